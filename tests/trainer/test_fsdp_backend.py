"""--train-backend fsdp against ddp: the same seed and batches train to the same weights.

Two real gloo ranks (spawned processes) train a ddp and an fsdp (FSDP2) policy side by side;
the loss and grad-norm curves, the weights and AdamW's moments agree within float
tolerance. The fsdp trainer's DCP checkpoint, saved at world size 2, resumes at world
size 1 with the same weights, optimizer state and log-probabilities.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.multiprocessing as mp
from fsdp_helpers import ddp_and_fsdp_rank

from slime_like.cluster.ports import free_port
from slime_like.errors import ConfigError
from slime_like.trainer.checkpoint import SHARDED_DIR, load_rank_state, load_sharded_rank_state
from slime_like.trainer.policy import PolicyTrainer

STEPS = 4


def test_fsdp_trains_like_ddp_and_its_checkpoint_resumes_at_another_world_size(
        tiny_model_dir, tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=ddp_and_fsdp_rank, args=(
        r, 2, ports, str(tiny_model_dir), STEPS, str(tmp_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = torch.load(io.BytesIO(out.get(timeout=300)), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    ddp, fsdp = got["curves"]["ddp"], got["curves"]["fsdp"]
    assert len(fsdp) == STEPS
    torch.testing.assert_close(torch.tensor(fsdp), torch.tensor(ddp), rtol=1e-4, atol=1e-5)
    states = got["states"]
    assert states["ddp"].keys() == states["fsdp"].keys() == states["resumed"].keys()
    assert any(":exp_avg" in k for k in states["fsdp"])  # the optimizer's moments compared too
    initial = PolicyTrainer(tiny_model_dir, seed=7).model.state_dict()
    moved = [k for k in initial if not torch.equal(initial[k], states["fsdp"][k])]
    assert moved, "training changed no weight"
    for key, value in states["ddp"].items():
        torch.testing.assert_close(states["fsdp"][key], value, rtol=1e-4, atol=1e-6, msg=key)
        torch.testing.assert_close(states["resumed"][key], states["fsdp"][key], rtol=0, atol=0,
                                   msg=key)
    assert len(list((tmp_path / SHARDED_DIR).glob("*.distcp"))) == 2  # one file per rank
    torch.testing.assert_close(got["logprobs"]["fsdp"], got["logprobs"]["ddp"], rtol=1e-4,
                               atol=1e-5)
    assert got["logprobs"]["resumed"] == got["logprobs"]["fsdp"]
    # A ddp trainer is told what the checkpoint is, not a missing-file traceback.
    plain = PolicyTrainer(tiny_model_dir)
    with pytest.raises(ConfigError, match="--train-backend fsdp"):
        load_rank_state(plain.model, plain.optimizer, 0, tmp_path)


def test_fsdp_refuses_a_ddp_checkpoint_naming_the_flag(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="--load.*--train-backend ddp"):
        load_sharded_rank_state(None, None, 0, tmp_path)

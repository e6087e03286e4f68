"""The agentic example as a real job on CPU: Ray, sglang-router, a reference engine, GRPO.

Two-turn calculator episodes (`examples/agentic/`) run token in / token out through the
router. The job's own check compares the engine's logprob of every model token, in every
turn, with the trainer's at the same weight version; the test checks that the tool's tokens
were kept out of the loss and out of that check, that each turn carries its weight version,
and that the model learns to call the tool (reward rises).
"""

from __future__ import annotations

import json

import pytest
import ray

from examples.agentic import calculator
from slime_like.config.parse import parse_args
from slime_like.models.tokenizer import ByteTokenizer
from slime_like.train import train
from tests.job import rl_plugins

TOK = ByteTokenizer()
STEPS, BATCH, N = 20, 4, 8


@pytest.fixture
def fresh_ray():
    yield
    if ray.is_initialized():
        ray.shutdown()


def _assert_environment_tokens_masked(s) -> None:
    """Output = turn 1 (ending in the call) + the tool's answer + turn 2, mask 1/0/1."""
    mask, out = s.loss_mask, s.output_ids
    assert len(mask) == len(out) == len(s.output_logprobs)
    if not s.meta["env_texts"]:  # answered without the tool: one turn, all the model's
        assert mask == [1] * len(out) and s.meta["model_turns"] == 1
        return
    call = out.index(TOK.encode(calculator.TOOL_CALL)[0])
    env = TOK.encode("".join(s.meta["env_texts"]))
    assert s.meta["env_texts"] == [f"{calculator.evaluate(s.prompt)}\n"]
    assert out[call + 1:call + 1 + len(env)] == env
    assert mask == [1] * (call + 1) + [0] * len(env) + [1] * (len(out) - call - 1 - len(env))
    assert all(s.output_logprobs[i] == 0.0 for i, m in enumerate(mask) if not m)
    # each model turn's weight-version span sits on its own tokens; the tool's lie between
    spans = s.meta["weight_versions"]
    assert [(sp["start"], sp["end"]) for sp in spans] == [(0, call + 1),
                                                          (call + 1 + len(env), len(out))]
    assert {sp["version"] for sp in spans} == {s.weight_version}


def test_agentic_job_masks_tool_tokens_checks_every_model_turn_and_learns_the_tool(
        tmp_path, fresh_ray):
    rl_plugins.AGENTIC.clear()
    args = parse_args(["--config", "examples/agentic/config.yaml", "--output-dir", str(tmp_path),
                       "--num-rollout", str(STEPS), "--custom-generate-function-path",
                       "tests.job.rl_plugins.recorded_calculator",
                       "--sglang-enable-deterministic-inference"])
    assert train(args) == 0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    samples = rl_plugins.AGENTIC
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert len(samples) == STEPS * BATCH * N

    for s in samples:
        _assert_environment_tokens_masked(s)
    per_step = [samples[i * BATCH * N:(i + 1) * BATCH * N] for i in range(STEPS)]
    for metrics, batch in zip(steps, per_step, strict=True):
        # the job compared exactly the model's tokens of every turn, and they agreed
        assert metrics["logprob_sample_mean_diff_max"] < 1e-4, metrics
        assert metrics["logprob_checked_tokens"] == sum(sum(s.loss_mask) for s in batch)
        assert metrics["env_tokens"] == sum(s.loss_mask.count(0) for s in batch)
        assert {s.weight_version for s in batch} == {str(metrics["weight_version"] - 1)}

    def called(batches) -> float:
        return sum(calculator.called_tool(s) for b in batches for s in b) / sum(map(len, batches))

    first = sum(s["reward_mean"] for s in steps[:4]) / 4
    last = sum(s["reward_mean"] for s in steps[-4:]) / 4
    assert last > first + 0.15, [round(s["reward_mean"], 3) for s in steps]
    assert called(per_step[-4:]) > called(per_step[:4]) + 0.2  # the model learned to call

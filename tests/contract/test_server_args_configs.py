"""Round trip for every config in configs/: the argv an engine actor would render ->
sglang 0.5.23's ServerArgs -> our view of the engine (sizes, ports, role, overrides) agrees.

The argv is made by the code that launches engines at run time: `engine_config` for each
placement, then `EngineServer.compose_args` with the ports its actor would have reserved. sglang itself is rendered as the program, whatever the config says.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from slime_like.config import parse_args
from slime_like.config.fleet_slices import engine_settings
from slime_like.engine.from_placement import engine_config
from slime_like.engine.launch import engine_view, render_argv
from slime_like.engine.server import EngineServer
from tests.contract.sglang_parse import register_argv

pytestmark = pytest.mark.sglang

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def _engines(config: Path):
    """(key, EngineServer, composed args, the group's overrides) for every engine actor of a config."""
    args = parse_args(["--config", str(config)])
    plan = args.nominal_plan
    out = []
    for i, p in enumerate(plan.engines):
        engine = EngineServer(engine_config(p, engine_settings(args), model_path=p.model_path or "tiny-model"))
        if p.nnodes > 1:
            engine.dist_init_addr = f"{p.dist_init_host}:{20000 + 50 * i}"
        port = 30000 + 10 * i
        composed = engine.compose_args(host=p.node_ip, port=port, nccl_port=port + 1,
                                       bootstrap_port=port + 2 if p.worker_type == "prefill" else None)
        out.append((f"{config.name}:{p.engine_id}:node{p.node_rank}", engine, composed, dict(p.overrides)))
    return out


ENGINES = [e for c in CONFIGS for e in _engines(c)]
for _key, _engine, _composed, _ in ENGINES:
    register_argv(_key, render_argv(_composed.args, "sglang")[3:])

# A config written for an older sglang: a renamed and a dropped field in a group's overrides.
_PD = next(e for k, e, *_ in ENGINES if k.startswith("pd.yaml"))
_OLD = EngineServer(dataclasses.replace(_PD.config, overrides={
    "cuda_graph_max_bs": 32, "prefill_round_robin_balance": True, "mem_fraction_static": 0.6}))
_OLD_COMPOSED = _OLD.compose_args(host="10.0.0.1", port=31000, nccl_port=31001,
                                  bootstrap_port=31002)
register_argv("old_config", render_argv(_OLD_COMPOSED.args, "sglang")[3:])


def test_every_shipped_config_is_round_tripped():
    assert CONFIGS, "no configs/*.yaml found"
    # every config that places engines of its own (external engines are someone else's)
    placing = {c.name for c in CONFIGS
               if parse_args(["--config", str(c)]).nominal_plan.engines}
    assert placing and {k.split(":")[0] for k, *_ in ENGINES} == placing
    assert "external_cpu.yaml" not in placing


@pytest.mark.parametrize("index", range(len(ENGINES)), ids=[e[0] for e in ENGINES])
def test_our_view_of_each_engine_survives_sglangs_parse(sglang_parsed, index):
    key, engine, composed, overrides = ENGINES[index]
    answer = sglang_parsed["results"][key]
    assert answer["ok"], f"sglang refused the argv of {key}: {answer['error']}"
    ours, theirs = engine_view(composed.args), engine_view(answer["args"])
    assert ours == theirs
    assert ours["worker_type"] == engine.config.worker_type
    assert ours["tp_size"] * ours["pp_size"] == engine.config.num_gpus_per_engine
    for name, value in overrides.items():  # the group's overrides reach sglang as written
        got = answer["args"][name]
        assert got == value or (isinstance(got, str) and json.loads(got) == value), name


def test_a_field_sglang_renamed_or_dropped_is_reported_by_name(sglang_parsed):
    assert _OLD_COMPOSED.dropped == ["cuda_graph_max_bs", "prefill_round_robin_balance"]
    (warning,) = [w for w in _OLD_COMPOSED.warnings if "dropped" in w]
    assert "cuda_graph_max_bs (from sglang[0].server_groups[0].overrides.cuda_graph_max_bs" in warning
    assert "cuda_graph_max_bs_decode" in warning and "prefill_round_robin_balance" in warning
    answer = sglang_parsed["results"]["old_config"]
    assert answer["ok"], answer.get("error")
    assert answer["args"]["mem_fraction_static"] == 0.6

"""The engine accepts any sglang 0.5.23 argv and refuses flags sglang does not know."""

from __future__ import annotations

import logging

import pytest

from slime_like.errors import ConfigError
from slime_like.reference_engine.args import parse_args


def test_sglang_aliases_and_abbreviations_parse_to_the_same_args():
    a = parse_args(["--model", "m", "--tensor-parallel-size", "2", "--context-length", "2k"])
    b = parse_args(["--model-path", "m", "--tp", "2", "--context-length", "2000"])
    assert a.tp_size == b.tp_size == 2 and a.context_length == b.context_length == 2000
    assert parse_args(["--model-path", "m", "--context-length", "2Ki"]).context_length == 2048


def test_unused_sglang_flags_are_accepted_with_one_warning_naming_them(caplog):
    with caplog.at_level(logging.WARNING):
        args = parse_args(["--model-path", "m", "--mem-fraction-static", "0.8", "--enable-tf32-matmul",
                           "--cuda-graph-bs-decode", "1", "2", "--tp-size", "1"])
    warnings = [r.getMessage() for r in caplog.records if "ignored sglang flags" in r.getMessage()]
    assert len(warnings) == 1
    assert "--mem-fraction-static" in warnings[0] and "--cuda-graph-bs-decode" in warnings[0]
    assert "--tp-size" not in warnings[0]
    assert args.all_args["mem_fraction_static"] == 0.8


def test_a_flag_sglang_does_not_know_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model-path", "m", "--no-such-sglang-flag"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --no-such-sglang-flag" in capsys.readouterr().err


def test_bad_choice_and_unsupported_layouts_are_clear_errors(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--load-format", "nonsense"])
    with pytest.raises(ConfigError, match="--load-format"):
        parse_args(["--model-path", "m", "--load-format", "gguf"])
    with pytest.raises(ConfigError, match="--dp-size"):
        parse_args(["--model-path", "m", "--dp-size", "2"])


def test_multi_node_flags_need_an_even_split_and_node_0s_address():
    with pytest.raises(ConfigError, match="--tp-size"):
        parse_args(["--model-path", "m", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:5000"])
    with pytest.raises(ConfigError, match="--dist-init-addr"):
        parse_args(["--model-path", "m", "--tp-size", "2", "--nnodes", "2"])
    with pytest.raises(ConfigError, match="--node-rank"):
        parse_args(["--model-path", "m", "--tp-size", "2", "--nnodes", "2", "--node-rank", "2",
                    "--dist-init-addr", "127.0.0.1:5000"])
    with pytest.raises(ConfigError, match="--dist-init-addr"):
        parse_args(["--model-path", "m", "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "nohost"])
    args = parse_args(["--model-path", "m", "--tp-size", "4", "--nnodes", "2", "--node-rank", "1",
                       "--dist-init-addr", "[::1]:5000"])
    assert list(args.node_ranks()) == [2, 3] and list(args.node_ranks(0)) == [0, 1]


def test_weight_update_gate_flag_defaults_to_strict():
    assert parse_args(["--model-path", "m"]).weight_update_gate == "strict"
    args = parse_args(["--model-path", "m", "--reference-weight-update-gate", "optional"])
    assert args.weight_update_gate == "optional"


def test_http_stack_flag_is_the_engines_own_and_checked(capsys, caplog):
    assert parse_args(["--model-path", "m"]).http_stack == "auto"
    with caplog.at_level("WARNING"):
        args = parse_args(["--model-path", "m", "--reference-http-stack", "asyncio"])
    assert args.http_stack == "asyncio"
    assert "reference_http_stack" not in args.all_args and not args.ignored_flags
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--reference-http-stack", "h2"])
    assert "--reference-http-stack: invalid choice: 'h2'" in capsys.readouterr().err


def test_the_engine_imports_neither_ray_nor_sglang():
    import subprocess
    import sys

    code = ("import sys, slime_like.reference_engine.server, slime_like.reference_engine.http_server, "
            "slime_like.reference_engine.engine, slime_like.protocol.tensor_payload; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'sglang', 'sglang_router')); "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr

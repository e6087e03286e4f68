"""sglang-router arguments: our defaults, `--router-*` pass-through, forced host and ports."""

from __future__ import annotations

import pytest

from slime_like.errors import ConfigError
from slime_like.router.args import compose_router_args, render_router_argv


def _compose(flags=None, pd=False):
    return compose_router_args(host="127.0.0.1", port=15000, prometheus_port=15001,
                               pd_disaggregation=pd, router_flags=flags)


def test_defaults_keep_the_router_health_checker_off_and_tune_balance_like_slime():
    args = _compose().args
    assert args["disable_health_check"] is True
    assert args["log_level"] == "warn"
    assert (args["balance_abs_threshold"], args["balance_rel_threshold"]) == (10, 1.2)
    assert "disable_circuit_breaker" not in args


def test_pd_mode_disables_the_circuit_breaker_and_sets_the_mode():
    args = _compose(pd=True).args
    assert args["pd_disaggregation"] is True and args["disable_circuit_breaker"] is True


def test_router_flags_pass_through_with_or_without_prefix():
    args = _compose({"router_policy": "round_robin", "retry-max-retries": 2,
                     "disable_health_check": False}).args
    assert args["policy"] == "round_robin"
    assert args["retry_max_retries"] == 2
    assert args["disable_health_check"] is False


def test_host_and_ports_cannot_be_moved_by_a_flag():
    with pytest.raises(ConfigError, match="--router-port"):
        _compose({"router_port": 1})


def test_bad_choice_names_the_flag():
    with pytest.raises(ConfigError, match="--router-policy"):
        _compose({"policy": "fastest"})


def test_unknown_router_flags_are_dropped_with_one_warning():
    out = _compose({"no_such_flag": 1, "nor_this": 2})
    assert out.dropped == ["no_such_flag", "nor_this"]
    assert len(out.warnings) == 1 and "no_such_flag, nor_this" in out.warnings[0]


def test_argv_runs_the_launcher_with_our_ports():
    argv = render_router_argv(_compose({"policy": "round_robin"}).args, python="py")
    assert argv[:3] == ["py", "-m", "slime_like.router.launch"]
    for pair in (["--host", "127.0.0.1"], ["--port", "15000"], ["--prometheus-port", "15001"],
                 ["--policy", "round_robin"]):
        i = argv.index(pair[0])
        assert argv[i:i + 2] == pair
    assert "--disable-health-check" in argv and "--pd-disaggregation" not in argv


def test_ipv6_bind_addresses_are_bracketed_as_the_router_requires():
    args = compose_router_args(host="::1", port=15000, prometheus_port=15001).args
    assert (args["host"], args["prometheus_host"]) == ("[::1]", "[::1]")


def test_smg_runs_from_its_own_module_with_its_own_flags_and_defaults():
    composed = compose_router_args(host="127.0.0.1", port=15000, prometheus_port=15001,
                                   router_flags={"policy": "least_load", "mini_lb": True},
                                   kind="smg")
    args = composed.args
    assert args["policy"] == "least_load"
    assert args["disable_tokenizer_autoload"] is True and args["disable_health_check"] is True
    assert args["disable_worker_overload_protection"] is True and args["load_monitor_interval"] == 1
    # sglang-router's own flag is not one of smg's: dropped, and the warning says by whom
    assert composed.dropped == ["mini_lb"] and "smg 1.13.0" in composed.warnings[0]
    argv = render_router_argv(args, python="py", kind="smg")
    assert argv[:3] == ["py", "-m", "smg.launch_router"]
    assert argv[argv.index("--policy") + 1] == "least_load"


def test_a_choice_only_the_other_router_has_names_the_flag():
    with pytest.raises(ConfigError, match="--router-policy"):
        _compose({"policy": "least_load"})  # sglang-router 0.3.2 has no least_load


def test_an_unknown_router_kind_names_the_flag():
    with pytest.raises(ConfigError, match=r"--router: 'nginx' is not one of"):
        compose_router_args(host="127.0.0.1", port=1, prometheus_port=2, kind="nginx")

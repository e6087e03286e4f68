"""The real console entry (`python -m slime_like.cli`): help, typos, --version, errors."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

from slime_like.observe.endpoints import MetricsEndpoint
from slime_like.observe.report import RunReport


def _cli(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slime_like.cli", *argv], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def test_help_lists_every_command_with_its_description():
    r = _cli("--help")
    assert r.returncode == 0, r.stderr
    assert "usage: slime-like [-h] [--version] COMMAND" in r.stdout
    for line in ("train ", "Run an RL job", "make-tiny-model", "Write a tiny HF-layout Llama",
                 "report ", "Re-render report.md", "fleet ", "Change a running job's fleet"):
        assert line in r.stdout


def test_a_mistyped_command_gets_a_suggestion_and_exit_2():
    r = _cli("trian", "--config", "x.yaml")
    assert r.returncode == 2
    assert r.stderr == "slime-like: error: unknown command 'trian'; did you mean 'train'?\n"
    r = _cli("zzz")
    assert r.returncode == 2
    assert r.stderr == ("slime-like: error: unknown command 'zzz' (commands: train, train-async, "
                        "make-tiny-model, report, fleet)\n")


def test_version_comes_from_the_package_metadata():
    r = _cli("--version")
    assert r.returncode == 0
    assert r.stdout == f"slime-like {version('slime_like')}\n"


def test_no_command_prints_help_and_exits_2():
    r = _cli()
    assert r.returncode == 2 and "commands:" in r.stderr


def test_train_flag_errors_are_one_line_without_traceback():
    r = _cli("train", "--config", "configs/quickstart.yaml", "--num-rollout", "zero")
    assert r.returncode == 2
    assert r.stderr == "slime-like train: error: --num-rollout: must be an integer, got 'zero'\n"
    r = _cli("train", "--config", "configs/quickstart.yaml", "--wandb-mod", "offline")
    assert r.returncode == 2
    assert r.stderr.startswith("slime-like train: error: --wandb-mod: unknown flag; did you mean")


def test_report_rerenders_a_run_folder(tmp_path):
    run = RunReport(tmp_path / "run", endpoints=[MetricsEndpoint("engine e0", "http://h:1/metrics")])
    run.log_step(0, {"reward_mean": 0.5})
    run.render()
    r = _cli("report", str(tmp_path / "run"), "--title", "again")
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "run" / "report.md").read_text()
    assert text.startswith("# again\n")
    assert "- engine e0: http://h:1/metrics" in text  # the endpoints were kept
    r = _cli("report", str(tmp_path))
    assert r.returncode == 2 and "not a run folder" in r.stderr

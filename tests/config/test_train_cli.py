"""`slime-like train`: errors are one line naming the flag, --dry-run prints the plan."""

from __future__ import annotations

from slime_like.train import main


def test_bad_flag_exits_2_with_the_flag_named(capsys):
    assert main(["--rollout-num-gpus", "x"]) == 2
    err = capsys.readouterr().err
    assert err == "slime-like train: error: --rollout-num-gpus: must be an integer, got 'x'\n"


def test_dry_run_prints_engines_with_nodes_and_gpus(capsys):
    argv = ["--hf-checkpoint", "m", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4",
            "--rollout-num-gpus-per-engine", "2", "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "placement group: 8 bundles" in out
    assert "default/g0/e1 node_rank 0/1: slot 6, node0 GPUs 6..7" in out

"""`slime-like train`: errors are one line naming the flag, --dry-run prints the plan."""

from __future__ import annotations

from slime_like.train import main


def test_bad_flag_exits_2_with_the_flag_named(capsys):
    assert main(["--rollout-num-gpus", "x"]) == 2
    err = capsys.readouterr().err
    assert err == "slime-like train: error: --rollout-num-gpus: must be an integer, got 'x'\n"


def test_dry_run_prints_engines_with_nodes_and_gpus(capsys, tiny_model_dir):
    argv = ["--hf-checkpoint", str(tiny_model_dir), "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4",
            "--rollout-num-gpus-per-engine", "2", "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "placement group: 8 bundles" in out
    assert "default/g0/e1 node_rank 0/1: slot 6, node0 GPUs 6..7" in out


BASE = ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--dry-run"]


def test_dry_run_rejects_a_checkpoint_that_cannot_be_loaded(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["--hf-checkpoint", str(tmp_path), *BASE]) == 2
    assert capsys.readouterr().err == (f"slime-like train: error: --hf-checkpoint: {tmp_path} is "
                                       "a directory without a config.json (not an HF "
                                       "checkpoint)\n")
    assert main(["--hf-checkpoint", "Qwen/Qwen3-4B", *BASE]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slime-like train: error: --hf-checkpoint: 'Qwen/Qwen3-4B' is not a "
                          "local directory and cannot be resolved on the Hugging Face hub")
    assert err.count("\n") == 1


def test_dry_run_rejects_missing_prompt_data_and_plugins(capsys, tmp_path):
    flags = ["--engine", "reference", *BASE]
    assert main([*flags, "--prompt-data", "no/such.jsonl"]) == 2
    assert capsys.readouterr().err == ("slime-like train: error: --prompt-data: no such file: "
                                       "no/such.jsonl\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1="}\n{"question": "2+2="}\n')
    assert main([*flags, "--prompt-data", str(bad)]) == 2
    assert capsys.readouterr().err == (f"slime-like train: error: --input-key: {bad}:2: no key "
                                       "'prompt' (keys: ['question'])\n")
    assert main([*flags, "--custom-rm-path", "examples.math_rl.reward.nope"]) == 2
    assert capsys.readouterr().err == ("slime-like train: error: --custom-rm-path: module "
                                       "'examples.math_rl.reward' has no attribute 'nope'\n")
    assert main([*flags, "--prompt-data", "examples/math_rl/train.jsonl", "--custom-rm-path",
                 "examples.math_rl.reward.reward_func", "--label-key", "label"]) == 0


def test_save_interval_needs_save(capsys):
    assert main(["--engine", "reference", "--save-interval", "2", *BASE]) == 2
    assert capsys.readouterr().err == ("slime-like train: error: --save-interval: needs --save "
                                       "(the directory to save into)\n")

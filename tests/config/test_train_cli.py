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
    # a hub id it cannot reach now: the plan is printed, with one warning saying what the job
    # will need (planning needs none of the checkpoint's files)
    assert main(["--hf-checkpoint", "Qwen/Qwen3-4B", *BASE]) == 0
    got = capsys.readouterr()
    assert got.err.startswith("slime-like train: warning: --hf-checkpoint: 'Qwen/Qwen3-4B' is not "
                              "in the local Hugging Face cache and the hub cannot be reached now")
    assert "huggingface-cli download Qwen/Qwen3-4B" in got.err and got.err.count("\n") == 1
    assert got.out.startswith("placement group: ")


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


def test_dry_run_of_a_shipped_gpu_config_plans_with_no_network_asking_the_hub_once(
        capsys, monkeypatch, tmp_path):
    """No network: every connection goes to a proxy that drops it. The dry run asks the hub
    once, gets no answer, says so in one line and prints the plan (no retries)."""
    import socket
    import threading

    from huggingface_hub import constants

    dropped: list[int] = []
    proxy = socket.socket()
    proxy.bind(("127.0.0.1", 0))
    proxy.listen(16)

    def drop_every_connection() -> None:
        while True:
            try:
                conn, _ = proxy.accept()
            except OSError:
                return
            dropped.append(1)
            conn.close()

    threading.Thread(target=drop_every_connection, daemon=True).start()
    url = f"http://127.0.0.1:{proxy.getsockname()[1]}"
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, url)
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    try:
        assert main(["--config", "configs/pd.yaml", "--dry-run"]) == 0
    finally:
        proxy.close()
    got = capsys.readouterr()
    assert got.err.startswith("slime-like train: warning: --hf-checkpoint: 'Qwen/Qwen3-4B' is not "
                              "in the local Hugging Face cache and the hub cannot be reached now")
    assert got.err.count("\n") == 1, got.err
    assert got.out.startswith("placement group: ") and "-m sglang.launch_server" in got.out
    assert dropped == [1]  # one request, no retry

"""Real RL jobs on CPU: a transformers checkpoint end to end, and kill + resume from --save.

Both run the math example (JSONL prompts, a rule-based reward plug-in) through real Ray,
sglang-router, reference engines and trainer; the job itself fails a step whose engine
log-probabilities differ from the trainer's, and the tests check it never did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray

from slime_like.config.parse import parse_args
from slime_like.train import train
from tests.job import rl_plugins
from tests.models.hf_helpers import write_hf_checkpoint

REPO = Path(__file__).resolve().parents[2]
MATH = ["--config", "examples/math_rl/config.yaml", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "2"]


@pytest.fixture(scope="module")
def fresh_ray():
    """One local Ray cluster for the module's in-process jobs (each starts its own fleet,
    trainer and placement group and stops them at its end)."""
    yield
    if ray.is_initialized():
        ray.shutdown()


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _assert_logprobs_held(steps: list[dict]) -> None:
    for s in steps:  # NaN (no sample at the trainer's version) would fail this too
        assert s["logprob_sample_mean_diff_max"] < 1e-4, s


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_transformers_checkpoint_trains_with_its_tokenizer_and_exact_logprobs(
        tmp_path, fresh_ray, arch):
    pytest.importorskip("transformers")
    ckpt = write_hf_checkpoint(tmp_path / arch, arch, tie=arch == "qwen3")
    rl_plugins.CALLS.clear()
    args = parse_args([*MATH, "--output-dir", str(tmp_path / "run"), "--num-rollout", "3",
                       "--hf-checkpoint", str(ckpt), "--apply-chat-template",
                       "--custom-generate-function-path", "tests.job.rl_plugins.router_generate"])
    assert train(args) == 0

    steps = _metrics(tmp_path / "run")
    assert [s["step"] for s in steps] == [0, 1, 2]
    _assert_logprobs_held(steps)
    # each step's samples came from the weights the trainer had just synced
    assert [s["sample_weight_versions"] for s in steps] == [[1], [2], [3]]
    # prompts went through the checkpoint's chat template, generation through the plug-in
    assert len(rl_plugins.CALLS) == 3 * 4 * 2
    assert all(c.startswith("<|user|>What is ") and c.endswith("\n<|assistant|>")
               for c in rl_plugins.CALLS)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_leftovers(procs: list[psutil.Process], grace: float = 30.0) -> list[str]:
    """Wait for the killed job's processes to go; SIGKILL the ones that stay (by pid)."""
    _, alive = psutil.wait_procs(procs, timeout=grace)
    names = []
    for p in alive:
        try:
            names.append(" ".join(p.cmdline()[:3]))
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    return names


def _job(out: Path, *flags: str) -> subprocess.Popen:
    """`python -m slime_like.train` as its own process: the job's driver (log: out.log)."""
    with open(out.with_suffix(".log"), "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-m", "slime_like.train", *MATH,
                                 "--output-dir", str(out), *flags], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_a_killed_job_resumes_after_its_last_checkpoint_serving_only_the_loaded_weights(
        tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _job(tmp_path / "first", "--num-rollout", "1000", "--save", str(ckpt),
                 "--save-interval", "2")
    tree: list[psutil.Process] = []
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and first.poll() is None:
            tree = _descendants(first.pid) or tree
            latest = ckpt / "latest_checkpointed_iteration.txt"
            if latest.is_file() and int(latest.read_text()) >= 3:
                break
            time.sleep(0.2)
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        tree = _descendants(first.pid) or tree
        first.send_signal(signal.SIGKILL)  # the driver dies mid-run, as on a node failure
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
        # What a dead driver leaves (Ray's own processes) goes at once; the engines' servers
        # die with their actors (parent-death signal) either way.
        _kill_leftovers(tree, grace=2.0)

    state = json.loads((ckpt / f"iter_{int((ckpt / 'latest_checkpointed_iteration.txt').read_text()):07d}"
                        / "job_state.json").read_text())
    k, version = state["step"], state["weight_version"]
    before = _metrics(tmp_path / "first")
    assert [s["step"] for s in before][: k + 1] == list(range(k + 1))
    assert before[k]["weight_version"] == version

    second = _job(tmp_path / "second", "--num-rollout", str(k + 4), "--load", str(ckpt),
                  "--save", str(ckpt), "--save-interval", "2")
    try:
        assert second.wait(300) == 0, (tmp_path / "second.log").read_text()[-3000:]
    finally:
        leftovers = _kill_leftovers(_descendants(second.pid), grace=0) if second.poll() is None \
            else []
        if second.poll() is None:
            second.kill()
    assert leftovers == []

    after = _metrics(tmp_path / "second")
    assert [s["step"] for s in after] == [k + 1, k + 2, k + 3]  # continues after the saved step
    _assert_logprobs_held(after)
    # the engines served the loaded weights, as the loaded version, before anything newer
    assert after[0]["sample_weight_versions"] == [version]
    assert all(min(s["sample_weight_versions"]) >= version for s in after)
    assert [s["weight_version"] for s in after] == [version + 1, version + 2, version + 3]
    events = [json.loads(line) for line in
              (tmp_path / "second" / "engine_timeline.jsonl").read_text().splitlines()]
    registered = [e for e in events if e["state"] == "REGISTERED"]
    assert {e["version"] for e in registered[:2]} == {str(version)}
    # and it saved on: the latest checkpoint is the last step of the resumed job
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == f"{k + 3}\n"

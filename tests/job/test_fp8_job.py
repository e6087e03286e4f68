"""The quickstart job with FP8 engines (`--sglang-quantization fp8`) end to end on CPU: real
Ray, router, two reference engines serving 128x128 FP8 blocks, the trainer quantizing at
every sync. The model spans several blocks in both dimensions of every quantized matrix."""

from __future__ import annotations

import json

import pytest
import ray

from slime_like.config.parse import parse_args
from slime_like.errors import ConfigError
from slime_like.train import train

STEPS = 3


@pytest.fixture
def fresh_ray():
    yield
    if ray.is_initialized():
        ray.shutdown()


def test_fp8_job_checks_every_token_against_the_quantized_trainer(tmp_path, fresh_ray):
    args = parse_args(["--config", "configs/quickstart.yaml", "--output-dir", str(tmp_path),
                       "--num-rollout", str(STEPS), "--sglang-quantization", "fp8",
                       "--tiny-model-hidden", "256", "--tiny-model-intermediate", "512",
                       "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                       "--rollout-max-response-len", "8"])
    assert train(args) == 0

    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(STEPS))
    for s in steps:
        # the engines' tokens scored by the weights they hold: the fp32 check's tolerance
        assert s["logprob_sample_mean_diff_max"] < 1e-4, s
        assert s["logprob_checked_tokens"] > 0
        # the same tokens under the trainer's own weights: FP8's error, which a check
        # against them would take for a bad sync at this tolerance
        assert s["fp8_tokens"] == s["logprob_checked_tokens"]
        assert 1e-4 < s["fp8_logprob_abs_diff_mean"] <= s["fp8_logprob_abs_diff_max"], s
        assert s["fp8_logprob_abs_diff_mean"] > 100 * s["logprob_sample_mean_diff_max"], s
        assert s["sync_quantize_s"] > 0
        assert 0.0 < s["fp8_tis_weight_mean"] <= s["fp8_tis_weight_max"]
        assert 0.0 <= s["fp8_tis_clip_frac"] <= 1.0
    assert steps[-1]["weight_version"] == STEPS + 1
    report = (tmp_path / "report.md").read_text()
    assert "FP8 rollout vs the trainer's unquantized weights" in report


def test_a_quantization_the_sync_cannot_make_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="--sglang-quantization.*'awq'"):
        parse_args(["--config", "configs/quickstart.yaml", "--sglang-quantization", "awq"])


def test_fp8_with_real_sglang_engines_is_refused_until_they_can_start_from_fp8():
    with pytest.raises(ConfigError, match="--sglang-quantization.*--engine sglang"):
        parse_args(["--config", "configs/quickstart.yaml", "--sglang-quantization", "fp8",
                    "--engine", "sglang", "--hf-checkpoint", "Qwen/Qwen3-0.6B"])

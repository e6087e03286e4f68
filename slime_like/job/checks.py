"""What the job checks on every step's samples before it trains on them: the rule and the
probe (`rollout/logprob_check.py`, `rollout/probe.py`) wired to the job's trainer, fleet
and flags."""

from __future__ import annotations

from slime_like.config.slices import JobSettings
from slime_like.fleet.fleet import Fleet
from slime_like.fleet.verify import serving_handles
from slime_like.protocol.modes import PauseMode
from slime_like.rollout.generate import Sample
from slime_like.rollout.logprob_check import LogprobCheck, LogprobMismatch, check_logprobs
from slime_like.rollout.probe import EngineProbe
from slime_like.rollout.quant_mismatch import quantization_mismatch
from slime_like.trainer.group import TrainerGroup

__all__ = ["LogprobCheck", "LogprobMismatch", "StepChecker", "check_logprobs", "weight_versions"]


def weight_versions(samples: list[Sample]) -> list[int | str]:
    """The distinct weight versions the samples' tokens were generated at (ints where
    they are)."""
    found = {v for s in samples for v in s.versions()}
    return sorted(int(v) for v in found) if all(v.isdigit() for v in found) else sorted(found)


class StepChecker:
    """The check as the job runs it each step: the engines answer the probe first (while
    colocated engines still hold their memory), then the trainer scores the probe and the
    samples and the rule decides."""

    def __init__(self, settings: JobSettings):
        self.settings = settings
        self.probe = EngineProbe(settings.logprob_probe_tokens)

    def ask_engines(self, fleet: Fleet, samples: list[Sample]) -> tuple | None:
        """Every serving engine of the updatable model scores the probe (chosen from the
        first samples checked); None when the probe is off."""
        if not self.probe.enabled:
            return None
        self.probe.choose(samples)
        return self.probe.ask_engines(serving_handles(fleet))

    def check(self, samples: list[Sample], trainer: TrainerGroup, version: int, step: int,
              answers: tuple | None) -> LogprobCheck:
        """The engines served the trainer's weights: every engine at the version it
        claims, every sample at its tokens' versions."""
        asynchrony = self.settings.asynchrony
        report = self.probe.judge(answers, trainer, version) if answers is not None else None
        return check_logprobs(samples, trainer, version, self.settings.logprob_check_tolerance,
                              self.settings.rollout.temperature,
                              staleness=asynchrony.max_staleness,
                              kv_kept=asynchrony.pause_mode == PauseMode.IN_PLACE,
                              fraction=asynchrony.check_fraction, seed=step, probe=report)

    def quantization_mismatch(self, samples: list[Sample], trainer: TrainerGroup) -> dict:
        """FP8 engines: each model token's log-probability under the trainer's own weights
        against the engines' (the TIS view of the gap, `rollout/quant_mismatch.py`); {}
        when the engines are not quantized. Every sample, at its tokens' versions."""
        if not self.settings.model.engine_quantization or not samples:
            return {}
        asynchrony, off_policy = self.settings.asynchrony, self.settings.off_policy
        rows = [(s.prompt_ids, s.output_ids, [(int(v), a, b) for v, a, b in s.spans()])
                for s in samples]
        own = trainer.span_logprobs(rows, self.settings.rollout.temperature,
                                    asynchrony.pause_mode == PauseMode.IN_PLACE, served=False)
        return quantization_mismatch([s.output_logprobs for s in samples], own,
                                     [s.model_token_mask() for s in samples],
                                     off_policy.tis_clip, off_policy.tis_clip_low)

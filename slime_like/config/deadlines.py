"""How long an engine may take to answer one call before it counts as hung.

One policy for every engine call that has a deadline: a weight sync's control calls and
bucket updates (`WeightSyncConfig.deadlines`: by default `SYNC_CALLS` for a sync the fleet
settles, `DeadlinePolicy()` for a standalone one) and the health monitor's probes
(`HealthSettings.deadlines`, default `DeadlinePolicy()`). A call type's deadline is

    max(floor_s, factor x the `quantile` of the last `window` answers of that call type)

over every engine of the fleet, never above the caller's own cap (the sync's HTTP
timeout, the probe's timeout); with fewer than `min_samples` answers so far there is no
basis yet, and the cap applies. The floor is absolute so that a fleet whose calls take a
millisecond does not call an engine hung after ten; the factor leaves room for an engine
that is slow for a moment, and grows the deadline on a loaded machine (until 100 answers
are in, the quantile of the window is its slowest answer). Both are far below the health
monitor's budget for a death (`--rollout-health-check-failures` probes of
`--rollout-health-check-timeout` each), which is what a hung engine cost every other
engine before.

Two floors, because a wrong verdict costs differently:
- A sync's call (`SYNC_CALLS`, 0.1 s). An engine found hung is only SUSPECT: out of the
  router and the sync, resynced in place when it answers again, relaunched only when the
  health monitor calls it dead. A wrong verdict costs one resync of one engine; a right
  one is paid by every engine of the step, which waits the deadline out. A control call
  takes a few milliseconds, so 10x its 0.99 quantile is usually below the floor and the
  floor is the deadline. The step after a SIGSTOP pays it, the failed attempt's clean-up
  and the retry: a 16-engine fleet's median step is 0.06-0.1 s, so the 0.2 s floor this
  had before alone broke the target of at most 3x the median step. Lower still would be
  within reach of a scheduling hiccup. A loaded machine answers slower, and its deadline
  grows with what its engines took (one 41 ms pause made it 0.41 s on a busy two-core
  machine), so the floor matters only where the answers are fast.
- A standalone sync's call (`DeadlinePolicy()`, 1 s): nothing holds its hung engine out
  and brings it back; the verdict fails the sync, the caller retries.
- A probe (`DeadlinePolicy()`, 1 s): a `/health_generate` past it makes a serving engine
  SUSPECT and resubmits every request it runs; a probe queues behind a running batch, so
  a low floor would move requests off busy, healthy engines.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime_like.errors import ConfigError


@dataclass(frozen=True)
class DeadlinePolicy:
    """A call type's deadline: max(floor_s, factor x quantile of its recent answers)."""

    floor_s: float = 1.0       # never less, whatever the answers took (a probe's floor)
    factor: float = 10.0       # times the quantile of recent answers
    quantile: float = 0.99     # of the last `window` answers of the call type
    window: int = 256          # answers kept per call type (across engines)
    min_samples: int = 4       # fewer answers than this: no deadline but the caller's cap

    def __post_init__(self) -> None:
        """The one check of a deadline policy (the sync's config and the fleet's both)."""
        def bad(name: str, expected: str) -> ConfigError:
            return ConfigError(f"deadlines.{name}", f"expected {expected}, "
                               f"got {getattr(self, name)!r}")

        if not float(self.floor_s) > 0:
            raise bad("floor_s", "a positive number of seconds")
        if not float(self.factor) >= 1:
            raise bad("factor", "a number >= 1")
        if not 0 < float(self.quantile) <= 1:
            raise bad("quantile", "a number in (0, 1]")
        if int(self.window) < 1:
            raise bad("window", "a positive number of answers")
        if not 1 <= int(self.min_samples) <= int(self.window):
            raise bad("min_samples", f"a number of answers between 1 and window ({self.window})")

    @classmethod
    def of(cls, value: DeadlinePolicy | dict | None) -> DeadlinePolicy:
        """A policy from itself, its fields as a dict (YAML, keyword settings), or None."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ConfigError("deadlines", f"unknown fields {sorted(unknown)}")
            return cls(**value)
        raise ConfigError("deadlines", f"expected a DeadlinePolicy or a dict, got {value!r}")


# A weight sync the fleet settles: a wrong "hung" costs one engine a resync (see above).
SYNC_CALLS = DeadlinePolicy(floor_s=0.1)

"""One exception hierarchy for the package: every error says what failed and where."""

from __future__ import annotations

import pickle


def _rebuild(cls: type, message: str, state: dict) -> SlimeLikeError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class SlimeLikeError(Exception):
    """Base of every error slime_like raises on purpose.

    Subclasses take their own constructor arguments, so pickling (Ray sends exceptions
    between processes) rebuilds from the message and attributes instead of re-calling
    `__init__`.
    """

    def __reduce__(self):
        return _rebuild, (type(self), str(self), dict(self.__dict__))


class ConfigError(SlimeLikeError, ValueError):
    """A flag or YAML field is wrong; `path` is its YAML path or flag name."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


class EngineError(SlimeLikeError):
    """An engine answered an HTTP call with an error, or did not answer in time."""

    def __init__(self, url: str, endpoint: str, status: int | None, body: str, *, reason: str = ""):
        self.url = url
        self.endpoint = endpoint
        self.status = status
        self.body = body
        self.reason = reason
        where = f"{url.rstrip('/')}{endpoint}"
        what = f"HTTP {status}" if status is not None else (reason or "no answer")
        text = body if len(body) <= 2000 else body[:2000] + "...[truncated]"
        super().__init__(f"engine {where}: {what}: {text}".rstrip(": "))


class LaunchError(SlimeLikeError):
    """A server process failed to start or exited; carries the tail of its log."""

    def __init__(self, message: str, log_tail: str = ""):
        self.log_tail = log_tail
        super().__init__(f"{message}\n--- log tail ---\n{log_tail}" if log_tail else message)


class RouterError(SlimeLikeError):
    """The sglang-router refused or did not finish a request."""


class WeightSyncError(SlimeLikeError, RuntimeError):
    """A weight update failed; names the engine and the step of the transaction.

    A `RuntimeError` too, as torchrl's SGLang weight sync raises: code written against the
    seed that catches `RuntimeError` catches ours."""

    def __init__(self, step: str, message: str, engine: str | None = None):
        self.step = step
        self.engine = engine
        self.detail = message
        self.paused: list[str] = []  # engines left paused for the caller (resume_on_failure off)
        self.unresponsive: list[str] = []  # engines that took no control call (a retry leaves them out)
        # engines whose call went past its deadline while others answered: hung, handed to
        # recovery by the fleet (a subset of `unresponsive`)
        self.hung: list[str] = []
        # engines that answered the sync's own ping after the failure (set by `WeightSync`):
        # a retry right after a hang need not ask them again (at 64 engines, a round of pings)
        self.answering: list[str] = []
        # no engine was sent an update (failed at the attach, pause or begin): every
        # engine still serves the weights it had
        self.untouched = False
        where = f" on engine {engine}" if engine else ""
        super().__init__(f"weight sync failed at step '{step}'{where}: {message}")


class WeightMetadataError(WeightSyncError, ValueError):
    """Parameter names, dtypes or shapes disagree with the receiver; no byte was sent.

    Also a `ValueError` (torchrl's meaning for a weight missing or changed before a sync)."""

    def __init__(self, message: str, engine: str | None = None):
        super().__init__("check_metadata", message, engine)


class UnsafePayloadError(SlimeLikeError, pickle.UnpicklingError):
    """A serialized weight payload names a global outside the allowlist, or is malformed."""

    def __init__(self, message: str, global_name: str | None = None):
        self.global_name = global_name
        super().__init__(message)


class FleetError(SlimeLikeError):
    """The fleet cannot do what was asked (no engines to sync, routing refused, ...)."""


class PlacementError(SlimeLikeError):
    """The placement group could not be created or probed (e.g. not enough GPUs in time)."""


class PluginError(SlimeLikeError):
    """A user plug-in (`--custom-rm-path`, ...) returned something the job cannot use."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"{flag}: {message}")

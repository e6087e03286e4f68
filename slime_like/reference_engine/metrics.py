"""Prometheus metrics under sglang's names, so dashboards and the router's /engine_metrics work.

With `--enable-metrics` off, `EngineMetrics.enabled` is False and every method is a no-op,
so callers never branch on the flag.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineMetrics:
    """The sglang:* series the reference engine can measure."""

    def __init__(self, enabled: bool, model_name: str):
        self.enabled = enabled
        self.registry = CollectorRegistry()
        if not enabled:
            return
        labels = ["model_name"]
        r = self.registry
        self._running = Gauge("sglang:num_running_reqs", "Running requests", labels, registry=r)
        self._queued = Gauge("sglang:num_queue_reqs", "Waiting requests", labels, registry=r)
        self._paused = Gauge("sglang:num_paused_reqs", "Requests held by a pause", labels, registry=r)
        self._token_usage = Gauge("sglang:token_usage", "Fraction of KV slots in use", labels, registry=r)
        self._throughput = Gauge("sglang:gen_throughput", "Decode tokens/s (last step)", labels, registry=r)
        self._prompt = Counter("sglang:prompt_tokens", "Prompt tokens", labels, registry=r)
        self._gen = Counter("sglang:generation_tokens", "Generated tokens", labels, registry=r)
        self._cached = Counter("sglang:cached_tokens", "Prompt tokens served from the prefix cache", labels, registry=r)
        self._requests = Counter("sglang:num_requests", "Finished requests", labels, registry=r)
        self._aborted = Counter("sglang:num_aborted_requests", "Aborted requests", labels, registry=r)
        self._retracted = Counter("sglang:num_retracted_requests", "Retractions", labels, registry=r)
        self._ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token", labels,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self._itl = Histogram("sglang:inter_token_latency_seconds", "Inter-token latency", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self._e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end latency", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self._weight_load = Histogram("sglang:weight_load_duration_seconds", "Weight update duration",
                                      labels, buckets=_LATENCY_BUCKETS, registry=r)
        self._label = {"model_name": model_name}

    def render(self) -> bytes:
        """Prometheus text exposition of every series."""
        return generate_latest(self.registry)

    def set_queue(self, running: int, waiting: int, paused: int, token_usage: float) -> None:
        """Queue gauges, updated once per scheduler loop."""
        if self.enabled:
            self._running.labels(**self._label).set(running)
            self._queued.labels(**self._label).set(waiting)
            self._paused.labels(**self._label).set(paused)
            self._token_usage.labels(**self._label).set(token_usage)

    def step(self, num_tokens: int, seconds: float) -> None:
        """One decode step of `num_tokens` tokens took `seconds`."""
        if self.enabled and seconds > 0:
            self._throughput.labels(**self._label).set(num_tokens / seconds)
            self._itl.labels(**self._label).observe(seconds)

    def first_token(self, seconds: float) -> None:
        """Time to first token of one request."""
        if self.enabled:
            self._ttft.labels(**self._label).observe(seconds)

    def finished(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                 latency: float, aborted: bool) -> None:
        """A request finished (or was aborted)."""
        if self.enabled:
            self._prompt.labels(**self._label).inc(prompt_tokens)
            self._gen.labels(**self._label).inc(completion_tokens)
            self._cached.labels(**self._label).inc(cached_tokens)
            self._requests.labels(**self._label).inc()
            self._e2e.labels(**self._label).observe(latency)
            if aborted:
                self._aborted.labels(**self._label).inc()

    def retracted(self, n: int) -> None:
        """Requests retracted by a pause."""
        if self.enabled and n:
            self._retracted.labels(**self._label).inc(n)

    def weight_load(self, seconds: float) -> None:
        """Duration of one weight update request."""
        if self.enabled:
            self._weight_load.labels(**self._label).observe(seconds)

"""Where the engines' and routers' Prometheus metrics are scraped from.

Engines are launched with `enable_metrics` and serve `/metrics` on their HTTP port; the
router serves its metrics on a separate Prometheus port. The fleet knows the URLs; this
turns them into the list an operator pastes into a scrape config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class MetricsEndpoint:
    """One scrape target: what it is (`engine default/g0/e0`, `router default`) and its URL."""

    name: str
    url: str

    def line(self) -> str:
        """`name: url`, as printed at start and listed in report.md."""
        return f"{self.name}: {self.url}"


def _metrics_url(base: str) -> str:
    base = base.rstrip("/")
    return base if base.endswith("/metrics") else base + "/metrics"


def metrics_endpoints(engine_urls: Mapping[str, str], router_urls: Mapping[str, str] | None = None,
                      job_url: str | None = None) -> list[MetricsEndpoint]:
    """The `/metrics` address of every engine, router and (if served) the job itself.

    `engine_urls` maps engine id to its HTTP URL; `router_urls` maps model name to the
    router's Prometheus URL (or its HTTP URL where both are one); `job_url` is the job's own
    endpoint (`--job-metrics-port`). Engines without a URL yet are left out.
    """
    out = []
    if job_url:
        out.append(MetricsEndpoint("job", _metrics_url(job_url)))
    for model, url in sorted((router_urls or {}).items()):
        if url:
            out.append(MetricsEndpoint(f"router {model}", _metrics_url(url)))
    for engine, url in sorted(engine_urls.items()):
        if url:
            out.append(MetricsEndpoint(f"engine {engine}", _metrics_url(url)))
    return out

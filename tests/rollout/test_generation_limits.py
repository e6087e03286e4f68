"""--sglang-server-concurrency and --rollout-request-timeout reach the rollout's requests.

A small HTTP server stands in for the router here: the point is what the rollout sends and
when (how many requests at once, when a silent one is sent again), which a real engine
would hide behind its own scheduling.
"""

from __future__ import annotations

import asyncio
import threading
import time

from aiohttp import web

from slime_like.cluster.ports import free_port
from slime_like.config.fleet_slices import fleet_settings
from slime_like.config.parse import parse_args
from slime_like.rollout.generate import RouterGenerator


class StandInRouter:
    """Answers /generate after `delay_s`; the first `hang` requests never get an answer."""

    def __init__(self, delay_s: float = 0.2, hang: int = 0):
        self.delay_s, self.hang = delay_s, hang
        self.inflight = self.max_inflight = self.seen = 0
        self.port = free_port()
        self._ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen += 1
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.seen <= self.hang:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.delay_s)
        finally:
            self.inflight -= 1
        n = body["sampling_params"].get("max_new_tokens", 1)
        return web.json_response({"output_ids": [5] * n, "meta_info": {
            "id": "x", "finish_reason": {"type": "length"}, "weight_version": "1",
            "weight_versions": [{"version": "1", "start": 0, "end": n}],
            "output_token_logprobs": [[-1.0, 5, None]] * n}})

    def _serve(self) -> None:
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        loop.run_forever()


def _router_settings(*flags: str):
    args = parse_args(["--config", "configs/quickstart.yaml", *flags])
    return fleet_settings(args, log_dir="logs"), args


def test_server_concurrency_caps_requests_in_flight():
    router = StandInRouter(delay_s=0.2)
    settings, args = _router_settings("--sglang-server-concurrency", "3")
    # the fleet's cap: the flag times the model's engines (one here)
    assert settings.engine.server_concurrency == 3
    gen = RouterGenerator(router.url, concurrency=settings.engine.server_concurrency * 1)
    samples = gen.generate([[1, 2]] * 4, 3, {"max_new_tokens": 2})
    assert len(samples) == 12 and router.max_inflight == 3


def test_a_request_unanswered_past_the_timeout_is_sent_again():
    router = StandInRouter(delay_s=0.0, hang=1)
    settings, _ = _router_settings("--rollout-request-timeout", "1")
    assert settings.router.request_timeout_s == 1.0
    gen = RouterGenerator(router.url, request_timeout_s=settings.router.request_timeout_s,
                          retry_backoff_s=0.05)
    t0 = time.monotonic()
    samples = gen.generate([[1, 2]], 1, {"max_new_tokens": 1})
    assert len(samples) == 1 and samples[0].attempts == 2
    assert 1.0 <= time.monotonic() - t0 < 5.0

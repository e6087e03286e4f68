"""A rollout waits (bounded) while no engine is routed, instead of failing its requests.

After a failed sync every engine may be out of the router for a moment (unrouted, then
resynced); the real sglang-router answers 503 `no_available_workers` meanwhile, smg 404
`model_not_found` ("No worker available"): both routers are run. The same
holds for scoring through a frozen reference model's router while its only engine is
being recovered (seen failing a CI run: the recovery took 10.7 s, scoring gave up at 7.5).
"""

from __future__ import annotations

import threading
import time

import pytest

from slime_like.rollout.generate import GenerationError, RouterGenerator
from slime_like.rollout.scoring import token_logprobs
from slime_like.router.kinds import ROUTER_KINDS
from slime_like.router.router import Router
from tests.reference_engine.conftest import start_engine, stop_engine

PARAMS = {"max_new_tokens": 3, "temperature": 1.0}


@pytest.fixture(scope="module", params=list(ROUTER_KINDS))
def any_router(request, tmp_path_factory):
    """A real router of each kind (round robin), one per kind for the module."""
    r = Router(host="127.0.0.1", router_flags={"policy": "round_robin"}, kind=request.param,
               log_dir=tmp_path_factory.mktemp(f"router-{request.param}"))
    r.start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    e = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine-logs"))
    yield e
    stop_engine(e)


def test_requests_wait_for_an_engine_to_be_routed_again(any_router, engine):
    router = any_router
    assert router.client.list_workers() == []
    # 3 attempts (about 2 s in all) would give up long before the engine is back (4 s)
    gen = RouterGenerator(router.url, max_attempts=3, retry_backoff_s=0.1, router_down_s=60.0)
    routing_at: list[float] = []

    def route_later() -> None:
        time.sleep(4.0)
        routing_at.append(time.monotonic())
        router.client.add_worker(engine.url)

    adder = threading.Thread(target=route_later, daemon=True)
    adder.start()
    try:
        samples = gen.generate([[1, 2, 3], [4, 5]], 2, PARAMS)
        done = time.monotonic()
    finally:
        adder.join(timeout=60)
        router.client.remove_worker(url=engine.url)
    assert len(samples) == 4 and all(len(s.output_ids) == 3 for s in samples)
    assert routing_at and done >= routing_at[0]  # answered only once an engine was back


def test_a_router_without_engines_fails_the_requests_after_the_bound(router):
    assert router.client.list_workers() == []
    gen = RouterGenerator(router.url, retry_backoff_s=0.2, router_down_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(GenerationError, match="no_available_workers"):
        gen.generate([[1, 2, 3]], 1, PARAMS)
    assert time.monotonic() - t0 < 30


def test_scoring_waits_for_an_engine_to_be_routed_again(router, engine):
    assert router.client.list_workers() == []
    routing_at: list[float] = []

    def route_later() -> None:
        time.sleep(10.0)  # longer than the retries alone last (about 7.5 s)
        routing_at.append(time.monotonic())
        router.client.add_worker(engine.url)

    adder = threading.Thread(target=route_later, daemon=True)
    adder.start()
    try:
        logprobs = token_logprobs(router.url, [([1, 2, 3], [4, 5]), ([6], [7, 8, 9])],
                                  router_down_s=60.0)
        done = time.monotonic()
    finally:
        adder.join(timeout=60)
        router.client.remove_worker(url=engine.url)
    assert [len(x) for x in logprobs] == [2, 3] and all(lp <= 0 for x in logprobs for lp in x)
    assert routing_at and done >= routing_at[0]

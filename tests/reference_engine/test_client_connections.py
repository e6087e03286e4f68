"""The engine client's keep-alive connections, against a real engine.

A weight sync's calls to one engine run one at a time, but each on whichever thread of the
shared engine pool is free: a client must reuse its connections across those threads (a
connection per thread went idle past the engine's keep-alive timeout between one thread's
calls, and about 20 calls of every 16-engine sync opened a new one). Overlapping calls each
get a connection of their own, and come back for the next calls.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from slime_like.engine.address import EngineAddress
from slime_like.engine.client import EngineClient
from slime_like.engine.keepalive import MAX_IDLE_CONNECTIONS
from slime_like.engine.session import EngineSession
from slime_like.protocol.modes import PauseMode


def test_one_call_at_a_time_from_many_threads_reuses_one_connection(resumed):
    client = EngineClient(resumed.url)
    with ThreadPoolExecutor(16) as pool:  # as the lanes run: the next call after the last
        for i in range(96):
            call = (client.ping, client.model_info, client.loads)[i % 3]
            pool.submit(call).result(timeout=30)
    assert client.connections_opened == 1


def test_a_sessions_pause_and_continue_on_pool_threads_share_the_connection(resumed):
    """Through the session's ordered lane, as a sync sends them."""
    session = EngineSession(EngineAddress(resumed.url))
    for _ in range(10):
        session.submit(lambda s: s.pause_generation(PauseMode.RETRACT), session)
        session.submit(lambda s: s.continue_generation(), session).result(timeout=30)
    assert session.http.connections_opened == 1
    assert not resumed.get("/v1/loads").json()["loads"][0]["paused"]


def test_overlapping_calls_each_get_a_connection_and_return_it(resumed):
    client = EngineClient(resumed.url)
    overlap = 6
    barrier = threading.Barrier(overlap)

    def ping_together() -> bool:
        barrier.wait(timeout=30)
        return client.ping()

    with ThreadPoolExecutor(overlap) as pool:
        assert all(pool.map(lambda _: ping_together(), range(overlap)))
    opened = client.connections_opened
    assert 1 < opened <= overlap
    for _ in range(20):  # the returned connections serve what follows: none is opened
        assert client.ping()
    assert client.connections_opened == opened
    assert len(client.kept._idle) <= MAX_IDLE_CONNECTIONS


def test_a_closed_client_opens_a_new_connection_for_its_next_call(resumed):
    client = EngineClient(resumed.url)
    assert client.ping()
    client.close()
    assert client.model_info()["weight_version"]
    assert client.connections_opened == 2

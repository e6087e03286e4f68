"""EngineServer (no Ray): ports that are taken, the port race, external engines, PD registration."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from slime_like.cluster.hosts import server_url
from slime_like.cluster.ports import PortReservation, reserve_ports
from slime_like.engine.external import ExternalEngine, expected_fields
from slime_like.engine.server import EngineConfig, EngineServer
from slime_like.errors import ConfigError, EngineError, LaunchError
from slime_like.reference_engine.step_floor import MIN_STEP_ENV
from slime_like.router.router import Router
from tests.engine.engine_helpers import wait_gone


@pytest.fixture
def engines():
    """Engines a test starts; every one is shut down at the end."""
    started: list[EngineServer] = []

    def track(engine: EngineServer) -> EngineServer:
        started.append(engine)
        return engine

    yield track
    for e in started:
        e.shutdown(grace=5)


@pytest.fixture(scope="module")
def shared_engine(tiny_model_dir, tmp_path_factory):
    """One reference engine for the tests that leave it as they found it.

    Its steps last at least 10 ms, so a long request is still running when a test pauses
    it: without a floor the tiny model can finish 900 tokens before a loaded machine
    delivers the pause.
    """
    engine = EngineServer(EngineConfig(model_path=str(tiny_model_dir), program="reference",
                                 host="127.0.0.1", log_dir=str(tmp_path_factory.mktemp("shared")),
                                 startup_timeout=120.0, env={MIN_STEP_ENV: "10"}))
    engine.init()
    yield engine
    engine.shutdown(grace=5)


# ---- no server needed ----------------------------------------------------------------------

def test_ipv6_node_ips_are_bracketed_in_urls():
    assert server_url("fd00::5", 30000) == "http://[fd00::5]:30000"
    assert server_url("10.0.0.5", 30000) == "http://10.0.0.5:30000"
    engine = EngineServer(EngineConfig(model_path="m", host="[fd00::5]"))
    engine.port = 31000
    assert engine.get_url() == "http://[fd00::5]:31000"


def test_nodes_other_than_node_0_have_no_handle():
    engine = EngineServer(EngineConfig(model_path="m", nnodes=2, node_rank=1, host="127.0.0.1"))
    engine.port = 1  # nothing listens there: any HTTP call would fail loudly
    assert engine.get_url() is None
    assert engine.handle() is None


def test_a_non_zero_node_needs_node_0s_dist_init_addr():
    engine = EngineServer(EngineConfig(model_path="m", nnodes=2, node_rank=1, host="127.0.0.1"))
    with pytest.raises(ConfigError, match="dist_init_addr"):
        engine.init()


def test_node_0_reserves_the_dist_init_block_on_its_own_node():
    engine = EngineServer(EngineConfig(model_path="m", nnodes=2, dp_size=2, host="127.0.0.1"))
    addr = engine.reserve_dist_init_addr()
    host, port = addr.rsplit(":", 1)
    try:
        assert host == "127.0.0.1"
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", int(port) + EngineServer.DIST_INIT_BLOCK + 1))  # last port of the block
    finally:
        engine.shutdown()


# ---- reference engines ---------------------------------------------------------------------

def test_taken_ports_do_not_break_launch(engines, reference_config):
    # Squat on every other port of a small range; the engine needs two free ones.
    with reserve_ports(1, consecutive=8) as block:
        start = block.ports[0]
    squatters = []
    try:
        for port in range(start, start + 8, 2):
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen()
            squatters.append(s)
        engine = engines(EngineServer(reference_config(port_range=(start, start + 8))))
        url = engine.init()
        assert engine.port not in range(start, start + 8, 2)
        assert engine.nccl_port not in range(start, start + 8, 2)
        assert url == f"http://127.0.0.1:{engine.port}"
        assert engine.handle().health_generate()
    finally:
        for s in squatters:
            s.close()


class _LosesTheRace(PortReservation):
    """Stand-in for a fault we cannot cause on demand: another process binds the server's
    port in the instant between our release and the server's own bind."""

    squatters: list[socket.socket] = []

    def release_for_server(self) -> None:
        super().release_for_server()
        s = socket.socket()
        s.bind(("127.0.0.1", self.ports[0]))
        s.listen()
        self.squatters.append(s)


def _racing_reserve(losses: int):
    calls = {"n": 0}

    def reserve(*args, **kwargs) -> PortReservation:
        real = reserve_ports(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] > losses:
            return real
        lost = _LosesTheRace([])
        lost._heads, lost._held = real._heads, real._held
        return lost
    return reserve, calls


def test_a_port_lost_before_the_server_binds_it_is_retried_with_new_ports(engines, reference_config):
    reserve, calls = _racing_reserve(losses=1)
    try:
        engine = engines(EngineServer(reference_config(), reserve=reserve))
        engine.init()
        taken = _LosesTheRace.squatters[0].getsockname()[1]
        assert calls["n"] == 2 and engine.port != taken
        assert engine.handle().health_generate()
        assert "address already in use" in engine.log_tail(50000).lower()
    finally:
        for s in _LosesTheRace.squatters:
            s.close()
        _LosesTheRace.squatters.clear()


def test_losing_the_port_race_every_time_is_a_bounded_launch_error(engines, reference_config):
    # With the retry shown above, one attempt allowed and lost is enough to show the bound.
    attempts = 1
    reserve, calls = _racing_reserve(losses=99)
    try:
        engine = engines(EngineServer(reference_config(port_attempts=attempts), reserve=reserve))
        with pytest.raises(LaunchError, match=f"every one of {attempts} attempts lost a port"):
            engine.init()
        assert calls["n"] == attempts and not engine.is_alive()
    finally:
        for s in _LosesTheRace.squatters:
            s.close()
        _LosesTheRace.squatters.clear()


def test_external_engine_attaches_when_its_server_info_matches(shared_engine, router):
    owned = shared_engine
    ext = ExternalEngine(f"127.0.0.1:{owned.port}",
                         expected=expected_fields(owned.server_args), worker_type="regular")
    assert ext.init() == owned.get_url()
    assert ext.sglang_version is not None
    handle = ext.handle()
    router.client.add_worker(handle.url, worker_type=handle.worker_type)
    assert router.client.find_worker(owned.get_url()).is_healthy
    assert handle.weight_version() == "default"
    router.client.remove_worker(url=handle.url)
    ext.shutdown()  # never kills
    assert owned.is_alive() and owned.handle().health_generate()
    with pytest.raises(LaunchError, match="never killed"):
        ext.simulate_crash()


def test_external_engine_that_does_not_match_is_refused_naming_each_field(shared_engine, router):
    owned = shared_engine
    ext = ExternalEngine(owned.get_url(), expected={"tp_size": 2, "model_path": "other/model",
                                                    "dp_size": 1}, worker_type="prefill")
    with pytest.raises(ConfigError) as e:
        ext.init()
    text = str(e.value)
    assert f"{owned.get_url()}/server_info" in text
    assert "tp_size: expected 2" in text and "model_path: expected 'other/model'" in text
    assert "worker_type: expected 'prefill'" in text and "dp_size" not in text
    assert router.client.find_worker(owned.get_url()) is None
    assert owned.is_alive()


def test_prefill_and_decode_engines_register_with_a_pd_router(engines, reference_config, tmp_path):
    with Router(host="127.0.0.1", pd_disaggregation=True, log_dir=tmp_path / "pd") as pd:
        prefill = engines(EngineServer(reference_config(worker_type="prefill", engine_rank=0)))
        decode = engines(EngineServer(reference_config(worker_type="decode", engine_rank=1)))
        for engine in (prefill, decode):
            engine.init()
            h = engine.handle()
            pd.client.add_worker(h.url, worker_type=h.worker_type, bootstrap_port=h.bootstrap_port)
        workers = {w.url: w for w in pd.client.list_workers()}
        assert workers[prefill.get_url()].worker_type == "prefill"
        assert workers[prefill.get_url()].bootstrap_port == prefill.bootstrap_port
        assert workers[decode.get_url()].worker_type == "decode"
        assert pd.client.wait_ready(timeout=30)["status"] == "ready"
        out = pd.client.generate({"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert "text" in out
        pids = [prefill.server_pid(), decode.server_pid()]
        for engine in (prefill, decode):
            pd.client.remove_worker(url=engine.get_url())
            engine.shutdown()
        assert pd.client.list_workers() == []
        assert wait_gone(pids) == []


def _generate_in_background(engine: EngineServer, max_new_tokens: int = 900):
    """Start one long generation; wait until the engine is running it."""
    result: dict = {}

    def run():
        result["out"] = engine.client.generate({
            "text": "a", "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True,
                                             "temperature": 0}}, timeout=120)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60  # a loaded CI machine can be slow to start it
    load: dict = {}
    while time.monotonic() < deadline:
        load = engine.client.loads()["loads"][0]
        if load["num_running_reqs"] + load["num_waiting_reqs"] > 0:
            return t, result
        time.sleep(0.02)
    raise AssertionError(f"the engine never picked up the request (its loads: {load}; the "
                         f"request's answer: {result.get('out')})")


def test_flush_cache_aborts_stuck_requests_when_nothing_would_be_lost(shared_engine):
    engine = shared_engine
    t, result = _generate_in_background(engine)
    # Frozen behind the handle's back (not through EngineSession.pause_generation): stuck
    # requests.
    engine.client.pause_generation("in_place")
    try:
        assert engine.handle().flush_cache(attempts=20, interval=0.2) is True
    finally:
        engine.client.continue_generation()
    t.join(60)
    assert result["out"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_flush_cache_never_aborts_requests_paused_in_place_and_gives_up_in_time(shared_engine):
    engine = shared_engine
    t, result = _generate_in_background(engine, max_new_tokens=300)
    handle = engine.handle()
    handle.pause_generation("in_place")
    try:
        with pytest.raises(EngineError, match=r"/flush_cache.*still busy after 3 attempts"):
            handle.flush_cache(attempts=3, interval=0.1)
    finally:
        handle.continue_generation()
    t.join(60)
    assert result["out"]["meta_info"]["finish_reason"]["type"] == "length"


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_ipv6_engine_registers_and_serves_through_an_ipv6_router(engines, reference_config, tmp_path):
    engine = engines(EngineServer(reference_config(host="::1")))
    assert engine.init() == f"http://[::1]:{engine.port}"
    with Router(host="::1", log_dir=tmp_path / "r6") as r6:
        assert r6.url.startswith("http://[::1]:")
        r6.client.add_worker(engine.get_url())
        assert r6.client.find_worker(engine.get_url()).is_healthy
        out = r6.client.generate({"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert "text" in out
        r6.client.remove_worker(url=engine.get_url())

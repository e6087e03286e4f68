"""A fault at each step of an update leaves no engine paused, inside an update session or in
a weight group, and the next update lands.

Two real reference engines with keys on (the default of the job), this process as the
trainer (gloo). Engine B is reached through a `FaultProxy` that, at one call of one step,
kills it (SIGKILL, real), hangs it (SIGSTOP, real) or answers 500 (the one fake: a real
engine cannot be made to fail a given call). The steps are the update's calls in order:
pause, begin, the first bucket, the last bucket (it carries the cache flush on sglang
0.5.23, so a fault at the flush is a fault there), end and continue. Engine A is asked
directly, with the admin key, what state it was left in.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import requests
from fault_proxy import FaultProxy
from weight_sync_helpers import start_engine, trainer_model

from slime_like.engine.address import EngineAddress
from slime_like.engine.session import EngineSession
from slime_like.errors import WeightSyncError
from slime_like.protocol.buckets import plan_buckets
from slime_like.weights import ModelWeights, WeightSync

USER, ADMIN = "user-key", "admin-key"
KEYS = ("--api-key", USER, "--admin-api-key", ADMIN)
BUCKET_BYTES = 1 << 16
GROUP_TIMEOUT_S = 15

STEPS = {  # step -> (endpoint, which call of it; None: the last bucket)
    "pause": ("/pause_generation", 1),
    "begin": ("/begin_weight_update", 1),
    "first bucket": ("/update_weights_from_distributed", 1),
    "last bucket, with the flush": ("/update_weights_from_distributed", None),
    "end": ("/end_weight_update", 1),
    "continue": ("/continue_generation", 1),
}


class Fleet:
    """Engine A (direct) and engine B (behind the fault proxy). A killed B is replaced by a
    spare started in the background while earlier cases ran: the engine's start-up is not
    on the test's path."""

    def __init__(self, model_dir, log_dir):
        self.model_dir, self.log_dir = model_dir, log_dir
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="spare-engine")
        self.a = start_engine(model_dir, log_dir, 1, *KEYS)
        self.b = start_engine(model_dir, log_dir, 1, *KEYS)
        self.proxy = FaultProxy(self.b.url, self.b.process)
        self.spare = self._start_spare()

    def _start_spare(self) -> Future:
        return self._starter.submit(start_engine, self.model_dir, self.log_dir, 1, *KEYS)

    def relaunch_b(self) -> None:
        self.b.process.terminate(grace=5)
        self.b = self.spare.result()
        self.spare = self._start_spare()
        self.proxy.retarget(self.b.url, self.b.process)

    def sessions(self) -> list[EngineSession]:
        return [session(url) for url in (self.a.url, self.proxy.url)]

    def close(self) -> None:
        self.proxy.close()
        for e in (self.a, self.b):
            e.process.terminate(grace=5)
        self._starter.shutdown(wait=True)
        self.spare.result().process.terminate(grace=5)


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    f = Fleet(tiny_model_dir, tmp_path_factory.mktemp("undo-engines"))
    yield f
    f.close()


def _admin(url: str, endpoint: str, body: dict | None = None) -> requests.Response:
    return requests.post(url + endpoint, json=body or {}, timeout=30,
                         headers={"Authorization": f"Bearer {ADMIN}"})


def assert_left_clean(url: str, groups: list[str], keep: str | None = None,
                      within_s: float = 0.0) -> None:
    """Not paused (within `within_s`), no update session open, in no group this test's
    trainer made (but `keep`)."""
    deadline = time.monotonic() + within_s
    while True:
        loads = requests.get(url + "/v1/loads", timeout=30,
                             headers={"Authorization": f"Bearer {USER}"}).json()["loads"]
        if not any(x["paused"] for x in loads) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not any(x["paused"] for x in loads), (url, "left paused")
    r = _admin(url, "/end_weight_update")
    assert r.status_code == 400 and "no weight-update session is open" in r.text, (url, r.text)
    for name in groups:
        if name != keep:
            r = _admin(url, "/destroy_weights_update_group", {"group_name": name})
            assert r.status_code == 400 and "does not exist" in r.text, (url, name, r.text)


def assert_serves(url: str, version: str) -> None:
    """The engine reports `version` as the weights it serves."""
    got = requests.get(url + "/model_info", timeout=30,
                       headers={"Authorization": f"Bearer {USER}"}).json()
    assert got["weight_version"] == version, (url, got)


def session(url: str) -> EngineSession:
    """A session with this module's keys (the engines run with keys on)."""
    return EngineSession(EngineAddress(url, api_key=USER, admin_api_key=ADMIN))


def b_back_takes_the_next_update(sync: WeightSync, fleet: Fleet, model_dir, version: str
                                 ) -> None:
    """B, hung and left out, continued and added back: the next update lands on both."""
    fleet.b.process.kill(signal.SIGCONT)
    sync.add_engine(session(fleet.proxy.url))
    sync.update(trainer_model(model_dir, seed=14), version)
    for url in (fleet.a.url, fleet.b.url):
        assert_serves(url, version)


@contextlib.contextmanager
def syncing(fleet: Fleet, http_timeout_s: float = 3, **settings) -> Iterator[WeightSync]:
    """A WeightSync over engines A and B; afterwards, whatever the case did: the proxy
    disarmed, B never left hung for the next case, the sync closed, both engines clean."""
    sync = WeightSync(fleet.sessions(), update_weight_buffer_size=BUCKET_BYTES,
                      http_timeout_s=http_timeout_s, group_timeout_s=GROUP_TIMEOUT_S,
                      liveness_timeout_s=1, **settings)
    try:
        yield sync
    finally:
        fleet.proxy.disarm()
        fleet.b.process.kill(signal.SIGCONT)
        sync.close()
    for url in (fleet.a.url, fleet.b.url):
        assert_left_clean(url, fleet.proxy.groups)


CASES = [(step, fault) for step in STEPS for fault in ("500", "kill", "hang")]


@pytest.mark.parametrize(("step", "fault"), CASES, ids=[f"{s}-{f}" for s, f in CASES])
def test_a_fault_at_each_step_is_undone_and_the_next_update_lands(fleet, tiny_model_dir,
                                                                   step, fault):
    endpoint, n = STEPS[step]
    policy = trainer_model(tiny_model_dir, seed=11)
    if n is None:
        n = len(plan_buckets(ModelWeights(policy).metadata(), BUCKET_BYTES))
    with syncing(fleet) as sync:
        sync.update(policy, "1")  # forms the group: the faults land in a running fleet
        fleet.proxy.arm(endpoint, n, fault)
        retried = step == "continue" and fault == "500"  # continue is idempotent: retried once
        if retried:
            sync.update(trainer_model(tiny_model_dir, seed=12), "2")
        else:
            with pytest.raises(WeightSyncError) as failure:
                sync.update(trainer_model(tiny_model_dir, seed=12), "2")
            assert failure.value.engine == fleet.proxy.url, failure.value  # names engine B
        assert fleet.proxy.fired.is_set()
        if fault == "hang":  # the hang ends, as a long GC pause or a flapping NIC's does
            fleet.b.process.kill(signal.SIGCONT)
        if fault == "kill":
            fleet.relaunch_b()
        # The healthy engine: serving, no session, out of every group (the continue step
        # failed after the update landed: its group is still the current one). After a hang
        # it may take until the hung peer lets go of the collective: gloo cannot abort one.
        current = sync.transport.group_name if step == "continue" else None
        assert_left_clean(fleet.a.url, fleet.proxy.groups, keep=current,
                          within_s=GROUP_TIMEOUT_S if fault == "hang" else 0.0)
        for url in sync.take_dropped():
            sync.add_engine(session(url))
        final = trainer_model(tiny_model_dir, seed=13)
        sync.update(final, "3")
        for url in (fleet.a.url, fleet.b.url):
            assert_serves(url, "3")
            assert_left_clean(url, fleet.proxy.groups, keep=sync.transport.group_name)


def test_an_engine_hung_at_its_pause_is_left_out_at_the_deadline_not_the_timeout(
        fleet, tiny_model_dir):
    """With answers to go by (two updates), a pause that engine B never answers (SIGSTOP,
    real) is cut at the pause's deadline, not the 60 s HTTP timeout: the sync fails naming
    B as hung without waiting for it, leaves engine A clean, and the next update lands on A
    alone. Continued and added back, B takes the update after that."""
    with syncing(fleet, http_timeout_s=60) as sync:
        for version in ("1", "2"):  # every call type answered twice by each engine
            sync.update(trainer_model(tiny_model_dir, seed=11), version)
        fleet.proxy.arm("/pause_generation", 1, "hang")
        with pytest.raises(WeightSyncError) as failure:
            sync.update(trainer_model(tiny_model_dir, seed=12), "3")
        err = failure.value
        assert err.hung == [fleet.proxy.url] and err.engine == fleet.proxy.url, err
        assert err.step == "pause_generation" and "deadline" in str(err), err
        assert err.answering == [fleet.a.url], err.answering  # asked after the failure
        assert sync.take_dropped() == [fleet.proxy.url]
        assert_left_clean(fleet.a.url, fleet.proxy.groups)
        sync.update(trainer_model(tiny_model_dir, seed=13), "4")  # A alone, B still hung
        assert sync.last_report.engines == [fleet.a.url]
        b_back_takes_the_next_update(sync, fleet, tiny_model_dir, "5")


@pytest.mark.parametrize("step", ["pause", "begin"])
def test_the_fleets_sync_leaves_an_engine_hung_before_any_update_behind_and_lands(
        fleet, tiny_model_dir, step):
    """The fleet's sync (`resume_on_failure=False`: it settles failures itself) finds B
    hung at its pause or begin (SIGSTOP, real) before any update went out: it does not
    fail, it drops B, rebuilds the group without it and lands on A in the same update,
    naming B in `report.hung`. A is left serving the new version in the new group only;
    continued and added back, B takes the next update."""
    endpoint, n = STEPS[step]
    with syncing(fleet, http_timeout_s=60, resume_on_failure=False) as sync:
        for version in ("1", "2"):  # every call type answered twice by each engine
            sync.update(trainer_model(tiny_model_dir, seed=11), version)
        first_group = sync.transport.group_name
        fleet.proxy.arm(endpoint, n, "hang")
        report = sync.update(trainer_model(tiny_model_dir, seed=12), "3")
        assert fleet.proxy.fired.is_set()
        assert list(report.hung) == [fleet.proxy.url], report.hung
        assert f"'{STEPS[step][0][1:]}'" in report.hung[fleet.proxy.url], report.hung
        assert report.engines == [fleet.a.url] and report.as_dict()["hung"] == report.hung
        assert sync.take_dropped() == [fleet.proxy.url]
        assert_serves(fleet.a.url, "3")
        assert sync.transport.group_name != first_group  # A left the group B was in
        assert_left_clean(fleet.a.url, fleet.proxy.groups, keep=sync.transport.group_name)
        b_back_takes_the_next_update(sync, fleet, tiny_model_dir, "4")


def test_a_regroup_after_an_engine_left_does_not_ask_the_others_models_again(
        fleet, tiny_model_dir):
    """An engine leaving the sync (dropped as hung, drained) makes the next update regroup;
    the engines already checked against the same metadata are not asked for their models
    again (`/model_info` has no deadline of its call type: a stopped engine would hold the
    attach until it died), while an engine that comes back is checked again."""
    with syncing(fleet) as sync:
        sync.update(trainer_model(tiny_model_dir, seed=11), "1")
        fleet.proxy.calls.clear()
        sync.remove_engine(fleet.a.url)
        sync.update(trainer_model(tiny_model_dir, seed=12), "2")  # B alone, in a new group
        assert fleet.proxy.calls["/model_info"] == 0, fleet.proxy.calls
        assert sync.last_report.engines == [fleet.proxy.url]
        sync.remove_engine(fleet.proxy.url)
        sync.add_engine(session(fleet.a.url))
        sync.update(trainer_model(tiny_model_dir, seed=13), "3")  # A alone
        sync.add_engine(session(fleet.proxy.url))
        sync.update(trainer_model(tiny_model_dir, seed=14), "4")  # B is back: checked again
        assert fleet.proxy.calls["/model_info"] >= 1, fleet.proxy.calls
        for url in (fleet.a.url, fleet.b.url):
            assert_serves(url, "4")


def test_an_engine_slow_to_answer_the_ping_after_a_failure_is_undone_not_dropped(
        fleet, tiny_model_dir):
    """After a failed sync every engine is pinged (`liveness_timeout_s`, 1 s here). Engine B,
    paused by the sync, answers that ping late (the proxy holds it 1.8 s: a loaded host)
    but within the second, longer ping: it is continued and kept, not dropped paused."""
    with syncing(fleet) as sync:
        sync.update(trainer_model(tiny_model_dir, seed=11), "1")
        fleet.proxy.arm("/begin_weight_update", 1, "500")
        fleet.proxy.slow("/ping", 1.8)
        with pytest.raises(WeightSyncError) as failure:
            sync.update(trainer_model(tiny_model_dir, seed=12), "2")
        assert failure.value.engine == fleet.proxy.url, failure.value
        assert "/ping" not in fleet.proxy.delays  # the slow ping was the one after the fault
        assert sync.take_dropped() == []
        for url in (fleet.a.url, fleet.b.url):
            assert_left_clean(url, fleet.proxy.groups, keep=sync.transport.group_name)
        sync.update(trainer_model(tiny_model_dir, seed=13), "3")  # both still members
        assert sync.last_report.engines == [fleet.a.url, fleet.proxy.url]
        for url in (fleet.a.url, fleet.b.url):
            assert_serves(url, "3")

"""A weight group that fails leaves no engine stuck in it.

Forming: engine B is still inside another group's rendezvous (as after an earlier failed
attempt whose store stayed open), so it never joins; engine A joins and waits for B. When
the trainer gives up, it must close the group's store: otherwise A waits out its own
rendezvous timeout (600 s here, longer in sglang) and answers no other control call, so
every later attempt to sync it fails too.

Broadcasting: gloo relays a broadcast along a tree, so an engine may be waiting on another
engine rather than on the trainer. When an engine dies mid-broadcast, every engine whose
receive failed must leave the group, or the engines below it wait out the group timeout
with their scheduler blocked (found by the chaos long form).
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
from weight_sync_helpers import model_checksum, start_engine, trainer_model

from slime_like.errors import WeightSyncError
from slime_like.protocol.weight_group import host_store
from slime_like.weights import WeightSync
from slime_like.weights.packing import ModelWeights


def test_a_group_that_cannot_form_releases_the_engines_that_joined(tiny_model_dir, tmp_path):
    a = start_engine(tiny_model_dir, tmp_path, 1)
    b = start_engine(tiny_model_dir, tmp_path, 1, "--soft-watchdog-timeout", "2")
    policy = trainer_model(tiny_model_dir, seed=7)
    sync = WeightSync([(a.url, 1), (b.url, 1)], http_timeout_s=30, group_timeout_s=3)
    # B's scheduler waits in a rendezvous nobody else joins, for as long as this store lives
    held = {"store": host_store(3, 600.0, host="127.0.0.1")}
    stuck = threading.Thread(target=b.post, daemon=True, args=("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": held["store"].port, "rank_offset": 1,
        "world_size": 3, "group_name": "never_formed", "backend": "gloo"}), kwargs={"timeout": 700})
    stuck.start()
    time.sleep(1.0)
    try:
        with pytest.raises(WeightSyncError, match="init_weights_update_group") as failed:
            sync.update(policy)
        # the error names B, the engine that never took its join (a retry leaves it out)
        assert failed.value.engine == b.url and failed.value.unresponsive == [b.url]
        # A's scheduler is free again: a call it runs there answers at once, although the
        # error (and its traceback) is still held here.
        t0 = time.monotonic()
        r = a.post("/weights_checker", {}, timeout=20)
        assert r.status_code == 200 and time.monotonic() - t0 < 10
        assert failed.value is not None
        # B's stuck scheduler is visible in its log, with the call that holds it
        b_log = (tmp_path / f"engine-{b.url.rsplit(':', 1)[1]}.log").read_text()
        assert "scheduler busy for" in b_log and "in init_group" in b_log, b_log[-2000:]
        # and A can join the next group (B left out)
        sync.close()
        alone = WeightSync([(a.url, 1)], http_timeout_s=30, group_timeout_s=10)
        try:
            alone.update(policy)
            assert a.weight_version() == "1"
        finally:
            alone.close()
    finally:
        held.clear()  # B's old rendezvous fails, and so does its queued join of ours
        gc.collect()
        stuck.join(timeout=30)
        sync.close()
        for e in (a, b):
            e.process.terminate(grace=10)


def test_an_engine_dying_at_its_join_frees_the_engines_already_in_the_rendezvous(
        tiny_model_dir, tmp_path):
    # Found by the fully-async chaos short form on a loaded machine: B is killed just as the
    # trainer asks it to join (its call fails at once), while A already waits in the
    # group's rendezvous. The trainer gives up at once; A must not wait out the rendezvous
    # (group_timeout_s here, 300 s by default): until A's join answers, every later sync of
    # A fails with "an earlier join is still unanswered".
    a = start_engine(tiny_model_dir, tmp_path, 1)
    b = start_engine(tiny_model_dir, tmp_path, 1)
    sync = WeightSync([(a.url, 1), (b.url, 1)], http_timeout_s=30, group_timeout_s=120)
    b_handle = next(e for e in sync.engines if e.url == b.url)
    join = b_handle.join_steps

    def crash_then_join(*args, **kwargs):  # a real SIGKILL, timed by this hook
        b.process.kill()
        b.process.wait_exit(30)
        return (yield from join(*args, **kwargs))

    b_handle.join_steps = crash_then_join
    policy = trainer_model(tiny_model_dir, seed=5)
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="init_weights_update_group"):
            sync.update(policy)
        assert time.monotonic() - t0 < 60
        # A's scheduler is free again within seconds, not after the 120 s rendezvous
        r = a.post("/weights_checker", {}, timeout=30)
        assert r.status_code == 200
        assert time.monotonic() - t0 < 30, f"A answered {time.monotonic() - t0:.0f}s after"
        # and the next sync, without B, lands on A
        sync.close()
        alone = WeightSync([(a.url, 1)], http_timeout_s=30, group_timeout_s=30)
        try:
            alone.update(policy)
            assert a.rank_checksums() == [model_checksum(policy)]
        finally:
            alone.close()
    finally:
        sync.close()
        for e in (a, b):
            e.process.terminate(grace=10)


class KillAfter(ModelWeights):
    """The trainer's weights; SIGKILLs `victim` once `n` tensors went out (a real crash)."""

    def __init__(self, model, n: int, victim):
        super().__init__(model)
        self.n, self.victim = n, victim

    def tensors(self):
        for i, item in enumerate(super().tensors()):
            if i == self.n:
                self.victim.process.kill()
                self.victim.process.wait_exit(30)
            yield item


def test_an_engine_dying_mid_broadcast_leaves_no_other_engine_waiting_in_the_group(
        tiny_model_dir, tmp_path):
    # ranks: trainer 0, A 1, B 2, C 3; with four ranks gloo relays A -> C
    a, b, c = (start_engine(tiny_model_dir, tmp_path, 1) for _ in range(3))
    sync = WeightSync([(e.url, 1) for e in (a, b, c)], update_weight_buffer_size=16 << 10,
                      http_timeout_s=60, group_timeout_s=60)
    try:
        sync.update(trainer_model(tiny_model_dir, seed=11))
        with pytest.raises(WeightSyncError):
            sync.update(KillAfter(trainer_model(tiny_model_dir, seed=12), 6, b))
        # every survivor's scheduler is free at once (not after the 600 s group timeout)
        for e in (a, c):
            t0 = time.monotonic()
            r = e.post("/weights_checker", {"action": "checksum"}, timeout=30)
            assert r.status_code == 200, (e.url, r.text)
            assert time.monotonic() - t0 < 10, f"{e.url} answered after {time.monotonic() - t0:.0f}s"
        # and the next sync, over the survivors, lands everywhere
        sync.close()
        model = trainer_model(tiny_model_dir, seed=13)
        survivors = WeightSync([(e.url, 1) for e in (a, c)], update_weight_buffer_size=16 << 10,
                               http_timeout_s=60, group_timeout_s=20)
        try:
            survivors.update(model)
        finally:
            survivors.close()
        for e in (a, c):
            assert e.rank_checksums() == [model_checksum(model)]
    finally:
        sync.close()
        for e in (a, b, c):
            e.process.terminate(grace=10)

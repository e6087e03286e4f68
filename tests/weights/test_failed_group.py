"""A weight group that cannot form leaves no engine stuck in its rendezvous.

Engine B is still inside another group's rendezvous (as after an earlier failed attempt
whose store stayed open), so it never joins; engine A joins and waits for B. When the
trainer gives up, it must close the group's store: otherwise A waits out its own
rendezvous timeout (600 s here, longer in sglang) and answers no other control call, so
every later attempt to sync it fails too.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
from weight_sync_helpers import start_engine, trainer_model

from slime_like.errors import WeightSyncError
from slime_like.protocol.weight_group import host_store
from slime_like.weights import WeightSync


def test_a_group_that_cannot_form_releases_the_engines_that_joined(tiny_model_dir, tmp_path):
    a = start_engine(tiny_model_dir, tmp_path, 1)
    b = start_engine(tiny_model_dir, tmp_path, 1)
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
        # A's scheduler is free again: a call it runs there answers at once, although the
        # error (and its traceback) is still held here.
        t0 = time.monotonic()
        r = a.post("/weights_checker", {}, timeout=20)
        assert r.status_code == 200 and time.monotonic() - t0 < 10
        assert failed.value is not None
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

"""Engines destroy the weight groups they leave, with API keys on (the default).

`/destroy_weights_update_group` is an admin route: a teardown that rebuilt its engine handles
from their URLs lost the keys, every destroy got 401 (suppressed), and each group outlived
its regroup (on GPUs, an NCCL communicator left alive per replacement, membership change or
resync). Asked afterwards with the admin key, every left group must be gone: 400 "does not
exist", as sglang answers too.
"""

from __future__ import annotations

import threading
import weakref

import requests
from weight_sync_helpers import start_engine, trainer_model

from slime_like.engine.address import EngineAddress
from slime_like.engine.session import EngineSession
from slime_like.weights import WeightSync

USER, ADMIN = "user-key", "admin-key"


def _left_group_is_gone(url: str, name: str) -> None:
    r = requests.post(f"{url}/destroy_weights_update_group", json={"group_name": name},
                      headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert r.status_code == 400 and "does not exist" in r.text, (name, r.status_code, r.text)


def test_a_regroup_and_a_close_destroy_every_left_group_on_keyed_engines(tiny_model_dir,
                                                                         tmp_path):
    keys = ("--api-key", USER, "--admin-api-key", ADMIN)
    a = start_engine(tiny_model_dir, tmp_path, 1, *keys)
    b = start_engine(tiny_model_dir, tmp_path, 1, *keys)
    policy = trainer_model(tiny_model_dir, seed=3)
    handle = lambda e: EngineSession(EngineAddress(e.url, api_key=USER, admin_api_key=ADMIN))  # noqa: E731
    sync = WeightSync([handle(a)], http_timeout_s=30, group_timeout_s=30)
    try:
        sync.update(policy)
        first = sync.transport.group_name
        first_pg = weakref.ref(sync.transport.pg)  # the trainer's end of it
        sync.add_engine(handle(b))  # a membership change: the next update regroups
        sync.update(policy)
        second = sync.transport.group_name
        assert first and second and first != second
        _left_group_is_gone(a.url, first)
        sync.close()
        for engine in (a, b):
            _left_group_is_gone(engine.url, second)
        # The trainer's ends are freed too (a replaced group on a thread of its own, which
        # the close waits for): no group object and no freeing thread outlives the close.
        assert first_pg() is None
        assert not [t for t in threading.enumerate() if t.name == "weight-group-free"]
        assert requests.get(f"{a.url}/model_info", timeout=30).status_code == 401  # keys on
    finally:
        sync.close()
        for e in (a, b):
            e.process.terminate(grace=10)

"""torchrl's SGLang weight-sync API, used as a torchrl user uses it with only the import
changed (`torchrl.weight_update.llm` -> `slime_like.weights`), into real reference engines
over a real gloo group.

What torchrl's own tests of that module check holds here too: the scheme keeps its
arguments, derives `world_size` and picks a free `master_port`; it makes a rank-0
transport, a sender and no receiver; transport devices are CUDA ordinals; a flush needs the
abort pause mode (`ValueError`); the environment overrides the flush; updates before the
group or without a model, and a group formed off rank 0, are `RuntimeError`s; the metadata
is {name: (dtype, shape)}.
"""

from __future__ import annotations

import copy
import itertools
import socket

import pytest
import torch
from fault_proxy import FaultProxy
from weight_sync_helpers import model_checksum, trainer_model

from slime_like.cluster.ports import free_port
from slime_like.weights import (
    SGLangCollectiveTransport,
    SGLangWeightSender,
    SGLangWeightSyncScheme,
    get_model_metadata,
    get_sglang_model_metadata,
)

PAUSE_ENV = "TORCHRL_SGLANG_PAUSE_GENERATION_MODE"
FLUSH_ENV = "TORCHRL_SGLANG_WEIGHT_SYNC_FLUSH_CACHE"
URL = "http://localhost:30000"  # constructing anything never calls the server
BUCKET = 64 << 10  # several buckets for the tiny model
_seeds = itertools.count(3400)


class Collector:
    """What torchrl's collectors expose to a weight sender."""

    def __init__(self):
        self.version = 0

    def increment_version(self):
        self.version += 1


@pytest.fixture(autouse=True)
def torchrl_environment_unset(monkeypatch):
    monkeypatch.delenv(PAUSE_ENV, raising=False)
    monkeypatch.delenv(FLUSH_ENV, raising=False)


def _transport(**kwargs) -> SGLangCollectiveTransport:
    return SGLangCollectiveTransport(server_url=URL, master_address="localhost",
                                     master_port=29500, rank=kwargs.pop("rank", 0),
                                     world_size=2, **kwargs)


# ---- the scheme, its transport, sender and receiver (no server) ----------------------------------

def test_scheme_keeps_every_argument_and_derives_the_world_size():
    scheme = SGLangWeightSyncScheme(server_url=URL + "/", master_address="localhost",
                                    master_port=29500, num_gpus=1, strategy="state_dict",
                                    device=0, flush_cache_on_update=False, pause_mode="in_place")
    assert scheme.server_url == URL
    assert (scheme.master_address, scheme.master_port) == ("localhost", 29500)
    assert (scheme.num_gpus, scheme.world_size, scheme.strategy_name) == (1, 2, "state_dict")
    assert (scheme.device, scheme.flush_cache_on_update, scheme.pause_mode) == (0, False, "in_place")
    default = SGLangWeightSyncScheme(URL)
    assert (default.strategy_name, default.pause_mode, default.flush_cache_on_update) == (
        "tensordict", None, None)


def test_scheme_picks_a_free_master_port_and_an_address_the_server_reaches():
    scheme = SGLangWeightSyncScheme(server_url=URL, num_gpus=2)
    assert 0 < scheme.master_port <= 55535
    assert scheme.world_size == 3
    assert scheme.master_address == "127.0.0.1"  # the server is local
    with socket.socket() as s:  # free: the weight group's store can listen on it
        s.bind(("0.0.0.0", scheme.master_port))


def test_scheme_makes_a_rank_zero_transport_a_sender_and_no_receiver():
    scheme = SGLangWeightSyncScheme(URL, num_gpus=1, flush_cache_on_update=False)
    transport = scheme.create_transport()
    assert isinstance(transport, SGLangCollectiveTransport)
    assert (transport.server_url, transport.rank, transport.world_size) == (URL, 0, 2)
    assert (transport.master_address, transport.master_port) == (scheme.master_address,
                                                                 scheme.master_port)
    assert transport.flush_cache_on_update is False and transport.pause_mode is None
    assert transport.check_connection() is False
    assert scheme.create_transport(timeout=5.0).timeout == 5.0
    aborting = SGLangWeightSyncScheme(URL, flush_cache_on_update=True, pause_mode="abort")
    transport = aborting.create_transport()
    assert (transport.flush_cache_on_update, transport.pause_mode) == (True, "abort")
    assert isinstance(scheme.create_sender(), SGLangWeightSender)
    assert scheme.create_receiver() is None


def test_transport_devices_are_cuda_ordinals():
    assert _transport(device=0).device == 0
    assert _transport(device="cuda:1").device == 1
    assert _transport(device=torch.device("cuda:2")).device == 2
    assert _transport(device=None).device == 0


# ---- settings: the flush rule and torchrl's environment variables ---------------------------------

def test_bad_settings_are_value_errors_naming_the_setting(monkeypatch):
    with pytest.raises(ValueError, match="pause_mode='abort'"):
        SGLangWeightSyncScheme(URL, flush_cache_on_update=True, pause_mode="retract")
    with pytest.raises(ValueError, match="pause_mode='abort'"):
        _transport(flush_cache_on_update=True, pause_mode="retract")
    with pytest.raises(ValueError, match="pause_mode='abort'"):  # the default mode is retract
        _transport(flush_cache_on_update=True)
    with pytest.raises(ValueError, match="strategy"):
        SGLangWeightSyncScheme(URL, strategy="pickle")
    with pytest.raises(ValueError, match="pause_mode"):
        SGLangWeightSyncScheme(URL, pause_mode="stop")
    monkeypatch.setenv(PAUSE_ENV, "abort")  # the environment's abort allows the flush
    assert _transport(flush_cache_on_update=True).resolved_flush_cache is True
    monkeypatch.setenv(PAUSE_ENV, "stop")
    with pytest.raises(ValueError, match=PAUSE_ENV):
        _transport()
    monkeypatch.delenv(PAUSE_ENV)
    monkeypatch.setenv(FLUSH_ENV, "sometimes")
    with pytest.raises(ValueError, match=FLUSH_ENV):
        _ = _transport().resolved_flush_cache


def test_the_environment_sets_the_pause_mode_and_overrides_the_flush(monkeypatch):
    assert _transport().resolved_pause_mode == "retract"  # torchrl's default
    monkeypatch.setenv(PAUSE_ENV, "abort")
    assert _transport().resolved_pause_mode == "abort"
    assert _transport(pause_mode="in_place").resolved_pause_mode == "in_place"  # argument wins
    assert _transport().resolved_flush_cache is True
    monkeypatch.setenv(FLUSH_ENV, "0")
    assert _transport(flush_cache_on_update=True).resolved_flush_cache is False
    monkeypatch.setenv(FLUSH_ENV, "1")
    assert _transport(flush_cache_on_update=False).resolved_flush_cache is True


# ---- errors before any byte moves -------------------------------------------------------------------

def test_misuse_before_the_group_is_a_runtime_error(tiny_model_dir):
    sender = SGLangWeightSyncScheme(URL).create_sender()
    sender.register_model(trainer_model(tiny_model_dir, seed=next(_seeds)))
    with pytest.raises(RuntimeError, match="Transport not initialized"):
        sender.update_weights()
    with pytest.raises(RuntimeError, match="Communication group not initialized"):
        _transport().send_weights("model", {"param": torch.zeros(10)})
    with pytest.raises(RuntimeError, match="Only rank 0"):
        _transport(rank=1).init_all_workers_group({})
    with pytest.raises(TypeError, match="increment_version"):
        sender.register_collector(object())


def test_a_server_that_does_not_answer_fails_the_group_as_a_runtime_error(tiny_model_dir):
    policy = trainer_model(tiny_model_dir, seed=next(_seeds))
    url = f"http://127.0.0.1:{free_port()}"
    sender = SGLangWeightSyncScheme(url).create_sender()
    with pytest.raises(RuntimeError, match=f"{url}/server_info: connection failed"):
        sender.init_all_workers_group(get_sglang_model_metadata(policy))
    assert sender.transport is None  # nothing half formed is kept


# ---- metadata ---------------------------------------------------------------------------------------

def test_metadata_is_name_to_dtype_and_shape(tiny_model_dir):
    policy = trainer_model(tiny_model_dir, seed=next(_seeds))
    metadata = get_sglang_model_metadata(policy)
    assert metadata == get_model_metadata(policy)
    assert metadata == {n: (p.dtype, p.shape) for n, p in policy.hf_state_dict().items()}
    assert all(isinstance(d, torch.dtype) and isinstance(s, torch.Size)
               for d, s in metadata.values())


# ---- into real engines ---------------------------------------------------------------------------------

def test_a_torchrl_loop_syncs_the_server_and_bumps_its_collectors(engines, tiny_model_dir):
    engine = engines[0]
    policy = trainer_model(tiny_model_dir, seed=next(_seeds))
    scheme = SGLangWeightSyncScheme(engine.url, num_gpus=1, device=0,
                                    update_weight_buffer_size=BUCKET)
    sender = scheme.create_sender()
    collector = Collector()
    try:
        sender.register_collector(collector)
        sender.init_all_workers_group(get_sglang_model_metadata(policy))
        assert sender.transport.check_connection()
        with pytest.raises(RuntimeError, match="No model registered"):
            sender.update_weights()
        sender.register_model(policy)
        sender.update_weights()
        assert engine.rank_checksums() == [model_checksum(policy)]
        assert collector.version == 1
        # A state dict: the registered names are sent, other keys ignored (as torchrl does).
        newer = trainer_model(tiny_model_dir, seed=next(_seeds))
        state = {**newer.hf_state_dict(), "rotary.inv_freq": torch.ones(4)}
        sender.update_weights(state)
        assert engine.rank_checksums() == [model_checksum(newer)]
        assert collector.version == 2
        # A weight missing or changed is bad input: a ValueError naming it; nothing is sent,
        # the server keeps serving what it had, no collector moves.
        name = next(iter(state))
        with pytest.raises(ValueError, match=name):
            sender.update_weights({k: v for k, v in state.items() if k != name})
        with pytest.raises(ValueError, match=name):
            sender.update_weights({**state, name: state[name].double()})
        assert engine.rank_checksums() == [model_checksum(newer)]
        assert engine.get("/ready").status_code == 200  # not left paused
        assert collector.version == 2
        # A metadata the server's model does not have is refused when the group forms.
        wrong = {**get_sglang_model_metadata(policy), name: (torch.float32, torch.Size([3]))}
        with pytest.raises(RuntimeError, match=name):
            sender.init_all_workers_group(wrong)
    finally:
        sender.shutdown()


def test_a_failed_update_is_a_runtime_error_and_the_next_update_lands(engines, tiny_model_dir):
    engine = engines[0]
    # The server answers its pause with a 500 once: a fault a real engine cannot be made to
    # give on demand, so the relay fakes that one answer (and relays every other call).
    proxy = FaultProxy(engine.url, engine.process)
    policy = trainer_model(tiny_model_dir, seed=next(_seeds))
    sender = SGLangWeightSyncScheme(proxy.url, update_weight_buffer_size=BUCKET).create_sender()
    collector = Collector()
    try:
        sender.register_model(policy)
        sender.register_collector(collector)
        sender.init_all_workers_group(get_sglang_model_metadata(policy))
        proxy.arm("/pause_generation", 1, "500")
        with pytest.raises(RuntimeError, match="pause"):
            sender.update_weights()
        assert collector.version == 0  # no version for weights that did not land
        assert engine.get("/ready").status_code == 200  # serving, not left paused
        sender.update_weights()  # torchrl's retry: the same call again
        assert engine.rank_checksums() == [model_checksum(policy)]
        assert collector.version == 1
    finally:
        sender.shutdown()
        proxy.close()


def test_a_transport_used_alone_sends_named_weights_and_leaves_its_group(engines,
                                                                         tiny_model_dir):
    engine = engines[0]
    policy = trainer_model(tiny_model_dir, seed=next(_seeds))
    scheme = SGLangWeightSyncScheme(engine.url, update_weight_buffer_size=BUCKET)
    transport = scheme.create_transport()
    try:
        transport.init_all_workers_group(get_sglang_model_metadata(policy))
        assert transport.check_connection() is True
        transport.send_weights("policy", policy.hf_state_dict())
        assert engine.rank_checksums() == [model_checksum(policy)]
    finally:
        transport.shutdown()
    assert transport.check_connection() is False
    with pytest.raises(RuntimeError, match="Communication group not initialized"):
        transport.send_weights("policy", policy.hf_state_dict())


def test_the_torchrl_environment_drives_a_tp2_server_between_updates(engines, tiny_model_dir,
                                                                      monkeypatch):
    engine = engines[1]  # TP=2: a group of world_size 3
    policy = trainer_model(tiny_model_dir, seed=next(_seeds))
    monkeypatch.setenv(PAUSE_ENV, "abort")
    sender = SGLangWeightSyncScheme(engine.url, num_gpus=2,
                                    update_weight_buffer_size=BUCKET).create_sender()
    try:
        sender.register_model(policy)
        sender.init_all_workers_group(get_model_metadata(policy))
        report = sender.update_weights()
        assert (report.pause_mode, report.flush) == ("abort", {engine.url: "flushed"})
        monkeypatch.setenv(FLUSH_ENV, "0")  # read at the next update, as torchrl does
        report = sender.update_weights()
        assert report.pause_mode == "abort" and report.flush[engine.url].startswith("skipped")
        monkeypatch.setenv(PAUSE_ENV, "in_place")
        with torch.no_grad():
            next(policy.parameters()).add_(1.0)  # a training step
        report = sender.update_weights()
        assert report.pause_mode == "in_place"
        assert engine.rank_checksums() == [model_checksum(policy)] * 2
    finally:
        sender.shutdown()


def test_a_lora_model_is_sent_merged_and_the_adapter_keeps_training(engines, tiny_model_dir):
    peft = pytest.importorskip("peft")
    engine = engines[0]
    base = trainer_model(tiny_model_dir, seed=next(_seeds))
    base_metadata = get_sglang_model_metadata(base)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8,
                                                      target_modules=["q_proj", "v_proj"]))
    assert get_sglang_model_metadata(lora) == base_metadata  # base names, as the server loads
    sender = SGLangWeightSyncScheme(engine.url, update_weight_buffer_size=BUCKET).create_sender()
    try:
        sender.register_model(lora)
        sender.init_all_workers_group(get_sglang_model_metadata(lora))
        for _ in range(2):
            with torch.no_grad():  # a step of the adapter (peft starts B at zero)
                for name, p in lora.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.05)
            sender.update_weights()
            merged = copy.deepcopy(lora).merge_and_unload()
            assert engine.rank_checksums() == [model_checksum(merged)]
        assert any("lora_A" in n for n, _ in lora.named_parameters())  # still an adapter
    finally:
        sender.shutdown()

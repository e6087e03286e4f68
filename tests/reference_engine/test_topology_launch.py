"""The project's own launcher (`engine.server.EngineServer`) starts PD pairs and multi-node engines
of the reference program, and the project's `Router` routes them: the argv, ports and
handles the job will use work as they are (no Ray here; the job adds the actors).
"""

from __future__ import annotations

import requests

from slime_like.engine.server import EngineConfig, EngineServer
from slime_like.models.loading import init_dummy_weights, load_pretrained
from slime_like.models.tokenizer import ByteTokenizer
from slime_like.router.router import Router
from slime_like.weights import WeightSync

TOK = ByteTokenizer()


def _config(model_dir, log_dir, **kw) -> EngineConfig:
    return EngineConfig(model_path=str(model_dir), program="reference", log_dir=str(log_dir),
                        startup_timeout=180, **kw)


def test_a_two_node_engine_from_the_projects_launcher(tiny_model_dir, tmp_path):
    node0 = EngineServer(_config(tiny_model_dir, tmp_path, num_gpus_per_engine=2, nnodes=2, node_rank=0,
                           host="127.0.0.1"))
    node1 = EngineServer(_config(tiny_model_dir, tmp_path, num_gpus_per_engine=2, nnodes=2, node_rank=1,
                           host="127.0.0.2"))
    try:
        addr = node0.reserve_dist_init_addr()  # node 0's actor first, the others get the address
        assert node1.init(addr) is None  # no HTTP on node 1; returns once started
        url = node0.init(addr)  # healthy only once node 1's rank joined
        handle = node0.handle()
        assert handle is not None and handle.url == url and handle.tp_size == 2
        model = load_pretrained(tiny_model_dir)
        init_dummy_weights(model, seed=99)
        sync = WeightSync([handle], update_weight_buffer_size=64 << 10, http_timeout_s=60,
                          group_timeout_s=60)
        try:
            sync.update(model, weight_version="v1")
        finally:
            sync.close()
        ranks = requests.post(url + "/weights_checker", json={"action": "checksum"}, timeout=30).json()["ranks"]
        assert len(ranks) == 2 and ranks[0]["per_gpu_checksum"] == ranks[1]["per_gpu_checksum"]
        assert requests.get(url + "/model_info", timeout=30).json()["weight_version"] == "v1"
        node1.simulate_crash()
        code = node0.wait_exit(timeout=20)
        assert code is not None and code != 0, node0.log_tail()
    finally:
        node1.shutdown()
        node0.shutdown()


def test_a_pd_pair_from_the_projects_launcher_behind_its_pd_router(tiny_model_dir, tmp_path):
    prefill = EngineServer(_config(tiny_model_dir, tmp_path, worker_type="prefill", host="127.0.0.1",
                             name="prefill"))
    decode = EngineServer(_config(tiny_model_dir, tmp_path, worker_type="decode", host="127.0.0.1",
                            name="decode"))
    router = Router(host="127.0.0.1", pd_disaggregation=True, router_flags={"policy": "round_robin"},
                    log_dir=tmp_path)
    try:
        prefill.init()
        decode.init()
        router.start()
        for engine in (prefill, decode):
            h = engine.handle()
            router.client.add_worker(h.url, worker_type=h.worker_type, bootstrap_port=h.bootstrap_port)
        router.client.wait_ready(timeout=30)
        out = router.client.generate({"input_ids": TOK.encode("launched by the project"),
                                      "sampling_params": {"max_new_tokens": 5, "temperature": 0},
                                      "return_logprob": True})
        assert len(out["output_ids"]) == 5 and len(out["meta_info"]["output_token_logprobs"]) == 5
    finally:
        router.stop()
        decode.shutdown()
        prefill.shutdown()

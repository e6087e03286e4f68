"""Helpers of the weight-sync tests: reference-engine processes, trainer-side checks."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import requests
import torch

from slime_like.cluster.ports import free_port
from slime_like.cluster.process import ServerProcess
from slime_like.models.loading import init_dummy_weights, load_pretrained
from slime_like.models.transformer import CausalLM, hf_named_parameters
from slime_like.protocol.checksums import overall_checksum, tensor_checksum
from tests.own_port import listens_on, lost_its_port


@dataclass
class Engine:
    """A running reference engine."""

    url: str
    tp_size: int
    process: ServerProcess

    def post(self, endpoint: str, body: dict | None = None, timeout: float = 60) -> requests.Response:
        return requests.post(self.url + endpoint, json={} if body is None else body, timeout=timeout)

    def get(self, endpoint: str, timeout: float = 30) -> requests.Response:
        return requests.get(self.url + endpoint, timeout=timeout)

    def rank_checksums(self) -> list[str]:
        """per_gpu_checksum of every TP rank (sha256 over name + per-tensor hash)."""
        body = self.post("/weights_checker", {"action": "checksum"}).json()
        assert body["success"], body
        return [r["per_gpu_checksum"] for r in body["ranks"]]

    def greedy(self, input_ids: list[int], n: int) -> list[int]:
        body = self.post("/generate", {"input_ids": input_ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": n, "ignore_eos": True}}).json()
        return body["output_ids"]

    def weight_version(self) -> str:
        return self.get("/model_info").json()["weight_version"]


def start_engine(model_dir: Path, log_dir: Path, tp_size: int = 1, *extra: str) -> Engine:
    """A reference engine healthy on a free port (started again on another port when a
    process bound its port first)."""
    for attempt in range(3):
        port = free_port()
        argv = [sys.executable, "-m", "slime_like.reference_engine", "--model-path",
                str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                "--tp-size", str(tp_size), *extra]
        proc = ServerProcess(argv, log_path=log_dir / f"engine-{port}.log", name=f"engine:{port}")
        proc.start()
        engine = Engine(f"http://127.0.0.1:{port}", tp_size, proc)

        def healthy(engine: Engine = engine, port: int = port) -> bool:
            try:
                answered = requests.get(engine.url + "/health", timeout=5).status_code == 200
            except requests.RequestException:
                return False
            return answered and listens_on(engine.process.pid, port)  # not another's server

        try:
            proc.wait_healthy(healthy, timeout=120)
            return engine
        except BaseException:
            proc.terminate(grace=5)
            if attempt == 2 or not lost_its_port(proc.log_tail()):
                raise
    raise AssertionError("unreachable")


def trainer_model(model_dir: Path, seed: int) -> CausalLM:
    """The tiny model with fresh random weights: what a training step would produce."""
    model = load_pretrained(model_dir)
    init_dummy_weights(model, seed=seed)
    return model


def model_checksum(model: torch.nn.Module) -> str:
    """The engine's per-rank checksum, computed on the trainer's tensors."""
    return overall_checksum({n: tensor_checksum(p) for n, p in hf_named_parameters(model)})


@torch.no_grad()
def greedy_continuation(model: CausalLM, input_ids: list[int], n: int) -> list[int]:
    """The trainer model's own greedy continuation (full forward per token)."""
    ids = list(input_ids)
    for _ in range(n):
        logits = model(torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(input_ids):]

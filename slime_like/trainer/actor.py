"""TrainerRank (plain) and TrainerActor (Ray): one data-parallel rank of the policy trainer.

Rank 0 also owns the weight sync into the engines. Its methods run on a threaded actor, so
a recovering engine can be synced while the driver waits on rollouts; `_weights_lock`
keeps a sync from reading weights that a train step is changing, and `_dirty` keeps a
recovering engine from getting weights that are newer than the version the others serve.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from slime_like.engine.handle import EngineHandle
from slime_like.trainer.checkpoint import load_rank_state, save_rank_state
from slime_like.trainer.policy import PolicyTrainer
from slime_like.weights.sync import WeightSync, WeightSyncConfig

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TrainerRank:
    """One trainer rank: model + optimiser; rank 0 additionally syncs weights to engines."""

    def __init__(self, rank: int, world_size: int, model_path: str, *, lr: float, seed: int,
                 sync_config: dict[str, Any] | None = None, use_transformers: bool = False,
                 engine_dtype: str | None = None, keep_served: bool = False):
        self.rank = rank
        # --update-weights-interval > 1: the weights the engines serve, kept after each full
        # sync, so samples are checked at the version they were made at.
        self.keep_served = keep_served
        self._served: torch.nn.Module | None = None
        self._served_version: int | None = None
        self.use_transformers = use_transformers
        self.engine_dtype = engine_dtype
        self.world_size = world_size
        self.model_path = model_path
        self.lr = lr
        self.seed = seed
        self.sync_config = dict(sync_config or {})
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.group: dist.ProcessGroup | None = None
        self.policy: PolicyTrainer | None = None
        self.weight_sync: WeightSync | None = None
        self.version = 0
        self._dirty = False
        self._weights_lock = threading.Condition()
        self._sync_step_hook: tuple[str, Callable[[], Any]] | None = None

    # ---- set-up ------------------------------------------------------------------------------

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"

    def master_port(self) -> int:
        return free_port()

    def init(self, master_addr: str, master_port: int) -> None:
        """Join the trainer's own process group (DP all-reduce) and load the policy."""
        if self.world_size > 1:
            dist.init_process_group("nccl" if self.device == "cuda" else "gloo",
                                    init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(minutes=10))
            self.group = dist.group.WORLD
        self.policy = PolicyTrainer(self.model_path, lr=self.lr, device=self.device,
                                    seed=self.seed, group=self.group,
                                    use_transformers=self.use_transformers,
                                    engine_dtype=self.engine_dtype)

    # ---- training ------------------------------------------------------------------------------

    def train_step(self, samples: list[tuple[list[int], list[int]]],
                   advantages: list[float], **kl: Any) -> dict[str, float]:
        """This rank's shard of one optimiser step; weights are 'dirty' until the next sync."""
        assert self.policy is not None
        with self._weights_lock:
            self._dirty = True
            metrics = self.policy.train_step(samples, advantages, **kl)
            offloader = self.policy.offloader
            onload = offloader.onload_stats()
            if onload.bytes:  # --offload-train: this step's copies to the host and back
                metrics.update(offloader.last_offload.as_dict("trainer_offload"))
                metrics.update(onload.as_dict("trainer_onload"))
            return metrics

    def completion_logprobs(self, samples: list[tuple[list[int], list[int]]],
                            version: int | None = None,
                            temperature: float = 1.0) -> list[list[float]]:
        """Log-probabilities of sampled tokens at `version` (the one the engines serve).

        After train steps without a sync the current weights are ahead of it; then the copy
        kept at the last sync answers, and without one the call fails rather than compare
        different weights.
        """
        assert self.policy is not None
        with self._weights_lock:
            if version is None or not self._dirty:
                return self.policy.completion_logprobs(samples, temperature=temperature)
            if self._served is not None and self._served_version == version:
                return self.policy.completion_logprobs(samples, self._served, temperature)
            raise RuntimeError(f"the trainer's weights moved past version {version} and no "
                               "copy of it was kept (keep_served)")

    def offload(self) -> dict[str, Any]:
        """--offload-train: model and optimizer state leave the GPU while engines generate
        (pinned host buffers, reused every step; gradients freed). The copy is enqueued and
        overlaps the generation; its time comes with the next train step's metrics.

        On a CPU trainer there is no device memory to give back; the call says so.
        """
        assert self.policy is not None
        if self.device != "cuda":
            return {"trainer_offloaded": False, "reason": "cpu trainer: nothing on a device"}
        with self._weights_lock:
            stats = self.policy.move_to("cpu", wait=False)
            return {"trainer_offloaded": True, "trainer_offload_gb": round(stats.bytes / 1e9, 4)}

    def onload(self) -> None:
        """Start the copy back; the next use of the model waits for it (so the copy overlaps
        what the driver does meanwhile: scoring, the rest of the rollout's bookkeeping)."""
        assert self.policy is not None
        if self.device == "cuda":
            with self._weights_lock:
                self.policy.move_to(self.device, wait=False)

    # ---- weight sync (rank 0) ------------------------------------------------------------------

    def _weight_sync(self) -> WeightSync:
        if self.weight_sync is None:
            self.weight_sync = WeightSync([], WeightSyncConfig(**self.sync_config))
            self.weight_sync.on_step = self._on_sync_step
        return self.weight_sync

    def on_sync_step(self, step: str, action: Callable[[], Any]) -> None:
        """Run `action` once, when the next sync reaches `step` (a WeightSync step name),
        before that step runs: chaos runs crash an engine there."""
        self._sync_step_hook = (step, action)

    def _on_sync_step(self, step: str) -> None:
        hook = self._sync_step_hook
        if hook is not None and hook[0] == step:
            self._sync_step_hook = None
            hook[1]()  # done before the step goes on

    def push_weights(self, targets: list[EngineHandle], version: int, full: bool = True) -> dict:
        """Put the current weights into `targets` (the fleet's update) and report.

        A full update installs `version` (the fleet's next) on every target over the main
        weight group. A resync gives replacement engines the version the others serve,
        over a group of their own; it waits while a train step has made the weights newer
        than that version (the full sync right after the step takes the engine along).
        """
        if self.rank != 0:
            return {}
        assert self.policy is not None
        with self._weights_lock:
            if full:
                report = self._weight_sync().update(self.policy.sync_source(), str(version),
                                                    engines=targets)
                self.version = version
                self._dirty = False
                if self.keep_served:
                    self._served, self._served_version = self.policy.snapshot(), version
                self._weights_lock.notify_all()
                return report.as_dict()
            if not self._weights_lock.wait_for(lambda: not self._dirty, timeout=600.0):
                raise TimeoutError("weights stayed ahead of the served version for 600s")
            one = WeightSync(targets, WeightSyncConfig(**self.sync_config))
            try:
                return one.update(self.policy.sync_source(), str(self.version)).as_dict()
            finally:
                one.close()

    # ---- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, out_dir: str) -> None:
        """Write this rank's part of a checkpoint (see trainer/checkpoint.py)."""
        assert self.policy is not None
        with self._weights_lock:
            self.policy.offloader.ready()
            save_rank_state(self.policy.model, self.policy.optimizer, self.rank, out_dir)

    def load_checkpoint(self, ckpt_dir: str, version: int) -> None:
        """Restore model, optimizer and RNG; the weights are `version` (not yet served)."""
        assert self.policy is not None
        with self._weights_lock:
            self.policy.move_to(self.device)  # the state a load replaces must be onloaded
            load_rank_state(self.policy.model, self.policy.optimizer, self.rank, ckpt_dir,
                            device=self.device)
            self.version = version
            self._dirty = True  # engines serve other weights until the next full sync

    def current_version(self) -> int:
        return self.version

    def shutdown(self) -> None:
        if self.weight_sync is not None:
            try:
                self.weight_sync.close()
            except Exception as e:  # engines may already be gone at teardown
                logger.warning("closing the weight sync failed: %s", e)
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()
            self.group = None


TrainerActor = ray.remote(max_concurrency=4)(TrainerRank)


def trainer_env() -> dict[str, str]:
    """Environment for trainer actors: NVLink multicast off, P2P/SHM left on (as sglang's own
    trainer-side test has it; docs/WEIGHT_SYNC.md, "Failure behaviour": environment)."""
    return {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"),
            "NCCL_CUMEM_ENABLE": os.environ.get("NCCL_CUMEM_ENABLE", "0")}

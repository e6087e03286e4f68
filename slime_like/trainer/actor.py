"""TrainerRank (plain) and TrainerActor (Ray): one data-parallel rank of the policy trainer.

Rank 0 also owns the weight sync into the engines; with --train-backend fsdp every rank takes
part in it (rank 0's sync gathers the shards bucket by bucket over a group of their own while
the others serve those gathers: weights/sharded.py). Its methods run on a threaded actor, so
a recovering engine can be synced while the driver waits on rollouts; `_weights_lock`
keeps a sync from reading weights that a train step is changing, and `_dirty` keeps a
recovering engine from getting weights that are newer than the version the others serve.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from slime_like.cluster.ports import free_port
from slime_like.engine.session import EngineSession
from slime_like.protocol.modes import Transport
from slime_like.trainer.checkpoint import (
    load_rank_state,
    load_sharded_rank_state,
    save_rank_state,
    save_sharded_rank_state,
)
from slime_like.trainer.policy import PolicyTrainer
from slime_like.trainer.versions import Span, VersionedWeights, span_logprobs
from slime_like.weights.fp8 import Fp8Weights
from slime_like.weights.sharded import ShardedWeights
from slime_like.weights.sync import WeightSync, WeightSyncConfig

logger = logging.getLogger(__name__)


class TrainerRank:
    """One trainer rank: model + optimiser; rank 0 additionally syncs weights to engines."""

    def __init__(self, rank: int, world_size: int, model_path: str, *, lr: float, seed: int,
                 sync: WeightSyncConfig | None = None, use_transformers: bool = False,
                 engine_dtype: str | None = None, keep_versions: int = 0,
                 backend: str = "ddp", engine_quantization: str | None = None):
        self.rank = rank
        self.backend = backend
        self.gather_group: dist.ProcessGroup | None = None  # fsdp: the syncs' gathers
        self._sharded: ShardedWeights | None = None
        self._serve_lock = threading.Lock()
        # The weights of the last `keep_versions` versions pushed, kept after each full sync
        # (--update-weights-interval > 1, the asynchronous schedules), so samples are checked
        # at the versions they were made at after the trainer moved on.
        self._versions = VersionedWeights(keep_versions)
        # --sglang-quantization fp8: `_versions` and `_served` hold what the engines serve
        # (dequantized FP8), `_raw_versions` the trainer's own weights of those versions,
        # for the rollout/trainer mismatch the job reports beside the check.
        self.engine_quantization = engine_quantization
        self._raw_versions = VersionedWeights(keep_versions if engine_quantization else 0)
        self._served: torch.nn.Module | None = None
        self.use_transformers = use_transformers
        self.engine_dtype = engine_dtype
        self.world_size = world_size
        self.model_path = model_path
        self.lr = lr
        self.seed = seed
        self.sync = sync if sync is not None else WeightSyncConfig()
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
        backend = "nccl" if self.device == "cuda" else "gloo"
        if self.world_size > 1 or self.backend == "fsdp":  # FSDP needs a group, even of one
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(minutes=10))
            self.group = dist.group.WORLD
        if self.backend == "fsdp":
            # The syncs' gathers run on their own group: a resync may gather while another
            # thread of this actor runs FSDP's collectives on the main one.
            self.gather_group = dist.new_group(backend=backend, timeout=timedelta(minutes=10))
        self.policy = PolicyTrainer(self.model_path, lr=self.lr, device=self.device,
                                    seed=self.seed, group=self.group,
                                    use_transformers=self.use_transformers,
                                    engine_dtype=self.engine_dtype, backend=self.backend,
                                    quantization=self.engine_quantization,
                                    keep_quantized=self.sync.transport == Transport.TENSOR)

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
        kept at that version's sync answers, and without one the call fails rather than
        compare different weights.
        """
        assert self.policy is not None
        with self._weights_lock:
            model = None if version is None else self._model_at(version)
            return self.policy.completion_logprobs(samples, model, temperature)

    def span_logprobs(self, samples: list[tuple[list[int], list[int], list[Span]]],
                      temperature: float = 1.0, kv_kept: bool = False,
                      served: bool = True) -> list[list[float]]:
        """Every output token's log-probability at the version of its span (see
        trainer/versions.py); `kv_kept`: the engines kept old-weight KV (in_place).
        `served=False`: under the trainer's own weights of that version rather than the
        engines' (they differ with FP8 engines)."""
        assert self.policy is not None
        policy = self.policy
        with self._weights_lock:
            return span_logprobs(
                lambda version: self._model_at(version, served),
                lambda model, pairs: policy.completion_logprobs(pairs, model, temperature),
                samples, kv_kept=kv_kept, temperature=temperature, device=self.device)

    def _model_at(self, version: int, served: bool = True) -> torch.nn.Module:
        """The weights of `version`: the live model while it is that version, else a copy.
        With FP8 engines, what they serve (`served`) or the trainer's own."""
        assert self.policy is not None
        quantized = self._served is not None
        if version == self.version and not self._dirty:
            return self._served if served and quantized else self.policy.model
        kept = (self._versions if served or not quantized else self._raw_versions).get(version)
        if kept is None:
            raise RuntimeError(f"the trainer's weights moved past version {version} and no "
                               f"copy of it was kept (kept: {self._versions.versions()}, "
                               f"current {self.version}{' + a train step' if self._dirty else ''})")
        return kept

    def offload(self, keep_weights: bool = False) -> dict[str, Any]:
        """--offload-train: model and optimizer state leave the GPU while engines generate
        (pinned host buffers, reused every step; gradients freed; the weights stay with
        `keep_weights`, --no-offload-train-weights). The copy is enqueued and overlaps the
        generation; its time comes with the next train step's metrics.

        On a CPU trainer there is no device memory to give back; the call says so.
        """
        assert self.policy is not None
        if self.device != "cuda":
            return {"trainer_offloaded": False, "reason": "cpu trainer: nothing on a device"}
        with self._weights_lock:
            stats = self.policy.move_to("cpu", wait=False, keep_weights=keep_weights)
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
            self.weight_sync = WeightSync([], self.sync)
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

    def push_weights(self, targets: list[EngineSession], version: int, full: bool = True,
                     quiet: frozenset[str] = frozenset()) -> dict:
        """Put the current weights into `targets` (the fleet's update) and report; `quiet`:
        targets the fleet holds out of the router, idle (not paused, `WeightSync.update`).

        A full update installs `version` (the fleet's next) on every target over the main
        weight group. A resync gives replacement engines the version the others serve,
        over a group of their own; it waits while a train step has made the weights newer
        than that version (the full sync right after the step takes the engine along).
        With fsdp every rank is called: rank 0 syncs from the shards, the others serve its
        gathers; rank 0 ends each sync with a word to them (`finish`), done or failed.
        """
        assert self.policy is not None
        sharded = self.backend == "fsdp"
        if self.rank != 0:
            return self._serve_gathers(version, full) if sharded else {}
        source = self._sharded_source() if sharded else self.policy.sync_source()
        try:
            with self._weights_lock:
                if full:
                    report = self._weight_sync().update(source, str(version), engines=targets,
                                                        quiet=quiet)
                    self.version = version
                    self._dirty = False
                    if self.policy.served is not None:
                        self._served = self.policy.served.refresh(source)
                        self._raw_versions.put(version, self.policy.model)
                    self._versions.put(version, self._served or self.policy.model)
                    self._weights_lock.notify_all()
                    return self._report(report, source)
                if not self._weights_lock.wait_for(lambda: not self._dirty, timeout=600.0):
                    raise TimeoutError("weights stayed ahead of the served version for 600s")
                one = WeightSync(targets, self.sync)
                try:
                    return self._report(one.update(source, str(self.version)), source)
                finally:
                    one.close()
        finally:
            if sharded:
                source.finish()

    @staticmethod
    def _report(report: Any, source: Any) -> dict:
        out = report.as_dict()
        if isinstance(source, ShardedWeights):
            out["gather"] = source.stats.as_dict()
        if isinstance(source, Fp8Weights):
            out["quantize_s"] = round(source.quantize_s, 5)
        return out

    def _sharded_source(self) -> ShardedWeights:
        if self._sharded is None:
            assert self.policy is not None
            cfg = self.sync
            self._sharded = ShardedWeights(
                self.policy.model, bucket_bytes=int(cfg.update_weight_buffer_size),
                dtype=self.policy.serve_dtype, group=self.gather_group,
                copies=cfg.transport != Transport.DISTRIBUTED)
        return self._sharded

    def _serve_gathers(self, version: int, full: bool) -> dict:
        """fsdp, ranks 1..N-1: send this rank's rows for one of rank 0's syncs. Sessions
        are interchangeable (the same shards, the same plan): a rank's calls serve rank 0's
        syncs one at a time, in rank 0's order."""
        with self._serve_lock:
            buckets = self._sharded_source().serve()
        if full:
            with self._weights_lock:
                self.version, self._dirty = version, False
        return {"served_buckets": buckets}

    # ---- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, out_dir: str) -> None:
        """Write this rank's part of a checkpoint (see trainer/checkpoint.py)."""
        assert self.policy is not None
        with self._weights_lock:
            self.policy.offloader.ready()
            if self.backend == "fsdp":
                save_sharded_rank_state(self.policy.model, self.policy.optimizer, self.rank,
                                        out_dir)
            else:
                save_rank_state(self.policy.model, self.policy.optimizer, self.rank, out_dir)

    def load_checkpoint(self, ckpt_dir: str, version: int) -> None:
        """Restore model, optimizer and RNG; the weights are `version` (not yet served)."""
        assert self.policy is not None
        with self._weights_lock:
            if self.device == "cuda":  # the state a load replaces must be onloaded
                self.policy.move_to(self.device)
            if self.backend == "fsdp":
                load_sharded_rank_state(self.policy.model, self.policy.optimizer, self.rank,
                                        ckpt_dir)
            else:
                load_rank_state(self.policy.model, self.policy.optimizer, self.rank, ckpt_dir,
                                device=self.device)
            self.version = version
            self._dirty = True  # engines serve other weights until the next full sync

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

"""TrainerGroup: the trainer's Ray actors, created on their placement-group slots."""

from __future__ import annotations

import ray

from slime_like.cluster.placement import JobPlacement
from slime_like.config.slices import OffPolicySettings
from slime_like.trainer.actor import TrainerActor, trainer_env
from slime_like.weights.sync_config import WeightSyncConfig


class TrainerGroup:
    """N data-parallel trainer ranks; rank 0 drives weight syncs.

    With `backend="fsdp"` the ranks hold shards: forwards and weight syncs are collective,
    so those calls go to every rank (rank 0 answers).
    """

    def __init__(self, placement: JobPlacement, model_path: str, *, lr: float, seed: int,
                 sync: WeightSyncConfig, use_transformers: bool = False,
                 engine_dtype: str | None = None, keep_versions: int = 0,
                 backend: str = "ddp", engine_quantization: str | None = None):
        world = len(placement.plan.trainer)
        self.sharded = backend == "fsdp"
        env = {"env_vars": trainer_env()}
        self.actors = [
            TrainerActor.options(**placement.trainer_options(rank), runtime_env=env).remote(
                rank, world, model_path, lr=lr, seed=seed,
                sync=sync, use_transformers=use_transformers,
                engine_dtype=engine_dtype, keep_versions=keep_versions if rank == 0 else 0,
                backend=backend, engine_quantization=engine_quantization)
            for rank in range(world)
        ]
        master_addr = ray.get(self.actors[0].node_ip.remote())
        master_port = ray.get(self.actors[0].master_port.remote())
        ray.get([a.init.remote(master_addr, master_port) for a in self.actors])

    @property
    def rank0(self):
        return self.actors[0]

    def train_step(self, samples: list, advantages: list[float], *,
                   ref_logprobs: list[list[float]] | None = None, kl_loss_coef: float = 0.0,
                   kl_loss_type: str = "low_var_kl", temperature: float = 1.0,
                   loss_masks: list[list[int] | None] | None = None,
                   rollout_logprobs: list[list[float]] | None = None,
                   off_policy: OffPolicySettings | None = None) -> dict[str, float]:
        """Split the batch over ranks (strided shards), step all, report rank 0's metrics.

        `rollout_logprobs` (the engines', per output token) and `off_policy` reach every
        rank's loss (`PolicyTrainer.train_step`).
        """
        n = len(self.actors)
        none = [None] * len(samples)
        refs = ref_logprobs if ref_logprobs is not None else none
        masks = loss_masks if loss_masks is not None else none
        behaviour = rollout_logprobs if rollout_logprobs is not None else none
        shards = [(samples[i::n], advantages[i::n], refs[i::n], masks[i::n], behaviour[i::n])
                  for i in range(n)]
        results = ray.get([
            a.train_step.remote(s, adv, ref_logprobs=None if ref_logprobs is None else r,
                                kl_loss_coef=kl_loss_coef, kl_loss_type=kl_loss_type,
                                temperature=temperature,
                                loss_masks=None if loss_masks is None else m,
                                rollout_logprobs=None if rollout_logprobs is None else b,
                                off_policy=off_policy)
            for a, (s, adv, r, m, b) in zip(self.actors, shards, strict=True)])
        return results[0]

    def completion_logprobs(self, samples: list, version: int | None = None,
                            temperature: float = 1.0) -> list[list[float]]:
        if not self.sharded:
            return ray.get(self.rank0.completion_logprobs.remote(samples, version, temperature))
        return ray.get([a.completion_logprobs.remote(samples, version, temperature)
                        for a in self.actors])[0]

    def span_logprobs(self, samples: list, temperature: float = 1.0,
                      kv_kept: bool = False, served: bool = True) -> list[list[float]]:
        """Each output token's log-probability at its span's version (rank 0; with fsdp
        every rank, the forward being collective); `served=False`: under the trainer's own
        weights rather than the FP8 engines' (`TrainerRank.span_logprobs`)."""
        if not self.sharded:
            return ray.get(self.rank0.span_logprobs.remote(samples, temperature, kv_kept,
                                                           served))
        return ray.get([a.span_logprobs.remote(samples, temperature, kv_kept, served)
                        for a in self.actors])[0]

    def offload(self, keep_weights: bool = False) -> dict:
        """--offload-train: every rank's model and optimizer state leave the GPU (the
        weights stay with `keep_weights`)."""
        return ray.get([a.offload.remote(keep_weights) for a in self.actors])[0]

    def onload(self) -> None:
        ray.get([a.onload.remote() for a in self.actors])

    def push_weights(self, update) -> dict:
        """The fleet's weight source: rank 0 pushes into the update's engines.

        A failure comes back as the WeightSyncError rank 0 raised (not Ray's wrapper), so
        the fleet sees which step and engine failed.
        """
        args = (update.targets, int(update.version), update.full, update.quiet)
        ref = self.rank0.push_weights.remote(*args)
        # fsdp: every rank serves rank 0's gathers (rank 0 always ends each sync for them).
        peers = [a.push_weights.remote(*args) for a in self.actors[1:]] if self.sharded else []
        try:
            report = ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise
        finally:
            if peers:
                ray.get(peers)  # a rank that died says so (RayActorError): the job stops
        return report

    def on_sync_step(self, step: str, action) -> None:
        """Run `action` (picklable) in rank 0 when its next sync reaches `step`."""
        ray.get(self.rank0.on_sync_step.remote(step, action))

    def save_checkpoint(self, out_dir: str) -> None:
        """Every rank writes its part into `out_dir` (a directory all ranks can reach)."""
        ray.get([a.save_checkpoint.remote(out_dir) for a in self.actors])

    def load_checkpoint(self, ckpt_dir: str, version: int) -> None:
        ray.get([a.load_checkpoint.remote(ckpt_dir, version) for a in self.actors])

    def shutdown(self) -> None:
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=60)
        finally:
            for a in self.actors:
                ray.kill(a)

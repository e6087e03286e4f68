"""PolicyTrainer: the model, optimiser and GRPO step of one trainer rank (no Ray here).

Data parallel across trainer ranks: each rank computes gradients on its shard of the batch
and the gradients are averaged over the trainer's own process group (gloo on CPU, NCCL on
GPU) before the optimiser step. With the `ddp` backend every rank holds the whole model
(an all-reduce of the gradients); with `fsdp` the model and optimizer state are sharded
(FSDP2, `sharding.py`) and forwards are collective: every rank runs each one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slime_like.config.slices import OffPolicySettings
from slime_like.models import load_pretrained
from slime_like.models.hf_checkpoint import load_transformers_model
from slime_like.models.transformer import hf_named_parameters
from slime_like.trainer.grpo import (
    PackedBatch,
    kl_penalty,
    off_policy_loss,
    pack,
    policy_gradient_loss,
    ref_logprob_rows,
    token_logprobs,
)
from slime_like.trainer.offload import MoveStats, TrainerOffload
from slime_like.trainer.serve_dtype import serve_dtype
from slime_like.trainer.sharding import BACKENDS, as_float, shard_model
from slime_like.weights.fp8 import Fp8Weights, ServedWeights
from slime_like.weights.packing import CastWeights, ModelWeights
from slime_like.weights.sharded import reshard


class PolicyTrainer:
    """One rank's copy of the policy: train steps and log-probability recomputation.

    `use_transformers` trains an HF checkpoint as `transformers`' AutoModelForCausalLM; the
    default is the pure-torch model (the tiny model, no transformers needed). Both name
    their parameters as the checkpoint does, so the weight sync needs no mapping. Weights
    stay fp32; syncs send them in the engines' dtype (`engine_dtype`, sglang's --dtype, or
    the checkpoint's).
    """

    def __init__(self, model_path: str | Path, *, lr: float = 1e-3, device: str = "cpu",
                 seed: int = 0, group: dist.ProcessGroup | None = None,
                 use_transformers: bool = False, engine_dtype: str | None = None,
                 backend: str = "ddp", load_format: str = "auto",
                 dtype: torch.dtype = torch.float32, quantization: str | None = None,
                 keep_quantized: bool = False):
        if backend not in BACKENDS:
            raise ValueError(f"train backend must be one of {BACKENDS}, got {backend!r}")
        torch.manual_seed(seed)
        if use_transformers:
            self.model = load_transformers_model(model_path, device=device, dtype=dtype)
        else:  # load_format "dummy": random weights from config.json (benchmarks)
            self.model = load_pretrained(model_path, device=device, dtype=dtype,
                                         load_format=load_format, seed=seed)
        self.sharded = backend == "fsdp"
        if self.sharded:
            if group is None:
                raise ValueError("--train-backend fsdp needs the trainer's process group")
            shard_model(self.model, group)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.99),
                                           weight_decay=0.0)
        self.offloader = TrainerOffload(self.model, self.optimizer)
        self.use_transformers = use_transformers
        served = serve_dtype(model_path, engine_dtype)
        self.serve_dtype = served
        # One source for the whole run: the same metadata list every sync (checked once)
        # and the same object, so the tensor transport can reuse its in-place requests.
        self._sync_source = (ModelWeights(self.model) if served == dtype
                             else CastWeights(self.model, served))
        # --sglang-quantization fp8: syncs send FP8 blocks, and `served` is what the engines
        # then hold (the copy the log-probability check scores with; weights/fp8.py).
        self.served: ServedWeights | None = None
        if quantization == "fp8":
            if self.sharded:
                raise ValueError("--sglang-quantization fp8 syncs from a full replica; "
                                 "--train-backend fsdp is not supported with it")
            # keep_quantized (the colocated `tensor` transport): a quantized copy kept on
            # the trainer's device between syncs, which then go in place
            self._sync_source = Fp8Weights(self.model, served, keep=keep_quantized)
            self.served = ServedWeights(self.model, served)
        # A colocated engine keeps the buffer a sync sends in place mapped until the next
        # sync only while the offloads leave it where it is (weights/tensor.py).
        self._sync_source.storage_stays = self.offloader.weights_stay
        self.group = group
        self.device = device
        self.steps = 0

    def _logits(self, input_ids: torch.Tensor, model: torch.nn.Module | None = None) -> torch.Tensor:
        model = model or self.model
        if self.use_transformers:
            return model(input_ids=input_ids, use_cache=False).logits
        return model(input_ids)

    def _world(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    def train_step(self, samples: Sequence[tuple[list[int], list[int]]],
                   advantages: Sequence[float], max_grad_norm: float = 1.0, *,
                   ref_logprobs: Sequence[Sequence[float]] | None = None,
                   kl_loss_coef: float = 0.0, kl_loss_type: str = "low_var_kl",
                   temperature: float = 1.0,
                   loss_masks: Sequence[Sequence[int] | None] | None = None,
                   rollout_logprobs: Sequence[Sequence[float]] | None = None,
                   off_policy: OffPolicySettings | None = None) -> dict[str, float]:
        """One optimiser step on this rank's samples; gradients averaged across ranks.

        With `ref_logprobs` (a frozen reference model's, per sampled token) and
        `kl_loss_coef > 0` the loss adds kl_loss_coef x the mean per-token KL estimate.
        `temperature` (the rollout's) scales the logits as sampling did, so the loss is
        taken under the distribution the samples came from (slime does the same).
        `loss_masks` (multi-turn samples) leave environment tokens out of the loss and KL.
        `off_policy` with `use_rollout_logprobs` or `use_tis` corrects the loss with the
        engines' `rollout_logprobs` (one per output token; see `grpo.off_policy_loss`).
        """
        if off_policy is not None and off_policy.enabled and rollout_logprobs is None:
            raise ValueError("the off-policy correction (--use-rollout-logprobs / --use-tis) "
                             "needs rollout_logprobs: the engines' log-probabilities")
        self.offloader.ready_weights()  # the optimizer state may still be copying back
        batch: PackedBatch = pack(samples, advantages, loss_masks=loss_masks).to(self.device)
        self.optimizer.zero_grad(set_to_none=False)
        logits = self._logits(batch.input_ids)
        if temperature != 1.0:
            logits = logits.float() / temperature
        logprobs = token_logprobs(logits, batch.input_ids)
        metrics: dict[str, float] = {}
        if off_policy is not None and off_policy.enabled:
            behaviour = ref_logprob_rows(samples, rollout_logprobs, logprobs.shape[1],
                                         what="rollout").to(self.device)
            loss, metrics = off_policy_loss(logprobs, batch, behaviour, off_policy)
        else:
            loss = policy_gradient_loss(logprobs, batch)
        if ref_logprobs is not None and kl_loss_coef > 0:
            ref = ref_logprob_rows(samples, ref_logprobs, logprobs.shape[1]).to(self.device)
            mask = batch.completion_mask.to(self.device).float()
            kl = (kl_penalty(logprobs, ref, kl_loss_type) * mask).sum() / mask.sum().clamp(min=1.0)
            loss = loss + kl_loss_coef * kl
            metrics["kl_loss"] = float(kl.detach())
        loss.backward()
        if self._world() > 1 and not self.sharded:  # FSDP reduce-scatters by itself
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.group)
                    p.grad.div_(self._world())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
        self.offloader.ready()
        self.optimizer.step()
        self.steps += 1
        if self.offloader.used and str(self.device).startswith("cuda"):
            # Colocated: the step's cached temporaries go back before the engines resume.
            torch.cuda.empty_cache()
        return {"loss": float(loss.detach()), "grad_norm": as_float(grad_norm), **metrics}

    @torch.no_grad()
    def completion_logprobs(self, samples: Sequence[tuple[list[int], list[int]]],
                            model: torch.nn.Module | None = None,
                            temperature: float = 1.0) -> list[list[float]]:
        """Per generated token, log p(token | prefix) under the current weights (fp32), or
        under `model` (e.g. a copy of the weights the engines serve). `temperature` scales
        the logits as the engines do for the logprobs they report (sglang's default)."""
        self.offloader.ready_weights()
        model = model or self.model
        was_training = model.training
        model.eval()
        try:
            batch = pack(samples, [0.0] * len(samples))
            logits = self._logits(batch.input_ids.to(self.device), model)
            if temperature != 1.0:
                logits = logits.float() / temperature
            lp = token_logprobs(logits, batch.input_ids.to(self.device)).cpu()
        finally:
            model.train(was_training)
            if self.sharded:
                reshard(model)  # FSDP's root stays unsharded after a forward without backward
        out = []
        for i, (prompt, output) in enumerate(samples):
            out.append(lp[i, len(prompt): len(prompt) + len(output)].tolist())
        return out


    def move_to(self, device: str, wait: bool = True, keep_weights: bool = False) -> MoveStats:
        """Offload the weights and the optimizer state to pinned host memory ("cpu"), or
        bring them back (the trainer's device). With `wait=False` the copy overlaps the
        caller's next work. Gradients are freed, not moved; `keep_weights` leaves the
        weights on the device. See trainer/offload.py."""
        if device == "cpu":
            if not keep_weights and isinstance(self._sync_source, Fp8Weights):
                self._sync_source.release()  # its kept copy gives the device back too
            return self.offloader.offload(wait=wait, keep_weights=keep_weights)
        return self.offloader.onload(wait=wait)

    def sync_source(self) -> Any:
        """What a weight sync sends: the model, or its weights cast to the engines' dtype."""
        self.offloader.ready()
        return self._sync_source

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """HF-named parameters to sync (tied lm_head left out, as in the checkpoint)."""
        return list(hf_named_parameters(self.model))

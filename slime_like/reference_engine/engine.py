"""ReferenceEngine: the model, the scheduler, the frontend and the TP ranks of one server."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch

from slime_like.models.config import ModelConfig
from slime_like.models.hf_tokenizer import load_tokenizer
from slime_like.models.loading import load_pretrained
from slime_like.models.tokenizer import ByteTokenizer
from slime_like.protocol.modes import WorkerType
from slime_like.protocol.ready_event import READY_EVENT_KEY
from slime_like.protocol.tensor_payload import KEPT_PAYLOADS_KEY
from slime_like.protocol.weight_delta import DELTA_FORMATS, SERVER_INFO_KEY
from slime_like.reference_engine import loads
from slime_like.reference_engine.args import SGLANG_VERSION, EngineArgs
from slime_like.reference_engine.disaggregation import (
    BOOTSTRAP_TIMEOUT_ENV,
    BootstrapServer,
    HandoffStore,
    env_timeout,
)
from slime_like.reference_engine.fp8 import quantize_model
from slime_like.reference_engine.frontend import Frontend
from slime_like.reference_engine.metrics import EngineMetrics
from slime_like.reference_engine.scheduler import Scheduler
from slime_like.reference_engine.served_log import ServedLog
from slime_like.reference_engine.step_floor import min_step_seconds
from slime_like.reference_engine.tp import TPGroup
from slime_like.reference_engine.weight_api import WeightControl
from slime_like.reference_engine.weight_receiver import WeightReceiver

logger = logging.getLogger(__name__)

_KV_BUDGET_BYTES = {"cpu": 1 << 30, "cuda": 4 << 30}
_DEFAULT_MAX_RUNNING = 64


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers."""
    return (config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim
            * torch.empty((), dtype=dtype).element_size())


class ReferenceEngine:
    """Everything one `python -m slime_like.reference_engine` process serves."""

    def __init__(self, args: EngineArgs):
        self.args = args
        self.started = time.time()
        self._shut_down = False
        self.device = torch.device(args.rank_device(0))
        if args.device == "cuda":
            torch.cuda.set_device(self.device)
            # cuDNN attention builds a graph per new sequence length (every decode step),
            # which cost ~1 ms of CPU per layer on an H200; the other kernels don't.
            torch.backends.cuda.enable_cudnn_sdp(False)
        torch.manual_seed(args.random_seed)
        self.config = ModelConfig.from_pretrained(args.model_path)
        self.dtype = args.torch_dtype(self.config.dtype)
        self.model_path = args.model_path
        self.served_model_name = args.served_model_name
        self.load_format = args.load_format
        # Ranks 1..N-1 load their copies while rank 0 loads its own; with tp=1 this is just
        # the 1-rank default group sglang's weight-sync code expects.
        self.tp_group = TPGroup(args)
        self.model = load_pretrained(args.model_path, device=self.device, dtype=self.dtype,
                                     load_format="dummy" if args.load_format == "dummy" else "auto",
                                     seed=args.random_seed)
        if args.quantization == "fp8":
            quantize_model(self.model, args.tp_size)
        self.weight_bytes = sum(t.numel() * t.element_size()
                                for t in self.model.state_dict().values())
        self.context_len = min(args.context_length or self.config.max_position_embeddings,
                               self.config.max_position_embeddings)
        # The checkpoint's own tokenizer for `text` inputs and output text (byte-level for
        # the tiny model: no transformers import); none to load with --skip-tokenizer-init.
        self.tokenizer = ByteTokenizer() if args.skip_tokenizer_init else load_tokenizer(
            args.all_args.get("tokenizer_path") or args.model_path, where="--tokenizer-path")
        per_token = kv_bytes_per_token(self.config, self.dtype)
        budget_tokens = args.max_total_tokens or (_KV_BUDGET_BYTES[args.device] // per_token)
        max_running = args.max_running_requests or max(1, min(_DEFAULT_MAX_RUNNING,
                                                              budget_tokens // self.context_len))
        self.max_running = max_running
        self.metrics = EngineMetrics(args.enable_metrics, self.served_model_name)
        self.scheduler = Scheduler(
            self.model, device=self.device, context_len=self.context_len, max_running=max_running,
            # --disable-radix-cache: no prefix is kept (a cache of no capacity keeps none).
            prefix_cache_tokens=0 if args.disable_radix_cache else max_running * self.context_len,
            weight_version=args.weight_version,
            seed=args.random_seed, metrics=self.metrics, tokenizer=self.tokenizer,
            stall_report_s=args.soft_watchdog_timeout, min_step_s=min_step_seconds(),
            served_log=ServedLog.from_env())
        # PD prefill: hand-offs by bootstrap room, served on --disaggregation-bootstrap-port.
        self.handoffs: HandoffStore | None = None
        self.bootstrap_server: BootstrapServer | None = None
        if args.disaggregation_mode == WorkerType.PREFILL:
            self.handoffs = HandoffStore(keep_s=env_timeout(BOOTSTRAP_TIMEOUT_ENV))
            self.bootstrap_server = BootstrapServer(args.host, args.disaggregation_bootstrap_port,
                                                    self.handoffs)
        self.frontend = Frontend(self.scheduler, context_len=self.context_len,
                                 skip_tokenizer_init=args.skip_tokenizer_init,
                                 incremental_streaming=args.incremental_streaming_output,
                                 vocab_size=self.config.vocab_size,
                                 disaggregation_mode=args.disaggregation_mode,
                                 handoffs=self.handoffs, tokenizer=self.tokenizer)
        self.receiver = WeightReceiver(self.model, tp_rank=0, tp_size=args.tp_size, device=self.device,
                                       model_path=args.model_path, load_format=args.load_format,
                                       seed=args.random_seed, cpu_backup=args.enable_weights_cpu_backup)
        # A forward must not read parameters a CUDA weight copy is still writing.
        self.scheduler.step_hooks.append(self.receiver.wait_loads)
        self.weight_control = WeightControl(receiver=self.receiver, tp=self.tp_group,
                                            scheduler=self.scheduler, frontend=self.frontend,
                                            metrics=self.metrics, gate=args.weight_update_gate)
        self.tp_group.wait_ready()
        self.scheduler.start()
        if self.bootstrap_server is not None:
            self.bootstrap_server.start()
        logger.info("reference engine loaded %s (%s, %s) on %s: tp=%d, %d slots x %d tokens",
                    args.model_path, self.config.architecture, self.dtype, self.device,
                    args.tp_size, max_running, self.context_len)

    def shutdown(self) -> None:
        """Stop the scheduler, leave weight groups, stop the TP ranks (idempotent)."""
        if self._shut_down:
            return
        self._shut_down = True
        self.frontend.close()
        if self.bootstrap_server is not None:
            self.bootstrap_server.stop()
        self.scheduler.stop()
        self.receiver.destroy_all_groups()
        self.tp_group.shutdown()

    # ---- info ------------------------------------------------------------------------------

    def model_info(self) -> dict:
        """GET /model_info: live model path, served name and weight version."""
        return {
            "model_path": self.model_path, "served_model_name": self.served_model_name,
            "tokenizer_path": self.args.all_args.get("tokenizer_path") or self.model_path,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version, "load_format": self.load_format,
            "reasoning_parser": None, "tool_call_parser": None,
            "disaggregation_mode": self.args.disaggregation_mode,
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": self.config.model_type, "architectures": [self.config.architecture],
        }

    def server_info(self) -> dict:
        """GET /server_info: every resolved sglang arg plus scheduler state."""
        info = {k: _jsonable(v) for k, v in self.args.all_args.items()}
        info.update({
            "model_path": self.model_path, "served_model_name": self.served_model_name,
            "device": self.args.device, "context_length": self.context_len,
            "max_running_requests": self.max_running, "load_format": self.load_format,
            "launch_command": " ".join([sys.executable, "-m", "slime_like.reference_engine",
                                        *sys.argv[1:]]),
            "status": "ready" if self.frontend.ready else "starting",
            "max_total_num_tokens": self.max_running * self.context_len,
            "max_req_input_len": self.context_len - 1,
            "startup_time": self.started, "kv_events": None,
            "internal_states": [self.internal_state()],
            "version": SGLANG_VERSION, "frontend": "python",
            "engine": "slime_like.reference",
            "weight_update_gate": self.args.weight_update_gate,
            SERVER_INFO_KEY: list(DELTA_FORMATS),  # ours: deltas it applies (weight_delta.py)
            KEPT_PAYLOADS_KEY: True,  # ours: kept plain tensor payloads (ipc_mappings.py)
            # ours: a tensor load waits for the sender's event on the GPU (ready_event.py)
            READY_EVENT_KEY: self.args.device == "cuda",
            "http_stack": self.args.http_stack,
        })
        return info

    def internal_state(self) -> dict:
        """The per-DP scheduler state dict of /server_info's internal_states."""
        load = self.scheduler.load()
        return {"dp_rank": 0, "tp_size": self.args.tp_size, "weight_version": self.scheduler.weight_version,
                "paused": self.frontend.paused, "forward_steps": self.scheduler.forward_steps,
                "last_gen_throughput": load["gen_throughput"], **load}

    def load_entry(self) -> dict:
        """One entry of /v1/loads' `loads`, every section (this engine is dp_rank 0)."""
        return loads.load_entry(
            self.scheduler.load(), disaggregation_mode=self.args.disaggregation_mode,
            weight_bytes=self.weight_bytes,
            kv_cache_bytes=0 if self.scheduler.pool.released else self.scheduler.pool.nbytes,
            paused=self.frontend.paused)

    def model_dir(self) -> Path:
        """The checkpoint directory currently served."""
        return Path(self.model_path)


def _jsonable(v):
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)

"""Model configuration read from an HF `config.json` (Llama, Qwen2, Qwen3, Qwen3-MoE layouts)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from slime_like.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3MoeForCausalLM",
                           "Qwen3ForCausalLM")
# RoPE variants the pure-torch model implements (anything else would silently differ from HF)
_ROPE_TYPES = (None, "default")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    """The fields of an HF causal-LM config that the pure-torch implementation needs."""

    architecture: str = "LlamaForCausalLM"
    model_type: str = "llama"
    vocab_size: int = 259
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qkv_bias: bool = False  # Qwen2: biases on q/k/v but not o
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    torch_dtype: str = "float32"
    # Qwen3 / Qwen3-MoE only
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen3-MoE's rule for which decoder layers carry experts."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{where}: architectures[0]",
                f"must be one of {list(SUPPORTED_ARCHITECTURES)}, got {arch!r}",
            )
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        if dtype not in _DTYPES:
            raise ConfigError(f"{where}: torch_dtype", f"must be one of {list(_DTYPES)}, got {dtype!r}")
        eos = raw.get("eos_token_id", 2)
        if isinstance(eos, list):
            eos = eos[0]
        is_qwen3 = arch.startswith("Qwen3")
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type"))
        if rope_type not in _ROPE_TYPES:
            raise ConfigError(f"{where}: rope_scaling",
                              f"RoPE type {rope_type!r} is not implemented by the reference "
                              "engine (only the default RoPE)")
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=arch,
            model_type=raw.get("model_type", "llama"),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw.get("intermediate_size", 4 * hidden)),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
            bos_token_id=int(raw.get("bos_token_id") if raw.get("bos_token_id") is not None else 1),
            eos_token_id=int(eos if eos is not None else 2),
            pad_token_id=int(raw.get("pad_token_id") if raw.get("pad_token_id") is not None else 0),
            torch_dtype=dtype,
            qk_norm=is_qwen3,
            num_experts=int(raw.get("num_experts", 0)) if arch == "Qwen3MoeForCausalLM" else 0,
            num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
            mlp_only_layers=list(raw.get("mlp_only_layers") or []),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(str(path), "no config.json in the model directory")
        return cls.from_dict(json.loads(path.read_text()), where=str(path))

    def to_hf_dict(self) -> dict:
        """The config.json an HF loader (transformers, sglang) accepts for this model."""
        d = asdict(self)
        arch = d.pop("architecture")
        d.pop("qk_norm")
        d.pop("qkv_bias")
        if arch != "Qwen3MoeForCausalLM":
            for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
                d.pop(key)
        d["architectures"] = [arch]
        d["hidden_act"] = "silu"
        d["initializer_range"] = 0.02
        d["use_cache"] = True
        d["attention_dropout"] = 0.0
        d["mlp_bias"] = False
        d["rope_scaling"] = None
        return d

"""A pure-torch causal LM with HF parameter names (Llama, Qwen2, Qwen3, Qwen3-MoE layouts).

Used by both sides of a weight sync: the trainer trains it, the reference engine serves it,
and `named_parameters()` yields exactly the names of the HF checkpoint, so buckets,
checksums and safetensors files need no name mapping.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from slime_like.models.config import ModelConfig


class KVCache(Protocol):
    """Storage the engine hands to a forward pass: appends new keys/values, returns all."""

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, Hkv, T_new, D] -> the full [B, Hkv, S, D] for attention."""
        ...


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as HF Llama does (needed for a 1e-5 logits match)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotary_cos_sin(config: ModelConfig, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos/sin tables [B, T, D] for the default (unscaled) RoPE, computed in float32."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta
        ** (torch.arange(0, dim, 2, dtype=torch.int64, device=position_ids.device).float() / dim)
    )
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        qkv_bias = c.attention_bias or c.qkv_bias
        self.q_proj = nn.Linear(c.hidden_size, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c.hidden_size, bias=c.attention_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)

    def forward(self, x, cos, sin, mask, kv_cache: KVCache | None):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        gqa = self.num_heads != self.num_kv_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Qwen3-MoE block: softmax router, top-k experts, experts stored as separate HF tensors."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )

    def forward(self, x):
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        weights = F.softmax(self.gate(h), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(h.dtype)
        out = torch.zeros_like(h)
        for expert_idx in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == expert_idx)
            out.index_add_(0, rows, self.experts[expert_idx](h[rows]) * weights[rows, slot, None])
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            self.mlp = SparseMoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, init_weights: bool = True):
        super().__init__()
        # Uninitialised when the weights come from elsewhere: normal_ on the meta device
        # imports torch._dynamo, 1.7 s of CPU at every engine and trainer start.
        empty = None if init_weights else torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=empty)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder-only LM. `forward` serves training (full causal) and decoding (KV cache)."""

    def __init__(self, config: ModelConfig, init_weights: bool = True):
        """`init_weights=False`: the embedding is left uninitialised (the caller loads or
        overwrites every weight, or only reads shapes on the meta device)."""
        super().__init__()
        self.config = config
        self.model = Backbone(config, init_weights)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V].

        attn_mask: bool [B, 1, T, S] (True = attend), required when rows are padded or a
        cache holds earlier tokens; None means plain causal attention over the T tokens.
        """
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(self.config, position_ids, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn_mask, kv_cache)
        return self.lm_head(self.model.norm(x))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under their checkpoint names (a tied lm_head is left out, as HF does)."""
        return dict(hf_named_parameters(self))


def hf_named_parameters(model: nn.Module):
    """named_parameters() without the tied lm_head duplicate (HF checkpoints omit it)."""
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for name, param in model.named_parameters(remove_duplicate=True):
        if tied and name == "lm_head.weight":
            continue
        yield name, param

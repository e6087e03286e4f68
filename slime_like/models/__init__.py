"""Pure-torch models with HF parameter names, shared by the trainer and the reference engine."""

from slime_like.models.config import ModelConfig
from slime_like.models.loading import build_model, load_pretrained, load_weights
from slime_like.models.tokenizer import ByteTokenizer
from slime_like.models.transformer import CausalLM

__all__ = ["ByteTokenizer", "CausalLM", "ModelConfig", "build_model", "load_pretrained", "load_weights"]

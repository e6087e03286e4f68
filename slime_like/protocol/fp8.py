"""sglang's FP8 block layout (`--quantization fp8` on a block-quantized checkpoint), shared
by the trainer that quantizes and the engine that loads.

A quantized linear weight `W` [N, K] travels as two tensors under sglang's loader names:
`<prefix>.weight`, float8 e4m3 [N, K], and `<prefix>.weight_scale_inv`, float32
[ceil(N/128), ceil(K/128)], one scale per 128x128 block (the last row or column of blocks
may be partial). Dequantized, `W[i, j] = weight[i, j] * weight_scale_inv[i // 128, j // 128]`
(sglang's `block_quant_dequant`); each block's scale is its largest |value| / 448, the
largest e4m3 magnitude, so the block's extreme lands on the format's extreme. The
projections of attention and of every MLP (experts included) are quantized; embeddings,
the LM head, norms, biases and the MoE router stay in the engines' dtype, as sglang's FP8
checkpoints have them.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slime_like.protocol.buckets import TensorMeta

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
SCALE_DTYPE = torch.float32
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
# The smallest scale a block gets: an all-zero block still has a finite, positive scale.
_MIN_AMAX = 1e-12
QUANTIZATIONS = (None, "fp8")

_QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def is_quantized(name: str) -> bool:
    """Whether sglang keeps this HF parameter as FP8 blocks (the linear projections)."""
    return bool(_QUANTIZED.search(name))


def scale_name(name: str) -> str:
    """'...q_proj.weight' -> '...q_proj.weight_scale_inv' (sglang's parameter name)."""
    return name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """The scale grid of a [N, K] weight: (ceil(N/bn), ceil(K/bk))."""
    n, k = shape
    return (-(-n // block[0]), -(-k // block[1]))


def check_quantization(value: str | None, where: str) -> str | None:
    """None or 'fp8'; anything else raises ValueError naming `where`."""
    if value not in QUANTIZATIONS:
        raise ValueError(f"{where}: quantization {value!r} is not supported here; expected "
                         "fp8 (sglang's block FP8) or none")
    return value


@torch.no_grad()
def quantize(weight: torch.Tensor, block: tuple[int, int] = BLOCK,
             out: tuple[torch.Tensor, torch.Tensor] | None = None,
             fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] floating weight -> (e4m3 values [N, K], float32 scales [ceil(N/bn), ceil(K/bk)]),
    computed on the weight's device. scale = block amax / 448; value = w / scale, saturated.
    `out`: tensors of those shapes to write into (a kept quantized copy), returned.
    `fused`: on CUDA, whole blocks in one Triton kernel (`fp8_kernel`; None: where Triton
    is installed), else in torch ops; the same bytes either way."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantization needs a 2-D weight, got shape {list(weight.shape)}")
    n, k = weight.shape
    bn, bk = block
    if out is not None and (tuple(out[0].shape) != (n, k) or out[0].dtype != FP8_DTYPE
                            or tuple(out[1].shape) != scale_shape((n, k), block)
                            or out[1].dtype != SCALE_DTYPE):
        raise ValueError(f"quantize(out=...) needs e4m3 {[n, k]} and float32 "
                         f"{list(scale_shape((n, k), block))}, got {out[0].dtype}"
                         f"{list(out[0].shape)} and {out[1].dtype}{list(out[1].shape)}")
    if weight.is_cuda and not (n % bn or k % bk):
        auto = fused is None
        if auto:
            fused = fused_by_default()
        if fused and _fused_layout(weight, out):
            try:
                return _quantize_fused(weight, block, out)
            except Exception as e:  # Triton could not build or launch the kernel here
                if not auto:
                    raise
                _give_up_fused(e)
        return _quantize_whole_blocks(weight, block, out)
    values, scale = _quantize_float32(weight, block)
    if out is None:
        return values, scale
    out[0].copy_(values)
    out[1].copy_(scale)
    return out


_fused_failure: str | None = None  # why the fused kernel could not run in this process


def _fused_layout(weight: torch.Tensor,
                  out: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """Whether the kernel can address these tensors (rows contiguous, scales contiguous);
    a view that is not goes through torch ops, without giving up the kernel for the rest."""
    return weight.stride(1) == 1 and (out is None or (out[0].stride(1) == 1
                                                      and out[1].is_contiguous()))


def _give_up_fused(error: Exception) -> None:
    """The fused kernel failed (no C compiler for Triton's launcher, an unsupported GPU):
    say so once, and quantize in torch ops from now on (the same bytes, slower)."""
    global _fused_failure
    _fused_failure = f"{type(error).__name__}: {error}"
    log.warning("the fused FP8 quantize kernel (Triton) failed, so this process quantizes "
                "in torch ops from now on: %s", _fused_failure)


def _quantize_fused(weight: torch.Tensor, block: tuple[int, int],
                    out: tuple[torch.Tensor, torch.Tensor] | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    from slime_like.protocol import fp8_kernel  # imports Triton: only where it runs

    n, k = weight.shape
    values, scale = out if out is not None else (
        torch.empty((n, k), dtype=FP8_DTYPE, device=weight.device),
        torch.empty(scale_shape((n, k), block), dtype=SCALE_DTYPE, device=weight.device))
    fp8_kernel.quantize_blocks(weight, values, scale, block, FP8_MAX, _MIN_AMAX)
    return values, scale


def fused_by_default() -> bool:
    """What `quantize(fused=None)` picks for whole blocks on CUDA now: the fused kernel where
    Triton is installed and the kernel has not failed in this process."""
    return triton_installed() and _fused_failure is None


@functools.cache
def triton_installed() -> bool:
    """Whether the fused GPU kernel can be imported (Triton, which CUDA builds of torch
    bring); asked without importing it, which would cost every process a fifth of a second."""
    return importlib.util.find_spec("triton") is not None


def _quantize_float32(weight: torch.Tensor, block: tuple[int, int],
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` on a float32 copy of the weight (a CPU's way, and any partial block's)."""
    n, k = weight.shape
    bn, bk = block
    # One float32 copy, worked on in place: each further step is a single pass over it
    # (a mixed-dtype division straight from bf16 was ten times slower on CPU).
    if n % bn or k % bk:
        padded = F.pad(weight.to(torch.float32), (0, -k % bk, 0, -n % bn))
    else:
        padded = weight.to(torch.float32, copy=True)
    tiles = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    amax = torch.maximum(tiles.amax(dim=(1, 3)), tiles.amin(dim=(1, 3)).neg_())
    scale = amax.clamp_(min=_MIN_AMAX).div_(FP8_MAX)
    # |w / scale| <= 448 up to float32 rounding, and e4m3 rounds anything below 464 to
    # 448: finite weights need no saturation pass.
    values = tiles.div_(scale[:, None, :, None]).to(FP8_DTYPE).view(padded.shape)
    return (values if values.shape == weight.shape else values[:n, :k].contiguous()), scale


def _quantize_whole_blocks(weight: torch.Tensor, block: tuple[int, int],
                           out: tuple[torch.Tensor, torch.Tensor] | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` in two passes over the weight and no float32 copy (a GPU's way): the block
    amax is one reduction (the inf-norm, in float32), and the division reads the weight in
    its own dtype, computes in float32 and writes e4m3 in the same kernel. The same bytes as
    the float32 path: every step is exact but the division, done in float32 in both. On a
    CPU the float32 copy is faster, which is why only CUDA weights come here."""
    n, k = weight.shape
    bn, bk = block
    tiles = weight.view(n // bn, bn, k // bk, bk)
    amax = torch.linalg.vector_norm(tiles, ord=float("inf"), dim=(1, 3), dtype=torch.float32,
                                    out=None if out is None else out[1])
    scale = amax.clamp_(min=_MIN_AMAX).div_(FP8_MAX)
    values = torch.empty((n, k), dtype=FP8_DTYPE, device=weight.device) if out is None \
        else out[0]
    torch.div(tiles, scale[:, None, :, None], out=values.view(n // bn, bn, k // bk, bk))
    return values, scale


def expand_scale(scale: torch.Tensor, shape: tuple[int, int],
                 block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """Per-block scales repeated to one per element of a [N, K] weight."""
    n, k = shape
    return scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:n, :k]


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """e4m3 values and block scales -> the weight in `dtype` (multiplied in float32, as
    sglang's `block_quant_dequant`)."""
    expected = scale_shape(tuple(values.shape), block)
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale grid {list(scale.shape)} does not fit a weight of shape "
                         f"{list(values.shape)} in {block[0]}x{block[1]} blocks (expected "
                         f"{list(expected)})")
    n, k = values.shape
    if n % block[0] == 0 and k % block[1] == 0:  # whole blocks: the scales broadcast
        tiles = values.view(n // block[0], block[0], k // block[1], block[1])
        return (tiles.float() * scale.float()[:, None, :, None]).to(dtype).view(n, k)
    return (values.float() * expand_scale(scale.float(), (n, k), block)).to(dtype)


def quantized_metadata(metas: Iterable[TensorMeta], dtype: torch.dtype,
                       block: tuple[int, int] = BLOCK) -> list[TensorMeta]:
    """What a quantized sync sends for these parameters: each quantized weight as its e4m3
    values followed by its scales; every other floating tensor in `dtype`."""
    out = []
    for m in metas:
        if is_quantized(m.name) and len(m.shape) == 2:
            out.append(TensorMeta(m.name, FP8_DTYPE, m.shape))
            out.append(TensorMeta(scale_name(m.name), SCALE_DTYPE, scale_shape(m.shape, block)))
        else:
            out.append(TensorMeta(m.name, dtype if m.dtype.is_floating_point else m.dtype,
                                  m.shape))
    return out


@dataclass(frozen=True)
class Partition:
    """One TP rank's share of a quantized weight: rows [r0, r1) and columns [c0, c1)."""

    rank: int
    rows: tuple[int, int]
    cols: tuple[int, int]


_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$")
_MERGED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
           "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def partitions(name: str, shape: tuple[int, int], tp_size: int) -> list[Partition]:
    """Each TP rank's slice of a quantized weight, as sglang splits it: the output rows of a
    column-parallel projection (q/k/v, gate/up), the input columns of a row-parallel one
    (o, down). (KV heads fewer than the ranks, which sglang replicates, are not modelled.)"""
    n, k = shape
    if _COLUMN.search(name):
        rows = n // tp_size
        return [Partition(r, (r * rows, (r + 1) * rows), (0, k)) for r in range(tp_size)]
    cols = k // tp_size
    return [Partition(r, (0, n), (r * cols, (r + 1) * cols)) for r in range(tp_size)]


def block_split_problems(named_shapes: Iterable[tuple[str, tuple[int, ...]]], tp_size: int,
                         block: tuple[int, int] = BLOCK) -> list[str]:
    """sglang's rule for block-quantized weights under TP (`validate_block_quant_shapes`):
    every rank's share of a split dimension, and every part of a merged projection
    (qkv, gate_up) even at TP 1, is a whole number of blocks. One line per weight that
    breaks it."""
    problems = []
    for name, shape in named_shapes:
        if not is_quantized(name) or len(shape) != 2:
            continue
        n, k = shape
        merged = _MERGED.get(name.rsplit(".", 2)[-2])
        for part in partitions(name, (n, k), tp_size):
            rows, cols = part.rows[1] - part.rows[0], part.cols[1] - part.cols[0]
            if (merged or tp_size > 1) and _COLUMN.search(name) and rows % block[0]:
                problems.append(f"{name}: {rows} output rows per rank (of {n}, TP {tp_size}"
                                f"{', merged into ' + merged if merged else ''}) are not a "
                                f"multiple of block_n {block[0]}")
                break
            if tp_size > 1 and not _COLUMN.search(name) and cols % block[1]:
                problems.append(f"{name}: {cols} input columns per rank (of {k}, TP "
                                f"{tp_size}) are not a multiple of block_k {block[1]}")
                break
    return problems


def shard(values: torch.Tensor, scale: torch.Tensor, part: Partition,
          block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's values and the scale blocks that cover them (whole blocks: see
    `block_split_problems`)."""
    (r0, r1), (c0, c1) = part.rows, part.cols
    return (values[r0:r1, c0:c1],
            scale[r0 // block[0]:-(-r1 // block[0]), c0 // block[1]:-(-c1 // block[1])])

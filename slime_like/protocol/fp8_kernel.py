"""sglang's FP8 block quantization as one GPU kernel (Triton): each 128x128 block is read
once, its amax, scale and e4m3 values computed in registers, and both written.

Why: on CUDA, `fp8.quantize` in torch ops is a reduction kernel and a division kernel, each
reading the whole weight, and the reduction over a block's two strided dimensions runs well
below the card's bandwidth. A dense 7B model's projections took about 40 ms that way on an
H100, so the FP8 sync from the kept copy was 3.8x the bf16 one; the sync's floor is one read
of the bf16 weights and one write of the FP8 bytes.

The result is the same bytes as the torch path on the same GPU (`fp8._quantize_float32`):
the amax is exact; the scale is the amax times the float32 reciprocal of 448, because that
is how torch on CUDA divides a tensor by a Python number (checked on an H100: an IEEE
division gives other scales in some blocks); the values are divided by the scale with IEEE
round-to-nearest (`div_rn`, as torch divides a tensor by a tensor, not the fast approximate
division), and the cast to e4m3 rounds to nearest even. Only whole blocks of a
2-D CUDA weight come here; Triton is optional (the torch path runs where it is missing),
and this module is imported only when a CUDA weight is quantized.
"""

from __future__ import annotations

import functools

import torch

try:  # Triton ships with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    """Whether the fused kernel can run here (Triton imports and a CUDA device exists)."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _quantize_blocks(weight, values, scales, n_col_blocks, weight_row_stride,
                         values_row_stride, inv_fp8_max, min_amax,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One program per block: read it once, write its e4m3 values and its scale."""
        block_row = tl.program_id(0)
        block_col = tl.program_id(1)
        rows = (block_row * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        cols = (block_col * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
        x = tl.load(weight + rows[:, None] * weight_row_stride + cols[None, :]).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        scale = tl.maximum(amax, min_amax) * inv_fp8_max
        quantized = tl.math.div_rn(x, scale).to(tl.float8e4nv, fp_downcast_rounding="rtne")
        tl.store(values + rows[:, None] * values_row_stride + cols[None, :], quantized)
        tl.store(scales + block_row * n_col_blocks + block_col, scale)


@functools.cache
def _float32_reciprocal(x: float) -> float:
    """1/x rounded to float32, as torch on CUDA divides a tensor by a number (a reciprocal,
    then one multiplication); once per value, not a host tensor per weight per sync."""
    return (torch.ones((), dtype=torch.float32) / x).item()


@functools.cache
def _num_warps(block: tuple[int, int]) -> int:
    """Eight warps for sglang's 128x128 blocks: 64 float32 values a thread."""
    return max(1, min(8, block[0] * block[1] // 2048))


def quantize_blocks(weight: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                    block: tuple[int, int], fp8_max: float, min_amax: float) -> None:
    """Write `weight`'s e4m3 values and float32 block scales into `values` and `scales`.

    `weight` is 2-D on CUDA, rows contiguous, both sides whole multiples of `block`;
    `values` ([N, K], e4m3, rows contiguous) and `scales` ([N/bn, K/bk], float32,
    contiguous) are on its device."""
    if triton is None:
        raise RuntimeError("the fused FP8 kernel needs Triton, which is not installed here "
                           "(quantize with fused=False)")
    n, k = weight.shape
    bn, bk = block
    if n % bn or k % bk:
        raise ValueError(f"the fused FP8 kernel takes whole {bn}x{bk} blocks, got a weight of "
                         f"shape {[n, k]}")
    for name, t in (("weight", weight), ("values", values)):
        if t.stride(1) != 1:
            raise ValueError(f"the fused FP8 kernel needs {name}'s rows contiguous, got "
                             f"strides {list(t.stride())}")
    if not scales.is_contiguous():
        raise ValueError("the fused FP8 kernel needs contiguous scales")
    grid = (n // bn, k // bk)
    _quantize_blocks[grid](weight, values, scales, k // bk, weight.stride(0), values.stride(0),
                           _float32_reciprocal(fp8_max), min_amax, BLOCK_N=bn, BLOCK_K=bk,
                           num_warps=_num_warps(block))

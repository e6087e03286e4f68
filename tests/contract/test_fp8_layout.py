"""Our FP8 block layout (`protocol/fp8.py`) against sglang 0.5.23's own block-FP8 code.

sglang's quantization modules import CUDA kernels at module level, so they do not import on
a CPU machine; the functions that define the layout are plain torch, so each is taken from
sglang's installed source by name (its `def` alone, through `ast`) and run here as sglang
wrote it: `block_quant_dequant` (how a value and its block scale make the weight),
`per_block_cast_to_fp8` (how sglang itself block-quantizes a weight), and
`Fp8LinearMethod.validate_block_quant_shapes` (which TP splits of blocks it refuses).
"""

from __future__ import annotations

import ast
import importlib.util
import math
import typing
from pathlib import Path

import pytest
import torch

from slime_like.protocol import fp8


def _sglang_dir() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23; "
                    "scripts/env.sh does it with SLIME_LIKE_SGLANG=1)")
    return Path(next(iter(spec.submodule_search_locations)))


def _source_of(relpath: str, name: str, owner: str | None = None) -> ast.FunctionDef:
    tree = ast.parse((_sglang_dir() / relpath).read_text())
    scope = tree.body
    if owner is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner).body
    found = [n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"sglang's {relpath} has no {owner + '.' if owner else ''}{name}"
    node = found[0]
    node.decorator_list = []
    return node


def _sglang_function(relpath: str, name: str, owner: str | None = None, **names):
    """sglang's function `name` compiled from its own source, with `names` as globals."""
    module = ast.Module(body=[_source_of(relpath, name, owner)], type_ignores=[])
    scope = {"torch": torch, "List": list, "Tuple": tuple, "Optional": typing.Optional,
             **names}
    exec(compile(module, f"sglang/{relpath}", "exec"), scope)  # noqa: S102 - sglang's code
    return scope[name]


FP8_UTILS = "srt/layers/quantization/fp8_utils.py"


@pytest.fixture(scope="module")
def sglang_fp8() -> dict:
    common = "srt/utils/common.py"
    ceil_div = _sglang_function(common, "ceil_div")
    ceil_align = _sglang_function(common, "ceil_align", ceil_div=ceil_div)
    ceil_to_ue8m0 = _sglang_function(FP8_UTILS, "ceil_to_ue8m0")
    return {
        "block_quant_dequant": _sglang_function(FP8_UTILS, "block_quant_dequant"),
        "per_block_cast_to_fp8": _sglang_function(FP8_UTILS, "per_block_cast_to_fp8",
                                                  ceil_align=ceil_align,
                                                  ceil_to_ue8m0=ceil_to_ue8m0),
        "validate": _sglang_function("srt/layers/quantization/fp8.py",
                                     "validate_block_quant_shapes", owner="Fp8LinearMethod",
                                     print_warning_once=print),
    }


# Several blocks in both dimensions, partial blocks at the bottom and right edges.
SHAPE = (300, 520)


def test_our_dequantize_is_sglangs_on_our_values_and_on_sglangs(sglang_fp8):
    w = torch.randn(SHAPE) * torch.logspace(-3, 0, SHAPE[1])  # blocks of very different range
    values, scale = fp8.quantize(w)
    assert values.dtype == torch.float8_e4m3fn and tuple(values.shape) == SHAPE
    assert scale.dtype == torch.float32 and tuple(scale.shape) == (3, 5) == fp8.scale_shape(SHAPE)
    whole = fp8.quantize(w[:256, :512])  # whole blocks take another path of ours
    for v, s in ((values, scale), whole):
        for dtype in (torch.float32, torch.bfloat16):
            ours = fp8.dequantize(v, s, dtype)
            theirs = sglang_fp8["block_quant_dequant"](v, s, list(fp8.BLOCK), dtype)
            assert torch.equal(ours, theirs), (tuple(v.shape), dtype)
    # a weight sglang quantized itself (its DeepGEMM path: power-of-two scales) reads back
    # through ours exactly as through sglang's
    their_values, their_scale = sglang_fp8["per_block_cast_to_fp8"](w.bfloat16())
    assert their_values.dtype == values.dtype and their_scale.shape == scale.shape
    assert torch.equal(fp8.dequantize(their_values, their_scale, torch.float32),
                       sglang_fp8["block_quant_dequant"](their_values, their_scale,
                                                         list(fp8.BLOCK), torch.float32))


def test_scale_inv_is_block_amax_over_448_and_values_saturate_at_the_block_extreme():
    w = torch.randn(SHAPE)
    w[:128, :128] = 0.0  # an all-zero block stays finite and dequantizes to zero
    values, scale = fp8.quantize(w)
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            tile = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            q = values[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].float()
            amax = float(tile.abs().max())
            if amax == 0.0:
                assert float(q.abs().max()) == 0.0 and scale[bi, bj] > 0
                continue
            assert math.isclose(float(scale[bi, bj]), amax / 448.0, rel_tol=1e-6)
            assert float(q.abs().max()) == 448.0
    # e4m3 keeps 3 mantissa bits: every value within 2^-4 of its magnitude (plus the
    # smallest subnormal step of its block)
    back = fp8.dequantize(values, scale, torch.float32)
    step = fp8.expand_scale(scale, SHAPE) * 2.0 ** -9
    assert bool(((back - w).abs() <= w.abs() * 2.0 ** -4 + step).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gpus_two_pass_quantize_makes_the_same_bytes_as_the_float32_one(dtype):
    """CUDA weights take the two-pass form (no float32 copy); the trainer's check and the
    engines must still see the same bytes whichever device quantized. Run here on CPU by
    calling that form directly, and on CUDA by the GPU tests."""
    w = (torch.randn(384, 640) * torch.logspace(-4, 0, 640)).to(dtype)
    w[:128, :128] = 0.0
    values, scale = fp8._quantize_float32(w, fp8.BLOCK)
    values2, scale2 = fp8._quantize_whole_blocks(w, fp8.BLOCK)
    assert torch.equal(scale, scale2)
    assert torch.equal(values.view(torch.uint8), values2.view(torch.uint8))


class _Layer:
    def __init__(self, tp: int):
        self.tp_group = type("G", (), {"world_size": tp})()


class _Config:
    weight_block_size = list(fp8.BLOCK)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_block_split_rule_matches_sglangs(sglang_fp8, tp):
    """Every weight of a multi-block model and of one whose MLP splits blocks: refused by
    sglang exactly when `block_split_problems` names it."""
    validate = sglang_fp8["validate"]
    # (name, [N, K], sglang's output partition sizes of the merged layer it belongs to)
    cases = [("layers.0.self_attn.q_proj.weight", (256, 256), [256, 256, 256]),
             ("layers.0.self_attn.o_proj.weight", (256, 256), None),
             ("layers.0.mlp.gate_proj.weight", (512, 256), [512, 512]),
             ("layers.0.mlp.down_proj.weight", (256, 512), None),
             ("layers.0.mlp.gate_proj.weight", (384, 256), [384, 384]),
             ("layers.0.mlp.down_proj.weight", (256, 384), None),
             ("layers.0.mlp.up_proj.weight", (192, 256), [192, 192])]
    for name, (n, k), merged in cases:
        column = merged is not None
        out_parts = [m // tp for m in merged] if column else [n]
        try:
            validate(_Layer(tp), _Config(), k, k if column else k // tp,
                     sum(merged) if column else n, sum(out_parts), out_parts)
            refused = False
        except ValueError:
            refused = True
        ours = fp8.block_split_problems([(name, (n, k))], tp)
        assert refused == bool(ours), (name, n, k, tp, ours)


def test_sglang_registers_values_and_scales_under_the_names_we_send():
    """sglang's FP8 linear method registers `weight` (e4m3) and `weight_scale_inv` (float32,
    one per block, ceil-divided) on each layer: the HF names a checkpoint carries."""
    node = _source_of("srt/layers/quantization/fp8.py", "create_fp8_weight_",
                      owner="Fp8LinearMethod")
    text = ast.unparse(node)
    assert "register_parameter('weight_scale_inv', scale)" in text
    assert "register_parameter('weight', weight)" in text
    assert "torch.float8_e4m3fn if is_checkpoint_fp8_serialized" in text
    assert "(output_size_per_partition + block_n - 1) // block_n" in text
    assert "(input_size_per_partition + block_k - 1) // block_k" in text
    assert "torch.float32" in text
    assert fp8.scale_name("model.layers.0.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight_scale_inv"

"""The 128x128-block FP8 weight format (DeepSeek-V3, Kimi-K2; transformers' FineGrainedFP8 `quant_method: fp8`
with `weight_block_size`): E4M3 weights with one float32 dequantization scale per 128x128 block.

The checkpoint stores every FP8 Linear as `<module>.weight` (float8_e4m3fn, [out, in]) and
`<module>.weight_scale_inv` (float32, [ceil(out/128), ceil(in/128)]); the bf16 weight is the block's FP8
values times its scale (`weight_scale_inv` is the dequantization multiplier, despite its name). Where a
dimension is not a multiple of 128, its last block is partial: DeepSeek's README_WEIGHTS.md says such a block
is zero-padded to 128 before its scale is computed and the padding removed after quantization. In DeepSeek-V3
and Kimi-K2 that happens once per layer: `self_attn.kv_a_proj_with_mqa` is [576, 7168] with scales [5, 56]
(rows 512..575 share the fifth scale row).

transformers 5.25 dequantizes FP8 checkpoints itself where it cannot keep them in FP8 (no CUDA/XPU device,
or `FineGrainedFP8Config(dequantize=True)`), in `integrations.finegrained_fp8.Fp8Dequantize._dequantize_one`.
That function derives the block shape from the scale grid alone (rows // scale_rows), which is right only for
whole blocks: [576, 7168] with [5, 56] scales raises ("not divisible by scale grid"), and a partial block that
happens to divide evenly is silently mis-scaled (the stand-in's [192, 256] with [2, 2] scales is read as two
96-row blocks: rows 96..127 get the second block's scale). `exact_block_dequantize()` is a scope, for a
family's `PreparedLoad.conversion_scope`, in which that function dequantizes 128x128 blocks (the quantization
config's `weight_block_size`) with the partial last block, and otherwise does what transformers does.
"""

from __future__ import annotations

import contextlib
import threading

import torch

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 (fn) value


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(out_features: int, in_features: int, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[int, int]:
    """Shape of `weight_scale_inv` for an [out, in] weight: one scale per (partial) block."""
    return ceil_div(out_features, block[0]), ceil_div(in_features, block[1])


def expand_scales(scale_inv: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int] = (BLOCK, BLOCK)
                  ) -> torch.Tensor:
    """The per-block scales [..., R, C] repeated over their blocks and cut to the weight's `shape` [..., out, in]."""
    rows, cols = shape[-2:]
    expected = scale_shape(rows, cols, block)
    if tuple(scale_inv.shape[-2:]) != expected:
        raise ValueError(f"scales {tuple(scale_inv.shape)} do not cover a weight {tuple(shape)} in {block[0]}x"
                         f"{block[1]} blocks (expected {expected})")
    s = scale_inv.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return s[..., :rows, :cols]


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 weight, float32 scale_inv) of a 2D float weight: per block, scale = amax / 448 (1 for an all-zero
    block), weight / scale rounded to E4M3. The partial last blocks are quantized as if zero-padded."""
    if weight.ndim != 2:
        raise ValueError(f"quantize_blocks takes a 2D weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    R, C = scale_shape(rows, cols, block)
    padded = torch.zeros(R * block[0], C * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    amax = padded.view(R, block[0], C, block[1]).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (weight.float() / expand_scales(scale, (rows, cols), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                      block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """The weight [..., out, in] as `dtype`: FP8 values times their block's scale, multiplied in float32 and
    then cast (as transformers does for whole blocks)."""
    return (weight.float() * expand_scales(scale_inv.float(), tuple(weight.shape), block)).to(dtype)


def _covers_in_blocks(weight: torch.Tensor, scales: torch.Tensor, block) -> bool:
    """Whether `scales` is the ceil-divided grid of `weight` in `block`-shaped blocks (DeepSeek's layout)."""
    if block is None or len(block) != 2 or scales.ndim < 2 or weight.ndim < 2:
        return False
    if weight.element_size() != 1 or not weight.dtype.is_floating_point or not scales.dtype.is_floating_point:
        return False
    return tuple(scales.shape[-2:]) == scale_shape(weight.shape[-2], weight.shape[-1], tuple(block))


_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = 0
_ORIGINAL = None


def _exact_dequantize_one(self, quantized, scales, output_dtype=None):
    """`Fp8Dequantize._dequantize_one` for 128x128-block FP8 weights (partial last blocks included); anything
    else (MXFP4/FP4 experts, per-tensor scales, other grids) goes to transformers' own code."""
    config = getattr(getattr(self, "hf_quantizer", None), "quantization_config", None)
    block = getattr(config, "weight_block_size", None)
    if not _covers_in_blocks(quantized, scales, block):
        return _ORIGINAL(self, quantized, scales, output_dtype=output_dtype)
    if output_dtype is None:  # transformers' default: the scales' dtype when it is a float of 2+ bytes
        output_dtype = scales.dtype if scales.element_size() >= 2 else torch.bfloat16
    return dequantize_blocks(quantized, scales, output_dtype, tuple(block))


@contextlib.contextmanager
def exact_block_dequantize():
    """Scope in which transformers' FP8 dequantization (`Fp8Dequantize`) handles partial 128x128 blocks as
    DeepSeek's checkpoints store them (see the module doc). Re-entrant; restores transformers' function on exit
    of the outermost scope."""
    global _PATCH_DEPTH, _ORIGINAL
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    with _PATCH_LOCK:
        if _PATCH_DEPTH == 0:
            _ORIGINAL = Fp8Dequantize._dequantize_one
            Fp8Dequantize._dequantize_one = _exact_dequantize_one
        _PATCH_DEPTH += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCH_DEPTH -= 1
            if _PATCH_DEPTH == 0:
                Fp8Dequantize._dequantize_one = _ORIGINAL
                _ORIGINAL = None

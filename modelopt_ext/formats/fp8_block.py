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

The same scope makes sharded loads exact (FSDP dense layers). transformers shards on read
(`distributed.sharding_utils.DtensorShardOperation`) every source tensor of a sharded parameter with that
parameter's placement, the FP8 weight's scale grid too, before `Fp8Dequantize` pairs them: a rank holding rows
96..191 of a [192, 256] weight got scale row 1 of [2, 2] instead of rows 0 and 1. In the scope, a scale grid
sharded for its weight's parameter is instead cut to the blocks of the rows and columns this rank's weight shard
holds, one scale per row (per column) along a dimension the shard does not hold whole (`shard_block_scales`), and
the dequantization reads such a scale with a block of 1 along that dimension. Every rank's dequantized shard is
then the same bytes as the rows of the whole weight's dequantization.
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


def _block_of(weight: torch.Tensor, scales: torch.Tensor, block) -> tuple[int, int] | None:
    """The block `scales` has over `weight` per dimension: `block`'s size where the scales are the ceil-divided grid
    (DeepSeek's layout), 1 where they hold one scale per row or column (a shard's, `shard_block_scales`); None
    for anything else (another format's scales)."""
    if block is None or len(block) != 2 or scales.ndim < 2 or weight.ndim < 2:
        return None
    if weight.element_size() != 1 or not weight.dtype.is_floating_point or not scales.dtype.is_floating_point:
        return None
    found = []
    for size, scale_size, b in zip(weight.shape[-2:], scales.shape[-2:], block):
        if scale_size == ceil_div(size, b):
            found.append(int(b))
        elif scale_size == size:
            found.append(1)
        else:
            return None
    return found[0], found[1]


_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = 0
_ORIGINAL: dict = {}  # transformers' functions while the scope is active


def _exact_dequantize_one(self, quantized, scales, output_dtype=None):
    """`Fp8Dequantize._dequantize_one` for 128x128-block FP8 weights (partial last blocks included); anything
    else (MXFP4/FP4 experts, per-tensor scales, other grids) goes to transformers' own code."""
    config = getattr(getattr(self, "hf_quantizer", None), "quantization_config", None)
    block = _block_of(quantized, scales, getattr(config, "weight_block_size", None))
    if block is None:
        return _ORIGINAL["dequantize_one"](self, quantized, scales, output_dtype=output_dtype)
    if output_dtype is None:  # transformers' default: the scales' dtype when it is a float of 2+ bytes
        output_dtype = scales.dtype if scales.element_size() >= 2 else torch.bfloat16
    return dequantize_blocks(quantized, scales, output_dtype, block)


def shard_block_scales(scales: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shape: tuple[int, int],
                       block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """The scales of the shard of a `shape` weight that holds rows `rows` and columns `cols` (index tensors, in
    order), from the whole weight's grid `scales`: the grid's rows (columns) where the shard holds every row
    (column), else one scale per held row (column), the scale of its block."""
    if tuple(scales.shape) != scale_shape(*shape, block):
        raise ValueError(f"scales {tuple(scales.shape)} do not cover a weight {tuple(shape)} in {block[0]}x"
                         f"{block[1]} blocks")
    for dim, index in ((0, rows), (1, cols)):
        if index.numel() != shape[dim] or not torch.equal(index, torch.arange(shape[dim])):
            scales = scales.index_select(dim, torch.div(index, block[dim], rounding_mode="floor"))
    return scales


def _param_shape_init(self, param, *args, **kwargs):
    """`DtensorShardOperation.__init__`, keeping the parameter's global shape for `_shard_tensor`."""
    _ORIGINAL["shard_init"](self, param, *args, **kwargs)
    self.modelopt_ext_param_shape = tuple(param.shape)


def _shard_tensor(self, source, tensor_idx=None, device=None, dtype=None):
    """`DtensorShardOperation.shard_tensor`; for the block-scale grid of a sharded 2D weight, the scales of this
    rank's weight shard (`shard_block_scales`) instead of the grid cut by the weight's placement."""
    original = _ORIGINAL["shard_tensor"]
    shape = getattr(self, "modelopt_ext_param_shape", None)
    source_shape = tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())
    if (shape is None or len(shape) != 2 or len(source_shape) != 2 or source_shape == shape
            or source_shape != scale_shape(*shape)):
        return original(self, source, tensor_idx=tensor_idx, device=device, dtype=dtype)
    # the rows and columns the weight's shard holds: the same placement applied to index grids (views, no copy)
    rows = original(self, torch.arange(shape[0]).unsqueeze(1).expand(shape), tensor_idx=tensor_idx)
    cols = original(self, torch.arange(shape[1]).unsqueeze(0).expand(shape), tensor_idx=tensor_idx)
    if rows is None:  # (not this rank's slice of a list: only for stacked parameters, never a 2D weight's)
        return None
    held_rows = rows[:, 0] if rows.shape[1] else torch.zeros(0, dtype=torch.long)
    held_cols = cols[0, :] if cols.shape[0] else torch.arange(shape[1])[:cols.shape[1]]
    scales = source[...] if not isinstance(source, torch.Tensor) else source
    return shard_block_scales(scales, held_rows, held_cols, shape).to(device=device, dtype=dtype)


@contextlib.contextmanager
def exact_block_dequantize():
    """Scope in which transformers' FP8 dequantization (`Fp8Dequantize`) handles partial 128x128 blocks as
    DeepSeek's checkpoints store them, and its shard-on-read gives each rank its weight shard's scales (see the
    module doc). Re-entrant; restores transformers' function on exit
    of the outermost scope."""
    global _PATCH_DEPTH
    from transformers.distributed.sharding_utils import DtensorShardOperation
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    patches = {"dequantize_one": (Fp8Dequantize, "_dequantize_one", _exact_dequantize_one),
               "shard_init": (DtensorShardOperation, "__init__", _param_shape_init),
               "shard_tensor": (DtensorShardOperation, "shard_tensor", _shard_tensor)}
    with _PATCH_LOCK:
        if _PATCH_DEPTH == 0:
            for name, (cls, attr, ours) in patches.items():
                _ORIGINAL[name] = getattr(cls, attr)
                setattr(cls, attr, ours)
        _PATCH_DEPTH += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCH_DEPTH -= 1
            if _PATCH_DEPTH == 0:
                for name, (cls, attr, _) in patches.items():
                    setattr(cls, attr, _ORIGINAL.pop(name))

"""MXFP4 -> 16-bit dequantization as one Triton kernel (CUDA only; imported lazily).

Each program decodes BLOCK packed bytes (2 * BLOCK values): both E2M1 nibbles of a byte (low first), times
the byte's group scale 2 ** (s - 127), stored interleaved in the output dtype. One read of the packed bytes
and scales, one write of the result: the memory traffic of the output alone, about 4.25 / 16 more.
Bit-identical to `formats.mxfp4.dequantize_mxfp4` (float32 products of a power of two and an E2M1 value are
exact, and so is their rounding to bf16 / fp16 within range).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BYTES_PER_GROUP = 16  # 32 values per scale, two values per byte
BLOCK = 2048


@triton.jit
def _e2m1(code):
    magnitude_code = code & 7
    exponent = magnitude_code >> 1
    half = (magnitude_code & 1).to(tl.float32) * 0.5
    power = tl.where(exponent == 1, 1.0, tl.where(exponent == 2, 2.0, 4.0))
    magnitude = tl.where(exponent == 0, half, power * (1.0 + half))
    # times -1.0 rather than negated: Triton negates as 0 - x, which would turn code 8 (-0.0) into +0.0
    return magnitude * tl.where((code & 8) != 0, -1.0, 1.0)


@triton.jit
def _dequantize_kernel(packed_ptr, scale_ptr, out_ptr, n_bytes, BLOCK: tl.constexpr, GROUP_BYTES: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_bytes
    byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
    s = tl.load(scale_ptr + offs // GROUP_BYTES, mask=mask, other=127).to(tl.int32)
    pow2 = tl.where(s == 0, 1 << 22, s << 23).to(tl.float32, bitcast=True)
    values = tl.interleave(_e2m1(byte & 15) * pow2, _e2m1(byte >> 4) * pow2)
    out_offs = pid * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + out_offs, values.to(out_ptr.dtype.element_ty), mask=out_offs < 2 * n_bytes)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed uint8 [..., B], scale uint8 [..., B / 16] -> [..., 2B] in `dtype` (CUDA tensors)."""
    packed, scale = packed.contiguous(), scale.contiguous()
    out = torch.empty(*packed.shape[:-1], 2 * packed.shape[-1], dtype=dtype, device=packed.device)
    n = packed.numel()
    if n:
        _dequantize_kernel[(triton.cdiv(n, BLOCK),)](packed, scale, out, n, BLOCK=BLOCK,
                                                      GROUP_BYTES=BYTES_PER_GROUP)
    return out

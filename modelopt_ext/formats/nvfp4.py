"""NVFP4 fake quantization in plain torch (any device): what an engine computes from a tensor and its
per-tensor amax, for quality measurements where ModelOpt's NVFP4 fake quantization needs CUDA (ModelOpt 0.47's
dynamic block quantization asserts on CPU tensors).

Rule (NVFP4, as ModelOpt exports it and the engines apply it): a per-tensor scale s2 = amax / (6 x 448);
per block of 16 along the last dim, the scale E4M3(block amax / 6 / s2) (round to nearest, at most 448);
values divided by block scale x s2, rounded to the nearest E2M1 value (ties to even, saturating at 6),
multiplied back. A block of zeros stays zero.
"""

from __future__ import annotations

import torch

from .mxfp4 import e2m1_magnitude_codes

BLOCK = 16
E2M1_MAX, E4M3_MAX = 6.0, 448.0
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fake_quantize_nvfp4(x: torch.Tensor, amax: torch.Tensor | float) -> torch.Tensor:
    """x quantized to NVFP4 under per-tensor `amax` and dequantized, in x's dtype (fp32 arithmetic)."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs the last dim to be a multiple of {BLOCK}, got shape {tuple(x.shape)}")
    amax = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
    s2 = amax / (E2M1_MAX * E4M3_MAX)
    blocks = x.float().reshape(-1, BLOCK)
    scale = (blocks.abs().amax(dim=-1, keepdim=True) / E2M1_MAX / s2).clamp(max=E4M3_MAX)
    scale = scale.to(torch.float8_e4m3fn).float() * s2
    y = torch.where(scale > 0, blocks / torch.where(scale > 0, scale, 1.0), 0.0)
    table = torch.tensor(_MAGNITUDES, device=x.device)
    q = table[e2m1_magnitude_codes(y.abs())].copysign(y)
    return (q * scale).reshape(x.shape).to(x.dtype)

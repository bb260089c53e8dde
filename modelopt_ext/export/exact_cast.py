"""MXFP4 -> NVFP4 without new error: the same 4-bit codes, block scales that multiply out to the source's.

An MXFP4 weight stores E2M1 codes with one E8M0 scale 2^e per 32 elements; NVFP4 stores E2M1 codes with one
E4M3 scale per 16 elements times one fp32 scale per tensor (`weight_scale_2`). Both pack two codes a byte, low
nibble first, so the packed bytes carry over as they are. With a per-tensor scale 2^k, each 16-block's scale
is 2^(e - k), which E4M3 holds exactly from 2^-9 (its smallest subnormal) to 2^8. Choosing k = e_max - 8
(e_max over the blocks holding a non-zero code) makes every block exact when e_max - e_min <= 17; blocks of
zero codes take any scale in range. Where the range is wider, the cast is not exact and `cast_pair` returns
None: the exporter then keeps ModelOpt's calibrated quantization for that expert (counted and named).

w1 and w3 of an expert share their `weight_scale_2` (the engines fuse them into one GEMM: vLLM warns and
uses w1's when they differ, TensorRT-LLM takes the max), so they are cast together.
"""

from __future__ import annotations

import dataclasses

import torch

E8M0_BIAS = 127
E4M3_MIN_EXP, E4M3_MAX_EXP = -9, 8  # powers of two E4M3 holds exactly (subnormal 2^-9 ... 256)
MX_GROUP, NV_GROUP = 32, 16


@dataclasses.dataclass(frozen=True)
class Nvfp4:
    """One NVFP4 weight as ModelOpt's export writes it."""

    weight: torch.Tensor  # uint8 [rows, cols / 2], two E2M1 codes a byte, low nibble first
    weight_scale: torch.Tensor  # float8_e4m3fn [rows, cols / 16]
    weight_scale_2: torch.Tensor  # float32 []


def _nonzero_groups(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols / 32]: whether a 32-group holds a code other than +-0 (magnitude bits 0x7 of each nibble)."""
    magnitude = (packed & 0x77) != 0
    return magnitude.view(*packed.shape[:-1], -1, MX_GROUP // 2).any(dim=-1)


def mxfp4_to_nvfp4(experts) -> bool:
    """Whether fused experts hold MXFP4 storage (packed codes + E8M0 scales) and NVFP4 weight quantizers: the
    exporter then writes their exact cast."""
    from modelopt_ext.export.expert_inputs import is_nvfp4_quantizer

    if not all(hasattr(experts, f"{p}_{part}") for p in ("gate_up_proj", "down_proj") for part in ("packed", "scale")):
        return False
    quantizers = [q for p in ("gate_up_proj", "down_proj") for q in getattr(experts, f"{p}_weight_quantizers", ())]
    return bool(quantizers) and all(is_nvfp4_quantizer(q) for q in quantizers)


def shared_exponent(tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> int | None:
    """k of the shared per-tensor scale 2^k that makes every block of `tensors` (as for `cast_pair`) exact in
    E4M3, or None when their used block scales span more than E4M3's exact powers of two."""
    exps = [scale.to(torch.int32) - E8M0_BIAS for _, scale in tensors]
    used = [_nonzero_groups(packed) for packed, _ in tensors]
    live = torch.cat([e[u] for e, u in zip(exps, used)])
    if live.numel() == 0:
        return 0
    hi, lo = int(live.max()), int(live.min())
    return None if hi - lo > E4M3_MAX_EXP - E4M3_MIN_EXP else hi - E4M3_MAX_EXP


def exact_experts(experts) -> dict[str, list[bool]]:
    """Per projection ("gate_up_proj", "down_proj") of fused experts that `mxfp4_to_nvfp4` accepts: whether
    each local expert's weights are exported as the exact cast (w1 and w3 cast together); {} for others."""
    if not mxfp4_to_nvfp4(experts):
        return {}
    out = {}
    for p in ("gate_up_proj", "down_proj"):
        packed, scale = (t.to_local() if hasattr(t, "to_local") else t
                         for t in (getattr(experts, f"{p}_packed"), getattr(experts, f"{p}_scale")))
        half = packed.shape[1] // 2
        out[p] = [shared_exponent([(packed[e, :half], scale[e, :half]), (packed[e, half:], scale[e, half:])]
                                  if p == "gate_up_proj" else [(packed[e], scale[e])]) is not None
                  for e in range(packed.shape[0])]
    return out


def cast_pair(tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Nvfp4] | None:
    """The exact NVFP4 form of MXFP4 weights sharing one per-tensor scale: `tensors` holds (packed uint8
    [rows, cols/2], E8M0 scale bytes uint8 [rows, cols/32]) per weight. None when one block scale would fall
    outside E4M3's exact powers of two under any shared per-tensor scale."""
    k = shared_exponent(tensors)
    if k is None:
        return None
    exps = [scale.to(torch.int32) - E8M0_BIAS for _, scale in tensors]
    out = []
    for (packed, _), e in zip(tensors, exps):
        block = torch.clamp(e - k, E4M3_MIN_EXP, E4M3_MAX_EXP)  # zero groups: any exact scale
        scale = torch.ldexp(torch.ones_like(block, dtype=torch.float32), block)
        scale = scale.repeat_interleave(MX_GROUP // NV_GROUP, dim=-1).to(torch.float8_e4m3fn)
        out.append(Nvfp4(packed.clone(), scale, torch.tensor(2.0**k, dtype=torch.float32)))
    return out


def dequantize_nvfp4(w: Nvfp4) -> torch.Tensor:
    """fp32 values of an NVFP4 weight (for checks)."""
    from modelopt_ext.formats.mxfp4 import E2M1_VALUES, unpack_e2m1

    values = E2M1_VALUES[unpack_e2m1(w.weight).long()]
    scale = w.weight_scale.float().repeat_interleave(NV_GROUP, dim=-1)
    return values * scale * w.weight_scale_2

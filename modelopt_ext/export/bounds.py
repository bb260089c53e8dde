"""Dequantization of exported FP8 / NVFP4 weights and their error bounds against the source (see `verify_export`)."""

from __future__ import annotations

import torch

from modelopt_ext.export.quant_layout import FP8_ALGOS, FP8_PB_BLOCK, fp8_pb_grid
from modelopt_ext.export.tensors import _Tensors
from modelopt_ext.formats.mxfp4 import E2M1_VALUES, unpack_e2m1

# Error-bound constants (see verify_export).
FP8_REL_ROUNDING = 2.0**-4  # half an ULP of E4M3 (3 mantissa bits), relative
FP8_SUBNORMAL_HALF_STEP = 2.0**-10  # half the E4M3 subnormal step 2**-9, in units of the scale
EXPORT_ROUNDING = 2.0**-8  # the source rounded to the export dtype (bf16, 2**-9) + the bf16 division (2**-9)
E2M1_STEP_EDGES = (2.0, 4.0)  # E2M1 steps: 0.5 below 2, 1 in [2, 4), 2 in [4, 6]
E2M1_HALF_STEPS = (0.25, 0.5, 1.0)


def _dequantize(key: str, algo: str, group_size: int, exp: _Tensors, w: torch.Tensor, problems: list[str]):
    """(dequantized float32 weight cropped to ``w``'s shape, per-element scale), or None after a problem."""
    module = key[: -len(".weight")]
    q = exp.get(key)
    if algo in FP8_ALGOS:
        if tuple(q.shape) != tuple(w.shape):
            problems.append(f"{key} has shape {list(q.shape)}, source {list(w.shape)}")
            return None
        scale = exp.get(f"{module}.weight_scale").float()
        if algo == "FP8":
            return q.float() * scale, scale.expand(w.shape)
        rows, cols = w.shape
        scale = scale.reshape(fp8_pb_grid(w.shape))  # row-major blocks, checked by the layout check
        scale = scale.repeat_interleave(FP8_PB_BLOCK, dim=0)[:rows].repeat_interleave(FP8_PB_BLOCK, dim=1)[:, :cols]
        return q.float() * scale, scale
    blocks = -(-w.shape[-1] // group_size)
    if tuple(q.shape) != (*w.shape[:-1], blocks * group_size // 2):
        problems.append(
            f"{key} has shape {list(q.shape)}, expected {[*w.shape[:-1], blocks * group_size // 2]} for the {algo} "
            f"packing of the source shape {list(w.shape)}"
        )
        return None
    block_scale = exp.get(f"{module}.weight_scale").float() * exp.get(f"{module}.weight_scale_2").float()
    scale = block_scale.repeat_interleave(group_size, dim=-1)[..., : w.shape[-1]]
    values = E2M1_VALUES[unpack_e2m1(q).long()][..., : w.shape[-1]]
    return values * scale, scale


def _check_bound(
    key: str, algo: str, group_size: int, exp: _Tensors, w: torch.Tensor, tolerance: float,
    stats: dict[str, list[float]], problems: list[str],
) -> None:
    w = w.float()
    out = _dequantize(key, algo, group_size, exp, w, problems)
    if out is None:
        return
    deq, scale = out
    w_abs = w.abs()
    if algo in FP8_ALGOS:
        bound = (FP8_REL_ROUNDING + EXPORT_ROUNDING) * w_abs + FP8_SUBNORMAL_HALF_STEP * scale
    else:
        x = w_abs / scale
        half_step = torch.where(
            x < E2M1_STEP_EDGES[0], E2M1_HALF_STEPS[0], torch.where(x < E2M1_STEP_EDGES[1], *E2M1_HALF_STEPS[1:])
        )
        bound = half_step * scale + EXPORT_ROUNDING * w_abs
    bound = tolerance * bound
    err = (deq - w).abs()
    bad = ~(err <= bound)  # NaN counts as a violation
    if bool(bad.any()):
        first = tuple(torch.nonzero(bad)[0].tolist())
        problems.append(
            f"{key}: {int(bad.sum())} of {w.numel()} values exceed the {algo} error bound; first at {list(first)}: "
            f"dequantized {deq[first].item():.6g}, source {w[first].item():.6g}, bound {bound[first].item():.3g}"
        )
    finite = torch.isfinite(err) & (bound > 0)
    ratio = float((err[finite] / bound[finite]).max()) if bool(finite.any()) else 0.0
    rel = float(err.max() / w_abs.max()) if float(w_abs.max()) > 0 else float(err.max())
    worst = stats.setdefault(algo, [0.0, 0.0])
    worst[0], worst[1] = max(worst[0], rel), max(worst[1], ratio)


"""Per-expert input scales of fused routed experts.

ModelOpt gives fused experts one input quantizer per projection, shared by every expert of the layer, and
its export copies that one scale into every expert. vLLM's CUTLASS NVFP4 MoE uses each expert's own
`input_scale` (a finer scale for an expert whose inputs are smaller); FlashInfer's backends and TensorRT-LLM
reduce them to one max over the experts, which is the shared scale again. So per-expert scales lose nothing
on engines that take the max and gain on those that do not.

While ModelOpt max-calibrates, the experts record each expert's input amax beside the shared quantizer
(`expert_input_amax`: projection -> fp32 [E local], -inf for an expert that saw no row). Here each expert's
scale is computed by ModelOpt's own export formula with the shared quantizer's amax set, for the call, to
that expert's amax; an expert without statistics keeps the shared scale (the layer's max over every rank),
so no expert is ever left without a scale and the max over experts is the shared scale.

Modes (`ptq --expert-input-scales`): "shared" (default: ModelOpt's export as it is) or "per-expert". On the
stand-in, with 128 calibration tokens, per-expert scales gave a higher held-out error (each expert's max is
taken over few rows, so held-out inputs above it are clipped): docs/export.md has the numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from torch import nn

MODES = ("shared", "per-expert")
# the checkpoint projections each fused input quantizer feeds (names as in FamilySpec.export_expert_names)
PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def is_nvfp4_quantizer(q) -> bool:
    """An enabled NVFP4 quantizer: E2M1 values in 16-element blocks with E4M3 scales."""
    blocks = getattr(q, "block_sizes", None) or {}
    return (getattr(q, "is_enabled", False) and tuple(getattr(q, "num_bits", ())) == (2, 1)
            and blocks.get(-1) == 16 and tuple(blocks.get("scale_bits") or ()) == (4, 3))


def _scale(q) -> torch.Tensor | None:
    """ModelOpt's exported input scale of quantizer `q` (NVFP4: amax / (6 x 448); others: amax / maxbound)."""
    from modelopt.torch.export.quant_utils import get_scaling_factor
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    return NVFP4QTensor.get_activation_scaling_factor(q) if is_nvfp4_quantizer(q) else get_scaling_factor(q)


@contextlib.contextmanager
def amax_set_to(q, value: torch.Tensor):
    """Quantizer `q`'s amax set to `value` (reshaped and cast as its own) for the body, then given back."""
    held = q.amax.detach().clone()
    q.amax = value.to(held.dtype).reshape(held.shape)
    try:
        yield
    finally:
        q.amax = held


@dataclasses.dataclass
class ExpertInputScales:
    """What one unit's experts got: final key -> scale, and the experts that kept the shared scale."""

    scales: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    per_expert: int = 0  # (expert, projection) pairs with their own statistics
    shared: list[str] = dataclasses.field(default_factory=list)  # "<experts module>.<id>.<projection>"


def expert_input_scales(name: str, module: nn.Module, offset: int, names: dict[str, str]) -> ExpertInputScales:
    """Per-expert input scales of the fused experts `module` (named `name`, first global expert `offset`),
    keyed as the export writes them (`name.<global id>.<checkpoint projection>.input_scale`). Empty when
    the module recorded no per-expert statistics (not calibrated from data, e.g. a constant amax)."""
    out = ExpertInputScales()
    recorded = getattr(module, "expert_input_amax", None) or {}
    for projection, targets in PROJECTIONS.items():
        amax_E = recorded.get(projection)
        q = getattr(module, f"{projection}_input_quantizer", None)
        if amax_E is None or q is None or not getattr(q, "is_enabled", False) or q.amax is None:
            continue
        for e, a in enumerate(amax_E.detach().float().cpu().tolist()):
            prefix = f"{name}.{offset + e}"
            if not (math.isfinite(a) and a > 0):
                out.shared.append(f"{prefix}.{projection}")
                continue
            with amax_set_to(q, torch.tensor(a, device=q.amax.device)):
                scale = _scale(q)
            for target in targets:
                out.scales[f"{prefix}.{names[target]}.input_scale"] = scale.detach().clone()
            out.per_expert += 1
    return out

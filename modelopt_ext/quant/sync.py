"""Amax synchronisation after calibration under expert parallelism, with every rank in step.

ModelOpt's own sync (`distributed_sync`) all-reduces each quantizer's amax over the world, but a rank whose
amax is None (say, an expert layer that received no tokens there) skips that collective and the ranks fall
out of step. Here calibration runs with ModelOpt's sync off, then `sync_amax` does it in one collective:

- every rank lists its quantizers in module order and the lists are compared (same names, same shapes);
- amax of all "shared" quantizers (dense layers, the experts' shared input quantizers) are flattened into one
  buffer, with -inf standing for "not calibrated here", and max-reduced over the world;
- per-expert weight quantizers of expert-parallel modules belong to one rank's experts and are not mixed
  with other ranks' (they are only reduced inside an expert group, ranks holding the same experts);
- a quantizer calibrated nowhere stays None and is reported; a non-finite amax is refused, naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from modelopt.torch.quantization.nn import TensorQuantizer

from modelopt_ext.dist import RankFailure

logger = logging.getLogger(__name__)


def calibration_algorithm(algorithm: str | Mapping[str, Any] = "max") -> dict[str, Any]:
    """ModelOpt's calibration algorithm config with its own distributed sync switched off."""
    algo = {"method": algorithm} if isinstance(algorithm, str) else dict(algorithm)
    algo["distributed_sync"] = False
    return algo


def _is_local_expert_quantizer(model: torch.nn.Module, name: str) -> bool:
    parent, _, rest = name.rpartition("_weight_quantizers.")
    if not parent:
        return False
    owner = model.get_submodule(parent.rpartition(".")[0])
    return bool(getattr(owner, "_is_expert_parallel", False))


def _reduce(quantizers: list[tuple[str, TensorQuantizer]], group, device: torch.device) -> list[str]:
    """Max-reduce the amax of `quantizers` (same list on every rank of `group`); returns uncalibrated names."""
    meta = [(name, None if q.amax is None else tuple(q.amax.shape)) for name, q in quantizers]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, meta, group=group)
    shapes = []
    for i, (name, _) in enumerate(meta):
        names = {m[i][0] if i < len(m) else None for m in gathered}
        if len(names) != 1 or any(len(m) != len(meta) for m in gathered):
            raise RankFailure(f"ranks list different quantizers at position {i}: {sorted(map(str, names))}")
        known = {m[i][1] for m in gathered if m[i][1] is not None}
        if len(known) > 1:
            raise RankFailure(f"quantizer {name} has amax of different shapes on different ranks: {sorted(known)}")
        shapes.append(known.pop() if known else None)
    parts = []
    for (name, q), shape in zip(quantizers, shapes):
        if shape is None:
            continue
        amax = q.amax
        parts.append(amax.detach().float().flatten().to(device) if amax is not None
                     else torch.full(shape, float("-inf"), device=device).flatten())
    if parts:
        flat = torch.cat(parts)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        offset = 0
        for (name, q), shape in zip(quantizers, shapes):
            if shape is None:
                continue
            n = torch.Size(shape).numel()
            value = flat[offset : offset + n].view(shape)
            offset += n
            if torch.isnan(value).any() or torch.isposinf(value).any():
                raise RankFailure(f"calibration statistics of {name} are not finite: amax {value.flatten()[:4]}")
            dtype = q.amax.dtype if q.amax is not None else torch.float32
            q.amax = value.to(dtype)
    return [name for (name, _), shape in zip(quantizers, shapes) if shape is None]


def sync_amax(model: torch.nn.Module, expert_group=None) -> dict[str, Any]:
    """Synchronise every quantizer's amax across the ranks (see module doc). Collective: call on all ranks.

    Args:
        expert_group: the process group of ranks holding the same experts (None: each rank's experts are
            its own, as when the EP degree equals the world size).
    Returns:
        {"shared": n, "local_experts": n, "uncalibrated": [names]}
    """
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    shared, local = [], []
    for name, module in model.named_modules():
        if isinstance(module, TensorQuantizer):
            (local if _is_local_expert_quantizer(model, name) else shared).append((name, module))
    uncalibrated = _reduce(shared, dist.group.WORLD, device)
    if expert_group is not None and dist.get_world_size(expert_group) > 1:
        uncalibrated += _reduce(local, expert_group, device)
    if uncalibrated:
        logger.info("%d quantizers were calibrated on no rank (amax stays None)", len(uncalibrated))
    return {"shared": len(shared), "local_experts": len(local), "uncalibrated": uncalibrated}

"""Amax synchronisation after calibration under expert parallelism, with every rank in step.

ModelOpt's own sync (`distributed_sync`) all-reduces each quantizer's amax over the world, but a rank whose
amax is None (say, an expert layer that received no tokens there) skips that collective and the ranks fall
out of step. Here calibration runs with ModelOpt's sync off, then `sync_amax` does it in one collective:

- every rank lists its quantizers in module order and the lists are compared (same names, same shapes);
- amax of all "shared" quantizers (dense layers, the experts' shared input quantizers) are flattened into one
  buffer, with -inf standing for "not calibrated here", and max-reduced over the world;
- per-expert weight quantizers of expert-parallel modules belong to one rank's experts and are not mixed
  with other ranks' (they are only reduced inside an expert group, ranks holding the same experts);
- an enabled quantizer calibrated nowhere stays None and is named in a warning (a disabled one has no
  amax by design: a debug line counts them); a non-finite amax is refused, naming it.

Non-finite statistics, with or without torch.distributed: ModelOpt's max calibrator asserts on a NaN/inf
amax as it collects, without naming the quantizer; `naming_nonfinite_quantizer` turns that assertion into a
ValueError naming it. `check_finite_amax` refuses NaN or inf amax after calibration (one process, or a
rank's local experts, which `sync_amax` does not reduce when every rank holds its own experts).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from modelopt.torch.quantization.nn import TensorQuantizer

from modelopt_ext.dist import RankFailure

logger = logging.getLogger(__name__)


def calibration_algorithm(algorithm: str | Mapping[str, Any] = "max") -> dict[str, Any]:
    """ModelOpt's calibration algorithm config with its own distributed sync switched off. ValueError for
    an algorithm ModelOpt does not know or that has no such switch (`recipe_io.check_algorithm`, which
    recipes are held to when they are loaded)."""
    from .recipe_io import check_algorithm

    check_algorithm(algorithm, "calibration algorithm")
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
        spoilt = bool((torch.isnan(flat) | torch.isposinf(flat)).any())  # one host read for all quantizers
        offset = 0
        for (name, q), shape in zip(quantizers, shapes):
            if shape is None:
                continue
            n = torch.Size(shape).numel()
            value = flat[offset : offset + n].view(shape)
            offset += n
            if spoilt and bool((torch.isnan(value) | torch.isposinf(value)).any()):
                raise RankFailure(f"calibration statistics of {name} are not finite: amax {value.flatten()[:4]}")
            dtype = q.amax.dtype if q.amax is not None else torch.float32
            q.amax = value.to(dtype)
    return [name for (name, _), shape in zip(quantizers, shapes) if shape is None]


MAX_LISTED_QUANTIZERS = 20
MAX_NAMED_UNCALIBRATED = 5  # names in sync_amax's warning about enabled quantizers no rank calibrated
_NONFINITE_ASSERTIONS = ("detected nan values in amax", "detected inf values in amax")


@contextlib.contextmanager
def naming_nonfinite_quantizer(model: torch.nn.Module) -> Iterator[None]:
    """Around `mtq.quantize`: ModelOpt's calibrators assert when a quantizer's input gives a NaN or inf
    amax, without saying which quantizer; re-raise that as a ValueError naming it (found in the traceback,
    so calibration pays nothing for it)."""
    try:
        yield
    except AssertionError as e:
        if not str(e).startswith(_NONFINITE_ASSERTIONS):
            raise
        quantizer, tb = None, e.__traceback__
        while tb is not None:  # the innermost TensorQuantizer frame is the one that was collecting
            owner = tb.tb_frame.f_locals.get("self")
            if isinstance(owner, TensorQuantizer):
                quantizer = owner
            tb = tb.tb_next
        names = {id(m): n for n, m in model.named_modules()}
        name = names.get(id(quantizer), "an unnamed quantizer") if quantizer is not None else "a quantizer"
        kind = "NaN" if "nan" in str(e) else "inf"
        raise ValueError(
            f"calibration statistics are not finite: {name} saw {kind} in its input during calibration "
            f"(ModelOpt: {e}), so the model is not exported; the calibration data or the layers feeding this "
            "module produce NaN or inf"
        ) from e


def nan_inf(tensors: list[torch.Tensor]) -> list[tuple[bool, bool]]:
    """(holds NaN, holds inf) for each tensor, read back to the host once for all of them."""
    if not tensors:
        return []
    device = tensors[0].device
    flags = torch.stack([torch.stack([torch.isnan(t).any(), torch.isinf(t).any()]).to(device) for t in tensors])
    return [(bool(nan), bool(inf)) for nan, inf in flags.tolist()]


def check_finite_amax(model: torch.nn.Module) -> None:
    """Raise ValueError naming every quantizer (by module name) whose amax holds NaN or inf.

    Calibration statistics that are not finite would give NaN or zero scales in the export; this runs after
    calibration, in one process as under torch.distributed, before anything is exported.
    """
    named = []
    for name, module in model.named_modules():
        amax = getattr(module, "_amax", None) if isinstance(module, TensorQuantizer) else None
        if isinstance(amax, torch.Tensor):  # the buffer itself: the amax property asserts on dynamic ones
            named.append((name, amax.detach().float().flatten()))
    if not named:
        return
    bad = []
    for (name, values), (nan, inf) in zip(named, nan_inf([v for _, v in named])):
        if not (nan or inf):
            continue
        kinds = [k for k, found in (("NaN", nan), ("inf", inf)) if found]
        bad.append(f"{name} ({int((~torch.isfinite(values)).sum())} of {values.numel()} amax values "
                   f"{' and '.join(kinds)})")
    if bad:
        listed = bad[:MAX_LISTED_QUANTIZERS]
        if len(bad) > len(listed):
            listed.append(f"... and {len(bad) - len(listed)} more")
        raise ValueError(
            f"calibration statistics are not finite (NaN or inf amax) in {len(bad)} quantizer(s), so the model "
            "is not exported; the calibration inputs or the weights of these modules hold NaN or inf: "
            + "; ".join(listed)
        )


def sync_amax(model: torch.nn.Module, expert_group=None) -> dict[str, Any]:
    """Synchronise every quantizer's amax across the ranks (see module doc). Collective: call on all ranks.

    Args:
        expert_group: the process group of ranks holding the same experts (None: each rank's experts are
            its own, as when the EP degree equals the world size).
    Returns:
        {"shared": n, "local_experts": n, "uncalibrated": [names of enabled quantizers calibrated on no rank]}
    """
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    shared, local = [], []
    for name, module in model.named_modules():
        if isinstance(module, TensorQuantizer):
            (local if _is_local_expert_quantizer(model, name) else shared).append((name, module))
    no_amax = _reduce(shared, dist.group.WORLD, device)
    if expert_group is not None and dist.get_world_size(expert_group) > 1:
        no_amax += _reduce(local, expert_group, device)
    enabled = {name for name, q in shared + local if q.is_enabled}
    uncalibrated = [name for name in no_amax if name in enabled]
    _report_uncalibrated(uncalibrated, len(no_amax) - len(uncalibrated))
    return {"shared": len(shared), "local_experts": len(local), "uncalibrated": uncalibrated}


def _report_uncalibrated(uncalibrated: list[str], disabled: int) -> None:
    """A warning naming (some of) the enabled quantizers no rank calibrated; disabled quantizers have no
    amax by design and get a debug line only."""
    if uncalibrated:
        named = ", ".join(uncalibrated[:MAX_NAMED_UNCALIBRATED])
        more = len(uncalibrated) - MAX_NAMED_UNCALIBRATED
        logger.warning("%d enabled quantizer(s) were calibrated on no rank (amax stays None): %s%s",
                       len(uncalibrated), named, f" and {more} more" if more > 0 else "")
    if disabled:
        logger.debug("%d disabled quantizer(s) have no amax (expected)", disabled)

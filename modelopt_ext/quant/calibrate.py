"""Calibration driver: ModelOpt quantization over this rank's batches, coverage, amax sync, expert policy.

    result = calibrate(model, quant_cfg, batches, router_glob=..., num_experts=..., uncovered="weights")

Steps: ModelOpt converts the model and runs `forward_loop` over the batches with its own distributed sync
off (`sync.calibration_algorithm`), while `coverage` counts routed tokens per expert; then, under
torch.distributed, `sync.sync_amax` brings every rank's amax in step; then the policy for experts that saw
no calibration token applies:

- "weights" (default): keep going. Their weight quantizers are calibrated from their weights, which ModelOpt
  does for every expert; their input amax is the layer's, as fused experts share one input quantizer per
  projection (the down projection's input quantizer has seen only other experts' activations).
- "all-experts": run calibration with every token sent to every expert (`all_experts_routing`), with the
  routing weights of experts the router did not pick set to zero, so the model's outputs are unchanged
  while every expert's activations reach the quantizers. Costs top-k -> all experts compute (and, under EP,
  exchange).
- "fail": raise, naming the layers and experts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from modelopt_ext.dist import mark
from modelopt_ext.ep.backend import restore_ep_forwards
from modelopt_ext.ep.sharding import local_expert_params
from modelopt_ext.families import RouterOutput
from modelopt_ext.profiling import BatchProfiler, sync_device

from .collect import check_collected, deferred_checks
from .coverage import Coverage, record_expert_coverage
from .modelopt_import import import_modelopt
from .recipe_io import check_calibrators
from .search import search_weights, split_algorithm
from .sync import calibration_algorithm, check_finite_amax, naming_nonfinite_quantizer, sync_amax

logger = logging.getLogger(__name__)
POLICIES = ("weights", "all-experts", "fail")


class UncoveredExperts(RuntimeError):
    """Experts received no calibration token and the policy is "fail"."""


@dataclasses.dataclass
class CalibrationResult:
    model: torch.nn.Module
    coverage: Coverage
    sync: dict[str, Any] | None
    # this rank's host wall clock per part (GPU work queued in one part may finish in the next): "convert"
    # (ModelOpt's conversion and, before the loop in ModelOpt 0.47's max calibration, the weight statistics of
    # every weight quantizer), "first_batch" (the first forward, to a device synchronize: first-call costs),
    # "forward" (the other batches and the deferred statistics check, which reads back), "finish" (ModelOpt
    # after the loop: the collected statistics loaded as amax), "sync" (amax sync under torch.distributed, the
    # weight search of mse / local_hessian with its forward pass (quant/search.py) and the finiteness check),
    # "coverage" (the count summed over ranks and its checks)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # weight quantizer name -> the amax max calibration gave it, kept when a weight search (mse, local_hessian)
    # then changed amax: what the calibration-free baseline of the quality report quantizes weights with
    max_weight_amax: dict[str, torch.Tensor] | None = None


@contextlib.contextmanager
def all_experts_routing(model: torch.nn.Module, router_glob: str, num_experts: int,
                        router_output: RouterOutput | None = None):
    """Routers return every expert, with the unpicked ones weighted 0 (outputs unchanged); `router_output`: what
    they return (the family's `FamilySpec.router_output`; default (ids, weights)), other items kept."""
    items = RouterOutput() if router_output is None else router_output

    def hook(module, inputs, output, name):
        ids_TK, weights_TK = items.ids(output, name), items.weights(output, name)
        T = ids_TK.shape[0]
        full = torch.zeros(T, num_experts, dtype=weights_TK.dtype, device=weights_TK.device)
        full.scatter_(1, ids_TK, weights_TK)
        every = torch.arange(num_experts, device=ids_TK.device, dtype=ids_TK.dtype).expand(T, num_experts)
        return items.replaced(output, every.contiguous(), full)

    handles = [m.register_forward_hook(lambda module, inputs, output, name=n: hook(module, inputs, output, name))
               for n, m in model.named_modules() if fnmatch.fnmatchcase(n, router_glob)]
    if not handles:
        raise ValueError(f"no module of the model matches the router glob {router_glob!r}")
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _integer_params_under_fsdp(model: torch.nn.Module):
    """ModelOpt reads FSDP-sharded weights by re-wrapping each gathered tensor as `nn.Parameter(t)`, which
    refuses integer tensors (the packed MXFP4 experts). Its own `no_requires_grad` context creates them
    without gradients; calibration needs none."""
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return contextlib.nullcontext()
    from modelopt.torch.quantization.utils.core_utils import no_requires_grad

    return no_requires_grad()


def name_parent_class_rules(quant_cfg: list, model: torch.nn.Module) -> list:
    """`quant_cfg` with each `parent_class` entry (e.g. ModelOpt's "disable every quantizer of an
    nn.Embedding") followed by the same entry spelt out per matching leaf module of `model`, by name.

    ModelOpt matches `parent_class` against its quantized class, which an FSDP-wrapped module's converted
    class is not a subclass of (measured: an FSDP-sharded embedding gets quantized by the FP8 recipe while
    the same model unsharded does not), so under FSDP those rules would silently not apply."""
    out = []
    for entry in quant_cfg:
        out.append(entry)
        name = entry.get("parent_class") if isinstance(entry, dict) else None
        cls = getattr(torch.nn, name.removeprefix("nn."), None) if isinstance(name, str) else None
        if not isinstance(cls, type):
            continue
        leaves = [n for n, m in model.named_modules() if isinstance(m, cls) and not any(True for _ in m.children())]
        for module_name in leaves:
            pattern = entry.get("quantizer_name", "*")
            out.append({**entry, "parent_class": None, "quantizer_name": f"{module_name}.{pattern}"})
    return out


def _search(model: torch.nn.Module, search, batches: list) -> dict[str, Any]:
    """The weight search after the amax sync (`search.search_weights`), replaying this rank's batches where it
    needs a forward pass."""

    def replay(m):
        with torch.no_grad():
            for i, batch in enumerate(batches):
                mark(f"{search.method} forward batch {i + 1}/{len(batches)}")
                m(**batch, use_cache=False)

    with _integer_params_under_fsdp(model), local_expert_params(model):
        return search_weights(model, search, replay)


def calibrate(
    model: torch.nn.Module,
    quant_cfg: Mapping[str, Any],
    batches: Iterable[Mapping[str, torch.Tensor]],
    *,
    router_glob: str,
    num_experts: int,
    uncovered: str = "weights",
    progress: Callable[[int], None] | None = None,
    plan=None,
    router_output: RouterOutput | None = None,
) -> CalibrationResult:
    """Quantize `model` with ModelOpt, calibrating on `batches` (this rank's); see the module doc. `plan`: the
    distribution plan the model was loaded with (default: the one `modelopt_ext.from_pretrained` put on it).
    `router_output`: the family's `FamilySpec.router_output` (what its routers return; default (ids, weights)).

    Under expert parallelism (experts modules sharded by `ep_dispatch_experts`): ModelOpt converts the model and
    calibrates the weights (before the forward loop) with the experts' sharded parameters presented as this rank's
    local tensors (`ep.sharding.local_expert_params`: its per-expert weight quantizers are local experts, indexed
    locally; the DTensors are back before the first forward, which FSDP's lazy initialization needs), and
    after the conversion, which binds the quantized class forward on the experts modules, their dispatching forward
    is put back (`ep.backend.restore_ep_forwards`) for MoE blocks that call `self.experts(...)` with global ids."""
    import_modelopt()  # done by this package's import already; makes sure ModelOpt leaves no temp files
    import modelopt.torch.quantization as mtq

    if uncovered not in POLICIES:
        raise ValueError(f"uncovered-experts policy {uncovered!r} is not one of {POLICIES}")
    if plan is None:
        plan = getattr(model, "modelopt_ext_plan", None)
    if plan is not None:
        plan.check_calibration_supported("calibrate")
    cfg = dict(quant_cfg)
    # a weight search (mse, local_hessian) runs after the amax sync, on synced amax (quant/search.py)
    cfg["algorithm"], search = split_algorithm(calibration_algorithm(cfg.get("algorithm", "max")))
    if isinstance(cfg.get("quant_cfg"), list):
        check_calibrators(cfg["quant_cfg"], "quant config")  # `--set` can set one after the recipe's checks
        cfg["quant_cfg"] = name_parent_class_rules(cfg["quant_cfg"], model)
    batches = list(batches)
    for module in model.modules():  # per-expert input statistics (export/expert_inputs.py) of this calibration only
        reset = getattr(module, "reset_expert_input_amax", None)
        if callable(reset):
            reset()
    routing = all_experts_routing(model, router_glob, num_experts, router_output) if uncovered == "all-experts" else (
        contextlib.nullcontext())
    # routing hooks first, so the coverage hook (registered after) counts what the experts actually get; routing
    # stays on through a weight search's own forward pass (local_hessian), which coverage does not count
    with routing:
        marks = [("start", time.perf_counter())]  # (part that ended, when)
        # the experts' local tensors while ModelOpt converts and calibrates the weights (before the forward loop);
        # the DTensors back for the forwards, which take them themselves (FSDP's first forward needs them)
        local_params = contextlib.ExitStack()

        def forward_loop(m):
            local_params.close()
            restore_ep_forwards(m)  # after ModelOpt's conversion, before the first forward
            marks.append(("convert", time.perf_counter()))
            profiler = BatchProfiler.from_env(dist.get_rank() if dist.is_initialized() else 0)
            with torch.no_grad():
                for i, batch in enumerate(batches):
                    mark(f"calibrate batch {i + 1}/{len(batches)}")
                    with profiler.batch(i) if profiler is not None else contextlib.nullcontext():
                        m(**batch, use_cache=False)
                    if i == 0:  # first-call costs (kernel choices, caches) apart from the steady loop
                        sync_device()
                        marks.append(("first_batch", time.perf_counter()))
                    if progress is not None:
                        progress(i + 1)
            if profiler is not None:
                profiler.close()
            check_collected(m)  # the statistics' finiteness, deferred from every collect to here (a host read)
            marks.append(("forward", time.perf_counter()))

        with record_expert_coverage(model, router_glob, num_experts, router_output) as coverage:
            with (_integer_params_under_fsdp(model), naming_nonfinite_quantizer(model), deferred_checks(),
                  local_params):
                local_params.enter_context(local_expert_params(model))
                model = mtq.quantize(model, cfg, forward_loop)
            restore_ep_forwards(model)  # also where ModelOpt ran no forward loop
            marks.append(("finish", time.perf_counter()))
        distributed = dist.is_available() and dist.is_initialized()
        report = sync_amax(model) if distributed else None
        max_weight_amax = None
        if search is not None:
            max_weight_amax = _weight_amax(model)
            searched = _search(model, search, batches)
            if distributed:  # ranks bitwise in step after the search, whatever its arithmetic did
                sync_amax(model)
            if report is not None:
                report["search"] = searched
    check_finite_amax(model)  # one process too: sync_amax only sees what it reduces
    marks.append(("sync", time.perf_counter()))
    missing = coverage.uncovered()
    if missing:
        detail = "; ".join(f"{name}: {experts}" for name, experts in missing.items())
        if uncovered == "fail":
            raise UncoveredExperts(f"experts without calibration tokens: {detail}")
        logger.warning("experts without calibration tokens (policy %r): %s", uncovered, detail)
    logger.info(coverage.summary_line())
    marks.append(("coverage", time.perf_counter()))
    seconds = {part: round(end - start, 3) for (_, start), (part, end) in zip(marks, marks[1:])}
    return CalibrationResult(model, coverage, report, seconds, max_weight_amax)


def _weight_amax(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every enabled weight quantizer's amax, by quantizer name."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    return {n: q._amax.detach().clone() for n, q in model.named_modules()
            if isinstance(q, TensorQuantizer) and q.is_enabled and "weight_quantizer" in n
            and getattr(q, "_amax", None) is not None}

"""Weight-side amax searches (ModelOpt's `mse` and `local_hessian`) under expert parallelism, ranks in step.

ModelOpt 0.47 runs both as: max calibration of every quantizer (weights from the weights, activations over
the forward loop), then, per weight quantizer, a search over candidate amax = max amax x m (m = 0.25, 0.35,
..., 4.0; or, with `fp8_scale_sweep`, the 126 FP8 values of an NVFP4-static per-block scale, the only weights
that option searches) for the candidate with the least error between the weight and its fake-quantized self:
plain squared error (`mse`) or, for `local_hessian`, sum over 16-column blocks of dw^T H dw with
H = sum x x^T / tokens over the layer's calibration inputs, from a second forward pass with weight
quantization off. Activation amax stay max-calibrated in both.

Under EP that is not what one process computes: ModelOpt's search runs before modelopt_ext's amax sync (the
second forward then quantizes the inputs with this rank's own activation amax), and each rank's Hessians
hold its own tokens only, so the argmin, and the amax, differ from rank to rank (measured on the stand-in:
up to 0.77 on amax of ~0.8, docs/ptq.md "Calibration algorithms"). Here `calibrate` runs ModelOpt's max only
(`split_algorithm`), syncs amax (`sync.sync_amax`), then `search_weights`:

- `local_hessian`: the second forward over this rank's batches, with ModelOpt's input hooks feeding an fp64
  accumulator of our own (fp64, so that the order the tokens are summed in, which EP changes, does not change
  the fp32 Hessian the search sees), with every weight quantizer off (ModelOpt's leaves the fused experts'
  on) and the input quantizers on their synced amax; the Hessians of shared weights (dense layers,
  replicated or FSDP) and their token counts are sum-reduced over the world before any decision. A routed
  expert's Hessian is already complete on the rank holding it (every token routed to it is dispatched there).
- the search itself (ModelOpt's `_mse_calibrate_weights`) is rank-local: every rank holds the same dense
  weights and the same reduced Hessians, or its own experts.
- routed-expert weights the exporter writes as the exact cast of their MXFP4 source (export/exact_cast.py)
  are not searched: their export does not use the weight amax (an expert whose cast is not exact is).

Each rank-local step runs under `dist.all_or_fail` (every rank fails together, naming the step); the amax
are max-reduced once more after the search, so ranks end bitwise in step whatever the arithmetic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from modelopt_ext.dist import all_or_fail

logger = logging.getLogger(__name__)

SEARCHES = ("mse", "local_hessian")
# fields of the search configs that belong to the max pass ModelOpt runs first
_MAX_FIELDS = ("moe_calib_experts_ratio", "layerwise", "shared_states")
# the Hessian forward runs with weight quantization off, the fused experts' per-expert weight quantizers too
# (ModelOpt 0.47 turns off `*weight_quantizer` only, which leaves them on)
_WEIGHTS_OFF = [{"quantizer_name": "*weight_quantizer", "enable": False},
                {"quantizer_name": "*weight_quantizers.*", "enable": False}]


def split_algorithm(algorithm: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """(what `mtq.quantize` runs, the weight search to run after the amax sync or None). A search algorithm
    becomes ModelOpt's max with its own max-pass fields (distributed sync off) and the search's validated
    config (ModelOpt's defaults filled in)."""
    from .recipe_io import calibration_methods

    algorithm = dict(algorithm)
    if algorithm.get("method") not in SEARCHES:
        return algorithm, None
    config = calibration_methods()[algorithm["method"]].model_validate(algorithm)
    base = {"method": "max", "distributed_sync": False}
    base.update({k: algorithm[k] for k in _MAX_FIELDS if k in algorithm})
    return base, config


def exact_cast_quantizers(model: torch.nn.Module) -> set[int]:
    """ids of the routed experts' weight quantizers whose export is the exact cast of their MXFP4 source (the
    weight amax is not used there; see export/exact_cast.py)."""
    from modelopt_ext.export.exact_cast import exact_experts

    out: set[int] = set()
    for module in model.modules():
        for p, exact in exact_experts(module).items():
            out.update(id(q) for q, is_exact in zip(getattr(module, f"{p}_weight_quantizers"), exact) if is_exact)
    return out


class _Hessians:
    """Per weight quantizer (by module name): sum over tokens of x x^T per `block_size` input columns, in
    fp64, and the token count."""

    def __init__(self, model: torch.nn.Module, block_size: int):
        self.names = {id(m): n for n, m in model.named_modules()}
        self.block_size = block_size
        self.sums: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}

    @torch.no_grad()
    def capture(self, weight_quantizer, weight, input_tensor) -> None:
        x = input_tensor.to_local() if hasattr(input_tensor, "to_local") else input_tensor
        cin = weight.shape[1]
        if cin % self.block_size:
            return  # ModelOpt: no Hessian, plain squared error for this weight
        name = self.names[id(weight_quantizer)]
        x = x.detach().reshape(-1, cin).to(torch.float64).T.reshape(cin // self.block_size, self.block_size, -1)
        h = x @ x.transpose(-1, -2)
        if name in self.sums:
            self.sums[name] += h
        else:
            self.sums[name] = h
        self.tokens[name] = self.tokens.get(name, 0) + x.shape[-1]

    def reduce_shared(self, model: torch.nn.Module, device: torch.device) -> int:
        """Sum the Hessians and token counts of shared (not rank-local expert) weights over the world, every
        rank contributing zeros for a Hessian it has not got. Collective. Returns how many were reduced."""
        from .sync import _is_local_expert_quantizer

        mine = {n: tuple(h.shape) for n, h in self.sums.items() if not _is_local_expert_quantizer(model, n)}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        shapes: dict[str, tuple] = {}
        for theirs in gathered:
            for name, shape in theirs.items():
                if shapes.setdefault(name, shape) != shape:
                    raise RuntimeError(f"local_hessian: {name} has Hessians of different shapes on different "
                                       f"ranks: {shapes[name]} and {shape}")
        names = sorted(shapes)
        if not names:
            return 0
        parts = [self.sums[n].to(device).flatten() if n in self.sums
                 else torch.zeros(shapes[n], dtype=torch.float64, device=device).flatten() for n in names]
        flat = torch.cat(parts + [torch.tensor([float(self.tokens.get(n, 0)) for n in names], dtype=torch.float64,
                                               device=device)])
        dist.all_reduce(flat)
        offset = 0
        for name in names:
            n = torch.Size(shapes[name]).numel()
            home = self.sums[name].device if name in self.sums else torch.device("cpu")
            self.sums[name] = flat[offset:offset + n].view(shapes[name]).to(home)
            offset += n
        for name, count in zip(names, flat[offset:].tolist()):
            self.tokens[name] = int(count)
        return len(names)

    def metrics(self, model: torch.nn.Module) -> tuple[dict[int, Callable], dict[int, torch.Tensor]]:
        """ModelOpt's error function and normalized Hessian (fp32) per quantizer id, built by its own
        accumulator class from these sums."""
        from modelopt.torch.quantization.model_calib import _LocalHessianAccumulator

        error_funcs, hessians = {}, {}
        for name, h in self.sums.items():
            tokens = self.tokens.get(name, 0)
            if not tokens:
                continue
            rows = _weight_rows(model, name)
            if rows is None:
                continue
            q = model.get_submodule(name)
            acc = _LocalHessianAccumulator(rows, h.shape[0] * self.block_size, self.block_size)
            acc.num_samples = tokens
            acc._normalized_hessian = (h / tokens).to(torch.float32)  # what its normalized_hessian() caches
            error_funcs[id(q)] = acc.build_error_func()
            hessians[id(q)] = acc.normalized_hessian()
        return error_funcs, hessians


def _weight_rows(model: torch.nn.Module, quantizer_name: str) -> int | None:
    """Output rows of the weight `quantizer_name` quantizes (a dense linear's weight or one expert's)."""
    parent, _, leaf = quantizer_name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    if leaf == "weight_quantizer":
        weight = getattr(owner, "weight", None)
        return None if weight is None else int(weight.shape[0])
    head, _, _ = parent.rpartition(".")  # <experts>.<proj>_weight_quantizers.<i>
    experts = model.get_submodule(head)
    proj = parent.rpartition(".")[2].removesuffix("_weight_quantizers")
    weight = getattr(experts, proj, None)
    return None if weight is None else int(weight.shape[1])


def _device(model: torch.nn.Module) -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def search_weights(model: torch.nn.Module, config, forward_loop: Callable[[torch.nn.Module], None]) -> dict[str, Any]:
    """Run the weight search `config` (from `split_algorithm`) on the max-calibrated, amax-synced `model`;
    `forward_loop` replays this rank's calibration batches (local_hessian). Collective under
    torch.distributed. Returns {"method", "searched": n, "skipped_exact_cast": n, "hessians_reduced": n}."""
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context
    from modelopt.torch.quantization.model_calib import (
        _mse_calibrate_weights,
        _register_local_hessian_input_hooks,
    )
    from modelopt.torch.quantization.nn import TensorQuantizer

    distributed = dist.is_available() and dist.is_initialized()
    method = config.method
    name_to_module = dict(model.named_modules())
    error_funcs: dict[int, Callable] = {}
    hessians: dict[int, torch.Tensor] = {}
    reduced = 0
    if method == "local_hessian":
        acc = _Hessians(model, config.block_size)

        def hessian_forward():
            handles = _register_local_hessian_input_hooks(model, name_to_module, acc.capture, config.block_size,
                                                          set())
            try:
                with set_quantizer_by_cfg_context(model, _WEIGHTS_OFF):
                    forward_loop(model)
            finally:
                for handle in handles:
                    handle.remove()

        all_or_fail("local_hessian: Hessian forward pass", hessian_forward)
        if distributed:
            reduced = acc.reduce_shared(model, _device(model))
        error_funcs, hessians = acc.metrics(model)

    skipped = exact_cast_quantizers(model)
    hidden = [(q, q._calibrator) for q in name_to_module.values()
              if isinstance(q, TensorQuantizer) and id(q) in skipped]
    searched = sum(1 for n, q in name_to_module.items() if isinstance(q, TensorQuantizer) and q.is_enabled
                   and "weight_quantizer" in n and id(q) not in skipped)

    def search():
        for q, _ in hidden:  # ModelOpt's search passes over a weight quantizer without a calibrator
            q._calibrator = None
        try:
            _mse_calibrate_weights(
                model, name_to_module, step_size=config.step_size, start_multiplier=config.start_multiplier,
                stop_multiplier=config.stop_multiplier, fp8_scale_sweep=config.fp8_scale_sweep,
                error_func_for=(lambda q: error_funcs.get(id(q))) if error_funcs else None,
                hessian_for=(lambda q: hessians.get(id(q))) if hessians else None,
            )
        finally:
            for q, calibrator in hidden:
                q._calibrator = calibrator
            for m in name_to_module.values():  # drop the Hessians the calibrators hold
                calibrator = getattr(m, "_calibrator", None) if isinstance(m, TensorQuantizer) else None
                if calibrator is not None and hasattr(calibrator, "_error_func"):
                    calibrator._error_func = None
                    if hasattr(calibrator, "_hessian"):
                        calibrator._hessian = None

    all_or_fail(f"{method} weight search", search)
    report = {"method": method, "searched": searched, "skipped_exact_cast": len(hidden), "hessians_reduced": reduced}
    logger.info("%s weight search: %d weight quantizer(s); %d routed-expert weight(s) left at max (exact MXFP4 "
                "cast); %d Hessian(s) summed over ranks", method, searched, len(hidden), reduced)
    return report

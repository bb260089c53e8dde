"""Quality report of a calibrated model on held-out tokens: our export against the calibration-free baseline.

    report = measure_quality(model, held_out_batches, expert_input_scales="per-expert")

Three quantization states of the same calibrated model are compared, all as the export writes them:
- "reference": every quantizer off (the source model);
- "ours": the recipe's quantizers as calibrated, except routed-expert weights that the export carries as the
  exact cast of their MXFP4 source (`export.exact_cast`: no weight error, so their weight quantizers are off),
  and routed-expert inputs at each expert's own amax when the export writes per-expert input scales;
- "baseline": NVIDIA's calibration-free converter: the same weights (where a weight search (mse,
  local_hessian) set ours, the weights at max calibration's amax instead, which needs no data), every input
  quantizer at the amax that gives input_scale 1.0 (NVFP4: 6 x 448; FP8: 448), no per-expert scales.

Measured (one pass per held-out batch in the reference state, with hooks):
- every quantized linear module and every fused experts module: the relative error (Frobenius, over all
  held-out rows) of its output in "ours" and "baseline" against "reference" on the same inputs (the
  reference pass's); experts are measured per expert on the rows routed to it (routing weights not applied);
- every MoE block (router, experts, shared experts): the same for the block's output; its router sees the
  same input in every state and is not quantized, so the source's routing is held fixed;
- the logits: mean KL(reference || state) per token and the share of tokens whose top-1 token agrees, from
  one full forward per state.

Collective under torch.distributed (every rank runs the same batches count; sums are gathered to every rank):
each rank measures its own held-out share and its own experts. Dense modules under FSDP are skipped (their
parameters are sharded outside their forward) and counted in `skipped`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from modelopt_ext.dist import gather_objects, in_group

logger = logging.getLogger(__name__)
STATES = ("ours", "baseline")
E4M3_MAX = 448.0


def _quantizers(module: nn.Module, recurse: bool = True):
    from modelopt.torch.quantization.nn import TensorQuantizer

    return [(n, q) for n, q in (module.named_modules() if recurse else ()) if isinstance(q, TensorQuantizer)]


def _baseline_amax(q) -> float:
    """The amax that makes an input quantizer's exported scale 1.0 (export/expert_inputs.py's formulas)."""
    from modelopt_ext.export.expert_inputs import is_nvfp4_quantizer

    return float(q.maxbound) * (E4M3_MAX if is_nvfp4_quantizer(q) else 1.0)


class _States:
    """Puts modules' quantizers into one of the states (module doc); `restore` gives back the calibrated one.

    NVFP4 quantizers are simulated (`formats.nvfp4.fake_quantize_nvfp4` in a forward hook of the disabled
    ModelOpt quantizer, reading its amax at call time), as ModelOpt's NVFP4 fake quantization needs CUDA."""

    def __init__(self, model: nn.Module, expert_input_scales: str,
                 baseline_weight_amax: Mapping[str, torch.Tensor] | None = None):
        from modelopt_ext.export.exact_cast import exact_experts
        from modelopt_ext.export.expert_inputs import is_nvfp4_quantizer

        quantizers = _quantizers(model)
        self.saved = {id(q): (q.is_enabled, None if getattr(q, "_amax", None) is None else q._amax.detach().clone())
                      for _, q in quantizers}
        # weight quantizer -> the amax the baseline quantizes its weight with (max calibration, no search)
        self.baseline_weight = {id(q): baseline_weight_amax[n] for n, q in quantizers
                                if baseline_weight_amax and n in baseline_weight_amax}
        self.per_expert = expert_input_scales == "per-expert"
        self.exact = {id(m): exact_experts(m) for m in model.modules() if hasattr(m, "expert_input_amax")}
        self.simulated: dict[int, bool] = {}  # NVFP4 quantizer -> whether it quantizes now
        self.handles = []
        for _, q in quantizers:
            if is_nvfp4_quantizer(q) and self.saved[id(q)][1] is not None:
                self.simulated[id(q)] = False
                self.handles.append(q.register_forward_hook(self._simulate))

    def _simulate(self, quantizer, inputs, output):
        from modelopt_ext.formats.nvfp4 import fake_quantize_nvfp4

        return fake_quantize_nvfp4(inputs[0], quantizer._amax) if self.simulated.get(id(quantizer)) else None

    def _set(self, q, on: bool) -> None:
        if id(q) in self.simulated:
            q.disable()
            self.simulated[id(q)] = on
        else:
            (q.enable if on else q.disable)()

    def apply(self, module: nn.Module, state: str) -> None:
        for name, q in _quantizers(module):
            enabled, amax = self.saved[id(q)]
            if amax is not None:
                q.amax = amax
            on = enabled and state != "reference"
            if state == "baseline" and on and name.endswith("input_quantizer") and amax is not None:
                q.amax = torch.full_like(amax, _baseline_amax(q))
            if state == "baseline" and on and id(q) in self.baseline_weight:
                q.amax = self.baseline_weight[id(q)].to(amax.device)
            self._set(q, on)
        for m in module.modules():
            if id(m) not in self.exact:
                continue
            m.__dict__.pop("expert_amax_override", None)
            if state == "ours" and self.per_expert and m.expert_input_amax:
                m.__dict__["expert_amax_override"] = dict(m.expert_input_amax)
            for p, exact in self.exact[id(m)].items():
                for q, is_exact in zip(getattr(m, f"{p}_weight_quantizers"), exact):
                    if is_exact:
                        self._set(q, False)

    def restore(self, model: nn.Module) -> None:
        for h in self.handles:
            h.remove()
        for _, q in _quantizers(model):
            enabled, amax = self.saved[id(q)]
            if amax is not None:
                q.amax = amax
            (q.enable if enabled else q.disable)()
        for m in model.modules():
            m.__dict__.pop("expert_amax_override", None)


@dataclasses.dataclass
class _Sums:
    kind: str
    err: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(STATES, 0.0))
    ref: float = 0.0
    rows: int = 0

    def add(self, state: str, y: torch.Tensor, ref: torch.Tensor) -> None:
        self.err[state] += float((y.float() - ref.float()).pow(2).sum())

    def add_ref(self, ref: torch.Tensor, rows: int) -> None:
        self.ref += float(ref.float().pow(2).sum())
        self.rows += rows


def _quantized(module: nn.Module, states: _States) -> bool:
    """Whether the recipe quantizes `module` (any of its quantizers enabled after calibration)."""
    return any(states.saved[id(q)][0] for _, q in _quantizers(module))


def _is_linear(module: nn.Module) -> bool:
    weight = module._parameters.get("weight")
    return weight is not None and weight.dim() == 2 and hasattr(module, "weight_quantizer")


@contextlib.contextmanager
def _hooks(model: nn.Module, states: _States, sums: dict[str, _Sums], moe_glob: str, skipped: list[str]):
    import fnmatch

    active = {"on": True}  # hooks measure only the reference pass, not their own re-runs

    @contextlib.contextmanager
    def measuring():
        active["on"] = False
        try:
            yield
        finally:
            active["on"] = True

    def rerun_hook(name, kind):
        """A linear module or an MoE block re-run on its reference inputs in each state (for a block this is
        collective under EP: every rank re-runs its blocks in the same order)."""
        def hook(module, args, kwargs, output):
            if not active["on"]:
                return
            with measuring():
                ref = output[0] if isinstance(output, tuple) else output
                s = sums.setdefault(name, _Sums(kind))
                s.add_ref(ref, ref.reshape(-1, ref.shape[-1]).shape[0])
                for state in STATES:
                    states.apply(module, state)
                    y = module.forward(*args, **kwargs)
                    s.add(state, y[0] if isinstance(y, tuple) else y, ref)
                states.apply(module, "reference")
        return hook

    def expert_probe(name):
        def probe(module, e, rows, y_ref, n):
            if not active["on"]:
                return
            with measuring():
                s = sums.setdefault(name, _Sums("experts"))
                s.add_ref(y_ref[:n], n)
                gate_up, down = module.gate_up_proj, module.down_proj
                for state in STATES:
                    states.apply(module, state)
                    s.add(state, module.expert_output(e, rows, gate_up, down)[:n], y_ref[:n])
                states.apply(module, "reference")
        return probe

    handles, probed = [], []
    for name, module in model.named_modules():
        if fnmatch.fnmatchcase(name, moe_glob):
            handles.append(module.register_forward_hook(rerun_hook(name, "moe_block"), with_kwargs=True))
        elif hasattr(module, "expert_input_amax") and _quantized(module, states):
            module.__dict__["quality_probe"] = expert_probe(name)
            probed.append(module)
        elif _is_linear(module) and _quantized(module, states):
            if isinstance(module._parameters["weight"], DTensor) and not getattr(module, "_is_expert_parallel", 0):
                skipped.append(name)
                continue
            handles.append(module.register_forward_hook(rerun_hook(name, "linear"), with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for m in probed:
            m.__dict__.pop("quality_probe", None)


def _logit_stats(ref: torch.Tensor, other: torch.Tensor) -> tuple[float, int]:
    """(sum over tokens of KL(ref || other), tokens whose top-1 agrees)."""
    p = torch.log_softmax(ref.float().reshape(-1, ref.shape[-1]), dim=-1)
    q = torch.log_softmax(other.float().reshape(-1, other.shape[-1]), dim=-1)
    kl = float((p.exp() * (p - q)).sum())
    return kl, int((p.argmax(-1) == q.argmax(-1)).sum())


def measure_quality(model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]], *, moe_glob: str,
                    expert_input_scales: str = "per-expert",
                    baseline_weight_amax: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The report (module doc) as a JSON-ready dict, the same on every rank. Leaves the model calibrated as
    it was. `baseline_weight_amax` (quantizer name -> amax; `CalibrationResult.max_weight_amax`): the weight
    amax of max calibration where a weight search changed ours; the baseline quantizes those weights with it."""
    states = _States(model, expert_input_scales, baseline_weight_amax)
    sums: dict[str, _Sums] = {}
    skipped: list[str] = []
    logits = {state: [0.0, 0] for state in STATES}
    tokens = 0
    try:
        with torch.no_grad():
            for batch in batches:
                states.apply(model, "reference")
                with _hooks(model, states, sums, moe_glob, skipped):
                    ref = model(**batch, use_cache=False).logits
                tokens += ref.shape[0] * ref.shape[1]
                for state in STATES:
                    states.apply(model, state)
                    kl, agree = _logit_stats(ref, model(**batch, use_cache=False).logits)
                    logits[state][0] += kl
                    logits[state][1] += agree
    finally:
        states.restore(model)
    return _reduce(sums, logits, tokens, sorted(set(skipped)))


def _reduce(sums: dict[str, _Sums], logits: dict[str, list], tokens: int, skipped: list[str]) -> dict[str, Any]:
    mine = {"sums": {n: dataclasses.asdict(s) for n, s in sums.items()}, "logits": logits, "tokens": tokens}
    parts = gather_objects(mine) if in_group() else [mine]
    total: dict[str, dict] = {}
    for part in parts:
        for name, s in part["sums"].items():
            t = total.setdefault(name, {"kind": s["kind"], "err": dict.fromkeys(STATES, 0.0), "ref": 0.0, "rows": 0})
            t["ref"] += s["ref"]
            t["rows"] += s["rows"]
            for state in STATES:
                t["err"][state] += s["err"][state]
    tokens = sum(p["tokens"] for p in parts)

    def rel(t, state):
        return math.sqrt(t["err"][state] / t["ref"]) if t["ref"] > 0 else None

    modules = {name: {"kind": t["kind"], "rows": t["rows"], **{state: rel(t, state) for state in STATES}}
               for name, t in sorted(total.items())}
    out_logits = {state: {"kl": sum(p["logits"][state][0] for p in parts) / max(tokens, 1),
                          "top1_agreement": sum(p["logits"][state][1] for p in parts) / max(tokens, 1)}
                  for state in STATES}
    return {"tokens": tokens, "states": {"ours": "this export", "baseline": "calibration-free (input_scale 1.0)"},
            "modules": modules, "logits": out_logits, "skipped_fsdp_modules": skipped}


def summary_lines(report: Mapping[str, Any]) -> list[str]:
    """Three lines for the ptq summary: routed experts, other quantized modules, logits."""
    def by_kind(kind):
        return [m for m in report["modules"].values() if m["kind"] == kind and m["ours"] is not None]

    lines = []
    for kind, what in (("experts", "routed experts"), ("linear", "other quantized modules")):
        mods = by_kind(kind)
        blocks = [m for m in by_kind("moe_block") if m["ours"] or m["baseline"]]  # a block with something quantized
        if not mods and kind == "experts" and blocks:
            # experts of a class without modelopt_ext's per-expert probe (transformers' own, e.g. DeepSeek-V3):
            # their MoE blocks' outputs are what is measured
            kind, what, mods = "moe_block", "routed experts, per MoE block (no per-expert probe)", blocks
        if not mods:
            lines.append(f"quality, {what}: none quantized")
            continue
        ours = sum(m["ours"] for m in mods) / len(mods)
        base = sum(m["baseline"] for m in mods) / len(mods)
        better = sum(m["ours"] < m["baseline"] for m in mods)
        same = sum(m["ours"] == m["baseline"] for m in mods)
        lines.append(f"quality, {what} ({len(mods)} modules, {report['tokens']:,} held-out tokens): mean output "
                     f"error ours {ours:.4f} vs calibration-free {base:.4f}; ours lower in {better}, equal in {same}, "
                     f"higher in {len(mods) - better - same}")
    lg = report["logits"]
    lines.append(f"quality, logits: KL ours {lg['ours']['kl']:.2e} vs calibration-free {lg['baseline']['kl']:.2e}; "
                 f"top-1 agreement ours {lg['ours']['top1_agreement']:.1%} vs {lg['baseline']['top1_agreement']:.1%}")
    return lines


def write_report(directory, report: Mapping[str, Any]) -> None:
    """quality.json (the report) and quality.png (per MoE layer: the routed experts' and the block's output
    error, ours vs calibration-free) into `directory`."""
    import json
    import re
    from pathlib import Path

    from modelopt_ext.report.png import grouped_bars_png

    directory = Path(directory)
    (directory / "quality.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    rows = []
    for name, m in report["modules"].items():
        layer = re.search(r"\.(\d+)\.", name)
        if m["kind"] in ("experts", "moe_block") and layer and m["ours"] is not None:
            rows.append((int(layer.group(1)), m["kind"], m))
    if not rows:
        return
    layers = sorted({layer for layer, _, _ in rows})
    series = {}
    for kind, label in (("experts", "experts"), ("moe_block", "block")):
        for state, who in (("ours", "ours"), ("baseline", "free")):
            values = {layer: m[state] for layer, k, m in rows if k == kind}
            series[f"{label} {who}"] = [values.get(layer, float("nan")) for layer in layers]
    grouped_bars_png(directory / "quality.png", title=f"output error on {report['tokens']:,} held-out tokens",
                     categories=[f"L{layer}" for layer in layers], series=series, ylabel="relative error")

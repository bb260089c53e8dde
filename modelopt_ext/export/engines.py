"""Serving-engine checks of an export: would vLLM, SGLang and TensorRT-LLM load it as it was quantized?

`check_engines(export_dir)` reads the export lazily (safetensors headers; tensor values only for the value
rules) and applies, per engine, the rules its loader imposes (docs/export.md, "Serving engines"):

- `method`: config names a quantization method and algorithms the engine implements;
- `fields`: the keys the engine requires are there, and config.json agrees with hf_quant_config.json;
- `names`: every linear module resolves, under the engine's naming and `quantized_layers` lookup, to the
  format its tensors have (unquantized ones to none, or are excluded);
- `fused-groups`: the modules an engine fuses into one GEMM share one format; FP8 block members line up
  with 128-row blocks;
- `exclusions`: no exclusion pattern excludes a quantized module under the engine's matching rules;
- `never-quantized`: modules the engines always build unquantized carry no quantized tensors;
- `experts`: every routed expert has every tensor, w1/w3 share their scales where the engine needs it;
- `scales`: scales are finite and positive; a block scale is zero only over an all-zero block.
"""

from __future__ import annotations

import fnmatch
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from modelopt_ext.export import engine_names as en
from modelopt_ext.export.layout import check_layout
from modelopt_ext.export.quant_layout import HF_QUANT_CONFIG_NAME, _same_grid, fp8_pb_grid
from modelopt_ext.export.serving import FP8_BLOCK
from modelopt_ext.export.tensors import _Entry, _load_json, _Tensors
from modelopt_ext.families import FamilySpec, experts_module_glob, family_for_config, read_config

__all__ = ["RULES", "RuleResult", "check_engines", "engine_verdicts", "format_results"]

logger = logging.getLogger(__name__)

RULES = ("method", "fields", "names", "fused-groups", "exclusions", "never-quantized", "experts", "scales")
SHOWN = 5  # problems (or notes) per rule line
COMPANIONS = ("weight_scale", "weight_scale_2", "input_scale")
UNQUANTIZED, ABSENT = "unquantized", "absent"
_FLOAT = ("F16", "BF16", "F32", "F64")


@dataclass(frozen=True)
class RuleResult:
    """One engine rule applied to one export: ok iff no problems; notes are remarks that do not fail it."""

    engine: str
    rule: str
    source: str  # where in the engine's source the rule comes from
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems


def _tensor_format(leaves: Mapping[str, _Entry]) -> str:
    """The algorithm a module's tensors have (`weight_scale` present), or "unrecognised (...)"."""
    w, s = leaves.get("weight"), leaves["weight_scale"]
    inp, s2 = "input_scale" in leaves, "weight_scale_2" in leaves
    if w is not None and w.dtype == "F8_E4M3" and s.dtype == "F32" and not s2:
        if inp and all(d == 1 for d in s.shape):
            return "FP8"
        if not inp and len(w.shape) == 2 and _same_grid(s.shape, fp8_pb_grid(w.shape)):
            return "FP8_PB_WO"
    if w is not None and w.dtype == "U8" and s.dtype == "F8_E4M3" and s2:
        return "NVFP4" if inp else "W4A16_NVFP4"
    return "unrecognised (" + ", ".join(f"{k} {e.dtype} {list(e.shape)}" for k, e in sorted(leaves.items())) + ")"


class _Export:
    """An export's configs, tensor headers and module formats, read once."""

    def __init__(self, export_dir: Path, config: Mapping, family: FamilySpec, stack: ExitStack):
        layout_problems: list[str] = []
        _, entries, _ = check_layout(export_dir, layout_problems)
        if layout_problems:
            logger.debug("layout problems (reported by verify): %s", layout_problems[:SHOWN])
        hf = _load_json(export_dir / HF_QUANT_CONFIG_NAME, layout_problems)
        nested = hf.get("quantization") if isinstance(hf, dict) else None
        flat = config.get("quantization_config")
        self.nested, self.flat = (q if isinstance(q, dict) else None for q in (nested, flat))
        self.config, self.serving = config, family.serving
        self.tensors = _Tensors(export_dir, {k: e.file for k, e in entries.items()}, stack)
        self.modules: dict[str, dict[str, _Entry]] = defaultdict(dict)
        for key, entry in entries.items():
            module, _, leaf = key.rpartition(".")
            self.modules[module][leaf] = entry
        names = family.export_expert_names
        self.gate, self.up, self.down = (names.get(k, k) for k in ("gate_proj", "up_proj", "down_proj"))
        self.bank_glob = experts_module_glob(family)
        sizes = family.sizes(config) if family.sizes is not None else {}
        experts = sizes.get("num_experts") or (config.get("text_config") or config).get("num_experts")
        self.num_experts = int(experts) if experts else None  # None: from the experts' tensors
        self.groups = tuple(self.serving.fused_groups(config))
        self.algos = {m: _tensor_format(leaves) for m, leaves in self.modules.items() if "weight_scale" in leaves}
        found: dict[str, list[tuple[frozenset, str]]] = defaultdict(list)  # linear unit -> (leaves, format)
        for module, leaves in self.modules.items():
            w, kinds = leaves.get("weight"), frozenset(leaves) & {"weight", *COMPANIONS}
            if module in self.algos:
                found[self.bank(module)].append((kinds, self.algos[module]))
            elif w is not None and len(w.shape) == 2 and w.dtype in _FLOAT and "embed" not in module.rpartition(".")[2]:
                found[self.bank(module)].append((kinds, UNQUANTIZED))
        # a bank's format: that of its complete experts (an incomplete one is the `experts` rule's problem)
        self.formats = {}
        for unit, items in found.items():
            union = frozenset().union(*(kinds for kinds, _ in items))
            self.formats[unit] = {f for kinds, f in items if kinds == union} or {f for _, f in items}
        self.banks = sorted(u for u in self.formats if fnmatch.fnmatchcase(u, self.bank_glob))
        self.memo: dict[str, object] = {}  # engine-independent results and per-engine views, computed once

    def once(self, key: str, compute):
        """`compute()`, computed on the first call for `key` only."""
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def bank(self, module: str) -> str:
        """The experts bank of a per-expert module (`...experts.{e}.w1` -> `...experts`), else the module."""
        parent, _, proj = module.rpartition(".")
        bank, _, index = parent.rpartition(".")
        if proj in (self.gate, self.up, self.down) and index.isdigit() and fnmatch.fnmatchcase(bank, self.bank_glob):
            return bank
        return module

    def format_of(self, unit: str) -> str:
        found = sorted(self.formats.get(unit, ()))
        return ABSENT if not found else found[0] if len(found) == 1 else "mixed (" + ", ".join(found) + ")"

    def quantized_units(self) -> list[str]:
        return sorted(u for u in self.formats if self.format_of(u) not in (UNQUANTIZED, ABSENT))

    def patterns(self) -> list[str]:
        """Every exclusion pattern of both configs (hf_quant_config exclude_modules, config.json ignore)."""
        found = (self.nested or {}).get("exclude_modules") or [], (self.flat or {}).get("ignore") or []
        return list(dict.fromkeys(p for ps in found if isinstance(ps, list) for p in ps if isinstance(p, str)))

    def view(self, engine: str) -> en.EngineView:
        return self.once(f"view {engine}", lambda: en.engine_view(engine, self.flat, self.nested,
                                                                  self.serving.sglang_key))

    def excluded(self, engine: str, name: str, shards: Sequence[str] = ()) -> bool:
        return en.excluded(engine, name, self.view(engine).exclude, shards)


def _rule_names(exp: _Export, engine: str) -> tuple[list[str], list[str]]:
    view, serving = exp.view(engine), exp.serving
    if engine == "trtllm":
        if serving.trtllm_names is None:
            return [f"how TensorRT-LLM's model code for family {exp.family.name!r} looks modules up is not known "
                    "(ServingSpec.trtllm_names)"], []
        quantized = [u for u in exp.quantized_units() if u not in exp.banks and not serving.never_quantized(u)]
        banks = [b for b in exp.banks if exp.format_of(b) != UNQUANTIZED]  # an unquantized bank: exclusions' rule
        return serving.trtllm_names({b: exp.format_of(b) for b in banks}, view,
                                    {u: exp.format_of(u) for u in quantized}), []
    candidates = en.vllm_candidates if engine == "vllm" else en.sglang_candidates

    def wanted(name: str, shards: Sequence[str] = ()) -> tuple[str | None, str]:
        if view.algo != en.MIXED:
            return view.algo, "top-level quant_algo"
        return en.resolve(view.layers, name, shards, candidates)

    problems: list[str] = []
    fused = [g.fused[engine] for g in exp.groups if engine in g.fused]
    members = {m for _, ms in fused for m in ms}
    for unit in sorted(exp.formats):
        name = serving.engine_name(unit, engine)
        if unit in members or serving.never_quantized(unit) or exp.excluded(engine, name):
            continue
        problems += en.mismatch(unit, name, exp.format_of(unit), *wanted(name))
    for fused_name, ms in fused:
        shards = [serving.engine_name(m, engine) for m in ms]
        haves = {exp.format_of(m) for m in ms}
        if len(haves) == 1 and not exp.excluded(engine, fused_name, shards):  # split groups: fused-groups
            problems += en.mismatch(fused_name, fused_name, haves.pop(), *wanted(fused_name, shards))
    return problems, []


def _rule_fused_groups(exp: _Export, engine: str) -> tuple[list[str], list[str]]:
    problems: list[str] = []
    partial: dict[tuple[str, str, int], list[int]] = defaultdict(list)
    for group in exp.groups:
        if engine not in group.fused:
            continue
        fused_name, members = group.fused[engine]
        leaf = {m: m.rpartition(".")[2] for m in members}
        formats = {m: exp.format_of(m) for m in members}
        if len(set(formats.values())) > 1:
            carry = ", ".join(f"{leaf[m]} {f}" for m, f in formats.items())
            problems.append(f"{group.name} of layer {group.layer}: {engine} fuses them into "
                            f"{fused_name.rpartition('.')[2]}, but {carry}")
            continue
        if formats[members[0]] != "FP8_PB_WO" or engine == "trtllm":  # TensorRT-LLM dequantizes them to bf16
            continue
        for i, m in enumerate(members):
            rows, cols = exp.modules[m]["weight"].shape
            if cols % FP8_BLOCK:
                problems.append(f"{m}: input width {cols} is not a multiple of {FP8_BLOCK} (FP8 block GEMM)")
            if rows % FP8_BLOCK and i < len(members) - 1:
                problems.append(f"{m}: {rows} rows, not a multiple of {FP8_BLOCK}, ahead of {leaf[members[i + 1]]}"
                                f" in {fused_name.rpartition('.')[2]}: its last block row straddles the next member")
            elif rows % FP8_BLOCK:
                partial[(group.name, leaf[m], rows)].append(group.layer)
    notes = [f"{name}: last member {leaf} ({rows} rows) ends in a partial {FP8_BLOCK}-row block, layers {layers}"
             for (name, leaf, rows), layers in sorted(partial.items())]
    return problems, notes


def _rule_exclusions(exp: _Export, engine: str) -> tuple[list[str], list[str]]:
    problems, patterns = [], exp.patterns()
    for unit in exp.quantized_units():
        name = exp.serving.engine_name(unit, engine)
        for p in patterns:
            problems += [f"pattern {p!r} excludes quantized {unit} ({hit})" for hit in en.engine_hits(engine, p, name)]
    for group in exp.groups:
        if engine in group.fused and exp.format_of(group.members[0]) not in (UNQUANTIZED, ABSENT):
            name = group.fused[engine][0]
            problems += [f"pattern {p!r} excludes fused {name} ({h})"
                         for p in patterns for h in en.engine_hits(engine, p, name)]
    return problems, []


def _never_quantized(exp: _Export) -> tuple[str, ...]:
    problems = []
    for module, leaves in sorted(exp.modules.items()):
        w = leaves.get("weight")
        quantized = [k for k in COMPANIONS if k in leaves]
        if w is not None and w.dtype in ("F8_E4M3", "U8"):
            quantized.append(f"weight {w.dtype}")
        if quantized and exp.serving.never_quantized(module):
            problems.append(f"{module} carries {', '.join(quantized)}; the engines build it unquantized")
    return tuple(problems)


def _expert_facts(exp: _Export) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(missing tensors, w1/w3 input_scale mismatches, w1/w3 weight_scale_2 mismatches)."""
    missing, inputs, scales2 = [], [], []
    per_bank: dict[str, dict[tuple[int, str], dict[str, _Entry]]] = defaultdict(dict)
    for module, leaves in exp.modules.items():
        if exp.bank(module) != module:
            parent, _, proj = module.rpartition(".")
            per_bank[exp.bank(module)][(int(parent.rpartition(".")[2]), proj)] = leaves
    n = exp.num_experts or 1 + max((e for experts in per_bank.values() for e, _ in experts), default=-1)
    for bank in exp.banks:
        experts = per_bank[bank]
        missing += [f"{bank}.{e}.{p}: expert index beyond num_experts {n}" for e, p in sorted(experts) if e >= n]
        required = {"weight"} | {leaf for leaves in experts.values() for leaf in leaves if leaf in COMPANIONS}
        for e in range(n):
            for p in (exp.gate, exp.down, exp.up):
                lacking = sorted(required - set(experts.get((e, p), {})))
                if lacking:
                    missing.append(f"{bank}.{e}.{p} has no {', '.join(lacking)}")
            gate, up = experts.get((e, exp.gate), {}), experts.get((e, exp.up), {})
            for leaf, out in (("input_scale", inputs), ("weight_scale_2", scales2)):
                if leaf in gate and leaf in up:
                    a, b = (exp.tensors.get(t[leaf].name).float() for t in (gate, up))
                    if not torch.equal(a, b):
                        out.append(f"{bank}.{e}: {exp.gate}.{leaf} {a.flatten()[0]:.6g} != {exp.up}.{leaf} "
                                   f"{b.flatten()[0]:.6g}")
    return tuple(missing), tuple(inputs), tuple(scales2)


def _rule_experts(exp: _Export, engine: str) -> tuple[list[str], list[str]]:
    missing, inputs, scales2 = exp.once("experts", lambda: _expert_facts(exp))
    return [*missing, *(inputs if engine == "trtllm" else ()), *scales2], []


def _scale_problems(exp: _Export) -> tuple[str, ...]:
    problems = []
    for module, algo in sorted(exp.algos.items()):
        leaves = exp.modules[module]
        for leaf in ("weight_scale_2", "input_scale", "weight_scale"):
            if leaf not in leaves:
                continue
            value = exp.tensors.get(leaves[leaf].name).float()
            block = leaf == "weight_scale" and algo in ("FP8_PB_WO", "NVFP4", "W4A16_NVFP4")
            bad = ~torch.isfinite(value) | (value < 0 if block else value <= 0)
            if bool(bad.any()):
                what = "negative" if block else "non-positive"
                problems.append(f"{module}.{leaf}: {int(bad.sum())} non-finite or {what} value(s)")
            elif block and bool((value == 0).any()):
                n = _zero_blocks_over_codes(exp.tensors.get(leaves["weight"].name), value, algo)
                if n:
                    problems.append(f"{module}.weight_scale: {n} zero block scale(s) over non-zero codes")
    return tuple(problems)


def _zero_blocks_over_codes(weight: torch.Tensor, scale: torch.Tensor, algo: str) -> int:
    """Blocks whose scale is zero while the weight block holds a non-zero code (the engines read it as 0)."""
    bits = weight.contiguous().view(torch.uint8)
    if algo == "FP8_PB_WO":
        grid = fp8_pb_grid(tuple(weight.shape))
        nonzero = torch.zeros(grid[0] * FP8_BLOCK, grid[1] * FP8_BLOCK, dtype=torch.bool)
        nonzero[: weight.shape[0], : weight.shape[1]] = (bits & 0x7F) != 0  # E4M3: 0x00 and 0x80 are zero
        blocks = nonzero.reshape(grid[0], FP8_BLOCK, grid[1], FP8_BLOCK).any(dim=3).any(dim=1)
        scale = scale.reshape(grid)
    else:  # two E2M1 codes a byte; 0 and 8 are zero
        if bits.shape[-1] % scale.shape[-1]:
            return 0  # malformed: reported by verify
        blocks = ((bits & 0x77) != 0).reshape(*scale.shape, -1).any(dim=-1)
    return int(((scale == 0) & blocks).sum())


_CHECKS = {  # rule -> check(export, engine) -> (problems, notes); engine-independent results are computed once
    "method": lambda exp, engine: (en.method_problems(engine, exp.flat, exp.nested), []),
    "fields": lambda exp, engine: (en.fields_problems(engine, exp.flat, exp.nested), []),
    "names": _rule_names,
    "fused-groups": _rule_fused_groups,
    "exclusions": _rule_exclusions,
    "never-quantized": lambda exp, engine: (list(exp.once("never-quantized", lambda: _never_quantized(exp))), []),
    "experts": _rule_experts,
    "scales": lambda exp, engine: (list(exp.once("scales", lambda: _scale_problems(exp))), []),
}


def _selected(engines: Sequence[str]) -> list[str]:
    out = []
    for engine in engines:
        for e in en.ENGINES if engine == "all" else (engine,):
            if e not in en.ENGINES:
                raise ValueError(f"unknown serving engine {e!r}; known: {', '.join(en.ENGINES)}, all")
            if e not in out:
                out.append(e)
    return out


def check_engines(export_dir: str | Path, engines: Sequence[str] = en.ENGINES) -> list[RuleResult]:
    """Every rule of every engine in `engines` ("all" for all) on the export, in `RULES` order per engine.
    The family and its serving facts come from the export's config.json; a family without them gives one
    failing `family` result per engine."""
    export_dir, selected = Path(export_dir), _selected(engines)
    config = read_config(export_dir)
    family = family_for_config(config, source=str(export_dir / "config.json"))
    if family.serving is None:
        why = f"the serving engines' rules are unknown for family {family.name!r} (FamilySpec.serving is None)"
        return [RuleResult(e, "family", "modelopt_ext/families.py: FamilySpec.serving", (why,)) for e in selected]
    results = []
    with ExitStack() as stack:
        exp = _Export(export_dir, config, family, stack)
        for engine in selected:
            for rule, check in _CHECKS.items():
                if engine not in exp.serving.engines:
                    problems, notes = [f"no serving facts for {engine} in family {family.name!r}"], []
                else:
                    problems, notes = check(exp, engine)
                source = en.sources(engine, rule, exp.serving.sources)
                results.append(RuleResult(engine, rule, source, tuple(problems), tuple(notes)))
    logger.debug("engine checks of %s: %d rule(s), %d failed", export_dir, len(results),
                 sum(not r.ok for r in results))
    return results


def engine_verdicts(results: Sequence[RuleResult]) -> dict[str, bool]:
    """engine -> whether every one of its rules passed."""
    verdicts: dict[str, bool] = {}
    for r in results:
        verdicts[r.engine] = verdicts.get(r.engine, True) and r.ok
    return verdicts


def _capped(items: Sequence[str]) -> str:
    more = f"; {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return "; ".join(items[:SHOWN]) + more


def format_results(results: Sequence[RuleResult]) -> list[str]:
    """One line per rule: `PASS engine rule (source)[: note: ...]` or `FAIL engine rule (source): problems`."""
    lines = []
    for r in results:
        line = f"{'PASS' if r.ok else 'FAIL'} {r.engine} {r.rule} ({r.source})"
        if r.problems:
            line += ": " + _capped(r.problems)
        elif r.notes:
            line += ": note: " + _capped(r.notes)
        lines.append(line)
    return lines

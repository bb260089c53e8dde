"""Checking `quant_cfg` quantizer patterns against a ModelOpt-quantized model (re-exported by `recipes`).

`check_patterns_match` refuses an entry whose `quantizer_name` glob (with its `parent_class`, if any)
matches no quantizer of the model, naming the file and entry it came from (`EntrySource`). Entries from
ModelOpt's generic default units are exempt (their globs are written for many architectures), and a
disabling entry may match a module or parameter name instead (a parameter ModelOpt does not wrap, kept
out on purpose). Globs are matched the way ModelOpt matches them: against the quantizer name and, for the
per-expert quantizers of fused experts, the name with the list index collapsed.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Mapping
from typing import Any

from modelopt_ext.quant.recipe_io import EntrySource

logger = logging.getLogger(__name__)

# Per-expert quantizers of fused experts live in ModuleLists (`..._weight_quantizers.7`); ModelOpt matches
# globs against the name and against the name with the list index collapsed (`..._weight_quantizer`).
_EXPERT_LIST = re.compile(r"(weight_quantizer|input_quantizer)s?\.\d+(?=$|\.)")


def quantizers(model) -> dict[str, Any]:
    """Every quantizer module of a ModelOpt-quantized model, by name (ModelOpt's TensorQuantizer and
    SequentialQuantizer)."""
    from modelopt.torch.quantization.nn import SequentialQuantizer, TensorQuantizer

    return {n: m for n, m in model.named_modules() if isinstance(m, (TensorQuantizer, SequentialQuantizer))}


def enabled_quantizers(model) -> dict[str, Any]:
    """The quantizers of `model` that are enabled (`is_enabled`)."""
    return {n: m for n, m in quantizers(model).items() if m.is_enabled}


def _name_matches(pattern: str, name: str) -> bool:
    collapsed = _EXPERT_LIST.sub(r"\1", name)
    return fnmatch.fnmatchcase(name, pattern) or (collapsed != name and fnmatch.fnmatchcase(collapsed, pattern))


def _enables(entry: Mapping[str, Any]) -> bool:
    return bool(entry.get("enable", True))  # an entry with cfg and no enable enables


def check_patterns_match(quant_cfg, model) -> None:
    """Raise ValueError if a `quant_cfg` entry (other than ModelOpt's generic default units) matches no
    quantizer of the quantized `model`, naming the file and entry it came from.

    A disabling entry that matches no quantizer passes if it matches a module or parameter name of the
    model (e.g. `*A_log*`: a parameter ModelOpt does not wrap, kept out on purpose); a misspelt one does not.
    `quant_cfg` is what `quant_config` returns, a loaded recipe, or a plain list of entries.
    """
    from modelopt.torch.quantization.nn import QuantModuleRegistry

    if isinstance(quant_cfg, Mapping) and "quantize" in quant_cfg:
        entries = quant_cfg["quantize"]["quant_cfg"]
    elif isinstance(quant_cfg, Mapping):
        entries = quant_cfg["quant_cfg"]
    else:
        entries = list(quant_cfg)
    sources = getattr(quant_cfg, "sources", None)
    if sources is None or len(sources) != len(entries):
        sources = [EntrySource("quant_cfg", f"[{i}]") for i in range(len(entries))]
    found = quantizers(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no quantizers: check the model mtq.quantize returned")
    others = ([n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
              + [n for n, _ in model.named_buffers()])  # e.g. a router's correction bias, kept out on purpose
    problems = []
    for entry, source in zip(entries, sources):
        if source.modelopt_default:
            continue
        pattern = entry["quantizer_name"]
        parent_class = None
        if entry.get("parent_class"):
            try:
                parent_class = QuantModuleRegistry[entry["parent_class"]]
            except KeyError:
                problems.append(f"{source}: parent_class {entry['parent_class']!r} is not a ModelOpt quant class")
                continue
        hits = [n for n in found if _name_matches(pattern, n) and (
            parent_class is None or isinstance(model.get_submodule(n.rpartition(".")[0]), parent_class))]
        if hits:
            continue
        if not _enables(entry) and parent_class is None and any(fnmatch.fnmatchcase(n, pattern) for n in others):
            logger.debug("%s: %r matches modules/parameters without quantizers only", source, pattern)
            continue
        problems.append(f"{source}: quantizer_name {pattern!r} matches no quantizer"
                        + ("" if _enables(entry) else ", module or parameter") + f" of {type(model).__name__}")
    if problems:
        raise ValueError("quantizer patterns that match nothing:\n  " + "\n  ".join(problems))

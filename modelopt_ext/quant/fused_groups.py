"""Refuse a recipe that would quantize one engine-fused group of modules in two ways, before loading.

Serving engines load some groups of a layer's projections as one GEMM with one quantization method (Kimi-K3:
KDA q/k/v/g/f_a/b, MLA q_a + kv_a_proj_with_mqa, gate/up; the family's `ServingSpec.fused_groups`). An
export whose members differ does not load correctly (vLLM: "some but not all shards quantized", or bf16
weights copied into an FP8 parameter). `check_fused_groups(quant_cfg, config)` works out, from the recipe's
`quant_cfg` list alone, how ModelOpt will set up each member's weight and input quantizer, and refuses a
split group naming the group and the modules on each side.

ModelOpt's rules (`modelopt.torch.quantization.conversion.set_quantizer_by_cfg`, 0.47): entries apply in
order to every quantizer whose name matches `quantizer_name` (fnmatch); an entry with `cfg` replaces the
quantizer's attributes whole (enabled unless `enable: false`); one without `cfg` only switches it on or
off; `parent_class` restricts an entry to quantizers whose module is of that class. The members are linear
layers; `tests/quant/test_fused_groups.py` checks the result against ModelOpt's own conversion for every
shipped recipe.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable, Mapping
from typing import Any

QUANTIZERS = ("weight_quantizer", "input_quantizer")
_LINEAR_CLASSES = ("Linear", "nn.Linear", "QuantLinear")


def _attributes(cfg) -> Any:
    from modelopt.torch.quantization.config import QuantizerAttributeConfig

    def one(c):
        c = c if isinstance(c, QuantizerAttributeConfig) else QuantizerAttributeConfig(**c)
        return c.model_dump(mode="json", exclude={"enable"})

    return [one(c) for c in cfg] if isinstance(cfg, list) else one(cfg)


def quantizer_states(quant_cfg: list, names: Iterable[str]) -> dict[str, tuple[bool, Any]]:
    """quantizer name -> (enabled, attributes or None for ModelOpt's defaults) after `quant_cfg`."""
    from modelopt.torch.quantization.config import normalize_quant_cfg_list

    entries = [(e["quantizer_name"], e.get("cfg"), e.get("enable", True), e.get("parent_class"))
               for e in normalize_quant_cfg_list(list(quant_cfg)) if isinstance(e.get("quantizer_name"), str)]
    states = {}
    for name in names:
        enabled, attrs = True, None
        for pattern, cfg, enable, parent in entries:
            if parent and parent not in _LINEAR_CLASSES:
                continue
            if not fnmatch.fnmatch(name, pattern):
                continue
            enabled = bool(enable)
            if cfg is not None:
                attrs = _attributes(cfg)
        states[name] = (enabled, attrs if enabled else None)
    return states


def describe(state: tuple[bool, Any]) -> str:
    """A quantizer state in words: "unquantized", "FP8 E4M3", "FP8 E4M3, 128x128 blocks", "E2M1, 16-blocks"."""
    enabled, attrs = state
    if not enabled:
        return "unquantized"
    if attrs is None:
        return "ModelOpt's default (INT8)"
    if isinstance(attrs, list):
        return " then ".join(describe((True, a)) for a in attrs)
    bits = attrs.get("num_bits")
    text = {(4, 3): "FP8 E4M3", (5, 2): "FP8 E5M2", (2, 1): "E2M1"}.get(tuple(bits) if isinstance(bits, list) else (),
                                                                           f"INT{bits}")
    blocks = attrs.get("block_sizes") or {}
    sizes = [str(v) for k, v in sorted(blocks.items(), key=lambda kv: str(kv[0])) if str(k).lstrip("-").isdigit()]
    if len(sizes) == 2:
        text += f", {sizes[1]}x{sizes[0]} blocks"
    elif len(sizes) == 1:
        text += f", {sizes[0]}-blocks"
    elif attrs.get("axis") is not None:
        text += f", per channel (axis {attrs['axis']})"
    return text


def split_groups(quant_cfg: list, config: Mapping[str, Any], serving) -> list[str]:
    """One line per kind of split: a group whose members' quantizers would differ, with the modules on each
    side and the layers where it happens."""
    groups = serving.fused_groups(config)
    names = [f"{m}.{q}" for g in groups for m in g.members for q in QUANTIZERS]
    states = quantizer_states(quant_cfg, names)
    splits: dict[tuple, list[int]] = {}
    example: dict[tuple, Any] = {}
    for group in groups:
        sides: dict[str, list[str]] = {}
        for member in group.members:
            key = json.dumps([states[f"{member}.{q}"] for q in QUANTIZERS], sort_keys=True)
            sides.setdefault(key, []).append(member)
        if len(sides) < 2:
            continue
        signature = (group.name, tuple(tuple(m.rpartition(".")[2] for m in side) for side in sides.values()))
        splits.setdefault(signature, []).append(group.layer)
        example.setdefault(signature, (group, sides))
    lines = []
    for signature, layers in splits.items():
        group, sides = example[signature]
        parts = []
        for members in sides.values():
            w, i = (states[f"{members[0]}.{q}"] for q in QUANTIZERS)
            short = "/".join(m.rpartition(".")[2] for m in members)
            parts.append(f"{short}: weights {describe(w)}, inputs {describe(i)}")
        where = f"layers {layers}" if len(layers) > 1 else f"layer {layers[0]}"
        engines = ", ".join(f"{e} {name.rpartition('.')[2]}" for e, (name, _) in group.fused.items())
        lines.append(f"{group.name} ({engines}) in {where}: " + "; ".join(parts))
    return lines


def check_fused_groups(quant_cfg: list, config: Mapping[str, Any], serving, recipe: str) -> None:
    """Raise ValueError when `quant_cfg` (the recipe with the family's exclusions) splits a fused group."""
    lines = split_groups(quant_cfg, config, serving)
    if lines:
        raise ValueError(
            f"recipe {recipe} quantizes modules that the serving engines fuse into one GEMM in different ways; "
            "each group needs one quantization for all its modules: " + " | ".join(lines))

"""The export's quantization config as the serving engines parse it; their exclusion-matching rules.

ModelOpt 0.47 writes `hf_quant_config.json` for one engine's naming (the checkpoint's) and spells the
FP8 block algorithm in lower case; `serving_quant_config` rewrites it, using the family's `ServingSpec`
(how vLLM, SGLang and TensorRT-LLM build the model):

- algorithm names as the engines spell them (upper case: `FP8_PB_WO`), FP8 block entries with their block
  edge (`group_size: 128`, which SGLang reads), NVFP4 entries with theirs;
- under MIXED_PRECISION, every `quantized_layers` entry under each engine's name for the module, and each
  fused module an engine builds from a group whose members share one format under the fused name too;
  the top-level `group_size`, and `exclude_modules` naming the unquantized linear modules, as globs where a
  glob matches no quantized module under any engine's matching rules (`exclusion_hits`);
- config.json's flat copy (`flat_quant_config`) marked `quant_method: modelopt_mixed` for MIXED_PRECISION
  (SGLang takes its per-layer path only then), with the same layers, exclusions and group size.

The engines' matching of an exclusion pattern against a module name, as read in their loaders:
- vLLM: exact name; substring (`pattern in name`, also with `language_model.` removed); fnmatch over the
  whole name, with `X*` (no dot before the star) read as `X` and `X.*`;
- SGLang: the pattern, mapped as its weight mapper maps names (`block_sparse_moe` -> `mlp`, and a copy
  without `language_model.`), as a regex (`*` -> `.*`) matching the whole name or one dotted component;
  and a dotted-path match (the name, an ancestor, or a run of components);
- TensorRT-LLM: fnmatch over the name or any ancestor; `re:` patterns as regexes.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from collections.abc import Iterable, Mapping
from typing import Any

from modelopt_ext.export.quant_layout import FP8_PB_BLOCK as FP8_BLOCK
from modelopt_ext.export.quant_layout import NVFP4_DEFAULT_GROUP_SIZE as NVFP4_GROUP
from modelopt_ext.export.quant_layout import canonical_algo as canonical_algo

FP8_BLOCK_ALGO = "FP8_PB_WO"
_LAYER_INDEX = re.compile(r"\.(layers|blocks)\.\d+\.")


def _vllm_hits(pattern: str, name: str) -> list[str]:
    # `X*` with no dot before the star is read as the two patterns `X` and `X.*` first
    forms = [pattern[:-1], pattern[:-1] + ".*"] if pattern.endswith("*") and pattern[-2:-1] not in (".", "") else [
        pattern]
    hits = []
    if name in forms:
        hits.append("exact")
    if any("*" not in f and (f in name or f in name.removeprefix("language_model.")) for f in forms):
        hits.append("substring")
    if any(fnmatch.fnmatchcase(name, f) for f in forms):
        hits.append("fnmatch")
    return hits


def _sglang_pattern_forms(pattern: str) -> list[str]:
    mapped = pattern.replace("block_sparse_moe", "mlp")
    if mapped.startswith("language_model.model."):
        mapped_short = "model." + mapped.removeprefix("language_model.model.")
    else:
        mapped_short = mapped.removeprefix("language_model.")
    return list(dict.fromkeys((mapped, mapped_short)))


def _sglang_hits(pattern: str, name: str) -> list[str]:
    hits = []
    names = list(dict.fromkeys((name, name.removeprefix("language_model."))))
    parts = name.split(".")
    for form in _sglang_pattern_forms(pattern):
        regex = re.compile(re.escape(form).replace(r"\*", ".*"))
        if any(regex.fullmatch(n) for n in names) or any(regex.fullmatch(p) for p in parts):
            hits.append("regex")
        if "*" not in form and any(n == form or n.startswith(form + ".") or f".{form}." in f".{n}." for n in names):
            hits.append("dotted path")
    return sorted(set(hits))


def _trtllm_hits(pattern: str, name: str) -> list[str]:
    if pattern.startswith("re:"):
        return ["regex"] if re.fullmatch(pattern[3:], name) else []
    parts = name.split(".")
    ancestors = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    return ["fnmatch"] if any(fnmatch.fnmatchcase(a, pattern) for a in ancestors) else []


_RULES = {"vllm": _vllm_hits, "sglang": _sglang_hits, "trtllm": _trtllm_hits}


def exclusion_hits(pattern: str, module: str, serving) -> list[str]:
    """How the engines would exclude checkpoint module `module` with exclusion `pattern`: a list of
    "engine rule" strings (empty: no engine excludes it). Each engine sees the module under its own name."""
    hits = []
    for engine in serving.engines:
        name = serving.engine_name(module, engine)
        hits += [f"{engine} {rule}" for rule in _RULES[engine](pattern, name)]
    return hits


def _entry(algo: str, group_size: int | None) -> dict:
    algo = canonical_algo(algo)
    if algo == FP8_BLOCK_ALGO:
        return {"quant_algo": algo, "group_size": FP8_BLOCK}
    if algo in ("NVFP4", "W4A16_NVFP4"):
        return {"quant_algo": algo, "group_size": int(group_size or NVFP4_GROUP)}
    return {"quant_algo": algo}


def _exclusions(unquantized: Iterable[str], quantized: Iterable[str], serving) -> list[str]:
    """Globs (one per module kind, layer indices as `*`) naming the unquantized modules, each checked to
    exclude no quantized module under any engine; exact names where a glob would, and none where even the
    exact name would."""
    quantized = sorted(set(quantized))

    def safe(pattern: str) -> bool:
        return not any(exclusion_hits(pattern, q, serving) for q in quantized)

    kinds: dict[str, list[str]] = {}
    for name in sorted(set(unquantized)):
        kinds.setdefault(_LAYER_INDEX.sub(lambda m: f".{m.group(1)}.*.", name), []).append(name)
    out = []
    for glob, names in sorted(kinds.items()):
        if safe(glob):
            out.append(glob)
        else:
            out += [n for n in names if safe(n)]
    return out


def serving_quant_config(hf_quant_config: Mapping[str, Any], serving, config: Mapping[str, Any],
                         linear_modules: Iterable[str]) -> dict:
    """`hf_quant_config.json` as the engines parse it (see the module doc). `linear_modules`: every linear
    module of the export in checkpoint naming (quantized or not; the fused experts banks left out)."""
    hf = copy.deepcopy(dict(hf_quant_config))
    q = hf.setdefault("quantization", {})
    q["quant_algo"] = canonical_algo(q.get("quant_algo"))
    if q["quant_algo"] != "MIXED_PRECISION":
        return hf
    listed = {module: _entry(e.get("quant_algo"), e.get("group_size")) for module, e in
              (q.get("quantized_layers") or {}).items()}
    layers: dict[str, dict] = {}
    for module, entry in listed.items():
        for alias in serving.layer_aliases(module):
            layers[alias] = entry
    for group in serving.fused_groups(config):
        for fused_name, members in group.fused.values():
            entries = [listed.get(m) for m in members]
            if entries[0] is not None and all(e == entries[0] for e in entries):
                layers[fused_name] = entries[0]
    q["quantized_layers"] = dict(sorted(layers.items()))
    nvfp4 = [e["group_size"] for e in listed.values() if e["quant_algo"] in ("NVFP4", "W4A16_NVFP4")]
    if nvfp4:
        q["group_size"] = nvfp4[0]
    unquantized = [m for m in linear_modules if m not in listed]
    q["exclude_modules"] = _exclusions(unquantized, listed, serving)
    return hf


def flat_quant_config(flat: Mapping[str, Any], hf_quant_config: Mapping[str, Any]) -> dict:
    """config.json's `quantization_config` (ModelOpt's conversion of hf_quant_config.json) made consistent
    with it: `modelopt_mixed` for MIXED_PRECISION, the same layers, exclusions and group size, the KV-cache
    key present, and the FP8 block group described (ModelOpt 0.47 leaves it bare)."""
    out = copy.deepcopy(dict(flat))
    q = hf_quant_config.get("quantization", {})
    out["quant_algo"] = q.get("quant_algo")
    out["kv_cache_quant_algo"] = q.get("kv_cache_quant_algo")
    if q.get("quant_algo") == "MIXED_PRECISION":
        out["quant_method"] = "modelopt_mixed"
        out["quantized_layers"] = copy.deepcopy(q.get("quantized_layers") or {})
        out["ignore"] = list(q.get("exclude_modules") or [])
        if "group_size" in q:
            out["group_size"] = q["group_size"]
    for group in (out.get("config_groups") or {}).values():
        if isinstance(group, dict) and canonical_algo(group.get("quant_algo")) == FP8_BLOCK_ALGO:
            group["quant_algo"] = FP8_BLOCK_ALGO
            group.setdefault("weights", {"dynamic": False, "num_bits": 8, "type": "float", "strategy": "block",
                                         "block_structure": [FP8_BLOCK, FP8_BLOCK]})
            group.setdefault("input_activations", None)
    return out


def fp8_block_report(config: Mapping[str, Any], serving, quant_cfg: list) -> list[str]:
    """For each kind of fused group a recipe quantizes to FP8 128x128 blocks: its members' rows and what the
    fused weight's rows make in blocks (one line per group kind, the first layer of that kind), and whether
    a partial block sits only at the group's end (then the members' scale grids concatenate into the fused
    one exactly); input widths that are not whole blocks are named."""
    from modelopt_ext.quant.fused_groups import quantizer_states

    lines, seen = [], set()
    groups = serving.fused_groups(config)
    states = quantizer_states(quant_cfg, [f"{m}.weight_quantizer" for g in groups for m in g.members])

    def fp8_block(member: str) -> bool:
        enabled, attrs = states[f"{member}.weight_quantizer"]
        blocks = {str(k): v for k, v in ((attrs or {}).get("block_sizes") or {}).items()}
        return enabled and attrs.get("num_bits") == [4, 3] and blocks.get("-1") == blocks.get("-2") == FP8_BLOCK

    for group in groups:
        if group.name in seen or not all(fp8_block(m) for m in group.members):
            continue
        seen.add(group.name)
        shapes = [serving.linear_shape(config, m) for m in group.members]
        if any(s is None for s in shapes):
            continue
        rows = [s[0] for s in shapes]
        partial = [m.rpartition(".")[2] for m, r in zip(group.members, rows) if r % FP8_BLOCK]
        total = sum(rows)
        members = " + ".join(f"{m.rpartition('.')[2]} {r}" for m, r in zip(group.members, rows))
        ends_only = all(r % FP8_BLOCK == 0 for r in rows[:-1])
        text = (f"{group.name}: {members} = {total} rows = {total // FP8_BLOCK} blocks"
                + (f" + {total % FP8_BLOCK} rows" if total % FP8_BLOCK else ""))
        if partial:
            text += (f"; partial block in {', '.join(partial)}"
                     + (" (the group's last member: the scale grids concatenate)" if ends_only else
                        " (NOT only at the group's end: a fused block would straddle two members)"))
        narrow = sorted({s[1] for s in shapes if s[1] % FP8_BLOCK})
        if narrow:
            text += f"; input widths {narrow} are not whole blocks"
        lines.append(text)
    return lines

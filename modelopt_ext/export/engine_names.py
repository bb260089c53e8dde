"""How each serving engine reads a ModelOpt export's quantization config: the algorithm names it accepts, how
it looks a module up in `quantized_layers`, and where in its source each rule comes from.

Facts from the engines' loaders (docs/export.md, "Serving engines: the rules `verify --engine` checks"):

- vLLM (`vllm/model_executor/layers/quantization/modelopt.py`) reads config.json's flat
  `quantization_config` first (`hf_quant_config.json` only without it) and upper-cases every algorithm name.
  A module resolves by its exact key (also with `language_model.model.` <-> `model.language_model.` swapped,
  bare `lm_head` for `*.lm_head`), then, for a fused module, by its shards' keys (they must agree), then by
  the first key under `module.`.
- SGLang 0.5.23 (`python/sglang/srt/layers/quantization/modelopt_quant.py`) reads config.json too; it maps
  the keys with the model's weight mapper (the family's `ServingSpec.sglang_key`), tries the module name, the
  same swap and `model.X` -> `model.language_model.X` (never `language_model.model.X`), then shards, then the
  first key under it.
  Top-level `quant_algo` is compared exactly; per-layer names upper-cased.
- TensorRT-LLM (`tensorrt_llm/quantization/modelopt_config.py`) takes `hf_quant_config.json` as
  authoritative, maps `fp8_pb_wo` (any case) to `FP8_BLOCK_SCALES` and otherwise builds `QuantAlgo(name)`, an
  enum of upper-case names (so it is case-sensitive). How its model code looks modules up is the family's
  (`ServingSpec.trtllm_names`).

What a family's model code adds (its weight mapper, its runtime's rules, its files) lives in the family's folder
and reaches the checks through its `ServingSpec`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from modelopt_ext.export.serving import FP8_BLOCK, exclusion_hits

ENGINES = ("vllm", "sglang", "trtllm")
MIXED = "MIXED_PRECISION"
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
FP8_BLOCK_NAMES = ("FP8_PB_WO", "FP8_BLOCK_SCALES")  # ModelOpt's name and TensorRT-LLM's / SGLang's alias

# vllm modelopt.py QUANT_ALGOS
VLLM_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8", MIXED)
# sglang modelopt_quant.py ModelOptMixedPrecisionConfig.get_quant_method (per layer, upper-cased)
SGLANG_LAYER_ALGOS = ("FP8", "FP8_PB_WO", "FP8_BLOCK_SCALES", "MXFP8", "NVFP4", "W4A16_NVFP4")
# tensorrt_llm/quantization/mode.py QuantAlgo (the members a ModelOpt checkpoint can name)
TRTLLM_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_BLOCK_SCALES", "NVFP4", MIXED, "W4A8_NVFP4_FP8",
                "W4A8_MXFP4_FP8", "W4A8_MXFP4_MXFP8", "W4A16_MXFP4", "W4A16_AWQ", "W4A8_AWQ", "W8A16", "W4A16",
                "INT8")

_VLLM = "vllm/model_executor/layers/quantization/modelopt.py"
_SGL = "sglang/srt/layers/quantization/modelopt_quant.py"
# (engine, rule) -> where the generic loader implements it; the family's model files add to it, and are the
# only source of the rules that only model code decides (`ServingSpec.sources`, `sources`)
SOURCES: Mapping[tuple[str, str], str] = {
    ("vllm", "method"): f"{_VLLM}: ModelOptQuantConfigBase._extract_modelopt_quant_algo, QUANT_ALGOS",
    ("vllm", "fields"): f"{_VLLM}: ModelOptNvFp4Config._from_config, ModelOptMixedPrecisionConfig._from_config",
    ("vllm", "names"): f"{_VLLM}: ModelOptMixedPrecisionConfig._resolve_quant_algo",
    ("vllm", "fused-groups"): f"{_VLLM}: FP8_PB_WO linear method create_weights",
    ("vllm", "exclusions"): f"{_VLLM}: is_layer_excluded; quantization/utils/quant_utils.py: is_layer_skipped",
    ("vllm", "experts"): f"{_VLLM}: ModelOptNvFp4FusedMoE.create_weights, process_weights_after_loading",
    ("vllm", "scales"): f"{_VLLM}: ModelOptFp8*/ModelOptNvFp4* methods (stored scales used as loaded)",
    ("sglang", "method"): "sglang/srt/configs/model_config.py: _parse_quant_hf_config, "
                          "_parse_modelopt_quant_config",
    ("sglang", "fields"): f"{_SGL}: ModelOptMixedPrecisionConfig.from_config",
    ("sglang", "names"): f"{_SGL}: ModelOptMixedPrecisionConfig._resolve_quant_algo, apply_weight_name_mapper",
    ("sglang", "fused-groups"): "sglang/srt/layers/quantization/fp8.py: validate_block_quant_shapes",
    ("sglang", "exclusions"): f"{_SGL}: is_layer_excluded; sglang/srt/layers/quantization/utils.py: "
                              "is_layer_skipped",
    ("sglang", "experts"): f"{_SGL}: ModelOptNvFp4FusedMoEMethod.create_weights, process_weights_after_loading",
    ("sglang", "scales"): f"{_SGL}: ModelOptFp8*/ModelOptNvFp4* methods (stored scales used as loaded)",
    ("trtllm", "method"): "tensorrt_llm/quantization/modelopt_config.py: is_modelopt_quant_config, "
                          "_canonicalize_algos; tensorrt_llm/quantization/mode.py: QuantAlgo",
    ("trtllm", "fields"): "tensorrt_llm/_torch/model_config.py: ModelConfig.from_pretrained, "
                          "_build_modelopt_quant_config",

    ("trtllm", "exclusions"): "tensorrt_llm/_torch/models/modeling_utils.py: "
                              "is_module_excluded_from_quantization",
    ("trtllm", "experts"): "tensorrt_llm/_torch/modules/fused_moe/quantization.py: NVFP4FusedMoEMethod."
                           "load_expert_fc31_input_scale_nvfp4, load_all_fp4_weight_scales_and_alphas",
    ("trtllm", "scales"): "tensorrt_llm/_torch/modules/fused_moe/quantization.py",
}


def same_algo(name: str | None) -> str | None:
    """An algorithm name in one spelling for comparisons: upper case, the FP8 block alias as FP8_PB_WO."""
    if not isinstance(name, str):
        return name
    name = name.upper()
    return "FP8_PB_WO" if name in FP8_BLOCK_NAMES else name


def trtllm_algo(name: str | None) -> str | None:
    """The QuantAlgo name TensorRT-LLM builds from a ModelOpt name (only `fp8_pb_wo` is mapped, in any case)."""
    if isinstance(name, str) and name.lower() == "fp8_pb_wo":
        return "FP8_BLOCK_SCALES"
    return name


def _swap(prefix: str) -> list[str]:
    pairs = (("language_model.model.", "model.language_model."), ("model.language_model.", "language_model.model."))
    for a, b in pairs:
        if prefix.startswith(a):
            return [b + prefix[len(a):]]
    return []


def vllm_candidates(prefix: str) -> list[str]:
    """vLLM's `_quantized_layer_prefix_candidates`."""
    out = [prefix] + (["lm_head"] if prefix.endswith(".lm_head") else []) + _swap(prefix)
    return list(dict.fromkeys(out))


def sglang_candidates(prefix: str) -> list[str]:
    """SGLang 0.5.23's `_quantized_layer_prefix_candidates`."""
    out = [prefix] + (["lm_head"] if prefix.endswith(".lm_head") else []) + _swap(prefix)
    if prefix.startswith("model.") and not prefix.startswith("model.language_model."):
        out.append("model.language_model." + prefix.removeprefix("model."))
    return list(dict.fromkeys(out))


def resolve(layers: Mapping[str, str], prefix: str, shards: Sequence[str],
            candidates: Callable[[str], list[str]]) -> tuple[str | None, str]:
    """(algorithm, how it was found) of module `prefix` in `quantized_layers` (keys as the engine holds them),
    the vLLM/SGLang way: exact key, then the fused module's shards, then the first key under the module.
    A fused module whose shards disagree gives (None, the reason starting with "shards disagree")."""
    for c in candidates(prefix):
        if c in layers:
            return layers[c], f"key {c}"
    found = {}
    for shard in shards:
        for c in candidates(shard):
            if c in layers:
                found[shard] = layers[c]
                break
    if found:
        algos = sorted({str(a) for a in found.values()})
        if len(algos) > 1:
            return None, "shards disagree (" + ", ".join(f"{s.rpartition('.')[2]} {a}" for s, a in found.items()) + ")"
        return next(iter(found.values())), "its shards' keys"
    for c in candidates(prefix):
        for key, algo in layers.items():
            if key.startswith(c + "."):
                return algo, f"key {key} under it"
    return None, "no key"


def method_problems(engine: str, flat: Mapping | None, nested: Mapping | None) -> list[str]:
    """Whether `engine` takes the export for a ModelOpt checkpoint of an algorithm it implements.
    `flat`: config.json's quantization_config; `nested`: hf_quant_config.json's `quantization` object."""
    problems: list[str] = []
    if engine == "trtllm":
        q = nested if nested is not None else flat
        if q is None:
            return ["neither hf_quant_config.json nor config.json quantization_config: not a ModelOpt checkpoint"]
        if nested is None and not str(q.get("quant_method")).startswith("modelopt"):
            problems.append(f"quant_method {q.get('quant_method')!r} and no hf_quant_config.json: not a ModelOpt "
                            "checkpoint for TensorRT-LLM")
        names = [("quant_algo", q.get("quant_algo"))] + [
            (f"quantized_layers[{k}]", v.get("quant_algo")) for k, v in _layers(q).items()]
        for where, name in names:
            if trtllm_algo(name) not in TRTLLM_ALGOS or (where != "quant_algo" and trtllm_algo(name) == MIXED):
                problems.append(f"{where} {name!r} is no QuantAlgo (case-sensitive; fp8_pb_wo is mapped)")
        return problems
    if flat is None:
        return [f"config.json has no quantization_config ({engine} reads it to pick the quantization method)"]
    method, algo = flat.get("quant_method"), flat.get("quant_algo")
    listed = _layers(flat) or (_layers(nested) if engine == "sglang" and nested is not None else {})
    layer_algos = {k: v.get("quant_algo") for k, v in listed.items()}
    if engine == "vllm":
        if not str(method).lower().startswith("modelopt"):
            problems.append(f"quant_method {method!r} does not start with 'modelopt'")
        accepted = VLLM_ALGOS
    else:
        accepted = SGLANG_LAYER_ALGOS
        if algo == MIXED:
            if method != "modelopt_mixed":
                problems.append(f"quant_method {method!r} for MIXED_PRECISION: SGLang needs 'modelopt_mixed'")
            if not any(same_algo(a) in NVFP4_ALGOS for a in layer_algos.values()):
                problems.append("MIXED_PRECISION without an NVFP4/W4A16_NVFP4 layer: SGLang routes it to w4afp8")
        elif method == "modelopt_mixed":
            problems.append(f"quant_method 'modelopt_mixed' with quant_algo {algo!r}: SGLang compares it exactly "
                            "with 'MIXED_PRECISION'")
        elif method not in (None, "modelopt"):
            problems.append(f"quant_method {method!r}: SGLang parses a ModelOpt config under 'modelopt'")
        elif not (algo in ("FP8", "MXFP8") or (isinstance(algo, str) and "FP4" in algo)):
            problems.append(f"top-level quant_algo {algo!r} is not recognised by SGLang (exact FP8, MXFP8, *FP4*, "
                            "MIXED_PRECISION; FP8_PB_WO only inside MIXED_PRECISION)")
    if engine == "vllm" and str(algo).upper() not in VLLM_ALGOS:
        problems.append(f"quant_algo {algo!r} is not in {engine}'s accepted set")
    for key, name in layer_algos.items():
        if str(name).upper() not in accepted or str(name).upper() == MIXED:
            problems.append(f"quantized_layers[{key}] quant_algo {name!r} is not in {engine}'s accepted set")
    return problems


def fields_problems(engine: str, flat: Mapping | None, nested: Mapping | None) -> list[str]:
    """The keys `engine` requires, and config.json's agreement with hf_quant_config.json (`nested`)."""
    problems = []
    if engine == "vllm" and nested is not None and str(nested.get("quant_algo")).upper() == "NVFP4":
        missing = [k for k in ("group_size", "kv_cache_quant_algo", "exclude_modules") if k not in nested]
        if missing:
            problems.append(f"hf_quant_config.json NVFP4 lacks {', '.join(missing)}")
    view = engine_view(engine, flat, nested)
    if engine != "trtllm" and view.algo == MIXED and not view.layers:
        problems.append("MIXED_PRECISION with an empty or missing quantized_layers")
    if engine == "sglang":
        sizes = {v.get("group_size", FP8_BLOCK) for v in (_layers(flat or {}) or _layers(nested or {})).values()
                 if same_algo(v.get("quant_algo")) == "FP8_PB_WO"}
        if len(sizes) > 1 or sizes - {FP8_BLOCK}:
            problems.append(f"FP8 block layers' group_size {sorted(map(str, sizes))}: SGLang takes one block size "
                            f"for all, and the tensors use {FP8_BLOCK}x{FP8_BLOCK} blocks")
    if flat is not None and nested is not None:
        if same_algo(flat.get("quant_algo")) != same_algo(nested.get("quant_algo")):
            problems.append(f"quant_algo differs: config.json {flat.get('quant_algo')!r}, "
                            f"hf_quant_config.json {nested.get('quant_algo')!r}")
        a, b = flat.get("quantized_layers") or {}, nested.get("quantized_layers") or {}
        differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if differ:
            problems.append(f"quantized_layers differ in {len(differ)} key(s) between config.json and "
                            f"hf_quant_config.json, first {differ[0]}")
        if set(flat.get("ignore") or []) != set(nested.get("exclude_modules") or []):
            problems.append("config.json ignore != hf_quant_config.json exclude_modules")
    return problems


@dataclass(frozen=True)
class EngineView:
    """The quantization config as one engine reads it, algorithm names in one spelling (`same_algo`)."""

    algo: str | None
    layers: Mapping[str, str]  # quantized_layers key, as the engine holds it -> algorithm
    exclude: tuple[str, ...]


def engine_view(engine: str, flat: Mapping | None, nested: Mapping | None,
                sglang_key: Callable[[str], str] = str) -> EngineView:
    """What `engine` reads: TensorRT-LLM hf_quant_config.json, the others config.json's flat copy first
    (SGLang falls back to hf_quant_config.json for a missing quantized_layers and maps the keys with the
    model's weight mapper, `sglang_key`: the family's `ServingSpec.sglang_key`)."""
    q = ((nested or flat) if engine == "trtllm" else (flat or nested)) or {}
    listed = _layers(q) or (_layers(nested) if engine == "sglang" and nested else {})
    key = sglang_key if engine == "sglang" else str
    exclude = q.get("exclude_modules") if q is nested else q.get("ignore", q.get("exclude_modules"))
    layers = {key(k): same_algo(v.get("quant_algo")) for k, v in listed.items()}
    return EngineView(same_algo(q.get("quant_algo")), layers, tuple(e for e in exclude or () if isinstance(e, str)))


class _OneEngine:
    """A stand-in serving spec for `exclusion_hits`: one engine, names already in that engine's naming."""

    def __init__(self, engine: str):
        self.engines = (engine,)

    @staticmethod
    def engine_name(module: str, engine: str) -> str:
        return module


def engine_hits(engine: str, pattern: str, name: str) -> list[str]:
    """How `engine` excludes module `name` (its own naming) with `pattern` ("engine rule" strings)."""
    return exclusion_hits(pattern, name, _OneEngine(engine))


def excluded(engine: str, name: str, patterns: Sequence[str], shards: Sequence[str] = ()) -> bool:
    """Whether `engine` builds module `name` (its naming) unquantized by exclusion; a fused module also when
    all its shards are excluded by the shard rule the engine applies (vLLM: exact names, SGLang: dotted
    paths, TensorRT-LLM: its usual matching)."""
    if any(engine_hits(engine, p, name) for p in patterns):
        return True
    rule = {"vllm": "exact", "sglang": "dotted path"}.get(engine, "")
    return bool(shards) and all(any(h.endswith(rule) for p in patterns for h in engine_hits(engine, p, s))
                                for s in shards)


def mismatch(unit: str, name: str, have: str, algo: str | None, how: str) -> list[str]:
    """The problem when checkpoint module `unit` (engine name `name`) carrying format `have` ("unquantized",
    an algorithm, "absent") resolves to `algo` (None: unquantized) as `how` says."""
    if algo is None and how.startswith("shards disagree"):
        return [f"{name}: {how}; the engine refuses a mixed fused layer"]
    want = algo or "unquantized"
    if have in (want, "absent"):
        return []
    shown = name if name == unit else f"{name} ({unit})"
    if have == "unquantized":
        return [f"{shown} is unquantized but resolves to {want} ({how}): the engine would quantize it"]
    return [f"{shown} carries {have} but resolves to {want} ({how})"]


# rules only the engine's model code decides: their source is the family's (`ServingSpec.sources`)
RULES_WITHOUT_LOADER_SOURCE = (("vllm", "never-quantized"), ("sglang", "never-quantized"), ("trtllm", "names"),
                               ("trtllm", "fused-groups"), ("trtllm", "never-quantized"))


def sources(engine: str, rule: str, family_sources: Mapping[tuple[str, str], str]) -> str:
    """Where a rule comes from: the generic loader's source, then the family's model files (`ServingSpec.sources`)."""
    found = [s for s in (SOURCES.get((engine, rule)), family_sources.get((engine, rule))) if s]
    return "; ".join(found) or "the family's model code (no source recorded)"


def _layers(q: Mapping) -> dict[str, Mapping]:
    layers = q.get("quantized_layers")
    return {k: v for k, v in layers.items() if isinstance(v, Mapping)} if isinstance(layers, Mapping) else {}

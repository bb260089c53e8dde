"""Model-family registry: a frozen spec per family, found by the checkpoint's `model_type`.

A family plugs in with data (plans, exclusions, floors, converters) and one `prepare` hook for the generic
loader (`modelopt_ext.loader`); nothing outside `modelopt_ext/models/<family>/` names a family.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any


@dataclasses.dataclass(frozen=True)
class ServingSpec:
    """How the serving engines build a family's model, from their loaders (docs/export.md).

    Attributes:
        engines: the engines described ("vllm", "sglang", "trtllm").
        fused_groups: `fused_groups(config_json_mapping)` -> the `FusedGroup`s: groups of one layer's modules an
            engine fuses into one GEMM.
        never_quantized: `never_quantized(module)`: no engine quantizes this module (checkpoint naming).
        engine_name: `engine_name(module, engine)` -> the name that engine gives the module it builds.
        layer_aliases: `layer_aliases(module)` -> the `quantized_layers` keys that every engine resolves.
        linear_shape: `linear_shape(config_json_mapping, module)` -> (out, in) of a fused group's member.
        kv_cache: what the engines do with a KV-cache quantization of the family's attention
            (`KVCacheServing`), or None where nothing is known (quant/kv_cache.py checks recipes against it).
        sglang_key: `sglang_key(key)` -> a `quantized_layers` key as SGLang's model for the family maps it (its
            weight mapper); default: unchanged.
        trtllm_names: `trtllm_names(banks, view, others)` -> problems: how TensorRT-LLM's model for the family
            looks up the routed experts banks (name -> format) and the other quantized modules in its view of the
            quantization config (`export.engine_names.EngineView`); None: not known (the rule then fails, saying so).
        sources: (engine, rule) -> the engine's model files a rule comes from, beside its generic loader's
            (`export.engine_names.SOURCES`).
        recipe_engines: shipped recipe name -> the engines its export is for, where not every engine loads it
            (what `ptq` checks without `--engine`; default: all).
    """

    engines: tuple[str, ...]
    fused_groups: Callable[[Mapping[str, Any]], tuple]
    never_quantized: Callable[[str], bool]
    engine_name: Callable[[str, str], str]
    layer_aliases: Callable[[str], tuple[str, ...]]
    linear_shape: Callable[[Mapping[str, Any], str], tuple[int, int] | None]
    kv_cache: KVCacheServing | None = None
    sglang_key: Callable[[str], str] = str
    trtllm_names: Callable[..., list[str]] | None = None
    sources: Mapping[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    recipe_engines: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class FusedGroup:
    """One engine-fused group of one decoder layer, in checkpoint names."""

    name: str
    layer: int
    members: tuple[str, ...]  # full module names, in the engines' fused order
    # engine -> (its fused module's name under its own naming, the members it fuses there)
    fused: Mapping[str, tuple[str, tuple[str, ...]]]

    def describe(self) -> str:
        engines = ", ".join(f"{e} {n.rpartition('.')[2]}" for e, (n, _) in self.fused.items())
        return f"{self.name} of layer {self.layer} ({engines})"


@dataclasses.dataclass(frozen=True)
class KVCacheServing:
    """What the serving engines do with a quantized KV cache of a family's attention (docs/export.md, "KV cache").

    Attributes:
        attention_modules: `attention_modules(config_json_mapping)` -> the attention modules (checkpoint names)
            whose keys and values the engines cache; ModelOpt puts `k_bmm_quantizer` / `v_bmm_quantizer` there.
        cached: what the engines store per token for them, in words.
        engines: engine -> None where it loads the export's calibrated KV scales for that cache, else what it
            does instead, in words.
        measured: what ModelOpt's KV quantizers measure on this family, in words.
        alternative: what to do instead of quantizing the KV cache in the recipe.
    """

    attention_modules: Callable[[Mapping[str, Any]], tuple[str, ...]]
    cached: str
    engines: Mapping[str, str | None]
    measured: str
    alternative: str


@dataclasses.dataclass(frozen=True)
class PredictionSpec:
    """What `modelopt-ext plan --predict` needs of a family to predict a job's time (modelopt_ext/predict.py).

    Attributes:
        measurement: the bundled per-GPU measurement JSON (scripts/bench_rank_share.py writes it); it may be
            absent, and the prediction then says so.
        layer_kinds: `layer_kinds(config_json_mapping)` -> measured kind ("dense_kda", "moe_mla", ...; the
            keys of the measurement's "layers" section) -> how many times the model runs it per token; a
            kind run once per model (embeddings and head) counts 1.
        dense_export_bytes: `dense_export_bytes(config_json_mapping, recipe)` -> {"outside_layers": bytes of
            the export file of everything outside the decoder layers, "layers": bytes of each decoder layer's
            dense file} as the recipe (a name or path for `quant.recipes.load`) exports them.
    """

    measurement: Path | None
    layer_kinds: Callable[[Mapping[str, Any]], Mapping[str, int]]
    dense_export_bytes: Callable[[Mapping[str, Any], str], Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class RouterOutput:
    """What a family's router returns, item by item: "ids" (the top-k global expert ids [T, K]), "weights" (their
    routing weights [T, K]) and any other item by name, passed through unchanged (e.g. DeepSeek-V3's "logits").
    Expert coverage reads the ids; the all-experts policy replaces ids and weights."""

    items: tuple[str, ...] = ("ids", "weights")

    def __post_init__(self):
        for item in ("ids", "weights"):
            if self.items.count(item) != 1:
                raise ValueError(f"router output items {self.items}: {item!r} must be named exactly once")

    def _checked(self, output, router: str) -> tuple:
        if not (isinstance(output, tuple) and len(output) == len(self.items)):
            got = f"{type(output).__name__} of {len(output) if isinstance(output, tuple) else 1} item(s)"
            raise TypeError(f"router {router}: the family's router returns {self.items}, this one returned {got}")
        return output

    def ids(self, output, router: str):
        """The expert ids in a router's output (`router`: its name, for the error)."""
        return self._checked(output, router)[self.items.index("ids")]

    def weights(self, output, router: str):
        return self._checked(output, router)[self.items.index("weights")]

    def replaced(self, output, ids, weights) -> tuple:
        """The output with other ids and weights, every other item as it was."""
        named = {"ids": ids, "weights": weights}
        return tuple(named.get(item, value) for item, value in zip(self.items, output))


def no_carried_layers(config) -> tuple[str, ...]:
    """A family whose model builds every layer of its checkpoint: nothing for the export to carry over."""
    return ()


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """Everything modelopt_ext knows about one model family.

    Attributes:
        name: family name used on the command line (`make-tiny NAME`).
        model_types: top-level `config.json` model_type values this family owns.
        text_model_type: model_type of the nested text config, checked when given.
        revision: the pinned upstream revision the remote-code lock describes; None for a family whose model
            class is transformers' own (no remote code runs).
        remote_code_lock: path of the bundled lock JSON (file name -> sha256); None for a family without remote
            code (nothing to check, and a lock given for it is refused).
        min_versions: distribution name -> lowest supported version.
        ep_plan: module/parameter FQN glob -> transformers EP style (data for the EP runtime).
        quantizer_exclusions: config -> quantizer name globs that must stay unquantized.
        converters: expert storage ("mxfp4" | "dense" | "fp8") -> transformers weight transforms (empty where
            transformers' own conversion mapping of the model type applies).
        prepare: `prepare(path, **from_pretrained_kwargs)` -> `modelopt_ext.loader.PreparedLoad`: every check,
            then how the generic loader patches, configures, builds, converts, warms up and checks the load;
            mutates nothing itself (the loader runs its `patch`).
        forward: `forward(path, dtype_name)` -> summary lines: loads the checkpoint with plain transformers (the
            family's own code, no adapter; remote code only once it matches the lock) and runs its forwards, raising
            on non-finite logits (`modelopt-ext forward`), if the family has one.
        make_tiny: generator of the family's stand-in checkpoint, if it has one: `make_tiny(out_dir, seed=0,
            sizes={field: int}, force=False, fit_steps=0)` -> its path (`modelopt-ext make-tiny`; unknown sizes
            are a ValueError naming the family's).
        sizes: `sizes(config_json_mapping)` -> figures for distribution planning (parameter and byte counts,
            widths; `modelopt_ext.plan.REQUIRED_SIZES` lists the keys), if the family can be planned.
        bundled_configs: name -> config.json shipped with the package (e.g. the full-size model), usable
            in place of a checkpoint folder where only the config is needed (`modelopt-ext plan`).
        default_recipe: the recipe `modelopt-ext ptq` uses without --recipe/--qformat (the production one).
        export_expert_names: ModelOpt's per-expert projection names (gate_proj, up_proj, down_proj) -> the
            names the checkpoint and serving engines use for them (e.g. w1, w3, w2).
        check_config: `check_config(config_json_mapping, source)` raises ValueError naming every key the
            family's code needs and lacks, or value it does not implement; run by `family_for_config`.
        serving: how the serving engines build the model (fused groups, names), if known.
        prediction: what `plan --predict` needs (bundled measurement, layer kinds, export bytes), if known.
        ptq_refused: why `modelopt-ext ptq` cannot run this family yet (refused in validate, before anything is
            loaded), or None where it runs.
        router_output: what a router `router_glob` names returns, item by item (`RouterOutput`): where expert
            coverage reads the ids and the all-experts policy replaces ids and weights; default (ids, weights).
        carried_layers: `carried_layers(config_json_mapping)` -> tensor-name prefixes (ending in ".") of source
            layers the model does not build that the export carries over unquantized and excluded from
            quantization (DeepSeek-V3's multi-token-prediction layer; `export.source_fp8`); default: none.
    """

    name: str
    model_types: tuple[str, ...]
    text_model_type: str | None
    revision: str | None
    remote_code_lock: Path | None
    min_versions: Mapping[str, str]
    ep_plan: Mapping[str, str]
    quantizer_exclusions: Callable[[Any], tuple[str, ...]]
    converters: Callable[[str], list]
    prepare: Callable[..., Any]
    make_tiny: Callable[..., Path] | None = None
    forward: Callable[[str, str], list[str]] | None = None
    router_glob: str | None = None
    sizes: Callable[[Mapping[str, Any]], Mapping[str, int]] | None = None
    bundled_configs: Mapping[str, Path] = dataclasses.field(default_factory=dict)
    default_recipe: str | None = None
    export_expert_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    check_config: Callable[[Mapping[str, Any], str], None] | None = None
    serving: ServingSpec | None = None
    prediction: PredictionSpec | None = None
    ptq_refused: str | None = None
    router_output: RouterOutput = RouterOutput()
    carried_layers: Callable[[Mapping[str, Any]], tuple[str, ...]] = no_carried_layers

    def __post_init__(self):
        object.__setattr__(self, "export_expert_names", MappingProxyType(dict(self.export_expert_names)))
        object.__setattr__(self, "bundled_configs", MappingProxyType(dict(self.bundled_configs)))
        object.__setattr__(self, "min_versions", MappingProxyType(dict(self.min_versions)))
        object.__setattr__(self, "ep_plan", MappingProxyType(dict(self.ep_plan)))


_FAMILIES: dict[str, FamilySpec] = {}


def register_family(spec: FamilySpec) -> FamilySpec:
    """Register `spec` under each of its model types; registering the same spec again is a no-op."""
    for model_type in spec.model_types:
        existing = _FAMILIES.get(model_type)
        if existing is not None and existing is not spec:
            raise ValueError(f"model_type {model_type!r} is already registered by family {existing.name!r}")
    for model_type in spec.model_types:
        _FAMILIES[model_type] = spec
    return spec


def _ensure_builtin_families() -> None:
    importlib.import_module("modelopt_ext.models")


def families() -> dict[str, FamilySpec]:
    """Registered families by name."""
    _ensure_builtin_families()
    return {spec.name: spec for spec in _FAMILIES.values()}


def family_for_config(config: Mapping[str, Any], source: str = "config.json") -> FamilySpec:
    """The family owning a `config.json` mapping; raises ValueError naming the model_type otherwise."""
    _ensure_builtin_families()
    model_type = config.get("model_type")
    spec = _FAMILIES.get(model_type)
    if spec is None:
        known = ", ".join(sorted(_FAMILIES)) or "none"
        raise ValueError(f"{source}: model_type {model_type!r} has no modelopt_ext family (known: {known})")
    if spec.text_model_type is not None:
        text_type = (config.get("text_config") or {}).get("model_type")
        if text_type != spec.text_model_type:
            raise ValueError(
                f"{source}: text_config.model_type is {text_type!r}, "
                f"family {spec.name!r} expects {spec.text_model_type!r}"
            )
    if spec.check_config is not None:
        spec.check_config(config, source)
    return spec


def read_config(path: str | Path) -> dict[str, Any]:
    """`config.json` of a checkpoint folder, with errors that name the file."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist or is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} is missing: not a transformers checkpoint folder")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must hold a JSON object, got {type(config).__name__}")
    return config


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder with its config.json and family, read once and passed on (to the loader, the
    calibration's recipe config and the export) instead of read again by each."""

    path: Path
    config: Mapping[str, Any]
    family: FamilySpec

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))
        object.__setattr__(self, "config", json.loads(json.dumps(dict(self.config))))  # its own copy: read only

    @classmethod
    def read(cls, path: str | Path) -> Checkpoint:
        """Reads `path`/config.json and finds its family; errors name the file."""
        config = read_config(path)
        return cls(Path(path), config, family_for_config(config, source=str(Path(path) / "config.json")))

    @property
    def config_dict(self) -> dict[str, Any]:
        """A mutable deep copy of config.json's mapping (for code that edits or serializes it)."""
        return json.loads(json.dumps(dict(self.config)))


def source_quantization_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's own quantization config: top level, or where a multimodal config keeps it, in its
    `text_config` (Kimi-K3's config.json has it only there; its remote code copies it up at load)."""
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), Mapping):
        qc = config["text_config"].get("quantization_config")
    return qc


MXFP4_FORMAT = "mxfp4-pack-quantized"  # compressed-tensors' format name for MXFP4-packed weights


def stored_expert_storage(config: Mapping[str, Any]) -> str:
    """"mxfp4" when the checkpoint's quantization_config format is MXFP4 packed, else "dense"."""
    quant = source_quantization_config(config) or {}
    return "mxfp4" if quant.get("format") == MXFP4_FORMAT else "dense"


def experts_module_glob(spec: FamilySpec) -> str:
    """The routed experts' module name glob of a family (its EP plan's `ep_dispatch_experts` rule)."""
    globs = [k for k, v in spec.ep_plan.items() if v == "ep_dispatch_experts"]
    if len(globs) != 1:
        raise ValueError(f"family {spec.name!r}: the EP plan needs exactly one ep_dispatch_experts rule, has {globs}")
    return globs[0]

"""Quantization recipes: YAML files loaded through ModelOpt's recipe loader, `--set` overrides, checks.

A recipe is a ModelOpt PTQ recipe (`metadata`, `quantize.{algorithm, quant_cfg}`, optional `imports`), the
schema `modelopt.recipe.load_recipe` validates. The shipped ones live in `RECIPES_DIR` (`recipes/` at the repository's
top level, shipped in the wheel as `modelopt_ext/recipes`): `<group>/<name>.yaml` recipes and `units/*.yaml`
reusable `quant_cfg` units.

    recipe = load("nvfp4_experts-fp8_attention", overrides=["quantize.algorithm.method=max"])
    cfg = quant_config(recipe, model.config)       # {"quant_cfg": [...], "algorithm": ...} for mtq.quantize
    mtq.quantize(model, cfg, forward_loop)
    check_patterns_match(cfg, model)               # every pattern of ours hit something

This module is the public API (names, loading, `--set` overrides, `quant_config`); two sibling modules
hold the rest, and their public names are importable from here too: `recipe_io` reads recipe files (safe
YAML, shape checks) and runs them through ModelOpt's loader (errors naming file and entry; `EntrySource`
per entry), `patterns` checks quantizer patterns against a quantized model (`check_patterns_match`,
`quantizers`, `enabled_quantizers`).

Names: `resolve_recipe` takes a bare name (`fp8_all`, `kimi_k3/fp8_all`; looked up in RECIPES_DIR, never in
`units/`) or a path to any YAML file on disk.

Imports: a recipe's `imports:` paths are resolved against the recipe file's own folder, then RECIPES_DIR
(so a user recipe anywhere can import `units/kimi_k3_exclusions`), then as ModelOpt resolves them (the
working directory, then ModelOpt's built-in library `modelopt_recipes/`, e.g. `configs/numerics/fp8`).
ModelOpt itself resolves relative import paths against the working directory only, so `load` hands it a
temporary copy of the recipe whose local import paths were made absolute; errors name the original file.
Units imported by a recipe resolve their own imports the ModelOpt way (keep them to built-in paths).

Safety: ModelOpt reads YAML with `yaml.safe_load` / `safe_load_all` only, and its `# modelopt-schema:`
comments may only name objects under `modelopt.*`; this package also parses with `yaml.safe_load` only
(recipe files in `recipe_io`, `--set` values here) and applies overrides itself (ModelOpt's own override
path merges through OmegaConf and would accept unknown keys).

Family exclusions: `quant_config` appends, after the recipe's entries, every glob of the model family's
`quantizer_exclusions(config)` that is not already in effect (`family_exclusion_entries`), so a user recipe
that forgets the family's unit still keeps what no serving engine quantizes in bf16. The shipped recipes
import the unit that holds all of them, so nothing is appended. Recipes must also quantize each group the
engines fuse into one GEMM alike; `quant.fused_groups` refuses one that does not, in validate.

hf_ptq.py `--qformat` presets (ModelOpt's `configs/ptq/presets/model/*.yaml`) with a recipe here, per family
(`RECIPES_DIR/qformats.yaml`, read by `recipe_for_qformat`):

    kimi_k3: fp8                -> kimi_k3/fp8_all
             nvfp4_experts_only -> kimi_k3/nvfp4_experts_only
             (production recipe kimi_k3/nvfp4_experts-fp8_attention has no preset)

The other presets (nvfp4, nvfp4_mlp_only, nvfp4_omlp_only, fp8_2d_blockwise_weight_only, int8*, int4*, mx*,
w4a8*, ...) have no recipe here: used as they are, they lack the family's exclusions (e.g. `nvfp4` would
quantize KDA's gate projections). ModelOpt's `nvfp4_experts_only` preset also enables every
`*block_sparse_moe*` quantizer, which on Kimi-K3 includes shared experts and latent projections; the
recipe of that name keeps those in bf16.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

# Re-exported (`as`), as is EntrySource below: part of this module's API, defined beside it.
from modelopt_ext.quant.patterns import check_patterns_match as check_patterns_match
from modelopt_ext.quant.patterns import enabled_quantizers as enabled_quantizers
from modelopt_ext.quant.patterns import quantizers as quantizers
from modelopt_ext.quant.recipe_io import (
    _SUFFIXES,
    EntrySource,
    _check_bits,
    _entry_sources,
    _explain_failure,
    _load_modelopt,
    _pydantic_errors,
    _read_raw,
    check_calibrators,
)
from modelopt_ext.quant.recipe_io import check_algorithm as check_algorithm

logger = logging.getLogger(__name__)



def _recipes_dir() -> Path:
    """The shipped recipes: `recipes/` at the repository's top level in a source checkout (editable installs
    included), `modelopt_ext/recipes` in an installed wheel (setup.py maps the one onto the other)."""
    package = Path(__file__).resolve().parent.parent
    installed = package / "recipes"
    return installed if installed.is_dir() else package.parent / "recipes"


RECIPES_DIR = _recipes_dir()
UNITS_DIR = RECIPES_DIR / "units"
QFORMATS_FILE = RECIPES_DIR / "qformats.yaml"

_EXMY = re.compile(r"^[Ee](\d+)[Mm](\d+)$")


class RecipeNotFoundError(FileNotFoundError):
    """No recipe of that name or path; the message lists what was looked for and the available names."""


class Recipe(dict):
    """A loaded recipe: the validated mapping (`metadata`, `quantize`), plus `path`, `sources` (one
    EntrySource per `quantize.quant_cfg` entry) and the `overrides` applied."""

    def __init__(self, data: Mapping[str, Any], path: Path, sources: list[EntrySource], overrides=()):
        super().__init__(data)
        self.path = path
        self.sources = sources
        self.overrides = tuple(overrides)


class QuantConfig(dict):
    """`{"quant_cfg": [...], "algorithm": ...}` for `mtq.quantize`, with `sources` per entry."""

    def __init__(self, data: Mapping[str, Any], path: Path | None, sources: list[EntrySource]):
        super().__init__(data)
        self.path = path
        self.sources = sources


# ---------------------------------------------------------------------------------------------- names


def _recipe_files() -> list[Path]:
    return sorted(
        p for p in RECIPES_DIR.rglob("*") if p.suffix in _SUFFIXES and p.is_file()
        and p.parent != RECIPES_DIR and UNITS_DIR not in p.parents
    )


def available_recipes() -> list[str]:
    """Names of the shipped recipes (`group/name`, no suffix)."""
    return [p.relative_to(RECIPES_DIR).with_suffix("").as_posix() for p in _recipe_files()]


def resolve_recipe(name_or_path: str | os.PathLike) -> Path:
    """The recipe file for a bare name (`nvfp4_experts-fp8_attention`, `kimi_k3/fp8_all`) or a YAML path.

    A bare name (a string without a .yaml/.yml suffix) is looked up in RECIPES_DIR first, as a relative
    name and then by file stem; anything else, and a bare name not found there, as a path on disk.
    Raises RecipeNotFoundError naming every place looked at and the available recipe names.
    """
    text = os.fspath(name_or_path)
    looked: list[str] = []
    bare = isinstance(name_or_path, str) and not text.endswith(_SUFFIXES) and not os.path.isabs(text)
    if bare and text and Path(text).parts[0] != "units":
        for suffix in _SUFFIXES:
            candidate = RECIPES_DIR / f"{text}{suffix}"
            looked.append(str(candidate))
            if candidate.is_file():
                return candidate
        stems = [p for p in _recipe_files() if p.stem == text]
        looked.append(f"{RECIPES_DIR}/*/{text}.yaml")
        if len(stems) == 1:
            return stems[0]
        if len(stems) > 1:
            names = ", ".join(p.relative_to(RECIPES_DIR).with_suffix("").as_posix() for p in stems)
            raise RecipeNotFoundError(f"recipe name {text!r} is ambiguous: {names}; give the full name")
    path = Path(text).expanduser()
    candidates = [path] if text.endswith(_SUFFIXES) or not bare else [path] + [
        Path(f"{text}{s}").expanduser() for s in _SUFFIXES]
    if text.endswith(_SUFFIXES) and not path.is_absolute():
        candidates.append(RECIPES_DIR / text)  # `kimi_k3/fp8_all.yaml` names a shipped recipe too
    for candidate in candidates:
        looked.append(str(candidate.absolute()))
        if candidate.is_file():
            return candidate.resolve()
    raise RecipeNotFoundError(
        f"recipe {text!r} not found; looked for {', '.join(looked)}. "
        f"Available recipes: {', '.join(available_recipes())} (or give the path of a YAML file)"
    )


def qformat_recipes() -> dict[str, dict[str, str]]:
    """family name -> {hf_ptq.py --qformat preset name -> recipe name}, from RECIPES_DIR/qformats.yaml."""
    table = yaml.safe_load(QFORMATS_FILE.read_text(encoding="utf-8")) or {}
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ValueError(f"{QFORMATS_FILE}: expected a mapping family -> {{qformat: recipe}}")
    return table


def recipe_for_qformat(qformat: str, family: str | None = None) -> Path:
    """The recipe playing the role of hf_ptq.py's `--qformat QFORMAT` preset (for `family`, if given)."""
    table = qformat_recipes()
    if family is not None and family not in table:
        raise ValueError(f"no --qformat mapping for family {family!r} (families: {', '.join(sorted(table))})")
    families = [family] if family is not None else sorted(table)
    hits = {f: table[f][qformat] for f in families if qformat in table[f]}
    if not hits:
        known = "; ".join(f"{f}: " + ", ".join(f"{q} -> {r}" for q, r in table[f].items()) for f in families)
        raise ValueError(
            f"--qformat {qformat!r} has no modelopt_ext recipe (mapped: {known}); "
            f"use a recipe name ({', '.join(available_recipes())}) or a YAML path"
        )
    if len(hits) > 1:
        raise ValueError(f"--qformat {qformat!r} maps to a recipe in several families ({', '.join(hits)}); "
                         "name the family")
    return resolve_recipe(next(iter(hits.values())))


# --------------------------------------------------------------------------------------------- loading


def _local_import(ref: str, base: Path) -> str | None:
    """Absolute path of an import found next to the recipe or in RECIPES_DIR; None leaves it to ModelOpt."""
    if os.path.isabs(ref):
        return None
    names = [ref] if ref.endswith(_SUFFIXES) else [f"{ref}{s}" for s in _SUFFIXES]
    for root in (base, RECIPES_DIR):
        for name in names:
            if (root / name).is_file():
                return str((root / name).resolve())
    return None


def load(name_or_path: str | os.PathLike, overrides: Iterable[str] = ()) -> Recipe:
    """Load a recipe through ModelOpt's `load_recipe`, then apply `--set KEY=VALUE` overrides.

    Returns the validated recipe as a plain mapping (ModelOpt's full dump: every quantizer attribute
    spelled out, so every attribute can be overridden). Overrides walk dotted keys into that mapping
    (list indices as numbers, e.g. `quantize.quant_cfg.3.enable=false`); values are parsed with
    yaml.safe_load and must have the existing value's type (ints are accepted for floats; `num_bits` /
    `scale_bits` also take `e4m3`-style names). Any error is a ValueError naming the file and the entry
    or key; that includes a `quantize.algorithm` (after the overrides) that ModelOpt does not know or
    `calibrate` cannot run (`recipe_io.check_algorithm`).
    """
    path = resolve_recipe(name_or_path)
    raw = _read_raw(path)
    data = dict(raw)
    data["imports"] = {k: _local_import(v, path.parent) or v for k, v in (raw.get("imports") or {}).items()}
    if not data["imports"]:
        del data["imports"]
    with tempfile.TemporaryDirectory(prefix="modelopt_ext_recipe-") as folder:
        try:
            recipe = _load_modelopt(path, data, folder)
        except ValueError as err:
            raise _explain_failure(path, err, data, folder) from err
    loaded = recipe.model_dump()
    sources = _entry_sources(path, data, len(loaded["quantize"]["quant_cfg"]))
    _check_bits(loaded["quantize"]["quant_cfg"], sources)
    overrides = list(overrides)
    algorithm = copy.deepcopy(loaded["quantize"]["algorithm"])
    if overrides:
        loaded = apply_overrides(loaded, overrides, path)
        count = len(loaded["quantize"]["quant_cfg"])
        if count != len(sources):
            sources = [EntrySource(str(path), f"quantize.quant_cfg[{k}] (after --set)") for k in range(count)]
        check_calibrators(loaded["quantize"]["quant_cfg"], f"{path}: after --set {' '.join(overrides)}")
    changed = loaded["quantize"]["algorithm"] != algorithm  # refused where it was set: the file or --set
    check_algorithm(loaded["quantize"]["algorithm"], f"{path}: after --set {' '.join(overrides)}" if changed
                    else str(path))
    logger.info("recipe %s: %d quant_cfg entries%s", path, len(loaded["quantize"]["quant_cfg"]),
                f", overrides {overrides}" if overrides else "")
    return Recipe(loaded, path=path, sources=sources, overrides=overrides)


# ------------------------------------------------------------------------------------------- overrides


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "string", list: "list", tuple: "list",
            dict: "mapping"}.get(type(value), type(value).__name__)


def _coerce(value: Any, existing: Any, leaf: str) -> Any:
    """`value` made to fit `existing`'s type, or None if it cannot."""
    if leaf in ("num_bits", "scale_bits"):
        if isinstance(value, str) and _EXMY.match(value):
            m = _EXMY.match(value)
            return (int(m.group(1)), int(m.group(2)))
        if isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int for v in value):
            return tuple(value)
        if type(value) is int:
            return value
        return None
    if existing is None:
        return value
    if isinstance(existing, bool):
        return value if isinstance(value, bool) else None
    if isinstance(existing, int):
        return value if type(value) is int else None
    if isinstance(existing, float):
        return float(value) if type(value) in (int, float) else None
    if isinstance(existing, (list, tuple)):
        return type(existing)(value) if isinstance(value, (list, tuple)) else None
    if isinstance(existing, dict):
        return value if isinstance(value, dict) else None
    return value if type(value) is type(existing) else None


def apply_overrides(data: dict[str, Any], overrides: Iterable[str], source: str | os.PathLike) -> dict[str, Any]:
    """`data` (a recipe mapping) with `KEY=VALUE` overrides applied and revalidated; see `load`."""
    from modelopt.recipe.config import ModelOptPTQRecipe

    data = copy.deepcopy(data)
    overrides = list(overrides)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{source}: override {item!r} is not KEY=VALUE")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{source}: --set {key}: value {text!r} is not valid YAML: {e}") from e
        node: Any = data
        parts = key.split(".")
        for depth, part in enumerate(parts):
            where = ".".join(parts[:depth]) or "the top level"
            if isinstance(node, dict):
                slot: Any = part
                if part not in node:
                    with contextlib.suppress(ValueError):
                        slot = int(part)
                if slot not in node:
                    known = ", ".join(map(str, node)) or "none"
                    raise ValueError(f"{source}: --set {key}: unknown key {part!r} under {where} (known: {known})")
            elif isinstance(node, list):
                if not re.fullmatch(r"\d+", part) or int(part) >= len(node):
                    raise ValueError(f"{source}: --set {key}: {where} is a list of {len(node)} entries; "
                                     f"{part!r} is not an index into it")
                slot = int(part)
            else:
                raise ValueError(f"{source}: --set {key}: {where} is a {_type_name(node)} value, not a mapping")
            if depth == len(parts) - 1:
                existing = node[slot]
                new = _coerce(value, existing, part)
                if new is None and value is not None:
                    expected = "int, e.g. 8, or ExMy, e.g. e4m3" if part in ("num_bits", "scale_bits") else (
                        "float" if isinstance(existing, float) else _type_name(existing))
                    current = repr(existing) if len(repr(existing)) <= 60 else repr(existing)[:57] + "..."
                    raise ValueError(f"{source}: --set {key}: expected {expected} (current value {current}), "
                                     f"got {_type_name(value)} {value!r}")
                node[slot] = new
            else:
                node = node[slot]
    try:
        return ModelOptPTQRecipe.model_validate(data).model_dump()
    except ValueError as e:
        details = _pydantic_errors(e) or [str(e)]
        raise ValueError(f"{source}: after --set {' '.join(overrides)}: " + "; ".join(details)) from e


# ------------------------------------------------------------------------------------ mtq.quantize config


def _family(model_config):
    from modelopt_ext.families import family_for_config

    mapping = model_config.to_dict() if hasattr(model_config, "to_dict") else dict(model_config)
    return family_for_config(mapping, source=f"{type(model_config).__name__}")


def _pure_disable(entry: Mapping[str, Any]) -> bool:
    return not entry.get("enable", True) and entry.get("cfg") is None and not entry.get("parent_class")


def _literal_parts(glob: str) -> list[str]:
    """The literal runs of a glob `*...*` whose inside has character classes at most (`*layers.1[02].X*` ->
    ["layers.1", ".X"]): a name it matches contains each of them. [] for any other glob."""
    inner = glob[1:-1]
    if len(glob) < 3 or glob[0] != "*" or glob[-1] != "*" or "*" in inner or "?" in inner:
        return []
    parts = re.split(r"\[[^\]]*\]", inner)
    return [] if any("[" in part or "]" in part for part in parts) else parts


def family_exclusion_entries(quant_cfg: list[Mapping[str, Any]], model_config, family=None) -> list[dict[str, Any]]:
    """Disabling entries for the family's `quantizer_exclusions(model_config)` globs (per-layer globs the YAML
    schema cannot express), appended after `quant_cfg`, except those that would change nothing: a glob that
    `quant_cfg` already disables after its last entry that may enable a quantizer, or that such a `*X*` glob
    covers (`*layers.3.self_attn.f_a_proj*` or `*layers.1[02].self_attn.f_a_proj*` inside
    `*self_attn.f_a_proj*`). ModelOpt matches every entry against
    every quantizer, so at Kimi-K3's 93 layers the redundant per-layer globs would cost most of the conversion
    (docs/calibration.md)."""
    spec = family or _family(model_config)
    final: list[str] = []  # pure disables after the last entry that may enable something
    for entry in quant_cfg:
        if _pure_disable(entry):
            final.append(entry["quantizer_name"])
        elif entry.get("enable", True) or entry.get("cfg") is not None:
            final = []
    # the X of each final `*X*` without wildcards: it covers every glob with X inside one of its literal runs
    literals = [parts[0] for parts in map(_literal_parts, final) if len(parts) == 1]

    def covered(glob: str) -> bool:
        parts = _literal_parts(glob)
        return glob in final or any(lit in part for lit in literals for part in parts)

    patterns = list(dict.fromkeys(spec.quantizer_exclusions(model_config)))
    entries = [{"quantizer_name": p, "parent_class": None, "cfg": None, "enable": False}
               for p in patterns if not covered(p)]
    logger.debug("family %s: %d exclusion entries added, %d already in effect", spec.name, len(entries),
                 len(patterns) - len(entries))
    return entries


def quant_config(recipe: Mapping[str, Any] | str | os.PathLike, model_config, *,
                 family_exclusions: bool = True, family=None) -> QuantConfig:
    """What `mtq.quantize(model, config, forward_loop)` takes: the recipe's `quant_cfg` and `algorithm`,
    followed by the model family's exclusions (see the module docstring) unless `family_exclusions` is
    False. `recipe` is a loaded recipe or a name/path for `load`; `model_config` the model's config (or
    the model); `family` its `FamilySpec` when the caller has it (else found from `model_config`)."""
    if not isinstance(recipe, Mapping):
        recipe = load(recipe)
    model_config = getattr(model_config, "config", model_config)
    quantize = recipe["quantize"]
    quant_cfg = copy.deepcopy(list(quantize["quant_cfg"]))
    path = getattr(recipe, "path", None)
    sources = list(getattr(recipe, "sources", None) or
                   [EntrySource(str(path or "recipe"), f"quantize.quant_cfg[{i}]") for i in range(len(quant_cfg))])
    if family_exclusions:
        family = family or _family(model_config)
        extra = family_exclusion_entries(quant_cfg, model_config, family)
        name = family.name
        sources += [EntrySource(f"family {name!r}", f"quantizer_exclusions(config) {e['quantizer_name']!r}")
                    for e in extra]
        quant_cfg += extra
    return QuantConfig({"quant_cfg": quant_cfg, "algorithm": copy.deepcopy(quantize["algorithm"])},
                       path=path, sources=sources)

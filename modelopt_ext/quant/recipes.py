"""Quantization recipes: YAML files loaded through ModelOpt's recipe loader, `--set` overrides, checks.

A recipe is a ModelOpt PTQ recipe (`metadata`, `quantize.{algorithm, quant_cfg}`, optional `imports`), the
schema `modelopt.recipe.load_recipe` validates. The shipped ones live in `RECIPES_DIR` (inside the package,
so they ship with the wheel): `<group>/<name>.yaml` recipes and `units/*.yaml` reusable `quant_cfg` units.

    recipe = load("nvfp4_experts-fp8_attention", overrides=["quantize.algorithm.method=max"])
    cfg = quant_config(recipe, model.config)       # {"quant_cfg": [...], "algorithm": ...} for mtq.quantize
    mtq.quantize(model, cfg, forward_loop)
    check_patterns_match(cfg, model)               # every pattern of ours hit something

Names: `resolve_recipe` takes a bare name (`fp8_all`, `kimi_k3/fp8_all`; looked up in RECIPES_DIR, never in
`units/`) or a path to any YAML file on disk.

Imports: a recipe's `imports:` paths are resolved against the recipe file's own folder, then RECIPES_DIR
(so a user recipe anywhere can import `units/kimi_k3_exclusions`), then as ModelOpt resolves them (the
working directory, then ModelOpt's built-in library `modelopt_recipes/`, e.g. `configs/numerics/fp8`).
ModelOpt itself resolves relative import paths against the working directory only, so `load` hands it a
temporary copy of the recipe whose local import paths were made absolute; errors name the original file.
Units imported by a recipe resolve their own imports the ModelOpt way (keep them to built-in paths).

Safety: ModelOpt reads YAML with `yaml.safe_load` / `safe_load_all` only, and its `# modelopt-schema:`
comments may only name objects under `modelopt.*`; this module also parses with `yaml.safe_load` only
(recipe files and `--set` values) and applies overrides itself (ModelOpt's own override path merges through
OmegaConf and would accept unknown keys).

Family exclusions: a quantizer-name glob sees only the name, and Kimi-K3's KDA and MLA layers both own
`self_attn.g_proj` (KDA's stays unquantized, MLA's does not); which layers are KDA comes from the model
config. So `quant_config` appends, after the recipe's entries, every glob of the model family's
`quantizer_exclusions(config)` that the recipe does not already hold as a disabling entry. With the shipped
recipes (whose unit holds the static globs) that is one entry per KDA layer and projection
(`*layers.{i}.self_attn.{f_a,f_b,b,g}_proj*`).

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
import dataclasses
import fnmatch
import io
import logging
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger(__name__)

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
UNITS_DIR = RECIPES_DIR / "units"
QFORMATS_FILE = RECIPES_DIR / "qformats.yaml"

_SUFFIXES = (".yaml", ".yml")
_TOP_LEVEL_KEYS = ("imports", "metadata", "quantize")
_ENTRY_KEYS = ("quantizer_name", "parent_class", "cfg", "enable")
_IMPORT = "$import"
# ModelOpt's own generic units: their globs are written for many architectures, so most of them match
# nothing on any one model; check_patterns_match does not hold them to matching.
_MODELOPT_DEFAULT_UNITS = ("configs/ptq/units/base_disable_all", "configs/ptq/units/default_disabled_quantizers")
_EXMY = re.compile(r"^[Ee](\d+)[Mm](\d+)$")
# Per-expert quantizers of fused experts live in ModuleLists (`..._weight_quantizers.7`); ModelOpt matches
# globs against the name and against the name with the list index collapsed (`..._weight_quantizer`).
_EXPERT_LIST = re.compile(r"(weight_quantizer|input_quantizer)s?\.\d+(?=$|\.)")


class RecipeNotFoundError(FileNotFoundError):
    """No recipe of that name or path; the message lists what was looked for and the available names."""


@dataclasses.dataclass(frozen=True)
class EntrySource:
    """Where one `quant_cfg` entry was written: a file and the entry in it."""

    location: str
    entry: str
    imported_by: str | None = None
    modelopt_default: bool = False

    def __str__(self) -> str:
        via = f" (imported by {self.imported_by})" if self.imported_by else ""
        return f"{self.location} {self.entry}{via}"


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


def _read_raw(path: Path) -> dict[str, Any]:
    """The recipe file as plain data (yaml.safe_load_all), with the shape checks ModelOpt reports poorly."""
    try:
        docs = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from e
    if len(docs) == 2 and isinstance(docs[0], dict) and isinstance(docs[1], dict):
        raw = {**docs[0], **docs[1]}  # ModelOpt's two-document form: header (imports) + body
    elif len(docs) == 1:
        raw = docs[0]
    else:
        raise ValueError(f"{path}: expected one YAML document (or a header and a body), got {len(docs)}")
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a recipe is a YAML mapping with {', '.join(_TOP_LEVEL_KEYS)}; "
                         f"got {type(raw).__name__}")
    unknown = [k for k in raw if k not in _TOP_LEVEL_KEYS]
    if unknown:
        raise ValueError(f"{path}: unknown top-level key(s) {', '.join(map(repr, unknown))} "
                         f"(a PTQ recipe has {', '.join(_TOP_LEVEL_KEYS)})")
    imports = raw.get("imports") or {}
    if not isinstance(imports, dict) or not all(isinstance(v, str) and v for v in imports.values()):
        raise ValueError(f"{path}: imports must map names to config paths (strings), got {imports!r}")
    metadata = raw.get("metadata")
    recipe_type = metadata.get("recipe_type") if isinstance(metadata, dict) else None
    if recipe_type != "ptq":
        raise ValueError(f"{path}: metadata.recipe_type must be 'ptq', got {recipe_type!r}")
    quantize = raw.get("quantize")
    if not isinstance(quantize, dict):
        raise ValueError(f"{path}: quantize must be a mapping with quant_cfg and algorithm, "
                         f"got {type(quantize).__name__}")
    quant_cfg = quantize.get("quant_cfg")
    if not isinstance(quant_cfg, list):
        # ModelOpt would default a missing quant_cfg to INT8 on every quantizer.
        raise ValueError(f"{path}: quantize.quant_cfg must be a list of entries, got {type(quant_cfg).__name__}")
    for i, entry in enumerate(quant_cfg):
        _check_raw_entry(path, f"quantize.quant_cfg[{i}]", entry, imports)
    return raw


def _check_raw_entry(path: Path, where: str, entry: Any, imports: Mapping[str, str]) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: {where} must be a mapping, got {type(entry).__name__} {entry!r}")
    if set(entry) == {_IMPORT}:
        refs = entry[_IMPORT] if isinstance(entry[_IMPORT], list) else [entry[_IMPORT]]
        missing = [r for r in refs if r not in imports]
        if missing:
            raise ValueError(f"{path}: {where}: $import of {', '.join(map(repr, missing))}, which imports "
                             f"does not declare (declared: {', '.join(imports) or 'none'})")
        return
    name = entry.get("quantizer_name")
    label = f"{where} (quantizer_name {name!r})"
    unknown = [k for k in entry if k not in _ENTRY_KEYS]
    if unknown:
        raise ValueError(f"{path}: {label}: unknown key(s) {', '.join(map(repr, unknown))} "
                         f"(an entry has {', '.join(_ENTRY_KEYS)}, or is a lone $import)")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{path}: {label}: quantizer_name must be a non-empty string")
    if "enable" in entry and not isinstance(entry["enable"], bool):
        raise ValueError(f"{path}: {label}: enable must be true or false, got "
                         f"{type(entry['enable']).__name__} {entry['enable']!r}")
    if entry.get("parent_class") is not None and not isinstance(entry["parent_class"], str):
        raise ValueError(f"{path}: {label}: parent_class must be a class name string")
    if "cfg" not in entry and "enable" not in entry:
        raise ValueError(f"{path}: {label}: an entry needs cfg, enable, or both")
    if entry.get("cfg") is not None and not isinstance(entry["cfg"], (dict, list)):
        raise ValueError(f"{path}: {label}: cfg must be a mapping of quantizer attributes (or a list of them), "
                         f"got {type(entry['cfg']).__name__} {entry['cfg']!r}")


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


def _modelopt_file(ref: str):
    """Where ModelOpt finds an import path: the working directory first, then its built-in library."""
    from modelopt.torch.opt.config_loader import BUILTIN_CONFIG_ROOT

    names = [ref] if ref.endswith(_SUFFIXES) else [f"{ref}{s}" for s in (".yml", ".yaml")]
    for candidate in [Path(n) for n in names] + [BUILTIN_CONFIG_ROOT.joinpath(n) for n in names]:
        if candidate.is_file():
            return candidate
    return None


def _display(file) -> str:
    from modelopt.torch.opt.config_loader import BUILTIN_CONFIG_ROOT

    root = str(BUILTIN_CONFIG_ROOT)
    text = str(file)
    return "<modelopt_recipes>/" + text[len(root):].lstrip("/\\") if text.startswith(root) else text


def _is_modelopt_default(file) -> bool:
    from modelopt.torch.opt.config_loader import BUILTIN_CONFIG_ROOT

    text = str(file)
    return any(text in (str(BUILTIN_CONFIG_ROOT.joinpath(f"{unit}{s}")) for s in _SUFFIXES)
               for unit in _MODELOPT_DEFAULT_UNITS)


@contextlib.contextmanager
def _modelopt_prints_logged(replace: tuple[str, str] | None = None):
    """ModelOpt's loader prints; route what it writes to stdout into this module's logger (redirect_stdout
    swaps sys.stdout for the whole process while a recipe loads)."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        for line in buffer.getvalue().splitlines():
            logger.debug("modelopt: %s", line.replace(*replace) if replace else line)


_UNION_LABELS = frozenset({"str", "int", "float", "bool", "dict", "list", "tuple", "none"})


def _pydantic_errors(exc: BaseException | None) -> list[str]:
    """`loc: message (got value)` lines of a pydantic ValidationError, else []. Union-branch labels are
    dropped from locations, and only the deepest locations are kept (a union reports every alternative)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return []
    by_loc: dict[str, tuple[list[str], str]] = {}
    for err in errors():
        parts = [p for p in err.get("loc", ()) if not (isinstance(p, str) and (
            "[" in p or "(" in p or p in _UNION_LABELS))]
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".") or "(top level)"
        got = ""
        if "input" in err and err.get("type") != "missing":
            got = repr(err["input"])
            got = f" (got {got if len(got) <= 80 else got[:77] + '...'})"
        msgs, _ = by_loc.setdefault(loc, ([], got))
        if err.get("msg", "") not in msgs:
            msgs.append(err.get("msg", ""))
    out = []
    for loc, (msgs, got) in by_loc.items():
        if any(o != loc and o.startswith(loc) for o in by_loc):
            continue
        specific = [m for m in msgs if not m.startswith("Input should be a valid")]
        out.append(f"{loc}: {' or '.join(specific or msgs)}{got}")
    return out


def _load_modelopt(path: Path, data: dict[str, Any], folder: str):
    """ModelOpt's load_recipe on `data` written to a temporary file named like `path` in `folder`."""
    from modelopt.recipe import load_recipe

    tmp_file = Path(folder) / path.name
    tmp_file.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    with _modelopt_prints_logged((str(tmp_file), str(path))):
        return load_recipe(tmp_file)


def _explain_failure(path: Path, err: ValueError, data: dict[str, Any], folder: str) -> ValueError:
    """A ValueError naming the original file and the failing entry (found by loading entries one by one,
    since ModelOpt's validation of quant_cfg does not report the entry's index)."""
    tmp_file = Path(folder) / path.name
    details = _pydantic_errors(err.__cause__ if err.__cause__ is not None else err)
    if not details:
        return ValueError(f"{path}: {str(err).replace(str(tmp_file), str(path))}")
    if any(d.startswith("quantize.quant_cfg") for d in details):
        bad = []
        for i, entry in enumerate(data["quantize"]["quant_cfg"]):
            probe = {**data, "quantize": {"quant_cfg": [entry]}}
            try:
                _load_modelopt(path, probe, folder)
            except ValueError as entry_err:
                lines = _pydantic_errors(entry_err.__cause__) or [str(entry_err).replace(str(tmp_file), str(path))]
                lines = [line.replace("quantize.quant_cfg", "", 1).lstrip(".") or line for line in lines]
                name = entry.get("quantizer_name", entry.get(_IMPORT))
                bad.append(f"quantize.quant_cfg[{i}] ({name!r}): " + "; ".join(lines))
        if bad:
            return ValueError(f"{path}: invalid entry " + "; invalid entry ".join(bad))
    return ValueError(f"{path}: invalid recipe: " + "; ".join(details))


def _entry_sources(path: Path, data: dict[str, Any], count: int) -> list[EntrySource]:
    from modelopt.torch.opt.config_loader import load_config

    imports = data.get("imports") or {}
    sources: list[EntrySource] = []
    for i, entry in enumerate(data["quantize"]["quant_cfg"]):
        here = f"quantize.quant_cfg[{i}]"
        if set(entry) != {_IMPORT}:
            sources.append(EntrySource(str(path), here))
            continue
        refs = entry[_IMPORT] if isinstance(entry[_IMPORT], list) else [entry[_IMPORT]]
        for ref in refs:
            file = _modelopt_file(imports[ref])
            with _modelopt_prints_logged():
                snippet = load_config(file) if file is not None else []
            entries = snippet if isinstance(snippet, list) else [snippet]
            for j in range(len(entries)):
                sources.append(EntrySource(
                    _display(file), f"entry [{j}]" if isinstance(snippet, list) else "entry",
                    imported_by=f"{path} {here}", modelopt_default=_is_modelopt_default(file),
                ))
    if len(sources) != count:  # not expected; keep errors useful anyway
        logger.debug("%s: could not attribute %d resolved quant_cfg entries to files", path, count)
        return [EntrySource(str(path), f"quantize.quant_cfg (resolved entry {k})") for k in range(count)]
    return sources


def load(name_or_path: str | os.PathLike, overrides: Iterable[str] = ()) -> Recipe:
    """Load a recipe through ModelOpt's `load_recipe`, then apply `--set KEY=VALUE` overrides.

    Returns the validated recipe as a plain mapping (ModelOpt's full dump: every quantizer attribute
    spelled out, so every attribute can be overridden). Overrides walk dotted keys into that mapping
    (list indices as numbers, e.g. `quantize.quant_cfg.3.enable=false`); values are parsed with
    yaml.safe_load and must have the existing value's type (ints are accepted for floats; `num_bits` /
    `scale_bits` also take `e4m3`-style names). Any error is a ValueError naming the file and the entry
    or key.
    """
    from modelopt.recipe.config import ModelOptPTQRecipe

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
    if not isinstance(recipe, ModelOptPTQRecipe):
        raise ValueError(f"{path}: not a PTQ recipe ({type(recipe).__name__})")
    loaded = recipe.model_dump()
    sources = _entry_sources(path, data, len(loaded["quantize"]["quant_cfg"]))
    overrides = list(overrides)
    if overrides:
        loaded = apply_overrides(loaded, overrides, path)
        count = len(loaded["quantize"]["quant_cfg"])
        if count != len(sources):
            sources = [EntrySource(str(path), f"quantize.quant_cfg[{k}] (after --set)") for k in range(count)]
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


def family_exclusion_entries(quant_cfg: list[Mapping[str, Any]], model_config) -> list[dict[str, Any]]:
    """Disabling entries for the family's `quantizer_exclusions(model_config)` globs that `quant_cfg` does
    not already hold as disabling entries (per-layer globs the YAML schema cannot express)."""
    spec = _family(model_config)
    present = {e["quantizer_name"] for e in quant_cfg
               if not e.get("enable", True) and e.get("cfg") is None and not e.get("parent_class")}
    entries = [{"quantizer_name": p, "parent_class": None, "cfg": None, "enable": False}
               for p in dict.fromkeys(spec.quantizer_exclusions(model_config)) if p not in present]
    logger.debug("family %s: %d exclusion entries added", spec.name, len(entries))
    return entries


def quant_config(recipe: Mapping[str, Any] | str | os.PathLike, model_config, *,
                 family_exclusions: bool = True) -> QuantConfig:
    """What `mtq.quantize(model, config, forward_loop)` takes: the recipe's `quant_cfg` and `algorithm`,
    followed by the model family's exclusions (see the module docstring) unless `family_exclusions` is
    False. `recipe` is a loaded recipe or a name/path for `load`; `model_config` the model's config (or
    the model)."""
    if not isinstance(recipe, Mapping):
        recipe = load(recipe)
    model_config = getattr(model_config, "config", model_config)
    quantize = recipe["quantize"]
    quant_cfg = copy.deepcopy(list(quantize["quant_cfg"]))
    path = getattr(recipe, "path", None)
    sources = list(getattr(recipe, "sources", None) or
                   [EntrySource(str(path or "recipe"), f"quantize.quant_cfg[{i}]") for i in range(len(quant_cfg))])
    if family_exclusions:
        extra = family_exclusion_entries(quant_cfg, model_config)
        name = _family(model_config).name
        sources += [EntrySource(f"family {name!r}", f"quantizer_exclusions(config) {e['quantizer_name']!r}")
                    for e in extra]
        quant_cfg += extra
    return QuantConfig({"quant_cfg": quant_cfg, "algorithm": copy.deepcopy(quantize["algorithm"])},
                       path=path, sources=sources)


# -------------------------------------------------------------------------------------------- checking


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
    others = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
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

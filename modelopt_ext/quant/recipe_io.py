"""Recipe files into ModelOpt's recipe loader: safe-YAML reading, shape checks, loading, error messages.

Internal to `modelopt_ext.quant.recipes`, whose `load` drives it (see that module's docstring for how
import paths are resolved and why ModelOpt gets a temporary copy of the recipe).

Reading: `_read_raw` parses a recipe file with `yaml.safe_load_all` only (one document, or ModelOpt's
header + body form) and checks what ModelOpt reports poorly: top-level keys, `imports`,
`metadata.recipe_type`, and every `quantize.quant_cfg` entry (keys, value types, `$import` names declared).

Loading: `_load_modelopt` writes recipe data (`yaml.safe_dump`) to a temporary file named like the
original and runs ModelOpt's `load_recipe` on it, with ModelOpt's prints routed to this module's logger.
On failure `_explain_failure` builds a ValueError naming the original file and the failing `quant_cfg`
entry (found by loading the entries one by one); `_pydantic_errors` formats validation errors.
`_entry_sources` attributes every resolved `quant_cfg` entry to the file and entry it was written in
(`EntrySource`), following `$import`s into unit files. `_check_bits` then refuses a `num_bits` /
`scale_bits` string that names no ExMy format on an entry without a custom backend (ModelOpt accepts it), and
(`_check_calibrator`) a quantizer calibrator other than max, such as `histogram` (percentile / MSE / entropy).
`check_algorithm` refuses a `quantize.algorithm` that ModelOpt's calibration-mode registry does not know
(ModelOpt's schema takes any string or mapping there and `mtq.quantize` fails on it after the model is
loaded), one that `modelopt_ext.quant.calibrate` cannot run (see `SYNC_FIELD`), or settings its config
class refuses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger(__name__)

_SUFFIXES = (".yaml", ".yml")
_TOP_LEVEL_KEYS = ("imports", "metadata", "quantize")
_ENTRY_KEYS = ("quantizer_name", "parent_class", "cfg", "enable")
_IMPORT = "$import"
# ModelOpt's own generic units: their globs are written for many architectures, so most of them match
# nothing on any one model; check_patterns_match does not hold them to matching.
_MODELOPT_DEFAULT_UNITS = ("configs/ptq/units/base_disable_all", "configs/ptq/units/default_disabled_quantizers")
_UNION_LABELS = frozenset({"str", "int", "float", "bool", "dict", "list", "tuple", "none"})


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


def _check_bits(entries: list[dict[str, Any]], sources: list[EntrySource]) -> None:
    """Refuse a string `num_bits` / `block_sizes.scale_bits` other than ExMy (which ModelOpt turns into a
    tuple) on a quantizer without a custom `backend`: ModelOpt's schema takes any string there (for custom
    backends) and the mistake would only surface in `mtq.quantize`, after the model is loaded. Also refuses a
    quantizer calibrator other than max (`_check_calibrator`)."""
    for entry, source in zip(entries, sources):
        cfgs = entry.get("cfg") or []
        for k, cfg in enumerate(cfgs if isinstance(cfgs, list) else [cfgs]):
            where = f"cfg[{k}]" if isinstance(cfgs, list) else "cfg"
            if isinstance(cfg, dict) and entry.get("enable", True) is not False:
                _check_calibrator(entry, source, where, cfg.get("calibrator", "max"))
            if not isinstance(cfg, dict) or cfg.get("backend") is not None:
                continue
            values = [("num_bits", cfg.get("num_bits"))]
            if isinstance(cfg.get("block_sizes"), dict):
                values.append(("block_sizes.scale_bits", cfg["block_sizes"].get("scale_bits")))
            for key, value in values:
                if isinstance(value, str):
                    raise ValueError(
                        f"{source}: quantizer_name {entry.get('quantizer_name')!r}: {where}.{key} is the string "
                        f"{value!r}; expected an int (e.g. 8) or ExMy (e.g. e4m3); other strings are for a custom "
                        "backend, and this entry sets none"
                    )


def check_calibrators(quant_cfg: list, source: str) -> None:
    """`_check_calibrator` over a resolved `quant_cfg` list (e.g. after `--set` overrides, in `calibrate`)."""
    for i, entry in enumerate(quant_cfg):
        cfgs = entry.get("cfg") if isinstance(entry, dict) else None
        for k, cfg in enumerate(cfgs if isinstance(cfgs, list) else [cfgs]):
            if isinstance(cfg, dict) and entry.get("enable", True) is not False:
                where = f"cfg[{k}]" if isinstance(cfgs, list) else "cfg"
                _check_calibrator(entry, EntrySource(source, f"quantize.quant_cfg[{i}]"), where,
                                  cfg.get("calibrator", "max"))


def _check_calibrator(entry: dict[str, Any], source: EntrySource, where: str, calibrator: Any) -> None:
    """Refuse a quantizer `calibrator` other than ModelOpt's max one (`histogram`, or a constructor): ModelOpt
    0.47's calibration algorithms load every calibrator's amax with `compute_amax()` and no method, which its
    HistogramCalibrator refuses (TypeError, after the model is loaded); and its histograms take their bins
    from each rank's own first batch, so under EP they could not be summed over ranks either."""
    if calibrator == "max":
        return
    shown = repr(calibrator) if isinstance(calibrator, str) else f"a {type(calibrator).__name__} constructor"
    raise ValueError(
        f"{source}: quantizer_name {entry.get('quantizer_name')!r}: {where}.calibrator is {shown}; modelopt_ext "
        "calibrates with ModelOpt's max calibrator only: ModelOpt 0.47's calibration algorithms never ask a "
        "histogram calibrator for its percentile / MSE / entropy amax (they fail on it after the model is "
        "loaded), and its histograms are binned from each rank's own data, so ranks' histograms cannot be summed "
        "under expert parallelism; drop calibrator (activation amax: max; weight amax searches: "
        "quantize.algorithm.method mse or local_hessian)"
    )


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


# `calibrate` runs ModelOpt with its own amax sync off (`sync.calibration_algorithm` sets this field to
# False; `sync.sync_amax` syncs instead, with every rank in step): an algorithm whose config class has no such
# field cannot run there (its config refuses the field: no calibration, smoothquant, AWQ, SVDQuant, GPTQ,
# ... in ModelOpt 0.47).
SYNC_FIELD = "distributed_sync"


def calibration_methods() -> dict[str | None, type]:
    """ModelOpt's calibration algorithms: `method` name (None: no calibration) -> config class, read from its
    calibration-mode registry (what `mtq.quantize` looks the name up in)."""
    from modelopt.torch.quantization.mode import CalibrateModeRegistry

    return {d.config_class.model_fields["method"].default: d.config_class
            for d in CalibrateModeRegistry._name2descriptor.values()}


def _names(methods) -> str:
    names = sorted(m for m in methods if m is not None)
    return ", ".join(names + (["null (no calibration)"] if None in methods else []))


def check_algorithm(algorithm: Any, where: str) -> None:
    """Raise ValueError `where: <entry>: ...` unless `algorithm` (a recipe's `quantize.algorithm`) is one
    calibration algorithm that ModelOpt knows and `calibrate` can run, with settings its config class takes;
    the message lists the names (from ModelOpt)."""
    methods = calibration_methods()
    runnable = {m: c for m, c in methods.items() if SYNC_FIELD in c.model_fields}
    use = f"use one of: {_names(runnable)}"
    if isinstance(algorithm, (list, tuple)):
        raise ValueError(f"{where}: quantize.algorithm is a list of {len(algorithm)} algorithms; modelopt_ext "
                         f"calibrates with one algorithm, {use}")
    if isinstance(algorithm, Mapping):
        entry, method = "quantize.algorithm.method", algorithm.get("method")
        if "method" not in algorithm:
            raise ValueError(f"{where}: quantize.algorithm has no method; {use}")
    elif algorithm is None or isinstance(algorithm, str):
        entry, method = "quantize.algorithm", algorithm
    else:
        raise ValueError(f"{where}: quantize.algorithm must be a method name or a mapping with method, got "
                         f"{type(algorithm).__name__} {algorithm!r}")
    shown = "null (no calibration)" if method is None else repr(method)
    if not isinstance(method, (str, type(None))) or method not in methods:
        from modelopt import __version__

        raise ValueError(f"{where}: {entry}: unknown calibration algorithm {shown}; valid: {_names(runnable)} "
                         f"(ModelOpt {__version__} has {_names(methods)}; modelopt_ext's calibration runs those "
                         f"with {SYNC_FIELD})")
    if method not in runnable:
        raise ValueError(f"{where}: {entry}: calibration algorithm {shown} cannot run in modelopt_ext's "
                         f"calibration, which turns ModelOpt's {SYNC_FIELD} off and syncs amax across ranks itself: "
                         f"{methods[method].__name__} has no {SYNC_FIELD}; {use}")
    if isinstance(algorithm, Mapping):
        try:
            runnable[method].model_validate(dict(algorithm))
        except ValueError as e:
            details = _pydantic_errors(e) or [str(e)]
            raise ValueError(f"{where}: " + "; ".join(f"quantize.algorithm.{d}" for d in details)) from e

"""Verify a quantized checkpoint in ModelOpt's unified Hugging Face format.

The format, as ``modelopt.torch.export.export_hf_checkpoint`` (nvidia-modelopt 0.47) writes it:

* safetensors shards with ``model.safetensors.index.json`` (``weight_map``: tensor -> shard file;
  ``metadata.total_size``: the sum of the tensors' data bytes), or one file without an index;
* ``hf_quant_config.json``: ``quantization.quant_algo`` (``FP8``, ``NVFP4``, or ``MIXED_PRECISION`` with
  per-module ``quantized_layers``), ``group_size``, ``exclude_modules`` (exact names and prefix
  wildcards such as ``vision_tower*``), ``kv_cache_quant_algo``; the same again in compressed-tensors
  style as ``config.json``'s ``quantization_config`` (``quant_algo``, ``ignore``, ``config_groups``,
  ``quant_method: modelopt``);
* for every quantized linear ``M`` (``M.input_scale`` F32 ``[]`` is absent when the input was never
  calibrated):

  - FP8: ``M.weight`` F8_E4M3 ``[..., I]``, ``M.weight_scale`` F32 ``[]``, no ``M.weight_scale_2``;
  - NVFP4: ``M.weight`` U8 ``[..., I/2]``, ``M.weight_scale`` F8_E4M3 ``[..., B]``, ``M.weight_scale_2``
    F32 ``[]``.

  FP8 dequantizes as ``weight * weight_scale``. NVFP4 packs two E2M1 codes per byte, element ``2j`` in
  the LOW nibble and ``2j+1`` in the high one (the same order as MXFP4 in ``modelopt_ext.formats.mxfp4``),
  and dequantizes as ``E2M1[code] * weight_scale[block] * weight_scale_2``;
* every other tensor keeps its source name, dtype and bytes, except for the renames in ``RENAMES``.

Shape legend: ``...`` leading dims (output features, experts), ``I`` input features, ``B`` NVFP4 blocks
``ceil(I / group_size)`` (the packed weight holds ``B * group_size`` codes; padding, if any, is cropped).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import math
import re
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import torch
from safetensors import safe_open

from modelopt_ext.formats.mxfp4 import E2M1_VALUES, dequantize_mxfp4, unpack_e2m1

logger = logging.getLogger(__name__)

MANIFEST_NAME = "MANIFEST.sha256"
INDEX_NAME = "model.safetensors.index.json"
HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
SUPPORTED_ALGOS = ("FP8", "NVFP4")
NVFP4_DEFAULT_GROUP_SIZE = 16
WEIGHT_COMPANIONS = ("weight_scale", "weight_scale_2", "input_scale")
KV_SCALES = ("k_scale", "v_scale")

# Export name -> source name, first match wins; every other export tensor keeps its source name. A source
# tensor ``X.weight`` is stored either as is or as MXFP4 (``X.weight_packed`` + ``X.weight_scale``).
RENAMES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"^(.+\.experts\.\d+)\.gate_proj\.weight$"), r"\1.w1.weight"),
    (re.compile(r"^(.+\.experts\.\d+)\.up_proj\.weight$"), r"\1.w3.weight"),
    (re.compile(r"^(.+\.experts\.\d+)\.down_proj\.weight$"), r"\1.w2.weight"),
)

# Error-bound constants (see verify_export).
FP8_REL_ROUNDING = 2.0**-4  # half an ULP of E4M3 (3 mantissa bits), relative
FP8_SUBNORMAL_HALF_STEP = 2.0**-10  # half the E4M3 subnormal step 2**-9, in units of the scale
EXPORT_ROUNDING = 2.0**-8  # the source rounded to the export dtype (bf16, 2**-9) + the bf16 division (2**-9)
E2M1_STEP_EDGES = (2.0, 4.0)  # E2M1 steps: 0.5 below 2, 1 in [2, 4), 2 in [4, 6]
E2M1_HALF_STEPS = (0.25, 0.5, 1.0)

_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_MANIFEST_LINE = re.compile(r"^([0-9a-f]{64})  (.+)$")


class ExportInvalid(ValueError):
    """The export failed verification; ``problems`` lists every problem, ``report`` the whole report."""

    def __init__(self, report: VerifyReport):
        self.report = report
        self.problems = report.problems
        lines = "\n".join(f"  - {p}" for p in report.problems)
        super().__init__(f"export {report.export_dir} is invalid: {len(report.problems)} problem(s):\n{lines}")


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of `verify_export`.

    ``max_rel_error[fmt]``: the largest ``max|dequantized - source| / max|source|`` over the weights of a
    format; ``max_bound_ratio[fmt]``: the largest ``|dequantized - source| / bound`` (<= 1 when valid).
    Both are empty without a source. ``manifest``: ``written``, ``checked``, ``absent`` or ``not written``.
    """

    export_dir: str
    source_dir: str | None
    files: int
    tensors_checked: int
    tensor_bytes: int
    quantized: Mapping[str, int]
    max_rel_error: Mapping[str, float]
    max_bound_ratio: Mapping[str, float]
    manifest: str
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        quant = ", ".join(f"{fmt} {n}" for fmt, n in sorted(self.quantized.items())) or "none"
        lines = [
            f"{'OK' if self.ok else 'INVALID'} {self.export_dir}: {self.tensors_checked} tensors, "
            f"{self.tensor_bytes} bytes in {self.files} safetensors file(s); quantized weights: {quant}",
        ]
        if self.source_dir is not None:
            errs = ", ".join(
                f"{fmt} {self.max_rel_error[fmt]:.3g} ({self.max_bound_ratio[fmt]:.3f} of bound)"
                for fmt in sorted(self.max_rel_error)
            ) or "no quantized weights"
            lines.append(f"vs source {self.source_dir}: max relative error {errs}")
        lines.append(f"manifest {MANIFEST_NAME}: {self.manifest}")
        return "\n".join(lines)


@dataclass(frozen=True)
class _Entry:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class _QuantSpec:
    algo: str | None  # FP8, NVFP4, MIXED_PRECISION, or None (nothing quantized)
    group_size: int
    exclude: tuple[str, ...]
    layers: Mapping[str, tuple[str, int]]  # MIXED_PRECISION: module -> (algo, group_size)
    kv_cache: str | None

    def excluded(self, module: str) -> bool:
        return any(fnmatch.fnmatchcase(module, pattern) for pattern in self.exclude)

    def format_for(self, module: str) -> tuple[str, int] | None:
        if self.algo is None or self.excluded(module):
            return None
        if self.algo == "MIXED_PRECISION":
            return self.layers.get(module)
        return self.algo, self.group_size


class _Unreadable(Exception):
    """A tensor that safetensors cannot read; the message names it and its file."""


class _Tensors:
    """Lazy access to tensors of safetensors files, one open handle per file."""

    def __init__(self, root: Path, files: Mapping[str, str], stack: ExitStack):
        self.root, self.files, self.stack, self.handles = root, files, stack, {}

    def get(self, key: str) -> torch.Tensor:
        name = self.files[key]
        try:
            if name not in self.handles:
                self.handles[name] = self.stack.enter_context(safe_open(str(self.root / name), framework="pt"))
            return self.handles[name].get_tensor(key)
        except Exception as e:  # safetensors raises its own error types
            raise _Unreadable(f"cannot read tensor {key} from {self.root / name}: {e}") from e


def _pairs_hook(duplicates: list[str]):
    def hook(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                duplicates.append(key)
            seen[key] = value
        return seen

    return hook


def _load_json(path: Path, problems: list[str]):
    if not path.is_file():
        return None
    duplicates: list[str] = []
    try:
        data = json.loads(path.read_text(), object_pairs_hook=_pairs_hook(duplicates))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problems.append(f"{path.name}: unreadable JSON ({e})")
        return None
    problems.extend(f"{path.name}: key {key} appears twice" for key in duplicates)
    return data


# ---------------------------------------------------------------------------------------------------
# (1), (2) shards and index


def _read_header(path: Path, problems: list[str]) -> dict[str, _Entry] | None:
    """Header entries of one safetensors file; offsets checked against the file size."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or n > size - 8:
            problems.append(f"{path.name}: not a safetensors file (header length {n}, file size {size})")
            return None
        raw = f.read(n)
    duplicates: list[str] = []
    try:
        header = json.loads(raw, object_pairs_hook=_pairs_hook(duplicates))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        problems.append(f"{path.name}: unreadable safetensors header ({e})")
        return None
    problems.extend(f"{path.name}: tensor {key} is named twice in the header" for key in duplicates)
    if not isinstance(header, dict):
        problems.append(f"{path.name}: safetensors header is not a JSON object")
        return None
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    entries, spans = {}, []
    for key, meta in header.items():
        try:
            dtype, shape = meta["dtype"], tuple(int(d) for d in meta["shape"])
            begin, end = (int(o) for o in meta["data_offsets"])
        except (TypeError, KeyError, ValueError):
            problems.append(f"{path.name}: malformed header entry for tensor {key}: {meta!r}")
            continue
        if dtype not in _DTYPE_BYTES:
            problems.append(f"{path.name}: tensor {key} has unknown dtype {dtype}")
            continue
        nbytes = math.prod(shape) * _DTYPE_BYTES[dtype]
        if end - begin != nbytes or begin < 0 or end > data_len:
            problems.append(
                f"{path.name}: tensor {key} data_offsets [{begin}, {end}] do not hold {dtype} {list(shape)} "
                f"({nbytes} bytes) inside the {data_len}-byte data section"
            )
            continue
        spans.append((begin, end, key))
        entries[key] = _Entry(key, path.name, dtype, shape, nbytes)
    spans.sort()
    for (_, end0, key0), (begin1, _, key1) in zip(spans, spans[1:]):
        if begin1 < end0:
            problems.append(f"{path.name}: tensors {key0} and {key1} overlap in the data section")
    return entries


def _check_index(
    path: Path, headers: dict[str, dict[str, _Entry]], where: dict[str, list[str]], shards: list[str],
    problems: list[str],
) -> None:
    index = _load_json(path, problems)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        problems.append(f"{path.name}: no weight_map object")
        return
    for key, shard in sorted(weight_map.items()):
        if shard not in shards:
            problems.append(f"{path.name}: tensor {key} is mapped to shard {shard}, which does not exist")
        elif shard in headers and key not in headers[shard]:
            if where.get(key):
                problems.append(f"{path.name}: tensor {key} is mapped to {shard} but stored in {', '.join(where[key])}")
            else:
                problems.append(f"tensor {key} is listed in {path.name} (shard {shard}) but missing from every shard")
    referenced = set(weight_map.values())
    problems.extend(f"shard {s} is not referenced by {path.name}" for s in shards if s not in referenced)
    problems.extend(
        f"tensor {key} in {files[0]} is not listed in {path.name}"
        for key, files in sorted(where.items()) if key not in weight_map
    )
    total = (index.get("metadata") or {}).get("total_size")
    if total is not None:
        actual = sum(e.nbytes for s in sorted(referenced & headers.keys()) for e in headers[s].values())
        if not isinstance(total, int) or total != actual:
            problems.append(
                f"{path.name}: metadata.total_size {total!r} != {actual} bytes of tensor data in its shards"
            )


def _check_layout(export_dir: Path, problems: list[str]) -> tuple[list[str], dict[str, _Entry], int]:
    """Shard files, the tensors (first occurrence of each name) and their total data bytes."""
    shards = sorted(p.name for p in export_dir.glob("*.safetensors") if p.is_file())
    headers = {}
    for name in shards:
        header = _read_header(export_dir / name, problems)
        if header is not None:
            headers[name] = header
    where: dict[str, list[str]] = defaultdict(list)
    for name, header in headers.items():
        for key in header:
            where[key].append(name)
    for key, files in sorted(where.items()):
        if len(files) > 1:
            problems.append(f"tensor {key} is stored in {len(files)} shards: {', '.join(files)}")
    indexes = sorted(p for p in export_dir.glob("*.safetensors.index.json") if p.is_file())
    if not shards:
        problems.append(f"no *.safetensors file in {export_dir}")
    if len(indexes) > 1:
        problems.append(f"several index files: {', '.join(p.name for p in indexes)}")
    if indexes:
        _check_index(indexes[0], headers, where, shards, problems)
    elif len(shards) > 1:
        problems.append(f"{len(shards)} safetensors files ({', '.join(shards)}) but no {INDEX_NAME}")
    entries: dict[str, _Entry] = {}
    for name in sorted(headers):
        for key, entry in headers[name].items():
            entries.setdefault(key, entry)
    tensor_bytes = sum(e.nbytes for header in headers.values() for e in header.values())
    return shards, entries, tensor_bytes


# ---------------------------------------------------------------------------------------------------
# (3) quantization layout


def _group_size(qc: Mapping, default: int) -> int:
    for group in (qc.get("config_groups") or {}).values():
        size = ((group or {}).get("weights") or {}).get("group_size")
        if size is not None:
            return size
    return default


def _read_quant_spec(export_dir: Path, problems: list[str]) -> _QuantSpec:
    hf = _load_json(export_dir / HF_QUANT_CONFIG_NAME, problems)
    config = _load_json(export_dir / "config.json", problems)
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if hf is not None:
        q = hf.get("quantization") if isinstance(hf, dict) else None
        if not isinstance(q, dict):
            problems.append(f"{HF_QUANT_CONFIG_NAME}: no 'quantization' object")
            q = {}
        algo, exclude = q.get("quant_algo"), list(q.get("exclude_modules") or [])
        group_size, kv = q.get("group_size") or NVFP4_DEFAULT_GROUP_SIZE, q.get("kv_cache_quant_algo")
        layers = q.get("quantized_layers") or {}
        if not isinstance(qc, dict):
            if algo is not None:
                problems.append(f"config.json has no quantization_config although {HF_QUANT_CONFIG_NAME} sets {algo}")
        else:
            if qc.get("quant_algo") != algo:
                problems.append(
                    f"config.json quantization_config.quant_algo {qc.get('quant_algo')!r} != "
                    f"{HF_QUANT_CONFIG_NAME} quant_algo {algo!r}"
                )
            ignore = set(qc.get("ignore") or [])
            if ignore != set(exclude):
                problems.append(
                    f"config.json quantization_config.ignore and {HF_QUANT_CONFIG_NAME} exclude_modules differ: "
                    f"only in ignore {sorted(ignore - set(exclude))}, only in exclude_modules "
                    f"{sorted(set(exclude) - ignore)}"
                )
            if algo == "NVFP4" and _group_size(qc, group_size) != group_size:
                problems.append(
                    f"config.json quantization_config group_size {_group_size(qc, group_size)} != "
                    f"{HF_QUANT_CONFIG_NAME} group_size {group_size}"
                )
    elif isinstance(qc, dict):
        algo, exclude = qc.get("quant_algo"), list(qc.get("ignore") or [])
        group_size, layers = _group_size(qc, NVFP4_DEFAULT_GROUP_SIZE), qc.get("quantized_layers") or {}
        kv = qc.get("kv_cache_scheme") or None
    else:
        algo, exclude, group_size, layers, kv = None, [], NVFP4_DEFAULT_GROUP_SIZE, {}, None
    if isinstance(qc, dict) and qc.get("quant_method") != "modelopt":
        method = qc.get("quant_method")
        problems.append(f"config.json quantization_config.quant_method is {method!r}, expected 'modelopt'")
    if algo not in (None, "MIXED_PRECISION", *SUPPORTED_ALGOS):
        supported = ", ".join((*SUPPORTED_ALGOS, "MIXED_PRECISION"))
        problems.append(f"quant_algo {algo!r} is not supported here (supported: {supported})")
    per_layer = {}
    for module, cfg in layers.items():
        layer_algo = (cfg or {}).get("quant_algo")
        if layer_algo not in SUPPORTED_ALGOS:
            problems.append(f"quantized_layers[{module}]: quant_algo {layer_algo!r} is not supported here")
        per_layer[module] = (layer_algo, (cfg or {}).get("group_size") or NVFP4_DEFAULT_GROUP_SIZE)
    return _QuantSpec(algo, int(group_size), tuple(exclude), MappingProxyType(per_layer), kv)


def _expect(entry: _Entry, dtype: str, shape: tuple[int, ...] | None, problems: list[str], why: str) -> bool:
    if entry.dtype != dtype or (shape is not None and entry.shape != shape):
        want = f"{dtype} {list(shape)}" if shape is not None else dtype
        problems.append(f"{entry.name} is {entry.dtype} {list(entry.shape)}, expected {want} ({why})")
        return False
    return True


def _check_positive(key: str, tensors: _Tensors, problems: list[str]) -> None:
    value = tensors.get(key).float()
    bad = ~(torch.isfinite(value) & (value > 0))
    if bool(bad.any()):
        problems.append(f"{key} has {int(bad.sum())} non-finite or non-positive value(s)")


def _check_quantized_module(
    module: str, leaves: dict[str, _Entry], algo: str, group_size: int, tensors: _Tensors, problems: list[str]
) -> bool:
    """Check one quantized module's tensors; True when their dtypes and shapes allow dequantization."""
    weight = leaves["weight"]
    if "input_scale" in leaves and _expect(leaves["input_scale"], "F32", (), problems, f"{algo} input scale"):
        _check_positive(f"{module}.input_scale", tensors, problems)
    if algo == "FP8":
        ok = _expect(weight, "F8_E4M3", None, problems, "FP8 weight")
        ok &= _expect(leaves["weight_scale"], "F32", (), problems, "FP8 per-tensor weight scale")
        if "weight_scale_2" in leaves:
            problems.append(f"orphan scale {module}.weight_scale_2: an FP8 weight has no second-level scale")
        if ok:
            _check_positive(f"{module}.weight_scale", tensors, problems)
            nan = int(torch.isnan(tensors.get(weight.name).float()).sum())
            if nan:
                problems.append(f"{weight.name} holds {nan} NaN value(s)")
        return ok
    # NVFP4
    if not _expect(weight, "U8", None, problems, "NVFP4 packed E2M1 pairs"):
        return False
    if len(weight.shape) < 2:
        problems.append(f"{weight.name} has shape {list(weight.shape)}, expected at least 2 dims")
        return False
    codes = 2 * weight.shape[-1]
    if codes % group_size:
        problems.append(f"{weight.name} holds {codes} codes per row, not a multiple of group_size {group_size}")
        return False
    ok = _expect(leaves["weight_scale"], "F8_E4M3", (*weight.shape[:-1], codes // group_size), problems,
                 f"NVFP4 per-{group_size}-block scale of {weight.name}")
    if ok:
        _check_positive(f"{module}.weight_scale", tensors, problems)
    if "weight_scale_2" not in leaves:
        problems.append(f"{module}.weight_scale_2 is missing (an NVFP4 weight needs its per-tensor scale)")
        return False
    if _expect(leaves["weight_scale_2"], "F32", (), problems, "NVFP4 per-tensor scale"):
        _check_positive(f"{module}.weight_scale_2", tensors, problems)
        return ok
    return False


def _check_quant_layout(
    entries: dict[str, _Entry], spec: _QuantSpec, tensors: _Tensors, problems: list[str]
) -> dict[str, tuple[str, int, bool]]:
    """Check every module's tensors against the config.

    Returns quantized weight name -> (algo, group size, whether its tensors are well-formed).
    """
    modules: dict[str, dict[str, _Entry]] = defaultdict(dict)
    for key, entry in entries.items():
        module, _, leaf = key.rpartition(".")
        modules[module][leaf] = entry
    quantized = {}
    for module in sorted(modules):
        leaves, fmt = modules[module], spec.format_for(module)
        weight = leaves.get("weight")
        for leaf in KV_SCALES:
            if leaf in leaves:
                if spec.kv_cache is None:
                    problems.append(f"orphan scale {module}.{leaf}: the config has no kv_cache_quant_algo")
                else:
                    _expect(leaves[leaf], "F32", (), problems, "KV-cache scale")
        if "weight_scale" not in leaves:
            problems.extend(
                f"orphan scale {module}.{leaf}: {module} has no weight_scale"
                for leaf in WEIGHT_COMPANIONS if leaf in leaves
            )
            if weight is None:
                continue
            if weight.dtype.startswith("F8_"):
                problems.append(f"{weight.name} is {weight.dtype} but {module}.weight_scale is missing")
            elif fmt is not None and len(weight.shape) == 2 and weight.dtype in _FLOAT_DTYPES:
                problems.append(
                    f"{weight.name} is unquantized {weight.dtype} but {module} is not in exclude_modules "
                    f"(the config quantizes it as {fmt[0]})"
                )
            continue
        present = ", ".join(f"{module}.{leaf}" for leaf in WEIGHT_COMPANIONS if leaf in leaves)
        if weight is None:
            problems.append(f"orphan scale(s) {present}: {module}.weight is missing")
        elif spec.excluded(module):
            problems.append(f"{module} matches exclude_modules but has quantized tensors ({present})")
        elif fmt is None:
            problems.append(f"{module} has quantized tensors ({present}) but the quantization config leaves it out")
        elif fmt[0] in SUPPORTED_ALGOS:
            try:
                quantized[weight.name] = (*fmt, _check_quantized_module(module, leaves, *fmt, tensors, problems))
            except _Unreadable as e:
                problems.append(str(e))
                quantized[weight.name] = (*fmt, False)
    return quantized


# ---------------------------------------------------------------------------------------------------
# (4) comparison with the source


def _source_files(source_dir: Path) -> dict[str, str]:
    if not source_dir.is_dir():
        raise FileNotFoundError(f"source checkpoint {source_dir} is not a directory")
    index = source_dir / INDEX_NAME
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    files = sorted(p for p in source_dir.glob("*.safetensors") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no {INDEX_NAME} or *.safetensors in source checkpoint {source_dir}")
    out: dict[str, str] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out.setdefault(key, path.name)
    return out


def source_name(export_key: str) -> str:
    """The source name of an export tensor: the first matching rule of ``RENAMES``, else the name itself."""
    for pattern, replacement in RENAMES:
        if pattern.match(export_key):
            return pattern.sub(replacement, export_key)
    return export_key


def _source_keys(export_key: str, source_files: Mapping[str, str]) -> tuple[str, ...] | None:
    """The source tensor of an export tensor: ``(name,)``, MXFP4 ``(packed, scale)``, or None."""
    name = source_name(export_key)
    if name in source_files:
        return (name,)
    packed, scale = f"{name}_packed", f"{name}_scale"
    if name.endswith(".weight") and packed in source_files and scale in source_files:
        return packed, scale
    return None


def _load_source(keys: tuple[str, ...], src: _Tensors, dtype: torch.dtype) -> torch.Tensor:
    """The source tensor; MXFP4 is dequantized to ``dtype``."""
    if len(keys) == 1:
        return src.get(keys[0])
    return dequantize_mxfp4(src.get(keys[0]), src.get(keys[1]), dtype)


def _bytes_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of elements whose bytes differ (same dtype and shape)."""
    size = a.element_size()
    a8 = a.contiguous().reshape(-1).view(torch.uint8).reshape(-1, size)
    b8 = b.contiguous().reshape(-1).view(torch.uint8).reshape(-1, size)
    return int((a8 != b8).any(dim=1).sum())


def _dequantize(key: str, algo: str, group_size: int, exp: _Tensors, w: torch.Tensor, problems: list[str]):
    """(dequantized float32 weight cropped to ``w``'s shape, per-element scale), or None after a problem."""
    module = key[: -len(".weight")]
    q = exp.get(key)
    if algo == "FP8":
        if tuple(q.shape) != tuple(w.shape):
            problems.append(f"{key} has shape {list(q.shape)}, source {list(w.shape)}")
            return None
        scale = exp.get(f"{module}.weight_scale").float()
        return q.float() * scale, scale.expand(w.shape)
    blocks = -(-w.shape[-1] // group_size)
    if tuple(q.shape) != (*w.shape[:-1], blocks * group_size // 2):
        problems.append(
            f"{key} has shape {list(q.shape)}, expected {[*w.shape[:-1], blocks * group_size // 2]} for the NVFP4 "
            f"packing of the source shape {list(w.shape)}"
        )
        return None
    block_scale = exp.get(f"{module}.weight_scale").float() * exp.get(f"{module}.weight_scale_2").float()
    scale = block_scale.repeat_interleave(group_size, dim=-1)[..., : w.shape[-1]]
    values = E2M1_VALUES[unpack_e2m1(q).long()][..., : w.shape[-1]]
    return values * scale, scale


def _check_bound(
    key: str, algo: str, group_size: int, exp: _Tensors, w: torch.Tensor, tolerance: float,
    stats: dict[str, list[float]], problems: list[str],
) -> None:
    w = w.float()
    out = _dequantize(key, algo, group_size, exp, w, problems)
    if out is None:
        return
    deq, scale = out
    w_abs = w.abs()
    if algo == "FP8":
        bound = (FP8_REL_ROUNDING + EXPORT_ROUNDING) * w_abs + FP8_SUBNORMAL_HALF_STEP * scale
    else:
        x = w_abs / scale
        half_step = torch.where(
            x < E2M1_STEP_EDGES[0], E2M1_HALF_STEPS[0], torch.where(x < E2M1_STEP_EDGES[1], *E2M1_HALF_STEPS[1:])
        )
        bound = half_step * scale + EXPORT_ROUNDING * w_abs
    bound = tolerance * bound
    err = (deq - w).abs()
    bad = ~(err <= bound)  # NaN counts as a violation
    if bool(bad.any()):
        first = tuple(torch.nonzero(bad)[0].tolist())
        problems.append(
            f"{key}: {int(bad.sum())} of {w.numel()} values exceed the {algo} error bound; first at {list(first)}: "
            f"dequantized {deq[first].item():.6g}, source {w[first].item():.6g}, bound {bound[first].item():.3g}"
        )
    finite = torch.isfinite(err) & (bound > 0)
    ratio = float((err[finite] / bound[finite]).max()) if bool(finite.any()) else 0.0
    rel = float(err.max() / w_abs.max()) if float(w_abs.max()) > 0 else float(err.max())
    worst = stats.setdefault(algo, [0.0, 0.0])
    worst[0], worst[1] = max(worst[0], rel), max(worst[1], ratio)


def _compare_with_source(
    entries: dict[str, _Entry], quantized: Mapping[str, tuple[str, int, bool]], exp: _Tensors, src: _Tensors,
    tolerance: float, stats: dict[str, list[float]], problems: list[str],
) -> None:
    covered: set[str] = set()
    for key in sorted(entries):
        if key.rpartition(".")[2] in WEIGHT_COMPANIONS + KV_SCALES:
            continue  # scales have no source counterpart; orphans were reported by the layout check
        keys = _source_keys(key, src.files)
        if keys is None:
            problems.append(f"export tensor {key} has no source tensor {source_name(key)} (plain or MXFP4)")
            continue
        covered.update(keys)
        try:
            if key in quantized:
                algo, group_size, well_formed = quantized[key]
                if well_formed:  # malformed ones were reported by the layout check
                    w = _load_source(keys, src, torch.float32)
                    _check_bound(key, algo, group_size, exp, w, tolerance, stats, problems)
                continue
            t = exp.get(key)
            w = _load_source(keys, src, t.dtype)
        except _Unreadable as e:
            problems.append(str(e))
            continue
        if t.dtype != w.dtype or tuple(t.shape) != tuple(w.shape):
            problems.append(f"{key} is {t.dtype} {list(t.shape)}, source {keys[0]} is {w.dtype} {list(w.shape)}")
        elif n := _bytes_differ(t, w):
            problems.append(f"{key} is not bit-exact to source {keys[0]}: {n} of {t.numel()} elements differ")
    problems.extend(f"source tensor {key} is missing from the export" for key in sorted(set(src.files) - covered))


# ---------------------------------------------------------------------------------------------------
# (5) manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(export_dir: Path) -> dict[str, str]:
    """sha256 of every file under ``export_dir`` but the manifest, by POSIX path relative to it."""
    return {
        p.relative_to(export_dir).as_posix(): _sha256(p)
        for p in sorted(export_dir.rglob("*"))
        if p.is_file() and p.relative_to(export_dir).as_posix() != MANIFEST_NAME
    }


def _check_manifest(path: Path, digests: Mapping[str, str], problems: list[str]) -> None:
    listed: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        m = _MANIFEST_LINE.match(line)
        if m is None:
            problems.append(f"{MANIFEST_NAME} line {number} is not 'sha256  filename': {line[:80]!r}")
        else:
            listed[m.group(2)] = m.group(1)
    for name, digest in sorted(listed.items()):
        if name not in digests:
            problems.append(f"{name} is listed in {MANIFEST_NAME} but missing")
        elif digests[name] != digest:
            problems.append(f"{name} changed since {MANIFEST_NAME} was written (sha256 {digests[name]}, was {digest})")
    problems.extend(f"{name} is not listed in {MANIFEST_NAME}" for name in sorted(set(digests) - set(listed)))


def _write_manifest(export_dir: Path, digests: Mapping[str, str]) -> None:
    tmp = export_dir / f".{MANIFEST_NAME}.tmp"
    tmp.write_text("".join(f"{digests[name]}  {name}\n" for name in sorted(digests)))
    tmp.replace(export_dir / MANIFEST_NAME)


# ---------------------------------------------------------------------------------------------------


def verify_export(
    export_dir: str | Path,
    source_dir: str | Path | None = None,
    *,
    tolerance_factor: float = 1.0,
    write_manifest: bool = False,
) -> VerifyReport:
    """Verify a unified-HF export; raise `ExportInvalid` listing every problem, else return the report.

    Checks: (1) index and shards agree exactly (each index entry is in the shard it names, each shard
    tensor is in the index, every shard is referenced, ``total_size`` matches; a single file needs no
    index); (2) every tensor is named once (within a header and across shards); (3) dtypes and shapes
    follow the quantization config (see the module docstring): quantized weights carry their scales,
    modules in ``exclude_modules`` carry none, no scale lacks its weight, no 2-D float weight of a module
    the config quantizes is left unquantized, scales are finite and positive, FP8 weights hold no NaN;
    (4) with ``source_dir``: every export tensor has its source tensor (``RENAMES``; MXFP4 sources are
    dequantized first) and every source tensor is exported; unquantized tensors are bit-exact (dtype and
    bytes); quantized weights dequantize within the format's bound, times ``tolerance_factor``:

    * FP8: ModelOpt stores ``fp8(w / s)``, ``s = amax / 448``, dividing in the export dtype (bf16) and
      rounding to nearest E4M3 (3 mantissa bits). Normals (``|w/s| >= 2**-6``) round within ``2**-4``
      relative; subnormals within half their step, ``2**-10`` in units of ``s``. The source's rounding to
      bf16 and the bf16 division add ``2**-9`` each. Bound: ``(2**-4 + 2**-8)*|w| + 2**-10*s``.
    * NVFP4: per block, ``s_b = weight_scale[b] * weight_scale_2`` (the stored values) and ``x = w / s_b``
      rounds to the nearest E2M1 value ``{0, .5, 1, 1.5, 2, 3, 4, 6}``; half the step is ``h(x) = 1/4``
      below 2, ``1/2`` in [2, 4), 1 from 4 up. ModelOpt rounds ``amax_b / (6 * weight_scale_2)`` to E4M3
      (<= ``2**-4`` relative), so ``|x| <= 6 / (1 - 2**-4) = 6.4`` and saturation at 6 stays below ``h = 1``.
      Bound: ``h(|w|/s_b)*s_b + 2**-8*|w|`` (the last term for the bf16 rounding of the source and fp32
      arithmetic).

    (5) ``MANIFEST.sha256`` (``sha256  path`` per file, sorted): when it exists and ``write_manifest`` is
    false, every file must match it, none may be missing or unlisted. With ``write_manifest`` the old
    manifest is replaced, but only when every other check passed.
    """
    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise FileNotFoundError(f"export directory {export_dir} does not exist or is not a directory")
    if not (isinstance(tolerance_factor, (int, float)) and math.isfinite(tolerance_factor) and tolerance_factor > 0):
        raise ValueError(f"tolerance_factor must be a finite number > 0, got {tolerance_factor!r}")
    problems: list[str] = []
    digests = file_digests(export_dir)
    manifest_path = export_dir / MANIFEST_NAME
    manifest = "absent"
    if manifest_path.is_file() and not write_manifest:
        _check_manifest(manifest_path, digests, problems)
        manifest = "checked"
    shards, entries, tensor_bytes = _check_layout(export_dir, problems)
    spec = _read_quant_spec(export_dir, problems)
    source_files = None if source_dir is None else _source_files(Path(source_dir))
    stats: dict[str, list[float]] = {}
    with ExitStack() as stack:
        exp = _Tensors(export_dir, {k: e.file for k, e in entries.items()}, stack)
        quantized = _check_quant_layout(entries, spec, exp, problems)
        if source_files is not None:
            src = _Tensors(Path(source_dir), source_files, stack)
            _compare_with_source(entries, quantized, exp, src, tolerance_factor, stats, problems)
    counts: dict[str, int] = defaultdict(int)
    for algo, _, _ in quantized.values():
        counts[algo] += 1
    if write_manifest:
        if problems:
            manifest = "not written"
            logger.warning("not writing %s: the export has %d problem(s)", manifest_path, len(problems))
        else:
            _write_manifest(export_dir, digests)
            manifest = "written"
    report = VerifyReport(
        export_dir=str(export_dir),
        source_dir=None if source_dir is None else str(source_dir),
        files=len(shards),
        tensors_checked=len(entries),
        tensor_bytes=tensor_bytes,
        quantized=MappingProxyType(dict(counts)),
        max_rel_error=MappingProxyType({algo: v[0] for algo, v in stats.items()}),
        max_bound_ratio=MappingProxyType({algo: v[1] for algo, v in stats.items()}),
        manifest=manifest,
        problems=tuple(problems),
    )
    if problems:
        logger.warning("export %s failed verification with %d problem(s)", export_dir, len(problems))
        raise ExportInvalid(report)
    logger.info("%s", report.summary())
    return report

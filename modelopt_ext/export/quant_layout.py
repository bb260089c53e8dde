"""Check (3) of `verify_export`: dtypes and shapes of the tensors against the quantization config."""

from __future__ import annotations

import fnmatch
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import torch

from modelopt_ext.export.tensors import _Entry, _load_json, _Tensors, _Unreadable

HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
SUPPORTED_ALGOS = ("FP8", "NVFP4")
NVFP4_DEFAULT_GROUP_SIZE = 16
WEIGHT_COMPANIONS = ("weight_scale", "weight_scale_2", "input_scale")
KV_SCALES = ("k_scale", "v_scale")
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


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


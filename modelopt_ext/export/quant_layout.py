"""Check (3) of `verify_export`: dtypes and shapes of the tensors against the quantization config."""

from __future__ import annotations

import fnmatch
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import torch

from modelopt_ext.export.tensors import _Entry, _load_json, _Tensors, _Unreadable

HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
FP8_ALGOS = ("FP8", "FP8_PB_WO")  # E4M3 weight times an F32 scale: per tensor, per 2-D block
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")  # packed E2M1 weight, E4M3 block scales, F32 per-tensor scale
SUPPORTED_ALGOS = FP8_ALGOS + NVFP4_ALGOS
WEIGHT_ONLY_ALGOS = ("FP8_PB_WO", "W4A16_NVFP4")  # no input_scale
# Algorithm names are compared upper-cased, as the engines do (ModelOpt 0.47 writes `fp8_pb_wo`; the exporter
# here writes `FP8_PB_WO`). FP8_PB_WO block edge (rows and columns). ModelOpt 0.47 records no block size for
# it in either config (the exporter here writes `group_size: 128` per layer);
# its preset FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG and the recipes here use 128 x 128.
FP8_PB_BLOCK = 128
NVFP4_DEFAULT_GROUP_SIZE = 16
WEIGHT_COMPANIONS = ("weight_scale", "weight_scale_2", "input_scale")
KV_SCALES = ("k_scale", "v_scale")
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


@dataclass(frozen=True)
class _QuantSpec:
    algo: str | None  # one of SUPPORTED_ALGOS, MIXED_PRECISION, another ModelOpt name, or None (nothing quantized)
    group_size: int
    exclude: tuple[str, ...]
    layers: Mapping[str, tuple[str, int]]  # MIXED_PRECISION: module -> (algo, group_size)
    kv_cache: str | None

    def excluded(self, module: str) -> bool:
        return any(fnmatch.fnmatchcase(module, pattern) for pattern in self.exclude)

    def format_for(self, module: str) -> tuple[str, int] | None:
        """(algo, group size) of a module: None when excluded; under MIXED_PRECISION the entry of
        ``quantized_layers`` for the module itself or else its nearest listed ancestor (an entry for fused
        experts ``...experts`` covers the per-expert linears ``...experts.{e}.w1``), None when neither is listed."""
        if self.algo is None or self.excluded(module):
            return None
        if self.algo != "MIXED_PRECISION":
            return self.algo, self.group_size
        name = module
        while name not in self.layers:
            if "." not in name:
                return None
            name = name.rpartition(".")[0]
        return self.layers[name]


def fp8_pb_grid(shape: tuple[int, ...]) -> tuple[int, int]:
    """(scale rows, scale cols) of an FP8_PB_WO weight of 2-D ``shape``: one scale per started block."""
    rows, cols = shape
    return math.ceil(rows / FP8_PB_BLOCK), math.ceil(cols / FP8_PB_BLOCK)


def _same_grid(shape: tuple[int, ...], grid: tuple[int, ...]) -> bool:
    """Whether a block-scale tensor of ``shape`` holds ``grid`` in row-major order. ModelOpt keeps the
    calibration amax's shape: ``[R, 1, C, 1]``, or ``[]`` for one block; ``[R, C]`` is accepted too."""
    return [d for d in shape if d != 1] == [d for d in grid if d != 1]


def canonical_algo(algo):
    """An algorithm name as the engines compare it (they upper-case what they read)."""
    return algo.upper() if isinstance(algo, str) else algo


def _group_size(qc: Mapping, default):
    """The first ``weights.group_size`` of ``config_groups`` (compressed-tensors style), else ``default``."""
    groups = qc.get("config_groups")
    for group in groups.values() if isinstance(groups, dict) else ():
        weights = group.get("weights") if isinstance(group, dict) else None
        size = weights.get("group_size") if isinstance(weights, dict) else None
        if size is not None:
            return size
    return default


def _positive_int(value, default: int, what: str, problems: list[str]) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        problems.append(f"{what} is {value!r}, expected a positive integer")
        return default
    return value


def _quantized_layers(layers, where: str, problems: list[str]) -> dict[str, tuple[str, int]]:
    """module -> (algo, group size) from a ``quantized_layers`` object; malformed entries are problems."""
    if not isinstance(layers, dict):
        problems.append(f"{where} quantized_layers is {type(layers).__name__}, expected an object")
        return {}
    out = {}
    for module, cfg in layers.items():
        if not isinstance(cfg, dict):
            problems.append(f"{where} quantized_layers[{module}] is {cfg!r}, expected an object")
            continue
        algo = canonical_algo(cfg.get("quant_algo"))
        if algo not in SUPPORTED_ALGOS:
            problems.append(f"{where} quantized_layers[{module}]: quant_algo {algo!r} is not supported here")
        size = _positive_int(cfg.get("group_size"), NVFP4_DEFAULT_GROUP_SIZE,
                             f"{where} quantized_layers[{module}].group_size", problems)
        out[module] = (algo, size)
    return out


def _names(value, what: str, problems: list[str]) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        problems.append(f"{what} is {value!r}, expected a list of module names")
        return []
    return value


def _read_quant_spec(export_dir: Path, problems: list[str]) -> _QuantSpec:
    hf = _load_json(export_dir / HF_QUANT_CONFIG_NAME, problems)
    config = _load_json(export_dir / "config.json", problems)
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    nested = (config.get("text_config") or {}).get("quantization_config") if isinstance(config, dict) else None
    if nested is not None:
        problems.append(
            "config.json text_config.quantization_config is still set (quant_method "
            f"{nested.get('quant_method') if isinstance(nested, dict) else nested!r}): engines that read the text "
            "config would take the export for the source's format"
        )
    where = HF_QUANT_CONFIG_NAME
    if hf is not None:
        q = hf.get("quantization") if isinstance(hf, dict) else None
        if not isinstance(q, dict):
            problems.append(f"{HF_QUANT_CONFIG_NAME}: no 'quantization' object")
            q = {}
        algo, kv = canonical_algo(q.get("quant_algo")), q.get("kv_cache_quant_algo")
        exclude = _names(q.get("exclude_modules"), f"{where} exclude_modules", problems)
        group_size = _positive_int(q.get("group_size"), NVFP4_DEFAULT_GROUP_SIZE, f"{where} group_size", problems)
        layers = q.get("quantized_layers") or {}
    elif isinstance(qc, dict):
        where = "config.json quantization_config"
        algo, kv = canonical_algo(qc.get("quant_algo")), qc.get("kv_cache_scheme") or None
        layers = qc.get("quantized_layers") or {}
        exclude = _names(qc.get("ignore"), f"{where}.ignore", problems)
        group_size = _positive_int(_group_size(qc, None), NVFP4_DEFAULT_GROUP_SIZE, f"{where} group_size", problems)
    else:
        algo, exclude, group_size, layers, kv = None, [], NVFP4_DEFAULT_GROUP_SIZE, {}, None
    per_layer = _quantized_layers(layers, where, problems)
    if hf is not None and not isinstance(qc, dict):
        if algo is not None:
            problems.append(f"config.json has no quantization_config although {HF_QUANT_CONFIG_NAME} sets {algo}")
    elif hf is not None:
        if canonical_algo(qc.get("quant_algo")) != algo:
            problems.append(
                f"config.json quantization_config.quant_algo {qc.get('quant_algo')!r} != "
                f"{HF_QUANT_CONFIG_NAME} quant_algo {algo!r}"
            )
        ignore = set(_names(qc.get("ignore"), "config.json quantization_config.ignore", problems))
        if ignore != set(exclude):
            problems.append(
                f"config.json quantization_config.ignore and {HF_QUANT_CONFIG_NAME} exclude_modules differ: "
                f"only in ignore {sorted(ignore - set(exclude))}, only in exclude_modules "
                f"{sorted(set(exclude) - ignore)}"
            )
        if algo in NVFP4_ALGOS and _group_size(qc, group_size) != group_size:
            problems.append(
                f"config.json quantization_config group_size {_group_size(qc, group_size)} != "
                f"{HF_QUANT_CONFIG_NAME} group_size {group_size}"
            )
        if "quantized_layers" in qc and qc["quantized_layers"] != layers:
            problems.append(f"config.json quantization_config.quantized_layers differs from {HF_QUANT_CONFIG_NAME}'s")
    if isinstance(qc, dict) and qc.get("quant_method") not in ("modelopt", "modelopt_mixed"):
        method = qc.get("quant_method")
        problems.append(f"config.json quantization_config.quant_method is {method!r}, expected 'modelopt' or "
                        "'modelopt_mixed'")
    if algo not in (None, "MIXED_PRECISION", *SUPPORTED_ALGOS):
        supported = ", ".join((*SUPPORTED_ALGOS, "MIXED_PRECISION"))
        problems.append(f"quant_algo {algo!r} is not supported here (supported: {supported})")
    if per_layer and algo != "MIXED_PRECISION":
        problems.append(f"{where} lists quantized_layers but quant_algo is {algo!r}, not 'MIXED_PRECISION'")
    return _QuantSpec(algo, group_size, tuple(exclude), MappingProxyType(per_layer), kv)


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


def _check_fp8_module(module: str, leaves: dict[str, _Entry], algo: str, tensors: _Tensors, problems: list[str]):
    weight, scale = leaves["weight"], leaves["weight_scale"]
    ok = _expect(weight, "F8_E4M3", None, problems, f"{algo} weight")
    if algo == "FP8":
        ok &= _expect(scale, "F32", (), problems, "FP8 per-tensor weight scale")
    elif _expect(scale, "F32", None, problems, f"{algo} block scale"):
        if len(weight.shape) != 2:
            problems.append(f"{weight.name} has shape {list(weight.shape)}, expected 2 dims ({algo} 2-D blocks)")
            return False
        grid = fp8_pb_grid(weight.shape)
        if not _same_grid(scale.shape, grid):
            problems.append(
                f"{scale.name} has shape {list(scale.shape)}, expected {list(grid)} (one {algo} scale per "
                f"{FP8_PB_BLOCK}x{FP8_PB_BLOCK} block of {weight.name} {list(weight.shape)})"
            )
            ok = False
    else:
        ok = False
    if "weight_scale_2" in leaves:
        problems.append(f"orphan scale {module}.weight_scale_2: an {algo} weight has no second-level scale")
    if ok:
        _check_positive(scale.name, tensors, problems)
        nan = int(torch.isnan(tensors.get(weight.name).float()).sum())
        if nan:
            problems.append(f"{weight.name} holds {nan} NaN value(s)")
    return ok


def _check_nvfp4_module(
    module: str, leaves: dict[str, _Entry], algo: str, group_size: int, tensors: _Tensors, problems: list[str]
) -> bool:
    weight = leaves["weight"]
    if not _expect(weight, "U8", None, problems, f"{algo} packed E2M1 pairs"):
        return False
    if len(weight.shape) < 2:
        problems.append(f"{weight.name} has shape {list(weight.shape)}, expected at least 2 dims")
        return False
    codes = 2 * weight.shape[-1]
    if codes % group_size:
        problems.append(f"{weight.name} holds {codes} codes per row, not a multiple of group_size {group_size}")
        return False
    ok = _expect(leaves["weight_scale"], "F8_E4M3", (*weight.shape[:-1], codes // group_size), problems,
                 f"{algo} per-{group_size}-block scale of {weight.name}")
    if ok:
        _check_positive(f"{module}.weight_scale", tensors, problems)
    if "weight_scale_2" not in leaves:
        problems.append(f"{module}.weight_scale_2 is missing (an {algo} weight needs its per-tensor scale)")
        return False
    if _expect(leaves["weight_scale_2"], "F32", (), problems, f"{algo} per-tensor scale"):
        _check_positive(f"{module}.weight_scale_2", tensors, problems)
        return ok
    return False


def _check_quantized_module(
    module: str, leaves: dict[str, _Entry], algo: str, group_size: int, tensors: _Tensors, problems: list[str]
) -> bool:
    """Check one quantized module's tensors; True when their dtypes and shapes allow dequantization."""
    if "input_scale" in leaves:
        if algo in WEIGHT_ONLY_ALGOS:
            problems.append(f"orphan scale {module}.input_scale: {algo} is weight-only")
        elif _expect(leaves["input_scale"], "F32", (), problems, f"{algo} input scale"):
            _check_positive(f"{module}.input_scale", tensors, problems)
    if algo in FP8_ALGOS:
        return _check_fp8_module(module, leaves, algo, tensors, problems)
    return _check_nvfp4_module(module, leaves, algo, group_size, tensors, problems)


def _quantized_as(spec: _QuantSpec, module: str, fmt: tuple[str, int]) -> str:
    if spec.algo != "MIXED_PRECISION":
        return f"{module} is not in exclude_modules (the config quantizes it as {fmt[0]})"
    listed = module
    while listed not in spec.layers:
        listed = listed.rpartition(".")[0]
    return f"quantized_layers lists {listed} as {fmt[0]}"


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
            if weight.dtype.startswith("F8_") or (fmt is not None and weight.dtype == "U8"):
                why = f" (the config quantizes it as {fmt[0]})" if weight.dtype == "U8" else ""
                problems.append(f"{weight.name} is {weight.dtype} but {module}.weight_scale is missing{why}")
            elif fmt is not None and len(weight.shape) == 2 and weight.dtype in _FLOAT_DTYPES:
                problems.append(f"{weight.name} is unquantized {weight.dtype} but {_quantized_as(spec, module, fmt)}")
            continue
        present = ", ".join(f"{module}.{leaf}" for leaf in WEIGHT_COMPANIONS if leaf in leaves)
        if weight is None:
            problems.append(f"orphan scale(s) {present}: {module}.weight is missing")
        elif spec.excluded(module):
            problems.append(f"{module} matches exclude_modules but has quantized tensors ({present})")
        elif fmt is None:
            why = "neither it nor an ancestor is in quantized_layers" if spec.algo == "MIXED_PRECISION" else (
                "the quantization config leaves it out")
            problems.append(f"{module} has quantized tensors ({present}) but {why}")
        elif fmt[0] in SUPPORTED_ALGOS:
            try:
                well_formed = _check_quantized_module(module, leaves, *fmt, tensors, problems)
            except _Unreadable as e:
                problems.append(str(e))
                well_formed = False
            except Exception as e:  # a malformed tensor must not stop the other checks
                problems.append(f"{module}: cannot check its {fmt[0]} tensors ({type(e).__name__}: {e})")
                well_formed = False
            quantized[weight.name] = (*fmt, well_formed)
    return quantized


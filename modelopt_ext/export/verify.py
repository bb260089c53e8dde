"""Verify a quantized checkpoint in ModelOpt's unified Hugging Face format.

The format, as ``modelopt.torch.export.export_hf_checkpoint`` (nvidia-modelopt 0.47) and the per-rank
exporter (`modelopt_ext.export.writer`) write it:

* safetensors shards with ``model.safetensors.index.json`` (``weight_map``: tensor -> shard file;
  ``metadata.total_size``: the sum of the tensors' data bytes), or one file without an index;
* ``hf_quant_config.json``: ``quantization.quant_algo`` (one format of ``SUPPORTED_ALGOS`` for every
  quantized module, or ``MIXED_PRECISION``), ``group_size``, ``exclude_modules`` (exact names and prefix
  wildcards such as ``vision_tower*``), ``kv_cache_quant_algo``; under ``MIXED_PRECISION``,
  ``quantized_layers`` maps a module to its ``{quant_algo, group_size}``, and an entry applies to the
  module and to every module below it that is not listed itself (an entry for fused experts
  ``...block_sparse_moe.experts`` covers the per-expert linears ``...experts.{e}.w1``); the same again
  in compressed-tensors style as ``config.json``'s ``quantization_config`` (``quant_algo``, ``ignore``,
  ``config_groups``, ``quantized_layers``, ``quant_method: modelopt``);
* for every quantized linear ``M`` (``M.input_scale`` F32 ``[]`` is absent when the input was never
  calibrated, and always for the weight-only ``FP8_PB_WO`` and ``W4A16_NVFP4``):

  - ``FP8``: ``M.weight`` F8_E4M3 ``[..., I]``, ``M.weight_scale`` F32 ``[]``, no ``M.weight_scale_2``;
  - ``FP8_PB_WO`` (FP8 weight-only, 2-D blocks of ``FP8_PB_BLOCK`` = 128 rows x 128 columns; neither
    config records the block size): ``M.weight`` F8_E4M3 ``[O, I]``, ``M.weight_scale`` F32 with one
    value per started block, ``ceil(O/128) x ceil(I/128)`` in row-major order, in the shape of
    ModelOpt's calibration amax: ``[ceil(O/128), 1, ceil(I/128), 1]``, or ``[]`` for a single block
    (``[ceil(O/128), ceil(I/128)]`` is accepted too); no ``M.weight_scale_2``;
  - ``NVFP4`` and ``W4A16_NVFP4``: ``M.weight`` U8 ``[..., I/2]``, ``M.weight_scale`` F8_E4M3
    ``[..., B]``, ``M.weight_scale_2`` F32 ``[]``.

  FP8 dequantizes as ``weight * weight_scale`` (the block's scale for ``FP8_PB_WO``). NVFP4 packs two
  E2M1 codes per byte, element ``2j`` in the LOW nibble and ``2j+1`` in the high one (the same order as
  MXFP4 in ``modelopt_ext.formats.mxfp4``), and dequantizes as
  ``E2M1[code] * weight_scale[block] * weight_scale_2``;
* every other tensor keeps its source name, dtype and bytes, except for the renames in ``RENAMES``
  (ModelOpt's own exporter names experts ``gate/up/down_proj``; the per-rank exporter keeps ``w1/w3/w2``).

Shape legend: ``...`` leading dims (output features, experts), ``O`` output and ``I`` input features,
``B`` NVFP4 blocks ``ceil(I / group_size)`` (the packed weight holds ``B * group_size`` codes; padding,
if any, is cropped).
"""

from __future__ import annotations

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

from modelopt_ext.export.bounds import (
    E2M1_HALF_STEPS,
    E2M1_STEP_EDGES,
    EXPORT_ROUNDING,
    FP8_REL_ROUNDING,
    FP8_SUBNORMAL_HALF_STEP,
    _check_bound,
)
from modelopt_ext.export.layout import INDEX_NAME, check_layout
from modelopt_ext.export.manifest import (
    MANIFEST_NAME,
    _check_manifest,
    _write_manifest,
    file_digests,
)
from modelopt_ext.export.quant_layout import (
    FP8_PB_BLOCK,
    HF_QUANT_CONFIG_NAME,
    KV_SCALES,
    NVFP4_DEFAULT_GROUP_SIZE,
    SUPPORTED_ALGOS,
    WEIGHT_COMPANIONS,
    _check_quant_layout,
    _read_quant_spec,
)
from modelopt_ext.export.tensors import _Entry, _Tensors, _Unreadable
from modelopt_ext.formats.fp8_block import dequantize_blocks
from modelopt_ext.formats.mxfp4 import E2M1_VALUES, dequantize_mxfp4, unpack_e2m1

__all__ = [
    "E2M1_HALF_STEPS", "E2M1_STEP_EDGES", "E2M1_VALUES", "EXPORT_ROUNDING", "FP8_PB_BLOCK", "FP8_REL_ROUNDING",
    "FP8_SUBNORMAL_HALF_STEP", "HF_QUANT_CONFIG_NAME", "INDEX_NAME", "KV_SCALES", "MANIFEST_NAME",
    "NVFP4_DEFAULT_GROUP_SIZE", "RENAMES", "SUPPORTED_ALGOS", "WEIGHT_COMPANIONS", "ExportInvalid",
    "VerifyReport", "dequantize_mxfp4", "file_digests", "source_name", "unpack_e2m1", "verify_export",
]

logger = logging.getLogger(__name__)

# Export name -> source name, first match wins; every other export tensor keeps its source name. A source
# tensor ``X.weight`` is stored either as is or as MXFP4 (``X.weight_packed`` + ``X.weight_scale``).
RENAMES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"^(.+\.experts\.\d+)\.gate_proj\.weight$"), r"\1.w1.weight"),
    (re.compile(r"^(.+\.experts\.\d+)\.up_proj\.weight$"), r"\1.w3.weight"),
    (re.compile(r"^(.+\.experts\.\d+)\.down_proj\.weight$"), r"\1.w2.weight"),
)


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
    Both are empty without a source. ``manifest``: ``written``, ``checked``, ``missing`` (a problem) or
    ``not written`` (with ``write_manifest``, when another check failed).
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


def _source_keys(export_key: str, source_files: Mapping[str, str], src: _Tensors | None = None
                 ) -> tuple[str, ...] | None:
    """The source tensor of an export tensor (its own name, else the ``RENAMES`` one): ``(name,)``, MXFP4
    ``(packed, scale)``, FP8 128x128 blocks ``(weight, weight_scale_inv)`` (an F8_E4M3 weight with its scales), or
    None."""
    for name in dict.fromkeys((export_key, source_name(export_key))):
        scale_inv = f"{name}_scale_inv"
        if name.endswith(".weight") and name in source_files and scale_inv in source_files and (
                src is None or src.dtype(name) == "F8_E4M3"):
            return name, scale_inv
        if name in source_files:
            return (name,)
        packed, scale = f"{name}_packed", f"{name}_scale"
        if name.endswith(".weight") and packed in source_files and scale in source_files:
            return packed, scale
    return None


def _load_source(keys: tuple[str, ...], src: _Tensors, dtype: torch.dtype) -> torch.Tensor:
    """The source tensor; MXFP4 and FP8 blocks are dequantized to ``dtype`` (FP8 blocks as transformers does:
    the float32 product, then cast)."""
    if len(keys) == 1:
        return src.get(keys[0])
    if keys[1].endswith("_scale_inv"):
        return dequantize_blocks(src.get(keys[0]), src.get(keys[1]), dtype)
    return dequantize_mxfp4(src.get(keys[0]), src.get(keys[1]), dtype)


def _bytes_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of elements whose bytes differ (same dtype and shape)."""
    size = a.element_size()
    a8 = a.contiguous().reshape(-1).view(torch.uint8).reshape(-1, size)
    b8 = b.contiguous().reshape(-1).view(torch.uint8).reshape(-1, size)
    return int((a8 != b8).any(dim=1).sum())


def _compare_one(
    key: str, keys: tuple[str, ...], quantized: Mapping[str, tuple[str, int, bool]], exp: _Tensors, src: _Tensors,
    tolerance: float, stats: dict[str, list[float]], problems: list[str],
) -> None:
    if key in quantized:
        algo, group_size, well_formed = quantized[key]
        if well_formed:  # malformed ones were reported by the layout check
            _check_bound(key, algo, group_size, exp, _load_source(keys, src, torch.float32), tolerance, stats, problems)
        return
    t = exp.get(key)
    if len(keys) == 2 and (not t.is_floating_point() or t.element_size() == 1):
        problems.append(
            f"{key} is {t.dtype} {list(t.shape)} without scales, but its source {keys[0]} is "
            f"{'FP8 blocks' if keys[1].endswith('_scale_inv') else 'MXFP4'}: "
            "an unquantized export of it must be a float tensor"
        )
        return
    w = _load_source(keys, src, t.dtype)
    if t.dtype != w.dtype or tuple(t.shape) != tuple(w.shape):
        problems.append(f"{key} is {t.dtype} {list(t.shape)}, source {keys[0]} is {w.dtype} {list(w.shape)}")
    elif n := _bytes_differ(t, w):
        problems.append(f"{key} is not bit-exact to source {keys[0]}: {n} of {t.numel()} elements differ")


def _compare_with_source(
    entries: dict[str, _Entry], quantized: Mapping[str, tuple[str, int, bool]], exp: _Tensors, src: _Tensors,
    tolerance: float, stats: dict[str, list[float]], problems: list[str],
) -> None:
    covered: set[str] = set()
    for key in sorted(entries):
        if key.rpartition(".")[2] in WEIGHT_COMPANIONS + KV_SCALES:
            continue  # scales have no source counterpart; orphans were reported by the layout check
        keys = _source_keys(key, src.files, src)
        if keys is None:
            problems.append(f"export tensor {key} has no source tensor {source_name(key)} (plain, MXFP4 or FP8 "
                            "blocks)")
            continue
        covered.update(keys)
        if key not in quantized and f"{key}_scale" in entries:
            continue  # quantized tensors the config does not cover: reported by the layout check
        try:
            _compare_one(key, keys, quantized, exp, src, tolerance, stats, problems)
        except _Unreadable as e:
            problems.append(str(e))
        except Exception as e:  # one malformed tensor must not stop the comparison of the others
            problems.append(f"{key}: cannot compare with source {', '.join(keys)} ({type(e).__name__}: {e})")
    problems.extend(f"source tensor {key} is missing from the export" for key in sorted(set(src.files) - covered))


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
    modules in ``exclude_modules`` carry none, modules with scales have a format (under
    ``MIXED_PRECISION``: they or an ancestor are in ``quantized_layers``), no scale lacks its weight, no
    2-D float weight of a module the config quantizes is left unquantized, scales are finite and
    positive, FP8 weights hold no NaN; (4) with ``source_dir``: every export tensor has its source tensor
    (``RENAMES``; MXFP4 sources are dequantized first) and every source tensor is exported; unquantized
    tensors are bit-exact (dtype and bytes); quantized weights dequantize within the format's bound, times
    ``tolerance_factor``:

    * FP8 and FP8_PB_WO: ModelOpt stores ``fp8(w / s)``, ``s = amax / 448`` (of the tensor, or of the
      128 x 128 block), dividing in the export dtype (bf16; fp32 for blocks) and rounding to nearest E4M3
      (3 mantissa bits). Normals (``|w/s| >= 2**-6``) round within ``2**-4`` relative; subnormals within
      half their step, ``2**-10`` in units of ``s``. The source's rounding to bf16 and the bf16 division
      add ``2**-9`` each. Bound: ``(2**-4 + 2**-8)*|w| + 2**-10*s``, ``s`` the element's own scale.
    * NVFP4 and W4A16_NVFP4: per block, ``s_b = weight_scale[b] * weight_scale_2`` (the stored values) and
      ``x = w / s_b`` rounds to the nearest E2M1 value ``{0, .5, 1, 1.5, 2, 3, 4, 6}``; half the step is
      ``h(x) = 1/4`` below 2, ``1/2`` in [2, 4), 1 from 4 up. ModelOpt rounds ``amax_b / (6 * weight_scale_2)``
      to E4M3 (<= ``2**-4`` relative), so ``|x| <= 6 / (1 - 2**-4) = 6.4`` and saturation at 6 stays below
      ``h = 1``. Bound: ``h(|w|/s_b)*s_b + 2**-8*|w|`` (the last term for the bf16 rounding of the source
      and fp32 arithmetic).

    A tensor that cannot be read or compared (wrong dtype, shape, a malformed source) is a problem naming
    it; the other checks go on.

    (5) ``MANIFEST.sha256`` (``sha256  path`` per file, sorted): unless ``write_manifest``, it must exist
    (modelopt-ext's exporter always writes it; without it the export is incomplete or not from
    modelopt-ext) and every file must match it, none may be missing or unlisted. With ``write_manifest``
    (for an export of ModelOpt's own ``export_hf_checkpoint``, which writes none) the manifest is written
    or replaced, but only when every other check passed.
    """
    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise FileNotFoundError(f"export directory {export_dir} does not exist or is not a directory")
    if not (isinstance(tolerance_factor, (int, float)) and math.isfinite(tolerance_factor) and tolerance_factor > 0):
        raise ValueError(f"tolerance_factor must be a finite number > 0, got {tolerance_factor!r}")
    problems: list[str] = []
    digests = file_digests(export_dir)
    manifest_path = export_dir / MANIFEST_NAME
    manifest = "not written"  # with write_manifest: "written" below, if every check passes
    if not write_manifest:
        manifest = "checked" if _check_manifest(manifest_path, digests, problems) else "missing"
    shards, entries, tensor_bytes = check_layout(export_dir, problems)
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
    logger.debug("%s", report.summary())  # callers print or log the summary
    return report

"""Per-rank export of a calibrated (EP) model to ModelOpt's unified Hugging Face checkpoint format.

    result = export_checkpoint(model, export_dir, source_dir=checkpoint, overwrite=False)

Collective under torch.distributed (every rank calls it; each step fails on every rank together):

1. plan: the file layout (`files.ExportFiles`, independent of the number of ranks), the export dtype and
   ModelOpt's quantization config (`hf_quant_config.json`), checked equal on every rank;
2. units, in a fixed order (everything outside the decoder layers, then each layer): the unit's tensors are
   made plain (`materialize`: FSDP-sharded ones gathered, expert-parallel ones kept local), ModelOpt's export
   handlers quantize its weights and split fused experts into per-expert tensors, experts are renamed to
   their global ids and the checkpoint's projection names (w1/w3/w2), each rank writes the files it owns
   (its experts' blocks; dense files round-robin) into a staging directory, and the unit is released; a
   rank's files are written on one thread of its own, then hashed (sha256, for the manifest) on HASH_THREADS
   more and at the same time flushed to the disk (fsync) on FLUSH_THREADS more, overlapped with the next
   unit's work and the next file's writing, at most MAX_PENDING_FILES queued for writing;
3. rank 0 writes the index, config.json (with `quantization_config`), hf_quant_config.json, the source's
   remote code, tokenizer and generation config, `write_extra`'s files and, last, MANIFEST.sha256 (hashing
   only the files it wrote itself in this step; the tensor files' digests come from their writers), flushes
   what it wrote and the directories to disk (every rank flushed its tensor files once each was hashed), then
   renames the staging directory to `export_dir` and flushes that rename: a crash cannot leave an export that
   looks finished with bytes still in the page cache.

Unquantized tensors keep the source checkpoint's dtype and bytes (a model loaded in float32 is cast back).
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import json
import logging
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from modelopt_ext.dist import agree, all_or_fail, gather_objects, in_group
from modelopt_ext.export.compat import KV_CACHE_MAX_BOUND, export_dtype, fused_property_weights, modelopt_export_api
from modelopt_ext.export.exact_cast import cast_pair, mxfp4_to_nvfp4
from modelopt_ext.export.expert_inputs import MODES as EXPERT_INPUT_MODES
from modelopt_ext.export.expert_inputs import expert_input_scales
from modelopt_ext.export.files import ExportFiles, check_experts_per_file, expert_key_renamer
from modelopt_ext.export.layout import INDEX_NAME, read_header
from modelopt_ext.export.manifest import _write_manifest, file_digests
from modelopt_ext.export.materialize import expert_offset, materialize, release
from modelopt_ext.export.serving import flat_quant_config, serving_quant_config
from modelopt_ext.export.source import SourceTensors
from modelopt_ext.export.staging import (
    copy_source_files,
    discard,
    drop_owner,
    fsync_path,
    interrupts_raise,
    publish,
    staging_dir,
    stale_dirs,
    sync_staging,
)
from modelopt_ext.export.target import ExportDirError, check_export_dir
from modelopt_ext.families import Checkpoint, FamilySpec, experts_module_glob
from modelopt_ext.lock import sha256_file

logger = logging.getLogger(__name__)
MAX_PENDING_FILES = 2  # files a rank's writing thread may have queued (host copies held meanwhile)
HASH_THREADS = 4  # threads hashing a rank's written files for the manifest (sha256 is ~1 GB/s a thread)
FLUSH_THREADS = 2  # threads flushing a rank's written files to the disk (fsync), beside the hashing
__all__ = ["ExportDirError", "ExportResult", "check_export_dir", "export_checkpoint"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class ExportResult:
    export_dir: Path
    files: int  # safetensors files
    tensors: int
    total_bytes: int  # tensor data bytes in the index
    bytes_written: tuple[int, ...]  # tensor data bytes each rank wrote
    seconds: float
    warnings: tuple[str, ...] = ()  # publishing: what of a replaced export could not be removed
    # routed-expert weights written as the exact NVFP4 cast of their MXFP4 source (export/exact_cast.py), and
    # those re-quantized by ModelOpt because their scales span more than E4M3 holds (named, all ranks)
    experts_exact: int = 0
    experts_requantized: tuple[str, ...] = ()
    # routed-expert input scales (export/expert_inputs.py): (expert, projection) pairs written from the
    # expert's own statistics, and those that kept the layer's shared scale (no calibration row)
    expert_inputs_own: int = 0
    expert_inputs_shared: tuple[str, ...] = ()
    # rank 0's seconds by part: "units" (the main thread: ModelOpt's handlers, the exact casts, the host copies),
    # "copies" (of those, the device -> host copies), "write" (the writing thread serializing files), "hash"
    # and "fsync" (the hashing threads, summed over threads)
    timing: dict[str, float] = dataclasses.field(default_factory=dict)
    # FP8_PB_WO weights written as the source's own FP8 blocks (export/source.py), the FP8-block source modules
    # whose ModelOpt output stayed, and the source layers carried over unquantized (FamilySpec.carried_layers)
    fp8_exact: int = 0
    fp8_requantized: tuple[str, ...] = ()
    carried: tuple[str, ...] = ()


def _file_plan(model: nn.Module, family: FamilySpec, experts_per_file: int | None, plan, carried: bool
               ) -> ExportFiles:
    layers, _, suffix = experts_module_glob(family).partition(".*.")
    container = model.get_submodule(layers)
    moe = tuple(i for i, layer in enumerate(container) if _has_submodule(layer, suffix))
    if not moe:
        raise ValueError(f"no decoder layer of the model has routed experts at {layers}.*.{suffix}")
    local = container[moe[0]].get_submodule(suffix).num_experts
    unquantized = [i for i in moe if not _experts_quantized(container[i].get_submodule(suffix))]
    if unquantized:
        raise ValueError(
            f"the routed experts of layers {unquantized} ({layers}.*.{suffix}) are not quantized by the recipe; the "
            "per-rank exporter writes quantized experts only (keep them MXFP4 in the source checkpoint instead)")
    if plan is not None:
        plan.check_calibration_supported("export")
    ep_size = plan.ep_size if plan is not None else 1
    per_file = check_experts_per_file(local * ep_size, ep_size, experts_per_file)
    return ExportFiles(layers, len(container), moe, suffix, local * ep_size, per_file, int(carried))


def _experts_quantized(experts: nn.Module) -> bool:
    quantizers = [q for p in ("gate_up_proj", "down_proj") for q in getattr(experts, f"{p}_weight_quantizers", ())]
    return bool(quantizers) and all(getattr(q, "is_enabled", False) for q in quantizers)


def _linear_modules(model: nn.Module, files: ExportFiles) -> list[str]:
    """Names of the model's linear modules (a 2-D weight; not embeddings, not the fused experts banks)."""
    experts = "." + files.experts_suffix
    out = []
    for name, module in model.named_modules():
        if experts in name + "." or isinstance(module, nn.Embedding):
            continue
        weight = module._parameters.get("weight")
        if weight is not None and weight.dim() == 2:
            out.append(name)
    return out


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False


def _refuse_cross_module_formats(quant_config: dict) -> None:
    """AWQ / SVDQuant exports need ModelOpt's pre-quant-scale fusion across modules (a dummy forward), which
    a unit-by-unit export does not do."""
    q = quant_config.get("quantization", {})
    algos = [q.get("quant_algo")] + [v.get("quant_algo") for v in (q.get("quantized_layers") or {}).values()]
    bad = sorted({a for a in algos if a and ("awq" in a.lower() or "svdquant" in a.lower())})
    if bad:
        raise ValueError(f"the per-rank exporter cannot write {bad} (pre-quant scales are fused across modules); "
                         "use a max-calibrated FP8/NVFP4 recipe")


@dataclasses.dataclass
class _Unit:
    layer: int | None  # None: everything outside the decoder layers
    modules: Callable[[], list[tuple[str, nn.Module]]]  # re-listed after handlers add per-expert modules


def _units(model: nn.Module, files: ExportFiles) -> list[_Unit]:
    container = model.get_submodule(files.layers)

    def rest():
        return [(n, m) for n, m in model.named_modules()
                if n != files.layers and not n.startswith(files.layers + ".")]

    def layer_modules(i):
        return lambda: [(f"{files.layers}.{i}" + (f".{n}" if n else ""), m) for n, m in container[i].named_modules()]

    return [_Unit(None, rest)] + [_Unit(i, layer_modules(i)) for i in range(files.num_layers)]


class _UnitExporter:
    """Exports units one at a time on this rank (see the module doc, step 2)."""

    def __init__(self, model, files: ExportFiles, family: FamilySpec, api, dtype, quant_config, source_dtypes,
                 staging: Path, rank: int, world: int, expert_inputs: str = "shared",
                 source_fp8: SourceTensors | None = None, carried: tuple[str, ...] = ()):
        self.model, self.files, self.api, self.dtype = model, files, api, dtype
        self.source_fp8, self.carried = source_fp8, carried
        self.expert_inputs = expert_inputs
        self.kv_format = quant_config["quantization"].get("kv_cache_quant_algo")
        self.source_dtypes, self.staging, self.rank, self.world = source_dtypes, staging, rank, world
        self.rename = expert_key_renamer(files.experts_suffix, family.export_expert_names)
        self.context = api.export_context(model=nn.Module(), dtype=dtype, is_modelopt_qlora=False)
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        self.tied = set(tied) if getattr(model.config.get_text_config(), "tie_word_embeddings", False) else set()
        self.names = dict(family.export_expert_names)
        self.written: dict[str, str] = {}
        # file -> its sha256: the file is written on `writer` (one thread, in order), then hashed on `hasher`
        # (HASH_THREADS) and flushed to the disk on `flusher` (FLUSH_THREADS) at the same time, overlapped with
        # the next unit's quantization and copies and the next file's writing; at most MAX_PENDING_FILES wait to
        # be written, bounding the host copies held
        self.files_done: dict[str, concurrent.futures.Future] = {}
        self.flushes: list[concurrent.futures.Future] = []
        self.writes: list[concurrent.futures.Future] = []
        self.writer: concurrent.futures.Executor | None = None  # all three set by export_checkpoint for the units
        self.hasher: concurrent.futures.Executor | None = None
        self.flusher: concurrent.futures.Executor | None = None
        self.bytes_written = 0
        self.exact = 0
        self.requantized: list[str] = []
        self.inputs_own = 0
        self.inputs_shared: list[str] = []
        self.fp8_exact = 0  # FP8_PB_WO weights written as the source's FP8 blocks
        self.fp8_requantized: list[str] = []  # FP8-block source modules whose ModelOpt output stayed (shapes differ)
        self.timing = _Timing()

    def _exact_casts(self, modules, offsets: dict[str, int]) -> dict[str, torch.Tensor]:
        """final key -> tensor for the routed experts stored MXFP4 whose weight quantizers are NVFP4: the
        exact cast of the source (same codes; w1 and w3 share weight_scale_2). Read before ModelOpt's handlers
        run (they drop the packed storage). An expert whose scales span too wide a range keeps ModelOpt's."""
        out: dict[str, torch.Tensor] = {}
        for name, module in modules:
            if name not in offsets or not mxfp4_to_nvfp4(module):
                continue
            gate_up, gate_up_scale = module.gate_up_proj_packed, module.gate_up_proj_scale
            down, down_scale = module.down_proj_packed, module.down_proj_scale
            half = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                prefix = f"{name}.{offsets[name] + e}"
                pairs = {
                    (self.names["gate_proj"], self.names["up_proj"]): [
                        (gate_up[e, :half], gate_up_scale[e, :half]), (gate_up[e, half:], gate_up_scale[e, half:])],
                    (self.names["down_proj"],): [(down[e], down_scale[e])],
                }
                for projections, sources in pairs.items():
                    cast = cast_pair(sources)
                    if cast is None:
                        self.requantized.append(f"{prefix}.{'/'.join(projections)}")
                        continue
                    for projection, w in zip(projections, cast):
                        for leaf in ("weight", "weight_scale", "weight_scale_2"):
                            out[f"{prefix}.{projection}.{leaf}"] = getattr(w, leaf)
                    self.exact += len(projections)
        return out

    def _expert_input_scales(self, modules, offsets: dict[str, int]) -> dict[str, torch.Tensor]:
        """final key -> the routed experts' own input scales (export/expert_inputs.py); read before ModelOpt's
        handlers replace the fused quantizers."""
        out: dict[str, torch.Tensor] = {}
        for name, module in modules:
            if name in offsets:
                got = expert_input_scales(name, module, offsets[name], self.names)
                out.update(got.scales)
                self.inputs_own += got.per_expert
                self.inputs_shared.extend(got.shared)
        return out

    def export(self, unit: _Unit) -> None:
        start = time.perf_counter()
        try:
            self._export(unit)
        finally:
            self.timing.add("units", time.perf_counter() - start)

    def _export(self, unit: _Unit) -> None:
        modules = unit.modules()
        offsets = {name: expert_offset(m) for name, m in modules if name.endswith("." + self.files.experts_suffix)}
        materialize(m for _, m in modules)
        casts = self._exact_casts(modules, offsets)
        if self.expert_inputs == "per-expert":
            casts.update(self._expert_input_scales(modules, offsets))
        for name, module in modules:
            self.api.dispatch_export_handler(name, module, self.context)
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        for name, module in unit.modules():
            items = list(module._parameters.items()) + [
                (b, t) for b, t in module._buffers.items() if b not in module._non_persistent_buffers_set]
            for attr, value in items:
                if value is None:
                    continue
                key, value = self._tensor(f"{name}.{attr}", value, offsets)
                if key is not None:
                    tensors.setdefault(self.files.file_of(key), {})[key] = value
        for key, value in casts.items():
            file = tensors.get(self.files.file_of(key), {})
            held = file.get(key)
            if held is not None and held.numel() == value.numel() == 1:  # a scale: [] or [1] as ModelOpt wrote it
                value = value.reshape(held.shape)
            if held is None or held.shape != value.shape or held.dtype != value.dtype:
                wrote = None if held is None else (held.dtype, list(held.shape))
                raise RuntimeError(f"{key}: the replacement {value.dtype} {list(value.shape)} does not replace what "
                                   f"ModelOpt's handler wrote ({wrote})")
            file[key] = value.to(held.device)
        for file, content in sorted(tensors.items()):
            if self._writes(unit, file):
                self._source_fp8_blocks(content)
                self._save(file, content)
        release(m for _, m in unit.modules())

    def _source_fp8_blocks(self, content: dict[str, torch.Tensor]) -> None:
        """In one file's tensors: every FP8_PB_WO weight (F8_E4M3 `weight` with a `weight_scale`) of a module the
        source stores as FP8 blocks replaced by the source's codes and scales (export/source_fp8.py)."""
        if self.source_fp8 is None or not self.source_fp8.modules:
            return
        for key in sorted(content):
            module, _, leaf = key.rpartition(".")
            scale = content.get(f"{module}.weight_scale")
            if leaf != "weight" or content[key].dtype != torch.float8_e4m3fn or scale is None:
                continue
            if module not in self.source_fp8.modules:
                continue
            exact = self.source_fp8.exact_fp8_block(module, content[key], scale)
            if exact is None:
                self.fp8_requantized.append(module)
                continue
            content[key] = exact[0].to(content[key].device)
            content[f"{module}.weight_scale"] = exact[1].to(scale.device)
            self.fp8_exact += 1

    def export_carried(self) -> None:
        """The source layers the model does not build (`FamilySpec.carried_layers`), into their own file, by the
        rank `ExportFiles.dense_writer` names for it."""
        if not self.files.carried or self.rank != self.files.dense_writer(self.files.num_layers, self.world):
            return
        start = time.perf_counter()
        try:
            self._save(self.files.carried_file(), self.source_fp8.carried(self.carried))
        finally:
            self.timing.add("units", time.perf_counter() - start)

    def _tensor(self, key: str, value: torch.Tensor, offsets: dict[str, int]):
        key, value = self.api.postprocess_tensor(key, value.detach(), KV_CACHE_MAX_BOUND, self.kv_format, False)
        if key is None or value is None or key in self.tied:
            return None, None
        for prefix, offset in offsets.items():
            if key.startswith(prefix + "."):
                if not self.rename.pattern.match(key):  # would hold this rank's shard under one name
                    raise RuntimeError(f"{key}: a fused experts tensor left after ModelOpt's export handlers")
                key = self.rename(key, offset)
                break
        source = self.source_dtypes.get(key)
        if source is not None and value.dtype in _FLOAT_DTYPES and value.dtype != source:
            value = value.to(source)  # an unquantized tensor of a model loaded in another precision
        return key, value

    def digests(self) -> dict[str, str]:
        """file -> sha256 of every file this rank wrote, once every one is on the disk (waits for the threads;
        raises what they raised)."""
        for flush in self.flushes:
            flush.result()
        return {file: future.result() for file, future in self.files_done.items()}

    def _writes(self, unit: _Unit, file: str) -> bool:
        if unit.layer is not None and file != self.files.dense_file(unit.layer):
            return True  # an experts block: only its holder produced it
        return self.rank == self.files.dense_writer(unit.layer, self.world)

    def _save(self, file: str, content: dict[str, torch.Tensor]) -> None:
        start = time.perf_counter()
        out = host_copies(content)
        self.timing.add("copies", time.perf_counter() - start)
        path = self.staging / file
        self.writes = [w for w in self.writes if not w.done()]
        if len(self.writes) >= MAX_PENDING_FILES:
            self.writes[0].result()  # the oldest: files are written in order
        write = self.writer.submit(_timed, self.timing, "write", _write_file, path, out)
        self.writes.append(write)
        self.files_done[file] = self.hasher.submit(_after, write, self.timing, "hash", sha256_file, path)
        self.flushes.append(self.flusher.submit(_after, write, self.timing, "fsync", fsync_path, path))
        for key, t in out.items():
            self.written[key] = file
            self.bytes_written += t.numel() * t.element_size()


def host_copies(content: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """key -> a contiguous host tensor of its own storage (safetensors refuses shared ones), in sorted key order.

    CUDA tensors are copied into pinned host memory (torch's caching host allocator: the blocks of the files
    written earlier are reused) without a synchronization per tensor, then once for the file. Measured on an
    H200 (docs/performance.md, "Session 17"): `.cpu()` into fresh pageable memory held the export's main thread
    3.2 s of its 5.6 s on 3.95 GB."""
    seen, out, devices = set(), {}, set()
    for key in sorted(content):
        t = content[key]
        if t.is_cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            devices.add(t.device)
        else:
            host = t.contiguous()
            if host.data_ptr() in seen:
                host = host.clone()
        seen.add(host.data_ptr())
        out[key] = host
    for device in devices:
        torch.cuda.synchronize(device)
    return out


def release_host_cache() -> None:
    """Give the pinned blocks `host_copies` left in torch's host cache back (a no-op where none was made)."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


def exported_config(source: dict, quantization_config: dict) -> dict:
    """The source's config.json describing the export: `quantization_config` replaced at the top level, and
    the source's own one removed where a multimodal config nests it (Kimi-K3 keeps its compressed-tensors
    MXFP4 config in `text_config`); left there, it would claim the exported weights are still MXFP4."""
    config = copy.deepcopy(source)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    config["quantization_config"] = quantization_config
    return config


def _write_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write one safetensors file (hashed and flushed to the disk on other threads, `_after`)."""
    save_file(tensors, str(path), metadata={"format": "pt"})


class _Timing:
    """Seconds by part of one rank's export (`ExportResult.timing`), added to from several threads."""

    def __init__(self):
        self.seconds = dict.fromkeys(("units", "copies", "write", "hash", "fsync"), 0.0)
        self.lock = threading.Lock()

    def add(self, part: str, seconds: float) -> None:
        with self.lock:
            self.seconds[part] += seconds

    def rounded(self) -> dict[str, float]:
        with self.lock:
            return {part: round(t, 3) for part, t in self.seconds.items()}


def _timed(timing: _Timing, part: str, fn, *args):
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        timing.add(part, time.perf_counter() - start)


def _after(write: concurrent.futures.Future, timing: _Timing, part: str, fn, path: Path):
    """`fn(path)` once `write` finished: sha256_file (read back while the file is in the page cache) or
    fsync_path. The export is published only once both are done for every file; flushing off the writing
    thread keeps the writer serializing the next file while the disk takes this one, and hashing beside the
    flush keeps the last file's hash out of the flush's way."""
    write.result()
    return _timed(timing, part, fn, path)


def exclude_carried(quant_config: dict, carried: tuple[str, ...]) -> None:
    """Add `<layer>*` to the quantization config's exclusions for each carried source layer prefix (`model.layers.61*`,
    as NVIDIA's DeepSeek NVFP4 checkpoints exclude the MTP layer; TensorRT-LLM matches the layer's own name)."""
    if not carried:
        return
    q = quant_config.setdefault("quantization", {})
    excluded = list(q.get("exclude_modules") or [])
    q["exclude_modules"] = excluded + [p for p in (c.rstrip(".") + "*" for c in carried) if p not in excluded]


def _finalize(staging: Path, source: Checkpoint, files: ExportFiles, maps: list[dict[str, str]],
              quant_config: dict, modelopt_config: dict, api, write_extra,
              digests: dict[str, str]) -> tuple[int, int]:
    """Rank 0: index, configs, copied source files, extra files, then the manifest (`digests`: sha256 of the
    tensor files, worked out by the ranks that wrote them)."""
    weight_map: dict[str, str] = {}
    for rank, part in enumerate(maps):
        for key, file in part.items():
            if key in weight_map:
                raise RuntimeError(f"tensor {key} was written twice ({weight_map[key]} and {file}, rank {rank})")
            weight_map[key] = file
    planned = {files.name(k) for k in range(1, files.count + 1)}
    if set(weight_map.values()) != planned:
        raise RuntimeError(f"files planned but not written: {sorted(planned - set(weight_map.values()))}; "
                           f"written but not planned: {sorted(set(weight_map.values()) - planned)}")
    total = sum(e.nbytes for f in sorted(planned) for e in (read_header(staging / f, []) or {}).values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    copy_source_files(source.path, staging)
    with warnings.catch_warnings():  # ModelOpt 0.47 warns that it cannot describe fp8_pb_wo; flat_quant_config does
        warnings.filterwarnings("ignore", message=".*Unsupported quantization algorithm 'fp8_pb_wo'.*")
        flat = api.convert_quant_config(modelopt_config)
    config = exported_config(source.config_dict, flat_quant_config(flat, quant_config))
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (staging / "hf_quant_config.json").write_text(json.dumps(quant_config, indent=4) + "\n")
    if write_extra is not None:
        write_extra(staging)
    drop_owner(staging)
    _write_manifest(staging, file_digests(staging, known=digests))
    sync_staging(staging, synced=set(digests))  # the tensor files were flushed by their writers
    return len(weight_map), total


def export_checkpoint(
    model: nn.Module,
    export_dir,
    *,
    source_dir,
    overwrite: bool = False,
    experts_per_file: int | None = None,
    write_extra: Callable[[Path], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    expert_input_scales: str = "shared",
    plan=None,
) -> ExportResult:
    """Export `model` (quantized by ModelOpt, possibly expert-parallel) to `export_dir`; see the module doc.

    Args:
        source_dir: the checkpoint the model was loaded from (config, remote code, tokenizer, source dtypes): its
            folder, or the `families.Checkpoint` the caller already read.
        overwrite: replace a non-empty `export_dir` (only once the new export is complete).
        experts_per_file: routed experts per safetensors file (see `files.py` for the default).
        write_extra: called on rank 0 with the staging directory to add files (e.g. coverage reports).
        progress: called on every rank with (units done, units) after each unit.
        expert_input_scales: "shared" (ModelOpt's: the layer's scale for every expert) or "per-expert" (each
            routed expert's input scale from its own calibration statistics, the layer's where it saw no
            token); export/expert_inputs.py.
        plan: the distribution plan the model was loaded with (`modelopt_ext.plan`); default: the one
            `modelopt_ext.from_pretrained` put on the model, if any.
    """
    if expert_input_scales not in EXPERT_INPUT_MODES:
        raise ValueError(f"expert_input_scales is {expert_input_scales!r}; expected one of {EXPERT_INPUT_MODES}")
    start = time.perf_counter()
    rank, world = (dist.get_rank(), dist.get_world_size()) if in_group() else (0, 1)
    export_dir = check_export_dir(export_dir, overwrite)
    source = source_dir if isinstance(source_dir, Checkpoint) else None
    if plan is None:
        plan = getattr(model, "modelopt_ext_plan", None)
    api = modelopt_export_api()

    def plan_export():
        checkpoint = source or Checkpoint.read(source_dir)
        family, config = checkpoint.family, checkpoint.config_dict
        source_tensors = SourceTensors.read(checkpoint.path, config)
        carried = tuple(p for p in family.carried_layers(config) if any(k.startswith(p) for k in source_tensors.files))
        files = _file_plan(model, family, experts_per_file, plan, bool(carried))
        dtype = export_dtype(model, api)
        api.prepare_moe_inputs(model, dtype, False)
        api.sync_moe_gate_up(model)
        with fused_property_weights():
            modelopt_config = api.get_quant_config(model)
        _refuse_cross_module_formats(modelopt_config)
        exclude_carried(modelopt_config, carried)
        quant_config = modelopt_config
        if family.serving is not None:  # as the serving engines parse it (export/serving.py)
            quant_config = serving_quant_config(modelopt_config, family.serving, config, _linear_modules(model, files))
            exclude_carried(quant_config, carried)
        return checkpoint, files, dtype, quant_config, modelopt_config, source_tensors, carried

    source, files, dtype, quant_config, modelopt_config, source_tensors, carried = all_or_fail(
        "export planning", plan_export)
    family = source.family
    agree("the export layout and quantization config", (dataclasses.asdict(files), quant_config))
    with interrupts_raise():  # SIGTERM/SIGINT while staged: every rank removes the staging dir, then leaves
        staging, created = None, []  # `created`: rank 0's staging dir from before it exists (staging_dir)
        try:
            staging = all_or_fail("export staging", lambda: _new_staging(export_dir, overwrite, rank, created))
            staging = Path(gather_objects(str(staging) if staging else None)[0])
            exporter = _UnitExporter(model, files, family, api, dtype, quant_config, source_tensors.export_dtypes(),
                                     staging, rank, world, expert_input_scales, source_tensors, carried)
            units = _units(model, files)
            # each rank writes its files and hashes them for the manifest on a thread while it exports the next
            # unit; rank 0 then reads only the files it writes in finalization (before: it re-read the whole export)
            with (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="export-write") as exporter.writer,
                  concurrent.futures.ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="export-sha256")
                  as exporter.hasher,
                  concurrent.futures.ThreadPoolExecutor(FLUSH_THREADS, thread_name_prefix="export-fsync")
                  as exporter.flusher):
                for i, unit in enumerate(units):
                    what = "the tensors outside the layers" if unit.layer is None else f"layer {unit.layer}"
                    all_or_fail(f"export of {what}", lambda unit=unit: exporter.export(unit))
                    if progress is not None:
                        progress(i + 1, len(units))
                all_or_fail("export of the carried source layers", exporter.export_carried)
                digests = {k: v for part in gather_objects(all_or_fail("export writing", exporter.digests))
                           for k, v in part.items()}
            release_host_cache()  # every file is written: the pinned copies are free
            maps = gather_objects(exporter.written)
            written = tuple(gather_objects(exporter.bytes_written))
            casts = gather_objects((exporter.exact, exporter.requantized))
            inputs = gather_objects((exporter.inputs_own, exporter.inputs_shared))
            fp8 = gather_objects((exporter.fp8_exact, exporter.fp8_requantized))
            result = all_or_fail("export finalization", lambda: _finalize(
                staging, source, files, maps, quant_config, modelopt_config, api, write_extra, digests)
                if rank == 0 else None)
            tensors, total = gather_objects(result)[0]
            warnings = all_or_fail("export publishing",
                                   lambda: publish(staging, export_dir, overwrite) if rank == 0 else None)
            warnings = tuple(gather_objects(warnings)[0])
        except BaseException as e:
            # first, in this order: a signal arriving in between would skip what follows (discard holds them)
            e.export_discarded = True  # read by `ptq`'s error line: nothing of this export is published
            # on every rank (the one that was interrupted may not be rank 0); rank 0's dir also when the signal came
            # while it was made or the ranks agreed on it (CI: a dir with only its owner record was left)
            discard(staging if staging is not None else next(iter(created), None))
            release_host_cache()
            raise
    seconds = time.perf_counter() - start
    logger.info("exported %d tensors (%s bytes) in %d files to %s in %.1f s", tensors, f"{total:,}", files.count,
                export_dir, seconds)
    exact, requantized = _totals(casts)
    if exact or requantized:
        logger.info("routed experts: %d weights cast exactly from MXFP4 to NVFP4 (codes kept, no added error), %d "
                    "re-quantized (scales too wide for one per-tensor scale)%s", exact,
                    sum(len(n.rpartition(".")[2].split("/")) for n in requantized), _named(requantized))
    fp8_exact, fp8_kept = _totals(fp8)
    if fp8_exact or fp8_kept:
        logger.info("FP8 128x128-block weights: %d copied exactly from the source's FP8 blocks, %d re-quantized by "
                    "ModelOpt (shapes differ from the source's)%s", fp8_exact, len(fp8_kept), _named(fp8_kept))
    if carried:
        logger.info("carried the source layers the model does not build, unquantized: %s", ", ".join(carried))
    own, shared = _totals(inputs)
    if own or shared:
        logger.info("routed experts: %d input scales from the expert's own statistics, %d kept the layer's shared "
                    "scale (no calibration token)%s", own, len(shared), _named(shared))
    timing = exporter.timing.rounded()
    logger.debug("export on rank %d: %s s", rank, timing)
    return ExportResult(export_dir, files.count, tensors, total, written, seconds, warnings, exact, requantized,
                        own, shared, timing, fp8_exact, fp8_kept, carried)


def _totals(parts: list[tuple[int, list[str]]]) -> tuple[int, tuple[str, ...]]:
    """Every rank's (count, names) summed: the total count and the sorted names."""
    return sum(n for n, _ in parts), tuple(sorted(name for _, names in parts for name in names))


def _named(names: tuple[str, ...]) -> str:
    """": a, b, c, d, e ..." for a log line (the first five), or "" for none."""
    return f": {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}" if names else ""


def _new_staging(export_dir: Path, overwrite: bool, rank: int, created: list[Path]) -> Path | None:
    """On rank 0: with `overwrite`, remove what earlier runs of this export left (validate reported it); then
    a new staging dir, its path in `created` before it exists."""
    if rank != 0:
        return None
    if overwrite:
        stale_dirs(export_dir, overwrite=True, remove=True)
    return staging_dir(export_dir, created)

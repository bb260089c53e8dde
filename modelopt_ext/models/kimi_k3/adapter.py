"""Kimi-K3 adapter: validate a checkpoint and say how to patch and load it (`prepare_load`, the family's hook
for the generic loader, `modelopt_ext.loader`).

Order matters: every check (path, trust, config, quantization format, remote-code lock, version floors,
classes to patch, KDA kernels) runs before anything is mutated, and remote code is only imported once
its files match the lock. Patches land on the module objects of that checkpoint only, when the loader runs
them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from modelopt_ext.conversion import scoped_conversion_mapping
from modelopt_ext.families import read_config, source_quantization_config
from modelopt_ext.formats.mxfp4 import check_scales
from modelopt_ext.loader import CheckpointError, PreparedLoad, WarmupHooks, on_gpu
from modelopt_ext.lock import check_remote_code, load_lock
from modelopt_ext.models.kimi_k3.config_check import check_config
from modelopt_ext.versions import check_min_versions

from .cache import KimiHybridCache
from .convert import expert_converters
from .experts import KimiK3PackedExperts
from .kda import apply_kda_patch, plan_kda_patch
from .patch import apply_patches, expert_storage, missing_classes
from .pinned import EP_PLAN, EXPERTS_GLOB, LOCK_FILE, MIN_VERSIONS
from .warmup import build_warmup_model, warmup_bytes, warmup_input_ids

logger = logging.getLogger(__name__)

MM_CLASS_REF = "modeling_kimi_k3.KimiK3ForConditionalGeneration"
# Keyword arguments the adapter decides itself.
RESERVED_KWARGS = ("config", "quantization_config", "output_loading_info")
__all__ = ["CheckpointError", "Prepared", "prepare", "prepare_load"]  # CheckpointError: the loader's, named here too

@dataclasses.dataclass(frozen=True)
class Prepared:
    """What `prepare` validated: the classes to load and how experts are stored."""

    path: Path
    model_class: type
    text_module: ModuleType
    mm_module: ModuleType
    storage: str  # "mxfp4" | "dense"
    quantization_config: dict | None


def expert_storage_of(config: dict[str, Any], source: str) -> str:
    """"mxfp4" for the upstream compressed-tensors MXFP4 experts, "dense" without a quantization config."""
    qc = source_quantization_config(config)
    if qc is None:
        return "dense"
    groups = qc.get("config_groups") or {}
    weights = [g.get("weights") or {} for g in groups.values()]
    ok = (
        qc.get("quant_method") == "compressed-tensors"
        and qc.get("format") == "mxfp4-pack-quantized"
        and len(weights) == 1
        and weights[0].get("num_bits") == 4
        and weights[0].get("type") == "float"
        and weights[0].get("group_size") == 32
    )
    if not ok:
        raise CheckpointError(
            f"{source}: quantization_config (quant_method={qc.get('quant_method')!r}, format={qc.get('format')!r}) "
            "is not the upstream compressed-tensors mxfp4-pack-quantized (4-bit float, group 32) format"
        )
    return "mxfp4"


def _check_call(path: Path, kwargs: dict[str, Any]) -> None:
    if not kwargs.get("trust_remote_code"):
        raise CheckpointError(
            f"{path} ships remote code (Kimi-K3); pass trust_remote_code=True. It runs only if its files "
            "match the pinned revision's lock."
        )
    reserved = [k for k in RESERVED_KWARGS if k in kwargs]
    if reserved:
        raise CheckpointError(f"from_pretrained arguments {reserved} are set by modelopt_ext and cannot be passed")


def _remote_modules(path: Path, kwargs: dict[str, Any]) -> tuple[type, ModuleType, ModuleType]:
    model_class = get_class_from_dynamic_module(MM_CLASS_REF, str(path), local_files_only=True)
    mm_module = sys.modules[model_class.__module__]
    text_cls = mm_module.__dict__.get("KimiLinearForCausalLM")
    if text_cls is None:
        raise CheckpointError(f"{mm_module.__name__} does not import KimiLinearForCausalLM")
    text_module = sys.modules[text_cls.__module__]
    return model_class, text_module, mm_module


def prepare(path: str | Path, remote_code_lock: str | Path | None = None, **kwargs) -> Prepared:
    """Run every check; import the (locked) remote code; return what to patch. Mutates nothing."""
    path = Path(path)
    config = read_config(path)
    _check_call(path, kwargs)
    source = str(path / "config.json")
    try:
        check_config(config, source)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    auto_ref = (config.get("auto_map") or {}).get("AutoModelForCausalLM")
    if auto_ref != MM_CLASS_REF:
        raise CheckpointError(f"{source}: auto_map.AutoModelForCausalLM is {auto_ref!r}, expected {MM_CLASS_REF!r}")
    storage = expert_storage_of(config, source)
    lock = load_lock(Path(remote_code_lock) if remote_code_lock is not None else LOCK_FILE)
    check_remote_code(path, lock)
    check_min_versions(MIN_VERSIONS, optional=frozenset({"fla-core"}))
    model_class, text_module, mm_module = _remote_modules(path, kwargs)
    missing = missing_classes(text_module, mm_module)
    if missing:
        raise CheckpointError(f"the checkpoint's remote code lacks the classes the adapter patches: {missing}")
    return Prepared(path, model_class, text_module, mm_module, storage, source_quantization_config(config))


# fused parameter -> the checkpoint's per-expert tensors stacked in its rows (w1 rows first, then w3: convert.py)
_SCALE_SOURCES = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}


def _expert_offset(param: torch.Tensor) -> int:
    """Global id of the first expert this rank holds of a (possibly EP-sharded, DTensor) expert parameter."""
    if not isinstance(param, DTensor):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return int(compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)[1][0])


def _shard_of(path: Path, key: str) -> str:
    index = path / "model.safetensors.index.json"
    try:
        return json.loads(index.read_text())["weight_map"][key] if index.is_file() else "model.safetensors"
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown shard"


def _check_expert_scales(model, path: Path) -> None:
    """Refuse E8M0 NaN bytes (255) in the loaded MXFP4 expert scales, naming the checkpoint tensor holding the
    first one (its key, shard and index) rather than the fused parameter it was merged into."""
    for fqn, module in model.named_modules():
        if not isinstance(module, KimiK3PackedExperts):
            continue
        for name, sources in _SCALE_SOURCES.items():
            param = getattr(module, f"{name}_scale")
            scale = param.to_local() if isinstance(param, DTensor) else param
            bad = scale == 255
            if not bool(bad.any()):
                continue
            local, row, _ = torch.nonzero(bad)[0].tolist()
            rows = scale.shape[1] // len(sources)
            part = row // rows
            key = f"{fqn}.{local + _expert_offset(param)}.{sources[part]}.weight_scale"
            where = f"tensor {key} in {_shard_of(path, key)}"
            try:
                check_scales(scale[local, part * rows:(part + 1) * rows], name=where)
            except ValueError as e:
                raise CheckpointError(f"checkpoint {path}: {e}") from e


def prepare_load(path: str | Path, *, remote_code_lock: str | Path | None = None, **kwargs) -> PreparedLoad:
    """The family's hook for `modelopt_ext.loader.load`: every check (`prepare`, and the KDA kernels for the
    device the model goes to), then how to patch, configure, build, convert, warm up and check the load.

    `remote_code_lock` names a lock recorded with `modelopt-ext lock-remote-code` for reviewed code that differs
    from the pinned revision; other keyword arguments are transformers' `from_pretrained` ones. The warm-up
    model (`models/kimi_k3/warmup.py`) is a small model of the same classes at the checkpoint's widths.
    """
    prepared = prepare(path, remote_code_lock=remote_code_lock, **kwargs)
    # fla-core kernels need CUDA: with no GPU, or when the caller places the model on the CPU, fla kernels
    # (real upstream imports them directly) are replaced by the torch reference.
    kda_plan = plan_kda_patch(prepared.text_module, device_type="cuda" if on_gpu(kwargs) else "cpu")

    def patch() -> None:
        apply_patches(prepared.text_module, prepared.mm_module, KimiHybridCache)
        apply_kda_patch(prepared.text_module, kda_plan)

    def make_config():
        config = prepared.model_class.config_class.from_pretrained(str(prepared.path))
        for holder in (config, config.get_text_config()):
            if hasattr(holder, "quantization_config"):
                del holder.quantization_config  # the adapter reads the MXFP4 experts itself
        return config

    def build_warmup(config, device, dtype, experts_implementation):
        return build_warmup_model(prepared.model_class, config, storage=prepared.storage, device=device, dtype=dtype,
                                  experts_implementation=experts_implementation)

    return PreparedLoad(
        path=prepared.path,
        model_class=prepared.model_class,
        ep_plan=EP_PLAN,
        patch=patch,
        make_config=make_config,
        build_scope=lambda: expert_storage(prepared.storage),
        conversion_scope=lambda: scoped_conversion_mapping(prepared.model_class.__name__,
                                                           expert_converters(prepared.storage)),
        counted_reads=(EXPERTS_GLOB,),
        warmup=WarmupHooks(build=build_warmup, input_ids=warmup_input_ids, nbytes=warmup_bytes),
        check_loaded=lambda model: _check_expert_scales(model, prepared.path),
        quantization_config=prepared.quantization_config,
        description=f"{prepared.storage} experts",
        family_options=("remote_code_lock",),
    )

"""Kimi-K3 adapter: validate a checkpoint, then patch its own remote-code classes, then load it.

Order matters: every check (path, trust, config, quantization format, remote-code lock, version floors,
classes to patch, KDA kernels) runs before anything is mutated, and remote code is only imported once
its files match the lock. Patches land on the module objects of that checkpoint only.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from modelopt_ext.ep.backend import capture_ep_forwards
from modelopt_ext.ep.sharding import count_checkpoint_reads, localize_replicated_params
from modelopt_ext.families import read_config, source_quantization_config
from modelopt_ext.formats.mxfp4 import check_scales
from modelopt_ext.lock import check_remote_code, load_lock
from modelopt_ext.models.kimi_k3.config_check import check_config
from modelopt_ext.versions import check_min_versions
from modelopt_ext.warmup import Warmup

from .cache import KimiHybridCache
from .convert import expert_converters, scoped_conversion_mapping
from .experts import KimiK3PackedExperts
from .kda import apply_kda_patch, plan_kda_patch
from .patch import apply_patches, expert_storage, missing_classes
from .pinned import EP_PLAN, EXPERTS_GLOB, LOCK_FILE, MIN_VERSIONS
from .warmup import build_warmup_model, warmup_bytes, warmup_input_ids

logger = logging.getLogger(__name__)

MM_CLASS_REF = "modeling_kimi_k3.KimiK3ForConditionalGeneration"
# Keyword arguments the adapter decides itself.
RESERVED_KWARGS = ("config", "quantization_config", "output_loading_info")
_LOAD_LOCK = threading.Lock()


class CheckpointError(ValueError):
    """The checkpoint or the call cannot be adapted; nothing was patched."""


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


def _strict_loading_info(info: dict[str, Any], path: Path) -> None:
    problems = {k: sorted(map(str, info.get(k) or ())) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {k: v for k, v in problems.items() if v}
    if problems or info.get("error_msgs"):
        raise CheckpointError(f"loading {path} left keys unmapped: {problems} {info.get('error_msgs') or ''}")


def _distributed_config(prepared: Prepared, config, plan):
    """transformers' DistributedConfig for `plan`, with plans named after a meta-device build of the model."""
    from transformers import DistributedConfig

    from modelopt_ext.ep.sharding import replicate_tp_plan, select_ep_plan

    with torch.device("meta"), expert_storage(prepared.storage):
        meta_model = prepared.model_class(copy.deepcopy(config))
    ep_plan = select_ep_plan(EP_PLAN, meta_model)
    kwargs = plan.distributed_config_kwargs()
    if plan.dense == "replicate":
        kwargs["tp_plan"] = replicate_tp_plan(meta_model, ep_plan)
    return DistributedConfig(**kwargs, ep_plan=ep_plan)


def warmup_fits(plan, config) -> bool:
    """Whether the warm-up model fits beside the plan's resident estimate within the usable device memory (its
    activations take the calibration activations' share, unused during the load); logs when it does not."""
    from modelopt_ext.plan import USABLE_FRACTION

    need, usable = warmup_bytes(config), USABLE_FRACTION * plan.device_memory_bytes
    if plan.estimate.total_bytes + need <= usable:
        return True
    logger.info("no warm-up forward: its %.1f GiB do not fit beside the plan's %.1f GiB in %.1f GiB usable",
                need / 2**30, plan.estimate.total_bytes / 2**30, usable / 2**30)
    return False


def warmup_device(device_map, on_gpu: bool, current: int = 0) -> torch.device:
    """Where the warm-up runs: the CPU, the one CUDA device `device_map` names, or else the current one (EP
    ranks, `device_map="cuda"`, or a map spread over several devices)."""
    if not on_gpu:
        return torch.device("cpu")
    if isinstance(device_map, (str, torch.device)) and str(device_map).startswith("cuda"):
        device = torch.device(device_map)
        return device if device.index is not None else torch.device("cuda", current)
    if isinstance(device_map, int):
        return torch.device("cuda", device_map)
    return torch.device("cuda", current)


def _start_warmup(prepared: Prepared, config, tokens: tuple[int, int], device: torch.device, kwargs) -> Warmup | None:
    """Build the warm-up model on this thread (its construction sets transformers' global default dtype, so
    it must not overlap the load) and start its forward on another (`modelopt_ext.warmup`). A failure to
    build it (out of memory, say) is logged, and the load goes on without it."""
    batch, seq_len = tokens
    dtype = kwargs.get("dtype")
    if not isinstance(dtype, torch.dtype):
        dtype = getattr(torch, str(getattr(config, "dtype", None) or "bfloat16").removeprefix("torch."))
    try:
        model = build_warmup_model(prepared.model_class, config, storage=prepared.storage, device=device,
                                   dtype=dtype, experts_implementation=kwargs.get("experts_implementation"))
        ids = warmup_input_ids(config, batch, seq_len, device)
    except Exception as e:  # noqa: BLE001 - an optimisation: report, never fail the load
        logger.warning("no warm-up forward: building its model failed: %s: %s", type(e).__name__, e)
        return None
    return Warmup(model, ids).start()


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


def load(path: str | Path, *, remote_code_lock: str | Path | None = None, distribution_plan=None,
         warmup_tokens: tuple[int, int] | None = None, warmup_timeout_s: float = 600.0, **kwargs):
    """Validate, patch and load a Kimi-K3 checkpoint; returns `KimiK3ForConditionalGeneration`.

    Keyword arguments are transformers' `from_pretrained` ones (`dtype`, `device_map`, `trust_remote_code`,
    `experts_implementation`, ...); `remote_code_lock` names a lock recorded with `modelopt-ext
    lock-remote-code` for reviewed code that differs from the pinned revision. With a `distribution_plan`
    (from `modelopt_ext.plan`, inside an initialised process group) the experts are sharded across the EP
    ranks as the checkpoint is read; each rank reads only its own experts' bytes. With `warmup_tokens`
    (batch, sequence length) a small model of the same classes runs one forward of that shape on a thread
    during the read (`models/kimi_k3/warmup.py`), waited for up to `warmup_timeout_s` at the end, unless
    it does not fit beside the plan's memory estimate; the model's `modelopt_ext_warmup_s` holds its
    seconds (None: not run, failed or still running).
    """
    if warmup_tokens is not None and not (len(warmup_tokens) == 2 and all(isinstance(n, int) and n > 0
                                                                         for n in warmup_tokens)):
        raise CheckpointError(f"warmup_tokens {warmup_tokens!r} must be two positive sizes (batch, sequence length)")
    prepared = prepare(path, remote_code_lock=remote_code_lock, **kwargs)
    # fla-core kernels need CUDA: with no GPU, or when the caller places the model on the CPU, fla kernels
    # (real upstream imports them directly) are replaced by the torch reference.
    device_map = kwargs.get("device_map")
    on_gpu = torch.cuda.is_available() and (device_map is None or "cpu" not in str(device_map))
    kda_plan = plan_kda_patch(prepared.text_module, device_type="cuda" if on_gpu else "cpu")
    with _LOAD_LOCK:
        apply_patches(prepared.text_module, prepared.mm_module, KimiHybridCache)
        apply_kda_patch(prepared.text_module, kda_plan)
        config = prepared.model_class.config_class.from_pretrained(str(prepared.path))
        for holder in (config, config.get_text_config()):
            if hasattr(holder, "quantization_config"):
                del holder.quantization_config  # the adapter reads the MXFP4 experts itself
        warm = None
        if warmup_tokens is not None and (distribution_plan is None or warmup_fits(distribution_plan, config)):
            device = warmup_device(device_map, on_gpu, torch.cuda.current_device() if on_gpu else 0)
            warm = _start_warmup(prepared, config, warmup_tokens, device, kwargs)
        if distribution_plan is not None:
            kwargs["distributed_config"] = _distributed_config(prepared, config, distribution_plan)
        converters = expert_converters(prepared.storage)
        with (
            scoped_conversion_mapping(prepared.model_class.__name__, converters),
            expert_storage(prepared.storage),
            count_checkpoint_reads([f"{EXPERTS_GLOB}.*"]) as reads,
        ):
            model, info = prepared.model_class.from_pretrained(
                str(prepared.path), config=config, output_loading_info=True, **kwargs
            )
    model.modelopt_ext_warmup_s = warm.wait(warmup_timeout_s) if warm is not None else None
    _strict_loading_info(info, prepared.path)
    if distribution_plan is not None:
        capture_ep_forwards(model)
        if distribution_plan.dense == "replicate":
            localize_replicated_params(model)
    model.modelopt_ext_bytes_read = dict(reads.by_group)
    logger.info("read %s bytes of the checkpoint (%s)", f"{reads.total:,}",
                ", ".join(f"{k} {v:,}" for k, v in sorted(reads.by_group.items())))
    _check_expert_scales(model, prepared.path)  # MXFP4 scales checked once, so forwards need no host syncs
    # As the Auto classes do: save_pretrained then copies the (unmodified) remote-code files.
    prepared.model_class.register_for_auto_class("AutoModelForCausalLM")
    if prepared.quantization_config is not None:
        model.config.quantization_config = prepared.quantization_config
    logger.info("loaded %s (%s experts) from %s", type(model).__name__, prepared.storage, prepared.path)
    return model.eval()

"""The generic checkpoint loader: a family's prepared load -> transformers' `from_pretrained`, sharded under a
distribution plan, with a warm-up forward during the read.

    result = load(family.prepare, path, distribution_plan=plan, warmup_tokens=(4, 2048), dtype=torch.bfloat16)

Steps, the same for every family:
1. `prepare(path, **kwargs)` (the family's hook) runs every check and returns a `PreparedLoad`; it mutates
   nothing.
2. Under one process-wide lock (model construction sets transformers' global default dtype): the family's
   patches, its config, the warm-up model built and its forward started on a thread (`modelopt_ext.warmup`)
   when it fits beside the plan's memory, the `DistributedConfig` for the plan (expert-parallel plan selected
   on a meta-device build of the model, dense modules replicated or left to FSDP), then `from_pretrained` in
   the family's construction and conversion scopes, counting the checkpoint bytes read.
3. After: the warm-up waited for, the loading info checked strictly (no missing, unexpected or mismatched key
   but the unexpected ones the family declares it leaves unread), the EP forwards captured and replicated
   parameters made local, the family's check of the loaded model, the class registered for the Auto class where
   it is the checkpoint's remote code, and the source's quantization config put back on the model's config.

Returns a `LoadResult` (the model, bytes read by group, the warm-up's seconds).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modelopt_ext.ep.backend import capture_ep_forwards
from modelopt_ext.ep.sharding import count_checkpoint_reads, localize_replicated_params
from modelopt_ext.warmup import Warmup

logger = logging.getLogger(__name__)

_LOAD_LOCK = threading.Lock()


class CheckpointError(ValueError):
    """The checkpoint or the call cannot be adapted; nothing was patched."""


@dataclasses.dataclass(frozen=True)
class WarmupHooks:
    """How a family builds its warm-up model: `build(config, device, dtype, experts_implementation)` -> a model
    of the checkpoint's classes at its widths; `input_ids(config, batch, seq_len, device)`; `nbytes(config)`, its
    parameters' bytes (for the fit against the plan)."""

    build: Callable[..., nn.Module]
    input_ids: Callable[..., torch.Tensor]
    nbytes: Callable[[Any], int]


@dataclasses.dataclass(frozen=True)
class PreparedLoad:
    """What a family's `prepare` hook checked and what the loader needs to load it.

    Attributes:
        path: the checkpoint folder.
        model_class: the class `from_pretrained` is called on.
        ep_plan: module-name glob -> transformers EP style (the family's expert-parallel plan).
        patch: the family's mutations (its remote-code patches), run under the load lock; idempotent.
        make_config: the model config to build with, once patched.
        build_scope: `build_scope()` -> the context every build of the model runs in (meta, warm-up, load).
        conversion_scope: `conversion_scope()` -> the context `from_pretrained` also runs in (weight conversions).
        counted_reads: module globs whose checkpoint reads count as "experts", the rest as "dense"
            (`ep.sharding.count_checkpoint_reads`).
        warmup: how the family builds its warm-up model, or None (no warm-up).
        check_loaded: `check_loaded(model)` raises CheckpointError for what only the loaded tensors show.
        quantization_config: the source's quantization config, put back on the loaded model's config.
        description: how the load is described in its log line (e.g. "mxfp4 experts").
        family_options: the keyword arguments that were the family's (`prepare` took them), not passed on to
            `from_pretrained`.
        load_kwargs: `from_pretrained` keyword arguments the family sets itself (e.g. a quantization config that
            dequantizes, `use_kernels=False`), over the caller's; `prepare` refuses a caller's argument it sets.
        ignored_unexpected: regular expressions (`re.match`, from the key's start) of checkpoint keys the model
            knowingly does not load (e.g. multi-token-prediction layers it does not build): not refused as unexpected.
        remote_code: the model class is the checkpoint's remote code; it is then registered for
            AutoModelForCausalLM after the load, so that `save_pretrained` copies its files and writes `auto_map`
            (for a class native to transformers that would change transformers' class for every model).
    """

    path: Path
    model_class: type
    ep_plan: Mapping[str, str]
    patch: Callable[[], None]
    make_config: Callable[[], Any]
    build_scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    conversion_scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    counted_reads: tuple[str, ...] = ()
    warmup: WarmupHooks | None = None
    check_loaded: Callable[[nn.Module], None] | None = None
    quantization_config: dict | None = None
    description: str = ""
    family_options: tuple[str, ...] = ()
    load_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    ignored_unexpected: tuple[str, ...] = ()
    remote_code: bool = True


@dataclasses.dataclass(frozen=True)
class LoadResult:
    model: nn.Module
    bytes_read: Mapping[str, int]  # checkpoint bytes read: "experts" (`PreparedLoad.counted_reads`), "dense"
    warmup_s: float | None  # the warm-up forward's seconds; None: not run, failed or still running


def on_gpu(kwargs: Mapping[str, Any]) -> bool:
    """Whether the model goes to a GPU: CUDA is there and `device_map` does not name the CPU."""
    device_map = kwargs.get("device_map")
    return torch.cuda.is_available() and (device_map is None or "cpu" not in str(device_map))


def check_warmup_tokens(warmup_tokens) -> None:
    if warmup_tokens is not None and not (len(warmup_tokens) == 2 and all(isinstance(n, int) and n > 0
                                                                         for n in warmup_tokens)):
        raise CheckpointError(f"warmup_tokens {warmup_tokens!r} must be two positive sizes (batch, sequence length)")


def load(prepare: Callable[..., PreparedLoad], path: str | Path, *, distribution_plan=None,
         warmup_tokens: tuple[int, int] | None = None, warmup_timeout_s: float = 600.0, **kwargs) -> LoadResult:
    """Load the checkpoint at `path` as the module doc says.

    `prepare` is the family's hook (`FamilySpec.prepare`); keyword arguments are transformers' `from_pretrained`
    ones plus the family's options. With a `distribution_plan` (from `modelopt_ext.plan`, inside an initialised
    process group) the experts are sharded across the EP ranks as the checkpoint is read. With `warmup_tokens`
    (batch, sequence length) the family's warm-up model runs one forward of that shape on a thread during the
    read, waited for up to `warmup_timeout_s` at the end, unless it does not fit beside the plan's estimate.
    """
    check_warmup_tokens(warmup_tokens)
    prepared = prepare(path, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in prepared.family_options}
    gpu = on_gpu(kwargs)
    with _LOAD_LOCK:
        prepared.patch()
        config = prepared.make_config()
        warm = None
        if (warmup_tokens is not None and prepared.warmup is not None
                and (distribution_plan is None or warmup_fits(distribution_plan, config, prepared.warmup))):
            device = warmup_device(kwargs.get("device_map"), gpu, torch.cuda.current_device() if gpu else 0)
            warm = _start_warmup(prepared, config, warmup_tokens, device, kwargs)
        if distribution_plan is not None:
            kwargs["distributed_config"] = _distributed_config(prepared, config, distribution_plan)
        with (
            prepared.conversion_scope(),
            prepared.build_scope(),
            count_checkpoint_reads([f"{glob}.*" for glob in prepared.counted_reads]) as reads,
        ):
            model, info = prepared.model_class.from_pretrained(
                str(prepared.path), config=config, output_loading_info=True, **{**kwargs, **prepared.load_kwargs}
            )
    warmup_s = warm.wait(warmup_timeout_s) if warm is not None else None
    _strict_loading_info(info, prepared.path, prepared.ignored_unexpected)
    if distribution_plan is not None:
        capture_ep_forwards(model)
        if distribution_plan.dense == "replicate":
            localize_replicated_params(model)
    logger.info("read %s bytes of the checkpoint (%s)", f"{reads.total:,}",
                ", ".join(f"{k} {v:,}" for k, v in sorted(reads.by_group.items())))
    if prepared.check_loaded is not None:
        prepared.check_loaded(model)
    if prepared.remote_code:
        # As the Auto classes do: save_pretrained then copies the (unmodified) remote-code files.
        prepared.model_class.register_for_auto_class("AutoModelForCausalLM")
    if prepared.quantization_config is not None:
        model.config.quantization_config = prepared.quantization_config
    logger.info("loaded %s (%s) from %s", type(model).__name__, prepared.description, prepared.path)
    return LoadResult(model.eval(), dict(reads.by_group), warmup_s)


def _strict_loading_info(info: dict[str, Any], path: Path, ignored_unexpected: tuple[str, ...] = ()) -> None:
    problems = {k: sorted(map(str, info.get(k) or ())) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems["unexpected_keys"] = [k for k in problems["unexpected_keys"]
                                   if not any(re.match(p, k) for p in ignored_unexpected)]
    problems = {k: v for k, v in problems.items() if v}
    if problems or info.get("error_msgs"):
        raise CheckpointError(f"loading {path} left keys unmapped: {problems} {info.get('error_msgs') or ''}")


def _distributed_config(prepared: PreparedLoad, config, plan):
    """transformers' DistributedConfig for `plan`, with plans named after a meta-device build of the model."""
    from transformers import DistributedConfig

    from modelopt_ext.ep.sharding import replicate_tp_plan, select_ep_plan

    with torch.device("meta"), prepared.build_scope():
        meta_model = prepared.model_class(copy.deepcopy(config))
    ep_plan = select_ep_plan(prepared.ep_plan, meta_model)
    kwargs = plan.distributed_config_kwargs()
    if plan.dense == "replicate":
        kwargs["tp_plan"] = replicate_tp_plan(meta_model, ep_plan)
    return DistributedConfig(**kwargs, ep_plan=ep_plan)


def warmup_fits(plan, config, hooks: WarmupHooks) -> bool:
    """Whether the warm-up model fits beside the plan's resident estimate within the usable device memory (its
    activations take the calibration activations' share, unused during the load); logs when it does not."""
    from modelopt_ext.plan import USABLE_FRACTION

    need, usable = hooks.nbytes(config), USABLE_FRACTION * plan.device_memory_bytes
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


def _start_warmup(prepared: PreparedLoad, config, tokens: tuple[int, int], device: torch.device,
                  kwargs) -> Warmup | None:
    """Build the warm-up model on this thread (its construction sets transformers' global default dtype, so
    it must not overlap the load) and start its forward on another (`modelopt_ext.warmup`). A failure to
    build it (out of memory, say) is logged, and the load goes on without it."""
    batch, seq_len = tokens
    dtype = kwargs.get("dtype")
    if not isinstance(dtype, torch.dtype):
        dtype = getattr(torch, str(getattr(config, "dtype", None) or "bfloat16").removeprefix("torch."))
    try:
        with prepared.build_scope():
            model = prepared.warmup.build(config, device, dtype, kwargs.get("experts_implementation"))
        ids = prepared.warmup.input_ids(config, batch, seq_len, device)
    except Exception as e:  # noqa: BLE001 - an optimisation: report, never fail the load
        logger.warning("no warm-up forward: building its model failed: %s: %s", type(e).__name__, e)
        return None
    return Warmup(model, ids).start()

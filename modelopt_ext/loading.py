"""Loading a checkpoint of a registered family: `modelopt_ext.from_pretrained` (the transformers-like entry) and
`load_checkpoint` (what `ptq` calls with the context it resolved in validation).

    model = modelopt_ext.from_pretrained(path, ep_size=8, dtype=torch.bfloat16, trust_remote_code=True)
    loaded = load_checkpoint(Checkpoint.read(path), plan=plan, dtype=torch.bfloat16, trust_remote_code=True)
    loaded.model, loaded.plan, loaded.bytes_read, loaded.warmup_s
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from modelopt_ext import loader
from modelopt_ext.dist import DEFAULT_TIMEOUT_S, agree, all_or_fail, init_distributed
from modelopt_ext.ep.backend import register_torch_a2a
from modelopt_ext.families import Checkpoint
from modelopt_ext.options import DEFAULT, ExpertsOptions, set_experts_options
from modelopt_ext.plan import resolve_distribution_plan


@dataclasses.dataclass(frozen=True)
class LoadedCheckpoint:
    """A loaded model and what its load resolved and measured."""

    model: nn.Module
    plan: Any  # the distribution plan (`modelopt_ext.plan.DistributionPlan`) under EP, else None
    bytes_read: Mapping[str, int]  # checkpoint bytes this rank read: "experts", "dense"
    warmup_s: float | None  # the warm-up forward's seconds (None: none ran)


def from_pretrained(
    path: str | Path,
    *,
    ep_size: int | None = None,
    dense: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    experts_options: ExpertsOptions = DEFAULT,
    **kwargs,
):
    """Load a checkpoint of a supported family with its adapter applied.

    Args:
        path: local checkpoint folder (no hub downloads).
        ep_size: expert-parallel degree. When given (under torchrun), every rank joins the process group,
            resolves the distribution plan, checks with the others that they agree, and loads only its own
            experts (`dense`: "replicate" or "fsdp" for the other modules; automatic when None).
        timeout_s: bound on every collective wait (process-group timeout).
        experts_options: how the fused experts and their exchange run (`modelopt_ext.options.ExpertsOptions`;
            the defaults are the measured best); set on every fused experts module, and carried by the plan
            under EP (the ranks agree on it before loading).
        **kwargs: transformers `from_pretrained` keyword arguments (e.g. `dtype`, `trust_remote_code`,
            `experts_implementation`) plus family options (e.g. `remote_code_lock`).
    Returns:
        The model class `AutoModelForCausalLM` gives for the checkpoint, patched by the family adapter;
        with EP its routed experts are sharded across the ranks. What the load resolved and measured rides on
        it: `modelopt_ext_plan` (under EP; `quant.calibrate` and `export_checkpoint` read it when not given a
        plan), `modelopt_ext_bytes_read` and `modelopt_ext_warmup_s` (`LoadedCheckpoint`).
    """
    if not isinstance(experts_options, ExpertsOptions):  # checked before anything is read
        raise TypeError(f"experts_options must be a modelopt_ext.options.ExpertsOptions, got {experts_options!r}")
    checkpoint = Checkpoint.read(path)
    plan = None
    if ep_size is None:
        if dense is not None:
            raise ValueError(f"dense={dense!r} needs ep_size: it places the dense modules of an EP run")
    else:
        if "distributed_config" in kwargs:
            raise ValueError("pass either ep_size (modelopt_ext resolves the plan) or distributed_config, not both")
        _, world_size = init_distributed(timeout_s)
        plan = all_or_fail("planning", lambda: resolve_distribution_plan(
            checkpoint.config, world_size, family=checkpoint.family, ep_size=ep_size, dense=dense,
            experts_options=experts_options))
        agree("the distribution plan", plan.to_dict())
    loaded = load_checkpoint(checkpoint, plan=plan, experts_options=experts_options, **kwargs)
    # for callers that get only the model (as transformers hangs `hf_device_map` on it); `ptq` passes these on
    if plan is not None:
        loaded.model.modelopt_ext_plan = plan
    loaded.model.modelopt_ext_bytes_read = dict(loaded.bytes_read)
    loaded.model.modelopt_ext_warmup_s = loaded.warmup_s
    return loaded.model


def load_checkpoint(checkpoint: Checkpoint, *, plan=None, experts_options: ExpertsOptions = DEFAULT,
                    **kwargs) -> LoadedCheckpoint:
    """The generic loader (`modelopt_ext.loader`) with the family's hook, for a checkpoint already read and, under
    EP, a plan the ranks already agreed on (inside their process group; its experts options win). Keyword
    arguments as `from_pretrained`'s."""
    if plan is not None:
        register_torch_a2a()
        experts_options = plan.experts_options

    def load():
        return loader.load(checkpoint.family.prepare, checkpoint.path, distribution_plan=plan, **kwargs)

    result = load() if plan is None else all_or_fail("loading", load)  # EP loads are collective
    set_experts_options(result.model, experts_options)
    return LoadedCheckpoint(result.model, plan, dict(result.bytes_read), result.warmup_s)

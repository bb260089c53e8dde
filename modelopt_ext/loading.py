"""`modelopt_ext.from_pretrained`: find the checkpoint's family, let it validate, patch and load."""

from __future__ import annotations

from pathlib import Path

from modelopt_ext import loader
from modelopt_ext.dist import DEFAULT_TIMEOUT_S, agree, all_or_fail, init_distributed
from modelopt_ext.ep.backend import register_torch_a2a
from modelopt_ext.families import family_for_config, read_config
from modelopt_ext.options import DEFAULT, ExpertsOptions, set_experts_options
from modelopt_ext.plan import resolve_distribution_plan


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
        with EP its routed experts are sharded across the ranks (`model.modelopt_ext_plan` holds the plan).
    """
    if not isinstance(experts_options, ExpertsOptions):  # checked before anything is read
        raise TypeError(f"experts_options must be a modelopt_ext.options.ExpertsOptions, got {experts_options!r}")
    config = read_config(path)
    family = family_for_config(config, source=str(Path(path) / "config.json"))
    if ep_size is None:
        if dense is not None:
            raise ValueError(f"dense={dense!r} needs ep_size: it places the dense modules of an EP run")
        return _with_options(_load(family, path, None, kwargs), experts_options)
    if "distributed_config" in kwargs:
        raise ValueError("pass either ep_size (modelopt_ext resolves the plan) or distributed_config, not both")
    _, world_size = init_distributed(timeout_s)
    plan = all_or_fail(
        "planning", lambda: resolve_distribution_plan(config, world_size, family=family, ep_size=ep_size, dense=dense,
                                                      experts_options=experts_options)
    )
    agree("the distribution plan", plan.to_dict())
    register_torch_a2a()
    model = all_or_fail("loading", lambda: _load(family, path, plan, kwargs))
    model.modelopt_ext_plan = plan
    return _with_options(model, plan.experts_options)


def _load(family, path, plan, kwargs):
    """The generic loader with the family's hook; what it measured rides on the model (`modelopt_ext_*`)."""
    result = loader.load(family.prepare, path, distribution_plan=plan, **kwargs)
    result.model.modelopt_ext_bytes_read = dict(result.bytes_read)
    result.model.modelopt_ext_warmup_s = result.warmup_s
    return result.model


def _with_options(model, options: ExpertsOptions):
    set_experts_options(model, options)
    return model

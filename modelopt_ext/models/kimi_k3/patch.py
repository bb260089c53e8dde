"""Patches for the classes of one loaded Kimi-K3 checkpoint module: fused MoE block and compatibility shims.

Everything here acts on the module objects transformers created for ONE checkpoint (its
`modeling_kimi_linear` and `modeling_kimi_k3`); two checkpoints in one process are patched separately, and
whether a module is patched is recorded on that module, not in a process-global flag.

Shapes: B batch, T time, H hidden, L latent width, N = B*T tokens, k top-k.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
from types import ModuleType

import torch
from torch import nn

from modelopt_ext.ep.backend import call_experts

from . import mla
from .experts import KimiK3Experts, KimiK3PackedExperts

logger = logging.getLogger(__name__)

PATCHED_ATTR = "__modelopt_ext_patched__"
# Classes the adapter needs in the text module, and in the multimodal module.
TEXT_CLASSES = ("KimiSparseMoeBlock", "KimiMoEGate", "KimiMLP", "KimiRMSNorm", "KimiDynamicCache",
                "KimiLinearPreTrainedModel", "KimiLinearModel", "KimiLinearForCausalLM", "KimiDeltaAttention",
                "KimiMLAAttention")
MM_CLASSES = ("KimiK3PreTrainedModel", "KimiK3ForConditionalGeneration")

# Which experts storage a block built now gets: "mxfp4" while loading a packed checkpoint, else "dense".
_EXPERT_STORAGE: contextvars.ContextVar[str] = contextvars.ContextVar("modelopt_ext_expert_storage", default="dense")
EXPERT_STORAGES = {"dense": KimiK3Experts, "mxfp4": KimiK3PackedExperts}


@contextlib.contextmanager
def expert_storage(kind: str):
    """Blocks constructed inside this context hold their routed experts as `kind` ("dense" or "mxfp4")."""
    if kind not in EXPERT_STORAGES:
        raise ValueError(f"expert storage {kind!r} is not one of {sorted(EXPERT_STORAGES)}")
    token = _EXPERT_STORAGE.set(kind)
    try:
        yield
    finally:
        _EXPERT_STORAGE.reset(token)


def missing_classes(text_module: ModuleType, mm_module: ModuleType) -> list[str]:
    """Names the adapter needs that the checkpoint's modules do not define as classes."""
    missing = [f"{text_module.__name__}.{n}" for n in TEXT_CLASSES if not inspect.isclass(text_module.__dict__.get(n))]
    missing += [f"{mm_module.__name__}.{n}" for n in MM_CLASSES if not inspect.isclass(mm_module.__dict__.get(n))]
    return missing


def make_fused_block_class(text_module: ModuleType) -> type[nn.Module]:
    """A `KimiSparseMoeBlock` with the checkpoint's router, norms and shared experts and fused experts.

    Order (latent MoE): router on the full width -> routed_expert_down_proj -> experts -> routed_expert_norm
    -> routed_expert_up_proj -> + shared experts on the full-width input. Routing stays on the device.
    """
    gate_cls, norm_cls, mlp_cls = text_module.KimiMoEGate, text_module.KimiRMSNorm, text_module.KimiMLP

    class KimiSparseMoeBlock(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.top_k = config.num_experts_per_token
            self.gate = gate_cls(config)
            self.experts = EXPERT_STORAGES[_EXPERT_STORAGE.get()](config)
            width = config.routed_expert_hidden_size
            self.routed_expert_down_proj = nn.Linear(config.hidden_size, width, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = norm_cls(width, eps=config.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(width, config.hidden_size, bias=False)
            if config.num_shared_experts:
                self.shared_experts = mlp_cls(config, config.moe_intermediate_size * config.num_shared_experts)

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            B, T, H = hidden_states.shape
            x_NH = hidden_states.reshape(-1, H)
            topk_idx_Nk, topk_weight_Nk = self.gate(x_NH)
            x_NL = self.routed_expert_down_proj(x_NH)
            y_NL = call_experts(self.experts, x_NL, topk_idx_Nk, topk_weight_Nk)
            if self.config.latent_moe_use_norm:
                y_NL = self.routed_expert_norm(y_NL)
            y = self.routed_expert_up_proj(y_NL).view(B, T, H)
            if self.config.num_shared_experts:
                y = y + self.shared_experts(hidden_states)
            return y

    KimiSparseMoeBlock.__module__ = text_module.__name__
    KimiSparseMoeBlock.__qualname__ = "KimiSparseMoeBlock"
    return KimiSparseMoeBlock


def _accepts_keywords(fn) -> bool:
    params = inspect.signature(fn).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


# Each shim returns the (owner, attribute, new value) assignments it needs, or none; apply_patches applies
# them only once all are computed, so a failure leaves the module untouched.
Assignment = tuple[object, str, object]


def _shim_tie_weights(cls: type) -> list[Assignment]:
    """transformers 5.24 calls `tie_weights(missing_keys=..., recompute_mapping=...)`; upstream declares
    `tie_weights(self)`. Only a class that defines it itself without **kwargs is wrapped."""
    own = cls.__dict__.get("tie_weights")
    if own is None or _accepts_keywords(own):
        return []

    @functools.wraps(own)
    def tie_weights(self, *args, **kwargs):
        return own(self)

    return [(cls, "tie_weights", tie_weights)]


def _shim_cache_keyword(cls: type) -> list[Assignment]:
    """transformers 5.24 passes the cache as `cache=`; upstream forwards only take `past_key_values=`.
    (Outputs built with `past_key_values=` already expose it as `cache`, which `generate` reads.)"""
    own = cls.__dict__.get("forward")
    if own is None or "cache" in inspect.signature(own).parameters:
        return []

    @functools.wraps(own)
    def forward(self, *args, cache=None, **kwargs):
        if cache is not None:
            if kwargs.get("past_key_values") is not None and kwargs["past_key_values"] is not cache:
                raise ValueError("pass the cache as either `cache` or `past_key_values`, not both")
            kwargs["past_key_values"] = cache
        return own(self, *args, **kwargs)

    return [(cls, "forward", forward)]


def _shim_generation_cache(cls: type, cache_cls: type) -> list[Assignment]:
    """`generate` would build a transformers DynamicCache, which the remote attention cannot use: build the
    hybrid cache instead unless the caller passed one or disabled caching."""
    if "_prepare_cache_for_generation" in cls.__dict__:
        return []
    default = cls._prepare_cache_for_generation

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        if model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            if generation_config.cache_implementation is not None:
                raise ValueError(
                    f"cache_implementation={generation_config.cache_implementation!r} is not supported by "
                    f"{type(self).__name__}; it uses {cache_cls.__name__}"
                )
            model_kwargs["cache"] = cache_cls(self.config)
            return None
        return default(self, generation_config, model_kwargs, *args, **kwargs)

    return [(cls, "_prepare_cache_for_generation", _prepare_cache_for_generation)]


def plan_patches(text_module: ModuleType, mm_module: ModuleType, cache_cls: type) -> list[Assignment]:
    """Every assignment the adapter makes to the checkpoint's modules and classes; mutates nothing."""
    plan: list[Assignment] = [
        (text_module, "KimiSparseMoeBlock", make_fused_block_class(text_module)),
        (text_module, "KimiDynamicCache", cache_cls),
        # the MLA core fused on CUDA, the KV quantizers on keys and values (mla.py)
        (text_module.KimiMLAAttention, "forward", mla.make_forward(vars(text_module.KimiMLAAttention)["forward"])),
    ]
    model_classes = (text_module.KimiLinearForCausalLM, text_module.KimiLinearModel,
                     mm_module.KimiK3ForConditionalGeneration)
    for cls in model_classes:
        plan += _shim_tie_weights(cls) + _shim_cache_keyword(cls)
    for cls in (text_module.KimiLinearForCausalLM, mm_module.KimiK3ForConditionalGeneration):
        plan += _shim_generation_cache(cls, cache_cls)
    # transformers decides from the class module's source text whether the experts implementation may be
    # chosen; the patched block supports it, so the answer is recorded on this checkpoint's base classes.
    for name in ("KimiLinearPreTrainedModel", "KimiLinearModel", "KimiLinearForCausalLM"):
        plan.append((text_module.__dict__[name], "_can_set_experts_implementation_cached_value", True))
    for name in ("KimiK3PreTrainedModel", "KimiK3ForConditionalGeneration"):
        plan.append((mm_module.__dict__[name], "_can_set_experts_implementation_cached_value", True))
    return plan


def is_patched(module: ModuleType) -> bool:
    return bool(module.__dict__.get(PATCHED_ATTR))


def apply_patches(text_module: ModuleType, mm_module: ModuleType, cache_cls: type) -> None:
    """Mutate the checkpoint's modules (call only after every check passed). Idempotent per module."""
    if is_patched(text_module):
        return
    plan = plan_patches(text_module, mm_module, cache_cls)
    for owner, name, value in plan:
        setattr(owner, name, value)
    mla.register_kv_quantizers(text_module.KimiMLAAttention)
    mla.register_kv_quantizers(text_module.KimiDeltaAttention, mla.NoKVCache)
    setattr(text_module, PATCHED_ATTR, True)
    setattr(mm_module, PATCHED_ATTR, True)
    logger.info("patched %d Kimi-K3 attributes in %s", len(plan), text_module.__name__)

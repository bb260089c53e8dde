"""Make the KDA kernels of a loaded Kimi-K3 remote module independent of fla-core's beta flag.

Upstream ``KimiDeltaAttention`` passes raw beta LOGITS with ``use_beta_sigmoid_in_kernel=True`` (and the
deprecated ``transpose_state_layout``); fla-core < 0.5.1 swallows the flag through ``**kwargs`` and runs the
recurrence on raw logits. ``plan_kda_patch`` validates the module's ``chunk_kda`` / ``fused_recurrent_kda``
without touching it; ``apply_kda_patch`` replaces both with wrappers that apply the sigmoid themselves and
pass ``use_beta_sigmoid_in_kernel=False``; ``undo_kda_patch`` restores the originals.

Beta numerics: the sigmoid is computed in fp32, as fla-core does it (``fused_beta_sigmoid`` before the chunk
kernel and the recurrent kernel both upcast the logits to fp32 first), then cast back to the logits' dtype.
fla-core 0.6.0 keeps the post-sigmoid beta in fp32, so fp32 logits give bit-identical beta while bf16 logits
get one extra bf16 rounding of beta (relative error <= 2**-9). With ``allow_neg_eigval`` the wrapper computes
``2 * sigmoid`` and passes ``allow_neg_eigval=False``, as the kernel would have done.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import logging
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
from packaging.version import InvalidVersion, Version

logger = logging.getLogger(__name__)

KERNEL_NAMES = ("chunk_kda", "fused_recurrent_kda")
TORCH_REFERENCES = {"chunk_kda": "torch_chunk_kda", "fused_recurrent_kda": "torch_recurrent_kda"}
STANDIN_MODULE = "modelopt_ext.models.kimi_k3.standin.modeling_kimi_linear"
FLA_DISTRIBUTION = "fla-core"
FLA_KDA_MODULE = "fla.ops.kda"
BETA_INDEX = 4  # q, k, v, g, beta
BETA_FLAG = "use_beta_sigmoid_in_kernel"
_MARK = "_modelopt_ext_kda_patch"  # set on our wrappers; its value is the KernelPlan
_VAR = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


class KdaPatchError(ValueError):
    """A KDA kernel cannot be planned, patched, or called safely."""


@dataclass(frozen=True)
class KernelPlan:
    name: str  # module-level name that gets replaced
    original: Callable  # what the module holds now (restored by undo)
    target: Callable  # what the wrapper calls: the original, or the torch reference on CPU
    origin: str  # "module", "standin", "torch-reference" or "fla"
    signature: inspect.Signature  # of `target`; every call is bound to it
    rename_state_layout: bool  # map `transpose_state_layout` to `state_v_first`

    @property
    def substituted(self) -> bool:
        return self.target is not self.original


@dataclass(frozen=True)
class KdaPatch:
    module_name: str
    kernels: tuple[KernelPlan, ...]  # empty: nothing to do (already patched)
    fla_version: str | None = None

    @property
    def is_noop(self) -> bool:
        return not self.kernels


def _fla_core_version() -> str | None:
    try:
        return importlib.metadata.version(FLA_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def _describe(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{name!r} from module {getattr(fn, '__module__', None)!r}"


def _is_ours(fn: Any) -> bool:
    return isinstance(getattr(fn, _MARK, None), KernelPlan)


def _origin(module: types.ModuleType, name: str, fn: Any) -> str:
    mod = getattr(fn, "__module__", None) or ""
    if mod == module.__name__:
        return "module"
    if mod == FLA_KDA_MODULE or mod.startswith(FLA_KDA_MODULE + "."):
        return "fla"
    if mod == STANDIN_MODULE:
        standin = importlib.import_module(STANDIN_MODULE)
        if fn is getattr(standin, name, None):
            return "standin"
        if any(fn is getattr(standin, ref, None) for ref in TORCH_REFERENCES.values()):
            return "torch-reference"
    raise KdaPatchError(
        f"{module.__name__}.{name} is {_describe(fn)}: expected the module's own kernel, fla-core's "
        f"{FLA_KDA_MODULE} kernel or the stand-in's torch reference; refusing an unknown function"
    )


def _check_fla_version(floor: str) -> str:
    found = _fla_core_version()
    try:
        ok = found is not None and Version(found) >= Version(floor)
    except InvalidVersion as exc:
        raise KdaPatchError(f"cannot compare {FLA_DISTRIBUTION} version {found!r} with floor {floor!r}: {exc}")
    if not ok:
        raise KdaPatchError(f"{FLA_DISTRIBUTION} {found or '(not installed)'} is below the required {floor}: "
                            f"older kernels ignore {BETA_FLAG} and run the recurrence on raw beta logits")
    return found


def _signature(module: types.ModuleType, name: str, fn: Any) -> inspect.Signature:
    try:
        sig = inspect.signature(fn)
    except Exception as exc:  # builtins, C functions, a __signature__ that raises
        raise KdaPatchError(f"{module.__name__}.{name} ({_describe(fn)}) has no introspectable signature: "
                            f"{exc!r}") from exc
    params = list(sig.parameters.values())
    beta = sig.parameters.get("beta")
    if beta is not None and beta.kind not in _VAR:
        if beta.kind is inspect.Parameter.KEYWORD_ONLY or 1 <= params.index(beta) <= BETA_INDEX:
            return sig
    elif any(p.kind is p.VAR_KEYWORD for p in params):
        if sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) <= BETA_INDEX:
            return sig  # a positional beta lands in *args (or fails to bind), a keyword one in **kwargs
    raise KdaPatchError(
        f"{module.__name__}.{name} ({_describe(fn)}) has signature {sig}: expected a `beta` parameter in "
        f"positional slots 2..5 or keyword-only, or **kwargs with at most 4 positional parameters"
    )


def plan_kda_patch(module: types.ModuleType, *, fla_floor: str = "0.5.1",
                   device_type: str | None = None) -> KdaPatch:
    """Validate `module`'s two KDA kernels and describe the patch; mutates nothing.

    Known kernels: defined in `module` itself, fla-core's ``fla.ops.kda`` (installed version >= `fla_floor`,
    checked only when the fla kernel will run) or the stand-in's dispatchers / torch references. With
    ``device_type == "cpu"`` fla kernels are replaced by the stand-in's torch reference (same arguments).
    Kernels already wrapped by `apply_kda_patch` are skipped, so a patched module plans nothing.
    """
    if not isinstance(module, types.ModuleType):
        raise KdaPatchError(f"expected a Python module, got {type(module).__qualname__}")
    namespace = vars(module)
    kernels, fla_version = [], None
    for name in KERNEL_NAMES:
        if name not in namespace:
            raise KdaPatchError(f"module {module.__name__!r} has no module-level {name!r}")
        fn = namespace[name]
        if _is_ours(fn):
            logger.debug("%s.%s is already patched", module.__name__, name)
            continue
        origin = _origin(module, name, fn)
        target = fn
        if origin == "fla" and getattr(device_type, "type", device_type) == "cpu":  # str or torch.device
            target = getattr(importlib.import_module(STANDIN_MODULE), TORCH_REFERENCES[name])
            logger.info("%s.%s: fla-core kernel on CPU, using the torch reference %s",
                        module.__name__, name, target.__qualname__)
        _signature(module, name, fn)
        if target is fn and origin == "fla":
            fla_version = _check_fla_version(fla_floor)
        sig = _signature(module, name, target)
        rename = "state_v_first" in sig.parameters and "transpose_state_layout" not in sig.parameters
        kernels.append(KernelPlan(name, fn, target, origin, sig, rename))
    return KdaPatch(module.__name__, tuple(kernels), fla_version)


class _Call:
    """One call's arguments bound to the target's signature; `beta` and flags by name or in **kwargs."""

    def __init__(self, plan: KernelPlan, args: tuple, kwargs: dict):
        self.plan, self.sig = plan, plan.signature
        try:
            self.bound = self.sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise KdaPatchError(f"{plan.name}: arguments do not fit {_describe(plan.target)}: {exc}") from exc
        params = self.sig.parameters.values()
        var = {p.kind: p.name for p in params if p.kind in _VAR}
        self.varkw = var.get(inspect.Parameter.VAR_KEYWORD)
        self.extra = self.bound.arguments.setdefault(self.varkw, {}) if self.varkw else {}
        self.varpos, self.beta_at = var.get(inspect.Parameter.VAR_POSITIONAL), None
        if self.varpos and not self._named("beta"):  # a positional beta that lands in *args: its index there
            at = BETA_INDEX - sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
            self.beta_at = at if 0 <= at < len(self.bound.arguments.get(self.varpos, ())) else None

    def _named(self, name: str) -> inspect.Parameter | None:
        p = self.sig.parameters.get(name)
        return p if p is not None and p.kind not in _VAR else None

    def given(self, name: str) -> bool:
        return name in (self.bound.arguments if self._named(name) else self.extra)

    def get(self, name: str, default: Any = None) -> Any:
        if name == "beta" and self.beta_at is not None:
            return self.bound.arguments[self.varpos][self.beta_at]
        p = self._named(name)
        if p is None:
            return self.extra.get(name, default)
        return self.bound.arguments.get(name, default if p.default is p.empty else p.default)

    def set(self, name: str, value: Any) -> None:
        if name == "beta" and self.beta_at is not None:
            rest = list(self.bound.arguments[self.varpos])
            rest[self.beta_at] = value
            self.bound.arguments[self.varpos] = tuple(rest)
        elif self._named(name):
            self.bound.arguments[name] = value
        elif self.varkw:
            self.extra[name] = value
        else:
            raise KdaPatchError(f"{self.plan.name}: {_describe(self.plan.target)} cannot take {name!r}")


def _make_wrapper(plan: KernelPlan) -> Callable:
    @functools.wraps(plan.original)
    def kda_kernel(*args, **kwargs):
        call = _Call(plan, args, kwargs)
        beta = call.get("beta")
        if not isinstance(beta, torch.Tensor):
            what = "is missing" if beta is None else f"must be a torch.Tensor, got {type(beta).__qualname__}"
            raise KdaPatchError(f"{plan.name}: beta (positional {BETA_INDEX} or keyword 'beta') {what}")
        if call.get(BETA_FLAG, False):
            scale = 2.0 if call.get("allow_neg_eigval", False) else 1.0
            post = torch.sigmoid(beta.float())
            call.set("beta", (post * scale if scale != 1.0 else post).to(beta.dtype))
            call.set(BETA_FLAG, False)
            if scale != 1.0:
                call.set("allow_neg_eigval", False)
        if plan.rename_state_layout and call.given("transpose_state_layout"):
            if call.given("state_v_first"):
                raise KdaPatchError(f"{plan.name}: got both state_v_first and transpose_state_layout")
            call.set("state_v_first", call.extra.pop("transpose_state_layout"))
        return plan.target(*call.bound.args, **call.bound.kwargs)

    setattr(kda_kernel, _MARK, plan)
    return kda_kernel


def apply_kda_patch(module: types.ModuleType, plan: KdaPatch) -> None:
    """Replace the planned module-level kernels with beta-sigmoid wrappers (checked before any change)."""
    if getattr(module, "__name__", None) != plan.module_name:
        raise KdaPatchError(f"plan is for module {plan.module_name!r}, got {getattr(module, '__name__', module)!r}")
    namespace = vars(module)
    for kp in plan.kernels:
        if namespace.get(kp.name) is not kp.original:
            raise KdaPatchError(f"{plan.module_name}.{kp.name} changed since planning: re-plan the patch")
    for kp in plan.kernels:
        namespace[kp.name] = _make_wrapper(kp)
        logger.info("patched %s.%s (%s kernel%s)", plan.module_name, kp.name, kp.origin,
                    ", torch reference on CPU" if kp.substituted else "")


def undo_kda_patch(module: types.ModuleType) -> tuple[str, ...]:
    """Restore the kernels replaced by `apply_kda_patch`; returns the restored names."""
    namespace, restored = vars(module), []
    for name in KERNEL_NAMES:
        fn = namespace.get(name)
        if _is_ours(fn):
            namespace[name] = fn.__wrapped__
            restored.append(name)
    if restored:
        logger.info("restored %s.%s", module.__name__, ", ".join(restored))
    return tuple(restored)

"""KDA kernel patch: planning validates without mutating, wrappers apply the beta sigmoid outside the kernel."""

import dataclasses
import functools
import importlib.util
import itertools
import types

import pytest
import torch

from modelopt_ext.models.kimi_k3 import kda
from modelopt_ext.models.kimi_k3.kda import BETA_FLAG, KdaPatchError, apply_kda_patch, plan_kda_patch, undo_kda_patch
from modelopt_ext.models.kimi_k3.standin import modeling_kimi_linear as standin

_COUNTER = itertools.count()
B, T, H, K, V = 2, 20, 2, 8, 8  # T > 16 crosses a chunk boundary of the torch reference


def load_copy():
    """An independent copy of the stand-in file, as a checkpoint load would give (own globals, own kernels)."""
    name = f"{standin.__package__}._kda_test_copy_{next(_COUNTER)}"
    spec = importlib.util.spec_from_file_location(name, standin.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def shallow_copy(name=None):
    """A ModuleType copy of the stand-in module's namespace (its functions still belong to the stand-in)."""
    mod = types.ModuleType(name or f"kda_test_shallow_{next(_COUNTER)}")
    mod.__dict__.update({k: v for k, v in vars(standin).items() if k not in ("__name__", "__spec__")})
    return mod


def own(module, fn, name=None):
    """Make `fn` look defined in `module` (the checkpoint's own code)."""
    fn.__module__ = module.__name__
    if name is not None:
        fn.__name__ = fn.__qualname__ = name
    return fn


def snapshot(module):
    return dict(vars(module))


def assert_unchanged(module, snap):
    now = vars(module)
    assert now.keys() == snap.keys()
    assert all(now[k] is snap[k] for k in snap)


def inputs(dtype, with_state, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v, g = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, T, H, K)
    beta = 3 * r(B, T, H)  # logits: raw use would be far outside [0, 1]
    kwargs = dict(A_log=r(H) * 0.5, dt_bias=r(H * K), scale=K**-0.5,
                  initial_state=r(B, H, V, K) if with_state else None, output_final_state=True,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  lower_bound=-5.0, transpose_state_layout=True)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta)), kwargs


class Spy:
    """A module-own kernel that records what it receives and runs the stand-in's torch reference."""

    def __init__(self, module, name, signature="dispatcher"):
        self.calls = []
        ref = getattr(standin, kda.TORCH_REFERENCES[name])
        if signature == "dispatcher":
            def kernel(q, k, v, g, beta, **kwargs):
                self.calls.append(((q, k, v, g, beta), dict(kwargs)))
                return ref(q, k, v, g, beta, **kwargs)
        else:  # keyword-only tail like fla's, no **kwargs
            def kernel(q, k, v, g, beta, *, use_beta_sigmoid_in_kernel=False, output_final_state=False):
                self.calls.append(((q, k, v, g, beta), dict(use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)))
                return ref(q, k, v, g, beta, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                           output_final_state=output_final_state)
        self.fn = own(module, kernel, name)
        setattr(module, name, self.fn)


def fake_fla(name, calls):
    """A stand-in for fla-core 0.6.0's kernel: fla's module name and the state_v_first keyword."""
    ref = getattr(standin, kda.TORCH_REFERENCES[name])

    def kernel(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
               output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
               use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False, lower_bound=None,
               state_v_first=False, cu_seqlens=None, **kwargs):
        calls.append(dict(beta=beta, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, kwargs=kwargs,
                          allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first))
        return ref(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   lower_bound=lower_bound, state_v_first=state_v_first, **kwargs)

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__module__ = "fla.ops.kda.chunk" if name == "chunk_kda" else "fla.ops.kda.fused_recurrent"
    return kernel


def fla_module(calls):
    mod = types.ModuleType(f"kda_test_fla_{next(_COUNTER)}")
    for name in kda.KERNEL_NAMES:
        setattr(mod, name, fake_fla(name, calls))
    return mod


@pytest.fixture
def fla_version(monkeypatch):
    def set_version(value):
        monkeypatch.setattr(kda, "_fla_core_version", lambda: value)
    set_version("0.6.0")
    return set_version


# ---------------------------------------------------------------------------------------------- planning


def test_plan_on_standin_mutates_nothing():
    snap = snapshot(standin)
    plan = plan_kda_patch(standin)
    assert_unchanged(standin, snap)
    assert plan.module_name == standin.__name__ and not plan.is_noop
    assert [kp.name for kp in plan.kernels] == ["chunk_kda", "fused_recurrent_kda"]
    assert all(kp.origin == "module" and not kp.substituted for kp in plan.kernels)
    assert plan.kernels[0].original is standin.chunk_kda and plan.fla_version is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.module_name = "other"


def test_plan_recognises_standin_functions_in_a_namespace_copy():
    mod = shallow_copy()
    mod.fused_recurrent_kda = standin.torch_recurrent_kda
    plan = plan_kda_patch(mod, device_type="cpu")
    assert [kp.origin for kp in plan.kernels] == ["standin", "torch-reference"]
    assert not any(kp.substituted for kp in plan.kernels)  # only fla kernels are substituted on CPU


# --------------------------------------------------------------------------------------- apply: numerics


@pytest.mark.parametrize("name", kda.KERNEL_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_state", [False, True])
def test_wrapped_kernel_matches_original(name, dtype, with_state):
    mod = load_copy()
    original = getattr(mod, name)
    (q, k, v, g, beta), kwargs = inputs(dtype, with_state)
    if name == "chunk_kda":
        kwargs["safe_gate"] = True
    o_ref, s_ref = original(q, k, v, g, beta, **kwargs)
    apply_kda_patch(mod, plan_kda_patch(mod))
    wrapped = getattr(mod, name)
    assert wrapped is not original and wrapped.__wrapped__ is original and wrapped.__name__ == name
    o, s = wrapped(q, k, v, g, beta, **kwargs)
    assert o.dtype == dtype and s.dtype == torch.float32
    if dtype == torch.float32:  # sigmoid in fp32 either way: identical beta
        torch.testing.assert_close(o, o_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=1e-6)
    else:  # the wrapper's beta carries one bf16 rounding: exact against the original fed that beta
        pre = torch.sigmoid(beta.float()).to(torch.bfloat16)
        o_pre, s_pre = original(q, k, v, g, pre, **{**kwargs, "use_beta_sigmoid_in_kernel": False})
        torch.testing.assert_close(o, o_pre, rtol=0, atol=0)
        torch.testing.assert_close(s, s_pre, rtol=0, atol=0)
        torch.testing.assert_close(o, o_ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(s, s_ref, rtol=1e-2, atol=1e-2)
    assert torch.isfinite(o.float()).all()


@pytest.mark.parametrize("name", kda.KERNEL_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_original_receives_post_sigmoid_beta_and_flag_false(name, dtype):
    mod = shallow_copy()
    spy = Spy(mod, name)
    (q, k, v, g, beta), kwargs = inputs(dtype, with_state=True)
    apply_kda_patch(mod, plan_kda_patch(mod))
    getattr(mod, name)(q, k, v, g, beta, **kwargs)
    (args, got), = spy.calls
    assert got["use_beta_sigmoid_in_kernel"] is False
    assert got["transpose_state_layout"] is True  # the dispatcher names neither alias: left alone
    assert args[4].dtype == dtype and args[4].shape == beta.shape
    assert torch.equal(args[4], torch.sigmoid(beta.float()).to(dtype))
    assert all(a is b for a, b in zip(args[:4], (q, k, v, g)))
    assert got["initial_state"] is kwargs["initial_state"]


def test_beta_by_keyword_and_falsy_flag_passes_beta_untouched():
    mod = shallow_copy()
    spy = Spy(mod, "chunk_kda", signature="keyword-only")
    apply_kda_patch(mod, plan_kda_patch(mod))
    (q, k, v, g, beta), _ = inputs(torch.float32, False)
    mod.chunk_kda(q, k, v, g, beta=beta)
    mod.chunk_kda(q, k, v, g, beta, use_beta_sigmoid_in_kernel=0)
    assert all(call[0][4] is beta and call[1]["use_beta_sigmoid_in_kernel"] in (False, 0) for call in spy.calls)
    mod.chunk_kda(q, k, v, g, beta=beta, use_beta_sigmoid_in_kernel=True)
    assert torch.equal(spy.calls[-1][0][4], torch.sigmoid(beta)) and spy.calls[-1][1] == {
        "use_beta_sigmoid_in_kernel": False}


# ------------------------------------------------------------------------------ idempotence, undo, copies


def test_idempotent_and_undo():
    mod = load_copy()
    originals = [getattr(mod, n) for n in kda.KERNEL_NAMES]
    apply_kda_patch(mod, plan_kda_patch(mod))
    wrappers = [getattr(mod, n) for n in kda.KERNEL_NAMES]
    snap = snapshot(mod)
    again = plan_kda_patch(mod)
    assert again.is_noop and again.kernels == ()
    apply_kda_patch(mod, again)
    assert_unchanged(mod, snap)
    assert [getattr(mod, n) for n in kda.KERNEL_NAMES] == wrappers
    assert undo_kda_patch(mod) == kda.KERNEL_NAMES
    assert all(getattr(mod, n) is o for n, o in zip(kda.KERNEL_NAMES, originals))
    assert undo_kda_patch(mod) == ()
    assert not plan_kda_patch(mod).is_noop


def test_patch_and_undo_on_the_standin_module_itself():
    originals = (standin.chunk_kda, standin.fused_recurrent_kda)
    try:
        apply_kda_patch(standin, plan_kda_patch(standin))
        assert standin.chunk_kda.__wrapped__ is originals[0]
        assert plan_kda_patch(standin).is_noop
    finally:
        undo_kda_patch(standin)
    assert (standin.chunk_kda, standin.fused_recurrent_kda) == originals


def test_two_module_copies_are_patched_independently():
    a, b = load_copy(), load_copy()
    b_snap = snapshot(b)
    apply_kda_patch(a, plan_kda_patch(a))
    assert_unchanged(b, b_snap)
    plan_b = plan_kda_patch(b)
    assert not plan_b.is_noop and plan_b.kernels[0].original is b.chunk_kda
    apply_kda_patch(b, plan_b)
    undo_kda_patch(a)
    assert a.chunk_kda is a.__dict__["chunk_kda"] and not hasattr(a.chunk_kda, "__wrapped__")
    assert b.chunk_kda.__wrapped__ is b_snap["chunk_kda"]


def test_apply_refuses_a_stale_or_foreign_plan():
    a, b = load_copy(), load_copy()
    plan = plan_kda_patch(a)
    snap_b = snapshot(b)
    with pytest.raises(KdaPatchError, match=f"plan is for module '{a.__name__}'"):
        apply_kda_patch(b, plan)
    assert_unchanged(b, snap_b)
    a.fused_recurrent_kda = a.torch_recurrent_kda
    snap_a = snapshot(a)
    with pytest.raises(KdaPatchError, match="fused_recurrent_kda changed since planning"):
        apply_kda_patch(a, plan)
    assert_unchanged(a, snap_a)  # chunk_kda was not replaced either


# ------------------------------------------------------------------------------------- planning refusals


def _refused(mod, match, **plan_kwargs):
    snap = snapshot(mod)
    with pytest.raises(KdaPatchError, match=match):
        plan_kda_patch(mod, **plan_kwargs)
    assert_unchanged(mod, snap)


def test_refuses_missing_name():
    mod = shallow_copy("kda_missing")
    del mod.fused_recurrent_kda
    _refused(mod, "module 'kda_missing' has no module-level 'fused_recurrent_kda'")


def test_refuses_unknown_foreign_function():
    mod = shallow_copy()

    def foreign_kda(q, k, v, g, beta, **kwargs):
        raise AssertionError("never called")

    mod.chunk_kda = foreign_kda
    _refused(mod, r"chunk_kda is '.*foreign_kda' from module '.*test_kda': expected .*refusing an unknown")
    mod.chunk_kda = types.SimpleNamespace(__module__="fla.ops.kda_evil", __qualname__="chunk_kda")
    _refused(mod, "'chunk_kda' from module 'fla.ops.kda_evil'")


class _NoSignature:
    @property
    def __signature__(self):
        raise RuntimeError("signature unavailable")

    def __call__(self, *args, **kwargs):
        raise AssertionError("never called")


@pytest.mark.parametrize("make", [lambda: functools.partial(torch.sigmoid), _NoSignature])
def test_refuses_uninspectable_callable(make):
    mod = shallow_copy()
    fn = make()
    fn.__module__ = mod.__name__  # passes the origin check; the signature check must catch it
    mod.chunk_kda = fn
    _refused(mod, r"chunk_kda \(.*\) has no introspectable signature")


@pytest.mark.parametrize("bad", ["def f(q, k, v, g, b): pass", "def f(q, k, v, g, x, beta): pass",
                                 "def f(beta, q, k, v, g): pass", "def f(q, k, v, g, *beta): pass",
                                 "def f(q, k, v, g, b, **kwargs): pass"])
def test_refuses_signature_without_bindable_beta(bad):
    mod = shallow_copy()
    namespace = {}
    exec(bad, namespace)  # noqa: S102 - a tiny literal signature under test
    mod.fused_recurrent_kda = own(mod, namespace["f"])
    _refused(mod, r"fused_recurrent_kda \(.*\) has signature .*expected a `beta` parameter")


def test_refuses_fla_below_floor(fla_version):
    mod = fla_module([])
    fla_version("0.4.9")
    _refused(mod, r"fla-core 0\.4\.9 is below the required 0\.5\.1")
    _refused(mod, r"fla-core 0\.4\.9 is below the required 0\.5\.1", device_type="cuda")
    fla_version(None)
    _refused(mod, r"fla-core \(not installed\) is below the required 0\.5\.1")
    fla_version("0.6.0")
    _refused(mod, r"fla-core 0\.6\.0 is below the required 0\.7", fla_floor="0.7")
    fla_version("not-a-version")
    _refused(mod, "cannot compare fla-core version 'not-a-version'")


# ------------------------------------------------------------------------------------- fla kernels


def test_fla_kernels_get_post_sigmoid_beta_and_state_v_first(fla_version):
    calls = []
    mod = fla_module(calls)
    plan = plan_kda_patch(mod, device_type="cuda")
    assert plan.fla_version == "0.6.0"
    assert all(kp.origin == "fla" and kp.rename_state_layout and not kp.substituted for kp in plan.kernels)
    apply_kda_patch(mod, plan)
    (q, k, v, g, beta), kwargs = inputs(torch.float32, with_state=True)
    mod.fused_recurrent_kda(q, k, v, g, beta, **kwargs)
    got, = calls
    assert got["use_beta_sigmoid_in_kernel"] is False and got["state_v_first"] is True
    assert "transpose_state_layout" not in got["kwargs"]
    assert torch.equal(got["beta"], torch.sigmoid(beta))
    mod.chunk_kda(q, k, v, g, beta, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    assert calls[-1]["allow_neg_eigval"] is False and torch.equal(calls[-1]["beta"], 2 * torch.sigmoid(beta))
    with pytest.raises(KdaPatchError, match="both state_v_first and transpose_state_layout"):
        mod.chunk_kda(q, k, v, g, beta, state_v_first=True, transpose_state_layout=True)


def test_fla_kernels_on_cpu_use_the_torch_reference(fla_version):
    calls = []
    mod = fla_module(calls)
    fla_version("0.4.0")  # the fla kernel never runs on CPU, so its version does not matter there
    plan = plan_kda_patch(mod, device_type="cpu")
    assert [kp.target for kp in plan.kernels] == [standin.torch_chunk_kda, standin.torch_recurrent_kda]
    assert all(kp.substituted and not kp.rename_state_layout for kp in plan.kernels)
    apply_kda_patch(mod, plan)
    assert mod.chunk_kda.__wrapped__ is plan.kernels[0].original
    (q, k, v, g, beta), kwargs = inputs(torch.float32, with_state=True)
    for name, ref in (("chunk_kda", standin.torch_chunk_kda), ("fused_recurrent_kda", standin.torch_recurrent_kda)):
        o, s = getattr(mod, name)(q, k, v, g, beta, **kwargs)
        o_ref, s_ref = ref(q, k, v, g, beta, **kwargs)
        torch.testing.assert_close(o, o_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=1e-6)
    assert calls == []


# --------------------------------------------------------------------------------------- call refusals


def test_call_refuses_non_tensor_or_missing_beta():
    mod = load_copy()
    apply_kda_patch(mod, plan_kda_patch(mod))
    snap = snapshot(mod)
    (q, k, v, g, beta), kwargs = inputs(torch.float32, with_state=False)
    with pytest.raises(KdaPatchError, match=r"chunk_kda: beta .* must be a torch.Tensor, got float"):
        mod.chunk_kda(q, k, v, g, 0.5, **kwargs)
    with pytest.raises(KdaPatchError, match=r"fused_recurrent_kda: beta .* must be a torch.Tensor, got list"):
        mod.fused_recurrent_kda(q, k, v, g, beta=[0.5], **kwargs)
    with pytest.raises(KdaPatchError, match="chunk_kda: arguments do not fit .*missing a required argument: 'beta'"):
        mod.chunk_kda(q, k, v, g, **kwargs)
    assert_unchanged(mod, snap)


@pytest.mark.parametrize("head", ["", "q, ", "q, k, v, g, "])
def test_varargs_kernel_gets_positional_beta_at_index_4(head):
    mod = shallow_copy()
    seen = []
    namespace = {"seen": seen}
    exec(f"def chunk_kda({head}*args, **kwargs):\n    seen.append((({head}) + args, kwargs))", namespace)  # noqa: S102
    mod.chunk_kda = own(mod, namespace["chunk_kda"])
    apply_kda_patch(mod, plan_kda_patch(mod))
    (q, k, v, g, beta), _ = inputs(torch.bfloat16, with_state=False)
    mod.chunk_kda(q, k, v, g, beta, use_beta_sigmoid_in_kernel=True)
    mod.chunk_kda(q, k, v, g, beta=beta, use_beta_sigmoid_in_kernel=True)
    post = torch.sigmoid(beta.float()).to(beta.dtype)
    (args, kw), (args2, kw2) = seen
    assert len(args) == 5 and args[3] is g and torch.equal(args[4], post) and kw == {BETA_FLAG: False}
    assert len(args2) == 4 and torch.equal(kw2["beta"], post) and kw2[BETA_FLAG] is False


def test_call_refuses_missing_beta_through_kwargs():
    mod = shallow_copy()
    mod.chunk_kda = own(mod, lambda q, k, v, g, **kwargs: (_ for _ in ()).throw(AssertionError), "chunk_kda")
    apply_kda_patch(mod, plan_kda_patch(mod))
    (q, k, v, g, beta), kwargs = inputs(torch.float32, with_state=False)
    with pytest.raises(KdaPatchError, match=r"chunk_kda: beta \(positional 4 or keyword 'beta'\) is missing"):
        mod.chunk_kda(q, k, v, g, **kwargs)


def test_kda_layer_forward_unchanged_by_the_patch():
    mod = load_copy()
    config = mod.KimiLinearConfig(hidden_size=32, linear_attn_config=dict(
        num_heads=2, head_dim=8, short_conv_kernel_size=4, gate_lower_bound=-5.0))
    torch.manual_seed(0)
    layer = mod.KimiDeltaAttention(config, layer_idx=0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(2, T, 32)
    with torch.no_grad():
        ref = layer(x)
        apply_kda_patch(mod, plan_kda_patch(mod, device_type="cpu"))
        out = layer(x)
    assert mod.chunk_kda.__wrapped__ is not mod.chunk_kda
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)

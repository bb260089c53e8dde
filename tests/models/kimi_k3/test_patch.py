"""Patches of one checkpoint's remote-code modules (modelopt_ext.models.kimi_k3.patch).

Remote modules come from COPIES of the tiny checkpoint imported through transformers' dynamic-module
machinery, so every copy has its own module objects and nothing here touches `tiny_ckpt`'s own modules.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from modelopt_ext.models.kimi_k3 import patch
from modelopt_ext.models.kimi_k3.cache import KimiHybridCache
from modelopt_ext.models.kimi_k3.experts import KimiK3Experts, KimiK3PackedExperts
from modelopt_ext.models.kimi_k3.standin.configuration_kimi_k3 import KimiLinearConfig
from modelopt_ext.testing.checkpoints import copy_checkpoint

MM_REF = "modeling_kimi_k3.KimiK3ForConditionalGeneration"
_COUNTER = itertools.count()


def remote_modules(tiny_ckpt, tmp_path_factory, stem):
    """(text_module, mm_module) of a fresh copy of the tiny checkpoint, imported but not patched."""
    name = f"patchtest_{stem}_{next(_COUNTER)}"
    copy = copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("copies"), name)
    cls = get_class_from_dynamic_module(MM_REF, str(copy), local_files_only=True)
    mm = sys.modules[cls.__module__]
    text = sys.modules[mm.KimiLinearForCausalLM.__module__]
    assert f".{name}." in mm.__name__ and f".{name}." in text.__name__
    assert not patch.is_patched(text) and not patch.is_patched(mm)
    return text, mm


@pytest.fixture(scope="module")
def upstream(tiny_ckpt, tmp_path_factory):
    """A copy that no test patches: the upstream classes to compare against."""
    return remote_modules(tiny_ckpt, tmp_path_factory, "upstream")


@pytest.fixture
def fresh(tiny_ckpt, tmp_path_factory):
    return remote_modules(tiny_ckpt, tmp_path_factory, "fresh")


CLASSES_TOUCHED = (
    ("text", "KimiLinearForCausalLM"), ("text", "KimiLinearModel"), ("text", "KimiLinearPreTrainedModel"),
    ("text", "KimiMLAAttention"), ("mm", "KimiK3ForConditionalGeneration"), ("mm", "KimiK3PreTrainedModel"),
)


def snapshot(text, mm):
    mods = {"text": text, "mm": mm}
    return {
        "text": dict(vars(text)),
        "mm": dict(vars(mm)),
        **{f"{m}.{c}": dict(vars(getattr(mods[m], c))) for m, c in CLASSES_TOUCHED},
    }


def assert_same(before, after):
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].keys() == after[key].keys(), key
        changed = [k for k in before[key] if before[key][k] is not after[key][k]]
        assert not changed, f"{key}: {changed}"


# ----------------------------------------------------------------------------------------------------
# plan / apply / missing


def test_plan_patches_mutates_nothing(fresh):
    text, mm = fresh
    before = snapshot(text, mm)
    plan = patch.plan_patches(text, mm, KimiHybridCache)
    assert_same(before, snapshot(text, mm))
    assert not patch.is_patched(text) and not patch.is_patched(mm)
    targets = {(owner, name) for owner, name, _ in plan}
    assert (text, "KimiSparseMoeBlock") in targets and (text, "KimiDynamicCache") in targets
    planned = {(owner, name): value for owner, name, value in plan}
    assert planned[(text, "KimiDynamicCache")] is KimiHybridCache
    block = planned[(text, "KimiSparseMoeBlock")]
    assert block is not text.KimiSparseMoeBlock and block.__module__ == text.__name__
    # every assignment lands on this checkpoint's own modules or classes
    own = {text, mm} | {getattr({"text": text, "mm": mm}[m], c) for m, c in CLASSES_TOUCHED}
    assert {owner for owner, _ in targets} <= own


def test_apply_patches_replaces_idempotent_and_per_module(tiny_ckpt, tmp_path_factory, upstream):
    text, mm = remote_modules(tiny_ckpt, tmp_path_factory, "apply")
    other_text, other_mm = remote_modules(tiny_ckpt, tmp_path_factory, "other")
    orig_block = text.KimiSparseMoeBlock
    orig_forward = vars(text.KimiLinearForCausalLM)["forward"]
    other_before = snapshot(other_text, other_mm)

    patch.apply_patches(text, mm, KimiHybridCache)
    assert text.KimiSparseMoeBlock is not orig_block and not hasattr(text.KimiSparseMoeBlock, "moe_infer")
    assert text.KimiDynamicCache is KimiHybridCache
    assert vars(text)[patch.PATCHED_ATTR] is True and vars(mm)[patch.PATCHED_ATTR] is True
    assert patch.is_patched(text) and patch.is_patched(mm)
    new_forward = vars(text.KimiLinearForCausalLM)["forward"]
    assert new_forward is not orig_forward and new_forward.__wrapped__ is orig_forward
    assert "cache" in inspect.signature(new_forward, follow_wrapped=False).parameters
    assert "_prepare_cache_for_generation" in vars(mm.KimiK3ForConditionalGeneration)

    first = snapshot(text, mm)
    patch.apply_patches(text, mm, KimiHybridCache)  # idempotent: nothing re-planned or re-wrapped
    assert_same(first, snapshot(text, mm))

    # the other copy (and the module-scoped upstream copy) keep their upstream classes
    assert_same(other_before, snapshot(other_text, other_mm))
    for t, m in ((other_text, other_mm), upstream):
        assert not patch.is_patched(t) and not patch.is_patched(m)
        assert patch.PATCHED_ATTR not in vars(t) and patch.PATCHED_ATTR not in vars(m)
        assert hasattr(t.KimiSparseMoeBlock, "moe_infer")
        assert t.KimiDynamicCache is not KimiHybridCache
    # a model built from the patched module gets fused experts; from the other copy, the per-expert list
    config = small_config()
    assert isinstance(text.KimiDecoderLayer(config, 1).block_sparse_moe.experts, KimiK3Experts)
    assert isinstance(other_text.KimiDecoderLayer(config, 1).block_sparse_moe.experts, nn.ModuleList)


def _module_copy(module, name, drop=(), replace=None):
    fake = types.ModuleType(name)
    fake.__dict__.update({k: v for k, v in vars(module).items() if k not in ("__name__", "__spec__")})
    for k in drop:
        del fake.__dict__[k]
    fake.__dict__.update(replace or {})
    return fake


def test_missing_classes(upstream):
    text, mm = upstream
    assert patch.missing_classes(text, mm) == []
    t2 = _module_copy(text, "fake_text", drop=["KimiMoEGate"], replace={"KimiRMSNorm": lambda *a: None})
    m2 = _module_copy(mm, "fake_mm", drop=["KimiK3PreTrainedModel"])
    assert patch.missing_classes(t2, mm) == ["fake_text.KimiMoEGate", "fake_text.KimiRMSNorm"]
    assert patch.missing_classes(t2, m2) == ["fake_text.KimiMoEGate", "fake_text.KimiRMSNorm",
                                             "fake_mm.KimiK3PreTrainedModel"]
    assert patch.missing_classes(text, m2) == ["fake_mm.KimiK3PreTrainedModel"]
    # the real modules were not touched by building the fakes
    assert inspect.isclass(vars(text)["KimiMoEGate"]) and inspect.isclass(vars(mm)["KimiK3PreTrainedModel"])


# ----------------------------------------------------------------------------------------------------
# shims on synthetic classes


def _apply(assignments):
    for owner, name, value in assignments:
        setattr(owner, name, value)


def test_shim_tie_weights_wraps_only_own_definitions():
    class Upstream:
        def __init__(self):
            self.calls = 0

        def tie_weights(self):
            self.calls += 1
            return "tied"

    class Child(Upstream):
        pass

    class Modern:
        def tie_weights(self, **kwargs):
            return kwargs

    with pytest.raises(TypeError):
        Upstream().tie_weights(missing_keys=set(), recompute_mapping=False)
    assert patch._shim_tie_weights(Child) == []
    assert patch._shim_tie_weights(Modern) == []
    assert patch._shim_tie_weights(object) == []

    plan = patch._shim_tie_weights(Upstream)
    assert len(plan) == 1 and plan[0][:2] == (Upstream, "tie_weights")
    original = Upstream.__dict__["tie_weights"]
    _apply(plan)
    assert Upstream.__dict__["tie_weights"] is not original
    obj = Upstream()
    assert obj.tie_weights(missing_keys={"a"}, recompute_mapping=True) == "tied"
    assert obj.tie_weights() == "tied"
    assert obj.calls == 2
    assert "tie_weights" not in Child.__dict__  # not given its own copy
    assert Child().tie_weights(recompute_mapping=False) == "tied"


def test_shim_cache_keyword():
    class Upstream:
        def forward(self, x, past_key_values=None, **kwargs):
            return x, past_key_values, kwargs

    class Child(Upstream):
        pass

    class Modern:
        def forward(self, x, cache=None):
            return cache

    assert patch._shim_cache_keyword(Child) == []
    assert patch._shim_cache_keyword(Modern) == []
    plan = patch._shim_cache_keyword(Upstream)
    assert len(plan) == 1 and plan[0][:2] == (Upstream, "forward")
    _apply(plan)
    m, c, other = Upstream(), object(), object()
    assert m.forward(1, cache=c) == (1, c, {})
    assert m.forward(1, past_key_values=c) == (1, c, {})
    assert m.forward(1, cache=c, past_key_values=c) == (1, c, {})  # the same object twice is fine
    assert m.forward(1, cache=c, past_key_values=None) == (1, c, {})
    assert m.forward(1, cache=None, extra=3) == (1, None, {"extra": 3})
    with pytest.raises(ValueError, match="either `cache` or `past_key_values`"):
        m.forward(1, cache=c, past_key_values=other)


class _Cache:
    def __init__(self, config):
        self.config = config


class _Base:
    def __init__(self):
        self.config = SimpleNamespace(name="cfg")
        self.default_calls = []

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        self.default_calls.append((generation_config, dict(model_kwargs), args, kwargs))
        return "default"


def _gen(use_cache=True, cache_implementation=None):
    return SimpleNamespace(use_cache=use_cache, cache_implementation=cache_implementation)


def test_shim_generation_cache():
    class Model(_Base):
        pass

    class Own(_Base):
        def _prepare_cache_for_generation(self, *a, **k):
            return "own"

    assert patch._shim_generation_cache(Own, _Cache) == []
    plan = patch._shim_generation_cache(Model, _Cache)
    assert len(plan) == 1 and plan[0][:2] == (Model, "_prepare_cache_for_generation")
    _apply(plan)

    m = Model()
    for use_cache in (True, None):  # anything but False caches
        kw = {}
        assert m._prepare_cache_for_generation(_gen(use_cache), kw, "assistant", 2, device="cpu") is None
        assert isinstance(kw["cache"], _Cache) and kw["cache"].config is m.config
    assert m.default_calls == []

    mine = object()
    kw = {"cache": mine}
    assert m._prepare_cache_for_generation(_gen(), kw, "assistant", device="cpu") == "default"
    assert kw["cache"] is mine
    assert m.default_calls[-1][1:] == ({"cache": mine}, ("assistant",), {"device": "cpu"})

    kw = {}
    assert m._prepare_cache_for_generation(_gen(False), kw) == "default"
    assert "cache" not in kw or kw["cache"] is None
    assert len(m.default_calls) == 2

    kw = {}
    with pytest.raises(ValueError, match="static") as exc:
        m._prepare_cache_for_generation(_gen(cache_implementation="static"), kw)
    assert "_Cache" in str(exc.value) and "cache" not in kw
    # a caller's cache wins over the refusal (nothing to build)
    assert m._prepare_cache_for_generation(_gen(cache_implementation="static"), {"cache": mine}) == "default"


# ----------------------------------------------------------------------------------------------------
# the fused block against the upstream block


def small_config(**overrides) -> KimiLinearConfig:
    kw = dict(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        num_experts=8, num_experts_per_token=3, moe_intermediate_size=32, num_shared_experts=1,
        routed_expert_hidden_size=32, attn_res_block_size=2, routed_scaling_factor=2.5,
        linear_attn_config={"full_attn_layers": [3], "kda_layers": [1, 2], "num_heads": 2, "head_dim": 8,
                            "short_conv_kernel_size": 4, "use_full_rank_gate": True, "gate_lower_bound": -5.0},
    )
    kw.update(overrides)
    return KimiLinearConfig(**kw)


def _randomize(module: nn.Module, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.5 if "bias" in name else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if name.endswith("norm.weight") else 0.0))


def _fused_state(upstream_block: nn.Module) -> dict[str, torch.Tensor]:
    """The upstream block's weights in the fused layout: gate_up = [w1 rows; w3 rows], down = w2."""
    sd = {k: v for k, v in upstream_block.state_dict().items() if not k.startswith("experts.")}
    ex = upstream_block.experts
    sd["experts.gate_up_proj"] = torch.stack([torch.cat([e.w1.weight, e.w3.weight], dim=0) for e in ex])
    sd["experts.down_proj"] = torch.stack([e.w2.weight for e in ex])
    return sd


@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("variant", [{}, {"latent_moe_use_norm": False, "num_shared_experts": 0}],
                         ids=["norm+shared", "plain"])
def test_fused_block_matches_upstream_block(upstream, impl, variant):
    text, _ = upstream
    config = small_config(**variant)
    ref = text.KimiSparseMoeBlock(config)
    _randomize(ref, 0)
    fused_cls = patch.make_fused_block_class(text)
    with patch.expert_storage("dense"):
        fused = fused_cls(config)
    assert isinstance(fused.experts, KimiK3Experts)
    fused.load_state_dict(_fused_state(ref), strict=True)
    config._experts_implementation = impl
    ref.eval(), fused.eval()

    x = torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x)
        got = fused(x)
    assert got.shape == want.shape == x.shape
    assert want.abs().max() > 0.1  # outputs are not vanishingly small
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
    # routed experts matter: breaking one expert changes the output
    idx, _ = ref.gate(x.reshape(-1, config.hidden_size))
    used = int(idx[0, 0])
    with torch.no_grad():
        fused.experts.down_proj[used] += 1.0
        assert not torch.allclose(fused(x), want, atol=1e-3)


def test_fused_block_matches_upstream_block_bf16(upstream):
    text, _ = upstream
    config = small_config()
    ref = text.KimiSparseMoeBlock(config)
    _randomize(ref, 4)
    with patch.expert_storage("dense"):
        fused = patch.make_fused_block_class(text)(config)
    fused.load_state_dict(_fused_state(ref))
    ref, fused = ref.to(torch.bfloat16).eval(), fused.to(torch.bfloat16).eval()
    x = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
    with torch.no_grad():
        want, got = ref(x), fused(x)
    assert got.dtype == want.dtype == torch.bfloat16
    # same rounding points as upstream (bf16 expert outputs, fp32 weighted sum): equal to bf16 resolution
    torch.testing.assert_close(got, want, rtol=8e-3, atol=8e-3)


def test_fused_block_trains(upstream):
    text, _ = upstream
    config = small_config()
    ref = text.KimiSparseMoeBlock(config)
    _randomize(ref, 2)
    with pytest.raises(NotImplementedError):
        ref.train()(torch.randn(1, 3, config.hidden_size))  # upstream refuses training

    with patch.expert_storage("dense"):
        fused = patch.make_fused_block_class(text)(config)
    fused.load_state_dict(_fused_state(ref))
    fused.train()
    x = torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(3))
    fused(x).square().mean().backward()
    for name in ("experts.gate_up_proj", "experts.down_proj", "gate.weight", "routed_expert_down_proj.weight",
                 "routed_expert_up_proj.weight", "routed_expert_norm.weight", "shared_experts.gate_proj.weight"):
        grad = fused.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_expert_storage_context(upstream):
    text, _ = upstream
    cls = patch.make_fused_block_class(text)
    config = small_config()
    assert isinstance(cls(config).experts, KimiK3Experts)  # default
    with patch.expert_storage("mxfp4"):
        assert isinstance(cls(config).experts, KimiK3PackedExperts)
        with patch.expert_storage("dense"):
            assert isinstance(cls(config).experts, KimiK3Experts)
        assert isinstance(cls(config).experts, KimiK3PackedExperts)
    assert isinstance(cls(config).experts, KimiK3Experts)
    with pytest.raises(ValueError, match="'bogus'"):
        with patch.expert_storage("bogus"):
            pass
    with pytest.raises(RuntimeError):
        with patch.expert_storage("mxfp4"):
            raise RuntimeError("x")
    assert isinstance(cls(config).experts, KimiK3Experts)  # reset after an exception too

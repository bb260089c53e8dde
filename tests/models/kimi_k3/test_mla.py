"""Kimi-K3's patched MLA forward (modelopt_ext.models.kimi_k3.mla): the remote math on CPU bit for bit, the
fused core against it, the KV quantizers where ModelOpt's rewrite would put them, no source rewrite."""

from __future__ import annotations

import warnings

import pytest
import torch

from modelopt_ext.models.kimi_k3 import mla, patch
from modelopt_ext.models.kimi_k3.cache import KimiHybridCache

from .test_patch import remote_modules


@pytest.fixture(scope="module")
def modules(tiny_ckpt, tmp_path_factory):
    """(upstream text module, patched text module): two copies of the tiny checkpoint's remote code."""
    upstream, _ = remote_modules(tiny_ckpt, tmp_path_factory, "mla_upstream")
    text, mm = remote_modules(tiny_ckpt, tmp_path_factory, "mla_patched")
    patch.apply_patches(text, mm, KimiHybridCache)
    return upstream, text


def _config():
    from modelopt_ext.models.kimi_k3.standin.configuration_kimi_k3 import KimiLinearConfig

    return KimiLinearConfig(hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16,
                            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mla_use_output_gate=True,
                            mla_use_nope=True)


def _pair(modules, dtype):
    upstream, text = modules
    cfg = _config()
    torch.manual_seed(0)
    theirs = upstream.KimiMLAAttention(cfg, layer_idx=0).to(dtype)
    ours = text.KimiMLAAttention(cfg, layer_idx=0).to(dtype)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_cpu_forward_is_the_remote_forward_bit_for_bit(modules, dtype, masked):
    theirs, ours = _pair(modules, dtype)
    assert hasattr(type(ours).forward, "__wrapped__") and not hasattr(type(theirs).forward, "__wrapped__")
    x = torch.randn(3, 11, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    mask = None
    if masked:
        mask = torch.ones(3, 11, dtype=torch.long)
        mask[1, :4] = 0  # left padding: queries 0-3 of row 1 see no key
    with torch.no_grad():
        assert torch.equal(ours(x, attention_mask=mask), theirs(x, attention_mask=mask))


def _qkv(B, h, S, L, dq, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, h, S, dq, generator=g).to(dtype), torch.randn(B, h, L, dq, generator=g).to(dtype),
            torch.randn(B, h, L, dv, generator=g).to(dtype))


@pytest.mark.parametrize("case", ["causal", "padding", "cache"])
def test_fused_core_matches_the_remote_core(case):
    """SDPA (run here on CPU tensors) against the remote fp32 core: causal, a padded batch with a query that sees
    no key (the remote code gives it the uniform mix), and queries at the end of a longer cache."""
    S, L = (5, 12) if case == "cache" else (12, 12)
    q, k, v = _qkv(2, 3, S, L, 24, 16, torch.float32, seed=2)
    mask = None
    if case == "padding":
        mask = torch.ones(2, L, dtype=torch.long)
        mask[0, :5] = 0
    scale = 24 ** -0.5
    ref = mla.remote_core(q, k, v, scale, mask)
    got = mla.fused_core(q, k, v, scale, mask)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    if case == "padding":  # the fully masked queries: the mean of the values, as in the remote code
        torch.testing.assert_close(got[0, :, :4], v[0].mean(dim=1, keepdim=True).expand(3, 4, 16), rtol=1e-5,
                                   atol=1e-5)


def test_fused_core_in_bf16_rounds_only_the_probabilities():
    """bf16 inputs: the fused core differs from the remote one (fp32 core, then cast) by about the rounding of
    the probabilities and of the output, never more than a few bf16 steps of the largest output."""
    q, k, v = _qkv(2, 4, 64, 64, 24, 16, torch.bfloat16, seed=3)
    ref = mla.remote_core(q, k, v, 24 ** -0.5, None).float()
    got = mla.fused_core(q, k, v, 24 ** -0.5, None).float()
    assert (got - ref).abs().max().item() <= 4 * 2 ** -8 * ref.abs().max().item()


def test_attention_core_picks_by_device(monkeypatch):
    seen = []
    monkeypatch.setattr(mla, "remote_core", lambda *a: seen.append("remote") or a[0])
    monkeypatch.setattr(mla, "fused_core", lambda *a: seen.append("fused") or a[0])
    q = torch.zeros(1, 1, 2, 4)
    mla.attention_core(q, q, q, 1.0, None)
    assert seen == ["remote"]


def test_modelopt_converts_the_patched_classes_without_rewriting_them(tiny_ckpt, tmp_path):
    """The loaded model's MLA class is registered with ModelOpt: conversion adds q/k/v quantizers that the
    patched forward applies to the queries, keys and values; the KDA class is registered without any, so
    ModelOpt neither rewrites a source nor warns that it could not."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.nn import QuantModuleRegistry

    import modelopt_ext
    from modelopt_ext.testing.checkpoints import copy_checkpoint

    model = modelopt_ext.from_pretrained(copy_checkpoint(tiny_ckpt, tmp_path, "mla_convert"), trust_remote_code=True,
                                         dtype=torch.float32, experts_implementation="batched_mm")
    attn = model.get_submodule("language_model.model.layers.2.self_attn")
    kda = model.get_submodule("language_model.model.layers.0.self_attn")
    patched_forward = vars(type(attn))["forward"]
    assert QuantModuleRegistry.get(type(attn)) is not None and QuantModuleRegistry.get(type(kda)) is not None
    seen = {}

    def record(key, t):
        seen[key] = max(seen.get(key, 0.0), float(t.detach().abs().max()))

    r, nope, h = attn.kv_lora_rank, attn.qk_nope_head_dim, attn.num_heads
    attn.q_b_proj.register_forward_hook(lambda m, i, o: record("q", o))
    attn.kv_a_proj_with_mqa.register_forward_hook(lambda m, i, o: record("k", o[..., r:]))
    attn.kv_b_proj.register_forward_hook(lambda m, i, o: (record("k", o.view(*o.shape[:-1], h, -1)[..., :nope]),
                                                          record("v", o.view(*o.shape[:-1], h, -1)[..., nope:]))
                                         and None)
    cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                         {"quantizer_name": "*[qkv]_bmm_quantizer", "cfg": {"num_bits": (4, 3)}}],
           "algorithm": "max"}
    batch = torch.randint(0, model.config.get_text_config().vocab_size, (2, 16),
                          generator=torch.Generator().manual_seed(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mtq.quantize(model, cfg, lambda m: m(input_ids=batch))
    assert not [w for w in caught if "quantized attention class" in str(w.message)]
    assert type(attn).forward is patched_forward  # converted, not rewritten
    assert not any(hasattr(kda, n) for n in mla.KV_QUANTIZERS)
    got = {n[0]: float(getattr(attn, n).amax) for n in mla.KV_QUANTIZERS}
    assert got == pytest.approx(seen, rel=1e-6)

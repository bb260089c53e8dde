"""The stand-in as transformers loads it (trust_remote_code, no adapter): keys, forwards, cache, experts."""

import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from modelopt_ext.formats.mxfp4 import dequantize_mxfp4
from modelopt_ext.models.kimi_k3.standin import modeling_kimi_linear as mkl
from modelopt_ext.models.kimi_k3.standin.configs import tiny_text_config
from modelopt_ext.models.kimi_k3.standin.inputs import synthetic_image, text_image_inputs
from modelopt_ext.models.kimi_k3.standin.smoke import load_unpatched


@pytest.fixture(scope="module")
def model_fp32(tiny_ckpt):
    return load_unpatched(str(tiny_ckpt), torch.float32)


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    return AutoTokenizer.from_pretrained(str(tiny_ckpt), trust_remote_code=True)


def _tensor(ckpt: Path, key: str) -> torch.Tensor:
    import json

    shard = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][key]
    with safe_open(str(ckpt / shard), "pt") as f:
        return f.get_tensor(key)


@pytest.mark.parametrize("auto_cls", [AutoModelForCausalLM, AutoModel])
def test_the_real_ignore_list_leaves_the_bf16_projections_unloaded(tiny_ckpt, auto_cls):
    """As the real checkpoint: compressed-tensors wraps the latent and AttnRes projections (not in `ignore`)
    and finds their bf16 `.weight` unexpected; nothing else is off."""
    _, info = auto_cls.from_pretrained(str(tiny_ckpt), trust_remote_code=True, output_loading_info=True)
    projections = r"(routed_expert_(down|up)_proj|_res_proj)"
    assert info["missing_keys"] and all(re.search(projections + r"\.weight_(packed|scale)$", k) for k in info["missing_keys"])
    assert info["unexpected_keys"] and all(re.search(projections + r"\.weight$", k) for k in info["unexpected_keys"])


@pytest.mark.parametrize("auto_cls", [AutoModelForCausalLM, AutoModel])
def test_loads_with_no_missing_or_unexpected_keys(tiny_ckpt, auto_cls):
    from transformers import AutoConfig

    from modelopt_ext.models.kimi_k3.standin.smoke import unquantized_modules

    config = AutoConfig.from_pretrained(str(tiny_ckpt), trust_remote_code=True)
    qc = dict(config.quantization_config)
    qc["ignore"] = qc["ignore"] + unquantized_modules(str(tiny_ckpt), qc["ignore"])
    config.quantization_config = qc
    model, info = auto_cls.from_pretrained(str(tiny_ckpt), config=config, trust_remote_code=True,
                                           output_loading_info=True)
    assert type(model).__name__ == "KimiK3ForConditionalGeneration"
    assert type(model).__module__.startswith("transformers_modules."), "must run the checkpoint's own code"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    attn = model.language_model.model.layers[1].self_attn
    assert attn.A_log.dtype == torch.float32 and attn.q_conv1d.weight.dtype == torch.float32
    assert model.language_model.lm_head.weight.dtype == torch.bfloat16
    moe = model.language_model.model.layers[1].block_sparse_moe
    assert moe.ep_size == 1 and len(moe.experts) == model.config.text_config.num_experts
    assert moe.experts[0].w1.weight_packed.dtype == torch.uint8  # still packed before the first forward


def test_decompressed_experts_equal_our_mxfp4_decode(tiny_ckpt, model_fp32):
    """compressed-tensors' decompression of the stored experts is bit-identical to formats.mxfp4."""
    prefix = "language_model.model.layers.2.block_sparse_moe.experts.5.w2"
    ours = dequantize_mxfp4(_tensor(tiny_ckpt, prefix + ".weight_packed"), _tensor(tiny_ckpt, prefix + ".weight_scale"),
                            dtype=torch.float32)
    theirs = model_fp32.language_model.model.layers[2].block_sparse_moe.experts[5].w2.weight
    assert torch.equal(theirs, ours)


def test_text_and_image_forwards_are_finite(tiny_ckpt, model_fp32, tokenizer):
    ids = torch.tensor([tokenizer.encode("The quick brown fox jumps over the lazy dog.")])
    with torch.no_grad():
        logits = model_fp32(input_ids=ids, use_cache=False).logits
    assert logits.shape == (1, ids.shape[1], model_fp32.config.text_config.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    inputs = text_image_inputs(tokenizer, model_fp32.config, "What is shown?", synthetic_image(56, 84))
    with torch.no_grad():
        mm_logits = model_fp32(**inputs, use_cache=False).logits
    n_features = (56 // 14 // 2) * (84 // 14 // 2)
    assert mm_logits.shape[1] == inputs["input_ids"].shape[1] - 1 + n_features
    assert torch.isfinite(mm_logits).all()
    # the image changes what follows it
    with torch.no_grad():
        other = model_fp32(**{**inputs, "pixel_values": -inputs["pixel_values"]}, use_cache=False).logits
    assert (other[0, -1] - mm_logits[0, -1]).abs().max() > 1e-3


def test_image_placeholder_count_is_checked(model_fp32, tokenizer):
    inputs = text_image_inputs(tokenizer, model_fp32.config, "x", synthetic_image(28, 28))
    inputs["pixel_values"] = torch.cat([inputs["pixel_values"]] * 2)
    inputs["grid_thws"] = torch.cat([inputs["grid_thws"]] * 2)
    with pytest.raises(ValueError, match="1 image placeholder tokens in input_ids but 2 images"):
        model_fp32(**inputs)


class _CountCalls:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("with_image", [False, True])
def test_cached_decode_matches_uncached_forward(model_fp32, tokenizer, monkeypatch, with_image):
    """Chunked prefill + recurrent one-token decode (KDA) and the torch.cat MLA cache vs full forwards."""
    remote = sys.modules[type(model_fp32.language_model).__module__]
    chunk, recurrent = _CountCalls(remote.chunk_kda), _CountCalls(remote.fused_recurrent_kda)
    monkeypatch.setattr(remote, "chunk_kda", chunk)
    monkeypatch.setattr(remote, "fused_recurrent_kda", recurrent)
    text = "Kimi reads the whole paragraph before it answers the question."
    ids = torch.tensor([tokenizer.encode(text)])
    prompt_len, steps = 20, 4
    extra = {}
    if with_image:
        mm = text_image_inputs(tokenizer, model_fp32.config, text, synthetic_image(28, 56))
        ids, extra = mm["input_ids"], {k: v for k, v in mm.items() if k != "input_ids"}
    with torch.no_grad():
        out = model_fp32(input_ids=ids[:, :prompt_len], use_cache=True, **extra)
        cache = out.past_key_values
        assert type(cache).__name__ == "KimiDynamicCache"
        kda_layers = sum(model_fp32.config.text_config.is_kda_layer(i) for i in range(len(cache)))
        assert chunk.calls == kda_layers and recurrent.calls == 0
        merged_len = out.logits.shape[1]
        for step in range(steps):
            pos = prompt_len + step
            step_logits = model_fp32(input_ids=ids[:, pos : pos + 1], past_key_values=cache, use_cache=True).logits
            full = model_fp32(input_ids=ids[:, : pos + 1], use_cache=False, **extra).logits
            torch.testing.assert_close(step_logits[:, -1], full[:, -1], atol=1e-4, rtol=1e-4)
        assert recurrent.calls == steps * kda_layers
        mla = cache.mla_layers[0]
        assert cache.key_cache[mla].shape[-2] == merged_len + steps
        assert cache.value_cache[mla].shape[-2] == merged_len + steps


_tiny_text_config = tiny_text_config


def _random_moe_block(config, seed=0):
    torch.manual_seed(seed)
    block = mkl.KimiSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        block.gate.e_score_correction_bias.copy_(torch.randn(config.num_experts) * 0.1)
    return block.eval()


def test_upstream_expert_loop_equals_per_token_reference():
    config = _tiny_text_config()
    block = _random_moe_block(config)
    x = torch.randn(1, 5, config.hidden_size)  # 5 tokens x top-2 over 8 experts: some experts get none
    x_TH = x.view(-1, config.hidden_size)
    idx, w = block.gate(x_TH)
    assert torch.bincount(idx.flatten(), minlength=8).eq(0).any()
    lat = block.routed_expert_down_proj(x_TH)
    expected = torch.stack([
        sum(w[t, j] * block.experts[int(idx[t, j])](lat[t]) for j in range(config.num_experts_per_token))
        for t in range(lat.shape[0])
    ])
    torch.testing.assert_close(block.moe_infer(lat, idx, w), expected, atol=1e-6, rtol=1e-5)
    # the whole block: latent order, routed_expert_norm, up projection, shared experts on the input
    full = block.routed_expert_up_proj(block.routed_expert_norm(expected)).view_as(x) + block.shared_experts(x)
    torch.testing.assert_close(block(x), full, atol=1e-6, rtol=1e-5)


def test_router_selects_by_biased_score_and_weights_by_unbiased():
    config = _tiny_text_config()
    gate = _random_moe_block(config).gate
    x = torch.randn(6, config.hidden_size)
    idx, w = gate(x)
    scores = torch.sigmoid(x @ gate.weight.T)
    expected_idx = torch.topk(scores + gate.e_score_correction_bias, 2, dim=-1).indices
    assert torch.equal(idx, expected_idx)
    expected_w = scores.gather(1, idx)
    torch.testing.assert_close(w, expected_w / expected_w.sum(-1, keepdim=True))


def test_moe_block_refuses_training():
    block = _random_moe_block(_tiny_text_config()).train()
    with pytest.raises(NotImplementedError):
        block(torch.randn(1, 3, 32))


def test_situ_glu_formula():
    g, u = torch.randn(100) * 10, torch.randn(100) * 50
    expected = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    torch.testing.assert_close(mkl.situ_glu(g, u), expected)
    assert mkl.situ_glu(g.bfloat16(), u.bfloat16()).dtype == torch.bfloat16

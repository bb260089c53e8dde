"""modelopt_ext.from_pretrained on the stand-in: parity with the unpatched checkpoint code, packed experts,
generation, cache, save_pretrained round trip, training, and isolation from other models."""

import json
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

import modelopt_ext
from modelopt_ext.models.kimi_k3.patch import PATCHED_ATTR
from modelopt_ext.models.kimi_k3.standin.inputs import synthetic_image, text_image_inputs
from modelopt_ext.models.kimi_k3.standin.smoke import load_unpatched
from modelopt_ext.testing.checkpoints import copy_checkpoint, remote_module


@pytest.fixture(scope="module")
def ckpts(tiny_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter")
    return {
        "reference": copy_checkpoint(tiny_ckpt, root, "reference_unpatched"),
        "adapted": copy_checkpoint(tiny_ckpt, root, "adapted_main"),
    }


@pytest.fixture(scope="module")
def reference_fp32(ckpts):
    return load_unpatched(str(ckpts["reference"]), torch.float32)


@pytest.fixture(scope="module")
def adapted_fp32(ckpts):
    return modelopt_ext.from_pretrained(ckpts["adapted"], trust_remote_code=True, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    return AutoTokenizer.from_pretrained(str(tiny_ckpt), trust_remote_code=True)


def _tensors(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"] if (
        path / "model.safetensors.index.json").exists() else None
    files = sorted(set(index.values())) if index else ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(str(path / name), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _inputs(tokenizer, config, with_image):
    text = "The adapter must not change what the model computes, token for token."
    if with_image:
        return text_image_inputs(tokenizer, config, text, synthetic_image(56, 56))
    return {"input_ids": torch.tensor([tokenizer.encode(text)] * 2)}


def test_returns_the_auto_class_with_packed_experts(ckpts, adapted_fp32):
    assert type(adapted_fp32).__name__ == "KimiK3ForConditionalGeneration"
    assert type(adapted_fp32).__module__.startswith("transformers_modules.adapted_main.")
    block = adapted_fp32.language_model.model.layers[1].block_sparse_moe
    assert type(block.experts).__name__ == "KimiK3PackedExperts"
    stored = _tensors(ckpts["adapted"])
    layer = "language_model.model.layers.1.block_sparse_moe.experts."
    packed_bytes = sum(t.numel() for k, t in stored.items() if k.startswith(layer))
    resident = sum(p.numel() * p.element_size() for p in block.experts.parameters())
    assert all(p.dtype == torch.uint8 for p in block.experts.parameters())
    assert resident == packed_bytes  # the packed size exactly
    E, L, I = 16, 64, 64
    assert resident < E * 3 * L * I * 2 / 3.5  # not bf16 (3.76x larger)
    assert adapted_fp32.config.quantization_config["format"] == "mxfp4-pack-quantized"


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("with_image", [False, True])
def test_logits_match_unpatched_in_fp32(ckpts, reference_fp32, tokenizer, impl, with_image):
    model = modelopt_ext.from_pretrained(
        ckpts["adapted"], trust_remote_code=True, dtype=torch.float32, experts_implementation=impl
    )
    assert model.config.get_text_config()._experts_implementation == impl
    inputs = _inputs(tokenizer, model.config, with_image)
    with torch.no_grad():
        ref = reference_fp32(**inputs, use_cache=False).logits
        out = model(**inputs, use_cache=False).logits
    assert out.shape == ref.shape
    # fp32 summation order only: the same math, within 1e-5 of the largest logit
    assert (out - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def test_bf16_block_parity_and_model_error_budget(ckpts, reference_fp32, tokenizer):
    """bf16: one MoE block given identical inputs agrees to bf16 rounding. End to end, the random stand-in
    is chaotic in bf16 (near-tied routing flips experts), so the adapted model's bf16 error against the
    fp32 reference is held to the unpatched model's own bf16 error."""
    adapted = modelopt_ext.from_pretrained(ckpts["adapted"], trust_remote_code=True, dtype=torch.bfloat16)
    reference = load_unpatched(str(ckpts["reference"]), torch.bfloat16)
    inputs = {"input_ids": torch.randint(13, 500, (4, 48), generator=torch.Generator().manual_seed(1))}
    with torch.no_grad():  # (the unpatched model's first forward also makes compressed-tensors decompress)
        exact = reference_fp32(**inputs, use_cache=False).logits
        ref_err = (reference(**inputs, use_cache=False).logits.float() - exact).abs().mean()
        our_err = (adapted(**inputs, use_cache=False).logits.float() - exact).abs().mean()
    assert our_err <= 1.5 * ref_err
    x = torch.randn(2, 9, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        for i in (1, 4):
            ours = adapted.language_model.model.layers[i].block_sparse_moe(x).float()
            theirs = reference.language_model.model.layers[i].block_sparse_moe(x).float()
            assert (ours - theirs).abs().max() <= 2e-2 * theirs.abs().max()


def test_greedy_generation_matches_unpatched(adapted_fp32, reference_fp32, tokenizer):
    prompt = torch.tensor([tokenizer.encode("Once upon a time")])
    out = adapted_fp32.generate(prompt, max_new_tokens=16, do_sample=False)
    seq = prompt
    with torch.no_grad():
        for _ in range(16):  # the unpatched model's greedy decode, recomputed without a cache
            nxt = reference_fp32(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    # generate stops at the end-of-sequence token; up to there it is the unpatched model's greedy decode
    eos = adapted_fp32.generation_config.eos_token_id
    assert out.shape[1] == prompt.shape[1] + 16 or out[0, -1].item() == eos
    assert torch.equal(out, seq[:, : out.shape[1]])


def test_cached_decode_uses_hybrid_cache_without_reallocation(adapted_fp32, tokenizer):
    ids = torch.tensor([tokenizer.encode("Cached decoding writes into preallocated storage, step by step.")])
    with torch.no_grad():
        out = adapted_fp32(input_ids=ids[:, :12], use_cache=True)
        cache = out.cache
        assert type(cache).__name__ == "KimiHybridCache"
        mla = cache.mla_layers[0]
        storage = cache.layers[mla].keys.data_ptr()
        for pos in range(12, 16):
            step = adapted_fp32(input_ids=ids[:, pos : pos + 1], cache=cache, use_cache=True).logits[:, -1]
            full = adapted_fp32(input_ids=ids[:, : pos + 1], use_cache=False).logits[:, -1]
            torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)
        assert cache.get_seq_length() == 16 and cache.get_query_offset() == 16
        assert cache.get_mask_sizes(1, mla) == (17, 0)
        assert cache.layers[mla].keys.data_ptr() == storage  # written in place, never re-concatenated


def test_save_pretrained_writes_the_original_keys_byte_for_byte(ckpts, adapted_fp32, tmp_path):
    model = modelopt_ext.from_pretrained(ckpts["adapted"], trust_remote_code=True)  # bf16, as stored
    model.save_pretrained(tmp_path / "saved")
    source, saved = _tensors(ckpts["adapted"]), _tensors(tmp_path / "saved")
    assert set(saved) == set(source)
    for key, tensor in source.items():
        assert saved[key].dtype == tensor.dtype and saved[key].shape == tensor.shape, key
        assert torch.equal(saved[key].view(torch.uint8), tensor.view(torch.uint8)), key
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    for name in ("configuration_kimi_k3.py", "modeling_kimi_k3.py", "modeling_kimi_linear.py"):
        assert (tmp_path / "saved" / name).read_bytes() == (ckpts["adapted"] / name).read_bytes()
    reloaded = modelopt_ext.from_pretrained(tmp_path / "saved", trust_remote_code=True, dtype=torch.float32)
    ids = torch.randint(13, 500, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, adapted_fp32(input_ids=ids).logits)


def test_training_reaches_router_and_expert_weights(adapted_fp32):
    """Packed experts train everything but the frozen MXFP4 bytes; a dense model (built from a config, as
    for training from scratch) also gets expert gradients. No NotImplementedError either way."""
    from modelopt_ext.models.kimi_k3.patch import expert_storage

    ids = torch.randint(13, 500, (2, 12), generator=torch.Generator().manual_seed(4))
    adapted_fp32.train()
    try:
        loss = adapted_fp32(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        block = adapted_fp32.language_model.model.layers[1].block_sparse_moe
        assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0
        assert block.routed_expert_down_proj.weight.grad.abs().sum() > 0
        assert all(not p.requires_grad for p in block.experts.parameters())
    finally:
        adapted_fp32.zero_grad(set_to_none=True)
        adapted_fp32.eval()
    text_cls = type(adapted_fp32.language_model)
    with expert_storage("dense"):
        dense = text_cls(adapted_fp32.config.text_config).float().train()
    loss = dense(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    experts = dense.model.layers[1].block_sparse_moe.experts
    assert type(experts).__name__ == "KimiK3Experts"
    assert experts.gate_up_proj.grad.abs().sum() > 0 and experts.down_proj.grad.abs().sum() > 0


def test_router_and_grouped_mm_path_never_sync_with_the_host(adapted_fp32, monkeypatch):
    block = adapted_fp32.language_model.model.layers[2].block_sparse_moe
    assert adapted_fp32.config.get_text_config()._experts_implementation == "grouped_mm"
    x = torch.randn(2, 7, 128)

    def sync(*args, **kwargs):
        raise AssertionError("host sync in the MoE forward")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    with torch.no_grad():
        y = block(x)
    monkeypatch.undo()
    assert y.shape == x.shape and torch.isfinite(y).all()


def test_each_checkpoint_gets_its_own_patch(tiny_ckpt, tmp_path):
    first = copy_checkpoint(tiny_ckpt, tmp_path, "isolation_first")
    second = copy_checkpoint(tiny_ckpt, tmp_path, "isolation_second")
    modelopt_ext.from_pretrained(first, trust_remote_code=True)
    assert remote_module(first, "modeling_kimi_linear").__dict__.get(PATCHED_ATTR)
    assert remote_module(second, "modeling_kimi_linear") is None  # not even imported yet
    unpatched = load_unpatched(str(second), torch.float32)
    assert type(unpatched.language_model.model.layers[1].block_sparse_moe.experts).__name__ == "ModuleList"
    model = modelopt_ext.from_pretrained(second, trust_remote_code=True)
    assert remote_module(second, "modeling_kimi_linear").__dict__.get(PATCHED_ATTR)
    assert type(model).__module__ != type(unpatched).__module__.replace("isolation_second", "isolation_first")


def test_native_kimi_linear_is_untouched(ckpts, tmp_path):
    """transformers' own `kimi_linear` (Kimi-Linear-48B) keeps its conversion mapping and still loads."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    from transformers.conversion_mapping import USER_REGISTERED_MAPPINGS, get_checkpoint_conversion_mapping

    before = repr(get_checkpoint_conversion_mapping("kimi_linear"))
    users_before = set(USER_REGISTERED_MAPPINGS)
    config = KimiLinearConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_token=2,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2,
                                          "head_dim": 16, "short_conv_kernel_size": 4},
    )
    torch.manual_seed(0)
    native = KimiLinearForCausalLM(config)
    native.save_pretrained(tmp_path / "native")
    modelopt_ext.from_pretrained(ckpts["adapted"], trust_remote_code=True)
    assert repr(get_checkpoint_conversion_mapping("kimi_linear")) == before
    assert set(USER_REGISTERED_MAPPINGS) == users_before
    reloaded, info = KimiLinearForCausalLM.from_pretrained(tmp_path / "native", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for (name, a), (_, b) in zip(native.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert "modelopt_ext" not in type(reloaded).__module__ and sys.modules[type(reloaded).__module__]


def test_loads_after_modelopt_was_imported_first(tiny_ckpt, tmp_path):
    """Import order must not matter (transformers' lazy module hides submodules imported elsewhere first)."""
    import subprocess

    ckpt = copy_checkpoint(tiny_ckpt, tmp_path, "import_order")
    code = ("import modelopt.torch.quantization, modelopt_ext, torch; "
            f"m = modelopt_ext.from_pretrained({str(ckpt)!r}, trust_remote_code=True); "
            "print(type(m.language_model.model.layers[1].block_sparse_moe.experts).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "KimiK3PackedExperts" in out.stdout

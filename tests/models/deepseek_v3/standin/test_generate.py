"""The tiny DeepSeek-V3 stand-in (modelopt_ext.models.deepseek_v3.standin.generate).

Every check reads the written files (config.json, the index, the shards through `safetensors.safe_open`) and
compares them with the public checkpoint's facts (`deepseek_v3_config.json`, `layout.py`), then loads the
folder with plain transformers (`AutoModelForCausalLM`, CPU: its FP8 quantizer dequantizes to bf16).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3ForCausalLM

from modelopt_ext.formats.fp8_block import BLOCK, dequantize_blocks, exact_block_dequantize
from modelopt_ext.models.deepseek_v3 import layout as L
from modelopt_ext.models.deepseek_v3.config_check import FP8_QUANTIZATION
from modelopt_ext.models.deepseek_v3.sizes import BUNDLED_CONFIG
from modelopt_ext.models.deepseek_v3.standin.generate import make_tiny, size_fields

PUBLIC = json.loads(BUNDLED_CONFIG.read_text())
SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{6})\.safetensors$")
DTYPES = {"F8_E4M3": L.FP8, "BF16": L.BF16, "F32": L.FP32}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _index(path: Path) -> dict[str, str]:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def _read(path: Path, key: str) -> torch.Tensor:
    with safe_open(path / _index(path)[key], "pt") as f:
        return f.get_tensor(key)


def _headers(path: Path) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """key -> (shape, layout dtype, shard file) of every tensor in every shard."""
    out = {}
    for shard in sorted(p.name for p in path.iterdir() if SHARD_RE.match(p.name)):
        with safe_open(path / shard, "pt") as f:
            for key in f.keys():
                s = f.get_slice(key)
                out[key] = (tuple(s.get_shape()), DTYPES[s.get_dtype()], shard)
    return out


def _dequantized(path: Path, module: str, dtype=torch.bfloat16) -> torch.Tensor:
    return dequantize_blocks(_read(path, module + ".weight"), _read(path, module + ".weight_scale_inv"), dtype)


# ----------------------------------------------------------------------------------------------------
# files and config


def test_files(ds_tiny):
    names = sorted(p.name for p in ds_tiny.iterdir())
    shards = [f"model-{i:05d}-of-000005.safetensors" for i in range(1, 6)]
    assert names == sorted(["config.json", "generation_config.json", "model.safetensors.index.json",
                            "tokenizer.json", "tokenizer_config.json", *shards])


def test_config_is_the_public_one_with_tiny_sizes(ds_tiny):
    config = _config(ds_tiny)
    assert list(config) == [k for k in PUBLIC if k != "auto_map"]  # every key, in the public order
    assert (config["model_type"], config["architectures"]) == ("deepseek_v3", ["DeepseekV3ForCausalLM"])
    assert config["quantization_config"] == FP8_QUANTIZATION == PUBLIC["quantization_config"]
    kept = ("rope_scaling", "rope_theta", "max_position_embeddings", "scoring_func", "topk_method",
            "routed_scaling_factor", "norm_topk_prob", "n_shared_experts", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "hidden_act", "moe_layer_freq", "rms_norm_eps", "tie_word_embeddings", "torch_dtype")
    assert {k: config[k] for k in kept} == {k: PUBLIC[k] for k in kept}
    sized = {"num_hidden_layers": 4, "first_k_dense_replace": 1, "hidden_size": 256, "intermediate_size": 512,
             "moe_intermediate_size": 256, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4,
             "topk_group": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 128,
             "kv_lora_rank": 128, "num_nextn_predict_layers": 1, "vocab_size": 512, "bos_token_id": 0,
             "eos_token_id": 1}
    assert {k: config[k] for k in sized} == sized


def test_tokenizer_loads_offline_with_the_config_ids(ds_tiny):
    tokenizer = AutoTokenizer.from_pretrained(ds_tiny)
    config = _config(ds_tiny)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    text = "The quick brown fox, 3.14 ünïcode."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert json.loads((ds_tiny / "generation_config.json").read_text())["eos_token_id"] == config["eos_token_id"]


# ----------------------------------------------------------------------------------------------------
# tensors


def test_tensors_are_the_real_layout(ds_tiny):
    headers = _headers(ds_tiny)
    expected = {t.name: (t.shape, t.dtype) for t in L.layout(_config(ds_tiny))}
    assert {k: v[:2] for k, v in headers.items()} == expected
    assert {k: v[2] for k, v in headers.items()} == _index(ds_tiny)


def test_shards_follow_the_real_order(ds_tiny):
    """Embeddings first, final norm and lm_head with the last decoder layer, the MTP layer alone in the last."""
    headers = _headers(ds_tiny)
    shard = {k: v[2] for k, v in headers.items()}
    assert shard["model.embed_tokens.weight"] == shard["model.layers.0.input_layernorm.weight"]
    assert shard["model.embed_tokens.weight"].startswith("model-00001-")
    assert shard["lm_head.weight"] == shard["model.norm.weight"] == shard["model.layers.3.mlp.gate.weight"]
    last = {k for k, f in shard.items() if f.startswith("model-00005-")}
    assert last == {k for k in headers if k.startswith("model.layers.4.")}


def test_fp8_linears_have_whole_blocks_except_kv_a_proj(ds_tiny):
    headers = _headers(ds_tiny)
    partial = set()
    for key, (shape, dtype, _) in headers.items():
        if dtype == L.FP8:
            scale_shape, scale_dtype, _ = headers[key + "_scale_inv"]
            assert scale_dtype == L.FP32 and scale_shape == (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK)), key
            if shape[0] % BLOCK or shape[1] % BLOCK:
                partial.add(key)
    assert partial == {f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight" for i in range(5)}
    assert headers["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"][0] == (128 + 64, 256)  # 64-row tail


def test_each_block_is_scaled_to_the_e4m3_range(ds_tiny):
    """scale = amax / 448: each block's largest FP8 magnitude is 448, the partial block's 64 rows included."""
    for module in ("model.layers.1.self_attn.kv_a_proj_with_mqa", "model.layers.2.mlp.experts.3.down_proj",
                   "model.layers.0.mlp.gate_proj"):
        q = _read(ds_tiny, module + ".weight").float()
        rows, cols = q.shape
        for r in range(0, rows, BLOCK):
            for c in range(0, cols, BLOCK):
                assert q[r:r + BLOCK, c:c + BLOCK].abs().max() == 448, (module, r, c)


def test_dtypes_of_the_unquantized_tensors(ds_tiny):
    headers = _headers(ds_tiny)
    assert {k for k, v in headers.items() if v[1] == L.FP32 and not k.endswith("_scale_inv")} == {
        f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(1, 5)}
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                "model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.0.input_layernorm.weight",
                "model.layers.2.self_attn.kv_a_layernorm.weight"):
        assert headers[key][1] == L.BF16, key


def test_the_mtp_layer_shares_embeddings_and_head(ds_tiny):
    assert torch.equal(_read(ds_tiny, "model.layers.4.embed_tokens.weight"), _read(ds_tiny, "model.embed_tokens.weight"))
    assert torch.equal(_read(ds_tiny, "model.layers.4.shared_head.head.weight"), _read(ds_tiny, "lm_head.weight"))
    assert not torch.equal(_read(ds_tiny, "model.layers.4.mlp.gate.weight"), _read(ds_tiny, "model.layers.3.mlp.gate.weight"))


def test_same_seed_same_bytes_other_seed_other_weights(ds_tiny, tmp_path):
    again = make_tiny(tmp_path / "again", seed=0)
    assert {p.name: p.read_bytes() for p in ds_tiny.iterdir()} == {p.name: p.read_bytes() for p in again.iterdir()}
    other = make_tiny(tmp_path / "other", seed=1, sizes={"num_mtp_layers": 0, "num_layers": 2})
    assert (other / "config.json").read_bytes() != (ds_tiny / "config.json").read_bytes()
    assert not torch.equal(_read(other, "model.layers.1.mlp.gate.weight"), _read(ds_tiny, "model.layers.1.mlp.gate.weight"))


# ----------------------------------------------------------------------------------------------------
# sizes and refusals


def test_sizes_overrides(tmp_path):
    path = make_tiny(tmp_path / "t", sizes={"num_layers": 3, "first_k_dense_replace": 2, "num_experts": 8, "n_group": 2,
                                            "topk_group": 1, "top_k": 2, "num_heads": 4, "kv_lora_rank": 256,
                                            "num_mtp_layers": 0, "vocab_size": 300})
    config = _config(path)
    assert (config["num_hidden_layers"], config["first_k_dense_replace"], config["n_routed_experts"]) == (3, 2, 8)
    assert (config["num_attention_heads"], config["kv_lora_rank"], config["num_nextn_predict_layers"]) == (4, 256, 0)
    headers = _headers(path)
    assert headers["model.layers.2.self_attn.kv_a_proj_with_mqa.weight_scale_inv"][0] == (3, 2)  # 320 rows
    assert "model.layers.1.mlp.gate_proj.weight" in headers and "model.layers.2.mlp.experts.7.up_proj.weight" in headers
    assert sorted(p.name for p in path.iterdir() if SHARD_RE.match(p.name))[-1] == "model-00003-of-000003.safetensors"


def test_an_unknown_size_is_refused_naming_the_fields(tmp_path):
    with pytest.raises(ValueError) as exc:
        make_tiny(tmp_path / "t", sizes={"hidden": 256, "layers": 2})
    message = str(exc.value)
    assert "no size hidden, layers" in message and ", ".join(size_fields()) in message
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("sizes, message", [
    ({"hidden_size": 200}, "hidden_size=200 must be a positive multiple of 128"),
    ({"kv_lora_rank": 96}, "kv_lora_rank=96 must be a positive multiple of 128"),
    ({"num_heads": 3}, "num_heads=3 must be a positive even number"),
    ({"first_k_dense_replace": 4}, "first_k_dense_replace=4 must be at least 0 and below num_layers=4"),
    ({"num_mtp_layers": -1}, "num_mtp_layers=-1 must be at least 0"),
    ({"vocab_size": 100}, "vocab_size=100 is below the tokenizer minimum"),
    ({"n_group": 3}, "n_routed_experts (16) is not divisible by n_group (3)"),
    ({"topk_group": 5}, "topk_group (5) exceeds n_group (4)"),
    ({"top_k": 9}, "num_experts_per_tok (9) exceeds the 8 experts"),
])
def test_sizes_the_format_cannot_hold_are_refused_before_writing(tmp_path, sizes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_tiny(tmp_path / "t", sizes=sizes)
    assert list(tmp_path.iterdir()) == []


def test_a_non_empty_folder_needs_force(tmp_path):
    out = tmp_path / "t"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        make_tiny(out, sizes={"num_mtp_layers": 0, "num_layers": 2})
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    make_tiny(out, sizes={"num_mtp_layers": 0, "num_layers": 2}, force=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    with pytest.raises(ValueError, match="fit_steps=-1"):
        make_tiny(tmp_path / "u", fit_steps=-1)


# ----------------------------------------------------------------------------------------------------
# plain transformers


def test_plain_transformers_loads_it_leaving_only_the_mtp_layer(ds_loaded):
    """transformers builds no MTP layer: it reports layer 4's keys unexpected (for the real checkpoint its
    `_keys_to_ignore_on_load_unexpected` silences `model.layers.61.*`, a hard-coded index)."""
    model, info = ds_loaded
    assert isinstance(model, DeepseekV3ForCausalLM)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"]
    assert info["unexpected_keys"] and all(k.startswith("model.layers.4.") for k in info["unexpected_keys"])
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.shared_head.head.weight"} <= set(info["unexpected_keys"])
    assert model.dtype == torch.bfloat16
    assert not hasattr(model.config, "quantization_config") or model.config.quantization_config.dequantize
    assert type(model.model.layers[1].self_attn.kv_a_proj_with_mqa) is torch.nn.Linear  # dequantized, not FP8Linear


def test_forward_logits_are_finite_and_deterministic(ds_tiny, ds_loaded):
    model, _ = ds_loaded
    ids = AutoTokenizer.from_pretrained(ds_tiny)(["DeepSeek stand-in, a forward pass."], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        first, second = model(ids).logits, model(ids).logits
    assert first.shape == (1, ids.shape[1], 512) and torch.isfinite(first).all()
    assert torch.equal(first, second)
    assert first.float().std() > 0.1  # not degenerate


WHOLE_BLOCK_MODULES = ("model.layers.0.self_attn.q_a_proj", "model.layers.1.self_attn.q_b_proj",
                       "model.layers.2.self_attn.kv_b_proj", "model.layers.3.self_attn.o_proj", "model.layers.0.mlp.up_proj",
                       "model.layers.0.mlp.down_proj", "model.layers.2.mlp.shared_experts.gate_proj")


def _assert_experts_exact(ds_tiny, model, layer: int, expert: int):
    experts = model.model.layers[layer].mlp.experts
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    gate_up = torch.cat([_dequantized(ds_tiny, p + "gate_proj"), _dequantized(ds_tiny, p + "up_proj")])
    assert torch.equal(experts.gate_up_proj[expert], gate_up)
    assert torch.equal(experts.down_proj[expert], _dequantized(ds_tiny, p + "down_proj"))


def test_plain_transformers_dequantizes_whole_blocks_exactly(ds_tiny, ds_loaded):
    """bf16(fp8 x block scale) for every whole-block Linear and the fused experts; bf16 tensors as stored."""
    model, _ = ds_loaded
    state = model.state_dict()
    for module in WHOLE_BLOCK_MODULES:
        assert torch.equal(state[module + ".weight"], _dequantized(ds_tiny, module)), module
    _assert_experts_exact(ds_tiny, model, 1, 0)
    _assert_experts_exact(ds_tiny, model, 3, 15)
    assert torch.equal(state["model.layers.2.mlp.gate.weight"], _read(ds_tiny, "model.layers.2.mlp.gate.weight").float())
    assert torch.equal(state["model.layers.2.mlp.gate.e_score_correction_bias"],
                       _read(ds_tiny, "model.layers.2.mlp.gate.e_score_correction_bias"))
    assert torch.equal(state["lm_head.weight"], _read(ds_tiny, "lm_head.weight"))


def test_plain_transformers_misreads_the_partial_block(ds_tiny, ds_loaded):
    """transformers 5.25 reads kv_a_proj_with_mqa's [2, 2] scales over 192 rows as two 96-row blocks: rows
    96..127 get the tail block's scale (`fp8.py`). If this starts failing, transformers has fixed it."""
    model, _ = ds_loaded
    loaded = model.state_dict()["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    exact = _dequantized(ds_tiny, "model.layers.1.self_attn.kv_a_proj_with_mqa")
    assert torch.equal(loaded[:96], exact[:96]) and torch.equal(loaded[128:], exact[128:])
    assert not torch.equal(loaded[96:128], exact[96:128])


def test_in_the_exact_scope_every_fp8_weight_is_fp8_times_its_block_scale(ds_tiny):
    with exact_block_dequantize():
        model = AutoModelForCausalLM.from_pretrained(ds_tiny)
    state = model.state_dict()
    for i in range(4):
        module = f"model.layers.{i}.self_attn.kv_a_proj_with_mqa"
        assert torch.equal(state[module + ".weight"], _dequantized(ds_tiny, module)), module
    for module in WHOLE_BLOCK_MODULES:
        assert torch.equal(state[module + ".weight"], _dequantized(ds_tiny, module)), module
    _assert_experts_exact(ds_tiny, model, 2, 7)
    ids = torch.tensor([[0, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_without_mtp_layer_the_load_is_clean(tmp_path):
    path = make_tiny(tmp_path / "t", sizes={"num_mtp_layers": 0, "num_layers": 2})
    with exact_block_dequantize():
        _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}

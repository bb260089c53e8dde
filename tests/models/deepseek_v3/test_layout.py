"""The checkpoint layout (modelopt_ext.models.deepseek_v3.layout) against the public tensor tables.

Facts from the public per-tensor tables (name pattern, shape, dtype per row, with totals) of
deepseek-ai/DeepSeek-R1 (DeepSeek-V3's architecture and layout: 163 shards) and moonshotai/Kimi-K2-Instruct
(61 shards), as listed in public model-inventory reports:

- DeepSeek-R1: 91,991 tensors, 684,531,386,000 elements, 641.29 GiB; layers 0-2 dense, 3-61 MoE (61: MTP),
  kv_a_proj_with_mqa [576, 7168] F8 with weight_scale_inv [5, 56] F32, gate.weight [256, 7168] BF16,
  e_score_correction_bias [256] F32, eh_proj [7168, 14336] BF16, norms BF16.
- Kimi-K2-Instruct: 139,644 tensors, 1,026,470,731,056 elements, 958.49 GiB; layer 0 dense, 1-60 MoE (384
  experts), q_b_proj [12288, 1536] with scales [96, 12], kv_b_proj [16384, 512] with [128, 4], plus a
  `self_attn.rotary_emb.inv_freq` [56] BF16 per layer (61), which `layout` leaves out.
"""

from __future__ import annotations

import json
import re
from collections import Counter

from modelopt_ext.models.deepseek_v3 import layout as L
from modelopt_ext.models.deepseek_v3.sizes import BUNDLED_CONFIG, KIMI_K2_CONFIG

DSV3 = json.loads(BUNDLED_CONFIG.read_text())
K2 = json.loads(KIMI_K2_CONFIG.read_text())
GIB = 2**30


def _by_name(tensors):
    return {t.name: t for t in tensors}


def test_deepseek_v3_layout_matches_the_public_table_totals():
    tensors = L.layout(DSV3)
    assert len(tensors) == 91_991
    assert sum(t.numel for t in tensors) == 684_531_386_000
    assert round(sum(t.nbytes for t in tensors) / GIB, 2) == 641.29
    assert len({t.name for t in tensors}) == len(tensors)


def test_kimi_k2_layout_matches_the_public_table_totals_but_the_unread_inv_freq():
    tensors = L.layout(K2)
    inv_freq = 61 * 56  # 61 `self_attn.rotary_emb.inv_freq` of 56 bf16 values, not in `layout`
    assert len(tensors) + 61 == 139_644
    assert sum(t.numel for t in tensors) + inv_freq == 1_026_470_731_056
    assert round((sum(t.nbytes for t in tensors) + 2 * inv_freq) / GIB, 2) == 958.49


def test_deepseek_v3_rows_of_the_public_table():
    t = _by_name(L.layout(DSV3))
    rows = {
        "model.embed_tokens.weight": ((129280, 7168), L.BF16),
        "lm_head.weight": ((129280, 7168), L.BF16),
        "model.norm.weight": ((7168,), L.BF16),
        "model.layers.0.mlp.gate_proj.weight": ((18432, 7168), L.FP8),
        "model.layers.0.mlp.gate_proj.weight_scale_inv": ((144, 56), L.FP32),
        "model.layers.2.mlp.down_proj.weight_scale_inv": ((56, 144), L.FP32),
        "model.layers.5.self_attn.kv_a_proj_with_mqa.weight": ((576, 7168), L.FP8),
        "model.layers.5.self_attn.kv_a_proj_with_mqa.weight_scale_inv": ((5, 56), L.FP32),
        "model.layers.5.self_attn.kv_b_proj.weight_scale_inv": ((256, 4), L.FP32),
        "model.layers.5.self_attn.o_proj.weight": ((7168, 16384), L.FP8),
        "model.layers.5.self_attn.q_b_proj.weight_scale_inv": ((192, 12), L.FP32),
        "model.layers.5.self_attn.q_a_layernorm.weight": ((1536,), L.BF16),
        "model.layers.5.self_attn.kv_a_layernorm.weight": ((512,), L.BF16),
        "model.layers.3.mlp.experts.255.down_proj.weight": ((7168, 2048), L.FP8),
        "model.layers.3.mlp.experts.255.down_proj.weight_scale_inv": ((56, 16), L.FP32),
        "model.layers.60.mlp.experts.0.up_proj.weight_scale_inv": ((16, 56), L.FP32),
        "model.layers.3.mlp.gate.weight": ((256, 7168), L.BF16),
        "model.layers.3.mlp.gate.e_score_correction_bias": ((256,), L.FP32),
        "model.layers.3.mlp.shared_experts.gate_proj.weight": ((2048, 7168), L.FP8),
        "model.layers.61.eh_proj.weight": ((7168, 14336), L.BF16),
        "model.layers.61.embed_tokens.weight": ((129280, 7168), L.BF16),
        "model.layers.61.enorm.weight": ((7168,), L.BF16),
        "model.layers.61.hnorm.weight": ((7168,), L.BF16),
        "model.layers.61.shared_head.head.weight": ((129280, 7168), L.BF16),
        "model.layers.61.shared_head.norm.weight": ((7168,), L.BF16),
        "model.layers.61.mlp.experts.7.gate_proj.weight": ((2048, 7168), L.FP8),
        "model.layers.61.self_attn.kv_a_proj_with_mqa.weight_scale_inv": ((5, 56), L.FP32),
    }
    for name, (shape, dtype) in rows.items():
        assert (t[name].shape, t[name].dtype) == (shape, dtype), name
    assert "model.layers.2.mlp.gate.weight" not in t and "model.layers.3.mlp.gate_proj.weight" not in t
    assert "model.layers.61.eh_proj.weight_scale_inv" not in t and "model.layers.62.enorm.weight" not in t


def test_kimi_k2_rows_of_the_public_table():
    t = _by_name(L.layout(K2))
    assert (t["model.layers.1.self_attn.q_b_proj.weight"].shape,
            t["model.layers.1.self_attn.q_b_proj.weight_scale_inv"].shape) == ((12288, 1536), (96, 12))
    assert t["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"].shape == (128, 4)
    assert t["model.layers.1.self_attn.o_proj.weight_scale_inv"].shape == (56, 64)
    assert t["model.layers.60.mlp.experts.383.gate_proj.weight"].shape == (2048, 7168)
    assert t["model.layers.0.mlp.up_proj.weight"].dtype == L.FP8 and "model.layers.1.mlp.up_proj.weight" not in t
    assert not any(name.startswith("model.layers.61.") for name in t)  # no MTP layer


def test_tensor_kinds_per_layer_pattern():
    """Row counts per name pattern with the layer and expert indices wildcarded, as the tables group them."""
    counts = Counter(re.sub(r"\.\d+\.", ".N.", re.sub(r"\.\d+\.", ".N.", t.name)) for t in L.layout(DSV3))
    assert counts["model.layers.N.mlp.experts.N.gate_proj.weight"] == 59 * 256
    assert counts["model.layers.N.mlp.experts.N.gate_proj.weight_scale_inv"] == 59 * 256
    assert counts["model.layers.N.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == 62
    assert counts["model.layers.N.mlp.gate.e_score_correction_bias"] == 59
    assert counts["model.layers.N.mlp.down_proj.weight"] == 3
    assert counts["model.layers.N.input_layernorm.weight"] == 62


def test_without_quantization_config_every_linear_is_bf16_and_unscaled():
    config = {**DSV3, "num_hidden_layers": 4, "n_routed_experts": 8, "num_nextn_predict_layers": 0}
    del config["quantization_config"]
    tensors = L.layout(config)
    assert not any(t.name.endswith("_scale_inv") for t in tensors)
    assert {t.dtype for t in tensors} == {L.BF16, L.FP32}
    assert [t.name for t in tensors if t.dtype == L.FP32] == [
        f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (3,)]


def test_no_query_lora_stores_q_proj():
    config = {**DSV3, "num_hidden_layers": 1, "first_k_dense_replace": 1, "q_lora_rank": None,
              "num_nextn_predict_layers": 0}
    t = _by_name(L.layout(config))
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (128 * 192, 7168)
    assert "model.layers.0.self_attn.q_a_proj.weight" not in t and "model.layers.0.self_attn.q_a_layernorm.weight" not in t


def test_mtp_layer_indices_and_layout_without_mtp():
    assert list(L.mtp_layer_indices(DSV3)) == [61]
    assert list(L.mtp_layer_indices(K2)) == []
    main = L.layout(DSV3, mtp=False)
    assert not any(t.part == "mtp" for t in main) and len(main) == 91_991 - sum(
        t.part == "mtp" for t in L.layout(DSV3))
    assert {t.part for t in L.layout(DSV3) if t.name.startswith("model.layers.61.")} == {"mtp"}

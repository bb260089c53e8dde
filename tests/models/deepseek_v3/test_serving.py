"""modelopt_ext.models.deepseek_v3.serving: the engines' fused groups, names and never-quantized modules of
DeepSeek-V3, checked against the bundled config and the checkpoint layout."""

from __future__ import annotations

import json

import pytest

from modelopt_ext.export.serving import fp8_block_report
from modelopt_ext.families import ServingSpec
from modelopt_ext.models.deepseek_v3 import engine_rules
from modelopt_ext.models.deepseek_v3 import serving as S
from modelopt_ext.models.deepseek_v3.layout import layout
from modelopt_ext.models.deepseek_v3.sizes import BUNDLED_CONFIG, KIMI_K2_CONFIG
from modelopt_ext.quant import recipes as R

L = "model.layers."


def spec() -> ServingSpec:
    return ServingSpec(engines=S.ENGINES, fused_groups=S.fused_groups, never_quantized=S.never_quantized,
                       engine_name=S.engine_name, layer_aliases=S.layer_aliases, linear_shape=S.linear_shape,
                       kv_cache=S.KV_CACHE, sglang_key=engine_rules.sglang_key,
                       trtllm_names=engine_rules.trtllm_names, sources=engine_rules.SOURCES)


@pytest.fixture(scope="module")
def real():
    return json.loads(BUNDLED_CONFIG.read_text())


def test_group_counts_at_full_size(real):
    counts = {}
    for g in S.fused_groups(real):
        counts[g.name] = counts.get(g.name, 0) + 1
    # 61 layers, all MLA with a q LoRA; first_k_dense_replace 3
    assert counts == {"MLA latent down projections": 61, "dense MLP gate/up": 3, "shared experts gate/up": 58}


def test_groups_of_layer_3_named_per_engine(real):
    groups = [g for g in S.fused_groups(real) if g.layer == 3]
    assert [g.name for g in groups] == ["MLA latent down projections", "shared experts gate/up"]
    mla, shared = groups
    a = f"{L}3.self_attn."
    assert mla.members == (f"{a}q_a_proj", f"{a}kv_a_proj_with_mqa")
    assert mla.fused == {"vllm": (f"{a}fused_qkv_a_proj", mla.members),
                         "sglang": (f"{a}fused_qkv_a_proj_with_mqa", mla.members),
                         "trtllm": (f"{a}kv_a_proj_with_mqa", mla.members)}
    m = f"{L}3.mlp.shared_experts."
    assert shared.members == (f"{m}gate_proj", f"{m}up_proj")
    assert {e: n for e, (n, _) in shared.fused.items()} == dict.fromkeys(S.ENGINES, f"{m}gate_up_proj")
    assert mla.describe() == ("MLA latent down projections of layer 3 (vllm fused_qkv_a_proj, "
                              "sglang fused_qkv_a_proj_with_mqa, trtllm kv_a_proj_with_mqa)")


def test_layer_0_is_dense(real):
    groups = [g for g in S.fused_groups(real) if g.layer == 0]
    assert [g.name for g in groups] == ["MLA latent down projections", "dense MLP gate/up"]
    assert groups[1].members == (f"{L}0.mlp.gate_proj", f"{L}0.mlp.up_proj")
    assert groups[1].fused["trtllm"][0] == f"{L}0.mlp.gate_up_proj"


def test_kimi_k2_groups():
    k2 = json.loads(KIMI_K2_CONFIG.read_text())
    layers = int(k2["num_hidden_layers"])
    names = [g.name for g in S.fused_groups(k2)]
    assert names.count("MLA latent down projections") == layers
    assert names.count("dense MLP gate/up") == k2["first_k_dense_replace"]
    assert names.count("shared experts gate/up") == layers - k2["first_k_dense_replace"]


def test_without_q_lora_nothing_is_fused_in_attention(real):
    small = dict(real, q_lora_rank=None)
    assert {g.name for g in S.fused_groups(small)} == {"dense MLP gate/up", "shared experts gate/up"}
    assert S.linear_shape(small, f"{L}0.self_attn.q_proj") == (128 * 192, 7168)
    assert S.linear_shape(small, f"{L}0.self_attn.q_a_proj") is None


def test_names_are_the_checkpoint_names():
    m = f"{L}7.mlp.experts"
    assert [S.engine_name(m, e) for e in S.ENGINES] == [m, m, m]
    assert S.layer_aliases(m) == (m,)
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        S.engine_name(m, "tgi")


@pytest.mark.parametrize("module, expected", [
    (f"{L}3.mlp.gate", True), (f"{L}61.eh_proj", True),
    (f"{L}3.mlp.gate_proj", False), (f"{L}0.mlp.gate_up_proj", False), (f"{L}3.mlp.experts", False),
    (f"{L}3.mlp.shared_experts.gate_proj", False), (f"{L}3.self_attn.q_a_proj", False), ("lm_head", False),
])
def test_never_quantized(module, expected):
    assert S.never_quantized(module) == expected


def test_linear_shapes_are_the_layout_shapes(real):
    """(out, in) from the config equals the checkpoint layout's weight shape for every projection of layers 0
    (dense) and 3 (MoE); the routed experts have none."""
    weights = {t.name.removesuffix(".weight"): t.shape for t in layout(real, mtp=False) if t.name.endswith(".weight")}
    checked = 0
    for layer in (0, 3):
        for module, shape in weights.items():
            if not module.startswith(f"{L}{layer}.") or "norm" in module or ".mlp.experts." in module:
                continue
            if module.endswith(".mlp.gate"):
                assert S.linear_shape(real, module) is None
                continue
            assert S.linear_shape(real, module) == shape, module
            checked += 1
    assert checked == 2 * (5 + 3)  # per layer: q_a, q_b, kv_a_proj_with_mqa, kv_b, o; gate, up, down
    assert S.linear_shape(real, f"{L}3.mlp.experts.0.gate_proj") is None


def test_fp8_block_report_of_fp8_all(real):
    quant = R.quant_config(R.load("deepseek_v3/fp8_all"), real)
    lines = fp8_block_report(real, spec(), quant["quant_cfg"])
    assert lines == [
        "MLA latent down projections: q_a_proj 1536 + kv_a_proj_with_mqa 576 = 2112 rows = 16 blocks + 64 rows; "
        "partial block in kv_a_proj_with_mqa (the group's last member: the scale grids concatenate)",
        "dense MLP gate/up: gate_proj 18432 + up_proj 18432 = 36864 rows = 288 blocks",
        "shared experts gate/up: gate_proj 2048 + up_proj 2048 = 4096 rows = 32 blocks",
    ]


def test_kv_cache_facts(real):
    modules = S.KV_CACHE.attention_modules(real)
    assert len(modules) == 61 and modules[0] == f"{L}0.self_attn" and modules[-1] == f"{L}60.self_attn"
    assert set(S.KV_CACHE.engines) == set(S.ENGINES)
    assert all(what for what in S.KV_CACHE.engines.values())  # no engine is known to use the calibrated scales

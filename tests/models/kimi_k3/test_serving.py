"""modelopt_ext.models.kimi_k3.serving: the engines' fused groups, names and never-quantized modules of Kimi-K3,
checked against the real config and tensor table."""

from __future__ import annotations

import json

import pytest

from modelopt_ext.models.kimi_k3 import serving as S
from modelopt_ext.models.kimi_k3.inventory import load_real_inventory
from modelopt_ext.models.kimi_k3.sizes import BUNDLED_CONFIG

L = "language_model.model.layers."


@pytest.fixture(scope="module")
def real():
    return json.loads(BUNDLED_CONFIG.read_text())


def test_groups_at_full_size(real):
    groups = S.fused_groups(real)
    by_name = {}
    for g in groups:
        by_name.setdefault(g.name, []).append(g.layer)
    assert {k: len(v) for k, v in by_name.items()} == {
        "KDA input projections": 69, "MLA latent down projections": 24, "dense MLP gate/up": 1,
        "shared experts gate/up": 92}
    kda = next(g for g in groups if g.name == "KDA input projections" and g.layer == 1)
    assert kda.members == tuple(f"{L}1.self_attn.{p}" for p in
                                ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj"))
    assert kda.fused["vllm"] == (f"{L}1.self_attn.in_proj_qkvgfab", kda.members)
    assert kda.fused["sglang"] == ("model.layers.1.self_attn.fused_qkvg_proj", kda.members[:4])
    mla = next(g for g in groups if g.name == "MLA latent down projections")
    assert mla.layer == 3 and mla.fused["sglang"][0] == "model.layers.3.self_attn.fused_qkv_a_proj_with_mqa"
    shared = next(g for g in groups if g.name == "shared experts gate/up")
    assert shared.fused["sglang"][0] == f"model.layers.{shared.layer}.mlp.shared_experts.gate_up_proj"


def test_engine_names_and_aliases():
    m = f"{L}7.block_sparse_moe.experts"
    assert S.engine_name(m, "vllm") == S.engine_name(m, "trtllm") == m
    assert S.engine_name(m, "sglang") == "model.layers.7.mlp.experts"
    assert S.engine_name("language_model.lm_head", "sglang") == "lm_head"
    assert S.layer_aliases(m) == (m, "model.layers.7.mlp.experts")
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        S.engine_name(m, "tgi")


@pytest.mark.parametrize("module, expected", [
    (f"{L}3.block_sparse_moe.gate", True), (f"{L}3.block_sparse_moe.routed_expert_down_proj", True),
    (f"{L}3.mlp_res_proj", True), ("language_model.model.output_attn_res_proj", True),
    (f"{L}3.self_attn.q_conv1d", True), ("vision_tower.encoder.blocks.0.wqkv", True), ("mm_projector.proj.0", True),
    (f"{L}3.block_sparse_moe.experts", False), (f"{L}3.block_sparse_moe.shared_experts.gate_proj", False),
    (f"{L}3.self_attn.b_proj", False), ("language_model.lm_head", False),
])
def test_never_quantized(module, expected):
    assert S.never_quantized(module) == expected


def test_linear_shapes_are_the_real_tensor_shapes(real):
    """Every fused group member's (out, in) from the config equals the real checkpoint's tensor table."""
    inventory = load_real_inventory()
    per_layer = inventory["per_layer"]
    for group in {g.name: g for g in S.fused_groups(real)}.values():
        kind = {"KDA input projections": "kda", "MLA latent down projections": "mla",
                "dense MLP gate/up": "dense_mlp", "shared experts gate/up": "moe"}[group.name]
        for member in group.members:
            rel = member.removeprefix(f"{L}{group.layer}.") + ".weight"
            shape = (per_layer[kind].get(rel) or per_layer["all"].get(rel))[0]
            if group.name.endswith("gate/up"):
                continue  # MLP widths are not needed for FP8 blocks (no shipped recipe blocks them)
            assert tuple(shape) == S.linear_shape(real, member), member

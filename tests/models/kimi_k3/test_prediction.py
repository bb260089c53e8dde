"""Kimi-K3's prediction data (models/kimi_k3/prediction.py): layer kinds and export bytes of the public config,
worked out by hand from its widths."""

from __future__ import annotations

import copy
import json

import pytest

from modelopt_ext.models.kimi_k3.prediction import dense_export_bytes, layer_kinds, quantized_linear_bytes
from modelopt_ext.models.kimi_k3.sizes import BUNDLED_CONFIG, dense_bytes

RECIPE = "kimi_k3/nvfp4_experts-fp8_attention"


@pytest.fixture(scope="module")
def kimi():
    return json.loads(BUNDLED_CONFIG.read_text())


def test_layer_kinds_of_the_public_config(kimi):
    # layer 0 (1-based 1) is dense and KDA; MLA at 1-based 4, 8, ..., 92 and 93 (24); 69 KDA in all
    assert layer_kinds(kimi) == {"dense_kda": 1, "moe_kda": 68, "moe_mla": 24, "embed_head": 1}


def test_layer_kinds_follow_the_config(kimi):
    cfg = copy.deepcopy(kimi)
    t = cfg["text_config"]
    t["first_k_dense_replace"] = 4  # layers 0-3 dense: 0, 1, 2 KDA, 3 MLA
    assert layer_kinds(cfg) == {"dense_kda": 3, "dense_mla": 1, "moe_kda": 66, "moe_mla": 23, "embed_head": 1}


def _fp8_block(out, inp):
    return out * inp + -(-out // 128) * -(-inp // 128) * 4


def test_dense_export_bytes_by_hand(kimi):
    H, P, d, heads = 7168, 96 * 128, 128, 96  # hidden, KDA heads x head_dim, KDA head_dim, MLA heads
    kda = {"q": (P, H), "k": (P, H), "v": (P, H), "g": (P, H), "f_a": (d, H), "b": (96, H), "o": (H, P)}
    mla = {"q_a": (1536, H), "kv_a": (512 + 64, H), "q_b": (heads * 192, 1536), "kv_b": (heads * 256, 512),
           "o": (H, heads * 128), "g": (heads * 128, H)}
    saved = lambda shapes: sum(o * i * 2 - _fp8_block(o, i) for o, i in shapes.values())  # noqa: E731
    got = dense_export_bytes(kimi, RECIPE)
    assert len(got["layers"]) == 93
    total = got["outside_layers"] + sum(got["layers"])
    assert total == dense_bytes(kimi) - 69 * saved(kda) - 24 * saved(mla)
    # outside the layers: embeddings + lm_head (untied) 2 x 163840 x 7168 bf16, final norm and AttnRes output
    # mix 3 x 7168, vision tower and projector: at least the first two
    assert got["outside_layers"] > 2 * 163840 * 7168 * 2
    # layer 0 (dense KDA) is larger than layer 1 (MoE KDA) by the dense MLP minus the MoE block's dense part
    dense_mlp = 3 * H * 33792 * 2
    moe_dense = (3 * H * 3072 * 2 + 2 * H * 3584 + 3584 + 896 * H) * 2 + 896 * 4
    assert got["layers"][0] - got["layers"][1] == dense_mlp - moe_dense


def test_quantized_linear_bytes():
    assert quantized_linear_bytes(256, 130, {"num_bits": [4, 3], "block_sizes": {-1: 128, -2: 128}}) == \
        256 * 130 + 2 * 2 * 4
    assert quantized_linear_bytes(10, 20, {"num_bits": [4, 3]}) == 200 + 8
    assert quantized_linear_bytes(32, 32, {"num_bits": [2, 1], "block_sizes": {-1: 16, "type": "dynamic"}}) == \
        512 + 64 + 8
    with pytest.raises(ValueError, match="not a format"):
        quantized_linear_bytes(8, 8, {"num_bits": 8})

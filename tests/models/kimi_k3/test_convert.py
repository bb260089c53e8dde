"""Tests of modelopt_ext/models/kimi_k3/convert.py: the per-expert <-> fused converters."""

from __future__ import annotations

import types
from copy import deepcopy

import pytest
import torch
from transformers.core_model_loading import apply_converters, dot_natural_key, revert_weight_conversion

from modelopt_ext.models.kimi_k3.convert import expert_converters

PACKED_KEY = "language_model.model.layers.1.block_sparse_moe.experts.3.{w}.{suffix}"


def test_converter_patterns():
    mx, dense = expert_converters("mxfp4"), expert_converters("dense")
    assert len(mx) == 4 and len(dense) == 2
    for suffix, convs, other in (("weight_packed", mx, "weight"), ("weight_scale", mx, "weight"),
                                 ("weight", dense, "weight_packed")):
        for w in ("w1", "w3", "w2"):
            key = PACKED_KEY.format(w=w, suffix=suffix)
            matching = [c for c in convs if c.compiled_sources.search(key)]
            assert len(matching) == 1, key
            renamed, pattern = apply_converters(key, convs)
            assert pattern is not None
            fused = "gate_up_proj" if w in ("w1", "w3") else "down_proj"
            tail = {"weight_packed": "_packed", "weight_scale": "_scale", "weight": ""}[suffix]
            assert renamed == f"language_model.model.layers.1.block_sparse_moe.experts.{fused}{tail}"
            # the other storage's converters do not touch this key
            other_convs = dense if convs is mx else mx
            assert not any(c.compiled_sources.search(key) for c in other_convs), key
    # dense converters leave packed keys alone and vice versa
    for c in dense:
        assert not c.compiled_sources.search(PACKED_KEY.format(w="w1", suffix="weight_packed"))
        assert not c.compiled_sources.search(PACKED_KEY.format(w="w1", suffix="weight_scale"))
    for c in mx:
        assert not c.compiled_sources.search(PACKED_KEY.format(w="w1", suffix="weight"))
    # nothing outside the routed experts is converted
    for key in ("language_model.model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight",
                "language_model.model.layers.0.mlp.up_proj.weight",
                "language_model.model.layers.1.block_sparse_moe.gate.weight"):
        assert apply_converters(key, mx + dense) == (key, None)


def test_unknown_storage_raises():
    with pytest.raises(ValueError, match="'fp8'"):
        expert_converters("fp8")


def _forward_convert(converters, state):
    """transformers' load-direction steps, on an in-memory state dict (keys in natural order)."""
    pattern_to_converter = {p: c for c in converters for p in c.source_patterns}
    out, pending = {}, {}
    for key, tensor in sorted(state.items(), key=lambda kv: dot_natural_key(kv[0])):
        renamed, pattern = apply_converters(key, converters)
        if pattern is None:
            out[key] = tensor
            continue
        conv = pending.setdefault(renamed, deepcopy(pattern_to_converter[pattern]))
        conv.add_tensor(renamed, key, pattern, tensor)
    for name, conv in pending.items():
        for k, v in conv.convert(name).items():
            out[k] = v[0] if isinstance(v, list) else v
    return out


@pytest.mark.parametrize("storage", ["mxfp4", "dense"])
def test_converters_round_trip(storage):
    E, I, L, layer = 5, 4, 6, 2
    g = torch.Generator().manual_seed(0)
    suffixes = {"mxfp4": {"weight_packed": "_packed", "weight_scale": "_scale"}, "dense": {"weight": ""}}[storage]
    per_expert = {}
    for src in suffixes:
        for e in range(E):
            for w, shape in (("w1", (I, L)), ("w3", (I, L)), ("w2", (L, I))):
                t = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8) if storage == "mxfp4" \
                    else torch.randn(shape, generator=g)
                per_expert[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.{src}"] = t
    other = {f"model.layers.{layer}.block_sparse_moe.gate.weight": torch.randn(E, 3, generator=g)}

    converters = expert_converters(storage)
    fused = _forward_convert(converters, {**per_expert, **other})
    prefix = f"model.layers.{layer}.block_sparse_moe.experts"
    assert set(fused) == {f"{prefix}.{p}{t}" for p in ("gate_up_proj", "down_proj") for t in suffixes.values()} | set(other)
    for src, tail in suffixes.items():
        gate_up, down = fused[f"{prefix}.gate_up_proj{tail}"], fused[f"{prefix}.down_proj{tail}"]
        assert gate_up.shape[:2] == (E, 2 * I) and down.shape[:2] == (E, L)
        for e in range(E):  # w1 rows first, then w3; experts in id order
            assert torch.equal(gate_up[e, :I], per_expert[f"{prefix}.{e}.w1.{src}"])
            assert torch.equal(gate_up[e, I:], per_expert[f"{prefix}.{e}.w3.{src}"])
            assert torch.equal(down[e], per_expert[f"{prefix}.{e}.w2.{src}"])

    # save direction: transformers' own revert_weight_conversion gives back the checkpoint keys and tensors
    fake_model = types.SimpleNamespace(_weight_conversions=expert_converters(storage), config=None)
    back = revert_weight_conversion(fake_model, dict(fused))
    assert set(back) == set(per_expert) | set(other)
    for k, v in per_expert.items():
        assert torch.equal(back[k], v), k

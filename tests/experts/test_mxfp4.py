"""modelopt_ext.experts.mxfp4 with a SiLU-GLU family made here: MXFP4 bytes kept as they are, the forward equal to
dense experts holding the dequantized weights, and each projection dequantized once per forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.moe import use_experts_implementation

from modelopt_ext.experts import mxfp4
from modelopt_ext.experts.fused import DenseExperts
from modelopt_ext.formats.mxfp4 import dequantize_mxfp4, quantize_mxfp4

E, L, I, T, K = 3, 64, 32, 7, 2


class _Config:
    _experts_implementation = "eager"


class _Silu:
    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


@mxfp4.materialize_in_forward
@use_experts_implementation(has_gate=True)
class PackedSilu(_Silu, mxfp4.PackedExperts):
    def __init__(self, config):
        super().__init__(E, L, I)


@use_experts_implementation(has_gate=True)
class DenseSilu(_Silu, DenseExperts):
    def __init__(self, config):
        super().__init__(E, L, I)


def _modules():
    g = torch.Generator().manual_seed(0)
    packed, dense = PackedSilu(_Config()), DenseSilu(_Config())
    with torch.no_grad():
        for name, shape in (("gate_up_proj", (E, 2 * I, L)), ("down_proj", (E, L, I))):
            codes, scale = quantize_mxfp4(torch.randn(*shape, generator=g))
            getattr(packed, f"{name}_packed").copy_(codes)
            getattr(packed, f"{name}_scale").copy_(scale)
            getattr(dense, name).copy_(dequantize_mxfp4(codes, scale, torch.float32))
    return packed, dense


def test_packed_storage_holds_the_bytes_and_computes_as_its_dequantized_weights():
    packed, dense = _modules()
    assert packed.gate_up_proj_packed.dtype == torch.uint8 and packed.gate_up_proj_packed.shape == (E, 2 * I, L // 2)
    assert not any(p.is_floating_point() for p in packed.parameters())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, L, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    with torch.no_grad():
        assert torch.equal(packed(x, idx, w), dense(x, idx, w))


def test_the_forward_dequantizes_each_projection_once(monkeypatch):
    packed, _ = _modules()
    calls = []
    real = mxfp4.dequantize_mxfp4
    monkeypatch.setattr(mxfp4, "dequantize_mxfp4", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(T, L)
    idx = torch.arange(T * K).reshape(T, K) % E
    with torch.no_grad():
        packed(x, idx, torch.ones(T, K))
    assert len(calls) == 2  # gate_up_proj and down_proj, whatever the number of experts hit

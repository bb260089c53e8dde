"""modelopt_ext.experts.fused with an activation that is not Kimi-K3's (SiLU-GLU, as DeepSeek-V3 and most MoEs):
the generic engine's eager, grouped and row paths against a per-token float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.moe import use_experts_implementation

from modelopt_ext.ep import local
from modelopt_ext.experts.fused import DenseExperts, FusedExperts
from modelopt_ext.options import ExpertsOptions

E, L, I, T, K = 4, 16, 8, 9, 2


class _Config:
    _experts_implementation = "eager"


@use_experts_implementation(has_gate=True)
class SiluExperts(DenseExperts):
    def __init__(self, config):
        super().__init__(E, L, I, init_std=0.3)

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _reference(module, x, idx, w):
    gate_up, down = module.gate_up_proj.double(), module.down_proj.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e == E:  # the EP sentinel: another rank's expert
                continue
            g, u = (gate_up[e] @ x[t].double()).chunk(2)
            out[t] += w[t, k].double() * (down[e] @ (F.silu(g) * u))
    return out


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, L, generator=g)
    idx = torch.stack([torch.randperm(E + 1, generator=g)[:K] for _ in range(T)])  # E: sentinel slots too
    return x, idx, torch.rand(T, K, generator=g)


def test_the_eager_forward_runs_the_family_activation():
    torch.manual_seed(0)
    module = SiluExperts(_Config())
    x, idx, w = _inputs(1)
    with torch.no_grad():
        got = module(x, idx, w)
    torch.testing.assert_close(got.double(), _reference(module, x, idx, w), rtol=1e-5, atol=1e-5)


def test_rows_grouped_by_expert_and_in_blocks_give_the_same_result():
    torch.manual_seed(0)
    module = SiluExperts(_Config())
    x, _, _ = _inputs(2)
    counts = [3, 0, 4, 2]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    with torch.no_grad():
        grouped = module.run_rows(x, offs_E=offs)
        blocks = local.block_segments([counts])
        per_block = module.run_rows(x, blocks)
        module.options = ExpertsOptions(segment_min_rows=1 << 30)  # regrouping is for CUDA; same rows on CPU
        again = module.run_rows(x, blocks)
    want = torch.cat([module._apply_gate(x[s:s + n] @ module.gate_up_proj[e].t()) @ module.down_proj[e].t()
                      for e, s, n in blocks])
    for got in (grouped, per_block, again):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_an_engine_without_an_activation_says_so():
    module = FusedExperts(E, L, I)
    with pytest.raises(NotImplementedError, match="FusedExperts defines no activation"):
        module._apply_gate(torch.zeros(1, 2 * I))

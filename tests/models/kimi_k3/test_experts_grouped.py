"""The experts' grouped path (`_grouped_forward`, `run_rows`) and when `fast_path` takes it. The path runs on
CUDA in production; here its arithmetic is checked on the CPU (torch._grouped_mm has a CPU kernel)."""

from __future__ import annotations

import torch

from modelopt_ext.ep import local
from modelopt_ext.experts import fused
from tests.models.kimi_k3.test_experts import (
    dense_experts,
    packed_experts,
    random_weights,
    reference_loops,
    routing,
)


def test_grouped_forward_matches_the_reference_with_sentinel_slots():
    W13, W2, x = random_weights(3)
    idx, w = routing(with_sentinel=True)
    want = reference_loops(x, idx, w, W13, W2)
    for module in (dense_experts(W13, W2, "eager"), packed_experts(W13, W2, "eager")[0]):
        with torch.no_grad(), module.materialized(torch.float32):
            got = module._grouped_forward(x, idx, w)
            eager = type(module).forward(module, x, idx, w)
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-5)
        if module.__class__.__name__ == "KimiK3Experts":
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_run_rows_segments_equal_grouped_offsets():
    W13, W2, x = random_weights(4)
    module = dense_experts(W13, W2, "eager")
    ids = torch.tensor([0, 0, 2, 3, 3, 3, 5])
    order, offs = local.sort_by_expert(ids, module.num_experts)
    counts = torch.bincount(ids, minlength=module.num_experts).tolist()
    segments = [(e, sum(counts[:e]), counts[e]) for e in range(module.num_experts)]
    with torch.no_grad():
        torch.testing.assert_close(module.run_rows(x[order], segments), module.run_rows(x[order], offs_E=offs),
                                   rtol=1e-5, atol=1e-6)


def test_small_segments_run_regrouped_with_the_same_result(monkeypatch):
    """[source][expert] blocks below `ExpertsOptions.segment_min_rows` (forced here on the CPU) are regrouped expert-major for
    the grouped GEMMs and put back in block order: the same rows as one GEMM per block."""
    W13, W2, x = random_weights(6)
    module = dense_experts(W13, W2, "eager")
    segments = local.block_segments([[2, 0, 1, 0, 0, 3], [0, 1, 1, 2, 0, 0]])
    rows = sum(r for _, _, r in segments)
    xs = x.repeat(2, 1)[:rows]
    with torch.no_grad():
        per_block = module.run_rows(xs, segments)
        calls = []
        monkeypatch.setattr(fused, "use_segment_gemms", lambda seg, dev, min_rows: calls.append(1) and False)
        regrouped = module.run_rows(xs, segments)
    assert calls, "the regrouped path was not taken"
    torch.testing.assert_close(regrouped, per_block, rtol=1e-5, atol=1e-6)


def test_fast_path_only_for_plain_cuda_inference():
    W13, W2, x = random_weights(5)
    module = dense_experts(W13, W2, "eager")
    assert not module.fast_path(x)  # CPU
    assert not module.fast_path(x.bfloat16())
    module.add_module("gate_up_proj_input_quantizer", torch.nn.Identity())  # what ModelOpt's conversion adds
    assert not module._quantizer_free()

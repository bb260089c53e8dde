"""ep.overlap on real gloo ranks: the chunked, overlapped exchange gives the dispatch/combine result exactly."""

import pytest
import torch

from modelopt_ext.ep.overlap import overlapped_moe
from modelopt_ext.testing.multiproc import run_ranks


@pytest.mark.parametrize("world_size", [2, 4])
def test_overlapped_moe_equals_dispatch_and_combine(world_size):
    results = run_ranks("modelopt_ext.testing.ep_bodies:overlap_vs_dispatch", world_size,
                        {"chunks": [1, 2, 3, 8]}, timeout_s=240)
    for rank, r in enumerate(results):
        assert r["shapes_ok"], f"rank {rank}: {r}"
        assert r["identical"] == {str(c): True for c in (1, 2, 3, 8)}, f"rank {rank}: {r}"
        assert r["segments_cover_rows"], f"rank {rank}"


def test_overlapped_moe_refuses_autograd():
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference-only"):
        overlapped_moe(x, torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2), 2, None, lambda r, s: r)

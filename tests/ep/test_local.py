"""ep.local: expert-grouped rows, the three GEMM layouts, and the fused combine's reference arithmetic."""

import pytest
import torch

from modelopt_ext.ep import local
from modelopt_ext.ep.dispatch import inverse_permutation, weighted_sum
from modelopt_ext.options import ExpertsOptions

E, L, I = 4, 32, 24


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return 0.2 * torch.randn(E, 2 * I, L, generator=g), 0.2 * torch.randn(E, L, I, generator=g)


def _act(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _loop(x, ids, w13, w2):
    return torch.stack([_act(x[r] @ w13[ids[r]].t()) @ w2[ids[r]].t() for r in range(x.shape[0])])


def test_sort_by_expert_groups_rows_and_puts_the_sentinel_last():
    ids = torch.tensor([3, 0, 4, 1, 0, 3, 4, 2])  # 4 == E: the EP sentinel
    order, offs = local.sort_by_expert(ids, E)
    assert ids[order].tolist() == [0, 0, 1, 2, 3, 3, 4, 4]
    assert order[:2].tolist() == [1, 4]  # stable
    assert offs.dtype == torch.int32 and offs.tolist() == [2, 3, 4, 6]
    inverse = inverse_permutation(order)
    assert torch.equal(order[inverse], torch.arange(8))


def test_grouped_segment_and_tiled_layouts_agree_with_a_row_loop():
    w13, w2 = _weights()
    ids = torch.tensor([2, 0, 0, 3, 2, 2, 0, 3, 3, 3, 0])
    x = torch.randn(ids.numel(), L)
    want = _loop(x, ids, w13, w2)
    order, offs = local.sort_by_expert(ids, E)
    grouped = local.expert_mlp(x[order], w13, w2, _act, offs_E=offs)
    torch.testing.assert_close(grouped, want[order], rtol=1e-4, atol=1e-4)
    counts = torch.bincount(ids, minlength=E).tolist()
    segments = [(e, sum(counts[:e]), counts[e]) for e in range(E)]  # expert 1 has no rows
    for tile in (0, 1, 2, 64):
        got = local.expert_mlp(x[order], w13, w2, _act, segments=segments, row_tile=tile)
        torch.testing.assert_close(got, want[order], rtol=1e-4, atol=1e-4)


def test_block_segments_walk_source_blocks_in_order():
    assert local.block_segments([[2, 0], [1, 3]]) == [(0, 0, 2), (1, 2, 0), (0, 2, 1), (1, 3, 3)]
    assert local.block_segments([[1]], start=5) == [(0, 5, 1)]


def test_project_needs_a_layout():
    w13, _ = _weights()
    try:
        local.project(torch.randn(3, L), w13)
    except ValueError as err:
        assert "offs_E" in str(err) and "segments" in str(err)
    else:
        raise AssertionError("project without offs_E or segments must refuse")


def test_gather_weighted_sum_is_the_combine_arithmetic():
    T, K, H = 5, 3, 8
    back = torch.randn(T * K, H)
    order = torch.randperm(T * K)
    inverse = inverse_permutation(order)
    w = torch.rand(T, K)
    want = weighted_sum(back.index_select(0, inverse).view(T, K, H), w)
    assert torch.equal(local.gather_weighted_sum(back, inverse, w), want)
    out = torch.empty(T + 2, H)
    local.gather_weighted_sum(back, inverse, w, out=out[1:T + 1])
    assert torch.equal(out[1:T + 1], want)


def test_regroup_orders_blocks_expert_major_and_back():
    # [source][expert] blocks of 2 sources x 3 experts; expert 1 of source 0 and expert 2 of source 1 empty
    counts = [[2, 0, 3], [1, 4, 0]]
    segments = local.block_segments(counts)
    ids = torch.tensor([e for e, _, rows in segments for _ in range(rows)])
    x = torch.arange(ids.numel()).float().unsqueeze(1)
    gather, offs, back = local.regroup(segments, 3, torch.device("cpu"))
    regrouped = x.index_select(0, gather)
    assert ids[gather].tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert gather.tolist() == [0, 1, 5, 6, 7, 8, 9, 2, 3, 4]  # sources in order within an expert
    assert offs.dtype == torch.int32 and offs.tolist() == [3, 7, 10]
    assert torch.equal(regrouped.index_select(0, back), x)


def test_regroup_refuses_unknown_experts():
    try:
        local.regroup([(0, 0, 2), (3, 2, 1)], 3, torch.device("cpu"))
    except ValueError as err:
        assert "outside [0, 3)" in str(err)
    else:
        raise AssertionError("expert 3 of 3 accepted")


def test_segment_gemms_only_for_large_segments_on_gpus():
    min_rows = ExpertsOptions().segment_min_rows
    big, small = [(0, 0, min_rows), (1, min_rows, 0)], [(0, 0, 8), (1, 8, 8)]
    cuda = torch.device("cuda")
    assert local.use_segment_gemms(big, cuda, min_rows) and not local.use_segment_gemms(small, cuda, min_rows)
    assert local.use_segment_gemms(small, cuda, 8) and not local.use_segment_gemms(small, cuda, 9)
    assert local.use_segment_gemms(small, torch.device("cpu"), min_rows)  # CPUs keep per-block GEMMs (exact rows)


def test_expert_major_offsets_only_for_expert_major_layouts():
    from modelopt_ext.ep.local import expert_major_offsets

    cpu = torch.device("cpu")
    # expert-major, expert 1 empty: inclusive offsets per expert
    assert expert_major_offsets([(0, 0, 3), (1, 3, 0), (2, 3, 4)], 4, 7, cpu).tolist() == [3, 3, 7, 7]
    assert expert_major_offsets([], 2, 0, cpu).tolist() == [0, 0]
    # [source][expert] blocks (an expert twice), out of order, a gap, rows left over, an unknown expert
    assert expert_major_offsets([(0, 0, 2), (1, 2, 1), (0, 3, 2)], 2, 5, cpu) is None
    assert expert_major_offsets([(1, 0, 2), (0, 2, 1)], 2, 3, cpu) is None
    assert expert_major_offsets([(0, 0, 2), (1, 3, 1)], 2, 4, cpu) is None
    assert expert_major_offsets([(0, 0, 2)], 2, 3, cpu) is None
    assert expert_major_offsets([(0, 0, 2), (2, 2, 1)], 2, 3, cpu) is None


def test_block_rows_and_segment_outputs_without_gaps():
    from modelopt_ext.ep.local import _tile_rows, block_rows

    cpu = torch.device("cpu")
    assert block_rows([5, 0, 9], [2, 1, 0], cpu).tolist() == [5, 6, 0]
    assert block_rows([], [], cpu).tolist() == []
    assert _tile_rows([(1, 0, 2), (0, 2, 0), (0, 2, 3)], 5)
    assert not _tile_rows([(1, 0, 2), (0, 3, 2)], 5)  # row 2 unwritten
    assert not _tile_rows([(1, 0, 2)], 3)
    # a row outside every segment still comes out as zeros
    x, w = torch.ones(5, 4), torch.ones(2, 3, 4)
    out = local.project(x, w, segments=[(0, 0, 2), (1, 3, 2)])
    assert out[2].eq(0).all() and out[[0, 1, 3, 4]].eq(4).all()


def test_expert_row_amax_by_offsets_and_by_segments():
    """Each expert's largest |value| over its rows, -inf for an expert without rows, rows outside every group
    ignored; the same from `offs_E` and from `segments` laid out otherwise."""
    from modelopt_ext.ep.local import expert_row_amax

    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 6, generator=g)
    x[9] = 100.0  # past the last offset: no expert's row
    rows = {0: [0, 1, 2], 1: [], 2: [3, 4, 5, 6, 7, 8]}  # expert 1 gets none
    expected = torch.tensor([x[r].abs().max() if r else float("-inf") for r in rows.values()])
    offs = torch.tensor([3, 3, 9], dtype=torch.int32)
    assert torch.equal(expert_row_amax(x, 3, offs_E=offs), expected)
    # the same rows as host segments, expert 2's split in two blocks around expert 0's
    y = torch.cat([x[3:5], x[0:3], x[5:9]])
    segments = [(2, 0, 2), (0, 2, 3), (1, 5, 0), (2, 5, 4)]
    assert torch.equal(expert_row_amax(y, 3, segments=segments), expected)
    assert torch.equal(expert_row_amax(x[:0], 3, offs_E=torch.zeros(3, dtype=torch.int32)),
                       torch.full((3,), float("-inf")))
    with pytest.raises(ValueError, match="needs offs_E"):
        expert_row_amax(x, 3)

"""The local experts' arithmetic on rows already grouped by expert, and the fused combine.

Shapes: S rows, E experts, L the experts' model width, I the expert width, T tokens, K top-k, H row width.

Rows reach the experts grouped by expert, in one of two layouts:
- `offs_E` (device int32, inclusive cumulative row counts): one `torch._grouped_mm` per projection, no host
  sync on GPUs (the sync-free path; on CPUs transformers' dispatcher, which may loop);
- `segments` (host tuples `(expert, first_row, rows)`, known when the EP exchange already brought its split
  sizes to the host): one cuBLAS GEMM per segment written into a view of one output, no gather needed when
  each segment is a contiguous block of the received rows.
The activation runs once over all rows between the two projections.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from transformers.integrations.moe import _grouped_mm

from .dispatch import count_ids, weighted_sum

Segment = tuple[int, int, int]  # (expert, first row, rows)

# CPU BLAS (MKL) computes GEMMs of fewer than 12 rows with other kernels that round differently, so an expert
# that receives few tokens would give a token a result that depends on how many tokens share its expert (and
# so on the EP degree and on how the exchange cut the rows into blocks). Padding to MIN_ROWS zero rows keeps
# each row's result independent of the others; zero rows do not move max calibration statistics.
MIN_ROWS = 16


def pad_rows(x_ML: torch.Tensor) -> torch.Tensor:
    """x with zero rows appended up to MIN_ROWS rows (unchanged when it has that many)."""
    M = x_ML.shape[0]
    return x_ML if M >= MIN_ROWS else torch.cat([x_ML, x_ML.new_zeros(MIN_ROWS - M, x_ML.shape[1])])


def sort_by_expert(ids_S: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of the S slots grouped by expert (stable) and the inclusive row offsets per expert.

    Ids equal to `num_experts` (the EP sentinel) sort last and fall outside every group. No host sync
    (`dispatch.count_ids`).
    """
    order_S = torch.argsort(ids_S, stable=True)
    return order_S, torch.cumsum(count_ids(ids_S, num_experts + 1)[:num_experts], 0, dtype=torch.int32)


def _tile_rows(segments: Sequence[Segment], num_rows: int) -> bool:
    """Whether the segments, in order, cover rows 0..num_rows back to back (every output row gets written)."""
    row = 0
    for _, start, rows in segments:
        if rows and start != row:
            return False
        row += rows
    return row == num_rows


def _segment_mm(x_SL: torch.Tensor, w_ENL: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
    # zeros only where a row may be left unwritten (filling [S, N] costs as much as a small GEMM)
    new = x_SL.new_empty if _tile_rows(segments, x_SL.shape[0]) else x_SL.new_zeros
    out = new(x_SL.shape[0], w_ENL.shape[1])
    for e, start, rows in segments:
        if not rows:
            continue
        if x_SL.is_cuda or rows >= MIN_ROWS:
            torch.mm(x_SL[start:start + rows], w_ENL[e].t(), out=out[start:start + rows])
        else:  # CPU: each row's result independent of the block size (see MIN_ROWS)
            out[start:start + rows] = torch.mm(pad_rows(x_SL[start:start + rows]), w_ENL[e].t())[:rows]
    return out


def project(x_SL: torch.Tensor, w_ENL: torch.Tensor, offs_E: torch.Tensor | None = None,
            segments: Sequence[Segment] | None = None) -> torch.Tensor:
    """[S, L] @ per-expert [N, L]^T -> [S, N]; rows outside every group/segment come out as zeros only on the
    segment path (the grouped path leaves rows past the last offset undefined)."""
    if segments is not None:
        return _segment_mm(x_SL, w_ENL, segments)
    if offs_E is None:
        raise ValueError("project needs offs_E (grouped rows) or segments (host row blocks)")
    if x_SL.is_cuda:  # the call measured sync-free (scripts/gpu_check_sync.py)
        return torch._grouped_mm(x_SL, w_ENL.transpose(-2, -1), offs=offs_E)
    # elsewhere transformers' dispatcher: torch's kernel where it runs (CPU from torch 2.9, aligned), or a loop
    return _grouped_mm(x_SL, w_ENL.transpose(-2, -1), offs_E)


# Rows per tile on the segment path (`ExpertsOptions.row_tile`; 0: whole segments). With tiles, each tile's
# gate/up output is consumed by the activation and the down projection right after its GEMM, while it is still
# in L2 (60 MB on an H200), instead of a full-size round trip through HBM.


def _tiled_mlp(x_SL, gate_up_E2IL, down_ELI, act, segments: Sequence[Segment], tile: int) -> torch.Tensor:
    out = x_SL.new_zeros(x_SL.shape[0], down_ELI.shape[1])
    for e, start, rows in segments:
        for first in range(start, start + rows, tile):
            last = min(first + tile, start + rows)
            h = act(torch.mm(x_SL[first:last], gate_up_E2IL[e].t()))
            torch.mm(h, down_ELI[e].t(), out=out[first:last])
    return out


def expert_mlp(x_SL: torch.Tensor, gate_up_E2IL: torch.Tensor, down_ELI: torch.Tensor,
               act: Callable[[torch.Tensor], torch.Tensor], offs_E: torch.Tensor | None = None,
               segments: Sequence[Segment] | None = None, row_tile: int = 0) -> torch.Tensor:
    """down(act(gate_up(x))) per expert on grouped rows (see module doc for `offs_E` / `segments`)."""
    if segments is not None and row_tile:
        return _tiled_mlp(x_SL, gate_up_E2IL, down_ELI, act, segments, row_tile)
    h_SI = act(project(x_SL, gate_up_E2IL, offs_E, segments))
    return project(h_SI, down_ELI, offs_E, segments)


# On CUDA, segments run as one cuBLAS GEMM each when they hold at least `min_rows` rows on average
# (`ExpertsOptions.segment_min_rows`, 4096); smaller ones are regrouped expert-major (`regroup`) for one
# `torch._grouped_mm` per projection. A cuBLAS call with a row count it has not seen costs ~170 us of host time
# (its kernel heuristics; measured in calibration, where every batch routes differently), more than the GPU time
# of a GEMM of a few thousand rows at these widths, so small segments leave the GPU waiting for the host. See
# docs/performance.md.


def use_segment_gemms(segments: Sequence[Segment], device: torch.device, min_rows: int) -> bool:
    """Whether `segments` should run as per-segment GEMMs (always on CPUs, where that keeps every row's
    result independent of the blocks; see above) rather than regrouped."""
    if device.type != "cuda":
        return True
    sizes = [rows for _, _, rows in segments if rows]
    return not sizes or sum(sizes) / len(sizes) >= min_rows


def _pinned(values: list[int], device: torch.device, dtype=torch.int64) -> torch.Tensor:
    """A small host list on `device` without a host sync (pinned memory, asynchronous copy)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def block_rows(starts: Sequence[int], sizes: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 row indices on `device`: rows [starts[i], starts[i] + sizes[i]) for each block i, in order. Built on
    the device from the host lists (no host sync)."""
    total = sum(sizes)
    if not total:
        return torch.empty(0, dtype=torch.int64, device=device)
    firsts = list(itertools.accumulate(sizes, initial=0))[:-1]
    shift = _pinned([start - first for start, first in zip(starts, firsts)], device)
    return torch.arange(total, device=device) + shift.repeat_interleave(_pinned(list(sizes), device),
                                                                       output_size=total)


def regroup(segments: Sequence[Segment], num_experts: int, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows laid out as `segments` (each a contiguous block of one expert's rows, e.g. [source][expert]):
    `gather_R` (row i of the expert-major layout is row gather_R[i] of the input), `offs_E` (int32 inclusive
    row offsets per expert, for `project`) and `back_R` (row j of the input layout is row back_R[j] of the
    expert-major one). Built on the device from the host sizes; no host sync."""
    blocks = [(e, start, rows) for e, start, rows in segments if rows]
    if any(not 0 <= e < num_experts for e, _, _ in blocks):
        raise ValueError(f"segment experts {sorted({e for e, _, _ in blocks})} outside [0, {num_experts})")
    order = sorted(range(len(blocks)), key=lambda b: blocks[b][0])  # stable: source order within an expert
    dst_start, row = [0] * len(blocks), 0
    for b in order:
        dst_start[b] = row
        row += blocks[b][2]
    totals = [0] * num_experts
    for e, _, rows in blocks:
        totals[e] += rows
    offs = list(itertools.accumulate(totals))

    def index(block_order: list[int], to_start: list[int], from_start: list[int]) -> torch.Tensor:
        # for each row of the `block_order` layout (blocks back to back, from_start): its row in the other layout
        return block_rows([to_start[b] for b in block_order], [blocks[b][2] for b in block_order], device)

    src_start = [start for _, start, _ in blocks]
    gather_R = index(order, src_start, dst_start)
    back_R = index(sorted(range(len(blocks)), key=lambda b: src_start[b]), dst_start, src_start)
    return gather_R, _pinned(offs, device, torch.int32), back_R


def expert_major_offsets(segments: Sequence[Segment], num_experts: int, num_rows: int, device: torch.device
                         ) -> torch.Tensor | None:
    """`offs_E` for `project` when `segments` already lay the `num_rows` rows out expert-major (each expert at
    most one segment, in expert order, back to back from row 0 to the last): the grouped GEMMs then run on
    the rows in place, with no `regroup` gathers. None for any other layout."""
    experts = [e for e, _, rows in segments if rows]
    if not _tile_rows(segments, num_rows) or any(not 0 <= e < num_experts for e in experts) or any(
            a >= b for a, b in itertools.pairwise(experts)):
        return None
    totals = [0] * num_experts
    for e, _, rows in segments:
        totals[e] += rows
    return _pinned(list(itertools.accumulate(totals)), device, torch.int32)


def block_segments(counts_WE: Sequence[Sequence[int]], start: int = 0) -> list[Segment]:
    """Segments of rows laid out as blocks [source rank][local expert] (what `dispatch` delivers)."""
    segments, row = [], start
    for per_expert in counts_WE:
        for e, rows in enumerate(per_expert):
            segments.append((e, row, rows))
            row += rows
    return segments


def _gather_weighted_sum(back_SH: torch.Tensor, inverse_S: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    T, K = weights_TK.shape
    return weighted_sum(back_SH.index_select(0, inverse_S).view(T, K, back_SH.shape[1]), weights_TK).to(back_SH.dtype)


def gather_weighted_sum(back_SH: torch.Tensor, inverse_S: torch.Tensor, weights_TK: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H] in back's dtype: slot k of token t is row `inverse_S[t*K + k]` of `back_SH`; the K slots are
    weighted and summed in fp32. On CUDA one Triton kernel (`kernels.combine`) reads each slot row once and
    writes into `out` when given (no [T, K, H] copy)."""
    if back_SH.is_cuda:
        from modelopt_ext.kernels.combine import gather_weighted_sum as kernel

        return kernel(back_SH, inverse_S, weights_TK, out)
    result = _gather_weighted_sum(back_SH, inverse_S, weights_TK)
    if out is None:
        return result
    out.copy_(result)
    return out


def expert_row_amax(x_SL: torch.Tensor, num_experts: int, offs_E: torch.Tensor | None = None,
                    segments: Sequence[Segment] | None = None) -> torch.Tensor:
    """fp32 [E]: the largest |value| among the rows of each expert (rows grouped as `project` takes them:
    `offs_E` or `segments`); -inf for an expert without rows. Rows outside every group are ignored. No host
    sync."""
    row_max_S = x_SL.detach().abs().amax(dim=-1).float() if x_SL.shape[0] else x_SL.new_empty(0, dtype=torch.float32)
    if segments is not None:
        blocks = [(e, start, rows) for e, start, rows in segments if rows]
        rows_R = block_rows([s for _, s, _ in blocks], [r for _, _, r in blocks], x_SL.device)
        ids_R = _pinned([e for e, _, _ in blocks], x_SL.device).repeat_interleave(
            _pinned([r for _, _, r in blocks], x_SL.device), output_size=rows_R.numel()) if blocks else rows_R
        row_max_S = row_max_S.index_select(0, rows_R)
    elif offs_E is not None:
        ids_R = torch.searchsorted(offs_E.to(torch.int64), torch.arange(x_SL.shape[0], device=x_SL.device),
                                   right=True)
    else:
        raise ValueError("expert_row_amax needs offs_E (grouped rows) or segments (host row blocks)")
    out = torch.full((num_experts + 1,), float("-inf"), device=x_SL.device)
    out.scatter_reduce_(0, ids_R.clamp(max=num_experts), row_max_S, reduce="amax")
    return out[:num_experts]

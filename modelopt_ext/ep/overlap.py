"""Expert-parallel MoE forward with the exchange overlapped with the local experts (inference, NCCL).

Shapes: T tokens on this rank, K top-k, S = T*K slots, W ranks, E local experts, C chunks, H row width.

The rank's tokens are split into C contiguous chunks. One count exchange and one host sync give every
chunk's split sizes. Chunk by chunk, the send rows are gathered and their dispatch exchange issued
(asynchronous, on the process group's stream), so chunk c+1's gather overlaps chunk c's exchange. Chunk c's
experts run as soon as its rows arrive, while later chunks are still on the wire; its outputs go back
(asynchronously) while chunk c+1 computes, and its tokens are weighted and summed
(`local.gather_weighted_sum`, one pass) once chunk c+1's experts are enqueued.

Send layout: slots sorted by (chunk, global expert id): per chunk, per destination rank, per local expert.
Receive layout: per chunk, per source rank, per local expert, so each (source, expert) block is contiguous
and the local experts run on the received buffer in place (`local.block_segments`), without a gather.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from modelopt_ext.faults import mark_exchange

from .dispatch import count_ids, inverse_permutation
from .local import Segment, block_segments, gather_weighted_sum

# Chunks of the rank's tokens (C above). 1 exchanges everything, then computes, then exchanges back.
CHUNKS = 2

RunRows = Callable[[torch.Tensor, Sequence[Segment]], torch.Tensor]


def _chunk_keys(ids_TK: torch.Tensor, chunks: int, num_global_experts: int) -> torch.Tensor:
    T, K = ids_TK.shape
    chunk_T = torch.arange(T, device=ids_TK.device) * chunks // max(T, 1)
    return (chunk_T.unsqueeze(1) * num_global_experts + ids_TK).reshape(-1)


def overlapped_moe(x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_local_experts: int,
                   group, run_rows: RunRows, chunks: int | None = None) -> torch.Tensor:
    """[T, H]: each token's K expert outputs (computed on the experts' owner ranks) weighted and summed.

    Args:
        x_TH: this rank's tokens; ids_TK: int64 global expert ids in [0, W*E); weights_TK: routing weights.
        run_rows: `(rows [R, H], segments) -> [R, H_out]` the local experts on received rows, row order kept.
        chunks: C (default `CHUNKS`); the same on every rank of the group, whatever its T.
    """
    if torch.is_grad_enabled() and (x_TH.requires_grad or weights_TK.requires_grad):
        raise RuntimeError("overlapped_moe is inference-only (no autograd through its exchanges); "
                           "call it under torch.no_grad() or use ep.dispatch")
    mark_exchange()
    W, E = dist.get_world_size(group), num_local_experts
    T, K = ids_TK.shape
    C = chunks or CHUNKS  # every rank must use the same C (one exchange per chunk); chunks may be empty
    if C < 1:
        raise ValueError(f"chunks must be >= 1, got {C}")
    key_S = _chunk_keys(ids_TK, C, W * E)
    order_S = torch.argsort(key_S, stable=True)
    send_WCE = count_ids(key_S, C * W * E).view(C, W, E).transpose(0, 1).contiguous()
    recv_WCE = torch.empty_like(send_WCE)
    dist.all_to_all_single(recv_WCE, send_WCE, group=group)
    send_host, recv_host = torch.stack([send_WCE, recv_WCE]).tolist()  # the one host sync
    send_sizes = [[sum(send_host[w][c]) for w in range(W)] for c in range(C)]
    recv_sizes = [[sum(recv_host[w][c]) for w in range(W)] for c in range(C)]
    send_off = [sum(map(sum, send_sizes[:c])) for c in range(C + 1)]
    recv_off = [sum(map(sum, recv_sizes[:c])) for c in range(C + 1)]
    token_off = [(c * T + C - 1) // C for c in range(C + 1)]  # chunk c: tokens t with t * C // T == c
    # Chunk by chunk: gather its send rows, then issue its exchange, so chunk c+1's gather overlaps chunk c's.
    source_S = order_S // K
    send_x = x_TH.new_empty(send_off[C], x_TH.shape[1])
    recv_x = x_TH.new_empty(recv_off[C], x_TH.shape[1])
    arrivals = []
    for c in range(C):
        sent = send_x[send_off[c]:send_off[c + 1]]
        torch.index_select(x_TH, 0, source_S[send_off[c]:send_off[c + 1]], out=sent)
        arrivals.append(dist.all_to_all_single(recv_x[recv_off[c]:recv_off[c + 1]], sent, recv_sizes[c],
                                               send_sizes[c], group=group, async_op=True))
    inverse_S = inverse_permutation(order_S)
    back = out = None
    returns = []

    def finish(c: int) -> None:  # chunk c's tokens: wait for their slots, weight and sum them
        returns[c].wait()
        tokens = slice(token_off[c], token_off[c + 1])
        gather_weighted_sum(back, inverse_S[token_off[c] * K:token_off[c + 1] * K], weights_TK[tokens],
                            out=out[tokens])

    for c in range(C):
        arrivals[c].wait()
        y = run_rows(recv_x[recv_off[c]:recv_off[c + 1]], block_segments([recv_host[w][c] for w in range(W)]))
        if back is None:
            back, out = y.new_empty(send_off[C], y.shape[1]), y.new_empty(T, y.shape[1])
        returns.append(dist.all_to_all_single(back[send_off[c]:send_off[c + 1]], y, send_sizes[c], recv_sizes[c],
                                              group=group, async_op=True))
        if c:  # enqueued after chunk c's experts, so chunk c-1's return overlaps them
            finish(c - 1)
    finish(C - 1)
    return out

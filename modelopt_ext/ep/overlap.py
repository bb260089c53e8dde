"""Expert-parallel MoE forward with the exchange overlapped with the local experts (inference, NCCL).

Shapes: T tokens on this rank, K top-k, S = T*K slots, W ranks, E local experts, C chunks, H row width.

The rank's tokens are split into C contiguous chunks. One count exchange and one host sync give every
chunk's split sizes. Chunk by chunk, the send rows are gathered and their dispatch exchange issued
(asynchronous, on the process group's stream), so chunk c+1's gather overlaps chunk c's exchange. Chunk c's
experts run as soon as its rows arrive, while later chunks are still on the wire; its outputs go back
(asynchronously) while chunk c+1 computes, and its tokens are weighted and summed
(`local.gather_weighted_sum`, one pass) once chunk c+1's experts are enqueued.

Send layout: slots sorted by (chunk, global expert id): per chunk, per destination rank, per local expert.
Receive layout: per chunk, per source rank, per local expert through NCCL, so each (source, expert) block is
contiguous and the local experts run on the received buffer in place (`local.block_segments`), without a
gather; per chunk, per local expert, per source rank through the copy engines, so each expert's rows are one
segment.

The rows move through a link (`ExpertsOptions.transport`, chosen by the registry `ep.links`): NCCL's
`all_to_all_single` (`link.NcclLink`; `token_link.TokenLink` sends each token once per rank), or copy engines
into peer-mapped memory (`copy_engine.CopyEngineLink`, CUDA ranks of one host), which leave the SMs to the
experts' GEMMs. `overlapped_moe` takes the link's steps in the order `link.Link` declares: `plan` (the counts
exchange and the one host sync) returns the call's frozen plan, and every later step gets that plan: the send
and receive buffers, per chunk `send`, then `received` (the rows the experts run on) and `send_back`, with
`return_buffer` once, after the first chunk's experts. The compute stream waits for the handles `send` and
`send_back` return. The link object keeps nothing of the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from modelopt_ext.faults import mark_exchange
from modelopt_ext.options import DEFAULT

from . import links
from .dispatch import count_ids, inverse_permutation
from .link import Routing
from .local import Segment, gather_weighted_sum

# How rows move between ranks (`ExpertsOptions.transport`, the links registered in `ep.links`): "nccl"
# (all_to_all_single on the process group's stream; with `token_dispatch`, one row per token and destination
# rank, `ep.token_link`), "copy_engine" (`ep.copy_engine`: copy engines into peer-mapped memory; CUDA ranks of
# one host) or "auto": the copy engines for CUDA tokens when every rank of the job runs on this host (torchrun's
# LOCAL_WORLD_SIZE equals WORLD_SIZE), NCCL otherwise. Measured side by side (docs/performance.md, session 5): the
# copy engines win for large layers (16,384 tokens a rank) and lose for calibration-sized ones (8,192 tokens,
# top-8), where their per-block copies cost more than they hide; so NCCL is the default.

RunRows = Callable[[torch.Tensor, Sequence[Segment]], torch.Tensor]


def _link(transport: str, token_dispatch: bool, group, x_TH: torch.Tensor):
    """The link for a call, as the registry chooses it (`ep.links`); it holds nothing of the call."""
    return links.build(links.choose(transport, token_dispatch, x_TH), group, x_TH)


def _token_chunks(T: int, chunks: int, device) -> torch.Tensor:
    """Each token's chunk: t * C // T (contiguous chunks of near-equal size)."""
    return torch.arange(T, device=device) * chunks // max(T, 1)


def chunk_routing(ids_TK: torch.Tensor, world: int, num_local_experts: int,
                  chunks: int) -> tuple[torch.Tensor, Routing]:
    """What a link's `plan` takes for ids_TK split into C = `chunks` contiguous chunks of tokens: this rank's
    counts send_WCE [W, C, E] (slots for rank w's local expert e in chunk c) and the `Routing`, whose send order
    sorts the slots by (chunk, global expert id). On the device, no host sync."""
    W, E, C, T = world, num_local_experts, chunks, ids_TK.shape[0]
    chunk_T = _token_chunks(T, C, ids_TK.device)
    key_S = (chunk_T.unsqueeze(1) * (W * E) + ids_TK).reshape(-1)
    order_S = torch.argsort(key_S, stable=True)
    send_WCE = count_ids(key_S, C * W * E).view(C, W, E).transpose(0, 1).contiguous()
    return send_WCE, Routing(ids_TK, order_S, chunk_T, C)


def overlapped_moe(x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_local_experts: int,
                   group, run_rows: RunRows, chunks: int = DEFAULT.chunks, transport: str = DEFAULT.transport,
                   token_dispatch: bool = DEFAULT.token_dispatch) -> torch.Tensor:
    """[T, H]: each token's K expert outputs (computed on the experts' owner ranks) weighted and summed.

    Args:
        x_TH: this rank's tokens; ids_TK: int64 global expert ids in [0, W*E); weights_TK: routing weights.
        run_rows: `(rows [R, H], segments) -> [R, H_out]` the local experts on received rows, row order kept.
        chunks: C; the same on every rank of the group, whatever its T.
        transport, token_dispatch: how rows move (`modelopt_ext.options.ExpertsOptions`); the same on every rank.
    """
    if torch.is_grad_enabled() and (x_TH.requires_grad or weights_TK.requires_grad):
        raise RuntimeError("overlapped_moe is inference-only (no autograd through its exchanges); "
                           "call it under torch.no_grad() or use ep.dispatch")
    C = chunks  # every rank must use the same C (one exchange per chunk); chunks may be empty
    if C < 1:
        raise ValueError(f"chunks must be >= 1, got {C}")
    link = _link(transport, token_dispatch, group, x_TH)
    mark_exchange()
    T, K = ids_TK.shape
    send_WCE, routing = chunk_routing(ids_TK, dist.get_world_size(group), num_local_experts, C)
    order_S = routing.order_S
    plan = link.plan(send_WCE, routing, x_TH)
    send_off = plan.send_off
    token_off = [(c * T + C - 1) // C for c in range(C + 1)]  # chunk c: tokens t with t * C // T == c
    # Chunk by chunk: gather its send rows, then issue its exchange, so chunk c+1's gather overlaps chunk c's.
    source_S = order_S // K
    send_x = link.send_buffer(plan, x_TH)
    recv = link.receive_buffer(plan, x_TH)
    arrivals = [link.send(plan, c, x_TH, source_S[send_off[c]:send_off[c + 1]], send_x, recv) for c in range(C)]
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
        y = run_rows(link.received(plan, c, recv), plan.chunk_segments(c))
        if back is None:
            back, out = link.return_buffer(plan, y), y.new_empty(T, y.shape[1])
        returns.append(link.send_back(plan, c, y, back))
        if c:  # enqueued after chunk c's experts, so chunk c-1's return overlaps them
            finish(c - 1)
    finish(C - 1)
    return out

"""The NCCL exchange with each token sent once per destination rank (`ExpertsOptions.token_dispatch`).

Shapes: T tokens on this rank, K top-k, S = T*K slots, W ranks, E local experts, C chunks, H row width,
N token rows sent, R slot rows received.

The plain exchange (`link.NcclLink`) sends one row per slot, so a token with several of its K experts on
one rank crosses the link once per such expert. Here each token row crosses once to every rank that owns at
least one of its experts, together with, per slot, the position of its token among the rows sent to that
rank; the receiver rebuilds the slot rows with one gather in its own memory, in exactly the layout the plain
exchange delivers ([source rank][local expert] blocks per chunk). The experts, the return exchange (one row
per slot: summing a rank's slots before the return would change the fp32 summation order) and the combine
are unchanged, and the results are the same bits.

`TokenLink` takes the steps of `link.Link` in the same order. Its plan (`TokenPlan`) is a `link.Layout` of the
slot rows plus the call's token routing (`route_tokens`: which token rows go where and each slot's token
position, computed on the device without a host sync) and the token counts, exchanged in the same all_to_all
as the slot counts and read back in the same host sync. Its receive buffer is a `TokenReceive` record: the
slot rows the experts run on, the token rows received and each received slot's token position. Per chunk,
`send` issues two all_to_alls (the token rows, then the slots' positions) and `received` rebuilds the chunk's
slot rows with one gather. The return (`return_buffer`, `send_back`) is `NcclLink`'s.

What it saves depends on how many of a token's experts share a rank: with K experts spread uniformly over W
ranks, a token reaches min(K, W)-ish distinct ranks instead of K. At 2 ranks and top-16 the dispatch moves
about 8x fewer bytes; at Kimi-K3's EP64 (top-16 of 896 experts) about 14.3 distinct ranks of 16 slots: 1.1x.
The receiver pays one gather of the R slot rows (HBM to HBM) and an int64 per slot on the link.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch
import torch.distributed as dist

from .dispatch import count_ids
from .link import Layout, NcclLink, Routing


class _Both:
    def __init__(self, *works):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


@dataclasses.dataclass(frozen=True)
class TokenRoute:
    """Which token rows a call sends where (device tensors).

    token_source [W*T]: the token of each sent token row, ordered by chunk, then destination rank, then token
        (the first N entries; the (rank, token) pairs not sent follow them).
    slot_position [S]: per slot, in send order, the position of its token among the token rows its chunk sends
        to the slot's rank.
    tokens_CW [C, W]: the token rows sent per chunk and destination rank.
    """

    token_source: torch.Tensor
    slot_position: torch.Tensor
    tokens_CW: torch.Tensor


def route_tokens(routing: Routing, world: int, num_local_experts: int) -> TokenRoute:
    """The token rows of a call and where they go (`TokenRoute`), on the device, with no host sync: a token
    goes once to every rank that owns at least one of its experts (rank w owns global experts [w*E, (w+1)*E))."""
    ids_TK, order_S, chunk_T, C = routing.ids_TK, routing.order_S, routing.chunk_T, routing.chunks
    W, T, device = world, ids_TK.shape[0], ids_TK.device
    dest_TK = ids_TK // num_local_experts
    # [W, T] (rank-major): torch scans an inner dimension fast, an outer one of width W very slowly
    sent_WT = torch.zeros(W, T, dtype=torch.bool, device=device).scatter_(0, dest_TK.t(), True)
    # pair p = w * T + t; the sent pairs sorted by (chunk, destination), token order kept; unsent ones last
    rank_W1 = torch.arange(W, device=device).unsqueeze(1)
    pair_key = torch.where(sent_WT, chunk_T.unsqueeze(0) * W + rank_W1, C * W).reshape(-1)
    token_source = torch.argsort(pair_key, stable=True) % max(T, 1)
    sent = sent_WT.long()
    before_WT = torch.cumsum(sent, 1) - sent
    chunk_first_T = (chunk_T * T + C - 1) // C
    position_WT = before_WT - before_WT.index_select(1, chunk_first_T)
    pair_S = (dest_TK * T + torch.arange(T, device=device).unsqueeze(1)).reshape(-1)
    slot_position = position_WT.reshape(-1).index_select(0, pair_S).index_select(0, order_S)
    return TokenRoute(token_source, slot_position, count_ids(pair_key, C * W + 1)[:C * W].view(C, W))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenPlan(Layout):
    """One call's plan through `TokenLink`: the `Layout` of the slot rows (as `NcclLink`'s) and the token rows.

    token_source [W*T], slot_position [S]: as in `TokenRoute` (send side, device).
    token_base_CW [C, W]: per (chunk, source rank), the first of its token rows in the received token rows.
    slots_in_CW [C, W]: per (chunk, source rank), the slot rows it sends this rank (device).
    tokens_sent[c][w] / tokens_received[c][w]: token rows sent to / received from rank w in chunk c (host).
    """

    token_source: torch.Tensor
    slot_position: torch.Tensor
    token_base_CW: torch.Tensor
    slots_in_CW: torch.Tensor
    tokens_sent: list[list[int]]
    tokens_received: list[list[int]]

    @functools.cached_property
    def token_send_off(self) -> list[int]:  # first token row each chunk sends, and the total
        return list(itertools.accumulate(map(sum, self.tokens_sent), initial=0))

    @functools.cached_property
    def token_recv_off(self) -> list[int]:
        return list(itertools.accumulate(map(sum, self.tokens_received), initial=0))


@dataclasses.dataclass(frozen=True)
class TokenReceive:
    """A call's receive buffers through `TokenLink`: the slot rows [R, H] the experts run on, the token rows
    received [token_recv_off[-1], H] and each received slot's token position [R]."""

    slots: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor


class TokenLink(NcclLink):
    """`overlap.overlapped_moe`'s exchange steps with token-level dispatch (see the module doc); the return
    (`return_buffer`, `send_back`) is `NcclLink`'s, one row per slot."""

    def plan(self, send_WCE: torch.Tensor, routing: Routing, x_TH: torch.Tensor | None) -> TokenPlan:
        """Slot and token counts of every (rank, chunk) exchanged in one all_to_all, read in one host sync."""
        W, C, E = send_WCE.shape
        route = route_tokens(routing, W, E)
        counts = torch.cat([send_WCE, route.tokens_CW.t().unsqueeze(-1)], dim=2).contiguous()  # [W, C, E + 1]
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        # for `received`, queued before the sync: per (chunk, source) the first of its token rows in the
        # receive buffer and its slot count
        tokens_in_CW = received[:, :, E].t().reshape(-1)
        token_base_CW = (torch.cumsum(tokens_in_CW, 0) - tokens_in_CW).view(C, W)
        slots_in_CW = received[:, :, :E].sum(-1).t().contiguous()
        send_host, recv_host = torch.stack([counts, received]).tolist()  # the one host sync
        blocks = [[per_chunk[:E] for per_chunk in per_rank] for per_rank in recv_host]
        return TokenPlan([[sum(send_host[w][c][:E]) for w in range(W)] for c in range(C)],
                         [[sum(recv_host[w][c][:E]) for w in range(W)] for c in range(C)], blocks,
                         token_source=route.token_source, slot_position=route.slot_position,
                         token_base_CW=token_base_CW, slots_in_CW=slots_in_CW,
                         tokens_sent=[[send_host[w][c][E] for w in range(W)] for c in range(C)],
                         tokens_received=[[recv_host[w][c][E] for w in range(W)] for c in range(C)])

    def send_buffer(self, plan: TokenPlan, x_TH: torch.Tensor) -> torch.Tensor:
        """[N, H]: where `send` gathers the token rows."""
        return x_TH.new_empty(plan.token_send_off[-1], x_TH.shape[1])

    def receive_buffer(self, plan: TokenPlan, x_TH: torch.Tensor) -> TokenReceive:
        tokens = x_TH.new_empty(plan.token_recv_off[-1], x_TH.shape[1])
        positions = plan.slot_position.new_empty(plan.recv_off[-1])
        return TokenReceive(x_TH.new_empty(plan.recv_off[-1], x_TH.shape[1]), tokens, positions)

    def send(self, plan: TokenPlan, c: int, x_TH, source_rows, send_x, recv: TokenReceive):
        """Chunk c: its token rows (gathered here; `source_rows`, the slots' tokens, are not needed) and each
        slot's token position, to their ranks."""
        first, last = plan.token_send_off[c], plan.token_send_off[c + 1]
        rows = send_x[first:last]
        torch.index_select(x_TH, 0, plan.token_source[first:last], out=rows)
        tokens = dist.all_to_all_single(recv.tokens[plan.token_recv_off[c]:plan.token_recv_off[c + 1]], rows,
                                        plan.tokens_received[c], plan.tokens_sent[c], group=self.group,
                                        async_op=True)
        positions = dist.all_to_all_single(recv.positions[plan.recv_off[c]:plan.recv_off[c + 1]],
                                           plan.slot_position[plan.send_off[c]:plan.send_off[c + 1]],
                                           plan.recv_sizes[c], plan.send_sizes[c], group=self.group, async_op=True)
        return _Both(tokens, positions)

    def received(self, plan: TokenPlan, c: int, recv: TokenReceive) -> torch.Tensor:
        """Chunk c's slot rows, rebuilt from its token rows (after its `send` was waited for)."""
        rows = recv.slots[plan.recv_off[c]:plan.recv_off[c + 1]]
        if not rows.shape[0]:
            return rows
        base_R = plan.token_base_CW[c].repeat_interleave(plan.slots_in_CW[c], output_size=rows.shape[0])
        positions = recv.positions[plan.recv_off[c]:plan.recv_off[c + 1]] + base_R
        return torch.index_select(recv.tokens, 0, positions, out=rows)

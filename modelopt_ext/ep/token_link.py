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

What it saves depends on how many of a token's experts share a rank: with K experts spread uniformly over W
ranks, a token reaches min(K, W)-ish distinct ranks instead of K. At 2 ranks and top-16 the dispatch moves
about 8x fewer bytes; at Kimi-K3's EP64 (top-16 of 896 experts) about 14.3 distinct ranks of 16 slots: 1.1x.
The receiver pays one gather of the R slot rows (HBM to HBM) and an int64 per slot on the link.
"""

from __future__ import annotations

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


class TokenLink(NcclLink):
    """`overlap.overlapped_moe`'s exchange steps with token-level dispatch (see the module doc); the return
    (`return_buffer`, `send_back`) is `NcclLink`'s, one row per slot."""

    def __init__(self, group, num_local_experts: int):
        super().__init__(group)
        self.E = num_local_experts

    def _plan_tokens(self, routing: Routing, W: int) -> torch.Tensor:
        """On the device, no sync: which token rows go where (`token_source`, ordered chunk, destination,
        token), each slot's token position among them (`slot_position`, send order); returns the token rows
        per (chunk, destination), [C, W]."""
        ids_TK, order_S, chunk_T, C = routing.ids_TK, routing.order_S, routing.chunk_T, routing.chunks
        T, device = ids_TK.shape[0], ids_TK.device
        dest_TK = ids_TK // self.E
        # [W, T] (rank-major): torch scans an inner dimension fast, an outer one of width W very slowly
        sent_WT = torch.zeros(W, T, dtype=torch.bool, device=device).scatter_(0, dest_TK.t(), True)
        # pair p = w * T + t; the sent pairs sorted by (chunk, destination), token order kept; unsent ones last
        rank_W1 = torch.arange(W, device=device).unsqueeze(1)
        pair_key = torch.where(sent_WT, chunk_T.unsqueeze(0) * W + rank_W1, C * W).reshape(-1)
        self.token_source = torch.argsort(pair_key, stable=True) % max(T, 1)
        sent = sent_WT.long()
        before_WT = torch.cumsum(sent, 1) - sent
        chunk_first_T = (chunk_T * T + C - 1) // C
        position_WT = before_WT - before_WT.index_select(1, chunk_first_T)
        pair_S = (dest_TK * T + torch.arange(T, device=device).unsqueeze(1)).reshape(-1)
        self.slot_position = position_WT.reshape(-1).index_select(0, pair_S).index_select(0, order_S)
        return count_ids(pair_key, C * W + 1)[:C * W].view(C, W)

    def layout(self, send_WCE: torch.Tensor, routing: Routing):
        """Slot and token counts of every (rank, chunk) exchanged in one all_to_all, read in one host sync."""
        W, C, E = send_WCE.shape
        tokens_CW = self._plan_tokens(routing, W)
        counts = torch.cat([send_WCE, tokens_CW.t().unsqueeze(-1)], dim=2).contiguous()  # [W, C, E + 1]
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        # for `received`, queued before the sync: per (chunk, source) the first of its token rows in the
        # receive buffer and its slot count
        tokens_in_CW = received[:, :, E].t().reshape(-1)
        self.token_base_CW = (torch.cumsum(tokens_in_CW, 0) - tokens_in_CW).view(C, W)
        self.slots_in_CW = received[:, :, :E].sum(-1).t().contiguous()
        send_host, recv_host = torch.stack([counts, received]).tolist()  # the one host sync
        self.tokens_sent = [[send_host[w][c][E] for w in range(W)] for c in range(C)]
        self.tokens_received = [[recv_host[w][c][E] for w in range(W)] for c in range(C)]
        self.token_send_off = list(itertools.accumulate(map(sum, self.tokens_sent), initial=0))
        self.token_recv_off = list(itertools.accumulate(map(sum, self.tokens_received), initial=0))
        blocks = [[per_chunk[:E] for per_chunk in per_rank] for per_rank in recv_host]
        self.layout_ = Layout([[sum(send_host[w][c][:E]) for w in range(W)] for c in range(C)],
                              [[sum(recv_host[w][c][:E]) for w in range(W)] for c in range(C)], blocks)
        return self.layout_

    def send_buffer(self, x_TH: torch.Tensor) -> torch.Tensor:
        return x_TH.new_empty(self.token_send_off[-1], x_TH.shape[1])

    def receive_buffer(self, x_TH: torch.Tensor) -> torch.Tensor:
        self.tokens_in = x_TH.new_empty(self.token_recv_off[-1], x_TH.shape[1])
        self.positions_in = self.slot_position.new_empty(self.layout_.recv_off[-1])
        return x_TH.new_empty(self.layout_.recv_off[-1], x_TH.shape[1])

    def send(self, c: int, x_TH, source_rows, send_x, recv_x):
        """Chunk c: its token rows (gathered here) and each slot's token position, to their ranks."""
        lay, first, last = self.layout_, self.token_send_off[c], self.token_send_off[c + 1]
        rows = send_x[first:last]
        torch.index_select(x_TH, 0, self.token_source[first:last], out=rows)
        tokens = dist.all_to_all_single(self.tokens_in[self.token_recv_off[c]:self.token_recv_off[c + 1]], rows,
                                        self.tokens_received[c], self.tokens_sent[c], group=self.group,
                                        async_op=True)
        positions = dist.all_to_all_single(self.positions_in[lay.recv_off[c]:lay.recv_off[c + 1]],
                                           self.slot_position[lay.send_off[c]:lay.send_off[c + 1]],
                                           lay.recv_sizes[c], lay.send_sizes[c], group=self.group, async_op=True)
        return _Both(tokens, positions)

    def received(self, c: int, recv_x: torch.Tensor) -> torch.Tensor:
        """Chunk c's slot rows, rebuilt from its token rows (after its `send` was waited for)."""
        lay = self.layout_
        rows = super().received(c, recv_x)
        if not rows.shape[0]:
            return rows
        base_R = self.token_base_CW[c].repeat_interleave(self.slots_in_CW[c], output_size=rows.shape[0])
        positions = self.positions_in[lay.recv_off[c]:lay.recv_off[c + 1]] + base_R
        return torch.index_select(self.tokens_in, 0, positions, out=rows)

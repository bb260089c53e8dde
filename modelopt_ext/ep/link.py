"""The links of the expert-parallel exchange (`ep.overlap`): what one call's rows move through.

A link serves one `overlapped_moe` call (a new one per call: it keeps that call's `Layout`): `layout(counts,
routing)` exchanges the counts and returns the call's host sizes (the one host sync), then `send_buffer`,
`receive_buffer` and `return_buffer` give the buffers, and per chunk `send` and `send_back` issue the two
asynchronous steps whose results the compute stream waits for, `received` giving the chunk's rows. Here: the
shared records (`Layout`, `Routing`), the base (`Link`) and NCCL with one row per slot (`NcclLink`, the
default); `ep.token_link` (one row per token and rank) and `ep.copy_engine` (copy engines into peer-mapped
memory) are the others, registered with what they need in `ep.links`, which chooses one from the experts
options.

Shapes: T tokens on this rank, K top-k, S = T*K slots, W ranks, E local experts, C chunks, H row width.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch
import torch.distributed as dist

from .local import Segment, block_segments


@dataclasses.dataclass(frozen=True)
class Layout:
    """One call's host sizes. send_sizes[c][w] / recv_sizes[c][w]: rows sent to / received from rank w in chunk
    c; recv_blocks[w][c][e]: rows received from rank w in chunk c for local expert e, laid out [source][expert]
    (NCCL); or, for a link that lays the received rows out its own way, segments[c] of each chunk."""

    send_sizes: list[list[int]]
    recv_sizes: list[list[int]]
    recv_blocks: list[list[list[int]]] | None
    segments: list[list[Segment]] | None = None

    def chunk_segments(self, c: int) -> list[Segment]:
        """(expert, first row, rows) of chunk c's received rows, rows counted from the chunk's first."""
        if self.segments is not None:
            return self.segments[c]
        return block_segments([per_chunk[c] for per_chunk in self.recv_blocks])

    @functools.cached_property
    def send_off(self) -> list[int]:  # first send row of each chunk, and the total
        return list(itertools.accumulate(map(sum, self.send_sizes), initial=0))

    @functools.cached_property
    def recv_off(self) -> list[int]:
        return list(itertools.accumulate(map(sum, self.recv_sizes), initial=0))


@dataclasses.dataclass(frozen=True)
class Routing:
    """What a link may use beyond the counts: the ids [T, K], the send order of the slots (sorted by chunk, then
    global expert), each token's chunk [T] and the chunk count."""

    ids_TK: torch.Tensor
    order_S: torch.Tensor
    chunk_T: torch.Tensor
    chunks: int


class Link:
    """What the links share once `layout` has set `layout_`: one send buffer of the layout's send rows, and
    chunk c's received rows as a slice of the receive buffer."""

    layout_: Layout

    def send_buffer(self, x_TH: torch.Tensor) -> torch.Tensor:
        return x_TH.new_empty(self.layout_.send_off[-1], x_TH.shape[1])

    def received(self, c: int, recv_x: torch.Tensor) -> torch.Tensor:
        return recv_x[self.layout_.recv_off[c]:self.layout_.recv_off[c + 1]]


class NcclLink(Link):
    """The exchange steps through `all_to_all_single` (asynchronous, on the process group's stream)."""

    def __init__(self, group):
        self.group = group

    def layout(self, send_WCE: torch.Tensor, routing=None) -> Layout:
        recv_WCE = torch.empty_like(send_WCE)
        dist.all_to_all_single(recv_WCE, send_WCE, group=self.group)
        send_host, recv_host = torch.stack([send_WCE, recv_WCE]).tolist()  # the one host sync
        C = send_WCE.shape[1]
        self.layout_ = Layout([[sum(send_host[w][c]) for w in range(len(send_host))] for c in range(C)],
                              [[sum(recv_host[w][c]) for w in range(len(recv_host))] for c in range(C)], recv_host)
        return self.layout_

    def receive_buffer(self, x_TH: torch.Tensor) -> torch.Tensor:
        return x_TH.new_empty(self.layout_.recv_off[-1], x_TH.shape[1])

    def return_buffer(self, y: torch.Tensor) -> torch.Tensor:
        return y.new_empty(self.layout_.send_off[-1], y.shape[1])

    def send(self, c: int, x_TH, source_rows, send_x, recv_x):
        lay = self.layout_
        sent = send_x[lay.send_off[c]:lay.send_off[c + 1]]
        torch.index_select(x_TH, 0, source_rows, out=sent)
        return dist.all_to_all_single(recv_x[lay.recv_off[c]:lay.recv_off[c + 1]], sent, lay.recv_sizes[c],
                                      lay.send_sizes[c], group=self.group, async_op=True)

    def send_back(self, c: int, y, back):
        lay = self.layout_
        return dist.all_to_all_single(back[lay.send_off[c]:lay.send_off[c + 1]], y, lay.send_sizes[c],
                                      lay.recv_sizes[c], group=self.group, async_op=True)

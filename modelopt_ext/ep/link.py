"""The links of the expert-parallel exchange (`ep.overlap`): the protocol they share, its records, and NCCL.

A link moves the rows of `overlapped_moe` calls between the ranks of a process group. The link object holds
only what outlives a call: its process group and, for the copy engines, the device, the peer-mapped buffer and
the side stream. Everything that belongs to one call lives in that call's plan, a frozen record that the
first step returns and every later step takes as its first argument; a tensor that one step allocates and a
later step uses is returned by the first and passed to the second. The steps, in this order (`Link`):

  1. `plan(send_WCE, routing, x_TH)`: collective. Exchanges the counts, reads the call's sizes back to the
     host (the call's one host sync) and returns the plan: a `Layout` (host sizes: rows per chunk and rank,
     their offsets, the segments the experts run on) or a subclass of it with the link's own per-call values.
  2. `send_buffer(plan, x_TH)`, then `receive_buffer(plan, x_TH)`: where the send rows are gathered and where
     the received rows land. The receive buffer is a tensor or a link's own frozen record of tensors; the
     caller only passes it on.
  3. For every chunk c in order: `send(plan, c, x_TH, source_rows, send_x, recv)`, collective: gathers chunk
     c's send rows (x_TH's rows `source_rows`) and issues their exchange; returns a handle whose `wait()`
     makes the compute stream wait for the rows to arrive.
  4. For every chunk c in order, once its handle was waited for: `received(plan, c, recv)`, chunk c's
     received rows [R_c, H], laid out as `plan.chunk_segments(c)` says; the experts run on them. After the
     first chunk's experts, once: `return_buffer(plan, y)`, where the outputs come back (send layout). Then
     `send_back(plan, c, y, back)`, collective: chunk c's outputs to their tokens' ranks, a handle to wait on.
Every rank of the group takes the collective steps in the same order with the same chunk count.

Since a link keeps nothing of a call, one link object may serve any number of calls, also interleaved ones,
where its registry entry (`ep.links.LinkSpec.concurrent_calls`) allows it. Here: the records (`Layout`,
`Routing`), the protocol (`Link`) and NCCL with one row per slot (`NcclLink`, the default); `ep.token_link`
(one row per token and rank) and `ep.copy_engine` (copy engines into peer-mapped memory) are the other links,
registered with their capabilities in `ep.links`, which chooses one from the experts options.

Shapes: T tokens on this rank, K top-k, S = T*K slots, W ranks, E local experts, C chunks, H row width.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import itertools

import torch
import torch.distributed as dist

from .local import Segment, block_segments


@dataclasses.dataclass(frozen=True)
class Layout:
    """One call's host sizes, the plan of `NcclLink` and the base of the other links' plans.

    send_sizes[c][w] / recv_sizes[c][w]: rows sent to / received from rank w in chunk c; recv_blocks[w][c][e]:
    rows received from rank w in chunk c for local expert e, laid out [source][expert] (NCCL); or, for a link
    that lays the received rows out its own way, segments[c] of each chunk."""

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


class Link(abc.ABC):
    """The protocol of a link (the steps and their order: the module doc). Each step takes the call's plan;
    the object itself is not changed by a call.

    The shared steps: the send rows in one buffer of the plan's send rows (`send_buffer`), and chunk c's
    received rows as a slice of a receive buffer tensor (`received`); a link may replace either."""

    @abc.abstractmethod
    def plan(self, send_WCE: torch.Tensor, routing: Routing, x_TH: torch.Tensor) -> Layout:
        """Collective: the call's plan from this rank's counts send_WCE [W, C, E] (rows for rank w's local
        expert e in chunk c), the routing and the tokens x_TH (for their device, dtype and width)."""

    def send_buffer(self, plan: Layout, x_TH: torch.Tensor) -> torch.Tensor:
        """[plan.send_off[-1], H]: where `send` gathers the send rows."""
        return x_TH.new_empty(plan.send_off[-1], x_TH.shape[1])

    @abc.abstractmethod
    def receive_buffer(self, plan: Layout, x_TH: torch.Tensor):
        """Where the received rows land: a tensor, or the link's own record, passed on to `send` and `received`."""

    @abc.abstractmethod
    def send(self, plan: Layout, c: int, x_TH: torch.Tensor, source_rows: torch.Tensor, send_x: torch.Tensor, recv):
        """Collective: gather chunk c's send rows and issue their exchange; a handle with `wait()`."""

    def received(self, plan: Layout, c: int, recv_x: torch.Tensor) -> torch.Tensor:
        """[plan.recv_sizes[c] summed, H]: chunk c's received rows (after its `send` was waited for)."""
        return recv_x[plan.recv_off[c]:plan.recv_off[c + 1]]

    @abc.abstractmethod
    def return_buffer(self, plan: Layout, y: torch.Tensor) -> torch.Tensor:
        """[plan.send_off[-1], H_out]: where the expert outputs y come back, in send layout."""

    @abc.abstractmethod
    def send_back(self, plan: Layout, c: int, y: torch.Tensor, back: torch.Tensor):
        """Collective: chunk c's expert outputs y (receive layout) into `back` on their tokens' ranks; a handle."""


class NcclLink(Link):
    """The exchange steps through `all_to_all_single` (asynchronous, on the process group's stream); its plan
    is a plain `Layout`."""

    def __init__(self, group):
        self.group = group

    def plan(self, send_WCE: torch.Tensor, routing: Routing | None, x_TH: torch.Tensor | None) -> Layout:
        """One all_to_all of the counts, then the host sync; routing and tokens are not needed."""
        recv_WCE = torch.empty_like(send_WCE)
        dist.all_to_all_single(recv_WCE, send_WCE, group=self.group)
        send_host, recv_host = torch.stack([send_WCE, recv_WCE]).tolist()  # the one host sync
        C = send_WCE.shape[1]
        return Layout([[sum(send_host[w][c]) for w in range(len(send_host))] for c in range(C)],
                      [[sum(recv_host[w][c]) for w in range(len(recv_host))] for c in range(C)], recv_host)

    def receive_buffer(self, plan: Layout, x_TH: torch.Tensor) -> torch.Tensor:
        return x_TH.new_empty(plan.recv_off[-1], x_TH.shape[1])

    def return_buffer(self, plan: Layout, y: torch.Tensor) -> torch.Tensor:
        return y.new_empty(plan.send_off[-1], y.shape[1])

    def send(self, plan: Layout, c: int, x_TH, source_rows, send_x, recv_x):
        sent = send_x[plan.send_off[c]:plan.send_off[c + 1]]
        torch.index_select(x_TH, 0, source_rows, out=sent)
        return dist.all_to_all_single(recv_x[plan.recv_off[c]:plan.recv_off[c + 1]], sent, plan.recv_sizes[c],
                                      plan.send_sizes[c], group=self.group, async_op=True)

    def send_back(self, plan: Layout, c: int, y, back):
        return dist.all_to_all_single(back[plan.send_off[c]:plan.send_off[c + 1]], y, plan.send_sizes[c],
                                      plan.recv_sizes[c], group=self.group, async_op=True)

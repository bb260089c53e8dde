"""The EP exchange of `ep.overlap` through the GPUs' copy engines into peer-mapped memory (one host, CUDA).

NCCL's all_to_all runs as kernels on the SMs. Overlapped with the experts' GEMMs, which are sized to fill every
SM, the two contend, so chunking the layer hid little of the exchange (docs/performance.md). Here rows move
with `cudaMemcpyAsync` between peer-mapped buffers (PyTorch's symmetric memory, CUDA backend): the copy engines
do the transfer over NVLink and the SMs stay with the GEMMs. Only one-block barrier kernels run on SMs.

Per rank, one symmetric buffer holds two regions: received rows, laid out expert-major ([chunk][local
expert][source]: each expert's rows of a chunk are one segment, so the experts run on them in place without
the regrouping gathers NCCL's [source][expert] blocks need) and returned expert outputs (this rank's send
layout [chunk][destination][local expert]). Each (peer, expert) block is one copy. `CopyEngineLink` takes the
steps of `link.Link` in the same order; the link object holds the process group, the device, the buffer and
the side stream (shared by every link of the same group and device), and each call's plan is a `CopyPlan`: a
`link.Layout` whose segments are the expert-major ones, plus this rank's copies (`PeerPlan`, from `peer_plan`)
and the tokens' dtype and width. A call, on one side stream (`_streams`):
  1. a barrier: every rank has finished with its buffers from the previous call (each rank's side stream
     first waits for its compute stream);
  2. per chunk, once its send rows are gathered (rows for this rank itself are gathered straight into its own
     receive region): a copy into each peer's receive region, then a barrier, so every chunk-c row for this
     rank has arrived when it completes;
  3. per chunk, once its experts ran: each source's block of outputs copied into that source's return region
     (this rank's own blocks are gathered into its return region on the compute stream: the copy engines move
     rows within one GPU far slower than a gather kernel, measured), then a barrier.
The compute stream waits for these with events; the host never waits. Offsets on peers come from one
all_gather of every rank's per-chunk counts, read back with the call's one host sync (the same sync NCCL's
split sizes need). The buffer grows, with a device synchronize and a collective rendezvous, when a call needs
more than it holds; every rank computes the same size from the same counts, so all grow together. Barriers
time out after `BARRIER_TIMEOUT_MS` (the kernel traps: the CUDA error fails the rank instead of a hang).
Since every call of a group and device uses the same buffer, from the same first row, calls through the copy
engines must not interleave (`ep.links` declares this: `concurrent_calls=False`); consecutive calls are
ordered by the barrier of step 1.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.distributed as dist

from .link import Layout, Link
from .local import block_rows

logger = logging.getLogger(__name__)

BARRIER_TIMEOUT_MS = 300_000
HEADROOM = 1.25  # a grown buffer holds this much more than the call that grew it needed
_GRANULE = 64 << 20  # bytes; buffer sizes are rounded up to this


Copy = tuple[int, int, int, int]  # (rank, first source row, first destination row, rows)


@dataclasses.dataclass(frozen=True)
class PeerPlan:
    """One rank's copies for one call, from every rank's rows per (source, destination, chunk, local expert).

    Receive layout (each rank, chunk by chunk): per local expert, per source rank, so each expert's rows are
    one contiguous segment and the experts run on them in place (`segments`), without a regrouping gather.
    Send and return layout (each rank, chunk by chunk): per destination rank, per local expert (`ep.overlap`).

    sends[c]: (peer, first row in this rank's send layout, first row in the peer's receive region, rows), one
        per (peer, expert) block, this rank included (its own rows are gathered straight into place).
    returns[c]: (source rank, first row of the block in this rank's chunk-c outputs, first row in the source's
        return region, rows), one per (source, expert) block, this rank included.
    segments[c]: (expert, first row in the chunk, rows) of this rank's chunk-c receive rows.
    recv_sizes[c][s], send_sizes[c][d]: rows received from s / sent to d in chunk c.
    back_base[p]: rows in p's receive region (its return region starts after them).
    capacity_rows: the largest receive + return row count over all ranks (what every buffer must hold).
    """

    sends: list[list[Copy]]
    returns: list[list[Copy]]
    segments: list[list[tuple[int, int, int]]]
    recv_sizes: list[list[int]]
    send_sizes: list[list[int]]
    back_base: list[int]
    capacity_rows: int


def _layout(blocks) -> tuple[dict, int]:
    """(first row of each block, total rows) for (key, rows) blocks laid out back to back in the given order."""
    starts, row = {}, 0
    for key, rows in blocks:
        starts[key] = row
        row += rows
    return starts, row


def peer_plan(rows_SDCE: list[list[list[list[int]]]], rank: int) -> PeerPlan:
    """The plan for `rank` from rows_SDCE[s][d][c][e]: the rows rank s sends rank d in chunk c for d's local
    expert e (host ints, the same on every rank)."""
    W = len(rows_SDCE)
    C = len(rows_SDCE[0][0]) if W else 0
    E = len(rows_SDCE[0][0][0]) if C else 0
    N = rows_SDCE
    recv_at, send_at, recv_total, send_total = [], [], [], []
    for p in range(W):  # where each block starts in rank p's receive and send layouts
        starts, total = _layout(((c, e, s), N[s][p][c][e]) for c in range(C) for e in range(E) for s in range(W))
        recv_at.append(starts)
        recv_total.append(total)
        starts, total = _layout(((c, d, e), N[p][d][c][e]) for c in range(C) for d in range(W) for e in range(E))
        send_at.append(starts)
        send_total.append(total)
    me = rank
    chunk_start = [recv_at[me][c, 0, 0] if E else 0 for c in range(C)]
    sends = [[(d, send_at[me][c, d, e], recv_at[d][c, e, me], N[me][d][c][e])
              for d in range(W) for e in range(E) if N[me][d][c][e]] for c in range(C)]
    returns = [[(s, recv_at[me][c, e, s] - chunk_start[c], recv_total[s] + send_at[s][c, me, e], N[s][me][c][e])
                for e in range(E) for s in range(W) if N[s][me][c][e]] for c in range(C)]
    segments = [[(e, recv_at[me][c, e, 0] - chunk_start[c], sum(N[s][me][c][e] for s in range(W)))
                 for e in range(E)] for c in range(C)]
    recv_sizes = [[sum(N[s][me][c]) for s in range(W)] for c in range(C)]
    send_sizes = [[sum(N[me][d][c]) for d in range(W)] for c in range(C)]
    capacity = max((recv_total[p] + send_total[p] for p in range(W)), default=0)
    return PeerPlan(sends, returns, segments, recv_sizes, send_sizes, recv_total, capacity)


class _Buffer:
    """One rank's symmetric buffer for a process group and device, grown collectively."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        self.nbytes = 0
        self.tensor = self.handle = None
        self._views: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def ensure(self, nbytes: int) -> None:
        if nbytes <= self.nbytes:
            return
        import torch.distributed._symmetric_memory as symm_mem

        size = math.ceil(nbytes * HEADROOM / _GRANULE) * _GRANULE
        if self.handle is not None:
            # Kernels and copies of earlier calls may still use the old buffer, here and (through it) on peers.
            torch.cuda.synchronize(self.device)
            self.tensor = self.handle = None
            self._views.clear()
        self.tensor = symm_mem.empty(size, dtype=torch.uint8, device=self.device)
        self.handle = symm_mem.rendezvous(self.tensor, self.group.group_name)
        self.nbytes = size
        if dist.get_rank(self.group) == 0:
            logger.info("copy-engine exchange: %.2f GiB of peer-mapped memory per rank", size / 2**30)

    def rows(self, rank: int, first_row: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, width] view of `rank`'s buffer starting at row `first_row` (rows of `width` x dtype). One
        whole-buffer view per (rank, width, dtype) is kept and sliced: `get_buffer` per block cost host time
        that left small layers waiting for the host."""
        key = (rank, width, dtype)
        whole = self._views.get(key)
        if whole is None:
            whole = self._views[key] = self.handle.get_buffer(
                rank, (self.nbytes // (width * dtype.itemsize), width), dtype)
        return whole[first_row:first_row + rows]


_buffers: dict[tuple[str, int], _Buffer] = {}
_streams: dict[int, torch.cuda.Stream] = {}


def peer_mapped_bytes(device_index: int) -> int:
    """Bytes of this process's copy-engine buffers on a device (0 when the exchange never ran there)."""
    return sum(buf.nbytes for (_, index), buf in _buffers.items() if index == device_index)


def _buffer(group, device: torch.device) -> _Buffer:
    key = (group.group_name, device.index)
    if key not in _buffers:
        _buffers[key] = _Buffer(group, device)
    return _buffers[key]


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """Peer copies and barriers; high priority, so the one-block barrier kernels start between GEMM blocks."""
    if device.index not in _streams:
        _streams[device.index] = torch.cuda.Stream(device, priority=-1)
    return _streams[device.index]


class _Arrived:
    """An exchange step the compute stream can wait for (like a c10d Work, without a host wait)."""

    def __init__(self, *events: torch.cuda.Event):
        self.events = events

    def wait(self) -> None:
        stream = torch.cuda.current_stream()
        for event in self.events:
            stream.wait_event(event)


def _recorded(stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


@dataclasses.dataclass(frozen=True, kw_only=True)
class CopyPlan(Layout):
    """One call's plan through `CopyEngineLink`: the `Layout` (sizes and the expert-major segments), this rank's
    copies (`PeerPlan`) and the rows' dtype and width (the tokens'; the expert outputs must match them)."""

    peer: PeerPlan
    dtype: torch.dtype
    width: int


class CopyEngineLink(Link):
    """The exchange steps `ep.overlap.overlapped_moe` takes, through copy engines (see the module doc)."""

    def __init__(self, group, device: torch.device):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the copy-engine exchange needs CUDA tensors; the tokens are on {device} "
                             "(use the 'nccl' transport)")
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = device
        self.buffer = _buffer(group, self.device)
        self.peer_stream = _side_stream(self.device)

    def plan(self, send_WCE: torch.Tensor, routing, x_TH: torch.Tensor) -> CopyPlan:
        """Every rank's counts (one all_gather, one host read) -> this call's `CopyPlan`; grows the buffer when
        needed and opens the call with a barrier."""
        if x_TH.device != self.device:
            raise ValueError(f"this copy-engine link moves rows on {self.device}; the tokens are on {x_TH.device}")
        W, C, E = send_WCE.shape
        dtype, width = x_TH.dtype, x_TH.shape[1]
        every = torch.empty(W, W, C, E, dtype=send_WCE.dtype, device=send_WCE.device)
        dist.all_gather_into_tensor(every, send_WCE.contiguous(), group=self.group)
        peer = peer_plan(every.tolist(), self.rank)  # the host sync
        self.buffer.ensure(peer.capacity_rows * width * dtype.itemsize)
        self.peer_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.peer_stream):
            self.buffer.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        return CopyPlan(peer.send_sizes, peer.recv_sizes, None, peer.segments, peer=peer, dtype=dtype, width=width)

    def receive_buffer(self, plan: CopyPlan, x_TH: torch.Tensor) -> torch.Tensor:
        return self.buffer.rows(self.rank, 0, plan.recv_off[-1], plan.width, plan.dtype)

    def return_buffer(self, plan: CopyPlan, y: torch.Tensor) -> torch.Tensor:
        if y.dtype != plan.dtype or y.shape[1] != plan.width:
            raise ValueError(f"the copy-engine exchange returns rows like the tokens ({plan.dtype}, width "
                             f"{plan.width}); the experts gave {y.dtype}, width {y.shape[1]}")
        return self.buffer.rows(self.rank, plan.peer.back_base[self.rank], plan.send_off[-1], plan.width,
                                plan.dtype)

    def send(self, plan: CopyPlan, c: int, x_TH: torch.Tensor, source_rows: torch.Tensor, send_x: torch.Tensor,
             recv_x: torch.Tensor) -> _Arrived:
        """Gather chunk c's send rows (this rank's own straight into place in its receive region), copy each
        (peer, expert) block into the peer's receive region, barrier."""
        me, first = self.rank, plan.send_off[c]
        for d, src, dst, n in plan.peer.sends[c]:
            rows = source_rows[src - first:src - first + n]
            torch.index_select(x_TH, 0, rows, out=recv_x[dst:dst + n] if d == me else send_x[src:src + n])
        return self._copy_to_peers(plan, plan.peer.sends[c], send_x)

    def send_back(self, plan: CopyPlan, c: int, y: torch.Tensor, back: torch.Tensor) -> _Arrived:
        """Chunk c's expert outputs (receive layout) to their sources' return regions: this rank's own blocks
        with one gather into its return region (compute stream), the others by the copy engines."""
        me, base = self.rank, plan.peer.back_base[self.rank]
        own = [(src, dst, n) for s, src, dst, n in plan.peer.returns[c] if s == me]
        if own:  # the own blocks' destinations follow each other (send layout: destination, then expert)
            first = own[0][1] - base
            rows = block_rows([src for src, _, _ in own], [n for _, _, n in own], y.device)
            torch.index_select(y, 0, rows, out=back[first:first + rows.shape[0]])
        return self._copy_to_peers(plan, plan.peer.returns[c], y)

    def _copy_to_peers(self, plan: CopyPlan, copies: list[Copy], source: torch.Tensor) -> _Arrived:
        """On the side stream, once the compute stream has written `source`: its rows copied into the peers'
        buffers (the copies to other ranks, rank + 1 first, so that at W > 2 the ranks start on different
        peers), then a barrier, so the rows every rank sent here have arrived when it completes."""
        ready = _recorded(torch.cuda.current_stream())
        source.record_stream(self.peer_stream)
        peers = sorted((copy for copy in copies if copy[0] != self.rank), key=lambda copy: (copy[0] - self.rank) %
                       self.world)
        with torch.cuda.stream(self.peer_stream):
            self.peer_stream.wait_event(ready)
            for peer, src, dst, n in peers:
                self.buffer.rows(peer, dst, n, plan.width, plan.dtype).copy_(source[src:src + n])
            self.buffer.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
            return _Arrived(_recorded(self.peer_stream))

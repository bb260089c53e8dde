"""ep.copy_engine: the peer offsets move every row where NCCL's all_to_all_single would (simulated ranks in one
process); the plan a call gets. The copies need CUDA: on one GPU (one rank, NCCL) here, skipped without one; across
GPUs, scripts/gpu_check_sync.py."""

import dataclasses
import random

import pytest
import torch

from modelopt_ext.ep.copy_engine import CopyEngineLink, CopyPlan, peer_plan
from modelopt_ext.ep.link import Layout
from modelopt_ext.ep.overlap import overlapped_moe

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy-engine link moves CUDA tensors "
                                "between peer-mapped buffers; this machine has no CUDA device")


def _simulate(counts, W, C, E):
    """Move labelled rows with every rank's plan; return what each rank received, its segments and what came
    back, with the expectations."""
    plans = [peer_plan(counts, r) for r in range(W)]
    cap = plans[0].capacity_rows
    assert all(p.capacity_rows == cap for p in plans)
    buffers = [[None] * cap for _ in range(W)]
    # send layout of rank s: chunk, destination, expert; a row's label says where it came from
    send = [[(s, c, d, e, i) for c in range(C) for d in range(W) for e in range(E) for i in range(counts[s][d][c][e])]
            for s in range(W)]
    for s in range(W):
        for c in range(C):
            for d, src, dst, n in plans[s].sends[c]:
                buffers[d][dst:dst + n] = send[s][src:src + n]
    received = [buffers[p][:plans[0].back_base[p]] for p in range(W)]
    # expert-major within each chunk: expert, then source rank
    expected = [[(s, c, p, e, i) for c in range(C) for e in range(E) for s in range(W) for i in range(counts[s][p][c][e])]
                for p in range(W)]
    segments_ok = True
    for p in range(W):
        first = 0
        for c in range(C):
            rows = received[p][first:first + sum(plans[p].recv_sizes[c])]
            for e, start, n in plans[p].segments[c]:  # each segment: all of expert e's rows of the chunk
                segments_ok &= all(label[3] == e for label in rows[start:start + n])
                segments_ok &= n == sum(label[3] == e for label in rows)
            # returns: the chunk's outputs, in receive layout, to each source's return region
            for s, src, dst, n in plans[p].returns[c]:
                buffers[s][dst:dst + n] = [("out",) + label for label in rows[src:src + n]]
            first += len(rows)
    back = [buffers[s][plans[0].back_base[s]:plans[0].back_base[s] + len(send[s])] for s in range(W)]
    return received, expected, back, [[("out",) + label for label in send[s]] for s in range(W)], plans, segments_ok


@pytest.mark.parametrize("W,C,E,seed", [(2, 1, 3, 0), (2, 2, 14, 1), (3, 3, 2, 2), (4, 2, 5, 3), (5, 1, 1, 4)])
def test_plan_delivers_rows_expert_major_and_back(W, C, E, seed):
    rng = random.Random(seed)
    counts = [[[[rng.choice([0, 0, 1, 2, 7]) for _ in range(E)] for _ in range(C)] for _ in range(W)] for _ in range(W)]
    received, expected, back, want_back, plans, segments_ok = _simulate(counts, W, C, E)
    assert received == expected
    assert segments_ok
    assert back == want_back
    need = max(sum(sum(map(sum, counts[s][p])) for s in range(W)) + sum(sum(map(sum, counts[p][d])) for d in range(W))
               for p in range(W))
    assert plans[0].capacity_rows == need


def test_plan_with_nothing_to_send():
    plan = peer_plan([[[[0, 0]], [[0, 0]]], [[[0, 0]], [[0, 0]]]], 1)
    assert plan.capacity_rows == 0 and plan.sends == [[]] and plan.returns == [[]]
    assert plan.segments == [[(0, 0, 0), (1, 0, 0)]]


def test_plan_by_hand():
    # 2 ranks, 1 chunk, 2 experts a rank. rows[s][d][0][e]: rank 0 sends itself 2 + 1 rows and rank 1 0 + 2;
    # rank 1 sends rank 0 3 + 1 rows and itself 1 + 0.
    rows = [[[[2, 1]], [[0, 2]]], [[[3, 1]], [[1, 0]]]]
    p0, p1 = peer_plan(rows, 0), peer_plan(rows, 1)
    # rank 0 receives expert 0: 2 (own) + 3 (rank 1), expert 1: 1 (own) + 1 (rank 1)
    assert p0.segments == [[(0, 0, 5), (1, 5, 2)]]
    # rank 1's rows for rank 0's expert 0 land after rank 0's own 2; for expert 1 after rank 0's own 1 (row 6)
    assert p1.sends == [[(0, 0, 2, 3), (0, 3, 6, 1), (1, 4, 0, 1)]]
    # rank 0's own rows: expert 0 at 0, expert 1 at 5; to rank 1 (expert 1 only): after rank 0's 0 rows and 1 own
    assert p0.sends == [[(0, 0, 0, 2), (0, 2, 5, 1), (1, 3, 1, 2)]]
    assert p0.back_base == [7, 3]
    # rank 0's outputs for rank 1's rows go to rank 1's return region (base 3) at rank 1's send rows 0 and 3
    assert p0.returns == [[(0, 0, 7, 2), (1, 2, 3, 3), (0, 5, 9, 1), (1, 6, 6, 1)]]
    assert p0.capacity_rows == 12


def test_needs_cuda_tokens():
    with pytest.raises(ValueError, match="needs CUDA tensors.*cpu"):
        CopyEngineLink(None, torch.device("cpu"))


def test_the_call_plan_is_a_frozen_layout_with_the_peer_copies():
    rows = [[[[2, 1]], [[0, 2]]], [[[3, 1]], [[1, 0]]]]  # test_plan_by_hand's
    peer = peer_plan(rows, 0)
    plan = CopyPlan(peer.send_sizes, peer.recv_sizes, None, peer.segments, peer=peer, dtype=torch.bfloat16, width=8)
    assert isinstance(plan, Layout) and plan.chunk_segments(0) == [(0, 0, 5), (1, 5, 2)]
    assert plan.send_off == [0, 5] and plan.recv_off == [0, 7]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.width = 16


@pytest.fixture
def one_gpu_group():
    """A one-rank NCCL group on GPU 0 (torn down afterwards)."""
    import torch.distributed as dist

    from modelopt_ext.testing.multiproc import free_port

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@needs_cuda
def test_one_copy_engine_link_serves_calls_on_one_gpu_and_keeps_nothing(one_gpu_group, monkeypatch):
    """Calls of several chunk counts and two dtypes through one copy-engine link object: each gives the NCCL
    links' result bit for bit (the same combine kernel; elementwise experts, so the row order does not matter)
    and dispatch/combine's up to the kernel's rounding; the link's attributes stay as they were."""
    from modelopt_ext.ep import links, overlap
    from modelopt_ext.ep.dispatch import combine, dispatch

    E, K, T = 3, 2, 37
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)]).cuda()  # expert 2 unused
    w = torch.rand(T, K, generator=g).cuda()
    scale = torch.arange(1, E + 1, dtype=torch.float32).cuda()
    x32 = torch.randn(T, 16, generator=g).cuda()
    link = links.build(links.LINKS["copy_engine"], one_gpu_group, x32)
    before = dict(vars(link))
    make_link = overlap._link
    monkeypatch.setattr(overlap, "_link", lambda transport, *args: link if transport == "copy_engine" else
                        make_link(transport, *args))

    def run_rows(rows, segments):
        out = torch.empty_like(rows)
        for e, start, n in segments:
            out[start:start + n] = rows[start:start + n] * scale[e].to(rows.dtype)
        return out

    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            x = x32.to(dtype)
            rx, rids, meta = dispatch(x, ids, E, one_gpu_group)
            want = combine(rx * scale[rids].unsqueeze(-1).to(dtype), w, meta, one_gpu_group)
            for chunks in (1, 2, 5):
                got = overlapped_moe(x, ids, w, E, one_gpu_group, run_rows, chunks=chunks, transport="copy_engine")
                for token_dispatch in (False, True):
                    nccl = overlapped_moe(x, ids, w, E, one_gpu_group, run_rows, chunks=chunks, transport="nccl",
                                          token_dispatch=token_dispatch)
                    assert torch.equal(got, nccl), (dtype, chunks, token_dispatch)
                torch.testing.assert_close(got, want)
        send_WCE, routing = overlap.chunk_routing(ids, 1, E, 2)
        plan = link.plan(send_WCE, routing, x32)
        assert isinstance(plan, CopyPlan) and plan.dtype == torch.float32 and plan.width == 16
        with pytest.raises(ValueError, match="returns rows like the tokens"):
            link.return_buffer(plan, x32[:, :8])
        torch.cuda.synchronize()
    assert vars(link).keys() == before.keys() and all(vars(link)[k] is v for k, v in before.items())


def test_unknown_transport_is_named():
    with torch.no_grad(), pytest.raises(ValueError, match="'carrier pigeon'"):
        overlapped_moe(torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), 1, None,
                       lambda r, s: r, transport="carrier pigeon")


def test_auto_takes_copy_engines_only_for_cuda_tokens_on_one_host(monkeypatch):
    from modelopt_ext.ep.links import resolve_transport

    cpu = torch.zeros(1, 4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_transport("auto", cpu) == "nccl"  # CPU tokens (gloo): never the copy engines
    assert resolve_transport("copy_engine", cpu) == "copy_engine"  # asked for by name: the link refuses CPUs
    cuda_like = torch.empty(1, 4, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert resolve_transport("auto", cuda_like) == "copy_engine"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # ranks on two hosts: peer mapping cannot reach them
    assert resolve_transport("auto", cuda_like) == "nccl"
    monkeypatch.delenv("WORLD_SIZE")
    assert resolve_transport("auto", cuda_like) == "nccl"


def test_peer_mapped_bytes_counts_this_devices_buffers(monkeypatch):
    from modelopt_ext.ep import copy_engine

    class Grown:
        nbytes = 3 << 20

    monkeypatch.setattr(copy_engine, "_buffers", {("group0", 0): Grown(), ("group1", 0): Grown(), ("group0", 1): Grown()})
    assert copy_engine.peer_mapped_bytes(0) == 6 << 20
    assert copy_engine.peer_mapped_bytes(1) == 3 << 20
    assert copy_engine.peer_mapped_bytes(2) == 0

"""ep.copy_engine: the peer offsets move every row where NCCL's all_to_all_single would (simulated ranks in one
process; the copies themselves need CUDA peers and are checked by scripts/gpu_check_sync.py)."""

import random

import pytest
import torch

from modelopt_ext.ep.copy_engine import CopyEngineLink, peer_plan
from modelopt_ext.ep.overlap import overlapped_moe


def _simulate(counts, W, C, E):
    """Move labelled rows with the plans; return what each rank received and got back, and the expectation."""
    rows = [[[sum(counts[s][d][c]) for c in range(C)] for d in range(W)] for s in range(W)]
    plans = [peer_plan(rows, r) for r in range(W)]
    cap = plans[0].capacity_rows
    assert all(p.capacity_rows == cap for p in plans)
    buffers = [[None] * cap for _ in range(W)]
    # send layout of rank s: chunk, destination, expert; a row's label says where it came from
    send = [[(s, c, d, e, i) for c in range(C) for d in range(W) for e in range(E) for i in range(counts[s][d][c][e])]
            for s in range(W)]
    for s in range(W):
        row = 0
        for c in range(C):
            for d in range(W):
                n = rows[s][d][c]
                at = plans[s].into_recv[c][d]
                buffers[d][at:at + n] = send[s][row:row + n]
                row += n
    received = [buffers[p][:plans[0].back_base[p]] for p in range(W)]
    expected = [[(s, c, p, e, i) for c in range(C) for s in range(W) for e in range(E) for i in range(counts[s][p][c][e])]
                for p in range(W)]
    # returns: rank p's outputs for chunk c, in its receive layout, go back to each source's return region
    for p in range(W):
        row = 0
        for c in range(C):
            for s in range(W):
                n = rows[s][p][c]
                at = plans[p].back_base[s] + plans[p].into_back[c][s]
                buffers[s][at:at + n] = [("out",) + label for label in received[p][row:row + n]]
                row += n
    back = [buffers[s][plans[0].back_base[s]:plans[0].back_base[s] + len(send[s])] for s in range(W)]
    return received, expected, back, [[("out",) + label for label in send[s]] for s in range(W)], plans


@pytest.mark.parametrize("W,C,E,seed", [(2, 1, 3, 0), (2, 2, 14, 1), (3, 3, 2, 2), (4, 2, 5, 3), (5, 1, 1, 4)])
def test_plan_delivers_rows_like_all_to_all(W, C, E, seed):
    rng = random.Random(seed)
    counts = [[[[rng.choice([0, 0, 1, 2, 7]) for _ in range(E)] for _ in range(C)] for _ in range(W)] for _ in range(W)]
    received, expected, back, want_back, plans = _simulate(counts, W, C, E)
    assert received == expected
    assert back == want_back
    need = max(sum(sum(map(sum, counts[s][p])) for s in range(W)) + sum(sum(map(sum, counts[p][d])) for d in range(W))
               for p in range(W))
    assert plans[0].capacity_rows == need


def test_plan_with_nothing_to_send():
    plan = peer_plan([[[0, 0], [0, 0]], [[0, 0], [0, 0]]], 1)
    assert plan.capacity_rows == 0 and plan.into_recv == [[0, 0], [0, 0]]


def test_plan_by_hand():
    # 2 ranks, 1 chunk: rank 0 sends 3 rows to itself and 2 to rank 1; rank 1 sends 4 to rank 0 and 1 to itself
    rows = [[[3], [2]], [[4], [1]]]
    p0, p1 = peer_plan(rows, 0), peer_plan(rows, 1)
    assert p1.into_recv == [[3, 2]]  # rank 1's rows land after rank 0's 3 own rows on rank 0; on rank 1 after 2
    assert p0.into_recv == [[0, 0]]
    assert p0.back_base == [7, 3]  # rank 0 receives 3 + 4 rows, rank 1 receives 2 + 1
    assert p1.into_back == [[3, 4]]  # rank 0 sent rank 1 its rows after its own 3; rank 1 sent its own after 4
    assert p0.capacity_rows == 12


def test_needs_cuda_tokens():
    with pytest.raises(ValueError, match="needs CUDA tensors.*cpu"):
        CopyEngineLink(None, torch.zeros(2, 4))


def test_unknown_transport_is_named():
    with torch.no_grad(), pytest.raises(ValueError, match="'carrier pigeon'"):
        overlapped_moe(torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), 1, None,
                       lambda r, s: r, transport="carrier pigeon")


def test_auto_takes_copy_engines_only_for_cuda_tokens_on_one_host(monkeypatch):
    from modelopt_ext.ep.overlap import resolve_transport

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

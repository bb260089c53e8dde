"""ep.token_link: the token routing (`route_tokens`) on hand-made and random routing, the token rows counted per
chunk and destination rank, `TokenLink`'s plan on one gloo rank, and its steps on 2 gloo ranks against the
plain NCCL link and the reference dispatch (same rows, same bits)."""

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist

from modelopt_ext.ep.link import NcclLink
from modelopt_ext.ep.overlap import chunk_routing
from modelopt_ext.ep.token_link import TokenLink, TokenPlan, TokenReceive, route_tokens
from modelopt_ext.testing.multiproc import run_ranks

# 2 ranks, 2 local experts each (global 0, 1 on rank 0; 2, 3 on rank 1), 3 tokens, top-2
HAND_IDS = torch.tensor([[3, 0], [1, 0], [2, 3]])


def _drive(link, plan, x_TH, routing):
    """A link's steps for one call with plan `plan`, every chunk's rows as the experts would get them, then the
    rows sent back unchanged (the return buffer in send order)."""
    C, K = routing.chunks, routing.ids_TK.shape[1]
    source_S = routing.order_S // K
    send_x, recv = link.send_buffer(plan, x_TH), link.receive_buffer(plan, x_TH)
    works = [link.send(plan, c, x_TH, source_S[plan.send_off[c]:plan.send_off[c + 1]], send_x, recv)
             for c in range(C)]
    rows, back = [], None
    for c in range(C):
        works[c].wait()
        rows.append(link.received(plan, c, recv).clone())
        if back is None:
            back = link.return_buffer(plan, rows[-1])
        link.send_back(plan, c, rows[-1], back).wait()
    return rows, back


# ---- per-rank body (run on every rank by run_ranks) ------------------------------------------------------------------


def token_vs_plain_exchange(rank: int, world_size: int, chunks: list[int]):
    """Through `TokenLink` and `NcclLink`, step by step, for several chunk counts: the plans' slot sizes, every
    chunk's received rows and the rows sent back; at one chunk, the rows against `dispatch`'s. Also the token
    rows sent against the distinct (token, rank) pairs, and the link's attributes before and after."""
    from modelopt_ext.ep.dispatch import dispatch

    E, H, K = 2, 6, 3
    tokens = 4 if rank else 17
    g = torch.Generator().manual_seed(300 + rank)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(world_size * E, generator=g)[:K] for _ in range(tokens)])
    group = dist.group.WORLD
    token_link, plain = TokenLink(group), NcclLink(group)
    before = dict(vars(token_link))
    out = {"sizes": {}, "rows": {}, "back": {}, "token_rows": {}, "receive_record": True}
    for C in chunks:
        send_WCE, routing = chunk_routing(ids, world_size, E, C)
        tplan = token_link.plan(send_WCE, routing, x)
        pplan = plain.plan(send_WCE, routing, x)
        out["receive_record"] &= isinstance(token_link.receive_buffer(tplan, x), TokenReceive)
        out["sizes"][C] = (tplan.send_sizes, tplan.recv_sizes, tplan.recv_blocks) == \
            (pplan.send_sizes, pplan.recv_sizes, pplan.recv_blocks)
        t_rows, t_back = _drive(token_link, tplan, x, routing)
        p_rows, p_back = _drive(plain, pplan, x, routing)
        out["rows"][C] = all(torch.equal(a, b) for a, b in zip(t_rows, p_rows, strict=True))
        out["back"][C] = torch.equal(t_back, p_back) and torch.equal(t_back, x[routing.order_S // K])
        out["token_rows"][C] = tplan.token_send_off[-1]
        if C == 1:
            recv_x, _, _ = dispatch(x, ids, E, group)
            out["dispatch_rows"] = torch.equal(t_rows[0], recv_x)
    out["distinct_token_ranks"] = int(sum(len(set((ids[t] // E).tolist())) for t in range(tokens)))
    out["slots"] = tokens * K
    out["same_attributes"] = vars(token_link) == before
    return out


# ---- tests -----------------------------------------------------------------------------------------------------------


def test_route_tokens_by_hand_one_chunk():
    send_WCE, routing = chunk_routing(HAND_IDS, 2, 2, 1)
    assert send_WCE.tolist() == [[[2, 1]], [[1, 2]]]  # rank 0: expert 0 twice, 1 once; rank 1: 2 once, 3 twice
    assert routing.order_S.tolist() == [1, 3, 2, 4, 0, 5]  # slots by global expert id
    route = route_tokens(routing, 2, 2)
    # token 0 reaches both ranks, token 1 rank 0, token 2 rank 1: two token rows for each rank, not three slots
    assert route.tokens_CW.tolist() == [[2, 2]]
    assert route.token_source[:4].tolist() == [0, 1, 0, 2]  # to rank 0: tokens 0, 1; to rank 1: tokens 0, 2
    assert sorted(route.token_source[4:].tolist()) == [1, 2]  # the pairs not sent: (rank 0, 2), (rank 1, 1)
    # per slot in send order, its token's place among the rows to its rank: (t0 r0) 0, (t1 r0) 1, (t1 r0) 1,
    # (t2 r1) 1, (t0 r1) 0, (t2 r1) 1
    assert route.slot_position.tolist() == [0, 1, 1, 1, 0, 1]


def test_route_tokens_by_hand_two_chunks():
    send_WCE, routing = chunk_routing(HAND_IDS, 2, 2, 2)  # tokens 0, 1 in chunk 0; token 2 in chunk 1
    # [rank][chunk][local expert]: rank 1 gets token 0's expert 3 in chunk 0 and token 2's 2 and 3 in chunk 1
    assert send_WCE.tolist() == [[[2, 1], [0, 0]], [[0, 1], [1, 1]]]
    route = route_tokens(routing, 2, 2)
    assert route.tokens_CW.tolist() == [[2, 1], [0, 1]]  # chunk 0: 2 rows to rank 0, 1 to rank 1; chunk 1: 0, 1
    assert route.token_source[:4].tolist() == [0, 1, 0, 2]
    assert route.slot_position.tolist() == [0, 1, 1, 0, 0, 0]  # positions restart in every chunk


@pytest.mark.parametrize("W,E,K,T,C,seed", [(2, 2, 3, 9, 1, 0), (3, 4, 5, 20, 3, 1), (4, 1, 2, 7, 8, 2),
                                            (2, 8, 8, 1, 2, 3), (5, 3, 2, 0, 2, 4)])
def test_route_tokens_sends_each_token_once_per_rank_and_every_slot_finds_its_token(W, E, K, T, C, seed):
    rng = random.Random(seed)
    ids = torch.tensor([rng.sample(range(W * E), K) for _ in range(T)], dtype=torch.long).reshape(T, K)
    send_WCE, routing = chunk_routing(ids, W, E, C)
    route = route_tokens(routing, W, E)
    chunk_T = routing.chunk_T.tolist()
    # token rows per (chunk, destination): the chunk's tokens with at least one expert on that rank
    want = [[sum(chunk_T[t] == c and any(e // E == w for e in ids[t].tolist()) for t in range(T)) for w in range(W)]
            for c in range(C)]
    assert route.tokens_CW.tolist() == want
    # ordered by chunk, then destination, then token
    starts = [0]
    for c in range(C):
        for w in range(W):
            starts.append(starts[-1] + want[c][w])
    sources = route.token_source.tolist()
    assert len(sources) == W * T
    for c in range(C):
        for w in range(W):
            block = sources[starts[c * W + w]:starts[c * W + w + 1]]
            assert block == [t for t in range(T) if chunk_T[t] == c and any(e // E == w for e in ids[t].tolist())]
    # every slot (send order) finds its own token at its position among its chunk's rows to its rank
    for s, slot in enumerate(routing.order_S.tolist()):
        t, e = divmod(slot, K)
        c, w = chunk_T[t], ids[t, e].item() // E
        assert sources[starts[c * W + w] + route.slot_position[s].item()] == t
    assert send_WCE.sum().item() == T * K


def test_token_link_plan_on_one_rank(one_rank_group):
    link = TokenLink(one_rank_group)
    ids = torch.tensor([[0, 1], [1, 0], [1, 2], [2, 0]])  # one rank, 3 experts, 2 chunks of 2 tokens
    x = torch.arange(8.0).reshape(4, 2)
    send_WCE, routing = chunk_routing(ids, 1, 3, 2)
    plan = link.plan(send_WCE, routing, x)
    assert isinstance(plan, TokenPlan) and vars(link) == {"group": one_rank_group}
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tokens_sent = []
    assert plan.send_sizes == plan.recv_sizes == [[4], [4]] and plan.recv_blocks == [[[2, 2, 0], [1, 1, 2]]]
    assert plan.tokens_sent == plan.tokens_received == [[2], [2]]  # each token once: every expert is local
    assert plan.token_send_off == plan.token_recv_off == [0, 2, 4]
    assert plan.token_base_CW.tolist() == [[0], [2]] and plan.slots_in_CW.tolist() == [[4], [4]]
    rows, back = _drive(link, plan, x, routing)
    assert torch.equal(torch.cat(rows), x[routing.order_S // 2])  # the slot rows, rebuilt from the token rows
    assert torch.equal(back, x[routing.order_S // 2])
    assert link.send_buffer(plan, x).shape == (4, 2)  # token rows, not slot rows (8)


def test_token_link_exchange_on_two_ranks_equals_the_plain_link_and_dispatch():
    chunks = [1, 2, 5]
    results = run_ranks(token_vs_plain_exchange, 2, {"chunks": chunks}, timeout_s=180)
    for rank, r in enumerate(results):
        assert r["sizes"] == r["rows"] == r["back"] == {c: True for c in chunks}, f"rank {rank}: {r}"
        assert r["dispatch_rows"] and r["receive_record"] and r["same_attributes"], f"rank {rank}: {r}"
        assert set(r["token_rows"].values()) == {r["distinct_token_ranks"]}, f"rank {rank}: {r}"
    assert sum(r["distinct_token_ranks"] for r in results) < sum(r["slots"] for r in results)

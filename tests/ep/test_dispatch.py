"""dispatch/combine on 2 real gloo ranks against permutations worked out by hand."""

import torch
import torch.distributed as dist

from modelopt_ext.ep.dispatch import combine, dispatch
from modelopt_ext.testing.multiproc import run_ranks

# ---- per-rank bodies (run on every rank by run_ranks) ----------------------------------------------------------------

# dispatch_by_hand: 2 ranks, 2 experts each (global 0,1 on rank 0; 2,3 on rank 1), 3 tokens, top-2.
HAND_IDS = {0: [[3, 0], [1, 2], [2, 3]], 1: [[0, 1], [0, 3], [1, 0]]}
HAND_WEIGHTS = {0: [[0.5, 0.25], [1.0, 2.0], [0.125, 4.0]], 1: [[1.0, 0.5], [2.0, 0.25], [4.0, 8.0]]}


def hand_tokens(rank: int) -> torch.Tensor:
    """Token t of rank r is [100 r + t, -(100 r + t)]."""
    base = torch.tensor([100.0 * rank + t for t in range(3)])
    return torch.stack([base, -base], dim=1)


def dispatch_by_hand(rank: int, world_size: int):
    x = hand_tokens(rank)
    ids = torch.tensor(HAND_IDS[rank])
    recv_x, recv_ids, meta = dispatch(x, ids, num_local_experts=2, group=dist.group.WORLD)
    # a hand-checkable "expert": multiply by (global expert id + 1)
    y = recv_x * (recv_ids + 2 * rank + 1).unsqueeze(-1).to(recv_x.dtype)
    out = combine(y, torch.tensor(HAND_WEIGHTS[rank]), meta, dist.group.WORLD)
    return {"recv_x": recv_x, "recv_ids": recv_ids, "send_sizes": meta.send_sizes,
            "recv_sizes": meta.recv_sizes, "out": out}


# combine_bf16_by_hand: HAND_IDS' routing; weights that bf16 cannot hold (rounding them to bf16 moves each by
# up to 2**-9 relative) and tokens whose expert outputs bf16 holds exactly (few mantissa bits).
BF16_WEIGHTS = {0: [[1 / 3, 0.1], [0.7, 0.2], [2 / 3, 0.45]], 1: [[0.3, 1 / 7], [0.55, 0.35], [0.9, 1 / 9]]}


def bf16_tokens(rank: int) -> torch.Tensor:
    """bf16 [3, 2]: token t of rank r is [1 + r/4 + t/16, -(2 + t/8)]; times 1..4 stays exact in bf16."""
    t = torch.arange(3, dtype=torch.float32)
    return torch.stack([1 + 0.25 * rank + t / 16, -(2 + t / 8)], dim=1).to(torch.bfloat16)


def combine_bf16_by_hand(rank: int, world_size: int):
    """bf16 tokens through dispatch -> "expert" (times global expert id + 1) -> combine with fp32 weights;
    the overlapped pipeline (`ep.overlap`, both NCCL-style links on gloo, 1 and 2 chunks) on the same inputs."""
    from modelopt_ext.ep import overlap

    x, ids, w = bf16_tokens(rank), torch.tensor(HAND_IDS[rank]), torch.tensor(BF16_WEIGHTS[rank])
    group = dist.group.WORLD
    recv_x, recv_ids, meta = dispatch(x, ids, num_local_experts=2, group=group)
    y = recv_x * (recv_ids + 2 * rank + 1).unsqueeze(-1).to(recv_x.dtype)
    out = combine(y, w, meta, group)

    def run_rows(rows, segments):
        result = torch.empty_like(rows)
        for e, start, n in segments:
            result[start:start + n] = rows[start:start + n] * (e + 2 * rank + 1)
        return result

    pipelined = {}
    for token_dispatch in (False, True):
        for chunks in (1, 2):
            with torch.no_grad():
                got = overlap.overlapped_moe(x, ids, w, 2, group, run_rows, chunks=chunks,
                                             token_dispatch=token_dispatch)
            pipelined[f"token_dispatch={token_dispatch},chunks={chunks}"] = got
    return {"out": out, "pipelined": pipelined}


# ---- tests -----------------------------------------------------------------------------------------------------------


def _expected(rank):
    """Rows rank `rank` receives: from rank 0 then rank 1, each sorted by global expert id (stable)."""
    rows, ids = [], []
    for src in (0, 1):
        slots = [(e, t) for t, pair in enumerate(HAND_IDS[src]) for e in pair]
        for e, t in sorted(slots, key=lambda s: s[0]):  # stable: equal ids keep slot order
            if e // 2 == rank:
                rows.append(hand_tokens(src)[t])
                ids.append(e % 2)
    return torch.stack(rows), torch.tensor(ids)


def test_dispatch_and_combine_by_hand():
    results = run_ranks(dispatch_by_hand, 2, timeout_s=120)
    for rank, r in enumerate(results):
        rows, ids = _expected(rank)
        assert torch.equal(r["recv_x"], rows)
        assert torch.equal(r["recv_ids"], ids)
        # rank 0 sends its slots for experts 0,1 to itself (3 slots) and 2,3 to rank 1 (3 slots)
        sends = [sum(e // 2 == dst for pair in HAND_IDS[rank] for e in pair) for dst in (0, 1)]
        assert list(r["send_sizes"]) == sends
        assert sum(r["recv_sizes"]) == rows.shape[0]
        # out[t] = sum_j w[t, j] * (expert id + 1) * x[t]
        x = hand_tokens(rank)
        expected = torch.stack([
            sum(w * (e + 1) * x[t] for e, w in zip(HAND_IDS[rank][t], HAND_WEIGHTS[rank][t])) for t in range(3)
        ])
        assert torch.equal(r["out"], expected)


def test_bf16_combine_by_hand():
    """bf16 expert outputs, fp32 routing weights that bf16 cannot hold: every EP combine (dispatch/combine and
    the overlapped pipeline through both of its gloo links) gives, per token, the fp32 products summed in slot
    order and rounded to bf16 once, which is the one-process reference (`weighted_sum`, then the cast)."""
    from modelopt_ext.ep.dispatch import weighted_sum
    from modelopt_ext.ep.local import gather_weighted_sum

    results = run_ranks(combine_bf16_by_hand, 2, timeout_s=120)
    for rank, r in enumerate(results):
        x, w = bf16_tokens(rank), torch.tensor(BF16_WEIGHTS[rank])
        # slot k of token t: expert e = HAND_IDS[rank][t][k] multiplies by e + 1 (exact in bf16)
        slots = torch.stack([torch.stack([x[t] * (e + 1) for e in HAND_IDS[rank][t]]) for t in range(3)])
        assert slots.dtype == torch.bfloat16
        expected = torch.empty(3, 2, dtype=torch.bfloat16)
        for t in range(3):
            acc = torch.zeros(2, dtype=torch.float32)
            for k in range(2):  # fp32 product, fp32 sum, slot order
                acc = acc + w[t, k] * slots[t, k].float()
            expected[t] = acc.to(torch.bfloat16)  # one rounding
        assert r["out"].dtype == torch.bfloat16
        assert torch.equal(r["out"], expected), (r["out"], expected)
        for name, got in r["pipelined"].items():
            assert torch.equal(got, expected), name
        # the one-process reference arithmetic, here and in the grouped path's combine
        assert torch.equal(weighted_sum(slots, w).to(torch.bfloat16), expected)
        inverse = torch.arange(6)
        assert torch.equal(gather_weighted_sum(slots.reshape(6, 2), inverse, w), expected)
        # the inputs tell the arithmetic apart: weights rounded to bf16 (the former batched GEMM) differ
        old = torch.bmm(w.to(torch.bfloat16).unsqueeze(1), slots).squeeze(1)
        assert not torch.equal(old, expected)

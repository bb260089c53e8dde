"""dispatch/combine on 2 real gloo ranks against permutations worked out by hand."""

import torch

from modelopt_ext.testing.ep_bodies import HAND_IDS, HAND_WEIGHTS, hand_tokens
from modelopt_ext.testing.multiproc import run_ranks


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
    results = run_ranks("modelopt_ext.testing.ep_bodies:dispatch_by_hand", 2, timeout_s=120)
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
    from modelopt_ext.testing.ep_bodies import BF16_WEIGHTS, bf16_tokens

    results = run_ranks("modelopt_ext.testing.ep_bodies:combine_bf16_by_hand", 2, timeout_s=120)
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

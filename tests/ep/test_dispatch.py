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

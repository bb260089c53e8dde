"""Per-rank bodies for the multi-process EP tests (run by `modelopt_ext.testing.multiproc.run_ranks`).

Each takes (rank, world_size, **kwargs) inside an initialised gloo group and returns tensors/values that
the test compares with single-process results or hand-computed expectations.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import modelopt_ext
from modelopt_ext.ep.dispatch import combine, dispatch

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


def _force_routing(model, experts: list[int]) -> None:
    """Every token of every MoE layer goes to `experts` (weights stay the router's)."""
    forced = torch.tensor(experts)

    def hook(module, inputs, output):
        idx, weight = output
        return forced.to(idx.device).expand_as(idx).contiguous(), weight

    for layer in model.language_model.model.layers:
        block = getattr(layer, "block_sparse_moe", None)
        if block is not None:
            block.gate.register_forward_hook(hook)


def ep_logits(rank: int, world_size: int, ckpt: str, dense: str, force_experts: list[int] | None = None,
              impl: str | None = None):
    """Logits of the EP model and of the same checkpoint in this one process, on a batch of this rank's own."""
    kwargs = {"trust_remote_code": True, "dtype": torch.float32}
    if impl is not None:
        kwargs["experts_implementation"] = impl
    single = modelopt_ext.from_pretrained(ckpt, **kwargs)
    model = modelopt_ext.from_pretrained(ckpt, ep_size=world_size, dense=dense, **kwargs)
    if force_experts is not None:
        _force_routing(single, force_experts)
        _force_routing(model, force_experts)
    ids = torch.randint(13, 500, (2, 16), generator=torch.Generator().manual_seed(100 + rank))
    with torch.no_grad():
        ep = model(input_ids=ids, use_cache=False).logits
        ref = single(input_ids=ids, use_cache=False).logits
    experts = model.language_model.model.layers[1].block_sparse_moe.experts
    return {"ep": ep, "ref": ref, "bytes_read": model.modelopt_ext_bytes_read,
            "plan": model.modelopt_ext_plan.to_dict(), "local_experts": experts.num_experts}


def plan_refusal(rank: int, world_size: int, ckpt: str, ep_size: int):
    """Every rank must raise the same error for a plan that cannot work."""
    try:
        modelopt_ext.from_pretrained(ckpt, ep_size=ep_size, trust_remote_code=True)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None

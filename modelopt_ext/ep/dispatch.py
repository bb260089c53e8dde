"""Token dispatch and combine for expert parallelism over one process group, as two functions joined by a
frozen metadata record (nothing is stored on modules between them).

Shapes: T tokens on this rank, K top-k, S = T*K routed slots, W ranks in the EP group, E experts per rank
(rank r owns global experts [r*E, (r+1)*E)), R rows this rank receives, H width.

Layout invariant: slots are sorted by global expert id, which groups them by owner rank, so the rows sent to
rank r are contiguous and ordered by r's local expert id; each rank receives, per source rank in rank order,
rows grouped by its local expert id.

Host syncs: exactly one per call of `dispatch`, the `.tolist()` of the W send and W receive sizes that
`all_to_all_single` needs for uneven splits. Routing metadata (order, counts, expert ids) stays on the device.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from modelopt_ext.faults import mark_exchange


@dataclasses.dataclass(frozen=True)
class DispatchMeta:
    """What `combine` needs to bring expert outputs back.

    order_S: int64 [S], the slot permutation that sorted slots by expert id (device).
    send_sizes / recv_sizes: rows sent to / received from each rank (host ints, length W).
    num_tokens: T; top_k: K.
    """

    order_S: torch.Tensor
    send_sizes: tuple[int, ...]
    recv_sizes: tuple[int, ...]
    num_tokens: int
    top_k: int


def _exchange(x: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single of rows; differentiable when autograd records."""
    if torch.is_grad_enabled() and x.requires_grad:
        out = x.new_empty(out_rows, *x.shape[1:])
        return dist_fn.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    out = x.new_empty(out_rows, *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: how many of `ids` (int64, in [0, n)) equal each value, on ids' device. A scatter-add into a
    fixed-size tensor, not `bincount`: CUDA's bincount reads the ids' minimum and maximum back to the host."""
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def inverse_permutation(order_S: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `order_S` (int64 [S], on its device): inverse[order[i]] = i."""
    inverse_S = torch.empty_like(order_S)
    inverse_S[order_S] = torch.arange(order_S.numel(), device=order_S.device)
    return inverse_S


def dispatch(
    x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, num_local_experts: int, group
) -> tuple[torch.Tensor, torch.Tensor, DispatchMeta]:
    """Send every (token, expert) slot to the rank owning the expert.

    Args:
        x_TH: [T, H] this rank's tokens.
        topk_ids_TK: [T, K] int64 global expert ids in [0, W*E).
        num_local_experts: E.
        group: the EP process group (W ranks).
    Returns:
        recv_x_RH [R, H] rows for this rank's experts, recv_ids_R [R] int64 local expert ids in [0, E),
        and the metadata `combine` needs.
    """
    mark_exchange()
    W = dist.get_world_size(group)
    T, K = topk_ids_TK.shape
    ids_S = topk_ids_TK.reshape(-1)
    order_S = torch.argsort(ids_S, stable=True)
    send_x = x_TH[order_S // K]
    counts_WE = count_ids(ids_S, W * num_local_experts).view(W, num_local_experts)
    recv_counts_WE = torch.empty_like(counts_WE)
    dist.all_to_all_single(recv_counts_WE, counts_WE, group=group)
    sizes = torch.stack([counts_WE.sum(dim=1), recv_counts_WE.sum(dim=1)]).tolist()  # the one host sync
    send_sizes, recv_sizes = tuple(sizes[0]), tuple(sizes[1])
    R = sum(recv_sizes)
    recv_x = _exchange(send_x, R, list(recv_sizes), list(send_sizes), group)
    local_ids = torch.arange(num_local_experts, device=x_TH.device).repeat(W)
    recv_ids_R = local_ids.repeat_interleave(recv_counts_WE.reshape(-1), output_size=R)
    meta = DispatchMeta(order_S, send_sizes, recv_sizes, T, K)
    return recv_x, recv_ids_R, meta


def combine(y_RH: torch.Tensor, topk_weights_TK: torch.Tensor, meta: DispatchMeta, group) -> torch.Tensor:
    """Return expert outputs to their tokens and sum them with the routing weights.

    Every dtype takes the one-process reference's arithmetic (`weighted_sum`, as the eager experts forward and
    `local.gather_weighted_sum` do): each slot output times its fp32 routing weight, summed in fp32 in slot
    order, then rounded once to y's dtype. For 16-bit outputs this materialises a [T, K, H] fp32 temporary
    (twice the bytes of the slots) where a batched GEMM with bf16 weights would read them once; the GEMM
    rounded the routing weights to bf16 and so gave results that depended on the EP degree (docs/export.md).

    Args:
        y_RH: [R, H] unweighted expert outputs, in the order `dispatch` delivered the rows.
        topk_weights_TK: [T, K] routing weights of this rank's tokens.
    Returns:
        [T, H] in y's dtype.
    """
    back_SH = _exchange(y_RH, sum(meta.send_sizes), list(meta.send_sizes), list(meta.recv_sizes), group)
    slots_TKH = back_SH.index_select(0, inverse_permutation(meta.order_S)).view(meta.num_tokens, meta.top_k, -1)
    return weighted_sum(slots_TKH, topk_weights_TK).to(y_RH.dtype)


def weighted_sum(slots_TKH: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
    """[T, H] fp32: the K slot outputs of each token times their routing weights, summed in fp32 in slot order
    (one fixed order for every token, whatever else the batch holds)."""
    return (slots_TKH.float() * topk_weights_TK.unsqueeze(-1).float()).sum(dim=1)

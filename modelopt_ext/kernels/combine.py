"""The EP combine's last step as one Triton kernel (CUDA only; imported lazily): each token's K returned slot
rows gathered by index, weighted and summed in fp32 in slot order, written once in the output dtype. Reads
every slot row once; no [T, K, H] temporary."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 1024


@triton.jit
def _gather_weighted_sum_kernel(back_ptr, inverse_ptr, weights_ptr, out_ptr, H, stride_back, stride_out,
                                K: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(inverse_ptr + token * K + k).to(tl.int64)
        weight = tl.load(weights_ptr + token * K + k).to(tl.float32)
        acc += weight * tl.load(back_ptr + row * stride_back + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gather_weighted_sum(back_SH: torch.Tensor, inverse_S: torch.Tensor, weights_TK: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * back[inverse[t*K + k]] (CUDA tensors; `out` [T, H] or new)."""
    T, K = weights_TK.shape
    H = back_SH.shape[1]
    if back_SH.stride(1) != 1:
        back_SH = back_SH.contiguous()
    if out is None:
        out = back_SH.new_empty(T, H)
    if T:
        _gather_weighted_sum_kernel[(T, triton.cdiv(H, BLOCK_H))](
            back_SH, inverse_S.contiguous(), weights_TK.contiguous(), out, H, back_SH.stride(0), out.stride(0),
            K=K, BLOCK_H=BLOCK_H)
    return out

"""SiTU-GLU on the gate/up GEMM output as one Triton kernel (CUDA only; imported lazily).

    out[s, i] = beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta),  g = x[s, i], u = x[s, I + i]

x is the [S, 2I] output of the fused gate/up projection (w1 rows first, then w3). The kernel reads each 16-bit
input once, computes in fp32 registers and writes the 16-bit product once.

`approx=True` evaluates tanh with the GPU's `tanh.approx.f32` instruction (and sigmoid(g) as
0.5 tanh(g/2) + 0.5): three special-function-unit operations per element instead of libdevice's precise
tanh/exp sequences, which keep the precise kernel compute-bound on an H200. Measured (docs/performance.md,
session 4): twice as fast (1.21 vs 2.51 ms for 262,718 x 3,072 outputs) but up to ~250 bf16 ulps from the
float64 formula at small values, where the precise kernel stays within 0.5 ulp; so the experts use the
precise form (`experts.GLU_ON_CUDA = "triton"`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK_M = 16
BLOCK_N = 256


@triton.jit
def _tanh_approx(x):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _situ_glu_kernel(x_ptr, out_ptr, S, I, stride_x, stride_out, beta, linear_beta,
                     APPROX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < S) & (cols[None, :] < I)
    src = x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :]
    g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(src + I, mask=mask, other=0.0).to(tl.float32)
    if APPROX:
        act = beta * _tanh_approx(g / beta) * (0.5 * _tanh_approx(0.5 * g) + 0.5)
        act = act * (linear_beta * _tanh_approx(u / linear_beta))
    else:
        act = beta * libdevice.tanh(g / beta) * tl.sigmoid(g) * (linear_beta * libdevice.tanh(u / linear_beta))
    dst = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(dst, act.to(out_ptr.dtype.element_ty), mask=mask)


def situ_glu(gate_up_S2I: torch.Tensor, beta: float, linear_beta: float, approx: bool = False) -> torch.Tensor:
    """[S, I] in the input's dtype from the [S, 2I] gate/up output (CUDA, unit stride along the width)."""
    S, two_I = gate_up_S2I.shape
    if two_I % 2:
        raise ValueError(f"gate/up width {two_I} is odd: expected the w1 half then the w3 half")
    I = two_I // 2
    x = gate_up_S2I if gate_up_S2I.stride(1) == 1 else gate_up_S2I.contiguous()
    out = x.new_empty(S, I)
    if S:
        grid = (triton.cdiv(S, BLOCK_M), triton.cdiv(I, BLOCK_N))
        _situ_glu_kernel[grid](x, out, S, I, x.stride(0), out.stride(0), float(beta), float(linear_beta),
                               APPROX=approx, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return out

"""SiTU-GLU on the gate/up GEMM output as one Triton kernel (CUDA only; imported lazily).

    out[s, i] = beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta),  g = x[s, i], u = x[s, I + i]

x is the [S, 2I] output of the fused gate/up projection (w1 rows first, then w3). The kernel reads each 16-bit
input once, computes in fp32 registers and writes the 16-bit product once. Three forms (`FORMS`):

- "exp2" (default): both tanh and the sigmoid from exp2 (the GPU's `ex2.approx.ftz.f32`), an odd polynomial for
  tanh near zero where 1 - exp(-2y) cancels, and the whole product as one fraction taken with one reciprocal
  square root: per element two exp2 for beta = 4 (three otherwise) and one rsqrt, no select-heavy libdevice
  sequences. The algorithm, its constants and its CPU mirror live in `situ_glu_math.py`; the mirror is within
  0.5 bf16 ulp of the float64 formula (tests/models/kimi_k3/test_situ_glu_math.py: every bf16 gate with fixed ups and
  vice versa, random pairs, also with exp2 perturbed by twice the instruction's error). The kernel was
  checked against the mirror under Triton's CPU interpreter; on an H200 (docs/performance.md, session 5) it is
  within 0.50 bf16 ulp of float64 and takes 1.57-1.64 ms for 262,718 x 3,072 outputs, between "approx" (1.21-1.28)
  and "libdevice" (2.42-2.50).
- "libdevice": libdevice tanh and `tl.sigmoid`. Within 0.5 bf16 ulp of the float64 formula; compute-bound on an
  H200 (2.51 ms for 262,718 x 3,072 outputs; docs/performance.md, session 4).
- "approx": tanh from the GPU's `tanh.approx.f32` instruction (and sigmoid(g) as 0.5 tanh(g/2) + 0.5): three
  special-function-unit operations per element. Same measurement: 1.21 ms, but up to ~250 bf16 ulps from the
  float64 formula at small values.

The experts option `glu_on_cuda` (`modelopt_ext.options`) picks the form the experts use ("triton" = "exp2").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from modelopt_ext.models.kimi_k3 import situ_glu_math

BLOCK_M = 16
BLOCK_N = 256
FORMS = ("exp2", "libdevice", "approx")

# The "exp2" form's constants, from their one home (`situ_glu_math`).
if len(situ_glu_math.TANH_POLY) != 2:
    raise ImportError(f"situ_glu expects 2 tanh polynomial coefficients, got {situ_glu_math.TANH_POLY}")
_POLY_THRESHOLD = tl.constexpr(situ_glu_math.TANH_POLY_THRESHOLD)
_C1 = tl.constexpr(situ_glu_math.TANH_POLY[0])
_C2 = tl.constexpr(situ_glu_math.TANH_POLY[1])
_NEG_LOG2E = tl.constexpr(situ_glu_math.NEG_LOG2E)
_NEG_TWO_LOG2E = tl.constexpr(situ_glu_math.NEG_TWO_LOG2E)


@triton.jit
def _tanh_approx(x):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _scale_constants(scale):
    """Per program: (c1', c2', exp2 factor, threshold) for scale tanh(x / scale); `situ_glu_math.scale_constants`."""
    inv = tl.math.div_rn(1.0, scale)
    inv2 = inv * inv
    return _C1 * inv2, _C2 * (inv2 * inv2), inv * _NEG_TWO_LOG2E, _POLY_THRESHOLD * scale


@triton.jit
def _scaled_tanh_parts(x_abs, scale, c1s, c2s, k, threshold):
    """scale tanh(x_abs / scale) for x_abs = |x| as (numerator, e, small): the fraction is numerator / 1 where
    small, numerator / (1 + e) elsewhere, e = exp(-2 x_abs / scale); `situ_glu_math.scaled_tanh_parts`."""
    e = tl.exp2(x_abs * k)
    w = x_abs * x_abs
    # Each a * b + c here is contracted into one FMA by the compiler (written out: tl.fma of older Triton versions
    # does not broadcast scalar operands).
    p = (w * c2s + c1s) * w + 1.0
    small = x_abs < threshold
    num = tl.where(small, x_abs * p, e * -scale + scale)
    return num, e, small


@triton.jit
def _situ_glu_exp2(g, u, beta, linear_beta, SQUARE_GATE_EXP: tl.constexpr):
    """SiTU-GLU of fp32 g, u with two (beta = 4) or three exp2 and one reciprocal square root;
    `situ_glu_math.situ_glu_fp32`."""
    c1_g, c2_g, k_g, threshold_g = _scale_constants(beta)
    c1_u, c2_u, k_u, threshold_u = _scale_constants(linear_beta)
    a = tl.abs(g)
    n_g, e_g, small_g = _scaled_tanh_parts(a, beta, c1_g, c2_g, k_g, threshold_g)
    n_u, e_u, small_u = _scaled_tanh_parts(tl.abs(u), linear_beta, c1_u, c2_u, k_u, threshold_u)
    if SQUARE_GATE_EXP:  # beta = 4: exp(-|g|) = e_g^2
        s = e_g * e_g
        d = e_g * e_g + 1.0
    else:
        s = tl.exp2(a * _NEG_LOG2E)
        d = 1.0 + s
    num = n_g * n_u
    num = tl.where(g < 0, num * s, num)
    d = tl.where(small_g, d, tl.fma(d, e_g, d))  # d (1 + e_g)
    d = tl.where(small_u, d, tl.fma(d, e_u, d))
    mag = num * tl.math.rsqrt(d * d)  # d in [1, 8]: one MUFU.RSQ, where `/` is a guarded division sequence
    sign = (g.to(tl.int32, bitcast=True) ^ u.to(tl.int32, bitcast=True)) & -2147483648
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _situ_glu_kernel(x_ptr, out_ptr, S, I, stride_x, stride_out, beta, linear_beta,
                     FORM: tl.constexpr, SQUARE_GATE_EXP: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < S) & (cols[None, :] < I)
    src = x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :]
    g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(src + I, mask=mask, other=0.0).to(tl.float32)
    if FORM == "exp2":
        act = _situ_glu_exp2(g, u, beta, linear_beta, SQUARE_GATE_EXP)
    elif FORM == "approx":
        act = beta * _tanh_approx(g / beta) * (0.5 * _tanh_approx(0.5 * g) + 0.5)
        act = act * (linear_beta * _tanh_approx(u / linear_beta))
    else:
        act = beta * libdevice.tanh(g / beta) * tl.sigmoid(g) * (linear_beta * libdevice.tanh(u / linear_beta))
    dst = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(dst, act.to(out_ptr.dtype.element_ty), mask=mask)


def situ_glu(gate_up_S2I: torch.Tensor, beta: float, linear_beta: float, form: str = "exp2") -> torch.Tensor:
    """[S, I] in the input's dtype from the [S, 2I] gate/up output (CUDA, unit stride along the width), by
    `form` (one of `FORMS`; see the module docstring)."""
    if form not in FORMS:
        raise ValueError(f"SiTU-GLU kernel form {form!r}; expected one of {FORMS}")
    situ_glu_math.check_betas(beta, linear_beta)
    S, two_I = gate_up_S2I.shape
    if two_I % 2:
        raise ValueError(f"gate/up width {two_I} is odd: expected the w1 half then the w3 half")
    I = two_I // 2
    x = gate_up_S2I if gate_up_S2I.stride(1) == 1 else gate_up_S2I.contiguous()
    out = x.new_empty(S, I)
    if S:
        grid = (triton.cdiv(S, BLOCK_M), triton.cdiv(I, BLOCK_N))
        _situ_glu_kernel[grid](x, out, S, I, x.stride(0), out.stride(0), float(beta), float(linear_beta),
                               FORM=form, SQUARE_GATE_EXP=form == "exp2" and situ_glu_math.squares_gate_exp(beta),
                               BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return out

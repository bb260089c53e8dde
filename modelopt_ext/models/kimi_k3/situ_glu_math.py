"""The "exp2" SiTU-GLU algorithm of `models/kimi_k3/situ_glu.py`, mirrored in PyTorch fp32 (CPU; no Triton needed).

    out = beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta)

This module is the one home of the algorithm's constants (`models/kimi_k3/situ_glu.py` imports them) and its CPU mirror:
the same branches, thresholds, coefficients and fp32 operations as the kernel's `_situ_glu_exp2` (FMAs included,
where the compiler contracts the kernel's a * b + c), so its accuracy is tested on CPU
(tests/models/kimi_k3/test_situ_glu_math.py). The GPU's own rounding differs in the ways listed at the end.

Per element (the sign is applied last, from the sign bits of g and u):
- scale tanh(x / scale) for a magnitude x = |g| or |u| and scale = beta or linear_beta, as a fraction (n, d):
  x < `TANH_POLY_THRESHOLD` scale: (x P(x^2), 1), P(w) = 1 + w (c1' + w c2') with c_k' = c_k / scale^(2k)
  (`TANH_POLY` = c1, c2, a minimax fit of tanh(y) / y ~ 1 + y^2 (c1 + y^2 c2) for y < 0.25, relative error
  4.9e-7 before fp32 rounding); otherwise, with e = exp2(-2 log2(e) x / scale) = exp(-2 x / scale),
  (scale - scale e, 1 + e), the numerator one FMA. Near zero 1 - e cancels, hence the polynomial branch.
- sigmoid(g), with s = exp(-|g|): (1, 1 + s) for g >= 0, (s, 1 + s) for g < 0. For beta = 4 (Kimi-K3's value,
  `squares_gate_exp`) s is the gate's e squared; otherwise s = exp2(-log2(e) |g|).
- out = n_g n_s n_u / (d_s d_g d_u), each factor of the denominator taken in by one FMA (d (1 + e) = d e + d),
  the quotient as n rsqrt(d^2): one MUFU.RSQ where `/` would be a guarded division sequence, so per element two
  exp2 for beta = 4 (three otherwise) and one reciprocal square root. The per-scale constants (1 / scale, c_k',
  the exp2 factor, the threshold) are computed once per program in the kernel. Each denominator factor is in
  [1, 2], so nothing overflows for any input: huge |g|, |u| make e and s underflow to 0 (tanh = 1, sigmoid = 1
  or 0), +-inf gives what the fp32 reference gives (e.g. g = +inf: beta * linear_beta tanh(u / linear_beta)),
  NaN in g or u gives NaN.

What the GPU does differently (read from the PTX that Triton 3.9 makes for sm_90), and how the mirror or the
tests stand for it:
- Triton's fp32 exp2 is `ex2.approx.ftz.f32`: relative error ~2^-22 against `torch.exp2`'s correct rounding
  (the tests perturb exp2 by twice that), and subnormal results flushed to zero, which the mirror's default
  `exp2_ftz` copies. So for beta != 4, g < -126 ln 2 (-87.3) gives +-0 where the formula gives at most
  beta * linear_beta * 2^-126 in magnitude (the fp32 reference flushes too, from about -88.7); for beta = 4 the
  square e * e underflows gradually instead.
- `rsqrt.approx.ftz.f32` (relative error ~2^-23) where the mirror takes `torch.rsqrt`, and the mirror's FMA is
  float64 arithmetic rounded to fp32 (it can differ from a true FMA by one fp32 ulp after a double rounding):
  fp32 differences far below the bf16 rounding step.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

# Below this y = |x| / scale, tanh(y) is the polynomial; at and above it, (1 - e) / (1 + e).
TANH_POLY_THRESHOLD = 0.25
# c1, c2 of tanh(y) ~ y (1 + y^2 (c1 + y^2 c2)) for y in [0, TANH_POLY_THRESHOLD): each the shortest decimal
# of an fp32 value.
TANH_POLY = (-0.33324572, 0.1287642)
# log2(e) rounded to fp32 (exactly representable, as is twice it).
LOG2E = 1.4426950216293335
NEG_LOG2E = -LOG2E
NEG_TWO_LOG2E = -2.0 * LOG2E
SMALLEST_NORMAL_F32 = 2.0**-126
# Scales (beta, linear_beta) the fp32 arithmetic is safe for: 1 / scale^4 (in c2') stays a normal fp32 number.
SCALE_MIN = 2.0**-30
SCALE_MAX = 2.0**30


def check_betas(beta: float, linear_beta: float) -> None:
    """The algorithm takes |x| / scale as the tanh argument: both scales must be positive, within
    [`SCALE_MIN`, `SCALE_MAX`]."""
    for name, value in (("beta", beta), ("linear_beta", linear_beta)):
        try:
            ok = math.isfinite(float(value)) and SCALE_MIN <= float(value) <= SCALE_MAX
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"SiTU-GLU {name} is {value!r}; expected a number in [2**-30, 2**30]")


def squares_gate_exp(beta: float) -> bool:
    """Whether the sigmoid's exp(-|g|) is the square of the gate tanh's e = exp(-2|g| / beta): beta = 4."""
    return float(beta) == 4.0


def exp2_ftz(x: torch.Tensor) -> torch.Tensor:
    """2^x with subnormal results flushed to zero, as the GPU's `ex2.approx.ftz.f32` (otherwise correctly
    rounded: the instruction's own ~2^-22 relative error is not modelled)."""
    y = torch.exp2(x)
    return torch.where(y < SMALLEST_NORMAL_F32, torch.zeros_like(y), y)


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once to fp32 (through float64, where a * b is exact)."""
    return (a.double() * b.double() + c.double()).float()


def scale_constants(scale: float) -> tuple[torch.Tensor, ...]:
    """fp32 (scale, c1', c2', exp2 factor, threshold) for scale tanh(x / scale), as the kernel computes them once
    per program: c_k' = c_k / scale^(2k), exp2 factor -2 log2(e) / scale, threshold `TANH_POLY_THRESHOLD` scale."""
    scale_t = _f32(scale)
    inv = _f32(1.0) / scale_t
    inv2 = inv * inv
    c1, c2 = (_f32(c) for c in TANH_POLY)
    return scale_t, c1 * inv2, c2 * (inv2 * inv2), inv * _f32(NEG_TWO_LOG2E), _f32(TANH_POLY_THRESHOLD) * scale_t


def scaled_tanh_parts(x_abs: torch.Tensor, scale: float, *, exp2: Callable = exp2_ftz,
                      poly_threshold: float = TANH_POLY_THRESHOLD) -> tuple[torch.Tensor, ...]:
    """scale tanh(x_abs / scale) for x_abs >= 0 (or NaN) in fp32 as (numerator, e, small): the fraction is
    numerator / 1 where small, numerator / (1 + e) elsewhere; e = exp(-2 x_abs / scale)."""
    scale_t, c1s, c2s, k, threshold = scale_constants(scale)
    if poly_threshold != TANH_POLY_THRESHOLD:
        threshold = _f32(poly_threshold) * scale_t
    one = torch.ones_like(x_abs)
    e = exp2(x_abs * k)
    w = x_abs * x_abs
    p = _fma(w, _fma(w, c2s.expand_as(w), c1s.expand_as(w)), one)
    small = x_abs < threshold
    num = torch.where(small, x_abs * p, _fma(e, -scale_t.expand_as(e), scale_t.expand_as(e)))
    return num, e, small


def situ_glu_fp32(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float, *,
                  exp2: Callable = exp2_ftz, poly_threshold: float = TANH_POLY_THRESHOLD) -> torch.Tensor:
    """SiTU-GLU of same-shaped gate and up by the kernel's "exp2" algorithm, in fp32 before the final rounding.

    `exp2` replaces the exponential (tests pass a perturbed one to model the GPU's approximate instruction);
    `poly_threshold` = 0 turns the polynomial branch off (tests show that the branch is needed)."""
    check_betas(beta, linear_beta)
    g, u = gate.float(), up.float()
    a = g.abs()
    n_g, e_g, small_g = scaled_tanh_parts(a, beta, exp2=exp2, poly_threshold=poly_threshold)
    n_u, e_u, small_u = scaled_tanh_parts(u.abs(), linear_beta, exp2=exp2, poly_threshold=poly_threshold)
    if squares_gate_exp(beta):
        s, d = e_g * e_g, _fma(e_g, e_g, torch.ones_like(e_g))
    else:
        s = exp2(a * _f32(NEG_LOG2E))
        d = 1.0 + s
    num = n_g * n_u
    num = torch.where(g < 0, num * s, num)
    d = torch.where(small_g, d, _fma(d, e_g, d))  # d (1 + e_g)
    d = torch.where(small_u, d, _fma(d, e_u, d))
    mag = num * torch.rsqrt(d * d)  # the kernel's reciprocal: one MUFU.RSQ (d is in [1, 8])
    negative = torch.signbit(g) ^ torch.signbit(u)  # the kernel: OR of the sign bits' XOR (signed zeros too)
    return torch.where(negative, -mag, mag)


def situ_glu(gate_up_S2I: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """[S, I] in the input's dtype from the [S, 2I] gate/up output (gate half first): `models/kimi_k3/situ_glu.py`'s
    "exp2" form on the CPU."""
    S, two_I = gate_up_S2I.shape
    if two_I % 2:
        raise ValueError(f"gate/up width {two_I} is odd: expected the w1 half then the w3 half")
    gate, up = gate_up_S2I.chunk(2, dim=-1)
    return situ_glu_fp32(gate, up, beta, linear_beta).to(gate_up_S2I.dtype)

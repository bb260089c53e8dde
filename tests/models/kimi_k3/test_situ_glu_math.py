"""Tests for modelopt_ext.models.kimi_k3.situ_glu_math: the CPU mirror of the SiTU-GLU kernel's "exp2" form, against
the float64 formula beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta).

The bound: the bf16 result within 0.51 bf16 ulp of the float64 value (correctly rounded but for near-ties) and
the fp32 value before rounding within 1e-5 relative. The second implies the first for any other fp32 error of the
GPU below ~2.5e-5 relative (one bf16 ulp is at least 2^-8 relative), which covers `rsqrt.approx.ftz.f32` and
true FMAs; the approximate exp2 is modelled by perturbing exp2 by twice its ~2^-22 relative error."""

import math

import pytest
import torch

from modelopt_ext.models.kimi_k3 import situ_glu_math
from modelopt_ext.models.kimi_k3.situ_glu_math import (
    LOG2E,
    NEG_TWO_LOG2E,
    TANH_POLY_THRESHOLD,
    exp2_ftz,
    scaled_tanh_parts,
    situ_glu,
    situ_glu_fp32,
)

BETA, LINEAR_BETA = 4.0, 25.0  # Kimi-K3's config values
ULP_BOUND = 0.51
REL_BOUND = 1e-5
EXP2_ERROR = 2.0**-21
EXP2_VARIANTS = {
    "exact": exp2_ftz,
    "high": lambda x: exp2_ftz(x) * (1 + EXP2_ERROR),
    "low": lambda x: exp2_ftz(x) * (1 - EXP2_ERROR),
}
FIXED = (0.37, -3.0, 1e-3, -1e-30, 7.5, 25.0, -200.0)  # values held fixed while the other input sweeps bf16


def _finite_bf16() -> torch.Tensor:
    """Every finite bf16 value (65,280 of the 65,536 bit patterns), both zeros and the subnormals included."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return every[torch.isfinite(every.float())]


def _formula(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    g, u = g.double(), u.double()
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


def _bf16_ulps(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|y - ref| in units of bf16's spacing at |ref|: 2^(k-8) for |ref| in [2^(k-1), 2^k), and the subnormal
    spacing 2^-133 below 2^-126 and at 0."""
    _, k = torch.frexp(ref)  # frexp(0) has k = 0
    k = torch.where(ref == 0, torch.full_like(k, -133), torch.clamp(k - 8, min=-133))
    ulp = torch.ldexp(torch.ones_like(ref), k)
    return (y.double() - ref).abs() / ulp


def _errors(g: torch.Tensor, u: torch.Tensor, beta: float = BETA, linear_beta: float = LINEAR_BETA,
            **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bf16 ulps, fp32 relative error where |ref| > 1e-30 else 0, the fp32 result) per element."""
    got = situ_glu_fp32(g, u, beta, linear_beta, **kwargs)
    ref = _formula(g, u, beta, linear_beta)
    ulps = _bf16_ulps(got.bfloat16(), ref)
    rel = torch.where(ref.abs() > 1e-30, (got.double() - ref).abs() / ref.abs(), torch.zeros_like(ref))
    return ulps, rel, got


def _sweeps() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every finite bf16 gate against each fixed up, and every finite bf16 up against each fixed gate."""
    every = _finite_bf16()
    out = []
    for value in FIXED:
        fixed = torch.full_like(every, value)
        out += [(every, fixed), (fixed, every)]
    return out


def test_constants():
    assert torch.tensor(LOG2E, dtype=torch.float32).item() == LOG2E  # an fp32 value
    assert abs(LOG2E - 1 / math.log(2)) < 2.0**-23
    assert torch.tensor(NEG_TWO_LOG2E, dtype=torch.float32).item() == NEG_TWO_LOG2E == -2 * LOG2E
    for c in situ_glu_math.TANH_POLY:
        assert torch.tensor(c, dtype=torch.float32).item() == pytest.approx(c, rel=2.0**-24)
    c1, c2 = situ_glu_math.TANH_POLY  # near tanh's Taylor coefficients -1/3, 2/15
    assert abs(c1 + 1 / 3) < 1e-3 and abs(c2 - 2 / 15) < 1e-2


def test_bf16_ulps_helper():
    ref = torch.tensor([1.0, 1.0, 3.0, -3.0, 0.0, 2.0**-130, 1.0 - 2.0**-10], dtype=torch.float64)
    y = torch.tensor([1.0 + 2.0**-7, 1.0 + 2.0**-8, 3.0 + 2.0**-7, -3.0, 2.0**-133, 0.0, 1.0], dtype=torch.float64)
    want = [1.0, 0.5, 0.5, 0.0, 1.0, 8.0, 0.25]  # spacing 2^-7 on [1, 2), 2^-8 just below 1
    assert _bf16_ulps(y, ref).tolist() == want


def test_polynomial_branch():
    """tanh below the threshold (the polynomial) and above it ((1 - e) / (1 + e)) within 1e-6 relative of float64,
    on a dense grid and on both sides of the threshold."""
    for scale in (BETA, LINEAR_BETA, 1.0, 0.3):
        y = torch.cat([torch.linspace(1e-6, 2 * TANH_POLY_THRESHOLD, 200_001),
                       torch.tensor([TANH_POLY_THRESHOLD]).nextafter(torch.tensor(0.0)),
                       torch.tensor([TANH_POLY_THRESHOLD])])
        x = y * scale
        num, e, small = scaled_tanh_parts(x, scale)
        assert small.any() and not small.all()
        got = torch.where(small, num.double(), num.double() / (1 + e.double()))
        ref = scale * torch.tanh(x.double() / scale)
        rel = (got - ref).abs() / ref
        assert rel.max().item() < 1e-6, scale


@pytest.mark.parametrize("exp2", EXP2_VARIANTS)
def test_every_bf16_gate_and_up(exp2):
    worst_ulps, worst_rel = 0.0, 0.0
    for g, u in _sweeps():
        ulps, rel, _ = _errors(g, u, exp2=EXP2_VARIANTS[exp2])
        worst_ulps, worst_rel = max(worst_ulps, ulps.max().item()), max(worst_rel, rel.max().item())
    assert worst_ulps <= ULP_BOUND, worst_ulps
    assert worst_rel < REL_BOUND, worst_rel


@pytest.mark.parametrize("exp2", EXP2_VARIANTS)
def test_random_pairs(exp2):
    gen = torch.Generator().manual_seed(0)
    every = _finite_bf16()
    n = 200_000
    g = torch.cat([every[torch.randint(len(every), (n,), generator=gen)],  # every magnitude
                   (torch.randn(n, generator=gen) * torch.tensor([0.1, 1.0, 10.0]).repeat(n // 3 + 1)[:n]).bfloat16()])
    u = torch.cat([every[torch.randint(len(every), (n,), generator=gen)],
                   (torch.randn(n, generator=gen) * 3).bfloat16()])
    ulps, rel, _ = _errors(g, u, exp2=EXP2_VARIANTS[exp2])
    assert ulps.max().item() <= ULP_BOUND, ulps.max().item()
    assert rel.max().item() < REL_BOUND, rel.max().item()


@pytest.mark.parametrize("beta, linear_beta", [(1.0, 3.0), (0.3, 100.0), (4.1, 25.3), (8.0, 25.0)])
def test_other_betas(beta, linear_beta):
    """Without beta = 4's squared e, the sigmoid's exp2 flushes below 2^-126 as on the GPU: g < -126 ln 2 gives
    +-0, where the formula is at most beta * linear_beta * 2^-126 in magnitude; everything else within bound."""
    for g, u in _sweeps():
        ulps, rel, got = _errors(g, u, beta, linear_beta)
        flushed = g.float() < -126 * math.log(2)
        assert (ulps[~flushed] <= ULP_BOUND).all(), (beta, linear_beta)
        assert (rel[~flushed] < REL_BOUND).all(), (beta, linear_beta)
        assert (got[flushed] == 0).all()
        assert (_formula(g, u, beta, linear_beta)[flushed].abs() <= beta * linear_beta * 2.0**-126).all()


def test_without_polynomial_branch_fails():
    """The bound can fail: (1 - e) / (1 + e) alone cancels near zero (tiny gates come out as 0)."""
    every = _finite_bf16()
    ulps, rel, got = _errors(every, torch.full_like(every, 7.5), poly_threshold=0.0)
    assert ulps.max().item() > 100
    assert rel.max().item() > 0.5
    tiny = (every.float().abs() < 1e-8) & (every.float() != 0)
    assert (got[tiny] == 0).all()


def test_special_values_match_fp32_reference():
    """+-inf, NaN and signed zeros come out as the fp32 reference (`experts._situ_glu_reference`) has them."""
    from modelopt_ext.models.kimi_k3.experts import _situ_glu_reference

    values = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 1.5, -2.25, 1e-20], dtype=torch.bfloat16)
    g, u = values.repeat_interleave(len(values)), values.repeat(len(values))
    got = situ_glu(torch.stack([g, u], dim=-1), BETA, LINEAR_BETA)[:, 0]
    want = _situ_glu_reference(g, u, BETA, LINEAR_BETA)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(got[finite].signbit(), want[finite].signbit())
    assert got[(g == math.inf) & (u == math.inf)].item() == BETA * LINEAR_BETA


def test_situ_glu_layout_and_checks():
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 12, generator=gen) * 4).bfloat16()
    out = situ_glu(x, BETA, LINEAR_BETA)
    assert out.shape == (5, 6) and out.dtype == torch.bfloat16
    assert torch.equal(out, situ_glu_fp32(x[:, :6], x[:, 6:], BETA, LINEAR_BETA).bfloat16())
    with pytest.raises(ValueError, match="odd"):
        situ_glu(x[:, :11], BETA, LINEAR_BETA)
    for beta, linear_beta in [(0.0, 25.0), (-4.0, 25.0), (4.0, math.inf), (math.nan, 25.0), (4.0, 2.0**40)]:
        with pytest.raises(ValueError, match="beta"):
            situ_glu(x, beta, linear_beta)

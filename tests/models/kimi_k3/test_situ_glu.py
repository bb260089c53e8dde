"""modelopt_ext.models.kimi_k3.situ_glu: SiTU-GLU on the gate/up output as one Triton kernel (CUDA only), in three
forms ("exp2", "libdevice", "approx").

On the CPU: the module needs Triton and says so; `experts.apply_situ_glu` on CPU tensors never imports it and
gives the fp32 reference; the wrapper's checks, layouts and launch (under a Triton stand-in,
tests/kernels/triton_stub.py); the module refuses a `situ_glu_math` it does not match. On a GPU with Triton: each
form against the float64 formula and the CPU mirror of the "exp2" form (`situ_glu_math.situ_glu`)."""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from modelopt_ext.models.kimi_k3 import situ_glu_math
from modelopt_ext.models.kimi_k3.experts import _situ_glu_reference, apply_situ_glu
from modelopt_ext.options import GLU_FORMS
from modelopt_ext.testing.multiproc import import_file

stub = import_file(Path(__file__).parents[2] / "kernels" / "triton_stub.py")
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON),
                               reason="the Triton kernel needs a CUDA device and triton installed")
BETA, LINEAR_BETA = 4.0, 25.0  # Kimi-K3's config values
MODULE = "modelopt_ext.models.kimi_k3.situ_glu"


def _gate_up(S: int, I: int, dtype=torch.bfloat16, seed: int = 0, scale: float = 4.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(S, 2 * I, generator=g) * scale).to(dtype)


def _formula(x: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """float64 [S, I] of the [S, 2I] gate/up output."""
    g, u = x.double().chunk(2, dim=-1)
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


def _bf16_ulps(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|y - ref| in units of bf16's spacing at |ref| (subnormal spacing 2^-133 at the bottom)."""
    _, k = torch.frexp(ref)
    k = torch.where(ref == 0, torch.full_like(k, -133), torch.clamp(k - 8, min=-133))
    return (y.double() - ref).abs() / torch.ldexp(torch.ones_like(ref), k)


@pytest.fixture
def kernel_module(monkeypatch):
    return stub.import_with_stub(MODULE, monkeypatch)


# ---- without a GPU ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_TRITON, reason="triton is installed here")
def test_importing_without_triton_names_triton():
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module(MODULE)
    assert info.value.name == "triton"
    assert MODULE not in sys.modules


@pytest.mark.parametrize("form", GLU_FORMS)
def test_cpu_tensors_never_import_the_kernel(monkeypatch, form):
    """Every experts form on CPU tensors is the fp32 reference of the two halves, and takes no kernel."""
    monkeypatch.setitem(sys.modules, MODULE, None)  # any import of it raises
    x = _gate_up(5, 12)
    got = apply_situ_glu(x, BETA, LINEAR_BETA, form)
    gate, up = x.chunk(2, dim=-1)
    assert got.shape == (5, 12) and got.dtype == torch.bfloat16
    assert torch.equal(got, _situ_glu_reference(gate, up, BETA, LINEAR_BETA))


def test_launch_grid_and_arguments(kernel_module):
    x = _gate_up(40, 300)
    out = kernel_module.situ_glu(x, BETA, LINEAR_BETA)
    assert out.shape == (40, 300) and out.dtype == torch.bfloat16
    (launch,) = kernel_module._situ_glu_kernel.launches
    assert launch.grid == (3, 2)  # 16-row by 256-column tiles of the [S, I] output
    assert launch.args[0] is x and launch.args[1] is out
    assert launch.args[2:] == (40, 300, 600, 300, 4.0, 25.0)  # S, I, the row strides, the betas as floats
    assert launch.kwargs == {"FORM": "exp2", "SQUARE_GATE_EXP": True, "BLOCK_M": 16, "BLOCK_N": 256}


@pytest.mark.parametrize("form, beta, squares", [("exp2", 4, True), ("exp2", 3.0, False), ("libdevice", 4.0, False),
                                                 ("approx", 4.0, False)])
def test_form_and_the_squared_gate_exponential(kernel_module, form, beta, squares):
    """exp(-|g|) is taken as e_g^2 only in the "exp2" form and only for beta = 4."""
    kernel_module.situ_glu(_gate_up(3, 8), beta, LINEAR_BETA, form=form)
    kwargs = kernel_module._situ_glu_kernel.launches[0].kwargs
    assert kwargs["FORM"] == form and kwargs["SQUARE_GATE_EXP"] is squares


def test_layouts_the_kernel_is_given(kernel_module):
    """Rows of a wider tensor pass as they are (their row stride); a column stride other than 1 is copied."""
    wide = _gate_up(6, 32)  # [6, 64]
    rows = wide[:, :32]  # [6, 32]: unit column stride, row stride 64
    kernel_module.situ_glu(rows, BETA, LINEAR_BETA)
    launch = kernel_module._situ_glu_kernel.launches[-1]
    assert launch.args[0] is rows and launch.args[2:6] == (6, 16, 64, 16)
    cols = wide[:, ::2]  # column stride 2
    out = kernel_module.situ_glu(cols, BETA, LINEAR_BETA)
    launch = kernel_module._situ_glu_kernel.launches[-1]
    assert launch.args[0].stride() == (32, 1) and torch.equal(launch.args[0], cols) and out.shape == (6, 16)


def test_arguments_refused_before_any_launch(kernel_module):
    x = _gate_up(4, 8)
    with pytest.raises(ValueError, match=r"SiTU-GLU kernel form 'fast'; expected one of \('exp2', 'libdevice', 'approx'\)"):
        kernel_module.situ_glu(x, BETA, LINEAR_BETA, form="fast")
    with pytest.raises(ValueError, match="gate/up width 15 is odd"):
        kernel_module.situ_glu(x[:, :15], BETA, LINEAR_BETA)
    for beta, linear_beta in [(0.0, 25.0), (-4.0, 25.0), (4.0, math.inf), (math.nan, 25.0), (4.0, 2.0**40)]:
        with pytest.raises(ValueError, match="beta"):
            kernel_module.situ_glu(x, beta, linear_beta)
    assert kernel_module._situ_glu_kernel.launches == []


def test_no_rows_launch_nothing(kernel_module):
    out = kernel_module.situ_glu(torch.zeros(0, 24, dtype=torch.float16), BETA, LINEAR_BETA)
    assert out.shape == (0, 12) and out.dtype == torch.float16
    assert kernel_module._situ_glu_kernel.launches == []


def test_the_module_refuses_a_math_module_it_does_not_match(monkeypatch):
    """The kernel's polynomial has two coefficients, taken from `situ_glu_math` at import."""
    monkeypatch.setattr(situ_glu_math, "TANH_POLY", (-0.33, 0.13, 0.05))
    with pytest.raises(ImportError, match=r"situ_glu expects 2 tanh polynomial coefficients, got \(-0\.33, 0\.13, 0\.05\)"):
        stub.import_with_stub(MODULE, monkeypatch)


# ---- on a GPU --------------------------------------------------------------------------------------------------

# Largest distance from the float64 formula, in bf16 ulps, by form (docs/performance.md: "exp2" and "libdevice"
# within 0.5 ulp on an H200; "approx", the tanh.approx instruction, up to ~250 ulps at small values).
ULP_BOUND = {"exp2": 0.51, "libdevice": 0.51}


@needs_gpu
@pytest.mark.parametrize("form", ["exp2", "libdevice", "approx"])
@pytest.mark.parametrize("beta, linear_beta", [(BETA, LINEAR_BETA), (3.0, 10.0)])
def test_kernel_against_the_formula(form, beta, linear_beta):
    from modelopt_ext.models.kimi_k3.situ_glu import situ_glu

    x = _gate_up(1000, 1536, seed=7)
    x[:7, :7] = torch.tensor([0.0, -0.0, 1e-20, -1e-3, 0.25, -30.0, 300.0], dtype=torch.bfloat16)  # small, large
    got = situ_glu(x.cuda(), beta, linear_beta, form=form).cpu()
    assert got.shape == (1000, 1536) and got.dtype == torch.bfloat16
    ref = _formula(x, beta, linear_beta)
    if form in ULP_BOUND:
        ulps = _bf16_ulps(got, ref)
        assert ulps.max().item() <= ULP_BOUND[form], ulps.max().item()
    else:
        torch.testing.assert_close(got.double(), ref, rtol=2.0**-6, atol=2e-3)


@needs_gpu
def test_exp2_form_against_its_cpu_mirror_and_the_cuda_dispatch(monkeypatch):
    """The "exp2" kernel and its CPU mirror (`situ_glu_math.situ_glu`) round to the same bf16 but at near-ties;
    `apply_situ_glu` takes the kernel for the "triton*" forms on CUDA tensors and the reference otherwise."""
    import modelopt_ext.models.kimi_k3.situ_glu as kernel

    x = _gate_up(512, 1024, seed=11)
    got = kernel.situ_glu(x.cuda(), BETA, LINEAR_BETA).cpu()
    mirror = situ_glu_math.situ_glu(x, BETA, LINEAR_BETA)
    differ = (got != mirror).float().mean().item()
    assert differ < 1e-3, differ
    assert (_bf16_ulps(got, mirror.double()) <= 1).all()
    calls = []
    original = kernel.situ_glu
    monkeypatch.setattr(kernel, "situ_glu", lambda *args, form: calls.append(form) or original(*args, form=form))
    for form in GLU_FORMS:
        apply_situ_glu(x.cuda(), BETA, LINEAR_BETA, form)
    assert calls == ["exp2", "libdevice", "approx"]  # "triton", "triton-libdevice", "triton-approx"; not compile, eager

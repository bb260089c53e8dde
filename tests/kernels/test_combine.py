"""modelopt_ext.kernels.combine: the EP combine's gather + weighted sum as one Triton kernel (CUDA only).

On the CPU: the module needs Triton and says so; the CPU combine (`ep.local.gather_weighted_sum`) never imports
it; the wrapper's layouts and launch grid (under a Triton stand-in, tests/kernels/triton_stub.py). On a GPU with
Triton: the kernel against the CPU reference arithmetic (fp32 products summed in slot order, one rounding)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from modelopt_ext.ep import local
from modelopt_ext.testing.multiproc import import_file

stub = import_file(Path(__file__).with_name("triton_stub.py"))
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON),
                               reason="the Triton kernel needs a CUDA device and triton installed")


def _inputs(T: int, K: int, H: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """back [S, H] with S = T * K + 3 rows (3 never gathered), inverse [T * K] (rows reused and skipped),
    weights [T, K] fp32."""
    g = torch.Generator().manual_seed(seed)
    back = torch.randn(T * K + 3, H, generator=g).to(dtype)
    inverse = torch.randint(0, T * K + 3, (T * K,), generator=g)
    weights = torch.rand(T, K, generator=g)
    return back.to(device), inverse.to(device), weights.to(device)


def _reference(back, inverse, weights) -> torch.Tensor:
    """float64 [T, H]: sum_k w[t, k] * back[inverse[t * K + k]]."""
    T, K = weights.shape
    slots = back.double().cpu()[inverse.cpu()].view(T, K, back.shape[1])
    return (slots * weights.double().cpu().unsqueeze(-1)).sum(dim=1)


@pytest.fixture
def kernel_module(monkeypatch):
    return stub.import_with_stub("modelopt_ext.kernels.combine", monkeypatch)


# ---- without a GPU ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_TRITON, reason="triton is installed here")
def test_importing_without_triton_names_triton():
    import modelopt_ext.kernels  # noqa: F401  (the package itself needs no Triton)

    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module("modelopt_ext.kernels.combine")
    assert info.value.name == "triton"
    assert "modelopt_ext.kernels.combine" not in sys.modules


def test_the_cpu_combine_never_imports_the_kernel(monkeypatch):
    """With the kernel module made unimportable, the CPU path still runs and gives the reference, rounded once
    (`out=` writes into a view of a larger buffer and leaves the rest alone)."""
    monkeypatch.setitem(sys.modules, "modelopt_ext.kernels.combine", None)  # any import of it raises
    back, inverse, weights = _inputs(5, 3, 40, torch.bfloat16)
    want = _reference(back, inverse, weights)
    got = local.gather_weighted_sum(back, inverse, weights)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 40)
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=0)  # within bf16's rounding of the sum
    buffer = torch.full((7, 40), -1.0, dtype=torch.bfloat16)
    assert local.gather_weighted_sum(back, inverse, weights, out=buffer[1:6]) is not None
    assert torch.equal(buffer[1:6], got)
    assert (buffer[0] == -1).all() and (buffer[6] == -1).all()


def test_launch_grid_and_arguments(kernel_module):
    back, inverse, weights = _inputs(3, 2, 2500, torch.bfloat16)
    out = kernel_module.gather_weighted_sum(back, inverse, weights)
    (launch,) = kernel_module._gather_weighted_sum_kernel.launches
    assert launch.grid == (3, 3)  # one program per token and per 1024 columns
    b, inv, w, o, H, stride_back, stride_out = launch.args
    assert b is back and o is out and H == 2500 and stride_back == 2500 and stride_out == 2500
    assert torch.equal(inv, inverse) and torch.equal(w, weights)
    assert launch.kwargs == {"K": 2, "BLOCK_H": kernel_module.BLOCK_H}
    assert out.shape == (3, 2500) and out.dtype == torch.bfloat16


def test_layouts_the_kernel_is_given(kernel_module):
    """Rows of a wider tensor pass as they are (their row stride); a column stride other than 1 is copied;
    inverse and weights are made contiguous; `out` (a column slice here) is written in place, its row stride
    passed."""
    back_rows = torch.randn(9, 64)[:, :40]  # unit column stride, row stride 64
    inverse = torch.arange(24)[::2] % 9  # [12], stride 2
    weights = torch.rand(2, 6).t()  # [6, 2], not contiguous
    out = torch.empty(6, 80)[:, :40]
    assert kernel_module.gather_weighted_sum(back_rows, inverse, weights, out) is out
    launch = kernel_module._gather_weighted_sum_kernel.launches[-1]
    assert launch.grid == (6, 1)
    assert launch.args[0] is back_rows and launch.args[5] == 64 and launch.args[6] == 80
    assert launch.args[1].is_contiguous() and torch.equal(launch.args[1], inverse)
    assert launch.args[2].is_contiguous() and torch.equal(launch.args[2], weights)
    back_cols = torch.randn(40, 9).t()  # [9, 40], column stride 9
    kernel_module.gather_weighted_sum(back_cols, inverse, weights)
    launch = kernel_module._gather_weighted_sum_kernel.launches[-1]
    assert launch.args[0].stride() == (40, 1) and torch.equal(launch.args[0], back_cols) and launch.args[5] == 40


def test_no_tokens_launch_nothing(kernel_module):
    back, inverse, weights = torch.randn(4, 16, dtype=torch.float16), torch.zeros(0, dtype=torch.long), torch.zeros(0, 2)
    out = kernel_module.gather_weighted_sum(back, inverse, weights)
    assert out.shape == (0, 16) and out.dtype == torch.float16
    assert kernel_module._gather_weighted_sum_kernel.launches == []


# ---- on a GPU --------------------------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T, K, H", [(37, 4, 1500), (1, 8, 7168), (300, 2, 64)])
def test_kernel_matches_the_cpu_reference(dtype, T, K, H):
    from modelopt_ext.kernels.combine import gather_weighted_sum

    back, inverse, weights = _inputs(T, K, H, dtype, seed=T + K)
    cpu = local.gather_weighted_sum(back, inverse, weights)  # the CPU path: fp32 sum in slot order, one rounding
    got = gather_weighted_sum(back.cuda(), inverse.cuda(), weights.cuda()).cpu()
    assert got.dtype == dtype and got.shape == (T, H)
    if dtype == torch.float32:
        torch.testing.assert_close(got, cpu, rtol=1e-6, atol=1e-6)
    else:  # the fp32 sums may differ in their last bits (FMA, order): at most one step of the 16-bit rounding
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        assert ((got.double() - cpu.double()).abs() <= cpu.double().abs() * ulp + 1e-5).all()
    torch.testing.assert_close(got.double(), _reference(back, inverse, weights),
                               rtol=1e-6 if dtype == torch.float32 else 2.0**-7, atol=1e-5)


@needs_gpu
def test_kernel_writes_into_out_and_the_cuda_combine_takes_it(monkeypatch):
    import modelopt_ext.kernels.combine as combine

    back, inverse, weights = (t.cuda() for t in _inputs(6, 4, 3000, torch.bfloat16))
    buffer = torch.full((8, 3000), -1.0, dtype=torch.bfloat16, device="cuda")
    assert combine.gather_weighted_sum(back, inverse, weights, out=buffer[1:7]).data_ptr() == buffer[1:7].data_ptr()
    assert (buffer[0] == -1).all() and (buffer[7] == -1).all()
    calls = []
    monkeypatch.setattr(combine, "gather_weighted_sum", lambda *args: calls.append(args) or args[3])
    local.gather_weighted_sum(back, inverse, weights, out=buffer[1:7])
    assert len(calls) == 1  # CUDA tensors go to the kernel

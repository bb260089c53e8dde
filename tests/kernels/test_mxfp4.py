"""modelopt_ext.kernels.mxfp4: MXFP4 -> 16-bit dequantization as one Triton kernel (CUDA only).

On the CPU: the module needs Triton and says so; the CPU path (`formats.mxfp4.dequantize_mxfp4_fused`) never
imports it; the wrapper's output shape and launch (under a Triton stand-in, tests/kernels/triton_stub.py). On a
GPU with Triton: bit-identical to the reference `formats.mxfp4.dequantize_mxfp4` for every byte and scale."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from modelopt_ext.formats.mxfp4 import dequantize_mxfp4, dequantize_mxfp4_fused
from modelopt_ext.testing.multiproc import import_file

stub = import_file(Path(__file__).with_name("triton_stub.py"))
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON),
                               reason="the Triton kernel needs a CUDA device and triton installed")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _every_byte_and_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """packed [255, 16, 16]: every byte in every row; scale [255, 16, 1]: row r has scale r (0..254)."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(255, 1).view(255, 16, 16)
    scale = torch.arange(255, dtype=torch.uint8).view(255, 1).repeat(1, 16).view(255, 16, 1)
    return packed, scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.fixture
def kernel_module(monkeypatch):
    return stub.import_with_stub("modelopt_ext.kernels.mxfp4", monkeypatch)


# ---- without a GPU ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_TRITON, reason="triton is installed here")
def test_importing_without_triton_names_triton():
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module("modelopt_ext.kernels.mxfp4")
    assert info.value.name == "triton"
    assert "modelopt_ext.kernels.mxfp4" not in sys.modules


def test_the_cpu_path_never_imports_the_kernel(monkeypatch):
    monkeypatch.setitem(sys.modules, "modelopt_ext.kernels.mxfp4", None)  # any import of it raises
    packed, scale = _every_byte_and_scale()
    for dtype in DTYPES + (torch.float64,):
        got = dequantize_mxfp4_fused(packed, scale, dtype)
        assert got.dtype == dtype and got.shape == (255, 16, 32)
        assert torch.equal(got, dequantize_mxfp4(packed, scale, dtype, validate=False))


def test_output_shape_dtype_and_launch(kernel_module):
    packed = torch.randint(0, 256, (3, 5, 2048 + 48), dtype=torch.uint8)
    scale = torch.randint(100, 150, (3, 5, (2048 + 48) // 16), dtype=torch.uint8)
    out = kernel_module.dequantize(packed, scale, torch.bfloat16)
    assert out.shape == (3, 5, 2 * (2048 + 48)) and out.dtype == torch.bfloat16
    (launch,) = kernel_module._dequantize_kernel.launches
    n = packed.numel()
    assert launch.grid == (-(-n // kernel_module.BLOCK),)  # one program per BLOCK packed bytes
    p, s, o, n_bytes = launch.args
    assert p is packed and s is scale and o is out and n_bytes == n
    assert launch.kwargs == {"BLOCK": 2048, "GROUP_BYTES": 16}  # 32 values per scale byte


def test_non_contiguous_inputs_are_made_contiguous(kernel_module):
    packed = torch.randint(0, 256, (64, 4), dtype=torch.uint8).t()  # [4, 64], strided
    scale = torch.randint(100, 150, (4, 4), dtype=torch.uint8).t()
    kernel_module.dequantize(packed, scale, torch.float16)
    p, s, _, _ = kernel_module._dequantize_kernel.launches[0].args
    assert p.is_contiguous() and torch.equal(p, packed) and s.is_contiguous() and torch.equal(s, scale)


def test_empty_input_launches_nothing(kernel_module):
    out = kernel_module.dequantize(torch.zeros(4, 0, dtype=torch.uint8), torch.zeros(4, 0, dtype=torch.uint8),
                                   torch.float32)
    assert out.shape == (4, 0) and out.dtype == torch.float32
    assert kernel_module._dequantize_kernel.launches == []


# ---- on a GPU --------------------------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_is_bit_identical_for_every_byte_and_scale(dtype):
    from modelopt_ext.kernels.mxfp4 import dequantize

    packed, scale = _every_byte_and_scale()
    want = dequantize_mxfp4(packed, scale, dtype, validate=False)
    got = dequantize(packed.cuda(), scale.cuda(), dtype).cpu()
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want))


@needs_gpu
def test_kernel_on_a_size_off_the_block_and_the_cuda_dispatch(monkeypatch):
    """A tensor whose byte count is no multiple of BLOCK (the masked tail); `dequantize_mxfp4_fused` takes the
    kernel for CUDA tensors in 16/32-bit dtypes and the float64 reference otherwise."""
    import modelopt_ext.kernels.mxfp4 as kernels

    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (7, 3 * 2048 + 80), generator=g, dtype=torch.uint8)
    scale = torch.randint(90, 160, (7, (3 * 2048 + 80) // 16), generator=g, dtype=torch.uint8)
    got = kernels.dequantize(packed.cuda(), scale.cuda(), torch.bfloat16).cpu()
    assert torch.equal(_bits(got), _bits(dequantize_mxfp4(packed, scale, torch.bfloat16, validate=False)))
    calls = []
    original = kernels.dequantize
    monkeypatch.setattr(kernels, "dequantize", lambda *args: calls.append(args[2]) or original(*args))
    dequantize_mxfp4_fused(packed.cuda(), scale.cuda(), torch.bfloat16)
    dequantize_mxfp4_fused(packed.cuda(), scale.cuda(), torch.float64)
    assert calls == [torch.bfloat16]

"""A stand-in for `triton` under which the Triton kernel modules (modelopt_ext/kernels/*.py,
models/kimi_k3/situ_glu.py) import on a machine without Triton, so their Python-side wrappers (argument checks,
layouts, launch grids) are tested on the CPU. A `@triton.jit` function becomes a `Kernel` that records each
launch instead of running. Not a test module: the kernel tests import it by path
(`multiproc.import_file(<tests>/kernels/triton_stub.py)`); the kernels themselves are compared with their CPU
references by each test file's GPU tests."""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any, NamedTuple


class Launch(NamedTuple):
    grid: tuple
    args: tuple
    kwargs: dict[str, Any]


class Kernel:
    """What `@triton.jit` makes of a function here: `kernel[grid](*args, **kwargs)` records a `Launch`."""

    def __init__(self, fn):
        self.fn = fn
        self.launches: list[Launch] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(Launch(tuple(grid), args, kwargs))

        return launch

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.fn.__name__} is a @triton.jit function: it runs inside a kernel only")


def stub_modules() -> dict[str, types.ModuleType]:
    """`triton`, `triton.language`, `triton.language.extra` and its `libdevice`: what the kernel modules touch
    at import (jit, cdiv, constexpr)."""
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    extra = types.ModuleType("triton.language.extra")
    libdevice = types.ModuleType("triton.language.extra.libdevice")
    triton.jit = Kernel
    triton.cdiv = lambda a, b: -(-a // b)
    triton.language = language
    language.constexpr = lambda value=None: value
    language.extra = extra
    extra.libdevice = libdevice
    return {"triton": triton, "triton.language": language, "triton.language.extra": extra,
            "triton.language.extra.libdevice": libdevice}


def import_with_stub(module: str, monkeypatch) -> types.ModuleType:
    """A fresh copy of `module` (a dotted name) imported with the stand-in in place of Triton, under a private
    name (the real module name is left alone); the stand-in leaves `sys.modules` when the test ends."""
    for name, stub in stub_modules().items():
        monkeypatch.setitem(sys.modules, name, stub)
    origin = importlib.util.find_spec(module).origin
    spec = importlib.util.spec_from_file_location(f"_triton_stub_{module.replace('.', '_')}", origin)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded

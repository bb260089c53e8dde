"""Max statistics without a host sync per quantizer call.

ModelOpt's `MaxCalibrator.collect` checks three facts about every amax it reduces (no NaN, none negative, no
inf) with `assert torch.any(...)`, and each check reads a device value back to the host: three device-to-host
syncs per quantizer call. On GPUs they stop the host from queueing work ahead of the device: the calibration
profile of the mid-size stand-in showed 72 syncs per forward, the GPU busy 60% of the wall time
(docs/performance.md).

`deferred_checks()` (around `mtq.quantize`) makes `collect` do the same arithmetic (ModelOpt's own
`reduce_amax` over the same axes, the running `torch.max`) without the asserts. NaN and inf are not lost:
`torch.amax` and `torch.max` propagate both into the running amax, and `check_collected(model)` (at the end
of the forward loop) reads every max calibrator's amax once and raises a ValueError naming the first
quantizer (in module order: where NaN or inf entered, as the asserts would have found it) and how many later
ones followed (negative values after `abs` cannot arise).
Calibrators that keep per-call amaxes (`track_amax`) read them back anyway and keep ModelOpt's collect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def deferred_checks() -> Iterator[None]:
    from modelopt.torch.quantization import utils as quant_utils
    from modelopt.torch.quantization.calib.max import MaxCalibrator

    original = MaxCalibrator.collect

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        if x.device.type == "meta" or getattr(self, "_track_amax", False):
            return original(self, x)
        axes = quant_utils.convert_quantization_axis_to_reduce_axis(x, self._axis)
        amax = quant_utils.reduce_amax(x, axis=axes).detach()
        if self._calib_amax is None:
            self._calib_amax = amax
        elif amax.shape != self._calib_amax.shape:
            raise RuntimeError(f"amax shape changed from {tuple(self._calib_amax.shape)} to {tuple(amax.shape)}")
        else:
            self._calib_amax = torch.max(self._calib_amax, amax)

    MaxCalibrator.collect = collect
    try:
        yield
    finally:
        MaxCalibrator.collect = original


def check_collected(model: torch.nn.Module) -> None:
    """Raise ValueError naming the quantizers whose collected max statistics hold NaN or inf (one host read
    for all of them)."""
    from modelopt.torch.quantization.calib.max import MaxCalibrator
    from modelopt.torch.quantization.nn import TensorQuantizer

    from .sync import nan_inf

    named = [(name, m._calibrator._calib_amax) for name, m in model.named_modules()
             if isinstance(m, TensorQuantizer) and isinstance(getattr(m, "_calibrator", None), MaxCalibrator)
             and isinstance(m._calibrator._calib_amax, torch.Tensor)]
    flags = nan_inf([amax for _, amax in named])
    bad = [(name, "NaN" if nan else "inf") for (name, _), (nan, inf) in zip(named, flags) if nan or inf]
    if bad:
        # NaN and inf flow downstream: the first quantizer in module order is where they appeared
        (first, kind), later = bad[0], len(bad) - 1
        also = f" (first in module order; {later} later quantizer(s) too)" if later else ""
        raise ValueError(f"calibration statistics are not finite: {first} saw {kind} in its input during "
                         f"calibration{also}, so the model is not exported; the calibration data or the layers "
                         "feeding this module produce NaN or inf")

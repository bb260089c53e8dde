"""quant.collect: max statistics without ModelOpt's per-call host checks, and the one deferred check."""

import pytest
import torch

pytest.importorskip("modelopt")

from modelopt.torch.quantization.calib.max import MaxCalibrator  # noqa: E402
from modelopt.torch.quantization.nn import TensorQuantizer  # noqa: E402

from modelopt_ext.quant.collect import check_collected, deferred_checks  # noqa: E402


@pytest.mark.parametrize("axis", [None, 0, (0,)])
def test_same_statistics_as_modelopt(axis):
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(6, 5, generator=g) * s for s in (1.0, 3.0, 0.5)]
    ours, theirs = MaxCalibrator(axis=axis), MaxCalibrator(axis=axis)
    for x in inputs:
        theirs.collect(x)
    original = MaxCalibrator.collect
    with deferred_checks():
        assert MaxCalibrator.collect is not original
        for x in inputs:
            ours.collect(x)
    assert MaxCalibrator.collect is original
    assert torch.equal(ours.compute_amax(), theirs.compute_amax())


def test_shape_change_still_refused():
    calib = MaxCalibrator(axis=0)
    with deferred_checks(), pytest.raises(RuntimeError, match="amax shape changed"):
        calib.collect(torch.ones(4, 2))
        calib.collect(torch.ones(3, 2))


def test_track_amax_keeps_modelopts_collect():
    calib = MaxCalibrator(track_amax=True)
    with deferred_checks():
        calib.collect(torch.ones(2, 2))
    assert len(calib.amaxs) == 1


def test_nan_and_inf_are_named_after_the_loop():
    model = torch.nn.ModuleDict({"a": TensorQuantizer(), "b": TensorQuantizer(), "c": TensorQuantizer()})
    for q in model.values():
        q.disable_quant()
        q.enable_calib()
    with deferred_checks():  # no assert fires while collecting
        model["a"](torch.ones(3))
        model["b"](torch.tensor([1.0, float("inf")]))
        model["c"](torch.tensor([float("nan"), 1.0]))
    with pytest.raises(ValueError, match=r"not finite: b saw inf in its input during calibration \(first in module "
                                         r"order; 1 later quantizer\(s\) too\)"):
        check_collected(model)
    model["b"]._calibrator.reset()
    model["c"]._calibrator.reset()
    check_collected(model)  # finite (or empty) statistics pass

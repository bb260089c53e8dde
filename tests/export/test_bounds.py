"""modelopt_ext.export.bounds: dequantizing exported FP8 / NVFP4 weights and their error bounds against the source."""

import pytest
import torch

from modelopt_ext.export.bounds import _check_bound, _dequantize
from modelopt_ext.formats.mxfp4 import E2M1_VALUES, pack_e2m1

# The export's tensors by key: `_dequantize` and `_check_bound` only call `exp.get(key)`, which a dict has.


def _fp8(values) -> torch.Tensor:
    return torch.tensor(values).to(torch.float8_e4m3fn)


def _nvfp4(codes: list[list[int]], block_scale: list[list[float]], scale_2: float) -> dict[str, torch.Tensor]:
    return {"m.weight": pack_e2m1(torch.tensor(codes, dtype=torch.uint8)),
            "m.weight_scale": _fp8(block_scale), "m.weight_scale_2": torch.tensor(scale_2)}


def test_fp8_within_the_rounding_bound_records_the_worst_errors():
    w = torch.tensor([[1.0, 0.3]])
    exp = {"m.weight": _fp8([[1.0, 0.3]]), "m.weight_scale": torch.tensor(1.0)}  # 0.3 is stored as 0.3125
    stats, problems = {}, []
    _check_bound("m.weight", "FP8", 0, exp, w, 1.0, stats, problems)
    assert problems == []
    # bound of 0.3: (2**-4 + 2**-8) * 0.3 + 2**-10 * scale 1 = 0.0208984375; error 0.0125
    rel, ratio = stats["FP8"]
    assert rel == pytest.approx(0.0125, rel=1e-5) and ratio == pytest.approx(0.0125 / 0.0208984375, rel=1e-5)


def test_fp8_value_off_by_more_than_the_bound_is_reported_and_the_tolerance_scales_it():
    w = torch.tensor([[1.0, 0.3]])
    exp = {"m.weight": _fp8([[1.0, 0.375]]), "m.weight_scale": torch.tensor(1.0)}
    stats, problems = {"FP8": [0.5, 0.25]}, []
    _check_bound("m.weight", "FP8", 0, exp, w, 1.0, stats, problems)
    assert problems == ["m.weight: 1 of 2 values exceed the FP8 error bound; first at [0, 1]: dequantized 0.375, "
                        "source 0.3, bound 0.0209"]
    assert stats["FP8"][0] == 0.5 and stats["FP8"][1] == pytest.approx(0.075 / 0.0208984375, rel=1e-5)  # maxima kept
    problems = []
    _check_bound("m.weight", "FP8", 0, exp, w, 4.0, {}, problems)  # 4 x 0.0209 > 0.075
    assert problems == []


def test_fp8_shape_mismatch_is_a_problem_not_an_error():
    problems = []
    exp = {"m.weight": _fp8([[1.0, 2.0, 3.0]]), "m.weight_scale": torch.tensor(1.0)}
    assert _dequantize("m.weight", "FP8", 0, exp, torch.ones(3, 1), problems) is None
    assert problems == ["m.weight has shape [1, 3], source [3, 1]"]


def test_fp8_block_scales_cover_128_by_128_blocks_cropped_to_the_weight():
    w = torch.cat([torch.full((128, 3), 2.0), torch.full((2, 3), 1.5)])  # two row blocks, one column block
    exp = {"m.weight": _fp8([[1.0] * 3] * 128 + [[3.0] * 3] * 2), "m.weight_scale": torch.tensor([[2.0], [0.5]])}
    problems = []
    deq, scale = _dequantize("m.weight", "FP8_PB_WO", 0, exp, w, problems)
    assert problems == [] and scale.shape == (130, 3)
    assert bool((scale[:128] == 2.0).all()) and bool((scale[128:] == 0.5).all())
    assert torch.equal(deq, w)
    stats = {}
    _check_bound("m.weight", "FP8_PB_WO", 0, exp, w, 1.0, stats, problems)
    assert problems == [] and stats == {"FP8_PB_WO": [0.0, 0.0]}


def test_nvfp4_dequantizes_codes_times_block_and_tensor_scales_cropped_to_the_source():
    # source width 20, group 16: two blocks per row, the second padded to 16 codes (8 bytes)
    codes = [list(range(16)) + [7, 15, 1, 9] + [0] * 12, [2] * 32]
    exp = _nvfp4(codes, [[1.0, 2.0], [0.5, 4.0]], 0.25)
    problems = []
    deq, scale = _dequantize("m.weight", "NVFP4", 16, exp, torch.zeros(2, 20), problems)
    assert problems == [] and deq.shape == scale.shape == (2, 20)
    assert torch.equal(scale[0], torch.tensor([0.25] * 16 + [0.5] * 4))
    assert torch.equal(scale[1], torch.tensor([0.125] * 16 + [1.0] * 4))
    assert torch.equal(deq[0], torch.cat([E2M1_VALUES * 0.25, torch.tensor([3.0, -3.0, 0.25, -0.25])]))
    assert torch.equal(deq[1], torch.tensor([0.125] * 16 + [1.0] * 4))


def test_nvfp4_packing_of_the_wrong_width_is_a_problem():
    problems = []
    exp = {"m.weight": torch.zeros(1, 8, dtype=torch.uint8)}
    assert _dequantize("m.weight", "NVFP4", 16, exp, torch.zeros(1, 20), problems) is None
    assert problems == ["m.weight has shape [1, 8], expected [1, 16] for the NVFP4 packing of the source shape [1, 20]"]


def test_nvfp4_bound_is_half_the_e2m1_step_at_each_value():
    # block scale 1, tensor scale 1: source 0.7 -> 0.5, 2.4 -> 2, 4.9 -> 4 are within half a step (0.25, 0.5, 1)
    w = torch.tensor([[0.7, 2.4, 4.9] + [0.0] * 13])
    exp = _nvfp4([[1, 4, 6] + [0] * 13], [[1.0]], 1.0)
    stats, problems = {}, []
    _check_bound("m.weight", "NVFP4", 16, exp, w, 1.0, stats, problems)
    assert problems == []
    assert stats["NVFP4"][1] == pytest.approx(0.9 / (1.0 + 4.9 / 256), rel=1e-5)
    # 1.9 -> 1.5 is 0.4 off, more than the 0.25 half step below 2 (0.4 would pass in [2, 4))
    w[0, 0] = 1.9
    exp = _nvfp4([[3, 4, 6] + [0] * 13], [[1.0]], 1.0)
    _check_bound("m.weight", "NVFP4", 16, exp, w, 1.0, stats, problems)
    assert problems == ["m.weight: 1 of 16 values exceed the NVFP4 error bound; first at [0, 0]: dequantized 1.5, "
                        "source 1.9, bound 0.257"]


def test_nan_scale_counts_as_a_violation():
    w = torch.ones(1, 16)
    exp = _nvfp4([[2] * 16], [[1.0]], float("nan"))
    stats, problems = {}, []
    _check_bound("m.weight", "NVFP4", 16, exp, w, 1.0, stats, problems)
    assert len(problems) == 1 and problems[0].startswith("m.weight: 16 of 16 values exceed the NVFP4 error bound")

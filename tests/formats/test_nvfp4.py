"""modelopt_ext.formats.nvfp4: NVFP4 fake quantization in plain torch, against hand values."""

import pytest
import torch

from modelopt_ext.formats.nvfp4 import fake_quantize_nvfp4

AMAX_UNIT_SCALE = 2688.0  # 6 x 448: the per-tensor scale is 1


def test_nvfp4_fake_quantization_by_hand():
    # amax 2688: per-tensor scale 1; block max 6 -> block scale 1: values round to the E2M1 grid
    x = torch.tensor([[6.0, 0.7, -1.3, 2.6, 5.2, 0.2, 0.0, -6.0] * 2])
    expected = torch.tensor([[6.0, 0.5, -1.5, 3.0, 6.0, 0.0, 0.0, -6.0] * 2])  # 0.7 -> 0.5, 2.6 -> 3, 5.2 -> 6
    assert torch.equal(fake_quantize_nvfp4(x, 2688.0), expected)
    # a block scale E4M3 holds exactly (0.5): the same grid, halved; a zero block stays zero
    assert torch.equal(fake_quantize_nvfp4(x / 2, 2688.0), expected / 2)
    assert not fake_quantize_nvfp4(torch.zeros(2, 16), 1.0).any()
    with pytest.raises(ValueError, match="multiple of 16"):
        fake_quantize_nvfp4(torch.ones(3, 8), 1.0)


def test_ties_round_to_the_even_e2m1_code():
    # midpoints: 0.25 (0 | 0.5), 0.75 (0.5 | 1), 1.25 (1 | 1.5), 2.5 (2 | 3), 3.5 (3 | 4), 5 (4 | 6)
    x = torch.tensor([[6.0, 2.5, 0.25, 0.75, -2.5, 5.0, -1.25, 3.5] + [0.0] * 8])
    expected = torch.tensor([[6.0, 2.0, 0.0, 1.0, -2.0, 4.0, -1.0, 4.0] + [0.0] * 8])
    assert torch.equal(fake_quantize_nvfp4(x, AMAX_UNIT_SCALE), expected)


def test_the_block_scale_is_rounded_to_e4m3_and_values_saturate_at_6():
    # block max 5: block scale 5/6 = 0.833 is stored as E4M3 0.8125; 5 / 0.8125 = 6.15 saturates at 6
    x = torch.tensor([[5.0, 1.0, -2.4] + [0.0] * 13])
    expected = torch.tensor([[6.0, 1.0, -3.0] + [0.0] * 13]) * 0.8125
    assert torch.equal(fake_quantize_nvfp4(x, AMAX_UNIT_SCALE), expected)


def test_each_block_of_16_has_its_own_scale():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 6.0, 0.75  # the second block's scale is 0.125: 0.75 is exact there (it would be 1 at scale 1)
    assert torch.equal(fake_quantize_nvfp4(x, AMAX_UNIT_SCALE), x)


def test_block_scales_clamp_at_448_so_values_above_amax_clip_to_amax():
    # amax 26.88: per-tensor scale 0.01; block max 60 asks for block scale 1000, clamped to 448 (4.48)
    x = torch.tensor([[60.0, -30.0, 1.0] + [0.0] * 13])
    out = fake_quantize_nvfp4(x, torch.tensor(26.88))
    assert out[0, :2].tolist() == pytest.approx([26.88, -26.88], rel=1e-6)
    assert not out[0, 2:].any()  # 1 / 4.48 = 0.22 rounds to 0


def test_shape_and_dtype_are_kept():
    x = torch.linspace(-3, 3, 2 * 3 * 32).reshape(2, 3, 32).to(torch.bfloat16)
    out = fake_quantize_nvfp4(x, 3.0)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 32)
    assert torch.equal(out.reshape(-1, 16), fake_quantize_nvfp4(x.reshape(-1, 16), 3.0))  # blocks along the last dim

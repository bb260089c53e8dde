"""models/kimi_k3/standin/inputs.py: image patches in the layout the stand-in's vision tower takes."""

from __future__ import annotations

import pytest
import torch

from modelopt_ext.models.kimi_k3.standin.inputs import image_to_patches, synthetic_image


def test_image_to_patches_is_row_major_by_patch():
    image = torch.arange(2 * 4 * 8, dtype=torch.float32).reshape(2, 4, 8)
    patches, grid = image_to_patches(image, 2)
    assert patches.shape == (8, 2, 2, 2) and grid.tolist() == [[1, 2, 4]]
    assert torch.equal(patches[0], image[:, 0:2, 0:2]) and torch.equal(patches[1], image[:, 0:2, 2:4])
    assert torch.equal(patches[4], image[:, 2:4, 0:2]) and torch.equal(patches[7], image[:, 2:4, 6:8])


def test_image_to_patches_refuses_a_size_the_merge_cannot_take():
    with pytest.raises(ValueError, match="image size 4x6 must be a multiple of 4"):
        image_to_patches(torch.zeros(3, 4, 6), 2)


def test_synthetic_images_are_deterministic_and_bounded():
    a, b = synthetic_image(8, 12, seed=1), synthetic_image(8, 12, seed=1)
    assert a.shape == (3, 8, 12) and torch.equal(a, b) and not torch.equal(a, synthetic_image(8, 12, seed=2))
    assert float(a.min()) >= -1 and float(a.max()) <= 1

"""Model inputs for the stand-in: image patches in the layout `KimiK3ForConditionalGeneration` takes.

Shapes: C channels, Hp x Wp pixels, p patch size, h x w patch grid, N = h * w patches (one frame, t = 1).
"""

from __future__ import annotations

import torch


def image_to_patches(image_CHW: torch.Tensor, patch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut an image into row-major patches.

    Args:
        image_CHW: [C, Hp, Wp], Hp and Wp multiples of 2 * patch_size (the 2x2 merge needs even grids).
    Returns:
        (pixel_values [N, C, p, p], grid_thw [1, 3] int64 = [[1, h, w]])
    """
    C, Hp, Wp = image_CHW.shape
    step = 2 * patch_size
    if Hp % step or Wp % step:
        raise ValueError(f"image size {Hp}x{Wp} must be a multiple of {step} (2 x patch_size {patch_size})")
    h, w = Hp // patch_size, Wp // patch_size
    patches = image_CHW.reshape(C, h, patch_size, w, patch_size).permute(1, 3, 0, 2, 4)
    return patches.reshape(h * w, C, patch_size, patch_size).contiguous(), torch.tensor([[1, h, w]])


def synthetic_image(height: int, width: int, seed: int = 0) -> torch.Tensor:
    """A deterministic [3, height, width] image in [-1, 1]: smooth gradients plus seeded noise."""
    g = torch.Generator().manual_seed(seed)
    ys = torch.linspace(-1, 1, height).view(1, height, 1)
    xs = torch.linspace(-1, 1, width).view(1, 1, width)
    base = torch.cat([ys.expand(1, height, width), xs.expand(1, height, width), (ys * xs).expand(1, height, width)])
    return (0.8 * base + 0.2 * torch.rand(3, height, width, generator=g) * 2 - 0.2).clamp(-1, 1)


def text_image_inputs(tokenizer, config, prompt: str, image_CHW: torch.Tensor) -> dict[str, torch.Tensor]:
    """input_ids with one image placeholder before `prompt`, plus pixel_values and grid_thws."""
    placeholder = tokenizer.convert_ids_to_tokens(config.media_placeholder_token_id)
    text = f"<|media_start|>image<|media_content|>{placeholder}<|media_end|>{prompt}"
    input_ids = torch.tensor([tokenizer.encode(text)])
    pixel_values, grid = image_to_patches(image_CHW, config.vision_config.patch_size)
    return {"input_ids": input_ids, "pixel_values": pixel_values, "grid_thws": grid}

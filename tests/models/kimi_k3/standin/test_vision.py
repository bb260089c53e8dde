"""The stand-in's vision tower and mm_projector: real checkpoint names and shapes, per-image attention, 2D rope,
sd2_tpool merge, the patchmergerv2 projector and refusals of the variants it does not implement."""

import pytest
import torch
import torch.nn.functional as F

from modelopt_ext.models.kimi_k3.standin import modeling_kimi_k3 as mk3
from modelopt_ext.models.kimi_k3.standin.configs import tiny_text_config
from modelopt_ext.models.kimi_k3.standin.configuration_kimi_k3 import (
    KimiK3Config,
    KimiK3VisionConfig,
    KimiLinearConfig,
)
from modelopt_ext.models.kimi_k3.standin.inputs import image_to_patches, synthetic_image

IMAGE_ID = 5
TINY_VISION = dict(
    vt_hidden_size=64, vt_intermediate_size=128, vt_num_hidden_layers=2, vt_num_attention_heads=4,
    qkv_hidden_size=96, mm_hidden_size=64, patch_size=14, init_pos_emb_height=16, init_pos_emb_width=16,
)


def _config(**vision_overrides) -> KimiK3Config:
    text = tiny_text_config(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = {**TINY_VISION, "text_hidden_size": text.hidden_size, **vision_overrides}
    return KimiK3Config(text_config=text, vision_config=vision, media_placeholder_token_id=IMAGE_ID, pad_token_id=0)


def _expected_shapes(D, I, Q, layers, p, H0, W0, merged, H) -> dict[str, tuple[int, ...]]:
    """The real checkpoint's vision / projector tensors as functions of the config (no biases anywhere)."""
    shapes = {
        "vision_tower.patch_embed.proj.weight": (D, 3, p, p),
        "vision_tower.patch_embed.pos_emb.weight": (H0, W0, D),
        "vision_tower.encoder.final_layernorm.weight": (D,),
        "mm_projector.proj.0.weight": (merged, merged),
        "mm_projector.proj.2.weight": (H, merged),
        "mm_projector.post_norm.weight": (H,),
    }
    for i in range(layers):
        b = f"vision_tower.encoder.blocks.{i}."
        shapes.update({
            b + "norm0.weight": (D,), b + "norm1.weight": (D,),
            b + "wqkv.weight": (3 * Q, D), b + "wo.weight": (D, Q),
            b + "mlp.fc0.weight": (I, D), b + "mlp.fc1.weight": (D, I),
        })
    return shapes


def _vision_shapes(model) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith("language_model.")}


def _randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """O(1) activations everywhere: norms near 1, matrices at 1/sqrt(fan_in), a strong position table."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.1 * r)
            elif name.endswith("pos_emb.weight"):
                p.copy_(0.5 * r)
            elif p.ndim > 1:
                p.copy_(r * p.shape[1:].numel() ** -0.5)
    return model.eval()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return _randomize(mk3.KimiK3ForConditionalGeneration(_config()))


def _patches(height: int, width: int, seed: int, t: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values [t*h*w, 3, 14, 14] (frame-major) and grid_thws [[t, h, w]] of seeded synthetic frames."""
    frames = [image_to_patches(synthetic_image(height, width, seed + i), 14) for i in range(t)]
    grid = frames[0][1].clone()
    grid[0, 0] = t
    return torch.cat([f[0] for f in frames]), grid


# ----------------------------------------------------------------------------------------------------
# Names and shapes


def test_tiny_state_dict_is_the_real_layout(model):
    cfg = model.config
    expected = _expected_shapes(D=64, I=128, Q=96, layers=2, p=14, H0=16, W0=16, merged=64 * 2 * 2,
                                H=cfg.text_config.hidden_size)
    assert _vision_shapes(model) == expected
    # nothing else hides in the vision modules (the rope table and the time embedding are never stored)
    assert not [k for k, _ in model.vision_tower.named_buffers()] + [k for k, _ in model.mm_projector.named_buffers()]


def test_full_size_vision_and_projector_shapes_on_meta():
    """The published Kimi-K3 tensor index: the config classes' defaults give the real sizes."""
    config = KimiK3Config(text_config=KimiLinearConfig(), vision_config=KimiK3VisionConfig())
    with torch.device("meta"):
        modules = {"vision_tower": mk3.KimiVisionTower(config.vision_config), "mm_projector": mk3.KimiMMProjector(config)}
    got = {f"{prefix}.{k}": tuple(v.shape) for prefix, m in modules.items() for k, v in m.state_dict().items()}
    assert got == _expected_shapes(D=1024, I=4096, Q=1536, layers=27, p=14, H0=64, W0=64, merged=4096, H=7168)
    assert got["mm_projector.proj.2.weight"] == (7168, 4096)
    assert got["vision_tower.encoder.blocks.26.wqkv.weight"] == (4608, 1024)


def test_full_size_layout_equals_the_real_inventory():
    """Names and shapes against the table derived from the published checkpoint (real_inventory.json)."""
    from modelopt_ext.models.kimi_k3.inventory import VISION_BLOCK_PREFIX, load_real_inventory

    inv = load_real_inventory()
    real = {k: tuple(v[0]) for k, v in inv["model"].items() if k.startswith(("vision_tower.", "mm_projector."))}
    for b in range(inv["config"]["vision_config"]["vt_num_hidden_layers"]):
        real.update({f"{VISION_BLOCK_PREFIX}{b}.{leaf}": tuple(v[0]) for leaf, v in inv["vision_block"].items()})
    config = KimiK3Config(text_config=KimiLinearConfig(), vision_config=KimiK3VisionConfig())
    with torch.device("meta"):
        modules = {"vision_tower": mk3.KimiVisionTower(config.vision_config), "mm_projector": mk3.KimiMMProjector(config)}
    assert {f"{prefix}.{k}": tuple(v.shape) for prefix, m in modules.items() for k, v in m.state_dict().items()} == real


def test_layernorm_and_bias_switches():
    cfg = _config(norm_type="layernorm", attn_bias=True, linear_bias=True, patch_embed_proj_bias=True)
    keys = set(mk3.KimiK3ForConditionalGeneration(cfg).state_dict())
    for name in ("patch_embed.proj", "encoder.blocks.1.norm0", "encoder.blocks.1.wqkv", "encoder.blocks.1.wo",
                 "encoder.blocks.1.mlp.fc0", "encoder.final_layernorm"):
        assert f"vision_tower.{name}.bias" in keys
    assert not any(k.startswith("mm_projector.") and k.endswith(".bias") for k in keys)


def test_init_weights_are_sane():
    torch.manual_seed(0)
    m = mk3.KimiK3ForConditionalGeneration(_config())
    pos = m.vision_tower.patch_embed.pos_emb.weight
    assert 0.015 < pos.std().item() < 0.025 and abs(pos.mean().item()) < 0.005
    assert torch.equal(m.vision_tower.encoder.blocks[0].norm0.weight, torch.ones(64))
    assert torch.equal(m.mm_projector.post_norm.weight, torch.ones(m.config.text_config.hidden_size))
    assert m.mm_projector.post_norm.eps == 1e-5 and m.vision_tower.encoder.final_layernorm.eps is None


# ----------------------------------------------------------------------------------------------------
# Forward


def test_text_and_image_forward_is_finite_and_sees_the_image(model):
    pixel_values, grid = _patches(56, 84, seed=1)
    assert grid.tolist() == [[1, 4, 6]]
    ids = torch.tensor([[1, 9, IMAGE_ID, 10, 11, 12]])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixel_values, grid_thws=grid, use_cache=False).logits
        other = model(input_ids=ids, pixel_values=-pixel_values, grid_thws=grid, use_cache=False).logits
    assert logits.shape == (1, ids.shape[1] - 1 + 2 * 3, model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()
    assert (other[0, -1] - logits[0, -1]).abs().max() > 1e-3


def _rotate(x_NAd, h, w):
    """2D rope written out: pair j of the head dim turns by (col if j even else row) * 10000^(-4 (j // 2) / d)."""
    d = x_NAd.shape[-1]
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    j = torch.arange(d // 2)
    pos = torch.where(j % 2 == 0, cols.reshape(-1, 1), rows.reshape(-1, 1)).float()  # [N, d/2]
    angle = (pos * 10000.0 ** (-4 * (j // 2) / d))[:, None, :]
    a, b = x_NAd[..., 0::2], x_NAd[..., 1::2]
    return torch.stack([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], dim=-1).flatten(-2)


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_image_features_follow_the_upstream_math(model):
    """patch embed + resized pos table -> blocks (rope attention, GELU-tanh MLP) -> final norm -> 2x2 cells ->
    Linear, GELU, Linear -> RMSNorm, written out with plain tensor ops."""
    vt, proj = model.vision_tower, model.mm_projector
    pixel_values, grid = _patches(28, 56, seed=2)
    h, w = grid[0, 1:].tolist()
    eps = torch.finfo(torch.float32).eps
    x = F.conv2d(pixel_values, vt.patch_embed.proj.weight, stride=14).flatten(1)
    table = vt.patch_embed.pos_emb.weight.permute(2, 0, 1)[None]
    x = x + F.interpolate(table, size=(h, w), mode="bilinear")[0].permute(1, 2, 0).reshape(h * w, -1)
    for block in vt.encoder.blocks:
        q, k, v = (block.wqkv.weight @ _rms(x, block.norm0.weight, eps).T).T.view(h * w, 3, 4, 24).unbind(1)
        q, k = _rotate(q, h, w), _rotate(k, h, w)
        scores = torch.einsum("nad,mad->anm", q, k) / 24**0.5
        attn = torch.einsum("anm,mad->nad", scores.softmax(-1), v).reshape(h * w, 96)
        x = x + attn @ block.wo.weight.T
        hidden = F.gelu(_rms(x, block.norm1.weight, eps) @ block.mlp.fc0.weight.T, approximate="tanh")
        x = x + hidden @ block.mlp.fc1.weight.T
    x = _rms(x, vt.encoder.final_layernorm.weight, eps)
    x = x.view(h // 2, 2, w // 2, 2, -1).permute(0, 2, 1, 3, 4).reshape(-1, 4 * 64)
    expected = _rms(F.gelu(x @ proj.proj[0].weight.T) @ proj.proj[2].weight.T, proj.post_norm.weight, 1e-5)
    with torch.no_grad():
        (got,) = model.get_image_features(pixel_values, grid)
    torch.testing.assert_close(got, expected.detach(), atol=1e-5, rtol=1e-5)


def test_multi_image_batch_equals_images_run_separately(model):
    """Attention stays within each image: a packed batch of three grids equals three separate runs."""
    images = [_patches(28, 56, seed=3), _patches(56, 28, seed=4), _patches(28, 28, seed=5, t=2)]
    with torch.no_grad():
        packed = model.get_image_features(torch.cat([p for p, _ in images]), torch.cat([g for _, g in images]))
        alone = [model.get_image_features(p, g)[0] for p, g in images]
    assert [f.shape[0] for f in packed] == [2, 2, 1]
    for a, b in zip(packed, alone):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # and the batch is not trivially constant: different images give different features
    assert (alone[0] - alone[1]).abs().max() > 1e-3


def test_merged_batch_places_each_image_at_its_placeholder(model):
    (p0, g0), (p1, g1) = _patches(28, 56, seed=6), _patches(56, 56, seed=7)
    ids = torch.tensor([[IMAGE_ID, 9, 10], [11, IMAGE_ID, 12]])
    embeds = model.get_input_embeddings()(ids)
    with torch.no_grad():
        feats = model.get_image_features(torch.cat([p0, p1]), torch.cat([g0, g1]))
        merged, mask = model._merge_with_image_features(ids, embeds, None, feats)
    assert merged.shape[1] == max(2 + 2, 2 + 4) and mask.tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6]
    torch.testing.assert_close(merged[0, :2], feats[0])
    torch.testing.assert_close(merged[1, 1:5], feats[1])


def _encode(encoder, x_ND, grid):
    with torch.no_grad():
        return encoder(x_ND, grid)


def test_rope_makes_features_depend_on_patch_position(model, monkeypatch):
    """Without the position table, only the 2D rope tells patches apart: permuting the patches must change
    the features, not just permute them (as it would without rope; checked as the control)."""
    encoder = model.vision_tower.encoder
    grid = [(1, 4, 6)]
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(8))
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(9))
    out, out_perm = _encode(encoder, x, grid), _encode(encoder, x[perm], grid)
    assert (out[perm] - out_perm).abs().max() > 1e-2
    monkeypatch.setattr(encoder.rope_2d, "forward", lambda g, device=None: torch.ones(24, 12, dtype=torch.complex64))
    torch.testing.assert_close(_encode(encoder, x, grid)[perm], _encode(encoder, x[perm], grid), atol=1e-5, rtol=1e-5)


def test_rope_2d_rotates_pairs_by_column_and_row():
    rope = mk3.KimiVisionRope2D(head_dim=8)
    freqs = rope([(1, 3, 5)])  # [15, 4]: pairs (col f0, row f0, col f1, row f1), f_i = 10000^(-4i/8)
    angles = freqs.angle().view(3, 5, 2, 2)
    rows, cols = torch.meshgrid(torch.arange(3.0), torch.arange(5.0), indexing="ij")
    for i, f in enumerate([1.0, 0.01]):
        torch.testing.assert_close(angles[..., i, 0], torch.remainder(cols * f + torch.pi, 2 * torch.pi) - torch.pi)
        torch.testing.assert_close(angles[..., i, 1], torch.remainder(rows * f + torch.pi, 2 * torch.pi) - torch.pi)
    # frames of one image share positions
    torch.testing.assert_close(rope([(2, 3, 5)]), freqs.repeat(2, 1))


def test_rope_scores_depend_only_on_the_2d_offset():
    rope = mk3.KimiVisionRope2D(head_dim=16)
    freqs = rope([(1, 6, 6)]).view(6, 6, -1)
    g = torch.Generator().manual_seed(10)
    q, k = torch.randn(1, 1, 16, generator=g), torch.randn(1, 1, 16, generator=g)

    def score(a, b):
        qa = mk3.apply_rope_2d(q, freqs[a][None])
        kb = mk3.apply_rope_2d(k, freqs[b][None])
        return (qa * kb).sum()

    torch.testing.assert_close(score((1, 2), (3, 1)), score((2, 4), (4, 3)))
    assert (score((1, 2), (3, 1)) - score((1, 2), (1, 3))).abs() > 1e-3  # row and column offsets differ


def test_pos_emb_resizes_bilinearly_and_adds_time_for_frames(model):
    pos_emb = model.vision_tower.patch_embed.pos_emb
    table = pos_emb.weight.detach()
    x = torch.zeros(16 * 16, 64)
    torch.testing.assert_close(pos_emb(x, [(1, 16, 16)]), table.reshape(256, 64))  # native size: as stored
    small = pos_emb(torch.zeros(12, 64), [(1, 3, 4)])
    ref = F.interpolate(table.permute(2, 0, 1)[None], size=(3, 4), mode="bilinear")[0].permute(1, 2, 0)
    torch.testing.assert_close(small, ref.reshape(12, 64))
    two = pos_emb(torch.zeros(24, 64), [(2, 3, 4)])
    time = mk3.sincos_1d(64, 2)
    torch.testing.assert_close(two.view(2, 12, 64), ref.reshape(1, 12, 64) + time[:, None, :])
    assert torch.equal(time[0], torch.cat([torch.zeros(32), torch.ones(32)]))


def test_tpool_merge_averages_frames_then_groups_2x2():
    x = torch.arange(2 * 2 * 4 * 1, dtype=torch.float32).view(-1, 1)  # t=2, h=2, w=4, D=1
    (cells,) = mk3.tpool_merge(x, [(2, 2, 4)], [2, 2])
    frame_mean = x.view(2, 2, 4).mean(0)
    assert cells.shape == (2, 4, 1)
    assert cells[:, :, 0].tolist() == [frame_mean[:, 0:2].flatten().tolist(), frame_mean[:, 2:4].flatten().tolist()]


# ----------------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize("key, value, supported", [
    ("mm_projector_type", "mlp", "patchmergerv2"),
    ("merge_type", "sd2", "sd2_tpool"),
    ("norm_type", "batchnorm", "rmsnorm"),
    ("mlp_type", "swiglu", "mlp2"),
    ("pos_emb_type", "rope_only", "divided_fixed"),
])
def test_unsupported_variants_are_refused(key, value, supported):
    with pytest.raises(ValueError, match=rf"vision_config\.{key} = '{value}' is not supported.*'{supported}'"):
        mk3.KimiK3ForConditionalGeneration(_config(**{key: value}))


def test_text_width_mismatch_is_refused():
    with pytest.raises(ValueError, match=r"text_hidden_size = 48 differs from text_config.hidden_size = 32"):
        mk3.KimiK3ForConditionalGeneration(_config(text_hidden_size=48))


def test_bad_grids_are_refused(model):
    pixel_values, grid = _patches(28, 56, seed=11)
    with pytest.raises(ValueError, match=r"grid_thws must be \[num_images, 3\]"):
        model.get_image_features(pixel_values, grid[:, 1:])  # the old (h, w) convention
    with pytest.raises(ValueError, match=r"pixel_values \(8, 3, 14, 14\) must be \[16, 3, 14, 14\]"):
        model.get_image_features(pixel_values, torch.tensor([[2, 2, 4]]))
    with pytest.raises(ValueError, match=r"h % 2 == 0 and w % 2 == 0"):
        model.get_image_features(pixel_values[:6], torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="exceeds vision_config.init_pos_emb_time = 4"):
        model.get_image_features(torch.cat([pixel_values] * 5), torch.tensor([[5, 2, 4]]))

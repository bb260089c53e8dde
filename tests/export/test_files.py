"""Tests for modelopt_ext.export.files: the rank-independent file layout of an export."""

from __future__ import annotations

import pytest

from modelopt_ext.export.files import ExportFiles, check_experts_per_file, default_experts_per_file, expert_key_renamer

LAYERS = "language_model.model.layers"


def _files(per_file=4) -> ExportFiles:
    return ExportFiles(LAYERS, num_layers=3, moe_layers=(1, 2), experts_suffix="block_sparse_moe.experts",
                       num_experts=16, experts_per_file=per_file)


def test_default_experts_per_file():
    assert default_experts_per_file(896) == 14  # Kimi-K3: one file per EP64 rank and layer
    assert default_experts_per_file(16) == 1
    assert default_experts_per_file(384) == 6


def test_layout_numbers_files_in_model_order():
    f = _files()
    assert f.count == 1 + 3 + 2 * 4
    assert f.rest_file() == "model-00001-of-00012.safetensors"
    assert f.dense_file(0) == "model-00002-of-00012.safetensors"
    assert f.dense_file(1) == "model-00003-of-00012.safetensors"
    assert [f.experts_file(1, e) for e in (0, 3, 4, 15)] == [
        "model-00004-of-00012.safetensors", "model-00004-of-00012.safetensors",
        "model-00005-of-00012.safetensors", "model-00007-of-00012.safetensors"]
    assert f.dense_file(2) == "model-00008-of-00012.safetensors"
    assert f.experts_file(2, 15) == "model-00012-of-00012.safetensors"
    with pytest.raises(ValueError, match="layer 0 has no routed experts"):
        f.experts_file(0, 1)


def test_file_of_routes_tensor_names():
    f = _files()
    assert f.file_of("language_model.model.embed_tokens.weight") == f.rest_file()
    assert f.file_of("vision_tower.patch_embed.weight") == f.rest_file()
    assert f.file_of(f"{LAYERS}.1.self_attn.o_proj.weight") == f.dense_file(1)
    assert f.file_of(f"{LAYERS}.1.block_sparse_moe.gate.weight") == f.dense_file(1)
    assert f.file_of(f"{LAYERS}.2.block_sparse_moe.experts.9.w2.weight_scale") == f.experts_file(2, 9)
    # the shared experts are dense tensors of their layer
    assert f.file_of(f"{LAYERS}.2.block_sparse_moe.shared_experts.down_proj.weight") == f.dense_file(2)


def test_carried_layers_take_the_last_file():
    """Source layers the model does not build (DeepSeek-V3's MTP layer, index num_layers) go to one last file,
    written by the rank `dense_writer(num_layers)` names; without them, a key past the layers is an error."""
    import dataclasses

    f = dataclasses.replace(_files(), carried=1)
    assert f.count == 1 + 3 + 2 * 4 + 1 and f.carried_file() == "model-00013-of-00013.safetensors"
    assert f.file_of(f"{LAYERS}.3.block_sparse_moe.experts.9.w2.weight") == f.carried_file()
    assert f.file_of(f"{LAYERS}.2.block_sparse_moe.experts.15.w2.weight") == "model-00012-of-00013.safetensors"
    assert f.dense_writer(3, 2) == 0
    with pytest.raises(ValueError, match="carries no source layers"):
        _files().file_of(f"{LAYERS}.3.self_attn.o_proj.weight")


def test_dense_files_are_spread_over_ranks():
    f = _files()
    assert f.dense_writer(None, 4) == 0
    assert [f.dense_writer(i, 4) for i in range(3)] == [1, 2, 3]
    assert [f.dense_writer(i, 1) for i in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("ep, per_file, ok", [(1, None, True), (16, None, True), (4, 4, True), (8, 4, False),
                                              (2, 3, False), (1, 0, False), (3, None, False)])
def test_check_experts_per_file(ep, per_file, ok):
    if ok:
        assert check_experts_per_file(16, ep, per_file) == (per_file or 1)
    else:
        with pytest.raises(ValueError, match="experts per|does not divide"):
            check_experts_per_file(16, ep, per_file)


def test_expert_renamer_maps_local_ids_and_projection_names():
    rename = expert_key_renamer("block_sparse_moe.experts", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})
    base = f"{LAYERS}.3.block_sparse_moe.experts"
    assert rename(f"{base}.2.gate_proj.weight", 8) == f"{base}.10.w1.weight"
    assert rename(f"{base}.0.up_proj.weight_scale_2", 0) == f"{base}.0.w3.weight_scale_2"
    assert rename(f"{base}.7.down_proj.input_scale", 8) == f"{base}.15.w2.input_scale"
    assert rename(f"{LAYERS}.3.self_attn.o_proj.weight", 8) == f"{LAYERS}.3.self_attn.o_proj.weight"

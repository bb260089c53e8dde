"""modelopt_ext.export.expert_inputs: every routed expert's input scale from its own calibration rows (the
layer's shared scale where it saw none), checked against the experts' inputs recorded independently on the
unquantized model; the grouped statistics path records the same; "shared" keeps ModelOpt's export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import modelopt_ext
from modelopt_ext.testing.checkpoints import copy_checkpoint
from modelopt_ext.testing.export_edits import read_index, shard_of
from modelopt_ext.testing.multiproc import import_file
from modelopt_ext.testing.routing import force_routing

bodies = import_file(Path(__file__).with_name("bodies.py"))
calibrate_and_export, calibration_batches = bodies.calibrate_and_export, bodies.calibration_batches

RECIPE = "kimi_k3/nvfp4_experts-fp8_attention"
EXPERTS = "language_model.model.layers.{layer}.block_sparse_moe.experts"
MOE_LAYERS = (1, 2, 3, 4, 5)
NVFP4_INPUT = 6.0 * 448.0  # input_scale = amax / (6 x 448)


def _get(directory, key: str) -> torch.Tensor:
    with safe_open(str(shard_of(directory, key)), framework="pt") as f:
        return f.get_tensor(key)


def _reference_amax(ckpt, force_experts=None) -> dict[int, torch.Tensor]:
    """layer -> [2, E]: each expert's max |input| of gate_up and of down over the calibration batches, from
    hooks on the unquantized model (the experts' own forward inputs; the down input recomputed from them)."""
    model = modelopt_ext.from_pretrained(str(ckpt), trust_remote_code=True, dtype=torch.float32)
    if force_experts is not None:
        force_routing(model, force_experts)
    out: dict[int, torch.Tensor] = {}

    def hook(layer):
        def record(module, args, kwargs):
            x, ids = args[0], args[1]
            amax = out.setdefault(layer, torch.full((2, module.num_experts), float("-inf")))
            with module.materialized(x.dtype):
                for e in range(module.num_experts):
                    rows = x[(ids == e).any(dim=-1)]
                    if rows.shape[0]:
                        h = module._apply_gate(rows @ module.gate_up_proj[e].t())
                        amax[0, e] = max(amax[0, e], rows.abs().max())
                        amax[1, e] = max(amax[1, e], h.abs().max())
        return record

    for layer in MOE_LAYERS:
        module = model.get_submodule(EXPERTS.format(layer=layer))
        module.register_forward_pre_hook(hook(layer), with_kwargs=True)
    with torch.no_grad():
        for batch in calibration_batches(0, 1, 2):
            model(**batch, use_cache=False)
    return out


@pytest.fixture(scope="module")
def source(tiny_ckpt, tmp_path_factory):
    return copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("expert_inputs"), "src")


def _scales(export, layer: int) -> torch.Tensor:
    """[3, E] exported input scales of w1, w3, w2."""
    experts = EXPERTS.format(layer=layer)
    return torch.stack([torch.stack([_get(export, f"{experts}.{e}.{w}.input_scale").reshape(()) for e in range(16)])
                        for w in ("w1", "w3", "w2")])


@pytest.mark.parametrize("grouped_statistics", ["never", "always"])
def test_each_expert_gets_the_scale_of_its_own_inputs(source, tmp_path, grouped_statistics):
    """The eager per-expert loop and the grouped statistics path (offs_E rows) both record each expert's inputs:
    its exported scale is its own amax / 2688, w1 and w3 share it, and the max over experts is the layer's."""
    reference = _reference_amax(source)
    result = calibrate_and_export(0, 1, str(source), str(tmp_path / "out"), RECIPE, batches=2,
                                  expert_input_scales="per-expert", grouped_statistics=grouped_statistics)
    seen = {layer: torch.isfinite(reference[layer][0]) for layer in MOE_LAYERS}
    assert result.expert_inputs_own == 2 * sum(int(s.sum()) for s in seen.values())
    assert result.expert_inputs_shared == tuple(sorted(
        f"{EXPERTS.format(layer=layer)}.{e}.{p}" for layer in MOE_LAYERS for e in range(16) if not seen[layer][e]
        for p in ("gate_up_proj", "down_proj")))
    for layer in MOE_LAYERS:
        scales, s = _scales(tmp_path / "out", layer), seen[layer]
        expected = reference[layer] / NVFP4_INPUT
        torch.testing.assert_close(scales[0, s], expected[0, s], rtol=1e-6, atol=0)
        # the down input is recomputed here from a GEMM over other row counts (BLAS rounds a few ulps apart)
        torch.testing.assert_close(scales[2, s], expected[1, s], rtol=1e-5, atol=0)
        assert torch.equal(scales[0, ~s], scales[0].max().expand(int((~s).sum())))
        assert torch.equal(scales[0], scales[1])
        assert len(set(scales[0].tolist())) > 1  # not one shared value


def test_experts_without_tokens_keep_the_layers_scale_and_shared_mode_is_modelopts(source, tmp_path):
    """Routing forced onto experts 0..3 (top-k 4): experts 4..15 saw no row and keep the shared scale (the max
    over 0..3), named in the result; "shared" writes that one scale for every expert."""
    from modelopt_ext.export.writer import export_checkpoint
    from modelopt_ext.families import families
    from modelopt_ext.quant.calibrate import calibrate
    from modelopt_ext.quant.recipes import quant_config

    covered = list(range(4))
    reference = _reference_amax(source, covered)

    def export(mode: str):  # the export consumes the calibrated model (ModelOpt's handlers split the experts)
        model = modelopt_ext.from_pretrained(str(source), trust_remote_code=True, dtype=torch.float32)
        force_routing(model, covered)
        result = calibrate(model, quant_config(RECIPE, model.config), calibration_batches(0, 1, 2),
                           router_glob=families()["kimi_k3"].router_glob, num_experts=16)
        return export_checkpoint(result.model, tmp_path / mode, source_dir=source, expert_input_scales=mode)

    own, shared = export("per-expert"), export("shared")
    assert own.expert_inputs_own == len(MOE_LAYERS) * 4 * 2
    assert len(own.expert_inputs_shared) == len(MOE_LAYERS) * 12 * 2
    assert EXPERTS.format(layer=3) + ".12.down_proj" in own.expert_inputs_shared
    assert shared.expert_inputs_own == 0
    for layer in MOE_LAYERS:
        mine, theirs = _scales(tmp_path / "per-expert", layer), _scales(tmp_path / "shared", layer)
        torch.testing.assert_close(mine[0, :4], reference[layer][0, :4] / NVFP4_INPUT, rtol=1e-6, atol=0)
        for w in range(3):
            assert len(set(theirs[w].tolist())) == 1  # ModelOpt's: one scale per layer and projection
            assert torch.equal(mine[w, 4:], theirs[w, 4:])  # no token: the layer's scale
            assert mine[w].max() == theirs[w, 0]
    keys = set(read_index(tmp_path / "per-expert")["weight_map"])
    assert keys == set(read_index(tmp_path / "shared")["weight_map"])


def test_an_unknown_mode_is_refused(tmp_path):
    from modelopt_ext.export.writer import export_checkpoint

    with pytest.raises(ValueError, match="expert_input_scales is 'per_expert'; expected one of"):
        export_checkpoint(torch.nn.Module(), tmp_path / "x", source_dir=tmp_path, expert_input_scales="per_expert")

"""modelopt_ext.export.exact_cast and its use by the exporter: routed experts stored MXFP4 are exported as
NVFP4 with the same codes and block scales that multiply out to the source's (bit-exact after dequantizing);
an expert whose scale range E4M3 cannot hold under one per-tensor scale keeps ModelOpt's calibrated
quantization, and is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from modelopt_ext.export.exact_cast import Nvfp4, cast_pair, dequantize_nvfp4
from modelopt_ext.formats.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from modelopt_ext.testing.checkpoints import copy_checkpoint
from modelopt_ext.testing.export_edits import read_index, rewrite, shard_of
from modelopt_ext.testing.multiproc import import_file

calibrate_and_export = import_file(Path(__file__).with_name("bodies.py")).calibrate_and_export

EXPERTS = "language_model.model.layers.{layer}.block_sparse_moe.experts"


def _mx(rows=32, cols=64, seed=0, spread=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) / 9
    w = w * torch.exp2(torch.randint(-spread, spread + 1, (rows, 1), generator=g).float()) if spread else w
    return quantize_mxfp4(w)


def test_cast_is_bit_exact_and_shares_the_per_tensor_scale():
    (p1, s1), (p3, s3) = _mx(seed=1, spread=3), _mx(seed=2, spread=3)
    w1, w3 = cast_pair([(p1, s1), (p3, s3)])
    for (p, s), w in (((p1, s1), w1), ((p3, s3), w3)):
        assert torch.equal(w.weight, p)  # the 4-bit codes, byte for byte
        assert w.weight_scale.dtype == torch.float8_e4m3fn and w.weight_scale.shape == (32, 64 // 16)
        assert torch.equal(dequantize_nvfp4(w), dequantize_mxfp4(p, s, torch.float32))
    assert w1.weight_scale_2 == w3.weight_scale_2 and w1.weight_scale_2.dtype == torch.float32


def test_scale_range_limits():
    """17 binades between the smallest and largest used block scale: exact (2^-9 ... 2^8 in E4M3); 18: not."""
    p, s = _mx()
    wide = s.clone()
    wide[0, 0], wide[1, 0] = 127 + 8, 127 - 9
    (w,) = cast_pair([(p, wide)])
    assert torch.equal(dequantize_nvfp4(w), dequantize_mxfp4(p, wide, torch.float32))
    assert float(w.weight_scale.float().min()) == 2.0**-9 and float(w.weight_scale.float().max()) == 2.0**8
    wide[1, 0] = 127 - 10
    assert cast_pair([(p, wide)]) is None
    # a group of zero codes takes any scale: its extreme E8M0 byte does not count
    zeroed = p.clone()
    zeroed[1, :16] = 0
    (w,) = cast_pair([(zeroed, wide)])
    assert torch.equal(dequantize_nvfp4(w), dequantize_mxfp4(zeroed, wide, torch.float32))


def test_all_zero_weight():
    p, s = _mx()
    (w,) = cast_pair([(torch.zeros_like(p), s)])
    assert float(w.weight_scale_2) == 1.0 and not dequantize_nvfp4(w).any()


def _export(source: Path, out: Path):
    return calibrate_and_export(0, 1, str(source), str(out), "kimi_k3/nvfp4_experts-fp8_attention", batches=2)


def _get(directory: Path, key: str) -> torch.Tensor:
    with safe_open(str(shard_of(directory, key)), framework="pt") as f:
        return f.get_tensor(key)


@pytest.fixture(scope="module")
def planted(tiny_ckpt, tmp_path_factory):
    """The stand-in with one expert's w3 scales spread over 20 binades (layer 2, expert 5), exported."""
    root = tmp_path_factory.mktemp("exact_cast")
    source = copy_checkpoint(tiny_ckpt, root, "exact_src")
    key = EXPERTS.format(layer=2) + ".5.w3.weight_scale"

    def widen(tensors):
        scale = tensors[key].clone()
        scale[0, 0], scale[1, 0] = 127 + 4, 127 - 16
        tensors[key] = scale

    rewrite(shard_of(source, key), widen)
    return source, root / "export", _export(source, root / "export")


def test_export_carries_the_source_codes_and_values(planted):
    source, export, result = planted
    experts = EXPERTS.format(layer=1)
    for e in (0, 7, 15):
        for w in ("w1", "w2", "w3"):
            packed, scale = _get(source, f"{experts}.{e}.{w}.weight_packed"), _get(source, f"{experts}.{e}.{w}.weight_scale")
            assert torch.equal(_get(export, f"{experts}.{e}.{w}.weight"), packed)
            exported = Nvfp4(*(_get(export, f"{experts}.{e}.{w}.{leaf}") for leaf in
                               ("weight", "weight_scale", "weight_scale_2")))
            assert torch.equal(dequantize_nvfp4(exported), dequantize_mxfp4(packed, scale, torch.float32))
        assert torch.equal(_get(export, f"{experts}.{e}.w1.weight_scale_2"), _get(export, f"{experts}.{e}.w3.weight_scale_2"))
    # every expert of every layer but the planted one: 5 MoE layers x 16 experts x 3 weights, minus w1/w3 of one
    assert result.experts_exact == 5 * 16 * 3 - 2
    assert result.experts_requantized == (EXPERTS.format(layer=2) + ".5.w1/w3",)


def test_the_planted_expert_takes_modelopts_quantization_and_still_verifies(planted):
    """The one re-quantized pair is the export's only NVFP4 error, within the format's bound; its w1 and w3
    still share one weight_scale_2 (ModelOpt syncs them)."""
    from modelopt_ext.export.verify import verify_export

    source, export, _ = planted
    report = verify_export(export, source)
    assert 0 < report.max_rel_error["NVFP4"] and report.max_bound_ratio["NVFP4"] <= 1.0
    pair = EXPERTS.format(layer=2) + ".5"
    assert torch.equal(_get(export, f"{pair}.w1.weight_scale_2"), _get(export, f"{pair}.w3.weight_scale_2"))
    assert f"{pair}.w3.weight_scale_2" in read_index(export)["weight_map"]


def test_calibration_free_recipe_reproduces_the_baseline(tiny_ckpt, tmp_path):
    """`kimi_k3/calibration_free` through `modelopt-ext ptq`: NVIDIA's converter's output from this tool.
    Every expert's input_scale is 1.0, the expert weights are the exact cast, the attention FP8 blocks come
    from the weights alone, and every engine's rules hold."""
    from modelopt_ext.cli import main
    from modelopt_ext.export.verify import verify_export

    source = copy_checkpoint(tiny_ckpt, tmp_path, "calibration_free")
    out = tmp_path / "out"
    argv = ["ptq", "--model", str(source), "--export-dir", str(out), "--no-progress", "--dtype", "float32",
            "--calib-size", "2", "--batch-size", "2", "--seq-len", "16", "--recipe", "kimi_k3/calibration_free"]
    assert main(argv) == 0
    scales = [float(_get(out, k)) for k in read_index(out)["weight_map"] if ".experts." in k and
              k.endswith(".input_scale")]
    assert len(scales) == 5 * 16 * 3 and set(scales) == {1.0}
    report = verify_export(out, source)
    assert report.max_rel_error["NVFP4"] == 0 and report.quantized["FP8_PB_WO"] == 40

"""bf16 (ptq's default dtype) through EP calibration and the exporter: EP2 exports what one process exports.

Measured on the stand-in (docs/export.md, "bf16"): while the EP combine weighted bf16 slots with one batched
GEMM (routing weights rounded to bf16), 64 of 240 input scales differed between EP1 and EP2 here (the w1/w3
and w2 input scales of MoE layers 4 and 5), by up to 0.95% relative; weights and weight scales never did.
With the combine summing in fp32 in slot order like the one-process reference, nothing differs at EP 2, 4 or 8
(also at 64 calibration blocks of 4 x 128 tokens through `ptq`), so the bound is 0: the whole export, every
file, is byte-identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modelopt_ext.testing.checkpoints import copy_checkpoint
from modelopt_ext.testing.multiproc import import_file, run_ranks

# the per-rank body shared by the export tests
calibrate_and_export = import_file(Path(__file__).parents[1] / "export" / "bodies.py").calibrate_and_export

PRODUCTION = "kimi_k3/nvfp4_experts-fp8_attention"
# Largest relative difference allowed between EP1's and EP2's input scales: measured 0 since the combine sums in
# fp32 in slot order (0.95% before), so any difference is a regression of the EP arithmetic.
INPUT_SCALE_BOUND = 0.0


def _tensors(export: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(export.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def _differences(a: Path, b: Path) -> tuple[list[str], float]:
    """Names of the tensors whose bytes differ, and the largest relative difference of the input scales."""
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    differing, worst = [], 0.0
    for name in sorted(ta):
        x, y = ta[name], tb[name]
        if x.dtype != y.dtype or x.shape != y.shape or x.reshape(-1).view(torch.uint8).ne(y.reshape(-1).view(torch.uint8)).any():
            differing.append(name)
            if name.endswith(".input_scale"):
                worst = max(worst, ((x.float() - y.float()).abs() / x.float().abs()).max().item())
    return differing, worst


@pytest.fixture(scope="module")
def source(tiny_ckpt, tmp_path_factory) -> Path:
    return copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("bf16"), "bf16_src")


def test_bf16_ep2_export_equals_one_process(source, tmp_path):
    """Calibrated and exported in bf16 (the loop ptq runs: from_pretrained, calibrate, export_checkpoint, each
    export checked by `verify`): EP2 (replicated dense) gives one process's weights byte for byte, input scales
    within INPUT_SCALE_BOUND, and in fact every file identical."""
    ref, out = tmp_path / "ep1", tmp_path / "ep2"
    calibrate_and_export(0, 1, str(source), str(ref), PRODUCTION, dtype="bfloat16")
    run_ranks(calibrate_and_export, 2, {"ckpt": str(source), "out": str(out), "recipe": PRODUCTION,
                                        "dense": "replicate", "dtype": "bfloat16"}, timeout_s=300)
    assert _tensors(ref)["language_model.lm_head.weight"].dtype == torch.bfloat16  # really a bf16 export
    differing, worst = _differences(ref, out)
    scales_only = [n for n in differing if not n.endswith(".input_scale")]
    assert not scales_only, f"EP2 differs from EP1 beyond input scales: {scales_only[:10]}"
    assert worst <= INPUT_SCALE_BOUND, f"{len(differing)} input scales differ, up to {worst:.3g} relative"
    files = sorted(p.name for p in ref.iterdir())
    assert files == sorted(p.name for p in out.iterdir())
    assert [n for n in files if (ref / n).read_bytes() != (out / n).read_bytes()] == []

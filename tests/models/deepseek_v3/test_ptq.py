"""`modelopt-ext ptq` on the DeepSeek-V3 stand-in under torchrun (gloo): the family's recipes end to end, the exports
compared across EP degrees and checked against the source (`verify --source`) and the engines' rules.

What the export of an FP8-block source must hold (export/source.py): FP8_PB_WO weights are the source's own codes
and block scales (0 error), unquantized Linears the dequantized weight in the checkpoint's bf16, the MTP layer
(`model.layers.4`, not built by transformers) carried over unquantized and excluded.

EP 1 against EP 2: every weight is the same; the routed experts' shared down_proj input scales of the MoE layers after
the first (layers 2 and 3) differ by fp32 rounding, because one process sums a token's expert outputs in expert-id
order (transformers' experts) and EP in top-k slot order (tests/models/deepseek_v3/test_calibrate_ep.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from modelopt_ext.formats.fp8_block import dequantize_blocks
from modelopt_ext.testing.nodes import node_env

ARGS = ("--calib-size", "16", "--batch-size", "4", "--seq-len", "64", "--dtype", "float32")
REL_AFTER_MOE = 2e-6  # as test_calibrate_ep.py


def _ptq(tiny: Path, out: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    cmd = [sys.executable, *launch, "-m", "modelopt_ext", "ptq", "--model", str(tiny), "--export-dir", str(out),
           *ARGS, *extra]
    env = {**node_env(out.parent), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=out.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="module")
def exports(ds_tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_ptq")
    out = {}
    for name, nproc, extra in (("ep1", 1, ()), ("ep2", 2, ()), ("ep4", 4, ("--quality-blocks", "4")),
                               ("experts_only", 2, ("--recipe", "deepseek_v3/nvfp4_experts_only", "--engine", "all")),
                               ("fp8_all", 2, ("--recipe", "deepseek_v3/fp8_all"))):
        proc = _ptq(ds_tiny, root / name, nproc, *extra)
        out[name] = (root / name, proc.stdout + proc.stderr)
    return out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _source(tiny: Path, key: str) -> torch.Tensor:
    index = json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(tiny / index[key]), framework="pt") as f:
        return f.get_tensor(key)


def test_exports_are_byte_identical_across_ep_degrees(exports):
    files = {name: sorted(p.name for p in exports[name][0].glob("*.safetensors")) for name in ("ep1", "ep2", "ep4")}
    assert files["ep1"] == files["ep2"] == files["ep4"]
    for f in files["ep2"]:
        assert (exports["ep2"][0] / f).read_bytes() == (exports["ep4"][0] / f).read_bytes(), f


def test_the_quality_report_measures_the_moe_blocks(exports):
    """transformers' own experts class has no per-expert probe: the summary reports the routed experts by MoE block
    (the dense layer 0's MLP, unquantized, left out); the report did not change the export (EP4 = EP2 above)."""
    folder, log = exports["ep4"]
    report = json.loads((folder / "quality.json").read_text())
    blocks = {n: m for n, m in report["modules"].items() if m["kind"] == "moe_block"}
    assert set(blocks) == {f"model.layers.{i}.mlp" for i in range(4)} and blocks["model.layers.0.mlp"]["ours"] == 0
    assert all(0 < blocks[f"model.layers.{i}.mlp"]["ours"] < 1 for i in (1, 2, 3))
    assert "quality, routed experts, per MoE block (no per-expert probe) (3 modules, " in log


def test_ep1_differs_only_in_input_scales_after_the_first_moe_layer(exports):
    one, two = _tensors(exports["ep1"][0]), _tensors(exports["ep2"][0])
    assert one.keys() == two.keys()
    differing = [k for k in one if not torch.equal(_raw(one[k]), _raw(two[k]))]
    for key in differing:
        assert key.endswith("down_proj.input_scale") and key.startswith(("model.layers.2.", "model.layers.3.")), key
        torch.testing.assert_close(one[key], two[key], rtol=REL_AFTER_MOE, atol=0)
    assert len(differing) <= 2 * 16  # 2 layers x 16 experts' copies of the shared scale


def test_fp8_block_weights_are_the_sources_own(exports, ds_tiny):
    folder, log = exports["ep2"]
    assert "20 copied exactly from the source's FP8 blocks, 0 re-quantized" in log
    tensors = _tensors(folder)
    for module in ("model.layers.0.self_attn.kv_a_proj_with_mqa", "model.layers.3.self_attn.o_proj"):
        assert torch.equal(_raw(tensors[f"{module}.weight"]), _raw(_source(ds_tiny, f"{module}.weight")))
        scale = tensors[f"{module}.weight_scale"]
        assert scale.ndim == 4 and torch.equal(scale.flatten(), _source(ds_tiny, f"{module}.weight_scale_inv").flatten())
    # unquantized FP8-block Linears: the dequantized weight in the checkpoint's bf16 (the model ran in float32)
    key = "model.layers.1.mlp.shared_experts.down_proj.weight"
    want = dequantize_blocks(_source(ds_tiny, key), _source(ds_tiny, key + "_scale_inv"), torch.bfloat16)
    assert tensors[key].dtype == torch.bfloat16 and torch.equal(tensors[key], want)
    assert not any(k.endswith("weight_scale_inv") for k in tensors)
    # fp8_all: every FP8_PB_WO weight of the export is the source's (experts included)
    assert "176 copied exactly from the source's FP8 blocks, 0 re-quantized" in exports["fp8_all"][1]


def test_the_mtp_layer_is_carried_unquantized_and_excluded(exports, ds_tiny):
    folder, log = exports["ep2"]
    tensors = _tensors(folder)
    index = json.loads((ds_tiny / "model.safetensors.index.json").read_text())["weight_map"]
    mtp = sorted(k for k in index if k.startswith("model.layers.4.") and not k.endswith("_scale_inv"))
    assert mtp and all(k in tensors for k in mtp)
    key = "model.layers.4.mlp.experts.5.up_proj.weight"
    want = dequantize_blocks(_source(ds_tiny, key), _source(ds_tiny, key + "_scale_inv"), torch.bfloat16)
    assert torch.equal(tensors[key], want)
    assert torch.equal(tensors["model.layers.4.eh_proj.weight"], _source(ds_tiny, "model.layers.4.eh_proj.weight"))
    last = sorted(folder.glob("*.safetensors"))[-1]
    with safe_open(str(last), framework="pt") as f:
        assert set(f.keys()) == set(mtp)  # the last file holds the carried layer alone
    for config in (json.loads((folder / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"],
                   json.loads((folder / "config.json").read_text())["quantization_config"]["ignore"]):
        assert "model.layers.4*" in config
    assert "carried the source layers the model does not build, unquantized: model.layers.4." in log


def test_verify_against_the_source_and_the_engines(exports, ds_tiny):
    from modelopt_ext.export.engines import check_engines, engine_verdicts
    from modelopt_ext.export.verify import verify_export

    for name, engines in (("ep2", {"vllm": True, "sglang": True, "trtllm": False}),
                          ("experts_only", {"vllm": True, "sglang": True, "trtllm": True}),
                          ("fp8_all", {"vllm": True, "sglang": False, "trtllm": False})):
        folder, log = exports[name]
        report = verify_export(folder, source_dir=ds_tiny)
        assert report.ok, (name, report.problems[:5])
        assert report.max_rel_error.get("FP8_PB_WO", 0.0) == 0.0
        assert engine_verdicts(check_engines(folder, ["all"])) == engines, name
        # without --engine, ptq checks the engines the family names for the recipe (ServingSpec.recipe_engines)
        checked = {e for e, ok in engines.items() if ok} if name != "experts_only" else set(engines)
        assert f"serving engines: {', '.join(f'{e} OK' for e in engines if e in checked)}" in log, (name, log[-2000:])



def _bf16_copy(tiny: Path, out: Path) -> Path:
    """The stand-in as a bf16 checkpoint (DeepSeek's fp8_cast_bf16.py output: FP8 blocks dequantized, no scales, no
    quantization_config)."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir()
    weight_map = {}
    for f in sorted(tiny.glob("*.safetensors")):
        stored = load_file(f)
        kept = {k: (dequantize_blocks(v, stored[k + "_scale_inv"], torch.bfloat16) if v.dtype == torch.float8_e4m3fn
                    else v) for k, v in stored.items() if not k.endswith("_scale_inv")}
        save_file(kept, str(out / f.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(kept, f.name))
    for p in tiny.iterdir():
        if p.suffix != ".safetensors" and p.name not in ("model.safetensors.index.json", "config.json"):
            shutil.copy(p, out / p.name)
    config = json.loads((tiny / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def test_fsdp_dense_layers_export_as_replicated_ones(ds_tiny, exports, tmp_path):
    """The FP8 source with FSDP-sharded dense layers (each rank dequantizes its rows with its shard's block scales,
    formats/fp8_block.py): the EP2 export is byte-identical to the replicated one's."""
    out = tmp_path / "fsdp"
    _ptq(ds_tiny, out, 2, "--dense", "fsdp")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == sorted(p.name for p in exports["ep2"][0].glob("*.safetensors")) and len(files) == 54
    for f in files:
        assert (out / f).read_bytes() == (exports["ep2"][0] / f).read_bytes(), f


def test_a_bf16_source_with_fsdp_dense_layers_exports_as_with_replicated_ones(ds_tiny, tmp_path):
    """FSDP-sharded dense layers on a bf16 DeepSeek-V3 checkpoint (as DeepSeek's fp8_cast_bf16.py writes it): the
    export at EP2 is byte-identical to the replicated one's."""
    source = _bf16_copy(ds_tiny, tmp_path / "bf16")
    digests = {}
    for dense in ("replicate", "fsdp"):
        out = tmp_path / dense
        _ptq(source, out, 2, "--dense", dense)
        digests[dense] = {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}
    assert digests["replicate"] == digests["fsdp"] and len(digests["fsdp"]) == 54

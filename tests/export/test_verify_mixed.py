"""Tests for modelopt_ext.export.verify on MIXED_PRECISION and fp8_pb_wo exports (CPU): the per-rank
exporter's export of the production recipe (NVFP4 experts named w1/w3/w2 under a fused-experts entry of
quantized_layers, fp8_pb_wo attention), ModelOpt's own fp8_pb_wo export, and hand-built edge cases."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from modelopt_ext.export.manifest import _write_manifest, file_digests
from modelopt_ext.export.verify import MANIFEST_NAME, ExportInvalid, verify_export
from modelopt_ext.testing.checkpoints import copy_checkpoint
from modelopt_ext.testing.export_edits import edit_quant_configs, fix_total_size, read_index, rewrite, shard_of

INDEX = "model.safetensors.index.json"
RECIPE = "kimi_k3/nvfp4_experts-fp8_attention"
LAYERS = "language_model.model.layers"
EXPERTS = f"{LAYERS}.1.block_sparse_moe.experts"
W1 = f"{EXPERTS}.3.w1"
F_A = f"{LAYERS}.0.self_attn.f_a_proj"  # [128, 128]: one 128x128 block
Q_B = f"{LAYERS}.2.self_attn.q_b_proj"  # [192, 128]: two row blocks


def _writer_export(source: Path, out: Path) -> None:
    """Calibrate the stand-in with the production recipe in one process and export it with the per-rank
    exporter (the steps of `modelopt-ext ptq` without expert parallelism)."""
    import modelopt_ext
    from modelopt_ext.export.writer import export_checkpoint
    from modelopt_ext.families import families
    from modelopt_ext.quant.calibrate import calibrate
    from modelopt_ext.quant.recipes import quant_config

    model = modelopt_ext.from_pretrained(source, trust_remote_code=True, dtype=torch.float32)
    batches = [{"input_ids": torch.randint(13, 500, (2, 16), generator=torch.Generator().manual_seed(200 + i))}
               for i in range(4)]
    result = calibrate(model, quant_config(RECIPE, model.config), batches,
                       router_glob=families()["kimi_k3"].router_glob, num_experts=16)
    export_checkpoint(result.model, out, source_dir=source)


@pytest.fixture(scope="module")
def mixed(tiny_ckpt, tmp_path_factory) -> tuple[Path, Path]:
    """(source, the per-rank exporter's export of the production recipe)."""
    root = tmp_path_factory.mktemp("verify_mixed")
    source = copy_checkpoint(tiny_ckpt, root, "src")
    _writer_export(source, root / "export")
    return source, root / "export"


@pytest.fixture(scope="module")
def fp8_pb_wo(tiny_ckpt, tmp_path_factory) -> tuple[Path, Path]:
    """(source, ModelOpt's own export_hf_checkpoint of FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG: quant_algo fp8_pb_wo)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    import modelopt_ext
    from modelopt_ext.models.kimi_k3.experts import KimiK3PackedExperts

    root = tmp_path_factory.mktemp("verify_fp8_pb_wo")
    source = copy_checkpoint(tiny_ckpt, root, "src")
    model = modelopt_ext.from_pretrained(source, trust_remote_code=True, dtype=torch.bfloat16)
    ids = torch.randint(13, 500, (2, 24), generator=torch.Generator().manual_seed(0))

    def loop(m):
        with torch.no_grad():
            m(input_ids=ids, use_cache=False)

    model = mtq.quantize(model, mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG, loop)
    with contextlib.ExitStack() as stack:  # see test_verify._export
        for module in model.modules():
            if isinstance(module, KimiK3PackedExperts):
                stack.enter_context(module.materialized(torch.bfloat16))
        export_hf_checkpoint(model, export_dir=root / "export", max_shard_size="10GB")
    return source, root / "export"


# ----------------------------------------------------------------------------------------------------
# helpers written independently of the module under test


def _headers(export: Path) -> dict[str, tuple[str, list[int]]]:
    out = {}
    for shard in sorted(export.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                s = f.get_slice(key)
                out[key] = (s.get_dtype(), s.get_shape())
    return out


def _drop(export: Path, keys: list[str]) -> None:
    for shard in sorted({shard_of(export, k).name for k in keys}):
        rewrite(export / shard, lambda t: [t.pop(k, None) for k in keys])
    index = read_index(export)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in keys}
    (export / INDEX).write_text(json.dumps(index))
    fix_total_size(export)


def _copy(export: Path, tmp_path: Path) -> Path:
    """A copy to corrupt, without the manifest (which would report every change)."""
    out = Path(shutil.copytree(export, tmp_path / "export"))
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    return out


def _sealed_verify(export: Path, source: Path | None = None, **kwargs):
    """verify_export after writing the manifest for the files as they are now: these tests edit exports to test
    the other checks (and ModelOpt's own exporter writes no manifest)."""
    _write_manifest(export, file_digests(export))
    return verify_export(export, source, **kwargs)


def _problems(export: Path, source: Path | None = None, **kwargs) -> tuple[str, ...]:
    with pytest.raises(ExportInvalid) as exc:
        _sealed_verify(export, source, **kwargs)
    return exc.value.problems


# ----------------------------------------------------------------------------------------------------
# valid exports


def test_mixed_export_passes_with_source(mixed):
    src, export = mixed
    hf = json.loads((export / "hf_quant_config.json").read_text())["quantization"]
    assert hf["quant_algo"] == "MIXED_PRECISION" and hf["quantized_layers"][EXPERTS]["quant_algo"] == "NVFP4"
    headers = _headers(export)
    assert f"{W1}.weight" in headers and not any(k.startswith(f"{EXPERTS}.") and ".gate_proj." in k for k in headers)
    assert headers[f"{Q_B}.weight"] == ("F8_E4M3", [192, 128]) and headers[f"{F_A}.weight_scale"] == ("F32", [])
    assert headers[f"{Q_B}.weight_scale"] == ("F32", [2, 1, 1, 1])  # ModelOpt's amax shape, kept as is
    n_pb = sum(cfg["quant_algo"] == "FP8_PB_WO" and f"{k}.weight" in headers for k, cfg in hf["quantized_layers"].items())
    n_nvfp4 = sum(k.endswith(".weight_scale_2") for k in headers)
    report = verify_export(export, src)  # the manifest the exporter wrote
    assert dict(report.quantized) == {"FP8_PB_WO": n_pb, "NVFP4": n_nvfp4} and n_pb > 20 and n_nvfp4 == 240
    assert report.manifest == "checked"
    # the routed experts are the exact NVFP4 cast of their MXFP4 source: no error at all
    assert report.max_rel_error["NVFP4"] == report.max_bound_ratio["NVFP4"] == 0
    assert 0.5 < report.max_bound_ratio["FP8_PB_WO"] <= 1.0
    # Independent reference for the two-block weight: each 128-row block times its own scale.
    with safe_open(str(shard_of(export, f"{Q_B}.weight")), framework="pt") as f:
        q, s = f.get_tensor(f"{Q_B}.weight").float(), f.get_tensor(f"{Q_B}.weight_scale").float().flatten()
    with safe_open(str(shard_of(src, f"{Q_B}.weight")), framework="pt") as f:
        w = f.get_tensor(f"{Q_B}.weight").float()
    assert s[0] != s[1]
    deq = torch.cat([q[:128] * s[0], q[128:] * s[1]])
    rel = float((deq - w).abs().max() / w.abs().max())
    assert 0 < rel <= report.max_rel_error["FP8_PB_WO"] <= 2**-4 + 2**-8


def test_modelopt_fp8_pb_wo_export_passes(fp8_pb_wo):
    src, export = fp8_pb_wo
    hf = json.loads((export / "hf_quant_config.json").read_text())["quantization"]
    assert hf["quant_algo"] == "fp8_pb_wo" and "group_size" not in hf
    headers = _headers(export)
    assert headers[f"{Q_B}.weight"] == ("F8_E4M3", [192, 128]) and headers[f"{Q_B}.weight_scale"][1] == [2, 1, 1, 1]
    report = _sealed_verify(export, src)
    assert dict(report.quantized) == {"FP8_PB_WO": sum(d == "F8_E4M3" for d, _ in headers.values())}
    assert 0.5 < report.max_bound_ratio["FP8_PB_WO"] <= 1.0


# ----------------------------------------------------------------------------------------------------
# corruptions of the MIXED export


@pytest.mark.parametrize("module, scale, expected", [
    (Q_B, torch.full((2, 2), 1e-3), "has shape [2, 2], expected [2, 1]"),
    (F_A, torch.full((2,), 1e-3), "has shape [2], expected [1, 1]"),
    (F_A, torch.tensor(1e-3, dtype=torch.bfloat16), "is BF16 [], expected F32 (FP8_PB_WO block scale)"),
])
def test_fp8_pb_wo_scale_with_wrong_shape_or_dtype(mixed, tmp_path, module, scale, expected):
    src, export = mixed[0], _copy(mixed[1], tmp_path)
    key = f"{module}.weight_scale"
    rewrite(shard_of(export, key), lambda t: t.__setitem__(key, scale))
    fix_total_size(export)
    problems = _problems(export)
    assert len(problems) == 1 and problems[0].startswith(f"{key} {expected}"), problems
    assert _problems(export, src) == problems  # a malformed weight is not compared


def test_fp8_weight_stored_as_bf16_is_reported(mixed, tmp_path):
    """The E4M3 codes cast to the source dtype (what the exporter once wrote): exact values, wrong format."""
    src, export = mixed[0], _copy(mixed[1], tmp_path)
    key = f"{Q_B}.weight"
    rewrite(shard_of(export, key), lambda t: t.__setitem__(key, t[key].to(torch.bfloat16)))
    fix_total_size(export)
    expected = (f"{key} is BF16 [192, 128], expected F8_E4M3 (FP8_PB_WO weight)",)
    assert _problems(export) == _problems(export, src) == expected


def test_fp8_pb_wo_scaled_block_breaks_the_bound(mixed, tmp_path):
    src, export = mixed[0], _copy(mixed[1], tmp_path)
    key = f"{Q_B}.weight_scale"

    def scale_second_block(t):
        t[key] = t[key].clone()
        t[key][1] *= 1.25

    rewrite(shard_of(export, key), scale_second_block)
    assert _sealed_verify(export).ok  # still a valid layout
    problems = _problems(export, src)
    assert len(problems) == 1
    assert problems[0].startswith(f"{Q_B}.weight: ") and "exceed the FP8_PB_WO error bound; first at [128, " in (
        problems[0])


def test_expert_module_not_listed_is_reported(mixed, tmp_path):
    src, export = mixed[0], _copy(mixed[1], tmp_path)
    edit_quant_configs(export, lambda q: q["quantized_layers"].pop(EXPERTS))
    expected = {
        f"{EXPERTS}.{e}.{w} has quantized tensors ({EXPERTS}.{e}.{w}.weight_scale, {EXPERTS}.{e}.{w}.weight_scale_2, "
        f"{EXPERTS}.{e}.{w}.input_scale) but neither it nor an ancestor is in quantized_layers"
        for e in range(16) for w in ("w1", "w2", "w3")
    }
    assert set(_problems(export)) == expected
    assert set(_problems(export, src)) == expected


def test_exact_entry_overrides_its_ancestor(mixed, tmp_path):
    export = _copy(mixed[1], tmp_path)
    edit_quant_configs(export, lambda q: q["quantized_layers"].__setitem__(W1, {"quant_algo": "FP8_PB_WO"}))
    problems = _problems(export)
    assert f"{W1}.weight is U8 [64, 32], expected F8_E4M3 (FP8_PB_WO weight)" in problems
    assert all(p.startswith(W1) or "orphan scale" in p for p in problems), problems


def test_exclude_modules_win_over_quantized_layers(mixed, tmp_path):
    export = _copy(mixed[1], tmp_path)
    pattern = f"{LAYERS}.2.block_sparse_moe*"

    def exclude(q):
        key = "ignore" if "quant_method" in q else "exclude_modules"
        q[key] = [*q.get(key, []), pattern, F_A]

    edit_quant_configs(export, exclude)
    problems = _problems(export)
    assert len(problems) == 16 * 3 + 1
    assert all(" matches exclude_modules but has quantized tensors " in p for p in problems)
    assert any(p.startswith(f"{F_A} matches") for p in problems)


def test_malformed_quantized_layers_are_problems(mixed, tmp_path):
    export = _copy(mixed[1], tmp_path)
    edit_quant_configs(export, lambda q: q["quantized_layers"].__setitem__(F_A, "FP8_PB_WO"))
    problems = _problems(export)
    assert f"hf_quant_config.json quantized_layers[{F_A}] is 'FP8_PB_WO', expected an object" in problems
    assert any(p.startswith(f"{F_A} has quantized tensors") for p in problems)


# ----------------------------------------------------------------------------------------------------
# tensors that cannot be compared are problems, not crashes


def test_packed_expert_weight_without_scales(mixed, tmp_path):
    src, export = mixed[0], _copy(mixed[1], tmp_path)
    _drop(export, [f"{W1}.weight_scale", f"{W1}.weight_scale_2", f"{W1}.input_scale"])
    missing = f"{W1}.weight is U8 but {W1}.weight_scale is missing (the config quantizes it as NVFP4)"
    assert _problems(export) == (missing,)
    assert _problems(export, src) == (
        missing,
        f"{W1}.weight is torch.uint8 [64, 32] without scales, but its source {W1}.weight_packed is MXFP4: "
        "an unquantized export of it must be a float tensor",
    )


def test_malformed_source_tensor(mixed, tmp_path):
    src = copy_checkpoint(mixed[0], tmp_path, "src")
    export = mixed[1]
    key = f"{LAYERS}.2.block_sparse_moe.experts.5.w2.weight"
    shard = src / read_index(src)["weight_map"][f"{key}_scale"]
    rewrite(shard, lambda t: t.__setitem__(f"{key}_scale", t[f"{key}_scale"][:, :1].contiguous()))
    problems = _problems(export, src)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{key}: cannot compare with source {key}_packed, {key}_scale (ValueError: ")


# ----------------------------------------------------------------------------------------------------
# hand-built one-linear exports


def _one_linear(root: Path, algo: str, w: torch.Tensor, tensors: dict[str, torch.Tensor]) -> tuple[Path, Path]:
    """A source with `lin.weight` = w and an export with `tensors`, `lin` listed as `algo` under MIXED_PRECISION."""
    src, export = root / "src", root / "export"
    src.mkdir(parents=True)
    export.mkdir(parents=True)
    save_file({"lin.weight": w}, str(src / "model.safetensors"))
    save_file(tensors, str(export / "model.safetensors"))
    layer = {"quant_algo": algo, **({"group_size": 16} if "NVFP4" in algo else {})}
    quant = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": {"lin": layer}}
    (export / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}))
    qc = {"quant_algo": "MIXED_PRECISION", "ignore": [], "quant_method": "modelopt", "quantized_layers": {"lin": layer}}
    (export / "config.json").write_text(json.dumps({"quantization_config": qc}))
    return src, export


def test_fp8_pb_wo_blocks_at_their_edges(tmp_path):
    # [130, 200]: 2 x 2 blocks, the last row and column blocks partial. Every E4M3 code times a power-of-two
    # block scale is exact in bf16, so the export below is lossless but for one value rounded half an ULP.
    codes = torch.randint(0, 256, (130, 200), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN: 1.0 instead
    x = codes.view(torch.float8_e4m3fn).float()
    s = torch.tensor([[1.0, 2.0], [0.5, 4.0]])
    s_full = s.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :200]
    x[0, 0] = 1.0625  # halfway between 1 and 1.125, stored as 1: error 2**-4, bound (2**-4 + 2**-8) * 1.0625 + 2**-10
    x[0, 128], x[129, 199] = 1.0, 2.0
    w = (x * s_full).to(torch.bfloat16)
    q = x.to(torch.float8_e4m3fn)
    assert q[0, 0].item() == 1.0
    good = {"lin.weight": q, "lin.weight_scale": s.reshape(2, 1, 2, 1)}
    report = _sealed_verify(_one_linear(tmp_path / "ok", "FP8_PB_WO", w, good)[1], tmp_path / "ok" / "src")
    assert report.quantized == {"FP8_PB_WO": 1} and 0.87 < report.max_bound_ratio["FP8_PB_WO"] <= 1.0  # 0.874
    assert _sealed_verify(_one_linear(tmp_path / "2d", "FP8_PB_WO", w, {**good, "lin.weight_scale": s})[1],
                         tmp_path / "2d" / "src").ok
    # One code of the partial corner block an ULP off (2 -> 2.25, times its scale 4); the scales transposed
    # (accepted as a layout, but block [0, 1] then gets 0.5 instead of 2).
    off = q.clone()
    off[129, 199] = 2.25
    cases = {
        "ulp": ({**good, "lin.weight": off}, "1 of 26000 values exceed the FP8_PB_WO error bound; first at [129, 199]"),
        "transposed": ({**good, "lin.weight_scale": s.t().contiguous()}, "first at [0, 128]"),
    }
    for name, (tensors, message) in cases.items():
        src, export = _one_linear(tmp_path / name, "FP8_PB_WO", w, tensors)
        problems = _problems(export, src)
        assert len(problems) == 1 and problems[0].startswith("lin.weight: ") and message in problems[0], problems
    src, export = _one_linear(tmp_path / "flat", "FP8_PB_WO", w, {**good, "lin.weight_scale": s.flatten()})
    assert _problems(export, src) == (
        "lin.weight_scale has shape [4], expected [2, 2] (one FP8_PB_WO scale per 128x128 block of lin.weight "
        "[130, 200])",
    )


def test_weight_only_formats_carry_no_input_scale(tmp_path):
    codes = torch.randint(0, 16, (4, 32), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = values[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
    w = (x * 0.5).to(torch.bfloat16)  # block scale 2 (E4M3) times weight_scale_2 0.25
    good = {
        "lin.weight": (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8),
        "lin.weight_scale": torch.full((4, 2), 2.0).to(torch.float8_e4m3fn),
        "lin.weight_scale_2": torch.tensor(0.25),
    }
    src, export = _one_linear(tmp_path / "ok", "W4A16_NVFP4", w, good)
    assert _sealed_verify(export, src).max_rel_error == {"W4A16_NVFP4": 0.0}
    src, export = _one_linear(tmp_path / "in", "W4A16_NVFP4", w, {**good, "lin.input_scale": torch.tensor(1.0)})
    assert _problems(export, src) == ("orphan scale lin.input_scale: W4A16_NVFP4 is weight-only",)

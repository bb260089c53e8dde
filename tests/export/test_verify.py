"""Tests for modelopt_ext.export.verify on real ModelOpt exports of the tiny stand-in (CPU)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from modelopt_ext.export.verify import MANIFEST_NAME, ExportInvalid, source_name, verify_export
from modelopt_ext.models.kimi_k3.experts import KimiK3PackedExperts
from modelopt_ext.testing.checkpoints import copy_checkpoint
from modelopt_ext.testing.export_edits import fix_total_size, read_index, rewrite, shard_of

INDEX = "model.safetensors.index.json"
EMBED = "language_model.model.embed_tokens.weight"
NORM = "language_model.model.layers.0.input_layernorm.weight"
Q_PROJ = "language_model.model.layers.0.self_attn.q_proj"
DOWN = "language_model.model.layers.0.mlp.down_proj.weight"
GATE_PROJ = "language_model.model.layers.1.block_sparse_moe.experts.3.gate_proj.weight"


def _export(tiny_ckpt: Path, root: Path, fmt: str, max_shard_size: str) -> tuple[Path, Path]:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    import modelopt_ext

    src = copy_checkpoint(tiny_ckpt, root, f"verify_src_{fmt}")
    model = modelopt_ext.from_pretrained(src, trust_remote_code=True, dtype=torch.bfloat16)
    ids = torch.randint(13, 500, (2, 24), generator=torch.Generator().manual_seed(0))

    def loop(m):
        with torch.no_grad():
            m(input_ids=ids, use_cache=False)

    cfg = {"fp8": mtq.FP8_DEFAULT_CFG, "nvfp4": mtq.NVFP4_DEFAULT_CFG}[fmt]
    model = mtq.quantize(model, cfg, loop)  # no forward after NVFP4 calibration: it fails on CPU
    out = root / f"export_{fmt}"
    with contextlib.ExitStack() as stack:
        # Workaround: packed experts dequantize `gate_up_proj` into a new tensor on every access, and
        # ModelOpt's sync_tied_input_amax groups fused experts by id() of that tensor; a freed tensor's id
        # is reused, so unrelated layers get grouped and the export fails at random ("no attribute
        # 'input_quantizer'"). Holding the dequantized tensors for the export keeps every id distinct.
        for module in model.modules():
            if isinstance(module, KimiK3PackedExperts):
                stack.enter_context(module.materialized(torch.bfloat16))
        export_hf_checkpoint(model, export_dir=out, max_shard_size=max_shard_size)
    _seal(out)  # ModelOpt's exporter writes no manifest; modelopt-ext's always does, and verify requires it
    return src, out


@pytest.fixture(scope="module")
def fp8(tiny_ckpt, tmp_path_factory) -> tuple[Path, Path]:
    """(source, sharded FP8 export)."""
    return _export(tiny_ckpt, tmp_path_factory.mktemp("verify_fp8"), "fp8", "600KB")


@pytest.fixture(scope="module")
def nvfp4(tiny_ckpt, tmp_path_factory) -> tuple[Path, Path]:
    """(source, single-file NVFP4 export)."""
    return _export(tiny_ckpt, tmp_path_factory.mktemp("verify_nvfp4"), "nvfp4", "10GB")


# ----------------------------------------------------------------------------------------------------
# helpers written independently of the module under test


def _copy(export: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(export, tmp_path / "export"))


def _seal(export: Path) -> None:
    """Write MANIFEST.sha256 for the files as they are now (``sha256  path``, sorted by path)."""
    files = sorted((p.relative_to(export).as_posix(), p) for p in export.rglob("*")
                   if p.is_file() and p.name != MANIFEST_NAME)
    (export / MANIFEST_NAME).write_text(
        "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {name}\n" for name, p in files))


def _verify(export: Path, source: Path | None = None, **kwargs):
    """verify_export after re-sealing the manifest: edits below test the other checks, not the manifest."""
    _seal(export)
    return verify_export(export, source, **kwargs)


def _data_span(path: Path, key: str) -> tuple[int, int]:
    """Absolute byte range of a tensor's data in a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + n])[key]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def _xor_bytes(path: Path, key: str, mask: int, count: int = 16) -> None:
    begin, end = _data_span(path, key)
    raw = bytearray(path.read_bytes())
    start = begin + (end - begin) // 3
    for i in range(start, min(start + count, end)):
        raw[i] ^= mask
    path.write_bytes(bytes(raw))


def _problems(export: Path, source: Path | None = None, *, seal: bool = True, **kwargs) -> tuple[str, ...]:
    """The problems verify_export reports; with `seal`, the manifest is rewritten first (see `_verify`)."""
    with pytest.raises(ExportInvalid) as exc:
        (_verify if seal else verify_export)(export, source, **kwargs)
    assert exc.value.problems == exc.value.report.problems
    for problem in exc.value.problems:
        assert problem in str(exc.value)
    return exc.value.problems


def _dtypes(path: Path) -> dict[str, torch.dtype]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: f.get_tensor(k).dtype for k in f.keys()})  # noqa: SIM118
    return out


# ----------------------------------------------------------------------------------------------------
# valid exports


def test_source_name_table():
    assert source_name("m.layers.1.block_sparse_moe.experts.3.gate_proj.weight") == (
        "m.layers.1.block_sparse_moe.experts.3.w1.weight")
    assert source_name("m.experts.0.up_proj.weight") == "m.experts.0.w3.weight"
    assert source_name("m.experts.15.down_proj.weight") == "m.experts.15.w2.weight"
    for unchanged in ("m.shared_experts.gate_proj.weight", "m.experts.0.gate_proj.weight_scale", "lm_head.weight"):
        assert source_name(unchanged) == unchanged


def test_fp8_sharded_export_passes_without_source(fp8):
    _, export = fp8
    index = read_index(export)
    dtypes = _dtypes(export)
    report = verify_export(export)
    assert report.ok and report.problems == ()
    shards = set(index["weight_map"].values())
    assert report.files == len(shards) > 1
    assert report.tensors_checked == len(index["weight_map"]) == len(dtypes)
    assert report.tensor_bytes == index["metadata"]["total_size"]
    assert dict(report.quantized) == {"FP8": sum(d == torch.float8_e4m3fn for d in dtypes.values())}
    assert report.manifest == "checked"
    assert dict(report.max_rel_error) == {}


def test_fp8_export_passes_with_source(fp8):
    src, export = fp8
    report = verify_export(export, src)
    assert report.source_dir == str(src)
    # Independent reference for one weight: |q * s - w| / max|w| with q, s, w read directly.
    with safe_open(str(shard_of(export, DOWN)), framework="pt") as f:
        q, s = f.get_tensor(DOWN).float(), f.get_tensor(DOWN + "_scale").float()
    src_index = json.loads((src / INDEX).read_text())["weight_map"]
    with safe_open(str(src / src_index[DOWN]), framework="pt") as f:
        w = f.get_tensor(DOWN).float()
    rel = float((q * s - w).abs().max() / w.abs().max())
    assert 0 < rel <= report.max_rel_error["FP8"] <= 2**-4 + 2**-8 + 1e-6
    assert 0.5 < report.max_bound_ratio["FP8"] <= 1.0


def test_nvfp4_single_file_export_passes(nvfp4):
    src, export = nvfp4
    assert not (export / INDEX).exists() and len(list(export.glob("*.safetensors"))) == 1
    dtypes = _dtypes(export)
    n_nvfp4 = sum(k.endswith(".weight_scale_2") for k in dtypes)
    assert verify_export(export).quantized == {"NVFP4": n_nvfp4}
    report = verify_export(export, src)
    assert dict(report.quantized) == {"NVFP4": n_nvfp4} and n_nvfp4 > 300
    # Round-to-nearest sits right at half a step for some values: the bound is tight, not loose.
    assert 0.9 < report.max_bound_ratio["NVFP4"] <= 1.0
    assert 0 < report.max_rel_error["NVFP4"] < 0.25


def test_tolerance_factor_scales_the_bound(nvfp4):
    src, export = nvfp4
    problems = _problems(export, src, seal=False, tolerance_factor=0.5)  # the fixture itself: sealed
    assert any(GATE_PROJ in p and "exceed the NVFP4 error bound" in p for p in problems)
    assert all("error bound" in p for p in problems)
    with pytest.raises(ValueError, match="tolerance_factor"):
        verify_export(export, tolerance_factor=0)


def test_missing_directories_raise(tmp_path, nvfp4):
    with pytest.raises(FileNotFoundError, match="nothing"):
        verify_export(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="no_source"):
        verify_export(nvfp4[1], tmp_path / "no_source")


# ----------------------------------------------------------------------------------------------------
# manifest


def test_manifest_written_then_checked(fp8, tmp_path):
    export = _copy(fp8[1], tmp_path)
    assert verify_export(export, write_manifest=True).manifest == "written"
    lines = (export / MANIFEST_NAME).read_text().splitlines()
    expected = sorted(
        (p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in export.iterdir() if p.name != MANIFEST_NAME
    )
    assert lines == [f"{digest}  {name}" for name, digest in expected]
    assert verify_export(export).manifest == "checked"
    (export / "stray.txt").write_text("x")
    (export / "generation_config.json").unlink()
    problems = _problems(export, seal=False)
    assert problems == (
        f"generation_config.json is listed in {MANIFEST_NAME} but missing",
        f"stray.txt is not listed in {MANIFEST_NAME}",
    )
    # Rewriting accepts the new file set.
    assert verify_export(export, write_manifest=True).manifest == "written"
    assert verify_export(export).manifest == "checked"


def test_a_nested_source_quantization_config_is_a_problem(fp8, tmp_path):
    export = _copy(fp8[1], tmp_path)
    config = json.loads((export / "config.json").read_text())
    config["text_config"]["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    (export / "config.json").write_text(json.dumps(config))
    problems = _problems(export)
    assert any("text_config.quantization_config is still set (quant_method 'compressed-tensors')" in p for p in problems)


def test_invalid_export_gets_no_manifest(fp8, tmp_path):
    export = _copy(fp8[1], tmp_path)
    (export / MANIFEST_NAME).unlink()  # as ModelOpt's own exporter leaves it
    (export / INDEX).unlink()
    with pytest.raises(ExportInvalid) as exc:
        verify_export(export, write_manifest=True)
    assert exc.value.report.manifest == "not written"
    assert not (export / MANIFEST_NAME).exists()
    assert any("but no model.safetensors.index.json" in p for p in exc.value.problems)


def _missing(export: Path) -> str:
    return (f"{export / MANIFEST_NAME} is missing: modelopt-ext's exporter always writes {MANIFEST_NAME}, so this "
            "export is incomplete or was not written by modelopt-ext; for an export of ModelOpt's own "
            "export_hf_checkpoint, `modelopt-ext verify --write-manifest` checks it and writes one")


def test_missing_manifest_is_a_problem(fp8, tmp_path):
    src, export = fp8[0], _copy(fp8[1], tmp_path)
    (export / MANIFEST_NAME).unlink()
    assert _problems(export, seal=False) == _problems(export, src, seal=False) == (_missing(export),)
    with pytest.raises(ExportInvalid) as exc:
        verify_export(export)
    assert exc.value.report.manifest == "missing"
    # --write-manifest is the way to accept an export of ModelOpt's own exporter (every other check passes)
    assert verify_export(export, src, write_manifest=True).manifest == "written"
    assert verify_export(export).manifest == "checked"


def test_verify_cli_exits_non_zero_without_manifest(nvfp4, tmp_path, capsys):
    from modelopt_ext.cli import main

    export = _copy(nvfp4[1], tmp_path)
    (export / MANIFEST_NAME).unlink()
    capsys.readouterr()
    assert main(["verify", str(export)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"modelopt-ext verify: {export} is invalid, 1 problem(s):",
                                         f"  - {_missing(export)}"]
    assert main(["verify", str(export), "--write-manifest"]) == 0
    assert "manifest MANIFEST.sha256: written" in capsys.readouterr().out
    assert main(["verify", str(export)]) == 0


# ----------------------------------------------------------------------------------------------------
# corruptions


def test_flipped_bytes_in_unquantized_tensor(fp8, tmp_path):
    src, export = fp8[0], _copy(fp8[1], tmp_path)
    verify_export(export, write_manifest=True)
    shard = shard_of(export, EMBED)
    _xor_bytes(shard, EMBED, 0x5A)
    assert _problems(export, seal=False) == (
        f"{shard.name} changed since {MANIFEST_NAME} was written (sha256 "
        f"{hashlib.sha256(shard.read_bytes()).hexdigest()}, was "
        f"{hashlib.sha256((fp8[1] / shard.name).read_bytes()).hexdigest()})",
    )
    problems = _problems(export, src, seal=False)
    assert len(problems) == 2
    assert problems[1].startswith(f"{EMBED} is not bit-exact to source {EMBED}: ")


@pytest.mark.parametrize("which", ["fp8", "nvfp4"])
def test_flipped_bytes_in_quantized_weight_break_the_bound(which, fp8, nvfp4, tmp_path):
    src, original = {"fp8": fp8, "nvfp4": nvfp4}[which]
    export = _copy(original, tmp_path)
    shard = shard_of(export, DOWN) if which == "fp8" else export / "model.safetensors"
    # FP8: bit 3 is the lowest exponent bit, so every flipped value moves by at least a factor 2 (or 2**-6
    # units of the scale next to the subnormals). NVFP4: 0x88 flips the sign of both codes of a byte, which
    # moves every nonzero code by twice its value, at least a whole 0.5 step.
    _xor_bytes(shard, DOWN, 0x08 if which == "fp8" else 0x88)
    problems = _problems(export, src)
    assert all(p.startswith(DOWN) for p in problems)  # an FP8 flip may also make a NaN, reported on its own
    assert any(p.startswith(f"{DOWN}: ") and f"exceed the {which.upper()} error bound" in p for p in problems)


def test_swapped_nvfp4_nibbles_are_caught(nvfp4, tmp_path):
    src, export = nvfp4[0], _copy(nvfp4[1], tmp_path)

    def swap(t):
        t[GATE_PROJ] = (t[GATE_PROJ] << 4) | (t[GATE_PROJ] >> 4)

    rewrite(export / "model.safetensors", swap)
    problems = _problems(export, src)
    assert len(problems) == 1 and problems[0].startswith(f"{GATE_PROJ}: ")


def test_missing_tensor_is_named(fp8, tmp_path):
    src, export = fp8[0], _copy(fp8[1], tmp_path)
    shard = shard_of(export, NORM)
    rewrite(shard, lambda t: t.pop(NORM))
    problems = _problems(export)
    assert f"tensor {NORM} is listed in {INDEX} (shard {shard.name}) but missing from every shard" in problems
    assert any(p.startswith(f"{INDEX}: metadata.total_size ") for p in problems)
    assert len(problems) == 2
    assert f"source tensor {NORM} is missing from the export" in _problems(export, src)


def test_missing_weight_scale_leaves_orphans(fp8, tmp_path):
    export = _copy(fp8[1], tmp_path)
    key = f"{Q_PROJ}.weight_scale"
    rewrite(shard_of(export, key), lambda t: t.pop(key))
    index = read_index(export)
    del index["weight_map"][key]
    (export / INDEX).write_text(json.dumps(index))
    fix_total_size(export)
    assert set(_problems(export)) == {
        f"orphan scale {Q_PROJ}.input_scale: {Q_PROJ} has no weight_scale",
        f"{Q_PROJ}.weight is F8_E4M3 but {Q_PROJ}.weight_scale is missing",
    }


def test_duplicated_key_in_two_shards(fp8, tmp_path):
    export = _copy(fp8[1], tmp_path)
    home = shard_of(export, EMBED)
    other = next(export / s for s in sorted(set(read_index(export)["weight_map"].values())) if s != home.name)
    embed = load_file(str(home))[EMBED]
    rewrite(other, lambda t: t.__setitem__(EMBED, embed))
    problems = _problems(export)
    first, second = sorted([home.name, other.name])
    assert f"tensor {EMBED} is stored in 2 shards: {first}, {second}" in problems


def test_index_entry_pointing_to_wrong_shard(fp8, tmp_path):
    export = _copy(fp8[1], tmp_path)
    index = read_index(export)
    home = index["weight_map"][NORM]
    wrong = next(s for s in sorted(set(index["weight_map"].values())) if s != home)
    index["weight_map"][NORM] = wrong
    (export / INDEX).write_text(json.dumps(index))
    assert _problems(export) == (f"{INDEX}: tensor {NORM} is mapped to {wrong} but stored in {home}",)


def test_index_naming_a_missing_shard(fp8, tmp_path):
    export = _copy(fp8[1], tmp_path)
    index = read_index(export)
    index["weight_map"][NORM] = "model-00009-of-00009.safetensors"
    (export / INDEX).write_text(json.dumps(index))
    problems = _problems(export)
    assert f"{INDEX}: tensor {NORM} is mapped to shard model-00009-of-00009.safetensors, which does not exist" in (
        problems)


def test_fp8_scale_with_wrong_dtype(fp8, tmp_path):
    src, export = fp8[0], _copy(fp8[1], tmp_path)
    key = f"{Q_PROJ}.weight_scale"
    rewrite(shard_of(export, key), lambda t: t.__setitem__(key, t[key].to(torch.bfloat16)))
    fix_total_size(export)
    expected = (f"{key} is BF16 [], expected F32 [] (FP8 per-tensor weight scale)",)
    assert _problems(export) == _problems(export, src) == expected


def test_nvfp4_block_scale_with_wrong_dtype(nvfp4, tmp_path):
    src, export = nvfp4[0], _copy(nvfp4[1], tmp_path)
    key = f"{GATE_PROJ}_scale"
    rewrite(export / "model.safetensors", lambda t: t.__setitem__(key, t[key].float()))
    expected = (f"{key} is F32 [64, 4], expected F8_E4M3 [64, 4] (NVFP4 per-16-block scale of {GATE_PROJ})",)
    assert _problems(export) == _problems(export, src) == expected


def _edit_quant_configs(export: Path, edit_hf, edit_config) -> None:
    hf = json.loads((export / "hf_quant_config.json").read_text())
    edit_hf(hf["quantization"])
    (export / "hf_quant_config.json").write_text(json.dumps(hf))
    config = json.loads((export / "config.json").read_text())
    edit_config(config["quantization_config"])
    (export / "config.json").write_text(json.dumps(config))


def test_excluded_module_with_quantized_weights(fp8, tmp_path):
    export = _copy(fp8[1], tmp_path)
    _edit_quant_configs(
        export, lambda q: q["exclude_modules"].append(Q_PROJ), lambda qc: qc["ignore"].append(Q_PROJ)
    )
    assert _problems(export) == (
        f"{Q_PROJ} matches exclude_modules but has quantized tensors "
        f"({Q_PROJ}.weight_scale, {Q_PROJ}.input_scale)",
    )


def test_unquantized_weight_not_excluded(nvfp4, tmp_path):
    export = _copy(nvfp4[1], tmp_path)
    lm_head = "language_model.lm_head"
    _edit_quant_configs(
        export, lambda q: q["exclude_modules"].remove(lm_head), lambda qc: qc["ignore"].remove(lm_head)
    )
    assert _problems(export) == (
        f"{lm_head}.weight is unquantized BF16 but {lm_head} is not in exclude_modules "
        "(the config quantizes it as NVFP4)",
    )


def test_configs_that_disagree(nvfp4, tmp_path):
    export = _copy(nvfp4[1], tmp_path)
    _edit_quant_configs(export, lambda q: q["exclude_modules"].append("extra*"), lambda qc: None)
    problems = _problems(export)
    assert len(problems) == 1 and "only in exclude_modules ['extra*']" in problems[0]


def test_orphan_scale_on_unquantized_module(nvfp4, tmp_path):
    export = _copy(nvfp4[1], tmp_path)
    key = "language_model.model.layers.0.input_layernorm.input_scale"
    rewrite(export / "model.safetensors", lambda t: t.__setitem__(key, torch.tensor(1.0)))
    assert _problems(export) == (
        f"orphan scale {key}: language_model.model.layers.0.input_layernorm has no weight_scale",
    )


def test_unmapped_export_key_with_source(nvfp4, tmp_path):
    src, export = nvfp4[0], _copy(nvfp4[1], tmp_path)
    key = "language_model.model.layers.0.extra_norm.bias"
    rewrite(export / "model.safetensors", lambda t: t.__setitem__(key, torch.zeros(4, dtype=torch.bfloat16)))
    assert _verify(export).ok
    assert _problems(export, src) == (f"export tensor {key} has no source tensor {key} (plain, MXFP4 or FP8 blocks)",)


# ----------------------------------------------------------------------------------------------------
# hand-built one-linear exports: the bounds at their edges, worked out by hand

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _tiny_export(root: Path, algo: str, w: torch.Tensor, tensors: dict[str, torch.Tensor]) -> tuple[Path, Path]:
    """A source with `lin.weight` = w and an export with `tensors` and `algo` configs."""
    src, export = root / "src", root / "export"
    src.mkdir(parents=True)
    export.mkdir(parents=True)
    save_file({"lin.weight": w}, str(src / "model.safetensors"))
    save_file(tensors, str(export / "model.safetensors"))
    quant = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": []}
    if algo == "NVFP4":
        quant["group_size"] = 16
    (export / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}))
    qc = {"quant_algo": algo, "ignore": [], "quant_method": "modelopt"}
    (export / "config.json").write_text(json.dumps({"quantization_config": qc}))
    _seal(export)
    return src, export


def test_fp8_bound_at_its_edges(tmp_path):
    # s = 2: the stored code x = w / 2. E4M3 near 1 has step 1/8; below 2**-6 the subnormal step is 2**-9.
    s = 2.0
    x = torch.zeros(2, 16)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 1.0, 1.0625, 2.0**-10, -3.0  # 1.0625 and 2**-10: halfway, rounded down
    w = (x * s).to(torch.bfloat16)
    q = x.to(torch.float8_e4m3fn)
    assert q[0, 1].item() == 1.0 and q[0, 2].item() == 0.0
    scale = torch.tensor(s)
    ok = verify_export(_tiny_export(tmp_path / "ok", "FP8", w, {"lin.weight": q, "lin.weight_scale": scale})[1],
                       tmp_path / "ok" / "src")
    assert ok.quantized == {"FP8": 1} and ok.max_bound_ratio["FP8"] <= 1.0
    # One ULP off (1 -> 1.125: error 1/8 > (2**-4 + 2**-8) * 1), and the subnormal rounded the wrong way by a
    # whole step (2**-10 -> 2**-8: error 3 * 2**-10 > 2**-10 + 2**-4 * 2**-10).
    for name, i, code in (("ulp", 0, 1.125), ("subnormal", 2, 2.0**-8), ("nan", 3, float("nan"))):
        bad = q.clone()
        bad[0, i] = code
        src, export = _tiny_export(tmp_path / name, "FP8", w, {"lin.weight": bad, "lin.weight_scale": scale})
        problems = _problems(export, src)
        assert problems[-1].startswith(f"lin.weight: 1 of 32 values exceed the FP8 error bound; first at [0, {i}]: ")
        assert problems[:-1] == (("lin.weight holds 1 NaN value(s)",) if name == "nan" else ())


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Element 2j in the low nibble, 2j+1 in the high one (NVFP4QTensor's order)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def test_nvfp4_bound_at_its_edges(tmp_path):
    # Block scales 0.5 and 2, weight_scale_2 = 0.25: s_b = 1/8 and 1/2; the codes hold x = w / s_b.
    block = torch.tensor([[0.5, 2.0], [0.5, 2.0]]).to(torch.float8_e4m3fn)
    s_b = torch.tensor([0.125, 0.5]).repeat_interleave(16)
    mags = torch.tensor([[7, 1, 4, 2, 0, 5, 6, 3] * 4, [3, 3, 1, 7, 2, 0, 4, 5] * 4], dtype=torch.uint8)
    x = torch.tensor(E2M1)[mags.long()]
    x[0, 0] = 5.0  # halfway between 4 and 6, stored as 6 (code 7): error 1 = half the step
    x[1, 0] = 1.25  # halfway between 1 and 1.5, stored as 1.5 (code 3): error 1/4
    x[0, 3], x[0, 5], x[0, 6] = 1.21875, 2.75, 4.5  # stored as 1, 3 and 4: errors 0.22, 0.25 and 0.5
    codes = mags.clone()
    codes[1, 16:] |= 8  # negative in the second block of row 1
    x[1, 16:] = -x[1, 16:]
    w = (x * s_b).to(torch.bfloat16)
    scale_2 = torch.tensor(0.25)
    good = {"lin.weight": _pack(codes), "lin.weight_scale": block, "lin.weight_scale_2": scale_2}
    src, export = _tiny_export(tmp_path / "ok", "NVFP4", w, good)
    report = verify_export(export, src)
    assert report.quantized == {"NVFP4": 1} and report.max_bound_ratio["NVFP4"] > 0.95  # 1 / (1 + 5 * 2**-8)
    # One code a step off in each step size: 1.21875 -> 1.5 (error 0.28 > 1/4 + 2**-8 * 1.22),
    # 2.75 -> 2 (0.75 > 1/2 + ...), 4.5 -> 6 (1.5 > 1 + ...); the nibbles of a byte swapped; the scales of the
    # two blocks swapped: each breaks the bound, first in row 0.
    cases = {}
    for col, code in ((3, 3), (5, 4), (6, 7)):
        off = codes.clone()
        off[0, col] = code
        cases[f"step{col}"] = {**good, "lin.weight": _pack(off)}
    swapped = codes.clone()
    swapped[0, 0:2] = codes[0, 0:2].flip(0)
    cases |= {
        "nibbles": {**good, "lin.weight": _pack(swapped)},
        "blocks": {**good, "lin.weight_scale": block.view(torch.uint8).flip(-1).view(torch.float8_e4m3fn)},
    }
    for name, tensors in cases.items():
        src, export = _tiny_export(tmp_path / name, "NVFP4", w, tensors)
        problems = _problems(export, src)
        assert len(problems) == 1 and "exceed the NVFP4 error bound; first at [0, " in problems[0], (name, problems)
        if name.startswith("step"):
            assert problems[0].startswith(f"lin.weight: 1 of 64 values exceed the NVFP4 error bound; first at [0, {name[4:]}]")


def test_nvfp4_missing_second_scale(nvfp4, tmp_path):
    export = _copy(nvfp4[1], tmp_path)
    module = GATE_PROJ[: -len(".weight")]
    rewrite(export / "model.safetensors", lambda t: t.pop(f"{module}.weight_scale_2"))
    assert _problems(export) == (
        f"{module}.weight_scale_2 is missing (an NVFP4 weight needs its per-tensor scale)",
    )


def test_shard_missing_from_index(fp8, tmp_path):
    export = _copy(fp8[1], tmp_path)
    save_file({"stray.weight": torch.zeros(2)}, str(export / "model-extra.safetensors"))
    assert _problems(export) == (
        f"shard model-extra.safetensors is not referenced by {INDEX}",
        f"tensor stray.weight in model-extra.safetensors is not listed in {INDEX}",
    )

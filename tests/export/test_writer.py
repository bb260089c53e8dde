"""Tests for modelopt_ext.export.writer: per-rank exports on real gloo ranks equal the single-process export
byte for byte, and an export is only ever visible complete."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from modelopt_ext.export.manifest import MANIFEST_NAME
from modelopt_ext.export.writer import ExportDirError, check_export_dir, exported_config
from modelopt_ext.testing.checkpoints import copy_checkpoint
from modelopt_ext.testing.multiproc import import_file, run_ranks

bodies = import_file(Path(__file__).with_name("bodies.py"))
calibrate_and_export, counting_pipelined_calls = bodies.calibrate_and_export, bodies.counting_pipelined_calls

PRODUCTION = "kimi_k3/nvfp4_experts-fp8_attention"
FP8 = "kimi_k3/fp8_all"
CALIBRATION_FREE = "kimi_k3/calibration_free"


@pytest.fixture(scope="module")
def source(tiny_ckpt, tmp_path_factory) -> Path:
    return copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("writer"), "writer_src")


@pytest.fixture(scope="module")
def single(source, tmp_path_factory):
    """Single-process exports, by recipe."""
    root = tmp_path_factory.mktemp("single")
    out = {}
    for recipe in (PRODUCTION, FP8, CALIBRATION_FREE):
        out[recipe] = root / recipe.replace("/", "_")
        calibrate_and_export(0, 1, str(source), str(out[recipe]), recipe)
    return out


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _assert_identical(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    differing = [name for name in fa if fa[name] != fb[name]]
    assert not differing, f"{b} differs from {a} in {differing}"


def test_single_process_export_layout(single, source):
    export = single[PRODUCTION]
    index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    experts = "language_model.model.layers.1.block_sparse_moe.experts"
    for e in (0, 15):
        for proj in ("w1", "w2", "w3"):
            for part in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
                assert f"{experts}.{e}.{proj}.{part}" in index
    assert not any(".experts." in k and ".gate_proj." in k or "_quantizer" in k for k in index)
    config = json.loads((export / "config.json").read_text())
    hf = json.loads((export / "hf_quant_config.json").read_text())
    assert hf["quantization"]["quant_algo"] == "MIXED_PRECISION"
    assert hf["quantization"]["quantized_layers"][experts]["quant_algo"] == "NVFP4"
    assert hf["quantization"]["quantized_layers"]["model.layers.1.mlp.experts"]["quant_algo"] == "NVFP4"  # SGLang
    kda = "language_model.model.layers.1.self_attn"
    assert hf["quantization"]["quantized_layers"][f"{kda}.in_proj_qkvgfab"] == {"quant_algo": "FP8_PB_WO",
                                                                              "group_size": 128}
    assert config["quantization_config"]["quantized_layers"] == hf["quantization"]["quantized_layers"]
    assert config["quantization_config"]["quant_method"] == "modelopt_mixed"  # SGLang's per-layer path
    # the source's compressed-tensors MXFP4 config lives in text_config, as Kimi-K3's does; it must go
    assert json.loads((source / "config.json").read_text())["text_config"]["quantization_config"]["format"] == (
        "mxfp4-pack-quantized")
    assert "quantization_config" not in config["text_config"]
    for name in ("modeling_kimi_k3.py", "modeling_kimi_linear.py", "configuration_kimi_k3.py", "tokenizer.json",
                 "coverage.json", MANIFEST_NAME):
        assert (export / name).is_file(), name
    assert not list(export.parent.glob(f".{export.name}.*")), "staging directory left behind"
    # the manifest (tensor files hashed by the rank that wrote them, on a thread) holds every file's real sha256
    listed = dict(reversed(line.split("  ", 1)) for line in (export / MANIFEST_NAME).read_text().splitlines())
    on_disk = {p.relative_to(export).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
               for p in export.rglob("*") if p.is_file() and p.name != MANIFEST_NAME}
    assert listed == on_disk


@pytest.mark.parametrize("recipe, world_size, dense", [
    (PRODUCTION, 2, "replicate"), (PRODUCTION, 2, "fsdp"), (PRODUCTION, 4, "replicate"), (PRODUCTION, 4, "fsdp"),
    (FP8, 2, "fsdp"), (FP8, 4, "replicate"), (CALIBRATION_FREE, 2, "fsdp"),
])
def test_ep_export_is_byte_identical_to_single_process(single, source, tmp_path, recipe, world_size, dense):
    out = tmp_path / "export"
    results = run_ranks(calibrate_and_export, world_size,
                        {"ckpt": str(source), "out": str(out), "recipe": recipe, "dense": dense}, timeout_s=400)
    _assert_identical(single[recipe], out)
    # every rank wrote a share: its own experts' files (and dense files round-robin)
    assert all(b > 0 for b in results[0].bytes_written)
    assert sum(results[0].bytes_written) == results[0].total_bytes


# ---- per-rank bodies (run on every rank by run_ranks) ----------------------------------------------------------------


def pipelined_calibrate_and_export(rank: int, world_size: int, ckpt: str, out: str, recipe: str, dense: str):
    """`calibrate_and_export` under EP with the grouped statistics path forced on the CPU, counting the calls
    of the overlapped pipeline's statistics-collecting row function on this rank."""
    with counting_pipelined_calls() as counts:
        result = calibrate_and_export(rank, world_size, ckpt, out, recipe, dense, grouped_statistics="always")
    return {"export": result, "pipelined_calls": counts["pipelined"], "other_calls": counts["other"]}


@pytest.mark.parametrize("world_size, dense", [(2, "replicate"), (4, "replicate"), (2, "fsdp")])
def test_pipelined_calibration_exports_identically(single, source, tmp_path, world_size, dense):
    """Max calibration through the overlapped EP pipeline (`run_rows_collecting` on the received blocks, the
    GPU default, forced here on gloo ranks) exports the bytes of the one-process eager per-expert path."""
    out = tmp_path / "export"
    results = run_ranks(pipelined_calibrate_and_export, world_size,
                        {"ckpt": str(source), "out": str(out), "recipe": PRODUCTION, "dense": dense}, timeout_s=400)
    _assert_identical(single[PRODUCTION], out)
    assert all(b > 0 for b in results[0]["export"].bytes_written)
    for r in results:  # every MoE forward of every rank went through the pipeline (2 chunks each)
        assert r["pipelined_calls"] > 0 and r["other_calls"] == 0, r


def test_uncovered_experts_export_identically(source, tmp_path):
    """Routing forced to experts 0..3 (rank 0's at EP2): the others get no token and take their input scale
    from the layer's shared input quantizer; EP2 and one process still agree byte for byte."""
    ref, out = tmp_path / "single", tmp_path / "ep2"
    calibrate_and_export(0, 1, str(source), str(ref), PRODUCTION, force_experts=[0, 1, 2, 3])
    run_ranks(calibrate_and_export, 2, {"ckpt": str(source), "out": str(out), "recipe": PRODUCTION,
                                        "dense": "replicate", "force_experts": [0, 1, 2, 3]}, timeout_s=300)
    _assert_identical(ref, out)
    coverage = json.loads((out / "coverage.json").read_text())
    assert all(v == list(range(4, 16)) for v in coverage["uncovered"].values())


def test_failed_rank_leaves_no_export(source, tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "keep.txt").write_text("previous export")
    (out / "MANIFEST.sha256").write_text("")  # a finished export: --overwrite may replace it, once the new one is done
    with pytest.raises(RuntimeError) as e:
        run_ranks(calibrate_and_export, 2, {"ckpt": str(source), "out": str(out), "recipe": FP8,
                                            "dense": "replicate", "fail_on_rank": 1}, timeout_s=300)
    message = str(e.value)
    assert "failed during export of layer 1" in message and "rank 1: RuntimeError: injected export failure" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no staging directory left
    assert sorted(p.name for p in out.iterdir()) == ["MANIFEST.sha256", "keep.txt"]  # the previous export is untouched


def test_a_failed_file_write_fails_the_export_and_leaves_nothing(source, tmp_path, monkeypatch):
    """Files are written on the rank's writing thread: a write that fails there (disk full on the second file)
    fails the export with the OS error, and the staging directory is removed; nothing is published."""
    from modelopt_ext.export import writer

    written = []
    write = writer._write_file

    def failing(path, tensors):
        written.append(path.name)
        if len(written) == 2:
            raise OSError(28, "No space left on device", str(path))
        return write(path, tensors)

    monkeypatch.setattr(writer, "_write_file", failing)
    out = tmp_path / "export"
    with pytest.raises(OSError, match="No space left on device"):
        calibrate_and_export(0, 1, str(source), str(out), FP8)
    assert len(written) >= 2
    assert list(tmp_path.iterdir()) == []  # no export, no staging directory


def test_a_signal_while_the_staging_dir_is_made_leaves_nothing(source, tmp_path, monkeypatch):
    """SIGTERM right after rank 0 made its staging dir, before the export holds its path (in a process group the
    ranks then agree on it, a collective a signal can interrupt): the dir is still removed. Before, only its owner
    record was left (found by tests/test_ptq_nodes.py once its trigger fired on the dir, not on a file)."""
    import signal

    from modelopt_ext.export import writer
    from modelopt_ext.export.staging import Interrupted

    made = []
    staging_dir = writer.staging_dir

    def signalled(export_dir, created=None):
        made.append(staging_dir(export_dir, created))
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(writer, "staging_dir", signalled)
    out = tmp_path / "export"
    with pytest.raises(Interrupted) as e:
        calibrate_and_export(0, 1, str(source), str(out), FP8)
    assert e.value.export_discarded and len(made) == 1
    assert list(tmp_path.iterdir()) == []  # no export, no staging directory


def test_every_byte_is_flushed_before_the_export_is_published(source, tmp_path, monkeypatch):
    """Each tensor file is fsynced by its writer, rank 0's files and the directories before the rename, and the
    rename itself after it: a crash cannot leave an export that looks finished with data still in memory."""
    import os

    synced = []
    fsync = os.fsync

    def recording(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    out = tmp_path / "export"
    calibrate_and_export(0, 1, str(source), str(out), FP8)
    staged = {Path(p).relative_to(tmp_path) for p in synced if Path(p).name != out.name and p != str(tmp_path)}
    staging_names = {p.parts[0] for p in staged}
    assert len(staging_names) == 1 and next(iter(staging_names)).startswith(".export.partial-")
    names = {Path(*p.parts[1:]).as_posix() for p in staged if len(p.parts) > 1}
    published = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert published <= names, sorted(published - names)
    assert str(tmp_path) in synced  # the rename, after it
    assert synced.index(str(tmp_path)) == len(synced) - 1


def test_check_export_dir(tmp_path):
    assert check_export_dir(tmp_path / "new", overwrite=False) == (tmp_path / "new").resolve()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ExportDirError, match="is not empty; pass --overwrite"):
        check_export_dir(tmp_path / "full", overwrite=False)
    with pytest.raises(ExportDirError, match="holds no finished modelopt-ext export"):  # not ours: never replaced
        check_export_dir(tmp_path / "full", overwrite=True)
    (tmp_path / "full" / "MANIFEST.sha256").write_text("")
    assert check_export_dir(tmp_path / "full", overwrite=True) == (tmp_path / "full").resolve()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportDirError, match="not a directory"):
        check_export_dir(tmp_path / "file", overwrite=True)


def test_ep8_fsdp_export_is_byte_identical(source, tmp_path):
    """8 gloo ranks (2 experts each), FSDP-sharded dense layers, one batch per rank."""
    ref, out = tmp_path / "single", tmp_path / "ep8"
    calibrate_and_export(0, 1, str(source), str(ref), PRODUCTION, batches=8)
    results = run_ranks(calibrate_and_export, 8, {"ckpt": str(source), "out": str(out), "recipe": PRODUCTION,
                                                  "dense": "fsdp", "batches": 8}, timeout_s=600)
    _assert_identical(ref, out)
    assert len(results[0].bytes_written) == 8 and all(b > 0 for b in results[0].bytes_written)


def test_unquantized_experts_are_refused_before_writing(source, tmp_path):
    """A recipe that leaves the routed experts unquantized: the fused (rank-local) tensors have no per-expert
    form to write, so the export stops at planning, naming the layers."""
    import torch

    import modelopt_ext
    from modelopt_ext.export.writer import export_checkpoint
    from modelopt_ext.quant.recipes import load, quant_config

    model = modelopt_ext.from_pretrained(source, trust_remote_code=True, dtype=torch.float32)
    cfg = quant_config(load(FP8), model.config)
    cfg["quant_cfg"].append({"quantizer_name": "*block_sparse_moe.experts*", "enable": False})
    import modelopt.torch.quantization as mtq

    ids = torch.randint(13, 500, (1, 8), generator=torch.Generator().manual_seed(0))
    model = mtq.quantize(model, dict(cfg), lambda m: m(input_ids=ids, use_cache=False))
    with pytest.raises(ValueError, match=r"routed experts of layers \[1, 2, 3, 4, 5\] .* are not quantized"):
        export_checkpoint(model, tmp_path / "export", source_dir=source)
    assert list(tmp_path.iterdir()) == []


def test_exported_config_replaces_top_level_and_drops_nested_quantization_config():
    source = {"model_type": "m", "text_config": {"hidden_size": 8, "quantization_config": {"format": "mxfp4"}},
              "quantization_config": {"quant_method": "compressed-tensors"}}
    out = exported_config(source, {"quant_method": "modelopt"})
    assert out == {"model_type": "m", "text_config": {"hidden_size": 8}, "quantization_config": {"quant_method": "modelopt"}}
    assert source["text_config"]["quantization_config"] == {"format": "mxfp4"}, "the source mapping is not mutated"
    assert exported_config({"a": 1}, {"q": 2}) == {"a": 1, "quantization_config": {"q": 2}}


def _copies_content(device):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    content = {"b.weight": base.to(device), "a.view": base[:, :4].to(device),  # non-contiguous on CPU
               "c.scale": torch.tensor(0.5).to(device), "d.codes": torch.randint(0, 255, (5, 3), dtype=torch.uint8,
                                                                                generator=g).to(device)}
    content["e.alias"] = content["b.weight"]  # one storage under two keys (safetensors refuses shared ones)
    return content


def _assert_host_copies(content):
    from modelopt_ext.export.writer import host_copies

    out = host_copies(content)
    assert list(out) == sorted(content)
    for key, t in out.items():
        assert t.device.type == "cpu" and t.is_contiguous() and t.dtype == content[key].dtype
        assert torch.equal(t, content[key].cpu()), key
    assert len({t.data_ptr() for t in out.values()}) == len(out)
    return out


def test_host_copies_on_cpu_are_contiguous_and_unshared():
    _assert_host_copies(_copies_content("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned copies of CUDA tensors need a GPU")
def test_host_copies_of_cuda_tensors_are_pinned_and_equal():
    out = _assert_host_copies(_copies_content("cuda"))
    assert all(t.is_pinned() for t in out.values())

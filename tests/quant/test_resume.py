"""quant/resume.py: the calibration state a rank saves (codec, staged files, header comparison) and its
restoration onto a freshly converted model. End-to-end `ptq --resume` runs: tests/test_ptq_resume.py."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
from torch import nn

from modelopt_ext.quant import resume
from modelopt_ext.quant.coverage import Coverage

FP8 = {"num_bits": (4, 3), "axis": None}
CFG = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                     {"quantizer_name": "*weight_quantizer", "cfg": FP8},
                     {"quantizer_name": "*input_quantizer", "cfg": FP8}],
       "algorithm": "max"}


def test_state_dir_is_a_hidden_sibling_of_the_export_dir(tmp_path):
    assert resume.state_dir(tmp_path / "exports" / "kimi-nvfp4") == tmp_path / "exports" / ".kimi-nvfp4.calibration"


def test_codec_round_trips_quantizer_properties():
    values = {"none": None, "flag": True, "bits": 8, "scale": 0.5, "inf": float("inf"), "name": "dynamic",
              "axis": (0, 2), "num_bits": (4, 3), "slices": [slice(None, 2, None), slice(None, None, None)],
              "blocks": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}, "dtype": torch.bfloat16,
              "shape": torch.Size([2, 8, 16]), "nested": [(1, [2, (3,)])]}
    encoded = json.loads(json.dumps({k: resume._encode(v, k) for k, v in values.items()}))
    decoded = {k: resume._decode(v) for k, v in encoded.items()}
    assert decoded == values
    assert type(decoded["shape"]) is torch.Size and type(decoded["axis"]) is tuple
    assert math.isnan(resume._decode(json.loads(json.dumps(resume._encode(float("nan"), "x")))))
    with pytest.raises(ValueError, match=r"q.weight_quantizer._odd is a object"):
        resume._encode([object()], "q.weight_quantizer._odd")


def _header(**changes) -> dict:
    header = {"rank": 0, "world_size": 2, "ep_size": 2,
              "config": {"--calib-size": 64, "--dataset": None, "--set": []},
              "checkpoint": {"config.json": "sha256:aa", "model-00001-of-00003.safetensors": "size:1 header:2 data:3",
                             "model-00002-of-00003.safetensors": "size:1 header:2 data:4"},
              "inputs": {"--recipe file": "a" * 64}, "versions": {"nvidia-modelopt": "0.47.0", "torch": "2.13.0"}}
    for key, value in changes.items():
        header[key] = {**header[key], **value} if isinstance(value, dict) else value
    return header


def test_differences_name_what_changed():
    saved = _header()
    assert resume.differences(saved, _header()) == []
    now = _header(world_size=4, ep_size=4, config={"--calib-size": 32, "--dataset": "calib.jsonl"},
                  checkpoint={"model-00001-of-00003.safetensors": "size:1 header:2 data:9"},
                  inputs={"--recipe file": "b" * 64}, versions={"nvidia-modelopt": "0.48.0"})
    assert resume.differences(saved, now) == [
        "world size was 2, now 4", "EP degree was 2, now 4",
        "--calib-size was 64, now 32", "--dataset was not given, now 'calib.jsonl'",
        "checkpoint files differ: model-00001-of-00003.safetensors",
        "--recipe file changed (sha256 was aaaaaaaaaaaa..., now bbbbbbbbbbbb...)",
        "nvidia-modelopt was 0.47.0, now 0.48.0"]
    one = _header(world_size=1, ep_size=None)
    assert resume.differences(saved, one)[:2] == ["world size was 2, now 1", "EP degree was 2, now none"]
    gone = _header()
    del gone["checkpoint"]["model-00002-of-00003.safetensors"]
    assert resume.differences(saved, gone) == ["checkpoint files differ: model-00002-of-00003.safetensors (gone)"]


def _calibrated(seed: int = 0):
    """A one-layer model quantized and max-calibrated by ModelOpt (FP8 weight and input), its input batch, and
    a stand-in for its CalibrationResult."""
    import modelopt.torch.quantization as mtq

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 8))
    x = torch.randn(4, 16) * 3
    model = mtq.quantize(model, CFG, lambda m: m(x))
    coverage = Coverage(4, {"gate": torch.tensor([3, 0, 5, 1])})
    result = types.SimpleNamespace(model=model, coverage=coverage, sync={"quantizers": 2},
                                   max_weight_amax={"0.weight_quantizer": torch.tensor(1.5)})
    return model, x, result


def test_a_restored_model_quantizes_as_the_calibrated_one(tmp_path):
    calibrated, x, result = _calibrated()
    header = {"rank": 0, "world_size": 1, "run": "r"}
    resume.save_state(tmp_path / "state", header, result, tokens=64)
    saved = resume.read_header(tmp_path / "state", 0)
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["rank0.json", "rank0.safetensors"]

    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(16, 8))  # the same weights, never calibrated
    restored, tokens = resume.restore(fresh, CFG, tmp_path / "state", saved)
    assert tokens == 64 and restored.coverage.table() == {"gate": [3, 0, 5, 1]}
    assert restored.max_weight_amax["0.weight_quantizer"].item() == 1.5
    for name in ("0.weight_quantizer", "0.input_quantizer"):
        a, b = calibrated.get_submodule(name), restored.model.get_submodule(name)
        assert a.amax is not None and torch.equal(a.amax, b.amax) and a.amax.dtype == b.amax.dtype, name
        assert (a._if_quant, a._if_calib, a._disabled) == (b._if_quant, b._if_calib, b._disabled)
    with torch.no_grad():
        assert torch.equal(calibrated(x), restored.model(x))  # the fake-quantized outputs, bit for bit


def test_a_write_interrupted_before_the_header_leaves_no_complete_state(tmp_path, monkeypatch):
    _, _, result = _calibrated()
    directory = tmp_path / "state"
    resume.save_state(directory, {"rank": 0, "world_size": 1, "run": "old"}, result, tokens=8)
    real = resume.os.replace

    def crash(src, dst):
        if str(dst).endswith(".json"):
            raise OSError("disk full")
        real(src, dst)

    monkeypatch.setattr(resume.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        resume.save_state(directory, {"rank": 0, "world_size": 1, "run": "new"}, result, tokens=8)
    monkeypatch.undo()
    assert not [p for p in directory.iterdir() if resume.TMP_MARK in p.name]  # no temporary file left
    with pytest.raises(resume.StateError, match=r"no saved calibration state for rank 0: .*rank0.json does not exist"):
        resume.read_header(directory, 0)


def test_a_damaged_tensors_file_is_refused(tmp_path):
    _, _, result = _calibrated()
    resume.save_state(tmp_path, {"rank": 0, "world_size": 1, "run": "r"}, result, tokens=8)
    data = bytearray((tmp_path / "rank0.safetensors").read_bytes())
    data[-1] ^= 1
    (tmp_path / "rank0.safetensors").write_bytes(bytes(data))
    with pytest.raises(resume.StateError, match=r"rank0.safetensors does not match .*rank0.json .*damaged"):
        resume.read_header(tmp_path, 0)


def test_saving_drops_the_ranks_of_an_earlier_larger_run_and_removal_leaves_nothing(tmp_path):
    _, _, result = _calibrated()
    for rank in range(4):
        resume.save_state(tmp_path / "s", {"rank": rank, "world_size": 4, "run": "big"}, result, tokens=8)
    resume.save_state(tmp_path / "s", {"rank": 1, "world_size": 2, "run": "small"}, result, tokens=8)
    resume.save_state(tmp_path / "s", {"rank": 0, "world_size": 2, "run": "small"}, result, tokens=8)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [
        "rank0.json", "rank0.safetensors", "rank1.json", "rank1.safetensors"]
    resume.remove_state(tmp_path / "s", 1)
    resume.remove_state(tmp_path / "s", 0)
    assert not (tmp_path / "s").exists()


def test_the_location_gets_the_export_targets_checks(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with pytest.raises(resume.StateError, match="lies inside the checkpoint"):
        resume.check_location(resume.state_dir(ckpt / "out"), ckpt, {})
    dataset = tmp_path / ".out.calibration" / "calib.jsonl"
    with pytest.raises(resume.StateError, match=r"--dataset .*calib.jsonl lies inside"):
        resume.check_location(resume.state_dir(tmp_path / "out"), ckpt, {"--dataset": dataset})
    (tmp_path / ".file.calibration").write_text("x")
    with pytest.raises(resume.StateError, match=r"\.file\.calibration exists and is not a directory"):
        resume.check_location(resume.state_dir(tmp_path / "file"), ckpt, {})
    resume.check_location(resume.state_dir(tmp_path / "out"), ckpt, {})


def test_a_saved_dtype_must_name_a_dtype():
    """A header names dtypes by their torch name; anything else torch exports (a function) is refused."""
    from modelopt_ext.quant.resume import _decode

    assert _decode({"dtype": "bfloat16"}) is torch.bfloat16
    with pytest.raises(ValueError, match="'load' in a saved quantizer property is not a torch dtype"):
        _decode({"dtype": "load"})

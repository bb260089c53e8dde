"""Every refusal of modelopt_ext.from_pretrained names the problem, and leaves nothing patched."""

import json
import logging

import pytest
from transformers.conversion_mapping import USER_REGISTERED_MAPPINGS, get_checkpoint_conversion_mapping

import modelopt_ext
from modelopt_ext.lock import RemoteCodeMismatch, sha256_file, write_lock
from modelopt_ext.models.kimi_k3.adapter import CheckpointError
from modelopt_ext.models.kimi_k3.kda import KdaPatchError
from modelopt_ext.models.kimi_k3.patch import PATCHED_ATTR
from modelopt_ext.testing.checkpoints import copy_checkpoint, remote_module

MM_CLASS = "KimiK3ForConditionalGeneration"


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path, request):
    # a plain identifier unique to the test, so each copy has its own remote-code module
    name = "refusal_" + "".join(c if c.isalnum() else "_" for c in request.node.name)
    return copy_checkpoint(tiny_ckpt, tmp_path, name)


def assert_untouched(checkpoint):
    """The checkpoint's remote modules are unpatched (or were never imported) and no mapping is left."""
    assert get_checkpoint_conversion_mapping(MM_CLASS) is None
    assert MM_CLASS not in USER_REGISTERED_MAPPINGS
    text = remote_module(checkpoint, "modeling_kimi_linear")
    if text is not None:
        assert not text.__dict__.get(PATCHED_ATTR)
        assert hasattr(text.KimiSparseMoeBlock, "moe_infer"), "the upstream MoE block must still be in place"
        assert not hasattr(text.chunk_kda, "_modelopt_ext_kda_patch")
        assert text.KimiDynamicCache.__module__ == text.__name__


def _edit_config(checkpoint, **changes):
    path = checkpoint / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        *path_keys, leaf = key.split("__")
        node = config
        for k in path_keys:
            node = node[k]
        node[leaf] = value
    path.write_text(json.dumps(config))


def _load(checkpoint, **kwargs):
    return modelopt_ext.from_pretrained(checkpoint, **{"trust_remote_code": True, **kwargs})


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _load(tmp_path / "nope")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        _load(ckpt)
    assert_untouched(ckpt)


def test_garbled_config(ckpt):
    (ckpt / "config.json").write_text('{"model_type": "kimi_k3", ')
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        _load(ckpt)
    assert_untouched(ckpt)


def test_unknown_model_type(ckpt):
    _edit_config(ckpt, model_type="llama")
    with pytest.raises(ValueError, match="model_type 'llama' has no modelopt_ext family"):
        _load(ckpt)
    assert_untouched(ckpt)


def test_wrong_text_model_type(ckpt):
    _edit_config(ckpt, text_config__model_type="deepseek_v3")
    with pytest.raises(ValueError, match="text_config.model_type is 'deepseek_v3'"):
        _load(ckpt)
    assert_untouched(ckpt)


@pytest.mark.parametrize("trust", [None, False])
def test_trust_remote_code_required(ckpt, trust):
    kwargs = {} if trust is None else {"trust_remote_code": trust}
    with pytest.raises(CheckpointError, match="pass trust_remote_code=True"):
        modelopt_ext.from_pretrained(ckpt, **kwargs)
    assert_untouched(ckpt)
    assert remote_module(ckpt, "modeling_kimi_linear") is None  # no remote code ran


def test_reserved_arguments(ckpt):
    with pytest.raises(CheckpointError, match=r"\['quantization_config'\] are set by modelopt_ext"):
        _load(ckpt, quantization_config=object())
    assert_untouched(ckpt)


def test_auto_map_must_name_the_multimodal_class(ckpt):
    _edit_config(ckpt, auto_map__AutoModelForCausalLM="modeling_kimi_linear.KimiLinearForCausalLM")
    with pytest.raises(CheckpointError, match="auto_map.AutoModelForCausalLM is 'modeling_kimi_linear"):
        _load(ckpt)
    assert_untouched(ckpt)


def test_unsupported_quantization_format(ckpt):
    _edit_config(ckpt, text_config__quantization_config__format="nvfp4-pack-quantized")
    with pytest.raises(CheckpointError, match="format='nvfp4-pack-quantized'"):
        _load(ckpt)
    assert_untouched(ckpt)


def test_modified_remote_code_names_file_and_both_hashes(ckpt):
    target = ckpt / "modeling_kimi_linear.py"
    locked = sha256_file(target)
    target.write_text(target.read_text() + "\nprint('pwned')\n")
    with pytest.raises(RemoteCodeMismatch) as err:
        _load(ckpt)
    message = str(err.value)
    assert "modeling_kimi_linear.py has sha256" in message
    assert sha256_file(target) in message and locked in message
    assert_untouched(ckpt)
    assert remote_module(ckpt, "modeling_kimi_linear") is None


def test_unknown_and_missing_remote_code_files(ckpt):
    (ckpt / "helpers.py").write_text("x = 1\n")
    (ckpt / "modeling_kimi_k3.py").unlink()
    with pytest.raises(RemoteCodeMismatch) as err:
        _load(ckpt)
    assert "unknown file helpers.py" in str(err.value)
    assert "modeling_kimi_k3.py" in str(err.value) and "missing from the checkpoint" in str(err.value)
    assert_untouched(ckpt)


def test_user_lock_admits_reviewed_code(ckpt, tmp_path, caplog):
    target = ckpt / "modeling_kimi_linear.py"
    target.write_text(target.read_text() + "\n# reviewed local change\n")
    with caplog.at_level(logging.WARNING, logger="modelopt_ext.lock"):
        lock = write_lock(ckpt, tmp_path / "reviewed.lock.json", revision="local-review")
    assert "only lock code you have reviewed" in caplog.text
    model = _load(ckpt, remote_code_lock=lock.source)
    assert type(model.language_model.model.layers[1].block_sparse_moe.experts).__name__ == "KimiK3PackedExperts"


def test_version_floor(ckpt, monkeypatch):
    import modelopt_ext.versions

    real = modelopt_ext.versions.installed_version
    monkeypatch.setattr(
        modelopt_ext.versions, "installed_version", lambda d: "5.20.0" if d == "transformers" else real(d)
    )
    with pytest.raises(RuntimeError, match="transformers 5.20.0 is below the supported floor 5.23"):
        _load(ckpt)
    assert_untouched(ckpt)
    assert remote_module(ckpt, "modeling_kimi_linear") is None


def _relock(ckpt, tmp_path):
    return write_lock(ckpt, tmp_path / "edited.lock.json", revision="edited").source


def test_missing_class_to_patch(ckpt, tmp_path):
    target = ckpt / "modeling_kimi_linear.py"
    target.write_text(target.read_text().replace("KimiMoEGate", "KimiRouterGate"))
    with pytest.raises(CheckpointError, match=r"lacks the classes the adapter patches: \[.*KimiMoEGate'\]"):
        _load(ckpt, remote_code_lock=_relock(ckpt, tmp_path))
    assert_untouched(ckpt)


def test_unknown_kda_kernel(ckpt, tmp_path):
    target = ckpt / "modeling_kimi_linear.py"
    target.write_text(target.read_text() + "\n\nchunk_kda = max\n")
    with pytest.raises(KdaPatchError, match="chunk_kda"):
        _load(ckpt, remote_code_lock=_relock(ckpt, tmp_path))
    assert_untouched(ckpt)


def _poison_scale(checkpoint, key, row, group):
    """Write the E8M0 NaN byte 255 at [row, group] of checkpoint scale tensor `key`, in place; returns its shard."""
    import struct

    shard = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"][key]
    with (checkpoint / shard).open("r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))[key]
        f.seek(8 + n + meta["data_offsets"][0] + row * meta["shape"][1] + group)
        f.write(b"\xff")
    return shard


@pytest.mark.parametrize("key,row,group", [
    ("language_model.model.layers.3.block_sparse_moe.experts.5.w3.weight_scale", 7, 1),  # second half of gate_up
    ("language_model.model.layers.2.block_sparse_moe.experts.15.w2.weight_scale", 0, 0),
])
def test_nan_scale_names_the_checkpoint_tensor(ckpt, key, row, group):
    shard = _poison_scale(ckpt, key, row, group)
    with pytest.raises(CheckpointError) as err:
        _load(ckpt)
    assert str(err.value) == (f"checkpoint {ckpt}: tensor {key} in {shard}: scale contains 1 byte(s) equal to 255 "
                              f"(E8M0 NaN, reserved), first at index ({row}, {group}); expected bytes in 0..254")

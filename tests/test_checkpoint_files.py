"""Pre-flight checks of a checkpoint folder's files: every refusal names the file and the offending key."""

import json
import logging
import os
import struct
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from modelopt_ext.checkpoint_files import CheckpointFiles, CheckpointFilesError, check_checkpoint_files
from modelopt_ext.testing.checkpoints import copy_checkpoint

INDEX = "model.safetensors.index.json"
SHARD1, SHARD2, SHARD3 = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path):
    return copy_checkpoint(tiny_ckpt, tmp_path, "ckpt_copy")


def _header(path: Path) -> tuple[int, dict]:
    """(header length, header) read by hand from the safetensors format: u64 little-endian length + JSON."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return n, header


def _edit_index(ckpt: Path, edit) -> None:
    index = json.loads((ckpt / INDEX).read_text())
    edit(index)
    (ckpt / INDEX).write_text(json.dumps(index))


def _refusal(ckpt: Path, *expected: str) -> str:
    with pytest.raises(CheckpointFilesError) as err:
        check_checkpoint_files(ckpt)
    message = str(err.value)
    for text in expected:
        assert text in message, message
    return message


def _first_key(shard: Path) -> str:
    return sorted(_header(shard)[1])[0]


# ----------------------------------------------------------------------------------------------------
# valid checkpoints


def test_tiny_checkpoint_passes_with_right_counts(tiny_ckpt):
    files = check_checkpoint_files(tiny_ckpt)
    assert isinstance(files, CheckpointFiles)
    assert files.config == json.loads((tiny_ckpt / "config.json").read_text())
    assert files.shards == (SHARD1, SHARD2, SHARD3)
    expected_map, expected_bytes = {}, 0
    for shard in files.shards:  # independent reference: safetensors itself, reading the tensors
        with safe_open(str(tiny_ckpt / shard), framework="pt") as f:
            for key in f.keys():
                expected_map[key] = shard
                t = f.get_tensor(key)
                expected_bytes += t.numel() * t.element_size()
    assert dict(files.tensors) == expected_map == json.loads((tiny_ckpt / INDEX).read_text())["weight_map"]
    assert len(files.tensors) == 670 and files.total_bytes == expected_bytes
    with pytest.raises(TypeError):
        files.tensors["x"] = SHARD1


def test_single_file_without_index(ckpt):
    tensors = {}
    for shard in (SHARD1, SHARD2, SHARD3):
        with safe_open(str(ckpt / shard), framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
        (ckpt / shard).unlink()
    (ckpt / INDEX).unlink()
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    files = check_checkpoint_files(ckpt)
    assert files.shards == ("model.safetensors",) and len(files.tensors) == len(tensors) == 670
    assert set(files.tensors.values()) == {"model.safetensors"}
    assert files.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_wrong_total_size_only_warns(ckpt, caplog):
    _edit_index(ckpt, lambda index: index["metadata"].update(total_size=12345))
    with caplog.at_level(logging.WARNING, logger="modelopt_ext.checkpoint_files"):
        check_checkpoint_files(ckpt)
    assert "metadata.total_size 12345" in caplog.text


def test_headers_only_on_a_huge_shard(tmp_path):
    """A 1 TiB (sparse) shard is checked from its header alone; reading its data would take minutes."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    header = json.dumps({"w": {"dtype": "U8", "shape": [2**40], "data_offsets": [0, 2**40]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    try:
        os.truncate(path, 8 + len(header) + 2**40)
    except OSError:
        pytest.skip("no sparse files on this filesystem")
    files = check_checkpoint_files(tmp_path)
    assert files.total_bytes == 2**40 and dict(files.tensors) == {"w": "model.safetensors"}


# ----------------------------------------------------------------------------------------------------
# folder and config.json


def test_missing_folder(tmp_path):
    _refusal(tmp_path / "nope", str(tmp_path / "nope"), "does not exist")


@pytest.mark.parametrize("content,expected", [
    (None, ["is missing"]),
    ('{\n  "model_type": "kimi_k3",\n  oops\n}', ["is not valid JSON", "line 3 column 3"]),
    ("[1, 2]", ["must hold a JSON object, got list"]),
    ('{"architectures": ["X"]}', ['has no "model_type" string (got None)']),
    ('{"model_type": 3}', ['has no "model_type" string (got 3)']),
    ('{"model_type": ""}', ['has no "model_type" string (got \'\')']),
], ids=["missing", "not-json", "not-object", "no-model-type", "int-model-type", "empty-model-type"])
def test_bad_config(ckpt, content, expected):
    if content is None:
        (ckpt / "config.json").unlink()
    else:
        (ckpt / "config.json").write_text(content)
    _refusal(ckpt, str(ckpt / "config.json"), *expected)


# ----------------------------------------------------------------------------------------------------
# shards and index


def test_no_safetensors(ckpt):
    for path in ckpt.glob("*.safetensors*"):
        path.unlink()
    _refusal(ckpt, f"no *.safetensors file in {ckpt}")


def test_several_shards_without_index(ckpt):
    (ckpt / INDEX).unlink()
    _refusal(ckpt, str(ckpt), f"3 safetensors files ({SHARD1}, {SHARD2}, {SHARD3}) but no {INDEX}")


def test_garbled_index(ckpt):
    (ckpt / INDEX).write_text('{"weight_map": {\n  "a": }')
    _refusal(ckpt, str(ckpt), f"{INDEX}: unreadable JSON", "line 2 column 8", f"{INDEX}: no weight_map object")


@pytest.mark.parametrize("index", [{"metadata": {}}, {"weight_map": ["a"]}])
def test_index_without_weight_map_object(ckpt, index):
    (ckpt / INDEX).write_text(json.dumps(index))
    _refusal(ckpt, f"checkpoint {ckpt}", f"{INDEX}: no weight_map object")


def test_index_names_missing_shard_file(ckpt):
    key = _first_key(ckpt / SHARD1)
    _edit_index(ckpt, lambda index: index["weight_map"].update({key: "model-00009-of-00003.safetensors"}))
    message = _refusal(ckpt, f"{INDEX}: tensor {key} is mapped to shard model-00009-of-00003.safetensors, "
                             "which does not exist")
    assert message.startswith(f"checkpoint {ckpt}: ")  # one problem, one line


def test_deleted_shard_is_one_problem_naming_its_tensors(ckpt):
    keys = sorted(_header(ckpt / SHARD3)[1])
    (ckpt / SHARD3).unlink()
    message = _refusal(ckpt, f"checkpoint {ckpt}: {INDEX}: {len(keys)} tensors are mapped to shard {SHARD3}, "
                             f"which does not exist (first: {', '.join(keys[:3])}, ...)")
    assert len(message.splitlines()) == 1


def test_many_problems_are_listed_capped(ckpt):
    keys = sorted(_header(ckpt / SHARD1)[1])
    _edit_index(ckpt, lambda index: index["weight_map"].update({k: f"gone-{i}.safetensors" for i, k in enumerate(keys)}))
    message = _refusal(ckpt, f"checkpoint {ckpt} has ", f"tensor {keys[0]} is mapped to shard gone-0.safetensors, "
                       "which does not exist", "more")
    assert len(message.splitlines()) == 1 + 20 + 1


def test_index_maps_tensor_to_the_wrong_shard(ckpt):
    key = _first_key(ckpt / SHARD1)
    _edit_index(ckpt, lambda index: index["weight_map"].update({key: SHARD2}))
    _refusal(ckpt, f"{INDEX}: tensor {key} is mapped to {SHARD2} but stored in {SHARD1}")


def test_index_names_tensor_no_shard_holds(ckpt):
    _edit_index(ckpt, lambda index: index["weight_map"].update({"ghost.weight": SHARD2}))
    _refusal(ckpt, f"tensor ghost.weight is listed in {INDEX} (shard {SHARD2}) but missing from every shard")


def test_tensor_missing_from_index(ckpt):
    key = _first_key(ckpt / SHARD2)
    _edit_index(ckpt, lambda index: index["weight_map"].pop(key))
    _refusal(ckpt, f"tensor {key} in {SHARD2} is not listed in {INDEX}")


def test_tensor_in_two_shards(ckpt):
    key = _first_key(ckpt / SHARD1)
    with safe_open(str(ckpt / SHARD2), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(str(ckpt / SHARD1), framework="pt") as f:
        tensors[key] = f.get_tensor(key)
    save_file(tensors, str(ckpt / SHARD2), metadata={"format": "pt"})
    _refusal(ckpt, f"tensor {key} is stored in 2 shards: {SHARD1}, {SHARD2}")


def test_truncated_shard(ckpt):
    n, header = _header(ckpt / SHARD2)
    data_len = (ckpt / SHARD2).stat().st_size - 8 - n - 10
    os.truncate(ckpt / SHARD2, 8 + n + data_len)
    cut = sorted(k for k, meta in header.items() if meta["data_offsets"][1] > data_len)
    assert cut
    begin, end = header[cut[0]]["data_offsets"]
    _refusal(ckpt, str(ckpt), f"{SHARD2}: tensor {cut[0]} data_offsets [{begin}, {end}] do not hold",
             f"inside the {data_len}-byte data section")


@pytest.mark.parametrize("length", [2**40, 2**64 - 1])
def test_header_length_beyond_file(ckpt, length):
    size = (ckpt / SHARD1).stat().st_size
    with (ckpt / SHARD1).open("r+b") as f:
        f.write(struct.pack("<Q", length))
    _refusal(ckpt, f"{SHARD1}: not a safetensors file (header length {length}, file size {size})")


def test_shard_shorter_than_header_length_field(ckpt):
    (ckpt / SHARD1).write_bytes(b"\x01\x02\x03")
    _refusal(ckpt, f"{SHARD1}: not a safetensors file", "file size 3")


def test_shard_header_not_json(ckpt):
    with (ckpt / SHARD3).open("r+b") as f:
        f.seek(8)
        f.write(b"{oops")
    _refusal(ckpt, f"{SHARD3}: unreadable safetensors header", "line 1 column 2")


@pytest.mark.parametrize("name,expected", [
    ("config.json", "{ckpt}/config.json is unreadable: Permission denied"),
    (SHARD2, "checkpoint {ckpt}: cannot read {ckpt}/" + SHARD2 + ": Permission denied"),
])
def test_unreadable_file(ckpt, monkeypatch, name, expected):
    real = Path.open  # tests run as root, where chmod 000 does not stop reading

    def open_(self, *args, **kwargs):
        if self == ckpt / name:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)
    _refusal(ckpt, expected.format(ckpt=ckpt))

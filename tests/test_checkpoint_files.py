"""Pre-flight checks of a checkpoint folder's files: every refusal names the file and the offending key."""

import json
import logging
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from modelopt_ext.checkpoint_files import (
    CheckpointFiles,
    CheckpointFilesError,
    check_checkpoint_files,
    check_tokenizer_files,
    checkpoint_fingerprint,
)
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
    assert len(files.tensors) == 654 and files.total_bytes == expected_bytes
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
    assert files.shards == ("model.safetensors",) and len(files.tensors) == len(tensors) == 654
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
    message = _refusal(ckpt, str(ckpt), f"{SHARD2}: tensor {cut[0]} data_offsets [{begin}, {end}] do not hold",
                       f"inside the {data_len}-byte data section")
    assert "after the last tensor" not in message and "unused between" not in message


def test_junk_after_the_last_tensor(ckpt):
    n, header = _header(ckpt / SHARD2)
    held = max(meta["data_offsets"][1] for meta in header.values())
    assert (ckpt / SHARD2).stat().st_size == 8 + n + held  # safetensors writes no trailing bytes
    with (ckpt / SHARD2).open("ab") as f:
        f.write(b"\x00" * 4096)
    message = _refusal(ckpt, f"checkpoint {ckpt}: {SHARD2}: 4096 bytes after the last tensor's data (data section "
                             f"holds {held} bytes, the file has {held + 4096} after the header)")
    assert len(message.splitlines()) == 1


@pytest.mark.parametrize("length", [1, 3])
def test_header_length_too_short(ckpt, length):
    with (ckpt / SHARD1).open("r+b") as f:
        f.write(struct.pack("<Q", length))
    expected = "is too short for a JSON header" if length < 2 else "is too short: the JSON header is cut off after 3"
    _refusal(ckpt, f"checkpoint {ckpt}: {SHARD1}: header length {length} {expected}")


def test_header_length_cutting_the_header_in_half(ckpt):
    n, _ = _header(ckpt / SHARD3)
    with (ckpt / SHARD3).open("r+b") as f:
        f.write(struct.pack("<Q", n // 2))
    _refusal(ckpt, f"{SHARD3}: header length {n // 2} is too short: the JSON header is cut off after {n // 2} bytes")


@pytest.mark.parametrize("length", [2**40, 2**64 - 1])
def test_header_length_beyond_file(ckpt, length):
    size = (ckpt / SHARD1).stat().st_size
    with (ckpt / SHARD1).open("r+b") as f:
        f.write(struct.pack("<Q", length))
    _refusal(ckpt, f"{SHARD1}: not a safetensors file (header length {length}, file size {size}): the header "
                   "would end past the end of the file")


def test_shard_shorter_than_header_length_field(ckpt):
    (ckpt / SHARD1).write_bytes(b"\x01\x02\x03")
    _refusal(ckpt, f"{SHARD1}: not a safetensors file (file size 3: shorter than the 8-byte header length field)")


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


# ----------------------------------------------------------------------------------------------------
# config.json sizes against the shard headers


def _edit_text_config(ckpt: Path, **changes) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"].update(changes)
    (ckpt / "config.json").write_text(json.dumps(config))


def _all_headers(ckpt: Path) -> dict[str, tuple[str, dict]]:
    """tensor name -> (shard, header entry), from the files by hand."""
    return {key: (shard, meta) for shard in (SHARD1, SHARD2, SHARD3) for key, meta in _header(ckpt / shard)[1].items()}


def _moe_layers(ckpt: Path) -> list[int]:
    return sorted({int(k.split(".layers.")[1].split(".")[0]) for k in _all_headers(ckpt) if ".experts.0.w1." in k})


def test_stand_in_sizes_agree_with_its_headers(tiny_ckpt):
    text = json.loads((tiny_ckpt / "config.json").read_text())["text_config"]
    headers = _all_headers(tiny_ckpt)
    embed = headers["language_model.model.embed_tokens.weight"][1]["shape"]
    assert embed == [text["vocab_size"], text["hidden_size"]] and text["num_experts"] == 16
    assert _moe_layers(tiny_ckpt) == [1, 2, 3, 4, 5]
    check_checkpoint_files(tiny_ckpt)


@pytest.mark.parametrize("num_experts", [20, 8])
def test_num_experts_contradicting_the_expert_ids(ckpt, num_experts):
    _edit_text_config(ckpt, num_experts=num_experts)
    example = "language_model.model.layers.1.block_sparse_moe.experts.15.w1.weight_packed"
    shard = _all_headers(ckpt)[example][0]
    message = _refusal(ckpt, f"checkpoint {ckpt}: config.json: text_config.num_experts is {num_experts}, but the shard "
                             f"headers hold 16 routed experts (ids 0..15) in layers 1..5 (e.g. tensor {example} in "
                             f"{shard}); expected ids 0..{num_experts - 1} in every MoE layer")
    assert len(message.splitlines()) == 1


def test_expert_missing_from_one_layer(ckpt):
    gone = "language_model.model.layers.3.block_sparse_moe.experts.9."
    shard = _all_headers(ckpt)[gone + "w1.weight_packed"][0]
    with safe_open(str(ckpt / shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(gone)}
    save_file(tensors, str(ckpt / shard), metadata={"format": "pt"})
    _edit_index(ckpt, lambda index: [index["weight_map"].pop(k) for k in list(index["weight_map"]) if k.startswith(gone)])
    _refusal(ckpt, f"checkpoint {ckpt}: config.json: text_config.num_experts is 16, but the shard headers hold 15 "
                   "routed experts (ids 0..8, 10..15) in layer 3 (e.g. tensor "
                   f"language_model.model.layers.3.block_sparse_moe.experts.15.w1.weight_packed in {shard}); "
                   "expected ids 0..15 in every MoE layer")


def test_top_k_above_the_number_of_experts(ckpt):
    _edit_text_config(ckpt, num_experts_per_token=17)
    _refusal(ckpt, f"checkpoint {ckpt}: config.json: text_config.num_experts_per_token is 17, more than the 16 routed "
                   "experts per layer (text_config.num_experts): top-k must be at most the number of experts")


def test_hidden_size_contradicting_embedding_norm_and_lm_head(ckpt):
    _edit_text_config(ckpt, hidden_size=256)
    headers = _all_headers(ckpt)
    message = _refusal(ckpt, f"checkpoint {ckpt} has 3 problems")
    for key, dim in (("language_model.model.embed_tokens.weight", 1), ("language_model.lm_head.weight", 1),
                     ("language_model.model.norm.weight", 0)):
        shard, meta = headers[key]
        assert (f"config.json: text_config.hidden_size is 256, but tensor {key} in {shard} has shape {meta['shape']} "
                f"(dim {dim}, the hidden size, should be 256)") in message, message


def test_vocab_size_contradicting_embedding_and_lm_head_rows(ckpt):
    _edit_text_config(ckpt, vocab_size=1000)
    headers = _all_headers(ckpt)
    message = _refusal(ckpt, f"checkpoint {ckpt} has 2 problems")
    for key in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight"):
        shard, meta = headers[key]
        assert (f"config.json: text_config.vocab_size is 1000, but tensor {key} in {shard} has shape {meta['shape']} "
                "(dim 0, one row per token, should be 1000)") in message, message


@pytest.mark.parametrize("value", [0, "16", 16.0, True])
def test_num_experts_not_a_size(ckpt, value):
    _edit_text_config(ckpt, num_experts=value)
    _refusal(ckpt, f"config.json: text_config.num_experts is {value!r}, expected a positive integer")


def test_top_level_sizes_of_a_config_without_text_config(tmp_path):
    """Families whose sizes sit at the top of config.json, with DeepSeek's / Mixtral's key names."""
    tensors = {f"model.layers.0.mlp.experts.{e}.w1.weight": torch.zeros(2, 4) for e in range(3)}
    tensors["model.embed_tokens.weight"] = torch.zeros(10, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = {"model_type": "x", "hidden_size": 4, "vocab_size": 10, "n_routed_experts": 3, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_checkpoint_files(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_routed_experts": 4, "num_experts_per_tok": 5}))
    message = _refusal(tmp_path, "config.json: n_routed_experts is 4, but the shard headers hold 3 routed experts "
                                 "(ids 0..2) in layer 0", "config.json: num_experts_per_tok is 5, more than the 4")
    assert "has 2 problems" in message


# ----------------------------------------------------------------------------------------------------
# MXFP4 scales (opt-in)


def _poison_scale(ckpt: Path, key: str, row: int, group: int) -> str:
    """Write the E8M0 NaN byte 255 at [row, group] of a uint8 scale tensor, in place; returns its shard."""
    shard = _all_headers(ckpt)[key][0]
    n, header = _header(ckpt / shard)
    begin = header[key]["data_offsets"][0]
    columns = header[key]["shape"][1]
    with (ckpt / shard).open("r+b") as f:
        f.seek(8 + n + begin + row * columns + group)
        f.write(b"\xff")
    return shard


def test_nan_scale_refused_with_scales_naming_tensor_and_shard(ckpt):
    key = "language_model.model.layers.3.block_sparse_moe.experts.5.w3.weight_scale"
    shard = _poison_scale(ckpt, key, 7, 1)
    check_checkpoint_files(ckpt)  # headers only by default: the data is not read
    with safe_open(str(ckpt / shard), framework="pt") as f:
        assert int(f.get_tensor(key)[7, 1]) == 255
    with pytest.raises(CheckpointFilesError) as err:
        check_checkpoint_files(ckpt, scales=True)
    assert str(err.value) == (f"checkpoint {ckpt}: tensor {key} in {shard}: scale contains 1 byte(s) equal to 255 "
                              "(E8M0 NaN, reserved), first at index (7, 1); expected bytes in 0..254")


def test_scales_check_passes_on_the_stand_in(tiny_ckpt):
    assert check_checkpoint_files(tiny_ckpt, scales=True).shards == (SHARD1, SHARD2, SHARD3)


# ----------------------------------------------------------------------------------------------------
# tokenizer files


def test_stand_in_tokenizer_files_pass(tiny_ckpt):
    assert sorted(p.name for p in tiny_ckpt.glob("tokenizer*")) == ["tokenizer.json", "tokenizer_config.json"]
    check_tokenizer_files(tiny_ckpt)


def _tokenizer_refusal(ckpt: Path, expected: str) -> str:
    with pytest.raises(CheckpointFilesError) as err:
        check_tokenizer_files(ckpt)
    assert str(err.value).startswith(f"checkpoint {ckpt}: {expected}"), str(err.value)
    return str(err.value)


def test_missing_tokenizer_config(ckpt):
    (ckpt / "tokenizer_config.json").unlink()
    _tokenizer_refusal(ckpt, "tokenizer_config.json is missing: the tokenizer's class, special tokens and chat "
                             "template would silently be left out")


def test_missing_tokenizer_json(ckpt):
    (ckpt / "tokenizer.json").unlink()
    _tokenizer_refusal(ckpt, "no tokenizer vocabulary file: expected tokenizer.json (or one of tokenizer.model, "
                             "tiktoken.model, vocab.json, vocab.txt, spiece.model)")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_truncated_tokenizer_file(ckpt, name):
    raw = (ckpt / name).read_bytes()
    (ckpt / name).write_bytes(raw[: len(raw) // 2])
    message = _tokenizer_refusal(ckpt, f"{name} is not valid JSON (")
    assert message.endswith("): truncated or garbled?")


def test_garbled_tokenizer_json(ckpt):
    (ckpt / "tokenizer.json").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    _tokenizer_refusal(ckpt, "tokenizer.json is not valid JSON (")


@pytest.mark.parametrize("content,expected", [
    ("", "tokenizer.json is empty"),
    ("[1]", "tokenizer.json must hold a JSON object, got list"),
    ('{"version": "1.0"}', 'tokenizer.json has no "model" object: not a tokenizers file'),
])
def test_tokenizer_json_not_a_tokenizer(ckpt, content, expected):
    (ckpt / "tokenizer.json").write_text(content)
    _tokenizer_refusal(ckpt, expected)


def test_tokenizer_problems_listed_together(ckpt):
    (ckpt / "tokenizer_config.json").unlink()
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(CheckpointFilesError) as err:
        check_tokenizer_files(ckpt)
    lines = str(err.value).splitlines()
    assert lines[0] == f"checkpoint {ckpt} has 2 problems:"
    assert lines[1].startswith("  - tokenizer_config.json is missing") and "no tokenizer vocabulary file" in lines[2]


# ----------------------------------------------------------------------------------------------------
# fingerprint


@pytest.fixture
def two_copies(tiny_ckpt, tmp_path):
    return copy_checkpoint(tiny_ckpt, tmp_path, "copy_a"), copy_checkpoint(tiny_ckpt, tmp_path, "copy_b")


def _differing(a: dict, b: dict) -> list[str]:
    assert list(a) == list(b)
    return [name for name in a if a[name] != b[name]]


def test_fingerprint_lists_every_file_a_run_reads(tiny_ckpt):
    import hashlib

    fingerprint = checkpoint_fingerprint(tiny_ckpt)
    assert list(fingerprint) == sorted(fingerprint) == sorted([
        "config.json", "generation_config.json", INDEX, SHARD1, SHARD2, SHARD3, "configuration_kimi_k3.py",
        "modeling_kimi_k3.py", "modeling_kimi_linear.py", "tokenizer.json", "tokenizer_config.json",
    ])
    raw = (tiny_ckpt / SHARD2).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    assert fingerprint[SHARD2] == f"size:{len(raw)} header:{hashlib.sha256(raw[: 8 + n]).hexdigest()}"
    assert fingerprint["config.json"] == "sha256:" + hashlib.sha256((tiny_ckpt / "config.json").read_bytes()).hexdigest()


def test_fingerprint_equal_for_two_copies(two_copies):
    a, b = two_copies
    assert checkpoint_fingerprint(a) == checkpoint_fingerprint(b)


def test_fingerprint_names_a_changed_shard_header(two_copies):
    a, b = two_copies
    n, _ = _header(b / SHARD2)
    raw = bytearray((b / SHARD2).read_bytes())
    at = raw.index(b'"format":"pt"', 8, 8 + n) + len(b'"format":"p')
    raw[at : at + 1] = b"x"  # same length, same size: only the header bytes differ
    (b / SHARD2).write_bytes(bytes(raw))
    before, after = checkpoint_fingerprint(a), checkpoint_fingerprint(b)
    assert _differing(before, after) == [SHARD2]
    assert before[SHARD2].split()[0] == after[SHARD2].split()[0]  # size unchanged


def test_fingerprint_names_a_shard_whose_size_changed(two_copies):
    a, b = two_copies
    with (b / SHARD3).open("ab") as f:
        f.write(b"\x00")
    before, after = checkpoint_fingerprint(a), checkpoint_fingerprint(b)
    assert _differing(before, after) == [SHARD3]
    assert before[SHARD3].split()[1] == after[SHARD3].split()[1]  # header unchanged


def test_fingerprint_names_a_changed_config(two_copies):
    a, b = two_copies
    (b / "config.json").write_text((b / "config.json").read_text().replace('"hidden_size": 128', '"hidden_size": 129'))
    assert _differing(checkpoint_fingerprint(a), checkpoint_fingerprint(b)) == ["config.json"]


def test_fingerprint_reads_no_tensor_data(two_copies):
    a, b = two_copies
    n, header = _header(b / SHARD1)
    begin = header[sorted(header)[0]]["data_offsets"][0]
    with (b / SHARD1).open("r+b") as f:
        f.seek(8 + n + begin)
        old = f.read(1)
        f.seek(8 + n + begin)
        f.write(bytes([old[0] ^ 0xFF]))
    assert checkpoint_fingerprint(a) == checkpoint_fingerprint(b)


def test_fingerprint_refuses_a_shard_the_index_names_but_is_missing(ckpt):
    (ckpt / SHARD2).unlink()
    with pytest.raises(CheckpointFilesError, match=f"{ckpt / SHARD2} is missing \\(named by {INDEX}\\)"):
        checkpoint_fingerprint(ckpt)

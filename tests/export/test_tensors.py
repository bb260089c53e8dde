"""modelopt_ext.export.tensors: lazy tensor access over safetensors files and strict JSON loading."""

import json
import re
from contextlib import ExitStack

import pytest
import torch
from safetensors.torch import save_file

from modelopt_ext.export.tensors import _load_json, _Tensors, _Unreadable


@pytest.fixture
def two_files(tmp_path):
    save_file({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)},
              str(tmp_path / "one.safetensors"))
    save_file({"c": torch.tensor([7], dtype=torch.int32)}, str(tmp_path / "two.safetensors"))
    return tmp_path, {"a": "one.safetensors", "b": "one.safetensors", "c": "two.safetensors"}


def test_tensors_are_read_lazily_with_one_handle_per_file(two_files):
    root, files = two_files
    with ExitStack() as stack:
        tensors = _Tensors(root, files, stack)
        assert tensors.handles == {}
        assert torch.equal(tensors.get("a"), torch.arange(6.0).reshape(2, 3))
        assert list(tensors.handles) == ["one.safetensors"]
        b = tensors.get("b")
        assert b.dtype == torch.bfloat16 and torch.equal(b, torch.ones(2, dtype=torch.bfloat16))
        assert torch.equal(tensors.get("c"), torch.tensor([7], dtype=torch.int32))
        assert sorted(tensors.handles) == ["one.safetensors", "two.safetensors"]
        handle = tensors.handles["one.safetensors"]
        tensors.get("a")
        assert tensors.handles["one.safetensors"] is handle


def test_an_unreadable_tensor_names_the_tensor_and_its_file(two_files):
    root, files = two_files
    (root / "broken.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with ExitStack() as stack:
        tensors = _Tensors(root, {**files, "d": "broken.safetensors", "e": "missing.safetensors",
                                  "f": "two.safetensors"}, stack)
        for key, name in (("d", "broken.safetensors"), ("e", "missing.safetensors"), ("f", "two.safetensors")):
            where = re.escape(str(root / name))
            with pytest.raises(_Unreadable, match=f"^cannot read tensor {key} from {where}: ") as info:
                tensors.get(key)
            assert info.value.__cause__ is not None
        with pytest.raises(KeyError):  # a key the index does not list is the caller's mistake, not the file's
            tensors.get("z")


def test_load_json_of_a_missing_file_is_none_without_a_problem(tmp_path):
    problems = []
    assert _load_json(tmp_path / "config.json", problems) is None
    assert problems == []


def test_load_json_reports_every_duplicate_key_at_any_depth(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"a": 1, "b": {"c": 2, "c": 3}, "a": 4}')
    problems = []
    assert _load_json(path, problems) == {"a": 4, "b": {"c": 3}}  # the last value wins, as json.loads
    assert problems == ["config.json: key c appears twice", "config.json: key a appears twice"]
    path.write_text(json.dumps({"a": [1, {"b": 2}]}))
    problems = []
    assert _load_json(path, problems) == {"a": [1, {"b": 2}]} and problems == []


@pytest.mark.parametrize("content", [b'{"a": 1,}', b'{"a": "\xff"}'], ids=["syntax", "not-utf8"])
def test_load_json_of_unreadable_content_is_a_problem(tmp_path, content):
    path = tmp_path / "hf_quant_config.json"
    path.write_bytes(content)
    problems = []
    assert _load_json(path, problems) is None
    assert len(problems) == 1 and problems[0].startswith("hf_quant_config.json: unreadable JSON (")

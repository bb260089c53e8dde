"""`read_header`: safetensors files built by hand (u64 little-endian header length, JSON header, data), each
refusal checked against what the safetensors library itself does with the same bytes."""

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from modelopt_ext.export.layout import MAX_HEADER_BYTES, read_header


def _write(path, header: dict, data: bytes, length: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def _u8(begin: int, end: int) -> dict:
    return {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}


def _problems(path) -> list[str]:
    problems: list[str] = []
    read_header(path, problems)
    return problems


def _safetensors_refuses(path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                f.get_tensor(key)
    except Exception:  # safetensors raises its own error types
        return True
    return False


def test_saved_file_has_no_problem(tmp_path):
    path = tmp_path / "ok.safetensors"
    save_file({"a": torch.zeros(3, dtype=torch.uint8), "b": torch.ones(2, 5)}, str(path), metadata={"format": "pt"})
    problems: list[str] = []
    entries = read_header(path, problems)
    assert problems == [] and sorted(entries) == ["a", "b"] and entries["b"].nbytes == 40


def test_junk_after_the_data(tmp_path):
    path = tmp_path / "junk.safetensors"
    _write(path, {"a": _u8(0, 4), "b": _u8(4, 10)}, bytes(10) + b"\xab" * 4096)
    assert _problems(path) == [
        "junk.safetensors: 4096 bytes after the last tensor's data (data section holds 10 bytes, "
        "the file has 4106 after the header)"
    ]
    assert _safetensors_refuses(path)


def test_gap_between_tensors_and_before_the_first(tmp_path):
    path = tmp_path / "gap.safetensors"
    _write(path, {"a": _u8(2, 4), "b": _u8(7, 10)}, bytes(10))
    assert _problems(path) == [
        "gap.safetensors: 2 bytes before the first tensor's data (a starts at byte 2 of the data section; "
        "safetensors needs it at 0)",
        "gap.safetensors: 3 bytes unused between tensors a (ends at byte 4) and b (starts at byte 7) of the data section",
    ]
    assert _safetensors_refuses(path)


def test_truncated_data_is_not_also_reported_as_a_gap(tmp_path):
    path = tmp_path / "cut.safetensors"
    _write(path, {"a": _u8(0, 4), "b": _u8(4, 10)}, bytes(7))
    assert _problems(path) == [
        "cut.safetensors: tensor b data_offsets [4, 10] do not hold U8 [6] (6 bytes) inside the 7-byte data section"
    ]


@pytest.mark.parametrize("length", [0, 1])
def test_header_length_too_short_for_any_json(tmp_path, length):
    path = tmp_path / "short.safetensors"
    _write(path, {"a": _u8(0, 4)}, bytes(4), length=length)
    assert _problems(path) == [
        f"short.safetensors: header length {length} is too short for a JSON header (at least 2 bytes, '{{}}')"
    ]


@pytest.mark.parametrize("cut", [2, 3, 17, 30, 44])
def test_header_length_cutting_the_json(tmp_path, cut):
    path = tmp_path / "cut.safetensors"
    header = {"weight": _u8(0, 4), "bias": _u8(4, 6)}
    assert cut < len(json.dumps(header))
    _write(path, header, bytes(6), length=cut)
    (problem,) = _problems(path)
    assert problem.startswith(f"cut.safetensors: header length {cut} is too short: the JSON header is cut off after "
                              f"{cut} bytes ("), problem
    assert _safetensors_refuses(path)


def test_header_length_past_the_end_of_the_file(tmp_path):
    path = tmp_path / "long.safetensors"
    _write(path, {"a": _u8(0, 4)}, bytes(4), length=1000)
    size = path.stat().st_size
    assert _problems(path) == [
        f"long.safetensors: not a safetensors file (header length 1000, file size {size}): "
        "the header would end past the end of the file"
    ]


def test_header_length_over_the_format_limit(tmp_path):
    path = tmp_path / "huge.safetensors"
    _write(path, {"a": _u8(0, 4)}, bytes(4), length=MAX_HEADER_BYTES + 1)
    try:
        os.truncate(path, 2 * MAX_HEADER_BYTES)
    except OSError:
        pytest.skip("no sparse files on this filesystem")
    assert _problems(path) == [
        f"huge.safetensors: not a safetensors file (header length {MAX_HEADER_BYTES + 1}, file size "
        f"{2 * MAX_HEADER_BYTES}): the header would end over the {MAX_HEADER_BYTES}-byte limit"
    ]


def test_file_shorter_than_the_length_field(tmp_path):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x05\x00\x00")
    assert _problems(path) == [
        "tiny.safetensors: not a safetensors file (file size 3: shorter than the 8-byte header length field)"
    ]


def test_garbled_header_is_unreadable_not_cut_off(tmp_path):
    path = tmp_path / "garbled.safetensors"
    raw = b'{"a": oops, "b": 1}'
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    (problem,) = _problems(path)
    assert problem.startswith("garbled.safetensors: unreadable safetensors header (Expecting value"), problem

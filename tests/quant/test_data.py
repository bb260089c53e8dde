"""Calibration data loading and per-rank batching."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from modelopt_ext.quant.data import calibration_batches, default_texts, load_texts


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    return AutoTokenizer.from_pretrained(str(tiny_ckpt), trust_remote_code=True)


def test_default_set_is_embedded():
    texts = default_texts()
    assert len(texts) >= 10 and all(len(t) > 40 for t in texts)


def test_jsonl_text_and_messages(tmp_path, tokenizer):
    path = tmp_path / "calib.jsonl"
    path.write_text(json.dumps({"text": "first sample"}) + "\n\n" + json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    texts = load_texts(path, tokenizer)
    assert texts[0] == "first sample"
    assert "<|im_user|>" in texts[1] and "hello" in texts[1]


def test_plain_text_one_sample_per_line(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text("one\n\n two \nthree\n")
    assert load_texts(path) == ["one", "two", "three"]


@pytest.mark.parametrize("content,message", [
    ("", r"is empty \(0 bytes\)"),
    ("\n  \n", r"is empty \(only whitespace\)"),
    ('{"text": 1}\n', ':1: expected an object with a "text" string'),
    ('{"text": "ok"}\nnot json\n', ":2: not valid JSON: Expecting value at column 1"),
    ('{"text": "ok"}\n\n{"text": "x",}\n', ":3: not valid JSON: .+ at column 14$"),
    ('{"messages": []}\n', ':1: a "messages" record needs a tokenizer'),
    ('{"text": ""}\n{"text": "  "}\n', "has no text: all 2 samples are blank"),
])
def test_bad_files_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        load_texts(path)
    assert str(path) in str(err.value)


def test_jsonl_lines_are_split_at_newlines_only(tmp_path):
    path = tmp_path / "calib.jsonl"
    path.write_text(json.dumps({"text": "a\u2028b\x0cc"}, ensure_ascii=False) + "\r\n" + json.dumps({"text": "d"}) + "\n")
    assert load_texts(path) == ["a\u2028b\x0cc", "d"]


def test_utf8_bom_is_dropped(tmp_path):
    path = tmp_path / "calib.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "x"}).encode() + b"\n")
    assert load_texts(path) == ["x"]


@pytest.mark.parametrize("content,offset,line", [
    (b"\xff\xfe\x00bad", 0, 1),
    ("ok line\nsecond caf\u00e9\n".encode() + b"third \xe9t\xe9\n", 27, 3),
])
def test_non_utf8_names_byte_offset(tmp_path, content, offset, line):
    path = tmp_path / "bin.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        load_texts(path)
    assert str(err.value).startswith(f"calibration dataset {path} is not UTF-8 text: ")
    assert f"byte 0x{content[offset]:02x} at byte offset {offset} (line {line})" in str(err.value)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ValueError, match=f"calibration dataset {tmp_path / 'missing.txt'} does not exist"):
        load_texts(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match=f"calibration dataset {tmp_path} is a directory, expected a JSONL or text"):
        load_texts(tmp_path)


def test_unreadable_file(tmp_path, monkeypatch):
    path = tmp_path / "secret.jsonl"
    path.write_text('{"text": "x"}\n')
    real = Path.read_bytes

    def read_bytes(self):  # tests run as root, where chmod 000 does not stop reading
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(ValueError, match=f"calibration dataset {path} is unreadable: Permission denied"):
        load_texts(path)


@pytest.mark.parametrize("encode_slice", [512, 3, 1])  # texts per tokenizer call: same blocks whatever it is
def test_blocks_are_packed_and_dealt_round_robin(tokenizer, encode_slice, monkeypatch):
    from modelopt_ext.quant import data

    monkeypatch.setattr(data, "ENCODE_SLICE", encode_slice)
    texts = default_texts()
    per_rank = [calibration_batches(tokenizer, texts, calib_size=10, batch_size=3, seq_len=16, rank=r, world_size=2)
                for r in range(2)]
    stream = []
    for t in texts:
        stream += tokenizer.encode(t) + [tokenizer.eos_token_id]
    blocks = [stream[i * 16 : (i + 1) * 16] for i in range(10)]
    for r in range(2):
        rows = [row for b in per_rank[r] for row in b["input_ids"].tolist()]
        assert rows == blocks[r::2]
        assert [b["input_ids"].shape[0] for b in per_rank[r]] == [3, 2]
        assert all(bool(b["attention_mask"].all()) for b in per_rank[r])


def test_short_text_gives_fewer_blocks(tokenizer, caplog):
    batches = calibration_batches(tokenizer, ["a short text of a few tokens"], calib_size=4, batch_size=2, seq_len=4)
    assert sum(b["input_ids"].shape[0] for b in batches) < 4
    assert "fewer than calib_size 4" in caplog.text


@pytest.mark.parametrize("kwargs,message", [
    ({"calib_size": 0}, "calib_size must be at least 1, got 0"),
    ({"batch_size": 0}, "batch_size must be at least 1"),
    ({"seq_len": -1}, "seq_len must be at least 1, got -1"),
    ({"calib_size": 1, "world_size": 2}, r"yields 1 blocks of 8 tokens, fewer than the 2 ranks"),
    ({"world_size": 0}, "world_size must be at least 1, got 0"),
    ({"rank": 2, "world_size": 2}, r"rank must be in \[0, 2\), got 2"),
    ({"rank": -1}, r"rank must be in \[0, 1\), got -1"),
])
def test_bad_sizes(tokenizer, kwargs, message):
    args = {"calib_size": 4, "batch_size": 2, "seq_len": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        calibration_batches(tokenizer, ["a text with enough tokens to fill a couple of blocks"], **args)


@pytest.mark.parametrize("texts", [[], [""], ["a few tokens"]], ids=["no-texts", "empty-text", "short-text"])
def test_no_block_at_all(tokenizer, texts):
    tokens = sum(len(tokenizer.encode(t)) + 1 for t in texts)
    assert tokens < 512
    with pytest.raises(ValueError, match=f"yields no block of 512 tokens: its {len(texts)} samples give {tokens} tokens; "
                                         "give more text or a smaller seq_len"):
        calibration_batches(tokenizer, texts, calib_size=4, batch_size=2, seq_len=512)

"""Calibration data loading and per-rank batching."""

import json
import os
import threading
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
    real = os.open

    def refusing_open(file, *args, **kwargs):  # tests run as root, where chmod 000 does not stop reading
        if Path(file) == path:
            raise PermissionError(13, "Permission denied", str(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(ValueError, match=f"calibration dataset {path} is unreadable: Permission denied"):
        load_texts(path)


def _refused_within(seconds: float, path, **kwargs) -> str:
    """load_texts(path) in a thread: the ValueError's message, failing (not hanging) if it blocks."""
    outcome: list = []

    def run():
        try:
            outcome.append(load_texts(path, **kwargs))
        except BaseException as e:  # noqa: BLE001 - inspected below
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"load_texts({path}) still running after {seconds} s"
    assert isinstance(outcome[0], ValueError), outcome
    return str(outcome[0])


def test_fifo_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "calib.jsonl"
    os.mkfifo(fifo)  # no writer: opening it for reading would block forever
    assert _refused_within(10, fifo) == (
        f"calibration dataset {fifo} is a FIFO (named pipe), expected a regular JSONL or text file")


def test_character_device_is_refused():
    assert _refused_within(10, "/dev/zero") == (
        "calibration dataset /dev/zero is a character device, expected a regular JSONL or text file")


def test_size_limit(tmp_path, monkeypatch):
    """A documented limit, checked with os.stat before the file is opened (a sparse file above 1 GiB here)."""
    from modelopt_ext.quant import data

    path = tmp_path / "calib.txt"
    path.write_text("x" * 99 + "\n")
    assert load_texts(path, max_bytes=100) == ["x" * 99]
    with pytest.raises(ValueError) as err:
        load_texts(path, max_bytes=99)
    assert str(err.value) == (f"calibration dataset {path} is 100 bytes, larger than the limit of 99 bytes; "
                              "calibration reads a few MB of text, give a smaller file")
    assert data.DEFAULT_MAX_DATASET_BYTES == 1 << 30
    big = tmp_path / "big.txt"
    with big.open("wb") as f:  # sparse: no disk used
        f.truncate((1 << 30) + 1)
    real_open = os.open

    def checked_open(file, *args, **kwargs):
        assert Path(file) != big, f"{big} was opened"
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", checked_open)
    with pytest.raises(ValueError) as err:
        load_texts(big)  # the default limit
    assert str(err.value) == (f"calibration dataset {big} is 1073741825 bytes (1.00 GiB), larger than the limit "
                              "of 1073741824 bytes (1.00 GiB); calibration reads a few MB of text, give a smaller "
                              "file")


def test_file_swapped_for_a_fifo_after_the_stat_is_refused(tmp_path, monkeypatch):
    """The check is repeated on the opened file (opened non-blocking, so a FIFO does not block the open)."""
    from modelopt_ext.quant import data

    path = tmp_path / "calib.txt"
    path.write_text("text\n")
    real_stat = os.stat

    def stat_then_swap(file, *args, **kwargs):
        result = real_stat(file, *args, **kwargs)
        if Path(file) == path:
            path.unlink()
            os.mkfifo(path)
        return result

    monkeypatch.setattr(data.os, "stat", stat_then_swap)
    assert _refused_within(10, path) == (
        f"calibration dataset {path} is a FIFO (named pipe), expected a regular JSONL or text file")


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


def test_ptq_refuses_a_fifo_dataset_in_validate(tiny_ckpt, tmp_path):
    """Through the CLI, in a subprocess with a time bound (the open of a FIFO without a writer blocked forever)."""
    import subprocess
    import sys

    fifo = tmp_path / "calib.jsonl"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "modelopt_ext", "ptq", "--model", str(tiny_ckpt), "--export-dir",
                           str(out), "--no-progress", "--dataset", str(fifo)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (f"modelopt-ext ptq: error: validate: calibration dataset {fifo} is a FIFO (named pipe), expected a "
            "regular JSONL or text file") in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert not out.exists()

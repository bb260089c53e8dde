"""Calibration data: an embedded default set, JSONL or text files, tokenized into per-rank batches.

No downloads: the default set is the text shipped with the package (`corpus.txt` beside this module; the
stand-in generators train their tokenizers on it too). A file is
JSONL (one object per line with a "text" field, or "messages" rendered with the tokenizer's chat template)
or plain text (one sample per non-empty line). It must be a regular file (a FIFO or a device is refused
before it is opened) of at most `max_bytes`, 1 GiB by default (`DEFAULT_MAX_DATASET_BYTES`). Samples are
tokenized and packed into one stream (EOS between samples), cut into blocks of `seq_len` tokens (no
padding: pad tokens would enter the activation statistics), the first `calib_size` blocks kept and dealt
round-robin to the ranks (rank r gets blocks r, r + W, ...), so every rank calibrates on different data.

Shapes: B batch, S sequence length.
"""

from __future__ import annotations

import importlib.resources
import json
import logging
import os
import stat
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def corpus_text() -> str:
    """The embedded corpus, whole: 18 English paragraphs, one a line."""
    return importlib.resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


def default_texts() -> list[str]:
    """The embedded calibration texts (one paragraph per sample)."""
    return [line.strip() for line in corpus_text().splitlines() if line.strip()]


# The largest --dataset read (1 GiB). Calibration uses calib_size * seq_len tokens, a few MB of text (512
# blocks of 2048 tokens is ~4 MB), and every rank reads the whole file into memory (bytes, then str), so a
# larger file only costs host memory per rank (8 ranks of a node: several GiB) without giving more data.
DEFAULT_MAX_DATASET_BYTES = 1 << 30

_FILE_KINDS = ((stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISCHR, "character device"),
               (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _FILE_KINDS if test(mode)), f"special file (mode 0o{mode:o})")


def _size_text(n: int) -> str:
    return f"{n} bytes ({n / (1 << 30):.2f} GiB)" if n >= 1 << 20 else f"{n} bytes"


def _check_regular(path: Path, info: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"calibration dataset {path} is a {_kind(info.st_mode)}, expected a regular JSONL or "
                         "text file")
    if info.st_size > max_bytes:
        raise ValueError(f"calibration dataset {path} is {_size_text(info.st_size)}, larger than the limit of "
                         f"{_size_text(max_bytes)}; calibration reads a few MB of text, give a smaller file")


def _read_regular_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of `path`, which must be a regular file of at most `max_bytes` bytes. Checked with
    `os.stat` before opening (opening a FIFO without a writer blocks, /dev/zero never ends), and again with
    `fstat` on the file as opened (non-blocking, in case another file took its place in between)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ValueError(f"calibration dataset {path} does not exist") from None
    except OSError as e:
        raise ValueError(f"calibration dataset {path} is unreadable: {e.strerror or e}") from e
    if stat.S_ISDIR(info.st_mode):
        raise ValueError(f"calibration dataset {path} is a directory, expected a JSONL or text file")
    _check_regular(path, info, max_bytes)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ValueError(f"calibration dataset {path} is unreadable: {e.strerror or e}") from e
    with os.fdopen(fd, "rb") as f:
        _check_regular(path, os.fstat(f.fileno()), max_bytes)
        try:
            raw = f.read(max_bytes + 1)  # it may have grown since
        except OSError as e:
            raise ValueError(f"calibration dataset {path} is unreadable: {e.strerror or e}") from e
    if len(raw) > max_bytes:
        raise ValueError(f"calibration dataset {path} grew past the limit of {_size_text(max_bytes)} while read")
    return raw


def _read_text_file(path: Path, max_bytes: int = DEFAULT_MAX_DATASET_BYTES) -> str:
    """The whole file as text (a UTF-8 BOM dropped); errors name the file and, for bad bytes, the offset.
    Only a regular file of at most `max_bytes` bytes is opened (`_read_regular_file`)."""
    raw = _read_regular_file(path, max_bytes)
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"calibration dataset {path} is not UTF-8 text: byte 0x{raw[e.start]:02x} at byte offset "
                         f"{e.start} (line {line}): {e.reason}") from e
    return content.removeprefix("\ufeff")


def load_texts(path: str | Path | None, tokenizer=None, *,
               max_bytes: int = DEFAULT_MAX_DATASET_BYTES) -> list[str]:
    """Samples from `path` (JSONL or text), or the embedded set when None.

    Raises ValueError naming the file (and the line or byte offset) for a missing, unreadable or non-UTF-8
    file, a directory, a FIFO, device or other file that is not a regular file (refused before it is
    opened), a file larger than `max_bytes` (default 1 GiB), a file without text, a JSONL line that is not
    JSON or not a usable record.
    """
    if path is None:
        return default_texts()
    path = Path(path)
    content = _read_text_file(path, max_bytes)
    jsonl = path.suffix in (".jsonl", ".json")
    # JSONL splits on "\n" only: JSON strings may hold U+2028 and other characters splitlines() breaks at
    lines = [(i + 1, line) for i, line in enumerate(content.split("\n") if jsonl else content.splitlines())
             if line.strip()]
    if not lines:
        what = "0 bytes" if not content else "only whitespace"
        raise ValueError(f"calibration dataset {path} is empty ({what}), expected at least one text sample")
    if not jsonl:
        return [line.strip() for _, line in lines]
    texts = []
    for number, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON: {e.msg} at column {e.colno}") from e
        if isinstance(record, dict) and isinstance(record.get("text"), str):
            texts.append(record["text"])
        elif isinstance(record, dict) and isinstance(record.get("messages"), list):
            if tokenizer is None:
                raise ValueError(f'{path}:{number}: a "messages" record needs a tokenizer for its chat template')
            texts.append(tokenizer.apply_chat_template(record["messages"], tokenize=False))
        else:
            raise ValueError(f'{path}:{number}: expected an object with a "text" string or a "messages" list')
    if not any(text.strip() for text in texts):
        raise ValueError(f"calibration dataset {path} has no text: all {len(texts)} samples are blank")
    return texts


ENCODE_SLICE = 512  # texts per tokenizer call in `calibration_batches`


def _encoded(tokenizer, texts: list[str]):
    """Each text's ids, tokenized `ENCODE_SLICE` texts to a call (a fast tokenizer encodes a batch on all
    cores) and lazily, slice by slice: the same ids as `tokenizer.encode` text by text (special tokens too)."""
    for first in range(0, len(texts), ENCODE_SLICE):
        yield from tokenizer(texts[first:first + ENCODE_SLICE])["input_ids"]


def calibration_batches(tokenizer, texts: list[str], *, calib_size: int, batch_size: int, seq_len: int,
                        rank: int = 0, world_size: int = 1, skip_blocks: int = 0) -> list[dict[str, torch.Tensor]]:
    """This rank's batches of packed blocks: {"input_ids": [B, seq_len], "attention_mask": ones [B, seq_len]}.
    `skip_blocks`: start after that many blocks (the held-out set for the quality report follows the
    calibration blocks, so it is never calibrated on)."""
    for name, value in (("calib_size", calib_size), ("batch_size", batch_size), ("seq_len", seq_len),
                        ("world_size", world_size)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in _encoded(tokenizer, texts):
        stream += ids + ([eos] if eos is not None else [])
        if len(stream) >= (skip_blocks + calib_size) * seq_len:
            break
    blocks = [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
    blocks = blocks[skip_blocks : skip_blocks + calib_size]
    if not blocks and skip_blocks:
        raise ValueError(f"the text has no block of {seq_len} tokens left after the {skip_blocks} calibration "
                         "blocks for the held-out set; give more text, a smaller --calib-size or --quality-blocks 0")
    if not blocks:
        raise ValueError(f"the calibration text yields no block of {seq_len} tokens: its {len(texts)} samples "
                         f"give {len(stream)} tokens; give more text or a smaller seq_len")
    if len(blocks) < world_size:
        raise ValueError(f"the calibration text yields {len(blocks)} blocks of {seq_len} tokens, fewer than the "
                         f"{world_size} ranks")
    if len(blocks) < calib_size:
        logger.warning("calibration text yields %d blocks of %d tokens, fewer than calib_size %d",
                       len(blocks), seq_len, calib_size)
    mine = torch.tensor(blocks[rank::world_size], dtype=torch.long)
    return [{"input_ids": chunk, "attention_mask": torch.ones_like(chunk)} for chunk in mine.split(batch_size)]

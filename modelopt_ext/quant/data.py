"""Calibration data: an embedded default set, JSONL or text files, tokenized into per-rank batches.

No downloads: the default set is the text shipped with the package (the stand-in's corpus). A file is
JSONL (one object per line with a "text" field, or "messages" rendered with the tokenizer's chat template)
or plain text (one sample per non-empty line). Samples are tokenized and packed into one stream (EOS between
samples), cut into blocks of `seq_len` tokens (no padding: pad tokens would enter the activation statistics),
the first `calib_size` blocks kept and dealt round-robin to the ranks (rank r gets blocks r, r + W, ...), so
every rank calibrates on different data.

Shapes: B batch, S sequence length.
"""

from __future__ import annotations

import importlib.resources
import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def default_texts() -> list[str]:
    """The embedded calibration texts (one paragraph per sample)."""
    text = importlib.resources.files("modelopt_ext.models.kimi_k3.standin").joinpath("corpus.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


def _read_text_file(path: Path) -> str:
    """The whole file as text (a UTF-8 BOM dropped); errors name the file and, for bad bytes, the offset."""
    if not path.exists():
        raise ValueError(f"calibration dataset {path} does not exist")
    if path.is_dir():
        raise ValueError(f"calibration dataset {path} is a directory, expected a JSONL or text file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"calibration dataset {path} is unreadable: {e.strerror or e}") from e
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"calibration dataset {path} is not UTF-8 text: byte 0x{raw[e.start]:02x} at byte offset "
                         f"{e.start} (line {line}): {e.reason}") from e
    return content.removeprefix("\ufeff")


def load_texts(path: str | Path | None, tokenizer=None) -> list[str]:
    """Samples from `path` (JSONL or text), or the embedded set when None.

    Raises ValueError naming the file (and the line or byte offset) for a missing, unreadable or non-UTF-8
    file, a directory, a file without text, a JSONL line that is not JSON or not a usable record.
    """
    if path is None:
        return default_texts()
    path = Path(path)
    content = _read_text_file(path)
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
                        rank: int = 0, world_size: int = 1) -> list[dict[str, torch.Tensor]]:
    """This rank's batches of packed blocks: {"input_ids": [B, seq_len], "attention_mask": ones [B, seq_len]}."""
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
        if len(stream) >= calib_size * seq_len:
            break
    blocks = [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)][:calib_size]
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

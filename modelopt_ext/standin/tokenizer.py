"""Small, deterministic byte-level BPE tokenizer for the random-weight stand-ins (Kimi-K3's, and DeepSeek-V3's,
whose [BOS]/[EOS] ids 0 and 1 match DeepSeek-V3's).

The real Kimi-K3 tokenizer is large and lives on the Hub; tests and tiny stand-in checkpoints only
need something that behaves like it: byte-level (so any text round-trips), carrying the same chat and
media marker tokens, and loadable offline with ``transformers.AutoTokenizer``. The BPE merges are
learned from the embedded corpus (``modelopt_ext/quant/corpus.txt``, also the default calibration text), so
the result depends only on the
requested vocabulary size and the installed ``tokenizers`` version.
"""

from __future__ import annotations

import json
import logging
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from modelopt_ext.quant.data import corpus_text

logger = logging.getLogger(__name__)

SPECIAL_TOKENS: list[str] = [
    "[BOS]",
    "[EOS]",
    "[PAD]",
    "[UNK]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|media_start|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
]
IMAGE_TOKEN = "<|media_pad|>"
MIN_MERGES = 16
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + MIN_MERGES
MODEL_MAX_LENGTH = 8192
# transformers>=5 native fast-tokenizer class; "PreTrainedTokenizerFast" is an alias of it there.
TOKENIZER_CLASS = "TokenizersBackend"

# Kimi-style turns: <|im_{role}|>{role}<|im_middle|>{content}<|im_end|>; image parts become the
# media marker sequence with a single <|media_pad|> placeholder.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}<|im_system|>{%- endif -%}"
    "{{ message['role'] }}<|im_middle|>"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- else -%}<|media_start|>image<|media_content|><|media_pad|><|media_end|>{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def _corpus_lines() -> list[str]:
    """Return the non-empty lines (paragraphs) of the packaged training corpus."""
    return [line for line in corpus_text().splitlines() if line.strip()]


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with at most ``vocab_size`` entries; specials get ids 0..12.

    Raises:
        ValueError: if ``vocab_size`` cannot hold the specials, the 256 bytes and a few merges.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: need at least {MIN_VOCAB_SIZE} "
            f"({len(SPECIAL_TOKENS)} special tokens + 256 bytes + {MIN_MERGES} merges)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:  # defensive: the trainer is expected to respect its budget
        raise RuntimeError(f"trained vocab {size} exceeds requested vocab_size={vocab_size}")
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise RuntimeError(f"special token {token!r} did not receive id {expected_id}")
    logger.info("Built byte-level BPE tokenizer: %d entries (budget %d)", size, vocab_size)
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    """Return the ``tokenizer_config.json`` content used by :func:`write_tokenizer`."""
    return {
        "tokenizer_class": TOKENIZER_CLASS,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "extra_special_tokens": SPECIAL_TOKENS[4:],
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_text(path: pathlib.Path, text: str) -> None:
    """Write ``text`` as UTF-8 with ``\\n`` newlines and exactly one trailing newline."""
    with path.open("w", encoding="utf-8", newline="\n") as handle:
        handle.write(text.rstrip("\n") + "\n")


def write_tokenizer(out_dir: pathlib.Path, vocab_size: int) -> dict[str, int]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``.

    The files are byte-identical for equal ``vocab_size`` (and ``tokenizers`` version) and load
    offline with ``transformers.AutoTokenizer.from_pretrained(out_dir)``.

    Returns:
        Mapping from each special token string to its id.
    """
    tokenizer = build_tokenizer(vocab_size)  # validates vocab_size before touching the disk
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_text(out_dir / "tokenizer.json", tokenizer.to_str(pretty=True))
    config_text = json.dumps(tokenizer_config(), indent=2, sort_keys=True, ensure_ascii=False)
    _write_text(out_dir / "tokenizer_config.json", config_text)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    logger.info("Wrote tokenizer (%d entries) to %s", tokenizer.get_vocab_size(), out_dir)
    return ids

"""Tests for the locally trained Kimi-K3 stand-in tokenizer (CPU only, no network)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # must be set before transformers / huggingface_hub import

import pathlib
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from modelopt_ext.standin import tokenizer as standin_tokenizer
from modelopt_ext.standin.tokenizer import (
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    build_tokenizer,
    write_tokenizer,
)

VOCAB_SIZE = 512
REPO_ROOT = pathlib.Path(standin_tokenizer.__file__).resolve().parents[2]
ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "naïve café — 東京 🚀",
    "def add(a, b):\n    return a + b  # sum\n",
    '{"id": 42, "items": [1, 2, 3]}\tTAB\r\nCRLF  double  spaces ',
    "Zażółć gęślą jaźń; Привет, мир; مرحبا; 🤖🧪 e=mc²",
    "",
]


def _read_dir(path: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("standin_tok")
    write_tokenizer(out, VOCAB_SIZE)
    return out


@pytest.fixture(scope="module")
def hf_tok(tok_dir: pathlib.Path):
    return AutoTokenizer.from_pretrained(tok_dir)


def test_write_twice_is_byte_identical(tmp_path: pathlib.Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    ids_a = write_tokenizer(first, VOCAB_SIZE)
    ids_b = write_tokenizer(second, VOCAB_SIZE)
    files_a, files_b = _read_dir(first), _read_dir(second)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(files_a)
    assert files_a.keys() == files_b.keys()
    for name in files_a:
        assert files_a[name] == files_b[name], f"{name} differs between two writes"
        assert files_a[name].endswith(b"\n") and not files_a[name].endswith(b"\n\n")
    assert ids_a == ids_b


def test_byte_identical_across_processes(tmp_path: pathlib.Path, tok_dir: pathlib.Path) -> None:
    script = (
        "import pathlib, sys\n"
        "from modelopt_ext.standin.tokenizer import write_tokenizer\n"
        "write_tokenizer(pathlib.Path(sys.argv[1]), int(sys.argv[2]))\n"
    )
    outputs = []
    for seed, threads in (("1", "1"), ("12345", "4")):
        out = tmp_path / f"proc_{seed}"
        env = dict(os.environ, PYTHONHASHSEED=seed, RAYON_NUM_THREADS=threads, HF_HUB_OFFLINE="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        subprocess.run(
            [sys.executable, "-c", script, str(out), str(VOCAB_SIZE)],
            env=env, check=True, timeout=120, capture_output=True,
        )
        outputs.append(_read_dir(out))
    reference = _read_dir(tok_dir)
    assert outputs[0].keys() == outputs[1].keys() == reference.keys()
    for name in reference:
        assert outputs[0][name] == outputs[1][name] == reference[name], f"{name} differs across processes"


def test_autotokenizer_loads_offline(tok_dir: pathlib.Path, hf_tok) -> None:
    assert hf_tok.is_fast
    assert (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token, hf_tok.unk_token) == (
        "[BOS]", "[EOS]", "[PAD]", "[UNK]",
    )
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id, hf_tok.unk_token_id) == (0, 1, 2, 3)
    assert hf_tok.model_max_length == 8192
    assert len(hf_tok) == build_tokenizer(VOCAB_SIZE).get_vocab_size()


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(hf_tok, text: str) -> None:
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert all(id_ >= len(SPECIAL_TOKENS) for id_ in ids)  # plain text never yields specials
    assert hf_tok.decode(ids) == text
    raw = build_tokenizer(VOCAB_SIZE)
    assert raw.decode(raw.encode(text).ids) == text


def test_special_tokens_are_single_ordered_ids(tok_dir: pathlib.Path, hf_tok) -> None:
    assert SPECIAL_TOKENS[-1] == "<|media_pad|>" and len(SPECIAL_TOKENS) == 13
    assert write_tokenizer(tok_dir / "again", VOCAB_SIZE) == {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        assert hf_tok.convert_tokens_to_ids(token) == expected_id
        assert hf_tok.encode(token, add_special_tokens=False) == [expected_id]
    ids = hf_tok.encode("look: <|media_pad|> here", add_special_tokens=False)
    assert ids.count(12) == 1
    assert hf_tok.decode(ids) == "look: <|media_pad|> here"


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE, 300, VOCAB_SIZE, 700])
def test_vocab_size_bound(vocab_size: int) -> None:
    tok = build_tokenizer(vocab_size)
    vocab = tok.get_vocab(with_added_tokens=True)
    assert len(vocab) == tok.get_vocab_size() <= vocab_size
    assert max(vocab.values()) < vocab_size
    assert len(vocab) > 256 + len(SPECIAL_TOKENS)  # some merges were learned


def test_too_small_vocab_size_raises(tmp_path: pathlib.Path) -> None:
    assert MIN_VOCAB_SIZE == 256 + len(SPECIAL_TOKENS) + 16
    with pytest.raises(ValueError, match=r"\b284\b"):
        build_tokenizer(MIN_VOCAB_SIZE - 1)
    with pytest.raises(ValueError, match=r"\b100\b"):
        write_tokenizer(tmp_path / "never_written", 100)
    assert not (tmp_path / "never_written").exists()


def test_chat_template_two_turns(hf_tok) -> None:
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "It is 4."},
    ]
    rendered = hf_tok.apply_chat_template(messages, tokenize=False)
    assert rendered == (
        "<|im_user|>user<|im_middle|>What is 2 + 2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>It is 4.<|im_end|>"
    )
    prompt = hf_tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, messages[0]], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>")
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
    ids = hf_tok.encode(rendered, add_special_tokens=False)
    assert [i for i in ids if i < len(SPECIAL_TOKENS)] == [5, 8, 4, 6, 8, 4]

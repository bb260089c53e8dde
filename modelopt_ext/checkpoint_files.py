"""Cheap pre-flight check of a checkpoint folder's files, before anything heavy (model build, weight load).

Reads `config.json`, the safetensors index and the JSON header of every `*.safetensors` file; never tensor
data, and no hashing, so a 1.5 TB checkpoint is checked in seconds. Every data_offsets pair is checked
against the shard's file size (truncated shards, junk after the data); the config's sizes (routed experts,
top-k, hidden and vocabulary sizes) are checked against the tensors' names and shapes. The shard and index
checks are the ones `modelopt-ext verify` runs on exports (`modelopt_ext.export.layout`), so messages read
the same; a single `model.safetensors` without index is accepted.

Also here: `check_tokenizer_files` (the tokenizer's files, before `AutoTokenizer` reads them) and
`checkpoint_fingerprint` (a digest of every file a run reads, shards by size and header only), with which
ranks on different nodes agree they read the same checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from modelopt_ext.export.layout import MAX_HEADER_BYTES, check_layout
from modelopt_ext.families import read_config, source_quantization_config
from modelopt_ext.lock import sha256_file

logger = logging.getLogger(__name__)

MAX_LISTED_PROBLEMS = 20


class CheckpointFilesError(ValueError):
    """A checkpoint folder whose files are missing, unreadable or inconsistent; the message names them."""


@dataclasses.dataclass(frozen=True)
class CheckpointFiles:
    """What the headers of a checked checkpoint folder say.

    Attributes:
        path: the checkpoint folder.
        config: the parsed `config.json`.
        shards: the safetensors file names, sorted.
        tensors: tensor name -> the shard file name holding it.
        total_bytes: bytes of tensor data over all shards (from the headers).
    """

    path: Path
    config: dict[str, Any]
    shards: tuple[str, ...]
    tensors: Mapping[str, str]
    total_bytes: int

    def __post_init__(self):
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))


def _check_config(path: Path) -> dict[str, Any]:
    """`config.json` through `families.read_config`, plus a `model_type` string; errors as CheckpointFilesError."""
    config_file = path / "config.json"
    try:
        config = read_config(path)
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointFilesError(str(e)) from e
    except OSError as e:
        raise CheckpointFilesError(f"{config_file} is unreadable: {e.strerror or e}") from e
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointFilesError(
            f'{config_file} has no "model_type" string (got {model_type!r}): not a transformers model config'
        )
    return config


def _is_total_size_note(problem: str) -> bool:
    # transformers ignores metadata.total_size and some published indexes get it wrong: warn, do not refuse
    return ": metadata.total_size " in problem


def _raise_problems(path: Path, problems: list[str]) -> None:
    if len(problems) == 1:
        raise CheckpointFilesError(f"checkpoint {path}: {problems[0]}")
    listed = [f"  - {p}" for p in problems[:MAX_LISTED_PROBLEMS]]
    if len(problems) > MAX_LISTED_PROBLEMS:
        listed.append(f"  ... and {len(problems) - MAX_LISTED_PROBLEMS} more")
    raise CheckpointFilesError(f"checkpoint {path} has {len(problems)} problems:\n" + "\n".join(listed))


def check_checkpoint_files(path: str | Path, *, scales: bool = False) -> CheckpointFiles:
    """Check a checkpoint folder's config, index and safetensors headers; raise CheckpointFilesError if bad.

    Refuses: a missing folder; a missing, non-JSON or non-object `config.json`, or one without `model_type`;
    no `*.safetensors` file; several shards but no index; a garbled index or one without a `weight_map`
    object; an index naming a missing shard, or a tensor its shard does not hold (naming the shard that
    does, if any); a tensor no index entry names; a tensor stored in two shards; a truncated shard, one with
    bytes after (or between) its tensors' data, or one whose header is not a valid safetensors header; config
    sizes the tensors contradict (`_config_size_problems`). All problems are reported together.

    With `scales`, also reads the MXFP4 `*.weight_scale` tensors (nothing else) and refuses E8M0 NaN bytes
    (255). Off by default: 1/32 byte per expert weight, about 85 GB for the full-size Kimi-K3, read by every
    rank; the adapter checks the loaded scales anyway (naming the same tensor).
    """
    path = Path(path)
    config = _check_config(path)
    problems: list[str] = []
    try:
        shards, entries, total_bytes = check_layout(path, problems)
        notes = [p for p in problems if _is_total_size_note(p)]
        problems = [p for p in problems if not _is_total_size_note(p)]
        if not problems:  # on a broken layout, expert ids or shapes would be missing for the wrong reason
            problems.extend(_config_size_problems(config, entries))
        if scales and not problems:
            problems.extend(_scale_problems(path, config, entries))
    except OSError as e:
        raise CheckpointFilesError(f"checkpoint {path}: cannot read {e.filename or path}: {e.strerror or e}") from e
    if problems:
        _raise_problems(path, problems)
    for note in notes:
        logger.warning("checkpoint %s: %s", path, note)
    files = CheckpointFiles(
        path=path,
        config=config,
        shards=tuple(shards),
        tensors={key: entry.file for key, entry in sorted(entries.items())},
        total_bytes=total_bytes,
    )
    logger.info("checkpoint %s: %d tensors in %d safetensors files, %d bytes of tensor data",
                path, len(files.tensors), len(files.shards), files.total_bytes)
    return files


# ----------------------------------------------------------------------------------------------------
# config.json sizes against the shard headers. Key names as transformers models spell them; the first
# present one is used. Per-expert tensors are found by name (`layers.<i>. ... .experts.<j>.`).

_NUM_EXPERTS_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token")
_EXPERT_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.+\.)?experts\.(\d+)\.")
_EMBEDDING = re.compile(r"(?:^|\.)embed_tokens\.weight$")
_LM_HEAD = re.compile(r"(?:^|\.)lm_head\.weight$")
_FINAL_NORM = re.compile(r"(?:^|\.)model\.norm\.weight$")
LISTED_IDS = 8


def _ids(ids) -> str:
    """Sorted ints as ranges: `0..3, 5, 7..15`, the first LISTED_IDS ranges."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = [f"{a}" if a == b else f"{a}..{b}" for a, b in runs[:LISTED_IDS]]
    return ", ".join(text) + (", ..." if len(runs) > LISTED_IDS else "")


def _config_int(text: Mapping[str, Any], names: tuple[str, ...], prefix: str, problems: list[str]):
    """(key as named in config.json, value) of the first of `names` in `text`; None if absent or not a size."""
    for name in names:
        if name in text:
            value = text[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"config.json: {prefix}{name} is {value!r}, expected a positive integer")
                return None
            return prefix + name, value
    return None


def _expert_problems(config_key: str, n: int, entries) -> list[str]:
    """Routed expert ids of every MoE layer in the headers against `range(n)`; one problem per distinct id set."""
    layers: dict[int, dict[int, str]] = {}
    for key in sorted(entries):
        m = _EXPERT_TENSOR.search(key)
        if m:
            layers.setdefault(int(m[1]), {}).setdefault(int(m[2]), key)
    groups: dict[frozenset[int], list[int]] = {}
    for layer, experts in sorted(layers.items()):
        groups.setdefault(frozenset(experts), []).append(layer)
    problems = []
    for ids, group in groups.items():
        if ids == frozenset(range(n)):
            continue
        example = layers[group[0]][max(ids)]
        problems.append(
            f"config.json: {config_key} is {n}, but the shard headers hold {len(ids)} routed experts (ids {_ids(ids)})"
            f" in layer{'s' if len(group) > 1 else ''} {_ids(group)} (e.g. tensor {example} in "
            f"{entries[example].file}); expected ids 0..{n - 1} in every MoE layer"
        )
    return problems


def _shape_problems(config_key: str, value: int, entries, pattern: re.Pattern, dim: int, what: str) -> list[str]:
    problems = []
    for key in sorted(k for k in entries if pattern.search(k)):
        shape = entries[key].shape
        if len(shape) <= dim or shape[dim] != value:
            problems.append(f"config.json: {config_key} is {value}, but tensor {key} in {entries[key].file} has shape "
                            f"{list(shape)} ({what} should be {value})")
    return problems


def _config_size_problems(config: Mapping[str, Any], entries) -> list[str]:
    """Sizes of config.json (its `text_config` if it has one) that the headers' tensors contradict: routed
    experts per layer vs the expert ids present, top-k vs the expert count, hidden size vs the embedding,
    final norm and lm_head widths, vocabulary size vs the embedding and lm_head rows."""
    text, prefix = config, ""
    if isinstance(config.get("text_config"), dict):
        text, prefix = config["text_config"], "text_config."
    problems: list[str] = []
    experts = _config_int(text, _NUM_EXPERTS_KEYS, prefix, problems)
    top_k = _config_int(text, _TOP_K_KEYS, prefix, problems)
    hidden = _config_int(text, ("hidden_size",), prefix, problems)
    vocab = _config_int(text, ("vocab_size",), prefix, problems)
    if experts is not None:
        problems += _expert_problems(*experts, entries)
    if top_k is not None and experts is not None and top_k[1] > experts[1]:
        problems.append(f"config.json: {top_k[0]} is {top_k[1]}, more than the {experts[1]} routed experts per layer "
                        f"({experts[0]}): top-k must be at most the number of experts")
    if hidden is not None:
        problems += _shape_problems(*hidden, entries, _EMBEDDING, 1, "dim 1, the hidden size,")
        problems += _shape_problems(*hidden, entries, _LM_HEAD, 1, "dim 1, the hidden size,")
        problems += _shape_problems(*hidden, entries, _FINAL_NORM, 0, "dim 0, the hidden size,")
    if vocab is not None:
        problems += _shape_problems(*vocab, entries, _EMBEDDING, 0, "dim 0, one row per token,")
        problems += _shape_problems(*vocab, entries, _LM_HEAD, 0, "dim 0, one row per token,")
    return problems


# ----------------------------------------------------------------------------------------------------
# MXFP4 scales (opt-in: reads the scale tensors, 1/32 byte per expert weight)

_SCALE_DTYPES = ("U8", "F8_E8M0")


def _scale_problems(path: Path, config: Mapping[str, Any], entries) -> list[str]:
    """E8M0 NaN bytes (255) in the `*.weight_scale` tensors of a compressed-tensors MXFP4 checkpoint."""
    import torch
    from safetensors import safe_open

    from modelopt_ext.formats.mxfp4 import check_scales

    qc = source_quantization_config(config)
    if not isinstance(qc, dict) or qc.get("format") != "mxfp4-pack-quantized":
        return []
    by_shard: dict[str, list[str]] = {}
    for key, entry in sorted(entries.items()):
        if key.endswith(".weight_scale") and entry.dtype in _SCALE_DTYPES:
            by_shard.setdefault(entry.file, []).append(key)
    problems = []
    for shard, keys in sorted(by_shard.items()):
        with safe_open(str(path / shard), framework="pt") as f:
            for key in keys:
                try:
                    check_scales(f.get_tensor(key).view(torch.uint8), name=f"tensor {key} in {shard}")
                except ValueError as e:
                    problems.append(str(e))
    logger.debug("checkpoint %s: checked %d MXFP4 scale tensors", path, sum(map(len, by_shard.values())))
    return problems


# ----------------------------------------------------------------------------------------------------
# tokenizer files

TOKENIZER_CONFIG = "tokenizer_config.json"
# files holding a tokenizer's vocabulary, of which one must be present; tokenizer.json first (fast tokenizers)
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "vocab.txt", "spiece.model")
_JSON_TOKENIZER_FILES = (TOKENIZER_CONFIG, "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
                         "vocab.json", "chat_template.json")
TOKENIZER_FILES = tuple(dict.fromkeys(
    (*_JSON_TOKENIZER_FILES, *VOCAB_FILES, "merges.txt", "chat_template.jinja")))


def _tokenizer_json_problem(file: Path) -> tuple[str | None, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"{file.name} is not valid JSON ({e}): truncated or garbled?", None
    if not isinstance(data, dict):
        return f"{file.name} must hold a JSON object, got {type(data).__name__}", None
    return None, data


def check_tokenizer_files(model_dir: str | Path) -> None:
    """Refuse a checkpoint's tokenizer before `AutoTokenizer` reads it, naming each file and its problem.

    Refuses: no `tokenizer_config.json` (transformers would load the vocabulary without the special tokens,
    chat template and class it names); no vocabulary file (`VOCAB_FILES`: for the stand-in, `tokenizer.json`);
    an empty one; a JSON tokenizer file that is not a JSON object (truncated, garbled); a `tokenizer.json`
    without a `model` object; a `tokenizer_class` that is not a string.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointFilesError(f"checkpoint folder {path} does not exist or is not a directory")
    problems = []
    try:
        if not (path / TOKENIZER_CONFIG).is_file():
            problems.append(f"{TOKENIZER_CONFIG} is missing: the tokenizer's class, special tokens and chat template "
                            "would silently be left out")
        if not any((path / name).is_file() for name in VOCAB_FILES):
            problems.append(f"no tokenizer vocabulary file: expected {VOCAB_FILES[0]} (or one of "
                            f"{', '.join(VOCAB_FILES[1:])})")
        for name in TOKENIZER_FILES:
            file = path / name
            if not file.is_file():
                continue
            if file.stat().st_size == 0:
                problems.append(f"{name} is empty")
                continue
            if name not in _JSON_TOKENIZER_FILES:
                continue
            problem, data = _tokenizer_json_problem(file)
            if problem is None and name == "tokenizer.json" and not isinstance(data.get("model"), dict):
                problem = f'{name} has no "model" object: not a tokenizers file'
            if problem is None and name == TOKENIZER_CONFIG and not isinstance(data.get("tokenizer_class", ""), str):
                problem = f"{name}: tokenizer_class is {data['tokenizer_class']!r}, expected a class name string"
            if problem is not None:
                problems.append(problem)
    except OSError as e:
        raise CheckpointFilesError(f"checkpoint {path}: cannot read {e.filename or path}: {e.strerror or e}") from e
    if problems:
        _raise_problems(path, problems)
    logger.debug("checkpoint %s: tokenizer files look sound", path)


# ----------------------------------------------------------------------------------------------------
# fingerprint

def _shard_fingerprint(file: Path) -> str:
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or n > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointFilesError(f"{file}: not a safetensors file (header length {n}, file size {size})")
        header = f.read(n)
    return f"size:{size} header:{hashlib.sha256(head + header).hexdigest()}"


def _indexed_shards(path: Path) -> tuple[list[str], set[str]]:
    """(index file names, shard names they map to); without an index, the folder's `*.safetensors` files."""
    indexes = sorted(p.name for p in path.glob("*.safetensors.index.json") if p.is_file())
    if not indexes:
        return [], {p.name for p in path.glob("*.safetensors") if p.is_file()}
    shards: set[str] = set()
    for name in indexes:
        try:
            weight_map = json.loads((path / name).read_text())["weight_map"]
            shards.update(str(shard) for shard in weight_map.values())
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointFilesError(f"{path / name}: no readable weight_map ({type(e).__name__}: {e})") from e
    return indexes, shards


def checkpoint_fingerprint(model_dir: str | Path) -> dict[str, str]:
    """A short string per file a run reads from the checkpoint folder, sorted by file name.

    Files: `config.json`, the index (`model.safetensors.index.json`), every shard the index names (without an
    index, every `*.safetensors`), every `*.py` remote-code file, the tokenizer files present
    (`TOKENIZER_FILES`) and `generation_config.json` if present. Shards: `size:<bytes> header:<sha256 of the
    length field and JSON header>` (their tensor data is never read); other files: `sha256:<hex>`. Equal
    dicts on two ranks mean they read the same checkpoint; the keys that differ name the files that differ.
    Raises CheckpointFilesError naming a file that is missing or unreadable.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointFilesError(f"checkpoint folder {path} does not exist or is not a directory")
    indexes, shards = _indexed_shards(path)
    names = {"config.json", *indexes, *(p.name for p in path.glob("*.py") if p.is_file())}
    names.update(name for name in (*TOKENIZER_FILES, "generation_config.json") if (path / name).is_file())
    fingerprint = {}
    for name in sorted(names | shards):
        file = path / name
        if not file.is_file():
            named_by = f" (named by {', '.join(indexes)})" if name in shards and indexes else ""
            raise CheckpointFilesError(f"{file} is missing{named_by}: cannot fingerprint the checkpoint")
        try:
            fingerprint[name] = _shard_fingerprint(file) if name in shards else f"sha256:{sha256_file(file)}"
        except OSError as e:
            raise CheckpointFilesError(f"{file} is unreadable: {e.strerror or e}") from e
    logger.debug("checkpoint %s: fingerprinted %d files", path, len(fingerprint))
    return fingerprint

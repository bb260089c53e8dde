"""Cheap pre-flight check of a checkpoint folder's files, before anything heavy (model build, weight load).

Reads `config.json`, the safetensors index and the JSON header of every `*.safetensors` file; never tensor
data, and no hashing, so a 1.5 TB checkpoint is checked in seconds. Every data_offsets pair is checked
against the shard's file size, which catches truncated shards. The shard and index checks are the ones
`modelopt-ext verify` runs on exports (`modelopt_ext.export.layout`), so messages read the same; a
single `model.safetensors` without index is accepted.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from modelopt_ext.export.layout import _check_layout
from modelopt_ext.families import read_config

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


def check_checkpoint_files(path: str | Path) -> CheckpointFiles:
    """Check a checkpoint folder's config, index and safetensors headers; raise CheckpointFilesError if bad.

    Refuses: a missing folder; a missing, non-JSON or non-object `config.json`, or one without `model_type`;
    no `*.safetensors` file; several shards but no index; a garbled index or one without a `weight_map`
    object; an index naming a missing shard, or a tensor its shard does not hold (naming the shard that
    does, if any); a tensor no index entry names; a tensor stored in two shards; a truncated shard or one
    whose header is not a valid safetensors header. All shard and index problems are reported together.
    """
    path = Path(path)
    config = _check_config(path)
    problems: list[str] = []
    try:
        shards, entries, total_bytes = _check_layout(path, problems)
    except OSError as e:
        raise CheckpointFilesError(f"checkpoint {path}: cannot read {e.filename or path}: {e.strerror or e}") from e
    notes = [p for p in problems if _is_total_size_note(p)]
    problems = [p for p in problems if not _is_total_size_note(p)]
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

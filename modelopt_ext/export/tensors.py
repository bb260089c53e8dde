"""Shared pieces of the export checks: header entries, lazy tensor access, strict JSON loading."""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open


@dataclass(frozen=True)
class _Entry:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int



class _Unreadable(Exception):
    """A tensor that safetensors cannot read; the message names it and its file."""


class _Tensors:
    """Lazy access to tensors of safetensors files, one open handle per file."""

    def __init__(self, root: Path, files: Mapping[str, str], stack: ExitStack):
        self.root, self.files, self.stack, self.handles = root, files, stack, {}

    def dtype(self, key: str) -> str:
        """The safetensors dtype name of one tensor (its header only)."""
        name = self.files[key]
        try:
            if name not in self.handles:
                self.handles[name] = self.stack.enter_context(safe_open(str(self.root / name), framework="pt"))
            return self.handles[name].get_slice(key).get_dtype()
        except Exception as e:  # safetensors raises its own error types
            raise _Unreadable(f"cannot read tensor {key} from {self.root / name}: {e}") from e

    def get(self, key: str) -> torch.Tensor:
        name = self.files[key]
        try:
            if name not in self.handles:
                self.handles[name] = self.stack.enter_context(safe_open(str(self.root / name), framework="pt"))
            return self.handles[name].get_tensor(key)
        except Exception as e:  # safetensors raises its own error types
            raise _Unreadable(f"cannot read tensor {key} from {self.root / name}: {e}") from e


def _pairs_hook(duplicates: list[str]):
    def hook(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                duplicates.append(key)
            seen[key] = value
        return seen

    return hook


def _load_json(path: Path, problems: list[str]):
    if not path.is_file():
        return None
    duplicates: list[str] = []
    try:
        data = json.loads(path.read_text(), object_pairs_hook=_pairs_hook(duplicates))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problems.append(f"{path.name}: unreadable JSON ({e})")
        return None
    problems.extend(f"{path.name}: key {key} appears twice" for key in duplicates)
    return data

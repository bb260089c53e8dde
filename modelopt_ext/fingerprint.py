"""What one rank will read, as short strings per file, for the ranks to compare before loading
(`dist.agree_files`): multi-node runs read node-local copies of the checkpoint, and a stale copy on one node
would otherwise be mixed into the export.

Per top-level file of the checkpoint: for shards their size, a hash of their header and a hash of a few
samples of their tensor data (a stale copy of the same shapes has the same header; reading `SAMPLES` x
`SAMPLE_BYTES` per shard costs a few seeks, not the data); for every other file (config, index, remote
code, tokenizer) its sha256. Plus the sha256 of the other inputs (the remote-code lock, the recipe, the
dataset).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

SAMPLES = 4  # evenly spaced over the data section, the first and last bytes included
SAMPLE_BYTES = 1 << 16


def data_samples(shard: Path, samples: int = SAMPLES, sample_bytes: int = SAMPLE_BYTES) -> str:
    """sha256 of `samples` slices of a safetensors file's data section (all of it when it is small)."""
    digest = hashlib.sha256()
    with shard.open("rb") as f:
        header = int.from_bytes(f.read(8), "little")
        start, size = 8 + header, os.fstat(f.fileno()).st_size
        span = max(0, size - start)
        if span <= samples * sample_bytes:
            offsets = [start]
            sample_bytes = span
        else:
            offsets = [start + (span - sample_bytes) * i // (samples - 1) for i in range(samples)]
        for offset in offsets:
            f.seek(offset)
            digest.update(f.read(sample_bytes))
    return digest.hexdigest()[:32]


def _sha256(path: Path) -> str:
    from modelopt_ext.lock import sha256_file

    return sha256_file(path)


def checkpoint_files_read(model_dir: Path) -> list[str]:
    """The checkpoint's files a run reads: every top-level file but hidden ones (config, index, shards, remote
    code, tokenizer, generation config)."""
    return sorted(p.name for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("."))


def shard_fingerprint(shard: Path) -> str:
    """"size:N header:H data:D" of a safetensors file, reading its header and `data_samples` only."""
    with shard.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        length = int.from_bytes(f.read(8), "little")
        header = f.read(min(length, max(0, size - 8)))
    return f"size:{size} header:{hashlib.sha256(header).hexdigest()[:32]} data:{data_samples(shard)}"


def input_fingerprint(model_dir: str | os.PathLike, others: Mapping[str, str | os.PathLike | None]) -> dict[str, str]:
    """{"--model DIR/FILE": ..., "OPTION PATH": "sha256:..."} for the checkpoint's files and `others` (option ->
    path): shards by `shard_fingerprint`, every other file by its sha256."""
    model_dir = Path(model_dir)
    files = {}
    for name in checkpoint_files_read(model_dir):
        path = model_dir / name
        value = shard_fingerprint(path) if name.endswith(".safetensors") else f"sha256:{_sha256(path)[:32]}"
        files[f"--model {model_dir}/{name}"] = value
    for option, path in others.items():
        if path is not None:
            files[f"{option} {path}"] = f"sha256:{_sha256(Path(path))[:32]}"
    return files

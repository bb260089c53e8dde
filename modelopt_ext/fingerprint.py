"""What one rank will read, as short strings per file, for the ranks to compare before loading
(`dist.agree_files`): multi-node runs read node-local copies of the checkpoint, and a stale copy on one node
would otherwise be mixed into the export.

Per file a run reads from the checkpoint (`checkpoint_files.checkpoint_fingerprint`: shards by size and
header hash, every other file (config, index, remote code, tokenizer) by its sha256), with, for each shard,
a hash of a few samples of its tensor data added (a stale copy of the same shapes has the same header;
reading `SAMPLES` x `SAMPLE_BYTES` per shard costs a few seeks, not the data). Plus the sha256 of the other
inputs (the remote-code lock, the recipe, the dataset).

A copy that differs only in bytes outside the samples (one tensor edited in place) is not detected: hashing
all the data would read the whole checkpoint on every node (1.56 TB for Kimi-K3).
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


def input_fingerprint(model_dir: str | os.PathLike, others: Mapping[str, str | os.PathLike | None]) -> dict[str, str]:
    """{"--model DIR/FILE": ..., "OPTION PATH": "sha256:..."} for the checkpoint's files
    (`checkpoint_files.checkpoint_fingerprint`, shards with their `data_samples` added) and `others` (option ->
    path)."""
    from modelopt_ext.checkpoint_files import checkpoint_fingerprint
    from modelopt_ext.lock import sha256_file

    model_dir = Path(model_dir)
    files = {}
    for name, value in checkpoint_fingerprint(model_dir).items():
        if name.endswith(".safetensors"):
            value = f"{value} data:{data_samples(model_dir / name)}"
        files[f"--model {model_dir}/{name}"] = value
    for option, path in others.items():
        if path is not None:
            files[f"{option} {path}"] = f"sha256:{sha256_file(Path(path))}"
    return files

"""Checks (1) and (2) of `verify_export`: safetensors shards, the index, and duplicate tensor names.

Public: `check_layout` (a sharded safetensors folder: shards, index, names; also the source checkpoint's checks in
`modelopt_ext.checkpoint_files`) and `read_header` (one shard's header as entries)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from modelopt_ext.export.tensors import _Entry, _load_json, _pairs_hook

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit

_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}


def _header_json(path: Path, size: int, problems: list[str]) -> tuple[int, object] | None:
    """(header length, parsed header JSON) of one safetensors file, or None with the problem recorded."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            problems.append(f"{path.name}: not a safetensors file (file size {size}: shorter than the 8-byte "
                            "header length field)")
            return None
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            limit = "past the end of the file" if n > size - 8 else f"over the {MAX_HEADER_BYTES}-byte limit"
            problems.append(f"{path.name}: not a safetensors file (header length {n}, file size {size}): "
                            f"the header would end {limit}")
            return None
        if n < 2:
            problems.append(f"{path.name}: header length {n} is too short for a JSON header (at least 2 bytes, '{{}}')")
            return None
        raw = f.read(n)
    duplicates: list[str] = []
    try:
        header = json.loads(raw, object_pairs_hook=_pairs_hook(duplicates))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        if isinstance(e, json.JSONDecodeError) and (e.pos >= len(e.doc.rstrip()) or e.msg.startswith("Unterminated")):
            problems.append(f"{path.name}: header length {n} is too short: the JSON header is cut off after "
                            f"{n} bytes ({e})")
        else:
            problems.append(f"{path.name}: unreadable safetensors header ({e})")
        return None
    problems.extend(f"{path.name}: tensor {key} is named twice in the header" for key in duplicates)
    return n, header


def read_header(path: Path, problems: list[str]) -> dict[str, _Entry] | None:
    """Header entries of one safetensors file; offsets checked against the file size, and the tensors' data
    checked to fill the data section exactly (back to back from byte 0, nothing after the last one), as
    safetensors itself requires."""
    size = path.stat().st_size
    parsed = _header_json(path, size, problems)
    if parsed is None:
        return None
    n, header = parsed
    if not isinstance(header, dict):
        problems.append(f"{path.name}: safetensors header is not a JSON object")
        return None
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    entries, spans = {}, []
    for key, meta in header.items():
        try:
            dtype, shape = meta["dtype"], tuple(int(d) for d in meta["shape"])
            begin, end = (int(o) for o in meta["data_offsets"])
        except (TypeError, KeyError, ValueError):
            problems.append(f"{path.name}: malformed header entry for tensor {key}: {meta!r}")
            continue
        if dtype not in _DTYPE_BYTES:
            problems.append(f"{path.name}: tensor {key} has unknown dtype {dtype}")
            continue
        nbytes = math.prod(shape) * _DTYPE_BYTES[dtype]
        if end - begin != nbytes or begin < 0 or end > data_len:
            problems.append(
                f"{path.name}: tensor {key} data_offsets [{begin}, {end}] do not hold {dtype} {list(shape)} "
                f"({nbytes} bytes) inside the {data_len}-byte data section"
            )
            continue
        spans.append((begin, end, key))
        entries[key] = _Entry(key, path.name, dtype, shape, nbytes)
    if len(entries) == len(header):  # with a bad entry the spans are incomplete: gaps would be spurious
        _check_spans(path.name, sorted(spans), data_len, problems)
    return entries


def _check_spans(name: str, spans: list[tuple[int, int, str]], data_len: int, problems: list[str]) -> None:
    """Sorted (begin, end, key) data spans: no overlap, no gap, nothing before the first or after the last."""
    if spans and spans[0][0] > 0:
        problems.append(f"{name}: {spans[0][0]} bytes before the first tensor's data ({spans[0][2]} starts at "
                        f"byte {spans[0][0]} of the data section; safetensors needs it at 0)")
    for (_, end0, key0), (begin1, _, key1) in zip(spans, spans[1:]):
        if begin1 < end0:
            problems.append(f"{name}: tensors {key0} and {key1} overlap in the data section")
        elif begin1 > end0:
            problems.append(f"{name}: {begin1 - end0} bytes unused between tensors {key0} (ends at byte {end0}) "
                            f"and {key1} (starts at byte {begin1}) of the data section")
    held = max((end for _, end, _ in spans), default=0)
    if data_len > held:
        problems.append(f"{name}: {data_len - held} bytes after the last tensor's data (data section holds "
                        f"{held} bytes, the file has {data_len} after the header)")


MISSING_SHARD_KEYS_SHOWN = 3


def _check_index(
    path: Path, headers: dict[str, dict[str, _Entry]], where: dict[str, list[str]], shards: list[str],
    problems: list[str],
) -> None:
    index = _load_json(path, problems)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        problems.append(f"{path.name}: no weight_map object")
        return
    missing: dict[str, list[str]] = {}
    for key, shard in sorted(weight_map.items()):
        if shard not in shards:
            missing.setdefault(shard, []).append(key)
        elif shard in headers and key not in headers[shard]:
            if where.get(key):
                problems.append(f"{path.name}: tensor {key} is mapped to {shard} but stored in {', '.join(where[key])}")
            else:
                problems.append(f"tensor {key} is listed in {path.name} (shard {shard}) but missing from every shard")
    for shard, keys in sorted(missing.items()):  # one line per missing shard, however many tensors it held
        if len(keys) == 1:
            problems.append(f"{path.name}: tensor {keys[0]} is mapped to shard {shard}, which does not exist")
        else:
            shown = MISSING_SHARD_KEYS_SHOWN
            first = ", ".join(keys[:shown]) + (", ..." if len(keys) > shown else "")
            problems.append(f"{path.name}: {len(keys)} tensors are mapped to shard {shard}, which does not exist "
                            f"(first: {first})")
    referenced = set(weight_map.values())
    problems.extend(f"shard {s} is not referenced by {path.name}" for s in shards if s not in referenced)
    problems.extend(
        f"tensor {key} in {files[0]} is not listed in {path.name}"
        for key, files in sorted(where.items()) if key not in weight_map
    )
    metadata = index.get("metadata") or {}
    if not isinstance(metadata, dict):
        problems.append(f"{path.name}: metadata is not a JSON object: {metadata!r:.80}")
        metadata = {}
    total = metadata.get("total_size")
    if total is not None:
        actual = sum(e.nbytes for s in sorted(referenced & headers.keys()) for e in headers[s].values())
        if not isinstance(total, int) or total != actual:
            problems.append(
                f"{path.name}: metadata.total_size {total!r} != {actual} bytes of tensor data in its shards"
            )


def check_layout(export_dir: Path, problems: list[str]) -> tuple[list[str], dict[str, _Entry], int]:
    """Shard files, the tensors (first occurrence of each name) and their total data bytes."""
    shards = sorted(p.name for p in export_dir.glob("*.safetensors") if p.is_file())
    headers = {}
    for name in shards:
        header = read_header(export_dir / name, problems)
        if header is not None:
            headers[name] = header
    where: dict[str, list[str]] = defaultdict(list)
    for name, header in headers.items():
        for key in header:
            where[key].append(name)
    for key, files in sorted(where.items()):
        if len(files) > 1:
            problems.append(f"tensor {key} is stored in {len(files)} shards: {', '.join(files)}")
    indexes = sorted(p for p in export_dir.glob("*.safetensors.index.json") if p.is_file())
    if not shards:
        problems.append(f"no *.safetensors file in {export_dir}")
    if len(indexes) > 1:
        problems.append(f"several index files: {', '.join(p.name for p in indexes)}")
    if indexes:
        _check_index(indexes[0], headers, where, shards, problems)
    elif len(shards) > 1:
        problems.append(f"{len(shards)} safetensors files ({', '.join(shards)}) but no {INDEX_NAME}")
    entries: dict[str, _Entry] = {}
    for name in sorted(headers):
        for key, entry in headers[name].items():
            entries.setdefault(key, entry)
    tensor_bytes = sum(e.nbytes for header in headers.values() for e in header.values())
    return shards, entries, tensor_bytes


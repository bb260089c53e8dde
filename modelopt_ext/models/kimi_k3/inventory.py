"""The real Kimi-K3 checkpoint's tensor inventory: a derived table, its expansion, and comparisons against it.

`real_inventory.json` (next to this file) holds one entry per tensor *kind* of moonshotai/Kimi-K3 at the
pinned revision, with the real full-size shape and the stored dtype: per decoder layer (`all` layers,
`kda` / `mla` attention, `dense_mlp` / `moe` feed-forward, one routed `expert`), per vision block, and
the model-level tensors. Which layer has which kind is not stored per layer: it follows from the config
subset the table carries (or from a raw config.json), the way the upstream code decides it:

- layer i (0-based) is KDA iff i + 1 is in `linear_attn_config["kda_layers"]`, otherwise MLA (the 1-based
  `full_attn_layers` must then be exactly the others);
- layer i has the sparse MoE block iff `num_experts` is set, i >= `first_k_dense_replace` and
  i % `moe_layer_freq` == 0, otherwise the dense MLP.

A tensor map is `{name: (shape, dtype)}` with `shape` a tuple of ints and `dtype` a torch dtype name
without the `torch.` prefix ("bfloat16", "float32", "uint8").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import struct
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

INVENTORY_FILE = Path(__file__).with_name("real_inventory.json")
LAYER_PREFIX = "language_model.model.layers."
VISION_BLOCK_PREFIX = "vision_tower.encoder.blocks."
EXPERT_INFIX = "block_sparse_moe.experts."
# safetensors header dtype codes -> torch dtype names
SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
DEFAULT_LIMIT = 50

TensorMap = dict[str, tuple[tuple[int, ...], str]]


def load_real_inventory(path: str | Path = INVENTORY_FILE) -> dict[str, Any]:
    """The derived table of the real checkpoint (`real_inventory.json`), as a dict."""
    with open(path) as f:
        inventory = json.load(f)
    for key in ("source", "totals", "config", "per_layer", "vision_block", "model"):
        if key not in inventory:
            raise ValueError(f"{path}: inventory has no {key!r} section")
    return inventory


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which 0-based decoder layers have which kind, and the expert and vision-block counts."""

    num_layers: int
    kda: tuple[int, ...]
    mla: tuple[int, ...]
    dense: tuple[int, ...]
    moe: tuple[int, ...]
    num_experts: int
    vision_blocks: int

    def __post_init__(self):
        object.__setattr__(self, "_kda_set", frozenset(self.kda))
        object.__setattr__(self, "_moe_set", frozenset(self.moe))

    def attention_kind(self, layer: int) -> str:
        """"kda" or "mla"."""
        return "kda" if layer in self._kda_set else "mla"

    def mlp_kind(self, layer: int) -> str:
        """"moe" or "dense_mlp"."""
        return "moe" if layer in self._moe_set else "dense_mlp"


def layer_schedule(config: Mapping[str, Any]) -> Schedule:
    """The layer schedule of a config: a raw config.json dict (with `text_config` / `vision_config`) or
    the inventory's `config` subset. Raises ValueError when `kda_layers` and `full_attn_layers` disagree."""
    text = config.get("text_config", config)
    vision = config.get("vision_config") or {}
    try:
        n = int(text["num_hidden_layers"])
        lac = text["linear_attn_config"]
        kda_1based = [int(i) for i in lac["kda_layers"]]
        full_1based = [int(i) for i in lac["full_attn_layers"]]
    except (KeyError, TypeError) as e:
        raise ValueError(f"config has no layer schedule: missing {e} in text_config") from None
    kda_set = set(kda_1based)
    kda = tuple(i for i in range(n) if i + 1 in kda_set)
    mla = tuple(i for i in range(n) if i + 1 not in kda_set)
    if sorted(i - 1 for i in full_1based) != list(mla):
        raise ValueError(
            f"linear_attn_config: full_attn_layers {full_1based} (1-based) are not the layers outside "
            f"kda_layers, which are {[i + 1 for i in mla]}"
        )
    if any(not 1 <= i <= n for i in kda_1based):
        raise ValueError(f"linear_attn_config: kda_layers {kda_1based} reach outside 1..{n}")
    num_experts = text.get("num_experts")
    first_dense = int(text.get("first_k_dense_replace", 0))
    freq = int(text.get("moe_layer_freq", 1))
    moe = tuple(i for i in range(n) if num_experts is not None and i >= first_dense and i % freq == 0)
    dense = tuple(i for i in range(n) if i not in frozenset(moe))
    blocks = vision.get("vt_num_hidden_layers", vision.get("num_hidden_layers", 0))
    return Schedule(n, kda, mla, dense, moe, int(num_experts or 0), int(blocks))


def _entry(value: Any, where: str) -> tuple[tuple[int, ...], str]:
    shape, dtype = value
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"inventory entry {where}: shape {shape} is not a list of non-negative ints")
    return tuple(shape), dtype_name(dtype)


def expected_tensors(inventory: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> TensorMap:
    """Every tensor the real checkpoint stores, `{name: (shape, dtype)}`, for the layer schedule of
    `config` (default: the inventory's own config subset). Shapes are the table's full-size ones."""
    schedule = layer_schedule(config if config is not None else inventory["config"])
    per_layer = inventory["per_layer"]
    out: TensorMap = {}
    for name, value in inventory["model"].items():
        out[name] = _entry(value, name)
    for b in range(schedule.vision_blocks):
        for leaf, value in inventory["vision_block"].items():
            out[f"{VISION_BLOCK_PREFIX}{b}.{leaf}"] = _entry(value, f"vision_block.{leaf}")
    for i in range(schedule.num_layers):
        prefix = f"{LAYER_PREFIX}{i}."
        for kind in ("all", schedule.attention_kind(i), schedule.mlp_kind(i)):
            for leaf, value in per_layer[kind].items():
                out[prefix + leaf] = _entry(value, f"per_layer.{kind}.{leaf}")
        if i in schedule.moe:
            expert_entries = [(leaf, _entry(v, f"per_layer.expert.{leaf}")) for leaf, v in per_layer["expert"].items()]
            for e in range(schedule.num_experts):
                for leaf, entry in expert_entries:
                    out[f"{prefix}{EXPERT_INFIX}{e}.{leaf}"] = entry
    logger.debug("expanded the inventory to %d tensors over %d layers", len(out), schedule.num_layers)
    return out


def total_params(tensors: Mapping[str, tuple[Iterable[int], str]]) -> int:
    """Sum of the element counts of every tensor, counting packed uint8 bytes as stored elements."""
    return sum(math.prod(shape) for shape, _ in tensors.values())


_ELEMENT_SIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "float16": 2, "bfloat16": 2, "int32": 4,
                 "float32": 4, "int64": 8, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}


def total_bytes(tensors: Mapping[str, tuple[Iterable[int], str]]) -> int:
    """Stored bytes of every tensor."""
    return sum(math.prod(shape) * _ELEMENT_SIZE[dtype] for shape, dtype in tensors.values())


def dtype_name(dtype: Any) -> str:
    """A torch dtype, its string form ("torch.bfloat16") or a safetensors code ("BF16") as "bfloat16"."""
    text = str(dtype)
    text = SAFETENSORS_DTYPES.get(text, text)
    return text.removeprefix("torch.")


def name_pattern(name: str, schedule: Schedule) -> str:
    """`name` with its layer, expert and vision-block indices replaced by the kind they stand for:
    `layers.{kda}.self_attn.q_proj.weight`, `layers.{moe}.block_sparse_moe.experts.{expert}.w1.weight_packed`,
    `layers.{layer}.input_layernorm.weight`, `vision_tower.encoder.blocks.{block}.wo.weight`."""
    if name.startswith(VISION_BLOCK_PREFIX):
        rest = name[len(VISION_BLOCK_PREFIX):]
        _, _, leaf = rest.partition(".")
        return f"{VISION_BLOCK_PREFIX}{{block}}.{leaf}"
    if not name.startswith(LAYER_PREFIX):
        return name
    index, _, leaf = name[len(LAYER_PREFIX):].partition(".")
    if not index.isdigit():
        return name
    layer = int(index)
    if leaf.startswith("self_attn."):
        kind = schedule.attention_kind(layer)
    elif leaf.startswith("mlp."):
        kind = "dense_mlp"
    elif leaf.startswith("block_sparse_moe."):
        kind = "moe"
        leaf = re.sub(r"^block_sparse_moe\.experts\.\d+\.", "block_sparse_moe.experts.{expert}.", leaf)
    else:
        kind = "layer"
    return f"{LAYER_PREFIX}{{{kind}}}.{leaf}"


def patterns(tensors: Mapping[str, tuple[Any, Any]], schedule: Schedule) -> dict[str, set[str]]:
    """`{name_pattern: dtypes}` of a tensor map."""
    out: dict[str, set[str]] = {}
    for name, (_, dtype) in tensors.items():
        out.setdefault(name_pattern(name, schedule), set()).add(dtype_name(dtype))
    return out


def _shape_text(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def compare(
    expected: Mapping[str, tuple[Iterable[int], Any]],
    actual: Mapping[str, tuple[Iterable[int], Any]],
    limit: int = DEFAULT_LIMIT,
) -> list[str]:
    """Readable differences between two tensor maps, empty when they agree: `missing` (expected, not in
    `actual`), `unexpected`, `shape` and `dtype` lines, in name order. At most `limit` lines; past that
    the last line counts the rest by kind."""
    problems: list[tuple[str, str]] = []
    for name in sorted(expected.keys() - actual.keys()):
        shape, dtype = expected[name]
        problems.append(("missing", f"missing: {name} {_shape_text(shape)} {dtype_name(dtype)}"))
    for name in sorted(actual.keys() - expected.keys()):
        shape, dtype = actual[name]
        problems.append(("unexpected", f"unexpected: {name} {_shape_text(shape)} {dtype_name(dtype)}"))
    differing = []
    for name in expected.keys() & actual.keys():
        (e_shape, e_dtype), (a_shape, a_dtype) = expected[name], actual[name]
        if tuple(e_shape) != tuple(a_shape) or (e_dtype != a_dtype and dtype_name(e_dtype) != dtype_name(a_dtype)):
            differing.append(name)
    for name in sorted(differing):
        (e_shape, e_dtype), (a_shape, a_dtype) = expected[name], actual[name]
        if tuple(e_shape) != tuple(a_shape):
            problems.append(("shape", f"shape: {name} expected {_shape_text(e_shape)}, got {_shape_text(a_shape)}"))
        if dtype_name(e_dtype) != dtype_name(a_dtype):
            problems.append(("dtype", f"dtype: {name} expected {dtype_name(e_dtype)}, got {dtype_name(a_dtype)}"))
    if len(problems) <= limit:
        return [text for _, text in problems]
    shown = max(limit - 1, 0)
    rest = Counter(kind for kind, _ in problems[shown:])
    counts = ", ".join(f"{kind} {rest[kind]}" for kind in ("missing", "unexpected", "shape", "dtype") if rest[kind])
    return [text for _, text in problems[:shown]] + [f"... and {len(problems) - shown} more ({counts})"]


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def checkpoint_tensors(checkpoint: str | Path) -> TensorMap:
    """`{name: (shape, dtype)}` of a safetensors checkpoint folder, read from the shard headers (no weights).
    With a `model.safetensors.index.json`, its weight map must name exactly the tensors of its shards."""
    folder = Path(checkpoint)
    index_path = folder / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    else:
        weight_map = None
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{folder}: no safetensors shards")
    out: TensorMap = {}
    for shard in shards:
        for name, info in _safetensors_header(folder / shard).items():
            if weight_map is not None and weight_map.get(name) != shard:
                raise ValueError(f"{folder}: {name} is in {shard} but the index maps it to {weight_map.get(name)}")
            out[name] = (tuple(info["shape"]), dtype_name(info["dtype"]))
    if weight_map is not None and weight_map.keys() != out.keys():
        absent = sorted(weight_map.keys() - out.keys())
        raise ValueError(f"{folder}: the index names {len(absent)} tensors no shard holds, e.g. {absent[:3]}")
    return out

"""Distribution plan: experts per rank, replicated or FSDP-sharded dense layers, and the memory per rank.

Resolved from `config.json` alone, through the family's `sizes(config)` figures: no weights are read, no
process group is touched. Every rank resolves its own plan; agreement between ranks is checked elsewhere
by comparing `DistributionPlan.to_dict()`.

Memory per rank (bytes; W world size, ep EP degree, T tokens per rank):
- read from disk: stored experts / ep (each rank reads only its own experts) + dense bytes (replicated)
  or dense bytes / W (FSDP: each rank reads its shard), as the checkpoint stores them.
- resident experts: all experts at the storage they are held in after loading / ep: MXFP4 experts stay packed,
  FP8 (128x128-block) experts are dequantized to bf16 ("dense"), bf16 ones stay bf16. With FSDP and ep < W,
  transformers also shards each rank's experts over the W / ep ranks holding the same experts and gathers one MoE
  layer at a time: experts / W + one layer's local experts.
- resident dense: all of it (replicated), or dense / W + the largest FSDP unit gathered (FSDP), as held after
  loading: the family's `loaded_dense_bytes` / `loaded_largest_dense_unit_bytes` where it gives them (an FP8
  checkpoint's dense Linears are dequantized too), else the stored bytes.
- activations per calibration batch, an estimate (attention workspaces are not counted):
  hidden states T x H x 2 B x live_hidden_states (tensors kept alive across a layer), plus the larger of
  a MoE layer's peak -- dispatch send + receive buffers 2 x T x top_k x latent x 2 B and the expert
  intermediate for the received rows T x top_k x 2I x 2 B (balanced routing) -- and the logits
  T x vocab x (2 + 4) B (bf16 output and its fp32 copy).
A plan fits when the total stays within USABLE_FRACTION of the device memory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from modelopt_ext.families import (
    FamilySpec,
    families,
    family_for_config,
    read_config,
    source_quantization_config,
    stored_expert_storage,
)
from modelopt_ext.options import DEFAULT, ExpertsOptions

logger = logging.getLogger(__name__)

DENSE_MODES = ("replicate", "fsdp")
EXPERT_STORAGES = ("mxfp4", "dense")  # how experts are held in memory
# how a checkpoint stores its experts: MXFP4 packed, FP8 E4M3 with a float32 scale per 128x128 block (1 B a weight
# + 4 B a block: the family's `expert_bytes`), or 16-bit
STORED_EXPERT_STORAGES = ("mxfp4", "fp8", "dense")
# stored -> held after loading by default: FP8 experts are dequantized by the load (bf16)
LOADED_EXPERT_STORAGE = {"mxfp4": "mxfp4", "fp8": "dense", "dense": "dense"}
EP_IMPLEMENTATION = "torch_a2a"
USABLE_FRACTION = 0.9
BF16, FP32 = 2, 4
# Figures a family's `sizes(config)` must return.
REQUIRED_SIZES = (
    "num_experts", "num_moe_layers", "num_layers", "hidden_size", "latent_size", "expert_intermediate_size",
    "top_k", "vocab_size", "expert_params", "expert_bytes", "dense_params", "dense_bytes",
    "largest_dense_unit_bytes", "live_hidden_states",
)
# Figures a family may add: the dense modules' bytes as held after loading where they differ from the stored ones
# (default: `dense_bytes`, `largest_dense_unit_bytes`).
OPTIONAL_SIZES = ("loaded_dense_bytes", "loaded_largest_dense_unit_bytes")
GIB, GB = 2**30, 10**9


def unsupported_replicas_message(what: str, ep_size: int, world_size: int) -> str:
    """Why calibration refuses an EP degree below the world size (EP x data-parallel replicas)."""
    return (f"{what}: EP degree {ep_size} on {world_size} ranks ({world_size // ep_size} replicas of every expert) is "
            "not supported: calibration and export assume every rank holds distinct experts (the replicas' "
            "statistics are not reduced and the export's expert offsets would collide); use an EP degree equal to "
            f"the world size ({world_size}), or run on {ep_size} ranks")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def checkpoint_expert_storage(config: Mapping[str, Any]) -> str:
    """How the checkpoint stores its experts (`STORED_EXPERT_STORAGES`): "fp8" for a `quant_method: fp8`
    quantization_config (E4M3 weights, float32 scales per 128x128 block), else `families.stored_expert_storage`
    ("mxfp4" | "dense")."""
    quant = source_quantization_config(config) or {}
    return "fp8" if quant.get("quant_method") == "fp8" else stored_expert_storage(config)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank; `total_bytes` is what stays resident at the peak (read bytes are not resident)."""

    read_bytes: int
    expert_bytes: int
    dense_bytes: int
    activation_bytes: int
    total_bytes: int = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "total_bytes", self.expert_bytes + self.dense_bytes + self.activation_bytes)


def estimate_memory(
    sizes: Mapping[str, int], world_size: int, ep_size: int, dense: str, expert_storage: str, stored_storage: str,
    tokens_per_rank: int,
) -> MemoryEstimate:
    """Per-rank memory of one placement (see the module docstring for the formulas)."""
    if expert_storage == stored_storage:
        experts_total = sizes["expert_bytes"]
    elif expert_storage == "dense":
        experts_total = sizes["expert_params"] * BF16
    else:
        raise ValueError(f"expert storage {expert_storage!r} needs an MXFP4 checkpoint; this one stores experts "
                         f"{stored_storage}")
    if dense == "fsdp" and world_size > ep_size:
        experts = _ceil_div(experts_total, world_size) + _ceil_div(experts_total, ep_size * sizes["num_moe_layers"])
    else:
        experts = _ceil_div(experts_total, ep_size)
    loaded_dense = sizes.get("loaded_dense_bytes", sizes["dense_bytes"])
    loaded_unit = sizes.get("loaded_largest_dense_unit_bytes", sizes["largest_dense_unit_bytes"])
    if dense == "replicate":
        dense_resident, dense_read = loaded_dense, sizes["dense_bytes"]
    else:
        dense_resident = _ceil_div(loaded_dense, world_size) + loaded_unit
        dense_read = _ceil_div(sizes["dense_bytes"], world_size)
    T, k = tokens_per_rank, sizes["top_k"]
    hidden = T * sizes["hidden_size"] * BF16 * sizes["live_hidden_states"]
    moe_peak = 2 * T * k * sizes["latent_size"] * BF16 + T * k * 2 * sizes["expert_intermediate_size"] * BF16
    logits = T * sizes["vocab_size"] * (BF16 + FP32)
    return MemoryEstimate(
        read_bytes=_ceil_div(sizes["expert_bytes"], ep_size) + dense_read,
        expert_bytes=experts,
        dense_bytes=dense_resident,
        activation_bytes=hidden + max(moe_peak, logits),
    )


@dataclasses.dataclass(frozen=True)
class DistributionPlan:
    """How one run places a model on `world_size` ranks: experts by EP, dense layers replicated or FSDP."""

    family: str
    world_size: int
    ep_size: int
    dp_size: int  # ranks with distinct batches: every rank
    dense: str  # "replicate" | "fsdp"
    num_experts: int
    experts_per_rank: int
    expert_storage: str  # "mxfp4" | "dense", as held in memory (an FP8 checkpoint's experts: "dense")
    estimate: MemoryEstimate
    device_memory_bytes: int
    tokens_per_rank: int
    expert_total_bytes: int  # all experts as stored on disk
    dense_total_bytes: int
    reason: str  # why `dense` was chosen
    experts_options: ExpertsOptions = DEFAULT  # how the experts and their exchange run: the same on every rank

    @property
    def replicas(self) -> int:
        """Copies of the experts: world_size / ep_size (1 when every rank holds distinct experts)."""
        return self.world_size // self.ep_size

    def check_calibration_supported(self, what: str) -> None:
        """ValueError unless calibration and export can run on this placement: today they assume every rank
        holds distinct experts (EP degree = world size); with replicas the expert statistics and the export's
        expert offsets would mix ranks that hold the same experts."""
        if self.replicas > 1:
            raise ValueError(unsupported_replicas_message(what, self.ep_size, self.world_size))

    def distributed_config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of transformers' `DistributedConfig` (the loader adds the replicate tp_plan)."""
        if self.dense == "fsdp":
            return {"fsdp_size": self.world_size, "ep_size": self.ep_size, "ep_implementation": EP_IMPLEMENTATION}
        return {"tp_size": self.world_size, "ep_size": self.ep_size, "ep_implementation": EP_IMPLEMENTATION}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DistributionPlan:
        d = dict(d)
        est = {k: v for k, v in d.pop("estimate").items() if k != "total_bytes"}
        if "experts_options" in d:
            d["experts_options"] = ExpertsOptions.from_dict(d["experts_options"])
        return cls(estimate=MemoryEstimate(**est), **d)

    def summary(self) -> str:
        e = self.estimate
        kwargs = ", ".join(f"{k}={v!r}" for k, v in self.distributed_config_kwargs().items())
        usable = USABLE_FRACTION * self.device_memory_bytes
        rows = [
            ("read from disk", e.read_bytes),
            (f"experts resident ({self.expert_storage})", e.expert_bytes),
            (f"dense resident ({self.dense})", e.dense_bytes),
            (f"activations ({self.tokens_per_rank} tokens, est.)", e.activation_bytes),
            ("total resident", e.total_bytes),
            ("device memory", self.device_memory_bytes),
            (f"usable ({USABLE_FRACTION:.0%})", int(usable)),
        ]
        lines = [
            f"{self.family} on {self.world_size} ranks: EP {self.ep_size}, dense {self.dense}, "
            f"{self.dp_size} distinct batches",
            *([f"  note: {unsupported_replicas_message('ptq', self.ep_size, self.world_size)}"]
              if self.replicas > 1 else []),
            f"  experts: {self.num_experts} per MoE layer, {self.experts_per_rank} per rank, "
            f"{self.expert_total_bytes / GB:.1f} GB stored in all",
            f"  dense layers: {self.dense_total_bytes / GB:.1f} GB in all",
            f"  choice: {self.reason}",
            f"  DistributedConfig({kwargs})",
            f"  {'per rank':<36} {'GiB':>9} {'GB':>9}",
        ]
        lines += [f"  {name:<36} {b / GIB:>9.1f} {b / GB:>9.1f}" for name, b in rows]
        return "\n".join(lines)


def default_device_memory() -> int:
    """Memory of CUDA device 0, or the host's physical RAM without CUDA."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def read_model_config(model: str | Path) -> tuple[dict[str, Any], str]:
    """(config mapping, source) of a checkpoint folder (config.json only) or a family's bundled config name."""
    path = Path(model)
    if path.exists():
        return read_config(path), str(path / "config.json")
    # by family in registration order, each family's in its own order
    bundled = {name: file for spec in families().values() for name, file in spec.bundled_configs.items()}
    if str(model) not in bundled:
        raise FileNotFoundError(
            f"{model} is neither a checkpoint folder nor a bundled config (bundled: {', '.join(bundled)})"
        )
    return json.loads(Path(bundled[str(model)]).read_text()), f"bundled config {model}"


def _family_sizes(config: Mapping[str, Any], family: FamilySpec | str | None) -> tuple[FamilySpec, Mapping]:
    if family is None:
        family = family_for_config(config)
    elif isinstance(family, str):
        known = families()
        if family not in known:
            raise ValueError(f"unknown model family {family!r} (known: {', '.join(sorted(known))})")
        family = known[family]
    if family.sizes is None:
        raise ValueError(f"family {family.name!r} does not provide sizes(config): cannot plan its distribution")
    sizes = family.sizes(config)
    missing = [k for k in REQUIRED_SIZES if k not in sizes]
    if missing:
        raise ValueError(f"family {family.name!r}: sizes(config) lacks {missing}")
    return family, sizes


def _fmt(b: float) -> str:
    return f"{b / GIB:.1f} GiB"


def resolve_distribution_plan(
    config: Mapping[str, Any],
    world_size: int,
    *,
    family: FamilySpec | str | None = None,
    ep_size: int | None = None,
    dense: str | None = None,
    device_memory_bytes: int | None = None,
    tokens_per_rank: int = 4096,
    expert_storage: str | None = None,
    experts_options: ExpertsOptions = DEFAULT,
) -> DistributionPlan:
    """Choose the placement of `config`'s model on `world_size` ranks, or refuse with the numbers.

    Args:
        config: a `config.json` mapping.
        world_size: number of ranks.
        family: FamilySpec or family name; looked up by the config's model_type when None.
        ep_size: EP degree (default world_size); must divide world_size and num_experts.
        dense: "replicate" | "fsdp"; None picks replicate when it fits (and ep_size == world_size), else fsdp.
        device_memory_bytes: memory of one device (default: CUDA device 0, else physical RAM).
        tokens_per_rank: tokens of one calibration batch per rank (for the activation estimate).
        expert_storage: "mxfp4" | "dense" in memory; default as the load holds the checkpoint's experts
            (`LOADED_EXPERT_STORAGE`: MXFP4 kept packed, FP8 dequantized).
        experts_options: how the experts and their exchange run (`modelopt_ext.options`), carried by the plan
            so that the ranks agree on them with it.
    Raises:
        ValueError naming the offending numbers.
    """
    if world_size < 1:
        raise ValueError(f"world_size ({world_size}) must be at least 1")
    ep = world_size if ep_size is None else ep_size
    if ep < 2:
        raise ValueError(f"EP degree {ep} on the EP path (world_size {world_size}): expert parallelism needs at "
                         "least 2 ranks")
    if world_size % ep:
        raise ValueError(f"world_size ({world_size}) is not divisible by the EP degree ({ep})")
    if dense is not None and dense not in DENSE_MODES:
        raise ValueError(f"dense {dense!r} is not one of {', '.join(DENSE_MODES)}")
    if dense == "replicate" and ep != world_size:
        raise ValueError(
            f"dense 'replicate' needs the EP degree ({ep}) to equal world_size ({world_size}): replicated dense "
            "layers use tp_size = world_size, and transformers requires ep_size to be a multiple of tp_size"
        )
    if tokens_per_rank < 1:
        raise ValueError(f"tokens_per_rank ({tokens_per_rank}) must be at least 1")
    spec, sizes = _family_sizes(config, family)
    num_experts = sizes["num_experts"]
    if num_experts % ep:
        raise ValueError(f"num_experts ({num_experts}) is not divisible by the EP degree ({ep})")
    stored = checkpoint_expert_storage(config)
    storage = LOADED_EXPERT_STORAGE[stored] if expert_storage is None else expert_storage
    if storage not in EXPERT_STORAGES:
        hint = " (FP8 experts are dequantized when loaded: 'dense')" if storage == "fp8" else ""
        raise ValueError(f"expert_storage {storage!r} is not one of {', '.join(EXPERT_STORAGES)}{hint}")
    memory = default_device_memory() if device_memory_bytes is None else device_memory_bytes
    if memory <= 0:
        raise ValueError(f"device memory ({memory} bytes) must be positive")
    usable = USABLE_FRACTION * memory

    candidates = [dense] if dense is not None else (["replicate", "fsdp"] if ep == world_size else ["fsdp"])
    notes = []
    for mode in candidates:
        est = estimate_memory(sizes, world_size, ep, mode, storage, stored, tokens_per_rank)
        logger.debug("%s with dense %s: %s", spec.name, mode, est)
        if est.total_bytes <= usable:
            break
        notes.append(f"dense {mode} needs {_fmt(est.total_bytes)} per rank > {_fmt(usable)} usable")
    else:
        raise ValueError(
            f"{spec.name} on {world_size} ranks (EP {ep}) of {_fmt(memory)}: parts that cannot be placed per rank "
            f"with dense {mode}: experts {_fmt(est.expert_bytes)} + dense {_fmt(est.dense_bytes)} + activations "
            f"{_fmt(est.activation_bytes)} = {est.total_bytes} bytes ({_fmt(est.total_bytes)}) needed, "
            f"{int(usable)} bytes ({_fmt(usable)}, {USABLE_FRACTION:.0%} of the device) available"
        )
    if dense is not None:
        reason = f"dense {mode} requested; fits in {_fmt(usable)} usable"
    else:
        if ep != world_size:
            notes.insert(0, f"replicate needs EP degree = world_size ({ep} != {world_size})")
        reason = "; ".join([*notes, f"{mode} fits in {_fmt(usable)} usable ({USABLE_FRACTION:.0%} of {_fmt(memory)})"])
    plan = DistributionPlan(
        family=spec.name, world_size=world_size, ep_size=ep, dp_size=world_size, dense=mode,
        num_experts=num_experts, experts_per_rank=num_experts // ep, expert_storage=storage, estimate=est,
        device_memory_bytes=memory, tokens_per_rank=tokens_per_rank, expert_total_bytes=sizes["expert_bytes"],
        dense_total_bytes=sizes["dense_bytes"], reason=reason, experts_options=experts_options,
    )
    logger.info("distribution plan for %s: world %d, EP %d, dense %s, %d experts per rank, %s per rank",
                spec.name, world_size, ep, mode, plan.experts_per_rank, _fmt(est.total_bytes))
    return plan

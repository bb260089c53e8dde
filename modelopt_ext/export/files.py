"""Which tensor goes to which safetensors file of an export, as a function of the model alone.

The layout does not depend on the number of ranks, so exports made at EP 1, 2, 4, ... are byte-identical:

- file 1: everything outside the decoder layers (embeddings, final norm, lm_head, vision tower, projector);
- per decoder layer: one file with the layer's dense tensors (attention, router, shared experts, norms),
  then, for an MoE layer, one file per block of `experts_per_file` consecutive routed experts;
- last, where the source has layers the model does not build (`FamilySpec.carried_layers`, e.g. DeepSeek-V3's
  multi-token-prediction layer), one file with their tensors.

Files are named `model-{k:05d}-of-{N:05d}.safetensors` in that order. A block of experts is written by the
rank holding them, so `experts_per_file` must divide the experts per rank; the default,
`num_experts // gcd(num_experts, 64)`, divides it for every EP degree that divides 64 (14 for Kimi-K3's
896 experts; 1 for the 16 of the tiny stand-in). Dense files are spread over the ranks round-robin.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping


def default_experts_per_file(num_experts: int) -> int:
    return num_experts // math.gcd(num_experts, 64)


def check_experts_per_file(num_experts: int, ep_size: int, experts_per_file: int | None) -> int:
    """The experts per file to use; raises ValueError naming the values when it cannot be used at `ep_size`."""
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"EP degree {ep_size} does not divide the {num_experts} routed experts of a layer")
    per_file = default_experts_per_file(num_experts) if experts_per_file is None else experts_per_file
    if per_file < 1 or num_experts % per_file:
        raise ValueError(f"experts per file {per_file} must be a positive divisor of the {num_experts} experts")
    per_rank = num_experts // ep_size
    if per_rank % per_file:
        raise ValueError(
            f"EP degree {ep_size} gives {per_rank} experts per rank, not a multiple of {per_file} experts per "
            f"file: pass --experts-per-file with a divisor of {per_rank}"
        )
    return per_file


@dataclasses.dataclass(frozen=True)
class ExportFiles:
    """The file plan. `layers` is the decoder layers' container (e.g. `language_model.model.layers`),
    `experts_suffix` the routed experts' module under a layer (e.g. `block_sparse_moe.experts`),
    `moe_layers` the layer indices that have routed experts."""

    layers: str
    num_layers: int
    moe_layers: tuple[int, ...]
    experts_suffix: str
    num_experts: int
    experts_per_file: int
    carried: int = 0  # 1 where the export carries source layers the model does not build (the last file)

    @property
    def blocks(self) -> int:
        return self.num_experts // self.experts_per_file

    @property
    def count(self) -> int:
        return 1 + self.num_layers + len(self.moe_layers) * self.blocks + self.carried

    def name(self, k: int) -> str:
        return f"model-{k:05d}-of-{self.count:05d}.safetensors"

    def rest_file(self) -> str:
        return self.name(1)

    def carried_file(self) -> str:
        if not self.carried:
            raise ValueError("this export carries no source layers")
        return self.name(self.count)

    def _layer_base(self, layer: int) -> int:
        """1-based number of layer `layer`'s dense file."""
        moe_before = sum(1 for i in self.moe_layers if i < layer)
        return 2 + layer + moe_before * self.blocks

    def dense_file(self, layer: int) -> str:
        return self.name(self._layer_base(layer))

    def experts_file(self, layer: int, expert: int) -> str:
        if layer not in self.moe_layers:
            raise ValueError(f"layer {layer} has no routed experts")
        return self.name(self._layer_base(layer) + 1 + expert // self.experts_per_file)

    def dense_writer(self, layer: int | None, world_size: int) -> int:
        """The rank writing layer `layer`'s dense file (None: the file of everything outside the layers;
        `num_layers`: the carried layers' file)."""
        return 0 if layer is None else (layer + 1) % world_size

    def file_of(self, key: str) -> str:
        """The file of an exported tensor name (experts already renamed to global ids)."""
        m = re.match(rf"^{re.escape(self.layers)}\.(\d+)\.(.*)$", key)
        if m is None:
            return self.rest_file()
        layer, rest = int(m.group(1)), m.group(2)
        if layer >= self.num_layers:
            return self.carried_file()
        e = re.match(rf"^{re.escape(self.experts_suffix)}\.(\d+)\.", rest)
        return self.experts_file(layer, int(e.group(1))) if e else self.dense_file(layer)


def expert_key_renamer(experts_suffix: str, names: Mapping[str, str]):
    """`rename(key, offset)`: `...{experts_suffix}.{i}.{proj}.x` -> `...{experts_suffix}.{i + offset}.{names[proj]}.x`
    (local expert index to global id; ModelOpt's projection names to the checkpoint's)."""
    pattern = re.compile(rf"^(.*\.{re.escape(experts_suffix)})\.(\d+)\.([A-Za-z0-9_]+)\.(.+)$")

    def rename(key: str, offset: int) -> str:
        m = pattern.match(key)
        if m is None:
            return key
        proj = names.get(m.group(3), m.group(3))
        return f"{m.group(1)}.{int(m.group(2)) + offset}.{proj}.{m.group(4)}"

    rename.pattern = pattern  # type: ignore[attr-defined]
    return rename

"""Expert coverage during calibration: how many routed tokens each expert of each MoE layer saw.

Counts are taken from the routers' outputs (global expert ids, before any EP dispatch), accumulated on the
device with `ep.dispatch.count_ids` (no host sync per step, unlike CUDA's `bincount`) and, under
torch.distributed, summed over the ranks when the recording ends, so every rank holds the global counts. An
expert with zero tokens got no activation statistics: calibration policies and the report use `uncovered()`.

Shapes: T routed tokens in one forward, K top-k, E experts of a layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import struct
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from modelopt_ext.ep.dispatch import count_ids
from modelopt_ext.families import RouterOutput


@dataclasses.dataclass
class Coverage:
    """Routed-token counts per MoE layer (module name of its router) and global expert id."""

    num_experts: int
    counts: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # router name -> int64 [E]

    def add(self, router: str, topk_ids_TK: torch.Tensor) -> None:
        c = count_ids(topk_ids_TK.reshape(-1), self.num_experts)
        self.counts[router] = self.counts[router] + c if router in self.counts else c

    def all_reduce(self) -> None:
        """Sum counts over the ranks (collective; same routers on every rank)."""
        if not (dist.is_available() and dist.is_initialized()) or not self.counts:
            return
        names = sorted(self.counts)
        flat = torch.stack([self.counts[n] for n in names])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        self.counts = dict(zip(names, flat.unbind(0)))

    def table(self) -> dict[str, list[int]]:
        return {name: self.counts[name].tolist() for name in sorted(self.counts, key=_layer_order)}

    def uncovered(self) -> dict[str, list[int]]:
        """Router name -> experts that received no token."""
        return {name: [e for e, n in enumerate(row) if n == 0] for name, row in self.table().items()
                if 0 in row}

    def summary_line(self) -> str:
        table = self.table()
        total = sum(len(row) for row in table.values())
        missing = sum(len(v) for v in self.uncovered().values())
        tokens = min((sum(row) for row in table.values()), default=0)
        return (f"expert coverage: {total - missing}/{total} (layer, expert) pairs received tokens "
                f"over {len(table)} MoE layers; {missing} received none; >= {tokens} routed slots per layer")

    def write_json(self, path: str | Path) -> None:
        data = {"num_experts": self.num_experts, "counts": self.table(), "uncovered": self.uncovered()}
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    def write_png(self, path: str | Path, cell: int = 4) -> None:
        """Heatmap: one row per MoE layer, one column per expert; black = 0 tokens (uncovered), then
        blue -> yellow by log(count) relative to the largest count."""
        rows = list(self.table().values())
        if not rows:
            raise ValueError("no coverage recorded: no router saw a token")
        peak = max(max(r) for r in rows) or 1
        pixels = []
        for row in rows:
            line = bytearray()
            for n in row:
                if n == 0:
                    rgb = (0, 0, 0)
                else:
                    t = torch.log1p(torch.tensor(float(n))).item() / torch.log1p(torch.tensor(float(peak))).item()
                    rgb = (int(255 * t), int(200 * t + 40), int(255 * (1 - t)))
                line += bytes(rgb) * cell
            pixels += [bytes(line)] * cell
        _write_png(Path(path), width=len(rows[0]) * cell, height=len(pixels), rows=pixels)


def _layer_order(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def _write_png(path: Path, width: int, height: int, rows: list[bytes]) -> None:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\x00" + r for r in rows)  # filter type 0 per scanline
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    path.write_bytes(png)


@contextlib.contextmanager
def record_expert_coverage(model: torch.nn.Module, router_glob: str, num_experts: int,
                           router_output: RouterOutput | None = None):
    """Count routed tokens while the body runs forwards; sums over ranks on exit.

    Args:
        router_glob: fnmatch glob of the router modules' names.
        num_experts: experts per MoE layer (global).
        router_output: what the routers return (the family's `FamilySpec.router_output`; default (ids, weights)).
    """
    items = RouterOutput() if router_output is None else router_output
    coverage = Coverage(num_experts)

    def hook(mod, inputs, output, name):
        ids = items.ids(output, name)
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"router {name}: the expert ids read from its output (item {items.items.index('ids')} of "
                            f"{items.items}) are not an integer tensor (got {getattr(ids, 'dtype', type(ids).__name__)}"
                            "); give the family's `router_output`")
        coverage.add(name, ids.detach())

    handles = []
    for name, module in model.named_modules():
        if fnmatch.fnmatchcase(name, router_glob):
            handles.append(module.register_forward_hook(
                lambda mod, inputs, output, name=name: hook(mod, inputs, output, name)))
    if not handles:
        raise ValueError(f"no module of the model matches the router glob {router_glob!r}")
    try:
        yield coverage
    finally:
        for h in handles:
            h.remove()
    coverage.all_reduce()

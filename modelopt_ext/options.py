"""How the fused experts and their expert-parallel exchange run: one frozen record, not module globals.

`ExpertsOptions` holds every choice between equivalent ways of computing the routed experts (same results
within each path's documented tolerance, different speed): whether the EP exchange is pipelined, in how many
chunks, over which link, whether the local experts run as one GEMM per segment, how the activation runs on
CUDA, whether calibration shows each quantizer all rows at once. The defaults are the measured winners
(docs/performance.md); the others stay as named, tested options for A/B runs.

Where it lives: `modelopt_ext.from_pretrained(..., experts_options=...)` (and `ptq --experts-option K=V`) sets it
on every fused experts module of the loaded model (`set_experts_options`), and under EP the distribution plan
carries it, so the ranks agree on it before loading (the exchange's chunks and link must match on every rank).
The EP backend reads it from the experts module it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

TRANSPORTS = ("auto", "nccl", "copy_engine")
GROUPED_STATISTICS_MODES = ("cuda", "always", "never")
GLU_FORMS = ("triton", "triton-libdevice", "triton-approx", "compile", "eager")


@dataclasses.dataclass(frozen=True)
class ExpertsOptions:
    """Args (the measurements behind each default: docs/performance.md):
        pipeline: EP calls overlap the exchange with the local experts (`ep.overlap`) where the experts offer
            a row function; False: dispatch -> the experts' class forward -> combine (the A/B baseline).
        chunks: chunks of a rank's tokens in the overlapped exchange (1: exchange all, compute, return).
        transport: "nccl" (all_to_all_single), "copy_engine" (copy engines into peer-mapped memory; CUDA ranks of
            one host) or "auto" (the copy engines when every rank runs on this host, NCCL otherwise).
        token_dispatch: through NCCL, send each token once per destination rank and rebuild its slot rows on
            the receiver (`ep.token_link`) instead of one row per slot.
        row_tile: rows per tile on the segment path (0: whole segments).
        segment_min_rows: on CUDA, segments run as one GEMM each when they average at least this many rows;
            smaller ones are regrouped expert-major for one grouped GEMM per projection.
        grouped_statistics: during max calibration run the experts as grouped GEMMs with each projection's
            input quantizer shown all rows at once: "cuda" (on CUDA tensors), "always", "never".
        fast_on_cuda: plain bf16 inference on CUDA runs sync-free grouped GEMMs instead of the eager loop.
        glu_on_cuda: the activation's form on CUDA: "triton" (the kernel's exp2 form), "triton-libdevice",
            "triton-approx", "compile" (torch.compile of the fp32 reference) or "eager" (the reference).
    """

    pipeline: bool = True
    chunks: int = 2
    transport: str = "nccl"
    token_dispatch: bool = False
    row_tile: int = 0
    segment_min_rows: int = 4096
    grouped_statistics: str = "cuda"
    fast_on_cuda: bool = True
    glu_on_cuda: str = "triton"

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value, kind = getattr(self, field.name), type(field.default)
            if type(value) is not kind:
                raise ValueError(f"experts option {field.name}={value!r}: expected {kind.__name__}")
        for name, value, allowed in (("transport", self.transport, TRANSPORTS),
                                     ("grouped_statistics", self.grouped_statistics, GROUPED_STATISTICS_MODES),
                                     ("glu_on_cuda", self.glu_on_cuda, GLU_FORMS)):
            if value not in allowed:
                raise ValueError(f"experts option {name}={value!r}: expected one of {', '.join(allowed)}")
        if self.chunks < 1:
            raise ValueError(f"experts option chunks={self.chunks}: expected at least 1")
        if self.row_tile < 0 or self.segment_min_rows < 0:
            raise ValueError(f"experts options row_tile={self.row_tile}, segment_min_rows={self.segment_min_rows}: "
                             "expected >= 0")

    def replace(self, **changes: Any) -> ExpertsOptions:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExpertsOptions:
        return cls(**d)

    @classmethod
    def parse(cls, items: Iterable[str]) -> ExpertsOptions:
        """From `NAME=VALUE` strings (`--experts-option`); booleans as true/false, integers in decimal."""
        fields = {f.name: type(f.default) for f in dataclasses.fields(cls)}
        changes: dict[str, Any] = {}
        for item in items:
            name, sep, text = item.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in fields:
                raise ValueError(f"experts option {item!r}: expected NAME=VALUE with NAME one of {', '.join(fields)}")
            kind, text = fields[name], text.strip()
            if kind is bool:
                if text.lower() not in ("true", "false"):
                    raise ValueError(f"experts option {item!r}: expected true or false")
                changes[name] = text.lower() == "true"
            elif kind is int:
                try:
                    changes[name] = int(text)
                except ValueError:
                    raise ValueError(f"experts option {item!r}: expected an integer") from None
            else:
                changes[name] = text
        return cls(**changes)


DEFAULT = ExpertsOptions()


def set_experts_options(model: Any, options: ExpertsOptions) -> int:
    """Give every fused experts module of `model` (a torch module; those whose class declares `options:
    ExpertsOptions`) these options; returns how many modules took them. (No torch import here: `plan` stays
    pure.)"""
    if not isinstance(options, ExpertsOptions):
        raise TypeError(f"experts_options must be an ExpertsOptions, got {type(options).__name__}")
    found = 0
    for module in model.modules():
        if isinstance(getattr(type(module), "options", None), ExpertsOptions):
            module.options = options
            found += 1
    return found


def options_of(module: Any) -> ExpertsOptions:
    """The options a module runs with (the defaults for a module that declares none)."""
    options = getattr(module, "options", None)
    return options if isinstance(options, ExpertsOptions) else DEFAULT

"""Predicted time and memory of a `ptq` job at scale, from a distribution plan and a one-GPU measurement (pure).

`modelopt-ext plan --predict` prints it (docs/scaling.md). The measurement is the JSON of
`scripts/bench_rank_share.py`: one H200 running one rank's share of the job (sections "layers", "calibrate",
"memory", "export", "disk"; a section that failed holds {"error": ...} and the lines that need it are reported
unavailable). Every line names the measurement keys it uses. Nothing here imports torch.

Symbols: W world size (= EP degree `ep` here: `ptq` refuses EP < W), g GPUs per node, C calibration tokens
over all ranks, T = C / W tokens per rank (every rank calibrates its own distinct blocks), k top-k, L the
routed experts' latent width, M MoE layers; B_ib the per-GPU inter-node bandwidth, B_nv NVLink's; GB = 1e9 B.

- load = plan.estimate.read_bytes / disk.load_bytes_per_s. The rank's read bytes (its experts as stored +
  the dense part as the plan places it) over the measured shard-on-read rate of `from_pretrained`. Assumes
  every node's storage gives each GPU the measured rate (node-local copies or a file system that scales with
  the nodes); a shared file system slower in aggregate makes the load longer.
- calibration = compute + all_to_all + fixed, where
  - compute = T x sum over measured kinds (count of the kind in the config, `FamilySpec.prediction.layer_kinds`)
    x layers[kind].s_per_token. The measured s_per_token is one rank's share at balanced routing: its own T
    tokens through the dense parts and T x k received rows through its local experts, so it does not depend
    on the EP degree (the rows per rank do not). Not captured: at a lower degree the rows spread over more
    local experts (smaller GEMMs) and each forward dequantizes more stored experts.
  - all_to_all = M x max(V x f_ib / B_ib, V x f_nv / B_nv), with V = T x 2 x k x L x 2 B (dispatch sends
    k bf16 latent rows per token, combine sends as many back), f_ib = (ep - g) / ep the share of
    destinations on other nodes (0 when ep <= g) and f_nv = (min(ep, g) - 1) / ep the share on the other
    GPUs of the node. NCCL's all-to-all posts every peer at once, so the NVLink and network parts run at the
    same time and the slower one bounds a layer (max, not sum). The exchange is added to the compute, not
    overlapped with it: `ep/overlap.py` overlaps it with the experts on one host, but across nodes the
    prediction assumes no overlap (conservative).
  - fixed = (convert + finish + sync + coverage) x N / n + first-call excess, from calibrate.parts_s: the
    per-module parts (quantizer insertion with the weight statistics of every weight quantizer; the collected
    statistics loaded as amax; the amax sync; the expert coverage check) scaled with the decoder layers, N the
    real model's (sum of widths.real_layer_counts) over the n measured (len(widths.layers)). An
    approximation: the quantizers per layer differ by kind (the measurement has one layer of each), and the
    measured rank holds widths.local_experts experts, the per-rank count at the measured EP degree (at another
    degree the expert quantizers per rank differ, not scaled). First-call excess = max(0, first_batch -
    forward / (calibrate.batches - 1)): the first batch minus a steady one (whose time the compute already
    counts), added once and not scaled; on GPUs ptq's warm-up during the load pays most of it, so it is an
    upper bound there. Every rank pays the fixed cost in parallel. Without parts_s or widths (or with
    batches < 2): calibrate.fixed_s added once, unscaled (a lower bound for the full model), and the line's
    source says so.
- export = max over ranks of the rank's export bytes / export.bytes_per_s_with_flush (the export followed by
  flushing its files to disk; export.bytes_per_s, without the flush, where that is not measured: the page cache
  cannot absorb the ~240 GB a node writes at EP64). A rank writes its experts, NVFP4:
  experts_per_rank x M x 3 projections x (in x out x (1/2 + 1/16) bytes: packed E2M1 and one E4M3 scale per
  16, + 2 fp32 scalars: weight_scale_2, input_scale), i.e. the expert parameters / ep x 9/16 + scalars; and
  the dense files `export/files.py` gives it (round robin: layer i's on rank (i + 1) mod W, everything outside
  the layers on rank 0) at the recipe's formats (`FamilySpec.prediction.dense_export_bytes`). The ranks write
  in parallel; the slowest (most bytes) ends the phase.
- total = load + calibration + export (validate, the engines' checks and process start-up not counted).
- peak memory per GPU = plan.estimate.total_bytes x memory.peak_bytes / memory.planned_bytes (the measured
  peak over the plan's estimate of the measured run); the plan's estimate alone when that ratio is missing.

Defaults: B_ib = 50 GB/s (400 Gb/s InfiniBand NDR, one NIC per GPU as on DGX/HGX H100 and H200 nodes; line
rate, NCCL reaches less), B_nv = 276 GB/s (NCCL all_to_all_single off-rank at 4,096 tokens per rank, latent
width 3584, top-16, 2 x H200: docs/performance.md, "EP exchange and local experts"), g = 8,
C = 128 x 2048 = 262,144.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

GB = 10**9
DEFAULT_CALIB_TOKENS = 128 * 2048
DEFAULT_INTERCONNECT_GBPS = 50.0  # 400 Gb/s InfiniBand NDR per GPU
DEFAULT_NVLINK_GBPS = 276.0  # docs/performance.md: NCCL all_to_all_single off-rank, 4,096 tokens per rank, 2 x H200
DEFAULT_GPUS_PER_NODE = 8
BF16, FP32 = 2, 4
NVFP4_GROUP = 16
SCALARS_PER_PROJECTION = 2  # NVFP4 weight_scale_2 and input_scale, fp32
EXPERT_PROJECTIONS = 3  # w1, w3, w2


@dataclasses.dataclass(frozen=True)
class Line:
    """One predicted figure: `value` in `unit` ("s" or "bytes"), None when unavailable (`source` says why)."""

    name: str
    value: float | None
    unit: str
    formula: str
    source: str

    @property
    def available(self) -> bool:
        return self.value is not None


@dataclasses.dataclass(frozen=True)
class JobPrediction:
    """A job's predicted phases (seconds) and peak memory per GPU, each with its formula and source."""

    world_size: int
    ep_size: int
    gpus_per_node: int
    calib_tokens: int
    tokens_per_rank: float
    interconnect_gbps: float
    nvlink_gbps: float
    measurement: str  # where the measurement came from, and its machine/date
    load: Line
    calibration_compute: Line
    all_to_all: Line
    calibrate_fixed: Line
    calibration: Line
    export: Line
    total: Line
    peak_memory: Line

    def phases(self) -> tuple[Line, ...]:
        return (self.load, self.calibration_compute, self.all_to_all, self.calibrate_fixed, self.calibration,
                self.export, self.total, self.peak_memory)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def lines(self) -> list[str]:
        nodes = math.ceil(self.world_size / self.gpus_per_node)
        out = [
            f"predicted job: {self.world_size} GPUs ({nodes} node(s) of {self.gpus_per_node}), EP {self.ep_size}, "
            f"{self.calib_tokens} calibration tokens ({self.tokens_per_rank:g} per rank), inter-node "
            f"{self.interconnect_gbps:g} GB/s per GPU, NVLink {self.nvlink_gbps:g} GB/s (gigabytes/s)",
            f"  measurement: {self.measurement}",
        ]
        for line in self.phases():
            if line.value is None:
                value = "unavailable"
            elif line.unit == "bytes":
                value = f"{line.value / 2**30:.1f} GiB"
            else:
                value = f"{line.value:.1f} s"
            indent = "    " if line in (self.calibration_compute, self.all_to_all, self.calibrate_fixed) else "  "
            out.append(f"{indent}{line.name + ':':<22} {value:>12}  = {line.formula}  [{line.source}]")
        return out


class _Missing(Exception):
    """A measurement value that is absent, failed or unusable; the message says which and why."""


def _value(measurement: Mapping[str, Any] | None, *path: str) -> float:
    """measurement[path[0]][path[1]]... as a positive number, or _Missing naming the key and the reason."""
    key = ".".join(path)
    if measurement is None:
        raise _Missing("no measurement")
    node: Any = measurement
    for i, part in enumerate(path):
        if not isinstance(node, Mapping):
            raise _Missing(f"{'.'.join(path[:i])} is not a section")
        if isinstance(node.get("error"), str):
            raise _Missing(f"section {'.'.join(path[:i])} failed: {node['error']}")
        if part not in node:
            raise _Missing(f"measurement lacks {key}")
        node = node[part]
    if isinstance(node, bool) or not isinstance(node, (int, float)) or not math.isfinite(node) or node < 0:
        raise _Missing(f"{key} = {node!r} is not a finite non-negative number")
    return float(node)


def _positive(measurement, *path: str) -> float:
    value = _value(measurement, *path)
    if value <= 0:
        raise _Missing(f"{'.'.join(path)} = {value!r} is not positive")
    return value


def load_measurement(path: str | Path) -> dict[str, Any]:
    """A measurement JSON file, with errors that name the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"measurement {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"measurement {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"measurement {path} must hold a JSON object, got {type(data).__name__}")
    return data


def expert_export_bytes(expert_params: int, num_experts: int, num_moe_layers: int, ep_size: int) -> int:
    """Bytes of one rank's routed experts exported NVFP4 (packed E2M1, E4M3 scale per 16, 2 fp32 scalars a
    projection)."""
    params = expert_params // ep_size
    experts = num_experts // ep_size * num_moe_layers
    return params // 2 + -(-params // NVFP4_GROUP) + experts * EXPERT_PROJECTIONS * SCALARS_PER_PROJECTION * FP32


def dense_export_by_rank(dense: Mapping[str, Any], world_size: int) -> list[int]:
    """Bytes of the dense files each rank writes: everything outside the layers on rank 0, layer i's file on
    rank (i + 1) mod W (`export.files.ExportFiles.dense_writer`)."""
    per_rank = [0] * world_size
    per_rank[0] += int(dense["outside_layers"])
    for i, b in enumerate(dense["layers"]):
        per_rank[(i + 1) % world_size] += int(b)
    return per_rank


FIXED_PER_MODULE_PARTS = ("convert", "finish", "sync", "coverage")


def _calibrate_fixed(measurement) -> Line:
    """The calibrate phase's fixed cost from calibrate.parts_s: the per-module parts x real / measured decoder
    layers + the first call's excess over a steady batch; _Missing when a part or width is absent."""
    per_module = {part: _value(measurement, "calibrate", "parts_s", part) for part in FIXED_PER_MODULE_PARTS}
    first, forward = (_value(measurement, "calibrate", "parts_s", p) for p in ("first_batch", "forward"))
    batches = _value(measurement, "calibrate", "batches")
    if batches < 2 or batches != int(batches):
        raise _Missing(f"calibrate.batches = {batches:g}: needs a whole number >= 2 for a steady batch")
    widths = measurement.get("widths")
    measured = widths.get("layers") if isinstance(widths, Mapping) else None
    if not isinstance(measured, list) or not measured:
        raise _Missing("measurement lacks widths.layers (a non-empty list)")
    counts = widths.get("real_layer_counts")
    if not isinstance(counts, Mapping) or not counts:
        raise _Missing("measurement lacks widths.real_layer_counts")
    real = sum(_value(measurement, "widths", "real_layer_counts", kind) for kind in counts)
    if real <= 0:
        raise _Missing("widths.real_layer_counts sum to 0")
    steady = forward / (batches - 1)
    excess = max(0.0, first - steady)
    value = sum(per_module.values()) * real / len(measured) + excess
    parts = " + ".join(f"{part} {s:.3f}" for part, s in per_module.items())
    formula = (f"({parts} s) x {real:g}/{len(measured)} layers + first-call excess {excess:.2f} s "
               f"(first batch {first:.3f} - forward {forward:.3f} / {batches - 1:g})")
    return Line("calibrate fixed", value, "s", formula,
                "calibrate.parts_s, calibrate.batches, widths.layers, widths.real_layer_counts")


def _gbps(bytes_per_s: float) -> str:
    return f"{bytes_per_s / GB:.3g} GB/s"


def _sum_line(name: str, parts: tuple[Line, ...], formula: str, source: str) -> Line:
    """The sum of `parts` (seconds), or unavailable naming the parts that are."""
    missing = [p.name for p in parts if not p.available]
    if missing:
        return Line(name, None, "s", formula, f"unavailable: {', '.join(missing)}")
    return Line(name, sum(p.value for p in parts), "s", formula, source)


def predict_job(
    config: Mapping[str, Any],
    plan,
    measurement: Mapping[str, Any] | None,
    *,
    calib_tokens: int = DEFAULT_CALIB_TOKENS,
    interconnect_gbps: float = DEFAULT_INTERCONNECT_GBPS,
    nvlink_gbps: float = DEFAULT_NVLINK_GBPS,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    measurement_source: str = "measurement",
    family=None,
    recipe: str | None = None,
) -> JobPrediction:
    """Predict the `ptq` job of `plan` (a `plan.DistributionPlan` of `config`) from a one-GPU `measurement`.

    Args:
        config: the `config.json` mapping the plan was resolved from.
        plan: its DistributionPlan (EP degree must equal the world size).
        measurement: the bench_rank_share JSON, or None when there is none (measured lines unavailable).
        calib_tokens: calibration tokens over all ranks.
        interconnect_gbps / nvlink_gbps: per-GPU inter-node and NVLink bandwidth, in GB/s (1e9 bytes/s).
        gpus_per_node: GPUs a node (NVLink domain).
        measurement_source: where the measurement came from (printed).
        family: FamilySpec (default: the config's); recipe: the export's recipe (default: the family's).
    Raises:
        ValueError naming the offending value (bad arguments, a family without `prediction`).
    """
    from modelopt_ext.families import family_for_config

    if plan.ep_size != plan.world_size:
        raise ValueError(f"the prediction covers EP degree = world size; the plan has EP {plan.ep_size} on "
                         f"{plan.world_size} ranks")
    for name, value in (("calib_tokens", calib_tokens), ("interconnect_gbps", interconnect_gbps),
                        ("nvlink_gbps", nvlink_gbps), ("gpus_per_node", gpus_per_node)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} ({value!r}) must be a positive number")
    family = family_for_config(config) if family is None else family
    if family.prediction is None or family.sizes is None:
        raise ValueError(f"family {family.name!r} does not provide what the prediction needs (prediction, sizes)")
    sizes = family.sizes(config)
    W, ep, g = plan.world_size, plan.ep_size, gpus_per_node
    T = calib_tokens / W
    if measurement is not None:
        where = ", ".join(f"{k} {measurement[k]}" for k in ("machine", "date") if k in measurement)
        measurement_source = f"{measurement_source} ({where})" if where else measurement_source

    def unavailable(name: str, unit: str, formula: str, e: _Missing) -> Line:
        return Line(name, None, unit, formula, f"unavailable: {'no measurement' if measurement is None else e}")

    # load
    read = plan.estimate.read_bytes
    formula = f"{read / GB:.1f} GB read per rank (plan) / disk.load_bytes_per_s"
    try:
        rate = _positive(measurement, "disk", "load_bytes_per_s")
        load = Line("load", read / rate, "s", f"{read / GB:.1f} GB read per rank (plan) / {_gbps(rate)}",
                    "disk.load_bytes_per_s")
    except _Missing as e:
        load = unavailable("load", "s", formula, e)

    # calibration: compute
    kinds = dict(family.prediction.layer_kinds(config))
    kinds_text = " + ".join(f"{n} x {kind}" for kind, n in kinds.items())
    formula = f"{T:g} tokens x ({kinds_text}) s/token"
    try:
        per_token = {kind: _value(measurement, "layers", kind, "s_per_token") for kind in kinds}
        s = sum(n * per_token[kind] for kind, n in kinds.items())
        compute = Line("calibration compute", T * s, "s", f"{T:g} tokens x {s * 1e3:.4g} ms/token ({kinds_text})",
                       "layers.{" + ",".join(kinds) + "}.s_per_token")
    except _Missing as e:
        compute = unavailable("calibration compute", "s", formula, e)

    # calibration: all-to-all (needs no measurement)
    k, L, M = sizes["top_k"], sizes["latent_size"], sizes["num_moe_layers"]
    V = T * 2 * k * L * BF16
    f_ib = (ep - g) / ep if ep > g else 0.0
    f_nv = (min(ep, g) - 1) / ep
    t_ib, t_nv = V * f_ib / (interconnect_gbps * GB), V * f_nv / (nvlink_gbps * GB)
    a2a = Line(
        "all-to-all", M * max(t_ib, t_nv), "s",
        f"{M} MoE layers x max({V / GB:.3g} GB x {f_ib:.3g} / {interconnect_gbps:g} GB/s, "
        f"{V / GB:.3g} GB x {f_nv:.3g} / {nvlink_gbps:g} GB/s)",
        f"config (top_k {k}, latent {L}); --interconnect-gbps, --nvlink-gbps; not overlapped with compute",
    )
    try:
        fixed = _calibrate_fixed(measurement)
    except _Missing as parts_missing:
        try:
            fixed_s = _value(measurement, "calibrate", "fixed_s")
            fixed = Line("calibrate fixed", fixed_s, "s", "measured once per rank, not scaled (lower bound)",
                         f"calibrate.fixed_s, unscaled: {parts_missing}")
        except _Missing as e:
            fixed = unavailable("calibrate fixed", "s", "per-module parts x layers + first-call excess",
                                _Missing(f"{e}; {parts_missing}"))
    calibration = _sum_line("calibration", (compute, a2a, fixed), "compute + all-to-all + fixed",
                            "the three lines above")

    # export
    experts = expert_export_bytes(sizes["expert_params"], sizes["num_experts"], M, ep)
    dense = family.prediction.dense_export_bytes(config, recipe or family.default_recipe)
    by_rank = dense_export_by_rank(dense, W)
    rank = max(range(W), key=lambda r: by_rank[r])
    written = experts + by_rank[rank]
    formula = (f"rank {rank}: {experts / GB:.1f} GB experts NVFP4 + {by_rank[rank] / GB:.2f} GB dense files "
               f"= {written / GB:.1f} GB")
    # the durable rate (the export, then its data flushed to disk) where measured: a node writes ~240 GB at EP64,
    # far beyond what the page cache absorbs, so the disk's rate is what the phase sees
    key = "bytes_per_s_with_flush" if "bytes_per_s_with_flush" in ((measurement or {}).get("export") or {}) else (
        "bytes_per_s")
    try:
        rate = _positive(measurement, "export", key)
        export = Line("export", written / rate, "s", f"{formula} / {_gbps(rate)}", f"export.{key}")
    except _Missing as e:
        export = unavailable("export", "s", f"{formula} / export.{key}", e)

    total = _sum_line("total", (load, calibration, export), "load + calibration + export",
                      "the lines above (validate, engines, start-up not counted)")

    # peak memory
    planned = plan.estimate.total_bytes
    try:
        ratio = _positive(measurement, "memory", "peak_bytes") / _positive(measurement, "memory", "planned_bytes")
        peak = Line("peak memory per GPU", planned * ratio, "bytes",
                    f"{planned / 2**30:.1f} GiB planned x {ratio:.3f} measured/planned",
                    "plan.estimate.total_bytes; memory.peak_bytes / memory.planned_bytes")
    except _Missing as e:
        why = "no measurement" if measurement is None else e
        peak = Line("peak memory per GPU", planned, "bytes", f"{planned / 2**30:.1f} GiB planned",
                    f"plan.estimate.total_bytes only (no measured ratio: {why})")

    return JobPrediction(
        world_size=W, ep_size=ep, gpus_per_node=g, calib_tokens=calib_tokens, tokens_per_rank=T,
        interconnect_gbps=interconnect_gbps, nvlink_gbps=nvlink_gbps, measurement=measurement_source,
        load=load, calibration_compute=compute, all_to_all=a2a, calibrate_fixed=fixed, calibration=calibration,
        export=export, total=total, peak_memory=peak,
    )

"""Profiling calibration batches for developers: `MODELOPT_EXT_PROFILE=DIR` (environment) makes the
calibration loop profile a few batches with `torch.profiler` on every rank and write, per rank,
`DIR/calibrate_rank{R}.txt` (operator tables by device and by host time) and `DIR/calibrate_rank{R}.json`
(wall time per profiled batch, the sum of device kernel time, the stream/event synchronizations the
profiler recorded, which include this profiler's own one per batch boundary).

`MODELOPT_EXT_PROFILE_BATCHES=FIRST:COUNT` picks the batches (default 2:3: two warm-up batches, then three).
`MODELOPT_EXT_PROFILE_STACKS=1` also records Python stacks and lists where host syncs come from
(`SYNC_OPS`: `.item()`/`.tolist()`, `nonzero`, stream synchronizations), by call site.
Profiling slows the profiled batches; tokens/s of a profiled run are not comparable with other runs.

`stream_overlap(trace)` reads a chrome trace (`export_chrome_trace`) and reports, per device, how GPU work of
four classes (NCCL communication, memcpys, GEMMs, other kernels) overlapped and how much communication ran
with no compute beside it.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
ENV_DIR, ENV_BATCHES, ENV_STACKS = "MODELOPT_EXT_PROFILE", "MODELOPT_EXT_PROFILE_BATCHES", "MODELOPT_EXT_PROFILE_STACKS"
SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "cudaStreamSynchronize")


def sync_device() -> None:
    """Wait for this process's CUDA work, when it has any (so host clocks time the device's work too)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _parse_batches(text: str) -> tuple[int, int]:
    try:
        first, count = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"{ENV_BATCHES}={text!r}: expected FIRST:COUNT, two integers (e.g. 2:3)") from None
    if first < 0 or count < 1:
        raise ValueError(f"{ENV_BATCHES}={text!r}: expected FIRST >= 0 and COUNT >= 1")
    return first, count


class BatchProfiler:
    """Profiles batches [first, first + count) of a loop; `batch(i)` wraps batch i, `close()` writes."""

    def __init__(self, out_dir: str | Path, first: int = 2, count: int = 3, rank: int = 0, stacks: bool = False):
        self.out_dir, self.first, self.count, self.rank, self.stacks = Path(out_dir), first, count, rank, stacks
        self.walls_ms: list[float] = []
        self._profile = self._averages = None
        self._sync_sites = ""

    def _sync_table(self) -> str:
        """Host-sync operators by Python call site (the innermost 8 Python frames above each), most frequent
        first. The profiler records Python calls as events; each sync's chain of parents gives its site."""
        sites: dict[tuple[str, tuple[str, ...]], int] = {}
        for event in self._profile.events():
            if event.name not in SYNC_OPS:
                continue
            frames, parent = [], event.cpu_parent
            while parent is not None and len(frames) < 8:
                if ".py(" in parent.name:
                    frames.append(parent.name)
                parent = parent.cpu_parent
            key = (event.name, tuple(frames))
            sites[key] = sites.get(key, 0) + 1
        ranked = sorted(sites.items(), key=lambda kv: -kv[1])[:40]
        return "\n".join(f"{n:6d}  {name}\n" + "\n".join(f"          {frame}" for frame in frames)
                         for (name, frames), n in ranked)

    @classmethod
    def from_env(cls, rank: int = 0) -> BatchProfiler | None:
        out_dir = os.environ.get(ENV_DIR)
        if not out_dir:
            return None
        first, count = _parse_batches(os.environ.get(ENV_BATCHES, "2:3"))
        return cls(out_dir, first, count, rank, stacks=os.environ.get(ENV_STACKS, "") == "1")

    @contextlib.contextmanager
    def batch(self, index: int):
        if not self.first <= index < self.first + self.count:
            yield
            return
        if self._profile is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=self.stacks)
            sync_device()
            self._profile.__enter__()
        sync_device()
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self._stop()  # the batch failed: leave no profiler running; close() still writes what it has
            raise
        sync_device()
        self.walls_ms.append((time.perf_counter() - start) * 1e3)
        if index == self.first + self.count - 1:
            self._stop()

    def _stop(self) -> None:
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self._averages = self._profile.key_averages()
            self._sync_sites = self._sync_table() if self.stacks else ""
            self._profile = None

    def close(self) -> None:
        """Stop profiling (when the loop ended inside the window) and write this rank's files."""
        self._stop()
        averages, self._averages = self._averages, None
        if averages is None:
            return
        # kernels and copies only (operator rows repeat their kernels' time)
        device_us = sum(e.self_device_time_total for e in averages
                        if getattr(e, "device_type", None) not in (None, torch.autograd.DeviceType.CPU))
        syncs = sum(e.count for e in averages if e.key in ("cudaStreamSynchronize", "cudaEventSynchronize"))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"calibrate_rank{self.rank}"
        tables = [f"# batches {self.first}..{self.first + len(self.walls_ms) - 1}: wall ms {self.walls_ms}"]
        for key in ("self_device_time_total", "self_cpu_time_total"):
            tables.append(f"## by {key}\n" + averages.table(sort_by=key, row_limit=45, max_name_column_width=70))
        if self._sync_sites:
            tables.append("## host syncs by call site\n" + self._sync_sites)
        stem.with_suffix(".txt").write_text("\n\n".join(tables) + "\n")
        summary = {"batches": [self.first, self.first + len(self.walls_ms)], "wall_ms": self.walls_ms,
                   "wall_ms_total": sum(self.walls_ms), "device_kernel_ms_total": device_us / 1e3,
                   "host_sync_calls": syncs}
        stem.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
        logger.info("calibration profile of rank %d written to %s.{txt,json}", self.rank, stem)


# --- overlap of GPU work in a chrome trace ----------------------------------------------------------------------------

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
"""Chrome-trace categories (kineto's, lower-case) of work that ran on a GPU; everything else is host side."""
GEMM_PATTERNS = ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "grouped_mm")
"""Lower-case substrings of matrix-product kernel names (cuBLAS/cuBLASLt, CUTLASS, torch's `_grouped_mm`)."""
OVERLAP_CLASSES = ("comm", "copy", "gemm", "other")
OVERLAP_PAIRS = (("comm", "gemm"), ("copy", "gemm"), ("comm", "other"), ("copy", "other"))
TOP_KERNELS = 5

Interval = tuple[float, float]


def _interval_union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time as `intervals` (touching ones are joined)."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _interval_intersection(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two outputs of `_interval_union` (sorted, disjoint), in one linear sweep."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def _classify(category: str, name: str) -> str:
    lower = name.lower()
    if "nccl" in lower:
        return "comm"
    if category == "gpu_memcpy":
        return "copy"
    if any(pattern in lower for pattern in GEMM_PATTERNS):
        return "gemm"
    return "other"


def _load_trace(trace: dict | list | str | os.PathLike) -> list:
    if isinstance(trace, (str, os.PathLike)):
        path = Path(trace)
        with path.open("rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"  # by content: export_chrome_trace gzips paths ending in .gz
        with (gzip.open(path, "rt", encoding="utf-8") if gzipped else path.open(encoding="utf-8")) as f:
            trace = json.load(f)
    if isinstance(trace, dict):
        if "traceEvents" not in trace:
            raise ValueError("not a chrome trace: no 'traceEvents' (expected export_chrome_trace's JSON)")
        return trace["traceEvents"]
    if isinstance(trace, list):  # the JSON-array form of a chrome trace
        return trace
    raise TypeError(f"expected a chrome trace dict or a path to one, got {type(trace).__name__}")


def _device_of(event: dict, args: dict) -> str:
    """Kernels, memsets and copies within a GPU carry args "device"; peer-to-peer copies (Memcpy PtoP) carry
    "fromDevice"/"toDevice" and "inDevice", the device that ran the copy. Kineto's pid is the device too."""
    for key in ("device", "inDevice"):
        if key in args:
            return str(args[key])
    pid = event.get("pid")
    return str(pid) if isinstance(pid, int) else "0"


def _ms(us: float) -> float:
    return round(us / 1e3, 6)  # trace times are microseconds with nanosecond decimals


def stream_overlap(trace: dict | str | os.PathLike, window: tuple[float, float] | None = None) -> dict:
    """How the GPU work in a `torch.profiler` chrome trace (`export_chrome_trace`, .json or .json.gz) overlapped,
    per device, to see how much of an expert-parallel layer's communication hides behind its compute.

    Only GPU events count: complete events ("ph" "X") of a category in `GPU_CATEGORIES`, on the device in
    their args ("device", or a peer copy's "inDevice"; else an integer pid, else 0). Each falls in one class:
    "comm" (name contains "nccl", any case), "copy" (any other "gpu_memcpy": peer-to-peer and device copies,
    host copies too), "gemm" (name contains one of `GEMM_PATTERNS`), "other" (the rest, memsets included).
    `window=(start_us, end_us)`, in the trace's microseconds ("ts"), clips events to it and drops the rest.

    Returns {device (str): summary}, {} when the trace holds no GPU events. A summary holds "start_us" and
    "end_us" (first start, last end) and, in ms: "span_ms" (their distance); "busy_ms" {class, "all"}: time
    at least one event of the class ran, on any stream; "concurrent_ms" {"comm+gemm", "copy+gemm",
    "comm+other", "copy+other"}: time both classes ran at once; "exposed_comm_ms": time comm or copy ran
    while neither gemm nor other did. Also "hidden_comm_fraction" (the rest of comm-or-copy time, as a
    fraction of it; 0.0 without any), "events" {class: count}, "streams" (stream ids, as str) and
    "top_kernels" {class: [{"name", "ms", "count"}], the `TOP_KERNELS` names of most total time}.
    """
    if window is not None and not window[0] < window[1]:
        raise ValueError(f"window {window!r}: expected (start_us, end_us) with start_us < end_us")
    # per device: class -> intervals, class -> name -> [total us, count], streams
    per_device: dict[str, dict] = {}
    for event in _load_trace(trace):
        if not isinstance(event, dict) or event.get("ph") != "X" or event.get("cat") not in GPU_CATEGORIES:
            continue
        start = float(event["ts"])
        end = start + max(float(event.get("dur", 0.0)), 0.0)
        if window is not None:
            clipped = max(start, window[0]), min(end, window[1])
            if clipped[1] < clipped[0] or (clipped[1] == clipped[0] and end > start):
                continue  # outside the window, or only touching it
            start, end = clipped
        args = event.get("args") or {}
        device = per_device.setdefault(_device_of(event, args), {
            "intervals": {c: [] for c in OVERLAP_CLASSES}, "names": {c: {} for c in OVERLAP_CLASSES},
            "streams": set()})
        name = str(event.get("name", ""))
        cls = _classify(event["cat"], name)
        device["intervals"][cls].append((start, end))
        total = device["names"][cls].setdefault(name, [0.0, 0])
        total[0] += end - start
        total[1] += 1
        device["streams"].add(str(args.get("stream", event.get("tid", ""))))

    summaries = {}
    for key in sorted(per_device, key=lambda k: (len(k), k)):  # "2" before "10"
        device = per_device[key]
        unions = {c: _interval_union(device["intervals"][c]) for c in OVERLAP_CLASSES}
        everything = _interval_union([iv for c in OVERLAP_CLASSES for iv in unions[c]])
        communication = _interval_union(unions["comm"] + unions["copy"])
        compute = _interval_union(unions["gemm"] + unions["other"])
        communication_us = _length(communication)
        hidden_us = _length(_interval_intersection(communication, compute))
        start_us, end_us = everything[0][0], everything[-1][1]
        top = {}
        for c in OVERLAP_CLASSES:
            ranked = sorted(device["names"][c].items(), key=lambda kv: (-kv[1][0], kv[0]))[:TOP_KERNELS]
            top[c] = [{"name": n, "ms": _ms(us), "count": count} for n, (us, count) in ranked]
        summaries[key] = {
            "start_us": start_us, "end_us": end_us, "span_ms": _ms(end_us - start_us),
            "busy_ms": {**{c: _ms(_length(unions[c])) for c in OVERLAP_CLASSES}, "all": _ms(_length(everything))},
            "concurrent_ms": {f"{a}+{b}": _ms(_length(_interval_intersection(unions[a], unions[b])))
                              for a, b in OVERLAP_PAIRS},
            "exposed_comm_ms": _ms(max(communication_us - hidden_us, 0.0)),
            "hidden_comm_fraction": round(hidden_us / communication_us, 6) if communication_us else 0.0,
            "events": {c: len(device["intervals"][c]) for c in OVERLAP_CLASSES},
            "streams": sorted(device["streams"], key=lambda s: (len(s), s)),
            "top_kernels": top,
        }
    if not summaries:
        logger.info("stream_overlap: no GPU events (categories %s) in the trace%s", sorted(GPU_CATEGORIES),
                    "" if window is None else f" within {window}")
    return summaries

"""Profiling calibration batches for developers: `MODELOPT_EXT_PROFILE=DIR` (environment) makes the
calibration loop profile a few batches with `torch.profiler` on every rank and write, per rank,
`DIR/calibrate_rank{R}.txt` (operator tables by device and by host time) and `DIR/calibrate_rank{R}.json`
(wall time per profiled batch, the sum of device kernel time, the stream/event synchronizations the
profiler recorded, which include this profiler's own one per batch boundary).

`MODELOPT_EXT_PROFILE_BATCHES=FIRST:COUNT` picks the batches (default 2:3: two warm-up batches, then three).
`MODELOPT_EXT_PROFILE_STACKS=1` also records Python stacks and lists where host syncs come from
(`SYNC_OPS`: `.item()`/`.tolist()`, `nonzero`, stream synchronizations), by call site.
Profiling slows the profiled batches; tokens/s of a profiled run are not comparable with other runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
ENV_DIR, ENV_BATCHES, ENV_STACKS = "MODELOPT_EXT_PROFILE", "MODELOPT_EXT_PROFILE_BATCHES", "MODELOPT_EXT_PROFILE_STACKS"
SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "cudaStreamSynchronize")


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

    def _sync(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

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
            self._sync()
            self._profile.__enter__()
        self._sync()
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self._stop()  # the batch failed: leave no profiler running; close() still writes what it has
            raise
        self._sync()
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

"""Profiling calibration batches for developers: `MODELOPT_EXT_PROFILE=DIR` (environment) makes the
calibration loop profile a few batches with `torch.profiler` on every rank and write, per rank,
`DIR/calibrate_rank{R}.txt` (operator tables by device and by host time) and `DIR/calibrate_rank{R}.json`
(wall time per profiled batch, the sum of device kernel time, the stream/event synchronizations the
profiler recorded, which include this profiler's own one per batch boundary).

`MODELOPT_EXT_PROFILE_BATCHES=FIRST:COUNT` picks the batches (default 2:3: two warm-up batches, then three).
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
ENV_DIR, ENV_BATCHES = "MODELOPT_EXT_PROFILE", "MODELOPT_EXT_PROFILE_BATCHES"


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

    def __init__(self, out_dir: str | Path, first: int = 2, count: int = 3, rank: int = 0):
        self.out_dir, self.first, self.count, self.rank = Path(out_dir), first, count, rank
        self.walls_ms: list[float] = []
        self._profile = None

    @classmethod
    def from_env(cls, rank: int = 0) -> BatchProfiler | None:
        out_dir = os.environ.get(ENV_DIR)
        if not out_dir:
            return None
        first, count = _parse_batches(os.environ.get(ENV_BATCHES, "2:3"))
        return cls(out_dir, first, count, rank)

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
            self._profile = torch.profiler.profile(activities=activities, record_shapes=False)
            self._sync()
            self._profile.__enter__()
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.walls_ms.append((time.perf_counter() - start) * 1e3)

    def close(self) -> None:
        """Stop profiling (when it ran) and write this rank's files."""
        if self._profile is None:
            return
        self._profile.__exit__(None, None, None)
        averages = self._profile.key_averages()
        device_us = sum(getattr(e, "self_device_time_total", 0) for e in averages)
        syncs = sum(e.count for e in averages if e.key in ("cudaStreamSynchronize", "cudaEventSynchronize"))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"calibrate_rank{self.rank}"
        tables = [f"# batches {self.first}..{self.first + len(self.walls_ms) - 1}: wall ms {self.walls_ms}"]
        for key in ("self_device_time_total", "self_cpu_time_total"):
            tables.append(f"## by {key}\n" + averages.table(sort_by=key, row_limit=45, max_name_column_width=70))
        stem.with_suffix(".txt").write_text("\n\n".join(tables) + "\n")
        summary = {"batches": [self.first, self.first + len(self.walls_ms)], "wall_ms": self.walls_ms,
                   "wall_ms_total": sum(self.walls_ms), "device_kernel_ms_total": device_us / 1e3,
                   "host_sync_calls": syncs}
        stem.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
        logger.info("calibration profile of rank %d written to %s.{txt,json}", self.rank, stem)
        self._profile = None

"""Progress reporting: a tqdm bar on stderr that library progress hooks drive, and the resource figures
(peak memory, byte counts) that run summaries show.

    with ProgressBar("calibrate", total=len(batches), enabled=rank == 0) as bar:
        calibrate(..., progress=bar)            # bar(done)
        export_checkpoint(..., progress=bar)    # bar(done, total)

Disabled bars (other ranks, `--no-progress`) create no tqdm object and write nothing.
"""

from __future__ import annotations

import sys

import torch


class ProgressBar:
    """Callable `bar(done, total=None)`: moves the bar to `done` items (absolute, not an increment) and
    adopts `total` when the caller learns it late (e.g. the exporter's unit count)."""

    def __init__(self, desc: str, total: int | None = None, *, enabled: bool = True, unit: str = "it"):
        self.desc, self.unit, self.enabled = desc, unit, enabled
        self.done = 0
        self.total = total
        self._bar = None
        if total is not None:
            self._open()

    def _open(self) -> None:
        if self.enabled and self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.desc, unit=self.unit, file=sys.stderr, dynamic_ncols=True)

    def __call__(self, done: int, total: int | None = None) -> None:
        if total is not None and total != self.total:
            self.total = total
            if self._bar is not None:
                self._bar.total = total
                self._bar.refresh()
        self._open()  # a bar without a total starts at the first call, when the caller knows it
        if self._bar is not None and done != self.done:
            self._bar.update(done - self.done)
        self.done = done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def format_bytes(n: int) -> str:
    """1536 -> "1.5 KiB"; 512 -> "512 B"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def peak_host_bytes() -> int:
    """This process's peak resident set size in bytes (ru_maxrss: KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_device_bytes() -> int | None:
    """torch.cuda.max_memory_allocated() of the current device, plus the peer-mapped buffer of the copy-engine
    exchange on it (allocated outside PyTorch's allocator, so not in its statistics); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    from modelopt_ext.ep.copy_engine import peer_mapped_bytes

    return int(torch.cuda.max_memory_allocated()) + peer_mapped_bytes(torch.cuda.current_device())

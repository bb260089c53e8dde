"""First-call costs paid while the checkpoint loads: one forward of a small model of the same classes, on a thread.

A process's first forward on a GPU pays costs that later forwards do not: Triton's runtime and each kernel's
first launch, the lazy loading of CUDA kernel modules, cuBLAS's handle. Measured on one H200 with the
mid-size stand-in (docs/performance.md, session 8) they were about 1.0 s of the calibrate phase, which
otherwise holds ~60 ms forwards. A family builds a model of its own (patched) classes with its widths but few
layers and experts (`models/kimi_k3/warmup.py`); `Warmup` runs one forward of it on a thread while the main
thread reads the checkpoint, so those costs overlap the load instead of following it.

    warm = Warmup(model, input_ids).start()
    ...                        # load
    seconds = warm.wait(timeout_s)

The warm-up is an optimisation only: its failure (out of memory, a kernel error) is logged as a warning and
the load goes on; `wait` is bounded and a thread still running after it is left behind as a daemon.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

logger = logging.getLogger(__name__)


class Warmup:
    """One no-grad forward of `model` on `input_ids` (same device) on a daemon thread; see the module doc."""

    def __init__(self, model: torch.nn.Module, input_ids: torch.Tensor):
        self.model, self.input_ids = model, input_ids
        self.seconds: float | None = None  # the forward's wall clock, once it finished without error
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="modelopt-ext-warmup", daemon=True)

    def start(self) -> Warmup:
        self._thread.start()
        return self

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            device = self.input_ids.device
            if device.type == "cuda":  # the current device is per thread: a new thread starts on device 0
                torch.cuda.set_device(device)
            with torch.no_grad():
                self.model(input_ids=self.input_ids, use_cache=False)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            self.seconds = round(time.perf_counter() - started, 3)
        except Exception as e:  # noqa: BLE001 - an optimisation: report, never fail the load
            self.error = e
        finally:
            self.model = self.input_ids = None  # its memory goes back to the caching allocator once it ends

    def wait(self, timeout_s: float) -> float | None:
        """Join the thread for up to `timeout_s`; the forward's seconds, or None (logged) when it failed or
        is still running."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("warm-up forward still running after %.0f s; going on without waiting", timeout_s)
            return None
        if self.error is not None:
            logger.warning("warm-up forward failed (the run goes on; first-call costs fall in calibration): %s: %s",
                           type(self.error).__name__, self.error)
            return None
        logger.info("warm-up forward took %.2f s (during the load)", self.seconds)
        return self.seconds

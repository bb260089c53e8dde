"""Process-group helpers: bounded initialisation, agreement between ranks, failing together.

Every collective here is bounded by the process group's timeout (set at initialisation), so a rank that
died or stalls makes the others fail after at most that long instead of hanging.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_TIMEOUT_S = 600.0


class RankFailure(RuntimeError):
    """Raised on every rank when any rank failed a step."""


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the process group torchrun describes (gloo on CPU, NCCL on GPUs); returns (rank, world size)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(f"expert parallelism needs torchrun (or its environment): {missing} are not set")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    logger.info("joined %s process group: rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
    return dist.get_rank(), dist.get_world_size()


def all_or_fail(step: str, fn: Callable[[], T]) -> T:
    """Run `fn` on every rank; if any rank raises, every rank raises RankFailure naming the failed ranks,
    the step and their errors (the failing rank chains its own exception)."""
    result, error, exc = None, None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - every error must reach the other ranks
        error, exc = f"{type(e).__name__}: {e}", e
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    if failed:
        first = min(failed)
        message = f"{len(failed)} rank(s) failed during {step}; rank {first}: {failed[first]}"
        if len(failed) > 1:
            message += f" (also ranks {sorted(failed)[1:]})"
        raise RankFailure(message) from exc
    return result


def agree(what: str, value: Any) -> None:
    """Check that every rank computed the same `value` (e.g. a plan) before acting on it."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    differing = [r for r, v in enumerate(values) if v != values[0]]
    if differing:
        raise RankFailure(f"ranks disagree on {what}: rank 0 has {values[0]!r}, rank {differing[0]} has "
                          f"{values[differing[0]]!r} (differing ranks: {differing})")

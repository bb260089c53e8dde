"""Process-group helpers: bounded initialisation, agreement between ranks, failing together.

Every collective here is bounded by the process group's timeout (set at initialisation), so a rank that
died or stalls makes the others fail after at most that long instead of hanging.

Each rank also records where it is and whether it failed in the process group's key-value store
(`modelopt_ext.faults`), so that when a collective fails because a rank died, failed elsewhere or stalls,
the survivors' message names that rank and what it was doing, not only that a connection closed.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from modelopt_ext.faults import mark, positions, record_failure

logger = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_TIMEOUT_S = 600.0
_joined = {"group": False}  # whether this process ever joined a process group through init_distributed


class RankFailure(RuntimeError):
    """Raised on every rank when any rank failed a step. `lost_contact`: raised because the group itself failed
    (a peer died, closed or timed out), so no rank can agree on anything more."""

    def __init__(self, message: str, lost_contact: bool = False):
        super().__init__(message)
        self.lost_contact = lost_contact


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
    _joined["group"] = True
    logger.info("joined %s process group: rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
    return dist.get_rank(), dist.get_world_size()


def leave_process_group() -> None:
    """Destroy the process group and let its threads go. `destroy_process_group` leaves each group's gloo
    threads running while anything refers to the group: the device meshes do, and torch's DTensor
    sharding-propagation cache keeps the meshes (and so every EP group) for the life of the process. The cache
    is cleared (best effort: a private torch helper), then a collection frees the meshes and joins the
    threads here rather than at interpreter exit (see `end_process`)."""
    dist.destroy_process_group()
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # another torch: its cache keeps the groups until the process ends
        logger.debug("torch has no DTensor sharding-cache helper; process-group threads stay until exit")
    else:
        _clear_sharding_prop_cache()
    gc.collect()


def end_process(status: int, *, joined: bool = False) -> int:
    """End a command-line process that joined a process group without interpreter finalization.

    `destroy_process_group` does not stop gloo's worker threads while anything still refers to the groups
    (a device mesh, torch's DTensor sharding cache; `leave_process_group` clears what it knows of). Such
    threads are torn down at interpreter finalization, where Python 3.11 ends a thread that takes the GIL
    with a forced unwind; through a C++ `noexcept` frame that aborts the process ("terminate called without
    an active exception", SIGABRT) after every file was written, and torchrun reports the run as failed
    (seen once in CI; docs/reliability.md). So once the command has finished (the group destroyed, the
    export renamed into place), this flushes the logs and standard streams and leaves with `os._exit`,
    running no atexit handler. Returns `status` when the process never joined a group: through
    `init_distributed`, or as its caller says (`joined`: a script that called `init_process_group` itself).
    """
    if not (joined or _joined["group"] or dist.is_initialized()):
        return status
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said on it
            pass
    os._exit(status)


def _is_comm_error(e: BaseException) -> bool:
    """A failure of the process group itself (a peer died, closed or timed out), not of the step's code."""
    return isinstance(e, (dist.DistError, TimeoutError)) or any(
        s in str(e) for s in ("Connection closed by peer", "Connection reset", "Timed out", "timed out"))


def all_or_fail(step: str, fn: Callable[[], T]) -> T:
    """Run `fn` on every rank; if any rank raises, every rank raises RankFailure naming the failed ranks,
    the step and their errors (the failing rank chains its own exception). If a rank died or stalls, the
    survivors raise RankFailure with every rank's last position (see the module doc) within the group's
    timeout. Without a process group it just runs `fn` (one process)."""
    if not in_group():
        return fn()
    mark(step)
    result, error, exc = None, None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - every error must reach the other ranks
        error, exc = f"{type(e).__name__}: {e}", e
        if isinstance(e, RankFailure) and e.lost_contact:  # a nested step lost the group: it already said so
            raise
        if _is_comm_error(e):  # a consequence of another rank's fault, not a failure of this rank's step
            message = f"lost contact with other ranks during {step} ({error}); positions: {positions()}"
            record_failure(step, f"lost contact with other ranks ({error})")  # stops a stalled peer's watch
            raise RankFailure(message, lost_contact=True) from e
        record_failure(step, error)
    errors: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(errors, error)
    except Exception as e:  # noqa: BLE001
        message = f"lost contact with other ranks after {step} ({type(e).__name__}: {e}); positions: {positions()}"
        if error is None:
            record_failure(step, f"lost contact with other ranks ({type(e).__name__}: {e})")
        raise RankFailure(message, lost_contact=True) from (exc or e)
    except BaseException as e:
        # a signal (SIGTERM's `Interrupted`) while the ranks agree on this step: outside the `except` above,
        # Python would not chain this rank's own failure, and the error line would lose it (seen in CI: a rank
        # said "nothing was exported" for an export it was discarding)
        if exc is not None and e.__context__ is None:
            e.__context__ = exc
        raise
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    if failed:
        first = min(failed)
        message = f"{len(failed)} rank(s) failed during {step}; rank {first}: {failed[first]}"
        if len(failed) > 1:
            message += f" (also ranks {sorted(failed)[1:]})"
        raise RankFailure(message) from exc
    return result


def in_group() -> bool:
    """Whether this process is in an initialised process group."""
    return dist.is_available() and dist.is_initialized()


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (collective); `[value]` without a process group."""
    if not in_group():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def agree(what: str, value: Any) -> None:
    """Check that every rank computed the same `value` (e.g. a plan) before acting on it (collective;
    nothing to check without a process group)."""
    values = gather_objects(value)
    differing = [r for r, v in enumerate(values) if v != values[0]]
    if differing:
        a, b = values[0], values[differing[0]]
        if isinstance(a, dict) and isinstance(b, dict):  # name only the entries that differ
            keys = sorted({k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}, key=str)
            a, b = {k: a.get(k) for k in keys}, {k: b.get(k) for k in keys}
        raise RankFailure(f"ranks disagree on {what}: rank 0 has {a!r}, rank {differing[0]} has {b!r} "
                          f"(differing ranks: {differing})")


def agree_files(what: str, files: Mapping[str, str]) -> None:
    """Check that every rank sees the same files (`files`: name -> fingerprint, e.g. size and header hash);
    otherwise raise RankFailure on every rank naming the ranks, their hosts and the first differing file
    (collective; nothing to check without a process group)."""
    values = gather_objects((socket.gethostname(), dict(files)))
    host0, reference = values[0]
    differing = [r for r, (_, mine) in enumerate(values) if mine != reference]
    if not differing:
        return
    r = differing[0]
    host, mine = values[r]
    names = [n for n in sorted(reference.keys() | mine.keys()) if reference.get(n) != mine.get(n)]
    first = names[0]
    hosts = sorted({values[d][0] for d in differing})
    raise RankFailure(
        f"ranks read different {what}: rank {r} (host {host}) differs from rank 0 (host {host0}) in "
        f"{len(names)} file(s), first {first}: rank 0 has {reference.get(first, 'no such file')}, rank {r} has "
        f"{mine.get(first, 'no such file')} (differing ranks {differing}, hosts {hosts}); every node must read the "
        "same copy")

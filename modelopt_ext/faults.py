"""Knowing which rank failed, and where, when the process group itself is what broke.

Every rank records in the process group's key-value store (torchrun's, or rank 0's) where it is (`mark`:
a step such as "calibrate batch 3/8", with time, host and pid) and, when a step raised on it, that failure
(`record_failure`). The store outlives a dead rank, so survivors can say who fell behind (`positions`).

A rank that raised goes on to `all_or_fail`'s agreement collective; ranks blocked in a different
collective (an expert all-to-all of the next batch, say) would only notice at the group's timeout.
`FailureWatch` (a daemon thread polling the store once a second) stops such a rank soon after another
rank recorded a failure: it waits a grace period for the orderly path, then logs the failed rank, its step
and error, and this rank's own position, and exits with status 1.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

logger = logging.getLogger(__name__)
_POSITION = "modelopt_ext/position/"
_FAILED = "modelopt_ext/failed/"
_FAILED_COUNT = "modelopt_ext/failed_count"  # one counter, so the watch polls one key, not one per rank
EXIT_STATUS = 1


def _store():
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - positions are best effort
        return None


def _set(key: str, value) -> None:
    store = _store()
    if store is None:
        return
    try:
        store.set(key, json.dumps(value))
    except Exception:  # noqa: BLE001 - the store may be gone with its host; the caller is failing already
        pass


def _get(store, key: str):
    return json.loads(store.get(key)) if store.check([key]) else None


# Ranks run the same steps in the same order, so the number of marks so far (`seq`) says how far each got.
_state = {"where": "start", "exchanges": 0, "seq": 0}


def _record(where: str) -> None:
    _state["seq"] += 1
    if dist.is_available() and dist.is_initialized():
        _set(f"{_POSITION}{dist.get_rank()}",
             [where, time.time(), socket.gethostname(), os.getpid(), _state["seq"]])


def mark(where: str) -> None:
    """Record that this rank is at `where` now (one store write; no collective)."""
    _state["where"] = where
    _record(where)


def mark_exchange() -> None:
    """Record that this rank enters its next expert exchange (called before each EP all-to-all), so a rank
    blocked in an exchange reads as ahead of one that stalled before reaching it."""
    _state["exchanges"] += 1
    _record(f"{_state['where']}, expert exchange {_state['exchanges']}")


def record_failure(step: str, error: str) -> None:
    """Record that `step` raised `error` on this rank."""
    if dist.is_available() and dist.is_initialized():
        _set(f"{_FAILED}{dist.get_rank()}", [step, error[:500], time.time()])
        store = _store()
        try:
            store.add(_FAILED_COUNT, 1)
        except Exception:  # noqa: BLE001 - see _set
            pass


def failures() -> dict[int, tuple[str, str]]:
    """Rank -> (step, error) of every rank that recorded a failure."""
    store, out = _store(), {}
    if store is None:
        return out
    for r in range(dist.get_world_size()):
        try:
            value = _get(store, f"{_FAILED}{r}")
        except Exception:  # noqa: BLE001
            return out
        if value is not None:
            out[r] = (value[0], value[1])
    return out


def positions() -> str:
    """Ranks that recorded a failure, then every rank's last position, the least advanced first (a rank that
    died or stalls is behind the ones waiting for it)."""
    store = _store()
    if store is None:
        return "unknown (no process group store)"
    now, rows = time.time(), []
    for r in range(dist.get_world_size()):
        try:
            value = _get(store, f"{_POSITION}{r}")
        except Exception:  # noqa: BLE001 - the store may have died with its host rank
            return "unknown (the store is unreachable: rank 0 or the launcher is gone)"
        if value is None:
            rows.append((0, r, "never reported"))
        else:
            where, t, host, pid, seq = value
            rows.append((seq, r, f"at {where!r} {now - t:.0f} s ago (host {host}, pid {pid})"))
    failed = "".join(f"rank {r} FAILED during {step}: {error}; " for r, (step, error) in sorted(failures().items()))
    return failed + "; ".join(f"rank {r} {text}" for _, r, text in sorted(rows))


class FailureWatch:
    """While active, stop this rank `grace_s` after another rank recorded a failure, or once the store has been
    unreachable for `STORE_LOST_POLLS` polls in a row (see the module doc)."""

    STORE_LOST_POLLS = 5

    def __init__(self, grace_s: float = 15.0, poll_s: float = 1.0, on_stop: Callable[[str], None] | None = None):
        """`on_stop(message)` is called just before the process exits (e.g. to print the command's error line)."""
        self.grace_s, self.poll_s, self.on_stop = grace_s, poll_s, on_stop
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self):
        if _store() is not None:
            self._thread = threading.Thread(target=self._run, name="modelopt_ext-failure-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s * 2)
        return False

    def _run(self) -> None:
        me, store, unreachable = dist.get_rank(), _store(), 0
        while not self._stop.wait(self.poll_s):
            try:
                count = store.add(_FAILED_COUNT, 0)
                unreachable = 0
            except Exception as e:  # noqa: BLE001 - its host (rank 0's node, its launcher) is gone
                unreachable += 1
                if unreachable >= self.STORE_LOST_POLLS:  # a rank stalled outside collectives would never notice
                    self._stop_process(me, f"the process group's store has been unreachable for {unreachable} "
                                           f"polls ({type(e).__name__}: {e}): rank 0's node or its launcher is "
                                           f"gone; rank {me} stops")
                continue
            if count == 0:
                continue
            others = {r: f for r, f in failures().items() if r != me}
            if not others:
                continue
            if self._stop.wait(self.grace_s):
                return  # the orderly path finished (or this rank is failing itself)
            first = min(others)
            step, error = others[first]
            self._stop_process(me, f"rank {first} failed during {step} ({error}); rank {me} did not reach the "
                                   f"agreement within {self.grace_s:.0f} s and stops. Positions: {positions()}")

    def _stop_process(self, me: int, message: str) -> None:
        logger.critical("rank %d: stopping: %s", me, message)
        if self.on_stop is not None:
            try:
                self.on_stop(message)
            except Exception:  # noqa: BLE001 - the exit below must happen
                logger.debug("on_stop failed", exc_info=True)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_STATUS)

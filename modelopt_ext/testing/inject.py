"""`python -m modelopt_ext.testing.inject KIND PHASE RANK -- modelopt-ext arguments`: run the CLI with one
fault injected on one rank, for the fault tests (tests/test_faults.py).

KIND: raise (an exception in the step's own code), kill (SIGKILL: the process vanishes), stall (sleeps
far beyond every timeout), abort (SIGABRT). PHASE: load (while reading the checkpoint), calibrate (before
batch 2), export (at the third unit, decoder layer 1), exit (at interpreter finalization, after the command
finished: an atexit handler, standing for gloo's worker threads that can abort a finalizing interpreter;
see `modelopt_ext.dist.end_process`).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time


def _fault(kind: str, phase: str) -> None:
    if kind == "raise":
        raise RuntimeError(f"injected failure during {phase}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "stall":
        time.sleep(3600)
    if kind == "abort":
        os.abort()
    raise ValueError(f"unknown fault kind {kind!r}")


def install(kind: str, phase: str) -> None:
    if phase == "load":
        import modelopt_ext.loader as loader

        def load(*args, **kwargs):  # the generic loader, inside the load's collective step (`loading`)
            _fault(kind, phase)

        loader.load = load
    elif phase == "calibrate":
        import modelopt_ext.quant.calibrate as calibrate

        original = calibrate.mark

        def mark(where: str) -> None:
            original(where)
            if where.startswith("calibrate batch 2/"):
                _fault(kind, phase)

        calibrate.mark = mark
    elif phase == "exit":
        atexit.register(_fault, kind, phase)
    elif phase == "export":
        import modelopt_ext.export.writer as writer

        original, calls = writer.materialize, []

        def materialize(modules):
            calls.append(1)
            if len(calls) == 3:
                _fault(kind, phase)
            return original(modules)

        writer.materialize = materialize
    else:
        raise ValueError(f"unknown phase {phase!r}")


def main(argv: list[str]) -> None:
    """Install the fault on its rank, then run the CLI the way `python -m modelopt_ext` does."""
    kind, phase, rank, sep, *rest = argv
    if sep != "--":
        raise SystemExit("usage: inject KIND PHASE RANK -- ARGS")
    if os.environ.get("RANK") == rank:
        install(kind, phase)
    from modelopt_ext.cli import run

    run(rest)


if __name__ == "__main__":
    main(sys.argv[1:])

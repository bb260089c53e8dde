"""Fault injection on real gloo ranks under torchrun: a rank raises (load, calibration, export), is killed
with SIGKILL, or stalls. Every rank exits non-zero within a bound, the output names the failed rank and the
phase, no export (nor a staging directory) is left, and the same command then succeeds.

The failure tests run one torchrun agent per rank (`testing.nodes`, `--nnodes 2`), so each rank's exit status
and output are its own: a rank that hung until the bound, or that exited without the phase's error, fails the
test (one torchrun for both ranks stops the second once the first exits, hiding how it would have ended)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from modelopt_ext.testing.checkpoints import copy_checkpoint
from modelopt_ext.testing.nodes import launch_nodes, node_env

FAST = "--experts-implementation batched_mm --dtype float32 --calib-size 8 --batch-size 2 --seq-len 16".split()
TIMEOUT_S = 20  # --timeout: the bound on every collective wait
BOUND_S = 150  # start-up, load and calibration of both ranks plus the timeout, on a loaded 2-core machine


@pytest.fixture(scope="module")
def model(tiny_ckpt, tmp_path_factory) -> Path:
    return copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("faults"), "faults_src")


def _run(tmp_path: Path, model: Path, fault: tuple[str, str, str] | None):
    env = node_env(tmp_path)  # this checkout first on PYTHONPATH, offline, no torchrun variables
    argv = ["ptq", "--model", str(model), "--export-dir", str(tmp_path / "export"), "--timeout", str(TIMEOUT_S),
            "--no-progress", *FAST]
    target = ["-m", "modelopt_ext.testing.inject", *fault, "--"] if fault else ["-m", "modelopt_ext"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *target, *argv]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=BOUND_S + 60)
    return proc, time.monotonic() - start


def _assert_no_export(tmp_path: Path) -> None:
    # the calibration state (`.export.calibration`, kept for `ptq --resume` when calibration finished) may stay
    left = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("hf_modules", ".export.calibration"))
    assert "export" not in left and not [n for n in left if n.startswith(".export.")], left


def _run_nodes(tmp_path: Path, model: Path, fault: tuple[str, str, str]):
    argv = ["ptq", "--model", str(model), "--export-dir", str(tmp_path / "export"), "--timeout", str(TIMEOUT_S),
            "--no-progress", *FAST]
    target = ["-m", "modelopt_ext.testing.inject", *fault, "--"]
    return launch_nodes(argv, [tmp_path, tmp_path], env=node_env(tmp_path), timeout_s=BOUND_S + 60, target=target)


@pytest.mark.parametrize("kind, phase", [("raise", "load"), ("raise", "calibrate"), ("raise", "export"),
                                         ("stall", "calibrate")])
def test_a_failing_rank_fails_every_rank(model, tmp_path, kind, phase):
    runs = _run_nodes(tmp_path, model, (kind, phase, "1"))
    for run in runs:
        assert not run.timed_out and run.returncode == 1, (run.node, run.returncode, run.stderr[-3000:])
        assert run.seconds < BOUND_S, f"rank {run.node} took {run.seconds:.0f} s"
    errors = [run.error_lines(f"modelopt-ext ptq: error: {phase}: ") for run in runs]
    for run, lines in zip(runs, errors):  # every rank: the phase's error line, its own (not torchrun's)
        assert lines, (run.node, run.stderr[-3000:])
    if kind == "raise":  # every rank names rank 1's exception (a rank stopped by its watch: through on_stop)
        assert all(f"injected failure during {phase}" in lines[-1] for lines in errors), errors
    else:  # rank 0 names the stalled rank first (its position is oldest); the stalled rank is stopped by its watch
        assert "positions: rank 1 at 'calibrate batch 2/2'" in errors[0][-1], errors[0]
        assert "rank 0 at 'calibrate batch 2/2, expert exchange" in errors[0][-1], errors[0]
        # rank 0 recorded its lost contact; the stalled rank's watch reads it, or finds the store gone with rank 0
        assert ("rank 0 failed during calibrate (lost contact" in errors[1][-1]
                or "the process group's store has been unreachable" in errors[1][-1]), errors[1]
    _assert_no_export(tmp_path)


def test_a_killed_rank_is_named_and_the_rerun_succeeds(model, tmp_path):
    proc, elapsed = _run(tmp_path, model, ("kill", "calibrate", "1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and elapsed < BOUND_S, out[-3000:]
    # torchrun reports the dead rank and its signal; rank 0 (if it got to it first) its last position
    assert "SIGKILL" in out or "Signal 9" in out, out[-3000:]
    assert "rank: 1" in out or "positions: rank 1 at 'calibrate batch 2/2'" in out, out[-3000:]
    _assert_no_export(tmp_path)
    proc, _ = _run(tmp_path, model, None)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert (tmp_path / "export" / "MANIFEST.sha256").is_file()


def test_an_abort_at_interpreter_exit_does_not_fail_a_finished_run(model, tmp_path):
    """Rank 0 aborts (SIGABRT) if its interpreter is finalized, as gloo's worker threads can make it do; the
    CLI ends a process that joined a group without finalization (`dist.end_process`), so the run succeeds."""
    proc, _ = _run(tmp_path, model, ("abort", "exit", "0"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "SIGABRT" not in out and "Signal 6" not in out, out[-3000:]
    assert "expert coverage:" in proc.stdout, proc.stdout[-3000:]  # rank 0's summary, flushed before leaving
    assert (tmp_path / "export" / "MANIFEST.sha256").is_file()

"""Fault injection on real gloo ranks under torchrun: a rank raises (load, calibration, export), is killed
with SIGKILL, or stalls. Every rank exits non-zero within a bound, the output names the failed rank and the
phase, no export (nor a staging directory) is left, and the same command then succeeds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modelopt_ext.testing.checkpoints import copy_checkpoint

FAST = "--experts-implementation batched_mm --dtype float32 --calib-size 8 --batch-size 2 --seq-len 16".split()
TIMEOUT_S = 20  # --timeout: the bound on every collective wait
BOUND_S = 150  # start-up, load and calibration of both ranks plus the timeout, on a loaded 2-core machine


@pytest.fixture(scope="module")
def model(tiny_ckpt, tmp_path_factory) -> Path:
    return copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("faults"), "faults_src")


def _run(tmp_path: Path, model: Path, fault: tuple[str, str, str] | None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "hf_modules"), OMP_NUM_THREADS="1")
    argv = ["ptq", "--model", str(model), "--export-dir", str(tmp_path / "export"), "--timeout", str(TIMEOUT_S),
            "--no-progress", *FAST]
    target = ["-m", "modelopt_ext.testing.inject", *fault, "--"] if fault else ["-m", "modelopt_ext"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *target, *argv]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=BOUND_S + 60)
    return proc, time.monotonic() - start


def _assert_no_export(tmp_path: Path) -> None:
    left = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("hf_modules",))
    assert "export" not in left and not [n for n in left if n.startswith(".export.")], left


@pytest.mark.parametrize("kind, phase", [("raise", "load"), ("raise", "calibrate"), ("raise", "export"),
                                         ("stall", "calibrate")])
def test_a_failing_rank_fails_every_rank(model, tmp_path, kind, phase):
    proc, elapsed = _run(tmp_path, model, (kind, phase, "1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert elapsed < BOUND_S, f"took {elapsed:.0f} s"
    errors = [line for line in out.splitlines() if "modelopt-ext ptq: error:" in line or "stopping: rank" in line]
    assert errors, out[-4000:]
    if kind == "raise":
        assert any("rank 1" in e and f"injected failure during {phase}" in e for e in errors), errors
    else:  # the stalled rank is the one whose position is oldest: it leads the positions
        assert any("positions: rank 1 at 'calibrate batch 2/2'" in e for e in errors), errors
        assert any("rank 0 at 'calibrate batch 2/2, expert exchange" in e for e in errors), errors
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

"""modelopt_ext.testing.inject: one fault of each kind, installed at each phase, on the chosen rank only
(tests/test_faults.py runs it end to end under torchrun)."""

import os
import signal
import subprocess
import sys

import pytest

import modelopt_ext.export.writer as writer
import modelopt_ext.loader as loader
import modelopt_ext.quant.calibrate as calibrate
from modelopt_ext.testing import inject


@pytest.fixture
def restored(monkeypatch):
    """The three functions the phases replace, each put back after the test (and recording calls meanwhile)."""
    calls = []
    monkeypatch.setattr(loader, "load", lambda *a, **k: calls.append("load"))
    monkeypatch.setattr(calibrate, "mark", lambda where: calls.append(where))
    monkeypatch.setattr(writer, "materialize", lambda modules: calls.append(list(modules)))
    return calls


def test_raise_during_load(restored):
    inject.install("raise", "load")
    with pytest.raises(RuntimeError, match="^injected failure during load$"):
        loader.load(lambda *a, **k: None, "ckpt", trust_remote_code=True)
    assert restored == []  # the real load never starts


def test_raise_before_calibration_batch_2(restored):
    inject.install("raise", "calibrate")
    calibrate.mark("calibrate batch 1/4")
    calibrate.mark("calibrate: coverage")
    with pytest.raises(RuntimeError, match="^injected failure during calibrate$"):
        calibrate.mark("calibrate batch 2/4")
    assert restored == ["calibrate batch 1/4", "calibrate: coverage", "calibrate batch 2/4"]  # marked first


def test_raise_at_the_third_exported_unit(restored):
    inject.install("raise", "export")
    writer.materialize(iter(["embed"]))
    writer.materialize(iter(["layer 0"]))
    with pytest.raises(RuntimeError, match="^injected failure during export$"):
        writer.materialize(iter(["layer 1"]))
    assert restored == [["embed"], ["layer 0"]]


def test_unknown_phase_and_kind(restored):
    with pytest.raises(ValueError, match="unknown phase 'save'"):
        inject.install("raise", "save")
    inject.install("explode", "load")
    with pytest.raises(ValueError, match="unknown fault kind 'explode'"):
        loader.load(lambda *a, **k: None, "ckpt")


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_kill_abort_and_the_exit_phase_end_the_process():
    """kill: SIGKILL at once; abort: SIGABRT; phase exit: the fault runs at interpreter finalization, after the
    program's own last line."""
    killed = _run("from modelopt_ext.testing.inject import _fault; _fault('kill', 'load'); print('survived')")
    assert killed.returncode == -signal.SIGKILL and "survived" not in killed.stdout
    aborted = _run("from modelopt_ext.testing.inject import install; install('abort', 'exit'); print('finished')")
    assert aborted.returncode == -signal.SIGABRT and aborted.stdout == "finished\n"
    raised = _run("from modelopt_ext.testing.inject import install; install('raise', 'exit'); print('finished')")
    assert raised.stdout == "finished\n" and "RuntimeError: injected failure during exit" in raised.stderr


def test_main_installs_on_its_rank_only_then_runs_the_cli(restored, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as info:
        inject.main(["raise", "load", "1", "--", "--help"])
    assert info.value.code == 0 and "make-tiny" in capsys.readouterr().out
    loader.load(lambda *a, **k: None, "ckpt")
    assert restored == ["load"]  # rank 0: nothing installed
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        inject.main(["raise", "load", "1", "--", "--help"])
    with pytest.raises(RuntimeError, match="injected failure during load"):
        loader.load(lambda *a, **k: None, "ckpt")


def test_main_needs_the_separator():
    with pytest.raises(SystemExit, match="usage: inject KIND PHASE RANK -- ARGS"):
        inject.main(["raise", "load", "1", "ptq"])


def test_stall_sleeps_beyond_every_timeout():
    proc = subprocess.Popen([sys.executable, "-c", "from modelopt_ext.testing.inject import _fault; _fault('stall', 'load')"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

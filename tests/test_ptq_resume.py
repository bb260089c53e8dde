"""`modelopt-ext ptq --resume` end to end (quant/resume.py; unit tests in tests/quant/test_resume.py): a run
whose export fails keeps every rank's calibration state; `--resume` with the same arguments exports from it,
byte for byte what an uninterrupted run writes, on 2 gloo ranks and in one process; a changed argument,
checkpoint or world size is refused on every rank before anything is loaded, naming what changed.

The EP2 tests share one interrupted run (module fixture) and run in file order: the refusals leave the state
as it was, the successful resume removes it."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from modelopt_ext import ptq
from modelopt_ext.cli import main
from modelopt_ext.quant import resume
from modelopt_ext.testing.checkpoints import copy_checkpoint
from modelopt_ext.testing.nodes import launch_nodes, node_env

FAST = "--experts-implementation batched_mm --dtype float32 --calib-size 8 --batch-size 2 --seq-len 16".split()
BOUND_S = 240


def _torchrun(root: Path, argv: list[str], fault: tuple[str, str, str] | None = None):
    target = ["-m", "modelopt_ext.testing.inject", *fault, "--"] if fault else ["-m", "modelopt_ext"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *target, *argv]
    return subprocess.run(cmd, env=node_env(root), cwd=root, capture_output=True, text=True, timeout=BOUND_S)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _same_export(a: Path, b: Path) -> None:
    one, two = _files(a), _files(b)
    assert sorted(one) == sorted(two)
    assert [name for name in one if one[name] != two[name]] == []  # every file, provenance and manifest included


@pytest.fixture(scope="module")
def interrupted(tiny_ckpt, tmp_path_factory):
    """2 ranks calibrate, then rank 1 fails while exporting decoder layer 1."""
    root = tmp_path_factory.mktemp("resume_ep2")
    model = copy_checkpoint(tiny_ckpt, root, "resume_src")
    argv = ["ptq", "--model", str(model), "--export-dir", str(root / "export"), "--timeout", "60", "--no-progress",
            *FAST]
    proc = _torchrun(root, argv, ("raise", "export", "1"))
    return root, model, argv, proc


def test_a_failed_export_keeps_every_ranks_calibration_state(interrupted):
    root, _, _, proc = interrupted
    assert proc.returncode != 0 and "injected failure during export" in proc.stderr, proc.stderr[-3000:]
    state = root / ".export.calibration"
    assert sorted(_files(state)) == ["rank0.json", "rank0.safetensors", "rank1.json", "rank1.safetensors"]
    assert f"the calibration state in {state} is kept" in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("modelopt-ext ptq: error: ")]
    hint = f"; the calibration state is kept in {state}: run again with the same arguments and --resume to export"
    assert errors and all(hint in line for line in errors), errors  # every rank's error line says how to go on
    assert not (root / "export").exists()


def test_a_changed_argument_and_checkpoint_are_refused_on_every_rank(interrupted):
    root, model, argv, _ = interrupted
    state = root / ".export.calibration"
    before = _files(state)
    shard = model / "model-00001-of-00003.safetensors"
    original = shard.read_bytes()
    shard.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # the last data byte: the fingerprint samples it
    try:
        changed = list(argv)
        changed[changed.index("--calib-size") + 1] = "4"  # was 8
        runs = launch_nodes([*changed, "--resume"], [root, root], env=node_env(root), timeout_s=BOUND_S)
    finally:
        shard.write_bytes(original)
    for run in runs:
        lines = run.error_lines("modelopt-ext ptq: error: validate: ")
        assert run.returncode == 1 and lines, (run.node, run.stderr[-3000:])
        assert f"--resume: the calibration state in {state} was saved by a different run" in lines[-1]
        assert "--calib-size was 8, now 4" in lines[-1]
        assert "checkpoint files differ: model-00001-of-00003.safetensors" in lines[-1]
    assert _files(state) == before and not (root / "export").exists()


def test_a_changed_world_size_is_refused(interrupted, capsys):
    root, _, argv, _ = interrupted
    assert main([*argv, "--resume"]) == 1  # one process: world size 1, no EP
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("modelopt-ext ptq: error: validate: --resume: the calibration state"), err
    assert "world size was 2, now 1; EP degree was 2, now none" in err
    assert (root / ".export.calibration" / "rank0.json").is_file()


def test_resume_exports_what_an_uninterrupted_run_writes(interrupted):
    root, _, argv, _ = interrupted
    proc = _torchrun(root, [*argv, "--resume", "--summary-json", str(root / "summary.json")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"restored from {root / '.export.calibration'} (saved by an earlier run; no forward pass)" in proc.stdout
    summary = json.loads((root / "summary.json").read_text())
    assert summary["tokens"] == [64, 64] and [list(p) for p in summary["calibrate_parts"]] == [["restore"]] * 2
    assert not (root / ".export.calibration").exists()  # removed once the export passed the engines' rules
    uninterrupted = [a if a != str(root / "export") else str(root / "export2") for a in argv]
    proc = _torchrun(root, uninterrupted)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_export(root / "export", root / "export2")


def test_one_process_resume_is_byte_identical(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """One process: the engines phase fails after an uninterrupted export was published, so the state is kept;
    `--resume --overwrite` replaces that export with the same bytes."""
    model = copy_checkpoint(tiny_ckpt, tmp_path, "resume_one")
    argv = ["ptq", "--model", str(model), "--export-dir", str(tmp_path / "out"), "--no-progress", *FAST]
    assert main([*argv, "--resume"]) == 1  # nothing saved yet
    err = capsys.readouterr().err.strip().splitlines()[-1]
    expected = tmp_path / ".out.calibration" / "rank0.json"
    assert f"no saved calibration state for rank 0: {expected} does not exist" in err, err

    def failing(self, inputs, export_dir):
        raise RuntimeError("engines interrupted")

    monkeypatch.setattr(ptq._Run, "_check_engines", failing)
    assert main(argv) == 1
    monkeypatch.undo()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"engines: RuntimeError: engines interrupted; the calibration state is kept in "
                        f"{tmp_path / '.out.calibration'}: run again with the same arguments and --resume to export "
                        "without calibrating"), err
    uninterrupted = _files(tmp_path / "out")
    state = tmp_path / ".out.calibration"
    saved = resume.read_header(state, 0)
    assert (saved["world_size"], saved["ep_size"], saved["tokens"]) == (1, None, 8 * 16)
    size = sum(p.stat().st_size for p in state.iterdir())
    assert size < 200_000, size  # no weights: amax, coverage and the header
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--resume", "--overwrite"]) == 0
    assert "restored from" in out.getvalue() and not state.exists()
    resumed = _files(tmp_path / "out")
    assert sorted(resumed) == sorted(uninterrupted)
    assert [name for name in resumed if resumed[name] != uninterrupted[name]] == []

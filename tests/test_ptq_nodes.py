"""`ptq` across two torchrun agents (`--nnodes 2`, one rank each) on one machine, every rank's exit status and
output captured on its own (`testing.nodes`): node-local checkpoint copies that differ, an export dir the
nodes do not share, and SIGTERM during the export. Each asserts the same error on every rank, a time bound,
and that nothing is left that looks like an export."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from modelopt_ext.testing.checkpoints import copy_checkpoint, tiny_checkpoint
from modelopt_ext.testing.nodes import launch_nodes, node_env

FAST = "--experts-implementation batched_mm --dtype float32 --calib-size 8 --batch-size 2 --seq-len 16".split()
PREFIX = "modelopt-ext ptq: error: "
TIMEOUT_S = 30  # --timeout
BOUND_S = 180  # two agents' start-up, imports and validate (plus load, calibration, export) on a loaded 2-core box


def _nodes(tmp_path: Path, tiny_ckpt: Path) -> list[Path]:
    """node0/ and node1/, each with its own copy of the checkpoint at the relative path `ckpt`."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
        copy_checkpoint(tiny_ckpt, node, "ckpt")
    return nodes


def _ptq(tmp_path: Path, nodes: list[Path], export: str, *extra: str, **kwargs):
    argv = ["ptq", "--model", "ckpt", "--export-dir", export, "--timeout", str(TIMEOUT_S), "--no-progress", *FAST,
            *extra]
    return launch_nodes(argv, nodes, env=node_env(tmp_path), timeout_s=BOUND_S + 60, **kwargs)


def _assert_every_rank_failed_with(runs, expected: str) -> None:
    for run in runs:
        errors = run.error_lines(PREFIX)
        assert not run.timed_out and run.returncode == 1, (run.node, run.returncode, run.stderr[-3000:])
        assert run.seconds < BOUND_S, f"rank {run.node} took {run.seconds:.0f} s"
        assert errors and errors[-1].startswith(PREFIX + expected), (run.node, errors, run.stderr[-3000:])


@pytest.mark.parametrize("what", ["config", "shard data"])
def test_node_local_copies_that_differ_fail_every_rank_before_loading(tiny_ckpt, tmp_path, what):
    """Node 1's copy is stale: its config.json was edited, or its weights are another generation of the same
    shapes (seed 1: same files, sizes and headers, other tensor values)."""
    nodes = _nodes(tmp_path, tiny_ckpt)
    stale = nodes[1] / "ckpt"
    if what == "config":
        config = json.loads((stale / "config.json").read_text())
        config["transformers_version"] = "0.0.1"
        (stale / "config.json").write_text(json.dumps(config, indent=2))
        file = "config.json"
    else:
        other = tiny_checkpoint("kimi_k3", tmp_path / "seed1", seed=1)
        file = "model-00001-of-00003.safetensors"  # the first in name order; every shard differs
        for shard in sorted(other.glob("*.safetensors")):
            assert shard.stat().st_size == (stale / shard.name).stat().st_size
            shutil.copyfile(shard, stale / shard.name)
    out = tmp_path / "out"
    runs = _ptq(tmp_path, nodes, str(out))
    _assert_every_rank_failed_with(
        runs, "validate: ranks read different checkpoints or inputs: rank 1 (host ")
    for run in runs:
        line = run.error_lines(PREFIX)[-1]
        assert f"in {1 if what == 'config' else 3} file(s), first --model ckpt/{file}: rank 0 has " in line, line
        assert "every node must read the same copy" in line
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_an_export_dir_the_nodes_do_not_share_fails_every_rank_in_validate(tiny_ckpt, tmp_path):
    """A relative export dir resolves into each node's own folder: rank 1 cannot see rank 0's probe."""
    nodes = _nodes(tmp_path, tiny_ckpt)
    runs = _ptq(tmp_path, nodes, "out")
    _assert_every_rank_failed_with(runs, "validate: 1 rank(s) failed during validate; rank 1: ExportDirError: export "
                                         f"dir {nodes[1] / 'out'}: rank 1 (host ")
    assert "every rank must write to one export dir on a filesystem all nodes share" in runs[0].stderr
    for node in nodes:
        assert sorted(p.name for p in node.iterdir()) == ["ckpt"]  # the probe is removed, nothing else written


def test_sigterm_during_the_export_removes_the_staging_dir_on_every_rank(tiny_ckpt, tmp_path):
    """What Slurm, Kubernetes and `timeout` do: SIGTERM to every node's agent once the export has written a
    file; torchrun passes it to its rank, each rank removes the staging dir and exits 143. Every rank ends in
    an error line (CI once saw rank 1 die without one: its signal came while it unwound from the failure that
    rank 0's exit caused, after the export had put back the default handler)."""
    nodes = _nodes(tmp_path, tiny_ckpt)
    out = tmp_path / "out"
    sent = []

    def terminate_once_exporting(agents) -> None:
        # (a file, not the dir: `p.glob(...)` alone is a generator, always true, which fired on the bare staging dir)
        if not sent and any(any(p.glob("*.safetensors")) for p in tmp_path.glob(".out.partial-*")):
            for agent in agents:
                os.kill(agent.pid, signal.SIGTERM)
            sent.append(True)

    runs = _ptq(tmp_path, nodes, str(out), while_running=terminate_once_exporting)
    assert sent, [r.stderr[-2000:] for r in runs]
    interrupted = "export: interrupted by SIGTERM; the staging directory was removed and nothing was published"
    for run in runs:
        assert not run.timed_out and run.returncode != 0 and run.seconds < BOUND_S, (run.node, run.stderr[-3000:])
        # a rank whose own signal comes late (its agent was scheduled after the other's) first fails for the
        # stopped peer: its line says so, and still names the signal when that arrives while it unwinds
        line = (run.error_lines(PREFIX) or [""])[-1]
        assert line.startswith(PREFIX + interrupted) or line.startswith(PREFIX + "export: lost contact with other "
                                                                            "ranks"), (run.node, run.stderr[-3000:])
    assert any(run.error_lines(PREFIX)[-1].startswith(PREFIX + interrupted) for run in runs)
    left = {str(p): sorted(f.name for f in p.iterdir()) for p in tmp_path.glob(".out.*")}
    state = left.pop(str(tmp_path / ".out.calibration"), None)  # calibration finished: kept for `ptq --resume`
    assert not out.exists() and not left, (left, [run.stderr[-3000:] for run in runs])
    assert state == ["rank0.json", "rank0.safetensors", "rank1.json", "rank1.safetensors"], state

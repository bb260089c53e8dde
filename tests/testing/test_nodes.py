"""modelopt_ext.testing.nodes: one torchrun agent per rank, each rank's own status and output, every run
bounded, and no rank left running after a timeout (torchrun starts ranks in sessions of their own)."""

from __future__ import annotations

import os
from pathlib import Path

from modelopt_ext.testing.nodes import launch_nodes, node_env

SCRIPT = """import os, sys, time
rank = int(os.environ["RANK"])
open(os.path.join(os.environ["PROBE_DIR"], f"pid{rank}"), "w").write(str(os.getpid()))
print(f"rank {rank} of {os.environ['WORLD_SIZE']} in {os.getcwd()}")
if rank == 1 and os.environ.get("STALL"):
    time.sleep(3600)
sys.exit(3 if rank == 1 else 2)  # both fail: an agent whose rank succeeded waits for the others at exit
"""


def _run(tmp_path: Path, timeout_s: float, **env):
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    cwds = [tmp_path / "n0", tmp_path / "n1"]
    for cwd in cwds:
        cwd.mkdir(exist_ok=True)
    return launch_nodes([], cwds, env=node_env(tmp_path, {"PROBE_DIR": str(tmp_path), **env}), timeout_s=timeout_s,
                        target=[str(script)])


def test_each_rank_reports_its_own_status_output_and_folder(tmp_path):
    runs = _run(tmp_path, 120)
    assert [r.node for r in runs] == [0, 1] and not any(r.timed_out for r in runs)
    assert runs[0].returncode != 0 and runs[1].returncode != 0  # each agent reports its own rank's failure
    assert "exitcode  : 2" in runs[0].stderr and "exitcode  : 3" in runs[1].stderr, (runs[0].stderr, runs[1].stderr)
    assert f"rank 0 of 2 in {tmp_path / 'n0'}" in runs[0].stdout and f"rank 1 of 2 in {tmp_path / 'n1'}" in runs[1].stdout
    assert "rank 1" not in runs[0].stdout


def test_a_stalled_rank_is_bounded_and_killed(tmp_path):
    runs = _run(tmp_path, 10, STALL="1")
    assert runs[0].returncode != 0 and not runs[0].timed_out
    assert runs[1].timed_out and runs[1].returncode is None and runs[1].seconds >= 10
    pid = int((tmp_path / "pid1").read_text())
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"

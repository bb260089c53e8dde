"""Real multi-node launches on one machine, for end-to-end tests: one torchrun agent per "node" (`--nnodes N
--node-rank i`, static rendezvous on 127.0.0.1, one rank each), each in its own working directory, so that
every rank's exit status and output are captured on their own and a relative path can name a node-local copy.

    runs = launch_nodes(["ptq", "--model", "ckpt", ...], [node0, node1], timeout_s=240)
    assert all(r.returncode == 1 for r in runs)

An agent whose rank succeeded waits at exit (torchrun's exit barrier, up to 300 s) for the other agents, so
a run in which some ranks succeed and others fail takes that long: `ptq` fails every rank together.
The checkout this module belongs to goes first on PYTHONPATH, so the ranks run this tree, not an installed
copy. Every run is bounded: past `timeout_s` every agent's process group is killed and `timed_out` is set.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import modelopt_ext

CHECKOUT = Path(modelopt_ext.__file__).resolve().parents[1]
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GROUP_RANK", "TORCHELASTIC_RUN_ID")


@dataclasses.dataclass
class NodeRun:
    """One agent (= one rank here): its exit status, output and wall-clock seconds."""

    node: int
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool

    def error_lines(self, prefix: str) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith(prefix)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without torchrun's variables, offline, with this checkout on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    path = [str(CHECKOUT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "hf_modules"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(path))
    env.update(extra or {})
    return env


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (torchrun starts each rank in a session of its own, out of the agent's group)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _end(agents: list[subprocess.Popen], grace_s: float = 40.0) -> None:
    """Stop agents still running: SIGTERM (torchrun passes it to its ranks), then SIGKILL to what is left,
    ranks included, so no rank outlives the test."""
    running = [a for a in agents if a.poll() is None]
    for agent in running:
        agent.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for agent in running:
        ranks = _children(agent.pid)
        try:
            agent.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        for pid in ranks + _children(agent.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(timeout=30)


def launch_nodes(argv: Sequence[str], cwds: Sequence[Path], *, env: dict[str, str], timeout_s: float,
                 target: Sequence[str] = ("-m", "modelopt_ext"),
                 while_running: Callable[[list[subprocess.Popen]], None] | None = None) -> list[NodeRun]:
    """Run `python -m torch.distributed.run ... TARGET ARGV` once per entry of `cwds` (node i in cwds[i]);
    `while_running` is called with the agents every 20 ms until all have ended (e.g. to signal them)."""
    port, n = free_port(), len(cwds)
    logs = Path(tempfile.mkdtemp(prefix="modelopt_ext_nodes-"))
    agents, files = [], []
    start = time.monotonic()
    for i, cwd in enumerate(cwds):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n), "--node-rank", str(i),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), *target, *argv]
        out, err = (logs / f"{i}.out").open("w"), (logs / f"{i}.err").open("w")
        files.append((out, err))
        agents.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                       start_new_session=True))
    ended: dict[int, float] = {}
    timed_out = False
    try:
        while len(ended) < n:
            for i, agent in enumerate(agents):
                if i not in ended and agent.poll() is not None:
                    ended[i] = time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                timed_out = True
                break
            if while_running is not None:
                while_running(agents)
            time.sleep(0.02)
    finally:
        _end(agents)
        for out, err in files:
            out.close()
            err.close()
    runs = []
    for i, agent in enumerate(agents):
        runs.append(NodeRun(i, None if i not in ended else agent.returncode, (logs / f"{i}.out").read_text(),
                            (logs / f"{i}.err").read_text(), ended.get(i, time.monotonic() - start),
                            timed_out and i not in ended))
    for f in logs.iterdir():
        f.unlink()
    logs.rmdir()
    return runs

"""Run a function on W real `torch.distributed` ranks (gloo, CPU), each its own process, with a bound.

`run_ranks("pkg.module:function", world_size, kwargs)` starts W Python processes with torchrun's
environment; each calls `function(rank, world_size, **kwargs)` inside an initialised gloo group and its
return value (anything `torch.save` can store) comes back in rank order. A rank that raises or a run that
exceeds `timeout_s` fails the whole call with every rank's output in the message; no process is left.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: str, world_size: int, kwargs: dict[str, Any] | None = None, timeout_s: float = 300) -> list:
    with tempfile.TemporaryDirectory(prefix="modelopt_ext_ranks-") as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "kwargs.json").write_text(json.dumps(kwargs or {}))
        port = free_port()
        procs = []
        for rank in range(world_size):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                   "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1"}
            log = open(tmp_path / f"rank{rank}.log", "w")
            procs.append((subprocess.Popen([sys.executable, "-m", __name__, target, tmp], env=env, stdout=log,
                                           stderr=subprocess.STDOUT), log))
        try:
            for proc, _ in procs:
                proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            for proc, log in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.close()
        codes = [p.returncode for p, _ in procs]
        if any(codes):
            logs = "\n".join(f"--- rank {r} (exit {c}) ---\n{(tmp_path / f'rank{r}.log').read_text()[-3000:]}"
                             for r, c in enumerate(codes))
            raise RuntimeError(f"{target} failed on {world_size} ranks (exit codes {codes}):\n{logs}")
        return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _worker(target: str, tmp: str) -> None:
    """Run the body, save its result and leave without tearing the process group down or finalizing the
    interpreter (`modelopt_ext.dist.end_process`: gloo's threads can abort a finalizing interpreter, failing a
    passing run). Rank 0 hosts the store, so every rank marks itself done in the store (not a collective: a
    body may leave the group broken on purpose) and rank 0 leaves last."""
    import datetime
    import traceback

    import torch.distributed as dist

    from modelopt_ext.dist import end_process, init_distributed

    module_name, fn_name = target.split(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    kwargs = json.loads((Path(tmp) / "kwargs.json").read_text())
    rank, world = init_distributed(timeout_s=120)
    status = 1
    try:
        result = fn(rank, world, **kwargs)
        torch.save(result, Path(tmp) / f"rank{rank}.pt")
        status = 0
    except BaseException:  # noqa: BLE001 - reported in the rank's log, then a non-zero exit
        traceback.print_exc()
    finally:
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"multiproc/done/{rank}", str(status))
            if rank == 0:
                store.wait([f"multiproc/done/{r}" for r in range(world)], datetime.timedelta(seconds=60))
        except Exception:  # noqa: BLE001 - a peer died: nothing to wait for
            pass
        end_process(status, joined=True)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])

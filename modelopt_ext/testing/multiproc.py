"""Run a function on W real `torch.distributed` ranks (gloo, CPU), each its own process, with a bound.

`run_ranks(target, world_size, kwargs)` starts W Python processes with torchrun's environment; each calls
`function(rank, world_size, **kwargs)` inside an initialised gloo group and its return value (anything
`torch.save` can store and the caller can load: tensors, plain values, library objects) comes back in rank
order. `kwargs` must be JSON-serialisable. A rank that raises fails the whole call with a `RuntimeError` naming
the failed ranks, with every rank's output in the message; a run that exceeds `timeout_s` (one bound for the
whole run) is killed, every rank's process group with it, and fails the same way. No process is left.

The target names the function, in one of three forms:

- the function itself (the spelling for tests): `run_ranks(my_body, 2, {...})`, where `my_body` is a
  module-level function of a Python file, usually the test file itself, so that a per-rank body sits next to the
  test that asserts on its results. It runs as `"<its file>:<its name>"` (`target_of`).
- `"/path/to/file.py:function"`: a Python file by path (a path holds a "/" or ends in ".py"). Each rank
  imports the file with `import_file`, under a module name of its own, so only the file's top-level code runs
  there (imports, constants, decorators): no pytest fixture or conftest. A test file that holds bodies must
  therefore import without pytest's help (importing pytest itself is fine).
- `"package.module:function"`: a module by dotted name, for library and script users.

A missing file is refused before any process starts (FileNotFoundError); a function the file or module does not
define fails the call with a message naming both.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_FILE_MODULE_PREFIX = "_modelopt_ext_file_"
_WORKER = "modelopt_ext.testing.multiproc"  # what each rank runs (`_worker`), also when this module is __main__


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def file_module_name(path: str | os.PathLike) -> str:
    """The module name `import_file` gives the file at `path`: its stem and a hash of its resolved path, the same
    in every process and different for two files of one name in different folders."""
    resolved = Path(path).resolve()
    stem = re.sub(r"\W", "_", resolved.stem)
    return f"{_FILE_MODULE_PREFIX}{stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:12]}"


def import_file(path: str | os.PathLike) -> types.ModuleType:
    """Import the Python file at `path` (`importlib.util.spec_from_file_location`) under `file_module_name`,
    once per process: a second call returns the same module. Tests use it to share bodies kept in a
    non-test module beside them (`bodies = import_file(Path(__file__).with_name("bodies.py"))`)."""
    resolved = Path(path).resolve()
    if not resolved.is_file():
        raise FileNotFoundError(f"no Python file {resolved}")
    name = file_module_name(resolved)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ImportError(f"{resolved} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def target_of(fn: Callable) -> str:
    """`"<file>:<name>"` of a module-level function (what `run_ranks` runs for a function)."""
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"run_ranks runs a module-level function, a 'file.py:function' or a 'module:function' "
                        f"string; got {fn!r}")
    if fn.__qualname__ != fn.__name__:
        raise TypeError(f"run_ranks runs module-level functions, which each rank finds by name in their file; "
                        f"{fn.__qualname__} is not one")
    source = inspect.getsourcefile(inspect.unwrap(fn))
    if source is None or not Path(source).is_file():
        raise TypeError(f"{fn.__name__} is not defined in a Python file ({fn.__code__.co_filename})")
    return f"{Path(source).resolve()}:{fn.__name__}"


def _split(target: str) -> tuple[str, str, bool]:
    """(file or module, function, whether it names a file)."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"run_ranks target {target!r}: expected 'path/to/file.py:function' or "
                         f"'package.module:function'")
    return where, name, "/" in where or os.sep in where or where.endswith(".py")


def resolve(target: str) -> Callable:
    """The function a string target names (importing its file or module)."""
    where, name, is_file = _split(target)
    if is_file:
        module, origin = import_file(where), f"file {Path(where).resolve()}"
    else:
        module, origin = importlib.import_module(where), f"module {where}"
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items()
                         if isinstance(v, types.FunctionType) and v.__module__ == module.__name__)
        raise AttributeError(f"no function {name!r} in {origin} (its functions: {', '.join(defined) or 'none'})")
    return fn


def run_ranks(target: str | Callable, world_size: int, kwargs: dict[str, Any] | None = None,
              timeout_s: float = 300) -> list:
    """Run `target` (see the module docstring) on `world_size` gloo ranks; its return values in rank order."""
    if callable(target):
        target = target_of(target)
    where, name, is_file = _split(target)
    if is_file:
        path = Path(where).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"run_ranks target {target!r}: no Python file {path}")
        target = f"{path}:{name}"
    with tempfile.TemporaryDirectory(prefix="modelopt_ext_ranks-") as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "kwargs.json").write_text(json.dumps(kwargs or {}))
        port = free_port()
        procs = []
        try:
            for rank in range(world_size):
                env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1"}
                log = open(tmp_path / f"rank{rank}.log", "w")
                # a session of its own: a timeout kills the rank's whole process group, helpers it started too
                procs.append((subprocess.Popen([sys.executable, "-m", _WORKER, target, tmp], env=env, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True), log))
            deadline = time.monotonic() + timeout_s
            for proc, _ in procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
        finally:
            killed = _kill(procs)
        codes = [p.returncode for p, _ in procs]
        missing = [r for r, c in enumerate(codes) if c == 0 and not (tmp_path / f"rank{r}.pt").is_file()]
        if killed or any(codes) or missing:
            raise RuntimeError(_failure(target, world_size, timeout_s, tmp_path, codes, killed, missing))
        return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _kill(procs: list) -> list[int]:
    """Kill every rank still running (its whole process group) and close the logs; the ranks killed."""
    killed = []
    for rank, (proc, log) in enumerate(procs):
        if proc.poll() is None:
            killed.append(rank)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # ended meanwhile
                pass
            proc.wait()
        log.close()
    return killed


def _failure(target: str, world_size: int, timeout_s: float, tmp_path: Path, codes: list, killed: list[int],
             missing: list[int]) -> str:
    unresolved = [(tmp_path / f"rank{r}.target").read_text() for r in range(world_size)
                  if (tmp_path / f"rank{r}.target").is_file()]
    if unresolved:
        head = f"{target}: {unresolved[0]}"
    elif killed:
        head = f"{target} timed out after {timeout_s:g} s on {world_size} ranks; killed ranks {killed}"
    else:
        failed = [r for r, c in enumerate(codes) if c]
        head = f"{target} failed on rank(s) {failed} of {world_size}" if failed else f"{target} on {world_size} ranks"
    if missing:
        head += f"; rank(s) {missing} exited 0 without a result"
    logs = "\n".join(f"--- rank {r} (exit {c}) ---\n{(tmp_path / f'rank{r}.log').read_text()[-3000:]}"
                     for r, c in enumerate(codes))
    return f"{head} (exit codes {codes}):\n{logs}"


def _worker(target: str, tmp: str) -> None:
    """Run the body, save its result and leave without tearing the process group down or finalizing the
    interpreter (`modelopt_ext.dist.end_process`: gloo's threads can abort a finalizing interpreter, failing a
    passing run). Rank 0 hosts the store, so every rank marks itself done in the store (not a collective: a
    body may leave the group broken on purpose) and rank 0 leaves last. A target that does not resolve ends
    the rank before it joins the group, its reason in `rank{R}.target`."""
    import datetime
    import traceback

    import torch.distributed as dist

    from modelopt_ext.dist import end_process, init_distributed

    try:
        fn = resolve(target)
    except Exception as e:  # noqa: BLE001 - the parent reports it, naming the file or module and the function
        traceback.print_exc()
        (Path(tmp) / f"rank{os.environ['RANK']}.target").write_text(f"{type(e).__name__}: {e}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
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

"""modelopt_ext.testing.multiproc: per-rank bodies run on real gloo ranks, results in rank order, the three target
forms (a function of this file, a file path, a dotted module), failures that name the rank and carry its output,
one bound for the whole run that kills every process, and targets that do not resolve named."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from modelopt_ext.testing.multiproc import file_module_name, import_file, resolve, run_ranks, target_of

HERE = Path(__file__).resolve()


# ---- per-rank bodies (run on every rank by run_ranks) ----------------------------------------------------------------


def sum_of_ranks(rank: int, world_size: int, scale: float):
    """An all-reduce of (rank + 1) * scale, and what the rank knows of itself."""
    t = torch.tensor([(rank + 1) * scale])
    dist.all_reduce(t)
    return {"rank": rank, "world": world_size, "env_rank": os.environ["RANK"], "sum": t,
            "pid": os.getpid(), "module": __name__}


def fails_on_rank_1(rank: int, world_size: int):
    """Rank 1 prints a line and raises; rank 0 returns."""
    dist.barrier()
    if rank == 1:
        print("rank 1 about to fail", flush=True)
        raise ValueError("boom from rank 1")
    return rank


def stalls(rank: int, world_size: int, pid_dir: str):
    """Record this rank's pid and a child process's, then stall (rank 1) or return and wait for rank 1 at the
    exit (rank 0: `multiproc._worker` waits for every rank's done mark)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(pid_dir, f"rank{rank}").write_text(f"{os.getpid()} {child.pid}")
    if rank == 1:
        time.sleep(600)
    return rank


def exits_without_result(rank: int, world_size: int):
    os._exit(0)


# ---- helpers -----------------------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


# ---- tests -------------------------------------------------------------------------------------------------------


def test_a_body_of_this_file_runs_on_every_rank_in_rank_order():
    results = run_ranks(sum_of_ranks, 2, {"scale": 0.5}, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["env_rank"] for r in results] == ["0", "1"]
    assert all(r["world"] == 2 for r in results)
    for r in results:  # 0.5 * (1 + 2): the ranks really formed one group
        assert torch.equal(r["sum"], torch.tensor([1.5]))
    assert len({r["pid"] for r in results} | {os.getpid()}) == 3  # two processes of their own
    # each rank imported this file by path under its own module name, not pytest's
    assert {r["module"] for r in results} == {file_module_name(HERE)}


def test_the_path_form_and_the_dotted_form():
    assert target_of(sum_of_ranks) == f"{HERE}:sum_of_ranks"
    results = run_ranks(f"{HERE}:sum_of_ranks", 2, {"scale": 2.0}, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1] and torch.equal(results[1]["sum"], torch.tensor([6.0]))
    # a module by dotted name: operator.add(rank, world_size)
    assert run_ranks("operator:add", 2, timeout_s=60) == [2, 3]


def test_a_raising_rank_fails_the_call_naming_it_with_its_output():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_ranks(fails_on_rank_1, 2, timeout_s=60)
    message = str(info.value)
    assert message.startswith(f"{HERE}:fails_on_rank_1 failed on rank(s) [1] of 2 (exit codes [0, 1])"), message
    rank1 = message.split("--- rank 1 (exit 1) ---", 1)[1]
    assert "rank 1 about to fail" in rank1 and "ValueError: boom from rank 1" in rank1
    assert "--- rank 0 (exit 0) ---" in message
    assert time.monotonic() - start < 30  # rank 0 did not wait out a timeout


def test_a_timeout_bounds_the_whole_run_and_kills_every_process(tmp_path):
    timeout_s = 8.0
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_ranks(stalls, 2, {"pid_dir": str(tmp_path)}, timeout_s=timeout_s)
    elapsed = time.monotonic() - start
    assert elapsed < timeout_s + 8, elapsed  # one bound for the run, not one per rank
    message = str(info.value)
    assert f"timed out after {timeout_s:g} s on 2 ranks; killed ranks [0, 1]" in message, message
    recorded = sorted(p.name for p in tmp_path.iterdir())
    assert recorded == ["rank0", "rank1"], f"the ranks did not start in {timeout_s} s: {recorded}"
    pids = [int(pid) for p in tmp_path.iterdir() for pid in p.read_text().split()]
    assert len(pids) == 4
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if _alive(pid)] == [], "a rank or a process it started outlived the timeout"


def test_a_missing_function_is_named_with_its_file():
    with pytest.raises(RuntimeError) as info:
        run_ranks(f"{HERE}:no_such_body", 1, timeout_s=60)
    message = str(info.value)
    assert message.startswith(f"{HERE}:no_such_body: AttributeError: no function 'no_such_body' in file {HERE}")
    assert "sum_of_ranks" in message.split("\n", 1)[0]  # the functions it does define
    with pytest.raises(RuntimeError, match=r"modelopt_ext\.no_such_module:f: ModuleNotFoundError: .*no_such_module"):
        run_ranks("modelopt_ext.no_such_module:f", 1, timeout_s=60)


def test_a_rank_that_exits_without_a_result_fails_the_call():
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[0\] exited 0 without a result"):
        run_ranks(exits_without_result, 1, timeout_s=60)


def test_targets_refused_before_any_process_starts(tmp_path):
    missing = tmp_path / "nowhere.py"
    with pytest.raises(FileNotFoundError, match=f"no Python file {missing}"):
        run_ranks(f"{missing}:body", 2)
    for bad in ("sum_of_ranks", f"{HERE}:", ":sum_of_ranks", f"{HERE}:not-a-name"):
        with pytest.raises(ValueError, match="expected 'path/to/file.py:function' or 'package.module:function'"):
            run_ranks(bad, 2)

    def nested(rank, world_size):
        return rank

    with pytest.raises(TypeError, match="test_targets_refused_before_any_process_starts.<locals>.nested is not one"):
        run_ranks(nested, 2)
    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(print, 2)


def test_import_file_imports_once_under_a_name_of_its_own(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "bodies.py").write_text(f"FOLDER = {folder!r}\ndef body(rank, world_size):\n    return FOLDER\n")
    a, b = import_file(tmp_path / "a" / "bodies.py"), import_file(tmp_path / "b" / "bodies.py")
    assert (a.FOLDER, b.FOLDER) == ("a", "b")  # one stem, two modules
    assert a.__name__ != b.__name__ and a.__name__ == file_module_name(tmp_path / "a" / "bodies.py")
    assert sys.modules[a.__name__] is a
    assert import_file(tmp_path / "a" / ".." / "a" / "bodies.py") is a  # once per process, by resolved path
    assert resolve(f"{tmp_path / 'b' / 'bodies.py'}:body") is b.body
    (tmp_path / "broken.py").write_text("raise RuntimeError('broken at import')\n")
    with pytest.raises(RuntimeError, match="broken at import"):
        import_file(tmp_path / "broken.py")
    assert file_module_name(tmp_path / "broken.py") not in sys.modules  # a failed import is not kept

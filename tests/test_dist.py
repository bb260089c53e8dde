"""modelopt_ext.dist on real gloo ranks: failing together, agreeing, bounded waits; and init outside torchrun."""

import os
import subprocess
import sys
import textwrap

import pytest

from modelopt_ext.dist import end_process, init_distributed
from modelopt_ext.testing.multiproc import free_port, run_ranks

WORLD = 3


# ---- per-rank bodies (run on every rank by run_ranks) ----------------------------------------------------------------


def dist_all_or_fail_and_agree(rank: int, world_size: int):
    """all_or_fail and agree on every rank: what each returned or raised, as plain values."""
    from modelopt_ext.dist import RankFailure, agree, all_or_fail

    def outcome(fn):
        try:
            return {"value": fn(), "error": None}
        except RankFailure as e:
            cause = e.__cause__
            return {"value": None, "error": str(e), "type": type(e).__name__,
                    "cause": None if cause is None else f"{type(cause).__name__}: {cause}"}

    def fail_on(ranks):
        def fn():
            if rank in ranks:
                raise ValueError(f"boom on rank {rank}")
            return rank * 10
        return fn

    def lost_contact():
        raise TimeoutError(f"peer gone (rank {rank})")

    differing = world_size - 1
    return {
        "one_fails": outcome(lambda: all_or_fail("step one", fail_on({1}))),
        "two_fail": outcome(lambda: all_or_fail("step two", fail_on({1, 2}))),
        "all_succeed": outcome(lambda: all_or_fail("step three", fail_on(set()))),
        "agree_equal": outcome(lambda: agree("the plan", {"ep": world_size, "dense": "replicate"})),
        "agree_differs": outcome(lambda: agree("the width", 128 + (rank == differing))),
        # every rank's inner step loses the group: the outer step says what the inner one said, and gathers nothing
        "nested_lost_contact": outcome(lambda: all_or_fail("outer", lambda: all_or_fail("inner", lost_contact))),
        "interrupted_while_agreeing": _interrupted_while_agreeing(rank, fail_on({1})),  # the last: it patches
    }


def _interrupted_while_agreeing(rank: int, fn) -> dict:
    """SIGTERM arrives while the ranks agree on a step that failed on rank 1 (the agreement's collective is
    replaced by one that receives the signal): the `Interrupted` it raises chains rank 1's own failure."""
    import signal

    import torch.distributed as dist

    from modelopt_ext.dist import all_or_fail
    from modelopt_ext.export.staging import Interrupted, interrupts_raise

    def signalled(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)

    gather, dist.all_gather_object = dist.all_gather_object, signalled
    try:
        with interrupts_raise():
            all_or_fail("step four", fn)
    except Interrupted as e:
        context = e.__context__
        return {"type": type(e).__name__, "context": None if context is None else f"{type(context).__name__}: "
                                                                                   f"{context}"}
    finally:
        dist.all_gather_object = gather
    return {"type": None}


def dist_stalled_rank(rank: int, world_size: int, timeout_s: float, stall_s: float):
    """Lower the group's timeout to `timeout_s`; rank 1 stalls `stall_s` before the collective. Returns how
    long each rank's all_or_fail took and what it raised."""
    import datetime
    import time

    from torch.distributed.distributed_c10d import _set_pg_timeout

    from modelopt_ext.dist import all_or_fail

    _set_pg_timeout(datetime.timedelta(seconds=timeout_s))
    if rank == 1:
        time.sleep(stall_s)
    start = time.monotonic()
    try:
        all_or_fail("the stalled step", lambda: rank)
        error = None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    return {"elapsed": time.monotonic() - start, "error": error}


@pytest.fixture(scope="module")
def outcomes():
    """Per rank, per scenario: {"value", "error", "type", "cause"} (one run of 3 ranks for every scenario)."""
    return run_ranks(dist_all_or_fail_and_agree, WORLD, timeout_s=120)


def test_all_or_fail_one_rank_raises_every_rank_raises_the_same(outcomes):
    results = [o["one_fails"] for o in outcomes]
    assert all(r["type"] == "RankFailure" and r["value"] is None for r in results)
    assert len({r["error"] for r in results}) == 1, [r["error"] for r in results]
    message = results[0]["error"]
    assert "rank 1" in message and "step one" in message and "ValueError: boom on rank 1" in message
    assert message.startswith("1 rank(s) failed")
    # the failing rank chains its own exception; the others have none to chain
    assert [r["cause"] for r in results] == [None, "ValueError: boom on rank 1", None]


def test_all_or_fail_several_ranks_raise_names_the_first_and_the_others(outcomes):
    results = [o["two_fail"] for o in outcomes]
    assert len({r["error"] for r in results}) == 1
    message = results[0]["error"]
    assert message.startswith("2 rank(s) failed during step two; rank 1: ValueError: boom on rank 1")
    assert "also ranks [2]" in message
    assert [r["cause"] for r in results] == [None, "ValueError: boom on rank 1", "ValueError: boom on rank 2"]


def test_all_or_fail_returns_each_ranks_own_value(outcomes):
    assert [o["all_succeed"] for o in outcomes] == [{"value": 10 * r, "error": None} for r in range(WORLD)]


def test_a_nested_step_that_lost_contact_is_raised_unchanged_by_the_outer_one(outcomes):
    results = [o["nested_lost_contact"] for o in outcomes]
    for rank, r in enumerate(results):
        assert r["type"] == "RankFailure", r
        assert r["error"].startswith(f"lost contact with other ranks during inner (TimeoutError: peer gone (rank {rank}"
                                     "))"), r
        assert "during outer" not in r["error"], r  # (the positions may name it: where the other ranks were)


def test_a_signal_while_agreeing_on_a_failure_chains_this_ranks_failure(outcomes):
    """CI once saw a rank discarding its export report "nothing was exported": the signal came in the outer step's
    agreement, after the `except` block, so the failure it ended was not chained."""
    results = [o["interrupted_while_agreeing"] for o in outcomes]
    assert [r["type"] for r in results] == ["Interrupted"] * WORLD
    assert [r["context"] for r in results] == [None, "ValueError: boom on rank 1", None]


def test_agree_passes_for_equal_values(outcomes):
    assert all(o["agree_equal"] == {"value": None, "error": None} for o in outcomes)


def test_agree_raises_on_every_rank_naming_both_values_and_the_differing_rank(outcomes):
    results = [o["agree_differs"] for o in outcomes]
    assert all(r["type"] == "RankFailure" for r in results)
    assert len({r["error"] for r in results}) == 1
    message = results[0]["error"]
    assert "the width" in message and "rank 0 has 128" in message and f"rank {WORLD - 1} has 129" in message
    assert f"differing ranks: [{WORLD - 1}]" in message


def test_a_stalled_rank_makes_the_other_fail_within_the_group_timeout():
    """The group's timeout is lowered to 1.5 s inside the body (the worker initialised it with 120 s)."""
    timeout_s, stall_s = 1.5, 4.0
    results = run_ranks(dist_stalled_rank, 2, {"timeout_s": timeout_s, "stall_s": stall_s}, timeout_s=60)
    waiting = results[0]
    assert waiting["error"] is not None, "rank 0 should fail while rank 1 stalls"
    assert waiting["elapsed"] < timeout_s + 3.0, waiting
    assert waiting["elapsed"] < stall_s, "rank 0 waited for the stalled rank instead of timing out"
    assert results[1]["error"] is not None  # its peer gave up: the late collective fails too


def test_init_distributed_outside_torchrun_names_the_missing_variables(monkeypatch):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="torchrun") as info:
        init_distributed(timeout_s=5)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        assert var in str(info.value)
    assert not dist.is_initialized()


def test_init_distributed_names_only_the_variables_that_are_missing(monkeypatch):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError) as info:
        init_distributed(timeout_s=5)
    message = str(info.value)
    assert "MASTER_ADDR" in message and "MASTER_PORT" in message
    assert "'RANK'" not in message and "'WORLD_SIZE'" not in message


def test_end_process_returns_the_status_when_no_group_was_joined(monkeypatch):
    import torch.distributed as dist

    import modelopt_ext.dist

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    monkeypatch.setitem(modelopt_ext.dist._joined, "group", False)
    assert end_process(3) == 3


# A one-rank gloo group joined through init_distributed, an atexit handler that must not run, output on both
# streams (buffered: stdout is a pipe) and a log record, then end_process.
_END_PROCESS = textwrap.dedent("""
    import atexit, logging, sys
    from modelopt_ext.dist import end_process, init_distributed
    import torch.distributed as dist
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    atexit.register(lambda: print("atexit handler ran", flush=True))
    init_distributed(timeout_s=30)
    dist.destroy_process_group()
    print("stdout line")
    sys.stderr.write("stderr line\\n")
    logging.getLogger("end").info("log line")
    end_process(3)
    print("after end_process", flush=True)
""")


def test_end_process_after_a_group_flushes_and_exits_without_finalization(tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-c", _END_PROCESS], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stdout == "stdout line\n", proc.stdout
    assert "stderr line" in proc.stderr and "log line" in proc.stderr, proc.stderr
    assert "atexit handler ran" not in proc.stdout + proc.stderr

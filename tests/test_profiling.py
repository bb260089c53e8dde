"""modelopt_ext.profiling: the calibration loop's opt-in profiler writes per-rank tables for the chosen batches."""

import json

import pytest
import torch

from modelopt_ext.profiling import ENV_BATCHES, ENV_DIR, BatchProfiler


def test_profiles_only_the_chosen_batches(tmp_path):
    profiler = BatchProfiler(tmp_path, first=1, count=2, rank=3)
    a, b = torch.randn(64, 64), torch.randn(8, 8)
    for i in range(5):
        with profiler.batch(i):
            (a @ a if i < 3 else b.t() @ b).sum()  # batches 3 and 4 (outside the window) only multiply b^T b
    profiler.close()
    summary = json.loads((tmp_path / "calibrate_rank3.json").read_text())
    assert summary["batches"] == [1, 3] and len(summary["wall_ms"]) == 2
    assert all(ms > 0 for ms in summary["wall_ms"])
    table = (tmp_path / "calibrate_rank3.txt").read_text()
    assert "aten::mm" in table and "## by self_cpu_time_total" in table
    assert "aten::t " not in table  # the profiler stopped after the window


def test_loop_shorter_than_the_window_writes_nothing(tmp_path):
    profiler = BatchProfiler(tmp_path / "p", first=5, count=1)
    with profiler.batch(0):
        pass
    profiler.close()
    assert not (tmp_path / "p").exists()


def test_from_env(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_DIR, raising=False)
    assert BatchProfiler.from_env() is None
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    monkeypatch.setenv(ENV_BATCHES, "0:4")
    profiler = BatchProfiler.from_env(rank=1)
    assert (profiler.first, profiler.count, profiler.rank) == (0, 4, 1)
    for bad in ("3", "a:b", "-1:2", "1:0"):
        monkeypatch.setenv(ENV_BATCHES, bad)
        with pytest.raises(ValueError, match=ENV_BATCHES):
            BatchProfiler.from_env()


def test_sync_call_sites_with_stacks(tmp_path):
    def reads_back():
        return torch.ones(3).sum().item()

    profiler = BatchProfiler(tmp_path, first=0, count=1, stacks=True)
    with profiler.batch(0):
        reads_back()
    profiler.close()
    table = (tmp_path / "calibrate_rank0.txt").read_text()
    assert "## host syncs by call site" in table and "aten::_local_scalar_dense" in table
    assert "reads_back" in table.split("## host syncs by call site")[1]


def test_a_failing_batch_stops_the_profiler(tmp_path):
    profiler = BatchProfiler(tmp_path, first=0, count=3)
    with profiler.batch(0):
        torch.ones(2).sum()
    with pytest.raises(RuntimeError, match="boom"), profiler.batch(1):
        raise RuntimeError("boom")
    assert profiler._profile is None  # stopped, not left running
    profiler.close()
    assert json.loads((tmp_path / "calibrate_rank0.json").read_text())["wall_ms"] != []

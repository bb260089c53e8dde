"""modelopt_ext.profiling: the calibration loop's opt-in profiler writes per-rank tables for the chosen batches."""

import json

import pytest
import torch

from modelopt_ext.profiling import ENV_BATCHES, ENV_DIR, BatchProfiler


def test_profiles_only_the_chosen_batches(tmp_path):
    profiler = BatchProfiler(tmp_path, first=1, count=2, rank=3)
    a = torch.randn(64, 64)
    for i in range(5):
        with profiler.batch(i):
            (a @ a).sum()
    profiler.close()
    summary = json.loads((tmp_path / "calibrate_rank3.json").read_text())
    assert summary["batches"] == [1, 3] and len(summary["wall_ms"]) == 2
    assert all(ms > 0 for ms in summary["wall_ms"])
    table = (tmp_path / "calibrate_rank3.txt").read_text()
    assert "aten::mm" in table and "## by self_cpu_time_total" in table


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

"""The measurement scripts under scripts/ keep working on the CPU: bench_ep's CPU smoke run on 2 gloo ranks
(the GPU figures themselves come from the device runs in docs/performance.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_ep_cpu_smoke(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "scripts" / "bench_ep.py"), "--device", "cpu", "--hidden", "128", "--inter", "64",
           "--tokens", "32", "--reps", "1", "--warmup", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench_ep.json").read_text())
    run = result["runs"][0]
    assert run["tokens_per_rank"] == 32 and run["rows"] > 0
    assert run["layer_max_abs_diff"] <= 1e-2 * max(run["layer_ref_max_abs"], 1e-6)  # ours vs before, bf16
    for form in ("triton", "compile", "eager"):  # on the CPU every form is the fp32 reference
        assert run[f"glu_{form}_max_bf16_ulps"] <= 0.5


def _time_calls():
    spec = importlib.util.spec_from_file_location("time_calls", ROOT / "scripts" / "time_calls.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_time_calls_times_named_functions_and_refuses_unknown_ones(monkeypatch, tmp_path):
    from modelopt_ext.quant import data

    time_calls = _time_calls()
    monkeypatch.setattr(data, "default_texts", data.default_texts)  # restored after the test
    seen = []
    monkeypatch.setattr("modelopt_ext.cli.main", lambda argv: seen.append(data.default_texts()) or 0)
    out = tmp_path / "t.json"
    assert time_calls.main(["--json", str(out), "modelopt_ext.quant.data.default_texts", "--", "verify", "x"]) == 0
    assert seen and seen[0] == data.default_texts.__wrapped__()
    seconds, calls = json.loads(out.read_text())["modelopt_ext.quant.data.default_texts"]
    assert calls == 1 and seconds > 0
    with pytest.raises(SystemExit, match="does not resolve"):
        time_calls.main(["modelopt_ext.quant.data.no_such_function", "--", "verify", "x"])
    with pytest.raises(SystemExit, match="usage"):
        time_calls.main(["modelopt_ext.quant.data.default_texts"])
    with pytest.raises(SystemExit, match="is not BxS"):
        time_calls.main(["--warm-forward", "4by2048", "--", "verify", "x"])

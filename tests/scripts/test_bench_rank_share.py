"""scripts/bench_rank_share.py runs end to end on the CPU (--tiny) and writes the JSON the predictor reads; the
generator options it uses (text_overrides, workers) change no byte of the default stand-in."""

from __future__ import annotations

import filecmp
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modelopt_ext.models.kimi_k3.standin.generate import TinySizes, make_tiny

ROOT = Path(__file__).resolve().parents[2]

# key -> the keys each section must hold with a positive finite number
NUMBERS = {
    "calibrate": ("s_per_token", "forward_s_per_token", "roofline_share", "forward_roofline_share"),
    "experts": ("rows", "mxfp4_s", "dequant_s", "bf16_s", "mxfp4_over_bf16"),
    "memory": ("peak_bytes", "planned_bytes"),
    "export": ("bytes", "seconds", "bytes_per_s"),
    "disk": ("load_bytes", "load_bytes_per_s", "raw_read_bytes_per_s", "read_ratio", "write_bytes",
             "write_bytes_per_s", "raw_write_bytes_per_s", "write_ratio"),
}
LAYER = ("s_per_token", "flops_per_token", "roofline_share")


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_tiny_run_writes_every_figure(tmp_path):
    out = tmp_path / "rank_share.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_rank_share.py"), "--tiny", "--device", "cpu",
           "--batches", "2", "--plain-batches", "1", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["errors"] == {} and r["skipped"] == {}, (r["errors"], r["skipped"], proc.stdout[-4000:])
    assert r["tiny"] is True and isinstance(r["machine"], str) and isinstance(r["date"], str)
    assert r["versions"]["torch"] and r["versions"]["transformers"]
    w = r["widths"]
    assert (w["local_experts"], w["top_k_real"], w["vocab_size_real"]) == (14, 16, 163840)
    assert w["layers"] == ["dense_kda", "moe_kda", "moe_mla"]
    assert w["real_layer_counts"] == {"dense_kda": 1, "moe_kda": 68, "moe_mla": 24}  # Kimi-K3's 93 layers
    assert r["tokens_per_batch"] == 32 and r["batches"] == 2
    assert _positive(r["matmul_bf16_tflops"])
    for kind in ("dense_kda", "moe_kda", "moe_mla", "embed_head"):
        for key in LAYER:
            assert _positive(r["layers"][kind][key]), (kind, key, r["layers"][kind])
    for kind in ("moe_kda", "moe_mla"):  # 14 rows a token measured, scaled to 16
        layer = r["layers"][kind]
        assert layer["routed_rows_per_token_measured"] == 14 and layer["routed_rows_per_token_real"] == 16
        assert layer["s_per_token"] >= layer["measured_s_per_token"]
    assert r["experts"]["rows"] == 32 * 16
    for section, keys in NUMBERS.items():
        for key in keys:
            assert _positive(r[section][key]), (section, key, r[section])
    # wall - median forward x tokens: a difference of two timings, below zero within noise on a busy 2-core
    # machine with the tiny run's two batches (seen: -0.11 s)
    assert math.isfinite(r["calibrate"]["fixed_s"]) and r["calibrate"]["fixed_s"] < r["calibrate"]["wall_s"]
    assert isinstance(r["disk"]["cache_evicted"], bool)
    assert "Calibrate" in proc.stdout or "calibrate:" in proc.stdout  # the printed table


def test_generator_threads_and_overrides_keep_bytes(tmp_path):
    sizes = TinySizes(num_layers=3, hidden_size=64, latent_size=32, moe_intermediate_size=32, num_experts=4, top_k=2,
                      vocab_size=512)
    one = make_tiny(tmp_path / "one", seed=3, sizes=sizes)
    three = make_tiny(tmp_path / "three", seed=3, sizes=sizes, workers=3, text_overrides={})
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in three.iterdir())
    assert all(filecmp.cmp(one / n, three / n, shallow=False) for n in names if (one / n).is_file())
    overrides = {"num_shared_experts": 2, "q_lora_rank": 256, "linear_attn_config": {"num_heads": 3}}
    wide = make_tiny(tmp_path / "wide", seed=3, sizes=sizes, workers=2, text_overrides=overrides)
    text = json.loads((wide / "config.json").read_text())["text_config"]
    assert (text["num_shared_experts"], text["q_lora_rank"], text["linear_attn_config"]["num_heads"]) == (2, 256, 3)
    assert text["linear_attn_config"]["full_attn_layers"] == [3]  # the layer schedule is kept
    for bad in ({"hidden_size": 128}, {"q_lora_rank": 0}, {"linear_attn_config": {"kda_layers": [1]}}):
        with pytest.raises(ValueError, match="text_overrides"):
            make_tiny(tmp_path / "bad", sizes=sizes, text_overrides=bad)
    assert not (tmp_path / "bad").exists()

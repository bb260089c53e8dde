"""Job prediction (modelopt_ext.predict): formulas against values worked out by hand from a fixture measurement,
failed sections reported unavailable, the `plan --predict` CLI."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from modelopt_ext import families
from modelopt_ext import predict as P
from modelopt_ext.cli import main
from modelopt_ext.families import PredictionSpec, family_for_config
from modelopt_ext.models.kimi_k3.sizes import BUNDLED_CONFIG
from modelopt_ext.plan import resolve_distribution_plan

GIB, GB = 2**30, 10**9
H200 = 139 * GIB
# Round figures, so that every prediction below can be worked out by hand.
MEASUREMENT = {
    "machine": "fixture", "date": "2026-01-01", "matmul_bf16_tflops": 750.0, "tokens_per_batch": 4096,
    "widths": {"layers": ["dense_kda", "moe_kda", "moe_mla"],
               "real_layer_counts": {"dense_kda": 1, "moe_kda": 68, "moe_mla": 24}},
    "layers": {
        "dense_kda": {"s_per_token": 1e-4, "flops_per_token": 1.0, "roofline_share": 0.5},
        "moe_kda": {"s_per_token": 2e-4, "flops_per_token": 1.0, "roofline_share": 0.5},
        "moe_mla": {"s_per_token": 3e-4, "flops_per_token": 1.0, "roofline_share": 0.5},
        "embed_head": {"s_per_token": 5e-5, "flops_per_token": 1.0, "roofline_share": 0.5},
    },
    "calibrate": {"s_per_token": 1e-3, "forward_s_per_token": 9e-4, "roofline_share": 0.4, "fixed_s": 7.0,
                  "batches": 8, "parts_s": {"convert": 0.2, "first_batch": 1.5, "forward": 7.0, "finish": 0.05,
                                            "sync": 0.05, "coverage": 0.0}},
    "experts": {},
    "memory": {"peak_bytes": 33 * GB, "planned_bytes": 30 * GB},
    "export": {"bytes": 10 * GB, "seconds": 5.0, "bytes_per_s": 2 * GB},
    "disk": {"load_bytes_per_s": 4 * GB, "raw_read_bytes_per_s": 5 * GB, "read_ratio": 0.8,
             "write_bytes_per_s": 2 * GB, "raw_write_bytes_per_s": 3 * GB, "write_ratio": 0.67},
}
# Calibrate's fixed cost, by hand: per-module parts (convert + finish + sync + coverage = 0.3 s) x 93 real / 3
# measured decoder layers = 9.3 s, + first-call excess: first batch 1.5 s - a steady batch (7.0 s / 7) = 0.5 s.
FIXED = 0.3 * 93 / 3 + (1.5 - 7.0 / 7)  # 9.8 s
# The public Kimi-K3 config, by hand: top-16 of 896 experts, latent width 3584, expert width 3072, 92 MoE layers
# (layer 0 dense), layers 4, 8, ..., 92, 93 (1-based) MLA, the other 69 KDA (layer 0 among them).
TOP_K, LATENT, INTER, EXPERTS, MOE_LAYERS = 16, 3584, 3072, 896, 92
# Stub dense export: 5 GB outside the layers (rank 0), 1 GB per layer file.
DENSE = {"outside_layers": 5 * GB, "layers": (1 * GB,) * 93}


@pytest.fixture(scope="module")
def kimi():
    return json.loads(BUNDLED_CONFIG.read_text())


@pytest.fixture(scope="module")
def family(kimi):
    real = family_for_config(kimi)
    return dataclasses.replace(real, prediction=dataclasses.replace(
        real.prediction, measurement=None, dense_export_bytes=lambda config, recipe: DENSE))


def _plan(kimi, nproc):
    return resolve_distribution_plan(kimi, nproc, device_memory_bytes=H200)


def _expert_bytes(ep):
    per_rank = EXPERTS // ep * MOE_LAYERS * 3 * INTER * LATENT  # parameters of this rank's experts
    return per_rank / 2 + per_rank / 16 + EXPERTS // ep * MOE_LAYERS * 3 * 2 * 4


def test_formulas_by_hand_at_64(kimi, family):
    plan = _plan(kimi, 64)
    pred = P.predict_job(kimi, plan, MEASUREMENT, calib_tokens=262_144, interconnect_gbps=50, nvlink_gbps=276,
                         gpus_per_node=8, family=family)
    T = 262_144 / 64  # 4096 tokens per rank
    assert pred.load.value == pytest.approx(plan.estimate.read_bytes / 4e9)
    compute = T * (1 * 1e-4 + 68 * 2e-4 + 24 * 3e-4 + 1 * 5e-5)
    assert pred.calibration_compute.value == pytest.approx(compute)  # 85.81 s
    V = T * 2 * TOP_K * LATENT * 2  # dispatch + combine bytes of one MoE layer and rank
    a2a = MOE_LAYERS * max(V * 56 / 64 / 50e9, V * 7 / 64 / 276e9)
    assert pred.all_to_all.value == pytest.approx(a2a)
    assert pred.all_to_all.value == pytest.approx(1.5126, rel=1e-4)
    assert pred.calibrate_fixed.value == pytest.approx(FIXED) == pytest.approx(9.8)
    assert pred.calibration.value == pytest.approx(compute + a2a + 9.8)
    # rank 0 writes the 5 GB outside the layers and layer 63's file (64 % 64 == 0): the most bytes
    exported = _expert_bytes(64) + 5 * GB + 1 * GB
    assert _expert_bytes(64) == 23_930_370_240
    assert pred.export.value == pytest.approx(exported / 2e9)
    assert pred.total.value == pytest.approx(pred.load.value + compute + a2a + 9.8 + exported / 2e9)
    assert pred.peak_memory.value == pytest.approx(plan.estimate.total_bytes * 1.1)
    assert pred.tokens_per_rank == 4096


def test_all_to_all_inside_one_nvlink_domain_is_nvlink_only(kimi, family):
    pred = P.predict_job(kimi, _plan(kimi, 64), MEASUREMENT, calib_tokens=64 * 1000, interconnect_gbps=1,
                         nvlink_gbps=200, gpus_per_node=72, family=family)
    V = 1000 * 2 * TOP_K * LATENT * 2
    assert pred.all_to_all.value == pytest.approx(MOE_LAYERS * V * 63 / 64 / 200e9)
    assert "1 node(s) of 72" in pred.lines()[0]


def test_all_to_all_at_128_gpus(kimi, family):
    pred = P.predict_job(kimi, _plan(kimi, 128), MEASUREMENT, calib_tokens=128 * 512, interconnect_gbps=25,
                         nvlink_gbps=300, family=family)
    V = 512 * 2 * TOP_K * LATENT * 2
    assert pred.all_to_all.value == pytest.approx(MOE_LAYERS * V * 120 / 128 / 25e9)
    # 7 experts per rank; rank 0: outside + layer 127 (none: 93 layers) -> 5 GB; rank 1..93: one layer each
    assert pred.export.value == pytest.approx((_expert_bytes(128) + 5 * GB) / 2e9)


def test_dense_export_by_rank_follows_the_export_file_plan():
    from modelopt_ext.export.files import ExportFiles

    files = ExportFiles(layers="x", num_layers=5, moe_layers=(1, 2, 3, 4), experts_suffix="e", num_experts=4,
                        experts_per_file=1)
    dense = {"outside_layers": 1000, "layers": (1, 10, 100, 10_000, 100_000)}
    by_rank = P.dense_export_by_rank(dense, 3)
    expected = [0, 0, 0]
    expected[files.dense_writer(None, 3)] += 1000
    for i, b in enumerate(dense["layers"]):
        expected[files.dense_writer(i, 3)] += b
    assert by_rank == expected == [1000 + 100, 1 + 10_000, 10 + 100_000]


def test_failed_sections_are_reported_unavailable(kimi, family):
    m = copy.deepcopy(MEASUREMENT)
    m["disk"] = {"error": "dd failed: no space"}
    m["layers"]["moe_mla"] = {"error": "OOM"}
    del m["memory"]["planned_bytes"]
    pred = P.predict_job(kimi, _plan(kimi, 64), m, family=family)
    assert pred.load.value is None and "section disk failed: dd failed: no space" in pred.load.source
    assert pred.calibration_compute.value is None and "layers.moe_mla failed: OOM" in pred.calibration_compute.source
    assert pred.calibration.value is None and "calibration compute" in pred.calibration.source
    assert pred.all_to_all.available and pred.calibrate_fixed.value == pytest.approx(9.8) and pred.export.available
    assert pred.total.value is None and "load, calibration" in pred.total.source
    assert pred.peak_memory.value == _plan(kimi, 64).estimate.total_bytes
    assert "memory.planned_bytes" in pred.peak_memory.source
    text = "\n".join(pred.lines())
    assert "unavailable" in text


def test_calibrate_fixed_first_call_excess_is_not_negative(kimi, family):
    m = copy.deepcopy(MEASUREMENT)
    m["calibrate"]["parts_s"]["first_batch"] = 0.5  # faster than a steady batch (1.0 s): no excess
    m["widths"]["layers"] = ["dense_kda", "moe_kda", "moe_mla", "moe_mla"]  # 4 measured layers
    pred = P.predict_job(kimi, _plan(kimi, 64), m, family=family)
    assert pred.calibrate_fixed.value == pytest.approx(0.3 * 93 / 4)
    assert "x 93/4 layers + first-call excess 0.00 s" in pred.calibrate_fixed.formula


@pytest.mark.parametrize("change, why", [
    (lambda m: m["calibrate"].pop("parts_s"), "measurement lacks calibrate.parts_s"),
    (lambda m: m["calibrate"]["parts_s"].pop("sync"), "measurement lacks calibrate.parts_s.sync"),
    (lambda m: m.update(widths={}), "measurement lacks widths.layers"),
    (lambda m: m["widths"].pop("real_layer_counts"), "measurement lacks widths.real_layer_counts"),
    (lambda m: m["calibrate"].update(batches=1), "calibrate.batches = 1"),
])
def test_calibrate_fixed_falls_back_to_fixed_s_unscaled(kimi, family, change, why):
    m = copy.deepcopy(MEASUREMENT)
    change(m)
    pred = P.predict_job(kimi, _plan(kimi, 64), m, family=family)
    assert pred.calibrate_fixed.value == 7.0
    source = pred.calibrate_fixed.source
    assert source.startswith("calibrate.fixed_s, unscaled: ") and why in source
    assert "not scaled" in pred.calibrate_fixed.formula
    assert pred.calibration.available


def test_calibrate_fixed_unavailable_without_parts_and_fixed_s(kimi, family):
    m = copy.deepcopy(MEASUREMENT)
    del m["calibrate"]["parts_s"], m["calibrate"]["fixed_s"]
    pred = P.predict_job(kimi, _plan(kimi, 64), m, family=family)
    assert pred.calibrate_fixed.value is None and pred.calibration.value is None
    assert "calibrate.fixed_s" in pred.calibrate_fixed.source and "calibrate.parts_s" in pred.calibrate_fixed.source


@pytest.mark.parametrize("value", [0, -1.0, "fast", None, True, float("nan")])
def test_unusable_rates_are_unavailable(kimi, family, value):
    m = copy.deepcopy(MEASUREMENT)
    m["export"]["bytes_per_s"] = value
    pred = P.predict_job(kimi, _plan(kimi, 64), m, family=family)
    assert pred.export.value is None and "export.bytes_per_s" in pred.export.source


def test_the_durable_export_rate_is_preferred(kimi, family):
    """With `bytes_per_s_with_flush` measured (export + flush to disk), the export line uses it: half the rate,
    twice the seconds of the plain rate."""
    m = copy.deepcopy(MEASUREMENT)
    plain = P.predict_job(kimi, _plan(kimi, 64), m, family=family).export
    m["export"]["bytes_per_s_with_flush"] = m["export"]["bytes_per_s"] / 2
    durable = P.predict_job(kimi, _plan(kimi, 64), m, family=family).export
    assert durable.source == "export.bytes_per_s_with_flush" and plain.source == "export.bytes_per_s"
    assert durable.value == pytest.approx(2 * plain.value)


def test_no_measurement(kimi, family):
    pred = P.predict_job(kimi, _plan(kimi, 64), None, measurement_source="none here", family=family)
    assert pred.measurement == "none here"
    assert [line.name for line in pred.phases() if line.available] == ["all-to-all", "peak memory per GPU"]
    assert pred.load.source == "unavailable: no measurement"


def test_refusals(kimi, family):
    plan = resolve_distribution_plan(kimi, 64, ep_size=32, device_memory_bytes=H200)
    with pytest.raises(ValueError, match="EP 32 on 64 ranks"):
        P.predict_job(kimi, plan, MEASUREMENT, family=family)
    with pytest.raises(ValueError, match=r"interconnect_gbps \(0\)"):
        P.predict_job(kimi, _plan(kimi, 64), MEASUREMENT, interconnect_gbps=0, family=family)


def test_module_names_no_family_and_imports_no_torch():
    source = Path(P.__file__).read_text()
    assert "kimi" not in source.lower()
    assert "import torch" not in source


def test_load_measurement_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.json"):
        P.load_measurement(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        P.load_measurement(tmp_path / "bad.json")


# CLI


@pytest.fixture()
def fixture_file(tmp_path):
    path = tmp_path / "rank_share.json"
    path.write_text(json.dumps(MEASUREMENT))
    return path


def test_cli_predict_lines_name_their_source(fixture_file, capsys):
    argv = ["plan", "--model", "kimi-k3", "--nproc", "64", "--device-memory-gib", "139", "--predict",
            "--measurement", str(fixture_file)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = {line.split(":")[0].strip(): line for line in out.splitlines()}
    assert "predicted job: 64 GPUs (8 node(s) of 8), EP 64, 262144 calibration tokens" in out
    assert "GB/s (gigabytes/s)" in out
    assert f"measurement: {fixture_file} (machine fixture, date 2026-01-01)" in out
    assert "[disk.load_bytes_per_s]" in lines["load"]
    assert "layers.{dense_kda,moe_kda,moe_mla,embed_head}.s_per_token" in lines["calibration compute"]
    assert "85.8 s" in lines["calibration compute"]
    assert "1.5 s" in lines["all-to-all"] and "--interconnect-gbps" in lines["all-to-all"]
    assert "9.8 s" in lines["calibrate fixed"]
    assert ("(convert 0.200 + finish 0.050 + sync 0.050 + coverage 0.000 s) x 93/3 layers + first-call excess "
            "0.50 s (first batch 1.500 - forward 7.000 / 7)") in lines["calibrate fixed"]
    assert "[calibrate.parts_s, calibrate.batches, widths.layers, widths.real_layer_counts]" in lines["calibrate fixed"]
    assert "[export.bytes_per_s]" in lines["export"]
    assert "memory.peak_bytes / memory.planned_bytes" in lines["peak memory per GPU"]
    assert "unavailable" not in out


def test_cli_json_has_the_phases(fixture_file, capsys):
    argv = ["plan", "--model", "kimi-k3", "--nproc", "64", "--device-memory-gib", "139", "--json",
            "--measurement", str(fixture_file), "--calib-tokens", "1048576", "--interconnect-gbps", "25"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    pred = data["prediction"]
    assert data["ep_size"] == 64 and pred["calib_tokens"] == 1_048_576 and pred["interconnect_gbps"] == 25
    for phase in ("load", "calibration_compute", "all_to_all", "calibrate_fixed", "calibration", "export", "total",
                  "peak_memory"):
        assert pred[phase]["value"] > 0 and pred[phase]["source"], phase
    assert pred["calibration_compute"]["value"] == pytest.approx(16384 * 0.02095)


def test_cli_without_prediction_options_prints_no_prediction(capsys):
    assert main(["plan", "--model", "kimi-k3", "--nproc", "64", "--device-memory-gib", "139", "--json"]) == 0
    assert "prediction" not in json.loads(capsys.readouterr().out)


def test_cli_says_no_measurement_bundled(kimi, tmp_path, monkeypatch, capsys):
    real = family_for_config(kimi)
    absent = dataclasses.replace(real, prediction=dataclasses.replace(real.prediction,
                                                                       measurement=tmp_path / "absent.json"))
    for model_type in real.model_types:
        monkeypatch.setitem(families._FAMILIES, model_type, absent)
    assert main(["plan", "--model", "kimi-k3", "--nproc", "64", "--device-memory-gib", "139", "--predict"]) == 0
    out = capsys.readouterr().out
    assert f"no measurement bundled (expected at {tmp_path / 'absent.json'}); pass --measurement PATH" in out
    assert "all-to-all" in out and "load:" in out


def test_cli_missing_measurement_file_exits_2(tmp_path, capsys):
    argv = ["plan", "--model", "kimi-k3", "--nproc", "64", "--device-memory-gib", "139",
            "--measurement", str(tmp_path / "nope.json")]
    assert main(argv) == 2
    assert "nope.json does not exist" in capsys.readouterr().err


def test_family_spec_points_at_its_measurement(kimi):
    spec = family_for_config(kimi).prediction
    assert isinstance(spec, PredictionSpec)
    assert spec.measurement.parent == BUNDLED_CONFIG.parent and spec.measurement.name == "rank_share_h200.json"

"""ModelOpt's conversion of an EP model: quantizers exist for this rank's experts only, their weight amax is
that expert's (global id = rank * local + i), and the model still dispatches after ModelOpt replaced the
experts' class and forward."""

import json

import pytest
from safetensors import safe_open

from modelopt_ext.formats.mxfp4 import dequantize_mxfp4
from modelopt_ext.testing.multiproc import run_ranks


def _expert_amax(ckpt, layer, expert, proj):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    stems = ["w1", "w3"] if proj == "gate_up" else ["w2"]
    amax = 0.0
    for stem in stems:
        key = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{stem}.weight_"
        with safe_open(str(ckpt / index[key + "packed"]), "pt") as f:
            w = dequantize_mxfp4(f.get_tensor(key + "packed"), f.get_tensor(key + "scale"))
        amax = max(amax, float(w.float().abs().max()))
    return amax


@pytest.mark.parametrize("dense", [
    "replicate",
    # ModelOpt's FSDP2 weight-access context re-wraps every parameter as a grad-requiring nn.Parameter, which
    # the uint8 MXFP4 expert tensors cannot be: EP calibration with FSDP-sharded dense layers is the
    # calibration issue's work.
    pytest.param("fsdp", marks=pytest.mark.xfail(strict=True, reason="raw mtq.quantize: ModelOpt FSDP2 weight access re-wraps uint8 params; modelopt_ext calibrate() avoids it")),
])
def test_fp8_calibration_under_ep_keeps_experts_apart(tiny_ckpt, dense):
    results = run_ranks("modelopt_ext.testing.ep_bodies:ep_modelopt_fp8", 2, {"ckpt": str(tiny_ckpt), "dense": dense},
                        timeout_s=300)
    for rank, r in enumerate(results):
        assert r["finite"]
        for layer, q in r["amax"].items():
            assert q["class"].startswith("Quant")
            assert len(q["gate_up"]) == len(q["down"]) == r["local"] == 8
            for i in range(r["local"]):
                expert = rank * r["local"] + i
                assert q["gate_up"][i] == pytest.approx(_expert_amax(tiny_ckpt, layer, expert, "gate_up"))
                assert q["down"][i] == pytest.approx(_expert_amax(tiny_ckpt, layer, expert, "down"))

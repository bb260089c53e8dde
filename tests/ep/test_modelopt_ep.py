"""ModelOpt's conversion of an EP model: quantizers exist for this rank's experts only, their weight amax is
that expert's (global id = rank * local + i), and the model still dispatches after ModelOpt replaced the
experts' class and forward."""

import json

import pytest
import torch
from safetensors import safe_open

import modelopt_ext
from modelopt_ext.formats.mxfp4 import dequantize_mxfp4
from modelopt_ext.testing.multiproc import run_ranks

# ---- per-rank bodies (run on every rank by run_ranks) ----------------------------------------------------------------


def ep_modelopt_fp8(rank: int, world_size: int, ckpt: str, dense: str):
    """ModelOpt FP8 calibration of the EP model: per-expert weight amax of this rank's experts, and a forward
    after conversion (ModelOpt replaces the experts' class and instance forward)."""
    import modelopt.torch.quantization as mtq

    model = modelopt_ext.from_pretrained(ckpt, ep_size=world_size, dense=dense, trust_remote_code=True,
                                         dtype=torch.float32)
    ids = torch.randint(13, 500, (2, 16), generator=torch.Generator().manual_seed(rank))

    def loop(m):
        with torch.no_grad():
            m(input_ids=ids, use_cache=False)

    model = mtq.quantize(model, mtq.FP8_DEFAULT_CFG, loop)
    amax = {}
    for i, layer in enumerate(model.language_model.model.layers):
        block = getattr(layer, "block_sparse_moe", None)
        if block is None:
            continue
        experts = block.experts
        amax[i] = {
            "class": type(experts).__name__,
            "gate_up": [float(q.amax) for q in experts.gate_up_proj_weight_quantizers],
            "down": [float(q.amax) for q in experts.down_proj_weight_quantizers],
        }
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    return {"amax": amax, "finite": bool(torch.isfinite(logits).all()), "local": experts.num_experts}


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
    results = run_ranks(ep_modelopt_fp8, 2, {"ckpt": str(tiny_ckpt), "dense": dense}, timeout_s=300)
    for rank, r in enumerate(results):
        assert r["finite"]
        for layer, q in r["amax"].items():
            assert q["class"].startswith("Quant")
            assert len(q["gate_up"]) == len(q["down"]) == r["local"] == 8
            for i in range(r["local"]):
                expert = rank * r["local"] + i
                assert q["gate_up"][i] == pytest.approx(_expert_amax(tiny_ckpt, layer, expert, "gate_up"))
                assert q["down"][i] == pytest.approx(_expert_amax(tiny_ckpt, layer, expert, "down"))

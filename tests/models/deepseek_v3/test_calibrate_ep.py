"""Calibration of the DeepSeek-V3 stand-in under expert parallelism (2 gloo ranks) against one process: every
quantizer's amax and the expert coverage counts.

The family's MoE block is transformers' own (`DeepseekV3MoE` calls `self.experts(...)` with global expert ids), so
this runs the generic pieces `quant.calibrate.calibrate` adds under EP: the dispatching forward put back after
ModelOpt's conversion (`ep.backend.restore_ep_forwards`), the experts' sharded parameters presented to ModelOpt as
the rank's local tensors (`ep.sharding.local_expert_params`: per-expert weight quantizers indexed locally), and the
router's expert ids read where `FamilySpec.router_output` says (`DeepseekV3TopkRouter` returns (logits, weights, ids)),
and the all-experts policy, which rewrites that output.

Each rank calibrates on its own batch; the one-process reference calibrates the same model on both ranks' batches.
Rank r's local expert i is global expert r * E_local + i. Equality, fp32: bit for bit for every per-expert weight
quantizer and for every quantizer up to and including the first MoE layer (layer 1: its experts' shared input
quantizers included, whose rows come from both ranks); within REL_AFTER_MOE after it (see there).
"""

from __future__ import annotations

import re

import pytest
import torch

import modelopt_ext
from modelopt_ext.testing.multiproc import run_ranks

WORLD = 2
NUM_EXPERTS = 16
FIRST_MOE_LAYER = 1
# After the first MoE layer the activations differ by fp32 rounding: a token's MoE output is the sum of its K=4 weighted
# expert outputs, which the EP combine adds in top-k slot order (`ep.dispatch.weighted_sum`) and the one-process eager
# experts forward (ModelOpt forces the eager one) in expert-id order (`index_add_`); the router's top-k ids are not
# sorted, so the orders differ. Measured: at most 3.1e-7 relative (2-3 ulps of the amax) on the stand-in.
REL_AFTER_MOE = 2e-6


def batches_of(rank: int) -> list[dict[str, torch.Tensor]]:
    """Rank `rank`'s calibration batches (the one-process reference runs every rank's)."""
    g = torch.Generator().manual_seed(500 + rank)
    return [{"input_ids": torch.randint(2, 500, (2, 12), generator=g)} for _ in range(2)]


def _amax_by_name(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    from modelopt.torch.quantization.nn import TensorQuantizer

    return {n: (None if getattr(q, "_amax", None) is None else q._amax.detach().clone())
            for n, q in model.named_modules() if isinstance(q, TensorQuantizer) and q.is_enabled}


def _calibrate(model, batches, uncovered="weights"):
    import modelopt.torch.quantization as mtq

    from modelopt_ext.families import families
    from modelopt_ext.quant.calibrate import calibrate

    spec = families()["deepseek_v3"]
    return calibrate(model, mtq.FP8_DEFAULT_CFG, batches, router_glob=spec.router_glob, num_experts=NUM_EXPERTS,
                     router_output=spec.router_output, uncovered=uncovered)


# ---- per-rank body (run on every rank by run_ranks) ------------------------------------------------------------------


def ep_calibration(rank: int, world_size: int, ckpt: str, uncovered: str = "weights"):
    """calibrate() on the EP model with this rank's batches: amax by quantizer name, coverage, local expert count."""
    model = modelopt_ext.from_pretrained(ckpt, ep_size=world_size, dtype=torch.float32,
                                         experts_implementation="batched_mm")
    result = _calibrate(model, batches_of(rank), uncovered)
    experts = result.model.model.layers[1].mlp.experts
    return {"amax": _amax_by_name(result.model), "coverage": result.coverage.table(), "sync": result.sync,
            "local_experts": experts.num_experts, "quantized_class": type(experts).__name__,
            "dispatching": experts.__dict__.get("forward") is experts.__dict__.get("_modelopt_ext_ep_forward")}


# ---- test ------------------------------------------------------------------------------------------------------------


def _global_name(name: str, rank: int, local_experts: int) -> str:
    """Rank `rank`'s per-expert quantizer name -> the one-process model's (global expert index)."""
    m = re.fullmatch(r"(.*\.experts\.\w+_weight_quantizers)\.(\d+)", name)
    return name if m is None else f"{m[1]}.{rank * local_experts + int(m[2])}"


def _ep_and_one_process(ckpt, uncovered: str):
    ep = run_ranks(ep_calibration, WORLD, {"ckpt": str(ckpt), "uncovered": uncovered}, timeout_s=300)
    single = modelopt_ext.from_pretrained(ckpt, dtype=torch.float32, experts_implementation="batched_mm")
    ref = _calibrate(single, [b for rank in range(WORLD) for b in batches_of(rank)], uncovered)
    return ep, {"amax": _amax_by_name(ref.model), "coverage": ref.coverage.table()}


@pytest.fixture(scope="module")
def calibrated(ds_tiny):
    return _ep_and_one_process(ds_tiny, "weights")


def test_ep_amax_equals_one_process(calibrated):
    _assert_amax_parity(*calibrated)


def _assert_amax_parity(ep, ref):
    seen, kinds = set(), {"expert weights": 0, "exact": 0, "after the first MoE layer": 0}
    worst = 0.0
    for rank, r in enumerate(ep):
        assert r["local_experts"] == NUM_EXPERTS // WORLD and r["dispatching"], r
        assert r["quantized_class"].startswith("Quant"), r["quantized_class"]  # ModelOpt converted the experts
        assert r["sync"]["uncalibrated"] == []
        for name, amax in r["amax"].items():
            global_name = _global_name(name, rank, r["local_experts"])
            assert global_name in ref["amax"], name
            want = ref["amax"][global_name]
            assert amax is not None and want is not None, name
            seen.add(global_name)
            layer = re.match(r"model\.layers\.(\d+)\.", name)
            if "_weight_quantizers." in name:
                kinds["expert weights"] += 1
                assert torch.equal(amax, want), (rank, name, amax, want)
            elif layer is not None and int(layer[1]) <= FIRST_MOE_LAYER:
                kinds["exact"] += 1
                assert torch.equal(amax, want), (rank, name, amax, want)
            else:
                kinds["after the first MoE layer"] += 1
                worst = max(worst, ((amax - want).abs() / want.abs()).max().item())
                torch.testing.assert_close(amax, want, rtol=REL_AFTER_MOE, atol=0, msg=f"rank {rank}: {name}")
    assert seen == set(ref["amax"])  # every one-process quantizer, each expert's on the rank holding it
    assert kinds["expert weights"] == 3 * NUM_EXPERTS * 2  # 3 MoE layers x 16 experts x 2 projections, over the ranks
    assert {"model.layers.1.mlp.experts.gate_up_proj_input_quantizer",
            "model.layers.1.mlp.experts.down_proj_input_quantizer"} <= seen
    print(f"amax parity: {kinds}; worst relative difference after the first MoE layer {worst:.3g}")


def test_ep_coverage_equals_one_process(calibrated):
    ep, ref = calibrated
    assert len(ref["coverage"]) == 3 and all(sum(row) == 2 * 2 * 12 * WORLD * 4 for row in ref["coverage"].values())
    for r in ep:
        assert r["coverage"] == ref["coverage"]


def test_all_experts_routing_sends_every_token_to_every_expert_under_ep(ds_tiny):
    """`--uncovered-experts all-experts` on a router that returns (logits, weights, ids): ids and weights replaced,
    the logits kept; every expert of every MoE layer counts every token, and EP matches one process."""
    ep, ref = _ep_and_one_process(ds_tiny, "all-experts")
    tokens = 2 * 2 * 12 * WORLD
    assert len(ref["coverage"]) == 3 and all(row == [tokens] * NUM_EXPERTS for row in ref["coverage"].values())
    assert all(r["coverage"] == ref["coverage"] for r in ep)
    _assert_amax_parity(ep, ref)

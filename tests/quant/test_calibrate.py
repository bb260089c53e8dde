"""calibrate(): coverage, amax sync and the uncovered-experts policies, on 2 gloo ranks and in one process."""

import pytest
import torch

import modelopt_ext
from modelopt_ext.families import families
from modelopt_ext.quant.calibrate import all_experts_routing, calibrate
from modelopt_ext.testing.checkpoints import copy_checkpoint
from modelopt_ext.testing.multiproc import run_ranks

BODY = "modelopt_ext.testing.ep_bodies:ep_calibrate_policy"
SPEC = families()["kimi_k3"]


def test_weights_policy_records_uncovered_experts(tiny_ckpt):
    results = run_ranks(BODY, 2, {"ckpt": str(tiny_ckpt), "uncovered": "weights"}, timeout_s=300)
    for r in results:
        assert "error" not in r, r
        assert len(r["uncovered"]) == 5 and all(v == list(range(4, 16)) for v in r["uncovered"].values())
        assert r["sync"]["shared"] > 0
    assert results[0]["down_input_amax"] == results[1]["down_input_amax"]  # in step after the sync


@pytest.mark.parametrize("uncovered", ["weights", "all-experts"])
def test_policies_through_the_pipeline(tiny_ckpt, uncovered):
    """Max calibration through the overlapped EP pipeline (forced on the CPU) with routing forced to rank 0's
    experts (rank 1's experts receive no rows: `weights`) or to every expert (`all-experts`): the same
    coverage and down-projection input amax as the dispatch/combine path."""
    usual = run_ranks(BODY, 2, {"ckpt": str(tiny_ckpt), "uncovered": uncovered}, timeout_s=300)
    piped = run_ranks(BODY, 2, {"ckpt": str(tiny_ckpt), "uncovered": uncovered, "grouped_statistics": "always"},
                      timeout_s=300)
    for u, p in zip(usual, piped):
        assert "error" not in p, p
        assert u["pipelined_calls"] == 0 and p["pipelined_calls"] == 10, p  # 5 MoE layers x 2 chunks
        assert p["uncovered"] == u["uncovered"]
        assert p["down_input_amax"] == pytest.approx(u["down_input_amax"], rel=1e-5)


def test_fail_policy_fails_every_rank(tiny_ckpt):
    results = run_ranks(BODY, 2, {"ckpt": str(tiny_ckpt), "uncovered": "fail"}, timeout_s=300)
    for r in results:
        assert r["error"].startswith("UncoveredExperts: experts without calibration tokens")
        assert "layers.1.block_sparse_moe.gate: [4, 5" in r["error"]


def test_all_experts_policy_covers_every_expert(tiny_ckpt):
    results = run_ranks(BODY, 2, {"ckpt": str(tiny_ckpt), "uncovered": "all-experts"}, timeout_s=300)
    for r in results:
        assert "error" not in r, r
        assert r["uncovered"] == {}


def test_all_experts_routing_keeps_outputs(tiny_ckpt, tmp_path):
    ckpt = copy_checkpoint(tiny_ckpt, tmp_path, "all_experts_routing")
    model = modelopt_ext.from_pretrained(ckpt, trust_remote_code=True, dtype=torch.float32,
                                         experts_implementation="batched_mm")
    ids = torch.randint(13, 500, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        with all_experts_routing(model, SPEC.router_glob, 16):
            out = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_unknown_policy(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match="policy 'sometimes' is not one of"):
        calibrate(torch.nn.Linear(2, 2), {}, [], router_glob="x", num_experts=1, uncovered="sometimes")


def test_parent_class_rules_are_spelt_out_per_module():
    """ModelOpt's parent_class rules do not match FSDP-wrapped modules; calibrate adds the same rule by name
    after each, for the model's leaf modules of that class."""
    from modelopt_ext.quant.calibrate import name_parent_class_rules

    model = torch.nn.Sequential(torch.nn.Embedding(4, 8), torch.nn.Linear(8, 8))
    cfg = [{"quantizer_name": "*", "cfg": {"num_bits": 8}},
           {"parent_class": "nn.Embedding", "quantizer_name": "*", "enable": False},
           {"parent_class": "SomethingCustom", "quantizer_name": "*", "enable": False}]
    out = name_parent_class_rules(cfg, model)
    assert out[:2] == cfg[:2] and out[3] == cfg[2]
    assert out[2] == {"parent_class": None, "quantizer_name": "0.*", "enable": False}

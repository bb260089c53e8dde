"""Amax after EP calibration + sync_amax equals one process calibrated on all ranks' batches."""

import logging

import pytest
import torch

import modelopt_ext
from modelopt_ext.testing.multiproc import run_ranks
from modelopt_ext.testing.routing import force_routing

# ---- per-rank bodies (run on every rank by run_ranks) ----------------------------------------------------------------


def ep_calibrate_and_sync(rank: int, world_size: int, ckpt: str, dense: str = "replicate",
                          force_experts: list[int] | None = None):
    """FP8 max calibration under EP with modelopt_ext's amax sync, and one process calibrated on every
    rank's batch: the amax the two end with, by quantizer name (per-expert ones by global expert id)."""
    import copy

    import modelopt.torch.quantization as mtq

    from modelopt_ext.quant.sync import calibration_algorithm, sync_amax

    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    cfg["algorithm"] = calibration_algorithm("max")
    kwargs = {"trust_remote_code": True, "dtype": torch.float32, "experts_implementation": "batched_mm"}
    batches = [torch.randint(13, 500, (2, 16), generator=torch.Generator().manual_seed(200 + r))
               for r in range(world_size)]

    def run(model, which):
        if force_experts is not None:
            force_routing(model, force_experts)

        def loop(m):
            with torch.no_grad():
                for ids in which:
                    m(input_ids=ids, use_cache=False)
        return mtq.quantize(model, cfg, loop)

    def amax_by_name(model, local_offset):
        out = {}
        for name, q in model.named_modules():
            if type(q).__name__ == "TensorQuantizer" and q.amax is not None:
                if "_weight_quantizers." in name:
                    head, _, idx = name.rpartition(".")
                    name = f"{head}.{int(idx) + local_offset}"
                out[name] = q.amax.detach().clone()
        return out

    model = run(modelopt_ext.from_pretrained(ckpt, ep_size=world_size, dense=dense, **kwargs), [batches[rank]])
    report = sync_amax(model)
    local = model.language_model.model.layers[1].block_sparse_moe.experts.num_experts
    ep = amax_by_name(model, rank * local)
    single = run(modelopt_ext.from_pretrained(ckpt, **kwargs), batches)
    return {"ep": ep, "ref": amax_by_name(single, 0), "report": report}


def test_ep_amax_equals_single_process_on_all_batches(tiny_ckpt):
    results = run_ranks(ep_calibrate_and_sync, 2, {"ckpt": str(tiny_ckpt)}, timeout_s=300)
    for rank, r in enumerate(results):
        ep, ref = r["ep"], r["ref"]
        assert r["report"]["local_experts"] > 0 and r["report"]["shared"] > 0
        shared = [n for n in ep if "_weight_quantizers." not in n]
        assert shared, "no shared quantizers calibrated"
        for name in shared:  # dense layers and the experts' shared input quantizers: max over every rank's data
            assert name in ref, name
            torch.testing.assert_close(ep[name], ref[name], rtol=1e-5, atol=0, msg=name)
        experts = [n for n in ep if "_weight_quantizers." in n]
        assert len(experts) == 5 * 2 * 8  # 5 MoE layers x (gate_up, down) x 8 local experts
        for name in experts:  # this rank's experts, by global id, never mixed with the other rank's
            assert torch.equal(ep[name], ref[name]), name
    # every rank ends with the same shared amax
    for name in results[0]["ep"]:
        if "_weight_quantizers." not in name:
            assert torch.equal(results[0]["ep"][name], results[1]["ep"][name]), name


def test_ranks_whose_experts_saw_no_tokens_stay_in_step(tiny_ckpt):
    """All tokens to rank 0's experts 0..3: rank 1's expert input quantizers calibrate nothing (amax None
    there); the sync still runs in step and gives both ranks rank 0's value."""
    results = run_ranks(ep_calibrate_and_sync, 2,
                        {"ckpt": str(tiny_ckpt), "force_experts": [0, 1, 2, 3]}, timeout_s=300)
    inputs = [n for n in results[0]["ep"] if ".block_sparse_moe.experts." in n and "input_quantizer" in n]
    assert len(inputs) == 5 * 2
    for r in results:
        for name in inputs:
            torch.testing.assert_close(r["ep"][name], r["ref"][name], rtol=1e-5, atol=0, msg=name)


def test_calibration_algorithm_turns_modelopt_sync_off():
    from modelopt_ext.quant.sync import calibration_algorithm

    assert calibration_algorithm("max") == {"method": "max", "distributed_sync": False}
    assert calibration_algorithm({"method": "mse", "distributed_sync": True}) == {"method": "mse",
                                                                                  "distributed_sync": False}


def _quantizers(enabled_with_amax: int, enabled_without: int, disabled: int) -> torch.nn.Module:
    from modelopt.torch.quantization.nn import TensorQuantizer

    model = torch.nn.Module()
    for i in range(enabled_with_amax):
        q = TensorQuantizer()
        q.amax = torch.tensor(1.0 + i)
        model.add_module(f"calibrated_{i}", q)
    for i in range(enabled_without):
        model.add_module(f"uncalibrated_{i}", TensorQuantizer())
    for i in range(disabled):
        q = TensorQuantizer()
        q.disable()
        model.add_module(f"disabled_{i}", q)
    return model


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_disabled_quantizers_are_not_reported_as_uncalibrated(one_rank, caplog):
    from modelopt_ext.quant.sync import sync_amax

    with caplog.at_level(logging.DEBUG, logger="modelopt_ext.quant.sync"):
        report = sync_amax(_quantizers(enabled_with_amax=2, enabled_without=0, disabled=3))
    assert report["uncalibrated"] == []
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert caplog.records[0].getMessage() == "3 disabled quantizer(s) have no amax (expected)"


def test_enabled_uncalibrated_quantizers_are_named_in_a_warning(one_rank, caplog):
    from modelopt_ext.quant.sync import sync_amax

    with caplog.at_level(logging.INFO, logger="modelopt_ext.quant.sync"):
        report = sync_amax(_quantizers(enabled_with_amax=1, enabled_without=7, disabled=3))
    assert report["uncalibrated"] == [f"uncalibrated_{i}" for i in range(7)]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert warnings[0].getMessage() == (
        "7 enabled quantizer(s) were calibrated on no rank (amax stays None): uncalibrated_0, uncalibrated_1, "
        "uncalibrated_2, uncalibrated_3, uncalibrated_4 and 2 more")


def test_calibration_algorithm_refuses_what_it_cannot_run():
    from modelopt_ext.quant.sync import calibration_algorithm

    with pytest.raises(ValueError, match=r"^calibration algorithm: quantize.algorithm: unknown calibration algorithm "
                                         r"'maxx'; valid: local_hessian, max, mse \(ModelOpt "):
        calibration_algorithm("maxx")
    with pytest.raises(ValueError, match=r"'gptq' cannot run in modelopt_ext's calibration.*GPTQCalibConfig has no "
                                         r"distributed_sync"):
        calibration_algorithm({"method": "gptq"})

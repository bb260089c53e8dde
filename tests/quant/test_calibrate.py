"""calibrate(): coverage, amax sync and the uncovered-experts policies, on 2 gloo ranks and in one process."""

import copy
from pathlib import Path

import pytest
import torch

import modelopt_ext
from modelopt_ext.families import families
from modelopt_ext.quant.calibrate import all_experts_routing, calibrate
from modelopt_ext.testing.checkpoints import copy_checkpoint
from modelopt_ext.testing.multiproc import import_file, run_ranks
from modelopt_ext.testing.routing import force_routing

# helpers of the export tests' per-rank bodies (tests/export/bodies.py)
_export_bodies = import_file(Path(__file__).parents[1] / "export" / "bodies.py")
calibration_batches, counting_pipelined_calls, verify_on_rank_0 = (
    _export_bodies.calibration_batches, _export_bodies.counting_pipelined_calls, _export_bodies.verify_on_rank_0)

SPEC = families()["kimi_k3"]


# ---- per-rank bodies (run on every rank by run_ranks) ----------------------------------------------------------------


def ep_calibrate_policy(rank: int, world_size: int, ckpt: str, uncovered: str, grouped_statistics: str = "cuda"):
    """calibrate() on EP2 with routing forced to rank 0's experts 0..3, under an uncovered-experts policy;
    `grouped_statistics="always"` takes the overlapped pipeline on the CPU (rank 1 then receives no rows)."""
    import modelopt.torch.quantization as mtq

    from modelopt_ext.families import families
    from modelopt_ext.options import ExpertsOptions
    from modelopt_ext.quant.calibrate import calibrate

    spec = families()["kimi_k3"]
    model = modelopt_ext.from_pretrained(ckpt, ep_size=world_size, dense="replicate", trust_remote_code=True,
                                         dtype=torch.float32, experts_implementation="batched_mm",
                                         experts_options=ExpertsOptions(grouped_statistics=grouped_statistics))
    force_routing(model, [0, 1, 2, 3])
    batches = [{"input_ids": torch.randint(13, 500, (2, 12), generator=torch.Generator().manual_seed(400 + rank))}]
    try:
        with counting_pipelined_calls() as counts:
            result = calibrate(model, mtq.FP8_DEFAULT_CFG, batches, router_glob=spec.router_glob, num_experts=16,
                               uncovered=uncovered)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    experts = result.model.language_model.model.layers[1].block_sparse_moe.experts
    return {"uncovered": result.coverage.uncovered(), "sync": result.sync, "pipelined_calls": counts["pipelined"],
            "down_input_amax": float(experts.down_proj_input_quantizer.amax)}


def test_weights_policy_records_uncovered_experts(tiny_ckpt):
    results = run_ranks(ep_calibrate_policy, 2, {"ckpt": str(tiny_ckpt), "uncovered": "weights"}, timeout_s=300)
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
    usual = run_ranks(ep_calibrate_policy, 2, {"ckpt": str(tiny_ckpt), "uncovered": uncovered}, timeout_s=300)
    piped = run_ranks(ep_calibrate_policy, 2,
                      {"ckpt": str(tiny_ckpt), "uncovered": uncovered, "grouped_statistics": "always"}, timeout_s=300)
    for u, p in zip(usual, piped):
        assert "error" not in p, p
        assert u["pipelined_calls"] == 0 and p["pipelined_calls"] == 10, p  # 5 MoE layers x 2 chunks
        assert p["uncovered"] == u["uncovered"]
        assert p["down_input_amax"] == pytest.approx(u["down_input_amax"], rel=1e-5)


def test_fail_policy_fails_every_rank(tiny_ckpt):
    results = run_ranks(ep_calibrate_policy, 2, {"ckpt": str(tiny_ckpt), "uncovered": "fail"}, timeout_s=300)
    for r in results:
        assert r["error"].startswith("UncoveredExperts: experts without calibration tokens")
        assert "layers.1.block_sparse_moe.gate: [4, 5" in r["error"]


def test_all_experts_policy_covers_every_expert(tiny_ckpt):
    results = run_ranks(ep_calibrate_policy, 2, {"ckpt": str(tiny_ckpt), "uncovered": "all-experts"}, timeout_s=300)
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


# ------------------------------------------------------------------ weight searches (quant/search.py)

NO_LAYERWISE = {"layerwise": {"enable": False}}


# ---- per-rank bodies (run on every rank by run_ranks) ----------------------------------------------------------------


def calibrate_algorithm_and_export(rank: int, world_size: int, ckpt: str, out: str, recipe: str,
                                   algorithm: dict | str, dense: str = "replicate", batches: int = 4):
    """Load (EP over the world when it has more than one rank), calibrate `recipe` with `algorithm` in place of
    its own on this rank's share of `batches` fixed batches (tests/export/bodies.py's `calibration_batches`),
    export to `out`. Returns every quantizer's amax by name (per-expert ones by global expert id) as fp32, and the sync
    report."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    from modelopt_ext.export.writer import export_checkpoint
    from modelopt_ext.families import families
    from modelopt_ext.quant.calibrate import calibrate
    from modelopt_ext.quant.recipes import quant_config

    kwargs = {"trust_remote_code": True, "dtype": torch.float32}
    if world_size > 1:
        kwargs.update(ep_size=world_size, dense=dense)
    model = modelopt_ext.from_pretrained(ckpt, **kwargs)
    cfg = dict(quant_config(recipe, model.config))
    cfg["algorithm"] = algorithm
    result = calibrate(model, cfg, calibration_batches(rank, world_size, batches),
                       router_glob=families()["kimi_k3"].router_glob, num_experts=16)
    amax = {}
    for name, q in result.model.named_modules():
        if isinstance(q, TensorQuantizer) and getattr(q, "_amax", None) is not None:
            if "_weight_quantizers." in name:
                head, _, idx = name.rpartition(".")
                local = result.model.get_submodule(head.rpartition(".")[0]).num_experts
                name = f"{head}.{int(idx) + rank * local}"
            amax[name] = q._amax.detach().float().clone()
    export_checkpoint(result.model, out, source_dir=ckpt, overwrite=True)
    verify_on_rank_0(rank, out, ckpt)
    return {"amax": amax, "sync": result.sync}


@pytest.mark.parametrize("recipe, algorithm", [
    ("kimi_k3/nvfp4_experts-fp8_attention", {"method": "mse"}),
    ("kimi_k3/fp8_all", {"method": "mse"}),
    # fp8_scale_sweep (local_hessian's default) searches NVFP4-static weights only, none here: sweep off
    ("kimi_k3/fp8_all", {"method": "local_hessian", "fp8_scale_sweep": False}),
])
def test_weight_search_under_ep2_matches_one_process(tiny_ckpt, tmp_path, recipe, algorithm):
    """Every quantizer's amax (fp32) and the export, byte for byte: before quant/search.py, local_hessian's
    per-rank Hessians gave amax up to 0.77 apart on the stand-in."""
    src = copy_checkpoint(tiny_ckpt, tmp_path, "search_src")
    kwargs = {"ckpt": str(src), "recipe": recipe, "algorithm": {**algorithm, **NO_LAYERWISE}}
    one = run_ranks(calibrate_algorithm_and_export, 1, {**kwargs, "out": str(tmp_path / "ep1")}, timeout_s=300)[0]
    two = run_ranks(calibrate_algorithm_and_export, 2, {**kwargs, "out": str(tmp_path / "ep2")}, timeout_s=300)
    assert two[0]["sync"]["search"]["method"] == algorithm["method"]
    if algorithm["method"] == "local_hessian":
        assert two[0]["sync"]["search"]["hessians_reduced"] > 0
    merged = {}
    for r in two:
        for name, amax in r["amax"].items():
            if name in merged:  # shared quantizers: the ranks agree bitwise
                assert torch.equal(merged[name], amax), name
            merged[name] = amax
    assert sorted(merged) == sorted(one["amax"])
    differing = [n for n, a in one["amax"].items() if not torch.equal(a, merged[n])]
    assert not differing, differing[:5]
    files = {p.name: p.read_bytes() for p in (tmp_path / "ep1").iterdir()}
    assert files == {p.name: p.read_bytes() for p in (tmp_path / "ep2").iterdir()}


def test_mse_weight_error_is_at_most_max(tiny_ckpt, tmp_path):
    """The FP8 128x128-block weight-only modules of the production recipe: MSE's searched weight amax gives a
    relative Frobenius error (fake-quantized vs source) no larger than max's, module by module, and lower in
    total; the routed experts' weight amax are left at max (their export is the exact MXFP4 cast)."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    from modelopt_ext.quant.recipes import quant_config

    src = copy_checkpoint(tiny_ckpt, tmp_path, "mse_src")
    errors, experts = {}, {}
    for method in ("max", "mse"):
        model = modelopt_ext.from_pretrained(str(src), trust_remote_code=True, dtype=torch.float32)
        cfg = dict(quant_config("kimi_k3/nvfp4_experts-fp8_attention", model.config))
        cfg["algorithm"] = {"method": method, **NO_LAYERWISE}
        model = calibrate(model, cfg, calibration_batches(0, 1, 2), router_glob=families()["kimi_k3"].router_glob,
                          num_experts=16).model
        errors[method], experts[method] = {}, {}
        with torch.no_grad():
            for name, m in model.named_modules():
                q = getattr(m, "weight_quantizer", None)
                if isinstance(q, TensorQuantizer) and q.is_enabled:
                    w = m.weight.float()
                    errors[method][name] = float((q(w) - w).norm() / w.norm())
                if "_weight_quantizers." in name and isinstance(m, TensorQuantizer):
                    experts[method][name] = m.amax.clone()
    assert len(errors["max"]) == 40
    assert all(errors["mse"][n] <= errors["max"][n] for n in errors["max"])
    assert sum(errors["mse"].values()) < sum(errors["max"].values())
    assert all(torch.equal(experts["max"][n], a) for n, a in experts["mse"].items())


def test_histogram_calibrator_is_refused_before_calibration(tiny_ckpt, tmp_path):
    from modelopt_ext.quant.recipes import load, quant_config

    """A quant config built in Python (not through `recipes.load`, which refuses it too) is checked again."""
    model = modelopt_ext.from_pretrained(str(copy_checkpoint(tiny_ckpt, tmp_path, "hist_src")), trust_remote_code=True,
                                         dtype=torch.float32)
    cfg = copy.deepcopy(dict(quant_config(load("kimi_k3/fp8_all"), model.config)))
    index = next(i for i, e in enumerate(cfg["quant_cfg"]) if e.get("quantizer_name") == "*input_quantizer")
    cfg["quant_cfg"][index]["cfg"]["calibrator"] = "histogram"
    with pytest.raises(ValueError, match=rf"quant config quantize.quant_cfg\[{index}\]: quantizer_name "
                       r"'\*input_quantizer': cfg.calibrator is 'histogram'; modelopt_ext calibrates with ModelOpt's "
                       r"max calibrator only"):
        calibrate(model, cfg, [], router_glob=families()["kimi_k3"].router_glob, num_experts=16)


def test_replicas_are_refused_before_anything_is_converted():
    """A model loaded with an EP degree below the world size (through the library, not ptq) is refused by
    `calibrate` itself, naming the degree and the world, before ModelOpt converts anything."""
    from modelopt_ext.models.kimi_k3.sizes import BUNDLED_CONFIG
    from modelopt_ext.plan import resolve_distribution_plan

    config = __import__("json").loads(BUNDLED_CONFIG.read_text())
    model = torch.nn.Linear(4, 4)
    model.modelopt_ext_plan = resolve_distribution_plan(config, 128, ep_size=64, dense="fsdp",
                                                        device_memory_bytes=10**15)
    with pytest.raises(ValueError, match=r"^calibrate: EP degree 64 on 128 ranks \(2 replicas of every expert\)"):
        calibrate(model, {"quant_cfg": [], "algorithm": "max"}, [], router_glob="*.gate", num_experts=896)
    assert type(model.weight) is torch.nn.Parameter and not any(True for _ in model.children())

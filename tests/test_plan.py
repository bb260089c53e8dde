"""Distribution plans (modelopt_ext.plan): refusals with their numbers, automatic choice, estimates, kwargs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelopt_ext import plan as P
from modelopt_ext.families import FamilySpec
from modelopt_ext.models.kimi_k3.sizes import BUNDLED_CONFIG
from modelopt_ext.plan import DistributionPlan, estimate_memory, read_model_config, resolve_distribution_plan

GIB = 2**30

# Round figures, so that every estimate below can be checked by hand.
SIZES = {
    "num_experts": 16, "num_moe_layers": 4, "num_layers": 5, "hidden_size": 64, "latent_size": 32,
    "expert_intermediate_size": 48, "top_k": 2, "vocab_size": 1000, "expert_params": 16_000_000,
    "expert_bytes": 8_000_000, "dense_params": 1_000_000, "dense_bytes": 2_000_000,
    "largest_dense_unit_bytes": 100_000, "live_hidden_states": 3,
}
MXFP4_CONFIG = {"model_type": "fake", "quantization_config": {"format": "mxfp4-pack-quantized"}}


def _family(sizes=SIZES, name="fake") -> FamilySpec:
    return FamilySpec(
        name=name, model_types=("fake",), text_model_type=None, revision="0" * 40,
        remote_code_lock=Path("/nonexistent/lock.json"), min_versions={}, ep_plan={},
        quantizer_exclusions=lambda config: (), converters=lambda storage: [], prepare=lambda path, **kw: None,
        sizes=(lambda config: sizes) if sizes is not None else None,
    )


def _plan(world=4, memory=10 * GIB, config=MXFP4_CONFIG, sizes=SIZES, **kw) -> DistributionPlan:
    return resolve_distribution_plan(config, world, family=_family(sizes), device_memory_bytes=memory,
                                     tokens_per_rank=kw.pop("tokens_per_rank", 100), **kw)


@pytest.fixture(scope="module")
def kimi() -> dict:
    return json.loads(BUNDLED_CONFIG.read_text())


# ----------------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(world=0), r"world_size \(0\) must be at least 1"),
        (dict(world=1), "EP degree 1 on the EP path"),
        (dict(world=4, ep_size=1), "EP degree 1 on the EP path"),
        (dict(world=8, ep_size=3), r"world_size \(8\) is not divisible by the EP degree \(3\)"),
        (dict(world=8, sizes={**SIZES, "num_experts": 12}), r"num_experts \(12\) is not divisible by the EP degree \(8\)"),
        (dict(dense="tp"), "dense 'tp' is not one of replicate, fsdp"),
        (dict(world=8, ep_size=4, dense="replicate"), r"EP degree \(4\) to equal world_size \(8\).*multiple of tp_size"),
        (dict(tokens_per_rank=0), r"tokens_per_rank \(0\)"),
        (dict(memory=0), r"device memory \(0 bytes\)"),
        (dict(expert_storage="fp8"), "expert_storage 'fp8'"),
        (dict(config={"model_type": "fake"}, expert_storage="mxfp4"), "needs an MXFP4 checkpoint"),
        (dict(sizes={k: v for k, v in SIZES.items() if k != "top_k"}), r"lacks \['top_k'\]"),
        (dict(sizes=None), "family 'fake' does not provide sizes"),
    ],
    ids=["world-0", "world-1", "ep-1", "world-mod-ep", "experts-mod-ep", "bad-dense", "replicate-ep-lt-world",
         "tokens-0", "memory-0", "bad-storage", "mxfp4-on-bf16", "sizes-missing-key", "no-sizes"],
)
def test_refusals_name_their_numbers(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        _plan(**kwargs)


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="model_type 'no_such_model' has no modelopt_ext family"):
        resolve_distribution_plan({"model_type": "no_such_model"}, 8, device_memory_bytes=GIB)
    with pytest.raises(ValueError, match="unknown model family 'nope'"):
        resolve_distribution_plan({"model_type": "kimi_k3"}, 8, family="nope", device_memory_bytes=GIB)


def test_nothing_fits_names_bytes_needed_and_available():
    fsdp = estimate_memory(SIZES, 4, 4, "fsdp", "mxfp4", "mxfp4", 100)
    memory = int(fsdp.total_bytes / 0.9) - 10
    with pytest.raises(ValueError, match="parts that cannot be placed") as exc:
        _plan(memory=memory)
    msg = str(exc.value)
    assert f"{fsdp.total_bytes} bytes" in msg and f"{int(0.9 * memory)} bytes" in msg and "dense fsdp" in msg


def test_explicit_dense_that_does_not_fit_is_refused():
    rep = estimate_memory(SIZES, 4, 4, "replicate", "mxfp4", "mxfp4", 100)
    fsdp = estimate_memory(SIZES, 4, 4, "fsdp", "mxfp4", "mxfp4", 100)
    memory = int((rep.total_bytes + fsdp.total_bytes) / 2 / 0.9)
    with pytest.raises(ValueError, match=f"dense replicate.*{rep.total_bytes} bytes"):
        _plan(memory=memory, dense="replicate")
    assert _plan(memory=memory, dense="fsdp").dense == "fsdp"


# ----------------------------------------------------------------------------------------------------
# automatic choice


def test_automatic_choice_at_crafted_memory_sizes():
    rep = estimate_memory(SIZES, 4, 4, "replicate", "mxfp4", "mxfp4", 100)
    fsdp = estimate_memory(SIZES, 4, 4, "fsdp", "mxfp4", "mxfp4", 100)
    assert fsdp.total_bytes < rep.total_bytes
    fits = lambda est: int(est.total_bytes / 0.9) + 1  # noqa: E731
    assert _plan(memory=fits(rep)).dense == "replicate"
    between = _plan(memory=fits(fsdp))
    assert between.dense == "fsdp"
    assert "dense replicate needs" in between.reason
    with pytest.raises(ValueError, match="parts that cannot be placed"):
        _plan(memory=fits(fsdp) - 100)


def test_automatic_choice_with_ep_below_world_is_fsdp():
    plan = _plan(world=8, ep_size=4, memory=100 * GIB)
    assert plan.dense == "fsdp" and "replicate needs EP degree = world_size (4 != 8)" in plan.reason
    assert (plan.world_size, plan.ep_size, plan.dp_size, plan.experts_per_rank) == (8, 4, 8, 4)


# ----------------------------------------------------------------------------------------------------
# estimates


def test_estimates_scale_with_ep_and_world():
    for world in (2, 4, 8):
        rep = _plan(world=world, dense="replicate").estimate
        fsdp = _plan(world=world, dense="fsdp").estimate
        assert rep.expert_bytes == fsdp.expert_bytes == SIZES["expert_bytes"] // world
        assert rep.dense_bytes == SIZES["dense_bytes"]
        assert fsdp.dense_bytes == SIZES["dense_bytes"] // world + SIZES["largest_dense_unit_bytes"]
        assert rep.read_bytes == (SIZES["expert_bytes"] + world * SIZES["dense_bytes"]) // world
        assert fsdp.read_bytes == (SIZES["expert_bytes"] + SIZES["dense_bytes"]) // world
        assert fsdp.total_bytes == fsdp.expert_bytes + fsdp.dense_bytes + fsdp.activation_bytes


def test_estimate_with_expert_fsdp_and_bf16_experts():
    # ep < world: transformers shards each EP group's experts over world/ep ranks, one MoE layer gathered.
    est = _plan(world=8, ep_size=4).estimate
    assert est.expert_bytes == SIZES["expert_bytes"] // 8 + SIZES["expert_bytes"] // (4 * 4)
    assert est.read_bytes == SIZES["expert_bytes"] // 4 + SIZES["dense_bytes"] // 8
    bf16 = _plan(world=4, expert_storage="dense", memory=GIB)
    assert bf16.expert_storage == "dense"
    assert bf16.estimate.expert_bytes == 2 * SIZES["expert_params"] // 4
    assert bf16.estimate.read_bytes == _plan(world=4, memory=GIB).estimate.read_bytes  # reads what is stored


def test_activation_formula():
    T, k = 100, 2
    hidden = T * 64 * 2 * 3
    moe = 2 * T * k * 32 * 2 + T * k * 2 * 48 * 2
    logits = T * 1000 * 6
    assert _plan().estimate.activation_bytes == hidden + max(moe, logits)
    wide_moe = {**SIZES, "vocab_size": 10}
    assert _plan(sizes=wide_moe).estimate.activation_bytes == hidden + moe
    assert _plan(tokens_per_rank=400).estimate.activation_bytes == 4 * (hidden + max(moe, logits))


def test_storage_follows_the_checkpoint():
    assert _plan().expert_storage == "mxfp4"
    assert _plan(config={"model_type": "fake"}).expert_storage == "dense"


def test_default_device_memory(monkeypatch):
    import os

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert resolve_distribution_plan(MXFP4_CONFIG, 4, family=_family()).device_memory_bytes == ram
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 123 * GIB}))
    assert resolve_distribution_plan(MXFP4_CONFIG, 4, family=_family()).device_memory_bytes == 123 * GIB


def test_resolving_is_pure(monkeypatch):
    import torch.distributed as dist

    def forbidden(*args, **kwargs):
        raise AssertionError("resolve_distribution_plan touched torch.distributed")

    for name in ("init_process_group", "is_initialized", "get_rank", "get_world_size", "all_gather_object"):
        monkeypatch.setattr(dist, name, forbidden, raising=False)
    assert _plan().world_size == 4


# ----------------------------------------------------------------------------------------------------
# the plan object


def test_distributed_config_kwargs_for_both_modes():
    assert _plan(world=8, dense="fsdp").distributed_config_kwargs() == {
        "fsdp_size": 8, "ep_size": 8, "ep_implementation": "torch_a2a"}
    assert _plan(world=8, dense="replicate").distributed_config_kwargs() == {
        "tp_size": 8, "ep_size": 8, "ep_implementation": "torch_a2a"}
    assert _plan(world=8, ep_size=2, dense="fsdp").distributed_config_kwargs()["ep_size"] == 2


def test_replicas_are_planned_but_refused_for_calibration_and_export():
    """EP below the world size loads in transformers (the planner places it), but calibration and export assume
    distinct experts per rank: `check_calibration_supported` refuses it, naming the degree, the world and the fix."""
    plan = _plan(world=8, ep_size=2, dense="fsdp")
    assert plan.replicas == 4
    with pytest.raises(ValueError) as e:
        plan.check_calibration_supported("calibrate")
    assert str(e.value).startswith("calibrate: EP degree 2 on 8 ranks (4 replicas of every expert) is not supported")
    assert "use an EP degree equal to the world size (8), or run on 2 ranks" in str(e.value)
    assert "note: ptq: EP degree 2 on 8 ranks" in plan.summary()
    single = _plan(world=8, dense="fsdp")
    assert single.replicas == 1
    single.check_calibration_supported("calibrate")
    assert "note:" not in single.summary()


def test_kwargs_build_a_transformers_distributed_config():
    from transformers.distributed import DistributedConfig

    for dense in ("fsdp", "replicate"):
        kwargs = _plan(world=4, dense=dense).distributed_config_kwargs()
        config = DistributedConfig(**kwargs)
        assert config.ep_size == 4


def test_to_dict_json_round_trip():
    plan = _plan(world=8, ep_size=4)
    d = plan.to_dict()
    again = json.loads(json.dumps(d))
    assert again == d
    assert DistributionPlan.from_dict(again) == plan
    assert d["estimate"]["total_bytes"] == plan.estimate.total_bytes
    assert _plan(world=8).to_dict() != d  # ranks that disagree see it


def test_summary_is_a_table_in_gib():
    plan = _plan(memory=10 * GIB)
    text = plan.summary()
    for needle in ("fake on 4 ranks", "EP 4", "4 per rank", "GiB", "read from disk", "experts resident (mxfp4)",
                   "total resident", "10.0", "DistributedConfig(", "ep_implementation='torch_a2a'"):
        assert needle in text, needle


def test_read_model_config(tmp_path, kimi):
    config, source = read_model_config("kimi-k3")
    assert config == kimi and "kimi-k3" in source
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    assert read_model_config(tmp_path)[0] == {"model_type": "x"}
    with pytest.raises(FileNotFoundError, match="no-such-model.*bundled: kimi-k3"):
        read_model_config("no-such-model")


# ----------------------------------------------------------------------------------------------------
# the real model


def test_kimi_k3_at_ep64_on_h200(kimi):
    plan = resolve_distribution_plan(kimi, 64, device_memory_bytes=141 * GIB)
    assert (plan.family, plan.dense, plan.ep_size, plan.experts_per_rank) == ("kimi_k3", "fsdp", 64, 14)
    assert plan.expert_storage == "mxfp4"
    assert plan.estimate.expert_bytes == pytest.approx(1.5e12 / 64, rel=0.1)
    assert plan.estimate.dense_bytes < 6e9  # 114 GB / 64 plus one gathered unit
    assert plan.estimate.read_bytes == pytest.approx(1.56e12 / 64, rel=0.1)
    assert "dense replicate needs" in plan.reason  # 114 GB replicated does not fit beside the experts
    assert plan.distributed_config_kwargs() == {"fsdp_size": 64, "ep_size": 64, "ep_implementation": "torch_a2a"}


def test_kimi_k3_replicated_with_more_memory_and_refused_at_ep8(kimi):
    assert resolve_distribution_plan(kimi, 64, device_memory_bytes=256 * GIB).dense == "replicate"
    with pytest.raises(ValueError, match="parts that cannot be placed"):
        resolve_distribution_plan(kimi, 8, device_memory_bytes=141 * GIB)
    with pytest.raises(ValueError, match=r"num_experts \(896\) is not divisible by the EP degree \(12\)"):
        resolve_distribution_plan(kimi, 12, device_memory_bytes=141 * GIB)


def test_plan_module_names_no_family():
    source = Path(P.__file__).read_text().lower()
    assert "kimi" not in source


# ----------------------------------------------------------------------------------------------------
# FP8 (128x128-block) checkpoints: read as stored, held dequantized


FP8_CONFIG = {"model_type": "fake", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                             "weight_block_size": [128, 128]}}


def test_fp8_experts_are_held_dequantized_and_read_as_stored():
    assert P.checkpoint_expert_storage(FP8_CONFIG) == "fp8"
    assert P.checkpoint_expert_storage(MXFP4_CONFIG) == "mxfp4"
    assert P.checkpoint_expert_storage({"model_type": "fake"}) == "dense"
    plan = _plan(world=4, config=FP8_CONFIG, memory=GIB)
    assert plan.expert_storage == "dense"
    assert plan.estimate.expert_bytes == 2 * SIZES["expert_params"] // 4  # bf16 after loading
    assert plan.estimate.read_bytes == SIZES["expert_bytes"] // 4 + SIZES["dense_bytes"]  # FP8 + scales as stored
    assert plan.expert_total_bytes == SIZES["expert_bytes"]
    with pytest.raises(ValueError, match="expert_storage 'fp8' is not one of mxfp4, dense .*dequantized"):
        _plan(config=FP8_CONFIG, expert_storage="fp8")
    with pytest.raises(ValueError, match="needs an MXFP4 checkpoint; this one stores experts fp8"):
        _plan(config=FP8_CONFIG, expert_storage="mxfp4")


def test_loaded_dense_sizes_replace_the_stored_ones_in_the_resident_estimate():
    loaded = {**SIZES, "loaded_dense_bytes": 3_500_000, "loaded_largest_dense_unit_bytes": 170_000}
    rep = _plan(world=4, config=FP8_CONFIG, sizes=loaded, dense="replicate").estimate
    fsdp = _plan(world=4, config=FP8_CONFIG, sizes=loaded, dense="fsdp").estimate
    assert rep.dense_bytes == 3_500_000 and rep.read_bytes == SIZES["expert_bytes"] // 4 + SIZES["dense_bytes"]
    assert fsdp.dense_bytes == 3_500_000 // 4 + 170_000
    assert fsdp.read_bytes == (SIZES["expert_bytes"] + SIZES["dense_bytes"]) // 4
    # without them (every MXFP4 or bf16 family today) the stored bytes are the resident ones, as before
    assert _plan(world=4, dense="fsdp").estimate.dense_bytes == SIZES["dense_bytes"] // 4 + 100_000

"""Plans for transformers built from a model (`select_ep_plan`, `replicate_tp_plan`), replacing replicated
DTensor parameters by local tensors, and counting the checkpoint bytes read through transformers' safe_open.

The plan tests build the stand-in on the meta device from a copy of the checkpoint (its own remote-code
module, patched by the adapter's `apply_patches` as loading does before building the model)."""

import fnmatch

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

from modelopt_ext.ep.sharding import (
    count_checkpoint_reads,
    localize_replicated_params,
    replicate_tp_plan,
    select_ep_plan,
    wildcard_names,
)
from modelopt_ext.models.kimi_k3.pinned import EP_PLAN, EXPERTS_GLOB

PACKED = {f"{EXPERTS_GLOB}.{n}" for n in ("gate_up_proj_packed", "gate_up_proj_scale", "down_proj_packed",
                                           "down_proj_scale")}
DENSE = {f"{EXPERTS_GLOB}.{n}" for n in ("gate_up_proj", "down_proj")}


@pytest.fixture(scope="module")
def meta_models(tiny_ckpt, tmp_path_factory):
    """{"mxfp4": model, "dense": model} built on the meta device from a patched copy of the stand-in."""
    from modelopt_ext.models.kimi_k3.adapter import prepare
    from modelopt_ext.models.kimi_k3.cache import KimiHybridCache
    from modelopt_ext.models.kimi_k3.patch import apply_patches, expert_storage
    from modelopt_ext.testing.checkpoints import copy_checkpoint

    copy = copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("plans"), "ep_sharding_plans")
    prepared = prepare(copy, trust_remote_code=True)
    apply_patches(prepared.text_module, prepared.mm_module, KimiHybridCache)
    config = prepared.model_class.config_class.from_pretrained(str(copy))
    del config.quantization_config
    models = {}
    for storage in ("mxfp4", "dense"):
        with torch.device("meta"), expert_storage(storage):
            models[storage] = prepared.model_class(config)
    return models


# ---- select_ep_plan ----------------------------------------------------------------------------------------


def test_select_ep_plan_keeps_the_packed_rules_for_mxfp4_experts(meta_models):
    selected = select_ep_plan(EP_PLAN, meta_models["mxfp4"])
    assert selected == {EXPERTS_GLOB: "ep_dispatch_experts", **dict.fromkeys(PACKED, "grouped_gemm")}


def test_select_ep_plan_keeps_the_dense_rules_for_dense_experts(meta_models):
    selected = select_ep_plan(EP_PLAN, meta_models["dense"])
    assert selected == {EXPERTS_GLOB: "ep_dispatch_experts", **dict.fromkeys(DENSE, "grouped_gemm")}


def test_select_ep_plan_rules_name_modules_and_params_of_the_model(meta_models):
    for model in meta_models.values():
        modules, params = wildcard_names(model)
        selected = select_ep_plan({**EP_PLAN, "language_model.model.layers.*.mlp.experts": "ep_dispatch_experts",
                                   "nothing.*.weight": "grouped_gemm"}, model)
        for name, style in selected.items():
            assert name in (modules if style == "ep_dispatch_experts" else params), name
        assert "nothing.*.weight" not in selected
        assert "language_model.model.layers.*.mlp.experts" not in selected


@pytest.mark.parametrize("plan", [
    {"language_model.model.layers.*.moe.experts": "ep_dispatch_experts",
     f"{EXPERTS_GLOB}.gate_up_proj_packed": "grouped_gemm"},
    {f"{EXPERTS_GLOB}.gate_up_proj_packed": "grouped_gemm", f"{EXPERTS_GLOB}.down_proj_packed": "grouped_gemm"},
    {},
    {EXPERTS_GLOB: "ep_dispatch_experts", f"{EXPERTS_GLOB}.gate_up_proj": "grouped_gemm"},
], ids=["dispatch-rule-names-no-module", "no-dispatch-rule", "empty", "no-tensor-rule-for-packed-experts"])
def test_select_ep_plan_refuses_a_plan_without_an_applicable_dispatch_rule(meta_models, plan):
    with pytest.raises(ValueError, match="ep_dispatch_experts") as info:
        select_ep_plan(plan, meta_models["mxfp4"])
    assert str(sorted(plan)) in str(info.value)


# ---- replicate_tp_plan -------------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", ["mxfp4", "dense"])
def test_replicate_tp_plan_covers_every_parameter_owner_outside_the_experts(meta_models, storage):
    model = meta_models[storage]
    ep_plan = select_ep_plan(EP_PLAN, model)
    tp_plan = replicate_tp_plan(model, ep_plan)
    owners = {replace_layer_number_by_wildcard(n).rpartition(".")[0] for n, _ in model.named_parameters()}
    expert_owners = {o for o in owners if o == EXPERTS_GLOB or o.startswith(EXPERTS_GLOB + ".")}
    assert expert_owners == {EXPERTS_GLOB}  # fused experts: the experts module owns its tensors itself
    assert set(tp_plan.values()) == {"replicate"}
    assert set(tp_plan) | expert_owners == owners
    assert not any(k == EXPERTS_GLOB or k.startswith(EXPERTS_GLOB + ".") for k in tp_plan)
    modules, _ = wildcard_names(model)
    assert set(tp_plan) <= modules
    # the experts' neighbours stay in the plan: router, latent projections, shared experts
    for name in ("gate", "routed_expert_down_proj", "routed_expert_up_proj", "shared_experts.up_proj"):
        assert f"language_model.model.layers.*.block_sparse_moe.{name}" in tp_plan
    assert "language_model.model.embed_tokens" in tp_plan and "language_model.lm_head" in tp_plan


def test_replicate_tp_plan_skips_whatever_the_ep_plan_dispatches(meta_models):
    """Only the EP plan's dispatch modules are left out: without the experts rule they would be replicated."""
    model = meta_models["mxfp4"]
    shared = "language_model.model.layers.*.block_sparse_moe.shared_experts"
    tp_plan = replicate_tp_plan(model, {**select_ep_plan(EP_PLAN, model), shared: "ep_dispatch_experts"})
    assert not any(k.startswith(shared) for k in tp_plan)
    assert EXPERTS_GLOB not in tp_plan
    assert EXPERTS_GLOB in replicate_tp_plan(model, {})


# ---- localize_replicated_params ----------------------------------------------------------------------------


def _dtensor_param(mesh, placements, requires_grad=True, seed=0):
    from torch.distributed.tensor import DTensor

    local = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
    return nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False), requires_grad=requires_grad)


def test_localize_replaces_only_fully_replicated_dtensors(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (1,))
    mesh2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    model = nn.Module()
    model.rep = nn.Linear(3, 4)
    model.rep.weight = _dtensor_param(mesh, [Replicate()], seed=1)
    model.frozen = nn.Linear(3, 4, bias=False)
    model.frozen.weight = _dtensor_param(mesh, [Replicate()], requires_grad=False, seed=2)
    model.rep2d = nn.Linear(3, 4, bias=False)
    model.rep2d.weight = _dtensor_param(mesh2, [Replicate(), Replicate()], seed=3)
    model.shard = nn.Linear(3, 4, bias=False)
    model.shard.weight = _dtensor_param(mesh, [Shard(0)], seed=4)
    model.mixed = nn.Linear(3, 4, bias=False)
    model.mixed.weight = _dtensor_param(mesh2, [Replicate(), Shard(0)], seed=5)
    model.partial = nn.Linear(3, 4, bias=False)
    model.partial.weight = _dtensor_param(mesh, [Partial()], seed=6)
    plain_bias = model.rep.bias
    before = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}

    assert localize_replicated_params(model) == 3

    for name in ("rep", "frozen", "rep2d"):
        w = getattr(model, name).weight
        assert type(w) is nn.Parameter and not isinstance(w.data, DTensor), name
        assert torch.equal(w.detach(), before[f"{name}.weight"])
    assert model.rep.weight.requires_grad and not model.frozen.weight.requires_grad
    assert model.rep.bias is plain_bias
    for name in ("shard", "mixed", "partial"):
        assert isinstance(getattr(model, name).weight, DTensor), name
    assert localize_replicated_params(model) == 0  # nothing replicated left
    x = torch.randn(2, 3)
    assert torch.equal(model.rep(x), torch.nn.functional.linear(x, before["rep.weight"], before["rep.bias"]))


def test_localize_keeps_a_shared_parameter_shared(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    mesh = init_device_mesh("cpu", (1,))
    model = nn.Module()
    model.embed, model.head = nn.Linear(3, 4, bias=False), nn.Linear(3, 4, bias=False)
    model.embed.weight = model.head.weight = _dtensor_param(mesh, [Replicate()])
    count = localize_replicated_params(model)
    assert model.embed.weight is model.head.weight
    assert count == 1


# ---- count_checkpoint_reads --------------------------------------------------------------------------------


@pytest.fixture
def small_file(tmp_path):
    tensors = {
        "model.layers.0.experts.w": torch.arange(64, dtype=torch.float32).reshape(8, 8),
        "model.layers.1.experts.w": torch.zeros(4, 4, dtype=torch.bfloat16),
        "model.layers.0.attn.q": torch.ones(3, 5, dtype=torch.float32),
        "model.norm": torch.ones(7, dtype=torch.bfloat16),
    }
    path = tmp_path / "small.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def test_count_checkpoint_reads_counts_bytes_by_group(small_file):
    import transformers.modeling_utils as mu

    path, tensors = small_file
    original = mu.safe_open
    with count_checkpoint_reads(["model.layers.*.experts.*"]) as counter:
        assert mu.safe_open is not original
        with mu.safe_open(str(path), framework="pt") as f:
            assert sorted(f.keys()) == sorted(tensors)  # other methods pass through
            for key in tensors:
                assert torch.equal(f.get_tensor(key), tensors[key])
    assert mu.safe_open is original
    assert counter.by_group == {"experts": 8 * 8 * 4 + 4 * 4 * 2, "dense": 3 * 5 * 4 + 7 * 2}
    assert counter.total == sum(t.numel() * t.element_size() for t in tensors.values())


def test_count_checkpoint_reads_counts_only_the_sliced_bytes(small_file):
    import transformers.modeling_utils as mu

    path, tensors = small_file
    with count_checkpoint_reads(["*.experts.*"]) as counter:
        with mu.safe_open(str(path), framework="pt") as f:
            sl = f.get_slice("model.layers.0.experts.w")
            assert sl.get_shape() == [8, 8]
            assert counter.total == 0  # opening a slice reads nothing
            rows = sl[2:5]
            assert torch.equal(rows, tensors["model.layers.0.experts.w"][2:5])
            assert counter.by_group == {"experts": 3 * 8 * 4}
            f.get_slice("model.layers.0.attn.q")[:, 1:2]
    assert counter.by_group == {"experts": 3 * 8 * 4, "dense": 3 * 1 * 4}


def test_count_checkpoint_reads_restores_safe_open_after_an_error(small_file):
    import transformers.modeling_utils as mu

    original = mu.safe_open
    with pytest.raises(KeyError, match="no such tensor"):
        with count_checkpoint_reads(["*"]) as counter:
            with mu.safe_open(str(small_file[0]), framework="pt") as f:
                f.get_tensor("model.norm")
            raise KeyError("no such tensor")
    assert mu.safe_open is original
    assert counter.by_group == {"experts": 7 * 2}  # "*" puts every key in the experts group


def test_count_checkpoint_reads_groups_by_fnmatch_of_the_key(small_file):
    import transformers.modeling_utils as mu

    path, tensors = small_file
    glob = "model.layers.0.*"
    with count_checkpoint_reads([glob]) as counter:
        with mu.safe_open(str(path), framework="pt") as f:
            for key in tensors:
                f.get_tensor(key)
    expected = {"experts": 0, "dense": 0}
    for key, t in tensors.items():
        expected["experts" if fnmatch.fnmatchcase(key, glob) else "dense"] += t.numel() * t.element_size()
    assert counter.by_group == expected

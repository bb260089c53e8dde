"""modelopt_ext.models.kimi_k3.pinned: the revision, lock, version floors and EP plan the Kimi-K3 family pins."""

import fnmatch
import json
import re
import types
from pathlib import Path

import pytest
from packaging.version import Version

from modelopt_ext.models.kimi_k3 import pinned
from modelopt_ext.models.kimi_k3.experts import KimiK3Experts, KimiK3PackedExperts
from modelopt_ext.versions import check_min_versions

SMALL = types.SimpleNamespace(num_experts=2, routed_expert_hidden_size=32, moe_intermediate_size=32,
                              activation_situ_beta=1.0, activation_situ_linear_beta=1.0)


def test_the_bundled_lock_sits_beside_the_module_and_records_the_pinned_revision():
    assert re.fullmatch(r"[0-9a-f]{40}", pinned.REVISION)
    assert pinned.LOCK_FILE.parent == Path(pinned.__file__).parent
    assert json.loads(pinned.LOCK_FILE.read_text())["revision"] == pinned.REVISION


def test_version_floors_parse_and_this_environment_meets_them():
    for floor in pinned.MIN_VERSIONS.values():
        Version(floor)  # raises InvalidVersion on a malformed floor
    check_min_versions(pinned.MIN_VERSIONS, optional=frozenset({"fla-core"}))  # as the adapter checks them


@pytest.mark.parametrize("name, matches", [
    ("language_model.model.layers.0.block_sparse_moe.experts", True),
    ("language_model.model.layers.27.block_sparse_moe.experts", True),
    ("language_model.model.layers.3.block_sparse_moe.shared_experts", False),
    ("language_model.model.layers.3.block_sparse_moe.gate", False),
    ("model.layers.3.block_sparse_moe.experts", False),
])
def test_the_experts_glob_names_each_layers_routed_experts_only(name, matches):
    assert pinned.EXPERTS_GLOB.startswith(pinned.LAYERS)
    assert fnmatch.fnmatchcase(name, pinned.EXPERTS_GLOB) is matches


def test_the_ep_plan_dispatches_the_experts_and_shards_every_expert_parameter_of_both_storages():
    dispatch = [glob for glob, style in pinned.EP_PLAN.items() if style == "ep_dispatch_experts"]
    assert dispatch == [pinned.EXPERTS_GLOB]
    sharded = {glob for glob, style in pinned.EP_PLAN.items() if style == "grouped_gemm"}
    assert len(sharded) == len(pinned.EP_PLAN) - 1  # nothing but dispatch and grouped_gemm rules
    # the parameters of the dense and the MXFP4-packed experts (built small here), one rule each
    params = {name for cls in (KimiK3Experts, KimiK3PackedExperts) for name, _ in cls(SMALL).named_parameters()}
    assert params == {"gate_up_proj", "down_proj", "gate_up_proj_packed", "gate_up_proj_scale", "down_proj_packed",
                      "down_proj_scale"}
    assert sharded == {f"{pinned.EXPERTS_GLOB}.{name}" for name in params}

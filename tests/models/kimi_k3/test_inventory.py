"""The real checkpoint's tensor inventory (modelopt_ext.models.kimi_k3.inventory, real_inventory.json) and the
stand-in measured against it.

The references are the published inventory report of moonshotai/Kimi-K3 (its totals and layer ranges are
written out here as the report gives them) and, for the stand-in, that table: the stand-in classes built at
full size on the meta device must store exactly the real checkpoint's names, shapes and dtypes.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from modelopt_ext.models.kimi_k3 import inventory as I

ROOT = Path(__file__).resolve().parents[3]
BUNDLED_CONFIG = ROOT / "modelopt_ext" / "models" / "kimi_k3" / "kimi_k3_config.json"
LAYER = "language_model.model.layers."
# The published report's totals: 96 shards, 497,220 tensors, 1,503,647,073,024 parameters (packed uint8
# elements counted as they are stored), 1453.66 GB of tensors (binary GB), 60 rows after compression.
REPORT_TENSORS, REPORT_PARAMS, REPORT_GIB, REPORT_ROWS = 497_220, 1_503_647_073_024, 1453.66, 60
MXFP4_GROUP = 32


@pytest.fixture(scope="module")
def inventory():
    return I.load_real_inventory()


@pytest.fixture(scope="module")
def real(inventory):
    return I.expected_tensors(inventory)


# ------------------------------------------------------------------------------------------ (a) totals
def test_table_reproduces_the_published_totals(inventory, real):
    assert len(real) == REPORT_TENSORS == inventory["totals"]["tensors"]
    assert I.total_params(real) == REPORT_PARAMS == inventory["totals"]["params"]
    assert round(I.total_bytes(real) / 2**30, 2) == REPORT_GIB
    rows = sum(len(v) for v in inventory["per_layer"].values()) + len(inventory["vision_block"]) + len(inventory["model"])
    assert rows == REPORT_ROWS
    assert inventory["revision"] == "9f62e4e9fffbd0a83ddd60e1c209d828994b3569"


def test_schedule_is_the_reports_layer_ranges(inventory, real):
    s = I.layer_schedule(inventory["config"])
    # report rows: KDA "0-2,4-6,...,88-90" (x69), MLA "3,7,...,83,87,91-92" (x24), dense "0", MoE "1-92"
    assert list(s.kda) == [i for i in range(91) if i % 4 != 3] and len(s.kda) == 69
    assert list(s.mla) == list(range(3, 88, 4)) + [91, 92] and len(s.mla) == 24
    assert s.dense == (0,) and s.moe == tuple(range(1, 93)) and s.num_experts == 896 and s.vision_blocks == 27
    assert f"{LAYER}0.mlp.up_proj.weight" in real and f"{LAYER}1.mlp.up_proj.weight" not in real
    assert f"{LAYER}92.block_sparse_moe.experts.895.w2.weight_scale" in real
    assert f"{LAYER}0.block_sparse_moe.gate.weight" not in real
    assert real[f"{LAYER}91.self_attn.kv_b_proj.weight"] == ((24576, 512), "bfloat16")
    assert f"{LAYER}91.self_attn.q_proj.weight" not in real and f"{LAYER}90.self_attn.q_proj.weight" in real


def test_bundled_config_has_the_inventorys_schedule(inventory, real):
    config = json.loads(BUNDLED_CONFIG.read_text())
    assert I.layer_schedule(config) == I.layer_schedule(inventory["config"])
    assert I.expected_tensors(inventory, config) == real


def test_schedule_refuses_inconsistent_full_attn_layers(inventory):
    config = copy.deepcopy(inventory["config"])
    config["text_config"]["linear_attn_config"]["full_attn_layers"] = [4, 8]
    with pytest.raises(ValueError, match="full_attn_layers"):
        I.layer_schedule(config)


# ----------------------------------------------------------------------------------------- (b) compare
def test_compare_reports_each_kind_of_problem(real):
    assert I.compare(real, dict(real)) == []
    doctored = dict(real)
    gone = f"{LAYER}5.self_attn.A_log"
    del doctored[gone]
    doctored[f"{LAYER}5.self_attn.A_log_padded"] = ((128,), "float32")
    doctored[f"{LAYER}3.self_attn.kv_b_proj.weight"] = ((24576, 256), "bfloat16")
    doctored[f"{LAYER}4.self_attn.o_norm.weight"] = ((128,), torch.bfloat16)
    doctored[f"{LAYER}6.self_attn.o_norm.weight"] = ((128,), "torch.float32")  # same dtype, other spelling
    assert I.compare(real, doctored) == [
        f"missing: {gone} [128] float32",
        f"unexpected: {LAYER}5.self_attn.A_log_padded [128] float32",
        f"shape: {LAYER}3.self_attn.kv_b_proj.weight expected [24576, 512], got [24576, 256]",
        f"dtype: {LAYER}4.self_attn.o_norm.weight expected float32, got bfloat16",
    ]


def test_compare_caps_the_list_and_counts_the_rest(real):
    actual = {k: v for k, v in real.items() if ".experts.7." not in k}  # 92 layers x 6 tensors missing
    actual["extra"] = ((1,), "uint8")
    problems = I.compare(real, actual, limit=5)
    assert len(problems) == 5 and all(p.startswith("missing: ") for p in problems[:4])
    assert problems[-1] == "... and 549 more (missing 548, unexpected 1)"
    assert len(I.compare(real, actual, limit=1000)) == 92 * 6 + 1


def test_checkpoint_tensors_reads_headers_and_checks_the_index(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.zeros(4, dtype=torch.uint8)}, tmp_path / "s1.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert I.checkpoint_tensors(tmp_path) == {"a": ((2, 3), "bfloat16"), "b": ((4,), "uint8")}
    index["weight_map"]["c"] = "s1.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="no shard holds"):
        I.checkpoint_tensors(tmp_path)


# ------------------------------------------------------------------- (c) the stand-in at full size
def _stored(state: dict[str, torch.Tensor]) -> I.TensorMap:
    """Names, shapes and dtypes as the generator stores a state dict (standin/generate.py::build_state_dict)."""
    from modelopt_ext.models.kimi_k3.standin import generate

    out = {}
    for name, tensor in state.items():
        shape = tuple(tensor.shape)
        if generate.EXPERT_KEY.search(name):
            rows, cols = shape
            stem = name[: -len("weight")]
            out[stem + "weight_packed"] = ((rows, cols // 2), "uint8")
            out[stem + "weight_scale"] = ((rows, cols // MXFP4_GROUP), "uint8")
        elif generate.FP32_KEYS.search(name):
            out[name] = (shape, "float32")
        else:
            out[name] = (shape, "bfloat16")
    return out


def _meta_build(cls, config):
    from transformers.initialization import no_init_weights  # as from_pretrained builds an empty model

    with torch.device("meta"), no_init_weights():
        return cls(config)


def test_standin_classes_at_full_size_store_the_real_tensors(inventory, real):
    """The stand-in classes, given the bundled full-size config.json, store exactly the real checkpoint's
    tensors. 92 x 896 experts take about 50 s to build on meta, so the whole model is built with 16 experts a
    layer (router rows follow) and one MoE block separately at the real 896."""
    from modelopt_ext.models.kimi_k3.standin.configuration_kimi_k3 import KimiK3Config
    from modelopt_ext.models.kimi_k3.standin.modeling_kimi_k3 import KimiK3ForConditionalGeneration

    start = time.perf_counter()
    raw = json.loads(BUNDLED_CONFIG.read_text())
    full_experts = raw["text_config"]["num_experts"]
    assert full_experts == inventory["config"]["text_config"]["num_experts"] == 896
    few = max(16, raw["text_config"]["num_experts_per_token"])
    reduced = copy.deepcopy(raw)
    reduced["text_config"]["num_experts"] = few
    model = _meta_build(KimiK3ForConditionalGeneration, KimiK3Config(**reduced))
    actual = _stored(model.state_dict())

    expert = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.")
    router = re.compile(r"\.block_sparse_moe\.gate\.(weight|e_score_correction_bias)$")
    expected = {}
    for name, (shape, dtype) in real.items():
        m = expert.search(name)
        if m and int(m.group(1)) >= few:
            continue
        if router.search(name):
            assert shape[0] == full_experts, name
            shape = (few,) + shape[1:]
        expected[name] = (shape, dtype)
    problems = I.compare(expected, actual)

    first_moe = I.layer_schedule(raw).moe[0]
    prefix = f"{LAYER}{first_moe}.block_sparse_moe."
    block_cls = type(model.get_submodule(prefix[:-1]))
    block = _meta_build(block_cls, KimiK3Config(**raw).text_config)
    block_actual = _stored({prefix + k: v for k, v in block.state_dict().items()})
    block_expected = {k: v for k, v in real.items() if k.startswith(prefix)}
    assert len(block_expected) == 8 + 6 * full_experts
    problems += I.compare(block_expected, block_actual)
    elapsed = time.perf_counter() - start
    assert problems == [], "\n".join(problems)
    assert elapsed < 30, f"building and comparing took {elapsed:.1f} s"


# ------------------------------------------------------------------ (d) the generated tiny stand-in
def _tiny(tiny_ckpt):
    config = json.loads((Path(tiny_ckpt) / "config.json").read_text())
    return I.patterns(I.checkpoint_tensors(tiny_ckpt), I.layer_schedule(config))


def test_tiny_standin_has_the_real_kinds_of_tensors(tiny_ckpt, inventory, real):
    real_patterns = I.patterns(real, I.layer_schedule(inventory["config"]))
    tiny_patterns = _tiny(tiny_ckpt)
    missing = sorted(real_patterns.keys() - tiny_patterns.keys())
    unexpected = sorted(tiny_patterns.keys() - real_patterns.keys())
    assert (missing, unexpected) == ([], [])


def test_tiny_standin_stores_each_kind_in_the_real_dtype(tiny_ckpt, inventory, real):
    real_patterns = I.patterns(real, I.layer_schedule(inventory["config"]))
    tiny_patterns = _tiny(tiny_ckpt)
    wrong = {p: (real_patterns[p], d) for p, d in tiny_patterns.items() if p in real_patterns and d != real_patterns[p]}
    assert wrong == {}


def test_name_pattern_generalizes_indices_by_kind(inventory):
    s = I.layer_schedule(inventory["config"])
    assert I.name_pattern(f"{LAYER}3.self_attn.g_proj.weight", s) == f"{LAYER}{{mla}}.self_attn.g_proj.weight"
    assert I.name_pattern(f"{LAYER}2.self_attn.g_proj.weight", s) == f"{LAYER}{{kda}}.self_attn.g_proj.weight"
    assert I.name_pattern(f"{LAYER}0.mlp.down_proj.weight", s) == f"{LAYER}{{dense_mlp}}.mlp.down_proj.weight"
    assert (I.name_pattern(f"{LAYER}9.block_sparse_moe.experts.12.w1.weight_packed", s)
            == f"{LAYER}{{moe}}.block_sparse_moe.experts.{{expert}}.w1.weight_packed")
    assert I.name_pattern(f"{LAYER}9.mlp_res_proj.weight", s) == f"{LAYER}{{layer}}.mlp_res_proj.weight"
    assert I.name_pattern("vision_tower.encoder.blocks.26.wo.weight", s) == "vision_tower.encoder.blocks.{block}.wo.weight"
    assert I.name_pattern("mm_projector.proj.0.weight", s) == "mm_projector.proj.0.weight"


# --------------------------------------------------------- scripts/check_upstream_names.py (optional)
@pytest.mark.skipif(not os.environ.get("KIMI_K3_UPSTREAM"), reason="set KIMI_K3_UPSTREAM to the upstream remote code")
def test_upstream_names_script_on_the_tiny_standin(tiny_ckpt):
    cmd = [sys.executable, str(ROOT / "scripts" / "check_upstream_names.py"),
           "--upstream", os.environ["KIMI_K3_UPSTREAM"], "--checkpoint", str(tiny_ckpt)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK: names, shapes and dtypes agree" in proc.stdout, proc.stdout + proc.stderr

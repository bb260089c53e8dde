"""The Kimi-K3 family spec (lock, registry entry, EP plan, quantizer exclusions) and its converters."""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers.conversion_mapping as cm
from safetensors.torch import load_file
from torch import nn

import modelopt_ext
from modelopt_ext.families import families, family_for_config, read_config
from modelopt_ext.lock import load_lock, remote_code_files
from modelopt_ext.models.kimi_k3 import spec
from modelopt_ext.models.kimi_k3.convert import expert_converters
from modelopt_ext.models.kimi_k3.experts import KimiK3Experts, KimiK3PackedExperts
from modelopt_ext.models.kimi_k3.patch import expert_storage
from modelopt_ext.models.kimi_k3.standin import configuration_kimi_k3 as standin_config
from modelopt_ext.testing.checkpoints import copy_checkpoint

STANDIN = Path(standin_config.__file__).parent
REMOTE_FILES = ("configuration_kimi_k3.py", "modeling_kimi_k3.py", "modeling_kimi_linear.py")


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def packed_model(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint loaded through the adapter (MXFP4 experts), from a private copy."""
    path = copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("spec"), "spec_test_packed_copy")
    return path, modelopt_ext.from_pretrained(path, trust_remote_code=True)


@pytest.fixture(scope="module")
def dense_model(packed_model):
    """A dense-experts model of the same (patched) class and config, built from the config."""
    _, model = packed_model
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with expert_storage("dense"):
        return type(model)(config)


# ----------------------------------------------------------------------------------------------------
# lock and registry


def test_bundled_lock_matches_the_standin_remote_code(tmp_path, tiny_ckpt):
    """Editing the stand-in's remote code requires re-recording the bundled lock."""
    for name in REMOTE_FILES:
        shutil.copy(STANDIN / name, tmp_path / name)
    lock = load_lock(spec.LOCK_FILE)
    assert lock.revision == spec.REVISION
    assert dict(lock.files) == remote_code_files(tmp_path)
    assert set(lock.files) == set(REMOTE_FILES)
    # the generated checkpoint ships exactly those files
    assert remote_code_files(tiny_ckpt) == dict(lock.files)


def test_family_registered_by_model_type(tiny_ckpt):
    assert spec.KIMI_K3.model_types == ("kimi_k3",)
    assert families()["kimi_k3"] is spec.KIMI_K3
    assert family_for_config(read_config(tiny_ckpt)) is spec.KIMI_K3
    assert family_for_config(json.loads(spec.BUNDLED_CONFIG.read_text())) is spec.KIMI_K3
    with pytest.raises(ValueError, match="text_config.vocab_size is missing"):  # the family's config check
        family_for_config({"model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear"}})
    with pytest.raises(ValueError, match="kimi_linear"):
        family_for_config({"model_type": "kimi_k3", "text_config": {"model_type": "llama"}})
    assert spec.KIMI_K3.remote_code_lock == spec.LOCK_FILE and spec.LOCK_FILE.is_file()
    assert spec.KIMI_K3.converters is expert_converters


# ----------------------------------------------------------------------------------------------------
# EP plan


def _names(model: nn.Module) -> set[str]:
    return {n for n, _ in model.named_modules() if n} | {n for n, _ in model.named_parameters()}


def test_ep_plan_globs_match_loaded_models(packed_model, dense_model):
    _, packed = packed_model
    packed_names, dense_names = _names(packed), _names(dense_model)
    moe_layers = [i for i in range(packed.config.text_config.num_hidden_layers)
                  if packed.config.text_config.is_moe_layer(i)]
    assert moe_layers  # the tiny model has MoE layers
    for glob, style in spec.EP_PLAN.items():
        hits = [n for n in packed_names | dense_names if fnmatch.fnmatchcase(n, glob)]
        assert hits, f"{glob} ({style}) matches nothing"
        # one hit per MoE layer, in one of the two storages
        assert len(hits) == len(moe_layers), (glob, hits)
    experts_glob = next(g for g, s in spec.EP_PLAN.items() if s == "ep_dispatch_experts")
    for model, cls in ((packed, KimiK3PackedExperts), (dense_model, KimiK3Experts)):
        matched = [m for n, m in model.named_modules() if fnmatch.fnmatchcase(n, experts_glob)]
        assert len(matched) == len(moe_layers) and all(isinstance(m, cls) for m in matched)
    # every expert parameter of either storage is covered by a grouped_gemm rule
    for names in (packed_names, dense_names):
        expert_params = {n for n in names if ".experts." in n}
        covered = {n for n in expert_params for g, s in spec.EP_PLAN.items()
                   if s == "grouped_gemm" and fnmatch.fnmatchcase(n, g)}
        assert expert_params and covered == expert_params


# ----------------------------------------------------------------------------------------------------
# quantizer exclusions


def _excluded(patterns, name):
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def test_quantizer_exclusions(packed_model):
    _, model = packed_model
    text = model.config.text_config
    patterns = spec.quantizer_exclusions(model.config)
    assert spec.quantizer_exclusions(text) == patterns  # a text config works as well
    kda = [i for i in range(text.num_hidden_layers) if text.is_kda_layer(i)]
    mla = [i for i in range(text.num_hidden_layers) if not text.is_kda_layer(i)]
    assert kda and mla

    # Expected verdict for every Linear, written independently of the patterns.
    def expect_excluded(name: str) -> bool:
        if name.startswith(("vision_tower.", "mm_projector.")) or name == "language_model.lm_head":
            return True
        if name.endswith(("block_sparse_moe.gate", "_res_proj", "routed_expert_down_proj", "routed_expert_up_proj")):
            return True
        m = re.fullmatch(r"language_model\.model\.layers\.(\d+)\.self_attn\.(\w+)", name)
        return bool(m) and int(m[1]) in kda and m[2] == "f_b_proj"

    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert len(linears) > 50
    for name in linears:
        for quantizer in (f"{name}.weight_quantizer", f"{name}.input_quantizer"):
            assert _excluded(patterns, quantizer) == expect_excluded(name), quantizer

    params = [n for n, _ in model.named_parameters()]
    must = [n for n in params if re.search(r"(conv1d\.weight|A_log|dt_bias|e_score_correction_bias)$", n)]
    must += [n for n in params if "norm" in n]
    assert any("A_log" in n for n in must) and any("o_norm" in n for n in must) and any("layernorm" in n for n in must)
    for n in must:
        assert _excluded(patterns, n), n
    assert _excluded(patterns, "language_model.model.output_attn_res_proj.weight_quantizer")
    assert _excluded(patterns, "language_model.model.output_attn_res_norm.weight")

    # explicitly NOT excluded: g_proj and o_proj everywhere, KDA's input group, routed experts
    for i in mla + kda:
        assert not _excluded(patterns, f"language_model.model.layers.{i}.self_attn.g_proj.weight_quantizer")
    for i in kda:
        for p in ("f_a_proj", "b_proj"):
            assert not _excluded(patterns, f"language_model.model.layers.{i}.self_attn.{p}.weight_quantizer")
    for i in range(text.num_hidden_layers):
        assert not _excluded(patterns, f"language_model.model.layers.{i}.self_attn.o_proj.input_quantizer")
    for i in kda:
        for p in ("q_proj", "k_proj", "v_proj"):
            assert not _excluded(patterns, f"language_model.model.layers.{i}.self_attn.{p}.weight_quantizer")
    for i in mla:
        for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
            assert not _excluded(patterns, f"language_model.model.layers.{i}.self_attn.{p}.weight_quantizer")
    expert_quantizers = [f"{n}_{q}" for n in params if ".experts." in n and n.endswith("_packed")
                         for q in ("weight_quantizers.0", "input_quantizer")]
    expert_quantizers += [f"language_model.model.layers.1.block_sparse_moe.experts.{p}.weight_quantizer"
                          for p in ("gate_up_proj", "down_proj")]
    for q in expert_quantizers:
        assert not _excluded(patterns, q), q


# ----------------------------------------------------------------------------------------------------
# converters


def test_adapter_load_and_save_round_trip(packed_model, tmp_path):
    """Through transformers' real machinery: the loaded fused bytes are the checkpoint's per-expert bytes, and
    save_pretrained writes the per-expert keys back byte for byte."""
    path, model = packed_model
    ckpt = _checkpoint_tensors(path)
    sd = model.state_dict()
    text = model.config.text_config
    layer = next(i for i in range(text.num_hidden_layers) if text.is_moe_layer(i))
    prefix = f"language_model.model.layers.{layer}.block_sparse_moe.experts"
    for src, tail in (("weight_packed", "_packed"), ("weight_scale", "_scale")):
        gate_up, down = sd[f"{prefix}.gate_up_proj{tail}"], sd[f"{prefix}.down_proj{tail}"]
        I = text.moe_intermediate_size
        for e in range(text.num_experts):
            assert torch.equal(gate_up[e, :I], ckpt[f"{prefix}.{e}.w1.{src}"])
            assert torch.equal(gate_up[e, I:], ckpt[f"{prefix}.{e}.w3.{src}"])
            assert torch.equal(down[e], ckpt[f"{prefix}.{e}.w2.{src}"])

    out = tmp_path / "saved"
    model.save_pretrained(out)
    saved = _checkpoint_tensors(out)
    assert set(saved) == set(ckpt)
    for k, v in ckpt.items():
        assert saved[k].dtype == v.dtype and torch.equal(saved[k], v), k


def test_adapter_load_leaves_no_registration(packed_model):
    _, model = packed_model
    name = type(model).__name__
    assert name not in (cm._checkpoint_conversion_mapping_cache or {})
    assert name not in cm.USER_REGISTERED_MAPPINGS
    # the loaded model keeps its own copy for save_pretrained
    convs = getattr(model, "_weight_conversions", None)
    assert convs and any("gate_up_proj_packed" in c.target_patterns[0] for c in convs if hasattr(c, "operations"))



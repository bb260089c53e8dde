"""KV-cache quantization on Kimi-K3 is refused in validate (quant/kv_cache.py; docs/export.md "KV cache")."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from modelopt_ext.quant import recipes as R
from modelopt_ext.quant.kv_cache import check_kv_cache, enabled_kv_quantizers
from modelopt_ext.testing.checkpoints import copy_checkpoint

SHIPPED = ["kimi_k3/nvfp4_experts-fp8_attention", "kimi_k3/fp8_all", "kimi_k3/nvfp4_experts_only",
           "kimi_k3/calibration_free"]
KV_FP8 = {"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": [4, 3], "axis": None}}


def _check(path, config, serving):
    quant = R.quant_config(R.load(path), config)
    check_kv_cache(quant["quant_cfg"], config, serving, str(path), quant.sources)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_quantize_no_kv_cache(name, config, serving):
    quant = R.quant_config(R.load(name), config)
    assert enabled_kv_quantizers(quant["quant_cfg"], serving.kv_cache.attention_modules(config)) == {}
    check_kv_cache(quant["quant_cfg"], config, serving, name, quant.sources)


def test_the_kv_caches_are_the_mla_layers(config, serving):
    assert serving.kv_cache.attention_modules(config) == (
        "language_model.model.layers.2.self_attn", "language_model.model.layers.5.self_attn")
    assert set(serving.kv_cache.engines) == set(serving.engines)


def test_fp8_kv_entry_is_refused_naming_entry_engines_and_alternative(config, serving, recipe_with):
    path = recipe_with([KV_FP8], "fp8_all")
    with pytest.raises(ValueError) as err:
        _check(path, config, serving)
    text = str(err.value)
    assert text.startswith(f"recipe {path} quantizes the KV cache, whose calibrated scales vllm, sglang, trtllm "
                           f"cannot use: {path} quantize.quant_cfg[3] (quantizer_name '*[kv]_bmm_quantizer') "
                           "enables language_model.model.layers.2.self_attn.k_bmm_quantizer and 3 more."), text
    assert "the MLA latent, kv_a_layernorm(kv_c) and k_pe" in text
    assert "vllm: its Kimi-K3 MLA layer (vllm/models/kimi_k3/nvidia/mla.py)" in text
    assert "the FP8 latent cache uses scale 1.0" in text
    assert "measures them on the decompressed per-head keys and values" in text
    assert text.endswith("vLLM and SGLang quantize the latent with scale 1.0 there")
    assert "--kv-cache-dtype fp8_e4m3" in text


def test_modelopt_kv_unit_import_and_nvfp4_kv_are_refused(config, serving, recipe_with):
    """ModelOpt's own unit (`configs/ptq/units/kv_fp8`, as its `*-kv_fp8` recipes import it) and an NVFP4 KV."""
    path = recipe_with([{"$import": "kv_fp8"}], "fp8_all", imports={"kv_fp8": "configs/ptq/units/kv_fp8"})
    with pytest.raises(ValueError, match=r"kv_fp8.yaml entry \[0\] \(imported by .*quantize.quant_cfg\[3\]\)"):
        _check(path, config, serving)
    path = recipe_with([{"$import": "kv_nvfp4"}], "fp8_all", imports={"kv_nvfp4": "configs/ptq/units/kv_nvfp4"})
    with pytest.raises(ValueError, match="quantizes the KV cache"):
        _check(path, config, serving)


def test_only_k_or_a_later_disable(config, serving, recipe_with):
    only_k = dict(KV_FP8, quantizer_name="*layers.5.self_attn.k_bmm_quantizer")
    with pytest.raises(ValueError, match=r"enables language_model.model.layers.5.self_attn.k_bmm_quantizer\. "):
        _check(recipe_with([only_k], "fp8_all"), config, serving)
    # disabled again later (or only under a class that is no attention): nothing to refuse
    disabled_again = [KV_FP8, {"quantizer_name": "*[kv]_bmm_quantizer", "enable": False}]
    _check(recipe_with(disabled_again, "fp8_all"), config, serving)
    _check(recipe_with([dict(KV_FP8, parent_class="nn.Linear")], "fp8_all"), config, serving)


def test_a_recipe_without_a_catch_all_disable_is_refused(config, serving):
    """ModelOpt enables a quantizer no entry matches: a quant_cfg without `*` disabled quantizes the KV cache."""
    with pytest.raises(ValueError, match="no entry disables them and ModelOpt enables a quantizer by default"):
        check_kv_cache([{"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8}}], config, serving, "r")


def test_families_without_kv_facts_or_with_supporting_engines_are_not_checked(config, serving):
    catch_all = [KV_FP8]
    check_kv_cache(catch_all, config, dataclasses.replace(serving, kv_cache=None), "r")
    supported = dataclasses.replace(serving.kv_cache, engines={e: None for e in serving.engines})
    check_kv_cache(catch_all, config, dataclasses.replace(serving, kv_cache=supported), "r")


def test_ptq_refuses_a_kv_recipe_before_loading_and_writes_nothing(tiny_ckpt, tmp_path, loads, capsys, recipe_with):
    from modelopt_ext.cli import main

    path = recipe_with([KV_FP8], "fp8_all")
    model = copy_checkpoint(tiny_ckpt, tmp_path, "src")
    before = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    capsys.readouterr()
    rc = main(["ptq", "--model", str(model), "--export-dir", str(tmp_path / "out"), "--no-progress",
               "--recipe", str(path)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("modelopt-ext ptq: error: ")]
    assert rc == 1 and loads == [] and not (tmp_path / "out").exists()
    assert err[-1].startswith(f"modelopt-ext ptq: error: validate: recipe {path} quantizes the KV cache"), err
    assert {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()} == before


def test_modelopt_measures_per_head_kv_not_the_latent(tiny_ckpt, tmp_path):
    """The fact behind the refusal, on the stand-in: ModelOpt's KV quantizers on the MLA module see the
    decompressed per-head keys and values, not the cached latent (the adapter registers the MLA class with
    ModelOpt, models/kimi_k3/mla.py: its source rewrite had put k_bmm_quantizer on the values)."""
    import modelopt.torch.quantization as mtq

    import modelopt_ext

    model = modelopt_ext.from_pretrained(copy_checkpoint(tiny_ckpt, tmp_path, "kv_measure"), trust_remote_code=True,
                                         dtype=torch.float32, experts_implementation="batched_mm")
    seen: dict[str, float] = {}

    def record(key, t):
        seen[key] = max(seen.get(key, 0.0), float(t.detach().abs().max()))

    attn = model.get_submodule("language_model.model.layers.2.self_attn")
    r, nope, h = attn.kv_lora_rank, attn.qk_nope_head_dim, attn.num_heads
    attn.kv_a_proj_with_mqa.register_forward_hook(lambda m, i, o: record("k_pe", o[..., r:]))
    attn.kv_a_layernorm.register_forward_hook(lambda m, i, o: record("kv_c_normed", o))
    attn.kv_b_proj.register_forward_hook(lambda m, i, o: (record("k_nope", o.view(*o.shape[:-1], h, -1)[..., :nope]),
                                                          record("value", o.view(*o.shape[:-1], h, -1)[..., nope:]))
                                         and None)
    cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}, KV_FP8], "algorithm": "max"}
    torch.manual_seed(0)
    batches = [torch.randint(0, model.config.get_text_config().vocab_size, (2, 16)) for _ in range(2)]
    mtq.quantize(model, cfg, lambda m: [m(input_ids=b) for b in batches])
    k_amax, v_amax = (float(getattr(attn, q).amax) for q in ("k_bmm_quantizer", "v_bmm_quantizer"))
    assert k_amax == pytest.approx(max(seen["k_nope"], seen["k_pe"]), rel=1e-6)
    assert v_amax == pytest.approx(seen["value"], rel=1e-6)
    assert seen["kv_c_normed"] not in (pytest.approx(k_amax), pytest.approx(v_amax))

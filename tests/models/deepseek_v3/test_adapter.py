"""The DeepSeek-V3 family's load (`models/deepseek_v3/adapter.py` through the generic loader): the same model as
plain transformers under the exact FP8 dequantization, Kimi-K2's model type, the MTP layer left unread and
nothing else, refusals, the warm-up; and expert parallelism on real gloo ranks (per-rank bodies at the top: each
rank imports this file by path, `modelopt_ext.testing.multiproc`).

Exactness: one process, fp32, the same experts implementation on both sides: bit for bit. Under EP, with
transformers' `batched_mm` experts (one GEMV per row, a row's result independent of the other rows) the EP logits
equal the one-process ones bit for bit, as for Kimi-K3 (tests/ep/test_ep_parity.py); with the default
`grouped_mm` (on the CPU its fallback runs one GEMM per expert over the rows it got, and under EP an expert gets
the rows of both ranks) the CPU GEMM accumulates differently for different row counts: measured 3.1e-6 at logits
of magnitude ~4, bounded here by 2e-5."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import modelopt_ext
from modelopt_ext.testing.multiproc import run_ranks

# ---- per-rank bodies (run on every rank by run_ranks) ----------------------------------------------------------------


def ep_logits(rank: int, world_size: int, ckpt: str, impl: str | None = None):
    """Logits of the EP model (dense replicated) and of the same checkpoint in this one process, on a batch of
    this rank's own; what the EP load read."""
    kwargs = {"dtype": torch.float32}
    if impl is not None:
        kwargs["experts_implementation"] = impl
    single = modelopt_ext.from_pretrained(ckpt, **kwargs)
    model = modelopt_ext.from_pretrained(ckpt, ep_size=world_size, dense="replicate", **kwargs)
    ids = torch.randint(2, 500, (2, 16), generator=torch.Generator().manual_seed(100 + rank))
    with torch.no_grad():
        ep = model(input_ids=ids, use_cache=False).logits
        ref = single(input_ids=ids, use_cache=False).logits
    experts = model.model.layers[1].mlp.experts
    return {"ep": ep, "ref": ref, "bytes_read": model.modelopt_ext_bytes_read, "local_experts": experts.num_experts,
            "local_shape": tuple(experts.gate_up_proj.to_local().shape), "plan": model.modelopt_ext_plan.to_dict()}


def fsdp_against_replicated(rank: int, world_size: int, ckpt: str):
    """The FP8 stand-in loaded with FSDP-sharded and with replicated dense layers (bf16, EP = world): the
    parameters that differ once gathered, how many are sharded, whether the logits are equal, the bytes read."""
    from torch.distributed.tensor import DTensor

    def whole(p):
        return (p.full_tensor() if isinstance(p, DTensor) else p).detach()

    replicated = modelopt_ext.from_pretrained(ckpt, ep_size=world_size, dense="replicate", dtype=torch.bfloat16)
    fsdp = modelopt_ext.from_pretrained(ckpt, ep_size=world_size, dense="fsdp", dtype=torch.bfloat16)
    want = dict(replicated.named_parameters())
    differ = [n for n, p in fsdp.named_parameters() if not torch.equal(whole(p), whole(want[n]))]
    sharded = [n for n, p in fsdp.named_parameters() if isinstance(p, DTensor) and "experts" not in n
               and any(hasattr(pl, "dim") for pl in p.placements)]
    ids = torch.randint(2, 500, (2, 16), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        equal = torch.equal(fsdp(input_ids=ids, use_cache=False).logits,
                            replicated(input_ids=ids, use_cache=False).logits)
    return {"differ": differ, "sharded": sharded, "logits_equal": equal,
            "bytes_read": fsdp.modelopt_ext_bytes_read, "plan": fsdp.modelopt_ext_plan.to_dict()}


# ---- helpers ---------------------------------------------------------------------------------------------------------


def _stored_bytes(ckpt: Path) -> dict[str, int]:
    """Bytes of the checkpoint's tensors (safetensors headers): "experts" and "dense" of the decoder layers and
    the rest, "mtp" of the multi-token-prediction layers."""
    from safetensors import safe_open

    config = json.loads((ckpt / "config.json").read_text())
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    out = {"experts": 0, "dense": 0, "mtp": 0}
    for name in sorted(set(index.values())):
        with safe_open(str(ckpt / name), "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                size = torch.Size(t.get_shape()).numel() * torch.empty(0, dtype=_DTYPES[t.get_dtype()]).element_size()
                parts = key.split(".")
                if key.startswith("model.layers.") and int(parts[2]) >= config["num_hidden_layers"]:
                    out["mtp"] += size
                else:
                    out["experts" if ".mlp.experts." in key else "dense"] += size
    return out


_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F32": torch.float32}


def _plain_transformers(ckpt: Path, **kwargs):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from modelopt_ext.formats.fp8_block import exact_block_dequantize

    config = DeepseekV3Config.from_dict(json.loads((ckpt / "config.json").read_text()))
    with exact_block_dequantize():
        return DeepseekV3ForCausalLM.from_pretrained(ckpt, config=config, **kwargs).eval()


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(2, 500, (2, 16), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.fixture(scope="module")
def ds_fp32(ds_tiny):
    return modelopt_ext.from_pretrained(ds_tiny, dtype=torch.float32)


@pytest.fixture(scope="module")
def k2_tiny(ds_tiny, tmp_path_factory):
    """The stand-in as Kimi-K2 ships it: model_type `kimi_k2` (the same tensors)."""
    out = tmp_path_factory.mktemp("k2") / "tiny"
    shutil.copytree(ds_tiny, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}, indent=2))
    return out


# ---- one process -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_load_is_plain_transformers_with_the_exact_dequantization(ds_tiny, ds_fp32, dtype):
    from transformers import DeepseekV3ForCausalLM

    model = ds_fp32 if dtype == torch.float32 else modelopt_ext.from_pretrained(ds_tiny, dtype=dtype)
    reference = _plain_transformers(ds_tiny, dtype=dtype)
    assert type(model) is DeepseekV3ForCausalLM
    ours, theirs = model.state_dict(), reference.state_dict()
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert torch.equal(_logits(model, _ids()), _logits(reference, _ids()))
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # transformers' fp32 router kept
    assert not any(p.dtype == torch.float8_e4m3fn for p in model.parameters())


def test_partial_fp8_blocks_are_exact(ds_tiny, ds_fp32):
    """kv_a_proj_with_mqa [192, 256] has a 64-row partial block: the loaded weight is fp8 x its block's scale."""
    from safetensors import safe_open

    from modelopt_ext.formats.fp8_block import dequantize_blocks

    key = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    index = json.loads((ds_tiny / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(ds_tiny / index[key]), "pt") as f:
        expected = dequantize_blocks(f.get_tensor(key), f.get_tensor(key + "_scale_inv"))
    loaded = ds_fp32.get_parameter(key)
    assert loaded.shape == (192, 256) and torch.equal(loaded, expected)


def test_bytes_read_are_the_decoder_layers_and_not_the_mtp_layer(ds_tiny, ds_fp32):
    stored = _stored_bytes(ds_tiny)
    assert stored["mtp"] > 0
    assert ds_fp32.modelopt_ext_bytes_read == {"experts": stored["experts"], "dense": stored["dense"]}


def test_the_native_class_is_not_registered_for_an_auto_class(ds_fp32):
    """`register_for_auto_class` would make every later DeepseekV3ForCausalLM save write an `auto_map` and copy
    modeling files; the family's class is transformers' own."""
    from transformers import DeepseekV3ForCausalLM

    assert "_auto_class" not in DeepseekV3ForCausalLM.__dict__ or DeepseekV3ForCausalLM._auto_class is None
    assert not hasattr(ds_fp32.config, "quantization_config")  # the model holds bf16/fp32, no FP8 tensor


def test_kimi_k2_model_type_loads_the_same_model(k2_tiny, ds_fp32):
    """transformers' conversion mapping has no `kimi_k2`: the family registers deepseek_v3's for the load only
    (without it the experts would stay unloaded, which the strict check refuses)."""
    from transformers import conversion_mapping as cm

    model = modelopt_ext.from_pretrained(k2_tiny, dtype=torch.float32)
    assert model.config.model_type == "kimi_k2"
    assert torch.equal(_logits(model, _ids()), _logits(ds_fp32, _ids()))
    assert "kimi_k2" not in (cm._checkpoint_conversion_mapping_cache or {})
    assert "kimi_k2" not in cm.USER_REGISTERED_MAPPINGS


def test_only_the_mtp_layer_may_go_unread(ds_tiny, tmp_path):
    """A stray tensor in the checkpoint is still refused, named; the MTP layer's keys are not."""
    from safetensors.torch import save_file

    from modelopt_ext.loader import CheckpointError

    out = tmp_path / "stray"
    shutil.copytree(ds_tiny, out)
    save_file({"model.layers.1.mlp.stray.weight": torch.zeros(2)}, str(out / "stray.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.1.mlp.stray.weight"] = "stray.safetensors"
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"'unexpected_keys': \['model.layers.1.mlp.stray.weight'\]"):
        modelopt_ext.from_pretrained(out, dtype=torch.float32)


def test_mtp_key_patterns_follow_the_config():
    from modelopt_ext.models.deepseek_v3.adapter import mtp_key_patterns

    assert mtp_key_patterns({"num_hidden_layers": 61, "num_nextn_predict_layers": 1}) == (r"model\.layers\.61\.",)
    assert mtp_key_patterns({"num_hidden_layers": 4, "num_nextn_predict_layers": 2}) == (
        r"model\.layers\.4\.", r"model\.layers\.5\.")
    assert mtp_key_patterns({"num_hidden_layers": 4}) == ()


@pytest.mark.parametrize("kwargs,needle", [
    ({"remote_code_lock": "lock.json"}, "family 'deepseek_v3' loads .* no remote code"),
    ({"quantization_config": object()}, r"\['quantization_config'\] are set by modelopt_ext"),
    ({"config": object()}, r"\['config'\] are set by modelopt_ext"),
])
def test_refusals(ds_tiny, kwargs, needle):
    from modelopt_ext.loader import CheckpointError

    with pytest.raises(CheckpointError, match=needle):
        modelopt_ext.from_pretrained(ds_tiny, **kwargs)


def test_trust_remote_code_is_accepted_and_unused(ds_tiny):
    from modelopt_ext.models.deepseek_v3.adapter import prepare_load

    prepared = prepare_load(ds_tiny, trust_remote_code=True, dtype=torch.float32)
    assert "trust_remote_code" in prepared.family_options and not prepared.remote_code
    assert prepared.load_kwargs["use_kernels"] is False and prepared.load_kwargs["quantization_config"].dequantize
    assert prepare_load(ds_tiny, use_kernels=True).load_kwargs.keys() == {"quantization_config"}


def test_an_unsupported_config_is_refused_before_loading(ds_tiny, tmp_path):
    out = tmp_path / "softmax"
    shutil.copytree(ds_tiny, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "scoring_func": "softmax"}))
    with pytest.raises(ValueError, match="scoring_func is 'softmax'"):
        modelopt_ext.from_pretrained(out)


def test_a_warmup_runs_during_the_load_and_changes_nothing(ds_tiny, ds_fp32):
    model = modelopt_ext.from_pretrained(ds_tiny, dtype=torch.float32, warmup_tokens=(2, 8))
    assert isinstance(model.modelopt_ext_warmup_s, float)
    assert torch.equal(_logits(model, _ids()), _logits(ds_fp32, _ids()))


# ---- expert parallelism on 2 gloo ranks ------------------------------------------------------------------------------


def test_ep_logits_equal_one_process_and_each_rank_reads_its_experts(ds_tiny):
    results = run_ranks(ep_logits, 2, {"ckpt": str(ds_tiny), "impl": "batched_mm"}, timeout_s=300)
    stored = _stored_bytes(ds_tiny)
    for rank, r in enumerate(results):
        assert r["plan"]["family"] == "deepseek_v3" and r["plan"]["expert_storage"] == "dense"
        assert r["local_experts"] == 8 and r["local_shape"] == (8, 512, 256)
        assert torch.equal(r["ep"], r["ref"]), f"rank {rank}: {(r['ep'] - r['ref']).abs().max()}"
        assert r["bytes_read"] == {"experts": stored["experts"] // 2, "dense": stored["dense"]}
    assert not torch.equal(results[0]["ep"], results[1]["ep"])  # the ranks ran different batches


def test_ep_with_the_default_grouped_experts(ds_tiny):
    results = run_ranks(ep_logits, 2, {"ckpt": str(ds_tiny)}, timeout_s=300)
    for rank, r in enumerate(results):
        assert (r["ep"] - r["ref"]).abs().max().item() <= 2e-5, f"rank {rank}"


def test_fsdp_dense_layers_of_an_fp8_checkpoint_load_as_replicated_ones(ds_tiny):
    """Each rank holds rows of the FP8 Linears that start inside 128-row blocks (e.g. 96 of the [192, 256] ones):
    transformers alone would pair them with the wrong block scales (tests/formats/test_fp8_block.py)."""
    results = run_ranks(fsdp_against_replicated, 2, {"ckpt": str(ds_tiny)}, timeout_s=300)
    for rank, r in enumerate(results):
        assert r["plan"]["dense"] == "fsdp", r["plan"]
        assert not r["differ"], f"rank {rank}: {r['differ'][:5]}"
        assert any("self_attn.q_a_proj" in n for n in r["sharded"]) and len(r["sharded"]) > 20, r["sharded"]
        assert r["logits_equal"], f"rank {rank}"
        assert r["bytes_read"]["dense"] < r["plan"]["dense_total_bytes"]  # each rank read its shard

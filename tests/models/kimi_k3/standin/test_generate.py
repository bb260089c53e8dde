"""Tests for the tiny Kimi-K3 stand-in generator (modelopt_ext.models.kimi_k3.standin.generate).

Every check reads the written files (config.json, the index, the shards through `safetensors.safe_open`),
never the generator's in-memory state, and compares them with the facts of the real checkpoint
(docs/kimi-k3-checkpoint.md: "Identity and files", "Sparse MoE block", "The stand-in").
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from modelopt_ext.formats.mxfp4 import GROUP_SIZE, dequantize_mxfp4
from modelopt_ext.models.kimi_k3.standin import generate
from modelopt_ext.models.kimi_k3.standin.generate import TinySizes, make_tiny

STANDIN_DIR = Path(generate.__file__).parent
REMOTE_CODE = ("configuration_kimi_k3.py", "modeling_kimi_k3.py", "modeling_kimi_linear.py")
SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
LAYER_RE = re.compile(r"^language_model\.model\.layers\.(\d+)\.(.+)$")
EXPERT_RE = re.compile(r"^language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(.+)$")
FP32_RE = re.compile(r"(\.A_log|\.dt_bias|_conv1d\.weight|\.o_norm\.weight|\.e_score_correction_bias)$")
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I32": 4, "I64": 8, "BOOL": 1}
NON_LAYER_KEYS = {
    "language_model.model.embed_tokens.weight",
    "language_model.lm_head.weight",
    "language_model.model.norm.weight",
    "language_model.model.output_attn_res_norm.weight",
    "language_model.model.output_attn_res_proj.weight",
}


# ----------------------------------------------------------------------------------------------------
# helpers


def _files(path: Path) -> dict[str, bytes]:
    """Every entry of a folder (flat) as name -> bytes; sub-folders would fail the comparison."""
    out = {}
    for p in sorted(path.iterdir()):
        assert p.is_file(), f"unexpected non-file {p}"
        out[p.name] = p.read_bytes()
    return out


def _shards(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if SHARD_RE.match(p.name))


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _read_tensors(path: Path) -> dict[str, dict]:
    """key -> {shard, dtype (safetensors name), shape}, read with safe_open; each key must be in one shard."""
    info: dict[str, dict] = {}
    for shard in _shards(path):
        with safe_open(str(path / shard), framework="pt") as f:
            for key in f.keys():
                assert key not in info, f"{key} stored in both {info[key]['shard']} and {shard}"
                sl = f.get_slice(key)
                info[key] = {"shard": shard, "dtype": sl.get_dtype(), "shape": list(sl.get_shape())}
    return info


def _tensor(path: Path, key: str, shard: str) -> torch.Tensor:
    with safe_open(str(path / shard), framework="pt") as f:
        return f.get_tensor(key)


def _siblings_tmp(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if re.match(r"^\..*\.tmp-", p.name))


def _check_layout(path: Path) -> None:
    """Keys, shapes and dtypes of the checkpoint at `path` agree with its own config.json."""
    cfg = _config(path)
    text = cfg["text_config"]
    n, H, L = text["num_hidden_layers"], text["hidden_size"], text["routed_expert_hidden_size"]
    E, I = text["num_experts"], text["moe_intermediate_size"]
    la = text["linear_attn_config"]
    tensors = _read_tensors(path)

    # Only the known top-level groups.
    for key in tensors:
        assert (
            key in NON_LAYER_KEYS or LAYER_RE.match(key) or key.startswith(("vision_tower.", "mm_projector."))
        ), f"unexpected key {key}"
    assert NON_LAYER_KEYS <= tensors.keys()
    assert any(k.startswith("vision_tower.") for k in tensors)
    assert any(k.startswith("mm_projector.") for k in tensors)
    assert tensors["language_model.model.embed_tokens.weight"]["shape"] == [text["vocab_size"], H]
    assert tensors["language_model.lm_head.weight"]["shape"] == [text["vocab_size"], H]
    assert tensors["language_model.model.output_attn_res_norm.weight"]["shape"] == [H]
    assert tensors["language_model.model.output_attn_res_proj.weight"]["shape"] == [1, H]

    layers = {int(m.group(1)) for k in tensors if (m := LAYER_RE.match(k))}
    assert layers == set(range(n))
    first_dense = text["first_k_dense_replace"]
    for i in range(n):
        p = f"language_model.model.layers.{i}."
        own = {k[len(p):]: v for k, v in tensors.items() if k.startswith(p)}
        for res in ("self_attention_res", "mlp_res"):
            assert own[f"{res}_norm.weight"]["shape"] == [H], (i, res)
            assert own[f"{res}_proj.weight"]["shape"] == [1, H], (i, res)
        # Attention type from linear_attn_config (1-based ids).
        is_kda, is_mla = (i + 1) in la["kda_layers"], (i + 1) in la["full_attn_layers"]
        assert is_kda != is_mla, f"layer {i} must be exactly one of KDA / MLA"
        assert ("self_attn.A_log" in own) == is_kda, i
        assert ("self_attn.kv_b_proj.weight" in own) == is_mla, i
        if is_kda:
            D = la["num_heads"] * la["head_dim"]
            for c in ("q", "k", "v"):
                assert own[f"self_attn.{c}_conv1d.weight"]["shape"] == [D, 1, la["short_conv_kernel_size"]]
        # MLP type.
        moe = {k for k in own if k.startswith("block_sparse_moe.")}
        if i < first_dense:
            assert not moe, f"dense layer {i} has MoE keys"
            assert {f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")} <= own.keys()
        else:
            assert not any(k.startswith("mlp.") for k in own), f"MoE layer {i} has dense mlp keys"
            assert own["block_sparse_moe.gate.weight"]["shape"] == [E, H]
            assert own["block_sparse_moe.gate.e_score_correction_bias"]["shape"] == [E]
            assert own["block_sparse_moe.routed_expert_down_proj.weight"]["shape"] == [L, H]
            assert own["block_sparse_moe.routed_expert_norm.weight"]["shape"] == [L]
            assert own["block_sparse_moe.routed_expert_up_proj.weight"]["shape"] == [H, L]
            for x in ("gate", "up", "down"):
                assert f"block_sparse_moe.shared_experts.{x}_proj.weight" in own
            # Routed experts: exactly packed + scale for w1/w2/w3 of every expert, nothing else.
            expected = {}
            for e in range(E):
                for w, (out_f, in_f) in (("w1", (I, L)), ("w3", (I, L)), ("w2", (L, I))):
                    expected[f"block_sparse_moe.experts.{e}.{w}.weight_packed"] = [out_f, in_f // 2]
                    expected[f"block_sparse_moe.experts.{e}.{w}.weight_scale"] = [out_f, in_f // GROUP_SIZE]
            got = {k: v["shape"] for k, v in own.items() if k.startswith("block_sparse_moe.experts.")}
            assert got == expected, f"layer {i} expert keys/shapes differ"

    # Dtypes: uint8 experts, fp32 KDA params + router bias, bf16 for the rest.
    for key, v in tensors.items():
        if EXPERT_RE.match(key):
            want = "U8"
        elif FP32_RE.search(key):
            want = "F32"
        else:
            want = "BF16"
        assert v["dtype"] == want, f"{key}: {v['dtype']} != {want}"


# ----------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt) -> Path:
    return Path(tiny_ckpt)


@pytest.fixture(scope="module")
def tensors(ckpt) -> dict[str, dict]:
    return _read_tensors(ckpt)


@pytest.fixture(scope="module")
def cfg(ckpt) -> dict:
    return _config(ckpt)


# ----------------------------------------------------------------------------------------------------
# determinism


def test_same_seed_twice_is_byte_identical(tmp_path, ckpt):
    a = make_tiny(tmp_path / "a", seed=0)
    b = make_tiny(tmp_path / "b", seed=0)
    files_a, files_b = _files(a), _files(b)
    assert sorted(files_a) == sorted(files_b)
    for name in files_a:
        assert files_a[name] == files_b[name], f"{name} differs between two runs with seed 0"
    # ... and equal to the session fixture's default checkpoint (seed 0), generated earlier.
    assert _files(ckpt) == files_a


def test_fresh_process_with_other_hash_seed_is_byte_identical(tmp_path, ckpt):
    out = tmp_path / "sub"
    code = textwrap.dedent(
        f"""
        from modelopt_ext.models.kimi_k3.standin.generate import make_tiny
        make_tiny({str(out)!r}, seed=0)
        """
    )
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    here, there = _files(ckpt), _files(out)
    assert sorted(here) == sorted(there)
    for name in here:
        assert here[name] == there[name], f"{name} differs in a fresh process"


def test_other_seed_changes_weights_only(tmp_path, ckpt):
    other = make_tiny(tmp_path / "seed1", seed=1)
    base, new = _files(ckpt), _files(other)
    assert sorted(base) == sorted(new)
    shards = _shards(ckpt)
    assert shards
    for name in shards:
        assert base[name] != new[name], f"{name} unchanged by another seed"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors.index.json", *REMOTE_CODE):
        assert base[name] == new[name], f"{name} depends on the seed"


# ----------------------------------------------------------------------------------------------------
# file set and config.json


def test_file_set(ckpt):
    names = {p.name for p in ckpt.iterdir()}
    shards = _shards(ckpt)
    assert len(shards) >= 2
    nums = [SHARD_RE.match(s).groups() for s in shards]
    total = {int(of) for _, of in nums}
    assert total == {len(shards)}, "every shard must name the same total, equal to the shard count"
    assert sorted(int(k) for k, _ in nums) == list(range(1, len(shards) + 1))
    expected = {
        "config.json", "generation_config.json", "model.safetensors.index.json",
        "tokenizer.json", "tokenizer_config.json", *REMOTE_CODE, *shards,
    }
    assert names == expected
    for fname in REMOTE_CODE:
        assert (ckpt / fname).read_bytes() == (STANDIN_DIR / fname).read_bytes(), fname


def test_generation_config_matches_tokenizer(ckpt, cfg):
    from tokenizers import Tokenizer

    gen = json.loads((ckpt / "generation_config.json").read_text())
    tk = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    assert gen["bos_token_id"] == tk.token_to_id("[BOS]") == cfg["text_config"]["bos_token_id"]
    assert gen["eos_token_id"] == tk.token_to_id("[EOS]") == cfg["text_config"]["eos_token_id"]
    assert gen["pad_token_id"] == tk.token_to_id("[PAD]") == cfg["text_config"]["pad_token_id"]


def test_config_identity(cfg, ckpt):
    from tokenizers import Tokenizer

    assert cfg["model_type"] == "kimi_k3"
    assert cfg["architectures"] == ["KimiK3ForConditionalGeneration"]
    auto_map = cfg["auto_map"]
    assert set(auto_map) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    assert auto_map["AutoConfig"] == "configuration_kimi_k3.KimiK3Config"
    assert auto_map["AutoModel"] == "modeling_kimi_k3.KimiK3ForConditionalGeneration"
    assert auto_map["AutoModelForCausalLM"] == "modeling_kimi_k3.KimiK3ForConditionalGeneration"
    for ref in auto_map.values():
        module, cls = ref.split(".")
        assert f"class {cls}(" in (ckpt / f"{module}.py").read_text(), ref
    assert cfg["text_config"]["model_type"] == "kimi_linear"
    vision = cfg["vision_config"]
    assert isinstance(vision, dict) and vision["vt_hidden_size"] > 0 and vision["vt_num_hidden_layers"] > 0
    tk = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    pad_id = tk.token_to_id("<|media_pad|>")
    assert pad_id is not None
    assert cfg["media_placeholder_token_id"] == pad_id


def test_quantization_config(cfg):
    from compressed_tensors import QuantizationConfig
    from compressed_tensors.config import CompressionFormat

    q = cfg["text_config"]["quantization_config"]
    assert q["quant_method"] == "compressed-tensors"
    assert q["format"] == "mxfp4-pack-quantized"
    assert CompressionFormat(q["format"]) is CompressionFormat.mxfp4_pack_quantized
    assert isinstance(q["ignore"], list) and q["ignore"]
    parsed = QuantizationConfig.model_validate(q)
    assert parsed.format == "mxfp4-pack-quantized"
    assert parsed.ignore == q["ignore"]
    assert len(parsed.config_groups) == 1
    (scheme,) = parsed.config_groups.values()
    assert scheme.targets == ["Linear"]
    assert scheme.format == "mxfp4-pack-quantized"
    w = scheme.weights
    assert (w.num_bits, str(w.type), w.group_size, str(w.strategy)) == (4, "float", 32, "group")
    assert w.symmetric is True and w.dynamic is False
    assert w.scale_dtype == torch.uint8
    assert scheme.input_activations is None and scheme.output_activations is None
    raw_w = q["config_groups"]["group_0"]["weights"]
    assert raw_w["group_size"] == 32 and raw_w["scale_dtype"] in ("torch.uint8", "uint8")


def test_the_real_ignore_list_misses_the_latent_and_attn_res_projections(ckpt, cfg):
    """compressed-tensors quantizes every Linear not matched by `ignore`. The real list (kept verbatim) leaves
    the routed experts and also the latent projections and AttnRes projections, which the checkpoint stores
    in bf16; `smoke.unquantized_modules` names exactly those for a plain transformers load."""
    from compressed_tensors.utils.match import match_name

    from modelopt_ext.models.kimi_k3.standin.configuration_kimi_k3 import KimiK3Config
    from modelopt_ext.models.kimi_k3.standin.modeling_kimi_k3 import KimiK3ForConditionalGeneration
    from modelopt_ext.models.kimi_k3.standin.smoke import unquantized_modules

    config = KimiK3Config.from_pretrained(str(ckpt))
    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(config)
    ignore = cfg["text_config"]["quantization_config"]["ignore"]
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears
    targeted = {n for n in linears if not any(match_name(n, t) for t in ignore)}
    experts = {n for n in linears if EXPERT_RE.match(n + ".weight")}
    missed = {n for n in linears if re.search(r"(routed_expert_(down|up)_proj|_res_proj)$", n)}
    assert experts and missed and targeted == experts | missed
    stored = {k[: -len(".weight_packed")] for k in _read_tensors(ckpt) if k.endswith(".weight_packed")}
    assert stored == experts, "only the routed experts are stored packed"
    extra = set(unquantized_modules(str(ckpt), ignore))
    assert missed <= extra and not extra & experts


def test_default_sizes_meet_the_brief(cfg, tensors):
    text = cfg["text_config"]
    n = text["num_hidden_layers"]
    layer0 = [k for k in tensors if k.startswith("language_model.model.layers.0.")]
    assert not any(".block_sparse_moe." in k for k in layer0)
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in tensors
    assert any(k.endswith("self_attn.A_log") for k in tensors)
    assert any(k.endswith("self_attn.kv_b_proj.weight") for k in tensors)
    assert text["linear_attn_config"]["kda_layers"] and text["linear_attn_config"]["full_attn_layers"]
    assert n // text["attn_res_block_size"] >= 2
    assert text["num_experts"] == 16 and text["num_experts_per_token"] == 4
    assert text["num_shared_experts"] >= 1
    assert text["first_k_dense_replace"] == 1
    assert text["routed_expert_hidden_size"] < text["hidden_size"]
    for name in ("hidden_size", "routed_expert_hidden_size", "moe_intermediate_size"):
        assert text[name] % 32 == 0, name
    assert {int(m.group(2)) for k in tensors if (m := EXPERT_RE.match(k))} == set(range(16))


# ----------------------------------------------------------------------------------------------------
# tensors


def test_index_matches_shards(ckpt, tensors):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert weight_map == {k: v["shard"] for k, v in tensors.items()}
    assert set(weight_map.values()) == set(_shards(ckpt))
    total = sum(DTYPE_BYTES[v["dtype"]] * torch.Size(v["shape"]).numel() for v in tensors.values())
    assert index["metadata"]["total_size"] == total


def test_layout_and_dtypes(ckpt):
    _check_layout(ckpt)


def test_no_plain_expert_weights(tensors):
    expert_keys = [k for k in tensors if ".experts." in k]
    assert expert_keys
    for k in expert_keys:
        assert re.search(r"\.experts\.\d+\.w[123]\.weight_(packed|scale)$", k), k


def test_fp32_tensors(tensors):
    fp32 = {k for k, v in tensors.items() if v["dtype"] == "F32"}
    suffixes = {re.search(FP32_RE, k).group(1) for k in fp32}
    assert suffixes == {".A_log", ".dt_bias", "_conv1d.weight", ".o_norm.weight", ".e_score_correction_bias"}
    for k in fp32:
        if k.endswith("_conv1d.weight"):
            shape = tensors[k]["shape"]
            assert len(shape) == 3 and shape[1:] == [1, 4], (k, shape)


def test_a_log_is_padded(ckpt, cfg, tensors):
    la = cfg["text_config"]["linear_attn_config"]
    heads, head_dim = la["num_heads"], la["head_dim"]
    assert head_dim > heads
    keys = [k for k in tensors if k.endswith("self_attn.A_log")]
    assert len(keys) == len(la["kda_layers"])
    for k in keys:
        assert tensors[k]["shape"] == [head_dim]
        a = _tensor(ckpt, k, tensors[k]["shard"])
        assert a.dtype == torch.float32
        assert torch.all(a[:heads] != 0), k
        assert torch.all(torch.isfinite(a[:heads])), k
        assert torch.equal(a[heads:], torch.zeros(head_dim - heads)), k


def test_scales_are_never_nan_byte(ckpt, tensors):
    n = 0
    for k, v in tensors.items():
        if k.endswith(".weight_scale"):
            s = _tensor(ckpt, k, v["shard"])
            assert s.dtype == torch.uint8
            assert not bool((s == 255).any()), k
            n += 1
    assert n > 0


def test_expert_dequantizes_to_plausible_values(ckpt, cfg, tensors):
    text = cfg["text_config"]
    layer = text["first_k_dense_replace"]
    for w, in_features in (("w1", text["routed_expert_hidden_size"]), ("w2", text["moe_intermediate_size"])):
        stem = f"language_model.model.layers.{layer}.block_sparse_moe.experts.3.{w}."
        packed = _tensor(ckpt, stem + "weight_packed", tensors[stem + "weight_packed"]["shard"])
        scale = _tensor(ckpt, stem + "weight_scale", tensors[stem + "weight_scale"]["shard"])
        assert packed.dtype == torch.uint8 and scale.dtype == torch.uint8
        deq = dequantize_mxfp4(packed, scale, torch.float32)
        assert deq.shape[-1] == in_features
        assert torch.isfinite(deq).all()
        std, target = deq.std().item(), in_features**-0.5
        assert 0.3 * target < std < 3 * target, (w, std, target)
        assert deq.abs().mean().item() > 0


def test_experts_differ_between_experts_and_layers(ckpt, tensors):
    """Values depend on the tensor name: two experts (or two layers) must not share bytes."""
    def packed(layer, e):
        k = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.w1.weight_packed"
        return _tensor(ckpt, k, tensors[k]["shard"])

    assert not torch.equal(packed(1, 0), packed(1, 1))
    assert not torch.equal(packed(1, 0), packed(2, 0))


# ----------------------------------------------------------------------------------------------------
# refusals


BAD_SIZES = [
    (dict(hidden_size=100), "hidden_size=100"),
    (dict(hidden_size=0), "hidden_size=0"),
    (dict(latent_size=48), "latent_size=48"),
    (dict(moe_intermediate_size=40), "moe_intermediate_size=40"),
    (dict(latent_size=256), "latent_size=256"),
    (dict(top_k=17), "top_k=17"),
    (dict(top_k=0), "top_k=0"),
    (dict(num_experts=0, top_k=0), "num_experts=0"),
    (dict(num_layers=1), "num_layers=1"),
    (dict(vocab_size=100), "vocab_size=100"),
]


@pytest.mark.parametrize("kwargs,needle", BAD_SIZES, ids=[n for _, n in BAD_SIZES])
def test_bad_sizes_refused_nothing_written(tmp_path, kwargs, needle):
    parent = tmp_path / "parent"
    parent.mkdir()
    target = parent / "out"
    with pytest.raises(ValueError) as err:
        make_tiny(target, sizes=TinySizes(**kwargs))
    assert needle in str(err.value)
    assert not target.exists()
    assert list(parent.iterdir()) == []


@pytest.mark.parametrize("kwargs,needle", BAD_SIZES[:1] + BAD_SIZES[-1:], ids=["hidden", "vocab"])
def test_bad_sizes_with_force_leave_existing_dir(tmp_path, kwargs, needle):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("old")
    with pytest.raises(ValueError, match=re.escape(needle)):
        make_tiny(target, sizes=TinySizes(**kwargs), force=True)
    assert _files(target) == {"keep.txt": b"old"}
    assert _siblings_tmp(tmp_path) == []


def test_non_empty_dir_without_force(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "stray.bin").write_bytes(b"\x00\x01")
    (target / "config.json").write_text("{}")
    before = _files(target)
    with pytest.raises(FileExistsError) as err:
        make_tiny(target)
    assert str(target) in str(err.value)
    assert _files(target) == before
    assert _siblings_tmp(tmp_path) == []


def test_non_empty_dir_with_force_is_replaced(tmp_path, ckpt):
    target = tmp_path / "out"
    target.mkdir()
    (target / "stray.bin").write_bytes(b"stale")
    (target / "config.json").write_text("{}")
    make_tiny(target, force=True)
    assert not (target / "stray.bin").exists()
    assert _files(target) == _files(ckpt)
    assert _siblings_tmp(tmp_path) == []


def test_empty_existing_dir_is_accepted(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    make_tiny(target, sizes=TinySizes(num_layers=2, num_experts=2, top_k=1))
    assert (target / "config.json").is_file()
    assert _siblings_tmp(tmp_path) == []


@pytest.mark.parametrize("force", [False, True])
def test_out_dir_is_a_regular_file(tmp_path, force):
    target = tmp_path / "out"
    target.write_bytes(b"not a dir")
    with pytest.raises(FileExistsError) as err:
        make_tiny(target, force=force)
    assert str(target) in str(err.value)
    assert target.read_bytes() == b"not a dir"
    assert _siblings_tmp(tmp_path) == []


def test_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    """An error after the temp folder exists removes it and keeps the old contents (force=True)."""
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("old")

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(generate, "write_shards", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        make_tiny(target, force=True)
    assert _files(target) == {"keep.txt": b"old"}
    assert _siblings_tmp(tmp_path) == []
    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError, match="disk full"):
        make_tiny(fresh)
    assert not fresh.exists()
    assert _siblings_tmp(tmp_path) == []


# ----------------------------------------------------------------------------------------------------
# custom sizes


CUSTOM = [
    TinySizes(num_layers=4, hidden_size=64, num_experts=8, top_k=2),
    TinySizes(num_layers=3, hidden_size=128, latent_size=96, moe_intermediate_size=96, num_experts=4, top_k=4,
              vocab_size=400),
]


@pytest.mark.parametrize("sizes", CUSTOM, ids=["l4-h64-e8-k2", "l3-h128-lat96-i96-e4-k4"])
def test_custom_sizes_consistent(tmp_path, sizes):
    out = make_tiny(tmp_path / "c", seed=5, sizes=sizes)
    text = _config(out)["text_config"]
    assert text["num_hidden_layers"] == sizes.num_layers
    assert text["hidden_size"] == sizes.hidden_size
    assert text["routed_expert_hidden_size"] == sizes.latent
    assert text["moe_intermediate_size"] == sizes.moe_intermediate_size
    assert text["num_experts"] == sizes.num_experts
    assert text["num_experts_per_token"] == sizes.top_k
    assert text["vocab_size"] == sizes.vocab_size
    full, kda = text["linear_attn_config"]["full_attn_layers"], text["linear_attn_config"]["kda_layers"]
    assert sorted(full + kda) == list(range(1, sizes.num_layers + 1))
    _check_layout(out)
    tensors = _read_tensors(out)
    experts = {(int(m.group(1)), int(m.group(2))) for k in tensors if (m := EXPERT_RE.match(k))}
    assert experts == {(i, e) for i in range(1, sizes.num_layers) for e in range(sizes.num_experts)}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {k: v["shard"] for k, v in tensors.items()}


def test_config_json_has_the_public_configs_keys_and_layout(ckpt):
    """Same keys per section as the public config.json (less what transformers 5 keeps elsewhere), the same
    value types, and the compressed-tensors config where the real file keeps it: in text_config only."""
    from modelopt_ext.models.kimi_k3.config_check import NOT_KEPT_BY_TRANSFORMERS_5
    from modelopt_ext.models.kimi_k3.sizes import BUNDLED_CONFIG

    real = json.loads(BUNDLED_CONFIG.read_text())
    ours = json.loads((ckpt / "config.json").read_text())
    assert "quantization_config" not in ours
    assert ours["text_config"]["quantization_config"] == real["text_config"]["quantization_config"]
    for section in (None, "text_config", "vision_config"):
        r, o = (real, ours) if section is None else (real[section], ours[section])
        expected = set(r) - NOT_KEPT_BY_TRANSFORMERS_5.get(section, set())
        extra = set(o) - set(r)
        # transformers 5 writes its generic fields into every sub-config dict; the public vision_config lacks them
        generic = {"_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "id2label",
                   "is_encoder_decoder", "label2id", "model_type", "output_attentions", "output_hidden_states",
                   "problem_type", "return_dict", "transformers_version"}
        assert expected <= set(o), (section, sorted(expected - set(o)))
        assert extra <= generic, (section, sorted(extra - generic))
        for key in expected:
            assert type(o[key]) is type(r[key]) or r[key] is None or o[key] is None, (section, key)

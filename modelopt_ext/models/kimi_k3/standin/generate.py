"""Generator of the tiny Kimi-K3 stand-in checkpoint (`modelopt-ext make-tiny kimi_k3 OUT_DIR`).

Writes the same files, class names, keys, dtypes and quantization format as the real checkpoint, every
size shrunk: config.json (auto_map + compressed-tensors MXFP4 quantization_config), the remote-code
files, sharded safetensors with an index, generation_config.json and a local tokenizer. Routed experts
are stored MXFP4 (`weight_packed` / `weight_scale`), everything else bf16, except the fp32 KDA
parameters and router bias. Values depend only on (seed, tensor name): the same seed gives
byte-identical files. `fit_steps` > 0 (`--fit N`) first fits those values to the embedded corpus (`fit.py`);
the same (seed, steps, sizes) again gives byte-identical files.

For benchmarks at real widths (`scripts/bench_rank_share.py`): `text_overrides` sets text_config fields the
sizes do not cover (the real attention shapes, dense MLP width, shared experts), and `workers` / `quantize_device`
compute the values on threads and quantize the experts on a GPU. Neither changes a byte: every tensor's values
come from its own generator, and MXFP4 quantization is exact integer and power-of-two arithmetic on any device.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from modelopt_ext.formats.mxfp4 import GROUP_SIZE, quantize_mxfp4
from modelopt_ext.standin import tokenizer as tok
from modelopt_ext.standin.files import prepare_out_dir, publish, staging_dir

from .configuration_kimi_k3 import KimiK3Config
from .modeling_kimi_k3 import KimiK3ForConditionalGeneration

logger = logging.getLogger(__name__)

STANDIN_DIR = Path(__file__).parent
PUBLIC_CONFIG = STANDIN_DIR.parent / "kimi_k3_config.json"  # the public config.json, key for key
REMOTE_CODE_FILES = ("configuration_kimi_k3.py", "modeling_kimi_k3.py", "modeling_kimi_linear.py")
TEXT_PREFIX = "language_model.model.layers."
EXPERT_KEY = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
FP32_KEYS = re.compile(r"(A_log|dt_bias|conv1d\.weight|o_norm\.weight|e_score_correction_bias)$")
# The real checkpoint's quantization config (text_config.quantization_config of config.json): MXFP4 weights
# (group 32, E8M0 uint8 scales) for every Linear not ignored. Its ignore list, verbatim, does not name the
# latent projections `routed_expert_{down,up}_proj` nor the AttnRes `*_res_proj` Linears, which the
# checkpoint nevertheless stores in bf16 (docs/standin.md: "The real ignore list").
IGNORE = [
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    "re:.*lm_head.*",
    "re:.*vision_tower.*",
    "re:.*mm_projector.*",
]


@dataclasses.dataclass(frozen=True)
class TinySizes:
    """Sizes of the stand-in. Defaults: dense layer 0, KDA and MLA layers, three AttnRes blocks."""

    num_layers: int = 6
    hidden_size: int = 128
    latent_size: int | None = None  # default: hidden_size // 2
    moe_intermediate_size: int = 64
    num_experts: int = 16
    top_k: int = 4
    vocab_size: int = 512

    @property
    def latent(self) -> int:
        return self.latent_size if self.latent_size is not None else self.hidden_size // 2

    def validate(self) -> None:
        """Refuse sizes the checkpoint format cannot hold, naming the value."""
        for name, value in (
            ("hidden_size", self.hidden_size),
            ("latent_size", self.latent),
            ("moe_intermediate_size", self.moe_intermediate_size),
        ):
            if value <= 0 or value % GROUP_SIZE:
                raise ValueError(f"{name}={value} must be a positive multiple of the MXFP4 group size {GROUP_SIZE}")
        if self.latent > self.hidden_size:
            raise ValueError(f"latent_size={self.latent} must not exceed hidden_size={self.hidden_size}")
        if self.num_layers < 2:
            raise ValueError(f"num_layers={self.num_layers}: need the dense layer 0 and at least one MoE layer")
        if self.num_experts < 1:
            raise ValueError(f"num_experts={self.num_experts} must be at least 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")
        if self.vocab_size < tok.MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size={self.vocab_size} is below the tokenizer minimum {tok.MIN_VOCAB_SIZE}")


# text_config fields `TinySizes` owns (or the layer schedule derives from): not settable by `text_overrides`.
SIZES_OWN = ("vocab_size", "hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_token",
             "moe_intermediate_size", "routed_expert_hidden_size")


def _apply_text_overrides(text: dict, overrides: Mapping[str, Any]) -> None:
    """`text` updated by `overrides` (`linear_attn_config` merged key by key, without its layer lists); refuses
    the fields `TinySizes` owns and values that are not positive where a size is meant."""
    for key, value in overrides.items():
        if key in SIZES_OWN:
            raise ValueError(f"text_overrides[{key!r}]: set it through TinySizes, not text_overrides")
        if key == "linear_attn_config":
            if not isinstance(value, Mapping) or {"kda_layers", "full_attn_layers"} & set(value):
                raise ValueError(f"text_overrides['linear_attn_config'] must be a mapping without the layer lists, "
                                 f"got {value!r}")
            text[key] = {**text[key], **value}
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            raise ValueError(f"text_overrides[{key!r}]={value} must be positive")
        text[key] = value


def build_config(sizes: TinySizes, special_ids: dict[str, int],
                 text_overrides: Mapping[str, Any] | None = None) -> KimiK3Config:
    """The stand-in's KimiK3Config: real field names and structure, tiny sizes (`text_overrides`: more
    text_config fields, e.g. Kimi-K3's real attention shapes; see `_apply_text_overrides`)."""
    n = sizes.num_layers
    full = list(range(3, n + 1, 3)) or [n]
    text = dict(
        vocab_size=sizes.vocab_size,
        hidden_size=sizes.hidden_size,
        intermediate_size=2 * sizes.hidden_size,
        num_hidden_layers=n,
        num_attention_heads=4,
        num_key_value_heads=4,
        # 128 as KDA's head_dim below: the serving engines fuse q_a_proj in front of kv_a_proj_with_mqa (and
        # f_a_proj, head_dim rows, in front of b_proj), so FP8 128x128 blocks must not straddle the two, as
        # at Kimi-K3's sizes (q_lora_rank 1536, head_dim 128)
        q_lora_rank=128,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=sizes.num_experts,
        num_experts_per_token=sizes.top_k,
        moe_intermediate_size=sizes.moe_intermediate_size,
        num_shared_experts=1,
        routed_expert_hidden_size=sizes.latent,
        attn_res_block_size=2,
        bos_token_id=special_ids["[BOS]"],
        eos_token_id=special_ids["[EOS]"],
        pad_token_id=special_ids["[PAD]"],
        linear_attn_config={
            "full_attn_layers": full,
            "kda_layers": [i for i in range(1, n + 1) if i not in full],
            "num_heads": 2,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        },
    )
    if text_overrides:
        _apply_text_overrides(text, text_overrides)
    text["architectures"] = ["KimiLinearForCausalLM"]
    text["auto_map"] = {
        "AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
        "AutoModel": "modeling_kimi_linear.KimiLinearModel",
        "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM",
    }
    text["dtype"] = "bfloat16"
    vision = dict(
        vt_hidden_size=64, vt_intermediate_size=128, vt_num_hidden_layers=2, vt_num_attention_heads=4,
        qkv_hidden_size=96, mm_hidden_size=64, text_hidden_size=sizes.hidden_size, patch_size=14,
        init_pos_emb_height=16, init_pos_emb_width=16,
    )
    return KimiK3Config(
        text_config=text,
        vision_config=vision,
        media_placeholder_token_id=special_ids[tok.IMAGE_TOKEN],
        bos_token_id=special_ids["[BOS]"],
        eos_token_id=special_ids["[EOS]"],
        pad_token_id=special_ids["[PAD]"],
        image_placeholder="<|kimi_image_placeholder|>",  # the processor's prompt marker, as the real config
        architectures=["KimiK3ForConditionalGeneration"],
        auto_map={
            "AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        },
        dtype="bfloat16",
    )


def quantization_config() -> dict:
    """The real checkpoint's `text_config.quantization_config`, field for field."""
    weights = {
        "num_bits": 4, "type": "float", "symmetric": True, "group_size": GROUP_SIZE, "strategy": "group",
        "dynamic": False, "actorder": None, "observer": "minmax", "scale_dtype": "torch.uint8",
        "block_structure": None, "observer_kwargs": {}, "zp_dtype": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"], "weights": weights, "input_activations": None,
                "output_activations": None, "format": "mxfp4-pack-quantized",
            }
        },
        "ignore": IGNORE,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def with_public_generic_fields(config_dict: dict) -> dict:
    """`config_dict` plus the generic fields the public config.json carries and transformers 5 does not write
    (`is_decoder`, `pruned_heads`, `tokenizer_class`, ... as transformers 4.56 serialized them), with the
    public values, so that config.json has the public file's keys; the generation defaults transformers 5
    keeps elsewhere (`NOT_KEPT_BY_TRANSFORMERS_5`) stay out."""
    from modelopt_ext.models.kimi_k3.config_check import NOT_KEPT_BY_TRANSFORMERS_5

    public = json.loads(PUBLIC_CONFIG.read_text())
    out = json.loads(json.dumps(config_dict))
    for section in (None, "text_config", "vision_config"):
        ours, theirs = (out, public) if section is None else (out[section], public[section])
        skip = NOT_KEPT_BY_TRANSFORMERS_5.get(section, set()) | {"text_config", "vision_config", "quantization_config"}
        for key, value in theirs.items():
            if key not in ours and key not in skip:
                ours[key] = value
    return out


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _values(name: str, shape: torch.Size, seed: int, config: KimiK3Config) -> torch.Tensor:
    """Deterministic fp32 values for one parameter, scaled to keep activations O(1)."""
    g = _generator(seed, name)
    randn = torch.randn(shape, generator=g, dtype=torch.float32)
    leaf = name.rsplit(".", 2)
    if name.endswith("A_log"):
        heads = config.text_config.linear_attn_config["num_heads"]
        a_log = torch.zeros(shape)
        a_log[:heads] = torch.rand(heads, generator=g).mul(15).add(1).log()
        return a_log
    if name.endswith("dt_bias") or name.endswith("e_score_correction_bias"):
        return randn * 0.1
    if name.endswith("conv1d.weight"):
        return randn * 0.5
    if "norm" in leaf[-2] and leaf[-1] == "weight":
        return 1.0 + 0.1 * randn
    if leaf[-1] == "bias" or name.endswith("pos_emb.weight"):
        return randn * 0.02
    if name.endswith("embed_tokens.weight"):
        return randn
    fan_in = shape[1:].numel() if len(shape) > 1 else shape[0]
    return randn * fan_in**-0.5


def _map(fn, items: list, workers: int) -> list:
    """`[fn(*item) for item in items]`, on `workers` threads when more than 1 (torch releases the GIL)."""
    if workers <= 1:
        return [fn(*item) for item in items]
    threads = torch.get_num_threads()
    try:  # one intra-op thread per worker: `workers` OpenMP teams of all cores would oversubscribe them
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="make-tiny",
                                                   initializer=torch.set_num_threads, initargs=(1,)) as pool:
            return list(pool.map(lambda item: fn(*item), items))
    finally:
        torch.set_num_threads(threads)


def initial_values(config: KimiK3Config, seed: int, workers: int = 1) -> dict[str, torch.Tensor]:
    """The random fp32 value of every parameter, keyed as the model's state dict, in sorted key order
    (`workers` threads: the same values, each tensor has its own generator)."""
    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(config)
    shapes = sorted((name, param.shape) for name, param in model.state_dict().items())
    values = _map(lambda name, shape: _values(name, shape, seed, config), shapes, workers)
    return {name: value for (name, _), value in zip(shapes, values)}


def _pack_one(name: str, value: torch.Tensor, device: torch.device | None) -> dict[str, torch.Tensor]:
    if EXPERT_KEY.search(name):
        packed, scale = quantize_mxfp4(value if device is None else value.to(device))
        stem = name[: -len("weight")]
        return {stem + "weight_packed": packed.cpu(), stem + "weight_scale": scale.cpu()}
    if FP32_KEYS.search(name):
        return {name: value.contiguous()}
    return {name: value.to(torch.bfloat16)}


def pack_state_dict(values: dict[str, torch.Tensor], workers: int = 1,
                    quantize_device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint tensors from fp32 values, keyed and typed as the real checkpoint stores them: routed experts
    MXFP4 (`weight_packed` / `weight_scale`), the KDA parameters and router bias fp32, the rest bf16.
    `workers` threads and `quantize_device` (the experts quantized there, e.g. "cuda") give the same bytes."""
    device = None if quantize_device is None else torch.device(quantize_device)
    if device is not None and device.type == "cpu":
        device = None
    items = sorted(values.items())
    state = {}
    for part in _map(lambda name, value: _pack_one(name, value, device), items, 1 if device else workers):
        state.update(part)
    return state


def build_state_dict(config: KimiK3Config, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of the random stand-in, keyed and typed as the real checkpoint stores them."""
    return pack_state_dict(initial_values(config, seed))


def _shard_of(key: str, num_layers: int, layers_per_shard: int) -> int:
    if key.startswith(TEXT_PREFIX):
        return int(key[len(TEXT_PREFIX) :].split(".", 1)[0]) // layers_per_shard
    if key.startswith("language_model.lm_head") or key.startswith("language_model.model.norm") or (
        key.startswith("language_model.model.output_attn_res")
    ):
        return (num_layers - 1) // layers_per_shard
    return 0  # embeddings, vision tower, mm_projector


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_shards(out: Path, state: dict[str, torch.Tensor], num_layers: int, layers_per_shard: int = 2) -> None:
    num_shards = (num_layers - 1) // layers_per_shard + 1
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    for key, tensor in state.items():
        shards[_shard_of(key, num_layers, layers_per_shard)][key] = tensor
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for key, tensor in shard.items():
            weight_map[key] = fname
            total += tensor.numel() * tensor.element_size()
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def make_tiny(out_dir: str | Path, seed: int = 0, sizes: TinySizes = TinySizes(), force: bool = False,
              fit_steps: int = 0, *, text_overrides: Mapping[str, Any] | None = None, workers: int = 1,
              quantize_device: str | torch.device | None = None) -> Path:
    """Write the stand-in checkpoint into `out_dir` (built in a temporary sibling, then moved in place).

    With `fit_steps` > 0 the random weights are first fitted to the embedded corpus for that many optimizer
    steps (`fit.fit_values`), then stored exactly as random ones; 0 writes the random stand-in.
    `text_overrides` sets more text_config fields (`build_config`); `workers` (threads) and `quantize_device`
    only make generation faster (same bytes; see the module doc).

    Raises ValueError for sizes the format cannot hold and FileExistsError for a non-empty `out_dir`
    without `force`; in both cases nothing is written.
    """
    sizes.validate()
    if workers < 1:
        raise ValueError(f"workers={workers} must be at least 1")
    if text_overrides:
        _apply_text_overrides({"linear_attn_config": {}}, text_overrides)  # refuse bad overrides before writing
    if fit_steps < 0:
        raise ValueError(f"fit_steps={fit_steps} must be at least 0")
    out_dir = Path(out_dir).resolve()  # "." or "x/.." must not make the temp dir live inside the target
    prepare_out_dir(out_dir, force)
    tmp = staging_dir(out_dir)
    try:
        special_ids = tok.write_tokenizer(tmp, sizes.vocab_size)
        config = build_config(sizes, special_ids, text_overrides)
        config_dict = with_public_generic_fields(config.to_dict())
        config_dict["text_config"]["quantization_config"] = quantization_config()  # where the real one keeps it
        _write_json(tmp / "config.json", config_dict)
        text = config.text_config
        _write_json(
            tmp / "generation_config.json",
            {"bos_token_id": text.bos_token_id, "eos_token_id": text.eos_token_id,
             "pad_token_id": text.pad_token_id, "do_sample": False, "max_new_tokens": 64},
        )
        for fname in REMOTE_CODE_FILES:
            shutil.copyfile(STANDIN_DIR / fname, tmp / fname)
        logger.info("generating tiny kimi_k3 weights (seed %d, %s)", seed, sizes)
        values = initial_values(config, seed, workers)
        if fit_steps:
            from .fit import fit_values

            values = fit_values(config, values, tmp, fit_steps, seed).values
        write_shards(tmp, pack_state_dict(values, workers, quantize_device), sizes.num_layers)
        publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote tiny kimi_k3 checkpoint to %s", out_dir)
    return out_dir

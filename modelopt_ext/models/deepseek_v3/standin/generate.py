"""Generator of the tiny DeepSeek-V3 stand-in checkpoint.

Writes what the public deepseek-ai/DeepSeek-V3 checkpoint holds, every size shrunk and the structure kept:

- `config.json`: the real config.json key for key (`deepseek_v3_config.json`: model_type `deepseek_v3`,
  architectures `DeepseekV3ForCausalLM`, the FP8 `quantization_config`, yarn `rope_scaling`, sigmoid
  `noaux_tc` routing with `n_group` / `topk_group`, `first_k_dense_replace`, MLA ranks, shared experts,
  `routed_scaling_factor`, `norm_topk_prob`, one MTP layer), without `auto_map`: the stand-in ships no remote
  code and loads with transformers' native classes. The head dims (nope 128, rope 64, v 128), the yarn
  parameters and `max_position_embeddings` are the real ones; `TinySizes` sets the rest.
- the tensors of `layout.layout(config)`: the real names, shapes and dtypes (FP8 E4M3 Linears with float32
  `weight_scale_inv` per 128x128 block, bf16 embeddings / head / norms / router weight / MTP extras, float32
  router bias), sharded one decoder layer a file (`model-00001-of-000005.safetensors` by default, DeepSeek's naming;
  embeddings in the first, final norm and lm_head with the last decoder layer, each MTP layer in a file of its
  own, last, as in the real checkpoint) with a `model.safetensors.index.json`.
- `generation_config.json`, and a byte-level BPE tokenizer trained offline on the embedded corpus (the
  Kimi-K3 stand-in's builder, `modelopt_ext.standin.tokenizer`: its [BOS] and [EOS] get ids 0 and 1, DeepSeek-V3's
  bos/eos ids; its chat markers are Kimi's, which Kimi-K2 uses and DeepSeek-V3 does not).

Widths that are multiples of 128 in the real model are multiples of 128 here, so every FP8 block is whole
except where the real model has a partial one: `kv_a_proj_with_mqa` has kv_lora_rank + 64 rows (real: 576 =
4 x 128 + 64; default here: 192 = 128 + 64), the last row block 64 rows high.

Weights are Gaussian, 1/sqrt(fan_in) for matrices, with values that depend only on sha256(seed:name) (the MTP
layer's embeddings and head are copies of the main ones, as in the real checkpoint); each FP8 weight is
quantized per block with scale = amax / 448 (`fp8.quantize_blocks`). The same seed and sizes give
byte-identical files. `fit_steps` > 0 first fits the random weights to the embedded corpus (`fit.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from modelopt_ext.formats.fp8_block import BLOCK, quantize_blocks
from modelopt_ext.standin import tokenizer as tok
from modelopt_ext.standin.files import prepare_out_dir, publish, staging_dir

from .. import layout as L
from ..config_check import config_problems
from ..sizes import BUNDLED_CONFIG

logger = logging.getLogger(__name__)

FAMILY = "deepseek_v3"
WIDTHS_IN_BLOCKS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank")


@dataclasses.dataclass(frozen=True)
class TinySizes:
    """Sizes of the stand-in (DeepSeek-V3's in the comments). Defaults: layer 0 dense, layers 1-3 MoE, one
    MTP layer (layer 4), 16 experts in 4 groups of which a token may use 2, top-4."""

    num_layers: int = 4  # 61
    first_k_dense_replace: int = 1  # 3
    hidden_size: int = 256  # 7168
    intermediate_size: int = 512  # 18432 (dense MLP)
    moe_intermediate_size: int = 256  # 2048 (each routed and shared expert)
    num_experts: int = 16  # 256
    top_k: int = 4  # 8
    n_group: int = 4  # 8
    topk_group: int = 2  # 4
    num_heads: int = 2  # 128
    q_lora_rank: int = 128  # 1536
    kv_lora_rank: int = 128  # 512
    num_mtp_layers: int = 1  # 1
    vocab_size: int = 512  # 129280

    def config_values(self) -> dict[str, int]:
        """The config.json fields these sizes set."""
        return {
            "num_hidden_layers": self.num_layers, "first_k_dense_replace": self.first_k_dense_replace,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size, "n_routed_experts": self.num_experts,
            "num_experts_per_tok": self.top_k, "n_group": self.n_group, "topk_group": self.topk_group,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_heads,
            "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
            "num_nextn_predict_layers": self.num_mtp_layers, "vocab_size": self.vocab_size,
        }

    def validate(self) -> None:
        """Refuse sizes the real structure or the FP8 block format cannot take, naming every value."""
        problems = []
        for name in WIDTHS_IN_BLOCKS:
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0 and value % BLOCK == 0):
                problems.append(f"{name}={value} must be a positive multiple of {BLOCK}, as in the real model, so "
                                "that only kv_a_proj_with_mqa has a partial FP8 block")
        if not (isinstance(self.num_heads, int) and self.num_heads > 0 and self.num_heads % 2 == 0):
            problems.append(f"num_heads={self.num_heads} must be a positive even number: q_b_proj has num_heads x "
                            f"192 rows, a multiple of {BLOCK} as in the real model only for an even count")
        if not (0 <= self.first_k_dense_replace < self.num_layers):
            problems.append(f"first_k_dense_replace={self.first_k_dense_replace} must be at least 0 and below "
                            f"num_layers={self.num_layers} (at least one MoE layer)")
        if self.num_mtp_layers < 0:
            problems.append(f"num_mtp_layers={self.num_mtp_layers} must be at least 0")
        if self.vocab_size < tok.MIN_VOCAB_SIZE:
            problems.append(f"vocab_size={self.vocab_size} is below the tokenizer minimum {tok.MIN_VOCAB_SIZE}")
        if not problems:  # the router's constraints (groups, top-k), as the family's config check states them
            problems += config_problems(build_config(self, {"[BOS]": 0, "[EOS]": 1}))
        if problems:
            raise ValueError("deepseek_v3 stand-in sizes: " + "; ".join(problems))


def size_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(TinySizes)]


def resolve_sizes(sizes: TinySizes | Mapping[str, int] | None) -> TinySizes:
    """`sizes` as TinySizes: None gives the defaults, a mapping overrides fields (unknown names refused)."""
    if sizes is None:
        return TinySizes()
    if isinstance(sizes, TinySizes):
        return sizes
    if not isinstance(sizes, Mapping):
        raise ValueError(f"deepseek_v3 stand-in: sizes must be a mapping of field -> int, got {type(sizes).__name__}")
    unknown = sorted(set(sizes) - set(size_fields()))
    if unknown:
        raise ValueError(f"deepseek_v3 stand-in: no size {', '.join(unknown)} (it has {', '.join(size_fields())})")
    return TinySizes(**sizes)


def public_config() -> dict[str, Any]:
    """DeepSeek-V3's public config.json (bundled)."""
    return json.loads(BUNDLED_CONFIG.read_text())


def build_config(sizes: TinySizes, special_ids: Mapping[str, int]) -> dict[str, Any]:
    """The stand-in's config.json: the public one, key for key and in its order, without `auto_map`, with the
    sizes and the tokenizer's bos/eos ids."""
    config = {k: v for k, v in public_config().items() if k != "auto_map"}
    values = {**sizes.config_values(), "bos_token_id": special_ids["[BOS]"], "eos_token_id": special_ids["[EOS]"]}
    missing = sorted(set(values) - set(config))
    if missing:  # the public config has every field the sizes set
        raise AssertionError(f"public DeepSeek-V3 config lacks {missing}")
    config.update(values)
    return config


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic fp32 values of one tensor, scaled to keep activations O(1)."""
    randn = torch.randn(shape, generator=_generator(seed, name), dtype=torch.float32)
    if name.endswith("e_score_correction_bias"):
        return randn * 0.1
    if name.endswith("norm.weight"):  # every RMSNorm: layer norms, q/kv LoRA norms, enorm/hnorm, shared_head.norm
        return 1.0 + 0.1 * randn
    if name.endswith("embed_tokens.weight"):
        return randn
    return randn * shape[-1] ** -0.5


# MTP tensors that are copies of main-model tensors in the real checkpoint (the MTP layer shares them)
_MTP_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def logical_tensors(config: Mapping[str, Any]) -> list[L.Tensor]:
    """The checkpoint's tensors without the FP8 scales (what values are drawn for), in layout order."""
    return [t for t in L.layout(config) if not t.name.endswith("_scale_inv")]


def initial_values(config: Mapping[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The random fp32 value of every checkpoint tensor but the FP8 scales, keyed by checkpoint name."""
    values = {}
    mtp_prefixes = tuple(f"model.layers.{i}." for i in L.mtp_layer_indices(config))
    for t in logical_tensors(config):
        if t.name.startswith(mtp_prefixes):
            suffix = t.name.split(".", 3)[3]
            if suffix in _MTP_COPIES:
                continue  # filled in below
        values[t.name] = _value(t.name, t.shape, seed)
    for prefix in mtp_prefixes:
        for suffix, source in _MTP_COPIES.items():
            values[prefix + suffix] = values[source].clone()
    return values


def pack_state_dict(config: Mapping[str, Any], values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors from fp32 values, typed as `layout` says: FP8 weights quantized per 128x128 block
    (with their `weight_scale_inv`), the rest cast to bf16 or kept float32."""
    state = {}
    for t in L.layout(config):
        if t.name.endswith("_scale_inv"):
            continue  # written with its weight
        value = values[t.name]
        if tuple(value.shape) != t.shape:
            raise ValueError(f"{t.name}: value of shape {tuple(value.shape)}, the checkpoint stores {t.shape}")
        if t.dtype == L.FP8:
            state[t.name], state[t.name + "_scale_inv"] = quantize_blocks(value)
        else:
            state[t.name] = value.to(getattr(torch, t.dtype)).contiguous()
    return state


def shard_of(name: str, num_layers: int) -> int:
    """0-based shard of a key: one decoder layer a shard, embeddings with layer 0, the final norm and lm_head
    with the last decoder layer, each MTP layer (index >= num_layers) in its own shard after those."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2])
    return 0 if name.startswith("model.embed_tokens.") else num_layers - 1


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_shards(out: Path, config: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> list[str]:
    """Write the shards (in layout order) and the index; returns the shard file names."""
    num_layers = config["num_hidden_layers"]
    num_shards = num_layers + int(config.get("num_nextn_predict_layers") or 0)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    for t in L.layout(config):
        shards[shard_of(t.name, num_layers)][t.name] = state[t.name]
    names = [f"model-{i + 1:05d}-of-{num_shards:06d}.safetensors" for i in range(num_shards)]
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for key, tensor in shard.items():
            weight_map[key] = fname
            total += tensor.numel() * tensor.element_size()
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return names


def make_tiny(out_dir: str | Path, seed: int = 0, sizes: TinySizes | Mapping[str, int] | None = None,
              force: bool = False, fit_steps: int = 0) -> Path:
    """Write the stand-in checkpoint into `out_dir` (built in a temporary sibling, then moved in place).

    `sizes`: a TinySizes, or a mapping of overrides of its fields (an unknown name is a ValueError naming the
    fields). `fit_steps` > 0 fits the random weights to the embedded corpus for that many optimizer steps
    first (`fit.fit_values`). Raises ValueError for sizes the format cannot hold and FileExistsError for a
    non-empty `out_dir` without `force`; in both cases nothing is written.
    """
    sizes = resolve_sizes(sizes)
    sizes.validate()
    if not isinstance(fit_steps, int) or fit_steps < 0:
        raise ValueError(f"fit_steps={fit_steps!r} must be an int, at least 0")
    out_dir = Path(out_dir).resolve()
    prepare_out_dir(out_dir, force)
    tmp = staging_dir(out_dir)
    try:
        special_ids = tok.write_tokenizer(tmp, sizes.vocab_size)
        config = build_config(sizes, special_ids)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", {
            "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False,
            "max_new_tokens": 64,
        })
        logger.info("generating tiny deepseek_v3 weights (seed %d, %s)", seed, sizes)
        values = initial_values(config, seed)
        if fit_steps:
            from .fit import fit_values

            values = fit_values(config, values, tmp, fit_steps, seed).values
        write_shards(tmp, config, pack_state_dict(config, values))
        publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote tiny deepseek_v3 checkpoint to %s", out_dir)
    return out_dir

"""Parameter counts and stored bytes of a DeepSeek-V3-architecture checkpoint (DeepSeek-V3/R1, Kimi-K2), from
its config.json alone: closed-form, module by module of transformers' `modeling_deepseek_v3.py`.

What is counted: the model transformers builds and loads (`DeepseekV3ForCausalLM`: embeddings, the
`num_hidden_layers` decoder layers, final norm, lm_head). The multi-token-prediction layer(s) the checkpoint
also stores (`model.layers.{num_hidden_layers}.*`, `num_nextn_predict_layers`) are not loaded by transformers
and are counted apart (`mtp_parameters`, `checkpoint_totals`). Parameter counts are of the unquantized
matrices (an FP8 weight's scales are not parameters); the router's `e_score_correction_bias` counts (it is a
buffer in transformers but a stored tensor).

Stored bytes, as the checkpoint holds them: with the FP8 quantization_config every Linear of attention, dense
MLP, shared and routed experts is 1 byte a weight plus a float32 scale per 128x128 block (partial blocks
included: [ceil(out/128), ceil(in/128)]); embeddings, lm_head, norms and the router weight bf16; the
correction bias float32. Without a quantization_config the Linears are bf16.

For DeepSeek-V3 (`deepseek_v3_config.json`) this gives 671,026,419,200 parameters for the main model (the
public 671B), 11,610,068,224 unique MTP parameters beside it (DeepSeek's README_WEIGHTS.md says 11.5B,
excluding the MTP layer's copies of embeddings and head), and for the whole checkpoint 684,531,386,000
stored elements and 688,574,839,360 bytes (641.29 GiB), as the public tensor table of DeepSeek-R1 (same
layout) lists them. Kimi-K2-Instruct: 1,026,408,232,448 parameters (the public "1T"); its table's
1,026,470,731,056 elements and 958.49 GiB are `checkpoint_totals` plus 61 unread `rotary_emb.inv_freq`
tensors of 56 bf16 values (tests/models/deepseek_v3/test_sizes.py).

Bundled configs: `deepseek_v3_config.json` is the public config.json of deepseek-ai/DeepSeek-V3 and
`kimi_k2_config.json` that of moonshotai/Kimi-K2-Instruct, key for key (README.md next to this file says where
they were read).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from modelopt_ext.formats.fp8_block import BLOCK, ceil_div

BUNDLED_CONFIG = Path(__file__).with_name("deepseek_v3_config.json")
KIMI_K2_CONFIG = Path(__file__).with_name("kimi_k2_config.json")
BF16, FP32, FP8 = 2, 4, 1

EXPERT_PARTS = ("routed_experts",)
DENSE_PARTS = ("shared_experts", "routers", "mla_attention", "dense_mlp", "norms", "embeddings", "lm_head")


def _get(config: Mapping[str, Any], key: str):
    try:
        return config[key]
    except KeyError:
        raise ValueError(f"DeepSeek-V3 config: config.json has no {key!r}") from None


class _Dims:
    """The config.json fields the formulas read."""

    def __init__(self, config: Mapping[str, Any]):
        g = lambda key: _get(config, key)  # noqa: E731
        self.H, self.V, self.n = g("hidden_size"), g("vocab_size"), g("num_hidden_layers")
        self.dense_inter, self.I = g("intermediate_size"), g("moe_intermediate_size")
        self.heads, self.q_rank, self.kv_rank = g("num_attention_heads"), g("q_lora_rank"), g("kv_lora_rank")
        self.nope, self.rope, self.v_dim = g("qk_nope_head_dim"), g("qk_rope_head_dim"), g("v_head_dim")
        self.E, self.top_k, self.shared = g("n_routed_experts"), g("num_experts_per_tok"), g("n_shared_experts")
        self.first_dense = g("first_k_dense_replace")
        self.mtp = int(config.get("num_nextn_predict_layers") or 0)
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.fp8 = config.get("quantization_config") is not None

    @property
    def moe_layers(self) -> int:
        return max(0, self.n - self.first_dense)

    @property
    def dense_layers(self) -> int:
        return self.n - self.moe_layers

    def linears(self, kind: str) -> list[tuple[int, int]]:
        """(out, in) of the Linears of one attention / dense MLP / shared expert / routed expert."""
        H, h = self.H, self.heads
        if kind == "attention":
            q = [(h * (self.nope + self.rope), H)] if self.q_rank is None else [
                (self.q_rank, H), (h * (self.nope + self.rope), self.q_rank)]
            return q + [(self.kv_rank + self.rope, H), (h * (self.nope + self.v_dim), self.kv_rank),
                        (H, h * self.v_dim)]
        width = {"dense_mlp": self.dense_inter, "shared_experts": self.I * self.shared, "routed_expert": self.I}[kind]
        return [(width, H), (width, H), (H, width)]

    def params(self, kind: str) -> int:
        return sum(o * i for o, i in self.linears(kind))

    def stored(self, kind: str) -> int:
        """Bytes of one module's Linears as stored: FP8 + float32 block scales, or bf16."""
        if not self.fp8:
            return self.params(kind) * BF16
        return sum(o * i * FP8 + ceil_div(o, BLOCK) * ceil_div(i, BLOCK) * FP32 for o, i in self.linears(kind))

    @property
    def attention_norms(self) -> int:
        return (self.q_rank or 0) + self.kv_rank  # q_a_layernorm (with a q LoRA), kv_a_layernorm

    def layer_loaded_bytes(self, moe: bool) -> int:
        """Bytes of one decoder layer without its routed experts as loaded in bf16 (FP8 dequantized): every
        parameter bf16 but the router's weight and correction bias, which transformers keeps in float32
        (`_keep_in_fp32_modules_strict`)."""
        attention = (self.params("attention") + self.attention_norms) * BF16
        ffn = self.params("shared_experts") * BF16 + (self.E * self.H + self.E) * FP32 if moe else \
            self.params("dense_mlp") * BF16
        return attention + ffn + 2 * self.H * BF16

    def layer_dense_bytes(self, moe: bool) -> int:
        """Stored bytes of one decoder layer without its routed experts (one FSDP unit)."""
        attention = self.stored("attention") + self.attention_norms * BF16
        if moe:
            ffn = self.stored("shared_experts") + self.E * self.H * BF16 + self.E * FP32
        else:
            ffn = self.stored("dense_mlp")
        return attention + ffn + 2 * self.H * BF16


def parameter_counts(config: Mapping[str, Any]) -> dict[str, int]:
    """Parameters per part of the model transformers builds from `config` (no MTP layer), unquantized counts.

    Keys: `EXPERT_PARTS + DENSE_PARTS`. "routers" counts the router weight and its correction bias; "norms"
    the two layer norms a layer and the final norm (the attention's q/kv LoRA norms are in "mla_attention");
    a tied lm_head counts 0.
    """
    d = _Dims(config)
    return {
        "routed_experts": d.moe_layers * d.E * d.params("routed_expert"),
        "shared_experts": d.moe_layers * d.params("shared_experts"),
        "routers": d.moe_layers * (d.E * d.H + d.E),
        "mla_attention": d.n * (d.params("attention") + d.attention_norms),
        "dense_mlp": d.dense_layers * d.params("dense_mlp"),
        "norms": d.n * 2 * d.H + d.H,
        "embeddings": d.V * d.H,
        "lm_head": 0 if d.tied else d.V * d.H,
    }


def expert_bytes(config: Mapping[str, Any]) -> int:
    """Stored bytes of every routed expert of the decoder layers (FP8 + scales, or bf16)."""
    d = _Dims(config)
    return d.moe_layers * d.E * d.stored("routed_expert")


def dense_bytes(config: Mapping[str, Any]) -> int:
    """Stored bytes of everything transformers loads but the routed experts."""
    d = _Dims(config)
    layers = d.dense_layers * d.layer_dense_bytes(False) + d.moe_layers * d.layer_dense_bytes(True)
    return layers + (d.V * d.H * (1 if d.tied else 2) + d.H) * BF16


def mtp_parameters(config: Mapping[str, Any]) -> dict[str, int]:
    """Parameters of the MTP layer(s) as stored: "unique" (decoder layer, enorm, hnorm, eh_proj, shared-head
    norm) and "shared" (their copies of the embeddings and the head)."""
    d = _Dims(config)
    layer = (d.params("attention") + d.attention_norms + d.E * d.params("routed_expert") + d.params("shared_experts")
             + d.E * d.H + d.E + 2 * d.H)
    unique = layer + 3 * d.H + 2 * d.H * d.H
    return {"unique": d.mtp * unique, "shared": d.mtp * 2 * d.V * d.H}


def mtp_bytes(config: Mapping[str, Any]) -> int:
    """Stored bytes of the MTP layer(s): an FP8 MoE decoder layer, and bf16 norms, eh_proj, embeddings, head."""
    d = _Dims(config)
    layer = d.layer_dense_bytes(True) + d.E * d.stored("routed_expert")
    return d.mtp * (layer + (3 * d.H + 2 * d.H * d.H + 2 * d.V * d.H) * BF16)


def checkpoint_totals(config: Mapping[str, Any]) -> dict[str, int]:
    """The whole checkpoint (MTP layers included): "elements" (every stored tensor's numel, FP8 scales
    included, as a safetensors listing sums them) and "bytes"."""
    d = _Dims(config)

    def elements(kind: str) -> int:
        scales = sum(ceil_div(o, BLOCK) * ceil_div(i, BLOCK) for o, i in d.linears(kind)) if d.fp8 else 0
        return d.params(kind) + scales

    moe_layer = (elements("attention") + d.attention_norms + d.E * elements("routed_expert")
                 + elements("shared_experts") + d.E * d.H + d.E + 2 * d.H)
    dense_layer = elements("attention") + d.attention_norms + elements("dense_mlp") + 2 * d.H
    main = d.dense_layers * dense_layer + d.moe_layers * moe_layer + d.V * d.H * (1 if d.tied else 2) + d.H
    mtp = d.mtp * (moe_layer + 3 * d.H + 2 * d.H * d.H + 2 * d.V * d.H)
    return {"elements": main + mtp,
            "bytes": expert_bytes(config) + dense_bytes(config) + mtp_bytes(config)}


def plan_sizes(config: Mapping[str, Any]) -> dict[str, int]:
    """The figures `modelopt_ext.plan` needs (`FamilySpec.sizes`; `modelopt_ext.plan.REQUIRED_SIZES`).

    `expert_bytes` and `dense_bytes` are the checkpoint's bytes (FP8 + scales where it is FP8): what a rank
    reads. `loaded_dense_bytes` and `loaded_largest_dense_unit_bytes` (`modelopt_ext.plan.OPTIONAL_SIZES`) are the
    dense modules as the family's load holds them (bf16, FP8 dequantized; router weight and bias float32); the
    experts are held at `expert_params` x 2 bytes (the plan's "dense" storage). The experts' input and output
    width is the hidden size (`latent_size`; no latent projection).
    """
    d = _Dims(config)
    counts = parameter_counts(config)
    units = [d.layer_dense_bytes(i >= d.first_dense) for i in range(d.n)]
    units += [counts["embeddings"] * BF16, counts["lm_head"] * BF16]
    loaded_units = [d.layer_loaded_bytes(i >= d.first_dense) for i in range(d.n)]
    loaded_units += [counts["embeddings"] * BF16, counts["lm_head"] * BF16]
    return {
        "num_experts": d.E,
        "num_moe_layers": d.moe_layers,
        "num_layers": d.n,
        "hidden_size": d.H,
        "latent_size": d.H,
        "expert_intermediate_size": d.I,
        "top_k": d.top_k,
        "vocab_size": d.V,
        "expert_params": counts["routed_experts"],
        "expert_bytes": expert_bytes(config),
        "dense_params": sum(counts[p] for p in DENSE_PARTS),
        "dense_bytes": dense_bytes(config),
        "largest_dense_unit_bytes": max(units),
        "loaded_dense_bytes": sum(loaded_units) + d.H * BF16,  # + the final norm
        "loaded_largest_dense_unit_bytes": max(loaded_units),
        # a pre-norm residual layer keeps the residual stream, its normalised input and its output alive
        "live_hidden_states": 3,
    }


sizes = plan_sizes  # the name the family spec's `sizes` field takes

"""Exact parameter counts and stored bytes of a Kimi-K3 checkpoint, from its config.json alone.

The formulas follow the stand-in modeling code (`standin/modeling_kimi_linear.py`, `modeling_kimi_k3.py`)
module by module; `tests/models/kimi_k3/test_sizes.py` checks them against the numel of a meta-device
instantiation of that code for two tiny configs. Nothing here builds a model or reads weights.

Storage as the checkpoint holds it: routed experts MXFP4 (compressed-tensors `mxfp4-pack-quantized`: per
row of `in` inputs, in/2 packed bytes and in/32 E8M0 scale bytes) or bf16; `A_log`, `dt_bias`, the KDA
conv weights, the KDA output norm `o_norm` and the router bias fp32; everything else bf16.

`kimi_k3_config.json` (next to this file) is the public config.json of moonshotai/Kimi-K3, key for key
(docs/standin.md lists where it comes from); its compressed-tensors `quantization_config` sits in
`text_config`, as the real file has it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from modelopt_ext.families import stored_expert_storage

BUNDLED_CONFIG = Path(__file__).with_name("kimi_k3_config.json")
MXFP4_GROUP = 32
BF16, FP32 = 2, 4

# Parts of the model, in the order `parameter_counts` reports them.
EXPERT_PARTS = ("routed_experts",)
DENSE_PARTS = (
    "shared_experts", "latent_projections", "routers", "kda_attention", "mla_attention", "attn_res",
    "dense_mlp", "norms", "embeddings", "lm_head", "vision_tower", "mm_projector",
)


def _get(cfg: Mapping[str, Any], key: str, where: str):
    try:
        return cfg[key]
    except KeyError:
        raise ValueError(f"Kimi-K3 config: {where} has no {key!r}") from None


class _Text:
    """The fields of `text_config` the formulas use, with the stand-in's layer predicates."""

    def __init__(self, config: Mapping[str, Any]):
        t = _get(config, "text_config", "config.json")
        g = lambda key: _get(t, key, "text_config")  # noqa: E731
        self.H, self.V, self.n = g("hidden_size"), g("vocab_size"), g("num_hidden_layers")
        self.dense_inter = g("intermediate_size")
        self.heads = g("num_attention_heads")
        self.q_rank, self.kv_rank = g("q_lora_rank"), g("kv_lora_rank")
        self.nope, self.rope, self.v_dim = g("qk_nope_head_dim"), g("qk_rope_head_dim"), g("v_head_dim")
        self.E, self.top_k, self.I = g("num_experts"), g("num_experts_per_token"), g("moe_intermediate_size")
        self.L, self.latent_norm = g("routed_expert_hidden_size"), g("latent_moe_use_norm")
        self.shared = g("num_shared_experts")
        self.first_dense, self.freq = g("first_k_dense_replace"), g("moe_layer_freq")
        self.tied = bool(t.get("tie_word_embeddings", False))
        self.attn_res_block = g("attn_res_block_size")
        self.output_gate = bool(t.get("mla_use_output_gate", False))
        lac = g("linear_attn_config")
        self.kda_layers = set(_get(lac, "kda_layers", "linear_attn_config"))
        self.kda_heads = _get(lac, "num_heads", "linear_attn_config")
        self.kda_dim = _get(lac, "head_dim", "linear_attn_config")
        self.conv_k = _get(lac, "short_conv_kernel_size", "linear_attn_config")

    def is_mla(self, i: int) -> bool:
        return (i + 1) not in self.kda_layers  # the real code: KDA iff listed in kda_layers, else MLA

    def is_moe(self, i: int) -> bool:
        return i >= self.first_dense and i % self.freq == 0

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n))

    @property
    def mla_layers(self) -> int:
        return sum(self.is_mla(i) for i in range(self.n))

    # Per-layer counts: (bf16 params, fp32 params).
    def kda(self) -> tuple[int, int]:
        H, P, d = self.H, self.kda_heads * self.kda_dim, self.kda_dim
        bf16 = 3 * H * P + H * d + d * P + H * self.kda_heads + H * P + P * H  # q/k/v, f_a, f_b, b, g, o
        fp32 = 3 * P * self.conv_k + max(self.kda_heads, d) + P + d  # conv1d x3, A_log (padded), dt_bias, o_norm
        return bf16, fp32

    def mla(self) -> int:
        H, h = self.H, self.heads
        return (
            H * self.q_rank + self.q_rank + self.q_rank * h * (self.nope + self.rope)
            + H * (self.kv_rank + self.rope) + self.kv_rank + self.kv_rank * h * (self.nope + self.v_dim)
            + (H * h * self.v_dim if self.output_gate else 0) + h * self.v_dim * H  # g_proj, o_proj
        )

    def moe_dense(self) -> dict[str, int]:
        """Non-expert params of one MoE block, by part."""
        H, L = self.H, self.L
        return {
            "shared_experts": 3 * H * self.I * self.shared,
            "latent_projections": 2 * H * L + (L if self.latent_norm else 0),
            "routers": self.E * H + self.E,
        }

    def layer_dense_bytes(self, i: int) -> int:
        """Stored bytes of decoder layer `i` without its routed experts (one FSDP unit)."""
        if self.is_mla(i):
            attn = self.mla() * BF16
        else:
            bf16, fp32 = self.kda()
            attn = bf16 * BF16 + fp32 * FP32
        if self.is_moe(i):
            moe = self.moe_dense()
            ffn = (moe["shared_experts"] + moe["latent_projections"] + self.E * self.H) * BF16 + self.E * FP32
        else:
            ffn = 3 * self.H * self.dense_inter * BF16
        return attn + ffn + 6 * self.H * BF16  # two layer norms, two AttnRes norms, two AttnRes projections


def _vision(config: Mapping[str, Any]) -> tuple[int, int]:
    """(vision tower params, mm_projector params) of the MoonViT tower and the patchmergerv2 projector."""
    v = _get(config, "vision_config", "config.json")
    g = lambda key: _get(v, key, "vision_config")  # noqa: E731
    D, inter, p = g("vt_hidden_size"), g("vt_intermediate_size"), g("patch_size")
    Q = D if g("qkv_hidden_size") is None else g("qkv_hidden_size")
    norm = D if g("norm_type") == "rmsnorm" else 2 * D  # LayerNorm adds a bias
    attn_bias, mlp_bias = bool(g("attn_bias")), bool(g("linear_bias"))
    attention = D * 3 * Q + Q * D + (3 * Q + D if attn_bias else 0)  # wqkv, wo
    mlp = 2 * D * inter + (inter + D if mlp_bias else 0)  # fc0, fc1
    patch_embed = 3 * D * p * p + (D if g("patch_embed_proj_bias") else 0)
    pos_emb = g("init_pos_emb_height") * g("init_pos_emb_width") * D
    tower = patch_embed + pos_emb + g("vt_num_hidden_layers") * (2 * norm + attention + mlp) + norm
    kh, kw = g("merge_kernel_size")
    merged, H = g("mm_hidden_size") * kh * kw, _get(config["text_config"], "hidden_size", "text_config")
    return tower, merged * merged + merged * H + H  # proj.0, proj.2 (no biases), post_norm


def parameter_counts(config: Mapping[str, Any]) -> dict[str, int]:
    """Parameters per part of the model described by a Kimi-K3 `config.json` mapping.

    Keys: `EXPERT_PARTS + DENSE_PARTS` ("routed_experts" counts w1, w2, w3 of every expert of every MoE
    layer as unquantized matrices). A tied lm_head counts as 0 (the checkpoint stores it once).
    """
    t = _Text(config)
    n_moe, n_mla = t.moe_layers, t.mla_layers
    n_kda, n_dense = t.n - n_mla, t.n - n_moe
    moe = t.moe_dense()
    tower, projector = _vision(config)
    return {
        "routed_experts": n_moe * t.E * 3 * t.I * t.L,
        **{part: n_moe * count for part, count in moe.items()},
        "kda_attention": n_kda * sum(t.kda()),
        "mla_attention": n_mla * t.mla(),
        "attn_res": t.n * 4 * t.H + 2 * t.H,  # per layer 2 norms + 2 [1,H] projections; the output mix
        "dense_mlp": n_dense * 3 * t.H * t.dense_inter,
        "norms": t.n * 2 * t.H + t.H,  # input / post-attention layer norms, final norm
        "embeddings": t.V * t.H,
        "lm_head": 0 if t.tied else t.V * t.H,
        "vision_tower": tower,
        "mm_projector": projector,
    }


def expert_bytes(config: Mapping[str, Any], storage: str) -> int:
    """Bytes of all routed experts stored as `storage`: "mxfp4" (packed + E8M0 scales) or "dense" (bf16)."""
    t = _Text(config)
    n = t.moe_layers * t.E
    if storage == "dense":
        return n * 3 * t.I * t.L * BF16
    if storage != "mxfp4":
        raise ValueError(f"expert storage {storage!r} is not one of 'mxfp4', 'dense'")
    for name, width in (("routed_expert_hidden_size", t.L), ("moe_intermediate_size", t.I)):
        if width % MXFP4_GROUP:
            raise ValueError(f"MXFP4 experts need {name} ({width}) divisible by the group size {MXFP4_GROUP}")
    row = lambda width: width // 2 + width // MXFP4_GROUP  # noqa: E731
    return n * (2 * t.I * row(t.L) + t.L * row(t.I))  # w1, w3: [I, L]; w2: [L, I]


def dense_bytes(config: Mapping[str, Any]) -> int:
    """Stored bytes of everything but the routed experts: fp32 KDA conv / A_log / dt_bias and router bias,
    bf16 otherwise."""
    t = _Text(config)
    counts = parameter_counts(config)
    _, kda_fp32 = t.kda()
    fp32 = (t.n - t.mla_layers) * kda_fp32 + t.moe_layers * t.E
    return (sum(counts[p] for p in DENSE_PARTS) - fp32) * BF16 + fp32 * FP32


def plan_sizes(config: Mapping[str, Any]) -> dict[str, int]:
    """The figures `modelopt_ext.plan` needs (see `FamilySpec.sizes`)."""
    t = _Text(config)
    counts = parameter_counts(config)
    tower, projector = _vision(config)
    units = [t.layer_dense_bytes(i) for i in range(t.n)]
    units += [counts["embeddings"] * BF16, counts["lm_head"] * BF16, (tower + projector) * BF16]
    return {
        "num_experts": t.E,
        "num_moe_layers": t.moe_layers,
        "num_layers": t.n,
        "hidden_size": t.H,
        "latent_size": t.L,
        "expert_intermediate_size": t.I,
        "top_k": t.top_k,
        "vocab_size": t.V,
        "expert_params": counts["routed_experts"],
        "expert_bytes": expert_bytes(config, stored_expert_storage(config)),
        "dense_params": sum(counts[p] for p in DENSE_PARTS),
        "dense_bytes": dense_bytes(config),
        "largest_dense_unit_bytes": max(units),
        # AttnRes keeps one [T, H] residual per finished block plus the embeddings; a layer adds the running
        # sum, its normalised input and its output.
        "live_hidden_states": t.n // t.attn_res_block + 1 + 3,
    }

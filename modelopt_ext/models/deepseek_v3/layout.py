"""The tensors of a DeepSeek-V3-architecture checkpoint (DeepSeek-V3/R1, Kimi-K2), from its config.json alone.

Names, shapes and stored dtypes as the public checkpoints hold them (the per-tensor tables of
deepseek-ai/DeepSeek-R1, same layout as DeepSeek-V3: 91,991 tensors, 684,531,386,000 elements; and of
moonshotai/Kimi-K2-Instruct: 139,644 tensors, 1,026,470,731,056 elements; both reproduced by
`tests/models/deepseek_v3/test_layout.py`):

- `model.embed_tokens.weight`, `lm_head.weight` [vocab, hidden] bf16; `model.norm.weight` bf16.
- per decoder layer `model.layers.{i}.`: `input_layernorm` / `post_attention_layernorm` [hidden] bf16;
  attention `self_attn.q_a_proj` [q_lora_rank, hidden], `q_a_layernorm` [q_lora_rank] bf16, `q_b_proj`
  [heads x (nope + rope), q_lora_rank] (`q_proj` [heads x (nope + rope), hidden] without a q LoRA),
  `kv_a_proj_with_mqa` [kv_lora_rank + rope, hidden], `kv_a_layernorm` [kv_lora_rank] bf16, `kv_b_proj`
  [heads x (nope + v), kv_lora_rank], `o_proj` [hidden, heads x v];
- layers before `first_k_dense_replace`: `mlp.{gate,up}_proj` [intermediate, hidden], `mlp.down_proj`
  [hidden, intermediate]; later layers: `mlp.experts.{e}.{gate,up,down}_proj` (moe_intermediate_size),
  `mlp.shared_experts.{gate,up,down}_proj` (moe_intermediate_size x n_shared_experts), the router
  `mlp.gate.weight` [experts, hidden] bf16 and `mlp.gate.e_score_correction_bias` [experts] float32.
- every Linear above is FP8 (`weight` float8_e4m3fn and `weight_scale_inv` float32 [ceil(out/128),
  ceil(in/128)], `modelopt_ext/formats/fp8_block.py`); without a quantization_config they are bf16 and have no scales.
- multi-token prediction (`num_nextn_predict_layers` layers after the last decoder layer, DeepSeek-V3 has
  one: `model.layers.61.`): a full MoE decoder layer as above plus `embed_tokens.weight` and
  `shared_head.head.weight` [vocab, hidden] (copies of the main ones), `enorm`, `hnorm`, `shared_head.norm`
  [hidden] and `eh_proj.weight` [hidden, 2 x hidden], all bf16 (eh_proj is not FP8). transformers builds no
  MTP layer and does not load these.

Kimi-K2-Instruct also stores a `self_attn.rotary_emb.inv_freq` [56] bf16 per decoder layer, which no model
reads (transformers drops `rotary_emb.inv_freq` keys on load); `layout` leaves them out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from modelopt_ext.formats.fp8_block import scale_shape

FP8, BF16, FP32 = "float8_e4m3fn", "bfloat16", "float32"
BYTES = {FP8: 1, BF16: 2, FP32: 4}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor: its key, shape and stored dtype (a `BYTES` key), and the kind of part it is in
    ("routed_experts", "shared_experts", "router", "attention", "dense_mlp", "norms", "embeddings", "lm_head",
    "mtp")."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    part: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * BYTES[self.dtype]


@dataclasses.dataclass(frozen=True)
class Dims:
    """The config.json fields the layout reads."""

    vocab: int
    hidden: int
    intermediate: int
    expert_intermediate: int
    layers: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    nope: int
    rope: int
    v: int
    experts: int
    shared: int
    first_dense: int
    mtp_layers: int
    tied: bool
    fp8: bool

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> Dims:
        def get(key):
            try:
                return config[key]
            except KeyError:
                raise ValueError(f"DeepSeek-V3 config has no {key!r}") from None

        return cls(
            vocab=get("vocab_size"), hidden=get("hidden_size"), intermediate=get("intermediate_size"),
            expert_intermediate=get("moe_intermediate_size"), layers=get("num_hidden_layers"),
            heads=get("num_attention_heads"), q_lora_rank=get("q_lora_rank"), kv_lora_rank=get("kv_lora_rank"),
            nope=get("qk_nope_head_dim"), rope=get("qk_rope_head_dim"), v=get("v_head_dim"),
            experts=get("n_routed_experts"), shared=get("n_shared_experts"), first_dense=get("first_k_dense_replace"),
            mtp_layers=int(config.get("num_nextn_predict_layers") or 0),
            tied=bool(config.get("tie_word_embeddings", False)),
            fp8=config.get("quantization_config") is not None,
        )

    def is_moe(self, layer: int) -> bool:
        """transformers' rule (`DeepseekV3DecoderLayer`): MoE from `first_k_dense_replace` on; MTP layers too."""
        return layer >= self.first_dense


def _linear(name: str, out_features: int, in_features: int, part: str, fp8: bool) -> Iterator[Tensor]:
    if not fp8:
        yield Tensor(f"{name}.weight", (out_features, in_features), BF16, part)
        return
    yield Tensor(f"{name}.weight", (out_features, in_features), FP8, part)
    yield Tensor(f"{name}.weight_scale_inv", scale_shape(out_features, in_features), FP32, part)


def _decoder_layer(d: Dims, i: int, part_override: str | None = None) -> Iterator[Tensor]:
    p = f"model.layers.{i}."
    H = d.hidden

    def part(kind: str) -> str:
        return part_override or kind

    yield Tensor(p + "input_layernorm.weight", (H,), BF16, part("norms"))
    yield Tensor(p + "post_attention_layernorm.weight", (H,), BF16, part("norms"))
    a = p + "self_attn."
    q_out = d.heads * (d.nope + d.rope)
    if d.q_lora_rank is None:
        yield from _linear(a + "q_proj", q_out, H, part("attention"), d.fp8)
    else:
        yield from _linear(a + "q_a_proj", d.q_lora_rank, H, part("attention"), d.fp8)
        yield Tensor(a + "q_a_layernorm.weight", (d.q_lora_rank,), BF16, part("attention"))
        yield from _linear(a + "q_b_proj", q_out, d.q_lora_rank, part("attention"), d.fp8)
    yield from _linear(a + "kv_a_proj_with_mqa", d.kv_lora_rank + d.rope, H, part("attention"), d.fp8)
    yield Tensor(a + "kv_a_layernorm.weight", (d.kv_lora_rank,), BF16, part("attention"))
    yield from _linear(a + "kv_b_proj", d.heads * (d.nope + d.v), d.kv_lora_rank, part("attention"), d.fp8)
    yield from _linear(a + "o_proj", H, d.heads * d.v, part("attention"), d.fp8)
    m = p + "mlp."
    if not d.is_moe(i):
        I = d.intermediate
        yield from _linear(m + "gate_proj", I, H, part("dense_mlp"), d.fp8)
        yield from _linear(m + "up_proj", I, H, part("dense_mlp"), d.fp8)
        yield from _linear(m + "down_proj", H, I, part("dense_mlp"), d.fp8)
        return
    I = d.expert_intermediate
    for e in range(d.experts):
        x = f"{m}experts.{e}."
        yield from _linear(x + "gate_proj", I, H, part("routed_experts"), d.fp8)
        yield from _linear(x + "up_proj", I, H, part("routed_experts"), d.fp8)
        yield from _linear(x + "down_proj", H, I, part("routed_experts"), d.fp8)
    yield Tensor(m + "gate.weight", (d.experts, H), BF16, part("router"))
    yield Tensor(m + "gate.e_score_correction_bias", (d.experts,), FP32, part("router"))
    S = I * d.shared
    yield from _linear(m + "shared_experts.gate_proj", S, H, part("shared_experts"), d.fp8)
    yield from _linear(m + "shared_experts.up_proj", S, H, part("shared_experts"), d.fp8)
    yield from _linear(m + "shared_experts.down_proj", H, S, part("shared_experts"), d.fp8)


def mtp_layer_indices(config: Mapping[str, Any]) -> range:
    """Layer indices of the multi-token-prediction layers (`model.layers.{i}.`): after the decoder layers."""
    d = Dims.of(config)
    return range(d.layers, d.layers + d.mtp_layers)


def layout(config: Mapping[str, Any], mtp: bool = True) -> list[Tensor]:
    """Every tensor of the checkpoint `config` describes, in a fixed order (embeddings, decoder layers, final
    norm and head, MTP layers). `mtp=False` leaves the MTP layers out (what transformers loads)."""
    d = Dims.of(config)
    H, V = d.hidden, d.vocab
    out = [Tensor("model.embed_tokens.weight", (V, H), BF16, "embeddings")]
    for i in range(d.layers):
        out += _decoder_layer(d, i)
    out.append(Tensor("model.norm.weight", (H,), BF16, "norms"))
    if not d.tied:
        out.append(Tensor("lm_head.weight", (V, H), BF16, "lm_head"))
    if mtp:
        for i in range(d.layers, d.layers + d.mtp_layers):
            p = f"model.layers.{i}."
            out.append(Tensor(p + "embed_tokens.weight", (V, H), BF16, "mtp"))
            out += [Tensor(p + f"{n}.weight", (H,), BF16, "mtp") for n in ("enorm", "hnorm")]
            out.append(Tensor(p + "eh_proj.weight", (H, 2 * H), BF16, "mtp"))
            out += _decoder_layer(d, i, part_override="mtp")
            out.append(Tensor(p + "shared_head.norm.weight", (H,), BF16, "mtp"))
            out.append(Tensor(p + "shared_head.head.weight", (V, H), BF16, "mtp"))
    return out

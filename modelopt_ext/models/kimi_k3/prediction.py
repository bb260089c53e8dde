"""What `modelopt-ext plan --predict` needs of Kimi-K3 (`FamilySpec.prediction`, `modelopt_ext/predict.py`).

- `MEASUREMENT`: the per-GPU measurement of one rank's share of the job that ships with the package
  (`scripts/bench_rank_share.py` on an H200 writes it); absent until that measurement exists.
- `layer_kinds(config)`: how many decoder layers of each measured kind the config has. A layer's kind is
  its feed-forward ("dense" for the first `first_k_dense_replace` layers, "moe" after, every
  `moe_layer_freq`-th) joined with its attention ("kda" for the 1-based layers in
  `linear_attn_config.kda_layers`, "mla" for `full_attn_layers`; `inventory.layer_schedule` checks that they
  split the layers). The public config: layer 0 is dense and KDA (`dense_kda` x 1), then 68 `moe_kda` and 24
  `moe_mla` layers; "embed_head" (embeddings, final norm, lm_head) counts once.
- `dense_export_bytes(config, recipe)`: bytes of the export's dense files as the recipe writes them. Stored
  bytes (`sizes.py`: bf16, fp32 for KDA conv / decay and the router bias) except the attention projections
  the recipe quantizes (`serving.linear_shape` gives their shapes): FP8 E4M3 weights are 1 byte a parameter
  plus one fp32 scale per started 128x128 block (FP8_PB_WO) or one fp32 `weight_scale` and `input_scale`
  (per-tensor FP8); NVFP4 weights 1/2 byte a parameter plus one E4M3 scale per 16 and two fp32 scalars.
  Other modules are counted as stored (the shipped recipes quantize nothing else outside the experts; the
  exporter keeps unquantized tensors in the source dtype, docs/export.md). Quantizer amax buffers, the
  index and config files are not counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .inventory import layer_schedule
from .serving import TEXT_LAYERS, linear_shape
from .sizes import _Text, dense_bytes

MEASUREMENT = Path(__file__).with_name("rank_share_h200.json")
EMBED_HEAD = "embed_head"
# Linear projections of an attention layer, by kind (f_b_proj: no shape known to `linear_shape`; always excluded).
ATTENTION_LINEARS = {
    "kda": ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj", "o_proj"),
    "mla": ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj", "g_proj"),
}
FP8_BLOCK, NVFP4_GROUP = 128, 16
BF16, FP32 = 2, 4


def layer_kinds(config: Mapping[str, Any]) -> dict[str, int]:
    """Measured kind -> count: "dense_kda"/"dense_mla"/"moe_kda"/"moe_mla" per decoder layer, "embed_head" 1."""
    schedule = layer_schedule(config)
    moe = set(schedule.moe)
    kinds = Counter(f"{'moe' if i in moe else 'dense'}_{schedule.attention_kind(i)}"
                    for i in range(schedule.num_layers))
    return {**dict(sorted(kinds.items())), EMBED_HEAD: 1}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def quantized_linear_bytes(out: int, inp: int, attrs: Mapping[str, Any]) -> int:
    """Exported bytes of an [out, inp] weight quantized with ModelOpt quantizer attributes `attrs`."""
    bits = attrs.get("num_bits")
    bits = tuple(bits) if isinstance(bits, (list, tuple)) else bits
    blocks = {str(k): v for k, v in (attrs.get("block_sizes") or {}).items()}
    n = out * inp
    if bits == (4, 3):
        if blocks.get("-1") == blocks.get("-2") == FP8_BLOCK:
            return n + _ceil_div(out, FP8_BLOCK) * _ceil_div(inp, FP8_BLOCK) * FP32
        if not blocks:
            return n + 2 * FP32  # weight_scale, input_scale
    if bits == (2, 1) and blocks.get("-1") == NVFP4_GROUP:
        return n // 2 + _ceil_div(n, NVFP4_GROUP) + 2 * FP32  # packed, E4M3 block scales, weight_scale_2, input_scale
    raise ValueError(f"quantizer attributes {dict(attrs)} are not a format the export-size prediction knows "
                     "(FP8 E4M3 per tensor or 128x128 blocks, NVFP4)")


def dense_export_bytes(config: Mapping[str, Any], recipe: str) -> dict[str, Any]:
    """{"outside_layers": bytes, "layers": (bytes of layer 0's dense file, ...)} as `recipe` exports them."""
    from modelopt_ext.quant import recipes
    from modelopt_ext.quant.fused_groups import quantizer_states

    text, schedule = _Text(config), layer_schedule(config)
    layers = [text.layer_dense_bytes(i) for i in range(schedule.num_layers)]
    outside = dense_bytes(config) - sum(layers)
    gated = bool(config.get("text_config", config).get("mla_use_output_gate", False))
    modules = {
        f"{TEXT_LAYERS}{i}.self_attn.{leaf}": i
        for i in range(schedule.num_layers)
        for leaf in ATTENTION_LINEARS[schedule.attention_kind(i)]
        if not (leaf == "g_proj" and schedule.attention_kind(i) == "mla" and not gated)
    }
    quant_cfg = recipes.quant_config(recipes.load(recipe), config)["quant_cfg"]
    states = quantizer_states(quant_cfg, [f"{m}.weight_quantizer" for m in modules])
    for module, layer in modules.items():
        enabled, attrs = states[f"{module}.weight_quantizer"]
        if not enabled:
            continue
        out, inp = linear_shape(config, module)
        if isinstance(attrs, list):  # ModelOpt's sequential quantizers: the last format is what is stored
            attrs = attrs[-1]
        layers[layer] += quantized_linear_bytes(out, inp, attrs or {}) - out * inp * BF16
    return {"outside_layers": outside, "layers": tuple(layers)}

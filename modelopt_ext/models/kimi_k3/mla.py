"""Kimi-K3's MLA attention forward: the remote code's math, its attention core fused on CUDA, and ModelOpt's KV
quantizers on the keys and values.

The pinned remote code computes the MLA core in fp32 on the full [B, heads, S, S] score matrix (`torch.matmul` of
the upcast q and k, `masked_fill`, softmax, `torch.matmul` with the upcast v, cast back). At Kimi-K3's widths that
was the largest single item of the calibration forward (docs/performance.md, "Session 17"): the fp32 score matrix
is 3.2 GB at 2 x 2048 tokens and four passes go over it. `forward` (patched onto the checkpoint's
`KimiMLAAttention` by `patch.plan_patches`) keeps every projection and norm of the remote forward as it is and
runs only the core differently, by device:

- CPU: the remote code's fp32 core, operation for operation (bit-identical logits, amax and exports).
- CUDA: `torch.nn.functional.scaled_dot_product_attention` on q, k and v as the projections produced them (bf16
  in a bf16 model), with the same scale and the same mask (causal, and the attention mask's padding as an
  additive bias of the dtype's lowest value, as the remote code's `masked_fill`; a query with no key left gets
  the uniform mix, as there). The inputs are exact (the remote code only upcasts them); the kernels accumulate in
  fp32 and the only extra rounding is of the softmax probabilities to the input dtype before they meet v. The
  difference to the remote core, measured at real widths, is in docs/performance.md.

ModelOpt quantizes an attention's KV cache by rewriting the class source's two matmuls
(`plugins.attention.register_attention_for_kv_quant`); on the remote source that puts `k_bmm_quantizer` on the
values and `v_bmm_quantizer` on the keys, and it would drop this forward (the rewrite compiles the source of the
file). `register_kv_quantizers` registers the patched class with ModelOpt instead (`mtq.register`): the class
gets `q_bmm_quantizer`, `k_bmm_quantizer` and `v_bmm_quantizer`, and `forward` applies them to the queries, the
keys and the values. Shipped recipes disable them (quant/kv_cache.py says why).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

KV_QUANTIZERS = ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer")


def remote_core(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The remote code's core: [B, h, S, dq], [B, h, L, dq], [B, h, L, dv] -> [B, h, S, dv] in q's dtype,
    computed in fp32 on the full score matrix (the stand-in's `KimiMLAAttention.forward`, operation for
    operation)."""
    S, kv_len = q.shape[2], key.shape[2]
    scores = torch.matmul(q.float(), key.float().transpose(-1, -2)) * scaling
    keep = _keep(S, kv_len, attention_mask, q.device)
    scores = scores.masked_fill(~keep, torch.finfo(torch.float32).min)
    return torch.matmul(scores.softmax(dim=-1), value.float()).to(q.dtype)


def fused_core(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The same core through SDPA, in q's dtype: causal by the kernel where no mask or cache is involved, else
    with the remote code's mask as an additive bias (the dtype's lowest value where the remote code fills)."""
    S, kv_len = q.shape[2], key.shape[2]
    if attention_mask is None and kv_len == S:
        return F.scaled_dot_product_attention(q, key, value, is_causal=True, scale=scaling)
    keep = _keep(S, kv_len, attention_mask, q.device)
    bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, torch.finfo(q.dtype).min)
    return F.scaled_dot_product_attention(q, key, value, attn_mask=bias, scale=scaling)


def _keep(S: int, kv_len: int, attention_mask: torch.Tensor | None, device) -> torch.Tensor:
    """[S, L] (or [B, 1, S, L] with a mask): True where query i may see key j (causal at the cache's end)."""
    q_pos = torch.arange(kv_len - S, kv_len, device=device)
    keep = q_pos[:, None] >= torch.arange(kv_len, device=device)[None, :]
    if attention_mask is not None:
        keep = keep[None, None] & attention_mask[:, None, None, :kv_len].bool()
    return keep


def attention_core(q, key, value, scaling, attention_mask):
    """`fused_core` on CUDA tensors, `remote_core` elsewhere (see the module doc)."""
    core = fused_core if q.is_cuda else remote_core
    return core(q, key, value, scaling, attention_mask)


def make_forward(remote_forward):
    """The patched `KimiMLAAttention.forward` (`__wrapped__`: the remote one, kept for A/B measurements)."""

    @functools.wraps(remote_forward)
    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False, **kwargs):
        B, S, _ = hidden_states.shape
        h = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(B, S, h, self.q_head_dim).transpose(1, 2)
        compressed, k_pe = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed)).view(B, S, h, -1).transpose(1, 2)
        k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_pe = k_pe.view(B, 1, S, self.qk_rope_head_dim).expand(B, h, S, self.qk_rope_head_dim)
        key = torch.cat([k_nope, k_pe], dim=-1)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        if getattr(self, "k_bmm_quantizer", None) is not None:  # registered with ModelOpt and converted
            q, key, value = self.q_bmm_quantizer(q), self.k_bmm_quantizer(key), self.v_bmm_quantizer(value)
        attn = attention_core(q, key, value, self.scaling, attention_mask)
        attn = attn.transpose(1, 2).reshape(B, S, h * self.v_head_dim)
        if self.use_output_gate:
            attn = attn * torch.sigmoid(self.g_proj(hidden_states))
        return self.o_proj(attn)

    return forward


class NoKVCache:
    """ModelOpt's quantized class for the KDA attention: no quantizer. KDA keeps a recurrent state, not a KV
    cache; registered, ModelOpt does not try to rewrite its source for one (and warn that it could not)."""

    def _setup(self):
        pass


class KVQuantizers:
    """What ModelOpt adds to the patched MLA class when it converts it (`mtq.register`'s quantized class)."""

    def _setup(self):
        from modelopt.torch.quantization.nn import TensorQuantizer

        for name in KV_QUANTIZERS:
            setattr(self, name, TensorQuantizer())


def register_kv_quantizers(attention_cls: type, quantized_cls: type = KVQuantizers) -> None:
    """Register `attention_cls` (a checkpoint's patched `KimiMLAAttention`) with ModelOpt, so that its
    conversion adds the KV quantizers `forward` applies instead of rewriting the remote source (`NoKVCache` for
    the KDA attention)."""
    from modelopt_ext.quant.modelopt_import import import_modelopt

    import_modelopt()
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.nn import QuantModuleRegistry

    if QuantModuleRegistry.get(attention_cls) is not None:
        return

    mtq.register(original_cls=attention_cls, quantized_cls=quantized_cls)
    logger.debug("registered %s.%s with ModelOpt as %s", attention_cls.__module__, attention_cls.__qualname__,
                 quantized_cls.__name__)

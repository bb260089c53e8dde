# Stand-in remote code for Kimi-K3, written by the modelopt_ext project from the public facts about the
# checkpoint (see docs/standin.md). It keeps the upstream behaviours the modelopt_ext adapter replaces:
# the per-expert Python loop with host-side counts, ep_size fixed to 1, NotImplementedError when the MoE
# block trains, the torch.cat MLA cache, KDA kernel calls with raw beta logits and
# use_beta_sigmoid_in_kernel=True, the padded A_log, the old tie_weights/get_mask_sizes signatures and a
# forward that only takes `past_key_values`.
# One deviation: where fla-core's kernels cannot run (no CUDA or no triton), KDA runs the pure-torch
# functions `torch_chunk_kda` / `torch_recurrent_kda` below, which honour the kernels' call contract.
"""Kimi-Linear text model of Kimi-K3: KDA + MLA layers, latent MoE with SiTU-GLU experts, AttnRes.

Shapes: B batch, T/S time, H hidden, h heads, K key dim, V value dim, E experts, k top-k, L latent width.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

from .configuration_kimi_k3 import KimiLinearConfig

logger = logging.get_logger(__name__)

try:
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda
except ImportError:  # fla-core needs triton; CPU installs run the torch functions below
    fla_chunk_kda = None
    fla_fused_recurrent_kda = None

TORCH_KDA_CHUNK_SIZE = 16


def torch_kda_gate(g_BTHK, A_log_H, dt_bias, lower_bound):
    """Log-space decay: `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`, or the softplus form when
    `lower_bound` is None. Returns fp32 [B, T, H, K]."""
    H, K = g_BTHK.shape[-2:]
    g = g_BTHK.float()
    if dt_bias is not None:
        g = g + dt_bias.float().view(H, K)
    if lower_bound is not None:
        a = A_log_H.float().exp().view(H, 1) if A_log_H is not None else 1.0
        return lower_bound * torch.sigmoid(a * g)
    return -A_log_H.float().exp().view(H, 1) * F.softplus(g)


def _prepare(q, k, v, g, beta, A_log, dt_bias, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
             use_beta_sigmoid_in_kernel, lower_bound, kwargs):
    state_v_first = kwargs.pop("state_v_first", False)
    if "transpose_state_layout" in kwargs:
        state_v_first = kwargs.pop("transpose_state_layout")
    for ignored in ("safe_gate", "cu_seqlens", "inplace_final_state"):
        value = kwargs.pop(ignored, None)
        if ignored == "cu_seqlens" and value is not None:
            raise NotImplementedError("the torch KDA reference does not take cu_seqlens")
    if kwargs:
        raise TypeError(f"unexpected KDA kernel arguments: {sorted(kwargs)}")
    q, k, v = q.float(), k.float(), v.float()
    if use_qk_l2norm_in_kernel:
        q = F.normalize(q, p=2, dim=-1, eps=1e-6)
        k = F.normalize(k, p=2, dim=-1, eps=1e-6)
    g = torch_kda_gate(g, A_log, dt_bias, lower_bound) if use_gate_in_kernel else g.float()
    beta = torch.sigmoid(beta.float()) if use_beta_sigmoid_in_kernel else beta.float()
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return q * scale, k, v, g, beta, state_v_first


def _initial_state(initial_state, B, H, K, V, state_v_first, device):
    if initial_state is None:
        return torch.zeros(B, H, K, V, dtype=torch.float32, device=device)
    s = initial_state.float()
    return s.transpose(-1, -2) if state_v_first else s


def _final_state(S_BHKV, output_final_state, state_v_first):
    if not output_final_state:
        return None
    return (S_BHKV.transpose(-1, -2) if state_v_first else S_BHKV).contiguous()


def torch_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                  output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                  use_beta_sigmoid_in_kernel=False, lower_bound=None, **kwargs):
    """Step-by-step recurrence (the `fused_recurrent_kda` contract). q, k [B,T,H,K]; v [B,T,H,V];
    g [B,T,H,K]; beta [B,T,H]. Returns (o [B,T,H,V] in v's dtype, final state or None)."""
    out_dtype = v.dtype
    q, k, v, g, beta, v_first = _prepare(q, k, v, g, beta, A_log, dt_bias, scale, use_qk_l2norm_in_kernel,
                                         use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound, kwargs)
    B, T, H, K = q.shape
    S = _initial_state(initial_state, B, H, K, v.shape[-1], v_first, q.device)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        kt = k[:, t]
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, dim=1)
    return o.to(out_dtype), _final_state(S, output_final_state, v_first)


def torch_chunk_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
              output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, lower_bound=None, **kwargs):
    """Chunked form of the same recurrence (the `chunk_kda` contract), exact up to fp32 rounding.

    Inside a chunk with cumulative log-decay G_t, the delta-rule pseudo-values u solve the unit lower
    triangular system (I + A) u = beta * (v - (k * exp G) S0), A_ts = beta_t sum_d k_t k_s exp(G_t - G_s)
    for s < t; decays are always formed as differences G_t - G_s <= 0, so nothing overflows.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, v_first = _prepare(q, k, v, g, beta, A_log, dt_bias, scale, use_qk_l2norm_in_kernel,
                                         use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound, kwargs)
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = _initial_state(initial_state, B, H, K, V, v_first, q.device)
    outs = []
    for start in range(0, T, TORCH_KDA_CHUNK_SIZE):
        sl = slice(start, min(start + TORCH_KDA_CHUNK_SIZE, T))
        # [B, H, C, *] views of this chunk
        qc, kc, vc, gc = (x[:, sl].transpose(1, 2) for x in (q, k, v, g))
        bc = beta[:, sl].transpose(1, 2)
        C = qc.shape[2]
        G = gc.cumsum(dim=2)  # [B,H,C,K]
        diff = G.unsqueeze(3) - G.unsqueeze(2)  # [B,H,C(t),C(s),K] = G_t - G_s
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(causal[..., None], diff, torch.full_like(diff, float("-inf"))).exp()
        kk = torch.einsum("bhtk,bhsk,bhtsk->bhts", kc, kc, decay)
        A = (bc.unsqueeze(-1) * kk).masked_fill(~causal.tril(-1), 0.0)
        rhs = bc.unsqueeze(-1) * (vc - torch.einsum("bhtk,bhkv->bhtv", kc * G.exp(), S))
        eye = torch.eye(C, dtype=torch.float32, device=q.device)
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        qk = torch.einsum("bhtk,bhsk,bhtsk->bhts", qc, kc, decay)
        o = torch.einsum("bhtk,bhkv->bhtv", qc * G.exp(), S) + qk @ u
        outs.append(o.transpose(1, 2))
        G_last = G[:, :, -1:]  # [B,H,1,K]
        S = G_last.transpose(-1, -2).exp() * S + torch.einsum("bhsk,bhsv->bhkv", kc * (G_last - G).exp(), u)
    o = torch.cat(outs, dim=1) if outs else v.new_zeros(B, 0, H, V, dtype=torch.float32)
    return o.to(out_dtype), _final_state(S, output_final_state, v_first)


def chunk_kda(q, k, v, g, beta, **kwargs):
    """fla-core's chunked KDA kernel on CUDA, the torch reference elsewhere (same arguments)."""
    if fla_chunk_kda is not None and q.is_cuda:
        return fla_chunk_kda(q, k, v, g, beta, **kwargs)
    return torch_chunk_kda(q, k, v, g, beta, **kwargs)


def fused_recurrent_kda(q, k, v, g, beta, **kwargs):
    """fla-core's recurrent KDA kernel on CUDA, the torch reference elsewhere (same arguments)."""
    if fla_fused_recurrent_kda is not None and q.is_cuda:
        return fla_fused_recurrent_kda(q, k, v, g, beta, **kwargs)
    return torch_recurrent_kda(q, k, v, g, beta, **kwargs)


# --------------------------------------------------------------------------------------------------------
# Building blocks


class KimiRMSNorm(nn.Module):
    """RMSNorm computed in fp32: `weight * normalized`."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(dtype)


class KimiGatedRMSNorm(nn.Module):
    """KDA output norm over the head dim, gated: `rmsnorm(o) * weight * sigmoid(gate)`, in fp32."""

    def __init__(self, head_dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.variance_epsilon = eps

    def forward(self, o, gate):
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (of * self.weight.float() * torch.sigmoid(gate.float())).to(gate.dtype)


def situ_glu(gate, up, beta: float = 4.0, linear_beta: float | None = 25.0):
    """SiTU-GLU in fp32: `beta tanh(g/beta) sigmoid(g) * linear_beta tanh(u/linear_beta)`, cast back
    (`up` is used as is when `linear_beta` is None)."""
    g, u = gate.float(), up.float()
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * u).to(gate.dtype)


def attn_res_mix(candidates, norm: KimiRMSNorm, proj: nn.Linear):
    """Attention residual: softmax over depth of the candidates' scores against `norm.weight * proj.weight`.

    candidates: list of N tensors [B, T, H] (stored block residuals, then the running sum).
    Returns [B, T, H]: the softmax-weighted mix of the raw candidates.
    """
    v_NBTH = torch.stack(candidates, dim=0)
    vf = v_NBTH.float()
    normed = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    query_H = norm.weight.float() * proj.weight[0].float()
    alpha_NBT = (normed * query_H).sum(-1).softmax(dim=0)
    return (alpha_NBT.unsqueeze(-1) * vf).sum(0).to(v_NBTH.dtype)


class KimiShortConv(nn.Module):
    """Causal depthwise conv (kernel K, no bias) + SiLU in fp32; its state is the last K-1 inputs."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel_size))

    def forward(self, x_BTD, state_BDW=None):
        B, T, D = x_BTD.shape
        xt = x_BTD.float().transpose(1, 2)
        if state_BDW is None:
            state_BDW = xt.new_zeros(B, D, self.kernel_size - 1)
        full = torch.cat([state_BDW.float(), xt], dim=-1)
        y = F.conv1d(full, self.weight.float(), groups=D)
        return F.silu(y).transpose(1, 2).to(x_BTD.dtype), full[..., full.shape[-1] - (self.kernel_size - 1):]


def situ_params(config: KimiLinearConfig) -> tuple[float, float | None]:
    """(beta, linear_beta) of SiTU-GLU; an unset beta means 1.0 and an unset linear beta leaves `up` as is."""
    return config.activation_situ_beta or 1.0, config.activation_situ_linear_beta


def glu(config: KimiLinearConfig, gate, up):
    """The gated activation `hidden_act` names: SiTU-GLU for "situ", else `ACT2FN[hidden_act](gate) * up`."""
    if config.hidden_act == "situ":
        beta, linear_beta = situ_params(config)
        return situ_glu(gate, up, beta, linear_beta)
    return ACT2FN[config.hidden_act](gate) * up


class KimiMLP(nn.Module):
    """GLU MLP with the model's `hidden_act` (SiTU for Kimi-K3): dense layer 0 and the shared experts."""

    def __init__(self, config: KimiLinearConfig, intermediate_size: int):
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(glu(self.config, self.gate_proj(x), self.up_proj(x)))


# --------------------------------------------------------------------------------------------------------
# Attention


class KimiDeltaAttention(nn.Module):
    """KDA linear attention. Kernels get raw beta logits and compute sigmoid(beta) themselves."""

    def __init__(self, config: KimiLinearConfig, layer_idx: int):
        super().__init__()
        lac = config.linear_attn_config
        self.layer_idx = layer_idx
        self.num_heads = lac["num_heads"]
        self.head_dim = lac["head_dim"]
        self.lower_bound = lac.get("gate_lower_bound", -5.0)
        proj = self.num_heads * self.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, proj, bias=False)
        self.k_proj = nn.Linear(hidden, proj, bias=False)
        self.v_proj = nn.Linear(hidden, proj, bias=False)
        self.q_conv1d = KimiShortConv(proj, lac["short_conv_kernel_size"])
        self.k_conv1d = KimiShortConv(proj, lac["short_conv_kernel_size"])
        self.v_conv1d = KimiShortConv(proj, lac["short_conv_kernel_size"])
        # Stored padded to a head_dim-long vector; only the first num_heads entries are used.
        self.A_log = nn.Parameter(torch.zeros(max(self.num_heads, self.head_dim)))
        self.dt_bias = nn.Parameter(torch.zeros(proj))
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, proj, bias=False)
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.g_proj = nn.Linear(hidden, proj, bias=False)
        self.o_norm = KimiGatedRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(proj, hidden, bias=False)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False, **kwargs):
        B, T, _ = hidden_states.shape
        h, d = self.num_heads, self.head_dim
        cache = past_key_values
        conv_state = cache.conv_states[self.layer_idx] if cache is not None else None
        state = cache.recurrent_states[self.layer_idx] if cache is not None else None
        cs_q, cs_k, cs_v = conv_state if conv_state is not None else (None, None, None)
        q, cs_q = self.q_conv1d(self.q_proj(hidden_states), cs_q)
        k, cs_k = self.k_conv1d(self.k_proj(hidden_states), cs_k)
        v, cs_v = self.v_conv1d(self.v_proj(hidden_states), cs_v)
        q, k, v = (x.view(B, T, h, d) for x in (q, k, v))
        g = self.f_b_proj(self.f_a_proj(hidden_states)).view(B, T, h, d)
        beta = self.b_proj(hidden_states)
        kernel_kwargs = dict(
            A_log=self.A_log[:h],
            dt_bias=self.dt_bias,
            scale=d**-0.5,
            initial_state=state,
            output_final_state=cache is not None,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            lower_bound=self.lower_bound,
            transpose_state_layout=True,
        )
        if cache is not None and state is not None and T == 1:
            o, state = fused_recurrent_kda(q, k, v, g, beta, **kernel_kwargs)
        else:
            o, state = chunk_kda(q, k, v, g, beta, safe_gate=True, **kernel_kwargs)
        if cache is not None:
            cache.conv_states[self.layer_idx] = (cs_q, cs_k, cs_v)
            cache.recurrent_states[self.layer_idx] = state
        o = self.o_norm(o, self.g_proj(hidden_states).view(B, T, h, d))
        return self.o_proj(o.reshape(B, T, h * d))


class KimiMLAAttention(nn.Module):
    """Multi-head latent attention without RoPE (`mla_use_nope`), with a sigmoid output gate when
    `mla_use_output_gate` is set. The low-rank norms use eps 1e-6 (upstream builds them with its default)."""

    def __init__(self, config: KimiLinearConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.scaling = self.q_head_dim**-0.5
        hidden, h = config.hidden_size, self.num_heads
        self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
        self.q_a_layernorm = KimiRMSNorm(config.q_lora_rank, eps=1e-6)
        self.q_b_proj = nn.Linear(config.q_lora_rank, h * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, config.kv_lora_rank + config.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = KimiRMSNorm(config.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, h * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.use_output_gate = bool(config.mla_use_output_gate)
        if self.use_output_gate:
            self.g_proj = nn.Linear(hidden, h * self.v_head_dim, bias=False)
        self.o_proj = nn.Linear(h * self.v_head_dim, hidden, bias=False)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False, **kwargs):
        B, S, _ = hidden_states.shape
        h = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(B, S, h, self.q_head_dim).transpose(1, 2)
        compressed, k_pe = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed)).view(B, S, h, -1).transpose(1, 2)
        k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_pe = k_pe.view(B, 1, S, self.qk_rope_head_dim).expand(B, h, S, self.qk_rope_head_dim)
        key = torch.cat([k_nope, k_pe], dim=-1)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        kv_len = key.shape[2]
        scores = torch.matmul(q.float(), key.float().transpose(-1, -2)) * self.scaling
        q_pos = torch.arange(kv_len - S, kv_len, device=q.device)
        keep = q_pos[:, None] >= torch.arange(kv_len, device=q.device)[None, :]
        if attention_mask is not None:
            keep = keep[None, None] & attention_mask[:, None, None, :kv_len].bool()
        scores = scores.masked_fill(~keep, torch.finfo(torch.float32).min)
        attn = torch.matmul(scores.softmax(dim=-1), value.float()).to(hidden_states.dtype)
        attn = attn.transpose(1, 2).reshape(B, S, h * self.v_head_dim)
        if self.use_output_gate:
            attn = attn * torch.sigmoid(self.g_proj(hidden_states))
        return self.o_proj(attn)


# --------------------------------------------------------------------------------------------------------
# Mixture of experts


class KimiMoEGate(nn.Module):
    """Sigmoid router (`noaux_tc`): experts chosen by top-k of score + bias, weighted by the unbiased scores.
    With `num_expert_group` > `topk_group` the choice is first limited to the `topk_group` groups whose two
    best biased scores sum highest."""

    def __init__(self, config: KimiLinearConfig):
        super().__init__()
        self.top_k = config.num_experts_per_token
        self.num_expert_group = config.num_expert_group or 1
        self.topk_group = config.topk_group or 1
        self.renormalize = config.moe_renormalize
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts))

    def forward(self, x_TH):
        """Returns (topk_idx [T, k] int64, topk_weight [T, k] fp32)."""
        scores_TE = F.linear(x_TH.float(), self.weight.float()).sigmoid()
        choice_TE = scores_TE + self.e_score_correction_bias.float()
        if self.num_expert_group > 1 and self.num_expert_group > self.topk_group:
            T, E = choice_TE.shape
            grouped = choice_TE.view(T, self.num_expert_group, E // self.num_expert_group)
            best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
            keep = torch.zeros(T, self.num_expert_group, dtype=torch.bool, device=x_TH.device)
            keep.scatter_(1, best_groups, True)
            choice_TE = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)
        _, topk_idx = torch.topk(choice_TE, self.top_k, dim=-1)
        topk_weight = scores_TE.gather(1, topk_idx)
        if self.renormalize:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx, topk_weight * self.routed_scaling_factor


class KimiExpert(nn.Module):
    """One routed expert at the experts' width (`routed_expert_hidden_size`): `w2(glu(w1 x, w3 x))`."""

    def __init__(self, config: KimiLinearConfig, width: int):
        super().__init__()
        self.config = config
        self.w1 = nn.Linear(width, config.moe_intermediate_size, bias=False)
        self.w3 = nn.Linear(width, config.moe_intermediate_size, bias=False)
        self.w2 = nn.Linear(config.moe_intermediate_size, width, bias=False)

    def forward(self, x):
        return self.w2(glu(self.config, self.w1(x), self.w3(x)))


class KimiSparseMoeBlock(nn.Module):
    """Latent MoE: router on the full width, experts at `routed_expert_hidden_size` between
    `routed_expert_down_proj` and `_up_proj` (at the full width when that key is None), shared experts on
    the full-width input."""

    def __init__(self, config: KimiLinearConfig):
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.ep_size = 1
        self.ep_rank = 0
        self.experts_per_rank = config.num_experts
        self.gate = KimiMoEGate(config)
        self.use_latent_moe = config.routed_expert_hidden_size is not None
        width = config.routed_expert_hidden_size if self.use_latent_moe else config.hidden_size
        self.use_latent_norm = self.use_latent_moe and bool(config.latent_moe_use_norm)
        self.experts = nn.ModuleList([KimiExpert(config, width) for _ in range(config.num_experts)])
        if self.use_latent_moe:
            self.routed_expert_down_proj = nn.Linear(config.hidden_size, width, bias=False)
            if self.use_latent_norm:
                self.routed_expert_norm = KimiRMSNorm(width, eps=config.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(width, config.hidden_size, bias=False)
        if config.num_shared_experts:
            self.shared_experts = KimiMLP(config, config.moe_intermediate_size * config.num_shared_experts)

    def forward(self, hidden_states):
        if self.training:
            raise NotImplementedError("KimiSparseMoeBlock does not support training")
        identity = hidden_states
        B, T, H = hidden_states.shape
        x_TH = hidden_states.reshape(-1, H)
        topk_idx, topk_weight = self.gate(x_TH)
        x_TL = self.routed_expert_down_proj(x_TH) if self.use_latent_moe else x_TH
        y_TL = self.moe_infer(x_TL, topk_idx, topk_weight)
        if self.use_latent_norm:
            y_TL = self.routed_expert_norm(y_TL)
        y = (self.routed_expert_up_proj(y_TL) if self.use_latent_moe else y_TL).view(B, T, H)
        if self.config.num_shared_experts:
            y = y + self.shared_experts(identity)
        return y

    @torch.no_grad()
    def moe_infer(self, x_TL, topk_idx, topk_weight):
        """Sort token copies by expert, run each expert on its rows in a Python loop, scatter back."""
        T, k = topk_idx.shape
        order = topk_idx.view(-1).argsort()
        sorted_tokens = x_TL[order // k]
        tokens_per_expert = torch.bincount(topk_idx.view(-1), minlength=self.num_experts).cpu().numpy()
        outputs = []
        start = 0
        for i, count in enumerate(tokens_per_expert):
            if count == 0:
                continue
            expert = self.experts[i + self.ep_rank * self.experts_per_rank]
            outputs.append(expert(sorted_tokens[start : start + count]))
            start += count
        outs = torch.cat(outputs, dim=0) if outputs else sorted_tokens.new_empty(0, x_TL.shape[-1])
        unsorted = torch.empty_like(outs)
        unsorted[order] = outs
        mixed = (unsorted.view(T, k, -1).float() * topk_weight.unsqueeze(-1)).sum(dim=1)
        return mixed.to(x_TL.dtype)


# --------------------------------------------------------------------------------------------------------
# Cache


class KimiDynamicCache:
    """Per layer: MLA keys/values grown with torch.cat; KDA conv states and fp32 recurrent states."""

    is_compileable = False

    def __init__(self, config: KimiLinearConfig):
        n = config.num_hidden_layers
        self.mla_layers = [i for i in range(n) if not config.is_kda_layer(i)]
        self.key_cache = [None] * n
        self.value_cache = [None] * n
        self.conv_states = [None] * n
        self.recurrent_states = [None] * n

    def __len__(self):
        return len(self.key_cache)

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None):
        if self.key_cache[layer_idx] is None:
            self.key_cache[layer_idx] = key_states
            self.value_cache[layer_idx] = value_states
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        layer_idx = self.mla_layers[0] if layer_idx is None or layer_idx not in self.mla_layers else layer_idx
        cached = self.key_cache[layer_idx]
        return 0 if cached is None else cached.shape[-2]

    def get_mask_sizes(self, cache_position: torch.Tensor, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + cache_position.shape[0], 0

    def reorder_cache(self, beam_idx: torch.LongTensor):
        for store in (self.key_cache, self.value_cache, self.recurrent_states):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t.index_select(0, beam_idx.to(t.device))
        for i, states in enumerate(self.conv_states):
            if states is not None:
                self.conv_states[i] = tuple(s.index_select(0, beam_idx.to(s.device)) for s in states)


# --------------------------------------------------------------------------------------------------------
# Model


class KimiDecoderLayer(nn.Module):
    def __init__(self, config: KimiLinearConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        attn_cls = KimiDeltaAttention if config.is_kda_layer(layer_idx) else KimiMLAAttention
        self.self_attn = attn_cls(config, layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        if self.is_moe:
            self.block_sparse_moe = KimiSparseMoeBlock(config)
        else:
            self.mlp = KimiMLP(config, config.intermediate_size)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = KimiRMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = KimiRMSNorm(hidden, eps=eps)
        self.self_attention_res_norm = KimiRMSNorm(hidden, eps=eps)
        self.self_attention_res_proj = nn.Linear(hidden, 1, bias=False)
        self.mlp_res_norm = KimiRMSNorm(hidden, eps=eps)
        self.mlp_res_proj = nn.Linear(hidden, 1, bias=False)

    def forward(self, blocks, partial, attention_mask=None, past_key_values=None, use_cache=False):
        """blocks: stored block residuals [B,T,H]; partial: this block's running sum or None.
        Returns the updated running sum."""
        candidates = blocks + ([partial] if partial is not None else [])
        h = attn_res_mix(candidates, self.self_attention_res_norm, self.self_attention_res_proj)
        attn_out = self.self_attn(
            self.input_layernorm(h), attention_mask=attention_mask, past_key_values=past_key_values,
            use_cache=use_cache,
        )
        partial = attn_out if partial is None else partial + attn_out
        h = attn_res_mix(blocks + [partial], self.mlp_res_norm, self.mlp_res_proj)
        ffn = self.block_sparse_moe if self.is_moe else self.mlp
        return partial + ffn(self.post_attention_layernorm(h))


class KimiLinearPreTrainedModel(PreTrainedModel):
    config_class = KimiLinearConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["KimiDecoderLayer"]
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias", "conv1d", "o_norm", "e_score_correction_bias"]
    _can_compile_fullgraph = False

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, KimiShortConv):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, KimiDeltaAttention):
            h = module.num_heads
            a_log = torch.zeros_like(module.A_log)
            a_log[:h] = torch.empty(h).uniform_(1, 16).log()
            with torch.no_grad():
                module.A_log.copy_(a_log)
            nn.init.zeros_(module.dt_bias)
        elif isinstance(module, KimiMoEGate):
            nn.init.normal_(module.weight, std=std)
            nn.init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, (KimiRMSNorm, KimiGatedRMSNorm)):
            nn.init.ones_(module.weight)


class KimiLinearModel(KimiLinearPreTrainedModel):
    def __init__(self, config: KimiLinearConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([KimiDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.output_attn_res_norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        **kwargs,
    ):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = KimiDynamicCache(self.config)
        cache = past_key_values if use_cache else None
        block_size = self.config.attn_res_block_size
        blocks, partial = [inputs_embeds], None
        for i, layer in enumerate(self.layers):
            partial = layer(blocks, partial, attention_mask=attention_mask, past_key_values=cache)
            if (i + 1) % block_size == 0:
                blocks.append(partial)
                partial = None
        candidates = blocks + ([partial] if partial is not None else [])
        hidden = attn_res_mix(candidates, self.output_attn_res_norm, self.output_attn_res_proj)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), past_key_values=cache)


class KimiLinearForCausalLM(KimiLinearPreTrainedModel, GenerationMixin):
    def __init__(self, config: KimiLinearConfig):
        super().__init__(config)
        self.model = KimiLinearModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def tie_weights(self, **kwargs):
        # Upstream declares `tie_weights(self)`; transformers 5.24 calls it with keywords from post_init,
        # so a class with that exact signature cannot be built at all. The stand-in takes and ignores them.
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep: int = 0,
        **kwargs,
    ):
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden = outputs.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)

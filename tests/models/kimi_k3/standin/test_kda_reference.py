"""The stand-in's pure-torch KDA: chunked == recurrent == the math of the checkpoint notes, in float64."""

import pytest
import torch
import torch.nn.functional as F

from modelopt_ext.models.kimi_k3.standin import modeling_kimi_linear as mkl

B, H, K, V = 2, 3, 8, 6


def _inputs(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g)
    k = torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    gate = torch.randn(B, T, H, K, generator=g)
    beta = torch.randn(B, T, H, generator=g)
    A_log = torch.rand(H, generator=g).mul(15).add(1).log()
    dt_bias = torch.randn(H * K, generator=g) * 0.1
    return q, k, v, gate, beta, A_log, dt_bias


KERNEL = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)


def _naive(q, k, v, gate, beta, A_log, dt_bias, S0=None):
    """Direct transcription of the checkpoint notes, float64, one head and one step at a time."""
    q, k, v = (x.double() for x in (q, k, v))
    q = q / q.norm(dim=-1, keepdim=True) * K**-0.5
    k = k / k.norm(dim=-1, keepdim=True)
    decay = -5 * torch.sigmoid(A_log.double().exp().view(H, 1) * (gate.double() + dt_bias.double().view(H, K)))
    b = torch.sigmoid(beta.double())
    T = q.shape[1]
    out = torch.zeros(B, T, H, V, dtype=torch.float64)
    S_all = torch.zeros(B, H, K, V, dtype=torch.float64) if S0 is None else S0.double().clone()
    for bi in range(B):
        for h in range(H):
            S = S_all[bi, h]
            for t in range(T):
                S = torch.diag(decay[bi, t, h].exp()) @ S
                kt = k[bi, t, h]
                S = S + b[bi, t, h] * torch.outer(kt, v[bi, t, h] - S.T @ kt)
                out[bi, t, h] = S.T @ q[bi, t, h]
            S_all[bi, h] = S
    return out, S_all


@pytest.mark.parametrize("T", [1, 5, 16, 17, 40])
def test_chunked_and_recurrent_match_the_math(T):
    q, k, v, gate, beta, A_log, dt_bias = _inputs(T)
    ref_o, ref_S = _naive(q, k, v, gate, beta, A_log, dt_bias)
    for fn in (mkl.torch_chunk_kda, mkl.torch_recurrent_kda):
        o, S = fn(q, k, v, gate, beta, A_log=A_log, dt_bias=dt_bias, output_final_state=True, **KERNEL)
        assert o.dtype == v.dtype
        torch.testing.assert_close(o.double(), ref_o, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(S.double(), ref_S, atol=2e-5, rtol=1e-4)


def test_initial_state_and_split_prefill():
    q, k, v, gate, beta, A_log, dt_bias = _inputs(37, seed=1)
    kw = dict(A_log=A_log, dt_bias=dt_bias, output_final_state=True, **KERNEL)
    o_all, S_all = mkl.torch_chunk_kda(q, k, v, gate, beta, **kw)
    o1, S1 = mkl.torch_chunk_kda(*(x[:, :21] for x in (q, k, v, gate, beta)), **kw)
    o2, S2 = mkl.torch_chunk_kda(*(x[:, 21:] for x in (q, k, v, gate, beta)), initial_state=S1, **kw)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o_all, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S2, S_all, atol=1e-5, rtol=1e-5)
    # one-token recurrent decode continuing a chunked prefill
    o3, S3 = mkl.torch_recurrent_kda(*(x[:, 36:] for x in (q, k, v, gate, beta)), initial_state=
                                     mkl.torch_chunk_kda(*(x[:, :36] for x in (q, k, v, gate, beta)), **kw)[1], **kw)
    torch.testing.assert_close(o3, o_all[:, 36:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S3, S_all, atol=1e-5, rtol=1e-5)


def test_state_layout_v_first_and_alias():
    q, k, v, gate, beta, A_log, dt_bias = _inputs(9)
    kw = dict(A_log=A_log, dt_bias=dt_bias, output_final_state=True, **KERNEL)
    _, S_kv = mkl.torch_chunk_kda(q, k, v, gate, beta, **kw)
    _, S_vk = mkl.torch_chunk_kda(q, k, v, gate, beta, state_v_first=True, **kw)
    _, S_alias = mkl.torch_chunk_kda(q, k, v, gate, beta, transpose_state_layout=True, **kw)
    assert S_vk.shape == (B, H, V, K)
    torch.testing.assert_close(S_vk, S_kv.transpose(-1, -2))
    torch.testing.assert_close(S_alias, S_vk)
    o_a, _ = mkl.torch_recurrent_kda(q, k, v, gate, beta, initial_state=S_vk, state_v_first=True, **kw)
    o_b, _ = mkl.torch_recurrent_kda(q, k, v, gate, beta, initial_state=S_kv, **kw)
    torch.testing.assert_close(o_a, o_b)


def test_beta_flag_semantics():
    """With the in-kernel flag the kernel squashes raw logits; without it beta must already be squashed."""
    q, k, v, gate, beta, A_log, dt_bias = _inputs(12)
    kw = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0)
    o_flag, _ = mkl.torch_chunk_kda(q, k, v, gate, beta, use_beta_sigmoid_in_kernel=True, **kw)
    o_pre, _ = mkl.torch_chunk_kda(q, k, v, gate, torch.sigmoid(beta), use_beta_sigmoid_in_kernel=False, **kw)
    o_raw, _ = mkl.torch_chunk_kda(q, k, v, gate, beta, use_beta_sigmoid_in_kernel=False, **kw)
    torch.testing.assert_close(o_flag, o_pre)
    assert (o_flag - o_raw).abs().max() > 1e-2


def test_gate_bounds_and_softplus_form():
    g = torch.randn(4, 5, H, K) * 5
    A_log = torch.rand(H).mul(15).add(1).log()
    lb = mkl.torch_kda_gate(g, A_log, None, -5.0)
    assert lb.min() >= -5.0 and lb.max() <= 0
    sp = mkl.torch_kda_gate(g, A_log, None, None)
    torch.testing.assert_close(sp, -A_log.exp().view(H, 1) * F.softplus(g))


def test_refuses_unknown_arguments():
    q, k, v, gate, beta, A_log, dt_bias = _inputs(3)
    with pytest.raises(TypeError, match="not_a_flag"):
        mkl.torch_chunk_kda(q, k, v, gate, beta, A_log=A_log, not_a_flag=True, **KERNEL)


def test_dispatch_uses_reference_on_cpu():
    q, k, v, gate, beta, A_log, dt_bias = _inputs(4)
    kw = dict(A_log=A_log, dt_bias=dt_bias, output_final_state=True, **KERNEL)
    torch.testing.assert_close(mkl.chunk_kda(q, k, v, gate, beta, **kw)[0], mkl.torch_chunk_kda(q, k, v, gate, beta, **kw)[0])
    torch.testing.assert_close(
        mkl.fused_recurrent_kda(q, k, v, gate, beta, **kw)[0], mkl.torch_recurrent_kda(q, k, v, gate, beta, **kw)[0]
    )

"""Fused routed experts (modelopt_ext.models.kimi_k3.experts) against a per-token float64 reference.

Covers the dense `KimiK3Experts` under transformers' eager / grouped_mm / batched_mm experts
implementations, the MXFP4 `KimiK3PackedExperts` (resident bytes, dequantize-on-access, one
materialization per forward whose per-expert slices are views of one 3-D tensor) and gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from modelopt_ext.ep.local import MIN_ROWS
from modelopt_ext.experts import mxfp4 as mxfp4_experts
from modelopt_ext.formats.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from modelopt_ext.models.kimi_k3 import experts as experts_mod
from modelopt_ext.models.kimi_k3.experts import KimiK3Experts, KimiK3PackedExperts
from modelopt_ext.models.kimi_k3.standin.configuration_kimi_k3 import KimiLinearConfig

E, L, I = 6, 32, 64  # experts, latent width, expert width (multiples of 32 for MXFP4)
IMPLS = ("eager", "grouped_mm", "batched_mm")


def make_config(impl: str | None = None, **overrides) -> KimiLinearConfig:
    kw = dict(num_hidden_layers=2, hidden_size=64, num_experts=E, routed_expert_hidden_size=L, moe_intermediate_size=I,
              num_experts_per_token=2)
    kw.update(overrides)
    config = KimiLinearConfig(**kw)
    config._experts_implementation = impl
    return config


def routing(with_sentinel: bool):
    """Hand-written top-2 routing over E=6 experts: expert 4 never receives a token; with `with_sentinel`,
    some slots carry the EP sentinel id E (== num_experts) with a NONZERO weight, which must still be dropped."""
    idx = [[0, 1], [1, 3], [5, 0], [2, 0], [1, 2], [3, 5], [0, 2]]
    if with_sentinel:
        idx[1][1] = E
        idx[5] = [E, E]
        idx[6][0] = E
    g = torch.Generator().manual_seed(7)
    w = torch.rand(len(idx), 2, generator=g) + 0.1
    return torch.tensor(idx, dtype=torch.int64), w


def situ_glu_ref(g: float, u: float, beta: float, linear_beta: float) -> float:
    return beta * math.tanh(g / beta) * (1.0 / (1.0 + math.exp(-g))) * linear_beta * math.tanh(u / linear_beta)


def reference_loops(x, idx, w, W13, W2, beta=4.0, linear_beta=25.0) -> torch.Tensor:
    """Per-token, per-slot, per-element Python loops in float64 (no torch kernels on the hot path)."""
    x, W13, W2, w = (t.detach().double().tolist() for t in (x, W13, W2, w))
    n_exp, two_i = len(W13), len(W13[0])
    i_dim, l_dim = two_i // 2, len(W2[0])
    out = []
    for t, row in enumerate(idx.tolist()):
        acc = [0.0] * l_dim
        for j, e in enumerate(row):
            if e >= n_exp:  # EP sentinel: not a local expert
                continue
            proj = [sum(a * b for a, b in zip(W13[e][r], x[t])) for r in range(two_i)]
            h = [situ_glu_ref(proj[r], proj[i_dim + r], beta, linear_beta) for r in range(i_dim)]
            for o in range(l_dim):
                acc[o] += w[t][j] * sum(a * b for a, b in zip(W2[e][o], h))
        out.append(acc)
    return torch.tensor(out, dtype=torch.float64)


def reference_autograd(x, idx, w, W13, W2, beta=4.0, linear_beta=25.0) -> torch.Tensor:
    """Differentiable float64 reference: a loop over tokens and slots, one matvec per (token, expert)."""
    n_exp, i_dim = W13.shape[0], W13.shape[1] // 2
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(W2.shape[1], dtype=torch.float64)
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e >= n_exp:
                continue
            g = W13[e, :i_dim] @ x[t]
            u = W13[e, i_dim:] @ x[t]
            h = beta * torch.tanh(g / beta) * torch.sigmoid(g) * linear_beta * torch.tanh(u / linear_beta)
            acc = acc + w[t, j] * (W2[e] @ h)
        rows.append(acc)
    return torch.stack(rows)


def random_weights(seed: int, scale: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    W13 = torch.randn(E, 2 * I, L, generator=g) * scale
    W2 = torch.randn(E, L, I, generator=g) * (scale / 2)
    x = torch.randn(7, L, generator=g)
    return W13, W2, x


def dense_experts(W13, W2, impl, **cfg) -> KimiK3Experts:
    ex = KimiK3Experts(make_config(impl, **cfg))
    with torch.no_grad():
        ex.gate_up_proj.copy_(W13)
        ex.down_proj.copy_(W2)
    return ex


def packed_experts(W13, W2, impl, **cfg):
    """Packed experts filled with quantize_mxfp4 bytes, and those bytes."""
    ex = KimiK3PackedExperts(make_config(impl, **cfg))
    q13, q2 = quantize_mxfp4(W13), quantize_mxfp4(W2)
    with torch.no_grad():
        ex.gate_up_proj_packed.copy_(q13[0])
        ex.gate_up_proj_scale.copy_(q13[1])
        ex.down_proj_packed.copy_(q2[0])
        ex.down_proj_scale.copy_(q2[1])
    return ex, q13, q2


# ----------------------------------------------------------------------------------------------------
# the reference itself


def test_reference_loops_by_hand():
    """A 1-expert, 1-token case computed by hand pins the reference (and its w1-rows-first layout)."""
    W13 = torch.zeros(1, 2, 2, dtype=torch.float64)
    W13[0, 0] = torch.tensor([1.0, 0.0])  # w1 row: g = x0
    W13[0, 1] = torch.tensor([0.0, 2.0])  # w3 row: u = 2 x1
    W2 = torch.tensor([[[3.0], [-1.0]]], dtype=torch.float64)  # [1, L=2, I=1]
    x = torch.tensor([[0.5, 1.5]], dtype=torch.float64)
    w = torch.tensor([[0.25]], dtype=torch.float64)
    g, u = 0.5, 3.0
    act = 4 * math.tanh(g / 4) / (1 + math.exp(-g)) * 25 * math.tanh(u / 25)
    want = torch.tensor([[0.25 * 3 * act, -0.25 * act]], dtype=torch.float64)
    got = reference_loops(x, torch.tensor([[0]]), w, W13, W2)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    torch.testing.assert_close(reference_autograd(x, torch.tensor([[0]]), w, W13, W2), want, rtol=1e-14, atol=0)


def test_situ_glu_matches_formula():
    g = torch.linspace(-30, 30, 61)
    u = torch.linspace(-80, 80, 61)
    got = experts_mod.situ_glu(g, u, 4.0, 25.0)
    want = torch.tensor([situ_glu_ref(a, b, 4.0, 25.0) for a, b in zip(g.tolist(), u.tolist())], dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # computed in fp32, returned in the input dtype
    assert experts_mod.situ_glu(g.bfloat16(), u.bfloat16(), 4.0, 25.0).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------------
# dense experts


@pytest.mark.parametrize("with_sentinel", [False, True], ids=["local", "ep-sentinels"])
@pytest.mark.parametrize("impl", IMPLS)
def test_dense_matches_reference(impl, with_sentinel):
    W13, W2, x = random_weights(0)
    idx, w = routing(with_sentinel)
    ex = dense_experts(W13, W2, impl)
    if with_sentinel and impl != "eager":
        # transformers' grouped_mm / batched_mm only drop sentinel ids (== num_experts) on an EP module.
        ex._is_expert_parallel = True
    with torch.no_grad():
        got = ex(x, idx, w)
    assert got.shape == (7, L) and got.dtype == torch.float32
    want = reference_loops(x, idx, w, W13, W2)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # rows whose every slot is a sentinel are exactly zero; expert 4 (no tokens) influences nothing
    if with_sentinel:
        assert torch.equal(got[5], torch.zeros(L))
    W13_b = W13.clone()
    W13_b[4] += 100.0
    with torch.no_grad():
        again = dense_experts(W13_b, W2, impl)
        again._is_expert_parallel = ex._is_expert_parallel
        torch.testing.assert_close(again(x, idx, w), got, rtol=0, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_dense_uses_config_situ_betas(impl):
    W13, W2, x = random_weights(1, scale=1.0)
    idx, w = routing(False)
    ex = dense_experts(W13, W2, impl, activation_situ_beta=1.5, activation_situ_linear_beta=2.0)
    with torch.no_grad():
        got = ex(x, idx, w)
    want = reference_loops(x, idx, w, W13, W2, beta=1.5, linear_beta=2.0)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, reference_loops(x, idx, w, W13, W2), rtol=1e-3, atol=1e-3)


def test_dense_layout_and_init():
    ex = KimiK3Experts(make_config(None, initializer_range=0.05))
    assert tuple(ex.gate_up_proj.shape) == (E, 2 * I, L)
    assert tuple(ex.down_proj.shape) == (E, L, I)
    assert ex.gate_up_proj.requires_grad and ex.down_proj.requires_grad
    assert 0.03 < ex.gate_up_proj.std().item() < 0.07  # initialized with initializer_range, not left empty
    assert ex.has_gate and not ex.is_transposed  # transformers' fused layout [E, 2I, L], not transposed


def test_dense_bf16_input_keeps_dtype():
    W13, W2, x = random_weights(2)
    idx, w = routing(False)
    ex = dense_experts(W13, W2, "eager").to(torch.bfloat16)
    with torch.no_grad():
        got = ex(x.bfloat16(), idx, w)
    assert got.dtype == torch.bfloat16
    want = reference_loops(x.bfloat16(), idx, w, ex.gate_up_proj.float(), ex.down_proj.float())
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)


# ----------------------------------------------------------------------------------------------------
# packed (MXFP4) experts


def test_packed_resident_parameters_are_uint8_bytes():
    ex = KimiK3PackedExperts(make_config(None))
    params = dict(ex.named_parameters())
    assert set(params) == {"gate_up_proj_packed", "gate_up_proj_scale", "down_proj_packed", "down_proj_scale"}
    assert all(p.dtype == torch.uint8 and not p.requires_grad for p in params.values())
    assert not any(b.is_floating_point() for b in ex.buffers())
    resident = sum(p.numel() * p.element_size() for p in ex.parameters()) + sum(
        b.numel() * b.element_size() for b in ex.buffers())
    want = E * (2 * I * L // 2 + 2 * I * L // 32 + L * I // 2 + L * I // 32)
    assert resident == want
    assert resident * 8 / (E * 3 * I * L) == pytest.approx(4.25)
    assert tuple(params["gate_up_proj_packed"].shape) == (E, 2 * I, L // 2)
    assert tuple(params["down_proj_scale"].shape) == (E, L, I // 32)


def test_packed_refuses_widths_off_the_group():
    with pytest.raises(ValueError, match="48"):
        KimiK3PackedExperts(make_config(None, routed_expert_hidden_size=48))


@pytest.mark.parametrize("materialize", [False, True], ids=["on-access", "materialized"])
@pytest.mark.parametrize("with_sentinel", [False, True], ids=["local", "ep-sentinels"])
@pytest.mark.parametrize("impl", IMPLS)
def test_packed_matches_dense_of_dequantized_bytes(impl, with_sentinel, materialize):
    W13, W2, x = random_weights(3)
    idx, w = routing(with_sentinel)
    packed, (p13, s13), (p2, s2) = packed_experts(W13, W2, impl)
    D13, D2 = dequantize_mxfp4(p13, s13, torch.float32), dequantize_mxfp4(p2, s2, torch.float32)
    assert not torch.equal(D13, W13)  # the quantization actually changed something
    dense = dense_experts(D13, D2, impl)
    ep = with_sentinel and impl != "eager"
    packed._is_expert_parallel = dense._is_expert_parallel = ep
    with torch.no_grad():
        want = dense(x, idx, w)
        if materialize:
            with packed.materialized(torch.float32):
                got = packed(x, idx, w)
        else:
            got = packed(x, idx, w)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.double(), reference_loops(x, idx, w, D13, D2), rtol=1e-5, atol=1e-5)


def test_packed_projection_outside_forward_is_fresh_dequantization():
    W13, W2, _ = random_weights(4)
    packed, (p13, s13), (p2, s2) = packed_experts(W13, W2, None)
    assert packed.dequant_dtype == torch.float32
    a, b = packed.gate_up_proj, packed.gate_up_proj
    assert a.dtype == torch.float32 and tuple(a.shape) == (E, 2 * I, L)
    assert torch.equal(a, dequantize_mxfp4(p13, s13, torch.float32))
    assert torch.equal(packed.down_proj, dequantize_mxfp4(p2, s2, torch.float32))
    assert a is not b and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    a.zero_()  # a fresh tensor: writing into it does not touch the module
    assert torch.equal(packed.gate_up_proj, b)
    packed.dequant_dtype = torch.bfloat16
    assert packed.gate_up_proj.dtype == torch.bfloat16
    assert torch.equal(packed.down_proj, dequantize_mxfp4(p2, s2, torch.bfloat16))


class _Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, packed, scale, *args, **kwargs):
        dtype = args[0] if args else kwargs.get("dtype", torch.bfloat16)
        self.calls.append((packed.data_ptr(), dtype))
        return self.fn(packed, scale, *args, **kwargs)


@pytest.mark.parametrize("impl", IMPLS)
def test_materialized_dequantizes_once_per_projection(impl, monkeypatch):
    W13, W2, x = random_weights(5)
    idx, w = routing(False)
    packed, _, _ = packed_experts(W13, W2, impl)
    spy = _Counting(mxfp4_experts.dequantize_mxfp4)
    monkeypatch.setattr(mxfp4_experts, "dequantize_mxfp4", spy)

    with torch.no_grad():
        packed(x, idx, w)  # no context: one dequantization per projection access
    assert len(spy.calls) == 2
    spy.calls.clear()

    with torch.no_grad(), packed.materialized(torch.bfloat16):
        assert len(spy.calls) == 2
        gu, down = packed.gate_up_proj, packed.down_proj
        assert packed.gate_up_proj is gu and packed.down_proj is down
        assert gu.dtype == torch.bfloat16 and down.dtype == torch.bfloat16
        packed(x.bfloat16(), idx, w)
        packed(x.bfloat16(), idx, w)
        assert len(spy.calls) == 2  # nothing more, whatever the implementation reads
    assert set(spy.calls) == {(packed.gate_up_proj_packed.data_ptr(), torch.bfloat16),
                              (packed.down_proj_packed.data_ptr(), torch.bfloat16)}
    # the cache is empty afterwards and the dtype is restored
    assert packed._materialized == {}
    assert packed.dequant_dtype == torch.float32
    after = packed.gate_up_proj
    assert len(spy.calls) == 3 and after.dtype == torch.float32
    assert after.untyped_storage().data_ptr() != gu.untyped_storage().data_ptr()


def test_materialized_cleans_up_when_the_body_raises():
    W13, W2, _ = random_weights(6)
    packed, _, _ = packed_experts(W13, W2, None)
    with pytest.raises(RuntimeError, match="boom"):
        with packed.materialized(torch.bfloat16):
            assert packed.gate_up_proj.dtype == torch.bfloat16
            raise RuntimeError("boom")
    assert packed._materialized == {}
    assert packed.dequant_dtype == torch.float32
    assert packed.gate_up_proj.dtype == torch.float32


def test_nested_materialized_contexts():
    """A caller that holds the experts materialized around a model forward (whose MoE block enters
    `materialized(x.dtype)` itself) must keep its cache, and the inner context must honour its dtype."""
    W13, W2, _ = random_weights(9)
    packed, _, _ = packed_experts(W13, W2, None)
    with packed.materialized(torch.float32):
        outer = packed.gate_up_proj
        with packed.materialized(torch.bfloat16):
            inner_dtype = packed.gate_up_proj.dtype
        still_cached = packed.gate_up_proj is outer
    assert still_cached, "the inner context emptied the outer context's cache"
    assert inner_dtype == torch.bfloat16


def test_eager_expert_slices_are_views_of_the_materialized_tensor(monkeypatch):
    """ModelOpt's _QuantFusedExperts recovers the expert id of each F.linear weight from its storage offset in
    the fused tensor: (offset - base offset) // base.stride(0). Every weight used in the forward must be a view
    of ONE materialized tensor per projection."""
    W13, W2, x = random_weights(7)
    idx, w = routing(True)  # includes sentinels, which must not produce a GEMM
    packed, _, _ = packed_experts(W13, W2, "eager")
    seen = []
    real_linear = F.linear

    def spy_linear(inp, weight, bias=None):
        seen.append((inp, weight))
        return real_linear(inp, weight, bias)

    with torch.no_grad(), packed.materialized(torch.float32):
        gu, down = packed.gate_up_proj, packed.down_proj
        monkeypatch.setattr(torch.nn.functional, "linear", spy_linear)
        packed(x, idx, w)
        monkeypatch.undo()

    hit = sorted({e for row in idx.tolist() for e in row if e < E})
    assert hit == [0, 1, 2, 5]  # expert 3 only appears in sentinel-overwritten rows here
    assert len(seen) == 2 * len(hit)
    ids = {"gate_up": [], "down": []}
    for inp, weight in seen:
        base, kind = (gu, "gate_up") if tuple(weight.shape) == (2 * I, L) else (down, "down")
        assert tuple(weight.shape) in ((2 * I, L), (L, I))
        assert weight.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), "not a view"
        offset = weight.storage_offset() - base.storage_offset()
        e = offset // base.stride(0)
        assert offset % base.stride(0) == 0
        assert torch.equal(weight, base[e])
        ids[kind].append(e)
        if kind == "gate_up":  # the rows routed to expert e (slot-major order, as torch.where gives them)
            tokens = [t for j in range(idx.shape[1]) for t, row in enumerate(idx.tolist()) if row[j] == e]
            # padded with zero rows to MIN_ROWS (row-count-independent GEMMs; see ep.local)
            assert inp.shape[0] == max(len(tokens), MIN_ROWS)
            assert torch.equal(inp[: len(tokens)], x[tokens]) and not inp[len(tokens):].any()
    assert ids["gate_up"] == hit and ids["down"] == hit


# ----------------------------------------------------------------------------------------------------
# gradients


@pytest.mark.parametrize("impl", IMPLS)
def test_dense_training_step_gradients(impl):
    W13, W2, x = random_weights(8)
    idx, w = routing(False)
    ex = dense_experts(W13, W2, impl)
    ex.train()
    target = torch.randn(7, L, generator=torch.Generator().manual_seed(1))
    loss = (ex(x, idx, w) - target).square().sum()
    loss.backward()

    W13r = W13.double().requires_grad_(True)
    W2r = W2.double().requires_grad_(True)
    ref_loss = (reference_autograd(x.double(), idx, w.double(), W13r, W2r) - target.double()).square().sum()
    ref_loss.backward()

    for got, want in ((ex.gate_up_proj.grad, W13r.grad), (ex.down_proj.grad, W2r.grad)):
        assert got is not None and got.abs().sum() > 0
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    # expert 4 received no token: zero gradient there, nonzero on the others
    assert torch.count_nonzero(ex.gate_up_proj.grad[4]) == 0
    assert all(torch.count_nonzero(ex.gate_up_proj.grad[e]) > 0 for e in (0, 1, 2, 3, 5))

    before = ex.gate_up_proj.detach().clone()
    torch.optim.SGD(ex.parameters(), lr=1e-2).step()
    assert not torch.equal(ex.gate_up_proj.detach(), before)
    assert torch.equal(ex.gate_up_proj.detach()[4], before[4])


def test_deleting_a_fused_projection_drops_its_packed_tensors():
    """ModelOpt's HF export splits fused experts into per-expert modules, then deletes the fused attributes."""
    W13, W2, _ = random_weights(5)
    packed, _, _ = packed_experts(W13, W2, None)
    del packed.gate_up_proj
    names = {n for n, _ in packed.named_parameters()}
    assert names == {"down_proj_packed", "down_proj_scale"}
    assert packed.down_proj.shape[0] == packed.num_experts
    with pytest.raises(AttributeError):
        packed.gate_up_proj


def test_eager_result_of_a_token_does_not_depend_on_the_batch():
    """A token's output is bit-identical whether its experts see 1 or many other tokens (CPU BLAS rounds
    GEMMs of few rows differently; the eager path pads), so calibration gives the same statistics at every
    EP degree."""
    W13, W2, x = random_weights(9)
    idx, w = routing(False)
    ex = dense_experts(W13, W2, "eager")
    with torch.no_grad():
        full = ex(x, idx, w)
        for t in range(x.shape[0]):
            assert torch.equal(ex(x[t : t + 1], idx[t : t + 1], w[t : t + 1]), full[t : t + 1]), t

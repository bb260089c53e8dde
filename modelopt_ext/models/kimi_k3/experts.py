"""Kimi-K3's fused routed experts: the generic engine (`modelopt_ext.experts`) with SiTU-GLU, driven by
transformers' experts-implementation mechanism.

Widths: E `num_experts`, L `routed_expert_hidden_size` (the latent width the experts run at), I
`moe_intermediate_size`. `gate_up_proj` holds each expert's w1 rows first, then its w3 rows; `down_proj` w2.
The gate is SiTU-GLU in fp32: `beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta)` with the
config's `activation_situ_beta` and `activation_situ_linear_beta`.

Two storage classes share that interface:
- `KimiK3Experts`: dense floating-point parameters (built from a config; trainable).
- `KimiK3PackedExperts`: the checkpoint's MXFP4 bytes kept as they are (`modelopt_ext.experts.mxfp4`).
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import use_experts_implementation

from modelopt_ext.experts.fused import DenseExperts
from modelopt_ext.experts.mxfp4 import PackedExperts, materialize_in_forward
from modelopt_ext.options import DEFAULT, GLU_FORMS


def _situ_glu_reference(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    g, u = gate.float(), up.float()
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return act.to(gate.dtype)


# The activation's forms on CUDA (`ExpertsOptions.glu_on_cuda`; `scripts/bench_ep.py` measures them side by
# side; docs/performance.md): the "triton*" forms are `situ_glu.py` here (reads the 16-bit gate/up output once,
# fp32 in registers, writes the 16-bit product): "triton" its "exp2" form (tanh and sigmoid from exp2, one
# reciprocal per element; within 0.5 bf16 ulp of the float64 formula, on CPU through its mirror
# `models/kimi_k3/situ_glu_math.py` and on H200s, where it is about 35% faster than the libdevice form),
# "triton-libdevice" its "libdevice" form (libdevice tanh: as accurate, compute-bound), "triton-approx" its
# "approx" form (the GPU's tanh.approx instruction: up to ~250 bf16 ulps off at small values); "compile"
# (`torch.compile` of the fp32 reference), "eager" (the reference: ~10 elementwise passes over fp32 temporaries).
_KERNEL_FORMS = {"triton": "exp2", "triton-libdevice": "libdevice", "triton-approx": "approx"}
_compiled_situ_glu = None


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float,
             form: str = DEFAULT.glu_on_cuda) -> torch.Tensor:
    """SiTU-GLU in fp32, cast back: `beta tanh(g/beta) sigmoid(g) * linear_beta tanh(u/linear_beta)`; compiled
    on CUDA when `form` is "compile"."""
    global _compiled_situ_glu
    if form == "compile" and gate.is_cuda and not torch.compiler.is_compiling():
        if _compiled_situ_glu is None:
            _compiled_situ_glu = torch.compile(_situ_glu_reference, dynamic=True, fullgraph=True)
        return _compiled_situ_glu(gate, up, beta, linear_beta)
    return _situ_glu_reference(gate, up, beta, linear_beta)


def apply_situ_glu(gate_up_S2I: torch.Tensor, beta: float, linear_beta: float,
                   form: str = DEFAULT.glu_on_cuda) -> torch.Tensor:
    """[S, 2I] gate/up output (w1 half, then w3 half) -> [S, I] SiTU-GLU, in the form `form` names on CUDA (see
    above) and the fp32 reference elsewhere."""
    if form not in GLU_FORMS:
        raise ValueError(f"SiTU-GLU form {form!r}; expected one of {GLU_FORMS}")
    if gate_up_S2I.is_cuda and form in _KERNEL_FORMS and not torch.compiler.is_compiling():
        from modelopt_ext.models.kimi_k3.situ_glu import situ_glu as kernel

        return kernel(gate_up_S2I, beta, linear_beta, form=_KERNEL_FORMS[form])
    gate, up = gate_up_S2I.chunk(2, dim=-1)
    return situ_glu(gate, up, beta, linear_beta, form)



class _SituGLU:
    """The activation of Kimi-K3's experts, read from the config."""

    def _init_activation(self, config) -> None:
        self.situ_beta = config.activation_situ_beta
        self.situ_linear_beta = config.activation_situ_linear_beta

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        """[S, 2I] -> [S, I]: SiTU-GLU of the w1 half and the w3 half."""
        return apply_situ_glu(gate_up_out, self.situ_beta, self.situ_linear_beta, self.options.glu_on_cuda)


def _widths(config) -> tuple[int, int, int]:
    return config.num_experts, config.routed_expert_hidden_size, config.moe_intermediate_size


@use_experts_implementation(has_gate=True)
class KimiK3Experts(_SituGLU, DenseExperts):
    """Dense fused experts: `gate_up_proj` [E, 2I, L] and `down_proj` [E, L, I] parameters."""

    def __init__(self, config):
        super().__init__(*_widths(config), init_std=getattr(config, "initializer_range", 0.02))
        self._init_activation(config)


@materialize_in_forward
@use_experts_implementation(has_gate=True)
class KimiK3PackedExperts(_SituGLU, PackedExperts):
    """MXFP4-packed fused experts; `gate_up_proj` / `down_proj` are dequantized views."""

    def __init__(self, config):
        super().__init__(*_widths(config))
        self._init_activation(config)

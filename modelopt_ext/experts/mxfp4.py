"""Fused routed experts stored as MXFP4 bytes (the generic engine, `experts.fused`, over packed storage).

`PackedExperts` keeps a checkpoint's MXFP4 bytes as they are (`*_packed` uint8 [E, R, B], B = in_features / 2;
`*_scale` uint8 E8M0 [E, R, G], G = in_features / 32); `gate_up_proj` / `down_proj` are dequantized on access,
and inside `materialized(...)` exactly once per forward, so every GEMM of it reads views of one transient tensor
(which is also what ModelOpt's fused-expert quantizer needs to recover expert ids from storage offsets).
Resident expert memory is the packed size (4.25 bits per weight). A family's class derives from it, adds its
activation, is decorated with transformers' `use_experts_implementation`, and then passes through
`materialize_in_forward`, so that whichever implementation the decorator picks reads the weights dequantized once.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from modelopt_ext.ep.sharding import local_tensor
from modelopt_ext.formats.mxfp4 import GROUP_SIZE, check_scales, dequantize_mxfp4, dequantize_mxfp4_fused

from .fused import FusedExperts


class PackedExperts(FusedExperts):
    """MXFP4-packed fused experts; `gate_up_proj` / `down_proj` are dequantized views (see the module doc)."""

    PACKED = ("gate_up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int):
        super().__init__(num_experts, hidden_dim, intermediate_dim)
        E, L, I = self.num_experts, self.hidden_dim, self.intermediate_dim
        for name, (rows, cols) in (("gate_up_proj", (2 * I, L)), ("down_proj", (L, I))):
            if cols % GROUP_SIZE:
                raise ValueError(f"{name} input width {cols} is not a multiple of the MXFP4 group size {GROUP_SIZE}")
            packed = torch.zeros(E, rows, cols // 2, dtype=torch.uint8)
            scale = torch.zeros(E, rows, cols // GROUP_SIZE, dtype=torch.uint8)
            self.register_parameter(f"{name}_packed", nn.Parameter(packed, requires_grad=False))
            self.register_parameter(f"{name}_scale", nn.Parameter(scale, requires_grad=False))
        self.dequant_dtype = torch.get_default_dtype()
        self._materialized: dict[str, torch.Tensor] = {}

    def check_scales(self) -> None:
        """Refuse NaN scale bytes once (after loading), so forwards can dequantize without host syncs."""
        for name in self.PACKED:
            check_scales(local_tensor(getattr(self, f"{name}_scale")))

    def _dequantized(self, name: str) -> torch.Tensor:
        if name in self._materialized:
            return self._materialized[name]
        # Under expert parallelism the packed tensors are DTensors sharded on the expert dim: the module's
        # experts are this rank's shard (num_experts is the local count), so dequantize the local part.
        packed, scale = (local_tensor(getattr(self, f"{name}_{part}")) for part in ("packed", "scale"))
        if packed.is_cuda:
            return dequantize_mxfp4_fused(packed, scale, self.dequant_dtype)
        return dequantize_mxfp4(packed, scale, self.dequant_dtype, validate=False)

    def _drop(self, name: str) -> None:
        # Exporters that split fused experts into per-expert modules delete the fused attributes afterwards.
        for part in ("packed", "scale"):
            delattr(self, f"{name}_{part}")
        self._materialized.pop(name, None)

    gate_up_proj = property(lambda self: self._dequantized("gate_up_proj"),
                            fdel=lambda self: self._drop("gate_up_proj"))
    down_proj = property(lambda self: self._dequantized("down_proj"), fdel=lambda self: self._drop("down_proj"))

    @contextlib.contextmanager
    def materialized(self, dtype: torch.dtype):
        """Dequantize both projections once to `dtype` for the body. Nests: an inner context of the same
        dtype reuses the outer tensors, another dtype materializes its own, and each exit restores what
        the enclosing context had."""
        saved_dtype, saved = self.dequant_dtype, dict(self._materialized)
        reuse = saved_dtype == dtype and all(name in saved for name in self.PACKED)
        self.dequant_dtype = dtype
        try:
            if not reuse:
                self._materialized.clear()
                for name in self.PACKED:
                    self._materialized[name] = self._dequantized(name)
            yield
        finally:
            self._materialized = saved
            self.dequant_dtype = saved_dtype




def materialize_in_forward(cls: type[PackedExperts]) -> type[PackedExperts]:
    """Wrap `cls.forward` (as `use_experts_implementation` left it) so the weights are dequantized once inside the
    experts' own forward, wherever it is called from (the block, an EP implementation holding local shards of
    the packed parameters, ModelOpt's quantized wrapper): the dequantized weights always match the parameters
    the caller's context exposes."""
    dispatch = cls.forward

    @functools.wraps(dispatch)
    def forward(self, hidden_states, top_k_index, top_k_weights):
        with self.materialized(hidden_states.dtype):
            return dispatch(self, hidden_states, top_k_index, top_k_weights)

    cls.forward = forward
    return cls

"""Fused routed experts of Kimi-K3, driven by transformers' experts-implementation mechanism.

Shapes: T routed tokens, k top-k, E experts (local experts under EP), L latent width (the experts' model
width, `routed_expert_hidden_size`), I expert width (`moe_intermediate_size`), B packed bytes (= in_features / 2),
G scale groups (= in_features / 32).

Layout (transformers' fused convention, not transposed): `gate_up_proj` [E, 2I, L] holds each expert's
w1 rows first, then its w3 rows; `down_proj` [E, L, I] holds w2. The gate is SiTU-GLU in fp32.

Two storage classes share that interface:
- `KimiK3Experts`: dense floating-point parameters (built from a config; trainable).
- `KimiK3PackedExperts`: the checkpoint's MXFP4 bytes kept as they are (`*_packed` uint8 [E, R, B],
  `*_scale` uint8 E8M0 [E, R, G]); `gate_up_proj` / `down_proj` are dequantized on access, and inside
  `materialized(...)` (entered by its forward) exactly once per forward, so every GEMM of it reads views of one
  transient tensor (which is also what ModelOpt's fused-expert quantizer needs to recover expert ids from
  storage offsets). Resident expert memory is the packed size (4.25 bits per weight).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.integrations.moe import use_experts_implementation

from modelopt_ext.ep.dispatch import inverse_permutation, weighted_sum
from modelopt_ext.ep.local import (
    Segment,
    expert_major_offsets,
    expert_mlp,
    expert_row_amax,
    gather_weighted_sum,
    pad_rows,
    project,
    regroup,
    sort_by_expert,
    use_segment_gemms,
)
from modelopt_ext.formats.mxfp4 import GROUP_SIZE, check_scales, dequantize_mxfp4, dequantize_mxfp4_fused
from modelopt_ext.options import DEFAULT, GLU_FORMS, ExpertsOptions


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# How the experts run (grouped statistics while ModelOpt max-calibrates, the sync-free grouped path for plain
# CUDA inference, the activation's form on CUDA, segment GEMMs vs regrouping) is each module's `options`
# (`modelopt_ext.options.ExpertsOptions`, set by `set_experts_options`); the class default is the defaults.


def _situ_glu_reference(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    g, u = gate.float(), up.float()
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return act.to(gate.dtype)


# The activation's forms on CUDA (`ExpertsOptions.glu_on_cuda`; `scripts/bench_ep.py` measures them side by
# side; docs/performance.md): the "triton*" forms are `kernels.situ_glu` (reads the 16-bit gate/up output once,
# fp32 in registers, writes the 16-bit product): "triton" its "exp2" form (tanh and sigmoid from exp2, one
# reciprocal per element; within 0.5 bf16 ulp of the float64 formula, on CPU through its mirror
# `kernels.situ_glu_math` and on H200s, where it is about 35% faster than the libdevice form),
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
        from modelopt_ext.kernels.situ_glu import situ_glu as kernel

        return kernel(gate_up_S2I, beta, linear_beta, form=_KERNEL_FORMS[form])
    gate, up = gate_up_S2I.chunk(2, dim=-1)
    return situ_glu(gate, up, beta, linear_beta, form)


@contextlib.contextmanager
def _amax_of_expert(quantizer, amax_E: torch.Tensor | None, e: int):
    """`quantizer`'s amax set to amax_E[e] for the body (nothing when there is no override or no finite value)."""
    if quantizer is None or amax_E is None or getattr(quantizer, "amax", None) is None or not bool(
            torch.isfinite(amax_E[e]) and amax_E[e] > 0):
        yield
        return
    from modelopt_ext.export.expert_inputs import amax_set_to

    with amax_set_to(quantizer, amax_E[e]):
        yield


class _FusedExpertsBase(nn.Module):
    options: ExpertsOptions = DEFAULT  # set per instance by `modelopt_ext.options.set_experts_options`

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.routed_expert_hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.situ_beta = config.activation_situ_beta
        self.situ_linear_beta = config.activation_situ_linear_beta

    # Per-expert input statistics, kept beside ModelOpt's one shared input quantizer per projection: while
    # that quantizer max-calibrates, each expert's own input amax (fp32 [E], -inf where it saw no row) is
    # recorded here under the projection's name ("gate_up_proj", "down_proj"); the exporter writes per-expert
    # input scales from it (`export.expert_inputs`).
    EXPERT_INPUT_PROJECTIONS = ("gate_up_proj", "down_proj")

    @property
    def expert_input_amax(self) -> dict[str, torch.Tensor]:
        return self.__dict__.setdefault("_expert_input_amax", {})

    def reset_expert_input_amax(self) -> None:
        self.expert_input_amax.clear()

    def _observing_expert_inputs(self) -> bool:
        """ModelOpt is collecting statistics for this module's input quantizers (not a constant amax)."""
        for p in self.EXPERT_INPUT_PROJECTIONS:
            q = getattr(self, f"{p}_input_quantizer", None)
            if q is None or not getattr(q, "is_enabled", False) or not getattr(q, "_if_calib", False):
                return False
            if getattr(q, "_constant_amax", None) is not None or getattr(q, "_use_constant_amax", False):
                return False
        return True

    def _observe(self, projection: str, amax_E: torch.Tensor) -> None:
        store = self.expert_input_amax
        held = store.get(projection)
        store[projection] = amax_E if held is None else torch.maximum(held, amax_E)

    def _observe_rows(self, projection: str, x_SL: torch.Tensor, offs_E=None, segments=None) -> None:
        if self._observing_expert_inputs():
            self._observe(projection, expert_row_amax(x_SL, self.num_experts, offs_E, segments))

    def _observe_expert(self, projection: str, e: int, rows: torch.Tensor) -> None:
        if self._observing_expert_inputs():
            amax_E = torch.full((self.num_experts,), float("-inf"), device=rows.device)
            amax_E[e] = rows.detach().abs().amax().float()
            self._observe(projection, amax_E)

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        """[S, 2I] -> [S, I]: SiTU-GLU of the w1 half and the w3 half."""
        return apply_situ_glu(gate_up_out, self.situ_beta, self.situ_linear_beta, self.options.glu_on_cuda)

    @contextlib.contextmanager
    def materialized(self, dtype: torch.dtype):
        """Weights readable as floating point of `dtype` for the duration of one forward."""
        yield

    def _quantizer_free(self) -> bool:
        """True when ModelOpt has not converted this module (no quantizers: plain inference)."""
        return not any(name.endswith("_quantizer") or name.endswith("_quantizers") for name in self._modules)

    def fast_path(self, hidden_states: torch.Tensor) -> bool:
        """The grouped GPU path applies: CUDA, 16-bit rows, no autograd, no ModelOpt quantizers."""
        return (self.options.fast_on_cuda and hidden_states.is_cuda and hidden_states.dtype == torch.bfloat16
                and not torch.is_grad_enabled() and self._quantizer_free())

    def _regrouped(self, fn, x_SL: torch.Tensor, segments: list[Segment] | None):
        """`fn` on `segments` rows regrouped expert-major (one grouped GEMM per projection) when
        `ep.local.use_segment_gemms` says the segments are too small for a GEMM each (in place when they are
        expert-major already); None otherwise."""
        if segments is None or use_segment_gemms(segments, x_SL.device, self.options.segment_min_rows):
            return None
        offs_E = expert_major_offsets(segments, self.num_experts, x_SL.shape[0], x_SL.device)
        if offs_E is not None:  # already expert-major (the copy-engine exchange's layout): no gathers
            return fn(x_SL, offs_E=offs_E)
        gather_R, offs_E, back_R = regroup(segments, self.num_experts, x_SL.device)
        return fn(x_SL.index_select(0, gather_R), offs_E=offs_E).index_select(0, back_R)

    def run_rows(self, x_SL: torch.Tensor, segments: list[Segment] | None = None,
                 offs_E: torch.Tensor | None = None) -> torch.Tensor:
        """The experts on rows grouped by expert (`ep.local.expert_mlp`), weights read once per projection."""
        regrouped = self._regrouped(self.run_rows, x_SL, segments)
        if regrouped is not None:
            return regrouped
        with self.materialized(x_SL.dtype):
            return expert_mlp(x_SL, _local(self.gate_up_proj), _local(self.down_proj), self._apply_gate, offs_E,
                              segments, self.options.row_tile)

    def run_rows_collecting(self, x_SL: torch.Tensor, segments: list[Segment] | None = None,
                            offs_E: torch.Tensor | None = None, valid_S1: torch.Tensor | None = None) -> torch.Tensor:
        """`run_rows` while ModelOpt max-calibrates: each projection's (shared) input quantizer is shown all its
        rows at once; rows where `valid_S1` is False (EP sentinel slots) are zeroed before each quantizer sees
        them and in the result (zeros do not move a max)."""
        regrouped = self._regrouped(self.run_rows_collecting, x_SL, segments)  # valid_S1 comes with offs_E only
        if regrouped is not None:
            return regrouped

        def masked(t):
            return t if valid_S1 is None else torch.where(valid_S1, t, 0)

        with self.materialized(x_SL.dtype):
            self.gate_up_proj_input_quantizer(masked(x_SL))
            self._observe_rows("gate_up_proj", x_SL, offs_E, segments)
            h_SI = masked(self._apply_gate(project(x_SL, _local(self.gate_up_proj), offs_E, segments)))
            self.down_proj_input_quantizer(h_SI)
            self._observe_rows("down_proj", h_SI, offs_E, segments)
            return masked(project(h_SI, _local(self.down_proj), offs_E, segments))

    def pipeline_rows(self, hidden_states: torch.Tensor):
        """What an expert-parallel pipeline (`ep.overlap`) may run on the received rows instead of this
        module's forward: `run_rows` for plain GPU inference (`fast_path`), `run_rows_collecting` during max
        calibration where the grouped statistics path applies, else None (the module's forward must run)."""
        if self.fast_path(hidden_states):
            return self.run_rows
        if not torch.is_grad_enabled() and self._grouped_statistics_on(hidden_states):
            return self.run_rows_collecting
        return None

    def _grouped_rows(self, hidden_states, top_k_index):
        """The K slots of the T tokens sorted by expert (no host sync): order_S, offs_E, valid_S1 (False for
        EP sentinel slots, id E, which sort after every group) and the rows x_SL."""
        K = top_k_index.shape[1]
        ids_S = top_k_index.reshape(-1)
        order_S, offs_E = sort_by_expert(ids_S, self.num_experts)
        valid_S1 = (ids_S.index_select(0, order_S) < self.num_experts).unsqueeze(-1)
        return order_S, offs_E, valid_S1, hidden_states.index_select(0, order_S // K)

    def _grouped_forward(self, hidden_states, top_k_index, top_k_weights):
        """One process on a GPU, no host sync: slots sorted by expert, two grouped GEMMs, the activation once,
        then each token's K slots gathered, weighted and summed in one pass. Sentinel slots (id E) sort
        after every group; their rows are zeroed before the sum."""
        order_S, offs_E, valid_S1, x_SL = self._grouped_rows(hidden_states, top_k_index)
        y_SL = torch.where(valid_S1, self.run_rows(x_SL, offs_E=offs_E), 0)
        return gather_weighted_sum(y_SL, inverse_permutation(order_S), top_k_weights)

    def _collecting_statistics(self) -> bool:
        """True when ModelOpt converted this module and none of its quantizers quantizes: they only collect
        statistics (max calibration), so the experts' inputs can be observed once per projection."""
        inputs = [getattr(self, f"{p}_input_quantizer", None) for p in ("gate_up_proj", "down_proj")]
        weights = [q for p in ("gate_up_proj", "down_proj") for q in getattr(self, f"{p}_weight_quantizers", ())]
        if any(q is None for q in inputs) or not weights:
            return False
        return not any(getattr(q, "is_enabled", False) and getattr(q, "_if_quant", False) for q in (*inputs, *weights))

    def _grouped_statistics_on(self, hidden_states: torch.Tensor) -> bool:
        """ModelOpt only collects max statistics and `options.grouped_statistics` allows the grouped path here."""
        mode = self.options.grouped_statistics
        mode_allows = mode == "always" or (mode == "cuda" and hidden_states.is_cuda)
        return mode_allows and self._collecting_statistics()

    def _grouped_statistics_forward(self, hidden_states, top_k_index, top_k_weights):
        """Calibration (one process): the rows of all experts sorted by expert, two grouped GEMMs, and each
        projection's (shared) input quantizer shown all its rows at once (`run_rows_collecting`). Gives the max
        statistics of the eager path (the max over the same rows) without its per-expert loop and host syncs."""
        order_S, offs_E, valid_S1, x_SL = self._grouped_rows(hidden_states, top_k_index)
        y_SL = self.run_rows_collecting(x_SL, offs_E=offs_E, valid_S1=valid_S1)
        return gather_weighted_sum(y_SL, inverse_permutation(order_S), top_k_weights).to(hidden_states.dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """Eager reference: one `F.linear` pair per expert that received tokens (the path ModelOpt's fused-expert
        quantizers intercept, and so the one every calibration runs).

        Args:
            hidden_states: [T, L]; top_k_index: [T, k] int64 expert ids in [0, E], where E itself is the EP
                sentinel (a slot routed to another rank) and is skipped; top_k_weights: [T, k] routing
                weights (fp32 keeps upstream's accumulation).
        Returns:
            [T, L] in hidden_states' dtype: each token's k expert outputs, weighted and summed in fp32 in slot
            order, the same arithmetic as the expert-parallel combine (`ep.dispatch.weighted_sum`), so a token's
            result does not depend on which other tokens share its experts or on the EP degree.
        """
        if self.fast_path(hidden_states):
            return self._grouped_forward(hidden_states, top_k_index, top_k_weights)
        if self._grouped_statistics_on(hidden_states):
            return self._grouped_statistics_forward(hidden_states, top_k_index, top_k_weights)
        T, L = hidden_states.shape
        slots_TkL = hidden_states.new_zeros(T, top_k_index.shape[1], L)
        gate_up, down = self.gate_up_proj, self.down_proj
        with torch.no_grad():
            mask_EkT = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = mask_EkT[: self.num_experts].sum(dim=(1, 2)).nonzero().flatten().tolist()
        probe = self.__dict__.get("quality_probe")  # quant.quality: measures quantized variants on these rows
        for e in hit:
            k_pos, token_idx = torch.where(mask_EkT[e])
            rows = pad_rows(hidden_states[token_idx])  # see ep.local.MIN_ROWS
            y = self.expert_output(e, rows, gate_up, down)
            if probe is not None:
                probe(self, e, rows, y, token_idx.numel())
            slots_TkL[token_idx, k_pos] = y[: token_idx.numel()]
        return weighted_sum(slots_TkL, top_k_weights).to(hidden_states.dtype)

    def expert_output(self, e: int, rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """Expert `e` (local id) on `rows`: one F.linear pair (the calls ModelOpt's fused-expert quantizers
        intercept), each projection's input quantizer set to this expert's own amax while `expert_amax_override`
        (projection -> fp32 [E]) holds one, and its input statistics recorded while ModelOpt calibrates."""
        override = self.__dict__.get("expert_amax_override") or {}
        with _amax_of_expert(getattr(self, "gate_up_proj_input_quantizer", None), override.get("gate_up_proj"), e):
            self._observe_expert("gate_up_proj", e, rows)
            h = self._apply_gate(F.linear(rows, gate_up[e]))
        with _amax_of_expert(getattr(self, "down_proj_input_quantizer", None), override.get("down_proj"), e):
            self._observe_expert("down_proj", e, h)
            return F.linear(h, down[e])


@use_experts_implementation(has_gate=True)
class KimiK3Experts(_FusedExpertsBase):
    """Dense fused experts: `gate_up_proj` [E, 2I, L] and `down_proj` [E, L, I] parameters."""

    def __init__(self, config):
        super().__init__(config)
        E, L, I = self.num_experts, self.hidden_dim, self.intermediate_dim
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, L))
        self.down_proj = nn.Parameter(torch.empty(E, L, I))
        std = getattr(config, "initializer_range", 0.02)
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=std)


@use_experts_implementation(has_gate=True)
class KimiK3PackedExperts(_FusedExpertsBase):
    """MXFP4-packed fused experts; `gate_up_proj` / `down_proj` are dequantized views (see module doc)."""

    PACKED = ("gate_up_proj", "down_proj")

    def __init__(self, config):
        super().__init__(config)
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
            check_scales(_local(getattr(self, f"{name}_scale")))

    def _dequantized(self, name: str) -> torch.Tensor:
        if name in self._materialized:
            return self._materialized[name]
        # Under expert parallelism the packed tensors are DTensors sharded on the expert dim: the module's
        # experts are this rank's shard (num_experts is the local count), so dequantize the local part.
        packed, scale = (_local(getattr(self, f"{name}_{part}")) for part in ("packed", "scale"))
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


_dispatch_experts_forward = KimiK3PackedExperts.forward


def _packed_forward(self, hidden_states, top_k_index, top_k_weights):
    # Materialize inside the experts' own forward, wherever it is called from (the block, an EP
    # implementation holding local shards of the packed parameters, ModelOpt's quantized wrapper), so the
    # dequantized weights always match the parameters the caller's context exposes.
    with self.materialized(hidden_states.dtype):
        return _dispatch_experts_forward(self, hidden_states, top_k_index, top_k_weights)


KimiK3PackedExperts.forward = functools.wraps(_dispatch_experts_forward)(_packed_forward)

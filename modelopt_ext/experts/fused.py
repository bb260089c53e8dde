"""The fused routed-experts engine, generic over families: storage, rows, statistics, fast paths.

Shapes: T routed tokens, k top-k, E experts (local experts under EP), L the experts' model width, I expert width,
S = T*k slots.

Layout (transformers' fused convention, not transposed): `gate_up_proj` [E, 2I, L] holds each expert's gate
rows first, then its up rows; `down_proj` [E, L, I]. A family's experts class derives from a storage class
(`DenseExperts` here, `experts.mxfp4.PackedExperts` for MXFP4 bytes) and gives the activation (`_apply_gate`,
[S, 2I] -> [S, I]); it is decorated with transformers' `use_experts_implementation(has_gate=True)`.

What the engine gives every family: the eager reference forward (one `F.linear` pair per expert that received
tokens, the calls ModelOpt's fused-expert quantizers intercept), grouped paths without host syncs (plain CUDA
inference, and max calibration showing each projection's input quantizer all its rows at once), the row
functions the expert-parallel pipeline runs on received rows (`run_rows`, `run_rows_collecting`,
`pipeline_rows`), per-expert input statistics beside ModelOpt's shared input quantizer (for per-expert input
scales in the export), and the per-expert amax override the export and the quality report use. How it runs is
each module's `options` (`modelopt_ext.options.ExpertsOptions`, set by `set_experts_options`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

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
from modelopt_ext.ep.sharding import local_tensor
from modelopt_ext.options import DEFAULT, ExpertsOptions


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


class FusedExperts(nn.Module):
    """The engine over E experts of width I on rows of width L; storage (`DenseExperts`, `mxfp4.PackedExperts`)
    and the activation (`_apply_gate`) come from subclasses. See the module doc."""

    options: ExpertsOptions = DEFAULT  # set per instance by `modelopt_ext.options.set_experts_options`

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim

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
        """[S, 2I] -> [S, I]: the gated activation of the gate half (first) and the up half; the family's."""
        raise NotImplementedError(f"{type(self).__name__} defines no activation (_apply_gate)")

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
            return expert_mlp(x_SL, local_tensor(self.gate_up_proj), local_tensor(self.down_proj), self._apply_gate,
                              offs_E, segments, self.options.row_tile)

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
            h_SI = masked(self._apply_gate(project(x_SL, local_tensor(self.gate_up_proj), offs_E, segments)))
            self.down_proj_input_quantizer(h_SI)
            self._observe_rows("down_proj", h_SI, offs_E, segments)
            return masked(project(h_SI, local_tensor(self.down_proj), offs_E, segments))

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



class DenseExperts(FusedExperts):
    """Dense fused experts: `gate_up_proj` [E, 2I, L] and `down_proj` [E, L, I] floating-point parameters,
    initialised normal(0, `init_std`) (trainable)."""

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, init_std: float = 0.02):
        super().__init__(num_experts, hidden_dim, intermediate_dim)
        E, L, I = num_experts, hidden_dim, intermediate_dim
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, L))
        self.down_proj = nn.Parameter(torch.empty(E, L, I))
        nn.init.normal_(self.gate_up_proj, std=init_std)
        nn.init.normal_(self.down_proj, std=init_std)

"""`torch_a2a`: an expert-parallel implementation for transformers' `EPImplementationInterface`.

Every rank of the EP group holds its own batch (data parallel): tokens go to their experts' ranks with one
all-to-all and come back with another (`modelopt_ext.ep.dispatch`). Unlike transformers' `all_to_all`, the
local experts are run through the experts module's *class* forward, looked up at call time, so a module whose
class was swapped after the plan was applied (ModelOpt's quantized experts) is still the one that runs, with
local expert ids.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface

from modelopt_ext.options import options_of

from .dispatch import combine, dispatch
from .overlap import overlapped_moe

NAME = "torch_a2a"


def run_local_experts(experts: torch.nn.Module, x_RH, ids_R, weights_R) -> torch.Tensor:
    """The experts' class forward on local rows (top-1, given weights). Looked up now, not at plan time."""
    return type(experts).forward(experts, x_RH, ids_R.unsqueeze(-1), weights_R.unsqueeze(-1))


class TorchA2AEP(EPImplementation):
    """Dispatch -> local experts (grouped GEMM or the experts' own implementation) -> combine; the
    overlapped pipeline of `ep.overlap` when the experts' `pipeline_rows` offers a row function (GPU inference,
    max calibration)."""

    def __init__(self, experts, ep_mesh, tp_mesh):
        super().__init__(experts, ep_mesh, tp_mesh)
        self.experts = experts
        self.group = ep_mesh.get_group()

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        options = options_of(self.experts)  # pipeline off: dispatch -> class forward -> combine (the A/B baseline)
        pipeline_rows = getattr(self.experts, "pipeline_rows", None) if options.pipeline else None
        run_rows = pipeline_rows(hidden_states) if pipeline_rows is not None else None
        if run_rows is not None:
            # Plain GPU inference or max calibration: the exchange overlapped with the local experts, which run
            # in place on the received blocks (ep.overlap), weights materialized once for all chunks. Autograd
            # and quantizing forwards take the path below (the experts' class forward).
            materialized = getattr(self.experts, "materialized", None)
            with materialized(hidden_states.dtype) if materialized is not None else contextlib.nullcontext():
                return overlapped_moe(hidden_states, top_k_index, top_k_weights, self.num_local_experts,
                                      self.group, run_rows, chunks=options.chunks, transport=options.transport,
                                      token_dispatch=options.token_dispatch)
        recv_x, recv_ids, meta = dispatch(hidden_states, top_k_index, self.num_local_experts, self.group)
        ones = torch.ones(recv_ids.shape[0], dtype=recv_x.dtype, device=recv_x.device)
        if recv_x.shape[0] == 0:
            # No rows for this rank: run one zero row so autograd still connects the exchange, then drop it.
            y = run_local_experts(self.experts, recv_x.new_zeros(1, recv_x.shape[-1]), recv_ids.new_zeros(1),
                                  ones.new_ones(1))[:0]
        else:
            y = run_local_experts(self.experts, recv_x, recv_ids, ones)
        return combine(y, top_k_weights, meta, self.group)


def register_torch_a2a() -> None:
    """Register `torch_a2a` with transformers (idempotent; needed before a model using it is built)."""
    if EPImplementationInterface._global_mapping.get(NAME) is not TorchA2AEP:
        EPImplementationInterface.register(NAME, TorchA2AEP)


EP_FORWARD_ATTR = "_modelopt_ext_ep_forward"


def capture_ep_forwards(model: torch.nn.Module) -> int:
    """Keep, on each expert-parallel experts module, the dispatching forward transformers installed on the
    instance when it applied the plan. ModelOpt's conversion replaces instance forwards; blocks that call
    `call_experts` keep dispatching. Returns how many modules were found."""
    found = 0
    for module in model.modules():
        if getattr(module, "_is_expert_parallel", False) and "forward" in module.__dict__:
            setattr(module, EP_FORWARD_ATTR, module.__dict__["forward"])
            found += 1
    return found


def _implementation_of(ep_forward) -> object | None:
    """The `EPImplementation` transformers' dispatching forward (`EpDispatchExpertsParallel.install_forward`'s
    closure) calls, or None where it is not found there."""
    code, cells = getattr(ep_forward, "__code__", None), getattr(ep_forward, "__closure__", None) or ()
    if code is None or "implementation" not in code.co_freevars:
        return None
    return cells[code.co_freevars.index("implementation")].cell_contents


def restore_ep_forwards(model: torch.nn.Module) -> int:
    """Put back, on every experts module whose dispatching forward `capture_ep_forwards` kept, that forward as the
    instance's `forward`, for model code that calls `self.experts(...)` with global expert ids (transformers' native
    MoE blocks). Call it after ModelOpt's conversion, which binds the (quantized) class forward on the instance
    (`DynamicModule.convert`, keeping the dispatching one as `_forward_pre_dm`): the dispatching forward then runs
    dispatch -> the experts' class forward looked up at call time (ModelOpt's quantized forward, on local expert
    ids and local weights) -> combine. Only `torch_a2a` runs the class forward at call time (transformers' own
    implementations run the forward bound when the plan was applied, which would bypass the quantizers): another
    implementation is refused. Idempotent; returns how many modules dispatch."""
    found = 0
    for module in model.modules():
        ep_forward = module.__dict__.get(EP_FORWARD_ATTR)
        if ep_forward is None:
            continue
        implementation = _implementation_of(ep_forward)
        if implementation is not None and not isinstance(implementation, TorchA2AEP):
            raise RuntimeError(
                f"{type(module).__name__}: expert-parallel implementation {type(implementation).__name__} runs the "
                f"experts' forward bound when the plan was applied, not the quantized one; calibrate with {NAME!r}")
        if module.__dict__.get("forward") is not ep_forward:
            module.forward = ep_forward
        found += 1
    return found


def call_experts(experts: torch.nn.Module, hidden_states, top_k_index, top_k_weights):
    """Run an experts module: through its expert-parallel dispatch when it has one, else as a module."""
    ep_forward = experts.__dict__.get(EP_FORWARD_ATTR)
    if ep_forward is not None:
        return ep_forward(hidden_states, top_k_index, top_k_weights)
    return experts(hidden_states, top_k_index, top_k_weights)

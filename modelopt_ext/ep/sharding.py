"""Turning a distribution plan into transformers' parallel plans, and tidying the loaded model.

Names: plans map module/parameter names with layer numbers replaced by `*` (transformers' convention) to a
style. Expert modules get `ep_dispatch_experts` and their fused tensors `grouped_gemm` (sharded on the expert
dim); with replicated dense layers every other module gets `replicate` on a TP mesh of the world's size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard


def wildcard_names(model: nn.Module) -> tuple[set[str], set[str]]:
    """(module names, parameter names) of `model` with layer numbers replaced by `*`."""
    modules = {replace_layer_number_by_wildcard(n) for n, _ in model.named_modules() if n}
    params = {replace_layer_number_by_wildcard(n) for n, _ in model.named_parameters()}
    return modules, params


def select_ep_plan(plan: Mapping[str, str], model: nn.Module) -> dict[str, str]:
    """The rules of a family's EP plan that name something in this model (e.g. only the packed tensors of
    MXFP4 experts); refuses a plan of which no dispatch rule applies."""
    modules, params = wildcard_names(model)
    selected = {k: v for k, v in plan.items() if k in modules or k in params}
    if "ep_dispatch_experts" not in selected.values() or "grouped_gemm" not in selected.values():
        raise ValueError(
            f"the EP plan {sorted(plan)} needs an ep_dispatch_experts rule naming a module and grouped_gemm rules "
            f"naming fused expert tensors of the model; it matched {sorted(selected) or 'nothing'}"
        )
    return selected


def replicate_tp_plan(model: nn.Module, ep_plan: Mapping[str, str]) -> dict[str, str]:
    """`replicate` for every module owning parameters outside the EP plan's expert modules."""
    experts = [k for k, v in ep_plan.items() if v == "ep_dispatch_experts"]
    owners = set()
    for name, _ in model.named_parameters():
        wild = replace_layer_number_by_wildcard(name)
        if any(wild == e or wild.startswith(e + ".") for e in experts):
            continue
        owners.add(wild.rpartition(".")[0])
    return dict.fromkeys(sorted(owners), "replicate")


def localize_replicated_params(model: nn.Module) -> int:
    """Replace fully replicated DTensor parameters by their local tensors (each rank holds the whole of
    them, and the model's own code mixes them with plain tensors). Returns how many were replaced."""
    localized: dict[int, nn.Parameter] = {}  # by identity, so tied parameters stay one parameter
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor) and all(isinstance(p, Replicate) for p in param.placements):
                if id(param) not in localized:
                    localized[id(param)] = nn.Parameter(param.to_local(), requires_grad=param.requires_grad)
                module._parameters[name] = localized[id(param)]
    return len(localized)


@dataclasses.dataclass
class ReadCounter:
    """Bytes this process materialized from checkpoint files, split by a key predicate."""

    by_group: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, group: str, nbytes: int) -> None:
        self.by_group[group] = self.by_group.get(group, 0) + nbytes

    @property
    def total(self) -> int:
        return sum(self.by_group.values())


class _CountingSlice:
    def __init__(self, inner, key: str, counter: ReadCounter, group_of):
        self._inner, self._key, self._counter, self._group_of = inner, key, counter, group_of

    def __getitem__(self, index):
        tensor = self._inner[index]
        self._counter.add(self._group_of(self._key), tensor.numel() * tensor.element_size())
        return tensor

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _CountingFile:
    def __init__(self, inner, counter: ReadCounter, group_of):
        self._inner, self._counter, self._group_of = inner, counter, group_of

    def get_slice(self, key: str):
        return _CountingSlice(self._inner.get_slice(key), key, self._counter, self._group_of)

    def get_tensor(self, key: str):
        tensor = self._inner.get_tensor(key)
        self._counter.add(self._group_of(key), tensor.numel() * tensor.element_size())
        return tensor

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


@contextlib.contextmanager
def count_checkpoint_reads(expert_globs: Iterable[str]):
    """Count the bytes transformers materializes from safetensors files while loading, as "experts" (keys
    under any of `expert_globs`, fnmatch) and "dense". Reads go through lazy slices, so only what a rank
    indexes is counted (and read)."""
    import transformers.modeling_utils as mu

    globs = tuple(expert_globs)
    counter = ReadCounter()

    def group_of(key: str) -> str:
        return "experts" if any(fnmatch.fnmatchcase(key, g) for g in globs) else "dense"

    original = mu.safe_open

    def counting_open(*args, **kwargs):
        return _CountingFile(original(*args, **kwargs), counter, group_of)

    mu.safe_open = counting_open
    try:
        yield counter
    finally:
        mu.safe_open = original


@contextlib.contextmanager
def local_expert_params(model: nn.Module):
    """Present the expert-parallel experts' sharded parameters (DTensors `Shard(0)` over the EP mesh, global
    shape [E, ...]) as this rank's local tensors [E/ep, ...] while the body runs, as transformers does inside the
    dispatching forward (`_use_local_dtensor_params`); the modules' `num_experts` already is the local count.

    For ModelOpt's calibration, which reads the weights outside the forward: ModelOpt 0.47's weight calibration
    (`model_calib.weight_only_quantize` -> `_QuantFusedExperts.iter_weights_for_calibration`) yields
    `weight[idx]` for idx < num_experts; on the DTensor that is global expert idx, not local expert idx, so a
    rank > 0's per-expert weight amax would mix another rank's expert in. The local tensors share storage with the
    DTensors, so writes in place (a folded weight) stay; a parameter the body replaces is wrapped back as a DTensor
    with the original's placements.

    A model with FSDP-sharded modules is left as it is (yields 0): FSDP keeps its own references to the parameters
    it manages and its lazy initialization and resharding expect them as they were. No family needs both: DeepSeek-V3's
    FP8 checkpoints refuse FSDP dense layers, and Kimi-K3's exports were byte-identical across EP degrees without this
    (tests/export/test_writer.py)."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        yield 0
        return
    swapped = []
    for module in model.modules():
        if not getattr(module, "_is_expert_parallel", False):
            continue
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor):
                local = nn.Parameter(param.to_local(), requires_grad=param.requires_grad and param.is_floating_point())
                module._parameters[name] = local
                swapped.append((module, name, param, local))
    try:
        yield len(swapped)
    finally:
        for module, name, original, local in swapped:
            current = module._parameters.get(name)
            if current is local:
                module._parameters[name] = original
            elif current is not None and not isinstance(current, DTensor):
                module._parameters[name] = nn.Parameter(
                    DTensor.from_local(current.detach(), original.device_mesh, original.placements, run_check=False),
                    requires_grad=original.requires_grad)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t

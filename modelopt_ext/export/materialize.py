"""Turning a unit of the model (a decoder layer, or everything outside the layers) into plain tensors for
export: FSDP-sharded parameters are gathered (collective: every rank calls this for the same modules in
the same order), expert-parallel ones keep this rank's experts, replicated ones are taken as they are.
After export the unit's tensors are released, so at most one gathered unit is resident at a time."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

EP_MESH_DIM = "ep"


def _mesh_names(t: DTensor) -> tuple[str, ...]:
    return tuple(t.device_mesh.mesh_dim_names or ())


def plain(t: torch.Tensor) -> torch.Tensor:
    """This rank's plain tensor for `t`: the whole tensor, except along the EP mesh dimension, where the
    rank keeps its own shard."""
    if not isinstance(t, DTensor):
        return t
    names = _mesh_names(t)
    if EP_MESH_DIM not in names:
        return t.full_tensor()
    placements = [p if name == EP_MESH_DIM else Replicate() for name, p in zip(names, t.placements)]
    return t.redistribute(t.device_mesh, placements).to_local()


def expert_offset(module: nn.Module) -> int:
    """Global id of the first expert `module` holds: its EP coordinate times its local expert count."""
    for param in module.parameters(recurse=False):
        if isinstance(param, DTensor) and EP_MESH_DIM in _mesh_names(param):
            coordinate = param.device_mesh.get_local_rank(EP_MESH_DIM)
            ep_dim = _mesh_names(param).index(EP_MESH_DIM)
            if param.placements[ep_dim] != Shard(0) or param.shape[0] % param.device_mesh.size(ep_dim):
                raise ValueError(f"expert tensor placements {param.placements} are not an even split of dim 0 "
                                 f"over the {EP_MESH_DIM!r} mesh dimension")
            return coordinate * (param.shape[0] // param.device_mesh.size(ep_dim))
    return 0


def materialize(modules: Iterable[nn.Module]) -> None:
    """Replace every DTensor parameter and buffer directly owned by `modules` by `plain(...)`."""
    for module in modules:
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor):
                module._parameters[name] = nn.Parameter(plain(param.detach()), requires_grad=False)
        for name, buf in list(module._buffers.items()):
            if isinstance(buf, DTensor):
                module._buffers[name] = plain(buf)


def release(modules: Iterable[nn.Module]) -> None:
    """Drop the tensors of exported modules (the model is not usable afterwards)."""
    for module in modules:
        for name in list(module._parameters):
            module._parameters[name] = None
        for name in list(module._buffers):
            module._buffers[name] = None

"""modelopt_ext.export.materialize: DTensor parameters into plain tensors for export, expert offsets, release."""

import pytest
import torch
from torch import nn

from modelopt_ext.export.materialize import expert_offset, materialize, plain, release


def _mesh(*names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,) * len(names), mesh_dim_names=names)


def _dtensor(local, mesh, placements):
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, mesh, placements, run_check=False)


def test_plain_tensors_pass_through_unchanged():
    t = torch.ones(2)
    assert plain(t) is t


def test_plain_gathers_replicated_and_keeps_the_ep_shard(one_rank_group):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    local = torch.arange(12.0).reshape(4, 3)
    for mesh, placements in ((_mesh("dp"), [Replicate()]), (_mesh("ep"), [Shard(0)]),
                             (_mesh("dp", "ep"), [Shard(1), Shard(0)])):
        out = plain(_dtensor(local, mesh, placements))
        assert not isinstance(out, DTensor), (mesh, placements)
        assert torch.equal(out, local), (mesh, placements)


def test_expert_offset(one_rank_group, monkeypatch):
    from torch.distributed.tensor import Replicate, Shard

    module = nn.Module()
    assert expert_offset(module) == 0  # no parameters: the first expert is 0
    module.replicated = nn.Parameter(_dtensor(torch.zeros(4, 3), _mesh("dp"), [Replicate()]))
    assert expert_offset(module) == 0  # no EP dimension
    mesh = _mesh("dp", "ep")
    module.experts = nn.Parameter(_dtensor(torch.zeros(4, 3), mesh, [Replicate(), Shard(0)]))
    assert expert_offset(module) == 0
    # rank 2 of the EP dimension holds 4 local experts: its first is expert 8 (a one-process mesh has only
    # coordinate 0, so the coordinate is set here)
    monkeypatch.setattr(mesh, "get_local_rank", lambda name: {"ep": 2}[name])
    assert expert_offset(module) == 8


def test_expert_offset_refuses_experts_not_split_along_dim_0(one_rank_group):
    from torch.distributed.tensor import Shard

    module = nn.Module()
    module.experts = nn.Parameter(_dtensor(torch.zeros(4, 3), _mesh("ep"), [Shard(1)]))
    with pytest.raises(ValueError, match=r"^expert tensor placements \(Shard\(dim=1\),\) are not an even split of dim 0 "
                                         r"over the 'ep' mesh dimension$"):
        expert_offset(module)


def test_materialize_replaces_only_directly_owned_dtensors(one_rank_group):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    parent = nn.Linear(3, 4)
    parent.weight = nn.Parameter(_dtensor(torch.full((4, 3), 2.0), _mesh("ep"), [Shard(0)]))
    parent.register_buffer("amax", _dtensor(torch.tensor([5.0]), _mesh("dp"), [Replicate()]))
    bias = parent.bias
    parent.child = nn.Linear(3, 4, bias=False)
    parent.child.weight = nn.Parameter(_dtensor(torch.ones(4, 3), _mesh("dp"), [Replicate()]))

    materialize([parent])

    assert type(parent.weight) is nn.Parameter and not isinstance(parent.weight.data, DTensor)
    assert not parent.weight.requires_grad and torch.equal(parent.weight, torch.full((4, 3), 2.0))
    assert not isinstance(parent.amax, DTensor) and torch.equal(parent.amax, torch.tensor([5.0]))
    assert parent.bias is bias  # plain parameters are left as they are
    assert isinstance(parent.child.weight.data, DTensor)  # only the modules passed, not their children
    materialize([parent.child])
    assert not isinstance(parent.child.weight.data, DTensor)


def test_release_drops_parameters_and_buffers():
    module = nn.BatchNorm1d(3)
    child = module.child = nn.Linear(2, 2)
    release([module])
    assert module.weight is None and module.bias is None and module.running_mean is None
    assert list(module._parameters) == ["weight", "bias"]  # the names stay, the tensors go
    assert child.weight is not None  # children are released when passed themselves

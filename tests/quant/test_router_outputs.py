"""Routers whose output is not (ids, weights): coverage reads the ids where `FamilySpec.router_output` says, refuses
a float tensor taken for ids and an output of other items, naming the router; the all-experts policy replaces ids and
weights and keeps the rest; the EP forward restore refuses an implementation that would bypass ModelOpt's quantized
experts. Toy modules, one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modelopt_ext.ep.backend import EP_FORWARD_ATTR, restore_ep_forwards
from modelopt_ext.families import RouterOutput, families
from modelopt_ext.quant.calibrate import all_experts_routing
from modelopt_ext.quant.coverage import record_expert_coverage


class LogitsFirstRouter(nn.Module):
    """Returns (logits [T, E], weights [T, K], ids [T, K]) as transformers' DeepseekV3TopkRouter does."""

    def forward(self, ids_TK):
        T, K = ids_TK.shape
        return torch.zeros(T, 8), torch.ones(T, K), ids_TK


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = LogitsFirstRouter()

    def forward(self, ids_TK):
        return self.gate(ids_TK)


def test_coverage_reads_the_ids_where_the_family_says():
    model = nn.ModuleDict({"l0": Block(), "l1": Block()})
    ids = torch.tensor([[0, 3], [3, 7]])
    with record_expert_coverage(model, "*.gate", 8, families()["deepseek_v3"].router_output) as cov:
        model["l0"](ids)
        model["l1"](ids[:1])
    assert cov.table() == {"l0.gate": [1, 0, 0, 2, 0, 0, 0, 1], "l1.gate": [1, 0, 0, 1, 0, 0, 0, 0]}


def test_the_default_is_ids_then_weights_and_refuses_another_output():
    assert families()["kimi_k3"].router_output == RouterOutput(("ids", "weights"))
    assert RouterOutput().ids((torch.tensor([[1]]), torch.ones(1, 1)), "r").tolist() == [[1]]
    model = nn.ModuleDict({"l0": Block()})
    with pytest.raises(TypeError, match=r"router l0.gate: the family's router returns \('ids', 'weights'\), this one "
                                        r"returned tuple of 3 item\(s\)"):
        with record_expert_coverage(model, "*.gate", 8):
            model["l0"](torch.tensor([[0, 1]]))


def test_float_ids_are_refused_naming_the_family_field():
    model = nn.ModuleDict({"l0": Block()})
    wrong = RouterOutput(("ids", "weights", "logits"))  # the logits taken for the ids
    with pytest.raises(TypeError, match=r"router l0.gate: .* not an integer tensor .*router_output"):
        with record_expert_coverage(model, "*.gate", 8, wrong):
            model["l0"](torch.tensor([[0, 1]]))


@pytest.mark.parametrize("items", [("ids",), ("ids", "ids", "weights"), ("logits", "weights")])
def test_a_router_output_must_name_ids_and_weights_once(items):
    with pytest.raises(ValueError, match="must be named exactly once"):
        RouterOutput(items)


def test_all_experts_routing_replaces_ids_and_weights_and_keeps_the_rest():
    model = nn.ModuleDict({"l0": Block()})
    with all_experts_routing(model, "*.gate", 8, families()["deepseek_v3"].router_output):
        logits, weights, ids = model["l0"](torch.tensor([[0, 3], [5, 3]]))
    assert torch.equal(logits, torch.zeros(2, 8))
    assert ids.tolist() == [list(range(8))] * 2 and ids.dtype == torch.long
    assert weights.tolist() == [[1, 0, 0, 1, 0, 0, 0, 0], [0, 0, 0, 1, 0, 1, 0, 0]]


def test_all_experts_routing_refuses_an_output_other_than_the_familys():
    model = nn.ModuleDict({"l0": Block()})
    with pytest.raises(TypeError, match=r"router l0.gate: the family's router returns \('ids', 'weights'\)"):
        with all_experts_routing(model, "*.gate", 8):
            model["l0"](torch.tensor([[0, 1]]))


def _dispatching_forward(implementation):
    def ep_forward(hidden_states, top_k_index, top_k_weights):  # the shape of transformers' closure
        return implementation(hidden_states, top_k_index, top_k_weights)

    return ep_forward


def test_restore_puts_the_dispatching_forward_back_and_refuses_a_bound_implementation():
    from modelopt_ext.ep.backend import TorchA2AEP

    experts = nn.Linear(2, 2)
    a2a = object.__new__(TorchA2AEP)  # not called here: only its type is checked
    ep_forward = _dispatching_forward(a2a)
    setattr(experts, EP_FORWARD_ATTR, ep_forward)
    experts.forward = experts.forward  # what ModelOpt's conversion leaves: a bound class forward on the instance
    assert restore_ep_forwards(experts) == 1 and experts.__dict__["forward"] is ep_forward
    assert restore_ep_forwards(experts) == 1 and experts.__dict__["forward"] is ep_forward  # idempotent

    class OtherEP:
        def __call__(self, *args):
            raise AssertionError("not called")

    other = nn.Linear(2, 2)
    setattr(other, EP_FORWARD_ATTR, _dispatching_forward(OtherEP()))
    with pytest.raises(RuntimeError, match="OtherEP runs the experts' forward bound when the plan was applied"):
        restore_ep_forwards(other)

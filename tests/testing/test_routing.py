"""modelopt_ext.testing.routing.force_routing: every token of every MoE layer to chosen experts, the router's
weights kept, layers without a MoE block left alone."""

import torch
from torch import nn

from modelopt_ext.testing.routing import force_routing


class _Gate(nn.Module):
    """A router: top-2 of a fixed score table, its softmax weights."""

    def __init__(self, experts: int):
        super().__init__()
        self.scores = nn.Linear(4, experts, bias=False)

    def forward(self, x):
        weights, idx = torch.softmax(self.scores(x), dim=-1).topk(2, dim=-1)
        return idx, weights


class _Layer(nn.Module):
    def __init__(self, moe: bool):
        super().__init__()
        if moe:
            self.block_sparse_moe = nn.Module()
            self.block_sparse_moe.gate = _Gate(8)
        self.mlp = nn.Linear(4, 4)


def _model() -> nn.Module:
    """The attribute path force_routing walks: model.language_model.model.layers[i].block_sparse_moe.gate."""
    torch.manual_seed(0)
    model = nn.Module()
    model.language_model = nn.Module()
    model.language_model.model = nn.Module()
    model.language_model.model.layers = nn.ModuleList([_Layer(False), _Layer(True), _Layer(True)])
    return model


def test_every_token_goes_to_the_chosen_experts_with_the_routers_weights():
    model = _model()
    layers = model.language_model.model.layers
    x = torch.randn(5, 4)
    before = [layers[i].block_sparse_moe.gate(x) for i in (1, 2)]
    assert not all((idx == torch.tensor([6, 3])).all() for idx, _ in before)
    force_routing(model, [6, 3])
    for i, (_, weights) in zip((1, 2), before):
        idx, w = layers[i].block_sparse_moe.gate(x)
        assert torch.equal(idx, torch.tensor([[6, 3]] * 5)) and idx.is_contiguous()
        assert torch.equal(w, weights)  # only the choice is forced
    assert not layers[0].mlp._forward_hooks  # a layer without a MoE block is left alone


def test_forced_ids_follow_the_routers_shape():
    """One expert per slot for any token count, a batch dimension included."""
    model = _model()
    force_routing(model, [1, 2])
    gate = model.language_model.model.layers[2].block_sparse_moe.gate
    idx, _ = gate(torch.randn(2, 3, 4))
    assert idx.shape == (2, 3, 2) and (idx == torch.tensor([1, 2])).all()
    idx, _ = gate(torch.randn(0, 4))
    assert idx.shape == (0, 2)

"""Forced routing for the test bodies: every token to chosen experts, so coverage and the experts without
tokens are known in advance (one rank's experts only, or every expert)."""

from __future__ import annotations

import torch


def force_routing(model, experts: list[int]) -> None:
    """Every token of every MoE layer goes to `experts` (weights stay the router's)."""
    forced = torch.tensor(experts)

    def hook(module, inputs, output):
        idx, weight = output
        return forced.to(idx.device).expand_as(idx).contiguous(), weight

    for layer in model.language_model.model.layers:
        block = getattr(layer, "block_sparse_moe", None)
        if block is not None:
            block.gate.register_forward_hook(hook)

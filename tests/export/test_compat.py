"""Tests of modelopt_ext/export/compat.py: resolving ModelOpt's export internals and fused property weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modelopt_ext.export import compat


def test_modelopt_export_api_resolves_every_piece():
    api = compat.modelopt_export_api()
    assert all(callable(getattr(api, f)) for f in api.__dataclass_fields__)


def test_modelopt_export_api_names_what_is_missing(monkeypatch):
    monkeypatch.setitem(compat._REQUIRED, "modelopt.torch.export.quant_utils", ("get_quant_config", "no_such_fn"))
    monkeypatch.setitem(compat._REQUIRED, "modelopt.no_such_module", ("a",))
    with pytest.raises(ImportError) as err:
        compat.modelopt_export_api()
    assert str(err.value).endswith("lacks what the per-rank exporter uses (built against 0.47): "
                                   "modelopt.torch.export.quant_utils.no_such_fn, modelopt.no_such_module.a")


class _Fused(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj_weight_quantizers = nn.ModuleList([nn.Identity()])
        self.down_proj = nn.Parameter(torch.zeros(1))  # a parameter: ModelOpt lists it already
        self.down_proj_weight_quantizers = nn.ModuleList([nn.Identity()])

    @property
    def gate_up_proj(self):
        return torch.zeros(1)


def test_fused_property_names_lists_computed_projections_only():
    assert compat._fused_property_names(_Fused()) == ["gate_up_proj"]
    assert compat._fused_property_names(nn.Linear(2, 2)) == []


def test_fused_property_weights_lists_them_inside_the_context_only():
    import modelopt.torch.export.quant_utils as quant_utils

    original = quant_utils.weight_attr_names
    with compat.fused_property_weights():
        assert list(quant_utils.weight_attr_names(_Fused())) == [*original(_Fused()), "gate_up_proj"]
    assert quant_utils.weight_attr_names is original

"""The ModelOpt export internals the per-rank exporter builds on, resolved and checked in one place.

ModelOpt's public `export_hf_checkpoint` gathers the whole state dict on rank 0 and names experts by
their local index, so under expert parallelism the exporter reuses ModelOpt's per-module pieces instead
(the same ones its streaming exporter uses): the export-handler registry (quantized weights, scales and
per-expert splitting of fused experts), per-tensor post-processing, and the quantization-config builder.
They are private to nvidia-modelopt 0.47; `modelopt_export_api()` imports them all before any work starts,
so a ModelOpt that lacks one fails before calibration rather than after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_REQUIRED = {
    "modelopt.torch.export.unified_export_hf": (
        "_dispatch_export_handler", "_resolve_export_dtype", "_prepare_moe_inputs", "_warn_on_unsynced_moe_gate_up",
    ),
    "modelopt.torch.export.quant_utils": ("get_quant_config", "_postprocess_single_tensor", "weight_attr_names"),
    "modelopt.torch.export.convert_hf_config": ("convert_hf_quant_config_format",),
    "modelopt.torch.export.registry": ("ExportContext",),
    "modelopt.torch.quantization.utils.core_utils": ("no_requires_grad",),
}
KV_CACHE_MAX_BOUND = 448.0  # ModelOpt's kv-cache scale: amax / 448


@dataclasses.dataclass(frozen=True)
class ModelOptExportAPI:
    dispatch_export_handler: Callable
    resolve_export_dtype: Callable
    prepare_moe_inputs: Callable
    sync_moe_gate_up: Callable
    get_quant_config: Callable
    postprocess_tensor: Callable
    convert_quant_config: Callable
    export_context: type
    no_requires_grad: Callable


def modelopt_export_api() -> ModelOptExportAPI:
    """Import every ModelOpt piece the exporter needs; raises ImportError naming what is missing."""
    import modelopt

    found: dict[str, Any] = {}
    missing = []
    for module_name, names in _REQUIRED.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing += [f"{module_name}.{n}" for n in names]
            continue
        for n in names:
            if hasattr(module, n):
                found[n] = getattr(module, n)
            else:
                missing.append(f"{module_name}.{n}")
    if missing:
        raise ImportError(f"nvidia-modelopt {modelopt.__version__} lacks what the per-rank exporter uses "
                          f"(built against 0.47): {', '.join(missing)}")
    return ModelOptExportAPI(
        dispatch_export_handler=found["_dispatch_export_handler"],
        resolve_export_dtype=found["_resolve_export_dtype"],
        prepare_moe_inputs=found["_prepare_moe_inputs"],
        sync_moe_gate_up=found["_warn_on_unsynced_moe_gate_up"],
        get_quant_config=found["get_quant_config"],
        postprocess_tensor=found["_postprocess_single_tensor"],
        convert_quant_config=found["convert_hf_quant_config_format"],
        export_context=found["ExportContext"],
        no_requires_grad=found["no_requires_grad"],
    )


def _fused_property_names(module: nn.Module) -> list[str]:
    """Fused projections a module exposes as computed tensors (not parameters) next to ModelOpt's plural
    per-expert weight quantizers, e.g. packed MXFP4 experts' dequantized `gate_up_proj` / `down_proj`."""
    names = []
    for attr in ("gate_up_proj", "down_proj"):
        quantizers = getattr(module, f"{attr}_weight_quantizers", None)
        if isinstance(quantizers, nn.ModuleList) and attr not in module._parameters and isinstance(
                getattr(type(module), attr, None), property):
            names.append(attr)
    return names


@contextlib.contextmanager
def fused_property_weights():
    """ModelOpt lists a module's weights from its parameters (`weight_attr_names`), so fused experts whose
    weights are computed from packed storage look unquantized to `get_quant_config` (their MoE block ends
    up in `exclude_modules`). Inside this context their fused projections are listed too."""
    from modelopt_ext.quant.modelopt_import import import_modelopt

    import_modelopt()
    quant_utils = importlib.import_module("modelopt.torch.export.quant_utils")
    original = quant_utils.weight_attr_names

    def weight_attr_names(module):
        seen = list(original(module))
        yield from seen
        yield from (n for n in _fused_property_names(module) if n not in seen)

    quant_utils.weight_attr_names = weight_attr_names
    try:
        yield
    finally:
        quant_utils.weight_attr_names = original


def export_dtype(model: nn.Module, api: ModelOptExportAPI) -> torch.dtype:
    dtype = api.resolve_export_dtype(model, None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype

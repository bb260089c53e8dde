"""What the serving engines' Kimi-K3 model code adds to their generic ModelOpt loaders (`export.engine_names`):
SGLang's weight-name mapper, TensorRT-LLM's Kimi-K3 runtime rules, and the model files each rule comes from.

- SGLang (`sglang/srt/models/kimi_k3.py`, `hf_to_sglang_mapper`) maps `quantized_layers` keys with the model's
  weight mapper: `block_sparse_moe` -> `mlp`, `language_model.layers.` -> `language_model.model.layers.`.
- TensorRT-LLM's Kimi-K3 runtime (`_torch/models/modeling_kimi_linear.py`) looks the routed experts up by an
  exact coarse key only, loads them as NVFP4 only (`_K3_EXPERT_CKPT_SPECS`), and builds every other module in
  bf16, dequantizing only FP8 block weights (`_dequantize_fp8_block_scaled`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the family registers without importing the export checks
    from modelopt_ext.export.engine_names import EngineView

TRTLLM_EXPERT_ALGOS = ("NVFP4",)
TRTLLM_EXPERT_PREFIXES = ("language_model.model.", "model.", "")
TRTLLM_EXPERT_SUFFIXES = ("block_sparse_moe.experts", "mlp.experts")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

_VLLM_K3 = "vllm/models/kimi_k3/nvidia/model.py"
_SGL_K3 = "sglang/srt/models/kimi_k3.py"
_TRT_K3 = "tensorrt_llm/_torch/models/modeling_kimi_linear.py"
# (engine, rule) -> the Kimi-K3 model files behind the rule, beside the generic loader's (engine_names.SOURCES)
SOURCES: Mapping[tuple[str, str], str] = {
    ("vllm", "names"): f"{_VLLM_K3}: packed_modules_mapping",
    ("vllm", "fused-groups"): "vllm/models/kimi_k3/nvidia/kda.py, mla.py",
    ("vllm", "never-quantized"): f"{_VLLM_K3}: KimiMoE, AttnRes (quant_config=None)",
    ("sglang", "names"): f"{_SGL_K3}: hf_to_sglang_mapper",
    ("sglang", "fused-groups"): f"{_SGL_K3}: load_weights",
    ("sglang", "never-quantized"): f"{_SGL_K3}: KimiK3MoE, AttnRes (quant_config=None)",
    ("trtllm", "names"): f"{_TRT_K3}: KimiK3MoERuntime._resolve_routed_quant_config, _K3_EXPERT_CKPT_SPECS",
    ("trtllm", "fused-groups"): f"{_TRT_K3}: gate_up_proj from gate_proj + up_proj",
    ("trtllm", "never-quantized"): f"{_TRT_K3}: gate, latent and AttnRes projections as bf16 nn.Linear",
    ("trtllm", "scales"): f"{_TRT_K3}: _dequantize_fp8_block_scaled",
}


def sglang_key(key: str) -> str:
    """A `quantized_layers` key after SGLang's Kimi-K3 weight mapper (`apply_weight_name_mapper`)."""
    key = key.replace("block_sparse_moe", "mlp")
    if key.startswith("language_model.layers."):
        key = "language_model.model.layers." + key.removeprefix("language_model.layers.")
    return key


def trtllm_expert_keys(layer: int) -> list[str]:
    """The exact keys TensorRT-LLM's Kimi-K3 runtime tries for the routed experts of decoder layer `layer`."""
    return [f"{p}layers.{layer}.{s}" for p in TRTLLM_EXPERT_PREFIXES for s in TRTLLM_EXPERT_SUFFIXES]


def trtllm_names(banks: Mapping[str, str], view: EngineView, others: Mapping[str, str]) -> list[str]:
    """TensorRT-LLM's Kimi-K3 runtime: routed experts banks (name -> format their tensors have) must be NVFP4
    and, under MIXED_PRECISION, listed under an exact coarse key; every other quantized module (`others`)
    is built in bf16 from a dequantized FP8 block weight (`_dequantize_fp8_block_scaled`)."""
    from modelopt_ext.export.engine_names import MIXED

    problems = []
    for bank, have in banks.items():
        if have not in TRTLLM_EXPERT_ALGOS:
            problems.append(f"{bank} carries {have}: the Kimi-K3 runtime loads routed experts as NVFP4 only")
        if view.algo != MIXED:
            if view.algo != have:
                problems.append(f"{bank} carries {have} but the top-level quant_algo is {view.algo}")
            continue
        layer = _LAYER.search(bank)
        keys = trtllm_expert_keys(int(layer.group(1))) if layer else []
        key = next((k for k in keys if k in view.layers), None)
        if key is None:
            problems.append(f"{bank}: no exact quantized_layers key {' | '.join(keys[:2])} | ...: TensorRT-LLM "
                            "defaults the experts to W4A8_MXFP4_MXFP8")
        elif view.layers[key] != have:
            problems.append(f"{bank} carries {have} but {key} says {view.layers[key]}")
    problems += [f"{unit} carries {have}: the Kimi-K3 runtime builds it in bf16 and dequantizes only FP8 block "
                 "weights" for unit, have in others.items() if have != "FP8_PB_WO"]
    return problems

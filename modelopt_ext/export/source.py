"""The source checkpoint's tensors as the exporter needs them: their dtypes, and its 128x128-block FP8 Linears.

Unquantized tensors keep the source's dtype (a model loaded in float32 is cast back). A source stored in
128x128-block FP8 (`formats/fp8_block.py`) needs more: transformers dequantizes such a checkpoint at load (the
model holds float weights), so what the export writes for an FP8-block source Linear is decided here, from the
source's own tensors:

- the recipe quantizes it to FP8 in 128x128 blocks (ModelOpt's FP8_PB_WO): the source's codes and block scales
  are written as they are (`weight` F8_E4M3, `weight_scale` = the source's `weight_scale_inv`, which is the
  dequantization multiplier, in ModelOpt's [R, 1, C, 1] shape): re-quantizing the dequantized weight could only
  add error (in bf16 it does: the dequantized values are rounded before ModelOpt reads them);
- the recipe leaves it unquantized: the dequantized weight in the checkpoint's dtype (config.json `torch_dtype`
  or `dtype`, bfloat16 without one), as transformers computes it (float32 product, then cast), whatever dtype
  the model was calibrated in;
- the model does not build it (DeepSeek-V3's multi-token-prediction layer, `FamilySpec.carried_layers`): its
  tensors are carried into the export, FP8-block weights dequantized as above and their scales dropped, and
  the layer is excluded from quantization, as NVIDIA's DeepSeek NVFP4 checkpoints ship it and the engines'
  MTP loaders (vLLM, SGLang, TensorRT-LLM) read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from modelopt_ext.export.layout import read_header
from modelopt_ext.export.quant_layout import FP8_PB_BLOCK
from modelopt_ext.families import source_quantization_config
from modelopt_ext.formats.fp8_block import dequantize_blocks, scale_shape

SCALE_INV = "weight_scale_inv"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def checkpoint_dtype(config: Mapping) -> torch.dtype:
    """The dtype a checkpoint's dequantized weights take: config.json's `torch_dtype` / `dtype`, else bfloat16."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"config.json dtype {name!r}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class SourceTensors:
    """What the exporter reads of a source checkpoint.

    Attributes:
        path: the checkpoint folder.
        files: tensor name -> its safetensors file (every tensor of the checkpoint).
        float_dtypes: tensor name -> dtype, for every bf16/fp16/fp32/fp64 tensor.
        modules: the modules stored as FP8 blocks: `<m>.weight` F8_E4M3 with `<m>.weight_scale_inv` F32 of the
            (ceil-divided) 128x128 block grid.
        dtype: the checkpoint's dtype for dequantized weights (`checkpoint_dtype`).
    """

    path: Path
    files: Mapping[str, str]
    float_dtypes: Mapping[str, torch.dtype]
    modules: frozenset[str]
    dtype: torch.dtype

    @classmethod
    def read(cls, path: Path, config: Mapping) -> SourceTensors:
        """From the shards' headers (no tensor data) and config.json's quantization_config."""
        problems: list[str] = []
        files, entries = {}, {}
        for shard in sorted(Path(path).glob("*.safetensors")):
            for key, entry in (read_header(shard, problems) or {}).items():
                files[key], entries[key] = shard.name, entry
        if problems:
            raise ValueError(f"source checkpoint {path}: {'; '.join(problems)}")
        qc = source_quantization_config(config) or {}
        block = tuple(qc.get("weight_block_size") or ())
        modules = set()
        if qc.get("quant_method") == "fp8" and block == (FP8_PB_BLOCK, FP8_PB_BLOCK):
            for key, entry in entries.items():
                module, _, leaf = key.rpartition(".")
                scale = entries.get(f"{module}.{SCALE_INV}")
                if (leaf == "weight" and entry.dtype == "F8_E4M3" and len(entry.shape) == 2 and scale is not None
                        and scale.dtype == "F32" and tuple(scale.shape) == scale_shape(*entry.shape)):
                    modules.add(module)
        floats = {k: _FLOAT_DTYPES[e.dtype] for k, e in entries.items() if e.dtype in _FLOAT_DTYPES}
        return cls(Path(path), files, floats, frozenset(modules), checkpoint_dtype(config))

    def tensor(self, key: str) -> torch.Tensor:
        """One tensor of the source, read from its file (safetensors)."""
        with safe_open(str(self.path / self.files[key]), framework="pt") as f:
            return f.get_tensor(key)

    def exact_fp8_block(self, module: str, weight: torch.Tensor, scale: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(codes, scale shaped as `scale`) of source FP8-block module `module` replacing the FP8_PB_WO `weight`
        and `scale` ModelOpt's export wrote for it; None where the module is not an FP8-block source or the
        shapes differ (ModelOpt's output then stays)."""
        if module not in self.modules:
            return None
        codes, source_scale = self.tensor(f"{module}.weight"), self.tensor(f"{module}.{SCALE_INV}")
        if (weight.dtype != codes.dtype or tuple(weight.shape) != tuple(codes.shape)
                or scale.numel() != source_scale.numel() or scale.dtype != source_scale.dtype):
            return None
        return codes, source_scale.reshape(scale.shape)

    def carried(self, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Every source tensor under `prefixes` (layers the model does not build), as the export writes it:
        FP8-block weights dequantized to `dtype` (their scales dropped), the rest as stored."""
        out = {}
        for key in sorted(k for k in self.files if k.startswith(prefixes)):
            module, _, leaf = key.rpartition(".")
            if module in self.modules and leaf == SCALE_INV:
                continue
            if module in self.modules and leaf == "weight":
                out[key] = dequantize_blocks(self.tensor(key), self.tensor(f"{module}.{SCALE_INV}"), self.dtype)
            else:
                out[key] = self.tensor(key)
        return out

    def export_dtypes(self) -> dict[str, torch.dtype]:
        """tensor name -> the dtype it is exported in where the recipe leaves it unquantized: a float tensor's
        own, an FP8-block module's weight the checkpoint's dtype."""
        return {**self.float_dtypes, **{f"{m}.weight": self.dtype for m in self.modules}}

#!/usr/bin/env python
"""How close an export's NVFP4 routed experts are to their MXFP4 source checkpoint.

    python scripts/compare_experts.py --export OUT --source CKPT

Prints, over every routed expert weight (`...experts.{e}.w{1,2,3}`): the fraction of packed code bytes equal
to the source's `weight_packed`, the Frobenius relative error of the dequantized export against the
dequantized source (all experts together), and the worst single tensor's. Reads safetensors only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open

from modelopt_ext.export.exact_cast import Nvfp4, dequantize_nvfp4
from modelopt_ext.formats.mxfp4 import dequantize_mxfp4


def _index(directory: Path) -> dict[str, str]:
    return json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]


def _get(directory: Path, index: dict[str, str], key: str) -> torch.Tensor:
    with safe_open(str(directory / index[key]), framework="pt") as f:
        return f.get_tensor(key)


def compare(export: Path, source: Path) -> dict[str, float]:
    out_index, src_index = _index(export), _index(source)
    same = total = 0
    err = ref_norm = worst = 0.0
    for key in sorted(out_index):
        if ".experts." not in key or not key.endswith(".weight"):
            continue
        base = key.removesuffix(".weight")
        codes, packed = _get(export, out_index, key), _get(source, src_index, f"{base}.weight_packed")
        same += int((codes == packed).sum())
        total += codes.numel()
        exported = Nvfp4(codes, _get(export, out_index, f"{base}.weight_scale"),
                         _get(export, out_index, f"{base}.weight_scale_2"))
        ref = dequantize_mxfp4(packed, _get(source, src_index, f"{base}.weight_scale"), torch.float32)
        diff = dequantize_nvfp4(exported) - ref
        err += float((diff**2).sum())
        ref_norm += float((ref**2).sum())
        worst = max(worst, float(diff.norm() / ref.norm()))
    return {"bytes_equal": same / total if total else 0.0, "frobenius": (err / ref_norm) ** 0.5 if ref_norm else 0.0,
            "worst": worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", type=Path, required=True)
    parser.add_argument("--source", type=Path, required=True)
    args = parser.parse_args()
    r = compare(args.export, args.source)
    print(f"routed experts: code bytes equal to the source {r['bytes_equal']:.3f}; relative error (Frobenius, all "
          f"experts) {r['frobenius']:.4f}; worst tensor {r['worst']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

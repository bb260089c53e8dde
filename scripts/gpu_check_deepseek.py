"""The DeepSeek-V3 family on one GPU: load, forward and calibration of its stand-in, against the CPU.

    python scripts/gpu_check_deepseek.py [--out DIR] [--hidden-size 1024 --num-experts 32 ...]

1. make-tiny deepseek_v3 (sizes from the flags; FP8 128x128 blocks, MTP layer) in a temporary folder;
2. `modelopt_ext.from_pretrained(..., device_map="cuda")` in bf16: on CUDA the family's prepare asks
   transformers to dequantize the FP8 blocks (exactly: `formats/fp8_block.py`) and not to fetch hub kernels
   (`use_kernels=False`; the machine is offline); every dequantized weight must equal the CPU load's bit for bit;
3. logits on the GPU against the fp32 CPU load (max |gpu - cpu| / max |cpu|): checked for an fp32 load on the
   GPU, reported for the bf16 one;
4. `quant.calibrate.calibrate` with the family's production recipe on a few corpus batches: every enabled
   quantizer's amax finite, coverage recorded, the seconds it took.
Exits non-zero on a failed check; writes DIR/check_deepseek.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

import modelopt_ext
from modelopt_ext.families import families

TOLERANCE = 1e-3  # fp32 on the GPU against fp32 on the CPU (max abs difference over max abs); the bf16 GPU model's
# difference is reported, not checked: with random weights near-tied router scores flip experts between dtypes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_out")
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-experts", type=int, default=32)
    p.add_argument("--moe-intermediate-size", type=int, default=512)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    from modelopt_ext.quant import recipes
    from modelopt_ext.quant.calibrate import calibrate
    from modelopt_ext.quant.data import calibration_batches, default_texts
    from modelopt_ext.quant.patterns import quantizers

    spec = families()["deepseek_v3"]
    report, failures = {"device": torch.cuda.get_device_name(0)}, []
    with tempfile.TemporaryDirectory() as tmp:
        sizes = {"hidden_size": args.hidden_size, "num_experts": args.num_experts,
                 "moe_intermediate_size": args.moe_intermediate_size}
        ckpt = spec.make_tiny(Path(tmp) / "ds", seed=0, sizes=sizes)
        start = time.perf_counter()
        gpu = modelopt_ext.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cuda")
        report["load_s"] = round(time.perf_counter() - start, 2)
        cpu = modelopt_ext.from_pretrained(ckpt, dtype=torch.bfloat16)
        g, c = gpu.state_dict(), cpu.state_dict()
        differ = [k for k in c if not torch.equal(g[k].cpu(), c[k])]
        report["weights_equal_cpu_load"] = not differ
        if differ:
            failures.append(f"{len(differ)} weights differ from the CPU load, first {differ[:3]}")
        del cpu
        reference = modelopt_ext.from_pretrained(ckpt, dtype=torch.float32)
        gpu32 = modelopt_ext.from_pretrained(ckpt, dtype=torch.float32, device_map="cuda")
        ids = torch.randint(3, 500, (2, 64), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = reference(input_ids=ids, use_cache=False).logits
            for name, model in (("fp32", gpu32), ("bf16", gpu)):
                got = model(input_ids=ids.cuda(), use_cache=False).logits.float().cpu()
                report[f"logits_rel_error_{name}_gpu_vs_cpu_fp32"] = float((got - want).abs().max() / want.abs().max())
        rel = report["logits_rel_error_fp32_gpu_vs_cpu_fp32"]
        if not rel <= TOLERANCE:
            failures.append(f"fp32 logits on the GPU differ from the CPU's by {rel:.2e} of their max (> {TOLERANCE})")
        del reference, gpu32
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ckpt)
        batches = calibration_batches(tokenizer, default_texts(), calib_size=args.batches, batch_size=1,
                                      seq_len=args.seq_len)
        batches = [{k: v.cuda() for k, v in b.items()} for b in batches]
        cfg = recipes.quant_config(recipes.load(spec.default_recipe), gpu.config, family=spec)
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = calibrate(gpu, cfg, batches, router_glob=spec.router_glob, router_ids=spec.router_ids,
                           num_experts=args.num_experts)
        torch.cuda.synchronize()
        report["calibrate_s"] = round(time.perf_counter() - start, 2)
        report["calibrate_parts"] = result.seconds
        report["coverage"] = result.coverage.summary_line()
        enabled = {n: q for n, q in quantizers(result.model).items() if getattr(q, "is_enabled", False)}
        bad = [n for n, q in enabled.items() if getattr(q, "amax", None) is not None
               and not bool(torch.isfinite(q.amax).all())]
        report["enabled_quantizers"], report["nonfinite_amax"] = len(enabled), bad[:5]
        if not enabled or bad:
            failures.append(f"{len(enabled)} enabled quantizers, non-finite amax in {bad[:3]}")
    report["failures"] = failures
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "check_deepseek.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

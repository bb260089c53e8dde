"""GPU check (H200): the stand-in's torch KDA reference against fla-core's Triton kernels, the adapter's KDA
wrapper against the raw kernel call, and the stand-in end to end on CUDA (unpatched vs adapted, fla vs torch).

Run on a CUDA machine from the repo root:  PYTHONPATH=. python scripts/gpu_check_kda.py --out OUT_DIR
Prints a table; writes OUT_DIR/gpu_check_kda.json. Errors are ||out - ref|| / ||ref|| (METHOD.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def kernel_inputs(B, T, H, K, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    def r(*s):
        return torch.randn(*s, generator=g, device="cuda")
    return dict(
        q=r(B, T, H, K).to(dtype), k=r(B, T, H, K).to(dtype), v=r(B, T, H, K).to(dtype),
        g=r(B, T, H, K).to(dtype), beta=r(B, T, H).to(dtype),
        A_log=torch.rand(H, generator=g, device="cuda").mul(15).add(1).log(),
        dt_bias=r(H * K) * 0.1,
    )


# The stand-in's own call arguments (modeling_kimi_linear.KimiDeltaAttention.forward).
CALL = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            lower_bound=-5.0, transpose_state_layout=True, output_final_state=True)


def check_kernels(results: dict) -> None:
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    from modelopt_ext.models.kimi_k3.standin import modeling_kimi_linear as mkl

    for dtype in (torch.float32, torch.bfloat16):
        for (B, T, H, K) in ((2, 257, 4, 64), (1, 2048, 8, 128)):
            x = kernel_inputs(B, T, H, K, dtype, seed=T)
            args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
            kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], scale=K**-0.5, **CALL)
            o_fla, s_fla = chunk_kda(*args, safe_gate=True, **kw)
            o_ref, s_ref = mkl.torch_chunk_kda(*args, safe_gate=True, **kw)
            # one-token decode from the chunked state
            step = kernel_inputs(B, 1, H, K, dtype, seed=T + 1)
            sargs = (step["q"], step["k"], step["v"], step["g"], step["beta"])
            skw = dict(kw, initial_state=s_fla)
            d_fla, _ = fused_recurrent_kda(*sargs, **skw)
            d_ref, _ = mkl.torch_recurrent_kda(*sargs, **dict(kw, initial_state=s_ref))
            # the adapter's wrapper semantics: beta squashed in fp32 and cast back, flag cleared
            beta_sq = torch.sigmoid(x["beta"].float()).to(x["beta"].dtype)
            o_wrap, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], beta_sq, safe_gate=True,
                                  **dict(kw, use_beta_sigmoid_in_kernel=False))
            key = f"{str(dtype).split('.')[-1]} B{B} T{T} H{H} K{K}"
            results["kernels"][key] = {
                "chunk: fla vs torch": rel(o_fla, o_ref),
                "chunk state: fla vs torch": rel(s_fla, s_ref),
                "decode: fla vs torch": rel(d_fla, d_ref),
                "chunk: wrapped vs in-kernel sigmoid": rel(o_wrap, o_fla),
            }


def check_model(results: dict, workdir: Path) -> None:
    import modelopt_ext
    from modelopt_ext.models.kimi_k3.standin.generate import make_tiny
    from modelopt_ext.models.kimi_k3.standin.smoke import load_unpatched
    from modelopt_ext.testing.checkpoints import copy_checkpoint

    src = make_tiny(workdir / "gpu_tiny", seed=0)
    ref_dir = copy_checkpoint(src, workdir, "gpu_reference")
    ids = torch.randint(13, 500, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cpu_ref = load_unpatched(str(ref_dir), torch.float32)(input_ids=ids, use_cache=False).logits
        gpu_ref_model = load_unpatched(str(ref_dir), torch.float32).cuda()
        gpu_ref = gpu_ref_model(input_ids=ids.cuda(), use_cache=False).logits.cpu()
        adapted = modelopt_ext.from_pretrained(src, trust_remote_code=True, dtype=torch.float32, device_map="cuda")
        gpu_adapted = adapted(input_ids=ids.cuda(), use_cache=False).logits.cpu()
        out = adapted(input_ids=ids[:, :64].cuda(), use_cache=True)
        cache, worst = out.cache, 0.0
        for pos in range(64, 72):
            step = adapted(input_ids=ids[:, pos : pos + 1].cuda(), cache=cache, use_cache=True).logits[:, -1]
            full = adapted(input_ids=ids[:, : pos + 1].cuda(), use_cache=False).logits[:, -1]
            worst = max(worst, float((step - full).abs().max()))
        block = adapted.language_model.model.layers[1].block_sparse_moe
        x = torch.randn(4, 512, block.config.hidden_size, device="cuda")
        torch.cuda.set_sync_debug_mode("error")
        try:
            block(x)
            torch.cuda.synchronize()
            sync_free = True
        except RuntimeError as e:
            import traceback

            tb = traceback.extract_tb(e.__traceback__)
            frames = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.line}" for f in tb]
            sync_free = f"sync: {e}"[:120] + " at " + " <- ".join(reversed(frames[-4:]))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    results["model"] = {
        "unpatched fp32: cuda (fla) vs cpu (torch ref), max abs logits": float((gpu_ref - cpu_ref).abs().max()),
        "unpatched fp32: cuda vs cpu, rel": rel(gpu_ref, cpu_ref),
        "adapted vs unpatched, both cuda fp32, max abs": float((gpu_adapted - gpu_ref).abs().max()),
        "adapted cached decode vs uncached, cuda fp32, max abs over 8 steps": worst,
        "adapted MoE block (grouped_mm) free of host syncs": sync_free,
        "experts implementation": adapted.config.get_text_config()._experts_implementation,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--skip-kernels", action="store_true", help="only the end-to-end model checks")
    args = parser.parse_args()
    import fla
    import transformers

    results = {
        "env": {
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
            "fla": getattr(fla, "__version__", "?"), "python": platform.python_version(),
        },
        "kernels": {},
    }
    start = time.time()
    if not args.skip_kernels:
        check_kernels(results)
    with tempfile.TemporaryDirectory() as d:
        check_model(results, Path(d))
    results["seconds"] = time.time() - start
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check_kda.json").write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps(results["env"]))
    for case, values in results["kernels"].items():
        print(case, " | ".join(f"{k}: {v:.2e}" for k, v in values.items()))
    for k, v in results["model"].items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()

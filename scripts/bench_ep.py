"""EP benchmark at Kimi-K3 per-rank shapes, side by side in one run (GPUs, NCCL, one process per GPU).

    torchrun --nproc-per-node 2 scripts/bench_ep.py [--tokens 4096 8192 16384] [--out DIR]

Per rank: latent width 3584, top-16, 14 experts per rank (EP2 -> 28 experts), bf16, uniform random routing.
Measures, with CUDA events (median of --reps after --warmup):
  - dispatch + combine (modelopt_ext.ep.dispatch, identity experts) vs raw `all_to_all_single` of the same
    bytes with the same splits (tokens there and back);
  - the local experts block (KimiK3Experts, transformers' grouped_mm + SiTU-GLU) on the rows one rank
    receives, in TFLOP/s, vs a plain 8192^3 bf16 matmul in the same process.
Prints ratios; rank 0 writes DIR/bench_ep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from modelopt_ext.ep.dispatch import combine, dispatch
from modelopt_ext.models.kimi_k3 import experts as experts_module
from modelopt_ext.models.kimi_k3.experts import KimiK3Experts

H, INTER, TOP_K, LOCAL_EXPERTS = 3584, 3072, 16, 14


def timed(fn, warmup: int, reps: int) -> float:
    """Median milliseconds of `fn` (CUDA events, ranks in lock step via barrier)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def routing(tokens: int, num_experts: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=g, device="cuda")
    ids = scores.topk(TOP_K, dim=-1).indices
    weights = torch.rand(tokens, TOP_K, generator=g, device="cuda")
    return ids, weights / weights.sum(-1, keepdim=True)


class Config:  # the fields KimiK3Experts reads
    num_experts = LOCAL_EXPERTS
    latent_moe_dim = H
    moe_intermediate_size = INTER
    activation_situ_beta = 4.0
    activation_situ_linear_beta = 25.0
    initializer_range = 0.02
    _experts_implementation = "grouped_mm"


def bench_exchange(tokens: int, args, group) -> dict:
    world = dist.get_world_size()
    rank = dist.get_rank()
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    ids, weights = routing(tokens, LOCAL_EXPERTS * world, seed=rank * 1000 + tokens)

    def ours():
        recv_x, _, meta = dispatch(x, ids, LOCAL_EXPERTS, group)
        return combine(recv_x, weights, meta, group)

    _, _, meta = dispatch(x, ids, LOCAL_EXPERTS, group)
    send = x.new_empty(sum(meta.send_sizes), H).normal_()
    recv = x.new_empty(sum(meta.recv_sizes), H)
    back = x.new_empty(sum(meta.send_sizes), H)

    def raw():
        dist.all_to_all_single(recv, send, list(meta.recv_sizes), list(meta.send_sizes), group=group)
        dist.all_to_all_single(back, recv, list(meta.send_sizes), list(meta.recv_sizes), group=group)

    t_ours = timed(ours, args.warmup, args.reps)
    t_raw = timed(raw, args.warmup, args.reps)
    off_rank = sum(s for r, s in enumerate(meta.send_sizes) if r != rank) * H * 2
    # where the time goes: the pieces of dispatch/combine outside the two exchanges
    ids_S = ids.reshape(-1)

    def counts():
        c = torch.bincount(ids_S, minlength=LOCAL_EXPERTS * world).view(world, LOCAL_EXPERTS)
        r = torch.empty_like(c)
        dist.all_to_all_single(r, c, group=group)
        torch.stack([c.sum(1), r.sum(1)]).tolist()

    def gather():
        return x[torch.argsort(ids_S, stable=True) // TOP_K]

    inverse = torch.empty_like(meta.order_S)
    inverse[meta.order_S] = torch.arange(meta.order_S.numel(), device="cuda")

    def unsort():
        return back.index_select(0, inverse)

    def weighted_sum():
        return torch.bmm(weights.to(back.dtype).unsqueeze(1), back.view(tokens, TOP_K, H)).squeeze(1)

    parts = {name: timed(fn, args.warmup, args.reps)
             for name, fn in (("counts+sync", counts), ("sort+gather", gather), ("unsort", unsort),
                              ("weighted sum (bmm)", weighted_sum))}
    return {"tokens_per_rank": tokens, "dispatch_combine_ms": t_ours, "raw_all_to_all_ms": t_raw,
            "raw_over_ours": t_raw / t_ours, "off_rank_bytes_each_way": off_rank,
            "raw_GBps_each_way": off_rank / (t_raw / 2 / 1e3) / 1e9, "parts_ms": parts}


def bench_experts(tokens: int, args) -> dict:
    rows = tokens * TOP_K  # rows one rank receives on average
    experts = KimiK3Experts(Config()).cuda().to(torch.bfloat16)
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, LOCAL_EXPERTS, (rows, 1), device="cuda")
    ones = torch.ones(rows, 1, device="cuda", dtype=torch.bfloat16)
    flops = 2 * rows * H * (2 * INTER) + 2 * rows * INTER * H
    out = {"rows": rows}
    # side by side: the eager fp32 SiTU-GLU, then the compiled (fused) one the module uses on CUDA
    for name, fused in (("eager_glu", False), ("", True)):
        experts_module.FUSE_ON_CUDA = fused
        with torch.no_grad():
            t = timed(lambda: experts(x, ids, ones), args.warmup + (3 if fused else 0), args.reps)
        suffix = f"_{name}" if name else ""
        out.update({f"experts_ms{suffix}": t, f"experts_TFLOPs{suffix}": flops / (t / 1e3) / 1e12})
    gate_up = torch.randn(rows, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out["glu_ms_eager"] = timed(lambda: experts_module._situ_glu_reference(*gate_up.chunk(2, -1), 4.0, 25.0),
                                    args.warmup, args.reps)
        out["glu_ms_fused"] = timed(lambda: experts_module.situ_glu(*gate_up.chunk(2, -1), 4.0, 25.0),
                                    args.warmup, args.reps)
        ref = experts_module._situ_glu_reference(*gate_up.chunk(2, -1), 4.0, 25.0).float()
        fused_out = experts_module.situ_glu(*gate_up.chunk(2, -1), 4.0, 25.0).float()
        out["glu_fused_max_abs_diff"] = float((ref - fused_out).abs().max())
        out["glu_fused_max_rel_diff"] = float(((ref - fused_out).abs() / ref.abs().clamp_min(1e-2)).max())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    group = dist.group.WORLD
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        t_mm = timed(lambda: a @ b, args.warmup, args.reps)
    matmul_tflops = 2 * 8192**3 / (t_mm / 1e3) / 1e12
    results = {"gpu": torch.cuda.get_device_name(), "world": dist.get_world_size(), "torch": torch.__version__,
               "matmul_8192_bf16_TFLOPs": matmul_tflops, "runs": []}
    for tokens in args.tokens:
        run = bench_exchange(tokens, args, group)
        run.update(bench_experts(tokens, args))
        run["experts_over_matmul"] = run["experts_TFLOPs"] / matmul_tflops
        results["runs"].append(run)
    if dist.get_rank() == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_ep.json").write_text(json.dumps(results, indent=2))
        print(f"{results['gpu']} x{results['world']}, torch {results['torch']}, "
              f"bf16 matmul 8192^3: {matmul_tflops:.0f} TFLOP/s")
        print("tokens/rank | dispatch+combine ms | raw a2a ms | raw/ours | experts ms | experts TFLOP/s | /matmul")
        for r in results["runs"]:
            print(f"{r['tokens_per_rank']:>11} | {r['dispatch_combine_ms']:>19.2f} | {r['raw_all_to_all_ms']:>10.2f} |"
                  f" {r['raw_over_ours']:>8.2f} | {r['experts_ms']:>10.2f} | {r['experts_TFLOPs']:>15.0f} |"
                  f" {r['experts_over_matmul']:>7.2f}")
        for r in results["runs"]:
            print(f"{r['tokens_per_rank']} tokens: experts with eager fp32 SiTU-GLU {r['experts_ms_eager_glu']:.2f} ms "
                  f"({r['experts_TFLOPs_eager_glu']:.0f} TFLOP/s) vs fused {r['experts_ms']:.2f} ms; SiTU-GLU alone "
                  f"{r['glu_ms_eager']:.2f} -> {r['glu_ms_fused']:.2f} ms, "
                  f"max |diff| {r['glu_fused_max_abs_diff']:.2e}")
        for r in results["runs"]:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in r["parts_ms"].items())
            print(f"{r['tokens_per_rank']} tokens: raw a2a {r['raw_GBps_each_way']:.0f} GB/s off-rank each way; "
                  f"parts (ms): {parts}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

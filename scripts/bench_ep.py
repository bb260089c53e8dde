"""The EP MoE layer at Kimi-K3 per-rank shapes against its parts, side by side in one run.

    torchrun --nproc-per-node 2 scripts/bench_ep.py [--tokens 4096 16384] [--chunks 1 2 4] [--out DIR]
    torchrun --nproc-per-node 2 scripts/bench_ep.py --device cpu --hidden 256 --inter 128 --tokens 64  # smoke

Per rank (defaults): latent width 3584, expert width 3072, top-16, 14 experts per rank, bf16, a sigmoid
top-k router over all W*14 experts. Median of --reps timings (CUDA events on GPUs) after --warmup, ranks in
lock step. Measured in the same run:
  - layer_ours[C]: router + `ep.overlap.overlapped_moe` with C chunks (exchange overlapped with the experts,
    experts in place on the received blocks, fused weighted combine), NCCL with one row per slot (the default
    link); layer_tokens[C]: the same with each token sent once per rank (`ep.token_link`, opt-in
    experts option `token_dispatch`). (In session 7's JSON, taken while the token dispatch was the default,
    "ours" is the token dispatch and "slots" the slot rows.);
  - layer_before: router + `ep.dispatch` + transformers' grouped_mm experts function + `combine` (the path
    `torch_a2a` takes for calibration and autograd);
  - parts: the two bare `torch._grouped_mm` GEMMs on the rows this rank receives + raw `all_to_all_single`
    of the same rows there and back (the issue's yardstick: layer / parts <= 1.0);
  - experts block (`run_rows`: GEMMs, activation) against a bf16 8192^3 matmul, with each SiTU-GLU form
    (`modelopt_ext.options.GLU_FORMS` and the sigmoid rewrite; time and error against float64); MXFP4 dequantization of
    the local experts (reference vs fused kernel);
  - with --carveouts N: cuBLASLt GEMMs told to leave N SMs free (`torch._C._set_sm_carveout_experimental`),
    bare and inside the overlapped layer;
  - dispatch+combine alone (identity experts) against the raw exchange of the slot rows (the yardstick) and
    against a raw exchange of the bytes the token dispatch moves (token rows out, slot rows back);
  - the layer with a new routing on every call ("varying": per-shape host costs show, as in calibration),
    with the default rule for small blocks (experts option `segment_min_rows`: regrouped) and with one GEMM per
    block.
Rank 0 prints ratios and writes DIR/bench_ep.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from modelopt_ext.ep import local
from modelopt_ext.ep.backend import run_local_experts
from modelopt_ext.ep.dispatch import combine, count_ids, dispatch, inverse_permutation
from modelopt_ext.ep.link import Routing
from modelopt_ext.ep.overlap import overlapped_moe
from modelopt_ext.ep.token_link import route_tokens
from modelopt_ext.formats.mxfp4 import dequantize_mxfp4, dequantize_mxfp4_fused
from modelopt_ext.models.kimi_k3 import experts as experts_module
from modelopt_ext.models.kimi_k3.experts import KimiK3Experts
from modelopt_ext.options import GLU_FORMS


def make_timer(device: str, warmup: int, reps: int):
    def timed(fn) -> float:
        """Median milliseconds of `fn`."""
        for _ in range(warmup):
            fn()
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        times = []
        for _ in range(reps):
            dist.barrier()
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                sync()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return timed


class Config:  # the fields KimiK3Experts reads
    activation_situ_beta = 4.0
    activation_situ_linear_beta = 25.0
    initializer_range = 0.02
    _experts_implementation = "grouped_mm"

    def __init__(self, args):
        self.num_experts = args.local_experts
        self.routed_expert_hidden_size = args.hidden
        self.moe_intermediate_size = args.inter


def router(x_TH, w_NH, top_k):
    scores = torch.sigmoid(x_TH.float() @ w_NH.float().t())
    weights, ids = scores.topk(top_k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


def situ_glu_sigmoid_form(gate, up, beta: float, linear_beta: float):
    """SiTU-GLU with tanh(z) = 2 sigmoid(2z) - 1 (exp-based): measured against the module's tanh form."""
    g, u = gate.float(), up.float()
    gate_part = beta * (2 * torch.sigmoid(g * (2 / beta)) - 1) * torch.sigmoid(g)
    return (gate_part * (linear_beta * (2 * torch.sigmoid(u * (2 / linear_beta)) - 1))).to(gate.dtype)


def bf16_ulps(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|y - ref| in units of the bf16 spacing at |ref| (2^(floor(log2 |ref|) - 7); values below 2^-60 count as
    2^-67)."""
    exponent = torch.floor(torch.log2(ref.abs().clamp_min(2.0**-60)))
    return (y.double() - ref).abs() / torch.exp2(exponent - 7)


def bench_activation(R, I, dev, dt, timed, t, out) -> None:
    """Each SiTU-GLU form on a [R, 2I] gate/up output: time, and its error against the float64 formula."""
    gate_up = torch.randn(R, 2 * I, device=dev, dtype=dt) * 3
    ref = experts_module._situ_glu_reference(*gate_up.double().chunk(2, -1), 4.0, 25.0)
    forms = {form: (lambda form=form: experts_module.apply_situ_glu(gate_up, 4.0, 25.0, form)) for form in GLU_FORMS}
    sigmoid_form = torch.compile(situ_glu_sigmoid_form, dynamic=True, fullgraph=True) if dev == "cuda" else (
        situ_glu_sigmoid_form)
    forms["sigmoid"] = lambda: sigmoid_form(*gate_up.chunk(2, -1), 4.0, 25.0)
    for form, fn in forms.items():
        t[f"glu_{form}"] = timed(fn)
        y = fn()
        out[f"glu_{form}_max_abs_diff"] = float((y.double() - ref).abs().max())
        out[f"glu_{form}_max_bf16_ulps"] = float(bf16_ulps(y, ref).max())


def bench_dequant(E, I, H, dev, dt, timed, t, out) -> None:
    packed = torch.randint(0, 256, (E, 2 * I, H // 2), device=dev, dtype=torch.uint8)
    scale = torch.randint(118, 124, (E, 2 * I, H // 32), device=dev, dtype=torch.uint8)
    t["dequant_gate_up_reference"] = timed(lambda: dequantize_mxfp4(packed, scale, dt, validate=False))
    t["dequant_gate_up_fused"] = timed(lambda: dequantize_mxfp4_fused(packed, scale, dt))
    out["dequant_fused_identical"] = bool(torch.equal(dequantize_mxfp4(packed, scale, dt, validate=False),
                                                      dequantize_mxfp4_fused(packed, scale, dt)))


def bench_exchange_parts(x, ids, weights, num_experts, K, timed, t) -> None:
    """Where dispatch+combine spends its time outside the two exchanges."""
    ids_S = ids.reshape(-1)
    order = torch.argsort(ids_S, stable=True)
    back = x.new_empty(ids_S.numel(), x.shape[1]).normal_()
    inverse = inverse_permutation(order)

    def counts():
        c = count_ids(ids_S, num_experts)
        r = torch.empty_like(c)
        dist.all_to_all_single(r, c)
        return torch.stack([c, r]).tolist()

    t["part_counts_sync"] = timed(counts)
    t["part_sort_gather"] = timed(lambda: x.index_select(0, torch.argsort(ids_S, stable=True) // K))
    t["part_gather_weighted_sum"] = timed(lambda: local.gather_weighted_sum(back, inverse, weights))
    t["part_gather_weighted_sum_eager"] = timed(lambda: local._gather_weighted_sum(back, inverse, weights))


@contextlib.contextmanager
def experts_options(experts, **changes):
    """The experts module's options (`modelopt_ext.options.ExpertsOptions`) changed inside the block."""
    saved = experts.options
    experts.options = saved.replace(**changes)
    try:
        yield
    finally:
        experts.options = saved


def token_split_sizes(ids, E: int, group) -> tuple[list[int], list[int]]:
    """Token rows this rank sends to / receives from each rank under the token dispatch (one per token and
    rank owning one of its experts; the token link's `route_tokens`, one chunk), for the raw exchange of the
    bytes it moves."""
    W = dist.get_world_size(group)
    chunk_T = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
    routing = Routing(ids, torch.argsort(ids.reshape(-1), stable=True), chunk_T, 1)
    send = route_tokens(routing, W, E).tokens_CW[0]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return send.tolist(), recv.tolist()


def bench_copy_engine(x, ids, weights, E, group, meta, timed, t, chunks) -> None:
    """Dispatch+combine through the copy engines, and the raw copy-engine exchange of the same rows: each peer's
    rows copied into its peer-mapped buffer and back, with the barriers that make them visible."""
    from modelopt_ext.ep import copy_engine

    for c in chunks:
        t[f"exchange_ce_c{c}"] = timed(lambda: overlapped_moe(x, ids, weights, E, group, lambda r, s: r, chunks=c,
                                                              transport="copy_engine"))
    rank, W, H = dist.get_rank(group), dist.get_world_size(group), x.shape[1]
    buf = copy_engine._buffer(group, x.device)
    send = x.new_empty(sum(meta.send_sizes), H).normal_()
    every = [None] * W
    dist.all_gather_object(every, list(meta.send_sizes), group=group)
    plan = copy_engine.peer_plan([[[[every[s][d]]] for d in range(W)] for s in range(W)], rank)  # one block a peer
    buf.ensure(plan.capacity_rows * H * x.dtype.itemsize)
    mine = buf.rows(rank, 0, plan.back_base[rank], H, x.dtype)

    def raw_ce():
        # every block, own rows too (a local copy-engine copy), as NCCL's exchange moves them
        for d, src, dst, n in plan.sends[0]:
            buf.rows(d, dst, n, H, x.dtype).copy_(send[src:src + n])
        buf.handle.barrier(channel=0, timeout_ms=copy_engine.BARRIER_TIMEOUT_MS)
        for s, src, dst, n in plan.returns[0]:
            buf.rows(s, dst, n, H, x.dtype).copy_(mine[src:src + n])
        buf.handle.barrier(channel=0, timeout_ms=copy_engine.BARRIER_TIMEOUT_MS)

    t["raw_copy_engine"] = timed(raw_ce)


def trace_overlap(layers: dict, args, out_dir: Path, tokens: int) -> dict:
    """Profile a few calls of each transport's layer (C = the middle chunk count) and summarise how the GPU
    work overlapped (`profiling.stream_overlap`); rank 0 keeps the traces."""
    from modelopt_ext.profiling import stream_overlap

    c = args.chunks[len(args.chunks) // 2]
    result = {}
    for name, layer in layers.items():
        if name not in args.transports:
            continue
        layer(c)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                layer(c)
            torch.cuda.synchronize()
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"trace_{name}_c{c}_{tokens}_rank{dist.get_rank()}.json"
        prof.export_chrome_trace(str(path))
        result[name] = {"chunks": c, "calls": 3, **stream_overlap(path)}
        if dist.get_rank() != 0:
            path.unlink()
    return result


def bench_tokens(tokens: int, args, group, timed, dev) -> dict:
    W, rank = dist.get_world_size(), dist.get_rank()
    H, I, E, K = args.hidden, args.inter, args.local_experts, args.top_k
    dt = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    x = torch.randn(tokens, H, device=dev, dtype=dt, generator=gen)
    torch.manual_seed(7 + rank)  # each rank holds other experts
    experts = KimiK3Experts(Config(args)).to(dev, dt)
    w_router = torch.randn(W * E, H, device=dev, dtype=dt, generator=torch.Generator(device=dev).manual_seed(3))
    ids, weights = router(x, w_router, K)
    out: dict = {"tokens_per_rank": tokens}

    # this rank's received rows, in dispatch order ([source][local expert] blocks) and expert-major
    recv_x, recv_ids, meta = dispatch(x, ids, E, group)
    R = recv_x.shape[0]
    order_R, offs_E = local.sort_by_expert(recv_ids, E)
    xs = recv_x.index_select(0, order_R)
    src_R = torch.repeat_interleave(torch.arange(W, device=dev), torch.tensor(meta.recv_sizes, device=dev),
                                    output_size=R)
    counts_WE = torch.bincount(src_R * E + recv_ids, minlength=W * E).view(W, E).tolist()
    segments = local.block_segments(counts_WE)
    flops = 2 * R * H * 2 * I + 2 * R * I * H
    out.update(rows=R, flops=flops)
    w13, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()
    h = torch.randn(R, I, device=dev, dtype=dt)

    with torch.no_grad():
        t = {}
        # parts: bare GEMMs and the raw exchange of the same rows
        t["bare_grouped_gemms"] = timed(lambda: (local.project(xs, w13, offs_E), local.project(h, w2, offs_E)))
        t["bare_segment_gemms"] = timed(lambda: (local.project(recv_x, w13, segments=segments),
                                                 local.project(h, w2, segments=segments)))
        send = x.new_empty(sum(meta.send_sizes), H).normal_()
        recv, back = x.new_empty(R, H), x.new_empty(sum(meta.send_sizes), H)

        def raw():
            dist.all_to_all_single(recv, send, list(meta.recv_sizes), list(meta.send_sizes), group=group)
            dist.all_to_all_single(back, recv, list(meta.send_sizes), list(meta.recv_sizes), group=group)

        t["raw_all_to_all"] = timed(raw)
        # the same, but the dispatch carries the token rows the token dispatch sends (the return stays per slot)
        tok_send, tok_recv = token_split_sizes(ids, E, group)
        out.update(token_rows_sent=sum(tok_send), slot_rows_sent=sum(meta.send_sizes))
        tok_out, tok_in = x.new_empty(sum(tok_send), H).normal_(), x.new_empty(sum(tok_recv), H)

        def raw_token_bytes():
            dist.all_to_all_single(tok_in, tok_out, tok_recv, tok_send, group=group)
            dist.all_to_all_single(back, recv, list(meta.send_sizes), list(meta.recv_sizes), group=group)

        t["raw_all_to_all_token_bytes"] = timed(raw_token_bytes)
        # the same GEMM shapes as one dense matmul each (one expert's weights for all rows): what the grouped
        # GEMMs would reach at this size and the clocks of a long run
        t["dense_same_shapes"] = timed(lambda: (torch.mm(xs, w13[0].t()), torch.mm(h, w2[0].t())))
        # the experts block
        with experts_options(experts, segment_min_rows=0):  # one cuBLAS GEMM per [source][expert] block, any size
            t["experts_segments"] = timed(lambda: experts.run_rows(recv_x, segments))
            for form in [f for f in GLU_FORMS[1:] if f != "eager"]:  # the default's alternatives
                with experts_options(experts, glu_on_cuda=form):
                    t[f"experts_segments_glu_{form}"] = timed(lambda: experts.run_rows(recv_x, segments))
        with experts_options(experts, segment_min_rows=1 << 62):  # blocks regrouped expert-major, one grouped GEMM
            t["experts_segments_regrouped"] = timed(lambda: experts.run_rows(recv_x, segments))
        t["experts_grouped"] = timed(lambda: experts.run_rows(xs, offs_E=offs_E))
        ones = torch.ones(R, device=dev, dtype=dt)
        t["experts_transformers"] = timed(lambda: run_local_experts(experts, recv_x, recv_ids, ones))
        bench_activation(R, I, dev, dt, timed, t, out)
        bench_dequant(E, I, H, dev, dt, timed, t, out)
        for tile in args.row_tiles:
            t[f"experts_segments_tile{tile}"] = timed(lambda: local.expert_mlp(
                recv_x, w13, w2, experts._apply_gate, segments=segments, row_tile=tile))
        bench_exchange_parts(x, ids, weights, W * E, K, timed, t)

        # dispatch + combine alone (identity experts)
        t["exchange_ours"] = timed(lambda: overlapped_moe(x, ids, weights, E, group, lambda r, s: r, chunks=1,
                                                          transport="nccl"))
        for c in args.chunks[1:]:
            t[f"exchange_ours_c{c}"] = timed(lambda: overlapped_moe(x, ids, weights, E, group, lambda r, s: r,
                                                                    chunks=c, transport="nccl"))
        for c in args.chunks:
            t[f"exchange_tokens_c{c}"] = timed(lambda: overlapped_moe(x, ids, weights, E, group, lambda r, s: r,
                                                                     chunks=c, transport="nccl", token_dispatch=True))

        def exchange_before():
            rx, _, m = dispatch(x, ids, E, group)
            return combine(rx, weights, m, group)

        t["exchange_before"] = timed(exchange_before)
        if "copy_engine" in args.transports:
            bench_copy_engine(x, ids, weights, E, group, meta, timed, t, args.chunks)

        # the whole layer
        def layer_before():
            i, w = router(x, w_router, K)
            rx, rids, m = dispatch(x, i, E, group)
            y = run_local_experts(experts, rx, rids, torch.ones(rx.shape[0], device=dev, dtype=dt))
            return combine(y, w, m, group)

        def layer_ours(c, token_dispatch=False):
            i, w = router(x, w_router, K)
            return overlapped_moe(x, i, w, E, group, experts.run_rows, chunks=c, transport="nccl",
                                  token_dispatch=token_dispatch)

        def layer_ce(c):
            i, w = router(x, w_router, K)
            return overlapped_moe(x, i, w, E, group, experts.run_rows, chunks=c, transport="copy_engine")

        t["layer_before"] = timed(layer_before)
        for c in args.chunks:
            t[f"layer_ours_c{c}"] = timed(lambda: layer_ours(c))
            t[f"layer_tokens_c{c}"] = timed(lambda: layer_ours(c, token_dispatch=True))
            if "copy_engine" in args.transports:
                t[f"layer_ce_c{c}"] = timed(lambda: layer_ce(c))
        if args.trace and dev == "cuda":
            out["overlap"] = trace_overlap({"nccl": layer_ours, "copy_engine": layer_ce}, args, Path(args.trace_dir),
                                           tokens)
        # a new routing on every call (as in calibration: every batch routes differently), so per-shape host
        # costs (cuBLAS heuristics for a row count it has not seen) show; default segment rule, then forced
        varying_runs = 3 + ("copy_engine" in args.transports)
        variants = iter([x + 0.05 * torch.randn_like(x) for _ in range(args.warmup + args.reps)] * varying_runs)

        def layer_varying(c, transport="nccl", token_dispatch=False):
            xv = next(variants)
            i, w = router(xv, w_router, K)
            return overlapped_moe(xv, i, w, E, group, experts.run_rows, chunks=c, transport=transport,
                                  token_dispatch=token_dispatch)

        c_mid = args.chunks[len(args.chunks) // 2]
        t[f"layer_ours_c{c_mid}_varying"] = timed(lambda: layer_varying(c_mid))
        if "copy_engine" in args.transports:
            t[f"layer_ce_c{c_mid}_varying"] = timed(lambda: layer_varying(c_mid, transport="copy_engine"))
        with experts_options(experts, segment_min_rows=0):
            t[f"layer_ours_c{c_mid}_varying_per_block"] = timed(lambda: layer_varying(c_mid))
        t[f"layer_tokens_c{c_mid}_varying"] = timed(lambda: layer_varying(c_mid, token_dispatch=True))
        variants = None  # free the inputs
        # SMs left to NCCL while the GEMMs run (cuBLASLt's SM count target), so the exchange can overlap them
        for sms in (n for n in args.carveouts if n and dev == "cuda"):
            torch.backends.cuda.preferred_blas_library("cublaslt")
            torch._C._set_sm_carveout_experimental(sms)
            try:
                t[f"bare_segment_gemms_carveout{sms}"] = timed(lambda: (local.project(recv_x, w13, segments=segments),
                                                                        local.project(h, w2, segments=segments)))
                for c in args.chunks:
                    t[f"layer_ours_c{c}_carveout{sms}"] = timed(lambda: layer_ours(c))
            finally:
                torch._C._set_sm_carveout_experimental(None)
                torch.backends.cuda.preferred_blas_library("default")
        y_before, y_ours = layer_before().float(), layer_ours(args.chunks[-1]).float()
        out["layer_max_abs_diff"] = float((y_ours - y_before).abs().max())
        y_tokens = layer_ours(args.chunks[-1], token_dispatch=True).float()
        out["token_dispatch_identical_to_slot_rows"] = bool(torch.equal(y_tokens, y_ours))
        if "copy_engine" in args.transports:  # expert-major blocks: one GEMM per expert, not per (source, expert)
            for c in args.chunks:
                out[f"layer_ce_c{c}_max_abs_diff_vs_nccl"] = float((layer_ce(c).float() - layer_ours(c).float()
                                                                    ).abs().max())
        out["layer_ref_max_abs"] = float(y_before.abs().max())
    out["ms"] = t
    return out


def summarize(run: dict, matmul_tflops: float) -> dict:
    t = run["ms"]
    parts = t["bare_grouped_gemms"] + t["raw_all_to_all"]
    layers = {k: v for k, v in t.items() if k.startswith(("layer_ours_c", "layer_tokens_c", "layer_ce_c"))}
    best = min(layers, key=layers.get)
    blocks = ("dense_same_shapes", "bare_grouped_gemms", "bare_segment_gemms", "experts_segments", "experts_grouped",
              "experts_transformers", *(k for k in t if k.startswith(("experts_segments_", "bare_segment_gemms_"))))
    tflops = {k: run["flops"] / (t[k] / 1e3) / 1e12 for k in blocks}
    return {"parts_ms": parts, "best_layer": best,
            "layer_ours_over_parts": t[best] / parts,
            "layer_before_over_parts": t["layer_before"] / parts,
            **{f"{k}_over_parts": v / parts for k, v in layers.items()},
            "TFLOPs": tflops, **{f"{k}_over_matmul": v / matmul_tflops for k, v in tflops.items()},
            "raw_over_exchange_ours": t["raw_all_to_all"] / min(v for k, v in t.items()
                                                                 if k.startswith("exchange_ours")),
            "raw_over_exchange_tokens": t["raw_all_to_all"] / min(v for k, v in t.items()
                                                                  if k.startswith("exchange_tokens")),
            "raw_token_bytes_over_exchange_tokens": t["raw_all_to_all_token_bytes"] / min(
                v for k, v in t.items() if k.startswith("exchange_tokens")),
            "token_rows_over_slot_rows": run["token_rows_sent"] / run["slot_rows_sent"],
            **({"raw_over_exchange_ce": t["raw_all_to_all"] / min(v for k, v in t.items()
                                                                  if k.startswith("exchange_ce")),
                "raw_copy_engine_over_exchange_ce": t["raw_copy_engine"] / min(v for k, v in t.items()
                                                                               if k.startswith("exchange_ce")),
                "raw_over_raw_copy_engine": t["raw_all_to_all"] / t["raw_copy_engine"]}
               if "raw_copy_engine" in t else {}),
            "experts_segments_over_dense_same_shapes": t["dense_same_shapes"] / t["experts_segments"],
            "raw_over_exchange_before": t["raw_all_to_all"] / t["exchange_before"],
            "dequant_fused_over_bare_gemms": t["dequant_gate_up_fused"] / t["bare_grouped_gemms"]}


def matmul_rate(n: int, dev: str, timed) -> float:
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / (timed(lambda: a @ b) / 1e3) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=3584)
    parser.add_argument("--inter", type=int, default=3072)
    parser.add_argument("--local-experts", type=int, default=14)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--row-tiles", type=int, nargs="+", default=[])
    parser.add_argument("--carveouts", type=int, nargs="+", default=[])
    parser.add_argument("--transports", nargs="+", default=None, choices=["nccl", "copy_engine"],
                        help="EP links to measure (default: both on GPUs, nccl on CPUs)")
    parser.add_argument("--trace", action="store_true", help="profile each transport's layer (GPUs)")
    parser.add_argument("--trace-dir", default="/tmp/bench_ep_traces", help="where rank 0 keeps the traces")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    dev = args.device
    if args.transports is None:
        args.transports = ["nccl", "copy_engine"] if dev == "cuda" else ["nccl"]
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if dev == "cuda" else "gloo")
    timed = make_timer(dev, args.warmup, args.reps)
    n = 8192 if dev == "cuda" else 512
    with torch.no_grad():
        matmul_tflops = matmul_rate(n, dev, timed)
    results = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "world": dist.get_world_size(),
               "torch": torch.__version__, f"matmul_{n}_bf16_TFLOPs": matmul_tflops, "args": vars(args), "runs": []}
    for tokens in args.tokens:
        run = bench_tokens(tokens, args, dist.group.WORLD, timed, dev)
        run["summary"] = summarize(run, matmul_tflops)
        results["runs"].append(run)
        if dev == "cuda":
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_ep.json").write_text(json.dumps(results, indent=2))
        print(f"{results['gpu']} x{results['world']}, torch {results['torch']}, bf16 matmul {n}^3: "
              f"{matmul_tflops:.0f} TFLOP/s")
        for r in results["runs"]:
            t, s = r["ms"], r["summary"]
            print(f"--- {r['tokens_per_rank']} tokens/rank, {r['rows']} rows received")
            print("  ms: " + ", ".join(f"{k} {v:.2f}" for k, v in t.items()))
            print(f"  layer/parts: ours {s['layer_ours_over_parts']:.2f} ({s['best_layer']}; "
                  + ", ".join(f"{k[6:-11]} {v:.2f}" for k, v in s.items()
                              if k.startswith(("layer_ours_c", "layer_tokens_c", "layer_ce_c"))
                              and k.endswith("_over_parts"))
                  + f"), before {s['layer_before_over_parts']:.2f}; parts {s['parts_ms']:.2f} ms")
            print("  experts TFLOP/s (/matmul): " + ", ".join(
                f"{k} {v:.0f} ({s[f'{k}_over_matmul']:.2f})" for k, v in s["TFLOPs"].items()))
            print(f"  raw/dispatch+combine: ours {s['raw_over_exchange_ours']:.2f}, token dispatch "
                  f"{s['raw_over_exchange_tokens']:.2f} (raw of the bytes it moves / it "
                  f"{s['raw_token_bytes_over_exchange_tokens']:.2f}; token rows / slot rows "
                  f"{s['token_rows_over_slot_rows']:.3f}; identical layer: "
                  f"{r['token_dispatch_identical_to_slot_rows']}), "
                  f"before {s['raw_over_exchange_before']:.2f}; dequant fused/bare GEMMs "
                  f"{s['dequant_fused_over_bare_gemms']:.3f} (identical: {r['dequant_fused_identical']})")
            if "raw_over_exchange_ce" in s:
                print(f"  copy engines: raw NCCL / ours {s['raw_over_exchange_ce']:.2f}, raw CE / ours "
                      f"{s['raw_copy_engine_over_exchange_ce']:.2f}, "
                      f"raw NCCL / raw CE {s['raw_over_raw_copy_engine']:.2f}")
            for name, o in r.get("overlap", {}).items():
                print(f"  overlap {name}: " + json.dumps(o.get("0", o))[:600])
            print("  SiTU-GLU vs float64, max |diff| / max bf16 ulps: " + ", ".join(
                f"{k[4:-13]} {r[k]:.2e} / {r[k[:-13] + '_max_bf16_ulps']:.2f}" for k in r
                if k.startswith("glu_") and k.endswith("_max_abs_diff")))
            print(f"  layer ours vs before max|diff| {r['layer_max_abs_diff']:.3e} "
                  f"(max |y| {r['layer_ref_max_abs']:.3e})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from modelopt_ext.dist import end_process

    end_process(0, joined=True)  # see modelopt_ext.dist.end_process

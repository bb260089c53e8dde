"""Probe: can the EP exchange run without a host sync here? PyTorch's NVSHMEM all_to_all_vdev_2d takes split
sizes on the device and delivers rows grouped by expert. Checks availability, correctness against NCCL
all_to_all_single + regrouping, sync-freedom and time, at Kimi-K3 per-rank shapes (GPUs, one per rank).

    timeout 180 torchrun --nproc-per-node 2 scripts/gpu_probe_nvshmem.py [--tokens 16384] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

H, E, K = 3584, 14, 16


def timed(fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def probe(tokens: int) -> dict:
    import torch.distributed._symmetric_memory as symm_mem

    W, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.empty(1, device=dev)  # NVSHMEM allocation needs the device context
    res = {"nvshmem_available": bool(symm_mem.is_nvshmem_available())}
    if not res["nvshmem_available"]:
        return res
    symm_mem.set_backend("NVSHMEM")
    group_name = dist.group.WORLD.group_name
    g = torch.Generator(device=dev).manual_seed(rank)
    ids = torch.rand(tokens, W * E, device=dev, generator=g).topk(K, -1).indices.reshape(-1)
    order = torch.argsort(ids, stable=True)
    x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16, generator=g)
    send = x.index_select(0, order // K)
    splits = torch.bincount(ids, minlength=W * E)
    S = send.shape[0]
    cap = S * W  # rows a rank could receive at most here
    inp = symm_mem.empty(S, H, dtype=torch.bfloat16, device=dev)
    out = symm_mem.empty(cap, H, dtype=torch.bfloat16, device=dev)
    in_splits = symm_mem.empty(W * E, dtype=torch.int64, device=dev)
    out_so = symm_mem.empty(2, W * E, dtype=torch.int64, device=dev)
    inp.copy_(send)
    in_splits.copy_(splits)

    def nvshmem():
        torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, in_splits, out_so, group_name, major_align=16)

    nvshmem()
    torch.cuda.synchronize()
    # reference: NCCL with host splits, then regroup [source][expert] -> [expert][source]
    recv_splits = torch.empty_like(splits)
    dist.all_to_all_single(recv_splits, splits)
    s_host, r_host = splits.view(W, E).sum(1).tolist(), recv_splits.view(W, E).sum(1).tolist()
    ref = x.new_empty(sum(r_host), H)
    dist.all_to_all_single(ref, send, r_host, s_host)
    blocks = list(ref.split(recv_splits.tolist()))  # [source][expert]
    out_splits, out_offs = out_so[0].tolist(), out_so[1].tolist()
    ok = True
    for e in range(E):
        for w in range(W):
            want = blocks[w * E + e]
            i = e * W + w
            got = out[out_offs[i]:out_offs[i] + out_splits[i]]
            ok &= got.shape == want.shape and bool(torch.equal(got, want))
    res["rows_match_nccl"] = ok
    torch.cuda.set_sync_debug_mode("error")
    try:
        nvshmem()
        res["sync_free"] = True
    except RuntimeError as err:
        res["sync_free"] = str(err).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    res["nvshmem_ms"] = timed(nvshmem)
    res["nccl_ms"] = timed(lambda: dist.all_to_all_single(ref, send, r_host, s_host))
    res["rows_sent"] = S
    return res


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    try:
        res = probe(args.tokens)
    except Exception as err:  # noqa: BLE001 - a probe reports what failed
        res = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-2000:]}
    print(f"rank {dist.get_rank()}: {json.dumps({k: v for k, v in res.items() if k != 'trace'})}", flush=True)
    if dist.get_rank() == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "probe_nvshmem.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
    from modelopt_ext.dist import end_process

    end_process(0, joined=True)  # see modelopt_ext.dist.end_process

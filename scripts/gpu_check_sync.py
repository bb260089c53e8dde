"""The fused GPU MoE path: numerics against the CPU reference and device-to-host syncs (GPUs, NCCL).

    torchrun --nproc-per-node 2 scripts/gpu_check_sync.py [--out DIR]

On every rank (one GPU each):
  1. one process: `KimiK3Experts` and `KimiK3PackedExperts` (MXFP4) in bf16 on the GPU, with each GPU form of
     the SiTU-GLU (`experts.GLU_FORMS`), forward under
     `torch.cuda.set_sync_debug_mode("error")` (any device-to-host sync raises), compared with the eager
     fp32 forward of the same weights on the CPU (some slots routed to the EP sentinel);
  2. expert parallel over all ranks: `ep.overlap.overlapped_moe` under sync debug mode "warn", with the
     received blocks regrouped (the default for blocks this small) and with one GEMM per block, each through
     NCCL (one row per slot, and each token sent once per rank, `ep.token_link`, which must give the same
     bits) and through the copy engines (`ep.copy_engine`), counting the syncs (the design has exactly one: the
     split sizes the exchange needs on the host), compared with `ep.dispatch` + the CPU reference of each
     rank's experts, and the copy-engine results with NCCL's (bit for bit where both run the grouped GEMMs on
     expert-major rows).
Exits non-zero on a failed check; rank 0 writes DIR/check_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from modelopt_ext.ep.dispatch import combine, dispatch
from modelopt_ext.ep.overlap import overlapped_moe
from modelopt_ext.formats.mxfp4 import quantize_mxfp4
from modelopt_ext.models.kimi_k3.experts import KimiK3Experts, KimiK3PackedExperts
from modelopt_ext.options import GLU_FORMS, ExpertsOptions

T, H, I, E, K = 512, 1024, 768, 16, 8
TOLERANCE = 2e-2  # max |gpu - cpu| / max |cpu|: bf16 inputs, weights and outputs against fp32


class Config:
    num_experts, routed_expert_hidden_size, moe_intermediate_size = E, H, I
    activation_situ_beta, activation_situ_linear_beta, initializer_range = 4.0, 25.0, 0.02
    _experts_implementation = "eager"


def packed_from(dense: KimiK3Experts) -> KimiK3PackedExperts:
    packed = KimiK3PackedExperts(Config())
    for name in ("gate_up_proj", "down_proj"):
        p, s = quantize_mxfp4(getattr(dense, name).detach())
        getattr(packed, f"{name}_packed").data.copy_(p)
        getattr(packed, f"{name}_scale").data.copy_(s)
    return packed


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want.float()).abs().max() / want.abs().max())


def check_one_process(seed: int) -> dict:
    """Each GPU SiTU-GLU form of `modelopt_ext.options.GLU_FORMS` (the Triton kernels and the compiled form)."""
    out = {}
    for form in [f for f in GLU_FORMS if f != "eager"]:
        out.update({f"{name}_{form}": v for name, v in _check_one_process(seed, form).items()})
    return out


def _check_one_process(seed: int, form: str) -> dict:
    torch.manual_seed(seed)
    dense = KimiK3Experts(Config())
    packed = packed_from(dense)
    for module in (dense, packed):
        module.options = ExpertsOptions(glu_on_cuda=form)
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(E + 1)[:K] for _ in range(T)])  # E itself: a slot routed elsewhere
    w = torch.rand(T, K)
    out = {}
    for name, module in (("dense", dense), ("mxfp4", packed)):
        with torch.no_grad():
            ref = module.to(torch.float32)(x, ids, w)
            gpu = module.to("cuda", torch.bfloat16) if name == "dense" else module.cuda()
            if name == "mxfp4":
                gpu.dequant_dtype = torch.bfloat16
            args = (x.cuda().bfloat16(), ids.cuda(), w.cuda())
            gpu(*args)  # compile and warm up
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = gpu(*args)
                torch.cuda.set_sync_debug_mode(0)
                synced = None
            except RuntimeError as err:
                torch.cuda.set_sync_debug_mode(0)
                got, synced = gpu(*args), str(err).splitlines()[0]
        out[name] = {"rel_error": rel_error(got, ref), "sync_error": synced}
    return out


def check_ep(group, seed: int) -> dict:
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(seed + rank)
    experts = KimiK3Experts(Config())
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(W * E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    with torch.no_grad():
        # reference: the exchange on the GPUs in fp32, each rank's experts in fp32 on the CPU
        rx, rids, meta = dispatch(x.cuda(), ids.cuda(), E, group)
        y = experts(rx.cpu(), rids.cpu().unsqueeze(-1), torch.ones(rx.shape[0], 1))
        ref = combine(y.cuda(), w.cuda(), meta, group).cpu()
        gpu = experts.to("cuda", torch.bfloat16)
        args = (x.cuda().bfloat16(), ids.cuda(), w.cuda(), E, group, gpu.run_rows)
        out, results = {}, {}
        # blocks here hold ~64 rows: the default rule regroups them; 0 forces one GEMM per block. Each through
        # NCCL and through the copy engines (whose first call allocates the peer-mapped buffer: warm-up).
        # NCCL first with one row per slot (the default), then with the token dispatch (`nccl_tokens`). (Session
        # 7's JSON was taken while the token dispatch was the default: its "nccl_slots" rows are the slot rows.)
        for variant in ("nccl", "nccl_tokens", "copy_engine"):
            transport = "nccl" if variant == "nccl_tokens" else variant
            for layout, min_rows in (("regrouped", ExpertsOptions().segment_min_rows), ("per_block", 0)):
                name = layout if variant == "nccl" else f"{layout}_{variant}"
                gpu.options = ExpertsOptions(segment_min_rows=min_rows)
                exchange = {"transport": transport, "token_dispatch": variant == "nccl_tokens"}
                try:
                    overlapped_moe(*args, **exchange)  # compile and warm up
                    torch.cuda.synchronize()
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        torch.cuda.set_sync_debug_mode("warn")
                        try:
                            got = overlapped_moe(*args, **exchange)
                        finally:
                            torch.cuda.set_sync_debug_mode(0)
                finally:
                    gpu.options = ExpertsOptions()
                syncs = [str(c.message).splitlines()[0] for c in caught if "synchroniz" in str(c.message)]
                out[name] = {"rel_error": rel_error(got, ref), "syncs": len(syncs), "sync_messages": syncs[:4]}
                results[name] = got
                if variant == "nccl_tokens":  # the same rows delivered in the same layout: the same bits
                    out[name]["identical_to_nccl"] = bool(torch.equal(got, results[layout]))
                elif variant != "nccl":
                    # The copy engines deliver rows expert-major: with the grouped GEMMs (the regrouped layout) the
                    # same rows in the same order as NCCL + regrouping, so the same bits; one GEMM per block runs
                    # one GEMM per expert instead of per (source, expert) block, so only close.
                    out[name]["max_abs_diff_vs_nccl"] = float((got.float() - results[layout].float()).abs().max())
                    if layout == "regrouped":
                        out[name]["identical_to_nccl"] = bool(torch.equal(got, results[layout]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    result = {"one_process": check_one_process(seed=11), "ep": check_ep(dist.group.WORLD, seed=21)}
    failures = [f"{k}: rel error {v['rel_error']:.3e} > {TOLERANCE}" for k, v in result["one_process"].items()
                if v["rel_error"] > TOLERANCE]
    failures += [f"{k}: synced: {v['sync_error']}" for k, v in result["one_process"].items() if v["sync_error"]]
    for layout, v in result["ep"].items():
        if v["rel_error"] > TOLERANCE:
            failures.append(f"ep {layout}: rel error {v['rel_error']:.3e} > {TOLERANCE}")
        if v["syncs"] > 1:
            failures.append(f"ep {layout}: {v['syncs']} syncs, expected 1: {v['sync_messages']}")
        if v.get("identical_to_nccl") is False:
            failures.append(f"ep {layout}: differs from the same layout through NCCL")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"result": result, "failures": failures})
    if dist.get_rank() == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "check_sync.json").write_text(json.dumps(gathered, indent=2))
        for r, g in enumerate(gathered):
            print(f"rank {r}: {json.dumps(g['result'])}")
            for f in g["failures"]:
                print(f"rank {r} FAILED {f}")
    ok = not any(g["failures"] for g in gathered)
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
    from modelopt_ext.dist import end_process

    end_process(0, joined=True)  # see modelopt_ext.dist.end_process

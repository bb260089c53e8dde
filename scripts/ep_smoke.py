"""Expert-parallel smoke run: load a checkpoint with EP, compare its logits with a single-process load.

    torchrun --nproc-per-node 2 scripts/ep_smoke.py --model DIR [--dense replicate|fsdp] [--ep N] [--tol 5e-5]

Every rank loads the checkpoint with `modelopt_ext.from_pretrained(..., ep_size=N)` (its own experts only),
runs a forward on a batch of its own (seeded by its rank), loads the same checkpoint in this one process,
runs the same batch through it, and reports the largest absolute logit difference. Rank 0 logs one row per
rank (local experts, checkpoint bytes read for experts / dense modules, max |logit diff|); every rank exits
1 when any rank's difference exceeds `--tol` (or is not finite), else 0. CPU (gloo) runs: the models stay on
the CPU.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

import modelopt_ext
from modelopt_ext.dist import DEFAULT_TIMEOUT_S, all_or_fail, end_process, init_distributed

logger = logging.getLogger("ep_smoke")

COLUMNS = ("rank", "local experts", "experts bytes read", "dense bytes read", "max |logit diff|")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="local checkpoint folder")
    parser.add_argument("--dense", choices=("replicate", "fsdp"), default=None,
                        help="placement of the dense modules (default: chosen by the plan)")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: the world size)")
    parser.add_argument("--tol", type=float, default=5e-5, help="largest allowed max |logit diff| per rank")
    parser.add_argument("--experts-implementation", default=None,
                        help="transformers experts implementation (e.g. batched_mm, grouped_mm, eager)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0, help="rank r draws its batch with seed + r")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="bound on every collective")
    args = parser.parse_args(argv)
    if not args.tol >= 0:
        parser.error(f"--tol must be a non-negative number, got {args.tol}")
    if args.ep is not None and args.ep < 1:
        parser.error(f"--ep must be positive, got {args.ep}")
    return args


def rank_batch(config, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """Token ids [batch_size, seq_len] drawn from the vocabulary, never the media placeholder token."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    candidates = torch.arange(text.vocab_size)
    placeholder = getattr(config, "media_placeholder_token_id", None)
    if placeholder is not None:
        candidates = candidates[candidates != placeholder]
    picks = torch.randint(len(candidates), (batch_size, seq_len), generator=torch.Generator().manual_seed(seed))
    return candidates[picks]


def local_experts(model: torch.nn.Module) -> int | None:
    """Experts per MoE layer held by this rank (None when the model has no fused experts module)."""
    for name, module in model.named_modules():
        if name.endswith(".experts") and hasattr(module, "num_experts"):
            return int(module.num_experts)
    return None


def format_table(rows: Sequence[dict]) -> str:
    lines = ["  ".join(f"{c:>18}" for c in COLUMNS)]
    for r in rows:
        cells = (r["rank"], "?" if r["local_experts"] is None else r["local_experts"], f"{r['experts_bytes']:,}",
                 f"{r['dense_bytes']:,}", f"{r['max_abs_diff']:.3e}")
        lines.append("  ".join(f"{c:>18}" for c in cells))
    return "\n".join(lines)


def failing_ranks(rows: Sequence[dict], tol: float) -> list[int]:
    """Ranks whose difference exceeds `tol` or is not finite (NaN never passes)."""
    return [r["rank"] for r in rows if not (math.isfinite(r["max_abs_diff"]) and r["max_abs_diff"] <= tol)]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank {os.environ.get('RANK', '?')} %(name)s %(levelname)s: %(message)s")
    rank, world_size = init_distributed(args.timeout_s)
    try:
        kwargs = {"trust_remote_code": True, "dtype": torch.float32}
        if args.experts_implementation is not None:
            kwargs["experts_implementation"] = args.experts_implementation
        ep_size = args.ep if args.ep is not None else world_size
        model = modelopt_ext.from_pretrained(args.model, ep_size=ep_size, dense=args.dense, timeout_s=args.timeout_s,
                                             **kwargs)
        plan = model.modelopt_ext_plan
        if rank == 0:
            logger.info("plan: EP %d, dense %s, %d experts per rank", plan.ep_size, plan.dense, plan.experts_per_rank)
        single = all_or_fail("the single-process load", lambda: modelopt_ext.from_pretrained(args.model, **kwargs))
        ids = rank_batch(model.config, args.batch_size, args.seq_len, args.seed + rank)

        def forwards():
            with torch.no_grad():
                ep = model(input_ids=ids, use_cache=False).logits
                ref = single(input_ids=ids, use_cache=False).logits
            return (ep.float() - ref.float()).abs().max().item()

        diff = all_or_fail("the forward", forwards)
        reads = getattr(model, "modelopt_ext_bytes_read", {})
        row = {"rank": rank, "local_experts": local_experts(model), "experts_bytes": reads.get("experts", 0),
               "dense_bytes": reads.get("dense", 0), "max_abs_diff": diff}
        rows: list = [None] * world_size
        dist.all_gather_object(rows, row)
        failed = failing_ranks(rows, args.tol)
        if rank == 0:
            logger.info("EP %d on %d ranks, dense %s, %s experts:\n%s", plan.ep_size, world_size, plan.dense,
                        args.experts_implementation or "default", format_table(rows))
            if failed:
                logger.error("ranks %s exceed the tolerance %g on max |logit diff|", failed, args.tol)
            else:
                logger.info("every rank within %g", args.tol)
        return 1 if failed else 0
    except BaseException:
        dist.destroy_process_group()
        raise


if __name__ == "__main__":
    end_process(main(), joined=True)  # see modelopt_ext.dist.end_process

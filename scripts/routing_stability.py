#!/usr/bin/env python
"""How stable a stand-in's MoE routing is under a tiny weight perturbation.

    python scripts/routing_stability.py CKPT [CKPT ...] [--noise 1e-3] [--trials 3] [--seq-len 64]

Loads each checkpoint with plain transformers in fp32 (`smoke.load_unpatched`: experts dequantized from
MXFP4), runs the embedded corpus (its own tokenizer, packed into blocks as calibration does) and records
every MoE layer's top-k expert set per token. Then adds Gaussian noise to every parameter, of standard
deviation `noise` times that tensor's RMS (0.1% relative noise by default), runs the same tokens again and
prints, per MoE layer, the fraction of tokens whose top-k set changed (mean over `trials` noise draws,
seeded), plus the median gap between the k-th and (k+1)-th biased router score of the unperturbed run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

from modelopt_ext.models.kimi_k3.standin.smoke import load_unpatched
from modelopt_ext.standin.fit import corpus_blocks

BATCH = 32  # corpus blocks per forward


@contextlib.contextmanager
def _recorded_routing(model):
    """Yields {layer name: [topk_idx per forward]}; hooks every router (class `KimiMoEGate`)."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if type(module).__name__ == "KimiMoEGate":
            seen[name] = []
            handles.append(module.register_forward_hook(
                lambda mod, args, out, name=name: seen[name].append(out[0].sort(dim=-1).values)))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _route(model, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    with _recorded_routing(model) as seen, torch.no_grad():
        for block in blocks.split(BATCH):
            model(input_ids=block, use_cache=False)
    return {name: torch.cat(chunks) for name, chunks in seen.items()}


def _router_gaps(model, blocks: torch.Tensor) -> dict[str, float]:
    """Median over tokens of (k-th - (k+1)-th) biased router score, per router."""
    inputs: dict[str, list[torch.Tensor]] = {}
    handles = []
    gates = {n: m for n, m in model.named_modules() if type(m).__name__ == "KimiMoEGate"}
    for name, gate in gates.items():
        inputs[name] = []
        handles.append(gate.register_forward_hook(
            lambda mod, args, out, name=name: inputs[name].append(args[0].detach())))
    with torch.no_grad():
        for block in blocks.split(BATCH):
            model(input_ids=block, use_cache=False)
    for h in handles:
        h.remove()
    gaps = {}
    for name, gate in gates.items():
        x = torch.cat(inputs[name]).float().detach()
        with torch.no_grad():
            choice = torch.nn.functional.linear(x, gate.weight.float()).sigmoid() + gate.e_score_correction_bias.float()
        if gate.top_k >= choice.shape[-1]:
            gaps[name] = float("inf")
            continue
        top = choice.topk(gate.top_k + 1, dim=-1).values
        gaps[name] = float((top[:, -2] - top[:, -1]).median())
    return gaps


def stability(checkpoint: Path, noise: float = 1e-3, trials: int = 3, seq_len: int = 64, seed: int = 0,
              max_blocks: int | None = None) -> dict[str, tuple[float, float]]:
    """{MoE layer: (fraction of tokens whose top-k set changes, median router gap)} over the corpus blocks
    (the first `max_blocks` of them when given)."""
    torch.manual_seed(seed)
    model = load_unpatched(str(checkpoint), torch.float32)
    blocks = corpus_blocks(checkpoint, seq_len)[:max_blocks]
    base = _route(model, blocks)
    gaps = _router_gaps(model, blocks)
    clean = {n: p.detach().clone() for n, p in model.named_parameters()}
    changed = {name: [] for name in base}
    g = torch.Generator().manual_seed(seed)
    for _ in range(trials):
        with torch.no_grad():
            for n, p in model.named_parameters():
                rms = clean[n].float().pow(2).mean().sqrt()
                p.copy_(clean[n] + noise * rms * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))
        noisy = _route(model, blocks)
        for name in base:
            changed[name].append(float((noisy[name] != base[name]).any(dim=-1).float().mean()))
    return {name: (statistics.fmean(v), gaps[name]) for name, v in changed.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--noise", type=float, default=1e-3, help="noise std relative to each tensor's RMS")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=None, help="use only the first N corpus blocks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {c: stability(c, args.noise, args.trials, args.seq_len, args.seed, args.blocks) for c in args.checkpoints}
    print(f"fraction of tokens whose top-k expert set changes under {args.noise:g} relative weight noise "
          f"(mean of {args.trials} draws); in brackets the median k-th minus (k+1)-th router score")
    layers = list(next(iter(results.values())))
    print("layer".ljust(48) + "".join(str(c.name)[:22].rjust(24) for c in args.checkpoints))
    for layer in layers:
        cells = "".join(f"{results[c][layer][0]:8.4f} ({results[c][layer][1]:.4f})".rjust(24)
                        for c in args.checkpoints)
        print(layer.ljust(48) + cells)
    means = "".join(f"{statistics.fmean(r[0] for r in results[c].values()):8.4f}".rjust(24) for c in args.checkpoints)
    print("mean".ljust(48) + means)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fit the stand-in's random weights to the embedded corpus for a few optimizer steps (`make-tiny --fit N`).

Random weights make the MoE routing chaotic (near-tied router scores, tiny input changes flip experts), so
quantization-quality numbers measured on the random stand-in mean little. A short next-token fit on the
text shipped with the package (`corpus.txt`, tokenized with the stand-in's own tokenizer and packed into
blocks as `quant.data.calibration_batches` does for calibration) gives the weights some structure.

Training runs in fp32 on the CPU, one thread, with AdamW; the data order comes from a generator seeded by
`seed`, the model's own randomness (none is used) from `torch.manual_seed(seed)`. The same (seed, steps,
sizes) gives the same fp32 values, and the generator packs them exactly as it packs random ones.

The routed experts' `moe_infer` is inference-only (`torch.no_grad`, and the MoE block refuses `train()`), so
the fit keeps the model in eval mode (it has no dropout) and gives each MoE block, for the duration of the
fit only, a differentiable expert mix with the same routing. `e_score_correction_bias` gets no gradient
(it only picks experts) and keeps its random values, as does the vision tower (text only).

Shapes: B batch, S sequence length, T tokens (B * S), k experts per token, L the experts' width.
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from modelopt_ext.standin.fit import FitResult, FitSettings, corpus_blocks, mean_loss, single_thread, train

from .configuration_kimi_k3 import KimiK3Config
from .modeling_kimi_k3 import KimiK3ForConditionalGeneration
from .modeling_kimi_linear import KimiSparseMoeBlock

logger = logging.getLogger(__name__)

# `make-tiny --fit` without a number: about 40 s of training at the default sizes on one CPU thread, the
# corpus loss from 6.74 to 2.16 (docs/standin.md, "A fitted stand-in")
DEFAULT_FIT_STEPS = 80


def _moe_infer_differentiable(self, x_TL, topk_idx, topk_weight):
    """`KimiSparseMoeBlock.moe_infer` with gradients: every expert on its tokens, weighted, summed in fp32."""
    y_TL = torch.zeros(x_TL.shape, dtype=torch.float32)
    for e, expert in enumerate(self.experts):
        tokens, slots = (topk_idx == e).nonzero(as_tuple=True)
        if tokens.numel():
            out = expert(x_TL[tokens]).float() * topk_weight[tokens, slots].unsqueeze(-1)
            y_TL = y_TL.index_add(0, tokens, out)
    return y_TL.to(x_TL.dtype)


@contextlib.contextmanager
def _trainable_moe(model: torch.nn.Module):
    blocks = [m for m in model.modules() if isinstance(m, KimiSparseMoeBlock)]
    for block in blocks:
        block.moe_infer = types.MethodType(_moe_infer_differentiable, block)
    try:
        yield
    finally:
        for block in blocks:
            del block.moe_infer


def _loss(model, ids_BS: torch.Tensor) -> torch.Tensor:
    logits = model.language_model(input_ids=ids_BS, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids_BS[:, 1:].reshape(-1))


def fit_values(config: KimiK3Config, values: dict[str, torch.Tensor], tokenizer_dir: str | Path, steps: int,
               seed: int, settings: FitSettings = FitSettings()) -> FitResult:
    """Train the model with parameters `values` (fp32, keyed as its state dict) for `steps` AdamW steps of
    next-token cross-entropy on the embedded corpus. Returns new fp32 values (every key of `values`) and the
    mean loss over all corpus blocks before and after. `values` itself is not modified."""
    if steps < 0:
        raise ValueError(f"fit steps must be at least 0, got {steps}")
    start = time.perf_counter()
    with single_thread():
        torch.manual_seed(seed)
        model = KimiK3ForConditionalGeneration(config)
        model.load_state_dict({k: v.clone() for k, v in values.items()}, strict=True)
        model.float().eval()  # eval: the MoE block refuses train(); the model has no dropout
        blocks = corpus_blocks(tokenizer_dir, settings.seq_len)
        params = [p for p in model.language_model.parameters() if p.requires_grad]
        with _trainable_moe(model):
            loss_before = mean_loss(_loss, model, blocks, settings.eval_batch_size)
            logger.info("fit: %d steps on %d corpus blocks of %d tokens (seed %d), loss before %.4f",
                        steps, blocks.shape[0], settings.seq_len, seed, loss_before)
            train(model, params, blocks, _loss, steps, seed, settings)
            loss_after = mean_loss(_loss, model, blocks, settings.eval_batch_size)
        state = model.state_dict()
        fitted = {k: state[k].detach().float().clone() for k in values}
    seconds = time.perf_counter() - start
    logger.info("fit: loss after %d steps %.4f (before %.4f), %.1f s", steps, loss_after, loss_before, seconds)
    return FitResult(values=fitted, loss_before=loss_before, loss_after=loss_after, seconds=seconds)

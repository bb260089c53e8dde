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
import dataclasses
import logging
import math
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from . import tokenizer as tok
from .configuration_kimi_k3 import KimiK3Config
from .modeling_kimi_k3 import KimiK3ForConditionalGeneration
from .modeling_kimi_linear import KimiSparseMoeBlock

logger = logging.getLogger(__name__)

# `make-tiny --fit` without a number: about 40 s of training at the default sizes on one CPU thread, the
# corpus loss from 6.74 to 2.16 (docs/standin.md, "A fitted stand-in")
DEFAULT_FIT_STEPS = 80


@dataclasses.dataclass(frozen=True)
class FitSettings:
    """Optimizer and data settings of the fit (defaults: the ones `make-tiny --fit` uses)."""

    lr: float = 1e-2
    warmup_steps: int = 5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seq_len: int = 64
    batch_size: int = 4
    eval_batch_size: int = 32  # blocks per forward of the before / after loss over the whole corpus


@dataclasses.dataclass
class FitResult:
    """fp32 values after the fit, keyed as the model's state dict, and the corpus loss before and after."""

    values: dict[str, torch.Tensor]
    loss_before: float
    loss_after: float
    seconds: float


def corpus_blocks(tokenizer_dir: str | Path, seq_len: int) -> torch.Tensor:
    """The embedded corpus as [num_blocks, seq_len] token ids: tokenized with the tokenizer in
    `tokenizer_dir`, EOS between paragraphs, cut into whole blocks (`quant.data.calibration_batches`)."""
    from transformers import PreTrainedTokenizerFast

    from modelopt_ext.quant.data import calibration_batches, default_texts

    # from tokenizer.json alone: AutoTokenizer would read the folder's config.json and its remote code
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(tokenizer_dir) / "tokenizer.json"),
                                        eos_token=tok.tokenizer_config()["eos_token"])
    texts = default_texts()
    num_tokens = sum(len(ids) + 1 for ids in tokenizer(texts)["input_ids"])  # + EOS after each paragraph
    batches = calibration_batches(tokenizer, texts, calib_size=max(1, num_tokens // seq_len),
                                  batch_size=1 << 30, seq_len=seq_len)
    return torch.cat([b["input_ids"] for b in batches])


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


@contextlib.contextmanager
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _loss(model, ids_BS: torch.Tensor) -> torch.Tensor:
    logits = model.language_model(input_ids=ids_BS, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids_BS[:, 1:].reshape(-1))


def _mean_loss(model, blocks: torch.Tensor, batch_size: int) -> float:
    with torch.no_grad():
        total = sum(_loss(model, b).item() * b.shape[0] for b in blocks.split(batch_size))
    return total / blocks.shape[0]


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 10% at the last step."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, steps - warmup - 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def fit_values(config: KimiK3Config, values: dict[str, torch.Tensor], tokenizer_dir: str | Path, steps: int,
               seed: int, settings: FitSettings = FitSettings()) -> FitResult:
    """Train the model with parameters `values` (fp32, keyed as its state dict) for `steps` AdamW steps of
    next-token cross-entropy on the embedded corpus. Returns new fp32 values (every key of `values`) and the
    mean loss over all corpus blocks before and after. `values` itself is not modified."""
    if steps < 0:
        raise ValueError(f"fit steps must be at least 0, got {steps}")
    start = time.perf_counter()
    with _single_thread():
        torch.manual_seed(seed)
        model = KimiK3ForConditionalGeneration(config)
        model.load_state_dict({k: v.clone() for k, v in values.items()}, strict=True)
        model.float().eval()  # eval: the MoE block refuses train(); the model has no dropout
        blocks = corpus_blocks(tokenizer_dir, settings.seq_len)
        params = [p for p in model.language_model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
        order = torch.Generator().manual_seed(seed)
        with _trainable_moe(model):
            loss_before = _mean_loss(model, blocks, settings.eval_batch_size)
            logger.info("fit: %d steps on %d corpus blocks of %d tokens (seed %d), loss before %.4f",
                        steps, blocks.shape[0], settings.seq_len, seed, loss_before)
            queue: list[int] = []
            for step in range(steps):
                if len(queue) < settings.batch_size:
                    queue += torch.randperm(blocks.shape[0], generator=order).tolist()
                batch, queue = blocks[queue[: settings.batch_size]], queue[settings.batch_size :]
                for group in optimizer.param_groups:
                    group["lr"] = settings.lr * _lr_factor(step, steps, settings.warmup_steps)
                optimizer.zero_grad(set_to_none=True)
                loss = _loss(model, batch)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
                optimizer.step()
                logger.debug("fit step %d/%d: batch loss %.4f", step + 1, steps, loss.item())
            loss_after = _mean_loss(model, blocks, settings.eval_batch_size)
        state = model.state_dict()
        fitted = {k: state[k].detach().float().clone() for k in values}
    seconds = time.perf_counter() - start
    logger.info("fit: loss after %d steps %.4f (before %.4f), %.1f s", steps, loss_after, loss_before, seconds)
    return FitResult(values=fitted, loss_before=loss_before, loss_after=loss_after, seconds=seconds)

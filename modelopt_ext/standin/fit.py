"""The fit every stand-in shares: random weights trained on the embedded corpus for a few AdamW steps, so that
the routing and activations look like a trained model's (docs/standin.md, "A fitted stand-in").

    with single_thread():
        blocks = corpus_blocks(tokenizer_dir, settings.seq_len)
        before = mean_loss(loss, model, blocks, settings.eval_batch_size)
        train(model, params, blocks, loss, steps, seed, settings)

Next-token cross-entropy (the family's `loss(model, ids_BS)`), fp32 on the CPU, one thread; the batches come in
an order drawn from a generator seeded by `seed`; linear warm-up then cosine decay to 10% (`lr_factor`). The
same (seed, steps, sizes) gives the same values. A family's `fit_values` builds its model, calls these and maps
the values back to its checkpoint's tensors.

Shapes: B batch, S sequence length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch

from . import tokenizer as tok

logger = logging.getLogger(__name__)

Loss = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]  # (model, ids_BS) -> scalar loss


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
    """fp32 values after the fit, keyed as the checkpoint's tensors, and the corpus loss before and after."""

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


@contextlib.contextmanager
def single_thread():
    """torch on one thread while the body runs (the fit's values must not depend on the machine's cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def mean_loss(loss: Loss, model: torch.nn.Module, blocks: torch.Tensor, batch_size: int) -> float:
    """The mean of `loss` over every block, `batch_size` blocks a forward, without gradients."""
    with torch.no_grad():
        total = sum(loss(model, b).item() * b.shape[0] for b in blocks.split(batch_size))
    return total / blocks.shape[0]


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 10% at the last step."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, steps - warmup - 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(model: torch.nn.Module, params: list[torch.nn.Parameter], blocks: torch.Tensor, loss: Loss, steps: int,
          seed: int, settings: FitSettings) -> None:
    """`steps` AdamW steps of `loss` on batches of `settings.batch_size` blocks, in an order drawn from a
    generator seeded by `seed` (every block once before any repeats), gradients clipped to `grad_clip`."""
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    order = torch.Generator().manual_seed(seed)
    queue: list[int] = []
    for step in range(steps):
        if len(queue) < settings.batch_size:
            queue += torch.randperm(blocks.shape[0], generator=order).tolist()
        batch, queue = blocks[queue[: settings.batch_size]], queue[settings.batch_size:]
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * lr_factor(step, steps, settings.warmup_steps)
        optimizer.zero_grad(set_to_none=True)
        value = loss(model, batch)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        logger.debug("fit step %d/%d: batch loss %.4f", step + 1, steps, value.item())

"""modelopt_ext/standin/fit.py: the fit every stand-in shares (schedule, loop, corpus blocks)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from modelopt_ext.standin import tokenizer as tok
from modelopt_ext.standin.fit import FitSettings, corpus_blocks, lr_factor, mean_loss, single_thread, train


def test_lr_factor_warms_up_then_decays_to_a_tenth():
    assert [lr_factor(s, 20, 4) for s in range(4)] == [1 / 5, 2 / 5, 3 / 5, 4 / 5]
    assert lr_factor(4, 20, 4) == 1.0
    assert lr_factor(19, 20, 4) == pytest.approx(0.1)
    mid = 4 + (20 - 4 - 1) / 2
    assert lr_factor(int(mid), 20, 4) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 15)))


def test_single_thread_restores_the_thread_count():
    before = torch.get_num_threads()
    with single_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


class _Bigram(torch.nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.table = torch.nn.Embedding(vocab, vocab)


def _loss(model, ids_BS):
    logits = model.table(ids_BS[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids_BS[:, 1:].reshape(-1))


def _fit(seed: int, steps: int):
    torch.manual_seed(0)
    model = _Bigram(16)
    blocks = torch.randint(0, 16, (10, 8), generator=torch.Generator().manual_seed(1))
    settings = FitSettings(lr=0.1, warmup_steps=1, batch_size=3, eval_batch_size=4)
    before = mean_loss(_loss, model, blocks, settings.eval_batch_size)
    train(model, list(model.parameters()), blocks, _loss, steps, seed, settings)
    return before, mean_loss(_loss, model, blocks, settings.eval_batch_size), model.table.weight.detach().clone()


def test_train_lowers_the_loss_and_repeats_for_a_seed():
    before, after, weights = _fit(seed=3, steps=12)
    assert after < before
    assert torch.equal(_fit(seed=3, steps=12)[2], weights)
    assert not torch.equal(_fit(seed=4, steps=12)[2], weights)  # another seed, another batch order
    assert torch.equal(_fit(seed=3, steps=0)[2], _fit(seed=9, steps=0)[2])  # no step: nothing changes


def test_corpus_blocks_are_whole_blocks_of_the_tokenized_corpus(tmp_path):
    tok.write_tokenizer(tmp_path, 512)
    blocks = corpus_blocks(tmp_path, 64)
    assert blocks.dtype == torch.long and blocks.shape[1] == 64 and blocks.shape[0] > 10
    assert int(blocks.max()) < 512

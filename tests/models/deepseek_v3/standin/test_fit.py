"""The fitted DeepSeek-V3 stand-in (`make_tiny(..., fit_steps=N)`, modelopt_ext.models.deepseek_v3.standin.fit)."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from modelopt_ext.formats.fp8_block import exact_block_dequantize
from modelopt_ext.models.deepseek_v3.standin import fit
from modelopt_ext.models.deepseek_v3.standin.generate import TinySizes, build_config, initial_values, make_tiny
from modelopt_ext.standin.fit import corpus_blocks

SIZES = {"num_layers": 2, "num_experts": 8, "n_group": 2, "topk_group": 1, "top_k": 2, "hidden_size": 128,
         "intermediate_size": 256, "moe_intermediate_size": 128}


def _corpus_loss(path) -> float:
    with exact_block_dequantize():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    blocks = corpus_blocks(path, 64)[:8]
    with torch.no_grad():
        logits = model(blocks).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), blocks[:, 1:].flatten()).item()


def test_model_state_round_trip_keeps_every_value():
    config = build_config(TinySizes(**SIZES), {"[BOS]": 0, "[EOS]": 1})
    values = initial_values(config, seed=3)
    state = fit.to_model_state(config, values)
    assert state["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 2 * 128, 128)
    assert not any(k.startswith("model.layers.2.") for k in state)  # the MTP layer is not in the model
    back = fit.from_model_state(config, state, values)
    assert back.keys() == values.keys() and all(torch.equal(back[k], values[k]) for k in values)


def test_fit_lowers_the_corpus_loss_of_the_stored_checkpoint(tmp_path):
    random = make_tiny(tmp_path / "random", sizes=SIZES)
    fitted = make_tiny(tmp_path / "fitted", sizes=SIZES, fit_steps=10)
    assert json.loads((fitted / "config.json").read_text()) == json.loads((random / "config.json").read_text())
    before, after = _corpus_loss(random), _corpus_loss(fitted)
    assert after < before - 0.5, (before, after)


def test_the_same_seed_fits_the_same_values(tmp_path):
    config = build_config(TinySizes(**SIZES), {"[BOS]": 0, "[EOS]": 1})
    make_tiny(tmp_path / "tok", sizes=SIZES)  # for its tokenizer
    values = initial_values(config, seed=0)
    first, second = (fit.fit_values(config, values, tmp_path / "tok", steps=2, seed=5) for _ in range(2))
    assert first.loss_after < first.loss_before
    assert all(torch.equal(first.values[k], second.values[k]) for k in values)
    assert not torch.equal(first.values["model.layers.1.mlp.gate.weight"], values["model.layers.1.mlp.gate.weight"])
    assert torch.equal(first.values["model.layers.2.embed_tokens.weight"], first.values["model.embed_tokens.weight"])
    assert torch.equal(first.values["model.layers.2.mlp.gate.weight"], values["model.layers.2.mlp.gate.weight"])

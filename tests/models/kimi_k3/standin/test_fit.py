"""Tests for the fitted stand-in (`make-tiny --fit N`, modelopt_ext.models.kimi_k3.standin.fit).

Small sizes and a few steps keep them fast. The checks read the written files (safetensors, the index) or
load them with plain transformers, as tests/models/kimi_k3/standin/test_generate.py does.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from modelopt_ext.cli import main
from modelopt_ext.models.kimi_k3.standin import fit, generate
from modelopt_ext.models.kimi_k3.standin.generate import TinySizes, make_tiny
from modelopt_ext.standin import tokenizer as tok

ROOT = Path(__file__).resolve().parents[4]
# one KDA dense layer and one MLA MoE layer
SIZES = TinySizes(num_layers=2, hidden_size=64, num_experts=4, top_k=2)
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-experts", "4", "--top-k", "2"]
STEPS = 6
SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
EXPERT_RE = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.")


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _layout(path: Path) -> dict[str, tuple[str, list[int]]]:
    """key -> (safetensors dtype, shape) over every shard."""
    out = {}
    for shard in sorted(p for p in path.iterdir() if SHARD_RE.match(p.name)):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                out[key] = (sl.get_dtype(), list(sl.get_shape()))
    return out


def _tensor(path: Path, key: str) -> torch.Tensor:
    shard = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][key]
    with safe_open(str(path / shard), framework="pt") as f:
        return f.get_tensor(key)


@pytest.fixture(scope="module")
def random_ckpt(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("fit") / "random", seed=0, sizes=SIZES)


@pytest.fixture(scope="module")
def fitted_ckpt(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("fit") / "fitted", seed=0, sizes=SIZES, fit_steps=STEPS)


@pytest.fixture(scope="module")
def fit_inputs(tmp_path_factory):
    """(config, random fp32 values, tokenizer folder) of the small stand-in, seed 0."""
    folder = tmp_path_factory.mktemp("tokenizer")
    config = generate.build_config(SIZES, tok.write_tokenizer(folder, SIZES.vocab_size))
    return config, generate.initial_values(config, 0), folder


def test_fit_lowers_the_corpus_loss_and_touches_only_trained_values(fit_inputs, caplog):
    config, values, folder = fit_inputs
    before = {k: v.clone() for k, v in values.items()}
    with caplog.at_level(logging.INFO, logger=fit.__name__):
        result = fit.fit_values(config, values, folder, steps=8, seed=0)
    assert result.loss_after < result.loss_before - 0.3, (result.loss_before, result.loss_after)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert f"loss before {result.loss_before:.4f}" in messages and f"loss after 8 steps {result.loss_after:.4f}" in messages
    assert all(torch.equal(values[k], before[k]) for k in values), "fit_values modified its input"
    assert result.values.keys() == values.keys()
    assert all(v.dtype == torch.float32 and v.shape == values[k].shape for k, v in result.values.items())
    changed = {k for k in values if not torch.equal(result.values[k], values[k])}
    # the text model trains, experts and routers included; what gets no gradient keeps its random values
    assert any(EXPERT_RE.search(k) for k in changed)
    assert any(k.endswith("block_sparse_moe.gate.weight") for k in changed)
    assert "language_model.model.embed_tokens.weight" in changed
    assert not any(k.startswith(("vision_tower.", "mm_projector.")) for k in changed)
    assert not any(k.endswith("e_score_correction_bias") for k in changed)
    heads = config.text_config.linear_attn_config["num_heads"]
    for k in (k for k in values if k.endswith("A_log")):
        assert torch.equal(result.values[k][heads:], torch.zeros_like(result.values[k][heads:])), k


def test_fit_refuses_negative_steps(tmp_path):
    with pytest.raises(ValueError, match="fit_steps=-1"):
        make_tiny(tmp_path / "out", sizes=SIZES, fit_steps=-1)
    assert not (tmp_path / "out").exists()


def test_same_seed_gives_byte_identical_files(tmp_path, capsys, fitted_ckpt):
    """A second fit with the same (seed, steps, sizes), through the command line and with another torch thread
    count set, writes the same bytes (the fit runs on one thread) and gives the thread count back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["make-tiny", "kimi_k3", str(tmp_path / "again"), *FLAGS, "--fit", str(STEPS)]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert _files(tmp_path / "again") == _files(fitted_ckpt)


def test_other_seed_or_steps_change_the_weights_only(tmp_path, fitted_ckpt, random_ckpt):
    base = _files(fitted_ckpt)
    for name, out in (("seed 1", make_tiny(tmp_path / "seed1", seed=1, sizes=SIZES, fit_steps=STEPS)),
                      ("random", random_ckpt)):
        other = _files(out)
        assert sorted(other) == sorted(base)
        for fname in base:
            if SHARD_RE.match(fname):
                assert other[fname] != base[fname], f"{fname} equal for {name}"
            else:
                assert other[fname] == base[fname], f"{fname} differs for {name}"


def test_fit_0_is_the_plain_generator(tmp_path, monkeypatch, random_ckpt):
    def no_fit(*args, **kwargs):
        raise AssertionError("fit_values called for fit_steps=0")

    monkeypatch.setattr(fit, "fit_values", no_fit)
    out = make_tiny(tmp_path / "zero", seed=0, sizes=SIZES, fit_steps=0)
    assert _files(out) == _files(random_ckpt)
    config = generate.build_config(SIZES, tok.write_tokenizer(tmp_path / "tk", SIZES.vocab_size))
    a, b = generate.build_state_dict(config, 0), generate.pack_state_dict(generate.initial_values(config, 0))
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_cli_without_fit_or_with_fit_0_is_the_plain_generator_and_refuses_negative(tmp_path, capsys, random_ckpt):
    assert main(["make-tiny", "kimi_k3", str(tmp_path / "a"), *FLAGS]) == 0
    assert main(["make-tiny", "kimi_k3", str(tmp_path / "b"), *FLAGS, "--fit", "0"]) == 0
    assert _files(tmp_path / "a") == _files(tmp_path / "b") == _files(random_ckpt)
    assert main(["make-tiny", "kimi_k3", str(tmp_path / "c"), *FLAGS, "--fit", "-2"]) == 2
    assert "fit_steps=-2" in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_fitted_checkpoint_is_stored_like_the_random_one(fitted_ckpt, random_ckpt):
    layout = _layout(fitted_ckpt)
    assert layout == _layout(random_ckpt)
    experts = {k: v for k, v in layout.items() if EXPERT_RE.search(k)}
    assert experts and all(k.endswith((".weight_packed", ".weight_scale")) and v[0] == "U8" for k, v in experts.items())
    key = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"
    assert not bool((_tensor(fitted_ckpt, key) == 255).any())


def test_fitted_checkpoint_loads_with_plain_transformers(fitted_ckpt, random_ckpt):
    from modelopt_ext.models.kimi_k3.standin.smoke import load_unpatched

    blocks = fit.corpus_blocks(fitted_ckpt, 64)[:8]

    def loss(path: Path) -> float:
        model = load_unpatched(str(path), torch.float32)
        with torch.no_grad():
            logits = model(input_ids=blocks, use_cache=False).logits
        assert torch.isfinite(logits).all()
        return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), blocks[:, 1:].flatten()))

    # the stored (bf16 / MXFP4) fit keeps most of its gain over the random weights
    assert loss(fitted_ckpt) < loss(random_ckpt) - 0.2


def test_routing_stability_script(fitted_ckpt):
    spec = importlib.util.spec_from_file_location("routing_stability", ROOT / "scripts" / "routing_stability.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.stability(fitted_ckpt, noise=1e-3, trials=1, max_blocks=16)
    assert sorted(result) == ["language_model.model.layers.1.block_sparse_moe.gate"]
    assert all(0.0 <= frac <= 1.0 and gap >= 0 for frac, gap in result.values())
    # much larger noise moves the routing of many tokens: the measurement can see a change
    loud = module.stability(fitted_ckpt, noise=0.3, trials=1, max_blocks=16)
    assert all(frac > 0.05 for frac, _ in loud.values()), loud

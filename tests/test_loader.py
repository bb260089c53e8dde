"""modelopt_ext.loader, the generic loader, with a family that is not Kimi-K3: a tiny Llama saved by transformers
and a `prepare` hook made here (no remote code), to show what the loader does for any family."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modelopt_ext import loader


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _hooks(llama, calls, **overrides):
    def prepare(path, **kwargs):
        calls.append(("prepare", sorted(kwargs)))

        @contextlib.contextmanager
        def scope(name):
            calls.append(("enter", name))
            yield

        fields = dict(
            path=llama, model_class=LlamaForCausalLM, ep_plan={},
            patch=lambda: calls.append(("patch",)),
            make_config=lambda: LlamaConfig.from_pretrained(llama),
            build_scope=lambda: scope("build"), conversion_scope=lambda: scope("conversion"),
            counted_reads=("model.layers.*.mlp",),
            check_loaded=lambda model: calls.append(("check", type(model).__name__)),
            quantization_config={"quant_method": "example"}, description="a test family",
            family_options=("family_flag",),
        )
        fields.update(overrides)
        return loader.PreparedLoad(**fields)

    return prepare


def test_a_family_hook_loads_through_the_generic_steps(llama, caplog):
    calls = []
    with caplog.at_level(logging.INFO, logger="modelopt_ext.loader"):
        result = loader.load(_hooks(llama, calls), llama, family_flag=True, dtype=torch.float32)
    reference = LlamaForCausalLM.from_pretrained(llama, dtype=torch.float32)
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(result.model(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert not result.model.training and result.warmup_s is None
    # the family's option went to its hook, not to from_pretrained (which would refuse it)
    assert calls[0] == ("prepare", ["dtype", "family_flag"])
    assert calls[1:] == [("patch",), ("enter", "conversion"), ("enter", "build"), ("check", "LlamaForCausalLM")]
    assert result.model.config.quantization_config == {"quant_method": "example"}
    mlp = sum(p.numel() * p.element_size() for n, p in reference.named_parameters() if ".mlp." in n)
    everything = sum(p.numel() * p.element_size() for p in reference.state_dict().values())
    assert result.bytes_read == {"experts": mlp, "dense": everything - mlp}
    assert "loaded LlamaForCausalLM (a test family)" in caplog.text


def test_unmapped_keys_fail_the_load(llama):
    class Wider(LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.extra = torch.nn.Linear(2, 2)

    with pytest.raises(loader.CheckpointError, match=r"left keys unmapped: \{'missing_keys': \['extra.bias', "
                                                     r"'extra.weight'\]\}"):
        loader.load(_hooks(llama, [], model_class=Wider), llama, dtype=torch.float32)


def test_a_warmup_runs_from_the_family_hooks_during_the_load(llama):
    built = []

    def build(config, device, dtype, experts_implementation):
        built.append((device.type, dtype))
        return LlamaForCausalLM(config).to(dtype)

    hooks = loader.WarmupHooks(build=build, input_ids=lambda config, b, s, device: torch.zeros(b, s, dtype=torch.long),
                               nbytes=lambda config: 1)
    result = loader.load(_hooks(llama, [], warmup=hooks), llama, dtype=torch.float32, warmup_tokens=(1, 4))
    assert built == [("cpu", torch.float32)] and isinstance(result.warmup_s, float)


@pytest.mark.parametrize("tokens", [(0, 4), (1,), (1, 4.0)])
def test_bad_warmup_tokens_are_refused_before_the_family_is_asked(llama, tokens):
    def prepare(path, **kwargs):
        pytest.fail("prepared after a bad argument")

    with pytest.raises(loader.CheckpointError, match="must be two positive sizes"):
        loader.load(prepare, llama, warmup_tokens=tokens)


# ----------------------------------------------------------------------------------------------------
# what a family without remote code declares (DeepSeek-V3 uses these)


def test_a_native_class_is_not_registered_for_an_auto_class(llama):
    """Only remote code is registered for AutoModelForCausalLM (so that save_pretrained copies its files); on a
    class of transformers' own the registration would change it for every model of the class."""

    class Native(LlamaForCausalLM):
        pass

    class Remote(LlamaForCausalLM):
        pass

    loader.load(_hooks(llama, [], model_class=Native, remote_code=False), llama, dtype=torch.float32)
    loader.load(_hooks(llama, [], model_class=Remote), llama, dtype=torch.float32)
    assert "_auto_class" not in Native.__dict__
    assert Remote.__dict__["_auto_class"] == "AutoModelForCausalLM"


def test_declared_unexpected_keys_are_ignored_and_no_others(llama):
    """A checkpoint layer the model does not build (here: layer 1 of a one-layer model) is refused unless the
    family declares it; a declaration matches from the key's start."""

    def one_layer():
        return LlamaConfig.from_pretrained(llama, num_hidden_layers=1)

    with pytest.raises(loader.CheckpointError, match=r"'unexpected_keys': \['model.layers.1.input_layernorm.weight'"):
        loader.load(_hooks(llama, [], make_config=one_layer), llama, dtype=torch.float32)
    with pytest.raises(loader.CheckpointError, match="unexpected_keys"):
        loader.load(_hooks(llama, [], make_config=one_layer, ignored_unexpected=(r"layers\.1\.",)), llama,
                    dtype=torch.float32)
    result = loader.load(_hooks(llama, [], make_config=one_layer, ignored_unexpected=(r"model\.layers\.1\.",)), llama,
                         dtype=torch.float32)
    assert len(result.model.model.layers) == 1


def test_the_family_load_kwargs_win_over_the_callers(llama):
    result = loader.load(_hooks(llama, [], load_kwargs={"dtype": torch.float64}), llama, dtype=torch.float32)
    assert result.model.model.embed_tokens.weight.dtype == torch.float64



"""Fixtures of the DeepSeek-V3 family's tests: the tiny stand-in, generated once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ds_tiny(tmp_path_factory):
    """The default DeepSeek-V3 stand-in (seed 0): layer 0 dense, layers 1-3 MoE, MTP layer 4."""
    from modelopt_ext.models.deepseek_v3.standin.generate import make_tiny

    return make_tiny(tmp_path_factory.mktemp("ds_v3") / "tiny", seed=0)


@pytest.fixture(scope="session")
def ds_loaded(ds_tiny):
    """(model, loading info) of the default stand-in loaded by plain transformers (CPU: dequantized to bf16)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(ds_tiny, output_loading_info=True)
    return model.eval(), info

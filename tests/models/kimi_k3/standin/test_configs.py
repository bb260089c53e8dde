"""modelopt_ext.models.kimi_k3.standin.configs: the small Kimi-K3 text config for unit tests that build modules directly."""

import torch

from modelopt_ext.models.kimi_k3.standin import modeling_kimi_linear as mkl
from modelopt_ext.models.kimi_k3.standin.configs import tiny_text_config
from modelopt_ext.models.kimi_k3.standin.configuration_kimi_k3 import KimiLinearConfig


def test_the_documented_shape():
    """Three layers (KDA, KDA, MLA), 8 experts top-2, widths 32."""
    config = tiny_text_config()
    assert isinstance(config, KimiLinearConfig)
    assert config.num_hidden_layers == 3
    assert [config.is_kda_layer(i) for i in range(3)] == [True, True, False] and config.is_mla
    assert (config.num_experts, config.num_experts_per_token) == (8, 2)
    assert config.hidden_size == config.moe_intermediate_size == config.routed_expert_hidden_size == 32


def test_overrides_replace_values_and_calls_share_nothing():
    config = tiny_text_config(num_experts=4, hidden_size=16, linear_attn_config={
        "full_attn_layers": [1], "kda_layers": [2, 3], "num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4})
    assert (config.num_experts, config.hidden_size) == (4, 16)
    assert [config.is_kda_layer(i) for i in range(3)] == [False, True, True]
    first = tiny_text_config()
    first.linear_attn_config["kda_layers"].append(3)  # a test that edits its config changes no other test's
    assert tiny_text_config().linear_attn_config["kda_layers"] == [1, 2]


def test_builds_a_small_stand_in_text_model_that_runs():
    torch.manual_seed(0)
    config = tiny_text_config()
    model = mkl.KimiLinearForCausalLM(config).eval()
    assert sum(p.numel() for p in model.parameters()) < 200_000  # small enough for per-token references
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 5, 9, 2, 7]]), use_cache=False).logits
    assert logits.shape == (1, 5, config.vocab_size) and torch.isfinite(logits).all()

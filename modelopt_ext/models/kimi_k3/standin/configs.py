"""Small Kimi-K3 text configs for unit tests that build modules directly (no checkpoint)."""

from __future__ import annotations

from modelopt_ext.models.kimi_k3.standin.configuration_kimi_k3 import KimiLinearConfig


def tiny_text_config(**overrides) -> KimiLinearConfig:
    """Three layers (KDA, KDA, MLA), 8 experts top-2, widths 32: small enough for per-token references."""
    base = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=1,
        routed_expert_hidden_size=32, attn_res_block_size=2,
        linear_attn_config={"full_attn_layers": [3], "kda_layers": [1, 2], "num_heads": 2, "head_dim": 8,
                            "short_conv_kernel_size": 4, "use_full_rank_gate": True, "gate_lower_bound": -5.0},
    )
    base.update(overrides)
    return KimiLinearConfig(**base)

# Stand-in remote code for Kimi-K3, written by the modelopt_ext project from the public facts about the
# checkpoint (see docs/standin.md). Defaults are the real model's sizes; the generator shrinks them.
"""Configuration classes of Kimi-K3: the multimodal wrapper, its Kimi-Linear text model and its ViT."""

from transformers import PretrainedConfig


def _default_full_attn_layers(num_hidden_layers: int) -> list[int]:
    # 1-based ids of the MLA layers: every fourth layer and the last one (24 of 93 for the real model).
    ids = list(range(4, num_hidden_layers + 1, 4))
    if num_hidden_layers not in ids:
        ids.append(num_hidden_layers)
    return ids


class KimiLinearConfig(PretrainedConfig):
    """Text backbone: KDA linear attention and MLA layers, latent MoE with SiTU-GLU experts, AttnRes."""

    model_type = "kimi_linear"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 7168,
        intermediate_size: int = 33792,
        num_hidden_layers: int = 93,
        num_attention_heads: int = 96,
        num_key_value_heads: int = 96,
        hidden_act: str = "silu",
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-5,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        tie_word_embeddings: bool = False,
        q_lora_rank: int = 1536,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        mla_use_nope: bool = True,
        mla_layernorm_eps: float = 1e-6,
        num_experts: int = 896,
        num_experts_per_token: int = 16,
        moe_intermediate_size: int = 3072,
        num_shared_experts: int = 2,
        first_k_dense_replace: int = 1,
        moe_layer_freq: int = 1,
        moe_router_activation_func: str = "sigmoid",
        moe_renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        latent_moe_dim: int = 3584,
        latent_moe_use_norm: bool = True,
        activation_situ_beta: float = 4.0,
        activation_situ_linear_beta: float = 25.0,
        attn_res_block_size: int = 12,
        linear_attn_config: dict | None = None,
        ep_size: int = 1,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_layernorm_eps = mla_layernorm_eps
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.moe_intermediate_size = moe_intermediate_size
        self.num_shared_experts = num_shared_experts
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.moe_router_activation_func = moe_router_activation_func
        self.moe_renormalize = moe_renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.latent_moe_dim = latent_moe_dim
        self.latent_moe_use_norm = latent_moe_use_norm
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.attn_res_block_size = attn_res_block_size
        if linear_attn_config is None:
            full = _default_full_attn_layers(num_hidden_layers)
            linear_attn_config = {
                "full_attn_layers": full,
                "kda_layers": [i for i in range(1, num_hidden_layers + 1) if i not in full],
                "num_heads": 96,
                "head_dim": 128,
                "short_conv_kernel_size": 4,
                "use_full_rank_gate": True,
                "gate_lower_bound": -5.0,
            }
        self.linear_attn_config = linear_attn_config
        # Upstream ships expert parallelism switched off and does not honour other values.
        self.ep_size = ep_size
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def is_mla(self, layer_idx: int) -> bool:
        """Whether 0-based layer `layer_idx` is an MLA (full attention) layer."""
        return (layer_idx + 1) in self.linear_attn_config["full_attn_layers"]

    def is_moe(self, layer_idx: int) -> bool:
        """Whether 0-based layer `layer_idx` has the sparse MoE block instead of the dense MLP."""
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0


class KimiK3VisionConfig(PretrainedConfig):
    """The ViT image encoder and the 2x2 patch merge feeding `mm_projector`."""

    model_type = "kimi_k3_vision"

    def __init__(
        self,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        num_hidden_layers: int = 27,
        num_attention_heads: int = 16,
        patch_size: int = 14,
        num_channels: int = 3,
        init_pos_emb_height: int = 64,
        init_pos_emb_width: int = 64,
        merge_kernel_size: tuple[int, int] | list[int] = (2, 2),
        layer_norm_eps: float = 1e-6,
        **kwargs,
    ):
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.patch_size = patch_size
        self.num_channels = num_channels
        self.init_pos_emb_height = init_pos_emb_height
        self.init_pos_emb_width = init_pos_emb_width
        self.merge_kernel_size = list(merge_kernel_size)
        self.layer_norm_eps = layer_norm_eps
        super().__init__(**kwargs)


class KimiK3Config(PretrainedConfig):
    """Kimi-K3: a Kimi-Linear text model, a ViT and the `mm_projector` that maps merged patches to text width."""

    model_type = "kimi_k3"
    sub_configs = {"text_config": KimiLinearConfig, "vision_config": KimiK3VisionConfig}
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        text_config: dict | KimiLinearConfig | None = None,
        vision_config: dict | KimiK3VisionConfig | None = None,
        media_placeholder_token_id: int = 163605,
        pad_token_id: int | None = None,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        if isinstance(text_config, dict):
            text_config = KimiLinearConfig(**text_config)
        self.text_config = text_config if text_config is not None else KimiLinearConfig()
        if isinstance(vision_config, dict):
            vision_config = KimiK3VisionConfig(**vision_config)
        self.vision_config = vision_config if vision_config is not None else KimiK3VisionConfig()
        self.media_placeholder_token_id = media_placeholder_token_id
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)

    def get_text_config(self, *args, **kwargs) -> KimiLinearConfig:
        return self.text_config

# Stand-in remote code for Kimi-K3, written by the modelopt_ext project from the public facts about the
# checkpoint (see docs/standin.md). Every key is spelled as the real config.json spells it, with the same
# meaning; defaults are the real model's values and the generator shrinks the sizes.
"""Configuration classes of Kimi-K3: the multimodal wrapper, its Kimi-Linear text model and its ViT."""

from transformers import PretrainedConfig


def _default_full_attn_layers(num_hidden_layers: int) -> list[int]:
    # 1-based ids of the MLA layers: every fourth layer and the last one (24 of 93 for the real model).
    ids = list(range(4, num_hidden_layers + 1, 4))
    if num_hidden_layers not in ids:
        ids.append(num_hidden_layers)
    return ids


class KimiLinearConfig(PretrainedConfig):
    """Text backbone: KDA linear attention and MLA layers, latent MoE with SiTU-GLU experts, AttnRes.

    Layer kinds as the real code decides them: layer i (0-based) is KDA iff i + 1 is in
    `linear_attn_config["kda_layers"]`, else MLA; it has the sparse MoE block iff `num_experts` is set,
    i >= `first_k_dense_replace` and i % `moe_layer_freq` == 0, else the dense MLP.
    """

    model_type = "kimi_linear"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 7168,
        intermediate_size: int = 33792,
        num_hidden_layers: int = 93,
        num_attention_heads: int = 96,
        num_key_value_heads: int | None = 96,
        hidden_act: str = "situ",
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-5,
        use_cache: bool = True,
        pad_token_id: int | None = 0,  # token ids: the real code's defaults; config.json sets them
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        tie_word_embeddings: bool = False,
        max_position_embeddings: int = 1048576,
        q_lora_rank: int | None = 1536,
        kv_lora_rank: int | None = 512,
        qk_nope_head_dim: int | None = 128,
        qk_rope_head_dim: int | None = 64,
        v_head_dim: int | None = 128,
        mla_use_nope: bool = True,
        mla_use_output_gate: bool = True,
        num_experts: int | None = 896,
        num_experts_per_token: int | None = 16,
        moe_intermediate_size: int | None = 3072,
        num_shared_experts: int | None = 2,
        first_k_dense_replace: int = 1,
        moe_layer_freq: int = 1,
        moe_router_activation_func: str = "sigmoid",
        moe_renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        topk_method: str = "noaux_tc",
        use_grouped_topk: bool = True,
        num_expert_group: int = 1,
        topk_group: int = 1,
        num_nextn_predict_layers: int = 0,
        routed_expert_hidden_size: int | None = 3584,
        latent_moe_use_norm: bool = True,
        activation_situ_beta: float | None = 4.0,
        activation_situ_linear_beta: float | None = 25.0,
        attn_res_block_size: int | None = 12,
        linear_attn_config: dict | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.max_position_embeddings = max_position_embeddings
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.moe_intermediate_size = moe_intermediate_size
        self.num_shared_experts = num_shared_experts
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.moe_router_activation_func = moe_router_activation_func
        self.moe_renormalize = moe_renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.topk_method = topk_method
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.routed_expert_hidden_size = routed_expert_hidden_size
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
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @property
    def is_mla(self) -> bool:
        """Whether the model has MLA layers at all (the real code's property of this name)."""
        return self.kv_lora_rank is not None or self.q_lora_rank is not None or self.mla_use_nope is True

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def is_kda_layer(self, layer_idx: int) -> bool:
        """Whether 0-based layer `layer_idx` is a KDA (linear attention) layer; the others are MLA."""
        return self.linear_attn_config is not None and (layer_idx + 1) in self.linear_attn_config["kda_layers"]

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether 0-based layer `layer_idx` has the sparse MoE block instead of the dense MLP."""
        return (
            self.num_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )


class KimiK3VisionConfig(PretrainedConfig):
    """The ViT image encoder (`vt_*`) and the patch-merger projector (`mm_projector_*`) feeding the text model."""

    def __init__(
        self,
        patch_size: int = 14,
        init_pos_emb_height: int = 64,
        init_pos_emb_width: int = 64,
        init_pos_emb_time: int = 4,
        pos_emb_type: str = "divided_fixed",
        pos_emb_interpolation_mode: str = "bilinear",
        vt_num_attention_heads: int = 12,
        vt_num_hidden_layers: int = 27,
        vt_hidden_size: int = 1024,
        vt_intermediate_size: int = 4096,
        qkv_hidden_size: int | None = 1536,
        merge_kernel_size: tuple[int, int] | list[int] = (2, 2),
        merge_type: str = "sd2_tpool",
        norm_type: str = "rmsnorm",
        mlp_type: str = "mlp2",
        activation_func: str = "gelu_pytorch_tanh",
        attn_bias: bool = False,
        linear_bias: bool = False,
        patch_embed_proj_bias: bool = False,
        mm_projector_type: str = "patchmergerv2",
        mm_hidden_size: int | None = 1024,
        projector_hidden_act: str = "gelu",
        projector_ln_eps: float = 1e-5,
        text_hidden_size: int = 7168,
        **kwargs,
    ):
        self.patch_size = patch_size
        self.init_pos_emb_height = init_pos_emb_height
        self.init_pos_emb_width = init_pos_emb_width
        self.init_pos_emb_time = init_pos_emb_time
        self.pos_emb_type = pos_emb_type
        self.pos_emb_interpolation_mode = pos_emb_interpolation_mode
        self.vt_num_attention_heads = vt_num_attention_heads
        self.vt_num_hidden_layers = vt_num_hidden_layers
        self.vt_hidden_size = vt_hidden_size
        self.vt_intermediate_size = vt_intermediate_size
        self.qkv_hidden_size = qkv_hidden_size
        self.merge_kernel_size = list(merge_kernel_size)
        self.merge_type = merge_type
        self.norm_type = norm_type
        self.mlp_type = mlp_type
        self.activation_func = activation_func
        self.attn_bias = attn_bias
        self.linear_bias = linear_bias
        self.patch_embed_proj_bias = patch_embed_proj_bias
        self.mm_projector_type = mm_projector_type
        self.mm_hidden_size = vt_hidden_size if mm_hidden_size is None else mm_hidden_size
        self.projector_hidden_act = projector_hidden_act
        self.projector_ln_eps = projector_ln_eps
        self.text_hidden_size = text_hidden_size
        super().__init__(**kwargs)


class KimiK3Config(PretrainedConfig):
    """Kimi-K3: a Kimi-Linear text model, a ViT and the `mm_projector` that maps merged patches to text width.

    The checkpoint's compressed-tensors `quantization_config` lives in `text_config`; as the real code
    does, it is also exposed on this config so that transformers sees it.
    """

    model_type = "kimi_k3"
    sub_configs = {"text_config": KimiLinearConfig, "vision_config": KimiK3VisionConfig}
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        text_config: dict | KimiLinearConfig | None = None,
        vision_config: dict | KimiK3VisionConfig | None = None,
        ignore_index: int = -100,
        media_placeholder_token_id: int = 163605,
        pad_token_id: int | None = 0,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        if isinstance(text_config, dict):
            text_config = KimiLinearConfig(**text_config)
        self.text_config = text_config if text_config is not None else KimiLinearConfig()
        if isinstance(vision_config, dict):
            vision_config = KimiK3VisionConfig(**vision_config)
        self.vision_config = vision_config if vision_config is not None else KimiK3VisionConfig()
        self.ignore_index = ignore_index
        self.media_placeholder_token_id = media_placeholder_token_id
        if getattr(self.text_config, "quantization_config", None) is not None and "quantization_config" not in kwargs:
            self.quantization_config = self.text_config.quantization_config
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)

    def get_text_config(self, *args, **kwargs) -> KimiLinearConfig:
        return self.text_config

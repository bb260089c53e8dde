"""The DeepSeek-V3 family spec (DeepSeek-V3/R1 `deepseek_v3`, Kimi-K2 `kimi_k2`): transformers' native model, so
no pinned revision and no remote-code lock; EP plan, exclusions, converters, sizes, serving facts, recipes, the
stand-in, and the multi-token-prediction layers the export carries over (`carried_layers`)."""

from __future__ import annotations

from modelopt_ext.families import FamilySpec, RouterOutput, ServingSpec, register_family

from . import engine_rules, serving
from .config_check import MODEL_TYPES, check_config
from .pinned import EP_PLAN, EXPORT_EXPERT_NAMES, MIN_VERSIONS, ROUTER_GLOB
from .sizes import BUNDLED_CONFIG, KIMI_K2_CONFIG, plan_sizes


def quantizer_exclusions(config) -> tuple[str, ...]:
    """Quantizer-name globs that stay unquantized under every recipe (the same for every config): the router
    (`mlp.gate`: its weight and correction bias, float32 in transformers), every norm (the layer norms, MLA's
    `q_a_layernorm` / `kv_a_layernorm`, the final norm), the embeddings and lm_head. `*.mlp.gate.*` does not
    match the MLPs' `gate_proj`."""
    return ("*.mlp.gate.*", "*e_score_correction_bias*", "*norm*", "*embed_tokens*", "*lm_head*")


def carried_layers(config) -> tuple[str, ...]:
    """The multi-token-prediction layers (`model.layers.{num_hidden_layers + i}.`, i < num_nextn_predict_layers):
    transformers does not build them; the export carries them over unquantized and excluded, as NVIDIA's DeepSeek
    NVFP4 checkpoints ship layer 61 and the engines' MTP loaders read it (export/source.py)."""
    layers = config["num_hidden_layers"]
    return tuple(f"model.layers.{layers + i}." for i in range(config.get("num_nextn_predict_layers", 0) or 0))


def _prepare(path, **kwargs):
    from . import adapter

    return adapter.prepare_load(path, **kwargs)


def _converters(storage: str) -> list:
    from .adapter import expert_converters

    return expert_converters(storage)


def _make_tiny(out_dir, seed: int = 0, sizes=None, **kwargs):
    """The stand-in generator (`standin.generate.make_tiny`); `sizes` a TinySizes or a mapping of overrides of its
    fields (an unknown one is a ValueError naming the fields)."""
    from .standin.generate import make_tiny

    return make_tiny(out_dir, seed, sizes, **kwargs)


DEEPSEEK_V3 = register_family(
    FamilySpec(
        name="deepseek_v3",
        model_types=MODEL_TYPES,
        text_model_type=None,
        revision=None,
        remote_code_lock=None,
        min_versions=MIN_VERSIONS,
        ep_plan=EP_PLAN,
        quantizer_exclusions=quantizer_exclusions,
        converters=_converters,
        prepare=_prepare,
        make_tiny=_make_tiny,
        router_glob=ROUTER_GLOB,
        sizes=plan_sizes,
        bundled_configs={"deepseek-v3": BUNDLED_CONFIG, "kimi-k2": KIMI_K2_CONFIG},
        default_recipe="deepseek_v3/nvfp4_experts-fp8_attention",
        export_expert_names=EXPORT_EXPERT_NAMES,
        check_config=check_config,
        serving=ServingSpec(
            engines=serving.ENGINES,
            fused_groups=serving.fused_groups,
            never_quantized=serving.never_quantized,
            engine_name=serving.engine_name,
            layer_aliases=serving.layer_aliases,
            linear_shape=serving.linear_shape,
            kv_cache=serving.KV_CACHE,
            sglang_key=engine_rules.sglang_key,
            trtllm_names=engine_rules.trtllm_names,
            sources=engine_rules.SOURCES,
            recipe_engines=engine_rules.RECIPE_ENGINES,
        ),
        router_output=RouterOutput(("logits", "weights", "ids")),  # DeepseekV3TopkRouter's return
        carried_layers=carried_layers,
    )
)

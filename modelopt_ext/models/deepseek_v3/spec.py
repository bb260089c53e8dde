"""The DeepSeek-V3 family spec (DeepSeek-V3/R1 `deepseek_v3`, Kimi-K2 `kimi_k2`): transformers' native model, so
no pinned revision and no remote-code lock; EP plan, exclusions, converters, sizes, serving facts, recipes, the
stand-in. `ptq` refuses the family until the pieces `PTQ_REFUSED` names exist."""

from __future__ import annotations

from modelopt_ext.families import FamilySpec, ServingSpec, register_family

from . import engine_rules, serving
from .config_check import MODEL_TYPES, check_config
from .pinned import EP_PLAN, EXPORT_EXPERT_NAMES, MIN_VERSIONS, ROUTER_GLOB
from .sizes import BUNDLED_CONFIG, KIMI_K2_CONFIG, plan_sizes

PTQ_REFUSED = ("the export does not write this family yet (the exact copy of FP8-block source weights and of the MTP "
               "layer, the fused layout of transformers' native experts); loading (modelopt_ext.from_pretrained, also "
               "with ep_size), calibration (also under EP) and `modelopt-ext plan` work, and the recipes and the "
               "serving facts exist")


def quantizer_exclusions(config) -> tuple[str, ...]:
    """Quantizer-name globs that stay unquantized under every recipe (the same for every config): the router
    (`mlp.gate`: its weight and correction bias, float32 in transformers), every norm (the layer norms, MLA's
    `q_a_layernorm` / `kv_a_layernorm`, the final norm), the embeddings and lm_head. `*.mlp.gate.*` does not
    match the MLPs' `gate_proj`."""
    return ("*.mlp.gate.*", "*e_score_correction_bias*", "*norm*", "*embed_tokens*", "*lm_head*")


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
        ),
        ptq_refused=PTQ_REFUSED,
        router_ids=lambda output: output[2],  # DeepseekV3TopkRouter returns (logits, topk weights, topk ids)
    )
)

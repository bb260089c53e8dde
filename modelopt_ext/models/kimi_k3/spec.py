"""The Kimi-K3 family spec: pinned revision, remote-code lock, EP plan, exclusions, floors, converters, sizes."""

from __future__ import annotations

from collections.abc import Mapping

from modelopt_ext.families import FamilySpec, PredictionSpec, ServingSpec, register_family

from . import engine_rules, prediction, serving
from .config_check import check_config
from .convert import expert_converters
from .pinned import EP_PLAN, LAYERS, LOCK_FILE, MIN_VERSIONS, REVISION
from .sizes import BUNDLED_CONFIG, plan_sizes


def quantizer_exclusions(config) -> tuple[str, ...]:
    """Quantizer-name globs that stay unquantized under every recipe (the same for every config).

    - what no serving engine quantizes (models/kimi_k3/serving.py): the router, the latent projections
      `routed_expert_{down,up}_proj`, the AttnRes projections, the KDA convolutions, vision tower, projector;
    - KDA's decay-gate up projection `f_b_proj` (no engine fuses it; 1.6 M parameters a layer at full size) and
      the decay parameters, every norm, lm_head and the embeddings.

    KDA's other projections (q/k/v/g/f_a/b) form one fused group in the engines and are left to the recipe,
    which must treat them alike (checked in validate: quant/fused_groups.py).
    """
    return (
        "*block_sparse_moe.gate*",
        "*block_sparse_moe.routed_expert_*_proj*",
        "*self_attn.f_b_proj*",
        "*conv1d*",
        "*A_log*",
        "*dt_bias*",
        "*_res_norm*",
        "*_res_proj*",
        "*output_attn_res*",
        "*norm*",
        "*vision_tower*",
        "*mm_projector*",
        "*lm_head*",
        "*embed_tokens*",
    )


def _prepare(path, **kwargs):
    from . import adapter

    return adapter.prepare_load(path, **kwargs)


def _forward(path, dtype_name: str = "bfloat16") -> list[str]:
    from .standin.smoke import run_forwards

    return run_forwards(path, dtype_name)


def _make_tiny(out_dir, seed: int = 0, sizes=None, **kwargs):
    """The family's stand-in generator; `sizes` a TinySizes or a mapping of overrides of its fields."""
    import dataclasses

    from .standin.generate import TinySizes, make_tiny

    if isinstance(sizes, Mapping):
        fields = [f.name for f in dataclasses.fields(TinySizes)]
        unknown = sorted(set(sizes) - set(fields))
        if unknown:
            raise ValueError(f"kimi_k3 stand-in: no size {', '.join(unknown)} (it has {', '.join(fields)})")
        sizes = TinySizes(**sizes)
    return make_tiny(out_dir, seed, TinySizes() if sizes is None else sizes, **kwargs)


KIMI_K3 = register_family(
    FamilySpec(
        name="kimi_k3",
        model_types=("kimi_k3",),
        text_model_type="kimi_linear",
        revision=REVISION,
        remote_code_lock=LOCK_FILE,
        min_versions=MIN_VERSIONS,
        ep_plan=EP_PLAN,
        quantizer_exclusions=quantizer_exclusions,
        converters=expert_converters,
        prepare=_prepare,
        make_tiny=_make_tiny,
        forward=_forward,
        router_glob=f"{LAYERS}.block_sparse_moe.gate",
        sizes=plan_sizes,
        bundled_configs={"kimi-k3": BUNDLED_CONFIG},
        default_recipe="kimi_k3/nvfp4_experts-fp8_attention",
        export_expert_names={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
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
        prediction=PredictionSpec(
            measurement=prediction.MEASUREMENT,
            layer_kinds=prediction.layer_kinds,
            dense_export_bytes=prediction.dense_export_bytes,
        ),
    )
)

"""The Kimi-K3 family spec: pinned revision, remote-code lock, EP plan, exclusions, floors, converters, sizes."""

from __future__ import annotations

from pathlib import Path

from modelopt_ext.families import FamilySpec, register_family

from .config_check import check_config
from .convert import expert_converters
from .sizes import BUNDLED_CONFIG, plan_sizes

# Moonshot's pinned revision of Kimi-K3. The bundled lock records the stand-in's remote-code files,
# which are this project's faithful re-implementation of that revision (see docs/standin.md).
REVISION = "9f62e4e9fffbd0a83ddd60e1c209d828994b3569"
LOCK_FILE = Path(__file__).with_name("remote_code.lock.json")

_LAYERS = "language_model.model.layers.*"
EXPERTS_GLOB = _EXPERTS = f"{_LAYERS}.block_sparse_moe.experts"
# Expert parallelism as data: the experts module dispatches tokens, its fused tensors (dense or MXFP4
# packed + scales) are sharded along the expert dimension.
EP_PLAN = {
    _EXPERTS: "ep_dispatch_experts",
    **{f"{_EXPERTS}.{name}": "grouped_gemm" for name in (
        "gate_up_proj", "down_proj", "gate_up_proj_packed", "gate_up_proj_scale", "down_proj_packed",
        "down_proj_scale",
    )},
}


def quantizer_exclusions(config) -> tuple[str, ...]:
    """Quantizer-name globs that stay unquantized: routers, KDA gates/conv/decay, AttnRes, norms, vision.

    KDA's `g_proj` (output gate) is excluded only in KDA layers; MLA layers keep theirs quantizable, as
    they keep `o_proj` in every layer.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kda_layers = [i for i in range(text.num_hidden_layers) if text.is_kda_layer(i)]
    patterns = [
        "*block_sparse_moe.gate*",
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
    ]
    for leaf in ("f_a_proj", "f_b_proj", "b_proj", "g_proj"):
        patterns += layer_globs(kda_layers, f"self_attn.{leaf}")
    return tuple(patterns)


def layer_globs(layers: list[int], suffix: str) -> list[str]:
    """fnmatch globs that together match exactly the names `*layers.{i}.{suffix}*` for i in `layers`: ids
    sharing all but their last digit in one glob, the last digit as a character class (`*layers.1[0245].X*`
    is the union of `*layers.10.X*`, `*layers.12.X*`, ...). One glob per ten layers instead of one per layer:
    ModelOpt matches every entry against every module (docs/calibration.md)."""
    tens: dict[str, list[str]] = {}
    for i in sorted(set(layers)):
        tens.setdefault(str(i)[:-1], []).append(str(i)[-1])
    return [f"*layers.{head}{last[0] if len(last) == 1 else '[' + ''.join(last) + ']'}.{suffix}*"
            for head, last in tens.items()]


def _load(path, **kwargs):
    from .adapter import load

    return load(path, **kwargs)


def _make_tiny(*args, **kwargs):
    from .standin.generate import make_tiny

    return make_tiny(*args, **kwargs)


KIMI_K3 = register_family(
    FamilySpec(
        name="kimi_k3",
        model_types=("kimi_k3",),
        text_model_type="kimi_linear",
        revision=REVISION,
        remote_code_lock=LOCK_FILE,
        min_versions={"transformers": "5.23", "torch": "2.7", "fla-core": "0.5.1"},
        ep_plan=EP_PLAN,
        quantizer_exclusions=quantizer_exclusions,
        converters=expert_converters,
        load=_load,
        make_tiny=_make_tiny,
        router_glob=f"{_LAYERS}.block_sparse_moe.gate",
        sizes=plan_sizes,
        bundled_configs={"kimi-k3": BUNDLED_CONFIG},
        default_recipe="kimi_k3/nvfp4_experts-fp8_attention",
        export_expert_names={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
        check_config=check_config,
    )
)

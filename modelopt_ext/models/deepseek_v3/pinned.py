"""What the DeepSeek-V3 family pins, as data: version floors, module names and the EP plan. Both the spec
(`spec.py`) and the loader (`adapter.py`) read them here, so that registering the family imports neither
transformers' model nor the adapter."""

from __future__ import annotations

# transformers 5.25: the native DeepSeek-V3 model with fused experts and `FineGrainedFP8Config(dequantize=True)`,
# whose `Fp8Dequantize._dequantize_one` `fp8.exact_block_dequantize` replaces (checked there at load)
MIN_VERSIONS = {"transformers": "5.25", "torch": "2.7"}

LAYERS = "model.layers.*"
EXPERTS_GLOB = f"{LAYERS}.mlp.experts"
ROUTER_GLOB = f"{LAYERS}.mlp.gate"
# transformers' DeepseekV3Config.base_model_ep_plan under the causal LM's prefix: the experts module dispatches
# tokens, its fused tensors (bf16 once loaded: the FP8 experts are dequantized) are sharded on the expert dim.
EP_PLAN = {
    EXPERTS_GLOB: "ep_dispatch_experts",
    f"{EXPERTS_GLOB}.gate_up_proj": "grouped_gemm",
    f"{EXPERTS_GLOB}.down_proj": "grouped_gemm",
}
# ModelOpt's per-expert projection names -> the checkpoint's (and the serving engines'): the same words
EXPORT_EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}

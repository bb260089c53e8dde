"""The DeepSeek-V3 warm-up model (`modelopt_ext.warmup`): transformers' `DeepseekV3ForCausalLM` at the checkpoint's
widths with a dense-MLP layer (where the checkpoint has one) and a MoE layer, the routed experts cut to top-k (one
group: the router's group-limited top-k over a single group), and a short vocabulary. Every projection keeps
its shape (MLA, the dense MLP, the shared experts, each routed expert; the router has fewer rows), so the forward
launches the kernels of the real model's first batch.

At DeepSeek-V3's widths it holds 2.3 GiB (`warmup_bytes`), at Kimi-K2's 2.0 GiB (the dense MLP of width 18,432 is
0.8 GiB of it).
"""

from __future__ import annotations

import copy

import torch

from .sizes import BF16, plan_sizes

VOCAB = 4096  # input ids are drawn below it; the embedding and lm_head shrink to it


def _vocab(config) -> int:
    return min(config.vocab_size, VOCAB)


def warmup_config(config):
    """A copy of a `DeepseekV3Config` shrunk as the module doc says (no quantization config: built, not loaded)."""
    cfg = copy.deepcopy(config)
    if cfg.num_experts_per_tok < 1 or cfg.n_routed_experts < cfg.num_experts_per_tok:
        raise ValueError(f"num_experts_per_tok {cfg.num_experts_per_tok} does not fit {cfg.n_routed_experts} experts")
    dense = min(cfg.first_k_dense_replace, 1)
    cfg.num_hidden_layers, cfg.first_k_dense_replace = dense + 1, dense
    cfg.n_routed_experts = max(cfg.num_experts_per_tok, 2)  # the router scores a group by its top two experts
    cfg.n_group = cfg.topk_group = 1
    cfg.vocab_size = _vocab(cfg)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value >= cfg.vocab_size:
            setattr(cfg, name, 0)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    return cfg


def warmup_bytes(config) -> int:
    """Bytes of the warm-up model (the family's size formulas on `warmup_config`, as loaded: bf16)."""
    sizes = plan_sizes(warmup_config(config).to_dict())
    return int(sizes["loaded_dense_bytes"] + sizes["expert_params"] * BF16)


def _keep_fp32(model: torch.nn.Module) -> None:
    """Upcast what `from_pretrained` keeps in fp32 (`_keep_in_fp32_modules_strict`: the router's weight and its
    correction bias, matched as transformers' dtype plan does: a name found anywhere in the tensor's), which
    `_from_config` leaves in the requested dtype."""
    names = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and any(n in name for n in names):
            tensor.data = tensor.data.float()


def build_warmup_model(config, device: torch.device, dtype: torch.dtype,
                       experts_implementation: str | None = None) -> torch.nn.Module:
    """The warm-up model on `device` (initialised there, with the global RNG state left as it was)."""
    from transformers import DeepseekV3ForCausalLM

    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        model = DeepseekV3ForCausalLM._from_config(warmup_config(config), dtype=dtype, **kwargs)
    _keep_fp32(model)
    return model.eval()


def warmup_input_ids(config, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[batch, seq_len] token ids below the warm-up vocabulary, the same on every call."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, _vocab(config), (batch, seq_len), generator=generator).to(device)

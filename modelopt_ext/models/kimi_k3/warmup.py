"""The Kimi-K3 warm-up model (`modelopt_ext.warmup`): the checkpoint's own patched classes at its widths, with
three text layers (a dense-MLP KDA layer, a MoE KDA layer, a MoE MLA layer: every kind the checkpoint has),
top-k routed experts, a short vocabulary and one vision layer. Every weight matrix the calibration multiplies
keeps its shape and dtype, so the forward launches the same kernels (cuBLAS GEMMs, Triton's dequantization,
SiTU-GLU and KDA kernels) as the real model's first batch.

At Kimi-K3's widths it holds 4.9 GiB (`warmup_bytes`; the dense MLP of width 33,792 is 1.4 GiB), plus its
forward's transients (the top-k experts dequantized, one calibration batch's activations) for the length of
the load.
"""

from __future__ import annotations

import copy

import torch

from .patch import expert_storage
from .sizes import plan_sizes

VOCAB = 4096  # input ids are drawn below it; the embedding and lm_head shrink to it


def _vocab(text_config) -> int:
    return min(text_config.vocab_size, VOCAB)


def warmup_config(config):
    """A copy of a `KimiK3Config` shrunk as the module doc says; raises ValueError if it has no MoE layer kind
    to keep (fewer than one routed expert per token)."""
    cfg = copy.deepcopy(config)
    text = cfg.text_config
    if text.num_experts_per_token < 1 or text.num_experts < text.num_experts_per_token:
        raise ValueError(f"num_experts_per_token {text.num_experts_per_token} does not fit {text.num_experts} experts")
    dense = min(text.first_k_dense_replace, 1)
    n = text.num_hidden_layers = dense + 2  # [a dense-MLP layer,] then MoE layers: KDA, MLA (the last)
    text.first_k_dense_replace = dense
    text.moe_layer_freq = 1
    text.num_experts = text.num_experts_per_token
    text.vocab_size = _vocab(text)
    text.attn_res_block_size = min(text.attn_res_block_size, 2)  # a block boundary inside the three layers
    text.linear_attn_config = dict(text.linear_attn_config, full_attn_layers=[n], kda_layers=list(range(1, n)))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value >= text.vocab_size:
            setattr(text, name, 0)
    if getattr(cfg, "vision_config", None) is not None:
        cfg.vision_config.vt_num_hidden_layers = 1
    return cfg


def warmup_bytes(config) -> int:
    """Bytes of the warm-up model's parameters (the family's exact size formulas on `warmup_config`)."""
    sizes = plan_sizes(warmup_config(config).to_dict())
    return int(sizes["dense_bytes"] + sizes["expert_bytes"])


def _keep_fp32(model: torch.nn.Module) -> None:
    """Upcast what `from_pretrained` keeps in fp32 (`_keep_in_fp32_modules_strict`, matched as transformers'
    dtype plan does: a name found anywhere in the parameter's; KDA's A_log, dt_bias and short convolutions,
    the router's correction bias), which `_from_config` leaves in the requested dtype."""
    names = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    for name, param in model.named_parameters():
        if param.is_floating_point() and any(n in name for n in names):
            param.data = param.data.float()


def build_warmup_model(model_class, config, *, storage: str, device: torch.device, dtype: torch.dtype,
                       experts_implementation: str | None = None) -> torch.nn.Module:
    """The warm-up model on `device` (initialised there, with the global RNG state left as it was)."""
    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device), expert_storage(storage):
        model = model_class._from_config(warmup_config(config), dtype=dtype, **kwargs)
    _keep_fp32(model)
    return model.eval()


def warmup_input_ids(config, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[batch, seq_len] token ids below the warm-up vocabulary, the same on every call."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, _vocab(config.text_config), (batch, seq_len), generator=generator).to(device)

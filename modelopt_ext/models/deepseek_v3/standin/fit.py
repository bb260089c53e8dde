"""Fit the DeepSeek-V3 stand-in's random weights to the embedded corpus (`make_tiny(..., fit_steps=N)`).

The fit every stand-in shares (`modelopt_ext.standin.fit`: data, settings, schedule, training loop): next-token
cross-entropy on `corpus.txt` tokenized with the stand-in's tokenizer and packed into blocks as calibration packs
it, AdamW, fp32 on the CPU, one thread, the data order seeded by `seed`. The model is transformers' own
`DeepseekV3ForCausalLM` in fp32 (differentiable as it is: its experts and router take gradients; the correction bias
is a buffer and keeps its random values). The checkpoint's per-expert tensors go in as the model's fused
`gate_up_proj` / `down_proj` and come back out the same way. The MTP layer is not part of that model: its decoder
block keeps its random values and its embeddings and head are copied again from the fitted main ones, as the real
checkpoint's are copies. The same (seed, steps, sizes) gives the same values.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from modelopt_ext.standin.fit import FitResult, FitSettings, corpus_blocks, mean_loss, single_thread, train

from .. import layout as L

logger = logging.getLogger(__name__)


def model_config(config: Mapping[str, Any]):
    """transformers' DeepseekV3Config for a config.json mapping, without its quantization_config (fp32 model)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{k: v for k, v in config.items() if k != "quantization_config"})


def to_model_state(config: Mapping[str, Any], values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint values (per-expert keys, MTP layers) -> the state dict of transformers' model (fused experts:
    `gate_up_proj[e]` = gate rows then up rows, `down_proj[e]`; no MTP keys)."""
    d = L.Dims.of(config)
    state = {k: v for k, v in values.items() if not _is_mtp_or_expert(k, d)}
    for i in range(d.first_dense, d.layers):
        p = f"model.layers.{i}.mlp.experts."
        state[p + "gate_up_proj"] = torch.stack([
            torch.cat([values[f"{p}{e}.gate_proj.weight"], values[f"{p}{e}.up_proj.weight"]])
            for e in range(d.experts)])
        state[p + "down_proj"] = torch.stack([values[f"{p}{e}.down_proj.weight"] for e in range(d.experts)])
    return state


def from_model_state(config: Mapping[str, Any], state: Mapping[str, torch.Tensor],
                     values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `to_model_state` over `values`' keys: MTP tensors kept, except the embeddings and head
    copies, taken from the main ones."""
    d = L.Dims.of(config)
    out = {}
    for key, old in values.items():
        parts = key.split(".")
        layer = int(parts[2]) if key.startswith("model.layers.") else None
        if layer is not None and layer >= d.layers:
            suffix = ".".join(parts[3:])
            source = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
            out[key] = state[source[suffix]].detach().float().clone() if suffix in source else old.clone()
        elif ".mlp.experts." in key:
            e, proj = int(parts[5]), parts[6]
            fused = state[".".join(parts[:5]) + (".down_proj" if proj == "down_proj" else ".gate_up_proj")]
            I = d.expert_intermediate
            rows = {"gate_proj": slice(0, I), "up_proj": slice(I, 2 * I), "down_proj": slice(None)}[proj]
            out[key] = fused[e][rows].detach().float().clone()
        else:
            out[key] = state[key].detach().float().clone()
    return out


def _is_mtp_or_expert(key: str, d: L.Dims) -> bool:
    if not key.startswith("model.layers."):
        return False
    return int(key.split(".")[2]) >= d.layers or ".mlp.experts." in key


def _loss(model, ids_BS: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids_BS, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids_BS[:, 1:].reshape(-1))


def fit_values(config: Mapping[str, Any], values: Mapping[str, torch.Tensor], tokenizer_dir: str | Path,
               steps: int, seed: int, settings: FitSettings = FitSettings()) -> FitResult:
    """Train the model with the checkpoint values `values` (fp32) for `steps` AdamW steps of next-token loss on
    the embedded corpus; returns new values for every key of `values` and the mean corpus loss before and
    after. `values` itself is not modified."""
    from transformers import DeepseekV3ForCausalLM

    if steps < 0:
        raise ValueError(f"fit steps must be at least 0, got {steps}")
    start = time.perf_counter()
    with single_thread():
        torch.manual_seed(seed)
        cfg = model_config(config)
        cfg._attn_implementation = "eager"
        model = DeepseekV3ForCausalLM(cfg).float().eval()  # eval: no dropout; gradients still flow
        state = to_model_state(config, values)
        model.load_state_dict({k: v.clone() for k, v in state.items()}, strict=False)
        missing = set(model.state_dict()) - set(state)
        if missing:
            raise AssertionError(f"stand-in values miss model tensors {sorted(missing)[:5]}")
        blocks = corpus_blocks(tokenizer_dir, settings.seq_len)
        params = [p for p in model.parameters() if p.requires_grad]
        loss_before = mean_loss(_loss, model, blocks, settings.eval_batch_size)
        train(model, params, blocks, _loss, steps, seed, settings)
        loss_after = mean_loss(_loss, model, blocks, settings.eval_batch_size)
        fitted = from_model_state(config, model.state_dict(), values)
    seconds = time.perf_counter() - start
    logger.info("fit: loss %.4f -> %.4f after %d steps, %.1f s", loss_before, loss_after, steps, seconds)
    return FitResult(values=fitted, loss_before=loss_before, loss_after=loss_after, seconds=seconds)

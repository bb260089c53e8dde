"""Load a Kimi-K3 checkpoint folder with plain transformers (no adapter) and run text and text+image
forwards: the stand-in's smoke test and the first README command until the main job exists."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

from modelopt_ext.families import read_config
from modelopt_ext.lock import check_remote_code, load_lock
from modelopt_ext.models.kimi_k3.pinned import LOCK_FILE

from .inputs import synthetic_image, text_image_inputs

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PROMPT = "Describe the picture in one short sentence."


def unquantized_modules(model_dir: str, ignore: list[str]) -> list[str]:
    """Modules the checkpoint stores as plain `.weight` that `ignore` does not name.

    The real Kimi-K3 quantization config targets every Linear but ignores neither the latent projections
    (`routed_expert_{down,up}_proj`) nor the AttnRes `*_res_proj`, which are stored in bf16: compressed-tensors
    then expects `weight_packed` for them and leaves them uninitialised (docs/standin.md).
    """
    weight_map = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())["weight_map"]
    patterns = [re.compile(i[3:]) for i in ignore if i.startswith("re:")]
    return sorted(
        key[: -len(".weight")] for key in weight_map
        if key.endswith(".weight") and key not in ignore and not any(p.match(key[: -len(".weight")]) for p in patterns)
    )


def load_unpatched(model_dir: str, dtype: torch.dtype):
    """The checkpoint's own remote code, as transformers loads it, with the bf16 modules the checkpoint's
    ignore list misses added to it. compressed-tensors decompresses MXFP4 experts to bf16 on first use unless
    asked to dequantize at load, which fp32 needs."""
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
    qc = dict(config.quantization_config)
    qc["ignore"] = list(qc.get("ignore") or []) + unquantized_modules(model_dir, list(qc.get("ignore") or []))
    config.quantization_config = qc
    kwargs = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dtype == torch.float32 else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, trust_remote_code=True, dtype=dtype,
                                                 **kwargs)
    return model.eval()


def run_forwards(model_dir: str, dtype_name: str = "bfloat16") -> list[str]:
    """Returns one summary line per forward; raises if any logits are not finite."""
    read_config(model_dir)  # clear errors for a missing folder or config.json
    check_remote_code(Path(model_dir), load_lock(LOCK_FILE))  # the remote code runs below: only the pinned one
    start = time.perf_counter()
    model = load_unpatched(model_dir, DTYPES[dtype_name])
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    lines = [f"loaded {type(model).__name__} from {model_dir} in {time.perf_counter() - start:.1f}s ({dtype_name})"]
    image = synthetic_image(56, 84)
    cases = {
        "text": {"input_ids": torch.tensor([tokenizer.encode(PROMPT)])},
        "text+image": text_image_inputs(tokenizer, model.config, PROMPT, image),
    }
    for name, inputs in cases.items():
        with torch.no_grad():
            logits = model(**inputs, use_cache=False).logits
        if not torch.isfinite(logits).all():
            raise RuntimeError(f"{name} forward produced non-finite logits")
        top = tokenizer.decode(logits[0, -1].argmax().item())
        lines.append(
            f"{name}: input_ids {tuple(inputs['input_ids'].shape)} -> logits {tuple(logits.shape)} "
            f"finite, mean {logits.float().mean():.4f} std {logits.float().std():.4f}, next token {top!r}"
        )
    return lines

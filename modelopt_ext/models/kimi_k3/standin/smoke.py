"""Load a Kimi-K3 checkpoint folder with plain transformers (no adapter) and run text and text+image
forwards: the stand-in's smoke test and the first README command until the main job exists."""

from __future__ import annotations

import logging
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

from modelopt_ext.families import read_config

from .inputs import synthetic_image, text_image_inputs

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PROMPT = "Describe the picture in one short sentence."


def load_unpatched(model_dir: str, dtype: torch.dtype):
    """The checkpoint's own remote code, as transformers loads it. compressed-tensors decompresses MXFP4
    experts to bf16 on first use unless asked to dequantize at load, which fp32 needs."""
    kwargs = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dtype == torch.float32 else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=dtype, **kwargs)
    return model.eval()


def run_forwards(model_dir: str, dtype_name: str = "bfloat16") -> list[str]:
    """Returns one summary line per forward; raises if any logits are not finite."""
    read_config(model_dir)  # clear errors for a missing folder or config.json
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

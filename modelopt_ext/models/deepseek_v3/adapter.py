"""DeepSeek-V3 adapter: validate a checkpoint and say how the generic loader (`modelopt_ext.loader`) loads it with
transformers' native `DeepseekV3ForCausalLM` (`prepare_load`, the family's hook). No remote code runs: the
checkpoints' `auto_map` (DeepSeek's `modeling_deepseek.py`) is never imported, and nothing is patched.

How the load differs from a plain `from_pretrained`:
- the config is `DeepseekV3Config` built from config.json's mapping (not `AutoConfig`, which wants Kimi-K2's
  remote code for model_type `kimi_k2`); it keeps the checkpoint's model_type;
- an FP8 checkpoint is loaded with `FineGrainedFP8Config(dequantize=True)` (ModelOpt then sees bf16 `nn.Linear`s
  and fused bf16 experts, on the CPU and on GPUs alike), inside `formats.fp8_block.exact_block_dequantize()`
  (transformers 5.25 mis-scales partial 128x128 blocks there), with `use_kernels=False` unless the caller says otherwise
  (transformers would fetch hub kernels for the RMSNorm on CUDA; there is no network);
- for model_type `kimi_k2`, which transformers' conversion mapping does not know, transformers' `deepseek_v3`
  mapping (the per-expert tensors merged into `gate_up_proj` / `down_proj`) is registered for the load only
  (without it the experts would be left unloaded: the strict check would refuse the load);
- FSDP-sharded dense layers of an FP8 checkpoint load exactly: in the same scope each rank gets the scales of the
  rows its weight shard holds (transformers 5.25 would cut the scale grid by the weight's placement; see
  `formats/fp8_block.py`);
- the multi-token-prediction layers (`model.layers.{num_hidden_layers}...`), which transformers does not build,
  are declared as knowingly unread (`PreparedLoad.ignored_unexpected`); any other unexpected key is refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from modelopt_ext.families import read_config
from modelopt_ext.formats.fp8_block import exact_block_dequantize
from modelopt_ext.loader import CheckpointError, PreparedLoad, WarmupHooks
from modelopt_ext.versions import check_min_versions

from .config_check import check_config
from .pinned import EP_PLAN, EXPERTS_GLOB, MIN_VERSIONS
from .warmup import build_warmup_model, warmup_bytes, warmup_input_ids

logger = logging.getLogger(__name__)

NATIVE_MODEL_TYPE = "deepseek_v3"  # the model type transformers' conversion mapping knows
# Keyword arguments the adapter decides itself.
RESERVED_KWARGS = ("config", "quantization_config", "output_loading_info")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
__all__ = ["CheckpointError", "expert_converters", "expert_storage_of", "mtp_key_patterns", "prepare_load"]


def expert_storage_of(config: dict[str, Any]) -> str:
    """"fp8" for the 128x128-block FP8 checkpoints (the only quantization_config `check_config` accepts), else
    "dense" (bf16, e.g. the output of DeepSeek's fp8_cast_bf16.py)."""
    return "fp8" if config.get("quantization_config") is not None else "dense"


def expert_converters(storage: str = "fp8") -> list:
    """transformers' own conversions of the `deepseek_v3` model type (the per-expert `{gate,up,down}_proj` tensors
    <-> the fused `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I]); transformers' FP8 quantizer adds the scales
    to them itself. The same for both storages."""
    if storage not in ("fp8", "dense"):
        raise ValueError(f"deepseek_v3 expert storage {storage!r} is not one of ['dense', 'fp8']")
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    converters = get_checkpoint_conversion_mapping(NATIVE_MODEL_TYPE)
    if not converters:
        raise CheckpointError(f"transformers has no conversion mapping for model_type {NATIVE_MODEL_TYPE!r}")
    return converters


def mtp_key_patterns(config: dict[str, Any]) -> tuple[str, ...]:
    """`re.match` patterns of the multi-token-prediction layers' keys (`model.layers.{n}.` for the
    `num_nextn_predict_layers` indices after the `num_hidden_layers` decoder layers)."""
    n, mtp = config["num_hidden_layers"], int(config.get("num_nextn_predict_layers") or 0)
    return tuple(rf"model\.layers\.{i}\." for i in range(n, n + mtp))


def _check_call(path: Path, kwargs: dict[str, Any], remote_code_lock) -> None:
    if remote_code_lock is not None:
        raise CheckpointError(f"remote_code_lock {remote_code_lock}: family 'deepseek_v3' loads {path} with "
                              "transformers' own classes and runs no remote code; there is no lock to check")
    reserved = [k for k in RESERVED_KWARGS if k in kwargs]
    if reserved:
        raise CheckpointError(f"from_pretrained arguments {reserved} are set by modelopt_ext and cannot be passed")


@contextlib.contextmanager
def _conversion_scope(model_type: str):
    """Exact FP8 block dequantization, and transformers' deepseek_v3 conversions under `model_type` when it is
    another (Kimi-K2's), registered for the load only."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(exact_block_dequantize())
        if model_type != NATIVE_MODEL_TYPE:
            from modelopt_ext.conversion import scoped_conversion_mapping

            stack.enter_context(scoped_conversion_mapping(model_type, expert_converters()))
        yield


def _check_loaded(model: torch.nn.Module) -> None:
    """Every FP8 weight was dequantized (a kept FP8 tensor would mean transformers took another path)."""
    kept = [n for n, p in model.named_parameters() if p.dtype in FP8_DTYPES]
    if kept:
        raise CheckpointError(f"{len(kept)} parameters stayed FP8 after a dequantizing load (first: {kept[0]})")


def prepare_load(path: str | Path, *, remote_code_lock: str | Path | None = None, trust_remote_code=None,
                 **kwargs) -> PreparedLoad:
    """The family's hook for `modelopt_ext.loader.load`: every check (call, config.json, versions), then how to
    configure, load, convert, warm up and check. Mutates nothing.

    `trust_remote_code` is accepted and unused (no remote code runs); `remote_code_lock` is refused (there is no
    remote code to lock). Other keyword arguments are transformers' `from_pretrained` ones.
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, FineGrainedFP8Config

    path = Path(path)
    config = read_config(path)
    _check_call(path, kwargs, remote_code_lock)
    source = str(path / "config.json")
    try:
        check_config(config, source)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    check_min_versions(MIN_VERSIONS)
    storage = expert_storage_of(config)
    model_type = config["model_type"]
    load_kwargs: dict[str, Any] = {}
    if storage == "fp8":
        load_kwargs["quantization_config"] = FineGrainedFP8Config(dequantize=True)
    if "use_kernels" not in kwargs:
        load_kwargs["use_kernels"] = False
    config_json = json.loads(json.dumps(config))  # its own copy

    def make_config():
        return DeepseekV3Config.from_dict(config_json)

    return PreparedLoad(
        path=path,
        model_class=DeepseekV3ForCausalLM,
        ep_plan=EP_PLAN,
        patch=lambda: None,
        make_config=make_config,
        conversion_scope=lambda: _conversion_scope(model_type),
        counted_reads=(EXPERTS_GLOB,),
        warmup=WarmupHooks(build=build_warmup_model, input_ids=warmup_input_ids, nbytes=warmup_bytes),
        check_loaded=_check_loaded,
        quantization_config=None,  # the model holds bf16: the source's FP8 config describes no loaded tensor
        description=("FP8 128x128-block checkpoint dequantized exactly" if storage == "fp8" else "bf16 checkpoint")
        + f", model_type {model_type}",
        family_options=("remote_code_lock", "trust_remote_code"),
        load_kwargs=load_kwargs,
        ignored_unexpected=mtp_key_patterns(config),
        remote_code=False,
    )

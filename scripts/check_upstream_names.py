#!/usr/bin/env python
"""Check stored tensor names against the public upstream Kimi-K3 modeling code.

    python scripts/check_upstream_names.py --upstream DIR --checkpoint CKPT   # a stand-in checkpoint
    python scripts/check_upstream_names.py --upstream DIR --real [--config CONFIG_JSON]

DIR holds the upstream remote code (configuration_kimi_k3.py, modeling_kimi_linear.py, modeling_kimi_k3.py;
the copy bundled by llm-compressor under src/llmcompressor/modeling/kimi_k3/). The script copies those
three files into a temporary package `kimi_k3_upstream` (they import each other relatively), builds
`KimiK3ForConditionalGeneration` on the meta device from a config.json, and turns its state dict into
the tensors a checkpoint stores:

- routed expert Linears `...block_sparse_moe.experts.{e}.w{1,2,3}.weight` [out, in] become
  `weight_packed` [out, in/2] uint8 and `weight_scale` [out, in/group] uint8 (MXFP4, group from the
  config's quantization_config, default 32);
- non-persistent buffers are left out (the state dict has none of them);
- storage rule (documented upstream quirk, see docs/standin.md): the KDA module declares `A_log` as
  [num_heads], the checkpoint stores it zero-padded to [head_dim]; `--strict` turns the rule off;
- dtypes: uint8 for the packed experts; float32 for `A_log`, `dt_bias`, the `{q,k,v}_conv1d` weights, the
  KDA `o_norm` weight and the router `e_score_correction_bias` (the real checkpoint's float32 tensors);
  bfloat16 for everything else. The upstream code itself fixes names and shapes, not stored dtypes.

With `--checkpoint` the expectation is compared with the checkpoint's safetensors index and shard headers;
with `--real` (config: `--config`, else `modelopt_ext/models/kimi_k3/kimi_k3_config.json` once that is the
raw public config.json) it is compared with `expected_tensors(load_real_inventory())`. It also reports, as
notes that do not change the exit status, the Linears the config's own `quantization_config` would treat
differently from that storage (compressed-tensors matching of targets and ignore list).

The upstream code needs fla (triton, GPU only) and llmcompressor; the script puts stub modules for exactly
the names it imports into sys.modules first (listed in the report). Exit status: 0 when expected and
stored tensors agree, 1 on any difference, 2 on a usage or input error.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from modelopt_ext.models.kimi_k3 import inventory as inv  # noqa: E402

UPSTREAM_FILES = ("configuration_kimi_k3.py", "modeling_kimi_linear.py", "modeling_kimi_k3.py")
PACKAGE = "kimi_k3_upstream"
BUNDLED_CONFIG = REPO / "modelopt_ext" / "models" / "kimi_k3" / "kimi_k3_config.json"
EXPERT_WEIGHT = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
FP32_STORED = re.compile(
    r"(\.self_attn\.A_log|\.self_attn\.dt_bias|\.self_attn\.[qkv]_conv1d\.weight|\.self_attn\.o_norm\.weight"
    r"|\.gate\.e_score_correction_bias)$"
)
A_LOG = re.compile(r"\.self_attn\.A_log$")
# The llm-compressor copy at b6dd6de8 does not compile: in KimiSparseMoeBlock.forward the original
# `if not self.training:` was left above its replacement `if False:#if not self.training:` with no body
# (IndentationError). The dangling line is dropped, only when the file does not compile as it is.
DANGLING_IF = re.compile(r"^([ \t]*)if not self\.training:\n(\1if False:#if not self\.training:\n)", re.MULTILINE)

STUBBED: list[str] = []
PATCHED: list[str] = []


# ----------------------------------------------------------------------------------------------- stubs
class ShortConvolutionStub(nn.Conv1d):
    """fla.modules.ShortConvolution's parameters: a depthwise causal Conv1d, weight [hidden, 1, kernel]."""

    def __init__(self, hidden_size, kernel_size, bias=False, activation="silu", backend="triton",
                 device=None, dtype=None, **kwargs):
        super().__init__(hidden_size, hidden_size, kernel_size, padding=kernel_size - 1, groups=hidden_size,
                         bias=bias, device=device, dtype=dtype)
        self.hidden_size, self.activation = hidden_size, activation


class FusedRMSNormGatedStub(nn.Module):
    """fla.modules.FusedRMSNormGated's parameters: `weight` [hidden] (no bias)."""

    def __init__(self, hidden_size, elementwise_affine=True, eps=1e-5, activation="swish", device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.eps, self.activation = hidden_size, eps, activation
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.register_parameter("bias", None)


def _kernel_stub(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"{name} is a stub of check_upstream_names.py: no kernels run here")

    kernel.__name__ = name
    return kernel


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__path__ = []  # importable as a package, so submodules resolve through sys.modules
    sys.modules[name] = module
    STUBBED.append(f"{name}: {', '.join(sorted(attrs)) or '(package)'}")
    return module


def install_stubs() -> None:
    """Stub modules for the fla and llmcompressor names the upstream files import (and nothing else)."""
    _module("fla")
    _module("fla.modules", FusedRMSNormGated=FusedRMSNormGatedStub, ShortConvolution=ShortConvolutionStub)
    _module("fla.ops")
    _module("fla.ops.kda", chunk_kda=_kernel_stub("chunk_kda"), fused_recurrent_kda=_kernel_stub("fused_recurrent_kda"))
    _module("fla.ops.utils")
    _module("fla.ops.utils.index", prepare_cu_seqlens_from_mask=_kernel_stub("prepare_cu_seqlens_from_mask"),
            prepare_lens_from_mask=_kernel_stub("prepare_lens_from_mask"))
    _module("fla.utils", tensor_cache=lambda fn: fn)
    _module("llmcompressor")
    _module("llmcompressor.modeling")
    _module("llmcompressor.modeling.moe")
    _module("llmcompressor.modeling.moe.context", get_calibrate_all_experts_flag=lambda: False)


def _compilable(source: str, fname: str) -> str:
    """`source`, or with the known dangling `if` line dropped when it does not compile as it is."""
    try:
        compile(source, fname, "exec")
        return source
    except SyntaxError as error:
        first_error = f"{error.msg} (line {error.lineno})"
    match = DANGLING_IF.search(source)
    if match is None:
        raise SyntaxError(f"upstream {fname} does not compile: {first_error}")
    line = source.count("\n", 0, match.start()) + 1
    source = DANGLING_IF.sub(r"\2", source, count=1)
    compile(source, fname, "exec")
    PATCHED.append(f"{fname}: {first_error}; dropped the dangling `if not self.training:` at line {line} "
                   "(KimiSparseMoeBlock.forward, never run here)")
    return source


def import_upstream(upstream: Path, workdir: Path):
    """(configuration module, modeling module) of the upstream files, imported as package `kimi_k3_upstream`."""
    package_dir = workdir / PACKAGE
    package_dir.mkdir()
    for fname in UPSTREAM_FILES:
        src = upstream / fname
        if not src.is_file():
            raise FileNotFoundError(f"--upstream {upstream}: no {fname}")
        (package_dir / fname).write_text(_compilable(src.read_text(), fname))
    (package_dir / "__init__.py").write_text("")
    sys.path.insert(0, str(workdir))
    import importlib

    configuration = importlib.import_module(f"{PACKAGE}.configuration_kimi_k3")
    modeling = importlib.import_module(f"{PACKAGE}.modeling_kimi_k3")
    return configuration, modeling


# ------------------------------------------------------------------------------------------ expectation
def build_upstream(configuration, modeling, config_dict: dict):
    """The upstream model on the meta device, and its config object. Built as from_pretrained builds an
    empty model (torch init functions skipped: they fix values, not names or shapes), about 2x faster."""
    from transformers.initialization import no_init_weights

    config = configuration.KimiK3Config(**config_dict)
    with torch.device("meta"), no_init_weights():
        model = modeling.KimiK3ForConditionalGeneration(config)
    return model, config


def _group_size(config_dict: dict) -> int:
    qc = config_dict.get("quantization_config") or config_dict.get("text_config", {}).get("quantization_config") or {}
    for group in (qc.get("config_groups") or {}).values():
        size = (group.get("weights") or {}).get("group_size")
        if size:
            return int(size)
    return 32


def stored_tensors(model, config, config_dict: dict, strict: bool) -> tuple[inv.TensorMap, list[str]]:
    """The tensors a checkpoint of `model` stores, and the storage rules that changed a shape."""
    group = _group_size(config_dict)
    text = config.text_config
    heads, head_dim = text.linear_attn_config["num_heads"], text.linear_attn_config["head_dim"]
    out: inv.TensorMap = {}
    rules: list[str] = []
    for name, tensor in model.state_dict().items():
        shape = tuple(tensor.shape)
        if EXPERT_WEIGHT.search(name):
            rows, cols = shape
            stem = name[: -len("weight")]
            out[stem + "weight_packed"] = ((rows, cols // 2), "uint8")
            out[stem + "weight_scale"] = ((rows, cols // group), "uint8")
            continue
        if A_LOG.search(name) and not strict and shape == (heads,) and head_dim > heads:
            if not rules:
                rules.append(f"A_log: upstream declares [{heads}] (num_heads), stored padded to [{head_dim}] "
                             "(head_dim)")
            shape = (head_dim,)
        out[name] = (shape, "float32" if FP32_STORED.search(name) else "bfloat16")
    return out, rules


def quantization_notes(model, config_dict: dict) -> list[str]:
    """Linears that the config's quantization_config quantizes (compressed-tensors matching) but the
    storage above keeps bf16, and routed experts it would leave unquantized."""
    qc = config_dict.get("quantization_config") or config_dict.get("text_config", {}).get("quantization_config")
    if not qc:
        return ["config has no quantization_config"]
    try:
        from compressed_tensors.utils.match import is_match
    except ImportError:
        return ["compressed_tensors is not installed: quantization_config not checked"]
    targets = [t for g in qc.get("config_groups", {}).values() for t in g.get("targets", [])]
    ignore = qc.get("ignore", [])
    quantized_bf16, unquantized_experts = [], []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        matched = is_match(name, module, targets, ignore)
        is_expert = EXPERT_WEIGHT.search(name + ".weight") is not None
        if matched and not is_expert:
            quantized_bf16.append(name)
        elif is_expert and not matched:
            unquantized_experts.append(name)
    notes = []
    for label, names in (("quantized by quantization_config but stored bf16", quantized_bf16),
                         ("routed experts that quantization_config leaves unquantized", unquantized_experts)):
        if names:
            kinds = sorted({re.sub(r"\.\d+\.", ".{i}.", n) for n in names})
            notes.append(f"{len(names)} Linears {label}: " + ", ".join(kinds))
    return notes


def _read_real_config(path: Path | None) -> dict:
    if path is None:
        path = BUNDLED_CONFIG
        config = json.loads(path.read_text())
        if "routed_expert_hidden_size" not in config.get("text_config", {}):
            raise SystemExit(
                f"error: {path} is not the raw public config.json yet (its text_config has no "
                "routed_expert_hidden_size); pass --config PATH"
            )
        return config
    return json.loads(Path(path).read_text())


def _schedule_line(config_dict: dict) -> str:
    s = inv.layer_schedule(config_dict)
    return (f"{s.num_layers} layers: {len(s.kda)} KDA, {len(s.mla)} MLA, {len(s.dense)} dense MLP, {len(s.moe)} MoE "
            f"x {s.num_experts} experts; {s.vision_blocks} vision blocks")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", type=Path, required=True, help="folder with the upstream remote code")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--checkpoint", type=Path, help="checkpoint folder (config.json + safetensors index)")
    mode.add_argument("--real", action="store_true", help="compare with the real checkpoint's inventory table")
    parser.add_argument("--config", type=Path, help="--real: full-size config.json (default: the bundled one)")
    parser.add_argument("--strict", action="store_true", help="apply no storage rule (A_log padding)")
    parser.add_argument("--limit", type=int, default=60, help="most difference lines to print")
    args = parser.parse_args(argv)

    if args.real:
        config_dict = _read_real_config(args.config)
        where = f"real inventory ({inv.INVENTORY_FILE.name}, revision {inv.load_real_inventory()['revision']})"
    else:
        config_path = args.checkpoint / "config.json"
        if not config_path.is_file():
            print(f"error: {args.checkpoint} has no config.json", file=sys.stderr)
            return 2
        config_dict = json.loads(config_path.read_text())
        where = f"checkpoint {args.checkpoint}"

    import transformers

    transformers.logging.set_verbosity_error()  # deprecation and GenerationMixin notices about the upstream code
    warnings.filterwarnings("ignore", category=FutureWarning)
    install_stubs()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kimi_k3_upstream-") as workdir:
        configuration, modeling = import_upstream(args.upstream, Path(workdir))
        model, config = build_upstream(configuration, modeling, config_dict)
    built = time.perf_counter() - start
    expected, rules = stored_tensors(model, config, config_dict, args.strict)
    notes = quantization_notes(model, config_dict)
    if args.real:
        actual = inv.expected_tensors(inv.load_real_inventory(), config_dict)
    else:
        actual = inv.checkpoint_tensors(args.checkpoint)
    problems = inv.compare(expected, actual, limit=args.limit)

    print(f"upstream code: {args.upstream}")
    print(f"compared with: {where}")
    print(f"config: {_schedule_line(config_dict)}")
    print(f"upstream model built on meta in {built:.1f} s: {len(expected)} stored tensors expected, "
          f"{len(actual)} found")
    print("stub modules installed:")
    for line in STUBBED:
        print(f"  {line}")
    print("source patches:" + ("" if PATCHED else " none"))
    for line in PATCHED:
        print(f"  {line}")
    print("storage rules applied:" + ("" if rules else " none"))
    for line in rules:
        print(f"  {line}")
    for line in notes:
        print(f"note: {line}")
    if problems:
        print(f"DIFFERENCES ({len(problems)} lines):")
        for line in problems:
            print(f"  {line}")
        return 1
    print("OK: names, shapes and dtypes agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())

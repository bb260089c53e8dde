"""Time named functions inside one `modelopt-ext` command (the device synchronized around each call), for
locating fixed costs such as ModelOpt's conversion steps; writes {name: [seconds, calls]} as JSON.

    python3 scripts/time_calls.py --json t.json modelopt.torch.quantization.conversion.set_quantizer_by_cfg \
        plugins -- ptq --model CKPT ... --no-warmup

Each name is MODULE.FUNCTION, replaced on its module (callers that look it up there see the timer);
`plugins` times each of ModelOpt's on-the-fly model plugins (they are called from a registry, not by
name). `--warm-forward BxS` runs one forward of the loaded model on random ids of that shape before
calibration, to see what a warmed process leaves in the first batch (docs/performance.md, session 8).
A name that does not resolve fails before the command runs.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import time
from pathlib import Path

from modelopt_ext.profiling import sync_device

TIMES: dict[str, list] = {}


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        sync_device()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sync_device()
            entry = TIMES.setdefault(name, [0.0, 0])
            entry[0] += time.perf_counter() - start
            entry[1] += 1

    return wrapper


def wrap(path: str) -> None:
    if path == "plugins":
        importlib.import_module("modelopt_ext.quant.modelopt_import")  # ModelOpt's import, as modelopt_ext does it
        custom = importlib.import_module("modelopt.torch.quantization.plugins.custom")
        plugins = list(custom.CUSTOM_MODEL_PLUGINS)
        custom.CUSTOM_MODEL_PLUGINS.clear()
        custom.CUSTOM_MODEL_PLUGINS.update(timed(f"plugin.{p.__name__}", p) for p in plugins)
        return
    module_name, _, attribute = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
        fn = getattr(module, attribute)
    except (ImportError, AttributeError, ValueError) as e:
        raise SystemExit(f"time_calls: {path!r} does not resolve: {e}") from None
    setattr(module, attribute, timed(path, fn))


def warm_forward(shape: str) -> None:
    """After `ptq._Run._load`, one no-grad forward of the loaded model on random ids of shape BxS."""
    import torch

    from modelopt_ext import ptq

    try:
        batch, seq_len = (int(v) for v in shape.split("x"))
    except ValueError:
        raise SystemExit(f"time_calls: --warm-forward {shape!r} is not BxS (e.g. 4x2048)") from None
    load = ptq._Run._load

    def _load(self):
        model = load(self)
        vocab = model.config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (batch, seq_len), device=model.device)
        with torch.no_grad():
            timed("warm_forward", lambda: model(input_ids=ids, use_cache=False))()
        return model

    ptq._Run._load = _load


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit("usage: time_calls.py [--json PATH] [--warm-forward BxS] NAME ... -- COMMAND ARGS")
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="time_calls.py")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--warm-forward", default=None, metavar="BxS")
    parser.add_argument("names", nargs="*")
    args = parser.parse_args(argv[:cut])
    for name in args.names:
        wrap(name)
    if args.warm_forward:
        warm_forward(args.warm_forward)
    from modelopt_ext.cli import main as cli_main

    status = cli_main(argv[cut + 1:])
    report = {name: [round(seconds, 4), calls] for name, (seconds, calls) in TIMES.items()}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    else:
        sys.stderr.write(json.dumps(report, indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.path.insert(0, ".")
    raise SystemExit(main(sys.argv[1:]))

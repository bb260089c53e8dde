"""Run the `modelopt-ext` command line with module settings changed first, for A/B measurements in one session.

    torchrun --nproc-per-node 2 scripts/run_with.py modelopt_ext.ep.backend.PIPELINE=False -- ptq --model ...

Each setting is MODULE.ATTRIBUTE=VALUE (VALUE a Python literal: False, 2, 'never'); the attribute must already
exist, so a misspelt setting fails instead of silently changing nothing.
"""

from __future__ import annotations

import ast
import importlib
import sys


def apply(setting: str) -> None:
    target, sep, text = setting.partition("=")
    module_name, _, attribute = target.rpartition(".")
    if not sep or not module_name:
        raise SystemExit(f"run_with: {setting!r} is not MODULE.ATTRIBUTE=VALUE")
    module = importlib.import_module(module_name)
    if not hasattr(module, attribute):
        raise SystemExit(f"run_with: {module_name} has no attribute {attribute!r}")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise SystemExit(f"run_with: {text!r} (for {target}) is not a Python literal") from None
    setattr(module, attribute, value)


def main(argv: list[str]) -> int:
    """Leading MODULE.ATTRIBUTE=VALUE arguments are settings; an optional `--` ends them (launchers such as
    torchrun may drop it); the rest is the command line."""
    cut = 0
    while cut < len(argv) and "=" in argv[cut] and not argv[cut].startswith("-"):
        apply(argv[cut])
        cut += 1
    rest = argv[cut + 1:] if cut < len(argv) and argv[cut] == "--" else argv[cut:]
    if not rest:
        raise SystemExit("usage: run_with.py [MODULE.ATTRIBUTE=VALUE ...] [--] COMMAND ARGS")
    from modelopt_ext.cli import main as cli_main

    return cli_main(rest)


if __name__ == "__main__":
    sys.path.insert(0, ".")
    from modelopt_ext.dist import end_process

    raise SystemExit(end_process(main(sys.argv[1:])))

"""Command-line interface: parses arguments and calls one library entry point per subcommand."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback

from modelopt_ext.export.engine_names import ENGINES as SERVING_ENGINES
from modelopt_ext.families import families

# make-tiny's size flags: passed to the family's generator as overrides of its own defaults (it refuses a size
# it has no such field for, naming the ones it has)
SIZE_FLAGS = {"num_layers": "decoder layers", "hidden_size": "hidden width",
              "latent_size": "routed-expert input width",
              "moe_intermediate_size": "routed-expert width", "num_experts": "routed experts per MoE layer",
              "top_k": "experts per token", "vocab_size": "vocabulary entries"}


def _standin_families() -> list[str]:
    return sorted(name for name, spec in families().items() if spec.make_tiny is not None)


def _add_make_tiny(sub) -> None:
    p = sub.add_parser("make-tiny", help="write a tiny random-weight stand-in checkpoint of a model family")
    p.add_argument("family", choices=_standin_families())
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    for field, text in SIZE_FLAGS.items():
        p.add_argument("--" + field.replace("_", "-"), type=int, default=None, help=f"{text} (default: the family's)")
    p.add_argument("--force", action="store_true", help="replace the contents of a non-empty OUT_DIR")
    p.add_argument("--fit", type=int, default=0, metavar="N",
                   help="fit the random weights to the embedded corpus for N optimizer steps before storing them "
                        "(default 0: random weights; 80 steps take about 40 s on a CPU for the default stand-in)")


def _run_make_tiny(args) -> int:
    sizes = {field: getattr(args, field) for field in SIZE_FLAGS if getattr(args, field) is not None}
    out = families()[args.family].make_tiny(args.out_dir, seed=args.seed, sizes=sizes, force=args.force,
                                            fit_steps=args.fit)
    print(f"wrote {args.family} stand-in to {out}")
    return 0


def _add_forward(sub) -> None:
    p = sub.add_parser("forward", help="load a checkpoint with plain transformers (no adapter) and run its family's "
                                       "smoke forwards (e.g. text and text+image)")
    p.add_argument("model")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")


def _run_forward(args) -> int:
    from modelopt_ext.families import Checkpoint

    family = Checkpoint.read(args.model).family
    if family.forward is None:
        raise ValueError(f"family {family.name!r} has no smoke forward")
    for line in family.forward(args.model, args.dtype):
        print(line)
    return 0


def _add_lock(sub) -> None:
    p = sub.add_parser(
        "lock-remote-code",
        help="record the sha256 of a checkpoint's remote code that you have reviewed, as a lock file",
    )
    p.add_argument("checkpoint")
    p.add_argument("--out", required=True, help="lock file to write (pass it as remote_code_lock / --remote-code-lock)")
    p.add_argument("--revision", default="reviewed-local", help="label recorded with the lock")


def _run_lock(args) -> int:
    from modelopt_ext.lock import write_lock

    lock = write_lock(args.checkpoint, args.out, args.revision)
    for name, digest in lock.files.items():
        print(f"{digest}  {name}")
    print(f"wrote {args.out}")
    return 0


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan", help="resolve the distribution plan (EP degree, dense placement, memory per rank) from config.json"
    )
    p.add_argument("--model", required=True, help="checkpoint folder (reads config.json only) or bundled config name")
    p.add_argument("--nproc", type=int, required=True, help="number of ranks (world size)")
    p.add_argument("--ep", type=int, default=None, help="EP degree (default: --nproc)")
    p.add_argument("--dense", choices=["replicate", "fsdp"], default=None, help="dense layers (default: automatic)")
    p.add_argument("--device-memory-gib", type=float, default=None, help="memory of one device (default: detected)")
    p.add_argument("--tokens-per-rank", type=int, default=4096, help="calibration tokens per rank and batch")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    from modelopt_ext.predict import (
        DEFAULT_CALIB_TOKENS,
        DEFAULT_GPUS_PER_NODE,
        DEFAULT_INTERCONNECT_GBPS,
        DEFAULT_NVLINK_GBPS,
    )

    g = p.add_argument_group("prediction (docs/scaling.md; any of these options turns it on)")
    g.add_argument("--predict", action="store_true",
                   help="also predict the ptq job: load, calibration, export, total and peak memory per GPU, each "
                        "from a GPU measurement (the family's bundled one unless --measurement)")
    g.add_argument("--measurement", metavar="PATH", default=None,
                   help="measurement JSON of scripts/bench_rank_share.py (default: the one bundled with the family)")
    g.add_argument("--calib-tokens", type=int, default=None, metavar="N",
                   help=f"calibration tokens over all ranks (default {DEFAULT_CALIB_TOKENS} = 128 x 2048)")
    g.add_argument("--interconnect-gbps", type=float, default=None, metavar="GB/s",
                   help="inter-node bandwidth per GPU in gigaBYTES per second (default "
                        f"{DEFAULT_INTERCONNECT_GBPS:g}: 400 Gb/s InfiniBand NDR, one NIC per GPU)")
    g.add_argument("--nvlink-gbps", type=float, default=None, metavar="GB/s",
                   help="NVLink all-to-all bandwidth per GPU in gigaBYTES per second (default "
                        f"{DEFAULT_NVLINK_GBPS:g}: NCCL all_to_all_single measured on 2 x H200, docs/performance.md)")
    g.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                   help=f"GPUs per node, the NVLink domain (default {DEFAULT_GPUS_PER_NODE})")


def _run_plan(args) -> int:
    import json

    from modelopt_ext.plan import read_model_config, resolve_distribution_plan

    config, _ = read_model_config(args.model)
    memory = None if args.device_memory_gib is None else int(args.device_memory_gib * 2**30)
    plan = resolve_distribution_plan(
        config, args.nproc, ep_size=args.ep, dense=args.dense, device_memory_bytes=memory,
        tokens_per_rank=args.tokens_per_rank,
    )
    blocks = _fp8_block_lines(config)
    prediction = _predict(config, plan, args)
    if args.json:
        extra = {} if prediction is None else {"prediction": prediction.to_dict()}
        print(json.dumps({**plan.to_dict(), "fp8_blocks": blocks, **extra}, indent=2))
    else:
        print(plan.summary())
        if blocks:
            print("FP8 128x128 blocks of fused groups (default recipe; exported at the logical shape with one scale "
                  "per started block, the engine pads: docs/export.md):")
            print("\n".join(f"  {line}" for line in blocks))
        if prediction is not None:
            print("\n".join(prediction.lines()))
    return 0


def _predict(config, plan, args):
    """The predicted job (modelopt_ext/predict.py) when --predict or one of its options was given, else None."""
    from modelopt_ext import predict

    options = (args.measurement, args.calib_tokens, args.interconnect_gbps, args.nvlink_gbps, args.gpus_per_node)
    if not args.predict and all(o is None for o in options):
        return None
    from modelopt_ext.families import family_for_config

    family = family_for_config(config, source="config")
    if args.measurement is not None:
        measurement, source = predict.load_measurement(args.measurement), args.measurement
    else:
        bundled = family.prediction.measurement if family.prediction is not None else None
        if bundled is not None and bundled.is_file():
            measurement, source = predict.load_measurement(bundled), f"bundled {bundled.name}"
        else:
            where = f" (expected at {bundled})" if bundled is not None else ""
            measurement, source = None, f"no measurement bundled{where}; pass --measurement PATH"
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return predict.predict_job(
        config, plan, measurement, measurement_source=source, family=family,
        calib_tokens=pick(args.calib_tokens, predict.DEFAULT_CALIB_TOKENS),
        interconnect_gbps=pick(args.interconnect_gbps, predict.DEFAULT_INTERCONNECT_GBPS),
        nvlink_gbps=pick(args.nvlink_gbps, predict.DEFAULT_NVLINK_GBPS),
        gpus_per_node=pick(args.gpus_per_node, predict.DEFAULT_GPUS_PER_NODE),
    )


def _fp8_block_lines(config) -> list[str]:
    """The default recipe's FP8 block shapes of the family's fused groups (`export.serving.fp8_block_report`)."""
    from modelopt_ext.families import family_for_config

    family = family_for_config(config, source="config")
    if family.serving is None or family.default_recipe is None:
        return []
    from modelopt_ext.export.serving import fp8_block_report
    from modelopt_ext.quant import recipes

    cfg = recipes.quant_config(recipes.load(family.default_recipe), config)["quant_cfg"]
    return fp8_block_report(config, family.serving, cfg)


def _add_verify(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="check a ModelOpt unified-HF export: shards and index, quantization layout, error bounds against "
        "the source, sha256 manifest",
    )
    p.add_argument("export_dir", metavar="EXPORT_DIR")
    p.add_argument("--source", metavar="DIR", default=None, help="source checkpoint: compare every tensor with it")
    p.add_argument(
        "--write-manifest", action="store_true", help="write MANIFEST.sha256 (only when every other check passes)"
    )
    p.add_argument(
        "--tolerance-factor", metavar="X", type=float, default=1.0,
        help="scale the quantization error bounds (default 1.0)",
    )
    p.add_argument(
        "--engine", metavar="NAME[,NAME]", type=_engine_names, action="append", default=None,
        help=f"also check the rules of serving engines ({', '.join(SERVING_ENGINES)}, all; repeatable or comma "
        "separated): one PASS/FAIL line per rule, exit 2 if any fails (docs/export.md, 'Serving engines')",
    )


def _engine_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in (*SERVING_ENGINES, "all")]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"invalid engine {', '.join(unknown) or repr(text)} (choose from {', '.join(SERVING_ENGINES)}, all)")
    return names


def _run_verify(args) -> int:
    from modelopt_ext.export.verify import ExportInvalid, verify_export

    status = 0
    try:
        report = verify_export(
            args.export_dir, args.source, tolerance_factor=args.tolerance_factor, write_manifest=args.write_manifest
        )
    except ExportInvalid as e:
        print(f"modelopt-ext verify: {args.export_dir} is invalid, {len(e.problems)} problem(s):", file=sys.stderr)
        for problem in e.problems:
            print(f"  - {problem}", file=sys.stderr)
        status = 2
    else:
        print(report.summary())
    if args.engine:
        from modelopt_ext.export.engines import check_engines, engine_verdicts, format_results

        results = check_engines(args.export_dir, [name for names in args.engine for name in names])
        for line in format_results(results):
            print(line)
        failed = [engine for engine, ok in engine_verdicts(results).items() if not ok]
        if failed:
            print(f"modelopt-ext verify: {args.export_dir} breaks the rules of {', '.join(failed)}", file=sys.stderr)
            status = 2
    return status


def _add_ptq(sub) -> None:
    from modelopt_ext.dist import DEFAULT_TIMEOUT_S

    p = sub.add_parser(
        "ptq",
        help="calibrate a checkpoint with a quantization recipe and export it (expert-parallel under torchrun)",
        description="Validate, load, calibrate and export; run under torchrun for expert parallelism. "
        "hf_ptq.py spellings are accepted: --pyt_ckpt_path, --export_path, --calib_size, --batch_size, --calib_seq.",
    )
    p.add_argument("--model", "--pyt_ckpt_path", dest="model", required=True, metavar="DIR",
                   help="local checkpoint folder")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--recipe", metavar="NAME|PATH", default=None,
                       help="quantization recipe: shipped name or YAML path (default: the family's production recipe)")
    which.add_argument("--qformat", metavar="NAME", default=None, help="hf_ptq.py preset name mapped to a recipe")
    p.add_argument("--set", dest="set", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override, e.g. quantize.algorithm.method=max (repeatable)")
    p.add_argument("--export-dir", "--export_path", dest="export_dir", required=True, metavar="DIR")
    p.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty export dir")
    p.add_argument("--resume", action="store_true",
                   help="export from the calibration state an earlier run of the same arguments saved beside the "
                   "export dir (.NAME.calibration/), without the forward passes; refused, naming what changed, if "
                   "the arguments, checkpoint, world size or EP degree differ (docs/ptq.md, 'Resume')")
    p.add_argument("--calib-size", "--calib_size", dest="calib_size", type=int, default=512, metavar="N",
                   help="calibration blocks of --seq-len tokens, over all ranks (default 512)")
    p.add_argument("--batch-size", "--batch_size", dest="batch_size", type=int, default=4, metavar="N",
                   help="blocks per forward and rank (default 4)")
    p.add_argument("--seq-len", "--calib_seq", dest="seq_len", type=int, default=512, metavar="N",
                   help="tokens per block (default 512)")
    p.add_argument("--dataset", default=None, metavar="PATH",
                   help="calibration texts, JSONL or text (default: the embedded set)")
    p.add_argument("--ep", type=int, default=None, metavar="N",
                   help="expert-parallel degree (default: the world size under torchrun, none otherwise)")
    p.add_argument("--dense", choices=["replicate", "fsdp"], default=None, help="dense layers (default: automatic)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--experts-implementation", choices=["eager", "grouped_mm", "batched_mm"], default=None,
                   help="transformers experts implementation (default: transformers' choice)")
    p.add_argument("--experts-option", action="append", default=[], metavar="NAME=VALUE",
                   help="how the fused experts and the EP exchange run (repeatable; modelopt_ext.options."
                        "ExpertsOptions: pipeline, chunks, transport, token_dispatch, row_tile, segment_min_rows, "
                        "grouped_statistics, fast_on_cuda, glu_on_cuda; defaults: the measured best)")
    p.add_argument("--remote-code-lock", metavar="LOCK", default=None,
                   help="lock of reviewed remote code that differs from the pinned revision (modelopt-ext "
                   "lock-remote-code)")
    p.add_argument("--uncovered-experts", choices=["weights", "all-experts", "fail"], default="weights",
                   help="experts that see no calibration token (default: weights)")
    p.add_argument("--expert-input-scales", choices=["shared", "per-expert"], default="shared",
                   help="routed experts' input scales: ModelOpt's one shared scale per layer and projection "
                        "(default), or each expert's own calibrated scale (the layer's where it saw no token; "
                        "measured worse on the stand-in, docs/export.md)")
    p.add_argument("--quality-blocks", type=int, default=0, metavar="N",
                   help="measure the quality report (quality.json, quality.png) on N held-out blocks of --seq-len "
                        "tokens after the calibration blocks (default 0: no report)")
    p.add_argument("--experts-per-file", type=int, default=None, metavar="N", help="experts per safetensors file")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"bound on every collective wait (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--summary-json", default=None, metavar="PATH", help="also write the summary as JSON (rank 0)")
    p.add_argument(
        "--engine", metavar="NAME[,NAME]", type=_engine_names, action="append", default=None,
        help=f"serving engines the export must load in ({', '.join(SERVING_ENGINES)}, all; default: those the "
        "family names for the recipe, else all): their rules run on the export at the end, and a failed one makes "
        "ptq exit non-zero (the export stays)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-warmup", action="store_true",
                   help="on GPUs, no warm-up forward of a small model of the same classes during the load "
                   "(it pays the first-call costs while the checkpoint is read; docs/ptq.md)")


def _run_ptq(args) -> int:
    import os

    from modelopt_ext.dist import RankFailure
    from modelopt_ext.export.staging import Interrupted
    from modelopt_ext.ptq import PtqError, interrupted_message, resume_hint, run_ptq
    from modelopt_ext.run_config import PtqConfig

    if int(os.environ.get("RANK", "0")) > 0 and not args.verbose:
        logging.getLogger().setLevel(logging.WARNING)  # rank 0 reports

    def report_error(text: str) -> None:
        print(f"modelopt-ext ptq: error: {' '.join(line.strip() for line in text.splitlines())}", file=sys.stderr,
              flush=True)

    try:
        config = PtqConfig.from_args(args)  # the same on every rank: each refuses bad values alike
    except ValueError as e:
        report_error(f"validate: {e}")
        return 1
    try:
        summary = run_ptq(config, report_error=report_error)  # also for a rank that the failure watch stops
    except Interrupted as e:  # SIGTERM/SIGINT: the export's staging is removed on every rank
        report_error(interrupted_message(e) + resume_hint(e))
        return 128 + e.signum
    except (PtqError, RankFailure, ValueError, OSError) as e:
        logging.getLogger(__name__).debug("ptq failed", exc_info=True)
        report_error(str(e) + resume_hint(e))
        return 1
    if summary.rank == 0:
        for line in summary.lines():
            print(line)
    return 0


COMMANDS = {
    "make-tiny": (_add_make_tiny, _run_make_tiny),
    "forward": (_add_forward, _run_forward),
    "lock-remote-code": (_add_lock, _run_lock),
    "plan": (_add_plan, _run_plan),
    "verify": (_add_verify, _run_verify),
    "ptq": (_add_ptq, _run_ptq),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelopt-ext", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add, _ in COMMANDS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return COMMANDS[args.command][1](args)
    except (ValueError, OSError) as e:
        print(f"modelopt-ext {args.command}: error: {e}", file=sys.stderr)
        return 2


def run(argv: list[str] | None = None):
    """The `modelopt-ext` / `python -m modelopt_ext` entry point: `main`, then end the process with its
    status (`dist.end_process`: without interpreter finalization when the command joined a process group)."""
    from modelopt_ext.dist import end_process

    try:
        status = main(argv)
    except Exception:  # noqa: BLE001 - reported here so that the exit below stays the only way out
        traceback.print_exc()
        status = 1
    raise SystemExit(end_process(status))


if __name__ == "__main__":
    raise SystemExit(main())

"""`modelopt-ext ptq`: validate, load (expert-parallel under torchrun), calibrate, export, summarise.

    torchrun --nproc-per-node 8 -m modelopt_ext ptq --model CKPT --export-dir OUT [--recipe NAME]

Phases, each timed, run on every rank in step:

- validate: what can be checked before loading: sizes, the checkpoint's files (config.json, index, shard
  headers) and family, its remote code against the lock (`--remote-code-lock` for reviewed code), the EP
  degree and experts per file, the recipe with its `--set` overrides, the tokenizer and the calibration
  data, the export folder (`check_export_dir`).
  Under torchrun the ranks first check that they all got the same arguments (`dist.agree`).
- load: `modelopt_ext.from_pretrained` with EP degree `--ep` (default: the world size under torchrun). On
  GPUs (unless `--no-warmup`) a small model of the same classes runs one calibration-shaped forward on a
  thread meanwhile, so the process's first-call costs overlap the read (`modelopt_ext.warmup`).
- calibrate: the recipe's quant config with the family's exclusions, this rank's batches (tokenized on a
  thread started at the end of validate, so it overlaps the load; cut to the same count on every rank: EP
  forwards are collective), `calibrate`. The recipe's patterns are checked against
  the quantized model after the first batch rather than after the whole run.
  Then each rank saves its calibration state beside the export dir (`quant.resume`); with `--resume` the
  phase restores that state instead of running the forward passes.
- export: `export_checkpoint`, with the expert coverage (coverage.json, coverage.png) added to the export.
- engines: the serving engines' loading rules on the published export (`export.engines`, as `modelopt-ext
  verify --engine`; `--engine` picks the engines, default those the family's `ServingSpec.recipe_engines`
  names for the recipe, else all); a broken
  rule fails the run, the export stays.
  Once they pass, the saved calibration state is removed (kept when the export or the engines failed).
- summary: per-rank figures gathered to every rank (`PtqSummary`, with a verdict per engine), logged on rank 0.

Under torch.distributed each phase runs inside `dist.all_or_fail`, so every rank fails together; a failure
leaves `run_ptq` as `PtqError`, whose message starts with the phase.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from modelopt_ext.dist import (
    RankFailure,
    agree,
    agree_files,
    all_or_fail,
    gather_objects,
    init_distributed,
    leave_process_group,
)
from modelopt_ext.export import writer
from modelopt_ext.export.staging import Interrupted, interrupts_raise
from modelopt_ext.families import Checkpoint
from modelopt_ext.faults import FailureWatch
from modelopt_ext.progress import ProgressBar, format_bytes, peak_device_bytes, peak_host_bytes
from modelopt_ext.run_config import PtqConfig

if TYPE_CHECKING:  # imported where used: modelopt_ext.quant imports ModelOpt (seconds), after the cheap checks
    from modelopt_ext.quant import recipes

logger = logging.getLogger(__name__)

PHASES = ("validate", "load", "calibrate", "export", "engines", "summary")
OPTIONAL_PHASES = {"quality": "calibrate"}  # phase -> the phase it follows; runs with --quality-blocks N > 0


class PtqError(RuntimeError):
    """A phase failed (on this rank or, under torch.distributed, on any rank); the message starts with it."""

    def __init__(self, phase: str, message: str):
        super().__init__(f"{phase}: {message}")
        self.phase = phase


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What validation resolved, passed to load, calibrate and export (none of them reads it again): the
    checkpoint (folder, config.json, family), the distribution plan under EP, the recipe, tokenizer, calibration
    texts and export folder."""

    checkpoint: Checkpoint
    plan: Any  # `modelopt_ext.plan.DistributionPlan` under EP, else None
    num_experts: int
    recipe: recipes.Recipe
    tokenizer: Any
    texts: list[str]
    export_dir: Path  # resolved (symlinks followed)
    lock: Path | None  # the remote-code lock the code was checked against (None: the family runs none)

    @property
    def family(self):
        return self.checkpoint.family


@dataclasses.dataclass
class _State:
    """Where this rank keeps its calibration state, the header a state of this run holds (`quant.resume`), and
    with --resume the saved header it exports from."""

    directory: Path
    header: dict[str, Any]
    saved: dict[str, Any] | None


@dataclasses.dataclass
class PtqSummary:
    """Figures of one run, the same on every rank; lists hold one value per rank."""

    export_dir: str
    recipe: str
    world_size: int
    ep_size: int | None
    seconds: dict[str, float]  # phase -> wall-clock seconds on this rank
    tokens: list[int]  # calibration tokens
    peak_host_bytes: list[int]  # max resident set size
    peak_device_bytes: list[int | None]  # progress.peak_device_bytes; None without CUDA
    bytes_read: list[int]  # checkpoint bytes read while loading
    bytes_written: list[int]  # tensor bytes written by the export
    coverage: str  # Coverage.summary_line()
    # per rank: the calibrate phase's parts (`quant.calibrate.CalibrationResult.seconds`) after "prepare",
    # and first "tokenize": the tokenizing thread's seconds, spent while the model loaded (not in the phase);
    # on GPUs "warmup" before it: the warm-up forward's seconds, also during the load (absent when none ran)
    calibrate_parts: list[dict[str, float]] = dataclasses.field(default_factory=list)
    # serving engine -> whether the export passed every rule of `modelopt-ext verify --engine` for it
    engines: dict[str, bool] = dataclasses.field(default_factory=dict)
    quality: list[str] = dataclasses.field(default_factory=list)  # quant.quality.summary_lines (--quality-blocks)
    resumed: str | None = None  # --resume: the calibration state dir the run exported from (no forward pass)
    rank: int = dataclasses.field(default=0, compare=False)  # the rank holding this copy

    @property
    def calib_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def tokens_per_s(self) -> float:
        seconds = self.seconds.get("calibrate", 0.0)
        return self.calib_tokens / seconds if seconds > 0 else 0.0

    @property
    def forward_tokens_per_s(self) -> float:
        """Calibration tokens over the slowest rank's forward loop (its first batch included): the calibrate
        phase without its fixed costs (ModelOpt's conversion with the weight statistics, the amax sync, coverage)."""
        seconds = max((parts.get("first_batch", 0.0) + parts.get("forward", 0.0) for parts in self.calibrate_parts),
                      default=0.0)
        return self.calib_tokens / seconds if seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        del data["rank"]
        data.update(calib_tokens=self.calib_tokens, tokens_per_s=round(self.tokens_per_s, 1),
                    forward_tokens_per_s=round(self.forward_tokens_per_s, 1))
        return data

    def lines(self) -> list[str]:
        ep = f"EP {self.ep_size}" if self.ep_size else "no EP"
        times = ", ".join(f"{phase} {s:.1f} s" for phase, s in self.seconds.items())
        calibration = (f"calibration: {self.calib_tokens:,} tokens, {self.tokens_per_s:,.0f} tokens/s "
                       f"(forward loop {self.forward_tokens_per_s:,.0f} tokens/s)")
        if self.resumed:
            calibration = (f"calibration: {self.calib_tokens:,} tokens, restored from {self.resumed} (saved by an "
                           "earlier run; no forward pass)")
        lines = [
            f"exported {self.export_dir} (recipe {self.recipe}; {self.world_size} rank(s), {ep})",
            f"time: {times}; total {sum(self.seconds.values()):.1f} s",
            calibration,
        ]
        for r in range(self.world_size):
            device = self.peak_device_bytes[r]
            lines.append(
                f"rank {r}: peak memory host {format_bytes(self.peak_host_bytes[r])}, device "
                f"{'-' if device is None else format_bytes(device)}; read {format_bytes(self.bytes_read[r])}, "
                f"written {format_bytes(self.bytes_written[r])}"
            )
        if self.engines:
            verdicts = ", ".join(f"{e} {'OK' if ok else 'FAILED'}" for e, ok in self.engines.items())
            lines.append(f"serving engines: {verdicts}")
        return lines + self.quality + [self.coverage]


def recipe_name(path: Path) -> str:
    """`kimi_k3/fp8_all` for a shipped recipe, the path otherwise."""
    from modelopt_ext.quant import recipes

    with contextlib.suppress(ValueError):
        return Path(path).relative_to(recipes.RECIPES_DIR).with_suffix("").as_posix()
    return str(path)


def validate(config: PtqConfig, *, rank: int = 0, world_size: int = 1, ep_size: int | None = None) -> RunContext:
    """Check everything that can be checked before loading; raises ValueError/OSError naming the problem.
    Returns the run's context: what load, calibrate and export use without reading it again."""
    from transformers import AutoTokenizer

    from modelopt_ext.checkpoint_files import check_checkpoint_files, check_tokenizer_files
    from modelopt_ext.export.files import check_experts_per_file
    from modelopt_ext.export.staging import stale_dirs
    from modelopt_ext.export.target import check_export_target, resolve_export_dir
    from modelopt_ext.families import family_for_config
    from modelopt_ext.lock import check_remote_code, load_lock
    from modelopt_ext.plan import resolve_distribution_plan, unsupported_replicas_message

    c = config
    # the source and the run's inputs are never in the way of the export: first, before anything is read
    export_dir = resolve_export_dir(c.export_dir)
    check_export_target(export_dir, c.model, {"--dataset": c.dataset, "--summary-json": c.summary_json,
                                              "--remote-code-lock": c.remote_code_lock})
    if c.calib_size < world_size:
        raise ValueError(f"--calib-size {c.calib_size} is smaller than the {world_size} ranks")
    if c.dense is not None and ep_size is None:
        raise ValueError(f"--dense {c.dense} places the dense layers of an EP run; there is no EP here")
    model_config = check_checkpoint_files(c.model).config
    family = family_for_config(model_config, source=str(Path(c.model) / "config.json"))
    checkpoint = Checkpoint(Path(c.model), model_config, family)
    if family.ptq_refused is not None:
        raise ValueError(f"family {family.name!r} ({checkpoint.path}) cannot be quantized by ptq yet: "
                         f"{family.ptq_refused}")
    if family.router_glob is None or family.sizes is None:
        raise ValueError(f"family {family.name!r} has no router glob or sizes: expert coverage cannot be recorded")
    # the remote code runs at load: refuse code that differs from the family's lock now, naming the files
    if family.remote_code_lock is None:  # transformers' own classes: no remote code runs, nothing to lock
        if c.remote_code_lock:
            raise ValueError(f"--remote-code-lock {c.remote_code_lock}: family {family.name!r} loads with "
                             "transformers' own classes and runs no remote code; there is no lock to check")
        lock = None
    else:
        lock = Path(c.remote_code_lock) if c.remote_code_lock else Path(family.remote_code_lock)
        check_remote_code(checkpoint.path, load_lock(lock))
    num_experts = int(family.sizes(model_config)["num_experts"])
    plan = None
    if ep_size is not None:
        what = f"--ep {ep_size}" if c.ep is not None else f"EP degree {ep_size} (the world size; --ep not given)"
        problems = [f"it does not divide the {n} {unit}" for n, unit in
                    ((world_size, "ranks"), (num_experts, "routed experts of a layer")) if n % ep_size]
        if ep_size < 2:
            problems.insert(0, "expert parallelism needs an EP degree of at least 2")
        if problems:
            raise ValueError(f"{what} with {world_size} rank(s): " + "; ".join(problems))
        if ep_size < world_size:
            raise ValueError(unsupported_replicas_message(what, ep_size, world_size))
        plan = resolve_distribution_plan(model_config, world_size, family=family, ep_size=ep_size, dense=c.dense,
                                         experts_options=c.experts_options)
    check_experts_per_file(num_experts, ep_size or 1, c.experts_per_file)
    from modelopt_ext.quant import recipes  # ModelOpt's first import, off this stack (quant.modelopt_import)
    from modelopt_ext.quant.data import load_texts

    if c.qformat is not None:
        source = recipes.recipe_for_qformat(c.qformat, family.name)
    elif c.recipe is not None:
        source = c.recipe
    elif family.default_recipe is not None:
        source = family.default_recipe
    else:
        raise ValueError(f"family {family.name!r} has no default recipe; give --recipe or --qformat")
    recipe = recipes.load(source, overrides=c.overrides)
    if family.serving is not None:  # a group an engine fuses into one GEMM must get one quantization
        from modelopt_ext.quant.fused_groups import check_fused_groups
        from modelopt_ext.quant.kv_cache import check_kv_cache

        quant = recipes.quant_config(recipe, model_config, family=family)
        check_fused_groups(quant["quant_cfg"], model_config, family.serving, str(recipe.path))
        check_kv_cache(quant["quant_cfg"], model_config, family.serving, str(recipe.path), quant.sources)
    # trust_remote_code=False: the tokenizer is not remote code, and None makes transformers ask on the
    # terminal (for up to 15 s) whether to run the checkpoint's configuration code
    check_tokenizer_files(c.model)  # names a missing or garbled file; transformers would guess or fail late
    tokenizer = AutoTokenizer.from_pretrained(c.model, trust_remote_code=False)
    texts = load_texts(c.dataset, tokenizer)
    summary_dir = Path(c.summary_json).absolute().parent if c.summary_json else None
    if rank == 0 and summary_dir is not None and not (summary_dir.is_dir() and os.access(summary_dir, os.W_OK)):
        raise ValueError(f"--summary-json {c.summary_json}: {summary_dir} is not a writable directory")
    check_export_target(export_dir, c.model, {"--recipe": recipe.path, "the remote-code lock": lock})
    export_dir = writer.check_export_dir(export_dir, c.overwrite)
    if rank == 0:
        stale_dirs(export_dir, overwrite=c.overwrite, remove=False)
    return RunContext(checkpoint, plan, num_experts, recipe, tokenizer, texts, export_dir, lock)


def run_ptq(config: PtqConfig, *, report_error: Callable[[str], None] | None = None) -> PtqSummary:
    """Run the phases (see the module doc) for `config`; returns the summary on every rank. Joins the process
    group when WORLD_SIZE > 1 or `config.ep` is given, and leaves it at the end. `report_error(text)`: how a rank
    that the failure watch stops reports its error line (the CLI's; default: none)."""
    if not isinstance(config, PtqConfig):
        raise TypeError(f"run_ptq takes a modelopt_ext.run_config.PtqConfig, got {type(config).__name__} (from "
                        "parsed CLI arguments: PtqConfig.from_args(args))")
    run = _Run(config, report_error)
    # SIGTERM/SIGINT raise `Interrupted` anywhere in the run, leaving the process group included (once), so
    # every rank reaches its error line; before, a signal that came while a failed rank left the group (gloo
    # tears down for a while) found the default handler back and ended the rank with no line (seen in CI)
    with interrupts_raise():
        try:
            with run.watch:
                return run.main()
        finally:
            if run.owns_group:
                leave_process_group()


def _chain(e: BaseException) -> list[BaseException]:
    """`e` and every exception it was raised from or while handling (`__cause__`, `__context__`), `e` first."""
    chain, seen = [], set()
    todo: list[BaseException | None] = [e]
    while todo:
        c = todo.pop()
        if c is not None and id(c) not in seen:
            seen.add(id(c))
            chain.append(c)
            todo += [c.__cause__, c.__context__]
    return chain


def resume_hint(e: BaseException) -> str:
    """What the error line adds when a failure after calibrating kept the calibration state: how to export from
    it without the forward passes ("" when nothing was kept)."""
    # a signal while unwinding: the failure it ended carries it
    kept = next((c.kept_state for c in _chain(e) if getattr(c, "kept_state", None) is not None), None)
    if kept is None:
        return ""
    return (f"; the calibration state is kept in {kept}: run again with the same arguments and --resume to export "
            "without calibrating")


def interrupted_message(e: Interrupted) -> str:
    """The error line's text for a run that SIGTERM or SIGINT stopped: the phase it reached, what it left, and
    the failure this rank was already unwinding from, if any (a signal that reaches a rank after its export
    failed because another rank was stopped first)."""
    chain = _chain(e)
    # what the run was failing with; an exception an `except` block was handling (e.g. a fallback import) is not one
    failures = [c for c in chain[1:] if not isinstance(c, Interrupted) and (
        isinstance(c, (PtqError, RankFailure)) or getattr(c, "export_discarded", False))]
    failure = next((c for c in failures if isinstance(c, PtqError)), failures[0] if failures else None)
    during = e.during or (failure.phase if isinstance(failure, PtqError) else "ptq")
    if any(getattr(c, "export_discarded", False) for c in chain):
        left = "the staging directory was removed and nothing was published"
    elif during in ("engines", "summary"):
        left = "the export was published before it"
    else:
        left = "nothing was exported"
    text = f"{during}: {e}; {left}"
    if isinstance(failure, PtqError):
        failure = str(failure)
    elif failure is not None:
        failure = f"{type(failure).__name__}: {failure}"
    return text + (f" (this rank was already failing: {' '.join(failure.split())})" if failure else "")


class _Run:
    def __init__(self, config: PtqConfig, report_error: Callable[[str], None] | None = None):
        self.config = config
        self.report_error = report_error
        self.rank, self.world_size, self.ep_size = 0, 1, None
        self.distributed = self.owns_group = False
        self.seconds: dict[str, float] = {}
        self.current = "validate"  # the phase running now
        self.watch = contextlib.ExitStack()  # the FailureWatch, once in a process group
        self.state: _State | None = None  # the calibration state's place and header (quant/resume.py)

    @contextlib.contextmanager
    def phase(self, name: str):
        self.current = name
        start = time.monotonic()
        try:
            yield
        except Interrupted as e:
            e.during = e.during or name
            raise
        except PtqError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure leaves as PtqError naming the phase
            detail = str(e) if isinstance(e, (RankFailure, ValueError, OSError)) else f"{type(e).__name__}: {e}"
            raise PtqError(name, detail) from e
        self.seconds[name] = round(time.monotonic() - start, 3)
        if self.rank == 0:
            logger.info("%s done in %.1f s", name, self.seconds[name])

    def main(self) -> PtqSummary:
        c = self.config
        with self.phase("validate"):
            self._join()
            if self.distributed:
                report = self.report_error  # the CLI's error line, for a rank the watch stops
                on_stop = (lambda message: report(f"{self.current}: {message}")) if report else None
                self.watch.enter_context(FailureWatch(grace_s=min(15.0, float(c.timeout)), on_stop=on_stop))
            agree("the ptq arguments", c.to_dict())
            inputs = all_or_fail(
                "validate", lambda: validate(c, rank=self.rank, world_size=self.world_size, ep_size=self.ep_size)
            )
            if self.distributed:
                self._agree_on_inputs(inputs)
            self.state = self._check_state(inputs)
        resuming = self.state.saved is not None
        # this rank's batches are tokenized while the model loads; leaving the block waits for the thread,
        # so a failed load leaves no thread behind (tokenizing is local work of seconds)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ptq-tokenize") as pool:
            tokenizing = None if resuming else pool.submit(self._batches, inputs)
            with self.phase("load"):
                loaded = all_or_fail("load", lambda: self._load(inputs))
                model = loaded.model
            with self.phase("calibrate"):
                if resuming:
                    result, tokens = self._restore(model, inputs)
                else:
                    result, tokens = self._calibrate(loaded, inputs, tokenizing)
                    self._save_state(result, tokens)
        quality = None
        with self._keeping_state():
            if c.quality_blocks:
                with self.phase("quality"):
                    quality = self._quality(result, inputs)
            with self.phase("export"):
                calibrated = sum(gather_objects(tokens))  # every rank's, for the export's provenance
                export = all_or_fail("export", lambda: self._export(result, inputs, calibrated, quality))
            with self.phase("engines"):
                engines = self._check_engines(inputs, export.export_dir)
                self._drop_state()
        with self.phase("summary"):
            summary = self._summary(loaded, inputs, export, tokens, result.coverage.summary_line(), result.seconds)
            summary.engines = engines
            summary.resumed = str(self.state.directory) if resuming else None
            if quality is not None:
                from modelopt_ext.quant.quality import summary_lines

                summary.quality = summary_lines(quality)
        if self.rank == 0:
            logger.info("ptq summary: %s", json.dumps(summary.to_dict()))
            if c.summary_json:
                try:
                    Path(c.summary_json).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
                except OSError as e:
                    raise PtqError("summary", f"cannot write --summary-json: {e}") from e
        return summary

    def _agree_on_inputs(self, inputs: RunContext) -> None:
        """Every rank reads the same checkpoint, lock, recipe and dataset bytes (node-local copies may differ),
        resolved the same distribution plan, and writes into one export dir (a file rank 0 writes beside it is
        seen by every rank)."""
        from modelopt_ext.export import target
        from modelopt_ext.fingerprint import input_fingerprint

        c = self.config
        if inputs.plan is not None:
            agree("the distribution plan", inputs.plan.to_dict())
        others = {"the remote-code lock": inputs.lock, "--recipe": inputs.recipe.path, "--dataset": c.dataset}
        fingerprint = all_or_fail("validate", lambda: input_fingerprint(c.model, others))
        agree_files("checkpoints or inputs", fingerprint)
        probe = all_or_fail("validate", lambda: target.write_probe(inputs.export_dir) if self.rank == 0 else None)
        name, token = gather_objects(probe)[0]
        try:
            all_or_fail("validate", lambda: target.check_probe(inputs.export_dir, name, token, self.rank,
                                                               socket.gethostname()))
        finally:
            if self.rank == 0:
                target.remove_probe(inputs.export_dir, name)

    def _check_state(self, inputs: RunContext) -> _State:
        """The calibration state's dir (`quant.resume`) passes the export target's checks; with --resume, this
        rank's saved state must be complete and from a run of this configuration (every rank refuses
        together, naming what changed); the ranks' states must come from one run."""
        from modelopt_ext.quant import resume

        c = self.config
        directory = resume.state_dir(inputs.export_dir)
        files = {"--dataset": c.dataset, "--summary-json": c.summary_json, "--recipe": inputs.recipe.path,
                 "the remote-code lock": inputs.lock}

        def check():
            resume.check_location(directory, c.model, files)
            header = resume.expected_header(c, recipe=inputs.recipe, lock=inputs.lock, rank=self.rank,
                                            world_size=self.world_size, ep_size=self.ep_size)
            saved = resume.check_saved(directory, header) if c.resume else None
            return header, saved, resume.saved_exists(directory, self.rank)

        header, saved, exists = all_or_fail("validate", check)
        runs = gather_objects(saved["run"] if saved else secrets.token_hex(8))
        if saved and len(set(runs)) > 1:
            raise ValueError(f"--resume: the ranks' calibration states in {directory} were saved by different runs "
                             f"({dict(enumerate(runs))}); run without --resume")
        header["run"] = runs[0]
        if self.rank == 0 and saved:
            logger.info("--resume: exporting from the calibration state in %s (run %s; no forward pass)", directory,
                        runs[0])
        elif self.rank == 0 and exists:
            logger.info("the calibration state an earlier run saved in %s is replaced once this run has calibrated",
                        directory)
        return _State(directory, header, saved)

    def _save_state(self, result, tokens: int) -> None:
        """Every rank saves its calibration state (`quant.resume.save_state`). A failure is a warning on every
        rank, not the run's: the state only serves a later --resume."""
        from modelopt_ext.quant import resume

        state = self.state
        try:
            sizes = all_or_fail("calibrate", lambda: resume.save_state(state.directory, state.header, result, tokens))
        except Exception as e:  # noqa: BLE001 - the export does not need it
            logger.warning("the calibration state was not saved in %s (%s); --resume will not find it",
                           state.directory, e)
            logger.debug("saving the calibration state failed", exc_info=True)
            with contextlib.suppress(OSError):  # no half-written state of this rank
                resume.remove_state(state.directory, self.rank, keep_dir=True)
            return
        if self.rank == 0:
            logger.info("saved the calibration state in %s (%s over %d rank(s)): `ptq --resume` with the same "
                        "arguments exports from it without calibrating", state.directory,
                        format_bytes(sum(gather_objects(sizes))), self.world_size)
        else:
            gather_objects(sizes)

    def _restore(self, model, inputs: RunContext):
        """--resume: ModelOpt's conversion with the recipe's config, then the saved calibration state."""
        from modelopt_ext.quant import recipes, resume

        state = self.state
        return all_or_fail("calibrate", lambda: resume.restore(
            model, recipes.quant_config(inputs.recipe, model.config, family=inputs.family), state.directory,
            state.saved))

    @contextlib.contextmanager
    def _keeping_state(self):
        """A failure from here to the engines' verdict (SIGTERM included) keeps the saved state; rank 0 says so,
        and the failure carries it (`kept_state`) for the error line (`resume_hint`)."""
        try:
            yield
        except BaseException as e:
            if self.state is not None and self.state.directory.is_dir():
                with contextlib.suppress(AttributeError):  # (an exception type that takes no attribute)
                    e.kept_state = self.state.directory
                if self.rank == 0:
                    logger.warning("the calibration state in %s is kept: `ptq --resume` with the same arguments "
                                   "exports from it without calibrating", self.state.directory)
            raise

    def _drop_state(self) -> None:
        """The export is published and passed the engines' rules: every rank removes its saved state (rank 0
        last, with the dir). Failing to is a warning."""
        from modelopt_ext.quant import resume

        directory = self.state.directory
        if self.rank != 0:
            with contextlib.suppress(OSError):
                resume.remove_state(directory, self.rank)
        gather_objects(None)  # every other rank's files are gone before rank 0 removes the dir
        if self.rank == 0 and directory.exists():
            try:
                resume.remove_state(directory, 0)
            except OSError as e:
                logger.warning("could not remove the calibration state %s: %s", directory, e)
            else:
                logger.info("removed the calibration state %s: the export is published", directory)

    def _join(self) -> None:
        c = self.config
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 or c.ep is not None or dist.is_initialized():
            joined = dist.is_initialized()
            try:
                self.rank, self.world_size = init_distributed(c.timeout)
            except RuntimeError as e:  # no torchrun environment, or the rendezvous failed
                raise ValueError(str(e)) from e
            self.distributed, self.owns_group = True, not joined
        self.ep_size = c.ep if c.ep is not None else (self.world_size if self.distributed else None)

    def _load(self, inputs: RunContext):
        """The checkpoint validation read, with the plan the ranks agreed on (`loading.load_checkpoint`)."""
        from modelopt_ext.loading import load_checkpoint

        c = self.config
        kwargs: dict[str, Any] = {"trust_remote_code": True, "dtype": getattr(torch, c.dtype)}
        if c.remote_code_lock:
            kwargs["remote_code_lock"] = c.remote_code_lock
        if c.experts_implementation is not None:
            kwargs["experts_implementation"] = c.experts_implementation
        if torch.cuda.is_available() and not c.no_warmup:
            kwargs["warmup_tokens"] = (c.batch_size, c.seq_len)  # a calibration batch's shape
        if inputs.plan is None and torch.cuda.is_available():
            kwargs["device_map"] = "cuda"
        return load_checkpoint(inputs.checkpoint, plan=inputs.plan, experts_options=c.experts_options, **kwargs)

    def _batches(self, inputs: RunContext) -> tuple[list[dict[str, torch.Tensor]], float]:
        """This rank's calibration batches and the seconds tokenizing took (`main` runs it on a thread while
        the model loads: a fast tokenizer releases the GIL while it encodes)."""
        from modelopt_ext.quant.data import calibration_batches

        c = self.config
        started = time.perf_counter()
        batches = calibration_batches(inputs.tokenizer, inputs.texts, calib_size=c.calib_size,
                                      batch_size=c.batch_size, seq_len=c.seq_len, rank=self.rank,
                                      world_size=self.world_size)
        return batches, round(time.perf_counter() - started, 3)

    def _calibrate(self, loaded, inputs: RunContext, tokenizing: concurrent.futures.Future):
        from modelopt_ext.quant import recipes
        from modelopt_ext.quant.calibrate import calibrate

        model = loaded.model

        def prepare():
            cfg = recipes.quant_config(inputs.recipe, model.config, family=inputs.family)
            return cfg, *tokenizing.result()  # the tokenizing thread's exception, raised here

        started = time.perf_counter()
        cfg, batches, tokenized = all_or_fail("calibrate", prepare)
        counts = gather_objects(len(batches))  # every rank must run the same number of (collective) EP forwards
        if min(counts) < len(batches):
            logger.warning("rank %d: calibrating on %d of its %d batches", self.rank, min(counts), len(batches))
            batches = batches[: min(counts)]
        embeddings = model.get_input_embeddings()
        device = embeddings.weight.device if embeddings is not None else torch.device("cpu")
        batches = [{k: v.to(device) for k, v in batch.items()} for batch in batches]
        tokens = sum(int(batch["input_ids"].numel()) for batch in batches)
        bar = ProgressBar("calibrate", total=len(batches), enabled=self._show_progress(), unit="batch")

        def on_batch(done: int) -> None:
            if done == 1:  # the model is converted by now: a pattern that matches nothing fails early
                recipes.check_patterns_match(cfg, model)
            bar(done)

        options = {"router_glob": inputs.family.router_glob, "router_output": inputs.family.router_output,
                   "num_experts": inputs.num_experts, "uncovered": self.config.uncovered_experts,
                   "progress": on_batch, "plan": inputs.plan}
        prepared = time.perf_counter() - started  # the recipe's config, waiting for the batches, on the device
        with bar:
            result = all_or_fail("calibrate", lambda: calibrate(model, cfg, batches, **options))
        warmup = loaded.warmup_s
        result.seconds = {**({"warmup": warmup} if warmup is not None else {}), "tokenize": tokenized,
                          "prepare": round(prepared, 3), **result.seconds}
        return result, tokens

    def _quality(self, result, inputs: RunContext) -> dict:
        """The quality report (`quant.quality`) on --quality-blocks held-out blocks, the ones after the
        calibration blocks (never calibrated on), dealt to the ranks as calibration blocks are."""
        from modelopt_ext.quant.data import calibration_batches
        from modelopt_ext.quant.quality import measure_quality

        c = self.config

        def held_out():
            return calibration_batches(inputs.tokenizer, inputs.texts, calib_size=c.quality_blocks,
                                       batch_size=c.batch_size, seq_len=c.seq_len, rank=self.rank,
                                       world_size=self.world_size, skip_blocks=c.calib_size)

        batches = all_or_fail("quality", held_out)
        count = min(gather_objects(len(batches)))  # collective EP forwards: the same number on every rank
        device = result.model.get_input_embeddings().weight.device
        batches = [{k: v.to(device) for k, v in b.items()} for b in batches[:count]]
        moe_glob = inputs.family.router_glob.rpartition(".")[0]
        return all_or_fail("quality", lambda: measure_quality(
            result.model, batches, moe_glob=moe_glob, expert_input_scales=c.expert_input_scales,
            baseline_weight_amax=result.max_weight_amax))

    def _export(self, result, inputs: RunContext, calibrated_tokens: int, quality: dict | None = None):
        from modelopt_ext import provenance

        c = self.config
        record = provenance.build(
            recipe_name=recipe_name(inputs.recipe.path), recipe=inputs.recipe, overrides=c.overrides,
            source=Path(c.model), family=inputs.family, lock=inputs.lock,
            calibration={"tokens": calibrated_tokens, "blocks": c.calib_size, "seq_len": c.seq_len,
                         "batch_size": c.batch_size, "dataset": c.dataset, "dtype": c.dtype,
                         "uncovered_experts": c.uncovered_experts, "coverage": result.coverage.summary_line(),
                         "expert_input_scales": c.expert_input_scales,
                         "experts_without_tokens": sum(len(v) for v in result.coverage.uncovered().values())},
            distribution={"world_size": self.world_size, "ep_size": self.ep_size, "dense": c.dense},
        )

        def write_extra(staging) -> None:
            result.coverage.write_json(Path(staging) / "coverage.json")
            result.coverage.write_png(Path(staging) / "coverage.png")
            provenance.write(Path(staging), record)
            if quality is not None:
                from modelopt_ext.quant.quality import write_report

                write_report(Path(staging), quality)

        with ProgressBar("export", enabled=self._show_progress(), unit="unit") as bar:
            options = {"overwrite": c.overwrite, "experts_per_file": c.experts_per_file,
                       "expert_input_scales": c.expert_input_scales, "plan": inputs.plan}
            return writer.export_checkpoint(
                result.model, c.export_dir, source_dir=inputs.checkpoint, **options, write_extra=write_extra,
                progress=bar)

    def _check_engines(self, inputs: RunContext, export_dir: Path) -> dict[str, bool]:
        """The serving engines' loading rules on the published export (`export.engines`, what `modelopt-ext
        verify --engine all` checks), run by rank 0; a failed rule fails every rank, naming it. The export
        stays for inspection."""
        if inputs.family.serving is None:
            return {}
        from modelopt_ext.export.engines import check_engines, engine_verdicts, format_results

        engines = list(self.config.engines) or list(
            inputs.family.serving.recipe_engines.get(recipe_name(inputs.recipe.path), ("all",)))

        def check():
            if self.rank != 0:
                return None
            results = check_engines(export_dir, engines)
            lines = format_results(results)
            for line in lines:
                (logger.debug if line.startswith("PASS") else logger.error)("%s", line)
            return engine_verdicts(results), [line for line in lines if line.startswith("FAIL")]

        verdicts, failed = gather_objects(all_or_fail("engines", check))[0]
        if failed:
            raise ValueError(f"the export {export_dir} breaks {len(failed)} serving-engine rule(s); it is kept for "
                             f"inspection (`modelopt-ext verify {export_dir} --engine all` repeats the checks): "
                             + " | ".join(failed[:3]) + (f" | {len(failed) - 3} more" if len(failed) > 3 else ""))
        return verdicts

    def _summary(self, loaded, inputs: RunContext, export, tokens: int, coverage: str,
                 calibrate_parts: dict[str, float]) -> PtqSummary:
        read = sum(loaded.bytes_read.values())
        mine = {"tokens": tokens, "peak_host_bytes": peak_host_bytes(), "peak_device_bytes": peak_device_bytes(),
                "calibrate_parts": calibrate_parts}
        rows = gather_objects({**mine, "bytes_read": read})
        written = list(export.bytes_written) + [0] * (self.world_size - len(export.bytes_written))
        return PtqSummary(
            **{key: [row[key] for row in rows] for key in rows[0]},
            export_dir=str(export.export_dir),
            recipe=recipe_name(inputs.recipe.path),
            world_size=self.world_size,
            ep_size=self.ep_size,
            seconds=self.seconds,
            bytes_written=written,
            coverage=coverage,
            rank=self.rank,
        )

    def _show_progress(self) -> bool:
        return self.rank == 0 and not self.config.no_progress

"""Per-rank bodies shared by the export tests (tests/export/test_writer.py, test_engines.py, test_exact_cast.py,
test_expert_inputs.py; tests/ep/test_bf16.py; tests/quant/test_calibrate.py): run by
`modelopt_ext.testing.multiproc.run_ranks`, or called directly with rank 0 of 1 for the single-process reference.
Not a test module (pytest collects test_*.py only); test files import it by path:
`import_file(Path(__file__).parents[1] / "export" / "bodies.py")`."""

from __future__ import annotations

import contextlib

import torch

import modelopt_ext
from modelopt_ext.testing.routing import force_routing

CALIB_BATCHES = 4


def calibration_batches(rank: int, world_size: int, count: int = CALIB_BATCHES) -> list[dict[str, torch.Tensor]]:
    """Rank `rank`'s share of a fixed set of `count` batches (every rank the same batch shape)."""
    if count % world_size:
        raise ValueError(f"{count} batches do not split evenly over {world_size} ranks")
    batches = [torch.randint(13, 500, (2, 16), generator=torch.Generator().manual_seed(200 + i))
               for i in range(count)]
    return [{"input_ids": b} for b in batches[rank::world_size]]


def calibrate_and_export(rank: int, world_size: int, ckpt: str, out: str, recipe: str, dense: str | None = None,
                         force_experts: list[int] | None = None, fail_on_rank: int | None = None,
                         batches: int = CALIB_BATCHES, grouped_statistics: str | None = None,
                         expert_input_scales: str = "shared", dtype: str = "float32"):
    """Load (EP when `dense` is given) in `dtype` (a torch dtype name), calibrate `recipe` (max) on this
    rank's batches, export to `out`. `grouped_statistics` is the experts option
    (`ExpertsOptions.grouped_statistics`; "always": the grouped statistics path, and under EP the overlapped
    pipeline with `run_rows_collecting`, on the CPU)."""
    from modelopt_ext.export.writer import export_checkpoint
    from modelopt_ext.families import families
    from modelopt_ext.options import ExpertsOptions
    from modelopt_ext.quant.calibrate import calibrate
    from modelopt_ext.quant.recipes import quant_config

    spec = families()["kimi_k3"]
    kwargs = {"trust_remote_code": True, "dtype": getattr(torch, dtype)}
    if grouped_statistics is not None:
        kwargs["experts_options"] = ExpertsOptions(grouped_statistics=grouped_statistics)
    if dense is not None:
        kwargs.update(ep_size=world_size, dense=dense)
    model = modelopt_ext.from_pretrained(ckpt, **kwargs)
    if force_experts is not None:
        force_routing(model, force_experts)
    result = calibrate(model, quant_config(recipe, model.config), calibration_batches(rank, world_size, batches),
                       router_glob=spec.router_glob, num_experts=16)
    if fail_on_rank is not None:
        _fail_during_export(result.model, fail_on_rank == rank)
    exported = export_checkpoint(result.model, out, source_dir=ckpt, overwrite=True,
                                 expert_input_scales=expert_input_scales,
                                 write_extra=lambda staging: result.coverage.write_json(staging / "coverage.json"))
    verify_on_rank_0(rank, out, ckpt)
    return exported


def verify_on_rank_0(rank: int, out: str, ckpt: str) -> None:
    """Rank 0 checks the finished export with the independent verifier (`modelopt-ext verify OUT --source
    CKPT`); `ExportInvalid` fails the rank, and so the test. About 0.5 s for a stand-in export."""
    if rank == 0:
        from modelopt_ext.export.verify import verify_export

        verify_export(out, ckpt)


@contextlib.contextmanager
def counting_pipelined_calls():
    """Counts the experts' `run_rows_collecting` calls in this process: yields {"pipelined": calls on
    received blocks (from `ep.overlap`), "other": the rest}."""
    from modelopt_ext.experts import fused as experts

    counts, original = {"pipelined": 0, "other": 0}, experts.FusedExperts.run_rows_collecting

    def counting(self, x_SL, segments=None, offs_E=None, valid_S1=None):
        counts["pipelined" if segments is not None else "other"] += 1
        return original(self, x_SL, segments, offs_E, valid_S1)

    experts.FusedExperts.run_rows_collecting = counting
    try:
        yield counts
    finally:
        experts.FusedExperts.run_rows_collecting = original


def _fail_during_export(model, fail: bool) -> None:
    """Make this rank raise while it exports the third unit (decoder layer 1)."""
    if not fail:
        return
    import modelopt_ext.export.writer as writer

    original, calls = writer.materialize, []

    def failing(modules):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected export failure")
        return original(modules)

    writer.materialize = failing

"""`modelopt_ext.options`: the experts options record (parsing, validation, defaults), and how it reaches the
experts: `from_pretrained(experts_options=...)` sets it on every fused experts module, the distribution plan
carries it (the ranks agree on it), and `ptq --experts-option` refuses a bad one in validate."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import modelopt_ext
from modelopt_ext.cli import main
from modelopt_ext.options import DEFAULT, ExpertsOptions, options_of, set_experts_options
from modelopt_ext.plan import DistributionPlan, resolve_distribution_plan


def test_defaults_are_the_measured_winners():
    """docs/performance.md: the overlapped pipeline in 2 chunks through NCCL with one row per slot, whole
    segments of >= 4096 rows as one GEMM each, grouped statistics and the grouped path on CUDA, the exp2 kernel."""
    assert DEFAULT == ExpertsOptions(pipeline=True, chunks=2, transport="nccl", token_dispatch=False, row_tile=0,
                                     segment_min_rows=4096, grouped_statistics="cuda", fast_on_cuda=True,
                                     glu_on_cuda="triton")
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.chunks = 4


def test_parse_takes_every_field_by_its_type():
    got = ExpertsOptions.parse(["pipeline=false", "chunks=4", "transport=copy_engine", "token-dispatch=TRUE",
                                "row_tile=256", "segment_min_rows=0", "grouped_statistics=never",
                                "fast_on_cuda=false", "glu_on_cuda=compile"])
    assert got == ExpertsOptions(False, 4, "copy_engine", True, 256, 0, "never", False, "compile")
    assert ExpertsOptions.parse([]) == DEFAULT
    assert ExpertsOptions.from_dict(got.to_dict()) == got


@pytest.mark.parametrize("items, message", [
    (["chunk=2"], "experts option 'chunk=2': expected NAME=VALUE with NAME one of pipeline, chunks, "),
    (["chunks"], "experts option 'chunks': expected NAME=VALUE"),
    (["pipeline=off"], "experts option 'pipeline=off': expected true or false"),
    (["chunks=two"], "experts option 'chunks=two': expected an integer"),
    (["chunks=0"], "experts option chunks=0: expected at least 1"),
    (["transport=nvshmem"], "experts option transport='nvshmem': expected one of auto, nccl, copy_engine"),
    (["glu_on_cuda=fast"], "experts option glu_on_cuda='fast': expected one of triton, triton-libdevice, "),
    (["grouped_statistics=sometimes"], "experts option grouped_statistics='sometimes': expected one of cuda, "),
    (["row_tile=-1"], "experts options row_tile=-1, segment_min_rows=4096: expected >= 0"),
])
def test_bad_options_name_the_value_and_what_was_expected(items, message):
    with pytest.raises(ValueError) as e:
        ExpertsOptions.parse(items)
    assert str(e.value).startswith(message)


def test_field_types_are_checked():
    with pytest.raises(ValueError, match=r"experts option chunks=True: expected int"):
        ExpertsOptions(chunks=True)
    with pytest.raises(ValueError, match=r"experts option pipeline=1: expected bool"):
        ExpertsOptions(pipeline=1)


def test_the_plan_carries_the_options(tiny_ckpt):
    from modelopt_ext.families import read_config

    options = ExpertsOptions(chunks=3, token_dispatch=True)
    plan = resolve_distribution_plan(read_config(tiny_ckpt), 2, ep_size=2, experts_options=options,
                                     device_memory_bytes=1 << 34)
    assert plan.experts_options == options
    assert plan.to_dict()["experts_options"]["chunks"] == 3  # what the ranks agree on
    assert DistributionPlan.from_dict(plan.to_dict()) == plan
    default = resolve_distribution_plan(read_config(tiny_ckpt), 2, ep_size=2, device_memory_bytes=1 << 34)
    assert default.experts_options == DEFAULT


def test_from_pretrained_sets_them_on_every_fused_experts_module(tiny_ckpt):
    options = ExpertsOptions(grouped_statistics="always", row_tile=8)
    model = modelopt_ext.from_pretrained(tiny_ckpt, trust_remote_code=True, dtype=torch.float32,
                                         experts_options=options)
    experts = [m for m in model.modules() if isinstance(getattr(type(m), "options", None), ExpertsOptions)]
    assert experts and all(options_of(m) is options for m in experts)
    assert set_experts_options(model, DEFAULT) == len(experts) and all(m.options is DEFAULT for m in experts)
    assert options_of(torch.nn.Linear(2, 2)) is DEFAULT
    with pytest.raises(TypeError, match="experts_options must be a modelopt_ext.options.ExpertsOptions"):
        modelopt_ext.from_pretrained(tiny_ckpt / "missing", experts_options={"chunks": 2})


def test_ptq_refuses_a_bad_experts_option_in_validate(tiny_ckpt, tmp_path, capsys, loads):
    assert main(["ptq", "--model", str(tiny_ckpt), "--export-dir", str(tmp_path / "out"),
                 "--experts-option", "transport=nvshmem"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("modelopt-ext ptq: error: validate: experts option transport='nvshmem': expected one of auto, "
                   "nccl, copy_engine")
    assert loads == []

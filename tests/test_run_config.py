"""run_config.py: the frozen `PtqConfig` the CLI and the Python API build alike."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from modelopt_ext.cli import build_parser
from modelopt_ext.export.engine_names import ENGINES
from modelopt_ext.options import ExpertsOptions
from modelopt_ext.quant.calibrate import POLICIES
from modelopt_ext.run_config import CHOICES, ENGINE_NAMES, NOT_HASHED, PtqConfig, flag


def _from_cli(*extra: str) -> PtqConfig:
    return PtqConfig.from_args(build_parser().parse_args(["ptq", "--model", "ckpt", "--export-dir", "out", *extra]))


def test_the_cli_and_the_api_build_the_same_config():
    cli = _from_cli("--calib_size", "64", "--set", "a=1", "--set", "b=2", "--engine", "vllm,sglang", "--engine",
                    "trtllm", "--experts-option", "chunks=4", "--experts-option", "pipeline=false", "--dense", "fsdp")
    api = PtqConfig(model="ckpt", export_dir="out", calib_size=64, overrides=("a=1", "b=2"),
                    engines=("vllm", "sglang", "trtllm"), dense="fsdp",
                    experts_options=ExpertsOptions(chunks=4, pipeline=False))
    assert cli == api
    assert _from_cli() == PtqConfig(model="ckpt", export_dir="out")


def test_every_ptq_flag_is_a_field():
    """A flag added to the parser must reach the config (from_args drops what it does not know)."""
    ptq = build_parser()._subparsers._group_actions[0].choices["ptq"]
    dests = {a.dest for a in ptq._actions if a.dest != "help"}
    renamed = {"set": "overrides", "engine": "engines", "experts_option": "experts_options"}
    fields = {f.name for f in dataclasses.fields(PtqConfig)}
    assert {renamed.get(d, d) for d in dests} == fields


def test_it_is_frozen_and_replace_checks_again():
    config = PtqConfig(model="ckpt", export_dir="out")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.calib_size = 4
    with pytest.raises(ValueError, match="--calib-size must be positive, got 0"):
        config.replace(calib_size=0)


@pytest.mark.parametrize("changes, message", [
    ({"batch_size": 0}, "--batch-size must be positive, got 0"),
    ({"ep": -2}, "--ep must be positive, got -2"),
    ({"seq_len": 1.5}, "--seq-len must be a number, got 1.5"),
    ({"timeout": float("nan")}, "--timeout must be a finite number, got nan"),
    ({"timeout": 8 * 24 * 3600.0}, "--timeout 691200 s is more than a week"),
    ({"quality_blocks": -1}, "--quality-blocks must be 0"),
    ({"dense": "zero3"}, "--dense 'zero3': expected one of replicate, fsdp"),
    ({"engines": ("tgi",)}, "--engine tgi: expected names from"),
    ({"engines": "vllm"}, "--engine: expected a sequence of strings"),
    ({"recipe": "r", "qformat": "fp8"}, "--recipe r and --qformat fp8: give one of them"),
    ({"experts_options": {"chunks": 2}}, "experts_options must be a modelopt_ext.options.ExpertsOptions"),
    ({"model": None}, "--model must be a path, got None"),
])
def test_bad_values_are_refused_naming_the_flag(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        PtqConfig(**{"model": "ckpt", "export_dir": "out", **changes})


def test_a_bad_experts_option_is_refused_when_parsed():
    with pytest.raises(ValueError, match="experts option 'chunks=x': expected an integer"):
        _from_cli("--experts-option", "chunks=x")


def test_paths_become_strings():
    config = PtqConfig(model=Path("ckpt"), export_dir=Path("out"), dataset=Path("d.jsonl"))
    assert (config.model, config.export_dir, config.dataset) == ("ckpt", "out", "d.jsonl")


def test_hashed_leaves_out_only_options_that_change_no_byte():
    base = _from_cli().hashed()
    same = _from_cli("--timeout", "30", "--overwrite", "--no-progress", "--summary-json", "s.json", "--resume",
                     "--engine", "vllm", "--quality-blocks", "4", "--no-warmup", "--export-dir", "elsewhere")
    assert same.hashed() == base
    assert base["--model"] == str(Path("ckpt").absolute()) and "--export-dir" not in base
    for extra in (["--calib-size", "4"], ["--seq-len", "8"], ["--dtype", "float32"], ["--set", "a=1"],
                  ["--experts-per-file", "2"], ["--expert-input-scales", "per-expert"], ["--ep", "2"],
                  ["--experts-option", "chunks=3"], ["--dense", "fsdp"], ["--uncovered-experts", "fail"]):
        assert _from_cli(*extra).hashed() != base, extra
    assert all(flag(name) not in base for name in NOT_HASHED)


def test_hashed_experts_options_are_canonical():
    """The same options given in another order or spelling, or a default given explicitly, hash the same."""
    a = _from_cli("--experts-option", "chunks=4", "--experts-option", "pipeline=False")
    b = _from_cli("--experts-option", "pipeline=false", "--experts-option", "chunks=4", "--experts-option",
                  "transport=nccl")
    assert a.hashed() == b.hashed()
    assert a.hashed()["--experts-option"] == ["chunks=4", "pipeline=false"]


def test_choices_match_the_modules_they_select():
    assert CHOICES["uncovered_experts"] == POLICIES
    assert ENGINE_NAMES == (*ENGINES, "all")


def test_to_dict_is_plain_data():
    import json

    data = _from_cli("--experts-option", "chunks=4").to_dict()
    assert json.loads(json.dumps(data)) == data and data["experts_options"]["chunks"] == 4

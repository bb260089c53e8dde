"""Bad inputs to `modelopt-ext ptq`, each through the real CLI: the error names the file or value and what was
expected, and comes before the heavy work (validation refuses before `from_pretrained` is called; a
recipe pattern that matches nothing fails at the first calibration batch; non-finite calibration
statistics fail before anything is exported). docs/reliability.md lists them with their messages.

Ranks started with different arguments: tests/test_ptq.py::test_ranks_fail_together_on_differing_arguments.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from modelopt_ext.cli import main
from modelopt_ext.families import families
from modelopt_ext.lock import sha256_file
from modelopt_ext.quant import recipes
from modelopt_ext.testing.checkpoints import copy_checkpoint
from modelopt_ext.testing.nodes import launch_nodes, node_env

FAST = "--experts-implementation batched_mm --dtype float32 --calib-size 8 --batch-size 2 --seq-len 16".split()
ONE_BATCH = "--experts-implementation batched_mm --dtype float32 --calib-size 2 --batch-size 2 --seq-len 16".split()
PREFIX = "modelopt-ext ptq: error: "


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt, tmp_path_factory):
    """An unmodified copy, for the tests whose bad input is not the checkpoint (never loaded)."""
    return copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("bad_input"), "bad_input_ok")


def _ptq(capsys, model: Path, out: Path, *extra: str) -> tuple[int, str]:
    """(exit status, the error line) of an in-process `modelopt-ext ptq` run."""
    capsys.readouterr()
    rc = main(["ptq", "--model", str(model), "--export-dir", str(out), "--no-progress", *FAST, *extra])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith(PREFIX)]
    return rc, errors[-1] if errors else ""


def _refused_in_validate(capsys, loads, model: Path, out: Path, *extra: str) -> str:
    rc, err = _ptq(capsys, model, out, *extra)
    assert rc == 1 and err.startswith(f"{PREFIX}validate: "), err
    assert loads == [] and not out.exists()
    return err


# ---------------------------------------------------------------------------------------- checkpoint files


def test_missing_config_json(tiny_ckpt, tmp_path, loads, capsys):
    model = copy_checkpoint(tiny_ckpt, tmp_path, "no_config")
    (model / "config.json").unlink()
    err = _refused_in_validate(capsys, loads, model, tmp_path / "out")
    assert f"{model / 'config.json'} is missing: not a transformers checkpoint folder" in err


def test_garbled_config_json(tiny_ckpt, tmp_path, loads, capsys):
    model = copy_checkpoint(tiny_ckpt, tmp_path, "garbled_config")
    (model / "config.json").write_text('{"model_type": "kimi_k3",\n  garbled')
    err = _refused_in_validate(capsys, loads, model, tmp_path / "out")
    assert f"{model / 'config.json'} is not valid JSON: Expecting property name" in err and "line 2 column 3" in err


def test_missing_shard(tiny_ckpt, tmp_path, loads, capsys):
    model = copy_checkpoint(tiny_ckpt, tmp_path, "missing_shard")
    (model / "model-00002-of-00003.safetensors").unlink()
    err = _refused_in_validate(capsys, loads, model, tmp_path / "out")
    assert f"checkpoint {model}: " in err  # one problem for the whole shard, naming a few of its tensors
    assert "tensors are mapped to shard model-00002-of-00003.safetensors, which does not exist (first: " in err


def test_truncated_shard(tiny_ckpt, tmp_path, loads, capsys):
    model = copy_checkpoint(tiny_ckpt, tmp_path, "truncated_shard")
    shard = model / "model-00003-of-00003.safetensors"
    size = shard.stat().st_size
    os.truncate(shard, size - 1000)
    err = _refused_in_validate(capsys, loads, model, tmp_path / "out")
    assert f"checkpoint {model}" in err and "model-00003-of-00003.safetensors: tensor " in err
    assert f"inside the {size - 1000 - 8 - _header_len(shard)}-byte data section" in err


def _header_len(shard: Path) -> int:
    with shard.open("rb") as f:
        return int.from_bytes(f.read(8), "little")


def test_index_names_a_tensor_absent_from_its_shard(tiny_ckpt, tmp_path, loads, capsys):
    model = copy_checkpoint(tiny_ckpt, tmp_path, "ghost_tensor")
    index_file = model / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    ghost = "language_model.model.layers.0.mlp.ghost_proj.weight"
    index["weight_map"][ghost] = "model-00001-of-00003.safetensors"
    index_file.write_text(json.dumps(index, indent=2))
    err = _refused_in_validate(capsys, loads, model, tmp_path / "out")
    assert err == (f"{PREFIX}validate: checkpoint {model}: tensor {ghost} is listed in model.safetensors.index.json "
                   "(shard model-00001-of-00003.safetensors) but missing from every shard")


def test_junk_appended_to_a_shard(tiny_ckpt, tmp_path, loads, capsys):
    model = copy_checkpoint(tiny_ckpt, tmp_path, "junk_shard")
    with (model / "model-00002-of-00003.safetensors").open("ab") as f:
        f.write(b"\0" * 4096)
    err = _refused_in_validate(capsys, loads, model, tmp_path / "out")
    assert "model-00002-of-00003.safetensors: 4096 bytes after the last tensor's data" in err, err


def test_config_sizes_that_contradict_the_shard_headers(tiny_ckpt, tmp_path, loads, capsys):
    """num_experts 20 where the headers hold 16 experts: refused in validate, not a transformers error in load."""
    model = copy_checkpoint(tiny_ckpt, tmp_path, "wrong_num_experts")
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["num_experts"] = 20
    (model / "config.json").write_text(json.dumps(config, indent=2))
    err = _refused_in_validate(capsys, loads, model, tmp_path / "out")
    assert "config.json: text_config.num_experts is 20, but the shard headers hold 16 routed experts (ids 0..15)" in err


@pytest.mark.parametrize("key, value, expected", [
    ("hidden_act", "silu", "text_config.hidden_act is 'silu'; supported: ['situ']"),
    ("topk_method", "group_limited_greedy", "text_config.topk_method is 'group_limited_greedy'; supported: ['noaux_tc']"),
    ("num_expert_group", 2, "text_config.num_expert_group is 2; supported: [1]"),
    ("routed_expert_hidden_size", None, "text_config.routed_expert_hidden_size is missing"),
])
def test_a_config_value_the_adapter_does_not_implement(tiny_ckpt, tmp_path, loads, capsys, key, value, expected):
    """Another activation, router or expert grouping, or a config without the real latent-width key: refused
    in validate naming key, value and what is supported; the checkpoint is left as it was."""
    model = copy_checkpoint(tiny_ckpt, tmp_path, f"config_{key}")
    config = json.loads((model / "config.json").read_text())
    if value is None:
        del config["text_config"][key]
    else:
        config["text_config"][key] = value
    (model / "config.json").write_text(json.dumps(config, indent=2))
    before = (model / "config.json").read_bytes()
    err = _refused_in_validate(capsys, loads, model, tmp_path / "out")
    assert f"{model / 'config.json'} is not a Kimi-K3 config modelopt_ext supports: " in err and expected in err
    assert (model / "config.json").read_bytes() == before


@pytest.mark.parametrize("damage", ["missing tokenizer_config.json", "truncated tokenizer.json"])
def test_tokenizer_files_are_named(tiny_ckpt, tmp_path, loads, capsys, damage):
    model = copy_checkpoint(tiny_ckpt, tmp_path, "tokenizer_" + damage.split()[0])
    if damage.startswith("missing"):
        (model / "tokenizer_config.json").unlink()
        expected = "tokenizer_config.json is missing: the tokenizer's class, special tokens and chat template"
    else:
        text = (model / "tokenizer.json").read_text()
        (model / "tokenizer.json").write_text(text[: len(text) // 2])
        expected = "tokenizer.json is not valid JSON ("
    err = _refused_in_validate(capsys, loads, model, tmp_path / "out")
    assert expected in err, err


def test_modified_remote_code(tiny_ckpt, tmp_path, loads, capsys):
    model = copy_checkpoint(tiny_ckpt, tmp_path, "edited_remote_code")
    code = model / "modeling_kimi_linear.py"
    code.write_text(code.read_text() + "\nimport os  # an edit nobody reviewed\n")
    lock_file = families()["kimi_k3"].remote_code_lock
    expected = json.loads(Path(lock_file).read_text())["files"]["modeling_kimi_linear.py"]
    err = _refused_in_validate(capsys, loads, model, tmp_path / "out")
    assert f"remote code in {model} does not match the lock {lock_file}" in err
    assert f"modeling_kimi_linear.py has sha256 {sha256_file(code)}, the lock expects {expected}" in err
    assert "configuration_kimi_k3.py" not in err and "modeling_kimi_k3.py" not in err  # unchanged files


def test_reviewed_remote_code_passes_with_its_lock(tiny_ckpt, tmp_path, loads, capsys):
    """--remote-code-lock: edited code that someone reviewed and locked passes validation (and reaches load)."""
    from modelopt_ext.lock import write_lock

    model = copy_checkpoint(tiny_ckpt, tmp_path, "reviewed_remote_code")
    code = model / "modeling_kimi_linear.py"
    code.write_text(code.read_text() + "\nimport os  # reviewed\n")
    lock = tmp_path / "reviewed.lock.json"
    write_lock(model, lock, "reviewed-local")
    rc, err = _ptq(capsys, model, tmp_path / "out", "--remote-code-lock", str(lock))
    assert rc == 1 and err.startswith(f"{PREFIX}load: ") and len(loads) == 1, err


# --------------------------------------------------------------------------------------------------- recipe


def _recipe(tmp_path: Path, name: str, mutate) -> Path:
    """A copy of the shipped kimi_k3/fp8_all recipe, changed by `mutate`, written to tmp_path/name."""
    data = yaml.safe_load((recipes.RECIPES_DIR / "kimi_k3" / "fp8_all.yaml").read_text())
    mutate(data["quantize"]["quant_cfg"])
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_recipe_unknown_key(ckpt, tmp_path, loads, capsys):
    path = _recipe(tmp_path, "typo.yaml", lambda cfg: cfg[1].update(enabel=True))
    err = _refused_in_validate(capsys, loads, ckpt, tmp_path / "out", "--recipe", str(path))
    assert err == (f"{PREFIX}validate: {path}: quantize.quant_cfg[1] (quantizer_name '*weight_quantizer'): unknown "
                   "key(s) 'enabel' (an entry has quantizer_name, parent_class, cfg, enable, or is a lone $import)")


@pytest.mark.parametrize("key, value, expected", [
    # ModelOpt's schema takes any string for num_bits (for custom backends); mtq.quantize would fail later
    ("num_bits", "eight", "{path} quantize.quant_cfg[2]: quantizer_name '*input_quantizer': cfg.num_bits is the "
                          "string 'eight'; expected an int (e.g. 8) or ExMy (e.g. e4m3)"),
    ("axis", "rows", "{path}: invalid entry quantize.quant_cfg[2] ('*input_quantizer'): cfg.axis: "),
])
def test_recipe_wrong_type(ckpt, tmp_path, loads, capsys, key, value, expected):
    path = _recipe(tmp_path, "wrong_type.yaml", lambda cfg: cfg[2]["cfg"].update({key: value}))
    err = _refused_in_validate(capsys, loads, ckpt, tmp_path / "out", "--recipe", str(path))
    assert err.startswith(f"{PREFIX}validate: " + expected.format(path=path)), err
    assert repr(value) in err


def test_recipe_pattern_that_matches_nothing(tiny_ckpt, tmp_path, capsys):
    """Checked against the quantized model, so after the load and the first calibration batch."""
    typo = {"quantizer_name": "*self_attn.o_prj.weight_quantizer", "enable": False}
    path = _recipe(tmp_path, "no_match.yaml", lambda cfg: cfg.insert(3, typo))
    model = copy_checkpoint(tiny_ckpt, tmp_path, "pattern_no_match")
    out = tmp_path / "out"
    rc = main(["ptq", "--model", str(model), "--export-dir", str(out), "--no-progress", *ONE_BATCH,
               "--recipe", str(path)])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith(PREFIX)]
    assert rc == 1 and errors, errors
    assert errors[-1] == (f"{PREFIX}calibrate: quantizer patterns that match nothing: {path} quantize.quant_cfg[3]: "
                          "quantizer_name '*self_attn.o_prj.weight_quantizer' matches no quantizer, module or "
                          "parameter of KimiK3ForConditionalGeneration")
    assert not out.exists()


# ------------------------------------------------------------------------------------- export dir, dataset


def test_non_empty_export_dir_without_overwrite(ckpt, tmp_path, loads, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "earlier.safetensors").write_bytes(b"keep me")
    rc, err = _ptq(capsys, ckpt, out)
    assert rc == 1 and loads == []
    assert err == f"{PREFIX}validate: export dir {out} is not empty; pass --overwrite to replace it"
    assert [p.name for p in out.iterdir()] == ["earlier.safetensors"]


def _listing(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["the checkpoint", "its parent", "inside it", "'' in it", "a link to it"])
def test_an_export_dir_on_the_source_is_refused_even_with_overwrite(tiny_ckpt, tmp_path, loads, capsys, monkeypatch,
                                                                    where):
    """--overwrite used to move the source aside and delete it (rc 0): now refused in validate, naming both."""
    model = copy_checkpoint(tiny_ckpt, tmp_path / "models", "source")
    before = _listing(model)
    export = {"the checkpoint": str(model), "its parent": str(model.parent), "inside it": str(model / "nvfp4"),
              "'' in it": "", "a link to it": str(tmp_path / "link")}[where]
    if where == "a link to it":
        (tmp_path / "link").symlink_to(model)
    monkeypatch.chdir(model)
    rc, err = _ptq(capsys, model, export, "--overwrite")
    assert rc == 1 and loads == [], err
    if where == "'' in it":
        assert err.startswith(f"{PREFIX}validate: export dir '' is empty (an unset shell variable?)"), err
    else:
        real = Path(export).resolve()
        assert err.startswith(f"{PREFIX}validate: --export-dir {real} and --model {model.resolve()}: the export dir "), err
    assert _listing(model) == before


def test_a_checkpoint_that_looks_like_an_export_is_still_refused(tiny_ckpt, tmp_path, loads, capsys):
    model = copy_checkpoint(tiny_ckpt, tmp_path / "models", "source")
    (model / "MANIFEST.sha256").write_text("")  # e.g. a checkpoint that is itself an earlier export
    rc, err = _ptq(capsys, model, model.parent, "--overwrite")
    assert rc == 1 and loads == []
    assert err == (f"{PREFIX}validate: --export-dir {model.parent.resolve()} and --model {model.resolve()}: the export "
                   "dir contains the checkpoint, which replacing it would delete"), err


def test_overwrite_refuses_a_folder_that_holds_no_export(ckpt, tmp_path, loads, capsys):
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.txt").write_text("not an export")
    rc, err = _ptq(capsys, ckpt, out, "--overwrite")
    assert rc == 1 and loads == [] and "holds no finished modelopt-ext export (no MANIFEST.sha256)" in err, err
    assert (out / "notes.txt").read_text() == "not an export"


def test_inputs_inside_the_export_dir_are_refused(ckpt, tmp_path, loads, capsys):
    out = tmp_path / "out"
    err = _refused_in_validate(capsys, loads, ckpt, out, "--summary-json", str(out / "summary.json"))
    assert err == (f"{PREFIX}validate: --summary-json {out / 'summary.json'} lies inside the export dir {out}, which "
                   "the export replaces: keep it outside"), err
    out.mkdir()
    (out / "MANIFEST.sha256").write_text("")
    data = out / "calib.txt"
    data.write_text("some calibration text\n" * 20)
    rc, err = _ptq(capsys, ckpt, out, "--overwrite", "--dataset", str(data))
    assert rc == 1 and loads == [] and err == (f"{PREFIX}validate: --dataset {data} lies inside the export dir {out}, "
                                               "which the export replaces: keep it outside"), err
    assert data.exists()


def test_summary_json_inside_the_checkpoint_is_refused(ckpt, tmp_path, loads, capsys):
    err = _refused_in_validate(capsys, loads, ckpt, tmp_path / "out", "--summary-json", str(ckpt / "s.json"))
    assert err == (f"{PREFIX}validate: --summary-json {ckpt.resolve() / 's.json'} lies inside the checkpoint "
                   f"{ckpt.resolve()}; the source is never written"), err


def test_an_export_dir_name_too_long_for_its_staging_dir(ckpt, tmp_path, loads, capsys):
    out = tmp_path / ("x" * 240)
    err = _refused_in_validate(capsys, loads, ckpt, out)
    assert f"export dir name {out.name!r} is 240 bytes; the staging directory beside it" in err, err
    assert "more than the 255 bytes a file name may have" in err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e9"])
def test_timeout_must_be_finite_and_bounded(ckpt, tmp_path, loads, capsys, value):
    err = _refused_in_validate(capsys, loads, ckpt, tmp_path / "out", f"--timeout={value}")
    expected = ("--timeout 1e+09 s is more than a week" if value == "1e9"
                else f"--timeout must be a finite number, got {float(value)}")
    assert err.startswith(f"{PREFIX}validate: {expected}"), err


def test_a_symlinked_export_dir_is_followed_and_replaced_in_place(ckpt, tmp_path, capsys):
    """The export dir is a link to an earlier export: the new export replaces the link's target (the link stays),
    and the run succeeds with nothing left beside it (this used to fail after publishing: rmtree on a link)."""
    target = tmp_path / "exports" / "v1"
    target.mkdir(parents=True)
    (target / "old.safetensors").write_bytes(b"old")
    (target / "MANIFEST.sha256").write_text("")
    link = tmp_path / "current"
    link.symlink_to(target)
    rc, err = _ptq(capsys, ckpt, link, "--overwrite")
    assert rc == 0, err
    assert link.is_symlink() and link.resolve() == target.resolve()
    names = sorted(p.name for p in target.iterdir())
    assert "old.safetensors" not in names and "MANIFEST.sha256" in names and "config.json" in names
    assert sorted(p.name for p in target.parent.iterdir()) == ["v1"]  # no staging nor replaced dir left


def test_empty_dataset(ckpt, tmp_path, loads, capsys):
    data = tmp_path / "calib.jsonl"
    data.write_text("")
    err = _refused_in_validate(capsys, loads, ckpt, tmp_path / "out", "--dataset", str(data))
    assert err == (f"{PREFIX}validate: calibration dataset {data} is empty (0 bytes), expected at least one text "
                   "sample")


def test_dataset_is_a_directory(ckpt, tmp_path, loads, capsys):
    data = tmp_path / "calib"
    data.mkdir()
    err = _refused_in_validate(capsys, loads, ckpt, tmp_path / "out", "--dataset", str(data))
    assert err == f"{PREFIX}validate: calibration dataset {data} is a directory, expected a JSONL or text file"


def test_dataset_not_utf8(ckpt, tmp_path, loads, capsys):
    data = tmp_path / "calib.txt"
    data.write_bytes("first sample\nsecond caf\u00e9\n".encode("latin-1"))
    err = _refused_in_validate(capsys, loads, ckpt, tmp_path / "out", "--dataset", str(data))
    assert err.startswith(f"{PREFIX}validate: calibration dataset {data} is not UTF-8 text: byte 0xe9 at byte "
                          "offset 23 (line 2)"), err


# ------------------------------------------------------------------------------------------- EP degree


def test_invalid_ep_degree(ckpt, tmp_path):
    """--ep 3 on 2 ranks: 3 divides neither the ranks nor the 16 experts; refused on both ranks in validate (one
    torchrun agent per rank, so each rank's exit status and error line are checked, within a bound)."""
    out = tmp_path / "out"
    argv = ["ptq", "--model", str(ckpt), "--export-dir", str(out), "--no-progress", *FAST, "--ep", "3",
            "--timeout", "60"]
    runs = launch_nodes(argv, [tmp_path, tmp_path], env=node_env(tmp_path), timeout_s=240)
    expected = ("validate: 2 rank(s) failed during validate; rank 0: ValueError: --ep 3 with 2 rank(s): it does not "
                "divide the 2 ranks; it does not divide the 16 routed experts of a layer")
    for run in runs:
        errors = run.error_lines(PREFIX)
        assert not run.timed_out and run.returncode == 1 and run.seconds < 180, (run.node, run.stderr[-3000:])
        assert errors and errors[-1].startswith(PREFIX + expected), (run.node, errors)
    assert not out.exists()


def test_ep_below_the_world_size_is_refused_in_validate(ckpt, tmp_path):
    """--ep 2 on 4 ranks (2 replicas of the experts) loaded, then crashed in calibrate (IndexError); now every rank
    refuses it in validate, before loading, naming the degree, the world and the fix."""
    out = tmp_path / "out"
    argv = ["ptq", "--model", str(ckpt), "--export-dir", str(out), "--no-progress", *FAST, "--ep", "2",
            "--dense", "fsdp", "--timeout", "60"]
    runs = launch_nodes(argv, [tmp_path] * 4, env=node_env(tmp_path), timeout_s=300)
    expected = ("validate: 4 rank(s) failed during validate; rank 0: ValueError: --ep 2: EP degree 2 on 4 ranks "
                "(2 replicas of every expert) is not supported")
    for run in runs:
        errors = run.error_lines(PREFIX)
        assert not run.timed_out and run.returncode == 1, (run.node, run.stderr[-3000:])
        assert errors and errors[-1].startswith(PREFIX + expected), (run.node, errors)
    assert not out.exists()


# ---------------------------------------------------------------------------------- non-finite statistics


TARGET = "language_model.model.layers.4.self_attn.o_proj"  # FP8 recipe: its input is quantized


def _ptq_fp8_one_batch(model: Path, out: Path, capsys) -> tuple[int, str]:
    argv = ["--model", str(model), "--export-dir", str(out), "--no-progress", *ONE_BATCH, "--recipe", "kimi_k3/fp8_all"]
    rc = main(["ptq", *argv])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith(PREFIX)]
    assert rc == 1 and errors, errors
    return rc, errors[-1]


def test_nan_in_calibration_statistics(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """NaN fed into one attention output projection during calibration: the statistics check at the end of
    the forward loop (`quant.collect`, which replaces ModelOpt's per-call asserts) names that quantizer, the
    first in module order, and ptq exports nothing."""
    import modelopt_ext.quant.calibrate as calibrate_module

    real = calibrate_module.calibrate

    def calibrate_with_nan(model, *args, **kwargs):
        def nan_inputs(module, inputs):
            return (torch.full_like(inputs[0], float("nan")), *inputs[1:])

        handle = model.get_submodule(TARGET).register_forward_pre_hook(nan_inputs)
        try:
            return real(model, *args, **kwargs)
        finally:
            handle.remove()

    monkeypatch.setattr(calibrate_module, "calibrate", calibrate_with_nan)
    model = copy_checkpoint(tiny_ckpt, tmp_path, "nan_statistics")
    out = tmp_path / "out"
    _, err = _ptq_fp8_one_batch(model, out, capsys)
    assert err.startswith(f"{PREFIX}calibrate: calibration statistics are not finite: {TARGET}.input_quantizer saw "
                          "NaN in its input during calibration (first in module order; "), err
    assert "later quantizer(s) too), so the model is not exported" in err
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_nonfinite_amax_after_calibration(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """An amax that is not finite after calibration (past ModelOpt's own asserts, which `python -O` drops,
    say): `check_finite_amax` refuses it in one process too, naming the quantizer; nothing is exported."""
    import modelopt.torch.quantization as mtq

    real = mtq.quantize

    def quantize_then_spoil(model, config, forward_loop=None):
        model = real(model, config, forward_loop)
        model.get_submodule(f"{TARGET}.input_quantizer").amax = torch.tensor(float("inf"))
        return model

    monkeypatch.setattr(mtq, "quantize", quantize_then_spoil)
    model = copy_checkpoint(tiny_ckpt, tmp_path, "inf_statistics")
    out = tmp_path / "out"
    _, err = _ptq_fp8_one_batch(model, out, capsys)
    assert err == (f"{PREFIX}calibrate: calibration statistics are not finite (NaN or inf amax) in 1 quantizer(s), "
                   "so the model is not exported; the calibration inputs or the weights of these modules hold NaN "
                   f"or inf: {TARGET}.input_quantizer (1 of 1 amax values inf)")
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))

"""Tests for the `modelopt-ext` command line (modelopt_ext.cli): make-tiny and forward."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from modelopt_ext.cli import main, run
from modelopt_ext.models.kimi_k3.standin.generate import make_tiny


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")
    return env


@pytest.fixture(scope="module")
def seed3(tmp_path_factory) -> Path:
    """The library's own seed-3 checkpoint, the reference for the CLI runs."""
    return make_tiny(tmp_path_factory.mktemp("lib") / "seed3", seed=3)


# ----------------------------------------------------------------------------------------------------
# make-tiny, in process


def test_make_tiny_writes_checkpoint(tmp_path, capsys, seed3):
    out = tmp_path / "ckpt"
    assert main(["make-tiny", "kimi_k3", str(out), "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert str(out) in captured.out
    assert captured.err.count("error") == 0
    # The seed reaches the generator: same bytes as the library call with seed 3.
    assert _files(out) == _files(seed3)
    assert json.loads((out / "config.json").read_text())["model_type"] == "kimi_k3"


def test_make_tiny_size_flags_reach_the_config(tmp_path, capsys):
    out = tmp_path / "ckpt"
    argv = [
        "make-tiny", "kimi_k3", str(out), "--num-layers", "4", "--hidden-size", "64", "--num-experts", "8",
        "--top-k", "2", "--latent-size", "32", "--moe-intermediate-size", "96", "--vocab-size", "400",
    ]
    assert main(argv) == 0
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert (text["num_hidden_layers"], text["hidden_size"], text["num_experts"], text["num_experts_per_token"]) == (
        4, 64, 8, 2)
    assert (text["routed_expert_hidden_size"], text["moe_intermediate_size"], text["vocab_size"]) == (32, 96, 400)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    experts = {m.groups() for k in weight_map if (m := re.search(r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.", k))}
    assert experts == {(str(i), str(e)) for i in range(1, 4) for e in range(8)}


BAD_ARGS = [
    (["--hidden-size", "100"], "hidden_size=100"),
    (["--latent-size", "48"], "latent_size=48"),
    (["--moe-intermediate-size", "40"], "moe_intermediate_size=40"),
    (["--latent-size", "256"], "latent_size=256"),
    (["--top-k", "17"], "top_k=17"),
    (["--top-k", "0"], "top_k=0"),
    (["--num-layers", "1"], "num_layers=1"),
    (["--vocab-size", "100"], "vocab_size=100"),
]


@pytest.mark.parametrize("extra,needle", BAD_ARGS, ids=[n for _, n in BAD_ARGS])
def test_make_tiny_bad_sizes_exit_2(tmp_path, capsys, extra, needle):
    out = tmp_path / "ckpt"
    assert main(["make-tiny", "kimi_k3", str(out), *extra]) == 2
    captured = capsys.readouterr()
    assert "error" in captured.err and needle in captured.err
    assert needle not in captured.out
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_make_tiny_non_empty_dir_then_force(tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "stray.txt").write_text("old")
    assert main(["make-tiny", "kimi_k3", str(out), "--num-layers", "2"]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--force" in err
    assert _files(out) == {"stray.txt": b"old"}
    assert main(["make-tiny", "kimi_k3", str(out), "--num-layers", "2", "--force"]) == 0
    assert not (out / "stray.txt").exists()
    assert (out / "config.json").is_file()


def test_make_tiny_out_dir_is_a_file(tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.write_text("x")
    assert main(["make-tiny", "kimi_k3", str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "not a directory" in err
    assert out.read_text() == "x"


def test_make_tiny_goes_through_the_family_registry(tmp_path):
    """The CLI names no family: make-tiny's choices and generator come from the registered families, which
    refuse a size they have no field for (naming theirs); parsing does not import the generator."""
    from modelopt_ext.families import families

    with pytest.raises(ValueError, match=r"kimi_k3 stand-in: no size n_group \(it has num_layers, hidden_size, "):
        families()["kimi_k3"].make_tiny(tmp_path / "x", sizes={"n_group": 2})
    assert not (tmp_path / "x").exists()
    probe = ("import sys, modelopt_ext.cli as c; c.build_parser(); "
             "print(sorted(m for m in sys.modules if '.standin' in m))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])


@pytest.mark.parametrize(
    "argv",
    [
        ["make-tiny", "no_such_family", "OUT"],
        ["make-tiny", "kimi_k3", "OUT", "--seed", "abc"],
        ["make-tiny", "kimi_k3"],
        [],
    ],
    ids=["unknown-family", "bad-seed", "missing-out", "no-command"],
)
def test_argparse_errors_exit_2(tmp_path, capsys, argv, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def no_group(monkeypatch):
    """`run` would end this (pytest's) process if it had joined a process group."""
    import torch.distributed as dist

    import modelopt_ext.dist

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    monkeypatch.setitem(modelopt_ext.dist._joined, "group", False)


def test_run_exits_with_main_status(tmp_path, capsys, monkeypatch, no_group):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        run(["make-tiny", "kimi_k3", str(tmp_path / "ckpt"), "--top-k", "0"])
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_run_reports_an_unexpected_exception_with_its_traceback_and_status_1(capsys, monkeypatch, no_group):
    import modelopt_ext.cli as cli

    def broken(args):
        raise RuntimeError("unexpected breakage")

    monkeypatch.setitem(cli.COMMANDS, "plan", (cli.COMMANDS["plan"][0], broken))
    with pytest.raises(SystemExit) as exc:
        run(["plan", "--model", "anything", "--nproc", "2"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: unexpected breakage" in err


# ----------------------------------------------------------------------------------------------------
# entry points in subprocesses


def test_python_m_make_tiny(tmp_path, seed3):
    out = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "modelopt_ext", "make-tiny", "kimi_k3", str(out), "--seed", "3"],
        env=_env(tmp_path), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(out) in proc.stdout
    assert _files(out) == _files(seed3)


def test_console_script_help(tmp_path):
    script = Path(sys.prefix) / "bin" / "modelopt-ext"
    assert script.is_file() and os.access(script, os.X_OK), script
    proc = subprocess.run([str(script), "--help"], env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "make-tiny" in proc.stdout and "forward" in proc.stdout
    assert proc.stdout.startswith("usage: modelopt-ext")


def test_make_tiny_help_lists_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["make-tiny", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--seed", "--num-layers", "--hidden-size", "--latent-size", "--moe-intermediate-size",
                 "--num-experts", "--top-k", "--vocab-size", "--force", "kimi_k3"):
        assert flag in out, flag


# ----------------------------------------------------------------------------------------------------
# forward


def test_forward_on_tiny_ckpt(tiny_ckpt, capsys):
    assert main(["forward", str(tiny_ckpt)]) == 0
    lines = capsys.readouterr().out.splitlines()
    text = [line for line in lines if line.startswith("text:")]
    both = [line for line in lines if line.startswith("text+image:")]
    assert len(text) == 1 and len(both) == 1, lines
    for line in text + both:
        assert "finite" in line
        assert re.search(r"logits \(1, \d+, 512\)", line), line
    # The image adds positions: the text+image logits are longer than its input_ids.
    ids_len, logit_len = map(int, re.search(r"input_ids \(1, (\d+)\) -> logits \(1, (\d+),", both[0]).groups())
    assert logit_len > ids_len


def test_forward_refuses_remote_code_that_differs_from_the_lock(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """`forward` runs the checkpoint's own remote code: only once it matches the family's lock."""
    import transformers

    from modelopt_ext.testing.checkpoints import copy_checkpoint

    ckpt = copy_checkpoint(tiny_ckpt, tmp_path, "forward_tampered")
    with (ckpt / "modeling_kimi_k3.py").open("a") as f:
        f.write("\nraise SystemExit('tampered code ran')\n")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: pytest.fail("code loaded"))
    assert main(["forward", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "modeling_kimi_k3.py" in err and "error" in err, err


def test_forward_refuses_a_family_without_one(tmp_path, capsys, monkeypatch):
    import dataclasses

    from modelopt_ext.families import Checkpoint, families

    spec = dataclasses.replace(families()["kimi_k3"], forward=None)
    monkeypatch.setattr(Checkpoint, "read", lambda path: Checkpoint(path, {"model_type": "x"}, spec))
    assert main(["forward", str(tmp_path)]) == 2
    assert "family 'kimi_k3' has no smoke forward" in capsys.readouterr().err



# ----------------------------------------------------------------------------------------------------
# lock-remote-code


def test_lock_remote_code_writes_a_usable_lock(tmp_path, capsys):
    import hashlib

    from modelopt_ext.lock import check_remote_code, load_lock

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    sources = {"modeling_x.py": b"X = 1\n", "configuration_x.py": b"C = 2\n"}
    for name, data in sources.items():
        (ckpt / name).write_bytes(data)
    (ckpt / "config.json").write_text("{}")
    out = tmp_path / "locks" / "x.lock.json"
    assert main(["lock-remote-code", str(ckpt), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in sources.items()}
    for name, digest in digests.items():
        assert f"{digest}  {name}" in stdout.splitlines()
    assert str(out) in stdout
    lock = load_lock(out)
    assert dict(lock.files) == digests and lock.revision == "reviewed-local"
    check_remote_code(ckpt, lock)  # accepted
    # a later edit is caught by the recorded lock
    (ckpt / "modeling_x.py").write_bytes(b"X = 2\n")
    with pytest.raises(ValueError, match="modeling_x.py"):
        check_remote_code(ckpt, lock)


def test_lock_remote_code_revision_label(tmp_path, capsys):
    from modelopt_ext.lock import load_lock

    (tmp_path / "m.py").write_text("")
    out = tmp_path / "l.json"
    assert main(["lock-remote-code", str(tmp_path), "--out", str(out), "--revision", "abc123"]) == 0
    assert load_lock(out).revision == "abc123"


def test_lock_remote_code_of_the_tiny_checkpoint_is_the_bundled_lock(tiny_ckpt, tmp_path, capsys):
    from modelopt_ext.lock import load_lock
    from modelopt_ext.models.kimi_k3.pinned import LOCK_FILE

    out = tmp_path / "tiny.lock.json"
    assert main(["lock-remote-code", str(tiny_ckpt), "--out", str(out)]) == 0
    assert dict(load_lock(out).files) == dict(load_lock(LOCK_FILE).files)


def test_lock_remote_code_without_out_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "m.py").write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["lock-remote-code", str(tmp_path)])
    assert exc.value.code == 2
    assert "--out" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.py"]


def test_lock_remote_code_folder_without_py_exits_2(tmp_path, capsys):
    ckpt = tmp_path / "weights"
    ckpt.mkdir()
    out = tmp_path / "l.json"
    assert main(["lock-remote-code", str(ckpt), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "lock-remote-code" in err and str(ckpt) in err
    assert not out.exists()


# ----------------------------------------------------------------------------------------------------
# plan


def test_plan_on_tiny_ckpt(tiny_ckpt, capsys):
    assert main(["plan", "--model", str(tiny_ckpt), "--nproc", "4", "--device-memory-gib", "8"]) == 0
    out = capsys.readouterr().out
    assert "kimi_k3 on 4 ranks: EP 4, dense replicate" in out
    assert "16 per MoE layer, 4 per rank" in out and "read from disk" in out


def test_plan_json_parses(tiny_ckpt, capsys):
    argv = ["plan", "--model", str(tiny_ckpt), "--nproc", "8", "--ep", "4", "--device-memory-gib", "8", "--json",
            "--tokens-per-rank", "128"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["world_size"], d["ep_size"], d["dense"], d["experts_per_rank"], d["tokens_per_rank"]) == (
        8, 4, "fsdp", 4, 128)
    assert d["device_memory_bytes"] == 8 * 2**30
    assert [line.split(":")[0] for line in d["fp8_blocks"]] == ["KDA input projections", "MLA latent down projections"]


def test_plan_kimi_k3_ep64_on_h200(capsys):
    assert main(["plan", "--model", "kimi-k3", "--nproc", "64", "--device-memory-gib", "141"]) == 0
    out = capsys.readouterr().out
    assert "EP 64, dense fsdp" in out and "14 per rank" in out
    assert "dense replicate needs" in out  # replicated dense does not fit beside the experts
    experts = re.search(r"experts resident \(mxfp4\)\s+([\d.]+)\s+([\d.]+)", out)
    assert experts and 21 <= float(experts.group(2)) <= 25, out  # GB per rank
    assert re.search(r"read from disk\s+[\d.]+\s+2[2-6]\.\d", out), out
    assert "fsdp_size=64, ep_size=64" in out
    # the FP8 128x128 block decision at real sizes: partial blocks only at the end of each fused group
    assert "FP8 128x128 blocks of fused groups (default recipe; exported at the logical shape" in out
    assert ("  KDA input projections: q_proj 12288 + k_proj 12288 + v_proj 12288 + g_proj 12288 + f_a_proj 128 + "
            "b_proj 96 = 49376 rows = 385 blocks + 96 rows; partial block in b_proj (the group's last member") in out
    assert "  MLA latent down projections: q_a_proj 1536 + kv_a_proj_with_mqa 576 = 2112 rows = 16 blocks + 64" in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--nproc", "4", "--ep", "3"], "world_size (4) is not divisible by the EP degree (3)"),
        (["--nproc", "32"], "num_experts (16) is not divisible by the EP degree (32)"),
        (["--nproc", "8", "--ep", "4", "--dense", "replicate"], "EP degree (4) to equal world_size (8)"),
        (["--nproc", "4", "--device-memory-gib", "0.001"], "parts that cannot be placed"),
    ],
    ids=["ep-mod", "experts-mod", "replicate-ep", "no-fit"],
)
def test_plan_bad_arguments_exit_2(tiny_ckpt, capsys, argv, needle):
    assert main(["plan", "--model", str(tiny_ckpt), *argv]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and "modelopt-ext plan: error" in captured.err
    assert captured.out == ""


def test_plan_unknown_model_exits_2(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path / "nothing"), "--nproc", "8"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "nothing") in err and "kimi-k3" in err


# ----------------------------------------------------------------------------------------------------
# verify (the checks themselves are tested on real exports in tests/export/test_verify.py)


def _fp8_export(root: Path) -> tuple[Path, Path]:
    """(source, export) by hand: one FP8 linear `lin` (per-tensor scale amax/448) and one BF16 norm."""
    import torch
    from safetensors.torch import save_file

    w = (torch.arange(4 * 32, dtype=torch.float32).reshape(4, 32) / 50 - 1.2).to(torch.bfloat16)
    norm = torch.linspace(0.5, 1.5, 32).to(torch.bfloat16)
    scale = w.float().abs().max() / 448
    src, export = root / "src", root / "export"
    src.mkdir(parents=True)
    export.mkdir(parents=True)
    save_file({"lin.weight": w, "norm.weight": norm}, str(src / "model.safetensors"))
    q = (w.float() / scale).to(torch.float8_e4m3fn)
    save_file({"lin.weight": q, "lin.weight_scale": scale, "norm.weight": norm}, str(export / "model.safetensors"))
    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": []}
    (export / "hf_quant_config.json").write_text(json.dumps({"quantization": quant}))
    qc = {"quant_algo": "FP8", "ignore": [], "quant_method": "modelopt"}
    (export / "config.json").write_text(json.dumps({"quantization_config": qc}))
    return src, export


def test_verify_valid_export(tmp_path, capsys):
    """A hand-built export has no manifest: refused (modelopt-ext's exports always carry one) until
    --write-manifest checks it and writes one; then plain verify passes, checking the manifest."""
    src, export = _fp8_export(tmp_path)
    assert main(["verify", str(export)]) == 2
    assert f"  - {export}/MANIFEST.sha256 is missing: modelopt-ext's exporter always writes" in capsys.readouterr().err
    assert main(["verify", str(export), "--write-manifest"]) == 0
    capsys.readouterr()
    assert main(["verify", str(export)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        f"OK {export}: 3 tensors, {128 + 4 + 64} bytes in 1 safetensors file(s); quantized weights: FP8 1",
        "manifest MANIFEST.sha256: checked",
    ]
    assert captured.err == ""


def test_verify_with_source_writes_then_checks_the_manifest(tmp_path, capsys):
    src, export = _fp8_export(tmp_path)
    assert main(["verify", str(export), "--source", str(src), "--write-manifest"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"vs source {re.escape(str(src))}: max relative error FP8 0\.0\d+ \(0\.\d+ of bound\)", out), out
    assert "manifest MANIFEST.sha256: written" in out
    listed = (export / "MANIFEST.sha256").read_text().splitlines()
    assert [line.split("  ")[1] for line in listed] == ["config.json", "hf_quant_config.json", "model.safetensors"]
    assert main(["verify", str(export)]) == 0
    assert "manifest MANIFEST.sha256: checked" in capsys.readouterr().out


def test_verify_invalid_export_lists_every_problem(tmp_path, capsys):
    src, export = _fp8_export(tmp_path)
    assert main(["verify", str(export), "--write-manifest"]) == 0
    capsys.readouterr()
    raw = bytearray((export / "model.safetensors").read_bytes())
    raw[-1] ^= 0x08  # last byte of the data: lin.weight, norm.weight or the scale, whichever is stored last
    (export / "model.safetensors").write_bytes(bytes(raw))
    (export / "stray.txt").write_text("x")
    assert main(["verify", str(export), "--source", str(src)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert lines[0] == f"modelopt-ext verify: {export} is invalid, {len(lines) - 1} problem(s):"
    assert lines[1].startswith("  - model.safetensors changed since MANIFEST.sha256 was written")
    assert lines[2] == "  - stray.txt is not listed in MANIFEST.sha256"
    assert len(lines) == 4 and re.match(r"  - (lin|norm)\.weight", lines[3]), lines  # the flipped tensor


def test_verify_tolerance_factor(tmp_path, capsys):
    src, export = _fp8_export(tmp_path)
    assert main(["verify", str(export), "--source", str(src), "--tolerance-factor", "0.01"]) == 2
    err = capsys.readouterr().err
    assert "lin.weight: " in err and "exceed the FP8 error bound" in err
    assert main(["verify", str(export), "--tolerance-factor", "0"]) == 2
    assert "modelopt-ext verify: error: tolerance_factor must be a finite number > 0, got 0.0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["verify", str(export), "--tolerance-factor", "abc"])
    assert exc.value.code == 2


def test_verify_missing_directories_exit_2(tmp_path, capsys):
    src, export = _fp8_export(tmp_path)
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert f"modelopt-ext verify: error: export directory {tmp_path / 'nothing'} does not exist" in capsys.readouterr().err
    assert main(["verify", str(export), "--source", str(tmp_path / "no_src")]) == 2
    assert str(tmp_path / "no_src") in capsys.readouterr().err


def test_verify_help_lists_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["verify", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("EXPORT_DIR", "--source", "--write-manifest", "--tolerance-factor"):
        assert flag in out, flag


def test_python_m_verify_exit_codes(tmp_path):
    src, export = _fp8_export(tmp_path)
    cmd = [sys.executable, "-m", "modelopt_ext", "verify"]
    proc = subprocess.run([*cmd, str(export), "--source", str(src), "--write-manifest"], env=_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"OK {export}: ")
    (export / "config.json").unlink()
    proc = subprocess.run([*cmd, str(export)], env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "  - config.json has no quantization_config although hf_quant_config.json sets FP8" in proc.stderr

"""modelopt_ext.quant.modelopt_import: the first ModelOpt import pins nothing of the importer's stack, so a
model is freed once its last user returns (checked in fresh interpreters: ModelOpt must not be imported yet),
and ModelOpt's generated attention sources leave no /tmp/modelopt_*.py behind."""

import os
import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent("""
    import gc, sys, weakref
    assert "modelopt" not in sys.modules, "the probe needs an interpreter without ModelOpt"

    class Big:
        pass

    def first_import():
        big = Big()
        {statement}
        return weakref.ref(big)

    ref = first_import()
    gc.collect()
    print("freed" if ref() is None else "pinned")
""")


@pytest.mark.parametrize("statement", ["import modelopt_ext.quant", "import modelopt_ext.quant.calibrate",
                                       "from modelopt_ext.quant.modelopt_import import import_modelopt; "
                                       "import_modelopt()"])
def test_the_first_import_through_modelopt_ext_pins_nothing(statement):
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(statement=statement)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "freed", proc.stdout


def test_an_import_error_reaches_the_caller(monkeypatch):
    from modelopt_ext.quant import modelopt_import

    monkeypatch.setattr(modelopt_import, "_FIRST", "modelopt_ext_no_such_module")
    with pytest.raises(ModuleNotFoundError, match="modelopt_ext_no_such_module"):
        modelopt_import.import_modelopt()


# ModelOpt's KV-cache registration of an attention class it rewrites (plugins.attention): ModelOpt saves the
# generated source to tempfile.NamedTemporaryFile(prefix="modelopt_", suffix=".py", delete=False) and never
# removes it. Each probe runs in a fresh interpreter with a private TMPDIR, so other processes' files are
# never seen.
_TOY_ATTENTION = textwrap.dedent("""
    import torch
    from torch import nn


    class ToyAttention(nn.Module):
        def forward(self, q, k, v):
            scores = torch.matmul(q, k.transpose(-1, -2))
            return torch.matmul(scores.softmax(-1), v)
""")

_REGISTER = textwrap.dedent("""
    import inspect, sys
    {first}
    sys.path.insert(0, sys.argv[1])
    import toy_attention
    from modelopt.torch.quantization.plugins.attention import register_attention_for_kv_quant
    from modelopt.torch.quantization.nn import QuantModuleRegistry

    assert register_attention_for_kv_quant(toy_attention.ToyAttention)
    quant_class = QuantModuleRegistry[toy_attention.ToyAttention]
    forward = next(c.forward for c in quant_class.__mro__ if c.__name__ == "_QuantToyAttention")
    source = inspect.getsource(forward)  # the generated code, found although its file is gone
    assert "self.k_bmm_quantizer" in source and "self.v_bmm_quantizer" in source, source
    print("generated:", forward.__code__.co_filename)
""")


def _register_in_fresh_process(tmp_path, first: str) -> tuple[list[str], str]:
    """(what the process left in its TMPDIR, its stdout)."""
    src, tmpdir = tmp_path / "src", tmp_path / "tmpdir"
    src.mkdir()
    tmpdir.mkdir()
    (src / "toy_attention.py").write_text(_TOY_ATTENTION)
    proc = subprocess.run([sys.executable, "-c", _REGISTER.format(first=first), str(src)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmpdir)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sorted(p.name for p in tmpdir.iterdir()), proc.stdout


def test_modelopt_alone_leaves_its_generated_source_behind(tmp_path):
    """The control: without modelopt_ext, ModelOpt 0.47 leaves one modelopt_*.py per process (if ModelOpt
    stops doing so, this fails and the workaround in quant.modelopt_import can go)."""
    left, _ = _register_in_fresh_process(tmp_path, "import modelopt.torch.quantization")
    assert len(left) == 1 and left[0].startswith("modelopt_") and left[0].endswith(".py"), left


def test_registration_through_modelopt_ext_leaves_no_file(tmp_path):
    left, out = _register_in_fresh_process(tmp_path, "import modelopt_ext.quant")
    assert left == []
    assert f"generated: {tmp_path / 'tmpdir'}/modelopt_ext-generated-" in out, out  # ours, removed


def test_calibrating_the_stand_in_leaves_no_file(tiny_ckpt, tmp_path):
    """The real path: `calibrate` on the stand-in, then a process end without atexit handlers (`os._exit`, as
    `dist.end_process` does). The adapter registers its attention classes with ModelOpt (models/kimi_k3/mla.py),
    so ModelOpt converts them without rewriting a source: no generated class, no file, and the MLA module keeps
    the adapter's forward with its KV quantizers."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    script = textwrap.dedent(f"""
        import os, sys
        import torch
        import modelopt_ext
        from modelopt_ext.families import families
        from modelopt_ext.quant.calibrate import calibrate
        from modelopt_ext.quant.recipes import quant_config

        model = modelopt_ext.from_pretrained({str(tiny_ckpt)!r}, trust_remote_code=True, dtype=torch.float32)
        batches = [{{"input_ids": torch.randint(13, 500, (1, 8), generator=torch.Generator().manual_seed(0))}}]
        calibrate(model, quant_config("kimi_k3/fp8_all", model.config), batches,
                  router_glob=families()["kimi_k3"].router_glob, num_experts=16)
        rewritten = ("_QuantKimiMLAAttention", "_QuantKimiDeltaAttention")  # the names a source rewrite gives
        generated = [c for m in model.modules() for c in type(m).__mro__ if c.__name__ in rewritten]
        assert not generated, generated
        mla = model.get_submodule("language_model.model.layers.2.self_attn")
        assert hasattr(type(mla).forward, "__wrapped__") and hasattr(mla, "k_bmm_quantizer"), type(mla).__mro__
        sys.stdout.flush()
        os._exit(0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmpdir)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    left = [p.name for p in tmpdir.iterdir()]
    assert not [n for n in left if n.startswith(("modelopt_", "modelopt_ext-generated-"))], left

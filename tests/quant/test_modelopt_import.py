"""modelopt_ext.quant.modelopt_import: the first ModelOpt import pins nothing of the importer's stack, so a
model is freed once its last user returns (checked in fresh interpreters: ModelOpt must not be imported yet)."""

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

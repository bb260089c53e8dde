"""Import ModelOpt without pinning the importer's stack.

ModelOpt imports PuLP, and PuLP's `copt_api` keeps the exception of its failed COPT library load as a class
attribute (`COPT_DLL.err`, PuLP 3.3). That exception's traceback holds the frames of the import, and every
frame holds its caller (`f_back`). So whichever function first imports ModelOpt keeps its locals alive until
the process ends. Measured: `run_ptq` imported ModelOpt while validating the recipe. After it returned, the
model, the calibration result and the device meshes with their gloo groups stayed alive, even after
`gc.collect()`. `import_modelopt` runs that first import on a thread of its own. A new thread's stack
holds nothing of the caller's, so nothing of the caller's is pinned.

ModelOpt's generated sources: to quantize an attention class's KV cache, ModelOpt rewrites its source
(`plugins.attention.register_attention_for_kv_quant`, run by `mtq.quantize` on a Hugging Face model whose
attention it cannot quantize otherwise and that no family registered itself: Kimi-K3's adapter registers its
attention classes, models/kimi_k3/mla.py) and compiles the new `_Quant<Name>`
class with the rewritten source saved to `tempfile.NamedTemporaryFile(prefix="modelopt_", suffix=".py",
delete=False)` as its file name: that file is only where tracebacks and `inspect.getsource` find the
generated methods' lines (ModelOpt reads nothing back), and ModelOpt never removes it, so every process
that quantized left a `/tmp/modelopt_*.py`. `import_modelopt` has ModelOpt write it into a temporary
directory of ours instead and, once the class is created, puts its lines into `linecache` (tracebacks and
`inspect.getsource` read them from there) and removes the directory. Nothing is left even when the process
ends with `os._exit` (`dist.end_process`) or is killed, and no other process's file is touched.
"""

from __future__ import annotations

import importlib
import inspect
import linecache
import logging
import os
import sys
import tempfile
import threading

logger = logging.getLogger(__name__)

_FIRST = "modelopt.torch.quantization"  # imports modelopt.torch, and with it PuLP
_GENERATOR = "modelopt.torch.quantization.plugins.attention"
_WRAPPED = "_modelopt_ext_source_in_linecache"
_prepared = False  # _generated_sources_in_linecache has run


def _generated_sources_in_linecache() -> None:
    """Wrap ModelOpt's `_create_quantized_class_from_ast` so that its generated source goes to a temporary
    directory of ours, removed once the class exists, its lines kept in `linecache` (see the module doc)."""
    module = importlib.import_module(_GENERATOR)
    create = getattr(module, "_create_quantized_class_from_ast", None)
    if create is None or getattr(create, _WRAPPED, False):
        return
    if "temp_file_name" not in inspect.signature(create).parameters:
        logger.debug("%s._create_quantized_class_from_ast takes no temp_file_name: its /tmp/modelopt_*.py files "
                     "stay", _GENERATOR)
        return

    def create_with_source_in_linecache(head, org_class, new_class_name, temp_file_name=None):
        if temp_file_name is not None:  # a caller's own file: theirs to keep
            return create(head, org_class, new_class_name, temp_file_name=temp_file_name)
        with tempfile.TemporaryDirectory(prefix="modelopt_ext-generated-") as folder:
            path = os.path.join(folder, f"modelopt_{new_class_name}.py")
            quant_class = create(head, org_class, new_class_name, temp_file_name=path)
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
        # mtime None: linecache.checkcache keeps the entry although the file is gone
        linecache.cache[path] = (sum(map(len, lines)), None, lines, path)
        logger.debug("ModelOpt generated %s (source kept in linecache as %s)", new_class_name, path)
        return quant_class

    setattr(create_with_source_in_linecache, _WRAPPED, True)
    module._create_quantized_class_from_ast = create_with_source_in_linecache


def import_modelopt() -> None:
    """Import ModelOpt's quantization package, the first time on a separate thread, and have it leave no
    generated source file behind (see the module doc). An import error is raised here, in the caller's
    thread."""
    if _FIRST in sys.modules and _prepared:
        return
    errors: list[BaseException] = []

    def first_import() -> None:
        global _prepared
        try:
            importlib.import_module(_FIRST)
            _generated_sources_in_linecache()
            _prepared = True
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
            errors.append(e)

    thread = threading.Thread(target=first_import, name="modelopt_ext-import-modelopt")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]

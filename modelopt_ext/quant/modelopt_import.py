"""Import ModelOpt without pinning the importer's stack.

ModelOpt imports PuLP, and PuLP's `copt_api` keeps the exception of its failed COPT library load as a class
attribute (`COPT_DLL.err`, PuLP 3.3). That exception's traceback holds the frames of the import, and every
frame holds its caller (`f_back`). So whichever function first imports ModelOpt keeps its locals alive until
the process ends. Measured: `run_ptq` imported ModelOpt while validating the recipe. After it returned, the
model, the calibration result and the device meshes with their gloo groups stayed alive, even after
`gc.collect()`. `import_modelopt` runs that first import on a thread of its own. A new thread's stack
holds nothing of the caller's, so nothing of the caller's is pinned.
"""

from __future__ import annotations

import importlib
import sys
import threading

_FIRST = "modelopt.torch.quantization"  # imports modelopt.torch, and with it PuLP


def import_modelopt() -> None:
    """Import ModelOpt's quantization package, the first time on a separate thread (see the module doc).
    An import error is raised here, in the caller's thread."""
    if _FIRST in sys.modules:
        return
    errors: list[BaseException] = []

    def first_import() -> None:
        try:
            importlib.import_module(_FIRST)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
            errors.append(e)

    thread = threading.Thread(target=first_import, name="modelopt_ext-import-modelopt")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]

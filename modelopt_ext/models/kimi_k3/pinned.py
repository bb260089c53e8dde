"""What the Kimi-K3 family pins, as data: Moonshot's revision, the remote-code lock, version floors, module names
and the EP plan. Both the spec (`spec.py`) and the loader (`adapter.py`) read them here, so neither imports
the other at load time."""

from __future__ import annotations

from pathlib import Path

# Moonshot's pinned revision of Kimi-K3. The bundled lock records the stand-in's remote-code files,
# which are this project's faithful re-implementation of that revision (see docs/standin.md).
REVISION = "9f62e4e9fffbd0a83ddd60e1c209d828994b3569"
LOCK_FILE = Path(__file__).with_name("remote_code.lock.json")
MIN_VERSIONS = {"transformers": "5.23", "torch": "2.7", "fla-core": "0.5.1"}

LAYERS = "language_model.model.layers.*"
EXPERTS_GLOB = _EXPERTS = f"{LAYERS}.block_sparse_moe.experts"
# Expert parallelism as data: the experts module dispatches tokens, its fused tensors (dense or MXFP4
# packed + scales) are sharded along the expert dimension.
EP_PLAN = {
    _EXPERTS: "ep_dispatch_experts",
    **{f"{_EXPERTS}.{name}": "grouped_gemm" for name in (
        "gate_up_proj", "down_proj", "gate_up_proj_packed", "gate_up_proj_scale", "down_proj_packed",
        "down_proj_scale",
    )},
}

"""The registry of the expert-parallel exchange's links: which exist, what each needs, which one a call takes.

A link moves the rows of `overlapped_moe` calls (`ep.link`: the protocol `Link`, whose steps all take the
call's frozen plan, and the records `Layout` and `Routing`); one file per link: `ep.link` (NCCL, one row per
slot), `ep.token_link` (NCCL, one row per token and rank), `ep.copy_engine` (copy engines into peer-mapped
memory). Each is registered here once, with the capabilities it declares (`LinkSpec`): whether it needs CUDA
tensors, whether every rank must run on one host, whether it passes gradients (none does: `overlapped_moe` is
inference-only) and whether one link object may serve interleaved calls. `choose` maps the experts options
(`transport`, `token_dispatch`) to a link; `build` refuses one whose needs are not met, naming them, before
it allocates anything, and otherwise makes the link object (which holds nothing of a call).
`tests/ep/test_links.py` runs every registered link that can run on the machine at several chunk counts
against the reference dispatch/combine, and says which it skipped and why.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from modelopt_ext.options import TRANSPORTS

from .copy_engine import CopyEngineLink
from .link import Link, NcclLink
from .token_link import TokenLink


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """A link and what it needs.

    Attributes:
        name: its name in the registry.
        transport: the `ExpertsOptions.transport` that selects it ("nccl" or "copy_engine").
        token_dispatch: the `ExpertsOptions.token_dispatch` that selects it among the NCCL links (None: any).
        make: `make(group, device)` -> a link object for the process group and the tokens' device.
        cuda_only: it moves CUDA tensors only.
        one_host_only: every rank of the group must run on this host (peer-mapped memory).
        autograd: it passes gradients (no link does; `overlapped_moe` refuses tensors that need them).
        concurrent_calls: one link object may serve calls whose steps interleave (the copy engines may not:
            every call of a group and device uses the same peer-mapped rows).
    """

    name: str
    transport: str
    token_dispatch: bool | None
    make: Callable[[object, torch.device], Link]
    cuda_only: bool = False
    one_host_only: bool = False
    autograd: bool = False
    concurrent_calls: bool = True


LINKS: dict[str, LinkSpec] = {spec.name: spec for spec in (
    LinkSpec("nccl", "nccl", False, lambda group, device: NcclLink(group)),
    LinkSpec("nccl_tokens", "nccl", True, lambda group, device: TokenLink(group)),
    LinkSpec("copy_engine", "copy_engine", None, lambda group, device: CopyEngineLink(group, device),
             cuda_only=True, one_host_only=True, concurrent_calls=False),
)}


def resolve_transport(transport: str, x_TH: torch.Tensor) -> str:
    """The transport a call takes: `transport`, with "auto" decided as `ep.overlap` says (the copy engines for
    CUDA tokens when every rank runs on this host, NCCL otherwise). The same on every rank of a job (same
    options, same environment, tokens on the same kind of device)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"EP transport {transport!r}; expected one of {TRANSPORTS}")
    if transport != "auto":
        return transport
    return "copy_engine" if x_TH.is_cuda and _one_host() is True else "nccl"


def choose(transport: str, token_dispatch: bool, x_TH: torch.Tensor) -> LinkSpec:
    """The registered link the options select for these tokens."""
    resolved = resolve_transport(transport, x_TH)
    for spec in LINKS.values():
        if spec.transport == resolved and spec.token_dispatch in (None, token_dispatch):
            return spec
    raise ValueError(f"no EP link for transport {resolved!r} with token_dispatch={token_dispatch}")


def unmet_needs(spec: LinkSpec, x_TH: torch.Tensor) -> list[str]:
    """What `spec` needs that these tokens or this job do not give (empty: it can run)."""
    unmet = []
    if spec.cuda_only and not x_TH.is_cuda:
        unmet.append(f"CUDA tensors (the tokens are on {x_TH.device})")
    if spec.one_host_only and _one_host() is False:
        unmet.append(f"every rank on one host (WORLD_SIZE {os.environ.get('WORLD_SIZE')}, LOCAL_WORLD_SIZE "
                     f"{os.environ.get('LOCAL_WORLD_SIZE')})")
    if not spec.autograd and x_TH.requires_grad and torch.is_grad_enabled():
        unmet.append("no autograd (the tokens need gradients)")
    return unmet


def build(spec: LinkSpec, group, x_TH: torch.Tensor) -> Link:
    """A `spec` link for these tokens' process group and device, once its needs are checked."""
    unmet = unmet_needs(spec, x_TH)
    if unmet:
        raise ValueError(f"the {spec.name!r} EP link needs {' and '.join(unmet)}")
    return spec.make(group, x_TH.device)


def _one_host() -> bool | None:
    """Whether every rank of the job runs on this host, from torchrun's environment (None: not launched by it)."""
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if world is None or local is None:
        return None
    return world == local

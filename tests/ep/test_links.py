"""ep.links: the registry of the EP exchange's links, what each declares it needs, the choice for a call, and
every registered link at several chunk counts against the reference dispatch/combine on real gloo ranks."""

import pytest
import torch

from modelopt_ext.ep import links
from modelopt_ext.ep.copy_engine import CopyEngineLink
from modelopt_ext.ep.link import Link, NcclLink
from modelopt_ext.ep.token_link import TokenLink
from modelopt_ext.options import TRANSPORTS
from modelopt_ext.testing.multiproc import run_ranks

CHUNKS = (1, 2, 3, 8)
CLASSES = {"nccl": NcclLink, "nccl_tokens": TokenLink, "copy_engine": CopyEngineLink}


def test_every_link_is_registered_with_its_needs():
    assert set(links.LINKS) == set(CLASSES)
    for name, spec in links.LINKS.items():
        assert spec.name == name and spec.transport in TRANSPORTS and issubclass(CLASSES[name], Link)
        assert not spec.autograd  # overlapped_moe is inference-only
    assert links.LINKS["copy_engine"].cuda_only and links.LINKS["copy_engine"].one_host_only
    assert not any(links.LINKS[n].cuda_only or links.LINKS[n].one_host_only for n in ("nccl", "nccl_tokens"))


def test_the_options_choose_the_link(monkeypatch):
    cpu = torch.zeros(2, 4)
    assert links.choose("nccl", False, cpu).name == "nccl"
    assert links.choose("nccl", True, cpu).name == "nccl_tokens"
    assert links.choose("copy_engine", False, cpu).name == "copy_engine"
    assert links.choose("copy_engine", True, cpu).name == "copy_engine"  # lays out its own rows
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert links.choose("auto", True, cpu).name == "nccl_tokens"  # CPU tokens: never the copy engines
    with pytest.raises(ValueError, match="'pigeon'"):
        links.choose("pigeon", False, cpu)


def test_build_refuses_unmet_needs_naming_them(monkeypatch):
    cpu = torch.zeros(2, 4)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match=r"'copy_engine' EP link needs CUDA tensors \(the tokens are on cpu\) and "
                                         r"every rank on one host \(WORLD_SIZE 16, LOCAL_WORLD_SIZE 8\)"):
        links.build(links.LINKS["copy_engine"], None, cpu, 2)
    grad = torch.zeros(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="'nccl' EP link needs no autograd"):
        links.build(links.LINKS["nccl"], None, grad, 2)
    with torch.no_grad():
        assert isinstance(links.build(links.LINKS["nccl"], None, grad, 2), NcclLink)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", sorted(links.LINKS))
def test_every_link_at_every_chunk_count_equals_dispatch_and_combine(name, world_size):
    spec = links.LINKS[name]
    unmet = links.unmet_needs(spec, torch.zeros(1, 1))  # the gloo ranks' tokens are on the CPU
    if unmet:
        pytest.skip(f"{name} needs {' and '.join(unmet)} (run on GPUs: scripts/gpu_check_sync.py)")
    token_dispatch = bool(spec.token_dispatch)
    results = run_ranks("modelopt_ext.testing.ep_bodies:overlap_vs_dispatch", world_size,
                        {"chunks": list(CHUNKS), "token_dispatch": token_dispatch, "transport": spec.transport},
                        timeout_s=240)
    for rank, r in enumerate(results):
        assert r["link_classes"] == [CLASSES[name].__name__], f"rank {rank}: {r}"
        assert r["shapes_ok"], f"rank {rank}: {r}"
        assert r["identical"] == {str(c): True for c in CHUNKS}, f"rank {rank}: {r}"
        assert r["segments_cover_rows"], f"rank {rank}"
        if token_dispatch:  # each token row sent once per rank owning one of its experts, whatever the chunks
            assert set(r["token_rows"].values()) == {r["distinct_token_ranks"]}, f"rank {rank}: {r}"
    if token_dispatch:  # the case the token dispatch exists for occurs
        assert sum(r["distinct_token_ranks"] for r in results) < sum(r["slots"] for r in results)

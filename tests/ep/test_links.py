"""ep.links: the registry of the EP exchange's links, what each declares it needs, the choice for a call, and
every registered link at several chunk counts against the reference dispatch/combine on real gloo ranks; a link
object keeps nothing of a call (two interleaved calls through one link object, and its attributes after them)."""

import pytest
import torch
import torch.distributed as dist

from modelopt_ext.ep import links
from modelopt_ext.ep.copy_engine import CopyEngineLink
from modelopt_ext.ep.link import Link, NcclLink
from modelopt_ext.ep.token_link import TokenLink
from modelopt_ext.options import TRANSPORTS
from modelopt_ext.testing.multiproc import run_ranks

CHUNKS = (1, 2, 3, 8)
CLASSES = {"nccl": NcclLink, "nccl_tokens": TokenLink, "copy_engine": CopyEngineLink}

# ---- per-rank bodies (run on every rank by run_ranks) ----------------------------------------------------------------


def _problem(rank: int, world_size: int, seed: int = 100):
    """fp32 tokens, ids, weights and expert scales of one rank (E = 3): rank 1 holds fewer tokens than the
    largest chunk count, and the last global expert receives nothing. Expert e of rank r: x * scale[e]."""
    E, H, K = 3, 16, 2
    tokens = 5 if rank == 1 else 23
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(world_size * E - 1, generator=g)[:K] for _ in range(tokens)])  # last unused
    w = torch.rand(tokens, K, generator=g)
    scale = torch.arange(1, E + 1, dtype=torch.float32) * (rank + 1)
    return x, ids, w, scale, E


def _reference(x, ids, w, scale, E, group):
    from modelopt_ext.ep.dispatch import combine, dispatch

    rx, rids, meta = dispatch(x, ids, E, group)
    return combine(rx * scale[rids].unsqueeze(-1), w, meta, group)


def _scaled_rows(scale, seen=None):
    """`run_rows` that runs expert e of each segment as x * scale[e] (and notes whether the segments cover the rows)."""

    def run_rows(rows, segments):
        out = torch.empty_like(rows)
        covered = 0
        for e, start, n in segments:
            out[start:start + n] = rows[start:start + n] * scale[e]
            covered += n
        if seen is not None:
            seen["ok"] &= covered == rows.shape[0]
        return out

    return run_rows


class _Recorded:
    """A link whose plans are kept here, in call order (the link object itself keeps none)."""

    def __init__(self, link: Link, plans: list):
        self.link, self.plans = link, plans

    def __getattr__(self, name):
        return getattr(self.link, name)

    def plan(self, *args):
        self.plans.append(self.link.plan(*args))
        return self.plans[-1]


def overlap_vs_dispatch(rank: int, world_size: int, chunks: list[int], token_dispatch: bool = True,
                        transport: str = "nccl"):
    """`ep.overlap.overlapped_moe` through the link `transport` and `token_dispatch` select (`ep.links`) against
    dispatch -> per-row experts -> combine, fp32, for several chunk counts; rank 1 holds fewer tokens than the
    largest chunk count and some experts receive nothing. Also the link each call took, and the token rows it
    sent (token dispatch, from the call's plan) against the distinct (token, rank) pairs."""
    from modelopt_ext.ep import overlap

    x, ids, w, scale, E = _problem(rank, world_size)
    group = dist.group.WORLD
    want = _reference(x, ids, w, scale, E, group)
    seen = {"ok": True}
    identical, token_rows = {}, {}
    made, plans = [], []
    make_link = overlap._link

    def recording_link(*args):
        made.append(make_link(*args))
        return _Recorded(made[-1], plans)

    overlap._link = recording_link
    try:
        with torch.no_grad():
            for c in chunks:
                got = overlap.overlapped_moe(x, ids, w, E, group, _scaled_rows(scale, seen), chunks=c,
                                             token_dispatch=token_dispatch, transport=transport)
                identical[str(c)] = bool(torch.equal(got, want))
                token_rows[str(c)] = getattr(plans[-1], "token_send_off", [None])[-1]
    finally:
        overlap._link = make_link
    distinct = int(sum(len(set((ids[t] // E).tolist())) for t in range(x.shape[0])))
    return {"identical": identical, "segments_cover_rows": seen["ok"], "shapes_ok": tuple(want.shape) == tuple(x.shape),
            "token_rows": token_rows, "distinct_token_ranks": distinct, "slots": ids.numel(),
            "link_classes": sorted({type(link).__name__ for link in made})}


def interleaved_calls(rank: int, world_size: int, name: str):
    """Two `overlapped_moe` calls through ONE link object of the registered link `name`, interleaved: call B
    (other tokens, 3 chunks) runs whole inside call A's first chunk (2 chunks), between A's sends and A's
    returns. Each against dispatch/combine; and the link's attributes before and after."""
    from modelopt_ext.ep import overlap

    group = dist.group.WORLD
    xa, ids_a, w_a, scale, E = _problem(rank, world_size, seed=100)
    xb, ids_b, w_b, _, _ = _problem(rank, world_size, seed=200)
    xb = xb[:, :8].contiguous()  # another width too
    want_a = _reference(xa, ids_a, w_a, scale, E, group)
    want_b = _reference(xb, ids_b, w_b, scale, E, group)
    shared = links.build(links.LINKS[name], group, xa)
    before = dict(vars(shared))
    made = []
    make_link = overlap._link
    got_b = {}

    def the_shared_link(*args):
        made.append(make_link(*args))  # what the registry chose for the call
        return shared

    def run_rows_a(rows, segments):
        if "b" not in got_b:  # A's first chunk: B runs whole, through the same link object
            got_b["b"] = overlap.overlapped_moe(xb, ids_b, w_b, E, group, _scaled_rows(scale), chunks=3,
                                                token_dispatch=bool(links.LINKS[name].token_dispatch),
                                                transport=links.LINKS[name].transport)
        return _scaled_rows(scale)(rows, segments)

    overlap._link = the_shared_link
    try:
        with torch.no_grad():
            got_a = overlap.overlapped_moe(xa, ids_a, w_a, E, group, run_rows_a, chunks=2,
                                           token_dispatch=bool(links.LINKS[name].token_dispatch),
                                           transport=links.LINKS[name].transport)
    finally:
        overlap._link = make_link
    after = vars(shared)
    return {"a": bool(torch.equal(got_a, want_a)), "b": bool(torch.equal(got_b["b"], want_b)),
            "chosen": sorted({type(link).__name__ for link in made}), "calls": len(made),
            "same_attributes": before.keys() == after.keys() and all(after[k] is v for k, v in before.items())}


# ---- tests -----------------------------------------------------------------------------------------------------------


def test_every_link_is_registered_with_its_needs():
    assert set(links.LINKS) == set(CLASSES)
    for name, spec in links.LINKS.items():
        assert spec.name == name and spec.transport in TRANSPORTS and issubclass(CLASSES[name], Link)
        assert not spec.autograd  # overlapped_moe is inference-only
    assert links.LINKS["copy_engine"].cuda_only and links.LINKS["copy_engine"].one_host_only
    assert not any(links.LINKS[n].cuda_only or links.LINKS[n].one_host_only for n in ("nccl", "nccl_tokens"))
    # one peer-mapped buffer per group and device: copy-engine calls must not interleave
    assert {n for n, spec in links.LINKS.items() if spec.concurrent_calls} == {"nccl", "nccl_tokens"}


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
        links.build(links.LINKS["copy_engine"], None, cpu)
    grad = torch.zeros(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="'nccl' EP link needs no autograd"):
        links.build(links.LINKS["nccl"], None, grad)
    with torch.no_grad():
        assert isinstance(links.build(links.LINKS["nccl"], None, grad), NcclLink)
        assert vars(links.build(links.LINKS["nccl_tokens"], "g", grad)) == {"group": "g"}  # nothing of a call


def _skip_unless_it_runs_here(name: str) -> None:
    unmet = links.unmet_needs(links.LINKS[name], torch.zeros(1, 1))  # the gloo ranks' tokens are on the CPU
    if unmet:
        pytest.skip(f"{name} needs {' and '.join(unmet)} (run on GPUs: scripts/gpu_check_sync.py)")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", sorted(links.LINKS))
def test_every_link_at_every_chunk_count_equals_dispatch_and_combine(name, world_size):
    _skip_unless_it_runs_here(name)
    spec = links.LINKS[name]
    token_dispatch = bool(spec.token_dispatch)
    results = run_ranks(overlap_vs_dispatch, world_size,
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


@pytest.mark.parametrize("name", sorted(links.LINKS))
def test_one_link_object_serves_interleaved_calls_and_keeps_nothing_of_them(name):
    _skip_unless_it_runs_here(name)
    if not links.LINKS[name].concurrent_calls:
        pytest.skip(f"{name} declares that its calls must not interleave")
    for rank, r in enumerate(run_ranks(interleaved_calls, 2, {"name": name}, timeout_s=240)):
        assert r["a"] and r["b"], f"rank {rank}: {r}"
        assert r["chosen"] == [CLASSES[name].__name__] and r["calls"] == 2, f"rank {rank}: {r}"
        assert r["same_attributes"], f"rank {rank}: the calls changed the link's attributes"

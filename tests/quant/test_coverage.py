"""Expert coverage: counts per MoE layer and expert, the report files, and EP sums over ranks."""

import json
import struct
import zlib

import pytest
import torch

import modelopt_ext
from modelopt_ext.families import families
from modelopt_ext.quant.coverage import Coverage, record_expert_coverage
from modelopt_ext.testing.checkpoints import copy_checkpoint
from modelopt_ext.testing.multiproc import run_ranks

SPEC = families()["kimi_k3"]


@pytest.fixture(scope="module")
def model(tiny_ckpt, tmp_path_factory):
    ckpt = copy_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("coverage"), "coverage_model")
    return modelopt_ext.from_pretrained(ckpt, trust_remote_code=True, dtype=torch.float32)


def test_counts_every_routed_slot(model):
    ids = torch.randint(13, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), record_expert_coverage(model, SPEC.router_glob, 16) as cov:
        model(input_ids=ids, use_cache=False)
        model(input_ids=ids[:, :5], use_cache=False)
    table = cov.table()
    assert list(table) == [f"language_model.model.layers.{i}.block_sparse_moe.gate" for i in range(1, 6)]
    for row in table.values():
        assert len(row) == 16 and sum(row) == (2 * 24 + 2 * 5) * 4  # tokens x top-4
    # hooks are gone afterwards: another forward does not count
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert cov.table() == table


def test_uncovered_experts_and_report_files(model, tmp_path):
    forced = torch.tensor([0, 1, 2, 3])
    handles = [layer.block_sparse_moe.gate.register_forward_hook(
        lambda m, i, out: (forced.expand_as(out[0]).contiguous(), out[1]))
        for layer in model.language_model.model.layers[1:]]
    try:
        with torch.no_grad(), record_expert_coverage(model, SPEC.router_glob, 16) as cov:
            model(input_ids=torch.randint(13, 500, (1, 8)), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    assert all(v == list(range(4, 16)) for v in cov.uncovered().values()) and len(cov.uncovered()) == 5
    assert "20/80" in cov.summary_line() and "60 received none" in cov.summary_line()
    cov.write_json(tmp_path / "coverage.json")
    data = json.loads((tmp_path / "coverage.json").read_text())
    assert data["uncovered"] == cov.uncovered() and data["counts"] == cov.table()
    cov.write_png(tmp_path / "coverage.png", cell=3)
    png = (tmp_path / "coverage.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (16 * 3, 5 * 3)
    idat_len = struct.unpack(">I", png[33:37])[0]
    raw = zlib.decompress(png[41 : 41 + idat_len])
    assert len(raw) == height * (1 + width * 3)
    assert raw[1 + 3 * 3 * 5 : 1 + 3 * 3 * 5 + 3] == b"\x00\x00\x00"  # expert 5 of layer 1: black (no tokens)


def test_router_glob_must_match(model):
    with pytest.raises(ValueError, match="router glob 'nothing.*'"):
        with record_expert_coverage(model, "nothing.*", 16):
            pass


def test_empty_coverage_has_no_heatmap(tmp_path):
    with pytest.raises(ValueError, match="no coverage recorded"):
        Coverage(16).write_png(tmp_path / "x.png")


# ---- per-rank bodies (run on every rank by run_ranks) ----------------------------------------------------------------


def ep_coverage(rank: int, world_size: int, ckpt: str):
    """Expert coverage recorded on the EP model over each rank's batch (summed over ranks), and in one
    process over every rank's batch."""
    from modelopt_ext.families import families
    from modelopt_ext.quant.coverage import record_expert_coverage

    spec = families()["kimi_k3"]
    kwargs = {"trust_remote_code": True, "dtype": torch.float32, "experts_implementation": "batched_mm"}
    batches = [torch.randint(13, 500, (2, 16), generator=torch.Generator().manual_seed(300 + r))
               for r in range(world_size)]
    model = modelopt_ext.from_pretrained(ckpt, ep_size=world_size, dense="replicate", **kwargs)
    with torch.no_grad(), record_expert_coverage(model, spec.router_glob, 16) as ep:
        model(input_ids=batches[rank], use_cache=False)
    single = modelopt_ext.from_pretrained(ckpt, **kwargs)
    # the single-process recording must not all-reduce: its counts already cover every batch
    with torch.no_grad(), record_expert_coverage(single, spec.router_glob, 16) as ref:
        for ids in batches:
            single(input_ids=ids, use_cache=False)
    return {"ep": ep.table(), "ref": {k: [v // world_size for v in row] for k, row in ref.table().items()}}


def test_ep_coverage_is_summed_over_ranks(tiny_ckpt):
    """Each EP rank routes its own batch; after the recording every rank holds the sum, which equals one
    process routing every batch (the reference divides by the world size because its own sum-over-ranks
    runs once more with identical counts on both ranks)."""
    results = run_ranks(ep_coverage, 2, {"ckpt": str(tiny_ckpt)}, timeout_s=300)
    for r in results:
        assert r["ep"] == r["ref"]
        assert all(sum(row) == 2 * 2 * 16 * 4 for row in r["ep"].values())

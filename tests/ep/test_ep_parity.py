"""Expert-parallel loading on real gloo ranks: logits equal the single-process model, each rank reads only its
experts, and skewed routing (a rank with no tokens, experts with none) works. Each rank uses its own batch.

Exactness is shown with transformers' `batched_mm` experts (one GEMV per row: a row's result does not depend
on which other rows share its expert), where EP and one process agree bit for bit. Grouped GEMMs and the eager
per-expert GEMMs see different row counts per expert under EP (rows from every rank), and CPU GEMM kernels
accumulate differently for different row counts: there the logits agree to fp32 rounding amplified through
the layers (measured up to 1.9e-5; see docs/ep.md)."""

import pytest
import torch

import modelopt_ext
from modelopt_ext.testing.multiproc import run_ranks
from modelopt_ext.testing.routing import force_routing

# ---- per-rank bodies (run on every rank by run_ranks) ----------------------------------------------------------------


def ep_logits(rank: int, world_size: int, ckpt: str, dense: str, force_experts: list[int] | None = None,
              impl: str | None = None, warmup: bool = False):
    """Logits of the EP model and of the same checkpoint in this one process, on a batch of this rank's own
    (`warmup`: the EP load runs the warm-up forward on a thread meanwhile)."""
    kwargs = {"trust_remote_code": True, "dtype": torch.float32}
    if impl is not None:
        kwargs["experts_implementation"] = impl
    single = modelopt_ext.from_pretrained(ckpt, **kwargs)
    warm = {"warmup_tokens": (2, 16)} if warmup else {}
    model = modelopt_ext.from_pretrained(ckpt, ep_size=world_size, dense=dense, **kwargs, **warm)
    if force_experts is not None:
        force_routing(single, force_experts)
        force_routing(model, force_experts)
    ids = torch.randint(13, 500, (2, 16), generator=torch.Generator().manual_seed(100 + rank))
    with torch.no_grad():
        ep = model(input_ids=ids, use_cache=False).logits
        ref = single(input_ids=ids, use_cache=False).logits
    experts = model.language_model.model.layers[1].block_sparse_moe.experts
    return {"ep": ep, "ref": ref, "bytes_read": model.modelopt_ext_bytes_read,
            "plan": model.modelopt_ext_plan.to_dict(), "local_experts": experts.num_experts,
            "warmup_s": model.modelopt_ext_warmup_s}


def plan_refusal(rank: int, world_size: int, ckpt: str, ep_size: int):
    """Every rank must raise the same error for a plan that cannot work."""
    try:
        modelopt_ext.from_pretrained(ckpt, ep_size=ep_size, trust_remote_code=True)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def _checkpoint_bytes(ckpt):
    import json

    from safetensors import safe_open

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    experts = dense = 0
    for name in sorted(set(index.values())):
        with safe_open(str(ckpt / name), "pt") as f:
            for key in f.keys():
                n = f.get_slice(key).get_shape()
                nbytes = torch.Size(n).numel() * (1 if "weight_packed" in key or "weight_scale" in key else 0)
                if ".experts." in key:
                    experts += nbytes
                else:
                    dense += f.get_tensor(key).numel() * f.get_tensor(key).element_size()
    return experts, dense


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dense", ["replicate", "fsdp"])
def test_ep_logits_equal_single_process(tiny_ckpt, world, dense):
    results = run_ranks(ep_logits, world, {"ckpt": str(tiny_ckpt), "dense": dense, "impl": "batched_mm"},
                        timeout_s=300)
    experts_total, dense_total = _checkpoint_bytes(tiny_ckpt)
    for rank, r in enumerate(results):
        assert r["plan"]["ep_size"] == world and r["plan"]["dense"] == dense
        assert r["local_experts"] == 16 // world
        assert torch.equal(r["ep"], r["ref"]), f"rank {rank}: {(r['ep'] - r['ref']).abs().max()}"
        # each rank reads exactly its share of the experts; dense all (replicated) or about 1/world (FSDP)
        assert r["bytes_read"]["experts"] == experts_total // world
        if dense == "replicate":
            assert r["bytes_read"]["dense"] == dense_total
        else:
            assert r["bytes_read"]["dense"] < dense_total / world * 1.2
    assert len({tuple(r["ep"].shape) for r in results}) == 1
    assert not torch.equal(results[0]["ep"], results[1]["ep"])  # ranks ran different batches


def test_a_warmup_during_the_ep_load_changes_nothing(tiny_ckpt):
    """The warm-up forward runs on a thread of every rank while the EP load's collectives run on the main
    thread; the logits still equal the single-process ones exactly."""
    results = run_ranks(ep_logits, 2, {"ckpt": str(tiny_ckpt), "dense": "replicate", "impl": "batched_mm",
                                                 "warmup": True}, timeout_s=300)
    for rank, r in enumerate(results):
        assert isinstance(r["warmup_s"], float), f"rank {rank}: the warm-up did not run"
        assert torch.equal(r["ep"], r["ref"]), f"rank {rank}: {(r['ep'] - r['ref']).abs().max()}"


@pytest.mark.parametrize("world,dense", [(2, "replicate"), (4, "fsdp")])
def test_skewed_routing_idle_ranks_and_experts(tiny_ckpt, world, dense):
    """Every token to experts 0..3 (all on rank 0): other ranks receive nothing, rank 0's other experts too."""
    results = run_ranks(ep_logits, world, {"ckpt": str(tiny_ckpt), "dense": dense, "impl": "batched_mm",
                                                     "force_experts": [0, 1, 2, 3]}, timeout_s=300)
    for rank, r in enumerate(results):
        assert torch.equal(r["ep"], r["ref"]), f"rank {rank}"


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
def test_grouped_and_eager_experts_under_ep(tiny_ckpt, impl):
    results = run_ranks(ep_logits, 4, {"ckpt": str(tiny_ckpt), "dense": "fsdp", "impl": impl},
                        timeout_s=300)
    for rank, r in enumerate(results):
        assert (r["ep"] - r["ref"]).abs().max().item() <= 5e-5, f"rank {rank}"


def test_bad_plan_fails_every_rank_with_the_same_message(tiny_ckpt):
    results = run_ranks(plan_refusal, 2, {"ckpt": str(tiny_ckpt), "ep_size": 3}, timeout_s=120)
    assert results[0] is not None and results[0] == results[1]
    assert "RankFailure" in results[0] and "planning" in results[0] and "3" in results[0]

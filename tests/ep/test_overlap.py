"""ep.overlap on real gloo ranks (every link at several chunk counts against dispatch/combine: tests/ep/test_links.py)."""

import pytest
import torch

import modelopt_ext
from modelopt_ext.ep.overlap import overlapped_moe
from modelopt_ext.testing.multiproc import run_ranks


def overlap_path_logits(rank: int, world_size: int, ckpt: str, options: dict | None = None):
    """Logits of an EP model whose `torch_a2a` takes the GPU inference path (`ep.overlap` + `run_rows`), forced
    here on the CPU by making `fast_path` true, against the usual dispatch/combine path of the same model;
    `options` (ExpertsOptions fields) go to from_pretrained, and the exchange settings each `overlapped_moe`
    call of the backend received are recorded."""
    from modelopt_ext.ep import backend
    from modelopt_ext.experts import fused as experts_module
    from modelopt_ext.options import ExpertsOptions

    kwargs = {"trust_remote_code": True, "dtype": torch.float32,
              "experts_options": ExpertsOptions(**(options or {}))}
    model = modelopt_ext.from_pretrained(ckpt, ep_size=world_size, **kwargs)
    exchanges = []
    original_moe = backend.overlapped_moe

    def recording_moe(*args, **kw):
        exchanges.append({k: kw[k] for k in ("chunks", "transport", "token_dispatch")})
        return original_moe(*args, **kw)

    backend.overlapped_moe = recording_moe
    ids = torch.randint(13, 500, (2, 16), generator=torch.Generator().manual_seed(200 + rank))
    taken = {"n": 0}

    def forced(self, hidden_states):
        taken["n"] += 1
        return not torch.is_grad_enabled() and self._quantizer_free()

    with torch.no_grad():
        usual = model(input_ids=ids, use_cache=False).logits
        original = experts_module.FusedExperts.fast_path
        experts_module.FusedExperts.fast_path = forced
        try:
            overlapped = model(input_ids=ids, use_cache=False).logits
        finally:
            experts_module.FusedExperts.fast_path = original
            backend.overlapped_moe = original_moe
    return {"usual": usual, "overlapped": overlapped, "fast_path_calls": taken["n"], "exchanges": exchanges,
            "plan_options": model.modelopt_ext_plan.experts_options.to_dict()}


def test_overlapped_moe_refuses_autograd():
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference-only"):
        overlapped_moe(x, torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2), 2, None, lambda r, s: r)


def test_torch_a2a_inference_path_gives_the_usual_logits(tiny_ckpt):
    """The model-level wiring of the GPU inference path (backend -> overlapped_moe -> experts.run_rows on the EP
    shards), forced on CPU gloo ranks: same logits as dispatch/combine up to fp32 GEMM rounding."""
    results = run_ranks(overlap_path_logits, 2, {"ckpt": str(tiny_ckpt)},
                        timeout_s=240)
    for rank, r in enumerate(results):
        assert r["fast_path_calls"] > 0, f"rank {rank}: the backend never asked for the fast path"
        torch.testing.assert_close(r["overlapped"], r["usual"], rtol=1e-4, atol=5e-5)  # ep_smoke's bound
        assert r["exchanges"] and all(e == {"chunks": 2, "transport": "nccl", "token_dispatch": False}
                                      for e in r["exchanges"])


@pytest.mark.parametrize("options", [{"chunks": 3, "token_dispatch": True}, {"pipeline": False}],
                         ids=["chunks3-token-dispatch", "no-pipeline"])
def test_experts_options_reach_the_backend_of_every_rank(tiny_ckpt, options):
    """`from_pretrained(experts_options=...)` under EP: the plan the ranks agreed on carries them and the
    backend runs each exchange with them (or, without the pipeline, dispatch/combine); the logits stay."""
    results = run_ranks(overlap_path_logits, 2,
                        {"ckpt": str(tiny_ckpt), "options": options}, timeout_s=240)
    for rank, r in enumerate(results):
        assert {k: r["plan_options"][k] for k in options} == options
        if options.get("pipeline") is False:
            assert r["exchanges"] == [], f"rank {rank}: the pipeline ran although it was off"
        else:
            assert r["exchanges"] and all(e == {"chunks": 3, "transport": "nccl", "token_dispatch": True}
                                          for e in r["exchanges"])
        torch.testing.assert_close(r["overlapped"], r["usual"], rtol=1e-4, atol=5e-5)

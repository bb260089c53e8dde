"""ep.overlap on real gloo ranks (every link at several chunk counts against dispatch/combine: tests/ep/test_links.py)."""

import pytest
import torch

from modelopt_ext.ep.overlap import overlapped_moe
from modelopt_ext.testing.multiproc import run_ranks


def test_overlapped_moe_refuses_autograd():
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference-only"):
        overlapped_moe(x, torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2), 2, None, lambda r, s: r)


def test_torch_a2a_inference_path_gives_the_usual_logits(tiny_ckpt):
    """The model-level wiring of the GPU inference path (backend -> overlapped_moe -> experts.run_rows on the EP
    shards), forced on CPU gloo ranks: same logits as dispatch/combine up to fp32 GEMM rounding."""
    results = run_ranks("modelopt_ext.testing.ep_bodies:overlap_path_logits", 2, {"ckpt": str(tiny_ckpt)},
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
    results = run_ranks("modelopt_ext.testing.ep_bodies:overlap_path_logits", 2,
                        {"ckpt": str(tiny_ckpt), "options": options}, timeout_s=240)
    for rank, r in enumerate(results):
        assert {k: r["plan_options"][k] for k in options} == options
        if options.get("pipeline") is False:
            assert r["exchanges"] == [], f"rank {rank}: the pipeline ran although it was off"
        else:
            assert r["exchanges"] and all(e == {"chunks": 3, "transport": "nccl", "token_dispatch": True}
                                          for e in r["exchanges"])
        torch.testing.assert_close(r["overlapped"], r["usual"], rtol=1e-4, atol=5e-5)

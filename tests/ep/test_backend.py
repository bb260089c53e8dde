"""The `torch_a2a` EP implementation: registration, the experts' class forward looked up at call time (as after
ModelOpt's convert swaps the experts' class), a rank receiving no tokens, and scripts/ep_smoke.py under torchrun."""

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.distributed.expert_parallel import EPImplementationInterface

import modelopt_ext
from modelopt_ext.ep.backend import NAME, TorchA2AEP, register_torch_a2a, run_local_experts
from modelopt_ext.testing.multiproc import free_port, run_ranks
from modelopt_ext.testing.routing import force_routing

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "scripts" / "ep_smoke.py"
WORLD = 2


def test_register_torch_a2a_is_idempotent_and_visible_to_transformers():
    register_torch_a2a()
    mapping = dict(EPImplementationInterface._global_mapping)
    register_torch_a2a()
    assert EPImplementationInterface._global_mapping == mapping
    interface = EPImplementationInterface()
    assert NAME == "torch_a2a" and NAME in interface
    assert interface[NAME] is TorchA2AEP
    for builtin in ("auto", "all_to_all", "all_reduce"):  # nothing else replaced
        assert builtin in interface


def test_run_local_experts_looks_the_class_forward_up_at_call_time():
    """An instance `forward` (what transformers' EP style installs) is bypassed; a class swapped later runs."""

    class Experts(torch.nn.Module):
        def forward(self, x, ids, weights):
            return x * 2

    class Swapped(Experts):
        def forward(self, x, ids, weights):
            self.seen = (x.shape, ids.shape, weights.shape)
            return super().forward(x, ids, weights) + 1

    experts = Experts()
    experts.forward = lambda *a: pytest.fail("the instance forward installed at load must not run")
    x, ids, w = torch.ones(3, 2), torch.tensor([0, 1, 0]), torch.ones(3)
    assert torch.equal(run_local_experts(experts, x, ids, w), x * 2)
    experts.__class__ = Swapped
    assert torch.equal(run_local_experts(experts, x, ids, w), x * 2 + 1)
    assert experts.seen == ((3, 2), (3, 1), (3, 1))  # top-1: ids and weights get a k dimension


# ---- per-rank bodies (run on every rank by run_ranks) ----------------------------------------------------------------


def _recording_subclass(base: type, log: dict) -> type:
    """A subclass of `base` (as ModelOpt's convert creates) whose forward records what it received."""

    class Recording(base):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            log.setdefault(self._recording_name, []).append({
                "rows": int(hidden_states.shape[0]),
                "max_id": int(top_k_index.max()) if top_k_index.numel() else -1,
                "min_id": int(top_k_index.min()) if top_k_index.numel() else -1,
                "num_experts": int(self.num_experts),
            })
            return super().forward(hidden_states, top_k_index, top_k_weights)

    Recording.__name__ = Recording.__qualname__ = f"Recording{base.__name__}"
    return Recording


def class_forward_after_swap(rank: int, world_size: int, ckpt: str):
    """Load with EP (torch_a2a), swap every experts module's class for a recording subclass, and run the
    model on this rank's batch, then again with every token routed to rank 0's experts."""
    kwargs = {"trust_remote_code": True, "dtype": torch.float32, "experts_implementation": "batched_mm"}
    single = modelopt_ext.from_pretrained(ckpt, **kwargs)
    model = modelopt_ext.from_pretrained(ckpt, ep_size=world_size, dense="replicate", **kwargs)
    ids = torch.randint(13, 500, (2, 16), generator=torch.Generator().manual_seed(200 + rank))
    with torch.no_grad():
        before = model(input_ids=ids, use_cache=False).logits
        ref = single(input_ids=ids, use_cache=False).logits
    log: dict = {}
    experts = {n: m for n, m in model.named_modules() if n.endswith("block_sparse_moe.experts")}
    classes = {}
    for name, module in experts.items():
        base = type(module)
        if base not in classes:
            classes[base] = _recording_subclass(base, log)
        module._recording_name = name
        module.__class__ = classes[base]
    with torch.no_grad():
        after = model(input_ids=ids, use_cache=False).logits
    swapped_log = {k: list(v) for k, v in log.items()}
    log.clear()
    top_k = model.config.get_text_config().num_experts_per_token
    force_routing(single, list(range(top_k)))
    force_routing(model, list(range(top_k)))
    with torch.no_grad():
        forced = model(input_ids=ids, use_cache=False).logits
        forced_ref = single(input_ids=ids, use_cache=False).logits
    return {"before": before, "after": after, "ref": ref, "log": swapped_log, "forced": forced,
            "forced_ref": forced_ref, "forced_log": dict(log), "moe_layers": sorted(experts),
            "classes": sorted(type(m).__name__ for m in experts.values()),
            "num_local_experts": experts[sorted(experts)[0]].num_experts, "top_k": top_k,
            "tokens": ids.numel()}


@pytest.fixture(scope="module")
def swapped(tiny_ckpt):
    return run_ranks(class_forward_after_swap, WORLD, {"ckpt": str(tiny_ckpt)}, timeout_s=300)


def test_swapped_experts_class_runs_on_every_rank_with_local_ids(swapped):
    layers = swapped[0]["moe_layers"]
    assert len(layers) == 5  # layer 0 is dense
    for rank, r in enumerate(swapped):
        assert r["num_local_experts"] == 16 // WORLD
        assert set(r["classes"]) == {"RecordingKimiK3PackedExperts"}
        assert sorted(r["log"]) == layers, f"rank {rank}: the swapped class forward did not run in every MoE layer"
        for layer, calls in r["log"].items():
            assert len(calls) == 1, (rank, layer, calls)
            call = calls[0]
            assert call["num_experts"] == r["num_local_experts"]
            assert 0 <= call["min_id"] <= call["max_id"] < r["num_local_experts"], (rank, layer, call)
        assert torch.equal(r["after"], r["before"]), f"rank {rank}: logits changed by the class swap"
        assert torch.equal(r["after"], r["ref"]), f"rank {rank}: {(r['after'] - r['ref']).abs().max()}"
    for layer in layers:  # every routed slot of every rank reached exactly one rank's experts
        assert sum(r["log"][layer][0]["rows"] for r in swapped) == sum(r["tokens"] * r["top_k"] for r in swapped)


def test_a_rank_receiving_no_tokens_runs_one_dummy_row(swapped):
    """Every token routed to experts 0..top_k-1 (all on rank 0): rank 1 receives nothing, and the backend runs
    its experts on one zero row (keeping autograd connected) whose output it drops."""
    layers = swapped[0]["moe_layers"]
    total_slots = sum(r["tokens"] * r["top_k"] for r in swapped)
    for rank, r in enumerate(swapped):
        assert sorted(r["forced_log"]) == layers, f"rank {rank}"
        for layer, calls in r["forced_log"].items():
            assert len(calls) == 1, (rank, layer, calls)
            if rank == 0:
                assert calls[0]["rows"] == total_slots
                assert calls[0]["max_id"] == r["top_k"] - 1
            else:
                assert calls[0]["rows"] == 1 and calls[0]["max_id"] == 0, (rank, layer, calls)
        assert torch.equal(r["forced"], r["forced_ref"]), f"rank {rank}: {(r['forced'] - r['forced_ref']).abs().max()}"
        assert not torch.equal(r["forced"], r["ref"])  # the routing was really forced


# ---- scripts/ep_smoke.py -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_module():
    spec = importlib.util.spec_from_file_location("ep_smoke_script", SMOKE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ep_smoke_tolerance_check(smoke_module):
    rows = [{"rank": 0, "max_abs_diff": 0.0}, {"rank": 1, "max_abs_diff": 5e-5}, {"rank": 2, "max_abs_diff": 6e-5},
            {"rank": 3, "max_abs_diff": math.nan}, {"rank": 4, "max_abs_diff": math.inf}]
    assert smoke_module.failing_ranks(rows, 5e-5) == [2, 3, 4]
    assert smoke_module.failing_ranks(rows[:2], 5e-5) == []
    with pytest.raises(SystemExit):
        smoke_module.parse_args(["--model", "x", "--tol", "-1"])
    args = smoke_module.parse_args(["--model", "x"])
    assert (args.tol, args.ep, args.dense) == (5e-5, None, None)


def test_ep_smoke_under_torchrun(tiny_ckpt):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
           str(free_port()), str(SMOKE.relative_to(REPO)), "--model", str(tiny_ckpt)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    header = re.search(r"rank\s+local experts\s+experts bytes read\s+dense bytes read\s+max \|logit diff\|", output)
    assert header, output[-6000:]
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+([\d,]+)\s+([\d,]+)\s+(\S+)\s*$", output[header.end():], re.M)
    assert [int(r[0]) for r in rows] == list(range(WORLD)), output[-6000:]
    for rank, local, experts_bytes, dense_bytes, diff in rows:
        assert int(local) == 16 // WORLD
        assert int(experts_bytes.replace(",", "")) > 0 and int(dense_bytes.replace(",", "")) > 0
        assert float(diff) <= 5e-5
    assert "every rank within" in output

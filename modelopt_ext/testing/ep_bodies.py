"""Per-rank bodies for the multi-process EP tests (run by `modelopt_ext.testing.multiproc.run_ranks`).

Each takes (rank, world_size, **kwargs) inside an initialised gloo group and returns tensors/values that
the test compares with single-process results or hand-computed expectations.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import modelopt_ext
from modelopt_ext.ep.dispatch import combine, dispatch
from modelopt_ext.testing.routing import force_routing

# dispatch_by_hand: 2 ranks, 2 experts each (global 0,1 on rank 0; 2,3 on rank 1), 3 tokens, top-2.
HAND_IDS = {0: [[3, 0], [1, 2], [2, 3]], 1: [[0, 1], [0, 3], [1, 0]]}
HAND_WEIGHTS = {0: [[0.5, 0.25], [1.0, 2.0], [0.125, 4.0]], 1: [[1.0, 0.5], [2.0, 0.25], [4.0, 8.0]]}


def hand_tokens(rank: int) -> torch.Tensor:
    """Token t of rank r is [100 r + t, -(100 r + t)]."""
    base = torch.tensor([100.0 * rank + t for t in range(3)])
    return torch.stack([base, -base], dim=1)


def dispatch_by_hand(rank: int, world_size: int):
    x = hand_tokens(rank)
    ids = torch.tensor(HAND_IDS[rank])
    recv_x, recv_ids, meta = dispatch(x, ids, num_local_experts=2, group=dist.group.WORLD)
    # a hand-checkable "expert": multiply by (global expert id + 1)
    y = recv_x * (recv_ids + 2 * rank + 1).unsqueeze(-1).to(recv_x.dtype)
    out = combine(y, torch.tensor(HAND_WEIGHTS[rank]), meta, dist.group.WORLD)
    return {"recv_x": recv_x, "recv_ids": recv_ids, "send_sizes": meta.send_sizes,
            "recv_sizes": meta.recv_sizes, "out": out}


# combine_bf16_by_hand: HAND_IDS' routing; weights that bf16 cannot hold (rounding them to bf16 moves each by
# up to 2**-9 relative) and tokens whose expert outputs bf16 holds exactly (few mantissa bits).
BF16_WEIGHTS = {0: [[1 / 3, 0.1], [0.7, 0.2], [2 / 3, 0.45]], 1: [[0.3, 1 / 7], [0.55, 0.35], [0.9, 1 / 9]]}


def bf16_tokens(rank: int) -> torch.Tensor:
    """bf16 [3, 2]: token t of rank r is [1 + r/4 + t/16, -(2 + t/8)]; times 1..4 stays exact in bf16."""
    t = torch.arange(3, dtype=torch.float32)
    return torch.stack([1 + 0.25 * rank + t / 16, -(2 + t / 8)], dim=1).to(torch.bfloat16)


def combine_bf16_by_hand(rank: int, world_size: int):
    """bf16 tokens through dispatch -> "expert" (times global expert id + 1) -> combine with fp32 weights;
    the overlapped pipeline (`ep.overlap`, both NCCL-style links on gloo, 1 and 2 chunks) on the same inputs."""
    from modelopt_ext.ep import overlap

    x, ids, w = bf16_tokens(rank), torch.tensor(HAND_IDS[rank]), torch.tensor(BF16_WEIGHTS[rank])
    group = dist.group.WORLD
    recv_x, recv_ids, meta = dispatch(x, ids, num_local_experts=2, group=group)
    y = recv_x * (recv_ids + 2 * rank + 1).unsqueeze(-1).to(recv_x.dtype)
    out = combine(y, w, meta, group)

    def run_rows(rows, segments):
        result = torch.empty_like(rows)
        for e, start, n in segments:
            result[start:start + n] = rows[start:start + n] * (e + 2 * rank + 1)
        return result

    pipelined = {}
    for token_dispatch in (False, True):
        for chunks in (1, 2):
            with torch.no_grad():
                got = overlap.overlapped_moe(x, ids, w, 2, group, run_rows, chunks=chunks,
                                             token_dispatch=token_dispatch)
            pipelined[f"token_dispatch={token_dispatch},chunks={chunks}"] = got
    return {"out": out, "pipelined": pipelined}


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


# --- modelopt_ext.dist (tests/test_dist.py) ---


def dist_all_or_fail_and_agree(rank: int, world_size: int):
    """all_or_fail and agree on every rank: what each returned or raised, as plain values."""
    from modelopt_ext.dist import RankFailure, agree, all_or_fail

    def outcome(fn):
        try:
            return {"value": fn(), "error": None}
        except RankFailure as e:
            cause = e.__cause__
            return {"value": None, "error": str(e), "type": type(e).__name__,
                    "cause": None if cause is None else f"{type(cause).__name__}: {cause}"}

    def fail_on(ranks):
        def fn():
            if rank in ranks:
                raise ValueError(f"boom on rank {rank}")
            return rank * 10
        return fn

    differing = world_size - 1
    return {
        "one_fails": outcome(lambda: all_or_fail("step one", fail_on({1}))),
        "two_fail": outcome(lambda: all_or_fail("step two", fail_on({1, 2}))),
        "all_succeed": outcome(lambda: all_or_fail("step three", fail_on(set()))),
        "agree_equal": outcome(lambda: agree("the plan", {"ep": world_size, "dense": "replicate"})),
        "agree_differs": outcome(lambda: agree("the width", 128 + (rank == differing))),
    }


def dist_stalled_rank(rank: int, world_size: int, timeout_s: float, stall_s: float):
    """Lower the group's timeout to `timeout_s`; rank 1 stalls `stall_s` before the collective. Returns how
    long each rank's all_or_fail took and what it raised."""
    import datetime
    import time

    from torch.distributed.distributed_c10d import _set_pg_timeout

    from modelopt_ext.dist import all_or_fail

    _set_pg_timeout(datetime.timedelta(seconds=timeout_s))
    if rank == 1:
        time.sleep(stall_s)
    start = time.monotonic()
    try:
        all_or_fail("the stalled step", lambda: rank)
        error = None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    return {"elapsed": time.monotonic() - start, "error": error}


# --- torch_a2a backend (tests/ep/test_backend.py) ---


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


def ep_modelopt_fp8(rank: int, world_size: int, ckpt: str, dense: str):
    """ModelOpt FP8 calibration of the EP model: per-expert weight amax of this rank's experts, and a forward
    after conversion (ModelOpt replaces the experts' class and instance forward)."""
    import modelopt.torch.quantization as mtq

    model = modelopt_ext.from_pretrained(ckpt, ep_size=world_size, dense=dense, trust_remote_code=True,
                                         dtype=torch.float32)
    ids = torch.randint(13, 500, (2, 16), generator=torch.Generator().manual_seed(rank))

    def loop(m):
        with torch.no_grad():
            m(input_ids=ids, use_cache=False)

    model = mtq.quantize(model, mtq.FP8_DEFAULT_CFG, loop)
    amax = {}
    for i, layer in enumerate(model.language_model.model.layers):
        block = getattr(layer, "block_sparse_moe", None)
        if block is None:
            continue
        experts = block.experts
        amax[i] = {
            "class": type(experts).__name__,
            "gate_up": [float(q.amax) for q in experts.gate_up_proj_weight_quantizers],
            "down": [float(q.amax) for q in experts.down_proj_weight_quantizers],
        }
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    return {"amax": amax, "finite": bool(torch.isfinite(logits).all()), "local": experts.num_experts}


def ep_calibrate_and_sync(rank: int, world_size: int, ckpt: str, dense: str = "replicate",
                          force_experts: list[int] | None = None):
    """FP8 max calibration under EP with modelopt_ext's amax sync, and one process calibrated on every
    rank's batch: the amax the two end with, by quantizer name (per-expert ones by global expert id)."""
    import copy

    import modelopt.torch.quantization as mtq

    from modelopt_ext.quant.sync import calibration_algorithm, sync_amax

    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    cfg["algorithm"] = calibration_algorithm("max")
    kwargs = {"trust_remote_code": True, "dtype": torch.float32, "experts_implementation": "batched_mm"}
    batches = [torch.randint(13, 500, (2, 16), generator=torch.Generator().manual_seed(200 + r))
               for r in range(world_size)]

    def run(model, which):
        if force_experts is not None:
            force_routing(model, force_experts)

        def loop(m):
            with torch.no_grad():
                for ids in which:
                    m(input_ids=ids, use_cache=False)
        return mtq.quantize(model, cfg, loop)

    def amax_by_name(model, local_offset):
        out = {}
        for name, q in model.named_modules():
            if type(q).__name__ == "TensorQuantizer" and q.amax is not None:
                if "_weight_quantizers." in name:
                    head, _, idx = name.rpartition(".")
                    name = f"{head}.{int(idx) + local_offset}"
                out[name] = q.amax.detach().clone()
        return out

    model = run(modelopt_ext.from_pretrained(ckpt, ep_size=world_size, dense=dense, **kwargs), [batches[rank]])
    report = sync_amax(model)
    local = model.language_model.model.layers[1].block_sparse_moe.experts.num_experts
    ep = amax_by_name(model, rank * local)
    single = run(modelopt_ext.from_pretrained(ckpt, **kwargs), batches)
    return {"ep": ep, "ref": amax_by_name(single, 0), "report": report}


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


def ep_calibrate_policy(rank: int, world_size: int, ckpt: str, uncovered: str, grouped_statistics: str = "cuda"):
    """calibrate() on EP2 with routing forced to rank 0's experts 0..3, under an uncovered-experts policy;
    `grouped_statistics="always"` takes the overlapped pipeline on the CPU (rank 1 then receives no rows)."""
    import modelopt.torch.quantization as mtq

    from modelopt_ext.families import families
    from modelopt_ext.options import ExpertsOptions
    from modelopt_ext.quant.calibrate import calibrate

    spec = families()["kimi_k3"]
    model = modelopt_ext.from_pretrained(ckpt, ep_size=world_size, dense="replicate", trust_remote_code=True,
                                         dtype=torch.float32, experts_implementation="batched_mm",
                                         experts_options=ExpertsOptions(grouped_statistics=grouped_statistics))
    force_routing(model, [0, 1, 2, 3])
    batches = [{"input_ids": torch.randint(13, 500, (2, 12), generator=torch.Generator().manual_seed(400 + rank))}]
    from modelopt_ext.testing.export_bodies import counting_pipelined_calls

    try:
        with counting_pipelined_calls() as counts:
            result = calibrate(model, mtq.FP8_DEFAULT_CFG, batches, router_glob=spec.router_glob, num_experts=16,
                               uncovered=uncovered)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    experts = result.model.language_model.model.layers[1].block_sparse_moe.experts
    return {"uncovered": result.coverage.uncovered(), "sync": result.sync, "pipelined_calls": counts["pipelined"],
            "down_input_amax": float(experts.down_proj_input_quantizer.amax)}


def overlap_vs_dispatch(rank: int, world_size: int, chunks: list[int], token_dispatch: bool = True,
                        transport: str = "nccl"):
    """`ep.overlap.overlapped_moe` through the link `transport` and `token_dispatch` select (`ep.links`) against
    dispatch -> per-row experts -> combine, fp32, for several chunk counts; rank 1 holds fewer tokens than the
    largest chunk count and some experts receive nothing. Also the link each call took, and the token rows it
    sent (token dispatch) against the distinct (token, rank) pairs."""
    from modelopt_ext.ep import overlap
    from modelopt_ext.ep.dispatch import combine, dispatch

    E, H, K = 3, 16, 2
    tokens = 5 if rank == 1 else 23
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(world_size * E - 1, generator=g)[:K] for _ in range(tokens)])  # last unused
    w = torch.rand(tokens, K, generator=g)
    scale = torch.arange(1, E + 1, dtype=torch.float32) * (rank + 1)  # expert e of this rank: x * scale[e]
    group = dist.group.WORLD
    rx, rids, meta = dispatch(x, ids, E, group)
    want = combine(rx * scale[rids].unsqueeze(-1), w, meta, group)
    seen = {"ok": True}

    def run_rows(rows, segments):
        out = torch.empty_like(rows)
        covered = 0
        for e, start, n in segments:
            out[start:start + n] = rows[start:start + n] * scale[e]
            covered += n
        seen["ok"] &= covered == rows.shape[0]
        return out

    identical, token_rows = {}, {}
    links = []
    make_link = overlap._link

    def recording_link(*args):
        links.append(make_link(*args))
        return links[-1]

    overlap._link = recording_link
    try:
        with torch.no_grad():
            for c in chunks:
                got = overlap.overlapped_moe(x, ids, w, E, group, run_rows, chunks=c, token_dispatch=token_dispatch,
                                             transport=transport)
                identical[str(c)] = bool(torch.equal(got, want))
                token_rows[str(c)] = getattr(links[-1], "token_send_off", [None])[-1]
    finally:
        overlap._link = make_link
    distinct = int(sum(len(set((ids[t] // E).tolist())) for t in range(tokens)))
    return {"identical": identical, "segments_cover_rows": seen["ok"], "shapes_ok": tuple(want.shape) == (tokens, H),
            "token_rows": token_rows, "distinct_token_ranks": distinct, "slots": tokens * K,
            "link_classes": sorted({type(link).__name__ for link in links})}


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


def calibrate_algorithm_and_export(rank: int, world_size: int, ckpt: str, out: str, recipe: str,
                                   algorithm: dict | str, dense: str = "replicate", batches: int = 4):
    """Load (EP over the world when it has more than one rank), calibrate `recipe` with `algorithm` in place of
    its own on this rank's share of `batches` fixed batches (`export_bodies.calibration_batches`), export to
    `out`. Returns every quantizer's amax by name (per-expert ones by global expert id) as fp32, and the sync
    report."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    from modelopt_ext.export.writer import export_checkpoint
    from modelopt_ext.families import families
    from modelopt_ext.quant.calibrate import calibrate
    from modelopt_ext.quant.recipes import quant_config
    from modelopt_ext.testing.export_bodies import calibration_batches, verify_on_rank_0

    kwargs = {"trust_remote_code": True, "dtype": torch.float32}
    if world_size > 1:
        kwargs.update(ep_size=world_size, dense=dense)
    model = modelopt_ext.from_pretrained(ckpt, **kwargs)
    cfg = dict(quant_config(recipe, model.config))
    cfg["algorithm"] = algorithm
    result = calibrate(model, cfg, calibration_batches(rank, world_size, batches),
                       router_glob=families()["kimi_k3"].router_glob, num_experts=16)
    amax = {}
    for name, q in result.model.named_modules():
        if isinstance(q, TensorQuantizer) and getattr(q, "_amax", None) is not None:
            if "_weight_quantizers." in name:
                head, _, idx = name.rpartition(".")
                local = result.model.get_submodule(head.rpartition(".")[0]).num_experts
                name = f"{head}.{int(idx) + rank * local}"
            amax[name] = q._amax.detach().float().clone()
    export_checkpoint(result.model, out, source_dir=ckpt, overwrite=True)
    verify_on_rank_0(rank, out, ckpt)
    return {"amax": amax, "sync": result.sync}

"""One rank's share of an EP64 Kimi-K3 run at the real widths, through the real code paths, in one process.

    PYTHONPATH=. python3 scripts/bench_rank_share.py --out $OUT/rank_share.json     # one H200, ~5 minutes
    PYTHONPATH=. python3 scripts/bench_rank_share.py --tiny --out /tmp/rs.json      # CPU smoke, small widths

The model: a generated stand-in (`make_tiny` with `text_overrides`) with Kimi-K3's widths taken from the
bundled real config (hidden 7168, latent 3584, expert width 3072, KDA 96 x 128, MLA q_lora 1536 / kv_lora 512 /
192-dim q-k / 128-dim v with the output gate, dense MLP 33792, 2 shared experts of 3072) and three text layers,
one of each kind (layer 0 dense-MLP KDA, layer 1 MoE KDA, layer 2 MoE MLA: the warm-up model's schedule,
`models/kimi_k3/warmup.py`), 14 routed experts a MoE layer stored MXFP4 (896 / EP64). The vocabulary is
reduced (--vocab, 4096); the embedding + lm_head at the real vocabulary 163840 are timed apart (gather, the
[T, 7168] x [7168, 163840] bf16 GEMM and the fp32 copy of the logits the model makes).

Routing: at EP64 with balanced routing a rank with T tokens receives T x 16 routed rows for its 14 experts.
One process cannot route 16 slots a token to 14 experts, so top_k = 14 here (every token to every local
expert: T x 14 rows, balanced by construction). The per-layer figures are scaled to 16 rows a token:
s_top16 = s + (experts_s - dequant_s) x (16 / 14 - 1) (the dequantization runs once a forward whatever the rows),
FLOPs likewise; the measured ones are kept as measured_*. The EP exchange itself is not in this benchmark
(scripts/bench_ep.py measures it).

Measured, each section guarded (a failure is written as {"error": ...} and the run goes on), the JSON
rewritten after every section:
  a. per layer kind and embedding + lm_head: seconds per token in calibration (CUDA events from forward
     pre/post hooks on each decoder layer, its attention, its MLP / MoE block and the experts; medians over the
     batches after the first), matmul FLOPs per token (every nn.Linear's shape x rows, the router, the experts'
     rows; attention cores approximated as stated in the JSON) and share of the bf16 roofline (achieved FLOP/s
     over a bf16 8192^3 matmul measured in the same run); the plain forward (no quantizers) beside it;
  b. the calibrate phase (`quant.calibrate.calibrate` with the family's default recipe, as ptq) and its forward
     loop: seconds per token, roofline share, fixed seconds;
  c. peak GPU memory against `plan.estimate_memory` of the same model;
  d. export (`export.writer.export_checkpoint`): bytes and seconds;
  e. the MXFP4 experts module (`run_rows`: dequantization, grouped GEMMs, SiTU-GLU) on T x 16 rows against the
     same module with bf16 weights, plain matmuls of the same shapes, and the dequantization alone;
  g. the MLA attention module (layer 2) with the patched forward (`models/kimi_k3/mla.py`: the core through SDPA
     on CUDA) against the remote forward it wraps, same weights and inputs: seconds, and the difference of the
     outputs and of the largest o_proj input (what the o_proj input quantizer's amax sees);
  f. disk: from_pretrained's read against a raw sequential read of the same files (page cache evicted before
     each: os.sync, posix_fadvise DONTNEED; residency checked with mincore and a second, cached read); the
     export's write against a raw sequential write + fsync of as many bytes on the same filesystem.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

T0 = time.perf_counter()
EP_SIZE, TOP_K_REAL = 64, 16
SECTIONS = ("matmul", "generate", "disk_read", "load", "plain", "mla_core", "experts", "embed_head", "calibrate",
            "memory", "export", "disk_write")
SKIPPABLE = ("disk", "plain", "mla_core", "experts", "embed_head", "export")


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------
# timing


class Clock:
    """CUDA events on a GPU (resolved after a synchronize), perf_counter on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        import torch

        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn, warmup: int | None = None, reps: int = 5) -> float:
        """Median seconds of `fn` after `warmup` calls (default 2 on a GPU, 1 on the CPU)."""
        for _ in range(warmup if warmup is not None else 2 if self.cuda else 1):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            a = self.mark()
            fn()
            b = self.mark()
            self.sync()
            times.append(self.seconds(a, b))
        return statistics.median(times)


class Spans:
    """Forward pre/post hooks that record (start, end) marks per module name, one record per call of `top`."""

    def __init__(self, clock: Clock, top, modules: dict):
        self.clock, self.records, self.handles, self.open = clock, [], [], {}
        self._hook("forward", top, new_record=True)
        for name, module in modules.items():
            self._hook(name, module)

    def _hook(self, name, module, new_record=False):
        def pre(mod, args, kwargs=None):
            if new_record:
                self.records.append(defaultdict(list))
            self.open[name] = self.clock.mark()

        def post(mod, args, output, kwargs=None):
            if self.records and name in self.open:
                self.records[-1][name].append((self.open.pop(name), self.clock.mark()))

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def durations(self, first: int = 0) -> list[dict[str, float]]:
        """Per recorded forward from index `first`: name -> seconds (summed over its calls)."""
        self.clock.sync()
        return [{name: sum(self.clock.seconds(a, b) for a, b in spans) for name, spans in rec.items()}
                for rec in self.records[first:]]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({k for row in rows for k in row})
    return {k: statistics.median(row[k] for row in rows if k in row) for k in names}


# ---------------------------------------------------------------------------------------------------------
# the model


def real_text_config() -> dict:
    from modelopt_ext.models.kimi_k3.sizes import BUNDLED_CONFIG

    return json.loads(BUNDLED_CONFIG.read_text())["text_config"]


def bench_sizes(args):
    """(TinySizes, text_overrides) of the benchmark model."""
    from modelopt_ext.models.kimi_k3.standin.generate import TinySizes

    if args.tiny:  # the stand-in's small attention, two shared experts, a wider dense MLP
        return (TinySizes(num_layers=3, hidden_size=256, latent_size=128, moe_intermediate_size=64, num_experts=14,
                          top_k=14, vocab_size=args.vocab),
                {"num_shared_experts": 2, "intermediate_size": 512})
    real = real_text_config()
    local = real["num_experts"] // EP_SIZE
    keys = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_output_gate", "num_shared_experts",
            "rms_norm_eps")
    overrides = {k: real[k] for k in keys}
    lac = real["linear_attn_config"]
    overrides["linear_attn_config"] = {k: lac[k] for k in ("num_heads", "head_dim", "short_conv_kernel_size",
                                                           "gate_lower_bound")}
    sizes = TinySizes(num_layers=3, hidden_size=real["hidden_size"], latent_size=real["routed_expert_hidden_size"],
                      moe_intermediate_size=real["moe_intermediate_size"], num_experts=local, top_k=local,
                      vocab_size=args.vocab)
    return sizes, overrides


def layer_kind(layer) -> str:
    attn = type(layer.self_attn).__name__
    kind = "kda" if "Delta" in attn else "mla" if "MLA" in attn else attn
    return f"{'moe' if getattr(layer, 'is_moe', False) else 'dense'}_{kind}"


def random_batches(n: int, batch: int, seq_len: int, vocab: int, avoid: set[int], device, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(32, vocab, (batch, seq_len), generator=g)
        for bad in avoid:  # the image placeholder would ask for pixel values
            ids[ids == bad] = 32 + (bad + 1 - 32) % (vocab - 32)
        out.append({"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)})
    return out


class FlopCount:
    """Matmul FLOPs of the next forward of `model` by bucket (layer i, embed_head, other): nn.Linear shapes x
    rows, the router (an F.linear over all experts), the experts (2 GEMMs over the routed rows)."""

    def __init__(self, model, layers_prefix: str):
        import torch

        self.flops = defaultdict(float)
        self.rows = defaultdict(int)
        self.done = False
        self.handles = [model.register_forward_hook(lambda *_: setattr(self, "done", True))]
        for name, m in model.named_modules():
            bucket = self._bucket(name, layers_prefix)
            if isinstance(m, torch.nn.Linear):
                self.handles.append(m.register_forward_hook(self._linear(bucket, m.in_features, m.out_features)))
            elif name.endswith("block_sparse_moe.gate") and getattr(m, "weight", None) is not None:
                E, H = m.weight.shape
                self.handles.append(m.register_forward_hook(self._linear(bucket, H, E)))
            elif name.endswith("block_sparse_moe.experts"):
                self.handles.append(m.register_forward_pre_hook(self._experts(bucket, m)))

    @staticmethod
    def _bucket(name: str, prefix: str) -> str:
        if name.startswith(prefix + "."):
            return f"layer{name[len(prefix) + 1:].split('.', 1)[0]}"
        return "embed_head" if ("embed_tokens" in name or "lm_head" in name) else "other"

    def _linear(self, bucket, fan_in, fan_out):
        def hook(mod, args, output):
            if not self.done:
                self.flops[bucket] += 2.0 * fan_in * fan_out * (args[0].numel() // fan_in)
        return hook

    def _experts(self, bucket, m):
        L, I = m.hidden_dim, m.intermediate_dim

        def hook(mod, args):
            if self.done:
                return
            rows = args[1].numel()  # one process: no EP sentinel slots
            self.rows[bucket] += rows
            self.flops[bucket] += rows * (2.0 * L * 2 * I + 2.0 * I * L)
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def per_token(self, tokens: int) -> tuple[dict, dict]:
        return {k: v / tokens for k, v in self.flops.items()}, {k: v / tokens for k, v in self.rows.items()}


def attention_core_flops(text, kind: str, seq_len: int) -> tuple[float, str]:
    """Approximate FLOPs per token of the attention core (outside the projections), and how it is counted."""
    if kind.endswith("kda"):
        lac = text.linear_attn_config
        h, d, C = lac["num_heads"], lac["head_dim"], 64
        return h * (6.0 * d * d + 4.0 * C * d), (
            "KDA chunked: heads x (6 dk dv (state read, update, output) + 4 C dk (intra-chunk, C=64)); approximate")
    h, qk, v = text.num_attention_heads, text.qk_nope_head_dim + text.qk_rope_head_dim, text.v_head_dim
    return h * 2.0 * seq_len * (qk + v), (
        "MLA as the stand-in runs it: eager fp32 QK^T and PV over the full S x S (masked, not halved): "
        "heads x 2 S (d_qk + d_v)")


# ---------------------------------------------------------------------------------------------------------
# disk


def files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def filesystem_of(path: Path) -> dict:
    """Mount point, type and free bytes of the filesystem holding `path` (from /proc/self/mounts)."""
    path = path.resolve()
    best = ("", "?", "?")
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            device, mount, kind = line.split()[:3]
            if (path == Path(mount) or Path(mount) in path.parents) and len(mount) > len(best[0]):
                best = (mount, kind, device)
    except OSError:
        pass
    usage = shutil.disk_usage(path)
    return {"mount": best[0], "type": best[1], "device": best[2], "free_bytes": usage.free}


def evict(paths) -> None:
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(paths) -> float | None:
    """Share of the files' pages in the page cache (mincore on a private mapping), None where unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
        resident = total = 0
        for p in paths:
            size = p.stat().st_size
            if size == 0:
                continue
            with open(p, "rb") as f:
                mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
            try:
                buf = (ctypes.c_char * size).from_buffer(mm)
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec)
                del buf
                if rc != 0:
                    return None
                resident += sum(b & 1 for b in vec)
                total += pages
            finally:
                mm.close()
        return resident / total if total else None
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None


def raw_read(paths, chunk: int = 16 << 20) -> tuple[int, float]:
    buf = bytearray(chunk)
    view = memoryview(buf)
    total, start = 0, time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - start


def raw_write(path: Path, nbytes: int, chunk: int = 64 << 20) -> dict:
    block = os.urandom(min(chunk, max(nbytes, 1)))
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
        written = time.perf_counter()
        os.fsync(f.fileno())
    done = time.perf_counter()
    return {"bytes": nbytes, "write_s": written - start, "fsync_s": done - written, "seconds": done - start}


# ---------------------------------------------------------------------------------------------------------
# the run


class Bench:
    def __init__(self, args):
        import torch

        self.args, self.torch = args, torch
        self.cuda = args.device == "cuda"
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.clock = Clock(self.cuda)
        self.work = Path(args.workdir)
        self.ckpt = self.work / "ckpt"
        self.result = {"tiny": bool(args.tiny), "errors": {}, "skipped": {}, "seconds": {}}
        self.model = self.calibrated = self.flops = self.rows = None
        self.peak_tflops = float("nan")
        self.peaks = {}

    # -- bookkeeping ------------------------------------------------------------------------------------
    def write(self) -> None:
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(_clean(self.result), indent=2, default=repr, allow_nan=False) + "\n")
        tmp.replace(out)

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - T0)

    def section(self, name: str, fn, *, needs=(), min_left_s: float = 0.0, key: str | None = None) -> None:
        key = key or name
        missing = [n for n in needs if getattr(self, n) is None]
        skip = (name in self.args.skip or (name.startswith("disk") and "disk" in self.args.skip))
        why = ("--skip" if skip else f"needs {missing}" if missing else
               f"budget: {self.left():.0f} s left < {min_left_s:.0f} s" if self.left() < min_left_s else None)
        if why:
            log(f"{name}: skipped ({why})")
            self.result["skipped"][name] = why
            self.write()
            return
        log(f"{name} ...")
        start = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the run goes on; the JSON says what failed
            text = f"{type(e).__name__}: {e}"
            log(f"{name}: FAILED {text}\n{traceback.format_exc()}")
            self.result["errors"][name] = text[:2000]
            if key not in self.result or not isinstance(self.result.get(key), dict):
                self.result[key] = {"error": text[:2000]}
            else:
                self.result[key].setdefault("error", text[:2000])
        finally:
            self.result["seconds"][name] = round(time.perf_counter() - start, 3)
            log(f"{name} done in {self.result['seconds'][name]:.1f} s")
            self.write()

    def peak(self, name: str) -> None:
        torch = self.torch
        if self.cuda:
            self.peaks[name] = int(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    # -- sections ---------------------------------------------------------------------------------------
    def env(self) -> None:
        import importlib.metadata as md

        torch = self.torch
        versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
        for dist in ("transformers", "nvidia-modelopt", "fla-core", "triton", "compressed-tensors", "safetensors"):
            try:
                versions[dist] = md.version(dist)
            except md.PackageNotFoundError:
                versions[dist] = None
        gpu = torch.cuda.get_device_name() if self.cuda else None
        self.result.update(
            machine=f"{gpu or 'cpu'} ({os.cpu_count()} CPUs, {platform.machine()})", versions=versions,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            args={k: sorted(v) if isinstance(v, set) else v for k, v in vars(self.args).items()},
            tokens_per_batch=self.args.tokens_per_batch, batches=self.args.batches)

    def matmul(self) -> None:
        torch = self.torch
        n = 8192 if self.cuda else 256
        a, b = (torch.randn(n, n, device=self.device, dtype=torch.bfloat16) for _ in range(2))
        s = self.clock.timed(lambda: a @ b, warmup=3, reps=10 if self.cuda else 3)
        self.peak_tflops = 2 * n**3 / s / 1e12
        self.result["matmul_bf16_tflops"] = self.peak_tflops
        self.result["matmul_bf16_n"] = n
        log(f"bf16 {n}^3 matmul: {self.peak_tflops:.0f} TFLOP/s")

    def generate(self) -> None:
        from modelopt_ext.models.kimi_k3.standin.generate import make_tiny

        sizes, overrides = bench_sizes(self.args)
        marker = self.work / "ckpt.sizes.json"
        want = json.dumps({"sizes": repr(sizes), "overrides": overrides, "seed": 0}, sort_keys=True)
        info = {"sizes": repr(sizes), "text_overrides": overrides}
        if not self.args.regenerate and marker.is_file() and marker.read_text() == want and (
                self.ckpt / "config.json").is_file():
            info["reused"] = True
        else:
            marker.unlink(missing_ok=True)
            workers = self.args.workers or os.cpu_count() or 1
            start = time.perf_counter()
            make_tiny(self.ckpt, seed=0, sizes=sizes, force=True, text_overrides=overrides, workers=workers,
                      quantize_device="cuda" if self.cuda else None)
            info.update(reused=False, seconds=time.perf_counter() - start, workers=workers)
            marker.write_text(want)
        files = files_of(self.ckpt)
        info["bytes"] = sum(p.stat().st_size for p in files)
        info["files"] = len(files)
        self.result["generate"] = info
        log(f"checkpoint {self.ckpt}: {info['bytes'] / 1e9:.2f} GB in {len(files)} files"
            + (f", generated in {info['seconds']:.1f} s" if "seconds" in info else " (reused)"))
        if self.cuda:  # the GPU quantization gives the CPU's bytes (checked on one expert tensor)
            try:
                self._check_quantize_device()
            except Exception as e:  # noqa: BLE001 - a check of the generator only
                info["quantize_device_identical"] = f"check failed: {type(e).__name__}: {e}"

    def _check_quantize_device(self) -> None:
        torch = self.torch
        from modelopt_ext.formats.mxfp4 import quantize_mxfp4

        w = torch.randn(256, 3584, generator=torch.Generator().manual_seed(0)) * 0.02
        cpu, gpu = quantize_mxfp4(w), quantize_mxfp4(w.cuda())
        self.result["generate"]["quantize_device_identical"] = all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))

    def disk_read(self) -> None:
        files = files_of(self.ckpt)
        d = {"load_bytes": sum(p.stat().st_size for p in files), "filesystem": filesystem_of(self.ckpt)}
        start = time.perf_counter()
        evict(files)
        d["evict_s"] = time.perf_counter() - start
        d["resident_after_evict"] = resident_fraction(files)
        n, s = raw_read(files)
        d.update(raw_read_bytes=n, raw_read_s=s, raw_read_bytes_per_s=n / s)
        d["resident_after_read"] = resident_fraction(files)
        if self.left() > 60:
            n, s = raw_read(files)
            d.update(cached_read_s=s, cached_read_bytes_per_s=n / s)
        self.result["disk"] = d
        log(f"raw read {n / 1e9:.2f} GB: {d['raw_read_bytes_per_s'] / 1e9:.2f} GB/s evicted"
            + (f", {d['cached_read_bytes_per_s'] / 1e9:.2f} GB/s cached" if "cached_read_s" in d else ""))

    def load(self) -> None:
        torch = self.torch
        import modelopt_ext

        files = files_of(self.ckpt)
        disk = self.result.setdefault("disk", {})
        if "disk" not in self.args.skip:
            evict(files)
            disk["resident_before_load"] = resident_fraction(files)
        kwargs = {"trust_remote_code": True, "dtype": torch.bfloat16}
        if self.cuda:
            kwargs["device_map"] = "cuda"
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        model = modelopt_ext.from_pretrained(str(self.ckpt), **kwargs)
        self.clock.sync()
        seconds = time.perf_counter() - start
        self.peak("load")
        self.model = model
        nbytes = sum(p.stat().st_size for p in files)
        disk.update(load_bytes=nbytes, load_s=seconds, load_bytes_per_s=nbytes / seconds,
                    load_bytes_read_counted=int(sum(getattr(model, "modelopt_ext_bytes_read", {}).values())))
        if disk.get("raw_read_bytes_per_s"):
            disk["read_ratio"] = disk["load_bytes_per_s"] / disk["raw_read_bytes_per_s"]
            cached = disk.get("cached_read_bytes_per_s")
            after, before = disk.get("resident_after_evict"), disk.get("resident_before_load")
            if after is not None and before is not None:
                disk["cache_evicted"] = after < 0.05 and before < 0.05
            elif cached:
                disk["cache_evicted"] = cached > 1.5 * disk["raw_read_bytes_per_s"]
            else:
                disk["cache_evicted"] = False
                disk["cache_evicted_note"] = "unknown: no mincore and no cached read"
        self._describe_model()
        log(f"from_pretrained {nbytes / 1e9:.2f} GB in {seconds:.1f} s ({disk['load_bytes_per_s'] / 1e9:.2f} GB/s)")

    def _describe_model(self) -> None:
        model = self.model
        text = model.config.get_text_config()
        self.text = text
        self.layers_prefix, layers = next((n, m) for n, m in model.named_modules() if n.endswith("model.layers"))
        self.layers = list(layers)
        self.kinds = [layer_kind(layer) for layer in self.layers]
        real = real_text_config()
        real_kinds = defaultdict(int)
        kda = set(real["linear_attn_config"]["kda_layers"])
        for i in range(real["num_hidden_layers"]):
            moe = i >= real["first_k_dense_replace"] and i % real["moe_layer_freq"] == 0
            real_kinds[f"{'moe' if moe else 'dense'}_{'kda' if i + 1 in kda else 'mla'}"] += 1
        self.real_kinds = dict(real_kinds)
        lac = text.linear_attn_config
        self.result["widths"] = {
            "hidden_size": text.hidden_size, "latent_size": text.routed_expert_hidden_size,
            "expert_intermediate_size": text.moe_intermediate_size, "local_experts": text.num_experts,
            "top_k_measured": text.num_experts_per_token, "top_k_real": TOP_K_REAL, "num_experts_real":
            real["num_experts"], "ep_size": EP_SIZE, "vocab_size_real": real["vocab_size"],
            "vocab_size_measured": text.vocab_size, "dense_intermediate_size": text.intermediate_size,
            "shared_experts": text.num_shared_experts,
            "shared_intermediate_size": text.moe_intermediate_size * text.num_shared_experts,
            "kda_heads": lac["num_heads"], "kda_head_dim": lac["head_dim"], "mla_heads": text.num_attention_heads,
            "q_lora_rank": text.q_lora_rank, "kv_lora_rank": text.kv_lora_rank,
            "qk_nope_head_dim": text.qk_nope_head_dim, "qk_rope_head_dim": text.qk_rope_head_dim,
            "v_head_dim": text.v_head_dim, "attn_res_block_size": text.attn_res_block_size,
            "layers": self.kinds, "real_layer_counts": self.real_kinds, "seq_len": self.args.seq_len,
            "experts_implementation": getattr(text, "_experts_implementation", None),  # the plain forward's
        }
        want = ["dense_kda", "moe_kda", "moe_mla"]
        if self.kinds != want:
            raise RuntimeError(f"layer kinds {self.kinds}, expected {want}")

    def _modules(self) -> dict:
        out = {}
        lm = self.model.get_submodule(self.layers_prefix.rsplit(".layers", 1)[0])
        out["embed_tokens"] = lm.embed_tokens
        head = next(m for n, m in self.model.named_modules() if n.endswith("lm_head"))
        out["lm_head"] = head
        for i, layer in enumerate(self.layers):
            out[f"layer{i}"] = layer
            out[f"layer{i}.attn"] = layer.self_attn
            ffn = layer.block_sparse_moe if layer.is_moe else layer.mlp
            out[f"layer{i}.ffn"] = ffn
            if layer.is_moe:
                out[f"layer{i}.experts"] = ffn.experts
        return out

    def _batches(self, n: int, seed: int):
        a = self.args
        avoid = {getattr(self.model.config, "media_placeholder_token_id", None)} - {None}
        return random_batches(n, a.tokens_per_batch // a.seq_len, a.seq_len, self.text.vocab_size, avoid,
                              self.device, seed)

    def plain(self) -> None:
        """Forwards without quantizers: the first counts FLOPs (and pays the first-call costs), the rest timed."""
        torch = self.torch
        spans = Spans(self.clock, self.model, self._modules())
        counter = FlopCount(self.model, self.layers_prefix)
        batches = self._batches(1 + self.args.plain_batches, seed=1)
        try:
            with torch.no_grad():
                start = time.perf_counter()
                self.model(**batches[0], use_cache=False)
                self.clock.sync()
                first_s = time.perf_counter() - start
                counter.remove()
                log(f"first forward (kernel builds, FLOP count) {first_s:.1f} s")
                for batch in batches[1:]:
                    if self.left() < self.args.reserve_s:
                        break
                    self.model(**batch, use_cache=False)
        finally:
            counter.remove()
            spans.remove()
        self.peak("plain")
        T = self.args.tokens_per_batch
        self.flops, self.rows = counter.per_token(T)
        rows = spans.durations(first=1)
        self.result["plain_forward"] = {"first_forward_s": first_s, "batches_timed": len(rows),
                                        "flops_per_token_by_bucket": self.flops,
                                        "routed_rows_per_token": self.rows}
        if rows:
            med = medians(rows)
            self.plain_med = med
            self.result["plain_forward"].update(
                s_per_token=med["forward"] / T,
                roofline_share=sum(self.flops.values()) / (med["forward"] / T) / (self.peak_tflops * 1e12),
                module_s_per_token={k: v / T for k, v in med.items()})

    def mla_core(self) -> None:
        """Layer 2's MLA attention: the patched forward against the remote one it wraps (see the module doc, g)."""
        torch = self.torch
        attn = self.layers[self.kinds.index("moe_mla")].self_attn
        remote = type(attn).forward.__wrapped__
        T, S = self.args.tokens_per_batch, self.args.seq_len
        g = torch.Generator(device=self.device).manual_seed(11)
        x = torch.randn(T // S, S, self.text.hidden_size, device=self.device, dtype=torch.bfloat16, generator=g)
        ones = torch.ones(T // S, S, dtype=torch.long, device=self.device)
        seen = {}
        hook = attn.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("o_in", a[0].detach()))
        reps = 5 if self.cuda else 2
        try:
            with torch.no_grad():
                ref = remote(attn, x, attention_mask=ones)
                ref_o_in = seen["o_in"]
                out = attn(x, attention_mask=ones)
                o_in = seen["o_in"]
                remote_s = self.clock.timed(lambda: remote(attn, x, attention_mask=ones), reps=reps)
                masked_s = self.clock.timed(lambda: attn(x, attention_mask=ones), reps=reps)
                causal_s = self.clock.timed(lambda: attn(x), reps=reps)
        finally:
            hook.remove()
        ref_amax, amax = ref_o_in.abs().max().item(), o_in.abs().max().item()
        self.result["mla_core"] = {
            "tokens": T, "remote_s": remote_s, "patched_s": masked_s, "patched_no_mask_s": causal_s,
            "speedup": remote_s / masked_s, "speedup_no_mask": remote_s / causal_s,
            "remote_s_per_token": remote_s / T, "patched_s_per_token": masked_s / T,
            "output_max_abs_diff_over_max": (out.float() - ref.float()).abs().max().item() / ref.abs().max().item(),
            "o_proj_input_max_abs_diff_over_max":
                (o_in.float() - ref_o_in.float()).abs().max().item() / ref_o_in.abs().max().item(),
            "o_proj_input_amax_remote": ref_amax, "o_proj_input_amax_patched": amax,
            "o_proj_input_amax_rel_diff": abs(amax - ref_amax) / ref_amax,
            "note": "the MoE MLA layer's self_attn on random bf16 hidden states [T/S, S, hidden] with the all-ones "
                    "attention mask calibration passes; patched_no_mask_s: no mask (causal SDPA kernel)",
        }
        log(f"MLA attention on {T} tokens: remote {remote_s * 1e3:.2f} ms, patched {masked_s * 1e3:.2f} ms "
            f"(x{remote_s / masked_s:.2f}; no mask {causal_s * 1e3:.2f} ms), o_proj input amax {ref_amax:.4g} -> "
            f"{amax:.4g}")

    def experts(self) -> None:
        """The MXFP4 experts of layer 1 on T x 16 routed rows (balanced), against bf16 weights."""
        torch = self.torch
        from modelopt_ext.ep.local import block_segments
        from modelopt_ext.models.kimi_k3.experts import KimiK3Experts

        packed = self.layers[1].block_sparse_moe.experts
        E, L, I = packed.num_experts, packed.hidden_dim, packed.intermediate_dim
        T = self.args.tokens_per_batch
        R = T * TOP_K_REAL
        counts = torch.full((E,), R // E, dtype=torch.long)
        counts[: R % E] += 1
        offs = torch.cumsum(counts, 0, dtype=torch.int32).to(self.device)
        g = torch.Generator(device=self.device).manual_seed(5)
        x = torch.randn(R, L, device=self.device, dtype=torch.bfloat16, generator=g)
        reps = 5 if self.cuda else 2
        with torch.no_grad():
            mx = self.clock.timed(lambda: packed.run_rows(x, offs_E=offs), reps=reps)

            def dequant():
                with packed.materialized(torch.bfloat16):
                    pass

            dq = self.clock.timed(dequant, reps=reps)
            with torch.device(self.device):
                dense = KimiK3Experts(self.text).to(torch.bfloat16)
            with packed.materialized(torch.bfloat16):
                dense.gate_up_proj.data.copy_(packed.gate_up_proj)
                dense.down_proj.data.copy_(packed.down_proj)
            bf = self.clock.timed(lambda: dense.run_rows(x, offs_E=offs), reps=reps)
            w13, w2 = dense.gate_up_proj.detach()[0], dense.down_proj.detach()[0]
            h = torch.randn(R, I, device=self.device, dtype=torch.bfloat16, generator=g)
            bare = self.clock.timed(lambda: (torch.mm(x, w13.t()), torch.mm(h, w2.t())), reps=reps)
            gate_up = torch.randn(R, 2 * I, device=self.device, dtype=torch.bfloat16, generator=g)
            glu = self.clock.timed(lambda: packed._apply_gate(gate_up), reps=reps)
            dense = gate_up = h = None  # freed before the next measurement
            # as an EP64 rank gets them: [source rank][local expert] blocks (regrouped on GPUs, ep/local.py)
            per = torch.full((EP_SIZE * E,), R // (EP_SIZE * E), dtype=torch.long)
            per[: R % (EP_SIZE * E)] += 1
            blocks = block_segments(per.view(EP_SIZE, E).tolist())
            ep_blocks = self.clock.timed(lambda: packed.run_rows(x, blocks), reps=reps)
        if self.cuda:
            torch.cuda.empty_cache()
        flops = R * (2.0 * L * 2 * I + 2.0 * I * L)
        peak = self.peak_tflops * 1e12
        self.dequant_s = dq
        self.result["experts"] = {
            "rows": R, "tokens": T, "rows_per_token": TOP_K_REAL, "local_experts": E, "flops": flops,
            "mxfp4_s": mx, "dequant_s": dq, "bf16_s": bf, "mxfp4_ep64_blocks_s": ep_blocks,
            "bare_bf16_matmul_s": bare, "situ_glu_s": glu,
            "mxfp4_over_bf16": mx / bf, "mxfp4_s_per_routed_row": mx / R, "mxfp4_s_per_token": mx / T,
            "mxfp4_roofline_share": flops / mx / peak, "bf16_roofline_share": flops / bf / peak,
            "bare_roofline_share": flops / bare / peak,
            "note": "KimiK3PackedExperts.run_rows on expert-sorted rows (one grouped GEMM per projection, the "
                    "dequantization of the 14 local experts, SiTU-GLU); bf16_s: KimiK3Experts.run_rows with the "
                    "same (dequantized) weights; bare: one dense matmul per projection of the same shapes; "
                    "mxfp4_ep64_blocks_s: the same rows laid out as an EP64 rank receives them (64 x 14 blocks, "
                    "run_rows with segments: regrouped expert-major on GPUs)",
        }
        log(f"experts on {R} rows: MXFP4 {mx * 1e3:.2f} ms, bf16 {bf * 1e3:.2f} ms (x{mx / bf:.2f}), dequant "
            f"{dq * 1e3:.2f} ms, bare matmuls {bare * 1e3:.2f} ms")

    def embed_head(self) -> None:
        """Embedding gather + lm_head GEMM + the fp32 logits copy at the real vocabulary."""
        torch = self.torch
        V, H, T = self.args.head_vocab, self.text.hidden_size, self.args.tokens_per_batch
        g = torch.Generator(device=self.device).manual_seed(7)
        w = torch.randn(V, H, device=self.device, dtype=torch.bfloat16, generator=g) * 0.02
        x = torch.randn(T, H, device=self.device, dtype=torch.bfloat16, generator=g)
        ids = torch.randint(0, V, (T,), device=self.device, generator=g)
        reps = 5 if self.cuda else 2
        with torch.no_grad():
            gather = self.clock.timed(lambda: torch.nn.functional.embedding(ids, w), reps=reps)
            gemm = self.clock.timed(lambda: torch.nn.functional.linear(x, w), reps=reps)
            logits = torch.nn.functional.linear(x, w)
            copy = self.clock.timed(lambda: logits.float(), reps=reps)
        w = logits = None  # freed before empty_cache
        if self.cuda:
            torch.cuda.empty_cache()
        s = gather + gemm + copy
        flops = 2.0 * H * V
        self.embed_head_real = {"s_per_token": s / T, "flops_per_token": flops,
                                "roofline_share": flops / (s / T) / (self.peak_tflops * 1e12),
                                "gather_s": gather, "lm_head_gemm_s": gemm, "logits_fp32_copy_s": copy, "tokens": T,
                                "vocab_size": V}
        log(f"embed+lm_head at vocab {V}: {s * 1e3:.2f} ms for {T} tokens (GEMM {gemm * 1e3:.2f} ms)")

    def calibrate(self) -> None:
        torch = self.torch
        from modelopt_ext.families import family_for_config, read_config
        from modelopt_ext.quant import recipes
        from modelopt_ext.quant.calibrate import calibrate

        family = family_for_config(read_config(self.ckpt))
        recipe = recipes.load(family.default_recipe)
        cfg = recipes.quant_config(recipe, self.model.config)
        batches = self._batches(self.args.batches, seed=2)
        T = self.args.tokens_per_batch
        spans = Spans(self.clock, self.model, self._modules())
        counter = None if self.flops else FlopCount(self.model, self.layers_prefix)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            result = calibrate(self.model, cfg, batches, router_glob=family.router_glob,
                               num_experts=self.text.num_experts)
            self.clock.sync()
            wall = time.perf_counter() - start
        finally:
            spans.remove()
            if counter is not None:
                counter.remove()
        if counter is not None:
            self.flops, self.rows = counter.per_token(T)
        self.peak("calibrate")
        self.calibrated = result
        rows = spans.durations()
        steady = rows[1:] or rows
        med = medians(steady)
        self.calib_med = med
        tokens = T * len(batches)
        flops = sum((self.flops or {}).values()) or float("nan")
        peak = self.peak_tflops * 1e12
        fwd = med["forward"] / T
        self.result["calibrate"] = {
            "recipe": str(family.default_recipe), "tokens": tokens, "batches": len(batches),
            "s_per_token": wall / tokens, "forward_s_per_token": fwd, "tokens_per_s": tokens / wall,
            "roofline_share": flops / (wall / tokens) / peak,
            "forward_roofline_share": flops / fwd / peak, "fixed_s": wall - fwd * tokens, "wall_s": wall,
            "first_batch_forward_s": rows[0]["forward"] if rows else None, "parts_s": dict(result.seconds),
            "flops_per_token": flops, "module_s_per_token": {k: v / T for k, v in med.items()},
            "coverage": result.coverage.summary_line(),
            "experts_implementation": getattr(self.text, "_experts_implementation", None),  # ModelOpt sets "eager"
            "forward_over_plain": fwd / self.result.get("plain_forward", {}).get("s_per_token", float("nan")),
            "note": "this 3-layer model (14 routed rows a token); per-layer figures scaled to top-16 are in layers",
        }
        log(f"calibrate {tokens} tokens in {wall:.2f} s ({tokens / wall:,.0f} tok/s; forward loop "
            f"{1 / fwd:,.0f} tok/s)")

    def layers_table(self) -> None:
        """layers.<kind> from the calibration (and plain) medians, scaled to 16 routed rows a token."""
        T = self.args.tokens_per_batch
        peak = self.peak_tflops * 1e12
        scale = TOP_K_REAL / self.text.num_experts_per_token
        dequant_tok = getattr(self, "dequant_s", 0.0) / T
        out = {}
        for i, kind in enumerate(self.kinds):
            core, how = attention_core_flops(self.text, kind, self.args.seq_len)
            matmul = (self.flops or {}).get(f"layer{i}", float("nan"))
            rows = (self.rows or {}).get(f"layer{i}", 0.0)
            expert_flops = rows * (2.0 * self.text.routed_expert_hidden_size * 2 * self.text.moe_intermediate_size
                                   + 2.0 * self.text.moe_intermediate_size * self.text.routed_expert_hidden_size)
            entry = {"attention_core_flops_per_token": core, "attention_core_note": how,
                     "measured_matmul_flops_per_token": matmul, "routed_rows_per_token_measured": rows,
                     "routed_rows_per_token_real": TOP_K_REAL if rows else 0}
            flops = matmul + core + (expert_flops * (scale - 1) if rows else 0.0)
            for tag, med in (("", getattr(self, "calib_med", None)), ("plain_", getattr(self, "plain_med", None))):
                if not med or f"layer{i}" not in med:
                    continue
                s = med[f"layer{i}"] / T
                experts = med.get(f"layer{i}.experts", 0.0) / T
                s_top16 = s + max(experts - dequant_tok, 0.0) * (scale - 1) if rows else s
                entry.update({
                    f"{tag}measured_s_per_token": s, f"{tag}s_per_token": s_top16,
                    f"{tag}attn_s_per_token": med.get(f"layer{i}.attn", 0.0) / T,
                    f"{tag}ffn_s_per_token": med.get(f"layer{i}.ffn", 0.0) / T,
                    f"{tag}experts_s_per_token": experts,
                    f"{tag}roofline_share": flops / s_top16 / peak,
                })
            entry["flops_per_token"] = flops
            out[kind] = entry
        eh = dict(getattr(self, "embed_head_real", {}) or {"error": "embed_head section did not run"})
        for tag, med in (("", getattr(self, "calib_med", None)), ("plain_", getattr(self, "plain_med", None))):
            if med:
                eh[f"{tag}in_model_s_per_token_vocab_{self.text.vocab_size}"] = (
                    med.get("embed_tokens", 0.0) + med.get("lm_head", 0.0)) / T
        out["embed_head"] = eh
        out["scaling"] = (
            f"s_per_token / flops_per_token / roofline_share of MoE layers are scaled to {TOP_K_REAL} routed rows a "
            f"token (EP{EP_SIZE}, balanced routing: a rank with T tokens receives T x {TOP_K_REAL} rows for its "
            f"{self.text.num_experts} experts) from {self.text.num_experts_per_token} measured: s_top16 = s + "
            f"(experts_s - dequant_s) x ({TOP_K_REAL}/{self.text.num_experts_per_token} - 1), where experts_s is the "
            "experts module's time in the layer (hooks) and dequant_s the dequantization of the local experts "
            "(experts section), which does not grow with rows; the router's width (14 vs 896 experts) and the EP "
            "exchange are not scaled. measured_*: as measured. Unprefixed: calibration (ModelOpt max statistics, "
            "production recipe); plain_*: forward without quantizers. embed_head: the real vocabulary, timed apart.")
        self.result["layers"] = out
        totals = {k: out[k].get("s_per_token") for k in ("dense_kda", "moe_kda", "moe_mla")}
        if all(v is not None for v in totals.values()) and "s_per_token" in out["embed_head"]:
            per_token = sum(self.real_kinds.get(k, 0) * v for k, v in totals.items()) + out["embed_head"]["s_per_token"]
            self.result["predicted_calibration_forward_s_per_token_ep64_without_exchange"] = per_token

    def memory(self) -> None:
        from modelopt_ext.families import read_config, stored_expert_storage
        from modelopt_ext.models.kimi_k3.sizes import plan_sizes
        from modelopt_ext.plan import estimate_memory

        config = read_config(self.ckpt)
        sizes = plan_sizes(config)
        stored = stored_expert_storage(config)
        est = estimate_memory(sizes, 1, 1, "replicate", stored, stored, self.args.tokens_per_batch)
        mem = {"planned_bytes": int(est.total_bytes), "planned": {k: int(v) for k, v in vars(est).items()},
               "planned_note": "plan.estimate_memory(plan_sizes(bench config), world 1, EP 1, replicate): the "
                               "activation estimate leaves out attention workspaces (the stand-in's MLA keeps "
                               "fp32 [B, heads, S, S] scores)"}
        from modelopt_ext.models.kimi_k3.sizes import BUNDLED_CONFIG

        real = json.loads(BUNDLED_CONFIG.read_text())
        est64 = estimate_memory(plan_sizes(real), EP_SIZE, EP_SIZE, "fsdp", "mxfp4", stored_expert_storage(real),
                                self.args.tokens_per_batch)
        mem["planned_real_ep64_fsdp"] = {k: int(v) for k, v in vars(est64).items()}
        if self.cuda:
            self.peak("memory")
            wanted = {k: v for k, v in self.peaks.items() if k in ("load", "plain", "calibrate", "export")}
            mem.update(peak_bytes=max(wanted.values(), default=0), peak_by_section=wanted,
                       peak_note="torch.cuda.max_memory_allocated over load, plain forwards, calibrate (export: "
                                 "updated by the export section); the synthetic experts / lm_head tensors excluded")
        else:
            from modelopt_ext.progress import peak_host_bytes

            mem.update(peak_bytes=peak_host_bytes(), peak_note="CPU: the process's peak resident set size")
        mem["peak_over_planned"] = mem["peak_bytes"] / mem["planned_bytes"]
        self.result["memory"] = mem

    def export(self) -> None:
        from modelopt_ext.export.writer import export_checkpoint

        target = self.work / "export"
        for p in self.work.glob("*export*"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        coverage = self.calibrated.coverage

        def extra(staging):
            coverage.write_json(Path(staging) / "coverage.json")

        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        res = export_checkpoint(self.calibrated.model, target, source_dir=self.ckpt, write_extra=extra)
        seconds = time.perf_counter() - start
        self.peak("export")
        mem = self.result.get("memory")
        if self.cuda and isinstance(mem, dict) and "peak_by_section" in mem:
            mem["peak_by_section"]["export"] = self.peaks["export"]
            mem["peak_bytes"] = max(mem["peak_bytes"], self.peaks["export"])
            mem["peak_over_planned"] = mem["peak_bytes"] / mem["planned_bytes"]
        flush_start = time.perf_counter()
        os.sync()
        flush = time.perf_counter() - flush_start
        written = int(sum(res.bytes_written))
        on_disk = sum(p.stat().st_size for p in files_of(target) if p.suffix == ".safetensors")
        self.export_bytes = on_disk
        self.result["export"] = {"bytes": written, "seconds": seconds, "bytes_per_s": written / seconds,
                                 "files_bytes": on_disk, "tensors": res.tensors, "files": res.files,
                                 "flush_s": flush, "bytes_per_s_with_flush": written / (seconds + flush),
                                 "experts_exact": res.experts_exact, "timing_s": res.timing}
        disk = self.result.setdefault("disk", {})
        disk.update(write_bytes=on_disk, write_bytes_per_s=on_disk / seconds)
        log(f"export {written / 1e9:.2f} GB in {seconds:.1f} s (+{flush:.1f} s os.sync)")

    def disk_write(self) -> None:
        path = self.work / "raw_write.bin"
        try:
            w = raw_write(path, self.export_bytes)
        finally:
            path.unlink(missing_ok=True)
        disk = self.result.setdefault("disk", {})
        disk.update(raw_write_bytes=w["bytes"], raw_write_s=w["seconds"], raw_write_fsync_s=w["fsync_s"],
                    raw_write_bytes_per_s=w["bytes"] / w["seconds"],
                    raw_write_nofsync_bytes_per_s=w["bytes"] / w["write_s"])
        disk["write_ratio"] = disk["write_bytes_per_s"] / disk["raw_write_bytes_per_s"]
        exp = self.result.get("export", {})
        if exp.get("flush_s") is not None:
            disk["write_ratio_with_flush"] = (exp["files_bytes"] / (exp["seconds"] + exp["flush_s"])) / (
                disk["raw_write_bytes_per_s"])
        log(f"raw write {w['bytes'] / 1e9:.2f} GB: {disk['raw_write_bytes_per_s'] / 1e9:.2f} GB/s with fsync")

    # -- all --------------------------------------------------------------------------------------------
    def run(self) -> dict:
        a = self.args
        self.work.mkdir(parents=True, exist_ok=True)
        self.section("env", self.env)
        self.section("matmul", self.matmul)
        self.section("generate", self.generate)
        self.section("disk_read", self.disk_read, min_left_s=a.reserve_s + 60, key="disk")
        self.section("load", self.load, key="disk")
        self.section("plain", self.plain, needs=("model",), key="plain_forward")
        self.section("mla_core", self.mla_core, needs=("model",), min_left_s=a.reserve_s)
        self.section("experts", self.experts, needs=("model",), min_left_s=a.reserve_s)
        self.section("embed_head", self.embed_head, min_left_s=a.reserve_s)
        self.section("calibrate", self.calibrate, needs=("model",))
        self.section("layers", self.layers_table, needs=("model",))
        self.section("memory", self.memory, needs=("model",))
        self.section("export", self.export, needs=("calibrated",))
        self.export_bytes = getattr(self, "export_bytes", None)
        self.section("disk_write", self.disk_write, needs=("export_bytes",), min_left_s=30, key="disk")
        self.result["tokens_per_batch"] = a.tokens_per_batch
        self.result["batches"] = a.batches
        self.result["total_s"] = time.perf_counter() - T0
        self.write()
        return self.result


def _clean(o):
    """JSON-safe copy: non-finite floats -> None, tuples -> lists, paths -> str."""
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, Path):
        return str(o)
    return o


def table(r: dict) -> str:
    def f(x, spec=".3g", scale=1.0):
        ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
        return format(x * scale, spec) if ok else "-"

    lines = [f"{r.get('machine')}  bf16 matmul {f(r.get('matmul_bf16_tflops'), '.0f')} TFLOP/s  "
             f"(tokens/batch {r.get('tokens_per_batch')}, batches {r.get('batches')}, tiny {r.get('tiny')})",
             f"{'layer':<12}{'us/token':>10}{'plain':>10}{'GFLOP/tok':>11}{'roofline':>10}{'plain':>8}"]
    for kind, e in (r.get("layers") or {}).items():
        if isinstance(e, dict):
            lines.append(f"{kind:<12}{f(e.get('s_per_token'), '.2f', 1e6):>10}"
                         f"{f(e.get('plain_s_per_token'), '.2f', 1e6):>10}"
                         f"{f(e.get('flops_per_token'), '.3f', 1e-9):>11}{f(e.get('roofline_share'), '.2f'):>10}"
                         f"{f(e.get('plain_roofline_share'), '.2f'):>8}")
    c, x, m, d, ex, mc = (r.get(k) or {} for k in ("calibrate", "experts", "memory", "disk", "export", "mla_core"))
    lines += [
        f"MLA attention remote / patched {f(mc.get('speedup'), '.2f')} (no mask {f(mc.get('speedup_no_mask'), '.2f')})"
        f", o_proj input amax rel diff {f(mc.get('o_proj_input_amax_rel_diff'), '.2g')}",
        f"calibrate: {f(c.get('s_per_token'), '.2f', 1e6)} us/token (roofline {f(c.get('roofline_share'), '.2f')}), "
        f"forward loop {f(c.get('forward_s_per_token'), '.2f', 1e6)} us/token "
        f"({f(c.get('forward_roofline_share'), '.2f')}), fixed {f(c.get('fixed_s'), '.2f')} s",
        f"experts ({x.get('rows')} rows): MXFP4 / bf16 {f(x.get('mxfp4_over_bf16'), '.2f')}, dequant "
        f"{f(x.get('dequant_s'), '.2f', 1e3)} ms, roofline {f(x.get('mxfp4_roofline_share'), '.2f')}",
        f"memory: peak {f(m.get('peak_bytes'), '.1f', 2**-30)} GiB, planned {f(m.get('planned_bytes'), '.1f', 2**-30)}"
        f" GiB (x{f(m.get('peak_over_planned'), '.2f')})",
        f"export: {f(ex.get('bytes'), '.2f', 1e-9)} GB in {f(ex.get('seconds'), '.1f')} s "
        f"(+{f(ex.get('flush_s'), '.1f')} s flush; seconds by part {ex.get('timing_s')}); durable ours/raw "
        f"{f(d.get('write_ratio_with_flush'), '.2f')}",
        f"disk read ours/raw {f(d.get('read_ratio'), '.2f')} ({f(d.get('load_bytes_per_s'), '.2f', 1e-9)} vs "
        f"{f(d.get('raw_read_bytes_per_s'), '.2f', 1e-9)} GB/s, evicted {d.get('cache_evicted')}); write ours/raw "
        f"{f(d.get('write_ratio'), '.2f')} ({f(d.get('write_bytes_per_s'), '.2f', 1e-9)} vs "
        f"{f(d.get('raw_write_bytes_per_s'), '.2f', 1e-9)} GB/s)",
    ]
    predicted = r.get("predicted_calibration_forward_s_per_token_ep64_without_exchange")
    if predicted:
        lines.append(f"93-layer calibration forward per token at EP64 (no exchange): {f(predicted, '.1f', 1e6)} us")
    if r.get("errors"):
        lines.append(f"errors: {sorted(r['errors'])}")
    if r.get("skipped"):
        lines.append(f"skipped: {r['skipped']}")
    return "\n".join(lines)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="small widths (CPU smoke run)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--tokens-per-batch", type=int, default=None, help="default 4096 (tiny: 32)")
    p.add_argument("--seq-len", type=int, default=None, help="default 2048 (tiny: 16)")
    p.add_argument("--batches", type=int, default=None, help="calibration batches (default 8; tiny 3)")
    p.add_argument("--plain-batches", type=int, default=None, help="timed plain forwards (default 3; tiny 2)")
    p.add_argument("--vocab", type=int, default=None, help="checkpoint vocabulary (default 4096; tiny 512)")
    p.add_argument("--head-vocab", type=int, default=None,
                   help="vocabulary of the separately timed embedding + lm_head (default the real 163840; tiny 8192)")
    p.add_argument("--workdir", default="/tmp/bench_rank_share")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/rank_share.json, else WORKDIR/rank_share.json)")
    p.add_argument("--workers", type=int, default=None, help="generation threads (default: all CPUs)")
    p.add_argument("--regenerate", action="store_true", help="generate the checkpoint even if WORKDIR has it")
    p.add_argument("--skip", default="", help=f"comma-separated sections to skip: {', '.join(SKIPPABLE)}")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="optional sections are skipped when less than their need is left of this (default 480)")
    p.add_argument("--reserve-s", type=float, default=None, help="time kept for calibrate + export (default 120)")
    a = p.parse_args(argv)
    a.skip = {s for s in a.skip.split(",") if s}
    bad = a.skip - set(SKIPPABLE)
    if bad:
        p.error(f"--skip {sorted(bad)}: not one of {SKIPPABLE}")
    tiny = a.tiny
    head_vocab = real_text_config()["vocab_size"]
    for name, real, small in (("tokens_per_batch", 4096, 32), ("seq_len", 2048, 16), ("batches", 8, 3),
                              ("plain_batches", 3, 2), ("vocab", 4096, 512), ("head_vocab", head_vocab, 8192),
                              ("reserve_s", 120.0, 0.0)):
        if getattr(a, name) is None:
            setattr(a, name, small if tiny else real)
    if a.tokens_per_batch % a.seq_len:
        p.error(f"--tokens-per-batch {a.tokens_per_batch} is not a multiple of --seq-len {a.seq_len}")
    if a.batches < 2:
        p.error("--batches must be at least 2 (the first one is the warm-up)")
    if a.out is None:
        a.out = str(Path(os.environ["OUT"]) / "rank_share.json") if os.environ.get("OUT") else str(
            Path(a.workdir) / "rank_share.json")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_MODULES_CACHE", str(Path(a.workdir) / "hf_modules"))
    import torch

    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; pass --device cpu --tiny for the CPU smoke run", file=sys.stderr)
        return 2
    if a.device == "cpu" and not a.tiny:
        print("real widths on the CPU would take hours; pass --tiny", file=sys.stderr)
        return 2
    log(f"bench_rank_share: device {a.device}, tiny {a.tiny}, out {a.out}")
    result = Bench(a).run()
    print(table(result), flush=True)
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

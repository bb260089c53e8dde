"""modelopt_ext.profiling: the calibration loop's opt-in profiler writes per-rank tables for the chosen batches;
`stream_overlap` summarises how GPU work overlapped in a chrome trace."""

import gzip
import json

import pytest
import torch

from modelopt_ext.profiling import (
    ENV_BATCHES,
    ENV_DIR,
    BatchProfiler,
    _interval_intersection,
    _interval_union,
    stream_overlap,
)


def test_profiles_only_the_chosen_batches(tmp_path):
    profiler = BatchProfiler(tmp_path, first=1, count=2, rank=3)
    a, b = torch.randn(64, 64), torch.randn(8, 8)
    for i in range(5):
        with profiler.batch(i):
            (a @ a if i < 3 else b.t() @ b).sum()  # batches 3 and 4 (outside the window) only multiply b^T b
    profiler.close()
    summary = json.loads((tmp_path / "calibrate_rank3.json").read_text())
    assert summary["batches"] == [1, 3] and len(summary["wall_ms"]) == 2
    assert all(ms > 0 for ms in summary["wall_ms"])
    table = (tmp_path / "calibrate_rank3.txt").read_text()
    assert "aten::mm" in table and "## by self_cpu_time_total" in table
    assert "aten::t " not in table  # the profiler stopped after the window


def test_loop_shorter_than_the_window_writes_nothing(tmp_path):
    profiler = BatchProfiler(tmp_path / "p", first=5, count=1)
    with profiler.batch(0):
        pass
    profiler.close()
    assert not (tmp_path / "p").exists()


def test_from_env(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_DIR, raising=False)
    assert BatchProfiler.from_env() is None
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    monkeypatch.setenv(ENV_BATCHES, "0:4")
    profiler = BatchProfiler.from_env(rank=1)
    assert (profiler.first, profiler.count, profiler.rank) == (0, 4, 1)
    for bad in ("3", "a:b", "-1:2", "1:0"):
        monkeypatch.setenv(ENV_BATCHES, bad)
        with pytest.raises(ValueError, match=ENV_BATCHES):
            BatchProfiler.from_env()


def test_sync_call_sites_with_stacks(tmp_path):
    def reads_back():
        return torch.ones(3).sum().item()

    profiler = BatchProfiler(tmp_path, first=0, count=1, stacks=True)
    with profiler.batch(0):
        reads_back()
    profiler.close()
    table = (tmp_path / "calibrate_rank0.txt").read_text()
    assert "## host syncs by call site" in table and "aten::_local_scalar_dense" in table
    assert "reads_back" in table.split("## host syncs by call site")[1]


def test_a_failing_batch_stops_the_profiler(tmp_path):
    profiler = BatchProfiler(tmp_path, first=0, count=3)
    with profiler.batch(0):
        torch.ones(2).sum()
    with pytest.raises(RuntimeError, match="boom"), profiler.batch(1):
        raise RuntimeError("boom")
    assert profiler._profile is None  # stopped, not left running
    profiler.close()
    assert json.loads((tmp_path / "calibrate_rank0.json").read_text())["wall_ms"] != []


# --- stream_overlap ---------------------------------------------------------------------------------------------------


def _gpu(name, ts, dur, stream, device=0, cat="kernel", **args):
    """A GPU event as kineto writes it (pid = device, tid = stream)."""
    return {"ph": "X", "cat": cat, "name": name, "pid": device, "tid": stream, "ts": ts, "dur": dur,
            "args": {"device": device, "stream": stream, **args} if "inDevice" not in args else {"stream": stream, **args}}


def _peer_copy(ts, dur, stream, src, dst):
    """Kineto's Memcpy PtoP: no "device" arg, only fromDevice/toDevice and inDevice (the device running it)."""
    return _gpu("Memcpy PtoP (Device -> Device)", ts, dur, stream, src, "gpu_memcpy", fromDevice=src, inDevice=src, toDevice=dst)


def _trace():
    """Times in us. Device 0, by stream:
        7  gemm [0,1000) [1500,2500), other [2500,2700) [3500,3600) (memset)
        8  gemm [800,1200)
        21 comm [500,2000)
        22 copy [2400,3000)
    gemm = [0,1200)+[1500,2500) = 2200, comm 1500, copy 600, other 300, all = [0,3000)+[3500,3600) = 3100,
    span 3600. comm&gemm = [500,1200)+[1500,2000) = 1200, copy&gemm = [2400,2500) = 100, comm&other 0,
    copy&other = [2500,2700) = 200. comm|copy = 2100, of which alone [1200,1500)+[2700,3000) = 600.
    Device 1: comm [10000,10400), gemm [10200,10600), copy to device 0 [10600,10700)."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "nccl:all_to_all", "pid": 1234, "tid": 1, "ts": 0, "dur": 5000, "args": {}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1234, "tid": 1, "ts": 10, "dur": 5, "args": {"device": 0}},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "nccl:all_to_all", "pid": 0, "tid": 21, "ts": 0, "dur": 5000,
         "args": {"device": 0, "stream": 21}},  # spans the NCCL kernel on the GPU row: must not count as work
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 0, "tid": 7, "ts": 0},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7 "}},
        _gpu("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 0, 1000, 7),
        _gpu("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 1500, 1000, 7),
        _gpu("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversal",
             800, 400, 8),
        _gpu("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 500, 1500, 21),
        _peer_copy(2400, 600, 22, src=0, dst=1),
        _gpu("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", 2500, 200, 7),
        _gpu("Memset (Device)", 3500, 100, 7, cat="gpu_memset"),
        _gpu("ncclKernel_AllReduce_RING_LL_Sum_float", 10000, 400, 21, device=1),
        _gpu("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 10200, 400, 7, device=1),
        _peer_copy(10600, 100, 22, src=1, dst=0),
    ]
    return {"schemaVersion": 1, "traceEvents": events, "displayTimeUnit": "ms"}


def test_stream_overlap_by_hand():
    summary = stream_overlap(_trace())
    assert list(summary) == ["0", "1"]
    d0 = summary["0"]
    assert (d0["start_us"], d0["end_us"], d0["span_ms"]) == (0.0, 3600.0, 3.6)
    assert d0["busy_ms"] == {"comm": 1.5, "copy": 0.6, "gemm": 2.2, "other": 0.3, "all": 3.1}
    assert d0["concurrent_ms"] == {"comm+gemm": 1.2, "copy+gemm": 0.1, "comm+other": 0.0, "copy+other": 0.2}
    assert d0["exposed_comm_ms"] == 0.6
    assert d0["hidden_comm_fraction"] == round(1500 / 2100, 6)
    assert d0["events"] == {"comm": 1, "copy": 1, "gemm": 3, "other": 2}
    assert d0["streams"] == ["7", "8", "21", "22"]
    top = d0["top_kernels"]
    assert [(k["name"][:5], k["ms"], k["count"]) for k in top["gemm"]] == [("nvjet", 2.0, 2), ("_ZN7c", 0.4, 1)]
    assert top["comm"] == [{"name": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "ms": 1.5, "count": 1}]
    assert top["copy"] == [{"name": "Memcpy PtoP (Device -> Device)", "ms": 0.6, "count": 1}]
    assert [k["name"] for k in top["other"]] == ["void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
                                                "Memset (Device)"]
    d1 = summary["1"]  # the peer copy that device 1 ran counts on device 1, though it has no "device" arg
    assert d1["busy_ms"] == {"comm": 0.4, "copy": 0.1, "gemm": 0.4, "other": 0.0, "all": 0.7}
    assert d1["concurrent_ms"] == {"comm+gemm": 0.2, "copy+gemm": 0.0, "comm+other": 0.0, "copy+other": 0.0}
    assert (d1["span_ms"], d1["exposed_comm_ms"], d1["events"]["copy"]) == (0.7, 0.3, 1)
    assert json.loads(json.dumps(summary)) == summary  # plain JSON types


def test_stream_overlap_window_clips():
    summary = stream_overlap(_trace(), window=(1000, 2450))
    assert list(summary) == ["0"]  # device 1 ran nothing in the window
    d0 = summary["0"]
    # gemm [0,1000) only touches the window: dropped; [800,1200) -> [1000,1200); [1500,2500) -> [1500,2450)
    assert d0["events"] == {"comm": 1, "copy": 1, "gemm": 2, "other": 0}
    assert (d0["start_us"], d0["end_us"], d0["span_ms"]) == (1000.0, 2450.0, 1.45)
    assert d0["busy_ms"] == {"comm": 1.0, "copy": 0.05, "gemm": 1.15, "other": 0.0, "all": 1.45}
    assert d0["concurrent_ms"] == {"comm+gemm": 0.7, "copy+gemm": 0.05, "comm+other": 0.0, "copy+other": 0.0}
    assert d0["exposed_comm_ms"] == 0.3  # [1200,1500)
    assert d0["top_kernels"]["gemm"][0]["ms"] == 0.95
    assert stream_overlap(_trace(), window=(5000, 6000)) == {}
    with pytest.raises(ValueError, match="start_us < end_us"):
        stream_overlap(_trace(), window=(2000, 1000))


def test_stream_overlap_reads_json_and_gz_files(tmp_path):
    expected = stream_overlap(_trace())
    (tmp_path / "trace.json").write_text(json.dumps(_trace()))
    with gzip.open(tmp_path / "trace.json.gz", "wt") as f:
        json.dump(_trace(), f)
    assert stream_overlap(tmp_path / "trace.json") == expected
    assert stream_overlap(str(tmp_path / "trace.json.gz")) == expected
    (tmp_path / "bad.json").write_text(json.dumps({"events": []}))
    with pytest.raises(ValueError, match="traceEvents"):
        stream_overlap(tmp_path / "bad.json")


@pytest.mark.parametrize("cat, name, cls", [
    ("kernel", "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "comm"),
    ("kernel", "NCCL_SendRecv_custom", "comm"),
    ("gpu_memcpy", "Memcpy DtoD (Device -> Device)", "copy"),
    ("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", "copy"),
    ("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("kernel", "void cublasLt::splitKreduce_kernel<32, 16, int, float>", "gemm"),
    ("kernel", "void at::cuda::detail::prepare_grouped_gemm_data<cutlass::bfloat16_t>", "gemm"),
    ("kernel", "triton_poi_fused__grouped_mm_0", "gemm"),
    ("kernel", "void at::native::index_elementwise_kernel<128, 4>", "other"),
    ("gpu_memset", "Memset (Device)", "other"),
])
def test_stream_overlap_classes(cat, name, cls):
    summary = stream_overlap({"traceEvents": [_gpu(name, 0, 2, 7, cat=cat)]})
    assert summary["0"]["events"] == {c: int(c == cls) for c in ("comm", "copy", "gemm", "other")}
    assert summary["0"]["busy_ms"][cls] == 0.002


def test_stream_overlap_defaults_and_exposed_only_comm():
    # no args at all: device 0, stream from tid; communication with no compute is all exposed
    events = [{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "pid": 0, "tid": 3, "ts": 10.5, "dur": 2.25},
              {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "pid": 0, "tid": 4, "ts": 11.0, "dur": 3.0}]
    d0 = stream_overlap({"traceEvents": events})["0"]
    assert d0["streams"] == ["3", "4"] and d0["busy_ms"]["comm"] == 0.0035  # [10.5, 14.0)
    assert d0["exposed_comm_ms"] == 0.0035 and d0["hidden_comm_fraction"] == 0.0
    assert d0["top_kernels"]["comm"] == [{"name": "ncclDevKernel_SendRecv", "ms": 0.00525, "count": 2}]


def test_interval_union_and_intersection():
    assert _interval_union([]) == []
    assert _interval_union([(5, 6), (0, 2), (1, 3), (3, 4), (7, 9), (7.5, 8)]) == [(0, 4), (5, 6), (7, 9)]
    a, b = [(0, 4), (5, 6), (7, 9)], [(1, 2), (3, 5.5), (6, 7), (8, 10)]
    assert _interval_intersection(a, b) == [(1, 2), (3, 4), (5, 5.5), (8, 9)]
    assert _interval_intersection(b, a) == _interval_intersection(a, b)
    assert _interval_intersection(a, []) == []


def test_stream_overlap_on_a_real_cpu_trace(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.randn(32, 32) @ torch.randn(32, 32)
    prof.export_chrome_trace(str(tmp_path / "cpu.json.gz"))  # torch gzips by suffix; a trace saves once
    with gzip.open(tmp_path / "cpu.json.gz", "rt") as f:
        trace = json.load(f)
    assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])
    (tmp_path / "cpu.json").write_text(json.dumps(trace))
    assert stream_overlap(tmp_path / "cpu.json") == {} == stream_overlap(tmp_path / "cpu.json.gz")
    assert stream_overlap(trace, window=(0, 1)) == {}
    trace["traceEvents"].append(_gpu("ncclDevKernel_SendRecv", 100, 50, 21))  # host events stay out of the summary
    d0 = stream_overlap(trace)["0"]
    assert d0["busy_ms"]["all"] == d0["exposed_comm_ms"] == 0.05 and sum(d0["events"].values()) == 1

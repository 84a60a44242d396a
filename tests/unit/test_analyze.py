"""`titanlite analyze` on small hand-made traces whose answers are worked out by hand."""

import json

import pytest

from titanlite.base.errors import ConfigError
from titanlite.tools.analyze import analyze, analyze_trace, kernel_class, main, to_markdown


def x(name, ts, dur, tid=1, cat="cpu_op", pid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def cpu_trace(rank=0, shift=0.0):
    # One 100 us step on thread 1. Compute: 0-40 and 50-60 (a mul nested in the add). The c10d operators
    # on thread 1 only enqueue; gloo runs the collectives on thread 2 in issue order: an all-gather at
    # 30-70 and a reduce-scatter (run by gloo as an all-reduce) at 80-90 (+ shift).
    note = dict(cat="user_annotation")
    return {
        "distributedInfo": {"rank": rank},
        "traceEvents": [
            x("ProfilerStep#3", 0, 100, **note),
            x("aten::mm", 0, 40),
            x("aten::add", 50, 10),
            x("aten::mul", 52, 3),
            x("FSDP::all_gather", 28, 4, **note),  # groups operators: neither compute nor communication
            x("c10d::_allgather_base_", 29, 1),
            x("gloo:all_gather", 30, 40, tid=2, **note),
            x("c10d::_reduce_scatter_base_", 79, 1),
            x("gloo:all_reduce", 80, 10 + shift, tid=2, **note),
            x("_c10d_functional::wait_tensor", 92, 2),  # a wait is not compute
            x("aten::empty", 120, 5),  # outside the step: ignored
            {"ph": "i", "name": "instant", "ts": 1, "pid": 1, "tid": 1},
        ],
    }


def test_cpu_trace_figures():
    r = analyze_trace(cpu_trace())
    assert r["mode"] == "cpu"
    assert r["total_ms"] == pytest.approx(0.100)
    # [0,40] + [50,60], less the c10d operator at [29,30] (enqueueing is communication, not compute).
    assert r["compute_ms"] == pytest.approx(0.049)
    # Communication: the union of [29,30], [30,70], [79,80] and [80,90] = 52 us.
    assert r["communication_ms"] == pytest.approx(0.052)
    overlap_us = 10 + 10  # [30,40] and [50,60]
    assert r["overlap_pct"] == pytest.approx(100 * overlap_us / 52)
    assert r["exposed_communication_ms"] == pytest.approx((52 - overlap_us) / 1000)
    assert r["non_compute_ms"] == pytest.approx(0.032)
    assert r["idle_ms"] == pytest.approx(0.019)  # [70,79] and [90,100]
    assert r["compute_pct"] + r["non_compute_pct"] + r["idle_pct"] == pytest.approx(100)
    assert r["collectives"] == {
        "all-gather": {"count": 1, "total_ms": pytest.approx(0.040), "mean_ms": pytest.approx(0.040)},
        "reduce-scatter": {"count": 1, "total_ms": pytest.approx(0.010), "mean_ms": pytest.approx(0.010)},
    }
    top = {op["name"]: op["ms"] for op in r["top_operators"]}
    assert top == {
        "aten::mm": pytest.approx(0.039),
        "aten::add": pytest.approx(0.007),
        "aten::mul": pytest.approx(0.003),
    }


def test_cpu_trace_without_overlap():
    trace = {
        "traceEvents": [
            x("ProfilerStep#1", 0, 100),
            x("aten::mm", 0, 50),
            x("c10d::allreduce_", 59, 1),
            x("gloo:all_reduce", 60, 30, tid=7),
        ]
    }
    r = analyze_trace(trace)
    assert (r["compute_pct"], r["non_compute_pct"], r["idle_pct"]) == pytest.approx((50, 31, 19))
    assert r["overlap_pct"] == 0
    assert r["exposed_communication_ms"] == pytest.approx(0.031)
    assert r["collectives"]["all-reduce"]["count"] == 1


def test_gpu_trace_figures():
    k = dict(cat="kernel", pid=0)
    trace = {
        "traceEvents": [
            x("ProfilerStep#1", -50, 200),  # CPU side: ignored when there are kernels
            x("sm90_xmma_gemm_bf16", 0, 50, tid=7, **k),
            x("ncclDevKernel_AllGather_RING_LL", 40, 40, tid=20, **k),
            x("Memcpy HtoD (Pageable -> Device)", 85, 5, tid=7, cat="gpu_memcpy", pid=0),
            x("vectorized_elementwise_kernel", 90, 10, tid=7, **k),
            x("sm90_xmma_gemm_bf16", 95, 5, tid=8, **k),
        ]
    }
    r = analyze_trace(trace)
    assert r["mode"] == "gpu"
    assert r["total_ms"] == pytest.approx(0.100)
    assert r["compute_pct"] == pytest.approx(60)  # [0,50] + [90,100]
    assert r["communication_ms"] == pytest.approx(0.040)
    assert r["overlap_pct"] == pytest.approx(25)  # [40,50] of [40,80]
    assert r["exposed_communication_ms"] == pytest.approx(0.030)
    assert r["other_non_compute_ms"] == pytest.approx(0.005)
    assert r["non_compute_pct"] == pytest.approx(35)
    assert r["idle_pct"] == pytest.approx(5)  # [80,85]
    assert r["collectives"] == {
        "all-gather": {"count": 1, "total_ms": pytest.approx(0.04), "mean_ms": pytest.approx(0.04)}
    }
    assert r["top_operators"][0] == {
        "name": "sm90_xmma_gemm_bf16",
        "ms": pytest.approx(0.055),
        "pct_of_total": pytest.approx(55),
    }
    assert list(r["kernel_classes"]) == ["matmul", "other kernels"]  # the NCCL kernel is not compute
    assert r["kernel_classes"]["matmul"] == {
        "ms": pytest.approx(0.055),
        "pct_of_kernels": pytest.approx(100 * 55 / 65),
        "pct_of_total": pytest.approx(55),
    }


def test_gpu_kernels_fall_into_classes():
    names = {
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "cutlass3x_sm90_tensorop_gemm_f8_f8_f32": "matmul",
        "pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16": "attention",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "compiled (inductor/Triton)",
        "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>": "other kernels",
    }
    assert {name: kernel_class(name) for name in names} == names


def test_folder_of_ranks_is_averaged_and_written(tmp_path):
    window = tmp_path / "profile" / "iteration_10"
    window.mkdir(parents=True)
    older = tmp_path / "profile" / "iteration_5"
    older.mkdir()
    (older / "rank0_trace.json").write_text("not json")  # an older window is not read
    (window / "rank0_trace.json").write_text(json.dumps(cpu_trace(0)))
    (window / "rank1_trace.json").write_text(json.dumps(cpu_trace(1, shift=10)))
    assert main([str(tmp_path / "profile")]) == 0
    result = json.loads((window / "analysis.json").read_text())
    assert set(result["ranks"]) == {"0", "1"}
    r0, r1, avg = result["ranks"]["0"], result["ranks"]["1"], result["average"]
    # Rank 1's reduce-scatter runs 80-100: 10 us more communication, 10 us less idle.
    assert r1["idle_ms"] == pytest.approx(r0["idle_ms"] - 0.010)
    assert avg["idle_pct"] == pytest.approx((r0["idle_pct"] + r1["idle_pct"]) / 2)
    assert avg["collectives"]["reduce-scatter"] == {
        "count": 1,
        "total_ms": pytest.approx(0.015),
        "mean_ms": pytest.approx(0.015),
    }
    assert "| idle % |" in (window / "analysis.md").read_text()


@pytest.mark.parametrize("stray", [False, True], ids=["metadata-only", "a-stray-collective"])
def test_a_rank_whose_profiler_recorded_nothing_is_left_out_and_named(tmp_path, stray):
    """Seen in `bench strategies` on CPU ranks sharing 2 cores: one rank's trace held metadata only, or
    metadata and one gloo all_reduce of a collective's thread, but no operator of the training thread."""
    events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}}]
    if stray:
        events.append({"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 9,
                       "ts": 100.0, "dur": 6.0})  # fmt: skip
    empty = {"traceEvents": events}
    (tmp_path / "rank0_trace.json").write_text(json.dumps(cpu_trace(0)))
    (tmp_path / "rank1_trace.json").write_text(json.dumps(empty))
    _, result = analyze(tmp_path)
    assert set(result["ranks"]) == {0} and result["empty"] == ["rank1_trace.json"]
    assert "Left out, the profiler recorded no training step: rank1_trace.json" in to_markdown(result)
    (tmp_path / "rank0_trace.json").write_text(json.dumps(empty))
    with pytest.raises(ConfigError, match="recorded no training step in any trace"):
        analyze(tmp_path)


def test_bad_input_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no such trace file or folder"):
        analyze(tmp_path / "missing")
    with pytest.raises(ConfigError, match="no \\*.json traces"):
        analyze(tmp_path)
    (tmp_path / "rank0_trace.json").write_text("{truncated")
    with pytest.raises(ConfigError, match="not a readable Chrome trace"):
        analyze(tmp_path)


def test_collective_inside_an_operator_is_not_compute():
    # A DTensor redistribution inside an autograd node: the node runs 0-100, its all-reduce 40-70 and
    # the wait for it 70-80 are nested in it. Only 0-40 and 80-100 are compute.
    trace = {
        "traceEvents": [
            x("ProfilerStep#1", 0, 100, cat="user_annotation"),
            x("autograd::engine::evaluate_function: MmBackward0", 0, 100),
            x("_c10d_functional::all_reduce", 40, 30),
            x("c10d::allreduce_", 41, 28),  # nested in the functional collective: the same collective
            x("gloo:all_reduce", 45, 30, tid=2, cat="user_annotation"),
            x("_c10d_functional::wait_tensor", 70, 10),
        ]
    }
    r = analyze_trace(trace)
    assert r["compute_ms"] == pytest.approx(0.060)
    assert r["communication_ms"] == pytest.approx(0.035)  # [40,75]
    assert r["overlap_pct"] == 0
    assert r["idle_ms"] == pytest.approx(0.005)  # the wait after gloo finished: [75,80]
    assert r["collectives"] == {
        "all-reduce": {"count": 1, "total_ms": pytest.approx(0.030), "mean_ms": pytest.approx(0.030)}
    }

"""`titanlite bench throughput`: the figures it prints and writes are consistent with each other.
(Whether titanlite is within 5 % of the bare loop is a measurement, printed by the benchmark and
recorded in BENCHMARKS.md, not asserted here.)"""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, env, titanlite_here, train_in_pool
from tests.pool import PoolFailure


def bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "titanlite.commands.cli", "bench", "throughput", *args]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)


def test_bench_prints_and_writes_both_loops(tmp_path):
    out = tmp_path / "bench.json"
    proc = bench(
        "--model.tokenizer",
        "byte",
        "--steps",
        "2",
        "--repeats",
        "3",
        "--warmup",
        "1",
        "--output",
        str(out),
        "--training.seq_len",
        "32",
        "--metrics.peak_tflops",
        "1.5",
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "bench: 1 warm-up steps, then 3 rounds of 2 steps per loop" in proc.stdout
    report = json.loads(out.read_text())
    assert report["tokens_per_step"] == 8 * 32
    loops = report["loops"]
    assert set(loops) == {"titanlite", "bare PyTorch"}
    for name, r in loops.items():
        rounds = r["round_step_seconds"]
        assert len(rounds) == 3 and all(t > 0 for t in rounds)
        assert r["step_seconds_median"] == sorted(rounds)[1]
        assert r["tokens_per_s_per_device"] == report["tokens_per_step"] / r["step_seconds_median"]
        assert abs(r["tflops_per_device"] - r["tokens_per_s_per_device"] * report["flops_per_token"] / 1e12) < 1e-12
        assert abs(r["mfu_pct"] - 100 * r["tflops_per_device"] / 1.5) < 1e-9
        assert f"{r['tokens_per_s_per_device']:,.0f}" in next(
            line for line in proc.stdout.splitlines() if line.startswith(f"{name:<14} ")
        )
    ratio = loops["titanlite"]["step_seconds_median"] / loops["bare PyTorch"]["step_seconds_median"]
    assert report["titanlite_over_bare"] == ratio
    assert f"titanlite step time / bare loop step time: {ratio:.3f}" in proc.stdout
    assert "peak memory: n/a per loop on CPU" in proc.stdout


def test_bench_refuses_bad_options_in_one_line():
    proc = titanlite_here("bench", "throughput", "--steps", "many")  # in this process (tests/helpers.py)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "titanlite: error: bench throughput --steps takes a whole number, not 'many'"
    proc = titanlite_here("bench", "throughput", "--repeats", "0")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1


TINY_BENCH = ["--model.tokenizer", "byte", "--training.seq_len", "32", "--training.local_batch_size", "4"]


@pytest.fixture
def bench_jobs_in_the_pool(monkeypatch):
    """The bench commands below run in this process (the `cli` fixture, as plan --measure's tests run plan), their
    training jobs on the pool's ranks (tests/helpers.py train_in_pool): the same worker's train() that the command's
    own strategies.launch starts under torchrun, without the launcher and the fork server's imports per job. What
    the bench reads of a job (its exit status, metrics and profiler traces in its run folder) is the same either way.
    Jobs named in the returned set are launched as the command launches them (strategies.launch)."""
    from titanlite.tools import strategies  # imports torch and titanlite: only these tests pay

    launch, launched = strategies.launch, set()

    def in_the_pool(ranks, args, run_root, name, timeout=3600):
        if name in launched:
            return launch(ranks, args, run_root, name, timeout)
        try:
            ran = train_in_pool(ranks, args, run_root, timeout=timeout, job_name=name)
        except PoolFailure as failure:  # the bench's row then says why, as after a failed launch
            return subprocess.CompletedProcess(args, 1, "", str(failure))
        return subprocess.CompletedProcess(args, 0, ran.stdout, ran.stderr)

    monkeypatch.setattr(strategies, "launch", in_the_pool)
    return launched


@pytest.mark.slow  # six profiled layouts; CI runs it
def test_bench_strategies_writes_table_json_and_chart(tmp_path, cli, bench_jobs_in_the_pool):
    bench_jobs_in_the_pool.add("ddpx2")  # DDP x 2 through torchrun, as the command launches every job
    proc = cli("bench", "strategies", "--steps", "6", "--output", str(tmp_path), *TINY_BENCH, env={"NGPU": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "strategies.json").read_text())
    rows = {r["strategy"]: r for r in report["rows"]}
    # 2 processes: no HSDP (it needs 4); TP and PP take both ranks.
    assert list(rows) == ["single device", "DDP x 2", "ZeRO-2 x 2", "ZeRO-3 x 2", "TP 2", "PP 2"]
    assert all("error" not in r for r in rows.values()), rows
    assert rows["single device"]["speedup"] == 1.0 and rows["single device"]["collectives_per_step"] == {}
    for r in rows.values():
        assert abs(r["compute_pct"] + r["non_compute_pct"] + r["idle_pct"] - 100) <= 0.5
        assert r["scaling_efficiency_pct"] == 100 * r["speedup"] / r["ranks"]
        assert (tmp_path / r["run"] / "profile").is_dir()
    assert rows["DDP x 2"]["collectives_per_step"]["all-reduce"] > 0
    for zero in ("ZeRO-2 x 2", "ZeRO-3 x 2"):
        assert {"all-gather", "reduce-scatter"} <= set(rows[zero]["collectives_per_step"])
    # ZeRO-3 gathers the blocks again for backward; ZeRO-2 keeps them.
    assert (
        rows["ZeRO-3 x 2"]["collectives_per_step"]["all-gather"]
        > rows["ZeRO-2 x 2"]["collectives_per_step"]["all-gather"]
    )
    assert rows["PP 2"]["collectives_per_step"]["send/recv"] > 0
    table = (tmp_path / "strategies.md").read_text()
    assert table in proc.stdout
    for name, r in rows.items():
        assert (
            f"| {name} | {r['ranks']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['speedup']:.2f} |" in table
        )
    png = (tmp_path / "strategies.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.slow  # doubling batch sizes; CI runs it
def test_bench_batch_sizes_stops_at_the_limit(tmp_path, cli, bench_jobs_in_the_pool):
    proc = cli(
        "bench",
        "batch-sizes",
        "--steps",
        "3",
        "--max-batch-size",
        "4",
        "--output",
        str(tmp_path),
        "--model.tokenizer",
        "byte",
        "--training.seq_len",
        "32",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "batch_sizes.json").read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 2, 4]
    assert report["stop"] == "stopped at --max-batch-size 4"
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_gib"] > 0 for r in report["rows"])
    assert "| 4 | " in (tmp_path / "batch_sizes.md").read_text()

"""`titanlite bench throughput`: the figures it prints and writes are consistent with each other.
(Whether titanlite is within 5 % of the bare loop is a measurement, printed by the benchmark and
recorded in BENCHMARKS.md, not asserted here.)"""

import json
import subprocess
import sys

from tests.helpers import REPO, env


def bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "titanlite.cli", "bench", "throughput", *args]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)


def test_bench_prints_and_writes_both_loops(tmp_path):
    out = tmp_path / "bench.json"
    proc = bench("--steps", "2", "--repeats", "3", "--warmup", "1", "--output", str(out),
                 "--training.seq_len", "32", "--metrics.peak_tflops", "1.5")
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
        assert f"{r['tokens_per_s_per_device']:,.0f}" in next(l for l in proc.stdout.splitlines() if l.startswith(f"{name:<14} "))
    ratio = loops["titanlite"]["step_seconds_median"] / loops["bare PyTorch"]["step_seconds_median"]
    assert report["titanlite_over_bare"] == ratio
    assert f"titanlite step time / bare loop step time: {ratio:.3f}" in proc.stdout
    assert "peak memory: n/a per loop on CPU" in proc.stdout


def test_bench_refuses_bad_options_in_one_line():
    proc = bench("--steps", "many")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "titanlite: error: bench throughput --steps takes a whole number, not 'many'"
    proc = bench("--repeats", "0")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1

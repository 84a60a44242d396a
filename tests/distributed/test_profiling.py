"""Profiling a real run on 2 gloo ranks (in the pool, tests/pool.py), then `titanlite analyze` on its traces."""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, TINY, env, train_in_pool
from tests.pool import PoolFailure

pytestmark = pytest.mark.distributed

NATIVE_CRASH = ("died (exit code -6)", "died (exit code -11)")  # a pool rank killed by SIGABRT / SIGSEGV
PROFILE = ["--profiling.enable_profiling", "--profiling.profile_freq", "3", "--training.steps", "6"]


def analyze(folder):
    cmd = [sys.executable, "-m", "titanlite.commands.cli", "analyze", str(folder)]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "layout, args, collectives",
    [
        ("fsdp", ["--training.local_batch_size", "4"], {"all-gather", "reduce-scatter"}),
        (
            "ddp",
            ["--training.local_batch_size", "4", "--parallelism.data_parallel_replicate_degree", "2"],
            {"all-reduce"},
        ),
    ],
)
def test_profiled_run_is_analyzed(tmp_path, layout, args, collectives):
    try:
        train_in_pool(2, [*TINY, *PROFILE, *args], tmp_path)
    except PoolFailure as failure:
        # Seen once in a full CI-like run: rank 0 aborted (SIGABRT) inside gloo's all-gather under FSDP while
        # the CPU profiler recorded; faulthandler printed the stacks. It is torch's and rare, not what this test
        # checks (the traces and their analysis), so one fresh run follows (on a fresh pool).
        if not any(crash in str(failure) for crash in NATIVE_CRASH):
            raise
        tmp_path = tmp_path / "again"
        train_in_pool(2, [*TINY, *PROFILE, *args], tmp_path)
    profile = tmp_path / "run" / "profile"
    # Windows end at steps 3 and 6, one trace per rank each.
    assert sorted(p.relative_to(profile).as_posix() for p in profile.rglob("*.json")) == [
        "iteration_3/rank0_trace.json",
        "iteration_3/rank1_trace.json",
        "iteration_6/rank0_trace.json",
        "iteration_6/rank1_trace.json",
    ]
    out = analyze(profile)
    assert out.returncode == 0, out.stderr
    result = json.loads((profile / "iteration_6" / "analysis.json").read_text())
    assert set(result["ranks"]) == {"0", "1"}
    for figures in [*result["ranks"].values(), result["average"]]:
        assert abs(figures["compute_pct"] + figures["non_compute_pct"] + figures["idle_pct"] - 100) <= 0.5
        assert figures["total_ms"] > 0 and figures["compute_pct"] > 0 and figures["communication_ms"] > 0
        assert collectives <= {kind for kind, fig in figures["collectives"].items() if fig["count"] > 0}
    if layout == "fsdp":  # DDP's gradients are bucketed into one all-reduce: no all-gather at all
        assert "all-reduce" in result["average"]["collectives"]  # the loss and grad-norm reductions
    else:
        assert "all-gather" not in result["average"]["collectives"]
    # The printed table shows the JSON's figures.
    avg = result["average"]
    assert (
        f"| compute % | {result['ranks']['0']['compute_pct']:.1f} | {result['ranks']['1']['compute_pct']:.1f} | "
        f"{avg['compute_pct']:.1f} |" in out.stdout
    )
    for kind, fig in avg["collectives"].items():
        assert f"| {kind} | {fig['count']:g} | {fig['total_ms']:.2f} | {fig['mean_ms']:.3f} |" in out.stdout
    assert (profile / "iteration_6" / "analysis.md").read_text() in out.stdout

"""`titanlite bench strategies` and `titanlite bench batch-sizes`: the study's two tables, made by running
real training jobs.

strategies: the same model and global batch as a single device, DDP, FSDP ZeRO-2 (reshard never),
ZeRO-3 (reshard always) and, where the world size allows, HSDP, TP and PP; each is a separate torchrun
job of --steps steps whose last two steps are profiled. Throughput and peak memory come from the job's
metrics (logged before the profiled steps, so the profiler does not slow them down); the shares of
compute, communication and idle time, overlap and collectives come from `titanlite analyze` on its
traces. The single-device run keeps the global batch by gradient accumulation over the same local
batch, so its memory per device is comparable.

batch-sizes: one process, local batch 1, 2, 4, ... until the device runs out of memory (or
--max-batch-size), each a separate job, so an out-of-memory error ends that job cleanly.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from titanlite.base.command_line import (
    TRAIN_WORKER,
    check_writable_place,
    local_launch,
    take_options,
    with_overrides,
)
from titanlite.base.devices import uses_cuda
from titanlite.base.errors import ConfigError
from titanlite.base.failures import reason_in
from titanlite.builder.plan import plan_run
from titanlite.components.metrics import read_records
from titanlite.config import parse_config
from titanlite.tools.analyze import analyze, write_results

STRATEGIES_USAGE = """usage: titanlite bench strategies [--config FILE] [--ngpu N] [--steps S] [--output DIR]
                                  [--section.key VALUE ...]
  --ngpu N      processes per strategy (default: $NGPU, else the visible GPUs, else 4)
  --steps S     steps per job (default 12; the last 2 are profiled, tokens/s covers steps 3 to S-3)
  --output DIR  where the table, chart, JSON and each job's run folder go
                (default: <job.dump_folder>/<job.name>/bench_strategies)"""

BATCH_USAGE = """usage: titanlite bench batch-sizes [--config FILE] [--steps S] [--max-batch-size B] [--output DIR]
                                   [--section.key VALUE ...]
  --steps S           steps per batch size (default 10; tokens/s covers steps 3 to S)
  --max-batch-size B  stop after this local batch size (default 64 on the CPU, which has no
                      out-of-memory error to stop at; 1024 on a GPU)
  --output DIR        default: <job.dump_folder>/<job.name>/bench_batch_sizes"""

PROFILED = 2  # steps in the profiled window at the end of each job
OOM_EXIT = 4  # a training worker's exit status for running out of device memory


@dataclass
class Strategy:
    name: str
    ranks: int
    args: list[str] = field(default_factory=list)


def strategies_for(n: int, base_args: list[str]) -> list[Strategy]:
    """The layouts to compare on n ranks; those the world size or the model cannot take are left out."""
    candidates = [
        Strategy("single device", 1, ["--parallelism.data_parallel_shard_degree", "1"]),
        Strategy(
            f"DDP x {n}",
            n,
            ["--parallelism.data_parallel_replicate_degree", str(n), "--parallelism.data_parallel_shard_degree", "1"],
        ),
        Strategy(
            f"ZeRO-2 x {n}",
            n,
            ["--parallelism.data_parallel_shard_degree", str(n), "--parallelism.fsdp_reshard_after_forward", "never"],
        ),
        Strategy(
            f"ZeRO-3 x {n}",
            n,
            ["--parallelism.data_parallel_shard_degree", str(n), "--parallelism.fsdp_reshard_after_forward", "always"],
        ),
    ]
    if n >= 4 and n % 2 == 0:
        candidates.append(
            Strategy(
                f"HSDP 2 x {n // 2}",
                n,
                [
                    "--parallelism.data_parallel_replicate_degree",
                    "2",
                    "--parallelism.data_parallel_shard_degree",
                    str(n // 2),
                ],
            )
        )
    if n % 2 == 0:
        dp = n // 2
        fsdp = f" x FSDP {dp}" if dp > 1 else ""
        candidates.append(
            Strategy(
                f"TP 2{fsdp}",
                n,
                ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", str(dp)],
            )
        )
        candidates.append(
            Strategy(
                f"PP 2{fsdp}",
                n,
                ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", str(dp)],
            )
        )
    usable = []
    for s in candidates:
        try:
            plan_run(parse_config(with_overrides(base_args, s.args)), s.ranks)
            usable.append(s)
        except ConfigError as e:
            print(f"bench: leaving out {s.name}: {e}")
    return usable


def launch(
    ranks: int, args: list[str], run_root: Path, name: str, timeout: float = 3600
) -> subprocess.CompletedProcess:
    """One training job: torchrun (LAUNCHER) of TRAIN_WORKER with `ranks` processes,
    run folder run_root/name; a failure ends its stderr with the worker's one-line reason."""
    cmd, env = local_launch(
        ranks,
        TRAIN_WORKER,
        with_overrides(args, ["--job.dump_folder", str(run_root), "--job.name", name]),
        log_dir=run_root / name / "torchrun_logs",
    )
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def last_error(proc: subprocess.CompletedProcess) -> str:
    return f"exit status {proc.returncode}: " + reason_in(proc.stderr).removeprefix("titanlite: error: ")[:300]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_records(path)[0] if path.exists() else []  # a torn last line (a crashed run) left out


# ----------------------------------------------------------------------------------------------
# Strategies


def strategies(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(STRATEGIES_USAGE)
        return 0
    default_n = int(os.environ.get("NGPU", 0)) or (torch.cuda.device_count() if uses_cuda() else 4)
    opts, rest = take_options(argv, {"ngpu": default_n, "steps": 12, "output": ""}, "bench strategies")
    if opts["ngpu"] < 1:
        raise ConfigError("bench strategies --ngpu must be at least 1")
    cfg = parse_config(rest)
    n, steps = opts["ngpu"], opts["steps"]
    if steps < PROFILED + 4:
        raise ConfigError(
            f"bench strategies needs --steps >= {PROFILED + 4} (2 warm-up, some timed, {PROFILED} profiled)"
        )
    out = Path(opts["output"] or Path(cfg.job.dump_folder) / cfg.job.name / "bench_strategies")
    check_writable_place(out, f"bench strategies --output {out}")
    out.mkdir(parents=True, exist_ok=True)
    global_batch = cfg.training.local_batch_size * n
    common = with_overrides(
        rest,
        [
            "--training.steps",
            str(steps),
            "--training.global_batch_size",
            str(global_batch),
            "--metrics.log_freq",
            str(steps - PROFILED - 1),
            "--metrics.throughput_warmup_steps",
            "2",
            "--checkpoint.enable",
            "false",
            "--profiling.enable_profiling",
            "true",
            "--profiling.profile_freq",
            str(steps),
            "--profiling.profile_active_steps",
            str(PROFILED),
            "--profiling.save_traces_folder",
            "profile",
        ],
    )
    rows = []
    for s in strategies_for(n, common):
        print(f"bench: {s.name} on {s.ranks} process(es) ...", flush=True)
        name = s.name.lower().replace(" ", "").replace("-", "")
        proc = launch(s.ranks, with_overrides(common, s.args), out, name)
        row: dict[str, Any] = {"strategy": s.name, "ranks": s.ranks, "run": name}
        records = read_metrics(out / name)
        timed = [r for r in records if r["step"] == steps - PROFILED - 1]
        if proc.returncode != 0 or not timed:
            row["error"] = last_error(proc)
            print(f"bench: {s.name} failed: {row['error']}")
            rows.append(row)
            continue
        t = timed[0]
        row |= {
            "tokens_per_s": t["tps"] * s.ranks,
            "tokens_per_s_per_device": t["tps"],
            "step_ms": 1e3 * global_batch * cfg.training.seq_len / (t["tps"] * s.ranks),
            "peak_memory_gib_rank0": t["mem_peak_gib"],
            "mfu_pct": t["mfu_pct"],
        }
        folder, result = analyze(out / name / "profile")
        write_results(folder, result)
        if result["empty"]:  # the shares below then average the other ranks
            row["traces_left_out"] = result["empty"]
            print(f"bench: {s.name}: the profiler recorded no training step in {', '.join(result['empty'])}; "
                  "its time shares average the other ranks", flush=True)  # fmt: skip
        avg = result["average"]
        row |= {key: avg[key] for key in ("compute_pct", "non_compute_pct", "idle_pct", "overlap_pct")}
        # Per profiled step (the profiler itself slows these steps; the shares are what compare).
        row["exposed_communication_ms_per_step"] = avg["exposed_communication_ms"] / PROFILED
        row["collectives_per_step"] = {kind: fig["count"] / PROFILED for kind, fig in avg["collectives"].items()}
        rows.append(row)
    base = next((r for r in rows if r["ranks"] == 1 and "error" not in r), None)
    for r in rows:
        if base and "error" not in r:
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["scaling_efficiency_pct"] = 100.0 * r["speedup"] / r["ranks"]
    device = torch.cuda.get_device_name() if uses_cuda() else "cpu (gloo)"
    header = (
        f"{cfg.model.name} {cfg.model.flavor}, global batch {global_batch} x {cfg.training.seq_len} tokens "
        f"(local {cfg.training.local_batch_size}), {n} processes, {device}, torch {torch.__version__}"
    )
    report = {"setup": header, "steps": steps, "rows": rows}
    (out / "strategies.json").write_text(json.dumps(report, indent=2) + "\n")
    table = strategies_markdown(report)
    (out / "strategies.md").write_text(table)
    print("\n" + table)
    chart = write_chart(rows, out / "strategies.png", header)
    print(f"written: {out / 'strategies.md'}, {out / 'strategies.json'}" + (f", {chart}" if chart else ""))
    return 0


def _collective_summary(counts: dict) -> str:
    short = {
        "all-gather": "AG",
        "reduce-scatter": "RS",
        "all-reduce": "AR",
        "send/recv": "P2P",
        "broadcast": "BC",
        "all-to-all": "A2A",
        "barrier": "BAR",
    }
    return ", ".join(f"{short.get(k, k)} {v:g}" for k, v in counts.items()) or "none"


def strategies_markdown(report: dict) -> str:
    def f(value, fmt):
        return "" if value is None else format(value, fmt)

    lines = [
        f"# Strategies: {report['setup']}",
        "",
        "Tokens/s: all ranks, steps 3 to S-3 (before the profiled steps). Memory: rank 0's peak "
        "(CUDA max allocated; on the CPU the process's peak RSS). Shares, overlap, exposed communication "
        f"and collectives: `titanlite analyze` on the last {PROFILED} (profiled) steps, averaged over ranks; "
        "exposed communication and collective counts are per step.",
        "",
        "| strategy | ranks | step (ms) | tokens/s | speed-up | scaling eff. | peak mem (GiB) | compute % "
        "| non-compute % | idle % | overlap % | exposed comm / step (ms) | collectives / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['strategy']} | {r['ranks']} | failed: {r['error']} |" + " |" * 10)
            continue
        lines.append(
            f"| {r['strategy']} | {r['ranks']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
            f"{f(r.get('speedup'), '.2f')} | {f(r.get('scaling_efficiency_pct'), '.0f')}% | "
            f"{r['peak_memory_gib_rank0']:.2f} | {r['compute_pct']:.1f} | {r['non_compute_pct']:.1f} | "
            f"{r['idle_pct']:.1f} | {r['overlap_pct']:.1f} | {r['exposed_communication_ms_per_step']:.1f} | "
            f"{_collective_summary(r['collectives_per_step'])} |"
        )
    return "\n".join(lines) + "\n"


def write_chart(rows: list[dict], path: Path, title: str) -> Path | None:
    """Throughput and peak memory per strategy, side by side; None (with a note) without matplotlib."""
    try:
        import matplotlib  # optional dependency (the [bench] extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after choosing the Agg backend (no display)
    except ImportError:
        print("bench: no chart: matplotlib is not installed (pip install '.[bench]')")
        return None
    ok = [r for r in rows if "error" not in r]
    names = [r["strategy"] for r in ok]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars = left.bar(names, [r["tokens_per_s"] for r in ok], color="tab:blue")
    left.bar_label(bars, labels=[f"{r['tokens_per_s']:,.0f}" for r in ok], fontsize=8)
    left.set_title("throughput (tokens/s, all ranks)")
    bars = right.bar(names, [r["peak_memory_gib_rank0"] for r in ok], color="tab:orange")
    right.bar_label(bars, labels=[f"{r['peak_memory_gib_rank0']:.2f}" for r in ok], fontsize=8)
    right.set_title("peak memory, rank 0 (GiB)")
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# Batch sizes


def batch_sizes(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(BATCH_USAGE)
        return 0
    cuda = uses_cuda()
    opts, rest = take_options(
        argv, {"steps": 10, "max-batch-size": 1024 if cuda else 64, "output": ""}, "bench batch-sizes"
    )
    cfg = parse_config(rest)
    steps = opts["steps"]
    if steps < 3 or opts["max-batch-size"] < 1:
        raise ConfigError(
            "bench batch-sizes needs --steps >= 3 (2 warm-up steps, then timed ones) and --max-batch-size >= 1"
        )
    out = Path(opts["output"] or Path(cfg.job.dump_folder) / cfg.job.name / "bench_batch_sizes")
    check_writable_place(out, f"bench batch-sizes --output {out}")
    out.mkdir(parents=True, exist_ok=True)
    rows, batch, stop = [], 1, ""
    while batch <= opts["max-batch-size"]:
        print(f"bench: local batch {batch} ...", flush=True)
        name = f"batch{batch}"
        args = with_overrides(
            rest,
            [
                "--training.local_batch_size",
                str(batch),
                "--training.global_batch_size",
                str(batch),
                "--training.steps",
                str(steps),
                "--metrics.log_freq",
                str(steps),
                "--checkpoint.enable",
                "false",
                "--parallelism.data_parallel_shard_degree",
                "1",
            ],
        )
        proc = launch(1, args, out, name)
        records = read_metrics(out / name)
        if proc.returncode != 0 or not records:
            oom = proc.returncode == 4  # a worker's torch.OutOfMemoryError (titanlite/base/failures.py)
            stop = f"batch {batch}: {'out of memory' if oom else last_error(proc)}"
            rows.append({"batch": batch, "error": "out of memory" if oom else last_error(proc)})
            break
        r = records[-1]
        rows.append(
            {
                "batch": batch,
                "tokens_per_s": r["tps"],
                "tflops": r["tflops"],
                "mfu_pct": r["mfu_pct"],
                "peak_memory_gib": r["mem_peak_gib"],
                "reserved_memory_gib": r["mem_reserved_gib"],
            }
        )
        batch *= 2
    if not stop:
        stop = f"stopped at --max-batch-size {opts['max-batch-size']}"
    device = torch.cuda.get_device_name() if cuda else "cpu"
    header = f"{cfg.model.name} {cfg.model.flavor}, seq {cfg.training.seq_len}, one {device}, torch {torch.__version__}"
    report = {"setup": header, "rows": rows, "stop": stop}
    (out / "batch_sizes.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# Batch sizes: {header}",
        "",
        "| local batch | tokens/s | TFLOPs | MFU | peak memory (GiB) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['error']} | | | |")
        else:
            mfu = "n/a" if r["mfu_pct"] is None else f"{r['mfu_pct']:.1f}%"
            lines.append(
                f"| {r['batch']} | {r['tokens_per_s']:,.0f} | {r['tflops']:.2f} | {mfu} | {r['peak_memory_gib']:.2f} |"
            )
    lines += ["", f"End: {stop}."]
    table = "\n".join(lines) + "\n"
    (out / "batch_sizes.md").write_text(table)
    print("\n" + table + f"written: {out / 'batch_sizes.md'}, {out / 'batch_sizes.json'}")
    return 0

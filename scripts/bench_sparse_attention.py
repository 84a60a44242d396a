"""Sparse against dense latent attention on this machine's CPU: DeepSeek-V3.2's debug model (each query reads the 16
keys its indexer selects) beside DeepSeek-V3's (the same latent attention, dense: SDPA's fused causal kernel), one
layer each, one sequence of 4,096, 16,384 and 65,536 tokens a step.

    python3 scripts/bench_sparse_attention.py [--lengths 4096 16384 65536] [--output sparse.json]

For each model and length: `titanlite plan --measure` (three real steps under the tensor-level memory tracker: the
measured peak, and the planner's estimate beside it), then three plain steps, whose last is timed (tokens/s, the first
two are warm-up as the log's are). Prints one row per case; --output writes them as JSON."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {"dense (deepseek_v3)": "deepseek_v3", "sparse (deepseek_v32)": "deepseek_v32"}


def common(family: str, seq_len: int, folder: str) -> list[str]:
    return [
        "--config", f"train_configs/{family}_debug.toml", "--model.tokenizer", "byte", "--model.n_layers", "1",
        "--training.seq_len", str(seq_len), "--training.local_batch_size", "1", "--training.global_batch_size", "1",
        "--lr_scheduler.warmup_steps", "1", "--job.dump_folder", folder,
    ]  # fmt: skip


def titanlite(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "titanlite.commands.cli", *args]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args[:3])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


def case(family: str, seq_len: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        plan_json = Path(folder) / "plan.json"
        args = common(family, seq_len, folder)
        titanlite("plan", "--ngpu", "1", "--measure", *args, env={"TITANLITE_PLAN_JSON": str(plan_json)})
        plan = json.loads(plan_json.read_text())
        run = [*args, "--training.steps", "3", "--metrics.log_freq", "1", "--job.name", "timed"]
        titanlite("train", *run, "--training.memory_preflight", "false")
        records = [json.loads(line) for line in (Path(folder) / "timed" / "metrics.jsonl").read_text().splitlines()]
    return {
        "model": family,
        "seq_len": seq_len,
        "estimated_peak_mib": plan["estimate_peak"] / 2**20,
        "measured_peak_mib": plan["measured_peak"] / 2**20,
        "tokens_per_s": records[-1]["tps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    rows = []
    print(f"{'model':<24}{'tokens':>8}{'tokens/s':>10}{'peak MiB':>10}{'planner':>10}")
    for seq_len in args.lengths:
        for name, family in MODELS.items():
            row = case(family, seq_len)
            rows.append(row)
            print(
                f"{name:<24}{seq_len:>8}{row['tokens_per_s']:>10,.0f}{row['measured_peak_mib']:>10.1f}"
                f"{row['estimated_peak_mib']:>10.1f}",
                flush=True,
            )
    if args.output:
        args.output.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

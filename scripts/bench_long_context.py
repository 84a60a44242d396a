"""A long-context model beside its attention-only counterpart on this machine's CPU, one sequence of each length a
step. Two comparisons (--compare):

- "sparse": DeepSeek-V3.2's debug model (each query reads the 16 keys its indexer selects) beside DeepSeek-V3's (the
  same latent attention, dense: SDPA's fused causal kernel), one layer each;
- "mamba": Nemotron-H's debug model (three Mamba-2, one attention and two MLP layers) beside its all-attention cut
  (`debug_attention`: the same six layers, each Mamba-2 layer an attention layer);
- "compressed": DeepSeek-V4's debug model (a sliding layer, two CSA layers reading 2 picked blocks of 2 tokens, an
  HCA layer reading every block of 4, each beside a window of 8) beside the same model with dense attention
  (`debug_dense`: every layer's window holds the whole sequence, no blocks).

    python3 scripts/bench_long_context.py [--compare sparse|mamba|compressed] [--lengths 4096 16384] [--output F]

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
# comparison -> (row label, its config file, the arguments that make the model)
COMPARISONS = {
    "sparse": [
        ("dense (deepseek_v3)", "deepseek_v3_debug", ["--model.n_layers", "1"]),
        ("sparse (deepseek_v32)", "deepseek_v32_debug", ["--model.n_layers", "1"]),
    ],
    "mamba": [
        ("all attention (debug_attention)", "nemotron_h_debug", ["--model.flavor", "debug_attention"]),
        ("Nemotron-H (debug)", "nemotron_h_debug", []),
    ],
    "compressed": [
        ("dense attention (debug_dense)", "deepseek_v4_debug", ["--model.flavor", "debug_dense"]),
        ("DeepSeek-V4 (debug)", "deepseek_v4_debug", []),
    ],
}
LENGTHS = {"sparse": [4096, 16384, 65536], "mamba": [4096, 16384], "compressed": [4096, 16384, 65536]}


def common(config: str, model: list[str], seq_len: int, folder: str) -> list[str]:
    return [
        "--config", f"train_configs/{config}.toml", "--model.tokenizer", "byte", *model,
        "--model.attn_mask_type", "causal", "--training.seq_len", str(seq_len), "--training.local_batch_size", "1",
        "--training.global_batch_size", "1", "--lr_scheduler.warmup_steps", "1", "--job.dump_folder", folder,
    ]  # fmt: skip


def titanlite(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "titanlite.commands.cli", *args]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args[:3])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


def case(config: str, model: list[str], seq_len: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        plan_json = Path(folder) / "plan.json"
        args = common(config, model, seq_len, folder)
        titanlite("plan", "--ngpu", "1", "--measure", *args, env={"TITANLITE_PLAN_JSON": str(plan_json)})
        plan = json.loads(plan_json.read_text())
        run = [*args, "--training.steps", "3", "--metrics.log_freq", "1", "--job.name", "timed"]
        titanlite("train", *run, "--training.memory_preflight", "false")
        records = [json.loads(line) for line in (Path(folder) / "timed" / "metrics.jsonl").read_text().splitlines()]
    return {
        "seq_len": seq_len,
        "estimated_peak_mib": plan["estimate_peak"] / 2**20,
        "measured_peak_mib": plan["measured_peak"] / 2**20,
        "tokens_per_s": records[-1]["tps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=list(COMPARISONS), default="sparse")
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    rows = []
    print(f"{'model':<34}{'tokens':>8}{'tokens/s':>10}{'peak MiB':>10}{'planner':>10}")
    for seq_len in args.lengths or LENGTHS[args.compare]:
        for name, config, model in COMPARISONS[args.compare]:
            row = {"model": name, **case(config, model, seq_len)}
            rows.append(row)
            print(
                f"{name:<34}{seq_len:>8}{row['tokens_per_s']:>10,.0f}{row['measured_peak_mib']:>10.1f}"
                f"{row['estimated_peak_mib']:>10.1f}",
                flush=True,
            )
    if args.output:
        args.output.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

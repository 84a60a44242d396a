"""Does a change leave the numbers alone? Trains the same short runs at a base commit and at the working tree, and
compares every logged figure that the model's math decides, bit for bit.

    .venv/bin/python scripts/same_numbers.py BASE [--steps 20] [--only NAME,...]

BASE is any commit (e.g. HEAD~3 or main): it is checked out into a temporary git worktree and run with this
checkout's interpreter. The runs: the default config, and the debug configs of llama3, qwen3, gemma3, gpt_oss,
deepseek_v3 and qwen3_moe (one process each, the CPU). Compared per step: loss, grad_norm, lr, and where logged
val_loss, aux_load_balance, expert_load; timings and memory are left out (they vary from run to run). Prints one
line per run and exits 1 if any figure differs. A refactor that must not change the math (one shared decoder,
say) shows it with this.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("llama3", "qwen3", "gemma3", "gpt_oss", "deepseek_v3", "qwen3_moe")
RUNS = {"default": [], **{name: ["--config", f"train_configs/{name}_debug.toml"] for name in FAMILIES}}
FIGURES = ("loss", "grad_norm", "lr", "val_loss", "aux_load_balance", "expert_load")


def train(tree: Path, folder: Path, args: list[str], steps: int) -> list[dict]:
    cmd = [sys.executable, "-m", "titanlite.commands.cli", "train", "--job.dump_folder", str(folder)]
    cmd += ["--job.name", "run", "--training.steps", str(steps), "--metrics.log_freq", "1", *args]
    env = {**os.environ, "PYTHONPATH": str(tree), "TITANLITE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"same_numbers: {' '.join(args) or 'default'} failed in {tree}:\n{proc.stderr[-2000:]}")
    lines = (folder / "run" / "metrics.jsonl").read_text().splitlines()
    return [{k: r[k] for k in ("step", *FIGURES) if k in r} for r in map(json.loads, lines)]


def first_difference(base: list[dict], ours: list[dict]) -> str:
    if len(base) != len(ours):
        return f"{len(ours)} records, the base {len(base)}"
    for a, b in zip(base, ours):
        if a != b:
            key = next(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
            return f"step {b.get('step')}: {key} {b.get(key)!r}, the base {a.get(key)!r}"
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", default="", help="comma-separated run names: " + ", ".join(RUNS))
    opts = parser.parse_args()
    chosen = [n for n in RUNS if not opts.only or n in opts.only.split(",")]
    scratch = Path(tempfile.mkdtemp(prefix="titanlite-same-numbers-"))
    tree = scratch / "base"
    git = ["git", "worktree"]
    subprocess.run([*git, "add", "--detach", str(tree), opts.base], cwd=REPO, check=True, capture_output=True)
    differ = 0
    try:
        for name in chosen:
            base = train(tree, scratch / "runs-base" / name, RUNS[name], opts.steps)
            ours = train(REPO, scratch / "runs-ours" / name, RUNS[name], opts.steps)
            problem = first_difference(base, ours)
            differ += bool(problem)
            said = f"{name:<12} {len(ours)} steps"
            print(f"DIFFERS {said}: {problem}" if problem else f"same    {said}", flush=True)
    finally:
        subprocess.run([*git, "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{len(chosen) - differ} of {len(chosen)} runs log the base's figures bit for bit")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

"""Does a change leave the numbers alone? Trains the same short runs at a base commit and at the working tree, and
compares every logged figure that the model's math decides, bit for bit.

    .venv/bin/python scripts/same_numbers.py BASE [--steps 20] [--only NAME,...]
    .venv/bin/python scripts/same_numbers.py BASE --init-only

BASE is any commit (e.g. HEAD~3 or main): it is checked out into a temporary git worktree and run with this
checkout's interpreter. The runs: the default config, and the debug configs of llama3, qwen3, gemma3, gemma4,
gemma4_moe, gpt_oss, deepseek_v3 and qwen3_moe (one process each, the CPU). Compared per step: loss, grad_norm, lr,
and where logged val_loss, aux_load_balance, expert_load; timings and memory are left out (they vary from run to
run). Prints one line per run and exits 1 if any figure differs. A refactor that must not change the math (one
shared decoder, say) shows it with this. --init-only trains nothing: it builds every registered family's debug
flavor and the families' under tests/families (each also with a multi-token prediction depth, per-layer inputs and
a tied head's own copy where its arguments have them) in both trees, starts each with init_weights(model, seed=0)
and compares every parameter bit for bit, one line per family.
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
FAMILIES = ("llama3", "qwen3", "gemma3", "gemma4", "gemma4_moe", "gpt_oss", "deepseek_v3", "qwen3_moe")
RUNS = {"default": [], **{name: ["--config", f"train_configs/{name}_debug.toml"] for name in FAMILIES}}
FIGURES = ("loss", "grad_norm", "lr", "val_loss", "aux_load_balance", "expert_load")
# Run in each tree (--init-only): every family's debug flavor started from seed 0, its parameters saved by family.
INIT_SNAPSHOT = """
import dataclasses, importlib, pkgutil, sys, torch
import tests.families
from titanlite.models import registry
from titanlite.models.common.init import init_weights
for found in pkgutil.iter_modules(tests.families.__path__):  # the families this tree has under tests/families
    importlib.import_module(f"tests.families.{found.name}")  # registered on import

def variants(name, args):
    fields = {f.name for f in dataclasses.fields(args)}
    yield name, args, False
    if "mtp_layers" in fields:
        yield name + "+mtp", dataclasses.replace(args, mtp_layers=1), False
    if "per_layer_dim" in fields and not args.per_layer_dim:
        yield name + "+per_layer", dataclasses.replace(args, per_layer_dim=8), False
    if args.tie_embeddings:  # a pipeline's last stage: the tied head's own copy
        yield name + "+head_copy", args, True

weights = {}
for name in registry.names():
    for key, args, head_copy in variants(name, registry.model_args(name, "debug", 256, 64)):
        try:
            spec = registry.spec_of(args)
            model = spec.load(spec.model)(args)
            if head_copy:
                model.output.weight = torch.nn.Parameter(torch.empty_like(model.output.weight))
            init_weights(model, seed=0)
            weights[key] = {k: v.detach().clone() for k, v in model.named_parameters()}
        except Exception as e:  # a variant the family refuses: the same refusal in both trees
            weights[key] = {"refused": torch.tensor(list(type(e).__name__.encode()))}
torch.save(weights, sys.argv[1])
"""


def train(tree: Path, folder: Path, args: list[str], steps: int) -> list[dict]:
    cmd = [sys.executable, "-m", "titanlite.commands.cli", "train", "--job.dump_folder", str(folder)]
    cmd += ["--job.name", "run", "--training.steps", str(steps), "--metrics.log_freq", "1", *args]
    env = {**os.environ, "PYTHONPATH": str(tree), "TITANLITE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"same_numbers: {' '.join(args) or 'default'} failed in {tree}:\n{proc.stderr[-2000:]}")
    lines = (folder / "run" / "metrics.jsonl").read_text().splitlines()
    return [{k: r[k] for k in ("step", *FIGURES) if k in r} for r in map(json.loads, lines)]


def init_snapshot(tree: Path, path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "TITANLITE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", INIT_SNAPSHOT, str(path)], cwd=tree, env=env, capture_output=True)
    if proc.returncode != 0:
        raise SystemExit(f"same_numbers: the init snapshot failed in {tree}:\n{proc.stderr.decode()[-2000:]}")
    import torch  # lazy: only --init-only reads the snapshots

    return torch.load(path)


def compare_inits(tree: Path, scratch: Path) -> int:
    """Print one line per family: its debug flavor's initial parameters here against the base's; the count differing."""
    base, ours = init_snapshot(tree, scratch / "base.pt"), init_snapshot(REPO, scratch / "ours.pt")
    differ = 0
    for name in sorted(set(base) | set(ours)):
        a, b = base.get(name, {}), ours.get(name, {})
        if name not in base:  # a family this tree adds: nothing to compare it with
            print(f"new     {name:<20} {len(b)} parameters (not in the base)", flush=True)
            continue
        problem = "" if name in ours else "missing in this tree"
        if not problem and a.keys() != b.keys():
            problem = f"parameter names differ: {sorted(set(a) ^ set(b))[:4]}"
        if not problem:
            bad = [k for k in a if not torch_equal(a[k], b[k])]
            problem = f"{len(bad)} of {len(a)} parameters differ, first {bad[0]}" if bad else ""
        differ += bool(problem)
        said = f"{name:<20} {len(b)} parameters"
        print(f"DIFFERS {said}: {problem}" if problem else f"same    {said}", flush=True)
    print(f"{len(base) - differ} of {len(base)} families start from the base's weights bit for bit")
    return differ


def torch_equal(a, b) -> bool:
    """Bit for bit: the same shape, dtype and bytes."""
    same_kind = a.shape == b.shape and a.dtype == b.dtype
    return same_kind and a.contiguous().numpy().tobytes() == b.contiguous().numpy().tobytes()


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
    parser.add_argument("--init-only", action="store_true", help="compare every family's initial weights only")
    opts = parser.parse_args()
    chosen = [n for n in RUNS if not opts.only or n in opts.only.split(",")]
    scratch = Path(tempfile.mkdtemp(prefix="titanlite-same-numbers-"))
    tree = scratch / "base"
    git = ["git", "worktree"]
    subprocess.run([*git, "add", "--detach", str(tree), opts.base], cwd=REPO, check=True, capture_output=True)
    differ = 0
    try:
        if opts.init_only:
            return 1 if compare_inits(tree, scratch) else 0
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

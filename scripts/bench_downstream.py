"""Downstream scoring's speed, on this machine: `titanlite eval --tasks` against lm-eval's own `hf` model on the same
model exported to a Hugging Face folder, and the in-loop scoring's cost on the training steps that do not score.

    .venv/bin/python scripts/bench_downstream.py [--flavor 124M] [--docs 100] [--repeats 3] [--output bench.json]

The model is GPT-2 of --flavor with the GPT-2 tokenizer, at its initial weights (titanlite seed-checkpoint: speed does
not depend on what the weights learnt), exported with `titanlite convert to-hf`. The tasks are local: a multiple-choice
task of --docs questions, four choices each, and a perplexity task of --docs // 4 documents (rolling windows of the
run's 128 tokens). Both scorers read the same requests in batches of 8 (titanlite: 8 rows per forward; lm-eval:
batch_size 8) at 128 tokens at most, in float32 on the CPU.

  requests/s   what lm-eval asked (log-likelihood requests and rolling windows) over the seconds of lm-eval's
               simple_evaluate around it, the model already loaded: for titanlite the time `titanlite eval` prints
               (run in this process, as the entry point runs it), for lm-eval's hf model a simple_evaluate on an HFLM
               made before the clock starts. One untimed round of each first (lm-eval's first call imports its
               metrics), then the median of --repeats, alternating; both in this process, one after the other.
  in-loop      runs of 30 steps with the tasks scored at step 30 only (downstream.interval 30), against the same runs
               without them: the median step time of steps 3 to 29 (the warm-up and the scoring step left out) over
               --repeats runs of each, alternating.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TITANLITE = [sys.executable, "-m", "titanlite.commands.cli"]
WORDS = "river stone light table garden window music paper winter market doctor bridge animal letter".split()


def write_tasks(folder: Path, docs: int) -> None:
    """A multiple-choice task (tb_choice) and a perplexity task (tb_text) of made-up English, with their documents."""
    folder.mkdir(parents=True, exist_ok=True)
    choice = [
        {
            "question": f"Which word comes after {WORDS[i % len(WORDS)]} in the list of the {i}th lesson?",
            "choices": [
                f"the {WORDS[(i + k) % len(WORDS)]} by the {WORDS[(i * k + 3) % len(WORDS)]}" for k in range(4)
            ],
            "answer": i % 4,
        }
        for i in range(docs)
    ]
    text = [{"text": " ".join(WORDS[(i * j + j) % len(WORDS)] for j in range(300)) + "."} for i in range(docs // 4)]
    for name, rows in (("tb_choice", choice), ("tb_text", text)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "tb_choice.yaml").write_text(
        f"task: tb_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder}/tb_choice.jsonl\n"
        'test_split: test\noutput_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\nmetric_list:\n'
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (folder / "tb_text.yaml").write_text(
        f"task: tb_text\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder}/tb_text.jsonl\n"
        'test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n    aggregation: weighted_perplexity\n    higher_is_better: false\n"
    )


def run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


class Lines(logging.Handler):
    """The log lines of this process (what `titanlite eval` prints), kept."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def titanlite_once(args: list[str], tasks: Path, output: Path) -> tuple[int, float, dict]:
    """`titanlite eval --tasks` in this process (as the entry point runs it): the requests and seconds it prints."""
    from titanlite.commands.cli import main as titanlite

    lines = Lines()
    logging.getLogger().addHandler(lines)
    try:
        code = titanlite(["eval", *args, "--tasks", "tb_choice,tb_text", "--include-path", str(tasks),
                          "--bootstrap-iters", "0", "--output", str(output)])  # fmt: skip
    finally:
        logging.getLogger().removeHandler(lines)
    found = [m for m in (re.search(r": (\d+) requests in ([0-9.]+)s", line) for line in lines.lines) if m]
    if code != 0 or not found:
        sys.exit(f"titanlite eval failed ({code}):\n" + "\n".join(lines.lines[-20:]))
    return int(found[-1][1]), float(found[-1][2]), json.loads(output.read_text())["results"]


def hf_once(lm, tasks: Path) -> tuple[float, dict]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    start = time.perf_counter()
    results = simple_evaluate(model=lm, tasks=["tb_choice", "tb_text"], task_manager=manager, bootstrap_iters=0)
    return time.perf_counter() - start, results["results"]


def step_times(folder: Path) -> list[float]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r["elapsed_s"] for r in records]


def in_loop(base: list[str], tasks: Path, scratch: Path, repeats: int) -> dict:
    """Median step time (from consecutive elapsed_s) of steps 3..29 with and without downstream scoring at step 30,
    over `repeats` runs of each, alternating."""
    times: dict[str, list[float]] = {"without": [], "with": []}
    scored = ["--downstream.tasks", "tb_choice", "--downstream.include_path", str(tasks), "--downstream.interval", "30",
              "--downstream.limit", "20"]  # fmt: skip
    for i in range(repeats):
        for name, extra in (("without", []), ("with", scored)):
            job = f"loop_{name}_{i}"
            run([*TITANLITE, "train", *base, "--job.name", job, "--training.steps", "30", "--metrics.log_freq", "1",
                 *extra])  # fmt: skip
            elapsed = step_times(scratch / job)
            times[name] += [b - a for a, b in zip(elapsed[2:28], elapsed[3:29])]
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flavor", default="124M")
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="")
    opts = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench_downstream_"))
    tasks = scratch / "tasks"
    write_tasks(tasks, opts.docs)
    base = ["--model.name", "gpt2", "--model.flavor", opts.flavor, "--model.tokenizer", "gpt2", "--training.seq_len",
            "128", "--training.local_batch_size", "8", "--job.dump_folder", str(scratch)]  # fmt: skip
    args = [*base, "--job.name", "model"]
    run([*TITANLITE, "seed-checkpoint", *args])
    run([*TITANLITE, "convert", "to-hf", "--output", str(scratch / "hf"), *args])

    import torch
    from lm_eval.models.huggingface import HFLM

    torch.set_num_threads(torch.get_num_threads())
    lm = HFLM(pretrained=str(scratch / "hf"), max_length=128, batch_size=8, dtype="float32", device="cpu")
    titanlite_once(args, tasks, scratch / "warm.json")
    hf_once(lm, tasks)
    ours, theirs, requests, same = [], [], 0, None
    for i in range(opts.repeats):
        requests, seconds, our_results = titanlite_once(args, tasks, scratch / f"ours{i}.json")
        ours.append(seconds)
        seconds, their_results = hf_once(lm, tasks)
        theirs.append(seconds)
        same = our_results["tb_choice"]["acc,none"] == their_results["tb_choice"]["acc,none"]
    figures = {
        "flavor": opts.flavor,
        "requests": requests,
        "titanlite_seconds": statistics.median(ours),
        "hf_seconds": statistics.median(theirs),
        "titanlite_requests_per_s": requests / statistics.median(ours),
        "hf_requests_per_s": requests / statistics.median(theirs),
        "same_acc": same,
    }
    figures["ratio"] = figures["titanlite_requests_per_s"] / figures["hf_requests_per_s"]
    loop = in_loop(base, tasks, scratch, opts.repeats)
    figures["step_s_without"], figures["step_s_with"] = loop["without"], loop["with"]
    print(f"requests (tb_choice x 4 choices + tb_text's rolling windows): {requests}")
    print(f"titanlite eval --tasks: {figures['titanlite_requests_per_s']:.1f} requests/s "
          f"(median {figures['titanlite_seconds']:.2f} s of {opts.repeats})")  # fmt: skip
    print(f"lm-eval hf on the export: {figures['hf_requests_per_s']:.1f} requests/s "
          f"(median {figures['hf_seconds']:.2f} s of {opts.repeats})")  # fmt: skip
    print(f"ratio titanlite / hf: {figures['ratio']:.2f}; the same tb_choice acc: {same}")
    print(f"in-loop: median step {loop['without'] * 1000:.1f} ms without downstream tasks, "
          f"{loop['with'] * 1000:.1f} ms with them (steps 3-29; scored at step 30 only)")  # fmt: skip
    if opts.output:
        Path(opts.output).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()

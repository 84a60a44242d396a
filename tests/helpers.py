"""Launch real training runs (torchrun + gloo on CPU) and read back their per-step metrics; a failed run's
assertion message starts with its worker's one-line reason. `run_ranks` runs one function on a few gloo
processes, for a check of collectives that needs no training run."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from tests.pool import PoolFailure, Ran, cli_job, pool, train_job
from titanlite.base.command_line import override_items
from titanlite.base.failures import reason_in

REPO = Path(__file__).resolve().parents[1]

# A small, fast setting of the debug model: global batch 8 sequences of 32 tokens, logged every step, on the
# byte tokenizer (257 ids, padded to 320): GPT-2's 50,304 rows were three quarters of a step's time.
TINY = [
    "--model.tokenizer",
    "byte",
    "--training.steps",
    "5",
    "--training.seq_len",
    "32",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
]
# Two pipeline stages in micro-batches of 2 on the interleaved schedule (whose forward-only path evaluates).
PP2 = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.pipeline_parallel_microbatch_size",
    "2",
    "--parallelism.pipeline_parallel_schedule",
    "Interleaved1F1B",
]
# A small validation corpus: 25 windows of 32 byte tokens (the last global batch of 8 is padded, one window in it).
VALIDATION_TEXT = REPO / "tests" / "data" / "validation.txt"
VALIDATION_WINDOWS = 25
# TINY, evaluated on VALIDATION_TEXT at steps 2, 4 and 5: what the reference runs and every layout
# parity test use, so that each compares validation losses too.
VALIDATED = [
    *TINY,
    "--validation.enable",
    "true",
    "--validation.freq",
    "2",
    "--validation.dataset_path",
    str(VALIDATION_TEXT),
]


def last_wins(argv: list[str]) -> list[str]:
    """A test's command line made of a base and its changes (`[*TINY, "--training.steps", "20"]`, a helper's
    `--job.name run` and the test's own): each option's last value only, where it stands. titanlite refuses an option
    given twice on one command line; the runners below pass what they are given through this."""
    items = override_items(argv)
    last = {key: i for i, (key, _) in enumerate(items) if key}
    return [arg for i, (key, args) in enumerate(items) if not key or last[key] == i for arg in args]


def env(**extra: str) -> dict[str, str]:
    """The environment of a launched run: one thread per rank, this interpreter, and (from
    tests/conftest.py) TITANLITE_DEVICE=cpu unless a gpu test passes TITANLITE_DEVICE="cuda"."""
    e = {**os.environ, "OMP_NUM_THREADS": "1", "TITANLITE_PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
    e.update(extra)
    return e


def worker_pids(launcher: int) -> list[str]:
    """The workers of a running launcher: the children of its forkserver (titanlite/commands/launch.py)."""
    children = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True).stdout.split()
    servers = [pid for pid in children if "multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_text()]
    return [
        w for s in servers for w in subprocess.run(["pgrep", "-P", s], capture_output=True, text=True).stdout.split()
    ]


def logged(caplog) -> list[str]:
    """The lines titanlite's loggers gave since caplog.clear(), as its entry points print them (titanlite/base/logs.py);
    the test calls caplog.set_level(logging.INFO, logger="titanlite") first."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("titanlite.")]


def torchrun(nproc: int, args: list[str], run_dir: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """One training run with `nproc` gloo ranks; the run folder is run_dir/run."""
    cmd = [
        sys.executable,
        "-m",
        "titanlite.commands.launch",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--log-dir={run_dir / 'torchrun_logs'}",
        "-m",
        "titanlite.commands.train",
        *last_wins(["--job.dump_folder", str(run_dir), "--job.name", "run", *args]),
    ]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


def train_in_pool(
    nproc: int,
    args: list[str],
    run_dir: Path,
    timeout: float = 300,
    job_name: str = "run",
    kind: str = "",
    **extra_env: str,
) -> Ran:
    """What torchrun(nproc, args, run_dir) runs, on `nproc` ranks of the pool (tests/pool.py) that outlives the
    test: the worker's own train() on each rank, without starting and importing N interpreters. A failure on any
    rank fails the test with its traceback; the result has the run's stdout (rank 0's, then what other ranks say).
    The run folder is run_dir/job_name; `kind`: the pool's (tests/pool.py pool)."""
    argv = last_wins(["--job.dump_folder", str(run_dir), "--job.name", job_name, *args])
    folder = Path(run_dir) / job_name
    with tempfile.TemporaryDirectory() as kept:
        if folder.exists():  # what the test put there (a checkpoint to resume), for a second attempt
            shutil.copytree(folder, Path(kept) / "run", symlinks=True)
        try:
            return pool(nproc, kind).run(train_job, argv, env=extra_env, timeout=timeout)
        except PoolFailure as failure:
            # A rank killed by a signal inside glibc or gloo (seen once: 'tcache_thread_shutdown(): unaligned tcache
            # chunk detected', SIGABRT, in a rank that had run many bodies) is the long-lived rank's, not the run's:
            # the body runs once more on a fresh pool from the same run folder, with a warning; a second death fails.
            if "died (exit code -" not in str(failure):
                raise
            warnings.warn(f"a pool rank died; the run is repeated on a fresh pool: {str(failure)[:300]}", stacklevel=2)
            shutil.rmtree(folder, ignore_errors=True)
            if (Path(kept) / "run").exists():
                shutil.copytree(Path(kept) / "run", folder, symlinks=True)
            return pool(nproc, kind).run(train_job, argv, env=extra_env, timeout=timeout)


def cli_in_pool(argv: list[str], timeout: float = 300, kind: str = "") -> subprocess.CompletedProcess:
    """`titanlite ARGV` run by the pool's one rank (tests/pool.py), its status and what it printed: for a command
    whose figures a test reads (`eval` on one process), without starting an interpreter that imports torch and
    titanlite; the rank gets its torch switches, environment and folder back afterwards."""
    ran = pool(1, kind).run(cli_job, last_wins(list(argv)), timeout=timeout)
    return subprocess.CompletedProcess(list(argv), ran.values[0], ran.stdout, ran.stderr)


def titanlite_here(*argv: str) -> subprocess.CompletedProcess:
    """`titanlite ARGV` in this pytest process (titanlite/commands/cli.py main, as the `titanlite` entry point runs
    it): its status and what it printed, without an interpreter of its own (about 4 s of CPU each). For the one-line
    refusals of `check`, `plan` and `generate`: the path from a refusal to its line and status 2 is one `except` in
    main, and a process of its own shows it where the launch is what is tested (tests/test_launcher.py,
    tests/distributed/test_run_folder_trust.py, tests/unit/test_preflight.py)."""
    from titanlite.commands.cli import main  # imports torch and titanlite: only the tests that use it pay

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(last_wins(list(argv)))
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


def run_train_sh(
    args: list[str], run_dir: Path, ngpu: int | None = 1, timeout: int = 300, **extra_env: str
) -> subprocess.CompletedProcess:
    """The user's command, ./run_train.sh, with NGPU processes (ngpu=None: NGPU unset, the launcher's default)."""
    cmd = [str(REPO / "run_train.sh"), *last_wins(["--job.dump_folder", str(run_dir), "--job.name", "run", *args])]
    launch_env = env(**({} if ngpu is None else {"NGPU": str(ngpu)}), **extra_env)
    if ngpu is None:
        launch_env.pop("NGPU", None)
    return subprocess.run(cmd, cwd=REPO, env=launch_env, capture_output=True, text=True, timeout=timeout)


def metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def wait_for_steps(job: subprocess.Popen, run_dir: Path, steps: int, timeout: float = 300) -> None:
    """Until the launched `job` has logged `steps` steps to run_dir/run/metrics.jsonl. A job that ends first, or
    a timeout (a loaded machine starts slowly: two pytest workers share its cores), fails the test with what the
    job printed, after ending it, rather than letting the test signal a run that is not there yet."""
    path = Path(run_dir) / "run" / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while job.poll() is None and time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    if job.poll() is None:
        job.kill()
    out, err = job.communicate()
    raise AssertionError(f"the job did not log {steps} steps within {timeout} s (exit {job.returncode}):\n"
                         f"{(out or '')[-2000:]}\n{(err or '')[-3000:]}")  # fmt: skip


def losses(proc: subprocess.CompletedProcess, run_dir: Path) -> list[float]:
    assert proc.returncode == 0, (
        f"run failed ({proc.returncode}): {reason_in(proc.stderr)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return [r["loss"] for r in metrics(run_dir)]


# Losses must match to the 1e-5. Grad norms agree to ~1e-6 at step 1; after that Adam's
# normalisation of near-zero gradients turns float32 reduction-order noise into weight differences
# too small to move the loss (~1e-7) but visible in the norm (~3e-5 by step 5).
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
# At step 1 the weights and the batch are the same on every layout: only the order of float32 reductions differs
# (every parity test of the suite within 1.6e-7 on 2026-11-28). A gradient that misses a reduction over some ranks
# shows there first: a norm's weight left out of tensor parallelism's plan gave 1.1e-5 under FSDP 2 x TP 2, while
# its losses stayed within 1e-5 and its later grad norms within 1e-4, Adam's normalised steps hiding it.
STEP1_GRAD_NORM_RTOL = 1e-6


def assert_matches(records: list[dict], reference: list[dict]) -> None:
    """Per-step losses and grad norms of a parallel run equal the single-process run's, and so do the
    validation losses, evaluated at the same steps."""
    assert_close([r["loss"] for r in records], [r["loss"] for r in reference], LOSS_RTOL)
    assert_close([r["grad_norm"] for r in records], [r["grad_norm"] for r in reference], GRAD_NORM_RTOL)
    if records and records[0]["step"] == 1:
        assert_close([records[0]["grad_norm"]], [reference[0]["grad_norm"]], STEP1_GRAD_NORM_RTOL)
    assert [r["step"] for r in records if "val_loss" in r] == [r["step"] for r in reference if "val_loss" in r]
    assert_close(
        [r["val_loss"] for r in records if "val_loss" in r],
        [r["val_loss"] for r in reference if "val_loss" in r],
        LOSS_RTOL,
    )


def assert_close(actual: list[float], expected: list[float], rtol: float) -> None:
    assert len(actual) == len(expected), (actual, expected)
    for step, (a, e) in enumerate(zip(actual, expected), start=1):
        assert abs(a - e) <= rtol * abs(e), f"step {step}: {a} vs {e} (relative {abs(a - e) / abs(e):.2e} > {rtol})"


def checkpoint_tensors(path, scratch) -> dict:
    """The model and optimizer tensors of a DCP checkpoint folder, by flattened name (full tensors, whatever
    the layout that saved them)."""
    scratch.mkdir(parents=True, exist_ok=True)
    out = scratch / f"{path.name}.pt"
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(out))
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    state = torch.load(out, weights_only=False)
    walk("", {k: v for k, v in state.items() if k in ("model", "optimizer")})  # not lr_scheduler, train_state, ...
    return flat


def run_ranks(worker: Callable[[int], None], nprocs: int = 2) -> None:
    """Run `worker(rank)` on `nprocs` ranks of the pool (tests/pool.py) joined in one gloo process group (the
    default group, made for this call and destroyed after it); an exception on any rank fails the caller with that
    rank's traceback. `worker` must be a module-level function: the ranks import it."""
    pool(nprocs).run(_in_default_group, worker)


def _in_default_group(worker: Callable[[int], None]) -> None:
    import torch.distributed as dist  # in the pool's rank, where torch is imported already

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=60))
    worker(rank)


# ---- downstream tasks: three local lm-eval tasks (a YAML file and JSON-lines documents each) ----

TASKS = "tl_choice,tl_text,tl_sum"
CHOICE_YAML = """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
TEXT_YAML = """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""
SUM_YAML = """output_type: generate_until
doc_to_text: "{{question}}="
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
QUESTIONS = [
    ("Which is a colour?", ["red", "seven", "under"], 0),
    ("What do bees make?", ["honey", "bricks", "rain"], 0),
    ("How many legs has a cat?", ["two", "four", "nine"], 1),
    ("Where does a fish live?", ["in a tree", "in the sky", "in the water"], 2),
    ("Which number is even?", ["3", "8", "11"], 1),
    ("What opens a lock?", ["a key", "a spoon", "a cloud"], 0),
]
TEXTS = [
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "The standard library holds modules for files, text, numbers and the network; each has its tests.",
    "import os\nfor name in sorted(os.listdir('.')):\n    print(name)\n",
]
SUMS = [("2+3", "5"), ("10+7", "17"), ("4+4", "8"), ("21+1", "22")]


def write_tasks(folder: Path) -> Path:
    """TASKS in `folder`: multiple choice (acc, acc_norm), a perplexity task (rolling log-likelihoods) and sums to
    generate (exact match), each a YAML file naming its documents there; nothing needs the hub."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("tl_choice", CHOICE_YAML), ("tl_text", TEXT_YAML), ("tl_sum", SUM_YAML)):
        header = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder}/{name}.jsonl\n"
        (folder / f"{name}.yaml").write_text(header + "test_split: test\n" + text)
    rows = {
        "tl_choice": [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS],
        "tl_text": [{"text": t} for t in TEXTS],
        "tl_sum": [{"question": q, "answer": a} for q, a in SUMS],
    }
    for name, docs in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return folder

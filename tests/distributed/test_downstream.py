"""Downstream tasks (lm-evaluation-harness) scored from titanlite checkpoints: during training and by `titanlite eval
--tasks`, on every layout, against lm-eval's own `hf` model on the exported folder, and generations against `titanlite
generate`. The tasks are local (YAML files and JSON-lines documents written here): nothing is fetched.

One 5-step run (scored in the loop at steps 2, 4 and 5, checkpointed at each) gives the checkpoints; one process's
`eval --tasks --log-samples` of step 5 is the reference every layout's answers are compared with, request by request.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import PP2, REPO, SUMS, TASKS, TINY, VALIDATED, cli_in_pool, env, metrics, train_in_pool, write_tasks
from tests.pool import close_pool, eval_job, pool

pytestmark = pytest.mark.distributed
KIND = "lm-eval"  # the bodies here run in pools of their own, ended after the module (tests/pool.py pool's `kind`)


@pytest.fixture(scope="module", autouse=True)
def own_pools():
    yield
    for ranks in (1, 2, 4):
        close_pool(ranks, KIND)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("tasks"))


def downstream(tasks: Path) -> list[str]:
    return ["--downstream.tasks", TASKS, "--downstream.include_path", str(tasks)]


@pytest.fixture(scope="module")
def run(tasks, tmp_path_factory) -> tuple[Path, list[dict]]:
    """The reference run (validated at steps 2, 4 and 5), scored in the loop at those steps too and checkpointed there:
    its folder and records."""
    run_dir = tmp_path_factory.mktemp("downstream_run")
    args = [
        *VALIDATED,
        *downstream(tasks),
        "--downstream.interval",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
    ]
    args.append("2")
    proc = train_in_pool(1, args, run_dir, kind=KIND)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "downstream at step 4: tl_choice/acc " in proc.stdout, proc.stdout[-3000:]
    return run_dir, metrics(run_dir)


def folder_args(run_dir: Path) -> list[str]:
    return ["--job.dump_folder", str(run_dir), "--job.name", "run"]


def eval_tasks(run_dir: Path, tasks: Path, output: Path, *extra: str) -> dict:
    """`titanlite eval --tasks` of the run on one process (the pool's rank), its results JSON."""
    argv = ["eval", *folder_args(run_dir), "--tasks", TASKS, "--include-path", str(tasks), "--bootstrap-iters", "0"]
    proc = cli_in_pool([*argv, "--output", str(output), *extra], kind=KIND)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return json.loads(output.read_text())


@pytest.fixture(scope="module")
def single(run, tasks, tmp_path_factory) -> dict:
    """One process's results for the step-5 checkpoint, with every request's answer (--log-samples)."""
    return eval_tasks(run[0], tasks, tmp_path_factory.mktemp("single") / "r.json", "--log-samples")


def answers(results: dict) -> dict[str, list]:
    """Each task's documents' answers, in document order: per request (log-likelihood, greedy) or the text."""
    return {
        task: [sample["resps"] for sample in sorted(samples, key=lambda s: s["doc_id"])]
        for task, samples in results["samples"].items()
    }


def figures(results: dict) -> dict[str, float]:
    return {
        f"downstream/{task}/{key.split(',')[0]}": value
        for task, row in results["results"].items()
        for key, value in row.items()
        if "," in key and "_stderr" not in key
    }


def assert_same_answers(ours: dict, theirs: dict, rel: float = 1e-5) -> None:
    """Equal accuracies and generations; log-likelihoods to `rel`; the same greedy flags."""
    a, b = answers(ours), answers(theirs)
    assert a.keys() == b.keys() == {"tl_choice", "tl_text", "tl_sum"}
    for task in a:
        assert len(a[task]) == len(b[task])
        for mine, other in zip(a[task], b[task]):
            flat_mine, flat_other = json.loads(json.dumps(mine)), json.loads(json.dumps(other))
            if task == "tl_sum":
                assert flat_mine == flat_other, (task, mine, other)
                continue
            for x, y in zip(flat_mine, flat_other):  # one entry per request of the document
                x, y = x[0], y[0]
                if isinstance(x, list):  # (log-likelihood, greedy)
                    assert x[0] == pytest.approx(y[0], rel=rel, abs=1e-5) and x[1] == y[1], (task, mine, other)
                else:  # a rolling log-likelihood
                    assert x == pytest.approx(y, rel=rel, abs=1e-5), (task, mine, other)
    counted = [key for key in figures(theirs) if "/tl_text/" not in key]  # accuracies and exact matches
    assert [figures(ours)[key] for key in counted] == [figures(theirs)[key] for key in counted]


def test_in_loop_figures_equal_eval_of_the_same_steps_checkpoint_and_training_is_untouched(
    run, tasks, single, tmp_path, reference
):
    run_dir, records = run
    # the scoring (lm-eval seeds every random generator it knows) changed no loss, norm or learning rate, bit for bit
    figures_of = [(r["step"], r["loss"], r["grad_norm"], r["lr"], r.get("val_loss")) for r in records]
    assert figures_of == [(r["step"], r["loss"], r["grad_norm"], r["lr"], r.get("val_loss")) for r in reference()]
    scored = {r["step"]: r for r in records if "downstream/tl_choice/acc" in r}
    assert sorted(scored) == [2, 4, 5]
    at_4 = eval_tasks(run_dir, tasks, tmp_path / "step4.json", "--checkpoint.load_step", "4")
    assert at_4["checkpoint"].endswith("step-4") and single["checkpoint"].endswith("step-5")
    for step, results in ((4, at_4), (5, single)):
        found = figures(results)
        assert len(found) == 5, found  # acc, acc_norm, word_perplexity, bits_per_byte, exact_match
        for key, value in found.items():
            assert scored[step][key] == pytest.approx(value, rel=1e-9), (step, key)


LAYOUTS = {  # each as the eval's first line names it: its arguments
    "dp_shard 2": [],
    "tp 2": ["--parallelism.tensor_parallel_degree", "2"],
    "cp 2": ["--parallelism.context_parallel_degree", "2"],
    "pp 2": PP2,
}


COMBINED = {  # on 4 ranks: each as the eval's first line names it
    "pp 2 x dp_shard 2": LAYOUTS["pp 2"],
    "dp_shard 2 x cp 2": LAYOUTS["cp 2"],
    "dp_shard 2 x tp 2": LAYOUTS["tp 2"],
}


@pytest.mark.parametrize(
    "layout",
    [*LAYOUTS, *(pytest.param(name, marks=pytest.mark.slow) for name in COMBINED)],  # slow: 4 ranks each
)
def test_every_layout_answers_as_one_process(layout, run, tasks, single, tmp_path):
    out = tmp_path / "r.json"
    argv = ["--output", str(out), "--bootstrap-iters", "0", "--log-samples", *folder_args(run[0]), *downstream(tasks)]
    ranks = 4 if layout in COMBINED else 2
    ran = pool(ranks, KIND).run(eval_job, [*argv, *{**LAYOUTS, **COMBINED}[layout]], timeout=300)
    assert ran.values == [0] * ranks, ran.stdout[-3000:] + ran.stderr[-4000:]
    assert f"titanlite eval: gpt2 debug on {layout}; tasks {TASKS.replace(',', ', ')};" in ran.stdout, ran.stdout
    results = json.loads(out.read_text())
    assert_same_answers(results, single)


@pytest.fixture(scope="module")
def folder(run, tmp_path_factory) -> Path:
    """The step-5 checkpoint exported to a Hugging Face folder, every weight then moved by N(0, 1): a model whose
    greedy generations are not one repeated byte, which both scorers then read."""
    import torch
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("hf") / "model"
    export = cli_in_pool(["convert", "to-hf", "--output", str(path), *folder_args(run[0])], kind=KIND)
    assert export.returncode == 0, export.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder_scored(folder, tasks, tmp_path_factory) -> dict:
    """`titanlite eval --tasks` of the folder on one process, from a run folder with no checkpoint of its own."""
    output = tmp_path_factory.mktemp("folder") / "r.json"
    argv = ["eval", *TINY, "--job.dump_folder", str(output.parent), "--job.name", "fresh"]
    argv += ["--checkpoint.initial_load_path", str(folder), "--tasks", TASKS, "--include-path", str(tasks)]
    proc = cli_in_pool([*argv, "--bootstrap-iters", "0", "--log-samples", "--output", str(output)], kind=KIND)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return json.loads(output.read_text())


def test_lm_evals_own_hf_model_on_the_exported_folder_answers_as_titanlite(folder, folder_scored, tasks):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    theirs = simple_evaluate(
        model="hf",
        model_args={"pretrained": str(folder), "max_length": 32, "dtype": "float32", "device": "cpu"},
        batch_size=8,
        tasks=TASKS.split(","),
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        bootstrap_iters=0,
        log_samples=True,
    )
    assert_same_answers(folder_scored, theirs)
    texts = [resps[0][0] for resps in answers(folder_scored)["tl_sum"]]
    assert len(set(texts)) > 1 and all(t.strip() for t in texts), texts  # generations worth comparing


def test_generations_are_what_titanlite_generate_prints(folder, folder_scored, cli, tmp_path):
    texts = [resps[0][0] for resps in answers(folder_scored)["tl_sum"]]
    for (question, _), text in zip(SUMS, texts):
        out = tmp_path / "g.json"
        argv = [*TINY, "--job.dump_folder", str(tmp_path), "--job.name", "fresh"]
        proc = cli("generate", *argv, "--checkpoint.initial_load_path", str(folder), "--prompt", f"{question}=",
                   "--max-new-tokens", "6", "--output", str(out))  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(out.read_text())["text"].split("\n")[0] == text, question


def test_expert_parallel_answers_as_one_process(tasks, tmp_path):
    moe = ["--config", "train_configs/qwen3_moe_debug.toml", *TINY, "--training.steps", "2"]
    proc = train_in_pool(1, [*moe, "--checkpoint.enable", "--checkpoint.interval", "2"], tmp_path, kind=KIND)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    one = eval_tasks(tmp_path, tasks, tmp_path / "one.json", "--log-samples")
    out = tmp_path / "ep2.json"
    argv = ["--output", str(out), "--bootstrap-iters", "0", "--log-samples", *folder_args(tmp_path), *downstream(tasks)]
    ran = pool(2, KIND).run(eval_job, [*argv, "--parallelism.expert_parallel_degree", "2"], timeout=300)
    assert ran.values == [0, 0], ran.stdout[-3000:] + ran.stderr[-4000:]
    assert "titanlite eval: qwen3_moe debug on dp_shard 2 x ep 2 (of shard x cp);" in ran.stdout, ran.stdout[-2000:]
    assert_same_answers(json.loads(out.read_text()), one)


@pytest.mark.parametrize("ngpu", ["1", pytest.param("2", marks=pytest.mark.slow)])  # 2: torchrun workers, 20 s
def test_eval_without_tasks_is_the_validation_loss_whatever_the_config_file_scores(ngpu, run, tasks, tmp_path):
    """A config file's [downstream] tasks are its run's, scored in its loop: `titanlite eval` without --tasks reads the
    same file and gives the validation loss, in this process and in workers that parse the command line again."""
    config = tmp_path / "run.toml"
    config.write_text(f'[downstream]\ntasks = ["tl_choice"]\ninclude_path = "{tasks}"\ninterval = 2\n')
    argv = ["eval", "--ngpu", ngpu, "--config", str(config), *folder_args(run[0]), *VALIDATED]
    if ngpu == "1":
        proc = cli_in_pool(argv, kind=KIND)
    else:  # the workers print to the launch's own stdout
        cmd = [sys.executable, "-m", "titanlite.commands.cli", *argv]
        proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = [r for r in run[1] if "val_loss" in r][-1]
    assert f"val_loss {last['val_loss']:.4f}" in proc.stdout and "tl_choice" not in proc.stdout, proc.stdout[-2000:]


def test_in_loop_scoring_on_fsdp_gives_one_process_figures(run, tasks, tmp_path):
    """[downstream] on 2 ranks: every rank scores (lm-eval answers each), rank 0 logs one process's figures."""
    args = [*VALIDATED, *downstream(tasks), "--downstream.interval", "2", "--training.local_batch_size", "4"]
    proc = train_in_pool(2, args, tmp_path, kind=KIND)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ours = {r["step"]: r for r in metrics(tmp_path) if "downstream/tl_choice/acc" in r}
    theirs = {r["step"]: r for r in run[1] if "downstream/tl_choice/acc" in r}
    assert sorted(ours) == sorted(theirs) == [2, 4, 5]
    for step, record in ours.items():
        for key, value in record.items():
            if key.startswith("downstream/"):
                assert value == pytest.approx(theirs[step][key], rel=1e-5), (step, key)

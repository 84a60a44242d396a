"""Validation changes nothing about training, and `titanlite eval` reproduces a run's last evaluation on any layout.

The validation losses of every layout equal the single-process ones in each parity test (assert_matches
compares them: tests.helpers.VALIDATED evaluates at steps 2, 4 and 5).
"""

import json
import subprocess
import sys

import pytest

from tests.helpers import PP2, REPO, TINY, VALIDATED, VALIDATION_WINDOWS, cli_in_pool, env, metrics, train_in_pool

pytestmark = pytest.mark.distributed

NO_VALIDATION = [*VALIDATED, "--validation.enable", "false"]  # same data (validation.dataset_path still set)


def training_figures(records: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in records]


def test_training_is_bitwise_the_same_with_and_without_validation(tmp_path, reference):
    proc = train_in_pool(1, [*NO_VALIDATION, "--training.local_batch_size", "8"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = metrics(tmp_path)
    assert not any("val_loss" in r for r in records)
    assert [r["step"] for r in reference() if "val_loss" in r] == [2, 4, 5]
    assert training_figures(records) == training_figures(reference())


def test_pipeline_evaluation_leaves_training_bitwise_the_same(tmp_path):
    # The schedule switches between its eval path (forward only) and training at every evaluation.
    runs = {}
    for name, args in (("with", VALIDATED), ("without", NO_VALIDATION)):
        proc = train_in_pool(2, [*args, *PP2, "--training.local_batch_size", "8"], tmp_path / name)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        runs[name] = metrics(tmp_path / name)
    assert training_figures(runs["with"]) == training_figures(runs["without"])
    assert [r["step"] for r in runs["with"] if "val_loss" in r] == [2, 4, 5]


def titanlite_eval(args: list[str], run_dir) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "titanlite.commands.cli",
        "eval",
        "--job.dump_folder",
        str(run_dir),
        "--job.name",
        "run",
        *args,
    ]
    return subprocess.run(
        cmd, cwd=REPO, env=env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), capture_output=True, text=True, timeout=300
    )


def run_folder(run_dir) -> list[str]:
    return ["--job.dump_folder", str(run_dir), "--job.name", "run"]


def eval_in_pool(args: list[str], run_dir) -> subprocess.CompletedProcess:
    return cli_in_pool(["eval", *run_folder(run_dir), *args])


@pytest.mark.slow  # about 23 s; CI runs it
def test_eval_of_the_final_checkpoint_prints_the_runs_last_validation_loss(tmp_path):
    checkpointed = [
        *VALIDATED,
        "--training.local_batch_size",
        "8",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "5",
    ]
    proc = train_in_pool(1, checkpointed, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    last = [r for r in metrics(tmp_path) if "val_loss" in r][-1]
    assert last["step"] == 5

    # On one process, `titanlite eval` runs on the pool's one rank (tests/helpers.py cli_in_pool): the figures are
    # what this test reads; test_eval_without_a_checkpoint_is_one_line runs the command as a process of its own.
    same = eval_in_pool([*checkpointed, "--output", str(tmp_path / "eval.json")], tmp_path)
    assert same.returncode == 0, same.stdout[-2000:] + same.stderr[-4000:]
    assert f"val_loss {last['val_loss']:.4f}  val_perplexity {last['val_perplexity']:.2f}" in same.stdout
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["val_loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert result["val_tokens"] == last["val_tokens"] == VALIDATION_WINDOWS * 32
    assert result["checkpoint"].endswith("step-5")

    # The same checkpoint on two pipeline stages (the schedule's eval path), in two torchrun workers.
    pipelined = titanlite_eval([*checkpointed, *PP2, "--ngpu", "2", "--output", str(tmp_path / "pp.json")], tmp_path)
    assert pipelined.returncode == 0, pipelined.stdout[-2000:] + pipelined.stderr[-4000:]
    assert "on pp 2" in pipelined.stdout
    assert json.loads((tmp_path / "pp.json").read_text())["val_loss"] == pytest.approx(last["val_loss"], rel=1e-5)

    # Exported to a Hugging Face folder and evaluated from there, by a run folder with no checkpoint.
    export = cli_in_pool(["convert", "to-hf", "--output", str(tmp_path / "hf"), "--job.dump_folder", str(tmp_path),
                          "--job.name", "run"])  # fmt: skip
    assert export.returncode == 0, export.stderr[-3000:]
    from_hf = eval_in_pool(
        [*VALIDATED, "--job.name", "fresh", "--checkpoint.initial_load_path", str(tmp_path / "hf")], tmp_path
    )
    assert from_hf.returncode == 0, from_hf.stdout[-2000:] + from_hf.stderr[-4000:]
    assert f"val_loss {last['val_loss']:.4f}" in from_hf.stdout


@pytest.mark.slow  # about 10 s; CI runs it
def test_eval_covers_the_runs_validation_windows_without_its_flags(tmp_path):
    """The run evaluated 2 batches of 2 windows (validation.steps, validation.local_batch_size): `titanlite eval` of
    its checkpoint, told nothing, takes them from the checkpoint's record and prints the run's last figures; a
    setting given on its command line is the user's (every window here)."""
    validated = [*VALIDATED, "--validation.steps", "2", "--validation.local_batch_size", "2"]
    trained = train_in_pool(1, [*validated, "--checkpoint.enable", "true", "--checkpoint.interval", "5"], tmp_path)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-4000:]
    last = [r for r in metrics(tmp_path) if "val_loss" in r][-1]
    assert last["val_tokens"] == 2 * 2 * 32
    told_nothing = eval_in_pool(["--output", str(tmp_path / "eval.json")], tmp_path)
    assert told_nothing.returncode == 0, told_nothing.stdout[-2000:] + told_nothing.stderr[-4000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["val_tokens"] == last["val_tokens"] and result["val_loss"] == pytest.approx(last["val_loss"], 1e-6)
    every = eval_in_pool(["--validation.steps", "-1", "--output", str(tmp_path / "all.json")], tmp_path)
    assert every.returncode == 0, every.stdout[-2000:] + every.stderr[-4000:]
    assert json.loads((tmp_path / "all.json").read_text())["val_tokens"] == VALIDATION_WINDOWS * 32
    # Exported, the folder keeps them: eval of the export, from a run folder of no checkpoint, covers the same.
    export = cli_in_pool(["convert", "to-hf", "--output", str(tmp_path / "hf"), *run_folder(tmp_path)])
    assert export.returncode == 0, export.stderr[-3000:]
    exported = ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--output", str(tmp_path / "hf.json")]
    from_hf = cli_in_pool(["eval", "--job.dump_folder", str(tmp_path), "--job.name", "fresh", *exported])
    assert from_hf.returncode == 0, from_hf.stdout[-2000:] + from_hf.stderr[-4000:]
    assert json.loads((tmp_path / "hf.json").read_text())["val_tokens"] == last["val_tokens"]


def test_eval_without_a_checkpoint_is_one_line(tmp_path):
    proc = titanlite_eval(VALIDATED, tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("titanlite: error: no checkpoint to evaluate in "), lines


def test_each_validation_set_is_logged_and_is_its_own_validation_loss(tmp_path):
    """A mixture of two sources with their own validation files: each set's loss is logged as val_loss/<name>, the
    total is their token-weighted mean, and each equals the loss `titanlite eval` gives that set alone."""
    import numpy as np

    rng = np.random.default_rng(0)
    for name, size in (("web", 40 * 32 + 1), ("code", 24 * 32 + 1)):  # 40 and 24 windows of 32 targets
        folder = tmp_path / "data" / name
        folder.mkdir(parents=True)
        rng.integers(0, 256, 4000, dtype=np.uint16).tofile(folder / "train.bin")
        # each set its own kind of text: web's ids below 128, code's above, so the two losses differ
        low = 0 if name == "web" else 128
        rng.integers(low, low + 128, size, dtype=np.uint16).tofile(folder / "val.bin")
    mixture = f"{tmp_path}/data/web:0.5,{tmp_path}/data/code:0.5"
    args = [*TINY, "--training.dataset_mixture", mixture, "--validation.enable", "--validation.freq", "5"]
    args += ["--checkpoint.enable", "--checkpoint.interval", "5"]
    proc = train_in_pool(1, args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "2 sets, each logged as val_loss/<name> (web, code)" in proc.stdout, proc.stdout[-3000:]
    last = metrics(tmp_path)[-1]
    web, code = last["val_loss/web"], last["val_loss/code"]
    assert web != code and f"[val_loss/web {web:.4f}  val_loss/code {code:.4f}]" in proc.stdout
    assert last["val_tokens"] == (40 + 24) * 32
    assert last["val_loss"] == pytest.approx((web * 40 + code * 24) / 64, rel=1e-9)
    for name, expected in (("web", web), ("code", code)):
        alone = eval_in_pool(
            [
                *args,
                "--validation.dataset_path",
                f"{tmp_path}/data/{name}/val.bin",
                "--output",
                str(tmp_path / "e.json"),
            ],
            tmp_path,
        )
        assert alone.returncode == 0, alone.stdout[-2000:] + alone.stderr[-3000:]
        assert json.loads((tmp_path / "e.json").read_text())["val_loss"] == pytest.approx(expected, rel=1e-6), name

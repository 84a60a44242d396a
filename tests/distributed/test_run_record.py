"""A run folder records what it trained, and every command that reads it uses that: `eval`, `convert to-hf` and
`generate` of a run trained with `--moe.balance bias` (routing biases that choose the experts) give the same
val_loss, export and ids without the flag as with it, a flag that contradicts the record is refused in one line,
and a checkpoint whose tensors the model being loaded has no place for is refused rather than partly loaded."""

import json

import pytest

from tests.helpers import VALIDATED, last_wins, metrics, train_in_pool
from titanlite.commands.cli import main

pytestmark = pytest.mark.distributed

# The qwen3_moe debug model trained with flags its config file does not hold: the tokenizer, the sequence length
# (both in TINY) and the bias balancing.
TRAINED = [
    "--config",
    "train_configs/qwen3_moe_debug.toml",
    *VALIDATED,
    "--training.local_batch_size",
    "4",
    "--moe.balance",
    "bias",
    "--moe.bias_update_rate",
    "0.01",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "5",
]
DATA = [
    "--validation.enable",
    "true",
    "--validation.dataset_path",
    VALIDATED[VALIDATED.index("--validation.dataset_path") + 1],
]


@pytest.fixture(scope="module")
def biased_run(tmp_path_factory):  # eval's worker runs in the test's process: capfd, as its faulthandler needs fds
    folder = tmp_path_factory.mktemp("biased")
    proc = train_in_pool(1, TRAINED, folder)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return folder


def run_folder(folder) -> list[str]:
    return ["--job.dump_folder", str(folder), "--job.name", "run"]


def test_eval_and_generate_take_the_trained_settings_from_the_checkpoint(biased_run, tmp_path, capfd):
    last = [r for r in metrics(biased_run) if "val_loss" in r][-1]
    results, ids = {}, {}
    for name, flags in (("recorded", []), ("repeated", TRAINED)):
        out = tmp_path / f"{name}.json"
        assert main(last_wins(["eval", *run_folder(biased_run), *DATA, *flags, "--output", str(out)])) == 0
        results[name] = json.loads(out.read_text())["val_loss"]
        out = tmp_path / f"{name}-ids.json"
        generate = ["generate", "--prompt", "def main(", "--max-new-tokens", "12", "--output", str(out)]
        assert main(last_wins([*generate, *run_folder(biased_run), *flags])) == 0
        ids[name] = json.loads(out.read_text())["new_ids"]
    # The same to float32 summation order (the evaluation batch follows training.local_batch_size, not recorded);
    # evaluated without the routing biases it was 1.6e-4 away.
    assert results["recorded"] == pytest.approx(results["repeated"], rel=1e-6)
    assert results["recorded"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert ids["recorded"] == ids["repeated"] and len(ids["recorded"]) == 12


@pytest.mark.parametrize(
    "flag, line",
    [
        (
            ["--moe.balance", "aux_loss"],
            "moe.balance='aux_loss' contradicts {step}, which was saved with moe.balance='bias'; leave it out "
            "(it is taken from there) or set it to 'bias'",
        ),
        (
            ["--training.seq_len", "64"],
            "training.seq_len=64 contradicts {step}, which was saved with training.seq_len=32",
        ),
    ],
    ids=["balance", "seq_len"],
)
def test_a_flag_that_contradicts_the_record_is_one_line(biased_run, tmp_path, capfd, flag, line):
    step = biased_run / "run" / "step-5"
    for command in (
        ["eval", *DATA],
        ["generate", "--prompt", "x"],
        ["convert", "to-hf", "--output", str(tmp_path / "hf")],
    ):
        capfd.readouterr()
        assert main(last_wins([*command, *run_folder(biased_run), *flag])) == 2, command
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("titanlite: error: " + line.format(step=step)), (command, err)
    assert not (tmp_path / "hf").exists()


def test_an_export_its_family_cannot_express_writes_nothing_with_or_without_the_flag(biased_run, tmp_path, capfd):
    """Hugging Face's qwen3_moe has no routing biases: exported without them the model would route otherwise,
    so the export is refused, as with the flag repeated, before a file is written (before, it dropped them)."""
    lines = []
    for name, flags in (("recorded", []), ("repeated", TRAINED)):
        capfd.readouterr()
        output = tmp_path / name / "hf"
        assert main(last_wins(["convert", "to-hf", "--output", str(output), *run_folder(biased_run), *flags])) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "cannot express moe.balance='bias'" in err[0], err
        lines.append(err[0])
        assert not (tmp_path / name).exists()  # not even the parent folder it would have made
    assert lines[0] == lines[1]


def test_a_checkpoint_with_tensors_the_model_has_no_place_for_is_refused(biased_run, tmp_path, capfd):
    """A run that starts from the biased run's weights but balances otherwise would load them without the routing
    biases (DCP reads only the tensors it is asked for): refused, naming one."""
    step = biased_run / "run" / "step-5"
    capfd.readouterr()
    args = ["eval", *DATA, "--config", "train_configs/qwen3_moe_debug.toml", *VALIDATED]
    args += ["--job.dump_folder", str(tmp_path), "--job.name", "other", "--checkpoint.initial_load_path", str(step)]
    args = last_wins(args)
    # The checkpoint's record is taken as ever (so the flag is refused) ...
    assert main(last_wins([*args, "--moe.balance", "aux_loss"])) == 2
    assert "contradicts" in capfd.readouterr().err
    # ... and a model built without the biases is refused at the load, not left without them.
    from titanlite.base.errors import ConfigError
    from titanlite.builder.model import plain_model
    from titanlite.builder.plan import plan_model
    from titanlite.components.checkpoint import load_model_only
    from titanlite.config import parse_config

    cfg = parse_config(["--config", "train_configs/qwen3_moe_debug.toml", "--model.tokenizer", "byte"])
    with pytest.raises(ConfigError, match=r"holds model tensors that this model has no place for \(layers\.\d+\."):
        load_model_only(step, plain_model(cfg, plan_model(cfg)))


def test_an_export_takes_the_balance_from_the_checkpoint(tmp_path):
    """DeepSeek-V3 trained with --moe.balance none (its flavor's is 'bias'): exported without the flag, the model is
    built as trained (before, it was built with routing biases the checkpoint does not hold, and the load failed),
    and the files equal those of an export with every training flag repeated."""
    trained = ["--config", "train_configs/deepseek_v3_debug.toml", "--model.tokenizer", "byte"]
    trained += ["--training.seq_len", "32", "--training.steps", "3", "--moe.balance", "none"]
    proc = train_in_pool(1, [*trained, "--checkpoint.enable", "--checkpoint.interval", "3"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    exports = {}
    for name, flags in (("recorded", []), ("repeated", trained[:-4] + trained[-2:])):
        out = tmp_path / name
        assert main(last_wins(["convert", "to-hf", "--output", str(out), *run_folder(tmp_path), *flags])) == 0
        exports[name] = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".safetensors", ".json")}
    assert exports["recorded"].keys() == exports["repeated"].keys() and "model.safetensors" in exports["recorded"]
    assert exports["recorded"] == exports["repeated"]

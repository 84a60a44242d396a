"""Experiment tracking: Weights & Biases logging (offline, read back from the run folder's wandb/ files) and
`titanlite compare` on metrics.jsonl files written here."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from titanlite.base.errors import ConfigError
from titanlite.builder.run import start_wandb
from titanlite.commands.cli import main
from titanlite.components import wandb_run
from titanlite.components.metrics import MetricsLogger
from titanlite.config import JobConfig


def record(step: int, loss: float, grad_norm: float = 1.0, tps: float | None = 1000.0, **more) -> dict:
    """A metrics record as the trainer logs it."""
    return {
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": 1e-3,
        "tps": tps,
        "tflops": None,
        "mfu_pct": None,
        "mem_peak_gib": 1.0,
        "mem_reserved_gib": None,
        "eta_s": None,
        "data_wait_pct": 0.1,
        **more,
    }


# ----------------------------------------------------------------------------------------------
# Weights & Biases


def wandb_records(path: Path):
    """The records of an offline run's transaction log (run-<id>.wandb), decoded with wandb's own protobuf:
    a ':W&B' header, then LevelDB-style log blocks of 32 KiB whose chunks (crc32c, length, type) make records."""
    from wandb.proto import wandb_internal_pb2  # the optional extra; its test needs it

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4) and pending:  # a full record, or a record's last chunk
            message = wandb_internal_pb2.Record()
            message.ParseFromString(pending)
            pending = b""
            yield message


def items(updates) -> dict:
    """Config or history items: {key: value}, the key being `key` or, in newer wandb, `nested_key`."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in updates}


def logged_run(path: Path) -> tuple[str, list[str], dict, list[tuple[int, float]]]:
    """(run id, tags, config, [(step, loss)]) of one offline W&B run."""
    run_id, tags, config, history = "", [], {}, []
    for message in wandb_records(path):
        kind = message.WhichOneof("record_type")
        if kind == "run":
            run_id, tags = message.run.run_id, list(message.run.tags)
            config |= items(message.run.config.update)
        elif kind == "config":
            config |= items(message.config.update)
        elif kind == "history":
            logged = items(message.history.item)
            history.append((logged["step"], logged["loss"]))
    return run_id, tags, config, history


def train_like(cfg: JobConfig, run_dir: Path, resumed: bool, records: list[dict]) -> None:
    """What rank 0 of a run does with its metrics: start the W&B run as build_trainer does, log, close."""
    metrics = MetricsLogger(run_dir, False, active=True, wandb=start_wandb(cfg, run_dir, resumed=resumed))
    for r in records:
        metrics.log(r)
    metrics.close()


def test_wandb_offline_run_holds_metrics_and_config_and_a_resume_continues_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = JobConfig()
    cfg.job.name, cfg.job.dump_folder, cfg.training.steps = "tracked", str(tmp_path), 77
    cfg.metrics.enable_wandb, cfg.metrics.wandb_tags = True, ["fsdp", "baseline"]
    run_dir = tmp_path / "tracked"
    run_dir.mkdir()

    train_like(cfg, run_dir, resumed=False, records=[record(1, 10.5), record(2, 10.25)])
    first_id = (run_dir / "wandb_run_id").read_text().strip()
    # The resumed attempt logs step 2 again (it resumed from a step-1 checkpoint): kept, not dropped.
    train_like(cfg, run_dir, resumed=True, records=[record(2, 10.125), record(3, 9.75)])
    assert (run_dir / "wandb_run_id").read_text().strip() == first_id

    logs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2, logs
    runs = [logged_run(path) for path in logs]
    assert [r[0] for r in runs] == [first_id, first_id]  # one W&B run, continued
    assert runs[0][1] == ["fsdp", "baseline"]
    assert runs[0][2]["training"]["steps"] == 77 and runs[0][2]["metrics"]["enable_wandb"] is True
    assert runs[0][3] == [(1, 10.5), (2, 10.25)]
    assert runs[1][3] == [(2, 10.125), (3, 9.75)]

    # A fresh run in the same folder (no checkpoint to resume) starts a new W&B run.
    train_like(cfg, run_dir, resumed=False, records=[record(1, 11.0)])
    assert (run_dir / "wandb_run_id").read_text().strip() != first_id


def test_wandb_missing_package_or_login_is_one_line_before_launch(monkeypatch, tmp_path):
    cfg = JobConfig()
    cfg.metrics.enable_wandb = True
    monkeypatch.setattr(wandb_run.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"the wandb package is not installed; install it with .*\[wandb\]"):
        wandb_run.check_wandb(cfg.metrics)
    monkeypatch.undo()
    broken = tmp_path / "site" / "wandb"  # installed, but its import fails (as a broken dependency's does)
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('no module named wandb_core')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # even for a run that needs no login
    with pytest.raises(ConfigError, match=r"the wandb package does not import \(.*\); install it with .*\[wandb\]"):
        wandb_run.check_wandb(cfg.metrics)
    monkeypatch.undo()

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no credentials anywhere
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="not logged in to Weights & Biases; run `wandb login`"):
        wandb_run.check_wandb(cfg.metrics)
    monkeypatch.setenv("WANDB_MODE", "offlin")
    with pytest.raises(ConfigError, match="WANDB_MODE='offlin' is not a W&B mode"):
        wandb_run.check_wandb(cfg.metrics)
    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb_run.check_wandb(cfg.metrics)  # offline needs no login


# ----------------------------------------------------------------------------------------------
# titanlite compare


def write_run(folder: Path, records: list[dict], tail: str = "") -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return folder


def test_compare_prints_each_metrics_largest_relative_difference_and_writes_a_png(tmp_path, capsys):
    steps = range(1, 6)
    a = write_run(tmp_path / "a", [record(s, 10.0 - s, grad_norm=2.0, val_loss=9.0) for s in steps])
    # b: loss off by 2e-6 relative at step 4 only, grad norm off by 1e-3 at step 2; validation at steps 2-5 only;
    # its last line cut short, as a crash while writing leaves it.
    b_records = [
        record(s, (10.0 - s) * (1 + 2e-6 * (s == 4)), grad_norm=2.0 * (1 + 1e-3 * (s == 2)), tps=900.0) for s in steps
    ]
    for r in b_records[1:]:
        r["val_loss"] = 9.0
    b = write_run(tmp_path / "b", b_records, tail='{"step": 6, "loss": 3.9')
    png = tmp_path / "cmp.png"

    assert main(["compare", str(a), str(b), "--output", str(png)]) == 0
    out = capsys.readouterr().out
    rows = {row[0]: row[1:] for row in (line.split() for line in out.splitlines() if line.startswith("  ")) if row}
    assert rows["loss"][:3] == ["5", "(1..5)", "2.000e-06"] and rows["loss"][3:5] == ["4", str(b)]
    assert rows["grad_norm"][:5] == ["5", "(1..5)", "1.000e-03", "2", str(b)]
    assert rows["val_loss"][:3] == ["4", "(2..5)", "0.000e+00"]
    assert "tps" not in rows and "mem_peak_gib" not in rows  # speed and memory are plotted, not compared
    assert f"{b}/metrics.jsonl: its last line (line 6) is cut short; compared without it" in out
    assert f"{b}: 5 logged steps, mean tokens/s per device 900" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["compare", str(a), str(b), "--output", str(png), "--max-diff", "1e-5"]) == 1
    assert "grad_norm differs by 1.000e-03 at step 2" in capsys.readouterr().err
    assert main(["compare", str(a), str(b), "--output", str(png), "--metrics", "loss", "--max-diff", "1e-5"]) == 0
    assert main(["compare", str(a), str(b), "--metrics", "los"]) == 2
    assert "compare --metrics: no run logged 'los'; they logged loss, grad_norm, lr, tps," in capsys.readouterr().err


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "no such run folder"),
        (lambda d: d.mkdir(), "has no metrics.jsonl; name a run folder"),
        (lambda d: write_run(d, [], tail='{"step": 1, "loss": 2.0}\nnot json\n{"step": 3}\n'), "line 2 is not a"),
        (lambda d: write_run(d, [], tail='{"step": 1, "lo'), "holds no logged step"),
    ],
)
def test_compare_bad_input_is_one_line(tmp_path, capsys, setup, message):
    good = write_run(tmp_path / "good", [record(1, 2.0)])
    bad = tmp_path / "bad"
    setup(bad)
    assert main(["compare", str(good), str(bad), "--output", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("titanlite: error: compare")


def test_compares_picture_labels_every_panel_with_its_legend_and_shows_validation_when_logged(tmp_path):
    from titanlite.commands.compare import figure, read_run

    scored = {"downstream/tl_choice/acc": 0.5, "val_loss/code": 8.5}  # a task's metric, a validation set's loss
    a = write_run(
        tmp_path / "a", [record(s, 10.0 - s, grad_norm=2.0, val_loss=9.0, tps=800.0, **scored) for s in (1, 2)]
    )
    b = write_run(tmp_path / "b", [record(s, 10.0 - s, grad_norm=2.0, tps=900.0) for s in (1, 2)])
    for runs, titles in (
        (
            [a, b],
            ["training loss", "validation loss", "gradient norm", "tokens/s per device", *sorted(scored)],
        ),
        ([b, b], ["training loss", "gradient norm", "tokens/s per device"]),  # no validation logged: no panel
    ):
        fig = figure([read_run(r) for r in runs])
        assert [ax.get_title() for ax in fig.axes] == titles
        for ax in fig.axes:
            assert ax.get_xlabel() == "step" and ax.get_ylabel()
            labels = [t.get_text() for t in ax.get_legend().get_texts()]
            assert labels == [str(r) for r in runs if read_run(r).series(ax.get_ylabel())], (ax.get_title(), labels)


def test_compare_metrics_choose_the_panels_and_identical_runs_both_show(tmp_path, capsys, monkeypatch):
    """--metrics chooses the table's rows and the picture's panels, in its order (a metric only a later run logged
    too: its panel holds that run's line); two identical runs draw two visible lines (their own line styles), and
    the step axis has whole-number ticks."""
    from titanlite.commands import compare

    records = [record(s, 10.0 - s, grad_norm=2.0 + s, tps=900.0) for s in range(1, 13)]
    a = write_run(tmp_path / "a", records)
    b = write_run(tmp_path / "b", [{**r, "val_loss": 9.0} if r["step"] % 4 == 0 else r for r in records])
    drawn = []
    real_figure = compare.figure
    monkeypatch.setattr(compare, "figure", lambda *args: drawn.append(real_figure(*args)) or drawn[-1])
    png = tmp_path / "cmp.png"

    assert main(["compare", str(a), str(b), "--output", str(png), "--metrics", "grad_norm,val_loss,loss"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()[4:-1]] == ["grad_norm", "val_loss", "loss"], out
    (fig,) = drawn
    assert [ax.get_ylabel() for ax in fig.axes] == ["grad_norm", "val_loss", "loss"]
    assert [ax.get_title() for ax in fig.axes] == ["gradient norm", "validation loss", "training loss"]
    for ax in fig.axes:
        ticks = list(ax.get_xticks())
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    styles = [[line.get_linestyle() for line in ax.get_lines()] for ax in fig.axes]
    assert styles[0] == styles[2] == ["-", "--"] and styles[1] == ["--"], styles  # only b logged val_loss
    assert all(line.get_marker() not in (None, "None", "") for ax in fig.axes for line in ax.get_lines())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    png.unlink()
    assert main(["compare", str(a), str(b), "--output", str(png), "--metrics", "loss,perplexity"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "titanlite: error: compare --metrics: no run logged 'perplexity'; they logged loss, grad_norm, lr, tps, "
        "mem_peak_gib, data_wait_pct, val_loss\n"
    )
    assert not png.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-diff", "nan"], "compare --max-diff takes a finite number, not 'nan'"),
        (["--max-diff", "-1"], "compare --max-diff must be at least 0, not -1"),
        (["--output", "{tmp}"], "is a folder; name a .png file in an existing folder"),
        (["--output", "{tmp}/picture"], "is not a .png file"),
        (["--output", "{tmp}/nowhere/c.png"], "is in a missing folder"),
    ],
)
def test_compare_refuses_a_nonsensical_option_before_reading_the_runs(tmp_path, capsys, args, message):
    good = write_run(tmp_path / "good", [record(1, 2.0)])
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    assert main(["compare", str(good), str(good), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "picture.png").exists()

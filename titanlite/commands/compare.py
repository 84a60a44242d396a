"""`titanlite compare RUN_DIR...`: how far runs' metrics.jsonl records lie apart, metric by metric, against the
first run (what to check after changing a layout), and a PNG of loss, grad norm and tokens/s (or of --metrics) against
the step, each run in its own line style so that identical runs both show."""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from titanlite.base.command_line import take_options
from titanlite.base.errors import ConfigError, check_path_length

logger = logging.getLogger(__name__)

USAGE = (
    "usage: titanlite compare RUN_DIR RUN_DIR [RUN_DIR ...] [--output FILE.png] [--metrics loss,val_loss,...] "
    "[--max-diff X]"
)

# Figures of speed and memory: they differ between layouts by design, so they are plotted (tps), not compared.
PERFORMANCE = {
    "tps",
    "tflops",
    "mfu_pct",
    "mem_peak_gib",
    "mem_reserved_gib",
    "eta_s",
    "data_wait_pct",
    "elapsed_s",
    "val_seconds",
    "downstream_seconds",
    "pp_bubble_analytic",
}
# The picture's panels without --metrics: (metric, title); val_loss's only when a run has one; then one per
# metric under DRAWN_FAMILIES a run logged (each validation set's loss, each downstream task's metric), by name. With
# --metrics, a panel per chosen metric, titled as here or by its name.
PLOTTED = (
    ("loss", "training loss"),
    ("val_loss", "validation loss"),
    ("grad_norm", "gradient norm"),
    ("tps", "tokens/s per device"),
)
# Each run's line: solid, dashed, dotted, dash-dot (then again), with its own marker on about MARKS of its points, so
# that a run drawn exactly over another (the same seed and layout) still shows.
DRAWN_FAMILIES = ("val_loss/", "downstream/")
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "x")
MARKS = 10
PANELS_PER_ROW = 4


@dataclass
class Run:
    label: str
    records: dict[int, dict]  # step -> its record (a step logged twice: the later record)

    def series(self, metric: str) -> dict[int, float]:
        """The metric's finite numbers by step (steps that did not log it, or logged null, are left out)."""
        return {
            step: float(r[metric])
            for step, r in self.records.items()
            if is_number(r.get(metric)) and math.isfinite(r[metric])
        }


@dataclass
class Difference:
    metric: str
    steps: list[int]  # the steps every run logged it at
    largest: float  # the largest relative difference from the first run
    at_step: int
    run: str  # the run it was found in


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_run(folder: Path) -> Run:
    """A run folder's metrics.jsonl. A last line cut short (a crash or a full disk while it was written) is left
    out with a note; any other line that is not a JSON record is an error naming it."""
    if not folder.exists():
        raise ConfigError(f"compare: {folder}: no such run folder")
    path = folder if folder.is_file() else folder / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"compare: {folder} has no metrics.jsonl; name a run folder (job.dump_folder/job.name)")
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"compare: cannot read {path}: {e}") from None
    records: dict[int, dict] = {}
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            step = record["step"]
        except (json.JSONDecodeError, TypeError, KeyError):
            if number == len(lines):
                logger.info(f"compare: {path}: its last line (line {number}) is cut short; compared without it")
                break
            raise ConfigError(f"compare: {path} line {number} is not a metrics record: {line[:60]!r}") from None
        records[step] = record
    if not records:
        raise ConfigError(f"compare: {path} holds no logged step")
    return Run(str(folder), records)


def logged_metrics(runs: list[Run]) -> list[str]:
    """The numeric fields any of the runs logged (step aside), in the order they first appear."""
    found = (k for run in runs for r in run.records.values() for k, v in r.items() if is_number(v) and k != "step")
    return list(dict.fromkeys(found))


def check_chosen(runs: list[Run], chosen: list[str]) -> None:
    """--metrics names only metrics some run logged: else one line naming the first it did not, and those logged."""
    logged = logged_metrics(runs)
    unknown = [m for m in chosen if m not in logged]
    if unknown:
        raise ConfigError(f"compare --metrics: no run logged '{unknown[0]}'; they logged {', '.join(logged)}")


def differences(runs: list[Run], chosen: list[str]) -> list[Difference]:
    """For each metric of the first run that is a figure of the training (not of speed or memory), or each of
    `chosen` (metrics some run logged: check_chosen): the steps every run logged it at, and the largest relative
    difference |x - x_first| / |x_first| among them."""
    reference, others = runs[0], runs[1:]
    check_chosen(runs, chosen)
    metrics = chosen or [m for m in logged_metrics([reference]) if m not in PERFORMANCE]
    found = []
    for metric in metrics:
        ref = reference.series(metric)
        series = [run.series(metric) for run in others]
        steps = sorted(set(ref).intersection(*series))
        largest, at_step, where = 0.0, steps[0] if steps else 0, others[0].label
        for run, values in zip(others, series):
            for step in steps:
                diff = relative_difference(values[step], ref[step])
                if diff > largest:
                    largest, at_step, where = diff, step, run.label
        found.append(Difference(metric, steps, largest, at_step, where))
    return found


def relative_difference(value: float, reference: float) -> float:
    if value == reference:
        return 0.0
    return abs(value - reference) / abs(reference) if reference != 0 else math.inf


def table(runs: list[Run], found: list[Difference]) -> list[str]:
    lines = [f"compare: {len(runs)} runs against {runs[0].label}"]
    for run in runs:
        tps = [v for step, v in sorted(run.series("tps").items())]
        mean = f"{sum(tps) / len(tps):,.0f}" if tps else "n/a"
        lines.append(f"  {run.label}: {len(run.records)} logged steps, mean tokens/s per device {mean}")
    lines.append(f"  {'metric':<16}{'steps in common':<22}{'largest rel. diff':>18}  at step  in run")
    for d in found:
        common = f"{len(d.steps)} ({d.steps[0]}..{d.steps[-1]})" if d.steps else "none"
        if not d.steps:
            lines.append(f"  {d.metric:<16}{common:<22}{'-':>18}")
            continue
        where = f"{d.at_step:>7}  {d.run}" if d.largest > 0 else f"{'-':>7}  -"
        lines.append(f"  {d.metric:<16}{common:<22}{d.largest:>18.3e}  {where}")
    return lines


def figure(runs: list[Run], chosen: list[str] | None = None):
    """The picture, returned as a matplotlib Figure: a panel per metric of `chosen` (--metrics), else per metric of
    PLOTTED that a run logged (training loss, validation loss, grad norm, tokens/s) and of DRAWN_FAMILIES (each
    validation set's loss, each downstream metric), at most PANELS_PER_ROW a row,
    against the step (whole-number ticks), each with its title, axis labels and legend; one line per run that
    logged the metric, each run in its own line style and marker (LINE_STYLES, MARKERS), so that identical runs
    both show."""
    try:
        import matplotlib  # optional dependency (the [bench] extra), needed only for the picture

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after choosing the Agg backend (no display)
        from matplotlib.ticker import MaxNLocator  # matplotlib's, with it
    except ImportError:
        raise ConfigError("compare: the PNG needs matplotlib; pip install -e '.[bench]'") from None
    titles = dict(PLOTTED)
    if chosen:
        panels = [(metric, titles.get(metric, metric)) for metric in chosen]
    else:
        panels = [(metric, title) for metric, title in PLOTTED if any(run.series(metric) for run in runs)]
        logged = {key for run in runs for record in run.records.values() for key in record}
        panels += [(m, m) for m in sorted(logged) if m.startswith(DRAWN_FAMILIES) and any(r.series(m) for r in runs)]
    columns = min(len(panels), PANELS_PER_ROW)
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:  # the last row's unused places
        ax.remove()
    for ax, (metric, title) in zip(axes.flat, panels):
        for i, run in enumerate(runs):
            points = sorted(run.series(metric).items())
            if points:
                ax.plot(
                    [s for s, _ in points],
                    [v for _, v in points],
                    label=run.label,
                    linestyle=LINE_STYLES[i % len(LINE_STYLES)],
                    linewidth=2.0 if i == 0 else 1.4,
                    marker=MARKERS[i % len(MARKERS)],
                    markevery=(i % max(1, len(points) // MARKS), max(1, len(points) // MARKS)),
                    markersize=4,
                    fillstyle="none",
                )
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(runs: list[Run], output: Path, chosen: list[str] | None = None) -> None:
    """The picture (figure()), written to `output`."""
    import matplotlib.pyplot as plt  # figure() imported it (or said how to install it)

    fig = figure(runs, chosen)
    try:
        fig.savefig(output, dpi=80)
    except OSError as e:
        raise ConfigError(f"compare --output {output}: cannot write it: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def compare(argv: list[str]) -> int:
    """`titanlite compare RUN_DIR...`: the differences table (of --metrics, else every training metric), then the
    PNG (of --metrics, else of PLOTTED); with --max-diff X, exit status 1 when a compared metric's largest relative
    difference exceeds X."""
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    defaults = {"output": "compare.png", "metrics": "", "max-diff": -1.0}  # max-diff -1: no gate
    opts, folders = take_options(argv, defaults, "compare", at_least={"max-diff": 0.0})
    unknown = [f for f in folders if f.startswith("--")]
    if unknown:
        raise ConfigError(f"compare: unknown option {unknown[0]}; {USAGE}")
    if len(folders) < 2:
        raise ConfigError(f"compare needs at least two run folders; {USAGE}")
    output = Path(opts["output"])
    why = (
        "a folder"
        if output.is_dir()
        else "not a .png file"
        if output.suffix.lower() != ".png"
        else "in a missing folder"
        if not output.parent.is_dir()
        else ""
    )
    if why:  # before any run is read, and never a file the picture was not written to
        raise ConfigError(f"compare --output {output} is {why}; name a .png file in an existing folder")
    for folder in folders:
        check_path_length(folder, "compare RUN_DIR")
    runs = [read_run(Path(f)) for f in folders]
    chosen = list(dict.fromkeys(m.strip() for m in opts["metrics"].split(",") if m.strip()))
    found = differences(runs, chosen)
    for line in table(runs, found):
        print(line)
    plot(runs, output, chosen)
    print(f"compare: wrote {output}")
    limit = opts["max-diff"]
    worst = max((d for d in found if d.steps), key=lambda d: d.largest, default=None)
    if limit >= 0 and worst is not None and worst.largest > limit:
        print(
            f"titanlite: error: compare: {worst.metric} differs by {worst.largest:.3e} at step {worst.at_step} "
            f"in {worst.run}, more than --max-diff {limit:g}",
            file=sys.stderr,
        )
        return 1
    return 0

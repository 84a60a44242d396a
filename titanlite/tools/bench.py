"""`titanlite bench throughput`: how fast titanlite trains a config on one device, and what its training
loop costs over a bare PyTorch loop.

Both loops run in the same process on the same model: built the same way (float8, activation
checkpointing and torch.compile as configured), with the same initial weights, batch, dtype, optimizer
implementation and gradient clipping. The bare loop is the minimum a training script needs (batch,
forward, loss, backward, clip, step, zero_grad, loss.item()); titanlite's is `Trainer.train`, with its
data loader, loss reduction, finite check, LR schedule, metrics and logging. The difference is what
titanlite adds.

After `--warmup` steps of each, the two loops take turns for `--repeats` rounds of `--steps` steps (the
order alternates each round, so drift in the machine's speed hits both alike). A round's step time is
its wall time over its steps, with the device synchronised at both ends; each loop's figure is the
median over rounds. One more round of each, untimed, counts the host's reads of tensor values made
outside torch (titanlite/tools/host_reads.py) and, on CUDA, every host-device synchronisation torch
reports: per step, beside the times. (`Trainer.train` reads its loss at the last step of each call,
so once per round here; a run reads it on logging and checkpoint steps only.)
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from titanlite.base.command_line import check_output_file, take_options, write_output
from titanlite.base.errors import ConfigError
from titanlite.builder.data import build_data
from titanlite.builder.model import parallelize_planned, plain_model
from titanlite.builder.plan import plan_run
from titanlite.builder.run import build_trainer
from titanlite.builder.runtime import start_rank
from titanlite.components.metrics import peak_memory_gib, reset_peak_memory
from titanlite.components.optim import implementation
from titanlite.config import parse_config
from titanlite.engine.trainer import autocast_for, synchronize
from titanlite.parallel.parallelize import DTYPES, materialize
from titanlite.tools.host_reads import count_cuda_syncs, count_host_reads, outside_torch

USAGE = """usage: titanlite bench throughput [--config FILE] [--steps N] [--warmup W] [--repeats R] [--no-bare]
                                  [--output FILE.json] [--section.key VALUE ...]
  --steps N      steps per timed round (default 5)
  --warmup W     untimed steps of each loop first (default 3; the first compiles, if compile is on)
  --repeats R    timed rounds of each loop; the figure is their median (default 7)
  --no-bare      time titanlite alone (the bare loop needs a second copy of the model and optimizer)
  --output FILE  also write the figures as JSON"""


@dataclass
class Figures:
    """One loop's measurements: seconds per step in each round, and the peak memory over its rounds."""

    name: str
    round_seconds: list[float] = field(default_factory=list)
    peak_memory_gib: float | None = None
    host_reads_per_step: float | None = None
    cuda_syncs_per_step: float | None = None

    @property
    def step_seconds(self) -> float:
        return statistics.median(self.round_seconds)


def parse_options(argv: list[str]) -> tuple[dict, list[str]]:
    defaults = {"steps": 5, "warmup": 3, "repeats": 7, "no-bare": False, "output": ""}
    opts, rest = take_options(argv, defaults, "bench throughput")
    if opts["steps"] < 1 or opts["repeats"] < 1 or opts["warmup"] < 0:
        raise ConfigError("bench throughput needs --steps >= 1, --repeats >= 1 and --warmup >= 0")
    check_output_file(opts["output"], "bench throughput --output")
    return opts, rest


class BareLoop:
    """The minimal PyTorch training loop over the same model, data and settings."""

    def __init__(self, cfg, plan, windows, device: torch.device, loss_compiled: bool):
        with torch.device("meta"):
            model = plain_model(cfg, plan.model)
        parallelize_planned(model, cfg, plan, None, device, chunked_loss=False)  # logits and F.cross_entropy
        materialize(model, device, cfg.training.seed)
        self.model, self.device, self.windows = model, device, windows
        self.batch, self.max_norm = cfg.training.local_batch_size, cfg.training.max_norm
        param_dtype = DTYPES[cfg.training.mixed_precision_param] if device.type == "cuda" else torch.float32
        self.autocast = autocast_for(device, model, param_dtype)
        o = cfg.optimizer
        impl = implementation(o, device.type, cfg.training.skips_steps())
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=impl == "fused",
            foreach=impl == "foreach",
        )
        self.foreach = impl != "for-loop"  # the clipping kernels titanlite uses (torch's default is per tensor on CPU)
        self.loss_fn = torch.compile(bare_loss, backend=cfg.compile.backend) if loss_compiled else bare_loss
        self.generator = torch.Generator().manual_seed(cfg.training.seed)

    def train(self, steps: int) -> None:
        self.model.train()
        for _ in range(steps):
            index = torch.randint(len(self.windows), (self.batch,), generator=self.generator)
            tokens = torch.stack([self.windows[int(i)] for i in index])
            if self.device.type == "cuda":
                tokens = tokens.pin_memory().to(self.device, non_blocking=True)
            with self.autocast():
                loss = self.loss_fn(self.model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=self.foreach)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            loss.item()


def bare_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def throughput(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise ConfigError("bench throughput measures one device in one process; run it without torchrun/NGPU")
    opts, rest = parse_options(argv)
    cfg = parse_config(rest)
    total = 2 * (
        opts["warmup"] + opts["steps"] * opts["repeats"]
    )  # more than either loop runs: the LR schedule spans it
    cfg.training.steps = total
    cfg.checkpoint.enable = False
    cfg.metrics.enable_tensorboard = False
    cfg.metrics.enable_wandb = False
    cfg.metrics.throughput_warmup_steps = 0
    # As a training run starts (on the CPU that includes its allocator setting: both loops benefit alike).
    plan = plan_run(cfg, 1)
    device = start_rank(cfg, plan, 1)

    with tempfile.TemporaryDirectory(prefix="titanlite-bench-") as folder:
        cfg.job.dump_folder = folder  # the run's metrics.jsonl and config.toml go away afterwards
        trainer = build_trainer(cfg, plan, device, rank=0, world_size=1)
        corpus = build_data(cfg, plan.model.tokenizer)
        loops = {"titanlite": lambda n: trainer.train(trainer.step + n)}
        if not opts["no-bare"]:
            loss_compiled = cfg.compile.enable and "loss" in cfg.compile.components and not plan.loss.parallel
            bare = BareLoop(cfg, plan, corpus.windows, device, loss_compiled)
            loops["bare PyTorch"] = bare.train
        figures = {name: Figures(name) for name in loops}
        print(f"bench: {opts['warmup']} warm-up steps, then {opts['repeats']} rounds of {opts['steps']} steps per loop")
        for loop in loops.values():
            loop(opts["warmup"])
        for r in range(opts["repeats"]):
            order = list(loops) if r % 2 == 0 else list(reversed(loops))
            for name in order:
                reset_peak_memory(device)
                synchronize(device)
                start = time.perf_counter()
                loops[name](opts["steps"])
                synchronize(device)
                figures[name].round_seconds.append((time.perf_counter() - start) / opts["steps"])
                if device.type == "cuda":
                    peak = peak_memory_gib(device)[0]
                    figures[name].peak_memory_gib = max(figures[name].peak_memory_gib or 0.0, peak)
        for name, loop in loops.items():
            with count_host_reads(outside_torch) as reads, count_cuda_syncs(device) as syncs:
                loop(opts["steps"])
                synchronize(device)
            figures[name].host_reads_per_step = len(reads) / opts["steps"]
            figures[name].cuda_syncs_per_step = syncs[0] / opts["steps"] if device.type == "cuda" else None
        trainer.logger.close()

    report = summarize(figures, trainer.figures, device)
    print(format_report(report, cfg, device))
    if opts["output"]:
        write_output(opts["output"], json.dumps(report, indent=2))
    return 0


def summarize(figures: dict[str, Figures], step, device: torch.device) -> dict:
    """Per loop: step time (median and range over rounds), tokens/s per device, TFLOPs, MFU, peak memory;
    and titanlite's step time over the bare loop's. `step` is the trainer's StepFigures (tokens per step,
    FLOPs per token by the formula in titanlite/components/metrics.py, the device's peak)."""
    loops = {}
    for name, fig in figures.items():
        tps = step.tokens_per_step / fig.step_seconds
        tflops = tps * step.flops_per_token / 1e12
        loops[name] = {
            "step_seconds_median": fig.step_seconds,
            "step_seconds_min": min(fig.round_seconds),
            "step_seconds_max": max(fig.round_seconds),
            "round_step_seconds": fig.round_seconds,
            "tokens_per_s_per_device": tps,
            "tflops_per_device": tflops,
            "mfu_pct": None if step.peak_tflops is None else 100.0 * tflops / step.peak_tflops,
            "peak_memory_gib": fig.peak_memory_gib,
            "host_reads_per_step": fig.host_reads_per_step,
            "cuda_syncs_per_step": fig.cuda_syncs_per_step,
        }
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "tokens_per_step": step.tokens_per_step,
        "flops_per_token": step.flops_per_token,
        "peak_tflops": step.peak_tflops,
        "loops": loops,
    }
    if device.type != "cuda":
        report["process_peak_rss_gib"] = peak_memory_gib(device)[0]
    if "bare PyTorch" in loops:
        report["titanlite_over_bare"] = (
            loops["titanlite"]["step_seconds_median"] / loops["bare PyTorch"]["step_seconds_median"]
        )
    return report


def format_report(report: dict, cfg, device: torch.device) -> str:
    def num(value, fmt):
        return "n/a" if value is None else format(value, fmt)

    lines = [
        f"bench throughput: {cfg.model.name} {cfg.model.flavor}, batch {cfg.training.local_batch_size} x "
        f"{cfg.training.seq_len} tokens, {report['device']}, torch {report['torch']}, "
        f"compile {'on' if cfg.compile.enable else 'off'}, AC {cfg.activation_checkpoint.mode}, "
        f"float8 {'on' if cfg.float8.enable else 'off'}",
        f"{'loop':<14} {'step ms (median, min-max)':>27} {'tokens/s':>11} {'TFLOPs':>8} {'MFU':>7} {'peak mem':>9} "
        f"{'reads/step':>10} {'syncs/step':>10}",
    ]
    for name, r in report["loops"].items():
        low, high = 1e3 * r["step_seconds_min"], 1e3 * r["step_seconds_max"]
        spread = f"{1e3 * r['step_seconds_median']:.1f} ({low:.1f}-{high:.1f})"
        mem = "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}GiB"
        lines.append(
            f"{name:<14} {spread:>27} {r['tokens_per_s_per_device']:>11,.0f} {r['tflops_per_device']:>8.3f} "
            f"{num(r['mfu_pct'], '.1f') + ('%' if r['mfu_pct'] is not None else ''):>7} {mem:>9} "
            f"{num(r['host_reads_per_step'], '.2f'):>10} {num(r['cuda_syncs_per_step'], '.2f'):>10}"
        )
    if "titanlite_over_bare" in report:
        ratio = report["titanlite_over_bare"]
        lines.append(f"titanlite step time / bare loop step time: {ratio:.3f} ({100 * (ratio - 1):+.1f}%)")
    lines.append(
        "reads/step: tensor values read by the host outside torch; syncs/step: host-device "
        "synchronisations CUDA reports (n/a off CUDA)"
    )
    if device.type != "cuda":
        lines.append(
            f"peak memory: n/a per loop on CPU; the process's peak RSS was {report['process_peak_rss_gib']:.2f} GiB"
        )
    if report["peak_tflops"] is None:
        lines.append("MFU: no known peak for this device; set metrics.peak_tflops to report it")
    return "\n".join(lines)

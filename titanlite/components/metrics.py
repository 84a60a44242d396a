"""Training figures: FLOPs per token, MFU against the device's real peak, memory, and the log writers.

One console line per log step; the same figures go to metrics.jsonl and, when enabled, TensorBoard and Weights & Biases.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from titanlite.components.wandb_run import WandbRun
from titanlite.models.common.interface import DecoderModule
from titanlite.models.registry import spec_of

logger = logging.getLogger(__name__)

# Dense bf16 tensor-core peak of one device, in TFLOP/s (vendor data sheets, without sparsity).
# Matched against torch.cuda.get_device_name(); the first matching entry wins, so specific names come first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM
    ("H200", 989.4),
    ("H800", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.05),
    ("L40", 181.05),
    ("L4", 121.0),
)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def flops_per_token(model: DecoderModule, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of `model` at `seq_len`, by its family's formula (its spec's
    `flops`; the dense families share titanlite/models/common/flops.py)."""
    spec = spec_of(model.args)
    return spec.load(spec.flops)(model, seq_len)


def device_peak_tflops(device: torch.device, override: float) -> float | None:
    """The configured peak, else the table's entry for this CUDA device; None when unknown (no MFU is shown)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> tuple[float, float | None]:
    """(peak, reserved) in GiB: CUDA max allocated and max reserved; on CPU the process's peak RSS and None."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30, None


@dataclass
class Throughput:
    """Tokens and time since the last log, counting only steps after the warm-up."""

    warmup_steps: int  # counted from the start of this process, so a resumed run warms up too
    tokens: int = 0
    seconds: float = 0.0
    steps_seen: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=20))  # the last counted step times, for the ETA
    data_wait: float = 0.0  # seconds spent waiting for batches since the last log
    window: float = 0.0  # seconds of steps since the last log

    def add_data_wait(self, seconds: float) -> None:
        self.data_wait += seconds

    def take_data_wait_pct(self) -> float | None:
        """Share of step time spent waiting for the data loader since the last call (every step counts)."""
        pct = 100.0 * self.data_wait / self.window if self.window > 0 else None
        self.data_wait, self.window = 0.0, 0.0
        return pct

    def add(self, tokens: int, seconds: float) -> None:
        self.window += seconds
        self.steps_seen += 1
        if self.steps_seen > self.warmup_steps:
            self.recent.append(seconds)
            self.tokens += tokens
            self.seconds += seconds

    def take(self) -> float | None:
        """Tokens/s over the counted steps since the last call (None if all were warm-up), then reset."""
        tps = self.tokens / self.seconds if self.seconds > 0 else None
        self.tokens, self.seconds = 0, 0.0
        return tps

    def eta_seconds(self, remaining_steps: int) -> float | None:
        """The remaining steps at the mean time of the last counted steps: warm-up steps (allocation,
        compilation) would make it far too long. None while only warm-up steps have run."""
        if remaining_steps <= 0:
            return 0.0
        return sum(self.recent) / len(self.recent) * remaining_steps if self.recent else None


def read_records(path: Path) -> tuple[list[dict], list[int]]:
    """metrics.jsonl's whole records, and the numbers (from 1) of its lines that are not one: what a crash or a
    full disk during a write leaves (a torn last line), which a reader skips rather than fails on."""
    records, torn = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        elif line.strip():
            torn.append(number)
    return records, torn


class MetricsLogger:
    """Writes one record per log step to the console, metrics.jsonl and optionally TensorBoard and a W&B run
    (`wandb`, which rank 0's builder starts)."""

    def __init__(
        self,
        run_dir: Path,
        enable_tensorboard: bool,
        active: bool,
        elapsed_before: float = 0.0,
        wandb: WandbRun | None = None,
    ):
        self.active = active
        self.jsonl = None
        self.tb = None
        self.wandb = wandb
        # A resumed run goes on from the training time its checkpoint recorded, so elapsed_s never restarts.
        self.start = time.perf_counter() - elapsed_before
        if not active:
            return
        self.jsonl = (run_dir / "metrics.jsonl").open("a")
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # seconds to import: only when enabled

            self.tb = SummaryWriter(log_dir=str(run_dir / "tb"))

    def log(self, record: dict) -> None:
        if self.jsonl is None:  # not active
            return
        record = {**record, "elapsed_s": round(self.elapsed(), 3)}
        logger.info(format_line(record))
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(record)

    def elapsed(self) -> float:
        """Seconds of training so far: this start's, plus those of the attempts before a resume."""
        return time.perf_counter() - self.start

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def format_line(r: dict) -> str:
    def fmt(value, spec, unit=""):
        return "n/a" if value is None else f"{value:{spec}}{unit}"

    tps = "warm-up" if r["tps"] is None else f"{r['tps']:,.0f}"
    eta = "n/a" if r["eta_s"] is None else _duration(r["eta_s"])
    line = (
        f"step {r['step']:>6}  loss {r['loss']:.4f}  grad_norm {r['grad_norm']:.4f}  lr {r['lr']:.2e}  "
        f"tps {tps}  tflops {fmt(r['tflops'], '.2f')}  mfu {fmt(r['mfu_pct'], '.1f', '%')}  "
        f"mem {r['mem_peak_gib']:.2f}GiB  data {fmt(r.get('data_wait_pct'), '.1f', '%')}  eta {eta}"
    )
    if "val_loss" in r:
        line += f"  val_loss {r['val_loss']:.4f}  val_ppl {r['val_perplexity']:.2f} ({r['val_seconds']:.1f}s)"
        sets = [f"{key} {value:.4f}" for key, value in r.items() if key.startswith("val_loss/")]
        if sets:
            line += f" [{'  '.join(sets)}]"
    # a model's auxiliary loss terms (MoE load balancing), multi-token prediction's depths, the sparse attention's
    # indexer loss
    for key in (k for k in r if k.startswith(("aux_", "mtp_loss", "indexer_loss"))):
        line += f"  {key} {r[key]:.4g}"
    if "expert_load" in r:  # MoE: max / mean tokens per expert of the step, the worst block's
        line += f"  expert_load {r['expert_load']:.2f}"
    if r.get("skipped_total"):  # steps skipped so far (training.skip_nonfinite_steps, the spike guard)
        line += f"  skipped {r['skipped_total']}"
    if "pp_idle_pct" in r:
        analytic = fmt(r["pp_bubble_analytic"], ".2f")
        line += f"  bubble {analytic} idle/pp-rank {'/'.join(f'{v:.0f}%' for v in r['pp_idle_pct'])}"
    return line


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )

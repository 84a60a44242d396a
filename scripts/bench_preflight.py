"""How long `titanlite check`'s memory preflight takes for Llama 3 70B on one CPU process (an estimate from the
config: nothing of the model is allocated), and the whole `titanlite check` command around it, on this machine.

    python3 scripts/bench_preflight.py

Prints the first in-process preflight of 70B (after one of the debug model, which pays the imports), the median
of the next 5, and the wall time of one `titanlite check --world-size 1` of the same config, which refuses it
(exit 2): every `./run_train.sh` runs that check before its workers start. tests/unit/test_preflight.py checks
what both say; their speed is measured here, not asserted in a test (the 2-core test machine's speed varies by 3x
day to day).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from titanlite.base.errors import ConfigError
from titanlite.builder.plan import plan_model
from titanlite.commands.check import memory_preflight
from titanlite.config import parse_config

REPO = Path(__file__).resolve().parents[1]
LLAMA_70B = ["--model.name", "llama3", "--model.flavor", "70B"]


def preflight_seconds() -> float:
    cfg = parse_config(LLAMA_70B)
    model = plan_model(cfg)  # check's plan has it before the preflight runs
    start = time.perf_counter()
    with contextlib.suppress(ConfigError):  # 70B does not fit one process's RAM: the refusal is expected
        memory_preflight(cfg, 1, 1, model)
    return time.perf_counter() - start


def main() -> None:
    os.environ.setdefault("TITANLITE_DEVICE", "cpu")
    with contextlib.suppress(ConfigError):
        cfg = parse_config([])
        memory_preflight(cfg, 1, 1, plan_model(cfg))  # the debug model: imports and first-call costs
    first = preflight_seconds()
    print(f"preflight of llama3 70B, one process, its first call: {first:.3f} s")
    times = [preflight_seconds() for _ in range(5)]
    print(f"preflight of llama3 70B, one process: median {statistics.median(times):.3f} s of 5 "
          f"(min {min(times):.3f}, max {max(times):.3f})")  # fmt: skip
    cmd = [sys.executable, "-m", "titanlite.commands.cli", "check", "--world-size", "1", *LLAMA_70B]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - start
    print(f"titanlite check of it: {wall:.1f} s wall, exit {proc.returncode} (interpreter, imports, data check)")


if __name__ == "__main__":
    main()

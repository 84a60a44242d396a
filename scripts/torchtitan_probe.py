"""Whether TorchTitan (its wheel and needs carried to a GPU box, installed with --target) runs on this machine's
torch, before issue 50's side-by-side: imports the package, then each model module's config registry directly
(TorchTitan's ConfigManager hides the import error behind its own), then parses the configs the comparison
starts from. Prints one `probe:` line per step and the first error's traceback.

    python -m pip install -q --no-index --no-deps --target /tmp/ttsite .whl/titan/*.whl
    PYTHONPATH=/tmp/ttsite python scripts/torchtitan_probe.py
"""

import importlib
import traceback

import torch
import torchtitan

print("probe: torchtitan", torchtitan.__version__, "torch", torch.__version__, flush=True)
for module in ("llama3", "qwen3"):
    try:
        importlib.import_module(f"torchtitan.models.{module}.config_registry")
        print(f"probe: torchtitan.models.{module}.config_registry imports", flush=True)
    except Exception:
        print(f"probe: torchtitan.models.{module}.config_registry does not import:", flush=True)
        traceback.print_exc()
        raise SystemExit(1) from None

from torchtitan.config import ConfigManager  # noqa: E402

for module, config in (("llama3", "llama3_8b"), ("qwen3", "qwen3_moe_debug")):
    try:
        c = ConfigManager().parse_args(["--module", module, "--config", config])
        print(f"probe: {config}: {type(c).__name__}, seq {c.training.seq_len}, batch {c.training.local_batch_size}")
    except Exception:
        print(f"probe: {config} does not parse:", flush=True)
        traceback.print_exc()

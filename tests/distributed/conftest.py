"""Single-process reference runs, made once per session and shared by every parity test."""

import pytest

from tests.helpers import VALIDATED

CONFIGS = {
    "gpt2": "train_configs/debug_model.toml",
    "llama3": "train_configs/llama3_debug.toml",
    "qwen3": "train_configs/qwen3_debug.toml",
    "qwen3_moe": "train_configs/qwen3_moe_debug.toml",
    "qwen3_5": "train_configs/qwen3_5_debug.toml",
    "nemotron_h": "train_configs/nemotron_h_debug.toml",
    "falcon_h1": "train_configs/falcon_h1_debug.toml",
    "granitemoehybrid": "train_configs/granitemoehybrid_debug.toml",
}


@pytest.fixture(scope="session")
def reference(one_process):
    """reference(model) -> per-step records of one process running the global batch of 8 (once per pytest run)."""

    def run(model: str = "gpt2") -> list[dict]:
        return one_process(["--config", CONFIGS[model], *VALIDATED, "--training.local_batch_size", "8"])

    return run

"""Single-process reference runs, made once per session and shared by every parity test."""

import pytest

from tests.helpers import VALIDATED, metrics, torchrun

CONFIGS = {
    "gpt2": "train_configs/debug_model.toml",
    "llama3": "train_configs/llama3_debug.toml",
    "qwen3": "train_configs/qwen3_debug.toml",
}


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """reference(model) -> per-step records of one process running the global batch of 8."""
    cache = {}

    def run(model: str = "gpt2") -> list[dict]:
        if model not in cache:
            run_dir = tmp_path_factory.mktemp(f"single_{model}")
            proc = torchrun(1, ["--config", CONFIGS[model], *VALIDATED, "--training.local_batch_size", "8"], run_dir)
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[model] = metrics(run_dir)
        return cache[model]

    return run

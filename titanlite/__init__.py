"""titanlite: a lean, TorchTitan-style pretraining codebase.

The package is built in layers, bottom to top; a module imports only from its own layer or below
(tests/unit/test_layers.py checks every import, function-level ones too, and that there is no cycle).
docs/architecture.md explains each layer.
"""

__version__ = "0.1.0"

# (layer, subpackage, what it holds), bottom to top.
LAYERS = (
    (
        0,
        "base",
        "errors and exit statuses, devices, command-line options, logging set-up, model arguments, a Hugging Face "
        "config.json both ways; no torch needed but in devices and failures",
    ),
    (1, "config", "the run configuration: sections, loading and validation, reference text"),
    (2, "models", "GPT-2 and Llama as plain modules, the model interface, weight init, flavors"),
    (2, "data", "tokenizers, sources, the prepared token store, sample order, the loader"),
    (3, "parallel", "one apply_* per parallelism, parallelize() in its order, the mesh, pipeline schedules"),
    (
        3,
        "components",
        "loss, optimizer, metrics, profiling, resilience, checkpoints, Hugging Face weights and tokenizer files",
    ),
    (4, "engine", "the Trainer (the loop for every layout) and the Validator"),
    (5, "builder", "from a config to a run: the layout plan, data, model, Trainer; the memory planner's estimator"),
    (
        6,
        "commands",
        "entry points: the torchrun workers (train, eval), generate, check, convert, the launcher, the CLI",
    ),
    (6, "tools", "plan, bench, analyze, prepare"),
)

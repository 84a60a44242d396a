"""Layer 1, the run configuration: a TOML file plus `--section.key` overrides, one dataclass per section.

The public names are re-exported here, so that every layer above imports them from `titanlite.config`.
"""

from titanlite.config.loading import grad_accum_steps, load_toml, parse_config, refuse_repeated_keys, validate_values
from titanlite.config.reference import help_text, reference_markdown, to_toml
from titanlite.config.sections import (
    DEFAULT_CONFIG,
    HF_DEFAULT_CONFIG,
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Data,
    Downstream,
    Float8,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    MoE,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
    field_docs,
)

__all__ = [
    "refuse_repeated_keys",
    "DEFAULT_CONFIG",
    "HF_DEFAULT_CONFIG",
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Compile",
    "Data",
    "Float8",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "MoE",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Training",
    "Downstream",
    "Validation",
    "field_docs",
    "grad_accum_steps",
    "help_text",
    "load_toml",
    "parse_config",
    "reference_markdown",
    "to_toml",
    "validate_values",
]

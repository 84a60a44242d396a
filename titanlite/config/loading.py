"""Loading a run configuration: defaults < TOML file < `--section.key` overrides, then validation of the values.

Unknown keys and wrong types are rejected with one line naming the key.
"""

from __future__ import annotations

import difflib
import math
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from titanlite.base.errors import ConfigError, resolved_against, special_file
from titanlite.config.sections import (
    DEFAULT_CONFIG,
    HF_DEFAULT_CONFIG,
    JobConfig,
    Training,
    field_types,
    section_classes,
    type_name,
)
from titanlite.models.hf_config import resolve_model_folder
from titanlite.models.registry import families_of_flavor, import_custom, spec_named

# Names other trainers give some keys (Hugging Face's Trainer, torchtitan's older ones): the name titanlite uses.
KEY_ALIASES = {"learning_rate": "lr", "max_steps": "steps", "warmup": "warmup_steps", "batch_size": "local_batch_size"}


def _suggest_key(key: str) -> str | None:
    """The config key meant by an unknown `key`, by its name first: a key of the same name (or the name other
    trainers give it) in another section (`training.lr` is `optimizer.lr`; among several, the section spelt most
    like the given one), else the key whose name is spelt most like it in any section (the given section first
    among equals). None when no name comes close."""
    section, _, name = key.rpartition(".")
    name = KEY_ALIASES.get(name, name)
    keys = [(s, k) for s, cls in section_classes().items() for k in field_types(cls)]

    def similar(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a, b).ratio()

    same_name = [(s, k) for s, k in keys if k == name and f"{s}.{k}" != key]
    if same_name:
        s, k = max(same_name, key=lambda sk: similar(section, sk[0]))
        return f"{s}.{k}"
    score, _, best = max((similar(name, k), s == section, f"{s}.{k}") for s, k in keys)
    return best if score >= 0.75 else None


def _unknown_key_error(key: str, where: str) -> ConfigError:
    close = _suggest_key(key)
    hint = f"; did you mean '{close}'?" if close else "; see --help for the valid keys"
    return ConfigError(f"unknown config key '{key}' ({where}){hint}")


def _coerce(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    """Check a TOML value's type, or convert a command-line string, for one field."""
    if typing.get_origin(tp) is list:
        if from_cli:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} is not a valid {type_name(tp)}")
        return [_coerce(key, v, typing.get_args(tp)[0], from_cli) for v in value]
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            allowed = ", ".join(repr(c) for c in choices)
            close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6) if isinstance(value, str) else []
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{key}={value!r} is not allowed; use one of: {allowed}{hint}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
    elif tp is int:
        number = value if isinstance(value, int) and not isinstance(value, bool) else None
        if number is None and from_cli:
            try:
                number = int(value)
            except ValueError:
                pass
        if number is not None:
            if not -(2**63) <= number < 2**63:  # torch, numpy and the checkpoints hold it as a 64-bit integer
                raise ConfigError(f"{key}={number} does not fit in a 64-bit integer; use a smaller number")
            return number
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli:
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key}={value!r} is not a valid {type_name(tp)}")


def _set(cfg: JobConfig, key: str, value: Any, where: str, from_cli: bool = False) -> None:
    section, _, name = key.partition(".")
    classes = section_classes()
    if section not in classes or name not in field_types(classes[section]):
        raise _unknown_key_error(key, where)
    tp = field_types(classes[section])[name]
    setattr(getattr(cfg, section), name, _coerce(key, value, tp, from_cli))


# ----------------------------------------------------------------------------------------------
# Loading


# The checkout titanlite runs from (the folder holding titanlite/ and train_configs/).
CHECKOUT = Path(__file__).resolve().parents[2]


def load_toml(path: str | Path, label: str | None = None) -> dict[str, Any]:
    """A TOML file's tables; `label` names it in errors (default: '--config PATH', with the folder a relative
    PATH was resolved against, and the checkout's file of that name when there is one)."""
    path = Path(path)
    label = label or f"--config {path}{resolved_against(path)}"
    if path.is_dir():
        raise ConfigError(
            f"{label} is a folder, not a TOML file; name a .toml file in it (the configs are in "
            f"{CHECKOUT / 'train_configs'})"
        )
    if kind := special_file(path):
        raise ConfigError(f"{label} is {kind}, not a file; name a .toml file")
    if not path.is_file():
        in_checkout = CHECKOUT / path
        hint = (
            f"did you mean {in_checkout}?"
            if not path.is_absolute() and in_checkout.is_file()
            else f"the configs are in {CHECKOUT / 'train_configs'}"
        )
        raise ConfigError(f"{label}: no such file; {hint}")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{label}: not valid TOML ({e})") from None
    except UnicodeDecodeError as e:  # tomllib decodes the whole file first
        raise ConfigError(
            f"{label}: not a TOML file: byte {e.start} (0x{e.object[e.start]:02x}) is not UTF-8 text (a binary or "
            "otherwise encoded file?); name a UTF-8 .toml file"
        ) from None
    except OSError as e:
        raise ConfigError(f"{label}: cannot be read ({e.strerror or e}); make it readable") from None


def _split_overrides(argv: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Split `--config FILE` and `--section.key VALUE` / `--section.key=VALUE` / `--flag` arguments."""
    config_path, pairs, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --section.key VALUE")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or (nxt.startswith("--") and not _is_number(nxt)):
                value = "true"  # a bare flag, e.g. --training.deterministic
            else:
                value, i = nxt, i + 1
        if key == "config":
            config_path = value
        elif "." not in key:
            raise _unknown_key_error(key, "command line")
        else:
            pairs.append((key, value))
        i += 1
    return config_path, pairs


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


# The keys that choose the model: set on the command line, they replace the config file's model and its description.
MODEL_CHOICE = {"model.name", "model.flavor", "model.hf_assets_path"}


def parse_config(
    argv: list[str],
    default_config: str | None = DEFAULT_CONFIG,
    recorded: tuple[str, dict[str, Any]] | None = None,
    defaults: tuple[str, dict[str, Any]] | None = None,
) -> JobConfig:
    """Defaults < TOML file < command-line overrides; then validate the values on their own.

    Without --config, a command line that sets model.flavor = "hf" starts from HF_DEFAULT_CONFIG rather than
    the debug model's. `recorded` is (where, {"section.key": value}): what a checkpoint was saved under, taken
    in place of the defaults; a key the user set to something else is refused. `defaults` is the same kind, taken
    where the user set nothing, theirs where they did (a run's evaluation settings, for `titanlite eval`)."""
    config_path, overrides = _split_overrides(argv)
    chosen = config_path is not None
    if not chosen and default_config == DEFAULT_CONFIG and dict(overrides).get("model.flavor") == "hf":
        default_config = HF_DEFAULT_CONFIG
    if config_path is not None and Path(config_path).resolve() == (CHECKOUT / HF_DEFAULT_CONFIG).resolve():
        chosen = False  # the shipped defaults of Hugging Face runs, named or not: seq_len is a ceiling
    cfg = JobConfig()
    # The keys a user set (their --config file's and the command line's; the default config's are defaults):
    # with model.flavor = "hf" these must agree with the folder, the rest are taken from it.
    explicit = set()
    tables: dict[str, Any] = {}
    if config_path is not None:
        label = f"in {config_path}"
        tables = load_toml(config_path)
    elif default_config:  # titanlite's own file, read from the checkout whatever the working folder
        shipped = Path(default_config) in (Path(DEFAULT_CONFIG), Path(HF_DEFAULT_CONFIG))
        path = CHECKOUT / default_config if shipped else Path(default_config)
        label = f"in the default config {path}"
        tables = load_toml(path, f"the default config {path} (no --config given)")
    for section, table in tables.items():
        if not isinstance(table, dict):
            raise _unknown_key_error(section, label)
        for name, value in table.items():
            _set(cfg, f"{section}.{name}", value, label)
            if chosen:
                explicit.add(f"{section}.{name}")
    for key, value in overrides:
        _set(cfg, key, value, "command line", from_cli=True)
        explicit.add(key)
    cli_keys = {key for key, _ in overrides}
    if MODEL_CHOICE & cli_keys and "job.description" not in cli_keys:  # the file's description is of its model
        cfg.job.description = JobConfig().job.description
        explicit.discard("job.description")
    if recorded is not None:
        apply_recorded(cfg, explicit, *recorded)
    if defaults is not None:
        apply_defaults(cfg, explicit, *defaults)
    validate_values(cfg)
    import_custom(cfg.model.custom_import)
    if cfg.model.flavor == "hf":
        folder_args = resolve_model_folder(cfg.model, explicit)
        name_hf_run(cfg, explicit, folder_args.max_seq_len, config_path or default_config)
    else:
        resolve_flavor_family(cfg.model, explicit)
    return cfg


def apply_recorded(cfg: JobConfig, explicit: set[str], where: str, values: dict[str, Any]) -> None:
    """Take `values` (a checkpoint's record) where the user set nothing; a key they set otherwise is an error."""
    for key, value in values.items():
        section, _, name = key.partition(".")
        ours = getattr(getattr(cfg, section, None), name, None)
        if key in explicit and not _same(key, ours, value):
            raise ConfigError(
                f"{key}={ours!r} contradicts {where}, which was saved with {key}={value!r}; leave it out (it is "
                f"taken from there) or set it to {value!r}"
            )
        _set(cfg, key, value, f"recorded in {where}")
        explicit.add(key)  # as binding as the user's: nothing is derived in its place


def apply_defaults(cfg: JobConfig, explicit: set[str], where: str, values: dict[str, Any]) -> None:
    """Take `values` (a checkpoint's record) where the user set nothing; unlike apply_recorded's, a key they set
    otherwise is theirs (what is measured, not what the model is)."""
    for key, value in values.items():
        if key not in explicit:
            _set(cfg, key, value, f"recorded in {where}")
            explicit.add(key)


def _same(key: str, ours: Any, recorded: Any) -> bool:
    if key.endswith("_path") and ours and recorded:  # one folder, however it is spelled
        return Path(ours).expanduser().resolve() == Path(recorded).expanduser().resolve()
    return ours == recorded


def name_hf_run(cfg: JobConfig, explicit: set[str], positions: int, config_path: str | None) -> None:
    """A Hugging Face run's own name and description (`hf-<folder name>`, the family and the folder), and a
    sequence length within the folder's positions, where the user set none of them."""
    folder = Path(cfg.model.hf_assets_path)
    if "job.name" not in explicit:
        cfg.job.name = f"hf-{folder.expanduser().resolve().name}"
    if "job.description" not in explicit:
        cfg.job.description = f"{cfg.model.name} from {folder}" + (f" (config {config_path})" if config_path else "")
    if "training.seq_len" not in explicit:
        cfg.training.seq_len = min(cfg.training.seq_len, positions)


def resolve_flavor_family(model, explicit: set[str]) -> None:
    """A flavor that only one family has (most published sizes) takes that family when model.name was not set
    by the user (the default config's gpt2 is a default); one that contradicts an explicit model.name is refused."""
    if model.flavor in spec_named(model.name).flavors:
        return
    families = families_of_flavor(model.flavor)
    if len(families) != 1:
        return  # unknown, or several families have it: the registry says which flavors there are
    if "model.name" in explicit:
        raise ConfigError(
            f"model.flavor={model.flavor!r} is a {families[0]} flavor, not a {model.name} one; set "
            f"model.name = '{families[0]}' or leave it out"
        )
    model.name = families[0]


# The [moe] keys that are numbers: -1 keeps the model flavor's value.
MOE_COEFFICIENTS = ("aux_loss_coef", "z_loss_coef", "bias_update_rate")


def validate_values(cfg: JobConfig) -> None:
    """Checks that need no knowledge of the world size (the layout is checked by ParallelDims): every number of
    every section finite, then each section's own checks (SECTION_CHECKS)."""
    for section, cls in section_classes().items():
        check_finite(section, getattr(cfg, section), cls)
    for section, check in SECTION_CHECKS.items():
        check(getattr(cfg, section))


def check_finite(name: str, section, cls: type) -> None:
    for key, tp in field_types(cls).items():
        value = getattr(section, key)
        if tp is float and not math.isfinite(value):
            raise ConfigError(f"{name}.{key}={value} is not a finite number")


def check_at_least_one(values: dict[str, Any]) -> None:
    for key, value in values.items():
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")


def check_not_negative(values: dict[str, Any]) -> None:
    for key, value in values.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must not be negative")


def check_spike_guard(t: Training) -> None:
    """The spike guard's threshold is a multiple of the median norm: at or below 1 it would skip ordinary steps."""
    if t.spike_factor != 0 and t.spike_factor <= 1:
        raise ConfigError(
            f"training.spike_factor={t.spike_factor} would skip ordinary steps (the threshold is that multiple of the "
            "median gradient norm): set it above 1 (e.g. 5), or 0 to turn the spike guard off"
        )
    check_at_least_one(
        {"training.spike_window": t.spike_window, "training.max_skipped_steps_in_row": t.max_skipped_steps_in_row}
    )


def check_job(job) -> None:
    check_job_name(job.name)


def check_training(t: Training) -> None:
    check_at_least_one(
        {"training.steps": t.steps, "training.local_batch_size": t.local_batch_size, "training.seq_len": t.seq_len}
    )
    if t.global_batch_size < 1 and t.global_batch_size != -1:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} must be at least 1, or -1 for local_batch_size x dp"
        )
    check_not_negative(
        {
            "training.max_norm": t.max_norm,
            "training.stop_after_step": t.stop_after_step,
            "training.mtp_loss_coefficient": t.mtp_loss_coefficient,
        }
    )
    if t.loss_chunk_tokens < -1:
        raise ConfigError(
            f"training.loss_chunk_tokens={t.loss_chunk_tokens} must be -1 (auto), 0 (whole logits) or a chunk size"
        )
    if t.stop_after_step > t.steps:
        raise ConfigError(f"training.stop_after_step={t.stop_after_step} is beyond training.steps={t.steps}")
    check_spike_guard(t)
    check_dataset_name(t.dataset, "training")
    if t.dataset == "local" and not t.dataset_path and not t.dataset_mixture:
        raise ConfigError("training.dataset='local' needs training.dataset_path (a file, folder or glob of a corpus)")
    if not t.dataset_text_field:
        raise ConfigError("training.dataset_text_field is empty; name the field that holds the text (e.g. 'text')")
    check_hub_keys(t, "training", hub=not t.dataset_mixture and t.dataset not in ("stdlib", "local"))


def check_metrics(metrics) -> None:
    check_at_least_one({"metrics.log_freq": metrics.log_freq})
    check_not_negative(
        {
            "metrics.throughput_warmup_steps": metrics.throughput_warmup_steps,
            "metrics.peak_tflops": metrics.peak_tflops,
        }
    )


# (part, the part it only makes sense with, why): a load of the one without the other is refused.
LOAD_DEPENDENCIES = (
    ("optimizer", "model", "the saved optimizer moments belong to the saved weights, not to fresh ones"),
    (
        "lr_scheduler",
        "train_state",
        "the saved schedule's position is the saved step, and the step count would start at 0",
    ),
)


def check_checkpoint(checkpoint) -> None:
    check_at_least_one({"checkpoint.interval": checkpoint.interval})
    if not checkpoint.export_max_shard_gb > 0:
        raise ConfigError(f"checkpoint.export_max_shard_gb={checkpoint.export_max_shard_gb} must be positive")
    check_not_negative({"checkpoint.keep_latest_k": checkpoint.keep_latest_k})
    if checkpoint.load_step < -1:
        raise ConfigError(f"checkpoint.load_step={checkpoint.load_step} must be -1 (newest) or a step number")
    parts = {"model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng"}
    unknown = sorted(set(checkpoint.exclude_from_loading) - parts)
    if unknown:
        raise ConfigError(f"checkpoint.exclude_from_loading names {unknown}; use some of: {', '.join(sorted(parts))}")
    left_out = set(checkpoint.exclude_from_loading)
    for part, needs, why in LOAD_DEPENDENCIES:
        if needs in left_out and part not in left_out:
            raise ConfigError(
                f"checkpoint.exclude_from_loading leaves out '{needs}' but loads '{part}': {why}; leave out "
                f"'{part}' too, or load '{needs}'"
            )


def check_parallelism(p) -> None:
    check_at_least_one(
        {
            "parallelism.data_parallel_replicate_degree": p.data_parallel_replicate_degree,
            "parallelism.tensor_parallel_degree": p.tensor_parallel_degree,
            "parallelism.pipeline_parallel_degree": p.pipeline_parallel_degree,
            "parallelism.pipeline_parallel_microbatch_size": p.pipeline_parallel_microbatch_size,
        }
    )
    if p.data_parallel_shard_degree < 1 and p.data_parallel_shard_degree != -1:
        raise ConfigError(
            f"parallelism.data_parallel_shard_degree={p.data_parallel_shard_degree} must be at least 1, or -1 for the "
            "rest of the world size"
        )
    check_not_negative({"parallelism.pipeline_parallel_layers_per_stage": p.pipeline_parallel_layers_per_stage})


def check_model(m) -> None:
    check_not_negative({"model.n_layers": m.n_layers})
    if m.mtp_layers < -1:
        raise ConfigError(
            f"model.mtp_layers={m.mtp_layers} must be -1 (the flavor's or folder's), 0 (none) or a number of depths"
        )
    if m.hf_assets_path and m.flavor != "hf" and m.tokenizer != "hf":
        raise ConfigError(
            f"model.hf_assets_path='{m.hf_assets_path}' changes nothing with model.flavor={m.flavor!r} and "
            f"model.tokenizer={m.tokenizer!r}: only flavor 'hf' (the folder's model) or tokenizer 'hf' (its "
            "tokenizer) read it; add --model.flavor hf to train the folder's model, or leave model.hf_assets_path out"
        )


def check_optimizer(optimizer) -> None:
    check_not_negative({"optimizer.weight_decay": optimizer.weight_decay})
    if not optimizer.lr > 0:
        raise ConfigError(f"optimizer.lr={optimizer.lr} must be positive")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(optimizer, key) < 1:
            raise ConfigError(f"optimizer.{key}={getattr(optimizer, key)} must be in [0, 1)")
    check_not_negative({"optimizer.muon_weight_decay": optimizer.muon_weight_decay})
    check_at_least_one({"optimizer.muon_ns_steps": optimizer.muon_ns_steps})
    if not optimizer.muon_lr > 0:
        raise ConfigError(f"optimizer.muon_lr={optimizer.muon_lr} must be positive")
    if not 0 <= optimizer.muon_momentum < 1:
        raise ConfigError(f"optimizer.muon_momentum={optimizer.muon_momentum} must be in [0, 1)")


def check_lr_scheduler(lr_scheduler) -> None:
    check_not_negative({"lr_scheduler.warmup_steps": lr_scheduler.warmup_steps})
    if not 0 <= lr_scheduler.min_lr_factor <= 1:
        raise ConfigError(f"lr_scheduler.min_lr_factor={lr_scheduler.min_lr_factor} must be between 0 and 1")


def check_data(data) -> None:
    check_not_negative(
        {
            "data.num_workers": data.num_workers,
            "data.prefetch": data.prefetch,
            "data.prepare_workers": data.prepare_workers,
        }
    )
    if not data.shard_size_mb > 0:
        raise ConfigError(f"data.shard_size_mb={data.shard_size_mb} must be positive")


def check_comm(comm) -> None:
    for key in ("init_timeout_seconds", "train_timeout_seconds"):
        if not getattr(comm, key) > 0:
            raise ConfigError(f"comm.{key}={getattr(comm, key)} must be positive")


def check_activation_checkpoint(ac) -> None:
    if ac.selective_ac_option < 1:
        raise ConfigError(f"activation_checkpoint.selective_ac_option={ac.selective_ac_option} must be at least 1")


def check_compile(compile_cfg) -> None:
    unknown = sorted(set(compile_cfg.components) - {"model", "loss"})
    if unknown:
        raise ConfigError(f"compile.components names {unknown}; use some of: loss, model")
    if compile_cfg.mode != "default" and compile_cfg.backend != "inductor":
        raise ConfigError(
            f"compile.mode='{compile_cfg.mode}' is an inductor mode, but compile.backend='{compile_cfg.backend}'; "
            "set compile.backend = 'inductor' or compile.mode = 'default'"
        )


def check_validation(v) -> None:
    if v.freq < 1:
        raise ConfigError(f"validation.freq={v.freq} must be at least 1 (steps between evaluations)")
    if v.steps < 1 and v.steps != -1:
        raise ConfigError(f"validation.steps={v.steps} must be at least 1, or -1 for the whole validation split")
    for key in ("local_batch_size", "seq_len"):
        if getattr(v, key) < 0:
            raise ConfigError(f"validation.{key}={getattr(v, key)} must not be negative (0 uses training.{key})")
    if not 0 <= v.split_fraction < 1:
        raise ConfigError(f"validation.split_fraction={v.split_fraction} must be in [0, 1)")
    check_dataset_name(v.dataset, "validation")
    if v.dataset == "local" and not v.dataset_path:
        raise ConfigError("validation.dataset='local' needs validation.dataset_path")
    if v.enable and not (v.dataset or v.dataset_path) and v.split_fraction == 0:
        raise ConfigError(
            "validation.enable needs held-out data: set validation.split_fraction > 0 or validation.dataset_path"
        )
    check_hub_keys(v, "validation", hub=bool(v.dataset) and v.dataset not in ("stdlib", "local"))


def check_moe(moe) -> None:
    for key in MOE_COEFFICIENTS:
        value = getattr(moe, key)
        if value < 0 and value != -1:
            raise ConfigError(f"moe.{key}={value} must be at least 0, or -1 to keep the model flavor's")


# Each section's own checks, by its name in JobConfig, in the order they run; a section that has none is absent.
SECTION_CHECKS: dict[str, Callable[[Any], None]] = {
    "job": check_job,
    "training": check_training,
    "metrics": check_metrics,
    "checkpoint": check_checkpoint,
    "parallelism": check_parallelism,
    "model": check_model,
    "optimizer": check_optimizer,
    "lr_scheduler": check_lr_scheduler,
    "data": check_data,
    "comm": check_comm,
    "activation_checkpoint": check_activation_checkpoint,
    "compile": check_compile,
    "validation": check_validation,
    "moe": check_moe,
}


def check_job_name(name: str) -> None:
    """The run folder is {dump_folder}/{name}: a name that is no folder of its own ('', '.', '..') would put the
    run's files in the dump folder itself or above it, beside other runs'."""
    if name.strip() in ("", ".", ".."):
        raise ConfigError(
            f"job.name={name!r} names no run folder of its own (the run would write into job.dump_folder itself or "
            "above it); give the run a name, e.g. --job.name my-run"
        )


def grad_accum_steps(training: Training, dp_degree: int) -> int:
    """Micro-batches per step on each rank, so that local_batch_size x dp x accumulation = global batch."""
    per_pass = training.local_batch_size * dp_degree
    if training.global_batch_size == -1:
        return 1
    if training.global_batch_size % per_pass:
        raise ConfigError(
            f"training.global_batch_size={training.global_batch_size} is not a multiple of "
            f"local_batch_size x dp = {training.local_batch_size} x {dp_degree} = {per_pass}; "
            f"use a multiple of {per_pass} or change training.local_batch_size"
        )
    return training.global_batch_size // per_pass


BUILT_IN_DATASETS = ("stdlib", "local")


def check_dataset_name(dataset: str, section: str) -> None:
    """A dataset name spelt like a built-in one ('stdlb', 'Local') is refused with the one meant, before it is
    looked up on the hub: hub datasets are named OWNER/NAME, and every name without an owner that is so close
    to 'stdlib' or 'local' is a typo in practice (the hub's few owner-less names have OWNER/NAME forms too)."""
    if not dataset or dataset in BUILT_IN_DATASETS or "/" in dataset:
        return
    close = difflib.get_close_matches(dataset.lower(), BUILT_IN_DATASETS, n=1, cutoff=0.75)
    if close:
        raise ConfigError(
            f"{section}.dataset={dataset!r} is not a dataset titanlite knows; did you mean '{close[0]}'? "
            f"(the built-in ones are 'stdlib' and 'local'; a hub dataset is named OWNER/NAME)"
        )


def check_hub_keys(section, name: str, hub: bool) -> None:
    """A split must be named; the keys that only a hub dataset reads are refused elsewhere, not ignored."""
    if not section.dataset_split:
        raise ConfigError(f"{name}.dataset_split is empty; name a split (e.g. 'train', 'validation')")
    if hub:
        return
    for key in ("dataset_subset", "dataset_data_files", "dataset_data_dir"):
        if getattr(section, key, None):
            mixture = name == "training" and section.dataset_mixture
            raise ConfigError(
                f"{name}.{key} applies only to a hub dataset ({name}.dataset = 'NAME'); unset it"
                + (" (a mixture's sources take no hub keys)" if mixture else "")
            )

"""Loading a run configuration: defaults < TOML file < `--section.key` overrides, then validation of the values.

Unknown keys and wrong types are rejected with one line naming the key.
"""

from __future__ import annotations

import codecs
import difflib
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from titanlite.base.errors import ConfigError, check_path_length, resolved_against, special_file
from titanlite.config.rules import MODEL_SWITCHES, check_bounds, check_features, check_model_counts, model_view
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
    PATH was resolved against, and the checkout's file of that name when there is one). A UTF-8 byte-order mark
    (what editors on Windows write first) is skipped."""
    check_path_length(path, label or "--config")
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
    bom = 0
    try:
        data = path.read_bytes()
        bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
        return tomllib.loads(data[bom:].decode("utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{label}: not valid TOML ({e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{label}: not a TOML file: byte {bom + e.start} (0x{e.object[e.start]:02x}) is not UTF-8 text (a binary "
            "or otherwise encoded file?); name a UTF-8 .toml file"
        ) from None
    except OSError as e:
        raise ConfigError(f"{label}: cannot be read ({e.strerror or e}); make it readable") from None


def refuse_repeated_keys(argv: list[str]) -> None:
    """A user's command line (`titanlite COMMAND ...`, a torchrun worker's) with `--config` or a `--section.key` given
    twice is refused, as a TOML file's repeated key is: which value was meant cannot be told. The command's own
    options (`--prompt`, `--output`) are take_options'. parse_config itself lets the last value win, for code that
    composes a run from a base and its changes (the tools' runs, tests)."""
    given: dict[str, str] = {}
    for i, arg in enumerate(argv):
        key, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if key != "config" and "." not in key:
            continue
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            value = "true" if nxt is None or (nxt.startswith("--") and not _is_number(nxt)) else nxt
        if key in given:
            raise ConfigError(
                f"{'--config' if key == 'config' else key} is given twice on the command line ('{given[key]}', then "
                f"'{value}'); give it once"
            )
        given[key] = value


def _split_overrides(argv: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Split `--config FILE` and `--section.key VALUE` / `--section.key=VALUE` / `--flag` arguments (a key given
    twice: the last value; a user's command line is refused one first, refuse_repeated_keys)."""
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
        if key != "config" and "." not in key:
            raise _unknown_key_error(key, "command line")
        if key == "config":
            config_path = value
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
MODEL_CHOICE = set(MODEL_SWITCHES)


def parse_config(
    argv: list[str],
    default_config: str | None = DEFAULT_CONFIG,
    recorded: tuple[str, dict[str, Any]] | None = None,
    defaults: tuple[str, dict[str, Any]] | None = None,
    training: bool = True,
) -> JobConfig:
    """Defaults < TOML file < command-line overrides; then validate the values on their own.

    Without --config, a command line that sets model.flavor = "hf" starts from HF_DEFAULT_CONFIG rather than
    the debug model's. `recorded` is (where, {"section.key": value}): what a checkpoint was saved under, taken
    in place of the defaults; a key the user set to something else is refused. `defaults` is the same kind, taken
    where the user set nothing, theirs where they did (a run's evaluation settings, for `titanlite eval`).
    `training`: refuse the settings of features that are off (rules.FEATURES); false for the commands that read a
    checkpoint rather than train (eval, convert, generate), which take a training run's flags as they are."""
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
    folder_args = None
    if cfg.model.flavor == "hf":
        folder_args = resolve_model_folder(cfg.model, explicit)
        name_hf_run(cfg, explicit, folder_args.max_seq_len, config_path or default_config)
    else:
        resolve_flavor_family(cfg.model, explicit)
    model = model_view(cfg.model, cfg.moe, folder_args)
    check_model_counts(cfg, model)
    if training:
        check_features(cfg, explicit, cli_keys, model)
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


def validate_values(cfg: JobConfig) -> None:
    """Checks that need no knowledge of the world size (the layout is checked by ParallelDims): every path a file
    system can hold, every number of every section finite and within its bounds (rules.BOUNDS), then each
    section's own checks (SECTION_CHECKS)."""
    check_path_keys(cfg)
    check_bounds(cfg)
    for section, check in SECTION_CHECKS.items():
        check(getattr(cfg, section))


def check_job(job) -> None:
    check_job_name(job.name)


def check_training(t: Training) -> None:
    if t.stop_after_step > t.steps:
        raise ConfigError(f"training.stop_after_step={t.stop_after_step} is beyond training.steps={t.steps}")
    check_dataset_name(t.dataset, "training")
    if t.dataset == "local" and not t.dataset_path and not t.dataset_mixture:
        raise ConfigError("training.dataset='local' needs training.dataset_path (a file, folder or glob of a corpus)")
    if not t.dataset_text_field:
        raise ConfigError("training.dataset_text_field is empty; name the field that holds the text (e.g. 'text')")
    check_hub_keys(t, "training", hub=not t.dataset_mixture and t.dataset not in ("stdlib", "local"))


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


def check_model(m) -> None:
    if m.hf_assets_path and m.flavor != "hf" and m.tokenizer != "hf":
        raise ConfigError(
            f"model.hf_assets_path='{m.hf_assets_path}' changes nothing with model.flavor={m.flavor!r} and "
            f"model.tokenizer={m.tokenizer!r}: only flavor 'hf' (the folder's model) or tokenizer 'hf' (its "
            "tokenizer) read it; add --model.flavor hf to train the folder's model, or leave model.hf_assets_path out"
        )


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
    check_dataset_name(v.dataset, "validation")
    if v.dataset == "local" and not v.dataset_path:
        raise ConfigError("validation.dataset='local' needs validation.dataset_path")
    if v.enable and not (v.dataset or v.dataset_path) and v.split_fraction == 0:
        raise ConfigError(
            "validation.enable needs held-out data: set validation.split_fraction > 0 or validation.dataset_path"
        )
    check_hub_keys(v, "validation", hub=bool(v.dataset) and v.dataset not in ("stdlib", "local"))


# Each section's own checks, by its name in JobConfig, in the order they run; a section that has none is absent.
SECTION_CHECKS: dict[str, Callable[[Any], None]] = {
    "job": check_job,
    "training": check_training,
    "checkpoint": check_checkpoint,
    "model": check_model,
    "compile": check_compile,
    "validation": check_validation,
}


def check_job_name(name: str) -> None:
    """The run folder is {dump_folder}/{name}, a folder inside the dump folder (sub-folders, as in sweep/lr-3e-3, are
    folders inside it too). A name that is no folder of its own ('', '.', '..') would put the run's files in the dump
    folder itself or above it, beside other runs'; an absolute one, or one that climbs out with '..', elsewhere."""
    if name.strip() in ("", ".", ".."):
        raise ConfigError(
            f"job.name={name!r} names no run folder of its own (the run would write into job.dump_folder itself or "
            "above it); give the run a name, e.g. --job.name my-run"
        )
    if os.path.isabs(name) or ".." in name.split(os.sep):
        how = "is an absolute path" if os.path.isabs(name) else "climbs out with '..'"
        raise ConfigError(
            f"job.name={name!r} {how}: the run folder job.dump_folder/job.name would not be inside job.dump_folder; "
            "give a relative name without '..' (e.g. --job.name my-run, or sweep/run-1 for a sub-folder), and "
            "job.dump_folder for where runs go"
        )


# The keys that name a path of this machine (a file, folder or glob). Each is checked for lengths a file system can
# hold before anything opens it: past them, every call fails with 'File name too long'.
PATH_KEYS = (
    "job.dump_folder",
    "job.name",
    "model.hf_assets_path",
    "training.dataset_path",
    "data.cache_dir",
    "validation.dataset_path",
    "checkpoint.initial_load_path",
    "parallelism.pipeline_parallel_schedule_csv",
    "profiling.save_traces_folder",
)


def check_path_keys(cfg: JobConfig) -> None:
    """Each path the config names (PATH_KEYS, the mixture's sources, the run folder they make) within the file
    system's lengths (check_path_length): one line naming the key, not a traceback where it is first opened."""
    for key in PATH_KEYS:
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        if value:
            check_path_length(value, key)
    for entry in cfg.training.dataset_mixture:  # SOURCE:WEIGHT
        check_path_length(entry.rpartition(":")[0] or entry, "training.dataset_mixture")
    run_dir = os.path.join(cfg.job.dump_folder, cfg.job.name)
    check_path_length(run_dir, "the run folder (job.dump_folder/job.name)")


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

"""What a resumed run may change against the checkpoint it resumes from.

Every checkpoint records the resolved config it was saved under, with a few facts that the config alone
does not pin down (the model's shape, the tokenizer, the corpus size). On resume the current config is the
source of truth: optimizer and schedule settings, clipping, the layout and the rest take effect from the
first resumed step, and one start-up line names what changed. Changes that would make the saved state wrong
are refused with one line naming the key and both values, unless the part of the state they would break is
left out of the load (checkpoint.exclude_from_loading, TorchTitan's key):

  the model (shape, family, tokenizer, moe.balance)
                                         'model' and 'optimizer' left out: the weights start afresh
  the data (sequence length, seed, sources, held-out split)
                                         'dataloader' left out: the data starts again at its first sample
  the optimizer's kind (AdamW or Muon, and which parameters Muon steps: AdamW's moments are not Muon's momenta)
                                         'optimizer' left out: the optimizer's state starts afresh
"""

from __future__ import annotations

from dataclasses import asdict

from titanlite.base.errors import ConfigError
from titanlite.config import JobConfig
from titanlite.models.common.moe.args import BALANCE_FIELDS

# Keys that decide which token windows sample i of the run is: the saved data position means nothing under
# other values.
# The training corpus: which files and records, hence which tokens (and which of them are held out).
CORPUS_KEYS = (
    "training.dataset",
    "training.dataset_path",
    "training.dataset_mixture",
    "training.dataset_text_field",
    "training.dataset_subset",
    "training.dataset_split",
    "training.dataset_data_files",
    "training.dataset_data_dir",
    "data.skip_unsupported_files",
)
DATA_KEYS = (
    "training.seq_len",
    "training.seed",
    *CORPUS_KEYS,
    "data.shuffle",
    "validation.split_fraction",
    "validation.dataset",
    "validation.dataset_path",
)
# Keys that decide the model; its shape (a fact) is compared too, for a Hugging Face folder whose files changed.
MODEL_KEYS = ("model.name", "model.flavor", "model.n_layers", "model.hf_assets_path", "model.tokenizer")
# Keys that decide which optimizer state each parameter has (Muon's momentum or AdamW's moments).
OPTIMIZER_KEYS = ("optimizer.name", "optimizer.muon_params")
# MoEArgs fields that a resume may change (the [moe] section's numbers): training terms, not the model.
MOE_COEFFICIENTS = tuple(f for f in BALANCE_FIELDS if f != "balance")
# Keys that say how this invocation loads, logs, profiles or names things: never reported as changes.
QUIET_SECTIONS = ("job", "checkpoint", "metrics", "profiling", "comm")


def flat_config(cfg: JobConfig) -> dict[str, object]:
    """{"section.key": value} of every config key."""
    return {f"{section}.{key}": value for section, fields in asdict(cfg).items() for key, value in fields.items()}


def resume_changes(
    saved: dict, saved_facts: dict, cfg: JobConfig, facts: dict, excluded: set[str], where: str
) -> list[str]:
    """The changes a resume from the checkpoint `where` takes on, as "key old -> new"; a ConfigError for a change
    that would make the loaded state wrong (see the module's docstring). `saved` is the checkpoint's flat config
    and `saved_facts` its facts; `facts` are this run's ("model": its arguments, "tokenizer": its fingerprint,
    "windows": the training corpus's window count)."""
    now = flat_config(cfg)
    differ = {key: (saved[key], now[key]) for key in now if key in saved and saved[key] != now[key]}
    fresh_model = {"model", "optimizer"} <= excluded
    fresh_data = "dataloader" in excluded
    if not fresh_model:
        _refuse_model_change(differ, saved_facts, facts, where)
    if not fresh_data:
        _refuse_data_change(differ, saved_facts, facts, where)
    if "optimizer" not in excluded:
        _refuse_optimizer_change(differ, where)
    quiet = tuple(f"{section}." for section in QUIET_SECTIONS)
    return [f"{key} {old!r} -> {new!r}" for key, (old, new) in differ.items() if not key.startswith(quiet)]


def _refuse_model_change(differ: dict, saved_facts: dict, facts: dict, where: str) -> None:
    advice = (
        "to train another model, give it its own run folder (set job.name); to resume this run, use the "
        "checkpoint's model (checkpoint.exclude_from_loading = ['model', 'optimizer'] would overwrite its weights)"
    )
    changed = _first_changed(differ, MODEL_KEYS, where)
    if changed:
        raise ConfigError(f"{changed}; {advice}")
    if saved_facts.get("tokenizer") not in (None, facts.get("tokenizer")):
        raise ConfigError(f"the tokenizer's vocabulary differs from the one {where} was saved with; {advice}")
    old_model, new_model = _without_coefficients(saved_facts.get("model")), _without_coefficients(facts.get("model"))
    old_balance, new_balance = (_balance(m) for m in (old_model, new_model))
    if old_balance != new_balance and None not in (old_balance, new_balance):
        raise ConfigError(
            f"moe.balance is {new_balance!r}, not the {old_balance!r} that {where} was saved with: the routing "
            f"(and the checkpoint's routing biases, kept with 'bias' only) would change under the trained weights; "
            f"set moe.balance = {old_balance!r}, or give another balance its own run folder (set job.name)"
        )
    if old_model is not None and new_model is not None and old_model != new_model:
        field = next(k for k in new_model if old_model.get(k) != new_model[k])
        raise ConfigError(
            f"the model's {field} is {new_model[field]!r}, not the {old_model.get(field)!r} that "
            f"{where} was saved with; {advice}"
        )


def _refuse_optimizer_change(differ: dict, where: str) -> None:
    changed = _first_changed(differ, OPTIMIZER_KEYS, where)
    if changed:
        raise ConfigError(
            f"{changed}: its optimizer state (AdamW's two moments or Muon's momentum, per parameter) does not fit "
            "this run's; resume with the checkpoint's value, or keep its weights and start the optimizer's state "
            "afresh with checkpoint.exclude_from_loading = ['optimizer']"
        )


def _without_coefficients(model: dict | None) -> dict | None:
    """A model's facts without the weights of its MoE balancing terms and its bias update rate: a resume may change
    them (they are listed among the changes), like the optimizer's settings."""
    if model is None or not isinstance(model.get("moe"), dict):
        return model
    moe = {key: value for key, value in model["moe"].items() if key not in MOE_COEFFICIENTS}
    return {**model, "moe": moe}


def _balance(model: dict | None) -> str | None:
    moe = None if model is None else model.get("moe")
    return moe.get("balance") if isinstance(moe, dict) else None


def _refuse_data_change(differ: dict, saved_facts: dict, facts: dict, where: str) -> None:
    advice = (
        "keep it, or add 'dataloader' to checkpoint.exclude_from_loading to start the data afresh "
        "(from its first sample)"
    )
    changed = _first_changed(differ, DATA_KEYS, where)
    if changed:
        raise ConfigError(f"{changed}: its saved data position would point at other windows; {advice}")
    old, new = saved_facts.get("windows"), facts.get("windows")
    if old is not None and new is not None and old != new:
        raise ConfigError(
            f"the training corpus has {new:,} windows, not the {old:,} of {where}: its sources "
            f"changed, so its saved data position would point at other windows; restore them, or add "
            "'dataloader' to checkpoint.exclude_from_loading to start the data afresh"
        )


def _first_changed(differ: dict, keys: tuple[str, ...], where: str) -> str | None:
    """'key=new differs from the old that WHERE was saved with' for the first of `keys` that changed."""
    key = next((k for k in keys if k in differ), None)
    if key is None:
        return None
    old, new = differ[key]
    return f"{key}={new!r} differs from the {old!r} that {where} was saved with"

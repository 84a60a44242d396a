"""Two rules every run configuration obeys, each declared once, as a table:

- BOUNDS: every number of every section lies within its bounds (a count has a finite upper bound, a divisor or an
  epsilon is positive), or is one of the few values that mean something else (-1: the flavor's, auto, ...);
- FEATURES: a key that only means something while a feature is on (Muon's settings under AdamW, the spike guard's
  window with the guard off, [moe] on a dense model, ...) is refused when set while the feature is off, rather
  than ignored without a word.

loading.py applies both (check_bounds, check_features); reference.py writes them into `--help` and
docs/configuration.md beside each key, so the reference says what is checked. Torch-free, like the rest of the
configuration.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from titanlite.base.errors import ConfigError
from titanlite.config.sections import JobConfig, field_types, section_classes
from titanlite.models.registry import names, spec_named, spec_of

# ----------------------------------------------------------------------------------------------
# Bounds


@dataclass(frozen=True)
class Bound:
    """The values a number may take: `low` to `high` (`low_open`/`high_open`: that end excluded), or one of
    `special`'s values, each with what it means. `why` says where the upper bound comes from and `low_why` why the
    lower one matters, in the refusal and in the docs. Every number must also be finite."""

    low: float
    high: float = math.inf
    why: str = ""
    low_open: bool = False
    high_open: bool = False
    special: tuple[tuple[float, str], ...] = ()
    low_why: str = ""
    refusal: str = ""  # the whole refusal after "key=value", for a range the generic words would say less well

    def allows(self, value: float) -> bool:
        if any(value == v for v, _ in self.special):
            return True
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def refusal_of(self, key: str, value: float) -> str | None:
        """The one line refusing `value` for `key`, or None where it is allowed."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"{key}={value} is not a finite number"
        if self.allows(value):
            return None
        if self.refusal:
            return f"{key}={value} {self.refusal}"
        if self.low == 0 and self.high == 1 and not (self.why or self.low_why):  # a fraction
            return f"{key}={value} must be {'in [0, 1)' if self.high_open else 'between 0 and 1'}"
        if value > self.high or (self.high_open and value >= self.high):
            limit = f"below {_number(self.high)}" if self.high_open else f"{_number(self.high)} or less"
            return f"{key}={value} is above its bound of {_number(self.high)}: {self.why}; set it to {limit}"
        if self.low_open:
            text = "must be positive" if self.low == 0 else f"must be above {_number(self.low)}"
        elif self.low == 0 and not self.special:
            text = "must not be negative"
        else:
            text = f"must be at least {_number(self.low)}"
        text += "".join(f", or {_number(v)} {meaning}" for v, meaning in self.special)
        return f"{key}={value} {text}" + (f": {self.low_why}" if self.low_why else "")

    def describe(self) -> str:
        """The bounds in the reference's words: 'Bounds: 1 to 100 (why).'"""
        low, high = _number(self.low), _number(self.high)
        if math.isinf(self.high):
            text = f"above {low}" if self.low_open else f"{low} or more"
        elif not (self.low_open or self.high_open):
            text = f"{low} to {high}"
        else:
            above, below = "above" if self.low_open else "at least", "below" if self.high_open else "at most"
            text = f"{above} {low} and {below} {high}"
        text += "".join(f", or {_number(v)} {meaning}" for v, meaning in self.special)
        reasons = "; ".join(r for r in (self.low_why, self.why) if r)
        return f"Bounds: {text}" + (f" ({reasons})" if reasons else "") + "."


def _number(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    return str(int(x)) if x.is_integer() and abs(x) < 1e15 else f"{x:g}"


# The shared bounds: what no run could need, each from something real.
MAX_STEPS = 10**9
STEPS_WHY = "10^9 steps take over 30 years at a step a second"
MAX_LAYERS = 1000
LAYERS_WHY = (
    "as deep as the deepest transformer trained, DeepNet's 1,000 layers; `titanlite check` measures every block "
    "on the meta device before launch"
)
MAX_RANKS = 2**20
RANKS_WHY = "more ranks than any cluster has devices"
MAX_SEQUENCES = 2**20
SEQUENCES_WHY = "a million sequences, hundreds of times the largest published batches"
MAX_TOKENS = 2**24
TOKENS_WHY = "longer than any model's context: the longest published ones take 10 M tokens"
MAX_PROCESSES = 1024
PROCESSES_WHY = "more processes than a node has cores"

STEPS = Bound(1, MAX_STEPS, STEPS_WHY)
STEPS_OR_NONE = Bound(0, MAX_STEPS, STEPS_WHY)
RANKS = Bound(1, MAX_RANKS, RANKS_WHY)
ANY = Bound(-math.inf)  # any finite number (not a count, a divisor or an epsilon)
NOT_NEGATIVE = Bound(0)
POSITIVE = Bound(0, low_open=True)
FRACTION_BELOW_ONE = Bound(0, 1, high_open=True)
FLAVORS = ((-1, "to keep the model flavor's"),)

# Every int and float key of every section (tests/unit/test_config_rules.py checks that none is missing, and that
# every integer has a finite upper bound).
BOUNDS: dict[str, Bound] = {
    "model.n_layers": Bound(0, MAX_LAYERS, LAYERS_WHY),
    "model.mtp_layers": Bound(
        0,
        MAX_LAYERS,
        "each depth is a block: " + LAYERS_WHY + " (and below training.seq_len: depth k predicts k + 1 tokens ahead)",
        special=((-1, "for the flavor's or folder's"),),
    ),
    "training.steps": STEPS,
    "training.local_batch_size": Bound(1, MAX_SEQUENCES, SEQUENCES_WHY),
    "training.global_batch_size": Bound(1, MAX_SEQUENCES, SEQUENCES_WHY, special=((-1, "for local_batch_size x dp"),)),
    "training.seq_len": Bound(1, MAX_TOKENS, TOKENS_WHY),
    "training.max_norm": NOT_NEGATIVE,
    "training.seed": Bound(-(2**63), 2**63 - 1, "a 64-bit integer"),
    "training.spike_factor": Bound(
        1,
        low_open=True,
        special=((0, "to turn the spike guard off"),),
        refusal="would skip ordinary steps (the threshold is that multiple of the median gradient norm): set it above "
        "1 (e.g. 5), or 0 to turn the spike guard off",
    ),
    "training.spike_window": Bound(
        1,
        10_000,
        "the guard keeps that many norms on the device and takes their median every step, and skips no spike in "
        "a run's first spike_window steps",
    ),
    "training.max_skipped_steps_in_row": STEPS,
    "training.loss_chunk_tokens": Bound(0, MAX_TOKENS, TOKENS_WHY, special=((-1, "for auto"),)),
    "training.mtp_loss_coefficient": NOT_NEGATIVE,
    "training.indexer_loss_coefficient": NOT_NEGATIVE,
    "training.stop_after_step": STEPS_OR_NONE,
    "data.num_workers": Bound(0, MAX_PROCESSES, PROCESSES_WHY),
    "data.prefetch": Bound(0, 1024, "each is a micro-batch held in host memory ahead of the step"),
    "data.prepare_workers": Bound(0, MAX_PROCESSES, PROCESSES_WHY),
    "data.shard_size_mb": Bound(
        0, 65_536, "a shard's text is held in a worker's memory while it is tokenised", low_open=True
    ),
    "validation.freq": STEPS,
    "validation.steps": Bound(1, MAX_STEPS, STEPS_WHY, special=((-1, "for the whole validation split"),)),
    "validation.local_batch_size": Bound(0, MAX_SEQUENCES, SEQUENCES_WHY),
    "validation.seq_len": Bound(0, MAX_TOKENS, TOKENS_WHY),
    "validation.split_fraction": FRACTION_BELOW_ONE,
    "downstream.interval": STEPS,
    "downstream.limit": Bound(1, MAX_SEQUENCES, SEQUENCES_WHY, special=((0, "for all of them"),)),
    "downstream.num_fewshot": Bound(
        0, 1024, "each example lengthens every prompt", special=((-1, "for each task's own setting"),)
    ),
    "downstream.batch_size": Bound(0, MAX_SEQUENCES, SEQUENCES_WHY),
    "optimizer.lr": POSITIVE,
    "optimizer.weight_decay": NOT_NEGATIVE,
    "optimizer.eps": Bound(
        0,
        1,
        "beyond 1 it outweighs sqrt(v) of any ordinary gradient, and AdamW becomes a scaled momentum SGD",
        low_open=True,
        low_why="AdamW divides each update by sqrt(v) + eps, which is 0 / 0 = NaN for a parameter whose gradient is 0, "
        "such as the embedding rows of tokens a batch lacks; use e.g. 1e-8",
    ),
    "optimizer.beta1": FRACTION_BELOW_ONE,
    "optimizer.beta2": FRACTION_BELOW_ONE,
    "optimizer.muon_lr": POSITIVE,
    "optimizer.muon_momentum": FRACTION_BELOW_ONE,
    "optimizer.muon_ns_steps": Bound(
        1,
        100,
        "Newton-Schulz converges in about 5 iterations, the default, and each is 3 matrix products per matrix per step",
    ),
    "optimizer.muon_weight_decay": NOT_NEGATIVE,
    "lr_scheduler.warmup_steps": STEPS_OR_NONE,
    "lr_scheduler.min_lr_factor": Bound(0, 1),
    "parallelism.data_parallel_replicate_degree": RANKS,
    "parallelism.data_parallel_shard_degree": Bound(
        1, MAX_RANKS, RANKS_WHY, special=((-1, "for the rest of the world size"),)
    ),
    "parallelism.context_parallel_degree": RANKS,
    "parallelism.tensor_parallel_degree": RANKS,
    "parallelism.expert_parallel_degree": RANKS,
    "parallelism.expert_tensor_parallel_degree": RANKS,
    "parallelism.pipeline_parallel_degree": RANKS,
    "parallelism.pipeline_parallel_microbatch_size": Bound(1, MAX_SEQUENCES, SEQUENCES_WHY),
    "parallelism.pipeline_parallel_layers_per_stage": Bound(0, MAX_LAYERS, LAYERS_WHY),
    "moe.aux_loss_coef": Bound(0, special=FLAVORS),
    "moe.z_loss_coef": Bound(0, special=FLAVORS),
    "moe.bias_update_rate": Bound(0, special=FLAVORS),
    "activation_checkpoint.selective_ac_option": Bound(1, MAX_LAYERS, LAYERS_WHY),
    "checkpoint.interval": STEPS,
    "checkpoint.keep_latest_k": Bound(0, MAX_STEPS, "at most one checkpoint a step: " + STEPS_WHY),
    "checkpoint.load_step": Bound(0, MAX_STEPS, STEPS_WHY, special=((-1, "for the newest"),)),
    "checkpoint.export_max_shard_gb": Bound(0, low_open=True, low_why="the export is cut into files of this size"),
    "comm.init_timeout_seconds": Bound(
        0, 7 * 86_400, "a week: a longer wait for a dead peer only holds the job's devices", low_open=True
    ),
    "comm.train_timeout_seconds": Bound(
        0, 7 * 86_400, "a week: a longer wait for a dead peer only holds the job's devices", low_open=True
    ),
    "metrics.log_freq": STEPS,
    "metrics.throughput_warmup_steps": STEPS_OR_NONE,
    "metrics.peak_tflops": Bound(0, 100_000, "over 40 times the dense bf16 peak of a B200, the fastest device yet"),
    "profiling.profile_freq": STEPS,
    "profiling.profile_active_steps": STEPS,
}


def numeric_keys() -> list[str]:
    """Every int and float key of the sections, as "section.key"."""
    return [
        f"{section}.{name}"
        for section, cls in section_classes().items()
        for name, tp in field_types(cls).items()
        if tp in (int, float)
    ]


def check_bounds(cfg: JobConfig) -> None:
    """Refuse the first number outside its bounds (BOUNDS), in the order the sections declare them."""
    for key in numeric_keys():
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        refusal = BOUNDS.get(key, ANY).refusal_of(key, value)
        if refusal:
            raise ConfigError(refusal)


# ----------------------------------------------------------------------------------------------
# Features: keys that mean something only while a feature is on


@dataclass(frozen=True)
class ModelView:
    """What the features need of the model (FEATURES' switches), torch-free: its family, the load balance of its
    experts (None: no mixture-of-experts blocks) and its multi-token prediction depths, model.mtp_layers resolved."""

    family: str
    balance: str | None
    mtp_layers: int
    mtp_capable: bool  # the family's arguments can hold multi-token prediction depths
    indexer: bool = False  # its attention is sparse, through a lightning indexer (DeepSeek-V3.2's, V4's CSA layers')


def model_view(model_cfg, moe_cfg, folder_args: Any = None) -> ModelView | None:
    """The ModelView of the [model] section (folder_args: a Hugging Face folder's model, with model.flavor "hf");
    None for a flavor the family does not have (refused when the model is built, naming the flavors)."""
    if model_cfg.flavor == "hf":
        args = folder_args
    else:
        args = spec_named(model_cfg.name).flavors.get(model_cfg.flavor)
    if args is None:
        return None
    spec = spec_of(args)
    moe = spec.moe(args)
    depth = model_cfg.mtp_layers if model_cfg.mtp_layers != -1 else getattr(args, "mtp_layers", 0)
    capable = any(f.name == "mtp_layers" for f in dataclasses.fields(args))
    indexer = getattr(args, "indexer", None) is not None or getattr(args, "has_indexer", False)
    return ModelView(spec.name, None if moe is None else (moe_cfg.balance or moe.balance), depth, capable, indexer)


def mtp_families() -> str:
    """The registered families whose models can have multi-token prediction depths."""
    capable = [n for n in names() if any(f.name == "mtp_layers" for f in dataclasses.fields(spec_named(n).args_type))]
    return ", ".join(capable)


@dataclass(frozen=True)
class Feature:
    """A feature and the keys that only mean something while it is on. `on(cfg, model)` says whether it is (model:
    None where the model is unknown: a feature that reads it, `needs_model`, is then not checked); `off(cfg, model)`
    why it is not, `turn_on(cfg, model)` how to turn it on; `when`, in the docs, when its keys apply. `switches`: the
    keys that turn it on or off: one of them set on the command line leaves the config file's keys of the feature
    be (the file's settings for when the feature is on, which this run turns off)."""

    keys: tuple[str, ...]
    when: str
    on: Callable[[JobConfig, Any], bool]
    off: Callable[[JobConfig, Any], str]
    turn_on: Callable[[JobConfig, Any], str]
    switches: tuple[str, ...]
    needs_model: bool = False


def keys_of(section: str, *, prefix: str = "", but: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The keys of a section (those whose name starts with `prefix`), but the ones named in `but`."""
    fields = field_types(section_classes()[section])
    return tuple(f"{section}.{k}" for k in fields if k.startswith(prefix) and k not in but)


# The keys that choose the model: set on the command line, they replace the config file's model (loading.py takes
# its MODEL_CHOICE from here).
MODEL_SWITCHES = ("model.name", "model.flavor", "model.hf_assets_path")


def _mtp_off(cfg: JobConfig, m: ModelView) -> str:
    if not m.mtp_capable:
        return f"model {m.family} has no multi-token prediction"
    return f"model {m.family} {cfg.model.flavor} has no multi-token prediction depths (model.mtp_layers resolves to 0)"


def _mtp_on(cfg: JobConfig, m: ModelView) -> str:
    if not m.mtp_capable:
        return f"use a family that has it ({mtp_families()})"
    return "set model.mtp_layers = 1"


FEATURES: tuple[Feature, ...] = (
    Feature(
        keys_of("optimizer", prefix="muon_"),
        "with optimizer.name = 'Muon'",
        lambda c, m: c.optimizer.name == "Muon",
        lambda c, m: f"optimizer.name is {c.optimizer.name!r}",
        lambda c, m: "set optimizer.name = 'Muon'",
        ("optimizer.name",),
    ),
    Feature(
        ("training.mtp_loss_coefficient",),
        "with multi-token prediction (model.mtp_layers > 0, or a folder's own depths)",
        lambda c, m: m.mtp_layers > 0,
        _mtp_off,
        _mtp_on,
        (*MODEL_SWITCHES, "model.mtp_layers"),
        needs_model=True,
    ),
    Feature(
        ("training.indexer_loss_coefficient", "training.indexer_dense_warmup"),
        "with sparse attention (model.name deepseek_v32, glm_moe_dsa or deepseek_v4, or such a folder)",
        lambda c, m: m.indexer,
        lambda c, m: f"model {m.family} attends densely: it has no indexer to train",
        lambda c, m: "use a model with sparse attention (deepseek_v32, glm_moe_dsa, deepseek_v4)",
        MODEL_SWITCHES,
        needs_model=True,
    ),
    Feature(
        ("training.spike_window",),
        "with the spike guard on (training.spike_factor > 1)",
        lambda c, m: c.training.spike_factor > 0,
        lambda c, m: "training.spike_factor is 0 (the spike guard is off)",
        lambda c, m: "set training.spike_factor above 1 (e.g. 5)",
        ("training.spike_factor",),
    ),
    Feature(
        ("training.max_skipped_steps_in_row",),
        "where steps are skipped (training.spike_factor or training.skip_nonfinite_steps)",
        lambda c, m: c.training.skips_steps(),
        lambda c, m: "no step is ever skipped (training.spike_factor is 0 and training.skip_nonfinite_steps false)",
        lambda c, m: "set training.spike_factor above 1 or training.skip_nonfinite_steps = true",
        ("training.spike_factor", "training.skip_nonfinite_steps"),
    ),
    Feature(
        keys_of("float8", but=("enable",)),
        "with float8.enable = true",
        lambda c, m: c.float8.enable,
        lambda c, m: "float8.enable is false",
        lambda c, m: "set float8.enable = true",
        ("float8.enable",),
    ),
    Feature(
        ("float8.fsdp_float8_all_gather",),
        "with float8.recipe = 'tensorwise'",
        lambda c, m: c.float8.recipe == "tensorwise",
        lambda c, m: f"float8.recipe is {c.float8.recipe!r}",
        lambda c, m: "set float8.recipe = 'tensorwise'",
        ("float8.enable", "float8.recipe"),
    ),
    Feature(
        # split_fraction is held out whether or not validation is on, so that turning it on changes no training data;
        # a separate validation corpus (dataset, dataset_path) means the training corpus holds nothing out, on or off
        keys_of("validation", but=("enable", "split_fraction", "dataset", "dataset_path")),
        "with validation.enable = true (or in `titanlite eval`)",
        lambda c, m: c.validation.enable,
        lambda c, m: "validation.enable is false",
        lambda c, m: "set validation.enable = true (`titanlite eval` reads them without it)",
        ("validation.enable",),
    ),
    Feature(
        keys_of("downstream", but=("tasks",)),
        "with downstream.tasks set (or in `titanlite eval --tasks`)",
        lambda c, m: bool(c.downstream.tasks),
        lambda c, m: "downstream.tasks is empty",
        lambda c, m: "name the tasks in downstream.tasks",
        ("downstream.tasks",),
    ),
    Feature(
        ("validation.dataset_split", "validation.dataset_text_field"),
        "with a separate validation corpus (validation.dataset or validation.dataset_path)",
        lambda c, m: bool(c.validation.dataset or c.validation.dataset_path),
        lambda c, m: "validation holds out the training corpus's last tokens (no validation.dataset or dataset_path)",
        lambda c, m: "name a separate corpus with validation.dataset or validation.dataset_path",
        ("validation.enable", "validation.dataset", "validation.dataset_path"),
    ),
    Feature(
        (
            "checkpoint.interval",
            "checkpoint.async_mode",
            "checkpoint.keep_latest_k",
            "checkpoint.model_only",
            "checkpoint.start_from_scratch",
        ),
        "with checkpoint.enable = true",
        lambda c, m: c.checkpoint.enable,
        lambda c, m: "checkpoint.enable is false (the run saves and resumes nothing)",
        lambda c, m: "set checkpoint.enable = true",
        ("checkpoint.enable",),
    ),
    Feature(
        keys_of("compile", but=("enable",)),
        "with compile.enable = true",
        lambda c, m: c.compile.enable,
        lambda c, m: "compile.enable is false",
        lambda c, m: "set compile.enable = true",
        ("compile.enable",),
    ),
    Feature(
        keys_of("metrics", prefix="wandb_"),
        "with metrics.enable_wandb = true",
        lambda c, m: c.metrics.enable_wandb,
        lambda c, m: "metrics.enable_wandb is false",
        lambda c, m: "set metrics.enable_wandb = true",
        ("metrics.enable_wandb",),
    ),
    Feature(
        keys_of("profiling", but=("enable_profiling",)),
        "with profiling.enable_profiling = true",
        lambda c, m: c.profiling.enable_profiling,
        lambda c, m: "profiling.enable_profiling is false",
        lambda c, m: "set profiling.enable_profiling = true",
        ("profiling.enable_profiling",),
    ),
    Feature(
        ("activation_checkpoint.selective_ac_option",),
        "with activation_checkpoint.mode = 'selective_layer'",
        lambda c, m: c.activation_checkpoint.mode == "selective_layer",
        lambda c, m: f"activation_checkpoint.mode is {c.activation_checkpoint.mode!r}",
        lambda c, m: "set activation_checkpoint.mode = 'selective_layer'",
        ("activation_checkpoint.mode",),
    ),
    Feature(
        ("lr_scheduler.min_lr_factor",),
        "with a decaying learning rate (lr_scheduler.decay_type 'cosine' or 'linear')",
        lambda c, m: c.lr_scheduler.decay_type != "constant",
        lambda c, m: "lr_scheduler.decay_type is 'constant' (no decay, no floor)",
        lambda c, m: "set lr_scheduler.decay_type = 'cosine' or 'linear'",
        ("lr_scheduler.decay_type",),
    ),
    Feature(
        keys_of("parallelism", prefix="pipeline_parallel_", but=("pipeline_parallel_degree",)),
        "with pipeline parallelism (parallelism.pipeline_parallel_degree > 1)",
        lambda c, m: c.parallelism.pipeline_parallel_degree > 1,
        lambda c, m: "parallelism.pipeline_parallel_degree is 1 (no pipeline)",
        lambda c, m: "set parallelism.pipeline_parallel_degree above 1",
        ("parallelism.pipeline_parallel_degree",),
    ),
    Feature(
        ("parallelism.disable_loss_parallel",),
        "with tensor parallelism (parallelism.tensor_parallel_degree > 1)",
        lambda c, m: c.parallelism.tensor_parallel_degree > 1,
        lambda c, m: "parallelism.tensor_parallel_degree is 1 (no loss parallelism to disable)",
        lambda c, m: "set parallelism.tensor_parallel_degree above 1",
        ("parallelism.tensor_parallel_degree",),
    ),
    Feature(
        keys_of("moe"),
        "with a mixture-of-experts model",
        lambda c, m: m.balance is not None,
        lambda c, m: f"model {m.family} has no mixture-of-experts blocks",
        lambda c, m: "use a model with experts (e.g. --config train_configs/qwen3_moe_debug.toml)",
        MODEL_SWITCHES,
        needs_model=True,
    ),
    Feature(
        ("moe.aux_loss_coef",),
        "with moe.balance = 'aux_loss' (the flavor's or set)",
        lambda c, m: m.balance == "aux_loss",
        lambda c, m: f"the balance is {m.balance!r}",
        lambda c, m: "set moe.balance = 'aux_loss'",
        (*MODEL_SWITCHES, "moe.balance"),
        needs_model=True,
    ),
    Feature(
        ("moe.bias_update_rate",),
        "with moe.balance = 'bias' (the flavor's or set)",
        lambda c, m: m.balance == "bias",
        lambda c, m: f"the balance is {m.balance!r}",
        lambda c, m: "set moe.balance = 'bias'",
        (*MODEL_SWITCHES, "moe.balance"),
        needs_model=True,
    ),
)


def _value(cfg: JobConfig, key: str) -> Any:
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


def check_features(cfg: JobConfig, given: set[str], command_line: set[str], model: ModelView | None) -> None:
    """Refuse the first key that is given (`given`: set in the user's config file or on the command line) with a
    value other than its default while a feature it belongs to (FEATURES) is off; a key from the file is left be
    when the command line sets one of the feature's switches (`command_line`: the keys set there), and any key when
    the command line sets an on/off switch of it to false (the run turns the feature off on purpose)."""
    defaults = JobConfig()
    for feature in FEATURES:
        if feature.needs_model and model is None:
            continue
        if feature.on(cfg, model):
            continue
        cli_switch = any(s in command_line for s in feature.switches)
        # `--validation.enable false` after the feature's own settings: the same command turns it off on purpose
        # (an on/off switch, not a choice such as optimizer.name, whose settings would contradict the choice).
        switched_off = any(s in command_line and _value(cfg, s) is False for s in feature.switches)
        for key in feature.keys:
            value = _value(cfg, key)
            if key not in given or value == _value(defaults, key) or (cli_switch and key not in command_line):
                continue
            if switched_off:
                continue
            raise ConfigError(
                f"{key}={value!r} is set but {feature.off(cfg, model)}: it applies only {feature.when}; "
                f"{feature.turn_on(cfg, model)}, or remove {key}"
            )


def check_model_counts(cfg: JobConfig, model: ModelView | None) -> None:
    """The counts bounded by another key: every multi-token prediction depth needs targets in the window (depth k
    predicts the token k + 1 places ahead, so a window of training.seq_len tokens has seq_len - k targets for it)."""
    # (a family without depths is refused its model.mtp_layers when the model is built, naming that)
    if model is not None and model.mtp_capable and model.mtp_layers >= cfg.training.seq_len:
        raise ConfigError(
            f"model.mtp_layers={model.mtp_layers} leaves depths without a target: depth k predicts the token k + 1 "
            f"places ahead, and a window of training.seq_len={cfg.training.seq_len} tokens has seq_len - k of them; "
            f"use model.mtp_layers below {cfg.training.seq_len} (or a longer training.seq_len)"
        )


def rule_text(key: str) -> str:
    """What the rules say of `key`, for its line in `--help` and docs/configuration.md ('' for none)."""
    parts = [BOUNDS[key].describe()] if key in BOUNDS else []
    whens = [f.when for f in FEATURES if key in f.keys]
    if whens:
        parts.append(f"Applies only {' and '.join(whens)}: set otherwise, it is refused.")
    return " ".join(parts)

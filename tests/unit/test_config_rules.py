"""Every number within a documented bound, and no setting of a feature that is off (issue 71, parts 2 and 3):
both rules are tables in titanlite/config/rules.py, applied by the config loader. Each case parses a config in
this process, in milliseconds (the float8 and model-argument ones plan a tiny model on the meta device)."""

from __future__ import annotations

import logging
import math
import re
import typing
from fnmatch import fnmatch
from pathlib import Path

import pytest

from titanlite.base.errors import ConfigError
from titanlite.builder import model_facts
from titanlite.builder.model_facts import ModelFacts
from titanlite.builder.plan import plan_model, plan_run
from titanlite.config import JobConfig, parse_config, reference_markdown, to_toml
from titanlite.config.rules import BOUNDS, FEATURES, numeric_keys
from titanlite.config.sections import field_types, section_classes

DEEPSEEK = ["--config", "train_configs/deepseek_v3_debug.toml"]
MOE = ["--config", "train_configs/qwen3_moe_debug.toml"]


def refusal(argv: list[str], **kwargs) -> str:
    """The one line parse_config refuses `argv` with."""
    with pytest.raises(ConfigError) as e:
        parse_config(argv, **kwargs)
    line = str(e.value)
    assert "\n" not in line, line
    return line


# ----------------------------------------------------------------------------------------------
# Part 2: every number bounded before launch


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--optimizer.muon_ns_steps", "100000000"],
            ["optimizer.muon_ns_steps=100000000 is above its bound of 100", "Newton-Schulz converges"],
        ),
        (["--model.mtp_layers", "1000000"], ["model.mtp_layers=1000000 is above its bound of 1000", "DeepNet"]),
        (
            [*DEEPSEEK, "--model.mtp_layers", "1000", "--training.seq_len", "32"],
            ["model.mtp_layers=1000 leaves depths without a target", "use model.mtp_layers below 32"],
        ),
        (["--model.n_layers", "100000"], ["model.n_layers=100000 is above its bound of 1000", "DeepNet"]),
        (["--optimizer.eps", "0"], ["optimizer.eps=0.0 must be positive", "AdamW divides each update"]),
        (["--optimizer.eps", "-1e-8"], ["optimizer.eps=-1e-08 must be positive"]),
        (["--comm.train_timeout_seconds", "1e300"], ["comm.train_timeout_seconds=1e+300 is above its bound"]),
        (["--training.spike_factor", "5", "--training.spike_window", "1000000"], ["spike_window=1000000 is above"]),
    ],
)
def test_the_issues_numbers_are_refused_in_one_line_naming_key_bound_and_why(argv, words):
    line = refusal(argv)
    for word in words:
        assert word in line, line


def test_every_number_has_a_bound_and_every_count_a_finite_one():
    keys = numeric_keys()
    assert set(BOUNDS) == set(keys), f"missing: {set(keys) - set(BOUNDS)}; unknown: {set(BOUNDS) - set(keys)}"
    for key in keys:
        section, _, name = key.partition(".")
        if field_types(section_classes()[section])[name] is int:
            assert math.isfinite(BOUNDS[key].high) and BOUNDS[key].why, f"{key} has no finite, explained upper bound"
    defaults = JobConfig()
    for key, bound in BOUNDS.items():
        section, _, name = key.partition(".")
        assert bound.refusal_of(key, getattr(getattr(defaults, section), name)) is None, f"{key}'s default is refused"


# training.seed's bound is the 64-bit integer's, which the command line's parser refuses first
BOUNDED = [key for key, bound in BOUNDS.items() if 1 < bound.high < 2**63 - 1]
# What turns on the feature a key belongs to (rules.FEATURES), by the key's prefix.
FEATURE_ON = {
    "training.spike_window": ["--training.spike_factor", "5"],
    "training.max_skipped_steps_in_row": ["--training.skip_nonfinite_steps"],
    "training.stop_after_step": ["--training.steps", "1000000000"],
    "validation.": ["--validation.enable"],
    "downstream.": ["--downstream.tasks", "hellaswag", "--training.steps", "1000000000"],
    "optimizer.muon_": ["--optimizer.name", "Muon"],
    "parallelism.pipeline_parallel_microbatch_size": ["--parallelism.pipeline_parallel_degree", "2"],
    "parallelism.pipeline_parallel_layers_per_stage": ["--parallelism.pipeline_parallel_degree", "2"],
    "activation_checkpoint.": ["--activation_checkpoint.mode", "selective_layer"],
    "checkpoint.": ["--checkpoint.enable"],
    "profiling.": ["--profiling.enable_profiling"],
    "model.mtp_layers": [*DEEPSEEK, "--training.seq_len", "2048"],
}


@pytest.mark.parametrize("key", BOUNDED)
def test_one_past_each_upper_bound_is_refused_with_the_bound_and_its_reason(key):
    bound = BOUNDS[key]
    section, _, name = key.partition(".")
    integer = field_types(section_classes()[section])[name] is int
    over = int(bound.high) + 1 if integer else float(bound.high) * 2
    line = refusal([f"--{key}", str(over)])
    assert line.startswith(f"{key}={over} is above its bound of ") and bound.why in line, line
    on = next((args for prefix, args in FEATURE_ON.items() if key.startswith(prefix)), [])
    parse_config([*on, f"--{key}", str(int(bound.high) if integer else bound.high)])  # the bound itself is fine


def test_the_bounds_are_in_the_reference():
    reference = reference_markdown()
    assert "Bounds: 1 to 100 (Newton-Schulz converges" in reference
    assert "Bounds: above 0 and at most 1 (AdamW divides each update" in reference


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--config", "train_configs/qwen3_5_debug.toml", "--model.mtp_layers", "2"], ["model.mtp_layers=2", "0 or 1"]),
        (["--config", "train_configs/olmo_hybrid_debug.toml", "--model.n_layers", "1"], ["model.n_layers=1"]),
    ],
)
def test_a_model_argument_the_family_refuses_is_one_line_not_a_traceback(argv, words):
    with pytest.raises(ConfigError) as e:
        plan_model(parse_config(argv))
    for word in words:
        assert word in str(e.value), str(e.value)


# ----------------------------------------------------------------------------------------------
# Part 3: every option meant


def other_value(key: str):
    """A valid value of `key` other than its default, as a command-line string."""
    chosen = {
        "compile.components": "model",
        "float8.filter_fqns": "attention",
        "optimizer.muon_params": "layers.*.weight",
        "compile.backend": "aot_eager",
        "validation.dataset": "owner/corpus",
        "validation.dataset_path": "data/val.jsonl",
        "moe.balance": "bias",
    }
    if key in chosen:
        return chosen[key]
    section, _, name = key.partition(".")
    tp = field_types(section_classes()[section])[name]
    default = getattr(getattr(JobConfig(), section), name)
    if tp is bool:
        return str(not default).lower()
    if typing.get_origin(tp) is typing.Literal:
        return next(c for c in typing.get_args(tp) if c != default)
    if tp is int:
        return str(default + 1 if default >= 0 else 5)
    if tp is float:
        return str(0.5 if default in (-1.0, 0.0) else default / 2)
    if typing.get_origin(tp) is list:
        return "a,b"
    return "x"


FEATURE_KEYS = sorted({key for feature in FEATURES for key in feature.keys} - {"lr_scheduler.min_lr_factor"})


@pytest.mark.parametrize("key", FEATURE_KEYS)
def test_a_key_of_a_feature_that_is_off_is_refused_naming_the_switch(key):
    # The default config (GPT-2, dense, AdamW, every optional feature off) leaves each of them without effect.
    line = refusal([f"--{key}", other_value(key)])
    if key == "validation.dataset_subset":  # a hub dataset's key, refused for any other source first
        assert line.startswith("validation.dataset_subset applies only to a hub dataset"), line
        return
    assert line.startswith(f"{key}=") and " is set but " in line and ": it applies only " in line, line
    assert line.endswith(f", or remove {key}"), line


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["--optimizer.muon_lr", "0.01"],
            "optimizer.muon_lr=0.01 is set but optimizer.name is 'AdamW': it applies only with optimizer.name = "
            "'Muon'; set optimizer.name = 'Muon', or remove optimizer.muon_lr",
        ),
        (
            ["--optimizer.muon_params", "layers.*.weight"],
            "optimizer.muon_params=['layers.*.weight'] is set but optimizer.name is 'AdamW'",
        ),
        (
            ["--training.mtp_loss_coefficient", "0.3"],
            "training.mtp_loss_coefficient=0.3 is set but model gpt2 has no multi-token prediction: it applies only "
            "with multi-token prediction",
        ),
        (
            [*DEEPSEEK, "--training.mtp_loss_coefficient", "0.3"],
            "set model.mtp_layers = 1, or remove training.mtp_loss_coefficient",
        ),
        (
            [*DEEPSEEK, "--training.indexer_dense_warmup", "true"],
            "training.indexer_dense_warmup=True is set but model deepseek_v3 attends densely: it has no indexer to "
            "train: it applies only with sparse attention",
        ),
        (
            ["--training.spike_window", "50"],
            "training.spike_window=50 is set but training.spike_factor is 0 (the spike guard is off)",
        ),
        (["--float8.filter_fqns", "attention"], "float8.filter_fqns=['attention'] is set but float8.enable is false"),
        (["--validation.freq", "10"], "validation.freq=10 is set but validation.enable is false"),
        (["--checkpoint.interval", "10"], "checkpoint.interval=10 is set but checkpoint.enable is false"),
        (["--compile.backend", "aot_eager"], "compile.backend='aot_eager' is set but compile.enable is false"),
        (["--metrics.wandb_project", "p"], "metrics.wandb_project='p' is set but metrics.enable_wandb is false"),
        (["--profiling.profile_freq", "5"], "profiling.profile_freq=5 is set but profiling.enable_profiling is false"),
        (
            ["--moe.aux_loss_coef", "0.01"],
            "moe.aux_loss_coef=0.01 is set but model gpt2 has no mixture-of-experts blocks",
        ),
        (
            [*MOE, "--moe.balance", "bias", "--moe.aux_loss_coef", "0.01"],
            "moe.aux_loss_coef=0.01 is set but the balance is 'bias': it applies only with moe.balance = 'aux_loss'",
        ),
        (
            ["--lr_scheduler.decay_type", "constant", "--lr_scheduler.min_lr_factor", "0.5"],
            "lr_scheduler.min_lr_factor=0.5 is set but lr_scheduler.decay_type is 'constant'",
        ),
    ],
)
def test_the_issues_ignored_settings_are_refused_in_one_line(argv, line):
    said = refusal(argv)
    assert said.startswith(line) or said.endswith(line), said


@pytest.mark.parametrize(
    "argv",
    [
        ["--optimizer.name", "Muon", "--optimizer.muon_lr", "0.01", "--optimizer.muon_params", "layers.*.weight"],
        [*DEEPSEEK, "--model.mtp_layers", "1", "--training.mtp_loss_coefficient", "0.3"],
        ["--model.name", "deepseek_v32", "--training.indexer_dense_warmup", "--training.indexer_loss_coefficient", "2"],
        ["--training.spike_factor", "5", "--training.spike_window", "50"],
        ["--training.skip_nonfinite_steps", "--training.max_skipped_steps_in_row", "2"],
        ["--float8.enable", "--float8.filter_fqns", "attention", "--float8.recipe", "rowwise"],
        ["--validation.enable", "--validation.freq", "10", "--validation.dataset_path", "v.jsonl"],
        ["--checkpoint.enable", "--checkpoint.interval", "10", "--checkpoint.keep_latest_k", "2"],
        ["--compile.enable", "--compile.backend", "aot_eager", "--compile.components", "model"],
        ["--profiling.enable_profiling", "--profiling.profile_freq", "5"],
        ["--activation_checkpoint.mode", "selective_layer", "--activation_checkpoint.selective_ac_option", "3"],
        [*MOE, "--moe.balance", "bias", "--moe.bias_update_rate", "0.01", "--moe.z_loss_coef", "0"],
    ],
)
def test_the_same_keys_are_taken_with_their_feature_on(argv):
    parse_config(argv)


def test_a_command_line_that_turns_a_feature_off_leaves_the_files_settings_of_it_be(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        "[checkpoint]\nenable = true\ninterval = 50\n[optimizer]\nname = 'Muon'\nmuon_lr = 0.01\n"
        "[compile]\nenable = true\nbackend = 'aot_eager'\n"
    )
    parse_config(["--config", str(toml)])
    # switched off for this run: the file's settings are for when they are on
    cfg = parse_config(
        ["--config", str(toml), "--checkpoint.enable", "false", "--optimizer.name", "AdamW", "--compile.enable=0"]
    )
    assert (cfg.checkpoint.interval, cfg.optimizer.muon_lr) == (50, 0.01)
    # and so is a command line that sets a feature's keys and turns it off (a base command and an override), but a
    # key given with its feature off by default is refused, as is a file that contradicts itself
    parse_config(["--checkpoint.interval", "20", "--checkpoint.enable", "false"])
    assert refusal(["--checkpoint.interval", "20"]).startswith("checkpoint.interval=20 is set but checkpoint.enable is")
    toml.write_text("[checkpoint]\ninterval = 50\n")
    assert refusal(["--config", str(toml)]).startswith("checkpoint.interval=50 is set but checkpoint.enable is false")


def test_a_config_that_writes_out_every_key_at_its_default_passes(tmp_path):
    # A run folder's config.toml lists every key: those at their defaults are not settings of an off feature.
    toml = tmp_path / "config.toml"
    toml.write_text(to_toml(parse_config([])))
    parse_config(["--config", str(toml)])


def test_every_shipped_config_passes_the_rules():
    for path in sorted(Path("train_configs").glob("*.toml")):
        if path.name != "hf_continue.toml":  # needs a folder; its keys are plain training ones
            parse_config(["--config", str(path)])


def test_commands_that_read_a_checkpoint_take_a_training_runs_flags():
    # `titanlite eval` reads [validation] with validation.enable false; convert and generate ignore training keys.
    argv = ["--validation.steps", "5", "--checkpoint.interval", "10"]
    assert parse_config(argv, training=False).validation.steps == 5
    refusal(argv)


def test_the_reference_says_when_a_key_applies():
    assert "Applies only with optimizer.name = 'Muon': set otherwise, it is refused." in reference_markdown()


def test_float8_filter_names_that_match_no_linear_layer_are_refused_with_the_closest(tmp_path):
    args = ["--float8.enable", "--job.dump_folder", str(tmp_path), "--training.seq_len", "32"]
    plan_run(parse_config([*args, "--float8.filter_fqns", "output,attention.wq"]), 1)
    with pytest.raises(ConfigError) as e:
        plan_run(parse_config([*args, "--float8.filter_fqns", "output,atention"]), 1)
    line = str(e.value)
    assert line.startswith("float8.filter_fqns names 'atention', which is part of no linear layer's name"), line
    assert "'attention'" in line and "\n" not in line, line


def test_the_guide_lists_every_key_the_feature_rule_covers():
    guide = (Path(__file__).resolve().parents[2] / "docs" / "configuration-guide.md").read_text()
    section = guide[guide.index("## What is checked before launch") :]
    named = set(re.findall(r"`([a-z0-9_.*]+)`", section))  # keys, key names and patterns (`moe.*`) in backticks
    for key in {key for feature in FEATURES for key in feature.keys}:
        name = key.partition(".")[2]
        covered = key in named or name in named or any(fnmatch(key, p) for p in named if p.endswith("*"))
        assert covered, f"{key} is not in the guide's table"


def test_measuring_many_blocks_is_said_before_it_starts(tmp_path, monkeypatch, caplog):
    cfg = parse_config(["--model.n_layers", "64", "--data.cache_dir", str(tmp_path)])
    planned = plan_model(cfg)
    facts = ModelFacts("gpt2", 64, 50304, 64, False, [1] * 64, [0] * 64, {"first": (1, 0), "last": (1, 0)}, 1)
    monkeypatch.setattr(model_facts, "model_facts", lambda cfg, planned: facts)
    with caplog.at_level(logging.INFO, logger="titanlite"):
        assert model_facts.cached_model_facts(cfg, planned) == facts
    assert "measuring what each of the model's 64 blocks saves for backward" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titanlite"):
        model_facts.cached_model_facts(cfg, planned)  # cached: nothing to measure, nothing said
    assert "measuring" not in caplog.text

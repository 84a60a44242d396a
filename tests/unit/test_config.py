"""The config: TOML + command-line overrides, one-line errors naming the key, layout checks, help."""

import json
from pathlib import Path

import pytest

from titanlite.base.errors import ConfigError
from titanlite.config import (
    DEFAULT_CONFIG,
    HF_DEFAULT_CONFIG,
    JobConfig,
    field_docs,
    grad_accum_steps,
    help_text,
    load_toml,
    parse_config,
    to_toml,
)
from titanlite.config.loading import tomllib  # tomli on Python 3.10
from titanlite.parallel.dims import ParallelDims

CHECKOUT = Path(__file__).resolve().parents[2]


def test_cli_overrides_toml_which_overrides_defaults(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 1e-3\n")
    cfg = parse_config(["--config", str(toml), "--training.steps", "9", "--optimizer.lr=2e-3"])
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.optimizer.lr == 2e-3
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size  # default


def test_bare_flag_and_explicit_booleans():
    assert parse_config(["--training.deterministic"]).training.deterministic is True
    assert parse_config(["--training.deterministic", "false"]).training.deterministic is False
    assert parse_config(["--data.shuffle=off", "--metrics.log_freq", "1"]).data.shuffle is False


def test_negative_numbers_are_values_not_flags():
    assert parse_config(["--parallelism.data_parallel_shard_degree", "-1"]).parallelism.data_parallel_shard_degree == -1


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--training.stepz", "3"], "did you mean 'training.steps'"),
        (["--optimizer.learning_rate", "1"], "unknown config key 'optimizer.learning_rate'"),
        (["--training.steps", "three"], "training.steps='three' is not a valid int"),
        (["--model.name", "bert"], "model.name='bert' is not a known model; use one of: gpt2, llama3"),
        (["--training.seq_len", "0"], "training.seq_len=0 must be at least 1"),
        (["--optimizer.lr", "0"], "optimizer.lr=0.0 must be positive"),
        (["--training.spike_factor", "1"], "training.spike_factor=1.0 would skip ordinary steps"),
        (["--training.spike_factor", "-3"], "set it above 1 (e.g. 5), or 0 to turn the spike guard off"),
        (
            ["--training.spike_factor", "5", "--training.spike_window", "0"],
            "training.spike_window=0 must be at least 1",
        ),
        (["--training.max_skipped_steps_in_row", "0"], "training.max_skipped_steps_in_row=0 must be at least 1"),
        (
            ["--checkpoint.exclude_from_loading", "model"],
            "leaves out 'model' but loads 'optimizer': the saved optimizer moments belong to the saved weights",
        ),
        (
            ["--checkpoint.exclude_from_loading", "train_state"],
            "leaves out 'train_state' but loads 'lr_scheduler'",
        ),
        (["--config", "missing.toml"], "no such file"),
        (["--training.dataset", "local"], "needs training.dataset_path"),
        (["--compile.mode", "fast"], "compile.mode='fast' is not allowed; use one of: 'default', 'reduce-overhead'"),
        (
            ["--compile.mode", "reduce-overhead", "--compile.backend", "aot_eager"],
            "compile.mode='reduce-overhead' is an inductor mode, but compile.backend='aot_eager'",
        ),
    ],
)
def test_bad_values_fail_with_one_line_naming_the_key(argv, fragment):
    with pytest.raises(ConfigError) as e:
        parse_config(argv)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv, suggestion",
    [
        (["--training.lr", "1e-3"], "optimizer.lr"),  # the name exists in another section: not 'training.seed'
        (["--training.warmup_steps", "3"], "lr_scheduler.warmup_steps"),
        (["--optimiser.lr", "1"], "optimizer.lr"),  # a misspelt section
        (["--trainig.dataset", "stdlib"], "training.dataset"),  # of two 'dataset' keys, the section spelt alike
        (["--optimizer.learning_rate", "1"], "optimizer.lr"),  # another trainer's name for it
        (["--training.stepz", "3"], "training.steps"),  # a misspelt name in its own section
        (["--training.lrr", "1"], "optimizer.lr"),  # a misspelt name of another section's key
    ],
)
def test_an_unknown_key_suggests_the_key_of_that_name_wherever_it_is(argv, suggestion):
    with pytest.raises(ConfigError) as e:
        parse_config(argv)
    assert str(e.value).endswith(f"; did you mean '{suggestion}'?"), str(e.value)


def test_an_unknown_key_like_no_other_gets_no_guess():
    with pytest.raises(ConfigError, match=r"unknown config key 'foo.bar' \(command line\); see --help"):
        parse_config(["--foo.bar", "1"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--training.dataset", "stdlb"],
            "training.dataset='stdlb' is not a dataset titanlite knows; did you mean 'stdlib'?",
        ),
        (["--training.dataset", "Local"], "did you mean 'local'?"),
        (["--validation.enable", "--validation.dataset", "stdlibb"], "validation.dataset='stdlibb' is not a dataset"),
        (["--model.tokenizer", "byt"], "use one of: 'gpt2', 'byte', 'hf' (did you mean 'byte'?)"),
    ],
)
def test_a_misspelt_choice_suggests_the_valid_one(argv, message):
    # A dataset name close to a built-in one is refused before any hub look-up (which would say only that the
    # hub could not be reached, or has no such dataset).
    with pytest.raises(ConfigError) as e:
        parse_config(argv)
    assert message in str(e.value)


def test_hub_dataset_names_are_not_taken_for_typos():
    for name in ("HuggingFaceFW/fineweb", "roneneldan/TinyStories"):
        assert parse_config(["--training.dataset", name]).training.dataset == name


def test_unknown_key_in_toml_names_the_file(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[training]\nsteps = 3\nwarmup = 2\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'training.warmup' \(in .*c.toml\)"):
        parse_config(["--config", str(toml)])


def test_the_default_config_is_the_checkouts_from_any_working_folder(tmp_path, monkeypatch):
    from titanlite.config import loading

    monkeypatch.chdir(tmp_path)  # e.g. .venv/bin/titanlite check, run from the user's home
    assert parse_config([]).job.name == "debug_model"  # train_configs/debug_model.toml's, not the bare default
    # A checkout without it: the line says it is the default one, not a --config the user gave.
    monkeypatch.setattr(loading, "CHECKOUT", tmp_path)
    with pytest.raises(ConfigError) as e:
        parse_config([])
    default = tmp_path / "train_configs" / "debug_model.toml"
    assert str(e.value).startswith(f"the default config {default} (no --config given): no such file"), str(e.value)
    assert "--config" not in str(e.value).partition("(no --config given)")[2]


def test_a_relative_path_is_reported_with_the_folder_it_was_resolved_against(tmp_path, monkeypatch):
    from titanlite.data.sources import Source, local_listing
    from titanlite.data.store import open_store
    from titanlite.data.tokenizer import ByteTokenizer

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        parse_config(["--config", "train_configs/llama3_debug.toml"])
    assert str(e.value) == (
        f"--config train_configs/llama3_debug.toml (resolved against {tmp_path}): no such file; did you mean "
        f"{CHECKOUT / 'train_configs' / 'llama3_debug.toml'}?"
    )
    with pytest.raises(ConfigError, match=f"; the configs are in {CHECKOUT / 'train_configs'}$"):
        parse_config(["--config", "nosuch.toml"])
    with pytest.raises(ConfigError) as e:
        local_listing(Source("local", "data/web.jsonl", "training.dataset_path"))
    assert str(e.value).startswith(f"training.dataset_path='data/web.jsonl' (resolved against {tmp_path}) does not")
    with pytest.raises(ConfigError) as e:  # an absolute path is shown as given
        local_listing(Source("local", str(tmp_path / "web.jsonl"), "training.dataset_path"))
    assert str(e.value).startswith(f"training.dataset_path='{tmp_path / 'web.jsonl'}' does not exist")
    (tmp_path / "web.txt").write_text("some text\n")
    (tmp_path / "taken").write_text("a file where data.cache_dir wants a folder")
    with pytest.raises(ConfigError) as e:
        open_store(Source("local", "web.txt", "training.dataset_path"), ByteTokenizer(), "taken")
    assert str(e.value).startswith(f"cannot write the token store in taken (resolved against {tmp_path}) ("), e.value


def test_wrong_toml_type_is_rejected(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[training]\nsteps = "10"\n')
    with pytest.raises(ConfigError, match="training.steps='10' is not a valid int"):
        parse_config(["--config", str(toml)])


def gpt2_folder(folder: Path, n_positions: int = 256) -> Path:
    """A Hugging Face GPT-2 folder as far as the config goes (config.json; GPT-2's vocabulary, so the shipped
    tokenizer): enough to parse a model.flavor = "hf" config without transformers."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": n_positions}
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 50257}))
    return folder


def test_every_shipped_config_parses(tmp_path):
    configs = sorted(Path("train_configs").glob("*.toml"))
    assert len(configs) >= 9
    for path in configs:
        folder = ["--model.hf_assets_path", str(gpt2_folder(tmp_path))] if path == Path(HF_DEFAULT_CONFIG) else []
        parse_config(["--config", str(path), *folder])


def test_hf_assets_path_that_changes_nothing_is_refused(tmp_path):
    """It used to train the debug GPT-2 from scratch and exit 0, the folder unread."""
    folder = str(gpt2_folder(tmp_path))
    with pytest.raises(ConfigError, match=r"model.hf_assets_path=.* changes nothing .* add --model.flavor hf") as e:
        parse_config(["--model.hf_assets_path", folder])
    assert "\n" not in str(e.value)
    assert parse_config(["--model.hf_assets_path", folder, "--model.flavor", "hf"]).model.name == "gpt2"
    # A named flavor with the folder's tokenizer reads it: allowed.
    assert parse_config(["--model.hf_assets_path", folder, "--model.tokenizer", "hf"]).model.flavor == "debug"


def test_a_hugging_face_run_is_named_for_its_folder_and_takes_the_hf_defaults(tmp_path):
    """Not the debug model's name, description, sequence length, batch and learning rate."""
    folder = gpt2_folder(tmp_path / "SmolGPT", n_positions=256)
    debug, hf = load_toml(DEFAULT_CONFIG), load_toml(HF_DEFAULT_CONFIG)
    cfg = parse_config(["--model.flavor", "hf", "--model.hf_assets_path", str(folder)])
    assert cfg.job.name == "hf-SmolGPT" != debug["job"]["name"]
    assert cfg.job.description == f"gpt2 from {folder} (config {HF_DEFAULT_CONFIG})"
    assert hf["training"]["seq_len"] > 256 and cfg.training.seq_len == 256  # the folder's 256 learned positions
    assert (cfg.training.local_batch_size, cfg.optimizer.lr) == (
        hf["training"]["local_batch_size"],
        hf["optimizer"]["lr"],
    )
    assert cfg.lr_scheduler.warmup_steps == hf["lr_scheduler"]["warmup_steps"] != debug["lr_scheduler"]["warmup_steps"]
    # Naming the shipped file gives the same run; what the user sets is theirs.
    named = parse_config(["--config", HF_DEFAULT_CONFIG, "--model.hf_assets_path", str(folder)])
    assert (named.job.name, named.training.seq_len) == ("hf-SmolGPT", 256)
    own = parse_config(
        [
            "--model.flavor",
            "hf",
            "--model.hf_assets_path",
            str(folder),
            "--job.name",
            "mine",
            "--training.seq_len",
            "64",
        ]
    )
    assert (own.job.name, own.training.seq_len) == ("mine", 64)


def test_resolved_config_round_trips_through_toml():
    cfg = parse_config(["--config", "train_configs/gpt2_large_zero2.toml", "--job.description", 'say "hi"'])
    data = tomllib.loads(to_toml(cfg))
    assert data["parallelism"]["fsdp_reshard_after_forward"] == "never"
    assert data["job"]["description"] == 'say "hi"'
    assert data["training"]["global_batch_size"] == 32


def test_help_lists_every_field_with_its_docstring():
    text = help_text()
    for section in ("job", "model", "training", "data", "optimizer", "lr_scheduler", "parallelism", "metrics"):
        cls = type(getattr(JobConfig(), section))
        docs = field_docs(cls)
        for name in cls.__dataclass_fields__:
            assert f"--{section}.{name}" in text
            assert docs.get(name), f"{section}.{name} has no docstring"


@pytest.mark.parametrize(
    "replicate, shard, world, expect",
    [(1, -1, 4, (1, 4)), (4, 1, 4, (4, 1)), (2, 2, 4, (2, 2)), (2, -1, 8, (2, 4)), (1, -1, 1, (1, 1))],
)
def test_parallel_dims_resolve(replicate, shard, world, expect):
    cfg = parse_config(
        [
            f"--parallelism.data_parallel_replicate_degree={replicate}",
            f"--parallelism.data_parallel_shard_degree={shard}",
        ]
    )
    dims = ParallelDims.from_config(cfg.parallelism, world)
    assert (dims.dp_replicate, dims.dp_shard) == expect
    assert dims.dp == world


def test_degrees_that_do_not_match_the_world_size_name_the_knob():
    cfg = parse_config(["--parallelism.data_parallel_replicate_degree", "3"])
    with pytest.raises(
        ConfigError, match="data_parallel_replicate_degree=3 does not divide the world size 4; use one of 1, 2, 4"
    ):
        ParallelDims.from_config(cfg.parallelism, 4)
    cfg = parse_config(["--parallelism.data_parallel_shard_degree", "3"])
    with pytest.raises(ConfigError, match="multiply to 3 .* world size is 4"):
        ParallelDims.from_config(cfg.parallelism, 4)


def test_global_batch_sets_gradient_accumulation():
    cfg = parse_config(["--training.local_batch_size", "2", "--training.global_batch_size", "16"])
    assert grad_accum_steps(cfg.training, dp_degree=2) == 4
    assert grad_accum_steps(parse_config([]).training, dp_degree=4) == 1  # -1: local x dp
    cfg = parse_config(["--training.local_batch_size", "2", "--training.global_batch_size", "10"])
    with pytest.raises(
        ConfigError, match="global_batch_size=10 is not a multiple of local_batch_size x dp = 2 x 4 = 8"
    ):
        grad_accum_steps(cfg.training, dp_degree=4)


def test_cpu_offload_needs_cuda_and_fsdp(monkeypatch):
    import torch

    from titanlite.builder.plan import plan_run

    cfg = parse_config(["--training.enable_cpu_offload"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device here"):
        plan_run(cfg, world_size=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TITANLITE_DEVICE")  # a GPU box, as titanlite.base.devices sees it
    ddp = parse_config(
        [
            "--training.enable_cpu_offload",
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ]
    )
    with pytest.raises(ConfigError, match="this layout has no FSDP"):
        plan_run(ddp, world_size=2)
    assert plan_run(cfg, world_size=2).dims.dp_shard == 2  # FSDP on a CUDA machine: accepted


def test_cuda_graphs_are_refused_where_they_overwrite_what_backward_needs():
    from titanlite.builder.plan import plan_run

    graphs = ["--compile.enable", "--compile.mode", "reduce-overhead", "--training.local_batch_size", "2"]
    assert plan_run(parse_config(graphs), world_size=1).grad_accum_steps == 1  # one forward per step: accepted
    with pytest.raises(ConfigError, match="reduce-overhead' with 2 gradient accumulation steps") as e:
        plan_run(parse_config([*graphs, "--training.global_batch_size", "4"]), world_size=1)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="under pipeline parallelism"):
        plan_run(parse_config([*graphs, "--parallelism.pipeline_parallel_degree", "2"]), world_size=2)


def test_every_family_has_a_debug_config_listed_in_the_docs():
    from titanlite.models.registry import names

    running = (CHECKOUT / "docs" / "running.md").read_text()
    for family in names():
        path = CHECKOUT / "train_configs" / ("debug_model.toml" if family == "gpt2" else f"{family}_debug.toml")
        assert path.exists(), f"{family} has no debug config ({path.name})"
        cfg = parse_config(["--config", str(path)])
        assert (cfg.model.name, cfg.model.flavor) == (family, "debug"), path.name
        assert f"| `{path.name}` |" in running, f"docs/running.md's table does not list {path.name}"
    for path in (CHECKOUT / "train_configs").glob("*.toml"):
        assert f"| `{path.name}` |" in running, f"docs/running.md's table does not list {path.name}"

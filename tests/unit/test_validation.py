"""The held-out split and validation batches: fixed by the data, never in training, every window counted once."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from titanlite.base.errors import ConfigError
from titanlite.builder.data import build_data, build_validation_data, run_tokenizer
from titanlite.builder.plan import plan_run
from titanlite.config import parse_config
from titanlite.data.datasets import split_point, validation_windows
from titanlite.data.store import TokenStore
from titanlite.engine.trainer import RankModel
from titanlite.engine.validator import IGNORE, EvalBatches, Validator, eval_batches
from titanlite.models.build import build_model
from titanlite.models.common.init import init_weights

EOT = 9


def test_split_starts_at_the_first_end_of_text_after_the_nominal_point():
    tokens = np.array([1, 2, EOT, 3, 4, 5, 6, 7, 8, EOT, 1, 2, 3, EOT, 5, 6, 7, 8, 1, 2], dtype=np.uint16)
    store = TokenStore([tokens[:7], tokens[7:]])  # the search crosses a shard boundary
    assert split_point(store, EOT, 0.6) == 9  # nominal 20 - 12 = 8, moved on to the end-of-text at 9
    assert split_point(store, EOT, 0.35) == 13  # nominal 13 is an end-of-text already
    assert split_point(store, EOT, 0.0) == 20  # nothing held out
    assert split_point(store, EOT, 0.1) == 18  # no end-of-text ahead: the nominal point


def test_the_split_depends_on_the_tokens_alone():
    tokens = np.random.default_rng(0).integers(0, EOT + 1, 10_000).astype(np.uint16)
    one, sharded = TokenStore([tokens]), TokenStore([tokens[:3333], tokens[3333:7000], tokens[7000:]])
    assert split_point(one, EOT, 0.05) == split_point(sharded, EOT, 0.05)
    assert tokens[split_point(one, EOT, 0.05)] == EOT


def test_no_validation_window_occurs_in_the_training_windows():
    # The default corpus (the standard library), as a run reads it; compared on the token ids themselves.
    cfg = parse_config(["--validation.enable", "true"])
    tokenizer = run_tokenizer(cfg)
    corpus = build_data(cfg, tokenizer)
    validation = build_validation_data(cfg, tokenizer, corpus)
    store, split = corpus.stores[0], corpus.split[0]
    # split_fraction 0.01, moved to an end-of-text within half that share either way (on any Python's stdlib)
    assert 0.005 * len(store) <= len(store) - split <= 0.015 * len(store)
    assert store.read(split, split + 1)[0] == tokenizer.eot_id
    training = {corpus.windows[i].numpy().tobytes() for i in range(len(corpus.windows))}
    held_out = [validation[i].numpy().tobytes() for i in range(len(validation))]
    assert len(held_out) > 200 and len(training) > 30_000
    assert not training.intersection(held_out)
    # and the token ranges do not touch: the last training window ends before the held-out tail begins
    last = (len(corpus.windows) - 1) * cfg.training.seq_len + cfg.training.seq_len + 1
    assert last <= split


def test_training_windows_are_the_same_whether_validation_is_enabled_or_not():
    on, off = (
        build_data(cfg, run_tokenizer(cfg))
        for cfg in (parse_config(["--validation.enable", flag]) for flag in ("true", "false"))
    )
    assert on.split == off.split and len(on.windows) == len(off.windows)
    samples = np.arange(1000)
    assert (on.order.windows(samples) == off.order.windows(samples)).all()


@pytest.mark.parametrize("dp, local", [(1, 8), (2, 4), (4, 2), (3, 3)])
def test_every_window_is_evaluated_once_whatever_the_layout(dp, local):
    windows = [torch.arange(i * 10, i * 10 + 6) for i in range(13)]  # 13 windows of 5 targets
    seen, batches = [], set()
    for rank in range(dp):
        rank_batches = list(eval_batches(windows, local, -1, rank, dp))
        batches.add(len(rank_batches))
        for inputs, labels in rank_batches:
            assert inputs.shape == labels.shape == (local, 5)
            for x, y in zip(inputs, labels):
                if (y != IGNORE).any():
                    seen.append(int(x[0]) // 10)
                else:
                    assert (x == 0).all()  # padding rows: token 0, every label ignored
    assert len(batches) == 1  # every rank runs the same number of batches
    assert sorted(seen) == list(range(13))


def test_steps_bound_the_windows_evaluated():
    windows = [torch.arange(6) for _ in range(40)]
    counted = sum(int((y != IGNORE).sum()) for _, y in eval_batches(windows, 4, 3, 0, 1))
    assert counted == 3 * 4 * 5


def test_validation_loss_is_the_token_mean_over_all_windows():
    torch.manual_seed(0)
    model = build_model("gpt2", "debug", 300, 16)
    init_weights(model, 0)
    windows = [torch.randint(0, 300, (17,)) for _ in range(11)]  # 11 windows: the last batch of 4 is padded
    result = Validator(RankModel([model], torch.device("cpu")), windows, EvalBatches(local_batch_size=4)).run()
    batch = torch.stack(windows)
    with torch.no_grad():
        expected = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).item()
    assert result["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert result["val_tokens"] == 11 * 16
    assert result["val_perplexity"] == pytest.approx(np.exp(expected), rel=1e-6)
    assert model.training  # back in training mode


def test_a_held_out_split_too_small_for_a_window_is_one_line():
    store = TokenStore([np.arange(100, dtype=np.uint16)], label="the corpus 'x'")
    with pytest.raises(ConfigError, match="holds out 5 tokens, too few for one window of validation.seq_len=32"):
        validation_windows([store], [95], 32)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--validation.freq", "0"], "validation.freq=0 must be at least 1"),
        (["--validation.steps", "0"], "validation.steps=0 must be at least 1, or -1"),
        (["--validation.split_fraction", "1"], "validation.split_fraction=1.0 must be in [0, 1)"),
        (["--validation.enable", "--validation.split_fraction", "0"], "validation.enable needs held-out data"),
        (["--validation.dataset", "local"], "validation.dataset='local' needs validation.dataset_path"),
    ],
)
def test_bad_validation_settings_are_one_line(args, fragment):
    with pytest.raises(ConfigError) as e:
        parse_config(args)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_pipeline_needs_validation_batches_it_can_cut_into_micro_batches():
    cfg = parse_config(
        [
            "--validation.enable",
            "--validation.local_batch_size",
            "6",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
        ]
    )
    with pytest.raises(ConfigError, match="set validation.local_batch_size to a multiple of 4"):
        plan_run(cfg, 2)

"""`titanlite plan` and the chunked loss (titanlite/components/loss.py): estimates only, on the meta device (the
measured comparison is in tests/distributed/test_plan_measure.py, marked slow)."""

import pytest

from titanlite.builder.estimate import estimate, setting_for
from titanlite.builder.layouts import layout_of
from titanlite.builder.model_facts import model_facts
from titanlite.builder.plan import plan_model
from titanlite.config import parse_config

LONG = ["--config", "train_configs/debug_model.toml", "--training.seq_len", "1024", "--training.local_batch_size", "4"]


def estimates(extra: list[str], ngpu: int = 1, device: str = "cpu"):
    cfg = parse_config([*LONG, *extra])
    model = plan_model(cfg)
    lay = layout_of(cfg, ngpu, model)
    s = setting_for(cfg, lay, ngpu, device)
    facts = model_facts(cfg, model)
    return facts, s, estimate(facts, lay, s)


def test_chunked_loss_estimate_drops_by_about_the_logits():
    facts, chunked_s, chunked = estimates([])  # loss_chunk_tokens -1: auto, chunks of 4096 without compile
    _, full_s, full = estimates(["--training.loss_chunk_tokens", "0"])
    assert (chunked_s.loss_chunk, full_s.loss_chunk) == (4096, 0)
    logits = 4 * 1024 * facts.vocab * 4  # [4, 1024, vocab] float32: 786 MiB
    # full logits: saved log-probabilities (activations) + the gradients of log-probs and logits (temporary);
    # one chunk of all 4096 tokens: its logits and log-probabilities at once, nothing full-size saved
    loss_full = full["activations"] + full["temporary"]
    loss_chunked = chunked["activations"] + chunked["temporary"]
    assert loss_full - loss_chunked == pytest.approx(logits, rel=0.03)
    assert full["peak"] - chunked["peak"] == pytest.approx(logits, rel=0.03)
    assert chunked["activations"] < full["activations"] - 0.9 * logits  # no full-vocabulary tensor saved
    # smaller chunks: the transient shrinks with the chunk (the logits and log-probabilities, 2 blocks of
    # [chunk, vocab] float32; each chunk's blocks are freed before the next; measured: 316.3 MiB peak)
    _, _, small = estimates(["--training.loss_chunk_tokens", "512"])
    assert small["temporary"] == pytest.approx(2 * 512 * facts.vocab * 4, rel=1e-6)
    # TP splits the chunk's vocabulary even without loss parallelism
    _, tp_s, tp = estimates(["--parallelism.tensor_parallel_degree", "2", "--parallelism.disable_loss_parallel"], 2)
    assert tp_s.loss_chunk == 4096 and not tp_s.loss_parallel
    assert tp["temporary"] < 0.8 * chunked["temporary"]


def test_compiled_loss_resolves_auto_to_full_logits(capsys):
    from titanlite.tools.plan import plan

    _, s, _ = estimates(["--compile.enable", "--compile.components", "loss"])
    assert s.loss_chunk == 0
    assert plan([*LONG, "--ngpu", "1", "--device", "cpu"]) == 0
    assert "; chunked loss, 4096 tokens a chunk" in capsys.readouterr().out.splitlines()[0]
    assert plan([*LONG, "--ngpu", "1", "--device", "cpu", "--training.loss_chunk_tokens", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("; full-logits loss")

"""lm-eval's side of downstream tasks, without a model: what titanlite's LM hands lm-eval and takes from it, that a
scoring leaves every random state as it was, the logged names, and the one-line refusals before launch (`titanlite
check` and `titanlite eval --tasks`, in this process)."""

from __future__ import annotations

import json
import random
import sys
import threading

import numpy as np
import pytest
import torch

from tests.helpers import SUMS, TASKS, TEXTS, write_tasks
from titanlite.config import Downstream
from titanlite.data.tokenizer import ByteTokenizer
from titanlite.engine.downstream import metric_values, score_tasks, task_manager, titanlite_lm


class Answers:
    """A Scorer's interface with made-up answers: each continuation's log-likelihood is minus its length (the shortest
    choice wins), greedy when it is one id; a generation is the sum's answer, then a new line and more text."""

    def __init__(self) -> None:
        self.requests: list[tuple[list[int], list[int]]] = []
        self.prompts: list[list[int]] = []

    def loglikelihoods(self, requests):
        self.requests += requests
        return [(-float(len(continuation)), len(continuation) == 1) for _, continuation in requests]

    def greedy_texts(self, prompts, max_new, decode, stops, vocab_size, eot_id, sampling=None):
        self.prompts += prompts
        answers = {f"{q}=": a for q, a in SUMS}
        return ["9" if answer == "8" else answer for answer in (answers[decode(p)] for p in prompts)]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("tasks"))


def test_a_scoring_reads_lm_evals_requests_and_leaves_every_random_state_as_it_was(tasks):
    d = Downstream(tasks=TASKS.split(","), include_path=str(tasks))
    scorer, tok = Answers(), ByteTokenizer()
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    before = random.random(), np.random.rand(), torch.rand(1).item()
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    threads = {t.name for t in threading.enumerate()}
    results = score_tasks(titanlite_lm(scorer, tok, max_length=32), d, task_manager(d))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == before  # lm-eval seeded all three inside
    assert {t.name for t in threading.enumerate()} == threads  # no progress bar's monitor left behind
    values = metric_values(results)
    # the shortest choice in bytes (the first of a tie) is right for 2 of the 6 questions: " red" and " a key"
    assert values["downstream/tl_choice/acc"] == pytest.approx(2 / 6)
    assert values["downstream/tl_sum/exact_match"] == pytest.approx(3 / 4)  # "8" came back as "9"
    assert set(values) == {
        "downstream/tl_choice/acc",
        "downstream/tl_choice/acc_norm",
        "downstream/tl_text/word_perplexity",
        "downstream/tl_text/bits_per_byte",
        "downstream/tl_sum/exact_match",
    }
    # lm-eval's split: the context's trailing space moves to the continuation; a rolling window of 32 ids at most,
    # the first conditioned on the end-of-text id (the byte tokenizer has no BOS)
    assert (tok.encode("Question: Which is a colour?\nAnswer:"), tok.encode(" red")) in scorer.requests
    for text in TEXTS:
        assert ([tok.eot_id], tok.encode(text)[:32]) in scorer.requests
    assert max(len(continuation) for _, continuation in scorer.requests) == 32
    assert scorer.prompts == [tok.encode(f"{q}=") for q, _ in SUMS]


def test_metric_names_keep_a_filter_other_than_none():
    results = {"results": {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.5, "exact_match_stderr,strict-"
                                      "match": 0.1, "exact_match,flexible-extract": 0.75}}}  # fmt: skip
    assert metric_values(results) == {
        "downstream/gsm8k/exact_match_strict-match": 0.5,
        "downstream/gsm8k/exact_match_flexible-extract": 0.75,
    }


def undecodable_tokenizer(folder):
    """A Hugging Face tokenizer folder whose tokenizer.json has no decoder: ids cannot become text again."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate("2 3 + = 5 the a".split())}}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder


@pytest.mark.parametrize(
    "case",
    ["unknown task", "include path", "interval 0", "interval past the run", "no lm-eval", "documents", "no decoder"],
)
def test_what_cannot_be_scored_is_one_line_before_launch(case, tasks, cli, monkeypatch, tmp_path):
    args = ["--job.dump_folder", str(tmp_path / "runs"), "--training.steps", "5", "--training.seq_len", "32"]
    args += ["--downstream.include_path", str(tasks), "--downstream.interval", "5"]
    named = "tl_choice"
    if case == "unknown task":
        named, words = "tl_choise", ["neither lm-eval nor downstream.include_path=", "has a task 'tl_choise'; did you"]
    elif case == "include path":
        args += ["--downstream.include_path", str(tasks / "tl_sum.yaml")]
        words = ["downstream.include_path=", "is not a folder"]
    elif case == "interval 0":
        args += ["--downstream.interval", "0"]
        words = ["downstream.interval=0 must be at least 1"]
    elif case == "interval past the run":
        args += ["--downstream.interval", "6"]
        words = ["downstream.interval=6 is past the run's last step (training.steps=5)"]
    elif case == "no lm-eval":
        monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed: its import fails
        words = ["downstream tasks need lm-evaluation-harness", "pip install -e '.[eval]'"]
    elif case == "documents":
        lost = tmp_path / "lost_task.yaml"  # its documents are not where it says (a hub dataset offline fails alike,
        lost.write_text(  # after datasets' own retries)
            (tasks / "tl_sum.yaml").read_text().replace("tl_sum", "tl_lost").replace(str(tasks), str(tmp_path / "gone"))
        )
        named, words = str(lost), ["cannot load their documents", "use local tasks"]
    else:
        folder = undecodable_tokenizer(tmp_path / "tokenizer")
        args += ["--model.tokenizer", "hf", "--model.hf_assets_path", str(folder)]
        named, words = "tl_sum", ["downstream task tl_sum generates text", "cannot turn ids back into text"]
    proc = cli("check", *args, "--downstream.tasks", named)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert lines[0].startswith("titanlite: error: ") and all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "runs").exists()  # nothing written


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--limit", "5"], "eval --limit applies to downstream tasks; name them with --tasks T1,T2"),
        (["--tasks", "tl_choice", "--log-samples"], "eval --log-samples writes lm-eval's samples into --output F.json"),
        (["--tasks", "tl_choice", "--num-fewshot", "-3"], "eval --num-fewshot must be at least -1, not -3"),
    ],
)
def test_evals_task_options_that_cannot_work_are_one_line(argv, words, cli, tmp_path):
    proc = cli("eval", "--job.dump_folder", str(tmp_path / "runs"), *argv)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("titanlite: error: ") and words in lines[0], lines[0]
    assert not (tmp_path / "runs").exists()

"""Downstream tasks with lm-evaluation-harness (lm-eval): a titanlite model as lm-eval's model, on any layout.

lm-eval owns the tasks: their documents, prompts, few-shot examples, the split of each request into context and
continuation (its TemplateLM), and the metrics (acc, acc_norm, perplexities, bits per byte, exact match). titanlite
answers the requests (titanlite/engine/scorer.py): log-likelihoods on the run's layout, rolling windows of the run's
length for perplexity tasks, greedy generations over a KV cache. Every process runs lm-eval whole on every request
(lm-eval's own rank 0 of 1): the Scorer splits each batch of requests over the data-parallel ranks and gives every
rank every answer, so every rank computes the same results and the layouts' collectives stay in step.

lm-eval is the optional extra `eval`: this module imports it only inside the functions that need it, so a run
without downstream tasks never loads it (a second and a half).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import io
import json
import logging
import os
import random
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import tqdm

from titanlite.base.errors import ConfigError, short_reason
from titanlite.config import Downstream
from titanlite.data.tokenizer import Tokenizer
from titanlite.engine.decoding import Sampling
from titanlite.engine.scorer import Scorer

logger = logging.getLogger(__name__)

INSTALL = "install it with `pip install -e '.[eval]'` (or `pip install lm-eval`)"
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's own default for a generate_until task that names none
PROGRESS_BAR = re.compile(r"\r|\d+%\||\bit/s\]|examples/s\]")  # a tqdm bar's line
GENERATION_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k"}


def lm_eval_modules():
    """lm-eval's evaluator, task manager and model base class, or one line saying how to install it."""
    try:
        # the optional extra, imported only where tasks are scored or checked (a second and a half)
        from lm_eval import evaluator, tasks, utils
        from lm_eval.api import model
    except ImportError as e:
        raise ConfigError(f"downstream tasks need lm-evaluation-harness, which does not import ({e}); {INSTALL}") from e
    return evaluator, tasks, utils, model


@contextlib.contextmanager
def lm_eval_quiet() -> Iterator[None]:
    """lm-eval's and datasets' progress bars kept off the terminal (every rank would draw them: tqdm reads its
    TQDM_DISABLE only when imported) and their info lines silent while lm-eval runs; whatever else they write to
    stderr (warnings) is passed on after the block. The loggers' levels are put back."""
    loggers = [logging.getLogger(name) for name in ("lm_eval", "lm-eval", "datasets")]
    levels = [one.level for one in loggers]
    for one in loggers:
        one.setLevel(logging.WARNING)
    captured = io.StringIO()
    # tqdm's documented switch for its monitor thread, which a bar would otherwise start and leave running
    monitor, tqdm.tqdm.monitor_interval = tqdm.tqdm.monitor_interval, 0
    try:
        with contextlib.redirect_stderr(captured):
            yield
    finally:
        tqdm.tqdm.monitor_interval = monitor
        for one, level in zip(loggers, levels):
            one.setLevel(level)
        kept = [line for line in captured.getvalue().split("\n") if line and not PROGRESS_BAR.search(line)]
        if kept:
            print("\n".join(kept), file=sys.stderr)


@contextlib.contextmanager
def one_process_to_lm_eval() -> Iterator[None]:
    """LOCAL_RANK=0 while lm-eval runs, then as it was. Every titanlite process is lm-eval's rank 0 of 1 (the Scorer
    shares the work), but lm-eval returns its results only where LOCAL_RANK is 0 (for a model it splits over a
    node's torchrun processes itself): every rank gets them, as every rank needs them."""
    kept = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    try:
        yield
    finally:
        if kept is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = kept


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Python's, numpy's and torch's random states as they were before the block: lm-eval seeds all three."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def is_task_file(name: str) -> bool:
    return name.endswith((".yaml", ".yml"))


def task_specs(d: Downstream) -> list[str]:
    """downstream.tasks as lm-eval takes them: names, and YAML files as absolute paths (which must exist)."""
    specs = []
    for name in d.tasks:
        if is_task_file(name):
            path = Path(name).expanduser()
            if not path.is_file():
                raise ConfigError(f"downstream.tasks names the file {name}, which does not exist; fix the path")
            name = str(path.resolve())
        specs.append(name)
    return specs


def task_manager(d: Downstream):
    """lm-eval's index of the tasks downstream.tasks may name: those under downstream.include_path alone where they are
    all there (or YAML files), else lm-eval's own too (reading its thousands of YAML files takes seconds)."""
    if d.include_path and not Path(d.include_path).expanduser().is_dir():
        raise ConfigError(
            f"downstream.include_path={d.include_path!r} is not a folder; name the folder that holds your task "
            "YAML files"
        )
    include = str(Path(d.include_path).expanduser().resolve()) if d.include_path else None
    lm_eval_modules()  # one line where lm-eval cannot be imported, before anything else is looked at
    names = [spec for spec in task_specs(d) if not is_task_file(spec)]
    if include is not None or not names:
        local = _task_index(include, False)
        if all(name in local.all_tasks for name in names):
            return local
    return _task_index(include, True)


@functools.lru_cache(maxsize=8)
def _task_index(include: str | None, defaults: bool):
    """lm-eval's TaskManager over `include` (and its own tasks, `defaults`), made once per process: a process that
    scores again (every interval, or a test's next layout) reads no YAML file twice."""
    _, tasks, _, _ = lm_eval_modules()
    with lm_eval_quiet():
        return tasks.TaskManager(include_path=include, include_defaults=defaults)


def check_tasks(d: Downstream, tokenizer: Tokenizer, manager=None) -> dict[str, str]:
    """Refuse, before launch, tasks that cannot be scored: lm-eval missing, an unknown task (naming the nearest ones
    lm-eval knows), documents that cannot load (offline, say), a generation task whose tokenizer cannot decode. Loads
    each task's documents (datasets caches them for the run). Returns each task's output type by name."""
    manager = manager or task_manager(d)
    known = set(manager.all_tasks)
    for spec in task_specs(d):
        if not is_task_file(spec) and spec not in known:
            near = difflib.get_close_matches(spec, sorted(known), n=3, cutoff=0.75)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            where = f"neither lm-eval nor downstream.include_path={d.include_path!r}" if d.include_path else "lm-eval"
            raise ConfigError(
                f"downstream.tasks: {where} has a task {spec!r}{hint} (`lm-eval ls tasks` lists lm-eval's; a task of "
                "your own is a YAML file named in downstream.tasks or found in downstream.include_path)"
            )
    loaded = load_tasks(d, manager)
    kinds = {}
    for name, task in loaded.items():
        kinds[name] = task.OUTPUT_TYPE
        if task.OUTPUT_TYPE == "generate_until" and not tokenizer.decodes:
            raise ConfigError(
                f"downstream task {name} generates text, and model.tokenizer={tokenizer.name!r} cannot turn ids back "
                "into text (its tokenizer.json has no decoder); use a tokenizer with one, or leave the task out"
            )
    return kinds


def load_tasks(d: Downstream, manager) -> dict[str, Any]:
    """Every task downstream.tasks names (a group's members one by one), by name, its documents loaded; one line where
    any cannot load."""
    try:
        with lm_eval_quiet():
            return dict(manager.load(task_specs(d))["tasks"])
    except ConfigError:
        raise
    except Exception as e:
        offline = " (offline: HF_DATASETS_OFFLINE is set)" if os.environ.get("HF_DATASETS_OFFLINE") == "1" else ""
        raise ConfigError(
            f"downstream.tasks {d.tasks} cannot load their documents{offline}: {short_reason(e)}; on a machine without "
            "the hub, use local tasks (a YAML file whose dataset_path is 'json' with data_files, docs/evaluation.md)"
        ) from e


def titanlite_lm(scorer: Scorer, tokenizer: Tokenizer, max_length: int):
    """lm-eval's model over `scorer`: its TemplateLM (lm-eval's split of each request into context and continuation
    ids, as its `hf` model makes it) with titanlite answering the token requests."""
    _, _, utils, model = lm_eval_modules()
    template: Any = model.TemplateLM  # lm-eval ships no type information

    class TitanliteLM(template):
        """lm-eval's view of a titanlite model: rank 0 of 1 on every process (the Scorer shares the work)."""

        def __init__(self) -> None:
            super().__init__()
            self.max_length = max_length

        @property
        def eot_token_id(self) -> int:
            return tokenizer.eot_id

        @property
        def prefix_token_id(self) -> int:
            # what an empty context is conditioned on, as lm-eval's hf model takes it: BOS where there is one
            return tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eot_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            return tokenizer.encode(string)

        def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
            return tokenizer.decode(tokens)

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood(requests, disable_tqdm=True)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            return scorer.loglikelihoods([(context, continuation) for _, context, continuation in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            """A document's log-likelihood: its tokens in disjoint windows of max_length, each conditioned on the
            tokens before it (lm-eval's rolling windows, the first on the prefix token), all scored in one go."""
            windows, owners = [], []
            for index, (text,) in enumerate(req.args for req in requests):
                rolling = utils.get_rolling_token_windows(
                    token_list=tokenizer.encode(text), prefix_token=self.prefix_token_id, max_seq_len=max_length,
                    context_len=1,
                )  # fmt: skip
                for window in map(utils.make_disjoint_window, rolling):
                    windows.append(window)
                    owners.append(index)
            totals = [0.0] * len(requests)
            for owner, (log_prob, _) in zip(owners, scorer.loglikelihoods(windows)):
                totals[owner] += log_prob
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            """Each context continued greedily until one of its stop strings (cut there), its max_gen_toks or the
            end-of-text; the context loses its first ids where it and the new ones would not fit in max_length."""
            prompts, limits, stops = [], [], []
            sampling = None
            for context, kwargs in (req.args for req in requests):
                kwargs = dict(kwargs or {})
                unknown = sorted(set(kwargs) - GENERATION_KEYS)
                if unknown:
                    raise ValueError(
                        f"generation settings {unknown} are not supported by titanlite's decoding (it takes "
                        f"{sorted(GENERATION_KEYS)}): the task would be scored on generations it did not ask for"
                    )
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                limit = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
                if kwargs.get("do_sample") and float(kwargs.get("temperature", 1.0)) > 0:
                    sampling = Sampling(float(kwargs.get("temperature", 1.0)), int(kwargs.get("top_k") or 0))
                room = max(max_length - limit, 1)
                prompts.append(tokenizer.encode(context)[-room:])
                limits.append(limit)
                stops.append(until)
            return scorer.greedy_texts(
                prompts, limits, tokenizer.decode, stops, tokenizer.vocab_size, tokenizer.eot_id, sampling
            )

    return TitanliteLM()


def score_tasks(lm, d: Downstream, manager, bootstrap_iters: int = 0, log_samples: bool = False) -> dict[str, Any]:
    """lm-eval's results for downstream.tasks (its simple_evaluate: the dict its CLI writes as JSON; with
    `log_samples`, every document's requests and answers under "samples"), with the process's random states kept."""
    evaluator, _, _, _ = lm_eval_modules()
    with rng_kept(), lm_eval_quiet(), one_process_to_lm_eval():
        return evaluator.simple_evaluate(
            model=lm,
            tasks=task_specs(d),
            num_fewshot=None if d.num_fewshot < 0 else d.num_fewshot,
            limit=d.limit or None,
            task_manager=manager,
            bootstrap_iters=bootstrap_iters,
            log_samples=log_samples,
        )


def metric_values(results: dict[str, Any]) -> dict[str, float]:
    """Each task's (and group's) metrics as downstream/<task>/<metric> (a filter other than lm-eval's 'none' joins the
    metric's name: exact_match_strict-match), standard errors left out."""
    values = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, flt = key.partition(",")
            if not flt or "_stderr" in metric or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name = metric if flt == "none" else f"{metric}_{flt}"
            values[f"downstream/{task}/{name}"] = float(value)
    return values


def results_table(results: dict[str, Any]) -> str:
    """lm-eval's own table of the results (and of the groups, where there are any)."""
    _, _, utils, _ = lm_eval_modules()
    table = utils.make_table(results)
    if results.get("groups"):
        table += "\n" + utils.make_table(results, "groups")
    return table


class InLoopScoring:
    """[downstream] during training: the tasks scored on the training layout, in eval mode, after the step's time is
    taken, with the random states kept; rank 0 prints one line per scoring."""

    def __init__(self, lm, d: Downstream, manager, speaks: bool):
        self.lm, self.d, self.manager, self.speaks = lm, d, manager, speaks
        self.interval = d.interval

    def run(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        values = metric_values(score_tasks(self.lm, self.d, self.manager))
        seconds = time.perf_counter() - start
        if self.speaks:
            figures = "  ".join(f"{key.removeprefix('downstream/')} {value:.4f}" for key, value in values.items())
            logger.info(f"downstream at step {step}: {figures}  ({seconds:.1f}s)")
        return values | {"downstream_seconds": round(seconds, 3)}


def results_json(results: dict[str, Any]) -> str:
    """lm-eval's results as its CLI writes them (what JSON cannot hold, as lm-eval turns it into text)."""
    _, _, utils, _ = lm_eval_modules()
    return json.dumps(results, indent=2, default=utils.handle_non_serializable, ensure_ascii=False) + "\n"

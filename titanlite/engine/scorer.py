"""Scoring token requests on this rank's model, on any layout: what lm-eval's requests reduce to.

A log-likelihood request is a context and a continuation of token ids; its answer is the continuation's summed
log-probability and whether every continuation token is the most likely one there. Requests are sorted by length
(longest first) and cut into global batches of `rows` x dp rows, one request per row, right-padded; dp rank r scores
rows r*rows .. of each, so every rank runs the same number of forwards, as FSDP, TP and PP need. The run's own
forward computes each batch (the pipeline's eval path under PP, this rank's share of the sequence under CP) and the
loss's output (logits, split by vocabulary under loss parallelism, or hidden states for the chunked head) is scored
at the targets only (titanlite/components/loss.py TokenScores). Each rank's rows go into one tensor of every
request's figures, summed once over the pipeline and the dp x cp ranks at the end: every rank returns them all.

Generation requests decode greedily over a KV cache (titanlite/engine/decoding.py) on a whole copy of the model that
every rank gathers from the layout (`plain`), each rank a share of the requests, the texts then shared by all.
Scoring runs without gradients, in eval mode, and draws no random numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from titanlite.components.loss import IGNORE, TokenScores
from titanlite.engine.decoding import Sampling, generate
from titanlite.engine.trainer import RankModel
from titanlite.models.common.interface import DecoderModule

Request = tuple[list[int], list[int]]  # (context ids, continuation ids)


@dataclass(frozen=True)
class ScoringShape:
    """The shape of each forward: `rows` requests per dp rank, at most `max_len` input tokens (the run's window; a
    longer request loses its first tokens, as lm-eval's models truncate), the length a multiple of `multiple` (what
    context parallelism's halves and tensor parallelism's sequence shards need) or, `fixed`, always max_len (a
    pipeline's stages and compiled graphs keep their shapes)."""

    rows: int
    max_len: int
    multiple: int = 1
    fixed: bool = False

    def length(self, longest: int) -> int:
        if self.fixed:
            return self.max_len
        return min(self.max_len, math.ceil(longest / self.multiple) * self.multiple)


class Scorer:
    """Answers token requests with this rank's model parts; every rank gets every answer. `plain`: the whole model
    (DecoderModule) on this rank's device with the layout's weights gathered, for generation."""

    def __init__(
        self,
        model: RankModel,
        scores: TokenScores,
        shape: ScoringShape,
        dp_rank: int = 0,
        dp_degree: int = 1,
        plain: Callable[[], DecoderModule] | None = None,
    ):
        self.model, self.scores, self.shape = model, scores, shape
        self.dp_rank, self.dp_degree, self.plain = dp_rank, dp_degree, plain
        self.forwards = 0  # forwards run so far (the benchmark's count)
        self.requests = 0  # log-likelihood requests (rolling windows each count) and generations answered so far

    def window(self, context: list[int], continuation: list[int]) -> tuple[list[int], int]:
        """The request's input ids (context and continuation but the last id, the first ones dropped past max_len)
        and how many of its last positions are scored."""
        ids = (context + continuation)[-(self.shape.max_len + 1) :]
        return ids, min(len(continuation), len(ids) - 1)

    @torch.no_grad()
    def loglikelihoods(self, requests: Sequence[Request]) -> list[tuple[float, bool]]:
        """(summed log-probability, greedy) of each request's continuation given its context."""
        windows = [self.window(c, x) for c, x in requests]
        self.requests += len(requests)
        order = sorted(range(len(requests)), key=lambda i: (-len(windows[i][0]), i))
        per_batch = self.shape.rows * self.dp_degree
        figures = torch.zeros(max(len(order), 1) + per_batch, 2, dtype=torch.float64, device=self.model.device)
        for part in self.model.parts:
            part.eval()
        try:
            for first in range(0, len(order), per_batch):
                batch = order[first : first + per_batch]
                width = self.shape.length(max(len(windows[i][0]) - 1 for i in batch))
                mine = batch[self.dp_rank * self.shape.rows : (self.dp_rank + 1) * self.shape.rows]
                inputs = torch.zeros(self.shape.rows, width, dtype=torch.long)
                labels = torch.full((self.shape.rows, width), IGNORE, dtype=torch.long)
                for row, i in enumerate(mine):
                    ids, scored = windows[i]
                    n = len(ids) - 1
                    inputs[row, :n] = torch.tensor(ids[:-1])
                    labels[row, n - scored : n] = torch.tensor(ids[n - scored + 1 :])
                rows = self.forward(inputs.to(self.model.device), labels.to(self.model.device))
                start = first + self.dp_rank * self.shape.rows
                figures[start : start + self.shape.rows] = rows
                self.forwards += 1
        finally:
            for part in self.model.parts:
                part.train()
        if self.model.pipeline is not None:  # only the last stage has figures
            dist.all_reduce(figures, group=self.model.pipeline.group)
        if self.model.loss_group is not None:  # dp ranks hold other rows, cp ranks parts of the same
            dist.all_reduce(figures, group=self.model.loss_group)
        values = figures.tolist()
        answers: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for position, i in enumerate(order):
            log_prob, missed = values[position]
            answers[i] = (log_prob, missed == 0)
        return answers

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[rows, 2]: each row's summed log-probability and count of targets that are not the argmax (this rank's
        part of the sequence under CP; zeros on a pipeline rank without the last stage)."""
        self.model.new_graph_round()
        p = self.model.pipeline
        if p is None:
            output, labels = self.model.forward(inputs, labels)
            with self.model.autocast(), self.model.loss_context():
                return self.scores(output, labels)
        inputs, labels, sequence = self.model.pipeline_split(inputs, labels)
        parts: list[torch.Tensor] = []
        with self.model.autocast(), self.model.loss_context(), p.loss.replaced(self.scores):
            p.run(p.schedule.eval, inputs, labels, parts, sequence)
        if not p.has_last:
            return torch.zeros(inputs.shape[0], 2, dtype=torch.float64, device=self.model.device)
        return torch.cat(parts)

    @torch.no_grad()
    def greedy_texts(
        self,
        prompts: Sequence[list[int]],
        max_new: Sequence[int],
        decode: Callable[[list[int]], str],
        stops: Sequence[Sequence[str]],
        vocab_size: int,
        eot_id: int | None,
        sampling: Sampling | None = None,
    ) -> list[str]:
        """Each prompt's continuation as text, greedy (or `sampling`), up to max_new ids, cut before the first of its
        stop strings (lm-eval's `until`); rank r decodes prompts r, r + world, ... on the gathered whole model."""
        if self.plain is None:
            raise RuntimeError("this Scorer was built without a whole model to generate with")
        model = self.plain().eval()
        self.requests += len(prompts)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        mine = {}
        for i in range(rank, len(prompts), world):

            def stopped(new_ids: list[int], stop: Sequence[str] = stops[i]) -> bool:
                text = decode(new_ids)
                return any(s and s in text for s in stop)

            result = generate(model, prompts[i], max_new[i], vocab_size, sampling or Sampling(), eot_id, until=stopped)
            text = decode([t for t in result.new_ids if t != eot_id])
            for s in stops[i]:
                if s:
                    text = text.split(s)[0]
            mine[i] = text
        del model
        shares: list[dict[int, str]] = [mine]
        if world > 1:
            shares = [{} for _ in range(world)]
            dist.all_gather_object(shares, mine)
        texts = {i: t for share in shares for i, t in share.items()}
        return [texts[i] for i in range(len(prompts))]


def gathered_state(parts: list[nn.Module], pipeline_group=None) -> dict[str, Any]:
    """The whole model's weights on every rank (full tensors, gathered from FSDP, TP and EP shards; under PP each
    stage's merged over the pipeline's ranks), keyed as the plain model names them."""
    state: dict[str, Any] = {}
    for part in parts:
        state |= get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
    if pipeline_group is not None:
        shares: list[dict] = [{} for _ in range(dist.get_world_size(pipeline_group))]
        dist.all_gather_object(shares, {k: v.cpu() for k, v in state.items()}, group=pipeline_group)
        for share in shares:
            state |= share
    return state

"""The mixture-of-experts block every MoE family shares (arguments: titanlite/models/common/moe/args.py): a router,
routed SwiGLU experts stored stacked, optional shared experts, load balancing; plain modules, no parallelism.

Routing: the router's scores are computed in float32 (softmax over all experts, or a sigmoid or sqrt(softplus) per
expert); each token takes its top_k experts, or at the hash layers those its token id's row of a fixed table names
(HashRouter), with the chosen scores (optionally renormalised, times route_scale) as the weights of their outputs.
No token is dropped. The tokens are sorted by expert and each expert's rows run as one group of
torch.nn.functional.grouped_mm (torch._grouped_mm's public name) where it runs for the device and dtype (CUDA sm90+;
the CPU in recent torch), else a loop over the experts that gives the same numbers (it reads the per-expert counts on
the host, the grouped path does not).

Balancing: with balance="aux_loss" the block adds aux_loss_coef * its load-balancing loss to the training loss as
the auxiliary term "load_balance", and with z_loss_coef > 0 the router z-loss as "router_z"
(titanlite/models/common/auxiliary.py); with balance="bias" a per-expert bias steers the choice of experts (never
the weights), moved after each step by update_balance_bias. Each block keeps the per-expert token counts of its
last forward in `tokens_per_expert` and their sum over a training step in `step_tokens`, on the device, for the
load metric and the bias update (titanlite/components/expert_balance.py).

Weights: router.gate.weight [E, dim]; experts.w1 and experts.w3 [E, hidden, dim] (gate and up), experts.w2
[E, dim, hidden] (down), each expert's matrix laid out as nn.Linear's; shared_expert.w1/w2/w3.weight and
shared_gate.weight as nn.Linear's. Each module starts its own (init_own): the stacked tensors like E linear weights
of their side (reset_parameters shows nn.Linear's own fill); moe_from_hf and moe_to_hf map one block's Hugging Face
tensors."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.models.common.auxiliary import add_auxiliary_loss
from titanlite.models.common.init_scheme import InitScheme, start_linears
from titanlite.models.common.moe.args import MoEArgs

_GROUPED_MM_RUNS: dict[tuple[str, torch.dtype], bool] = {}


def _try_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Run F.grouped_mm forward and backward once on tiny aligned tensors; False if it raises.

    In a thread of its own, whose autograd state is fresh (gradients on, no inference mode, no saved-tensor
    hooks): the first forward may run under no_grad or inference_mode, or inside activation checkpointing,
    whose hooks would count the probe's tensors in the block's forward but not in its recomputation."""
    result = [False]

    def probe() -> None:
        try:
            result[0] = _run_grouped_mm(device, dtype)
        except (RuntimeError, NotImplementedError, TypeError):
            pass

    thread = threading.Thread(target=probe, name="grouped_mm_probe")
    thread.start()
    thread.join()
    return result[0]


def _run_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    x = torch.ones(8, 8, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(2, 8, 8, device=device, dtype=dtype, requires_grad=True)
    offs = torch.tensor([3, 8], device=device, dtype=torch.int32)
    out = F.grouped_mm(x, w.transpose(-2, -1), offs=offs)
    out.backward(torch.ones_like(out))
    return True


@torch.compiler.disable
def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether F.grouped_mm runs, forward and backward, for tensors of `dtype` on `device` (tried once per
    device and dtype): on CUDA sm90+ for bfloat16; on the CPU in torch 2.9+ for float32, bfloat16 and float16."""
    key = (str(device), dtype)
    if key not in _GROUPED_MM_RUNS:
        _GROUPED_MM_RUNS[key] = device.type != "meta" and _try_grouped_mm(device, dtype)
    return _GROUPED_MM_RUNS[key]


# Why GroupedExperts loops over its experts rather than taking F.grouped_mm (loop_reason).
LOOP_CHOSEN, LOOP_COMPILED, LOOP_UNALIGNED, LOOP_UNSUPPORTED = "chosen", "compiled", "unaligned", "unsupported"


def grouped_mm_aligned(dtype: torch.dtype, *widths: int) -> bool:
    """Whether rows of these widths have 16-byte-aligned strides, as F.grouped_mm requires."""
    itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
    return all(width * itemsize % 16 == 0 for width in widths)


class Routing(NamedTuple):
    """A router's decision for N tokens: logits and scores [N, E] (float32), the chosen experts [N, k] and their
    combine weights [N, k] (float32)."""

    logits: torch.Tensor
    scores: torch.Tensor
    indices: torch.Tensor
    weights: torch.Tensor


class Router(nn.Module):
    """A linear gate dim -> n_experts; scores in float32; top-k (with n_groups > 1, among each token's topk_groups
    best groups: limit_to_groups); with balance="bias", `expert_bias` (a buffer, checkpointed) is added to the
    scores for choosing the experts only, never to the weights (DeepSeek-V3)."""

    expert_bias: torch.Tensor | None
    biased = True  # whether balance="bias" gives it an expert_bias (not where a fixed table chooses: HashRouter)

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.n_experts, bias=args.router_bias)
        if args.balance == "bias" and self.biased:
            self.register_buffer("expert_bias", torch.zeros(args.n_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """The gate input-side, its bias zero."""
        start_linears(name, full, generator, scheme, inputs=("gate",), outputs=())

    def forward(self, x: torch.Tensor) -> Routing:
        """Route x [N, dim]."""
        args = self.args
        logits = self.gate(x).float()  # [N, E]
        scores = score(logits, args.score_func)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if args.topk_groups < args.n_groups:
            choice = limit_to_groups(choice, args.n_groups, args.topk_groups)
        indices = torch.topk(choice, args.top_k, dim=-1).indices  # [N, k]
        return Routing(logits, scores, indices, combine_weights(scores, indices, args))


class HashRouter(Router):
    """DeepSeek-V4's router at its hash layers: each token's experts are the row of `tid2eid` [vocab_size, top_k]
    (int64, a checkpointed buffer) at its token id, a fixed table that a folder or checkpoint fills (`default_table`
    until then); the gate's scores, as Router's, only weight them. No balancing bias: the table, not the scores,
    chooses."""

    tid2eid: torch.Tensor
    biased = False

    def __init__(self, dim: int, args: MoEArgs, vocab_size: int):
        super().__init__(dim, args)
        self.register_buffer("tid2eid", torch.zeros(vocab_size, args.top_k, dtype=torch.int64))
        self.default_table()

    @torch.no_grad()
    def default_table(self) -> None:
        """The table of a model started from scratch (a folder or checkpoint replaces it): token v's experts are
        (v * 2654435761 + j) mod n_experts for j < top_k, distinct in each row and (the multiplier odd, a bijection
        of the residues for a power-of-two expert count) each expert chosen by as many ids as any other, give or take
        one; fixed, as DeepSeek-V4's tables are, and the same on every rank and layout."""
        ids = torch.arange(self.tid2eid.shape[0], device=self.tid2eid.device, dtype=torch.int64)[:, None]
        choices = torch.arange(self.args.top_k, device=ids.device, dtype=torch.int64)[None, :]
        self.tid2eid.copy_((ids * 2654435761 + choices) % self.args.n_experts)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> Routing:
        """Route x [N, dim] by the token ids `tokens` [N] (required; optional in the signature only to keep
        Router's)."""
        if tokens is None:
            raise ValueError("a hash-routed MoE block (MoEArgs.hash_layers) needs the token ids: forward(x, tokens)")
        logits = self.gate(x).float()  # [N, E]
        scores = score(logits, self.args.score_func)
        indices = self.tid2eid[tokens]  # [N, k]
        return Routing(logits, scores, indices, combine_weights(scores, indices, self.args))


def score(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """The router's scores [N, E] of float32 `logits` by MoEArgs.score_func."""
    if score_func == "softmax":
        return logits.softmax(dim=-1)
    if score_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits.sigmoid()


def combine_weights(scores: torch.Tensor, indices: torch.Tensor, args: MoEArgs) -> torch.Tensor:
    """The chosen experts' scores [N, k], renormalised with norm_topk_prob, times route_scale."""
    weights = scores.gather(-1, indices)
    if args.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if args.route_scale != 1.0:
        weights = weights * args.route_scale
    return weights


def check_hash_table(table: torch.Tensor, n_experts: int, top_k: int) -> str | None:
    """Why `table` cannot be a HashRouter's tid2eid for n_experts experts and top_k choices (a one-line reason), or
    None: it must be [vocab_size, top_k] of expert indices 0 .. n_experts - 1."""
    if table.ndim != 2 or table.shape[1] != top_k:
        return f"tid2eid has shape {list(table.shape)}; it must be [vocab_size, top_k={top_k}]"
    if table.is_floating_point() or table.is_complex():
        return f"tid2eid holds {table.dtype}; it must hold integer expert indices"
    if not table.numel():
        return None
    smallest, largest = int(table.min()), int(table.max())
    if smallest < 0:
        return f"tid2eid holds expert index {smallest}; expert indices start at 0"
    if largest >= n_experts:
        return (
            f"tid2eid holds expert index {largest}; the block has n_experts={n_experts} (indices 0 .. {n_experts - 1})"
        )
    return None


def limit_to_groups(choice: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """choice [N, E] with the experts outside each token's topk_groups best groups set to -inf: a group's score is
    the sum of its two best choice scores (DeepSeek-V3's group-limited routing, "noaux_tc")."""
    grouped = choice.unflatten(-1, (n_groups, -1))  # [N, G, E/G]
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(-1, group_scores.topk(topk_groups, dim=-1).indices, True)
    return grouped.masked_fill(~kept[..., None], float("-inf")).flatten(-2)


def load_balancing_loss(
    scores: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    args: MoEArgs,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The Switch Transformer loss over one block's N tokens: n_experts * sum_i f_i * P_i, f_i the fraction of
    tokens routed to expert i (the k choices count each; the f_i sum to k) and P_i its mean router probability
    (scores that are not a softmax, sigmoid's and sqrtsoftplus's, normalised per token to sum to 1). Gradients reach
    the router through P alone, as in transformers' load_balancing_loss_func, which this equals for one layer's
    logits. `reduce` sums the statistics [3, E] (counts, probability sums, N) over the ranks that hold the rest of the
    micro-batch (MoE.reduce), so that f and P are the whole micro-batch's, as in one process."""
    probs = scores if args.score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    counts = counts.float()
    totals = torch.stack([counts, probs.sum(dim=0), torch.full_like(counts, indices.shape[0])])
    if reduce is not None:
        totals = reduce(totals)
    n_tokens = totals[2, 0].detach()
    fraction = totals[0].detach() / n_tokens  # [E]
    mean_prob = totals[1] / n_tokens  # [E]
    return args.n_experts * (fraction * mean_prob).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """The mean over tokens of logsumexp(router logits)^2 (ST-MoE; OLMoE's router z-loss): keeps logits small."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The experts' usual activation: silu(gate) * up."""
    return F.silu(gate) * up


@dataclass(frozen=True)
class LimitedSwiGLU:
    """DeepSeek-V4's experts' activation (MoEArgs.swiglu_limit): silu of the gate clamped above at `limit`, times
    the up projection clamped to +-limit. Not gpt-oss's ClampedSwiGLU, which adds one to up and gates by
    sigmoid(alpha * gate)."""

    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts' activation: the gate clamped above at `limit`, the up projection to +-limit, then
    (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(self.alpha * gate))


def relu_squared(up: torch.Tensor) -> torch.Tensor:
    """The ungated experts' activation (Nemotron-H's): relu(up)^2."""
    return torch.square(F.relu(up))


class GroupedExperts(nn.Module):
    """n_experts gated feed-forwards stored stacked: w1, w3 [E, hidden, dim] (gate, up), w2 [E, dim, hidden] (down);
    with `bias`, b1, b3 [E, hidden] and b2 [E, dim] (gpt-oss). `activation(gate, up)` makes the hidden
    activations: swiglu by default, ClampedSwiGLU for gpt-oss. Not `gated`: no w3 (nor b3), w1 the up projection and
    `activation(up)` the hidden activations (relu_squared: Nemotron-H's experts).

    forward takes the tokens sorted by expert and each expert's row count. use_grouped_mm: None chooses
    F.grouped_mm wherever it runs for the tensors (grouped_mm_runs, 16-byte-aligned widths), True insists on
    it, False always loops over the experts."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        n_experts: int,
        use_grouped_mm: bool | None = None,
        bias: bool = False,
        activation: Callable[..., torch.Tensor] = swiglu,
        gated: bool = True,
    ):
        super().__init__()
        self.use_grouped_mm = use_grouped_mm
        self.activation = activation
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim)) if gated else None
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.b1 = nn.Parameter(torch.empty(n_experts, hidden)) if bias else None
        self.b3 = nn.Parameter(torch.empty(n_experts, hidden)) if bias and gated else None
        self.b2 = nn.Parameter(torch.empty(n_experts, dim)) if bias else None

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """Gate and up (w1, w3) input-side, down (w2) residual-side, the biases zero."""
        if name in ("w1", "w3"):
            scheme.projection(full, generator)
        elif name == "w2":
            scheme.residual(full, generator)
        elif name in ("b1", "b3", "b2"):
            nn.init.zeros_(full)
        else:
            raise KeyError(f"GroupedExperts has no parameter {name!r}")

    def reset_parameters(self) -> None:
        """Each expert's matrices as nn.Linear initialises its weight, its biases zero (a run starts them by
        init_own)."""
        for w in (self.w1, self.w3, self.w2):
            if w is not None:
                bound = 1 / math.sqrt(w.shape[-1])
                nn.init.uniform_(w, -bound, bound)
        for b in (self.b1, self.b3, self.b2):
            if b is not None:
                nn.init.zeros_(b)

    def grouped(self, x: torch.Tensor) -> bool:
        """Whether forward takes F.grouped_mm for x."""
        return self.loop_reason(x.device, x.dtype, torch.compiler.is_compiling()) is None

    def loop_reason(self, device: torch.device, dtype: torch.dtype, compiling: bool) -> str | None:
        """Why forward loops over the experts for inputs of `dtype` on `device` (one of the LOOP_ reasons), or None
        where it takes F.grouped_mm; what forward chooses and the start-up line says."""
        if self.use_grouped_mm is not None:
            return None if self.use_grouped_mm else LOOP_CHOSEN
        if compiling and dtype != torch.bfloat16:
            return (
                LOOP_COMPILED  # torch's shape function for the compiler admits bfloat16 only, whatever the device runs
            )
        hidden, dim = _local(self.w1).shape[1:]  # this rank's widths (expert tensor parallelism splits hidden)
        if not grouped_mm_aligned(dtype, dim, hidden):
            return LOOP_UNALIGNED
        return None if grouped_mm_runs(device, dtype) else LOOP_UNSUPPORTED

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor, *, step: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """x [M, dim] sorted by expert, counts [E] (integers summing to M) -> [M, dim]. `step`: (the block's routed
        counts, its step total), the counts added to the total when backward reaches these weights (CountOnBackward);
        a keyword, so expert parallelism's hooks, which replace x and counts, hand it on as it is."""
        autocast = torch.amp.is_autocast_available(x.device.type) and torch.is_autocast_enabled(x.device.type)
        if autocast:  # as autocast would run the experts' matmuls (the loop's do); none on "meta" (the planner's)
            x = x.to(torch.get_autocast_dtype(x.device.type))
        # No rows at all (an expert-parallel rank no token was sent to): F.grouped_mm's backward refuses them.
        if x.shape[0] and self.grouped(x):
            return self.forward_grouped(x, counts, step)
        return self.forward_loop(x, counts, step)

    def local_weights(
        self, step: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """w1, w3 (None: ungated), w2 of the experts this rank computes: all of them, or under expert parallelism
        (whose hooks hand forward the tokens and counts of this rank's experts only) its shard of each DTensor; w1
        counting `step` on backward when given."""
        w1, w2 = _local(self.w1), _local(self.w2)
        w3 = None if self.w3 is None else _local(self.w3)
        if step is not None:
            w1 = CountOnBackward.apply(w1, *step)
        return w1, w3, w2

    def local_biases(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
        """b1, b3 (None: ungated), b2 of this rank's experts, as local_weights; None without biases."""
        if self.b1 is None or self.b2 is None:
            return None
        return _local(self.b1), None if self.b3 is None else _local(self.b3), _local(self.b2)

    def hidden(self, gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
        """The hidden activations of w1's output `gate` and w3's `up` (None: ungated, w1's output alone)."""
        return self.activation(gate) if up is None else self.activation(gate, up)

    def forward_grouped(
        self, x: torch.Tensor, counts: torch.Tensor, step: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        offs = counts.cumsum(0).to(torch.int32)  # each group's end row, on the device: no host read
        w1, w3, w2 = (None if w is None else w.to(x.dtype).transpose(-2, -1) for w in self.local_weights(step))
        assert w1 is not None and w2 is not None
        gate = F.grouped_mm(x, w1, offs=offs)  # [M, hidden]
        up = None if w3 is None else F.grouped_mm(x, w3, offs=offs)
        biases = self.local_biases()
        if biases is None:
            return F.grouped_mm(self.hidden(gate, up), w2, offs=offs)
        # each row's expert, without reading the counts on the host (output_size: the rows are known)
        expert = torch.repeat_interleave(torch.arange(counts.shape[0], device=x.device), counts, output_size=x.shape[0])
        b1, b3, b2 = (None if b is None else b.to(x.dtype)[expert] for b in biases)
        assert b1 is not None and b2 is not None
        return F.grouped_mm(self.hidden(gate + b1, None if up is None or b3 is None else up + b3), w2, offs=offs) + b2

    def forward_loop(
        self, x: torch.Tensor, counts: torch.Tensor, step: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        w1, w3, w2 = self.local_weights(step)
        biases = self.local_biases()
        b1, b3, b2 = biases if biases is not None else (None, None, None)

        def expert(rows: torch.Tensor, e: int) -> torch.Tensor:
            at = (lambda b: None) if b1 is None else (lambda b: b[e])
            up = None if w3 is None else F.linear(rows, w3[e], at(b3))
            h = self.hidden(F.linear(rows, w1[e], at(b1)), up)
            return F.linear(h, w2[e], at(b2))

        if x.device.type == "meta":  # shapes only (the planner's meta runs): no counts to read
            return expert(x, 0)
        return torch.cat([expert(rows, e) for e, rows in enumerate(torch.split(x, counts.tolist()))])


class CountOnBackward(torch.autograd.Function):
    """The identity on an expert weight, whose backward adds a block's routed token counts to its step total: how a
    training forward's counts join its step exactly once. Backward reaches the weight once per forward that is
    trained on; not for a forward whose graph is never backpropagated (activation checkpointing's recompute, whose
    graph only feeds the saved tensors), not for one differentiated for its inputs alone (a pipeline stage's shape
    inference, torch.autograd.grad with inputs=, which leaves the weights' branches out), not for evaluation (no
    graph). The gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, counts: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        ctx.counts, ctx.total = counts, total
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        with torch.no_grad():
            ctx.total += ctx.counts
        return grad, None, None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class SharedExpert(nn.Module):
    """The SwiGLU feed-forward every token goes through beside the routed experts, down(activation(gate x, up x))
    (LimitedSwiGLU where the routed experts clamp); not `gated`, down(relu(up x)^2) with w1 the up projection and no
    w3 (Nemotron-H's)."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        gated: bool = True,
        activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = swiglu,
    ):
        super().__init__()
        self.activation = activation
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate (up where not gated)
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, hidden, bias=False) if gated else None  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(relu_squared(self.w1(x)))
        return self.w2(self.activation(self.w1(x), self.w3(x)))

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        start_linears(name, full, generator, scheme, inputs=("w1", "w3"), outputs=("w2",))


class MoE(nn.Module):
    """The block: router, routed experts, optional shared expert (with Qwen2-MoE's sigmoid gate); [B, T, D] in and
    out. Adds its auxiliary loss terms inside a training step; `tokens_per_expert` [E] (int64, on the device)
    holds the routed token counts of its last forward."""

    tokens_per_expert: torch.Tensor
    step_tokens: torch.Tensor

    def __init__(
        self,
        dim: int,
        args: MoEArgs,
        use_grouped_mm: bool | None = None,
        experts: GroupedExperts | None = None,
        hash_vocab: int = 0,
    ):
        """`experts`: the routed experts where a family's differ from the plain SwiGLU ones (gpt-oss's biases and
        clamped activation); None builds those. `hash_vocab` > 0: a hash layer's block (MoEArgs.hash_layers), its
        HashRouter's table one row per token id of that vocabulary."""
        super().__init__()
        self.args = args
        self.router = HashRouter(dim, args, hash_vocab) if hash_vocab > 0 else Router(dim, args)
        gated = args.activation == "swiglu"
        width = args.latent_dim or dim  # the routed experts' (LatentMoE: between latent_down and latent_up)
        glu = LimitedSwiGLU(args.swiglu_limit) if args.swiglu_limit > 0 else swiglu
        if experts is None:
            experts = GroupedExperts(width, args.expert_dim, args.n_experts, use_grouped_mm,
                                     activation=glu if gated else relu_squared, gated=gated)  # fmt: skip
        self.latent_down = nn.Linear(dim, width, bias=False) if args.latent_dim else None
        self.experts = experts
        self.latent_up = nn.Linear(width, dim, bias=False) if args.latent_dim else None
        self.shared_expert = SharedExpert(dim, args.shared_hidden, gated, glu) if args.shared_hidden else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if args.shared_gate else None
        # Sums the load-balancing statistics, differentiably, over the ranks that hold the rest of the micro-batch
        # (the layout sets it: titanlite/parallel/parallelize.py pool_balance_over); None: this rank holds it all.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        # int64: a cast of the model to bfloat16 leaves it exact (it casts floating buffers only).
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts, dtype=torch.int64), persistent=False)
        # The counts summed over a training step's forwards, added by each forward's backward (CountOnBackward: once,
        # however often the block runs for a recompute or a pipeline's shape inference); the step's hook reads and
        # zeroes them.
        self.register_buffer("step_tokens", torch.zeros(args.n_experts, dtype=torch.int64), persistent=False)

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """The shared expert's sigmoid gate and the latent projections input-side (router, experts and shared expert
        start their own)."""
        start_linears(name, full, generator, scheme, inputs=("shared_gate", "latent_down", "latent_up"), outputs=())

    def reset_parameters(self) -> None:
        """Fill every weight as nn.Linear would (tests, and a model built outside a run's init); zero the bias."""
        self.router.gate.reset_parameters()
        self.experts.reset_parameters()
        for module in (self.shared_expert, self.shared_gate, self.latent_down, self.latent_up):
            for linear in module.modules() if module is not None else ():
                if isinstance(linear, nn.Linear):
                    linear.reset_parameters()
        if self.router.expert_bias is not None:
            self.router.expert_bias.zero_()

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]; `tokens` [B, T] (int64), the token ids a HashRouter chooses by (required
        there, ignored elsewhere)."""
        bsz, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)  # [N, D]
        route = self.route(flat, tokens)
        chosen = route.indices.reshape(-1)  # [N*k], token n's choices at n*k .. n*k+k-1
        counts = torch.zeros(self.args.n_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, chosen, torch.ones_like(chosen))  # [E], on the device (bincount would sync)
        with torch.no_grad():
            self.tokens_per_expert.copy_(counts)
        order = torch.argsort(chosen, stable=True)  # the choices sorted by expert
        token = order // self.args.top_k  # the token of each sorted choice
        # A training forward's counts join the step's when its backward reaches the experts (CountOnBackward).
        step = (counts, self.step_tokens) if torch.is_grad_enabled() else None
        rows = flat if self.latent_down is None else self.latent_down(flat)  # [N, D or latent]
        expert_out = self.experts(rows[token], counts, step=step)  # [N*k, D or latent]
        weights = route.weights.reshape(-1)[order, None]  # [N*k, 1], float32
        # The k outputs of each token are summed in float32 (as transformers does under float32 weights).
        out = torch.zeros(rows.shape, dtype=torch.float32, device=x.device)
        out = out.index_add(0, token, expert_out.float() * weights).to(x.dtype)
        if self.latent_up is not None:
            out = self.latent_up(out)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        out = self.add_balancing_terms(out, route, counts)
        return out.view(bsz, seqlen, dim)

    def route(self, flat: torch.Tensor, tokens: torch.Tensor | None) -> Routing:
        """The router's decision for flat [N, dim], a HashRouter's by `tokens` [B, T] (N = B * T)."""
        if not isinstance(self.router, HashRouter):
            return self.router(flat)
        if tokens is None or tokens.numel() != flat.shape[0]:
            shape = None if tokens is None else list(tokens.shape)
            raise ValueError(
                f"a hash-routed MoE block (MoEArgs.hash_layers) needs forward(x, tokens) with the token ids [B, T] of "
                f"its {flat.shape[0]} positions; got tokens of shape {shape}"
            )
        return self.router(flat, tokens.reshape(-1))

    def add_balancing_terms(self, out: torch.Tensor, route: Routing, counts: torch.Tensor) -> torch.Tensor:
        """out, with the block's auxiliary terms joined to the training loss (a no-op outside a training step)."""
        args = self.args
        if not torch.is_grad_enabled():
            return out
        if args.balance == "aux_loss" and args.aux_loss_coef > 0:
            aux = load_balancing_loss(route.scores, route.indices, counts, args, self.reduce)
            out = add_auxiliary_loss(out, "load_balance", args.aux_loss_coef * aux)
        if args.z_loss_coef > 0:
            out = add_auxiliary_loss(out, "router_z", args.z_loss_coef * router_z_loss(route.logits))
        return out


def expert_load(counts: torch.Tensor) -> torch.Tensor:
    """max / mean of per-expert token counts (1 when balanced), on their device: the log's expert load."""
    counts = counts.float()
    return counts.max() / counts.mean().clamp(min=1e-9)


@torch.no_grad()
def update_balance_bias(moe: MoE, counts: torch.Tensor, rate: float) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3): move each expert's routing bias by `rate` toward balance,
    up for experts that got fewer tokens than the mean, down for those that got more.

    `counts` [E] are the step's token counts per expert summed over every rank that routes tokens through this
    block: the caller all-reduces `moe.tokens_per_expert` (a sum over the data-parallel ranks) first, so every
    rank applies the same update and the replicas' biases stay equal."""
    bias = moe.router.expert_bias
    if bias is None:
        raise ValueError("update_balance_bias needs a block built with balance='bias'")
    counts = counts.float()
    bias += rate * torch.sign(counts.mean() - counts)


# Hugging Face's names for one block's tensors, relative to the block ("mlp." in a decoder layer). Checkpoint
# files hold one tensor per expert (experts.{e}.gate_proj.weight; Mixtral's files w1/w3/w2); transformers 5 holds
# them stacked in memory (experts.gate_up_proj [E, 2*hidden, dim], gate rows first; experts.down_proj).
EXPERT_NAMES = {"gate_proj": ("gate_proj", "up_proj", "down_proj"), "w1": ("w1", "w3", "w2")}


def moe_from_hf(hf: Mapping[str, torch.Tensor], n_experts: int) -> dict[str, torch.Tensor]:
    """Our block's tensors (names relative to MoE) from one Hugging Face block's: per-expert (either naming) or
    stacked routed experts, the router gate, the shared expert (shared_expert or DeepSeek's shared_experts) and
    its gate, DeepSeek's e_score_correction_bias."""
    out: dict[str, torch.Tensor] = {"router.gate.weight": hf["gate.weight"]}
    if "gate.e_score_correction_bias" in hf:
        out["router.expert_bias"] = hf["gate.e_score_correction_bias"].float()
    if "experts.gate_up_proj" in hf:
        out["experts.w1"], out["experts.w3"] = hf["experts.gate_up_proj"].chunk(2, dim=1)
        out["experts.w2"] = hf["experts.down_proj"]
    else:
        gate, up, down = EXPERT_NAMES["w1" if "experts.0.w1.weight" in hf else "gate_proj"]
        for ours, theirs in (("w1", gate), ("w3", up), ("w2", down)):
            out[f"experts.{ours}"] = torch.stack([hf[f"experts.{e}.{theirs}.weight"] for e in range(n_experts)])
    for prefix in ("shared_expert.", "shared_experts."):
        if prefix + "gate_proj.weight" in hf:
            for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                out[f"shared_expert.{ours}.weight"] = hf[f"{prefix}{theirs}.weight"]
    if "shared_expert_gate.weight" in hf:
        out["shared_gate.weight"] = hf["shared_expert_gate.weight"]
    return {name: t.contiguous() for name, t in out.items()}


def moe_to_hf(
    ours: Mapping[str, torch.Tensor], names: str = "gate_proj", shared: str = "shared_expert"
) -> dict[str, torch.Tensor]:
    """One block's tensors under the names of Hugging Face checkpoint files (one tensor per expert): `names`
    "gate_proj" (gate_proj/up_proj/down_proj: Qwen-MoE, OLMoE, DeepSeek) or "w1" (Mixtral's w1/w3/w2); `shared`
    the shared expert's module name (DeepSeek: "shared_experts")."""
    gate, up, down = EXPERT_NAMES[names]
    out = {"gate.weight": ours["router.gate.weight"]}
    if "router.expert_bias" in ours:
        out["gate.e_score_correction_bias"] = ours["router.expert_bias"]
    for mine, theirs in (("w1", gate), ("w3", up), ("w2", down)):
        for e, w in enumerate(ours[f"experts.{mine}"].unbind(0)):
            out[f"experts.{e}.{theirs}.weight"] = w
    if "shared_expert.w1.weight" in ours:
        for mine, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            out[f"{shared}.{theirs}.weight"] = ours[f"shared_expert.{mine}.weight"]
    if "shared_gate.weight" in ours:
        out["shared_expert_gate.weight"] = ours["shared_gate.weight"]
    return out

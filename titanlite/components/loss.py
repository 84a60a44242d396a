"""The training loss: the token mean of the next-token cross-entropy, in float32, in one of two ways.

- plain (`training.loss_chunk_tokens = 0`): the model returns logits [B, T, vocab] and
  `F.cross_entropy` takes them (upcast to float32; its backward makes a gradient of the same size).
- chunked (the default): the model returns its final hidden states [B, T, dim] and the loss applies
  the output projection itself, `loss_chunk_tokens` tokens at a time. Each chunk's float32 logits give
  its loss and, at once, the chunk's gradients with respect to the hidden states and the projection
  weight, and are freed: no [B, T, vocab] tensor (logits, their float32 copy, their gradient) ever
  exists, and backward only scales the stored gradients. The matmul FLOPs are those of the plain
  path (forward, input gradient, weight gradient); nothing is recomputed.

The model says which it returns by an argument, never by the config: `model(tokens, logits=False)` gives the
hidden states, and the loss takes them with the model's head (`model.output`, models/common/head.py).
Layouts: the model still calls its head in forward (`output(h, project=False)` passes h through), so FSDP
gathers its weight as before and reduce-scatters its gradient; under
tensor parallelism the weight stays split by vocabulary and the chunk's softmax is reduced over the
TP group (three all-reduces of one number per token), as loss parallelism does with whole logits;
a pipeline's last stage hands its hidden states to the schedule's loss function, which is this one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from titanlite.base.errors import ConfigError
from titanlite.models.common.auxiliary import record_loss_part
from titanlite.models.common.head import OutputHead
from titanlite.models.common.interface import unwrapped

IGNORE = -100  # F.cross_entropy's default ignore_index: padded validation rows


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the (non-ignored) tokens of one micro-batch, computed in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class ChunkedCrossEntropy:
    """loss_fn(hidden, labels) with the model's output `head`, for hidden states from `model(..., logits=False)`: the
    plain loss's value
    and gradients, `chunk_tokens` tokens at a time. `compiled`: fuse each chunk's softmax arithmetic
    into one kernel (torch.compile), so the chunk's logits are read once."""

    def __init__(self, head: OutputHead, chunk_tokens: int, compiled: bool = False, backend: str = "inductor"):
        self.head, self.chunk_tokens = head, chunk_tokens
        self.chunk_fn = (
            torch.compile(fused_softmax_cross_entropy, backend=backend, dynamic=False)
            if compiled
            else softmax_cross_entropy
        )

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        flat, weight, group, vocab_start = local_projection(self.head, hidden)
        compute_grads = torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad)
        chunk_fn = self.chunk_fn if group is None else None
        return _ChunkedCrossEntropy.apply(
            flat, weight, labels.flatten(), self.chunk_tokens, group, vocab_start, compute_grads, chunk_fn,
            self.head.softcap,
        )  # fmt: skip


def local_projection(head: OutputHead, hidden: torch.Tensor):
    """The hidden states [B * T, dim] and this rank's rows of the output weight, in the autocast dtype where autocast
    is on (as nn.Linear would compute), with the vocabulary-parallel group and this rank's first row (None, 0: the
    whole vocabulary here). `hidden` [B, T, dim] may be a TP-sharded DTensor: every rank then gets all tokens."""
    weight = head.weight  # FSDP's gathered weight during the step; a plain parameter otherwise
    group, vocab_start = None, 0
    if isinstance(weight, DTensor):  # tensor parallel: this rank's rows of the vocabulary
        mesh = weight.device_mesh
        if weight.placements != (Shard(0),) or mesh.mesh_dim_names != ("tp",):
            raise RuntimeError(
                f"chunked loss: the output weight is {weight.placements} on {mesh} at the loss, "
                "not gathered by FSDP nor split by TP alone"
            )
        group = mesh.get_group()
        weight = weight.to_local()
        vocab_start = mesh.get_local_rank() * weight.shape[0]
        if isinstance(hidden, DTensor):
            # All tokens on every TP rank; each rank's input gradient covers its vocabulary rows only
            # (Partial), which the gather's backward turns into the sequence shards' sums.
            hidden = hidden.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
    flat = hidden.flatten(0, 1)
    device_type = flat.device.type
    if torch.is_autocast_enabled(device_type):  # the projection in the autocast dtype, as nn.Linear would be
        dtype = torch.get_autocast_dtype(device_type)
        flat, weight = flat.to(dtype), weight.to(dtype)
    return flat, weight, group, vocab_start


def kept_log_loss(logits: torch.Tensor, target: torch.Tensor, keep: torch.Tensor):
    """The chunk's float32 log-probabilities and the summed loss of its kept rows."""
    log_probs = torch.log_softmax(logits.float(), dim=1)
    return log_probs, -torch.where(keep, log_probs.gather(1, target[:, None])[:, 0], 0.0).sum()


def softmax_cross_entropy(logits: torch.Tensor, target: torch.Tensor, keep: torch.Tensor, with_grad: bool):
    """One chunk on one rank holding the whole vocabulary: the summed loss of its kept rows and, with
    `with_grad`, d(sum)/d(logits) = softmax - one-hot (in the logits' dtype; ignored rows are left for
    the caller to mask)."""
    log_probs, loss = kept_log_loss(logits, target, keep)
    if not with_grad:
        return loss, None
    grad = log_probs.exp_()
    grad[torch.arange(len(target), device=target.device), target] -= 1.0
    return loss, grad.to(logits.dtype)


def fused_softmax_cross_entropy(logits: torch.Tensor, target: torch.Tensor, keep: torch.Tensor, with_grad: bool):
    """softmax_cross_entropy written for torch.compile: the one-hot as a comparison, so the gradient is
    one pointwise kernel from the logits to its dtype (an indexed update would make the compiler write
    the float32 probabilities out first; measured on an H100, that cost GPT-2 124M 3.5 ms a step)."""
    log_probs, loss = kept_log_loss(logits, target, keep)
    if not with_grad:
        return loss, None
    one_hot = torch.arange(logits.shape[1], device=logits.device)[None, :] == target[:, None]
    return loss, (log_probs.exp() - one_hot.float()).to(logits.dtype)


def vocab_parallel_cross_entropy(logits: torch.Tensor, local: torch.Tensor, keep: torch.Tensor, group, with_grad: bool):
    """softmax_cross_entropy for logits split by vocabulary over `group` (`local`: each label's index
    among this rank's rows, out of range where another rank holds it)."""
    vocab = logits.shape[1]
    mine = keep & (local >= 0) & (local < vocab)
    index = local.clamp(0, vocab - 1)
    z = logits.float()
    peak = z.max(dim=1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    sum_exp = (z - peak[:, None]).exp().sum(dim=1)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
    picked = torch.where(mine, z.gather(1, index[:, None])[:, 0], 0.0)
    dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
    lse = peak + sum_exp.log()
    loss = torch.where(keep, lse - picked, 0.0).sum()
    if not with_grad:
        return loss, None
    grad = (z - lse[:, None]).exp()
    grad[torch.arange(len(local), device=local.device), index] -= mine.to(grad.dtype)
    return loss, grad.to(logits.dtype)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, group, vocab_start, compute_grads, chunk_fn, softcap=0.0):
        n_tokens = hidden.shape[0]
        valid = labels != IGNORE
        count = valid.sum()
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if compute_grads else None
        one_chunk = n_tokens <= chunk_tokens  # then the weight gradient needs no float32 accumulator
        grad_weight = None
        for start in range(0, n_tokens, chunk_tokens):
            end = start + chunk_tokens
            h, y, keep = hidden[start:end], labels[start:end], valid[start:end]
            logits = h @ weight.t()  # [n, vocab (this rank's rows)], in the compute dtype
            if softcap:  # the head's cap, softcap * tanh(z / softcap); d/dz = 1 - tanh^2
                capped = torch.tanh(logits.float() / softcap)
                logits = (softcap * capped).to(logits.dtype)
            if group is None:
                loss, grad = chunk_fn(logits, y.clamp(min=0), keep, compute_grads)
            else:
                loss, grad = vocab_parallel_cross_entropy(logits, y - vocab_start, keep, group, compute_grads)
            del logits
            if softcap:
                grad = None if grad is None else (grad.float() * (1 - capped.square())).to(grad.dtype)
                del capped
            loss_sum += loss
            if grad_hidden is not None:  # compute_grads
                # Ignored rows (padding) contribute nothing: masked on the [n, dim] sides, not on [n, vocab].
                mask = keep[:, None].to(h.dtype)
                grad_hidden[start:end] = (grad @ weight) * mask
                chunk_grad_weight = grad.t() @ (h * mask)
                if one_chunk:
                    grad_weight = chunk_grad_weight
                elif grad_weight is None:
                    grad_weight = chunk_grad_weight.float()
                else:
                    grad_weight += chunk_grad_weight
                del grad, chunk_grad_weight  # before the next chunk's logits: one chunk's blocks at a time
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.weight_dtype = weight.dtype
        return loss_sum / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_loss / count
        return (
            grad_hidden * scale.to(grad_hidden.dtype),
            (grad_weight * scale).to(ctx.weight_dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


DEFAULT_CHUNK_TOKENS = 4096


# Pipeline schedules that split backward into input and weight gradients (a CSV schedule may). On torch 2.11
# the weight half fails on a custom autograd.Function's output ("Attribute '_input_metadata' is invalid"), which
# the chunked loss is; 2.13 takes it.
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "csv")
SPLIT_BACKWARD_TAKES_FUNCTIONS = torch.__version__ >= "2.12"


def schedule_of(parallelism) -> str:
    """The pipeline schedule a [parallelism] section runs: "" without pipeline parallelism, "csv" for a file."""
    if parallelism.pipeline_parallel_degree == 1:
        return ""
    return "csv" if parallelism.pipeline_parallel_schedule_csv else parallelism.pipeline_parallel_schedule


def chunk_tokens(training, compile_cfg, loss_parallel: bool, schedule: str = "") -> int:
    """training.loss_chunk_tokens resolved: -1 (auto) chunks unless torch.compile fuses the plain loss
    (compile.enable with 'loss' in compile.components, and no loss parallelism, which stays eager): then
    the plain loss measured faster on an H100 (GPT-2 124M batch 16: 38.2 against 46.9 ms a step), at the
    cost of the [B, T, vocab] logits in memory (1.6 GiB more at that size). 0: plain; N: chunks of N.
    `schedule`: the pipeline schedule, if any; on torch 2.11 a split-backward one takes the plain loss."""
    old_split = schedule in SPLIT_BACKWARD_SCHEDULES and not SPLIT_BACKWARD_TAKES_FUNCTIONS
    if old_split and training.loss_chunk_tokens > 0:
        raise ConfigError(
            f"training.loss_chunk_tokens={training.loss_chunk_tokens} with pipeline_parallel_schedule={schedule} "
            f"needs torch 2.12 or later (torch {torch.__version__} cannot split the chunked loss's backward); set "
            "training.loss_chunk_tokens = 0 or -1, or use another schedule"
        )
    if training.loss_chunk_tokens >= 0:
        return training.loss_chunk_tokens
    fused_plain = compile_cfg.enable and "loss" in compile_cfg.components and not loss_parallel
    return 0 if fused_plain or old_split else DEFAULT_CHUNK_TOKENS


def mtp_loss_names(depth: int) -> tuple[str, ...]:
    """The logged names of multi-token prediction's depths: mtp_loss for one, mtp_loss_1 .. mtp_loss_D for more."""
    return ("mtp_loss",) if depth == 1 else tuple(f"mtp_loss_{k}" for k in range(1, depth + 1))


class MultiTokenLoss:
    """loss_fn(output, labels) with multi-token prediction (models/common/multi_token.py): `output` holds the main
    output and each depth's, concatenated along the batch (the model's forward with mtp_tokens); `labels` [B, T, D + 1]
    the tokens 1..D + 1 places ahead (future_labels). Each part's cross-entropy is `base`'s (plain or chunked, on any
    layout); the value returned is the main one, and its gradient is that of

        main + coefficient / D * (loss_1 + ... + loss_D)

    (DeepSeek-V3's lambda / D; Megatron-LM's mtp_loss_scaling_factor / mtp_num_layers), each loss_k the mean over the
    window's positions that have a target k + 1 places ahead (T - k of T). The depths' values are logged beside the
    loss (auxiliary.record_loss_part). On a context-parallel rank those positions are not a fixed share of its slice
    (the window's last ones are on one rank), so each rank divides its sum by its share of the whole window's count,
    (its main targets) x (T - k) / T, with T = `seq_len`, the whole window: the mean over ranks is one process's."""

    def __init__(self, base, depth: int, coefficient: float, seq_len: int):
        self.base, self.depth, self.coefficient, self.seq_len = base, depth, coefficient, seq_len
        self.names = mtp_loss_names(depth)

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if labels.dim() == 2:  # the main model alone (evaluation: titanlite/engine/trainer.py RankModel.ahead)
            return self.base(output, labels)
        parts = output.chunk(self.depth + 1, dim=0)
        main = self.base(parts[0], labels[..., 0])
        main_targets = (labels[..., 0] != IGNORE).sum()
        total = None
        for k in range(1, self.depth + 1):
            targets = labels[..., k]
            # base's token mean over this rank's targets, rescaled to its share of the window's (class docstring)
            share = main_targets * ((self.seq_len - k) / self.seq_len)
            loss = self.base(parts[k], targets) * ((targets != IGNORE).sum() / share.clamp(min=1))
            record_loss_part(self.names[k - 1], loss)
            total = loss if total is None else total + loss
        assert total is not None  # depth >= 1
        extra = total * (self.coefficient / self.depth)
        return main + (extra - extra.detach())  # the value main's, the gradient also extra's


class TokenScores:
    """score_fn(output, labels) -> [R, 2] float64: for each row of labels [R, T], the summed log-probability of its
    targets (labels != IGNORE) and how many of them are not the most likely id there (0: the row's targets are the
    greedy continuation), what lm-eval's loglikelihood requests ask for. `output` is what the model returns for the
    run's loss: logits (whole, or split by vocabulary under loss parallelism) or, with `head`, the final hidden states,
    projected here `chunk_tokens` targets at a time and only at the targets. On a context-parallel rank the sums are
    of its share of the sequence; summed over the cp ranks they are the row's."""

    def __init__(self, head: OutputHead | None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        self.head, self.chunk_tokens = head, max(chunk_tokens, 1)

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        keep = (labels != IGNORE).flatten()
        rows = keep.nonzero()[:, 0] // labels.shape[-1]
        targets = labels.flatten()[keep]
        if self.head is not None:
            flat, weight, group, vocab_start = local_projection(self.head, output)
            flat = flat[keep]
        else:
            weight, group, vocab_start = None, None, 0
            if isinstance(output, DTensor):  # loss parallelism: [B, T, vocab/tp] on each rank, or whole
                mesh, vocab_split = output.device_mesh, output.placements[0].is_shard(output.dim() - 1)
                local = output.to_local() if vocab_split else output.full_tensor()
                if vocab_split:
                    group, vocab_start = mesh.get_group(), mesh.get_local_rank() * local.shape[-1]
                output = local
            flat = output.flatten(0, 1)[keep]
        log_probs, greedy = [], []
        for start in range(0, len(targets), self.chunk_tokens):
            z = flat[start : start + self.chunk_tokens]
            if weight is not None:
                z = z @ weight.t()
                if self.head is not None and self.head.softcap:
                    z = self.head.softcap * torch.tanh(z.float() / self.head.softcap)
            lp, best = target_log_probs(z.float(), targets[start : start + self.chunk_tokens] - vocab_start, group)
            log_probs.append(lp)
            greedy.append(best)
        out = torch.zeros(labels.shape[0], 2, dtype=torch.float64, device=labels.device)
        if log_probs:
            out[:, 0].index_add_(0, rows, torch.cat(log_probs).double())
            out[:, 1].index_add_(0, rows, (~torch.cat(greedy)).double())
        return out


def target_log_probs(z: torch.Tensor, local: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits z [n, vocab] (this rank's columns of a vocabulary split over `group`, or all): each target's
    log-probability and whether it is the most likely id (its logit the largest; lm-eval compares the argmax, which
    differs only where two ids tie exactly). `local`: the targets as indices into this rank's columns."""
    vocab = z.shape[1]
    mine = (local >= 0) & (local < vocab)
    picked = torch.where(mine, z.gather(1, local.clamp(0, vocab - 1)[:, None])[:, 0], 0.0)
    peak = z.max(dim=1).values
    if group is None:  # one fused pass for the normaliser
        return picked - torch.logsumexp(z, dim=1), picked >= peak
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    sum_exp = (z - peak[:, None]).exp().sum(dim=1)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
    return picked - peak - sum_exp.log(), picked >= peak


def output_head(parts: list[nn.Module]) -> OutputHead | None:
    """The output head of the part that holds it (None: a pipeline rank without the last stage)."""
    heads = [head for head in (getattr(unwrapped(p), "output", None) for p in parts) if isinstance(head, OutputHead)]
    return heads[0] if heads else None


def build_loss(parts: list[nn.Module], chunk_tokens: int, compiled: bool = False, backend: str = "inductor"):
    """The loss function for these model parts: chunked with the head of the part that holds it (the model then
    runs with logits=False), else the plain cross-entropy of logits."""
    head = output_head(parts)
    if chunk_tokens <= 0 or head is None:  # plain; or a pipeline rank without the last stage (never called)
        return cross_entropy
    return ChunkedCrossEntropy(head, chunk_tokens, compiled, backend)


def build_scores(parts: list[nn.Module], chunk_tokens: int) -> TokenScores:
    """The scoring function (TokenScores) for these model parts, on the output the run's loss takes: hidden states
    with the head of the part that holds it when the loss is chunked, else logits."""
    head = output_head(parts)
    return TokenScores(head if chunk_tokens > 0 else None, chunk_tokens)

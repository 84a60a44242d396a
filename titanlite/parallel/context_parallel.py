"""Context parallelism (apply_cp): the ranks of the cp mesh dimension split every sequence, and attention
gathers the keys and values of the other ranks' tokens (Llama 3's method: cheap with grouped-query attention,
any mask composes with it, and it runs on gloo as on NCCL; docs/parallelism.md says why not ring attention).
It wraps each block's attention core, whichever it is (titanlite/models/common/attention.py ATTENTION_CORES), and
the two sequence cores of each linear-attention layer (titanlite/models/common/gated_delta_net.py) and Mamba-2 layer
(titanlite/models/common/mamba2.py): the short convolution takes the last inputs of the chunk before each of its
chunks, and the delta rule or the SSD scan scans the chunks' state transitions, gathered from every rank, in sequence
order (`ContextParallelDeltaRule`, `ContextParallelStateScan` say how).

Load balance: a sequence is cut into 2 x cp chunks and rank r holds chunks r and 2cp-1-r, so under a causal
mask every rank attends over the same number of keys. Each token keeps its true position (for RoPE and the
mask) through `Sequence` (titanlite/models/common/attention.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlite.base.errors import ConfigError
from titanlite.models.common.attention import CoreAttention, Sequence, attend, document_ids
from titanlite.models.common.gated_delta_net import DeltaRule, ShortConvolution
from titanlite.models.common.latent.sparse import SequenceKeys
from titanlite.models.common.linear_attention import document_starts
from titanlite.models.common.mamba2 import StateScan

# torch 2.13 renamed the autograd all-gather; either gathers on gloo and NCCL, and compiles.
_all_gather_autograd = getattr(functional, "all_gather_single_autograd", None) or functional.all_gather_tensor_autograd
# torch 2.13 renamed the c10d ones too (the old names warn there); same arguments.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def check_cp_degree(cp: int, seq_len: int, what: str = "training.seq_len", conv_size: int = 1) -> None:
    """A CP degree must cut the sequence into 2 x cp equal chunks, each at least as long as the conv_size - 1 inputs
    that a linear layer's convolution reads before a token (conv_size 1: no linear layers), which the chunk before
    it hands on."""
    if cp > 1 and seq_len % (2 * cp):
        fits = [d for d in range(1, 17) if seq_len % (2 * d) == 0]
        raise ConfigError(
            f"parallelism.context_parallel_degree={cp} does not cut {what}={seq_len} into {2 * cp} equal chunks "
            f"(two per rank, for balance); use a degree in {fits} or a {what} divisible by {2 * cp}"
        )
    if cp > 1 and seq_len // (2 * cp) < conv_size - 1:
        fits = [d for d in range(1, 17) if seq_len % (2 * d) == 0 and seq_len // (2 * d) >= conv_size - 1]
        raise ConfigError(
            f"parallelism.context_parallel_degree={cp} cuts {what}={seq_len} into chunks of {seq_len // (2 * cp)} "
            f"tokens, fewer than the {conv_size - 1} earlier inputs the linear layers' convolution (conv_size="
            f"{conv_size}) reads; use a degree in {fits} or a {what} of at least {2 * cp * (conv_size - 1)}"
        )


def balanced_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions rank `rank` holds of a sequence of `seq_len` tokens: chunks rank and 2cp-1-rank."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


def gathered_positions(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """The positions of the keys after the gather: rank 0's tokens, then rank 1's, ..."""
    return torch.cat([balanced_positions(seq_len, cp, r, device) for r in range(cp)])


class SequenceSplit:
    """What a rank does to each batch before the forward pass: with cp > 1, keep its balanced share of the
    sequence (inputs and labels); with block-causal attention, the tokens' documents. Returns the inputs,
    labels and the `Sequence` the model takes (None: whole sequences, plain causal, the fused kernel)."""

    def __init__(self, cp: int = 1, rank: int = 0, eot_id: int | None = None):
        self.cp, self.rank, self.eot_id = cp, rank, eot_id

    def __call__(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Sequence | None]:
        documents = document_ids(inputs, self.eot_id) if self.eot_id is not None else None
        if self.cp == 1:
            return inputs, labels, None if documents is None else Sequence(documents=documents)
        positions = balanced_positions(inputs.shape[1], self.cp, self.rank, inputs.device)
        keys = gathered_positions(inputs.shape[1], self.cp, inputs.device)
        sequence = Sequence(
            positions=positions,
            documents=None if documents is None else documents[:, positions],
            key_positions=keys,
            key_documents=None if documents is None else documents[:, keys],
        )
        return inputs[:, positions], labels[:, positions], sequence


class _GatherFirstDim(torch.autograd.Function):
    """All-gather along dim 0 over `group` with plain blocking c10d calls; backward reduce-scatters the
    gradient (sums every rank's gradient of each part into its owner). The eager path: the same two
    collectives FSDP issues, with no asynchronous tensor wrapper in the autograd graph."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
        _all_gather(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        _reduce_scatter(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def gather_sequence(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """All-gather `x` along `dim` over the cp group (rank 0's part first). Its backward sums every rank's
    gradient of each part into the rank that owns it (a reduce-scatter). Under torch.compile a functional
    collective, which it traces (with activation checkpointing too); in eager mode blocking c10d calls.
    Gathered along the first dimension, the one every torch from 2.11 supports."""
    moved = x.movedim(dim, 0).contiguous()
    if moved.is_meta:  # a pipeline stage inferring its shapes on the meta device: no data to gather
        return moved.new_empty((moved.shape[0] * dist.get_world_size(group), *moved.shape[1:])).movedim(0, dim)
    if torch.compiler.is_compiling():
        return _all_gather_autograd(moved, 0, group).movedim(0, dim)
    return _GatherFirstDim.apply(moved, group).movedim(0, dim)


class ContextParallelCore(CoreAttention):
    """Wraps a block's attention core (`inner`, any registered one): gathers the keys and values of the whole
    sequence from the cp group, then lets the inner core attend over them. The `Sequence` passes through as it
    is: SequenceSplit already gave it the queries' positions and the gathered keys' (key_positions), so the
    inner core builds the mask of this rank's queries against every key. Only CoreAttention's contract is
    inherited; the attention itself is the inner core's."""

    def __init__(self, inner: CoreAttention, group: dist.ProcessGroup):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sequence: Sequence | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kv = gather_sequence(torch.stack([k, v]), self.group, 3)  # one collective for both: [2, B, Hkv, S, hd]
        return attend(self.inner, q, kv[0], kv[1], sequence, sinks)  # sinks see no key: nothing to gather


class ContextParallelKeys(SequenceKeys):
    """Wraps a sparse attention layer's SequenceKeys (models/common/latent/sparse.py): what each token's keys are made
    of [B, T, C] (its latent, rotary key and indexer key: a few hundred channels, far fewer than the heads' keys and
    values) gathered from every rank of the cp group, rank 0's first, as the Sequence's key_positions say; the layer
    puts them in position order, selects each query's keys and expands them itself. Backward sums each rank's
    gradient into the rank that holds the token."""

    def __init__(self, inner: SequenceKeys, group: dist.ProcessGroup):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, keys: torch.Tensor, sequence: Sequence | None) -> torch.Tensor:
        return gather_sequence(keys, self.group, 1)


def _chunk_slots(cp: int) -> list[int]:
    """Where each chunk of the sequence lies among the gathered local chunks (rank 0's two, rank 1's two, ...)."""
    slots = [0] * (2 * cp)
    for rank in range(cp):
        slots[rank], slots[2 * cp - 1 - rank] = 2 * rank, 2 * rank + 1
    return slots


def _chunk_continues(sequence: Sequence | None, cp: int, dtype: torch.dtype) -> torch.Tensor | None:
    """[B, 2cp]: 1 where chunk c's first token is in the document of the token before it (chunk c-1's last), 0 where
    it starts a new one (and for chunk 0); None: one document (plain causal), every chunk continues."""
    if sequence is None or sequence.key_documents is None or sequence.key_positions is None:
        return None
    documents = sequence.key_documents[:, sequence.key_positions.argsort()]  # [B, S] in sequence order
    chunk = documents.shape[1] // (2 * cp)
    firsts = documents[:, chunk::chunk]  # chunks 1 .. 2cp-1
    continues = (firsts == documents[:, chunk - 1 :: chunk][:, : 2 * cp - 1]).to(dtype)
    return torch.cat([torch.zeros_like(continues[:, :1]), continues], dim=1)


def _chunks_on_batch(x: torch.Tensor) -> torch.Tensor:
    """A rank's [B, 2L, ...] (its two chunks) as [2B, L, ...]: the two chunks as rows of one batch."""
    half = x.shape[1] // 2
    return torch.cat([x[:, :half], x[:, half:]], dim=0)


def _chunks_in_sequence(x: torch.Tensor) -> torch.Tensor:
    """_chunks_on_batch undone: [2B, L, ...] -> [B, 2L, ...]."""
    batch = x.shape[0] // 2
    return torch.cat([x[:batch], x[batch:]], dim=1)


class ContextParallelConvolution(ShortConvolution):
    """Wraps a linear layer's ShortConvolution (`inner`): each of this rank's chunks starts from the last K-1 inputs
    of the chunk before it in the sequence (those of an earlier document than that chunk's last token zeroed, as
    causal_conv1d's state is), gathered from the rank that holds it; no inputs for the first chunk or one whose
    first token starts a document. Returns the outputs of this rank's tokens and the whole sequence's final state."""

    def __init__(self, inner: ShortConvolution, group: dist.ProcessGroup):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        sequence: Sequence | None = None,
        state: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        width, (batch, length, channels) = weight.shape[1] - 1, x.shape  # width: the inputs read before a token
        if width == 0:  # no token reads another: nothing crosses a chunk boundary
            return self.inner(x, weight, sequence, state, bias)
        check_cp_degree(cp, length * cp, "the sequence's length", width + 1)
        documents = None if sequence is None or sequence.documents is None else _chunks_on_batch(sequence.documents)
        chunks = _chunks_on_batch(x)  # [2B, L, C]
        tails = chunks[:, -width:]
        if documents is not None:
            tails = tails * (documents[:, -width:] == documents[:, -1:])[..., None]
        tails = gather_sequence(tails.view(2, batch, width, channels), self.group, 0)  # [2cp, B, K-1, C]
        slots, continues = _chunk_slots(cp), _chunk_continues(sequence, cp, x.dtype)
        first = x.new_zeros(batch, width, channels) if state is None else state.transpose(1, 2)

        def before(c: int) -> torch.Tensor:  # the inputs before chunk c
            if c == 0:
                return first
            tail = tails[slots[c - 1]]
            return tail if continues is None else tail * continues[:, c, None, None]

        states = torch.cat([before(rank), before(2 * cp - 1 - rank)]).transpose(1, 2)  # [2B, C, K-1]
        y, _ = self.inner(chunks, weight, None if documents is None else Sequence(documents=documents), states, bias)
        return _chunks_in_sequence(y), tails[slots[-1]].transpose(1, 2)


class ContextParallelDeltaRule(DeltaRule):
    """Wraps a linear layer's DeltaRule (`inner`). The state after a chunk is linear in the state before it,
    S_out = P S_in + Q, and each output too, o_t = o0_t + (P_t^T q_t)^T S_in, because the rule is linear, column by
    column, in the state and the values. So the inner rule runs once over this rank's two chunks (as two rows of the
    batch) with the values widened by Dk columns of zeros and the state [0 | I]: the value columns give o0 and Q,
    the outputs and final state from a zero state; the extra ones P_t^T q_t at each token and the transition P at
    the end. Every rank gathers every chunk's (P, Q) and scans them in sequence order, the state set back to zero
    where a chunk starts a document, then adds to its outputs what its chunks' incoming states contribute. Cost per
    layer: Dk more value columns, one gather of 2cp x [B, H, Dk, Dk + Dv] and a scan of 2cp small products. Returns
    the outputs of this rank's tokens and the whole sequence's final state."""

    def __init__(self, inner: DeltaRule, group: dist.ProcessGroup):
        super().__init__(inner.chunk_size)
        self.inner = inner
        self.group = group

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        sequence: Sequence | None = None,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        batch, heads, key_dim, value_dim = v.shape[0], v.shape[2], k.shape[3], v.shape[3]
        dtype = torch.float32  # the inner rule's computing dtype: float64 when an input is
        for t in (q, k, v, g, beta, state):
            if t is not None:
                dtype = torch.promote_types(dtype, t.dtype)
        eye = torch.eye(key_dim, dtype=dtype, device=v.device).expand(2 * batch, heads, key_dim, key_dim)
        start = torch.cat([eye.new_zeros(2 * batch, heads, key_dim, value_dim), eye], dim=-1)  # [0 | I]
        widened = torch.cat([v, v.new_zeros(*v.shape[:3], key_dim)], dim=-1)  # [B, 2L, H, Dv + Dk]
        documents = None if sequence is None or sequence.documents is None else _chunks_on_batch(sequence.documents)
        out, end = self.inner(
            *(_chunks_on_batch(t) for t in (q, k, widened, g, beta)),
            None if documents is None else Sequence(documents=documents),
            start,
        )
        assert end is not None  # a state was handed in: every backend returns the final one
        ends = gather_sequence(end.view(2, batch, heads, key_dim, -1), self.group, 0)  # [2cp, B, H, Dk, Dv + Dk]
        slots, continues = _chunk_slots(cp), _chunk_continues(sequence, cp, dtype)
        carried = eye.new_zeros(batch, heads, key_dim, value_dim) if state is None else state.to(dtype)
        incoming = []  # the state before each chunk
        for c in range(2 * cp):
            if c and continues is not None:
                carried = carried * continues[:, c, None, None, None]
            incoming.append(carried)
            transition = ends[slots[c]]
            carried = transition[..., value_dim:] @ carried + transition[..., :value_dim]
        before = torch.cat([incoming[rank], incoming[2 * cp - 1 - rank]])  # [2B, H, Dk, Dv]
        reads = torch.einsum("bthk,bhkv->bthv", out[..., value_dim:].to(dtype), before)
        return _chunks_in_sequence(out[..., :value_dim] + reads.to(out.dtype)), carried


class ContextParallelStateScan(StateScan):
    """Wraps a Mamba-2 layer's StateScan (`inner`). With one decay per head, a chunk hands on S_out = a S_in + Q, a
    number per head (the exponential of the chunk's summed log-decay; 0 where a document starts inside it), and each of
    its tokens reads o_t = o0_t + d_t q_t^T S_in (d_t its decay from the chunk's start; 0 after a document start). So
    the inner scan runs once over this rank's two chunks (as two rows of the batch) from a zero state (handed in: its
    PyTorch path, whatever model.linear_attn_backend says), giving o0 and Q; every rank gathers every chunk's Q and a,
    scans them in sequence order (the state set back to zero where a chunk starts a document) and adds to its outputs
    what its chunks' incoming states contribute. Cost per layer: one gather of 2cp x [B, H, N, P] and a scan of 2cp
    small products, no widened values (the delta rule's transition is a matrix: ContextParallelDeltaRule). Returns the
    outputs of this rank's tokens and the whole sequence's final state."""

    def __init__(self, inner: StateScan, group: dist.ProcessGroup):
        super().__init__(inner.chunk_size)
        self.inner = inner
        self.group = group

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        sequence: Sequence | None = None,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        batch, heads = v.shape[0], v.shape[2]
        documents = None if sequence is None or sequence.documents is None else _chunks_on_batch(sequence.documents)
        # A zero state handed in: the inner scan's PyTorch path, which returns the final state of packed documents too
        zeros = v.new_zeros(2 * batch, heads, k.shape[3], v.shape[3], dtype=torch.promote_types(v.dtype, torch.float32))
        out, end = self.inner(
            *(_chunks_on_batch(t) for t in (q, k, v, g)),
            None if documents is None else Sequence(documents=documents),
            zeros,
        )
        assert end is not None  # a state was handed in
        dtype = end.dtype  # the inner scan's computing dtype
        decay = _chunks_on_batch(g).to(dtype).cumsum(dim=1)  # [2B, L, H]: each token's decay from its chunk's start
        reads = decay.exp()
        if documents is not None:  # the tokens after a document start inside the chunk read no incoming state
            reads = reads * (document_starts(documents).cumsum(dim=1) == 0)[..., None]
        passes = reads[:, -1].contiguous()  # [2B, H]: the number a chunk multiplies its incoming state by
        ends = gather_sequence(end.view(2, batch, *end.shape[1:]), self.group, 0)  # [2cp, B, H, N, P]
        factors = gather_sequence(passes.view(2, batch, heads), self.group, 0)  # [2cp, B, H]
        slots, continues = _chunk_slots(cp), _chunk_continues(sequence, cp, dtype)
        carried = end.new_zeros(batch, *end.shape[1:]) if state is None else state.to(dtype)
        incoming = []  # the state before each chunk
        for c in range(2 * cp):
            if c and continues is not None:
                carried = carried * continues[:, c, None, None, None]
            incoming.append(carried)
            carried = factors[slots[c]][..., None, None] * carried + ends[slots[c]]
        before = torch.cat([incoming[rank], incoming[2 * cp - 1 - rank]])  # [2B, H, N, P]
        queries = _chunks_on_batch(q).to(dtype).repeat_interleave(heads // q.shape[2], dim=2)  # [2B, L, H, N]
        read = torch.einsum("blhn,bhnp->blhp", queries * reads[..., None], before)
        return _chunks_in_sequence(out + read.to(out.dtype)), carried


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Wrap every block's attention core (its `core`) in one that gathers keys and values over `cp_mesh`, every
    sparse attention layer's key source (`keys`) in one that gathers what its keys are made of, and every
    linear-attention layer's convolution (`conv`) and delta rule (`rule`), and every Mamba-2 layer's scan (`scan`),
    in ones that hand state across ranks."""
    group = cp_mesh.get_group()
    wrappers: dict[str, tuple[type[nn.Module], type[nn.Module]]] = {
        "core": (CoreAttention, ContextParallelCore),
        "conv": (ShortConvolution, ContextParallelConvolution),
        "rule": (DeltaRule, ContextParallelDeltaRule),
        "scan": (StateScan, ContextParallelStateScan),
        "keys": (SequenceKeys, ContextParallelKeys),
    }
    for name, (kind, wrapper) in wrappers.items():
        found = [
            (module, getattr(module, name))
            for module in model.modules()
            if isinstance(getattr(module, name, None), kind)
        ]
        for module, inner in found:
            setattr(module, name, wrapper(inner, group))

"""The planner's estimator: per-rank memory and per-step communication of each layout, from the model's facts
(titanlite/builder/model_facts.py), and the layout to recommend. `titanlite plan` prints it; `titanlite check`
compares the config's own layout with the machine before launch. Per rank, for each layout:

  parameters    fp32, divided by TP (split matrices and vocabulary ends; norms stay whole), by the
                pipeline stage, and by FSDP's shard degree
  gradients     fp32, sharded as the parameters under FSDP; whole under DDP and on one device
  optimizer     AdamW's two fp32 moments, sharded as the parameters; under Muon one fp32 momentum for each
                parameter it steps (the blocks' matrices, sharded as they are), and, at its step, beside the
                gradients, its largest tensor made whole with the Newton-Schulz iteration's operands
                (muon_step_bytes)
  activations   the saved tensors of one micro-batch per layer (by AC mode), in the activation dtype
                (bf16 under mixed precision on GPUs), x the micro-batches a pipeline stage keeps in
                flight; under TP+SP divided by TP except the two gathered norm outputs per block. A
                linear-attention layer's are its chunked kernel's ([B, H, T/C, C, C] and [B, H, T, Dk or Dv]
                tensors and one [B, H, Dk, Dv] state per chunk): measured as the others, linear in T
  temporary     FSDP's unsharded parameters (ZeRO-2: all of them, kept from forward to backward;
                ZeRO-3: the largest unit twice, current and prefetched) and one unit's unsharded
                gradients for the reduce-scatter; the loss's full-vocabulary gradients in backward
  the loss      full logits (training.loss_chunk_tokens resolved to 0): the saved full-vocabulary tensors
                (activations) and, in backward, the float32 gradients of log-probabilities and logits
                (temporary); chunked (N > 0, titanlite/components/loss.py): no full-vocabulary tensor is saved;
                kept until backward, the gradients it computes in forward, of the hidden states [b*s, d]
                (activation dtype) and of the output weight [vocab/tp, d] (float32 over several chunks);
                temporary, one chunk's [N, vocab/tp] logits and float32 log-probabilities (and the
                logits' float32 copy under bf16; the vocabulary-parallel softmax of TP holds one more)

Peak = parameters + optimizer + the largest of three moments: the start of backward (kept activations,
the loss's gradients, FSDP buffers), the recomputation of a checkpointed block (kept activations and
that block's full ones), and the end of backward (gradients, FSDP buffers).

CPU offload (training.enable_cpu_offload; at one rank FSDP on a one-rank mesh, the ZeRO-Offload case):
FSDP keeps the sharded fp32 parameters, their gradients and both AdamW moments in host memory (`host`,
bytes per rank: 16 per sharded parameter), and AdamW steps there. The device then holds the gathered
parameters of the current and prefetched unit, one unit's unsharded gradients, the activations and the
loss's temporaries: the peak above without parameters, gradients and optimizer. Left out: each
parameter's transient fp32 copy to the device before its cast. Offloaded layouts are the last resort:
they are considered only when no layout fits on the devices, as their host-device copies (at the PCIe
bandwidth below, in the step time) and the CPU's optimizer step slow every step.

Communication per step and rank, ring algorithms ((n-1)/n of the data per all-gather/reduce-scatter,
twice that per all-reduce): DDP all-reduces gradients; FSDP all-gathers parameters (once under ZeRO-2,
twice under ZeRO-3) and reduce-scatters gradients; HSDP also all-reduces the shards across replicas;
TP all-gathers and reduce-scatters [b, s, d] activations 4 times per block in forward and in backward;
CP all-gathers each block's keys and values in forward (and in AC's recomputation) and reduce-scatters their
gradients in backward; PP sends each micro-batch's activations forward and their gradients back.

Time and tokens/s. Every layout runs the same global batch (global_batch: training.global_batch_size, else the
local batch x the config's own data-parallel degree), at the micro-batch that fits with the most tokens/s
(best_micro_batch). Compute = (FLOPs per token + AC's recomputation) x tokens per step / world, at ASSUMED_MFU of
the device's peak; full AC recomputes a third of the blocks' FLOPs (each block's forward again),
selective_layer with option k a k-th of that, selective_op nothing counted (pointwise work only). Step =
max(compute x (1 + bubble), data parallelism's collectives, which overlap with compute) + TP's, CP's and PP's
communication and CPU offload's copies (which do not); bubble = (pp - 1) / (micro-batches x stages per rank).
Tokens/s = global batch x seq_len / step. docs/planning.md compares these estimates with published runs.

Context parallelism (CP degree c): a rank holds seq_len / c tokens of each sequence, so the activations are
those of a sequence of seq_len / c tokens, plus, per block, the keys and values gathered from the other
ranks (2 x (c - 1) / c x [b, seq_len, kv_width / tp]), and one attention mask for all blocks (see
attention_mask_bytes; block-causal masks on one device too; none with model.attn_backend flex); FSDP shards
over dp_shard x c.

Mixtures of experts. A MoE block runs whole on every TP rank (titanlite/models/moe_decoder/parallelize.py): TP
divides neither its parameters nor the activations it saves, and its FLOPs (those of its active parameters,
moe_flops_per_token) are done tp times. Expert parallelism (EP degree e, ranks borrowed from dp_shard x cp) splits
each block's routed experts e ways and FSDP shards each share over efsdp = dp_shard x cp / e ranks: the experts'
weights, gradients and AdamW state per rank are divided by e x efsdp (`experts`, a part of params, grads and
optim), FSDP gathers 1/e of them (its temporary buffers, its all-gather and reduce-scatter over efsdp ranks), and
the rest of the model is sharded as without EP. The all-to-all buffers (`dispatch`, dispatch_bytes): the rows the
running MoE layer receives and sends back, [tokens x top_k, dim] each, one layer at a time. Traffic: per MoE layer
and micro-batch 2 all-to-alls in forward, 2 in backward (2 more where AC recomputes), each moving (e - 1) / e of
those rows, in the critical path (not overlapped), over NVLink when the e x tp ranks fit in a node.

Expert tensor parallelism (ETP = TP, titanlite/parallel/expert_tensor_parallel.py) splits each routed expert's and
shared expert's matrices over the TP ranks: their parameters, gradients and AdamW state per rank are divided by tp
too, their FLOPs are no longer repeated on every TP rank (the router's still are, left out), and the activations
the block saves are split but for the gathered tokens and the rows handed to the experts ([tokens x (top_k + 1),
dim], whole). Traffic beside TP's own per-block collectives (the block's all-gather in and reduce-scatter out are
the dense feed-forward's): in backward, per MoE layer and micro-batch, the all-reduce over TP of the experts' input
rows' gradients [tokens x top_k, dim] and of the shared expert's input gradients [tokens, dim], in the critical path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from titanlite.builder.layouts import (
    Layout,
    candidate_layouts,
    expert_parallel_layouts,
    expert_tensor_parallel_layouts,
    offload_layouts,
)
from titanlite.builder.model_facts import ModelFacts
from titanlite.components.loss import chunk_tokens
from titanlite.components.optim import muon_ns_dtype
from titanlite.models.common.indexer import chunk_elements
from titanlite.parallel.parallelize import loss_parallel_enabled

GIB = 2**30
# Per-GPU bandwidth assumed for the time column (GB/s, one direction, what NCCL's bus bandwidth reaches).
BANDWIDTH = {"nvlink": 360.0, "infiniband": 45.0, "pcie": 22.0}


@dataclass(frozen=True)
class Machine:
    """What the layouts are estimated for: `ngpu` devices (processes) on each of `nnodes` nodes."""

    ngpu: int
    nnodes: int = 1
    device: str = "cuda"  # 'cuda': bf16 activations under mixed precision; 'cpu': float32, as titanlite runs there
    interconnect: str = "nvlink"  # within a node (between nodes: infiniband)
    tflops: float = 989.0  # peak of one device, for the step-time column

    @property
    def world(self) -> int:
        return self.ngpu * self.nnodes


# ----------------------------------------------------------------------------------------------
# Estimates


@dataclass
class Setting:
    seq_len: int
    micro_batch: int  # sequences per forward/backward on one rank
    microbatches: int  # per optimizer step on one rank (accumulation x pipeline micro-batches)
    act_bytes: int  # bytes per activation element (2 under bf16 mixed precision on GPUs)
    param_gather_bytes: int  # bytes per parameter element in FSDP's all-gather (2 under bf16)
    loss_parallel: bool
    schedule: str
    stages_per_rank: int
    selective_ac_option: int
    loss_chunk: int = 0  # titanlite.components.loss.chunk_tokens: tokens per chunk of the chunked loss; 0: full logits
    block_causal: bool = False  # model.attn_mask_type: documents masked from each other
    compiled: bool = False  # compile.enable: the attention mask is built in each block's graph, not shared
    global_batch: int = 0  # sequences per optimizer step over all data-parallel ranks (the same for every layout)
    flex: bool = False  # model.attn_backend flex: block masks of a few bytes per block pair, no dense mask
    muon_ns_bytes: int = 2  # bytes per element of Muon's Newton-Schulz iteration (optimizer.muon_ns_dtype)
    device: str = "cuda"  # what the ranks run on (the chunk of a sparse layer's selection is the device's)


def stage_layers(n_layers: int, pp: int, stages_per_rank: int) -> list[list[int]]:
    """Layers held by each pp rank (titanlite's even split, stages placed looped)."""
    if pp == 1:
        return [list(range(n_layers))]
    stages = pp * stages_per_rank
    base, extra = divmod(n_layers, stages)
    bounds, start = [], 0
    for i in range(stages):
        size = base + (1 if i < extra else 0)
        bounds.append(list(range(start, start + size)))
        start += size
    return [sum((bounds[r + k * pp] for k in range(stages_per_rank)), []) for r in range(pp)]


def estimate(facts: ModelFacts, lay: Layout, s: Setting) -> dict:
    """Per-rank memory (bytes) by component for the rank with the largest peak, and per-step
    communication (bytes per rank) by collective."""
    worst = None
    stage_sets = stage_layers(facts.n_layers, lay.dims.pp, s.stages_per_rank if lay.dims.pp > 1 else 1)
    # Multi-token prediction's blocks (layers past the decoder's) go with the head on the last stage.
    stage_sets[-1] += list(range(facts.n_layers, len(facts.layer_params)))
    for pp_rank, layers in enumerate(stage_sets):
        first, last = pp_rank == 0, pp_rank == lay.dims.pp - 1
        est = estimate_rank(facts, lay, s, layers, first, last, pp_rank)
        if worst is None or est["peak"] > worst["peak"]:
            worst = est | {"pp_rank": pp_rank}
    assert worst is not None  # pp >= 1 stages
    return worst


def estimate_rank(facts, lay: Layout, s: Setting, layers: list[int], first: bool, last: bool, pp_rank: int) -> dict:
    tp, shard, cp, ep, etp = lay.dims.tp, lay.dims.view_degree("dp_shard_cp"), lay.dims.cp, lay.dims.ep, lay.dims.etp
    s = replace(s, seq_len=s.seq_len // cp)  # a context-parallel rank holds seq_len / cp tokens of each sequence

    def local(full: int, split: int) -> float:
        return (full - split) + split / tp

    layer_experts = facts.layer_experts or [0] * facts.n_layers
    # The routed experts (whole on every TP rank, split over ep by expert parallelism) apart from the rest; with
    # ETP a TP rank's share of their width, and of the shared experts'.
    experts = float(sum(layer_experts[i] for i in layers)) / etp
    n_params = sum(local(facts.layer_params[i], facts.layer_tp_split[i]) for i in layers) - experts * etp
    if etp > 1 and facts.layer_shared:
        n_params -= sum(facts.layer_shared[i] for i in layers) * (1 - 1 / etp)
    if first:
        n_params += local(*facts.ends["first"])
    if last:
        n_params += local(*facts.ends["last"])
    mtp = len(facts.layer_params) > facts.n_layers  # multi-token prediction embeds the tokens ahead on the last stage
    if last and (facts.tie or mtp) and lay.dims.pp > 1 and not first:
        n_params += local(*facts.ends["first"])  # the last stage's copy of the tied (or MTP's) embedding
    # FSDP shards the rest over dp_shard x cp, an expert-parallel rank's experts over the efsdp ranks
    # (ep x efsdp = dp_shard x cp: with FSDP, the same share of the experts as without expert parallelism).
    sharded_experts = experts / (ep * lay.dims.efsdp) if lay.dims.fsdp_enabled else experts
    sharded = n_params / shard + sharded_experts
    # Muon keeps one fp32 momentum per parameter it steps, AdamW two moments for the others.
    muon_experts = float(sum(facts.layer_muon_experts[i] for i in layers)) / etp if facts.layer_muon_experts else 0.0
    muon_sharded_experts = muon_experts / (ep * lay.dims.efsdp) if lay.dims.fsdp_enabled else muon_experts
    muon_rest = sum(local(facts.layer_muon[i], facts.layer_muon_split[i]) for i in layers) if facts.layer_muon else 0
    params = 4 * sharded
    optimizer = 2 * 4 * sharded - 4 * (muon_rest / shard + muon_sharded_experts)
    grads = 4 * sharded if lay.dims.fsdp_enabled else 4 * (n_params + experts)
    expert_states = (
        16 * sharded_experts - 4 * muon_sharded_experts
    )  # of params, grads and optimizer: the experts' fp32 weights, gradients, moments
    host = 0.0
    if lay.offload:  # FSDP keeps the shards, their gradients and AdamW's moments in host memory
        host, params, grads, optimizer, expert_states = params + grads + optimizer, 0.0, 0.0, 0.0, 0.0

    # Activations of one micro-batch on this rank, float32 as measured (per whole sequence: / cp for a
    # context-parallel rank's share), then in the activation dtype.
    scale = s.micro_batch * s.act_bytes / 4 / cp
    hidden = s.micro_batch * s.seq_len * facts.dim * s.act_bytes  # one [b, s, d] tensor
    # Context parallelism: each block's attention keeps the keys and values gathered from the other ranks.
    gathered_kv = 2 * s.micro_batch * s.seq_len * (cp - 1) * facts.kv_width / tp * s.act_bytes
    per_layer = []
    for i in layers:
        full = facts.act_layer[i] * scale
        moe = facts.act_layer_moe[i] * scale if facts.act_layer_moe else 0.0
        if tp > 1:  # sequence parallel: all but the two gathered norm outputs are split; a MoE block runs whole
            # (with ETP split too, but for the gathered tokens and the rows handed to the experts)
            whole = moe if etp == 1 else min(moe, hidden * (facts.top_k + 1))
            full = (full - moe - 2 * hidden) / tp + 2 * hidden + (moe - whole) / tp + whole
        per_layer.append(full + gathered_kv + (attention_mask_bytes(s, cp) if s.compiled else 0.0))
    recompute = 0.0
    if lay.ac == "full":
        kept = [hidden / tp for _ in layers]
        recompute = max(per_layer, default=0.0)
    elif lay.ac == "selective_layer":
        k = max(1, s.selective_ac_option)
        kept = [hidden / tp if j % k == 0 else a for j, a in enumerate(per_layer)]
        recompute = max(per_layer, default=0.0)
    elif lay.ac == "selective_op":
        kept = [facts.act_layer_sac[i] * scale / tp + hidden / tp for i in layers]
        recompute = max((a - k for a, k in zip(per_layer, kept)), default=0.0)
    else:
        kept = per_layer
    acts = sum(kept)
    if layers and not s.compiled:  # one mask, shared by the blocks that keep it for backward
        if lay.ac == "full":  # none keeps it: each block builds its own in forward and in recomputation
            recompute += attention_mask_bytes(s, cp)
        else:
            acts += attention_mask_bytes(s, cp)
    if first:
        acts += facts.act_first * scale / tp
    vocab_split = tp if s.loss_parallel else 1
    loss_grads = 0.0
    if last and s.loss_chunk > 0:
        acts += facts.act_last_hidden * scale / tp
        chunk_kept, loss_grads = chunked_loss_bytes(facts, s, tp)
        acts += chunk_kept
        if lay.dims.pp > 1:  # a pipeline stage keeps its output (the hidden states) for its backward
            loss_grads += hidden
    elif last:
        acts += facts.act_last_hidden * scale / tp + facts.act_last_vocab * s.micro_batch / vocab_split
        # Backward of the loss: the gradients of the log-probabilities and of the logits, float32
        # (loss parallelism's sharded cross-entropy keeps a third, its softmax, through backward).
        loss_grads = (3 if s.loss_parallel else 2) * s.micro_batch * s.seq_len * facts.vocab * 4 / vocab_split
        if lay.dims.pp > 1:  # a pipeline stage keeps its output (the logits) for its backward
            loss_grads += s.micro_batch * s.seq_len * facts.vocab * s.act_bytes / vocab_split
    in_flight = microbatches_in_flight(lay, s, pp_rank)
    activations = acts * in_flight

    fsdp_buffers = 0.0
    if lay.dims.fsdp_enabled:
        # Gathered, a rank holds the rest whole (its TP share) and its expert-parallel share of the experts.
        unsharded = (n_params + experts / ep) * s.param_gather_bytes
        unit = largest_unit(facts, tp, ep, etp)
        gather = unsharded if lay.reshard == "never" else min(unsharded, 2 * unit * s.param_gather_bytes)
        fsdp_buffers = gather + unit * 4  # + one unit's unsharded fp32 gradients
        if s.microbatches > 1 and lay.dims.pp == 1:
            # Without gradient sync on the first micro-batches, FSDP accumulates unsharded gradients.
            fsdp_buffers += unsharded
    # Expert parallelism's all-to-alls: the rows a MoE layer receives and the rows it sends back (dispatch_bytes).
    dispatch = dispatch_bytes(facts, lay, s) if any(layer_experts[i] for i in layers) else 0.0
    # Three moments: backward starts (all kept activations and the loss's gradients); a checkpointed
    # block is recomputed (its full activations beside the kept ones, the loss's gradients gone);
    # backward ends (all gradients).
    start_of_backward = activations + loss_grads + fsdp_buffers
    recomputing = activations + recompute + fsdp_buffers + dispatch  # a MoE block's forward again: its all-to-alls
    end_of_backward = grads + fsdp_buffers
    forward_end = activations + fsdp_buffers + dispatch  # the last MoE layer's forward, all activations kept
    if facts.index_heads and layers:  # a sparse layer's chunk of indexer scores, made and dropped in its forward
        working = selection_chunk_bytes(facts, s, cp)
        forward_end, recomputing = forward_end + working, recomputing + working
    if facts.chunked_attention and layers:  # a chunk's float32 scores and their softmax (compressed attention)
        working = 8.0 * chunk_elements(s.device)
        forward_end, recomputing = forward_end + working, recomputing + working
    # Muon's step: the gradients, and its largest tensor made whole (muon_step_bytes).
    muon_step = facts.muon_largest_tensor and layers
    optimizer_step = grads + muon_step_bytes(facts, ep, s.muon_ns_bytes) if muon_step else 0.0
    peak = params + optimizer + max(start_of_backward, recomputing, end_of_backward, forward_end, optimizer_step)
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer": optimizer,
        "activations": activations + recompute * (recomputing > start_of_backward),
        "temporary": max(loss_grads + fsdp_buffers, optimizer_step - grads),
        "dispatch": dispatch,
        "experts": expert_states,
        "peak": peak,
        "host": host,
        "in_flight": in_flight,
        "comm": communication(lay, s, n_params, experts, len(layers), facts, first, last, layers),
    }


def selection_chunk_bytes(facts, s: Setting, cp: int) -> float:
    """The indexer scores of one chunk of queries against every key of the sequence (float32): as many queries as
    keep them under the chunk size (models/common/indexer.py CHUNK_ELEMENTS), at most a rank's share."""
    per_query = s.micro_batch * facts.index_heads * s.seq_len * cp  # s.seq_len is a rank's share: keys are all
    return 4.0 * min(chunk_elements(s.device), per_query * s.seq_len)


def muon_step_bytes(facts, ep: int, ns_bytes: int = 2) -> float:
    """What Muon's step holds beside the weights, gradients and momenta, for its largest tensor (a stack of experts:
    this rank's 1/ep of them) of M elements, in the owner way (muon_orthogonalize_on's default; the every-rank way
    holds less): a round's n momentum-updated shards (M in all, float32), the same sent and the owner's matrix
    received (float32), its result, the result's shards sent back and received (bfloat16), and the Newton-Schulz
    iteration's operands for the largest matrix (the matrix, its Gram matrix and the polynomial of it), of ns_bytes
    each (optimizer.muon_ns_dtype)."""
    whole = facts.muon_largest_tensor / (ep if facts.muon_largest_tensor > facts.muon_largest_matrix else 1)
    return 3 * 4 * whole + 3 * 2 * whole + 3 * ns_bytes * facts.muon_largest_matrix


def largest_unit(facts, tp: int, ep: int, etp: int = 1) -> float:
    """Parameters of the largest FSDP unit as gathered on one rank: a block (the rest of it by TP, its routed experts,
    their own unit inside it, by expert parallelism and ETP) or the root (the ends)."""
    if not facts.layer_experts:
        return facts.largest_unit / tp
    blocks = [(p - e) / tp + e / (ep * etp) for p, e in zip(facts.layer_params, facts.layer_experts)]
    return max(blocks + [(facts.ends["first"][0] + facts.ends["last"][0]) / tp])


def dispatch_bytes(facts, lay: Layout, s: Setting) -> float:
    """Expert parallelism's buffers (titanlite/parallel/expert_parallel.py), for the one MoE layer running: the
    [tokens x top_k, dim] rows it receives from the ep ranks and the rows it sends back to them, in the activation
    dtype (tokens: the micro-batch's local ones, whole under TP: the MoE block runs on the gathered sequence). Only
    one layer's count: they are transient (the all-to-alls save nothing for backward, the reordering only its indices)
    and freed before the next layer runs; backward's two all-to-alls make a pair of the same size, as does AC's
    recomputation. The rows routed to a rank's experts equal on average the rows it sends (balanced routing); their
    saved activations are the experts' own, measured without expert parallelism, so not counted again."""
    if lay.dims.ep == 1:
        return 0.0
    rows = s.micro_batch * s.seq_len * facts.top_k
    return 2 * rows * facts.dim * s.act_bytes


def attention_mask_bytes(s: Setting, cp: int) -> float:
    """The explicit attention mask, in the activation dtype, which SDPA keeps for backward: [local tokens, all
    tokens] under context parallelism (shared by the micro-batch's sequences), [b, tokens, tokens] with
    block-causal documents. Built once per forward pass and shared by every block (one per block when
    compiled). Plain causal attention on whole sequences needs none, nor FlexAttention (its block mask holds a
    few bytes per 128 x 128 block pair). `s.seq_len`: local tokens."""
    if s.flex or (cp == 1 and not s.block_causal):
        return 0.0
    return (s.micro_batch if s.block_causal else 1) * s.seq_len * s.seq_len * cp * s.act_bytes


def chunked_loss_bytes(facts, s: Setting, tp: int) -> tuple[float, float]:
    """The chunked loss (titanlite/components/loss.py) on one rank: (bytes kept from its forward to backward, bytes of
    its largest transient). Kept: the gradients it computes in forward, of the hidden states [b*s, d] in
    the activation dtype (whole under TP: the hidden states are gathered) and of the output weight
    [vocab/tp, d] (float32 accumulated over several chunks, else the activation dtype). Transient, per
    chunk of min(N, b*s) tokens x vocab/tp (the chunked loss always splits the vocabulary over TP): the
    logits in the activation dtype, their float32 copy under bf16, the float32 log-probabilities; under
    TP the vocabulary-parallel softmax holds two float32 blocks at once ((z - max).exp()) instead of one.
    Each chunk's blocks are released before the next chunk's logits are made. With one chunk the weight's
    gradient comes after the chunk's transients are freed, so only the larger of the two counts. Measured
    (float32, debug model, seq 1024, batch 4): within 0.1 % of the peak with one chunk of 4096, several of
    1024 or 512, and under TP 2."""
    tokens = s.micro_batch * s.seq_len
    vocab = facts.vocab / tp
    one_chunk = tokens <= s.loss_chunk
    grad_hidden = tokens * facts.dim * s.act_bytes
    grad_weight = vocab * facts.dim * (s.act_bytes if one_chunk else 4)
    per_element = s.act_bytes + (4 if s.act_bytes < 4 else 0) + (8 if tp > 1 else 4)
    transient = min(s.loss_chunk, tokens) * vocab * per_element
    if one_chunk:
        transient = max(transient - grad_weight, 0.0)
    return grad_hidden + grad_weight, transient


def loss_path(s: Setting) -> str:
    return f"chunked loss, {s.loss_chunk} tokens a chunk" if s.loss_chunk > 0 else "full-logits loss"


def microbatches_in_flight(lay: Layout, s: Setting, pp_rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at once."""
    if lay.dims.pp == 1:
        return 1
    m = s.microbatches
    if s.schedule == "GPipe":
        return m
    if s.stages_per_rank == 1:  # 1F1B: rank r runs p - r forwards before its first backward
        return min(m, lay.dims.pp - pp_rank)
    # Looped and V-shaped schedules: about one round of p micro-batches per local stage, in stage units.
    return min(m, lay.dims.pp) * (1 + (s.stages_per_rank - 1) / s.stages_per_rank)


def communication(
    lay: Layout, s: Setting, n_params: float, experts: float, n_layers: int, facts, first: bool, last: bool, layers=()
) -> dict:
    """Bytes per step and rank by collective. `n_params`: the rank's parameters but the routed experts (its TP
    share), `experts`: the routed experts' (whole; expert parallelism splits them ep ways, then FSDP efsdp ways)."""

    def ring(n):
        return (n - 1) / n

    comm: dict[str, float] = {}
    # Gradients are synchronised once per step (on the last micro-batch); FSDP gathers parameters for
    # every micro-batch's forward (and, under ZeRO-3, its backward).
    accum = s.microbatches if lay.dims.pp == 1 else 1
    if lay.dims.ddp_enabled:
        comm["all-reduce"] = 2 * ring(lay.dims.dp_replicate) * 4 * (n_params + experts)
    gathers = 1 if lay.reshard == "never" else 2
    shard = lay.dims.view_degree("dp_shard_cp")  # FSDP shards over the data-parallel shards and the cp ranks
    ep, efsdp = lay.dims.ep, lay.dims.efsdp  # and an expert-parallel rank's experts over efsdp ranks
    if lay.dims.fsdp_enabled and shard > 1:  # FSDP on one rank communicates nothing
        elements = ring(shard) * n_params + (ring(efsdp) * experts / ep if efsdp > 1 else 0.0)
        comm["all-gather"] = gathers * accum * elements * s.param_gather_bytes
        comm["reduce-scatter"] = elements * 4
        if lay.dims.dp_replicate > 1:
            comm["all-reduce"] = 2 * ring(lay.dims.dp_replicate) * 4 * (n_params / shard + experts / (ep * efsdp))
    if lay.offload:  # fp32 shards to the device before each all-gather, their gradients back once
        comm["host<->device"] = (gathers * accum + 1) * 4 * (n_params + experts) / lay.dims.dp_shard
    moe_layers = sum(1 for i in layers if facts.layer_experts and facts.layer_experts[i])
    if ep > 1 and moe_layers:
        # Each MoE layer sends its routed rows [tokens x top_k, dim] to their experts' ranks and the results back:
        # 2 all-to-alls in forward, 2 in backward (and 2 more where AC recomputes the forward), each moving
        # (ep - 1) / ep of the rows off the rank (balanced routing). The counts' small all-to-all is left out.
        rows = s.micro_batch * s.seq_len * facts.top_k  # local tokens, whole under TP
        passes = 6 if lay.ac in ("full", "selective_layer") else 4
        volume = passes * ring(ep) * rows * facts.dim * s.act_bytes
        comm["ep all-to-all"] = volume * moe_layers * s.microbatches
    if lay.dims.tp > 1:
        hidden = s.micro_batch * s.seq_len * facts.dim * s.act_bytes
        per_layer = 8 * ring(lay.dims.tp) * hidden  # 2 all-gathers + 2 reduce-scatters, forward and backward
        comm["tp all-gather/reduce-scatter"] = per_layer * n_layers * s.microbatches
    if lay.dims.etp > 1 and moe_layers:
        # Backward: the experts' input rows' gradients [tokens x top_k, dim] and the shared expert's input's
        # [tokens, dim] all-reduced over TP (the routing weights' [tokens, top_k] left out).
        rows = s.micro_batch * s.seq_len * (facts.top_k + (1 if any(facts.layer_shared) else 0))
        volume = 2 * ring(lay.dims.tp) * rows * facts.dim * s.act_bytes
        comm["tp expert all-reduce"] = volume * moe_layers * s.microbatches
    if lay.dims.cp > 1:  # K and V gathered in forward (again when AC recomputes), their gradients reduce-scattered
        kv = 2 * s.micro_batch * s.seq_len * lay.dims.cp * facts.kv_width / lay.dims.tp * s.act_bytes  # whole sequence
        passes = 3 if lay.ac in ("full", "selective_layer") else 2
        comm["cp all-gather/reduce-scatter"] = passes * ring(lay.dims.cp) * kv * n_layers * s.microbatches
    if lay.dims.pp > 1:
        hidden = s.micro_batch * s.seq_len * facts.dim * s.act_bytes
        sends = (0 if last else 1) + (0 if first else 1)
        comm["send/recv"] = 2 * hidden * sends * s.microbatches
    return comm


# Collectives of data parallelism: FSDP prefetches the next unit's all-gather and reduce-scatters while the
# next block computes, DDP all-reduces its buckets during backward; they overlap with compute.
OVERLAPPED = ("all-gather", "reduce-scatter", "all-reduce")


def comm_seconds(lay: Layout, comm: dict, ngpu: int, nnodes: int, interconnect: str) -> tuple[float, float]:
    """Time to move the step's data at the assumed bandwidths, as (overlapped, exposed): TP within a node; data
    parallelism within a node when it fits in one, else across nodes; PP across nodes when there are several;
    CPU offload's copies over PCIe; expert parallelism's all-to-alls within a node when its ep ranks (ep x tp
    consecutive ranks: tp is the innermost dimension) fit in one, else across nodes. Data parallelism's collectives
    overlap with compute; TP's, CP's and EP's (in the critical path of each block), PP's sends and offload's copies
    do not."""
    intra, inter = BANDWIDTH[interconnect] * 1e9, BANDWIDTH["infiniband"] * 1e9
    dp_inside = lay.dims.dp_replicate * lay.dims.dp_shard * lay.dims.cp * lay.dims.tp <= ngpu
    overlapped = exposed = 0.0
    for kind, volume in comm.items():
        if kind == "host<->device":
            exposed += volume / (BANDWIDTH["pcie"] * 1e9)
        elif kind.startswith("ep"):
            exposed += volume / (intra if lay.dims.ep * lay.dims.tp <= ngpu or nnodes == 1 else inter)
        elif kind.startswith(("tp", "cp")):
            exposed += volume / intra
        elif kind == "send/recv":
            exposed += volume / (inter if nnodes > 1 else intra)
        else:
            overlapped += volume / (intra if dp_inside or nnodes == 1 else inter)
    return overlapped, exposed


def pipeline_bubbles(pp: int, microbatches: list[int]) -> list[tuple[int, int, float, float]]:
    """(p, m, idle relative to compute (p-1)/m, share of the step idle (p-1)/(m+p-1)) for GPipe and 1F1B."""
    return [(pp, m, (pp - 1) / m, (pp - 1) / (m + pp - 1)) for m in microbatches]


def global_batch(cfg, own: Layout) -> int:
    """Sequences per optimizer step, the user's: training.global_batch_size, else the local batch times the data-
    parallel degree of the config's own layout. Every layout the planner weighs does this much work per step."""
    t = cfg.training
    return t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * own.dims.dp


def setting_for(cfg, lay: Layout, world: int, device: str, micro_batch: int = 0, batch: int = 0) -> Setting:
    """Micro-batch size, micro-batches per step, dtypes and schedule for a layout of this config. `batch`: the
    global batch in sequences (0: the config's, at this layout's data-parallel degree); `micro_batch`: sequences
    per forward/backward (0: the config's own, training.local_batch_size or, under PP,
    pipeline_parallel_microbatch_size); the rest of a data-parallel rank's share is accumulated (under PP: more
    pipeline micro-batches)."""
    t = cfg.training
    dp = lay.dims.dp
    batch = batch or (t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp)
    per_rank = max(1, batch // dp)  # sequences one dp rank handles per step
    bf16 = device == "cuda" and t.mixed_precision_param == "bfloat16"
    p = cfg.parallelism
    if lay.dims.pp > 1:
        mbs = micro_batch or p.pipeline_parallel_microbatch_size
        microbatches = max(1, per_rank // mbs)
        schedule = p.pipeline_parallel_schedule
        stages = 1 if schedule in ("GPipe", "1F1B") else 2
    else:
        mbs = micro_batch or min(t.local_batch_size, per_rank)
        microbatches, schedule, stages = max(1, per_rank // mbs), "", 1
    loss_parallel = loss_parallel_enabled(lay.dims, p)
    return Setting(
        t.seq_len,
        mbs,
        microbatches,
        2 if bf16 else 4,
        2 if bf16 else 4,
        loss_parallel,
        schedule,
        stages,
        cfg.activation_checkpoint.selective_ac_option,
        chunk_tokens(t, cfg.compile, loss_parallel, schedule),
        cfg.model.attn_mask_type == "block_causal",
        cfg.compile.enable,
        per_rank * dp,
        cfg.model.attn_backend == "flex",
        2 if muon_ns_dtype(cfg.optimizer, device) == "bfloat16" else 4,
        device,
    )


# The largest micro-batch (sequences per forward/backward on one rank) the planner tries.
MAX_MICRO_BATCH = 64


def micro_batches(cfg, lay: Layout, batch: int) -> tuple[list[int], str]:
    """The micro-batch sizes a layout can run the global batch with (largest first), or [] and why not: its
    data-parallel degree must divide the batch, and under PP the micro-batches per step must suit the schedule
    (titanlite/parallel/pipeline.py: at least pp for GPipe and 1F1B, a multiple of pp for the others)."""
    dp, pp = lay.dims.dp, lay.dims.pp
    if batch % dp:
        return [], f"the data-parallel degree does not divide the global batch of {batch} sequences"
    per_rank = batch // dp
    sizes = [m for m in range(min(per_rank, MAX_MICRO_BATCH), 0, -1) if per_rank % m == 0]
    if pp > 1:
        single = cfg.parallelism.pipeline_parallel_schedule in ("GPipe", "1F1B")
        sizes = [m for m in sizes if per_rank // m >= pp and (single or (per_rank // m) % pp == 0)]
        if not sizes:
            return [], "too few sequences per pipeline for its schedule's micro-batches"
    return sizes, ""


def layout_rows(cfg, facts: ModelFacts, own: Layout, machine: Machine, fits) -> list[dict]:
    """The config's own layout as configured, then every candidate layout (the own one included) without AC, with
    the config's AC mode and with full AC, each at the micro-batch that fits and runs fastest, all at the config's
    global batch (global_batch), estimated for `machine`; fits(estimate) says whether one fits. When none fits on
    CUDA, the offloaded FSDP layouts follow (the last resorts)."""
    batch = global_batch(cfg, own)
    own_row = layout_row(cfg, facts, own, machine, fits, own=True, batch=batch)

    def rows_of(layouts: list[Layout]) -> list[dict]:
        out = []
        for lay in dict.fromkeys(layouts):
            for ac in dict.fromkeys(["none", own.ac, "full"]):
                l2 = replace(lay, ac=ac)
                if not layout_allowed(facts, l2, cfg):
                    continue
                row = best_micro_batch(cfg, facts, l2, machine, fits, batch)
                if row is not None and not same_run(row, own_row):
                    out.append(row)
        return out

    layouts = [own, *candidates(cfg, facts, machine)]
    rows = [own_row, *rows_of(layouts)]
    if machine.device == "cuda" and not any(r["fits"] for r in rows):
        rows += rows_of([lay for lay in offload_layouts(machine.ngpu, machine.nnodes) if lay != own])
    return rows


def candidates(cfg, facts: ModelFacts, machine: Machine) -> list[Layout]:
    """The machine's candidate layouts (candidate_layouts) and, for a mixture of experts, those again with expert
    parallelism (expert_parallel_layouts)."""
    layouts = candidate_layouts(machine.ngpu, machine.nnodes, cfg.training.seq_len, facts.n_layers)
    if not facts.n_experts:
        return layouts
    layouts += expert_parallel_layouts(layouts, facts.n_experts)
    return layouts + expert_tensor_parallel_layouts(layouts)


def same_run(a: dict, b: dict) -> bool:
    sa, sb = a["setting"], b["setting"]
    return a["layout"] == b["layout"] and (sa.micro_batch, sa.microbatches) == (sb.micro_batch, sb.microbatches)


def excluded_layouts(cfg, facts: ModelFacts, own: Layout, machine: Machine) -> dict[str, list[str]]:
    """Why not -> the candidate layouts that cannot run the config's global batch for that reason."""
    batch = global_batch(cfg, own)
    out: dict[str, list[str]] = {}
    for lay in candidates(cfg, facts, machine):
        refusal = ""
        if lay.dims.tp > 1 and facts.tp_refusal:  # the family cannot be split by TP at all
            refusal = f"tensor parallelism cannot split the {facts.tp_refusal}"
        elif lay.dims.pp > 1 and facts.pp_refusal:  # nor this model cut into pipeline stages
            refusal = f"pipeline parallelism cannot cut the {facts.pp_refusal}"
        if refusal:
            if lay.name not in out.get(refusal, []):
                out.setdefault(refusal, []).append(lay.name)
        elif layout_allowed(facts, lay, cfg):
            sizes, why = micro_batches(cfg, lay, batch)
            if not sizes and lay.name not in out.get(why, []):
                out.setdefault(why, []).append(lay.name)
    return out


def best_micro_batch(cfg, facts: ModelFacts, lay: Layout, machine: Machine, fits, batch: int) -> dict | None:
    """The layout's row at the micro-batch that fits with the most tokens/s (the larger on a tie: fewer, larger
    kernels); when none fits, at the smallest (the least memory). None when the layout cannot run the batch."""
    sizes, _ = micro_batches(cfg, lay, batch)
    rows = [layout_row(cfg, facts, lay, machine, fits, own=False, micro_batch=m, batch=batch) for m in sizes]
    if not rows:
        return None
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        return rows[-1]
    return max(fitting, key=lambda r: (round(r["tokens_s"], 6), r["setting"].micro_batch))


def layout_row(
    cfg, facts: ModelFacts, lay: Layout, machine: Machine, fits, own: bool, micro_batch: int = 0, batch: int = 0
) -> dict:
    """One layout's estimate, its step time at the assumed bandwidths and MFU, its tokens/s, and whether it fits."""
    s = setting_for(cfg, lay, machine.world, machine.device, micro_batch, batch)
    est = estimate(facts, lay, s)
    overlapped, exposed = comm_seconds(lay, est["comm"], machine.ngpu, machine.nnodes, machine.interconnect)
    seconds = overlapped + exposed
    compute = compute_seconds(facts, cfg, lay, s, machine.tflops)
    bubble = (lay.dims.pp - 1) / (s.microbatches * s.stages_per_rank) if lay.dims.pp > 1 else 0.0
    step = max(compute * (1 + bubble), overlapped) + exposed
    return {
        "layout": lay,
        "setting": s,
        "est": est,
        "comm_s": seconds,
        "exposed_s": step - compute * (1 + bubble),
        "compute_s": compute,
        "fits": fits(est),
        "own": own,
        "bubble": bubble,
        "step_s": step,
        "tokens_s": s.global_batch * s.seq_len / step,
    }


def batch_overrides(cfg, row: dict) -> list[str]:
    """The overrides that give a row's batch: the global batch, and the micro-batch (under PP: each pipeline's
    sequences per step and the pipeline micro-batch size), where they differ from the config."""
    s, lay, t = row["setting"], row["layout"], cfg.training
    wanted = {"--training.global_batch_size": s.global_batch}
    if lay.dims.pp > 1:
        wanted["--training.local_batch_size"] = s.global_batch // lay.dims.dp
        wanted["--parallelism.pipeline_parallel_microbatch_size"] = s.micro_batch
    else:
        wanted["--training.local_batch_size"] = s.micro_batch
    current = {
        "--training.global_batch_size": t.global_batch_size if t.global_batch_size > 0 else None,
        "--training.local_batch_size": t.local_batch_size,
        "--parallelism.pipeline_parallel_microbatch_size": cfg.parallelism.pipeline_parallel_microbatch_size,
    }
    if current["--training.global_batch_size"] is None and (
        s.global_batch == wanted["--training.local_batch_size"] * lay.dims.dp
    ):
        del wanted["--training.global_batch_size"]  # the default (local x dp, no accumulation) gives it
    return [x for key, value in wanted.items() if value != current[key] for x in (key, str(value))]


def verdict(cfg, rows: list[dict], pick: dict | None, budget: float) -> str:
    """One line on the config's own layout: the recommended one; fits, and how much slower than the recommended;
    or does not fit, by how much, and the smallest change that makes it fit (its AC, a smaller micro-batch with
    more accumulation), else the recommended layout."""
    own = next(r for r in rows if r["own"])
    lay, s = own["layout"], own["setting"]
    head = f"config ({lay.name}, AC {lay.ac}, {batch_shape(own)})"
    if pick is own:
        return f"{head}: is the recommended layout"
    if own["fits"]:
        if pick is None:
            return f"{head}: fits"
        ratio = pick["tokens_s"] / own["tokens_s"]
        other = f"the recommended layout ({pick['layout'].name}, AC {pick['layout'].ac})"
        if ratio < 1:
            return f"{head}: fits, {1 / ratio:.2f}x the estimated tokens/s of {other}, which is simpler"
        if ratio < 1.01:
            return f"{head}: fits, within 1 % of the estimated tokens/s of {other}"
        return f"{head}: fits; {ratio:.2f}x slower than {other}"
    line = f"{head}: does not fit ({own['est']['peak'] / GIB:.1f} GiB > {budget / GIB:.1f} GiB per rank)"
    same = [r for r in rows if r["fits"] and r["layout"].dims == lay.dims and r["layout"].reshard == lay.reshard]
    same = [r for r in same if not r["layout"].offload]
    if same:  # the config's own mesh: the fewest changes first (its AC kept, then the batch kept), then speed
        fix = min(
            same, key=lambda r: (r["layout"].ac != lay.ac, r["setting"].micro_batch != s.micro_batch, -r["tokens_s"])
        )
        change = (
            ["--activation_checkpoint.mode", fix["layout"].ac] if fix["layout"].ac != lay.ac else []
        ) + batch_overrides(cfg, fix)
        return f"{line}; fix: {' '.join(change)}"
    if pick is not None:
        return f"{line}; fix: use the recommended layout"
    return line


def batch_shape(row: dict) -> str:
    """'micro-batch 2 x 4 accumulation', or under PP 'micro-batch 1, 32 pipeline micro-batches'."""
    s, lay = row["setting"], row["layout"]
    if lay.dims.pp > 1:
        return f"micro-batch {s.micro_batch}, {s.microbatches} pipeline micro-batches"
    return f"micro-batch {s.micro_batch} x {s.microbatches} accumulation"


ASSUMED_MFU = 0.4


def rows_json(rows: list[dict]) -> dict:
    pick, why = recommend(rows)
    return {
        "rows": [
            {
                "layout": r["layout"].name,
                "ac": r["layout"].ac,
                "fits": r["fits"],
                "own": r["own"],
                "offload": r["layout"].offload,
                "loss_chunk_tokens": r["setting"].loss_chunk,
                "comm_bytes": r["est"]["comm"],
                "step_s": r["step_s"],
                "bubble": r["bubble"],
                "tokens_s": r["tokens_s"],
                "micro_batch": r["setting"].micro_batch,
                "microbatches": r["setting"].microbatches,
                "global_batch": r["setting"].global_batch,
            }
            | {
                k: r["est"][k]
                for k in (
                    "parameters",
                    "gradients",
                    "optimizer",
                    "activations",
                    "temporary",
                    "dispatch",
                    "experts",
                    "peak",
                    "host",
                )
            }
            | {"ep": r["layout"].dims.ep, "etp": r["layout"].dims.etp}
            for r in rows
        ],
        "recommended": None if pick is None else {"layout": pick["layout"].name, "ac": pick["layout"].ac, "why": why},
    }


def compute_seconds(facts: ModelFacts, cfg, lay: Layout, s: Setting, tflops: float) -> float:
    """One rank's share of the step's FLOPs (the global batch's tokens x FLOPs per token, plus what AC recomputes)
    at ASSUMED_MFU of `tflops`. Full AC re-runs each block's forward in backward: a third of the blocks' training
    FLOPs again (the output head is not checkpointed); selective_layer every k-th block's, 1/k of that;
    selective_op keeps the matmuls' and attention's outputs and recomputes only pointwise work, counted as none.
    A mixture-of-experts block runs whole on every TP rank (titanlite/models/moe_decoder/parallelize.py): its
    FLOPs (those of its active parameters) are done tp times over, unless expert tensor parallelism splits it."""
    tokens = s.global_batch * s.seq_len
    blocks = facts.flops_per_token - 6 * facts.vocab * facts.dim  # all but the output projection
    recompute = {"full": 1 / 3, "selective_layer": 1 / (3 * max(1, s.selective_ac_option))}.get(lay.ac, 0.0)
    # The MoE blocks' again on the other TP ranks, unless ETP splits them (its router's repeats, left out).
    repeated = (lay.dims.tp - 1) * facts.moe_flops_per_token if lay.dims.etp == 1 else 0.0
    flops = (facts.flops_per_token + repeated + recompute * (blocks + repeated)) * tokens
    return flops / lay.dims.world_size / (tflops * 1e12 * ASSUMED_MFU)


def layout_allowed(facts: ModelFacts, lay: Layout, cfg) -> bool:
    # The trainer's own condition (check_tp_degree): a family that refuses TP; heads, KV heads, FFN width,
    # vocabulary and sequence length.
    if lay.dims.tp > 1 and facts.tp_refusal:
        return False
    if lay.dims.pp > 1 and facts.pp_refusal:  # check_pp_degree
        return False
    if lay.dims.tp > 1 and any(size % lay.dims.tp for size in [*facts.tp_sizes.values(), cfg.training.seq_len]):
        return False
    if lay.dims.cp > 1 and cfg.training.seq_len % (2 * lay.dims.cp):  # check_cp_degree
        return False
    if lay.dims.pp > 1 and lay.dims.ddp_enabled:  # check_pipeline_data_parallel: PP takes FSDP or HSDP, not DDP
        return False
    if lay.dims.ep > 1 and (not facts.n_experts or facts.n_experts % lay.dims.ep):  # check_ep_degree
        return False
    if lay.dims.etp > 1 and (  # check_etp_degree and dims.check_etp
        not facts.n_experts
        or facts.etp_refusal
        or lay.dims.etp != lay.dims.tp
        or any(size % lay.dims.etp for size in facts.etp_sizes.values())
        or (lay.dims.ep > 1 and lay.dims.cp > 1)
    ):
        return False
    return lay.dims.pp <= facts.n_layers


PREFERENCE = ["DDP", "ZeRO-2", "ZeRO-3", "HSDP", "single"]


def simplicity(lay: Layout) -> tuple:
    """No CPU offload before offload, no AC before AC, no CP before CP (it cuts every sequence), fewer dimensions
    (expert parallelism counts as one), then DDP before ZeRO-2 before ZeRO-3."""
    used = sum(d > 1 for d in (lay.dims.dp, lay.dims.cp, lay.dims.tp, lay.dims.pp, lay.dims.ep))
    kind = 0 if lay.dims.ddp_enabled else 1 if lay.reshard == "never" else 2
    return (lay.offload, lay.ac != "none", lay.dims.cp > 1, used, lay.dims.tp, lay.dims.pp, kind)


def recommend(rows: list[dict]) -> tuple[dict | None, str]:
    """Among the layouts that fit: the most estimated tokens/s (the same global batch in every row, so the
    shortest step), or the simplest layout within 5 % of it (fewer dimensions, DDP before ZeRO-2 before ZeRO-3,
    no AC before AC)."""
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        return None, "nothing fits: add GPUs or nodes, shorten training.seq_len, lower training.local_batch_size"
    best = max(r["tokens_s"] for r in fitting)
    near = [r for r in fitting if r["tokens_s"] >= best / 1.05]
    pick = min(near, key=lambda r: (simplicity(r["layout"]), -r["tokens_s"]))
    lay, est = pick["layout"], pick["est"]
    world = lay.dims.world_size
    why = (
        f"fits with {est['peak'] / GIB:.1f} GiB per rank; {batch_shape(pick)}; estimated "
        f"{pick['tokens_s'] / world:,.0f} tokens/s per GPU ({pick['tokens_s']:,.0f} in all), step "
        f"{1e3 * pick['step_s']:.0f} ms ({1e3 * pick['comm_s']:.0f} ms of communication, "
        f"{1e3 * pick['exposed_s']:.0f} ms of it not hidden by compute, "
        f"{sum(est['comm'].values()) / 1e9:.2f} GB per rank"
        + (f", pipeline bubble {pick['bubble']:.0%}" if lay.dims.pp > 1 else "")
        + ")"
    )
    if lay.ac != "none":
        why += f"; needs activation_checkpoint.mode = '{lay.ac}' to fit"
    if lay.offload:
        why += (
            f"; needs training.enable_cpu_offload = true to fit, with {est['host'] / GIB:.1f} GiB of host memory "
            "per rank (its AdamW step runs on the CPU, not in the step time)"
        )
    return pick, why

"""The run configuration's sections: one dataclass per TOML section, each field's docstring its `--help` text.

Torch-free, like everything below it, so that parsing a config imports no torch.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

DEFAULT_CONFIG = "train_configs/debug_model.toml"
# Without --config, a run with model.flavor = "hf" on its command line starts from this one instead.
HF_DEFAULT_CONFIG = "train_configs/hf_continue.toml"


@dataclass
class Job:
    """Names the run and where its folder goes."""

    name: str = "debug"
    """Run name; the run folder is {dump_folder}/{name}/. Left unset with model.flavor = "hf", it is
    "hf-<folder name>" of model.hf_assets_path."""
    dump_folder: str = "checkpoints"
    """Root folder of run folders (config.toml, metrics.jsonl, tb/, checkpoints)."""
    description: str = ""
    """Free text describing the run; printed at start-up. Left unset with model.flavor = "hf", it names the
    family, the folder and the config file the run started from. A command line that sets model.name, model.flavor
    or model.hf_assets_path (another model than the config file's) and not this leaves the file's out."""


@dataclass
class Model:
    """Which model: a family and a size, or a Hugging Face folder, and the tokenizer."""

    name: str = "gpt2"
    """Model family: a registered spec (titanlite/models/registry.py; docs/models.md lists the families and
    their flavors). An unknown name is refused with the list of known ones."""
    custom_import: str = ""
    """A Python module imported before the model is resolved, which registers families defined outside
    titanlite (titanlite.models.registry.register; docs/models.md, "Adding a family")."""
    flavor: str = "debug"
    """Size within the family: one of its flavors (docs/models.md; an unknown one is refused with the family's
    list). A flavor only one family has selects that family when model.name is not set. Or "hf": the family,
    shape and every field that changes the math from model.hf_assets_path's config.json, its weights as the initial ones
    (when the run folder has no checkpoint), its tokenizer as the run's."""
    tokenizer: Literal["gpt2", "byte", "hf"] = "gpt2"
    """Tokenizer: "gpt2" (the GPT-2 BPE, shipped, works offline), "byte" (raw UTF-8 bytes) or "hf" (the
    tokenizer.json of model.hf_assets_path, with its BOS/EOS ids around each document; the default with
    flavor "hf" when the folder has one). Sets the vocabulary size of a named flavor."""
    hf_assets_path: str = ""
    """A Hugging Face model folder (config.json, model.safetensors or its sharded index, tokenizer.json), as
    TorchTitan names it: read with flavor "hf" or tokenizer "hf". Nothing is downloaded."""
    n_layers: int = 0
    """Override the flavor's number of transformer layers (0 keeps the flavor's)."""
    mtp_layers: int = -1
    """Multi-token prediction depths (DeepSeek-V3's sequential modules: each its own norms, projection and block,
    with the model's embedding and head; docs/models-moe.md#multi-token-prediction): -1 keeps what the flavor has
    (what a Hugging Face folder's config.json says, num_nextn_predict_layers; 0 for a named flavor), 0 trains
    without (a folder's MTP layers are then carried unchanged into its export), N > 0 adds N depths. Only a family
    whose config.json can say so takes N > 0 (DeepSeek-V3, GLM-4.5; Qwen3.5, Qwen3.5-MoE and Qwen3-Next one at
    most); with a folder, N must be its own count or 0. training.mtp_loss_coefficient weighs their losses."""
    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """Attention mask, as TorchTitan names it: "causal" lets a token attend to every earlier token of its
    window; "block_causal" only to earlier tokens of its own document (documents end at the tokenizer's
    end-of-text id, which the data path puts after each one), as Llama 3 was trained."""
    attn_backend: Literal["sdpa", "flex"] = "sdpa"
    """How attention computes (never what): "sdpa" is scaled_dot_product_attention, the fused flash/cuDNN kernel
    for plain causal attention, with a dense [B, 1, T, S] mask for anything else (block-causal, context
    parallelism), which grows as T x S; "flex" is FlexAttention, whose masks are functions of the token indices
    built into a block mask once per batch, never a T x S tensor, and which skips the blocks a mask leaves out:
    use it for block-causal masks and long sequences. On CUDA flex runs torch's compiled kernel; on the CPU (where
    torch has no FlexAttention backward) titanlite's blockwise loop, the same numbers to rounding."""
    linear_attn_backend: Literal["auto", "torch", "fla"] = "auto"
    """How the linear-attention layers' gated delta rule and the Mamba-2 layers' SSD scan compute (never what), in
    the hybrid families (Qwen3.5, Qwen3-Next, OLMo Hybrid, Kimi Linear; Nemotron-H, Granite 4.0 H, Falcon-H1):
    "torch" is titanlite's chunked PyTorch path (any device); "fla" is flash-linear-attention's Triton kernels (`pip
    install flash-linear-attention`; CUDA only, refused before launch elsewhere); "auto" takes "fla" on CUDA where it
    imports and its kernels, run once at start-up on a tiny input, agree with the PyTorch path, and "torch" otherwise;
    the start-up line says which and why. Context parallelism runs the PyTorch path (it hands each chunk its state)."""


@dataclass
class Training:
    """The run's length, batch, sequence length, corpus, precision and loss."""

    steps: int = 100
    """Number of optimizer steps; the LR schedule spans them."""
    local_batch_size: int = 8
    """Sequences per data-parallel rank per micro-batch."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks; -1 means local_batch_size x dp. Gradient
    accumulation makes up any difference, so it must be a multiple of local_batch_size x dp."""
    seq_len: int = 128
    """Tokens per sequence."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    dataset: str = "stdlib"
    """'stdlib' (built-in corpus: the Python standard library's source, no download), 'local'
    (files under dataset_path), or a Hugging Face hub dataset name (streamed; needs network)."""
    dataset_path: str = ""
    """Used when dataset = 'local': a file, a folder or a glob (e.g. "data/fineweb_train_*.bin"). Text
    (tokenised once into a prepared store): .txt, .jsonl/.json (JSON lines), each also as .gz/.zst/.bz2/.xz,
    .parquet, .arrow, or a `datasets` save_to_disk folder. Tokens (read in place): llm.c or nanoGPT .bin,
    .npy, or a Megatron indexed dataset (its path prefix, or the .bin beside its .idx)."""
    dataset_text_field: str = "text"
    """The JSON field or column that holds each document's text (e.g. "content" for The Stack), for local
    JSON lines, parquet and arrow files and hub datasets alike."""
    dataset_subset: str = ""
    """A hub dataset's subset (its config name, `datasets`' `name`), e.g. "sample-10BT" for
    HuggingFaceFW/fineweb-edu."""
    dataset_split: str = "train"
    """The split to train on: of a hub dataset, or of a `datasets` DatasetDict folder."""
    dataset_data_files: list[str] = field(default_factory=list)
    """A hub dataset's data files to read (`datasets`' `data_files`), e.g. ["data/CC-MAIN-2024-10/*"]."""
    dataset_data_dir: str = ""
    """A hub dataset's folder to read (`datasets`' `data_dir`)."""
    dataset_mixture: list[str] = field(default_factory=list)
    """Several sources with weights, each "SOURCE:WEIGHT" (SOURCE: a path as in dataset_path, 'stdlib'
    or 'hub:NAME'), e.g. ["data/web:0.7", "data/code:0.3"]; replaces dataset and dataset_path. Samples
    are drawn from the sources in proportion to the weights."""
    seed: int = 42
    """Seed for weight initialisation and data order; the same seed gives the same weights on any layout."""
    deterministic: bool = False
    """Use deterministic algorithms only (slower); also disables TF32."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Parameter/compute dtype on CUDA (FSDP MixedPrecisionPolicy, autocast otherwise). CPU runs use float32."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Gradient reduction dtype for FSDP on CUDA."""
    enable_cpu_offload: bool = False
    """Keep FSDP's sharded parameters, gradients and optimizer state in host memory (ZeRO offload), for
    models that do not fit on the GPUs even when sharded. Needs CUDA and FSDP: any layout with
    data_parallel_shard_degree > 1, or one GPU (where it turns on parallelism.fsdp_single_rank)."""
    memory_preflight: bool = True
    """Before launch, `titanlite check` (and so run_train.sh) estimates each rank's peak memory with the
    planner's model and refuses a layout that cannot fit the device (or, on the CPU, the available RAM
    shared by the node's ranks); false skips the check, for those who know better."""
    skip_nonfinite_steps: bool = False
    """On a NaN/inf loss or gradient norm, skip that step's update and go on (reported at the next log or
    checkpoint step), instead of stopping the run there. The update is skipped on the device by the
    fused AdamW, so optimizer.implementation must be 'auto' or 'fused'."""
    spike_factor: float = 0.0
    """0 (the default): off. F > 1: a step whose gradient norm (before clipping) is over F times the median of
    the last spike_window kept steps' norms is skipped like a non-finite one (which the guard also skips): no
    update, a line naming the step and its norm, "skipped_steps" in the metrics; its data counts as consumed and
    the LR schedule moves on. Decided on the device from global values, so every rank skips the same steps; the
    first spike_window steps are never skipped for a spike. Off by default: a skip changes the run, and the
    threshold is the model's to choose (OLMo-core's skipping optimizer is opt-in too)."""
    spike_window: int = 20
    """How many of the last kept (not skipped) steps' gradient norms the spike guard takes the median of."""
    max_skipped_steps_in_row: int = 5
    """Where steps are skipped (spike_factor, skip_nonfinite_steps): more than this many in a row stop the run,
    exit status 3, found at the next logging or checkpoint step and before anything is saved there."""
    loss_chunk_tokens: int = -1
    """N > 0: the output projection and cross-entropy are computed N tokens at a time, with their
    gradients, so the [batch, seq, vocab] logits never exist (titanlite/components/loss.py). 0: whole logits and
    F.cross_entropy (compiled when compile.components names 'loss'). -1 (auto): chunks of 4096 tokens,
    except where torch.compile fuses the plain loss, which was faster on an H100 (and uses more memory)."""
    mtp_loss_coefficient: float = 0.1
    """With multi-token prediction (model.mtp_layers): the loss is the main cross-entropy plus this times the mean of
    the D depths' cross-entropies (DeepSeek-V3's lambda, 0.3 then 0.1 in its report; Megatron-LM's
    mtp_loss_scaling_factor, whose default 0.1 this is). The logged `loss` stays the main cross-entropy; each depth's
    is logged beside it as mtp_loss (mtp_loss_1, mtp_loss_2, ... for several)."""
    indexer_loss_coefficient: float = 1.0
    """With sparse attention (deepseek_v32, glm_moe_dsa: each query reads the keys a lightning indexer selects): the
    weight of the indexer's loss in the training loss, the KL divergence from the attention's weights (summed over
    its heads) to the indexer's over the selected keys, averaged over the queries and summed over the layers. The
    indexer's input is detached from the model, so this trains the indexer alone. Logged unweighted as indexer_loss;
    0 logs it and trains the indexer by nothing (weight decay still applies to it as to every weight)."""
    indexer_dense_warmup: bool = False
    """With sparse attention: DeepSeek-V3.2's first stage, the attention dense and only the indexers trained (every
    other weight frozen), on their loss over every earlier key. Off (the default): sparse attention, the whole model
    trained."""
    stop_after_step: int = 0
    """End the run after this step, with a checkpoint, without changing the LR schedule that `steps`
    sets (for jobs split into fixed-length allocations); 0 runs to `steps`."""

    def skips_steps(self) -> bool:
        """Whether a bad step's update is skipped on the device (skip_nonfinite_steps, or the spike guard)."""
        return self.skip_nonfinite_steps or self.spike_factor > 0


@dataclass
class Data:
    """How token windows are prepared and fed to the step."""

    num_workers: int = 0
    """DataLoader worker processes per rank (0 reads in the training process)."""
    pin_memory: bool = True
    """Pin host batches for faster, non-blocking copies to CUDA (ignored on CPU)."""
    prefetch: int = 2
    """Micro-batches built (and pinned, on CUDA) ahead of the step in a background thread; 0 builds each
    one when the step asks for it."""
    shuffle: bool = True
    """Visit the packed windows in a seeded random order (per epoch) instead of corpus order."""
    cache_dir: str = ""
    """Where prepared token stores live; empty means $TITANLITE_CACHE_DIR or ~/.cache/titanlite."""
    prepare_workers: int = 0
    """Worker processes that tokenise a corpus into its store (titanlite prepare, or the first launch);
    0 uses every core."""
    shard_size_mb: float = 32.0
    """Source text per shard of a prepared store (the unit of parallel work and of resuming an
    interrupted prepare); it takes effect when a store is built."""
    verify_sources: bool = False
    """Before reusing a prepared store, re-hash every byte of its sources (normally size, mtime and a
    sampled fingerprint of each file are compared)."""
    skip_unsupported_files: bool = False
    """A local folder or glob holding files titanlite does not read (say README.md or urls.txt.gz's
    neighbours of another format) is refused, naming them; true leaves them out, and the start-up's data
    line names them. Hidden files (.name) are always left out."""


@dataclass
class Validation:
    """Periodic evaluation on held-out or separate text."""

    enable: bool = False
    """Evaluate the loss on held-out windows every `freq` steps and at the last step (val_loss,
    val_perplexity and val_tokens in the step's log line, metrics.jsonl and TensorBoard)."""
    freq: int = 100
    """Steps between evaluations; the last step is always evaluated."""
    steps: int = -1
    """Batches per evaluation (of each validation set, where there are several), each local_batch_size x dp
    windows; -1 evaluates every validation window once (the same windows on any layout)."""
    local_batch_size: int = 0
    """Validation windows per data-parallel rank per batch; 0 uses training.local_batch_size."""
    seq_len: int = 0
    """Tokens per validation window; 0 uses training.seq_len."""
    dataset: str = ""
    """Empty: the held-out split of the training corpus. Otherwise a separate corpus, named as
    training.dataset names one ('stdlib', 'local' with dataset_path, or a hub name); training then holds
    nothing out."""
    dataset_path: str = ""
    """A separate validation corpus, as training.dataset_path (implies dataset = 'local')."""
    dataset_split: str = "validation"
    """The split of a separate validation corpus: of a hub dataset or a `datasets` DatasetDict folder (a
    pre-tokenised folder gives its files named for validation, or all of them if it has none)."""
    dataset_subset: str = ""
    """A hub validation dataset's subset (config name)."""
    dataset_text_field: str = ""
    """The field or column of a separate validation corpus that holds the text; empty: as training's."""
    split_fraction: float = 0.01
    """Share of each training source held out for validation: its last tokens, from the end-of-text
    nearest that point (within half the share either way; else inside a document). Held out whether or not
    validation is enabled, so enabling it never changes the training data; 0 holds nothing out. A
    pre-tokenised folder with files named for validation (val.bin, fineweb_val_*.bin) holds none out: those
    files are its validation set."""


@dataclass
class Downstream:
    """Downstream tasks (HellaSwag, ARC, a task of your own) scored during training with lm-evaluation-harness: the
    `eval` extra, pip install -e .[eval]."""

    tasks: list[str] = field(default_factory=list)
    """lm-eval task names (e.g. ["hellaswag", "arc_easy"], a group such as "mmlu") or paths of task YAML files;
    empty: no downstream scoring. Scored every `interval` steps and at the last; each metric is logged as
    downstream/<task>/<metric>."""
    include_path: str = ""
    """A folder of task YAML files (lm-eval's --include_path) whose tasks `tasks` may name."""
    interval: int = 1000
    """Steps between scorings (at most training.steps); the last step is always scored."""
    limit: int = 0
    """Documents scored per task: the first N; 0: all of them."""
    num_fewshot: int = -1
    """Worked examples before each prompt; -1: each task's own setting."""
    batch_size: int = 0
    """Requests per data-parallel rank per forward; 0: the validation batch (validation.local_batch_size, else
    training.local_batch_size), which a pipeline-parallel run always uses."""


@dataclass
class Optimizer:
    """AdamW, or Muon for the hidden matrices beside AdamW for the rest, and their settings."""

    name: Literal["AdamW", "Muon"] = "AdamW"
    """Optimizer. 'Muon' orthogonalises each hidden matrix's momentum (Newton-Schulz; each expert's matrices
    separately) and steps the other parameters (embeddings, output head, routers, norms, biases) with AdamW at
    optimizer.lr; both follow the same LR schedule (docs/optimizers.md)."""
    lr: float = 3e-4
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices and embeddings only (not to biases or norms)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """AdamW kernel: 'auto' picks fused on CUDA (and wherever training.skip_nonfinite_steps is on) and
    foreach elsewhere."""
    muon_lr: float = 0.02
    """Muon's peak learning rate (the AdamW parameters keep optimizer.lr), before muon_adjust_lr's scaling."""
    muon_momentum: float = 0.95
    """Muon's momentum (an exponential average of the gradients, as torch.optim.Muon keeps it)."""
    muon_nesterov: bool = True
    """Orthogonalise Nesterov's look-ahead of the momentum rather than the momentum itself."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per orthogonalisation."""
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """The Newton-Schulz iteration's dtype: bfloat16 as torch.optim.Muon (and Keller Jordan's) run it, or float32,
    twice the memory and several times the time of its matmuls, whose layouts agree with one process to float32's
    reduction order (~1e-6 in the loss after 10 steps) where bfloat16 roundings of that order give ~1e-4. 'auto':
    bfloat16 on CUDA, float32 on the CPU, where titanlite computes in float32 throughout."""
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "original"
    """How a matrix's learning rate follows its shape A x B: 'original' (Keller Jordan's) multiplies muon_lr by
    sqrt(max(1, A / B)); 'match_rms_adamw' (Moonlight's) by 0.2 sqrt(max(A, B)), which gives the update AdamW's
    RMS, so muon_lr = optimizer.lr is a starting point."""
    muon_orthogonalize_on: Literal["owner", "every_rank"] = "owner"
    """Where a sharded matrix is orthogonalised (FSDP, TP, EP's experts split by FSDP): 'owner', one rank per
    matrix, which receives the others' shards and sends back theirs of the result (two all-to-alls per round of n
    same-shaped matrices over n ranks); 'every_rank', every rank that holds a shard, after an all-gather of each
    matrix. 'owner' sends 1.5/n of the bytes over n ranks (the result in bfloat16) and runs 1/n of the iterations
    per rank (scripts/muon_comm.py measures both; docs/optimizers.md); a matrix split over two mesh dimensions
    (FSDP x TP) is gathered either way."""
    muon_weight_decay: float = 0.1
    """Muon's decoupled weight decay (the AdamW parameters keep optimizer.weight_decay)."""
    muon_params: list[str] = field(default_factory=list)
    """Which parameters Muon steps, as name globs (fnmatch, e.g. 'layers.*.attention.*.weight'); empty: every
    linear weight and every stack of experts' matrices inside the blocks, but not the routers' gates. Each must
    be a matrix (2-D) or a stack of them; a vector named here is refused."""


@dataclass
class LRScheduler:
    """Warm-up, then a decay to a floor."""

    warmup_steps: int = 10
    """Linear warm-up steps from near zero to the peak learning rate. Longer than training.steps, it is cut to
    training.steps (a start-up line says so)."""
    decay_type: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay shape after warm-up, down to min_lr_factor x lr at the last step."""
    min_lr_factor: float = 0.1
    """Final learning rate as a fraction of the peak."""


@dataclass
class Parallelism:
    """The layout: data parallel (DDP, FSDP/HSDP), context, tensor and pipeline parallel degrees."""

    data_parallel_replicate_degree: int = 1
    """Replicas (DDP alone, or the outer dimension of HSDP). Beside pipeline parallelism only as HSDP:
    PP with DDP is refused (docs/parallelism.md)."""
    data_parallel_shard_degree: int = -1
    """FSDP shards; -1 means whatever is left of the world size."""
    fsdp_single_rank: bool = False
    """Apply FSDP on a single device too (a one-rank mesh): its bf16 mixed precision and, with
    training.enable_cpu_offload (which turns this on at one rank), ZeRO-Offload of the weights,
    gradients and AdamW state to host memory. Only for a single-device run (world size 1)."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """'always' frees gathered parameters after forward (ZeRO-3); 'never' keeps them (ZeRO-2);
    'default' is ZeRO-3 unless pipeline parallelism is on."""
    context_parallel_degree: int = 1
    """Ranks that split each sequence (context parallelism, for long sequences): each holds 2 of 2 x degree
    chunks of every sequence, and attention gathers the other ranks' keys and values. FSDP shards over
    data_parallel_shard_degree x this degree. training.seq_len must divide into 2 x degree chunks."""
    tensor_parallel_degree: int = 1
    """Ranks that split each layer (Megatron-style tensor parallelism, with sequence parallelism
    between blocks). Keep it within a node: it communicates twice per layer."""
    expert_parallel_degree: int = 1
    """Ranks that split each mixture-of-experts block's routed experts (expert parallelism): each holds
    n_experts / degree of them and tokens travel to their experts' ranks and back (all-to-all). The ranks are
    borrowed from data_parallel_shard_degree x context_parallel_degree, as TorchTitan does, so the degree must
    be a multiple of the context-parallel degree and divide that product; FSDP shards the experts over the
    rest. Only for families with mixture-of-experts blocks (docs/parallelism.md)."""
    expert_tensor_parallel_degree: int = 1
    """Ranks that split each routed expert's matrices (expert tensor parallelism, TorchTitan's key): 1 runs every
    mixture-of-experts block whole on each tensor-parallel rank; tensor_parallel_degree splits each expert's gate
    and up projections by columns and its down projection by rows over the tensor-parallel ranks, as a dense
    MLP's (the shared experts too), beside expert parallelism or without it (TorchTitan's DeepSeek-V3 671B layout:
    FSDP x TP 8, EP 1). No other value; the degree must divide the experts' intermediate widths. Default 1, as
    TorchTitan's, so a TP run's experts stay as they were (docs/parallelism.md)."""
    disable_loss_parallel: bool = False
    """Gather the full-vocabulary logits before the loss instead of computing the loss on the
    vocabulary shards (loss parallelism is on by default when tensor_parallel_degree > 1)."""
    enable_async_tensor_parallel: bool = False
    """Overlap tensor-parallel communication with compute (CUDA with torch.compile only): refused for now,
    as titanlite has not run it on a GPU yet (docs/parallelism.md)."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages' ranks: the model is cut into consecutive stages, one group of layers per rank
    (or several, for the looped and V-shaped schedules). Suits slow links between nodes."""
    pipeline_parallel_schedule: Literal[
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
    ] = "1F1B"
    """torch.distributed.pipelining schedule. GPipe and 1F1B run one stage per rank; the others run
    several (looped: stages r, r+pp, ...; ZBVZeroBubble and DualPipeV: two stages in a V)."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch; the local batch (times gradient accumulation) is cut into
    local_batch_size x accumulation / microbatch_size micro-batches."""
    pipeline_parallel_layers_per_stage: int = 0
    """Transformer layers per stage; 0 picks one stage per rank for GPipe/1F1B and two otherwise,
    splitting the layers as evenly as possible (earlier stages take any extra layer)."""
    pipeline_parallel_schedule_csv: str = ""
    """A schedule written as CSV (the format of torch's _PipelineScheduleRuntime) to run instead of a
    named one; stages are placed as for the looped schedules."""


@dataclass
class MoE:
    """Load balancing of a mixture-of-experts model (qwen3_moe, olmoe, mixtral, deepseek_v3); a key left at its default
    keeps the family flavor's value (with model.flavor = "hf", config.json's)."""

    balance: Literal["", "aux_loss", "bias", "none"] = ""
    """How the experts' load is balanced: "aux_loss" adds aux_loss_coef times the load-balancing loss to the
    training loss (transformers' families); "bias" (auxiliary-loss-free, DeepSeek-V3) adds a per-expert bias to
    the router's scores for choosing experts (never to their weights) and, after each step, moves it by
    bias_update_rate toward equal load over the step's tokens of all ranks; "none"; "" keeps the flavor's.
    Refused for a family without mixture-of-experts blocks, and changed on resume only with a fresh model."""
    aux_loss_coef: float = -1.0
    """Weight of the load-balancing loss, with balance "aux_loss" (config.json router_aux_loss_coef); -1 keeps
    the flavor's."""
    z_loss_coef: float = -1.0
    """Weight of the router z-loss, the mean over tokens of logsumexp(router logits)^2 (OLMoE's), with any
    balance; 0 turns it off, -1 keeps the flavor's."""
    bias_update_rate: float = -1.0
    """How far each expert's routing bias moves after each step, with balance "bias" (DeepSeek-V3 used 0.001):
    up for an expert that got fewer tokens than the mean, down for one that got more; -1 keeps the flavor's."""
    experts_kernel: Literal["auto", "loop"] = "auto"
    """How the routed experts compute: "auto" runs each block's experts as one torch.nn.functional.grouped_mm
    wherever it runs for the device and dtype (CUDA sm90+ in bfloat16; the CPU in torch 2.9+), else a loop over the
    experts; "loop" always loops (the same numbers; for comparing the two, e.g. tokens/s on a GPU)."""


@dataclass
class ActivationCheckpoint:
    """Recompute activations in backward to save memory."""

    mode: Literal["none", "full", "selective_layer", "selective_op"] = "none"
    """Recompute activations in backward instead of keeping them: 'full' for every block,
    'selective_layer' for every selective_ac_option-th block, 'selective_op' keeps matmul and attention
    outputs and recomputes the cheap ops in between."""
    selective_ac_option: int = 2
    """With mode 'selective_layer': checkpoint every this many blocks (1 = every block)."""


@dataclass
class Compile:
    """torch.compile of the blocks and the loss."""

    enable: bool = False
    """torch.compile each transformer block (fullgraph), and the loss if components names it."""
    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: 'model' (per block) and/or 'loss'."""
    backend: str = "inductor"
    """torch.compile backend: 'inductor' generates kernels (CUDA and CPU); 'aot_eager' only traces,
    which compiles in seconds and suits correctness checks."""
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """Inductor's mode for the blocks and the plain loss: 'reduce-overhead' replays each compiled block as a
    CUDA graph (fewer kernel launches; CUDA only; refused with gradient accumulation or pipeline parallelism),
    'max-autotune' also benchmarks matmul and kernel configurations while compiling (minutes longer); needs
    backend 'inductor'."""


@dataclass
class Float8:
    """Float8 matmuls through torchao (H100 and later)."""

    enable: bool = False
    """Run the transformer blocks' linear layers in float8 through torchao (pip install '.[float8]').
    Faster on GPUs of compute capability 8.9+ (H100, H200, L4); on the CPU it runs for correctness only."""
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """torchao's scaling recipe: 'tensorwise' (one scale per tensor, fastest, float8 FSDP all-gather),
    'rowwise' (one scale per row, more accurate), 'rowwise_with_gw_hp' (rowwise, weight gradients in high
    precision)."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers whose name contains one of these stay in high precision. The output projection (the
    model's head, which the losses apply) always does, whatever this list says, and so do a mixture of experts'
    routers and layers whose dimensions (per tensor-parallel shard) are not multiples of 16. The routed experts'
    grouped matmuls are not linear layers and stay in the training dtype."""
    emulate: bool = False
    """Emulate float8 matmuls in high precision: for GPUs below compute capability 8.9 (no speed-up)."""
    fsdp_float8_all_gather: bool = True
    """Under FSDP with the tensorwise recipe, all-gather the weights in float8 (half the bytes of bf16)."""


@dataclass
class Checkpoint:
    """Sharded DCP checkpoints, resume, exports and the initial weights."""

    enable: bool = False
    """Save DCP checkpoints to step-<N>/ in the run folder, and resume from the newest complete one."""
    interval: int = 500
    """Save every this many steps; the last step (or training.stop_after_step) is always saved."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """'disabled' saves before the next step; 'async' copies the state on the training thread and writes it
    in a background thread while training goes on; 'async_with_pinned_mem' copies it into reused pinned
    host buffers (shared, unpinned ones on the CPU) and writes it from DCP's background process, also for
    one process (given a one-rank process group). docs/checkpointing.md compares their costs."""
    keep_latest_k: int = 0
    """Keep only the newest k complete checkpoints (0 keeps all); the newest is never deleted."""
    load_step: int = -1
    """Resume from this step's checkpoint; -1 takes the newest complete one. One older than the run folder's newest
    is refused (training on from it would overwrite the newer ones): branch from it in a run folder of its own with
    initial_load_path and initial_load_model_only = false."""
    model_only: bool = False
    """Save only the model weights (in export_dtype) at the last step, for export or fine-tuning."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weight dtype of model_only checkpoints and Hugging Face exports."""
    export_max_shard_gb: float = 5.0
    """A Hugging Face export larger than this is split into model-0000i-of-0000n.safetensors files listed by
    model.safetensors.index.json (as save_pretrained does)."""
    export_quantized: bool = False
    """convert to-hf writes the weights that the FP8 folder the run started from held quantized in its format again
    (e4m3 with a scale_inv per block of its weight_block_size, computed from the trained weights) and keeps its
    quantization_config, so the export is served as the original was; the other tensors in export_dtype. Only for
    a run that started from an fp8 folder (model.flavor "hf" or checkpoint.initial_load_path)."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts of a checkpoint not to restore, e.g. ["optimizer", "lr_scheduler", "dataloader", "train_state"]."""
    start_from_scratch: bool = False
    """Train from step 0 although the run folder holds checkpoints: they are not loaded (start-up lists them),
    and saves at their steps replace them. Without it, a run folder whose checkpoints are all unusable is an
    error, not a silent restart."""
    initial_load_path: str = ""
    """Weights to start from when the run folder has no checkpoint: a DCP checkpoint folder (step-N)
    or a Hugging Face folder (config.json + safetensors)."""
    initial_load_model_only: bool = True
    """With false, initial_load_path's DCP checkpoint is loaded whole (optimizer, LR schedule, data position, step;
    less checkpoint.exclude_from_loading's parts), as a resume would: a branch of a run from an older checkpoint in
    a run folder of its own, which leaves the original run's checkpoints and metrics untouched."""


@dataclass
class Comm:
    """Collective timeouts: a dead or hung peer stops the job."""

    init_timeout_seconds: float = 300.0
    """Timeout of collectives until the first step ends (start-up, compilation, checkpoint loading)."""
    train_timeout_seconds: float = 100.0
    """Timeout of each collective after the first step: a dead or hung peer stops the job within this time."""


@dataclass
class Metrics:
    """What is logged, how often and where."""

    log_freq: int = 10
    """Log every this many steps (and always the last step)."""
    enable_tensorboard: bool = False
    """Also write the metrics as TensorBoard scalars under tb/ in the run folder."""
    enable_wandb: bool = False
    """Also log the metrics and the resolved config to Weights & Biases from rank 0 (`pip install -e .[wandb]`,
    then `wandb login`, or WANDB_MODE=offline to keep the run under wandb/ in the run folder for `wandb sync`).
    The W&B run id is kept in the run folder (wandb_run_id), so a resumed run continues the same W&B run."""
    wandb_project: str = "titanlite"
    """The W&B project the run is logged to (the entity: WANDB_ENTITY, else your default)."""
    wandb_run_name: str = ""
    """The W&B run's display name; "" uses job.name."""
    wandb_tags: list[str] = field(default_factory=list)
    """Tags of the W&B run, e.g. ["fsdp", "baseline"]."""
    throughput_warmup_steps: int = 2
    """The first steps, excluded from tokens/s, TFLOPs and MFU (allocation, compilation)."""
    peak_tflops: float = 0.0
    """Peak dense bf16 TFLOP/s of one device for MFU; 0 looks the device up in a table (unknown: no MFU)."""


@dataclass
class Profiling:
    """torch.profiler traces of chosen steps."""

    enable_profiling: bool = False
    """Record torch.profiler traces (one Chrome trace per rank per profiled window) into the run folder."""
    profile_freq: int = 10
    """Profile the last profile_active_steps steps of every profile_freq steps (after one warm-up step)."""
    profile_active_steps: int = 1
    """Steps recorded in each profiled window."""
    save_traces_folder: str = "profile"
    """Folder in the run folder for traces (iteration_<step>/rank<r>_trace.json) and memory snapshots."""
    enable_memory_snapshot: bool = False
    """CUDA only: record allocator history and write a snapshot pickle at each profiled window, for
    https://pytorch.org/memory_viz (skipped with a note on CPU)."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    data: Data = field(default_factory=Data)
    validation: Validation = field(default_factory=Validation)
    downstream: Downstream = field(default_factory=Downstream)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    moe: MoE = field(default_factory=MoE)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)


# ----------------------------------------------------------------------------------------------
# Field docs and types


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (Python keeps none at run time, so read the source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef)  # the source of a class
    body = node.body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            assert isinstance(node.target, ast.Name)  # a dataclass field
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        return "list of " + type_name(typing.get_args(tp)[0])
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))

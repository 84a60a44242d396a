"""The planner's facts about a model, measured on the meta device (no memory): parameters per block and at
the ends (and which of them tensor parallelism splits, which are routed experts), FLOPs per token, and the bytes
autograd saves for backward, per block (and of those, inside its mixture of experts), by running forward and the
loss on meta tensors, so the figures follow the model code rather than a rule of thumb. `cached_model_facts` keeps
them per model shape and code version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from titanlite.builder.data import cache_dir
from titanlite.builder.model import plain_model
from titanlite.builder.plan import ModelPlan
from titanlite.components.loss import cross_entropy
from titanlite.components.metrics import flops_per_token
from titanlite.components.muon import muon_parameters, unwrapped_name
from titanlite.models.common.auxiliary import AuxiliaryLosses, collecting
from titanlite.models.common.compressed_attention import CompressedAttention
from titanlite.models.common.flops import active_parameters
from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.moe.layer import GroupedExperts, MoE
from titanlite.models.registry import spec_of
from titanlite.parallel.activation_checkpoint import SAVE_OPS
from titanlite.parallel.expert_tensor_parallel import etp_split_sizes
from titanlite.parallel.tensor_parallel import tp_refusal, tp_split_sizes

logger = logging.getLogger(__name__)
# From this many blocks on, measuring them is said first: each costs tens of milliseconds on the meta device (a
# minute or more for the 1,000 model.n_layers allows), which would otherwise pass in silence.
SAID_BLOCKS = 64


@dataclass
class ModelFacts:
    family: str
    dim: int
    vocab: int
    n_layers: int
    tie: bool
    layer_params: list[int]  # full parameter count per block
    layer_tp_split: list[int]  # of those, the ones TP splits
    ends: dict[str, tuple[int, int]]  # first/last: (params, TP-split params), outside the blocks
    largest_unit: int  # params of the largest FSDP unit (a block or the root)
    act_layer: list[float] = field(default_factory=list)  # saved bytes per block, per sequence, float32
    act_layer_sac: list[float] = field(default_factory=list)  # of those, what selective-op AC keeps
    act_first: float = 0.0  # saved before the first block (embeddings), per sequence
    act_last_hidden: float = 0.0  # saved after the last block, except full-vocabulary tensors
    act_last_vocab: float = 0.0  # saved full-vocabulary tensors (logits path), per sequence
    flops_per_token: float = 0.0  # training FLOPs per token (metrics.flops_per_token)
    tp_sizes: dict[str, int] = field(default_factory=dict)  # what a TP degree must divide (tp_split_sizes)
    kv_width: int = 0  # key (and value) channels per token: KV heads x head_dim (what context parallelism gathers)
    tp_refusal: str = ""  # why the family cannot be split by TP at all (its spec's tp_refusal); "": it can
    pp_refusal: str = ""  # why the model cannot be cut into pipeline stages (its spec's pp_refusal); "": it can
    active_params: int = 0  # what one token uses (flops.active_parameters): below params for a mixture of experts
    # Mixtures of experts (0 and empty lists for a dense model). Neither TP nor the norms' rule splits a MoE block:
    # it runs whole on every TP rank, unless ETP splits its experts; expert parallelism splits its routed experts.
    layer_experts: list[int] = field(default_factory=list)  # routed experts' parameters per block (0: dense block)
    n_experts: int = 0  # routed experts per MoE block
    top_k: int = 0  # experts per token
    moe_flops_per_token: float = 0.0  # of flops_per_token, the MoE blocks' (active parameters): TP repeats them
    act_layer_moe: list[float] = field(default_factory=list)  # of act_layer, saved inside the MoE block (whole
    # under TP: the block runs on the gathered sequence)
    # Expert tensor parallelism (ETP = TP) splits the routed experts and the shared experts' matrices over TP.
    layer_shared: list[int] = field(default_factory=list)  # the shared experts' parameters per block
    etp_sizes: dict[str, int] = field(default_factory=dict)  # what an ETP degree must divide (the experts' widths)
    etp_refusal: str = ""  # why the family's experts cannot be split over TP (its spec's etp_refusal); "": they can
    # Muon (optimizer.name = "Muon"; empty and 0 under AdamW): per block, the parameters Muon steps (one fp32
    # momentum each, where AdamW keeps two moments) outside the routed experts, of those the ones TP splits, and the
    # routed experts' ones; the largest tensor Muon makes whole at once (a stack of experts: all of it) and the
    # largest single matrix it orthogonalises, in elements.
    layer_muon: list[int] = field(default_factory=list)
    layer_muon_split: list[int] = field(default_factory=list)
    layer_muon_experts: list[int] = field(default_factory=list)
    muon_largest_tensor: int = 0
    # Sparse attention (a lightning indexer's layers): the indexer's heads, whose scores of a chunk of queries against
    # every key are the largest tensor its layer makes and drops (models/common/latent/sparse.py select); 0: none.
    index_heads: int = 0
    # Attention computed a chunk of queries at a time (DeepSeek-V4's compressed attention: its chunks' scores and
    # their softmax, at most about chunk_elements each, made and dropped in its forward and again in its recompute).
    chunked_attention: bool = False
    muon_largest_matrix: int = 0

    @property
    def params(self) -> int:
        return sum(self.layer_params) + self.ends["first"][0] + self.ends["last"][0]


TP_SPLIT = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "tok_embeddings", "pos_embeddings", "output")


def tp_splits(name: str, shape, whole: tuple[str, ...] = ()) -> bool:
    """Whether the tensor-parallel plan splits this parameter (row-wise biases and norms stay whole, and so does
    everything under the module prefixes `whole`: a mixture of experts runs whole on every TP rank)."""
    if name.startswith(whole):
        return False
    parts = name.split(".")
    if not any(p in TP_SPLIT for p in parts):
        return False
    return not (parts[-1] == "bias" and parts[-2] in ("wo", "w2"))


def model_facts(cfg, planned: ModelPlan) -> ModelFacts:
    """The planned model's facts at training.seq_len (the length its arguments were planned for), measured on
    the meta device."""
    seq_len = cfg.training.seq_len
    with torch.device("meta"):
        model = plain_model(cfg, planned)
    args = model.args
    layer_params, layer_split, layer_experts, layer_shared, moe_params = [], [], [], [], 0.0
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for block in model.layers.values():
        named = list(block.named_parameters())
        whole = tuple(f"{n}." for n, m in block.named_modules() if isinstance(m, MoE))
        layer_params.append(sum(p.numel() for _, p in named))
        layer_split.append(sum(p.numel() for n, p in named if tp_splits(n, p.shape, whole)))
        layer_experts.append(
            sum(p.numel() for m in block.modules() if isinstance(m, GroupedExperts) for p in m.parameters())
        )
        shared = [m.shared_expert for m in block.modules() if isinstance(m, MoE) and m.shared_expert is not None]
        layer_shared.append(sum(p.numel() for m in shared for p in m.parameters()))
    for moe in moes:  # active parameters per token: top_k / n_experts of the routed experts, the rest whole
        routed = sum(p.numel() for p in moe.experts.parameters())
        moe_params += sum(p.numel() for p in moe.parameters()) - routed * (1 - moe.args.top_k / moe.args.n_experts)
    seen, ends = set(), {"first": [0, 0], "last": [0, 0]}
    for name, p in model.named_parameters(remove_duplicate=True):
        if name.startswith("layers.") or id(p) in seen:
            continue
        seen.add(id(p))
        where = "first" if name.startswith(("tok_embeddings", "pos_embeddings")) else "last"
        ends[where][0] += p.numel()
        ends[where][1] += p.numel() if tp_splits(name, p.shape) else 0
    root = ends["first"][0] + ends["last"][0]
    facts = ModelFacts(
        cfg.model.name,
        args.dim,
        args.vocab_size,
        args.n_layers,
        args.tie_embeddings,
        layer_params,
        layer_split,
        {k: (v[0], v[1]) for k, v in ends.items()},
        max(max(layer_params), root),
        flops_per_token=flops_per_token(model, seq_len),
        tp_sizes=tp_split_sizes(args),
        kv_width=getattr(args, "n_kv_heads", args.n_heads) * args.head_dim,
        tp_refusal=tp_refusal(args) or "",
        pp_refusal=spec_of(args).pp_refusal(args) or "",
        active_params=active_parameters(model),
        layer_experts=layer_experts,
        n_experts=moes[0].args.n_experts if moes else 0,
        top_k=moes[0].args.top_k if moes else 0,
        moe_flops_per_token=6.0 * moe_params,
        layer_shared=layer_shared if moes else [],
        etp_sizes=etp_split_sizes(moes[0].args) if moes else {},
        etp_refusal=spec_of(args).etp_refusal(args) or "",
        index_heads=indexer.n_heads if (indexer := getattr(args, "indexer", None)) is not None else 0,
        chunked_attention=any(isinstance(m, CompressedAttention) for m in model.modules()),
    )
    if cfg.optimizer.name == "Muon":
        count_muon(model, facts, cfg.optimizer.muon_params)
    measure_saved_tensors(model, facts, seq_len)
    return facts


def count_muon(model: DecoderModule, facts: ModelFacts, globs: list[str]) -> None:
    """Fill in the Muon fields of `facts`: which of the blocks' parameters Muon steps (muon_parameters), by block."""
    chosen = {unwrapped_name(n): p for n, p in muon_parameters(model, globs)}
    for index, block in model.layers.items():
        whole = tuple(f"{n}." for n, m in block.named_modules() if isinstance(m, MoE))
        experts = {id(p) for m in block.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
        named = [(n, p) for n, p in block.named_parameters() if f"layers.{index}.{n}" in chosen]
        facts.layer_muon.append(sum(p.numel() for _, p in named if id(p) not in experts))
        facts.layer_muon_split.append(
            sum(p.numel() for n, p in named if id(p) not in experts and tp_splits(n, p.shape, whole))
        )
        facts.layer_muon_experts.append(sum(p.numel() for _, p in named if id(p) in experts))
    facts.muon_largest_tensor = max((p.numel() for p in chosen.values()), default=0)
    facts.muon_largest_matrix = max((p.shape[-2] * p.shape[-1] for p in chosen.values()), default=0)


class FlashAttentionOnMeta(TorchFunctionMode):
    """On meta tensors scaled_dot_product_attention falls back to the math path, which saves the
    [heads, s, s] attention matrix; real runs use a flash kernel (CPU and CUDA), which saves the output
    and the log-sum-exp only. While this mode is on, each call without a mask goes to the CPU flash kernel,
    whose meta version saves the same (a TorchFunctionMode: torch's own hook, nothing of torch replaced)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self.flash(*args, **kwargs)

    @staticmethod
    def flash(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kwargs
    ):
        # The flash kernels read grouped keys and values as they are (enable_gqa): no per-head copy is saved.
        if attn_mask is not None or dropout_p or kwargs:
            return F.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa, **kwargs,
            )  # fmt: skip
        flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return flash_cpu(query, key, value, 0.0, is_causal, scale=scale)[0]


def measure_saved_tensors(model, facts: ModelFacts, seq_len: int) -> None:
    """Run forward and the loss on meta tensors for one sequence and record the bytes autograd saves
    for backward: per block, and before/after the blocks; also which of them selective-op AC keeps."""
    # Storages are keyed by their Python object's id: torch keeps one object per storage while it lives (views share
    # it), and every storage here stays alive until the measurement ends (the model's, the inputs, `alive`).
    params = {id(p.untyped_storage()) for p in model.parameters()}
    produced_by: dict[int, object] = {}
    region = ["first"]
    # Selective-op AC stores every output of its save ops, also those autograd itself does not save
    # (the attention and MLP output projections, whose outputs only feed residual adds).
    sac_outputs: dict[int, tuple[str, float]] = {}
    alive = []  # every output kept referenced (meta: no memory), so no storage id is reused for another

    class Producers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    alive.append(t)
                    key = id(t.untyped_storage())
                    produced_by.setdefault(key, func)
                    if func in SAVE_OPS:
                        sac_outputs.setdefault(key, (region[0], float(t.untyped_storage().nbytes())))
            return out

    saved: dict[int, tuple[str, float, bool, bool, bool]] = {}
    in_moe = [False]  # inside a mixture-of-experts block (what TP leaves whole)

    def pack(t):
        key = id(t.untyped_storage())
        if key not in params and key not in saved:
            vocab = t.dim() > 0 and t.shape[-1] == facts.vocab
            nbytes = float(t.untyped_storage().nbytes())
            saved[key] = (region[0], nbytes, produced_by.get(key) in SAVE_OPS, vocab, in_moe[0])
        return t

    for key, block in model.layers.items():
        block.register_forward_pre_hook(lambda mod, inp, key=key: region.__setitem__(0, key))
        block.register_forward_hook(lambda mod, inp, out: region.__setitem__(0, "last"))
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.register_forward_pre_hook(lambda mod, inp: in_moe.__setitem__(0, True))
        moe.register_forward_hook(lambda mod, inp, out: in_moe.__setitem__(0, False))
    tokens = torch.zeros(1, seq_len + 1, dtype=torch.long, device="meta")
    # Multi-token prediction's depths run as in training (after the decoder's blocks: their own blocks' saved
    # tensors by their keys, the rest, their head's logits included, with the last stage's).
    depth = getattr(model, "mtp_layers", 0)
    ahead = {"mtp_tokens": tokens[:, 1:, None].expand(-1, -1, depth)} if depth else {}
    # Inside a training step's collection, as a run's forward is: the terms a model computes for its auxiliary losses
    # (sparse attention's indexer loss) keep their tensors too.
    terms = AuxiliaryLosses(spec_of(model.args).auxiliary_losses(model.args))
    with Producers(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FlashAttentionOnMeta():
        with collecting(terms):
            cross_entropy(model(tokens[:, :-1], **ahead), tokens[:, 1:].expand(1 + depth, -1))
    keys = list(model.layers.keys())
    facts.act_layer = [sum(b for r, b, *_ in saved.values() if r == k) for k in keys]
    facts.act_layer_moe = [sum(b for r, b, _, _, moe in saved.values() if r == k and moe) for k in keys]
    facts.act_layer_sac = [sum(b for r, b in sac_outputs.values() if r == k) for k in keys]
    facts.act_first = sum(b for r, b, *_ in saved.values() if r == "first")
    facts.act_last_hidden = sum(b for r, b, _, v, _ in saved.values() if r == "last" and not v)
    facts.act_last_vocab = sum(b for r, b, _, v, _ in saved.values() if r == "last" and v)


# What the planner's model facts depend on besides the model's settings: the code that defines the models
# and measures them.
FACTS_SOURCES = (
    "models",  # every family's folder, the registry and the shared blocks
    "base/hf_config.py",
    "builder/model_facts.py",
    "builder/model.py",  # plain_model: the attention cores and the experts' path the config picks
    "parallel/activation_checkpoint.py",
    "parallel/tensor_parallel.py",
    "parallel/expert_tensor_parallel.py",
    "components/loss.py",
    "components/metrics.py",
    "components/muon.py",  # muon_parameters: which parameters Muon steps
)


def cached_model_facts(cfg, planned: ModelPlan) -> ModelFacts:
    """model_facts, kept in the cache folder (data.cache_dir) per model shape and code version: its first
    meta forward in a process costs about a second (torch imports its compiler stack for some meta
    kernels), which every launch would otherwise pay again."""
    m = cfg.model
    muon = (cfg.optimizer.name, cfg.optimizer.muon_params)  # which parameters Muon steps (count_muon)
    mtp = getattr(planned.args, "mtp_layers", 0)  # model.mtp_layers resolved (a folder's: what its weights hold)
    indexer = getattr(planned.args, "indexer", None)  # sparse attention's: the dense warm-up keeps more
    shape = (m.name, m.flavor, m.n_layers, m.tokenizer, cfg.training.seq_len, muon, mtp, indexer)
    key = hashlib.sha256(repr(shape).encode())
    if m.flavor == "hf" or m.tokenizer == "hf":  # the shape (and vocabulary) is the folder's
        key.update(repr(planned.tokenizer.fingerprint).encode())
        if m.flavor == "hf":
            key.update((Path(m.hf_assets_path) / "config.json").read_bytes())
    package = Path(__file__).resolve().parents[1]
    for name in FACTS_SOURCES:
        files = sorted((package / name).rglob("*.py")) if (package / name).is_dir() else [package / name]
        for path in files:
            key.update(path.read_bytes())
    path = cache_dir(cfg) / "plan-facts" / f"{key.hexdigest()[:24]}.json"
    try:
        fields = json.loads(path.read_text())
        fields["ends"] = {k: tuple(v) for k, v in fields["ends"].items()}
        return ModelFacts(**fields)
    except (OSError, ValueError, TypeError, KeyError):
        pass
    blocks = planned.args.n_layers + mtp
    if blocks >= SAID_BLOCKS:
        logger.info(
            f"titanlite: memory: measuring what each of the model's {blocks} blocks saves for backward, on the meta "
            "device (tens of milliseconds a block; once per model shape, then cached)"
        )
    facts = model_facts(cfg, planned)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(facts)))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs the second again
    return facts

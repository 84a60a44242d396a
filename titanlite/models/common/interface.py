"""The model interface: what parallelize(), the pipeline splitter, weight init, checkpoints, the losses, the
metrics and Hugging Face import rely on. Each family's module (its folder's model.py, named by its spec)
implements it, with no parallelism inside.

Parameter names are part of the contract: blocks live in `layers` keyed "0".."n_layers-1" (a pipeline stage
keeps its own keys, so names do not depend on the layout), and each parameter's full value is made by
`init_param` from its name and its own generator alone (the module that holds it starts it: models/common/init.py
start_param), so the weights do not depend on the layout either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from titanlite.models.common.attention import Sequence
from titanlite.models.common.decoder_args import TransformerArgs
from titanlite.models.common.head import OutputHead
from titanlite.models.common.kv_cache import KVCache

# What a pipeline stage part before the last returns where its family hands the next part a tensor beside its hidden
# states: (h, carry) (the MoE families' pooled routing totals: models/common/moe/balance.py). A plain tuple, which
# torch.distributed.pipelining sends tensor by tensor (a NamedTuple it would take for one value); the next part's
# forward pre-hook turns it back into its positional h and the keyword `carry` (parallel/pipeline.py carry_as_keyword).
WithCarry = tuple[torch.Tensor, torch.Tensor]


class Decoder(Protocol):
    """A decoder-only language model as a plain nn.Module."""

    @property
    def args(self) -> TransformerArgs:
        """Its family's arguments (ModelSpec.args_type), which meet the shared decoder's contract (dim, n_layers,
        n_heads, head_dim, vocab_size, max_seq_len, ...: models/common/decoder_args.py TransformerArgs); read-only
        here, so a family's module may hold its own subclass."""
        ...

    tok_embeddings: nn.Embedding | None  # None on pipeline stages after the first
    layers: nn.ModuleDict  # the transformer blocks, keyed by index; FSDP, AC and compile wrap each one
    norm: nn.Module | None  # final norm; None on pipeline stages before the last
    output: OutputHead | None  # the head: output(h) logits, output(h, project=False) h; None before the last stage
    # Whether forward's input is tokens to embed (False on a pipeline stage after the first, even one that keeps
    # tok_embeddings for multi-token prediction's tokens ahead).
    embeds_input: bool

    # Attributes only the first pipeline stage keeps (the embeddings), and only the last (norm, output).
    first_stage_modules: ClassVar[tuple[str, ...]]
    last_stage_modules: ClassVar[tuple[str, ...]]

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        sequence: Sequence | None = None,
        *,
        logits: bool = True,
    ) -> torch.Tensor | WithCarry:
        """Logits [B, T, vocab] of tokens [B, T]; with logits=False, the final hidden states [B, T, dim] (after
        the final norm), which the training losses take together with `output` (titanlite/components/loss.py).
        Either way the last stage calls `output` (as `output(h, project=logits)`), so FSDP and tensor
        parallelism see the same module calls. A later pipeline stage receives hidden states instead of tokens
        and returns hidden states unless it holds `output`; a family may hand the next stage a tensor beside
        them, returning (h, carry) (WithCarry) from a part without `output` and taking the keyword `carry=` in the
        next (titanlite/parallel/pipeline.py passes it on; the MoE families' pooled routing totals). The whole
        model, and the part that holds `output`, return one tensor. With a cache, the tokens continue the cached
        sequence (generation). `sequence`: the tokens' positions and documents
        (titanlite/models/common/attention.py), for block-causal masks and context parallelism; each block's
        attention runs through its `core` module (a CoreAttention, built by name: build_core), which context
        parallelism wraps."""
        ...

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `full`, the full-size value of parameter `name`, in place, drawing only from `generator`."""
        ...

    def init_buffers(self) -> None:
        """Compute non-persistent buffers (e.g. RoPE tables) on the device the model now lives on."""
        ...

    def tie_weights(self) -> None:
        """With tied embeddings, make output.weight the very tensor tok_embeddings.weight again (after
        anything that replaces parameters, such as to_empty or a tensor-parallel plan)."""
        ...


if TYPE_CHECKING:

    class DecoderModule(nn.Module, Decoder):
        """What a built model is to the type checker: an nn.Module that implements Decoder (Python has no
        intersection types, and a Protocol cannot derive from nn.Module). No class derives from it: the
        builders return their spec's class as one (spec.load is untyped), so each family's model.py returns an
        instance of its class as a Decoder under TYPE_CHECKING: there mypy checks the family against the protocol."""

else:
    DecoderModule = nn.Module  # at run time a built model is the nn.Module it is


def unwrapped(part: nn.Module) -> DecoderModule:
    """The model inside a data-parallel wrapper: a DDP-wrapped part (what a run's parts are under DDP) does not
    forward attribute lookups (`output`, `tok_embeddings`, `args`) to its module, and names its parameters
    "module.*". Anything that reads the model's attributes or its parameter names off a run's parts
    goes through this; what runs the part (forward, the pipeline schedule, gradient sync) keeps the wrapper.
    FSDP, TP, activation checkpointing and compile change the module in place or inside it: nothing to unwrap."""
    # A run's parts are decoders (or stages of one) under whatever wraps them; nn.Module cannot say so to mypy.
    return cast("DecoderModule", part.module if isinstance(part, DistributedDataParallel) else part)

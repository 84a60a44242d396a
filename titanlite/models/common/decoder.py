"""The one decoder every family is built on: token embedding (and learned positions, and a scale, where a family has
them) -> layers -> final norm -> output head, with the rotary tables, weight tying, the KV cache's plumbing, the
pipeline's split points and the pooled load-balancing term of a mixture of experts. Plain modules with no
parallelism inside; the trainer shards them from outside.

Each layer is a Block: a *mixer* (attention of some kind: titanlite/models/common/mixers.py; a family may bring its
own kind) and a *feed-forward* (a dense MLP, titanlite/models/common/feed_forward.py, or a mixture of experts,
titanlite/models/common/moe/), each with its norms placed before it, after it, both or neither. A family declares its
layers: which mixer each layer's kind (args.layer_types, "full_attention" where a family gives none) builds
(`Transformer.mixers`), which feed-forward, which norms, which rotary table it reads, what else its block reads
(`Transformer.layer_inputs`); it overrides the `build_*` methods where it differs from the defaults, which build the
switches of the shared arguments (qk norms, biases, windows, NoPE layers, pre- or post-norm, mixtures of experts from
args.moe) that most families set."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from titanlite.models.common.attention import Sequence
from titanlite.models.common.auxiliary import add_auxiliary_loss
from titanlite.models.common.decoder_args import (
    DecoderArgs,
    TransformerArgs,
    kind_of,
    rope_kind,
    rotary_dim_of,
    window_of,
)
from titanlite.models.common.feed_forward import GatedMLP
from titanlite.models.common.head import OutputHead
from titanlite.models.common.init import start_param
from titanlite.models.common.init_scheme import InitScheme
from titanlite.models.common.interface import Decoder, WithCarry
from titanlite.models.common.kv_cache import KVCache, LayerCache
from titanlite.models.common.mixers import Attention, AttentionOptions
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.moe.balance import PooledBalance, PooledMoE, pooled_loss
from titanlite.models.common.moe.layer import GroupedExperts, HashRouter, MoE
from titanlite.models.common.multi_token import AroundDepth, MultiTokenProjection
from titanlite.models.common.rope import RotaryTable

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11; titanlite runs on 3.10

NORM_PLACEMENTS = ("pre", "post", "both", "none")


class Block(nn.Module):
    """One layer: the mixer (`attention`, whatever its kind: one name, so checkpoints and plans name every mixer
    alike) and the feed-forward, each inside a residual add, with its norms placed by `mixer_norms` and `ffn_norms`:
    "pre" normalises the sublayer's input (`attention_norm`, `ffn_norm`), "post" its output before the add (the same
    names), "both" its input and its output (`post_attention_norm`, `post_ffn_norm` after), "none" neither.
    `rotary`: the mixer reads the rotary table the decoder hands in (called as mixer(x, cos, sin, ...))."""

    def __init__(
        self,
        mixer: nn.Module,
        feed_forward: nn.Module,
        norm: Callable[[], nn.Module],
        mixer_norms: str = "pre",
        ffn_norms: str = "pre",
        rotary: bool = True,
    ):
        super().__init__()
        for placement in (mixer_norms, ffn_norms):
            if placement not in NORM_PLACEMENTS:
                raise ValueError(f"Block norm placement {placement!r}; use one of {', '.join(NORM_PLACEMENTS)}")
        self.mixer_norms, self.ffn_norms, self.rotary = mixer_norms, ffn_norms, rotary
        # Registered in this order (parameter order: the optimizer's and the gradient norm's sums follow it).
        if mixer_norms != "none":
            self.attention_norm = norm()
        self.attention = mixer
        if mixer_norms == "both":
            self.post_attention_norm = norm()
        if ffn_norms != "none":
            self.ffn_norm = norm()
        self.feed_forward = feed_forward
        if ffn_norms == "both":
            self.post_ffn_norm = norm()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
    ) -> torch.Tensor:
        rope = (cos, sin) if self.rotary else ()
        y = self.attention_norm(x) if self.mixer_norms in ("pre", "both") else x
        y = self.attention(y, *rope, cache=cache, sequence=sequence)
        if self.mixer_norms == "post":
            y = self.attention_norm(y)
        elif self.mixer_norms == "both":
            y = self.post_attention_norm(y)
        h = x + y
        y = self.ffn_norm(h) if self.ffn_norms in ("pre", "both") else h
        y = self.feed_forward(y)
        if self.ffn_norms == "post":
            y = self.ffn_norm(y)
        elif self.ffn_norms == "both":
            y = self.post_ffn_norm(y)
        return h + y


class MixerBlock(nn.Module):
    """A layer of one sublayer, a mixer behind its pre-norm: x + mixer(norm(x)) (Nemotron-H's Mamba-2 and attention
    layers). Its parts are named as Block's (`attention_norm`, `attention`), so plans and checkpoints name a mixer
    alike whichever block holds it."""

    def __init__(self, mixer: nn.Module, norm: Callable[[], nn.Module], rotary: bool = True):
        super().__init__()
        self.rotary = rotary
        self.attention_norm = norm()
        self.attention = mixer

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
    ) -> torch.Tensor:
        rope = (cos, sin) if self.rotary else ()
        return x + self.attention(self.attention_norm(x), *rope, cache=cache, sequence=sequence)


class FeedForwardBlock(nn.Module):
    """A layer of one sublayer, a feed-forward behind its pre-norm: x + feed_forward(norm(x)) (Nemotron-H's MLP and
    mixture-of-experts layers); named as Block's (`ffn_norm`, `feed_forward`). It mixes no tokens, so it takes the
    rotary tables, cache and sequence only to be called as every block is."""

    def __init__(self, feed_forward: nn.Module, norm: Callable[[], nn.Module]):
        super().__init__()
        self.ffn_norm = norm()
        self.feed_forward = feed_forward

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
    ) -> torch.Tensor:
        return x + self.feed_forward(self.ffn_norm(x))


class ParallelBlock(nn.Module):
    """A layer of two mixers side by side on one pre-norm (Falcon-H1's attention and Mamba-2): each reads the normed
    input times its input multiplier, their outputs times their output multipliers are added into the residual, then
    the feed-forward runs behind its own pre-norm. Its parts are named as Block's (`attention_norm`, `attention`,
    `ffn_norm`, `feed_forward`) and the second mixer `mamba`, so plans and checkpoints name the attention alike
    whichever block holds it. `multipliers`: (attention in, attention out, mamba in, mamba out); `rotary`: the
    attention reads the rotary table the decoder hands in (the second mixer never does)."""

    def __init__(
        self,
        attention: nn.Module,
        mamba: nn.Module,
        feed_forward: nn.Module,
        norm: Callable[[], nn.Module],
        multipliers: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0),
        rotary: bool = True,
    ):
        super().__init__()
        if len(multipliers) != 4:
            raise ValueError(f"ParallelBlock multipliers={multipliers}; give attention in, out, mamba in, out")
        self.multipliers, self.rotary = tuple(multipliers), rotary
        self.attention_norm = norm()
        self.attention = attention
        self.mamba = mamba
        self.ffn_norm = norm()
        self.feed_forward = feed_forward

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
    ) -> torch.Tensor:
        rope = (cos, sin) if self.rotary else ()
        attention_in, attention_out, mamba_in, mamba_out = self.multipliers
        y = self.attention_norm(x)
        m = _times(self.mamba(_times(y, mamba_in), cache=cache, sequence=sequence), mamba_out)
        a = _times(self.attention(_times(y, attention_in), *rope, cache=cache, sequence=sequence), attention_out)
        h = x + (m + a)
        return h + self.feed_forward(self.ffn_norm(h))


def _times(t: torch.Tensor, multiplier: float) -> torch.Tensor:
    """`t` times a block's multiplier; `t` itself where it is one."""
    return t if multiplier == 1.0 else t * multiplier


def grouped_query_attention(model: Transformer, layer: int, **changes: Unpack[AttentionOptions]) -> Attention:
    """The shared arguments' attention for `layer`: their heads, biases, Q/K norms, window, NoPE layers and rotated
    channels (rotary_dim, or its kind's own)."""
    a = model.args
    assert isinstance(a, DecoderArgs)  # their switches; a family of other arguments builds its own attention
    options: AttentionOptions = {
        "qkv_bias": a.qkv_bias,
        "out_bias": a.out_bias,
        "qk_norm": a.qk_norm,
        "norm_eps": a.norm_eps,
        "rotary": layer not in a.nope_layers,
        "window": window_of(a, layer),
    }
    rotary_dim = rotary_dim_of(a, layer)
    if rotary_dim < a.head_dim:  # partial rotary: the leading rotary_dim channels of each head rotate
        options["rotary_dim"] = rotary_dim
    return Attention(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, **(options | changes))


class Transformer(nn.Module):
    """Implements titanlite.models.common.interface.Decoder for every family (module docstring). A family's module
    is this class (its arguments' switches say the rest) or a subclass overriding the `build_*` hooks, the rotary
    tables, `embedding_scale` (or `embedding_multiplier`) and, where its parameters start otherwise than the shared
    scheme says, `init_scheme`. Each module starts its own parameters (its `init_own`: models/common/init.py
    start_param)."""

    first_stage_modules: ClassVar[tuple[str, ...]] = ("tok_embeddings",)
    last_stage_modules: ClassVar[tuple[str, ...]] = ("norm", "output")  # and mtp, where it has multi-token prediction
    # A layer kind (args.layer_types) -> fn(model, layer) building its mixer. A family adds its own kinds by
    # overriding it ({**Transformer.mixers, "my_kind": builder}); a kind it does not list is refused.
    mixers: ClassVar[dict[str, Callable[[Any, int], nn.Module]]] = {
        "full_attention": grouped_query_attention,
        "sliding_attention": grouped_query_attention,
    }
    learned_positions: ClassVar[bool] = False  # pos_embeddings for max_seq_len positions (GPT-2)
    embedding_scale: float | None = None  # the embeddings multiplied by it (in their dtype), e.g. sqrt(dim)
    # The embeddings multiplied by it as a Python number, not rounded to their dtype first (muP's multiplier, as
    # transformers' Granite 4.0 H and Falcon-H1 apply it)
    embedding_multiplier: float = 1.0
    pooled_balance: ClassVar[bool] = True  # MoE blocks pool their balance statistics (moe/balance.py), or not
    # Whether forward's input is tokens to embed: False on a pipeline stage after the first, even one that keeps
    # tok_embeddings for its multi-token prediction depths (parallel/pipeline.py split_model).
    embeds_input: bool = True

    @property
    def reads_token_ids(self) -> bool:
        """Whether blocks past the embedding read the input's token ids (hash-routed experts): a pipeline stage after
        the first then takes them as forward's `token_ids` (the trainer hands them to every stage)."""
        return False

    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.args = args
        self.moe_args: MoEArgs | None = args.moe
        # The pooled load-balancing statistics of the MoE blocks (one term for them all), where they pool.
        self.balance: PooledBalance | None = (
            PooledBalance() if self.moe_args is not None and self.pooled_balance else None
        )
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings: nn.Embedding | None = (
            nn.Embedding(args.max_seq_len, args.dim) if self.learned_positions else None
        )
        self.rotary = self.rotary_tables()
        # Multi-token prediction (models/common/multi_token.py): depth k's block is layer n_layers + k - 1, after
        # the decoder's own, and its norms and projection are mtp[that layer's key].
        self.mtp_layers: int = args.mtp_layers
        n_blocks = args.n_layers + self.mtp_layers
        # layer name -> the rotary table its mixer reads (None: none)
        self.layer_rotary = {str(i): self.rotary_of(i) for i in range(n_blocks)}
        # A ModuleDict keyed by layer index keeps parameter names stable when a pipeline stage
        # deletes the layers it does not own.
        self.layers = nn.ModuleDict({str(i): self.build_layer(i) for i in range(n_blocks)})
        # The residual as several streams (hyper-connections): widened after the embedding (widen), folded by this
        # module before the final norm (on the last pipeline stage).
        self.streams: nn.Module | None = self.build_streams()
        self.norm: nn.Module | None = self.build_norm()
        self.output: OutputHead | None = OutputHead(args.dim, args.vocab_size)
        self.mtp: nn.ModuleDict | None = (
            nn.ModuleDict({str(i): self.build_ahead(i) for i in range(args.n_layers, n_blocks)})
            if self.mtp_layers
            else None
        )
        self.tie_weights()
        # The rotary tables [max_seq_len, rotary_dim // 2], non-persistent because they follow from args, so
        # checkpoints need not carry them. Registered empty here to fix their device; init_buffers fills them.
        for name, table in self.rotary.items():
            for part in ("cos", "sin"):
                empty = torch.empty(args.max_seq_len, table.dim // 2, dtype=torch.float32)
                self.register_buffer(f"{name}_{part}", empty, persistent=False)
        self.init_buffers()

    # --- what a family declares (the defaults build the shared arguments' switches) ---

    def layer_kind(self, layer: int) -> str:
        """The kind of `layer`'s mixer: args.layer_types' entry, "full_attention" where there are none (and for a
        multi-token prediction depth's block, past them: decoder_args.kind_of)."""
        return kind_of(self.args, layer)

    def build_layer(self, layer: int) -> nn.Module:
        """Layer `layer`'s block: a Block of its mixer and feed-forward (a family of other layer shapes builds
        MixerBlock or FeedForwardBlock, or a block of its own)."""
        mixer_norms, ffn_norms = self.norm_placement(layer)
        return Block(
            self.build_mixer(layer),
            self.build_feed_forward(layer),
            self.build_norm,
            mixer_norms,
            ffn_norms,
            rotary=self.layer_rotary[str(layer)] is not None,
        )

    def build_ahead(self, layer: int) -> nn.Module:
        """What surrounds multi-token prediction's block `layer` (a depth's norms, projection and final norm:
        models/common/multi_token.py MultiTokenProjection, whose interface a family's own follows)."""
        return MultiTokenProjection(self.args.dim, self.build_norm)

    def build_mixer(self, layer: int) -> nn.Module:
        kind = self.layer_kind(layer)
        if kind not in self.mixers:
            raise ValueError(f"layer {layer} is of kind {kind!r}; {type(self).__name__} knows {', '.join(self.mixers)}")
        return self.mixers[kind](self, layer)

    def build_feed_forward(self, layer: int) -> nn.Module:
        """A mixture of experts at args.moe's sparse layers, the SwiGLU MLP of width ffn_dim elsewhere."""
        a, moe = self.args, self.moe_args
        if moe is not None and moe.is_sparse(layer):
            experts = self.build_experts()
            if self.balance is not None:
                return PooledMoE(a.dim, moe, self.balance, experts=experts)
            return MoE(a.dim, moe, experts=experts)
        return GatedMLP(a.dim, a.ffn_dim, bias=a.mlp_bias)

    def build_experts(self) -> GroupedExperts | None:
        """A MoE block's routed experts where the family's differ from the plain SwiGLU ones; None: those."""
        return None

    def build_norm(self) -> nn.Module:
        """The blocks' norms and the final one. nn.RMSNorm runs torch.nn.functional.rms_norm, a fused kernel where
        the backend has one."""
        return nn.RMSNorm(self.args.dim, eps=self.args.norm_eps)

    def build_streams(self) -> nn.Module | None:
        """How the blocks' residual is carried: None, one stream [B, T, dim] (every family but those with
        hyper-connections); else the module that folds the streams the blocks read and write back into one [B, T, dim]
        before the final norm, the embedded tokens having been widened into them by `widen`
        (models/common/hyper_connections.py)."""
        return None

    def widen(self, h: torch.Tensor) -> torch.Tensor:
        """The embedded tokens [B, T, dim] as the residual the first block reads: themselves (one stream), or the
        streams of a family with several (build_streams). On the first pipeline stage, which holds no fold."""
        return h

    def norm_placement(self, layer: int) -> tuple[str, str]:
        """The placement of the mixer's norms and the feed-forward's (Block): args.norm_position's."""
        return self.args.norm_position, self.args.norm_position

    def rotary_tables(self) -> dict[str, RotaryTable]:
        """The rotary tables the layers read, by name (their buffers are <name>_cos and <name>_sin): "rope" of
        rope_theta and rope_scaling over rotary_dim channels, and "rope_<kind>" of each layer kind's own settings
        (args.layer_rope; over rotary_dim channels where the kind names no width of its own), "rope" left out where
        every layer reads its kind's own."""
        a = self.args
        rotary_dim = a.rotary_dim or a.head_dim
        own = a.layer_rope
        tables = {f"rope_{kind}": RotaryTable.of(rope, rotary_dim) for kind, rope in own.items()}
        if not own or any(rope_kind(a, i) not in own for i in range(a.n_layers)):
            tables["rope"] = RotaryTable(rotary_dim, a.rope_theta, a.rope_scaling)
        return tables

    def rotary_of(self, layer: int) -> str | None:
        """The table `layer` reads (None: its mixer takes no rotations): its kind's own, or "rope"."""
        if not self.rotary:
            return None
        own = self.args.layer_rope
        kind = rope_kind(self.args, layer) if own else None
        return f"rope_{kind}" if kind in own else "rope"

    # --- the model interface ---

    def init_buffers(self) -> None:
        """Compute the rotary tables in float32 on the device the model lives on (after to_empty too); start the
        MoE blocks' step token counts and routing biases at zero and the hash-routed blocks' token tables at their
        default (a checkpoint or a folder then restores the biases and tables)."""
        for name, table in self.rotary.items():
            cos, sin = table.compute(self.args.max_seq_len, getattr(self, f"{name}_cos").device)
            # Re-registering (rather than copy_) keeps them float32 even if the model was cast.
            self.register_buffer(f"{name}_cos", cos, persistent=False)
            self.register_buffer(f"{name}_sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, MoE):
                module.step_tokens.zero_()
                if module.router.expert_bias is not None:
                    module.router.expert_bias.zero_()
                if isinstance(module.router, HashRouter):
                    module.router.default_table()

    def tie_weights(self) -> None:
        """With tie_embeddings, make output.weight the very tensor tok_embeddings.weight.

        Call again after anything that replaces parameters, such as to_empty (which unties them)."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        sequence: Sequence | None = None,
        *,
        logits: bool = True,
        carry: torch.Tensor | None = None,
        mtp_tokens: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | WithCarry:
        """Logits [B, T, vocab] of tokens [B, T] at positions 0..T-1 (training), or at `sequence.positions`,
        attending as `sequence` says (titanlite/models/common/attention.py). With a cache (generation), the tokens
        continue the cached sequence, and their keys and values are added to the cache. logits=False: the final
        hidden states [B, T, dim] instead, for a loss that applies `output` itself.

        What it returns: the whole model, and a pipeline stage part that holds the output head, one tensor; a part
        before the head its hidden states [B, T, dim], or, with the pooled MoE balance term on (balance "aux_loss",
        aux_loss_coef > 0: moe/balance.py), (h, carry) (interface.WithCarry): carry [3, E] the routing totals of its
        blocks plus the `carry` it received from the part before (zeros outside training, so every step hands on
        the same tensors). The part that holds the head adds the one term, from its blocks' totals plus `carry`
        (after_blocks).

        With multi-token prediction, `mtp_tokens` [B, T, mtp_layers] (the tokens 1..D places ahead of each position,
        IGNORE past the window: multi_token.future_labels) make the part that holds the head return the main
        output and each depth's, concatenated along the batch: [(1 + D) B, T, ...]. Without them (generation,
        evaluation of the main model alone) the depths do not run.

        `token_ids` [B, T]: the input's token ids, for a pipeline stage after the first whose blocks read them
        (reads_token_ids); the first stage's are its input."""
        positions = self.positions_of(tokens, cache, sequence)
        tables = self.rotary_at(positions)
        balance, moe = self.balance, self.moe_args
        if balance is None or moe is None or not (moe.balance == "aux_loss" and moe.aux_loss_coef > 0):
            h, totals = self.run(tokens, positions, tables, cache, sequence, token_ids), None
        else:
            # This forward's blocks record their routing into the tally; it closes before anything else runs.
            with balance.recording(torch.is_grad_enabled()) as tally:
                h = self.run(tokens, positions, tables, cache, sequence, token_ids)
            totals = tally.totals(moe.n_experts, h.device)
            totals = totals if carry is None else carry + totals
            if self.output is None:  # a pipeline stage before the last: the totals travel with the activations
                if torch.is_grad_enabled() and not totals.requires_grad:
                    # no routing block before this point: the next stage still sends a gradient for the carry back
                    totals.requires_grad_()
                return h, totals
            if not torch.is_grad_enabled() or (carry is None and not tally.rows):
                totals = None  # no term: evaluation, or no block of the whole model routed a token
        if self.output is None:  # a pipeline stage before the last, with nothing to hand on beside h
            return h
        residual = h
        if self.streams is not None:
            h = self.streams(h)  # folded into one
        h = self.after_blocks(h, totals)
        h = self.norm(h) if self.norm is not None else h
        if mtp_tokens is not None and self.mtp is not None:
            first = next(iter(self.mtp.values()))
            hidden = residual if first.reads_residual else h
            h = torch.cat([h, *self.predict_ahead(hidden, mtp_tokens, positions, tables, sequence)])
        return self.output(h, project=logits)  # [B, T, vocab], or [B, T, dim]

    def run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None,
        tables: dict[str | None, tuple],
        cache: KVCache | None,
        sequence: Sequence | None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This part's blocks over its input, the hidden states [B, T, dim] after the last: the embedding first (on
        the first stage: a later one receives hidden states [B, T, dim] instead of tokens), then each block with its
        rotary table (and its extra inputs: layer_inputs). Not the multi-token prediction depths' blocks
        (predict_ahead, after the final norm)."""
        h = self.embed(tokens, positions) if self.embeds_input else tokens
        inputs = self.layer_inputs(tokens, h, tokens if self.embeds_input else token_ids)
        if self.embeds_input:
            h = self.widen(h)
        for name, layer in self.layers.items():
            if self.mtp is not None and name in self.mtp:
                continue  # a multi-token prediction depth's block (predict_ahead)
            cos, sin = tables[self.layer_rotary[name]]
            extra = inputs[name] if inputs is not None else {}
            h = layer(h, cos, sin, cache=None if cache is None else cache.layer(name), sequence=sequence, **extra)
        if cache is not None:
            cache.advance(tokens.shape[1])
        return h

    def predict_ahead(
        self,
        h: torch.Tensor,
        mtp_tokens: torch.Tensor,
        positions: torch.Tensor | None,
        tables: dict,
        sequence: Sequence | None,
    ) -> list[torch.Tensor]:
        """Each multi-token prediction depth's normed output [B, T, dim] (models/common/multi_token.py), from the
        main model's `h` (its normed output, or its residual where the depths read that: reads_residual) and the
        tokens ahead (`mtp_tokens`; positions past the window embed token 0 and have no target)."""
        assert self.mtp is not None
        outputs = []
        for k, (name, module) in enumerate(self.mtp.items()):
            projection = cast(AroundDepth, module)
            ahead = self.embed(mtp_tokens[..., k].clamp(min=0), positions)
            cos, sin = tables[self.layer_rotary[name]]
            x = self.layers[name](projection(ahead, h), cos, sin, sequence=sequence)
            out, h = projection.outputs(x)
            outputs.append(out)
        return outputs

    def layer_inputs(
        self, tokens: torch.Tensor, h: torch.Tensor, token_ids: torch.Tensor | None = None
    ) -> dict[str, dict[str, Any]] | None:
        """Each block's extra keyword arguments for this forward, by layer name, made once from its input (`tokens`,
        or a later pipeline stage's hidden states), the embedded `h` and the input's token ids (None on a later
        stage of a model that does not read them: reads_token_ids); None: the blocks take none. A family whose
        blocks read more than the residual stream overrides it (Gemma 4: each layer's per-layer input, and the keys
        and values its layers hand on; DeepSeek-V4: its hash-routed blocks' token ids)."""
        return None

    @staticmethod
    def positions_of(tokens: torch.Tensor, cache: KVCache | None, sequence: Sequence | None) -> torch.Tensor | None:
        """The tokens' positions: after the cached ones (generation), the sequence's own, or None for 0..T-1."""
        if cache is not None:  # the new tokens start at the first uncached position
            return cache.positions(tokens.shape[1], tokens.device)
        if sequence is not None and sequence.positions is not None:
            return sequence.positions
        return None

    def rotary_at(self, positions: torch.Tensor | None) -> dict[str | None, tuple]:
        """Each rotary table by name (None: a layer without one): whole (attention cuts them to length), or at the
        tokens' positions."""
        tables: dict[str | None, tuple] = {None: (None, None)}
        for name in self.rotary:
            cos, sin = getattr(self, f"{name}_cos"), getattr(self, f"{name}_sin")
            tables[name] = (cos, sin) if positions is None else (cos[positions], sin[positions])
        return tables

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        if self.tok_embeddings is None:
            return tokens
        h = self.tok_embeddings(tokens)
        if self.embedding_scale is not None:
            # The scale rounded to the embedding's dtype first, as transformers does (sqrt(3072) is 55.5 in bf16).
            h = h * torch.tensor(self.embedding_scale, dtype=h.dtype, device=h.device)
        if self.embedding_multiplier != 1.0:
            h = h * self.embedding_multiplier
        if self.pos_embeddings is not None:
            pos = positions if positions is not None else torch.arange(tokens.shape[1], device=tokens.device)
            h = h + self.pos_embeddings(pos)
        return h

    def after_blocks(self, h: torch.Tensor, totals: torch.Tensor | None) -> torch.Tensor:
        """The hidden states after the last block of the part that holds the output head, before the final norm,
        with the pooled load-balancing term joined when `totals` [3, E] are given: the routing totals of every block
        of the model that ran in this training forward (this part's, plus the `carry` of the stages before: forward).
        Here the norm that follows makes the part's output a tensor of its own, not a view of h, which FSDP would
        warn about at the root."""
        balance, moe = self.balance, self.moe_args
        if totals is None or balance is None or moe is None:
            return h
        term = moe.aux_loss_coef * pooled_loss(balance.reduced(totals), moe.n_experts)
        return add_auxiliary_loss(h, "load_balance", term)

    def init_scheme(self) -> InitScheme:
        """How this model's parameters start (models/common/init_scheme.py): the shared scheme, depth-scaled by the
        decoder's n_layers; a family with a scheme of its own returns that."""
        return InitScheme(self.args.n_layers, self.args.dim, self.args.tie_embeddings)

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `full` (the full-size value of parameter `name`) in place, using only `generator`: the module that
        holds the parameter starts it, as init_scheme() says (models/common/init.py start_param)."""
        start_param(self, name, full, generator, self.init_scheme())

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """The decoder's own parameters: the token embedding and the learned positions."""
        if name == "tok_embeddings.weight":
            scheme.embedding(full, generator)
        elif name == "pos_embeddings.weight":
            scheme.positions(full, generator)
        else:
            raise KeyError(f"{type(self).__name__} has no parameter {name!r} of its own")


if TYPE_CHECKING:  # mypy (.ci/run) holds the class to the model interface and names any member that differs

    def _implements_decoder(model: Transformer) -> Decoder:
        return model

"""What a model family tells the rest of titanlite: its ModelSpec. Torch-free, like each family's arguments, so
the configuration, `titanlite help` and the launcher's checks read specs without importing torch."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from titanlite.base.hf_config import FieldTypes

MATH = "math"  # the metadata key of a field of a family's arguments: False where the field changes no math


def not_math(default: Any = dataclasses.MISSING) -> Any:
    """A field of a family's arguments that does not change what the weights compute (the family's name, the
    vocabulary's and the context's sizes, how a folder stores a tensor): `field(metadata={MATH: False})`. Every
    other field is math: importing weights into a model whose math fields differ from the folder's is refused
    (titanlite/components/hf_weights.py), so a field a family adds is checked unless it says otherwise here. A
    subclass that redeclares such a field marks it again."""
    if default is dataclasses.MISSING:
        return field(metadata={MATH: False})
    return field(default=default, metadata={MATH: False})


def math_fields(args: Any) -> tuple[str, ...]:
    """The fields of a family's arguments (a dataclass) that decide what its weights compute: all but not_math's."""
    return tuple(f.name for f in dataclasses.fields(args) if f.metadata.get(MATH, True))


@dataclass(frozen=True)
class HFConfig:
    """A family's Hugging Face config.json, both ways: `read(config, where)` gives its arguments (every field
    that changes the math honoured, or refused with one line naming it), `write(args)` the family's own fields
    (model_type and architectures included). `tokenizer(args)`: the built-in tokenizer a folder without a
    tokenizer.json uses (None: the user must name one). `experts`: whether `read` honours the mixture-of-experts
    fields (num_experts, moe_intermediate_size, ...); a dense family's config.json with them is refused.
    `also_reads`: more model_types `read` takes. `fields`: the JSON types of the config.json fields `read` takes
    beyond those every decoder family shares (titanlite/base/hf_config.py FIELDS), checked before it reads any."""

    model_type: str
    read: Callable[[dict, str], Any]
    write: Callable[[Any], dict]
    tokenizer: Callable[[Any], str | None] = lambda args: None
    experts: bool = False
    also_reads: tuple[str, ...] = ()
    """More model_types `read` takes (a published multimodal folder whose text model this family is)."""
    nullable: tuple[str, ...] = ()
    """Fields whose null `read` takes itself (OLMo Hybrid's rope_theta: no rotation); null is refused elsewhere."""
    fields: FieldTypes = field(default_factory=dict)
    """The family's own config.json fields: name -> (what it must be, whether null stands for "absent"), its folder's
    hf_config.py FIELDS (with the shared tables of the blocks it reads: MoE, latent attention, Gated DeltaNet)."""


@dataclass(frozen=True)
class ModelSpec:
    """One model family (model.name). Its torch halves are named by "module:attribute" and imported on first
    use (`load`), so a spec, and the registry of them, stay importable without torch:

    - `model`: the nn.Module class, built as cls(args) (titanlite/models/common/interface.py's Decoder);
    - `tp_plan`: fn(model) -> {module name: ParallelStyle} for the blocks (the ends are shared);
    - `hf_weights`: a module with hf_sources, hf_keys, to_hf and from_hf_tensor (components/hf_weights.py);
    - `flops`: fn(model, seq_len) -> training FLOPs per token (the dense formula unless the family names its own).

    `tp_split_sizes(args)`: the sizes a tensor-parallel degree must divide; `tp_refusal`: why this family
    cannot be split by tensor parallelism at all (None: it can); `pp_refusal`, by pipeline stages.
    `with_depth(args, n_layers)`: the arguments at another depth (model.n_layers). `args_type`: the family's
    arguments dataclass."""

    name: str
    args_type: type
    flavors: dict[str, Any]
    model: str
    tp_plan: str
    hf_weights: str  # "" for a family with no Hugging Face counterpart
    tp_split_sizes: Callable[[Any], dict[str, int]]
    hf: HFConfig | None = None
    tp_refusal: Callable[[Any], str | None] = lambda args: None
    pp_refusal: Callable[[Any], str | None] = lambda args: None
    """Why this family's model (at these arguments) cannot be cut into pipeline stages (None: it can)."""
    etp_refusal: Callable[[Any], str | None] = lambda args: None
    """Why this family's experts cannot be split over the tensor-parallel ranks (expert tensor parallelism,
    titanlite/parallel/expert_tensor_parallel.py) though its MoE blocks can be run whole there (None: they can)."""
    with_depth: Callable[[Any, int], dict] = lambda args, n_layers: {"n_layers": n_layers}
    flops: str = "titanlite.models.common.flops:dense_flops_per_token"
    """fn(model, seq_len) -> training FLOPs per token (forward + backward), for tokens/s -> TFLOPS and MFU."""
    auxiliary_losses: Callable[[Any], tuple[str, ...]] = lambda args: ()
    """The names of the auxiliary loss terms the model adds in training (models/common/auxiliary.py), logged as
    aux_<name>; none for a dense family."""
    moe: Callable[[Any], Any] = lambda args: None
    """The family's mixture-of-experts arguments (a MoEArgs: titanlite/models/common/moe/args.py) at `args`, or None
    for a family without MoE blocks: how the builder, the planner and the parallelisms learn of the experts."""
    learned_positions: bool = False
    """Position embeddings learned for max_seq_len positions: a longer sequence, or a folder of another context
    length, is another model (RoPE tables are computed for any length)."""
    description: str = ""
    _loaded: dict = field(default_factory=dict, compare=False, repr=False)

    def load(self, ref: str) -> Any:
        """The object a "module:attribute" reference names (a module alone without the colon), imported once."""
        if ref not in self._loaded:
            module, _, attribute = ref.partition(":")
            found = importlib.import_module(module)
            self._loaded[ref] = getattr(found, attribute) if attribute else found
        return self._loaded[ref]

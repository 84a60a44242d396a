"""OLMo Hybrid's decoder on the shared decoder (titanlite/models/common/decoder.py): pre-norm blocks around Gated
DeltaNet layers (titanlite/models/common/gated_delta_net.py, the write strength doubled) and OLMo 2's post-norm
blocks around attention with whole-projection Q/K norms, rotated or not; RMSNorms, a SwiGLU MLP. No parallelism
inside."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titanlite.models.common.decoder import Transformer, grouped_query_attention
from titanlite.models.common.gated_delta_net import DecayInit, gated_delta_net_of
from titanlite.models.common.interface import Decoder
from titanlite.models.common.rope import RotaryTable
from titanlite.models.olmo_hybrid.args import OlmoHybridArgs

# The linear layers' output norm's epsilon, whatever rms_norm_eps says (transformers' OlmoHybridRMSNormGated, as
# flash-linear-attention's FusedRMSNormGated).
LINEAR_NORM_EPS = 1e-5
# transformers' OlmoHybridConfig init ranges: A = exp(A_log) uniform in [0, 16]; dt log-uniform in [0.001, 0.1],
# floored at 1e-4, dt_bias its softplus inverse.
OLMO_DECAY = DecayInit(a_range=(0.0, 16.0), dt_range=(0.001, 0.1), dt_floor=1e-4)


def gated_delta_net(model: OlmoHybrid, layer: int) -> nn.Module:
    a = model.args
    beta_scale = 2.0 if a.allow_neg_eigval else 1.0
    return gated_delta_net_of(a, norm_eps=LINEAR_NORM_EPS, beta_scale=beta_scale, decay_init=OLMO_DECAY)


class OlmoHybrid(Transformer):
    """Implements titanlite.models.common.interface.Decoder (OLMo Hybrid)."""

    args: OlmoHybridArgs
    mixers = {"full_attention": grouped_query_attention, "linear_attention": gated_delta_net}

    def norm_placement(self, layer: int) -> tuple[str, str]:
        """The attention layers' blocks normalise each sublayer's output (OLMo 2's), the linear layers' its input."""
        return ("post", "post") if self.layer_kind(layer) == "full_attention" else ("pre", "pre")

    def rotary_tables(self) -> dict[str, RotaryTable]:
        return {"rope": RotaryTable(self.args.head_dim, self.args.rope_theta)} if self.args.rope else {}

    def rotary_of(self, layer: int) -> str | None:
        return "rope" if self.args.rope and self.layer_kind(layer) == "full_attention" else None


if TYPE_CHECKING:

    def _implements_decoder(model: OlmoHybrid) -> Decoder:
        return model

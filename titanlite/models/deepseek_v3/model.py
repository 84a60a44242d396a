"""DeepSeek-V3 on the shared latent-attention decoder (titanlite/models/common/latent/model.py): pre-norm blocks of
multi-head latent attention (titanlite/models/common/mixers.py LatentAttention) and a mixture of experts (the shared
block, titanlite/models/common/moe/layer.py: sigmoid scores, group-limited top-k, the balancing bias, shared experts,
each block its own load-balancing term), the first moe.dense_layers with a dense SwiGLU. Plain modules with no
parallelism inside; multi-token prediction (mtp_layers, the shared decoder's: models/common/multi_token.py) after
the decoder's layers, each depth's block a mixture of experts as DeepSeek's layer 61 is."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titanlite.models.common.interface import Decoder
from titanlite.models.common.latent.model import LatentDecoder
from titanlite.models.deepseek_v3.args import DeepseekV3Args


class DeepseekV3(LatentDecoder):
    """Implements titanlite.models.common.interface.Decoder."""

    args: DeepseekV3Args
    pooled_balance = False  # each MoE block adds its own term (transformers' DeepSeek-V3 has no pooled one)


if TYPE_CHECKING:  # mypy holds the class to the model interface and names any member that differs

    def _implements_decoder(model: DeepseekV3) -> Decoder:
        return model

"""OLMo 3 (Olmo3ForCausalLM): OLMo 2's decoder (post-norm blocks, an RMSNorm over each token's whole query and key
projection) with sliding-window attention on three of every four layers, and rotary scaling (YaRN in the
long-context releases) on the full-attention layers only, the sliding ones rotating unscaled: the shared decoder's
per-layer-type rotary settings (DecoderArgs.layer_rope). Its sizes, config.json (titanlite/models/olmo3/hf_config.py)
and spec; the model, weights and tensor-parallel plan are the shared decoder's."""

from __future__ import annotations

import dataclasses

from titanlite.models.common.decoder_args import DecoderArgs, debug, sizes
from titanlite.models.common.decoder_spec import decoder_spec
from titanlite.models.common.rope_args import LayerRope, YarnRopeScaling
from titanlite.models.olmo3 import hf_config
from titanlite.models.olmo3.hf_config import layer_types


def with_depth(args: DecoderArgs, n_layers: int) -> dict:
    """model.n_layers: the depth, and OLMo 3's three sliding : one full pattern at the new depth."""
    return {"n_layers": n_layers, "layer_types": layer_types(n_layers) if args.layer_types else ()}


def rotary(theta: float, full: YarnRopeScaling | None) -> dict:
    """The rotary fields of an OLMo 3: base `theta` on every layer, `full` scaling on the full-attention ones."""
    return {
        "rope_theta": theta,
        "layer_rope": {"full_attention": LayerRope(theta, full), "sliding_attention": LayerRope(theta)},
    }


# The long-context releases' YaRN: an original context of 8,192 stretched 8 times (65,536), on the full layers.
LONG_CONTEXT = YarnRopeScaling(factor=8.0, original_max_position_embeddings=8192, attention_factor=1.2079441541679836)


def _olmo3(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int) -> DecoderArgs:
    return DecoderArgs(
        **sizes(dim, n_layers, n_heads, n_kv_heads, ffn_dim),
        vocab_size=100278,
        max_seq_len=65536,
        norm_eps=1e-6,
        family="olmo3",
        qk_norm="full",
        norm_position="post",
        sliding_window=4096,
        layer_types=layer_types(n_layers),
        **rotary(500000.0, LONG_CONTEXT),
    )


FLAVORS = {
    # Tiny, for tests and CPU runs: a window of 16 (under the debug config's 128 tokens), layers 0-2 sliding and
    # unscaled, layer 3 full with YaRN stretching 32 positions 4 times.
    "debug": debug(
        "olmo3",
        qk_norm="full",
        norm_position="post",
        sliding_window=16,
        layer_types=layer_types(4),
        **rotary(500000.0, YarnRopeScaling(factor=4.0, original_max_position_embeddings=32)),
    ),
    # allenai/Olmo-3-1025-7B and Olmo-3-1125-32B (their config.json).
    "olmo3_7b": _olmo3(4096, 32, 32, 32, 11008),
    "olmo3_32b": _olmo3(5120, 64, 40, 8, 27648),
}

SPEC = dataclasses.replace(
    decoder_spec(
        "olmo3",
        FLAVORS,
        hf_config.HF,
        "OLMo 3: OLMo 2's post-norm decoder with whole-projection Q/K norms, 3 sliding : 1 full layers, rotary "
        "scaling (YaRN) on the full layers only",
    ),
    with_depth=with_depth,
)

"""SmolLM3: the Llama decoder with no rotary embedding in every 4th layer (NoPE). Its sizes, its config.json
and its spec."""

from __future__ import annotations

from titanlite.base.hf_config import COUNT, WHOLES, FieldTypes, refuse
from titanlite.models.common.decoder_args import DecoderArgs, debug, every
from titanlite.models.common.decoder_config import (
    DecoderConfig,
    Expressible,
    attention_biases,
    window_fields,
    window_if_used,
)
from titanlite.models.common.decoder_spec import decoder_spec

FLAVORS = {
    "debug": debug("smollm3", tie_embeddings=True, nope_layers=every(4, 4)),
    "smollm3_3b": DecoderArgs(
        dim=2048,
        n_layers=36,
        n_heads=16,
        n_kv_heads=4,
        ffn_dim=11008,
        vocab_size=128256,
        max_seq_len=65536,
        rope_theta=5e6,
        norm_eps=1e-6,
        tie_embeddings=True,
        family="smollm3",
        nope_layers=every(4, 36),
    ),
}


def nope_layers(config: dict, n_layers: int, where: str) -> tuple[int, ...]:
    """Layers without RoPE: no_rope_layers holds 1 (RoPE) or 0 (none) per layer, else every
    no_rope_layer_interval-th layer has none."""
    flags = config.get("no_rope_layers")
    if flags is None:
        return every(config.get("no_rope_layer_interval", 4), n_layers)
    if len(flags) != n_layers:
        raise refuse(where, "no_rope_layers", f"[{len(flags)} entries]", f"it needs one per layer ({n_layers})")
    return tuple(i for i, use in enumerate(flags) if not use)


def switches(config: dict, n_layers: int, where: str) -> dict:
    return attention_biases(config, n_layers, where) | {"nope_layers": nope_layers(config, n_layers, where)}


def fields(args: DecoderArgs) -> dict:
    return {
        "mlp_bias": args.mlp_bias,
        **window_fields(args, max_window_layers=False),
        "no_rope_layers": [int(i not in args.nope_layers) for i in range(args.n_layers)],
    }


HF = DecoderConfig(
    family="smollm3",
    model_type="smollm3",
    architecture="SmolLM3ForCausalLM",
    expressible=Expressible(nope=True),
    switches=switches,
    window=window_if_used(),
    fields=fields,
)
# The config.json fields SmolLM3 reads beyond the shared ones (titanlite/base/hf_config.py FIELDS): its NoPE layers.
FIELDS: FieldTypes = {"no_rope_layers": (WHOLES, True), "no_rope_layer_interval": (COUNT, False)}

SPEC = decoder_spec("smollm3", FLAVORS, HF, "SmolLM3: the Llama decoder with NoPE layers", FIELDS)

"""OLMo2: the Llama decoder with post-norm blocks (each sublayer's output normalised before the residual add)
and an RMSNorm over each token's whole query and key projection. Its sizes, its config.json and its spec; under
tensor parallelism the shared plan shards the whole-projection norm with the heads (titanlite/models/common/
parallelize.py WholeProjectionNorm: the sum of squares all-reduced over the ranks)."""

from __future__ import annotations

from titanlite.models.common.decoder_args import DecoderArgs, debug
from titanlite.models.common.decoder_config import DecoderConfig, Expressible, attention_biases, no_mlp_bias
from titanlite.models.common.decoder_spec import decoder_spec


def _olmo2(dim, n_layers, n_heads, ffn_dim) -> DecoderArgs:
    return DecoderArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        ffn_dim=ffn_dim,
        vocab_size=100352,
        max_seq_len=4096,
        rope_theta=500000.0,
        norm_eps=1e-6,
        family="olmo2",
        qk_norm="full",
        norm_position="post",
    )


FLAVORS = {
    "debug": debug("olmo2", n_kv_heads=4, qk_norm="full", norm_position="post"),
    "olmo2_1b": _olmo2(2048, 16, 16, 8192),
    "olmo2_7b": _olmo2(4096, 32, 32, 11008),
}


def switches(config: dict, n_layers: int, where: str) -> dict:
    no_mlp_bias("olmo2", config, where)
    return attention_biases(config, n_layers, where) | {"qk_norm": "full", "norm_position": "post"}


HF = DecoderConfig(
    family="olmo2",
    model_type="olmo2",
    architecture="Olmo2ForCausalLM",
    expressible=Expressible(mlp_bias=False, qk_norm="full", norm_position="post"),
    switches=switches,
)
SPEC = decoder_spec(
    "olmo2", FLAVORS, HF, "OLMo2: the Llama decoder with post-norm blocks and whole-projection Q/K norms"
)

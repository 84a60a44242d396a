"""Multi-head latent attention's weights under Hugging Face's names, DeepSeek-V3's (which Kimi Linear's share): the
projections and norms of a layer's attention (ours under attention., theirs under self_attn.), and a pre-norm block's
names around them."""

from __future__ import annotations

from titanlite.models.common.latent.args import LatentArgs

ENDS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
MLP = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))  # a dense layer's SwiGLU: ours, Hugging Face's


def latent_names(args: LatentArgs) -> list[tuple[str, str]]:
    """(ours, Hugging Face's) for each of the latent attention's weights: kv_a_proj_with_mqa (the latent and the
    shared rotary key), kv_a_layernorm, kv_b_proj, o_proj, the indexer's where it has one (indexer.wq_b, wk, k_norm,
    weights_proj), and the query's q_proj or, with q_lora_rank, q_a_proj, q_a_layernorm and q_b_proj."""
    names = [("wkv_a", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"), ("wkv_b", "kv_b_proj"), ("wo", "o_proj")]
    if (
        args.indexer is not None
    ):  # DeepSeek Sparse Attention's indexer, under the same names (its norm's bias: block_names)
        names += [(f"indexer.{w}", f"indexer.{w}") for w in ("wq_b", "wk", "k_norm", "weights_proj")]
    if args.q_lora_rank:
        return names + [("wq_a", "q_a_proj"), ("q_norm", "q_a_layernorm"), ("wq_b", "q_b_proj")]
    return names + [("wq", "q_proj")]


def block_names(layer: int, mixer: list[tuple[str, str]], dense: bool) -> dict[str, str]:
    """Block `layer`'s weights (ours -> Hugging Face's): its two norms, its mixer's (`mixer`: latent_names, or another
    kind's (ours, theirs)) and, where `dense`, its SwiGLU's (mlp.*; a sparse block's are the family's)."""
    ours, hf = f"layers.{layer}.", f"model.layers.{layer}."
    names = {ours + "attention_norm.weight": hf + "input_layernorm.weight"}
    names[ours + "ffn_norm.weight"] = hf + "post_attention_layernorm.weight"
    names |= {f"{ours}attention.{w}.weight": f"{hf}self_attn.{proj}.weight" for w, proj in mixer}
    if ("indexer.k_norm", "indexer.k_norm") in mixer:  # a LayerNorm, with a bias
        names[f"{ours}attention.indexer.k_norm.bias"] = f"{hf}self_attn.indexer.k_norm.bias"
    return names | ({f"{ours}feed_forward.{w}.weight": f"{hf}mlp.{proj}.weight" for w, proj in MLP} if dense else {})

"""Llama 3's arguments, torch-free: the shared decoder's (titanlite/models/common/decoder_args.py) at Llama 3's
sizes."""

from __future__ import annotations

from titanlite.models.common.decoder_args import DecoderArgs, debug
from titanlite.models.common.rope_args import Llama3RopeScaling

LLAMA3_VOCAB = 128256  # Llama 3's tokenizer (tiktoken-based, 128,000 ids and 256 reserved special ones)
LLAMA31_ROPE_SCALING = Llama3RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

# vocab_size 0: the tokenizer's, padded to a multiple of 64.
FLAVORS = {
    "debug": debug("llama3"),
    # Llama 3.2 1B.
    "1B": DecoderArgs(
        family="llama3",
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=0,
        max_seq_len=8192,
        tie_embeddings=True,
    ),
    # A 3B of Llama's architecture at the widths of a published 3B (RoPE in every layer).
    "3B": DecoderArgs(
        family="llama3",
        dim=2048,
        n_layers=36,
        n_heads=16,
        n_kv_heads=4,
        ffn_dim=11008,
        vocab_size=0,
        max_seq_len=8192,
        tie_embeddings=True,
    ),
    # Llama 3.1 8B, 70B and 405B: their shapes, their 128,256-id vocabulary, untied, RoPE theta 500,000 with
    # Llama 3.1's frequency scaling, 131,072 positions. Trained with a smaller tokenizer (the GPT-2 one of
    # the debug configs), the embedding rows past its ids are simply never used.
    "8B": DecoderArgs(
        family="llama3",
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=LLAMA3_VOCAB,
        max_seq_len=131072,
        rope_scaling=LLAMA31_ROPE_SCALING,
    ),
    "70B": DecoderArgs(
        family="llama3",
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        vocab_size=LLAMA3_VOCAB,
        max_seq_len=131072,
        rope_scaling=LLAMA31_ROPE_SCALING,
    ),
    "405B": DecoderArgs(
        family="llama3",
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        vocab_size=LLAMA3_VOCAB,
        max_seq_len=131072,
        rope_scaling=LLAMA31_ROPE_SCALING,
    ),
}

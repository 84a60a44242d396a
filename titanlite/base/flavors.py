"""Model flavors by name: each family's shapes, as plain model arguments (torch-free, so the configuration can
tell which family a flavor name belongs to). The published models' shapes are those of their config.json on
the Hugging Face hub (and `transformers`' defaults for them); a vocab_size of 0 means the tokenizer's, padded
to a multiple of 64 (the debug and GPT-2/Llama flavors); a published model keeps its own vocabulary size, of
which a smaller tokenizer (e.g. the shipped GPT-2 one, offline) uses the first ids.
"""

from __future__ import annotations

from titanlite.base.model_args import GPT2Args, LlamaArgs, ModelArgs


def _every(interval: int, n_layers: int) -> tuple[int, ...]:
    """Layer indices i with (i + 1) % interval == 0: SmolLM3's NoPE layers (no_rope_layer_interval)."""
    return tuple(i for i in range(n_layers) if (i + 1) % interval == 0)


def _qwen2(dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, tie) -> LlamaArgs:
    return LlamaArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
        vocab_size=vocab_size,
        max_seq_len=32768,
        rope_theta=1e6,
        norm_eps=1e-6,
        tie_embeddings=tie,
        family="qwen2",
        qkv_bias=True,
    )


def _qwen3(dim, n_layers, n_heads, n_kv_heads, ffn_dim, tie, vocab_size=151936) -> LlamaArgs:
    return LlamaArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
        vocab_size=vocab_size,
        max_seq_len=40960,
        rope_theta=1e6,
        norm_eps=1e-6,
        tie_embeddings=tie,
        head_dim=128,
        family="qwen3",
        qk_norm="head",
    )


def _olmo2(dim, n_layers, n_heads, ffn_dim) -> LlamaArgs:
    return LlamaArgs(
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


def _debug(family: str, **switches) -> LlamaArgs:
    """A tiny decoder of `family` for tests and CPU runs: dim 64, 4 layers, 4 heads (2 for keys and values)."""
    shape = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 192, "vocab_size": 0}
    return LlamaArgs(**(shape | switches), family=family)


FLAVORS: dict[str, dict[str, ModelArgs]] = {
    "gpt2": {
        "debug": GPT2Args(dim=64, n_layers=4, n_heads=4, vocab_size=0),
        "124M": GPT2Args(dim=768, n_layers=12, n_heads=12, vocab_size=0),
        "355M": GPT2Args(dim=1024, n_layers=24, n_heads=16, vocab_size=0),
        "774M": GPT2Args(dim=1280, n_layers=36, n_heads=20, vocab_size=0),
        "1.5B": GPT2Args(dim=1600, n_layers=48, n_heads=25, vocab_size=0),
    },
    "llama3": {
        "debug": _debug("llama3"),
        # Llama 3.2 1B.
        "1B": LlamaArgs(
            dim=2048,
            n_layers=16,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=8192,
            vocab_size=0,
            max_seq_len=8192,
            tie_embeddings=True,
        ),
        # SmolLM3-3B's widths as a plain Llama (RoPE in every layer); smollm3/smollm3_3b is the real one.
        "3B": LlamaArgs(
            dim=2048,
            n_layers=36,
            n_heads=16,
            n_kv_heads=4,
            ffn_dim=11008,
            vocab_size=0,
            max_seq_len=8192,
            tie_embeddings=True,
        ),
        "8B": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=0, max_seq_len=8192),
        # Llama 3 70B (for planning on many GPUs: `titanlite plan --model.flavor 70B`).
        "70B": LlamaArgs(
            dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=0, max_seq_len=8192
        ),
    },
    "smollm3": {
        "debug": _debug("smollm3", tie_embeddings=True, nope_layers=_every(4, 4)),
        "smollm3_3b": LlamaArgs(
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
            nope_layers=_every(4, 36),
        ),
    },
    "qwen2": {
        "debug": _debug("qwen2", qkv_bias=True),
        "qwen2.5_0.5b": _qwen2(896, 24, 14, 2, 4864, 151936, tie=True),
        "qwen2.5_1.5b": _qwen2(1536, 28, 12, 2, 8960, 151936, tie=True),
        "qwen2.5_7b": _qwen2(3584, 28, 28, 4, 18944, 152064, tie=False),
    },
    "qwen3": {
        "debug": _debug("qwen3", head_dim=32, qk_norm="head"),
        "qwen3_0.6b": _qwen3(1024, 28, 16, 8, 3072, tie=True),
        "qwen3_1.7b": _qwen3(2048, 28, 16, 8, 6144, tie=True),
        "qwen3_4b": _qwen3(2560, 36, 32, 8, 9728, tie=True),
        "qwen3_8b": _qwen3(4096, 36, 32, 8, 12288, tie=False),
    },
    "olmo2": {
        "debug": _debug("olmo2", n_kv_heads=4, qk_norm="full", norm_position="post"),
        "olmo2_1b": _olmo2(2048, 16, 16, 8192),
        "olmo2_7b": _olmo2(4096, 32, 32, 11008),
    },
    "mistral": {
        "debug": _debug("mistral"),
        # Mistral 7B v0.3: no sliding window.
        "mistral_7b": LlamaArgs(
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=14336,
            vocab_size=32768,
            max_seq_len=32768,
            rope_theta=1e6,
            norm_eps=1e-5,
            family="mistral",
        ),
    },
}


def families_of_flavor(flavor: str) -> list[str]:
    """The families (model.name) that have a flavor of this name."""
    return [family for family, flavors in FLAVORS.items() if flavor in flavors]

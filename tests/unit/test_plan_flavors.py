"""The flavors the planner sizes are the real models: Llama 3.1 8B, 70B and 405B and SmolLM3-3B have the parameter
counts `transformers` gives the published configurations (both built on the meta device, no memory)."""

import pytest
import torch

from titanlite.models.build import build_model

LLAMA31 = {
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
}
SHAPES = {  # hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size
    "8B": (4096, 32, 32, 8, 14336),
    "70B": (8192, 80, 64, 8, 28672),
    "405B": (16384, 126, 128, 8, 53248),
}


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors once


def hf_count(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return count(AutoModelForCausalLM.from_config(config))


def titanlite_count(name: str, flavor: str) -> int:
    with torch.device("meta"):
        return count(build_model(name, flavor, 50257, 1024))  # a smaller tokenizer: the flavor's own vocabulary


@pytest.mark.parametrize("flavor", sorted(SHAPES))
def test_llama31_flavors_have_the_published_parameter_counts(flavor):
    from transformers import LlamaConfig

    dim, layers, heads, kv, ffn = SHAPES[flavor]
    config = LlamaConfig(
        hidden_size=dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=ffn,
        **LLAMA31,
    )
    assert titanlite_count("llama3", flavor) == hf_count(config)


def test_smollm3_3b_has_the_published_parameter_count():
    from transformers import SmolLM3Config

    config = SmolLM3Config(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        rope_theta=5e6,
        no_rope_layer_interval=4,
    )
    assert titanlite_count("smollm3", "smollm3_3b") == hf_count(config)

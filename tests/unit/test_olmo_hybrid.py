"""OLMo Hybrid against `transformers` itself: random OlmoHybridForCausalLM models (grouped attention and value heads,
head_dim not hidden / heads, RoPE or none as the published checkpoints, beta doubled or not, tied or not) import with
transformers' logits to 1e-5 (fp32), greedy generation equals transformers', an export loads back in transformers
with our logits; packed documents are computed as if each were alone; what an olmo_hybrid config.json cannot mean is
refused in one line naming the field."""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

from tests.conformance import exports_as, greedy_ids_match, imported_by_config, random_hf, tokens  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.components.hf_weights import load_hf_into  # noqa: E402
from titanlite.models.build import model_from_args  # noqa: E402
from titanlite.models.common.attention import Sequence  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config, folder_args  # noqa: E402
from titanlite.models.olmo_hybrid import hf_config, weights  # noqa: E402

VOCAB = 200
CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,  # not 64 / 4
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    linear_conv_kernel_dim=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads read each key head
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
CASES = {
    "rope": {},
    "tied-beta-1": {
        "tie_word_embeddings": True,
        "linear_allow_neg_eigval": False,
        "layer_types": ["linear_attention", "full_attention"] * 2,
    },
}
NOPE = {"rope_parameters": {"rope_type": "default", "rope_theta": None}}  # the published checkpoints'


def random_model(changes: dict):
    """A transformers model of CONFIG with `changes`, its norms and dt_bias moved off their init too."""
    return random_hf(
        lambda: transformers.OlmoHybridForCausalLM(transformers.OlmoHybridConfig(**{**CONFIG, **changes})),
        scale=0.1,
        moved=lambda name: "norm" in name or "dt_bias" in name,
    )


@pytest.fixture(scope="module", params=list(CASES))
def folder(request, tmp_path_factory):
    hf = random_model(CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path


TOKENS = tokens(VOCAB, (2, 70))  # past one 64-token chunk


def test_logits_equal_transformers_and_an_export_loads_back_with_ours(folder, tmp_path):
    """Imported by the family's reader (`imported` here: the folder's 200 ids, which the byte tokenizer's 257 in
    tests/conformance.py's would refuse), its logits to rtol = atol = 1e-5; `exports_as` adds 1e-5 of their scale."""
    hf, path = folder
    ours = imported_by_config(path)
    with torch.no_grad():
        logits = ours(TOKENS)
        torch.testing.assert_close(logits, hf(TOKENS).logits, rtol=1e-5, atol=1e-5)
    args = folder_args(path, 64)
    back = exports_as(ours, args, tmp_path / "export", "OlmoHybridForCausalLM", TOKENS)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["OlmoHybridForCausalLM"]
    assert args_from_hf_config(config) == dataclasses.replace(args, max_seq_len=256)
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, logits, rtol=1e-5, atol=1e-5)
    llama = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 64, "rope_theta": None}  # fmt: skip
    with pytest.raises(ConfigError, match="rope_theta=null") as refused:
        args_from_hf_config(llama, "config.json:")
    assert "\n" not in str(refused.value)


def test_greedy_generation_equals_transformers(folder):
    hf, path = folder
    greedy_ids_match(hf, imported_by_config(path), [5, 17, 42, 7, 99, 3, 150], 10, VOCAB)


def test_packed_documents_compute_as_if_each_were_alone(folder):
    """Block-causal: the linear layers' state and convolution window restart at each document (the attention
    layers' mask too), so the logits of a packed row are those of its documents run one by one."""
    _, path = folder
    ours = imported_by_config(path)
    tokens = torch.randint(0, VOCAB, (1, 90), generator=torch.Generator().manual_seed(2))
    cuts = [0, 23, 24, 71, 90]  # a one-token document, and one crossing the 64-token chunk boundary
    documents = torch.zeros(1, 90, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        documents[:, a:b] = i
    with torch.no_grad():
        packed = ours(tokens, sequence=Sequence(documents=documents))
        alone = torch.cat([ours(tokens[:, a:b]) for a, b in zip(cuts, cuts[1:])], dim=1)
        whole = ours(tokens)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (packed[:, 30:] - whole[:, 30:]).abs().max() > 1e-3  # documents do change what the later tokens see


def test_the_published_checkpoints_attention_without_rotations_equals_transformers(tmp_path):
    """A null rope_theta: transformers builds no rotary embedding, and neither do we; the folder imports as users
    import it (the type check lets this family's null through, OLMo Hybrid's reader takes it), the export says it
    again. Another family's null rope_theta stays refused in one line."""
    hf = random_model(NOPE)
    assert hf.model.rotary_emb is None
    hf.save_pretrained(tmp_path / "hf")
    args = folder_args(tmp_path / "hf", 64)
    assert not args.rope
    ours = model_from_args(args).eval()
    load_hf_into([ours], tmp_path / "hf")
    with torch.no_grad():
        logits = ours(TOKENS)
        torch.testing.assert_close(logits, hf(TOKENS).logits, rtol=1e-5, atol=1e-5)
    back = exports_as(ours, args, tmp_path / "export", "OlmoHybridForCausalLM", TOKENS)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["rope_parameters"]["rope_theta"] is None
    assert back.model.rotary_emb is None
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, logits, rtol=1e-5, atol=1e-5)


def test_transformers_module_names_of_the_block_norms_read_as_the_stored_ones():
    args = hf_config.read({**CONFIG, "model_type": "olmo_hybrid"}, "config.json:")
    stored = {"model.layers.0.input_layernorm.weight", "model.layers.3.post_attention_layernorm.weight"}
    assert set(weights.hf_keys(args, sorted(stored))) == {
        "model.layers.0.attention_layer_norm.weight",
        "model.layers.3.feedforward_layer_norm.weight",
    }


@pytest.mark.parametrize(
    "change, field",
    [
        ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, "layer_types"),
        ({"layer_types": ["linear_attention"] * 4}, "layer_types"),
        ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"linear_key_head_dim": "16"}, "linear_key_head_dim"),
        ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
        ({"linear_allow_neg_eigval": "yes"}, "linear_allow_neg_eigval"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_what_olmo_hybrid_cannot_mean_is_refused_naming_the_field(change, field):
    config = {**CONFIG, "model_type": "olmo_hybrid", **change}
    with pytest.raises(ConfigError, match=field) as refused:
        args_from_hf_config(config, "config.json:")
    assert "\n" not in str(refused.value)

"""Granite 4.0 H against `transformers` itself: random GraniteMoeHybridForCausalLM folders (config.json's layer_types
under the published names, mamba / attention) import with transformers' logits to 1e-5 (fp32), in two shapes: experts
beside the shared MLP, grouped B and C, mamba_d_head "auto", the muP-style multipliers; and rotated attention, the
shared MLP alone, biases on the attention and Mamba projections but none on the convolution, tied embeddings, a
head_dim of its own. Greedy generation (the SSM state, convolution window and key/value cache) equals transformers',
an export loads back in transformers with our logits and says layer_types by the published names again; packed
documents are computed as if each were alone; the step is clamped to time_step_limit; our debug flavor, trained a few
steps, exports as GraniteMoeHybridForCausalLM; the Small flavor has the published parameter count; what a
granitemoehybrid config.json cannot mean is refused in one line naming the field."""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

from tests.conformance import (  # noqa: E402
    debug_args,
    exports_as,
    greedy_ids_match,
    imported_by_config,
    random_hf,
    tokens,
    trained,
)
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.models.build import model_from_args  # noqa: E402
from titanlite.models.common.attention import Sequence  # noqa: E402
from titanlite.models.granitemoehybrid import weights  # noqa: E402
from titanlite.models.granitemoehybrid.args import FLAVORS, with_depth  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config, folder_args  # noqa: E402

VOCAB = 200
CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_n_groups=2,  # four heads read each group's B and C; the gated norm normalises each group's half apart
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,  # the window of 70 tokens crosses four chunks
    embedding_multiplier=12.0,
    attention_multiplier=0.05,
    residual_multiplier=0.5,
    logits_scaling=3.0,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
CASES = {
    "experts": {
        "layer_types": ["mamba", "attention", "mamba", "mamba"],
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "shared_intermediate_size": 48,
    },
    "rope-dense-biases": {
        "layer_types": ["attention", "mamba", "mamba", "attention"],
        "num_local_experts": 0,
        "num_experts_per_tok": 0,
        "shared_intermediate_size": 80,
        "position_embedding_type": "rope",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
        "attention_bias": True,
        "mamba_proj_bias": True,
        "mamba_conv_bias": False,
        "tie_word_embeddings": True,
        "embedding_multiplier": 1.0,  # a tied head over random embeddings x 12 picks one id over and over
        "head_dim": 24,  # not 64 / 4
    },
}
PUBLISHED = {"linear_attention": "mamba", "full_attention": "attention"}  # transformers' names -> the published ones


def random_model(changes: dict):
    """A transformers model of CONFIG with `changes`, every parameter moved off its init (norms, A_log, D, dt_bias
    and the biases that start at zero too)."""
    config = transformers.GraniteMoeHybridConfig(**{**CONFIG, **changes})
    return random_hf(lambda: transformers.GraniteMoeHybridForCausalLM(config))


@pytest.fixture(scope="module", params=list(CASES))
def folder(request, tmp_path_factory):
    hf = random_model(CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    # The published config.json names the layers mamba / attention; transformers writes its own names.
    config["layer_types"] = [PUBLISHED[kind] for kind in config["layer_types"]]
    if request.param == "experts":
        config["mamba_d_head"] = "auto"  # int(mamba_expand x hidden_size) / mamba_n_heads = 16
    (path / "config.json").write_text(json.dumps(config))
    return hf, path


TOKENS = tokens(VOCAB, (2, 70))


def test_logits_equal_transformers_and_an_export_loads_back_with_ours(folder, tmp_path):
    hf, path = folder
    ours = imported_by_config(path)
    with torch.no_grad():
        logits = ours(TOKENS)
        torch.testing.assert_close(logits, hf(TOKENS).logits, rtol=1e-5, atol=1e-5)
    args = folder_args(path, 64)
    back = exports_as(ours, args, tmp_path / "export", "GraniteMoeHybridForCausalLM", TOKENS)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    published = json.loads((path / "config.json").read_text())
    assert config["layer_types"] == published["layer_types"]
    assert args_from_hf_config(config) == dataclasses.replace(args, max_seq_len=256)
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, logits, rtol=1e-5, atol=1e-5)


def test_greedy_generation_equals_transformers(folder):
    """A prompt of 20 tokens (more than one chunk of 16) and 12 new ones, each decoded from the cached SSM state,
    convolution window and keys and values."""
    hf, path = folder
    prompt = tokens(VOCAB, (1, 20), seed=5)[0].tolist()
    greedy_ids_match(hf, imported_by_config(path), prompt, 12, VOCAB, distinct=2)


def test_packed_documents_compute_as_if_each_were_alone(folder):
    """Block-causal: the Mamba layers' state and convolution window restart at each document (the attention layers'
    mask too; rotated layers read each document's own positions), so the logits of a packed row are those of its
    documents run one by one."""
    _, path = folder
    ours = imported_by_config(path)
    row = torch.randint(0, VOCAB, (1, 90), generator=torch.Generator().manual_seed(2))
    cuts = [0, 23, 24, 71, 90]  # a one-token document, and ones crossing the 16-token chunk boundaries
    documents = torch.zeros(1, 90, dtype=torch.long)
    positions = torch.zeros(1, 90, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        documents[:, a:b], positions[:, a:b] = i, torch.arange(b - a)
    with torch.no_grad():
        packed = ours(row, sequence=Sequence(documents=documents, positions=positions[0]))
        alone = torch.cat([ours(row[:, a:b]) for a, b in zip(cuts, cuts[1:])], dim=1)
        whole = ours(row)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (packed[:, 30:] - whole[:, 30:]).abs().max() > 1e-3


def test_the_step_is_clamped_to_time_step_limit_as_transformers_clamps_it(tmp_path):
    """A limit the steps cross (softplus(dt + dt_bias) is about 1.3 at transformers' init of dt_bias, one): the logits
    are transformers' and not those of the unclamped model. (transformers' one-token decoding step does not clamp, so
    generation is compared under the default limit, none.)"""
    hf = random_model({**CASES["experts"], "time_step_limit": (0.05, 0.5)})
    hf.save_pretrained(tmp_path)
    ours = imported_by_config(tmp_path)
    assert (ours.args.dt_min, ours.args.dt_max) == (0.05, 0.5)
    unclamped = model_from_args(dataclasses.replace(ours.args, dt_min=0.0, dt_max=float("inf")))
    unclamped.load_state_dict(ours.state_dict())
    with torch.no_grad():
        logits = ours(TOKENS)
        torch.testing.assert_close(logits, hf(TOKENS).logits, rtol=1e-5, atol=1e-5)
        assert (unclamped.eval()(TOKENS) - logits).abs().max() > 1e-3


def test_the_debug_flavor_trained_exports_as_granitemoehybrid(tmp_path):
    """Our debug flavor (experts, grouped B and C, every multiplier other than one) after a few AdamW steps, so norms,
    dt_bias, A_log and D leave their initial values: transformers loads its export with our logits."""
    args = debug_args(FLAVORS)
    ours, batch = trained(args)
    exports_as(ours, args, tmp_path, "GraniteMoeHybridForCausalLM", batch[:, :-1])


def test_transformers_in_memory_expert_names_read_as_the_stored_ones():
    args = FLAVORS["debug"]
    moe = "model.layers.0.block_sparse_moe."
    assert weights.hf_keys(args, [f"{moe}experts.gate_up_proj", f"{moe}router.weight", "lm_head.weight"]) == {
        f"{moe}input_linear.weight": f"{moe}experts.gate_up_proj",
        f"{moe}router.layer.weight": f"{moe}router.weight",
        "lm_head.weight": "lm_head.weight",
    }


def test_a_deeper_model_repeats_the_layer_pattern():
    small = FLAVORS["granite_4_0_h_small"]
    assert with_depth(small, 12)["layer_types"] == small.layer_types[:12]
    kinds = with_depth(FLAVORS["debug"], 6)["layer_types"]
    assert kinds == (*FLAVORS["debug"].layer_types, *FLAVORS["debug"].layer_types[:2])


def test_the_small_flavor_has_the_published_parameter_count():
    """32,207,337,984: the total of ibm-granite/granite-4.0-h-small's safetensors index (its embeddings tied)."""
    with torch.device("meta"):
        model = model_from_args(FLAVORS["granite_4_0_h_small"])
    assert sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) == 32_207_337_984


@pytest.mark.parametrize(
    "change, field",
    [
        ({"layer_types": ["mamba", "attention", "mamba2", "mamba"]}, "layer_types='mamba2'.*mamba, linear_attention"),
        ({"layer_types": None, "layers_block_type": ["mamba", "hybrid", "mamba", "mamba"]}, "layers_block_type"),
        ({"num_hidden_layers": 5}, "num_hidden_layers"),
        ({"mamba_d_head": "auto", "mamba_n_heads": 6}, "mamba_n_heads"),  # 6 does not divide 2 x 64
        ({"mamba_d_head": 8}, "mamba_d_head"),  # 8 heads of 8 make 64, not the inner width 128
        ({"mamba_n_groups": 3}, "mamba_n_groups"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"sliding_window": 64}, "sliding_window"),
        ({"position_embedding_type": "alibi"}, "position_embedding_type"),
        ({"position_embedding_type": "rope", "head_dim": 15}, "head_dim"),
        ({"position_embedding_type": "rope", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"time_step_limit": None}, "time_step_limit"),
        ({"time_step_limit": [0.5, 0.1]}, "time_step_limit"),
        ({"logits_scaling": 0}, "logits_scaling"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"mamba_n_heads": "8"}, "mamba_n_heads"),
        ({"embedding_multiplier": True}, "embedding_multiplier"),
    ],
)
def test_what_granitemoehybrid_cannot_mean_is_refused_naming_the_field(change, field):
    config = {**CONFIG, **CASES["experts"], "model_type": "granitemoehybrid", **change}
    with pytest.raises(ConfigError, match=field) as refused:
        args_from_hf_config(config, "config.json:")
    assert "\n" not in str(refused.value)


def test_absent_keys_take_transformers_defaults():
    """A config.json of the sizes alone: GraniteMoeHybridConfig's defaults for the rest (every layer Mamba-2, 8
    experts of which 2 per token, the head width int(2 x hidden_size) / 128, no step limit, no rotations)."""
    args = args_from_hf_config({"model_type": "granitemoehybrid", "hidden_size": 256, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "vocab_size": 64})  # fmt: skip
    assert args.layer_types == ("mamba", "mamba") and (args.moe.n_experts, args.moe.top_k) == (8, 2)
    assert (args.mamba_heads, args.mamba_head_dim, args.mamba_groups, args.state_dim) == (128, 4, 1, 256)
    assert (args.dt_min, args.dt_max, args.rope, args.ffn_dim, args.moe.expert_dim) == (0.0, float("inf"), False,
                                                                                       1024, 11008)  # fmt: skip

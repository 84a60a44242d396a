"""Falcon-H1 against `transformers` itself. Random FalconH1ForCausalLM folders (grouped B and C, grouped key/value
heads, head_dim != hidden / heads, the published kind of multipliers off one everywhere) in two cases: the Mamba
output's gated RMSNorm (the norm before the gate); and no norm, so the gate falls on the scan's output, with every bias
(attention, MLP, Mamba input and output projections) but the convolution's. Each imports with transformers' logits to
1e-5 (fp32), greedy generation (the KV cache, the SSM state and the convolution window at once) equals transformers',
an export loads back in transformers with our logits and its config.json reads back as the same arguments; packed
documents are computed as if each were alone. Tied embeddings with the gate before the norm import and export alike;
a binding time_step_limit clamps the step as transformers' prefill does; the published 0.5B config.json reads as our
flavor; what a falcon_h1 config.json cannot mean is refused in one line naming the field."""

import dataclasses
import json
import math

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

from tests.conformance import exports_as, greedy_ids_match, imported_by_config, random_hf, tokens  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.models.common.attention import Sequence  # noqa: E402
from titanlite.models.falcon_h1.args import FLAVORS  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config, folder_args  # noqa: E402

VOCAB = 200
CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,  # not 64 / 4
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    mamba_d_ssm=64,
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_n_groups=2,  # four heads read each group's B and C
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=16,  # the window of 70 tokens crosses four chunks (ours: the same size)
    # the published kind of muP multipliers, none of them one
    embedding_multiplier=5.656854249492381,
    lm_head_multiplier=0.3,
    attention_in_multiplier=1.5,
    attention_out_multiplier=0.9375,
    key_multiplier=0.39,
    ssm_in_multiplier=1.25,
    ssm_out_multiplier=0.7,
    ssm_multipliers=[0.35, 0.6, 0.8, 1.3, 0.45],
    mlp_multipliers=[0.88, 0.59],
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
CASES = {
    "gated-norm": {"mamba_rms_norm": True, "mamba_norm_before_gate": True},
    "biases": {
        "mamba_rms_norm": False,
        "attention_bias": True,
        "mlp_bias": True,
        "mamba_proj_bias": True,
        "projectors_bias": True,
        "mamba_conv_bias": False,
    },
}


def random_model(changes: dict):
    """A transformers model of CONFIG with `changes`, every parameter moved off its init (norms, A_log, D, dt_bias
    and the biases that start at zero too), its convolutions ten times larger: so x, B and C are, and the scan's state
    shows in the logits beside the D skip (at random_hf's scale, A_log + 3 moved them by 1e-6, under the tolerance;
    now by 1e-3)."""
    hf = random_hf(lambda: transformers.FalconH1ForCausalLM(transformers.FalconH1Config(**{**CONFIG, **changes})))
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mamba.conv1d.weight.mul_(10.0)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def folder(request, tmp_path_factory):
    hf = random_model(CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path


TOKENS = tokens(VOCAB, (2, 70))


def test_logits_equal_transformers_and_an_export_loads_back_with_ours(folder, tmp_path):
    hf, path = folder
    ours = imported_by_config(path)
    with torch.no_grad():
        logits = ours(TOKENS)
        torch.testing.assert_close(logits, hf(TOKENS).logits, rtol=1e-5, atol=1e-5)
    args = folder_args(path, 64)
    back = exports_as(ours, args, tmp_path / "export", "FalconH1ForCausalLM", TOKENS)
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["ssm_multipliers"] == CONFIG["ssm_multipliers"]
    assert "time_step_limit" not in written  # transformers' default, no clamp
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, logits, rtol=1e-5, atol=1e-5)


def test_greedy_generation_equals_transformers(folder):
    """A prompt of 20 tokens (more than one chunk of 16) and 12 new ones, each decoded from the cached keys and
    values, SSM state and convolution window."""
    hf, path = folder
    prompt = tokens(VOCAB, (1, 20), seed=5)[0].tolist()
    greedy_ids_match(hf, imported_by_config(path), prompt, 12, VOCAB, distinct=2)


def test_packed_documents_compute_as_if_each_were_alone(folder):
    """Block-causal: the attention's mask and the Mamba mixers' state and convolution window restart at each
    document, so the logits of a packed row are those of its documents run one by one."""
    _, path = folder
    ours = imported_by_config(path)
    row = torch.randint(0, VOCAB, (1, 90), generator=torch.Generator().manual_seed(2))
    cuts = [0, 23, 24, 71, 90]  # a one-token document, and ones crossing the 16-token chunk boundaries
    documents = torch.zeros(1, 90, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        documents[:, a:b] = i
    with torch.no_grad():
        packed = ours(row, sequence=Sequence(documents=documents))
        alone = torch.cat([ours(row[:, a:b]) for a, b in zip(cuts, cuts[1:])], dim=1)
        whole = ours(row)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (packed[:, 30:] - whole[:, 30:]).abs().max() > 1e-3


def test_tied_embeddings_with_the_gate_before_the_norm_import_and_export(tmp_path):
    """lm_head tied to the embeddings (one tensor in the folder) and the Mamba gate applied before its norm."""
    hf = random_model({"tie_word_embeddings": True, "mamba_rms_norm": True, "mamba_norm_before_gate": False})
    hf.save_pretrained(tmp_path / "hf")
    ours = imported_by_config(tmp_path / "hf")
    assert ours.args.tie_embeddings and not ours.args.mamba_norm_before_gate
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), hf(TOKENS).logits, rtol=1e-5, atol=1e-5)
    exports_as(ours, folder_args(tmp_path / "hf", 64), tmp_path / "export", "FalconH1ForCausalLM", TOKENS)


def test_a_binding_time_step_limit_clamps_the_step_as_transformers_prefill(tmp_path):
    """The steps (softplus of about 1.3, dt_bias near one) clamped to [0.05, 0.3]: our logits are transformers'
    (whose chunked scan clamps; its one-token decoding step does not, so generation is compared without a clamp that
    binds), and the clamp changes them."""
    hf = random_model({**CASES["gated-norm"], "time_step_limit": [0.05, 0.3]})
    hf.save_pretrained(tmp_path)
    ours = imported_by_config(tmp_path)
    assert (ours.args.dt_min, ours.args.dt_max) == (0.05, 0.3)
    with torch.no_grad():
        logits = ours(TOKENS)
        torch.testing.assert_close(logits, hf(TOKENS).logits, rtol=1e-5, atol=1e-5)
        for layer in hf.model.layers:
            layer.mamba.time_step_limit = (0.0, math.inf)
        assert (hf(TOKENS).logits - logits).abs().max() > 1e-2


# tiiuae/Falcon-H1-0.5B-Instruct's config.json as Megatron-Bridge's Falcon-H1 bridge tests carry it, with the
# mamba_d_ssm that transformers needs for its 24 heads of 64 (mlx-lm's falcon_h1 defaults say 1536).
PUBLISHED_0_5B = {
    "architectures": ["FalconH1ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_in_multiplier": 1.0,
    "attention_out_multiplier": 0.9375,
    "attn_layer_indices": None,
    "embedding_multiplier": 5.656854249492381,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 2048,
    "key_multiplier": 0.39062499999999994,
    "lm_head_multiplier": 0.0390625,
    "mamba_chunk_size": 128,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_head": 64,
    "mamba_d_ssm": 1536,
    "mamba_d_state": 128,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_n_heads": 24,
    "mamba_norm_before_gate": False,
    "mamba_proj_bias": False,
    "mamba_rms_norm": False,
    "mamba_use_mlp": True,
    "max_position_embeddings": 16384,
    "mlp_bias": False,
    "mlp_multipliers": [0.8838834764831844, 0.5859375],
    "model_type": "falcon_h1",
    "num_attention_heads": 8,
    "num_hidden_layers": 36,
    "num_key_value_heads": 2,
    "projectors_bias": False,
    "rms_norm_eps": 1e-5,
    "rope_scaling": None,
    "rope_theta": 100000000000.0,
    "ssm_in_multiplier": 1.25,
    "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
    "ssm_out_multiplier": 0.23570226039551587,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32784,
}


def test_every_layer_counts_its_attention_and_its_scan():
    """The shared FLOP formula counts a ParallelBlock's attention (12 d T: the only term that grows with T) and the
    Mamba mixer beside it (its scan's work, StateScan.flops_per_token) in every layer."""
    from titanlite.components.metrics import flops_per_token
    from titanlite.models.build import model_from_args
    from titanlite.models.common.flops import matmul_parameters

    with torch.device("meta"):
        model = model_from_args(dataclasses.replace(FLAVORS["debug"], vocab_size=256))
    a = model.args
    growth = flops_per_token(model, 8192) - flops_per_token(model, 4096)
    assert growth == 12 * a.n_layers * a.n_heads * a.head_dim * 4096
    scans = [block.mamba.sequence_flops_per_token(4096) for block in model.layers.values()]
    assert len(scans) == a.n_layers and all(s > 0 for s in scans)
    attention = 12 * a.n_layers * a.n_heads * a.head_dim * 4096
    assert flops_per_token(model, 4096) == 6 * matmul_parameters(model) + attention + sum(scans)


def test_the_published_config_reads_as_our_flavor_and_back():
    assert args_from_hf_config(PUBLISHED_0_5B) == FLAVORS["falcon_h1_0.5b"]
    assert transformers.FalconH1Config(**PUBLISHED_0_5B).mamba_d_head == 64  # transformers takes it as it is
    expanded = args_from_hf_config({**PUBLISHED_0_5B, "mamba_d_ssm": None, "mamba_expand": 2, "mamba_n_heads": 32})
    assert (expanded.mamba_width, expanded.mamba_heads) == (2048, 32)  # mamba_expand x hidden_size without it
    auto = args_from_hf_config({**PUBLISHED_0_5B, "mamba_d_head": "auto"})
    assert auto.mamba_head_dim == 64


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mamba_use_mlp": False}, "mamba_use_mlp"),
        ({"attn_layer_indices": [0, 1]}, "attn_layer_indices"),
        ({"sliding_window": 64}, "sliding_window"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"layer_types": ["attention", "hybrid", "hybrid"]}, "layer_types"),
        ({"mamba_d_ssm": 60}, "mamba_n_heads"),  # 8 heads do not divide it
        ({"mamba_d_head": 4}, "mamba_d_head"),  # 8 heads of 4 are not mamba_d_ssm=64
        ({"mamba_n_groups": 3}, "mamba_n_heads"),  # not a multiple of the groups
        ({"mamba_n_groups": "2"}, "mamba_n_groups"),
        ({"mamba_rms_norm": "true"}, "mamba_rms_norm"),
        ({"time_step_limit": [0.5, 0.1]}, "time_step_limit"),
        ({"time_step_limit": None}, "time_step_limit"),
        ({"ssm_multipliers": [1.0, 1.0]}, "ssm_multipliers"),
        ({"mlp_multipliers": [1.0, "2"]}, "mlp_multipliers"),
        ({"key_multiplier": None}, "key_multiplier"),
        ({"embedding_multiplier": "5.6"}, "embedding_multiplier"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type"),
        ({"mamba_d_state": 0}, "mamba_d_state"),
    ],
)
def test_what_falcon_h1_cannot_mean_is_refused_naming_the_field(change, field):
    config = {**CONFIG, "model_type": "falcon_h1", **change}
    with pytest.raises(ConfigError, match=field) as refused:
        args_from_hf_config(config, "config.json:")
    assert "\n" not in str(refused.value)


def test_time_step_limit_reads_and_writes_an_infinite_bound_as_transformers_5():
    """A clamp below alone is written with transformers 5's tagged infinity, which reads back (from JSON too); no
    clamp at all, transformers' default, goes unsaid."""
    from titanlite.models.common.mamba2_args import step_limit, step_limit_fields

    written = json.loads(json.dumps(step_limit_fields(0.01, math.inf)))
    assert written == {"time_step_limit": [0.01, {"__float__": "Infinity"}]}
    assert step_limit(written["time_step_limit"], "config.json:") == (0.01, math.inf)
    assert step_limit([0.0, math.inf], "config.json:") == (0.0, math.inf) and step_limit_fields(0.0, math.inf) == {}

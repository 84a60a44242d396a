"""Mamba-2 and Nemotron-H. The SSD scan: the chunked path equals the recurrence in float64 (outputs, final state and
every gradient) with packed documents resetting the state and a state handed in. Nemotron-H against `transformers`
itself: random NemotronHForCausalLM folders (config.json written with hybrid_override_pattern, as published; grouped
B and C and grouped key/value heads; Nemotron 3's mixture-of-experts layers, relu^2 experts with and without a latent
width, a shared expert, routing biases and grouped routing; conv and projection biases on and off; lm_head never
tied, as transformers' never ties it) import with transformers' logits to 1e-5 (fp32), greedy generation (the SSM
state and convolution window in the cache) equals transformers', an export loads back in transformers with our logits
and says hybrid_override_pattern again; a folder's multi-token prediction depth loads, trains and exports (carried
where the run leaves it out); packed documents are computed as if each were alone; what a nemotron_h config.json
cannot mean is refused in one line naming the field."""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from tests.conformance import exports_as, greedy_ids_match, imported_by_config, random_hf, tokens  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.components.metrics import flops_per_token  # noqa: E402
from titanlite.models.build import model_from_args  # noqa: E402
from titanlite.models.common.attention import Sequence  # noqa: E402
from titanlite.models.common.mamba2 import StateScan, ssd_chunked, ssd_recurrent  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config, folder_args  # noqa: E402
from titanlite.models.nemotron_h.args import FLAVORS, with_depth  # noqa: E402

VOCAB = 200
CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,  # not 64 / 4
    vocab_size=VOCAB,
    max_position_embeddings=256,
    mamba_num_heads=8,
    mamba_head_dim=8,
    n_groups=2,  # four heads read each group's B and C
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=16,  # the window of 70 tokens crosses four chunks (ours: the same size)
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
MOE = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    routed_scaling_factor=2.5,
)
CASES = {
    "published": {"hybrid_override_pattern": "M-M*-M"},
    "biases": {"hybrid_override_pattern": "M*M-", "use_bias": True, "mlp_bias": True, "use_conv_bias": False},
    # Nemotron 3: mixture-of-experts layers, relu^2 experts in a latent width, a shared expert, grouped routing
    "latent-moe": {"hybrid_override_pattern": "ME*EM-", **MOE, "moe_latent_size": 24, "n_group": 2, "topk_group": 1},
    "moe": {"hybrid_override_pattern": "MEM*E", **MOE},
}


def random_model(changes: dict):
    """A transformers model of CONFIG with `changes`, every parameter moved off its init (norms, A_log, D, dt_bias
    and the biases that start at zero too)."""
    return random_hf(
        lambda: transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**{**CONFIG, **changes})),
        buffers=lambda name: name.endswith("e_score_correction_bias"),  # the routing biases, which start at zero
    )


@pytest.fixture(scope="module", params=list(CASES))
def folder(request, tmp_path_factory):
    hf = random_model(CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    # The published config.json names the layers by hybrid_override_pattern; transformers writes layers_block_type.
    config.pop("layers_block_type")
    config["hybrid_override_pattern"] = CASES[request.param]["hybrid_override_pattern"]
    (path / "config.json").write_text(json.dumps(config))
    return hf, path


TOKENS = tokens(VOCAB, (2, 70))


def test_the_chunked_scan_equals_the_recurrence_with_documents_and_a_state():
    """float64, 1e-10: outputs, the final state and the gradients of every input (q, k, v, the log-decay, the state
    handed in), with a one-token document, documents crossing chunk boundaries, and none."""
    generator = torch.Generator().manual_seed(0)
    batch, length, groups, state, heads, width = 2, 37, 2, 5, 4, 3

    def draw(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=generator).requires_grad_()

    q, k, v, s0 = draw(batch, length, groups, state), draw(batch, length, groups, state), draw(
        batch, length, heads, width), draw(batch, heads, state, width)  # fmt: skip
    g = (-torch.rand(batch, length, heads, dtype=torch.float64, generator=generator)).requires_grad_()
    documents = torch.zeros(batch, length, dtype=torch.long)
    documents[0, 10:], documents[0, 11:], documents[1, 16:] = 1, 2, 1
    for docs in (None, documents):
        ours = ssd_chunked(q, k, v, g, s0, docs, chunk_size=8)
        reference = ssd_recurrent(q, k, v, g, s0, docs)
        for a, b in zip(ours, reference):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
        inputs = (q, k, v, g, s0)
        grads = torch.autograd.grad(ours[0].square().sum() + ours[1].sum(), inputs)
        expected = torch.autograd.grad(reference[0].square().sum() + reference[1].sum(), inputs)
        for a, b in zip(grads, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    # documents change what the later tokens see (the reset is real)
    assert (ssd_chunked(q, k, v, g, s0, documents)[0] - ssd_chunked(q, k, v, g, s0)[0]).abs().max() > 1e-3


def test_the_scan_counts_the_flops_torch_counts_and_only_attention_grows_with_length():
    """StateScan.flops_per_token (x3 for backward) is what torch's FLOP counter counts of the chunked scan's forward
    (a length a multiple of the chunk); a Nemotron-H's FLOPs per token grow with the length by its attention layers'
    12 d T alone: the Mamba layers' work is linear in T, the MLP layers' (FeedForwardBlock) mix no tokens."""
    generator = torch.Generator().manual_seed(0)
    length, groups, state, heads, width = 32, 2, 5, 4, 3
    q, k = (torch.randn(1, length, groups, state, generator=generator) for _ in range(2))
    v, g = torch.randn(1, length, heads, width, generator=generator), -torch.rand(1, length, heads, generator=generator)
    scan = StateScan(chunk_size=8)
    with FlopCounterMode(display=False) as counter:
        scan(q, k, v, g)
    assert 3 * counter.get_total_flops() == length * scan.flops_per_token(heads, groups, state, width)
    with torch.device("meta"):
        model = model_from_args(dataclasses.replace(FLAVORS["debug"], vocab_size=256))
    attention = sum(kind == "full_attention" for kind in model.args.layer_types)
    growth = flops_per_token(model, 8192) - flops_per_token(model, 4096)
    assert attention == 1 and growth == 12 * attention * model.args.n_heads * model.args.head_dim * 4096


def test_logits_equal_transformers_and_an_export_loads_back_with_ours(folder, tmp_path):
    hf, path = folder
    ours = imported_by_config(path)
    with torch.no_grad():
        logits = ours(TOKENS)
        torch.testing.assert_close(logits, hf(TOKENS).logits, rtol=1e-5, atol=1e-5)
    args = folder_args(path, 64)
    back = exports_as(ours, args, tmp_path / "export", "NemotronHForCausalLM", TOKENS)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    published = json.loads((path / "config.json").read_text())
    assert config["hybrid_override_pattern"] == published["hybrid_override_pattern"]
    assert args_from_hf_config(config) == dataclasses.replace(args, max_seq_len=256)
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, logits, rtol=1e-5, atol=1e-5)


def test_greedy_generation_equals_transformers(folder):
    """A prompt of 20 tokens (more than one chunk of 16) and 12 new ones, each decoded from the cached SSM state and
    convolution window."""
    hf, path = folder
    prompt = tokens(VOCAB, (1, 20), seed=5)[0].tolist()
    greedy_ids_match(hf, imported_by_config(path), prompt, 12, VOCAB, distinct=2)


def test_packed_documents_compute_as_if_each_were_alone(folder):
    """Block-causal: the Mamba layers' state and convolution window restart at each document (the attention layers'
    mask too), so the logits of a packed row are those of its documents run one by one."""
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


def test_a_folder_s_multi_token_prediction_depth_loads_trains_and_exports_bit_for_bit(tmp_path, caplog):
    """A Nemotron 3 Super-style folder: num_nextn_predict_layers 1 (mtp_hybrid_override_pattern "*E") and its depth's
    tensors under mtp.layers.0 (fusion, attention) and mtp.layers.1 (experts, final norm). The model has the depth,
    loaded tensor for tensor; the main logits stay transformers' (which builds no depth); the depth runs and its loss
    has a gradient for every depth tensor; an export writes the depth's tensors back unchanged and loads in
    transformers with our logits. With model.mtp_layers = 0 the tensors are carried instead, bit for bit."""
    from safetensors.torch import load_file, save_file

    from titanlite.components.hf_weights import load_hf_into, save_hf, to_hf
    from titanlite.models.common.init import init_weights

    hf = random_model(CASES["latent-moe"])
    source = tmp_path / "hf"
    hf.save_pretrained(source)
    args = dataclasses.replace(folder_args(source, 64), mtp_layers=1)
    donor = model_from_args(args)
    init_weights(donor, 3)
    mtp = {k: v for k, v in to_hf(args, donor.state_dict()).items() if k.startswith("mtp.")}
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.1.final_layernorm.weight"} <= set(mtp)
    assert "mtp.layers.1.mixer.experts.0.up_proj.weight" in mtp and "mtp.layers.0.mixer.q_proj.weight" in mtp
    config = json.loads((source / "config.json").read_text())
    config |= {"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}
    config.pop("mtp_layers_block_type", None)
    (source / "config.json").write_text(json.dumps(config))
    weights = load_file(source / "model.safetensors")
    save_file({**weights, **mtp}, source / "model.safetensors", metadata={"format": "pt"})

    assert folder_args(source, 64).mtp_layers == 1
    model = model_from_args(folder_args(source, 64))
    load_hf_into([model], source)
    state = model.state_dict()
    for ours, theirs in donor.state_dict().items():
        if ours.startswith(("mtp.", f"layers.{args.n_layers}.")):
            assert torch.equal(state[ours], theirs), ours
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(TOKENS), hf(TOKENS).logits, rtol=1e-5, atol=1e-5)
    ahead = TOKENS[:, 1:, None]
    out = model.train()(TOKENS[:, :-1], mtp_tokens=ahead)
    assert out.shape == (2 * TOKENS.shape[0], TOKENS.shape[1] - 1, VOCAB)
    out[TOKENS.shape[0] :].square().mean().backward()
    depth = [(n, p) for n, p in model.named_parameters() if n.startswith(("mtp.", f"layers.{args.n_layers}."))]
    assert depth and all(p.grad is not None for _, p in depth)
    model.zero_grad()

    save_hf(tmp_path / "export", model.args, model.state_dict(), carry_from=source)
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(exported[k], v) for k, v in mtp.items())
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (written["num_nextn_predict_layers"], written["mtp_hybrid_override_pattern"]) == (1, "*E")
    back = transformers.NemotronHForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, hf(TOKENS).logits, rtol=1e-5, atol=1e-5)

    without = dataclasses.replace(folder_args(source, 64), mtp_layers=0)  # model.mtp_layers = 0: carried instead
    plain = model_from_args(without)
    load_hf_into([plain], source)
    save_hf(tmp_path / "carried", without, plain.state_dict(), carry_from=source)
    carried = load_file(tmp_path / "carried" / "model.safetensors")
    assert all(torch.equal(carried[k], v) for k, v in mtp.items())


def test_transformers_module_names_read_as_the_published_ones():
    from titanlite.models.nemotron_h import weights

    args = FLAVORS["debug"]
    assert weights.hf_keys(args, ["model.layers.0.mixer.A_log", "lm_head.weight"]) == {
        "backbone.layers.0.mixer.A_log": "model.layers.0.mixer.A_log",
        "lm_head.weight": "lm_head.weight",
    }


def test_a_deeper_model_repeats_the_pattern():
    assert with_depth(FLAVORS["nemotron_h_8b"], 12)["layer_types"] == FLAVORS["nemotron_h_8b"].layer_types[:12]
    kinds = with_depth(FLAVORS["debug"], 8)["layer_types"]
    assert kinds == (*FLAVORS["debug"].layer_types, *FLAVORS["debug"].layer_types[:2])


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hybrid_override_pattern": "M-X*"}, "hybrid_override_pattern"),
        ({"hybrid_override_pattern": "ME*-", "mlp_bias": True}, "mlp_bias"),  # the shared expert's
        ({"hybrid_override_pattern": "ME*-", "num_experts_per_tok": 9}, "num_experts_per_tok"),  # of 8 experts
        ({"hybrid_override_pattern": "ME*-", "n_group": 3}, "n_group"),  # not dividing the 8 experts
        ({"layers_block_type": ["linear_attention", "mamba2"]}, "layers_block_type"),
        ({"hybrid_override_pattern": "M-M*", "num_hidden_layers": 5}, "num_hidden_layers"),
        ({"mamba_num_heads": 6}, "mamba_num_heads"),  # not a multiple of n_groups=4
        ({"n_groups": "2"}, "n_groups"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
        ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),  # transformers' never ties it
        ({"mamba_proj_bias": True}, "mamba_proj_bias"),
        ({"sliding_window": 64}, "sliding_window"),
        ({"ssm_state_size": 0}, "ssm_state_size"),
        ({"hybrid_override_pattern": "ME*-", "num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
        (
            {"hybrid_override_pattern": "ME*-", "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "E*"},
            "mtp_hybrid_override_pattern",
        ),
        ({"num_nextn_predict_layers": 1}, "mtp_layers"),  # a depth of experts in a model without them
    ],
)
def test_what_nemotron_h_cannot_mean_is_refused_naming_the_field(change, field):
    config = {**CONFIG, "model_type": "nemotron_h", "hybrid_override_pattern": "M-M*", "n_groups": 4, **change}
    with pytest.raises(ConfigError, match=field) as refused:
        args_from_hf_config(config, "config.json:")
    assert "\n" not in str(refused.value)

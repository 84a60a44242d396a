"""Qwen3-Next against `transformers` itself: a random Qwen3NextForCausalLM (two value heads per key head, so the
fused, head-grouped in_proj_qkvz / in_proj_ba really are regrouped; partial rotary; a dense layer among the mixtures
of experts) imports with transformers' logits to 1e-5 (fp32), greedy generation equals transformers', an export loads
back in transformers with our logits; the published folders' multi-token prediction tensors are skipped; what a
qwen3_next config.json cannot mean is refused in one line naming the field."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

from tests.conformance import exports_as, greedy_ids_match, imported_by_config, random_hf, tokens  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config, folder_args, hf_config  # noqa: E402
from titanlite.models.qwen3_next import weights  # noqa: E402
from titanlite.models.qwen3_next.args import FLAVORS  # noqa: E402

VOCAB = 200
CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,  # the dense layer's MLP
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads read each key head
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    norm_topk_prob=False,  # Qwen3.5-MoE always renormalises; Qwen3-Next says
    mlp_only_layers=[1],
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def random_model():
    """A transformers Qwen3-Next, its norms and dt_bias moved off their init too."""
    return random_hf(
        lambda: transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**CONFIG)),
        scale=0.1,
        moved=lambda name: "norm" in name or "dt_bias" in name,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    hf = random_model()
    path = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(path)
    return hf, path


def test_the_folder_reads_as_grouped_value_heads_with_a_dense_layer(folder):
    _, path = folder
    args = folder_args(path, 64)
    assert (args.family, args.linear_key_heads, args.linear_value_heads, args.rotary_dim) == ("qwen3_next", 2, 4, 8)
    assert (args.ffn_dim, args.moe.expert_dim, args.moe.dense_layers, args.moe.norm_topk_prob) == (96, 24, (1,), False)


def test_logits_equal_transformers_and_an_export_loads_back_with_ours(folder, tmp_path):
    """Imported by the family's reader (`imported` here: the folder's 200 ids, which the byte tokenizer's 257 in
    tests/conformance.py's would refuse), its logits to rtol = atol = 1e-5; `exports_as` adds 1e-5 of their scale."""
    hf, path = folder
    ours = imported_by_config(path)
    batch = tokens(VOCAB, (2, 70))  # past one 64-token chunk
    with torch.no_grad():
        logits = ours(batch)
        torch.testing.assert_close(logits, hf(batch).logits, rtol=1e-5, atol=1e-5)
    args = folder_args(path, 64)
    back = exports_as(ours, args, tmp_path / "export", "Qwen3NextForCausalLM", batch, model_type="qwen3_next")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == ["Qwen3NextForCausalLM"]
    with torch.no_grad():
        torch.testing.assert_close(back(batch).logits, logits, rtol=1e-5, atol=1e-5)
    assert folder_args(tmp_path / "export", 64) == args


def test_greedy_generation_equals_transformers(folder):
    hf, path = folder
    greedy_ids_match(hf, imported_by_config(path), [5, 17, 42, 7, 99, 3, 150], 10, VOCAB)


def test_fused_projections_regroup_by_key_head_and_back():
    """in_proj_qkvz's rows are [q_g, k_g, v_g (r heads), z_g (r heads)] for each key-head group g: value head
    g r + j of ours is row block (g, j) of the group's v part."""
    args = FLAVORS["debug"]  # 2 key heads of 16, 4 value heads of 16
    hk, dk, dv, r = args.linear_key_heads, args.linear_key_dim, args.linear_value_dim, 2
    fused = torch.arange(hk * (2 * dk + 2 * r * dv), dtype=torch.float32)[:, None].expand(-1, 3)
    v = weights.ungroup(args, "in_proj_qkvz.weight", fused, 2)
    group_rows = 2 * dk + 2 * r * dv
    assert v[dv * 3, 0] == 1 * group_rows + 2 * dk + 1 * dv  # value head 3: group 1, its second head
    parts = [weights.ungroup(args, "in_proj_qkvz.weight", fused, i) for i in range(4)]
    assert torch.equal(weights.group(args, parts), fused)


def test_the_multi_token_prediction_tensors_of_a_published_folder_are_skipped(folder, tmp_path):
    hf, path = folder
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, "mtp.fc.weight": torch.zeros(64, 128)}, tmp_path / "model.safetensors")
    tokens = torch.tensor([[5, 17, 42, 7]])
    with torch.no_grad():
        torch.testing.assert_close(imported_by_config(tmp_path)(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)


def test_the_published_flavor_writes_qwen3_next_80b_a3b_config():
    config = transformers.Qwen3NextConfig(**hf_config(FLAVORS["qwen3_next_80b_a3b"]))
    published = dict(
        hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, vocab_size=151936, max_position_embeddings=262144, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
    )  # fmt: skip
    assert {k: getattr(config, k) for k in published} == published
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + config.layer_types[4:]
    assert args_from_hf_config(config.to_dict()) == FLAVORS["qwen3_next_80b_a3b"]


def test_an_absent_key_takes_qwen3_next_configs_default():
    args = args_from_hf_config({"model_type": "qwen3_next"})
    assert args == dataclasses.replace(
        FLAVORS["qwen3_next_80b_a3b"], ffn_dim=5632, max_seq_len=32768, rope_theta=10000.0
    )


@pytest.mark.parametrize(
    "change, field",
    [
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, "layer_types"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_experts": 0}, "num_experts"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ],
)
def test_what_qwen3_next_cannot_mean_is_refused_naming_the_field(change, field):
    config = {**CONFIG, "model_type": "qwen3_next", **change}
    with pytest.raises(ConfigError, match=field) as refused:
        args_from_hf_config(config, "config.json:")
    assert "\n" not in str(refused.value)


def test_an_export_refuses_what_qwen3_next_cannot_say():
    moe = dataclasses.replace(FLAVORS["debug"].moe, score_func="sigmoid")
    with pytest.raises(ConfigError, match="a qwen3_next config.json cannot express MoEArgs.score_func='sigmoid'"):
        hf_config(dataclasses.replace(FLAVORS["debug"], vocab_size=320, moe=moe))

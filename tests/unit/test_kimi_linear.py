"""Kimi Linear against `transformers`' KimiLinearForCausalLM (fp32, CPU): random models (KDA and latent-attention
layers interleaved, query compression off and on, expert groups, a non-zero correction bias, a dense first layer)
import with transformers' logits to 1e-5 and greedy ids (the latent layers' KV cache and the KDA layers' recurrent
and convolution states); a trained model exports as KimiLinearForCausalLM with our logits and reads back equal; the
published checkpoint's config.json form reads as the flavor; what is not implemented is refused in one line; each
flavor counts transformers' parameters; tensor parallelism gives the one-process logits and gradients."""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

from tests.conformance import (  # noqa: E402
    debug_args,
    exports_as,
    greedy_ids_match,
    imported,
    imports_with_its_logits,
    random_hf,
    tokens,
    trained,
)
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.models.build import model_from_args  # noqa: E402
from titanlite.models.common.init import init_weights  # noqa: E402
from titanlite.models.common.kimi_delta import KimiDeltaAttention  # noqa: E402
from titanlite.models.common.moe.layer import MoE, update_balance_bias  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config, hf_config  # noqa: E402
from titanlite.models.kimi_linear.args import FLAVORS  # noqa: E402

VOCAB = 300
# KDA, latent attention, KDA, KDA; KDA 4 heads of 16, a convolution over 3 tokens; latent attention 4 heads of key
# 16 + 8, value 12, latent 32; 8 experts, 3 per token, one shared; the first layer dense.
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    num_local_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=1,
    linear_head_dim=16,
    linear_num_heads=4,
    linear_conv_kernel_dim=3,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    tie_word_embeddings=False,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
CASES = {
    "no_q_lora": {},
    "q_lora-groups": {"q_lora_rank": 24, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
}


def random_kimi(**changes):
    """transformers' KimiLinearForCausalLM, its weights moved off their init and its correction biases non-zero."""
    return random_hf(
        lambda: transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**{**SHAPE, **changes})),
        buffers=lambda name: name.endswith("e_score_correction_bias"),
    )


@pytest.mark.parametrize("case", CASES)
def test_a_folder_imports_with_transformers_logits(tmp_path, case):
    # 80 tokens: longer than KDA's chunk of 64, so the chunked rule carries its state from one chunk to the next.
    ours = imports_with_its_logits(random_kimi(**CASES[case]), tmp_path, tokens(VOCAB, (2, 80)), seq_len=96)
    assert sum(isinstance(m, KimiDeltaAttention) for m in ours.modules()) == 3


def test_greedy_generation_equals_transformers(tmp_path):
    """Decoding one token at a time: the latent layer's cached keys and values, each KDA layer's recurrent state
    and its convolution's last inputs."""
    hf = random_kimi()
    hf.save_pretrained(tmp_path)
    greedy_ids_match(hf, imported(tmp_path), [5, 17, 42, 7, 99], 12, VOCAB, distinct=6)


def test_a_trained_model_exports_as_kimi_linear_with_our_logits(tmp_path):
    """A few steps of training with bias balancing (the biases move), then an export that transformers loads."""
    args = debug_args(FLAVORS)

    def balance(model):
        for m in model.modules():
            if isinstance(m, MoE):
                update_balance_bias(m, m.step_tokens, 0.05)
                m.step_tokens.zero_()

    ours, batch = trained(args, after_step=balance)
    assert all(m.router.expert_bias.count_nonzero() for m in ours.modules() if isinstance(m, MoE))
    exports_as(ours, args, tmp_path, "KimiLinearForCausalLM", batch)


def config_json(**changes) -> dict:
    return {**transformers.KimiLinearConfig(**SHAPE).to_dict(), **changes}


def linear_attn_config(**changes) -> dict:
    return {"linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 3, **changes}}


REFUSED = {
    "layer_types='sliding_attention'": {
        "layer_types": ["linear_attention", "sliding_attention", "linear_attention", "linear_attention"]
    },
    "mlp_layer_types='shared'": {"mlp_layer_types": ["dense", "shared", "sparse", "sparse"]},
    "num_key_value_heads=2": {"num_key_value_heads": 2},
    "attention_bias=True": {"attention_bias": True},
    "hidden_act='gelu'": {"hidden_act": "gelu"},
    "mla_use_nope=False": {"mla_use_nope": False},
    "moe_router_activation_func='softmax'": {"moe_router_activation_func": "softmax"},
    "moe_layer_freq=2": {"moe_layer_freq": 2},
    "linear_conv_kernel_dim=0": {"linear_conv_kernel_dim": 0},
    "linear_attn_config.gate_lower_bound=-5.0": linear_attn_config(gate_lower_bound=-5.0),
    "linear_attn_config.use_full_rank_gate=True": linear_attn_config(use_full_rank_gate=True),
    "linear_attn_config.allow_neg_eigval=True": linear_attn_config(allow_neg_eigval=True),
    "linear_attn_config.num_v_heads=8": linear_attn_config(num_v_heads=8),
    "linear_attn_config.kda_layer_index_base=0": linear_attn_config(kda_layer_index_base=0),
    "num_experts_per_tok=9": {"num_experts_per_tok": 9},
}


@pytest.mark.parametrize("named", REFUSED)
def test_what_is_not_implemented_is_refused_in_one_line(named):
    with pytest.raises(ConfigError) as e:
        args_from_hf_config(config_json(**REFUSED[named]), "config.json:")
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_layer_lists_that_miss_a_layer_are_refused_in_one_line():
    config = config_json(layer_types=None, **linear_attn_config(kda_layers=[1, 3, 4], full_attn_layers=[]))
    with pytest.raises(ConfigError, match=r"layer 2 of 4 is in neither kda_layers nor full_attn_layers$"):
        args_from_hf_config(config, "config.json:")


# moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json as published (its own code's names), without auto_map.
PUBLISHED = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "bos_token_id": 163584,
    "eos_token_id": 163586, "pad_token_id": 163839, "first_k_dense_replace": 1, "head_dim": 72, "hidden_act": "silu",
    "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32, "short_conv_kernel_size": 4,
    },
    "mla_use_nope": True, "model_max_length": 1048576, "moe_intermediate_size": 1024, "moe_layer_freq": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 32,
    "num_expert_group": 1, "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27,
    "num_key_value_heads": 32, "num_nextn_predict_layers": 0, "num_shared_experts": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "torch_dtype": "bfloat16", "use_cache": True, "use_grouped_topk": True, "v_head_dim": 128,
    "vocab_size": 163840,
}  # fmt: skip


def test_the_published_config_json_reads_as_its_flavor():
    flavor = FLAVORS["kimi_linear_48b_a3b"]
    assert args_from_hf_config(PUBLISHED) == flavor
    assert args_from_hf_config(hf_config(flavor)) == flavor
    published = {k: v for k, v in PUBLISHED.items() if k != "rope_scaling"}  # null; transformers warns of the name
    assert list(transformers.KimiLinearConfig(**published).layer_types) == list(flavor.layer_types)


def count(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("flavor", FLAVORS)
def test_each_flavor_counts_transformers_parameters(flavor):
    args = dataclasses.replace(FLAVORS[flavor], vocab_size=FLAVORS[flavor].vocab_size or 320)
    with torch.device("meta"):
        ours = model_from_args(args)
        theirs = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**hf_config(args)))
    assert count(ours) == count(theirs), (count(ours), count(theirs))


def _tp_gradients(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from titanlite.models.build import build_model
    from titanlite.parallel.parallelize import materialize
    from titanlite.parallel.tensor_parallel import apply_tp

    batch = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(4))
    whole = build_model("kimi_linear", "debug", 320, 64)
    init_weights(whole, 0)
    with torch.device("meta"):
        split = build_model("kimi_linear", "debug", 320, 64)
    apply_tp(split, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), loss_parallel=False, chunked_loss=False)
    materialize(split, torch.device("cpu"), seed=0)
    weights = torch.randn(2, 40, 320, generator=torch.Generator().manual_seed(5))
    for model in (whole, split):
        logits = model(batch)
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        torch.testing.assert_close(logits, whole(batch), rtol=1e-5, atol=1e-5)
        (logits * weights).sum().backward()
    expected = dict(whole.named_parameters())
    for name, p in split.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        scale = expected[name].grad.abs().max()
        assert (grad - expected[name].grad).abs().max() <= 1e-5 * scale, name


def test_tensor_parallel_gives_the_one_process_logits_and_gradients():
    """TP x 2: both mixers split by heads (KDA's convolutions, decays and biases with them), the low-rank and latent
    projections whole on each rank, every gradient equal."""
    from tests.helpers import run_ranks

    run_ranks(_tp_gradients)

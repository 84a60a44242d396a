"""The MoE decoder's families against transformers: a random Qwen3-MoE folder (a dense layer by mlp_only_layers,
renormalised top-k), and OLMoE and Mixtral folders, import with transformers' logits to 1e-5 and its aux_loss; a
trained model of each exports as its transformers class with our logits; Qwen3-30B-A3B counts transformers'
parameters; the FLOPs count active parameters; an impossible expert-parallel degree and what a config.json cannot
say are refused in one line; activation checkpointing changes nothing; a short CPU run logs aux_load_balance."""

import dataclasses
import json
import re
import subprocess

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

from tests.conformance import (  # noqa: E402
    debug_args,
    exports_as,
    imported,
    imports_with_its_logits,
    random_hf,
    tokens,
    trained,
)
from tests.helpers import metrics, titanlite_here, train_in_pool  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.builder.plan import plan_run  # noqa: E402
from titanlite.config import parse_config  # noqa: E402
from titanlite.models.build import model_from_args  # noqa: E402
from titanlite.models.common.auxiliary import AuxiliaryLosses, collecting  # noqa: E402
from titanlite.models.common.flops import dense_flops_per_token, moe_flops_per_token  # noqa: E402
from titanlite.models.common.init import init_weights  # noqa: E402
from titanlite.models.common.moe.layer import MoE, load_balancing_loss  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config, hf_config  # noqa: E402
from titanlite.models.registry import spec_named  # noqa: E402

FLAVORS = spec_named("qwen3_moe").flavors
VOCAB = 300
COEF = 0.02


def hf_config_of(**changes):
    """GQA, head_dim 24 (not 96 / 6), 6 experts of width 40, top-3 renormalised, layer 1 dense."""
    shape = dict(
        hidden_size=96,
        intermediate_size=200,
        moe_intermediate_size=40,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        router_aux_loss_coef=COEF,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        rope_theta=1e6,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    return transformers.Qwen3MoeConfig(**(shape | changes))


# OLMoE and Mixtral: the same shape; the experts' width is their intermediate_size; no dense layer.
OTHERS = dict(
    hidden_size=96,
    intermediate_size=40,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    num_experts_per_tok=3,
    router_aux_loss_coef=COEF,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
CONFIGS = {
    "qwen3_moe": hf_config_of,
    "olmoe": lambda **changes: transformers.OlmoeConfig(**(OTHERS | {"num_experts": 6} | changes)),
    "mixtral": lambda **changes: transformers.MixtralConfig(
        **(OTHERS | {"num_local_experts": 6, "head_dim": 24, "sliding_window": None} | changes)
    ),
}


def random_model(family: str = "qwen3_moe", **changes):
    return random_hf(lambda: transformers.AutoModelForCausalLM.from_config(CONFIGS[family](**changes)))


def aux_terms(model, x) -> dict[str, float]:
    """The auxiliary terms our model adds in a training forward of x."""
    terms = AuxiliaryLosses(spec_named("qwen3_moe").auxiliary_losses(model.args))
    terms.watch(model)
    with collecting(terms):
        model(x).sum().backward()
    return dict(zip(terms.names, terms.take(torch.device("cpu"), passes=1).tolist()))


@pytest.mark.parametrize(
    "changes", [{}, {"norm_topk_prob": False, "mlp_only_layers": []}], ids=["norm-dense1", "plain"]
)
def test_a_folder_imports_with_transformers_logits_and_aux_loss(tmp_path, changes):
    hf = random_model(**changes)
    x = tokens(VOCAB)
    ours = imports_with_its_logits(hf, tmp_path, x)
    assert [type(ours.layers[str(i)].feed_forward).__name__ for i in range(4)] == (
        ["PooledMoE", "GatedMLP", "PooledMoE", "PooledMoE"] if changes == {} else ["PooledMoE"] * 4
    )
    with torch.no_grad():
        theirs = hf(x, output_router_logits=True)
    # transformers pools every layer's router logits into one load-balancing loss; so does our one term.
    logged = aux_terms(ours, x)
    assert logged["load_balance"] == pytest.approx(COEF * theirs.aux_loss.item(), rel=1e-5)


def test_the_pooled_term_is_not_the_mean_of_per_layer_terms(tmp_path):
    """What the test above pins: the mean of the blocks' own (per-layer) losses would log another number."""
    hf = random_model()
    hf.save_pretrained(tmp_path)
    ours = imported(tmp_path)
    x = tokens(VOCAB)
    routes = {}
    blocks = [m for m in ours.modules() if isinstance(m, MoE)]
    hooks = [m.router.register_forward_hook(lambda mod, i, out: routes.__setitem__(mod, out)) for m in blocks]
    with torch.no_grad():
        ours(x)
    for hook in hooks:
        hook.remove()
    per_layer = [
        load_balancing_loss(r.scores, r.indices, torch.bincount(r.indices.flatten(), minlength=6), ours.args.moe)
        for r in routes.values()
    ]
    assert len(per_layer) == 3
    assert abs(COEF * sum(per_layer).item() / 3 - aux_terms(ours, x)["load_balance"]) > 1e-6


@pytest.mark.parametrize("family", ["olmoe", "mixtral"])
def test_olmoe_and_mixtral_import_with_transformers_logits_and_aux_loss(tmp_path, family):
    hf = random_model(family)
    x = tokens(VOCAB)
    ours = imports_with_its_logits(hf, tmp_path, x)
    assert ours.args.family == family and ours.args.qk_norm == ("full" if family == "olmoe" else "none")
    with torch.no_grad():
        theirs = hf(x, output_router_logits=True)
    assert aux_terms(ours, x)["load_balance"] == pytest.approx(COEF * theirs.aux_loss.item(), rel=1e-5)


CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "mixtral": "MixtralForCausalLM"}


@pytest.mark.parametrize("family", CLASSES)
def test_a_trained_model_exports_as_its_class_with_our_logits(tmp_path, family):
    args = debug_args(spec_named(family).flavors)
    ours, batch = trained(args)  # a few steps, so norms leave their ones and the router its start
    exports_as(ours, args, tmp_path, CLASSES[family], batch)
    if family == "qwen3_moe":
        assert json.loads((tmp_path / "config.json").read_text())["mlp_only_layers"] == [1]


def test_qwen3_30b_a3b_counts_transformers_parameters():
    args = FLAVORS["qwen3_moe_30b_a3b"]
    with torch.device("meta"):
        ours = model_from_args(args)
        config = transformers.AutoConfig.for_model(**hf_config(args))
        theirs = transformers.AutoModelForCausalLM.from_config(config)
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(ours) == count(theirs)
    assert 30.0e9 < count(ours) < 31.0e9  # "30B"


def test_flops_count_the_active_experts_only():
    """6 * N_active, N_active counting 8 of Qwen3-30B-A3B's 128 experts: its published 3.3B active parameters."""
    args = FLAVORS["qwen3_moe_30b_a3b"]
    with torch.device("meta"):
        model = model_from_args(args)
    experts = sum(p.numel() for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters())
    dense = dense_flops_per_token(model, 4096)
    assert moe_flops_per_token(model, 4096) == dense - 6 * experts * (1 - 8 / 128)
    active = (moe_flops_per_token(model, 4096) - 12 * 48 * 32 * 128 * 4096) / 6
    # The model card's "3.3B activated" counts the embedding table too, which the FLOPs leave out (a lookup).
    assert 3.3e9 < active + args.vocab_size * args.dim < 3.4e9


def check(*args: str) -> subprocess.CompletedProcess:
    return titanlite_here("check", "--model.name", "qwen3_moe", *args)


EP_REFUSALS = [
    (4, ["--parallelism.expert_parallel_degree", "3"], "parallelism.expert_parallel_degree=3 borrows its ranks "
     "from data_parallel_shard_degree x context_parallel_degree = 4 x 1, which it does not divide; use a degree "
     "that divides 4 and is a multiple of 1"),
    (8, ["--parallelism.expert_parallel_degree", "2", "--parallelism.context_parallel_degree", "4"],
     "parallelism.expert_parallel_degree=2 must be a multiple of context_parallel_degree=4: expert parallelism "
     "borrows every context-parallel rank"),
    (16, ["--parallelism.expert_parallel_degree", "16"], "parallelism.expert_parallel_degree=16 does not divide "
     "the 8 experts of each qwen3_moe block; use a degree that divides 8"),
    (2, ["--model.name", "llama3", "--parallelism.expert_parallel_degree", "2"],
     "parallelism.expert_parallel_degree=2 splits mixture-of-experts blocks, but model llama3 has none; set it "
     "to 1"),
]  # fmt: skip


@pytest.mark.parametrize("world, args, message", EP_REFUSALS)
def test_an_impossible_expert_parallel_degree_is_refused_before_launch(world, args, message):
    cfg = parse_config(["--model.name", "qwen3_moe", *args])
    with pytest.raises(ConfigError) as e:
        plan_run(cfg, world)
    assert str(e.value) == message


def test_titanlite_check_refuses_an_impossible_expert_parallel_degree_in_one_line():
    world, args, message = EP_REFUSALS[2]
    proc = check("--world-size", str(world), *args)
    assert proc.returncode == 2 and proc.stderr == f"titanlite: error: {message}\n", proc.stderr


def test_a_folder_missing_one_experts_tensor_is_refused_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    random_model().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="has no 'model.layers.2.mlp.experts.5.up_proj.weight'"):
        imported(tmp_path)


REFUSED = {
    "olmoe clip_qkv=8.0": {"clip_qkv": 8.0},
    "num_experts=0": {"num_experts": 0},
    "shared_expert_intermediate_size=64": {"shared_expert_intermediate_size": 64},
    "decoder_sparse_step=0": {"decoder_sparse_step": 0},
    "num_experts_per_tok=7 exceeds num_local_experts=6": {"num_experts_per_tok": 7},
    "mlp_bias=True": {"mlp_bias": True},
}


@pytest.mark.parametrize("field", REFUSED)
def test_what_the_family_does_not_implement_is_refused_in_one_line(field):
    family, _, field = field.rpartition(" ") if field.startswith(("olmoe", "mixtral")) else ("", "", field)
    config = CONFIGS[family or "qwen3_moe"]().to_dict() | REFUSED[f"{family} {field}".strip()]
    with pytest.raises(ConfigError, match=field) as e:
        args_from_hf_config(config)
    assert "\n" not in str(e.value)


def test_the_config_json_reads_every_moe_field():
    args = args_from_hf_config(hf_config_of(decoder_sparse_step=2, mlp_only_layers=[3]).to_dict())
    assert args.moe.dense_layers == (0, 2, 3)
    assert (args.moe.n_experts, args.moe.top_k, args.moe.expert_dim) == (6, 3, 40)
    assert args.moe.norm_topk_prob and args.moe.aux_loss_coef == COEF
    assert args.ffn_dim == 200 and args.qk_norm == "head"


def test_a_block_config_json_cannot_express_is_not_exported():
    moe = dataclasses.replace(FLAVORS["debug"].moe, z_loss_coef=0.01)
    with pytest.raises(ConfigError, match="a qwen3_moe config.json cannot express MoEArgs.z_loss_coef=0.01"):
        hf_config(dataclasses.replace(FLAVORS["debug"], vocab_size=320, moe=moe))


def test_a_cpu_training_run_logs_the_load_balancing_term(tmp_path):
    args = ["--config", "train_configs/qwen3_moe_debug.toml", "--training.steps", "4", "--metrics.log_freq", "2"]
    proc = train_in_pool(1, [*args, "--training.seq_len", "64"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model qwen3_moe debug" in proc.stdout
    # The model line gives total and active parameters: each sparse layer leaves n_experts - top_k experts idle.
    args = FLAVORS["debug"]
    sparse = sum(args.moe.is_sparse(i) for i in range(args.n_layers))
    idle = sparse * (args.moe.n_experts - args.moe.top_k) * 3 * args.dim * args.moe.expert_dim
    total = int(re.search(r"model qwen3_moe debug: ([\d,]+) parameters", proc.stdout)[1].replace(",", ""))
    assert f"{total - idle:,} active per token" in proc.stdout, proc.stdout[:1500]
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [2, 4]
    assert all(0 < r["aux_load_balance"] < 0.01 for r in records)  # 0.001 times about top_k = 2
    assert " aux_load_balance " in proc.stdout


def test_activation_checkpointing_gives_the_same_term_and_gradients(monkeypatch):
    """Checkpointed blocks recompute their routing in backward: the pooled term and the gradients are the same
    (even on the very first forward, where the shared block probes torch._grouped_mm)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from titanlite.models.common.moe import layer as moe_module

    args = dataclasses.replace(FLAVORS["debug"], vocab_size=320, max_seq_len=64)
    x = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(5))
    runs = []
    for checkpointed in (False, True):
        monkeypatch.setattr(moe_module, "_GROUPED_MM_RUNS", {})
        model = model_from_args(args)
        init_weights(model, 0)
        if checkpointed:
            for i in list(model.layers):
                model.layers[i] = checkpoint_wrapper(model.layers[i], preserve_rng_state=False)
        terms = aux_terms(model, x)
        runs.append((terms, [p.grad for p in model.parameters()]))
    (terms, grads), (terms_ac, grads_ac) = runs
    assert terms["load_balance"] > 0 and terms_ac == pytest.approx(terms, rel=1e-6)
    for g, g_ac in zip(grads, grads_ac):
        torch.testing.assert_close(g_ac, g, rtol=1e-5, atol=1e-7)

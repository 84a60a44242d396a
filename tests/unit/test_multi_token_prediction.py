"""Multi-token prediction (model.mtp_layers, titanlite/models/common/multi_token.py) against a reference written out
here in plain torch around transformers' own DeepseekV3DecoderLayer (fp32, CPU): a random DeepSeek-V3 folder with one
MTP layer stored as DeepSeek's layer 61 is (model.layers.N: enorm, hnorm, eh_proj, the block, shared_head.norm, and
copies of the embedding and head; GLM-4.5 stores its own alike) imports with its MTP logits within 1e-5 and exports the
same tensors back; a copy
that differs from the shared embedding is refused, model.mtp_layers = 0 leaves the layer out (carried into the
export), and a family whose config.json cannot say MTP refuses model.mtp_layers > 0 in one line before launch. The
labels' columns ahead and the loss's weighting are checked against direct computations."""

import json
import logging

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)
from safetensors.torch import load_file, save_file  # noqa: E402

from tests.conformance import assert_logits_match, imported, imported_by_config  # noqa: E402
from tests.helpers import titanlite_here  # noqa: E402
from tests.unit.test_deepseek_v3 import SHAPE, VOCAB, random_deepseek  # noqa: E402
from tests.unit.test_glm4_moe import random_glm  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.builder.model import build_rank_model  # noqa: E402
from titanlite.builder.plan import plan_run  # noqa: E402
from titanlite.components.hf_weights import load_hf_into, save_hf  # noqa: E402
from titanlite.components.loss import MultiTokenLoss, cross_entropy  # noqa: E402
from titanlite.config import parse_config  # noqa: E402
from titanlite.models.common.auxiliary import AuxiliaryLosses, collecting  # noqa: E402
from titanlite.models.common.multi_token import IGNORE, future_labels  # noqa: E402
from titanlite.models.hf_config import folder_model_args  # noqa: E402

LAYER = SHAPE["num_hidden_layers"]  # the MTP layer's number: DeepSeek-V3's 61 of 61 decoder layers
RANDOM = {"deepseek_v3": random_deepseek, "glm4_moe": random_glm}  # both test files' shapes have 3 layers, vocab 300


def mtp_folder(folder, embed_copy=None, family="deepseek_v3"):
    """A random transformers DeepSeek-V3 (or GLM-4.5) saved to `folder`, with one random MTP layer written beside it
    as DeepSeek stores layer 61 (num_nextn_predict_layers 1). Returns (the transformers model, the MTP layer's
    tensors, transformers' module of its block)."""
    hf = RANDOM[family]()
    hf.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    # The block: layer LAYER of a random model one layer deeper, as transformers saves it (one tensor per expert).
    deeper = RANDOM[family](num_hidden_layers=LAYER + 1)
    deeper.save_pretrained(folder / "deeper")
    prefix = f"model.layers.{LAYER}."
    mtp = {k: v for k, v in load_file(folder / "deeper" / "model.safetensors").items() if k.startswith(prefix)}
    dim = SHAPE["hidden_size"]
    for name in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"{prefix}{name}.weight"] = 1 + torch.randn(dim) * 0.1
    mtp[prefix + "eh_proj.weight"] = torch.randn(dim, 2 * dim) * (2 * dim) ** -0.5
    weights = load_file(folder / "model.safetensors")
    mtp[prefix + "embed_tokens.weight"] = (
        weights["model.embed_tokens.weight"].clone() if embed_copy is None else embed_copy
    )
    mtp[prefix + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights | mtp, folder / "model.safetensors", metadata={"format": "pt"})
    return hf, mtp, deeper.model.layers[LAYER]


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_mtp_logits(hf, block, mtp: dict, inputs: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's depth 1 (its report's eq. 21-22) in plain torch: the main model's final hidden states (after its
    norm) and the embedding of the token one place ahead, each normed, concatenated (embedding first), projected, one
    decoder layer (transformers' own `block`, causal), the depth's norm and the shared head."""
    p, eps = f"model.layers.{LAYER}.", hf.config.rms_norm_eps
    with torch.no_grad():
        h = hf.model(inputs).last_hidden_state
        e = hf.model.embed_tokens(ahead)
        normed = [rms(e, mtp[p + "enorm.weight"], eps), rms(h, mtp[p + "hnorm.weight"], eps)]
        x = F.linear(torch.cat(normed, -1), mtp[p + "eh_proj.weight"])
        positions = torch.arange(inputs.shape[1])[None]
        x = block(x, position_ids=positions, position_embeddings=hf.model.rotary_emb(x, positions))
        return F.linear(rms(x, mtp[p + "shared_head.norm.weight"], eps), mtp[p + "shared_head.head.weight"])


def window() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 49), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", RANDOM)
def test_a_folder_with_an_mtp_layer_imports_with_the_reference_mtp_logits_and_exports_it_back(tmp_path, caplog, family):
    hf, mtp, block = mtp_folder(tmp_path / "hf", family=family)
    with caplog.at_level(logging.INFO, logger="titanlite"):
        ours = imported(tmp_path / "hf")
    assert ours.mtp_layers == 1
    assert "hold 2 copies of the embedding and head, equal to the model's" in caplog.text
    tokens = window()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        main, depth = ours(inputs, mtp_tokens=future_labels(labels, 1)[..., :1]).chunk(2)
        assert_logits_match(main, hf(inputs).logits)
        assert_logits_match(depth, reference_mtp_logits(hf, block, mtp, inputs, labels))
        assert_logits_match(ours(inputs), hf(inputs).logits)  # without the tokens ahead: the main model alone
    save_hf(tmp_path / "export", ours.args, ours.state_dict())
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(exported[name], value) for name, value in mtp.items()), [
        n for n, v in mtp.items() if not torch.equal(exported[n], v)
    ]
    assert json.loads((tmp_path / "export" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_a_folder_whose_mtp_embedding_differs_from_the_model_s_is_refused(tmp_path):
    mtp_folder(tmp_path, embed_copy=torch.randn(VOCAB, SHAPE["hidden_size"]))
    with pytest.raises(ConfigError) as e:
        imported(tmp_path)
    message = str(e.value)
    assert f"'model.layers.{LAYER}.embed_tokens.weight' differs from 'model.embed_tokens.weight'" in message
    assert "model.mtp_layers = 0" in message and "\n" not in message


def test_mtp_layers_0_leaves_a_folder_s_mtp_layer_out_and_carries_it(tmp_path, caplog):
    hf, mtp, _ = mtp_folder(tmp_path / "hf")
    with caplog.at_level(logging.INFO, logger="titanlite"):
        ours = imported(tmp_path / "hf", 64, "--model.mtp_layers", "0")
    assert ours.mtp is None and str(LAYER) not in ours.layers
    assert f"also holds {len(mtp)} tensors the model does not train" in caplog.text
    with torch.no_grad():
        assert_logits_match(ours(window()[:, :-1]), hf(window()[:, :-1]).logits)
    save_hf(tmp_path / "export", ours.args, ours.state_dict(), carry_from=tmp_path / "hf")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(exported[name], value) for name, value in mtp.items())


@pytest.mark.parametrize("holds", [True, False])
def test_a_folder_s_mtp_layers_are_named_once_on_the_start_up_line(tmp_path, caplog, holds):
    """What a folder's num_nextn_predict_layers gave the run is said on the start-up's multi-token prediction line
    alone, once, with its prefix: not where the folder is read (the launcher's check and each worker parse the config,
    the worker imports the weights, `convert` and `generate` read the folder again). A folder that declares a layer
    but holds none of its tensors (as transformers saves it) trains without, and the line says so."""
    mtp_folder(tmp_path / "hf")
    if not holds:
        weights = load_file(tmp_path / "hf" / "model.safetensors")
        kept = {k: v for k, v in weights.items() if not k.startswith(f"model.layers.{LAYER}.")}
        save_file(kept, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    argv = ["--model.flavor", "hf", "--model.hf_assets_path", str(tmp_path / "hf"), "--model.tokenizer", "byte"]
    argv += ["--training.seq_len", "32", "--training.local_batch_size", "1", "--job.dump_folder", str(tmp_path)]
    with caplog.at_level(logging.INFO, logger="titanlite"):
        parse_config(argv)  # the launcher's check
        cfg = parse_config(argv)  # the worker
        plan = plan_run(cfg, 1)
        setup = build_rank_model(cfg, plan, None, torch.device("cpu"))
        load_hf_into(setup.rank.parts, tmp_path / "hf")
        folder_model_args(tmp_path / "hf")  # convert, generate
    assert "num_nextn_predict_layers" not in caplog.text, caplog.text
    named = [line for line in setup.loss_line.split("\n") if "num_nextn_predict_layers" in line]
    config = tmp_path / "hf" / "config.json"
    if holds:
        assert len(named) == 1 and named[0].startswith(
            f"  multi-token prediction: 1 depth(s) after layer {LAYER - 1}, "
        ), named
        assert named[0].endswith(
            f"; {config}'s num_nextn_predict_layers=1, 1 layer(s) loaded from the folder (model.mtp_layers = 0 "
            "leaves them out of the run and carries them into its export)"
        )
    else:
        assert named == [
            f"  multi-token prediction: none: {config}'s num_nextn_predict_layers=1, but the folder holds no such "
            "layer's tensors (as transformers saves it)"
        ]


@pytest.mark.parametrize("mtp_layers", ["2", "-2"])
def test_a_folder_refuses_another_count_of_mtp_layers(tmp_path, mtp_layers):
    mtp_folder(tmp_path)
    with pytest.raises(ConfigError) as e:
        imported(tmp_path, 64, "--model.mtp_layers", mtp_layers)
    assert "model.mtp_layers" in str(e.value) and "\n" not in str(e.value)


def test_future_labels_are_the_tokens_ahead_with_no_target_past_the_window():
    labels = torch.tensor([[1, 2, 3, 4]])
    assert future_labels(labels, 2).tolist() == [[[1, 2, 3], [2, 3, 4], [3, 4, IGNORE], [4, IGNORE, IGNORE]]]


def test_the_loss_is_the_main_one_and_its_gradient_adds_the_weighted_depths():
    """Value: the main cross-entropy; gradient: of main + 0.3 / 2 x (depth 1 + depth 2), each a mean over its
    positions with a target; the depths logged as mtp_loss_1 and mtp_loss_2."""
    torch.manual_seed(0)
    logits = torch.randn(3 * 2, 8, 11, requires_grad=True)
    labels = future_labels(torch.randint(0, 11, (2, 8)), 2)
    terms = AuxiliaryLosses(("mtp_loss_1", "mtp_loss_2"))
    with collecting(terms):
        terms.begin_forward(0)
        loss = MultiTokenLoss(cross_entropy, 2, 0.3, seq_len=8)(logits, labels)
    parts = logits.chunk(3)
    depths = [F.cross_entropy(parts[k].flatten(0, 1), labels[..., k].flatten()) for k in (1, 2)]
    main = F.cross_entropy(parts[0].flatten(0, 1), labels[..., 0].flatten())
    assert loss.item() == main.item()
    assert torch.allclose(terms.take(torch.device("cpu"), 1), torch.stack(depths).detach())
    (grad,) = torch.autograd.grad(loss, logits)
    (expected,) = torch.autograd.grad(main + 0.15 * (depths[0] + depths[1]), logits)
    assert torch.allclose(grad, expected, atol=1e-7)


def test_mtp_layers_on_a_family_that_cannot_say_it_is_one_line_before_launch(tmp_path):
    proc = titanlite_here(
        "check", "--model.name", "llama3", "--model.mtp_layers", "1", "--job.dump_folder", str(tmp_path)
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("titanlite: error: model.mtp_layers=1: model llama3 has no multi-token prediction")
    assert "set model.mtp_layers = 0" in lines[-1]
    assert not any(tmp_path.iterdir())  # nothing written


def planned(mtp_layers: str, pp: str = "1"):
    """The planner's facts and the worst rank's estimate of DeepSeek-V3's debug model on `pp` pipeline stages."""
    from titanlite.builder.estimate import estimate, setting_for
    from titanlite.builder.layouts import layout_of
    from titanlite.builder.model_facts import model_facts
    from titanlite.builder.plan import plan_model
    from titanlite.config import parse_config

    cfg = parse_config(
        ["--config", "train_configs/deepseek_v3_debug.toml", "--model.mtp_layers", mtp_layers]
        + ["--parallelism.pipeline_parallel_degree", pp, "--parallelism.data_parallel_shard_degree", "1"]
    )
    model = plan_model(cfg)
    ngpu = int(pp)
    lay = layout_of(cfg, ngpu, model)
    facts = model_facts(cfg, model)
    return facts, estimate(facts, lay, setting_for(cfg, lay, ngpu, "cpu"))


def test_the_planner_counts_the_depths_flops_parameters_and_activations():
    """One depth adds its block, projection and norms to the parameters (on the last pipeline stage, with the
    embedding's copy), its block's attention and the head's second matmul to the FLOPs, its block's saved tensors
    and its logits to the activations."""
    from titanlite.builder.plan import plan_model
    from titanlite.config import parse_config
    from titanlite.models.build import model_from_args

    without, plain = planned("0")
    with_mtp, ahead = planned("1")
    cfg = parse_config(["--config", "train_configs/deepseek_v3_debug.toml", "--model.mtp_layers", "1"])
    with torch.device("meta"):
        model = model_from_args(plan_model(cfg).args)
    args = model.args
    extra = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("mtp.", f"layers.{args.n_layers}.")))
    assert with_mtp.layer_params == without.layer_params + [with_mtp.layer_params[-1]]
    # 6 x the depth's matmul parameters (its routed experts at top_k / n_experts), its attention, the head again
    routed = sum(
        p.numel() for n, p in model.named_parameters() if n.startswith(f"layers.{args.n_layers}.feed_forward.experts")
    )
    idle = routed * (1 - args.moe.top_k / args.moe.n_experts)
    attention = 12 * args.n_heads * args.head_dim * cfg.training.seq_len
    head = args.vocab_size * args.dim
    assert with_mtp.flops_per_token - without.flops_per_token == pytest.approx(6 * (extra - idle + head) + attention)
    assert ahead["activations"] > plain["activations"]
    assert ahead["parameters"] - plain["parameters"] == 4 * extra  # fp32
    _, stages_without = planned("0", pp="2")
    _, stages = planned("1", pp="2")
    assert stages["pp_rank"] == 1  # the last stage: the depth and the embedding's copy
    assert stages["parameters"] - stages_without["parameters"] == 4 * (extra + head)


def qwen_mtp_folder(folder, case: str):
    """A random transformers Qwen3.5 (dense, or MoE) saved to `folder` with a random multi-token prediction layer as
    Qwen stores it: mtp.layers.0 (a full-attention layer: layer 4 of a random model one layer deeper), mtp.fc,
    mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden and mtp.norm ((1 + w) norms), mtp_num_hidden_layers 1."""
    from tests.unit.test_qwen3_5 import TEXT, random_model

    hf = random_model(case)
    hf.save_pretrained(folder)
    n = TEXT["num_hidden_layers"]
    kinds = [*hf.config.layer_types, "full_attention"]
    torch.manual_seed(5)
    deeper = type(hf)(type(hf.config)(**{**hf.config.to_dict(), "num_hidden_layers": n + 1, "layer_types": kinds}))
    deeper.save_pretrained(folder / "deeper")
    prefix = f"model.layers.{n}."
    stored = load_file(folder / "deeper" / "model.safetensors")
    mtp = {"mtp.layers.0." + k[len(prefix) :]: v for k, v in stored.items() if k.startswith(prefix)}
    dim = TEXT["hidden_size"]
    mtp |= {
        f"mtp.{name}.weight": torch.randn(dim) * 0.1 for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
    }
    mtp["mtp.fc.weight"] = torch.randn(dim, 2 * dim) * (2 * dim) ** -0.5
    save_file(load_file(folder / "model.safetensors") | mtp, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1}))
    return hf, mtp, deeper.model.layers[n].eval()


@pytest.mark.parametrize("case", ["dense", "moe"])
def test_a_qwen3_5_folder_with_an_mtp_layer_imports_with_the_reference_mtp_logits_and_exports_it_back(tmp_path, case):
    """Qwen3.5's multi-token prediction (mtp.*): the same math with (1 + w) norms, its block a gated full-attention
    layer (a mixture of experts in Qwen3.5-MoE)."""
    hf, mtp, block = qwen_mtp_folder(tmp_path / "hf", case)
    ours = imported_by_config(tmp_path / "hf")  # its own vocabulary of 200 (no tokenizer)
    assert ours.mtp_layers == 1
    tokens = torch.randint(0, 200, (2, 33), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    eps = hf.config.rms_norm_eps
    with torch.no_grad():
        main, depth = ours(inputs, mtp_tokens=labels[..., None]).chunk(2)
        assert_logits_match(main, hf(inputs).logits)
        h, e = hf.model(inputs).last_hidden_state, hf.model.embed_tokens(labels)
        normed = [
            rms(e, 1 + mtp["mtp.pre_fc_norm_embedding.weight"], eps),
            rms(h, 1 + mtp["mtp.pre_fc_norm_hidden.weight"], eps),
        ]
        x = F.linear(torch.cat(normed, -1), mtp["mtp.fc.weight"])
        positions = torch.arange(inputs.shape[1])[None]
        x = block(x, position_embeddings=hf.model.rotary_emb(x, positions), position_ids=positions)
        assert_logits_match(depth, hf.lm_head(rms(x, 1 + mtp["mtp.norm.weight"], eps)))
    save_hf(tmp_path / "export", ours.args, ours.state_dict())
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(exported[name], value) for name, value in mtp.items())
    assert json.loads((tmp_path / "export" / "config.json").read_text())["mtp_num_hidden_layers"] == 1

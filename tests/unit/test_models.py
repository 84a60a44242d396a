"""Model definitions: sizes, weight tying, forward shapes, causality, init determinism, overfitting.
Runs on CPU; large flavors are only built on the meta device."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from titanlite.base.errors import ConfigError
from titanlite.models.build import build_model
from titanlite.models.common.decoder import Transformer as Llama
from titanlite.models.common.decoder_args import DecoderArgs
from titanlite.models.common.init import init_weights, param_seed
from titanlite.models.common.interface import Decoder
from titanlite.models.deepseek_v3.args import DeepseekV3Args
from titanlite.models.deepseek_v4.args import DeepseekV4Args
from titanlite.models.gpt2.args import GPT2Args
from titanlite.models.gpt2.model import GPT2
from titanlite.models.kimi_linear.args import KimiLinearArgs
from titanlite.models.registry import names, pad_vocab, spec_named, spec_of
from titanlite.parallel.parallelize import materialize

GPT2_VOCAB = 50257

FLAVORS = {name: spec_named(name).flavors for name in names()}  # every family's sizes, by model.name


def n_params(model: torch.nn.Module) -> int:
    # named_parameters() deduplicates shared tensors, so tied embeddings count once.
    return sum(p.numel() for p in model.parameters())


def meta_model(name: str, flavor: str, vocab_size: int = GPT2_VOCAB, seq_len: int = 1024):
    with torch.device("meta"):
        return build_model(name, flavor, vocab_size, seq_len)


@pytest.mark.parametrize("name", sorted(FLAVORS))
def test_every_family_implements_the_model_interface(name):
    """What parallelize(), the pipeline splitter, init, checkpoints and HF import use, on every family."""
    model = build_model(name, "debug", 256, 32)
    # Every member of the protocol, looked up as the trainer does (isinstance against a runtime-checkable protocol
    # cannot stand in: from Python 3.12 it looks attributes up statically, which misses nn.Module's submodules).
    members = [*Decoder.__annotations__, "forward", "init_param", "init_buffers", "tie_weights"]
    assert [m for m in members if not hasattr(model, m)] == []
    assert isinstance(model.layers, torch.nn.ModuleDict) and list(model.layers) == [
        str(i) for i in range(model.args.n_layers)
    ]
    for attr in (*model.first_stage_modules, *model.last_stage_modules):
        assert isinstance(getattr(model, attr), torch.nn.Module), attr
    # the head's part last (a family may keep more there: DeepSeek-V4's hyper-head, which folds its streams)
    assert model.first_stage_modules[0] == "tok_embeddings" and model.last_stage_modules[-2:] == ("norm", "output")
    full = {name: torch.empty(p.shape) for name, p in model.named_parameters()}
    for param_name, value in full.items():  # init_param knows every parameter by name
        model.init_param(param_name, value, torch.Generator().manual_seed(0))
    spec = spec_of(model.args)  # the family's spec names this module, its plan and its weight names
    assert spec.load(spec.model) is type(model) and callable(spec.load(spec.tp_plan))
    assert isinstance(model.args, spec.args_type) and issubclass(
        spec.args_type, (GPT2Args, DecoderArgs, DeepseekV3Args, KimiLinearArgs, DeepseekV4Args)
    )


def llama_expected_params(args) -> int:
    """Parameter count of a Llama from its shape alone."""
    hd = args.head_dim
    attn = args.dim * (args.n_heads * hd) * 2 + args.dim * (args.n_kv_heads * hd) * 2
    ffn = 3 * args.dim * args.ffn_dim
    layer = attn + ffn + 2 * args.dim
    emb = args.vocab_size * args.dim
    return args.n_layers * layer + args.dim + emb * (1 if args.tie_embeddings else 2)


def test_pad_vocab():
    assert pad_vocab(GPT2_VOCAB) == 50304
    assert pad_vocab(256) == 256
    assert pad_vocab(257) == 320


@pytest.mark.parametrize("flavor,millions", [("124M", 124), ("774M", 774)])
def test_gpt2_param_count(flavor, millions):
    model = meta_model("gpt2", flavor)
    assert model.args.vocab_size == 50304
    n = n_params(model)
    print(f"gpt2 {flavor}: {n:,}")
    assert abs(n - millions * 1e6) < 1e6


@pytest.mark.parametrize(
    "flavor,low,high",
    [
        ("1B", 1.0e9, 1.1e9),
        ("3B", 2.9e9, 2.95e9),
        ("8B", 8.0e9, 8.05e9),
        ("70B", 70.5e9, 70.6e9),
        ("405B", 405e9, 406e9),
    ],
)
def test_llama_param_count(flavor, low, high):
    # 1B and 3B take the tokenizer's vocabulary (here GPT-2's 50k); 8B, 70B and 405B embed Llama 3's 128,256 ids
    # whatever the tokenizer (tests/unit/test_plan_flavors.py compares them with transformers).
    model = meta_model("llama3", flavor)
    n = n_params(model)
    print(f"llama3 {flavor}: {n:,}")
    assert n == llama_expected_params(model.args)
    assert low < n < high


@pytest.mark.parametrize("name,flavor", [("gpt2", "124M"), ("gpt2", "1.5B"), ("llama3", "1B"), ("llama3", "3B")])
def test_tied_flavors_share_one_tensor(name, flavor):
    model = meta_model(name, flavor)
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in dict(model.named_parameters())


def tied_llama_debug_on_meta():
    args = dataclasses.replace(FLAVORS["llama3"]["debug"], vocab_size=256, tie_embeddings=True)
    with torch.device("meta"):
        return Llama(args)


@pytest.mark.parametrize("make", [lambda: meta_model("gpt2", "debug", 256, 64), tied_llama_debug_on_meta])
def test_tie_survives_materialize(make):
    model = make()
    assert model.output.weight is model.tok_embeddings.weight
    materialize(model, torch.device("cpu"), seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.device.type == "cpu"
    logits = model(torch.randint(0, 256, (1, 8)))
    assert torch.isfinite(logits).all()


def test_plain_to_empty_unties_and_tie_weights_reties():
    # nn.Module.to_empty (which a wrapper might call on our model's children) makes a new Parameter
    # per module; materialize() therefore calls tie_weights() right after it.
    model = meta_model("gpt2", "debug", 256, 64)
    torch.nn.Module.to_empty(model, device="cpu")
    assert model.output.weight is not model.tok_embeddings.weight
    model.tie_weights()
    assert model.output.weight is model.tok_embeddings.weight


def test_untied_llama_stays_untied():
    model = build_model("llama3", "debug", 256, 64)
    assert model.output.weight is not model.tok_embeddings.weight
    model.tie_weights()
    assert model.output.weight is not model.tok_embeddings.weight


@pytest.mark.parametrize("name", ["gpt2", "llama3"])
def test_forward_shape_and_causality(name):
    torch.manual_seed(0)
    model = build_model(name, "debug", 300, 64)
    init_weights(model, 0)
    vocab = model.args.vocab_size
    assert vocab == 320
    tokens = torch.randint(0, 300, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, vocab)
    assert torch.isfinite(logits).all()

    t = 9
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % 300
    logits2 = model(changed)
    torch.testing.assert_close(logits2[:, :t], logits[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(logits2[:, t:], logits[:, t:])


def test_llama_gqa_path():
    model = build_model("llama3", "debug", 256, 64)
    args = model.args
    assert args.n_kv_heads < args.n_heads
    attn = model.layers["0"].attention
    assert attn.wk.weight.shape == (args.n_kv_heads * args.head_dim, args.dim)
    assert attn.wq.weight.shape == (args.n_heads * args.head_dim, args.dim)
    init_weights(model, 1)
    out = model(torch.randint(0, 256, (3, 20)))
    assert out.shape == (3, 20, 256)


def test_forward_tolerates_missing_parts():
    # A middle pipeline stage drops embeddings, final norm and output, and passes hidden states.
    for name in ("gpt2", "llama3"):
        model = build_model(name, "debug", 256, 64)
        init_weights(model, 0)
        model.tok_embeddings = None
        model.norm = None
        model.output = None
        h = torch.randn(2, 8, model.args.dim)
        assert model(h).shape == (2, 8, model.args.dim)


def test_rope_buffers_non_persistent_float32():
    model = build_model("llama3", "debug", 256, 64)
    assert model.rope_cos.dtype == torch.float32
    assert model.rope_cos.shape == (model.args.max_seq_len, model.args.head_dim // 2)
    assert "rope_cos" not in model.state_dict()
    model.to(torch.bfloat16)
    model.init_buffers()
    assert model.rope_cos.dtype == torch.float32 and model.rope_sin.dtype == torch.float32


def test_max_seq_len():
    assert build_model("gpt2", "debug", 256, 64).args.max_seq_len == 1024
    assert meta_model("gpt2", "124M", 256, 2048).args.max_seq_len == 2048
    assert build_model("llama3", "debug", 256, 64).args.max_seq_len == 2048
    assert meta_model("llama3", "1B", 256, 16384).args.max_seq_len == 16384


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["gpt2", "llama3"])
def test_init_weights_deterministic(name):
    a = build_model(name, "debug", 256, 64)
    b = build_model(name, "debug", 256, 64)
    init_weights(a, 7)
    init_weights(b, 7)
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)

    init_weights(b, 8)
    assert not torch.equal(sa["tok_embeddings.weight"], b.state_dict()["tok_embeddings.weight"])
    assert not torch.equal(sa["layers.0.attention.wq.weight"], b.state_dict()["layers.0.attention.wq.weight"])


@pytest.mark.parametrize("name", ["gpt2", "llama3"])
def test_meta_to_empty_init_matches_direct(name):
    direct = build_model(name, "debug", 256, 64)
    init_weights(direct, 3)

    model = meta_model(name, "debug", 256, 64)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_buffers()
    # The trainer's path: one full float32 tensor per parameter, seeded by param_seed.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            g = torch.Generator(device=p.device).manual_seed(param_seed(3, pname))
            full = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            model.init_param(pname, full, g)
            p.copy_(full)

    sd, sm = direct.state_dict(), model.state_dict()
    for k in sd:
        torch.testing.assert_close(sm[k], sd[k], rtol=0, atol=0)
    tokens = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(model(tokens), direct(tokens), rtol=0, atol=0)


def test_init_schemes():
    gpt = build_model("gpt2", "124M", 256, 1024)
    init_weights(gpt, 0)
    L = gpt.args.n_layers
    blk = gpt.layers["0"]
    assert torch.all(blk.attention.wq.bias == 0) and torch.all(blk.attention_norm.weight == 1)
    assert torch.all(gpt.norm.bias == 0)
    assert abs(blk.attention.wq.weight.std().item() - 0.02) < 1e-3
    assert abs(blk.feed_forward.w2.weight.std().item() - 0.02 / math.sqrt(2 * L)) < 2e-4
    assert abs(gpt.pos_embeddings.weight.std().item() - 0.01) < 5e-4

    llama = build_model("llama3", "debug", 256, 64)
    init_weights(llama, 0)
    wq = llama.layers["1"].attention.wq.weight
    assert wq.abs().max().item() <= 0.04 + 1e-6
    out = llama.output.weight
    assert out.abs().max().item() <= 3 * llama.args.dim**-0.5 + 1e-6
    assert torch.all(llama.layers["0"].ffn_norm.weight == 1)


def test_init_param_prefix_and_unknown_name():
    model = build_model("gpt2", "debug", 256, 64)
    g = torch.Generator().manual_seed(0)
    full = torch.empty(64)
    model.init_param("_orig_mod.layers.3.ffn_norm.weight", full, g)
    assert torch.all(full == 1)
    with pytest.raises(KeyError):
        model.init_param("layers.0.attention.rotary.weight", full, g)
    with pytest.raises(KeyError):
        build_model("llama3", "debug", 256, 64).init_param("layers.0.attention.rotary.bias", full, g)


def test_param_seed_stable():
    assert param_seed(0, "tok_embeddings.weight") == param_seed(0, "tok_embeddings.weight")
    assert param_seed(0, "tok_embeddings.weight") != param_seed(1, "tok_embeddings.weight")
    assert param_seed(0, "layers.0.attention.wq.weight") != param_seed(0, "layers.1.attention.wq.weight")
    assert 0 <= param_seed(2**40, "x") < 2**63


def test_unknown_flavor_and_name():
    with pytest.raises(ConfigError, match="use one of: debug, 124M, 355M, 774M, 1.5B"):
        build_model("gpt2", "2B", 256, 64)
    with pytest.raises(ConfigError, match="use one of: debug, 1B, 3B, 8B, 70B, 405B"):
        build_model("llama3", "1T", 256, 64)
    with pytest.raises(ConfigError, match="gpt2, llama3, smollm3, qwen2, qwen3, olmo2, mistral"):
        build_model("gpt3", "debug", 256, 64)
    assert set(FLAVORS) == {
        "gpt2",
        "llama3",
        "smollm3",
        "qwen2",
        "qwen3",
        "olmo2",
        "mistral",
        "qwen3_moe",
        "olmoe",
        "mixtral",
        "gemma3",
        "gemma4",
        "gemma4_moe",
        "gpt_oss",
        "deepseek_v3",
        "deepseek_v32",
        "glm_moe_dsa",
        "deepseek_v4",
        "qwen3_5",
        "qwen3_5_moe",
        "kimi_linear",
        "qwen3_next",
        "olmo_hybrid",
        "olmo3",
        "glm4_moe",
        "minimax_m2",
        "nemotron_h",
        "falcon_h1",
        "granitemoehybrid",
    }


# llama3's case is slow (about 25 s; CI runs it); gpt2's stays in the default suite.
@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama3", marks=pytest.mark.slow)])
def test_overfit_one_batch(name):
    torch.manual_seed(0)
    model = build_model(name, "debug", 256, 64)
    init_weights(model, 0)
    assert isinstance(model, GPT2 if name == "gpt2" else Llama)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 2, losses


def test_each_family_declares_which_fields_change_its_math():
    # The import check (components/hf_weights.py) compares the fields a family's arguments call math: all but those
    # marked not_math (models/spec.py), read from the dataclass, with no central list to forget a family's field in.
    from titanlite.components.hf_weights import _check_compatible
    from titanlite.models.gemma3.args import FLAVORS as GEMMA3
    from titanlite.models.gemma3.args import Gemma3Args
    from titanlite.models.spec import math_fields

    for name in names():
        args = next(iter(spec_named(name).flavors.values()))
        fields = set(math_fields(args))
        assert not fields & {"family", "vocab_size", "max_seq_len"}, name
        assert {"dim", "n_layers"} <= fields, name
    assert "query_pre_attn_scalar" in math_fields(GEMMA3["debug"])  # a family's own field, declared nowhere else

    @dataclasses.dataclass
    class Planted(Gemma3Args):  # a field a family adds later, saying nothing about it
        new_switch: float = 1.0

    base = dataclasses.replace(GEMMA3["debug"], vocab_size=256)
    ours, folder = (Planted(**{**dataclasses.asdict(base), "new_switch": v}) for v in (1.0, 2.0))
    with pytest.raises(ConfigError, match="new_switch"):
        _check_compatible(folder, ours, "/folder")
    _check_compatible(dataclasses.replace(folder, new_switch=1.0), ours, "/folder")  # equal: accepted


def test_a_layer_kind_a_family_does_not_know_is_refused_naming_the_kinds_it_knows():
    with pytest.raises(ValueError, match="'linear_attention'; its layer kinds are full_attention, sliding_attention"):
        DecoderArgs(
            dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=64, family="llama3",
            layer_types=("linear_attention", "full_attention"),
        )  # fmt: skip
    # A family's module lists its own kinds (Transformer.mixers); one it does not list is refused when built.
    from titanlite.models.common.decoder import grouped_query_attention

    class FullOnly(Llama):
        mixers = {"full_attention": grouped_query_attention}

    args = DecoderArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=64, vocab_size=64, family="llama3")
    args.layer_types = ("full_attention", "sliding_attention")  # past DecoderArgs' own check
    with pytest.raises(ValueError, match="layer 1 is of kind 'sliding_attention'; FullOnly knows full_attention"):
        FullOnly(args)

"""DeepSeek-V4 against `transformers` itself: a random DeepseekV4ForCausalLM folder (three residual streams with
hyper-connections; a sliding layer, two compressed sparse attention layers whose indexer picks 2 of up to 10 blocks of
2 tokens, a heavily compressed one of blocks of 4, each with a window of 4 tokens, shorter than the prompt and than
the continuation; attention sinks; the first layer's experts routed by its token table, the others by sqrt-softplus
scores with routing biases; clamped SwiGLUs) imports with transformers' logits to 1e-5 (fp32), greedy generation (the
window, the compressors' inputs and their blocks in the cache) equals transformers', an export loads back in
transformers with our logits. Packed documents compress and attend as if each were alone; a cached forward in pieces
equals the whole; training reaches every parameter, the indexers through their KL loss; the FLOPs count the window,
the blocks and the indexer."""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

import safetensors.torch  # noqa: E402

from tests.conformance import exports_as, greedy_ids_match, imported_by_config, random_hf, tokens  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.commands.generate import decode_with_graphs  # noqa: E402
from titanlite.components.hf_weights import load_hf_into, save_hf  # noqa: E402
from titanlite.components.metrics import flops_per_token  # noqa: E402
from titanlite.models.build import model_from_args  # noqa: E402
from titanlite.models.common import compressed_attention as compressed_attention_module  # noqa: E402
from titanlite.models.common import indexer as indexer_core  # noqa: E402
from titanlite.models.common.attention import Sequence  # noqa: E402
from titanlite.models.common.auxiliary import AuxiliaryLosses, collecting  # noqa: E402
from titanlite.models.common.compressed_attention import query_chunks  # noqa: E402
from titanlite.models.common.kv_cache import KVCache  # noqa: E402
from titanlite.models.deepseek_v4.args import CSA, FLAVORS, HCA, SLIDING  # noqa: E402
from titanlite.models.hf_config import folder_args  # noqa: E402

VOCAB = 96
LAYERS = [SLIDING, CSA, HCA, CSA]
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=16,
    q_lora_rank=24,
    partial_rotary_factor=0.5,  # 8 of 16 channels rotate
    num_experts_per_tok=2,
    n_routed_experts=4,
    n_shared_experts=1,
    layer_types=LAYERS,
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={CSA: 2, HCA: 4},
    sliding_window=4,
    o_groups=2,
    o_lora_rank=8,
    # 8 indexer heads: a block's score is a sum of relu terms, exactly zero (a tie) only where every head's is
    index_n_heads=8,
    index_head_dim=16,
    index_topk=2,
    hc_mult=3,
    hc_sinkhorn_iters=5,
    swiglu_limit=0.5,  # the clamp bites at this scale
    max_position_embeddings=256,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
TOKENS = tokens(VOCAB, (2, 29), seed=4)


def random_model():
    """A random transformers DeepSeek-V4, its routing biases and token tables random too (distinct experts a row)."""

    def build():
        config = transformers.DeepseekV4Config(**CONFIG)
        config._experts_implementation = "eager"  # transformers' reference loop over the experts
        return transformers.DeepseekV4ForCausalLM(config)

    hf = random_hf(build, scale=0.3, buffers=lambda name: name.endswith("e_score_correction_bias"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, table in hf.named_buffers():
            if name.endswith("tid2eid"):
                table.copy_(torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(VOCAB)]))
    return hf


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    hf = random_model()
    path = tmp_path_factory.mktemp("deepseek_v4")
    hf.save_pretrained(path)
    return hf, path


def test_logits_equal_transformers_and_an_export_loads_back_with_ours(folder, tmp_path):
    hf, path = folder
    ours = imported_by_config(path)
    with torch.no_grad():
        logits = ours(TOKENS)
        torch.testing.assert_close(logits, hf(TOKENS, use_cache=False).logits, rtol=1e-5, atol=1e-5)
    back = exports_as(ours, folder_args(path, 64), tmp_path / "export", "DeepseekV4ForCausalLM", TOKENS)
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS, use_cache=False).logits, logits, rtol=1e-5, atol=1e-5)


def test_greedy_generation_equals_transformers(folder):
    """A prompt of 9 tokens (past the window of 4 and four CSA blocks) and 14 new ones, each decoded from the cached
    window, the compressors' inputs and the blocks they completed."""
    hf, path = folder
    prompt = tokens(VOCAB, (1, 9), seed=5)[0].tolist()
    greedy_ids_match(hf, imported_by_config(path), prompt, 14, VOCAB, distinct=3)


def test_a_cached_forward_in_pieces_and_packed_documents_compute_as_the_whole(folder):
    """Prefill then pieces of 1, 7 and the rest through the cache give the whole forward's logits; a packed row's
    documents (one of one token, others crossing the blocks and the window) give the logits of each alone."""
    _, path = folder
    ours = imported_by_config(path)
    with torch.no_grad():
        whole = ours(TOKENS)
        cache = KVCache(64)
        pieces = [ours(TOKENS[:, a:b], cache=cache) for a, b in ((0, 5), (5, 6), (6, 13), (13, 29))]
        torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-5, atol=1e-5)
        cuts = [0, 7, 8, 19, 29]
        documents = torch.zeros(2, 29, dtype=torch.long)
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            documents[:, a:b] = i
        packed = ours(TOKENS, sequence=Sequence(documents=documents))
        for a, b in zip(cuts, cuts[1:]):
            torch.testing.assert_close(packed[:, a:b], ours(TOKENS[:, a:b]), rtol=1e-5, atol=1e-5)
        assert (packed[:, 8:19] - whole[:, 8:19]).abs().max() > 1e-3  # the documents' bounds are real


def test_training_reaches_every_parameter_the_indexers_through_their_loss(folder):
    _, path = folder
    ours = imported_by_config(path).train()
    terms = AuxiliaryLosses(("indexer_loss",))
    terms.watch(ours)
    with collecting(terms):
        out = ours(TOKENS)
        torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), TOKENS[:, 1:].flatten()).backward()
    assert float(terms.take(torch.device("cpu"), 1)[0]) > 0  # the two CSA layers' KL terms, joined to the loss
    untouched = [n for n, p in ours.named_parameters() if p.grad is None or not p.grad.abs().sum()]
    assert not untouched, untouched


def test_flops_count_the_window_the_blocks_and_the_indexer():
    """Per token beyond the parameters: a sliding layer's window grows no more past it, an HCA layer's blocks grow
    by T / rate, a CSA layer's picked blocks stop at topk while its indexer scores every block."""
    args = dataclasses.replace(FLAVORS["debug"], vocab_size=256)
    with torch.device("meta"):
        model = model_from_args(args)
    a = model.args
    growth = flops_per_token(model, 4096) - flops_per_token(model, 2048)
    heads = 12.0 * a.n_heads * a.head_dim
    indexer = 2.0 * a.index_n_heads * (a.index_head_dim + 1)
    csa = sum(kind == CSA for kind in a.layer_types)
    expected = heads * 2048 / a.hca_rate + csa * indexer * 2048 / a.csa_rate
    assert growth == pytest.approx(expected)


def test_a_folder_whose_token_table_names_an_expert_past_the_count_is_refused_in_one_line(tmp_path):
    """tid2eid is read before launch (an integer table, checked beside the weights' headers): an expert index past
    n_experts is refused naming the tensor and the count, not left to index out of range mid-step."""
    bad = random_model()
    with torch.no_grad():
        bad.model.layers[0].mlp.gate.tid2eid[5, 1] = 4  # experts 0..3
    bad.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.ffn\.gate\.tid2eid.*expert index 4.*n_experts=4"):
        imported_by_config(tmp_path)


def test_a_folder_in_the_published_checkpoints_names_imports_the_same(folder, tmp_path):
    """DeepSeek's published folders name the top level without transformers' "model." prefix (embed.weight,
    layers.N..., hc_head_fn, norm.weight) and may store a token table as floats: the same model, the same logits."""
    hf, path = folder
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tensors = {}
    for name, tensor in safetensors.torch.load_file(path / "model.safetensors").items():
        name = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}.get(name, name)
        name = name.replace("model.hc_head.hc_", "hc_head_").removeprefix("model.")
        tensors[name] = tensor.float() if name.endswith("tid2eid") else tensor
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors")
    assert "embed.weight" in tensors and "layers.0.ffn.gate.tid2eid" in tensors
    with torch.no_grad():
        torch.testing.assert_close(imported_by_config(tmp_path)(TOKENS), imported_by_config(path)(TOKENS))


def test_its_decode_step_is_never_captured_as_a_cuda_graph():
    """The compressed blocks grow as a state counted on the host, which no static cache holds: on CUDA generation
    decodes eagerly and says why, and --cuda-graph is refused in one line (checked here without a GPU: the choice is
    made before anything runs on one)."""
    with torch.device("meta"):
        model = model_from_args(dataclasses.replace(FLAVORS["debug"], vocab_size=256))
    cuda = torch.device("cuda")
    graphs, line = decode_with_graphs(model, cuda, {"no-cuda-graph": False, "cuda-graph": False})
    assert not graphs and "decoding eagerly: its compressed attention keeps a growing list" in line
    with pytest.raises(ConfigError, match="generate --cuda-graph cannot capture this model's decode step"):
        decode_with_graphs(model, cuda, {"no-cuda-graph": False, "cuda-graph": True})


def test_its_multi_token_prediction_layer_computes_as_deepseeks_and_exports_in_the_published_names(folder, tmp_path):
    """A folder with the published MTP layer (mtp.0.*: a sliding layer's block, enorm, hnorm, e_proj, h_proj, its own
    hyper-head and norm). The reference is transformers' own decoder layer for the block (a random 5-layer
    DeepseekV4ForCausalLM whose layer 4 is saved as mtp.0), fed as DeepSeek's MTPBlock feeds it: the streams after
    the last layer, each through hnorm and h_proj, plus e_proj(enorm(embedding of the token ahead)); its output
    folded by the depth's hyper-head, normed, through the shared head. Our depth-1 logits equal that to 1e-5; an
    export writes mtp.0.* back (transformers leaves it alone) and reads back with the same logits; with
    model.mtp_layers = 0 the export carries it unchanged; training reaches every parameter of the depth."""
    hf4, path = folder
    config5 = transformers.DeepseekV4Config(
        **{**CONFIG, "num_hidden_layers": 5, "layer_types": [*LAYERS, SLIDING],
           "mlp_layer_types": ["hash_moe", "moe", "moe", "moe", "moe"]}
    )  # fmt: skip
    config5._experts_implementation = "eager"
    hf5 = random_hf(lambda: transformers.DeepseekV4ForCausalLM(config5), scale=0.3, buffers=lambda n: "bias" in n)
    hf5.load_state_dict(hf4.state_dict(), strict=False)  # layers 0-3, the embedding, hyper-head and head are hf4's
    hf5.save_pretrained(tmp_path / "five")
    tensors = safetensors.torch.load_file(path / "model.safetensors")
    five = safetensors.torch.load_file(tmp_path / "five" / "model.safetensors")
    mtp = {k.replace("model.layers.4.", "mtp.0."): t for k, t in five.items() if k.startswith("model.layers.4.")}
    generator = torch.Generator().manual_seed(7)
    dim = CONFIG["hidden_size"]
    own = {"enorm.weight": (dim,), "hnorm.weight": (dim,), "norm.weight": (dim,), "e_proj.weight": (dim, dim),
           "h_proj.weight": (dim, dim), "hc_head_fn": (3, 3 * dim), "hc_head_base": (3,),
           "hc_head_scale": (1,)}  # fmt: skip
    for name, shape in own.items():
        start = 1.0 if name.endswith("norm.weight") else 0.0
        mtp[f"mtp.0.{name}"] = start + 0.3 * torch.randn(shape, generator=generator)
    folder_with = tmp_path / "with_mtp"
    folder_with.mkdir()
    config = {**json.loads((path / "config.json").read_text()), "num_nextn_predict_layers": 1}
    (folder_with / "config.json").write_text(json.dumps(config))
    safetensors.torch.save_file({**tensors, **mtp}, folder_with / "model.safetensors")

    ours = imported_by_config(folder_with)
    assert ours.mtp_layers == 1 and ours.layer_kind(4) == SLIDING
    ahead = torch.cat([TOKENS[:, 1:], torch.full((2, 1), -100)], dim=1)
    with torch.no_grad():
        depth1 = ours(TOKENS, mtp_tokens=ahead[..., None])[2:]
        captured = {}
        hook = hf5.model.layers[4].register_forward_pre_hook(
            lambda m, args, kwargs: captured.update(streams=args[0], kwargs=kwargs), with_kwargs=True
        )
        hf5(TOKENS, use_cache=False)
        hook.remove()
        norm = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RMSNorm
        enorm, hnorm, last = (norm(dim, eps=config5.rms_norm_eps) for _ in range(3))
        for module, name in ((enorm, "enorm"), (hnorm, "hnorm"), (last, "norm")):
            module.weight.copy_(mtp[f"mtp.0.{name}.weight"])
        head = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4HyperHead(config5)
        for p in ("fn", "base", "scale"):
            getattr(head, f"hc_{p}").copy_(mtp[f"mtp.0.hc_head_{p}"])
        e = enorm(hf5.model.embed_tokens(ahead.clamp(min=0))) @ mtp["mtp.0.e_proj.weight"].T
        x = e.unsqueeze(2) + hnorm(captured["streams"]) @ mtp["mtp.0.h_proj.weight"].T
        y = hf5.model.layers[4](x, **captured["kwargs"])
        expected = hf5.lm_head(last(head(y)))
        torch.testing.assert_close(depth1, expected, rtol=1e-5, atol=1e-5)

    save_hf(tmp_path / "export", folder_args(folder_with, 64), ours.state_dict())
    written = safetensors.torch.load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(written[k], t) for k, t in mtp.items())
    with torch.no_grad():
        torch.testing.assert_close(imported_by_config(tmp_path / "export")(TOKENS, mtp_tokens=ahead[..., None])[2:],
                                   depth1)  # fmt: skip

    # model.mtp_layers = 0: the run leaves the layer out, and its export carries mtp.0.* unchanged, saying it has one
    without = dataclasses.replace(folder_args(folder_with, 64), mtp_layers=0)
    main_only = model_from_args(without)
    load_hf_into([main_only], folder_with)
    save_hf(tmp_path / "carried", without, main_only.state_dict(), carry_from=folder_with)
    carried = safetensors.torch.load_file(tmp_path / "carried" / "model.safetensors")
    assert all(torch.equal(carried[k], t) for k, t in mtp.items())
    assert json.loads((tmp_path / "carried" / "config.json").read_text())["num_nextn_predict_layers"] == 1

    ours.train()
    out = ours(TOKENS, mtp_tokens=ahead[..., None])
    torch.nn.functional.cross_entropy(out[2:, :-1].flatten(0, 1), ahead[:, :-1].flatten()).backward()
    depth = [n for n, p in ours.named_parameters() if n.startswith(("mtp.", "layers.4."))]
    untouched = [n for n in depth if ours.get_parameter(n).grad is None or not ours.get_parameter(n).grad.abs().sum()]
    assert len(depth) > 20 and not untouched, untouched


def test_chunks_of_one_query_give_the_whole_sequences_logits_and_gradients(folder, monkeypatch):
    """The attention's chunks (ChunkedAttention: each chunk's output written in place, its gradients recomputed a
    chunk at a time and added to the queries', keys', blocks' and sinks') against autograd's own backward of one
    chunk for the whole sequence: the same logits and every parameter's gradient, the window's, the blocks' and the
    picked blocks' paths alike."""
    _, path = folder

    class Autograd:  # the chunks' forward, differentiated by autograd itself
        @staticmethod
        def apply(plan, *tensors):
            return plan.forward(*tensors)

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ours = imported_by_config(path).train()
        out = ours(TOKENS)
        torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), TOKENS[:, 1:].flatten()).backward()
        return out.detach(), {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}

    with monkeypatch.context() as patch:
        patch.setattr(compressed_attention_module, "ChunkedAttention", Autograd)
        whole = run()
    monkeypatch.setattr(indexer_core, "CHUNK_ELEMENTS", 64)  # a chunk of one query (twice chunk_elements' scores)
    assert len(query_chunks(29, 8, 8, torch.device("cpu"))) == 29
    chunked = run()
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-5, atol=1e-5)
    assert chunked[1].keys() == whole[1].keys() and len(whole[1]) > 50
    for name, grad in whole[1].items():
        torch.testing.assert_close(chunked[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("k", [1, 2, 5, 64])
def test_the_indexers_pick_is_a_stable_sorts_first_k_ties_earliest_first(k):
    """The compressed attention's indexer picks its blocks with top_earliest: the k highest scores, equal ones
    earliest first, as a stable descending sort's first k, on scores full of ties (the relu's zeros, repeated
    values) and of -inf (blocks a query may not see: all of a row's, or all but fewer than k)."""
    generator = torch.Generator().manual_seed(k)
    scores = torch.randint(0, 4, (3, 5, 64), generator=generator).float()  # a few values, each many times
    scores[0] = torch.randn(5, 64, generator=generator).relu()  # about half exactly zero
    scores[1, :, ::2] = float("-inf")
    scores[2, 0] = float("-inf")  # a query that sees nothing
    scores[2, 1, 3:] = float("-inf")  # one that sees 3 blocks
    values, indices = indexer_core.top_earliest(scores, k)
    expected_values, expected_indices = scores.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(indices, expected_indices[..., :k])
    assert torch.equal(values, expected_values[..., :k])

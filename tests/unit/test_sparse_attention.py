"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) against `transformers` (fp32, CPU): random DeepseekV32ForCausalLM
and GlmMoeDsaForCausalLM folders whose indexers keep 8 keys of a 48-token prompt import with the logits to 1e-5
(and the selection matters: kept dense, the logits differ), greedy generation over the cache equals transformers', a
trained model exports as its class with our logits, an FP8 folder (the indexer's projections quantized too) gives its
dequantized copy's logits; what cannot be built is refused in one line. The sparse pieces alone: the gathered
attention equals dense attention under the same mask, gradients too, whatever the chunk; the selection does not depend
on the order the keys come in (context parallelism's); the indexer learns from its KL loss and stands still at a weight
of 0."""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is an optional test dependency")

from safetensors.torch import load_file, save_file  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from tests.conformance import (  # noqa: E402
    assert_logits_match,
    debug_args,
    exports_as,
    greedy_ids_match,
    imported,
    random_hf,
    tokens,
    trained,
)
from tests.unit.test_deepseek_v3 import SHAPE, VOCAB  # noqa: E402
from tests.unit.test_quantized_folders import fp8_folders, imported_logits  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.components.hf_weights import load_hf_into  # noqa: E402
from titanlite.components.metrics import flops_per_token  # noqa: E402
from titanlite.models.build import model_from_args  # noqa: E402
from titanlite.models.common import indexer as indexer_core  # noqa: E402
from titanlite.models.common.attention import Sequence, attention_mask  # noqa: E402
from titanlite.models.common.auxiliary import AuxiliaryLosses, collecting  # noqa: E402
from titanlite.models.common.flops import SequenceMixer  # noqa: E402
from titanlite.models.common.latent import sparse  # noqa: E402
from titanlite.models.common.latent.sparse import SparseLatentAttention  # noqa: E402
from titanlite.models.deepseek_v3.sparse_args import GLM_FLAVORS as GLM  # noqa: E402
from titanlite.models.deepseek_v3.sparse_args import V32_FLAVORS as V32  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config, folder_args  # noqa: E402

INDEXER = dict(index_n_heads=4, index_head_dim=16, index_topk=8)
FAMILIES = {
    "deepseek_v32": (transformers.DeepseekV32ForCausalLM, transformers.DeepseekV32Config, V32),
    "glm_moe_dsa": (transformers.GlmMoeDsaForCausalLM, transformers.GlmMoeDsaConfig, GLM),
}


def random_sparse(family: str, **changes):
    """transformers' model of `family`, DeepSeek-V3's test shape with an indexer of 4 heads keeping 8 keys, its
    weights moved off their init and its correction biases non-zero."""
    model, config, _ = FAMILIES[family]
    return random_hf(
        lambda: model(config(**{**SHAPE, **INDEXER, **changes})),
        buffers=lambda name: name.endswith("e_score_correction_bias"),
    )


def indexers(model) -> list[SparseLatentAttention]:
    return [m for m in model.modules() if isinstance(m, SparseLatentAttention)]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_folder_imports_with_transformers_logits_and_the_selection_matters(tmp_path, family):
    hf = random_sparse(family)
    hf.save_pretrained(tmp_path)
    ours = imported(tmp_path)
    assert len(indexers(ours)) == SHAPE["num_hidden_layers"]
    with torch.no_grad():
        expected = hf(tokens(VOCAB)).logits
        assert_logits_match(ours(tokens(VOCAB)), expected)
        for layer in indexers(ours):
            layer.indexer.topk = 48  # every key: dense attention
        assert (ours(tokens(VOCAB)) - expected).abs().max() > 1e-3 * expected.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_over_the_cache_equals_transformers(tmp_path, family):
    """5 prompt tokens and 12 more: from the 9th on, each step attends to 8 of the cached keys."""
    hf = random_sparse(family)
    hf.save_pretrained(tmp_path)
    greedy_ids_match(hf, imported(tmp_path), [5, 17, 42, 7, 99], 12, VOCAB)


CLASSES = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_trained_model_exports_as_its_class_with_our_logits(tmp_path, family):
    """Three steps on 32-token sequences (the debug indexer keeps 16 keys), then an export transformers loads."""
    args = debug_args(FAMILIES[family][2])
    ours, batch = trained(args)
    exports_as(ours, args, tmp_path, CLASSES[family], batch)


def test_an_fp8_folder_imports_with_the_logits_of_its_dequantized_weights(tmp_path):
    """As DeepSeek-V3.2 is published: the projections in e4m3 blocks, the indexer's wq_b and wk among them."""
    quantized = ("_proj.weight", "a_proj_with_mqa.weight", "indexer.wq_b.weight", "indexer.wk.weight")
    folder, stored, reference = fp8_folders(random_sparse("deepseek_v32"), tmp_path, lambda n: n.endswith(quantized))
    assert "model.layers.1.self_attn.indexer.wk.weight_scale_inv" in stored
    with torch.no_grad():
        assert_logits_match(imported_logits(folder, tokens(VOCAB)), reference(tokens(VOCAB)).logits)


REFUSED = {
    "index_topk=0": {"index_topk": 0},
    "index_head_dim=4 cannot hold the qk_rope_head_dim=8": {"index_head_dim": 4},
    "q_lora_rank=None": {"q_lora_rank": None},
    "rope_interleave=False": {"rope_interleave": False},
    "layer_types=['full_attention']": {"layer_types": ["full_attention"] * 3},
    "mlp_layer_types=": {"mlp_layer_types": ["sparse"] * 3},
}


@pytest.mark.parametrize("field", REFUSED)
def test_what_cannot_be_built_is_refused_in_one_line(field):
    config = random_sparse("deepseek_v32").config.to_dict()
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")) as e:
        args_from_hf_config({**config, **REFUSED[field]})
    assert "\n" not in str(e.value)


def test_glm5_layers_that_reuse_an_earlier_selection_are_refused_in_one_line():
    config = random_sparse("glm_moe_dsa").config.to_dict()
    with pytest.raises(ConfigError, match="indexer_types=.*'shared'.*not built") as e:
        args_from_hf_config({**config, "indexer_types": ["full", "shared", "full"]})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "name, damage",
    [("indexer.wk.weight", None), ("indexer.k_norm.bias", None), ("indexer.wq_b.weight", lambda t: t[:-1])],
    ids=["missing wk", "missing k_norm bias", "misshaped wq_b"],
)
def test_a_folder_whose_indexer_tensor_is_missing_or_misshaped_is_refused_naming_it(tmp_path, name, damage):
    random_sparse("deepseek_v32").save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    key = f"model.layers.1.self_attn.{name}"
    if damage is None:
        del tensors[key]
    else:
        tensors[key] = damage(tensors[key]).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    model = model_from_args(folder_args(tmp_path, 64))
    with pytest.raises(ConfigError, match=f"model.layers.1.self_attn.{name}") as e:
        load_hf_into([model], tmp_path)
    assert "\n" not in str(e.value)


# ---- the sparse pieces alone -------------------------------------------------------------------------------------


def dense_reference(q_latent, q_rot, latent, k_rot, allowed, indices, valid, scale):
    """Dense latent attention whose mask keeps the selected keys only: what transformers computes, in the latent's
    space."""
    chosen = torch.zeros(*indices.shape[:2], latent.shape[1], dtype=torch.bool)
    chosen.scatter_(-1, indices, valid)
    scores = torch.einsum("bqhr,bsr->bhqs", q_latent, latent) + torch.einsum("bqhd,bsd->bhqs", q_rot, k_rot)
    scores = (scores * scale).masked_fill(~(chosen[:, None] & allowed), float("-inf"))
    return torch.einsum("bhqs,bsr->bqhr", scores.softmax(-1), latent)


@pytest.mark.parametrize("chunk_elements", [1 << 22, 64])
def test_gathered_attention_equals_dense_attention_under_the_selection_with_its_gradients(monkeypatch, chunk_elements):
    """Block-causal (two documents), 4 of at most 24 keys a query; chunks of one query too (64 elements)."""
    monkeypatch.setattr(indexer_core, "CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(0)
    q_latent, q_rot = torch.randn(2, 24, 3, 8, generator=g), torch.randn(2, 24, 3, 4, generator=g)
    latent, k_rot = torch.randn(2, 24, 8, generator=g), torch.randn(2, 24, 4, generator=g)
    inputs = [t.requires_grad_() for t in (q_latent, q_rot, latent, k_rot)]
    iq, ik, iw = torch.randn(2, 24, 2, 8, generator=g), torch.randn(2, 24, 8, generator=g), torch.randn(2, 24, 2)
    documents = torch.tensor([[0] * 10 + [1] * 14, [0] * 17 + [1] * 7])
    sequence = Sequence(documents=documents)
    indexer = sparse.Indexer(16, 8, 2, 8, 4, topk=4, interleaved=False)
    indices, valid = sparse.select(indexer, iq, ik, iw, sequence)
    assert not valid[:, :3].all() and valid[:, 3:10].all()  # the first queries see fewer than 4 keys
    ours, sums = sparse.sparse_attention(*inputs, indices, valid, 0.3)
    allowed = attention_mask(sequence, 24, 24, latent.device)
    expected = dense_reference(*inputs, allowed, indices, valid, 0.3)
    torch.testing.assert_close(ours, expected)
    torch.testing.assert_close(sums.sum(-1), torch.full((2, 24), 3.0))  # each head's weights sum to one
    grads = torch.autograd.grad(ours.square().sum(), inputs)
    torch.testing.assert_close(grads, torch.autograd.grad(expected.square().sum(), inputs))


def test_the_selection_does_not_depend_on_the_order_the_keys_come_in():
    """Context parallelism gathers the keys rank by rank: put back in position order, they select what one process
    does, ties among equal scores included (zeros, where every head's score is negative)."""
    g = torch.Generator().manual_seed(1)
    iq, ik, iw = torch.randn(1, 16, 2, 8, generator=g), torch.randn(1, 16, 8, generator=g), torch.randn(1, 16, 2)
    indexer = sparse.Indexer(16, 8, 2, 8, 4, topk=5, interleaved=False)
    whole = sparse.select(indexer, iq, ik, iw, None)
    order = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])  # cp 2's gathered positions
    shuffled = Sequence(key_positions=order)
    ordered, (keys,) = sparse.keys_in_order(shuffled, ik[:, order])
    assert torch.equal(keys, ik)
    picked = sparse.select(indexer, iq, keys, iw, ordered)
    assert torch.equal(picked[0], whole[0]) and torch.equal(picked[1], whole[1])


def recall(model, batch) -> float:
    """How many of the main attention's top-k keys (its weights summed over the heads) each layer's indexer picks,
    over every query that sees more than k keys, on `batch`."""
    found, total, inputs = 0, 0, {}
    hooks = [
        layer.register_forward_pre_hook(lambda m, args, kwargs: inputs.__setitem__(m, args), with_kwargs=True)
        for layer in indexers(model)
    ]
    with torch.no_grad():
        model(batch)
    for hook in hooks:
        hook.remove()
    for layer, (x, cos, sin) in inputs.items():
        q, residual = layer.queries(x, cos, sin)
        k, _ = layer.expand(*layer.latent(x, cos, sin))
        sums, _ = sparse.dense_head_sums(q, k, None, layer.scale)
        index_q, index_k, index_w = layer.indexer(x, residual, cos, sin)
        picked, _ = sparse.select(layer.indexer, index_q, index_k, index_w, None)
        wanted = sums.topk(layer.indexer.topk, dim=-1).indices
        for t in range(layer.indexer.topk, x.shape[1]):
            hits = torch.isin(picked[:, t], wanted[:, t]).sum()
            found, total = found + int(hits), total + picked[:, t].numel()
    return found / total


def indexer_training(folder, coefficient: float, warmup: bool, steps: int = 20):
    """The random DeepSeek-V3.2 of `folder` (its indexer keeping 4 keys of up to 48) trained `steps` AdamW steps at
    lr 1e-2 (no weight decay: a parameter whose gradients are all zero keeps its value exactly) with the indexer loss
    at `coefficient`: in the dense warm-up (`warmup`) the indexer alone on its loss over every key, as DeepSeek-V3.2's
    first stage; else the whole model on both losses. Returns the recall before and after, the logged indexer losses,
    the model as it started and as it ended."""
    start, model = imported(folder), imported(folder)
    for layer in indexers(model):
        layer.loss_weight, layer.dense_warmup = coefficient, warmup
    batch = tokens(VOCAB, (4, 49), seed=3)
    before = recall(model, batch[:, :-1])
    trained = [p for layer in indexers(model) for p in layer.indexer.parameters()] if warmup else model.parameters()
    optimizer = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.0)
    logged, terms = [], AuxiliaryLosses(("indexer_loss",))
    terms.watch(model)
    for _ in range(steps):
        with collecting(terms):
            logits = model(batch[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        logged.append(float(terms.take(torch.device("cpu"), 1)[0]))
        optimizer.step()
        optimizer.zero_grad()
    return before, recall(model, batch[:, :-1]), logged, start, model


def test_the_indexer_learns_the_attention_it_stands_for_and_not_at_a_weight_of_zero(tmp_path):
    """The dense warm-up's KL loss raises the indexer's recall of the attention's top 4 keys (over the queries that
    see more than 4); at weight 0 the indexer loss is logged as before but the indexer never moves while the rest of
    the model trains (sparse mode)."""
    random_sparse("deepseek_v32", index_topk=4).save_pretrained(tmp_path)
    before, after, logged, _, _ = indexer_training(tmp_path, 1.0, warmup=True)
    print(f"warm-up, weight 1: recall {before:.3f} -> {after:.3f}, indexer_loss {logged[0]:.5f} -> {logged[-1]:.5f}")
    assert after > before + 0.08, (before, after)
    assert logged[-1] < 0.5 * logged[0] and all(value > 0 for value in logged)
    still_before, still_after, still_logged, start, model = indexer_training(tmp_path, 0.0, warmup=False)
    print(f"sparse, weight 0: recall {still_before:.3f} -> {still_after:.3f}, indexer_loss {still_logged[0]:.5f}")
    assert all(value > 0 for value in still_logged)
    for ours, first in zip(indexers(model), indexers(start)):
        for (name, p), q in zip(ours.indexer.named_parameters(), first.indexer.parameters()):
            assert torch.equal(p, q), name
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters()))  # the rest trained


def test_the_flop_count_follows_torchs_counter_and_reads_k_keys_not_t():
    """The forward's matmuls of the selection, the sparse attention and the indexer loss, as torch's FLOP counter sees
    them, are the forward third of the layer's count (SequenceMixer: models/common/flops.py), which past topk grows
    with T only by the selection's scores."""
    with torch.device("meta"):
        model = model_from_args(debug_args(V32))
    layer = indexers(model)[0]
    assert isinstance(layer, SequenceMixer)
    heads, rank, rope, index, t = 4, 32, 8, layer.indexer, 64
    g = torch.Generator().manual_seed(0)
    q_latent, q_rot = torch.randn(1, t, heads, rank, generator=g), torch.randn(1, t, heads, rope, generator=g)
    latent, k_rot = torch.randn(1, t, rank, generator=g), torch.randn(1, t, rope, generator=g)
    iq, ik, iw = torch.randn(1, t, 4, 16), torch.randn(1, t, 16), torch.randn(1, t, 4)
    with FlopCounterMode(display=False) as counter:
        indices, valid = sparse.select(index, iq, ik, iw, None)
        _, sums = sparse.sparse_attention(q_latent, q_rot, latent, k_rot, indices, valid, 0.1)
        sparse.indexer_kl(iq, ik, iw, indices, valid, sums, index.scale)
    forward = counter.get_total_flops()
    # the count is forward and backward (3x) but for the selection, which runs forward only
    selection = 2 * 4 * 17 * t * t
    assert 3 * (forward - selection) + selection == t * layer.sequence_flops_per_token(t)
    assert layer.sequence_flops_per_token(t) == 6 * heads * (2 * rank + rope) * 16 + 2 * 4 * 17 * t + 6 * 4 * 17 * 16
    growth = flops_per_token(model, 8192) - flops_per_token(model, 4096)
    assert growth == 3 * 2 * 4 * 17 * 4096  # three layers' selections: the attention reads 16 keys at any length


def test_the_start_up_line_says_how_the_indexer_attends_and_trains():
    """A sequence no longer than index_topk leaves no key out: the attention runs dense, and the line says so; the
    warm-up names the weights it trains."""
    from titanlite.builder.model import indexer_line

    with torch.device("meta"):
        sparse_model = model_from_args(debug_args(V32))
        warm = model_from_args(debug_args(V32, indexer=dataclasses.replace(V32["debug"].indexer, dense_warmup=True)))
    assert "each query reads the 16 keys its layer's indexer selects (index_topk)" in indexer_line(sparse_model, 32)
    line = indexer_line(sparse_model, 16)
    assert "index_topk=16 covers training.seq_len=16" in line and "the attention runs dense" in line
    assert "the indexers alone trained (10,080 weights, the rest frozen)" in indexer_line(warm, 32)


def test_the_multi_token_prediction_layer_and_its_indexer_export_and_read_back(tmp_path):
    """DeepSeek-V3.2's MTP layer (model.layers.N, N the decoder's layers) is a sparse layer with an indexer of its own,
    written and read under transformers' names."""
    from titanlite.components.hf_weights import save_hf
    from titanlite.models.common.init import init_weights

    args = debug_args(V32, mtp_layers=1)
    ours = model_from_args(args)
    init_weights(ours, 0)
    save_hf(tmp_path, args, ours.state_dict())
    assert "model.layers.3.self_attn.indexer.wq_b.weight" in load_file(tmp_path / "model.safetensors")
    read = folder_args(tmp_path, 64)
    assert read.mtp_layers == 1
    back = model_from_args(read)
    load_hf_into([back], tmp_path)
    expected = ours.state_dict()
    assert back.state_dict().keys() == expected.keys()
    assert all(torch.equal(value, expected[name]) for name, value in back.state_dict().items())


@pytest.mark.parametrize("mode", ["full", "selective_op"])
def test_activation_checkpointing_records_the_indexer_loss_once(mode):
    """The indexer loss is added inside the block, where activation checkpointing's recompute runs again (it stops
    only after the block's last saved tensor): recorded once per trained forward all the same, and the gradients are
    the unwrapped model's."""
    from titanlite.config import ActivationCheckpoint
    from titanlite.models.common.init import init_weights
    from titanlite.parallel.activation_checkpoint import apply_ac

    batch = tokens(320, (2, 33))
    runs = []
    for wrap in (False, True):
        model = model_from_args(debug_args(V32))
        init_weights(model, 0)
        if wrap:
            apply_ac(model, ActivationCheckpoint(mode=mode))
        terms = AuxiliaryLosses(("indexer_loss",))
        terms.watch(model)
        with collecting(terms):
            logits = model(batch[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        grads = [p.grad for p in model.parameters()]
        runs.append((float(terms.take(torch.device("cpu"), 1)[0]), grads))
    (plain, plain_grads), (wrapped, wrapped_grads) = runs
    assert wrapped == pytest.approx(plain, rel=1e-6) and plain > 0
    torch.testing.assert_close(wrapped_grads, plain_grads)

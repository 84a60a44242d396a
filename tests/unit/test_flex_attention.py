"""The "flex" attention core against SDPA's: the same outputs and gradients for plain causal, block-causal
(documents), grouped-query attention and the positions context parallelism gives a rank; and the block mask its
CUDA path hands torch's flex_attention describes the same mask (run here forward-only: torch has no
FlexAttention backward on the CPU, which is why the CPU path is titanlite's own blockwise loop)."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from titanlite.models.common.attention import (
    FlexAttention,
    SDPAttention,
    Sequence,
    attention_mask,
    blockwise_attention,
    build_core,
    mask_function,
)

B, HQ, HKV, HD = 2, 4, 2, 16


@pytest.fixture(params=[1024, 48], ids=["chunk1024", "chunk48"])
def key_chunk(request, monkeypatch):
    """flex's CPU path both with its keys in one chunk (these short sequences) and in several of 48 (the online
    softmax across chunks, the last one ragged); the tests of the cores themselves take it."""
    monkeypatch.setattr(FlexAttention, "CHUNK", request.param)


def qkv(queries: int, keys: int, seed: int = 0, grad: bool = True):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, HQ, queries, HD), (B, HKV, keys, HD), (B, HKV, keys, HD)]
    return [torch.randn(s, generator=g, dtype=torch.float64).requires_grad_(grad) for s in shapes]


def documents(length: int, seed: int = 1) -> torch.Tensor:
    """[B, length] document ids: a new document after each of a few random end-of-text positions."""
    ends = torch.rand(B, length, generator=torch.Generator().manual_seed(seed)) < 0.05
    return torch.cumsum(ends.to(torch.int64), dim=1)


SEQUENCES = {
    "causal": lambda T: None,
    "block_causal": lambda T: Sequence(documents=documents(T)),
    # What context parallelism hands rank 1 of 2 (load-balanced chunks 1 and 2 of 4): its queries' positions,
    # all T keys gathered in position order.
    "cp_rank1": lambda T: Sequence(
        positions=torch.cat([torch.arange(T // 4, T // 2), torch.arange(T // 2, 3 * T // 4)]),
        key_positions=torch.arange(T),
        documents=documents(T)[:, T // 4 : 3 * T // 4],
        key_documents=documents(T),
    ),
}


@pytest.mark.usefixtures("key_chunk")
@pytest.mark.parametrize("kind", list(SEQUENCES))
def test_flex_core_equals_sdpa_forward_and_backward(kind):
    T = 300  # not a multiple of the 128-query block
    sequence = SEQUENCES[kind](T)
    queries = T if sequence is None or sequence.positions is None else len(sequence.positions)
    grads = []
    outs = []
    for core in (SDPAttention(), build_core("flex")):
        q, k, v = qkv(queries, T)
        out = core(q, k, v, sequence)
        (out * torch.linspace(-1, 1, HD, dtype=out.dtype)).sum().backward()
        outs.append(out)
        grads.append([t.grad for t in (q, k, v)])
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-12)
    for flex, sdpa in zip(*grads):
        torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-12)


@pytest.mark.usefixtures("key_chunk")
def test_blockwise_keeps_at_most_a_block_of_scores_and_saves_only_its_inputs():
    """Each block of queries sees only the span of keys it may attend to, and backward recomputes the blocks:
    nothing of size T x S is saved (the saved tensors are q, k and v's slices)."""
    T = 512
    q, k, v = qkv(T, T)
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = blockwise_attention(q, k, v, None, 128, chunk=FlexAttention.CHUNK)
    out.sum().backward()  # backward recomputes each block, and frees it before the next
    assert saved and max(saved) <= B * HQ * T * HD, saved  # nothing like B x H x T x T


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_cuda_block_mask_describes_the_same_mask():
    """What FlexAttention's CUDA path hands torch: a block mask built from mask_function (here by eager
    create_block_mask) and flex_attention with enable_gqa. Forward only (no CPU backward in torch)."""
    T = 256
    sequence = SEQUENCES["block_causal"](T)
    allowed = mask_function(sequence, T, torch.device("cpu"))
    block_mask = create_block_mask(lambda b, h, q_idx, k_idx: allowed(b, q_idx, k_idx), B, None, T, T, device="cpu")
    q, k, v = (t.float() for t in qkv(T, T, grad=False))
    with torch.no_grad():
        out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        expected = SDPAttention()(q, k, v, sequence)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    # The block mask skips what the dense mask rules out whole: 128 x 128 blocks with no allowed pair.
    dense = attention_mask(sequence, T, T, torch.device("cpu"))  # [B, 1, T, T]
    any_allowed = dense.reshape(B, 1, T // 128, 128, T // 128, 128).any(dim=(3, 5))
    assert torch.equal(block_mask.to_dense().bool(), any_allowed)


def test_flex_is_a_known_core():
    assert isinstance(build_core("flex"), FlexAttention)


def reference_attention(q, k, v, documents=None, window=None, softcap=None, scale=None):
    """Attention written out from its definition, for the window and softcap cases: every query i of a sequence
    sees key j when j <= i, i - j < window and both are in one document; scores scaled, then softcapped."""
    T, S = q.shape[2], k.shape[2]
    i, j = torch.arange(T)[:, None], torch.arange(S)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    allowed = (
        allowed[None, None] & (documents[:, None, :, None] == documents[:, None, None, :])
        if documents is not None
        else allowed
    )
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    scores = q @ k.transpose(-2, -1) * (scale if scale else HD**-0.5)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


@pytest.mark.usefixtures("key_chunk")
@pytest.mark.parametrize("name", ["sdpa", "flex"])
@pytest.mark.parametrize(
    "options", [{"window": 37}, {"softcap": 2.0, "scale": 0.4}, {"window": 200, "softcap": 3.0}], ids=str
)
@pytest.mark.parametrize("block_causal", [False, True])
def test_windows_and_softcaps_follow_their_definition(name, options, block_causal):
    T = 300
    docs = documents(T) if block_causal else None
    sequence = Sequence(documents=docs) if block_causal else None
    q, k, v = qkv(T, T)
    out = build_core(name, **options)(q, k, v, sequence)
    expected = reference_attention(q, k, v, docs, **options)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.sum().backward()  # both cores train with them
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_cuda_path_applies_the_window_and_the_softcap_as_defined():
    """The block mask with a window, and the softcap as a score modification, as FlexAttention's CUDA path hands
    them to torch (forward, eager, on the CPU)."""
    T, window, cap = 256, 40, 2.0
    allowed = mask_function(None, T, torch.device("cpu"), window)
    block_mask = create_block_mask(lambda b, h, q_idx, k_idx: allowed(b, q_idx, k_idx), None, None, T, T, device="cpu")
    q, k, v = (t.float() for t in qkv(T, T, grad=False))
    with torch.no_grad():
        out = flex_attention(
            q, k, v, score_mod=lambda s, b, h, qi, ki: cap * torch.tanh(s / cap), block_mask=block_mask, enable_gqa=True
        )
    expected = reference_attention(q, k, v, window=window, softcap=cap)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    dense = attention_mask(Sequence(), T, T, torch.device("cpu"), window)
    assert torch.equal(block_mask.to_dense().bool(), dense.reshape(1, 1, 2, 128, 2, 128).any(dim=(3, 5)))


@pytest.mark.parametrize("sequence_of", [lambda T: None, lambda T: Sequence(documents=documents(T)[:1].expand(2, -1))])
def test_a_windowed_model_trains_the_same_on_flex_and_on_sdpas_explicit_mask(sequence_of):
    """Qwen2's debug model with a window of 40 on its last two layers, 300 tokens (past the window and a flex
    block), three AdamW steps: flex's losses equal those of SDPA with the window as a dense mask (1e-5), and so do
    the first step's gradients."""
    import dataclasses

    from titanlite.models.build import model_from_args
    from titanlite.models.common.init import init_weights
    from titanlite.models.registry import spec_named

    args = dataclasses.replace(
        spec_named("qwen2").flavors["debug"], vocab_size=64, max_seq_len=300, sliding_window=40,
        layer_types=("full_attention",) * 2 + ("sliding_attention",) * 2,
    )  # fmt: skip
    tokens = torch.randint(0, 64, (2, 301), generator=torch.Generator().manual_seed(4))
    sequence = sequence_of(300)
    runs = []
    for backend in ("sdpa", "flex"):
        model = model_from_args(args)
        for block in model.layers.values():
            block.attention.core = build_core(backend, **block.attention.core.options())
        init_weights(model, 0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, first_grads = [], {}
        for step in range(3):
            logits = model(tokens[:, :-1], sequence=sequence)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            if step == 0:
                first_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        runs.append((losses, first_grads))
    assert [block.attention.core.window for block in model.layers.values()] == [None, None, 40, 40]
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-5, atol=0)
    for name, grad in runs[0][1].items():  # every parameter's gradient, to float32 rounding
        assert (runs[1][1][name] - grad).norm() <= 1e-5 * grad.norm(), name

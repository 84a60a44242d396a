"""Attention sinks (gpt-oss): a learned logit per query head that joins each query's softmax denominator and
contributes no value. Both cores ("sdpa", "flex"'s CPU blockwise path) equal attention written out from that
definition in float64, outputs and the gradients of q, k, v and the sinks, with windows, grouped-query attention
and documents; the formula of flex's CUDA path (flex_attention's output times sigmoid(lse - sink)) is checked
forward with eager flex_attention on the CPU (it cannot run compiled here, and torch has no CPU backward)."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from titanlite.models.common.attention import FlexAttention, Sequence, build_core, flex_with_sinks, mask_function
from titanlite.models.common.kv_cache import KVCache

B, HQ, HKV, HD = 2, 4, 2, 16


@pytest.fixture(params=[1024, 48], ids=["chunk1024", "chunk48"])
def key_chunk(request, monkeypatch):
    """flex's CPU path both with its keys in one chunk (these short sequences) and in several of 48 (the online
    softmax across chunks, the last one ragged); the tests of the cores themselves take it."""
    monkeypatch.setattr(FlexAttention, "CHUNK", request.param)


def inputs(queries: int, keys: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, HQ, queries, HD), (B, HKV, keys, HD), (B, HKV, keys, HD), (HQ,)]
    q, k, v, sinks = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    sinks = sinks * 3  # some heads' sinks dominate their short windows, some hardly count
    return [t.requires_grad_() for t in (q, k, v, sinks)]


def documents(length: int) -> torch.Tensor:
    ends = torch.rand(B, length, generator=torch.Generator().manual_seed(1)) < 0.05
    return torch.cumsum(ends.to(torch.int64), dim=1)


def reference(q, k, v, sinks, documents=None, window=None, scale=None):
    """out_i = sum_j e^(x_ij) v_j / (e^(s_h) + sum_j e^(x_ij)) over the keys j query i may see."""
    T, S = q.shape[2], k.shape[2]
    i, j = torch.arange(T)[:, None], torch.arange(S)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    allowed = allowed[None, None]
    if documents is not None:
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    x = q @ k.transpose(-2, -1) * (scale if scale else HD**-0.5)
    top = torch.maximum(x.masked_fill(~allowed, float("-inf")).amax(-1, keepdim=True), sinks[None, :, None, None])
    e = torch.exp(x - top) * allowed
    denominator = e.sum(-1, keepdim=True) + torch.exp(sinks[None, :, None, None] - top)
    return (e / denominator) @ v


@pytest.mark.usefixtures("key_chunk")
@pytest.mark.parametrize("name", ["sdpa", "flex"])
@pytest.mark.parametrize("options", [{}, {"window": 37}, {"window": 5, "scale": 0.3}], ids=str)
@pytest.mark.parametrize("block_causal", [False, True])
def test_both_cores_equal_the_written_out_sinks_with_their_gradients(name, options, block_causal):
    T = 300  # past the window and over two of flex's 128-query blocks
    docs = documents(T) if block_causal else None
    sequence = Sequence(documents=docs) if block_causal else None
    core = build_core(name, sinks=True, **options)
    weights = torch.linspace(-1, 1, HD, dtype=torch.float64)
    grads = []
    outs = []
    for attend in (
        lambda q, k, v, sinks: core(q, k, v, sequence, sinks=sinks),
        lambda q, k, v, sinks: reference(q, k, v, sinks, documents=docs, **options),
    ):
        tensors = inputs(T, T)
        out = attend(*tensors)
        (out * weights).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad for t in tensors])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)
    for ours, theirs, what in zip(grads[0], grads[1], ("q", "k", "v", "sinks")):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10, msg=what)
    assert grads[0][3].abs().min() > 0  # every head's sink learns


def test_a_sink_lowers_every_weight_and_without_it_the_core_is_unchanged():
    q, k, v, sinks = inputs(40, 40)
    core = build_core("sdpa", window=8, sinks=True)
    plain = build_core("sdpa", window=8)(q, k, v, None)
    torch.testing.assert_close(core(q, k, v, None, sinks=torch.full((HQ,), -1e4, dtype=torch.float64)), plain)
    assert core.options()["sinks"] and not build_core("sdpa").options()["sinks"]
    assert build_core("flex", **core.options()).sinks  # the same block on the other backend keeps them


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 40])
def test_the_cuda_paths_lse_rescaling_is_exact(window):
    """flex_with_sinks as FlexAttention's CUDA path calls it (there with the compiled flex_attention): here eager,
    forward, float32, on the CPU, against the written-out definition."""
    T = 256
    allowed = mask_function(None, T, torch.device("cpu"), window)
    block_mask = create_block_mask(lambda b, h, q_idx, k_idx: allowed(b, q_idx, k_idx), None, None, T, T, device="cpu")
    q, k, v, sinks = (t.detach().float() for t in inputs(T, T))
    with torch.no_grad():
        out = flex_with_sinks(flex_attention, q, k, v, block_mask, None, None, sinks)
        expected = reference(*(t.double() for t in (q, k, v, sinks)), window=window).float()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["sdpa", "flex"])
def test_a_kv_cache_attends_with_the_sinks_token_by_token(name):
    """Decoding one token at a time through a KVCache gives the whole sequence's output, window and sinks kept."""
    T = 24
    q, k, v, sinks = (t.detach() for t in inputs(T, T))
    core = build_core(name, window=6, sinks=True)
    whole = core(q, k, v, None, sinks=sinks)
    cache = KVCache(T)
    steps = []
    for t in range(T):
        steps.append(cache.layer("0").attend(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], core, sinks))
        cache.advance(1)
    torch.testing.assert_close(torch.cat(steps, dim=2), whole, rtol=0, atol=1e-12)

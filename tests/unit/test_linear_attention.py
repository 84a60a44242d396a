"""The linear-attention kernels of the hybrid families: the chunked gated delta rule gives the step-by-step one's
outputs and state (decay per head and per key channel, any length, a state handed in), packed documents are each
computed as if alone, and the kernels, the causal convolution and the gated norm give Hugging Face's results."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.kimi_linear.modeling_kimi_linear import (
    chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextRMSNormGated,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from titanlite.models.common.linear_attention import (
    GatedRMSNorm,
    causal_conv1d,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)

DECAYS = ["per-head", "per-channel"]


def kernel_inputs(
    batch=2, length=37, heads=3, key_dim=5, value_dim=4, decay="per-head", key_heads=None, dtype=torch.float64, seed=0
):
    """q, k (unit length, as the mixers hand them in), v, g (log-decay <= 0), beta in (0, 1) and a starting state."""
    gen = torch.Generator().manual_seed(seed)
    key_heads = key_heads or heads

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k = (F.normalize(randn(batch, length, key_heads, key_dim), dim=-1) for _ in range(2))
    v = randn(batch, length, heads, value_dim)
    g_shape = (batch, length, heads) if decay == "per-head" else (batch, length, heads, key_dim)
    g = -F.softplus(randn(*g_shape) - 1.0)
    beta = torch.sigmoid(randn(batch, length, heads))
    state = randn(batch, heads, key_dim, value_dim)
    return q, k, v, g, beta, state


def chunked(q, k, v, g, beta, initial_state=None, documents=None):
    return gated_delta_rule_chunked(q, k, v, g, beta, initial_state, documents, chunk_size=8)


KERNELS = {"chunked": chunked, "recurrent": gated_delta_rule_recurrent}


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("key_heads", [3, 1], ids=["heads", "grouped-values"])
def test_chunked_equals_recurrent_in_float64(decay, key_heads):
    """37 tokens in chunks of 8 (the last one padded), from a random state: the chunked form's outputs and final
    state are the recurrent loop's to rounding."""
    q, k, v, g, beta, state = kernel_inputs(decay=decay, key_heads=key_heads)
    o_loop, s_loop = gated_delta_rule_recurrent(q, k, v, g, beta, state)
    o_chunk, s_chunk = chunked(q, k, v, g, beta, state)
    assert o_chunk.shape == v.shape and s_chunk.shape == state.shape
    assert (o_chunk - o_loop).abs().max() < 1e-10
    assert (s_chunk - s_loop).abs().max() < 1e-10


def test_kernels_read_the_state_handed_in_and_the_decay():
    """The output depends on the starting state and on g: neither is silently dropped (a check the equalities
    above need, as both kernels could drop the same thing)."""
    q, k, v, g, beta, state = kernel_inputs()
    for kernel in KERNELS.values():
        from_state, _ = kernel(q, k, v, g, beta, state)
        from_zero, _ = kernel(q, k, v, g, beta)
        undecayed, _ = kernel(q, k, v, torch.zeros_like(g), beta, state)
        assert (from_state - from_zero).abs().max() > 1e-3
        assert (from_state - undecayed).abs().max() > 1e-3


# Row 0: documents of 5, 11, 1 and 20 tokens, starting inside a chunk of 8, on a chunk's boundary (16) and one token
# later. Row 1: 16, 10 and 11 tokens whose indices 3, 7, 3 repeat: a document starts where the index changes.
PACKED = [[5, 11, 1, 20], [16, 10, 11]]
INDICES = [[0, 1, 2, 3], [3, 7, 3]]


def packed_documents() -> torch.Tensor:
    rows = [torch.cat([torch.full((n,), i) for n, i in zip(lengths, ids)]) for lengths, ids in zip(PACKED, INDICES)]
    return torch.stack(rows)


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_each_packed_document_is_computed_as_if_alone(kernel, decay):
    """With documents, each document's outputs are those of the document run alone: the first from the state
    handed in, the others from zero; the final state is the last document's."""
    q, k, v, g, beta, state = kernel_inputs(decay=decay)
    run = KERNELS[kernel]
    o_packed, s_packed = run(q, k, v, g, beta, state, documents=packed_documents())
    o_unmasked, _ = run(q, k, v, g, beta, state)
    for row, lengths in enumerate(PACKED):
        start = 0
        for n, end in enumerate(torch.tensor(lengths).cumsum(0).tolist()):
            part = (x[row : row + 1, start:end] for x in (q, k, v, g, beta))
            alone, s_alone = run(*part, state[row : row + 1] if n == 0 else None)
            assert (o_packed[row, start:end] - alone[0]).abs().max() < 1e-10
            if n > 0:  # the mask changes the later documents
                assert (o_unmasked[row, start:end] - alone[0]).abs().max() > 1e-3
            start = end
        assert (s_packed[row] - s_alone[0]).abs().max() < 1e-10


@pytest.mark.parametrize("decay", DECAYS)
def test_state_handed_on_continues_the_sequence(decay):
    """Prefill 20 tokens in chunks, then decode the rest one token at a time from the state each step hands on: the
    outputs and final state of the whole sequence in one call (how generation uses the two kernels)."""
    q, k, v, g, beta, state = kernel_inputs(decay=decay)
    whole, s_whole = chunked(q, k, v, g, beta, state)
    prefill, s = chunked(*(x[:, :20] for x in (q, k, v, g, beta)), state)
    outputs = [prefill]
    for t in range(20, q.shape[1]):
        o, s = gated_delta_rule_recurrent(*(x[:, t : t + 1] for x in (q, k, v, g, beta)), s)
        outputs.append(o)
    assert (torch.cat(outputs, dim=1) - whole).abs().max() < 1e-10
    assert (s - s_whole).abs().max() < 1e-10


def hf_l2norm(x):
    """Qwen3-Next's in-kernel L2 normalisation, x / sqrt(sum x^2 + 1e-6), which its kernels apply with
    use_qk_l2norm_in_kernel=True: ours leave it to the mixer."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_gated_delta_net_matches_hugging_face(kernel):
    """Float32, two key heads for four value heads, 70 tokens (the default chunk of 64 and a padded second), from
    a state: ours on L2-normalised q and k give Qwen3-Next's chunked and recurrent kernels' outputs and states."""
    q, k, v, g, beta, state = kernel_inputs(batch=2, length=70, heads=4, key_heads=2, key_dim=8, dtype=torch.float32)
    q, k = q * 3.0, k * 0.5  # not unit length: the in-kernel normalisation has something to do
    theirs = torch_chunk_gated_delta_rule if kernel == "chunked" else torch_recurrent_gated_delta_rule
    o_hf, s_hf = theirs(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ours = gated_delta_rule_chunked if kernel == "chunked" else gated_delta_rule_recurrent
    o, s = ours(hf_l2norm(q), hf_l2norm(k), v, g, beta, state)
    torch.testing.assert_close(o, o_hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_hf, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kimi_delta_attention_matches_hugging_face(kernel):
    """Float32, decay per key channel, 70 tokens from a state: Kimi Linear's chunked and recurrent kernels' outputs
    and states (q and k normalised before both)."""
    q, k, v, g, beta, state = kernel_inputs(batch=2, length=70, key_dim=8, decay="per-channel", dtype=torch.float32)
    theirs = chunk_kimi_delta_attention if kernel == "chunked" else recurrent_kimi_delta_attention
    o_hf, s_hf = theirs(q, k, v, g, beta, initial_state=state, output_final_state=True)
    ours = gated_delta_rule_chunked if kernel == "chunked" else gated_delta_rule_recurrent
    o, s = ours(q, k, v, g, beta, state)
    torch.testing.assert_close(o, o_hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_hf, atol=1e-5, rtol=1e-5)


def test_kernels_return_q_dtype_and_a_float32_state():
    q, k, v, g, beta, state = kernel_inputs(length=11, dtype=torch.float32)
    for kernel in KERNELS.values():
        o, s = kernel(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, state)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32


def test_kernels_name_the_misshapen_argument():
    q, k, v, g, beta, state = kernel_inputs()
    with pytest.raises(ValueError, match=r"^g \(2, 37, 2\) must be"):
        gated_delta_rule_chunked(q, k, v, g[..., :2], beta)
    with pytest.raises(ValueError, match="initial_state"):
        gated_delta_rule_recurrent(q, k, v, g, beta, state[:, :1])


@pytest.mark.parametrize("decay", DECAYS)
def test_chunked_gradients_pass_gradcheck(decay):
    """Backward through plain autograd (triangular solves, masked exponentials) gives the numerical gradients of
    every input, the state and the decay included, across a document start inside a chunk."""
    q, k, v, g, beta, state = kernel_inputs(batch=1, length=5, heads=1, key_dim=2, value_dim=2, decay=decay)
    documents = torch.tensor([[0, 0, 0, 1, 1]])

    def run(*inputs):
        return gated_delta_rule_chunked(*inputs, documents=documents, chunk_size=2)

    inputs = tuple(x.requires_grad_() for x in (q, k, v, g, beta, state))
    assert torch.autograd.gradcheck(run, inputs)


def conv_inputs(batch=2, length=23, channels=6, width=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, channels, generator=gen, dtype=torch.float64)
    conv = nn.Conv1d(channels, channels, width, groups=channels, padding=width - 1, dtype=torch.float64)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen))
        conv.bias.copy_(torch.randn(channels, generator=gen))
    return x, conv


@pytest.mark.parametrize("activation", [True, False], ids=["silu", "linear"])
def test_causal_conv1d_is_the_checkpoints_depthwise_conv(activation):
    """nn.Conv1d(C, C, K, groups=C, padding=K-1) as the families build it, its outputs cut to the first T: the
    same, with its weight [C, 1, K] as [C, K]; the state handed on is the last K-1 inputs."""
    x, conv = conv_inputs()
    reference = conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
    if activation:
        reference = F.silu(reference)
    y, state = causal_conv1d(x, conv.weight[:, 0], conv.bias, activation=activation)
    torch.testing.assert_close(y, reference, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(state, x[:, -3:].transpose(1, 2), atol=0, rtol=0)


def test_causal_conv1d_one_token_at_a_time_equals_the_whole_sequence():
    """From a random state, feeding one token at a time with the state each call hands on gives the whole call's
    outputs and its final state; the state handed in is read (zeros give other outputs)."""
    x, conv = conv_inputs()
    weight, bias = conv.weight[:, 0].detach(), conv.bias.detach()
    state = torch.randn(2, 6, 3, dtype=torch.float64)
    whole, whole_state = causal_conv1d(x, weight, bias, state=state)
    steps, s = [], state
    for t in range(x.shape[1]):
        y, s = causal_conv1d(x[:, t : t + 1], weight, bias, state=s)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(s, whole_state, atol=0, rtol=0)
    from_zero, _ = causal_conv1d(x, weight, bias)
    assert (from_zero[:, :3] - whole[:, :3]).abs().max() > 1e-3


def test_causal_conv1d_convolves_each_document_alone():
    """Documents of 7, 1, 13 and 2 tokens: each document's outputs are its own alone, the first continuing the
    state handed in; the state handed on is the last document's alone (two inputs, the third zero)."""
    x, conv = conv_inputs()
    weight, bias = conv.weight[:, 0].detach(), conv.bias.detach()
    state = torch.randn(2, 6, 3, dtype=torch.float64)
    lengths = [7, 1, 13, 2]
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(2, -1)
    y, new_state = causal_conv1d(x, weight, bias, documents=documents, state=state)
    unmasked, _ = causal_conv1d(x, weight, bias, state=state)
    start = 0
    for n, end in enumerate(torch.tensor(lengths).cumsum(0).tolist()):
        alone, alone_state = causal_conv1d(x[:, start:end], weight, bias, state=state if n == 0 else None)
        torch.testing.assert_close(y[:, start:end], alone, atol=1e-12, rtol=1e-12)
        if n > 0:
            assert (unmasked[:, start] - alone[:, 0]).abs().max() > 1e-3
        start = end
    torch.testing.assert_close(new_state, alone_state, atol=0, rtol=0)
    assert (new_state[..., 0] == 0).all() and (new_state[..., 1:] != 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_qwen3_next(dtype):
    """Random weight, input and gate: Qwen3-Next's gated norm's outputs, in the input's dtype."""
    gen = torch.Generator().manual_seed(0)
    x, gate = (torch.randn(3, 5, 16, generator=gen).to(dtype) for _ in range(2))
    theirs, ours = Qwen3NextRMSNormGated(16, eps=1e-6), GatedRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16, generator=gen) + 1.0)
        ours.weight.copy_(theirs.weight)
    out = ours(x, gate)
    assert out.dtype == dtype
    torch.testing.assert_close(out, theirs(x, gate), atol=1e-6, rtol=1e-6)
    ungated = ours.weight * F.rms_norm(x.float(), (16,), eps=1e-6).to(dtype)
    assert (out.float() - ungated.float()).abs().max() > 1e-2

"""Context parallelism of the linear-attention layers: a Gated DeltaNet layer whose convolution and delta rule
apply_cp wrapped gives, on 2 and 4 gloo ranks, the outputs and gradients (input and parameters) of one process
over the whole sequence, causal and with documents that cross the ranks' chunks, one starting exactly at a chunk
boundary; Qwen3.5's layers are all wrapped; the delta rule alone matches with one decay per key channel (Kimi's);
a chunk shorter than the convolution's reach is refused at plan time. A Mamba-2 layer (its convolution with a bias,
its SSD scan) likewise, and the scan alone with a state handed in."""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.helpers import run_ranks
from titanlite.base.errors import ConfigError
from titanlite.models.build import build_model
from titanlite.models.common.attention import Sequence
from titanlite.models.common.gated_delta_net import DeltaRule, GatedDeltaNet
from titanlite.models.common.mamba2 import Mamba2, StateScan
from titanlite.parallel.context_parallel import (
    ContextParallelConvolution,
    ContextParallelDeltaRule,
    ContextParallelStateScan,
    SequenceSplit,
    apply_cp,
    check_cp_degree,
)

EOT = 0
DIM = 32
# The mixer computes q, k, the decay and its output norm in float32 even for float64 weights and inputs.
LAYER_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def layer() -> GatedDeltaNet:
    """Tiny, float64, every parameter seeded (the decay's A_log and dt_bias near the families' initial values)."""
    torch.manual_seed(0)
    mixer = GatedDeltaNet(DIM, key_heads=2, value_heads=4, key_dim=8, value_dim=8, conv_size=4).double()
    with torch.no_grad():
        for name, param in mixer.named_parameters():
            param.copy_(torch.randn_like(param) * (0.5 if name.startswith("conv") else 0.3))
        mixer.A_log.uniform_(-1.0, 1.0)
        mixer.dt_bias.uniform_(-1.0, 0.5)
    return mixer


def tokens(length: int) -> torch.Tensor:
    """[2, length] token ids, EOT closing documents: row 0's start inside chunks, one within the conv's reach of a
    chunk's end (position 6) and one document of two tokens; row 1's start exactly at chunk boundaries (8, 16)."""
    ids = torch.arange(1, 2 * length + 1).view(2, length) % 7 + 1
    for row, ends in ((0, (5, 11, 12, 18, length - 6)), (1, (7, 15, length // 2 + 3))):
        ids[row, list(ends)] = EOT
    return ids


def cp_layer_equals_one_process(rank: int, length: int, blocked: bool) -> None:
    """One rank of test_linear_layer_under_cp_equals_one_process."""
    cp = dist.get_world_size()
    whole, ids = layer(), tokens(length)
    split = SequenceSplit(cp=cp, rank=rank, eot_id=EOT if blocked else None)
    x = torch.randn(2, length, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, length, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    # One process over the whole sequence.
    x_whole = x.clone().requires_grad_()
    out_whole = whole(x_whole, sequence=SequenceSplit(eot_id=EOT if blocked else None)(ids, ids)[2])
    (out_whole * weights).sum().backward()

    # This rank's share, the layer's cores wrapped; each rank's parameter gradients are its share of the whole.
    mixer = copy.deepcopy(whole)
    mixer.zero_grad()
    apply_cp(mixer, init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)))
    assert type(mixer.conv) is ContextParallelConvolution and type(mixer.rule) is ContextParallelDeltaRule
    _, _, sequence = split(ids, ids)
    positions = split(torch.arange(length).expand(2, -1), ids)[0][0]
    x_mine = x[:, positions].clone().requires_grad_()
    out = mixer(x_mine, sequence=sequence)
    (out * weights[:, positions]).sum().backward()
    torch.testing.assert_close(out, out_whole[:, positions].detach(), **LAYER_TOLERANCE)
    assert x_mine.grad is not None and x_whole.grad is not None
    torch.testing.assert_close(x_mine.grad, x_whole.grad[:, positions], **LAYER_TOLERANCE)
    for (name, mine), theirs in zip(mixer.named_parameters(), whole.parameters()):
        assert mine.grad is not None and theirs.grad is not None, name
        dist.all_reduce(mine.grad)
        torch.testing.assert_close(mine.grad, theirs.grad, **LAYER_TOLERANCE, msg=name)

    # A family's linear layers are wrapped likewise, attention beside them, the state dict's names unchanged.
    with torch.device("meta"):
        qwen = build_model("qwen3_5", "debug", 320, length)
    names = list(qwen.state_dict())
    apply_cp(qwen, init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)))
    assert list(qwen.state_dict()) == names
    wrapped = [type(m).__name__ for m in qwen.modules() if isinstance(getattr(m, "inner", None), nn.Module)]
    assert wrapped == ["ContextParallelConvolution", "ContextParallelDeltaRule"] * 3 + ["ContextParallelCore"]

    # A pipeline stage infers its shapes on the meta device: the wrapped layer runs there too.
    with torch.device("meta"):
        meta = GatedDeltaNet(DIM, key_heads=2, value_heads=4, key_dim=8, value_dim=8, conv_size=4)
    apply_cp(meta, init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)))
    fields = {name: getattr(sequence, name) for name in Sequence.TENSORS if getattr(sequence, name) is not None}
    on_meta = Sequence(**{name: value.to("meta") for name, value in fields.items()})
    assert meta(x_mine.to("meta", torch.float32), sequence=on_meta).shape == out.shape


def cp_rule_with_channel_decay(rank: int, length: int) -> None:
    """One rank of test_delta_rule_under_cp_with_a_decay_per_key_channel."""
    cp = dist.get_world_size()
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.nn.functional.normalize(torch.randn(2, length, 2, 8, generator=gen, dtype=torch.float64), dim=-1)
            for _ in range(2))  # fmt: skip
    v = torch.randn(2, length, 4, 6, generator=gen, dtype=torch.float64)
    g = -torch.nn.functional.softplus(torch.randn(2, length, 4, 8, generator=gen, dtype=torch.float64) - 1.0)
    beta = 2 * torch.sigmoid(torch.randn(2, length, 4, generator=gen, dtype=torch.float64))  # OLMo's beta_scale 2
    ids = tokens(length)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    expected, final = DeltaRule(chunk_size=4)(*inputs, SequenceSplit(eot_id=EOT)(ids, ids)[2])
    expected.sum().backward()

    split = SequenceSplit(cp=cp, rank=rank, eot_id=EOT)
    sequence = split(ids, ids)[2]
    assert sequence is not None and sequence.positions is not None
    mine = [t[:, sequence.positions].clone().requires_grad_() for t in (q, k, v, g, beta)]
    rule = ContextParallelDeltaRule(DeltaRule(chunk_size=4), dist.group.WORLD)
    out, state = rule(*mine, sequence)
    out.sum().backward()
    torch.testing.assert_close(out, expected[:, sequence.positions].detach(), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(state, final.detach(), rtol=1e-9, atol=1e-10)  # the whole sequence's, on every rank
    for part, whole in zip(mine, inputs):
        assert part.grad is not None and whole.grad is not None
        torch.testing.assert_close(part.grad, whole.grad[:, sequence.positions], rtol=1e-9, atol=1e-10)


@pytest.mark.distributed
@pytest.mark.parametrize("blocked", [False, True], ids=["causal", "block_causal"])
@pytest.mark.parametrize("cp, length", [(2, 32), (4, 64)], ids=["cp2", "cp4"])
def test_linear_layer_under_cp_equals_one_process(cp, length, blocked):
    run_ranks(functools.partial(cp_layer_equals_one_process, length=length, blocked=blocked), cp)


@pytest.mark.distributed
def test_delta_rule_under_cp_with_a_decay_per_key_channel():
    run_ranks(functools.partial(cp_rule_with_channel_decay, length=32), 4)


def test_a_chunk_shorter_than_the_convolution_reach_is_refused_at_plan_time():
    check_cp_degree(4, 24, conv_size=4)  # chunks of 3 tokens: just enough
    with pytest.raises(ConfigError, match=r"chunks of 2 tokens, fewer than the 3 earlier inputs .*\(conv_size=4\)"):
        check_cp_degree(4, 16, conv_size=4)


def cp_mamba_equals_one_process(rank: int, length: int) -> None:
    """One rank of test_mamba2_under_cp_equals_one_process."""
    cp = dist.get_world_size()
    torch.manual_seed(0)
    whole = Mamba2(DIM, heads=4, head_dim=6, groups=2, state_dim=5, conv_size=4, chunk_size=4).double()
    with torch.no_grad():
        for name, param in whole.named_parameters():
            param.copy_(torch.randn_like(param) * (0.5 if name.startswith("conv") else 0.3))
        whole.A_log.uniform_(-1.0, 1.0)
    ids = tokens(length)
    x = torch.randn(2, length, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, length, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x_whole = x.clone().requires_grad_()
    out_whole = whole(x_whole, sequence=SequenceSplit(eot_id=EOT)(ids, ids)[2])
    (out_whole * weights).sum().backward()

    mixer = copy.deepcopy(whole)
    mixer.zero_grad()
    apply_cp(mixer, init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)))
    assert type(mixer.conv) is ContextParallelConvolution and type(mixer.scan) is ContextParallelStateScan
    sequence = SequenceSplit(cp=cp, rank=rank, eot_id=EOT)(ids, ids)[2]
    assert sequence is not None and sequence.positions is not None
    x_mine = x[:, sequence.positions].clone().requires_grad_()
    out = mixer(x_mine, sequence=sequence)
    (out * weights[:, sequence.positions]).sum().backward()
    torch.testing.assert_close(out, out_whole[:, sequence.positions].detach(), **LAYER_TOLERANCE)
    assert x_mine.grad is not None and x_whole.grad is not None
    torch.testing.assert_close(x_mine.grad, x_whole.grad[:, sequence.positions], **LAYER_TOLERANCE)
    for (name, mine), theirs in zip(mixer.named_parameters(), whole.parameters()):
        assert mine.grad is not None and theirs.grad is not None, name
        dist.all_reduce(mine.grad)
        torch.testing.assert_close(mine.grad, theirs.grad, **LAYER_TOLERANCE, msg=name)

    # The scan alone, float64 throughout, with a state handed in: outputs, the whole sequence's final state (on every
    # rank) and every input's gradient to 1e-10, plain causal and with documents.
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, length, 2, 5, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, length, 4, 6, generator=gen, dtype=torch.float64)
    g = -torch.nn.functional.softplus(torch.randn(2, length, 4, generator=gen, dtype=torch.float64) - 1.0)
    s0 = torch.randn(2, 4, 5, 6, generator=gen, dtype=torch.float64)
    for eot in (None, EOT):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, g)]
        expected, final = StateScan(chunk_size=4)(*inputs, SequenceSplit(eot_id=eot)(ids, ids)[2], s0)
        (expected.square().sum() + final.sum()).backward()
        sequence = SequenceSplit(cp=cp, rank=rank, eot_id=eot)(ids, ids)[2]
        assert sequence is not None and sequence.positions is not None
        mine = [t[:, sequence.positions].clone().requires_grad_() for t in (q, k, v, g)]
        out, state = ContextParallelStateScan(StateScan(chunk_size=4), dist.group.WORLD)(*mine, sequence, s0)
        (out.square().sum() + state.sum() / cp).backward()
        torch.testing.assert_close(out, expected[:, sequence.positions].detach(), rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(state, final.detach(), rtol=1e-9, atol=1e-10)
        for part, whole_input in zip(mine, inputs):
            assert part.grad is not None and whole_input.grad is not None
            torch.testing.assert_close(part.grad, whole_input.grad[:, sequence.positions], rtol=1e-9, atol=1e-10)


@pytest.mark.distributed
@pytest.mark.parametrize("cp, length", [(2, 32), pytest.param(4, 64, marks=pytest.mark.slow)], ids=["cp2", "cp4"])
def test_mamba2_under_cp_equals_one_process(cp, length):
    """A Mamba-2 layer whose convolution (with its bias) and SSD scan apply_cp wrapped gives, block-causal, the
    outputs and gradients (input and parameters) of one process over the whole sequence; the scan alone to 1e-10."""
    run_ranks(functools.partial(cp_mamba_equals_one_process, length=length), cp)

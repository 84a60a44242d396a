"""LR schedule shape, gradient clipping (on one mesh and across meshes), the FLOP formula and the peak table."""

import importlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers import run_ranks
from titanlite.components.metrics import (
    Throughput,
    count_params,
    device_peak_tflops,
    flops_per_token,
    format_line,
)
from titanlite.components.optim import LRSchedulers, Optimizers, clip_grad_norm_, lr_factor, warmup_cut
from titanlite.config import LRScheduler, Optimizer
from titanlite.models import registry
from titanlite.models.build import build_model
from titanlite.models.common.flops import SequenceMixer, dense_flops_per_token, matmul_parameters
from titanlite.models.common.gated_delta_net import GatedDeltaNet
from titanlite.models.common.linear_attention import gated_delta_rule_chunked


def test_warmup_then_cosine_to_min_factor():
    cfg = LRScheduler(warmup_steps=10, decay_type="cosine", min_lr_factor=0.1)
    factors = [lr_factor(s, cfg, 100) for s in range(100)]
    assert factors[0] == pytest.approx(1 / 11)
    assert all(a < b for a, b in zip(factors[:10], factors[1:11]))  # rising during warm-up
    assert factors[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))  # then falling
    halfway = 10 + 89 / 2  # steps 10 .. 99 decay, so progress 0.5 falls between steps 54 and 55
    assert lr_factor(int(halfway), cfg, 100) > 0.1 + 0.9 * 0.5 > lr_factor(int(halfway) + 1, cfg, 100)


@pytest.mark.parametrize("decay_type", ["cosine", "linear"])
@pytest.mark.parametrize("warmup, steps", [(10, 100), (10, 20), (2, 5), (0, 7), (4, 5)])
def test_the_last_step_trains_at_the_documented_minimum(decay_type, warmup, steps):
    # lr_scheduler.decay_type's doc: "down to min_lr_factor x lr at the last step" (0-based step `steps - 1`).
    cfg = LRScheduler(warmup_steps=warmup, decay_type=decay_type, min_lr_factor=0.1)
    assert lr_factor(steps - 1, cfg, steps) == pytest.approx(0.1, abs=1e-12)
    if steps - 1 > warmup:
        assert lr_factor(warmup, cfg, steps) == pytest.approx(1.0)  # the first step after warm-up is at the peak


@pytest.mark.parametrize("warmup", [3, 4, 20])
def test_a_warmup_longer_than_the_run_is_cut_to_it_and_says_so(warmup):
    # docs/configuration-guide.md: warmup = min(lr_scheduler.warmup_steps, training.steps); factor (s+1)/(warmup+1).
    cfg = LRScheduler(warmup_steps=warmup, decay_type="cosine", min_lr_factor=0.1)
    factors = [lr_factor(s, cfg, 3) for s in range(3)]
    if warmup == 3:  # as long as the run: nothing is cut, and nothing said
        assert warmup_cut(cfg, 3) is None
    else:
        assert warmup_cut(cfg, 3) == (
            f"  lr schedule: lr_scheduler.warmup_steps {warmup} is longer than training.steps 3: the warm-up is cut "
            "to 3 steps, the LR rising to 3/4 of optimizer.lr at the last step, with no decay"
        )
    assert factors == pytest.approx([1 / 4, 2 / 4, 3 / 4])
    assert warmup_cut(LRScheduler(warmup_steps=2), 3) is None


def test_the_scheduled_optimizer_steps_at_the_minimum_last():
    # What the trainer logs as `lr`: the optimizer's LR while it takes each of the run's 20 steps.
    cfg = LRScheduler(warmup_steps=10, decay_type="cosine", min_lr_factor=0.1)
    model = torch.nn.Linear(2, 2)
    optimizers = Optimizers([model], Optimizer(lr=3e-3), "cpu")
    schedulers = LRSchedulers(optimizers, cfg, total_steps=20)
    lrs = []
    for _ in range(20):
        lrs.append(optimizers.param_groups[0]["lr"])
        optimizers.step()
        schedulers.step()
    assert lrs[10] == pytest.approx(3e-3)
    assert lrs[-1] == pytest.approx(3e-4)


def test_linear_and_constant_decay():
    linear = LRScheduler(warmup_steps=0, decay_type="linear", min_lr_factor=0.0)
    assert lr_factor(0, linear, 101) == 1.0
    assert lr_factor(50, linear, 101) == pytest.approx(0.5)
    constant = LRScheduler(warmup_steps=0, decay_type="constant", min_lr_factor=0.0)
    assert lr_factor(99, constant, 100) == 1.0


def test_clip_grad_norm_returns_the_norm_before_clipping_and_clips():
    p = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    p[0].grad = torch.tensor([3.0, 0.0, 0.0])
    p[1].grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    norm = clip_grad_norm_(p, max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    assert torch.cat([q.grad for q in p]).norm().item() == pytest.approx(1.0, rel=1e-5)


def test_partial_gradients_are_summed_then_clipped_like_the_rest(tmp_path):
    """A sequence-parallel norm's gradient is Partial(sum); torch 2.11's in-place foreach multiply left such a
    gradient unscaled, so TP runs drifted from one process. Clipping sums it first: every gradient is clipped."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        norm = torch.nn.Parameter(DTensor.from_local(torch.ones(2), mesh, [Replicate()]))
        proj = torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Shard(0)]))
        norm.grad = DTensor.from_local(torch.tensor([3.0, 0.0]), mesh, [Partial()])
        proj.grad = DTensor.from_local(torch.tensor([0.0, 4.0, 0.0, 0.0]), mesh, [Shard(0)])
        total = clip_grad_norm_([norm, proj], max_norm=1.0)
        assert total.item() == pytest.approx(5.0)
        assert norm.grad.placements == (Replicate(),)
        assert norm.grad.full_tensor().tolist() == pytest.approx([0.6, 0.0], rel=1e-5)
        assert proj.grad.full_tensor().tolist() == pytest.approx([0.0, 0.8, 0.0, 0.0], rel=1e-5)
    finally:
        dist.destroy_process_group()


def test_a_family_counts_its_flops_by_its_own_formula(monkeypatch):
    # relu2 (tests/families/) names its own FLOP count in its spec; the metrics ask the spec, not a shared formula.
    # Registered in a copy of the registry, so later tests in this process see the built-in families only.
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    monkeypatch.setitem(registry._SPECS, "relu2", importlib.import_module("tests.families.relu2").SPEC)
    with torch.device("meta"):
        model = build_model("relu2", "debug", 256, 64)
    a = model.args
    own = 6.0 * (a.n_layers * 12 * a.dim**2 + a.dim * 256) + 6.0 * a.n_layers * a.dim * 64
    assert flops_per_token(model, 64) == own
    assert own != dense_flops_per_token(model, 64)


def test_flops_per_token_formula_for_gpt2_124m():
    with torch.device("meta"):
        model = build_model("gpt2", "124M", 50257, 1024)
    a = model.args
    total = count_params(model)
    embeddings = a.vocab_size * a.dim + a.max_seq_len * a.dim
    n = total - embeddings + a.vocab_size * a.dim  # tied output projection still does its matmul
    assert flops_per_token(model, 1024) == 6 * n + 12 * a.n_layers * a.dim * 1024
    # The familiar figure: ~0.87 GFLOP per token for GPT-2 small at T=1024.
    assert 0.8e9 < flops_per_token(model, 1024) < 0.9e9


def test_hybrid_flops_count_attention_at_full_layers_and_the_delta_rule_at_linear_ones():
    # Qwen3.5's debug model: 1 full-attention layer (4 heads x 16) and 3 Gated DeltaNet layers (4 value heads,
    # Dk = Dv = 16, chunks of 64). Only the full layer's term grows with T; each linear layer adds the rule's
    # 3 x H x (5 C Dk + 3 C Dv + 6 Dk Dv), whatever T.
    with torch.device("meta"):
        model = build_model("qwen3_5", "debug", 256, 4096)
    rule = 3 * 4 * (5 * 64 * 16 + 3 * 64 * 16 + 6 * 16 * 16)
    for seq in (4096, 16384):
        assert flops_per_token(model, seq) == 6 * matmul_parameters(model) + 12 * 1 * 4 * 16 * seq + 3 * rule
    # Kimi Linear's debug model: KDA's per-channel decay makes each score 7 C Dk where Gated DeltaNet's is 5 C Dk.
    with torch.device("meta"):
        kimi = build_model("kimi_linear", "debug", 256, 4096)
    a = kimi.args
    linear = a.n_layers - len(a.attention_layers())
    grows = flops_per_token(kimi, 8192) - flops_per_token(kimi, 4096)
    assert grows == 12 * (a.n_layers - linear) * a.n_heads * a.head_dim * 4096


def test_the_delta_rule_count_follows_the_chunked_kernel():
    # The forward's matmuls as torch's FLOP counter sees them in gated_delta_rule_chunked, plus the two triangular
    # solves it does not count (C^2 per column per chunk: C (Dk + Dv) per token), are a third of the formula's R.
    layer = GatedDeltaNet(64, key_heads=2, value_heads=4, key_dim=16, value_dim=32, conv_size=4)
    tokens, heads, chunk, dk, dv = 128, 4, layer.rule.chunk_size, 16, 32
    q, k = torch.randn(1, tokens, 2, dk), torch.randn(1, tokens, 2, dk)
    v, g, beta = torch.randn(1, tokens, heads, dv), -torch.rand(1, tokens, heads), torch.rand(1, tokens, heads)
    with FlopCounterMode(display=False) as counter:
        gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=chunk)
    forward = counter.get_total_flops() + tokens * heads * chunk * (dk + dv)
    assert isinstance(layer, SequenceMixer)  # so the model's count (flops.py) asks it
    assert 3 * forward == tokens * layer.sequence_flops_per_token(tokens)


def test_peak_is_unknown_on_cpu_unless_configured():
    assert device_peak_tflops(torch.device("cpu"), 0.0) is None
    assert device_peak_tflops(torch.device("cpu"), 123.0) == 123.0


def test_throughput_excludes_warmup_steps():
    t = Throughput(warmup_steps=2)
    t.add(1000, 10.0)  # slow first steps (allocation, compilation) are not counted
    t.add(1000, 10.0)
    assert t.take() is None
    t.add(1000, 1.0)
    t.add(1000, 1.0)
    assert t.take() == pytest.approx(1000.0)


def test_eta_leaves_out_warmup_steps():
    t = Throughput(warmup_steps=2)
    t.add(1000, 30.0)  # compilation and allocation: not what the remaining steps will take
    t.add(1000, 10.0)
    assert t.eta_seconds(10) is None  # nothing measured yet: shown as `eta n/a`
    t.add(1000, 1.0)
    t.add(1000, 2.0)
    assert t.eta_seconds(10) == pytest.approx(15.0)  # 10 steps at the counted mean of 1.5 s
    assert t.eta_seconds(0) == 0.0


def test_the_log_line_shows_an_unknown_eta_as_n_a():
    record = {"step": 1, "loss": 9.0, "grad_norm": 1.0, "lr": 1e-3, "tps": None, "tflops": None, "mfu_pct": None}
    line = format_line({**record, "mem_peak_gib": 1.0, "eta_s": None})
    assert line.endswith("eta n/a")
    assert format_line({**record, "mem_peak_gib": 1.0, "eta_s": 75.0}).endswith("eta 1m15s")


def test_data_wait_share_of_step_time():
    t = Throughput(warmup_steps=0)
    t.add_data_wait(0.5)
    t.add(1000, 2.0)
    t.add(1000, 2.0)
    assert t.take_data_wait_pct() == pytest.approx(12.5)
    assert t.take_data_wait_pct() is None  # reset after each log


def clip_over_two_meshes(rank: int) -> None:
    """One rank of test_clipping_takes_the_norm_over_gradients_on_different_meshes."""
    g = torch.Generator().manual_seed(0)  # the same full gradients on both ranks
    full = [torch.randn(8, 3, generator=g), torch.randn(4, 2, generator=g), torch.randn(5, generator=g)]
    shard = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    experts = init_device_mesh("cpu", (1, 2), mesh_dim_names=("ep_replicate", "ep"))
    grads = [
        distribute_tensor(full[0], shard, [Shard(0)]),
        distribute_tensor(full[1], experts, [Replicate(), Shard(0)]),
        full[2].clone(),  # a plain (replicated) gradient beside them
    ]
    params = [torch.nn.Parameter(torch.zeros_like(grad)) for grad in grads]
    for p, grad in zip(params, grads):
        p.grad = grad
    expected = torch.cat([f.flatten() for f in full]).norm()

    # One mesh: torch's own norm over all of them, bit for bit.
    assert torch.equal(clip_grad_norm_(params[:1], 0.0), torch.nn.utils.get_total_norm(grads[:1]).full_tensor())
    total = clip_grad_norm_(params, max_norm=1.0)
    assert not isinstance(total, DTensor)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    scale = 1.0 / (expected + 1e-6)  # clip_grads_with_norm_'s factor, the same on every mesh
    clipped = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params]
    for after, before in zip(clipped, full):
        torch.testing.assert_close(after, before * scale, rtol=1e-6, atol=0)
    assert torch.cat([c.flatten() for c in clipped]).norm().item() == pytest.approx(1.0, rel=1e-5)


@pytest.mark.distributed
def test_clipping_takes_the_norm_over_gradients_on_different_meshes():
    """Experts' gradients live on their own mesh: gradients sharded over a 1-D mesh of both ranks, over a 2-D
    mesh with other dimension names, and a plain tensor give the norm of all the full gradients put together
    (2 gloo processes), and clipping scales every one of them by the same factor."""
    run_ranks(clip_over_two_meshes)

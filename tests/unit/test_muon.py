"""Muon (titanlite/components/muon.py) on one device against torch.optim.Muon: the same updates where both define
them (2-D matrices, every option), and a stack of experts' matrices as those matrices one by one."""

import pytest
import torch

from titanlite.components.muon import Muon


def steps(optimizer_type, params: list[torch.Tensor], grads: list[list[torch.Tensor]], **options) -> list:
    """The parameters after one step per entry of `grads` (one gradient per parameter each)."""
    params = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = optimizer_type(params, **options)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in params]


def gradients(shapes, n_steps: int = 3, seed: int = 0) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(n_steps)]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"nesterov": False, "weight_decay": 0.0, "momentum": 0.9},
        {"adjust_lr_fn": "match_rms_adamw", "lr": 0.02},
    ],
)
def test_matrices_update_as_torch_optim_muon(options):
    shapes = [(24, 40), (40, 24), (32, 32)]  # wide, tall (orthogonalised transposed), square
    params = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(shapes)]
    grads = gradients(shapes)
    ours_options = {k if k != "adjust_lr_fn" else "adjust_lr": v for k, v in options.items()}
    ours = steps(Muon, params, grads, **ours_options)
    theirs = steps(torch.optim.Muon, params, grads, **options)
    for a, b, before in zip(ours, theirs, params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert not torch.equal(a, before)  # they moved


def test_a_stack_of_experts_updates_as_its_matrices_one_by_one():
    """[E, A, B]: each expert's matrix orthogonalised and its learning rate adjusted by A x B, as torch.optim.Muon
    does for E separate matrices (which it takes; it refuses the stack)."""
    stack = torch.randn(4, 48, 16, generator=torch.Generator().manual_seed(3))
    grads = gradients([(4, 48, 16)])
    ours = steps(Muon, [stack], grads, adjust_lr="match_rms_adamw", lr=0.01)[0]
    theirs = steps(torch.optim.Muon, list(stack), [list(g[0]) for g in grads], adjust_lr_fn="match_rms_adamw", lr=0.01)
    torch.testing.assert_close(ours, torch.stack(theirs), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        steps(torch.optim.Muon, [stack], grads)


def test_a_vector_is_refused_naming_where_it_belongs():
    with pytest.raises(ValueError, match=r"a parameter of shape \(16,\) belongs with AdamW"):
        Muon([torch.nn.Parameter(torch.zeros(16))])

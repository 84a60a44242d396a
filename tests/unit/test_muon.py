"""Muon (titanlite/components/muon.py) on one device against torch.optim.Muon: the same updates where both define
them (2-D matrices, every option), and a stack of experts' matrices as those matrices one by one; which parameters a
Muon run hands to Muon, the refusal of a vector named into its group, and a skipped (non-finite) step."""

import pytest
import torch

from tests.helpers import titanlite_here
from titanlite.base.errors import ConfigError
from titanlite.builder.model import plain_model
from titanlite.builder.plan import plan_model
from titanlite.components.muon import Muon, check_muon_params, muon_parameters
from titanlite.components.optim import Optimizers
from titanlite.components.resume import flat_config, resume_changes
from titanlite.config import Optimizer, parse_config


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


class Tiny(torch.nn.Module):
    """An embedding, one block's linear weight (Muon's), its bias and a norm (AdamW's)."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(10, 8)
        self.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(8, 16)})
        self.norm = torch.nn.LayerNorm(16)


def tiny_optimizers(model: torch.nn.Module) -> Optimizers:
    cfg = Optimizer(name="Muon", muon_lr=0.02, lr=1e-2)
    return Optimizers([model], cfg, "cpu", skip_nonfinite=True)


def set_grads(model: torch.nn.Module, value: float | None = None, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) if value is None else torch.full_like(p, value)


def test_a_muon_run_steps_the_hidden_matrices_with_muon_and_the_rest_with_adamw():
    model = Tiny()
    optimizers = tiny_optimizers(model)
    adamw, muon = optimizers.optimizers
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, Muon)
    assert [p for g in muon.param_groups for p in g["params"]] == [model.layers["0"].weight]
    assert len([p for g in adamw.param_groups for p in g["params"]]) == 4  # embedding, bias, norm's two
    assert optimizers.by_part == [[adamw, muon]]


def test_skip_update_if_leaves_weights_and_momenta_of_a_bad_step_as_they_were():
    """found_inf = 1 (a non-finite gradient): Muon's weights and momentum buffers stay, decided on the device, as
    the fused AdamW's do; found_inf = 0 steps exactly as a step without the flag."""
    model, twin = Tiny(), Tiny()
    twin.load_state_dict(model.state_dict())
    optimizers, plain = tiny_optimizers(model), tiny_optimizers(twin)
    set_grads(model), set_grads(twin)
    optimizers.skip_update_if(torch.tensor(False))
    optimizers.step()
    plain.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    muon = optimizers.optimizers[1]
    momentum = muon.state[model.layers["0"].weight]["momentum_buffer"].clone()
    set_grads(model, float("nan"))
    optimizers.skip_update_if(torch.tensor(True))
    optimizers.step()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert torch.equal(muon.state[model.layers["0"].weight]["momentum_buffer"], momentum)


def test_the_default_muon_parameters_are_the_blocks_matrices_and_experts_but_not_routers():
    cfg = parse_config(["--config", "train_configs/qwen3_moe_debug.toml", "--model.tokenizer", "byte"])
    with torch.device("meta"):
        model = plain_model(cfg, plan_model(cfg))
    names = {n for n, _ in muon_parameters(model, [])}
    assert "layers.0.attention.wq.weight" in names and "layers.0.feed_forward.experts.w1" in names
    assert "layers.1.feed_forward.w2.weight" in names
    assert not {n for n in names if "router" in n or "norm" in n or not n.startswith("layers.")}
    assert len(names) == 4 * 4 + 3 * 3 + 3  # attention's 4 per block, 3 MoE blocks' 3 stacks, the dense block's 3


def test_muon_params_naming_a_vector_is_one_line_before_launch(tmp_path):
    proc = titanlite_here(
        "check", "--config", "train_configs/qwen3_moe_debug.toml", "--model.tokenizer", "byte", "--optimizer.name",
        "Muon", "--optimizer.muon_params", "layers.*", "--job.dump_folder", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    message = "optimizer.muon_params names layers.0.attention_norm.weight of shape (64,), which Muon cannot"
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())


def test_a_muon_params_glob_that_matches_nothing_is_refused():
    with pytest.raises(ConfigError, match="optimizer.muon_params glob 'layers.*.mlp.*' matches no parameter"):
        check_muon_params(Tiny(), ["layers.*.weight", "layers.*.mlp.*"])
    check_muon_params(Tiny(), ["layers.*.weight"])


def test_a_resume_that_changes_the_optimizers_kind_is_refused_unless_its_state_is_left_out():
    """An AdamW checkpoint holds two moments per parameter, a Muon run needs a momentum per hidden matrix: refused
    with the key and both values, unless checkpoint.exclude_from_loading leaves the optimizer's state out."""
    adamw, muon = parse_config([]), parse_config(["--optimizer.name", "Muon"])
    facts = {"model": {"dim": 64}, "tokenizer": "t", "windows": 100}
    with pytest.raises(ConfigError, match="optimizer.name='Muon' differs from the 'AdamW' that step-3 was saved with"):
        resume_changes(flat_config(adamw), facts, muon, facts, set(), "step-3")
    assert resume_changes(flat_config(adamw), facts, muon, facts, {"optimizer"}, "step-3") == [
        "optimizer.name 'AdamW' -> 'Muon'"
    ]
    narrowed = parse_config(["--optimizer.name", "Muon", "--optimizer.muon_params", "layers.*.attention.*.weight"])
    with pytest.raises(ConfigError, match="optimizer.muon_params=.* differs from the \\[\\]"):
        resume_changes(flat_config(muon), facts, narrowed, facts, set(), "step-3")

"""Each module starts its own parameters (init_own), found from the parameter's name (models/common/init.py
start_param): through activation checkpointing's and compile's wrappers, with the name below the module, and a
KeyError for a parameter no module knows."""

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from titanlite.models.build import build_model
from titanlite.models.common.decoder import Transformer
from titanlite.models.common.init import init_weights
from titanlite.models.common.init_scheme import InitScheme

# torch.compile loads dynamo, whose import of torch.utils.mkldnn defines TorchScript classes that torch itself warns
# about (torch's own modules, once per process); the wrapping is what this file tests, not TorchScript.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): p.detach().clone()
        for name, p in model.named_parameters()
    }


@pytest.mark.parametrize("name", ["llama3", "gemma3", "qwen3_5"])
def test_wrapped_blocks_start_as_plain_ones(name):
    """Activation checkpointing and compile wrap the blocks (parallelize's order): the weights stay the same."""
    plain, wrapped = build_model(name, "debug", 256, 32), build_model(name, "debug", 256, 32)
    for key, block in list(wrapped.layers.items()):
        wrapper = checkpoint_wrapper(block, preserve_rng_state=False)
        wrapped.layers.register_module(key, torch.compile(wrapper) if key == "0" else wrapper)
    init_weights(plain, 0)
    init_weights(wrapped, 0)
    ours, theirs = weights(wrapped), weights(plain)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


class Doubler(nn.Module):
    """A toy mixer with a parameter of its own, started at 2."""

    def __init__(self, dim: int):
        super().__init__()
        self.gain = nn.Parameter(torch.empty(dim))
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos=None, sin=None, cache=None, sequence=None):
        return self.proj(x * self.gain)

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        if name == "gain":
            full.fill_(2.0)
        elif name == "proj.weight":
            scheme.residual(full, generator)
        else:
            raise KeyError(name)


class WithDoubler(Transformer):
    mixers = {"full_attention": lambda model, layer: Doubler(model.args.dim)}


def test_a_new_mixer_starts_its_own_parameters():
    """A mixer's init_own gets the names below it, and the model's scheme (depth-scaled for a residual side)."""
    args = build_model("llama3", "debug", 256, 32).args
    model = WithDoubler(args)
    init_weights(model, 0)
    assert torch.all(model.layers["1"].attention.gain == 2.0)
    bound = 2 * 0.02 / (2 * args.n_layers) ** 0.5
    assert model.layers["0"].attention.proj.weight.abs().max() <= bound
    with pytest.raises(KeyError, match="layers.0.attention.scale"):
        model.init_param("layers.0.attention.scale.weight", torch.empty(1), torch.Generator())

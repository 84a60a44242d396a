"""Expert tensor parallelism's refusals (parallelism.expert_tensor_parallel_degree): one line each, before launch.
Its parity with one process runs in tests/distributed/test_deepseek_v3.py (TP x 2 and EP 2 x TP 2, experts split)."""

import dataclasses

import pytest

from tests.helpers import titanlite_here
from titanlite.base.errors import ConfigError
from titanlite.builder.plan import plan_run
from titanlite.config import parse_config
from titanlite.models.registry import spec_named
from titanlite.parallel.expert_tensor_parallel import check_etp_degree

ETP, TP = "--parallelism.expert_tensor_parallel_degree", "--parallelism.tensor_parallel_degree"
DEEPSEEK = ["--config", "train_configs/deepseek_v3_debug.toml"]

REFUSALS = [
    (2, [*DEEPSEEK, TP, "2", ETP, "4"], "parallelism.expert_tensor_parallel_degree=4 must be 1 (experts whole on "
     "each tensor-parallel rank) or tensor_parallel_degree=2 (each expert split over them); use 1 or 2"),
    (2, [*DEEPSEEK, ETP, "2"], "parallelism.expert_tensor_parallel_degree=2 must be 1 (experts whole on each "
     "tensor-parallel rank) or tensor_parallel_degree=1 (each expert split over them); use 1"),
    (8, [*DEEPSEEK, TP, "2", ETP, "2", "--parallelism.expert_parallel_degree", "2",
         "--parallelism.context_parallel_degree", "2"],
     "parallelism.expert_tensor_parallel_degree=2 beside expert_parallel_degree=2 and context_parallel_degree=2 "
     "is not supported (the experts' mesh would be 3-D); set one of them to 1"),
    (2, ["--model.name", "llama3", TP, "2", ETP, "2"], "parallelism.expert_tensor_parallel_degree=2 splits "
     "mixture-of-experts blocks, but model llama3 has none; set it to 1"),
    (2, ["--config", "train_configs/gpt_oss_debug.toml", TP, "2", ETP, "2"], "parallelism.expert_tensor_parallel_"
     "degree=2 cannot split the gpt_oss experts' down-projection biases (each rank's partial output would add "
     "them once more); set it to 1"),
]  # fmt: skip


@pytest.mark.parametrize("world, args, message", REFUSALS)
def test_an_impossible_expert_tensor_parallel_degree_is_refused_before_launch(world, args, message):
    with pytest.raises(ConfigError) as e:
        plan_run(parse_config(args), world)
    assert str(e.value) == message


def test_a_degree_that_does_not_divide_the_expert_widths_is_refused_naming_them():
    """The routed experts' width and the shared experts' are both named where neither divides."""
    args = spec_named("deepseek_v3").flavors["debug"]
    odd = dataclasses.replace(args, moe=dataclasses.replace(args.moe, expert_dim=30))
    with pytest.raises(ConfigError) as e:
        check_etp_degree(4, odd, "deepseek_v3")
    assert str(e.value) == (
        "parallelism.expert_tensor_parallel_degree=4 does not divide the deepseek_v3 experts' expert_dim=30 and the "
        "shared experts' width=30; use 1 or a tensor_parallel_degree that divides it"
    )
    check_etp_degree(2, odd, "deepseek_v3")  # 30 and the shared width divide by 2


def test_titanlite_check_refuses_it_in_one_line_with_exit_2():
    world, args, message = REFUSALS[0]
    proc = titanlite_here("check", "--world-size", str(world), *args)
    assert proc.returncode == 2 and proc.stderr == f"titanlite: error: {message}\n", proc.stderr

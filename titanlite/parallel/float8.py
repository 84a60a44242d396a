"""Float8 training through torchao: the linear layers of the transformer blocks run their matmuls in float8.

torchao swaps each chosen `nn.Linear` for a `Float8Linear` that casts its input, weight and output
gradient to float8 with dynamic scales (per tensor for the 'tensorwise' recipe, per row for 'rowwise')
and keeps the weight itself, its gradient and the optimizer state in high precision, so the parameter
names and checkpoints are the same as without float8. Under FSDP2 with the tensorwise recipe the weights
can also be all-gathered in float8 (half the bytes of bf16), with their scales computed for all
parameters at once after each optimizer step.

The swap replaces modules, so it runs on the meta model before any parallelism registers hooks on them;
the tensor-parallel plan then shards the Float8Linear layers like any linear layer, gathering activations
in high precision. (torchao's float8 tensor-parallel styles, which gather them in float8, cannot run on
gloo, which has no float8 concatenation, so they wait for a test on GPUs.)
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util

import torch
import torch.nn as nn

from titanlite.base.devices import uses_cuda
from titanlite.base.errors import ConfigError
from titanlite.base.logs import quieted
from titanlite.config import Float8
from titanlite.models.common.head import OutputHead

INSTALL_HINT = "pip install '.[float8]' (or pip install torchao) in the environment that runs titanlite"


def torchao_float8():
    """The torchao.float8 module, or a ConfigError saying how to install it."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            f"float8.enable needs torchao, which is not installed; {INSTALL_HINT}, or set float8.enable = false"
        )
    try:
        with quieted():
            import torchao.float8 as float8  # optional dependency (the [float8] extra)
    except Exception as e:  # a torchao built for another torch fails here, not at find_spec
        raise ConfigError(
            f"float8.enable: torchao is installed but does not import ({type(e).__name__}: {e}); "
            f"install a torchao release built for torch {torch.__version__}, or set float8.enable = false"
        ) from None
    return float8


def check_float8(cfg: Float8) -> None:
    """Refuse, before anything starts, a float8 run that cannot work here."""
    if not cfg.enable:
        return
    torchao_float8()
    if uses_cuda() and not cfg.emulate:
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise ConfigError(
                f"float8.enable: this GPU (compute capability {major}.{minor}) has no float8 matmuls (they need 8.9+: "
                "H100, H200, L4, RTX 40xx); set float8.emulate = true to run float8 numerics in high precision (no "
                "speed-up)"
            )


def check_float8_filter(model: nn.Module, filter_fqns: list[str], family: str) -> None:
    """Refuse a float8.filter_fqns entry that is part of no linear layer's name of the model (float8_filter's
    test): it would keep nothing in high precision, without a word. Names the closest parts of the real names."""
    linears = [fqn for fqn, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name in filter_fqns:
        if any(name in fqn for fqn in linears):
            continue
        # each name's parts, and what follows its layer index ('attention.wq' of layers.0.attention.wq)
        parts: set[str] = set()
        for fqn in linears:
            words = fqn.split(".")
            parts.update(w for w in words if not w.isdigit())
            index = max((i for i, w in enumerate(words) if w.isdigit()), default=-1)
            parts.add(".".join(words[index + 1 :]))
        close = difflib.get_close_matches(name, sorted(parts), n=3, cutoff=0.5)
        hint = (
            f"did you mean {' or '.join(repr(c) for c in close)}?"
            if close
            else f"its linear layers are named like {', '.join(linears[:3])}"
        )
        raise ConfigError(
            f"float8.filter_fqns names {name!r}, which is part of no linear layer's name in model {family} (it would "
            f"keep nothing in high precision); {hint} Fix it or remove it"
        )


def float8_filter(filter_fqns: list[str], tp: int):
    """Which linear layers to convert: not those whose name contains one of filter_fqns, and not those
    whose (tensor-parallel local) dimensions are not multiples of 16, which float8 matmuls require."""

    def convert(module: nn.Module, fqn: str) -> bool:
        if (
            not isinstance(module, nn.Linear)
            or isinstance(module, OutputHead)  # the losses apply it in high precision (chunked: its weight)
            or fqn.endswith("router.gate")  # an MoE router's scores choose the experts: kept exact, as TorchTitan does
            or any(part in fqn for part in filter_fqns)
        ):
            return False
        out_features, in_features = module.weight.shape
        return all(size % (16 * tp) == 0 for size in (out_features, in_features))

    return convert


def apply_float8(model: nn.Module, cfg: Float8, *, fsdp: bool, tp: int) -> None:
    """Swap the chosen linear layers of a meta-device model for torchao's Float8Linear."""
    if not cfg.enable:
        return
    float8 = torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(cfg.recipe)
    config = dataclasses.replace(
        config,
        emulate=cfg.emulate,
        enable_fsdp_float8_all_gather=fsdp_float8_all_gather(cfg, fsdp),
    )
    float8.convert_to_float8_training(model, config=config, module_filter_fn=float8_filter(cfg.filter_fqns, tp))


def fsdp_float8_all_gather(cfg: Float8, fsdp: bool) -> bool:
    """torchao all-gathers float8 weights for the tensorwise recipe only."""
    return cfg.enable and cfg.fsdp_float8_all_gather and fsdp and cfg.recipe == "tensorwise"


class Float8ScalePrecompute:
    """After each optimizer step, compute the float8 scales of all FSDP-sharded weights in one
    all-reduce instead of one per weight in the next forward (only with float8 all-gather)."""

    def __init__(self, parts: list[nn.Module], cfg: Float8, fsdp: bool):
        self.parts = parts if fsdp_float8_all_gather(cfg, fsdp) else []

    def __call__(self, step: int) -> None:
        if self.parts:
            precompute = torchao_float8().precompute_float8_dynamic_scale_for_fsdp
            for part in self.parts:
                precompute(part)

    def __bool__(self) -> bool:
        return bool(self.parts)


def describe_float8(cfg: Float8, parts: list[nn.Module], device: torch.device, fsdp: bool) -> str:
    """One log line: what runs in float8, and a warning where it cannot be faster."""
    names = [name for part in parts for name, m in part.named_modules() if type(m).__name__ == "Float8Linear"]
    line = f"  float8: {len(names)} linear layers in float8 ({cfg.recipe}"
    line += ", FSDP all-gathers weights in float8)" if fsdp_float8_all_gather(cfg, fsdp) else ")"
    line += f"; kept in high precision: {', '.join(cfg.filter_fqns) or 'none'} and any layer not a multiple of 16"
    if device.type != "cuda":
        line += "\n  warning: float8 on the CPU runs for correctness only and gives no speed-up"
    elif cfg.emulate:
        line += "\n  warning: float8.emulate runs float8 numerics in high precision and gives no speed-up"
    return line

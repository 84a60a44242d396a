"""The family conformance harness: what every family's tests check against `transformers`, each check one function
here, so that a family's test file holds only its data (the random model's shape, the cases, its class name) and
what only that family has.

- `random_hf`: a transformers model of a family, its weights moved off their init (so that a weight dropped or
  transposed on import changes the logits), seeded, in eval mode.
- `imports_with_its_logits`: the model saved as a folder, imported as a run does (model.flavor = "hf"), gives
  transformers' logits to 1e-5 of their scale (fp32).
- `greedy_ids_match`: `titanlite generate`'s greedy continuation equals transformers' `generate`.
- `trained`: one of our flavors after a few AdamW steps (so norms and biases leave their initial ones and zeros).
- `exports_as`: that model saved as a folder loads in transformers as the family's class, with our logits, and its
  config.json reads back as our arguments.

The published shapes' parameter counts against transformers' are one test over every family's flavors
(tests/unit/test_hf_families.py `test_a_published_shape_counts_transformers_parameters`); the debug configs' steps
and layouts are tests/distributed/test_model_families.py and each family's distributed tests. The checks run in
the test's own process (no process is started here): a whole family's checks cost about a second on a laptop CPU.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from titanlite.components.hf_weights import load_hf_into, save_hf
from titanlite.config import parse_config
from titanlite.engine.decoding import generate
from titanlite.models.build import configured_model, model_from_args
from titanlite.models.common.init import init_weights
from titanlite.models.hf_config import args_from_hf_config, folder_args

RTOL = 1e-5  # of the largest |logit|: fp32 sums in another order


def random_hf(
    build: Callable[[], Any],
    scale: float = 0.05,
    buffers: Callable[[str], bool] | None = None,
    moved: Callable[[str], bool] | None = None,
) -> Any:
    """`build()` (a transformers model), seeded with 0, every parameter moved by `scale` x N(0, 1) (norms and biases
    too); `buffers(name)`: the buffers to move too (routing biases that start at zero), by 0.1 x N(0, 1); `moved(name)`:
    the parameters to move, where not every one (the others keep transformers' init)."""
    torch.manual_seed(0)
    model = build()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if moved is None or moved(name):
                p.add_(torch.randn_like(p) * scale)
        for name, b in model.named_buffers():
            if buffers is not None and buffers(name):
                b.copy_(torch.randn_like(b) * 0.1)
    return model.eval()


def imported(folder: Path, seq_len: int = 64, *options: str) -> torch.nn.Module:
    """The folder's model built and filled as a run does (model.flavor = "hf"), on the CPU; `options`: more
    command-line settings."""
    folder_flags = ["--model.flavor", "hf", "--model.hf_assets_path", str(folder), "--model.tokenizer", "byte"]
    cfg = parse_config([*folder_flags, "--training.seq_len", str(seq_len), *options])
    model = configured_model(cfg.model, 257, seq_len)
    load_hf_into([model], folder)
    return model.eval()


def imported_by_config(folder: Path, seq_len: int = 64) -> torch.nn.Module:
    """The folder's model from its config.json alone (its own vocabulary, no tokenizer: for folders whose ids the
    byte tokenizer does not cover), filled from its weights, on the CPU."""
    model = model_from_args(folder_args(folder, seq_len))
    load_hf_into([model], folder)
    return model.eval()


def assert_logits_match(ours: torch.Tensor, theirs: torch.Tensor, rtol: float = RTOL) -> None:
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() <= rtol * scale, ((ours - theirs).abs().max() / scale).item()


def tokens(vocab: int, shape: tuple[int, ...] = (2, 48), seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def imports_with_its_logits(
    hf: Any, folder: Path, batch: torch.Tensor, seq_len: int = 64, options: tuple[str, ...] = ()
) -> torch.nn.Module:
    """`hf` saved into `folder` and imported at `seq_len` (`options`: more settings): our logits on `batch` are
    transformers'; our model."""
    hf.save_pretrained(folder)
    ours = imported(folder, seq_len, *options)
    with torch.no_grad():
        assert_logits_match(ours(batch), hf(batch).logits)
    return ours


def greedy_ids_match(
    hf: Any, ours: torch.nn.Module, prompt: list[int], new: int, vocab: int, distinct: int = 0
) -> None:
    """Our greedy continuation of `prompt` (`new` tokens, among `vocab` ids) is transformers'; `distinct`: where
    given, it holds more than that many different ids (not one id over and over)."""
    result = generate(ours, prompt, max_new_tokens=new, vocab_size=vocab)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert result.new_ids == theirs[0, len(prompt) :].tolist()
    assert not distinct or len(set(result.new_ids)) > distinct, result.new_ids


def trained(
    args: Any,
    steps: int = 3,
    length: int = 33,
    after_step: Callable[[torch.nn.Module], None] | None = None,
) -> tuple[torch.nn.Module, torch.Tensor]:
    """Our model of `args` (vocab 320), initialised as a run does, after `steps` AdamW steps at lr 1e-2 on 4 random
    sequences of `length` tokens (`after_step(model)` after each: a family's own update, as bias balancing), in
    eval mode; and those sequences, on which to compare logits."""
    model = model_from_args(args)
    init_weights(model, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = tokens(320, (4, length), seed=3)
    for _ in range(steps):
        logits = model(batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(model)
    return model.eval(), batch


def exports_as(
    ours: torch.nn.Module,
    args: Any,
    folder: Path,
    hf_class: str,
    batch: torch.Tensor,
    model_type: str = "",
    reads_back: Any = None,
) -> Any:
    """`ours` (of `args`) saved into `folder`: transformers loads it as `hf_class` (of `model_type`, where given)
    with our logits on `batch`, and its config.json reads back as `args` (as `reads_back`, where given: a family
    whose config.json one reader shares with another); the loaded model."""
    import transformers

    save_hf(folder, args, ours.state_dict())
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == hf_class
    written = json.loads((folder / "config.json").read_text())
    assert written["model_type"] == (model_type or hf.config.model_type)
    with torch.no_grad():
        assert_logits_match(ours(batch), hf(batch).logits)
    expected = args if reads_back is None else reads_back
    assert args_from_hf_config(written) == expected
    assert args_from_hf_config(hf.config.to_dict()) == expected
    return hf


def debug_args(flavors: dict[str, Any], **changes: Any) -> Any:
    """A family's debug flavor at vocab 320 and 64 positions (what `trained` and `exports_as` take)."""
    return dataclasses.replace(flavors["debug"], vocab_size=320, max_seq_len=64, **changes)

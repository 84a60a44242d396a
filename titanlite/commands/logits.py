"""`titanlite logits`: a prompt's next-token logits from a run's checkpoint or a Hugging Face folder, the top K ids
at the last position (or every position), in float32 on the CPU; for a Hugging Face folder, beside transformers'
logits for the same folder and ids, with the largest difference over every position and id and where it is.

What an import is checked with: the same ids go through both models, so a difference is the models', never the
tokenizers'. The comparison is on by default where it can be made (the source is a Hugging Face folder and
transformers is installed); `--no-compare` leaves it out, `--compare` insists (one line and exit 2 where it cannot
be made). A folder that transformers cannot load is one line too, not a traceback."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from titanlite.base.command_line import take_options
from titanlite.base.errors import ConfigError
from titanlite.base.logs import quieted
from titanlite.commands.generate import load_model
from titanlite.components.checkpoint import checkpoint_to_load, parse_run_config
from titanlite.data.tokenizer import Tokenizer, build_tokenizer

OPTIONS = {
    "prompt": "",
    "top": 5,  # how many ids each printed position lists
    "all-positions": False,  # print every position's top ids, not only the last's
    "compare": False,  # insist on transformers' logits beside ours (one line where they cannot be had)
    "no-compare": False,  # titanlite's logits alone, even for a Hugging Face folder
}
INSTALL_HINT = "pip install '.[hf]' (or pip install transformers)"
TOKEN_WIDTH = 14  # characters of a token's text shown (its repr, cut)


@dataclass
class Difference:
    """The largest |titanlite - transformers| over every position and id, where it is, and both values there."""

    value: float
    position: int
    token: int
    ours: float
    theirs: float


def largest_difference(ours: torch.Tensor, theirs: torch.Tensor) -> Difference:
    """Over logits [T, V] of the same ids (the ids both models have, should their vocabularies differ)."""
    vocab = min(ours.shape[-1], theirs.shape[-1])
    ours, theirs = ours[:, :vocab], theirs[:, :vocab]
    diff = (ours - theirs).abs()
    diff = torch.where(torch.isnan(diff), torch.inf, diff)  # a NaN on one side is the worst difference there is
    position, token = divmod(int(diff.argmax()), vocab)
    return Difference(
        float(diff[position, token]), position, token, float(ours[position, token]), float(theirs[position, token])
    )


def top_ids(logits: torch.Tensor, k: int, vocab_size: int) -> list[tuple[int, float]]:
    """The k largest of one position's logits [V] as (id, logit), among the tokenizer's ids only (the columns past
    vocab_size pad the embedding and no tokenizer decodes them)."""
    values, ids = torch.topk(logits[:vocab_size], min(k, vocab_size))
    return list(zip(ids.tolist(), values.tolist()))


# ---- transformers -----------------------------------------------------------------------------------------------


def why_no_comparison(path: Path, opts: dict) -> str | None:
    """Why transformers' logits are not printed beside ours (None: they are), or a ConfigError where --compare
    insists and they cannot be."""
    if opts["no-compare"]:
        return "--no-compare"
    if not (path / "config.json").is_file():
        why = f"{path} is a titanlite checkpoint, not a Hugging Face folder"
        if opts["compare"]:
            raise ConfigError(
                f"logits --compare needs a Hugging Face folder, and {why}; export it with `titanlite convert to-hf "
                "--output DIR` and compare DIR, or leave --compare out"
            )
        return why
    if importlib.util.find_spec("transformers") is None:
        if opts["compare"]:
            raise ConfigError(f"logits --compare needs transformers, which is not installed; {INSTALL_HINT}")
        return f"transformers is not installed; {INSTALL_HINT} to compare"
    return None


def transformers_logits(folder: Path, ids: list[int]) -> tuple[torch.Tensor, str]:
    """transformers' logits [T, V] of ids for the folder, in float32 on the CPU, offline, and its model's class."""
    try:
        with quieted():
            import transformers  # the optional [hf] extra: only a comparison needs it (seconds to import)
    except Exception as e:  # installed is not enough: one built for another torch fails here
        raise ConfigError(
            f"transformers is installed but does not import ({_first_line(e)}); {INSTALL_HINT}, or add --no-compare"
        ) from None
    transformers.utils.logging.disable_progress_bar()  # a bar for reading a folder's weights says nothing here
    try:
        with quieted():  # its integrations import torchao (and its warnings) as the model is built
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=torch.float32, local_files_only=True
            )
    except Exception as e:  # whatever transformers raises for a folder it cannot read: one line, not its traceback
        raise ConfigError(
            f"transformers {transformers.__version__} cannot load {folder} ({_first_line(e)}); add --no-compare "
            "for titanlite's logits alone"
        ) from None
    with torch.inference_mode():
        logits = model.eval()(torch.tensor([ids])).logits[0].float()
    return logits, type(model).__name__


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


# ---- the command ------------------------------------------------------------------------------------------------


def check_options(opts: dict) -> None:
    if opts["compare"] and opts["no-compare"]:
        raise ConfigError("logits takes --compare or --no-compare, not both; leave one out")
    if not opts["prompt"]:
        raise ConfigError("logits needs a non-empty --prompt TEXT")


def main(argv: list[str]) -> int:
    opts, rest = take_options(argv, OPTIONS, "logits", at_least={"top": 1})
    check_options(opts)
    cfg = parse_run_config(rest)  # the model the checkpoint was trained as, without its flags repeated
    tokenizer = build_tokenizer(cfg.model.tokenizer, cfg.model.hf_assets_path)
    # As generate: a tokenizer with a BOS id starts every training document with it, so the prompt too.
    ids = ([] if tokenizer.bos_id is None else [tokenizer.bos_id]) + tokenizer.encode(opts["prompt"])
    path = checkpoint_to_load(cfg, "read the logits of")
    skip = why_no_comparison(path, opts)
    model, source = load_model(cfg, tokenizer, path)
    if len(ids) > model.args.max_seq_len:
        raise ConfigError(
            f"logits --prompt is {len(ids)} tokens but the model's context is {model.args.max_seq_len} (max_seq_len); "
            "use a shorter prompt"
        )
    with torch.inference_mode():
        ours = model.eval()(torch.tensor([ids]))[0].float()  # [T, V]: float32 weights on the CPU
    del model  # one model in memory at a time: transformers' is loaded next
    theirs, hf_class = transformers_logits(path, ids) if skip is None else (None, "")
    beside = f", beside transformers' ({hf_class})" if skip is None else f" (no comparison: {skip})"
    print(f"titanlite: logits of {source} on cpu (float32){beside}; the prompt is {len(ids)} tokens")
    positions = range(len(ids)) if opts["all-positions"] else [len(ids) - 1]
    agree = [print_position(p, ids, ours, theirs, opts["top"], tokenizer) for p in positions]
    if theirs is not None:
        print_comparison(ours, theirs, agree, positions, opts["top"], tokenizer)
    return 0


def shown(tokenizer: Tokenizer, token: int) -> str:
    """A token's text as Python writes a string, cut to TOKEN_WIDTH; an id past the tokenizer's pads the embedding."""
    if token >= tokenizer.vocab_size:
        return "(padding)"
    text = repr(tokenizer.decode([token]))
    return text if len(text) <= TOKEN_WIDTH else text[: TOKEN_WIDTH - 4] + "...'"


def print_position(
    position: int, ids: list[int], ours: torch.Tensor, theirs: torch.Tensor | None, k: int, tokenizer: Tokenizer
) -> bool:
    """One position's top k ids, ours (and transformers' beside them); whether both list the same ids in order."""
    vocab = tokenizer.vocab_size
    print(f"position {position} (id {ids[position]} {shown(tokenizer, ids[position])}), the next token's top {k}:")
    columns = [top_ids(logits[position], k, vocab) for logits in (ours, theirs) if logits is not None]
    if theirs is not None:
        print(f"{'':6}{'titanlite':<{TOKEN_WIDTH + 26}}transformers")
    for rank, row in enumerate(zip(*columns), start=1):
        cells = [f"{token:>7} {shown(tokenizer, token):<{TOKEN_WIDTH}} {logit:>12.6f}" for token, logit in row]
        print(f"  {rank:>2}." + "     ".join(cells))
    return len(columns) == 1 or [t for t, _ in columns[0]] == [t for t, _ in columns[1]]


def print_comparison(
    ours: torch.Tensor, theirs: torch.Tensor, agree: list[bool], positions: range | list[int], k: int, tokenizer
) -> None:
    """The largest difference, where it is, and the positions whose top k ids differ (print_position's `agree`)."""
    d = largest_difference(ours, theirs)
    n, vocab = ours.shape[0], min(ours.shape[-1], theirs.shape[-1])
    print(
        f"titanlite: largest |titanlite - transformers| over {n} position{'s' if n > 1 else ''} x {vocab} ids: "
        f"{d.value:.3g} at position {d.position}, id {d.token} {shown(tokenizer, d.token)} (titanlite {d.ours:.6f}, "
        f"transformers {d.theirs:.6f})"
    )
    if ours.shape[-1] != theirs.shape[-1]:
        print(f"titanlite: titanlite gives {ours.shape[-1]} ids, transformers {theirs.shape[-1]}: compared {vocab}")
    differ = [p for p, same in zip(positions, agree) if not same]
    where = "the printed position" if len(agree) == 1 else f"all {len(agree)} printed positions"
    print(
        f"titanlite: the top {k} ids agree, in order, at {where}"
        if not differ
        else f"titanlite: the top {k} ids differ at position(s) {', '.join(map(str, differ))}"
    )

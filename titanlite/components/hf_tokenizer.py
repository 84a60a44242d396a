"""Write a titanlite tokenizer as the files `transformers.AutoTokenizer.from_pretrained(folder)` loads offline.

An "hf" tokenizer is copied as it came; the GPT-2 and byte tokenizers are rebuilt as `tokenizers` byte-level
BPE tokenizer.json files that give exactly titanlite's ids. Only `tokenizers` is needed (not transformers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from titanlite.base.errors import ConfigError
from titanlite.data.tokenizer import (
    GPT2_EOT,
    GPT2_PAT_STR,
    GPT2_RANKS_PATH,
    HF_TOKENIZER_CONFIG,
    HF_TOKENIZER_FILE,
    ByteTokenizer,
    GPT2Tokenizer,
    HFTokenizer,
    Tokenizer,
    read_ranks,
)

# Copied from an "hf" tokenizer's folder when present; nothing else is (no weights, no chat templates' extras).
HF_COPIED_FILES = (HF_TOKENIZER_FILE, HF_TOKENIZER_CONFIG, "special_tokens_map.json")
# transformers 5 loads this class from tokenizer.json alone (4.x too, as its fast tokenizer).
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def save_tokenizer(folder: Path, tokenizer: Tokenizer, model_max_length: int) -> dict:
    """Write `tokenizer`'s files into `folder`; returns {"bos_token_id", "eos_token_id"} (ints or None)
    for the caller's config.json and generation_config.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, HFTokenizer):
        return _save_hf(folder, tokenizer, model_max_length)
    if isinstance(tokenizer, GPT2Tokenizer):
        _write_json(folder / HF_TOKENIZER_FILE, gpt2_tokenizer_json())
        _write_config(folder, GPT2_EOT, GPT2_EOT, model_max_length, unk=GPT2_EOT)
        # As Hugging Face's gpt2 config: <|endoftext|> is BOS and EOS (titanlite adds no separate BOS).
        return {"bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id}
    if isinstance(tokenizer, ByteTokenizer):
        _write_json(folder / HF_TOKENIZER_FILE, byte_tokenizer_json())
        _write_config(folder, None, GPT2_EOT, model_max_length)
        return {"bos_token_id": None, "eos_token_id": tokenizer.eot_id}
    raise ConfigError(f"cannot export tokenizer {tokenizer.name!r} to Hugging Face files; use 'gpt2', 'byte' or 'hf'")


def _save_hf(folder: Path, tokenizer: HFTokenizer, model_max_length: int) -> dict:
    """Copy the folder's tokenizer files as they are (its tokenizer_config.json keeps its own model_max_length);
    write a minimal tokenizer_config.json where it has none."""
    for name in HF_COPIED_FILES:
        source = tokenizer.folder / name
        if source.is_file() and source.resolve() != (folder / name).resolve():
            shutil.copyfile(source, folder / name)
    backend = tokenizer.backend
    if not (tokenizer.folder / HF_TOKENIZER_CONFIG).is_file():
        bos = None if tokenizer.declared_bos_id is None else backend.id_to_token(tokenizer.declared_bos_id)
        _write_config(
            folder, bos, backend.id_to_token(tokenizer.eot_id), model_max_length, add_bos=tokenizer.bos_id is not None
        )
    return {"bos_token_id": tokenizer.declared_bos_id, "eos_token_id": tokenizer.eot_id}


def _write_config(
    folder: Path, bos: str | None, eos: str, model_max_length: int, unk: str | None = None, add_bos: bool = False
) -> None:
    """A minimal tokenizer_config.json. add_bos_token records whether titanlite put the BOS before each document
    (HFTokenizer reads the folder back the same way); transformers 5's generic tokenizer class ignores it and
    adds only what tokenizer.json's post-processor adds (here nothing, as titanlite's encode)."""
    config = {
        "tokenizer_class": TOKENIZER_CLASS,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    _write_json(folder / HF_TOKENIZER_CONFIG, {key: value for key, value in config.items() if value is not None})


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# Byte-level BPE tokenizer.json files


def byte_symbols() -> list[str]:
    """The printable character byte-level BPE uses for each byte (GPT-2's map): printable Latin-1 bytes stand
    for themselves, the other bytes take the characters from U+0100 on, in byte order. Vocabulary
    strings must be printable and free of spaces, which this guarantees."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    symbols, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def _spelled(token: bytes, symbols: list[str]) -> str:
    return "".join(symbols[byte] for byte in token)


def _merge_parts(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two tokens whose merge makes `token`: byte-pair encode its bytes with the merges ranked below it
    (lowest rank first, as tiktoken does) until two parts remain."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = rank, -1
        for i in range(len(parts) - 1):
            found = ranks.get(parts[i] + parts[i + 1], rank)
            if found < best:
                best, at = found, i
        if at < 0:
            raise ConfigError(f"the GPT-2 rank file cannot build token rank {rank}; reinstall titanlite")
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts[0], parts[1]


def _bpe_tokenizer_json(
    vocab: dict[str, int], merges: list[tuple[str, str]], split_pattern: str | None, special: str, special_id: int
) -> dict:
    """A byte-level BPE tokenizer.json (text split by `split_pattern` first, if given) with one special token."""
    tokenizers = _import_tokenizers()
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers  # optional: found just above

    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if split_pattern is None:
        backend.pre_tokenizer = byte_level
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split_pattern), behavior="isolated"), byte_level]
        )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(special, special=True, normalized=False)])
    if backend.token_to_id(special) != special_id:
        raise ConfigError(
            f"building the tokenizer.json put {special} at id {backend.token_to_id(special)}, not {special_id}; "
            "report this"
        )
    return json.loads(backend.to_str())


def gpt2_tokenizer_json() -> dict:
    """GPT-2's tokenizer.json rebuilt from the shipped tiktoken ranks (about half a second): vocabulary =
    each token's bytes in byte-level characters, merges derived from the ranks, the split pattern as
    tiktoken's (not the ByteLevel pre-tokenizer's own regex, which splits some whitespace differently)."""
    ranks = read_ranks(GPT2_RANKS_PATH)
    symbols = byte_symbols()
    vocab = {_spelled(token, symbols): rank for token, rank in ranks.items()}
    ordered = sorted(ranks.items(), key=lambda item: item[1])
    pairs = (_merge_parts(token, rank, ranks) for token, rank in ordered if len(token) > 1)
    merges = [(_spelled(first, symbols), _spelled(second, symbols)) for first, second in pairs]
    return _bpe_tokenizer_json(vocab, merges, GPT2_PAT_STR, GPT2_EOT, GPT2Tokenizer.eot_id)


def byte_tokenizer_json() -> dict:
    """The byte tokenizer as a tokenizer.json: ids 0..255 are the bytes (no merges), 256 is <|endoftext|>."""
    vocab = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
    return _bpe_tokenizer_json(vocab, [], None, GPT2_EOT, ByteTokenizer.eot_id)


def _import_tokenizers():
    try:
        import tokenizers  # optional dependency (the [hf] extra)
    except ImportError as e:
        raise ConfigError("exporting a tokenizer needs the tokenizers package; pip install tokenizers") from e
    return tokenizers

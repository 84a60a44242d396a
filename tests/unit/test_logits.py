"""`titanlite logits`: a random transformers folder's logits, a plain one (Qwen3) and a hybrid one (Qwen3.5: Gated
DeltaNet and gated full attention), printed beside transformers' with their largest difference (float32, CPU);
the top ids agree; bad input is one line and exit 2."""

import re

import pytest
import torch

from titanlite.commands import logits
from titanlite.commands.cli import main

transformers = pytest.importorskip("transformers", reason="transformers is an optional test dependency")

VOCAB = 320  # the byte tokenizer's 257 ids, and room past them
SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)
FOLDERS = {
    "plain": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE)),
    "hybrid": lambda: transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SHAPE, **HYBRID)),
}
PROMPT = "Hello, world"


def saved(kind: str, path) -> list[str]:
    """A random transformers model of the kind saved to path (no tokenizer.json: the byte tokenizer reads the
    prompt), and the flags that name it."""
    torch.manual_seed(0)
    FOLDERS[kind]().save_pretrained(path)
    return ["--model.flavor", "hf", "--model.hf_assets_path", str(path), "--model.tokenizer", "byte"]


def rows(out: str) -> list[tuple[list[int], list[int]]]:
    """Each printed position's top ids: (titanlite's, transformers')."""
    found = []
    for block in out.split("\nposition ")[1:]:
        ranked = re.findall(r"^\s+\d+\.\s+(\d+) .*?\s{5}\s*(\d+) ", block, flags=re.M)
        found.append(([int(a) for a, _ in ranked], [int(b) for _, b in ranked]))
    return found


@pytest.mark.parametrize("kind", ["plain", "hybrid"])
def test_logits_beside_transformers_agree(kind, tmp_path, capsys):
    flags = saved(kind, tmp_path / kind)
    argv = ["logits", "--prompt", PROMPT, "--top", "3", *flags]
    assert main(argv + (["--all-positions"] if kind == "plain" else [])) == 0
    out, err = capsys.readouterr()
    assert "beside transformers'" in out and "the prompt is 12 tokens" in out, out
    difference = float(re.search(r"over 12 positions x 320 ids: (\S+) at position", out).group(1))
    assert difference < 1e-4, out
    printed = rows(out)
    assert len(printed) == (12 if kind == "plain" else 1)
    assert all(len(ours) == 3 and ours == theirs for ours, theirs in printed), out
    assert "the top 3 ids agree, in order" in out
    # --no-compare: titanlite's alone, the same top ids
    assert main(argv + ["--no-compare"]) == 0
    alone = capsys.readouterr().out
    assert "no comparison: --no-compare" in alone and "transformers" not in alone.split("\n", 1)[1]
    assert re.findall(r"^\s+\d+\.\s+(\d+) ", alone, flags=re.M) == [str(i) for i in printed[-1][0]]


def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, monkeypatch):
    flags = saved("plain", tmp_path / "plain")
    empty = tmp_path / "dcp"
    empty.mkdir()

    def cannot(*args, **kwargs):
        raise ValueError("The checkpoint you are trying to load has model type `qwen9`\nmore text")

    cases = {
        "logits needs a non-empty --prompt TEXT": ["--prompt", "", *flags],
        "Hugging Face model folder /nonexistent does not exist": [
            "--prompt", "a", "--model.flavor", "hf", "--model.hf_assets_path", "/nonexistent",
        ],
        "--compare needs a Hugging Face folder": [
            "--prompt", "a", "--compare", "--checkpoint.initial_load_path", str(empty),
        ],
        "logits --top must be at least 1": ["--prompt", "a", "--top", "0", *flags],
    }  # fmt: skip
    for message, argv in cases.items():
        assert main(["logits", *argv]) == 2, message
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("titanlite: error: ") and message in err[0], err
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", cannot)
    assert main(["logits", "--prompt", "a", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot load" in err[0] and "model type `qwen9`); add --no-compare" in err[0], err


def test_without_transformers_it_prints_titanlites_alone_unless_compare_insists(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(logits.importlib.util, "find_spec", lambda name: None)
    none = {"compare": False, "no-compare": False}
    assert "transformers is not installed" in logits.why_no_comparison(tmp_path, none)
    with pytest.raises(logits.ConfigError, match="needs transformers, which is not installed"):
        logits.why_no_comparison(tmp_path, {**none, "compare": True})

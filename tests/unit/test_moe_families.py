"""The MoE families (Qwen3-MoE, OLMoE, Mixtral) as a user meets them: `titanlite generate` on a Hugging Face
folder continues a prompt greedily exactly as transformers' generate does; a config.json routing each token to
more experts than there are is refused in one line, exit 2, before launch; the start-up log and `titanlite plan`
show total and active parameters, and the FLOPs behind MFU count the active ones."""

import functools
import json
import subprocess

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

from tests.conformance import random_hf  # noqa: E402
from tests.helpers import REPO, env  # noqa: E402
from tests.unit.test_qwen3_moe import CONFIGS  # noqa: E402
from titanlite.commands.cli import main  # noqa: E402
from titanlite.models.build import model_from_args  # noqa: E402
from titanlite.models.common.flops import active_parameters, moe_flops_per_token  # noqa: E402
from titanlite.models.registry import spec_named  # noqa: E402

FAMILIES = list(CONFIGS)  # qwen3_moe, olmoe, mixtral: 6 experts, 3 per token, GQA
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """Per family, a random transformers model of the byte tokenizer's 257 ids (the command picks among the
    tokenizer's ids only) and its saved folder. Weights moved far off their init (noise 0.5), so greedy decoding
    wanders through many ids and routes each new token to other experts, instead of repeating one id."""
    out = {}
    for family in FAMILIES:
        build = functools.partial(transformers.AutoModelForCausalLM.from_config, CONFIGS[family](vocab_size=257))
        hf = random_hf(build, scale=0.5)
        folder = tmp_path_factory.mktemp(family)
        hf.save_pretrained(folder)
        out[family] = (hf, folder)
    return out


def folder_args(folder) -> list[str]:
    return ["--model.flavor", "hf", "--model.hf_assets_path", str(folder), "--model.tokenizer", "byte"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_generate_command_continues_like_transformers(folders, family, tmp_path, capsys):
    hf, folder = folders[family]
    out = tmp_path / "out.json"
    argv = ["generate", "--prompt", "Hello, world", "--max-new-tokens", str(NEW_TOKENS), "--output", str(out)]
    assert main([*argv, *folder_args(folder)]) == 0, capsys.readouterr().err
    record = json.loads(out.read_text())
    with torch.no_grad():
        prompt = torch.tensor([record["prompt_ids"]])
        theirs = hf.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert record["stop"] == "max-new-tokens"
    assert record["new_ids"] == theirs[0, prompt.shape[1] :].tolist()
    assert len(set(record["new_ids"])) > NEW_TOKENS // 2, record["new_ids"]  # not one id over and over
    assert f"{NEW_TOKENS} new tokens in" in capsys.readouterr().out


@pytest.fixture
def too_many_per_token(folders, family, tmp_path):
    """The family's folder, its config.json asking for 7 experts per token of its 6."""
    _, folder = folders[family]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"num_experts_per_tok": 7}))
    return bad


@pytest.mark.parametrize("family", FAMILIES)
def test_more_experts_per_token_than_experts_is_one_line_before_launch(family, too_many_per_token, capsys):
    config = json.loads((too_many_per_token / "config.json").read_text())
    experts_key = next(k for k in ("num_experts", "num_local_experts") if k in config)
    expected = (
        f"titanlite: error: {too_many_per_token / 'config.json'}: num_experts_per_tok=7 exceeds {experts_key}=6: "
        "each token is routed to num_experts_per_tok distinct experts; set num_experts_per_tok to at most 6\n"
    )
    capsys.readouterr()
    for command in (["check", "--world-size", "1"], ["generate", "--prompt", "hi"]):
        assert main([*command, *folder_args(too_many_per_token)]) == 2
        assert capsys.readouterr().err == expected, command
    if family != "mixtral":  # the launcher's path is the same for every family: one launch (about 3 s) shows it
        return
    proc = subprocess.run(
        ["./run_train.sh", *folder_args(too_many_per_token), "--job.dump_folder", str(too_many_per_token / "runs")],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr == expected, proc.stderr[-2000:]
    assert not (too_many_per_token / "runs").exists()  # refused before the launch made a run folder


def qwen3_30b_a3b_counts() -> tuple[int, int]:
    """Qwen3-30B-A3B's total and active parameters from its published shape (config.json on the Hub): 48 layers of
    width 2048, 32 query and 4 key/value heads of 128, per-head Q/K norms, 128 experts of width 768 of which 8
    per token, vocabulary 151936, untied embeddings."""
    vocab, dim, layers, heads, kv_heads, head_dim = 151936, 2048, 48, 32, 4, 128
    experts, per_token, expert_width = 128, 8, 768
    attention = dim * heads * head_dim + 2 * dim * kv_heads * head_dim + heads * head_dim * dim + 2 * head_dim
    per_layer = attention + 2 * dim + dim * experts  # + two RMSNorms and the router's gate
    expert = 3 * dim * expert_width  # gate, up and down projections
    ends = 2 * vocab * dim + dim  # embedding, output projection, final norm
    return ends + layers * (per_layer + experts * expert), ends + layers * (per_layer + per_token * expert)


def test_qwen3_30b_a3b_active_parameters_and_flops():
    total, active = qwen3_30b_a3b_counts()
    assert total == 30_532_122_624
    assert 3.3e9 < active < 3.4e9  # the model card's "3.3B activated"
    with torch.device("meta"):
        model = model_from_args(spec_named("qwen3_moe").flavors["qwen3_moe_30b_a3b"])
    assert active_parameters(model) == active
    # MFU's FLOPs: 6 x the active parameters less the input embedding (a lookup), + attention's 12 L d T.
    seq = 4096
    assert moe_flops_per_token(model, seq) == 6 * (active - 151936 * 2048) + 12 * 48 * 32 * 128 * seq


def test_plan_shows_qwen3_30b_a3b_total_and_active(capsys):
    total, active = qwen3_30b_a3b_counts()
    assert main(["plan", "--model.flavor", "qwen3_moe_30b_a3b", "--ngpu", "8"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(
        f"titanlite plan: qwen3_moe qwen3_moe_30b_a3b, {total:,} parameters (30.53 B), "
        f"{active:,} active per token (3.35 B), seq "
    ), first


def test_plan_of_a_dense_model_shows_one_count(capsys):
    assert main(["plan", "--model.name", "llama3", "--ngpu", "1"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert " parameters (" in first and "active" not in first, first

"""Text generation: the KV cache gives the full forward's logits, decoding is greedy or seeded sampling over
the tokenizer's ids only, greedy matches transformers' generate, and `titanlite generate` loads a run's
checkpoint, a Hugging Face folder or a DCP folder and rejects bad input with one line. CPU, fp32, debug models."""

import json

import pytest
import torch

from tests.helpers import REPO
from titanlite.commands.cli import main
from titanlite.commands.generate import decode_with_graphs
from titanlite.components.hf_weights import save_hf
from titanlite.data.tokenizer import ByteTokenizer
from titanlite.engine.decoding import CONTEXT_FULL, END_OF_TEXT, MAX_NEW_TOKENS, Sampling, generate, next_token, sample
from titanlite.models.build import build_model
from titanlite.models.common.attention import build_core
from titanlite.models.common.init import init_weights
from titanlite.models.common.kv_cache import KVCache, StaticKVCache

TOK = ByteTokenizer()  # 257 ids, padded to 320 in the model
SEQ_LEN = 64
MODELS = ["gpt2", "llama3"]
PROMPTS = ["def main(", "import os\n", "The quick brown fox"]


def debug_model(name: str, seed: int = 0) -> torch.nn.Module:
    model = build_model(name, "debug", TOK.vocab_size, SEQ_LEN)
    init_weights(model, seed)
    return model.eval()


# ---- the KV cache ---------------------------------------------------------------------------------------


CACHES = {"host": lambda n: KVCache(max_len=n), "static": lambda n: StaticKVCache(n, torch.device("cpu"))}


@pytest.mark.parametrize("kind", CACHES)
@pytest.mark.parametrize("name", [*MODELS, "deepseek_v32", "nemotron_h"])
def test_cached_decoding_matches_full_forward_logits(name, kind):
    """Both caches: the host-counted one, and the static one (device-side position, masked whole-buffer
    attention) that CUDA-graph decoding replays. DeepSeek-V3.2's sparse layers keep their latents and indexer keys
    (16 selected of up to 20: the last steps select); Nemotron-H's Mamba-2 layers their SSM state and convolution
    window (a chunk of 5 after the cache runs the chunked scan from the cached state)."""
    model = debug_model(name)
    tokens = torch.randint(0, TOK.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    # A prefill, single-token steps, a several-token chunk after the cache (the shifted causal mask), more steps.
    chunks = [8, 1, 1, 1, 1, 5, 1, 1, 1]
    cache, start = CACHES[kind](20), 0
    with torch.inference_mode():
        full = model(tokens)
        for size in chunks:
            logits = model(tokens[:, start : start + size], cache=cache)
            torch.testing.assert_close(logits, full[:, start : start + size], atol=1e-5, rtol=1e-5)
            start += size
    assert cache.length == start == 20


def test_cuda_graph_decoding_needs_a_cuda_device():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        generate(debug_model("gpt2"), [1, 2], 4, TOK.vocab_size, cuda_graph=True)


def test_cuda_decodes_with_graphs_by_default_with_ways_out():
    """On CUDA the decode replays a CUDA graph unless --no-cuda-graph; models whose captured step has not run on a
    GPU (experts, FlexAttention) decode eagerly with a line saying so, unless --cuda-graph; the CPU never graphs.
    (The device is only compared here: no GPU is needed.)"""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    plain = {"cuda-graph": False, "no-cuda-graph": False}
    dense, experts = debug_model("llama3"), debug_model("qwen3_moe")
    flex = debug_model("llama3")
    for block in flex.layers.values():
        block.attention.core = build_core("flex", **block.attention.core.options())
    assert decode_with_graphs(dense, cuda, plain) == (True, None)
    assert decode_with_graphs(dense, cuda, {**plain, "no-cuda-graph": True}) == (False, None)
    assert decode_with_graphs(dense, cpu, plain) == (False, None)
    for model, why in ((experts, "mixture-of-experts"), (flex, "FlexAttention")):
        graphed, note = decode_with_graphs(model, cuda, plain)
        assert not graphed and note.startswith("decoding eagerly: ") and why in note, note
        assert decode_with_graphs(model, cuda, {**plain, "cuda-graph": True}) == (True, None)


def test_cache_refuses_positions_past_its_length():
    model = debug_model("gpt2")
    cache = KVCache(max_len=4)
    with torch.inference_mode(), pytest.raises(ValueError, match="holds 4 positions"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)


# ---- decoding -------------------------------------------------------------------------------------------


def test_padded_vocab_ids_are_never_picked():
    logits = torch.zeros(3, 320)
    logits[:, TOK.vocab_size :] = 100.0  # the padding columns would win if they were allowed
    logits[:, 7] = 1.0
    gen = torch.Generator().manual_seed(0)
    assert next_token(logits, TOK.vocab_size, Sampling(), gen).tolist() == [7, 7, 7]
    sampled = next_token(logits.repeat(100, 1), TOK.vocab_size, Sampling(temperature=5.0), gen)
    assert sampled.max().item() < TOK.vocab_size


def test_sampling_follows_the_probabilities():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).repeat(100_000, 1)
    ids = sample(probs, torch.Generator().manual_seed(0))
    shares = torch.bincount(ids, minlength=4) / len(ids)
    torch.testing.assert_close(shares, probs[0], atol=0.01, rtol=0)
    assert shares[3] == 0


def test_top_k_samples_only_the_k_most_likely():
    logits = torch.arange(TOK.vocab_size, dtype=torch.float32).repeat(500, 1) / 50
    ids = next_token(logits, TOK.vocab_size, Sampling(temperature=1.0, top_k=3), torch.Generator().manual_seed(0))
    assert set(ids.tolist()) == {254, 255, 256}


@pytest.mark.parametrize("name", MODELS)
def test_greedy_is_deterministic_and_seeded_sampling_reproducible(name):
    model, prompt = debug_model(name), TOK.encode(PROMPTS[0])
    greedy = [generate(model, prompt, 12, TOK.vocab_size).new_ids for _ in range(2)]
    assert greedy[0] == greedy[1] and len(greedy[0]) == 12

    def sample(seed: int) -> list[int]:
        return generate(model, prompt, 12, TOK.vocab_size, Sampling(temperature=0.8, top_k=20, seed=seed)).new_ids

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_stops_at_end_of_text_and_when_the_context_is_full():
    model = debug_model("gpt2")
    free = generate(model, TOK.encode(PROMPTS[1]), 8, TOK.vocab_size)
    assert free.stop == MAX_NEW_TOKENS
    eot = free.new_ids[3]  # pretend this id ends the text: generation stops at its first appearance
    stopped = generate(model, TOK.encode(PROMPTS[1]), 8, TOK.vocab_size, eot_id=eot)
    assert stopped.stop == END_OF_TEXT
    assert stopped.new_ids == free.new_ids[: free.new_ids.index(eot) + 1]
    context = model.args.max_seq_len
    full = generate(model, [65] * (context - 3), 10, TOK.vocab_size)
    assert full.stop == CONTEXT_FULL and len(full.new_ids) == 3


# ---- parity with transformers ---------------------------------------------------------------------------


@torch.no_grad()
def add_noise(model: torch.nn.Module, std: float, seed: int) -> None:
    """Add noise to every weight. A freshly initialised GPT-2 (its output tied to the embedding) greedily
    repeats its last byte forever, which would hide a wrong position; noise gives varied continuations."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * std)


# The freshly initialised Llama ends each prompt's continuation with end-of-text: both sides must stop there.
PARITY_CASES = [("gpt2", 0.1), ("llama3", 0.0), ("llama3", 0.1)]


@pytest.mark.parametrize("name,noise", PARITY_CASES, ids=["gpt2-noisy", "llama", "llama-noisy"])
def test_greedy_matches_transformers_generate(tmp_path, name, noise):
    transformers = pytest.importorskip("transformers", reason="transformers is an optional test dependency")
    model = debug_model(name, seed=1)
    add_noise(model, noise, seed=2)
    save_hf(tmp_path, model.args, model.state_dict(), torch.float32)  # as `titanlite convert to-hf` does
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    padding = list(range(TOK.vocab_size, model.args.vocab_size))
    for prompt in PROMPTS:
        ids = TOK.encode(prompt)
        ours = generate(model, ids, 16, TOK.vocab_size, eot_id=TOK.eot_id).new_ids
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=16,
                do_sample=False,
                suppress_tokens=padding,
                eos_token_id=TOK.eot_id,
                pad_token_id=TOK.eot_id,
            )
        assert ours == out[0, len(ids) :].tolist(), prompt


# ---- the command ----------------------------------------------------------------------------------------


def config_args(dump_folder) -> list[str]:
    return [
        "--config",
        str(REPO / "train_configs/debug_model.toml"),
        "--job.dump_folder",
        str(dump_folder),
        "--model.tokenizer",
        "byte",
        "--training.seq_len",
        str(SEQ_LEN),
    ]


@pytest.fixture(scope="module")
def seeded_run(tmp_path_factory):
    """A dump folder whose run has the step-0 checkpoint of `titanlite seed-checkpoint` (seed 42)."""
    folder = tmp_path_factory.mktemp("runs")
    assert main(["seed-checkpoint", *config_args(folder)]) == 0
    return folder


def seed_42_greedy(prompt: str, n: int) -> list[int]:
    """What the seed checkpoint's weights (init_weights with training.seed 42) generate."""
    return generate(debug_model("gpt2", seed=42), TOK.encode(prompt), n, TOK.vocab_size, eot_id=TOK.eot_id).new_ids


def test_generate_from_run_checkpoint_prints_and_writes_json(seeded_run, tmp_path, capsys):
    capsys.readouterr()
    out_json = tmp_path / "out.json"
    args = [
        "generate",
        *config_args(seeded_run),
        "--prompt",
        PROMPTS[0],
        "--max-new-tokens",
        "10",
        "--output",
        str(out_json),
    ]
    assert main(args) == 0
    stdout = capsys.readouterr().out
    record = json.loads(out_json.read_text())
    assert record["prompt"] == PROMPTS[0] and record["prompt_ids"] == TOK.encode(PROMPTS[0])
    assert record["new_ids"] == seed_42_greedy(PROMPTS[0], 10)
    assert record["text"] == TOK.decode(record["new_ids"]) and record["tokens_per_s"] > 0
    assert "step-0" in stdout and PROMPTS[0] + record["text"] in stdout
    assert "10 new tokens in" in stdout and "tokens/s" in stdout


def test_generate_output_into_a_missing_folder_makes_it(seeded_run, tmp_path):
    # Checked before generating (an unwritable place is refused then), made when the record is written: the
    # generated text is never lost to a folder that did not exist yet.
    out_json = tmp_path / "new" / "folder" / "out.json"
    args = ["generate", *config_args(seeded_run), "--prompt", PROMPTS[1], "--max-new-tokens", "2"]
    assert main([*args, "--output", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["new_ids"] == seed_42_greedy(PROMPTS[1], 2)


def test_generate_from_initial_load_path_hf_or_dcp(seeded_run, tmp_path, capsys):
    hf_folder = tmp_path / "hf"
    model = debug_model("gpt2", seed=42)
    save_hf(hf_folder, model.args, model.state_dict(), torch.float32)
    expected = seed_42_greedy(PROMPTS[2], 6)
    for initial in (hf_folder, seeded_run / "debug_model" / "step-0"):
        out_json = tmp_path / "out.json"
        args = [
            "generate",
            *config_args(tmp_path / "empty"),
            "--checkpoint.initial_load_path",
            str(initial),
            "--prompt",
            PROMPTS[2],
            "--max-new-tokens",
            "6",
            "--output",
            str(out_json),
        ]
        assert main(args) == 0
        assert json.loads(out_json.read_text())["new_ids"] == expected, initial
        assert str(initial) in capsys.readouterr().out


BAD_INPUTS = {
    "empty prompt": (["--prompt", ""], "non-empty --prompt"),
    "no prompt": ([], "non-empty --prompt"),
    "prompt fills the context": (["--prompt", "x" * 1024], "1024 tokens but the model's context is 1024"),
    "no new tokens": (["--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens=0 must be at least 1"),
    "negative temperature": (["--prompt", "a", "--temperature", "-1"], "--temperature=-1 must be"),
    "negative top-k": (["--prompt", "a", "--top-k", "-2"], "--top-k=-2 must be"),
    "not a number": (["--prompt", "a", "--max-new-tokens", "many"], "takes a whole number"),
    "cuda graphs on the CPU": (["--prompt", "a", "--cuda-graph"], "--cuda-graph needs a CUDA GPU"),
    "graphs and no graphs": (["--prompt", "a", "--cuda-graph", "--no-cuda-graph"], "not both"),
    "no checkpoint": (["--prompt", "a", "--job.name", "never_trained"], "checkpoint.initial_load_path"),
    "initial_load_path missing": (
        ["--prompt", "a", "--job.name", "never_trained", "--checkpoint.initial_load_path", "/nonexistent/step-3"],
        "cannot be loaded (it does not exist)",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_and_status_2(seeded_run, capsys, case):
    extra, message = BAD_INPUTS[case]
    capsys.readouterr()
    assert main(["generate", *config_args(seeded_run), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("titanlite: error:") and message in err[0], err

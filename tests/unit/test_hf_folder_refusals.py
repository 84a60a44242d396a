"""A Hugging Face folder that would not train as its config.json says is refused before launch: `titanlite check`
(what ./run_train.sh runs in the launcher before any worker) exits 2 with one line naming the tensor or the
config.json field and what to change, and writes nothing. Each class of fault: a dtype titanlite does not read
(bfloat16 and float16 are read, exactly, and said so), tensor shapes config.json does not make, a field of the wrong
JSON type, a NaN or infinite weight, a field that trains with dropout or router noise, and refusals in the folder's
own config.json names."""

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)
safetensors_torch = pytest.importorskip("safetensors.torch")

from tests.helpers import REPO, env  # noqa: E402
from tests.unit.test_hf_families import imported, random_model  # noqa: E402
from tests.unit.test_qwen3_moe import CONFIGS  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.base.hf_config import FIELDS, ROPE_FIELDS, check_training_fields, check_types  # noqa: E402
from titanlite.components.hf_weights import check_hf_values, load_hf_into, save_hf  # noqa: E402
from titanlite.config import parse_config  # noqa: E402
from titanlite.models.build import configured_model, model_from_args  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config  # noqa: E402
from titanlite.models.registry import names, spec_named, spec_of_model_type  # noqa: E402

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    """A random Qwen3 folder (test_hf_families.py's: vocabulary 300, hidden 96, 4 layers, untied, float32)."""
    folder = tmp_path_factory.mktemp("qwen3")
    random_model("qwen3").save_pretrained(folder)
    return folder


def variant(source: Path, to: Path, config=None, tensors=None) -> Path:
    """A copy of folder `source` with config.json's fields updated by `config` and the tensors passed through
    `tensors` (a function of the dict of them)."""
    shutil.copytree(source, to)
    if config:
        path = to / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors:
        path = to / WEIGHTS
        safetensors_torch.save_file(tensors(safetensors_torch.load_file(path)), path, metadata={"format": "pt"})
    return to


def refusal(cli, folder: Path, tmp_path: Path, *flags: str) -> str:
    """The one line `titanlite check` refuses the folder's run with (exit 2), after asserting that it wrote nothing:
    no run folder, no prepared data."""
    runs, cache = tmp_path / "runs", tmp_path / "cache"
    proc = cli(
        "check", "--model.flavor", "hf", "--model.hf_assets_path", str(folder), "--model.tokenizer", "byte",
        "--job.dump_folder", str(runs), "--data.cache_dir", str(cache), *flags,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("titanlite: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert not runs.exists() and not cache.exists()
    return proc.stderr.removeprefix("titanlite: error: ").strip()


# ---- dtypes ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, why",
    [(torch.float64, "float32 parameters would round"), (torch.int8, "quantized"), (torch.float8_e4m3fn, "quantized")],
    ids=["float64", "int8", "float8"],
)
def test_a_dtype_titanlite_does_not_read_is_refused_naming_a_tensor(cli, qwen3_folder, tmp_path, dtype, why):
    mlp = lambda t: {k: v.to(dtype) if ".mlp." in k else v for k, v in t.items()}  # noqa: E731
    line = refusal(cli, variant(qwen3_folder, tmp_path / "f", tensors=mlp), tmp_path)
    name = str(dtype).removeprefix("torch.").removesuffix("fn")
    assert re.search(rf"tensor 'model\.layers\.\d\.mlp\.\w+\.weight' and 11 more are {name} \(", line), line
    assert why in line and "convert the folder to one of them" in line


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_bfloat16_and_float16_weights_are_read_exactly_and_said_in_one_line(qwen3_folder, tmp_path, caplog, dtype):
    half = lambda t: {k: v.to(dtype) for k, v in t.items()}  # noqa: E731
    folder = variant(qwen3_folder, tmp_path / "f", tensors=half)
    with caplog.at_level("INFO", logger="titanlite"):
        model = imported(folder)
    said = [r.getMessage() for r in caplog.records if "widened" in r.getMessage()]
    name = str(dtype).removeprefix("torch.")
    assert said == [f"  checkpoint: {folder} holds {name} weights, widened exactly to float32 parameters"]
    stored = safetensors_torch.load_file(folder / WEIGHTS)["model.norm.weight"]
    assert model.norm.weight.dtype == torch.float32 and torch.equal(model.norm.weight, stored.float())


# ---- shapes ------------------------------------------------------------------------------------------------------


def rows(name: str, n: int):
    """Tensors with `name` cut or zero-padded to n rows."""

    def change(t):
        w = t[name]
        t[name] = w[:n].clone() if n <= len(w) else torch.cat([w, w.new_zeros(n - len(w), *w.shape[1:])])
        return t

    return change


@pytest.mark.parametrize(
    "name, n, config",
    [
        ("model.embed_tokens.weight", 320, None),  # padded rows: refused in the worker before, after writing
        ("lm_head.weight", 280, None),  # fewer rows: padded with zeros without a word before
        ("lm_head.weight", 300, {"vocab_size": 280}),  # config.json's vocabulary smaller than the tensors'
    ],
    ids=["embedding-padded", "head-short", "config-vocab-small"],
)
def test_tensor_rows_config_json_does_not_make_are_refused(cli, qwen3_folder, tmp_path, name, n, config):
    folder = variant(qwen3_folder, tmp_path / "f", config=config, tensors=None if config else rows(name, n))
    line = refusal(cli, folder, tmp_path)
    vocab = (config or {}).get("vocab_size", 300)
    stored = 300 if config else n
    assert line.startswith(
        f"{folder}: tensor {name!r} has shape ({stored}, 96), but its config.json makes it ({vocab}, 96) "
        f"(vocab_size={vocab}); the weights were not saved with this config.json: set vocab_size to {stored}"
    ), line


def test_another_shape_than_config_json_makes_is_refused(cli, qwen3_folder, tmp_path):
    folder = variant(qwen3_folder, tmp_path / "f", config={"intermediate_size": 208})
    line = refusal(cli, folder, tmp_path)
    assert "'model.layers.0.mlp.down_proj.weight' has shape (96, 200), but its config.json makes it (96, 208)" in line
    assert line.endswith("use the config.json saved with them")


def test_a_named_flavors_larger_vocabulary_is_said_in_one_line(tmp_path, caplog):
    """The one intended padding: a folder of 300 ids into the debug flavor's 320 rows (257 byte ids, padded)."""
    args = spec_named("qwen3").flavors["debug"]
    args = type(args)(**{**args.__dict__, "vocab_size": 300})
    torch.manual_seed(0)
    ours = model_from_args(args)
    save_hf(tmp_path / "f", args, ours.state_dict())
    cfg = parse_config(
        ["--model.name", "qwen3", "--model.flavor", "debug", "--model.tokenizer", "byte",
         "--checkpoint.initial_load_path", str(tmp_path / "f")]
    )  # fmt: skip
    model = configured_model(cfg.model, 257, 64)
    with caplog.at_level("INFO", logger="titanlite"):
        load_hf_into([model], tmp_path / "f")
    said = [r.getMessage() for r in caplog.records if "start at zero" in r.getMessage()]
    assert said == [
        f"  checkpoint: {tmp_path / 'f'} embeds 300 token ids; the model's rows past them, to its vocab_size 320, "
        "start at zero (no token of the tokenizer reads them)"
    ]
    assert model.tok_embeddings.weight[300:].count_nonzero() == 0


# ---- config.json field types -------------------------------------------------------------------------------------

WRONG_TYPES = {
    "string": ({"num_hidden_layers": "4"}, 'num_hidden_layers="4" is not a whole number of at least 1; write 4 '
               "without the quotes"),
    "list": ({"hidden_size": [96]}, "hidden_size=[96] is not a whole number of at least 1; write 96, not a list"),
    "bool-for-float": ({"rms_norm_eps": True}, "rms_norm_eps=true is not a finite number of 0 or more; correct it"),
    "float-for-count": ({"num_attention_heads": 6.0}, "num_attention_heads=6.0 is not a whole number of at least 1; "
                        "write 6"),
    "null": ({"vocab_size": None}, "vocab_size=null is not a whole number of at least 1"),
    "bool-as-string": ({"tie_word_embeddings": "false"}, 'tie_word_embeddings="false" is not true or false; write '
                       "false without the quotes"),
    "nested": ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
               'rope_parameters.rope_theta="1e4" is not a finite number above 0; write 1e4 without the quotes'),
}  # fmt: skip


@pytest.mark.parametrize("case", WRONG_TYPES)
def test_a_field_of_the_wrong_json_type_is_refused_naming_it(cli, qwen3_folder, tmp_path, case):
    """Before: a traceback from the model's constructor (or, for "false", a model tied without a word)."""
    config, message = WRONG_TYPES[case]
    folder = variant(qwen3_folder, tmp_path / "f", config=config)
    assert refusal(cli, folder, tmp_path).startswith(f"{folder / 'config.json'}: {message}")


CONFIG_CLASSES = ["GPT2Config", "LlamaConfig", "Qwen2Config", "Qwen3Config", "SmolLM3Config", "MistralConfig",
                  "Olmo2Config", "Gemma3TextConfig", "Qwen3MoeConfig", "OlmoeConfig", "MixtralConfig", "GptOssConfig",
                  "DeepseekV3Config", "DeepseekV32Config", "GlmMoeDsaConfig"]  # fmt: skip


@pytest.mark.parametrize("name", CONFIG_CLASSES)
def test_every_config_transformers_writes_has_the_types_the_check_asks(name):
    config = getattr(transformers, name)().to_dict()
    hf = spec_of_model_type(config["model_type"], "config.json:").hf
    assert hf is not None
    check_types(config, "config.json:", hf.fields, hf.nullable)
    assert {k for k in config if k in FIELDS}  # the shared table covers the family's fields
    assert not hf.fields or {k for k in config if k in hf.fields}  # and so does the family's own


MODELS = REPO / "titanlite" / "models"


def _modules_read(path: Path) -> set[Path]:
    """The files of titanlite/models that `path` imports (a module, or a package's __init__.py)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("titanlite.models"):
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.startswith("titanlite.models")]
        else:
            continue
        for name in names:
            base = REPO / Path(*name.split("."))
            found |= {f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()}
    return found


def _fields_read(spec) -> set[str]:
    """The config.json fields a family's reader takes: those its folder's modules (and the module of its `read`, where
    that is a shared reader's), and the titanlite/models modules they import (the shared readers), read as
    config.get("x") or config["x"], and the front door's (titanlite/models/hf_config.py)."""
    read = sys.modules[getattr(spec.hf.read, "func", spec.hf.read).__module__].__file__
    assert read is not None
    # The family's own modules (its folder's standard ones: docs/models.md, "Adding a family"), not those of another
    # family its folder holds (Gemma 4's MoE sizes, DeepSeek-V3.2 and GLM-5 in DeepSeek-V3's), which reach their own
    # through their readers' imports.
    standard = ("__init__.py", "args.py", "hf_config.py", "weights.py", "model.py", "parallelize.py")
    folders = {MODELS / spec.name, Path(read).parent}
    todo = {Path(read)} | {folder / name for folder in folders if folder.parent == MODELS for name in standard}
    todo = {path for path in todo if path.is_file()}
    seen = {MODELS / "hf_config.py", MODELS / "registry.py"}  # the front door: read, not followed (it reaches all)
    while todo:
        path = todo.pop()
        seen.add(path)
        todo |= _modules_read(path) - seen
    pattern = r'config(?:\.get\(|\[)"(\w+)"'
    return {k for path in seen - {MODELS / "registry.py"} for k in re.findall(pattern, path.read_text())}


def test_the_type_table_covers_every_field_a_family_reads():
    """The check stays whole, family by family: a field a family's reader takes from config.json has its type in the
    shared table (FIELDS) or in the family's own (its spec's HFConfig.fields, which includes the shared tables of the
    blocks it reads: MoE, latent attention, Gated DeltaNet); those of rope_scaling and rope_parameters are
    ROPE_FIELDS'."""
    families = [spec_named(name) for name in names()]
    untyped = {}
    for spec in families:
        if spec.hf is None:
            continue
        read = _fields_read(spec)
        assert read, spec.name
        untyped[spec.name] = sorted(read - set(FIELDS) - set(spec.hf.fields))
    assert untyped and not any(untyped.values()), {k: v for k, v in untyped.items() if v}
    assert {"rope_theta", "factor", "original_max_position_embeddings", "beta_fast"} <= set(ROPE_FIELDS)


# ---- values ------------------------------------------------------------------------------------------------------


def poison(name: str, value: float):
    def change(t):
        t[name].view(-1)[7] = value
        return t

    return change


@pytest.mark.parametrize("value, what", [(float("nan"), "1 NaN value"), (float("inf"), "1 infinite value")])
def test_a_non_finite_weight_is_refused_before_launch_naming_it(cli, qwen3_folder, tmp_path, value, what):
    """Before: trained into a NaN loss at step 1, blamed on the learning rate (exit 3)."""
    name = "model.layers.1.mlp.up_proj.weight"
    folder = variant(qwen3_folder, tmp_path / "f", tensors=poison(name, value))
    assert refusal(cli, folder, tmp_path) == (
        f"{folder}: tensor {name!r} in {WEIGHTS} holds {what}; the weights are damaged (training from them ends in a "
        "NaN loss): download or export the folder again"
    )


def test_a_folder_too_large_to_scan_before_launch_is_checked_as_it_is_read(qwen3_folder, tmp_path):
    folder = variant(qwen3_folder, tmp_path / "f", tensors=poison("model.norm.weight", float("nan")))
    assert not check_hf_values(folder, limit=1000)  # larger than the limit: left to the load
    with pytest.raises(ConfigError, match=r"tensor 'model.norm.weight' in model.safetensors holds 1 NaN value"):
        imported(folder)


# ---- fields that change how training computes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [{"attention_dropout": 0.1}, {"hidden_dropout": 0.05}, {"attention_dropout": 0.1, "resid_pdrop": 0.2}],
    ids=["attention_dropout", "hidden_dropout", "two"],
)
def test_dropout_in_config_json_refuses_a_training_run(cli, qwen3_folder, tmp_path, fields):
    """Before: ignored by every family but gpt-oss, so the run trained another model than config.json's."""
    folder = variant(qwen3_folder, tmp_path / "f", config=fields)
    named = ", ".join(f"{k}={v}" for k, v in fields.items())
    them = "it" if len(fields) == 1 else "them"
    assert refusal(cli, folder, tmp_path) == (
        f"{folder / 'config.json'}: {named}: titanlite trains without dropout or router noise, so this would train "
        f"another model than config.json describes; set {them} to 0.0 in config.json"
    )


def test_dropout_refuses_a_run_from_initial_weights_too(cli, qwen3_folder, tmp_path):
    folder = variant(qwen3_folder, tmp_path / "f", config={"attention_dropout": 0.1})
    runs = tmp_path / "runs"
    proc = cli("check", "--checkpoint.initial_load_path", str(folder), "--job.dump_folder", str(runs))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "attention_dropout=0.1" in proc.stderr
    assert not runs.exists()


@pytest.mark.parametrize(
    "family, fields",
    [
        ("gpt2", {"attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1}),  # GPT2Config's defaults
        ("mixtral", {"router_jitter_noise": 0.1}),
        ("gpt_oss", {"attention_dropout": 0.1}),
    ],
)
def test_every_family_goes_through_the_one_training_check(family, fields):
    config = {"model_type": family, **fields, "summary_first_dropout": 0.1, "classifier_dropout": 0.3}
    with pytest.raises(ConfigError) as e:
        check_training_fields(config, "config.json:")
    assert ", ".join(f"{k}={v}" for k, v in fields.items()) + ": titanlite trains without" in str(e.value)
    assert "summary_first_dropout" not in str(e.value)  # the heads' own, which titanlite never builds


def test_inference_reads_a_config_json_with_dropout():
    """generate and eval read the folder: dropout changes nothing there."""
    config = {**random_model("qwen3").config.to_dict(), "attention_dropout": 0.1}
    assert args_from_hf_config(config).n_layers == 4


# ---- the folder's own field names ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_experts_per_tok": 0}, "num_experts_per_tok=0 is not a whole number of at least 1"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size=0 is not a whole number of at least 1"),
        ({"num_local_experts": 0}, "num_local_experts=0 is not supported: a model without experts is a qwen3 model"),
        ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_experts=4"),
        ({"num_experts_per_tok": 7}, "num_experts_per_tok=7 exceeds num_local_experts=6"),
    ],
    ids=["top_k", "expert_width", "transformers5-count", "qwen-count", "more-than-experts"],
)
def test_a_qwen3_moe_folder_is_refused_in_its_own_names(cli, tmp_path, changes, message):
    """Before: MoEArgs.top_k, MoEArgs.expert_dim, and num_experts for a folder that counts num_local_experts."""
    folder = tmp_path / "f"
    folder.mkdir()
    config = CONFIGS["qwen3_moe"]().to_dict() | changes  # transformers 5 writes num_local_experts
    if "num_experts" in changes:
        del config["num_local_experts"]  # Qwen's own folders write num_experts
    (folder / "config.json").write_text(json.dumps(config))
    line = refusal(cli, folder, tmp_path)
    assert message in line and "MoEArgs" not in line, line


def test_a_deepseek_routing_refusal_is_in_its_own_names():
    config = transformers.DeepseekV3Config(n_routed_experts=8, num_experts_per_tok=2, n_group=3, topk_group=1)
    with pytest.raises(ConfigError, match=r"n_group=3; use a divisor of n_routed_experts=8") as e:
        args_from_hf_config({**config.to_dict(), "first_k_dense_replace": 1, "num_hidden_layers": 2})
    assert "MoEArgs" not in str(e.value)


def test_a_named_flavor_of_another_shape_than_the_folder_is_refused_in_config_json_names(cli, qwen3_folder, tmp_path):
    """checkpoint.initial_load_path with a named flavor of another shape: the differences in the folder's own
    config.json names (hidden_size, not titanlite's dim)."""
    runs = tmp_path / "runs"
    proc = cli(
        "check", "--config", "train_configs/qwen3_debug.toml", "--model.tokenizer", "byte",
        "--checkpoint.initial_load_path", str(qwen3_folder), "--job.dump_folder", str(runs),
    )  # fmt: skip
    assert proc.returncode == 2 and not runs.exists()
    line = proc.stderr.strip()
    start = f"titanlite: error: checkpoint.initial_load_path='{qwen3_folder}' has hidden_size=96, "
    assert line.startswith(start), line
    assert "but the configured model has hidden_size=64" in line and "model.flavor = 'hf'" in line, line
    assert not re.search(r"\b(dim|n_heads|ffn_dim|norm_eps)=", line) and "rope_parameters" not in line, line


# ---- through the launcher ------------------------------------------------------------------------------------------


def test_run_train_refuses_a_damaged_folder_before_any_worker_in_one_line(qwen3_folder, tmp_path):
    """What ./run_train.sh runs: the launcher's --check refuses in its own process; no worker, no run folder."""
    folder = variant(qwen3_folder, tmp_path / "f", tensors=poison("lm_head.weight", float("nan")))
    runs = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, "-m", "titanlite.commands.launch", "--check", "--standalone", "--nproc-per-node", "1",
         "-m", "titanlite.commands.train", "--model.flavor", "hf", "--model.hf_assets_path", str(folder),
         "--model.tokenizer", "byte", "--job.dump_folder", str(runs)],
        cwd=REPO, env=env(), capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == (
        f"titanlite: error: {folder}: tensor 'lm_head.weight' in {WEIGHTS} holds 1 NaN value; the weights are damaged "
        "(training from them ends in a NaN loss): download or export the folder again\n"
    )
    assert not runs.exists()

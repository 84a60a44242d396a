"""Qwen3.5 and Qwen3.5-MoE against `transformers` itself: random text models (grouped value heads, partial rotary,
tied and untied) import with transformers' logits to 1e-5 (fp32), greedy generation equals transformers' (the linear
layers' recurrent state and convolution window in the cache), an export loads back in transformers with our logits;
packed documents are computed as if each were alone; what Qwen3.5's config.json cannot mean is refused in one line."""

import json

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

from tests.conformance import exports_as, greedy_ids_match, imported_by_config, random_hf, tokens  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.components.hf_weights import save_hf  # noqa: E402
from titanlite.models.build import model_from_args  # noqa: E402
from titanlite.models.common.attention import Sequence  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config, folder_args  # noqa: E402

VOCAB = 200
TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads read each key head
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
CASES = {
    "dense": lambda: transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT)),
    "dense-tied": lambda: transformers.Qwen3_5ForCausalLM(
        transformers.Qwen3_5TextConfig(**{**TEXT, "tie_word_embeddings": True})
    ),
    "moe": lambda: transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**TEXT, **MOE)),
}


def random_model(case: str):
    """A transformers model of the case, its norms moved off their init too."""
    return random_hf(CASES[case], scale=0.1, moved=lambda name: "norm" in name or "dt_bias" in name)


@pytest.fixture(scope="module", params=list(CASES))
def folder(request, tmp_path_factory):
    hf = random_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path


def test_logits_equal_transformers_and_an_export_loads_back_with_ours(folder, tmp_path):
    """Imported by the family's reader (`imported` here: the folder's 200 ids, which the byte tokenizer's 257 in
    tests/conformance.py's would refuse), its logits to rtol = atol = 1e-5; `exports_as` adds 1e-5 of their scale."""
    hf, path = folder
    ours = imported_by_config(path)
    batch = tokens(VOCAB, (2, 70))  # past one 64-token chunk
    with torch.no_grad():
        logits = ours(batch)
        torch.testing.assert_close(logits, hf(batch).logits, rtol=1e-5, atol=1e-5)
    back = exports_as(ours, folder_args(path, 64), tmp_path / "export", type(hf).__name__, batch)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == [type(hf).__name__]
    with torch.no_grad():
        torch.testing.assert_close(back(batch).logits, logits, rtol=1e-5, atol=1e-5)


def test_greedy_generation_equals_transformers(folder):
    hf, path = folder
    greedy_ids_match(hf, imported_by_config(path), [5, 17, 42, 7, 99, 3, 150], 10, VOCAB)


def test_packed_documents_compute_as_if_each_were_alone(folder):
    """Block-causal: the linear layers' state and convolution window restart at each document (the full layers'
    mask too), so the logits of a packed row are those of its documents run one by one."""
    _, path = folder
    ours = imported_by_config(path)
    tokens = torch.randint(0, VOCAB, (1, 90), generator=torch.Generator().manual_seed(2))
    cuts = [0, 23, 24, 71, 90]  # a one-token document, and one crossing the 64-token chunk boundary
    documents = torch.zeros(1, 90, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        documents[:, a:b] = i
    with torch.no_grad():
        packed = ours(tokens, sequence=Sequence(documents=documents))
        alone = torch.cat([ours(tokens[:, a:b]) for a, b in zip(cuts, cuts[1:])], dim=1)
        whole = ours(tokens)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (packed[:, 30:] - whole[:, 30:]).abs().max() > 1e-3  # documents do change what the later tokens see


def test_a_published_multimodal_config_reads_its_text_model():
    text = {k: v for k, v in TEXT.items() if k not in ("pad_token_id", "bos_token_id", "eos_token_id")}
    config = {"model_type": "qwen3_5", "text_config": {**text, "model_type": "qwen3_5_text"}, "vision_config": {}}
    args = args_from_hf_config(config)
    assert (args.family, args.n_layers, args.rotary_dim, args.linear_value_heads) == ("qwen3_5", 4, 8, 4)
    moe = {"model_type": "qwen3_5_moe", "text_config": {**text, **MOE, "model_type": "qwen3_5_moe_text"}}
    assert args_from_hf_config(moe).moe.n_experts == 4


@pytest.mark.parametrize(
    "change, field",
    [
        ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, "layer_types"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.3}}, "partial_rotary_factor"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_what_qwen3_5_cannot_mean_is_refused_naming_the_field(change, field):
    config = {**TEXT, "model_type": "qwen3_5_text", **change}
    with pytest.raises(ConfigError, match=field) as refused:
        args_from_hf_config(config, "config.json:")
    assert "\n" not in str(refused.value)


def test_the_linear_attention_backend_is_chosen_for_the_device_or_refused_in_one_line():
    from titanlite.models.build import linear_backend
    from titanlite.models.registry import model_args

    hybrid, dense = model_args("qwen3_5", "debug", 256, 64), model_args("qwen3", "debug", 256, 64)
    backend, why = linear_backend(hybrid, "auto", "cpu")
    assert (backend, why) == ("torch", "its Triton kernels need a CUDA device, and this run is on cpu")
    assert linear_backend(hybrid, "torch", "cpu")[0] == "torch"
    with pytest.raises(ConfigError, match="model.linear_attn_backend='fla' cannot run here: its Triton kernels"):
        linear_backend(hybrid, "fla", "cpu")
    assert linear_backend(dense, "auto", "cpu") == ("torch", "")
    with pytest.raises(ConfigError, match="'torch' changes nothing: model qwen3 has no linear-attention or Mamba-2"):
        linear_backend(dense, "torch", "cpu")
    mamba = model_args("nemotron_h", "debug", 256, 64)  # its Mamba-2 layers' scan takes the same choice
    assert linear_backend(mamba, "auto", "cpu") == ("torch", why)
    with pytest.raises(ConfigError, match="model.linear_attn_backend='fla' cannot run here: its Triton kernels"):
        linear_backend(mamba, "fla", "cpu")


VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, out_hidden_size=64,
              num_position_embeddings=16, temporal_patch_size=1, spatial_merge_size=2)  # fmt: skip


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """A published-style Qwen3.5 folder: Qwen3_5ForConditionalGeneration (text model under model.language_model.*,
    a vision tower under model.visual.*) with multi-token-prediction tensors (mtp.*) beside them, as Qwen's are."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    text = {k: v for k, v in TEXT.items() if k not in ("pad_token_id", "bos_token_id", "eos_token_id")}
    config = transformers.Qwen3_5Config(text_config=text, vision_config=VISION)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    path = tmp_path_factory.mktemp("multimodal")
    hf.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    tensors["mtp.layers.0.mlp.up_proj.weight"] = torch.randn(96, 64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return hf, path


def test_a_multimodal_folder_trains_its_text_model_and_exports_back_into_its_layout(multimodal, tmp_path, caplog):
    """Import reads text_config and model.language_model.*, says what it leaves out; the export writes the trained
    text weights back under model.language_model.*, the folder's config.json with them, and the vision tower and mtp
    tensors unchanged: it loads again as Qwen3_5ForConditionalGeneration, with our logits."""
    from safetensors.torch import load_file

    hf, path = multimodal
    with caplog.at_level("INFO"):
        ours = imported_by_config(path)
    assert "tensors the model does not train (model.visual.*, mtp.fc.*, mtp.layers.*)" in caplog.text
    tokens = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = ours(tokens)
        torch.testing.assert_close(logits, hf(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)
    trained = {k: v + 0.01 if k.endswith("wo.weight") else v for k, v in ours.state_dict().items()}
    ours.load_state_dict(trained)
    save_hf(tmp_path / "export", folder_args(path, 64), ours.state_dict(), carry_from=path)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["vision_config"]["depth"] == 1
    assert config["text_config"]["model_type"] == "qwen3_5_text"
    before, after = load_file(path / "model.safetensors"), load_file(tmp_path / "export" / "model.safetensors")
    carried = [k for k in before if k.startswith(("model.visual.", "mtp."))]
    assert len(carried) > 3 and all(torch.equal(before[k], after[k]) for k in carried)
    assert set(after) == set(before)  # the same tensors, under the same names
    back = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


def test_mtp_tensors_of_another_width_are_refused_before_the_run(multimodal, tmp_path):
    """mtp.* that do not fit the text model (mtp.fc for another hidden size; a block unlike the full-attention
    layers') would be carried into an export transformers cannot load: one line naming the tensor."""
    from safetensors.torch import load_file, save_file

    from titanlite.components.hf_weights import WeightReader, check_tensors
    from titanlite.models.hf_config import folder_model_args

    _, path = multimodal
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    for name, shape in (("mtp.fc.weight", (64, 96)), ("mtp.layers.0.mlp.up_proj.weight", (80, 64))):
        tensors = load_file(path / "model.safetensors") | {name: torch.randn(shape)}
        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ConfigError, match=f"tensor '{name}', carried .* has shape \\({shape[0]}, {shape[1]}\\)"):
            check_tensors(folder_model_args(tmp_path), WeightReader(tmp_path))


def test_initial_weights_start_the_linear_layers_output_norms_at_one_and_the_zero_centred_norms_at_zero():
    """The (1 + w) norms start at 0 (a factor of one); the linear layers' output norm multiplies by its weight as it
    is, so it starts at 1 (at 0 every linear layer would output zeros), as transformers initialises both."""
    from titanlite.models.common.init import init_weights
    from titanlite.models.registry import model_args

    model = model_from_args(model_args("qwen3_5", "debug", 256, 64))
    init_weights(model, seed=0)
    linear = model.layers["0"].attention
    assert torch.equal(linear.norm.weight, torch.ones_like(linear.norm.weight))
    for norm in (model.norm, model.layers["0"].attention_norm, model.layers["3"].attention.q_norm):
        assert torch.equal(norm.weight, torch.zeros_like(norm.weight))
    a = linear.A_log.exp()
    assert bool((a >= 0.01).all() and (a <= 16).all()) and torch.equal(linear.dt_bias, torch.ones_like(linear.dt_bias))


def test_a_flash_linear_attention_install_that_cannot_compute_here_falls_back_saying_why(monkeypatch):
    """fla_smoke runs both kernels once against the PyTorch path: one that raises, or computes something else, is
    a reason to fall back (resolve_backend's "auto" then takes the PyTorch path and the start-up line says why)."""
    import sys
    import types

    from titanlite.models.common import gated_delta_net
    from titanlite.models.common.linear_attention import gated_delta_rule_chunked

    def exact(q, k, v, g, beta, cu_seqlens=None, output_final_state=False):
        documents = torch.zeros(1, q.shape[1], dtype=torch.long)
        documents[:, cu_seqlens[1:-1]] = 1
        documents = documents.cumsum(dim=1)
        return gated_delta_rule_chunked(q, k, v, g, beta, documents=documents)[0], None

    def off(*args, **kwargs):
        return exact(*args, **kwargs)[0] + 0.01, None

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    for kernels, why in ((exact, None), (off, "differs from the PyTorch path by 0.01"), (broken, "no kernel image")):
        fla = types.ModuleType("fla.ops.gated_delta_rule")
        kda = types.ModuleType("fla.ops.kda")
        fla.chunk_gated_delta_rule, kda.chunk_kda = kernels, kernels  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fla)
        monkeypatch.setitem(sys.modules, "fla.ops.kda", kda)
        reason = gated_delta_net.fla_smoke(torch.device("cpu"))
        assert (reason is None) if why is None else (why in reason), reason

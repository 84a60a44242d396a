"""Quantized Hugging Face folders as published: DeepSeek-V3's FP8 (e4m3 weights, a float32 scale_inv per block, the
edge blocks partial) and gpt-oss's MXFP4 experts (e2m1 values, a power-of-two scale per 32) import dequantized, with
the logits of the same model read from a dequantized copy (transformers' own MXFP4 decoding makes gpt-oss's copy);
the start-up line says what the folder was; incomplete or damaged scales and other quantizations are refused in one
line before anything runs."""

import json
import logging
from collections.abc import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is an optional test dependency")

from safetensors.torch import load_file, save_file  # noqa: E402

from tests.unit.test_deepseek_v3 import random_deepseek  # noqa: E402
from tests.unit.test_gpt_oss import SHAPE as GPT_OSS  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.components.hf_quantized import dequantize_fp8, dequantize_mxfp4, quantize_fp8  # noqa: E402
from titanlite.components.hf_weights import WeightReader, check_tensors, load_hf_into  # noqa: E402
from titanlite.models.build import model_from_args, with_mtp_layers  # noqa: E402
from titanlite.models.hf_config import folder_args, folder_model_args  # noqa: E402

BLOCK = [16, 24]  # no dimension of the tiny models is a multiple of both: partial edge blocks everywhere


def rewrite(folder, tensors: dict, config_changes: dict) -> None:
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))


def fp8_folders(hf, root, quantized: Callable[[str], bool], block=BLOCK, fmt: str = "e4m3"):
    """transformers model `hf` saved twice under `root`: "fp8", its 2-D weights whose names `quantized` takes in e4m3
    with a float32 weight_scale_inv per `block` (partial at the edges) and a quantization_config naming the format
    `fmt`, as published folders are; and "plain", the same weights dequantized. Returns (the fp8 folder, its stored
    tensors, transformers' model of the plain folder)."""
    for name in ("fp8", "plain"):
        hf.save_pretrained(root / name)
    stored, dequantized = load_file(root / "fp8" / "model.safetensors"), {}
    for name, tensor in list(stored.items()):
        if tensor.dim() == 2 and quantized(name):
            weight, scale = quantize_fp8(tensor, tuple(block))
            stored[name], stored[name + "_scale_inv"] = weight, scale
            dequantized[name] = dequantize_fp8(weight, scale, tuple(block))
    assert len(dequantized) > 4, sorted(dequantized)
    method = {"quant_method": "fp8", "fmt": fmt, "activation_scheme": "dynamic", "weight_block_size": list(block)}
    rewrite(root / "fp8", stored, {"quantization_config": method})
    rewrite(root / "plain", {**load_file(root / "plain" / "model.safetensors"), **dequantized}, {})
    reference = type(hf).from_pretrained(root / "plain", dtype=torch.float32).eval()
    return root / "fp8", stored, reference


def imported_logits(folder, tokens) -> torch.Tensor:
    model = model_from_args(folder_args(folder, 64))
    load_hf_into([model], folder)
    with torch.no_grad():
        return model.eval()(tokens)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """A DeepSeek-V3 folder with its projections in FP8 blocks as published (not the router, norms, embedding and
    head), and the same weights dequantized in a plain copy that transformers loads."""
    root = tmp_path_factory.mktemp("fp8")
    quantized, stored, reference = fp8_folders(
        random_deepseek(), root, lambda name: name.endswith(("_proj.weight", "a_proj_with_mqa.weight"))
    )
    return quantized, reference, stored


def test_an_fp8_folder_imports_with_the_logits_of_its_dequantized_weights(fp8, caplog):
    folder, reference, _ = fp8
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="titanlite"):
        ours = imported_logits(folder, tokens)
    assert "is quantized (fp8 (e4m3) in 16 x 24 blocks, quantization_config): each weight dequantized" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(ours, reference(tokens).logits, rtol=1e-5, atol=1e-5)


def test_fp8_blocks_round_trip_within_e4m3s_rounding():
    value = torch.randn(40, 50) * torch.logspace(-2, 2, 50)  # columns of very different sizes
    weight, scale = quantize_fp8(value, (16, 24))
    assert weight.dtype == torch.float8_e4m3fn and scale.shape == (3, 3)  # the edge blocks partial
    back = dequantize_fp8(weight, scale, (16, 24))
    # e4m3 keeps 3 mantissa bits (a relative error of at most 2^-4), and steps of 2^-9 of its block's scale below
    # its smallest normal value
    per_value = scale.repeat_interleave(16, 0)[:40].repeat_interleave(24, 1)[:, :50]
    assert ((back - value).abs() <= value.abs() * 2**-4 + per_value * 2**-9).all()
    assert (back - value).abs().max() > 0  # rounded, not kept


@pytest.mark.parametrize(
    "damage, refusal",
    [
        ("drop", "but the folder has no 'model.layers.0.self_attn.o_proj.weight_scale_inv'"),
        ("shape", "need float32 (4, 2)"),
        ("dtype", "need float32"),
    ],
)
def test_incomplete_or_damaged_fp8_scales_are_one_line(fp8, tmp_path, damage, refusal):
    folder, _, stored = fp8
    for file in ("config.json",):
        (tmp_path / file).write_text((folder / file).read_text())
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    tensors = dict(stored)
    if damage == "drop":
        del tensors[name]
    elif damage == "shape":
        tensors[name] = tensors[name][:, :1].contiguous()
    else:
        tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=refusal.replace("(", r"\(").replace(")", r"\)")) as refused:
        check_tensors(folder_model_args(tmp_path), WeightReader(tmp_path))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("fmt, read", [("e4m3", True), ("float8_e4m3fn", True), ("e5m2", False)])
def test_the_fp8_format_is_e4m3_by_either_name(tmp_path, fmt, read):
    """DeepSeek's and GLM's folders write fmt "e4m3", MiniMax-M2's "float8_e4m3fn" (torch's name): the same format."""
    from titanlite.base.hf_config import quantization_of

    config = {"quantization_config": {"quant_method": "fp8", "fmt": fmt, "weight_block_size": [128, 128]}}
    if read:
        assert quantization_of(config, "c:") == {"method": "fp8", "block": (128, 128)}
    else:
        with pytest.raises(ConfigError, match="quantization_config.fmt='e5m2' is not supported: titanlite reads fp8"):
            quantization_of(config, "c:")


def test_a_quantization_titanlite_does_not_read_is_refused_naming_the_ones_it_does(tmp_path):
    random_deepseek().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ConfigError, match="quant_method 'gptq'.*titanlite reads fp8 \\(block-scaled e4m3\\) and mxfp4"):
        folder_model_args(tmp_path)


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """A gpt-oss folder with its experts in MXFP4 as published: gate_up_proj_blocks [E, 2I, D / 32, 16] and _scales
    [E, 2I, D / 32] (and down_proj's), and transformers' model of the same weights decoded by its own
    convert_moe_packed_tensors from a plain copy."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = tmp_path_factory.mktemp("mxfp4")
    shape = {**GPT_OSS, "intermediate_size": 64}  # both expert widths multiples of 32
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**shape))
    hf.save_pretrained(root / "mxfp4")
    hf.save_pretrained(root / "plain")
    stored = load_file(root / "mxfp4" / "model.safetensors")
    plain = load_file(root / "plain" / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for name in [n for n in stored if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, width, rows = stored[name].shape  # unquantized [E, in, out]: blocks run over `in`
        blocks = torch.randint(0, 256, (experts, rows, width // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(119, 124, (experts, rows, width // 32), dtype=torch.uint8, generator=generator)
        del stored[name]
        stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
        plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        torch.testing.assert_close(dequantize_mxfp4(blocks, scales), plain[name], rtol=0, atol=0)
    rewrite(root / "mxfp4", stored, {"quantization_config": {"quant_method": "mxfp4"}})
    rewrite(root / "plain", plain, {})
    reference = transformers.GptOssForCausalLM.from_pretrained(root / "plain", dtype=torch.float32).eval()
    return root / "mxfp4", reference


def test_an_mxfp4_gpt_oss_folder_imports_with_transformers_dequantized_logits(mxfp4):
    folder, reference = mxfp4
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
    ours = imported_logits(folder, tokens)
    with torch.no_grad():
        torch.testing.assert_close(ours, reference(tokens).logits, rtol=1e-5, atol=1e-5)


def test_a_slice_of_rows_reads_as_those_rows_of_the_whole(fp8, mxfp4):
    """What a rank keeps of a quantized tensor (reading its rows' blocks and scales only) is the whole tensor's rows:
    FP8 rows cut inside blocks of 16, MXFP4 experts."""
    reader = WeightReader(fp8[0])
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    whole = reader.get(name)
    for rows in (range(5), range(7, 30), range(17, whole.shape[0])):
        assert torch.equal(reader.get(name, rows), whole[rows.start : rows.stop])
    reader = WeightReader(mxfp4[0])
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(reader.get(name, range(1, 3)), reader.get(name)[1:3])


def test_multi_token_prediction_layers_are_exported_bit_for_bit_while_not_trained(tmp_path, caplog):
    """DeepSeek-V3's layer past the decoder (num_nextn_predict_layers) with model.mtp_layers = 0: left out of the model
    with one line, carried into an export unchanged, and the export's config.json still counts it."""
    from titanlite.components.hf_weights import save_hf

    hf = random_deepseek()
    hf.save_pretrained(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    mtp = {"model.layers.3.enorm.weight": torch.randn(64), "model.layers.3.eh_proj.weight": torch.randn(64, 128)}
    rewrite(tmp_path / "hf", {**weights, **mtp}, {"num_nextn_predict_layers": 1})
    args = with_mtp_layers(folder_args(tmp_path / "hf", 64), 0)
    model = model_from_args(args)
    with caplog.at_level(logging.INFO, logger="titanlite"):
        load_hf_into([model], tmp_path / "hf")
    assert "also holds 2 tensors the model does not train (model.layers.*): left out of the run, carried" in caplog.text
    save_hf(tmp_path / "export", args, model.state_dict(), carry_from=tmp_path / "hf")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(exported[k], v) for k, v in mtp.items())
    assert json.loads((tmp_path / "export" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, model.eval()(tokens), rtol=1e-5, atol=1e-5)


def test_an_fp8_export_writes_the_folders_blocks_and_reads_back_with_the_same_logits(fp8, tmp_path):
    """checkpoint.export_quantized: the weights the folder held in FP8 blocks are written so again (scales from the
    values), its quantization_config kept; read back by the same import, the logits are the first import's (an
    unchanged weight re-quantizes to itself; a trained one moves by at most e4m3's rounding, 2^-4 of a value)."""
    from titanlite.components.hf_weights import save_hf

    folder, _, stored = fp8
    args = folder_args(folder, 64)
    model = model_from_args(args)
    load_hf_into([model], folder)
    save_hf(tmp_path / "export", args, model.state_dict(), carry_from=folder, quantized=True)
    exported = load_file(tmp_path / "export" / "model.safetensors")
    quantized = [k for k, v in stored.items() if v.dtype == torch.float8_e4m3fn]
    assert all(exported[k].dtype == torch.float8_e4m3fn and k + "_scale_inv" in exported for k in quantized)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["quantization_config"] == json.loads((folder / "config.json").read_text())["quantization_config"]
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        first = model.eval()(tokens)
    torch.testing.assert_close(imported_logits(tmp_path / "export", tokens), first, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="checkpoint.export_quantized writes the FP8 blocks .* started from none"):
        save_hf(tmp_path / "none", args, model.state_dict(), quantized=True)
    assert not (tmp_path / "none").exists()


def with_mtp_layer(fp8, folder) -> dict:
    """The FP8 DeepSeek-V3 folder with a multi-token-prediction layer as published (model.layers.3, past the 3 of
    the decoder: a copy of layer 2's block, its norms, eh_proj in FP8 blocks too, shared_head.norm); its tensors."""
    source, _, stored = fp8
    folder.mkdir()
    (folder / "config.json").write_text((source / "config.json").read_text())
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in stored.items() if ".layers.2." in k}
    mtp |= {f"model.layers.3.{n}.weight": torch.randn(64) for n in ("enorm", "hnorm", "shared_head.norm")}
    eh_proj = quantize_fp8(torch.randn(64, 128), tuple(BLOCK))
    mtp |= {"model.layers.3.eh_proj.weight": eh_proj[0], "model.layers.3.eh_proj.weight_scale_inv": eh_proj[1]}
    rewrite(folder, {**stored, **mtp}, {"num_nextn_predict_layers": 1})
    return mtp


def test_an_fp8_folders_carried_layer_is_exported_as_stored_or_dequantized_with_the_export(fp8, tmp_path, caplog):
    """Carried FP8 tensors keep their values and scales bit for bit in an FP8 export; an export in the training dtype
    (no quantization_config) writes them dequantized to it, and says so."""
    from titanlite.components.hf_weights import save_hf

    mtp = with_mtp_layer(fp8, tmp_path / "hf")
    args = with_mtp_layers(folder_args(tmp_path / "hf", 64), 0)  # model.mtp_layers = 0: the layer is carried
    model = model_from_args(args)
    load_hf_into([model], tmp_path / "hf")
    save_hf(tmp_path / "fp8", args, model.state_dict(), carry_from=tmp_path / "hf", quantized=True)
    exported = load_file(tmp_path / "fp8" / "model.safetensors")
    assert all(exported[k].dtype == v.dtype and torch.equal(exported[k].view(torch.uint8), v.view(torch.uint8))
               for k, v in mtp.items())  # fmt: skip
    with caplog.at_level(logging.INFO, logger="titanlite"):
        save_hf(tmp_path / "bf16", args, model.state_dict(), torch.bfloat16, carry_from=tmp_path / "hf")
    assert "carried tensors held in fp8 in" in caplog.text and "written dequantized to bfloat16" in caplog.text
    exported = load_file(tmp_path / "bf16" / "model.safetensors")
    name = "model.layers.3.eh_proj.weight"
    assert name + "_scale_inv" not in exported
    expected = dequantize_fp8(mtp[name], mtp[name + "_scale_inv"], tuple(BLOCK)).to(torch.bfloat16)
    assert torch.equal(exported[name], expected)


@pytest.mark.parametrize(
    "name, shape",
    [("model.layers.3.eh_proj.weight", (64, 96)), ("model.layers.3.mlp.shared_experts.up_proj.weight", (40, 64))],
)
def test_a_carried_layer_of_another_width_is_refused_before_the_run_and_the_export(fp8, tmp_path, name, shape):
    from titanlite.components.hf_weights import save_hf

    mtp = with_mtp_layer(fp8, tmp_path / "hf")
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    stored[name] = torch.randn(shape)
    stored.pop(name + "_scale_inv", None)
    rewrite(tmp_path / "hf", stored, {})
    refusal = (
        f"tensor '{name}', carried \\(not trained\\) into the run's export, has shape \\({shape[0]}, {shape[1]}\\)"
    )
    with pytest.raises(ConfigError, match=refusal) as refused:
        check_tensors(with_mtp_layers(folder_model_args(tmp_path / "hf"), 0), WeightReader(tmp_path / "hf"))
    assert "\n" not in str(refused.value) and len(mtp) > 10
    args = with_mtp_layers(folder_args(tmp_path / "hf", 64), 0)  # model.mtp_layers = 0: the layer is carried
    with pytest.raises(ConfigError, match=refusal):
        save_hf(tmp_path / "export", args, model_from_args(args).state_dict(), carry_from=tmp_path / "hf")
    assert not (tmp_path / "export").exists()

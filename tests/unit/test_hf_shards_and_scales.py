"""A Hugging Face folder's files read as they mean (issue 71): a tensor stored in two shards is read from the one
model.safetensors.index.json names, two differing copies the index does not resolve are refused naming both files,
an index that does not match its files is one line; FP8 block scales must be finite and positive and MXFP4's
exponents at most 252 (so no dequantized value overflows float32 or bfloat16); scale tensors without the
quantization_config that reads them are one line saying so; an unsupported model_type lists each one once; a
quantized export says what transformers needs to read it. Tiny folders written by hand, in process."""

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from titanlite.base.errors import ConfigError
from titanlite.components.hf_weights import INDEX_FILE, WeightReader, export_loads, load_hf_into, save_hf
from titanlite.models.build import model_from_args
from titanlite.models.hf_config import folder_args
from titanlite.models.registry import model_args, spec_of_model_type

A, B = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
ONE, TWO = torch.ones(2, 3), torch.full((2, 3), 2.0)


def folder_of(folder: Path, shards: dict, weight_map=None, config: dict | None = None) -> Path:
    """`folder` holding safetensors files {file: {name: tensor}}, an index of `weight_map` (given one) and a config.json
    of `config` (given one)."""
    for file, tensors in shards.items():
        save_file({name: t.clone() for name, t in tensors.items()}, folder / file, metadata={"format": "pt"})
    if weight_map is not None:
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def refused(make) -> str:
    with pytest.raises(ConfigError) as refusal:
        make()
    line = str(refusal.value)
    assert "\n" not in line, line
    return line


# ---- a tensor in two files ---------------------------------------------------------------------------------------


def test_a_tensor_in_two_shards_is_read_from_the_one_the_index_names(tmp_path):
    folder = folder_of(tmp_path, {A: {"x": ONE, "y": ONE}, B: {"x": TWO, "z": TWO}}, {"x": A, "y": A, "z": B})
    reader = WeightReader(folder)
    assert torch.equal(reader.get("x"), ONE)
    assert sorted(reader.keys()) == ["x", "y", "z"]


def test_differing_copies_the_index_does_not_resolve_are_refused_naming_both_files(tmp_path):
    folder = folder_of(tmp_path, {A: {"x": ONE, "y": ONE}, B: {"x": TWO, "z": TWO}}, {"y": A, "z": B})
    line = refused(lambda: WeightReader(folder))
    assert line.startswith(f"{folder}: tensor 'x' is stored in both {A} and {B} with different values"), line
    assert f"{INDEX_FILE} does not name either" in line


def test_identical_copies_the_index_does_not_name_are_read(tmp_path):
    folder = folder_of(tmp_path, {A: {"x": ONE, "y": ONE}, B: {"x": ONE.clone(), "z": TWO}}, {"y": A, "z": B})
    assert torch.equal(WeightReader(folder).get("x"), ONE)


@pytest.mark.parametrize("elsewhere", [True, False], ids=["in another file", "in no file"])
def test_an_index_naming_a_file_that_does_not_hold_the_tensor_is_refused(tmp_path, elsewhere):
    shards = {A: {"y": ONE}, B: {"z": TWO, **({"x": TWO} if elsewhere else {})}}
    folder = folder_of(tmp_path, shards, {"x": A, "y": A, "z": B})
    line = refused(lambda: WeightReader(folder))
    where = f"{B} holds it" if elsewhere else "no file of the folder holds it"
    assert line.startswith(f"{folder / INDEX_FILE}: weight_map puts 'x' in {A}, which does not hold it ({where})")
    assert "download the folder again" in line


@pytest.mark.parametrize(
    "index, said",
    [
        ({"weight_map": {"y": A, "z": "model-00003-of-00003.safetensors"}}, "does not exist; the folder is incomplete"),
        ({"weight_map": {"y": A, "z": None}}, "weight_map['z'] is None, not a safetensors file of the folder"),
        ({"weight_map": {"y": A, "z": "../x.safetensors"}}, "not a safetensors file of the folder"),
        ([A], "has no weight_map"),
    ],
    ids=["missing file", "null file", "file outside", "not an object"],
)
def test_a_damaged_index_is_one_line(tmp_path, index, said):
    folder = folder_of(tmp_path, {A: {"y": ONE}})
    (folder / INDEX_FILE).write_text(json.dumps(index))
    assert said in refused(lambda: WeightReader(folder))


def test_copies_in_two_shards_are_said_once_as_a_folder_is_loaded(tmp_path, caplog):
    """A real folder split into two shards: one tensor also stored, identical, in the file the index does not name,
    another with other values there (the index's copy is the one loaded); the load says each once."""
    args = model_args("llama3", "debug", 64, 32)
    save_hf(tmp_path, args, model_from_args(args).state_dict())
    tensors = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    other, same = first[:2]
    assert (other, same) == ("lm_head.weight", "model.embed_tokens.weight")
    save_file({n: tensors[n] for n in first}, tmp_path / A, metadata={"format": "pt"})
    stray = {same: tensors[same].clone(), other: tensors[other] + 1}
    save_file({**{n: tensors[n] for n in second}, **stray}, tmp_path / B, metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(first, A), **dict.fromkeys(second, B)}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = model_from_args(folder_args(tmp_path, 32))
    with caplog.at_level(logging.INFO, logger="titanlite"):
        load_hf_into([model], tmp_path)
    lines = [r.getMessage() for r in caplog.records]
    assert [line for line in lines if "identical copies" in line] == [
        f"  checkpoint: {tmp_path} stores 1 tensor in more than one file, identical copies (e.g. {same!r} in {A} "
        f"and {B}): each read once"
    ]
    assert [line for line in lines if "other values" in line] == [
        f"  checkpoint: {tmp_path} stores 1 tensor again in another file with other values (e.g. {other!r} in {B}): "
        f"each read from the file {INDEX_FILE} names (transformers 5 reads the copy in the file last by name, "
        "whatever the index says): remove the stray copies"
    ]
    assert torch.equal(model.output.weight.detach(), tensors[other])  # the copy the index names


# ---- FP8 and MXFP4 scales ----------------------------------------------------------------------------------------

FP8_CONFIG = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [2, 4]}}


def fp8_folder(folder: Path, scale_inv: torch.Tensor, columns: int = 6, config: dict | None = FP8_CONFIG) -> Path:
    """A weight 'w' [4, columns] of e4m3 ones in 2 x 4 blocks with `scale_inv`, and a plain 'n'."""
    weight = torch.ones(4, columns).to(torch.float8_e4m3fn)
    return folder_of(folder, {"model.safetensors": {"w": weight, "w_scale_inv": scale_inv, "n": ONE}}, config=config)


@pytest.mark.parametrize(
    "scales, said",
    [
        ([[1.0, 0.0], [1.0, 1.0]], "holds 1 scale that is not finite and positive (the first: 0.0)"),
        ([[1.0, -0.5], [-2.0, 1.0]], "holds 2 scales that are not finite and positive (the first: -0.5)"),
        ([[1.0, 1.0], [float("nan"), 1.0]], "holds 1 scale that is not finite and positive (the first: nan)"),
        ([[float("inf"), 1.0], [1.0, 1.0]], "holds 1 scale that is not finite and positive (the first: inf)"),
    ],
    ids=["zero", "negative", "NaN", "infinite"],
)
def test_fp8_scales_must_be_finite_and_positive(tmp_path, scales, said):
    reader = WeightReader(fp8_folder(tmp_path, torch.tensor(scales)))
    line = refused(lambda: reader.get("w"))
    assert line.startswith(f"{tmp_path}: tensor 'w_scale_inv' in model.safetensors {said}; each block of 'w' is"), line
    assert "the folder is damaged" in line


def test_positive_fp8_scales_are_read(tmp_path):
    reader = WeightReader(fp8_folder(tmp_path, torch.tensor([[1.0, 2.0], [0.5, 2.0**-100]])))
    assert reader.get("w")[:, 4:].tolist() == [[2.0, 2.0], [2.0, 2.0], [2.0**-100] * 2, [2.0**-100] * 2]


MXFP4_CONFIG = {"quantization_config": {"quant_method": "mxfp4"}}


@pytest.mark.parametrize("exponent, nibbles", [(253, 0x77), (255, 0x00)], ids=["overflows", "NaN of E8M0"])
def test_mxfp4_exponents_above_252_are_refused(tmp_path, exponent, nibbles):
    blocks = torch.full((1, 2, 1, 16), nibbles, dtype=torch.uint8)  # 0x77: every value 6, e2m1's largest
    scales = torch.tensor([[[127], [exponent]]], dtype=torch.uint8)
    shards = {"model.safetensors": {"e_blocks": blocks, "e_scales": scales}}
    reader = WeightReader(folder_of(tmp_path, shards, config=MXFP4_CONFIG))
    line = refused(lambda: reader.get("e"))
    assert line.startswith(
        f"{tmp_path}: tensor 'e_scales' in model.safetensors holds 1 exponent above 252 (the first: {exponent}); "
    ), line


def test_mxfp4_exponent_252_reads_finite_in_float32_and_bfloat16(tmp_path):
    blocks = torch.full((1, 2, 1, 16), 0x77, dtype=torch.uint8)
    scales = torch.tensor([[[0], [252]]], dtype=torch.uint8)
    shards = {"model.safetensors": {"e_blocks": blocks, "e_scales": scales}}
    value = WeightReader(folder_of(tmp_path, shards, config=MXFP4_CONFIG)).get("e")
    assert value[:, :, 1].unique().tolist() == [6 * 2.0**125]
    assert value.bfloat16().isfinite().all()


@pytest.mark.parametrize("method", ["fp8", "mxfp4"])
def test_scales_without_a_quantization_config_are_one_line(tmp_path, method):
    if method == "fp8":
        weight, scale = torch.ones(4, 6).to(torch.float8_e4m3fn), torch.ones(2, 2)
        tensors = {"a.weight": weight, "a.weight_scale_inv": scale, "b.weight": weight, "b.weight_scale_inv": scale}
    else:
        tensors = {"e_blocks": torch.zeros(1, 2, 1, 16, dtype=torch.uint8), "e_scales": torch.zeros(1, 2, 1).byte()}
    folder = folder_of(tmp_path, {"model.safetensors": {**tensors, "n": ONE}}, config={"model_type": "qwen3"})
    line = refused(lambda: WeightReader(folder))
    if method == "fp8":
        assert line.startswith(
            f"{folder}: tensor 'a.weight_scale_inv' and 1 more are FP8 block scales (of float8_e4m3 weights), but "
            f"{folder / 'config.json'} has no quantization_config to read them by; add the folder's own"
        ), line
        assert '"weight_block_size": [128, 128]' in line
    else:
        assert line.startswith(
            f"{folder}: tensor 'e_scales' is MXFP4 scales (of 'e_blocks'), but {folder / 'config.json'} has no "
            "quantization_config to read them by; add"
        ), line


# ---- the lines that name what titanlite and transformers read ----------------------------------------------------


def test_an_unsupported_model_type_is_refused_listing_each_one_read_once():
    line = refused(lambda: spec_of_model_type("gemma", "c:"))
    listed = re.findall(r"'([^']+)'", line.split("titanlite reads", 1)[1])
    assert len(listed) == len(set(listed)), listed
    assert {"llama", "gemma4_text", "gemma4", "qwen3_5_text", "qwen3_5"} <= set(listed)


def test_an_exports_last_line_says_what_transformers_needs_to_load_it(tmp_path):
    for name in ("plain", "whole", "partial"):
        (tmp_path / name).mkdir()
    plain = folder_of(tmp_path / "plain", {"model.safetensors": {"n": ONE}}, config={})
    assert export_loads(plain, "bfloat16") == ("bfloat16", "AutoModelForCausalLM and AutoTokenizer load it offline")
    what, loads = export_loads(fp8_folder(tmp_path / "whole", torch.ones(2, 2), columns=8), "float32")
    (tmp_path / "one").mkdir()  # 3 columns in one block of 4: read right, as transformers takes one block for them
    assert export_loads(fp8_folder(tmp_path / "one", torch.ones(2, 1), columns=3), "float32") == (what, loads)
    assert what == "fp8 (e4m3) in 2 x 4 blocks, the other weights float32"
    assert loads == (
        "AutoTokenizer loads it offline, and AutoModelForCausalLM with accelerate installed (transformers' fp8 reader "
        "needs it: pip install accelerate)"
    )
    _, loads = export_loads(fp8_folder(tmp_path / "partial", torch.ones(2, 2), columns=6), "float32")
    assert loads.startswith("AutoTokenizer loads it offline, and AutoModelForCausalLM with accelerate installed (pip")
    assert "1 of its fp8 weights ends in partial blocks (e.g. 'w' (4, 6))" in loads

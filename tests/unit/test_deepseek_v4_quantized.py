"""DeepSeek-V4's published format (deepseek-ai/DeepSeek-V4-Flash and -Pro): the attention's and shared experts' weights
e4m3 with an E8M0 scale (X.scale, a power of two) per 128 x 128 block, the routed experts fp4 (int8 holding two e2m1
values, low nibble first) with an E8M0 scale per 32 values of a row, the top level named without "model.". A random
transformers DeepSeek-V4 quantized so imports with transformers' logits of the dequantized weights; a NaN scale or an
fp4 weight without its scales is refused in one line naming it; checkpoint.export_quantized writes the format back,
the multi-token prediction layer's (mtp.0.*, its projections fp8 and its experts fp4) too."""

import json
import math
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

from safetensors.torch import load_file, save_file  # noqa: E402

import tests.unit.test_deepseek_v4 as v4  # noqa: E402
from tests.conformance import imported_by_config  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.base.hf_config import quantization_of  # noqa: E402
from titanlite.components.hf_weights import WeightReader, load_hf_into, save_hf  # noqa: E402
from titanlite.models.build import model_from_args  # noqa: E402
from titanlite.models.hf_config import folder_args  # noqa: E402

QUANTIZATION = {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}  # fmt: skip
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP8_WEIGHTS = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight")


def published_name(name: str) -> str:
    """transformers' saved name -> the published checkpoints' (no "model." at the top level)."""
    name = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}.get(name, name)
    return name.replace("model.hc_head.hc_", "hc_head_").removeprefix("model.")


def fp8_e8m0(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 values, E8M0 scales, the dequantized weight) of `weight`, each block's scale the power of two covering
    its largest magnitude over 448."""
    rows, cols = weight.shape
    values = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    exponents = torch.empty(math.ceil(rows / block), math.ceil(cols / block), dtype=torch.uint8)
    dequantized = torch.empty(rows, cols)
    for i in range(exponents.shape[0]):
        for j in range(exponents.shape[1]):
            cut = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
            exponent = math.ceil(math.log2(weight[cut].abs().max().item() / 448))
            values[cut] = (weight[cut] / 2.0**exponent).to(torch.float8_e4m3fn)
            exponents[i, j] = exponent + 127
            dequantized[cut] = values[cut].float() * 2.0**exponent
    return values, exponents.view(torch.float8_e8m0fnu), dequantized


def fp4_e8m0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 of two e2m1 codes a byte, low nibble first; E8M0 scales per 32 values of a row; the dequantized weight)
    of `weight`, each value rounded to the nearest e2m1 one."""
    rows, cols = weight.shape
    groups = weight.view(rows, cols // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(dim=-1) / 6))  # [rows, cols / 32]
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - E2M1).abs().argmin(dim=-1).view(rows, cols)  # the nearest e2m1 value's code
    dequantized = E2M1[codes] * torch.exp2(exponent).repeat_interleave(32, dim=-1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu), dequantized


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the published-format folder, transformers' model of its dequantized weights). The experts 32 wide, so that
    32 divides every expert row."""
    root = tmp_path_factory.mktemp("deepseek_v4_quantized")
    with mock.patch.dict(v4.CONFIG, moe_intermediate_size=32):
        v4.random_model().save_pretrained(root / "plain")
    config = json.loads((root / "plain" / "config.json").read_text())
    # The published MTP layer: layer 3's block (a CSA layer, as compress_ratios' last entry says) as mtp.0, and the
    # depth's own tensors, its two projections fp8 as published
    config |= {"num_nextn_predict_layers": 1, "compress_ratios": [0, 4, 128, 4, 4]}
    plain = load_file(root / "plain" / "model.safetensors")
    dim, generator = config["hidden_size"], torch.Generator().manual_seed(3)
    layer3 = {k: t for k, t in plain.items() if k.startswith("model.layers.3.")}
    plain |= {k.replace("model.layers.3.", "mtp.0."): t.clone() for k, t in layer3.items()}
    for name, shape in (("e_proj.weight", (dim, dim)), ("h_proj.weight", (dim, dim)), ("hc_head_fn", (3, 3 * dim)),
                        ("hc_head_base", (3,)), ("hc_head_scale", (1,))):  # fmt: skip
        plain[f"mtp.0.{name}"] = 0.3 * torch.randn(shape, generator=generator)
    plain |= {f"mtp.0.{norm}.weight": torch.ones(dim) for norm in ("enorm", "hnorm", "norm")}
    stored, dequantized = {}, {}
    for name, tensor in plain.items():
        theirs = published_name(name)
        if name.endswith((*FP8_WEIGHTS, ".e_proj.weight", ".h_proj.weight")) or ".shared_experts." in name:
            stored[theirs], stored[theirs.removesuffix("weight") + "scale"], dequantized[name] = fp8_e8m0(tensor, 128)
        elif ".ffn.experts." in name:
            stored[theirs], stored[theirs.removesuffix("weight") + "scale"], dequantized[name] = fp4_e8m0(tensor)
        else:
            stored[theirs], dequantized[name] = tensor, tensor
    for folder, tensors, extra in (
        ("published", stored, {"quantization_config": QUANTIZATION, "expert_dtype": "fp4"}),
        ("dequantized", dequantized, {}),
    ):
        (root / folder).mkdir()
        save_file(tensors, root / folder / "model.safetensors")
        (root / folder / "config.json").write_text(json.dumps({**config, **extra}))
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(root / "dequantized", experts_implementation="eager")
    return root / "published", hf.eval()


def test_the_published_format_imports_with_transformers_logits_of_its_dequantized_weights(folders, caplog):
    folder, hf = folders
    stored = load_file(folder / "model.safetensors")
    assert stored["layers.1.attn.wo_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.1.attn.wo_a.scale"].dtype == torch.float8_e8m0fnu
    assert stored["layers.1.ffn.experts.2.w2.weight"].dtype == torch.int8
    assert stored["layers.1.ffn.experts.2.w2.scale"].shape == (32, 1)
    with caplog.at_level("INFO"):
        ours = imported_by_config(folder)
    assert "is quantized (fp8 (e4m3) in 128 x 128 blocks and fp4 (e2m1), quantization_config)" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(ours(v4.TOKENS), hf(v4.TOKENS, use_cache=False).logits, rtol=1e-5, atol=1e-5)


def tampered(folder: Path, tmp_path: Path, change) -> Path:
    """A copy of `folder` whose tensors `change(tensors)` edits in place."""
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    tensors = load_file(copy / "model.safetensors")
    change(tensors)
    save_file(tensors, copy / "model.safetensors")
    return copy


@pytest.mark.parametrize(
    "scale, largest",
    [("layers.2.attn.wq_b.scale", 246), ("layers.3.ffn.experts.1.w3.scale", 252)],
    ids=["fp8 weight", "fp4 expert"],
)
def test_a_nan_scale_is_refused_in_one_line_naming_it(folders, tmp_path, scale, largest):
    """255 is E8M0's NaN; above 246 (e4m3's 448) or 252 (e2m1's 6) the weight would overflow float32."""

    def nan(tensors):
        tensors[scale].view(torch.uint8)[0, 0] = 255

    with pytest.raises(ConfigError) as refused:
        imported_by_config(tampered(folders[0], tmp_path, nan))
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"{tmp_path / 'copy'}: tensor {scale!r} in model.safetensors holds 1 exponent above "), line
    assert f"above {largest} (the first: 255)" in line


@pytest.mark.parametrize("expert_dtype", ["fp4", None], ids=["expert_dtype fp4", "no expert_dtype"])
def test_an_int8_weight_without_its_scales_is_refused_naming_it(folders, tmp_path, expert_dtype):
    """Under expert_dtype "fp4" it is an fp4 weight whose scales are missing; without it, an int8 tensor (as any
    integer weight is)."""
    weight = "layers.1.ffn.experts.0.w1.weight"
    copy = tampered(folders[0], tmp_path, lambda tensors: tensors.pop("layers.1.ffn.experts.0.w1.scale"))
    config = json.loads((copy / "config.json").read_text())
    if expert_dtype is None:
        del config["expert_dtype"]
    (copy / "config.json").write_text(json.dumps(config))
    why = "is fp4 but the folder has no 'layers.1.ffn.experts.0.w1.scale'" if expert_dtype else "is int8"
    with pytest.raises(ConfigError, match=f"^{copy}: tensor '{weight}' {why}"):
        imported_by_config(copy)


def test_another_scale_format_or_expert_dtype_is_refused_naming_it():
    config = {"quantization_config": QUANTIZATION, "expert_dtype": "fp4"}
    assert quantization_of(config, "c:") == {
        "method": "fp8", "block": (128, 128), "scale_fmt": "ue8m0", "expert_dtype": "fp4",
    }  # fmt: skip
    inside = {"quantization_config": {**QUANTIZATION, "expert_dtype": "fp8"}}  # where transformers 5 moves it
    assert quantization_of(inside, "c:")["expert_dtype"] == "fp8"
    for changed, line in [
        ({"quantization_config": {**QUANTIZATION, "scale_fmt": "e5m2"}}, "c: quantization_config.scale_fmt='e5m2'"),
        ({**config, "expert_dtype": "int4"}, "c: expert_dtype='int4' is not supported"),
        ({"quantization_config": {**QUANTIZATION, "expert_dtype": "nf4"}}, "c: quantization_config.expert_dtype='nf4'"),
    ]:
        with pytest.raises(ConfigError, match=f"^{line}"):
            quantization_of(changed, "c:")


def test_an_export_quantized_writes_the_format_back_to_the_same_values(folders, tmp_path):
    """checkpoint.export_quantized of a run that started from the folder: the same weights fp8 with E8M0 block scales
    and fp4 experts (in transformers' names), the same quantization_config with expert_dtype in it; every weight reads
    back to the folder's dequantized values, and the export imports with the same logits."""
    folder = folders[0]
    args = folder_args(folder, 64)
    model = model_from_args(args)
    load_hf_into([model], folder)
    save_hf(tmp_path / "export", args, model.state_dict(), carry_from=folder, quantized=True)
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert exported["model.layers.1.attn.wo_a.weight"].dtype == torch.float8_e4m3fn
    assert exported["model.layers.1.attn.wo_a.scale"].dtype == torch.float8_e8m0fnu
    assert exported["model.layers.1.ffn.experts.2.w2.weight"].dtype == torch.int8
    assert exported["model.layers.1.ffn.experts.2.w2.scale"].dtype == torch.float8_e8m0fnu
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["quantization_config"] == {**QUANTIZATION, "expert_dtype": "fp4"}
    source, back = WeightReader(folder), WeightReader(tmp_path / "export")
    quantized = list(source.logical.names)
    assert len(quantized) == 5 * (5 + 3 + 4 * 3) + 2  # the MTP layer's block and its e_proj and h_proj among them
    assert exported["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
    assert exported["mtp.0.ffn.experts.1.w1.weight"].dtype == torch.int8
    for name in quantized:
        torch.testing.assert_close(back.get(name if name.startswith("mtp.") else "model." + name), source.get(name),
                                   rtol=0, atol=0)  # fmt: skip
    with torch.no_grad():
        ahead = {"mtp_tokens": v4.TOKENS[:, 1:2].expand(-1, v4.TOKENS.shape[1])[..., None]}
        torch.testing.assert_close(
            imported_by_config(tmp_path / "export")(v4.TOKENS, **ahead),
            model.eval()(v4.TOKENS, **ahead),
            rtol=1e-5,
            atol=1e-5,
        )

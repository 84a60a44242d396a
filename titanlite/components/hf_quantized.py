"""Quantized Hugging Face folders read as the tensors they stand for: each quantized weight and its scales are shown
as one tensor of the weight's logical name and shape, dequantized to float32 when it is read (one tensor at a time, as
every weight is read: the host never holds the whole model twice).

- "fp8" (quantization_config {"quant_method": "fp8", "weight_block_size": [r, c]}): a weight X.weight of e4m3 values
  [R, C] and X.weight_scale_inv, float32 [ceil(R / r), ceil(C / c)], one scale per block (the blocks at the right and
  bottom edges may be partial); the value is weight * scale_inv of its block.
- "mxfp4" (gpt-oss's experts): X_blocks, uint8 [..., N, G, 16], two e2m1 values a byte (low nibble first), and
  X_scales, uint8 [..., N, G], an exponent biased by 127 per 32 values; the value [..., N, G * 32] is transposed to
  [..., G * 32, N], the layout of the unquantized tensor X, as transformers dequantizes it.

The checks a folder's quantized tensors must pass (a scale present, of its dtype, of the shape its block size gives)
are made when a tensor's header is asked (WeightReader.header), which `titanlite check` and the launcher do for every
tensor before a run starts; the scales' values when they are read (`titanlite check` reads every one of a folder of up
to 4 GiB): every fp8 scale finite and positive (zero would make its block zeros, a negative one flip its signs), every
mxfp4 exponent at most MXFP4_MAX_EXPONENT. Scale tensors in a folder whose config.json declares no quantization are
refused as such (check_unconfigured_scales), not as tensors the model has no place for."""

from __future__ import annotations

import math

import torch

from titanlite.base.errors import ConfigError

FP8_SCALE = "_scale_inv"  # X.weight's scales are X.weight_scale_inv
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
FP8_DTYPES = ("F8_E4M3",)
# e2m1: sign, two exponent bits, one mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# The largest mxfp4 exponent read. A scale byte e (E8M0) stands for 2^(e - 127) and e2m1 values reach 6, so a value is
# at most 6 * 2^(e - 127): e = 252 gives 1.5 * 2^127, below float32's and bfloat16's largest (both about 2^128), and
# e = 253 overflows them (dequantized as titanlite and transformers' convert_moe_packed_tensors do, ldexp with the bias
# 127, in float32 or bfloat16); 255 is E8M0's NaN. Small exponents are kept: 0 (2^-127) is what an all-zero block gets.
MXFP4_MAX_EXPONENT = 252


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scales an fp8 weight of `shape` [R, C] needs: ceil(R / r) x ceil(C / c)."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 `weight` [R, C] times the float32 `scale_inv` of its block, in float32."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * scale


def quantize_fp8(value: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`value` [R, C] as e4m3 values and a float32 scale_inv per block (the block's largest magnitude over e4m3's
    largest, 448): the inverse of dequantize_fp8 up to e4m3's rounding."""
    rows, cols = value.shape
    r, c = block
    grid = fp8_scale_shape((rows, cols), block)
    padded = torch.zeros(grid[0] * r, grid[1] * c, dtype=torch.float32, device=value.device)
    padded[:rows, :cols] = value.float()
    blocks = padded.view(grid[0], r, grid[1], c)
    scale_inv = blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
    scale_inv = torch.where(scale_inv > 0, scale_inv, torch.ones_like(scale_inv))
    quantized = (blocks / scale_inv[:, None, :, None]).view(grid[0] * r, grid[1] * c)[:rows, :cols]
    return quantized.to(torch.float8_e4m3fn).contiguous(), scale_inv.contiguous()


def mxfp4_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The unquantized tensor's shape of mxfp4 blocks [..., N, G, 16]: [..., G * 32, N]."""
    *prefix, rows, groups, width = blocks_shape
    return (*prefix, groups * width * 2, rows)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """mxfp4 `blocks` uint8 [..., N, G, 16] with `scales` uint8 [..., N, G] as float32 [..., G * 32, N]."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., N, G, 16, 2]
    values = values.flatten(-2)  # [..., N, G, 32], low nibble first
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).transpose(-1, -2).contiguous()


def _counted(count: int, what: str) -> str:
    return f"{count:,} {what}{'s' * (count > 1)} that {'are' if count > 1 else 'is'}"


def check_fp8_scales(scale_inv: torch.Tensor, where: str, weight: str) -> None:
    """Refuse an fp8 weight's scales (`where`: "folder: tensor 'X.weight_scale_inv' in file") unless every one is
    finite and positive: a block's values are its e4m3 values times its scale, so a zero one makes them zeros and a
    negative one flips their signs, silently."""
    flat = scale_inv.reshape(-1).float()
    bad = ~(flat.isfinite() & (flat > 0))
    count = int(bad.sum())
    if count:
        raise ConfigError(
            f"{where} holds {_counted(count, 'scale')} not finite and positive (the first: {flat[bad][0].item()}); "
            f"each block of {weight!r} is its e4m3 values times its scale, so the weight would be zeros, of flipped "
            "signs or NaN: the folder is damaged, download or export it again"
        )


def check_mxfp4_scales(scales: torch.Tensor, where: str) -> None:
    """Refuse mxfp4 exponents above MXFP4_MAX_EXPONENT (`where`: "folder: tensor 'X_scales' in file"): their values
    overflow float32 and bfloat16, and 255 is E8M0's NaN."""
    flat = scales.reshape(-1)
    bad = flat.to(torch.int32) > MXFP4_MAX_EXPONENT
    count = int(bad.sum())
    if count:
        raise ConfigError(
            f"{where} holds {count:,} exponent{'s' * (count > 1)} above {MXFP4_MAX_EXPONENT} (the first: "
            f"{int(flat[bad][0])}); a scale is 2^(exponent - 127) and e2m1 values reach 6, so above "
            f"{MXFP4_MAX_EXPONENT} the weight overflows float32 and bfloat16 (255 is E8M0's NaN): the folder is "
            "damaged, download it again"
        )


def check_unconfigured_scales(raw: list[str], header, folder, config) -> None:
    """In a folder whose config.json (`config`, a path) declares no quantization: refuse fp8 scales (X.weight_scale_inv
    beside an e4m3 X.weight) or mxfp4 ones (X_scales beside X_blocks) in one line saying so, rather than as tensors the
    model has no place for (`header(raw) -> (dtype, shape)`)."""
    present = set(raw)
    fp8 = [
        name
        for name in raw
        if name.endswith(FP8_SCALE)
        and name.removesuffix(FP8_SCALE) in present
        and header(name.removesuffix(FP8_SCALE))[0] in FP8_DTYPES
    ]
    if fp8:
        more = f" and {len(fp8) - 1} more are" if len(fp8) > 1 else " is"
        raise ConfigError(
            f"{folder}: tensor {fp8[0]!r}{more} FP8 block scales (of float8_e4m3 weights), but {config} has no "
            "quantization_config to read them by; add the folder's own (DeepSeek-V3's is \"quantization_config\": "
            '{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}) '
            "to it, or use a copy of the folder in bfloat16"
        )
    mxfp4 = [
        name
        for name in raw
        if name.endswith(MXFP4_SCALES)
        and name.removesuffix(MXFP4_SCALES) + MXFP4_BLOCKS in present
        and header(name.removesuffix(MXFP4_SCALES) + MXFP4_BLOCKS)[0] == "U8"
    ]
    if mxfp4:
        blocks = mxfp4[0].removesuffix(MXFP4_SCALES) + MXFP4_BLOCKS
        which = f" and {len(mxfp4) - 1} more are" if len(mxfp4) > 1 else " is"
        raise ConfigError(
            f"{folder}: tensor {mxfp4[0]!r}{which} MXFP4 scales (of {blocks!r}), but {config} has no "
            'quantization_config to read them by; add gpt-oss\'s, "quantization_config": {"quant_method": "mxfp4"}, '
            "to it"
        )


class QuantizedTensors:
    """The logical tensors of a folder's raw ones under its quantization (`method` "fp8" with `block`, or "mxfp4"):
    `names` maps each logical name to the raw names it is read from; everything else is itself. Built from the raw
    names, dtypes and shapes (`header(raw) -> (dtype, shape)`), reading nothing."""

    def __init__(self, quantization: dict | None, raw: list[str], header, folder, file_of=None) -> None:
        self.method = quantization["method"] if quantization else None
        self.block: tuple[int, int] = quantization.get("block", (0, 0)) if quantization else (0, 0)
        self.folder, self.header = folder, header
        self.file_of = file_of  # a raw tensor's file name, for the refusals of its values (None: not said)
        self.names: dict[str, tuple[str, ...]] = {}
        present = set(raw)
        hidden: set[str] = set()
        for name in raw:
            if self.method == "fp8" and header(name)[0] in FP8_DTYPES:
                self.names[name] = (name, name + FP8_SCALE)
                hidden.add(name + FP8_SCALE)
            elif self.method == "mxfp4" and name.endswith(MXFP4_BLOCKS):
                base = name.removesuffix(MXFP4_BLOCKS)
                self.names[base] = (name, base + MXFP4_SCALES)
                hidden |= {name, base + MXFP4_SCALES}
        self.missing = {parts[1] for parts in self.names.values() if parts[1] not in present}
        self.plain = [name for name in raw if name not in hidden and name not in self.names]

    def keys(self) -> list[str]:
        return [*self.plain, *self.names]

    def logical_header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype as the folder stores it, or "FP8" / "MXFP4" for a quantized weight with its scales, as no stored
        dtype is named; the logical shape), its scales checked: present, of their dtype and of the shape the weight
        and block size give."""
        if name not in self.names:
            return self.header(name)
        raw, scale = self.names[name]
        dtype, shape = self.header(raw)
        where = f"{self.folder}: tensor {raw!r}"
        if scale in self.missing:
            raise ConfigError(f"{where} is {self.method} but the folder has no {scale!r}; the folder is incomplete")
        scale_dtype, scale_shape = self.header(scale)
        if self.method == "fp8":
            expected = fp8_scale_shape(shape, self.block)
            if len(shape) != 2 or scale_dtype not in ("F32", "BF16") or scale_shape != expected:
                raise ConfigError(
                    f"{where} has scales {scale!r} of {scale_dtype} {scale_shape}, but {self.block[0]} x "
                    f"{self.block[1]} blocks of a {shape} weight need float32 {expected}; the folder is damaged or "
                    "its quantization_config.weight_block_size is not the one it was saved with"
                )
            return "FP8", shape
        if dtype != "U8" or scale_dtype != "U8" or scale_shape != shape[:-1] or shape[-1] != 16:
            raise ConfigError(
                f"{where} ({dtype} {shape}) with scales {scale!r} ({scale_dtype} {scale_shape}) is not mxfp4: blocks "
                "are uint8 [..., N, G, 16] and scales uint8 [..., N, G]"
            )
        return "MXFP4", mxfp4_shape(shape)

    def read(self, name: str, get, rows: range | None = None) -> torch.Tensor:
        """The logical tensor `name`, dequantized to float32 where it is quantized (`get(raw, rows)` reads a raw one,
        or its rows `rows` of the first dimension); with `rows`, only those rows of the logical tensor, read from only
        the raw rows (and blocks of scales) they are made from."""
        if name not in self.names:
            return get(name, rows)
        self.logical_header(name)
        raw, scale = self.names[name]
        where = f"{self.folder}: tensor {scale!r}" + (f" in {self.file_of(scale)}" if self.file_of else "")
        if self.method == "mxfp4":  # the first dimension (the experts) is the raw tensors' first too
            scales = get(scale, rows)
            check_mxfp4_scales(scales, where)
            return dequantize_mxfp4(get(raw, rows), scales)
        if rows is None:
            scale_inv = get(scale, None)
            check_fp8_scales(scale_inv, where, raw)
            return dequantize_fp8(get(raw, None), scale_inv, self.block)
        # The whole blocks of rows that hold `rows`, dequantized, then cut to them.
        size = self.block[0]
        first, end = rows.start // size, math.ceil(rows.stop / size)
        stored = self.header(raw)[1][0]
        scale_inv = get(scale, range(first, end))
        check_fp8_scales(scale_inv, where, raw)
        weight = get(raw, range(first * size, min(end * size, stored)))
        value = dequantize_fp8(weight, scale_inv, self.block)
        return value[rows.start - first * size : rows.stop - first * size]

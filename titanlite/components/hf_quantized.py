"""Quantized Hugging Face folders read as the tensors they stand for: each quantized weight and its scales are shown
as one tensor of the weight's logical name and shape, dequantized to float32 when it is read (one tensor at a time, as
every weight is read: the host never holds the whole model twice).

- "fp8" (quantization_config {"quant_method": "fp8", "weight_block_size": [r, c]}): a weight X.weight of e4m3 values
  [R, C] and X.weight_scale_inv, float32 [ceil(R / r), ceil(C / c)], one scale per block (the blocks at the right and
  bottom edges may be partial); the value is weight * scale_inv of its block.
- "mxfp4" (gpt-oss's experts): X_blocks, uint8 [..., N, G, 16], two e2m1 values a byte (low nibble first), and
  X_scales, uint8 [..., N, G], an exponent biased by 127 per 32 values; the value [..., N, G * 32] is transposed to
  [..., G * 32, N], the layout of the unquantized tensor X, as transformers dequantizes it.
- DeepSeek-V4's (fp8 with scale_fmt "ue8m0", expert_dtype "fp4"): a weight's scales are X.scale (for X.weight), E8M0
  bytes e standing for 2^(e - 127): an e4m3 weight [R, C] has one per block, as fp8's scale_inv; an int8 one [R, C / 2]
  (an fp4 expert) holds two e2m1 values a byte (low nibble first) of the weight [R, C], rows its output features as
  nn.Linear's, and X.scale [R, C / 32] one per 32 consecutive values of a row.

The checks a folder's quantized tensors must pass (a scale present, of its dtype, of the shape its block size gives)
are made when a tensor's header is asked (WeightReader.header), which `titanlite check` and the launcher do for every
tensor before a run starts; the scales' values when they are read (`titanlite check` reads every one of a folder of up
to 4 GiB): every float fp8 scale finite and positive (zero would make its block zeros, a negative one flip its signs),
every E8M0 exponent at most the largest whose values stay finite (MXFP4_MAX_EXPONENT, FP8_MAX_EXPONENT). Scale tensors
in a folder whose config.json declares no quantization are refused as such (check_unconfigured_scales), not as tensors
the model has no place for. checkpoint.export_quantized writes an fp8 folder's weights back in its own format
(QuantizedTensors.quantize)."""

from __future__ import annotations

import math

import torch

from titanlite.base.errors import ConfigError

FP8_SCALE = "_scale_inv"  # X.weight's scales are X.weight_scale_inv
E8M0_SCALE = ".scale"  # DeepSeek-V4's: X.weight's scales are X.scale, powers of two
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
FP8_DTYPES = ("F8_E4M3",)
FP4_DTYPES = ("I8",)  # two e2m1 values a byte, as DeepSeek-V4's experts are stored
E8M0_DTYPES = ("F8_E8M0", "U8")  # a power-of-two scale's exponent byte, as safetensors names it (or raw bytes)
FP4_GROUP = 32  # the values of a row one fp4 scale covers
# e2m1: sign, two exponent bits, one mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# The largest mxfp4 exponent read. A scale byte e (E8M0) stands for 2^(e - 127) and e2m1 values reach 6, so a value is
# at most 6 * 2^(e - 127): e = 252 gives 1.5 * 2^127, below float32's and bfloat16's largest (both about 2^128), and
# e = 253 overflows them (dequantized as titanlite and transformers' convert_moe_packed_tensors do, ldexp with the bias
# 127, in float32 or bfloat16); 255 is E8M0's NaN. Small exponents are kept: 0 (2^-127) is what an all-zero block gets.
MXFP4_MAX_EXPONENT = 252
# The same for e4m3 values, which reach 448 = 1.75 * 2^8: e = 246 gives 1.75 * 2^127, and e = 247 overflows.
FP8_MAX_EXPONENT = 246
E2M1_MAX = 6.0


def exponents(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (torch.float8_e8m0fnu, as safetensors reads F8_E8M0, or raw uint8) as their exponent bytes."""
    return scales.view(torch.uint8) if scales.dtype == torch.float8_e8m0fnu else scales.to(torch.uint8)


def powers_of_two(exponent_bytes: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes e as the float32 scales 2^(e - 127) they stand for."""
    ones = torch.ones(exponent_bytes.shape, dtype=torch.float32, device=exponent_bytes.device)
    return torch.ldexp(ones, exponent_bytes.to(torch.int32) - 127)


def scale_exponents(amax: torch.Tensor, largest: float) -> torch.Tensor:
    """The E8M0 exponent bytes of the smallest powers of two s with amax / s at most `largest` (e4m3's 448, e2m1's
    6): ceil(log2(amax / largest)) + 127; an all-zero block gets 127 (a scale of 1)."""
    exponent = torch.ceil(torch.log2(amax.float() / largest))
    exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent))
    return (exponent + 127).clamp(0, 254).to(torch.uint8)


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scales an fp8 weight of `shape` [R, C] needs: ceil(R / r) x ceil(C / c)."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 `weight` [R, C] times the float32 `scale_inv` of its block, in float32."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * scale


def _blocks_of(value: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """`value` [R, C] in float32, zero-padded to whole blocks and viewed as [R / r, r, C / c, c] (rounded up)."""
    rows, cols = value.shape
    r, c = block
    grid = fp8_scale_shape((rows, cols), block)
    padded = torch.zeros(grid[0] * r, grid[1] * c, dtype=torch.float32, device=value.device)
    padded[:rows, :cols] = value.float()
    return padded.view(grid[0], r, grid[1], c)


def _e4m3_of(blocks: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The blocks [R / r, r, C / c, c] over each block's `scale` [R / r, C / c] as e4m3 values, cut to `shape`."""
    grid_rows, r, grid_cols, c = blocks.shape
    quantized = (blocks / scale[:, None, :, None]).view(grid_rows * r, grid_cols * c)[: shape[0], : shape[1]]
    return quantized.to(torch.float8_e4m3fn).contiguous()


def quantize_fp8(value: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`value` [R, C] as e4m3 values and a float32 scale_inv per block (the block's largest magnitude over e4m3's
    largest, 448): the inverse of dequantize_fp8 up to e4m3's rounding."""
    blocks = _blocks_of(value, block)
    scale_inv = blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
    scale_inv = torch.where(scale_inv > 0, scale_inv, torch.ones_like(scale_inv))
    return _e4m3_of(blocks, scale_inv, tuple(value.shape)), scale_inv.contiguous()


def quantize_fp8_e8m0(value: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`value` [R, C] as e4m3 values and an E8M0 scale per block (the power of two covering the block's largest
    magnitude over 448), as DeepSeek-V4's folders store it: the inverse of dequantize_fp8 up to e4m3's rounding."""
    blocks = _blocks_of(value, block)
    exponent = scale_exponents(blocks.abs().amax(dim=(1, 3)), torch.finfo(torch.float8_e4m3fn).max)
    quantized = _e4m3_of(blocks, powers_of_two(exponent), tuple(value.shape))
    return quantized, exponent.view(torch.float8_e8m0fnu).contiguous()


def fp4_shape(packed_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The weight's shape of fp4 values packed [R, C / 2]: [R, C]."""
    return (*packed_shape[:-1], packed_shape[-1] * 2)


def fp4_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scales an fp4 weight of `shape` [R, C] needs: one per 32 values of a row, [R, ceil(C / 32)]."""
    return (*shape[:-1], math.ceil(shape[-1] / FP4_GROUP))


def dequantize_fp4(packed: torch.Tensor, exponent_bytes: torch.Tensor) -> torch.Tensor:
    """fp4 values packed two a byte `packed` (int8 [R, C / 2], low nibble first) with E8M0 `exponent_bytes`
    [R, ceil(C / 32)] as float32 [R, C]."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    raw = packed.contiguous().view(torch.uint8)
    values = torch.stack([lut[(raw & 0x0F).long()], lut[(raw >> 4).long()]], dim=-1).flatten(-2)
    scale = powers_of_two(exponent_bytes).repeat_interleave(FP4_GROUP, dim=-1)[..., : values.shape[-1]]
    return values * scale


def quantize_fp4(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`value` [R, C] (C even) as fp4 values packed two a byte (int8 [R, C / 2], low nibble first) and an E8M0 scale
    per 32 values of a row (the power of two covering their largest magnitude over 6), each value rounded to the
    nearest e2m1 one: the inverse of dequantize_fp4 up to that rounding."""
    rows, cols = value.shape
    groups = math.ceil(cols / FP4_GROUP)
    padded = torch.zeros(rows, groups * FP4_GROUP, dtype=torch.float32, device=value.device)
    padded[:, :cols] = value.float()
    padded = padded.view(rows, groups, FP4_GROUP)
    exponent = scale_exponents(padded.abs().amax(dim=-1), E2M1_MAX)
    scaled = (padded / powers_of_two(exponent)[..., None]).view(rows, -1)[:, :cols]
    magnitudes = torch.tensor(E2M1[:8], dtype=torch.float32, device=value.device)
    nearest = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # e2m1's code of the magnitude, 0..7
    codes = (nearest + 8 * ((scaled < 0) & (nearest > 0))).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8).contiguous(), exponent.view(torch.float8_e8m0fnu).contiguous()


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


def check_exponents(exponent_bytes: torch.Tensor, where: str, fp8: bool = False) -> None:
    """Refuse E8M0 exponents above the largest whose values stay finite (`where`: "folder: tensor 'X_scales' in
    file"): MXFP4_MAX_EXPONENT for e2m1 values, FP8_MAX_EXPONENT for e4m3 ones (`fp8`); above it the values overflow
    float32 and bfloat16, and 255 is E8M0's NaN."""
    largest, values = (
        (FP8_MAX_EXPONENT, "e4m3 values reach 448") if fp8 else (MXFP4_MAX_EXPONENT, "e2m1 values reach 6")
    )
    flat = exponent_bytes.reshape(-1)
    bad = flat.to(torch.int32) > largest
    count = int(bad.sum())
    if count:
        raise ConfigError(
            f"{where} holds {count:,} exponent{'s' * (count > 1)} above {largest} (the first: {int(flat[bad][0])}); a "
            f"scale is 2^(exponent - 127) and {values}, so above {largest} the weight overflows float32 and bfloat16 "
            "(255 is E8M0's NaN): the folder is damaged, download it again"
        )


def _weight_of_scale(name: str) -> str | None:
    """The weight a scale tensor's name belongs to (X.weight of X.weight_scale_inv or X.scale); None for another."""
    if name.endswith(FP8_SCALE):
        return name.removesuffix(FP8_SCALE)
    return name.removesuffix(E8M0_SCALE) + ".weight" if name.endswith(E8M0_SCALE) else None


def scale_names(weight: str) -> tuple[str, ...]:
    """The names an fp8 or fp4 weight's scales may have: X.weight_scale_inv, and X.scale for X.weight."""
    return (weight + FP8_SCALE, *((weight.removesuffix(".weight") + E8M0_SCALE,) if weight.endswith(".weight") else ()))


def check_unconfigured_scales(raw: list[str], header, folder, config) -> None:
    """In a folder whose config.json (`config`, a path) declares no quantization: refuse fp8 scales (X.weight_scale_inv
    or X.scale beside an e4m3 or fp4 X.weight) or mxfp4 ones (X_scales beside X_blocks) in one line saying so, rather
    than as tensors the model has no place for (`header(raw) -> (dtype, shape)`)."""
    present = set(raw)
    fp8 = [name for name in raw if (weight := _weight_of_scale(name)) in present and header(weight)[0] in FP8_DTYPES]
    fp8 += [name for name in raw if (weight := _weight_of_scale(name)) in present and header(weight)[0] in FP4_DTYPES]
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
    `names` maps each logical name to the raw names it is read from, `kinds` to how ("fp8": e4m3 values with block
    scales, float32 or E8M0; "fp4": int8 holding two e2m1 values with an E8M0 scale per 32; "mxfp4"); everything else
    is itself. Built from the raw names, dtypes and shapes (`header(raw) -> (dtype, shape)`), reading nothing."""

    def __init__(self, quantization: dict | None, raw: list[str], header, folder, file_of=None) -> None:
        self.method = quantization["method"] if quantization else None
        self.block: tuple[int, int] = quantization.get("block", (0, 0)) if quantization else (0, 0)
        self.quantization = quantization or {}
        self.folder, self.header = folder, header
        self.file_of = file_of  # a raw tensor's file name, for the refusals of its values (None: not said)
        self.names: dict[str, tuple[str, ...]] = {}
        self.kinds: dict[str, str] = {}
        present = set(raw)
        for name in raw:
            dtype = header(name)[0]
            if self.method == "fp8" and dtype in FP8_DTYPES:
                self._add(name, "fp8", (name, self._scale_of(name, present)))
            elif self.method == "fp8" and dtype in FP4_DTYPES and self._is_fp4(name, present):
                self._add(name, "fp4", (name, self._scale_of(name, present)))
            elif self.method == "mxfp4" and name.endswith(MXFP4_BLOCKS):
                base = name.removesuffix(MXFP4_BLOCKS)
                self._add(base, "mxfp4", (name, base + MXFP4_SCALES))
        hidden = {part for parts in self.names.values() for part in parts}
        self.missing = {parts[1] for parts in self.names.values() if parts[1] not in present}
        self.plain = [name for name in raw if name not in hidden and name not in self.names]

    def _add(self, name: str, kind: str, parts: tuple[str, str]) -> None:
        self.names[name], self.kinds[name] = parts, kind

    def _scale_of(self, weight: str, present: set[str]) -> str:
        """The scales of an fp8 or fp4 weight: whichever of its scale_names the folder holds; where it holds none, the
        name its format gives them (X.scale for DeepSeek-V4's: scale_fmt "ue8m0" or expert_dtype "fp4")."""
        names = scale_names(weight)
        held = [name for name in names if name in present]
        ue8m0 = self.quantization.get("scale_fmt") == "ue8m0" or self.quantization.get("expert_dtype") == "fp4"
        return held[0] if held else names[-1] if ue8m0 else names[0]

    def _is_fp4(self, name: str, present: set[str]) -> bool:
        """Whether an int8 tensor is an fp4 weight: X.weight with X.scale beside it, or in a folder whose experts are
        fp4 (expert_dtype "fp4", its missing scale then refused as such). Any other int8 tensor is refused as one
        (hf_weights.check_tensors)."""
        if not name.endswith(".weight"):
            return False
        return scale_names(name)[-1] in present or self.quantization.get("expert_dtype") == "fp4"

    def keys(self) -> list[str]:
        return [*self.plain, *self.names]

    def logical_header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype as the folder stores it, or "FP8" / "FP4" / "MXFP4" for a quantized weight with its scales, as no
        stored dtype is named; the logical shape), its scales checked: present, of their dtype and of the shape the
        weight and block size give."""
        if name not in self.names:
            return self.header(name)
        raw, scale = self.names[name]
        dtype, shape = self.header(raw)
        where = f"{self.folder}: tensor {raw!r}"
        kind = self.kinds[name]
        if scale in self.missing:
            raise ConfigError(f"{where} is {kind} but the folder has no {scale!r}; the folder is incomplete")
        scale_dtype, scale_shape = self.header(scale)
        if kind == "fp8":
            return self._fp8_header(where, shape, scale, scale_dtype, scale_shape)
        if kind == "fp4":
            return self._fp4_header(where, shape, scale, scale_dtype, scale_shape)
        if dtype != "U8" or scale_dtype != "U8" or scale_shape != shape[:-1] or shape[-1] != 16:
            raise ConfigError(
                f"{where} ({dtype} {shape}) with scales {scale!r} ({scale_dtype} {scale_shape}) is not mxfp4: blocks "
                "are uint8 [..., N, G, 16] and scales uint8 [..., N, G]"
            )
        return "MXFP4", mxfp4_shape(shape)

    def _fp8_header(self, where: str, shape, scale: str, scale_dtype: str, scale_shape) -> tuple[str, tuple[int, ...]]:
        """An e4m3 weight's: its scales float32 (or bfloat16), or E8M0, one per block."""
        expected = fp8_scale_shape(shape, self.block) if len(shape) == 2 else None
        if scale_dtype not in ("F32", "BF16", *E8M0_DTYPES) or scale_shape != expected:
            need = "E8M0" if scale.endswith(E8M0_SCALE) else "float32"  # as DeepSeek-V4's X.scale, V3's scale_inv
            raise ConfigError(
                f"{where} has scales {scale!r} of {scale_dtype} {scale_shape}, but {self.block[0]} x "
                f"{self.block[1]} blocks of a {shape} weight need {need} {expected}; the folder is damaged or its "
                "quantization_config.weight_block_size is not the one it was saved with"
            )
        return "FP8", shape

    def _fp4_header(self, where: str, shape, scale: str, scale_dtype: str, scale_shape) -> tuple[str, tuple[int, ...]]:
        """An fp4 weight's (int8 [R, C / 2] standing for [R, C]): its scales E8M0 [R, ceil(C / 32)]."""
        logical = fp4_shape(shape)
        expected = fp4_scale_shape(logical)
        if len(shape) != 2 or scale_dtype not in E8M0_DTYPES or scale_shape != expected:
            raise ConfigError(
                f"{where} (int8 {shape}, fp4 values of a {logical} weight, two a byte) has scales {scale!r} of "
                f"{scale_dtype} {scale_shape}, but it needs one E8M0 scale per {FP4_GROUP} values of a row, F8_E8M0 "
                f"{expected}; the folder is damaged"
            )
        return "FP4", logical

    def read(self, name: str, get, rows: range | None = None) -> torch.Tensor:
        """The logical tensor `name`, dequantized to float32 where it is quantized (`get(raw, rows)` reads a raw one,
        or its rows `rows` of the first dimension); with `rows`, only those rows of the logical tensor, read from only
        the raw rows (and blocks of scales) they are made from."""
        if name not in self.names:
            return get(name, rows)
        self.logical_header(name)
        raw, scale = self.names[name]
        where = f"{self.folder}: tensor {scale!r}" + (f" in {self.file_of(scale)}" if self.file_of else "")
        kind = self.kinds[name]
        if kind in ("mxfp4", "fp4"):  # rows: the raw tensors' and their scales' first dimension too
            exponent_bytes = exponents(get(scale, rows))
            check_exponents(exponent_bytes, where)
            if kind == "fp4":
                return dequantize_fp4(get(raw, rows), exponent_bytes)
            return dequantize_mxfp4(get(raw, rows), exponent_bytes)
        if rows is None:
            return dequantize_fp8(get(raw, None), self._fp8_scales(get(scale, None), where, raw), self.block)
        # The whole blocks of rows that hold `rows`, dequantized, then cut to them.
        size = self.block[0]
        first, end = rows.start // size, math.ceil(rows.stop / size)
        stored = self.header(raw)[1][0]
        scale_inv = self._fp8_scales(get(scale, range(first, end)), where, raw)
        weight = get(raw, range(first * size, min(end * size, stored)))
        value = dequantize_fp8(weight, scale_inv, self.block)
        return value[rows.start - first * size : rows.stop - first * size]

    @staticmethod
    def _fp8_scales(scales: torch.Tensor, where: str, raw: str) -> torch.Tensor:
        """An fp8 weight's block scales as float32, checked: E8M0 ones (DeepSeek-V4's) as their powers of two."""
        if scales.dtype in (torch.float8_e8m0fnu, torch.uint8):
            exponent_bytes = exponents(scales)
            check_exponents(exponent_bytes, where, fp8=True)
            return powers_of_two(exponent_bytes)
        check_fp8_scales(scales, where, raw)
        return scales

    def quantize(self, name: str, export_name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """`value`, the new value of the folder's quantized weight `name`, quantized as the folder stores it, under the
        export's name for it (`export_name`) and its scales' (named as the folder names them): the write-back of
        checkpoint.export_quantized, of fp8 folders (an mxfp4 one is not written back)."""
        raw, scale = self.names[name]
        suffix = FP8_SCALE if scale == raw + FP8_SCALE else E8M0_SCALE
        scale_name = export_name + suffix if suffix == FP8_SCALE else export_name.removesuffix(".weight") + suffix
        if self.kinds[name] == "fp4":
            packed, exponent_bytes = quantize_fp4(value)
            return {export_name: packed, scale_name: exponent_bytes}
        if self.header(scale)[0] in E8M0_DTYPES:
            weight, scales = quantize_fp8_e8m0(value, self.block)
        else:
            weight, scales = quantize_fp8(value, self.block)
        return {export_name: weight, scale_name: scales}

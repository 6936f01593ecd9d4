"""Plain constants, scale layouts and input validation of the operator contract.

Both twins import this module: it holds no arithmetic on tensor values, only the facts of the
contract (format limits, scale-factor shapes and strides) and the checks every public entry point
makes on its arguments, so that the reference and the optimized kernels accept and refuse exactly
the same inputs with the same messages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def align(a: int, b: int) -> int:
    return ceil_div(a, b) * b


# ---------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantFormat:
    """A quantized element format.

    ``qmax`` is the largest finite magnitude; ``amax_floor`` the lower clamp of a block's absolute
    maximum (so that an all-zero block still gets a finite, non-zero scale); ``storage_dtype`` the
    torch dtype of the data tensor; ``values_per_byte`` how many elements share one stored byte
    (2/3 for e5m6, whose 12-bit values fill 12 bytes per 8 values).
    """

    name: str
    qmax: float
    amax_floor: float
    storage_dtype: torch.dtype
    values_per_byte: int | Fraction

    def logical_hidden(self, columns: int) -> int:
        """Values in a stored row of ``columns`` bytes (elements). Integer arithmetic only: under
        dynamic shapes (``torch.compile``, ``opcheck``) ``columns`` is a ``SymInt``."""
        ratio = Fraction(self.values_per_byte)
        return columns * ratio.numerator // ratio.denominator


E4M3 = QuantFormat("e4m3", 448.0, 1e-4, torch.float8_e4m3fn, 1)
# 6 * 2^-126: the smallest amax whose scale amax/6 is still a normal fp32 number.
E2M1 = QuantFormat("e2m1", 6.0, 6.0 * 2.0**-126, torch.int8, 2)

# e5m6 (the top 12 bits of an fp16): max finite 65024; the amax floor of e4m3. 8 values fill 12 bytes.
E5M6 = QuantFormat("e5m6", 65024.0, 1e-4, torch.uint8, Fraction(2, 3))
E5M6_GROUP_VALUES = 8
E5M6_GROUP_BYTES = 12

CAST_FORMATS = {f.name: f for f in (E4M3, E2M1)}
# per_token_cast alone also writes e5m6 (one scale per row only).
PER_TOKEN_CAST_FORMATS = {f.name: f for f in (E4M3, E2M1, E5M6)}
# The formats of quantized data a cast reads back, by the dtype of its data tensor (e5m6 is named
# by x_special_fmt instead: its uint8 bytes do not identify it).
QUANTIZED_DATA_FORMATS = {torch.float8_e4m3fn: E4M3, torch.int8: E2M1}
CAST_BACK_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CAST_INPUT_DTYPES = (torch.bfloat16, torch.float32)
PER_TOKEN_CHANNEL_BLOCKS = (16, 32, 64, 128)
PER_BLOCK_SIZES = (32, 128)  # bm and bk of per_block_cast
PER_CHANNEL_TOKEN_BLOCKS = (32, 128)  # num_per_tokens of the per-channel casts

# The code points of e2m1 (FP4): sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

UE8M0_BIAS = 127
UE8M0_NAN = 0xFF  # OCP E8M0: the all-ones exponent byte is NaN (a NaN or Inf scale encodes to it)
FP32_MANTISSA_MASK = 0x007FFFFF
FP32_EXPONENT_AND_SIGN_MASK = 0xFF800000


# ---------------------------------------------------------------------------------------------
# Scale-factor layouts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScaleLayout:
    """Where the scale of block (row r, column block k) lives.

    - ``row_major``: fp32 ``[rows, kblocks]``, contiguous.
    - ``col_major`` (``use_tma_aligned_col_major_sf``): fp32 ``[rows, kblocks]`` with strides
      ``(1, align(rows, 4))``, the layout TMA loads of FP8 GEMMs read.
    - ``packed_ue8m0``: int32 ``[rows, ceil(kblocks / 4)]`` with strides ``(1, align(rows, 4))``;
      byte ``k % 4`` (little-endian) of word ``k // 4`` holds the biased exponent of the
      power-of-two scale; unused bytes of the last word are zero.
    """

    kind: str  # "row_major" | "col_major" | "packed_ue8m0"

    @staticmethod
    def from_flags(use_tma_aligned_col_major_sf: bool, use_packed_ue8m0: bool) -> ScaleLayout:
        if use_packed_ue8m0:
            return ScaleLayout("packed_ue8m0")
        if use_tma_aligned_col_major_sf:
            return ScaleLayout("col_major")
        return ScaleLayout("row_major")

    @property
    def dtype(self) -> torch.dtype:
        return torch.int32 if self.kind == "packed_ue8m0" else torch.float32

    def logical_columns(self, kblocks: int) -> int:
        return ceil_div(kblocks, 4) if self.kind == "packed_ue8m0" else kblocks

    def leading_dimension(self, rows: int) -> int:
        """Distance between consecutive columns (col-major layouts) or rows (row-major)."""
        return align(rows, 4) if self.kind != "row_major" else 0

    def empty(self, rows: int, kblocks: int, device) -> torch.Tensor:
        """Allocate an uninitialized scale tensor with the contract's shape, dtype and strides."""
        columns = self.logical_columns(kblocks)
        if self.kind == "row_major":
            return torch.empty((rows, columns), dtype=torch.float32, device=device)
        storage = torch.empty((columns, align(rows, 4)), dtype=self.dtype, device=device)
        # narrow, not indexing: a fake CUDA tensor on a PyTorch built without CUDA can be narrowed
        # but not indexed from Python (the index sets a CUDA device guard that build lacks).
        return storage.T.narrow(0, 0, rows)


def per_token_scale_shape(num_tokens: int, hidden: int, num_per_channels: int) -> tuple[int, int]:
    return num_tokens, ceil_div(hidden, num_per_channels)


# ---------------------------------------------------------------------------------------------
# Validation shared by both twins
# ---------------------------------------------------------------------------------------------


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, value, *, dtypes=None, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got {value.dtype}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    return value


def check_shape(name: str, value: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(value.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(value.shape)}")


def check_int(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """A Python int (not a bool) with ``low <= value <= high`` where those are given."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if (low is not None and value < low) or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_nonnegative_float(name: str, value, *, allow_zero: bool = True) -> float:
    """A finite Python number ``>= 0`` (``> 0`` when ``allow_zero`` is False), returned as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite float {bound}, got {value!r}")
    return float(value)


def check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {sorted(allowed)!r}, got {value!r}")


def check_cast_format(fmt) -> QuantFormat:
    check_choice("fmt", fmt, CAST_FORMATS)
    return CAST_FORMATS[fmt]


def check_unit_inner_stride(name: str, x: torch.Tensor) -> None:
    if x.dim() == 2 and x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(
            f"{name} must have unit stride in its last dimension (a row stride larger than the "
            f"row is fine), got strides {tuple(x.stride())}; call .contiguous() first"
        )


def check_per_token_blocks(fmt: QuantFormat, hidden: int, num_per_channels) -> None:
    if isinstance(num_per_channels, bool) or not isinstance(num_per_channels, int):
        raise TypeError(f"num_per_channels must be an int, got {type(num_per_channels).__name__}")
    if num_per_channels < 1:
        raise ValueError(f"num_per_channels must be positive, got {num_per_channels}")
    if num_per_channels not in PER_TOKEN_CHANNEL_BLOCKS and num_per_channels != hidden:
        raise ValueError(
            f"num_per_channels must be one of {PER_TOKEN_CHANNEL_BLOCKS} or the hidden size "
            f"{hidden}, got {num_per_channels}"
        )
    if fmt.values_per_byte == 2 and (hidden % 2 or num_per_channels % 2):
        raise ValueError(
            f"e2m1 packs two values per byte: hidden ({hidden}) and num_per_channels ({num_per_channels}) must be even"
        )
    if fmt is E5M6:
        if num_per_channels != hidden:
            raise ValueError(
                f"fmt 'e5m6' takes one scale per row: num_per_channels must be the hidden size {hidden}, "
                f"got {num_per_channels}"
            )
        if hidden % E5M6_GROUP_VALUES:
            raise ValueError(f"e5m6 packs 8 values into 12 bytes: hidden ({hidden}) must be a multiple of 8")


def check_scale_flags(
    fmt: QuantFormat, round_sf: bool, use_packed_ue8m0: bool, use_tma_aligned_col_major_sf: bool = False
) -> bool:
    """Return the effective ``round_sf``: packed UE8M0 stores exponents only, so it implies it."""
    flags = (
        ("round_sf", round_sf),
        ("use_packed_ue8m0", use_packed_ue8m0),
        ("use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf),
    )
    for name, flag in flags:
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    return round_sf or use_packed_ue8m0


def check_per_token_cast_input(x, fmt: str, num_per_channels, x_block_size, formats=CAST_FORMATS) -> QuantFormat:
    """Validate ``per_token_cast``'s plain-tensor input; return the output format.

    ``formats``: the output formats the entry point writes (``PER_TOKEN_CAST_FORMATS`` for a
    ``per_token_cast`` that also writes e5m6)."""
    check_choice("fmt", fmt, formats)
    spec = formats[fmt]
    check_plain_input(x, x_block_size)
    check_tensor("x", x, dtypes=CAST_INPUT_DTYPES, ndim=2)
    check_unit_inner_stride("x", x)
    check_per_token_blocks(spec, x.shape[1], num_per_channels)
    return spec


def check_scale_tensor(name: str, sf, *, rows: int, kblocks: int, layout: ScaleLayout, device) -> torch.Tensor:
    """Check a caller-provided scale tensor against the layout it claims to have."""
    check_tensor(name, sf, dtypes=(layout.dtype,), ndim=2)
    expected = (rows, layout.logical_columns(kblocks))
    if tuple(sf.shape) != expected:
        raise ValueError(f"{name} must have shape {expected} for this layout, got {tuple(sf.shape)}")
    if sf.device != torch.device(device) and not (sf.device.type == torch.device(device).type == "cuda"):
        raise ValueError(f"{name} must be on {device}, got {sf.device}")
    if sf.numel() > 0:
        if layout.kind == "row_major" and sf.shape[1] > 1 and sf.stride(1) != 1:
            raise ValueError(f"{name} must be row-major (unit column stride), got strides {tuple(sf.stride())}")
        if layout.kind != "row_major" and sf.stride(0) != 1:
            raise ValueError(
                f"{name} must be column-major (strides (1, >= rows)) for "
                f"{layout.kind}, got strides {tuple(sf.stride())}"
            )
    return sf


def infer_scale_layout(name: str, sf: torch.Tensor) -> ScaleLayout:
    """The layout of an existing scale tensor, read off its dtype and strides."""
    if sf.dtype == torch.int32:
        return ScaleLayout("packed_ue8m0")
    if sf.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (or int32 for packed UE8M0), got {sf.dtype}")
    # Column-major storage has unit row stride and a column stride of align(rows, 4) > 1; a
    # row-major tensor only has unit row stride when it has a single column (then stride(1) == 1).
    if sf.dim() == 2 and sf.stride(0) == 1 and sf.stride(1) != 1:
        return ScaleLayout("col_major")
    return ScaleLayout("row_major")


def check_quantized_pair(name: str, x, num_per_channels) -> tuple[torch.Tensor, torch.Tensor, QuantFormat, int]:
    """Validate a ``(data, sf)`` pair quantized with 1×C blocks; return data, sf, format, hidden."""
    if not (isinstance(x, (tuple, list)) and len(x) == 2):
        raise TypeError(f"{name} must be a (data, sf) pair, got {type(x).__name__}")
    data, sf = x
    check_tensor(f"{name}[0]", data, dtypes=(torch.float8_e4m3fn, torch.int8), ndim=2)
    check_tensor(f"{name}[1]", sf, dtypes=(torch.float32, torch.int32), ndim=2)
    check_unit_inner_stride(f"{name}[0]", data)
    fmt = E4M3 if data.dtype == torch.float8_e4m3fn else E2M1
    hidden = data.shape[1] * fmt.values_per_byte
    check_per_token_blocks(fmt, hidden, num_per_channels)
    layout = infer_scale_layout(f"{name}[1]", sf)
    check_scale_tensor(
        f"{name}[1]",
        sf,
        rows=data.shape[0],
        kblocks=ceil_div(hidden, num_per_channels),
        layout=layout,
        device=data.device,
    )
    return data, sf, fmt, hidden


def check_block_size(name: str, block_size) -> tuple[int, int]:
    if not (
        isinstance(block_size, (tuple, list)) and len(block_size) == 2 and all(isinstance(b, int) for b in block_size)
    ):
        raise TypeError(f"{name} must be a (rows, columns) pair of ints, got {block_size!r}")
    if block_size[0] != 1:
        raise ValueError(f"{name} must be (1, C) for per-token blocks, got {tuple(block_size)}")
    return tuple(block_size)


# ---------------------------------------------------------------------------------------------
# Block shapes, quantized inputs (re-quantization, cast back), per-channel and lossless casts
# ---------------------------------------------------------------------------------------------


def _is_int_pair(value) -> bool:
    return (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) for b in value)
    )


def check_block_shape(name: str, block_size) -> tuple[int, int]:
    """A 2-D block ``(bm, bk)`` of ``per_block_cast``: bm, bk in ``PER_BLOCK_SIZES``."""
    if not _is_int_pair(block_size):
        raise TypeError(f"{name} must be a (rows, columns) pair of ints, got {block_size!r}")
    bm, bk = block_size
    if bm not in PER_BLOCK_SIZES or bk not in PER_BLOCK_SIZES:
        raise ValueError(f"{name} must be (bm, bk) with bm, bk in {PER_BLOCK_SIZES}, got {tuple(block_size)}")
    return bm, bk


def check_cast_source(x, fmt: QuantFormat, *, dtypes=CAST_INPUT_DTYPES) -> torch.Tensor:
    """A plain tensor to quantize: 2-D, one of ``dtypes``, unit inner stride, even H for e2m1."""
    check_tensor("x", x, dtypes=dtypes, ndim=2)
    check_unit_inner_stride("x", x)
    if fmt.values_per_byte == 2 and x.shape[1] % 2:
        raise ValueError(f"e2m1 packs two values per byte: hidden ({x.shape[1]}) must be even")
    return x


def check_plain_input(x, x_block_size) -> None:
    """A cast given a plain (not quantized) ``x`` takes no ``x_block_size``.

    An entry point that reads a quantized tuple handles it before calling this; one that does not
    (yet) gets here with the tuple and says so."""
    if x_block_size is None:
        return
    if isinstance(x, tuple):
        raise ValueError(
            "this implementation takes a plain tensor x only: re-quantizing a (data, sf) tuple "
            f"(x_block_size={x_block_size!r}) is not supported by it"
        )
    raise ValueError(
        "x_block_size is only meaningful when x is an already quantized (data, sf) tuple; "
        f"got x_block_size={x_block_size!r} with x of type {type(x).__name__}"
    )


def check_block_cast_input(x, fmt: str, block_size, x_block_size) -> tuple[QuantFormat, int, int]:
    """Validate ``per_block_cast``'s plain-tensor input; return the format and the block."""
    spec = check_cast_format(fmt)
    check_plain_input(x, x_block_size)
    bm, bk = check_block_shape("block_size", block_size)
    check_cast_source(x, spec)
    return spec, bm, bk


def check_quantized_block_size(name: str, block_size, hidden: int) -> tuple[int, int]:
    """The block a ``(data, sf)`` pair was quantized with: one that a cast of the contract makes.

    ``(1, C)`` (per-token, C in ``PER_TOKEN_CHANNEL_BLOCKS`` or the hidden size), ``(bm, bk)``
    (per-block, both in ``PER_BLOCK_SIZES``) or ``(nt, 1)`` (per-channel, nt in
    ``PER_CHANNEL_TOKEN_BLOCKS``).
    """
    if not _is_int_pair(block_size):
        raise TypeError(f"{name} must be a (rows, columns) pair of ints, got {block_size!r}")
    rows, columns = block_size
    per_token = rows == 1 and (columns in PER_TOKEN_CHANNEL_BLOCKS or columns == hidden > 0)
    per_block = rows in PER_BLOCK_SIZES and columns in PER_BLOCK_SIZES
    per_channel = columns == 1 and rows in PER_CHANNEL_TOKEN_BLOCKS
    if not (per_token or per_block or per_channel):
        raise ValueError(
            f"{name} must be (1, C) with C (num_per_channels) one of {PER_TOKEN_CHANNEL_BLOCKS} or the hidden "
            f"size {hidden}, (bm, bk) with bm, bk in {PER_BLOCK_SIZES}, or (nt, 1) with nt in "
            f"{PER_CHANNEL_TOKEN_BLOCKS}; got {tuple(block_size)}"
        )
    return rows, columns


def check_special_fmt(x_special_fmt) -> None:
    if x_special_fmt is not None and x_special_fmt != "e5m6":
        raise ValueError(f"x_special_fmt must be None or 'e5m6', got {x_special_fmt!r}")


def check_quantized_input(
    name: str,
    x,
    block_size,
    *,
    x_special_fmt=None,
    formats: tuple[QuantFormat, ...] = (E4M3, E2M1),
    block_name: str = "x_block_size",
) -> tuple[torch.Tensor, torch.Tensor, QuantFormat, int, tuple[int, int]]:
    """Validate a quantized ``(data, sf)`` pair with blocks of any shape the casts make.

    ``data``: float8_e4m3fn ``[T, H]`` or int8 ``[T, H/2]`` (e2m1), restricted to ``formats``;
    with ``x_special_fmt='e5m6'`` uint8 ``[T, 3H/2]``. Unit inner stride, any row stride.
    ``sf``: fp32 or packed int32 scales of logical shape ``[ceil(T/bm), ceil(H/bk)]`` in a layout
    read off its dtype and strides. Returns data, sf, format, H and the block ``(bm, bk)``.
    """
    check_special_fmt(x_special_fmt)
    if not (isinstance(x, (tuple, list)) and len(x) == 2):
        raise TypeError(f"{name} must be a (data, sf) pair, got {type(x).__name__}")
    data, sf = x
    if x_special_fmt == "e5m6":
        check_tensor(f"{name}[0]", data, dtypes=(torch.uint8,), ndim=2)
        if data.shape[1] % E5M6_GROUP_BYTES:
            raise ValueError(
                f"{name}[0] holds packed e5m6 (12 bytes per 8 values): its width must be a multiple of 12, "
                f"got {data.shape[1]}"
            )
        fmt = E5M6
    else:
        allowed = tuple(dtype for dtype, f in QUANTIZED_DATA_FORMATS.items() if f in formats)
        check_tensor(f"{name}[0]", data, dtypes=allowed, ndim=2)
        fmt = QUANTIZED_DATA_FORMATS[data.dtype]
    check_tensor(f"{name}[1]", sf, dtypes=(torch.float32, torch.int32), ndim=2)
    check_unit_inner_stride(f"{name}[0]", data)
    hidden = fmt.logical_hidden(data.shape[1])
    bm, bk = check_quantized_block_size(block_name, block_size, hidden)
    layout = infer_scale_layout(f"{name}[1]", sf)
    rows, kblocks = ceil_div(data.shape[0], bm), ceil_div(hidden, bk)
    check_scale_tensor(f"{name}[1]", sf, rows=rows, kblocks=kblocks, layout=layout, device=data.device)
    return data, sf, fmt, hidden, (bm, bk)


def check_num_per_tokens(num_per_tokens, allowed=PER_CHANNEL_TOKEN_BLOCKS) -> int:
    if isinstance(num_per_tokens, bool) or num_per_tokens not in allowed:
        raise ValueError(f"num_per_tokens must be one of {tuple(allowed)}, got {num_per_tokens!r}")
    return num_per_tokens


def check_pos_to_token(pos_to_token, num_tokens: int, device, *, values: bool = True) -> torch.Tensor:
    """int32 ``[P]`` row indices into ``x``, each in ``[-1, T)``; -1 marks a padding (zero) row.
    ``values=False`` checks dtype, shape and device only (no read-back of the indices: a compile or
    shape-only pass, whose indices are uninitialized or meta)."""
    check_tensor("pos_to_token", pos_to_token, dtypes=(torch.int32,), ndim=1)
    if pos_to_token.device != torch.device(device) and not (
        pos_to_token.device.type == torch.device(device).type == "cuda"
    ):
        raise ValueError(f"pos_to_token must be on {device} (the device of x), got {pos_to_token.device}")
    if not values:
        return pos_to_token
    outside = (pos_to_token < -1) | (pos_to_token >= num_tokens)
    if pos_to_token.numel() and bool(outside.any()):
        where = int(outside.nonzero()[0, 0])
        raise ValueError(
            f"pos_to_token must hold row indices in [-1, {num_tokens}) (-1: a zero row), "
            f"got {int(pos_to_token[where])} at position {where}"
        )
    return pos_to_token


def check_power_of_two_scales(name: str, scales: torch.Tensor) -> None:
    """fp32 scales that are positive normal powers of two (UE8M0 values 2^-126 .. 2^127)."""
    bits = scales.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    ok = ((bits & FP32_MANTISSA_MASK) == 0) & (bits >= 0) & (exponent >= 1) & (exponent <= 254)
    if scales.numel() and not bool(ok.all()):
        row, column = (int(i) for i in (~ok).nonzero()[0])
        raise ValueError(
            f"{name} must hold positive normal powers of two (UE8M0 scales, as round_sf=True makes); "
            f"scale [{row}, {column}] is {float(scales[row, column])!r}"
        )


def check_out_block_size(out_block_size, x_block_size: tuple[int, int], hidden: int) -> tuple[int, int]:
    """An output block made of whole input blocks (``per_block_cast_lossless``)."""
    bm, bk = check_quantized_block_size("out_block_size", out_block_size, hidden)
    if bm % x_block_size[0] or bk % x_block_size[1]:
        raise ValueError(
            f"out_block_size {tuple(out_block_size)} must be a multiple of x_block_size "
            f"{tuple(x_block_size)} in both dimensions (each output block is made of whole input blocks)"
        )
    return bm, bk

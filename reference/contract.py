"""Plain constants, scale layouts and input validation of the operator contract.

Both twins import this module: it holds no arithmetic on tensor values, only the facts of the
contract (format limits, scale-factor shapes and strides) and the checks every public entry point
makes on its arguments, so that the reference and the optimized kernels accept and refuse exactly
the same inputs with the same messages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    torch dtype of the data tensor; ``values_per_byte`` how many elements share one stored byte.
    """

    name: str
    qmax: float
    amax_floor: float
    storage_dtype: torch.dtype
    values_per_byte: int


E4M3 = QuantFormat("e4m3", 448.0, 1e-4, torch.float8_e4m3fn, 1)
# 6 * 2^-126: the smallest amax whose scale amax/6 is still a normal fp32 number.
E2M1 = QuantFormat("e2m1", 6.0, 6.0 * 2.0**-126, torch.int8, 2)

CAST_FORMATS = {f.name: f for f in (E4M3, E2M1)}
CAST_BACK_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CAST_INPUT_DTYPES = (torch.bfloat16, torch.float32)
PER_TOKEN_CHANNEL_BLOCKS = (16, 32, 64, 128)

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
        return storage.T[:rows]


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


def check_per_token_cast_input(x, fmt: str, num_per_channels, x_block_size) -> QuantFormat:
    """Validate ``per_token_cast``'s plain-tensor input; return the output format."""
    spec = check_cast_format(fmt)
    if x_block_size is not None:
        raise ValueError(
            "x_block_size is only meaningful when x is an already quantized (data, sf) pair; "
            f"got x_block_size={x_block_size!r} with a plain tensor"
        )
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

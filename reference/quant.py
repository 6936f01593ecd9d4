"""Reference twin of the quantization family (contract §1): the executable specification.

Every function here is plain PyTorch, runs on the CPU and on the GPU, and is written to be read:
split into blocks, take the absolute maximum, derive the scale, multiply, encode. The optimized
kernels in ``tileproof.optimized.quant`` must reproduce these results bit for bit.

Conventions (shared by every cast):

- ``sf`` is the *dequantization* scale: ``x ≈ decode(q) · sf``.
- A block's ``amax`` is ``max |x|`` over the block in fp32 (NaN if the block holds a NaN), clamped
  below at the format's ``amax_floor`` (1e-4 for e4m3, 6·2^-126 for e2m1).
- Without ``round_sf``: ``sf = amax / qmax`` and the multiplier is ``qmax / amax``, both IEEE fp32
  divisions (the multiplier is *not* ``1 / sf``, which can differ in the last bit).
- With ``round_sf`` (implied by ``use_packed_ue8m0``): ``sf`` is rounded *up* to a power of two,
  ``2^ceil(log2(amax / qmax))`` — add ``0x7FFFFF`` to the fp32 bits and clear the mantissa; a NaN
  scale stays NaN — and the multiplier is the exact ``1 / sf``.
- ``y = x · multiplier`` in fp32, then encoded: e4m3 clamps to ±448 and rounds to nearest even (NaN
  stays NaN, encoded 0x7F); e2m1 rounds ``|y|`` to nearest even on {0, .5, 1, 1.5, 2, 3, 4, 6},
  saturating at 6 (NaN and +Inf become 6), keeping the sign bit (so −0.1 encodes as 0b1000); every
  NaN encodes as +6 (0b0111), whatever its sign bit, so results do not depend on the device.
- Packed UE8M0 scales decode 0xFF as NaN (OCP E8M0); a NaN or Inf scale encodes to 0xFF.
- e2m1 data is packed two per byte into int8: element ``2j`` in the low nibble, ``2j+1`` in the high.
"""

from __future__ import annotations

import torch
from einops import rearrange

from .contract import (
    CAST_BACK_DTYPES,
    E2M1_GRID,
    E4M3,
    FP32_EXPONENT_AND_SIGN_MASK,
    FP32_MANTISSA_MASK,
    UE8M0_NAN,
    QuantFormat,
    ScaleLayout,
    ceil_div,
    check_block_size,
    check_choice,
    check_per_token_cast_input,
    check_quantized_pair,
    check_scale_flags,
    check_scale_tensor,
)

__all__ = [
    "per_token_cast",
    "per_token_cast_with_sf_only",
    "per_token_cast_with_precomputed_sf",
    "per_token_cast_back",
    "cast_back",
    "encode_e4m3",
    "encode_e2m1",
    "decode_e2m1",
    "scales_from_amax",
    "scales_to_layout",
    "scales_from_layout",
]


# ---------------------------------------------------------------------------------------------
# Element encodings
# ---------------------------------------------------------------------------------------------


def encode_e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 → float8_e4m3fn: clamp to ±448, round to nearest even; every NaN becomes 0x7F."""
    clamped = torch.clamp(y, -E4M3.qmax, E4M3.qmax)
    canonical = torch.where(torch.isnan(clamped), torch.full_like(clamped, float("nan")).abs(), clamped)
    return canonical.to(torch.float8_e4m3fn)


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 → 4-bit e2m1 codes (uint8 values 0..15), round to nearest even, saturating at 6."""
    magnitude = y.abs()
    # Magnitude code = number of rounding thresholds at or below |y|. A value exactly on a
    # threshold (a tie) goes to the neighbour whose code is even: ">" keeps it on the lower code
    # when the lower code is even, ">=" lifts it when the upper code is even. NaN compares false
    # everywhere, so test "not below" to send NaN (and +Inf) to the top code, 6.0.
    ties_to_upper = (0.75, 1.75, 3.5)  # 0.5|1.0, 1.5|2.0, 3|4: upper codes 2, 4, 6 are even
    ties_to_lower = (0.25, 1.25, 2.5, 5.0)  # 0|0.5, 1|1.5, 2|3, 4|6: lower codes 0, 2, 4, 6
    code = torch.zeros_like(magnitude, dtype=torch.uint8)
    for threshold in ties_to_upper:
        code += (~(magnitude < threshold)).to(torch.uint8)
    for threshold in ties_to_lower:
        code += (~(magnitude <= threshold)).to(torch.uint8)
    # NaN has no meaningful sign (x86 keeps an input NaN's sign through a multiply, GPUs return
    # the canonical +NaN): like e4m3's 0x7F, every NaN encodes as +6 (0b0111).
    sign = (torch.signbit(y) & ~torch.isnan(y)).to(torch.uint8)
    return code | (sign << 3)


def encode_e2m1(y: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., H]`` → packed e2m1 int8 ``[..., H/2]`` (element 2j in the low nibble)."""
    codes = _e2m1_codes(y)
    pairs = rearrange(codes, "... (j two) -> ... j two", two=2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.view(torch.int8)


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 int8 ``[..., H/2]`` → fp32 ``[..., H]``."""
    as_bytes = packed.view(torch.uint8)
    codes = rearrange(torch.stack([as_bytes & 0x0F, as_bytes >> 4], dim=-1), "... j two -> ... (j two)")
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=packed.device)
    magnitude = grid[(codes & 0x07).long()]
    return torch.where((codes & 0x08) != 0, -magnitude, magnitude)


def encode(fmt: QuantFormat, y: torch.Tensor) -> torch.Tensor:
    return encode_e4m3(y) if fmt is E4M3 else encode_e2m1(y)


def decode(fmt: QuantFormat, data: torch.Tensor) -> torch.Tensor:
    return data.to(torch.float32) if fmt is E4M3 else decode_e2m1(data)


# ---------------------------------------------------------------------------------------------
# Scales
# ---------------------------------------------------------------------------------------------


def _round_up_to_power_of_two(sf: torch.Tensor) -> torch.Tensor:
    bits = sf.view(torch.int32).to(torch.int64)
    rounded = ((bits + FP32_MANTISSA_MASK) & FP32_EXPONENT_AND_SIGN_MASK).to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(sf), sf, rounded)


def scales_from_amax(amax: torch.Tensor, fmt: QuantFormat, round_sf: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Block absolute maxima (fp32) → ``(sf, multiplier)``, both fp32, per the contract's rule."""
    amax = torch.clamp(amax.to(torch.float32), min=fmt.amax_floor)
    qmax = torch.full_like(amax, fmt.qmax)
    sf = amax / qmax
    if not round_sf:
        return sf, qmax / amax
    sf = _round_up_to_power_of_two(sf)
    return sf, torch.ones_like(sf) / sf


def scales_to_layout(sf: torch.Tensor, layout: ScaleLayout) -> torch.Tensor:
    """fp32 scales ``[rows, kblocks]`` → the stored tensor of ``layout`` (shape, dtype, strides)."""
    rows, kblocks = sf.shape
    out = layout.empty(rows, kblocks, sf.device)
    if layout.kind != "packed_ue8m0":
        out.copy_(sf)
        return out
    # Power-of-two scales only: the biased exponent byte is the whole information.
    exponent_bytes = ((sf.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    padded = torch.zeros((rows, out.shape[1] * 4), dtype=torch.uint8, device=sf.device)
    padded[:, :kblocks] = exponent_bytes
    words = rearrange(padded, "r (w b) -> r w b", b=4).to(torch.int64)
    little_endian = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)
    out.copy_(little_endian.to(torch.uint32).view(torch.int32) if rows else little_endian.to(torch.int32))
    return out


def scales_from_layout(stored: torch.Tensor, kblocks: int) -> torch.Tensor:
    """The stored scale tensor (any layout) → fp32 scales ``[rows, kblocks]``."""
    if stored.dtype == torch.float32:
        return stored.to(torch.float32).contiguous()
    words = stored.contiguous().to(torch.int64) & 0xFFFFFFFF
    exponent_bytes = torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], dim=-1)
    exponent_bytes = rearrange(exponent_bytes, "r w b -> r (w b)")[:, :kblocks]
    scales = (exponent_bytes.to(torch.int32) << 23).view(torch.float32)
    return torch.where(exponent_bytes == UE8M0_NAN, torch.full_like(scales, float("nan")), scales)


# ---------------------------------------------------------------------------------------------
# Per-token (1×C) casts
# ---------------------------------------------------------------------------------------------


def _blocks(values: torch.Tensor, num_per_channels: int) -> torch.Tensor:
    """fp32 ``[T, H]`` → ``[T, kblocks, C]``, the last block zero-padded (zeros never raise amax)."""
    tokens, hidden = values.shape
    kblocks = ceil_div(hidden, num_per_channels)
    padded = torch.zeros((tokens, kblocks * num_per_channels), dtype=torch.float32, device=values.device)
    padded[:, :hidden] = values
    return rearrange(padded, "t (k c) -> t k c", c=num_per_channels)


def _block_amax(values: torch.Tensor, num_per_channels: int) -> torch.Tensor:
    blocks = _blocks(values, num_per_channels)
    if blocks.shape[0] == 0:
        return blocks.new_zeros(blocks.shape[:2])
    return blocks.abs().amax(dim=-1)  # NaN-propagating, like the kernels


def _apply_multiplier(values: torch.Tensor, multiplier: torch.Tensor, num_per_channels: int) -> torch.Tensor:
    hidden = values.shape[1]
    per_element = multiplier.repeat_interleave(num_per_channels, dim=1)[:, :hidden]
    return values * per_element


def per_token_cast(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one scale per 1×C block of each row.

    Args:
        x: bf16 or fp32 ``[T, H]``; unit stride along H, any row stride ``>= H``.
        fmt: ``"e4m3"`` (data float8_e4m3fn ``[T, H]``) or ``"e2m1"`` (data int8 ``[T, H/2]``, two
            values per byte, element 2j in the low nibble; H must be even).
        num_per_channels: C, one of 16, 32, 64, 128, or H (one scale per row). The last block of a
            row is partial when C does not divide H.
        x_block_size: must be None for a plain tensor (re-quantization of a (data, sf) pair is not
            part of this slice).
        use_tma_aligned_col_major_sf: store fp32 scales column-major, strides ``(1, align(T, 4))``.
        round_sf: round every scale up to a power of two (UE8M0-representable).
        use_packed_ue8m0: store scales as biased exponent bytes, 4 per int32 (implies the two above).

    Returns:
        ``(q, sf)``: ``sf`` has logical shape ``[T, ceil(H / C)]`` (``[T, ceil(H / C / 4)]`` int32
        when packed), the dequantization scale of each block.
    """
    spec = check_per_token_cast_input(x, fmt, num_per_channels, x_block_size)
    round_sf = check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)

    values = x.to(torch.float32)
    amax = _block_amax(values, num_per_channels)
    sf, multiplier = scales_from_amax(amax, spec, round_sf)
    q = encode(spec, _apply_multiplier(values, multiplier, num_per_channels))
    return q, scales_to_layout(sf, layout)


def per_token_cast_with_sf_only(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """The scales ``per_token_cast`` would return, without the quantized data."""
    spec = check_per_token_cast_input(x, fmt, num_per_channels, x_block_size)
    round_sf = check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)
    sf, _ = scales_from_amax(_block_amax(x.to(torch.float32), num_per_channels), spec, round_sf)
    return scales_to_layout(sf, layout)


def per_token_cast_with_precomputed_sf(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    sf: torch.Tensor,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """Quantize ``x`` with given scales: ``q = encode(x · (1 / sf))``.

    ``sf`` must be in the layout the flags name (as returned by ``per_token_cast_with_sf_only``
    with the same flags). ``round_sf`` is accepted for signature symmetry; the scales are used as
    given. Returns only the data tensor.
    """
    spec = check_per_token_cast_input(x, fmt, num_per_channels, x_block_size)
    check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)
    tokens, hidden = x.shape
    kblocks = ceil_div(hidden, num_per_channels)
    check_scale_tensor("sf", sf, rows=tokens, kblocks=kblocks, layout=layout, device=x.device)

    scales = scales_from_layout(sf, kblocks)
    multiplier = torch.ones_like(scales) / scales
    return encode(spec, _apply_multiplier(x.to(torch.float32), multiplier, num_per_channels))


def cast_back(x, fmt: str, x_block_size, x_special_fmt=None) -> torch.Tensor:
    """Dequantize a ``(data, sf)`` pair: ``out = decode(data) · sf`` in fp32, then to ``fmt``.

    Args:
        x: ``(data, sf)`` as returned by a per-token cast: data float8_e4m3fn ``[T, H]`` or packed
            e2m1 int8 ``[T, H/2]``; sf in any of the three layouts (read off its dtype and strides).
        fmt: output dtype, ``"bf16"`` (rounded to nearest even from the fp32 product) or ``"fp32"``.
        x_block_size: ``(1, C)``, the block the scales were computed over.
        x_special_fmt: must be None in this slice (``"e5m6"`` comes with the E5M6 casts).
    """
    check_choice("fmt", fmt, CAST_BACK_DTYPES)
    if x_special_fmt is not None:
        raise ValueError(
            f"x_special_fmt must be None (e5m6 cast back is not part of this release), got {x_special_fmt!r}"
        )
    _, num_per_channels = check_block_size("x_block_size", x_block_size)
    data, sf, spec, hidden = check_quantized_pair("x", x, num_per_channels)

    scales = scales_from_layout(sf, ceil_div(hidden, num_per_channels))
    per_element = scales.repeat_interleave(num_per_channels, dim=1)[:, :hidden]
    return (decode(spec, data) * per_element).to(CAST_BACK_DTYPES[fmt])


def per_token_cast_back(x, fmt: str, num_per_channels: int, x_special_fmt=None) -> torch.Tensor:
    """``cast_back`` with ``x_block_size = (1, num_per_channels)``."""
    return cast_back(x, fmt, (1, num_per_channels), x_special_fmt=x_special_fmt)

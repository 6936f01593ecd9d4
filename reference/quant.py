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

E5M6 (``fmt="e5m6"`` of ``per_token_cast``, one scale per row only; qmax 65024, amax floor 1e-4; a
12-bit float, the top 12 bits of an IEEE fp16: 1 sign, 5 exponent bits with bias 15, 6 mantissa
bits; codes are uint16 values 0..0xFFF):

- ``encode_e5m6`` rounds an fp32 value to the nearest e5m6 value, ties to the even code, in the
  normal *and* the subnormal range (min subnormal 2^-20, max finite 65024). This is the contract's
  recipe — fp16 round-toward-zero, keep the top 12 bits, round to nearest even with the discarded
  bits of the fp32 value — taking "discarded bits" to mean *all* bits of ``x`` below the e5m6 LSB.
  (The public kernel reads only the low 17 fp32 bits, which is the same thing for ``|x| >= 2^-14``
  only.)
- Overflow: ``|x| >= 65280`` (the midpoint between 65024 and 2^16; the tie goes to the even code,
  which is the infinity code) encodes as ±Inf (0x7C0 / 0xFC0), as in IEEE round-to-nearest. ±Inf
  encodes as ±Inf. Every NaN encodes as the canonical +NaN 0x7FF, whatever its sign or payload.
- The sign is kept: a negative value that rounds to zero encodes as −0 (0x800).
- ``decode_e5m6`` is exact: code ``c`` is the fp16 with bits ``c << 4``; 0x7C1..0x7FF and
  0xFC1..0xFFF decode as NaN.
- Packing: 8 codes ``h0..h7`` (96 bits) are concatenated most significant first, ``h0`` on top, and
  cut into 3 uint32 words ``w0 = h0<<20 | h1<<8 | h2>>4``, ``w1 = h2<<28 | h3<<16 | h4<<4 | h5>>8``,
  ``w2 = h5<<24 | h6<<12 | h7``; each word is stored little-endian (the device's native order), so a
  row of H values is uint8 ``[3H/2]`` (H a multiple of 8).

Quantized inputs (``dequantize``, ``cast_back``, and the re-quantization of a ``(q, sf)`` pair by the
casts): ``decode(q) · sf`` in fp32 — one correctly rounded product per element, ``sf`` broadcast over
the block ``x_block_size`` the pair was made with: ``(1, C)`` per token, ``(bm, bk)`` per block or
``(nt, 1)`` per channel, in any of the three scale layouts. A cast given a pair quantizes exactly that
fp32 tensor (the multiplier is applied to the dequantized value, not folded into one factor with the
input scale).
"""

from __future__ import annotations

import torch
from einops import rearrange

from .contract import (
    CAST_BACK_DTYPES,
    CAST_FORMATS,
    E2M1_GRID,
    E4M3,
    E5M6,
    FP32_EXPONENT_AND_SIGN_MASK,
    FP32_MANTISSA_MASK,
    PER_TOKEN_CAST_FORMATS,
    UE8M0_NAN,
    QuantFormat,
    ScaleLayout,
    ceil_div,
    check_choice,
    check_per_token_blocks,
    check_per_token_cast_input,
    check_quantized_input,
    check_scale_flags,
    check_scale_tensor,
)

__all__ = [
    "per_token_cast",
    "per_token_cast_with_sf_only",
    "per_token_cast_with_precomputed_sf",
    "per_token_cast_back",
    "cast_back",
    "dequantize",
    "encode_e4m3",
    "encode_e2m1",
    "decode_e2m1",
    "E5M6_MAX",
    "E5M6_MIN_SUBNORMAL",
    "E5M6_NAN",
    "encode_e5m6",
    "decode_e5m6",
    "pack_e5m6",
    "unpack_e5m6",
    "scales_from_amax",
    "scales_to_layout",
    "scales_from_layout",
    "expand_blocks",
]

E5M6_MAX = 65024.0
E5M6_MIN_SUBNORMAL = 2.0**-20
E5M6_INF = 0x7C0
E5M6_NAN = 0x7FF
E5M6_SIGN = 0x800


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


def encode_e5m6(x: torch.Tensor) -> torch.Tensor:
    """fp32 (or bf16) → e5m6 codes, uint16 values 0..0xFFF, same shape; see the module docstring."""
    values = x.to(torch.float64)  # exact; every step below is exact in fp64 except the one rounding
    magnitude = values.abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m · 2^exponent, m in [0.5, 1)
    # The spacing of e5m6 values around |x|: 2^(e-6) in the binade [2^e, 2^(e+1)), e >= -14; the
    # subnormal spacing 2^-20 below 2^-14.
    binade = torch.clamp(exponent.to(torch.int64) - 1, min=-14)
    ulp = torch.ldexp(torch.ones_like(magnitude), binade - 6)
    rounded = torch.round(magnitude / ulp) * ulp  # torch.round: half to even, on the multiple of ulp
    # The rounded value is an fp16 value with its 4 low bits clear, or 2^16 and above (→ fp16 Inf).
    half_bits = rounded.to(torch.float16).view(torch.int16).to(torch.int32) & 0x7FFF
    code = half_bits >> 4
    code = torch.where(torch.isinf(magnitude), torch.full_like(code, E5M6_INF), code)
    code = code | torch.where(torch.signbit(values), E5M6_SIGN, 0).to(torch.int32)
    code = torch.where(torch.isnan(values), torch.full_like(code, E5M6_NAN), code)
    return code.to(torch.uint16)


def decode_e5m6(codes: torch.Tensor) -> torch.Tensor:
    """e5m6 codes (uint16, low 12 bits used) → fp32, exactly."""
    half_bits = (codes.to(torch.int32) & 0xFFF) << 4
    return half_bits.to(torch.int16).view(torch.float16).to(torch.float32)


def pack_e5m6(codes: torch.Tensor) -> torch.Tensor:
    """e5m6 codes ``[..., H]`` (H a multiple of 8) → packed uint8 ``[..., 3H/2]``."""
    if codes.shape[-1] % 8:
        raise ValueError(
            f"e5m6 packs 8 values into 3 words: the last dimension must be a multiple of 8, got {codes.shape[-1]}"
        )
    h = rearrange(codes.to(torch.int64) & 0xFFF, "... (g e) -> ... g e", e=8).unbind(-1)
    w0 = (h[0] << 20) | (h[1] << 8) | (h[2] >> 4)
    w1 = ((h[2] & 0xF) << 28) | (h[3] << 16) | (h[4] << 4) | (h[5] >> 8)
    w2 = ((h[5] & 0xFF) << 24) | (h[6] << 12) | h[7]
    words = torch.stack([w0, w1, w2], dim=-1)
    little_endian = torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], dim=-1)
    return rearrange(little_endian, "... g w b -> ... (g w b)").to(torch.uint8)


def unpack_e5m6(packed: torch.Tensor) -> torch.Tensor:
    """Packed uint8 ``[..., 3H/2]`` → e5m6 codes uint16 ``[..., H]``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed e5m6 data must be uint8, got {packed.dtype}")
    if packed.shape[-1] % 12:
        raise ValueError(f"packed e5m6 rows hold 12 bytes per 8 values, got {packed.shape[-1]} bytes")
    b = rearrange(packed.to(torch.int64), "... (g w b) -> ... g w b", w=3, b=4)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    w0, w1, w2 = words.unbind(-1)
    h = [
        w0 >> 20,
        (w0 >> 8) & 0xFFF,
        ((w0 & 0xFF) << 4) | (w1 >> 28),
        (w1 >> 16) & 0xFFF,
        (w1 >> 4) & 0xFFF,
        ((w1 & 0xF) << 8) | (w2 >> 24),
        (w2 >> 12) & 0xFFF,
        w2 & 0xFFF,
    ]
    return rearrange(torch.stack(h, dim=-1), "... g e -> ... (g e)").to(torch.uint16)


def encode(fmt: QuantFormat, y: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T, H]`` → the stored data tensor of ``fmt``."""
    if fmt is E5M6:
        return pack_e5m6(encode_e5m6(y))
    return encode_e4m3(y) if fmt is E4M3 else encode_e2m1(y)


def decode(fmt: QuantFormat, data: torch.Tensor) -> torch.Tensor:
    """The stored data tensor of ``fmt`` → its exact values, fp32 ``[T, H]``."""
    if fmt is E5M6:
        return decode_e5m6(unpack_e5m6(data))
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
# Blocks and dequantization
# ---------------------------------------------------------------------------------------------


def expand_blocks(per_block: torch.Tensor, bm: int, bk: int, tokens: int, hidden: int) -> torch.Tensor:
    """One value per block ``[ceil(T/bm), ceil(H/bk)]`` → one per element ``[T, H]``."""
    return per_block.repeat_interleave(bm, dim=0).repeat_interleave(bk, dim=1)[:tokens, :hidden]


def dequantize(x, x_block_size, x_special_fmt=None) -> torch.Tensor:
    """A quantized ``(data, sf)`` pair → fp32 ``[T, H]``: ``decode(data) · sf`` of its block.

    Args:
        x: ``(data, sf)``: data float8_e4m3fn ``[T, H]``, packed e2m1 int8 ``[T, H/2]`` or, with
            ``x_special_fmt="e5m6"``, packed e5m6 uint8 ``[T, 3H/2]``; unit inner stride, any row
            stride. ``sf`` fp32 or packed UE8M0 int32, logical shape ``[ceil(T/bm), ceil(H/bk)]``, in
            any of the three layouts (read off its dtype and strides).
        x_block_size: ``(bm, bk)`` the scales were computed over: ``(1, C)`` with C in 16, 32, 64,
            128 or H; ``(bm, bk)`` with bm, bk in 32, 128; ``(nt, 1)`` with nt in 32, 128.
        x_special_fmt: None, or ``"e5m6"`` for packed e5m6 data.

    Each element is one fp32 product of two exact operands, rounded to nearest even.
    """
    data, sf, fmt, hidden, (bm, bk) = check_quantized_input("x", x, x_block_size, x_special_fmt=x_special_fmt)
    tokens = data.shape[0]
    scales = scales_from_layout(sf, ceil_div(hidden, bk))
    return decode(fmt, data) * expand_blocks(scales, bm, bk, tokens, hidden)


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


def _per_token_source(x, fmt, num_per_channels, x_block_size, formats) -> tuple[torch.Tensor, QuantFormat]:
    """The values to quantize, fp32 ``[T, H]``, and the output format.

    A plain tensor is upcast; an already quantized ``(data, sf)`` tuple (re-quantization) is
    dequantized with its block ``x_block_size`` first.
    """
    if not isinstance(x, tuple):
        spec = check_per_token_cast_input(x, fmt, num_per_channels, x_block_size, formats=formats)
        return x.to(torch.float32), spec
    check_choice("fmt", fmt, formats)
    if fmt not in CAST_FORMATS:
        raise ValueError(f"fmt {fmt!r} takes a plain tensor x, not an already quantized (data, sf) pair")
    spec = CAST_FORMATS[fmt]
    values = dequantize(x, x_block_size)
    check_per_token_blocks(spec, values.shape[1], num_per_channels)
    return values, spec


def per_token_cast(
    x,
    fmt: str,
    num_per_channels: int,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one scale per 1×C block of each row.

    Args:
        x: bf16 or fp32 ``[T, H]``; unit stride along H, any row stride ``>= H``. Or an already
            quantized ``(data, sf)`` pair (re-quantization): it is dequantized first,
            ``decode(data) · sf`` in fp32 (see ``dequantize``), and that tensor is quantized.
        fmt: ``"e4m3"`` (data float8_e4m3fn ``[T, H]``), ``"e2m1"`` (data int8 ``[T, H/2]``, two
            values per byte, element 2j in the low nibble; H must be even) or ``"e5m6"`` (data uint8
            ``[T, 3H/2]``; only with C == H, H a multiple of 8, and a plain tensor ``x``).
        num_per_channels: C, one of 16, 32, 64, 128, or H (one scale per row). The last block of a
            row is partial when C does not divide H.
        x_block_size: the block ``(bm, bk)`` of a quantized ``x`` (see ``dequantize``); None for a
            plain tensor.
        use_tma_aligned_col_major_sf: store fp32 scales column-major, strides ``(1, align(T, 4))``.
        round_sf: round every scale up to a power of two (UE8M0-representable).
        use_packed_ue8m0: store scales as biased exponent bytes, 4 per int32 (implies the two above).

    Returns:
        ``(q, sf)``: ``sf`` has logical shape ``[T, ceil(H / C)]`` (``[T, ceil(H / C / 4)]`` int32
        when packed), the dequantization scale of each block.
    """
    values, spec = _per_token_source(x, fmt, num_per_channels, x_block_size, PER_TOKEN_CAST_FORMATS)
    round_sf = check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)

    amax = _block_amax(values, num_per_channels)
    sf, multiplier = scales_from_amax(amax, spec, round_sf)
    q = encode(spec, _apply_multiplier(values, multiplier, num_per_channels))
    return q, scales_to_layout(sf, layout)


def per_token_cast_with_sf_only(
    x,
    fmt: str,
    num_per_channels: int,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """The scales ``per_token_cast`` would return, without the quantized data (fmt e4m3 or e2m1)."""
    values, spec = _per_token_source(x, fmt, num_per_channels, x_block_size, CAST_FORMATS)
    round_sf = check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)
    sf, _ = scales_from_amax(_block_amax(values, num_per_channels), spec, round_sf)
    return scales_to_layout(sf, layout)


def per_token_cast_with_precomputed_sf(
    x,
    fmt: str,
    num_per_channels: int,
    sf: torch.Tensor,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """Quantize ``x`` with given scales: ``q = encode(x · (1 / sf))`` (fmt e4m3 or e2m1).

    ``x`` as for ``per_token_cast`` (a quantized pair is dequantized first). ``sf`` must be in the
    layout the flags name (as returned by ``per_token_cast_with_sf_only`` with the same flags).
    ``round_sf`` is accepted for signature symmetry; the scales are used as given. Returns only the
    data tensor.
    """
    values, spec = _per_token_source(x, fmt, num_per_channels, x_block_size, CAST_FORMATS)
    check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)
    tokens, hidden = values.shape
    kblocks = ceil_div(hidden, num_per_channels)
    check_scale_tensor("sf", sf, rows=tokens, kblocks=kblocks, layout=layout, device=values.device)

    scales = scales_from_layout(sf, kblocks)
    multiplier = torch.ones_like(scales) / scales
    return encode(spec, _apply_multiplier(values, multiplier, num_per_channels))


# ---------------------------------------------------------------------------------------------
# Cast back
# ---------------------------------------------------------------------------------------------


def cast_back(x, fmt: str, x_block_size, x_special_fmt=None) -> torch.Tensor:
    """Dequantize a ``(data, sf)`` pair: ``out = decode(data) · sf`` in fp32, then to ``fmt``.

    Args:
        x: ``(data, sf)`` as returned by any cast: data float8_e4m3fn ``[T, H]``, packed e2m1 int8
            ``[T, H/2]`` or packed e5m6 uint8 ``[T, 3H/2]``; sf in any of the three layouts (read off
            its dtype and strides).
        fmt: output dtype, ``"bf16"`` (rounded to nearest even from the fp32 product) or ``"fp32"``.
        x_block_size: the block the scales were computed over: ``(1, C)`` per token, ``(bm, bk)``
            per block, ``(nt, 1)`` per channel (see ``dequantize``).
        x_special_fmt: None, or ``"e5m6"`` for packed e5m6 data.

    Returns:
        ``out`` ``[T, H]`` of ``fmt``, contiguous.
    """
    check_choice("fmt", fmt, CAST_BACK_DTYPES)
    return dequantize(x, x_block_size, x_special_fmt=x_special_fmt).to(CAST_BACK_DTYPES[fmt])


def per_token_cast_back(x, fmt: str, num_per_channels: int, x_special_fmt=None) -> torch.Tensor:
    """``cast_back`` with ``x_block_size = (1, num_per_channels)``."""
    return cast_back(x, fmt, (1, num_per_channels), x_special_fmt=x_special_fmt)

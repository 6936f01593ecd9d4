"""Reference twin of the quantization family, continued (contract §1): E5M6, 2-D blocks, channels.

Plain PyTorch, CPU and GPU, written to be read. The scale rule is *not* restated here: every cast
takes its ``(sf, multiplier)`` from ``quant.scales_from_amax`` and stores scales with
``quant.scales_to_layout``, so the per-token, per-block and per-channel casts cannot drift apart.

E5M6 (a 12-bit float, the top 12 bits of an IEEE fp16: 1 sign, 5 exponent bits with bias 15, 6
mantissa bits; codes are uint16 values 0..0xFFF):

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
"""

from __future__ import annotations

import torch
from einops import rearrange

from .contract import (
    CAST_INPUT_DTYPES,
    E4M3,
    QuantFormat,
    ScaleLayout,
    ceil_div,
    check_cast_format,
    check_scale_flags,
    check_scale_tensor,
    check_tensor,
    check_unit_inner_stride,
)
from .quant import encode_e2m1, encode_e4m3, scales_from_amax, scales_from_layout, scales_to_layout

__all__ = [
    "E5M6_MAX",
    "E5M6_MIN_SUBNORMAL",
    "E5M6_NAN",
    "encode_e5m6",
    "decode_e5m6",
    "pack_e5m6",
    "unpack_e5m6",
    "per_block_cast",
    "per_block_cast_with_sf_only",
    "per_block_cast_with_precomputed_sf",
    "per_channel_cast",
]

E5M6_MAX = 65024.0
E5M6_MIN_SUBNORMAL = 2.0**-20
E5M6_INF = 0x7C0
E5M6_NAN = 0x7FF
E5M6_SIGN = 0x800
PER_BLOCK_SIZES = (32, 128)
PER_CHANNEL_TOKEN_BLOCKS = (32, 128)


# ---------------------------------------------------------------------------------------------
# E5M6
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# 2-D block casts
# ---------------------------------------------------------------------------------------------


def _encode(fmt: QuantFormat, y: torch.Tensor) -> torch.Tensor:
    return encode_e4m3(y) if fmt is E4M3 else encode_e2m1(y)


def _block_amax_2d(values: torch.Tensor, bm: int, bk: int) -> torch.Tensor:
    """fp32 ``[T, H]`` → ``[ceil(T/bm), ceil(H/bk)]`` block maxima of ``|x|``; tails padded with zeros."""
    tokens, hidden = values.shape
    rows, kblocks = ceil_div(tokens, bm), ceil_div(hidden, bk)
    padded = torch.zeros((rows * bm, kblocks * bk), dtype=torch.float32, device=values.device)
    padded[:tokens, :hidden] = values
    blocks = rearrange(padded.abs(), "(r i) (k j) -> r k (i j)", i=bm, j=bk)
    if blocks.numel() == 0:
        return blocks.new_zeros((rows, kblocks))
    return blocks.amax(dim=-1)  # NaN-propagating


def _expand(per_block: torch.Tensor, bm: int, bk: int, tokens: int, hidden: int) -> torch.Tensor:
    """Block values ``[rows, kblocks]`` → one per element ``[T, H]``."""
    return per_block.repeat_interleave(bm, dim=0).repeat_interleave(bk, dim=1)[:tokens, :hidden]


def _check_block_cast(x, fmt, block_size, x_block_size) -> tuple[QuantFormat, int, int]:
    spec = check_cast_format(fmt)
    if x_block_size is not None:
        raise ValueError(
            "x_block_size is only meaningful when x is an already quantized (data, sf) pair, which this "
            f"release does not accept; got x_block_size={x_block_size!r}"
        )
    if not (
        isinstance(block_size, (tuple, list))
        and len(block_size) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) for b in block_size)
    ):
        raise TypeError(f"block_size must be a (rows, columns) pair of ints, got {block_size!r}")
    bm, bk = block_size
    if bm not in PER_BLOCK_SIZES or bk not in PER_BLOCK_SIZES:
        raise ValueError(f"block_size must be (bm, bk) with bm, bk in {PER_BLOCK_SIZES}, got {tuple(block_size)}")
    check_tensor("x", x, dtypes=CAST_INPUT_DTYPES, ndim=2)
    check_unit_inner_stride("x", x)
    if spec.values_per_byte == 2 and x.shape[1] % 2:
        raise ValueError(f"e2m1 packs two values per byte: hidden ({x.shape[1]}) must be even")
    return spec, bm, bk


def _check_block_cast_with_scales(
    x, fmt, block_size, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0
) -> tuple[QuantFormat, int, int, bool, ScaleLayout]:
    """The block-cast checks plus the scale flags: format, block, effective round_sf, layout."""
    spec, bm, bk = _check_block_cast(x, fmt, block_size, x_block_size)
    round_sf = check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    return spec, bm, bk, round_sf, ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)


def per_block_cast(
    x: torch.Tensor,
    fmt: str,
    block_size,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one scale per 2-D block of ``bm`` rows × ``bk`` columns.

    Args:
        x: bf16 or fp32 ``[T, H]``, unit stride along H.
        fmt: ``"e4m3"`` (data float8_e4m3fn ``[T, H]``) or ``"e2m1"`` (int8 ``[T, H/2]``, H even).
        block_size: ``(bm, bk)``, each 32 or 128. Tail blocks (T or H not a multiple) are partial;
            their missing elements count as zeros for the amax.
        x_block_size: must be None (re-quantization is not part of this release).
        use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0: the scale layout and rounding,
            exactly as for ``per_token_cast``, with ``ceil(T/bm)`` scale rows.

    Returns:
        ``(q, sf)``, ``sf`` of logical shape ``[ceil(T/bm), ceil(H/bk)]`` (packed: int32
        ``[ceil(T/bm), ceil(ceil(H/bk)/4)]``).
    """
    spec, bm, bk, round_sf, layout = _check_block_cast_with_scales(
        x, fmt, block_size, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0
    )
    values = x.to(torch.float32)
    sf, multiplier = scales_from_amax(_block_amax_2d(values, bm, bk), spec, round_sf)
    q = _encode(spec, values * _expand(multiplier, bm, bk, *values.shape))
    return q, scales_to_layout(sf, layout)


def per_block_cast_with_sf_only(
    x: torch.Tensor,
    fmt: str,
    block_size,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """The scales ``per_block_cast`` would return, without the data."""
    spec, bm, bk, round_sf, layout = _check_block_cast_with_scales(
        x, fmt, block_size, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0
    )
    sf, _ = scales_from_amax(_block_amax_2d(x.to(torch.float32), bm, bk), spec, round_sf)
    return scales_to_layout(sf, layout)


def per_block_cast_with_precomputed_sf(
    x: torch.Tensor,
    fmt: str,
    block_size,
    sf: torch.Tensor,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """Quantize with given scales (in the layout the flags name): ``q = encode(x · (1 / sf))``."""
    spec, bm, bk, _, layout = _check_block_cast_with_scales(
        x, fmt, block_size, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0
    )
    tokens, hidden = x.shape
    rows, kblocks = ceil_div(tokens, bm), ceil_div(hidden, bk)
    check_scale_tensor("sf", sf, rows=rows, kblocks=kblocks, layout=layout, device=x.device)
    scales = scales_from_layout(sf, kblocks)
    multiplier = torch.ones_like(scales) / scales
    return _encode(spec, x.to(torch.float32) * _expand(multiplier, bm, bk, tokens, hidden))


# ---------------------------------------------------------------------------------------------
# Per-channel casts (column blocks of num_per_tokens tokens × 1 channel)
# ---------------------------------------------------------------------------------------------


def per_channel_cast(
    x: torch.Tensor, fmt: str = "e4m3", num_per_tokens: int = 128, round_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one scale per column block of ``num_per_tokens`` tokens of one channel.

    Args:
        x: bf16 or fp32 ``[T, H]``, unit stride along H.
        fmt: ``"e4m3"`` (data ``[T, H]``) or ``"e2m1"`` (int8 ``[T, H/2]`` packed along H, H even).
        num_per_tokens: 32 or 128 (default). The last block of a column is partial when T is not a
            multiple; its missing elements count as zeros.
        round_sf: round every scale up to a power of two.

    Returns:
        ``(q, sf)``, ``sf`` fp32 row-major ``[ceil(T / num_per_tokens), H]``.
    """
    spec = check_cast_format(fmt)
    if isinstance(num_per_tokens, bool) or num_per_tokens not in PER_CHANNEL_TOKEN_BLOCKS:
        raise ValueError(f"num_per_tokens must be one of {PER_CHANNEL_TOKEN_BLOCKS}, got {num_per_tokens!r}")
    check_tensor("x", x, dtypes=CAST_INPUT_DTYPES, ndim=2)
    check_unit_inner_stride("x", x)
    if spec.values_per_byte == 2 and x.shape[1] % 2:
        raise ValueError(f"e2m1 packs two values per byte: hidden ({x.shape[1]}) must be even")
    round_sf = check_scale_flags(spec, round_sf, False)
    values = x.to(torch.float32)
    sf, multiplier = scales_from_amax(_block_amax_2d(values, num_per_tokens, 1), spec, round_sf)
    q = _encode(spec, values * _expand(multiplier, num_per_tokens, 1, *values.shape))
    return q, sf.contiguous()

"""Reference twin of the quantization family, continued (contract §1): 2-D blocks, channels, lossless.

Plain PyTorch, CPU and GPU, written to be read. The scale rule is *not* restated here: every cast
takes its ``(sf, multiplier)`` from ``quant.scales_from_amax`` and stores scales with
``quant.scales_to_layout``, so the per-token, per-block and per-channel casts cannot drift apart.
A quantized ``(q, sf)`` input is read with ``quant.dequantize`` (``decode(q) · sf`` in fp32).

- ``per_block_cast`` (+ ``_with_sf_only``, ``_with_precomputed_sf``): one scale per ``bm × bk``
  block, bm, bk in {32, 128}; tail blocks are partial, their missing elements count as zeros.
- ``per_channel_cast``: one scale per column block of ``num_per_tokens`` tokens × 1 channel.
- ``per_channel_cast_fused``: the same after an optional row gather ``x[pos_to_token]`` (-1: a zero
  row) and an optional dequantization of a 1×128-scaled e4m3 input; any number of rows P (the
  last token block holds the P mod nt rows that exist).
- ``per_channel_cast_and_transpose``: ``per_channel_cast`` with the data returned transposed.
- ``per_block_cast_lossless``: FP4 with power-of-two scales → FP8 with coarser power-of-two scales,
  exact or refused (see its docstring).

The E5M6 format (``encode_e5m6`` ... ``unpack_e5m6``) lives in ``quant`` next to the other element
encodings; its names are re-exported here.
"""

from __future__ import annotations

import torch
from einops import rearrange

from .contract import (
    E2M1,
    E4M3,
    PER_BLOCK_SIZES,
    PER_CHANNEL_TOKEN_BLOCKS,
    QuantFormat,
    ScaleLayout,
    ceil_div,
    check_block_cast_input,
    check_block_shape,
    check_cast_format,
    check_cast_source,
    check_choice,
    check_num_per_tokens,
    check_out_block_size,
    check_pos_to_token,
    check_power_of_two_scales,
    check_quantized_input,
    check_scale_flags,
    check_scale_tensor,
)
from .quant import (
    E5M6_MAX,
    E5M6_MIN_SUBNORMAL,
    E5M6_NAN,
    decode_e2m1,
    decode_e5m6,
    dequantize,
    encode,
    encode_e4m3,
    encode_e5m6,
    expand_blocks,
    pack_e5m6,
    scales_from_amax,
    scales_from_layout,
    scales_to_layout,
    unpack_e5m6,
)

__all__ = [
    "E5M6_MAX",
    "E5M6_MIN_SUBNORMAL",
    "E5M6_NAN",
    "PER_BLOCK_SIZES",
    "PER_CHANNEL_TOKEN_BLOCKS",
    "LOSSLESS_EXPONENT_HEADROOM",
    "encode_e5m6",
    "decode_e5m6",
    "pack_e5m6",
    "unpack_e5m6",
    "per_block_cast",
    "per_block_cast_with_sf_only",
    "per_block_cast_with_precomputed_sf",
    "per_channel_cast",
    "per_channel_cast_fused",
    "per_channel_cast_and_transpose",
    "per_block_cast_lossless",
]

FP8_ONLY = {"e4m3": E4M3}  # the formats of the fused per-channel casts and of the lossless cast
FUSED_TOKEN_BLOCKS = (128,)  # num_per_tokens of per_channel_cast_fused
FUSED_INPUT_CHANNEL_BLOCK = 128  # the 1×128 blocks of a quantized input of per_channel_cast_fused
# log2(e4m3 max power of two 2^8 / e2m1 max power of two 2^2): E_out = max(E_in) - 6 puts the
# largest FP4 value of an output block (6 · 2^(E_max)) at 384 · 2^(E_out), inside e4m3's range.
LOSSLESS_EXPONENT_HEADROOM = 6


# ---------------------------------------------------------------------------------------------
# 2-D block casts
# ---------------------------------------------------------------------------------------------


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


def _block_cast_source(x, fmt, block_size, x_block_size) -> tuple[torch.Tensor, QuantFormat, int, int]:
    """The values to quantize (fp32 ``[T, H]``; a quantized tuple is dequantized), format, block."""
    if not isinstance(x, tuple):
        spec, bm, bk = check_block_cast_input(x, fmt, block_size, x_block_size)
        return x.to(torch.float32), spec, bm, bk
    spec = check_cast_format(fmt)
    bm, bk = check_block_shape("block_size", block_size)
    values = dequantize(x, x_block_size)
    if spec.values_per_byte == 2 and values.shape[1] % 2:
        raise ValueError(f"e2m1 packs two values per byte: hidden ({values.shape[1]}) must be even")
    return values, spec, bm, bk


def _block_cast_with_scales(
    x, fmt, block_size, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0
) -> tuple[torch.Tensor, QuantFormat, int, int, bool, ScaleLayout]:
    """The block-cast source plus the scale flags: values, format, block, effective round_sf, layout."""
    values, spec, bm, bk = _block_cast_source(x, fmt, block_size, x_block_size)
    round_sf = check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    return values, spec, bm, bk, round_sf, ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)


def per_block_cast(
    x,
    fmt: str,
    block_size,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one scale per 2-D block of ``bm`` rows × ``bk`` columns.

    Args:
        x: bf16 or fp32 ``[T, H]``, unit stride along H. Or an already quantized ``(data, sf)``
            tuple (re-quantization), dequantized first with ``x_block_size`` (``quant.dequantize``).
        fmt: ``"e4m3"`` (data float8_e4m3fn ``[T, H]``) or ``"e2m1"`` (int8 ``[T, H/2]``, H even).
        block_size: ``(bm, bk)``, each 32 or 128. Tail blocks (T or H not a multiple) are partial;
            their missing elements count as zeros for the amax.
        x_block_size: the block of a quantized ``x``: ``(1, C)``, ``(bm, bk)`` or ``(nt, 1)``; None
            for a plain tensor.
        use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0: the scale layout and rounding,
            exactly as for ``per_token_cast``, with ``ceil(T/bm)`` scale rows.

    Returns:
        ``(q, sf)``, ``sf`` of logical shape ``[ceil(T/bm), ceil(H/bk)]`` (packed: int32
        ``[ceil(T/bm), ceil(ceil(H/bk)/4)]``).
    """
    values, spec, bm, bk, round_sf, layout = _block_cast_with_scales(
        x, fmt, block_size, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0
    )
    sf, multiplier = scales_from_amax(_block_amax_2d(values, bm, bk), spec, round_sf)
    q = encode(spec, values * expand_blocks(multiplier, bm, bk, *values.shape))
    return q, scales_to_layout(sf, layout)


def per_block_cast_with_sf_only(
    x,
    fmt: str,
    block_size,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """The scales ``per_block_cast`` would return, without the data."""
    values, spec, bm, bk, round_sf, layout = _block_cast_with_scales(
        x, fmt, block_size, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0
    )
    sf, _ = scales_from_amax(_block_amax_2d(values, bm, bk), spec, round_sf)
    return scales_to_layout(sf, layout)


def per_block_cast_with_precomputed_sf(
    x,
    fmt: str,
    block_size,
    sf: torch.Tensor,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """Quantize with given scales (in the layout the flags name): ``q = encode(x · (1 / sf))``."""
    values, spec, bm, bk, _, layout = _block_cast_with_scales(
        x, fmt, block_size, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0
    )
    tokens, hidden = values.shape
    rows, kblocks = ceil_div(tokens, bm), ceil_div(hidden, bk)
    check_scale_tensor("sf", sf, rows=rows, kblocks=kblocks, layout=layout, device=values.device)
    scales = scales_from_layout(sf, kblocks)
    multiplier = torch.ones_like(scales) / scales
    return encode(spec, values * expand_blocks(multiplier, bm, bk, tokens, hidden))


# ---------------------------------------------------------------------------------------------
# Per-channel casts (column blocks of num_per_tokens tokens × 1 channel)
# ---------------------------------------------------------------------------------------------


def _per_channel(values: torch.Tensor, spec: QuantFormat, num_per_tokens: int, round_sf: bool):
    """fp32 ``[T, H]`` → ``(q [T, H(/2)], sf fp32 [ceil(T/nt), H])``, one scale per column block."""
    sf, multiplier = scales_from_amax(_block_amax_2d(values, num_per_tokens, 1), spec, round_sf)
    q = encode(spec, values * expand_blocks(multiplier, num_per_tokens, 1, *values.shape))
    return q, sf.contiguous()


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
    check_num_per_tokens(num_per_tokens)
    check_cast_source(x, spec)
    round_sf = check_scale_flags(spec, round_sf, False)
    return _per_channel(x.to(torch.float32), spec, num_per_tokens, round_sf)


def _gather_rows(values: torch.Tensor, pos_to_token: torch.Tensor) -> torch.Tensor:
    """Row ``p`` of the result is ``values[pos_to_token[p]]``, or a row of zeros where it is -1."""
    tokens, hidden = values.shape
    with_zero_row = torch.cat([values, values.new_zeros((1, hidden))])  # row T: the padding row
    index = torch.where(pos_to_token < 0, tokens, pos_to_token.to(torch.int64))
    return with_zero_row[index]


def per_channel_cast_fused(
    x,
    fmt: str,
    num_per_tokens: int = 128,
    round_sf: bool = False,
    num_per_channels: int | None = None,
    pos_to_token: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel cast of ``x``'s rows, optionally gathered and dequantized first.

    Args:
        x: bf16 or fp32 ``[T, H]`` (unit stride along H), or a tuple ``(q, sf)`` quantized with
            1×128 blocks (q float8_e4m3fn ``[T, H]``, sf in any layout), dequantized first
            (``decode(q) · sf`` in fp32, ``quant.dequantize``).
        fmt: ``"e4m3"``.
        num_per_tokens: 128, the token block of the output scales.
        round_sf: round every scale up to a power of two.
        num_per_channels: 128 when ``x`` is a ``(q, sf)`` tuple (the width of its blocks); None for a
            plain tensor.
        pos_to_token: optional int32 ``[P]``: output row ``p`` is row ``pos_to_token[p]`` of the
            (dequantized) ``x``, or a row of zeros where it is -1. Without it, P = T.

    Returns:
        ``(q, sf)``: q float8_e4m3fn ``[P, H]``, sf fp32 row-major ``[ceil(P / 128), H]``. Any P: the
        last token block's scale is taken over the ``P mod 128`` rows that exist (nothing past P
        is read). Padding rows are +0 (byte 0x00) and, being zero, never raise a scale.
    """
    check_choice("fmt", fmt, FP8_ONLY)
    check_num_per_tokens(num_per_tokens, FUSED_TOKEN_BLOCKS)
    round_sf = check_scale_flags(E4M3, round_sf, False)
    if isinstance(x, tuple):
        if num_per_channels != FUSED_INPUT_CHANNEL_BLOCK:
            raise ValueError(
                f"num_per_channels must be {FUSED_INPUT_CHANNEL_BLOCK} (the width of the 1×128 blocks of a "
                f"quantized x), got {num_per_channels!r}"
            )
        block = (1, FUSED_INPUT_CHANNEL_BLOCK)
        check_quantized_input("x", x, block, formats=(E4M3,))
        values = dequantize(x, block)
    else:
        if num_per_channels is not None:
            raise ValueError(
                "num_per_channels is the block width of a quantized (q, sf) x; it must be None for a plain "
                f"tensor, got {num_per_channels!r}"
            )
        values = check_cast_source(x, E4M3).to(torch.float32)
    if pos_to_token is not None:
        check_pos_to_token(pos_to_token, values.shape[0], values.device)
        values = _gather_rows(values, pos_to_token)
    return _per_channel(values, E4M3, num_per_tokens, round_sf)


def per_channel_cast_and_transpose(
    x: torch.Tensor, fmt: str, num_per_tokens: int, round_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_channel_cast`` of a bf16 ``x``, the data returned transposed.

    Args:
        x: bf16 ``[T, H]``, unit stride along H.
        fmt: ``"e4m3"``.
        num_per_tokens: 32 or 128.
        round_sf: round every scale up to a power of two.

    Returns:
        ``(q, sf)``: q float8_e4m3fn ``[H, T]`` contiguous, ``q[h, t]`` the code of ``x[t, h]``; sf
        fp32 row-major ``[ceil(T / num_per_tokens), H]`` (the scale of ``q[h, t]`` is
        ``sf[t // num_per_tokens, h]``).
    """
    check_choice("fmt", fmt, FP8_ONLY)
    check_num_per_tokens(num_per_tokens)
    check_cast_source(x, E4M3, dtypes=(torch.bfloat16,))
    round_sf = check_scale_flags(E4M3, round_sf, False)
    q, sf = _per_channel(x.to(torch.float32), E4M3, num_per_tokens, round_sf)
    return q.T.contiguous(), sf


# ---------------------------------------------------------------------------------------------
# Lossless FP4 → FP8
# ---------------------------------------------------------------------------------------------


def per_block_cast_lossless(
    x,
    fmt: str,
    x_block_size,
    out_block_size,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-quantize FP4 data with power-of-two scales to e4m3 with coarser power-of-two scales, exactly.

    With ``E_in`` the biased exponent of an input block's scale (``sf = 2^(E_in - 127)``), each
    output block gets ``E_out = max(E_in over its input blocks) - 6``, at least 1, and every value
    ``v`` of an input block becomes the e4m3 value ``v · 2^(E_in - E_out)``: ``decode(q_out) ·
    sf_out == decode(q_in) · sf_in``, bit for bit in fp32.

    ``E_in - E_out <= 6``, so ``|v · 2^d| <= 6 · 64 = 384 < 448``: nothing saturates. Downwards,
    every FP4 value is an e4m3 normal for ``d >= -5`` (an exponent spread of up to 11 inside an
    output block) and still exact in e4m3's subnormals for ``d >= -8``; below that a value is exact
    only if it is a multiple of 2^-9 (zero always is). A value that e4m3 cannot hold is refused
    with a ``ValueError`` naming it (TileKernels refuses every spread above 11 with a device-side
    assert, whatever the values; every input it accepts gives the same bytes here). The lower
    clamp of ``E_out`` at 1 keeps the output scale a normal fp32 number (TileKernels clamps at 0,
    which stores the scale 0.0 and loses such a block; it only happens when every input scale of
    the block is at most 2^-121).

    Args:
        x: ``(q, sf)`` tuple: q packed e2m1 int8 ``[T, H/2]`` (unit inner stride), sf its scales in
            any layout, each a positive normal power of two (``round_sf=True`` scales).
        fmt: ``"e4m3"``.
        x_block_size: the input block (``(1, 32)`` for MXFP4; any block the casts make).
        out_block_size: the output block, a multiple of ``x_block_size`` in both dimensions, e.g.
            ``(1, 128)``, ``(32, 32)``, ``(128, 128)``.
        use_tma_aligned_col_major_sf, use_packed_ue8m0: the output scale layout, as for the casts.
        round_sf: accepted for signature symmetry; the output scales are powers of two anyway.

    Returns:
        ``(q, sf)``: q float8_e4m3fn ``[T, H]``; sf ``2^(E_out - 127)`` of logical shape
        ``[ceil(T/bm_out), ceil(H/bk_out)]`` in the layout the flags name.
    """
    check_choice("fmt", fmt, FP8_ONLY)
    data, sf, _, hidden, (in_bm, in_bk) = check_quantized_input("x", x, x_block_size, formats=(E2M1,))
    out_bm, out_bk = check_out_block_size(out_block_size, (in_bm, in_bk), hidden)
    check_scale_flags(E4M3, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)
    tokens = data.shape[0]

    scales_in = scales_from_layout(sf, ceil_div(hidden, in_bk))
    check_power_of_two_scales("x[1]", scales_in)
    exponent_in = expand_blocks(scales_in.view(torch.int32) >> 23, in_bm, in_bk, tokens, hidden)
    # Exponents are >= 1, so the zeros padding a tail block never win the maximum.
    largest_in = _block_amax_2d(exponent_in.to(torch.float32), out_bm, out_bk).to(torch.int32)
    exponent_out = torch.clamp(largest_in - LOSSLESS_EXPONENT_HEADROOM, min=1)
    shift = exponent_in - expand_blocks(exponent_out, out_bm, out_bk, tokens, hidden)

    # fp64 holds v · 2^shift exactly for every shift (down to 1 - 254), so the check below sees
    # the true value even where fp32 would underflow.
    exact = decode_e2m1(data).to(torch.float64) * _power_of_two_f64(shift)
    q = encode_e4m3(exact.to(torch.float32))
    _refuse_inexact(q, exact, shift, exponent_in, (out_bm, out_bk))
    sf_out = (exponent_out << 23).view(torch.float32)
    return q, scales_to_layout(sf_out, layout)


def _power_of_two_f64(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent in fp64, built from its bits (exact on every device, unlike exp2 or pow)."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def _refuse_inexact(q, exact, shift, exponent_in, out_block) -> None:
    inexact = q.to(torch.float64) != exact
    if not bool(inexact.any()):
        return
    t, h = (int(i) for i in inexact.nonzero()[0])
    d, e = int(shift[t, h]), int(exponent_in[t, h])
    value = float(exact[t, h]) / 2.0**d
    raise ValueError(
        f"x cannot be cast to e4m3 losslessly: element [{t}, {h}] is {value} · 2^{e - 127}, and e4m3 has no "
        f"{value} · 2^{d}; its input block's scale exponent is {LOSSLESS_EXPONENT_HEADROOM - d} below the "
        f"largest of its out_block_size {out_block} block (spreads up to 11 are always exact)"
    )

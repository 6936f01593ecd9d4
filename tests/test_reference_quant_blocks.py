"""E5M6 and the 2-D block / per-channel casts of the reference twin, proven on the CPU.

E5M6 is checked exhaustively over its 4096 codes and at every rounding boundary against an
independent rule (the nearest of the sorted code values, ties to the even code, computed with
``fractions``). The block casts are checked against ``quant.per_token_cast`` through a
rearrangement (a bm×bk block is a row of bm·bk values with ``C == H``), so the scale rule is the
per-token one by construction *and* by test.
"""

from __future__ import annotations

import math
import struct
import zlib
from fractions import Fraction

import pytest
import torch
from einops import rearrange

from tileproof.reference import quant as rq
from tileproof.reference import quant_blocks as qb
from tileproof.reference.contract import ScaleLayout, align, ceil_div

ALL_CODES = torch.arange(4096, dtype=torch.int32).to(torch.uint16)


def f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def next_f32(v: float, direction: float) -> float:
    return f32(math.nextafter(v, direction)) if f32(math.nextafter(v, direction)) != v else _step(v, direction)


def _step(v: float, direction: float) -> float:
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    up = (direction > v) == (v >= 0)
    return struct.unpack("<f", struct.pack("<I", bits + (1 if up else -1)))[0]


def positive_values() -> list[Fraction]:
    """Exact values of codes 0..0x7BF (finite, non-negative), then 2^16 standing in for Inf (0x7C0)."""
    out = []
    for code in range(0x7C0):
        exponent, mantissa = code >> 6, code & 0x3F
        if exponent == 0:
            out.append(Fraction(mantissa, 64) * Fraction(1, 2**14))
        else:
            out.append((1 + Fraction(mantissa, 64)) * Fraction(2) ** (exponent - 15))
    out.append(Fraction(2**16))
    return out


POSITIVE = positive_values()


def scalar_encode(v: float) -> int:
    """Independent e5m6 encoder: nearest value, ties to the even code, ≥ 65280 → Inf."""
    if math.isnan(v):
        return qb.E5M6_NAN
    sign = 0x800 if math.copysign(1.0, v) < 0 else 0
    if math.isinf(v):
        return sign | 0x7C0
    m = Fraction(abs(v))
    lo, hi = 0, len(POSITIVE) - 1
    if m >= POSITIVE[-1]:
        return sign | 0x7C0
    while hi - lo > 1:  # POSITIVE[lo] <= m < POSITIVE[hi]
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if POSITIVE[mid] <= m else (lo, mid)
    below, above = m - POSITIVE[lo], POSITIVE[hi] - m
    code = lo if below < above or (below == above and lo % 2 == 0) else hi
    return sign | code


def encode_list(values: list[float]) -> list[int]:
    return qb.encode_e5m6(torch.tensor(values, dtype=torch.float32)).to(torch.int32).tolist()


# ---------------------------------------------------------------------------------------------
# E5M6
# ---------------------------------------------------------------------------------------------


def test_e5m6_decode_exhaustive_matches_independent_values():
    decoded = qb.decode_e5m6(ALL_CODES).tolist()
    for code, value in enumerate(decoded):
        magnitude_code, sign = code & 0x7FF, -1.0 if code & 0x800 else 1.0
        if magnitude_code > 0x7C0:
            assert math.isnan(value), hex(code)
        elif magnitude_code == 0x7C0:
            assert value == sign * math.inf
        else:
            assert value == sign * float(POSITIVE[magnitude_code]), hex(code)
            assert math.copysign(1.0, value) == sign
    assert qb.decode_e5m6(torch.tensor([0x7BF], dtype=torch.uint16)).item() == qb.E5M6_MAX
    assert qb.decode_e5m6(torch.tensor([0x001], dtype=torch.uint16)).item() == qb.E5M6_MIN_SUBNORMAL


def test_e5m6_decode_then_encode_is_identity_on_non_nan_codes():
    values = qb.decode_e5m6(ALL_CODES)
    codes = qb.encode_e5m6(values).to(torch.int32)
    expected = ALL_CODES.to(torch.int32)
    not_nan = ~torch.isnan(values)
    assert torch.equal(codes[not_nan], expected[not_nan])  # both zeros and both infinities included
    assert int(not_nan.sum()) == 4096 - 2 * 63
    assert torch.all(codes[~not_nan] == qb.E5M6_NAN)
    assert encode_list([0.0, -0.0]) == [0x000, 0x800]


def test_e5m6_round_to_nearest_even_at_every_boundary():
    inputs, expected = [], []
    for lower in range(0x7C0):
        a, b = POSITIVE[lower], POSITIVE[lower + 1]
        midpoint = f32(float((a + b) / 2))
        assert Fraction(midpoint) == (a + b) / 2  # exact in fp32: e5m6 has 7 significant bits
        even = lower if lower % 2 == 0 else lower + 1
        for v, code in ((midpoint, even), (_step(midpoint, -1.0), lower), (_step(midpoint, math.inf), lower + 1)):
            for sign in (1.0, -1.0):
                inputs.append(sign * v)
                expected.append(code | (0x800 if sign < 0 else 0))
    assert encode_list(inputs) == expected
    # The top boundary: the midpoint 65280 between 65024 (odd code 0x7BF) and 2^16 goes to Inf.
    assert encode_list([65280.0, _step(65280.0, -1.0), -65280.0]) == [0x7C0, 0x7BF, 0xFC0]


def test_e5m6_encode_matches_independent_encoder_on_random_fp32():
    g = torch.Generator().manual_seed(5)
    exponents = torch.randint(-30, 18, (3000,), generator=g).to(torch.float32)
    values = torch.randn(3000, generator=g) * torch.exp2(exponents)
    codes = qb.encode_e5m6(values).to(torch.int32).tolist()
    assert codes == [scalar_encode(v) for v in values.tolist()]


def test_e5m6_specials():
    nan_bits = torch.tensor([0x7FC00000, 0xFFC00000 - 2**32, 0x7F800001, 0x7FFFFFFF], dtype=torch.int32)
    assert encode_list(nan_bits.view(torch.float32).tolist()) == [qb.E5M6_NAN] * 4
    big = [math.inf, -math.inf, 1e30, -3.0e38, 65536.0, 70000.0]
    assert encode_list(big) == [0x7C0, 0xFC0, 0x7C0, 0xFC0, 0x7C0, 0x7C0]
    tiny = [2.0**-21, -(2.0**-21), f32(2.0**-21 * 1.0001), 1e-30, -1e-30]
    assert encode_list(tiny) == [0x000, 0x800, 0x001, 0x000, 0x800]
    bf16 = torch.tensor([1.0, -2.5], dtype=torch.bfloat16)
    assert qb.encode_e5m6(bf16).to(torch.int32).tolist() == [0x3C0, 0xC10]


def test_e5m6_pack_byte_layout_of_a_hand_built_group():
    codes = torch.tensor([[0x123, 0x456, 0x789, 0xABC, 0xDEF, 0x012, 0x345, 0x678]], dtype=torch.int32)
    packed = qb.pack_e5m6(codes.to(torch.uint16))
    # 96 bits "123456789ABCDEF012345678" → words 0x12345678, 0x9ABCDEF0, 0x12345678, little-endian.
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (1, 12)
    assert bytes(packed[0].tolist()).hex() == "78563412f0debc9a78563412"
    assert torch.equal(qb.unpack_e5m6(packed).to(torch.int32), codes)
    as_words = packed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert as_words.tolist() == [[0x12345678, 0x9ABCDEF0, 0x12345678]]


def test_e5m6_pack_round_trips_all_codes_and_validates():
    codes = ALL_CODES.reshape(8, 512)
    packed = qb.pack_e5m6(codes)
    assert tuple(packed.shape) == (8, 768)
    assert torch.equal(qb.unpack_e5m6(packed).to(torch.int32), codes.to(torch.int32))
    with pytest.raises(ValueError, match="multiple of 8"):
        qb.pack_e5m6(codes[:, :7])
    with pytest.raises(ValueError, match="12 bytes"):
        qb.unpack_e5m6(packed[:, :10])
    with pytest.raises(TypeError, match="uint8"):
        qb.unpack_e5m6(packed.to(torch.int32))


# ---------------------------------------------------------------------------------------------
# per_block_cast
# ---------------------------------------------------------------------------------------------


def decode(fmt: str, q: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) if fmt == "e4m3" else rq.decode_e2m1(q)


def via_per_token(x: torch.Tensor, fmt: str, bm: int, bk: int, round_sf: bool):
    """per_block_cast rebuilt from per_token_cast: each padded bm×bk block becomes one row."""
    tokens, hidden = x.shape
    rows, kblocks = ceil_div(tokens, bm), ceil_div(hidden, bk)
    padded = torch.zeros((rows * bm, kblocks * bk), dtype=x.dtype)
    padded[:tokens, :hidden] = x
    as_rows = rearrange(padded, "(r i) (k j) -> (r k) (i j)", i=bm, j=bk).contiguous()
    q, sf = rq.per_token_cast(as_rows, fmt, bm * bk, round_sf=round_sf)
    values = rearrange(decode(fmt, q), "(r k) (i j) -> (r i) (k j)", r=rows, i=bm)[:tokens, :hidden]
    return values, sf.reshape(rows, kblocks)


SHAPES = [(32, 128), (33, 130), (200, 96), (1, 2), (129, 300)]


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("block", [(32, 32), (32, 128), (128, 32), (128, 128)])
@pytest.mark.parametrize("round_sf", [False, True])
def test_per_block_equals_per_token_on_rearranged_blocks(fmt, block, round_sf):
    g = torch.Generator().manual_seed(zlib.crc32(repr((fmt, block, round_sf)).encode()))
    for tokens, hidden in SHAPES:
        x = torch.randn(tokens, hidden, generator=g) * torch.exp2(torch.randint(-8, 8, (tokens, 1), generator=g))
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            q, sf = qb.per_block_cast(xd, fmt, block, round_sf=round_sf)
            values, sf_expected = via_per_token(xd, fmt, *block, round_sf)
            assert q.dtype == (torch.float8_e4m3fn if fmt == "e4m3" else torch.int8)
            assert tuple(sf.shape) == (ceil_div(tokens, block[0]), ceil_div(hidden, block[1]))
            assert torch.equal(sf, sf_expected)
            assert torch.equal(decode(fmt, q), values)


@pytest.mark.parametrize("fmt,qmax", [("e4m3", 448.0), ("e2m1", 6.0)])
def test_per_block_amax_hits_qmax_in_every_block_including_tails(fmt, qmax):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(70, 290, generator=g)
    q, sf = qb.per_block_cast(x, fmt, (32, 128))
    blocks = torch.nn.functional.pad(decode(fmt, q).abs(), (0, 384 - 290, 0, 96 - 70))
    block_max = rearrange(blocks, "(r i) (k j) -> r k (i j)", i=32, j=128).amax(-1)
    assert torch.all(block_max == qmax)
    # A tail block holding a single element: x[64:70, 256:290] only.
    x_tail = torch.zeros(65, 258)
    x_tail[64, 256] = -3.0
    q, sf = qb.per_block_cast(x_tail, fmt, (32, 128))
    assert tuple(sf.shape) == (3, 3)
    assert decode(fmt, q)[64, 256].item() == -qmax
    assert sf[2, 2].item() == f32(3.0 / qmax) and sf[0, 0].item() == f32(1e-4 / qmax if fmt == "e4m3" else 2.0**-126)


@pytest.mark.parametrize(
    "flags", [(True, False, False), (False, True, False), (True, True, True), (False, False, True)]
)
def test_per_block_scale_layouts_are_the_quant_layouts(flags):
    col_major, round_sf, packed = flags
    x = torch.randn(97, 1100, generator=torch.Generator().manual_seed(3))
    q_plain, sf_plain = qb.per_block_cast(x, "e4m3", (32, 32), round_sf=round_sf or packed)
    q, sf = qb.per_block_cast(
        x, "e4m3", (32, 32), use_tma_aligned_col_major_sf=col_major, round_sf=round_sf, use_packed_ue8m0=packed
    )
    layout = ScaleLayout.from_flags(col_major, packed)
    expected = rq.scales_to_layout(sf_plain, layout)
    assert sf.dtype == expected.dtype and sf.shape == expected.shape and sf.stride() == expected.stride()
    assert torch.equal(sf.contiguous().view(torch.int32), expected.contiguous().view(torch.int32))
    rows = ceil_div(97, 32)
    if col_major or packed:
        assert sf.stride() == (1, align(rows, 4))
    assert torch.equal(q.view(torch.uint8), q_plain.view(torch.uint8))
    assert torch.equal(rq.scales_from_layout(sf, ceil_div(1100, 32)), sf_plain)
    only = qb.per_block_cast_with_sf_only(
        x, "e4m3", (32, 32), use_tma_aligned_col_major_sf=col_major, round_sf=round_sf, use_packed_ue8m0=packed
    )
    assert only.stride() == sf.stride() and torch.equal(only.contiguous().view(torch.int32), expected.view(torch.int32))
    if round_sf or packed:
        q2 = qb.per_block_cast_with_precomputed_sf(
            x, "e4m3", (32, 32), sf, use_tma_aligned_col_major_sf=col_major, round_sf=round_sf, use_packed_ue8m0=packed
        )
        assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


def test_per_block_nan_propagates_to_its_block_only():
    x = torch.ones(64, 64)
    x[40, 3] = math.nan
    _, sf = qb.per_block_cast(x, "e4m3", (32, 32))
    assert torch.isnan(sf).tolist() == [[False, False], [True, False]]


def test_per_block_validation():
    x = torch.randn(8, 64)
    with pytest.raises(ValueError, match="block_size must be"):
        qb.per_block_cast(x, "e4m3", (64, 128))
    with pytest.raises(ValueError, match="block_size must be"):
        qb.per_block_cast(x, "e4m3", (1, 128))
    with pytest.raises(TypeError, match="pair of ints"):
        qb.per_block_cast(x, "e4m3", 128)
    with pytest.raises(ValueError, match="fmt must be one of"):
        qb.per_block_cast(x, "e5m6", (32, 32))
    with pytest.raises(ValueError, match="x_block_size"):
        qb.per_block_cast(x, "e4m3", (32, 32), x_block_size=(1, 128))
    with pytest.raises(ValueError, match="must be even"):
        qb.per_block_cast(torch.randn(8, 63), "e2m1", (32, 32))
    with pytest.raises(TypeError, match="dtype"):
        qb.per_block_cast(x.half(), "e4m3", (32, 32))
    with pytest.raises(ValueError, match="unit stride"):
        qb.per_block_cast(torch.randn(64, 8).T, "e4m3", (32, 32))
    with pytest.raises(TypeError, match="round_sf must be a bool"):
        qb.per_block_cast(x, "e4m3", (32, 32), round_sf=1)
    with pytest.raises(ValueError, match="shape"):
        qb.per_block_cast_with_precomputed_sf(x, "e4m3", (32, 32), torch.ones(1, 3))


# ---------------------------------------------------------------------------------------------
# per_channel_cast
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_per_tokens", [32, 128])
@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("tokens", [128, 300, 5])
def test_per_channel_is_per_token_of_the_transpose(num_per_tokens, round_sf, tokens):
    g = torch.Generator().manual_seed(tokens * 7 + num_per_tokens)
    x = torch.randn(tokens, 48, generator=g) * torch.exp2(torch.randint(-6, 6, (1, 48), generator=g))
    for fmt in ("e4m3", "e2m1"):
        q, sf = qb.per_channel_cast(x, fmt, num_per_tokens, round_sf=round_sf)
        assert sf.dtype == torch.float32 and tuple(sf.shape) == (ceil_div(tokens, num_per_tokens), 48)
        assert sf.is_contiguous()
        q_t, sf_t = rq.per_token_cast(x.T.contiguous(), "e4m3", num_per_tokens if tokens != 5 else 5, round_sf=round_sf)
        if fmt == "e4m3":
            assert torch.equal(sf, sf_t.T)
            assert torch.equal(q.view(torch.uint8), q_t.T.contiguous().view(torch.uint8))
        else:
            # e2m1 packs along H; compare the values against the block cast with (num_per_tokens, 1) blocks.
            values = decode("e2m1", q)
            amax = torch.nn.functional.pad(x.abs(), (0, 0, 0, (-tokens) % num_per_tokens))
            amax = rearrange(amax, "(r i) h -> r i h", i=num_per_tokens).amax(1)
            sf_e, mult = rq.scales_from_amax(amax, qb.check_cast_format("e2m1"), round_sf)
            assert torch.equal(sf, sf_e)
            y = x * mult.repeat_interleave(num_per_tokens, 0)[:tokens]
            assert torch.equal(values, rq.decode_e2m1(rq.encode_e2m1(y)))


def test_per_channel_validation():
    x = torch.randn(8, 64)
    with pytest.raises(ValueError, match="num_per_tokens"):
        qb.per_channel_cast(x, "e4m3", 64)
    with pytest.raises(ValueError, match="fmt must be one of"):
        qb.per_channel_cast(x, "fp8")
    with pytest.raises(ValueError, match="must be even"):
        qb.per_channel_cast(torch.randn(8, 7), "e2m1")


# ---------------------------------------------------------------------------------------------
# per_token_cast to e5m6 (one scale per row) and its cast back
# ---------------------------------------------------------------------------------------------

E5M6_FLAGS = [{}, {"round_sf": True}, {"use_tma_aligned_col_major_sf": True}, {"use_packed_ue8m0": True}]


def stored_row_scales(sf: torch.Tensor) -> list[float]:
    """One scale per row, read element by element (packed UE8M0: byte 0 of the row's word)."""
    if sf.dtype == torch.int32:
        return [2.0 ** ((int(sf[r, 0]) & 0xFF) - 127) for r in range(sf.shape[0])]
    return [float(sf[r, 0]) for r in range(sf.shape[0])]


@pytest.mark.parametrize("flags", E5M6_FLAGS, ids=lambda f: "+".join(f) or "plain")
def test_e5m6_cast_follows_the_scale_rule_and_the_independent_encoder(flags, generator):
    rounded = bool(flags) and "use_tma_aligned_col_major_sf" not in flags
    for tokens, hidden, dtype in [
        (0, 8, torch.float32),
        (1, 8, torch.bfloat16),
        (6, 40, torch.float32),
        (3, 96, torch.bfloat16),
    ]:
        x = torch.randn(tokens, hidden, generator=generator) * torch.exp2(
            torch.randint(-12, 12, (tokens, 1), generator=generator)
        )
        if tokens > 2:
            x[1] = torch.randn(hidden, generator=generator) * 1e-7  # below the 1e-4 amax floor
            x[2, 0] = -(2.0**-30)  # rounds to -0 after the multiply
        x = x.to(dtype)
        q, sf = rq.per_token_cast(x, "e5m6", hidden, **flags)
        assert q.dtype == torch.uint8 and tuple(q.shape) == (tokens, hidden * 3 // 2) and q.is_contiguous()
        layout = ScaleLayout.from_flags(
            flags.get("use_tma_aligned_col_major_sf", False), flags.get("use_packed_ue8m0", False)
        )
        expected_sf = rq.scales_to_layout(torch.zeros(tokens, 1), layout)
        assert sf.dtype == expected_sf.dtype and sf.shape == expected_sf.shape and sf.stride() == expected_sf.stride()
        codes = qb.unpack_e5m6(q).to(torch.int32).tolist()
        scales = stored_row_scales(sf)
        for t, row in enumerate(x.to(torch.float32).tolist()):
            amax = max(max(abs(v) for v in row), f32(1e-4))
            if rounded:
                mantissa, exponent = math.frexp(f32(amax / 65024.0))
                scale = 2.0 ** (exponent - 1) if mantissa == 0.5 else 2.0**exponent
                multiplier = 1.0 / scale
            else:
                scale, multiplier = f32(amax / 65024.0), f32(65024.0 / amax)
            assert scales[t] == scale
            assert codes[t] == [scalar_encode(f32(v * multiplier)) for v in row]
        back = rq.cast_back((q, sf), "fp32", (1, hidden), x_special_fmt="e5m6")
        expected_back = [
            [f32(float(POSITIVE[c & 0x7FF]) * (-1 if c & 0x800 else 1) * scales[t]) for c in row]
            for t, row in enumerate(codes)
        ]
        assert back.tolist() == expected_back


def test_e5m6_cast_validation():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="one scale per row"):
        rq.per_token_cast(x, "e5m6", 32)
    with pytest.raises(ValueError, match="multiple of 8"):
        rq.per_token_cast(torch.randn(4, 60), "e5m6", 60)
    with pytest.raises(ValueError, match="takes a plain tensor"):
        rq.per_token_cast(rq.per_token_cast(x, "e4m3", 64), "e5m6", 64, x_block_size=(1, 64))
    with pytest.raises(ValueError, match="fmt must be one of"):
        rq.per_token_cast_with_sf_only(x, "e5m6", 64)
    with pytest.raises(ValueError, match="fmt must be one of"):
        qb.per_block_cast(x, "e5m6", (32, 32))


# ---------------------------------------------------------------------------------------------
# Re-quantization by the block casts
# ---------------------------------------------------------------------------------------------


def block_loop_dequantize(data, sf, fmt: str, bm: int, bk: int) -> torch.Tensor:
    """decode(data) times each block's own scale, one block at a time (scales read word by word)."""
    values = decode(fmt, data)
    tokens, hidden = values.shape
    out = torch.empty_like(values)
    for r in range(ceil_div(tokens, bm)):
        for k in range(ceil_div(hidden, bk)):
            if sf.dtype == torch.int32:
                scale = 2.0 ** (((int(sf[r, k // 4]) >> (8 * (k % 4))) & 0xFF) - 127)
            else:
                scale = float(sf[r, k])
            block = (slice(r * bm, (r + 1) * bm), slice(k * bk, (k + 1) * bk))
            out[block] = values[block] * scale
    return out


REQUANT_SOURCES = {
    "e4m3_1x128": lambda x: (rq.per_token_cast(x, "e4m3", 128), (1, 128), "e4m3"),
    "e2m1_1x32_packed": lambda x: (rq.per_token_cast(x, "e2m1", 32, use_packed_ue8m0=True), (1, 32), "e2m1"),
    "e4m3_128x128_col_major": lambda x: (
        qb.per_block_cast(x, "e4m3", (128, 128), use_tma_aligned_col_major_sf=True),
        (128, 128),
        "e4m3",
    ),
    "e4m3_channel_32": lambda x: (qb.per_channel_cast(x, "e4m3", 32), (32, 1), "e4m3"),
}


@pytest.mark.parametrize("source", REQUANT_SOURCES)
@pytest.mark.parametrize("fmt,block", [("e4m3", (128, 128)), ("e2m1", (32, 32)), ("e4m3", (32, 128))])
def test_per_block_requantization_is_cast_of_the_dequantized_input(source, fmt, block, generator):
    for tokens, hidden in [(0, 64), (1, 128), (45, 160)]:
        x = torch.randn(tokens, hidden, generator=generator) * torch.exp2(
            torch.randint(-5, 5, (tokens, 1), generator=generator)
        )
        pair, x_block, in_fmt = REQUANT_SOURCES[source](x)
        dequantized = block_loop_dequantize(*pair, in_fmt, *x_block)
        for flags in ({}, {"use_packed_ue8m0": True}):
            q, sf = qb.per_block_cast(pair, fmt, block, x_block_size=x_block, **flags)
            q_expected, sf_expected = qb.per_block_cast(dequantized, fmt, block, **flags)
            assert torch.equal(q.view(torch.uint8), q_expected.view(torch.uint8))
            assert sf.stride() == sf_expected.stride() and torch.equal(sf, sf_expected)
            only = qb.per_block_cast_with_sf_only(pair, fmt, block, x_block_size=x_block, **flags)
            assert torch.equal(only, sf_expected)
            given = qb.per_block_cast_with_precomputed_sf(pair, fmt, block, sf, x_block_size=x_block, **flags)
            given_expected = qb.per_block_cast_with_precomputed_sf(dequantized, fmt, block, sf, **flags)
            assert torch.equal(given.view(torch.uint8), given_expected.view(torch.uint8))
            if flags:  # power-of-two scales: 1/sf is the cast's own multiplier, so the same bytes
                assert torch.equal(given.view(torch.uint8), q.view(torch.uint8))


def test_per_block_requantization_validation():
    pair = rq.per_token_cast(torch.randn(4, 66), "e4m3", 64)
    with pytest.raises(TypeError, match="x_block_size must be a"):
        qb.per_block_cast(pair, "e4m3", (32, 32))
    with pytest.raises(ValueError, match=r"x\[1\] must have shape"):
        qb.per_block_cast(pair, "e4m3", (32, 32), x_block_size=(32, 32))
    with pytest.raises(ValueError, match="must be even"):
        qb.per_block_cast(
            (pair[0][:, :65], rq.per_token_cast(torch.randn(4, 65), "e4m3", 65)[1]),
            "e2m1",
            (32, 32),
            x_block_size=(1, 65),
        )
    with pytest.raises(ValueError, match="block_size must be"):
        qb.per_block_cast(pair, "e4m3", (64, 64), x_block_size=(1, 64))


# ---------------------------------------------------------------------------------------------
# per_channel_cast_fused
# ---------------------------------------------------------------------------------------------


def loop_per_channel(rows: list[list[float]], hidden: int, num_per_tokens: int, round_sf: bool):
    """The per-channel cast of fp32 rows, column block by column block, in Python fp32 arithmetic."""
    scales = []
    products = [[0.0] * hidden for _ in rows]
    for start in range(0, len(rows), num_per_tokens):
        block = range(start, min(start + num_per_tokens, len(rows)))  # only the rows that exist
        scale_row = []
        for h in range(hidden):
            amax = max(max(abs(rows[r][h]) for r in block), f32(1e-4))
            if round_sf:
                mantissa, exponent = math.frexp(f32(amax / 448.0))
                scale = 2.0 ** (exponent - 1) if mantissa == 0.5 else 2.0**exponent
                multiplier = 1.0 / scale
            else:
                scale, multiplier = f32(amax / 448.0), f32(448.0 / amax)
            scale_row.append(scale)
            for r in block:
                products[r][h] = f32(rows[r][h] * multiplier)
        scales.append(scale_row)
    return products, scales


def gathered_rows(values: torch.Tensor, pos: list[int]) -> list[list[float]]:
    hidden = values.shape[1]
    return [values[p].tolist() if p >= 0 else [0.0] * hidden for p in pos]


def check_fused(q, sf, rows, hidden, round_sf):
    products, scales = loop_per_channel(rows, hidden, 128, round_sf)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (len(rows), hidden) and q.is_contiguous()
    assert sf.dtype == torch.float32 and tuple(sf.shape) == (ceil_div(len(rows), 128), hidden) and sf.is_contiguous()
    assert sf.tolist() == scales
    expected = rq.encode_e4m3(torch.tensor(products, dtype=torch.float32).reshape(len(rows), hidden))
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("round_sf", [False, True])
def test_per_channel_cast_fused_gathers_rows_including_padding_and_partial_blocks(round_sf, generator):
    hidden = 6
    for tokens, num_rows in [(50, 200), (7, 129), (50, 16), (3, 1), (9, 0), (0, 5)]:
        x = torch.randn(tokens, hidden, generator=generator) * torch.exp2(
            torch.randint(-4, 5, (tokens, 1), generator=generator)
        )
        pos = torch.randint(-1, tokens, (num_rows,), generator=generator, dtype=torch.int32)
        if num_rows > 2:
            pos[-1] = -1  # a padding row in the partial last block
        q, sf = qb.per_channel_cast_fused(x.bfloat16(), "e4m3", 128, round_sf=round_sf, pos_to_token=pos)
        rows = gathered_rows(x.bfloat16().float(), pos.tolist())
        check_fused(q, sf, rows, hidden, round_sf)
        padding = (pos < 0).nonzero().flatten()
        assert torch.all(q.view(torch.uint8)[padding] == 0x00)  # +0


@pytest.mark.parametrize("layout", ["row_major", "col_major", "packed_ue8m0"])
def test_per_channel_cast_fused_dequantizes_a_1x128_input(layout, generator):
    tokens, hidden = 40, 256
    x = torch.randn(tokens, hidden, generator=generator) * torch.exp2(
        torch.randint(-6, 6, (tokens, 2), generator=generator)
    ).repeat_interleave(128, 1)
    flags = {"col_major": {"use_tma_aligned_col_major_sf": True}, "packed_ue8m0": {"use_packed_ue8m0": True}}.get(
        layout, {}
    )
    pair = rq.per_token_cast(x, "e4m3", 128, **flags)
    dequantized = block_loop_dequantize(*pair, "e4m3", 1, 128)
    pos = torch.tensor([5, -1, 0, 39, 5] * 27 + [-1], dtype=torch.int32)  # 136 rows: a partial block of 8
    q, sf = qb.per_channel_cast_fused(pair, "e4m3", 128, num_per_channels=128, pos_to_token=pos)
    expected_q, expected_sf = qb.per_channel_cast(_rows_tensor(gathered_rows(dequantized, pos.tolist())), "e4m3", 128)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8)) and torch.equal(sf, expected_sf)
    q, sf = qb.per_channel_cast_fused(pair, "e4m3", num_per_channels=128)  # no gather: P = T
    expected_q, expected_sf = qb.per_channel_cast(dequantized, "e4m3", 128)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8)) and torch.equal(sf, expected_sf)


def _rows_tensor(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_per_channel_cast_fused_without_gather_is_per_channel_cast(generator):
    for tokens in (256, 300, 1):
        x = torch.randn(tokens, 64, generator=generator)
        q, sf = qb.per_channel_cast_fused(x, "e4m3")
        expected_q, expected_sf = qb.per_channel_cast(x, "e4m3", 128)
        assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8)) and torch.equal(sf, expected_sf)


def test_per_channel_cast_fused_validation():
    x = torch.randn(8, 128)
    pair = rq.per_token_cast(x, "e4m3", 128)
    pos = torch.zeros(4, dtype=torch.int32)
    cases = [
        (lambda: qb.per_channel_cast_fused(x, "e2m1"), ValueError, "fmt must be one of"),
        (lambda: qb.per_channel_cast_fused(x, "e4m3", 32), ValueError, "num_per_tokens must be one of"),
        (lambda: qb.per_channel_cast_fused(x, "e4m3", round_sf=1), TypeError, "round_sf"),
        (lambda: qb.per_channel_cast_fused(x, "e4m3", num_per_channels=128), ValueError, "must be None for a plain"),
        (lambda: qb.per_channel_cast_fused(pair, "e4m3"), ValueError, "num_per_channels must be 128"),
        (
            lambda: qb.per_channel_cast_fused(pair, "e4m3", num_per_channels=64),
            ValueError,
            "num_per_channels must be 128",
        ),
        (
            lambda: qb.per_channel_cast_fused(rq.per_token_cast(x, "e2m1", 128), "e4m3", num_per_channels=128),
            TypeError,
            r"x\[0\] must have dtype in \(float8_e4m3fn\)",
        ),
        (lambda: qb.per_channel_cast_fused(x.half(), "e4m3"), TypeError, "x must have dtype"),
        (
            lambda: qb.per_channel_cast_fused(x, "e4m3", pos_to_token=pos.long()),
            TypeError,
            "pos_to_token must have dtype",
        ),
        (lambda: qb.per_channel_cast_fused(x, "e4m3", pos_to_token=pos[None]), ValueError, "pos_to_token must be 1-D"),
        (lambda: qb.per_channel_cast_fused(x, "e4m3", pos_to_token=pos + 8), ValueError, r"in \[-1, 8\)"),
        (lambda: qb.per_channel_cast_fused(x, "e4m3", pos_to_token=pos - 2), ValueError, "got -2 at position 0"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


# ---------------------------------------------------------------------------------------------
# per_channel_cast_and_transpose
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_per_tokens", [32, 128])
@pytest.mark.parametrize("round_sf", [False, True])
def test_per_channel_cast_and_transpose_is_the_transposed_per_channel_cast(num_per_tokens, round_sf, generator):
    for tokens, hidden in [(0, 64), (1, 64), (33, 48), (300, 16)]:
        x = (
            torch.randn(tokens, hidden, generator=generator)
            * torch.exp2(torch.randint(-6, 6, (1, hidden), generator=generator))
        ).bfloat16()
        q_t, sf = qb.per_channel_cast_and_transpose(x, "e4m3", num_per_tokens, round_sf=round_sf)
        q, sf_expected = qb.per_channel_cast(x, "e4m3", num_per_tokens, round_sf=round_sf)
        assert q_t.dtype == torch.float8_e4m3fn and tuple(q_t.shape) == (hidden, tokens) and q_t.is_contiguous()
        assert torch.equal(sf, sf_expected) and sf.is_contiguous()
        raw = q_t.view(torch.uint8).flatten().tolist()  # byte h·T + t holds the code of x[t, h]
        codes = q.view(torch.uint8)
        for t, h in [(0, 0), (tokens - 1, hidden - 1), (tokens // 2, hidden // 3)]:
            if tokens:
                assert raw[h * tokens + t] == int(codes[t, h])
        assert torch.equal(q_t.view(torch.uint8), codes.T)


def test_per_channel_cast_and_transpose_validation():
    x = torch.randn(64, 64).bfloat16()
    with pytest.raises(TypeError, match="x must have dtype in \\(bfloat16\\)"):
        qb.per_channel_cast_and_transpose(x.float(), "e4m3", 32)
    with pytest.raises(ValueError, match="fmt must be one of"):
        qb.per_channel_cast_and_transpose(x, "e2m1", 32)
    with pytest.raises(ValueError, match="num_per_tokens"):
        qb.per_channel_cast_and_transpose(x, "e4m3", 64)
    with pytest.raises(ValueError, match="unit stride"):
        qb.per_channel_cast_and_transpose(x.T, "e4m3", 32)


# ---------------------------------------------------------------------------------------------
# per_block_cast_lossless
# ---------------------------------------------------------------------------------------------

# Every e4m3 value, independently: subnormals k·2^-9, normals (1 + m/8)·2^(e-7), max 448.
E4M3_EXACT = {Fraction(k, 2**9) for k in range(8)}
E4M3_EXACT |= {(1 + Fraction(m, 8)) * Fraction(2) ** (e - 7) for e in range(1, 16) for m in range(8)} - {Fraction(480)}
FP4_VALUES = [Fraction(v).limit_denominator() for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]


def fp4_value(code: int) -> Fraction:
    return -FP4_VALUES[code & 7] if code & 8 else FP4_VALUES[code & 7]


def pack_codes(codes: list[list[int]]) -> torch.Tensor:
    """4-bit codes ``[T, H]`` → packed e2m1 int8 ``[T, H/2]``, element 2j in the low nibble."""
    packed = [[row[j] | (row[j + 1] << 4) for j in range(0, len(row), 2)] for row in codes]
    return torch.tensor(packed, dtype=torch.int32).to(torch.uint8).view(torch.int8)


def power_of_two(exponents: list[list[int]]) -> torch.Tensor:
    """fp32 scales 2^(E - 127) from biased exponents E (1..254)."""
    return torch.tensor(exponents, dtype=torch.int32).mul(1 << 23).view(torch.float32)


def assert_same_dequantized(pair_in, in_block, pair_out, out_block):
    before = rq.cast_back(pair_in, "fp32", in_block)
    after = rq.cast_back(pair_out, "fp32", out_block)
    assert torch.equal(before.view(torch.int32), after.view(torch.int32))  # bit for bit, signs of zeros included


def test_lossless_every_fp4_code_at_every_exponent_and_spread_up_to_14():
    """Rows of one (1, 128) output block: input block 0 has the row's largest exponent, blocks 1-3
    that minus a spread of 0..14; every block holds all 16 codes twice."""
    all_codes = list(range(16)) * 2
    rows, exponents = [], []
    for largest in (1, 2, 5, 6, 7, 8, 9, 60, 127, 200, 254):
        for spread in range(15):
            if largest - spread >= 1:
                rows.append(all_codes * 4)
                exponents.append([largest] + [largest - spread] * 3)
    data, sf = pack_codes(rows), power_of_two(exponents)
    q, sf_out = qb.per_block_cast_lossless((data, sf), "e4m3", (1, 32), (1, 128))
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (len(rows), 128)
    assert tuple(sf_out.shape) == (len(rows), 1) and sf_out.dtype == torch.float32
    decoded = q.float().tolist()
    for r, (row, block_exponents) in enumerate(zip(rows, exponents, strict=True)):
        e_out = max(block_exponents[0] - 6, 1)
        assert sf_out[r, 0].item() == math.ldexp(1.0, e_out - 127)
        for h, code in enumerate(row):
            wanted = fp4_value(code) * Fraction(2) ** (block_exponents[h // 32] - e_out)
            assert wanted in E4M3_EXACT or -wanted in E4M3_EXACT
            assert Fraction(decoded[r][h]) == wanted
            assert math.copysign(1.0, decoded[r][h]) == (-1.0 if code & 8 else 1.0)  # -0 stays -0 (0x80)
    assert_same_dequantized((data, sf), (1, 32), (q, sf_out), (1, 128))


def test_lossless_beyond_spread_14_accepts_exactly_the_values_e4m3_holds():
    for spread in (15, 16, 17, 30, 200):
        for code in range(16):
            # Block 0 (largest exponent 220) holds a 6; block 1 (exponent 220 - spread) the code.
            row = [7] + [0] * 31 + [code] + [0] * 31
            pair = (pack_codes([row]), power_of_two([[220, 220 - spread]]))
            wanted = abs(fp4_value(code)) * Fraction(2) ** (6 - spread)
            if wanted in E4M3_EXACT:
                q, sf_out = qb.per_block_cast_lossless(pair, "e4m3", (1, 32), (1, 64))
                assert Fraction(q.float()[0, 32].item()) == fp4_value(code) * Fraction(2) ** (6 - spread)
                assert_same_dequantized(pair, (1, 32), (q, sf_out), (1, 64))
            else:
                with pytest.raises(ValueError, match=rf"element \[0, 32\] .* {spread} below the largest"):
                    qb.per_block_cast_lossless(pair, "e4m3", (1, 32), (1, 64))


LOSSLESS_OUT_BLOCKS = [(1, 32), (1, 128), (32, 32), (128, 128), (32, 128), (128, 32)]
LOSSLESS_LAYOUTS = {
    "row_major": {},
    "col_major": {"use_tma_aligned_col_major_sf": True},
    "packed": {"use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True},
}


@pytest.mark.parametrize("out_block", LOSSLESS_OUT_BLOCKS, ids=str)
def test_lossless_on_cast_outputs_all_layouts_and_tails(out_block, generator):
    for tokens, hidden in [(0, 64), (1, 32), (33, 96), (130, 160)]:
        x = torch.randn(tokens, hidden, generator=generator) * torch.exp2(
            torch.randint(-3, 4, (tokens, 1), generator=generator)
        )
        if tokens > 2:
            x[1] = 0.0  # all-zero input blocks: scale 2^-126, far below their neighbours, and exact
        names = list(LOSSLESS_LAYOUTS)
        for i, in_name in enumerate(names):
            pair = rq.per_token_cast(x, "e2m1", 32, round_sf=True, **LOSSLESS_LAYOUTS[in_name])
            for out_name in (names[i], names[(i + 1 + tokens) % 3]):  # every layout in and out, in turn
                out_flags = LOSSLESS_LAYOUTS[out_name]
                q, sf = qb.per_block_cast_lossless(pair, "e4m3", (1, 32), out_block, **out_flags)
                layout = ScaleLayout.from_flags(out_name != "row_major", out_name == "packed")
                rows, kblocks = ceil_div(tokens, out_block[0]), ceil_div(hidden, out_block[1])
                empty = layout.empty(rows, kblocks, "cpu")
                assert sf.dtype == empty.dtype and sf.shape == empty.shape, (in_name, out_name)
                if tokens:
                    assert sf.stride() == empty.stride()
                assert_same_dequantized(pair, (1, 32), (q, sf), out_block)
                scales = rq.scales_from_layout(sf, kblocks)
                assert torch.all((scales.view(torch.int32) & 0x807FFFFF) == 0)  # positive powers of two


def test_lossless_packed_scale_bytes():
    pair = (pack_codes([[7] * 32 + [1] * 32]), power_of_two([[140, 131]]))
    q, sf = qb.per_block_cast_lossless(pair, "e4m3", (1, 32), (1, 32), use_packed_ue8m0=True)
    # E_out = max(E_in) - 6 for each (1, 32) block on its own: 134 and 125.
    assert sf.dtype == torch.int32 and int(sf[0, 0]) & 0xFFFFFFFF == (125 << 8) | 134
    assert q.float()[0, 0].item() == 384.0 and q.float()[0, 32].item() == 32.0  # 6·2^6, 0.5·2^6


def test_lossless_validation():
    good = (pack_codes([[1] * 64]), power_of_two([[127, 127]]))
    cases = [
        (good, "e2m1", (1, 32), (1, 64), {}, ValueError, "fmt must be one of"),
        (
            (good[0].view(torch.uint8).view(torch.float8_e4m3fn), good[1]),
            "e4m3",
            (1, 32),
            (1, 64),
            {},
            TypeError,
            r"x\[0\] must have dtype in \(int8\)",
        ),
        (
            (good[0], torch.tensor([[1.0, 0.75]])),
            "e4m3",
            (1, 32),
            (1, 64),
            {},
            ValueError,
            r"powers of two .* scale \[0, 1\] is 0.75",
        ),
        ((good[0], torch.tensor([[1.0, -1.0]])), "e4m3", (1, 32), (1, 64), {}, ValueError, "powers of two"),
        ((good[0], torch.tensor([[1.0, 0.0]])), "e4m3", (1, 32), (1, 64), {}, ValueError, "powers of two"),
        ((good[0], torch.tensor([[1.0, math.nan]])), "e4m3", (1, 32), (1, 64), {}, ValueError, "powers of two"),
        ((good[0], torch.tensor([[2.0**-127, 1.0]])), "e4m3", (1, 32), (1, 64), {}, ValueError, "powers of two"),
        ((good[0], torch.tensor([[0xFF7F]], dtype=torch.int32)), "e4m3", (1, 32), (1, 64), {}, ValueError, "is nan"),
        ((good[0], good[1][:, :1]), "e4m3", (1, 64), (1, 32), {}, ValueError, "must be a multiple of x_block_size"),
        (good, "e4m3", (1, 32), (64, 64), {}, ValueError, "out_block_size must be"),
        (good, "e4m3", (1, 32), None, {}, TypeError, "out_block_size must be a"),
        (good, "e4m3", None, (1, 64), {}, TypeError, "x_block_size must be a"),
        (good, "e4m3", (1, 32), (1, 64), {"round_sf": "yes"}, TypeError, "round_sf"),
    ]
    for x, fmt, in_block, out_block, flags, error, match in cases:
        with pytest.raises(error, match=match):
            qb.per_block_cast_lossless(x, fmt, in_block, out_block, **flags)
    q, sf = qb.per_block_cast_lossless(good, "e4m3", (1, 32), (1, 64), round_sf=True)  # round_sf: no effect
    assert sf.item() == 2.0**-6 and q.float()[0, 0].item() == 32.0

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

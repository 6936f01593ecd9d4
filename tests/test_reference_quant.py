"""The reference twin of the quantization family, proven on its own (CPU only).

The reference is the executable specification the optimized kernels are compared against bit for
bit, so it is checked here against *independent* implementations written in this file: scalar
pure-Python encoders (``fractions``/``math``/``struct``, nearest grid point with ties to the even
code), IEEE fp32 arithmetic done in Python doubles and rounded with ``struct`` (double rounding is
innocuous for one division: 53 >= 2·24 + 2), and byte-level reads of the packed scale storage.

Error bounds used below (derived, not tuned; ``y = x · multiplier``, ``x̂ = decode(q) · sf``):

- e4m3 rounds to nearest with 3 mantissa bits: ``|q - y| <= 2^-4·|y|`` in the normal range and
  ``<= 2^-10`` (half the smallest subnormal step 2^-9) below it, so per element
  ``|x̂ - x| <= 2^-4·|x| + 2^-10·sf`` (in particular ``<= 2^-4·amax + 2^-10·sf`` over a block).
- e2m1's grid {0, .5, 1, 1.5, 2, 3, 4, 6} has half-spacings 0.25 on [0, 2], 0.5 on [2, 4] and 1 on
  [4, 6], each at most ``max(0.25, |y|/4)``, so ``|x̂ - x| <= max(0.25·sf, |x|/4)`` (``<= sf`` always).

Both get a slack of 2^-19 relative for the fp32 roundings of the multiplier and of ``x · m``.
"""

from __future__ import annotations

import bisect
import math
import struct
from fractions import Fraction

import pytest
import torch

from tileproof.reference import contract
from tileproof.reference import quant as rq
from tileproof.reference.contract import E2M1, E2M1_GRID, E4M3, ScaleLayout, align, ceil_div

FORMATS = {"e4m3": E4M3, "e2m1": E2M1}
FLOAT_INF = float("inf")
NAN = float("nan")

# ---------------------------------------------------------------------------------------------
# Independent helpers
# ---------------------------------------------------------------------------------------------


def f32(v: float) -> float:
    """Round a Python float (double) to the nearest fp32, ties to even (C's double → float)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def int_bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit pattern as an integer tensor of the same width (for bitwise comparisons)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width) if t.dtype != width else t


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, *, strides: bool = True) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if strides and actual.numel() > 0:
        assert actual.stride() == expected.stride(), (actual.stride(), expected.stride())
    mismatch = int_bits(actual.contiguous()) != int_bits(expected.contiguous())
    assert not mismatch.any(), f"{int(mismatch.sum())} of {actual.numel()} elements differ"


def all_bf16_values() -> torch.Tensor:
    """Every one of the 65536 bf16 bit patterns, as fp32 (NaNs included)."""
    return torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(torch.float32)


def neighbourhood(points, ulps: int = 3) -> list[float]:
    """Each point, and the ``ulps`` fp32 neighbours on either side of it."""
    out = []
    for p in points:
        for direction in (FLOAT_INF, -FLOAT_INF):
            v = torch.tensor(p, dtype=torch.float32)
            target = torch.tensor(direction)
            for _ in range(ulps):
                v = torch.nextafter(v, target)
                out.append(v.item())
        out.append(f32(p))
    return out


def fp32_samples(generator: torch.Generator, n: int, lo: int, hi: int) -> torch.Tensor:
    """Random fp32 values of both signs with magnitudes spread over 2^lo .. 2^hi."""
    exponents = torch.randint(lo, hi, (n,), generator=generator).to(torch.float32)
    mantissas = torch.rand(n, generator=generator) + 1.0
    signs = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)
    return signs * mantissas * torch.exp2(exponents)


# e2m1: 4-bit codes, sign bit 3, magnitude code = index into the grid.
GRID = [float(g) for g in E2M1_GRID]
assert GRID == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_code_scalar(v: float) -> int:
    """Nearest grid point of |v| (ties to the even code), saturating at 6, sign bit kept; every
    NaN is +6 (a NaN's sign bit depends on the device that produced it)."""
    if math.isnan(v):
        return 7
    sign = 8 if math.copysign(1.0, v) < 0 else 0
    m = abs(v)
    if m >= GRID[-1]:
        return sign | 7
    hi = bisect.bisect_right(GRID, m)  # GRID[hi - 1] <= m < GRID[hi]
    lo = hi - 1
    below, above = Fraction(m) - Fraction(GRID[lo]), Fraction(GRID[hi]) - Fraction(m)
    if below < above:
        code = lo
    elif above < below:
        code = hi
    else:
        code = lo if lo % 2 == 0 else hi
    return sign | code


def e2m1_decode_scalar(code: int) -> float:
    return math.copysign(GRID[code & 7], -1.0 if code & 8 else 1.0)


def e2m1_codes_of(values) -> list[int]:
    """Encode with the reference and unpack the nibbles (element 2j is the low nibble)."""
    values = list(values)
    if len(values) % 2:
        values.append(0.0)
    packed = rq.encode_e2m1(torch.tensor(values, dtype=torch.float32)).view(torch.uint8).tolist()
    codes = []
    for byte in packed:
        codes += [byte & 0x0F, byte >> 4]
    return codes[: len(values)]


# e4m3 (float8_e4m3fn): sign bit 7, 4 exponent bits (bias 7), 3 mantissa bits, S.1111.111 is NaN.
def e4m3_value_scalar(code: int) -> Fraction | None:
    sign, exponent, mantissa = code >> 7, (code >> 3) & 0xF, code & 0x7
    if exponent == 15 and mantissa == 7:
        return None
    if exponent == 0:
        magnitude = Fraction(mantissa, 8) * Fraction(1, 2**6)
    else:
        magnitude = (1 + Fraction(mantissa, 8)) * Fraction(2) ** (exponent - 7)
    return -magnitude if sign else magnitude


E4M3_POSITIVE = [float(e4m3_value_scalar(c)) for c in range(0x7F)]  # codes 0x00..0x7E, increasing
assert E4M3_POSITIVE[-1] == 448.0 and E4M3_POSITIVE[1] == 2.0**-9
assert all(a < b for a, b in zip(E4M3_POSITIVE, E4M3_POSITIVE[1:], strict=False))


def e4m3_code_scalar(v: float) -> int:
    """Clamp to ±448, nearest representable (ties to the even code), sign kept; NaN → 0x7F."""
    if math.isnan(v):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    m = min(abs(v), 448.0)
    hi = bisect.bisect_left(E4M3_POSITIVE, m)  # E4M3_POSITIVE[hi - 1] < m <= E4M3_POSITIVE[hi]
    if E4M3_POSITIVE[hi] == m:
        return sign | hi
    lo = hi - 1
    below, above = Fraction(m) - Fraction(E4M3_POSITIVE[lo]), Fraction(E4M3_POSITIVE[hi]) - Fraction(m)
    if below < above:
        code = lo
    elif above < below:
        code = hi
    else:
        code = lo if lo % 2 == 0 else hi
    return sign | code


def e4m3_codes_of(values) -> list[int]:
    return rq.encode_e4m3(torch.tensor(list(values), dtype=torch.float32)).view(torch.uint8).tolist()


# ---------------------------------------------------------------------------------------------
# e2m1 encoding
# ---------------------------------------------------------------------------------------------

# (threshold, code just below, code just above, code of the tie itself: the even one)
E2M1_THRESHOLDS = [
    (0.25, 0, 1, 0),
    (0.75, 1, 2, 2),
    (1.25, 2, 3, 2),
    (1.75, 3, 4, 4),
    (2.5, 4, 5, 4),
    (3.5, 5, 6, 6),
    (5.0, 6, 7, 6),
]


@pytest.mark.parametrize("threshold,below,above,tie", E2M1_THRESHOLDS)
def test_e2m1_thresholds_and_ties(threshold, below, above, tie):
    t = torch.tensor(threshold, dtype=torch.float32)
    just_below = torch.nextafter(t, torch.tensor(0.0)).item()
    just_above = torch.nextafter(t, torch.tensor(FLOAT_INF)).item()
    values = [threshold, just_below, just_above, -threshold, -just_below, -just_above]
    expected = [tie, below, above, 8 | tie, 8 | below, 8 | above]
    assert e2m1_codes_of(values) == expected
    assert [e2m1_code_scalar(v) for v in values] == expected


def test_e2m1_saturation_nan_and_signs():
    cases = [
        (6.0, 0b0111),
        (7.0, 0b0111),
        (1e30, 0b0111),
        (3.4028234663852886e38, 0b0111),  # fp32 max
        (FLOAT_INF, 0b0111),
        (-7.0, 0b1111),
        (-FLOAT_INF, 0b1111),
        (NAN, 0b0111),
        (-NAN, 0b0111),  # NaN has no sign: +6 on every device
        (0.0, 0b0000),
        (-0.0, 0b1000),
        (-0.1, 0b1000),  # a negative value rounding to zero keeps its sign
        (-0.25, 0b1000),  # tie between 0 and 0.5 → 0, sign kept
        (-1e-30, 0b1000),
        (-1e-45, 0b1000),  # fp32 subnormal
        (1e-45, 0b0000),
        (0.5, 0b0001),
        (-6.0, 0b1111),
    ]
    values, expected = zip(*cases, strict=True)
    assert e2m1_codes_of(values) == list(expected)
    assert [e2m1_code_scalar(v) for v in values] == list(expected)


def test_e2m1_matches_scalar_on_every_bf16_value_and_threshold_neighbourhoods(generator):
    midpoints = [(a + b) / 2 for a, b in zip(GRID, GRID[1:], strict=False)]
    values = torch.cat(
        [
            all_bf16_values(),
            torch.tensor(neighbourhood(GRID + midpoints + [-m for m in midpoints], ulps=4)),
            fp32_samples(generator, 20_000, -4, 4),
        ]
    )
    if values.numel() % 2:
        values = torch.cat([values, torch.zeros(1)])
    packed = rq.encode_e2m1(values).view(torch.uint8)
    actual = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten().tolist()
    expected = [e2m1_code_scalar(v) for v in values.tolist()]
    wrong = [(v, a, e) for v, a, e in zip(values.tolist(), actual, expected, strict=True) if a != e]
    assert not wrong, f"{len(wrong)} mismatches, first: {wrong[:5]}"


def test_e2m1_packing_low_nibble_first():
    # codes 1 (0.5), 7 (6), 10 (-1), 0 (0), 5 (3), 12 (-2)
    packed = rq.encode_e2m1(torch.tensor([[0.5, 6.0, -1.0, 0.0, 3.0, -2.0]]))
    assert packed.dtype == torch.int8 and packed.shape == (1, 3)
    assert packed.view(torch.uint8).tolist() == [[0x71, 0x0A, 0xC5]]
    assert packed.tolist() == [[0x71, 0x0A, 0xC5 - 256]]  # int8 storage of the same bytes


def test_e2m1_packing_random(generator):
    x = fp32_samples(generator, 4 * 64, -3, 3).reshape(4, 64)
    packed = rq.encode_e2m1(x).view(torch.uint8)
    assert packed.shape == (4, 32)
    codes = [[e2m1_code_scalar(v) for v in row] for row in x.tolist()]
    expected = [[row[2 * j] | (row[2 * j + 1] << 4) for j in range(32)] for row in codes]
    assert packed.tolist() == expected


def test_e2m1_decode_encode_grid_both_signs():
    grid = torch.tensor(GRID + [-g for g in GRID], dtype=torch.float32)
    decoded = rq.decode_e2m1(rq.encode_e2m1(grid))
    assert_bitwise(decoded, grid)  # bitwise: -0.0 stays -0.0
    assert torch.signbit(decoded[len(GRID)]).item()


def test_e2m1_every_packed_byte_round_trips():
    all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    decoded = rq.decode_e2m1(all_bytes)
    assert decoded.dtype == torch.float32 and decoded.shape == (512,)
    expected = []
    for b in range(256):
        expected += [e2m1_decode_scalar(b & 0x0F), e2m1_decode_scalar(b >> 4)]
    assert_bitwise(decoded, torch.tensor(expected, dtype=torch.float32))
    # Code 0b1000 decodes to -0.0 (sign bit set), which re-encodes to 0b1000, not to +0.
    assert math.copysign(1.0, decoded[2 * 0x08].item()) == -1.0
    assert rq.encode_e2m1(decoded[2 * 0x08 : 2 * 0x08 + 2]).view(torch.uint8).item() == 0x08
    assert_bitwise(rq.encode_e2m1(decoded), all_bytes)


# ---------------------------------------------------------------------------------------------
# e4m3 encoding
# ---------------------------------------------------------------------------------------------


def test_e4m3_code_points_decode_as_the_independent_decoder():
    all_codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    decoded = all_codes.view(torch.float8_e4m3fn).to(torch.float32).tolist()
    for code, value in enumerate(decoded):
        expected = e4m3_value_scalar(code)
        if expected is None:
            assert math.isnan(value), hex(code)
        else:
            assert Fraction(value) == expected and math.copysign(1.0, value) == (-1.0 if code & 0x80 else 1.0)


def test_e4m3_decode_encode_identity_on_every_finite_code():
    finite = [c for c in range(256) if c & 0x7F != 0x7F]
    values = torch.tensor(finite, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    assert e4m3_codes_of(values.tolist()) == finite  # 0x80 (-0.0) included


def test_e4m3_midpoints_round_to_even():
    values, expected = [], []
    for lo in range(0x7E):  # consecutive positive codes lo, lo + 1
        a, b = E4M3_POSITIVE[lo], E4M3_POSITIVE[lo + 1]
        mid = (a + b) / 2
        assert f32(mid) == mid  # exactly representable
        even = lo if lo % 2 == 0 else lo + 1
        t = torch.tensor(mid, dtype=torch.float32)
        below = torch.nextafter(t, torch.tensor(0.0)).item()
        above = torch.nextafter(t, torch.tensor(FLOAT_INF)).item()
        for sign in (0, 0x80):
            s = -1.0 if sign else 1.0
            values += [s * mid, s * below, s * above]
            expected += [sign | even, sign | lo, sign | (lo + 1)]
    assert e4m3_codes_of(values) == expected
    assert [e4m3_code_scalar(v) for v in values] == expected


def test_e4m3_clamp_nan_and_tiny():
    cases = [
        (448.0, 0x7E),
        (449.0, 0x7E),
        (464.0, 0x7E),  # the midpoint to the (nonexistent) 480: clamped first, never NaN
        (480.0, 0x7E),
        (500.0, 0x7E),
        (1e30, 0x7E),
        (3.4028234663852886e38, 0x7E),
        (FLOAT_INF, 0x7E),
        (-500.0, 0xFE),
        (-FLOAT_INF, 0xFE),
        (NAN, 0x7F),
        (-NAN, 0x7F),  # every NaN becomes the canonical 0x7F
        (0.0, 0x00),
        (-0.0, 0x80),
        (2.0**-9, 0x01),  # smallest subnormal
        (2.0**-10, 0x00),  # tie between 0 and 2^-9 → even code 0
        (-(2.0**-10), 0x80),
        (3 * 2.0**-10, 0x02),  # tie between codes 1 and 2 → 2
        (1e-30, 0x00),
        (-1e-30, 0x80),
    ]
    values, expected = zip(*cases, strict=True)
    assert e4m3_codes_of(values) == list(expected)
    assert [e4m3_code_scalar(v) for v in values] == list(expected)


def test_e4m3_matches_scalar_on_every_bf16_value_and_random_fp32(generator):
    values = torch.cat(
        [
            all_bf16_values(),
            fp32_samples(generator, 20_000, -12, 10),
            torch.tensor(neighbourhood([448.0, 464.0, 2.0**-6, 2.0**-9, 2.0**-10], ulps=3)),
        ]
    )
    actual = rq.encode_e4m3(values).view(torch.uint8).tolist()
    expected = [e4m3_code_scalar(v) for v in values.tolist()]
    wrong = [(v, a, e) for v, a, e in zip(values.tolist(), actual, expected, strict=True) if a != e]
    assert not wrong, f"{len(wrong)} mismatches, first: {wrong[:5]}"


# ---------------------------------------------------------------------------------------------
# Scales
# ---------------------------------------------------------------------------------------------


def amax_samples(generator: torch.Generator, spec) -> torch.Tensor:
    edges = [0.0, spec.amax_floor, spec.amax_floor / 2, spec.qmax, 1.0, 3.4028234663852886e38, 1e-38]
    edges += neighbourhood([spec.amax_floor], ulps=2)
    return torch.cat([torch.tensor(edges, dtype=torch.float32), fp32_samples(generator, 4000, -40, 40).abs()])


@pytest.mark.parametrize("fmt", FORMATS)
def test_scales_without_rounding_are_true_fp32_divisions(fmt, generator):
    spec = FORMATS[fmt]
    amax = amax_samples(generator, spec)
    sf, multiplier = rq.scales_from_amax(amax, spec, round_sf=False)
    assert sf.dtype == multiplier.dtype == torch.float32
    floor = f32(spec.amax_floor)
    clamped = [max(a, floor) for a in amax.tolist()]
    assert [f32_bits(s) for s in sf.tolist()] == [f32_bits(a / spec.qmax) for a in clamped]
    assert [f32_bits(m) for m in multiplier.tolist()] == [f32_bits(spec.qmax / a) for a in clamped]
    # The multiplier is qmax / amax, not 1 / sf: the two differ in the last bit for some amax.
    one_over_sf = [f32(1.0 / s) for s in sf.tolist()]
    assert any(a != b for a, b in zip(one_over_sf, multiplier.tolist(), strict=True))


def test_scale_floors():
    e4m3_sf, e4m3_mult = rq.scales_from_amax(torch.tensor([0.0, 1e-6, 1e-4]), E4M3, round_sf=False)
    assert e4m3_sf.tolist() == [f32(f32(1e-4) / 448.0)] * 3
    assert e4m3_mult.tolist() == [f32(448.0 / f32(1e-4))] * 3
    e2m1_sf, e2m1_mult = rq.scales_from_amax(torch.tensor([0.0, 1e-40, 6 * 2.0**-126]), E2M1, round_sf=False)
    assert e2m1_sf.tolist() == [2.0**-126] * 3  # the smallest normal fp32, exactly
    assert e2m1_mult.tolist() == [2.0**126] * 3
    rounded, _ = rq.scales_from_amax(torch.tensor([0.0]), E4M3, round_sf=True)
    assert rounded.item() == 2.0**-22  # 1e-4 / 448 ≈ 2.2e-7 rounds up to 2^-22
    rounded, _ = rq.scales_from_amax(torch.tensor([0.0]), E2M1, round_sf=True)
    assert rounded.item() == 2.0**-126


@pytest.mark.parametrize("fmt", FORMATS)
def test_rounded_scales_are_powers_of_two_just_above_amax_over_qmax(fmt, generator):
    spec = FORMATS[fmt]
    amax = amax_samples(generator, spec)
    sf, multiplier = rq.scales_from_amax(amax, spec, round_sf=True)
    floor = f32(spec.amax_floor)
    for a, s, m in zip(amax.tolist(), sf.tolist(), multiplier.tolist(), strict=True):
        a = max(a, floor)
        mantissa, exponent = math.frexp(s)
        assert mantissa == 0.5, f"sf {s} of amax {a} is not a power of two"
        exact = Fraction(a) / Fraction(spec.qmax)
        assert exact <= Fraction(s) < 2 * exact, (a, s)
        # Independently: 2^ceil(log2(v)) of the fp32 quotient v.
        q_mantissa, q_exponent = math.frexp(f32(a / spec.qmax))
        assert s == (2.0 ** (q_exponent - 1) if q_mantissa == 0.5 else 2.0**q_exponent)
        assert Fraction(m) * Fraction(s) == 1  # the multiplier is the exact inverse


@pytest.mark.parametrize("fmt", FORMATS)
def test_rounding_keeps_exact_powers_of_two(fmt):
    spec = FORMATS[fmt]
    low = -126 if fmt == "e2m1" else -22
    powers = [2.0**k for k in range(low, 100)]
    amax = torch.tensor([p * spec.qmax for p in powers], dtype=torch.float32)
    sf, multiplier = rq.scales_from_amax(amax, spec, round_sf=True)
    assert sf.tolist() == powers
    assert multiplier.tolist() == [1.0 / p for p in powers]
    # the round of a scale that already is a power of two is itself
    again, _ = rq.scales_from_amax(sf * spec.qmax, spec, round_sf=True)
    assert_bitwise(again, sf)


@pytest.mark.parametrize("round_sf", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_amax_gives_nan_scale(fmt, round_sf):
    sf, multiplier = rq.scales_from_amax(torch.tensor([NAN, 1.0]), FORMATS[fmt], round_sf=round_sf)
    assert math.isnan(sf[0].item()) and math.isnan(multiplier[0].item())
    assert not math.isnan(sf[1].item())


# ---------------------------------------------------------------------------------------------
# Scale layouts
# ---------------------------------------------------------------------------------------------


def power_of_two_scales(rows: int, kblocks: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Known power-of-two scales 2^e, with e spanning the whole normal range (-126 .. 127)."""
    exponents = [[(r * 37 + k * 11) % 254 - 126 for k in range(kblocks)] for r in range(rows)]
    sf = torch.tensor([[math.ldexp(1.0, e) for e in row] for row in exponents], dtype=torch.float32)
    return sf.reshape(rows, kblocks), exponents


@pytest.mark.parametrize("rows,kblocks", [(5, 6), (4, 4), (1, 1), (3, 9), (8, 7), (2, 12)])
def test_packed_ue8m0_byte_layout(rows, kblocks):
    sf, exponents = power_of_two_scales(rows, kblocks)
    packed = rq.scales_to_layout(sf, ScaleLayout("packed_ue8m0"))
    words = ceil_div(kblocks, 4)
    ld = align(rows, 4)
    assert packed.dtype == torch.int32
    assert packed.shape == (rows, words)
    assert packed.stride() == (1, ld)
    storage = packed.untyped_storage().tolist()  # raw bytes
    for r in range(rows):
        for w in range(words):
            expected_word = 0
            for b in range(4):
                k = 4 * w + b
                expected_byte = exponents[r][k] + 127 if k < kblocks else 0  # unused bytes are zero
                expected_word |= expected_byte << (8 * b)
                # byte k % 4 (little-endian) of word k // 4, word (r, w) at element offset r + w * ld
                address = (packed.storage_offset() + r + w * ld) * 4 + b
                assert storage[address] == expected_byte, (r, k)
            assert packed[r, w].item() & 0xFFFFFFFF == expected_word
    assert_bitwise(rq.scales_from_layout(packed, kblocks), sf)


def test_packed_ue8m0_example_word():
    # Scales 1, 2, 0.5, 2^-3 of one row: exponent bytes 127, 128, 126, 124 → word 0x7C7E807F.
    sf = torch.tensor([[1.0, 2.0, 0.5, 0.125, 4.0]])
    packed = rq.scales_to_layout(sf, ScaleLayout("packed_ue8m0"))
    assert [w & 0xFFFFFFFF for w in packed[0].tolist()] == [0x7C7E807F, 0x00000081]


def test_packed_ue8m0_nan_scale_is_byte_ff():
    sf = torch.tensor([[NAN, 1.0]])
    packed = rq.scales_to_layout(sf, ScaleLayout("packed_ue8m0"))
    assert packed.item() & 0xFFFFFFFF == 0x7FFF


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13])
def test_col_major_layout(rows, generator):
    sf = torch.rand(rows, 3, generator=generator)
    col = rq.scales_to_layout(sf, ScaleLayout("col_major"))
    row = rq.scales_to_layout(sf, ScaleLayout("row_major"))
    assert col.dtype == row.dtype == torch.float32
    assert col.shape == row.shape == (rows, 3)
    assert col.stride() == (1, align(rows, 4))
    assert row.stride() == (3, 1)
    assert_bitwise(col, row, strides=False)
    assert_bitwise(rq.scales_from_layout(col, 3), sf)
    assert_bitwise(rq.scales_from_layout(row, 3), sf)


# ---------------------------------------------------------------------------------------------
# per_token_cast and friends: properties on random inputs
# ---------------------------------------------------------------------------------------------

SHAPES = {
    "quick": [(0, 64), (1, 128), (7, 100), (33, 256)],
    "full": [(0, 64), (1, 128), (2, 32), (7, 100), (33, 256), (129, 1000), (256, 7168)],
}
FLAG_SETS = {
    "row_major": {},
    "round_sf": {"round_sf": True},
    "col_major": {"use_tma_aligned_col_major_sf": True},
    "col_major_round_sf": {"use_tma_aligned_col_major_sf": True, "round_sf": True},
    "packed_ue8m0": {"use_packed_ue8m0": True},
    "packed_ue8m0_col_major_round_sf": {
        "use_packed_ue8m0": True,
        "use_tma_aligned_col_major_sf": True,
        "round_sf": True,
    },
}


def make_input(generator, tokens, hidden, c, fmt, dtype) -> torch.Tensor:
    """Rows of very different magnitudes, plus an all-zero block (row 0, block 0) and a block whose
    values all lie below the amax floor (row 1, last block)."""
    spec = FORMATS[fmt]
    row_scale = torch.exp2(torch.randint(-20, 21, (tokens, 1), generator=generator).to(torch.float32))
    x = torch.randn(tokens, hidden, generator=generator) * row_scale
    if tokens >= 2:
        x[0, :c] = 0.0
        last = (ceil_div(hidden, c) - 1) * c
        x[1, last:] = torch.randn(hidden - last, generator=generator) * spec.amax_floor / 8
    return x.to(dtype)


def strided_copy(x: torch.Tensor) -> torch.Tensor:
    """The same values in a wider buffer: row stride hidden + 40, storage offset 3."""
    wide = torch.full((x.shape[0], x.shape[1] + 40), 1e30, dtype=x.dtype)
    view = wide[:, 3 : 3 + x.shape[1]]
    view.copy_(x)
    return view


def block_amax(x32: torch.Tensor, c: int) -> torch.Tensor:
    tokens, hidden = x32.shape
    kblocks = ceil_div(hidden, c)
    padded = torch.zeros(tokens, kblocks * c)
    padded[:, :hidden] = x32.abs()
    return padded.reshape(tokens, kblocks, c).amax(dim=-1) if tokens else torch.zeros(0, kblocks)


def expected_scales_and_multipliers(amax: torch.Tensor, spec, rounded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale rule, block by block, in Python fp32 arithmetic (independent of the reference)."""
    floor = f32(spec.amax_floor)
    scales, multipliers = [], []
    for a in amax.flatten().tolist():
        a = max(a, floor)
        if rounded:
            mantissa, exponent = math.frexp(f32(a / spec.qmax))
            sf = 2.0 ** (exponent - 1) if mantissa == 0.5 else 2.0**exponent
            scales.append(sf)
            multipliers.append(1.0 / sf)
        else:
            scales.append(f32(a / spec.qmax))
            multipliers.append(f32(spec.qmax / a))
    shape = amax.shape
    return torch.tensor(scales).reshape(shape), torch.tensor(multipliers).reshape(shape)


def per_element(scales: torch.Tensor, c: int, hidden: int) -> torch.Tensor:
    return scales.repeat_interleave(c, dim=1)[:, :hidden]


def decoded_values(q: torch.Tensor, fmt: str) -> torch.Tensor:
    return q.to(torch.float32) if fmt == "e4m3" else rq.decode_e2m1(q)


def magnitude_and_sign_codes(q: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "e4m3":
        b = q.view(torch.uint8).to(torch.int32)
        return b & 0x7F, b >> 7
    b = q.view(torch.uint8).to(torch.int32)
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)
    return codes & 0x7, codes >> 3


@pytest.mark.parametrize("c", [16, 32, 64, 128, "H"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_per_token_cast_properties(fmt, dtype, c, tier, generator):
    spec = FORMATS[fmt]
    for tokens, hidden in SHAPES[tier]:
        C = hidden if c == "H" else c
        kblocks = ceil_div(hidden, C)
        x = make_input(generator, tokens, hidden, C, fmt, dtype)
        x32 = x.to(torch.float32)
        amax = block_amax(x32, C)
        for name, flags in FLAG_SETS.items():
            where = f"{fmt} {dtype} C={C} T={tokens} H={hidden} {name}"
            rounded = bool(flags.get("round_sf") or flags.get("use_packed_ue8m0"))
            packed = bool(flags.get("use_packed_ue8m0"))
            col_major = bool(flags.get("use_tma_aligned_col_major_sf") or packed)
            q, sf = rq.per_token_cast(x, fmt, C, **flags)

            # shapes, dtypes, strides
            assert q.dtype == spec.storage_dtype, where
            assert q.shape == (tokens, hidden // spec.values_per_byte), where
            assert q.is_contiguous(), where
            columns = ceil_div(kblocks, 4) if packed else kblocks
            assert sf.dtype == (torch.int32 if packed else torch.float32), where
            assert sf.shape == (tokens, columns), where
            if tokens:
                expected_strides = (1, align(tokens, 4)) if col_major else (columns, 1)
                assert sf.stride() == expected_strides, where

            # the scales are the rule applied to the block maxima, and q = encode(x · multiplier)
            # with the encoders proven above
            scales = rq.scales_from_layout(sf, kblocks)
            expected_sf, expected_multiplier = expected_scales_and_multipliers(amax, spec, rounded)
            assert_bitwise(scales, expected_sf, strides=False)
            y = x32 * per_element(expected_multiplier, C, hidden)
            assert_bitwise(q, rq.encode_e4m3(y) if fmt == "e4m3" else rq.encode_e2m1(y))

            # every block reaches the top of the format, unless its amax was clamped to the floor
            decoded = decoded_values(q, fmt)
            dec_amax = block_amax(decoded, C)
            reached = amax >= spec.amax_floor
            if rounded:
                assert (dec_amax[reached] >= spec.qmax / 2).all(), where
                assert (dec_amax <= spec.qmax).all(), where
            else:
                assert (dec_amax[reached] == spec.qmax).all(), where
            floor_sf, _ = rq.scales_from_amax(torch.zeros(1), spec, rounded)
            assert (scales[~reached] == floor_sf).all(), where
            if tokens >= 2:
                assert dec_amax[0, 0].item() == amax[0, 0].item() == 0, where
                assert amax[1, -1].item() < spec.amax_floor and scales[1, -1] == floor_sf, where

            # dequantization error (bounds derived in the module docstring)
            sf_el = per_element(scales, C, hidden).to(torch.float64)
            x64 = x32.to(torch.float64)
            err = (decoded.to(torch.float64) * sf_el - x64).abs()
            slack = 2.0**-19 * (x64.abs() + sf_el)
            if fmt == "e4m3":
                bound = 2.0**-4 * x64.abs() + 2.0**-10 * sf_el
            else:
                bound = torch.maximum(0.25 * sf_el, x64.abs() / 4)
                assert (err <= sf_el * (1 + 2.0**-19)).all(), where
            assert (err <= bound + slack).all(), f"{where}: max excess {(err - bound - slack).max().item()}"

            # a row stride larger than the row gives the same result
            q_strided, sf_strided = rq.per_token_cast(strided_copy(x), fmt, C, **flags)
            assert_bitwise(q_strided, q)
            assert_bitwise(sf_strided, sf)

            # the sf-only variant returns exactly the scales
            assert_bitwise(rq.per_token_cast_with_sf_only(x, fmt, C, **flags), sf)
            assert_bitwise(rq.per_token_cast_with_sf_only(strided_copy(x), fmt, C, **flags), sf)

            # quantizing with the precomputed scales: bit for bit when they are powers of two
            q_pre = rq.per_token_cast_with_precomputed_sf(x, fmt, C, sf, **flags)
            if rounded:
                assert_bitwise(q_pre, q)
            else:  # multiplier 1/sf instead of qmax/amax: at most one code step apart
                assert q_pre.dtype == q.dtype and q_pre.shape == q.shape, where
                mag, sign = magnitude_and_sign_codes(q, fmt)
                mag_pre, sign_pre = magnitude_and_sign_codes(q_pre, fmt)
                assert (sign == sign_pre).all(), where
                assert ((mag - mag_pre).abs() <= 1).all(), where

            # cast back: decode(q) · sf in fp32 (exact in float64, then rounded once), then bf16
            expected_fp32 = (decoded.to(torch.float64) * sf_el).to(torch.float32)
            back = rq.cast_back((q, sf), "fp32", (1, C))
            assert_bitwise(back, expected_fp32)
            assert_bitwise(rq.cast_back((q, sf), "bf16", (1, C)), expected_fp32.to(torch.bfloat16))
            assert_bitwise(rq.per_token_cast_back((q, sf), "fp32", C), back)
            if rounded:  # re-quantizing the dequantized values gives them back exactly
                q2, sf2 = rq.per_token_cast(back, fmt, C, **flags)
                assert_bitwise(rq.cast_back((q2, sf2), "fp32", (1, C)), back)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_back_accepts_col_major_scales_of_a_single_row(fmt):
    """per_token_cast's own col-major output for T = 1 (strides (1, 4)) is accepted by cast_back.

    (Regression: the layout used to be inferred as col-major only for rows > 1, so a single row of
    col-major scales was taken for row-major and refused for its non-unit column stride.)
    """
    x = torch.arange(1, 65, dtype=torch.float32).reshape(1, 64)
    q, sf = rq.per_token_cast(x, fmt, 16, use_tma_aligned_col_major_sf=True)
    q_row, sf_row = rq.per_token_cast(x, fmt, 16)
    assert sf.stride() == (1, 4)
    expected = rq.cast_back((q_row, sf_row), "fp32", (1, 16))
    assert_bitwise(rq.cast_back((q, sf), "fp32", (1, 16)), expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_block(fmt):
    x = torch.randn(2, 64)
    x[1, 20] = NAN  # block 1 of row 1
    clean = x.clone()
    clean[1, 16:32] = 0.0
    q, sf = rq.per_token_cast(x, fmt, 16)
    q_clean, sf_clean = rq.per_token_cast(clean, fmt, 16)
    assert math.isnan(sf[1, 1].item())
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 1] = False
    assert_bitwise(sf[mask], sf_clean[mask])
    mag, _ = magnitude_and_sign_codes(q, fmt)
    mag_clean, _ = magnitude_and_sign_codes(q_clean, fmt)
    nan_code = 0x7F if fmt == "e4m3" else 0x7
    assert (mag[1, 16:32] == nan_code).all()  # e4m3: NaN; e2m1: saturated to 6
    assert torch.equal(
        torch.cat([mag[0], mag[1, :16], mag[1, 32:]]), torch.cat([mag_clean[0], mag_clean[1, :16], mag_clean[1, 32:]])
    )
    if fmt == "e4m3":
        assert (q[1, 16:32].view(torch.uint8) == 0x7F).all()
    packed = rq.per_token_cast_with_sf_only(x, fmt, 16, use_packed_ue8m0=True)
    assert (packed[1, 0].item() >> 8) & 0xFF == 0xFF


@pytest.mark.parametrize("fmt", FORMATS)
def test_negative_values_rounding_to_zero_keep_their_sign(fmt):
    x = torch.zeros(1, 16)
    x[0, 0] = 448.0 if fmt == "e4m3" else 6.0  # multiplier 1
    x[0, 1] = -0.1 if fmt == "e2m1" else -1e-4
    x[0, 2] = -0.0
    q, sf = rq.per_token_cast(x, fmt, 16)
    assert sf.item() == 1.0
    if fmt == "e4m3":
        assert q.view(torch.uint8)[0, :3].tolist() == [0x7E, 0x80, 0x80]
    else:
        assert q.view(torch.uint8)[0, :2].tolist() == [0x87, 0x08]


def test_per_token_cast_small_example():
    x = torch.tensor([[1.0, -2.0, 3.0, 448.0], [0.0, 0.0, 0.0, 0.0]])
    q, sf = rq.per_token_cast(x, "e4m3", 4)
    assert sf.tolist() == [[1.0], [f32(f32(1e-4) / 448.0)]]
    assert q.to(torch.float32).tolist() == [[1.0, -2.0, 3.0, 448.0], [0.0] * 4]
    q, sf = rq.per_token_cast(x, "e2m1", 4)
    assert sf.tolist() == [[f32(448.0 / 6.0)], [f32(f32(6 * 2.0**-126) / 6.0)]]
    # y = x · 6/448: 0.0134 → 0, -0.0268 → -0 (0b1000), 0.040 → 0, 6 → 6 (0b0111)
    assert q.view(torch.uint8).tolist() == [[0x80, 0x70], [0x00, 0x00]]


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

VALID_X = torch.zeros(4, 64)


def _valid_sf(**flags):
    keep = {k: v for k, v in flags.items() if k in ("use_tma_aligned_col_major_sf", "use_packed_ue8m0")}
    keep = {k: v for k, v in keep.items() if isinstance(v, bool)}
    return rq.per_token_cast_with_sf_only(VALID_X, "e4m3", 32, **keep)


ENTRY_POINTS = {
    "per_token_cast": lambda x, fmt, c, **kw: rq.per_token_cast(x, fmt, c, **kw),
    "with_sf_only": lambda x, fmt, c, **kw: rq.per_token_cast_with_sf_only(x, fmt, c, **kw),
    "with_precomputed_sf": lambda x, fmt, c, **kw: rq.per_token_cast_with_precomputed_sf(
        x, fmt, c, _valid_sf(**kw), **kw
    ),
}

INPUT_ERRORS = {
    "fmt_e5m6": (VALID_X, "e5m6", 32, {}, ValueError, "fmt"),
    "fmt_upper": (VALID_X, "E4M3", 32, {}, ValueError, "fmt"),
    "fmt_none": (VALID_X, None, 32, {}, ValueError, "fmt"),
    "c_48": (VALID_X, "e4m3", 48, {}, ValueError, "num_per_channels"),
    "c_0": (VALID_X, "e4m3", 0, {}, ValueError, "num_per_channels"),
    "c_256": (VALID_X, "e4m3", 256, {}, ValueError, "num_per_channels"),
    "c_bool": (VALID_X, "e4m3", True, {}, TypeError, "num_per_channels"),
    "c_float": (VALID_X, "e4m3", 32.0, {}, TypeError, "num_per_channels"),
    "e2m1_odd_hidden": (torch.zeros(4, 33), "e2m1", 33, {}, ValueError, "hidden"),
    "e2m1_odd_hidden_c16": (torch.zeros(4, 33), "e2m1", 16, {}, ValueError, "hidden"),
    "x_1d": (torch.zeros(64), "e4m3", 32, {}, ValueError, "x must be 2-D"),
    "x_3d": (torch.zeros(2, 4, 64), "e4m3", 32, {}, ValueError, "x must be 2-D"),
    "x_0d": (torch.tensor(1.0), "e4m3", 32, {}, ValueError, "x must be 2-D"),
    "x_float16": (torch.zeros(4, 64, dtype=torch.float16), "e4m3", 32, {}, TypeError, "x must have dtype"),
    "x_float64": (torch.zeros(4, 64, dtype=torch.float64), "e4m3", 32, {}, TypeError, "x must have dtype"),
    "x_int32": (torch.zeros(4, 64, dtype=torch.int32), "e4m3", 32, {}, TypeError, "x must have dtype"),
    "x_fp8": (torch.zeros(4, 64).to(torch.float8_e4m3fn), "e4m3", 32, {}, TypeError, "x must have dtype"),
    "x_list": ([[0.0] * 64] * 4, "e4m3", 32, {}, TypeError, "x must be a torch.Tensor"),
    "x_transposed": (torch.zeros(64, 4).T, "e4m3", 32, {}, ValueError, "x must have unit stride"),
    "x_block_size": (VALID_X, "e4m3", 32, {"x_block_size": (1, 32)}, ValueError, "x_block_size"),
    "round_sf_int": (VALID_X, "e4m3", 32, {"round_sf": 1}, TypeError, "round_sf"),
    "round_sf_none": (VALID_X, "e4m3", 32, {"round_sf": None}, TypeError, "round_sf"),
    "packed_str": (VALID_X, "e4m3", 32, {"use_packed_ue8m0": "yes"}, TypeError, "use_packed_ue8m0"),
}


@pytest.mark.parametrize("case", INPUT_ERRORS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_input_validation(entry, case):
    x, fmt, c, kwargs, error, match = INPUT_ERRORS[case]
    with pytest.raises(error, match=match):
        ENTRY_POINTS[entry](x, fmt, c, **kwargs)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_col_major_flag_must_be_a_bool(entry):
    """Like round_sf and use_packed_ue8m0, use_tma_aligned_col_major_sf must be a bool.

    The reference checks the other two flags (check_scale_flags) but not this one, so a truthy
    non-bool ("no", 1) silently selects the col-major layout and a None the row-major one.
    """
    for value in (1, "no", None):
        with pytest.raises(TypeError, match="use_tma_aligned_col_major_sf"):
            ENTRY_POINTS[entry](VALID_X, "e4m3", 32, use_tma_aligned_col_major_sf=value)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_zero_hidden_with_zero_block_is_rejected(entry):
    """num_per_channels == hidden == 0 must be refused with a ValueError, not a ZeroDivisionError."""
    with pytest.raises(ValueError, match="num_per_channels"):
        ENTRY_POINTS[entry](torch.zeros(4, 0), "e4m3", 0)


def test_empty_hidden_with_a_listed_block_size():
    q, sf = rq.per_token_cast(torch.zeros(4, 0), "e4m3", 16)
    assert q.shape == (4, 0) and sf.shape == (4, 0)


def _precomputed(sf, **flags):
    return rq.per_token_cast_with_precomputed_sf(VALID_X, "e4m3", 32, sf, **flags)


def test_precomputed_sf_validation():
    good = _valid_sf()
    assert good.shape == (4, 2)
    col = _valid_sf(use_tma_aligned_col_major_sf=True)
    packed = _valid_sf(use_packed_ue8m0=True)
    cases = [
        ("shape", torch.zeros(4, 3), {}, ValueError, "sf must have shape"),
        ("shape_rows", torch.zeros(5, 2), {}, ValueError, "sf must have shape"),
        ("1d", torch.zeros(8), {}, ValueError, "sf must be 2-D"),
        ("float64", good.double(), {}, TypeError, "sf must have dtype"),
        ("bf16", good.bfloat16(), {}, TypeError, "sf must have dtype"),
        ("int32_for_fp32_layout", packed, {}, TypeError, "sf must have dtype"),
        ("not_a_tensor", [[1.0, 1.0]] * 4, {}, TypeError, "sf must be a torch.Tensor"),
        ("col_major_given_row_major", col, {}, ValueError, "sf must be row-major"),
        ("row_major_given_col_major", good, {"use_tma_aligned_col_major_sf": True}, ValueError, "column-major"),
        ("fp32_given_packed", good, {"use_packed_ue8m0": True}, TypeError, "sf must have dtype"),
        ("meta_device", torch.empty(4, 2, device="meta"), {}, ValueError, "sf must be on cpu"),
    ]
    for name, sf, flags, error, match in cases:
        with pytest.raises(error, match=match):
            _precomputed(sf, **flags)
        assert name  # (for the traceback)
    # packed scales with two words per row, stored row-major, are refused as well
    x = torch.zeros(4, 256)
    sf_rows = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="column-major"):
        rq.per_token_cast_with_precomputed_sf(x, "e4m3", 32, sf_rows, use_packed_ue8m0=True)
    # the valid ones are accepted
    _precomputed(good)
    _precomputed(col, use_tma_aligned_col_major_sf=True)
    _precomputed(packed, use_packed_ue8m0=True)


def test_cast_back_validation():
    q, sf = rq.per_token_cast(VALID_X, "e4m3", 32)
    q4, sf4 = rq.per_token_cast(torch.zeros(4, 64), "e2m1", 32)
    cases = [
        ((q, sf), "fp16", (1, 32), None, ValueError, "fmt"),
        ((q, sf), "e4m3", (1, 32), None, ValueError, "fmt"),
        ((q, sf), "bfloat16", (1, 32), None, ValueError, "fmt"),
        ((q, sf), "fp32", (128, 128), None, ValueError, r"x\[1\] must have shape \(1, 1\)"),
        ((q, sf), "fp32", (2, 32), None, ValueError, "x_block_size"),
        ((q, sf), "fp32", (64, 64), None, ValueError, "x_block_size"),
        ((q, sf), "fp32", (1, 1), None, ValueError, "x_block_size"),
        ((q, sf), "fp32", (32, 1), None, ValueError, r"x\[1\] must have shape \(1, 64\)"),
        ((q, sf), "fp32", (True, 32), None, TypeError, "x_block_size"),
        ((q, sf), "fp32", (1,), None, TypeError, "x_block_size"),
        ((q, sf), "fp32", "1x32", None, TypeError, "x_block_size"),
        ((q, sf), "fp32", (1, 32.0), None, TypeError, "x_block_size"),
        ((q, sf), "fp32", None, None, TypeError, "x_block_size"),
        ((q, sf), "fp32", (1, 48), None, ValueError, "num_per_channels"),
        ((q, sf), "fp32", (1, 16), None, ValueError, r"x\[1\] must have shape"),
        ((q, sf), "fp32", (1, 32), "e5m6", TypeError, r"x\[0\] must have dtype in \(uint8\)"),
        ((q, sf), "fp32", (1, 32), "e4m3", ValueError, "x_special_fmt must be None or 'e5m6'"),
        ((q.view(torch.uint8), sf), "fp32", (1, 32), None, TypeError, r"x\[0\] must have dtype"),
        ((q.view(torch.uint8)[:, :62], sf), "fp32", (1, 32), "e5m6", ValueError, "multiple of 12"),
        (q, "fp32", (1, 32), None, TypeError, r"x must be a \(data, sf\) pair"),
        ((q, sf, sf), "fp32", (1, 32), None, TypeError, r"x must be a \(data, sf\) pair"),
        ((q.to(torch.float32), sf), "fp32", (1, 32), None, TypeError, r"x\[0\]"),
        ((q.to(torch.bfloat16), sf), "fp32", (1, 32), None, TypeError, r"x\[0\]"),
        ((q, sf.half()), "fp32", (1, 32), None, TypeError, r"x\[1\]"),
        ((q, sf[0]), "fp32", (1, 32), None, ValueError, r"x\[1\] must be 2-D"),
        ((q[:, :1], sf), "fp32", (1, 32), None, ValueError, r"x\[1\] must have shape"),
        ((torch.zeros(64, 4).to(torch.float8_e4m3fn).T, sf), "fp32", (1, 32), None, ValueError, r"x\[0\]"),
        ((q4, sf4), "fp32", (1, 30), None, ValueError, "num_per_channels"),
    ]
    for x, fmt, block, special, error, match in cases:
        with pytest.raises(error, match=match):
            rq.cast_back(x, fmt, block, x_special_fmt=special)
    with pytest.raises(ValueError, match="fmt"):
        rq.per_token_cast_back((q, sf), "fp16", 32)
    with pytest.raises(ValueError, match="num_per_channels"):
        rq.per_token_cast_back((q, sf), "fp32", 48)
    with pytest.raises(TypeError, match=r"x\[0\]"):
        rq.per_token_cast_back((q, sf), "fp32", 32, x_special_fmt="e5m6")
    with pytest.raises(ValueError, match="x_special_fmt"):
        rq.per_token_cast_back((q, sf), "fp32", 32, x_special_fmt="e2m1")


# ---------------------------------------------------------------------------------------------
# Quantized inputs: cast back of every block shape and scale layout, re-quantization
# ---------------------------------------------------------------------------------------------

# Every block a cast of the contract makes: per token (1, C) and (1, H), per block, per channel.
QUANTIZED_BLOCKS = [(1, 16), (1, 32), (1, 64), (1, 128), (1, "H"), (32, 32), (32, 128), (128, 32), (128, 128)]
QUANTIZED_BLOCKS += [(32, 1), (128, 1)]
LAYOUTS = ("row_major", "col_major", "packed_ue8m0")


def e5m6_value_scalar(code: int) -> float:
    """12-bit e5m6 code → value (1 sign, 5 exponent bits with bias 15, 6 mantissa bits)."""
    sign, exponent, mantissa = code >> 11, (code >> 6) & 0x1F, code & 0x3F
    if exponent == 31:
        magnitude = math.inf if mantissa == 0 else math.nan
    elif exponent == 0:
        magnitude = mantissa * 2.0**-20
    else:
        magnitude = (1 + mantissa / 64) * 2.0 ** (exponent - 15)
    return -magnitude if sign else magnitude


def e4m3_float_scalar(code: int) -> float:
    value = e4m3_value_scalar(code)  # a Fraction: its zero has no sign, so take the sign bit
    return math.nan if value is None else math.copysign(abs(float(value)), -1.0 if code & 0x80 else 1.0)


def element_values(q: torch.Tensor, fmt: str) -> list[list[float]]:
    """The stored elements as Python floats, decoded byte by byte without the reference."""
    rows = q.view(torch.uint8).tolist()
    if fmt == "e4m3":
        return [[e4m3_float_scalar(b) for b in row] for row in rows]
    if fmt == "e2m1":
        return [[e2m1_decode_scalar(c) for b in row for c in (b & 0xF, b >> 4)] for row in rows]
    out = []
    for row in rows:
        codes = []
        for g in range(0, len(row), 12):
            words = [int.from_bytes(bytes(row[g + 4 * w : g + 4 * w + 4]), "little") for w in range(3)]
            bits = (words[0] << 64) | (words[1] << 32) | words[2]  # 96 bits, h0 on top
            codes += [(bits >> (12 * (7 - i))) & 0xFFF for i in range(8)]
        out.append([e5m6_value_scalar(c) for c in codes])
    return out


def stored_scales(sf: torch.Tensor, kblocks: int) -> list[list[float]]:
    """The scales as Python floats, read element by element (packed: the exponent bytes of each word)."""
    if sf.dtype == torch.float32:
        return [[float(sf[r, k]) for k in range(kblocks)] for r in range(sf.shape[0])]
    out = []
    for r in range(sf.shape[0]):
        exponent_bytes = [(int(sf[r, k // 4]) >> (8 * (k % 4))) & 0xFF for k in range(kblocks)]
        out.append([math.nan if b == 0xFF else (0.0 if b == 0 else 2.0 ** (b - 127)) for b in exponent_bytes])
    return out


def loop_dequantize(q, sf, fmt: str, bm: int, bk: int) -> torch.Tensor:
    """``decode(q[t, h]) · sf[t // bm, h // bk]`` rounded to fp32, one element at a time."""
    values = element_values(q, fmt)
    hidden = len(values[0]) if values else {"e4m3": 1, "e2m1": 2}.get(fmt, 2 / 3) * q.shape[1]
    scales = stored_scales(sf, ceil_div(int(hidden), bk))
    out = [[f32(v * scales[t // bm][h // bk]) for h, v in enumerate(row)] for t, row in enumerate(values)]
    return torch.tensor(out, dtype=torch.float32).reshape(q.shape[0], int(hidden))


def random_pair(generator, fmt: str, tokens: int, hidden: int, bm: int, bk: int, layout: str):
    """Random codes (NaN codes included) and random scales of one block shape, stored in ``layout``."""
    columns = {"e4m3": hidden, "e2m1": hidden // 2, "e5m6": hidden * 3 // 2}[fmt]
    data = torch.randint(0, 256, (tokens, columns), generator=generator, dtype=torch.int32).to(torch.uint8)
    if fmt == "e4m3":
        data = data.view(torch.float8_e4m3fn)
    elif fmt == "e2m1":
        data = data.view(torch.int8)
    rows, kblocks = ceil_div(tokens, bm), ceil_div(hidden, bk)
    exponents = torch.randint(-40, 40, (rows, kblocks), generator=generator).to(torch.float32)
    scales = torch.exp2(exponents)
    if layout != "packed_ue8m0":
        scales = scales * (1 + torch.rand(rows, kblocks, generator=generator))  # not powers of two
    return data, rq.scales_to_layout(scales, ScaleLayout(layout))


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "e5m6"])
@pytest.mark.parametrize("block", QUANTIZED_BLOCKS, ids=str)
def test_cast_back_every_block_shape_and_layout_matches_a_loop(fmt, block, generator):
    tokens, hidden = 35, 40  # tails for every block; 40 is a multiple of 8 (e5m6) and even (e2m1)
    bm, bk = block[0], hidden if block[1] == "H" else block[1]
    special = "e5m6" if fmt == "e5m6" else None
    for layout in LAYOUTS:
        data, sf = random_pair(generator, fmt, tokens, hidden, bm, bk, layout)
        expected = loop_dequantize(data, sf, fmt, bm, bk)
        out32 = rq.cast_back((data, sf), "fp32", (bm, bk), x_special_fmt=special)
        out16 = rq.cast_back((data, sf), "bf16", (bm, bk), x_special_fmt=special)
        assert out32.shape == (tokens, hidden) and out32.is_contiguous()
        both_nan = torch.isnan(out32) & torch.isnan(expected)
        assert torch.equal(
            torch.where(both_nan, 0.0, out32).view(torch.int32), torch.where(both_nan, 0.0, expected).view(torch.int32)
        )
        assert out16.dtype == torch.bfloat16
        assert_bitwise(
            torch.where(both_nan, 0.0, out16.float()), torch.where(both_nan, 0.0, expected.bfloat16().float())
        )
        if bm == 1:
            assert_bitwise(rq.per_token_cast_back((data, sf), "fp32", bk, x_special_fmt=special), out32)


def test_cast_back_strided_rows_and_zero_tokens(generator):
    data, sf = random_pair(generator, "e2m1", 9, 64, 32, 32, "col_major")
    wide = torch.full((9, 40), 0x77, dtype=torch.uint8).view(torch.int8)  # padding decodes as 6
    wide[:, :32] = data
    assert_bitwise(rq.cast_back((wide[:, :32], sf), "fp32", (32, 32)), rq.cast_back((data, sf), "fp32", (32, 32)))
    empty, sf0 = random_pair(generator, "e4m3", 0, 64, 128, 128, "packed_ue8m0")
    out = rq.cast_back((empty, sf0), "bf16", (128, 128))
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


SOURCES = {  # (fmt, x_block_size, flags) of the quantized input of a re-quantization
    "e4m3_1x128": ("e4m3", (1, 128), {}),
    "e2m1_1x32_packed": ("e2m1", (1, 32), {"use_packed_ue8m0": True}),
    "e4m3_1x16_col_major": ("e4m3", (1, 16), {"use_tma_aligned_col_major_sf": True}),
}


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("fmt,c", [("e4m3", 128), ("e2m1", 32), ("e4m3", "H")])
def test_per_token_requantization_is_cast_of_the_dequantized_input(source, fmt, c, generator):
    in_fmt, block, in_flags = SOURCES[source]
    for tokens, hidden in [(0, 64), (1, 128), (37, 160)]:
        c_out = hidden if c == "H" else c
        x = make_input(generator, tokens, hidden, 32, "e4m3", torch.float32)
        pair = rq.per_token_cast(x, in_fmt, block[1], **in_flags)
        dequantized = loop_dequantize(*pair, in_fmt, *block) if tokens else torch.zeros(0, hidden)
        for flags in ({}, {"round_sf": True}, {"use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True}):
            q, sf = rq.per_token_cast(pair, fmt, c_out, x_block_size=block, **flags)
            q_expected, sf_expected = rq.per_token_cast(dequantized, fmt, c_out, **flags)
            assert_bitwise(q, q_expected)
            assert_bitwise(sf, sf_expected)
            sf_only = rq.per_token_cast_with_sf_only(pair, fmt, c_out, x_block_size=block, **flags)
            assert_bitwise(sf_only, sf_expected)
            q_given = rq.per_token_cast_with_precomputed_sf(pair, fmt, c_out, sf, x_block_size=block, **flags)
            q_given_expected = rq.per_token_cast_with_precomputed_sf(dequantized, fmt, c_out, sf, **flags)
            assert_bitwise(q_given, q_given_expected)


def test_requantization_multiplies_the_dequantized_value_not_a_fused_factor():
    """y = fl(fl(q · sf_in) · m), not fl(q · fl(sf_in · m)): a case where the two differ."""
    q = torch.tensor([[1.25, 448.0]]).to(torch.float8_e4m3fn)
    sf_in = torch.tensor([[f32(1 / 3)]])
    q_out, sf_out = rq.per_token_cast((q, sf_in), "e4m3", 2, x_block_size=(1, 2))
    multiplier = f32(448.0 / f32(448.0 * f32(1 / 3)))
    dequantized = f32(1.25 * f32(1 / 3))
    assert sf_out.item() == f32(f32(448.0 * f32(1 / 3)) / 448.0)
    assert q_out.view(torch.uint8)[0, 0].item() == e4m3_code_scalar(f32(dequantized * multiplier))
    fused = f32(1.25 * f32(f32(1 / 3) * multiplier))
    assert f32(dequantized * multiplier) != fused  # the two orders differ in the last bit here


def test_requantization_validation():
    pair = rq.per_token_cast(torch.randn(4, 64), "e4m3", 32)
    cases = [
        ({}, TypeError, "x_block_size must be a"),  # x_block_size=None with a pair
        ({"x_block_size": (1, 64)}, ValueError, r"x\[1\] must have shape"),
        ({"x_block_size": (1, 48)}, ValueError, "x_block_size"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            rq.per_token_cast(pair, "e4m3", 32, **kwargs)
    with pytest.raises(ValueError, match="fmt 'e5m6' takes a plain tensor"):
        rq.per_token_cast(pair, "e5m6", 64, x_block_size=(1, 32))
    with pytest.raises(ValueError, match="fmt must be one of"):
        rq.per_token_cast_with_sf_only(pair, "e5m6", 64, x_block_size=(1, 32))
    with pytest.raises(TypeError, match=r"x\[0\] must have dtype"):
        rq.per_token_cast((pair[0].float(), pair[1]), "e4m3", 32, x_block_size=(1, 32))
    with pytest.raises(ValueError, match="num_per_channels"):
        rq.per_token_cast(pair, "e4m3", 48, x_block_size=(1, 32))
    with pytest.raises(ValueError, match="x_block_size is only meaningful .* tuple; .* type list"):
        rq.per_token_cast(list(pair), "e4m3", 32, x_block_size=(1, 32))  # a list is not a quantized pair
    # An implementation without re-quantization (the shared check, given the tuple) says so.
    with pytest.raises(ValueError, match="re-quantizing a .* tuple .* is not supported by it"):
        contract.check_per_token_cast_input(pair, "e4m3", 32, (1, 32))

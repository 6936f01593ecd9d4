"""Property-based tests (hypothesis) of the reference twins: shapes, layouts and values (CPU only).

The other ``test_reference_*`` modules check each operator against hand-picked cases and independent
re-implementations. Here hypothesis draws the cases instead: shapes with empty, single, odd and tail
sizes; values spread over the whole fp32/bf16 range with injected all-zero rows and blocks, huge
outliers, subnormals and signed zeros; every flag combination. Each test checks laws of the contract
(``shared/spec/operators.md`` and the reference docstrings) that a plausible bug would break: error
bounds, exact scaling laws, inverse mappings, orderings, invariances and equivalences between
operators. Each test's docstring quotes the sentence of the spec it checks.

Reproducibility: every test runs with ``derandomize=True`` (hypothesis derives its examples from the
test itself, so CI sees the same cases on every run) and without an example database (no failure is
replayed from a previous run; hypothesis keeps only its self-ignoring ``.hypothesis/`` cache). Bulk
tensor data comes from a ``torch.Generator`` seeded by a drawn integer, so a failing example is
reproduced by its printed draws; hypothesis shrinks the shape, the seed and the injected special
values. The whole module runs in well under a minute on one CPU core.

Decoders used below are written here, independently of the reference: e4m3 through torch's dtype
conversion, e2m1 nibbles through the grid, e5m6 bit groups through Python integers and numpy's
float16, packed UE8M0 scale words byte by byte. Expected scales are computed in float64 and rounded
to fp32 by numpy (correct rounding of one division, since 53 >= 2·24 + 2).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from tileproof.reference import engram, mhc, moe, quant_blocks, quant_swiglu, transpose
from tileproof.reference import quant as rq

# derandomize: examples derived from the test, the same on every run; no example database.
DETERMINISTIC = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow],
}

QMAX = {"e4m3": 448.0, "e2m1": 6.0, "e5m6": 65024.0}
# The amax floor as the fp32 value the reference clamps with.
FLOOR = {"e4m3": float(np.float32(1e-4)), "e2m1": 6.0 * 2.0**-126, "e5m6": float(np.float32(1e-4))}
# Half the spacing of the format around |y| (y = x · multiplier): max(REL·|y|, ABS) bounds the
# rounding error of one encode, in units of the block scale (module docstring of test_reference_quant).
ERROR = {"e4m3": (2.0**-4, 2.0**-10), "e2m1": (0.25, 0.25), "e5m6": (2.0**-7, 2.0**-21)}
# fp32 roundings of the multiplier and of x · multiplier (a few 2^-24, relative to |x|).
SLACK = 2.0**-20
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
CHANNEL_BLOCKS = (16, 32, 64, 128)
LAYOUTS = {
    "row_major": {},
    "col_major": {"use_tma_aligned_col_major_sf": True},
    "round_sf": {"round_sf": True},
    "col_major+round_sf": {"use_tma_aligned_col_major_sf": True, "round_sf": True},
    "packed_ue8m0": {"use_packed_ue8m0": True},
    "packed_ue8m0+col_major": {"use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True},
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align4(a: int) -> int:
    return ceil_div(a, 4) * 4


def f32(values) -> np.ndarray:
    """Round float64 values to the nearest fp32 (ties to even), back as float64."""
    with np.errstate(over="ignore"):  # beyond the fp32 range: ±inf, as IEEE rounding gives
        return np.asarray(values, dtype=np.float64).astype(np.float32).astype(np.float64)


def as_f64(x: torch.Tensor) -> np.ndarray:
    """The exact values of a bf16/fp32 tensor as a float64 numpy array (any strides)."""
    return x.detach().to(torch.float64).contiguous().numpy()


def from_f64(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A float64 numpy array → a tensor of ``dtype`` with standard strides (numpy's empty arrays may not have them)."""
    return torch.empty(values.shape, dtype=dtype).copy_(torch.from_numpy(np.asarray(values, dtype=np.float64)))


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, ``[..., N · itemsize]`` uint8 (a contiguous copy first)."""
    t = torch.empty(t.shape, dtype=t.dtype).copy_(t)  # standard strides, even for size-1 dimensions
    if t.numel() == 0:
        return torch.empty((*t.shape[:-1], t.shape[-1] * t.element_size()), dtype=torch.uint8)
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(bits(a), bits(b)), f"{what}: bytes differ"


# ---------------------------------------------------------------------------------------------
# Independent decoders
# ---------------------------------------------------------------------------------------------


def decode_e2m1(packed: torch.Tensor) -> np.ndarray:
    b = packed.contiguous().view(torch.uint8).numpy().astype(np.int64)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], 2 * b.shape[1])
    magnitude = E2M1_GRID[codes & 7]
    return np.where(codes & 8, -magnitude, magnitude)


def e5m6_codes(packed: torch.Tensor) -> np.ndarray:
    """Packed uint8 ``[T, 3H/2]`` → codes ``[T, H]``: 3 little-endian words per 8 codes, h0 on top."""
    rows = packed.contiguous().numpy().astype(np.int64)
    tokens, groups = rows.shape[0], rows.shape[1] // 12
    codes = np.zeros((tokens, groups * 8), dtype=np.int64)
    for t in range(tokens):
        for g in range(groups):
            b = rows[t, 12 * g : 12 * g + 12].tolist()
            words = [b[4 * w] | b[4 * w + 1] << 8 | b[4 * w + 2] << 16 | b[4 * w + 3] << 24 for w in range(3)]
            group = words[0] << 64 | words[1] << 32 | words[2]
            for i in range(8):
                codes[t, 8 * g + i] = (group >> (84 - 12 * i)) & 0xFFF
    return codes


def decode_e5m6(packed: torch.Tensor) -> np.ndarray:
    codes = e5m6_codes(packed)
    return (codes.astype(np.uint16) << 4).view(np.float16).astype(np.float64)


def decode_data(q: torch.Tensor, fmt: str) -> np.ndarray:
    if fmt == "e4m3":
        return q.to(torch.float64).numpy()
    if fmt == "e2m1":
        return decode_e2m1(q)
    return decode_e5m6(q)


def packed_exponent_bytes(sf: torch.Tensor) -> np.ndarray:
    """int32 ``[rows, words]`` → the exponent bytes ``[rows, 4·words]``, byte k % 4 of word k // 4."""
    words = sf.numpy().astype(np.int64) & 0xFFFFFFFF
    per_byte = np.stack([(words >> (8 * b)) & 0xFF for b in range(4)], axis=-1)
    return per_byte.reshape(words.shape[0], 4 * words.shape[1])


def decode_scales(sf: torch.Tensor, kblocks: int) -> np.ndarray:
    """Stored scales (any layout) → float64 ``[rows, kblocks]``; UE8M0 byte e is 2^(e-127), 0xFF NaN."""
    if sf.dtype == torch.float32:
        return sf.to(torch.float64).numpy().copy()
    exponents = packed_exponent_bytes(sf)[:, :kblocks]
    return np.where(exponents == 0xFF, np.nan, np.ldexp(1.0, exponents - 127))


def is_rounded(layout: str) -> bool:
    """round_sf is set, or implied by use_packed_ue8m0."""
    return "round_sf" in layout or layout.startswith("packed")


def check_scale_storage(sf: torch.Tensor, rows: int, kblocks: int, layout: str) -> None:
    """Contract §1 "Scale layouts": shape, dtype and strides of each layout; unused packed bytes 0."""
    packed = layout.startswith("packed")
    columns = ceil_div(kblocks, 4) if packed else kblocks
    assert sf.dtype == (torch.int32 if packed else torch.float32), (layout, sf.dtype)
    assert tuple(sf.shape) == (rows, columns), (layout, tuple(sf.shape), (rows, columns))
    if sf.numel():
        column_major = packed or "col_major" in layout
        expected = (1, align4(rows)) if column_major else (columns, 1)
        assert sf.stride() == expected, (layout, sf.stride(), expected)
        assert sf.storage_offset() == 0
    if packed and sf.numel():
        assert (packed_exponent_bytes(sf)[:, kblocks:] == 0).all(), "unused bytes of the last word must be 0"


def block_amax(x64: np.ndarray, bm: int, bk: int) -> np.ndarray:
    """``max |x|`` per ``bm × bk`` block (tails padded with zeros; NaN propagates)."""
    tokens, hidden = x64.shape
    rows, kblocks = ceil_div(tokens, bm), ceil_div(hidden, bk)
    padded = np.zeros((rows * bm, kblocks * bk))
    padded[:tokens, :hidden] = np.abs(x64)
    return padded.reshape(rows, bm, kblocks, bk).max(axis=(1, 3))


def expected_scales(amax: np.ndarray, fmt: str, round_sf: bool) -> np.ndarray:
    """``sf = fl32(max(amax, floor) / qmax)``; with round_sf the next power of two at or above."""
    sf = f32(np.maximum(amax, FLOOR[fmt]) / QMAX[fmt])
    if not round_sf:
        return sf
    mantissa, exponent = np.frexp(np.nan_to_num(sf, nan=1.0))
    rounded = np.where(mantissa == 0.5, sf, np.ldexp(1.0, exponent))
    return np.where(np.isnan(sf), np.nan, rounded)


def expand(per_block: np.ndarray, bm: int, bk: int, tokens: int, hidden: int) -> np.ndarray:
    return np.repeat(np.repeat(per_block, bm, axis=0), bk, axis=1)[:tokens, :hidden]


def check_cast(x, q, sf, fmt: str, block: tuple[int, int], layout: str, *, check_back: bool = True) -> None:
    """Every law of a cast of the plain tensor ``x`` with blocks ``block`` and scale layout ``layout``.

    - data tensor: dtype, shape ``[T, H]`` / ``[T, H/2]`` / ``[T, 3H/2]``, contiguous;
    - scale storage (``check_scale_storage``), and the scale of each block is the contract's rule
      applied to its amax (a power of two with round_sf);
    - the amax element of a block encodes to ±qmax exactly (without round_sf) or to a magnitude in
      [qmax/2, qmax] (with round_sf; sf is the smallest power of two with amax/sf <= qmax), unless
      its amax was clamped to the floor;
    - every element dequantizes within the format's half spacing around ``x / sf``, in units of sf;
    - the sign bit of every code is the sign bit of its input (−0 for a negative value rounding to 0);
    - ``cast_back`` is ``decode(q) · sf`` rounded once to fp32, and once more to bf16.
    """
    x64 = as_f64(x)
    tokens, hidden = x64.shape
    bm, bk = block
    rows, kblocks = ceil_div(tokens, bm), ceil_div(hidden, bk)
    round_sf = is_rounded(layout)
    storage = {"e4m3": torch.float8_e4m3fn, "e2m1": torch.int8, "e5m6": torch.uint8}[fmt]
    width = {"e4m3": hidden, "e2m1": hidden // 2, "e5m6": hidden * 3 // 2}[fmt]
    assert q.dtype == storage and tuple(q.shape) == (tokens, width) and q.is_contiguous()
    check_scale_storage(sf, rows, kblocks, layout)

    amax = block_amax(x64, bm, bk)
    scales = decode_scales(sf, kblocks)
    want = expected_scales(amax, fmt, round_sf)
    assert np.array_equal(scales, want, equal_nan=True), f"scales {scales} != {want} (amax {amax})"

    values = decode_data(q, fmt)
    sf_el = expand(scales, bm, bk, tokens, hidden)
    amax_el = expand(amax, bm, bk, tokens, hidden)
    top = (np.abs(x64) == amax_el) & (amax_el >= FLOOR[fmt])
    if round_sf:
        assert ((np.abs(values[top]) >= QMAX[fmt] / 2) & (np.abs(values[top]) <= QMAX[fmt])).all()
    else:
        assert (np.abs(values[top]) == QMAX[fmt]).all(), "a block's amax must encode to ±qmax"
    rel, absolute = ERROR[fmt]
    err = np.abs(values * sf_el - x64)
    bound = np.maximum(rel * np.abs(x64), absolute * sf_el) * (1 + SLACK) + SLACK * np.abs(x64)
    assert (err <= bound).all(), (
        f"max excess {np.max(err - bound)} at {np.unravel_index(np.argmax(err - bound), err.shape)}"
    )
    assert (np.signbit(values) == np.signbit(x64)).all(), "codes must keep the sign bit of their input"

    if check_back:
        special = "e5m6" if fmt == "e5m6" else None
        back = rq.cast_back((q, sf), "fp32", block, x_special_fmt=special)
        expected_back = from_f64(f32(values * sf_el), torch.float32)
        assert_same_bits(back, expected_back, "cast_back fp32")
        assert_same_bits(rq.cast_back((q, sf), "bf16", block, x_special_fmt=special), expected_back.to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------

SPECIAL_KINDS = ("zero_row", "zero_block", "outlier", "dtype_max", "subnormal", "zero", "tiny_row", "tie")


def draw_matrix(draw, tokens: int, hidden: int, dtype: torch.dtype, *, specials: bool = True, magnitude=None):
    """A ``[T, H]`` tensor of ``dtype``: seeded normal or log-uniform values at a drawn scale, with
    injected special values, optionally a view with a row stride larger than H."""
    seed = draw(st.integers(0, 2**32 - 1))
    exponent = draw(magnitude if magnitude is not None else st.integers(-140, 120))
    generator = torch.Generator().manual_seed(seed)
    if draw(st.booleans()):
        x = torch.randn(tokens, hidden, generator=generator, dtype=torch.float64)
    else:  # log-uniform over 2^±20: many binades inside one block
        sign = torch.randint(0, 2, (tokens, hidden), generator=generator).to(torch.float64) * 2 - 1
        x = sign * torch.exp2(torch.rand(tokens, hidden, generator=generator, dtype=torch.float64) * 40 - 20)
    x = x * 2.0**exponent
    info = torch.finfo(dtype)
    if specials and x.numel():
        for kind, a, b in draw(
            st.lists(
                st.tuples(st.sampled_from(SPECIAL_KINDS), st.integers(0, 2**20), st.integers(0, 2**20)), max_size=4
            )
        ):
            row, column = a % tokens, b % hidden
            if kind == "zero_row":
                x[row] = -0.0 if b % 2 else 0.0
            elif kind == "zero_block":
                start = (b % ceil_div(hidden, 32)) * 32
                x[row, start : start + 32] = 0.0
            elif kind == "outlier":
                x[row, column] *= 2.0 ** (b % 60)
            elif kind == "dtype_max":
                x[row, column] = info.max if a % 2 else -info.max
            elif kind == "subnormal":
                x[row, column] = (b % 127 + 1) * info.smallest_normal * info.eps * (1 if a % 2 else -1)
            elif kind == "zero":
                x[row, column] = -0.0 if b % 2 else 0.0
            elif kind == "tiny_row":
                x[row] = x[row] / x[row].abs().max().clamp(min=1e-300) * info.smallest_normal * 2.0 ** (b % 24 - 8)
            elif kind == "tie":  # the row's amax twice, with both signs
                x[row, column] = -x[row].abs().max()
    x = x.clamp(-info.max, info.max).to(dtype)
    if draw(st.booleans()) and x.numel():  # a row stride larger than the row
        padding = draw(st.integers(1, 9))
        wide = torch.full((tokens, hidden + padding), float("nan"), dtype=dtype)
        wide[:, :hidden] = x
        x = wide[:, :hidden]
    return x


HIDDEN = st.one_of(st.integers(0, 40), st.sampled_from([63, 64, 65, 127, 128, 129, 160, 200, 255, 256]))


@st.composite
def per_token_cases(draw):
    fmt = draw(st.sampled_from(["e4m3", "e2m1", "e5m6"]))
    tokens = draw(st.integers(0, 6))
    if fmt == "e5m6":
        hidden = 8 * draw(st.integers(1, 24))
        c = hidden
    else:
        hidden = draw(HIDDEN)
        if fmt == "e2m1":
            hidden += hidden % 2
        c = draw(st.sampled_from(CHANNEL_BLOCKS + ((hidden,) if hidden else ())))
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    x = draw_matrix(draw, tokens, hidden, dtype)
    return fmt, c, layout, x


# ---------------------------------------------------------------------------------------------
# Per-token casts
# ---------------------------------------------------------------------------------------------


@settings(max_examples=150, **DETERMINISTIC)
@given(per_token_cases())
def test_per_token_cast_scales_layout_and_reconstruction(case):
    """§1: "amax per block in fp32, clamped below ... sf = amax/Qmax ... With round_sf=True the scale is
    rounded up to a power of two"; "Scale layouts: (a) row-major ... (b) strides (1, align(rows, 4)) ...
    (c) use_packed_ue8m0 (implies b and round_sf) ... Unused bytes of the last word are 0"; cast_back:
    "decode(q) · sf broadcast over the blocks, any scale layout". For every format, block width C
    (16..128 or H, tail blocks included), flag combination, input dtype and row stride."""
    fmt, c, layout, x = case
    q, sf = rq.per_token_cast(x, fmt, c, **LAYOUTS[layout])
    check_cast(x, q, sf, fmt, (1, c), layout)


@settings(max_examples=60, **DETERMINISTIC)
@given(per_token_cases())
def test_per_token_layout_flags_change_only_the_scale_storage(case):
    """§1: the layout flags choose where the scales are stored, not their values; "use_packed_ue8m0
    (implies b and round_sf)"; per_token_cast_with_sf_only returns "only the scales" (same bytes and
    strides); per_token_cast_with_precomputed_sf quantizes "with given scales (multiplier 1/sf)",
    which is per_token_cast's multiplier exactly when the scales are powers of two."""
    fmt, c, _, x = case
    kblocks = ceil_div(x.shape[1], c)
    reference = {rounded: rq.per_token_cast(x, fmt, c, round_sf=rounded) for rounded in (False, True)}
    for layout, flags in LAYOUTS.items():
        q, sf = rq.per_token_cast(x, fmt, c, **flags)
        q_ref, sf_ref = reference[is_rounded(layout)]
        assert_same_bits(q, q_ref, layout)
        assert np.array_equal(decode_scales(sf, kblocks), decode_scales(sf_ref, kblocks), equal_nan=True), layout
        if fmt == "e5m6":
            continue
        sf_only = rq.per_token_cast_with_sf_only(x, fmt, c, **flags)
        assert_same_bits(sf_only, sf, layout)
        assert sf_only.stride() == sf.stride() or sf.numel() == 0
        if is_rounded(layout):
            assert_same_bits(rq.per_token_cast_with_precomputed_sf(x, fmt, c, sf, **flags), q, layout)


@st.composite
def nan_cases(draw):
    fmt, c, layout, x = draw(per_token_cases())
    assume(x.numel() > 0)
    positions = draw(st.lists(st.tuples(st.integers(0, x.shape[0] - 1), st.integers(0, x.shape[1] - 1)), min_size=1))
    return fmt, c, layout, x, positions


@settings(max_examples=60, **DETERMINISTIC)
@given(nan_cases())
def test_nan_poisons_exactly_its_own_block(case):
    """quant.py: "A block's amax is max |x| over the block in fp32 (NaN if the block holds a NaN)";
    "a NaN scale stays NaN"; "Packed UE8M0 scales decode 0xFF as NaN ... a NaN or Inf scale encodes to
    it". So every element of a block holding a NaN dequantizes to NaN, and every other block is
    quantized exactly as if the NaN had been a zero (a block's scale and codes depend on that block only)."""
    fmt, c, layout, x, positions = case
    poisoned, zeroed = x.clone(), x.clone()
    blocks = set()
    for t, h in positions:
        poisoned[t, h] = float("nan")
        zeroed[t, h] = 0.0
        blocks.add((t, h // c))
    flags = LAYOUTS[layout]
    q, sf = rq.per_token_cast(poisoned, fmt, c, **flags)
    q0, sf0 = rq.per_token_cast(zeroed, fmt, c, **flags)
    kblocks = ceil_div(x.shape[1], c)
    scales, scales0 = decode_scales(sf, kblocks), decode_scales(sf0, kblocks)
    in_nan_block = np.zeros(x.shape, dtype=bool)
    nan_block = np.zeros(scales.shape, dtype=bool)
    for t, k in blocks:
        nan_block[t, k] = True
        in_nan_block[t, k * c : (k + 1) * c] = True
    assert np.isnan(scales[nan_block]).all(), "a block with a NaN must get a NaN scale"
    assert np.array_equal(scales[~nan_block], scales0[~nan_block])
    special = "e5m6" if fmt == "e5m6" else None
    back = rq.cast_back((q, sf), "fp32", (1, c), x_special_fmt=special).numpy()
    back0 = rq.cast_back((q0, sf0), "fp32", (1, c), x_special_fmt=special).numpy()
    assert np.isnan(back[in_nan_block]).all(), "every element of a NaN block dequantizes to NaN"
    assert np.array_equal(back[~in_nan_block].view(np.int32), back0[~in_nan_block].view(np.int32))


@settings(max_examples=50, **DETERMINISTIC)
@given(per_token_cases(), st.lists(st.integers(0, 5), max_size=8))
def test_per_token_cast_is_odd_and_row_local(case, rows):
    """§1: "the sign bit is always kept" and the block scale is taken over |x|: casting −x gives the
    same scales and every code with its sign bit flipped (e2m1: 0b1000 for −0; e4m3: 0x80). And "1×C
    blocks": each row is quantized on its own, so casting any selection of rows (repeats allowed)
    gives exactly those rows of the full result."""
    fmt, c, layout, x = case
    flags = LAYOUTS[layout]
    q, sf = rq.per_token_cast(x, fmt, c, **flags)
    q_neg, sf_neg = rq.per_token_cast(-x, fmt, c, **flags)
    kblocks = ceil_div(x.shape[1], c)
    assert_same_bits(sf_neg, sf)
    values, values_neg = decode_data(q, fmt), decode_data(q_neg, fmt)
    assert np.array_equal(np.abs(values), np.abs(values_neg))
    assert (np.signbit(values) != np.signbit(values_neg)).all()
    if x.shape[0]:
        index = torch.tensor([r % x.shape[0] for r in rows], dtype=torch.int64)
        q_rows, sf_rows = rq.per_token_cast(x[index], fmt, c, **flags)
        assert_same_bits(q_rows, q[index])
        assert np.array_equal(decode_scales(sf_rows, kblocks), decode_scales(sf, kblocks)[index.numpy()])


@settings(max_examples=50, **DETERMINISTIC)
@given(per_token_cases(), st.integers(1, 24))
def test_per_token_cast_power_of_two_scaling_only_scales_sf(case, shift):
    """§1 scale rule: sf = amax/Qmax, multiplier Qmax/amax, y = x·multiplier, all IEEE fp32: scaling x
    by 2^j scales amax, sf (and its power-of-two rounding) by 2^j and the multiplier by 2^-j exactly,
    so y and the codes do not change — for every block whose amax is not clamped to the floor."""
    fmt, c, layout, x = case
    x64 = as_f64(x)
    big = x64 * 2.0**shift
    assume(not np.any(np.abs(big) > torch.finfo(x.dtype).max))
    scaled = from_f64(big, x.dtype)
    flags = LAYOUTS[layout]
    q, sf = rq.per_token_cast(x, fmt, c, **flags)
    q2, sf2 = rq.per_token_cast(scaled, fmt, c, **flags)
    kblocks = ceil_div(x.shape[1], c)
    amax = block_amax(x64, 1, c)
    live = amax >= FLOOR[fmt]
    assert np.array_equal(decode_scales(sf2, kblocks)[live], decode_scales(sf, kblocks)[live] * 2.0**shift)
    live_el = expand(live, 1, c, *x.shape)
    v, v2 = decode_data(q, fmt), decode_data(q2, fmt)
    assert np.array_equal(v[live_el], v2[live_el]) and np.array_equal(np.signbit(v[live_el]), np.signbit(v2[live_el]))


CONTAINED_BLOCKS = {  # source block -> target blocks lying inside it (both start at 0)
    (1, 32): [(1, 16), (1, 32)],
    (1, 64): [(1, 16), (1, 32), (1, 64)],
    (1, 128): [(1, 16), (1, 32), (1, 64), (1, 128)],
    (32, 32): [(1, 16), (1, 32), (32, 32)],
    (32, 128): [(1, 32), (1, 128), (32, 32), (32, 128)],
    (128, 128): [(1, 64), (1, 128), (32, 32), (32, 128), (128, 32), (128, 128)],
}


@st.composite
def requantization_cases(draw):
    fmt = draw(st.sampled_from(["e4m3", "e2m1"]))
    source = draw(st.sampled_from(sorted(CONTAINED_BLOCKS)))
    target = draw(st.sampled_from(CONTAINED_BLOCKS[source]))
    tokens = draw(st.integers(0, 6) if max(source[0], target[0]) == 1 else st.integers(0, 70))
    hidden = draw(st.integers(0, 140))
    hidden += hidden % 2
    x = draw_matrix(draw, tokens, hidden, DTYPES[draw(st.sampled_from(sorted(DTYPES)))])
    layouts = [name for name in sorted(LAYOUTS) if is_rounded(name)]
    return fmt, source, target, x, draw(st.sampled_from(layouts)), draw(st.sampled_from(layouts))


def block_cast(x, fmt, block, flags, x_block_size=None):
    if block[0] == 1:
        return rq.per_token_cast(x, fmt, block[1], x_block_size=x_block_size, **flags)
    return quant_blocks.per_block_cast(x, fmt, block, x_block_size=x_block_size, **flags)


@settings(max_examples=60, **DETERMINISTIC)
@given(requantization_cases())
def test_round_sf_requantization_into_finer_blocks_is_lossless(case):
    """§1: a cast of "an already quantized (q, sf) ... (re-quantization: dequantize, then quantize)".
    With power-of-two scales (round_sf) and target blocks that lie inside the source blocks, every
    target scale is a power of two at most the source scale, every value q·sf is q·2^d in the target
    (d >= 0, still within Qmax, still a code of the format): the dequantized values come back bit for bit."""
    fmt, source, target, x, layout_in, layout_out = case
    q, sf = block_cast(x, fmt, source, LAYOUTS[layout_in])
    q2, sf2 = block_cast((q, sf), fmt, target, LAYOUTS[layout_out], x_block_size=source)
    before = rq.cast_back((q, sf), "fp32", source)
    # Near the fp32 maximum a rounded-up scale can carry a code to 2^128: such a dequantized value
    # is ±inf (IEEE overflow of decode(q)·sf) and cannot be re-quantized.
    assume(bool(torch.isfinite(before).all()))
    after = rq.cast_back((q2, sf2), "fp32", target)
    assert_same_bits(after, before)
    check_cast(before, q2, sf2, fmt, target, layout_out, check_back=False)


@st.composite
def e5m6_codes_cases(draw):
    tokens, groups = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    codes = torch.randint(0, 0x1000, (tokens, 8 * groups), generator=torch.Generator().manual_seed(seed))
    extra = draw(st.lists(st.sampled_from([0, 0x800, 0x7C0, 0xFC0, 0x7BF, 0xFFF, 0x001, 0x03F, 0x040]), max_size=4))
    flat = codes.view(-1)
    for i, code in enumerate(extra[: flat.numel()]):
        flat[(i * 7) % flat.numel()] = code
    return codes.to(torch.uint16)


@settings(max_examples=40, **DETERMINISTIC)
@given(e5m6_codes_cases())
def test_e5m6_packing_and_codes_round_trip(codes):
    """§1: "e5m6 (12-bit float = the top 12 bits of an IEEE fp16 ...; 8 values packed into 3 uint32
    words, big-endian bit order inside the group, stored as uint8 [T, 3H/2]"; quant.py: decode is
    exact, encode rounds to the nearest e5m6 value, so every finite or infinite code encodes back to
    itself and every NaN code to the canonical 0x7FF."""
    packed = rq.pack_e5m6(codes)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (codes.shape[0], codes.shape[1] * 3 // 2)
    assert np.array_equal(e5m6_codes(packed), codes.to(torch.int64).numpy())
    assert torch.equal(rq.unpack_e5m6(packed), codes)
    values = rq.decode_e5m6(codes)
    expected = (codes.numpy().astype(np.uint16) << 4).view(np.float16).astype(np.float32)
    assert np.array_equal(values.numpy(), expected, equal_nan=True)
    is_nan = torch.isnan(values)
    again = rq.encode_e5m6(values)
    assert torch.equal(again[~is_nan], codes[~is_nan])
    assert (again[is_nan] == rq.E5M6_NAN).all()


# ---------------------------------------------------------------------------------------------
# 2-D block and per-channel casts
# ---------------------------------------------------------------------------------------------


@st.composite
def per_block_cases(draw):
    fmt = draw(st.sampled_from(["e4m3", "e2m1"]))
    block = (draw(st.sampled_from([32, 128])), draw(st.sampled_from([32, 128])))
    tokens = draw(st.one_of(st.integers(0, 40), st.sampled_from([63, 64, 65, 129])))
    hidden = draw(st.one_of(st.integers(0, 40), st.sampled_from([63, 64, 65, 129])))
    hidden += (fmt == "e2m1") * (hidden % 2)
    x = draw_matrix(draw, tokens, hidden, DTYPES[draw(st.sampled_from(sorted(DTYPES)))])
    return fmt, block, draw(st.sampled_from(sorted(LAYOUTS))), x


@settings(max_examples=60, **DETERMINISTIC)
@given(per_block_cases())
def test_per_block_cast_scales_layout_and_reconstruction(case):
    """§1 per_block_cast: "2-D blocks (bm, bk), bm, bk ∈ {32, 128}" with the shared scale rule and
    layouts over ``[ceil(T/bm), ceil(H/bk)]`` scales, tail blocks partial; a 2-D block's scale is the
    largest 1×bk scale of its rows (the rule is monotone in amax); the sf-only and precomputed-sf
    variants agree with the cast."""
    fmt, block, layout, x = case
    flags = LAYOUTS[layout]
    q, sf = quant_blocks.per_block_cast(x, fmt, block, **flags)
    check_cast(x, q, sf, fmt, block, layout)
    bm, bk = block
    tokens, hidden = x.shape
    kblocks = ceil_div(hidden, bk)
    if hidden and tokens:
        _, sf_rows = rq.per_token_cast(x, fmt, bk, round_sf=is_rounded(layout))
        row_scales = decode_scales(sf_rows, kblocks)
        padded = np.full((ceil_div(tokens, bm) * bm, kblocks), -np.inf)
        padded[:tokens] = row_scales
        assert np.array_equal(decode_scales(sf, kblocks), padded.reshape(-1, bm, kblocks).max(axis=1))
    assert_same_bits(quant_blocks.per_block_cast_with_sf_only(x, fmt, block, **flags), sf)
    if is_rounded(layout):
        assert_same_bits(quant_blocks.per_block_cast_with_precomputed_sf(x, fmt, block, sf, **flags), q)


@st.composite
def per_channel_cases(draw):
    fmt = draw(st.sampled_from(["e4m3", "e2m1"]))
    tokens = draw(st.one_of(st.integers(0, 40), st.sampled_from([127, 128, 129, 200, 257])))
    hidden = draw(st.integers(0, 9))
    hidden += (fmt == "e2m1") * (hidden % 2)
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    return fmt, draw(st.sampled_from([32, 128])), draw(st.booleans()), draw_matrix(draw, tokens, hidden, dtype)


@settings(max_examples=50, **DETERMINISTIC)
@given(per_channel_cases())
def test_per_channel_cast_is_a_transposed_per_token_cast(case):
    """§1 per_channel_cast: "column blocks of 128 tokens × 1 channel; sf [T/128, H]" (nt ∈ {32, 128},
    partial last block); per_channel_cast_and_transpose: "per-channel cast, output transposed". The
    same scale rule on column blocks: for e4m3 it is exactly the per-token cast of xᵀ, transposed."""
    fmt, nt, round_sf, x = case
    q, sf = quant_blocks.per_channel_cast(x, fmt, nt, round_sf)
    check_cast(x, q, sf, fmt, (nt, 1), "round_sf" if round_sf else "row_major")
    if fmt == "e4m3":
        q_t, sf_t = rq.per_token_cast(x.T.contiguous(), fmt, nt, round_sf=round_sf)
        assert_same_bits(q, q_t.T.contiguous())
        assert_same_bits(sf, sf_t.T.contiguous())
        if x.dtype == torch.bfloat16:
            q_tr, sf_tr = quant_blocks.per_channel_cast_and_transpose(x, fmt, nt, round_sf)
            assert q_tr.is_contiguous()
            assert_same_bits(q_tr, q_t)
            assert_same_bits(sf_tr, sf)


@st.composite
def fused_channel_cases(draw):
    tokens = draw(st.integers(1, 6))
    hidden = draw(st.one_of(st.integers(0, 20), st.sampled_from([127, 128, 129, 256])))
    positions = draw(st.one_of(st.integers(0, 20), st.sampled_from([127, 128, 129, 255, 300])))
    seed = draw(st.integers(0, 2**32 - 1))
    generator = torch.Generator().manual_seed(seed)
    pos_to_token = torch.randint(-1, tokens, (positions,), generator=generator, dtype=torch.int32)
    x = draw_matrix(draw, tokens, hidden, DTYPES[draw(st.sampled_from(sorted(DTYPES)))])
    quantized = draw(st.sampled_from([None, *sorted(LAYOUTS)]))
    return x, quantized, pos_to_token if draw(st.booleans()) else None, draw(st.booleans())


@settings(max_examples=50, **DETERMINISTIC)
@given(fused_channel_cases())
def test_per_channel_cast_fused_gathers_then_casts_any_row_count(case):
    """§1 per_channel_cast_fused: "optional row gather x[pos_to_token] (−1 → zero row) and optional
    dequantization of a 1×128-scaled FP8 input, then per-channel cast. Must be right when P is not a
    multiple of 128": the last token block's scale is taken over the rows that exist, and padding
    rows are +0 codes."""
    x, quantized, pos_to_token, round_sf = case
    if quantized is None:
        source, values, extra = x, as_f64(x), {}
    else:
        source = rq.per_token_cast(x, "e4m3", 128, **LAYOUTS[quantized])
        values = rq.cast_back(source, "fp32", (1, 128)).to(torch.float64).numpy()
        assume(np.isfinite(values).all())  # a round_sf scale can carry a value near the fp32 maximum to ±inf
        extra = {"num_per_channels": 128}
    if pos_to_token is not None:
        index = pos_to_token.to(torch.int64).numpy()
        values = np.where((index >= 0)[:, None], values[np.maximum(index, 0)], 0.0)
    q, sf = quant_blocks.per_channel_cast_fused(source, "e4m3", 128, round_sf, pos_to_token=pos_to_token, **extra)
    gathered = from_f64(values, torch.float32)
    check_cast(gathered, q, sf, "e4m3", (128, 1), "round_sf" if round_sf else "row_major")
    if pos_to_token is not None:
        assert (q.view(torch.uint8)[pos_to_token < 0] == 0).all(), "padding rows must be +0 (0x00)"


@st.composite
def lossless_cases(draw):
    x_block = draw(st.sampled_from([(1, 16), (1, 32), (1, 64)]))
    out_block = draw(
        st.sampled_from(
            [b for b in [(1, 32), (1, 64), (1, 128), (32, 32), (32, 128), (128, 128)] if b[1] % x_block[1] == 0]
        )
    )
    tokens = draw(st.integers(0, 6) if out_block[0] == 1 else st.integers(0, 40))
    hidden = 2 * draw(st.integers(0, 70))
    spread = draw(st.integers(0, 40))
    x = draw_matrix(draw, tokens, hidden, torch.float32, magnitude=st.integers(-100, 100))
    if x.numel():  # widen the exponent spread between blocks
        generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
        x = x * torch.exp2(torch.randint(-spread, spread + 1, (tokens, 1 + hidden // 16), generator=generator))[
            :, torch.arange(hidden) // 16
        ].to(torch.float32)
        x = torch.nan_to_num(x, posinf=3e38, neginf=-3e38)
    return x, x_block, out_block, draw(st.sampled_from(sorted(LAYOUTS)))


@settings(max_examples=60, **DETERMINISTIC)
@given(lossless_cases())
def test_per_block_cast_lossless_is_exact_or_refused(case):
    """§1 per_block_cast_lossless: "exact FP4(+power-of-two 1×32 scales) → FP8(+coarser power-of-two
    scales): E_out = max(E_in) − 6 ... must dequantize to bit-identical values"; the docstring: a value
    e4m3 cannot hold is refused with a ValueError, and "spreads up to 11 are always exact"."""
    x, x_block, out_block, layout = case
    source = rq.per_token_cast(x, "e2m1", x_block[1], round_sf=True)
    tokens, hidden = x.shape
    in_exponents = np.log2(decode_scales(source[1], ceil_div(hidden, x_block[1])))
    per_element = expand(in_exponents, *x_block, tokens, hidden)
    padded_hi = np.full(
        (ceil_div(tokens, out_block[0]) * out_block[0], ceil_div(hidden, out_block[1]) * out_block[1]), -np.inf
    )
    padded_lo = np.full(padded_hi.shape, np.inf)
    padded_hi[:tokens, :hidden] = per_element
    padded_lo[:tokens, :hidden] = per_element
    shape = (padded_hi.shape[0] // out_block[0], out_block[0], padded_hi.shape[1] // out_block[1], out_block[1])
    spread = np.nan_to_num(padded_hi.reshape(shape).max(axis=(1, 3)) - padded_lo.reshape(shape).min(axis=(1, 3)))
    flags = LAYOUTS[layout]
    try:
        q, sf = quant_blocks.per_block_cast_lossless(source, "e4m3", x_block, out_block, **flags)
    except ValueError as error:
        event("refused")
        assert "losslessly" in str(error)
        assert spread.max() > 11, f"an exponent spread of {spread.max()} <= 11 must be exact"
        return
    event("exact")
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (tokens, hidden)
    kblocks = ceil_div(hidden, out_block[1])
    check_scale_storage(sf, ceil_div(tokens, out_block[0]), kblocks, layout)
    scales = decode_scales(sf, kblocks)
    assert (np.frexp(scales)[0] == 0.5).all(), "output scales must be powers of two"
    assert_same_bits(rq.cast_back((q, sf), "fp32", out_block), rq.cast_back(source, "fp32", x_block))


# ---------------------------------------------------------------------------------------------
# SwiGLU + casts
# ---------------------------------------------------------------------------------------------


def silu64(g: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return g / (1.0 + np.exp(-g))


@st.composite
def swiglu_forward_cases(draw):
    fmt = draw(st.sampled_from(["e4m3", "e2m1"]))
    rows = draw(st.integers(0, 8))
    hidden = draw(st.one_of(st.integers(1, 40), st.sampled_from([127, 128, 129, 256])))
    hidden += (fmt == "e2m1") * (hidden % 2)
    c = draw(st.sampled_from([128, hidden]))
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    x = draw_matrix(draw, rows, 2 * hidden, dtype, specials=False, magnitude=st.integers(-12, 8))
    if rows and draw(st.booleans()):  # an all-zero row: the floor scale
        x[draw(st.integers(0, rows - 1))] = 0.0
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    tokens, topk = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    routing = None
    if draw(st.booleans()):
        weights = torch.rand(tokens, topk, generator=generator) * 2 ** draw(st.integers(-3, 3))
        routing = (torch.randint(-1, tokens * topk, (rows,), generator=generator), weights)
    pos_to_expert = torch.randint(-1, 3, (rows,), generator=generator) if draw(st.booleans()) else None
    clamp = draw(st.one_of(st.none(), st.floats(0.01, 30.0)))
    return fmt, c, x, routing, pos_to_expert, clamp, draw(st.sampled_from(sorted(LAYOUTS)))


@settings(max_examples=60, **DETERMINISTIC)
@given(swiglu_forward_cases())
def test_swiglu_forward_and_per_token_cast_quantizes_silu_times_up(case):
    """§1 swiglu_forward_and_per_token_cast: "g = x[:, :H], u = x[:, H:]; with clamp c: g = min(g, c),
    u = clamp(u, −c, c) and clamped_count += [#g>c, #u>c, #u<−c]; a = silu(g)·u·w with
    w = topk_weights.flatten()[pos_to_token_topk[r]] when given; rows with pos_to_expert < 0 are
    padding and are skipped; then per-token cast of a". The dequantized output is within the cast's
    bound of silu(g)·u·w evaluated in float64; padding rows are zero bytes, are not counted, and do not
    change the other rows."""
    fmt, c, x, routing, pos_to_expert, clamp, layout = case
    flags = LAYOUTS[layout]
    rows, hidden = x.shape[0], x.shape[1] // 2
    counts = torch.zeros(3, dtype=torch.int64) if clamp is not None else None
    kwargs = {"pos_to_expert": pos_to_expert, "swiglu_clamp_value": clamp, "clamped_count": counts, **flags}
    if routing is not None:
        kwargs.update(pos_to_token_topk=routing[0], topk_weights=routing[1])
    q, sf = quant_swiglu.swiglu_forward_and_per_token_cast(x, fmt, c, **kwargs)

    x64 = as_f64(x)
    g, u = x64[:, :hidden], x64[:, hidden:]
    padding = np.zeros(rows, dtype=bool) if pos_to_expert is None else pos_to_expert.numpy() < 0
    if clamp is not None:
        c32 = float(np.float32(clamp))
        above, up_above, up_below = g > c32, u > c32, u < -c32
        expected_counts = [int((m & ~padding[:, None]).sum()) for m in (above, up_above, up_below)]
        assert counts.tolist() == expected_counts
        g, u = np.where(above, c32, g), np.where(up_above, c32, np.where(up_below, -c32, u))
    w = np.ones((rows, 1))
    if routing is not None:
        index = routing[0].numpy()
        w = np.where(index >= 0, routing[1].double().numpy().reshape(-1)[np.maximum(index, 0)], 0.0)[:, None]
    a64 = np.where(padding[:, None], 0.0, silu64(g) * u * w)

    kblocks = ceil_div(hidden, c)
    scales = decode_scales(sf, kblocks)
    sf_el = expand(scales, 1, c, rows, hidden)
    values = decode_data(q, fmt)
    rel, absolute = ERROR[fmt]
    err = np.abs(values * sf_el - a64)
    # the fp32 activation is within a few ulp of the float64 one (four roundings, exp correctly rounded)
    bound = np.maximum(rel * np.abs(a64), absolute * sf_el) * (1 + 2**-18) + 2**-18 * np.abs(a64) + 2.0**-140
    assert (err <= bound).all(), f"max excess {np.max(err - bound)}"
    check_scale_storage(sf, rows, kblocks, layout)
    if padding.any():
        # the stored bytes of padding rows are zero, data and scales (fp32 0.0 or UE8M0 words 0)
        assert (q.view(torch.uint8)[torch.from_numpy(padding)] == 0).all()
        assert (sf[torch.from_numpy(padding)] == 0).all()
        keep = torch.from_numpy(~padding)
        kwargs_kept = dict(kwargs, pos_to_expert=None, clamped_count=None)
        if routing is not None:
            kwargs_kept["pos_to_token_topk"] = routing[0][keep]
        q_kept, sf_kept = quant_swiglu.swiglu_forward_and_per_token_cast(x[keep], fmt, c, **kwargs_kept)
        assert_same_bits(q_kept, q[keep])
        assert np.array_equal(decode_scales(sf_kept, kblocks), scales[~padding])


@st.composite
def swiglu_clamp_cases(draw):
    rows, hidden = draw(st.integers(0, 6)), draw(st.integers(1, 40))
    x = draw_matrix(draw, rows, 2 * hidden, torch.float32, magnitude=st.integers(-4, 6))
    return x, draw(st.floats(2.0**-4, 40.0)), draw(st.sampled_from([32, 128])), draw(st.booleans())


@settings(max_examples=40, **DETERMINISTIC)
@given(swiglu_clamp_cases())
def test_swiglu_clamp_is_clamping_the_input_first(case):
    """§1: "with clamp c: g = min(g, c), u = clamp(u, −c, c)" (quant_swiglu.py: c rounded once to fp32,
    strict comparisons): both forward operators give the bytes of the unclamped operator applied to
    the input clamped beforehand; the per-channel operator's transposed and untransposed outputs agree."""
    x, clamp, nt, round_sf = case
    hidden = x.shape[1] // 2
    c32 = float(np.float32(clamp))
    clamped = x.clone()
    clamped[:, :hidden] = torch.where(x[:, :hidden] > c32, c32, x[:, :hidden])
    clamped[:, hidden:] = x[:, hidden:].clamp(-c32, c32)
    q, sf = quant_swiglu.swiglu_forward_and_per_token_cast(x, "e4m3", hidden, swiglu_clamp_value=clamp)
    q0, sf0 = quant_swiglu.swiglu_forward_and_per_token_cast(clamped, "e4m3", hidden)
    assert_same_bits(q, q0)
    assert_same_bits(sf, sf0)
    xb, clamped_b = x.to(torch.bfloat16), clamped.to(torch.bfloat16)
    c_b = float(torch.tensor(c32).to(torch.bfloat16))  # a clamp value that bf16 holds exactly
    clamped_b[:, :hidden] = torch.where(xb[:, :hidden] > c_b, c_b, xb[:, :hidden])
    clamped_b[:, hidden:] = xb[:, hidden:].clamp(-c_b, c_b)
    op = quant_swiglu.swiglu_forward_and_per_channel_cast_and_transpose
    q_t, sf_t = op(xb, "e4m3", nt, round_sf, swiglu_clamp_value=c_b)
    assert_same_bits(q_t, op(clamped_b, "e4m3", nt, round_sf)[0])
    q_n, sf_n = op(xb, "e4m3", nt, round_sf, without_transpose=True, swiglu_clamp_value=c_b)
    assert_same_bits(q_t, q_n.T.contiguous())
    assert_same_bits(sf_t, sf_n)


@st.composite
def swiglu_backward_cases(draw):
    c = draw(st.sampled_from([32, 128]))
    hidden = c * draw(st.integers(1, 2))
    tokens, topk, experts = draw(st.integers(0, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    topk_idx = torch.randint(-1, experts, (tokens, topk), generator=generator)
    mapping = moe.get_fused_mapping(topk_idx, experts, 0, draw(st.sampled_from([1, 4])))
    rows = mapping[0].shape[0]
    x = draw_matrix(draw, rows, 2 * hidden, torch.bfloat16, specials=False, magnitude=st.integers(-3, 3))
    grad_out = draw_matrix(draw, rows, hidden, torch.bfloat16, specials=False, magnitude=st.integers(-3, 3))
    weight = torch.rand(tokens, topk, generator=generator)
    clamp = draw(st.one_of(st.none(), st.floats(0.5, 8.0)))
    return x.contiguous(), grad_out.contiguous(), weight, mapping, c, clamp


@settings(max_examples=30, **DETERMINISTIC)
@given(swiglu_backward_cases())
def test_swiglu_backward_is_the_derivative(case):
    """§1 swiglu_backward_and_per_token_cast: "dequantize g, u; s = σ(g); out = g·s·u·w;
    dg = go·w·s·u·(1 + g(1−s)), du = go·w·g·s (0 where clamped); dweight[t,j] = Σ_h go·g·s·u; dx also
    per-token cast": every output against float64 autograd of silu(g)·u·w on the dequantized input."""
    x, grad_out, weight, mapping, c, clamp = case
    _, _, pos_to_token_topk, token_topk_to_pos, *_ = mapping
    x_q, x_sf = rq.per_token_cast(x, "e4m3", c)
    out, (dx_q, dx_sf), dx, dweight = quant_swiglu.swiglu_backward_and_per_token_cast(
        (x_q, x_sf), grad_out, weight, pos_to_token_topk, token_topk_to_pos, c, swiglu_clamp_value=clamp
    )
    hidden = x.shape[1] // 2
    values = rq.cast_back((x_q, x_sf), "fp32", (1, c)).double()
    g = values[:, :hidden].clone().requires_grad_(True)
    u = values[:, hidden:].clone().requires_grad_(True)
    index = pos_to_token_topk.to(torch.int64)
    w = torch.where(index >= 0, weight.double().reshape(-1)[index.clamp(min=0)], 0.0)[:, None]
    gc, uc = g, u
    if clamp is not None:
        c32 = float(np.float32(clamp))
        gc = torch.where(g > c32, torch.full_like(g, c32), g)
        uc = torch.where(u > c32, torch.full_like(u, c32), torch.where(u < -c32, torch.full_like(u, -c32), u))
    act = torch.nn.functional.silu(gc) * uc
    go = grad_out.double()
    (act * w * go).sum().backward()
    dg, du = g.grad, u.grad
    bf16 = 2.0**-8  # half an ulp of bf16, relative
    out64 = (act * w).detach()
    assert ((out.double() - out64).abs() <= bf16 * out64.abs() + 2**-20 * out64.abs() + 1e-30).all()
    scale = ((go * w).abs() * (uc.abs() + 1) * (gc.abs() + 1)).detach()  # size of the terms of dg and du
    for got, want in ((dx[:, :hidden], dg), (dx[:, hidden:], du)):
        assert ((got.double() - want).abs() <= bf16 * want.abs() + 2**-19 * scale + 1e-30).all()
    # dx quantized per token (row-major fp32 scales): within the e4m3 bound of the exact gradient
    check_scale_storage(dx_sf, x.shape[0], 2 * hidden // c, "row_major")
    want = torch.cat([dg, du], dim=1).numpy()
    sf_el = expand(decode_scales(dx_sf, 2 * hidden // c), 1, c, *want.shape)
    err = np.abs(decode_data(dx_q, "e4m3") * sf_el - want)
    bound = (
        np.maximum(2**-4 * np.abs(want), 2**-10 * sf_el) * (1 + 2**-18) + 2**-19 * torch.cat([scale, scale], 1).numpy()
    )
    assert (err <= bound + 1e-30).all()
    row_sums = (go * act.detach()).sum(dim=1)
    slots = token_topk_to_pos.to(torch.int64)
    want = torch.where(slots >= 0, row_sums[slots.clamp(min=0)], 0.0) if row_sums.numel() else torch.zeros_like(dweight)
    magnitude = (go.abs() * act.detach().abs()).sum(dim=1)
    tol = torch.where(slots >= 0, magnitude[slots.clamp(min=0)], 0.0) if row_sums.numel() else 0
    assert ((dweight.double() - want).abs() <= 2**-20 * tol + 1e-30).all()


# ---------------------------------------------------------------------------------------------
# MoE gating and routing
# ---------------------------------------------------------------------------------------------

INF = float("inf")
SCORE_VALUES = st.one_of(
    st.sampled_from([-INF, -1.0, -0.0, 0.0, 0.5, 1.0, 2.0, INF, float("nan")]),
    st.floats(width=32, allow_nan=False),
)


def rank_key(value: float, index: int) -> tuple:
    """The stable descending order of the contract: NaN first (by index), then larger, ties → smaller index."""
    return (0, 0.0, index) if math.isnan(value) else (1, -value, index)


@st.composite
def score_matrices(draw, values=SCORE_VALUES, max_tokens=6, max_experts=12):
    tokens, experts = draw(st.integers(0, max_tokens)), draw(st.integers(1, max_experts))
    flat = draw(st.lists(values, min_size=tokens * experts, max_size=tokens * experts))
    return torch.tensor(flat, dtype=torch.float32).reshape(tokens, experts)


@settings(max_examples=80, **DETERMINISTIC)
@given(score_matrices(), st.integers(1, 12))
def test_topk_gate_is_the_stable_descending_top_k(scores, k):
    """§2 topk_gate: "top-k indices, descending, ties → smaller index (a stable sort)"; moe.py: "−0.0 and
    +0.0 are equal (a tie). −inf is an ordinary value ... A NaN ranks above every number". Checked
    against Python's sort: every chosen score ranks before every unchosen one, in rank order."""
    k = min(k, scores.shape[1])
    idx = moe.topk_gate(scores, k)
    assert idx.dtype == torch.int64 and tuple(idx.shape) == (scores.shape[0], k) and idx.is_contiguous()
    for row, chosen in zip(scores.tolist(), idx.tolist(), strict=True):
        assert chosen == sorted(range(len(row)), key=lambda e, row=row: rank_key(row[e], e))[:k]


@st.composite
def grouped_scores(draw):
    groups, per_group = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    tokens = draw(st.integers(0, 5))
    values = st.one_of(st.integers(-3, 3).map(float), st.sampled_from([-INF, INF, -0.0]), st.floats(-4, 4, width=32))
    flat = draw(st.lists(values, min_size=tokens * groups * per_group, max_size=tokens * groups * per_group))
    scores = torch.tensor(flat, dtype=torch.float32).reshape(tokens, groups, per_group)
    return scores, draw(st.integers(1, min(2, per_group))), draw(st.integers(1, groups))


@settings(max_examples=60, **DETERMINISTIC)
@given(grouped_scores())
def test_topk_sum_and_topk_group_idx_ranks_groups_by_their_top_sums(case):
    """§2 topk_sum_and_topk_group_idx: "group score = sum of the group's top-1/top-2 scores; indices of
    the best groups in rank order" (moe.py: fl32(first + second), a repeated maximum counting twice;
    ties → smaller group index)."""
    scores, num_sum, num_groups = case
    idx = moe.topk_sum_and_topk_group_idx(scores, num_sum, num_groups)
    assert idx.dtype == torch.int64 and tuple(idx.shape) == (scores.shape[0], num_groups)
    for token, chosen in zip(scores.tolist(), idx.tolist(), strict=True):
        group_scores = []
        for group in token:
            best = sorted(group, reverse=True)[:num_sum]
            group_scores.append(float(f32(best[0] + best[1])) if num_sum == 2 else best[0])
        assert chosen == sorted(range(len(token)), key=lambda g, s=group_scores: rank_key(s[g], g))[:num_groups]


@settings(max_examples=60, **DETERMINISTIC)
@given(
    score_matrices(
        values=st.one_of(st.just(0.0), st.floats(0, 2.0**100, width=32), st.floats(0, 2.0**-100, width=32)),
        max_experts=9,
    )
)
def test_normalize_weight_rows_sum_to_one(weights):
    """§2 normalize_weight: "den = 1e-20 + Σ_k w" (moe.py: left to right from fp32(1e-20), then a true
    division): each row of w/den sums to S/(1e-20 + S) (1 unless S is tiny) within (k + 1) fp32 roundings,
    and a zero row gives zero weights, never NaN."""
    den, normalized = moe.normalize_weight(weights)
    assert den.dtype == normalized.dtype == torch.float32 and tuple(normalized.shape) == tuple(weights.shape)
    w = weights.numpy()
    expected_den = np.full(w.shape[0], np.float32(1e-20), dtype=np.float32)
    for j in range(w.shape[1]):
        expected_den = expected_den + w[:, j]
    assert np.array_equal(den.numpy(), expected_den)
    assert np.array_equal(normalized.numpy(), w / expected_den[:, None])
    total = w.astype(np.float64).sum(axis=1)
    want = total / (float(np.float32(1e-20)) + total)
    got = normalized.double().numpy().sum(axis=1)
    assert (np.abs(got - want) <= (w.shape[1] + 2) * 2.0**-24 * want + 1e-45).all()
    assert not torch.isnan(normalized).any()


@st.composite
def index_matrices(draw, low=-1):
    tokens, topk, high = draw(st.integers(0, 8)), draw(st.integers(1, 5)), draw(st.integers(1, 9))
    flat = draw(st.lists(st.integers(low, high - 1), min_size=tokens * topk, max_size=tokens * topk))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    return torch.tensor(flat, dtype=dtype).reshape(tokens, topk), high


@settings(max_examples=60, **DETERMINISTIC)
@given(index_matrices(), st.integers(1, 4))
def test_group_count_and_aux_fi_count_the_valid_slots(case, num_aux_topk):
    """§2 group_count: "histogram, negatives ignored" (int32 [G]); aux_fi: "count_e · E / (T ·
    num_aux_topk), −1 ignored" (fp32 [E]; moe.py: exact products, one division, zeros for T = 0)."""
    idx, high = case
    counts = [sum(v == e for v in idx.flatten().tolist()) for e in range(high)]
    histogram = moe.group_count(idx, high)
    assert histogram.dtype == torch.int32 and histogram.tolist() == counts
    fi = moe.aux_fi(idx, high, num_aux_topk)
    assert fi.dtype == torch.float32 and tuple(fi.shape) == (high,)
    tokens = idx.shape[0]
    want = [float(f32(c * high / (tokens * num_aux_topk))) if tokens else 0.0 for c in counts]
    assert fi.tolist() == want


@settings(max_examples=60, **DETERMINISTIC)
@given(index_matrices(low=-3))
def test_inplace_unique_group_indices_keeps_first_occurrences(case):
    """§2 inplace_unique_group_indices: "per row, repeats after the first occurrence become −1" (moe.py:
    in place; negative entries are padding and stay as they are)."""
    idx, high = case
    expected = []
    for row in idx.tolist():
        seen, out = set(), []
        for v in row:
            out.append(-1 if v >= 0 and v in seen else v)
            seen.add(v)
        expected.append(out)
    result = moe.inplace_unique_group_indices(idx, high)
    assert result is idx and idx.tolist() == expected


@st.composite
def tp_cases(draw):
    per_rank, num_ep = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    num_tp = draw(st.integers(1, num_ep + 1))
    n = per_rank * num_ep
    tokens, topk = draw(st.integers(0, 6)), draw(st.integers(1, 4))
    flat = draw(st.lists(st.integers(-1, n - 1), min_size=tokens * topk, max_size=tokens * topk))
    return torch.tensor(flat, dtype=torch.int64).reshape(tokens, topk), n, num_ep, num_tp


@settings(max_examples=60, **DETERMINISTIC)
@given(tp_cases())
def test_mask_indices_by_tp_partitions_the_experts_between_tp_ranks(case):
    """§2 mask_indices_by_tp: "keep indices owned by this tensor-parallel rank, re-indexed; others −1":
    every expert is kept by exactly one tp rank, the local numbering of a rank is one-to-one and lies in
    [0, ceil(num_ep_ranks / num_tp_ranks) · per_rank), and it maps back to the global expert
    (e = (dp · num_tp_ranks + tp) · per_rank + j for local dp · per_rank + j)."""
    idx, n, num_ep, num_tp = case
    per_rank = n // num_ep
    kept_by = torch.zeros_like(idx)
    for tp in range(num_tp):
        local = moe.mask_indices_by_tp(idx, n, num_ep, tp, num_tp)
        assert local.dtype == idx.dtype and local.shape == idx.shape
        kept = local >= 0
        kept_by += kept.to(idx.dtype)
        assert (local[kept] < ceil_div(num_ep, num_tp) * per_rank).all()
        dp, j = local[kept] // per_rank, local[kept] % per_rank
        assert torch.equal((dp * num_tp + tp) * per_rank + j, idx[kept])
        assert (local[~kept] == -1).all()
    assert torch.equal(kept_by, (idx >= 0).to(idx.dtype)), "every expert must be kept by exactly one tp rank"


@st.composite
def router_cases(draw, exact: bool):
    groups = draw(st.sampled_from([0, 1, 2, 4]))
    kept_groups = draw(st.integers(1, groups)) if groups else 0
    # Group limiting ranks groups by their top-2 sums: it needs two experts per group (one expert per
    # group is refused, with a ValueError naming topk_sum_and_topk_group_idx's num_topk_sum).
    per_group = draw(st.integers(2 if groups != kept_groups else 1, 4))
    experts = max(groups, 1) * per_group * draw(st.integers(1, 2))
    reachable = kept_groups * (experts // groups) if groups and kept_groups != groups else experts
    topk = draw(st.integers(1, min(reachable, 6)))
    tokens = draw(st.integers(0, 6))
    if exact:  # small dyadic values: logits + bias exact in fp32, many ties
        logits = draw(st.lists(st.integers(-4, 4).map(float), min_size=tokens * experts, max_size=tokens * experts))
        bias = draw(st.lists(st.integers(-8, 8).map(lambda v: v / 4), min_size=experts, max_size=experts))
    else:
        value = st.one_of(st.floats(-12, 12, width=32), st.floats(-40, 40, width=32))
        logits = draw(st.lists(value, min_size=tokens * experts, max_size=tokens * experts))
        bias = draw(st.lists(st.floats(-1, 1, width=32), min_size=experts, max_size=experts))
    logits = torch.tensor(logits, dtype=torch.float32).reshape(tokens, experts)
    factor = draw(st.sampled_from([1.0, 2.5, 0.7]))
    return logits, torch.tensor(bias, dtype=torch.float32), topk, kept_groups, groups, factor


def route(logits, bias, topk, kept_groups, groups, factor, scoring, **kwargs):
    options = {"ep_rank": 0, "num_ep_ranks": 1, "tp_rank": 0, "num_tp_ranks": 1, **kwargs}
    return moe.top2_sum_gate(
        logits,
        bias,
        topk,
        kept_groups,
        groups,
        False,
        0,
        factor,
        options.pop("ep_rank"),
        options.pop("num_ep_ranks"),
        options.pop("tp_rank"),
        options.pop("num_tp_ranks"),
        scoring,
        **options,
    )


def scores64(logits: np.ndarray, scoring: str) -> np.ndarray:
    if scoring == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    if scoring == "sqrtsoftplus":
        return np.sqrt(np.where(logits > 20, logits, np.log1p(np.exp(np.minimum(logits, 20)))))
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def check_weights(idx, weights, logits, scoring, factor):
    """weights = s_idx / (1e-20 + Σ s_idx) · routed_scaling_factor, from the unbiased scores."""
    s = scores64(logits.double().numpy(), scoring) if logits.numel() else np.zeros(logits.shape)
    chosen = np.take_along_axis(s, idx.numpy(), axis=1)
    want = chosen / (1e-20 + chosen.sum(axis=1, keepdims=True)) * float(np.float32(factor))
    assert (np.abs(weights.double().numpy() - want) <= 2.0**-18 * want + 1e-38).all()


@settings(max_examples=60, **DETERMINISTIC)
@given(router_cases(exact=True), st.integers(-30, 30))
def test_top2_sum_gate_softmax_routing_and_shift_invariance(case, shift):
    """§2 top2_sum_gate: "ranking score s + bias (softmax: logits + bias); optional group limiting by
    top-2 group sums; stable top-k; weights s_idx / (1e-20 + Σ s_idx) · routed_scaling_factor". With
    exact (small dyadic) logits the choice is checked against Python's sort, group limiting included;
    and softmax routing is invariant under adding a constant to a token's logits: same indices, same
    weight bits (softmax subtracts the row maximum first)."""
    logits, bias, topk, kept_groups, groups, factor = case
    idx, weights = route(logits, bias, topk, kept_groups, groups, factor, "softmax")
    assert idx.dtype == torch.int64 and weights.dtype == torch.float32
    assert tuple(idx.shape) == tuple(weights.shape) == (logits.shape[0], topk)
    experts = logits.shape[1]
    for row, chosen in zip((logits + bias).tolist(), idx.tolist(), strict=True):
        allowed = list(range(experts))
        if groups and kept_groups != groups:
            size = experts // groups
            sums = [sum(sorted(row[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(groups)]
            best = sorted(range(groups), key=lambda g, sums=sums: rank_key(sums[g], g))[:kept_groups]
            allowed = [e for e in allowed if e // size in best]
        assert chosen == sorted(allowed, key=lambda e, row=row: rank_key(row[e], e))[:topk]
    check_weights(idx, weights, logits, "softmax", factor)
    shifted_idx, shifted_weights = route(logits + shift, bias, topk, kept_groups, groups, factor, "softmax")
    assert torch.equal(shifted_idx, idx)
    assert_same_bits(shifted_weights, weights)


@settings(max_examples=60, **DETERMINISTIC)
@given(router_cases(exact=False), st.sampled_from(["sigmoid", "sqrtsoftplus"]))
def test_top2_sum_gate_sigmoid_routing_picks_the_best_ranking_scores(case, scoring):
    """§2 top2_sum_gate with "scores s = sigmoid / sqrt(softplus) (softplus(x) = x if x>20)": the k
    chosen experts are distinct, lie in at most num_topk_groups groups, each among the groups with the
    best top-2 sums of s + bias, every chosen s + bias is at least every unchosen one of those groups
    (up to the fp32 rounding of s), and the weights are the normalized unbiased scores times the
    scaling factor."""
    logits, bias, topk, kept_groups, groups, factor = case
    idx, weights = route(logits, bias, topk, kept_groups, groups, factor, scoring)
    experts = logits.shape[1]
    ranking = scores64(logits.double().numpy(), scoring) + bias.double().numpy() if logits.numel() else None
    for t, chosen in enumerate(idx.tolist()):
        assert len(set(chosen)) == topk
        allowed = set(range(experts))
        if groups and kept_groups != groups:
            size = experts // groups
            used = {e // size for e in chosen}
            assert len(used) <= kept_groups
            top2 = np.sort(ranking[t].reshape(groups, size), axis=1)[:, -2:].sum(axis=1)
            for g in used:  # a used group is among the num_topk_groups best top-2 sums
                assert (top2 > top2[g] + 1e-6).sum() < kept_groups
            allowed = {e for e in allowed if e // size in used}
        worst_chosen = min(ranking[t, e] for e in chosen)
        others = [ranking[t, e] for e in allowed - set(chosen)]
        assert not others or worst_chosen >= max(others) - 1e-6
    check_weights(idx, weights, logits, scoring, factor)


@st.composite
def masked_router_cases(draw):
    logits, bias, topk, kept_groups, groups, factor = draw(router_cases(exact=False))
    tokens, experts = logits.shape
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=tokens, max_size=tokens)), dtype=torch.bool)
    divisors = [d for d in range(1, experts + 1) if experts % d == 0]
    num_ep = draw(st.sampled_from(divisors))
    num_tp = draw(st.integers(1, num_ep))
    ranks = (draw(st.integers(0, num_ep - 1)), num_ep, draw(st.integers(0, num_tp - 1)), num_tp)
    return logits, bias, topk, kept_groups, groups, factor, mask, ranks, draw(st.sampled_from(["sigmoid", "softmax"]))


@settings(max_examples=50, **DETERMINISTIC)
@given(masked_router_cases())
def test_top2_sum_gate_mask_and_parallel_reindexing_are_per_token_and_per_slot(case):
    """§2 top2_sum_gate: "masked tokens get idx −1, weight 0" (moe.py: their logits are not read, so NaN
    there changes nothing) and the other tokens route as without a mask; unmapped_topk_idx receives the
    logical choice (−1 for a masked token); "expert-parallel/tensor-parallel re-indexing (−1 for experts
    not on this rank)" is mask_indices_by_tp of the single-rank indices, with the weights kept."""
    logits, bias, topk, kept_groups, groups, factor, mask, (ep_rank, num_ep, tp_rank, num_tp), scoring = case
    poisoned = logits.clone()
    poisoned[~mask] = float("nan")
    unmapped = torch.full((logits.shape[0], topk), 12345, dtype=torch.int64)
    idx, weights = route(
        poisoned, bias, topk, kept_groups, groups, factor, scoring, mask=mask, unmapped_topk_idx=unmapped
    )
    free_idx, free_weights = route(logits, bias, topk, kept_groups, groups, factor, scoring)
    assert (idx[~mask] == -1).all() and (weights[~mask] == 0).all()
    assert torch.equal(idx[mask], free_idx[mask]) and torch.equal(weights[mask], free_weights[mask])
    assert torch.equal(unmapped, torch.where(mask[:, None], free_idx, -1))
    ranks = {"ep_rank": ep_rank, "num_ep_ranks": num_ep, "tp_rank": tp_rank, "num_tp_ranks": num_tp}
    local_idx, local_weights = route(logits, bias, topk, kept_groups, groups, factor, scoring, **ranks)
    assert torch.equal(local_idx, moe.mask_indices_by_tp(free_idx, logits.shape[1], num_ep, tp_rank, num_tp))
    assert_same_bits(local_weights, free_weights)


@st.composite
def mapping_cases(draw):
    idx, experts = draw(index_matrices())
    alignment = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 128]))
    mode = draw(st.sampled_from(["sync", "no_sync", "bound"]))
    return idx, experts, alignment, mode, draw(st.integers(0, 40))


@settings(max_examples=80, **DETERMINISTIC)
@given(mapping_cases())
def test_get_fused_mapping_is_a_valid_inverse_mapping(case):
    """§2 get_fused_mapping: "expert e owns [start_e, start_e + align(count_e, alignment)), padding slots
    −1; token_topk_to_pos[t,j] is where (t, j) landed (−1 for idx −1). Order inside a segment is by
    token": every valid (t, j) slot appears exactly once, the three position arrays invert
    token_topk_to_pos, segments are consecutive, aligned and filled from their start in flat order."""
    idx, experts, alignment, mode, extra = case
    tokens, topk = idx.shape
    counts = [int((idx == e).sum()) for e in range(experts)]
    sizes = [ceil_div(c, alignment) * alignment for c in counts]
    used = sum(sizes)
    requested = {"sync": 0, "no_sync": 0, "bound": used + extra}[mode]
    if mode == "bound" and requested == 0:
        requested = alignment  # 0 would mean "sync"
    result = moe.get_fused_mapping(idx, experts, requested, alignment, force_no_sync=mode == "no_sync")
    pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos, start, end, per_expert, per_expert_list = result
    for tensor in result[:7]:
        assert tensor.dtype == torch.int32
    positions = pos_to_expert.shape[0]
    if mode == "sync":
        assert positions == used and per_expert_list == sizes
    else:
        assert positions >= used and per_expert_list == []
    assert pos_to_token.shape == pos_to_token_topk.shape == (positions,)
    assert token_topk_to_pos.shape == idx.shape
    assert start.tolist() == [sum(sizes[:e]) for e in range(experts)]
    assert end.tolist() == [sum(sizes[: e + 1]) for e in range(experts)] and per_expert.tolist() == sizes
    hit = torch.zeros(positions, dtype=torch.bool)
    flat_idx = idx.reshape(-1).tolist()
    landing = token_topk_to_pos.reshape(-1).tolist()
    next_free = list(start.tolist())
    for slot, (e, p) in enumerate(zip(flat_idx, landing, strict=True)):
        if e < 0:
            assert p == -1
            continue
        assert p == next_free[e], "a segment is filled from its start, in flat (token, slot) order"
        next_free[e] += 1
        assert not hit[p], "two slots landed on one position"
        hit[p] = True
        assert (pos_to_expert[p], pos_to_token[p], pos_to_token_topk[p]) == (e, slot // topk, slot)
    for name, tensor in (("expert", pos_to_expert), ("token", pos_to_token), ("slot", pos_to_token_topk)):
        assert (tensor[~hit] == -1).all(), f"padding positions must be −1 in pos_to_{name}"


@st.composite
def expand_cases(draw):
    idx, experts, alignment, mode, _ = draw(mapping_cases())
    hidden = draw(st.integers(0, 12))
    x = draw_matrix(draw, idx.shape[0], hidden, torch.bfloat16, specials=False, magnitude=st.integers(-20, 20))
    weights = torch.rand(idx.shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1))))
    return idx, experts, alignment, mode == "no_sync", x.contiguous(), weights, draw(st.booleans())


@settings(max_examples=50, **DETERMINISTIC)
@given(expand_cases())
def test_expand_to_fused_and_reduce_fused_gather_and_combine(case):
    """§2 expand_to_fused: "gather each token's row to all of its expert slots (padding rows zero), scales
    too"; reduce_fused: "out[t] = Σ_j x[pos(t,j)] · w[t,j] in fp32". Without weights the round trip is
    count_t · x[t] rounded once (the fp32 sum of a few copies of a bf16 value is exact); with weights it
    is within fp32 accumulation error of the float64 sum."""
    idx, experts, alignment, no_sync, x, weights, col_major = case
    pos_to_expert, pos_to_token, _, token_topk_to_pos, *_ = moe.get_fused_mapping(
        idx, experts, 0, alignment, force_no_sync=no_sync
    )
    expanded = moe.expand_to_fused(x, token_topk_to_pos, pos_to_expert)
    assert expanded.dtype == x.dtype and tuple(expanded.shape) == (pos_to_expert.shape[0], x.shape[1])
    source = pos_to_token.to(torch.int64)
    valid = source >= 0
    assert_same_bits(expanded[valid], x[source[valid]])
    assert (bits(expanded[~valid]) == 0).all()

    count = (token_topk_to_pos >= 0).sum(dim=1, keepdim=True).double()
    # the sum starts from acc = +0.0 (moe.py), so a token without slots, or a −0 row, gives +0
    summed = (count * x.double() + 0.0).to(torch.bfloat16)
    assert_same_bits(moe.reduce_fused(expanded, None, token_topk_to_pos), summed)
    x32 = expanded.float()
    combined = moe.reduce_fused(x32, weights, token_topk_to_pos)
    w = torch.where(token_topk_to_pos >= 0, weights, 0.0).double()
    want = w.sum(dim=1, keepdim=True) * x.double()
    assert ((combined.double() - want).abs() <= idx.shape[1] * 2.0**-23 * want.abs() + 1e-38).all()

    sf = torch.rand(x.shape[0], 3) + 0.5
    out, out_sf = moe.expand_to_fused_with_sf((x, sf), 32, token_topk_to_pos, pos_to_expert, col_major)
    assert_same_bits(out, expanded)
    assert tuple(out_sf.shape) == (pos_to_expert.shape[0], 3)
    if col_major and out_sf.numel():
        assert out_sf.stride() == (1, align4(pos_to_expert.shape[0]))
    assert_same_bits(out_sf[valid], sf[source[valid]])
    assert (out_sf[~valid] == 0).all()


# ---------------------------------------------------------------------------------------------
# Transpose
# ---------------------------------------------------------------------------------------------

TRANSPOSE_DTYPES = [
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
SIZES = st.one_of(st.integers(0, 9), st.sampled_from([31, 63, 64, 65, 127, 129]))


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaN payloads, −0, every FP8 code) of ``dtype``; bool holds 0/1 bytes."""
    out = torch.empty(shape, dtype=dtype)
    if out.numel():
        generator = torch.Generator().manual_seed(seed)
        raw = out.view(torch.uint8) if dtype != torch.bool else out
        high = 2 if dtype == torch.bool else 256
        raw.copy_(torch.randint(0, high, raw.shape, generator=generator, dtype=torch.uint8).to(raw.dtype))
    return out


@st.composite
def matrices_of_any_dtype(draw, batched: bool):
    dtype = draw(st.sampled_from(TRANSPOSE_DTYPES))
    batch = draw(st.integers(0, 3)) if batched else None
    rows, columns, padding = draw(SIZES), draw(SIZES), draw(st.sampled_from([0, 0, 1, 3, 64]))
    seed = draw(st.integers(0, 2**32 - 1))
    if batched:
        extra_rows = draw(st.integers(0, 2))  # a batch stride larger than one matrix
        buffer = random_bytes((batch, rows + extra_rows, columns + padding), dtype, seed)
        return buffer[:, :rows, :columns]
    return random_bytes((rows, columns + padding), dtype, seed)[:, :columns]


@settings(max_examples=80, **DETERMINISTIC)
@given(matrices_of_any_dtype(batched=False))
def test_transpose_moves_bytes_and_twice_is_identity(x):
    """§3 transpose: "(x [M,N]) -> [N,M] ... any dtype incl. FP8; row stride may exceed N; must handle any
    M, N (tails)"; transpose.py: "bit-for-bit the input (NaN payloads, signed zeros and FP8 codes
    included)", a fresh contiguous tensor that never aliases the input. Transposing twice gives back
    the input's bytes."""
    out = transpose.transpose(x)
    rows, columns = x.shape
    assert out.dtype == x.dtype and tuple(out.shape) == (columns, rows) and out.is_contiguous()
    if x.numel():
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    size = x.element_size()
    assert torch.equal(
        bits(out).reshape(columns, rows, size), bits(x).reshape(rows, columns, size).transpose(0, 1).contiguous()
    )
    assert_same_bits(transpose.transpose(out), x)


@settings(max_examples=40, **DETERMINISTIC)
@given(matrices_of_any_dtype(batched=True))
def test_batched_transpose_is_transpose_of_each_matrix(x):
    """§3 batched_transpose: "(x [B,M,N]) -> [B,N,M]" with a free batch stride: every matrix of the batch
    transposed on its own, bit for bit, the result contiguous."""
    out = transpose.batched_transpose(x)
    batch, rows, columns = x.shape
    assert out.dtype == x.dtype and tuple(out.shape) == (batch, columns, rows) and out.is_contiguous()
    for b in range(batch):
        assert_same_bits(out[b], transpose.transpose(x[b]))
    assert_same_bits(transpose.batched_transpose(out), x)


# ---------------------------------------------------------------------------------------------
# mHC
# ---------------------------------------------------------------------------------------------


def seeded(draw) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))


@st.composite
def sinkhorn_cases(draw):
    tokens, n = draw(st.integers(0, 4)), draw(st.integers(1, 8))
    bound = draw(st.sampled_from([0.5, 1.0, 4.0, 8.0]))
    logits = (torch.rand(tokens, n, n, generator=seeded(draw)) * 2 - 1) * bound
    return logits, draw(st.integers(10, 25)), draw(st.sampled_from([0.0, 1e-6, 1e-4])), bound


@settings(max_examples=40, **DETERMINISTIC)
@given(sinkhorn_cases())
def test_sinkhorn_makes_rows_and_columns_sum_to_one(case):
    """§5 sinkhorn_normalize: "P = softmax(comb, over o) + eps; P /= (Σ_i P + eps); then repeat−1 times:
    row-normalize, column-normalize": the result is non-negative, its columns sum to 1 up to eps (the
    last step) whatever the logits, its rows too after enough iterations (logits in [−1, 1], 10 or more),
    and the row error never grows from one iteration count to the next (Sinkhorn's L1 error is monotone)."""
    logits, repeat, eps, bound = case
    p = mhc.sinkhorn_normalize(logits, repeat=repeat, eps=eps)
    n = logits.shape[1]
    assert p.dtype == torch.float32 and p.shape == logits.shape and p.is_contiguous()
    assert torch.isfinite(p).all() and (p >= 0).all()
    p64 = p.double()
    columns, rows = p64.sum(dim=-2), p64.sum(dim=-1)
    assert ((columns - 1).abs() <= n * 2.0**-22 + 2 * eps).all()
    if bound <= 1:  # wider logits converge more slowly
        assert ((rows - 1).abs() <= 1e-3 + n * eps).all()
    row_error = (mhc.sinkhorn_normalize(logits, repeat=repeat + 1, eps=eps).double().sum(-1) - 1).abs().sum(-1)
    assert (row_error <= (rows - 1).abs().sum(-1) + n * 2.0**-20).all()


@settings(max_examples=30, **DETERMINISTIC)
@given(sinkhorn_cases(), st.integers(0, 2**32 - 1))
def test_sinkhorn_backward_annihilates_the_invariant_directions(case, seed):
    """§5 sinkhorn_normalize: "softmax(comb, over o)" is invariant to adding a constant to a source row
    i, so the backward's Σ_o dL[i, o] is 0 for any output gradient, and the forward barely moves; and the
    column sums are 1 up to eps whatever the logits, so an output gradient constant down each column
    (g[i, o] = c_o) has a gradient ≈ 0 ("exact backward through every iteration")."""
    logits, repeat, eps, _ = case
    generator = torch.Generator().manual_seed(seed)
    tokens, n, _ = logits.shape
    shifted = logits + torch.randint(-8, 9, (tokens, n, 1), generator=generator).float()
    p = mhc.sinkhorn_normalize(logits, repeat, eps)
    assert ((mhc.sinkhorn_normalize(shifted, repeat, eps) - p).abs() <= 2e-5).all()
    grad = torch.randn(tokens, n, n, generator=generator)
    d_logits = mhc.sinkhorn_normalize_bwd(grad, logits, repeat, eps)
    assert d_logits.shape == logits.shape and d_logits.dtype == torch.float32
    assert (d_logits.double().sum(-1).abs() <= 1e-6 * (1 + grad.abs().amax(dim=(1, 2))[:, None])).all()
    per_column = torch.randn(tokens, 1, n, generator=generator).expand(tokens, n, n).contiguous()
    d_flat = mhc.sinkhorn_normalize_bwd(per_column, logits, repeat, eps)
    assert (d_flat.abs() <= 1e-6 * (1 + per_column.abs().amax(dim=(1, 2), keepdim=True))).all()


@st.composite
def split_cases(draw):
    tokens, n = draw(st.integers(0, 5)), draw(st.integers(1, 4))
    generator = seeded(draw)
    mixes = torch.randn(tokens, n * n + 2 * n, generator=generator) * 2 ** draw(st.integers(-4, 6))
    scale = torch.randn(3, generator=generator)
    base = torch.randn(n * n + 2 * n, generator=generator)
    return mixes, scale, base, n, draw(st.sampled_from([0.0, 1.0, 2.0])), draw(st.sampled_from([0.0, 1e-6, 0.5]))


@settings(max_examples=40, **DETERMINISTIC)
@given(split_cases(), st.integers(0, 2**20))
def test_split_mixes_ranges_and_column_order(case, column):
    """§5 mhc_pre_split_mixes: "pre = σ(s0·m[:n] + b[:n]) + pre_eps, post = post_mult·σ(s1·m[n:2n] +
    b[n:2n]), comb = s2·m[2n:] + b[2n:] viewed [n,n]" with "Mixes order: [pre n | post n | comb n²],
    comb row-major": pre lies in [pre_eps, 1 + pre_eps], post in [0, post_mult], and changing one
    column of the mixes changes exactly the output it feeds; mhc_head_compute_mix is σ(s·m + b) + eps."""
    mixes, scale, base, n, post_mult, pre_eps = case
    pre, post, comb = mhc.mhc_pre_split_mixes(mixes, scale, base, n, post_mult, pre_eps)
    tokens = mixes.shape[0]
    assert pre.shape == post.shape == (tokens, n) and comb.shape == (tokens, n, n)
    assert ((pre >= pre_eps) & (pre <= 1 + pre_eps)).all() and ((post >= 0) & (post <= post_mult)).all()
    column %= n * n + 2 * n
    bumped = mixes.clone()
    bumped[:, column] += 1.0
    outputs = torch.cat([pre, post, comb.flatten(1)], dim=1)
    changed = torch.cat(
        [t.flatten(1) for t in mhc.mhc_pre_split_mixes(bumped, scale, base, n, post_mult, pre_eps)], dim=1
    )
    others = torch.ones(n * n + 2 * n, dtype=torch.bool)
    others[column] = False
    assert torch.equal(changed[:, others], outputs[:, others]), "one mix column feeds one output"
    head = mhc.mhc_head_compute_mix(mixes[:, :n].contiguous(), scale[:1].contiguous(), base[:n].contiguous(), pre_eps)
    assert ((head >= pre_eps) & (head <= 1 + pre_eps)).all() and head.shape == (tokens, n)


@st.composite
def stream_cases(draw):
    tokens, n, hidden = draw(st.integers(0, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 24))
    residual = draw_matrix(draw, tokens * n, hidden, torch.bfloat16, specials=False, magnitude=st.integers(-30, 30))
    y = draw_matrix(draw, tokens, hidden, torch.bfloat16, specials=False, magnitude=st.integers(-30, 30))
    perms = [draw(st.permutations(range(n))) for _ in range(tokens)]
    sources = [draw(st.integers(0, n - 1)) for _ in range(tokens)]
    total = 2 ** draw(st.integers(0, 8))  # n dyadic weights k_i / 2^m summing to 1
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=n - 1, max_size=n - 1)))
    parts = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    return residual.reshape(tokens, n, hidden).contiguous(), y.contiguous(), perms, sources, parts


@settings(max_examples=40, **DETERMINISTIC)
@given(stream_cases())
def test_mhc_apply_post_and_expand_follow_their_index_conventions(case):
    """§5: mhc_pre_apply_mix "layer_in[c] = Σ_i pre_i · X[i,c] (fp32 math, bf16 out)"; mhc_post
    "X'[o,c] = post_o · y[c] + Σ_i comb[i,o] · X[i,c] (note: comb transposed)"; expand_to_mhc "X[t,i] = h[t]
    for every stream; backward sums streams (fp32 accumulate)". Exact cases: a one-hot pre picks one
    stream; dyadic weights summing to 1 give h back from expand_to_mhc(h); a permutation comb moves
    stream i to stream o = π(i); a one-hot post writes y into one stream; the expand backward is n·h
    rounded once."""
    residual, y, perms, sources, parts = case
    tokens, n, hidden = residual.shape
    one_hot = torch.zeros(tokens, n)
    one_hot[torch.arange(tokens), torch.tensor(sources, dtype=torch.int64)] = 1.0
    picked = mhc.mhc_pre_apply_mix(residual, one_hot)
    assert_same_bits(picked, residual[torch.arange(tokens), torch.tensor(sources, dtype=torch.int64)])
    expanded = mhc.expand_to_mhc(y, n)
    assert expanded.shape == (tokens, n, hidden) and all(torch.equal(expanded[:, i], y) for i in range(n))
    weights = torch.tensor(parts, dtype=torch.float32) / sum(parts)  # dyadic: every product and sum exact
    assert_same_bits(mhc.mhc_pre_apply_mix(expanded, weights.expand(tokens, n).contiguous()), y)
    assert_same_bits(mhc.expand_to_mhc_bwd(expanded), (n * y.double()).to(torch.bfloat16))

    comb = torch.zeros(tokens, n, n)
    for t, perm in enumerate(perms):
        comb[t, torch.arange(n), torch.tensor(perm)] = 1.0  # comb[i, π(i)] = 1
    moved = mhc.mhc_post(y, residual, torch.zeros(tokens, n), comb)
    for t, perm in enumerate(perms):
        for i in range(n):
            assert_same_bits(moved[t, perm[i]], residual[t, i])
    written = mhc.mhc_post(y, residual, one_hot, torch.zeros(tokens, n, n))
    for t, o in enumerate(sources):
        assert_same_bits(written[t, o], y[t])
        assert (bits(written[t, torch.arange(n) != o]) == 0).all()


@st.composite
def norm_cases(draw):
    tokens, n, hidden = draw(st.integers(0, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 16))
    generator = seeded(draw)
    residual = (torch.randn(tokens, n, hidden, generator=generator) * 4).to(torch.bfloat16)
    fn = torch.randn(n * n + 2 * n, n * hidden, generator=generator)
    weight = torch.rand(n * hidden, generator=generator) + 0.5 if draw(st.booleans()) else None
    return residual, fn, weight, draw(st.integers(-20, 20))


@settings(max_examples=30, **DETERMINISTIC)
@given(norm_cases())
def test_mhc_pre_norm_fn_is_invariant_to_a_power_of_two_scale(case):
    """§5 mhc_pre_norm_fn: "mixes = (x @ fnᵀ) · rsqrt(Σx²/(nC) + eps)": with eps = 0 an RMS-normalized
    projection, so scaling the streams by 2^j (exact in bf16, exact through every product and sum)
    leaves the mixes unchanged bit for bit; with eps > 0 the mixes only shrink toward 0 in magnitude."""
    residual, fn, weight, shift = case
    mixes = mhc.mhc_pre_norm_fn(residual, fn, weight, 0.0)
    scaled = (residual.double() * 2.0**shift).to(torch.bfloat16)
    assert torch.equal(scaled.double(), residual.double() * 2.0**shift)
    assert mixes.shape == (residual.shape[0], fn.shape[0]) and mixes.dtype == torch.float32
    nonzero = residual.flatten(1).abs().amax(dim=1) > 0
    assert_same_bits(mhc.mhc_pre_norm_fn(scaled, fn, weight, 0.0)[nonzero], mixes[nonzero])
    damped = mhc.mhc_pre_norm_fn(residual, fn, weight, 1e-2)
    assert (damped.abs() <= mixes.abs() * (1 + 2.0**-20) + 1e-30).all()


@st.composite
def big_fuse_cases(draw):
    residual, fn, weight, _ = draw(norm_cases())
    n = residual.shape[1]
    generator = seeded(draw)
    scale = torch.rand(3, generator=generator)
    base = torch.randn(n * n + 2 * n, generator=generator)
    return residual, fn, weight, scale, base, draw(st.integers(1, 20)), draw(st.sampled_from([0.0, 1e-6]))


@settings(max_examples=25, **DETERMINISTIC)
@given(big_fuse_cases())
def test_mhc_pre_big_fuse_is_the_four_steps(case):
    """§5 mhc_pre_big_fuse: "inference-only: norm + split + Sinkhorn + apply fused, one pass per token"
    (mhc.py: "defined as those four steps run one by one (bit for bit), the norm weight included"):
    post in [0, post_mult], comb columns summing to 1, and the bytes of the unfused pipeline."""
    residual, fn, weight, scale, base, repeat, eps = case
    n = residual.shape[1]
    post, comb, layer_input = mhc.mhc_pre_big_fuse(
        residual, fn, scale, base, 1e-6, 1e-6, eps, 2.0, repeat, mhc_norm_weight=weight
    )
    mixes = mhc.mhc_pre_norm_fn(residual, fn, weight, 1e-6)
    pre_u, post_u, logits = mhc.mhc_pre_split_mixes(mixes, scale, base, n, 2.0, 1e-6)
    assert_same_bits(post, post_u)
    assert_same_bits(comb, mhc.sinkhorn_normalize(logits, repeat, eps))
    assert_same_bits(layer_input, mhc.mhc_pre_apply_mix(residual, pre_u))
    assert ((post >= 0) & (post <= 2.0)).all()
    assert ((comb.double().sum(dim=-2) - 1).abs() <= n * 2.0**-22 + 2 * eps).all()


@st.composite
def multilayer_cases(draw):
    tokens, n, hidden = draw(st.integers(0, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 12))
    layers = draw(st.integers(1, 4))
    posts = draw(st.sampled_from([layers - 1, layers]))
    generator = seeded(draw)
    initial = (torch.randn(tokens, n, hidden, generator=generator)).to(torch.bfloat16)
    pre = [torch.rand(tokens, n, generator=generator) for _ in range(layers)]
    outputs = [torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16) for _ in range(posts)]
    post = [torch.rand(tokens, n, generator=generator) * 2 for _ in range(posts)]
    comb = [mhc.sinkhorn_normalize(torch.randn(tokens, n, n, generator=generator)) for _ in range(posts)]
    return initial, pre, outputs, post, comb


@settings(max_examples=25, **DETERMINISTIC)
@given(multilayer_cases())
def test_mhc_multilayer_recompute_replays_the_layers_bit_for_bit(case):
    """§5 mhc_multilayer_recompute: "recompute layer inputs and residuals of L consecutive layers from the
    first residual (activation recomputation), bit-identical to running the layers one by one" (with
    L or L − 1 posts)."""
    initial, pre, outputs, post, comb = case
    layer_inputs = [torch.full_like(outputs[0] if outputs else initial[:, 0], 7.0) for _ in pre]
    residuals = [torch.full_like(initial, 7.0) for _ in outputs]
    mhc.mhc_multilayer_recompute(initial, pre, outputs, post, comb, layer_inputs, residuals)
    stream = initial
    for layer in range(len(pre)):
        assert_same_bits(layer_inputs[layer], mhc.mhc_pre_apply_mix(stream, pre[layer]))
        if layer < len(outputs):
            stream = mhc.mhc_post(outputs[layer], stream, post[layer], comb[layer])
            assert_same_bits(residuals[layer], stream)


# ---------------------------------------------------------------------------------------------
# Engram
# ---------------------------------------------------------------------------------------------


def wrap64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


@st.composite
def hash_cases(draw):
    tokens, max_ngram = draw(st.integers(0, 5)), draw(st.integers(2, 4))
    layers, tables = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    ids = draw(st.lists(st.integers(0, 2**31 - 1), min_size=tokens * max_ngram, max_size=tokens * max_ngram))
    multipliers = draw(
        st.lists(
            st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**20)),
            min_size=layers * max_ngram,
            max_size=layers * max_ngram,
        )
    )
    count = layers * (max_ngram - 1) * tables
    vocab = draw(st.lists(st.one_of(st.integers(1, 7), st.integers(1, 2**24)), min_size=count, max_size=count))
    offsets = draw(st.lists(st.integers(0, 2**30), min_size=count, max_size=count))
    return (
        torch.tensor(ids, dtype=torch.int32).reshape(tokens, max_ngram),
        torch.tensor(multipliers, dtype=torch.int64).reshape(layers, max_ngram),
        torch.tensor(vocab, dtype=torch.int32).reshape(layers, max_ngram - 1, tables),
        torch.tensor(offsets, dtype=torch.int32).reshape(layers, (max_ngram - 1) * tables),
    )


@settings(max_examples=50, **DETERMINISTIC)
@given(hash_cases())
def test_engram_hash_is_the_wrapped_xor_hash_in_its_table(case):
    """§4 engram_hash: "for n = 2..N: h = XOR_{i<n} (id_i · mult_i) (int64, wrapping), out = h mod
    vocab[l, n−2, j] + offset" (engram.py: floored modulo, so every row lies in [offset, offset +
    vocab) even for a negative wrapped h). Checked with Python integers, huge multipliers included."""
    ids, multipliers, vocab, offsets = case
    out = engram.engram_hash(ids, multipliers, vocab, offsets)
    layers, max_ngram = multipliers.shape
    tables = vocab.shape[2]
    assert out.dtype == torch.int32 and tuple(out.shape) == (layers, ids.shape[0], (max_ngram - 1) * tables)
    for layer in range(layers):
        for t, row in enumerate(ids.tolist()):
            h = 0
            for i, token in enumerate(row):
                h ^= wrap64(token * int(multipliers[layer, i]))
                if i == 0:
                    continue
                for j in range(tables):
                    column = (i - 1) * tables + j
                    size, offset = int(vocab[layer, i - 1, j]), int(offsets[layer, column])
                    assert int(out[layer, t, column]) == h % size + offset


@st.composite
def gate_cases(draw):
    tokens, streams, hidden = draw(st.integers(0, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 32))
    generator = seeded(draw)
    x = (torch.randn(tokens, streams, hidden, generator=generator) * 2).to(torch.bfloat16)
    k = (torch.randn(tokens, streams, hidden, generator=generator) * 2).to(torch.bfloat16)
    v = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
    w = torch.rand(streams, hidden, generator=generator) + 0.5
    if draw(st.booleans()) and streams > 0:
        w[draw(st.integers(0, streams - 1))] = 0.0  # dot = 0: the gate is exactly ½
    return x, k, v, w, draw(st.sampled_from([1e-6, 1e-2, 0.3])), draw(st.integers(-12, 12))


@settings(max_examples=40, **DETERMINISTIC)
@given(gate_cases())
def test_engram_gate_forward_laws(case):
    """§4 engram_gate_fwd: "dot = Σ_d x·w·k, s = dot·rstd_x·rstd_k/√D, gate = σ(sign(s)·√max(|s|,
    clamp_value)), out = x + gate·v": the gate is ½ exactly where dot = 0 and otherwise at least
    σ(√clamp) away from ½ on its side; with eps = 0 it is invariant to scaling x by 2^j (s is a cosine);
    negating k negates dot exactly and mirrors the gate (g → 1 − g); out is x + gate·v rounded once."""
    x, k, v, w, clamp, shift = case
    out, dot, gate, rstd_x, rstd_k = engram.engram_gate_fwd(x, k, v, w, 0.0, clamp)
    tokens, streams, hidden = x.shape
    for tensor in (dot, gate, rstd_x, rstd_k):
        assert tensor.dtype == torch.float32 and tuple(tensor.shape) == (tokens, streams)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    zero = dot == 0
    assert (gate[zero] == 0.5).all()
    margin = 1 / (1 + math.exp(-math.sqrt(clamp))) - 0.5
    assert (((gate - 0.5).abs() >= margin * (1 - 2.0**-20)) | zero).all()
    assert ((gate > 0.5) == (dot > 0)).all()
    nonzero = (x.float().abs().amax(dim=-1) > 0) & (k.float().abs().amax(dim=-1) > 0)
    scaled = (x.double() * 2.0**shift).to(torch.bfloat16)
    _, dot2, gate2, rstd_x2, _ = engram.engram_gate_fwd(scaled, k, v, w, 0.0, clamp)
    assert_same_bits(gate2[nonzero], gate[nonzero])
    assert_same_bits(dot2, dot * 2.0**shift)
    _, dot_neg, gate_neg, *_ = engram.engram_gate_fwd(x, -k, v, w, 0.0, clamp)
    assert torch.equal(dot_neg, -dot)  # as values: a zero dot may change its sign
    assert ((gate_neg - (1 - gate)).abs() <= 2.0**-23).all()
    want = x.double() + gate.double()[..., None] * v.double()[:, None, :]
    assert (
        (out.double() - want).abs() <= 2.0**-8 * want.abs() + 2.0**-22 * (x.double().abs() + v.double().abs()[:, None])
    ).all()


@settings(max_examples=30, **DETERMINISTIC)
@given(gate_cases(), st.integers(1, 9))
def test_engram_gate_backward_partials_and_clamped_branch(case, num_partials):
    """§4 engram_gate_bwd: "β = 0 if |s| < clamp ... dv = Σ_streams g·go; dw_partial = per-block partial
    sums of β·x·k"; grad_w_reduce: "G = Σ partials; grad_wh += G·we, grad_we += G·wh. Must work for any
    SM count": the sum of the partials does not depend on their number (blocks past T are zero), dx,
    dk, dv do not either, and with a clamp above every |s| the gate has no derivative (dk = 0, dx = go)."""
    x, k, v, w, clamp, _ = case
    tokens, streams, hidden = x.shape
    grad_out = (torch.randn(tokens, streams, hidden, generator=torch.Generator().manual_seed(7))).to(torch.bfloat16)
    _, dot, gate, rstd_x, rstd_k = engram.engram_gate_fwd(x, k, v, w, 1e-6, clamp)
    saved = (dot, gate, rstd_x, rstd_k)
    dx, dk, dv, dw = engram.engram_gate_bwd(grad_out, x, k, v, w, *saved, clamp, num_partials=1)
    dx_p, dk_p, dv_p, dw_p = engram.engram_gate_bwd(grad_out, x, k, v, w, *saved, clamp, num_partials=num_partials)
    assert tuple(dw_p.shape) == (num_partials, streams, hidden)
    for a, b in ((dx_p, dx), (dk_p, dk), (dv_p, dv)):
        assert_same_bits(a, b)
    per_block = ceil_div(tokens, num_partials)
    for p in range(num_partials):
        if p * per_block >= tokens:
            assert (dw_p[p] == 0).all(), "a block past the last token must be zero"
    total = dw_p.double().sum(0)
    assert (
        (total - dw.double()[0]).abs() <= 2.0**-20 * (dw.double()[0].abs() + dw_p.double().abs().sum(0)) + 1e-30
    ).all()
    want_dv = (gate.double()[..., None] * grad_out.double()).sum(1)
    assert ((dv.double() - want_dv).abs() <= 2.0**-8 * want_dv.abs() + 2.0**-20 * grad_out.double().abs().sum(1)).all()

    wh = (torch.rand(streams, hidden) + 0.5).to(torch.bfloat16)
    we = (torch.rand(streams, hidden) + 0.5).to(torch.bfloat16)
    grad_wh, grad_we = torch.ones(streams, hidden), torch.ones(streams, hidden)
    engram.grad_w_reduce(dw_p, wh, we, grad_wh, grad_we)
    scale = dw_p.double().abs().sum(0)
    assert ((grad_wh.double() - 1 - total * we.double()).abs() <= 2.0**-20 * (scale * we.double() + 1)).all()
    assert ((grad_we.double() - 1 - total * wh.double()).abs() <= 2.0**-20 * (scale * wh.double() + 1)).all()
    untouched = torch.ones(streams, hidden)
    engram.grad_w_reduce(dw_p[:0], wh, we, untouched, untouched.clone())
    assert (untouched == 1).all(), "zero partials add nothing"
    fused = engram.fused_weight(wh, we)
    assert torch.equal(fused.double(), wh.double() * we.double()), "w = wh·we is exact in fp32"

    huge_clamp = 1e30  # every |s| below the clamp: the clamped branch everywhere
    _, dot_c, gate_c, rx, rk = engram.engram_gate_fwd(x, k, v, w, 1e-6, huge_clamp)
    dx_c, dk_c, _, dw_c = engram.engram_gate_bwd(grad_out, x, k, v, w, dot_c, gate_c, rx, rk, huge_clamp)
    assert (dk_c == 0).all() and (dw_c == 0).all()
    assert_same_bits(dx_c, grad_out)

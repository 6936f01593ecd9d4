"""GPU: the cast back of every block shape and format, the e5m6 cast and the lossless FP4 → FP8 cast
of ``tileproof.optimized.quant`` agree bit for bit with the reference twin (refusals included).

Quantized inputs are random bytes (every e4m3, e2m1 and e5m6 code occurs, NaN codes included) with
random scales in each layout (NaN, Inf and zero scales included), so the cast back is checked far
beyond what a cast produces. Data rows are contiguous, padded (row stride > row) or start one byte
past an aligned address (narrower vectors; e5m6: the byte path). Every optimized output is poisoned
before the kernel runs, so an element it never writes shows.

``build_*`` make each case's inputs on any device from a generator (the test's seeded ``generator``
fixture), so that a compile-only pass can call them on the CPU under ``compile_only()`` and prove
that every kernel configuration used here builds.
"""

import pytest
import torch

import tileproof.reference.quant as reference
import tileproof.reference.quant_blocks as reference_blocks
from tileproof.optimized.jit import poison_outputs
from tileproof.reference.contract import ScaleLayout, ceil_div

pytestmark = pytest.mark.gpu

LAYOUTS = {
    "row": ScaleLayout("row_major"),
    "col": ScaleLayout("col_major"),
    "packed": ScaleLayout("packed_ue8m0"),
}
STORAGE = {"e4m3": torch.float8_e4m3fn, "e2m1": torch.int8, "e5m6": torch.uint8}
STORED_PER_VALUE = {"e4m3": 1.0, "e2m1": 0.5, "e5m6": 1.5}
ROWS = ("contiguous", "padded", "unaligned")


def _optimized():
    import tileproof.optimized.quant as optimized

    return optimized


def _bytes(tensor):
    # A fresh contiguous copy: a view with size-1 dimensions may keep a non-unit stride.
    return tensor.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def _strides(tensor):
    """The strides that address a second element (of dimensions longer than one)."""
    return [stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size > 1]


def _assert_same(actual, expected, what, nan_equal=False):
    """Same dtype, shape, strides and bytes; with ``nan_equal`` any NaN matches any NaN (payloads
    are not part of the contract)."""
    assert actual.dtype == expected.dtype, what
    assert actual.shape == expected.shape, what
    if not actual.numel():
        return
    assert _strides(actual) == _strides(expected), what
    actual_bytes, expected_bytes = _bytes(actual), _bytes(expected)
    differ = actual_bytes != expected_bytes
    if nan_equal:
        both_nan = torch.isnan(actual.float()) & torch.isnan(expected.float())
        differ = differ.view(actual.numel(), -1).any(-1) & ~both_nan.reshape(-1)
    bad = differ.nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} differ, first at {bad[0].tolist()}"


def _rows_of(data: torch.Tensor, rows: str, generator) -> torch.Tensor:
    """``data`` as a view of a wider buffer of random bytes: contiguous, padded rows, or rows that
    start one byte past an aligned address (for e2m1 two values: one byte)."""
    if rows == "contiguous":
        return data
    tokens, width = data.shape
    extra = 16 if rows == "padded" else 13
    wide = torch.randint(0, 256, (tokens, width + extra), generator=generator, dtype=torch.uint8).view(data.dtype)
    start = 0 if rows == "padded" else 1
    wide[:, start : start + width] = data
    return wide[:, start : start + width]


def _random_scales(rows: int, kblocks: int, layout: ScaleLayout, generator) -> torch.Tensor:
    """Scales in ``layout``: fp32 of random magnitudes 2^-20 .. 2^20 (a NaN, an Inf and a zero among
    them), or random exponent bytes (0 and 0xFF, i.e. 0.0 and NaN, included)."""
    if layout.kind == "packed_ue8m0":
        stored = layout.empty(rows, kblocks, "cpu")
        stored.copy_(torch.randint(-(2**31), 2**31, stored.shape, generator=generator, dtype=torch.int64))
        return stored
    values = torch.rand(rows, kblocks, generator=generator) + 0.5
    values *= torch.exp2(torch.randint(-20, 21, (rows, kblocks), generator=generator).float())
    flat = values.view(-1)
    for i, special in enumerate((float("nan"), float("inf"), 0.0)):
        if flat.numel() > 3 * i + 2:
            flat[3 * i + 2] = special
    stored = layout.empty(rows, kblocks, "cpu")
    stored.copy_(values)
    return stored


# ---------------------------------------------------------------------------------------------
# cast_back
# ---------------------------------------------------------------------------------------------

SHAPES = [(0, 256), (1, 7168), (129, 1000), (300, 4096), (33, 776)]
BLOCKS = [(1, 16), (1, 128), (1, None), (32, 32), (32, 128), (128, 32), (128, 128), (32, 1), (128, 1)]
CAST_BACK_CASES = [
    (tokens, hidden, fmt, block, out, layout, rows)
    for tokens, hidden in SHAPES
    for fmt in ("e4m3", "e2m1", "e5m6")
    for block in BLOCKS
    for out in ("bf16", "fp32")
    for layout in LAYOUTS
    for rows in ROWS
    if not (fmt == "e5m6" and hidden % 8)
    and (layout == "row" or out == "bf16")  # the output dtype and the scale layout are independent
    and (rows == "contiguous" or (layout == "row" and out == "bf16"))
]


def build_cast_back(tokens, hidden, fmt, block, layout, rows, device, generator):
    """``((data, sf), x_block_size, kwargs)`` of a cast-back case: random codes and scales."""
    block = (block[0], hidden if block[1] is None else block[1])
    width = int(hidden * STORED_PER_VALUE[fmt])
    codes = torch.randint(0, 256, (tokens, width), generator=generator, dtype=torch.uint8)
    data = _rows_of(codes.view(STORAGE[fmt]), rows, generator)
    sf = _random_scales(ceil_div(tokens, block[0]), ceil_div(hidden, block[1]), LAYOUTS[layout], generator)
    kwargs = {"x_special_fmt": "e5m6"} if fmt == "e5m6" else {}
    return (_to(data, device), _to(sf, device)), block, kwargs


def _to(tensor: torch.Tensor, device) -> torch.Tensor:
    """Move a (possibly strided) view with its layout and its address modulo 16 bytes: the span
    from the last 16-byte boundary before its first element to its last element travels."""
    if tensor.numel() == 0:
        return tensor.to(device)
    lead = tensor.storage_offset() * tensor.element_size() % 16 // tensor.element_size()
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    flat = tensor.as_strided((lead + span,), (1,), tensor.storage_offset() - lead).to(device)
    return flat.as_strided(tensor.shape, tensor.stride(), flat.storage_offset() + lead)


@pytest.mark.parametrize("tokens,hidden,fmt,block,out,layout,rows", CAST_BACK_CASES)
def test_cast_back_matches_reference(tokens, hidden, fmt, block, out, layout, rows, generator):
    pair, block, kwargs = build_cast_back(tokens, hidden, fmt, block, layout, rows, "cuda", generator)
    expected = reference.cast_back(pair, out, block, **kwargs)
    with poison_outputs():
        actual = _optimized().cast_back(pair, out, block, **kwargs)
    _assert_same(actual, expected, f"cast_back {fmt} {block} → {out}", nan_equal=True)
    if block[0] == 1:
        with poison_outputs():
            again = _optimized().per_token_cast_back(pair, out, block[1], **kwargs)
        _assert_same(again, expected, "per_token_cast_back", nan_equal=True)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_cast_back_of_a_cast_restores_the_casts_values(fmt, generator):
    """Real pairs: per_block_cast (128×128, packed scales) and per_channel_cast, cast back."""
    x = (torch.randn(300, 1024, generator=generator) * 3).cuda()
    q, sf = reference_blocks.per_block_cast(
        x, fmt, (128, 128), use_packed_ue8m0=True, use_tma_aligned_col_major_sf=True
    )
    with poison_outputs():
        actual = _optimized().cast_back((q, sf), "bf16", (128, 128))
    _assert_same(actual, reference.cast_back((q, sf), "bf16", (128, 128)), "per_block pair", nan_equal=True)
    q, sf = reference_blocks.per_channel_cast(x, fmt, 128)
    with poison_outputs():
        actual = _optimized().cast_back((q, sf), "fp32", (128, 1))
    _assert_same(actual, reference.cast_back((q, sf), "fp32", (128, 1)), "per_channel pair", nan_equal=True)


# ---------------------------------------------------------------------------------------------
# per_token_cast(x, "e5m6", H)
# ---------------------------------------------------------------------------------------------

E5M6_FLAGS = {
    "plain": {},
    "round": {"round_sf": True},
    "colmajor": {"use_tma_aligned_col_major_sf": True},
    "packed": {"use_tma_aligned_col_major_sf": True, "use_packed_ue8m0": True},
    "round+colmajor": {"use_tma_aligned_col_major_sf": True, "round_sf": True},
}
# Hidden sizes: every packed store width (H % 32 == 0: 48 bytes; 16: 24; 8: 12), rows of few chunks
# (a 64-thread CTA: 8, 40, 96) and of more chunks than threads (16384: two chunks per thread). Padded
# and misaligned rows (one element off: 1-element loads) on one shape, to keep the kernel count low.
E5M6_SHAPES = [(0, 64), (1, 8), (5, 40), (64, 96), (37, 1040), (129, 7168), (3, 16384)]
E5M6_CASES = [
    (tokens, hidden, dtype, flags, "contiguous")
    for tokens, hidden in E5M6_SHAPES
    for dtype in (torch.bfloat16, torch.float32)
    for flags in E5M6_FLAGS
] + [(37, 1040, dtype, "plain", rows) for dtype in (torch.bfloat16, torch.float32) for rows in ("padded", "unaligned")]


def build_e5m6_x(tokens, hidden, dtype, rows, device, generator):
    """Rows of magnitudes 2^-15 .. 2^15 (values far below a row's amax reach e5m6's subnormals), a
    tiny row (the amax floor), NaN / ±Inf in two rows; contiguous, padded or one element off."""
    values = torch.randn(tokens, hidden, generator=generator)
    values *= torch.exp2(torch.randint(-30, 31, (tokens, hidden), generator=generator).float() * 0.5)
    if tokens >= 4:
        values[1] *= 1e-9
        values[2, hidden // 3] = float("nan")
        values[3, 0] = float("inf")
        values[3, -1] = float("-inf")
    extra = {"contiguous": 0, "padded": 16, "unaligned": 17}[rows]
    start = 1 if rows == "unaligned" else 0
    wide = torch.full((tokens, hidden + extra), float("nan"))
    wide[:, start : start + hidden] = values
    return _to(wide.to(dtype)[:, start : start + hidden], device)


@pytest.mark.parametrize("tokens,hidden,dtype,flags,rows", E5M6_CASES)
def test_e5m6_cast_matches_reference(tokens, hidden, dtype, flags, rows, generator):
    x = build_e5m6_x(tokens, hidden, dtype, rows, "cuda", generator)
    expected_q, expected_sf = reference.per_token_cast(x, "e5m6", hidden, **E5M6_FLAGS[flags])
    with poison_outputs():
        q, sf = _optimized().per_token_cast(x, "e5m6", hidden, **E5M6_FLAGS[flags])
    _assert_same(q, expected_q, "q")
    _assert_same(sf, expected_sf, "sf", nan_equal=True)


def test_e5m6_encoder_over_the_fp32_range():
    """With ``round_sf`` and a row amax of 65024 the multiplier is exactly 1, so the kernel encodes
    the input's own fp32 values: every 61st fp32 pattern of [0, 65024], every e5m6 value and
    midpoint with its two fp32 neighbours, both signs, in rows of 4096."""
    patterns = torch.arange(0, 0x477E0000 + 1, 61, dtype=torch.int64).to(torch.int32).view(torch.float32)
    codes = torch.arange(0, 0x7C0, dtype=torch.int32).to(torch.uint16)
    exact = reference.decode_e5m6(codes).to(torch.float64)
    midpoints = ((exact[:-1] + exact[1:]) / 2).to(torch.float32)
    around = torch.cat([midpoints, exact.to(torch.float32)])
    bits = around.view(torch.int32)
    neighbours = torch.cat([around, (bits + 1).view(torch.float32), (bits - 1).clamp(min=0).view(torch.float32)])
    values = torch.cat([patterns, neighbours])
    values = values[values <= 65024.0]  # nothing above the row's pinned amax
    values = torch.cat([values, -values])
    per_row = 4095
    rows = ceil_div(values.numel(), per_row)
    padded = torch.zeros(rows * per_row)
    padded[: values.numel()] = values
    x = torch.cat([torch.full((rows, 1), 65024.0), padded.view(rows, per_row)], dim=1).cuda()
    expected_q, expected_sf = reference.per_token_cast(x, "e5m6", 4096, round_sf=True)
    assert bool((expected_sf == 1).all())
    q, sf = _optimized().per_token_cast(x, "e5m6", 4096, round_sf=True)
    _assert_same(q, expected_q, "q")
    _assert_same(sf, expected_sf, "sf")


# ---------------------------------------------------------------------------------------------
# per_block_cast_lossless
# ---------------------------------------------------------------------------------------------

# Input pairs: (the cast's block, its scale flags). All with power-of-two scales (round_sf).
LOSSLESS_SOURCES = {
    "1x32": ((1, 32), {}),
    "1x32-col": ((1, 32), {"use_tma_aligned_col_major_sf": True}),
    "1x32-packed": ((1, 32), {"use_tma_aligned_col_major_sf": True, "use_packed_ue8m0": True}),
    "1x16": ((1, 16), {}),
    "32x32-packed": ((32, 32), {"use_tma_aligned_col_major_sf": True, "use_packed_ue8m0": True}),
    "nt32": ((32, 1), {}),
}
OUT_BLOCKS = [(1, 32), (1, 128), (1, None), (32, 32), (32, 128), (128, 32), (128, 128), (32, 1), (128, 1)]
OUT_FLAGS = {
    "plain": {},
    "colmajor": {"use_tma_aligned_col_major_sf": True},
    "packed": {"use_tma_aligned_col_major_sf": True, "use_packed_ue8m0": True},
}
LOSSLESS_SHAPES = [(0, 64), (1, 32), (33, 96), (130, 256), (257, 1024)]


def _valid_out_block(out_block, in_block, hidden):
    out_block = (out_block[0], hidden if out_block[1] is None else out_block[1])
    return out_block if out_block[0] % in_block[0] == 0 and out_block[1] % in_block[1] == 0 else None


LOSSLESS_CASES = [
    (tokens, hidden, source, out_block, flags, rows)
    for tokens, hidden in LOSSLESS_SHAPES
    for source in LOSSLESS_SOURCES
    for out_block in OUT_BLOCKS
    for flags in OUT_FLAGS
    for rows in ("contiguous", "padded")
    if _valid_out_block(out_block, LOSSLESS_SOURCES[source][0], hidden)
    and (rows == "contiguous" or (flags == "plain" and source == "1x32"))
]


def build_lossless(tokens, hidden, source, spread, rows, device, generator):
    """An FP4 pair with power-of-two scales made by the reference cast of random values whose
    magnitudes vary by up to 2^±spread between groups of 16, and an all-zero row (floor scales).
    Magnitudes before the spread lie in [1, 2): a block of one element (the tail of a 32-token
    channel block) then has its amax within the spread too, as a normal draw's need not be."""
    block, flags = LOSSLESS_SOURCES[source]
    signs = torch.randint(0, 2, (tokens, hidden), generator=generator) * 2 - 1
    values = signs * (1 + torch.rand(tokens, hidden, generator=generator))
    exponents = torch.randint(-spread, spread + 1, (tokens, hidden // 16), generator=generator)
    values *= torch.exp2(exponents.float()).repeat_interleave(16, 1)
    if tokens >= 3:
        values[tokens // 2] = 0.0
    if block[0] == 1:
        q, sf = reference.per_token_cast(values, "e2m1", block[1], round_sf=True, **flags)
    elif block[1] == 1:
        q, sf = reference_blocks.per_channel_cast(values, "e2m1", block[0], round_sf=True)
    else:
        q, sf = reference_blocks.per_block_cast(values, "e2m1", block, round_sf=True, **flags)
    return (_to(_rows_of(q, rows, generator), device), _to(sf, device)), block


def _lossless_outcome(fn, pair, in_block, out_block, flags):
    """``(q, sf)``, or the ValueError's message."""
    try:
        with poison_outputs():
            return fn(pair, "e4m3", in_block, out_block, **flags)
    except ValueError as error:
        return str(error)


def _assert_same_outcome(actual, expected, what):
    if isinstance(expected, str) or isinstance(actual, str):
        assert actual == expected, what
        return
    _assert_same(actual[0], expected[0], f"{what}: q")
    _assert_same(actual[1], expected[1], f"{what}: sf")


@pytest.mark.parametrize("tokens,hidden,source,out_block,flags,rows", LOSSLESS_CASES)
def test_lossless_matches_reference(tokens, hidden, source, out_block, flags, rows, generator):
    pair, in_block = build_lossless(tokens, hidden, source, 3, rows, "cuda", generator)
    out_block = _valid_out_block(out_block, in_block, hidden)
    expected = _lossless_outcome(reference_blocks.per_block_cast_lossless, pair, in_block, out_block, OUT_FLAGS[flags])
    actual = _lossless_outcome(_optimized().per_block_cast_lossless, pair, in_block, out_block, OUT_FLAGS[flags])
    assert not isinstance(expected, str), "spreads of at most 6 are always exact"
    _assert_same_outcome(actual, expected, f"{source} → {out_block} {flags}")


@pytest.mark.parametrize("source", ["1x32", "1x32-packed", "32x32-packed", "nt32"])
@pytest.mark.parametrize("out_block", [(1, None), (128, 128), (128, 1)])
def test_lossless_refuses_like_the_reference(source, out_block, generator):
    """Spreads up to 2^±20 between blocks: some outputs are inexact, and the first inexact element
    (row-major) is named the same way; the rest gives the same bytes."""
    pair, in_block = build_lossless(257, 1024, source, 20, "contiguous", "cuda", generator)
    out_block = _valid_out_block(out_block, in_block, 1024)
    if out_block is None:
        pytest.skip("not a whole number of input blocks")
    expected = _lossless_outcome(reference_blocks.per_block_cast_lossless, pair, in_block, out_block, {})
    actual = _lossless_outcome(_optimized().per_block_cast_lossless, pair, in_block, out_block, {})
    _assert_same_outcome(actual, expected, f"{source} → {out_block}")


@pytest.mark.parametrize("bad", ["three", "zero", "nan", "negative", "subnormal", "byte0", "byteFF"])
def test_lossless_refuses_scales_that_are_not_powers_of_two(bad, generator):
    packed = bad.startswith("byte")
    flags = {"use_tma_aligned_col_major_sf": True, "use_packed_ue8m0": True} if packed else {}
    values = torch.randn(40, 128, generator=generator)
    q, sf = reference.per_token_cast(values, "e2m1", 32, round_sf=True, **flags)
    if packed:
        word = int(sf[7, 0])
        sf[7, 0] = (word & ~0xFF00) | ((0 if bad == "byte0" else 0xFF) << 8)
    else:
        sf[7, 1] = {"three": 3.0, "zero": 0.0, "nan": float("nan"), "negative": -1.0, "subnormal": 2.0**-130}[bad]
    pair = (q.cuda(), _to(sf, "cuda"))
    expected = _lossless_outcome(reference_blocks.per_block_cast_lossless, pair, (1, 32), (1, 128), {})
    actual = _lossless_outcome(_optimized().per_block_cast_lossless, pair, (1, 32), (1, 128), {})
    assert isinstance(expected, str) and "powers of two" in expected
    assert actual == expected

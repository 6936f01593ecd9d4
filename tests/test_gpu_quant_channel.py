"""GPU: the optimized per-channel casts with a gather, an FP8 input or a transposed output, and the
re-quantization input (a quantized ``(q, sf)`` tuple with ``x_block_size``) of the per-token and
per-block casts, agree bit for bit with the reference twin (scales: NaN ≡ NaN).

Every case runs under ``poison_outputs``, so a byte the kernels never write shows up. The inputs
are built on ``DEVICE``; with it set to ``"cpu"``, every case also runs under ``compile_only()`` on
a CPU machine (which checks that every kernel configuration the cases reach compiles).
"""

import pytest
import torch

import tileproof.reference.quant as reference
import tileproof.reference.quant_blocks as reference_blocks
from tileproof.optimized.jit import poison_outputs

pytestmark = pytest.mark.gpu

DEVICE = "cuda"  # every input is built on it (a compile-only run on a CPU machine sets "cpu")

SCALE_FLAGS = {
    "row": {},
    "col": {"use_tma_aligned_col_major_sf": True},
    "packed": {"use_tma_aligned_col_major_sf": True, "use_packed_ue8m0": True},
    "round": {"round_sf": True},
}
_DS = 7168  # DeepSeek-V3 hidden size


def _optimized():
    import tileproof.optimized.quant as optimized

    return optimized


def _rows(tokens, hidden, row_stride, dtype, generator, special=False):
    """Rows of magnitudes 2^-8 .. 2^8 with a row below e4m3's amax floor and an outlier row; the
    padding between rows (``row_stride > hidden``) is NaN, which no kernel may read."""
    values = torch.randn(tokens, hidden, generator=generator) * 3
    if tokens:
        values *= torch.exp2(torch.randint(-8, 9, (tokens, 1), generator=generator).float())
        values[0] *= 1e-6
    if tokens > 3:
        values[tokens // 2, : hidden // 3] *= 64
    if special and tokens > 2 and hidden > 7:
        values[1, 3], values[2, 5], values[2, 7] = float("nan"), float("inf"), -float("inf")
    wide = torch.full((tokens, row_stride or hidden), float("nan"))
    wide[:, :hidden] = values
    return wide.to(dtype)[:, :hidden]


def _strided_data(data, row_stride):
    """Quantized data as a view of a wider buffer padded with 0x7F bytes (e4m3 NaN)."""
    if not row_stride or row_stride == data.shape[1]:
        return data
    wide = torch.full((data.shape[0], row_stride), 0x7F, dtype=torch.uint8).view(data.dtype)
    wide[:, : data.shape[1]] = data
    return wide[:, : data.shape[1]]


def _pos_to_token(rows, tokens, generator):
    """int32 ``[P]`` rows of x in ``[-1, T)``: about one in eight is -1 (a zero row), the last one is."""
    pos = torch.randint(0, max(tokens, 1), (rows,), generator=generator, dtype=torch.int32)
    padding = torch.rand(rows, generator=generator) < 0.125
    if rows:
        padding[-1] = True
    if tokens == 0:
        padding[:] = True
    return torch.where(padding, -1, pos)


# --- per_channel_cast_and_transpose --------------------------------------------------------------
# (tokens, hidden, row_stride, num_per_tokens, round_sf, special). T covers every store width of q
# [H, T] (16: T % 16 == 0; 8; 4; 1), 0/1/odd tokens and partial token blocks; H = 99 reads rows in
# 1-element vectors, H = 40 leaves most of a 128-channel tile empty.
TRANSPOSE_CASES = [
    (0, 64, None, 32, False, False),
    (1, 64, None, 128, False, False),
    (33, 48, 64, 32, True, False),
    (300, 16, None, 128, False, False),
    (256, 96, None, 32, True, False),
    (136, 40, None, 32, False, False),
    (130, 200, None, 128, True, False),
    (77, 99, None, 32, False, False),
    (40, 64, None, 128, False, True),
    (1000, _DS, None, 32, True, False),
    (4096, _DS, 7232, 128, False, False),
]


@pytest.mark.parametrize("tokens,hidden,row_stride,nt,round_sf,special", TRANSPOSE_CASES)
def test_per_channel_cast_and_transpose_matches_reference(tokens, hidden, row_stride, nt, round_sf, special):
    generator = torch.Generator().manual_seed(tokens * 1_000_003 + hidden * 131 + nt)
    x = _rows(tokens, hidden, row_stride, torch.bfloat16, generator, special).to(DEVICE)
    expected_q, expected_sf = reference_blocks.per_channel_cast_and_transpose(x, "e4m3", nt, round_sf)
    with poison_outputs():
        q, sf = _optimized().per_channel_cast_and_transpose(x, "e4m3", nt, round_sf)
    _assert_same_bits(q, expected_q, "q")
    _assert_same_bits(sf, expected_sf, "sf")


# --- per_channel_cast_fused --------------------------------------------------------------------
# (kind, tokens, hidden, row_stride, P (None: no gather), round_sf, special). kind: "bf16"/"fp32"
# for a plain x, or the scale layout of a 1×128 e4m3 (q, sf) input. P % 128 != 0 throughout
# (the last token block's scale over the rows that exist), T = 0 with P > 0 (every row padding).
FUSED_CASES = [
    ("bf16", 256, 64, None, None, False, False),
    ("fp32", 300, 32, 48, None, True, False),
    ("bf16", 1, 64, None, None, False, False),
    ("bf16", 0, 64, None, None, True, False),
    ("bf16", 50, 96, 112, 200, False, False),
    ("fp32", 7, 64, None, 129, True, False),
    ("bf16", 3, 32, None, 1, False, False),
    ("bf16", 9, 64, None, 0, False, False),
    ("bf16", 0, 32, None, 16, True, False),
    ("bf16", 40, 99, None, 300, False, False),
    ("bf16", 40, 64, None, 77, False, True),
    ("row", 40, 256, 384, 136, False, False),
    ("col", 129, 128, None, None, True, False),
    ("packed", 5, 256, None, 200, False, False),
    ("row", 0, 256, None, 20, False, False),
    ("packed", 300, 384, 400, None, True, False),
    ("col", 70, 200, None, 257, False, False),
    ("packed", 40, 256, None, 50, False, True),
    ("bf16", 4096, _DS, 7232, 8192 + 64, False, False),
    ("row", 4096, _DS, 7296, 8192 + 16, True, False),
]


def _fused_inputs(kind, tokens, hidden, row_stride, rows, round_sf, special, device):
    generator = torch.Generator().manual_seed(tokens * 1_000_003 + hidden * 131 + (rows or 0))
    kwargs = {"round_sf": round_sf}
    if kind in ("bf16", "fp32"):
        dtype = torch.bfloat16 if kind == "bf16" else torch.float32
        x = _rows(tokens, hidden, row_stride, dtype, generator, special).to(device)
    else:
        source = _rows(tokens, hidden, None, torch.float32, generator, special)
        data, sf = reference.per_token_cast(source, "e4m3", 128, **SCALE_FLAGS[kind])
        x = (_strided_data(data, row_stride).to(device), sf.to(device))
        kwargs["num_per_channels"] = 128
    if rows is not None:
        kwargs["pos_to_token"] = _pos_to_token(rows, tokens, generator).to(device)
    return x, kwargs


@pytest.mark.parametrize("kind,tokens,hidden,row_stride,rows,round_sf,special", FUSED_CASES)
def test_per_channel_cast_fused_matches_reference(kind, tokens, hidden, row_stride, rows, round_sf, special):
    x, kwargs = _fused_inputs(kind, tokens, hidden, row_stride, rows, round_sf, special, DEVICE)
    expected_q, expected_sf = reference_blocks.per_channel_cast_fused(x, "e4m3", **kwargs)
    with poison_outputs():
        q, sf = _optimized().per_channel_cast_fused(x, "e4m3", **kwargs)
    _assert_same_bits(q, expected_q, "q")
    _assert_same_bits(sf, expected_sf, "sf")


# --- re-quantization: x a quantized (q, sf) tuple with x_block_size ----------------------------
# name → (format, x_block_size, scale flags of the cast that makes the pair).
SOURCES = {
    "e4m3-1x128": ("e4m3", (1, 128), "row"),
    "e2m1-1x32-packed": ("e2m1", (1, 32), "packed"),
    "e4m3-128x128-col": ("e4m3", (128, 128), "col"),
    "e2m1-32x32-round": ("e2m1", (32, 32), "round"),
    "e4m3-nt32": ("e4m3", (32, 1), "row"),
}
REQUANT_SHAPES = [(45, 256, 288), (129, 1024, None), (1, 128, None), (0, 64, None)]
BLOCK_TARGETS = [("e4m3", (128, 128), "row"), ("e2m1", (32, 32), "packed"), ("e4m3", (32, 128), "col")]
# num_per_channels None: one scale per row (C = H).
TOKEN_TARGETS = [("e4m3", 128, "row"), ("e2m1", 32, "round"), ("e4m3", None, "packed")]


def _quantized(source, tokens, hidden, row_stride, device):
    fmt, block, flags = SOURCES[source]
    generator = torch.Generator().manual_seed(tokens * 1_000_003 + hidden * 131 + len(source))
    values = _rows(tokens, hidden, None, torch.float32, generator)
    if block[0] == 1:
        data, sf = reference.per_token_cast(values, fmt, block[1], **SCALE_FLAGS[flags])
    elif block[1] == 1:
        data, sf = reference_blocks.per_channel_cast(values, fmt, block[0], **SCALE_FLAGS[flags])
    else:
        data, sf = reference_blocks.per_block_cast(values, fmt, block, **SCALE_FLAGS[flags])
    width = row_stride // (2 if fmt == "e2m1" else 1) if row_stride else None
    return (_strided_data(data, width).to(device), sf.to(device)), block


@pytest.mark.parametrize("tokens,hidden,row_stride", REQUANT_SHAPES)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("target", range(len(BLOCK_TARGETS)))
def test_per_block_cast_requantization_matches_reference(tokens, hidden, row_stride, source, target):
    fmt, block, flags = BLOCK_TARGETS[target]
    x, x_block = _quantized(source, tokens, hidden, row_stride, DEVICE)
    kwargs = dict(SCALE_FLAGS[flags], x_block_size=x_block)
    optimized = _optimized()
    expected_q, expected_sf = reference_blocks.per_block_cast(x, fmt, block, **kwargs)
    expected_given = reference_blocks.per_block_cast_with_precomputed_sf(x, fmt, block, expected_sf, **kwargs)
    with poison_outputs():
        q, sf = optimized.per_block_cast(x, fmt, block, **kwargs)
        sf_only = optimized.per_block_cast_with_sf_only(x, fmt, block, **kwargs)
        q_given_sf = optimized.per_block_cast_with_precomputed_sf(x, fmt, block, expected_sf, **kwargs)
    _assert_same_bits(q, expected_q, "q")
    _assert_same_bits(sf, expected_sf, "sf")
    _assert_same_bits(sf_only, expected_sf, "sf only")
    _assert_same_bits(q_given_sf, expected_given, "q with precomputed sf")


@pytest.mark.parametrize("tokens,hidden,row_stride", REQUANT_SHAPES)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("target", range(len(TOKEN_TARGETS)))
def test_per_token_cast_requantization_matches_reference(tokens, hidden, row_stride, source, target):
    fmt, num_per_channels, flags = TOKEN_TARGETS[target]
    num_per_channels = num_per_channels or hidden
    x, x_block = _quantized(source, tokens, hidden, row_stride, DEVICE)
    kwargs = dict(SCALE_FLAGS[flags], x_block_size=x_block)
    optimized = _optimized()
    expected_q, expected_sf = reference.per_token_cast(x, fmt, num_per_channels, **kwargs)
    expected_given = reference.per_token_cast_with_precomputed_sf(x, fmt, num_per_channels, expected_sf, **kwargs)
    with poison_outputs():
        q, sf = optimized.per_token_cast(x, fmt, num_per_channels, **kwargs)
        sf_only = optimized.per_token_cast_with_sf_only(x, fmt, num_per_channels, **kwargs)
        q_given_sf = optimized.per_token_cast_with_precomputed_sf(x, fmt, num_per_channels, expected_sf, **kwargs)
    _assert_same_bits(q, expected_q, "q")
    _assert_same_bits(sf, expected_sf, "sf")
    _assert_same_bits(sf_only, expected_sf, "sf only")
    _assert_same_bits(q_given_sf, expected_given, "q with precomputed sf")


# --- validation: the same errors as the reference ----------------------------------------------


def _bad_calls(device):
    x = torch.zeros(8, 64, dtype=torch.bfloat16, device=device)
    pair = (torch.zeros(8, 128, dtype=torch.float8_e4m3fn, device=device), torch.ones(8, 1, device=device))
    pos = torch.zeros(4, dtype=torch.int32, device=device)
    return [
        ("per_channel_cast_fused", (x, "e2m1"), {}),
        ("per_channel_cast_fused", (x, "e4m3", 32), {}),
        ("per_channel_cast_fused", (x, "e4m3"), {"round_sf": 1}),
        ("per_channel_cast_fused", (x, "e4m3"), {"num_per_channels": 128}),
        ("per_channel_cast_fused", (pair, "e4m3"), {}),
        ("per_channel_cast_fused", (pair, "e4m3"), {"num_per_channels": 64}),
        ("per_channel_cast_fused", ((pair[0].view(torch.int8), pair[1]), "e4m3"), {"num_per_channels": 128}),
        ("per_channel_cast_fused", (x, "e4m3"), {"pos_to_token": pos.long()}),
        ("per_channel_cast_fused", (x, "e4m3"), {"pos_to_token": pos + 8}),
        ("per_channel_cast_fused", (x, "e4m3"), {"pos_to_token": pos - 2}),
        ("per_channel_cast_fused", (list(pair), "e4m3"), {}),
        ("per_channel_cast_and_transpose", (x, "e2m1", 32), {}),
        ("per_channel_cast_and_transpose", (x, "e4m3", 64), {}),
        ("per_channel_cast_and_transpose", (x.float(), "e4m3", 32), {}),
        ("per_channel_cast_and_transpose", (x.T, "e4m3", 32), {}),
        ("per_channel_cast_and_transpose", (x, "e4m3", 32), {"round_sf": "yes"}),
        ("per_channel_cast", (x, "e4m3", True), {}),
        ("per_block_cast", (x, "e4m3", (64, 128)), {}),
        ("per_block_cast", (x, "e4m3", (128, 128)), {"x_block_size": (1, 128)}),
        ("per_block_cast", (pair, "e4m3", (128, 128)), {"x_block_size": (1, 48)}),
        ("per_block_cast", (pair, "e4m3", (128, 128)), {}),
        ("per_block_cast_with_sf_only", (pair, "e5m6", (128, 128)), {"x_block_size": (1, 128)}),
        ("per_token_cast", (pair, "e5m6", 128), {"x_block_size": (1, 128)}),
        ("per_token_cast", (pair, "e4m3", 128), {"x_block_size": (2, 128)}),
        ("per_token_cast_with_sf_only", (pair, "e5m6", 128), {"x_block_size": (1, 128)}),
        ("per_token_cast_with_precomputed_sf", (pair, "e4m3", 128, pair[1]), {"x_block_size": (128, 1)}),
    ]


def _reference_of(name):
    return getattr(reference_blocks if name.startswith(("per_block", "per_channel")) else reference, name)


@pytest.mark.parametrize("index", range(len(_bad_calls("cpu"))))
def test_invalid_arguments_raise_the_reference_errors(index):
    name, args, kwargs = _bad_calls(DEVICE)[index]
    with pytest.raises((TypeError, ValueError)) as expected:
        _reference_of(name)(*args, **kwargs)
    with pytest.raises(expected.type) as actual:
        getattr(_optimized(), name)(*args, **kwargs)
    assert str(actual.value) == str(expected.value)


# --- helpers ----------------------------------------------------------------------------------


def _meaningful_strides(tensor):
    """Strides of the dimensions longer than 1 (a [64, 1] tensor may have any second stride)."""
    return tuple(stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size > 1)


def _flat(tensor):
    """The elements in row-major order, in fresh contiguous storage (a one-element view of a
    column-major scale tensor keeps its stride 4 through ``contiguous`` and ``reshape``)."""
    flat = tensor.reshape(-1)
    return torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat)


def _bytes(tensor):
    return _flat(tensor).view(torch.uint8)


def _assert_same_bits(actual, expected, what):
    """Same dtype, shape, strides and bytes; fp32 NaN equals NaN whatever its payload."""
    assert actual.dtype == expected.dtype, what
    assert actual.shape == expected.shape, what
    if actual.numel():
        assert _meaningful_strides(actual) == _meaningful_strides(expected), what
        a, e = _bytes(actual), _bytes(expected)
        if actual.dtype == torch.float32:
            both_nan = torch.isnan(_flat(actual)) & torch.isnan(_flat(expected))
            a = torch.where(both_nan, 0, a.view(torch.int32)).view(torch.uint8)
            e = torch.where(both_nan, 0, e.view(torch.int32)).view(torch.uint8)
        mismatch = (a != e).nonzero()
        assert mismatch.numel() == 0, f"{what}: {mismatch.shape[0]} bytes differ, first at {mismatch[0].tolist()}"

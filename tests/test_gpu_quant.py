"""GPU: the optimized quantization kernels agree bit for bit with the reference twin."""

import pytest
import torch

import tileproof.reference.quant as reference
from tileproof.optimized.jit import poison_outputs

pytestmark = pytest.mark.gpu

FLAG_SETS = {
    "plain": {},
    "round": {"round_sf": True},
    "colmajor": {"use_tma_aligned_col_major_sf": True},
    "packed": {"use_tma_aligned_col_major_sf": True, "use_packed_ue8m0": True},
}


def _optimized():
    import tileproof.optimized.quant as optimized

    return optimized


def _input(tokens, hidden, dtype, row_padding, generator):
    wide = torch.randn(tokens, hidden + row_padding, generator=generator) * 3
    if tokens:
        wide[0] *= 1e-3  # a row of small values: scales near the floor
    return wide.to(dtype).cuda()[:, :hidden]


def _bytes(tensor):
    # .contiguous() first: a one-row column-major scale tensor reshapes to a stride-4 view.
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _assert_same_bits(actual, expected, what):
    assert actual.dtype == expected.dtype, what
    assert actual.shape == expected.shape, what
    if actual.numel():
        assert actual.stride() == expected.stride(), what
        mismatch = (_bytes(actual) != _bytes(expected)).nonzero()
        assert mismatch.numel() == 0, f"{what}: {mismatch.shape[0]} bytes differ, first at {mismatch[0].tolist()}"


CASES = [
    (tokens, hidden, C, fmt, dtype, flags, padding)
    for tokens, hidden in [(0, 256), (1, 7168), (37, 1000), (129, 7168)]
    for C in (16, 32, 64, 128)
    for fmt in ("e4m3", "e2m1")
    for dtype in (torch.bfloat16, torch.float32)
    for flags in FLAG_SETS
    for padding in (0, 64)
    if not (padding and flags != "plain")
] + [
    (5, 96, 96, "e4m3", torch.bfloat16, "plain", 0),
    (3, 200, 200, "e2m1", torch.float32, "packed", 8),
    # More rows than one launch's grid y holds (65535): launched in slices of rows.
    (70001, 256, 128, "e4m3", torch.bfloat16, "packed", 0),
    (65537, 64, 32, "e2m1", torch.float32, "colmajor", 0),
    (65536, 128, 16, "e4m3", torch.float32, "plain", 64),
]


@pytest.mark.parametrize("tokens,hidden,C,fmt,dtype,flags,padding", CASES)
def test_per_token_cast_family_matches_reference(tokens, hidden, C, fmt, dtype, flags, padding):
    optimized = _optimized()
    generator = torch.Generator().manual_seed(tokens * 1_000_003 + hidden * 131 + C)
    x = _input(tokens, hidden, dtype, padding, generator)
    kwargs = FLAG_SETS[flags]
    expected_q, expected_sf = reference.per_token_cast(x, fmt, C, **kwargs)
    with poison_outputs():
        q, sf = optimized.per_token_cast(x, fmt, C, **kwargs)
        sf_only = optimized.per_token_cast_with_sf_only(x, fmt, C, **kwargs)
        q_given_sf = optimized.per_token_cast_with_precomputed_sf(x, fmt, C, expected_sf, **kwargs)
        back = optimized.per_token_cast_back((expected_q, expected_sf), "bf16", C)
    _assert_same_bits(q, expected_q, "q")
    _assert_same_bits(sf, expected_sf, "sf")
    _assert_same_bits(sf_only, expected_sf, "sf only")
    expected_given = reference.per_token_cast_with_precomputed_sf(x, fmt, C, expected_sf, **kwargs)
    _assert_same_bits(q_given_sf, expected_given, "q with precomputed sf")
    _assert_same_bits(back, reference.per_token_cast_back((expected_q, expected_sf), "bf16", C), "cast back")


BLOCK_CASES = [
    (tokens, hidden, block, fmt, dtype, flags, padding)
    for tokens, hidden in [(0, 256), (1, 7168), (129, 1000), (300, 4096)]
    for block in ((128, 128), (32, 128), (128, 32), (32, 32))
    for fmt in ("e4m3", "e2m1")
    for dtype in (torch.bfloat16, torch.float32)
    for flags in FLAG_SETS
    for padding in (0, 64)
    if not (padding and flags != "plain")
] + [
    (129, 999, (128, 128), "e4m3", torch.bfloat16, "plain", 1),  # odd hidden: 1-element vectors
    (33, 998, (32, 32), "e2m1", torch.float32, "packed", 2),
]


@pytest.mark.parametrize("tokens,hidden,block,fmt,dtype,flags,padding", BLOCK_CASES)
def test_per_block_cast_family_matches_reference(tokens, hidden, block, fmt, dtype, flags, padding):
    import tileproof.reference.quant_blocks as reference_blocks

    optimized = _optimized()
    generator = torch.Generator().manual_seed(tokens * 1_000_003 + hidden * 131 + block[0] * 7 + block[1])
    x = _input(tokens, hidden, dtype, padding, generator)
    kwargs = FLAG_SETS[flags]
    expected_q, expected_sf = reference_blocks.per_block_cast(x, fmt, block, **kwargs)
    with poison_outputs():
        q, sf = optimized.per_block_cast(x, fmt, block, **kwargs)
        sf_only = optimized.per_block_cast_with_sf_only(x, fmt, block, **kwargs)
        q_given_sf = optimized.per_block_cast_with_precomputed_sf(x, fmt, block, expected_sf, **kwargs)
    _assert_same_bits(q, expected_q, "q")
    _assert_same_bits(sf, expected_sf, "sf")
    _assert_same_bits(sf_only, expected_sf, "sf only")
    expected_given = reference_blocks.per_block_cast_with_precomputed_sf(x, fmt, block, expected_sf, **kwargs)
    _assert_same_bits(q_given_sf, expected_given, "q with precomputed sf")


@pytest.mark.parametrize("tokens,hidden", [(0, 256), (1, 7168), (129, 1000), (300, 4096), (77, 998)])
@pytest.mark.parametrize("num_per_tokens", [32, 128])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_channel_cast_matches_reference(tokens, hidden, num_per_tokens, fmt, dtype):
    import tileproof.reference.quant_blocks as reference_blocks

    generator = torch.Generator().manual_seed(tokens * 1_000_003 + hidden * 131 + num_per_tokens)
    x = _input(tokens, hidden, dtype, 0, generator)
    expected_q, expected_sf = reference_blocks.per_channel_cast(x, fmt, num_per_tokens)
    with poison_outputs():
        q, sf = _optimized().per_channel_cast(x, fmt, num_per_tokens)
    _assert_same_bits(q, expected_q, "q")
    _assert_same_bits(sf, expected_sf, "sf")

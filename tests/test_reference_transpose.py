"""The reference twin of the transpose family, proven on its own (CPU only).

Every check is bitwise: inputs are built as random *integer* bit patterns of the element's width
and reinterpreted as the dtype under test (so FP8/bf16/fp32 inputs contain NaNs, infinities, signed
zeros and subnormals), and the expected result is the transpose of those integers, computed with
plain indexing on the integer tensor, never through a floating-point path.
"""

from __future__ import annotations

import pytest
import torch

from tileproof.reference.transpose import batched_transpose, transpose

WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = (
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
)
# Tails: 0, 1, odd, around 64 and 128, primes.
SHAPES = [(0, 0), (0, 7), (7, 0), (1, 1), (1, 130), (130, 1), (3, 5), (63, 65), (64, 64), (127, 129), (200, 96)]


def random_bits(shape, dtype: torch.dtype, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bits, x)``: random integer patterns of the dtype's width and the same memory as ``dtype``."""
    word = WORD[dtype.itemsize]
    info = torch.iinfo(word)
    bits = torch.randint(info.min, info.max, shape, dtype=torch.int64, generator=generator).to(word)
    return bits, bits.view(dtype)


def expected_transpose(bits: torch.Tensor) -> torch.Tensor:
    """Independent transpose of an integer tensor: gather element (i, j) into (j, i) one row at a time."""
    *batch, rows, cols = bits.shape
    out = torch.zeros((*batch, cols, rows), dtype=bits.dtype)
    for j in range(cols):
        out[..., j, :] = bits[..., :, j]
    return out


def assert_bitwise_transposed(y: torch.Tensor, x: torch.Tensor, bits: torch.Tensor) -> None:
    assert y.dtype == x.dtype
    assert y.shape == (*x.shape[:-2], x.shape[-1], x.shape[-2])
    assert y.is_contiguous()
    if y.numel() > 0:
        assert y.data_ptr() != x.data_ptr()
    assert torch.equal(y.view(bits.dtype), expected_transpose(bits))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_transpose_every_dtype_and_tail(dtype, shape, generator):
    bits, x = random_bits(shape, dtype, generator)
    assert_bitwise_transposed(transpose(x), x, bits)


@pytest.mark.parametrize("dtype", (torch.float8_e4m3fn, torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("shape", [(0, 5, 3), (1, 1, 1), (3, 65, 33), (5, 64, 128), (2, 0, 4)], ids=str)
def test_batched_transpose(dtype, shape, generator):
    bits, x = random_bits(shape, dtype, generator)
    assert_bitwise_transposed(batched_transpose(x), x, bits)


@pytest.mark.parametrize("dtype", (torch.float8_e4m3fn, torch.bfloat16, torch.float32), ids=str)
def test_row_stride_exceeds_row(dtype, generator):
    # x is the left 37 columns of a 100-column buffer: row stride 100 > N = 37.
    bits_wide, wide = random_bits((45, 100), dtype, generator)
    x, bits = wide[:, :37], bits_wide[:, :37]
    assert x.stride() == (100, 1)
    assert_bitwise_transposed(transpose(x), x, bits)
    # Batched: strided rows, and a batch stride that skips every other matrix.
    bits_wide, wide = random_bits((6, 33, 80), dtype, generator)
    x, bits = wide[::2, :, 5:70], bits_wide[::2, :, 5:70]
    assert_bitwise_transposed(batched_transpose(x), x, bits)


def test_special_fp8_codes_survive():
    # Every one of the 256 e4m3 codes (both NaNs 0x7F/0xFF, ±0, subnormals, ±448) comes back unchanged.
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    x = bits.view(torch.float8_e4m3fn)
    assert_bitwise_transposed(transpose(x), x, bits)


def test_nan_payloads_and_signed_zero_survive():
    patterns = [0x7FC00001, 0xFFC00123, 0x7F800001, 0x80000000, 0x00000001, 0x7F800000]
    bits = torch.tensor([patterns], dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    assert_bitwise_transposed(transpose(x), x, bits)


def test_bool_and_complex():
    x = torch.tensor([[True, False, True], [False, False, True]])
    assert torch.equal(transpose(x), x.T)
    z = torch.complex(torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64))
    assert torch.equal(transpose(z).view(torch.int64), z.T.contiguous().view(torch.int64))


@pytest.mark.parametrize("dtype", (torch.float8_e4m3fn, torch.bfloat16), ids=str)
def test_deepseek_shape(dtype, generator):
    # The hidden size of DeepSeek-V3 (7168) with 8192 tokens; checked against an integer transpose.
    bits, x = random_bits((8192, 7168), dtype, generator)
    y = transpose(x)
    assert y.shape == (7168, 8192) and y.is_contiguous()
    assert torch.equal(y.view(bits.dtype), bits.T.contiguous())


def test_size_one_last_dimension_with_odd_stride(generator):
    # A single column taken from a transposed view: its stride along N is 5, which is never used.
    bits, base = random_bits((3, 5), torch.bfloat16, generator)
    x, xbits = base.T[:, :1], bits.T[:, :1]
    assert x.stride(-1) != 1
    assert_bitwise_transposed(transpose(x), x, xbits)


def test_validation():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        transpose([[1, 2]])
    with pytest.raises(ValueError, match="x must be 2-D"):
        transpose(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="x must be 3-D"):
        batched_transpose(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="unit stride in its last dimension"):
        transpose(torch.zeros(4, 6).T)

"""GPU: the optimized ``transpose`` and ``batched_transpose`` agree bit for bit with the reference twin.

Inputs are random bit patterns of the element's width (NaN payloads, signed zeros, every FP8 code)
viewed as the dtype, inside a wider buffer of random bits: a kernel that reads the padding between
rows, converts a value on the way or drops an element shows in the output. Every case runs under
``poison_outputs`` (an element the kernel never writes shows up) and checks that no byte of the
input's buffer changed. The cases cover every element width (complex128 included), 0/1/odd/tail
sizes, every load width (base address and strides aligned to 16, 8, 4, 2, 1 bytes), every store
width (``M · element size`` aligned to 16, 8, 4, 2, 1 bytes), batches beyond grid y's limit, a
zero batch stride, and the DeepSeek-V3 shapes.

The inputs are built on ``DEVICE``; with it set to ``"cpu"``, every case also runs under
``compile_only()`` (or on the CPU emulator in ``scratch/emu_transpose``) on a machine without a GPU.
"""

import pytest
import torch

import tileproof.reference.transpose as reference
from tileproof.optimized.jit import poison_outputs

pytestmark = pytest.mark.gpu

DEVICE = "cuda"  # every input is built on it (a compile-only run on a CPU machine sets "cpu")

DTYPES = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "bool": torch.bool,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "int32": torch.int32,
    "fp64": torch.float64,
    "int64": torch.int64,
    "c128": torch.complex128,
}

# (B (None: transpose), M, N, dtype, row stride (0: N), batch stride (0: M · row stride), element
# offset of x in its buffer (a base address aligned to fewer than 16 bytes)).
CASES = [
    # Every element width; 0, 1, odd and tail sizes on both sides.
    (None, 0, 5, "bf16", 0, 0, 0),
    (None, 5, 0, "e4m3", 0, 0, 0),
    (None, 1, 1, "int8", 0, 0, 0),
    (None, 1, 130, "e4m3", 136, 0, 0),
    (None, 130, 1, "bf16", 0, 0, 0),
    (None, 63, 65, "e4m3", 80, 0, 0),
    (None, 64, 64, "bf16", 0, 0, 0),
    (None, 127, 129, "bf16", 192, 0, 0),
    (None, 200, 96, "e5m2", 0, 0, 0),
    (None, 37, 250, "fp16", 256, 0, 0),
    (None, 65, 33, "int32", 40, 0, 0),
    (None, 33, 70, "fp32", 0, 0, 0),
    (None, 17, 19, "int64", 0, 0, 0),
    (None, 40, 70, "fp64", 72, 0, 0),
    (None, 31, 45, "bool", 48, 0, 0),
    (None, 5, 7, "c128", 9, 0, 0),
    (None, 20, 70, "c128", 0, 0, 1),
    # Store widths: M · size % 16 = 0, 8, 4, 2, 1 (a piece of a stored chunk never straddles M).
    (None, 144, 256, "e4m3", 0, 0, 0),
    (None, 136, 256, "e4m3", 0, 0, 0),
    (None, 132, 200, "e4m3", 0, 0, 0),
    (None, 130, 64, "e4m3", 0, 0, 0),
    (None, 129, 300, "e4m3", 301, 0, 0),
    (None, 99, 130, "bf16", 136, 0, 0),
    (None, 70, 50, "fp32", 0, 0, 0),
    # Load widths: base address or row stride aligned to 1, 2, 4, 8 bytes.
    (None, 130, 260, "e4m3", 272, 0, 3),
    (None, 70, 40, "bf16", 40, 0, 1),
    (None, 33, 40, "bf16", 44, 0, 2),
    (None, 50, 48, "fp32", 50, 0, 0),
    (None, 40, 64, "fp64", 65, 0, 0),
    (None, 64, 128, "e4m3", 132, 0, 0),
    # Batches: empty, single, strided, misaligned, more matrices than grid y's 65535 CTAs.
    (0, 5, 7, "bf16", 0, 0, 0),
    (3, 0, 7, "e4m3", 0, 0, 0),
    (1, 1, 1, "fp32", 0, 0, 0),
    (2, 63, 65, "e4m3", 72, 0, 0),
    (3, 17, 130, "bf16", 0, 17 * 130 + 10, 0),
    (4, 128, 64, "e4m3", 0, 0, 0),
    (2, 33, 31, "fp32", 32, 33 * 32 + 64, 0),
    (5, 7, 9, "int64", 0, 0, 0),
    (3, 5, 7, "c128", 0, 0, 0),
    (2, 256, 300, "bf16", 304, 300 * 304 + 3, 1),
    (70_000, 3, 5, "bf16", 0, 0, 0),
    # DeepSeek-V3: hidden 7168, TileKernels' twice-strided rows, tails, expert batches.
    (None, 8192, 7168, "bf16", 14336, 0, 0),
    (None, 8192, 7168, "e4m3", 14336, 0, 0),
    (None, 8001, 7000, "bf16", 7168, 0, 0),
    (None, 4001, 2050, "e4m3", 2112, 0, 0),
    (8, 4096, 7168, "bf16", 0, 0, 0),
    (32, 1023, 2050, "e4m3", 2112, 0, 0),
]


def _optimized():
    import tileproof.optimized.transpose as optimized

    return optimized


def _random_buffer(elements: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as ``elements`` values of ``dtype`` (bool: 0 or 1 bytes)."""
    raw = torch.randint(0, 256, (elements * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        return (raw & 1).view(torch.bool)
    return raw.view(dtype)


def _input(batch, rows, cols, dtype, row_stride, batch_stride, offset, generator) -> torch.Tensor:
    """x as a view of a random buffer on ``DEVICE``, with the case's strides and element offset."""
    row_stride = row_stride or cols
    span = batch_stride or rows * row_stride
    buffer = _random_buffer(offset + (batch or 1) * span + 16, dtype, generator).to(DEVICE)
    if batch is None:
        return buffer.as_strided((rows, cols), (row_stride, 1), offset)
    return buffer.as_strided((batch, rows, cols), (span, row_stride, 1), offset)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert actual.is_contiguous()
    if actual.numel():
        mismatch = (_bytes(actual) != _bytes(expected)).nonzero()
        assert mismatch.numel() == 0, f"{mismatch.shape[0]} bytes differ, first at byte {mismatch[0].item()}"


def _run(x: torch.Tensor, batched: bool) -> None:
    buffer = torch.empty(0, dtype=torch.uint8, device=x.device).set_(x.untyped_storage())
    buffer_before = buffer.clone()
    name = "batched_transpose" if batched else "transpose"
    expected = getattr(reference, name)(x)
    with poison_outputs():
        out = getattr(_optimized(), name)(x)
    _assert_same_bits(out, expected)
    if out.numel():
        assert out.data_ptr() != x.data_ptr()
    assert torch.equal(buffer, buffer_before), "the input's buffer changed"


@pytest.mark.parametrize("batch,rows,cols,dtype,row_stride,batch_stride,offset", CASES)
def test_transpose_matches_reference(batch, rows, cols, dtype, row_stride, batch_stride, offset):
    generator = torch.Generator().manual_seed(rows * 1_000_003 + cols * 131 + (batch or 0) + offset)
    x = _input(batch, rows, cols, DTYPES[dtype], row_stride, batch_stride, offset, generator)
    _run(x, batched=batch is not None)


@pytest.mark.parametrize("dtype", ["e4m3", "bf16", "fp64"])
def test_zero_strides_are_read_as_given(dtype):
    # An expanded input: batch stride 0 (every matrix the same memory) and, in the row, stride 0 rows.
    generator = torch.Generator().manual_seed(7)
    base = _random_buffer(40 * 70, DTYPES[dtype], generator).to(DEVICE).view(40, 70)
    _run(base.expand(3, 40, 70), batched=True)
    _run(base[:1].expand(40, 70), batched=False)


# --- validation: the same errors as the reference ----------------------------------------------


def _bad_calls(device):
    x = torch.zeros(8, 64, dtype=torch.bfloat16, device=device)
    return [
        ("transpose", (x.tolist(),)),
        ("transpose", (x[None],)),
        ("transpose", (x[0],)),
        ("transpose", (x.T,)),
        ("transpose", (x[:, ::2],)),
        ("batched_transpose", (x,)),
        ("batched_transpose", (x[None].transpose(1, 2),)),
        ("batched_transpose", ("x",)),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls("cpu"))))
def test_invalid_arguments_raise_the_reference_errors(index):
    name, args = _bad_calls(DEVICE)[index]
    with pytest.raises((TypeError, ValueError)) as expected:
        getattr(reference, name)(*args)
    with pytest.raises(expected.type) as actual:
        getattr(_optimized(), name)(*args)
    assert str(actual.value) == str(expected.value)

"""The 32-bit size limit of the optimized kernels (issue 9): every kernel indexes its tensors with
int32 element offsets, so a tensor spanning more than 2**31 - 1 elements is refused with a
``ValueError`` before any launch (optimized/jit.py, ``DirectLaunch``), and one just below the limit
is computed correctly (launchers that split their work, like per_token_cast, also take larger
inputs). The reference twin is plain PyTorch (64-bit indexing) and has no limit."""

from __future__ import annotations

import pytest
import torch

from tileproof.optimized import jit

LIMIT = jit.MAX_KERNEL_TENSOR_ELEMENTS
HIDDEN = 7168


class _RecordingKernel:
    """Stands in for a compiled kernel: records the launch (no adapter, so DirectLaunch calls it)."""

    def __init__(self):
        self.launched = False

    def __call__(self, *args):
        self.launched = True


def test_the_limit_is_the_largest_int32():
    assert LIMIT == torch.iinfo(torch.int32).max


def test_a_tensor_at_the_limit_is_launched():
    kernel = _RecordingKernel()
    jit.DirectLaunch(kernel)(torch.empty(LIMIT, dtype=torch.uint8, device="meta"), 3)
    assert kernel.launched


def test_a_tensor_past_the_limit_is_refused_before_the_launch():
    kernel = _RecordingKernel()
    huge = torch.empty(LIMIT + 1, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match=r"argument 1 spans 2147483648 elements.*32-bit offsets"):
        jit.DirectLaunch(kernel)(torch.empty(4, device="meta"), huge)
    assert not kernel.launched


@pytest.mark.compile
def test_the_refusal_names_the_kernel_parameter():
    """A real compiled kernel (for sm_90a; nothing runs): the message names its parameter."""
    from tileproof.optimized import engram

    kernel = engram.hash_kernel.__wrapped__()
    ids = torch.empty(LIMIT + 1, dtype=torch.int32, device="meta")
    small = torch.empty(8, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=r"^ids spans 2147483648 elements"):
        jit.DirectLaunch(kernel)(ids, small, small, small, small, 1, 1, 2, 1, 1, 1)


def _rows_for(elements: int, element_bytes: int = 1) -> int:
    return elements // (HIDDEN * element_bytes)


@pytest.mark.gpu
def test_gpu_transpose_past_the_limit_is_refused():
    """transpose moves bytes: its kernel reads ``x`` as uint8, so the limit is 2**31 - 1 bytes."""
    from tileproof.optimized import transpose

    x = torch.empty(_rows_for(LIMIT, 2) + 1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=r"^x spans \d+ elements as the kernel reads it.*32-bit offsets"):
        transpose.transpose(x)


@pytest.mark.gpu
def test_gpu_transpose_just_below_the_limit_is_exact():
    """One launch whose byte offsets reach within 14 KiB of 2**31: the last rows of ``x`` (the last
    columns of ``out``) are where an offset formed in int32 past the limit would go wrong."""
    from tileproof.optimized import transpose

    rows = _rows_for(LIMIT, 2)
    x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device="cuda", generator=_generator())
    assert LIMIT - 2 * HIDDEN < x.numel() * 2 <= LIMIT
    out = transpose.transpose(x)
    for part in (slice(0, 3), slice(rows - 3, rows)):
        assert torch.equal(out[:, part], x[part].t())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_gpu_per_token_cast_past_the_limit_is_exact(fmt):
    """per_token_cast launches at most 65535 rows at a time (grid y), each launch on views that
    start at its first row, so no launch comes near the limit and inputs past 2**31 elements work."""
    from tileproof.optimized import quant
    from tileproof.reference import quant as reference

    rows = _rows_for(LIMIT) + 1
    x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device="cuda", generator=_generator())
    assert x.numel() > LIMIT
    data, sf = quant.per_token_cast(x, fmt, 32)
    for part in (slice(0, 3), slice(rows - 3, rows)):
        expected_data, expected_sf = reference.per_token_cast(x[part], fmt, 32)
        assert torch.equal(data[part].view(torch.uint8), expected_data.view(torch.uint8))
        assert torch.equal(sf[part], expected_sf)


def _generator() -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(9)

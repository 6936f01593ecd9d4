"""GPU: the optimized expand / reduce kernels of the expert-major layout (``expand_to_fused``,
``expand_to_fused_with_sf``, ``reduce_fused``) agree bit for bit with the reference twin
(reduce: any NaN equals any NaN, as the oracle's policy says).

Every case runs under ``poison_outputs``, so a byte the kernels never write shows up. Mappings come
from the reference ``get_fused_mapping`` (a quarter of the slots ``-1``, extra padding rows past the
last segment), so positions are unique and padding rows exist. Inputs are built on the CPU from a
seeded generator and moved to ``DEVICE``; with it set to ``"cpu"`` every case also runs under
``compile_only()`` on a CPU machine (which checks that every kernel configuration compiles).
"""

import subprocess
import sys
import zlib
from contextlib import nullcontext
from unittest import mock

import pytest
import torch

import tileproof.reference.moe as reference
from tileproof.optimized.jit import poison_outputs

pytestmark = pytest.mark.gpu

DEVICE = "cuda"  # every input is built on it (a compile-only run on a CPU machine sets "cpu")
_DS = 7168  # DeepSeek-V3 hidden size


def _optimized():
    import tileproof.optimized.moe as optimized

    return optimized


def _generator(*params) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def _mapping(tokens, experts, topk, alignment, extra, generator, index_dtype=torch.int32):
    """(token_topk_to_pos [T, k], pos_to_expert [P]) of a random routing: each token ``topk``
    distinct experts in random order, about a quarter of the slots ``-1``; P is the exact size
    plus ``extra`` padding rows."""
    if tokens:
        idx = torch.stack([torch.randperm(experts, generator=generator)[:topk] for _ in range(tokens)])
    else:
        idx = torch.empty(0, topk, dtype=torch.int64)
    idx = idx.masked_fill(torch.rand(idx.shape, generator=generator) < 0.25, -1)
    exact = reference.get_fused_mapping(idx, experts, 0, alignment)[0].shape[0]
    rows = exact + extra
    mapping = reference.get_fused_mapping(idx, experts, rows, alignment) if rows else None
    token_topk_to_pos = mapping[3] if mapping else torch.full((tokens, topk), -1, dtype=torch.int32)
    pos_to_expert = mapping[0] if mapping else torch.empty(0, dtype=torch.int32)
    return token_topk_to_pos.to(index_dtype).to(DEVICE), pos_to_expert.to(DEVICE)


def _rows(rows, hidden, dtype, row_stride, generator):
    """``[rows, hidden]`` of ``dtype``, a view of a wider buffer when ``row_stride`` is set; floats
    4·N(0, 1) (inf and NaN in a few places), other dtypes random bytes (every e4m3 code)."""
    width = row_stride or hidden
    if dtype.is_floating_point and dtype.itemsize > 1:
        wide = 4.0 * torch.randn(rows, width, generator=generator)
        if rows > 2 and hidden > 3:
            wide[1, 2], wide[2, 3] = float("inf"), float("nan")
        wide = wide.to(dtype)
    else:
        wide = torch.randint(0, 256, (rows, width * dtype.itemsize), generator=generator, dtype=torch.uint8)
        wide = wide.view(dtype)
    return wide.to(DEVICE)[:, :hidden]


def _bits(tensor):
    flat = tensor.reshape(-1)
    flat = torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat)
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def _meaningful_strides(tensor):
    return tuple(stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size > 1)


def _assert_same_bits(actual, expected, what, nan_equal=False):
    """Same dtype, shape, strides and bits (``nan_equal``: any NaN matches any NaN)."""
    assert actual.dtype == expected.dtype, what
    assert actual.shape == expected.shape, what
    if actual.numel():
        assert _meaningful_strides(actual) == _meaningful_strides(expected), what
        a, e = _bits(actual), _bits(expected)
        if nan_equal and actual.dtype.is_floating_point:
            both_nan = torch.isnan(actual.float()).reshape(-1) & torch.isnan(expected.float()).reshape(-1)
            a, e = a.masked_fill(both_nan, 0), e.masked_fill(both_nan, 0)
        mismatch = (a != e).nonzero()
        assert mismatch.numel() == 0, f"{what}: {mismatch.shape[0]} elements differ, first at {mismatch[0].tolist()}"


def _stale_scratch(tokens, topk, generator):
    """A replacement for the kernels' uninitialised scratch: slot numbers in and around ``[0, T·k)``,
    as left over by an earlier call, which the padding test must see through."""

    def scratch(rows, device):
        return torch.randint(-2, tokens * topk + 2, (rows,), generator=generator, dtype=torch.int32).to(device)

    return scratch


# --- expand_to_fused ---------------------------------------------------------------------------
# (tokens, hidden, dtype, row_stride, topk, experts, alignment, extra rows, index dtype). Row bytes
# cover every vector width (16: bf16 x 200; 8: fp32 x 14 with stride 18; 4: fp32 x 13 with stride 17;
# 2: int16 x 3; 1: e4m3 x 37), 0 / 1 / odd tokens, k = 1 .. 9, int64 positions.
EXPAND_CASES = [
    (0, 64, torch.bfloat16, 0, 2, 8, 4, 5, torch.int32),
    (1, _DS, torch.bfloat16, 0, 8, 256, 128, 0, torch.int32),
    (7, 200, torch.bfloat16, 264, 3, 8, 4, 3, torch.int64),
    (33, 576, torch.float8_e4m3fn, 0, 6, 64, 64, 17, torch.int32),
    (9, 37, torch.float8_e4m3fn, 0, 2, 8, 1, 4, torch.int32),
    (5, 13, torch.float32, 17, 1, 4, 2, 2, torch.int32),
    (6, 14, torch.float32, 18, 2, 4, 2, 2, torch.int32),
    (6, 3, torch.int16, 0, 4, 4, 2, 1, torch.int64),
    (129, 1100, torch.bfloat16, 0, 9, 16, 8, 9, torch.int32),
    (300, 4096, torch.float16, 4160, 8, 32, 128, 64, torch.int32),
    (77, 2048, torch.float64, 0, 2, 16, 1, 0, torch.int32),
    (4001, _DS, torch.bfloat16, 0, 8, 256, 128, 128, torch.int32),
    (8192, _DS, torch.bfloat16, 0, 8, 256, 128, 32512, torch.int32),
]


@pytest.mark.parametrize("tokens,hidden,dtype,row_stride,topk,experts,alignment,extra,index_dtype", EXPAND_CASES)
@pytest.mark.parametrize("stale", [False, True])
def test_expand_to_fused_matches_reference(
    tokens, hidden, dtype, row_stride, topk, experts, alignment, extra, index_dtype, stale
):
    generator = _generator(tokens, hidden, dtype, topk, experts)
    pos, pos_to_expert = _mapping(tokens, experts, topk, alignment, extra, generator, index_dtype)
    x = _rows(tokens, hidden, dtype, row_stride, generator)
    expected = reference.expand_to_fused(x, pos, pos_to_expert)
    optimized = _optimized()
    scratch = _stale_scratch(tokens, topk, generator)
    with poison_outputs(), mock.patch.object(optimized.fused, "_row_slot_scratch", scratch) if stale else nullcontext():
        out = optimized.expand_to_fused(x, pos, pos_to_expert)
    _assert_same_bits(out, expected, "out")


def test_expand_uses_only_the_length_of_pos_to_expert():
    """Padding is whatever no slot points to (the reference's rule), not ``pos_to_expert < 0``:
    a ``pos_to_expert`` of all zeros, or all ``-1``, gives the same rows."""
    generator = _generator("length-only")
    pos, pos_to_expert = _mapping(50, 16, 4, 8, 20, generator)
    x = _rows(50, 256, torch.bfloat16, 0, generator)
    expected = reference.expand_to_fused(x, pos, pos_to_expert)
    for fake in (torch.zeros_like(pos_to_expert), torch.full_like(pos_to_expert, -1)):
        with poison_outputs():
            out = _optimized().expand_to_fused(x, pos, fake)
        _assert_same_bits(out, expected, "out")


def test_expand_reads_strided_positions():
    """``token_topk_to_pos`` as a column-major view and as a column slice of a wider tensor."""
    generator = _generator("strided-positions")
    pos, pos_to_expert = _mapping(40, 16, 3, 4, 7, generator)
    x = _rows(40, 320, torch.bfloat16, 0, generator)
    expected = reference.expand_to_fused(x, pos, pos_to_expert)
    wide = torch.full((40, 5), -1, dtype=torch.int32, device=pos.device)
    wide[:, 1:4] = pos
    for view in (pos.T.contiguous().T, wide[:, 1:4]):
        with poison_outputs():
            out = _optimized().expand_to_fused(x, view, pos_to_expert)
        _assert_same_bits(out, expected, "out")


def test_column_major_rows_are_accepted():
    """x with a non-unit inner stride (the reference takes any layout): copied to a contiguous
    tensor first, same results."""
    generator = _generator("column-major")
    pos, pos_to_expert = _mapping(24, 8, 2, 4, 3, generator)
    x = _rows(96, 24, torch.bfloat16, 0, generator).T
    expanded = _rows(pos_to_expert.shape[0], 40, torch.float32, 0, generator).T.contiguous().T
    weights = torch.rand(24, 2, generator=generator).to(DEVICE)
    with poison_outputs():
        out = _optimized().expand_to_fused(x, pos, pos_to_expert)
        reduced = _optimized().reduce_fused(expanded, weights, pos)
    _assert_same_bits(out, reference.expand_to_fused(x, pos, pos_to_expert), "expand")
    _assert_same_bits(reduced, reference.reduce_fused(expanded, weights, pos), "reduce", nan_equal=True)


# A position outside [-1, P) in a process of its own: the device-side assertion it triggers leaves
# the CUDA context unusable.
_OUT_OF_RANGE = """
import torch
from tileproof.optimized.moe import expand_to_fused, reduce_fused
pos = torch.tensor([[0, 1], [2, {bad}]], dtype=torch.int32, device="cuda")
if "{op}" == "expand":
    expand_to_fused(torch.ones(2, 64, device="cuda"), pos, torch.zeros(4, dtype=torch.int32, device="cuda"))
else:
    reduce_fused(torch.ones(4, 64, device="cuda"), None, pos)
torch.cuda.synchronize()
"""


@pytest.mark.parametrize("op,bad", [("expand", 4), ("reduce", -2)])
def test_positions_out_of_range_stop_the_kernel(op, bad):
    """Position values are not checked on the host (that takes a synchronisation): an entry
    outside ``[-1, P)`` stops the kernel with a device-side assertion (the reference raises
    ``ValueError``)."""
    if DEVICE != "cuda":
        pytest.skip("needs a CUDA GPU")
    script = _OUT_OF_RANGE.format(op=op, bad=bad)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode != 0, f"{op} accepted position {bad}"
    assert "assert" in (result.stdout + result.stderr).lower(), result.stderr[-2000:]


# --- expand_to_fused_with_sf -------------------------------------------------------------------
# (tokens, hidden, num_per_channels, scales, use_tma_aligned_col_major_sf, input scale layout):
# scales "fp32" or "packed" (int32 UE8M0 words), input scales row-major or column-major
# (``[T, H_sf]`` with strides ``(1, align(T, 4))``, as the casts write them).
EXPAND_SF_CASES = [
    (0, 128, 128, "fp32", False, "row"),
    (1, _DS, 128, "fp32", True, "row"),
    (7, 256, 32, "packed", True, "row"),
    (33, 576, 128, "fp32", True, "col"),
    (129, 200, 32, "fp32", False, "row"),
    (65, _DS, 32, "fp32", False, "col"),
    (4001, _DS, 128, "packed", True, "col"),
]


def _scales(tokens, columns, kind, layout, generator):
    if kind == "packed":
        values = torch.randint(0, 2**31 - 1, (tokens, columns), generator=generator, dtype=torch.int32)
    else:
        values = torch.rand(tokens, columns, generator=generator) + 0.5
    if layout == "row":
        return values.to(DEVICE)
    storage = torch.zeros(columns, (tokens + 3) // 4 * 4, dtype=values.dtype)
    storage[:, :tokens] = values.T
    return storage.to(DEVICE)[:, :tokens].T


@pytest.mark.parametrize("tokens,hidden,num_per_channels,kind,col_major,layout", EXPAND_SF_CASES)
def test_expand_to_fused_with_sf_matches_reference(tokens, hidden, num_per_channels, kind, col_major, layout):
    generator = _generator(tokens, hidden, num_per_channels, kind, col_major, layout)
    pos, pos_to_expert = _mapping(tokens, 64, 6, 16, 11, generator)
    data = _rows(tokens, hidden, torch.float8_e4m3fn, 0, generator)
    blocks = -(-hidden // num_per_channels)
    sf = _scales(tokens, -(-blocks // 4) if kind == "packed" else blocks, kind, layout, generator)
    expected_out, expected_sf = reference.expand_to_fused_with_sf(
        (data, sf), num_per_channels, pos, pos_to_expert, col_major
    )
    scratch = _stale_scratch(tokens, 6, generator)
    with poison_outputs(), mock.patch.object(_optimized().fused, "_row_slot_scratch", scratch):
        out, out_sf = _optimized().expand_to_fused_with_sf((data, sf), num_per_channels, pos, pos_to_expert, col_major)
    _assert_same_bits(out, expected_out, "out")
    _assert_same_bits(out_sf, expected_sf, "out_sf")


# --- reduce_fused ------------------------------------------------------------------------------
# (tokens, hidden, dtype, topk, experts, alignment, weights, x_sf, fp8, sf, index dtype, row stride).
# Vectors of 8 (bf16 / fp16 x 16 bytes), 4 (fp32), 2 and 1 elements; k = 1 .. 9 (9: two slot
# batches); fp32 outputs show any FMA that is not one fused rounding; sf = 128 saturates e4m3.
REDUCE_CASES = [
    (0, 64, torch.bfloat16, 2, 8, 4, True, False, False, False, torch.int32, 0),
    (1, _DS, torch.bfloat16, 8, 256, 128, True, False, False, False, torch.int32, 0),
    (7, 200, torch.bfloat16, 3, 8, 4, True, True, True, True, torch.int32, 0),
    (33, 64, torch.float32, 9, 16, 8, False, False, True, False, torch.int64, 0),
    (9, 37, torch.float32, 9, 16, 1, True, True, False, True, torch.int32, 0),
    (5, 130, torch.float16, 6, 8, 2, False, True, False, False, torch.int32, 0),
    (17, 1030, torch.bfloat16, 8, 16, 2, True, False, True, True, torch.int32, 0),
    (11, 21, torch.bfloat16, 2, 8, 2, True, False, False, True, torch.int32, 0),
    (65, 512, torch.bfloat16, 1, 8, 4, True, True, False, False, torch.int64, 640),
    (129, 4096, torch.float32, 8, 32, 128, True, True, False, True, torch.int32, 0),
    (300, 2048, torch.float16, 6, 64, 64, True, False, True, True, torch.int32, 0),
    (4001, _DS, torch.bfloat16, 8, 256, 128, True, False, False, False, torch.int32, 0),
    (8192, _DS, torch.bfloat16, 8, 256, 128, True, False, True, True, torch.int32, 0),
]


def _reduce_inputs(tokens, hidden, dtype, topk, experts, alignment, weights, x_sf, fp8, sf, index_dtype, row_stride):
    generator = _generator(tokens, hidden, dtype, topk, experts, weights, x_sf, fp8, sf)
    pos, pos_to_expert = _mapping(tokens, experts, topk, alignment, 7, generator, index_dtype)
    rows = pos_to_expert.shape[0]
    x = _rows(rows, hidden, dtype, row_stride, generator)
    used = torch.zeros(rows, dtype=torch.bool, device=x.device)
    used[pos[pos >= 0].long()] = True
    x[~used] = float("nan")  # rows no slot points to: never read
    topk_weights = None
    if weights:
        # A strided view (the columns of a wider tensor), as a router's output slice would be.
        topk_weights = (torch.rand(tokens, topk + 2, generator=generator) + 0.01).to(DEVICE)[:, 1 : topk + 1]
    data = x
    if x_sf:
        scales = (torch.rand(rows, generator=generator) + 0.5).to(DEVICE).masked_fill(~used, float("nan"))
        data = (x, scales)
    multiplier = torch.tensor([128.0 if fp8 else 0.75], device=DEVICE) if sf else None
    return data, topk_weights, pos, "e4m3" if fp8 else "", multiplier


@pytest.mark.parametrize(
    "tokens,hidden,dtype,topk,experts,alignment,weights,x_sf,fp8,sf,index_dtype,row_stride", REDUCE_CASES
)
def test_reduce_fused_matches_reference(
    tokens, hidden, dtype, topk, experts, alignment, weights, x_sf, fp8, sf, index_dtype, row_stride
):
    args = _reduce_inputs(
        tokens, hidden, dtype, topk, experts, alignment, weights, x_sf, fp8, sf, index_dtype, row_stride
    )
    expected = reference.reduce_fused(*args)
    with poison_outputs():
        out = _optimized().reduce_fused(*args)
    _assert_same_bits(out, expected, "out", nan_equal=True)


def test_reduce_of_an_expand_is_deterministic_and_exact_for_one_slot():
    """k = 1 with weight 1: reduce(expand(x)) gives x back bit for bit (one FMA with 1.0 onto +0),
    and two calls give the same bits."""
    generator = _generator("round-trip")
    pos, pos_to_expert = _mapping(70, 8, 1, 4, 3, generator)
    x = _rows(70, 1000, torch.bfloat16, 0, generator)
    ones = torch.ones(70, 1, device=x.device)
    optimized = _optimized()
    with poison_outputs():
        expanded = optimized.expand_to_fused(x, pos, pos_to_expert)
        first = optimized.reduce_fused(expanded, ones, pos)
        second = optimized.reduce_fused(expanded, ones, pos)
    has_slot = (pos >= 0).reshape(-1)
    expected = torch.where(has_slot[:, None], x, torch.zeros_like(x))
    _assert_same_bits(first, expected, "round trip", nan_equal=True)
    _assert_same_bits(second, first, "second call", nan_equal=True)


# --- validation: the same errors as the reference ----------------------------------------------


def _bad_calls(device):
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device=device)
    pos = torch.tensor([[0, 1], [2, -1], [3, 4], [-1, 5]], dtype=torch.int32, device=device)
    pos_to_expert = torch.zeros(8, dtype=torch.int32, device=device)
    sf = torch.ones(4, 1, device=device)
    expanded = torch.zeros(8, 64, dtype=torch.bfloat16, device=device)
    weights = torch.ones(4, 2, device=device)
    return [
        ("expand_to_fused", (x[0], pos, pos_to_expert)),
        ("expand_to_fused", (x, pos.float(), pos_to_expert)),
        ("expand_to_fused", (x, pos[:3], pos_to_expert)),
        ("expand_to_fused", (x, pos, pos_to_expert.float())),
        ("expand_to_fused", (x, pos[:, 0], pos_to_expert)),
        ("expand_to_fused", ([x], pos, pos_to_expert)),
        ("expand_to_fused_with_sf", (x, 128, pos, pos_to_expert)),
        ("expand_to_fused_with_sf", ((x, sf[:3]), 128, pos, pos_to_expert)),
        ("expand_to_fused_with_sf", ((x, sf), 0, pos, pos_to_expert)),
        ("expand_to_fused_with_sf", ((x, sf), True, pos, pos_to_expert)),
        ("expand_to_fused_with_sf", ((x, sf), 128, pos, pos_to_expert, 1)),
        ("expand_to_fused_with_sf", ((x, sf[:, 0]), 128, pos, pos_to_expert)),
        ("reduce_fused", (expanded.to(torch.float8_e4m3fn), weights, pos)),
        ("reduce_fused", ((expanded,), weights, pos)),
        ("reduce_fused", (expanded, weights, pos, "e5m2")),
        ("reduce_fused", (expanded, weights, pos.float())),
        ("reduce_fused", ((expanded, torch.ones(7, device=device)), weights, pos)),
        ("reduce_fused", ((expanded, torch.ones(8, device=device).double()), weights, pos)),
        ("reduce_fused", (expanded, weights[:, :1], pos)),
        ("reduce_fused", (expanded, weights.double(), pos)),
        ("reduce_fused", (expanded, weights, pos, "", torch.ones(2, device=device))),
        ("reduce_fused", (expanded, weights, pos, "e4m3", torch.ones(1, 1, device=device))),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls("cpu"))))
def test_invalid_arguments_raise_the_reference_errors(index):
    name, args = _bad_calls(DEVICE)[index]
    with pytest.raises((TypeError, ValueError)) as expected:
        getattr(reference, name)(*args)
    with pytest.raises(expected.type) as actual:
        getattr(_optimized(), name)(*args)
    assert str(actual.value) == str(expected.value)

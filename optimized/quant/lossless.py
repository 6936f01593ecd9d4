"""Lossless FP4 → FP8 re-quantization (``per_block_cast_lossless``): TileLang kernels and launcher.

The rule (``tileproof.reference.quant_blocks.per_block_cast_lossless``): with ``E_in`` the biased
exponent of an input block's power-of-two scale, every output block gets ``E_out = max(E_in over its
input blocks) - 6``, at least 1, and every FP4 value ``v`` becomes the e4m3 value ``v · 2^(E_in -
E_out)``, exactly; an input e4m3 cannot hold exactly is refused, as is a scale that is not a
positive normal power of two.

Kernel design, two launches (an output block is a union of whole input blocks of any shape the
casts make, so its exponent maximum is a reduction over a rectangle of the input scale grid):

1. ``exponent_kernel``: a group of ``G`` lanes (a power of two up to 32, a runtime value: the
   input blocks an output block covers, rounded up) reads the covered input scales, validates each,
   reduces the maximum exponent with ``shfl_xor`` inside the group, and its first lane stores the
   output scale (fp32 ``2^(E_out - 127)`` or the packed byte ``E_out``). Reads the input scales once.
2. ``convert_kernel``: elementwise, ``vector`` (16) values per thread-vector: one 8-byte load of
   FP4 codes and one 16-byte store of e4m3 bytes. ``E_in`` is read from the input scales and
   ``E_out`` back from the output scales of step 1 (one of each per vector, or per element for
   blocks one column wide); block indices are runtime shifts, as in ``cast_back``. The conversion
   is one exact fp32 multiply by ``2^d`` and the e4m3 conversion of an exactly representable value.
   The exactness test is on integers: a nonzero FP4 value is ``odd · 2^k`` (odd ∈ {1, 3}), and
   ``odd · 2^(k + d)`` is an e4m3 value iff ``k + d >= -9`` (e4m3's subnormal step is 2^-9, and
   ``d <= 6`` keeps it below 448). The second read of the input scales mostly hits L2.

The refusal: a kernel cannot raise, so both kernels record the first offending position (row-major,
as the reference reports it) with a 64-bit ``atomicMin`` of ``row << 32 | column`` in a small
device status tensor, and the launcher reads it back: **one device-to-host synchronization per
call**, on the common path too (there is no way to raise a Python exception about device data
without one; the alternative, a device-side trap as TileKernels does, kills the CUDA context). Only
when a position was recorded does the launcher read the few values its message names.
"""

import tilelang.language as T
import torch

from tileproof.reference.contract import (
    E2M1,
    E2M1_GRID,
    E4M3,
    UE8M0_NAN,
    ScaleLayout,
    ceil_div,
    check_choice,
    check_out_block_size,
    check_power_of_two_scales,
    check_quantized_input,
    check_scale_flags,
    infer_scale_layout,
)
from tileproof.reference.quant_blocks import FP8_ONLY, LOSSLESS_EXPONENT_HEADROOM

from ..jit import address, compiling_only, flat_view, jit, new_output, require_cuda
from .common import e2m1_value
from .dequantize import WHOLE_ROW_SHIFT, _log2_block
from .per_token import packed_scale_index

THREADS = 256
ITEMS = 2
WIDEST_VECTOR = 16  # e4m3 outputs per thread-vector: one 16-byte store, one 8-byte FP4 load
NO_POSITION = 2**63 - 1  # the status words' initial value: larger than every row << 32 | column
# e4m3's smallest subnormal is 2^-9: odd · 2^j is an e4m3 value iff j >= -9 (odd ∈ {1, 3}, j <= 7).
E4M3_LOWEST_EXPONENT = -9
# Shifts outside [-20, 6] only occur for refused inputs; clamping keeps 2^d a normal fp32 there.
SHIFT_RANGE = (-20, LOSSLESS_EXPONENT_HEADROOM)
STATUS_BAD_SCALE, STATUS_INEXACT = 0, 1


def _exponent_of(sf, scale_row, kblock, row_stride, kblock_stride, packed: bool):
    """Biased exponent (int32) of a stored scale: the packed byte, or bits 30..23 of the fp32."""
    if packed:
        return T.cast(sf[packed_scale_index(scale_row, kblock, row_stride)], "int32")
    return (T.reinterpret(sf[scale_row * row_stride + kblock * kblock_stride], "int32") >> 23) & 0xFF


def _invalid_scale(sf, scale_row, kblock, row_stride, kblock_stride, exponent, packed: bool):
    """Not a positive normal power of two (2^-126 .. 2^127): a byte 0 or 0xFF, or an fp32 with a
    sign or mantissa bit set or a zero / all-ones exponent."""
    outside = T.Or(exponent < 1, exponent > 254)
    if packed:
        return outside
    bits = T.reinterpret(sf[scale_row * row_stride + kblock * kblock_stride], "int32")
    return T.Or(outside, (bits & T.int32(-0x7F800001)) != 0)  # -0x7F800001: the bits 0x807FFFFF


def _position(row, column):
    return (T.cast(row, "uint64") << 32) | T.cast(column, "uint64")


@jit()
def exponent_kernel(in_packed: bool, out_packed: bool, threads: int = THREADS):
    """Output scales from the input scales; also validates every input scale. Grid: (output scale
    rows, groups of output blocks along a row); every size, stride and the group shape is runtime."""
    in_dtype = "uint8" if in_packed else "float32"
    out_dtype = "uint8" if out_packed else "float32"

    in_span = T.dynamic("in_span")
    out_span = T.dynamic("out_span")

    @T.prim_func
    def kernel(
        sf_in: T.Tensor((in_span,), in_dtype),
        sf_out: T.Tensor((out_span,), out_dtype),
        status: T.Tensor((2,), "uint64"),
        in_rows: T.int32,
        in_kblocks: T.int32,
        out_rows: T.int32,
        out_kblocks: T.int32,
        in_row_stride: T.int32,
        in_kblock_stride: T.int32,
        out_row_stride: T.int32,
        out_kblock_stride: T.int32,
        cover_rows: T.int32,
        cover_columns: T.int32,
        cover_columns_shift: T.int32,
        cover_columns_mask: T.int32,
        group_shift: T.int32,
        rounds: T.int32,
    ):
        with T.Kernel(out_rows, T.ceildiv(out_kblocks, threads >> group_shift), threads=threads) as (
            out_row,
            part,
        ):
            tx = T.get_thread_binding()
            group_lanes = 1 << group_shift
            lane = tx & (group_lanes - 1)
            out_kblock = part * (threads >> group_shift) + (tx >> group_shift)
            largest = T.alloc_local((1,), "int32")
            largest[0] = 0
            # Covered input block s of the group: row s >> shift, column s & mask (the shift is 31
            # and the mask 0x7FFFFFFF when the cover is a single input row).
            for round_index in T.serial(rounds):
                covered = round_index * group_lanes + lane
                scale_row = out_row * cover_rows + (covered >> cover_columns_shift)
                kblock = out_kblock * cover_columns + (covered & cover_columns_mask)
                if (
                    out_kblock < out_kblocks
                    and covered < cover_rows * cover_columns
                    and scale_row < in_rows
                    and kblock < in_kblocks
                ):
                    exponent = _exponent_of(sf_in, scale_row, kblock, in_row_stride, in_kblock_stride, in_packed)
                    if _invalid_scale(sf_in, scale_row, kblock, in_row_stride, in_kblock_stride, exponent, in_packed):
                        T.atomic_min(status[STATUS_BAD_SCALE], _position(scale_row, kblock))
                    largest[0] = T.max(largest[0], exponent)
            for step in T.unroll(5):
                if (1 << step) < group_lanes:
                    largest[0] = T.max(largest[0], T.shfl_xor(largest[0], 1 << step))
            if lane == 0 and out_kblock < out_kblocks:
                exponent_out = T.max(largest[0] - LOSSLESS_EXPONENT_HEADROOM, 1)
                if out_packed:
                    byte = packed_scale_index(out_row, out_kblock, out_row_stride)
                    sf_out[byte] = T.cast(exponent_out, "uint8")
                    if out_kblock == out_kblocks - 1:
                        # The contract wants the unused bytes of the last word zeroed.
                        for spare in T.unroll(1, 4):
                            if out_kblock % 4 + spare < 4:
                                sf_out[byte + spare] = T.uint8(0)
                else:
                    sf_out[out_row * out_row_stride + out_kblock * out_kblock_stride] = T.reinterpret(
                        exponent_out << 23, "float32"
                    )

    return kernel


@jit()
def convert_kernel(
    vector: int,
    in_packed: bool,
    out_packed: bool,
    in_per_element: bool,
    out_per_element: bool,
    threads: int = THREADS,
    items: int = ITEMS,
):
    """FP4 codes → e4m3 bytes, exactly, with the exponents of both scale grids. Grid: (rows,
    column parts): rows on x, so any token count fits. The FP4 row stride counts vectors."""
    stored_per_vector = vector // 2
    in_dtype = "uint8" if in_packed else "float32"
    out_dtype = "uint8" if out_packed else "float32"
    in_width = vector if in_per_element else 1
    out_width = vector if out_per_element else 1

    q_span = T.dynamic("q_span")
    in_span = T.dynamic("in_span")
    out_span = T.dynamic("out_span")
    q8_span = T.dynamic("q8_span")

    def block_of(column, column_shift, per_element: bool):
        return column if per_element else column >> column_shift

    def of_element(exponents, item, e, per_element: bool):
        return exponents[item, e] if per_element else exponents[item, 0]

    @T.prim_func
    def kernel(
        q: T.Tensor((q_span,), "uint8"),
        sf_in: T.Tensor((in_span,), in_dtype),
        sf_out: T.Tensor((out_span,), out_dtype),
        q8: T.Tensor((q8_span,), "float8_e4m3"),
        status: T.Tensor((2,), "uint64"),
        hidden_vectors: T.int32,
        q_row_stride_vectors: T.int32,
        in_row_stride: T.int32,
        in_kblock_stride: T.int32,
        out_row_stride: T.int32,
        out_kblock_stride: T.int32,
        in_row_shift: T.int32,
        in_column_shift: T.int32,
        out_row_shift: T.int32,
        out_column_shift: T.int32,
        num_tokens: T.int32,
    ):
        with T.Kernel(num_tokens, T.ceildiv(hidden_vectors, threads * items), threads=threads) as (row, part):
            tx = T.get_thread_binding()
            codes = T.alloc_local((items, stored_per_vector), "uint8")
            exponent_in = T.alloc_local((items, in_width), "int32")
            exponent_out = T.alloc_local((items, out_width), "int32")
            converted = T.alloc_local((vector,), "float8_e4m3")
            q_row = T.cast(row, "int64") * q_row_stride_vectors * stored_per_vector
            q8_row = T.cast(row, "int64") * hidden_vectors * vector
            in_scale_row = row >> in_row_shift
            out_scale_row = row >> out_row_shift

            # Issue every load (codes and both exponents) before using any of them.
            for item in T.unroll(items):
                column_vector = (part * items + item) * threads + tx
                if column_vector < hidden_vectors:
                    for e in T.vectorized(stored_per_vector):
                        codes[item, e] = q[q_row + column_vector * stored_per_vector + e]
                    for e in T.unroll(in_width):
                        kblock = block_of(column_vector * vector + e, in_column_shift, in_per_element)
                        exponent_in[item, e] = _exponent_of(
                            sf_in, in_scale_row, kblock, in_row_stride, in_kblock_stride, in_packed
                        )
                    for e in T.unroll(out_width):
                        kblock = block_of(column_vector * vector + e, out_column_shift, out_per_element)
                        exponent_out[item, e] = _exponent_of(
                            sf_out, out_scale_row, kblock, out_row_stride, out_kblock_stride, out_packed
                        )

            for item in T.unroll(items):
                column_vector = (part * items + item) * threads + tx
                if column_vector < hidden_vectors:
                    for e in T.unroll(vector):
                        code = (T.cast(codes[item, e // 2], "uint32") >> ((e % 2) * 4)) & 0xF
                        shift = of_element(exponent_in, item, e, in_per_element) - of_element(
                            exponent_out, item, e, out_per_element
                        )
                        # A nonzero FP4 magnitude m is odd · 2^k with k = max(m >> 1, 1) - 1 - (m & 1).
                        magnitude = T.cast(code & 7, "int32")
                        lowest_bit = T.max(magnitude >> 1, 1) - 1 - (magnitude & 1)
                        if magnitude != 0 and lowest_bit + shift < E4M3_LOWEST_EXPONENT:
                            T.atomic_min(status[STATUS_INEXACT], _position(row, column_vector * vector + e))
                        clamped = T.min(T.max(shift, SHIFT_RANGE[0]), SHIFT_RANGE[1])
                        power = T.reinterpret((clamped + 127) << 23, "float32")
                        converted[e] = T.cast(e2m1_value(code) * power, "float8_e4m3")
                    for e in T.vectorized(vector):
                        q8[q8_row + column_vector * vector + e] = converted[e]

    return kernel


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _vector_width(data: torch.Tensor, in_bk: int, out_bk: int) -> int:
    """Values per thread-vector: 16, narrowed until it divides both block widths (one-column
    blocks: one scale per element, no constraint), the row, and the FP4 row stride and alignment."""
    hidden = data.shape[1] * 2
    vector = WIDEST_VECTOR
    while vector > 2 and (
        (in_bk > 1 and in_bk % vector)
        or (out_bk > 1 and out_bk % vector)
        or hidden % vector
        or (data.stride(0) * 2) % vector
        or address(data) % (vector // 2)
    ):
        vector //= 2
    return vector


def _scale_arguments(sf: torch.Tensor, packed: bool) -> tuple[torch.Tensor, int, int]:
    """Flat scale tensor and its (row, column-block) strides; packed: bytes, the leading words."""
    if packed:
        return flat_view(sf).view(torch.uint8), sf.stride(1), 0
    return flat_view(sf), sf.stride(0), sf.stride(1)


def _stored_exponent(sf: torch.Tensor, row: int, kblock: int) -> int:
    """The biased exponent of one stored scale (any layout), read on the host (error path only)."""
    if sf.dtype == torch.float32:
        return (int(sf[row, kblock : kblock + 1].view(torch.int32).item()) >> 23) & 0xFF
    return (int(sf[row, kblock // 4].item()) >> (8 * (kblock % 4))) & 0xFF


def _packed_scales_as_float(sf: torch.Tensor, kblocks: int) -> torch.Tensor:
    """Packed UE8M0 scales → fp32 ``[rows, kblocks]`` (0xFF: NaN), on the host (error path only)."""
    words = sf.cpu().to(torch.int64) & 0xFFFFFFFF
    exponents = torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], dim=-1).reshape(sf.shape[0], -1)
    exponents = exponents[:, :kblocks].to(torch.int32)
    scales = (exponents << 23).view(torch.float32)
    return torch.where(exponents == UE8M0_NAN, torch.full_like(scales, float("nan")), scales)


def _refuse(status, data, sf, sf_out, hidden, in_block, out_block) -> None:
    """Raise the reference's ValueError for the first position the kernels recorded, if any."""
    bad_scale, inexact = status.tolist()  # the one device-to-host synchronization of a call
    if bad_scale != NO_POSITION:
        kblocks = ceil_div(hidden, in_block[1])
        scales = _packed_scales_as_float(sf, kblocks) if sf.dtype == torch.int32 else sf
        check_power_of_two_scales("x[1]", scales)
        row, kblock = bad_scale >> 32, bad_scale & 0xFFFFFFFF
        raise RuntimeError(f"the device flagged input scale [{row}, {kblock}] but the host finds it valid")
    if inexact == NO_POSITION:
        return
    t, h = inexact >> 32, inexact & 0xFFFFFFFF
    exponent_in = _stored_exponent(sf, t // in_block[0], h // in_block[1])
    exponent_out = _stored_exponent(sf_out, t // out_block[0], h // out_block[1])
    shift = exponent_in - exponent_out
    code = (int(data[t, h // 2 : h // 2 + 1].view(torch.uint8).item()) >> (4 * (h % 2))) & 0xF
    value = -E2M1_GRID[code & 7] if code & 8 else E2M1_GRID[code & 7]
    raise ValueError(
        f"x cannot be cast to e4m3 losslessly: element [{t}, {h}] is {value} · 2^{exponent_in - 127}, and e4m3 "
        f"has no {value} · 2^{shift}; its input block's scale exponent is {LOSSLESS_EXPONENT_HEADROOM - shift} "
        f"below the largest of its out_block_size {out_block} block (spreads up to 11 are always exact)"
    )


def per_block_cast_lossless(
    x,
    fmt: str,
    x_block_size,
    out_block_size,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-quantize FP4 data with power-of-two scales to e4m3 with coarser power-of-two scales,
    exactly; same contract as ``tileproof.reference.quant_blocks.per_block_cast_lossless``, bit for
    bit, including its refusals (same ``ValueError`` messages).

    Synchronizes once with the host (see the module docstring): the refusal rule depends on the
    data, and only the host can raise. Not capturable in a CUDA graph for that reason.
    """
    check_choice("fmt", fmt, FP8_ONLY)
    data, sf, _, hidden, in_block = check_quantized_input("x", x, x_block_size, formats=(E2M1,))
    out_block = check_out_block_size(out_block_size, in_block, hidden)
    check_scale_flags(E4M3, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    require_cuda("x[0]", data)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)
    tokens = data.shape[0]
    q8 = new_output(torch.empty((tokens, hidden), dtype=torch.float8_e4m3fn, device=data.device))
    out_rows, out_kblocks = ceil_div(tokens, out_block[0]), ceil_div(hidden, out_block[1])
    sf_out = new_output(layout.empty(out_rows, out_kblocks, data.device))
    if tokens == 0 or hidden == 0:
        return q8, sf_out

    in_packed = infer_scale_layout("x[1]", sf).kind == "packed_ue8m0"
    in_bm, in_bk = in_block
    out_bm, out_bk = out_block
    in_per_element, out_per_element = in_bk == 1 and in_bm > 1, out_bk == 1 and out_bm > 1
    vector = _vector_width(data, in_bk, out_bk)
    exponents = exponent_kernel(in_packed, use_packed_ue8m0)
    convert = convert_kernel(vector, in_packed, use_packed_ue8m0, in_per_element, out_per_element)
    if compiling_only():
        return q8, sf_out

    in_rows, in_kblocks = ceil_div(tokens, in_bm), ceil_div(hidden, in_bk)
    # The input blocks an output block covers: cover_rows × cover_columns (whole blocks, as checked).
    # Covered block s sits at (s >> shift, s & mask): with a single covered row the shift is 31
    # (any cover_columns, e.g. a whole row of 224 blocks); with several, out_bk ∈ {1, 32, 128} and
    # cover_columns is a power of two.
    cover_rows, cover_columns = out_bm // in_bm, out_bk // in_bk
    columns_shift = WHOLE_ROW_SHIFT if cover_rows == 1 else _log2_block(cover_columns)
    cover = cover_rows * cover_columns
    group_shift = min(5, (cover - 1).bit_length())
    rounds = ceil_div(cover, 1 << group_shift)

    status_words = torch.full((2,), NO_POSITION, dtype=torch.int64, device=data.device)
    status = status_words.view(torch.uint64)
    sf_in_argument, in_row_stride, in_kblock_stride = _scale_arguments(sf, in_packed)
    sf_out_argument, out_row_stride, out_kblock_stride = _scale_arguments(sf_out, use_packed_ue8m0)
    exponents(
        sf_in_argument,
        sf_out_argument,
        status,
        in_rows,
        in_kblocks,
        out_rows,
        out_kblocks,
        in_row_stride,
        in_kblock_stride,
        out_row_stride,
        out_kblock_stride,
        cover_rows,
        cover_columns,
        columns_shift,
        (1 << columns_shift) - 1,
        group_shift,
        rounds,
    )
    q_row_stride_vectors = (data.stride(0) if tokens > 1 else data.shape[1]) * 2 // vector
    convert(
        flat_view(data).view(torch.uint8),
        sf_in_argument,
        sf_out_argument,
        flat_view(q8),
        status,
        hidden // vector,
        q_row_stride_vectors,
        in_row_stride,
        in_kblock_stride,
        out_row_stride,
        out_kblock_stride,
        _log2_block(in_bm),
        0 if in_per_element else _log2_block(in_bk),
        _log2_block(out_bm),
        0 if out_per_element else _log2_block(out_bk),
        tokens,
    )
    _refuse(status_words, data, sf, sf_out, hidden, in_block, out_block)
    return q8, sf_out

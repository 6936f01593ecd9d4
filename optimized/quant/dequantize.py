"""Dequantization (cast back) of quantized tensors of every block shape: ``out = decode(q) · sf``.

Kernel design: every thread turns ``items`` vectors of ``vector`` (8) elements into output: one
wide load of the quantized bytes and one 16-byte store per vector, so each warp store covers 512
contiguous bytes. The product is one fp32 multiply, then round-to-nearest-even to bf16 (or kept in
fp32), exactly like the reference. Scales are read through the same layout rules as the casts
write them (row- or column-major fp32 through runtime strides, or packed UE8M0 bytes).

- Blocks ``(1, C)`` and ``(bm, bk)``: a vector never straddles a scale block (``vector`` divides
  ``bk``), so it needs one scale, at ``(row >> log2 bm, column >> log2 bk)``. The shifts are runtime
  values, so one compiled kernel serves every block shape; ``C == H`` (one scale per row) is the
  shift 31, which sends every column of the row to scale column 0.
- Per-channel blocks ``(nt, 1)``: every element has its own scale, so a thread takes ``rows``
  consecutive rows of the same vector column (``rows`` divides nt: one scale row) and loads the
  vector's ``vector`` scales once for all of them.
- e5m6 data (``x_special_fmt="e5m6"``): a vector is one packed group, 8 values in 3 little-endian
  uint32 words (12 bytes; read as words when the row stride and base address are 4-byte aligned,
  as bytes otherwise), decoded exactly (``e5m6.e5m6_value``).
"""

import tilelang.language as T
import torch

from tileproof.reference.contract import (
    CAST_BACK_DTYPES,
    E2M1,
    E4M3,
    E5M6,
    E5M6_GROUP_BYTES,
    E5M6_GROUP_VALUES,
    ceil_div,
    check_choice,
    check_quantized_input,
    infer_scale_layout,
)

from ..jit import address, compiling_only, flat_view, jit, new_output, require_cuda
from .common import divide_by_magic, division_magic, e2m1_value, scale_from_ue8m0
from .e5m6 import e5m6_value, unpack_group
from .per_token import packed_scale_index

# From a sweep on the H200: 256 threads × 2 vectors of 8 outputs per thread.
THREADS = 256
ITEMS = 2
# Per-channel scales: rows of one vector column per thread (each loads the vector's scales once).
CHANNEL_ROWS = 4
# A column shift that sends every column of a row to scale column 0 (C == H, any H < 2^31).
WHOLE_ROW_SHIFT = 31

_TL_OUT_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_FORMATS = {fmt.name: fmt for fmt in (E4M3, E2M1, E5M6)}


@jit()
def cast_back_kernel(
    fmt_name: str,
    out_dtype: str,
    vector: int,
    packed_ue8m0: bool,
    scale_per_element: bool = False,
    e5m6_words: bool = True,
    threads: int = THREADS,
    items: int = ITEMS,
    rows: int = 1,
):
    """Factory over the static parameters; sizes, strides and the block shape (as shifts) are
    runtime scalars (see ``per_token_cast_kernel`` for why tensors are passed flat).

    ``q_row_stride`` counts vectors for e4m3 / e2m1 (so TileLang proves the wide loads aligned)
    and stored elements (words or bytes) for e5m6, whose rows need not hold whole groups."""
    fmt = _FORMATS[fmt_name]
    if fmt is E5M6:
        q_dtype = "int32" if e5m6_words else "uint8"
        stored_per_vector = 3 if e5m6_words else E5M6_GROUP_BYTES
        stride_unit = 1
        load_loop = T.unroll  # 12 bytes: no single wide load exists
    else:
        # e2m1 bytes are read through a uint8 view of the int8 data (plain byte moves vectorize).
        q_dtype = "float8_e4m3" if fmt is E4M3 else "uint8"
        stored_per_vector = vector // fmt.values_per_byte
        stride_unit = stored_per_vector
        load_loop = T.vectorized
    sf_dtype = "uint8" if packed_ue8m0 else "float32"
    scale_width = vector if scale_per_element else 1

    q_span = T.dynamic("q_span")
    sf_span = T.dynamic("sf_span")
    out_span = T.dynamic("out_span")

    def read_scale(sf, scale_row, kblock, sf_row_stride, sf_kblock_stride):
        if packed_ue8m0:
            return scale_from_ue8m0(sf[packed_scale_index(scale_row, kblock, sf_row_stride)])
        return sf[scale_row * sf_row_stride + kblock * sf_kblock_stride]

    def scale_of(scales, item, e):
        return scales[item, e] if scale_per_element else scales[item, 0]

    @T.macro
    def load_vector(q, stored, r, item, row, column_vector, q_row_stride):
        q_row = T.cast(row, "int64") * q_row_stride * stride_unit
        for e in load_loop(stored_per_vector):
            stored[r, item, e] = q[q_row + column_vector * stored_per_vector + e]

    @T.macro
    def decode_and_store(out, stored, scales, result, r, item, row, column_vector, hidden_vectors):
        if fmt is E4M3:
            for e in T.vectorized(vector):
                result[e] = T.cast(T.cast(stored[r, item, e], "float32") * scale_of(scales, item, e), out_dtype)
        elif fmt is E2M1:
            for e in T.unroll(vector):
                code = (T.cast(stored[r, item, e // 2], "uint32") >> ((e % 2) * 4)) & 0xF
                result[e] = T.cast(e2m1_value(code) * scale_of(scales, item, e), out_dtype)
        else:
            if e5m6_words:
                words = [T.reinterpret(stored[r, item, w], "uint32") for w in range(3)]
            else:
                words = [
                    T.cast(stored[r, item, 4 * w], "uint32")
                    | (T.cast(stored[r, item, 4 * w + 1], "uint32") << 8)
                    | (T.cast(stored[r, item, 4 * w + 2], "uint32") << 16)
                    | (T.cast(stored[r, item, 4 * w + 3], "uint32") << 24)
                    for w in range(3)
                ]
            for e, code in enumerate(unpack_group(*words)):
                result[e] = T.cast(e5m6_value(code) * scale_of(scales, item, e), out_dtype)
        out_row = T.cast(row, "int64") * hidden_vectors * vector
        for e in T.vectorized(vector):
            out[out_row + column_vector * vector + e] = result[e]

    @T.prim_func
    def kernel(
        q: T.Tensor((q_span,), q_dtype),
        sf: T.Tensor((sf_span,), sf_dtype),
        out: T.Tensor((out_span,), out_dtype),
        num_tokens: T.int32,
        hidden_vectors: T.int32,
        q_row_stride: T.int32,
        sf_row_stride: T.int32,
        sf_kblock_stride: T.int32,
        row_shift: T.int32,
        column_shift: T.int32,
        column_blocks: T.int32,
        group_magic: T.int64,
        group_shift: T.int32,
    ):
        # One flattened grid dimension, column blocks fastest: consecutive CTAs walk memory in
        # order (rows on grid x with column blocks on y strided through it: +5 % time), and grid
        # x holds up to 2^31 - 1 CTAs where grid y stops at 65535 rows.
        with T.Kernel(T.ceildiv(num_tokens, rows) * column_blocks, threads=threads) as (cta,):
            row_group = divide_by_magic(cta, group_magic, group_shift)
            bx = cta - row_group * column_blocks
            tx = T.get_thread_binding()
            stored = T.alloc_local((rows, items, stored_per_vector), q_dtype)
            scales = T.alloc_local((items, scale_width), "float32")
            result = T.alloc_local((vector,), out_dtype)
            first_row = row_group * rows
            # ``rows`` divides the block height, so the thread's rows share one scale row.
            scale_row = first_row >> row_shift

            # Issue every load (data and scales) before using any of them.
            for item in T.unroll(items):
                column_vector = (bx * items + item) * threads + tx
                if column_vector < hidden_vectors:
                    for r in T.unroll(rows):
                        if rows == 1:
                            load_vector(q, stored, r, item, first_row, column_vector, q_row_stride)
                        elif first_row + r < num_tokens:
                            load_vector(q, stored, r, item, first_row + r, column_vector, q_row_stride)
                    if scale_per_element:
                        for e in T.unroll(vector):
                            scales[item, e] = read_scale(
                                sf, scale_row, column_vector * vector + e, sf_row_stride, sf_kblock_stride
                            )
                    else:
                        kblock = (column_vector * vector) >> column_shift
                        scales[item, 0] = read_scale(sf, scale_row, kblock, sf_row_stride, sf_kblock_stride)

            for item in T.unroll(items):
                column_vector = (bx * items + item) * threads + tx
                if column_vector < hidden_vectors:
                    for r in T.unroll(rows):
                        if rows == 1:
                            decode_and_store(
                                out, stored, scales, result, r, item, first_row, column_vector, hidden_vectors
                            )
                        elif first_row + r < num_tokens:
                            decode_and_store(
                                out, stored, scales, result, r, item, first_row + r, column_vector, hidden_vectors
                            )

    return kernel


def _vector_width(data: torch.Tensor, fmt, block_columns: int | None) -> int:
    """Output elements per thread-vector: 8 (one 16-byte bf16 store, so a warp's store is 512
    contiguous bytes), narrowed until it divides the block width (``None``: one scale per element),
    the row, and the quantized row stride and alignment. An e5m6 vector is one packed group."""
    if fmt is E5M6:
        return E5M6_GROUP_VALUES
    values_per_byte = fmt.values_per_byte
    hidden = data.shape[1] * values_per_byte
    vector = 8
    while vector > values_per_byte and (
        (block_columns is not None and block_columns % vector)
        or hidden % vector
        or (data.stride(0) * values_per_byte) % vector
        or address(data) % (vector // values_per_byte)
    ):
        vector //= 2
    return vector


def _log2_block(size: int) -> int:
    """Shift that maps an index to its block: log2 of a power-of-two block; a block that is not a
    power of two (C == H) spans the whole row."""
    return size.bit_length() - 1 if size & (size - 1) == 0 else WHOLE_ROW_SHIFT


def cast_back(x, fmt: str, x_block_size, x_special_fmt=None) -> torch.Tensor:
    """Dequantize a ``(data, sf)`` pair; same contract as ``tileproof.reference.quant.cast_back``.

    ``out = decode(data) · sf`` in fp32, then rounded to nearest even to bf16 (``fmt="bf16"``) or
    kept (``"fp32"``). Any block the casts make (``(1, C)``, ``(bm, bk)``, ``(nt, 1)``), any of the
    three scale layouts (read off dtype and strides), e4m3 / e2m1 data or, with
    ``x_special_fmt="e5m6"``, packed e5m6 bytes.
    """
    check_choice("fmt", fmt, CAST_BACK_DTYPES)
    data, sf, spec, hidden, (bm, bk) = check_quantized_input("x", x, x_block_size, x_special_fmt=x_special_fmt)
    require_cuda("x[0]", data)
    out_dtype = CAST_BACK_DTYPES[fmt]
    tokens = data.shape[0]
    out = new_output(torch.empty((tokens, hidden), dtype=out_dtype, device=data.device))
    if tokens == 0 or hidden == 0:
        return out

    layout = infer_scale_layout("x[1]", sf)
    packed = layout.kind == "packed_ue8m0"
    # (1, 1) (C == H == 1) is a one-element row: one scale per (1-wide) vector, no channel mode.
    per_element = bk == 1 and bm > 1
    vector = _vector_width(data, spec, None if per_element else bk)
    # e5m6 groups are read as 32-bit words when every row starts on a 4-byte boundary.
    e5m6_words = spec is not E5M6 or ((tokens == 1 or data.stride(0) % 4 == 0) and address(data) % 4 == 0)
    plan = {"items": 1, "rows": CHANNEL_ROWS} if per_element else {}
    kernel = cast_back_kernel(spec.name, _TL_OUT_DTYPES[out_dtype], vector, packed, per_element, e5m6_words, **plan)
    if compiling_only():
        return out
    threads, items = plan.get("threads", THREADS), plan.get("items", ITEMS)
    column_blocks = ceil_div(hidden // vector, threads * items)
    group_magic, group_shift = division_magic(column_blocks)

    if spec is E5M6:
        q_argument = flat_view(data).view(torch.int32) if e5m6_words else flat_view(data)
        element_bytes = 4 if e5m6_words else 1
        q_row_stride = (data.stride(0) if tokens > 1 else data.shape[1]) // element_bytes
    else:
        stored_per_vector = vector // spec.values_per_byte
        q_argument = flat_view(data).view(torch.uint8) if spec is E2M1 else flat_view(data)
        q_row_stride = data.stride(0) // stored_per_vector if tokens > 1 else data.shape[1] // stored_per_vector
    if packed:
        sf_argument, sf_row_stride, sf_kblock_stride = flat_view(sf).view(torch.uint8), sf.stride(1), 0
    else:
        sf_argument, sf_row_stride, sf_kblock_stride = flat_view(sf), sf.stride(0), sf.stride(1)
    kernel(
        q_argument,
        sf_argument,
        flat_view(out),
        tokens,
        hidden // vector,
        q_row_stride,
        sf_row_stride,
        sf_kblock_stride,
        _log2_block(bm),
        0 if per_element else _log2_block(bk),
        column_blocks,
        group_magic,
        group_shift,
    )
    return out


def per_token_cast_back(x, fmt: str, num_per_channels: int, x_special_fmt=None) -> torch.Tensor:
    """``cast_back`` with ``x_block_size = (1, num_per_channels)``."""
    return cast_back(x, fmt, (1, num_per_channels), x_special_fmt=x_special_fmt)

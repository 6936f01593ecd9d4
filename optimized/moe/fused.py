"""Moving rows into and out of the expert-major layout: ``expand_to_fused``,
``expand_to_fused_with_sf`` and ``reduce_fused`` (TileLang kernels and launchers).

Kernel design (memory-bound: the minimal traffic is x read once and every output row written once):

- **Expand**, two launches.

  1. ``row_slot_kernel``: one thread per slot ``s = t·k + j`` stores ``s`` at ``row_slot[p]`` for
     every ``p = token_topk_to_pos[t, j]`` in ``[0, P)``. ``row_slot`` is a scratch ``int32 [P]``
     that nobody initialises: a row ``p`` is *covered* iff ``row_slot[p]`` holds a slot ``s`` in
     ``[0, T·k)`` whose position is ``p``. A stale value passes that test only when its slot does
     point at ``p``, i.e. when ``p`` is covered, so the test is exact without a fill (no memset
     launch, no host synchronisation). This is what makes the result the reference's for *any*
     ``token_topk_to_pos``: ``pos_to_expert`` is not trusted to mark the padding, only its length
     is used (the reference's rule).
  2. ``expand_kernel``, grid ``(T + ceil(P / padding_rows), parts)``. CTA ``x < T`` loads its
     token's row chunk once into registers (``items`` 16-byte vectors per thread, all loads before
     any store) and stores it to each of its ``k`` positions (read ``slots`` at a time, before the
     stores that need them). Each CTA after them takes ``padding_rows`` consecutive rows, tests
     them as above and stores zeros to the uncovered ones. The heavy token CTAs come first in grid
     order, the light padding ones fill in behind them. Rows travel as raw bytes (any dtype, FP8
     included): ``vector_bytes`` is the widest of 16, 8, 4, 2, 1 that divides the row, the row
     stride and the base address. ``_with_sf``: chunk 0 of a token (or padding) CTA also copies
     (or zeroes) the row's scales, element by element through runtime strides, so that every
     scale layout, row- or column-major, in or out, is the same kernel. Two slots with the same
     position (never made by ``get_fused_mapping``) leave one of their rows, unspecified which,
     as the reference's indexed assignment does.

- **Reduce**: CTA ``(t, part)`` owns a chunk of token ``t``'s output row, ``items`` vectors per
  thread. Slots are taken in batches of ``slots`` (static): the batch's positions, weights and
  ``x_sf`` are read, every gathered 16-byte row vector of the batch is loaded, then the FMAs run in
  slot order, ``acc = fma(fp32(x[p]), s_j, acc)`` (``__fmaf_rn``, one rounding), with
  ``s_j = fl32(w[t, j] · x_sf[p])`` (``__fmul_rn``); then ``fl32(acc · sf[0])`` and one rounding to
  the output (bf16/fp16 round to nearest even, e4m3 ``cvt.rn.satfinite``: ±448 saturation, NaN →
  0x7F). Exactly the reference's sequence of IEEE operations, so the result is bitwise its.
  Weights, ``x_sf`` and ``sf`` are uniform runtime switches (one compiled kernel for the eight
  combinations); ``k``, ``T``, ``P``, ``H`` and every stride are runtime values.

Argument checks are the reference's (same messages), except the **values** of
``token_topk_to_pos``: checking them on the host would cost a synchronisation per call, so an entry
outside ``[-1, P)`` stops the kernel that reads it with a device-side assertion instead of the
reference's ``ValueError`` (the family's rule, docs/moe.md); no access goes out of bounds
meanwhile (such an entry is never used as a position). Tensors whose last dimension is not unit-stride
(an exotic layout the reference accepts) are first made contiguous by PyTorch; scales of more
than 8 bytes per element are refused (``TypeError``).
"""

import tilelang.language as T
import torch

from tileproof.reference.contract import align, check_bool, check_int, check_tensor
from tileproof.reference.moe import (
    INDEX_DTYPES,
    check_indices,
    check_reduce_inputs,
)

from ..jit import address, compiling_only, flat_view, jit, new_output, require_cuda

__all__ = ["expand_to_fused", "expand_to_fused_with_sf", "reduce_fused"]

# Default schedules (threads per CTA, vectors in flight per thread); swept by scratch/gpu_fused.py.
EXPAND_THREADS = 128
EXPAND_ITEMS = 4
PADDING_ROWS = 8  # rows an expand padding CTA tests (and zeroes when uncovered)
EXPAND_SLOTS = 8  # positions an expand token CTA loads at once (k = 8 in one batch)
REDUCE_THREADS = 128
REDUCE_ITEMS = 2
# Gathered rows loaded before their FMAs, k = 8 in two batches of 4, two vectors per thread, 6 CTAs
# per SM: more loads in flight than one batch of 8 (80 registers; 8 CTAs per SM spilled there):
# 269.9 µs against 312.3 µs (T 8192, k 8, H 7168 bf16, H200, kernel time; e4m3 out 261.2 against 306.4).
REDUCE_SLOTS = 4
REDUCE_MIN_BLOCKS = 6  # CTAs per SM
ROW_SLOT_THREADS = 256

# Raw bytes per vector → (element type the kernel moves, elements per vector).
VECTOR_UNITS = {16: ("int32", 4), 8: ("int32", 2), 4: ("int32", 1), 2: ("int16", 1), 1: ("uint8", 1)}
_TORCH_UNITS = {"int32": torch.int32, "int16": torch.int16, "uint8": torch.uint8}
# Scale elements are copied as raw integers of their size.
SCALE_UNITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
_TORCH_SCALE_UNITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INDEX_NAMES = {torch.int32: "int32", torch.int64: "int64"}
_REDUCE_INPUTS = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_REDUCE_OUTPUTS = {**_REDUCE_INPUTS, torch.float8_e4m3fn: "float8_e4m3"}


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


def slot_offset(slot, num_topk, row_stride, slot_stride):
    """Offset of flat slot ``t·k + j`` (``>= 0``) in a ``[T, k]`` tensor with the given strides."""
    token = T.truncdiv(slot, num_topk)
    return T.cast(token, "int64") * row_stride + (slot - token * num_topk) * slot_stride


@jit()
def row_slot_kernel(index_dtype: str, threads: int = ROW_SLOT_THREADS):
    """``row_slot[token_topk_to_pos[t, j]] = t·k + j`` for every position in ``[0, P)``."""
    pos_span = T.dynamic("pos_span")
    row_slot_span = T.dynamic("row_slot_span")

    @T.prim_func
    def kernel(
        pos: T.Tensor((pos_span,), index_dtype),
        row_slot: T.Tensor((row_slot_span,), "int32"),
        num_slots: T.int32,
        num_topk: T.int32,
        num_rows: T.int32,
        pos_row_stride: T.int32,
        pos_slot_stride: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_slots, threads), threads=threads) as (block,):
            tx = T.get_thread_binding()
            position = T.alloc_var("int64")
            slot = block * threads + tx
            if slot < num_slots:
                position = T.cast(pos[slot_offset(slot, num_topk, pos_row_stride, pos_slot_stride)], "int64")
                # An entry outside [-1, P) stops the kernel (the reference raises ValueError).
                T.device_assert(position >= -1 and position < num_rows, no_stack_info=True)
                if position >= 0 and position < num_rows:
                    row_slot[T.cast(position, "int32")] = slot

    return kernel


@jit()
def expand_kernel(
    vector_bytes: int,
    index_dtype: str,
    scale_bytes: int = 0,
    threads: int = EXPAND_THREADS,
    items: int = EXPAND_ITEMS,
    padding_rows: int = PADDING_ROWS,
    slots: int = EXPAND_SLOTS,
):
    """Factory over the static parameters; T, k, P, H and every stride are runtime values.

    ``vector_bytes``: bytes per vector of a row (x and out are passed as flat arrays of the
    vector's element type, row strides counted in vectors, so that TileLang proves the alignment
    of every wide access). ``scale_bytes``: element size of the scales to copy, 0 without scales.
    """
    unit_dtype, units = VECTOR_UNITS[vector_bytes]
    with_scales = scale_bytes > 0
    scale_dtype = SCALE_UNITS[scale_bytes if with_scales else 4]
    chunk_vectors = threads * items

    x_span = T.dynamic("x_span")
    out_span = T.dynamic("out_span")
    sf_span = T.dynamic("sf_span")
    out_sf_span = T.dynamic("out_sf_span")
    pos_span = T.dynamic("pos_span")
    row_slot_span = T.dynamic("row_slot_span")

    @T.prim_func
    def kernel(
        x: T.Tensor((x_span,), unit_dtype),
        out: T.Tensor((out_span,), unit_dtype),
        sf: T.Tensor((sf_span,), scale_dtype),
        out_sf: T.Tensor((out_sf_span,), scale_dtype),
        pos: T.Tensor((pos_span,), index_dtype),
        row_slot: T.Tensor((row_slot_span,), "int32"),
        num_tokens: T.int32,
        num_topk: T.int32,
        num_rows: T.int32,
        hidden_vectors: T.int32,
        x_row_stride: T.int32,
        pos_row_stride: T.int32,
        pos_slot_stride: T.int32,
        sf_columns: T.int32,
        sf_row_stride: T.int32,
        sf_column_stride: T.int32,
        out_sf_row_stride: T.int32,
        out_sf_column_stride: T.int32,
    ):
        padding_ctas = T.ceildiv(num_rows, padding_rows)
        parts = T.max(T.ceildiv(hidden_vectors, chunk_vectors), 1)
        with T.Kernel(num_tokens + padding_ctas, parts, threads=threads) as (unit, part):
            tx = T.get_thread_binding()
            values = T.alloc_local((items, units), unit_dtype)
            uncovered = T.alloc_local((padding_rows,), "int32")
            rows = T.alloc_local((slots,), "int32")
            scale = T.alloc_local((1,), scale_dtype)
            position = T.alloc_var("int64")
            source = T.alloc_var("int64")
            target = T.alloc_var("int64")
            slot = T.alloc_var("int32")
            num_slots = num_tokens * num_topk
            scale_rounds = T.ceildiv(sf_columns, threads)

            if unit < num_tokens:
                # A token: its row chunk into registers (every load before any store), then to
                # each of its positions.
                for item in T.unroll(items):
                    vector = (part * items + item) * threads + tx
                    if vector < hidden_vectors:
                        source = T.cast(unit, "int64") * x_row_stride + vector
                        for e in T.vectorized(units):
                            values[item, e] = x[source * units + e]
                for batch in T.serial(T.ceildiv(num_topk, slots)):
                    # The batch's positions (-1: none), all loaded before the stores that use them.
                    for b in T.unroll(slots):
                        j = batch * slots + b
                        rows[b] = -1
                        if j < num_topk:
                            position = T.cast(
                                pos[T.cast(unit, "int64") * pos_row_stride + j * pos_slot_stride], "int64"
                            )
                            if position >= 0 and position < num_rows:
                                rows[b] = T.cast(position, "int32")
                    for b in T.unroll(slots):
                        if rows[b] >= 0:
                            for item in T.unroll(items):
                                vector = (part * items + item) * threads + tx
                                if vector < hidden_vectors:
                                    target = T.cast(rows[b], "int64") * hidden_vectors + vector
                                    for e in T.vectorized(units):
                                        out[target * units + e] = values[item, e]
                    if with_scales and part == 0:
                        for r in T.serial(scale_rounds):
                            column = r * threads + tx
                            if column < sf_columns:
                                scale[0] = sf[T.cast(unit, "int64") * sf_row_stride + column * sf_column_stride]
                                for b in T.unroll(slots):
                                    if rows[b] >= 0:
                                        out_sf[
                                            T.cast(rows[b], "int64") * out_sf_row_stride + column * out_sf_column_stride
                                        ] = scale[0]
            else:
                # Padding candidates: zero every row no slot points to (see the module docstring).
                first_row = (unit - num_tokens) * padding_rows
                for r in T.unroll(padding_rows):
                    uncovered[r] = 0
                    if first_row + r < num_rows:
                        uncovered[r] = 1
                        slot = row_slot[first_row + r]
                        if slot >= 0 and slot < num_slots:
                            position = T.cast(
                                pos[slot_offset(slot, num_topk, pos_row_stride, pos_slot_stride)], "int64"
                            )
                            if position == first_row + r:
                                uncovered[r] = 0
                for r in T.unroll(padding_rows):
                    if uncovered[r] != 0:
                        for item in T.unroll(items):
                            vector = (part * items + item) * threads + tx
                            if vector < hidden_vectors:
                                target = T.cast(first_row + r, "int64") * hidden_vectors + vector
                                for e in T.vectorized(units):
                                    out[target * units + e] = T.cast(0, unit_dtype)
                        if with_scales and part == 0:
                            for s in T.serial(scale_rounds):
                                column = s * threads + tx
                                if column < sf_columns:
                                    out_sf[
                                        T.cast(first_row + r, "int64") * out_sf_row_stride
                                        + column * out_sf_column_stride
                                    ] = T.cast(0, scale_dtype)

    return kernel


def bf16_pair(word):
    """The two bf16 values of an int32 word (element 2i in the low half) as fp32, exactly."""
    low = T.reinterpret(word << 16, "float32")
    high = T.reinterpret(T.reinterpret(T.reinterpret(word, "uint32") >> 16 << 16, "int32"), "float32")
    return low, high


@jit()
def reduce_kernel(
    in_dtype: str,
    out_dtype: str,
    vector: int,
    index_dtype: str,
    threads: int = REDUCE_THREADS,
    items: int = REDUCE_ITEMS,
    slots: int = REDUCE_SLOTS,
    min_blocks: int = REDUCE_MIN_BLOCKS,
):
    """Factory over the static parameters; T, k, P, H, every stride and the three optional inputs
    (``with_weights``, ``with_x_sf``, ``with_sf``: uniform runtime switches) are runtime values.

    ``vector``: elements per 16-byte (or narrower, at tails and odd strides) access of x.
    """
    # bf16 rows travel as 32-bit words (two values each); widening one is a shift or a mask.
    bf16_words = in_dtype == "bfloat16" and vector % 2 == 0
    loaded = vector // 2 if bf16_words else vector
    x_dtype = "int32" if bf16_words else in_dtype

    x_span = T.dynamic("x_span")
    x_sf_span = T.dynamic("x_sf_span")
    weights_span = T.dynamic("weights_span")
    pos_span = T.dynamic("pos_span")
    sf_span = T.dynamic("sf_span")
    out_span = T.dynamic("out_span")

    @T.prim_func
    def kernel(
        x: T.Tensor((x_span,), x_dtype),
        x_sf: T.Tensor((x_sf_span,), "float32"),
        weights: T.Tensor((weights_span,), "float32"),
        pos: T.Tensor((pos_span,), index_dtype),
        sf: T.Tensor((sf_span,), "float32"),
        out: T.Tensor((out_span,), out_dtype),
        num_tokens: T.int32,
        num_topk: T.int32,
        num_rows: T.int32,
        hidden_vectors: T.int32,
        x_row_stride: T.int32,
        x_sf_stride: T.int32,
        weights_row_stride: T.int32,
        weights_slot_stride: T.int32,
        pos_row_stride: T.int32,
        pos_slot_stride: T.int32,
        with_weights: T.int32,
        with_x_sf: T.int32,
        with_sf: T.int32,
    ):
        with T.Kernel(num_tokens, T.ceildiv(hidden_vectors, threads * items), threads=threads) as (token, part):
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            acc = T.alloc_local((items, vector), "float32")
            rows = T.alloc_local((slots, items, loaded), x_dtype)
            row = T.alloc_local((slots,), "int32")
            scale = T.alloc_local((slots,), "float32")
            result = T.alloc_local((vector,), "float32")
            position = T.alloc_var("int64")
            source = T.alloc_var("int64")
            target = T.alloc_var("int64")

            for item in T.unroll(items):
                for e in T.unroll(vector):
                    acc[item, e] = T.float32(0)
            for batch in T.serial(T.ceildiv(num_topk, slots)):
                # 1. The batch's positions and scales s_j, then every gathered vector of it.
                for b in T.unroll(slots):
                    j = batch * slots + b
                    row[b] = -1
                    scale[b] = T.float32(1)
                    if j < num_topk:
                        position = T.cast(pos[T.cast(token, "int64") * pos_row_stride + j * pos_slot_stride], "int64")
                        T.device_assert(position >= -1 and position < num_rows, no_stack_info=True)
                        if position >= 0 and position < num_rows:
                            row[b] = T.cast(position, "int32")
                            if with_weights != 0:
                                scale[b] = weights[
                                    T.cast(token, "int64") * weights_row_stride + j * weights_slot_stride
                                ]
                            if with_x_sf != 0:
                                scale[b] = T.ieee_mul(scale[b], x_sf[T.cast(row[b], "int64") * x_sf_stride])
                for b in T.unroll(slots):
                    if row[b] >= 0:
                        for item in T.unroll(items):
                            vector_index = (part * items + item) * threads + tx
                            if vector_index < hidden_vectors:
                                source = T.cast(row[b], "int64") * x_row_stride + vector_index
                                for e in T.vectorized(loaded):
                                    rows[b, item, e] = x[source * loaded + e]
                # 2. The FMAs, in slot order.
                for b in T.unroll(slots):
                    if row[b] >= 0:
                        for item in T.unroll(items):
                            if bf16_words:
                                for w in T.unroll(loaded):
                                    low, high = bf16_pair(rows[b, item, w])
                                    acc[item, 2 * w] = T.ieee_fmaf(low, scale[b], acc[item, 2 * w])
                                    acc[item, 2 * w + 1] = T.ieee_fmaf(high, scale[b], acc[item, 2 * w + 1])
                            else:
                                for e in T.unroll(vector):
                                    acc[item, e] = T.ieee_fmaf(
                                        T.cast(rows[b, item, e], "float32"), scale[b], acc[item, e]
                                    )

            # 3. · sf[0], one rounding to the output format, one wide store per vector.
            for item in T.unroll(items):
                vector_index = (part * items + item) * threads + tx
                if vector_index < hidden_vectors:
                    for e in T.unroll(vector):
                        result[e] = acc[item, e]
                        if with_sf != 0:
                            result[e] = T.ieee_mul(acc[item, e], sf[0])
                    target = T.cast(token, "int64") * hidden_vectors + vector_index
                    for e in T.vectorized(vector):
                        out[target * vector + e] = T.cast(result[e], out_dtype)

    return kernel


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def _vector_bytes(row_bytes: int, stride_bytes: int | None, address: int) -> int:
    """The widest of 16, 8, 4, 2, 1 bytes that divides the row, the row stride (None: one row) and
    the base address."""
    width = 16
    while width > 1 and (row_bytes % width or (stride_bytes is not None and stride_bytes % width) or address % width):
        width //= 2
    return width


def _unit_inner_stride(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its last dimension is unit-stride (any row stride), else a contiguous copy."""
    if tensor.dim() == 2 and tensor.shape[1] > 1 and tensor.stride(1) != 1:
        return tensor.contiguous()
    return tensor


def _flat(tensor: torch.Tensor | None, dtype: torch.dtype, device) -> torch.Tensor:
    """``flat_view(tensor)``, or a one-element placeholder when it is absent or empty (the kernel
    reads nothing from it then)."""
    if tensor is None or tensor.numel() == 0:
        return torch.empty(1, dtype=dtype, device=device)
    return flat_view(tensor)


def _as_units(tensor: torch.Tensor, unit: torch.dtype) -> torch.Tensor:
    """The flat bytes of ``tensor`` reinterpreted as ``unit`` elements (a placeholder when empty)."""
    if tensor.numel() == 0:
        return torch.empty(1, dtype=unit, device=tensor.device)
    return flat_view(tensor).view(torch.uint8).view(unit)


def _row_stride(tensor: torch.Tensor) -> int:
    """Row stride in elements; a single row has none that matters (its length is used)."""
    return tensor.stride(0) if tensor.shape[0] > 1 else tensor.shape[1]


def _reduce_vector(x: torch.Tensor) -> int:
    """Elements per access of x: 16 bytes, narrowed until it divides the row, the row stride and
    the base address."""
    element = x.element_size()
    row_stride = x.stride(0) * element if x.shape[0] > 1 else None
    return _vector_bytes(x.shape[1] * element, row_stride, address(x)) // element or 1


def _check_expand(x, token_topk_to_pos, pos_to_expert) -> None:
    """The reference's checks, except the values of ``token_topk_to_pos`` (module docstring)."""
    check_tensor("x", x, ndim=2)
    check_tensor("pos_to_expert", pos_to_expert, dtypes=INDEX_DTYPES, ndim=1)
    check_indices("token_topk_to_pos", token_topk_to_pos)
    if token_topk_to_pos.shape[0] != x.shape[0]:
        raise ValueError(f"token_topk_to_pos must have {x.shape[0]} rows (x's), got {token_topk_to_pos.shape[0]}")


def _row_slot_scratch(num_rows: int, device) -> torch.Tensor:
    """The uninitialised ``row_slot`` scratch of the expand kernels (tests fill it with garbage)."""
    return torch.empty(num_rows, dtype=torch.int32, device=device)


def _launch_expand(x, token_topk_to_pos, out, sf=None, out_sf=None, schedule: dict | None = None) -> None:
    """Compile and launch the two expand kernels: every element of ``out`` (and ``out_sf``) written.
    ``schedule``: ``expand_kernel``'s threads / items / padding_rows (default: the constants)."""
    num_rows = out.shape[0]
    num_tokens, num_topk = token_topk_to_pos.shape
    with_scales = sf is not None and sf.shape[1] > 0
    if num_rows == 0 or (x.shape[1] == 0 and not with_scales):
        return
    x = _unit_inner_stride(x)
    row_bytes = x.shape[1] * x.element_size()
    stride_bytes = x.stride(0) * x.element_size() if num_tokens > 1 else None
    vector_bytes = _vector_bytes(row_bytes, stride_bytes, address(x) if x.numel() else 0)
    unit_name, _ = VECTOR_UNITS[vector_bytes]
    scale_bytes = 0
    if with_scales:
        scale_bytes = sf.element_size()
        if scale_bytes not in SCALE_UNITS:
            raise TypeError(f"x[1] must have elements of 1, 2, 4 or 8 bytes for the optimized kernels, got {sf.dtype}")
    index_name = _INDEX_NAMES[token_topk_to_pos.dtype]
    num_slots = num_tokens * num_topk
    slot_kernel = row_slot_kernel(index_name) if num_slots else None
    kernel = expand_kernel(vector_bytes, index_name, scale_bytes, **(schedule or {}))
    if compiling_only():
        return

    device = out.device
    unit = _TORCH_UNITS[unit_name]
    hidden_vectors = row_bytes // vector_bytes
    x_row_stride = stride_bytes // vector_bytes if stride_bytes is not None else hidden_vectors
    pos_argument, pos_strides = _flat(token_topk_to_pos, token_topk_to_pos.dtype, device), token_topk_to_pos.stride()
    row_slot = _row_slot_scratch(num_rows, device)
    if slot_kernel is not None:
        slot_kernel(pos_argument, row_slot, num_slots, num_topk, num_rows, *pos_strides)
    if with_scales:
        scale_unit = _TORCH_SCALE_UNITS[scale_bytes]
        sf_argument, out_sf_argument = _as_units(sf, scale_unit), _as_units(out_sf, scale_unit)
        sf_strides, out_sf_strides, sf_columns = sf.stride(), out_sf.stride(), sf.shape[1]
    else:
        sf_argument = out_sf_argument = torch.empty(1, dtype=torch.int32, device=device)
        sf_strides, out_sf_strides, sf_columns = (0, 0), (0, 0), 0
    kernel(
        _as_units(x, unit),
        _as_units(out, unit),
        sf_argument,
        out_sf_argument,
        pos_argument,
        row_slot,
        num_tokens,
        num_topk,
        num_rows,
        hidden_vectors,
        x_row_stride,
        *pos_strides,
        sf_columns,
        *sf_strides,
        *out_sf_strides,
    )


def _launch_reduce(x, x_sf, topk_weights, token_topk_to_pos, sf, out, schedule: dict | None = None) -> None:
    """Compile and launch ``reduce_kernel`` into ``out`` ``[T, H]``. ``schedule``: its threads /
    items / slots / min_blocks (default: the constants)."""
    num_tokens, hidden = out.shape
    if num_tokens == 0 or hidden == 0:
        return
    x = _unit_inner_stride(x)
    vector = _reduce_vector(x)
    index_name = _INDEX_NAMES[token_topk_to_pos.dtype]
    kernel = reduce_kernel(_REDUCE_INPUTS[x.dtype], _REDUCE_OUTPUTS[out.dtype], vector, index_name, **(schedule or {}))
    if compiling_only():
        return

    device = x.device
    # bf16 rows are read as 32-bit words (see ``bf16_words`` in the kernel factory).
    x_argument = flat_view(x) if x.numel() else torch.empty(vector, dtype=x.dtype, device=device)
    if x.dtype == torch.bfloat16 and vector % 2 == 0:
        x_argument = x_argument.view(torch.int32)
    kernel(
        x_argument,
        _flat(x_sf, torch.float32, device),
        _flat(topk_weights, torch.float32, device),
        _flat(token_topk_to_pos, token_topk_to_pos.dtype, device),
        _flat(sf, torch.float32, device),
        flat_view(out),
        num_tokens,
        token_topk_to_pos.shape[1],
        x.shape[0],
        hidden // vector,
        _row_stride(x) // vector if x.shape[0] else 0,
        x_sf.stride(0) if x_sf is not None else 0,
        *(topk_weights.stride() if topk_weights is not None else (0, 0)),
        *token_topk_to_pos.stride(),
        int(topk_weights is not None),
        int(x_sf is not None),
        int(sf is not None),
    )


def expand_to_fused(x: torch.Tensor, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor) -> torch.Tensor:
    """Copy each token's row to every expert slot it was routed to; padding rows zero. Same contract
    as ``tileproof.reference.moe.expand_to_fused`` (any dtype, bit for bit, ``[P, H]`` contiguous)."""
    _check_expand(x, token_topk_to_pos, pos_to_expert)
    require_cuda("x", x)
    require_cuda("token_topk_to_pos", token_topk_to_pos)
    out = new_output(torch.empty(pos_to_expert.shape[0], x.shape[1], dtype=x.dtype, device=x.device))
    _launch_expand(x, token_topk_to_pos, out)
    return out


def expand_to_fused_with_sf(
    x: tuple[torch.Tensor, torch.Tensor],
    num_per_channels: int,
    token_topk_to_pos: torch.Tensor,
    pos_to_expert: torch.Tensor,
    use_tma_aligned_col_major_sf: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`expand_to_fused` of a ``(data, sf)`` pair, the scale rows following their data rows, in
    the same two launches. Same contract as ``tileproof.reference.moe.expand_to_fused_with_sf``."""
    if not isinstance(x, tuple) or len(x) != 2:
        raise TypeError(f"x must be a (data, sf) tuple, got {type(x).__name__}")
    data, sf = x
    check_tensor("x[0]", data, ndim=2)
    check_tensor("x[1]", sf, ndim=2)
    if sf.shape[0] != data.shape[0]:
        raise ValueError(f"x[1] must have {data.shape[0]} rows (x[0]'s), got {sf.shape[0]}")
    check_int("num_per_channels", num_per_channels, low=1)
    check_bool("use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf)
    _check_expand(data, token_topk_to_pos, pos_to_expert)
    require_cuda("x[0]", data)
    require_cuda("x[1]", sf)
    require_cuda("token_topk_to_pos", token_topk_to_pos)
    num_rows, sf_columns = pos_to_expert.shape[0], sf.shape[1]
    out = new_output(torch.empty(num_rows, data.shape[1], dtype=data.dtype, device=data.device))
    if use_tma_aligned_col_major_sf:
        storage = torch.empty(sf_columns, align(num_rows, 4), dtype=sf.dtype, device=sf.device)
        out_sf = new_output(storage.narrow(1, 0, num_rows).T)  # narrow: see ScaleLayout.empty
    else:
        out_sf = new_output(torch.empty(num_rows, sf_columns, dtype=sf.dtype, device=sf.device))
    _launch_expand(data, token_topk_to_pos, out, sf, out_sf)
    return out, out_sf


def reduce_fused(
    x,
    topk_weights: torch.Tensor | None,
    token_topk_to_pos: torch.Tensor,
    fp8_format: str = "",
    sf: torch.Tensor | None = None,
) -> torch.Tensor:
    """Combine each token's expert outputs: a weighted sum over its slots in fp32, FMAs in slot order,
    then ``· sf[0]`` and one rounding (or e4m3 encoding). Same contract as
    ``tileproof.reference.moe.reduce_fused``, bit for bit."""
    x, x_sf, num_tokens, num_topk = check_reduce_inputs(
        x, topk_weights, token_topk_to_pos, fp8_format, sf, values=False
    )
    for name, tensor in (
        ("x" if x_sf is None else "x[0]", x),
        ("token_topk_to_pos", token_topk_to_pos),
        ("x[1]", x_sf),
        ("topk_weights", topk_weights),
        ("sf", sf),
    ):
        if tensor is not None:
            require_cuda(name, tensor)
    out_dtype = torch.float8_e4m3fn if fp8_format == "e4m3" else x.dtype
    out = new_output(torch.empty(num_tokens, x.shape[1], dtype=out_dtype, device=x.device))
    _launch_reduce(x, x_sf, topk_weights, token_topk_to_pos, sf, out)
    return out

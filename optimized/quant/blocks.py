"""2-D block casts (``bm × bk`` blocks) and per-channel casts (``nt`` tokens × 1 channel) to e4m3 / e2m1.

Kernel design (memory-bound: read x once, write q and sf once). One CTA owns a *tile* of ``bm`` rows
× ``thread_cols · vector`` columns, i.e. one block row of the scale grid:

- Thread ``tx`` is column thread ``tx % thread_cols`` and row thread ``tx // thread_cols``; it loads
  ``items = bm / row threads`` rows of one 16-byte vector (narrower only when the row length,
  the row stride or the base address forbid it), all before using any: ``items`` independent wide
  loads in flight per thread. A warp reads whole 256-byte row segments, so loads coalesce.
- Block amax: a thread's own maximum, then ``shfl_xor`` over the lanes of the same block inside
  the warp, then one shared-memory slot per (warp rows, column group) and a CTA barrier; the
  owner of each block (per-channel: of each column) turns it into ``sf`` and the multiplier with
  the same IEEE divisions as every other cast, stores ``sf`` and shares the multiplier through
  shared memory (one division pair per block instead of one per thread).
- Per-channel casts are the same kernel with blocks one column wide: the amax is kept per element
  of the thread's vector, and each column's scale is computed by one thread (consecutive threads
  → consecutive columns, so the ``[T / nt, H]`` scale rows are written coalesced).
- Tails: rows past T and vectors past H are masked and count as zeros (which never raises an
  absolute maximum); their scale entries exist and are written when the block exists.
- One kernel serves the three public variants (cast, scales only, cast with given scales) through
  a uniform runtime ``mode`` and every fp32 scale layout through runtime strides, as in
  ``per_token``.
- Re-quantization (``x`` a quantized ``(data, sf)`` tuple with ``x_block_size``): our ``cast_back``
  to fp32, then this kernel on the fp32 tensor; two kernels and an fp32 round trip through memory
  (a fused path is future work).

``per_channel_cast_fused`` and ``per_channel_cast_and_transpose`` live in ``channel.py``.
"""

import tilelang.language as T
import torch

from tileproof.reference.contract import (
    E2M1,
    E4M3,
    ScaleLayout,
    ceil_div,
    check_block_cast_input,
    check_block_shape,
    check_cast_format,
    check_cast_source,
    check_num_per_tokens,
    check_scale_flags,
    check_scale_tensor,
)

from ..jit import compiling_only, device_constant, flat_view, jit, new_output, require_cuda
from .common import e2m1_code, float_bits_abs, scale_and_multiplier, scale_from_ue8m0, ue8m0_byte
from .dequantize import cast_back
from .per_token import MODE_CAST, MODE_PRECOMPUTED_SF, MODE_SF_ONLY, _vector_width, packed_scale_index

_TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}

CHANNEL_BLOCK = 1  # ``block_cols`` of a per-channel cast: one scale per column of a block of rows


def schedule(block_rows: int, block_cols: int, vector: int) -> dict:
    """Threads per CTA and column threads for a call (from sweeps on the H200, see docs/performance.md)."""
    lanes_per_block = max(1, block_cols // vector)
    thread_cols = max(16, min(lanes_per_block, 128)) if block_cols != CHANNEL_BLOCK else 16
    threads = max(256 if block_rows == 128 else 128, thread_cols)
    return {"threads": threads, "thread_cols": thread_cols, "min_blocks": 2048 // threads // 2}


def packed_max(a, b):
    """Lane-wise max of two int32 words of two bf16 magnitudes each (sign bits already clear)."""
    return T.reinterpret(
        T.call_extern("uint32", "__vmaxu2", T.reinterpret(a, "uint32"), T.reinterpret(b, "uint32")), "int32"
    )


def magnitude_bits(word):
    """A word of two bf16 values with both sign bits cleared."""
    return word & T.int32(0x7FFF7FFF)


def half_as_float_bits(word, half):
    """bf16 ``half`` (0: low, 1: high; an int or an unrolled index) of a word, as the bits of
    the equal fp32 value (bf16 → fp32 is exact)."""
    high = T.reinterpret(T.reinterpret(word, "uint32") >> 16 << 16, "int32")
    if isinstance(half, int):
        return word << 16 if half == 0 else high
    return T.if_then_else(half == 0, word << 16, high)


@jit()
def block_cast_kernel(
    in_dtype: str,
    fmt_name: str,
    block_rows: int,
    block_cols: int,
    vector: int,
    packed_ue8m0: bool,
    threads: int = 256,
    thread_cols: int = 16,
    min_blocks: int = 1,
):
    """Factory over the static parameters; token count, hidden size and strides are runtime values.

    ``block_cols == 1`` is the per-channel cast. Tensors are passed flat with strides counted in
    vectors (see ``per_token_cast_kernel``: it lets TileLang prove the 16-byte alignment).
    ``min_blocks`` CTAs per SM bounds the registers per thread: the load, barrier and store phases
    of one CTA only overlap with those of other CTAs on the same SM.
    """
    fmt = E4M3 if fmt_name == "e4m3" else E2M1
    channel_mode = block_cols == CHANNEL_BLOCK
    thread_rows = threads // thread_cols
    items = block_rows // thread_rows
    if items * thread_rows != block_rows or thread_rows * thread_cols != threads:
        raise ValueError(f"schedule ({threads} threads, {thread_cols} column threads) must tile {block_rows} rows")
    # bf16 rows travel as 32-bit words (two values each) until they are encoded: half the
    # registers, and a maximum costs one packed 16-bit max per two elements.
    bf16_words = in_dtype == "bfloat16" and vector % 2 == 0
    words = vector // 2 if bf16_words else vector
    value_dtype = "int32" if bf16_words else "float32"
    tile_columns = thread_cols * vector
    rows_per_warp = max(1, 32 // thread_cols)
    slot_rows = thread_rows // rows_per_warp
    if channel_mode:
        lanes_per_block = 1
        column_group = 1
        blocks_per_tile = tile_columns  # one "block" per column
        slot_columns = thread_cols  # each slot holds a thread's column maxima (``amax_width`` words)
        amax_width = words
    else:
        lanes_per_block = block_cols // vector
        if thread_cols % lanes_per_block:
            raise ValueError(f"a tile of {thread_cols} column threads must hold whole blocks of {lanes_per_block}")
        column_group = min(lanes_per_block, 32)
        blocks_per_tile = thread_cols // lanes_per_block
        slot_columns = thread_cols // column_group
        amax_width = 1
    slots_per_block = lanes_per_block // column_group if not channel_mode else 1
    # Lane bits the in-warp reduction folds: column bits inside one block's lane group, and the
    # row bits when a warp spans several rows.
    shuffle_masks = [1 << bit for bit in range(5) if (1 << bit) < column_group]
    if thread_cols < 32:
        shuffle_masks += [thread_cols << step for step in range((32 // thread_cols).bit_length() - 1)]
    slot_words = slot_rows * slot_columns * amax_width
    stored_per_vector = vector // fmt.values_per_byte
    x_dtype = "int32" if bf16_words else in_dtype
    q_dtype = "float8_e4m3" if fmt is E4M3 else "uint8"
    sf_dtype = "uint8" if packed_ue8m0 else "float32"
    owner_rounds = ceil_div(blocks_per_tile, threads)

    x_span = T.dynamic("x_span")
    q_span = T.dynamic("q_span")
    sf_span = T.dynamic("sf_span")

    @T.prim_func
    def kernel(
        x: T.Tensor((x_span,), x_dtype),
        q: T.Tensor((q_span,), q_dtype),
        sf: T.Tensor((sf_span,), sf_dtype),
        num_tokens: T.int32,
        hidden_vectors: T.int32,
        row_stride_vectors: T.int32,
        num_kblocks: T.int32,
        sf_row_stride: T.int32,
        sf_kblock_stride: T.int32,
        mode: T.int32,
        round_sf: T.int32,
    ):
        with T.Kernel(T.ceildiv(hidden_vectors, thread_cols), T.ceildiv(num_tokens, block_rows), threads=threads) as (
            tile,
            block_row,
        ):
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            column_thread = tx % thread_cols
            row_thread = tx // thread_cols
            values = T.alloc_local((items, words), value_dtype)
            widened = T.alloc_local((vector,), "float32")
            amax = T.alloc_local((amax_width,), "int32")
            multipliers = T.alloc_local((vector,), "float32")
            sf_value = T.alloc_local((1,), "float32")
            multiplier = T.alloc_local((1,), "float32")
            codes = T.alloc_local((stored_per_vector,), "uint8")
            block_amax = T.alloc_local((1,), "int32")
            # One shared buffer for the amax slots and the multipliers (as fp32 bits): as two
            # buffers TileLang overlays them (per-thread liveness), and an owner writing its
            # multiplier could clobber a slot another owner has not read yet.
            exchange = T.alloc_shared((slot_words + blocks_per_tile,), "int32")

            column_vector = tile * thread_cols + column_thread
            first_row = block_row * block_rows + row_thread
            column_in_range = column_vector < hidden_vectors

            # 1. Load every row of this thread's vector column before using any.
            for item in T.unroll(items):
                row = first_row + item * thread_rows
                if column_in_range and row < num_tokens:
                    offset = (T.cast(row, "int64") * row_stride_vectors + column_vector) * words
                    for w in T.vectorized(words):
                        if bf16_words:
                            values[item, w] = x[offset + w]
                        else:
                            values[item, w] = T.cast(x[offset + w], "float32")
                else:
                    for w in T.vectorized(words):
                        values[item, w] = T.cast(0, value_dtype)

            # 2. Block (per-channel: column) absolute maxima as fp32 bits, or, for bf16 words,
            #    packed bf16 magnitudes; integer maxima rank NaN above Inf, so NaN propagates.
            for a in T.unroll(amax_width):
                amax[a] = 0
            for item in T.unroll(items):
                for w in T.unroll(words):
                    if bf16_words:
                        if channel_mode:
                            amax[w] = packed_max(amax[w], magnitude_bits(values[item, w]))
                        else:
                            amax[0] = packed_max(amax[0], magnitude_bits(values[item, w]))
                    elif channel_mode:
                        amax[w] = T.max(amax[w], float_bits_abs(values[item, w]))
                    else:
                        amax[0] = T.max(amax[0], float_bits_abs(values[item, w]))
            if bf16_words and not channel_mode:
                amax[0] = T.max(half_as_float_bits(amax[0], 0), half_as_float_bits(amax[0], 1))
            for mask in shuffle_masks:
                for a in T.unroll(amax_width):
                    if bf16_words and channel_mode:
                        amax[a] = packed_max(amax[a], T.shfl_xor(amax[a], mask))
                    else:
                        amax[a] = T.max(amax[a], T.shfl_xor(amax[a], mask))
            if row_thread % rows_per_warp == 0 and column_thread % column_group == 0:
                for a in T.unroll(amax_width):
                    slot = (row_thread // rows_per_warp) * slot_columns + column_thread // column_group
                    exchange[slot * amax_width + a] = amax[a]
            T.sync_threads()

            # 3. One owner per block (per column): fold the slots, scale, store sf, share the multiplier.
            for round_index in T.unroll(owner_rounds):
                owned = round_index * threads + tx
                if owned < blocks_per_tile:
                    block_amax[0] = 0
                    for r in T.unroll(slot_rows):
                        if channel_mode and bf16_words:
                            word = exchange[r * slot_columns * amax_width + owned // 2]
                            low = half_as_float_bits(word, 0)
                            high = half_as_float_bits(word, 1)
                            block_amax[0] = T.max(block_amax[0], T.if_then_else(owned % 2 == 0, low, high))
                        else:
                            for s in T.unroll(slots_per_block):
                                word = r * slot_columns * amax_width + owned * slots_per_block + s
                                block_amax[0] = T.max(block_amax[0], exchange[word])
                    if channel_mode:
                        kblock = tile * tile_columns + owned
                        exists = kblock < hidden_vectors * vector
                    else:
                        kblock = tile * blocks_per_tile + owned
                        exists = kblock < num_kblocks
                    if mode == MODE_PRECOMPUTED_SF:
                        sf_value[0] = T.float32(1)
                        if exists:
                            if packed_ue8m0:
                                sf_value[0] = scale_from_ue8m0(sf[packed_scale_index(block_row, kblock, sf_row_stride)])
                            else:
                                sf_value[0] = sf[block_row * sf_row_stride + kblock * sf_kblock_stride]
                        multiplier[0] = T.ieee_fdiv(T.float32(1.0), sf_value[0])
                    else:
                        scale_and_multiplier(block_amax[0], fmt, round_sf != 0, sf_value, multiplier)
                        if exists:
                            if packed_ue8m0:
                                byte = packed_scale_index(block_row, kblock, sf_row_stride)
                                sf[byte] = ue8m0_byte(sf_value[0])
                                if kblock == num_kblocks - 1:
                                    # The contract wants the unused bytes of the last word zeroed.
                                    for spare in T.unroll(1, 4):
                                        if kblock % 4 + spare < 4:
                                            sf[byte + spare] = T.uint8(0)
                            else:
                                sf[block_row * sf_row_stride + kblock * sf_kblock_stride] = sf_value[0]
                    exchange[slot_words + owned] = T.reinterpret(multiplier[0], "int32")
            T.sync_threads()

            # 4. Encode and store, one wide store per vector.
            if mode != MODE_SF_ONLY:
                for e in T.unroll(vector):
                    if channel_mode:
                        multipliers[e] = T.reinterpret(exchange[slot_words + column_thread * vector + e], "float32")
                    else:
                        shared = exchange[slot_words + column_thread // lanes_per_block]
                        multipliers[e] = T.reinterpret(shared, "float32")
                for item in T.unroll(items):
                    row = first_row + item * thread_rows
                    if column_in_range and row < num_tokens:
                        for e in T.unroll(vector):
                            if bf16_words:
                                # bf16 → fp32 is exact: the word's halves shifted into the high bits.
                                widened[e] = T.reinterpret(half_as_float_bits(values[item, e // 2], e % 2), "float32")
                            else:
                                widened[e] = values[item, e]
                        q_offset = (T.cast(row, "int64") * hidden_vectors + column_vector) * stored_per_vector
                        if fmt is E4M3:
                            for e in T.vectorized(vector):
                                q[q_offset + e] = T.cast(widened[e] * multipliers[e], "float8_e4m3")
                        else:
                            for p in T.unroll(vector // 2):
                                low = e2m1_code(widened[2 * p] * multipliers[2 * p])
                                high = e2m1_code(widened[2 * p + 1] * multipliers[2 * p + 1])
                                codes[p] = T.cast(low | (high << 4), "uint8")
                            for p in T.vectorized(stored_per_vector):
                                q[q_offset + p] = codes[p]

    return kernel


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def _launch(x, spec, block_rows: int, block_cols: int, sf, q, mode: int, round_sf: bool, packed: bool):
    tokens, hidden = x.shape
    if tokens == 0 or hidden == 0:
        return
    vector = _vector_width(x)
    if spec is E2M1 and vector < 2:
        raise ValueError("e2m1 needs rows that start on 2-element boundaries (even row stride, aligned base)")
    plan = schedule(block_rows, block_cols, vector)
    kernel = block_cast_kernel(_TL_DTYPES[x.dtype], spec.name, block_rows, block_cols, vector, packed, **plan)
    if compiling_only():
        return
    if packed:
        # int32 words [rows, kwords] with strides (1, ld): pass the bytes; ld counts words.
        sf_argument, row_stride, kblock_stride = flat_view(sf).view(torch.uint8), sf.stride(1), 0
    else:
        sf_argument, row_stride, kblock_stride = flat_view(sf), sf.stride(0), sf.stride(1)
    row_stride_vectors = x.stride(0) // vector if tokens > 1 else hidden // vector
    q_argument = flat_view(q).view(torch.uint8) if spec is E2M1 else flat_view(q)
    kblocks = hidden if block_cols == CHANNEL_BLOCK else ceil_div(hidden, block_cols)
    # bf16 rows are read as 32-bit words (see ``bf16_words`` in the kernel factory).
    x_argument = flat_view(x).view(torch.int32) if x.dtype == torch.bfloat16 and vector % 2 == 0 else flat_view(x)
    kernel(
        x_argument,
        q_argument,
        sf_argument,
        tokens,
        hidden // vector,
        row_stride_vectors,
        kblocks,
        row_stride,
        kblock_stride,
        mode,
        int(round_sf),
    )


def _block_cast_source(x, fmt, block_size, x_block_size):
    """The tensor the kernel quantizes, the output format and the block, with the reference's checks.

    A quantized ``(data, sf)`` tuple is re-quantized in two kernels: our ``cast_back`` to fp32 (the
    reference's rule: dequantize to fp32, then cast that tensor), then the block cast of the fp32
    result; dequantizing in the cast's registers (one kernel, no fp32 round trip through memory)
    is future work."""
    if not isinstance(x, tuple):
        spec, bm, bk = check_block_cast_input(x, fmt, block_size, x_block_size)
        require_cuda("x", x)
        return x, spec, bm, bk
    spec = check_cast_format(fmt)
    bm, bk = check_block_shape("block_size", block_size)
    values = cast_back(x, "fp32", x_block_size)
    check_cast_source(values, spec)  # fp32 [T, H] contiguous: only e2m1's even H can fail here
    return values, spec, bm, bk


def _allocate_data(x: torch.Tensor, spec) -> torch.Tensor:
    tokens, hidden = x.shape
    return new_output(torch.empty((tokens, hidden // spec.values_per_byte), dtype=spec.storage_dtype, device=x.device))


def per_block_cast(
    x,
    fmt: str,
    block_size,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one scale per ``bm × bk`` block; same contract as
    ``tileproof.reference.quant_blocks.per_block_cast`` (shapes, layouts, rounding), bit for bit.
    ``x`` may be a quantized ``(data, sf)`` tuple with its ``x_block_size`` (two kernels: see
    ``_block_cast_source``)."""
    x, spec, bm, bk = _block_cast_source(x, fmt, block_size, x_block_size)
    round_sf = check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)
    tokens, hidden = x.shape
    sf = new_output(layout.empty(ceil_div(tokens, bm), ceil_div(hidden, bk), x.device))
    q = _allocate_data(x, spec)
    _launch(x, spec, bm, bk, sf, q, MODE_CAST, round_sf, use_packed_ue8m0)
    return q, sf


def per_block_cast_with_sf_only(
    x,
    fmt: str,
    block_size,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """The scales ``per_block_cast`` would return, without writing any data."""
    x, spec, bm, bk = _block_cast_source(x, fmt, block_size, x_block_size)
    round_sf = check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)
    tokens, hidden = x.shape
    sf = new_output(layout.empty(ceil_div(tokens, bm), ceil_div(hidden, bk), x.device))
    placeholder = device_constant(spec.storage_dtype, x.device, numel=0)
    _launch(x, spec, bm, bk, sf, placeholder, MODE_SF_ONLY, round_sf, use_packed_ue8m0)
    return sf


def per_block_cast_with_precomputed_sf(
    x,
    fmt: str,
    block_size,
    sf: torch.Tensor,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """Quantize with given scales (in the layout the flags name): ``q = encode(x · (1 / sf))``."""
    x, spec, bm, bk = _block_cast_source(x, fmt, block_size, x_block_size)
    check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)
    tokens, hidden = x.shape
    rows, kblocks = ceil_div(tokens, bm), ceil_div(hidden, bk)
    check_scale_tensor("sf", sf, rows=rows, kblocks=kblocks, layout=layout, device=x.device)
    q = _allocate_data(x, spec)
    _launch(x, spec, bm, bk, sf, q, MODE_PRECOMPUTED_SF, False, use_packed_ue8m0)
    return q


def per_channel_cast(
    x: torch.Tensor, fmt: str = "e4m3", num_per_tokens: int = 128, round_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one scale per column block of ``num_per_tokens`` tokens of one channel;
    same contract as ``tileproof.reference.quant_blocks.per_channel_cast``, bit for bit."""
    spec = check_cast_format(fmt)
    check_num_per_tokens(num_per_tokens)
    check_cast_source(x, spec)
    round_sf = check_scale_flags(spec, round_sf, False)
    require_cuda("x", x)
    tokens, hidden = x.shape
    sf = new_output(torch.empty((ceil_div(tokens, num_per_tokens), hidden), dtype=torch.float32, device=x.device))
    q = _allocate_data(x, spec)
    _launch(x, spec, num_per_tokens, CHANNEL_BLOCK, sf, q, MODE_CAST, round_sf, False)
    return q, sf

"""Per-token (1×C block) casts to e4m3 / e2m1: TileLang kernels and their launchers.

Kernel design (memory-bound: read x once, write q and sf once):

- A warp handles a *segment* of ``32 · chunk`` consecutive elements of one row; each lane holds
  ``chunk`` consecutive elements loaded as 16-byte vectors (narrower only when the row stride or
  base address is not 16-byte aligned). A 1×C block spans ``C / chunk`` adjacent lanes, so its
  absolute maximum is a few ``shfl_xor`` steps, with no shared memory and no barrier.
- Each thread loads ``items`` segments before using any (independent 16-byte loads in flight),
  which is what keeps HBM busy; ``schedule`` picks threads, items and the lane chunk per call.
- Grid: ``(units per row, rows)``; a CTA covers ``warps · items`` segments of one row. Grid y
  stops at 65535 rows, so longer inputs are launched in slices of rows (views starting at the
  slice's first row; one launch for up to 65535 tokens).
- C == H outside {16, 32, 64, 128} (one scale per row) uses ``per_row_cast_kernel``: a CTA per row
  and a CTA-wide reduction.
  Tails (H not a multiple of the segment or of C) are masked per vector; masked elements count as
  zero, which never raises an absolute maximum.
- One kernel serves the three public variants (cast, scales only, cast with given scales) and both
  fp32 layouts (row- and column-major, through runtime strides): the variant is a uniform runtime
  branch, which costs nothing next to the memory traffic and keeps the compiled-kernel count small.
"""

import functools

import tilelang.language as T
import torch

from tileproof.reference.contract import (
    CAST_FORMATS,
    E2M1,
    E4M3,
    PER_TOKEN_CAST_FORMATS,
    PER_TOKEN_CHANNEL_BLOCKS,
    ScaleLayout,
    ceil_div,
    check_choice,
    check_per_token_cast_input,
    check_scale_flags,
    check_scale_tensor,
)

from ..jit import (
    LaunchPlans,
    address,
    device_constant,
    flat_view,
    jit,
    launched,
    new_output,
    require_cuda,
)
from .common import (
    cta_amax_bits,
    e2m1_pack_codes,
    e2m1_pack_codes_of_finite_block,
    float_bits_abs,
    scale_and_multiplier,
    scale_from_ue8m0,
    ue8m0_byte,
)

# Default schedule (threads per CTA, segments per thread in flight); see ``schedule``.
THREADS = 64
ITEMS = 4
DECODE_TOKENS = 256  # at or below this many rows the grid is small: one segment per thread


def schedule(fmt_name: str, num_per_channels: int, vector: int, tokens: int) -> dict:
    """Threads, items, lane chunk and scale sharing for a call, from sweeps on the H200.

    e4m3 (8192×7168, 1×128): 64 threads × 4 items with shared scales (one division pair per
    thread instead of one per item: 53.5 → 48 µs). e2m1 spends ~8 more instructions per element
    on its encoding, so each lane takes a 16-element chunk (two 16-byte loads), halving the
    per-block shuffles (1×32: 50.2 µs). Few rows (decode) want small CTAs and no scale broadcast.
    Tiling a 7168 row exactly (7 items) measured no better.

    ``min_blocks`` (CTAs per SM, ``__launch_bounds__``) caps the registers: the e2m1 finite-block
    path of 16-byte bf16 vectors has no per-vector branch, and ptxas, free to overlap all of a
    thread's vectors, took 64 (1×32) and 128 (1×16) registers where the branchy code had 41 and
    68. With 24 and 16 CTAs per SM it fits 40 and 64 registers, with the same instructions and no
    spills (SASS checked): the occupancy of the branchy kernel, or better.
    """
    if tokens <= DECODE_TOKENS:
        return {"threads": 64, "items": 1, "chunk": 0, "shared_scales": False, "min_blocks": 1}
    if fmt_name == "e2m1" and num_per_channels >= 16 and 16 % vector == 0:
        items = 4 if num_per_channels == 16 else 2
        min_blocks = {2: 24, 4: 16}[items] if vector == 8 else 1
        return {"threads": 64, "items": items, "chunk": 16, "shared_scales": True, "min_blocks": min_blocks}
    return {"threads": 64, "items": 4, "chunk": 0, "shared_scales": True, "min_blocks": 1}


MODE_CAST, MODE_SF_ONLY, MODE_PRECOMPUTED_SF = 0, 1, 2

_TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def lane_chunk(num_per_channels: int, vector: int) -> int:
    """Elements per lane: one vector, or more when a block is wider than 32 vectors."""
    return max(vector, num_per_channels // 32)


@jit()
def per_token_cast_kernel(
    in_dtype: str,
    fmt_name: str,
    num_per_channels: int,
    vector: int,
    packed_ue8m0: bool,
    threads: int = THREADS,
    items: int = ITEMS,
    chunk: int = 0,
    shared_scales: bool = True,
    min_blocks: int = 1,
):
    """Factory over the static parameters; token count, hidden size and strides are runtime values.

    Every tensor is passed flat, with its row strides as runtime scalars counted in vectors: that
    is what lets TileLang prove 16-byte alignment and emit one wide load or store per vector.

    A CTA handles one *unit*: ``warps · items`` segments of one row (grid: units per row × rows).
    """
    fmt = E4M3 if fmt_name == "e4m3" else E2M1
    chunk = max(chunk, lane_chunk(num_per_channels, vector))
    warps = threads // 32
    lanes_per_group = num_per_channels // chunk
    vectors_per_chunk = chunk // vector
    shuffle_steps = lanes_per_group.bit_length() - 1
    stored_per_vector = vector // fmt.values_per_byte
    segment_vectors = 32 * vectors_per_chunk
    groups_per_segment = 32 // lanes_per_group
    # bf16 rows travel as 32-bit words (two values each) until they are encoded: half the
    # registers, and the block maximum costs one packed 16-bit max per two elements.
    bf16_words = in_dtype == "bfloat16" and vector % 2 == 0
    loaded_per_vector = vector // 2 if bf16_words else vector
    value_dtype = "int32" if bf16_words else "float32"
    x_dtype = "int32" if bf16_words else in_dtype
    scale_owners = items * groups_per_segment
    shared_scales = shared_scales and lanes_per_group > 1 and scale_owners <= 32
    # e2m1 bytes are written through a uint8 view of the int8 data (plain byte moves vectorize).
    q_dtype = "float8_e4m3" if fmt is E4M3 else "uint8"
    sf_dtype = "uint8" if packed_ue8m0 else "float32"
    finite_block_encoder = fmt is E2M1 and bf16_words and vector == 8

    x_span = T.dynamic("x_span")
    q_span = T.dynamic("q_span")
    sf_span = T.dynamic("sf_span")

    @T.macro
    def load_unit(x, values, row, part, hidden_vectors, row_stride_vectors, warp, lane):
        x_row = T.cast(row, "int64") * row_stride_vectors * loaded_per_vector
        for item in T.unroll(items):
            first_vector = ((part * items + item) * warps + warp) * segment_vectors + lane * vectors_per_chunk
            for v in T.unroll(vectors_per_chunk):
                if first_vector + v < hidden_vectors:
                    for e in T.vectorized(loaded_per_vector):
                        if bf16_words:
                            values[item, v * loaded_per_vector + e] = x[
                                x_row + (first_vector + v) * loaded_per_vector + e
                            ]
                        else:
                            values[item, v * vector + e] = T.cast(x[x_row + (first_vector + v) * vector + e], "float32")
                else:
                    for e in T.vectorized(loaded_per_vector):
                        values[item, v * loaded_per_vector + e] = T.cast(0, value_dtype)

    @T.macro
    def chunk_amax_bits(values, item, group_amax):
        """|x| max of this lane's chunk as fp32 bits (NaN ranks above Inf, so it propagates)."""
        if bf16_words:
            # Two bf16 per word: mask both signs, then one max.u16x2 per two elements.
            pair_max = T.alloc_local((1,), "uint32")
            pair_max[0] = T.uint32(0)
            for j in T.unroll(chunk // 2):
                masked = T.reinterpret(values[item, j], "uint32") & T.uint32(0x7FFF7FFF)
                pair_max[0] = T.call_extern("uint32", "__vmaxu2", pair_max[0], masked)
            widest = T.max(pair_max[0] & T.uint32(0xFFFF), pair_max[0] >> 16)
            group_amax[item] = T.reinterpret(widest << 16, "int32")
        else:
            group_amax[item] = 0
            for j in T.unroll(chunk):
                group_amax[item] = T.max(group_amax[item], float_bits_abs(values[item, j]))

    @T.macro
    def scale_block(
        sf,
        amax_bits,
        sf_value,
        multiplier,
        row,
        kblock,
        is_owner,
        num_kblocks,
        sf_row_stride,
        sf_kblock_stride,
        mode,
        round_sf,
    ):
        """Scale and multiplier of one block: computed and stored by its owner, or read."""
        if mode == MODE_PRECOMPUTED_SF:
            sf_value[0] = T.float32(1)
            if kblock < num_kblocks:
                if packed_ue8m0:
                    sf_value[0] = scale_from_ue8m0(sf[packed_scale_index(row, kblock, sf_row_stride)])
                else:
                    sf_value[0] = sf[row * sf_row_stride + kblock * sf_kblock_stride]
            multiplier[0] = T.ieee_fdiv(T.float32(1.0), sf_value[0])
        else:
            scale_and_multiplier(amax_bits, fmt, round_sf != 0, sf_value, multiplier, bf16_words)
            if is_owner and kblock < num_kblocks:
                if packed_ue8m0:
                    sf[packed_scale_index(row, kblock, sf_row_stride)] = ue8m0_byte(sf_value[0])
                    if kblock == num_kblocks - 1:
                        # The contract wants the unused bytes of the last word zeroed.
                        for spare in T.unroll(1, 4):
                            if kblock % 4 + spare < 4:
                                sf[packed_scale_index(row, kblock, sf_row_stride) + spare] = T.uint8(0)
                else:
                    sf[row * sf_row_stride + kblock * sf_kblock_stride] = sf_value[0]

    @T.macro
    def encode_vector(q, values, item_multiplier, widened, codes, q_row, item, v, first_vector, finite):
        q_offset = q_row + (first_vector + v) * stored_per_vector
        if bf16_words:
            # bf16 → fp32 is exact: the word's halves shifted into the high bits.
            for e in T.unroll(vector // 2):
                word = T.reinterpret(values[item, v * loaded_per_vector + e], "uint32")
                widened[0, 2 * e] = T.reinterpret(word << 16, "float32")
                widened[0, 2 * e + 1] = T.reinterpret(word & T.uint32(0xFFFF0000), "float32")
            words = (values, item, v * loaded_per_vector) if finite else None
            store_encoded_vector(q, q_offset, widened, 0, 0, item_multiplier[item], fmt, vector, codes, words)
        else:
            store_encoded_vector(q, q_offset, values, item, v * vector, item_multiplier[item], fmt, vector, codes)

    @T.macro
    def encode_items(q, values, item_multiplier, widened, codes, q_row, part, hidden_vectors, warp, lane, finite):
        """Encode and store this thread's vectors; ``finite``: with the finite-block encoder, and
        without the per-vector bounds test (the caller has checked that every vector is in range)."""
        for item in T.unroll(items):
            first_vector = ((part * items + item) * warps + warp) * segment_vectors + lane * vectors_per_chunk
            for v in T.unroll(vectors_per_chunk):
                if finite:
                    encode_vector(q, values, item_multiplier, widened, codes, q_row, item, v, first_vector, True)
                else:
                    if first_vector + v < hidden_vectors:
                        encode_vector(q, values, item_multiplier, widened, codes, q_row, item, v, first_vector, False)

    @T.macro
    def encode_unit(
        q,
        sf,
        values,
        group_amax,
        owned_amax,
        item_multiplier,
        widened,
        sf_value,
        multiplier,
        codes,
        row,
        part,
        hidden_vectors,
        num_kblocks,
        sf_row_stride,
        sf_kblock_stride,
        mode,
        round_sf,
        warp,
        lane,
    ):
        q_row = T.cast(row, "int64") * hidden_vectors * stored_per_vector

        # 1. Block absolute maxima: this lane's chunk, then across the block's lanes.
        for item in T.unroll(items):
            chunk_amax_bits(values, item, group_amax)
            for step in T.unroll(shuffle_steps):
                group_amax[item] = T.max(group_amax[item], T.shfl_xor(group_amax[item], 1 << step))

        # 2. Scales. With ``shared_scales`` lane L owns block (item L // groups, group L % groups)
        #    of the warp: it alone divides, stores the scale, and the multipliers travel back by
        #    shuffle. Otherwise every lane divides for its own block (fine when a block is 1 lane).
        if shared_scales:
            owner_item = lane // groups_per_segment
            owner_group = lane % groups_per_segment
            owned_amax[0] = 0
            for item in T.unroll(items):
                fetched = T.shfl_sync(group_amax[item], owner_group * lanes_per_group)
                owned_amax[0] = T.if_then_else(owner_item == item, fetched, owned_amax[0])
            owner_first_vector = ((part * items + owner_item) * warps + warp) * segment_vectors + (
                owner_group * lanes_per_group * vectors_per_chunk
            )
            scale_block(
                sf,
                owned_amax[0],
                sf_value,
                multiplier,
                row,
                owner_first_vector * vector // num_per_channels,
                lane < scale_owners,
                num_kblocks,
                sf_row_stride,
                sf_kblock_stride,
                mode,
                round_sf,
            )
            for item in T.unroll(items):
                item_multiplier[item] = T.shfl_sync(multiplier[0], item * groups_per_segment + lane // lanes_per_group)
        else:
            for item in T.unroll(items):
                first_vector = ((part * items + item) * warps + warp) * segment_vectors + lane * vectors_per_chunk
                scale_block(
                    sf,
                    group_amax[item],
                    sf_value,
                    multiplier,
                    row,
                    first_vector * vector // num_per_channels,
                    (lane % lanes_per_group) == 0,
                    num_kblocks,
                    sf_row_stride,
                    sf_kblock_stride,
                    mode,
                    round_sf,
                )
                item_multiplier[item] = multiplier[0]

        # 3. Encode and store the data, one wide store per vector. A thread whose e2m1 blocks all
        #    have a multiplier from their own finite amax (all of them, unless a NaN or Inf is in
        #    the block or the scales were given) and whose vectors are all in range takes the
        #    leaner encoder of ``e2m1_pack_codes_of_finite_block`` and skips the per-vector bounds
        #    tests; the test is once per thread, so the branch is uniform unless a warp holds such
        #    a block or the row's end.
        if mode != MODE_SF_ONLY:
            if finite_block_encoder:
                last_vector = ((part * items + items - 1) * warps + warp) * segment_vectors + (
                    lane + 1
                ) * vectors_per_chunk
                positive = [item_multiplier[item] > T.float32(0) for item in range(items)]
                in_range_and_positive = T.And(last_vector <= hidden_vectors, mode != MODE_PRECOMPUTED_SF)
                if functools.reduce(T.And, positive, in_range_and_positive):
                    encode_items(
                        q, values, item_multiplier, widened, codes, q_row, part, hidden_vectors, warp, lane, True
                    )
                else:
                    encode_items(
                        q, values, item_multiplier, widened, codes, q_row, part, hidden_vectors, warp, lane, False
                    )
            else:
                encode_items(q, values, item_multiplier, widened, codes, q_row, part, hidden_vectors, warp, lane, False)

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
        units_per_row = T.ceildiv(T.ceildiv(hidden_vectors, segment_vectors), warps * items)
        # Rows on grid y: no integer division to find a CTA's row (this kernel is issue-bound
        # enough that a runtime division per CTA shows up in the timings).
        with T.Kernel(units_per_row, num_tokens, threads=threads) as (part, row):
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            values = T.alloc_local((items, chunk // 2 if bf16_words else chunk), value_dtype)
            widened = T.alloc_local((1, vector), "float32")
            group_amax = T.alloc_local((items,), "int32")
            owned_amax = T.alloc_local((1,), "int32")
            item_multiplier = T.alloc_local((items,), "float32")
            sf_value = T.alloc_local((1,), "float32")
            multiplier = T.alloc_local((1,), "float32")
            codes = T.alloc_local((stored_per_vector,), "uint8")
            load_unit(x, values, row, part, hidden_vectors, row_stride_vectors, warp, lane)
            encode_unit(
                q,
                sf,
                values,
                group_amax,
                owned_amax,
                item_multiplier,
                widened,
                sf_value,
                multiplier,
                codes,
                row,
                part,
                hidden_vectors,
                num_kblocks,
                sf_row_stride,
                sf_kblock_stride,
                mode,
                round_sf,
                warp,
                lane,
            )

    return kernel


@T.macro
def store_encoded_vector(q, q_offset, values, item, first, multiplier, fmt, vector, codes, finite_block_words=None):
    """Encode ``values[item, first : first + vector] · multiplier`` and store it with one wide store
    (e4m3: ``vector`` bytes; e2m1: ``vector / 2`` bytes, element 2j in the low nibble).

    ``finite_block_words``: ``(words, word_item, first_word)``, the bf16 pairs the eight fp32
    ``values`` were widened from, for an e2m1 block whose multiplier came from its own finite amax:
    encoded by ``e2m1_pack_codes_of_finite_block`` (same bytes, fewer instructions)."""
    if fmt is E4M3:
        for e in T.vectorized(vector):
            q[q_offset + e] = T.cast(values[item, first + e] * multiplier, "float8_e4m3")
    else:
        scaled = T.alloc_local((vector,), "float32")
        packed = T.alloc_local((2,), "uint32")
        for e in T.unroll(vector):
            scaled[e] = values[item, first + e] * multiplier
        if finite_block_words is None:
            e2m1_pack_codes(scaled, vector, True, packed)
        else:
            e2m1_pack_codes_of_finite_block(scaled, *finite_block_words, packed)
        for p in T.unroll(vector // 2):
            codes[p] = T.cast(packed[0] >> (8 * p), "uint8")
        for p in T.vectorized(vector // 2):
            q[q_offset + p] = codes[p]


@jit()
def per_row_cast_kernel(in_dtype: str, fmt_name: str, hidden: int, vector: int, packed_ue8m0: bool, threads: int = 256):
    """One scale per row (C == H, any H): a CTA per row holds the whole row in registers
    (``hidden`` is static so the per-thread vector count is too), reduces |x| across the CTA
    (warp shuffles, then one shared-memory exchange), then encodes. Same flat arguments as
    ``per_token_cast_kernel``."""
    fmt = E4M3 if fmt_name == "e4m3" else E2M1
    warps = threads // 32
    hidden_vectors = hidden // vector
    vectors_per_thread = ceil_div(hidden_vectors, threads)
    stored_per_vector = vector // fmt.values_per_byte
    q_dtype = "float8_e4m3" if fmt is E4M3 else "uint8"
    sf_dtype = "uint8" if packed_ue8m0 else "float32"

    x_span = T.dynamic("x_span")
    q_span = T.dynamic("q_span")
    sf_span = T.dynamic("sf_span")

    @T.prim_func
    def kernel(
        x: T.Tensor((x_span,), in_dtype),
        q: T.Tensor((q_span,), q_dtype),
        sf: T.Tensor((sf_span,), sf_dtype),
        num_tokens: T.int32,
        row_stride_vectors: T.int32,
        sf_row_stride: T.int32,
        mode: T.int32,
        round_sf: T.int32,
    ):
        with T.Kernel(num_tokens, threads=threads) as (row,):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            values = T.alloc_local((vectors_per_thread, vector), "float32")
            amax = T.alloc_local((1,), "int32")
            warp_amax = T.alloc_shared((warps,), "int32")
            sf_value = T.alloc_local((1,), "float32")
            multiplier = T.alloc_local((1,), "float32")
            codes = T.alloc_local((stored_per_vector,), "uint8")
            x_row = T.cast(row, "int64") * row_stride_vectors * vector
            q_row = T.cast(row, "int64") * hidden_vectors * stored_per_vector

            for i in T.unroll(vectors_per_thread):
                if i * threads + tx < hidden_vectors:
                    for e in T.vectorized(vector):
                        values[i, e] = T.cast(x[x_row + (i * threads + tx) * vector + e], "float32")
                else:
                    for e in T.vectorized(vector):
                        values[i, e] = T.float32(0)

            amax[0] = 0
            for i in T.unroll(vectors_per_thread):
                for e in T.unroll(vector):
                    amax[0] = T.max(amax[0], float_bits_abs(values[i, e]))
            cta_amax_bits(amax, warp_amax, lane, warp, warps)

            if mode == MODE_PRECOMPUTED_SF:
                if packed_ue8m0:
                    sf_value[0] = scale_from_ue8m0(sf[packed_scale_index(row, 0, sf_row_stride)])
                else:
                    sf_value[0] = sf[row * sf_row_stride]
                multiplier[0] = T.ieee_fdiv(T.float32(1.0), sf_value[0])
            else:
                scale_and_multiplier(amax[0], fmt, round_sf != 0, sf_value, multiplier)
                if tx == 0:
                    if packed_ue8m0:
                        sf[packed_scale_index(row, 0, sf_row_stride)] = ue8m0_byte(sf_value[0])
                        for spare in T.unroll(1, 4):
                            sf[packed_scale_index(row, 0, sf_row_stride) + spare] = T.uint8(0)
                    else:
                        sf[row * sf_row_stride] = sf_value[0]

            if mode != MODE_SF_ONLY:
                for i in T.unroll(vectors_per_thread):
                    if i * threads + tx < hidden_vectors:
                        q_offset = q_row + (i * threads + tx) * stored_per_vector
                        store_encoded_vector(q, q_offset, values, i, 0, multiplier[0], fmt, vector, codes)

    return kernel


def packed_scale_index(row, kblock, leading_words):
    """Byte offset of block ``kblock``'s exponent in the packed UE8M0 storage (little-endian)."""
    return ((kblock // 4) * leading_words + row) * 4 + kblock % 4


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


MAX_GRID_Y = 65535  # CUDA's limit on a grid's y extent


def _vector_width(x: torch.Tensor) -> int:
    """Widest vector (elements, at most 16 bytes) that every row start and the row length allow."""
    element_bytes = x.element_size()
    vector = 16 // element_bytes
    while vector > 1 and (x.shape[1] % vector or x.stride(0) % vector or address(x) % (vector * element_bytes)):
        vector //= 2
    return vector


def _cast_plan(
    x: torch.Tensor,
    mode: int,
    fmt: str,
    num_per_channels: int,
    x_block_size,
    use_tma_aligned_col_major_sf: bool,
    round_sf: bool,
    use_packed_ue8m0: bool,
    sf: torch.Tensor | None = None,
):
    """Check a per-token cast of ``x``'s signature (``mode``: cast, scales only, or cast with the
    given ``sf``) and decide its launch. The plan, ``run(x, sf=None) -> (q, sf)``, allocates the
    outputs (the scales unless given; a zero-size placeholder for q when only scales are written)
    and launches."""
    spec = check_per_token_cast_input(x, fmt, num_per_channels, x_block_size)
    round_sf = check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    require_cuda("x", x)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)
    tokens, hidden = x.shape
    kblocks = ceil_div(hidden, num_per_channels)
    device = x.device
    if mode == MODE_PRECOMPUTED_SF:
        check_scale_tensor("sf", sf, rows=tokens, kblocks=kblocks, layout=layout, device=device)
        round_sf = False  # the given scales are used as they are
    placeholder = device_constant(spec.storage_dtype, device, numel=0) if mode == MODE_SF_ONLY else None
    data_shape = (tokens, hidden // spec.values_per_byte)

    def allocate(sf):
        if sf is None:
            sf = new_output(layout.empty(tokens, kblocks, device))
        q = (
            placeholder
            if placeholder is not None
            else new_output(torch.empty(data_shape, dtype=spec.storage_dtype, device=device))
        )
        return q, sf

    if tokens == 0:
        return lambda x, sf=None: allocate(sf)
    vector = _vector_width(x)
    if spec is E2M1 and vector < 2:
        raise ValueError("e2m1 needs rows that start on 2-element boundaries (even row stride, aligned base)")
    row_wide = num_per_channels not in PER_TOKEN_CHANNEL_BLOCKS
    if row_wide:
        kernel = per_row_cast_kernel(_TL_DTYPES[x.dtype], spec.name, hidden, vector, use_packed_ue8m0)
    else:
        kernel = per_token_cast_kernel(
            _TL_DTYPES[x.dtype],
            spec.name,
            num_per_channels,
            vector,
            use_packed_ue8m0,
            **schedule(spec.name, num_per_channels, vector, tokens),
        )
    kernel = launched(kernel)
    # Packed scales are int32 words [rows, kwords] with strides (1, ld): the kernel gets their
    # bytes, and ld counts words. A given sf has the strides it was checked for (its signature).
    if sf is None:
        sf_strides = layout.empty(tokens, kblocks, "meta").stride()
    else:
        sf_strides = sf.stride()
    row_stride, kblock_stride = (sf_strides[1], 0) if use_packed_ue8m0 else sf_strides
    row_stride_vectors = x.stride(0) // vector if tokens > 1 else hidden // vector
    words = not row_wide and x.dtype == torch.bfloat16 and vector % 2 == 0
    bytes_data = spec is E2M1

    def flat_arguments(x_rows, q_rows, sf_rows):
        x_argument = flat_view(x_rows)
        if words:
            x_argument = x_argument.view(torch.int32)  # bf16 rows read as 32-bit words (``bf16_words``)
        q_argument = flat_view(q_rows).view(torch.uint8) if bytes_data else flat_view(q_rows)
        return x_argument, q_argument, flat_view(sf_rows).view(torch.uint8) if use_packed_ue8m0 else flat_view(sf_rows)

    if row_wide:  # a row per CTA on grid x
        scalars = (tokens, row_stride_vectors, row_stride, mode, int(round_sf))

        def run(x, sf=None):
            q, sf = allocate(sf)
            if kernel is not None:
                kernel(*flat_arguments(x, q, sf), *scalars)
            return q, sf

        return run
    scalars = (hidden // vector, row_stride_vectors, kblocks, row_stride, kblock_stride, mode, int(round_sf))
    # Rows are on grid y, which stops at MAX_GRID_Y: longer inputs go in launches of that many rows,
    # each on views that start at its first row (the scale index is linear in the row, packed too).
    row_slices = [slice(first, min(tokens, first + MAX_GRID_Y)) for first in range(0, tokens, MAX_GRID_Y)]

    def run(x, sf=None):
        q, sf = allocate(sf)
        if kernel is None:
            return q, sf
        if len(row_slices) == 1:
            kernel(*flat_arguments(x, q, sf), tokens, *scalars)
            return q, sf
        for rows in row_slices:
            q_rows = q[rows] if q.dim() == 2 else q
            kernel(*flat_arguments(x[rows], q_rows, sf[rows]), rows.stop - rows.start, *scalars)
        return q, sf

    return run


_CAST_PLANS = LaunchPlans(_cast_plan)


def _dequantized_source(x, fmt: str, x_block_size, formats=CAST_FORMATS) -> torch.Tensor:
    """Re-quantization input: a quantized ``(data, sf)`` tuple → fp32 ``[T, H]`` by our ``cast_back``
    (the reference's rule: dequantize to fp32, then cast that tensor). The caller then casts the
    result as a plain tensor: two kernels and an fp32 round trip through memory; dequantizing in
    the cast's registers is future work."""
    check_choice("fmt", fmt, formats)
    if fmt not in CAST_FORMATS:
        raise ValueError(f"fmt {fmt!r} takes a plain tensor x, not an already quantized (data, sf) pair")
    from .dequantize import cast_back  # here, not at the top: dequantize imports this module

    return cast_back(x, "fp32", x_block_size)


def per_token_cast(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one scale per 1×C block of each row; same contract as
    ``tileproof.reference.quant.per_token_cast`` (shapes, layouts, rounding), bit for bit. ``x``
    may be a quantized ``(data, sf)`` tuple with its ``x_block_size`` (see ``_dequantized_source``)."""
    if isinstance(x, tuple):
        x, x_block_size = _dequantized_source(x, fmt, x_block_size, PER_TOKEN_CAST_FORMATS), None
    if fmt == "e5m6":
        from .e5m6 import per_token_cast_e5m6  # here, not at the top: e5m6 imports this module

        return per_token_cast_e5m6(
            x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0
        )
    arguments = (
        x,
        MODE_CAST,
        fmt,
        num_per_channels,
        x_block_size,
        use_tma_aligned_col_major_sf,
        round_sf,
        use_packed_ue8m0,
    )
    return _CAST_PLANS.plan(*arguments)(x)


def per_token_cast_with_sf_only(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """The scales of ``per_token_cast`` without writing any data (reads x once, writes sf)."""
    if isinstance(x, tuple):
        x, x_block_size = _dequantized_source(x, fmt, x_block_size), None
    arguments = (
        x,
        MODE_SF_ONLY,
        fmt,
        num_per_channels,
        x_block_size,
        use_tma_aligned_col_major_sf,
        round_sf,
        use_packed_ue8m0,
    )
    return _CAST_PLANS.plan(*arguments)(x)[1]


def per_token_cast_with_precomputed_sf(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    sf: torch.Tensor,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> torch.Tensor:
    """Quantize ``x`` with given scales (``q = encode(x · (1/sf))``); returns the data only."""
    if isinstance(x, tuple):
        x, x_block_size = _dequantized_source(x, fmt, x_block_size), None
    arguments = (
        x,
        MODE_PRECOMPUTED_SF,
        fmt,
        num_per_channels,
        x_block_size,
        use_tma_aligned_col_major_sf,
        round_sf,
        use_packed_ue8m0,
        sf,
    )
    return _CAST_PLANS.plan(*arguments)(x, sf)[0]

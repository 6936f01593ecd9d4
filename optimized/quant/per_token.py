"""Per-token (1×C block) casts to e4m3 / e2m1: TileLang kernels and their launchers.

Kernel design (memory-bound: read x once, write q and sf once):

- A warp handles a *segment* of ``32 · chunk`` consecutive elements of one row; each lane holds
  ``chunk`` consecutive elements loaded as 16-byte vectors (narrower only when the row stride or
  base address is not 16-byte aligned). A 1×C block spans ``C / chunk`` adjacent lanes, so its
  absolute maximum is a few ``shfl_xor`` steps, with no shared memory and no barrier.
- Each thread loads ``items`` segments before using any (independent 16-byte loads in flight),
  which is what keeps HBM busy; ``schedule`` picks threads, items and the lane chunk per call.
- Grid: ``(units per row, rows)``; a CTA covers ``warps · items`` segments of one row.
- C == H outside {16, 32, 64, 128} (one scale per row) uses ``per_row_cast_kernel``: a CTA per row
  and a CTA-wide reduction.
  Tails (H not a multiple of the segment or of C) are masked per vector; masked elements count as
  zero, which never raises an absolute maximum.
- One kernel serves the three public variants (cast, scales only, cast with given scales) and both
  fp32 layouts (row- and column-major, through runtime strides): the variant is a uniform runtime
  branch, which costs nothing next to the memory traffic and keeps the compiled-kernel count small.
"""

import tilelang.language as T
import torch

from tileproof.reference.contract import (
    E2M1,
    E4M3,
    PER_TOKEN_CHANNEL_BLOCKS,
    ScaleLayout,
    ceil_div,
    check_per_token_cast_input,
    check_scale_flags,
    check_scale_tensor,
)

from ..jit import compiling_only, flat_view, jit, new_output, require_cuda
from .common import e2m1_code, float_bits_abs, scale_and_multiplier, scale_from_ue8m0, ue8m0_byte

# Default schedule (threads per CTA, segments per thread in flight); see ``schedule``.
THREADS = 64
ITEMS = 4
DECODE_TOKENS = 256  # at or below this many rows the grid is small: one segment per thread


def schedule(fmt_name: str, num_per_channels: int, vector: int, tokens: int) -> dict:
    """Threads, items and lane chunk for a call, from a sweep on the H200 (docs/results/).

    e4m3 is bound by memory and per-block overhead: 64 threads × 4 items. e2m1 spends ~8 more
    instructions per element on its encoding, so each lane takes a 16-element chunk (two 16-byte
    loads), halving the per-block shuffles and divisions. Few rows (decode) want more, smaller CTAs.
    """
    if tokens <= DECODE_TOKENS:
        return {"threads": 64, "items": 1, "chunk": 0}
    if fmt_name == "e2m1" and num_per_channels >= 16 and 16 % vector == 0:
        return {"threads": 64, "items": 2, "chunk": 16}
    return {"threads": 64, "items": 4, "chunk": 0}


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
    # e2m1 bytes are written through a uint8 view of the int8 data (plain byte moves vectorize).
    q_dtype = "float8_e4m3" if fmt is E4M3 else "uint8"
    sf_dtype = "uint8" if packed_ue8m0 else "float32"

    x_span = T.dynamic("x_span")
    q_span = T.dynamic("q_span")
    sf_span = T.dynamic("sf_span")

    @T.macro
    def load_unit(x, values, row, part, hidden_vectors, row_stride_vectors, warp, lane):
        x_row = T.cast(row, "int64") * row_stride_vectors * vector
        for item in T.unroll(items):
            first_vector = ((part * items + item) * warps + warp) * segment_vectors + lane * vectors_per_chunk
            for v in T.unroll(vectors_per_chunk):
                if first_vector + v < hidden_vectors:
                    for e in T.vectorized(vector):
                        values[item, v * vector + e] = T.cast(x[x_row + (first_vector + v) * vector + e], "float32")
                else:
                    for e in T.vectorized(vector):
                        values[item, v * vector + e] = T.float32(0)

    @T.macro
    def encode_unit(
        q,
        sf,
        values,
        group_amax,
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
        for item in T.unroll(items):
            first_vector = ((part * items + item) * warps + warp) * segment_vectors + lane * vectors_per_chunk
            kblock = first_vector * vector // num_per_channels
            writes_scale = (lane % lanes_per_group) == 0 and kblock < num_kblocks

            # Block absolute maximum: this lane's chunk, then across the block's lanes.
            group_amax[item] = 0
            for j in T.unroll(chunk):
                group_amax[item] = T.max(group_amax[item], float_bits_abs(values[item, j]))
            for step in T.unroll(shuffle_steps):
                group_amax[item] = T.max(group_amax[item], T.shfl_xor(group_amax[item], 1 << step))

            # Scale and multiplier: computed (and stored), or read.
            if mode == MODE_PRECOMPUTED_SF:
                sf_value[0] = T.float32(1)
                if kblock < num_kblocks:
                    if packed_ue8m0:
                        sf_value[0] = scale_from_ue8m0(sf[packed_scale_index(row, kblock, sf_row_stride)])
                    else:
                        sf_value[0] = sf[row * sf_row_stride + kblock * sf_kblock_stride]
                multiplier[0] = T.ieee_fdiv(T.float32(1.0), sf_value[0])
            else:
                scale_and_multiplier(group_amax[item], fmt, round_sf != 0, sf_value, multiplier)
                if writes_scale:
                    if packed_ue8m0:
                        sf[packed_scale_index(row, kblock, sf_row_stride)] = ue8m0_byte(sf_value[0])
                        if kblock == num_kblocks - 1:
                            # The contract wants the unused bytes of the last word zeroed.
                            for spare in T.unroll(1, 4):
                                if kblock % 4 + spare < 4:
                                    sf[packed_scale_index(row, kblock, sf_row_stride) + spare] = T.uint8(0)
                    else:
                        sf[row * sf_row_stride + kblock * sf_kblock_stride] = sf_value[0]

            # Encode and store the data, one wide store per vector.
            if mode != MODE_SF_ONLY:
                for v in T.unroll(vectors_per_chunk):
                    if first_vector + v < hidden_vectors:
                        q_offset = q_row + (first_vector + v) * stored_per_vector
                        store_encoded_vector(q, q_offset, values, item, v * vector, multiplier[0], fmt, vector, codes)

    @T.prim_func
    def kernel(
        x: T.Tensor((x_span,), in_dtype),
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
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            values = T.alloc_local((items, chunk), "float32")
            group_amax = T.alloc_local((items,), "int32")
            sf_value = T.alloc_local((1,), "float32")
            multiplier = T.alloc_local((1,), "float32")
            codes = T.alloc_local((stored_per_vector,), "uint8")
            load_unit(x, values, row, part, hidden_vectors, row_stride_vectors, warp, lane)
            encode_unit(
                q,
                sf,
                values,
                group_amax,
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
def store_encoded_vector(q, q_offset, values, item, first, multiplier, fmt, vector, codes):
    """Encode ``values[item, first : first + vector] · multiplier`` and store it with one wide store
    (e4m3: ``vector`` bytes; e2m1: ``vector / 2`` bytes, element 2j in the low nibble)."""
    if fmt is E4M3:
        for e in T.vectorized(vector):
            q[q_offset + e] = T.cast(values[item, first + e] * multiplier, "float8_e4m3")
    else:
        for p in T.unroll(vector // 2):
            low = e2m1_code(values[item, first + 2 * p] * multiplier)
            high = e2m1_code(values[item, first + 2 * p + 1] * multiplier)
            codes[p] = T.cast(low | (high << 4), "uint8")
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
            for step in T.unroll(5):
                amax[0] = T.max(amax[0], T.shfl_xor(amax[0], 1 << step))
            if lane == 0:
                warp_amax[warp] = amax[0]
            T.sync_threads()
            for w in T.unroll(warps):
                amax[0] = T.max(amax[0], warp_amax[w])

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


def _vector_width(x: torch.Tensor) -> int:
    """Widest vector (elements, at most 16 bytes) that every row start and the row length allow."""
    element_bytes = x.element_size()
    vector = 16 // element_bytes
    while vector > 1 and (x.shape[1] % vector or x.stride(0) % vector or x.data_ptr() % (vector * element_bytes)):
        vector //= 2
    return vector


def _launch(x, spec, num_per_channels, sf, q, mode: int, round_sf: bool, packed: bool):
    tokens, hidden = x.shape
    if tokens == 0:
        return
    vector = _vector_width(x)
    if spec is E2M1 and vector < 2:
        raise ValueError("e2m1 needs rows that start on 2-element boundaries (even row stride, aligned base)")
    row_wide = num_per_channels not in PER_TOKEN_CHANNEL_BLOCKS
    if row_wide:
        kernel = per_row_cast_kernel(_TL_DTYPES[x.dtype], spec.name, hidden, vector, packed)
    else:
        kernel = per_token_cast_kernel(
            _TL_DTYPES[x.dtype],
            spec.name,
            num_per_channels,
            vector,
            packed,
            **schedule(spec.name, num_per_channels, vector, tokens),
        )
    if compiling_only():
        return
    if packed:
        # int32 words [rows, kwords] with strides (1, ld): pass the bytes; ld counts words.
        sf_argument, row_stride, kblock_stride = flat_view(sf).view(torch.uint8), sf.stride(1), 0
    else:
        sf_argument, row_stride, kblock_stride = flat_view(sf), sf.stride(0), sf.stride(1)
    row_stride_vectors = x.stride(0) // vector if tokens > 1 else hidden // vector
    q_argument = flat_view(q).view(torch.uint8) if spec is E2M1 else flat_view(q)
    if row_wide:
        kernel(flat_view(x), q_argument, sf_argument, tokens, row_stride_vectors, row_stride, mode, int(round_sf))
    else:
        kblocks = ceil_div(hidden, num_per_channels)
        kernel(
            flat_view(x),
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


def _allocate_data(x: torch.Tensor, spec) -> torch.Tensor:
    tokens, hidden = x.shape
    return new_output(torch.empty((tokens, hidden // spec.values_per_byte), dtype=spec.storage_dtype, device=x.device))


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
    ``tileproof.reference.quant.per_token_cast`` (shapes, layouts, rounding), bit for bit."""
    spec = check_per_token_cast_input(x, fmt, num_per_channels, x_block_size)
    round_sf = check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    require_cuda("x", x)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)
    tokens, hidden = x.shape
    sf = new_output(layout.empty(tokens, ceil_div(hidden, num_per_channels), x.device))
    q = _allocate_data(x, spec)
    _launch(x, spec, num_per_channels, sf, q, MODE_CAST, round_sf, use_packed_ue8m0)
    return q, sf


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
    spec = check_per_token_cast_input(x, fmt, num_per_channels, x_block_size)
    round_sf = check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    require_cuda("x", x)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)
    tokens, hidden = x.shape
    sf = new_output(layout.empty(tokens, ceil_div(hidden, num_per_channels), x.device))
    placeholder = torch.empty((0,), dtype=spec.storage_dtype, device=x.device)
    _launch(x, spec, num_per_channels, sf, placeholder, MODE_SF_ONLY, round_sf, use_packed_ue8m0)
    return sf


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
    spec = check_per_token_cast_input(x, fmt, num_per_channels, x_block_size)
    check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    require_cuda("x", x)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)
    tokens, hidden = x.shape
    check_scale_tensor(
        "sf", sf, rows=tokens, kblocks=ceil_div(hidden, num_per_channels), layout=layout, device=x.device
    )
    q = _allocate_data(x, spec)
    _launch(x, spec, num_per_channels, sf, q, MODE_PRECOMPUTED_SF, False, use_packed_ue8m0)
    return q

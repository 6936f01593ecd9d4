"""Optimized twin of the transpose family (contract §3): one TileLang kernel for every element width.

Same public names, argument order and results (bit for bit) as ``tileproof.reference.transpose``.
A transpose moves bytes and never computes: the kernel sees ``x`` and the output as flat byte
arrays and moves elements of ``element_bytes`` (1, 2, 4, 8 or 16: complex128 is one 16-byte
element) as 32-bit words and byte permutes, so no value is ever converted.

Kernel design (memory-bound: read every element once, write it once). A CTA moves one *tile* of
``tile_rows × tile_cols`` elements of one matrix through shared memory; ``V = 16 / element_bytes``
elements make one 16-byte *chunk*.

- Loads: the tile is ``tile_rows`` input rows of ``tile_n_vectors`` chunks (``tile_cols = V ·
  tile_n_vectors``); consecutive lanes take consecutive chunks of a row, so a warp reads whole
  128-byte row segments. Every thread issues all its loads before it stores any to shared memory
  (independent 16-byte loads in flight).
- Stores: the output tile is ``tile_cols`` rows of ``tile_m_vectors`` chunks (``tile_rows = V ·
  tile_m_vectors``). A thread takes a *unit*: ``V`` consecutive input rows × ``column_bytes`` bytes
  of shared memory, i.e. ``column_bytes / element_bytes`` output rows of one 16-byte chunk each. It
  reads the ``V`` row pieces (one ``column_bytes``-wide shared load each), transposes them in
  registers and stores each output chunk with one 16-byte store. Consecutive lanes take
  consecutive chunks of the same output rows: a warp writes whole 128-byte row segments.
- The register transpose: 4- to 16-byte elements are whole words, only renamed; 2-byte elements
  are paired by one ``__byte_perm`` per output word (the low or the high halves of two words);
  1-byte elements by two rounds of ``__byte_perm`` (pairs of rows interleaved, then pairs of
  pairs), eight per four output words.
- Bank conflicts: chunk ``q`` of tile row ``r`` lives at chunk ``q ^ ((r / V) mod 8)`` of its row
  (shared rows are multiples of 128 bytes, so a chunk's banks depend only on its position mod 8).
  A load's quarter-warp writes 8 consecutive chunks of one row (a permutation of the 8 bank
  groups); a unit read by 8 lanes of consecutive ``a = r / V`` and the same column finds them in
  8 distinct bank groups, and 2 or 4 column pieces of one chunk (``column_bytes`` 8 or 4) fill
  the rest of the 32 banks: with ``tile_m_vectors = 8`` every shared access is conflict-free.
- Tails and alignment, all runtime values (one compiled kernel per element width and schedule):
  rows past M are not loaded and their output elements never stored; the chunk straddling N is
  loaded element by element, chunks past it not at all. ``load_bytes`` (16, 8, 4, 2 or 1: the
  alignment of the base address, the row stride and the batch stride) splits every 16-byte load
  into aligned pieces. ``store_bytes`` is the alignment of an output row (``M · element_bytes``;
  the output is fresh, its base 16-byte aligned). One copy of the load loop and of the store loop
  per width, behind a branch uniform across the grid: the aligned path stays branch-free.
- Misaligned output rows (``store_bytes`` < 16): split into ``store_bytes``-wide pieces, a 16-byte
  store would become up to 16 one-byte stores, each touching every sector of the warp's rows (the
  H200 ran such shapes at 7-17 % of the copy roof). Instead the ``tile_m_vectors`` lanes that write
  one 128-byte row segment (its *group*) write it as aligned 16-byte chunks. The segment starts at
  ``base``, ``shift = base mod 16`` bytes past an aligned address (the same for every segment of a
  row: tiles are 16-byte multiples); aligned chunk ``c`` (at ``base - shift + 16 c``) holds the
  last ``shift`` bytes of logical chunk ``c - 1`` and the first ``16 - shift`` of chunk ``c``. Lane
  ``c`` receives lane ``c - 1``'s chunk (``__shfl_sync`` within the group, 4 words; rotated, so
  lane 0 receives the last lane's) and forms aligned chunk ``c`` with a select of whole words
  (``shift / 4``) and a ``__byte_perm`` per word (``shift mod 4`` bytes). Each lane stores its
  aligned chunk whole (one 16-byte store), except where it leaves the segment: lane 0's chunk
  starts before ``base`` (the segment's *head*: its bytes from ``shift`` on), and a chunk may reach
  past M (only its bytes before M). Lane 0's rotated chunk also holds the segment's *tail*, the
  last ``shift`` bytes of the last lane's chunk, which lane 0 stores in the aligned chunk after the
  segment. A partial chunk, bytes ``lo .. hi``, goes out in naturally aligned 1/2/4/8-byte pieces
  (ascending sizes from ``lo``, then descending to ``hi``; at most 8 pieces, usually 1-3).
  Lanes whose chunk starts past M still shuffle and store: the lane after the last one inside M
  writes that lane's last bytes (its own are masked). Needs a group that is a power-of-two part
  of a warp and whole warps of units (every default schedule); other schedules keep the pieces.
- Grid: one CTA per (matrix, tile), all on grid x (grid y and z stop at 65535); consecutive CTAs
  take consecutive tiles along M (``m_fastest``) or along N.
"""

import tilelang.language as T
import torch

from tileproof.reference.transpose import check_transpose_input

from .jit import LaunchPlans, address, flat_view, jit, launched, new_output, require_cuda

__all__ = ["transpose", "batched_transpose"]

CHUNK_BYTES = 16  # one global vector: 16-byte loads and stores
ELEMENT_BYTES = (1, 2, 4, 8, 16)
# ``__byte_perm`` selectors (nibble n: the source byte of result byte n, 0-3 the first word, 4-7 the
# second): 0x5140 interleaves bytes 0, 1 of two words and 0x7362 bytes 2, 3; 0x5410 takes the low
# halves of two words and 0x7632 the high halves. Both high selections are the low ones + 0x2222.
INTERLEAVE_LOW_BYTES = 0x5140
LOW_HALVES = 0x5410
HIGH_SELECTION_STEP = 0x2222
# ``IDENTITY_SELECTOR + o * BYTE_SHIFT_STEP`` selects bytes o .. o+3 of ``high_word:low_word`` (o = 0 .. 4).
IDENTITY_SELECTOR = 0x3210
BYTE_SHIFT_STEP = 0x1111
MAX_GRID_X = 2**31 - 1
MAX_SIDE = 2**31 - 2**16  # M and N: tile indices are int32 (a tile may reach past the last row or column)

# Default schedule per element width: (tile_m_vectors, tile_n_vectors, threads, column_bytes). Tiles
# of 128-byte output rows and 128- to 1024-byte input rows, 8 to 16 KB per CTA; to be swept on the H200.
SCHEDULES = {
    1: (8, 8, 256, 4),
    2: (8, 16, 256, 8),
    4: (8, 32, 256, 16),
    8: (8, 32, 256, 16),
    16: (8, 64, 256, 16),
}


def schedule(element_bytes: int) -> dict:
    """The static parameters of ``transpose_kernel`` for an element width (``SCHEDULES``)."""
    tile_m_vectors, tile_n_vectors, threads, column_bytes = SCHEDULES[element_bytes]
    return {
        "tile_m_vectors": tile_m_vectors,
        "tile_n_vectors": tile_n_vectors,
        "threads": threads,
        "column_bytes": column_bytes,
    }


def byte_perm(low_word, high_word, selector):
    """``__byte_perm``: byte ``n`` of the result is byte ``selector`` nibble ``n`` of the 8-byte
    value ``high_word:low_word`` (one PRMT instruction)."""
    return T.call_extern("uint32", "__byte_perm", low_word, high_word, selector)


@jit()
def transpose_kernel(
    element_bytes: int,
    tile_m_vectors: int = 8,
    tile_n_vectors: int = 8,
    threads: int = 256,
    column_bytes: int = 16,
    min_blocks: int = 0,
    m_fastest: bool = True,
):
    """Factory over the static parameters; every size, stride and alignment is a runtime value.

    Static: ``element_bytes`` (1, 2, 4, 8, 16); the tile, ``tile_m_vectors`` output chunks ×
    ``tile_n_vectors`` input chunks (a power of two >= 8); ``threads``; ``column_bytes`` (4, 8 or 16:
    the shared-memory read per input row of a unit); ``min_blocks`` (CTAs per SM to fit, which
    bounds the registers; 0: no bound); ``m_fastest`` (the CTA order).

    ``x`` and ``out`` are the flat bytes of the input (from its first element) and of the
    contiguous output. Runtime: ``rows`` (M), ``cols`` (N), the tile counts, the row and batch
    strides of ``x`` in bytes, and ``load_bytes`` / ``store_bytes`` (the widest aligned access to
    an input / output row, see the module docstring).
    """
    vector = CHUNK_BYTES // element_bytes  # elements per chunk
    tile_rows = tile_m_vectors * vector
    tile_cols = tile_n_vectors * vector
    row_bytes = tile_n_vectors * CHUNK_BYTES  # one tile row in shared memory
    chunks = tile_rows * tile_n_vectors
    loads = -(-chunks // threads)  # chunks each thread loads (the last round may leave threads idle)
    units = tile_m_vectors * (row_bytes // column_bytes)
    unit_rounds = -(-units // threads)
    out_rows_per_unit = column_bytes // element_bytes
    pieces_per_chunk = CHUNK_BYTES // column_bytes
    column_words = column_bytes // 4
    element_words = max(1, element_bytes // 4)  # 32-bit words per element (register transpose)
    # Access widths a row may be aligned to (an element is always aligned to its own size).
    piece_widths = [width for width in (16, 8, 4, 2, 1) if width >= element_bytes]
    if element_bytes not in ELEMENT_BYTES:
        raise ValueError(f"element_bytes must be one of {ELEMENT_BYTES}, got {element_bytes}")
    if column_bytes not in (4, 8, 16) or column_bytes < element_bytes:
        raise ValueError(f"column_bytes must be 4, 8 or 16 and hold an element, got {column_bytes}")
    if tile_n_vectors < 8 or tile_n_vectors & (tile_n_vectors - 1):
        raise ValueError(f"tile_n_vectors must be a power of two >= 8 (the swizzle), got {tile_n_vectors}")
    if threads % 32 or threads > 1024:
        raise ValueError(f"threads must be a multiple of 32 up to 1024, got {threads}")

    # Misaligned output rows (store_bytes < 16) are written as shifted aligned chunks (module
    # docstring): a lane takes its predecessor's chunk with a warp shuffle within its group of
    # ``tile_m_vectors`` lanes, so the group must be a power-of-two part of a warp, and every lane of
    # a warp that reaches the shuffle (``units`` a multiple of 32). Other schedules store narrow pieces.
    group_fits_warp = tile_m_vectors <= 32 and not tile_m_vectors & (tile_m_vectors - 1)
    shifted_stores = element_bytes < CHUNK_BYTES and group_fits_warp and units % 32 == 0
    store_widths = [CHUNK_BYTES] if shifted_stores else piece_widths
    # Pieces of a partial shifted chunk: no narrower than an element (every boundary is a multiple of one).
    piece_sizes = [size for size in (1, 2, 4, 8) if size >= element_bytes]

    x_span = T.dynamic("x_span", "int64")  # bytes: a tensor may exceed 2 GB
    out_span = T.dynamic("out_span", "int64")

    def swizzled(row, row_block, chunk):
        """Byte offset of ``chunk`` of tile row ``row`` (``row_block = row / V``) in shared memory."""
        return row * row_bytes + (chunk ^ (row_block % 8)) * CHUNK_BYTES

    @T.macro
    def load_chunk(x, loaded, k, row_offset, chunk_column, piece_bytes: int):
        """Chunk ``chunk_column`` (16 bytes) of the row at byte ``row_offset`` into ``loaded[k]``,
        in aligned pieces of ``piece_bytes``."""
        first_piece = row_offset // piece_bytes + chunk_column * (CHUNK_BYTES // piece_bytes)
        for p in T.unroll(CHUNK_BYTES // piece_bytes):
            for e in T.vectorized(piece_bytes):
                loaded[k, p * piece_bytes + e] = x[(first_piece + p) * piece_bytes + e]

    @T.macro
    def load_partial_chunk(x, loaded, k, row_offset, column, cols):
        """The elements of a chunk straddling N (from element ``column``) one by one."""
        first_element = row_offset // element_bytes + column
        for p in T.unroll(vector):
            if column + p < cols:
                for e in T.vectorized(element_bytes):
                    loaded[k, p * element_bytes + e] = x[(first_element + p) * element_bytes + e]

    @T.macro
    def store_chunk(out, chunk, j, row_offset, chunk_column, first_row, rows, piece_bytes: int):
        """``chunk[j]`` (16 bytes: output elements from ``first_row``) into the output row at byte
        ``row_offset``, in aligned pieces of ``piece_bytes``, each masked against M (a piece never
        straddles M: M · element_bytes is a multiple of ``piece_bytes``)."""
        first_piece = row_offset // piece_bytes + chunk_column * (CHUNK_BYTES // piece_bytes)
        for p in T.unroll(CHUNK_BYTES // piece_bytes):
            if first_row + p * (piece_bytes // element_bytes) < rows:
                for e in T.vectorized(piece_bytes):
                    out[(first_piece + p) * piece_bytes + e] = chunk[j, p * piece_bytes + e]

    def pair_word(previous, chunk_registers, j, n):
        """Word ``n`` (0-7) of the 32 bytes ``previous`` (the group predecessor's chunk) : own chunk ``j``."""
        return previous[n] if n < 4 else chunk_registers[j, n - 4]

    @T.macro
    def shift_chunk(previous, chunk_registers, j, window, aligned, shift):
        """``aligned`` ← the 16 bytes that start ``shift`` bytes before own chunk ``j``: the last
        ``shift`` bytes of ``previous``, then the first ``16 - shift`` bytes of chunk ``j``."""
        word_shift = shift >> 2  # whole words taken from ``previous``
        # window[i] = word 3 - word_shift + i of previous : own (runtime index: a select chain).
        for i in list(range(5)):  # unrolled in Python: the word indices must be Python integers
            window[i] = T.if_then_else(
                word_shift == 0,
                pair_word(previous, chunk_registers, j, 3 + i),
                T.if_then_else(
                    word_shift == 1,
                    pair_word(previous, chunk_registers, j, 2 + i),
                    T.if_then_else(
                        word_shift == 2,
                        pair_word(previous, chunk_registers, j, 1 + i),
                        pair_word(previous, chunk_registers, j, i),
                    ),
                ),
            )
        if element_bytes >= 4:
            for w in T.unroll(4):
                aligned[w] = window[w + 1]  # shift is a multiple of 4: whole words
        else:
            # Bytes 4 - shift % 4 .. 7 - shift % 4 of window[w + 1] : window[w] (shift % 4 = 0: window[w + 1]).
            selector = IDENTITY_SELECTOR + (4 - (shift & 3)) * BYTE_SHIFT_STEP
            for w in T.unroll(4):
                aligned[w] = byte_perm(window[w], window[w + 1], selector)

    @T.macro
    def store_piece(
        out, aligned, aligned_bytes, narrow_word, narrow_bytes, chunk_index, position, size: int, fixed: int
    ):
        """Bytes ``position .. position + size`` of the register chunk ``aligned`` to the same bytes
        of the 16-byte output chunk ``chunk_index`` (``position`` a multiple of ``size``). An 8-byte
        piece sits at the known offset ``fixed`` (8 when ascending from ``lo``, 0 descending to ``hi``)."""
        if size == 8:
            for e in T.vectorized(8):
                out[chunk_index * CHUNK_BYTES + fixed + e] = aligned_bytes[fixed + e]
        else:
            word_index = position >> 2
            word = T.if_then_else(
                word_index == 0,
                aligned[0],
                T.if_then_else(word_index == 1, aligned[1], T.if_then_else(word_index == 2, aligned[2], aligned[3])),
            )
            narrow_word[0] = word >> T.cast((position & 3) * 8, "uint32")
            piece_index = chunk_index * (CHUNK_BYTES // size) + T.cast(position >> (size.bit_length() - 1), "int64")
            for e in T.vectorized(size):
                out[piece_index * size + e] = narrow_bytes[e]

    @T.macro
    def store_range(out, aligned, aligned_bytes, narrow_word, narrow_bytes, chunk_index, lo, hi, position):
        """Bytes ``lo .. hi`` (0 <= lo < hi <= 16, not 0 .. 16) of ``aligned`` to output chunk
        ``chunk_index``, in naturally aligned pieces: ascending sizes from ``lo`` while its alignment
        allows, then descending sizes to ``hi`` (at most one piece of each size each way)."""
        position[0] = lo
        for size in piece_sizes:
            if (position[0] & size) != 0 and position[0] + size <= hi:
                store_piece(out, aligned, aligned_bytes, narrow_word, narrow_bytes, chunk_index, position[0], size, 8)
                position[0] = position[0] + size
        for size in list(reversed(piece_sizes)):
            if position[0] + size <= hi:
                store_piece(out, aligned, aligned_bytes, narrow_word, narrow_bytes, chunk_index, position[0], size, 0)
                position[0] = position[0] + size

    @T.macro
    def transpose_unit(block, chunk_registers):
        """``block[i, w]`` (word ``w`` of the unit's piece of input row ``i``) → ``chunk_registers[j, k]``
        (word ``k`` of output chunk ``j``: the unit's elements of input column ``j``)."""
        if element_bytes == 1:
            for j in T.unroll(out_rows_per_unit):
                for k in T.unroll(4):
                    # Byte j % 4 of word j / 4 of rows 4k .. 4k+3: interleave rows (4k, 4k+1) and
                    # (4k+2, 4k+3) bytewise, then take the matching halves of the two pairs.
                    pairs = INTERLEAVE_LOW_BYTES + (j % 4 // 2) * HIGH_SELECTION_STEP
                    upper = byte_perm(block[4 * k, j // 4], block[4 * k + 1, j // 4], pairs)
                    lower = byte_perm(block[4 * k + 2, j // 4], block[4 * k + 3, j // 4], pairs)
                    chunk_registers[j, k] = byte_perm(upper, lower, LOW_HALVES + (j % 2) * HIGH_SELECTION_STEP)
        elif element_bytes == 2:
            for j in T.unroll(out_rows_per_unit):
                for k in T.unroll(4):
                    halves = LOW_HALVES + (j % 2) * HIGH_SELECTION_STEP
                    chunk_registers[j, k] = byte_perm(block[2 * k, j // 2], block[2 * k + 1, j // 2], halves)
        else:
            for j in T.unroll(out_rows_per_unit):
                for i in T.unroll(vector):
                    for h in T.unroll(element_words):
                        chunk_registers[j, i * element_words + h] = block[i, j * element_words + h]

    @T.prim_func
    def kernel(
        x: T.Tensor((x_span,), "uint8"),
        out: T.Tensor((out_span,), "uint8"),
        rows: T.int32,
        cols: T.int32,
        tiles_m: T.int32,
        tiles_n: T.int32,
        num_ctas: T.int32,
        x_row_bytes: T.int64,
        x_batch_bytes: T.int64,
        load_bytes: T.int32,
        store_bytes: T.int32,
    ):
        with T.Kernel(num_ctas, threads=threads) as (cta,):
            if min_blocks:
                T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            tile = T.alloc_shared((tile_rows * row_bytes,), "uint8")
            # Register arrays of 32-bit words, moved as bytes (TileLang declares each array with the
            # type of its last view).
            loaded = T.alloc_local((loads, CHUNK_BYTES), "uint8")
            T.view(loaded, (loads, CHUNK_BYTES // 4), "uint32")
            block_bytes = T.alloc_local((vector * column_bytes,), "uint8")
            block = T.view(block_bytes, (vector, column_words), "uint32")
            chunk = T.alloc_local((out_rows_per_unit, CHUNK_BYTES), "uint8")
            chunk_registers = T.view(chunk, (out_rows_per_unit, CHUNK_BYTES // 4), "uint32")
            if shifted_stores:
                previous = T.alloc_local((4,), "uint32")  # the group predecessor's chunk
                window = T.alloc_local((5,), "uint32")
                aligned_bytes = T.alloc_local((CHUNK_BYTES,), "uint8")  # the shifted, aligned chunk
                aligned = T.view(aligned_bytes, (4,), "uint32")
                narrow_bytes = T.alloc_local((4,), "uint8")  # one piece narrower than 8 bytes
                narrow_word = T.view(narrow_bytes, (1,), "uint32")
                position = T.alloc_local((1,), "int32")  # the next byte to store of a partial chunk
                # Per output row, computed once (TileLang would repeat the expressions at every use).
                shift = T.alloc_var("int32")
                chunk_index = T.alloc_var("int64")
                lo = T.alloc_var("int32")
                hi = T.alloc_var("int32")
                tail = T.alloc_var("int32")

            # Computed once into variables: TileLang would repeat each floor division at every use.
            tile_m = T.alloc_var("int32")
            tile_n = T.alloc_var("int32")
            batch = T.alloc_var("int32")
            if m_fastest:
                tile_m = cta % tiles_m
                tile_n = cta // tiles_m % tiles_n
            else:
                tile_n = cta % tiles_n
                tile_m = cta // tiles_n % tiles_m
            batch = cta // tiles_m // tiles_n
            first_row = tile_m * tile_rows
            first_col = tile_n * tile_cols
            x_matrix = T.cast(batch, "int64") * x_batch_bytes

            # 1. Every load of the tile in flight, then into shared memory. Whole chunks: one copy
            #    of the loop per access width (a uniform branch outside it keeps the fast path
            #    branch-free); the chunk straddling N, if any: element by element.
            for piece_bytes in piece_widths:
                if load_bytes == piece_bytes:
                    for k in T.unroll(loads):
                        r = (k * threads + tx) // tile_n_vectors
                        q = (k * threads + tx) % tile_n_vectors
                        if k * threads + tx < chunks and first_row + r < rows and first_col + (q + 1) * vector <= cols:
                            load_chunk(
                                x,
                                loaded,
                                k,
                                x_matrix + T.cast(first_row + r, "int64") * x_row_bytes,
                                tile_n * tile_n_vectors + q,
                                piece_bytes,
                            )
            if vector > 1 and first_col + tile_cols > cols:
                for k in T.unroll(loads):
                    r = (k * threads + tx) // tile_n_vectors
                    q = (k * threads + tx) % tile_n_vectors
                    column = first_col + q * vector
                    if k * threads + tx < chunks and first_row + r < rows and column < cols and column + vector > cols:
                        load_partial_chunk(
                            x, loaded, k, x_matrix + T.cast(first_row + r, "int64") * x_row_bytes, column, cols
                        )
            for k in T.unroll(loads):
                r = (k * threads + tx) // tile_n_vectors
                q = (k * threads + tx) % tile_n_vectors
                if k * threads + tx < chunks:
                    for e in T.vectorized(CHUNK_BYTES):
                        tile[swizzled(r, r // vector, q) + e] = loaded[k, e]
            T.sync_threads()

            # 2. Units: V rows x column_bytes from shared memory -> output chunks.
            out_row_bytes = T.cast(rows, "int64") * element_bytes
            out_matrix_rows = T.cast(batch, "int64") * cols
            for k in T.unroll(unit_rounds):
                a = (k * threads + tx) % tile_m_vectors
                g = (k * threads + tx) // tile_m_vectors
                unit_first_row = first_row + a * vector
                unit_first_col = first_col + g * out_rows_per_unit
                if k * threads + tx < units and unit_first_row < rows and unit_first_col < cols:
                    piece = (g % pieces_per_chunk) * column_bytes  # the unit's bytes inside its chunk
                    for i in T.unroll(vector):
                        for e in T.vectorized(column_bytes):
                            block_bytes[i * column_bytes + e] = tile[
                                swizzled(a * vector + i, a, g // pieces_per_chunk) + piece + e
                            ]
                    transpose_unit(block, chunk_registers)
                    for piece_bytes in store_widths:
                        if store_bytes == piece_bytes:
                            for j in T.unroll(out_rows_per_unit):
                                if unit_first_col + j < cols:
                                    store_chunk(
                                        out,
                                        chunk,
                                        j,
                                        (out_matrix_rows + unit_first_col + j) * out_row_bytes,
                                        tile_m * tile_m_vectors + a,
                                        unit_first_row,
                                        rows,
                                        piece_bytes,
                                    )
                if shifted_stores:
                    # Misaligned output rows: every lane of the warp shuffles (lanes past M included:
                    # a successor may need their predecessor's bytes); stores masked per byte range.
                    if store_bytes < CHUNK_BYTES and k * threads + tx < units:
                        # The unit's logical chunk starts ``remaining`` bytes before the end of its output rows.
                        remaining = out_row_bytes - T.cast(tile_m * tile_m_vectors + a, "int64") * CHUNK_BYTES
                        for j in T.unroll(out_rows_per_unit):
                            # Lane a of the group is lane a of its shuffle segment (groups tile the warp).
                            for w in T.unroll(4):
                                previous[w] = T.shfl_sync(
                                    chunk_registers[j, w], (a + tile_m_vectors - 1) % tile_m_vectors, tile_m_vectors
                                )
                            if unit_first_col + j < cols:
                                row_start = (out_matrix_rows + unit_first_col + j) * out_row_bytes
                                shift = T.cast(row_start & (CHUNK_BYTES - 1), "int32")  # the row's misalignment
                                # Aligned chunk ``shift`` bytes before the logical one (``chunk_index`` · 16).
                                chunk_index = (row_start >> 4) + T.cast(tile_m * tile_m_vectors + a, "int64")
                                shift_chunk(previous, chunk_registers, j, window, aligned, shift)
                                # Bytes of the aligned chunk inside the row: from the segment's start
                                # (lane 0: ``shift``), to the row's end (M). ``room``: the row's bytes
                                # from the aligned chunk on.
                                room = remaining + T.cast(shift, "int64")
                                lo = T.if_then_else(a == 0, shift, 0)
                                hi = T.cast(T.max(T.min(room, CHUNK_BYTES), 0), "int32")
                                if lo == 0 and hi == CHUNK_BYTES:
                                    for e in T.vectorized(CHUNK_BYTES):
                                        out[chunk_index * CHUNK_BYTES + e] = aligned_bytes[e]
                                elif lo < hi:
                                    store_range(
                                        out,
                                        aligned,
                                        aligned_bytes,
                                        narrow_word,
                                        narrow_bytes,
                                        chunk_index,
                                        lo,
                                        hi,
                                        position,
                                    )
                                # Lane 0 also holds the segment's tail (its predecessor by rotation is
                                # the group's last lane): bytes 0 .. shift of its aligned chunk, the last
                                # lane's last ``shift`` bytes, go to the aligned chunk after the segment
                                # (up to M).
                                tail = T.cast(
                                    T.max(T.min(room - tile_m_vectors * CHUNK_BYTES, T.cast(shift, "int64")), 0),
                                    "int32",
                                )
                                if a == 0 and tail > 0:
                                    store_range(
                                        out,
                                        aligned,
                                        aligned_bytes,
                                        narrow_word,
                                        narrow_bytes,
                                        chunk_index + tile_m_vectors,
                                        0,
                                        tail,
                                        position,
                                    )

    return kernel


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def _alignment(*byte_counts: int) -> int:
    """The widest access (16, 8, 4, 2 or 1 bytes) aligned at every one of ``byte_counts``."""
    width = CHUNK_BYTES
    while width > 1 and any(count % width for count in byte_counts):
        width //= 2
    return width


def _transpose_plan(x: torch.Tensor, batched: bool):
    """Check a transpose of ``x``'s signature (``[B, M, N]`` when ``batched``, else ``[M, N]``)
    and decide its launch. The plan, ``run(x) -> out``, allocates ``out`` (``[B, N, M]`` or
    ``[N, M]``, contiguous) and launches ``transpose_kernel`` with ``schedule(element_bytes)``."""
    check_transpose_input("x", x, 3 if batched else 2)
    require_cuda("x", x)
    batches, rows, cols = x.shape if batched else (1, *x.shape)
    out_shape = (batches, cols, rows) if batched else (cols, rows)
    dtype, device = x.dtype, x.device

    def allocate():
        return new_output(torch.empty(out_shape, dtype=dtype, device=device))

    if batches * rows * cols == 0:
        return lambda x: allocate()
    element_bytes = x.element_size()
    vector = CHUNK_BYTES // element_bytes
    tiles = schedule(element_bytes)
    tiles_m = -(-rows // (tiles["tile_m_vectors"] * vector))
    tiles_n = -(-cols // (tiles["tile_n_vectors"] * vector))
    num_ctas = batches * tiles_m * tiles_n
    if max(rows, cols) > MAX_SIDE:
        raise ValueError(f"x of shape {tuple(x.shape)}: at most {MAX_SIDE} rows and columns (int32 tile indices)")
    if num_ctas > MAX_GRID_X:
        raise ValueError(f"x of shape {tuple(x.shape)} needs {num_ctas} tiles, more than one launch has ({MAX_GRID_X})")
    kernel = launched(transpose_kernel(element_bytes, **tiles))
    # Strides of dimensions of size 1 never address memory: they constrain no alignment. The
    # matrix of a 2-D x spans the same elements as a batch of one, so it is passed flat as it is.
    row_stride = x.stride(-2) if rows > 1 else 0
    batch_stride = x.stride(0) if batched and batches > 1 else 0
    load_bytes = _alignment(address(x), row_stride * element_bytes, batch_stride * element_bytes)
    store_bytes = _alignment(rows * element_bytes)
    scalars = (
        rows,
        cols,
        tiles_m,
        tiles_n,
        num_ctas,
        row_stride * element_bytes,
        batch_stride * element_bytes,
        load_bytes,
        store_bytes,
    )

    def run(x):
        out = allocate()
        if kernel is not None:
            kernel(flat_view(x).view(torch.uint8), out.view(-1).view(torch.uint8), *scalars)
        return out

    return run


_TRANSPOSE_PLANS = LaunchPlans(_transpose_plan)


def batched_transpose(x: torch.Tensor) -> torch.Tensor:
    """Swap the last two dimensions of a batch of matrices: ``out[b, j, i] = x[b, i, j]``; same
    contract as ``tileproof.reference.transpose.batched_transpose`` (any dtype, 16-byte complex128
    included; tails; row stride > N; free batch stride), bit for bit."""
    return _TRANSPOSE_PLANS.plan(x, True)(x)


def transpose(x: torch.Tensor) -> torch.Tensor:
    """Transpose one matrix: ``out[j, i] = x[i, j]``; same contract as
    ``tileproof.reference.transpose.transpose``, bit for bit (one batch of ``batched_transpose``)."""
    return _TRANSPOSE_PLANS.plan(x, False)(x)

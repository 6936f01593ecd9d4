"""Per-channel casts with a gather, an FP8 input or a transposed output: ``per_channel_cast_fused``
and ``per_channel_cast_and_transpose`` (e4m3 output, ``nt`` tokens × 1 channel per scale).

Kernel design (memory-bound: read the rows once, write q and sf once). The design of
``blocks.block_cast_kernel`` (column threads × row threads, a block's amax through shuffles and one
shared-memory exchange, one owner per column turning it into ``sf`` and the multiplier), with a
tile of 128 tokens whatever ``nt`` (32-token scale blocks are sub-blocks of the tile) and each
thread owning 8 *consecutive* tokens of one vector of channels:

- Loads: thread ``(row r, column c)`` loads tokens ``8r .. 8r+7`` of its 16-byte vector (8 bf16, 4
  fp32 or 16 e4m3 channels), all before using any; a warp reads two 256-byte row segments per
  load. With ``pos_to_token`` each token is first mapped to its source row (-1: a zero row; so is an
  index past x's rows, which the launcher refuses except inside a CUDA-graph capture). An
  e4m3 input is dequantized in registers: ``decode(q) · sf`` in fp32 with the scale of the row's
  1×128 block (a 16-element vector never straddles one), computed again when encoding rather than
  kept (16 fp32 registers per token otherwise).
- Amax: per channel over the thread's 8 tokens, then the warp's two row threads (16 tokens, always
  inside one scale block) by one shuffle, then one shared slot per warp; owners fold the slots of
  their block (8 warps for nt = 128, 2 for nt = 32).
- Row-major output (the fused cast): each thread encodes its 8 tokens and stores one vector per
  token, as ``block_cast_kernel`` does.
- Transposed output: each thread encodes, per channel, its 8 consecutive tokens into one 8-byte
  slot of a shared ``[channels][128 tokens]`` e4m3 tile; then each thread reads 16 consecutive
  tokens of a channel (one 16-byte shared load) and stores them to ``q[h, t : t+16]``: a warp
  writes four 128-byte channel-row segments. Slots are XOR-swizzled so that neither side has bank
  conflicts: token slot ``r`` of a channel written by column thread ``c`` lives at slot ``r ^ c``.
  The 16 lanes of a half-warp (same ``r``, ``c`` = 0..15) hit 16 distinct slots, i.e. all 32 banks
  (each 128-byte channel row spans the banks once); a 16-byte read of chunk ``k`` (slots
  ``2k, 2k+1``) finds them in physical chunk ``k ^ (c >> 1)``, swapped when ``c`` is odd, and the
  8 lanes of a quarter-warp read the 8 distinct chunks of one channel row.
- Tails: tokens past P and vectors past H are masked and count as zeros; a token-block scale is
  taken over the rows that exist (nothing past P is read; a known public implementation silently
  corrupts those scales when P % 128 != 0). Stores to ``q [H, P]`` are 16 bytes wide when P is a
  multiple of 16, else as wide as P allows (8, 4 or 1 bytes).
- Compiled configurations: the gather and the store width are uniform runtime branches (they
  cost nothing next to the memory traffic); static are the source dtype and vector, ``nt``, the
  input scale encoding and the output orientation.

Every scale, multiplier and encoding is the same IEEE fp32 arithmetic as the other casts
(``common.scale_and_multiplier``, ``cvt.rn.satfinite`` to e4m3), so the results are bitwise those of
``tileproof.reference.quant_blocks``.
"""

import tilelang.language as T
import torch

from tileproof.reference.contract import (
    E4M3,
    ceil_div,
    check_cast_source,
    check_choice,
    check_num_per_tokens,
    check_pos_to_token,
    check_quantized_input,
    check_scale_flags,
    infer_scale_layout,
)
from tileproof.reference.quant_blocks import FP8_ONLY, FUSED_INPUT_CHANNEL_BLOCK, FUSED_TOKEN_BLOCKS

from ..jit import capturing, compiling_only, device_constant, flat_view, jit, new_output, require_cuda
from .blocks import half_as_float_bits, magnitude_bits, packed_max
from .common import float_bits_abs, scale_and_multiplier, scale_from_ue8m0
from .per_token import _vector_width, packed_scale_index

TILE_TOKENS = 128  # tokens per CTA, for every nt: a transposed q row segment is 128 bytes
THREADS = 256
THREAD_COLS = 16  # column threads: a warp spans two row threads
TOKENS_PER_THREAD = TILE_TOKENS // (THREADS // THREAD_COLS)  # 8: one 8-byte slot of a transposed row
CHUNK_BYTES = 16  # a transposed row is read back in 16-byte chunks
# CTAs per SM, which bounds the registers per thread: 64 (bf16 / fp32 rows: 32 hold the 8 loaded
# tokens); an e4m3 source keeps 16 channels' maxima and multipliers and spills at 64, not at 80.
MIN_BLOCKS = {"bfloat16": 4, "float32": 4, "float8_e4m3": 3}

_SOURCE_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float8_e4m3fn: "float8_e4m3"}


def store_width(rows: int) -> int:
    """Bytes per store of a transposed q row of ``rows`` tokens: 16, or the widest of 8, 4 and 1
    that divides ``rows`` (every row must start on a store boundary)."""
    for width in (16, 8, 4):
        if rows % width == 0:
            return width
    return 1


@jit()
def per_channel_kernel(
    source: str,
    num_per_tokens: int,
    vector: int,
    packed_x_sf: bool,
    transposed: bool,
):
    """Factory over the static parameters; row counts, hidden size and strides are runtime values.

    ``source``: the dtype of x (``float8_e4m3``: quantized data with 1×128 scales ``x_sf``,
    ``packed_x_sf``: packed UE8M0). ``transposed``: q is ``[H, P]``, else ``[P, H]``. Runtime:
    ``gather`` (rows come through ``pos``) and, transposed, ``store_bytes`` (16, 8, 4 or 1: the
    widest store every row of q starts on; the wide stores go through ``q_words``, an int32 view
    of q's storage, so that TileLang can prove their alignment). Tensors are passed flat with
    strides counted in vectors (see ``per_token_cast_kernel``).
    """
    thread_rows = THREADS // THREAD_COLS
    items = TOKENS_PER_THREAD
    warps = THREADS // 32
    fp8_source = source == "float8_e4m3"
    # bf16 rows travel as 32-bit words (two values each) until they are encoded, as in blocks.py.
    bf16_words = source == "bfloat16" and vector % 2 == 0
    words = vector // 2 if bf16_words else vector
    if bf16_words:
        x_dtype, value_dtype = "int32", "int32"
    elif fp8_source:
        x_dtype, value_dtype = source, source
    else:
        x_dtype, value_dtype = source, "float32"
    amax_width = words  # bf16 words hold two channels' packed maxima; otherwise fp32 bits per channel
    tile_columns = THREAD_COLS * vector
    blocks_per_tile = TILE_TOKENS // num_per_tokens
    warps_per_block = warps // blocks_per_tile
    rows_per_block = thread_rows // blocks_per_tile
    owners = blocks_per_tile * tile_columns
    owner_rounds = ceil_div(owners, THREADS)
    slot_words = warps * THREAD_COLS * amax_width
    # One shared buffer for the amax slots, the multipliers and the transposed tile: TileLang
    # overlays separate buffers whose per-thread lifetimes look disjoint, which is wrong for data
    # that other threads still read across a barrier.
    tile_offset = slot_words + owners  # words; a multiple of 16, so the tile is 64-byte aligned
    tile_words = tile_columns * TILE_TOKENS // 4 if transposed else 0
    exchange_words = tile_offset + tile_words
    row_words = TILE_TOKENS // 4
    chunks_per_row = TILE_TOKENS // CHUNK_BYTES
    store_rounds = ceil_div(tile_columns * chunks_per_row, THREADS)
    x_sf_dtype = "uint8" if packed_x_sf else "float32"
    if 32 // THREAD_COLS * items > num_per_tokens:
        raise ValueError(f"a warp's {32 // THREAD_COLS * items} tokens must lie in one {num_per_tokens}-token block")

    x_span = T.dynamic("x_span")
    x_sf_span = T.dynamic("x_sf_span")
    pos_span = T.dynamic("pos_span")
    q_span = T.dynamic("q_span")
    q_words_span = T.dynamic("q_words_span")
    sf_span = T.dynamic("sf_span")

    def value_of(values, item_scales, item, e):
        """Element ``e`` of the thread's vector at token ``item`` as the fp32 the cast quantizes."""
        if bf16_words:
            return T.reinterpret(half_as_float_bits(values[item, e // 2], e % 2), "float32")
        if fp8_source:
            return T.cast(values[item, e], "float32") * item_scales[item]
        return values[item, e]

    @T.prim_func
    def kernel(
        x: T.Tensor((x_span,), x_dtype),
        x_sf: T.Tensor((x_sf_span,), x_sf_dtype),
        pos: T.Tensor((pos_span,), "int32"),
        q: T.Tensor((q_span,), "float8_e4m3"),
        q_words: T.Tensor((q_words_span,), "int32"),
        sf: T.Tensor((sf_span,), "float32"),
        num_rows: T.int32,
        hidden_vectors: T.int32,
        row_stride_vectors: T.int32,
        x_sf_row_stride: T.int32,
        x_sf_kblock_stride: T.int32,
        q_row_stores: T.int32,
        gather: T.int32,
        num_source_rows: T.int32,
        store_bytes: T.int32,
        round_sf: T.int32,
    ):
        with T.Kernel(T.ceildiv(hidden_vectors, THREAD_COLS), T.ceildiv(num_rows, TILE_TOKENS), threads=THREADS) as (
            tile,
            token_tile,
        ):
            T.annotate_min_blocks_per_sm(MIN_BLOCKS[source])
            tx = T.get_thread_binding()
            column_thread = tx % THREAD_COLS
            row_thread = tx // THREAD_COLS
            warp = tx // 32
            source_rows = T.alloc_local((items,), "int32")
            values = T.alloc_local((items, words), value_dtype)
            item_scales = T.alloc_local((items,), "float32")
            amax = T.alloc_local((amax_width,), "int32")
            multipliers = T.alloc_local((vector,), "float32")
            sf_value = T.alloc_local((1,), "float32")
            multiplier = T.alloc_local((1,), "float32")
            block_amax = T.alloc_local((1,), "int32")
            scaled = T.alloc_local((max(items, vector),), "float32")
            codes = T.alloc_local((items,), "float8_e4m3")
            stored = T.alloc_local((4,), "int32")
            ordered = T.alloc_local((4,), "int32")
            exchange = T.alloc_shared((exchange_words,), "int32")
            exchange_bytes = T.view(exchange, (exchange_words * 4,), "float8_e4m3")
            source_vector = T.alloc_var("int64")

            column_vector = tile * THREAD_COLS + column_thread
            first_row = token_tile * TILE_TOKENS + row_thread * items
            column_in_range = column_vector < hidden_vectors

            # 1. Source row of each token (-1: padding or past P), then every load before any use.
            for item in T.unroll(items):
                source_rows[item] = -1
                if first_row + item < num_rows:
                    if gather != 0:
                        # An index past x's rows (the launcher's range check cannot run inside a
                        # CUDA-graph capture) is a zero row, never a read out of bounds.
                        source_row = pos[first_row + item]
                        source_rows[item] = T.if_then_else(source_row < num_source_rows, source_row, -1)
                    else:
                        source_rows[item] = first_row + item
            for item in T.unroll(items):
                if column_in_range and source_rows[item] >= 0:
                    # Through a variable: an index that reads a local buffer defeats TileLang's
                    # vectorizer (the load would split into scalar ones).
                    source_vector = T.cast(source_rows[item], "int64") * row_stride_vectors + column_vector
                    for w in T.vectorized(words):
                        if x_dtype == value_dtype:
                            values[item, w] = x[source_vector * words + w]
                        else:
                            values[item, w] = T.cast(x[source_vector * words + w], value_dtype)
                    if fp8_source:
                        kblock = column_vector * vector // FUSED_INPUT_CHANNEL_BLOCK
                        if packed_x_sf:
                            byte = packed_scale_index(source_rows[item], kblock, x_sf_row_stride)
                            item_scales[item] = scale_from_ue8m0(x_sf[byte])
                        else:
                            item_scales[item] = x_sf[source_rows[item] * x_sf_row_stride + kblock * x_sf_kblock_stride]
                else:
                    # Padding rows are +0 whatever the input scale (0 · NaN would be NaN).
                    for w in T.vectorized(words):
                        values[item, w] = T.cast(0, value_dtype)
                    if fp8_source:
                        item_scales[item] = T.float32(0)

            # 2. Per-channel absolute maxima (fp32 bits, or packed bf16 magnitudes): integer
            #    maxima rank NaN above Inf, so NaN propagates.
            for a in T.unroll(amax_width):
                amax[a] = 0
            for item in T.unroll(items):
                for w in T.unroll(words):
                    if bf16_words:
                        amax[w] = packed_max(amax[w], magnitude_bits(values[item, w]))
                    else:
                        amax[w] = T.max(amax[w], float_bits_abs(value_of(values, item_scales, item, w)))
            for a in T.unroll(amax_width):
                folded = T.shfl_xor(amax[a], THREAD_COLS)
                amax[a] = packed_max(amax[a], folded) if bf16_words else T.max(amax[a], folded)
            if row_thread % 2 == 0:
                for a in T.unroll(amax_width):
                    exchange[(warp * THREAD_COLS + column_thread) * amax_width + a] = amax[a]
            T.sync_threads()

            # 3. One owner per (token block, channel): fold its warps' slots, scale, store sf,
            #    share the multiplier.
            for round_index in T.unroll(owner_rounds):
                owned = round_index * THREADS + tx
                if owned < owners:
                    block = owned // tile_columns
                    column = owned % tile_columns
                    slot_column = column // vector
                    element = column % vector
                    block_amax[0] = 0
                    for w in T.unroll(warps_per_block):
                        base = ((block * warps_per_block + w) * THREAD_COLS + slot_column) * amax_width
                        if bf16_words:
                            word = exchange[base + element // 2]
                            block_amax[0] = T.max(block_amax[0], half_as_float_bits(word, element % 2))
                        else:
                            block_amax[0] = T.max(block_amax[0], exchange[base + element])
                    scale_and_multiplier(block_amax[0], E4M3, round_sf != 0, sf_value, multiplier)
                    channel = tile * tile_columns + column
                    scale_row = token_tile * blocks_per_tile + block
                    if channel < hidden_vectors * vector and scale_row * num_per_tokens < num_rows:
                        sf[T.cast(scale_row, "int64") * hidden_vectors * vector + channel] = sf_value[0]
                    exchange[slot_words + owned] = T.reinterpret(multiplier[0], "int32")
            T.sync_threads()

            # 4. Encode and store.
            my_block = row_thread // rows_per_block
            for e in T.unroll(vector):
                multipliers[e] = T.reinterpret(
                    exchange[slot_words + my_block * tile_columns + column_thread * vector + e], "float32"
                )
            if not transposed:
                for item in T.unroll(items):
                    row = first_row + item
                    if column_in_range and row < num_rows:
                        q_offset = (T.cast(row, "int64") * hidden_vectors + column_vector) * vector
                        if bf16_words:
                            # Widen the words first: picking halves element by element does not vectorize.
                            for e in T.unroll(vector):
                                scaled[e] = value_of(values, item_scales, item, e) * multipliers[e]
                            for e in T.vectorized(vector):
                                q[q_offset + e] = T.cast(scaled[e], "float8_e4m3")
                        else:
                            for e in T.vectorized(vector):
                                q[q_offset + e] = T.cast(
                                    value_of(values, item_scales, item, e) * multipliers[e], "float8_e4m3"
                                )
            else:
                slot = row_thread ^ column_thread
                for e in T.unroll(vector):
                    for item in T.unroll(items):
                        scaled[item] = value_of(values, item_scales, item, e) * multipliers[e]
                    for item in T.vectorized(items):
                        codes[item] = T.cast(scaled[item], "float8_e4m3")
                    byte = (tile_offset + (column_thread * vector + e) * row_words) * 4 + slot * items
                    for i in T.vectorized(items):
                        exchange_bytes[byte + i] = codes[i]
                T.sync_threads()
                for round_index in T.unroll(store_rounds):
                    chunk_index = round_index * THREADS + tx
                    column = chunk_index // chunks_per_row
                    chunk = chunk_index % chunks_per_row
                    channel = tile * tile_columns + column
                    first_token = token_tile * TILE_TOKENS + chunk * CHUNK_BYTES
                    if column < tile_columns and channel < hidden_vectors * vector and first_token < num_rows:
                        writer = column // vector
                        word = tile_offset + column * row_words + (chunk ^ (writer >> 1)) * (CHUNK_BYTES // 4)
                        for w in T.vectorized(4):
                            stored[w] = exchange[word + w]
                        for w in T.unroll(4):
                            ordered[w] = T.if_then_else(writer % 2 == 1, stored[w ^ 2], stored[w])
                        # q_row_stores: stores of store_bytes per row of q (each branch divides by a constant).
                        row_first_store = T.cast(channel, "int64") * q_row_stores
                        if store_bytes == 16:
                            for w in T.vectorized(4):
                                q_words[(row_first_store + first_token // 16) * 4 + w] = ordered[w]
                        elif store_bytes == 8:
                            for piece in T.unroll(2):
                                if first_token + piece * 8 < num_rows:
                                    for w in T.vectorized(2):
                                        q_words[(row_first_store + first_token // 8 + piece) * 2 + w] = ordered[
                                            piece * 2 + w
                                        ]
                        elif store_bytes == 4:
                            for piece in T.unroll(4):
                                if first_token + piece * 4 < num_rows:
                                    q_words[row_first_store + first_token // 4 + piece] = ordered[piece]
                        else:
                            for b in T.unroll(CHUNK_BYTES):
                                if first_token + b < num_rows:
                                    code = (T.reinterpret(ordered[b // 4], "uint32") >> (8 * (b % 4))) & 0xFF
                                    q[row_first_store + first_token + b] = T.reinterpret(
                                        T.cast(code, "uint8"), "float8_e4m3"
                                    )

    return kernel


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def _launch(values, x_sf, pos_to_token, q, sf, num_per_tokens: int, round_sf: bool, transposed: bool):
    """Compile and launch ``per_channel_kernel`` for ``values`` (bf16/fp32 rows, or e4m3 data with
    its 1×128 scales ``x_sf``), optionally gathered through ``pos_to_token``, into ``q`` and ``sf``."""
    rows = q.shape[1] if transposed else q.shape[0]
    hidden = values.shape[1]
    if rows == 0 or hidden == 0:
        return
    vector = _vector_width(values)
    packed_x_sf = x_sf is not None and infer_scale_layout("x[1]", x_sf).kind == "packed_ue8m0"
    kernel = per_channel_kernel(_SOURCE_DTYPES[values.dtype], num_per_tokens, vector, packed_x_sf, transposed)
    if compiling_only():
        return
    device = values.device
    bf16_words = values.dtype == torch.bfloat16 and vector % 2 == 0
    words = vector // 2 if bf16_words else vector
    tokens = values.shape[0]
    row_stride_vectors = values.stride(0) // vector if tokens > 1 else hidden // vector
    # Every row may be padding (T = 0): the kernel then reads nothing from x, but gets a tensor.
    x_argument = flat_view(values) if values.numel() else torch.zeros(words, dtype=values.dtype, device=device)
    if bf16_words:
        x_argument = x_argument.view(torch.int32)
    if x_sf is None or x_sf.numel() == 0:
        x_sf_argument = device_constant(torch.uint8 if packed_x_sf else torch.float32, device)
        x_sf_row_stride = x_sf_kblock_stride = 0
    elif packed_x_sf:
        # int32 words [rows, kwords] with strides (1, ld): pass the bytes; ld counts words.
        x_sf_argument, x_sf_row_stride, x_sf_kblock_stride = flat_view(x_sf).view(torch.uint8), x_sf.stride(1), 0
    else:
        x_sf_argument, x_sf_row_stride, x_sf_kblock_stride = flat_view(x_sf), x_sf.stride(0), x_sf.stride(1)
    # The kernel reads pos_to_token with unit stride (a strided view of indices is copied: P ints).
    pos_argument = pos_to_token.contiguous() if pos_to_token is not None else device_constant(torch.int32, device)
    store_bytes = store_width(rows) if transposed else 1
    q_argument = flat_view(q)
    # The int32 view of q for stores of 4 bytes or more (P % 4 == 0, so its size is too).
    q_words = q_argument.view(torch.int32) if store_bytes >= 4 else device_constant(torch.int32, device)
    kernel(
        x_argument,
        x_sf_argument,
        pos_argument,
        q_argument,
        q_words,
        flat_view(sf),
        rows,
        hidden // vector,
        row_stride_vectors,
        x_sf_row_stride,
        x_sf_kblock_stride,
        rows // store_bytes,
        int(pos_to_token is not None),
        tokens,
        store_bytes,
        int(round_sf),
    )


def per_channel_cast_fused(
    x,
    fmt: str,
    num_per_tokens: int = 128,
    round_sf: bool = False,
    num_per_channels: int | None = None,
    pos_to_token: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel cast of ``x``'s rows, optionally gathered (``pos_to_token``, -1: a zero row) and
    dequantized (a 1×128 e4m3 ``(q, sf)`` tuple) first, in one kernel; same contract as
    ``tileproof.reference.quant_blocks.per_channel_cast_fused``, bit for bit, for any P.

    ``pos_to_token``'s range ([-1, T)) is checked on the host, which reads the indices back; inside a
    CUDA-graph capture that read cannot run, and an index past x's rows gives a zero row instead of a
    ``ValueError`` (never a read out of bounds)."""
    check_choice("fmt", fmt, FP8_ONLY)
    check_num_per_tokens(num_per_tokens, FUSED_TOKEN_BLOCKS)
    round_sf = check_scale_flags(E4M3, round_sf, False)
    if isinstance(x, tuple):
        if num_per_channels != FUSED_INPUT_CHANNEL_BLOCK:
            raise ValueError(
                f"num_per_channels must be {FUSED_INPUT_CHANNEL_BLOCK} (the width of the 1×128 blocks of a "
                f"quantized x), got {num_per_channels!r}"
            )
        values, x_sf, _, _, _ = check_quantized_input("x", x, (1, FUSED_INPUT_CHANNEL_BLOCK), formats=(E4M3,))
    else:
        if num_per_channels is not None:
            raise ValueError(
                "num_per_channels is the block width of a quantized (q, sf) x; it must be None for a plain "
                f"tensor, got {num_per_channels!r}"
            )
        values, x_sf = check_cast_source(x, E4M3), None
    tokens, hidden = values.shape
    rows = tokens
    if pos_to_token is not None:
        # The range check reads the indices back: not while compiling only, and not inside a CUDA-graph
        # capture (which cannot hold a read-back; the kernel then takes an index past x's rows as a zero row).
        check_pos_to_token(pos_to_token, tokens, values.device, values=not (compiling_only() or capturing()))
        rows = pos_to_token.shape[0]
    require_cuda("x[0]" if x_sf is not None else "x", values)
    device = values.device
    q = new_output(torch.empty((rows, hidden), dtype=torch.float8_e4m3fn, device=device))
    sf = new_output(torch.empty((ceil_div(rows, num_per_tokens), hidden), dtype=torch.float32, device=device))
    _launch(values, x_sf, pos_to_token, q, sf, num_per_tokens, round_sf, transposed=False)
    return q, sf


def per_channel_cast_and_transpose(
    x: torch.Tensor, fmt: str, num_per_tokens: int, round_sf: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_channel_cast(x, "e4m3", num_per_tokens, round_sf)`` with q returned transposed
    (``[H, T]`` contiguous), in one kernel; same contract as
    ``tileproof.reference.quant_blocks.per_channel_cast_and_transpose``, bit for bit."""
    check_choice("fmt", fmt, FP8_ONLY)
    check_num_per_tokens(num_per_tokens)
    check_cast_source(x, E4M3, dtypes=(torch.bfloat16,))
    round_sf = check_scale_flags(E4M3, round_sf, False)
    require_cuda("x", x)
    tokens, hidden = x.shape
    q = new_output(torch.empty((hidden, tokens), dtype=torch.float8_e4m3fn, device=x.device))
    sf = new_output(torch.empty((ceil_div(tokens, num_per_tokens), hidden), dtype=torch.float32, device=x.device))
    _launch(x, None, None, q, sf, num_per_tokens, round_sf, transposed=True)
    return q, sf

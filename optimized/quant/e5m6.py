"""E5M6 (12-bit float) on the device: element encoder and decoder, and the e5m6 per-token cast.

The cast is ``per_token_cast(x, "e5m6", H)`` (one scale per row, H a multiple of 8); the optimized
``per_token_cast`` hands ``fmt="e5m6"`` to ``per_token_cast_e5m6`` here. The cast back of e5m6 data
is the generic ``cast_back`` kernel (``dequantize``), which decodes with ``e5m6_value``.

Kernel design (memory-bound: read x once, write 1.5 bytes per value and one scale per row): a CTA
per row, the whole row in registers, like ``per_row_cast_kernel``. A thread owns ``items`` chunks
of ``8 · groups`` consecutive values (``groups`` packed 8-value groups: 4 when H is a multiple of
32, so the 48 packed bytes of a chunk leave as three 16-byte stores; 2 → three 8-byte stores; 1 →
three 4-byte stores). The row's amax is a warp shuffle, one shared-memory exchange and a barrier;
thread 0 derives and stores the scale. ``items`` is the next power of two of the chunks per thread,
so one compiled kernel serves every hidden size up to ``items · threads`` chunks.
"""

import tilelang.language as T
import torch

from tileproof.reference.contract import (
    E5M6,
    PER_TOKEN_CAST_FORMATS,
    ScaleLayout,
    check_per_token_cast_input,
    check_scale_flags,
)

from ..jit import address, compiling_only, flat_view, jit, new_output, require_cuda
from .common import cta_amax_bits, float_bits_abs, scale_and_multiplier, ue8m0_byte
from .per_token import packed_scale_index

# Field constants of the encoding (reference/quant.py's module docstring states the rules).
E5M6_INF_CODE = 0x7C0
E5M6_NAN_CODE = 0x7FF
FP32_TWO_POW_MINUS_14 = 0x38800000  # below it e5m6 is subnormal (spacing 2^-20)
FP32_EIGHT = 0x41000000  # 8.0: the fp32 spacing in [8, 16) is 2^-20, e5m6's subnormal step
FP32_TO_E5M6_DROPPED_BITS = 17  # 23 fp32 mantissa bits - 6 e5m6 mantissa bits
FP32_TO_FP16_EXPONENT_SHIFT = (127 - 15) << 6  # the rebias, in units of the e5m6 exponent field
FP32_E5M6_OVERFLOW = 0x477F0000  # 65280: from here on |y| rounds to 2^16, i.e. ±Inf
FP32_INF = 0x7F800000  # magnitude bits above it are NaN

THREADS = 256
SMALL_ROW_THREADS = 64  # rows of at most 64 chunks: a smaller CTA, fewer idle threads

_TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def e5m6_code(y):
    """fp32 → 12-bit e5m6 code (uint32): nearest value, ties to the even code, sign kept.

    Normal range (|y| >= 2^-14): round the fp32 pattern to 6 mantissa bits with the integer
    round-half-even ``(bits + 0xFFFF + lsb) >> 17`` (a carry into the exponent is the correct
    next binade), then rebias the exponent from 127 to 15. Subnormal range: ``8 + |y|`` is one
    correctly rounded fp32 addition onto the grid of spacing 2^-20 (the fp32 spacing of [8, 16)),
    so its bits minus those of 8.0 are the subnormal code, ties to even, up to 64 = 2^-14. |y| is
    taken on the bits and re-read as fp32, so the compiler cannot contract the product that made
    ``y`` into the addition (that would round once instead of twice). |y| >= 65280 (the midpoint
    above 65024, whose tie goes to the even code, Inf) and ±Inf give ±Inf; every NaN gives 0x7FF.
    The range tests compare the magnitude bits as int32 (non-negative, so ordered like the values).
    """
    magnitude = T.reinterpret(y, "int32") & T.int32(0x7FFFFFFF)
    unsigned = T.reinterpret(magnitude, "uint32")
    lsb = (unsigned >> FP32_TO_E5M6_DROPPED_BITS) & T.uint32(1)
    normal = ((unsigned + T.uint32(0xFFFF) + lsb) >> FP32_TO_E5M6_DROPPED_BITS) - T.uint32(FP32_TO_FP16_EXPONENT_SHIFT)
    shifted = T.reinterpret(magnitude, "float32") + T.float32(8.0)
    subnormal = T.reinterpret(shifted, "uint32") - T.uint32(FP32_EIGHT)
    finite = T.if_then_else(magnitude < T.int32(FP32_TWO_POW_MINUS_14), subnormal, normal)
    code = T.if_then_else(magnitude >= T.int32(FP32_E5M6_OVERFLOW), T.uint32(E5M6_INF_CODE), finite)
    signed = code | ((T.reinterpret(y, "uint32") >> 31) << 11)  # the sign bit of the 12-bit code
    return T.if_then_else(magnitude > T.int32(FP32_INF), T.uint32(E5M6_NAN_CODE), signed)


def e5m6_value(code):
    """12-bit e5m6 code (uint32) → fp32, exact: the fp16 with bits ``code << 4``, widened."""
    half_bits = T.cast((code & T.uint32(0xFFF)) << 4, "uint16")
    return T.cast(T.reinterpret(half_bits, "float16"), "float32")


def unpack_group(w0, w1, w2):
    """The 8 codes (uint32 each) of one packed group of three little-endian words, h0 first."""
    mask = T.uint32(0xFFF)
    return [
        w0 >> 20,
        (w0 >> 8) & mask,
        ((w0 & T.uint32(0xFF)) << 4) | (w1 >> 28),
        (w1 >> 16) & mask,
        (w1 >> 4) & mask,
        ((w1 & T.uint32(0xF)) << 8) | (w2 >> 24),
        (w2 >> 12) & mask,
        w2 & mask,
    ]


def pack_group(h):
    """8 codes (uint32 each, 12 bits used) → the group's three words, most significant first."""
    return [
        (h[0] << 20) | (h[1] << 8) | (h[2] >> 4),
        (h[2] << 28) | (h[3] << 16) | (h[4] << 4) | (h[5] >> 8),
        (h[5] << 24) | (h[6] << 12) | h[7],
    ]


@jit()
def per_row_e5m6_cast_kernel(
    in_dtype: str, groups: int, x_vector: int, packed_ue8m0: bool, items: int, threads: int = THREADS
):
    """Factory over the static parameters; the token count, the row length (in chunks of
    ``8 · groups`` values) and the strides are runtime values. ``x_vector``: elements per load
    (16 bytes, narrower when the row stride or base address forbid). Tensors are passed flat, the
    x row stride counted in ``x_vector`` units (so TileLang can prove the wide loads aligned)."""
    warps = threads // 32
    chunk = 8 * groups
    words = 3 * groups
    loads_per_chunk = chunk // x_vector
    store_loop = T.vectorized if groups > 1 else T.unroll  # 3 words (12 bytes): no single wide store
    sf_dtype = "uint8" if packed_ue8m0 else "float32"

    x_span = T.dynamic("x_span")
    q_span = T.dynamic("q_span")
    sf_span = T.dynamic("sf_span")

    @T.prim_func
    def kernel(
        x: T.Tensor((x_span,), in_dtype),
        q: T.Tensor((q_span,), "int32"),
        sf: T.Tensor((sf_span,), sf_dtype),
        num_tokens: T.int32,
        hidden_chunks: T.int32,
        row_stride_vectors: T.int32,
        sf_row_stride: T.int32,
        round_sf: T.int32,
    ):
        with T.Kernel(num_tokens, threads=threads) as (row,):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            values = T.alloc_local((items, chunk), "float32")
            packed = T.alloc_local((words,), "int32")
            codes = T.alloc_local((8,), "uint32")
            amax = T.alloc_local((1,), "int32")
            warp_amax = T.alloc_shared((warps,), "int32")
            sf_value = T.alloc_local((1,), "float32")
            multiplier = T.alloc_local((1,), "float32")
            x_row = T.cast(row, "int64") * row_stride_vectors * x_vector
            q_row = T.cast(row, "int64") * hidden_chunks * words

            # 1. Every load of the row before any use; chunks past the row count as zeros.
            for i in T.unroll(items):
                if i * threads + tx < hidden_chunks:
                    for v in T.unroll(loads_per_chunk):
                        for e in T.vectorized(x_vector):
                            values[i, v * x_vector + e] = T.cast(
                                x[x_row + (i * threads + tx) * chunk + v * x_vector + e], "float32"
                            )
                else:
                    for e in T.vectorized(chunk):
                        values[i, e] = T.float32(0)

            # 2. The row's |x| max as fp32 bits (NaN ranks above Inf, so it propagates).
            amax[0] = 0
            for i in T.unroll(items):
                for e in T.unroll(chunk):
                    amax[0] = T.max(amax[0], float_bits_abs(values[i, e]))
            cta_amax_bits(amax, warp_amax, lane, warp, warps)

            # 3. Scale and multiplier (the common rule with e5m6's Qmax and floor); thread 0 stores sf.
            scale_and_multiplier(amax[0], E5M6, round_sf != 0, sf_value, multiplier)
            if tx == 0:
                if packed_ue8m0:
                    sf[packed_scale_index(row, 0, sf_row_stride)] = ue8m0_byte(sf_value[0])
                    for spare in T.unroll(1, 4):
                        sf[packed_scale_index(row, 0, sf_row_stride) + spare] = T.uint8(0)
                else:
                    sf[row * sf_row_stride] = sf_value[0]

            # 4. Encode, pack 8 codes into 3 words per group, one wide store per chunk.
            for i in T.unroll(items):
                if i * threads + tx < hidden_chunks:
                    for g in T.unroll(groups):
                        for e in T.unroll(8):
                            codes[e] = e5m6_code(values[i, g * 8 + e] * multiplier[0])
                        for w, word in enumerate(pack_group([codes[e] for e in range(8)])):
                            packed[g * 3 + w] = T.reinterpret(word, "int32")
                    for w in store_loop(words):
                        q[q_row + (i * threads + tx) * words + w] = packed[w]

    return kernel


def _x_vector(x: torch.Tensor) -> int:
    """Elements per load: 16 bytes, narrowed until the row stride and base address allow it."""
    vector = 16 // x.element_size()
    while vector > 1 and (x.stride(0) % vector or address(x) % (vector * x.element_size())):
        vector //= 2
    return vector


def schedule(hidden: int) -> dict:
    """Groups per chunk (the widest store H allows), threads, and chunks per thread in flight."""
    groups = 4 if hidden % 32 == 0 else 2 if hidden % 16 == 0 else 1
    chunks = hidden // (8 * groups)
    threads = SMALL_ROW_THREADS if chunks <= SMALL_ROW_THREADS else THREADS
    items = 1
    while items * threads < chunks:
        items *= 2
    return {"groups": groups, "threads": threads, "items": items}


def per_token_cast_e5m6(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    x_block_size=None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token_cast(x, "e5m6", H, ...)``: same contract as ``tileproof.reference.quant``'s, bit
    for bit: ``q`` uint8 ``[T, 3H/2]`` (8 codes per 3 little-endian words), ``sf`` ``[T, 1]`` in the
    layout the flags name."""
    if isinstance(x, tuple):
        raise ValueError(f"fmt {fmt!r} takes a plain tensor x, not an already quantized (data, sf) pair")
    spec = check_per_token_cast_input(x, fmt, num_per_channels, x_block_size, formats=PER_TOKEN_CAST_FORMATS)
    round_sf = check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    require_cuda("x", x)
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)
    tokens, hidden = x.shape
    sf = new_output(layout.empty(tokens, 1, x.device))
    q = new_output(torch.empty((tokens, hidden * 3 // 2), dtype=E5M6.storage_dtype, device=x.device))
    if tokens == 0 or hidden == 0:
        return q, sf
    x_vector = _x_vector(x)
    plan = schedule(hidden)
    kernel = per_row_e5m6_cast_kernel(_TL_DTYPES[x.dtype], x_vector=x_vector, packed_ue8m0=use_packed_ue8m0, **plan)
    if compiling_only():
        return q, sf
    if use_packed_ue8m0:
        # int32 words [rows, 1] with strides (1, ld): pass the bytes; ld counts words.
        sf_argument, sf_row_stride = flat_view(sf).view(torch.uint8), sf.stride(1)
    else:
        sf_argument, sf_row_stride = flat_view(sf), sf.stride(0)
    row_stride_vectors = x.stride(0) // x_vector if tokens > 1 else hidden // x_vector
    kernel(
        flat_view(x),
        flat_view(q).view(torch.int32),
        sf_argument,
        tokens,
        hidden // (8 * plan["groups"]),
        row_stride_vectors,
        sf_row_stride,
        int(round_sf),
    )
    return q, sf

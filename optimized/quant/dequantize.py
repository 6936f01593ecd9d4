"""Dequantization of per-token (1×C) quantized tensors: ``out = decode(q) · sf``.

Kernel design: every thread turns ``items`` vectors of ``vector`` (8) elements into output: one
wide load of the quantized bytes and one 16-byte store per vector, so each warp store covers 512
contiguous bytes. A vector never straddles a scale block (``vector`` divides C), so it needs one
scale, read through the same layout rules as the casts write them. The product is one fp32
multiply, then round-to-nearest-even to bf16 (or kept in fp32), exactly like the reference.
"""

import tilelang.language as T
import torch

from tileproof.reference.contract import (
    CAST_BACK_DTYPES,
    E2M1,
    E4M3,
    check_block_size,
    check_choice,
    check_quantized_pair,
    infer_scale_layout,
)

from ..jit import compiling_only, flat_view, jit, new_output, require_cuda
from .common import e2m1_value, scale_from_ue8m0
from .per_token import packed_scale_index

# From a sweep on the H200: 256 threads × 2 vectors of 8 outputs per thread.
THREADS = 256
ITEMS = 2

_TL_OUT_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


@jit()
def cast_back_kernel(
    fmt_name: str,
    out_dtype: str,
    num_per_channels: int,
    vector: int,
    packed_ue8m0: bool,
    threads: int = THREADS,
    items: int = ITEMS,
):
    """Factory over the static parameters; sizes and strides are runtime scalars (see
    ``per_token_cast_kernel`` for why tensors are passed flat)."""
    fmt = E4M3 if fmt_name == "e4m3" else E2M1
    stored_per_vector = vector // fmt.values_per_byte
    q_dtype = "float8_e4m3" if fmt is E4M3 else "uint8"
    sf_dtype = "uint8" if packed_ue8m0 else "float32"

    q_span = T.dynamic("q_span")
    sf_span = T.dynamic("sf_span")
    out_span = T.dynamic("out_span")

    @T.prim_func
    def kernel(
        q: T.Tensor((q_span,), q_dtype),
        sf: T.Tensor((sf_span,), sf_dtype),
        out: T.Tensor((out_span,), out_dtype),
        num_tokens: T.int32,
        hidden_vectors: T.int32,
        q_row_stride_vectors: T.int32,
        sf_row_stride: T.int32,
        sf_kblock_stride: T.int32,
    ):
        with T.Kernel(T.ceildiv(hidden_vectors, threads * items), num_tokens, threads=threads) as (bx, row):
            tx = T.get_thread_binding()
            stored = T.alloc_local((items, stored_per_vector), q_dtype)
            scales = T.alloc_local((items,), "float32")
            result = T.alloc_local((vector,), out_dtype)
            q_row = T.cast(row, "int64") * q_row_stride_vectors * stored_per_vector
            out_row = T.cast(row, "int64") * hidden_vectors * vector

            # Issue every load (data and scale) before using any of them.
            for item in T.unroll(items):
                column_vector = (bx * items + item) * threads + tx
                if column_vector < hidden_vectors:
                    for e in T.vectorized(stored_per_vector):
                        stored[item, e] = q[q_row + column_vector * stored_per_vector + e]
                    kblock = column_vector * vector // num_per_channels
                    if packed_ue8m0:
                        scales[item] = scale_from_ue8m0(sf[packed_scale_index(row, kblock, sf_row_stride)])
                    else:
                        scales[item] = sf[row * sf_row_stride + kblock * sf_kblock_stride]

            for item in T.unroll(items):
                column_vector = (bx * items + item) * threads + tx
                if column_vector < hidden_vectors:
                    if fmt is E4M3:
                        for e in T.vectorized(vector):
                            result[e] = T.cast(T.cast(stored[item, e], "float32") * scales[item], out_dtype)
                    else:
                        for e in T.unroll(vector):
                            code = (T.cast(stored[item, e // 2], "uint32") >> ((e % 2) * 4)) & 0xF
                            result[e] = T.cast(e2m1_value(code) * scales[item], out_dtype)
                    for e in T.vectorized(vector):
                        out[out_row + column_vector * vector + e] = result[e]

    return kernel


def _vector_width(data: torch.Tensor, values_per_byte: int, num_per_channels: int) -> int:
    """Output elements per thread-vector: 8 (one 16-byte bf16 store, so a warp's store is 512
    contiguous bytes), narrowed until it divides the block, the row, and the quantized row stride
    and alignment."""
    hidden = data.shape[1] * values_per_byte
    vector = 8
    while vector > values_per_byte and (
        num_per_channels % vector
        or hidden % vector
        or (data.stride(0) * values_per_byte) % vector
        or data.data_ptr() % (vector // values_per_byte)
    ):
        vector //= 2
    return vector


def cast_back(x, fmt: str, x_block_size, x_special_fmt=None) -> torch.Tensor:
    """Dequantize a ``(data, sf)`` pair; same contract as ``tileproof.reference.quant.cast_back``.

    ``out = decode(data) · sf`` in fp32, then rounded to nearest even to bf16 (``fmt="bf16"``) or
    kept (``"fp32"``). Scales may be in any of the three layouts (read off dtype and strides).
    """
    check_choice("fmt", fmt, CAST_BACK_DTYPES)
    if x_special_fmt is not None:
        raise ValueError(
            f"x_special_fmt must be None (e5m6 cast back is not part of this release), got {x_special_fmt!r}"
        )
    _, num_per_channels = check_block_size("x_block_size", x_block_size)
    data, sf, spec, hidden = check_quantized_pair("x", x, num_per_channels)
    require_cuda("x[0]", data)
    out_dtype = CAST_BACK_DTYPES[fmt]
    tokens = data.shape[0]
    out = new_output(torch.empty((tokens, hidden), dtype=out_dtype, device=data.device))
    if tokens == 0:
        return out

    layout = infer_scale_layout("x[1]", sf)
    packed = layout.kind == "packed_ue8m0"
    vector = _vector_width(data, spec.values_per_byte, num_per_channels)
    kernel = cast_back_kernel(spec.name, _TL_OUT_DTYPES[out_dtype], num_per_channels, vector, packed)
    if compiling_only():
        return out

    stored_per_vector = vector // spec.values_per_byte
    q_argument = flat_view(data).view(torch.uint8) if spec is E2M1 else flat_view(data)
    if packed:
        sf_argument, sf_row_stride, sf_kblock_stride = flat_view(sf).view(torch.uint8), sf.stride(1), 0
    else:
        sf_argument, sf_row_stride, sf_kblock_stride = flat_view(sf), sf.stride(0), sf.stride(1)
    q_row_stride_vectors = data.stride(0) // stored_per_vector if tokens > 1 else data.shape[1] // stored_per_vector
    kernel(
        q_argument,
        sf_argument,
        flat_view(out),
        tokens,
        hidden // vector,
        q_row_stride_vectors,
        sf_row_stride,
        sf_kblock_stride,
    )
    return out


def per_token_cast_back(x, fmt: str, num_per_channels: int, x_special_fmt=None) -> torch.Tensor:
    """``cast_back`` with ``x_block_size = (1, num_per_channels)``."""
    return cast_back(x, fmt, (1, num_per_channels), x_special_fmt=x_special_fmt)

"""Optimized twin of the mHC norm-fn (contract §5): ``mhc_pre_norm_fn`` and its explicit backward.

Same public names, argument order and results as ``tileproof.reference.mhc``, within the bounds the
oracle states (``oracle/mhc.py``, ``PreNormFn`` / ``PreNormFnBwd``): those assume fp32 sums over
``nC`` (or T) terms in any order with fn (dmul) read as TF32, 2^-11 per product. The FFMA kernels
multiply in plain fp32 (2^-24 per product) and the tensor-core path with fn·γ split into two bf16
parts (2^-18), both *more* accurate than the TF32 model, so the same bounds hold; only the
summation order differs from PyTorch's.

Kernel design (x is the flattened stream ``[T, nC]``, bf16; m = fn's rows, 24 for n = 4):

- **Forward / statistics on tensor cores** (a contiguous residual with 16-byte rows, the layout a
  model passes): ``folded_fn_split_kernel`` writes ``fn·γ`` transposed as bf16 ``[hi | lo]`` columns
  (``hi = bf16(f)``, ``lo = bf16(f − hi)``); ``norm_fn_mma_kernel`` streams x by TMA in tiles of 128
  tokens × 128 features through a 3-stage warp-specialized pipeline into one bf16 wgmma per 64
  tokens (two consumer warpgroups share the tile's fn rows; M 64, N 2·m rounded to 8, fp32
  accumulation) and adds up x² per element on the side; few token
  tiles split the features over more CTAs (a split count from the shape only, so the bits do not
  depend on the GPU), and ``norm_fn_finish_kernel`` adds the splits in order, hi and lo, and applies
  the same epilogue as ``norm_fn_kernel``. x is read once, from HBM; fn·γ (2.8 MB at C 7168) from L2.
- **Forward / statistics, other layouts** (``norm_fn_kernel``): one warp per ``TOKENS`` tokens walks the whole
  row. A lane takes groups of ``GROUP`` consecutive channels of one stream (one 8-byte load per
  token on the vector path), keeps ``TOKENS·(m + 1)`` fp32 partial sums (the m dot products and Σx²
  of each token) in registers and reads the matching fn rows one at a time (γ folded in on the fly:
  ``fn·γ`` is the reference's one fp32 rounding); the 8 warps of a CTA share those fn reads through
  L1. A warp butterfly (``shfl_xor``, fixed order) finishes the sums: no atomics, deterministic.
  The forward writes ``mixes = mul · rsqrt(Σx²/nC + eps)``; the backward's first pass instead writes
  per token ``dmul = g·r`` and ``2·dsq = −(Σ_j g_j mul_j)·r / (Σx² + eps·nC)``.
- **Backward to x and fn on tensor cores** (same layouts): the statistics pass above also writes
  dmul as bf16 ``[hi | lo | hi]`` columns, ``folded_fn_split_kernel`` fn·γ as ``[hi; hi; lo]`` rows,
  and ``norm_fn_grad_mma_kernel`` (grid: 128-feature blocks × token splits) takes per 64-token tile
  ``dx = dsplit · stacked + 2·dsq·x`` (one wgmma: hi·hi + lo·hi + hi·lo) and accumulates
  ``dfnᵀ += xᵀ · [dhi | dlo]`` (a second wgmma, x read transposed from the same shared tile); the
  split partials go to ``norm_fn_reduce_kernel`` as below.
- **Backward to x and fn, other layouts** (``norm_fn_grad_kernel``): grid (channel blocks, streams, token splits). A
  thread holds its ``m × GROUP`` slab of folded fn in registers and walks the tokens of its split:
  ``dx = fnᵀ·dmul + 2·dsq·x`` (fp32, stored contiguous) and accumulates ``dmul ⊗ x`` into an fp32
  partial of dfn, written per split. ``norm_fn_reduce_kernel`` adds the split partials in split
  order (deterministic, no atomics), multiplies by γ and sums ``dfn_folded·fn`` over m for dγ.
"""

import functools
import math

import tilelang
import tilelang.language as T
import torch

from tileproof.reference.contract import ceil_div, check_nonnegative_float, check_shape, check_tensor
from tileproof.reference.mhc import check_grad_addend, check_norm_inputs, check_statistics

from .jit import (
    LaunchPlans,
    address,
    compiling_only,
    device_constant,
    flat_view,
    jit,
    launched,
    new_output,
    require_cuda,
)

__all__ = ["mhc_pre_norm_fn", "mhc_pre_norm_fn_bwd"]

F32 = torch.float32
BF16 = torch.bfloat16

# Consecutive channels a thread takes per step: 4 bf16 (8-byte loads) and 4 fp32 of fn (16 bytes);
# with 24 rows of fn the slab is 96 registers, which the backward holds next to 96 dfn partials.
GROUP = 4
# Forward / statistics: tokens per warp (its 4·(m + 1) partial sums take ~100 registers) and 8 warps
# per CTA. Every warp walks all of fn; the CTA's warps walk it together, so most of those reads hit
# L1 and L2 sees fn once per 32 tokens instead of once per 4.
TOKENS = 4
THREADS = 256
GRAD_THREADS = 128
REDUCE_THREADS = 128
# Backward: aim for this many CTAs over the (channel blocks × streams × token splits) grid (2 waves
# of 132 SMs × 4), with at least MIN_SPLIT_TOKENS tokens per split.
TARGET_CTAS = 1056
MIN_SPLIT_TOKENS = 64

# Tensor-core path of the GEMM (x · fnᵀ with Σx² on the side): x is streamed once by TMA in tiles of
# MMA_TILE_TOKENS tokens × MMA_DEPTH features; fn·γ is split into bf16 high and low parts
# (fn·γ = hi + lo + O(2^-18)·|fn·γ|), so one bf16 wgmma per tile gives both products with fp32
# accumulation: more accurate than the TF32 model the oracle's bound assumes (2^-11 per product).
MMA_TOKENS = 64  # one warpgroup's wgmma M
MMA_DEPTH = 128
MMA_THREADS = 128  # a consumer warpgroup (TileLang adds the TMA producer)
# Every tile reads its [hi | lo] rows of the folded fn again from L2: with 64-token tiles that is 0.75
# byte per byte of x at 24 mixes, and the L2 was the limit (H200, T 8192 C 7168: 152 µs, 74 % of the
# copy roof). Two consumer warpgroups sharing a 128-token tile halve it: 152 → 133 µs (192 tokens:
# 133-136, slower at T 4001; 3 stages as fast as 4 and 5 with 128 tokens). Sweeps:
# norm-fn-forward-tile*-h200-sweep.json.
MMA_TILE_TOKENS = 128
MMA_STAGES = 3
# The features are split over CTAs when there are few token tiles: about this many CTAs, from the
# shape alone (never the SM count), so the summation order, and so the bits, are the same on any GPU.
# H200 sweeps: with 128-token tiles 128 CTAs (one wave on 132 SMs) beat 192 and 256 by 4-11 %.
MMA_TARGET_CTAS = 128
# The per-token epilogue's CTA: tokens and threads (its per-element work over all of them). H200,
# T 8192 C 7168: 5.3 → 3.1 µs forward, 19 → 7.4 backward (17.5 → 9.4 from the saved statistics);
# 16 tokens × 64 threads and 64 × 256 the same, 32 × 64 slower. Sweep: norm-fn-small-kernels-h200-sweep.json.
FINISH_TOKENS = 32
FINISH_THREADS = 128
SPLIT_THREADS = 128
SPLIT_FEATURES = 64  # a divisor of MMA_DEPTH and GRAD_MMA_FEATURES (the padded feature counts)
# Backward to x and fn on tensor cores: CTAs of GRAD_MMA_FEATURES features walk token tiles of
# MMA_TOKENS; dmul is split into bf16 [hi | lo | hi] columns (GRAD_MMA_SLOTS each: m rounded up to 16,
# wgmma's K step), fn·γ into [hi; hi; lo] rows, so that one wgmma gives hi·hi + lo·hi + hi·lo.
GRAD_MMA_FEATURES = 128
GRAD_MMA_STAGES = 2
# Its token splits (each CTA walks one split's tiles and writes one dfn partial, which the reduction
# adds): as few as fill the GPU, from the shape alone (never the SM count, nor whether an addend is
# given), so the summation order, and so dfn's bits, are the same on any GPU and in either form of the
# call; tuned for the 132-SM H100 / H200 (CTAs resident at once: 132 × the schedule's min_blocks).
# The smallest split count whose CTAs make at least GRAD_MMA_MIN_WAVES waves of resident CTAs, or
# whose last wave is at least GRAD_MMA_FULL_WAVE full. Every split costs a CTA's pipeline fill and
# drain per feature block and a partial to write and read back, and a last wave that is mostly empty
# leaves bandwidth unused: H200 sweep (T 4001 and 8192, C 1280-7168, 1 to 26 splits), a target of 1024
# CTAs (4-5 waves, the earlier rule) took 8-30 % longer than the best count everywhere (T 8192 C 7168
# with the addend and saved statistics 412 µs, 2 splits 376; C 1280 168 vs 137 with 6: one 91 % full
# wave; C 2560 with 4 splits, 1.2 waves: 234 vs 184 with 3). Sweeps: norm-grad-splits-h200-sweep.json
# (1 split up to the old count) and norm-grad-splits-more-h200-sweep.json (half to three times it).
GRAD_MMA_FULL_WAVE = 0.9
GRAD_MMA_MIN_WAVES = 1.5
GRAD_MMA_POLICY_SMS = 132


@T.macro
def load_group(src, values, base, group, step, count, slot, vector: int):
    """Channels ``group·GROUP + e`` (e < GROUP) of a row → ``values[slot·GROUP + e]`` as fp32, 0 at or
    past ``count``. ``vector == GROUP``: ``base`` counts vectors and the group is one aligned load
    (``count`` a multiple of GROUP); ``vector == 1``: element ``base + channel·step``."""
    if vector == 1:
        for e in T.unroll(GROUP):
            channel = group * GROUP + e
            values[slot * GROUP + e] = T.if_then_else(
                T.cast(channel, "int64") < count,
                T.cast(src[base + T.cast(channel, "int64") * step], "float32"),
                T.float32(0),
            )
    else:
        for e in T.vectorized(GROUP):
            values[slot * GROUP + e] = T.cast(src[(base + group) * GROUP + e], "float32")


@T.macro
def warp_sum(partials, count: int):
    """``partials[k]`` (``count`` fp32 per lane) → the warp's sum in every lane: a butterfly of
    ``shfl_xor`` (a fixed order, so the result does not depend on scheduling)."""
    for k in T.unroll(count):
        for step in T.unroll(5):
            partials[k] = partials[k] + T.shfl_xor(partials[k], 1 << (4 - step))


@T.macro
def store_group(dst, values, slot, base, group, count, vector: int):
    """``values[slot·GROUP + e]`` → channel ``group·GROUP + e`` of the contiguous row at ``base`` (in vectors
    when ``vector == GROUP``: one 16-byte store for fp32), below ``count``; rounded to ``dst``'s dtype."""
    if vector == 1:
        for e in T.unroll(GROUP):
            if T.cast(group * GROUP + e, "int64") < count:
                dst[base + group * GROUP + e] = T.cast(values[slot * GROUP + e], dst.dtype)
    else:
        for e in T.vectorized(GROUP):
            dst[(base + group) * GROUP + e] = T.cast(values[slot * GROUP + e], dst.dtype)


@T.macro
def load_folded_fn(
    fn,
    gamma,
    slab,
    weight,
    stream,
    group,
    hidden,
    fn_row_stride,
    fn_col_stride,
    gamma_stride,
    rows: int,
    vector: int,
    weighted: bool,
):
    """``slab[j·GROUP + e] = fn[j, k]·γ[k]`` (γ only when ``weighted``) for the group's flattened
    columns ``k = stream·C + group·GROUP + e``; 0 past C. Strides in vectors on the vector path."""
    if weighted:
        load_group(
            gamma,
            weight,
            T.cast(stream, "int64") * (hidden // vector) * gamma_stride,
            group,
            T.cast(gamma_stride, "int64"),
            T.cast(hidden, "int64"),
            0,
            vector,
        )
    for j in T.unroll(rows):
        load_group(
            fn,
            slab,
            T.cast(j, "int64") * fn_row_stride + T.cast(stream, "int64") * (hidden // vector) * fn_col_stride,
            group,
            T.cast(fn_col_stride, "int64"),
            T.cast(hidden, "int64"),
            j,
            vector,
        )
        if weighted:
            for e in T.unroll(GROUP):
                slab[j * GROUP + e] = slab[j * GROUP + e] * weight[e]


@jit()
def norm_fn_kernel(
    n: int,
    rows: int,
    vector: int,
    weighted: bool,
    backward: bool,
    tokens: int = TOKENS,
    threads: int = THREADS,
    save_statistics: bool = False,
):
    """One warp per ``tokens`` tokens: ``mul[t, j] = Σ_k x[t, k]·fn[j, k]`` and ``sq[t] = Σ_k x²``
    (fp32, ``warp_sum``). Forward: ``out[t, j] = mul·rsqrt(sq/nC + eps)`` (``[T, rows]``), and with
    ``save_statistics`` ``statistics[t] = [mul | sq]`` (``[T, rows + 1]``). Backward (``grad`` read):
    ``out[t] = [dmul (rows) | 2·dsq]`` (``[T, rows + 1]``)."""
    warps = threads // 32
    sums = tokens * (rows + 1)  # [mul (tokens × rows) | sq (tokens)]
    width = rows + 1 if backward else rows
    residual_span = T.dynamic("residual_span")
    fn_span = T.dynamic("fn_span")
    gamma_span = T.dynamic("gamma_span")
    grad_span = T.dynamic("grad_span")
    out_span = T.dynamic("out_span")
    statistics_span = T.dynamic("statistics_span")

    @T.prim_func
    def kernel(
        residual: T.Tensor((residual_span,), "bfloat16"),
        fn: T.Tensor((fn_span,), "float32"),
        gamma: T.Tensor((gamma_span,), "float32"),
        grad: T.Tensor((grad_span,), "float32"),
        out: T.Tensor((out_span,), "float32"),
        statistics: T.Tensor((statistics_span,), "float32"),
        num_tokens: T.int32,
        hidden: T.int32,
        residual_token_stride: T.int32,
        residual_stream_stride: T.int32,
        residual_channel_stride: T.int32,
        fn_row_stride: T.int32,
        fn_col_stride: T.int32,
        gamma_stride: T.int32,
        grad_token_stride: T.int32,
        grad_col_stride: T.int32,
        eps: T.float32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, tokens * warps), threads=threads) as (block,):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            xs = T.alloc_local((tokens * GROUP,), "float32")
            slab = T.alloc_local((GROUP,), "float32")
            weight = T.alloc_local((GROUP,), "float32")
            partials = T.alloc_local((sums,), "float32")
            first = (block * warps + warp) * tokens
            groups = T.ceildiv(hidden, GROUP)
            for k in T.unroll(sums):
                partials[k] = T.float32(0)
            for stream in T.serial(n):
                # A warp past the last token has nothing to do (its loop count is 0).
                for chunk in T.serial(T.if_then_else(first < num_tokens, T.ceildiv(groups, 32), 0)):
                    group = chunk * 32 + lane
                    if group < groups:
                        for t in T.unroll(tokens):
                            token = T.min(first + t, num_tokens - 1)  # a tail CTA re-reads its last token
                            load_group(
                                residual,
                                xs,
                                T.cast(token, "int64") * residual_token_stride
                                + T.cast(stream, "int64") * residual_stream_stride,
                                group,
                                T.cast(residual_channel_stride, "int64"),
                                T.cast(hidden, "int64"),
                                t,
                                vector,
                            )
                            for e in T.unroll(GROUP):
                                partials[tokens * rows + t] = (
                                    partials[tokens * rows + t] + xs[t * GROUP + e] * xs[t * GROUP + e]
                                )
                        if weighted:
                            load_group(
                                gamma,
                                weight,
                                T.cast(stream, "int64") * (hidden // vector) * gamma_stride,
                                group,
                                T.cast(gamma_stride, "int64"),
                                T.cast(hidden, "int64"),
                                0,
                                vector,
                            )
                        # One row of fn at a time (4 registers, not the 4·m slab): the 4·(m + 1)
                        # partial sums already take ~100 registers.
                        for j in T.unroll(rows):
                            load_group(
                                fn,
                                slab,
                                T.cast(j, "int64") * fn_row_stride
                                + T.cast(stream, "int64") * (hidden // vector) * fn_col_stride,
                                group,
                                T.cast(fn_col_stride, "int64"),
                                T.cast(hidden, "int64"),
                                0,
                                vector,
                            )
                            for e in T.unroll(GROUP):
                                if weighted:
                                    slab[e] = slab[e] * weight[e]
                                for t in T.unroll(tokens):
                                    partials[t * rows + j] = partials[t * rows + j] + xs[t * GROUP + e] * slab[e]
            warp_sum(partials, sums)
            if lane == 0:
                features = T.cast(n * hidden, "float32")
                for t in T.unroll(tokens):
                    token = first + t
                    if token < num_tokens:
                        sq = partials[tokens * rows + t]
                        rstd = T.rsqrt(T.ieee_fdiv(sq, features) + eps)
                        base = T.cast(token, "int64") * width
                        if backward:
                            g_base = T.cast(token, "int64") * grad_token_stride
                            # Σ_j g_j·mul_j, reusing the first slab slot as scratch.
                            slab[0] = T.float32(0)
                            for j in T.unroll(rows):
                                g = grad[g_base + j * grad_col_stride]
                                slab[0] = slab[0] + g * partials[t * rows + j]
                                out[base + j] = g * rstd
                            out[base + rows] = T.ieee_fdiv(-slab[0] * rstd, sq + eps * features)
                        else:
                            for j in T.unroll(rows):
                                out[base + j] = partials[t * rows + j] * rstd
                            if save_statistics:
                                stat_base = T.cast(token, "int64") * (rows + 1)
                                for j in T.unroll(rows):
                                    statistics[stat_base + j] = partials[t * rows + j]
                                statistics[stat_base + rows] = sq

    return kernel


@jit()
def norm_fn_grad_kernel(
    n: int, rows: int, vector: int, weighted: bool, accumulate: bool = False, threads: int = GRAD_THREADS
):
    """Grid (channel blocks, streams, token splits): ``dres[t, i, c] = Σ_j fn[j, k]·dmul[t, j] +
    2dsq[t]·x[t, k]`` (fp32, contiguous) and ``partial[split, j, k] = Σ_{t in split} dmul[t, j]·x[t, k]``
    (tokens in order), ``k = i·C + c``; ``coef`` is ``norm_fn_kernel``'s backward output. With
    ``accumulate``, ``dres = bf16(that + addend)`` (the contiguous bf16 ``addend``, one fp32 add)."""
    residual_span = T.dynamic("residual_span")
    fn_span = T.dynamic("fn_span")
    gamma_span = T.dynamic("gamma_span")
    coef_span = T.dynamic("coef_span")
    dres_span = T.dynamic("dres_span")
    addend_span = T.dynamic("addend_span")
    partial_span = T.dynamic("partial_span")

    @T.prim_func
    def kernel(
        residual: T.Tensor((residual_span,), "bfloat16"),
        fn: T.Tensor((fn_span,), "float32"),
        gamma: T.Tensor((gamma_span,), "float32"),
        coef: T.Tensor((coef_span,), "float32"),
        dres: T.Tensor((dres_span,), "bfloat16" if accumulate else "float32"),
        addend: T.Tensor((addend_span,), "bfloat16"),
        partial: T.Tensor((partial_span,), "float32"),
        num_tokens: T.int32,
        hidden: T.int32,
        split_tokens: T.int32,
        num_splits: T.int32,
        residual_token_stride: T.int32,
        residual_stream_stride: T.int32,
        residual_channel_stride: T.int32,
        fn_row_stride: T.int32,
        fn_col_stride: T.int32,
        gamma_stride: T.int32,
    ):
        with T.Kernel(T.ceildiv(T.ceildiv(hidden, GROUP), threads), n, num_splits, threads=threads) as (
            block,
            stream,
            split,
        ):
            tx = T.get_thread_binding()
            xs = T.alloc_local((GROUP,), "float32")
            slab = T.alloc_local((rows * GROUP,), "float32")
            weight = T.alloc_local((GROUP,), "float32")
            dmul = T.alloc_local((rows + 1,), "float32")
            result = T.alloc_local((GROUP,), "float32")
            dfn = T.alloc_local((rows * GROUP,), "float32")
            group = block * threads + tx
            groups = T.ceildiv(hidden, GROUP)
            if group < groups:
                load_folded_fn(
                    fn,
                    gamma,
                    slab,
                    weight,
                    stream,
                    group,
                    T.cast(hidden, "int64"),
                    fn_row_stride,
                    T.cast(fn_col_stride, "int64"),
                    T.cast(gamma_stride, "int64"),
                    rows,
                    vector,
                    weighted,
                )
                for k in T.unroll(rows * GROUP):
                    dfn[k] = T.float32(0)
                for step in T.serial(T.min(split_tokens, num_tokens - split * split_tokens)):
                    token = split * split_tokens + step
                    t64 = T.cast(token, "int64")
                    load_group(
                        residual,
                        xs,
                        t64 * residual_token_stride + T.cast(stream, "int64") * residual_stream_stride,
                        group,
                        T.cast(residual_channel_stride, "int64"),
                        T.cast(hidden, "int64"),
                        0,
                        vector,
                    )
                    for j in T.unroll(rows + 1):
                        dmul[j] = coef[t64 * (rows + 1) + j]
                    for e in T.unroll(GROUP):
                        result[e] = dmul[rows] * xs[e]
                        for j in T.unroll(rows):
                            result[e] = result[e] + slab[j * GROUP + e] * dmul[j]
                            dfn[j * GROUP + e] = dfn[j * GROUP + e] + dmul[j] * xs[e]
                    row = (t64 * n + stream) * (hidden // vector)  # in vectors on the vector path
                    if accumulate:
                        for e in T.unroll(GROUP):
                            at = row + group * GROUP + e if vector == 1 else (row + group) * GROUP + e
                            if T.cast(group * GROUP + e, "int64") < T.cast(hidden, "int64"):
                                result[e] = result[e] + T.cast(addend[at], "float32")
                    store_group(dres, result, 0, row, group, T.cast(hidden, "int64"), vector)
                for j in T.unroll(rows):
                    row = ((T.cast(split, "int64") * rows + j) * n + stream) * (hidden // vector)
                    store_group(partial, dfn, j, row, group, T.cast(hidden, "int64"), vector)

    return kernel


@jit()
def norm_fn_reduce_kernel(rows: int, weighted: bool, threads: int = REDUCE_THREADS):
    """One thread per flattened column k of the FFMA backward's ``partial[split, j, k]``:
    ``s_j = Σ_split partial[split, j, k]`` (split order); ``dfn[j, k] = s_j·γ[k]`` and
    ``dγ[k] = Σ_j s_j·fn[j, k]`` (j in order) when ``weighted``, else ``dfn[j, k] = s_j``. (The
    tensor-core backward's layout has its own: ``norm_fn_reduce_columns_kernel``.)"""
    partial_span = T.dynamic("partial_span")
    fn_span = T.dynamic("fn_span")
    gamma_span = T.dynamic("gamma_span")
    dfn_span = T.dynamic("dfn_span")
    dgamma_span = T.dynamic("dgamma_span")

    @T.prim_func
    def kernel(
        partial: T.Tensor((partial_span,), "float32"),
        fn: T.Tensor((fn_span,), "float32"),
        gamma: T.Tensor((gamma_span,), "float32"),
        dfn: T.Tensor((dfn_span,), "float32"),
        dgamma: T.Tensor((dgamma_span,), "float32"),
        features: T.int32,
        splits: T.int32,
        fn_row_stride: T.int32,
        fn_col_stride: T.int32,
        gamma_stride: T.int32,
    ):
        with T.Kernel(T.ceildiv(features, threads), threads=threads) as (block,):
            tx = T.get_thread_binding()
            total = T.alloc_local((2,), "float32")  # [s_j | dγ]
            column = block * threads + tx
            if column < features:
                k64 = T.cast(column, "int64")
                total[1] = T.float32(0)
                for j in T.unroll(rows):
                    total[0] = partial[T.cast(j, "int64") * features + k64]
                    for split in T.serial(1, splits):
                        total[0] = total[0] + partial[(T.cast(split, "int64") * rows + j) * features + k64]
                    if weighted:
                        dfn[T.cast(j, "int64") * features + k64] = total[0] * gamma[k64 * gamma_stride]
                        total[1] = total[1] + total[0] * fn[T.cast(j, "int64") * fn_row_stride + k64 * fn_col_stride]
                    else:
                        dfn[T.cast(j, "int64") * features + k64] = total[0]
                if weighted:
                    dgamma[k64] = total[1]

    return kernel


@jit()
def norm_fn_reduce_columns_kernel(rows: int, slots: int, weighted: bool, threads: int = REDUCE_THREADS):
    """The dfn / dγ reduction of the tensor-core layout ``partial[split, k, c]`` (``c = j`` hi,
    ``slots + j`` lo), the same sums in the same order: ``s_j = Σ_split (hi + lo)``. Each split's
    block of ``threads`` rows (``2·slots`` floats each) comes into shared memory whole (coalesced) with
    a padded row, then thread k reads its row without bank conflicts."""
    columns = 2 * slots
    fn_span = T.dynamic("fn_span")
    gamma_span = T.dynamic("gamma_span")
    dfn_span = T.dynamic("dfn_span")
    dgamma_span = T.dynamic("dgamma_span")
    splits = T.dynamic("splits")
    features = T.dynamic("features")

    @T.macro
    def load_split(partial, tile, split, first):
        for i, c in T.Parallel(threads, columns):
            tile[i, c] = partial[split, T.min(first + i, features - 1), c]

    @T.prim_func
    def kernel(
        partial: T.Tensor((splits, features, columns), "float32"),
        fn: T.Tensor((fn_span,), "float32"),
        gamma: T.Tensor((gamma_span,), "float32"),
        dfn: T.Tensor((dfn_span,), "float32"),
        dgamma: T.Tensor((dgamma_span,), "float32"),
        fn_row_stride: T.int32,
        fn_col_stride: T.int32,
        gamma_stride: T.int32,
    ):
        with T.Kernel(T.ceildiv(features, threads), threads=threads) as (block,):
            tx = T.get_thread_binding()
            tile = T.alloc_shared((threads, columns + 1), "float32")
            sums = T.alloc_local((rows,), "float32")
            total = T.alloc_local((1,), "float32")
            first = block * threads
            load_split(partial, tile, 0, first)
            for j in T.unroll(rows):
                sums[j] = tile[tx, j] + tile[tx, slots + j]
            for split in T.serial(1, splits):
                load_split(partial, tile, split, first)
                for j in T.unroll(rows):
                    sums[j] = sums[j] + (tile[tx, j] + tile[tx, slots + j])
            column = first + tx
            if column < features:
                k64 = T.cast(column, "int64")
                total[0] = T.float32(0)
                for j in T.unroll(rows):
                    if weighted:
                        dfn[T.cast(j, "int64") * features + k64] = sums[j] * gamma[k64 * gamma_stride]
                        total[0] = total[0] + sums[j] * fn[T.cast(j, "int64") * fn_row_stride + k64 * fn_col_stride]
                    else:
                        dfn[T.cast(j, "int64") * features + k64] = sums[j]
                if weighted:
                    dgamma[k64] = total[0]

    return kernel


# The smallest fp32 value that bf16's round-to-nearest-even takes to infinity: (2 − 2^-8)·2^127.
BF16_OVERFLOW = (2 - 2.0**-8) * 2.0**127
FLOAT32_MAX = (2 - 2.0**-23) * 2.0**127


def bf16_pair(value):
    """``(high, low)``, two bf16 parts of an fp32 ``value`` whose sum carries it to ~2^-17: ``high =
    bf16(value)`` (round to nearest even) and ``low = bf16(value − high)`` (the difference is exact).
    Two exceptions keep the tensor-core products equal to the fp32 ones at the range's ends: a finite
    value that rounds to infinity takes the largest bf16 of its sign as ``high`` (its top 16 bits:
    truncation), so ``high + low`` stays finite; and a non-finite value gets ``low = 0`` (``inf − inf``
    would be NaN)."""
    bits = T.reinterpret(value, "uint32")
    truncated = T.cast(T.reinterpret(bits & T.uint32(0xFFFF0000), "float32"), "bfloat16")
    high = T.if_then_else(T.abs(value) < T.float32(BF16_OVERFLOW), T.cast(value, "bfloat16"), truncated)
    low = T.if_then_else(
        T.abs(value) <= T.float32(FLOAT32_MAX),
        T.cast(value - T.cast(high, "float32"), "bfloat16"),
        T.bfloat16(0),
    )
    return high, low


@jit()
def folded_fn_split_kernel(rows: int, slots: int, weighted: bool, stacked: bool, threads: int = SPLIT_THREADS):
    """``f = fn[j, k]·γ[k]`` (fp32, the reference's one rounding; γ only when ``weighted``) as two bf16
    parts by ``bf16_pair`` (``hi = bf16(f)``, ``lo = bf16(f − hi)``), for ``j < rows``;
    zero for ``rows ≤ j < slots`` and past the features. Columns (the forward GEMM's B, ``[padded,
    2·slots]``): ``out[k, j] = hi``, ``out[k, slots + j] = lo``. ``stacked`` (the backward dx GEMM's B,
    ``[3·slots, padded]``): ``out[j, k] = out[slots + j, k] = hi``, ``out[2·slots + j, k] = lo``.
    ``padded`` is a multiple of SPLIT_FEATURES: each CTA builds its features' block of ``out`` in
    shared memory and stores it whole (coalesced; the columns layout's rows are 2·slots wide)."""
    fn_span = T.dynamic("fn_span")
    gamma_span = T.dynamic("gamma_span")
    padded = T.dynamic("padded")
    shape = (3 * slots, padded) if stacked else (padded, 2 * slots)
    tile_shape = (3 * slots, SPLIT_FEATURES) if stacked else (SPLIT_FEATURES, 2 * slots)

    @T.prim_func
    def kernel(
        fn: T.Tensor((fn_span,), "float32"),
        gamma: T.Tensor((gamma_span,), "float32"),
        out: T.Tensor(shape, "bfloat16"),
        features: T.int32,
        fn_row_stride: T.int32,
        fn_col_stride: T.int32,
        gamma_stride: T.int32,
    ):
        with T.Kernel(T.ceildiv(padded, SPLIT_FEATURES), threads=threads) as (block,):
            tile = T.alloc_shared(tile_shape, "bfloat16")
            products = T.alloc_fragment((slots, SPLIT_FEATURES), "float32")
            first = block * SPLIT_FEATURES
            # Every load first, then the splits: interleaved with the tile's stores, each thread's
            # loads went out one after another (7.7 → 3.8 µs at C 7168, H200).
            for j, column in T.Parallel(slots, SPLIT_FEATURES):
                k = T.min(first + column, features - 1)
                product = fn[T.cast(T.min(j, rows - 1), "int64") * fn_row_stride + T.cast(k, "int64") * fn_col_stride]
                if weighted:
                    product = product * gamma[T.cast(k, "int64") * gamma_stride]
                products[j, column] = T.if_then_else((j < rows) & (first + column < features), product, T.float32(0))
            for j, column in T.Parallel(slots, SPLIT_FEATURES):
                high, low = bf16_pair(products[j, column])
                if stacked:
                    tile[j, column] = high
                    tile[slots + j, column] = high
                    tile[2 * slots + j, column] = low
                else:
                    tile[column, j] = high
                    tile[column, slots + j] = low
            # Each writing thread's proxy fence, before the barrier that hands the tile to the TMA
            # store (TileLang's own fence runs in the storing thread alone, after the barrier).
            T.fence_proxy_async()
            if stacked:
                T.copy(tile, out[0, first])
            else:
                T.copy(tile, out[first, 0])

    return kernel


# TileLang's warp-specialized pipeline (a TMA producer warp group feeding the wgmma consumers), and its
# guarded stores for the tail tile of tokens (the project's other kernels guard their own accesses).
MMA_PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: False,
    tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: False,
}


@T.macro
def release_after_thread_reads(sink, stage):
    """End a pipelined loop body whose threads read ``stage`` (a TMA-filled shared buffer) with plain
    loads: a proxy fence, then a dead read that TileLang's warp specialization takes as the buffer's
    last use, so the barrier arrival that hands it back to the TMA producer (one barrier per buffer)
    comes after the fence. Without it the arrival issues while the loads are still in flight (ptxas
    waits for them only where their registers are used, after it), and the TMA load of the tile two
    steps on can overwrite the buffer under them: generic-proxy reads are not ordered before
    async-proxy writes by the barrier alone. Seen on the H200 as nondeterministic 16-byte groups of dx
    in the norm-fn backward with 4 and 8 mixes. The fence (MEMBAR + FENCE.VIEW.ASYNC) waits for the
    loads; nvcc drops the dead read."""
    T.fence_proxy_async()
    sink[0] = stage[(0,) * len(stage.shape)]


@T.macro
def accumulate_squares(squares, x_shared, tile_tokens: int, depth: int):
    """``squares[i, k] += x[i, k]²`` (fp32) for the step's x tile: element-wise per step, reduced once at
    the end, so no cross-thread sum in the loop."""
    for i, k in T.Parallel(tile_tokens, depth):
        squares[i, k] = squares[i, k] + T.cast(x_shared[i, k], "float32") * T.cast(x_shared[i, k], "float32")


@T.macro
def store_statistics_partials(
    products, squares, row_squares, partial, partial_sq, split, tile, tile_tokens: int, tokens
):
    """The split's partial products and Σx² of the tile's tokens (the tail's rows past ``tokens`` dropped)."""
    T.reduce_sum(squares, row_squares, dim=1)
    T.copy(products, partial[split, tile * tile_tokens, 0])
    for i in T.Parallel(tile_tokens):
        if tile * tile_tokens + i < tokens:
            partial_sq[split, tile * tile_tokens + i] = row_squares[i]


@jit(pass_configs=MMA_PASS_CONFIGS)
def norm_fn_mma_kernel(
    columns: int, depth: int = MMA_DEPTH, stages: int = MMA_STAGES, tile_tokens: int = MMA_TILE_TOKENS
):
    """Grid (token tiles, feature splits): ``partial[s, t, :] = Σ_{k in split s} x[t, k]·folded[k, :]``
    (bf16 wgmma, fp32 accumulation) and ``partial_sq[s, t] = Σ_{k in split s} x[t, k]²`` (fp32). Tiles
    past the tokens or features read zeros (TMA). ``tile_tokens`` (a multiple of 64): one consumer
    warpgroup per 64 tokens of a tile, all sharing the tile's ``folded`` rows (see MMA_TILE_TOKENS)."""
    tokens = T.dynamic("tokens")
    features = T.dynamic("features")
    padded = T.dynamic("padded")
    splits = T.dynamic("splits")

    @T.prim_func
    def kernel(
        x: T.Tensor((tokens, features), "bfloat16"),
        folded: T.Tensor((padded, columns), "bfloat16"),
        partial: T.Tensor((splits, tokens, columns), "float32"),
        partial_sq: T.Tensor((splits, tokens), "float32"),
        steps_per_split: T.int32,
    ):
        warpgroups = tile_tokens // MMA_TOKENS
        with T.Kernel(T.ceildiv(tokens, tile_tokens), splits, threads=MMA_THREADS * warpgroups) as (tile, split):
            x_shared = T.alloc_shared((tile_tokens, depth), "bfloat16")
            folded_shared = T.alloc_shared((depth, columns), "bfloat16")
            products = T.alloc_fragment((tile_tokens, columns), "float32")
            squares = T.alloc_fragment((tile_tokens, depth), "float32")
            row_squares = T.alloc_fragment((tile_tokens,), "float32")
            sink = T.alloc_local((1,), "bfloat16")
            T.clear(products)
            T.clear(squares)
            first_step = split * steps_per_split
            steps = T.min(steps_per_split, T.ceildiv(features, depth) - first_step)
            for step in T.Pipelined(steps, num_stages=stages):
                T.copy(x[tile * tile_tokens, (first_step + step) * depth], x_shared)
                T.copy(folded[(first_step + step) * depth, 0], folded_shared)
                # Each warpgroup its own 64 tokens (rows), over all the columns.
                T.gemm(x_shared, folded_shared, products, policy=T.GemmWarpPolicy.FullRow)
                accumulate_squares(squares, x_shared, tile_tokens, depth)
                release_after_thread_reads(sink, x_shared)
            store_statistics_partials(
                products, squares, row_squares, partial, partial_sq, split, tile, tile_tokens, tokens
            )

    return kernel


def odd_words(words: int) -> int:
    """A shared-memory row length (in 4-byte words) that is odd: thread t's row then starts in bank
    ``t·odd mod 32``, a different bank for each of a warp's threads (conflict-free row walks)."""
    return words | 1


@jit()
def norm_fn_finish_kernel(
    rows: int,
    half: int,
    backward: bool,
    slots: int = 0,
    save_statistics: bool = False,
    from_statistics: bool = False,
    tile_tokens: int = FINISH_TOKENS,
    threads: int = FINISH_THREADS,
    contiguous_grad: bool = False,
):
    """Per token: ``mul[j] = Σ_s partial[s, t, j] + Σ_s partial[s, t, half + j]`` (splits in order;
    the hi sum alone where it is not finite), ``sq = Σ_s partial_sq[s, t]``, then
    ``norm_fn_kernel``'s epilogue: forward
    ``out[t, j] = mul·rsqrt(sq/nC + eps)``; backward ``out[t] = [dmul (rows) | 2·dsq]``, or with
    ``slots`` (for ``norm_fn_grad_mma_kernel``) ``out[t] = 2·dsq`` alone and ``dsplit[t]`` = dmul as
    bf16 ``[hi | lo | hi]`` (``bf16_pair``; ``slots`` columns each, zero past ``rows``; the second hi
    is 0 where dmul is not finite).
    ``save_statistics`` (forward): also ``statistics[t] = [mul_j + low_j (rows) | sq]``, the values the
    epilogue used. ``from_statistics`` (backward): those values read from ``statistics`` instead of
    summed from the partials (which are then not read), so the results are the recomputing ones, bit
    for bit, when the statistics come from the same GEMM schedule.

    A CTA of ``threads`` takes ``tile_tokens`` tokens. What is per element (the split sums, ``out``,
    the bf16 splits) runs over all its threads, what is per token (``sq``, ``rstd``, the ``dmul·mul``
    sum in row order) on one thread per token; every per-token row moves between global and shared
    memory in whole blocks, consecutive threads on consecutive elements (shared rows of an odd word
    count: no bank conflicts). One thread per token for everything left ~900 dependent instructions
    per warp with a warp or two per SM (H200, T 8192: 19 µs backward, 5.5 forward).

    ``contiguous_grad`` (backward; the caller's promise that grad is ``[T, rows]`` contiguous): the
    tile's grad block is read at ``t·rows + j``, which compiles to a linear index, instead of through
    the runtime strides, whose 64-bit index arithmetic (a division and a remainder per element) was
    most of the load's instructions; the strides are then not read."""
    columns = 2 * half
    width = rows + 1 if backward else rows
    split_words = 3 * slots // 2  # slots is a multiple of 16: whole words of bf16 pairs
    tokens = T.dynamic("tokens")
    splits = T.dynamic("splits")
    grad_span = T.dynamic("grad_span")
    out_span = T.dynamic("out_span")
    dsplit_span = T.dynamic("dsplit_span")
    statistics_span = T.dynamic("statistics_span")

    @T.prim_func
    def kernel(
        partial: T.Tensor((splits, tokens, columns), "float32"),
        partial_sq: T.Tensor((splits, tokens), "float32"),
        grad: T.Tensor((grad_span,), "float32"),
        out: T.Tensor((out_span,), "float32"),
        dsplit: T.Tensor((dsplit_span,), "bfloat16"),
        statistics: T.Tensor((statistics_span,), "float32"),
        features: T.int32,
        grad_token_stride: T.int32,
        grad_col_stride: T.int32,
        eps: T.float32,
    ):
        with T.Kernel(T.ceildiv(tokens, tile_tokens), threads=threads) as (block,):
            tx = T.get_thread_binding()
            # Per token [mul (rows) | sq]: read (from_statistics) or summed here.
            statistics_tile = T.alloc_shared((tile_tokens, odd_words(rows + 1)), "float32")
            rstd_tile = T.alloc_shared((tile_tokens,), "float32")
            out_tile = T.alloc_shared((tile_tokens, odd_words(width)), "float32")
            if backward:
                grad_tile = T.alloc_shared((tile_tokens, odd_words(rows)), "float32")
            if slots:
                dsplit_tile = T.alloc_shared((tile_tokens, 2 * odd_words(split_words)), "bfloat16")
            if not from_statistics:
                high = T.alloc_fragment((tile_tokens, rows), "float32")
                low = T.alloc_fragment((tile_tokens, rows), "float32")
            sq = T.alloc_local((1,), "float32")
            dot = T.alloc_local((1,), "float32")
            first = block * tile_tokens
            if backward and contiguous_grad:
                for t, j in T.Parallel(tile_tokens, rows):
                    if first + t < tokens:
                        grad_tile[t, j] = grad[T.cast(first + t, "int64") * rows + j]
            elif backward:
                for t, j in T.Parallel(tile_tokens, rows):
                    if first + t < tokens:
                        grad_tile[t, j] = grad[
                            T.cast(first + t, "int64") * grad_token_stride + T.cast(j, "int64") * grad_col_stride
                        ]
            if from_statistics:
                for t, c in T.Parallel(tile_tokens, rows + 1):
                    if first + t < tokens:
                        statistics_tile[t, c] = statistics[T.cast(first + t, "int64") * (rows + 1) + c]
            else:
                T.clear(high)
                T.clear(low)
                for s in T.serial(splits):
                    for t, j in T.Parallel(tile_tokens, rows):
                        token = T.min(first + t, tokens - 1)
                        high[t, j] = high[t, j] + partial[s, token, j]
                        low[t, j] = low[t, j] + partial[s, token, half + j]
                for t, j in T.Parallel(tile_tokens, rows):
                    # lo corrects a finite hi; an infinite hi (an infinite x) is the product, as in
                    # fp32, where lo would add inf·0 or the other infinity from the split of fn (NaN).
                    statistics_tile[t, j] = T.if_then_else(
                        T.abs(high[t, j]) <= T.float32(FLOAT32_MAX), high[t, j] + low[t, j], high[t, j]
                    )
            count = T.cast(features, "float32")
            if tx < tile_tokens:
                if from_statistics:
                    sq[0] = statistics_tile[tx, rows]
                else:
                    sq[0] = T.float32(0)
                    for s in T.serial(splits):
                        sq[0] = sq[0] + partial_sq[s, T.min(first + tx, tokens - 1)]
                    statistics_tile[tx, rows] = sq[0]
                rstd_tile[tx] = T.rsqrt(T.ieee_fdiv(sq[0], count) + eps)
                if backward:
                    dot[0] = T.float32(0)
                    for j in T.unroll(rows):
                        dot[0] = dot[0] + grad_tile[tx, j] * statistics_tile[tx, j]
                    out_tile[tx, rows] = T.ieee_fdiv(-dot[0] * rstd_tile[tx], sq[0] + eps * count)
            if slots:
                for t, j in T.Parallel(tile_tokens, slots):
                    # dmul again (the same product as out's), zero past the rows.
                    value = T.if_then_else(j < rows, grad_tile[t, T.min(j, rows - 1)] * rstd_tile[t], T.float32(0))
                    dmul_high, dmul_low = bf16_pair(value)
                    dsplit_tile[t, j] = dmul_high
                    dsplit_tile[t, slots + j] = dmul_low
                    # An infinite dmul meets fn's lo part, whose sign is not fn's: inf·lo could be the
                    # opposite infinity of inf·hi (NaN where fp32 has fn·inf). Its hi·hi product alone
                    # gives the fp32 answer.
                    dsplit_tile[t, 2 * slots + j] = T.if_then_else(
                        T.abs(value) <= T.float32(FLOAT32_MAX), dmul_high, T.bfloat16(0)
                    )
                for t, c in T.Parallel(tile_tokens, 3 * slots):
                    if first + t < tokens:
                        dsplit[T.cast(first + t, "int64") * (3 * slots) + c] = dsplit_tile[t, c]
                for t in T.Parallel(tile_tokens):
                    if first + t < tokens:
                        out[first + t] = out_tile[t, rows]
            else:
                for t, j in T.Parallel(tile_tokens, rows):
                    out_tile[t, j] = (grad_tile[t, j] if backward else statistics_tile[t, j]) * rstd_tile[t]
                for t, c in T.Parallel(tile_tokens, width):
                    if first + t < tokens:
                        out[T.cast(first + t, "int64") * width + c] = out_tile[t, c]
            if save_statistics:
                for t, c in T.Parallel(tile_tokens, rows + 1):
                    if first + t < tokens:
                        statistics[T.cast(first + t, "int64") * (rows + 1) + c] = statistics_tile[t, c]

    return kernel


@jit(pass_configs=MMA_PASS_CONFIGS)
def norm_fn_grad_mma_kernel(
    slots: int,
    rows: int,
    stages: int = GRAD_MMA_STAGES,
    block_features: int = GRAD_MMA_FEATURES,
    min_blocks: int = 1,
    staged_store: bool = False,
    accumulate: bool = False,
    shared_pair: bool = False,
    addend_stage: bool = False,
):
    """Grid (feature blocks of block_features, token splits); per token tile of the split:
    ``dres[t, k] = Σ_r dsplit[t, r]·stacked[r, k] + dsq2[t]·x[t, k]`` (fp32; ``dsq2 = 2·dsq``, a
    contiguous fp32 vector padded to whole token tiles: rows past the tokens are not stored) and,
    summed over the split's tiles, ``partial[s, k, c] = Σ_t dsplit[t, c]·x[t, k]`` for the
    ``2·slots`` columns ``[hi | lo]`` (against xᵀ); tiles past the tokens or features read zeros
    (TMA).

    ``min_blocks`` > 1 asks for that many CTAs per SM (``__launch_bounds__``) and splits the
    registers to fit: the consumer warpgroup gets ``65536 / min_blocks / 128 − 24`` (multiple of 8,
    at most 240), the TMA producer 24. ``staged_store``: dx goes through a shared tile and leaves by
    one bulk copy instead of each thread's stores from the accumulator. ``accumulate``: ``dres =
    bf16(that + addend[t, k])`` (the contiguous bf16 ``addend``, one fp32 add, one rounding).
    ``shared_pair``: dmul's ``[hi | lo]`` columns are loaded once, for both GEMMs (dx's then in two
    GEMMs, the second for its ``hi·lo`` product), instead of all three columns for dx and the pair
    again for dfn: 8 KB less per 64-token tile with 24 mixes. ``addend_stage`` (with ``accumulate``;
    ``addend`` then ``[T, nC]``, 16-byte aligned): the addend tile comes through the pipeline by TMA
    with x's, instead of each thread's loads after the GEMMs, whose DRAM latency every tile waited
    for; dres then leaves through that stage buffer, once read, by one bulk copy (``staged_store``
    without a tile of its own: 16 KB, with 24 mixes the room a second CTA per SM needs), and the
    buffer goes back to the producer after the TMA store has read it."""
    if addend_stage and not accumulate:
        raise ValueError("addend_stage needs accumulate (an addend to load)")
    out_dtype = "bfloat16" if accumulate else "float32"
    width = 3 * slots
    consumer_registers = min(240, (65536 // min_blocks // MMA_THREADS - 24) // 8 * 8)
    tokens = T.dynamic("tokens")
    features = T.dynamic("features")
    padded = T.dynamic("padded")
    splits = T.dynamic("splits")
    addend_span = T.dynamic("addend_span")
    padded_tokens = T.dynamic("padded_tokens")

    @T.prim_func
    def kernel(
        x: T.Tensor((tokens, features), "bfloat16"),
        stacked: T.Tensor((width, padded), "bfloat16"),
        dsplit: T.Tensor((tokens, width), "bfloat16"),
        dsq2: T.Tensor((padded_tokens,), "float32"),
        dres: T.Tensor((tokens, features), out_dtype),
        addend: T.Tensor((tokens, features) if addend_stage else (addend_span,), "bfloat16"),
        partial: T.Tensor((splits, features, 2 * slots), "float32"),
        split_tiles: T.int32,
    ):
        with T.Kernel(T.ceildiv(features, block_features), splits, threads=MMA_THREADS) as (block, split):
            stacked_shared = T.alloc_shared((2 * slots if shared_pair else width, block_features), "bfloat16")
            x_shared = T.alloc_shared((MMA_TOKENS, block_features), "bfloat16")
            if shared_pair:
                # dmul's [hi | lo] columns, which both GEMMs read, and its second hi (dx's hi·lo).
                pair_shared = T.alloc_shared((MMA_TOKENS, 2 * slots), "bfloat16")
                high_shared = T.alloc_shared((MMA_TOKENS, slots), "bfloat16")
                stacked_low = T.alloc_shared((slots, block_features), "bfloat16")
            else:
                d_shared = T.alloc_shared((MMA_TOKENS, width), "bfloat16")
                dfn_operand = T.alloc_shared((MMA_TOKENS, 2 * slots), "bfloat16")
            dx = T.alloc_fragment((MMA_TOKENS, block_features), "float32")
            dfn = T.alloc_fragment((block_features, 2 * slots), "float32")
            sink = T.alloc_local((1,), "bfloat16")
            if accumulate:
                dx_out = T.alloc_fragment((MMA_TOKENS, block_features), out_dtype)
            if addend_stage:
                addend_shared = T.alloc_shared((MMA_TOKENS, block_features), "bfloat16")
                # Swizzled (TMA writes it so): the threads read it in the accumulator's row pattern,
                # eight rows 256 bytes apart per load, all in one bank unswizzled.
                T.annotate_layout({addend_shared: tilelang.layout.make_swizzled_layout(addend_shared)})
            if staged_store and not addend_stage:
                dx_shared = T.alloc_shared((MMA_TOKENS, block_features), out_dtype)
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
                T.annotate_producer_reg_dealloc(24)
                T.annotate_consumer_reg_alloc(consumer_registers)
            # The launcher sends only feature counts that are multiples of GRAD_MMA_FEATURES here
            # (_tensor_cores): no column guard on the stores, which then pair up (8-byte stores).
            T.assume(features % block_features == 0)
            first = block * block_features
            T.copy(stacked[0, first], stacked_shared)
            if shared_pair:
                T.copy(stacked[2 * slots, first], stacked_low)
            T.clear(dfn)
            first_tile = split * split_tiles
            tiles = T.min(split_tiles, T.ceildiv(tokens, MMA_TOKENS) - first_tile)
            for step in T.Pipelined(tiles, num_stages=stages):
                token = (first_tile + step) * MMA_TOKENS
                T.copy(x[token, first], x_shared)
                if addend_stage:
                    T.copy(addend[token, first], addend_shared)
                if shared_pair:
                    T.copy(dsplit[token, 0], pair_shared)
                    T.copy(dsplit[token, 2 * slots], high_shared)
                    # The same k-steps in the same order as the one-GEMM form: the same dx bits.
                    T.gemm(pair_shared, stacked_shared, dx, clear_accum=True)
                    T.gemm(high_shared, stacked_low, dx)
                    T.gemm(x_shared, pair_shared, dfn, transpose_A=True)
                else:
                    T.copy(dsplit[token, 0], d_shared)
                    T.copy(dsplit[token, 0], dfn_operand)
                    T.gemm(d_shared, stacked_shared, dx, clear_accum=True)
                    T.gemm(x_shared, dfn_operand, dfn, transpose_A=True)
                for i, k in T.Parallel(MMA_TOKENS, block_features):
                    dx[i, k] = dx[i, k] + dsq2[token + i] * T.cast(x_shared[i, k], "float32")
                if addend_stage:
                    for i, k in T.Parallel(MMA_TOKENS, block_features):
                        dx_out[i, k] = T.cast(dx[i, k] + T.cast(addend_shared[i, k], "float32"), out_dtype)
                    release_after_thread_reads(sink, x_shared)
                    # The addend's stage goes back to the producer after its last use, the TMA
                    # store's read (TileLang waits for it before that barrier's arrival).
                    T.copy(dx_out, addend_shared)
                    T.fence_proxy_async()  # each writing thread's, before the TMA store reads it
                    T.copy(addend_shared, dres[token, first])
                else:
                    release_after_thread_reads(sink, x_shared)
                    if accumulate:
                        # The tail's clamped reads are of elements whose stores are dropped.
                        for i, k in T.Parallel(MMA_TOKENS, block_features):
                            at = T.cast(T.min(token + i, tokens - 1), "int64") * features + T.min(
                                first + k, features - 1
                            )
                            dx_out[i, k] = T.cast(dx[i, k] + T.cast(addend[at], "float32"), out_dtype)
                        if staged_store:
                            T.copy(dx_out, dx_shared)
                            T.fence_proxy_async()  # each writing thread's, before the TMA store reads it
                            T.copy(dx_shared, dres[token, first])
                        else:
                            T.copy(dx_out, dres[token, first])
                    elif staged_store:
                        T.copy(dx, dx_shared)
                        T.fence_proxy_async()
                        T.copy(dx_shared, dres[token, first])
                    else:
                        T.copy(dx, dres[token, first])
            # Stored as accumulated, hi and lo columns apart (the reduction adds them): no fp32 tile
            # in shared memory, whose 32 KB would keep a second CTA off the SM.
            T.copy(dfn, partial[split, first, 0])

    return kernel


# The tensor-core path's schedule, read at each call (the committed values; a sweep changes them):
# norm_fn_grad_mma_kernel's knobs (with fp32 dx, and with the addend's bf16 dx) and the per-token
# epilogue's CTA size. H200 sweep at T 8192 C 7168: two CTAs per SM
# (128 registers each, no spill) take the dx / dfn kernel from 853 to 713 µs with fp32 dx and from
# 1087 to 766 with the addend, where the staged bf16 store gains another 36 (730; it loses 130 with
# fp32 dx: twice the tile); 64-feature blocks and a third stage lose. The tiled reduction (a CTA's
# columns over the splits, coalesced) takes the dfn sum from 30 to 12 µs, same bits. Loading dmul's
# [hi | lo] once for both GEMMs (shared_pair) gains 1.5-3 % with fp32 dx (667 -> 657 µs) and loses
# 5-8 % with the addend (690 -> 744: the staged store's tile and the second dx GEMM's waits), same bits.
# With the addend, each thread loaded its addend elements after the GEMMs and every tile waited for
# DRAM: the addend tile through the pipeline by TMA with x's (addend_stage) with shared_pair takes the
# layers' call (addend + statistics, T 8192 C 7168) from 691 to 535 µs, T 4001 C 7168 434 -> 357, same
# bits; the staged dx store then paid only where two CTAs still fit on an SM (m <= 16: 336 -> 208 with
# m 4; with 24 mixes its own tile left one CTA per SM, 662). Sweep: norm-grad-addend-stage-h200-sweep.json.
# Staged through the addend's stage buffer instead (no tile of its own, two CTAs per SM with 24 mixes
# too): 534 -> 457 µs at T 8192 C 7168 (addend + statistics), T 8192 C 4096 384 -> 349, m 4 unchanged,
# same bits everywhere. Sweep: norm-grad-store-in-addend-h200-sweep.json.
# 2·dsq from a contiguous vector (the epilogue's) instead of the [dmul | 2·dsq] rows' last column: the
# layers' call 445.6 -> 411.5 µs, T 8192 C 7168 fp32 dx 620 -> 603, but fp32 dx at C <= 4096 2-6 %
# slower (T 8192 C 4096 348 -> 370; not understood). Through the pipeline by TMA instead of the
# threads' loads: slower with the addend (456). Same bits. Sweep: norm-grad-dsq-stage-h200-sweep.json.
# With those fewer splits, fp32 dx through a staged tile of its own and one bulk store per tile (two
# CTAs per SM still fit with 24 mixes: 112 KB each) instead of each thread's 8-byte stores from the
# accumulator: T 8192 C 7168 631 -> 528 µs (2 splits), C 4096 345 -> 313, C 1280 137 -> 121, T 4001
# C 2560 130 -> 115, same bits (slower only where the splits leave less than a wave of CTAs, which the
# rule above picks only when the tokens run out). Without it, 2 splits lost to 3 at C 7168 (631 vs
# 588 µs). Sweep: norm-grad-fp32-staged-h200-sweep.json.
GRAD_MMA_SCHEDULE = {
    "stages": GRAD_MMA_STAGES,
    "block_features": GRAD_MMA_FEATURES,
    "min_blocks": 2,
    "staged_store": True,
    "shared_pair": True,
    "addend_stage": False,
}
# With the addend, dx leaves through the addend's stage buffer (no staged tile of its own).
GRAD_MMA_ADDEND_SCHEDULE = {**GRAD_MMA_SCHEDULE, "staged_store": False, "addend_stage": True}
# An addend that TMA cannot load (base not 16-byte aligned): the threads' loads, as before the sweep.
GRAD_MMA_ADDEND_LOADS_SCHEDULE = {**GRAD_MMA_SCHEDULE, "staged_store": True, "shared_pair": False}
FINISH_SCHEDULE = {"tile_tokens": FINISH_TOKENS, "threads": FINISH_THREADS}
# norm_fn_reduce_columns_kernel's CTA (features per CTA): 32 a little ahead of 64 and 128 (0.3-1.5 µs of
# ~17, same bits; the same sweep).
GRAD_REDUCE_SCHEDULE = {"threads": 32}


def _grad_mma_splits(tokens: int, features: int, min_blocks: int) -> tuple[int, int]:
    """(splits, token tiles per split) of the tensor-core backward, from the shape only: the smallest
    split count whose CTAs (splits × feature blocks) make GRAD_MMA_MIN_WAVES waves of the CTAs a
    GRAD_MMA_POLICY_SMS-SM GPU holds at ``min_blocks`` per SM, or fill their last wave to
    GRAD_MMA_FULL_WAVE; every token tile its own split when none does."""
    tiles = ceil_div(tokens, MMA_TOKENS)
    blocks = ceil_div(features, GRAD_MMA_SCHEDULE["block_features"])
    splits = _fewest_filling_splits(
        tiles, blocks, GRAD_MMA_POLICY_SMS * min_blocks, GRAD_MMA_MIN_WAVES, GRAD_MMA_FULL_WAVE
    )
    return splits, ceil_div(tiles, splits)


@functools.lru_cache(maxsize=1024)  # a loop over split counts, per call otherwise
def _fewest_filling_splits(tiles: int, blocks: int, resident: int, min_waves: float, full_wave: float) -> int:
    for splits in range(1, tiles + 1):
        if ceil_div(tiles, ceil_div(tiles, splits)) != splits:
            continue  # the same tiles per split as a smaller count
        waves = splits * blocks / resident
        if waves >= min_waves or waves / math.ceil(waves) >= full_wave:
            return splits
    return tiles


def _tensor_core_gradients_launch(residual, mhc_fn, mhc_norm_weight, grad_output, eps: float, addend, statistics):
    """The tensor-core backward's launches for arguments of these signatures: ``launch(residual,
    mhc_fn, mhc_norm_weight, grad_output, d_residual, addend, statistics)`` writes ``d_residual`` and
    returns the per-split dfn partials ``[splits, nC, 2·slots]`` (hi and lo columns apart; None under
    ``compiling_only``, which builds the kernels and launches nothing): five launches (four with
    saved statistics)."""
    tokens, n, hidden = residual.shape
    features = n * hidden
    rows = mhc_fn.shape[0]
    slots = 16 * ceil_div(rows, 16)  # a wgmma K step holds 16 bf16
    weighted = mhc_norm_weight is not None
    if addend is None:
        schedule = dict(GRAD_MMA_SCHEDULE)
    elif address(addend) % 16:
        schedule = dict(GRAD_MMA_ADDEND_LOADS_SCHEDULE)
    else:
        schedule = dict(GRAD_MMA_ADDEND_SCHEDULE)
    stack_kernel = folded_fn_split_kernel(rows, slots, weighted, True)
    grad_kernel = norm_fn_grad_mma_kernel(slots, rows, **schedule, accumulate=addend is not None)
    statistics_launch = _statistics_mma_launch(
        residual, mhc_fn, mhc_norm_weight, grad_output, eps, True, slots, statistics is not None
    )
    if compiling_only():
        return lambda *tensors: None
    # After the compile-only return: under outputs_only the sizes may be symbolic (torch.compile's
    # dynamic shapes), which the memoized split search cannot hash, and no split is launched.
    splits, per_split = _grad_mma_splits(tokens, features, schedule["min_blocks"])
    padded = ceil_div(features, GRAD_MMA_FEATURES) * GRAD_MMA_FEATURES  # block_features divides it
    fn_strides = mhc_fn.stride()
    gamma_stride = mhc_norm_weight.stride(0) if weighted else 0
    addend_stage = schedule["addend_stage"]

    def launch(residual, mhc_fn, mhc_norm_weight, grad_output, d_residual, addend, statistics):
        device = residual.device
        # Scratch: dmul's bf16 splits and 2·dsq, padded to whole token tiles (the tail tile's threads
        # read it unclamped; the pad's rows of dx are not stored).
        dsplit = torch.empty((tokens, 3 * slots), dtype=BF16, device=device)
        dsq2 = torch.empty(ceil_div(tokens, MMA_TOKENS) * MMA_TOKENS, dtype=F32, device=device)
        statistics_launch(residual, mhc_fn, mhc_norm_weight, grad_output, dsq2, dsplit, statistics)
        stacked = torch.empty((3 * slots, padded), dtype=BF16, device=device)
        partial = torch.empty((splits, features, 2 * slots), dtype=F32, device=device)
        gamma = mhc_norm_weight if weighted else mhc_fn
        stack_kernel(flat_view(mhc_fn), flat_view(gamma), stacked, features, *fn_strides, gamma_stride)
        x = residual.view(tokens, features)
        if addend is None:
            addend_argument = device_constant(BF16, device)
        else:
            addend_argument = addend.view(tokens, features) if addend_stage else addend.view(-1)
        grad_kernel(x, stacked, dsplit, dsq2, d_residual.view(tokens, features), addend_argument, partial, per_split)
        return partial

    return launch


# The most mixes the tensor-core kernels take: their shared memory grows with m (the forward's three
# stages hold 128 fn·γ columns of 2·m rounded to 8 bf16 each: 216 KB at m 80, over the SM's 227 KB at
# 88; the backward's 1.5 KB per 16-rounded mix + 64 KB). mHC has m = n² + 2n: 24 at n 4, 80 at n 8.
TENSOR_CORE_MAX_ROWS = 80


def _tensor_cores(residual: torch.Tensor, rows: int) -> bool:
    """The tensor-core path reads x ``[T, nC]`` by TMA: a contiguous residual on a 16-byte aligned base
    whose rows are whole feature blocks of the backward (nC a multiple of GRAD_MMA_FEATURES: every
    model's C is a multiple of 32), so its stores need no column guard, and at most
    TENSOR_CORE_MAX_ROWS mixes. Other layouts and more mixes take the FFMA kernels."""
    tokens, n, hidden = residual.shape
    return (
        0 < rows <= TENSOR_CORE_MAX_ROWS
        and residual.is_contiguous()
        and (n * hidden) % GRAD_MMA_FEATURES == 0
        and address(residual) % 16 == 0
    )


# The statistics GEMM's schedule, read at each call (committed values; a sweep changes them). ``depth``
# divides MMA_DEPTH, the padding of the folded fn.
MMA_SCHEDULE = {
    "depth": MMA_DEPTH,
    "stages": MMA_STAGES,
    "target_ctas": MMA_TARGET_CTAS,
    "tokens": MMA_TILE_TOKENS,
}


def _mma_splits(tokens: int, features: int) -> tuple[int, int]:
    """(splits, steps per split) of the features for the tensor-core GEMM: from the shape only."""
    steps = ceil_div(features, MMA_SCHEDULE["depth"])
    wanted = max(1, min(steps, ceil_div(MMA_SCHEDULE["target_ctas"], ceil_div(tokens, MMA_SCHEDULE["tokens"]))))
    per_split = ceil_div(steps, wanted)
    return ceil_div(steps, per_split), per_split


def _from_statistics_launch(grad, features: int, eps: float, slots: int):
    """The backward's ``out = [dmul | 2·dsq]`` (and, with ``slots``, the tensor-core path's dmul split)
    from the forward's saved statistics: ``launch(grad, out, statistics, dsplit)``, one launch of the
    per-token epilogue, no pass over the streams. Its partial arguments are empty, with the token count
    the kernel binds T from."""
    tokens, rows = grad.shape
    half = 8 * ceil_div(rows, 8)
    finish_kernel = norm_fn_finish_kernel(
        rows, half, True, slots, from_statistics=True, contiguous_grad=grad.is_contiguous(), **FINISH_SCHEDULE
    )
    if compiling_only():
        return lambda *tensors: None
    grad_strides = grad.stride()

    def launch(grad, out, statistics, dsplit):
        device = grad.device
        finish_kernel(
            torch.empty((0, tokens, 2 * half), dtype=F32, device=device),
            torch.empty((0, tokens), dtype=F32, device=device),
            flat_view(grad),
            out.view(-1),
            device_constant(BF16, device) if dsplit is None else dsplit.view(-1),
            statistics.view(-1),
            features,
            *grad_strides,
            eps,
        )

    return launch


def _statistics_mma_launch(
    residual, mhc_fn, mhc_norm_weight, grad, eps: float, backward: bool, slots: int, with_statistics: bool
):
    """The launches for ``out`` of ``norm_fn_kernel`` by the tensor-core GEMM, for arguments of these
    signatures: ``launch(residual, mhc_fn, mhc_norm_weight, grad, out, dsplit, statistics)`` writes the
    forward mixes, or the backward's ``[dmul | 2·dsq]`` (with ``slots``, dmul's bf16 splits into
    ``dsplit`` and 2·dsq alone into ``out``): three launches (fold and split fn·γ, the GEMM, the
    per-token epilogue). ``with_statistics``: the forward writes the statistics ``[T, m + 1]`` too;
    the backward reads them instead of running the GEMM (``_from_statistics_launch``, one launch).
    The forward's ``grad`` is None here and its ``out`` at launch (never read there)."""
    tokens, n, hidden = residual.shape
    features = n * hidden
    if backward and with_statistics:
        from_statistics = _from_statistics_launch(grad, features, eps, slots)
        return lambda residual, mhc_fn, mhc_norm_weight, grad, out, dsplit, statistics: from_statistics(
            grad, out, statistics, dsplit
        )
    rows = mhc_fn.shape[0]
    half = 8 * ceil_div(rows, 8)  # wgmma's N comes in multiples of 8
    weighted = mhc_norm_weight is not None
    splits, per_split = _mma_splits(tokens, features)
    depth, stages, tile_tokens = MMA_SCHEDULE["depth"], MMA_SCHEDULE["stages"], MMA_SCHEDULE["tokens"]
    split_kernel = folded_fn_split_kernel(rows, half, weighted, False)
    mma_kernel = norm_fn_mma_kernel(2 * half, depth, stages, tile_tokens)
    saved = with_statistics  # (the forward's: it writes them)
    contiguous_grad = backward and grad.is_contiguous()
    finish_kernel = norm_fn_finish_kernel(
        rows, half, backward, slots, save_statistics=saved, contiguous_grad=contiguous_grad, **FINISH_SCHEDULE
    )
    if compiling_only():
        return lambda *tensors: None
    grad_strides = grad.stride() if backward else (0, 0)
    gamma_stride = mhc_norm_weight.stride(0) if weighted else 0
    fn_strides = mhc_fn.stride()

    def launch(residual, mhc_fn, mhc_norm_weight, grad, out, dsplit, statistics):
        device = residual.device
        split_argument = out.view(-1).view(torch.bfloat16) if dsplit is None else dsplit.view(-1)
        statistics_argument = statistics.view(-1) if saved else device_constant(F32, device)
        # Scratch, not outputs: every element is written before it is read.
        partial = torch.empty((splits, tokens, 2 * half), dtype=F32, device=device)
        partial_sq = torch.empty((splits, tokens), dtype=F32, device=device)
        x = residual.view(tokens, features)
        folded = torch.empty((ceil_div(features, MMA_DEPTH) * MMA_DEPTH, 2 * half), dtype=BF16, device=device)
        gamma = mhc_norm_weight if weighted else mhc_fn
        split_kernel(flat_view(mhc_fn), flat_view(gamma), folded, features, *fn_strides, gamma_stride)
        mma_kernel(x, folded, partial, partial_sq, per_split)
        finish_kernel(
            partial,
            partial_sq,
            flat_view(grad),
            out.view(-1),
            split_argument,
            statistics_argument,
            features,
            *grad_strides,
            eps,
        )

    return launch


def _vector(residual: torch.Tensor, mhc_fn: torch.Tensor, mhc_norm_weight: torch.Tensor | None) -> int:
    """GROUP when every group is one aligned load: C a multiple of GROUP and the residual, fn and γ
    rows allow it (unit innermost stride, aligned base and outer strides), else 1 (scalar loads)."""
    # Imported here: optimized/mhc.py re-exports this module's functions at its end, so a module-level
    # import would be circular when this module is imported first.
    from .mhc import _vector_width

    hidden = residual.shape[-1]
    if hidden % GROUP:
        return 1
    tensors = [(residual, hidden), (mhc_fn, mhc_fn.shape[-1])]
    if mhc_norm_weight is not None:
        tensors.append((mhc_norm_weight, mhc_norm_weight.shape[-1]))
    return _vector_width(tensors, GROUP)


def _operand_strides(residual, mhc_fn, mhc_norm_weight, vector: int) -> list[int]:
    """Residual token / stream strides and channel stride, fn row / column strides, γ stride:
    outer strides in vectors, innermost ones in elements (1 on the vector path)."""
    residual_strides = [residual.stride(0) // vector, residual.stride(1) // vector, residual.stride(2)]
    fn_strides = [mhc_fn.stride(0) // vector, mhc_fn.stride(1)]
    gamma_stride = [mhc_norm_weight.stride(0) if mhc_norm_weight is not None else 1]
    return residual_strides + fn_strides + gamma_stride


def _split_tokens(tokens: int, hidden: int, n: int) -> int:
    """Tokens per split of the backward (a function of the shape only, so the reduction order is)."""
    channel_blocks = ceil_div(ceil_div(hidden, GROUP), GRAD_THREADS) * n
    splits = max(1, min(ceil_div(tokens, MIN_SPLIT_TOKENS), ceil_div(TARGET_CTAS, channel_blocks)))
    return ceil_div(tokens, splits)


def _schedules() -> tuple:
    """The module's schedule dictionaries as they are now: part of every norm-fn plan's key, so that a
    sweep that replaces an entry between calls gets new plans."""
    return (
        tuple(MMA_SCHEDULE.items()),
        tuple(GRAD_MMA_SCHEDULE.items()),
        tuple(GRAD_MMA_ADDEND_SCHEDULE.items()),
        tuple(GRAD_MMA_ADDEND_LOADS_SCHEDULE.items()),
        tuple(FINISH_SCHEDULE.items()),
        tuple(GRAD_REDUCE_SCHEDULE.items()),
    )


def _norm_fn_plan(residual, mhc_fn, mhc_norm_weight, mhc_norm_eps, save_statistics, schedules):
    """Check an ``mhc_pre_norm_fn`` of these signatures and decide its launch; the plan:
    ``run(residual, mhc_fn, mhc_norm_weight) -> mixes`` or ``(mixes, statistics)``. ``schedules``
    (``_schedules()``) is only part of the key."""
    tokens, n, hidden = check_norm_inputs(residual, mhc_fn, mhc_norm_weight)
    eps = check_nonnegative_float("mhc_norm_eps", mhc_norm_eps)
    require_cuda("residual", residual)
    require_cuda("mhc_fn", mhc_fn)
    if mhc_norm_weight is not None:
        require_cuda("mhc_norm_weight", mhc_norm_weight)
    rows = mhc_fn.shape[0]
    device = residual.device

    def allocate():
        out = new_output(torch.empty((tokens, rows), dtype=F32, device=device))
        statistics = new_output(torch.empty((tokens, rows + 1), dtype=F32, device=device)) if save_statistics else None
        return out, statistics

    def result(out, statistics):
        return (out, statistics) if save_statistics else out

    if tokens == 0:
        return lambda *tensors: result(*allocate())
    if n * hidden == 0:

        def empty_rows(*tensors):
            out, statistics = allocate()
            if save_statistics:
                statistics.zero_()  # empty sums
            out.fill_(float("nan"))  # rsqrt(0/0 + eps), as the reference's empty mean
            return result(out, statistics)

        return empty_rows
    if rows == 0 and not save_statistics:
        return lambda *tensors: allocate()[0]
    if _tensor_cores(residual, rows):
        launch = _statistics_mma_launch(residual, mhc_fn, mhc_norm_weight, None, eps, False, 0, save_statistics)

        def run_tensor_cores(residual, mhc_fn, mhc_norm_weight):
            out, statistics = allocate()
            launch(residual, mhc_fn, mhc_norm_weight, out, out, None, statistics)
            return result(out, statistics)

        return run_tensor_cores
    vector = _vector(residual, mhc_fn, mhc_norm_weight)
    weighted = mhc_norm_weight is not None
    kernel = launched(norm_fn_kernel(n, rows, vector, weighted, False, save_statistics=save_statistics))
    scalars = (tokens, hidden, *_operand_strides(residual, mhc_fn, mhc_norm_weight, vector), 0, 0, eps)

    def run(residual, mhc_fn, mhc_norm_weight):
        out, statistics = allocate()
        if kernel is not None:
            gamma = mhc_norm_weight if weighted else mhc_fn
            kernel(
                flat_view(residual),
                flat_view(mhc_fn),
                flat_view(gamma),
                out.view(-1),
                out.view(-1),
                statistics.view(-1) if save_statistics else device_constant(F32, device),
                *scalars,
            )
        return result(out, statistics)

    return run


_NORM_FN_PLANS = LaunchPlans(_norm_fn_plan)


def mhc_pre_norm_fn(
    residual: torch.Tensor,
    mhc_fn: torch.Tensor,
    mhc_norm_weight: torch.Tensor | None,
    mhc_norm_eps: float,
    *,
    save_statistics: bool = False,
):
    """RMS-normalised projection of the flattened streams: fp32 ``[T, m]``
    ``(x @ (fn ⊙ γ)ᵀ) · rsqrt(Σx²/nC + eps)`` (tensor cores for a contiguous residual whose nC is a
    multiple of 128, fp32 FFMA otherwise; sums in any order within the oracle's bound). With
    ``save_statistics`` (as in the reference) also the fp32 ``[T, m + 1]`` ``[x·(fn⊙γ)ᵀ | Σx²]`` the
    epilogue used, for ``mhc_pre_norm_fn_bwd(..., statistics=)``."""
    plan = _NORM_FN_PLANS.plan(residual, mhc_fn, mhc_norm_weight, mhc_norm_eps, save_statistics, _schedules())
    return plan(residual, mhc_fn, mhc_norm_weight)


def _norm_fn_bwd_plan(grad_output, residual, mhc_fn, mhc_norm_weight, mhc_norm_eps, grad_addend, statistics, schedules):
    """Check an ``mhc_pre_norm_fn_bwd`` of these signatures and decide its launches; the plan:
    ``run(grad_output, residual, mhc_fn, mhc_norm_weight, grad_addend, statistics) -> (dresidual, dfn,
    dnorm_weight)``. ``schedules`` (``_schedules()``) is only part of the key."""
    tokens, n, hidden = check_norm_inputs(residual, mhc_fn, mhc_norm_weight)
    rows = mhc_fn.shape[0]
    check_tensor("grad_output", grad_output, dtypes=(F32,), ndim=2)
    check_shape("grad_output", grad_output, (tokens, rows))
    eps = check_nonnegative_float("mhc_norm_eps", mhc_norm_eps)
    check_grad_addend(grad_addend, tokens, n, hidden)
    check_statistics(statistics, tokens, rows)
    for name, tensor in (("grad_output", grad_output), ("residual", residual), ("mhc_fn", mhc_fn)):
        require_cuda(name, tensor)
    has_statistics = statistics is not None
    if has_statistics:
        require_cuda("statistics", statistics)
        statistics = statistics.contiguous()
    weighted = mhc_norm_weight is not None
    if weighted:
        require_cuda("mhc_norm_weight", mhc_norm_weight)
    device = residual.device
    features = n * hidden
    accumulate = grad_addend is not None
    if accumulate:
        require_cuda("grad_addend", grad_addend)
        grad_addend = grad_addend.contiguous()

    def allocate():
        d_residual = new_output(torch.empty((tokens, n, hidden), dtype=BF16 if accumulate else F32, device=device))
        d_fn = new_output(torch.empty((rows, features), dtype=F32, device=device))
        d_weight = new_output(torch.empty((features,), dtype=F32, device=device)) if weighted else None
        return d_residual, d_fn, d_weight

    if features == 0 or rows == 0:

        def no_features(grad_output, residual, mhc_fn, mhc_norm_weight, grad_addend, statistics):
            d_residual, d_fn, d_weight = allocate()
            # No rows: dx = 2·dsq·x with dsq = 0 (an empty sum).
            if accumulate:
                d_residual.copy_(grad_addend)
            else:
                d_residual.zero_()
            return d_residual, d_fn, d_weight.zero_() if weighted else None

        return no_features
    if tokens == 0:

        def no_tokens(*tensors):
            d_residual, d_fn, d_weight = allocate()
            return d_residual, d_fn.zero_(), d_weight.zero_() if weighted else None

        return no_tokens
    vector = _vector(residual, mhc_fn, mhc_norm_weight)
    strides = _operand_strides(residual, mhc_fn, mhc_norm_weight, vector)
    fn_strides, grad_strides = mhc_fn.stride(), grad_output.stride()
    if _tensor_cores(residual, rows):
        reduce = launched(
            norm_fn_reduce_columns_kernel(rows, 16 * ceil_div(rows, 16), weighted, **GRAD_REDUCE_SCHEDULE)
        )
        gradients = _tensor_core_gradients_launch(
            residual, mhc_fn, mhc_norm_weight, grad_output, eps, grad_addend, statistics
        )

        def run_tensor_cores(grad_output, residual, mhc_fn, mhc_norm_weight, grad_addend, statistics):
            if accumulate:
                grad_addend = grad_addend.contiguous()
            if has_statistics:
                statistics = statistics.contiguous()
            d_residual, d_fn, d_weight = allocate()
            partial = gradients(residual, mhc_fn, mhc_norm_weight, grad_output, d_residual, grad_addend, statistics)
            if reduce is not None:
                gamma = mhc_norm_weight if weighted else mhc_fn
                reduce(
                    partial,
                    flat_view(mhc_fn),
                    flat_view(gamma),
                    d_fn.view(-1),
                    (d_weight if weighted else d_fn).view(-1),
                    *fn_strides,
                    strides[-1],
                )
            return d_residual, d_fn, d_weight

        return run_tensor_cores
    split_tokens = _split_tokens(tokens, hidden, n)
    splits = ceil_div(tokens, split_tokens)
    from_statistics = _from_statistics_launch(grad_output, features, eps, 0) if has_statistics else None
    stats = None if has_statistics else launched(norm_fn_kernel(n, rows, vector, weighted, True))
    grad = launched(norm_fn_grad_kernel(n, rows, vector, weighted, accumulate))
    reduce = launched(norm_fn_reduce_kernel(rows, weighted))

    def run(grad_output, residual, mhc_fn, mhc_norm_weight, grad_addend, statistics):
        if accumulate:
            grad_addend = grad_addend.contiguous()
        if has_statistics:
            statistics = statistics.contiguous()
        d_residual, d_fn, d_weight = allocate()
        if grad is None:
            return d_residual, d_fn, d_weight
        gamma = mhc_norm_weight if weighted else mhc_fn
        # Scratch, not outputs: every element is written before it is read.
        coef = torch.empty((tokens, rows + 1), dtype=F32, device=device)
        if has_statistics:
            from_statistics(grad_output, coef, statistics, None)
        partial = torch.empty((splits, rows, features), dtype=F32, device=device)
        if not has_statistics:
            stats(
                flat_view(residual),
                flat_view(mhc_fn),
                flat_view(gamma),
                flat_view(grad_output),
                coef.view(-1),
                device_constant(F32, device),
                tokens,
                hidden,
                *strides,
                *grad_strides,
                eps,
            )
        grad(
            flat_view(residual),
            flat_view(mhc_fn),
            flat_view(gamma),
            coef.view(-1),
            d_residual.view(-1),
            grad_addend.view(-1) if accumulate else device_constant(BF16, device),
            partial.view(-1),
            tokens,
            hidden,
            split_tokens,
            splits,
            *strides,
        )
        reduce(
            partial.view(-1),
            flat_view(mhc_fn),
            flat_view(gamma),
            d_fn.view(-1),
            (d_weight if weighted else d_fn).view(-1),
            features,
            splits,
            *fn_strides,
            strides[-1],
        )
        return d_residual, d_fn, d_weight

    return run


_NORM_FN_BWD_PLANS = LaunchPlans(_norm_fn_bwd_plan)


def mhc_pre_norm_fn_bwd(
    grad_output: torch.Tensor,
    residual: torch.Tensor,
    mhc_fn: torch.Tensor,
    mhc_norm_weight: torch.Tensor | None,
    mhc_norm_eps: float,
    *,
    grad_addend: torch.Tensor | None = None,
    statistics: torch.Tensor | None = None,
):
    """Explicit backward of ``mhc_pre_norm_fn``: ``(dresidual fp32 [T, n, C], dfn fp32 [m, nC],
    dnorm_weight fp32 [nC] or None)``; dfn and dγ are summed over tokens deterministically. With
    ``grad_addend`` (bf16 ``[T, n, C]``, as in the reference) the kernel adds it to dx in fp32 and
    returns dresidual as bf16, rounded once (a non-contiguous addend is copied first). With
    ``statistics`` (the forward's ``save_statistics`` output) the pass over the streams that would
    recompute them is skipped; from our forward on the same inputs the results are the same bits."""
    arguments = (grad_output, residual, mhc_fn, mhc_norm_weight, mhc_norm_eps, grad_addend, statistics)
    plan = _NORM_FN_BWD_PLANS.plan(*arguments, _schedules())
    return plan(grad_output, residual, mhc_fn, mhc_norm_weight, grad_addend, statistics)

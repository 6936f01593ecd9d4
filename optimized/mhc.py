"""Optimized twin of the mHC elementwise and small-matrix operators (contract §5): TileLang kernels.

Same public names, argument order and results as ``tileproof.reference.mhc`` for ``expand_to_mhc``
(bit for bit), ``expand_to_mhc_bwd`` (bit for bit: the streams are added in order), the Sinkhorn
projection, the split of the mixes, the pre-apply, the post and the head mix, forward and backward,
each within the bound its oracle states (``oracle/mhc.py``): the fp32 sums run in another order than
PyTorch's, and the GPU's ``expf`` and IEEE divisions replace PyTorch's kernels.

Kernel design:

- **Sinkhorn** (``sinkhorn_kernel``): one thread per token, its ``n × n`` matrix in registers. The
  ``2R − 1`` normalisation steps are unrolled (R is static, so every register index is a constant):
  a step adds the ``n`` entries of each row (or column) in index order, adds eps and divides every
  entry by its sum (IEEE division, as the reference). The backward recomputes the iterations on
  chip: a first pass stores a checkpoint of P every ``K ≈ √(2R − 1)`` steps in shared memory (the
  thread's slots only, no barrier), then the reverse steps run last first, each recomputing its input
  state from the checkpoint before it (at most ``K − 1`` steps) and applying
  ``dP = (dY − Σ(dY⊙P)·r)·r``, ``r = 1 / (S + eps)``. These loops are runtime loops (registers stay
  below 80, no spills); multiplying by the reciprocal (one IEEE division per row instead of one per
  entry) adds one rounding per step, well inside the backward's 2^-16 bound.
- **Stream kernels** (pre-apply, post, expand): 16-byte vectors of 8 bf16 channels. A thread takes
  ``items`` vectors of one token row; the token's coefficients (``n`` or ``n + n²`` fp32) are read
  once per thread (L1 broadcasts). Sums over the streams run in stream order in fp32; each bf16
  output is rounded once (round to nearest even).
- **Backward reductions over C** (pre-apply and post backward): one CTA per token walks its whole
  row, each thread keeping fp32 partial sums of the ``n`` (``n + n²``) coefficient gradients in
  registers; a warp butterfly and one shared-memory slot per warp finish the sum, so no atomics and
  the result does not depend on scheduling.
- **Token kernels** (split, head): one thread per token row of mixes, ``σ(z) = 1 / (1 + e^-z)`` with
  ``expf`` and an IEEE division. The backward's parameter gradients are summed over tokens in two
  deterministic stages: each CTA of a fixed-size grid reduces its tokens into one partial row, then a
  single CTA adds the partial rows in order.
"""

import importlib

import tilelang.language as T
import torch

from tileproof.reference.contract import (
    ceil_div,
    check_nonnegative_float,
    check_positive_int,
    check_shape,
    check_tensor,
)
from tileproof.reference.mhc import (
    check_head_inputs,
    check_post_inputs,
    check_residual,
    check_split_inputs,
    check_square,
)

from .jit import (
    LaunchPlans,
    address,
    device_constant,
    flat_view,
    jit,
    launched,
    new_output,
    require_cuda,
)
from .warp import halved_index, halving_butterfly, halving_steps

# The norm-fn kernels and the fused / multilayer paths live in their own modules, which import the
# kernels of this one: they are looked up on first use (PEP 562 ``__getattr__`` at the end), so
# either module may be imported first; the oracle finds every mHC twin here.
_ELSEWHERE = {
    "mhc_pre_norm_fn": "mhc_norm",
    "mhc_pre_norm_fn_bwd": "mhc_norm",
    "mhc_pre_big_fuse": "mhc_fuse",
    "mhc_multilayer_recompute": "mhc_fuse",
}

__all__ = [
    "sinkhorn_normalize",
    "sinkhorn_normalize_bwd",
    "mhc_pre_split_mixes",
    "mhc_pre_split_mixes_bwd",
    "mhc_pre_apply_mix",
    "mhc_pre_apply_mix_bwd",
    "mhc_post",
    "mhc_post_bwd",
    "expand_to_mhc",
    "expand_to_mhc_bwd",
    "mhc_head_compute_mix",
    "mhc_head_compute_mix_bwd",
    *_ELSEWHERE,
]

F32 = torch.float32
BF16 = torch.bfloat16

# Token kernels: one token per thread.
TOKEN_THREADS = 128
# Sinkhorn forward: each thread is a long dependent chain; 256-thread CTAs measured 16.5 µs against
# 20.4 µs at 128 (n 4, R 20, 65536 tokens, H200).
SINKHORN_THREADS = 256
# Sinkhorn backward: 64 threads keep a CTA's checkpoints at 24 KB for R = 20 (n = 4).
SINKHORN_BWD_THREADS = 64
# Stream kernels: 8 bf16 channels (16 bytes) per vector, ``items`` vectors per thread.
STREAM_THREADS = 128
STREAM_ITEMS = 2
# mhc_post reads y once per n outputs: 4 vectors per thread keep more loads in flight (258.5 µs
# against 266.8 µs at 2 items, T 8192, C 7168, H200). Rows that such CTAs do not tile exactly take
# one CTA of 2 vectors per thread instead (post_schedule).
POST_ITEMS = 4
POST_WIDE_ITEMS = 2
BF16_VECTOR = 8
# Reductions over C: one CTA per token row.
REDUCE_THREADS = 128
# mhc_post_bwd rows of 129–255 column vectors (C 1280: 160) take one CTA of whole warps covering the
# row instead of two 128-thread chunks, which left 96 lanes idle: 86.7 against 88.4 µs at T 8192,
# C 1280 on the H200. Wider rows that 128 does not divide measured no better in 160-thread chunks
# (C 2560: 147.3 against 146.3 µs), so they keep REDUCE_THREADS.
MAX_ROW_CTA_THREADS = 256
# Parameter gradients of the token kernels: CTAs of the first stage (each reduces a strided share of
# the tokens into one partial row); enough to fill an H200 and few enough for one CTA to add up.
PARTIAL_BLOCKS = 264


def post_bwd_threads(columns: int) -> int:
    """``post_bwd_kernel``'s CTA for a row of ``columns`` vectors: REDUCE_THREADS, or one CTA of whole
    warps covering a row a little wider than that (see MAX_ROW_CTA_THREADS)."""
    if REDUCE_THREADS < columns < MAX_ROW_CTA_THREADS and columns % REDUCE_THREADS:
        return 32 * ceil_div(columns, 32)
    return REDUCE_THREADS


def _alignment_elements(tensor: torch.Tensor) -> int:
    return address(tensor) // tensor.element_size() if tensor.numel() else 0


def _vector_width(tensors_and_sizes, width: int) -> int:
    """``width`` when, for every ``(tensor, inner size)``, the inner size is a multiple of ``width``,
    the innermost stride 1, the base ``width``-element aligned and every outer stride a multiple of
    ``width`` (so each vector is one aligned wide access), else 1."""
    for tensor, inner_size in tensors_and_sizes:
        if tensor.numel() == 0:
            continue
        if inner_size % width or tensor.stride(-1) != 1 or _alignment_elements(tensor) % width:
            return 1
        if any(
            stride % width for size, stride in zip(tensor.shape[:-1], tensor.stride()[:-1], strict=True) if size > 1
        ):
            return 1
    return width


def _strides_in(tensor: torch.Tensor, vector: int) -> list[int]:
    """Outer strides counted in vectors (the innermost stride, in elements, when ``vector`` is 1)."""
    outer = [stride // vector for stride in tensor.stride()[:-1]]
    return outer + [tensor.stride(-1) if vector == 1 else 1]


# ---------------------------------------------------------------------------------------------
# Sinkhorn
# ---------------------------------------------------------------------------------------------


def _int64(*scalars):
    return [T.cast(scalar, "int64") for scalar in scalars]


def _sinkhorn_segment(steps: int) -> int:
    """Steps between two checkpoints of the backward: ≈ √steps balances shared memory and recomputation."""
    length = 1
    while length * length < steps:
        length += 1
    return length


@T.macro
def load_matrix(src, values, token, token_step, row_step, col_step, n: int, vector: int):
    """``values[i·n + o] = src[token, i, o]``; the steps are int64 strides counted in vectors
    (``col_step`` in elements when ``vector`` is 1; it is 1 otherwise).

    (The steps are passed as int64 casts, not as the kernel's bare parameters: TileLang renames a
    parameter after the macro argument it is passed to, and two calls would give two parameters one name.)"""
    base = T.cast(token, "int64") * token_step * vector
    for i in T.unroll(n):
        for c in T.unroll(n // vector):
            if vector == 1:
                values[i * n + c] = src[base + i * row_step + c * col_step]
            else:
                for e in T.vectorized(vector):
                    values[i * n + c * vector + e] = src[base + (i * row_step + c) * vector + e]


@T.macro
def store_matrix(dst, values, token, n: int, vector: int):
    """``dst[token, i, o] = values[i·n + o]``, ``dst`` contiguous ``[T, n, n]``."""
    base = T.cast(token, "int64") * (n * n)
    for c in T.unroll(n * n // vector):
        for e in T.vectorized(vector):
            dst[base + c * vector + e] = values[c * vector + e]


@T.macro
def softmax_rows(logits, q, row_stats, n: int):
    """``q = softmax_o(logits)`` row by row: max-subtracted ``expf``, summed in index order, IEEE
    division (``row_stats``: ``n`` fp32 of scratch)."""
    for i in T.unroll(n):
        row_stats[i] = logits[i * n]
        for o in T.unroll(1, n):
            row_stats[i] = T.max(row_stats[i], logits[i * n + o])
        for o in T.unroll(n):
            q[i * n + o] = T.exp(logits[i * n + o] - row_stats[i])
        row_stats[i] = q[i * n]
        for o in T.unroll(1, n):
            row_stats[i] = row_stats[i] + q[i * n + o]
        for o in T.unroll(n):
            q[i * n + o] = T.ieee_fdiv(q[i * n + o], row_stats[i])


@T.macro
def normalize(p, denominators, eps, step, n: int, exact: bool):
    """Sinkhorn step ``step`` (even: columns, sums over i; odd: rows, sums over o) in place:
    ``denominators[k] = Σ p + eps`` (index order); ``exact``: ``p / d``, else ``denominators`` holds
    ``r = 1 / d`` and ``p · r``."""
    if step % 2 == 0:
        for o in T.unroll(n):
            denominators[o] = p[o]
            for i in T.unroll(1, n):
                denominators[o] = denominators[o] + p[i * n + o]
            denominators[o] = denominators[o] + eps
    else:
        for i in T.unroll(n):
            denominators[i] = p[i * n]
            for o in T.unroll(1, n):
                denominators[i] = denominators[i] + p[i * n + o]
            denominators[i] = denominators[i] + eps
    if not exact:
        for k in T.unroll(n):
            denominators[k] = T.ieee_fdiv(T.float32(1.0), denominators[k])
    for i in T.unroll(n):
        for o in T.unroll(n):
            d = T.if_then_else(step % 2 == 0, denominators[o], denominators[i])
            if exact:
                p[i * n + o] = T.ieee_fdiv(p[i * n + o], d)
            else:
                p[i * n + o] = p[i * n + o] * d


@T.macro
def normalize_reciprocals(p, reciprocals, eps, step, n: int):
    """``reciprocals = 1 / (Σ_axis p + eps)`` of step ``step``, ``p`` unchanged (the reverse step's input)."""
    if step % 2 == 0:
        for o in T.unroll(n):
            reciprocals[o] = p[o]
            for i in T.unroll(1, n):
                reciprocals[o] = reciprocals[o] + p[i * n + o]
    else:
        for i in T.unroll(n):
            reciprocals[i] = p[i * n]
            for o in T.unroll(1, n):
                reciprocals[i] = reciprocals[i] + p[i * n + o]
    for k in T.unroll(n):
        reciprocals[k] = T.ieee_fdiv(T.float32(1.0), reciprocals[k] + eps)


@T.macro
def normalize_backward(p, dp, reciprocals, dot, step, n: int):
    """Reverse of step ``step`` from its input state ``p`` and ``reciprocals`` (``1 / (S + eps)``):
    ``dp ← (dp − Σ_axis(dp⊙p)·r)·r``."""
    if step % 2 == 0:
        for o in T.unroll(n):
            dot[o] = dp[o] * p[o]
            for i in T.unroll(1, n):
                dot[o] = dot[o] + dp[i * n + o] * p[i * n + o]
    else:
        for i in T.unroll(n):
            dot[i] = dp[i * n] * p[i * n]
            for o in T.unroll(1, n):
                dot[i] = dot[i] + dp[i * n + o] * p[i * n + o]
    for i in T.unroll(n):
        for o in T.unroll(n):
            # Select values, not an index: a runtime index would put the arrays in local memory.
            r = T.if_then_else(step % 2 == 0, reciprocals[o], reciprocals[i])
            projection = T.if_then_else(step % 2 == 0, dot[o], dot[i])
            dp[i * n + o] = (dp[i * n + o] - projection * r) * r


@jit()
def sinkhorn_kernel(n: int, repeat: int, vector: int, threads: int = SINKHORN_THREADS):
    """Forward: one token per thread; T, the strides (in vectors) and eps are runtime values."""
    steps = 2 * repeat - 1
    logits_span = T.dynamic("logits_span")
    out_span = T.dynamic("out_span")

    @T.prim_func
    def kernel(
        logits: T.Tensor((logits_span,), "float32"),
        out: T.Tensor((out_span,), "float32"),
        num_tokens: T.int32,
        token_stride: T.int32,
        row_stride: T.int32,
        col_stride: T.int32,
        eps: T.float32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, threads), threads=threads) as (block,):
            token = block * threads + T.get_thread_binding()
            values = T.alloc_local((n * n,), "float32")
            p = T.alloc_local((n * n,), "float32")
            denominators = T.alloc_local((n,), "float32")
            if token < num_tokens:
                load_matrix(logits, values, token, *_int64(token_stride, row_stride, col_stride), n, vector)
                softmax_rows(values, p, denominators, n)
                for k in T.unroll(n * n):
                    p[k] = p[k] + eps
                for step in T.unroll(steps):
                    normalize(p, denominators, eps, step, n, False)
                store_matrix(out, p, token, n, 4 if n * n % 4 == 0 else 1)

    return kernel


@jit()
def sinkhorn_bwd_kernel(n: int, repeat: int, vector: int, threads: int = SINKHORN_BWD_THREADS):
    """Backward: one token per thread, the iterations recomputed from checkpoints (module docstring)."""
    steps = 2 * repeat - 1
    segment = _sinkhorn_segment(steps)
    segments = ceil_div(steps, segment)
    grad_span = T.dynamic("grad_span")
    logits_span = T.dynamic("logits_span")
    out_span = T.dynamic("out_span")

    @T.prim_func
    def kernel(
        grad: T.Tensor((grad_span,), "float32"),
        logits: T.Tensor((logits_span,), "float32"),
        out: T.Tensor((out_span,), "float32"),
        num_tokens: T.int32,
        grad_token_stride: T.int32,
        grad_row_stride: T.int32,
        grad_col_stride: T.int32,
        token_stride: T.int32,
        row_stride: T.int32,
        col_stride: T.int32,
        eps: T.float32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, threads), threads=threads) as (block,):
            token = block * threads + T.get_thread_binding()
            values = T.alloc_local((n * n,), "float32")
            q = T.alloc_local((n * n,), "float32")
            p = T.alloc_local((n * n,), "float32")
            dp = T.alloc_local((n * n,), "float32")
            reciprocals = T.alloc_local((n,), "float32")
            dot = T.alloc_local((n,), "float32")
            # Checkpoint c (the state before step c·segment) of thread x: entry k at (c·n² + k)·threads + x,
            # so a warp's accesses hit 32 banks. Shared memory, not registers: the steps are runtime loops.
            checkpoints = T.alloc_shared((segments * n * n * threads,), "float32")
            tx = T.get_thread_binding()
            if token < num_tokens:
                load_matrix(logits, values, token, *_int64(token_stride, row_stride, col_stride), n, vector)
                softmax_rows(values, q, dot, n)
                for k in T.unroll(n * n):
                    p[k] = q[k] + eps
                for c in T.serial(segments):
                    for k in T.unroll(n * n):
                        checkpoints[(c * (n * n) + k) * threads + tx] = p[k]
                    if c < segments - 1:
                        for s in T.serial(segment):
                            normalize(p, reciprocals, eps, c * segment + s, n, False)
                load_matrix(grad, dp, token, *_int64(grad_token_stride, grad_row_stride, grad_col_stride), n, vector)
                # Segments last first, each one's steps in reverse; the input state of step c·segment + j is
                # recomputed from checkpoint c. (Nested loops rather than j // segment: TVM's simplifier
                # rewrites the floor division of (steps − 1 − back) wrongly.)
                for back_segment in T.serial(segments):
                    c = segments - 1 - back_segment
                    for back_step in T.serial(segment):
                        j = segment - 1 - back_step
                        if c * segment + j < steps:
                            for k in T.unroll(n * n):
                                p[k] = checkpoints[(c * (n * n) + k) * threads + tx]
                            for s in T.serial(j):
                                normalize(p, reciprocals, eps, c * segment + s, n, False)
                            normalize_reciprocals(p, reciprocals, eps, c * segment + j, n)
                            normalize_backward(p, dp, reciprocals, dot, c * segment + j, n)
                # The softmax backward: dL = (dQ − Σ_o dQ⊙Q)⊙Q (+ eps has unit derivative).
                for i in T.unroll(n):
                    dot[i] = dp[i * n] * q[i * n]
                    for o in T.unroll(1, n):
                        dot[i] = dot[i] + dp[i * n + o] * q[i * n + o]
                for i in T.unroll(n):
                    for o in T.unroll(n):
                        dp[i * n + o] = (dp[i * n + o] - dot[i]) * q[i * n + o]
                store_matrix(out, dp, token, n, 4 if n * n % 4 == 0 else 1)

    return kernel


def _matrix_vector(*tensors) -> int:
    """4 (16-byte loads of a row) when every ``[T, n, n]`` input allows it, else 1."""
    return _vector_width([(t, t.shape[-1]) for t in tensors], 4)


def _sinkhorn_plan(comb_res_mix: torch.Tensor, repeat, eps, backward: bool, grad_output=None):
    """Check a Sinkhorn forward or (``backward``) backward of these signatures and decide
    its launch. The plan, ``run(comb_res_mix, grad_output=None) -> out``, allocates fp32
    ``[T, n, n]`` and launches."""
    n = check_square("comb_res_mix", comb_res_mix)
    if backward:
        check_tensor("grad_output", grad_output, dtypes=(F32,), ndim=3)
        check_shape("grad_output", grad_output, (comb_res_mix.shape[0], n, n))
    repeat = check_positive_int("repeat", repeat)
    eps = check_nonnegative_float("eps", eps)
    require_cuda("comb_res_mix", comb_res_mix)
    if backward:
        require_cuda("grad_output", grad_output)
    tokens = comb_res_mix.shape[0]
    device = comb_res_mix.device

    def allocate():
        return new_output(torch.empty((tokens, n, n), dtype=F32, device=device))

    if tokens == 0 or n == 0:
        return lambda comb_res_mix, grad_output=None: allocate()
    if not backward:
        vector = _matrix_vector(comb_res_mix)
        kernel = launched(sinkhorn_kernel(n, repeat, vector))
        scalars = (tokens, *_strides_in(comb_res_mix, vector), eps)

        def run(comb_res_mix, grad_output=None):
            out = allocate()
            if kernel is not None:
                kernel(flat_view(comb_res_mix), flat_view(out), *scalars)
            return out

        return run
    vector = _matrix_vector(grad_output, comb_res_mix)
    kernel = launched(sinkhorn_bwd_kernel(n, repeat, vector))
    scalars = (tokens, *_strides_in(grad_output, vector), *_strides_in(comb_res_mix, vector), eps)

    def run_backward(comb_res_mix, grad_output):
        out = allocate()
        if kernel is not None:
            kernel(flat_view(grad_output), flat_view(comb_res_mix), flat_view(out), *scalars)
        return out

    return run_backward


_SINKHORN_PLANS = LaunchPlans(_sinkhorn_plan)


def sinkhorn_normalize(comb_res_mix: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Project the comb logits onto (approximately) doubly stochastic matrices (see the reference)."""
    return _SINKHORN_PLANS.plan(comb_res_mix, repeat, eps, False)(comb_res_mix)


def sinkhorn_normalize_bwd(
    grad_output: torch.Tensor, comb_res_mix: torch.Tensor, repeat: int = 10, eps: float = 1e-6
) -> torch.Tensor:
    """Gradient of ``sinkhorn_normalize`` w.r.t. its logits, recomputing the iterations on chip."""
    return _SINKHORN_PLANS.plan(comb_res_mix, repeat, eps, True, grad_output)(comb_res_mix, grad_output)


# ---------------------------------------------------------------------------------------------
# Stream kernels: pre-apply, post, expand (bf16 vectors of channels)
# ---------------------------------------------------------------------------------------------


@T.macro
def load_channels(src, values, offset, column, column_step, slot, columns, vector: int):
    """Vector ``column`` of a row → ``values[slot·vector + e]``, still bf16 (0 past ``columns``):
    the kernels widen each value to fp32 where they use it, which halves the registers the loaded
    rows take (more rows in flight per SM).

    With ``vector > 1``: ``offset`` (the row) and ``column`` count vectors of contiguous channels, one
    16-byte load. With ``vector == 1``: elements, the channel at ``offset + column·column_step``."""
    if column < columns:
        if vector == 1:
            values[slot] = src[offset + column * column_step]
        else:
            for e in T.vectorized(vector):
                values[slot * vector + e] = src[(offset + column) * vector + e]
    else:
        for e in T.unroll(vector):
            values[slot * vector + e] = T.cast(0, "bfloat16")


def widen(value):
    """A loaded bf16 value as fp32 (exact)."""
    return T.cast(value, "float32")


@T.macro
def store_channels(dst, raw, values, offset, column, slot, columns, vector: int):
    """``bf16(values[slot·vector + e])`` (round to nearest even) → vector ``column`` of the contiguous
    row at ``offset`` (both in vectors), below ``columns``."""
    if column < columns:
        for e in T.unroll(vector):
            raw[e] = T.cast(values[slot * vector + e], "bfloat16")
        for e in T.vectorized(vector):
            dst[(offset + column) * vector + e] = raw[e]


@T.macro
def load_streams(
    residual, streams, row, residual_stream_stride, channel_stride, column, item, items, columns, n: int, vector: int
):
    """Vector ``column`` of the token's n streams (stream i at ``row + i·residual_stream_stride``) →
    ``streams[(i·items + item)·vector + e]`` (``load_channels`` each)."""
    for i in T.unroll(n):
        load_channels(
            residual,
            streams,
            row + i * residual_stream_stride,
            column,
            channel_stride,
            i * items + item,
            columns,
            vector,
        )


@T.macro
def pre_mix_item(mixed, streams, pre, item, items, n: int, vector: int):
    """``mixed[item·vector + e] = Σ_i pre[i]·X_i`` in fp32, i in order (the pre-apply)."""
    for e in T.unroll(vector):
        mixed[item * vector + e] = pre[0] * widen(streams[item * vector + e])
        for i in T.unroll(1, n):
            mixed[item * vector + e] = mixed[item * vector + e] + pre[i] * widen(
                streams[(i * items + item) * vector + e]
            )


@T.macro
def post_mix_item(mixed, streams, y, post, weights, o, item, items, n: int, vector: int):
    """``mixed[item·vector + e] = post[o]·y + Σ_i comb[i, o]·X_i`` in fp32 for output stream o: the sum
    over i in order first, then the post term (the reference's order); ``weights[i·n + o] = comb[i, o]``."""
    for e in T.unroll(vector):
        mixed[item * vector + e] = weights[o] * widen(streams[item * vector + e])
        for i in T.unroll(1, n):
            mixed[item * vector + e] = mixed[item * vector + e] + weights[i * n + o] * widen(
                streams[(i * items + item) * vector + e]
            )
        mixed[item * vector + e] = post[o] * widen(y[item * vector + e]) + mixed[item * vector + e]


def _stream_vector(hidden: int, *tensors) -> int:
    """8 (16-byte vectors of bf16 channels) when C and every stream tensor allow it, else 1."""
    if hidden % BF16_VECTOR:
        return 1
    return _vector_width([(t, hidden) for t in tensors], BF16_VECTOR)


def _channel_strides(tensor: torch.Tensor, vector: int) -> list[int]:
    """Outer strides of a ``[T, (n,) C]`` stream tensor in vectors, and its channel stride (elements)."""
    return _strides_in(tensor, vector)


def cta_sum_slots(count: int) -> int:
    """The fp32 slots ``cta_sum`` needs for ``count`` values per thread: up to 32 values, ``count``
    padded to a power of two (the halving butterfly's), else ``count``."""
    return 1 << halving_steps(count) if count <= 32 else count


@T.macro
def cta_sum(partials, warp_sums, lane, warp, count: int, warps: int):
    """``partials[k]`` (``count`` fp32 per thread in ``cta_sum_slots(count)`` slots, the extra ones
    zero) → the CTA's sum in ``partials[k]`` of thread 0: a warp butterfly (partners at distance 16,
    8, 4, 2, 1), then one shared-memory slot per warp and value, added in warp order.

    Up to 32 values the warp sum is ``halving_butterfly``'s (the same trees, hence the same bits):
    ``padded − 1`` shuffles instead of 5·``count`` (31 instead of 100 for ``mhc_post_bwd``'s 20 sums
    at n 4)."""
    if count <= 32:
        halvings = halving_steps(count)
        halving_butterfly(partials, halvings, lane, True)
        held = halved_index(lane, halvings, True)
        # One lane per value: those whose lane bits below the halvings' are zero.
        if (lane & ((1 << (5 - halvings)) - 1)) == 0 and held < count:
            warp_sums[warp * count + held] = partials[0]
    else:
        for k in T.unroll(count):
            for step in T.unroll(5):
                partials[k] = partials[k] + T.shfl_xor(partials[k], 1 << (4 - step))
        if lane == 0:
            for k in T.unroll(count):
                warp_sums[warp * count + k] = partials[k]
    T.sync_threads()
    if warp == 0 and lane == 0:
        for k in T.unroll(count):
            partials[k] = warp_sums[k]
            for w in T.unroll(1, warps):
                partials[k] = partials[k] + warp_sums[w * count + k]


@jit()
def post_kernel(n: int, vector: int, items: int = POST_ITEMS, threads: int = STREAM_THREADS):
    """``out[t, o, c] = post[t, o]·y[t, c] + Σ_i comb[t, i, o]·X[t, i, c]`` (fp32, i in order, one
    bf16 rounding). Grid: (T, channel blocks of ``threads·items`` vectors); strides in vectors (the
    channel strides, in elements, matter only when ``vector`` is 1)."""
    x_span = T.dynamic("x_span")
    residual_span = T.dynamic("residual_span")
    post_span = T.dynamic("post_span")
    comb_span = T.dynamic("comb_span")
    out_span = T.dynamic("out_span")

    @T.prim_func
    def kernel(
        x: T.Tensor((x_span,), "bfloat16"),
        residual: T.Tensor((residual_span,), "bfloat16"),
        post_mix: T.Tensor((post_span,), "float32"),
        comb: T.Tensor((comb_span,), "float32"),
        out: T.Tensor((out_span,), "bfloat16"),
        num_tokens: T.int32,
        hidden_vectors: T.int32,
        x_token_stride: T.int32,
        x_channel_stride: T.int32,
        residual_token_stride: T.int32,
        residual_stream_stride: T.int32,
        residual_channel_stride: T.int32,
        post_token_stride: T.int32,
        post_stream_stride: T.int32,
        comb_token_stride: T.int32,
        comb_source_stride: T.int32,
        comb_destination_stride: T.int32,
    ):
        with T.Kernel(num_tokens, T.ceildiv(hidden_vectors, threads * items), threads=threads) as (token, block):
            tx = T.get_thread_binding()
            raw = T.alloc_local((vector,), "bfloat16")
            y = T.alloc_local((items * vector,), "bfloat16")
            streams = T.alloc_local((n * items * vector,), "bfloat16")
            mixed = T.alloc_local((items * vector,), "float32")
            post = T.alloc_local((n,), "float32")
            weights = T.alloc_local((n * n,), "float32")
            t64 = T.cast(token, "int64")
            for o in T.unroll(n):
                post[o] = post_mix[t64 * post_token_stride + o * post_stream_stride]
                for i in T.unroll(n):
                    weights[i * n + o] = comb[
                        t64 * comb_token_stride + i * comb_source_stride + o * comb_destination_stride
                    ]
            for item in T.unroll(items):
                column = (block * items + item) * threads + tx
                load_channels(
                    x,
                    y,
                    t64 * x_token_stride,
                    column,
                    T.cast(x_channel_stride, "int64"),
                    item,
                    hidden_vectors,
                    vector,
                )
                load_streams(
                    residual,
                    streams,
                    t64 * residual_token_stride,
                    residual_stream_stride,
                    T.cast(residual_channel_stride, "int64"),
                    column,
                    item,
                    items,
                    hidden_vectors,
                    n,
                    vector,
                )
            for o in T.unroll(n):
                for item in T.unroll(items):
                    column = (block * items + item) * threads + tx
                    post_mix_item(mixed, streams, y, post, weights, o, item, items, n, vector)
                    store_channels(
                        out, raw, mixed, (t64 * n + o) * hidden_vectors, column, item, hidden_vectors, vector
                    )

    return kernel


@jit()
def post_bwd_kernel(n: int, vector: int, threads: int = REDUCE_THREADS):
    """One CTA per token: ``dy = Σ_o post_o·g_o``, ``dX_i = Σ_o comb[i, o]·g_o`` (bf16, o in order)
    and the sums over C ``dpost_o = Σ_c y·g_o``, ``dcomb[i, o] = Σ_c X_i·g_o`` (fp32, ``cta_sum``)."""
    warps = threads // 32
    sums = n + n * n  # [dpost n | dcomb n²]
    grad_span = T.dynamic("grad_span")
    x_span = T.dynamic("x_span")
    residual_span = T.dynamic("residual_span")
    post_span = T.dynamic("post_span")
    comb_span = T.dynamic("comb_span")
    dx_span = T.dynamic("dx_span")
    dresidual_span = T.dynamic("dresidual_span")
    dpost_span = T.dynamic("dpost_span")
    dcomb_span = T.dynamic("dcomb_span")

    @T.prim_func
    def kernel(
        grad: T.Tensor((grad_span,), "bfloat16"),
        x: T.Tensor((x_span,), "bfloat16"),
        residual: T.Tensor((residual_span,), "bfloat16"),
        post_mix: T.Tensor((post_span,), "float32"),
        comb: T.Tensor((comb_span,), "float32"),
        dx: T.Tensor((dx_span,), "bfloat16"),
        dresidual: T.Tensor((dresidual_span,), "bfloat16"),
        dpost: T.Tensor((dpost_span,), "float32"),
        dcomb: T.Tensor((dcomb_span,), "float32"),
        num_tokens: T.int32,
        hidden_vectors: T.int32,
        grad_token_stride: T.int32,
        grad_stream_stride: T.int32,
        grad_channel_stride: T.int32,
        x_token_stride: T.int32,
        x_channel_stride: T.int32,
        residual_token_stride: T.int32,
        residual_stream_stride: T.int32,
        residual_channel_stride: T.int32,
        post_token_stride: T.int32,
        post_stream_stride: T.int32,
        comb_token_stride: T.int32,
        comb_source_stride: T.int32,
        comb_destination_stride: T.int32,
    ):
        with T.Kernel(num_tokens, threads=threads) as (token,):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            raw = T.alloc_local((vector,), "bfloat16")
            g = T.alloc_local((n * vector,), "bfloat16")
            y = T.alloc_local((vector,), "bfloat16")
            streams = T.alloc_local((n * vector,), "bfloat16")
            result = T.alloc_local((vector,), "float32")
            post = T.alloc_local((n,), "float32")
            weights = T.alloc_local((n * n,), "float32")
            partials = T.alloc_local((cta_sum_slots(sums),), "float32")
            warp_sums = T.alloc_shared((warps * sums,), "float32")
            t64 = T.cast(token, "int64")
            for o in T.unroll(n):
                post[o] = post_mix[t64 * post_token_stride + o * post_stream_stride]
                for i in T.unroll(n):
                    weights[i * n + o] = comb[
                        t64 * comb_token_stride + i * comb_source_stride + o * comb_destination_stride
                    ]
            for k in T.unroll(cta_sum_slots(sums)):
                partials[k] = T.float32(0)
            for chunk in T.serial(T.ceildiv(hidden_vectors, threads)):
                column = chunk * threads + tx
                load_channels(
                    x,
                    y,
                    t64 * x_token_stride,
                    column,
                    T.cast(x_channel_stride, "int64"),
                    0,
                    hidden_vectors,
                    vector,
                )
                for i in T.unroll(n):
                    load_channels(
                        grad,
                        g,
                        t64 * grad_token_stride + i * grad_stream_stride,
                        column,
                        T.cast(grad_channel_stride, "int64"),
                        i,
                        hidden_vectors,
                        vector,
                    )
                    load_channels(
                        residual,
                        streams,
                        t64 * residual_token_stride + i * residual_stream_stride,
                        column,
                        T.cast(residual_channel_stride, "int64"),
                        i,
                        hidden_vectors,
                        vector,
                    )
                for e in T.unroll(vector):
                    result[e] = post[0] * widen(g[e])
                    for o in T.unroll(1, n):
                        result[e] = result[e] + post[o] * widen(g[o * vector + e])
                store_channels(dx, raw, result, t64 * hidden_vectors, column, 0, hidden_vectors, vector)
                for i in T.unroll(n):
                    for e in T.unroll(vector):
                        result[e] = weights[i * n] * widen(g[e])
                        for o in T.unroll(1, n):
                            result[e] = result[e] + weights[i * n + o] * widen(g[o * vector + e])
                    store_channels(
                        dresidual, raw, result, (t64 * n + i) * hidden_vectors, column, 0, hidden_vectors, vector
                    )
                for o in T.unroll(n):
                    for e in T.unroll(vector):
                        partials[o] = partials[o] + widen(y[e]) * widen(g[o * vector + e])
                    for i in T.unroll(n):
                        for e in T.unroll(vector):
                            partials[n + i * n + o] = partials[n + i * n + o] + widen(streams[i * vector + e]) * widen(
                                g[o * vector + e]
                            )
            cta_sum(partials, warp_sums, lane, warp, sums, warps)
            if tx == 0:
                for o in T.unroll(n):
                    dpost[t64 * n + o] = partials[o]
                for k in T.unroll(n * n):
                    dcomb[t64 * (n * n) + k] = partials[n + k]

    return kernel


@jit()
def apply_mix_kernel(n: int, vector: int, items: int = STREAM_ITEMS, threads: int = STREAM_THREADS):
    """``out[t, c] = Σ_i mix[t, i]·X[t, i, c]`` (fp32, i in order, one bf16 rounding); grid and
    strides as ``post_kernel``. With unit weights (stride 0) it is the in-order sum of the streams."""
    residual_span = T.dynamic("residual_span")
    mix_span = T.dynamic("mix_span")
    out_span = T.dynamic("out_span")

    @T.prim_func
    def kernel(
        residual: T.Tensor((residual_span,), "bfloat16"),
        mix: T.Tensor((mix_span,), "float32"),
        out: T.Tensor((out_span,), "bfloat16"),
        num_tokens: T.int32,
        hidden_vectors: T.int32,
        residual_token_stride: T.int32,
        residual_stream_stride: T.int32,
        residual_channel_stride: T.int32,
        mix_token_stride: T.int32,
        mix_stream_stride: T.int32,
    ):
        with T.Kernel(num_tokens, T.ceildiv(hidden_vectors, threads * items), threads=threads) as (token, block):
            tx = T.get_thread_binding()
            raw = T.alloc_local((vector,), "bfloat16")
            streams = T.alloc_local((n * items * vector,), "bfloat16")
            mixed = T.alloc_local((items * vector,), "float32")
            weights = T.alloc_local((n,), "float32")
            t64 = T.cast(token, "int64")
            for i in T.unroll(n):
                weights[i] = mix[t64 * mix_token_stride + i * mix_stream_stride]
            for item in T.unroll(items):
                column = (block * items + item) * threads + tx
                load_streams(
                    residual,
                    streams,
                    t64 * residual_token_stride,
                    residual_stream_stride,
                    T.cast(residual_channel_stride, "int64"),
                    column,
                    item,
                    items,
                    hidden_vectors,
                    n,
                    vector,
                )
            for item in T.unroll(items):
                column = (block * items + item) * threads + tx
                pre_mix_item(mixed, streams, weights, item, items, n, vector)
                store_channels(out, raw, mixed, t64 * hidden_vectors, column, item, hidden_vectors, vector)

    return kernel


@jit()
def apply_mix_bwd_kernel(n: int, vector: int, threads: int = REDUCE_THREADS):
    """One CTA per token: ``dX_i = bf16(mix_i·g)`` and ``dmix_i = Σ_c g·X_i`` (fp32, ``cta_sum``)."""
    warps = threads // 32
    grad_span = T.dynamic("grad_span")
    residual_span = T.dynamic("residual_span")
    mix_span = T.dynamic("mix_span")
    dresidual_span = T.dynamic("dresidual_span")
    dmix_span = T.dynamic("dmix_span")

    @T.prim_func
    def kernel(
        grad: T.Tensor((grad_span,), "bfloat16"),
        residual: T.Tensor((residual_span,), "bfloat16"),
        mix: T.Tensor((mix_span,), "float32"),
        dresidual: T.Tensor((dresidual_span,), "bfloat16"),
        dmix: T.Tensor((dmix_span,), "float32"),
        num_tokens: T.int32,
        hidden_vectors: T.int32,
        grad_token_stride: T.int32,
        grad_channel_stride: T.int32,
        residual_token_stride: T.int32,
        residual_stream_stride: T.int32,
        residual_channel_stride: T.int32,
        mix_token_stride: T.int32,
        mix_stream_stride: T.int32,
    ):
        with T.Kernel(num_tokens, threads=threads) as (token,):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            raw = T.alloc_local((vector,), "bfloat16")
            g = T.alloc_local((vector,), "bfloat16")
            streams = T.alloc_local((n * vector,), "bfloat16")
            result = T.alloc_local((vector,), "float32")
            weights = T.alloc_local((n,), "float32")
            partials = T.alloc_local((cta_sum_slots(n),), "float32")
            warp_sums = T.alloc_shared((warps * n,), "float32")
            t64 = T.cast(token, "int64")
            for i in T.unroll(n):
                weights[i] = mix[t64 * mix_token_stride + i * mix_stream_stride]
            for i in T.unroll(cta_sum_slots(n)):
                partials[i] = T.float32(0)
            for chunk in T.serial(T.ceildiv(hidden_vectors, threads)):
                column = chunk * threads + tx
                load_channels(
                    grad,
                    g,
                    t64 * grad_token_stride,
                    column,
                    T.cast(grad_channel_stride, "int64"),
                    0,
                    hidden_vectors,
                    vector,
                )
                for i in T.unroll(n):
                    load_channels(
                        residual,
                        streams,
                        t64 * residual_token_stride + i * residual_stream_stride,
                        column,
                        T.cast(residual_channel_stride, "int64"),
                        i,
                        hidden_vectors,
                        vector,
                    )
                for i in T.unroll(n):
                    for e in T.unroll(vector):
                        result[e] = weights[i] * widen(g[e])
                        partials[i] = partials[i] + widen(g[e]) * widen(streams[i * vector + e])
                    store_channels(
                        dresidual, raw, result, (t64 * n + i) * hidden_vectors, column, 0, hidden_vectors, vector
                    )
            cta_sum(partials, warp_sums, lane, warp, n, warps)
            if tx == 0:
                for i in T.unroll(n):
                    dmix[t64 * n + i] = partials[i]

    return kernel


@jit()
def expand_kernel(n: int, vector: int, items: int = STREAM_ITEMS, threads: int = STREAM_THREADS):
    """``out[t, o, c] = hidden[t, c]`` for every stream o (a copy: bf16 moved as raw vectors)."""
    hidden_span = T.dynamic("hidden_span")
    out_span = T.dynamic("out_span")

    @T.prim_func
    def kernel(
        hidden_states: T.Tensor((hidden_span,), "bfloat16"),
        out: T.Tensor((out_span,), "bfloat16"),
        num_tokens: T.int32,
        hidden_vectors: T.int32,
        token_stride: T.int32,
        channel_stride: T.int32,
    ):
        with T.Kernel(num_tokens, T.ceildiv(hidden_vectors, threads * items), threads=threads) as (token, block):
            tx = T.get_thread_binding()
            values = T.alloc_local((items * vector,), "bfloat16")
            t64 = T.cast(token, "int64")
            for item in T.unroll(items):
                column = (block * items + item) * threads + tx
                if column < hidden_vectors:
                    if vector == 1:
                        values[item] = hidden_states[t64 * token_stride + column * T.cast(channel_stride, "int64")]
                    else:
                        for e in T.vectorized(vector):
                            values[item * vector + e] = hidden_states[(t64 * token_stride + column) * vector + e]
            for o in T.unroll(n):
                for item in T.unroll(items):
                    column = (block * items + item) * threads + tx
                    if column < hidden_vectors:
                        for e in T.vectorized(vector):
                            out[((t64 * n + o) * hidden_vectors + column) * vector + e] = values[item * vector + e]

    return kernel


def _apply_mix_plan(x, mix):
    """Check an ``mhc_pre_apply_mix`` of these signatures and decide its launch; the plan:
    ``run(x, mix) -> out``."""
    tokens, n, hidden = check_residual("x", x)
    check_tensor("mix", mix, dtypes=(F32,), ndim=2)
    check_shape("mix", mix, (tokens, n))
    require_cuda("x", x)
    require_cuda("mix", mix)
    device = x.device

    def allocate():
        return new_output(torch.empty((tokens, hidden), dtype=BF16, device=device))

    if tokens * hidden == 0:
        return lambda x, mix: allocate()
    vector = _stream_vector(hidden, x)
    kernel = launched(apply_mix_kernel(n, vector))
    scalars = (tokens, hidden // vector, *_channel_strides(x, vector), *mix.stride())

    def run(x, mix):
        out = allocate()
        if kernel is not None:
            kernel(flat_view(x), flat_view(mix), flat_view(out), *scalars)
        return out

    return run


_APPLY_MIX_PLANS = LaunchPlans(_apply_mix_plan)


def mhc_pre_apply_mix(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """Mix the n streams into the sublayer input: bf16 ``[T, C]`` ``Σ_i mix_i·X[i]`` (fp32, rounded once)."""
    return _APPLY_MIX_PLANS.plan(x, mix)(x, mix)


def _apply_mix_bwd_plan(grad_output, x, mix):
    """Check an ``mhc_pre_apply_mix_bwd`` of these signatures and decide its launch; the plan:
    ``run(grad_output, x, mix) -> (dx, dmix)``."""
    tokens, n, hidden = check_residual("x", x)
    check_tensor("mix", mix, dtypes=(F32,), ndim=2)
    check_shape("mix", mix, (tokens, n))
    check_tensor("grad_output", grad_output, dtypes=(BF16,), ndim=2)
    check_shape("grad_output", grad_output, (tokens, hidden))
    for name, tensor in (("grad_output", grad_output), ("x", x), ("mix", mix)):
        require_cuda(name, tensor)
    device = x.device

    def allocate():
        d_residual = new_output(torch.empty((tokens, n, hidden), dtype=BF16, device=device))
        return d_residual, new_output(torch.empty((tokens, n), dtype=F32, device=device))

    if tokens == 0 or n == 0:
        return lambda grad_output, x, mix: allocate()
    if hidden == 0:

        def zero_mix_gradient(grad_output, x, mix):
            d_residual, d_mix = allocate()
            return d_residual, d_mix.zero_()

        return zero_mix_gradient
    vector = _stream_vector(hidden, grad_output, x)
    kernel = launched(apply_mix_bwd_kernel(n, vector))
    scalars = (
        tokens,
        hidden // vector,
        *_channel_strides(grad_output, vector),
        *_channel_strides(x, vector),
        *mix.stride(),
    )

    def run(grad_output, x, mix):
        d_residual, d_mix = allocate()
        if kernel is not None:
            kernel(
                flat_view(grad_output), flat_view(x), flat_view(mix), flat_view(d_residual), flat_view(d_mix), *scalars
            )
        return d_residual, d_mix

    return run


_APPLY_MIX_BWD_PLANS = LaunchPlans(_apply_mix_bwd_plan)


def mhc_pre_apply_mix_bwd(
    grad_output: torch.Tensor, x: torch.Tensor, mix: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit backward of ``mhc_pre_apply_mix``: ``(dx bf16 [T, n, C], dmix fp32 [T, n])``."""
    return _APPLY_MIX_BWD_PLANS.plan(grad_output, x, mix)(grad_output, x, mix)


def post_schedule(hidden_vectors: int) -> tuple[int, int]:
    """``(items, threads)`` of ``post_kernel`` for a row of ``hidden_vectors`` vectors. Rows that CTAs
    of ``POST_ITEMS × STREAM_THREADS`` tile exactly, or longer than two of them, take those; any other
    row up to that length takes one CTA of 2 vectors per thread with at most one idle warp, where the
    default CTA would leave lanes idle. H200, T 8192, kernel time: C 7168 (896 vectors, 448 threads)
    250.5 µs against 255.1; C 1280 (160 vectors, 96 threads) 48.3 against 72.3; C 2560 (320
    vectors, 160 threads) 95.3 against 100.4."""
    default = POST_ITEMS * STREAM_THREADS
    if hidden_vectors % default == 0 or hidden_vectors > 2 * default:
        return POST_ITEMS, STREAM_THREADS
    return POST_WIDE_ITEMS, 32 * ceil_div(ceil_div(hidden_vectors, POST_WIDE_ITEMS), 32)


def _post_plan(x, residual, post_layer_mix, comb_res_mix):
    """Check an ``mhc_post`` of these signatures and decide its launch; the plan:
    ``run(x, residual, post_layer_mix, comb_res_mix) -> out``."""
    tokens, n, hidden = check_post_inputs(x, residual, post_layer_mix, comb_res_mix)
    for name, tensor in (("x", x), ("residual", residual), ("post_layer_mix", post_layer_mix)):
        require_cuda(name, tensor)
    require_cuda("comb_res_mix", comb_res_mix)
    device = residual.device

    def allocate():
        return new_output(torch.empty((tokens, n, hidden), dtype=BF16, device=device))

    if tokens * n * hidden == 0:
        return lambda *tensors: allocate()
    vector = _stream_vector(hidden, x, residual)
    kernel = launched(post_kernel(n, vector, *post_schedule(hidden // vector)))
    scalars = (
        tokens,
        hidden // vector,
        *_channel_strides(x, vector),
        *_channel_strides(residual, vector),
        *post_layer_mix.stride(),
        *comb_res_mix.stride(),
    )

    def run(x, residual, post_layer_mix, comb_res_mix):
        out = allocate()
        if kernel is not None:
            kernel(
                flat_view(x),
                flat_view(residual),
                flat_view(post_layer_mix),
                flat_view(comb_res_mix),
                flat_view(out),
                *scalars,
            )
        return out

    return run


_POST_PLANS = LaunchPlans(_post_plan)


def mhc_post(
    x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor
) -> torch.Tensor:
    """Write the sublayer output back into the streams and mix the residual: bf16 ``[T, n, C]``
    ``post_o·y + Σ_i comb[i, o]·X[i]`` (fp32, rounded once)."""
    return _POST_PLANS.plan(x, residual, post_layer_mix, comb_res_mix)(x, residual, post_layer_mix, comb_res_mix)


def _post_bwd_plan(grad_output, x, residual, post_layer_mix, comb_res_mix):
    """Check an ``mhc_post_bwd`` of these signatures and decide its launch; the plan:
    ``run(grad_output, x, residual, post_layer_mix, comb_res_mix) -> (dx, dresidual, dpost, dcomb)``."""
    tokens, n, hidden = check_post_inputs(x, residual, post_layer_mix, comb_res_mix)
    check_tensor("grad_output", grad_output, dtypes=(BF16,), ndim=3)
    check_shape("grad_output", grad_output, (tokens, n, hidden))
    for name, tensor in (("grad_output", grad_output), ("x", x), ("residual", residual)):
        require_cuda(name, tensor)
    require_cuda("post_layer_mix", post_layer_mix)
    require_cuda("comb_res_mix", comb_res_mix)
    device = residual.device

    def allocate():
        d_x = new_output(torch.empty((tokens, hidden), dtype=BF16, device=device))
        d_residual = new_output(torch.empty((tokens, n, hidden), dtype=BF16, device=device))
        d_post = new_output(torch.empty((tokens, n), dtype=F32, device=device))
        return d_x, d_residual, d_post, new_output(torch.empty((tokens, n, n), dtype=F32, device=device))

    if tokens == 0 or n == 0:
        return lambda *tensors: allocate()
    if hidden == 0:

        def zero_mix_gradients(*tensors):
            d_x, d_residual, d_post, d_comb = allocate()
            return d_x, d_residual, d_post.zero_(), d_comb.zero_()

        return zero_mix_gradients
    vector = _stream_vector(hidden, grad_output, x, residual)
    kernel = launched(post_bwd_kernel(n, vector, post_bwd_threads(hidden // vector)))
    scalars = (
        tokens,
        hidden // vector,
        *_channel_strides(grad_output, vector),
        *_channel_strides(x, vector),
        *_channel_strides(residual, vector),
        *post_layer_mix.stride(),
        *comb_res_mix.stride(),
    )

    def run(grad_output, x, residual, post_layer_mix, comb_res_mix):
        d_x, d_residual, d_post, d_comb = allocate()
        if kernel is not None:
            kernel(
                flat_view(grad_output),
                flat_view(x),
                flat_view(residual),
                flat_view(post_layer_mix),
                flat_view(comb_res_mix),
                flat_view(d_x),
                flat_view(d_residual),
                flat_view(d_post),
                flat_view(d_comb),
                *scalars,
            )
        return d_x, d_residual, d_post, d_comb

    return run


_POST_BWD_PLANS = LaunchPlans(_post_bwd_plan)


def mhc_post_bwd(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Explicit backward of ``mhc_post``: ``(dx bf16 [T, C], dresidual bf16 [T, n, C], dpost fp32
    [T, n], dcomb fp32 [T, n, n])``."""
    arguments = (grad_output, x, residual, post_layer_mix, comb_res_mix)
    return _POST_BWD_PLANS.plan(*arguments)(*arguments)


def _expand_plan(hidden, mhc_mult):
    """Check an ``expand_to_mhc`` of these signatures and decide its launch; the plan: ``run(hidden) -> out``."""
    check_tensor("hidden", hidden, dtypes=(BF16,), ndim=2)
    n = check_positive_int("mhc_mult", mhc_mult)
    require_cuda("hidden", hidden)
    tokens, width = hidden.shape
    device = hidden.device

    def allocate():
        return new_output(torch.empty((tokens, n, width), dtype=BF16, device=device))

    if tokens * width == 0:
        return lambda hidden: allocate()
    vector = _stream_vector(width, hidden)
    kernel = launched(expand_kernel(n, vector))
    scalars = (tokens, width // vector, *_channel_strides(hidden, vector))

    def run(hidden):
        out = allocate()
        if kernel is not None:
            kernel(flat_view(hidden), flat_view(out), *scalars)
        return out

    return run


_EXPAND_PLANS = LaunchPlans(_expand_plan)


def expand_to_mhc(hidden: torch.Tensor, mhc_mult: int) -> torch.Tensor:
    """Copy the hidden state into every stream: bf16 ``[T, C] → [T, n, C]`` contiguous (exact)."""
    return _EXPAND_PLANS.plan(hidden, mhc_mult)(hidden)


def _expand_bwd_plan(grad_output):
    """Check an ``expand_to_mhc_bwd`` of this signature and decide its launch; the plan:
    ``run(grad_output) -> out``."""
    check_tensor("grad_output", grad_output, dtypes=(BF16,), ndim=3)
    require_cuda("grad_output", grad_output)
    tokens, n, hidden = grad_output.shape
    device = grad_output.device

    def allocate():
        return new_output(torch.empty((tokens, hidden), dtype=BF16, device=device))

    if tokens * hidden == 0:
        return lambda grad_output: allocate()
    if n == 0:
        return lambda grad_output: allocate().zero_()
    vector = _stream_vector(hidden, grad_output)
    kernel = launched(apply_mix_kernel(n, vector))
    ones = device_constant(F32, device, value=1, numel=1)
    scalars = (tokens, hidden // vector, *_channel_strides(grad_output, vector), 0, 0)

    def run(grad_output):
        out = allocate()
        if kernel is not None:
            kernel(flat_view(grad_output), ones, flat_view(out), *scalars)
        return out

    return run


_EXPAND_BWD_PLANS = LaunchPlans(_expand_bwd_plan)


def expand_to_mhc_bwd(grad_output: torch.Tensor) -> torch.Tensor:
    """Sum the streams' gradients: bf16 ``[T, n, C] → [T, C]``, fp32 in stream order, rounded once.

    Runs ``apply_mix_kernel`` with unit weights (a stride-0 tensor of ones): ``1·g`` is exact and a
    fused ``1·g + acc`` rounds like ``g + acc``, so this is the in-order sum, bit for bit."""
    return _EXPAND_BWD_PLANS.plan(grad_output)(grad_output)


# ---------------------------------------------------------------------------------------------
# Token kernels: split of the mixes, head mix
# ---------------------------------------------------------------------------------------------


def sigmoid(z):
    """``1 / (1 + e^-z)``: ``expf`` and an IEEE division (PyTorch's CUDA sigmoid has the same form)."""
    return T.ieee_fdiv(T.float32(1.0), T.float32(1.0) + T.exp(-z))


@jit()
def split_kernel(n: int, head: bool, threads: int = TOKEN_THREADS):
    """One token per thread: ``z = scale_group·mixes + base``; ``pre = σ(z) + pre_eps``,
    ``post = post_mult·σ(z)``, ``comb = z``. With ``head`` only the first n columns exist (one scale):
    the head mix is the pre group. Outputs contiguous; the mixes' strides in elements."""
    mixes_span = T.dynamic("mixes_span")
    scale_span = T.dynamic("scale_span")
    base_span = T.dynamic("base_span")
    pre_span = T.dynamic("pre_span")
    post_span = T.dynamic("post_span")
    comb_span = T.dynamic("comb_span")

    @T.prim_func
    def kernel(
        mixes: T.Tensor((mixes_span,), "float32"),
        scale: T.Tensor((scale_span,), "float32"),
        base: T.Tensor((base_span,), "float32"),
        pre: T.Tensor((pre_span,), "float32"),
        post: T.Tensor((post_span,), "float32"),
        comb: T.Tensor((comb_span,), "float32"),
        num_tokens: T.int32,
        mixes_token_stride: T.int32,
        mixes_column_stride: T.int32,
        post_mult: T.float32,
        pre_eps: T.float32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, threads), threads=threads) as (block,):
            token = block * threads + T.get_thread_binding()
            t64 = T.cast(token, "int64")
            row = t64 * mixes_token_stride
            if token < num_tokens:
                for j in T.unroll(n):
                    z = mixes[row + j * mixes_column_stride] * scale[0] + base[j]
                    pre[t64 * n + j] = sigmoid(z) + pre_eps
                if not head:
                    for j in T.unroll(n):
                        z = mixes[row + (n + j) * mixes_column_stride] * scale[1] + base[n + j]
                        post[t64 * n + j] = post_mult * sigmoid(z)
                    for k in T.unroll(n * n):
                        comb[t64 * (n * n) + k] = (
                            mixes[row + (2 * n + k) * mixes_column_stride] * scale[2] + base[2 * n + k]
                        )

    return kernel


@jit()
def split_bwd_kernel(n: int, head: bool, threads: int = TOKEN_THREADS):
    """Grid-stride over tokens (one per thread at a time): ``dz`` (σ recomputed without pre_eps),
    ``dmixes = dz·scale_group``, and per CTA one partial row ``[Σ dz·mixes (m) | Σ dz (m)]`` of the
    parameter gradients (thread partials in registers, then ``cta_sum``), m = n (head) or n² + 2n."""
    warps = threads // 32
    columns = n if head else n * n + 2 * n
    grad_pre_span = T.dynamic("grad_pre_span")
    grad_post_span = T.dynamic("grad_post_span")
    grad_comb_span = T.dynamic("grad_comb_span")
    mixes_span = T.dynamic("mixes_span")
    scale_span = T.dynamic("scale_span")
    base_span = T.dynamic("base_span")
    dmixes_span = T.dynamic("dmixes_span")
    partial_span = T.dynamic("partial_span")

    @T.prim_func
    def kernel(
        grad_pre: T.Tensor((grad_pre_span,), "float32"),
        grad_post: T.Tensor((grad_post_span,), "float32"),
        grad_comb: T.Tensor((grad_comb_span,), "float32"),
        mixes: T.Tensor((mixes_span,), "float32"),
        scale: T.Tensor((scale_span,), "float32"),
        base: T.Tensor((base_span,), "float32"),
        dmixes: T.Tensor((dmixes_span,), "float32"),
        partial: T.Tensor((partial_span,), "float32"),
        num_tokens: T.int32,
        grad_pre_token_stride: T.int32,
        grad_pre_column_stride: T.int32,
        grad_post_token_stride: T.int32,
        grad_post_column_stride: T.int32,
        grad_comb_token_stride: T.int32,
        grad_comb_source_stride: T.int32,
        grad_comb_destination_stride: T.int32,
        mixes_token_stride: T.int32,
        mixes_column_stride: T.int32,
        post_mult: T.float32,
        num_blocks: T.int32,
    ):
        with T.Kernel(num_blocks, threads=threads) as (block,):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            dz = T.alloc_local((columns,), "float32")
            sums = T.alloc_local((cta_sum_slots(2 * columns),), "float32")
            warp_sums = T.alloc_shared((warps * 2 * columns,), "float32")
            for k in T.unroll(cta_sum_slots(2 * columns)):
                sums[k] = T.float32(0)
            for round_ in T.serial(T.ceildiv(num_tokens, num_blocks * threads)):
                token = (round_ * num_blocks + block) * threads + tx
                t64 = T.cast(token, "int64")
                row = t64 * mixes_token_stride
                if token < num_tokens:
                    for j in T.unroll(n):
                        s = sigmoid(mixes[row + j * mixes_column_stride] * scale[0] + base[j])
                        dz[j] = grad_pre[t64 * grad_pre_token_stride + j * grad_pre_column_stride] * s * (1 - s)
                    if not head:
                        for j in T.unroll(n):
                            s = sigmoid(mixes[row + (n + j) * mixes_column_stride] * scale[1] + base[n + j])
                            g = grad_post[t64 * grad_post_token_stride + j * grad_post_column_stride]
                            dz[n + j] = g * post_mult * s * (1 - s)
                        for i in T.unroll(n):
                            for o in T.unroll(n):
                                dz[2 * n + i * n + o] = grad_comb[
                                    t64 * grad_comb_token_stride
                                    + i * grad_comb_source_stride
                                    + o * grad_comb_destination_stride
                                ]
                    for j in T.unroll(columns):
                        group = 0 if head else T.if_then_else(j < n, 0, T.if_then_else(j < 2 * n, 1, 2))
                        dmixes[t64 * columns + j] = dz[j] * scale[group]
                        sums[j] = sums[j] + dz[j] * mixes[row + j * mixes_column_stride]
                        sums[columns + j] = sums[columns + j] + dz[j]
            cta_sum(sums, warp_sums, lane, warp, 2 * columns, warps)
            if tx == 0:
                for k in T.unroll(2 * columns):
                    partial[T.cast(block, "int64") * (2 * columns) + k] = sums[k]

    return kernel


@T.macro
def group_sum(per_column, total, dscale, group: int, first: int, last: int):
    """``dscale[group] = Σ per_column[first:last]`` in column order (as the reference groups them)."""
    total[0] = per_column[first]
    for j in T.unroll(first + 1, last):
        total[0] = total[0] + per_column[j]
    dscale[group] = total[0]


@jit()
def parameter_grad_kernel(n: int, head: bool, threads: int = 64):
    """One CTA adds the partial rows in block order: ``dbase[j] = Σ_b Σdz``, the per-column
    ``Σ_b Σ dz·mixes``, and ``dscale[g]`` = the sum of its group's columns in column order."""
    columns = n if head else n * n + 2 * n
    partial_span = T.dynamic("partial_span")
    dscale_span = T.dynamic("dscale_span")
    dbase_span = T.dynamic("dbase_span")

    @T.prim_func
    def kernel(
        partial: T.Tensor((partial_span,), "float32"),
        dscale: T.Tensor((dscale_span,), "float32"),
        dbase: T.Tensor((dbase_span,), "float32"),
        num_blocks: T.int32,
    ):
        with T.Kernel(1, threads=threads) as (_,):
            tx = T.get_thread_binding()
            total = T.alloc_local((2,), "float32")
            per_column = T.alloc_shared((columns,), "float32")
            for part in T.serial(T.ceildiv(columns, threads)):
                column = part * threads + tx
                if column < columns:
                    total[0] = T.float32(0)
                    total[1] = T.float32(0)
                    for b in T.serial(num_blocks):
                        total[0] = total[0] + partial[T.cast(b, "int64") * (2 * columns) + column]
                        total[1] = total[1] + partial[T.cast(b, "int64") * (2 * columns) + columns + column]
                    per_column[column] = total[0]
                    dbase[column] = total[1]
            T.sync_threads()
            if tx == 0:
                group_sum(per_column, total, dscale, 0, 0, n)
                if not head:
                    group_sum(per_column, total, dscale, 1, n, 2 * n)
                    group_sum(per_column, total, dscale, 2, 2 * n, columns)

    return kernel


def _token_blocks(tokens: int) -> int:
    return min(PARTIAL_BLOCKS, ceil_div(tokens, TOKEN_THREADS))


def _split_plan(input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps):
    """Check an ``mhc_pre_split_mixes`` of these signatures and decide its launch; the plan:
    ``run(input_mixes, mhc_scale, mhc_base) -> (pre, post, comb)``."""
    n = check_split_inputs(input_mixes, mhc_scale, mhc_base, mhc_mult)
    post_mult = check_nonnegative_float("mhc_post_mult_value", mhc_post_mult_value)
    pre_eps = check_nonnegative_float("mhc_pre_eps", mhc_pre_eps)
    for name, tensor in (("input_mixes", input_mixes), ("mhc_scale", mhc_scale), ("mhc_base", mhc_base)):
        require_cuda(name, tensor)
    tokens = input_mixes.shape[0]
    device = input_mixes.device

    def allocate():
        pre = new_output(torch.empty((tokens, n), dtype=F32, device=device))
        post = new_output(torch.empty((tokens, n), dtype=F32, device=device))
        return pre, post, new_output(torch.empty((tokens, n, n), dtype=F32, device=device))

    if tokens == 0:
        return lambda *tensors: allocate()
    kernel = launched(split_kernel(n, False))
    scalars = (tokens, *input_mixes.stride(), post_mult, pre_eps)

    def run(input_mixes, mhc_scale, mhc_base):
        pre, post, comb = allocate()
        if kernel is not None:
            kernel(
                flat_view(input_mixes),
                flat_view(mhc_scale),
                flat_view(mhc_base),
                flat_view(pre),
                flat_view(post),
                flat_view(comb),
                *scalars,
            )
        return pre, post, comb

    return run


_SPLIT_PLANS = LaunchPlans(_split_plan)


def mhc_pre_split_mixes(
    input_mixes: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    mhc_mult: int,
    mhc_post_mult_value: float,
    mhc_pre_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the normed mixes into ``(pre [T, n], post [T, n], comb logits [T, n, n])`` (fp32, contiguous)."""
    arguments = (input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps)
    return _SPLIT_PLANS.plan(*arguments)(input_mixes, mhc_scale, mhc_base)


def _split_backward_plan(grads, mixes, scale, base, n: int, post_mult: float, head: bool):
    """The two stages of the split / head backward for these signatures (checked by the caller);
    the plan: ``run(grads, mixes, scale, base) -> (dmixes, dscale, dbase)``."""
    tokens, columns = mixes.shape
    scales = scale.shape[0]
    device = mixes.device

    def allocate():
        d_mixes = new_output(torch.empty((tokens, columns), dtype=F32, device=device))
        d_scale = new_output(torch.empty((scales,), dtype=F32, device=device))
        return d_mixes, d_scale, new_output(torch.empty((columns,), dtype=F32, device=device))

    if tokens == 0:

        def zero_parameter_gradients(*tensors):
            d_mixes, d_scale, d_base = allocate()
            return d_mixes, d_scale.zero_(), d_base.zero_()

        return zero_parameter_gradients
    blocks = _token_blocks(tokens)
    first = launched(split_bwd_kernel(n, head))
    second = launched(parameter_grad_kernel(n, head))
    grad_pre, grad_post, grad_comb = grads
    scalars = (
        tokens,
        *grad_pre.stride(),
        *grad_post.stride(),
        *grad_comb.stride(),
        *mixes.stride(),
        post_mult,
        blocks,
    )

    def run(grads, mixes, scale, base):
        d_mixes, d_scale, d_base = allocate()
        if first is None:
            return d_mixes, d_scale, d_base
        # Every CTA writes its whole row: no initialisation needed.
        partial = torch.empty((blocks * 2 * columns,), dtype=F32, device=device)
        grad_pre, grad_post, grad_comb = grads
        first(
            flat_view(grad_pre),
            flat_view(grad_post),
            flat_view(grad_comb),
            flat_view(mixes),
            flat_view(scale),
            flat_view(base),
            flat_view(d_mixes),
            partial,
            *scalars,
        )
        second(partial, flat_view(d_scale), flat_view(d_base), blocks)
        return d_mixes, d_scale, d_base

    return run


def _split_bwd_plan(grad_pre, grad_post, grad_comb, input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value):
    """Check an ``mhc_pre_split_mixes_bwd`` of these signatures; the plan: ``_split_backward_plan``'s."""
    n = check_split_inputs(input_mixes, mhc_scale, mhc_base, mhc_mult)
    tokens = input_mixes.shape[0]
    for name, value, shape in (
        ("grad_pre", grad_pre, (tokens, n)),
        ("grad_post", grad_post, (tokens, n)),
        ("grad_comb", grad_comb, (tokens, n, n)),
    ):
        check_tensor(name, value, dtypes=(F32,), ndim=len(shape))
        check_shape(name, value, shape)
    post_mult = check_nonnegative_float("mhc_post_mult_value", mhc_post_mult_value)
    for name, tensor in (("grad_pre", grad_pre), ("grad_post", grad_post), ("grad_comb", grad_comb)):
        require_cuda(name, tensor)
    for name, tensor in (("input_mixes", input_mixes), ("mhc_scale", mhc_scale), ("mhc_base", mhc_base)):
        require_cuda(name, tensor)
    grads = (grad_pre, grad_post, grad_comb)
    return _split_backward_plan(grads, input_mixes, mhc_scale, mhc_base, n, post_mult, head=False)


_SPLIT_BWD_PLANS = LaunchPlans(_split_bwd_plan)


def mhc_pre_split_mixes_bwd(
    grad_pre: torch.Tensor,
    grad_post: torch.Tensor,
    grad_comb: torch.Tensor,
    input_mixes: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    mhc_mult: int,
    mhc_post_mult_value: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Explicit backward of ``mhc_pre_split_mixes``: ``(dmixes [T, n² + 2n], dscale [3], dbase [n² + 2n])``."""
    arguments = (grad_pre, grad_post, grad_comb, input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value)
    plan = _SPLIT_BWD_PLANS.plan(*arguments)
    return plan((grad_pre, grad_post, grad_comb), input_mixes, mhc_scale, mhc_base)


def _head_plan(input_mix, mhc_scale, mhc_base, mhc_pre_eps):
    """Check an ``mhc_head_compute_mix`` of these signatures and decide its launch; the plan:
    ``run(input_mix, mhc_scale, mhc_base) -> out``."""
    tokens, n = check_head_inputs(input_mix, mhc_scale, mhc_base)
    pre_eps = check_nonnegative_float("mhc_pre_eps", mhc_pre_eps)
    for name, tensor in (("input_mix", input_mix), ("mhc_scale", mhc_scale), ("mhc_base", mhc_base)):
        require_cuda(name, tensor)
    device = input_mix.device

    def allocate():
        return new_output(torch.empty((tokens, n), dtype=F32, device=device))

    if tokens * n == 0:
        return lambda *tensors: allocate()
    kernel = launched(split_kernel(n, True))
    scalars = (tokens, *input_mix.stride(), 0.0, pre_eps)

    def run(input_mix, mhc_scale, mhc_base):
        out = allocate()
        if kernel is not None:
            # The post and comb outputs do not exist for the head: the kernel never touches them.
            flat_out = flat_view(out)
            kernel(
                flat_view(input_mix), flat_view(mhc_scale), flat_view(mhc_base), flat_out, flat_out, flat_out, *scalars
            )
        return out

    return run


_HEAD_PLANS = LaunchPlans(_head_plan)


def mhc_head_compute_mix(
    input_mix: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor, mhc_pre_eps: float
) -> torch.Tensor:
    """Head weights before the LM head: fp32 ``[T, n]`` ``σ(s·m + b) + pre_eps`` (``split_kernel``'s pre group)."""
    return _HEAD_PLANS.plan(input_mix, mhc_scale, mhc_base, mhc_pre_eps)(input_mix, mhc_scale, mhc_base)


def _head_bwd_plan(grad_output, input_mix, mhc_scale, mhc_base):
    """Check an ``mhc_head_compute_mix_bwd`` of these signatures; the plan: ``run(grad_output,
    input_mix, mhc_scale, mhc_base) -> (dmix, dscale, dbase)``."""
    tokens, n = check_head_inputs(input_mix, mhc_scale, mhc_base)
    check_tensor("grad_output", grad_output, dtypes=(F32,), ndim=2)
    check_shape("grad_output", grad_output, (tokens, n))
    for name, tensor in (("grad_output", grad_output), ("input_mix", input_mix), ("mhc_scale", mhc_scale)):
        require_cuda(name, tensor)
    require_cuda("mhc_base", mhc_base)
    device = input_mix.device
    if n == 0:

        def no_streams(*tensors):
            return (
                torch.empty((tokens, 0), dtype=F32, device=device),
                torch.zeros((1,), dtype=F32, device=device),  # a sum of no terms
                torch.empty((0,), dtype=F32, device=device),
            )

        return no_streams
    # The head has only the pre group: the post and comb gradients are never read (any fp32 tensor).
    grads = (grad_output, grad_output, grad_output.unsqueeze(-1))
    backward = _split_backward_plan(grads, input_mix, mhc_scale, mhc_base, n, 1.0, head=True)

    def run(grad_output, input_mix, mhc_scale, mhc_base):
        return backward((grad_output, grad_output, grad_output.unsqueeze(-1)), input_mix, mhc_scale, mhc_base)

    return run


_HEAD_BWD_PLANS = LaunchPlans(_head_bwd_plan)


def mhc_head_compute_mix_bwd(
    grad_output: torch.Tensor, input_mix: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Explicit backward: ``(dmix fp32 [T, n], dscale fp32 [1], dbase fp32 [n])``, parameters summed over tokens."""
    arguments = (grad_output, input_mix, mhc_scale, mhc_base)
    return _HEAD_BWD_PLANS.plan(*arguments)(*arguments)


def __getattr__(name: str):
    """The twins of ``_ELSEWHERE``, imported on first use."""
    if name in _ELSEWHERE:
        return getattr(importlib.import_module(f"{__package__}.{_ELSEWHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Optimized twin of the Engram family (contract §4): TileLang kernels for sm_90a / sm_100.

Same public names, argument order and results as ``tileproof.reference.engram`` (``engram_hash``
and ``fused_weight`` bit for bit; the gate within the oracle's stated bounds: its sums over D run
in another order than PyTorch's). The reference's module docstring states the math.

Kernel design (everything here is memory-bound):

- ``engram_hash``: one thread per output row (layer, token, column), coalesced int32 stores; N, M
  and every size are runtime values (one compiled kernel). The n-gram products wrap in 64-bit
  unsigned arithmetic (two's complement, no signed overflow), the XOR is reinterpreted as int64 and
  reduced with a floored modulo (C's ``%`` truncates; a negative remainder gets the table size added).
- ``fused_weight``: one thread per vector of ``w``; the product of two bf16 values is exact in fp32.
- ``engram_gate_fwd``: one CTA per token, all ``n`` streams; thread ``tx`` owns the 16-byte
  column vectors ``i·threads + tx``. x, k and v are read once (every load of the token in flight
  before any use), x and v stay in registers for ``out``. The ``3n`` sums over D (Σx², Σk²,
  Σx·w·k) are fp32: per thread, then a ``shfl_xor`` butterfly per warp, then the warps' partials
  through shared memory in warp order, so every thread holds the same totals and computes the
  statistics itself (no second barrier). Strides of x, k and v are runtime values (k and v may be
  views of one fused projection output); ``save_for_backward`` is a runtime switch.
- ``engram_gate_bwd``: one persistent CTA per token block of ``dw_partial`` (grid = P, whatever
  the SM count). Per token: grad_out, x, k and v are loaded, ``dv = Σ_m gate_m·go_m`` is stored at
  once, ``dg = Σ_d go·v`` is reduced like the forward's sums, then ``β``, ``dx`` and ``dk``. The
  block's ``Σ_t β·x⊙k`` accumulates in shared memory (each thread owns its columns, so no races
  and no atomics; ``n·D`` fp32 per CTA is too much for registers at D = 7168), in token order.
  The warps' ``dg`` partials go through two alternating slots of the same shared buffer, which
  makes one barrier per token enough. When the CTA's columns of w fit in shared memory next to
  that sum (n = 4: every D up to 7168), they are copied there once (the streamed rows would evict them
  from L1 at every token); otherwise they are read from L1 / L2 and the next token's grad_out and
  v are prefetched into registers (``load_token_rows``, the forward's per-token loads).
  Where two tokens' rows fit in shared memory (16-byte vectors, n ≤ 4, D ≤ 4096 at n = 4),
  ``gate_bwd_bulk_kernel`` takes over: thread 0 brings each token's rows in with bulk copies one
  token ahead (mbarrier-completed), every thread reads them from shared memory, and w and the
  block's sum stay in registers; same arithmetic in the same order.
- ``grad_w_reduce``: elementwise over ``[n, D]``, read as one row of ``n·D`` elements when the
  rows are back to back (16-byte vectors at any D, n = 4). A CTA per 32 column vectors; its 8 warps
  sum interleaved eighths of the P partials (4 loads in flight per thread), then warp 0 adds the 8
  partial sums in warp order, multiplies by the gains and updates the two accumulators in place.
  Nothing depends on the SM count; P = 0 launches nothing.

Vectors are 16 bytes wide when every row length, stride and base address allows it, narrower
otherwise (down to one element). Tensors need unit stride along their last dimension (the
reference's rule for the gate; for ``fused_weight`` and ``grad_w_reduce`` this twin asks it too,
``ValueError`` otherwise); the small ``[T, n]`` statistics of the backward and the hash's
parameter tables are made contiguous first (a no-op for the usual layouts).
"""

import tilelang
import tilelang.language as T
import torch

from tileproof.reference.contract import ceil_div, check_nonnegative_float, check_shape, check_tensor
from tileproof.reference.engram import (
    check_gate_bwd_inputs,
    check_gate_inputs,
    check_grad_kv,
    check_hash_inputs,
    check_unit_last_stride,
)

from .device import SHARED_MEMORY_BYTES
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
from .warp import halving_butterfly, halving_steps

__all__ = ["engram_hash", "fused_weight", "engram_gate_fwd", "engram_gate_bwd", "grad_w_reduce"]

_INT32_MAX = 2**31 - 1
HASH_THREADS = 128
WEIGHT_THREADS = 128
REDUCE_WARPS = 8  # P-slices of grad_w_reduce's CTA
REDUCE_UNROLL = 4  # partial loads in flight per thread
GATE_THREADS = 256
MAX_GATE_THREADS = 512


def gate_schedule(hidden: int, vector: int) -> tuple[int, int]:
    """(threads, column vectors per thread) of the gate kernels for a row of ``hidden`` elements.

    Two 16-byte columns per thread keep ~100 registers of x, k, v (and go) per thread, so that
    two 256-thread CTAs fit on an SM at D = 4096 (the forward's acceptance shape). Rows of up to
    512 columns all take that shape (small D leaves threads idle, which only costs small rows, and
    keeps the compiled configurations few); wider rows take whole warps of two columns each (448
    threads at D = 7168), and rows wider than 512 threads × 2 columns take more columns per thread.
    Columns past the row are masked.
    """
    columns = max(1, hidden // vector)
    if columns <= 2 * GATE_THREADS:
        return GATE_THREADS, 2
    per_thread = max(2, ceil_div(columns, MAX_GATE_THREADS))
    return min(MAX_GATE_THREADS, 32 * ceil_div(ceil_div(columns, per_thread), 32)), per_thread


def gate_bwd_schedule(hidden: int, vector: int) -> tuple[int, int]:
    """The backward's CTA shape. Each of its CTAs walks a block of tokens one by one (one ``dw_partial``
    row per CTA) with a CTA-wide sum per token on the critical path, and one CTA per SM (its rows take
    most of the registers), so a thread's work per token is what its warps' latency hides:

    - up to 256 columns (D ≤ 2048 at bf16): ``gate_schedule``'s 256 threads × 2;
    - up to 512 columns: one column per thread, whole warps (512 threads at D = 4096, 128 registers):
      against 256 × 2 (207 registers), T 4001 D 4096 with ``grad_kv``'s strided outputs 203.6 → 193.8 µs,
      the packed outputs 384.3 → 383.7 µs at T 8192 (H200);
    - wider rows: four columns per thread (224 threads at D = 7168): 950 µs against 1134 µs at 448 × 2
      (T 8192, H200), while the forward is fastest at 448 × 2 (407 µs against 668 µs at 224 × 4).
    """
    columns = max(1, hidden // vector)
    if columns <= GATE_THREADS:
        return gate_schedule(hidden, vector)
    if columns <= MAX_GATE_THREADS:
        return 32 * ceil_div(columns, 32), 1
    per_thread = max(4, ceil_div(columns, MAX_GATE_THREADS))
    return min(MAX_GATE_THREADS, 32 * ceil_div(ceil_div(columns, per_thread), 32)), per_thread


def gate_bwd_shared_floats(
    streams: int, vector: int, threads: int, columns_per_thread: int, weights_in_shared: bool
) -> tuple[int, int, int]:
    """Shared memory of ``gate_bwd_kernel`` in fp32 words: the dg exchange slots (two per warp and
    stream, padded to 32 bytes), the block's Σ β·x⊙k and, with ``weights_in_shared``, the CTA's
    columns of w."""
    exchange_floats = 8 * ceil_div(2 * (threads // 32) * streams, 8)
    accumulator_floats = columns_per_thread * streams * threads * vector
    return exchange_floats, accumulator_floats, accumulator_floats if weights_in_shared else 0


def _vector_width(width: int, max_vector: int, tensors) -> int:
    """Widest vector (elements, at most ``max_vector``) dividing ``width`` and every leading stride
    of ``tensors`` (of dimensions longer than 1), with every base address aligned to the vector's
    bytes (at most 16: wider fp32 vectors travel as several 16-byte accesses)."""

    def fits(vector: int) -> bool:
        return not width % vector and all(
            not address(t) % min(16, vector * t.element_size()) and not any(s % vector for s in _leading_strides(t))
            for t in tensors
        )

    vector = max_vector
    while vector > 1 and not fits(vector):
        vector //= 2
    return vector


def _leading_strides(tensor: torch.Tensor) -> list[int]:
    """The strides of every dimension but the last; 0 for a dimension of size 1 (its stride is
    irrelevant, so it never constrains the vector width)."""
    return [(s if size > 1 else 0) for size, s in zip(tensor.shape[:-1], tensor.stride()[:-1], strict=True)]


def _strides_in_vectors(tensor: torch.Tensor, vector: int) -> list[int]:
    return [s // vector for s in _leading_strides(tensor)]


# ---------------------------------------------------------------------------------------------
# Hash
# ---------------------------------------------------------------------------------------------


@jit()
def hash_kernel(threads: int = HASH_THREADS):
    """One kernel for every shape: N, M, layers, tokens and the ids' strides are runtime values.
    Grid: ``(ceil(T·C / threads), L)`` with ``C = (N-1)·M``; thread ``f`` of a layer computes row
    ``f`` of its ``[T, C]`` output (coalesced int32 stores). The parameter tables are contiguous,
    so ``vocab_sizes[l]`` flattened is indexed by the output column itself."""
    ids_span = T.dynamic("ids_span")
    multipliers_span = T.dynamic("multipliers_span")
    vocab_span = T.dynamic("vocab_span")
    offsets_span = T.dynamic("offsets_span")
    out_span = T.dynamic("out_span")

    @T.prim_func
    def kernel(
        ids: T.Tensor((ids_span,), "int32"),
        multipliers: T.Tensor((multipliers_span,), "int64"),
        vocab_sizes: T.Tensor((vocab_span,), "int32"),
        offsets: T.Tensor((offsets_span,), "int32"),
        out: T.Tensor((out_span,), "int32"),
        num_tokens: T.int32,
        num_layers: T.int32,
        max_ngram: T.int32,
        tables: T.int32,
        ids_row_stride: T.int32,
        ids_column_stride: T.int32,
    ):
        columns = (max_ngram - 1) * tables
        with T.Kernel(T.ceildiv(num_tokens * columns, threads), num_layers, threads=threads) as (part, layer):
            tx = T.get_thread_binding()
            flat = part * threads + tx
            mixed = T.alloc_local((1,), "uint64")
            if flat < num_tokens * columns:
                token = flat // columns
                column = flat % columns
                order = column // tables + 2  # the n-gram order n of this column
                ids_row = T.cast(token, "int64") * ids_row_stride
                # Unsigned products wrap modulo 2^64 exactly like two's-complement int64 ones,
                # without C's undefined signed overflow.
                mixed[0] = T.uint64(0)
                for i in T.serial(order):
                    token_id = ids[ids_row + i * ids_column_stride]
                    T.device_assert(token_id >= 0, "engram_hash: ngram_token_ids must be non-negative")
                    token_id_bits = T.cast(T.cast(token_id, "int64"), "uint64")
                    mixed[0] = mixed[0] ^ (token_id_bits * T.cast(multipliers[layer * max_ngram + i], "uint64"))
                size = T.cast(vocab_sizes[layer * columns + column], "int64")
                T.device_assert(size > 0, "engram_hash: vocab_sizes must be positive")
                T.device_assert(
                    T.cast(offsets[layer * columns + column], "int64") + size - 1 <= _INT32_MAX,
                    "engram_hash: offsets + vocab_sizes must fit in int32",
                )
                remainder = T.truncmod(T.reinterpret(mixed[0], "int64"), size)  # has the dividend's sign
                floored = T.if_then_else(remainder < 0, remainder + size, remainder)
                out[T.cast(layer, "int64") * num_tokens * columns + flat] = (
                    T.cast(floored, "int32") + offsets[layer * columns + column]
                )

    return kernel


def engram_hash(
    ngram_token_ids: torch.Tensor,
    multipliers: torch.Tensor,
    vocab_sizes: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Hashed n-gram ids → flat embedding-table rows; same contract as
    ``tileproof.reference.engram.engram_hash``, bit for bit (any strides of the ids). The value rules
    (ids non-negative, table sizes positive, ``offsets + vocab_sizes`` within int32) are not read back
    to the host, which would synchronize and break CUDA-graph capture: the kernel device-asserts them
    on every value it reads (with no tokens it reads none; the reference raises ``ValueError``)."""
    tokens, max_ngram, layers, tables = check_hash_inputs(ngram_token_ids, multipliers, vocab_sizes, offsets)
    require_cuda("ngram_token_ids", ngram_token_ids)

    columns = (max_ngram - 1) * tables
    out = new_output(torch.empty((layers, tokens, columns), dtype=torch.int32, device=ngram_token_ids.device))
    if out.numel() == 0:
        return out
    if tokens * columns > _INT32_MAX:
        raise ValueError(f"ngram_token_ids has too many tokens for the kernel's int32 indexing: {tokens}")
    kernel = hash_kernel()
    if compiling_only():
        return out
    kernel(
        flat_view(ngram_token_ids),
        multipliers.contiguous().reshape(-1),
        vocab_sizes.contiguous().reshape(-1),
        offsets.contiguous().reshape(-1),
        out.reshape(-1),
        tokens,
        layers,
        max_ngram,
        tables,
        ngram_token_ids.stride(0),
        ngram_token_ids.stride(1),
    )
    return out


# ---------------------------------------------------------------------------------------------
# Fused weight
# ---------------------------------------------------------------------------------------------


@jit()
def fused_weight_kernel(vector: int, threads: int = WEIGHT_THREADS):
    """Factory over the vector width; n, D and the gains' row strides (in vectors) are runtime
    values. Grid: ``(ceil(D / (threads·vector)), n)``."""
    wh_span = T.dynamic("wh_span")
    we_span = T.dynamic("we_span")
    w_span = T.dynamic("w_span")

    @T.prim_func
    def kernel(
        wh: T.Tensor((wh_span,), "bfloat16"),
        we: T.Tensor((we_span,), "bfloat16"),
        w: T.Tensor((w_span,), "float32"),
        num_streams: T.int32,
        hidden_vectors: T.int32,
        wh_row_stride: T.int32,
        we_row_stride: T.int32,
    ):
        with T.Kernel(T.ceildiv(hidden_vectors, threads), num_streams, threads=threads) as (part, stream):
            tx = T.get_thread_binding()
            column = part * threads + tx
            gain_h = T.alloc_local((vector,), "bfloat16")
            gain_e = T.alloc_local((vector,), "bfloat16")
            if column < hidden_vectors:
                for e in T.vectorized(vector):
                    gain_h[e] = wh[(stream * wh_row_stride + column) * vector + e]
                for e in T.vectorized(vector):
                    gain_e[e] = we[(stream * we_row_stride + column) * vector + e]
                for e in T.vectorized(vector):
                    w[(stream * hidden_vectors + column) * vector + e] = T.cast(gain_h[e], "float32") * T.cast(
                        gain_e[e], "float32"
                    )

    return kernel


def _fused_weight_plan(wh: torch.Tensor, we: torch.Tensor):
    """Check a ``fused_weight`` of these signatures and decide its launch; the plan: ``run(wh, we) -> w``."""
    check_tensor("wh", wh, dtypes=(torch.bfloat16,), ndim=2)
    check_tensor("we", we, dtypes=(torch.bfloat16,), ndim=2)
    check_shape("we", we, tuple(wh.shape))
    check_unit_last_stride("wh", wh)
    check_unit_last_stride("we", we)
    require_cuda("wh", wh)
    streams, hidden = wh.shape
    device = wh.device

    def allocate():
        return new_output(torch.empty((streams, hidden), dtype=torch.float32, device=device))

    if streams * hidden == 0:
        return lambda wh, we: allocate()
    vector = _vector_width(hidden, 8, (wh, we))
    kernel = launched(fused_weight_kernel(vector))
    scalars = (streams, hidden // vector, *_strides_in_vectors(wh, vector), *_strides_in_vectors(we, vector))

    def run(wh, we):
        w = allocate()
        if kernel is not None:
            kernel(flat_view(wh), flat_view(we), w.view(-1), *scalars)
        return w

    return run


_FUSED_WEIGHT_PLANS = LaunchPlans(_fused_weight_plan)


def fused_weight(wh: torch.Tensor, we: torch.Tensor) -> torch.Tensor:
    """``w = wh ⊙ we`` in fp32; same contract as ``tileproof.reference.engram.fused_weight``, bit
    for bit (the product of two bf16 values is exact). The gains need unit stride along D."""
    return _FUSED_WEIGHT_PLANS.plan(wh, we)(wh, we)


# ---------------------------------------------------------------------------------------------
# Gate: shared pieces
# ---------------------------------------------------------------------------------------------


@T.macro
def cta_sums(sums, exchange, slot, count: int, lane, warp, warps: int):
    """``sums[0:count]`` (this thread's fp32 partials) → the CTA's totals, in every thread: a
    ``shfl_xor`` butterfly per warp, then the warps' partials from ``exchange[slot, warp, :]`` in
    warp order (the same order, hence the same totals, in every thread), after one barrier."""
    for s in T.unroll(count):
        for step in T.unroll(5):
            sums[s] = sums[s] + T.shfl_xor(sums[s], 1 << step)
    if lane == 0:
        for s in T.unroll(count):
            exchange[(slot * warps + warp) * count + s] = sums[s]
    T.sync_threads()
    for s in T.unroll(count):
        sums[s] = exchange[slot * warps * count + s]
        for w in T.unroll(1, warps):
            sums[s] = sums[s] + exchange[(slot * warps + w) * count + s]


@T.macro
def cta_stream_totals(sums, total, exchange, slot, count: int, steps: int, lane, warp, warps: int):
    """``sums[0:2^steps]`` (this thread's fp32 partials of ``count`` streams, zero-padded) → in
    ``total[0]``, the CTA's total of stream ``lane % count``, in every lane of every warp.

    The bits are ``cta_sums``': each total is the same balanced tree over a warp's lanes (step j adds
    a lane's value and that of its partner at distance 2^j), then the warps' partials in warp order.
    But the warp sum is ``halving_butterfly``'s (partners at distance 1, 2, … 16): n = 4 streams cost
    6 shuffles instead of 20, lane l ends with its warp's total of stream l mod 2^steps, and each
    lane reads back its one stream's ``warps`` partials instead of every stream's."""
    halving_butterfly(sums, steps, lane, False)
    if lane < count:
        exchange[(slot * warps + warp) * count + lane] = sums[0]
    T.sync_threads()
    total[0] = exchange[slot * warps * count + lane % count]
    for w in T.unroll(1, warps):
        total[0] = total[0] + exchange[(slot * warps + w) * count + lane % count]


@T.macro
def load_token_statistics(dot, gate, rstd_x, rstd_k, token, lane, streams: int, gates, lane_statistics):
    """Token ``token``'s gates (every stream) into ``gates`` and the statistics of stream
    ``lane % n`` (dot, rstd_x, rstd_k, gate) into ``lane_statistics``."""
    for m in T.unroll(streams):
        gates[m] = gate[token * streams + m]
    lane_statistics[0] = dot[token * streams + lane % streams]
    lane_statistics[1] = rstd_x[token * streams + lane % streams]
    lane_statistics[2] = rstd_k[token * streams + lane % streams]
    lane_statistics[3] = gate[token * streams + lane % streams]


@T.macro
def stream_coefficients(
    lane_statistics,
    total,
    lane_results,
    betas,
    x_coefficients,
    k_coefficients,
    streams: int,
    hidden,
    scale,
    clamp_value,
):
    """β and the x and k coefficients of stream ``lane % n`` (from ``lane_statistics`` = its dot,
    rstd_x, rstd_k, gate and ``total[0]`` = its dg), then every stream's from its lane by shuffle: one
    chain of IEEE divisions and a square root per lane instead of n per thread."""
    dot_value = lane_statistics[0]
    rx = lane_statistics[1]
    rk = lane_statistics[2]
    lane_gate = lane_statistics[3]
    norms = rx * rk * scale  # ∂s/∂dot
    # β = 0 on the clamped branch; |dot| there may be 0, so the other branch divides by 1 instead (as
    # the reference's safe_dot).
    clamped = T.abs(dot_value) * norms < clamp_value
    safe_dot = T.if_then_else(clamped, T.float32(1), T.abs(dot_value))
    slope = total[0] * lane_gate * (T.float32(1) - lane_gate) * T.float32(0.5)
    lane_results[0] = T.if_then_else(clamped, T.float32(0), slope * T.sqrt(T.ieee_fdiv(norms, safe_dot)))
    lane_results[1] = T.ieee_fdiv(dot_value * rx * rx, hidden)
    lane_results[2] = T.ieee_fdiv(dot_value * rk * rk, hidden)
    for m in T.unroll(streams):
        betas[m] = T.shfl_sync(lane_results[0], m)
        x_coefficients[m] = T.shfl_sync(lane_results[1], m)
        k_coefficients[m] = T.shfl_sync(lane_results[2], m)


def _as_float(value):
    return T.cast(value, "float32")


@T.macro
def store_input_gradients(
    dx, dk, dx_offset, dk_offset, go, x, k, w, betas, x_coefficients, k_coefficients, m, vector: int
):
    """Stream ``m``'s vector of ``dx = go + β(w·k − c_x·x)`` and ``dk = β(w·x − c_k·k)`` (fp32, rounded
    once to bf16); ``go``, ``x``, ``k`` and ``w`` give element ``e`` of the thread's vectors."""
    for e in T.vectorized(vector):
        dx[dx_offset + e] = T.cast(
            _as_float(go(e)) + betas[m] * (w(e) * _as_float(k(e)) - x_coefficients[m] * _as_float(x(e))), "bfloat16"
        )
    for e in T.vectorized(vector):
        dk[dk_offset + e] = T.cast(
            betas[m] * (w(e) * _as_float(x(e)) - k_coefficients[m] * _as_float(k(e))), "bfloat16"
        )


@T.macro
def load_token_rows(
    streamed, single, tx, hidden_vectors, threads: int, columns_per_thread: int, streams: int, vector: int
):
    """One token's rows → registers, for this thread's columns ``i·threads + tx``: ``streamed`` is
    ``((tensor, values, row, stream_stride), ...)``, rows of ``n`` streams into ``values[i, m, :]``;
    ``single`` is ``(tensor, values, row)`` (one row shared by the streams, into ``values[i, :]``) or
    ``None``. Offsets are in vectors; per column the single row first, then per stream each streamed
    tensor in turn (the forward's x, k interleaved); every load is issued before any use. Masked
    columns (past the row) get zeros: they add nothing to a sum and are never stored. Shared by the
    forward (x, k, v) and the backward (grad_out, v)."""
    for i in T.unroll(columns_per_thread):
        column = i * threads + tx
        if column < hidden_vectors:
            if single is not None:
                for e in T.vectorized(vector):
                    single[1][i, e] = single[0][(single[2] + column) * vector + e]
            for m in T.unroll(streams):
                # Indexed, not unpacked: a buffer bound to a name here would take that name in the
                # generated code (the kernel's parameters included).
                for rows in streamed:
                    for e in T.vectorized(vector):
                        rows[1][i, m, e] = rows[0][(rows[2] + m * rows[3] + column) * vector + e]
        else:
            if single is not None:
                for e in T.vectorized(vector):
                    single[1][i, e] = T.cast(0, "bfloat16")
            for m in T.unroll(streams):
                for rows in streamed:
                    for e in T.vectorized(vector):
                        rows[1][i, m, e] = T.cast(0, "bfloat16")


# ---------------------------------------------------------------------------------------------
# Gate forward
# ---------------------------------------------------------------------------------------------


@jit()
def gate_fwd_kernel(streams: int, vector: int, threads: int, columns_per_thread: int):
    """Factory over n, the vector width and the CTA shape; T, D, every stride (in vectors),
    ``eps``, ``clamp_value`` and ``save_for_backward`` are runtime values. Grid: one CTA per token."""
    warps = threads // 32
    count = 3 * streams  # Σx², Σk², Σx·w·k per stream

    x_span = T.dynamic("x_span")
    k_span = T.dynamic("k_span")
    v_span = T.dynamic("v_span")
    w_span = T.dynamic("w_span")
    out_span = T.dynamic("out_span")
    stats_span = T.dynamic("stats_span")

    @T.prim_func
    def kernel(
        x: T.Tensor((x_span,), "bfloat16"),
        k: T.Tensor((k_span,), "bfloat16"),
        v: T.Tensor((v_span,), "bfloat16"),
        w: T.Tensor((w_span,), "float32"),
        out: T.Tensor((out_span,), "bfloat16"),
        dot_out: T.Tensor((stats_span,), "float32"),
        gate_out: T.Tensor((stats_span,), "float32"),
        rstd_x_out: T.Tensor((stats_span,), "float32"),
        rstd_k_out: T.Tensor((stats_span,), "float32"),
        num_tokens: T.int32,
        hidden_vectors: T.int32,
        x_token_stride: T.int32,
        x_stream_stride: T.int32,
        k_token_stride: T.int32,
        k_stream_stride: T.int32,
        v_token_stride: T.int32,
        w_stream_stride: T.int32,
        hidden: T.float32,
        scale: T.float32,
        eps: T.float32,
        clamp_value: T.float32,
        save: T.int32,
    ):
        with T.Kernel(num_tokens, threads=threads) as (token,):
            # At least 512 threads' worth of CTAs per SM (≤ 128 registers): the next token's loads
            # are in flight while a CTA reduces and stores.
            T.annotate_min_blocks_per_sm(max(1, 512 // threads))
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            xs = T.alloc_local((columns_per_thread, streams, vector), "bfloat16")
            ks = T.alloc_local((columns_per_thread, streams, vector), "bfloat16")
            vs = T.alloc_local((columns_per_thread, vector), "bfloat16")
            ws = T.alloc_local((vector,), "float32")
            sums = T.alloc_local((count,), "float32")
            gates = T.alloc_local((streams,), "float32")
            exchange = T.alloc_shared((warps * count,), "float32")

            x_row = T.cast(token, "int64") * x_token_stride
            k_row = T.cast(token, "int64") * k_token_stride
            v_row = T.cast(token, "int64") * v_token_stride

            # Every load of the token first (x, k, v: ~100 registers of 16-byte vectors in flight).
            load_token_rows(
                ((x, xs, x_row, x_stream_stride), (k, ks, k_row, k_stream_stride)),
                (v, vs, v_row),
                tx,
                hidden_vectors,
                threads,
                columns_per_thread,
                streams,
                vector,
            )

            for s in T.unroll(count):
                sums[s] = T.float32(0)
            for i in T.unroll(columns_per_thread):
                column = T.min(i * threads + tx, hidden_vectors - 1)  # masked columns: any w, x = 0
                for m in T.unroll(streams):
                    for e in T.vectorized(vector):
                        ws[e] = w[(m * w_stream_stride + column) * vector + e]
                    for e in T.unroll(vector):
                        x_value = _as_float(xs[i, m, e])
                        k_value = _as_float(ks[i, m, e])
                        sums[m] = sums[m] + x_value * x_value
                        sums[streams + m] = sums[streams + m] + k_value * k_value
                        # (x·w)·k as the reference: x·w is exact, the product by k rounds once.
                        sums[2 * streams + m] = sums[2 * streams + m] + x_value * ws[e] * k_value
            cta_sums(sums, exchange, 0, count, lane, warp, warps)

            for m in T.unroll(streams):
                rstd_x = T.rsqrt(T.ieee_fdiv(sums[m], hidden) + eps)
                rstd_k = T.rsqrt(T.ieee_fdiv(sums[streams + m], hidden) + eps)
                dot = sums[2 * streams + m]
                score = dot * rstd_x * rstd_k * scale
                root = T.sqrt(T.max(T.abs(score), clamp_value))
                # sign(±0) = ±0: s == 0 gives σ(0) = ½ exactly. A NaN s stays NaN (as torch.sign's),
                # so the gate is NaN, never a silent ½ (the root's fmaxf would drop the NaN).
                signed_root = T.if_then_else(
                    score > T.float32(0), root, T.if_then_else(score < T.float32(0), -root, score)
                )
                gates[m] = T.ieee_fdiv(T.float32(1), T.float32(1) + T.exp(-signed_root))
                if save != 0 and tx == 0:
                    dot_out[token * streams + m] = dot
                    gate_out[token * streams + m] = gates[m]
                    rstd_x_out[token * streams + m] = rstd_x
                    rstd_k_out[token * streams + m] = rstd_k

            out_row = T.cast(token, "int64") * streams * hidden_vectors
            for i in T.unroll(columns_per_thread):
                column = i * threads + tx
                if column < hidden_vectors:
                    for m in T.unroll(streams):
                        for e in T.vectorized(vector):
                            out[(out_row + m * hidden_vectors + column) * vector + e] = T.cast(
                                _as_float(xs[i, m, e]) + gates[m] * _as_float(vs[i, e]), "bfloat16"
                            )

    return kernel


def _gate_fwd_plan(x, k, v, w, eps, clamp_value, save_for_backward):
    """Check an ``engram_gate_fwd`` of these signatures and decide its launch; the plan:
    ``run(x, k, v, w) -> (out, dot, gate, rstd_x, rstd_k)`` (the statistics None unless saved)."""
    tokens, streams, hidden = check_gate_inputs(x, k, v, w)
    eps = check_nonnegative_float("eps", eps, allow_zero=True)
    clamp_value = check_nonnegative_float("clamp_value", clamp_value, allow_zero=False)
    if not isinstance(save_for_backward, bool):
        raise TypeError(f"save_for_backward must be a bool, got {type(save_for_backward).__name__}")
    require_cuda("x", x)
    device = x.device
    # Statistics not saved: the kernel's flag is off and it writes none of them (one empty constant).
    absent_stats = None if save_for_backward else device_constant(torch.float32, device, numel=0)

    def allocate():
        out = new_output(torch.empty((tokens, streams, hidden), dtype=torch.bfloat16, device=device))
        if not save_for_backward:
            return out, None, None, None, None
        return out, *(new_output(torch.empty((tokens, streams), dtype=torch.float32, device=device)) for _ in range(4))

    if tokens * streams * hidden == 0:
        return lambda x, k, v, w: allocate()
    vector = _vector_width(hidden, 8, (x, k, v, w))
    kernel = launched(gate_fwd_kernel(streams, vector, *gate_schedule(hidden, vector)))
    scalars = (
        tokens,
        hidden // vector,
        *_strides_in_vectors(x, vector),
        *_strides_in_vectors(k, vector),
        _strides_in_vectors(v, vector)[0],
        _strides_in_vectors(w, vector)[0],
        float(hidden),
        hidden**-0.5,
        eps,
        clamp_value,
        int(save_for_backward),
    )

    def run(x, k, v, w):
        results = allocate()
        if kernel is not None:
            stats = (stat.view(-1) for stat in results[1:]) if save_for_backward else (absent_stats,) * 4
            kernel(flat_view(x), flat_view(k), flat_view(v), flat_view(w), results[0].view(-1), *stats, *scalars)
        return results

    return run


_GATE_FWD_PLANS = LaunchPlans(_gate_fwd_plan)


def engram_gate_fwd(
    x: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    clamp_value: float,
    save_for_backward: bool = True,
):
    """Gate the shared value into every stream; same contract as
    ``tileproof.reference.engram.engram_gate_fwd`` (k and v may be strided views, e.g. of one fused
    projection output), within the oracle's bounds: the sums over D run in another order."""
    arguments = (x, k, v, w, eps, clamp_value, save_for_backward)
    return _GATE_FWD_PLANS.plan(*arguments)(x, k, v, w)


# ---------------------------------------------------------------------------------------------
# Gate backward
# ---------------------------------------------------------------------------------------------


# Z3's own arithmetic solver: with the faster one (jit.FAST_SOLVER) one configuration (n 4, vector
# 8, 256 threads, 2 columns per thread) loses a proof that a barrier is redundant and gains a
# __syncthreads(); the bit-vector setting alone changes none of this kernel's code.
@jit(solver={"smt.bv.solver": "2"})
def gate_bwd_kernel(
    streams: int,
    vector: int,
    threads: int,
    columns_per_thread: int,
    prefetch: bool = True,
    weights_in_shared: bool = False,
    packed_outputs: bool = True,
):
    """Factory over n, the vector width and the CTA shape; T, D, P, the block length and every
    stride (in vectors) are runtime values. Grid: one CTA per token block of ``dw_partial``.

    ``prefetch``: the next token's ``grad_out`` and ``v`` rows (what the row sums read first) are
    loaded while the current token is processed, so a CTA walking its block is not idle for a
    whole memory latency at each token (typically one CTA per SM: P = the SM count).

    ``weights_in_shared``: the CTA copies its columns of w to shared memory once, instead of
    reading them from L1 at every token, where the streamed rows (~100 KB per token) evict them
    to L2: 392.9 → 388.5 µs at T 8192, n 4, D 4096 (bit for bit; H200). Needs ``n·D`` more fp32 of
    shared memory (``gate_bwd_shared_floats``); the launcher keeps w in L1 when that does not fit.

    ``packed_outputs``: dk has dx's layout (``[T, n, D]`` contiguous) and dv is ``[T, D]`` contiguous,
    so their offsets are dx's and the row's (the token strides ``dk_token_stride`` and
    ``dv_token_stride`` are not read); otherwise (``grad_kv``'s views) each has its own token stride."""
    warps = threads // 32
    steps = halving_steps(streams)
    padded_streams = 1 << steps
    # One fp32 shared buffer: two alternating slots of the warps' dg partials, then the block's
    # Σ β·x⊙k (16-byte aligned) as [columns_per_thread, n, pieces, threads, piece]: a thread's
    # vector is split in 16-byte pieces, consecutive threads' pieces adjacent (no bank conflicts);
    # then, with ``weights_in_shared``, the thread's columns of w in the same layout.
    exchange_floats, accumulator_floats, weight_floats = gate_bwd_shared_floats(
        streams, vector, threads, columns_per_thread, weights_in_shared
    )
    piece = min(vector, 4)
    pieces = vector // piece

    def accumulator_offset(i, m, h, tx):
        return exchange_floats + (((i * streams + m) * pieces + h) * threads + tx) * piece

    def weight_offset(i, m, h, tx):
        return accumulator_offset(i, m, h, tx) + accumulator_floats

    go_span = T.dynamic("go_span")
    x_span = T.dynamic("x_span")
    k_span = T.dynamic("k_span")
    v_span = T.dynamic("v_span")
    w_span = T.dynamic("w_span")
    stats_span = T.dynamic("stats_span")
    dx_span = T.dynamic("dx_span")
    dk_span = T.dynamic("dk_span")
    dv_span = T.dynamic("dv_span")
    dw_span = T.dynamic("dw_span")

    @T.macro
    def copy_own_columns(dst, dst_index, src, src_index, tx, hidden_vectors):
        """``dst[dst_index(i, m, h, column) + e] = src[src_index(i, m, h, column) + e]`` for this
        thread's columns inside the row (``column = i·threads + tx``), every stream ``m`` and every
        16-byte piece ``h`` of a vector: w into shared memory, the block's sum out of it."""
        for i in T.unroll(columns_per_thread):
            column = i * threads + tx
            if column < hidden_vectors:
                for m in T.unroll(streams):
                    for h in T.unroll(pieces):
                        for e in T.vectorized(piece):
                            dst[dst_index(i, m, h, column) + e] = src[src_index(i, m, h, column) + e]

    @T.macro
    def load_gradient_rows(
        grad_out, v, gos, vs, token, tx, hidden_vectors, go_token_stride, go_stream_stride, v_token_stride
    ):
        """Token ``token``'s ``grad_out`` (n streams) and ``v`` rows → ``gos``, ``vs`` (the
        forward's per-token loads)."""
        go_row = T.cast(token, "int64") * go_token_stride
        v_row = T.cast(token, "int64") * v_token_stride
        load_token_rows(
            ((grad_out, gos, go_row, go_stream_stride),),
            (v, vs, v_row),
            tx,
            hidden_vectors,
            threads,
            columns_per_thread,
            streams,
            vector,
        )

    @T.prim_func
    def kernel(
        grad_out: T.Tensor((go_span,), "bfloat16"),
        x: T.Tensor((x_span,), "bfloat16"),
        k: T.Tensor((k_span,), "bfloat16"),
        v: T.Tensor((v_span,), "bfloat16"),
        w: T.Tensor((w_span,), "float32"),
        dot: T.Tensor((stats_span,), "float32"),
        gate: T.Tensor((stats_span,), "float32"),
        rstd_x: T.Tensor((stats_span,), "float32"),
        rstd_k: T.Tensor((stats_span,), "float32"),
        dx: T.Tensor((dx_span,), "bfloat16"),
        dk: T.Tensor((dk_span,), "bfloat16"),
        dv: T.Tensor((dv_span,), "bfloat16"),
        dw_partial: T.Tensor((dw_span,), "float32"),
        num_tokens: T.int32,
        num_blocks: T.int32,
        block_tokens: T.int32,
        hidden_vectors: T.int32,
        go_token_stride: T.int32,
        go_stream_stride: T.int32,
        x_token_stride: T.int32,
        x_stream_stride: T.int32,
        k_token_stride: T.int32,
        k_stream_stride: T.int32,
        v_token_stride: T.int32,
        w_stream_stride: T.int32,
        dk_token_stride: T.int32,
        dv_token_stride: T.int32,
        hidden: T.float32,
        scale: T.float32,
        clamp_value: T.float32,
    ):
        with T.Kernel(num_blocks, threads=threads) as (block,):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            gos = T.alloc_local((columns_per_thread, streams, vector), "bfloat16")
            xs = T.alloc_local((columns_per_thread, streams, vector), "bfloat16")
            ks = T.alloc_local((columns_per_thread, streams, vector), "bfloat16")
            vs = T.alloc_local((columns_per_thread, vector), "bfloat16")
            next_gos = T.alloc_local((columns_per_thread, streams, vector), "bfloat16")
            next_vs = T.alloc_local((columns_per_thread, vector), "bfloat16")
            ws = T.alloc_local((vector,), "float32")
            sums = T.alloc_local((padded_streams,), "float32")
            total = T.alloc_local((1,), "float32")
            gates = T.alloc_local((streams,), "float32")
            betas = T.alloc_local((streams,), "float32")
            # The statistics of stream lane % n: each lane computes one stream's β and coefficients.
            lane_statistics = T.alloc_local((4,), "float32")
            lane_results = T.alloc_local((3,), "float32")  # β, the x and the k coefficient
            x_coefficients = T.alloc_local((streams,), "float32")
            k_coefficients = T.alloc_local((streams,), "float32")
            dv_values = T.alloc_local((vector,), "float32")
            staged = T.alloc_local((vector,), "float32")
            shared = T.alloc_shared((exchange_floats + accumulator_floats + weight_floats,), "float32")

            for i in T.unroll(columns_per_thread):
                for m in T.unroll(streams):
                    for h in T.unroll(pieces):
                        for e in T.vectorized(piece):
                            shared[accumulator_offset(i, m, h, tx) + e] = T.float32(0)
            if weights_in_shared:
                copy_own_columns(
                    shared,
                    lambda i, m, h, column: weight_offset(i, m, h, tx),
                    w,
                    lambda i, m, h, column: (m * w_stream_stride + column) * vector + h * piece,
                    tx,
                    hidden_vectors,
                )

            first = T.min(block * block_tokens, num_tokens)
            last = T.min(first + block_tokens, num_tokens)
            if prefetch and first < last:
                load_gradient_rows(
                    grad_out,
                    v,
                    next_gos,
                    next_vs,
                    first,
                    tx,
                    hidden_vectors,
                    go_token_stride,
                    go_stream_stride,
                    v_token_stride,
                )
            for token in T.serial(first, last):
                x_row = T.cast(token, "int64") * x_token_stride
                k_row = T.cast(token, "int64") * k_token_stride
                if prefetch:
                    for i in T.unroll(columns_per_thread):
                        for e in T.unroll(vector):
                            vs[i, e] = next_vs[i, e]
                        for m in T.unroll(streams):
                            for e in T.unroll(vector):
                                gos[i, m, e] = next_gos[i, m, e]
                    if token + 1 < last:
                        load_gradient_rows(
                            grad_out,
                            v,
                            next_gos,
                            next_vs,
                            token + 1,
                            tx,
                            hidden_vectors,
                            go_token_stride,
                            go_stream_stride,
                            v_token_stride,
                        )
                else:
                    load_gradient_rows(
                        grad_out,
                        v,
                        gos,
                        vs,
                        token,
                        tx,
                        hidden_vectors,
                        go_token_stride,
                        go_stream_stride,
                        v_token_stride,
                    )
                for i in T.unroll(columns_per_thread):
                    column = i * threads + tx
                    if column < hidden_vectors:
                        for m in T.unroll(streams):
                            for e in T.vectorized(vector):
                                xs[i, m, e] = x[(x_row + m * x_stream_stride + column) * vector + e]
                            for e in T.vectorized(vector):
                                ks[i, m, e] = k[(k_row + m * k_stream_stride + column) * vector + e]
                # The token's statistics with its gates, at its start: loaded after the dg barrier,
                # their latency would sit on every token's critical path.
                load_token_statistics(dot, gate, rstd_x, rstd_k, token, lane, streams, gates, lane_statistics)

                # dv needs no reduction: store it while the dg partials travel.
                out_row = T.cast(token, "int64") * streams * hidden_vectors
                dk_row = T.cast(token, "int64") * (streams * hidden_vectors if packed_outputs else dk_token_stride)
                dv_row = T.cast(token, "int64") * (hidden_vectors if packed_outputs else dv_token_stride)
                for i in T.unroll(columns_per_thread):
                    column = i * threads + tx
                    if column < hidden_vectors:
                        for e in T.unroll(vector):
                            dv_values[e] = gates[0] * _as_float(gos[i, 0, e])
                            for m in T.unroll(1, streams):
                                dv_values[e] = dv_values[e] + gates[m] * _as_float(gos[i, m, e])
                        for e in T.vectorized(vector):
                            dv[(dv_row + column) * vector + e] = T.cast(dv_values[e], "bfloat16")

                for m in T.unroll(padded_streams):
                    sums[m] = T.float32(0)
                for i in T.unroll(columns_per_thread):
                    for m in T.unroll(streams):
                        for e in T.unroll(vector):
                            sums[m] = sums[m] + _as_float(gos[i, m, e]) * _as_float(vs[i, e])
                cta_stream_totals(sums, total, shared, token % 2, streams, steps, lane, warp, warps)

                stream_coefficients(
                    lane_statistics,
                    total,
                    lane_results,
                    betas,
                    x_coefficients,
                    k_coefficients,
                    streams,
                    hidden,
                    scale,
                    clamp_value,
                )

                for i in T.unroll(columns_per_thread):
                    column = i * threads + tx
                    if column < hidden_vectors:
                        for m in T.unroll(streams):
                            if weights_in_shared:
                                for h in T.unroll(pieces):
                                    for e in T.vectorized(piece):
                                        ws[h * piece + e] = shared[weight_offset(i, m, h, tx) + e]
                            else:
                                for e in T.vectorized(vector):
                                    ws[e] = w[(m * w_stream_stride + column) * vector + e]
                            dx_offset = (out_row + m * hidden_vectors + column) * vector
                            # Packed, dk's offset is dx's: no index arithmetic of its own (the kernel
                            # is bound by its instructions per token; the separate offset cost ~4 %).
                            dk_offset = dx_offset if packed_outputs else (dk_row + m * hidden_vectors + column) * vector
                            store_input_gradients(
                                dx,
                                dk,
                                dx_offset,
                                dk_offset,
                                lambda e, i=i, m=m: gos[i, m, e],
                                lambda e, i=i, m=m: xs[i, m, e],
                                lambda e, i=i, m=m: ks[i, m, e],
                                lambda e: ws[e],
                                betas,
                                x_coefficients,
                                k_coefficients,
                                m,
                                vector,
                            )
                            # Staged through registers: 16-byte shared accesses (and TileLang
                            # drops the load of a one-element vectorized read-modify-write).
                            for h in T.unroll(pieces):
                                for e in T.vectorized(piece):
                                    staged[h * piece + e] = shared[accumulator_offset(i, m, h, tx) + e]
                            for e in T.unroll(vector):
                                staged[e] = staged[e] + betas[m] * _as_float(xs[i, m, e]) * _as_float(ks[i, m, e])
                            for h in T.unroll(pieces):
                                for e in T.vectorized(piece):
                                    shared[accumulator_offset(i, m, h, tx) + e] = staged[h * piece + e]

            dw_row = T.cast(block, "int64") * streams * hidden_vectors
            copy_own_columns(
                dw_partial,
                lambda i, m, h, column: (dw_row + m * hidden_vectors + column) * vector + h * piece,
                shared,
                lambda i, m, h, column: accumulator_offset(i, m, h, tx),
                tx,
                hidden_vectors,
            )

    return kernel


BULK_VECTOR = 8  # bulk copies move whole 16-byte-aligned rows: bf16 vectors of 8


# Rows up to this many 16-byte columns take the bulk-copy backward. T 8192, n 4, P 132 on the H200,
# against the register kernel, bit for bit the same outputs: D 1024 172.5 → 122.6 µs, 1280
# 180.1 → 136.8, 2048 217.2 → 192.9, 2560 (320 columns) 249.2 → 240.4; but D 4096 (512 columns)
# 381.4 → 390.5, T 4001 191.8 → 196.9 (docs/performance.md, "A twelfth look").
GATE_BWD_BULK_MAX_COLUMNS = 320


def gate_bwd_bulk_threads(streams: int, hidden: int, vector: int) -> int:
    """The CTA size of ``gate_bwd_bulk_kernel`` for this row (one 16-byte column per thread, whole
    warps), or 0 where it does not apply: vectors narrower than 16 bytes (rows or strides not
    16-byte aligned: bulk copies need that), rows of more than ``GATE_BWD_BULK_MAX_COLUMNS``
    columns (slower there), more than 4 streams (w and the block's sum take 16·n registers per
    thread), or two stages that do not fit in shared memory."""
    columns = hidden // vector
    if vector != BULK_VECTOR or columns > GATE_BWD_BULK_MAX_COLUMNS or streams > 4:
        return 0
    threads = 32 * ceil_div(columns, 32)
    return threads if gate_bwd_bulk_shared_bytes(streams, threads) <= SHARED_MEMORY_BYTES else 0


def gate_bwd_bulk_shared_bytes(streams: int, threads: int) -> int:
    """Shared memory of ``gate_bwd_bulk_kernel``: two stages of one token's rows (grad_out, x, k:
    ``n`` rows each, and v) of ``threads · 8`` bf16, the dg exchange slots and four 8-byte mbarriers
    (each stage's ``full`` and ``released``)."""
    stage_elements = (3 * streams + 1) * threads * BULK_VECTOR
    exchange_floats = 8 * ceil_div(2 * (threads // 32) * streams, 8)
    return 2 * 2 * stage_elements + 4 * exchange_floats + 4 * 8


# Barriers by hand: TileLang's planner sees the bulk copies write the stages and would put two more
# __syncthreads() per token around them; the mbarriers and the dg barrier already order every access.
@jit(solver={"smt.bv.solver": "2"}, pass_configs={tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True})
def gate_bwd_bulk_kernel(streams: int, threads: int, packed_outputs: bool = True):
    """``gate_bwd_kernel`` with each token's rows brought into shared memory by bulk copies
    (``cp.async.bulk``, completing on an mbarrier) one token ahead, so that no thread issues a
    global load in the token loop and a token's loads never wait for the previous token's stores.
    One 16-byte column per thread (``threads · 8 ≥ D``); w and the block's Σ β·x⊙k live in
    registers (32 fp32 each at n = 4), since the two stages take the shared memory (130 KB at n 4,
    D 2560).

    Same arithmetic as ``gate_bwd_kernel(streams, 8, threads, 1)`` in the same order (the sums,
    the lanes' statistics, the token-ordered Σ β·x⊙k), so the same bits. At the start of token t
    thread 0 refills the other stage with token t + 1's ``3n + 1`` rows as soon as every thread has
    arrived on ``released`` for token t − 1 (it has read its last row of that stage): a token of
    lead. (Refilling after token t's dg barrier instead, where every thread is known done, measured
    up to 5 % slower at D ≤ 1280 and within 1 % elsewhere.)"""
    vector = BULK_VECTOR
    warps = threads // 32
    steps = halving_steps(streams)
    padded_streams = 1 << steps
    row = threads * vector  # elements of a staged row: the widest D this CTA shape serves
    go_offset, x_offset, k_offset, v_offset = 0, streams * row, 2 * streams * row, 3 * streams * row
    stage_elements = (3 * streams + 1) * row
    exchange_floats = 8 * ceil_div(2 * warps * streams, 8)

    go_span = T.dynamic("go_span")
    x_span = T.dynamic("x_span")
    k_span = T.dynamic("k_span")
    v_span = T.dynamic("v_span")
    w_span = T.dynamic("w_span")
    stats_span = T.dynamic("stats_span")
    dx_span = T.dynamic("dx_span")
    dk_span = T.dynamic("dk_span")
    dv_span = T.dynamic("dv_span")
    dw_span = T.dynamic("dw_span")

    @T.macro
    def bulk_copy(stages, stage_offset, source, source_offset, row_bytes, full, stage):
        # TileLang's own 1D bulk-copy intrinsic (what T.copy lowers a contiguous load to), with a
        # runtime length: T.copy would need the row length at compile time.
        T.tma_load(
            stages.access_ptr("w", offset=stage_offset),
            source.access_ptr("r", offset=source_offset),
            full[stage],
            row_bytes,
            0,
        )

    @T.macro
    def issue(stages, full, grad_out, x, k, v, token, stage, row_bytes, token_bytes, strides):
        """Token ``token``'s rows → stage ``stage``, completing on ``full[stage]`` (thread 0 only)."""
        (
            go_token_stride,
            go_stream_stride,
            x_token_stride,
            x_stream_stride,
            k_token_stride,
            k_stream_stride,
            v_token_stride,
        ) = strides
        base = stage * stage_elements
        go_row = T.cast(token, "int64") * go_token_stride
        x_row = T.cast(token, "int64") * x_token_stride
        k_row = T.cast(token, "int64") * k_token_stride
        T.mbarrier_arrive_expect_tx(full[stage], token_bytes)
        for m in T.unroll(streams):
            bulk_copy(
                stages,
                base + go_offset + m * row,
                grad_out,
                (go_row + m * go_stream_stride) * vector,
                row_bytes,
                full,
                stage,
            )
            bulk_copy(
                stages, base + x_offset + m * row, x, (x_row + m * x_stream_stride) * vector, row_bytes, full, stage
            )
            bulk_copy(
                stages, base + k_offset + m * row, k, (k_row + m * k_stream_stride) * vector, row_bytes, full, stage
            )
        bulk_copy(stages, base + v_offset, v, T.cast(token, "int64") * v_token_stride * vector, row_bytes, full, stage)

    @T.prim_func
    def kernel(
        grad_out: T.Tensor((go_span,), "bfloat16"),
        x: T.Tensor((x_span,), "bfloat16"),
        k: T.Tensor((k_span,), "bfloat16"),
        v: T.Tensor((v_span,), "bfloat16"),
        w: T.Tensor((w_span,), "float32"),
        dot: T.Tensor((stats_span,), "float32"),
        gate: T.Tensor((stats_span,), "float32"),
        rstd_x: T.Tensor((stats_span,), "float32"),
        rstd_k: T.Tensor((stats_span,), "float32"),
        dx: T.Tensor((dx_span,), "bfloat16"),
        dk: T.Tensor((dk_span,), "bfloat16"),
        dv: T.Tensor((dv_span,), "bfloat16"),
        dw_partial: T.Tensor((dw_span,), "float32"),
        num_tokens: T.int32,
        num_blocks: T.int32,
        block_tokens: T.int32,
        hidden_vectors: T.int32,
        go_token_stride: T.int32,
        go_stream_stride: T.int32,
        x_token_stride: T.int32,
        x_stream_stride: T.int32,
        k_token_stride: T.int32,
        k_stream_stride: T.int32,
        v_token_stride: T.int32,
        w_stream_stride: T.int32,
        dk_token_stride: T.int32,
        dv_token_stride: T.int32,
        hidden: T.float32,
        scale: T.float32,
        clamp_value: T.float32,
    ):
        with T.Kernel(num_blocks, threads=threads) as (block,):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            stages = T.alloc_shared((2 * stage_elements,), "bfloat16")
            exchange = T.alloc_shared((exchange_floats,), "float32")
            full = T.alloc_barrier([1, 1])
            # Each thread arrives once it has read its last row of a token's stage.
            released = T.alloc_barrier([threads, threads])
            ws = T.alloc_local((streams, vector), "float32")
            accumulators = T.alloc_local((streams, vector), "float32")
            go_values = T.alloc_local((vector,), "bfloat16")
            x_values = T.alloc_local((vector,), "bfloat16")
            k_values = T.alloc_local((vector,), "bfloat16")
            v_values = T.alloc_local((vector,), "bfloat16")
            sums = T.alloc_local((padded_streams,), "float32")
            total = T.alloc_local((1,), "float32")
            gates = T.alloc_local((streams,), "float32")
            next_gates = T.alloc_local((streams,), "float32")
            betas = T.alloc_local((streams,), "float32")
            lane_statistics = T.alloc_local((4,), "float32")
            next_lane_statistics = T.alloc_local((4,), "float32")
            lane_results = T.alloc_local((3,), "float32")
            x_coefficients = T.alloc_local((streams,), "float32")
            k_coefficients = T.alloc_local((streams,), "float32")
            dv_values = T.alloc_local((vector,), "float32")

            column = tx
            row_bytes = hidden_vectors * (vector * 2)
            token_bytes = row_bytes * (3 * streams + 1)
            first = T.min(block * block_tokens, num_tokens)
            last = T.min(first + block_tokens, num_tokens)

            strides = (
                go_token_stride,
                go_stream_stride,
                x_token_stride,
                x_stream_stride,
                k_token_stride,
                k_stream_stride,
                v_token_stride,
            )
            if tx == 0:
                if first < last:
                    issue(stages, full, grad_out, x, k, v, first, 0, row_bytes, token_bytes, strides)
                if first + 1 < last:
                    issue(stages, full, grad_out, x, k, v, first + 1, 1, row_bytes, token_bytes, strides)
            for m in T.unroll(streams):
                for e in T.unroll(vector):
                    ws[m, e] = T.float32(0)
                    accumulators[m, e] = T.float32(0)
            if column < hidden_vectors:
                for m in T.unroll(streams):
                    for e in T.vectorized(vector):
                        ws[m, e] = w[(m * w_stream_stride + column) * vector + e]
            if first < last:
                load_token_statistics(dot, gate, rstd_x, rstd_k, first, lane, streams, next_gates, next_lane_statistics)

            for token in T.serial(first, last):
                local = token - first
                stage = local % 2
                base = stage * stage_elements
                for m in T.unroll(streams):
                    gates[m] = next_gates[m]
                for s in T.unroll(4):
                    lane_statistics[s] = next_lane_statistics[s]
                # The statistics come from global memory: the next token's are loaded a token ahead.
                if token + 1 < last:
                    load_token_statistics(
                        dot, gate, rstd_x, rstd_k, token + 1, lane, streams, next_gates, next_lane_statistics
                    )
                T.mbarrier_wait_parity(full[stage], (local // 2) % 2)
                if tx == 0 and local >= 1 and token + 1 < last:
                    # The previous token's stage, as soon as every thread has read it: a token of lead.
                    T.mbarrier_wait_parity(released[1 - stage], ((local - 1) // 2) % 2)
                    issue(stages, full, grad_out, x, k, v, token + 1, 1 - stage, row_bytes, token_bytes, strides)

                out_row = T.cast(token, "int64") * streams * hidden_vectors
                dk_row = T.cast(token, "int64") * (streams * hidden_vectors if packed_outputs else dk_token_stride)
                dv_row = T.cast(token, "int64") * (hidden_vectors if packed_outputs else dv_token_stride)
                for m in T.unroll(padded_streams):
                    sums[m] = T.float32(0)
                if column < hidden_vectors:
                    for e in T.vectorized(vector):
                        v_values[e] = stages[base + v_offset + column * vector + e]
                    for m in T.unroll(streams):
                        for e in T.vectorized(vector):
                            go_values[e] = stages[base + go_offset + m * row + column * vector + e]
                        for e in T.unroll(vector):
                            if m == 0:
                                dv_values[e] = gates[0] * _as_float(go_values[e])
                            else:
                                dv_values[e] = dv_values[e] + gates[m] * _as_float(go_values[e])
                            sums[m] = sums[m] + _as_float(go_values[e]) * _as_float(v_values[e])
                    for e in T.vectorized(vector):
                        dv[(dv_row + column) * vector + e] = T.cast(dv_values[e], "bfloat16")
                cta_stream_totals(sums, total, exchange, local % 2, streams, steps, lane, warp, warps)

                stream_coefficients(
                    lane_statistics,
                    total,
                    lane_results,
                    betas,
                    x_coefficients,
                    k_coefficients,
                    streams,
                    hidden,
                    scale,
                    clamp_value,
                )

                if column < hidden_vectors:
                    for m in T.unroll(streams):
                        for e in T.vectorized(vector):
                            go_values[e] = stages[base + go_offset + m * row + column * vector + e]
                        for e in T.vectorized(vector):
                            x_values[e] = stages[base + x_offset + m * row + column * vector + e]
                        for e in T.vectorized(vector):
                            k_values[e] = stages[base + k_offset + m * row + column * vector + e]
                        dx_offset = (out_row + m * hidden_vectors + column) * vector
                        dk_offset = dx_offset if packed_outputs else (dk_row + m * hidden_vectors + column) * vector
                        store_input_gradients(
                            dx,
                            dk,
                            dx_offset,
                            dk_offset,
                            lambda e: go_values[e],
                            lambda e: x_values[e],
                            lambda e: k_values[e],
                            lambda e, m=m: ws[m, e],
                            betas,
                            x_coefficients,
                            k_coefficients,
                            m,
                            vector,
                        )
                        for e in T.unroll(vector):
                            accumulators[m, e] = accumulators[m, e] + betas[m] * _as_float(x_values[e]) * _as_float(
                                k_values[e]
                            )
                T.mbarrier_arrive(released[stage])

            if column < hidden_vectors:
                dw_row = T.cast(block, "int64") * streams * hidden_vectors
                for m in T.unroll(streams):
                    for e in T.vectorized(vector):
                        dw_partial[(dw_row + m * hidden_vectors + column) * vector + e] = accumulators[m, e]

    return kernel


def _gate_bwd_plan(grad_out, x, k, v, w, dot, gate, rstd_x, rstd_k, clamp_value, num_partials, grad_kv):
    """Check an ``engram_gate_bwd`` of these signatures and decide its launch; the plan:
    ``run(grad_out, x, k, v, w, dot, gate, rstd_x, rstd_k, grad_kv) -> (dx, dk, dv, dw_partial)``."""
    clamp_value = check_gate_bwd_inputs(grad_out, x, k, v, w, dot, gate, rstd_x, rstd_k, clamp_value, num_partials)
    tokens, streams, hidden = x.shape
    if streams > 32:
        raise ValueError(f"x must have at most 32 streams (dimension 1) for the optimized backward, got {streams}")
    require_cuda("x", x)
    if grad_kv is not None:
        check_grad_kv(grad_kv, tokens, streams, hidden)
        require_cuda("grad_kv", grad_kv)
    device = x.device

    def allocate(grad_kv):
        dx = new_output(torch.empty((tokens, streams, hidden), dtype=torch.bfloat16, device=device))
        if grad_kv is None:
            dk = new_output(torch.empty((tokens, streams, hidden), dtype=torch.bfloat16, device=device))
            dv = new_output(torch.empty((tokens, hidden), dtype=torch.bfloat16, device=device))
        else:
            dk, dv = _kv_gradients(grad_kv, streams, hidden)
        dw_partial = new_output(torch.empty((num_partials, streams, hidden), dtype=torch.float32, device=device))
        return dx, dk, dv, dw_partial

    if num_partials * streams * hidden == 0:
        return lambda *tensors: allocate(tensors[-1])
    # With no token every block is empty: the kernel still runs, to write the zeros. dk and dv
    # inside grad_kv have the strides and alignment its signature fixes.
    if grad_kv is None:
        dk, dv = _meta_gradients(tokens, streams, hidden)
    else:
        dk, dv = _kv_gradients(grad_kv, streams, hidden)
    vector = _vector_width(hidden, 8, (grad_out, x, k, v, w, dk, dv))
    bulk_threads = gate_bwd_bulk_threads(streams, hidden, vector)
    if bulk_threads:
        kernel = gate_bwd_bulk_kernel(streams, bulk_threads, packed_outputs=grad_kv is None)
    else:
        threads, columns_per_thread = gate_bwd_schedule(hidden, vector)
        shared_floats = gate_bwd_shared_floats(streams, vector, threads, columns_per_thread, weights_in_shared=True)
        weights_in_shared = 4 * sum(shared_floats) <= SHARED_MEMORY_BYTES
        # With w in shared memory the next token's rows are better loaded in turn than prefetched
        # (387.3 against 388.5 µs at T 8192, n 4, D 4096, P 132, H200; the prefetch's 40 registers).
        kernel = gate_bwd_kernel(
            streams,
            vector,
            threads,
            columns_per_thread,
            prefetch=not weights_in_shared,
            weights_in_shared=weights_in_shared,
            packed_outputs=grad_kv is None,
        )
    kernel = launched(kernel)
    scalars = (
        tokens,
        num_partials,
        ceil_div(tokens, num_partials),
        hidden // vector,
        *_strides_in_vectors(grad_out, vector),
        *_strides_in_vectors(x, vector),
        *_strides_in_vectors(k, vector),
        _strides_in_vectors(v, vector)[0],
        _strides_in_vectors(w, vector)[0],
        _strides_in_vectors(dk, vector)[0],
        _strides_in_vectors(dv, vector)[0],
        float(hidden),
        hidden**-0.5,
        clamp_value,
    )

    def run(grad_out, x, k, v, w, dot, gate, rstd_x, rstd_k, grad_kv):
        dx, dk, dv, dw_partial = allocate(grad_kv)
        if kernel is not None:
            kernel(
                flat_view(grad_out),
                flat_view(x),
                flat_view(k),
                flat_view(v),
                flat_view(w),
                dot.contiguous().view(-1),
                gate.contiguous().view(-1),
                rstd_x.contiguous().view(-1),
                rstd_k.contiguous().view(-1),
                dx.view(-1),
                flat_view(dk),
                flat_view(dv),
                dw_partial.view(-1),
                *scalars,
            )
        return dx, dk, dv, dw_partial

    return run


def _kv_gradients(grad_kv: torch.Tensor, streams: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dk ``[T, n, D]`` and dv ``[T, D]``: the views of the fused projection's gradient."""
    return grad_kv[:, : streams * hidden].unflatten(1, (streams, hidden)), grad_kv[:, streams * hidden :]


def _meta_gradients(tokens: int, streams: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dk and dv as the backward allocates them without ``grad_kv`` (contiguous; their vector
    width depends on strides only: fresh allocations are 16-byte aligned), on the meta device."""
    dk = torch.empty((tokens, streams, hidden), dtype=torch.bfloat16, device="meta")
    return dk, torch.empty((tokens, hidden), dtype=torch.bfloat16, device="meta")


_GATE_BWD_PLANS = LaunchPlans(_gate_bwd_plan)


def engram_gate_bwd(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    dot: torch.Tensor,
    gate: torch.Tensor,
    rstd_x: torch.Tensor,
    rstd_k: torch.Tensor,
    clamp_value: float,
    *,
    num_partials: int = 1,
    grad_kv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Explicit backward of ``engram_gate_fwd``; same contract as
    ``tileproof.reference.engram.engram_gate_bwd`` (block ``p`` of ``dw_partial`` owns tokens
    ``[p·c, (p+1)·c)``, ``c = ceil(T / P)``, for any P), within the oracle's bounds.

    ``grad_kv`` (optional): the fused projection's gradient buffer, as in the reference; the kernel
    writes dk and dv straight into it, so a caller whose k and v are views of one tensor gets that
    tensor's gradient without autograd's zero fill and slice copies.

    At most 32 streams (n ≤ 32; ``ValueError`` otherwise): one lane per stream finishes its sums."""
    arguments = (grad_out, x, k, v, w, dot, gate, rstd_x, rstd_k, clamp_value, num_partials, grad_kv)
    plan = _GATE_BWD_PLANS.plan(*arguments)
    return plan(grad_out, x, k, v, w, dot, gate, rstd_x, rstd_k, grad_kv)


# ---------------------------------------------------------------------------------------------
# Weight-gradient reduction
# ---------------------------------------------------------------------------------------------


@jit()
def grad_w_reduce_kernel(vector: int, warps: int = REDUCE_WARPS, unroll: int = REDUCE_UNROLL):
    """Factory over the vector width (fp32 elements); P, n, D and every row stride (in vectors)
    are runtime values. Grid: ``(ceil(D / (32·vector)), n)``; warp ``w`` sums the partials
    ``p ≡ w (mod warps)``, ``unroll`` loads in flight at a time."""
    threads = 32 * warps

    dw_span = T.dynamic("dw_span")
    wh_span = T.dynamic("wh_span")
    we_span = T.dynamic("we_span")
    grad_wh_span = T.dynamic("grad_wh_span")
    grad_we_span = T.dynamic("grad_we_span")

    @T.prim_func
    def kernel(
        dw_partial: T.Tensor((dw_span,), "float32"),
        wh: T.Tensor((wh_span,), "bfloat16"),
        we: T.Tensor((we_span,), "bfloat16"),
        grad_wh: T.Tensor((grad_wh_span,), "float32"),
        grad_we: T.Tensor((grad_we_span,), "float32"),
        num_partials: T.int32,
        num_streams: T.int32,
        hidden_vectors: T.int32,
        dw_partial_stride: T.int32,
        dw_stream_stride: T.int32,
        wh_stream_stride: T.int32,
        we_stream_stride: T.int32,
        grad_wh_stream_stride: T.int32,
        grad_we_stream_stride: T.int32,
    ):
        with T.Kernel(T.ceildiv(hidden_vectors, 32), num_streams, threads=threads) as (part, stream):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            column = part * 32 + lane
            loaded = T.alloc_local((unroll, vector), "float32")
            total = T.alloc_local((vector,), "float32")
            gain_h = T.alloc_local((vector,), "bfloat16")
            gain_e = T.alloc_local((vector,), "bfloat16")
            accumulated_h = T.alloc_local((vector,), "float32")
            accumulated_e = T.alloc_local((vector,), "float32")
            exchange = T.alloc_shared((threads * vector,), "float32")

            for e in T.unroll(vector):
                total[e] = T.float32(0)
            if column < hidden_vectors:
                for batch in T.serial(T.ceildiv(num_partials, warps * unroll)):
                    for u in T.unroll(unroll):
                        partial = (batch * unroll + u) * warps + warp
                        if partial < num_partials:
                            offset = T.cast(partial, "int64") * dw_partial_stride + stream * dw_stream_stride + column
                            for e in T.vectorized(vector):
                                loaded[u, e] = dw_partial[offset * vector + e]
                        else:
                            for e in T.vectorized(vector):
                                loaded[u, e] = T.float32(0)
                    for u in T.unroll(unroll):
                        for e in T.unroll(vector):
                            total[e] = total[e] + loaded[u, e]
            for e in T.vectorized(vector):
                exchange[tx * vector + e] = total[e]
            T.sync_threads()

            if warp == 0 and column < hidden_vectors:
                for e in T.unroll(vector):
                    total[e] = exchange[lane * vector + e]
                    for w in T.unroll(1, warps):
                        total[e] = total[e] + exchange[(w * 32 + lane) * vector + e]
                for e in T.vectorized(vector):
                    gain_h[e] = wh[(stream * wh_stream_stride + column) * vector + e]
                for e in T.vectorized(vector):
                    gain_e[e] = we[(stream * we_stream_stride + column) * vector + e]
                for e in T.vectorized(vector):
                    accumulated_h[e] = grad_wh[(stream * grad_wh_stream_stride + column) * vector + e]
                for e in T.vectorized(vector):
                    accumulated_e[e] = grad_we[(stream * grad_we_stream_stride + column) * vector + e]
                # w = wh ⊙ we: the chain rule gives each gain the other one as its factor.
                for e in T.vectorized(vector):
                    grad_wh[(stream * grad_wh_stream_stride + column) * vector + e] = accumulated_h[e] + total[
                        e
                    ] * _as_float(gain_e[e])
                for e in T.vectorized(vector):
                    grad_we[(stream * grad_we_stream_stride + column) * vector + e] = accumulated_e[e] + total[
                        e
                    ] * _as_float(gain_h[e])

    return kernel


def _grad_w_reduce_plan(dw_partial, wh, we, grad_wh, grad_we):
    """Check a ``grad_w_reduce`` of these signatures and decide its launch; the plan:
    ``run(dw_partial, wh, we, grad_wh, grad_we)`` (in place, returns None)."""
    check_tensor("dw_partial", dw_partial, dtypes=(torch.float32,), ndim=3)
    check_tensor("wh", wh, dtypes=(torch.bfloat16,), ndim=2)
    streams, hidden = wh.shape
    check_shape("dw_partial", dw_partial, (dw_partial.shape[0], streams, hidden))
    check_tensor("we", we, dtypes=(torch.bfloat16,), ndim=2)
    check_shape("we", we, (streams, hidden))
    for name, value in (("grad_wh", grad_wh), ("grad_we", grad_we)):
        check_tensor(name, value, dtypes=(torch.float32,), ndim=2)
        check_shape(name, value, (streams, hidden))
    for name, value in (("dw_partial", dw_partial), ("wh", wh), ("we", we), ("grad_wh", grad_wh), ("grad_we", grad_we)):
        check_unit_last_stride(name, value)
    require_cuda("grad_wh", grad_wh)

    num_partials = dw_partial.shape[0]
    if num_partials == 0 or grad_wh.numel() == 0:
        return lambda *tensors: None  # G = 0: nothing is added
    tensors = (dw_partial, wh, we, grad_wh, grad_we)
    if all(streams == 1 or t.stride(-2) == hidden for t in tensors):
        # Rows back to back: the op is elementwise over [n, D], so one row of n·D elements (n = 4
        # makes it a multiple of 4: 16-byte vectors at any D). Each tensor spans the same elements
        # either way, so the launch passes the given tensors flat.
        dw_partial, wh, we, grad_wh, grad_we = (
            t.as_strided((*t.shape[:-2], 1, streams * hidden), (*t.stride()[:-2], streams * hidden, 1)) for t in tensors
        )
        streams, hidden = 1, streams * hidden
    vector = _vector_width(hidden, 4, (dw_partial, wh, we, grad_wh, grad_we))
    kernel = launched(grad_w_reduce_kernel(vector))
    scalars = (
        num_partials,
        streams,
        hidden // vector,
        *_strides_in_vectors(dw_partial, vector),
        *_strides_in_vectors(wh, vector),
        *_strides_in_vectors(we, vector),
        *_strides_in_vectors(grad_wh, vector),
        *_strides_in_vectors(grad_we, vector),
    )

    def run(dw_partial, wh, we, grad_wh, grad_we):
        if kernel is not None:
            kernel(
                flat_view(dw_partial), flat_view(wh), flat_view(we), flat_view(grad_wh), flat_view(grad_we), *scalars
            )

    return run


_REDUCE_PLANS = LaunchPlans(_grad_w_reduce_plan)


def grad_w_reduce(
    dw_partial: torch.Tensor,
    wh: torch.Tensor,
    we: torch.Tensor,
    grad_wh: torch.Tensor,
    grad_we: torch.Tensor,
) -> None:
    """``G = Σ_p dw_partial[p]``, then ``grad_wh += G ⊙ we`` and ``grad_we += G ⊙ wh`` in place;
    same contract as ``tileproof.reference.engram.grad_w_reduce`` (any P, P = 0 included), within
    the oracle's bound. Every tensor needs unit stride along D."""
    arguments = (dw_partial, wh, we, grad_wh, grad_we)
    _REDUCE_PLANS.plan(*arguments)(*arguments)

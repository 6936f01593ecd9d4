"""Index bookkeeping of the MoE family (contract §2): weights, counts, masks and the token→expert layout.

Six public operators, each the optimized twin of the function of the same name in
``tileproof.reference.moe`` (same signature, same validation messages, integer results bit for bit,
``normalize_weight`` and ``aux_fi`` bit for bit too: a fixed sequence of IEEE fp32 operations).

Kernel design:

- ``normalize_weight``: one thread per token holds the token's ``k`` weights in registers (16-byte
  loads and stores when the row allows), sums them left to right from fp32(1e-20) and divides
  each by the sum with a correctly rounded division. One launch, nothing else: the 16384×8
  benchmark is launch-bound.
- Counting (``group_count``, ``aux_fi`` and step 1 of ``get_fused_mapping``) never uses a global
  atomic and never needs a zeroed buffer. The flat slots ``t · k + j`` are cut into *chunks* of
  ``threads · rounds`` consecutive slots, one CTA each; a CTA counts its chunk per expert in shared
  memory and writes the whole row of counts (zeros included) to an expert-major scratch
  ``counts[e, chunk]``. A second kernel, one warp per expert, sums (and, for the mapping, scans)
  that row in chunk order. Integer sums do not depend on the order anyway; the chunk order is what
  makes the *ranks* below deterministic.
- ``get_fused_mapping`` is three kernels and no host synchronisation (unless the exact size is
  asked for): (1) the chunk counts above; (2) per expert, an exclusive scan over chunks (each
  chunk's first rank inside the expert), the count and the aligned size; (3) the placement: each
  CTA re-reads its chunk, whose slots each warp owns ``rounds`` rounds of 32 in flat order. A
  round's rank among equal experts is ``popc(match_any(e) & lanes below)``; per-warp counters in
  shared memory carry it across rounds, an exclusive prefix over the warps in flat order (seeded by
  the chunk's base from kernel 2 and the expert's segment start) across warps. So a pair's position
  is ``expert_start[e]`` + pairs of ``e`` in earlier chunks + in earlier warps of the chunk + in
  earlier rounds + in earlier lanes: ascending flat index inside every segment, whatever the grid.
  Segment starts are an exclusive scan of the aligned sizes that every CTA of kernel 3 recomputes
  (a few hundred integers), so no fourth launch is needed; CTA 0 writes ``expert_start`` and
  ``expert_end``. The padding positions (segment tails and everything past the last segment) are
  written by kernel 3 too: every one of the ``P`` positions is written exactly once.
- Experts are processed in tiles of ``capacity`` (shared-memory counters), so any number of
  experts works; up to ``capacity`` experts (512 by default) take one tile.
- ``mask_indices_by_tp`` is elementwise (16-byte vectors over a contiguous input, strided element
  access otherwise); ``inplace_unique_group_indices`` one thread per row (a bit set of the groups
  seen when ``num_groups <= 64``, else a re-read of the row's earlier slots).

Index validation: arguments (types, shapes, ranges of the Python ints) are checked on the host with
the reference's messages. The *values* of index tensors are checked on the device
(``device_assert``: an entry out of range stops the kernel with a CUDA assertion) instead of the
reference's ``ValueError``, which needs a host synchronisation. The same holds for
``get_fused_mapping``'s ``num_expanded_tokens`` when it is positive but smaller than the aligned
total: the placement kernel device-asserts (and never writes past ``P`` meanwhile); checking it on
the host would cost the synchronisation that a given size exists to avoid.
"""

import struct

import tilelang.language as T
import torch

from tileproof.reference.contract import ceil_div, check_bool, check_int
from tileproof.reference.moe import (
    MAPPING_DTYPE,
    WEIGHT_EPSILON,
    check_indices,
    check_scores,
)

from ..jit import (
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

__all__ = [
    "normalize_weight",
    "group_count",
    "aux_fi",
    "mask_indices_by_tp",
    "inplace_unique_group_indices",
    "get_fused_mapping",
]

# fp32(1e-20) as bits: the start value of every weight denominator, exactly the reference's fill.
WEIGHT_EPSILON_BITS = struct.unpack("<i", struct.pack("<f", WEIGHT_EPSILON))[0]
NORMALIZE_THREADS = 128
# Counting and placement: a CTA owns THREADS · ROUNDS consecutive slots (see mapping_schedule);
# experts in tiles of EXPERT_TILE shared-memory counters (every expert count of the contract's
# workloads in one tile).
MAP_THREADS = 256
MAP_ROUNDS = 2
EXPERT_TILE = 512
TOTALS_THREADS = 256
ELEMENT_THREADS = 256
ROW_THREADS = 128
# Rows of num_groups <= this keep the groups seen as the bits of one 64-bit word.
BITSET_GROUPS = 64

# What expert_totals_kernel writes: the mapping's bases, counts and aligned sizes; plain counts;
# or the load-balance frequency.
MODE_MAPPING, MODE_COUNT, MODE_FREQUENCY = 0, 1, 2

_TL_INDEX_DTYPES = {torch.int32: "int32", torch.int64: "int64"}


# ---------------------------------------------------------------------------------------------
# normalize_weight
# ---------------------------------------------------------------------------------------------


def row_vector(num_topk: int) -> int:
    """Elements per vector of a contiguous row of ``num_topk`` fp32 weights (16 bytes at most)."""
    return 4 if num_topk % 4 == 0 else 2 if num_topk % 2 == 0 else 1


@jit()
def normalize_weight_kernel(num_topk: int, threads: int = NORMALIZE_THREADS):
    """One thread per token. ``vectorized`` (a uniform runtime flag, so one compiled kernel per k):
    rows are read as ``row_vector(k)``-element vectors at ``row_stride_vectors`` vectors apart and
    the output is contiguous; otherwise element by element through any strides of both tensors."""
    vector = row_vector(num_topk)
    slots = max(num_topk, 1)
    row_vectors = num_topk // vector

    w_span = T.dynamic("w_span")
    den_span = T.dynamic("den_span")
    out_span = T.dynamic("out_span")

    @T.prim_func
    def kernel(
        weights: T.Tensor((w_span,), "float32"),
        den: T.Tensor((den_span,), "float32"),
        normalized: T.Tensor((out_span,), "float32"),
        num_tokens: T.int32,
        vectorized: T.int32,
        row_stride_vectors: T.int32,
        row_stride: T.int32,
        column_stride: T.int32,
        out_row_stride: T.int32,
        out_column_stride: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, threads), threads=threads) as (block,):
            tx = T.get_thread_binding()
            row = block * threads + tx
            values = T.alloc_local((slots,), "float32")
            total = T.alloc_local((1,), "float32")
            if row < num_tokens:
                if vectorized != 0:
                    w_row = T.cast(row, "int64") * row_stride_vectors * vector
                    for v in T.unroll(row_vectors):
                        for e in T.vectorized(vector):
                            values[v * vector + e] = weights[w_row + v * vector + e]
                else:
                    for j in T.unroll(num_topk):
                        values[j] = weights[T.cast(row, "int64") * row_stride + T.cast(j, "int64") * column_stride]
                # Left to right from fp32(1e-20): the reference's k roundings, in its order.
                total[0] = T.reinterpret(T.int32(WEIGHT_EPSILON_BITS), "float32")
                for j in T.unroll(num_topk):
                    total[0] = total[0] + values[j]
                for j in T.unroll(num_topk):
                    values[j] = T.ieee_fdiv(values[j], total[0])
                if vectorized != 0:
                    out_row = T.cast(row, "int64") * num_topk
                    for v in T.unroll(row_vectors):
                        for e in T.vectorized(vector):
                            normalized[out_row + v * vector + e] = values[v * vector + e]
                else:
                    for j in T.unroll(num_topk):
                        out = T.cast(row, "int64") * out_row_stride + T.cast(j, "int64") * out_column_stride
                        normalized[out] = values[j]
                den[row] = total[0]

    return kernel


def _normalize_weight_plan(topk_weights: torch.Tensor):
    """Check a ``normalize_weight`` of this signature and decide its launch; the plan:
    ``run(topk_weights) -> (den, normalized)``."""
    check_scores("topk_weights", topk_weights, ndim=2)
    require_cuda("topk_weights", topk_weights)
    num_tokens, num_topk = topk_weights.shape
    device = topk_weights.device

    def allocate(topk_weights):
        den = new_output(torch.empty(num_tokens, dtype=torch.float32, device=device))
        return den, new_output(torch.empty_like(topk_weights))

    if num_tokens == 0:
        return allocate
    kernel = launched(normalize_weight_kernel(num_topk))
    vector = row_vector(num_topk)
    row_stride, column_stride = _strides(topk_weights)
    normalized_like = torch.empty_like(topk_weights, device="meta")  # the output's strides
    out_row_stride, out_column_stride = _strides(normalized_like)
    vectorized = (
        column_stride == 1
        and row_stride % vector == 0
        and address(topk_weights) % (4 * vector) == 0
        and normalized_like.is_contiguous()
    )
    scalars = (
        num_tokens,
        int(vectorized),
        row_stride // vector,
        row_stride,
        column_stride,
        out_row_stride,
        out_column_stride,
    )

    def run(topk_weights):
        den, normalized = allocate(topk_weights)
        if kernel is not None:
            kernel(flat_view(topk_weights), den, flat_view(normalized), *scalars)
        return den, normalized

    return run


_NORMALIZE_PLANS = LaunchPlans(_normalize_weight_plan)


def normalize_weight(topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Divide each token's top-k weights by their sum (``tileproof.reference.moe.normalize_weight``,
    bit for bit): ``den`` fp32 ``[T]`` and the normalized weights fp32 ``[T, k]`` in the layout of
    an elementwise result (``torch.empty_like``: a dense input's strides, else contiguous)."""
    plan = _NORMALIZE_PLANS.plan(topk_weights)
    return plan(topk_weights)


# ---------------------------------------------------------------------------------------------
# Counting in chunks: expert_histogram_kernel, expert_totals_kernel
# ---------------------------------------------------------------------------------------------


def _lanes_below(lane):
    """The bits of the lanes before ``lane`` in its warp (uint32)."""
    return T.shift_left(T.uint32(1), T.cast(lane, "uint32")) - T.uint32(1)


def _check_capacity(capacity: int, threads: int) -> None:
    """Each thread clears and writes ``capacity / threads`` counters of a tile (a static count)."""
    if capacity % threads or threads % 32:
        raise ValueError(f"capacity ({capacity}) must be a multiple of threads ({threads}), a multiple of 32")


def _chunk_loader(index_dtype: str, threads: int, rounds: int):
    """A macro loading a chunk's slots: lane ``l`` of warp ``w``, round ``r`` takes the chunk's slot
    ``(w · rounds + r) · 32 + l`` (flat order: warp by warp, round by round, lane by lane). An entry
    in ``[0, E)`` is an expert; anything else (padding, a slot past the end) becomes -1."""
    chunk_slots = threads * rounds

    @T.macro
    def load_chunk(
        x, experts, chunk, warp, lane, num_slots, num_topk, row_stride, column_stride, num_experts, padding_floor, check
    ):
        for r in T.unroll(rounds):
            flat = chunk * chunk_slots + (warp * rounds + r) * 32 + lane
            # num_topk is 0 only when there are no slots: the division then never matters.
            token = flat // T.max(num_topk, 1)
            address = T.cast(token, "int64") * row_stride + T.cast(flat - token * num_topk, "int64") * column_stride
            raw = T.if_then_else(flat < num_slots, x[address], T.cast(-1, index_dtype))
            if check:
                # Out-of-range entries stop the kernel (the reference raises ValueError on the host).
                T.device_assert(raw < num_experts and raw >= padding_floor, no_stack_info=True)
            experts[r] = T.if_then_else(raw >= 0 and raw < num_experts, T.cast(raw, "int32"), -1)

    return load_chunk


@jit()
def expert_histogram_kernel(
    index_dtype: str, threads: int = MAP_THREADS, rounds: int = MAP_ROUNDS, capacity: int = EXPERT_TILE
):
    """CTA ``c`` counts the experts of chunk ``c`` and writes ``counts[e · num_chunks + c]`` for every
    expert ``e`` (zeros included). ``padding_floor``: the smallest entry allowed (-1, or the most
    negative value of the dtype when every negative entry is padding)."""
    _check_capacity(capacity, threads)
    load_chunk = _chunk_loader(index_dtype, threads, rounds)

    x_span = T.dynamic("x_span")
    counts_span = T.dynamic("counts_span")

    @T.prim_func
    def kernel(
        x: T.Tensor((x_span,), index_dtype),
        counts: T.Tensor((counts_span,), "int32"),
        num_slots: T.int32,
        num_topk: T.int32,
        row_stride: T.int64,
        column_stride: T.int64,
        num_experts: T.int32,
        num_chunks: T.int32,
        padding_floor: T.int64,
    ):
        with T.Kernel(num_chunks, threads=threads) as (chunk,):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            experts = T.alloc_local((rounds,), "int32")
            tile_counts = T.alloc_shared((capacity,), "int32")
            load_chunk(
                x,
                experts,
                chunk,
                warp,
                lane,
                num_slots,
                num_topk,
                row_stride,
                column_stride,
                num_experts,
                padding_floor,
                True,
            )
            for tile in T.serial(T.ceildiv(num_experts, capacity)):
                first = tile * capacity
                width = T.min(capacity, num_experts - first)
                for i in T.unroll(capacity // threads):
                    tile_counts[i * threads + tx] = 0
                T.sync_threads()
                for r in T.unroll(rounds):
                    local = experts[r] - first
                    same = T.match_any_sync(experts[r])
                    # One shared atomic per group of equal experts in the round (its lowest lane).
                    if local >= 0 and local < width and (same & _lanes_below(lane)) == T.uint32(0):
                        T.atomic_add(tile_counts[local], T.cast(T.popcount(same), "int32"))
                T.sync_threads()
                for i in T.unroll(capacity // threads):
                    if i * threads + tx < width:
                        counts[T.cast(first + i * threads + tx, "int64") * num_chunks + chunk] = tile_counts[
                            i * threads + tx
                        ]
                T.sync_threads()

    return kernel


@jit()
def expert_totals_kernel(threads: int = TOTALS_THREADS):
    """One warp per expert sums its row of chunk counts in chunk order.

    ``mode``: MODE_MAPPING rewrites the row in place as exclusive prefix sums (each chunk's first
    rank inside the expert) and writes ``totals[e]`` and the aligned size ``sizes[e]``; MODE_COUNT
    writes ``totals[e]``; MODE_FREQUENCY writes ``frequency[e] = fl32(fp32(count · E) /
    fp32(denominator))`` (0 when the denominator is 0, i.e. no tokens).
    """
    warps = threads // 32

    counts_span = T.dynamic("counts_span")
    totals_span = T.dynamic("totals_span")
    sizes_span = T.dynamic("sizes_span")
    frequency_span = T.dynamic("frequency_span")

    @T.prim_func
    def kernel(
        counts: T.Tensor((counts_span,), "int32"),
        totals: T.Tensor((totals_span,), "int32"),
        sizes: T.Tensor((sizes_span,), "int32"),
        frequency: T.Tensor((frequency_span,), "float32"),
        num_experts: T.int32,
        num_chunks: T.int32,
        alignment: T.int64,
        denominator: T.int64,
        mode: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_experts, warps), threads=threads) as (block,):
            tx = T.get_thread_binding()
            lane = tx % 32
            expert = block * warps + tx // 32
            carry = T.alloc_local((1,), "int32")
            inclusive = T.alloc_local((1,), "int32")
            carry[0] = 0
            if expert < num_experts:
                row = T.cast(expert, "int64") * num_chunks
                for b in T.serial(T.ceildiv(num_chunks, 32)):
                    c = b * 32 + lane
                    value = T.if_then_else(c < num_chunks, counts[row + c], 0)
                    inclusive[0] = value
                    for step in T.unroll(5):
                        from_below = T.shfl_up(inclusive[0], 1 << step)
                        if lane >= (1 << step):
                            inclusive[0] = inclusive[0] + from_below
                    if mode == MODE_MAPPING and c < num_chunks:
                        counts[row + c] = carry[0] + inclusive[0] - value
                    carry[0] = carry[0] + T.shfl_sync(inclusive[0], 31)
                if lane == 0:
                    if mode != MODE_FREQUENCY:
                        totals[expert] = carry[0]
                    if mode == MODE_MAPPING:
                        aligned = (T.cast(carry[0], "int64") + alignment - 1) // alignment * alignment
                        sizes[expert] = T.cast(aligned, "int32")
                    if mode == MODE_FREQUENCY:
                        # Both products exact in int64, each converted to fp32 once, one division.
                        numerator = T.cast(T.cast(carry[0], "int64") * num_experts, "float32")
                        quotient = T.ieee_fdiv(numerator, T.cast(denominator, "float32"))
                        frequency[expert] = T.if_then_else(denominator == 0, T.float32(0), quotient)

    return kernel


def mapping_schedule(num_slots: int) -> dict:
    """Threads and rounds of 32 slots per thread of the counting and placement kernels: a CTA owns
    ``threads · rounds`` consecutive slots. Each CTA of the placement kernel pays a fixed cost (the
    scan of the aligned sizes, its bases), so chunks are not tiny; 512 slots give 128 CTAs for
    DeepSeek-V3's 8192 tokens × top-8, all resident at once."""
    return {"threads": MAP_THREADS, "rounds": MAP_ROUNDS}


def _chunks(num_slots: int, threads: int = MAP_THREADS, rounds: int = MAP_ROUNDS) -> int:
    """Chunks of ``threads · rounds`` slots; at least one, so that the per-expert results of an
    empty input are still written by the kernels."""
    return max(1, ceil_div(num_slots, threads * rounds))


def _strides(tensor: torch.Tensor) -> tuple[int, int]:
    """Row and column strides of a 2-D tensor in elements (a single row or column has no stride)."""
    rows, columns = tensor.shape
    row_stride = tensor.stride(0) if rows > 1 else columns
    column_stride = tensor.stride(1) if columns > 1 else 1
    return row_stride, column_stride


def _count(indices: torch.Tensor, num_experts: int, padding_floor: int, totals, frequency, denominator: int, mode: int):
    """Chunk counts of ``indices`` over ``num_experts``, then the per-expert results of ``mode``."""
    num_tokens, num_topk = indices.shape
    schedule = mapping_schedule(num_tokens * num_topk)
    chunks = _chunks(num_tokens * num_topk, **schedule)
    histogram = expert_histogram_kernel(_TL_INDEX_DTYPES[indices.dtype], **schedule)
    totals_kernel = expert_totals_kernel()
    if compiling_only():
        return
    counts = torch.empty(num_experts * chunks, dtype=torch.int32, device=indices.device)
    row_stride, column_stride = _strides(indices)
    histogram(
        flat_view(indices),
        counts,
        num_tokens * num_topk,
        num_topk,
        row_stride,
        column_stride,
        num_experts,
        chunks,
        padding_floor,
    )
    placeholder = device_constant(torch.int32, indices.device, numel=0)
    totals_kernel(counts, totals, placeholder, frequency, num_experts, chunks, 1, denominator, mode)


INT64_MIN = -(2**63)


def group_count(group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Histogram of group indices, int32 ``[num_groups]`` (``tileproof.reference.moe.group_count``);
    negative entries are padding, entries ``>= num_groups`` device-assert."""
    check_indices("group_idx", group_idx)
    check_int("num_groups", num_groups, low=1)
    require_cuda("group_idx", group_idx)
    out = new_output(torch.empty(num_groups, dtype=torch.int32, device=group_idx.device))
    placeholder = device_constant(torch.float32, group_idx.device, numel=0)
    _count(group_idx, num_groups, INT64_MIN, out, placeholder, 0, MODE_COUNT)
    return out


def aux_fi(topk_idx: torch.Tensor, num_experts: int, num_aux_topk: int) -> torch.Tensor:
    """The load-balance frequency ``f_e = fl32(fp32(count_e · E) / fp32(T · num_aux_topk))``, fp32
    ``[E]``, zeros for ``T = 0`` (``tileproof.reference.moe.aux_fi``, bit for bit); entries outside
    ``[-1, E)`` device-assert."""
    check_indices("topk_idx", topk_idx)
    check_int("num_experts", num_experts, low=1)
    check_int("num_aux_topk", num_aux_topk, low=1)
    require_cuda("topk_idx", topk_idx)
    out = new_output(torch.empty(num_experts, dtype=torch.float32, device=topk_idx.device))
    placeholder = device_constant(torch.int32, topk_idx.device, numel=0)
    denominator = topk_idx.shape[0] * num_aux_topk
    _count(topk_idx, num_experts, -1, placeholder, out, denominator, MODE_FREQUENCY)
    return out


# ---------------------------------------------------------------------------------------------
# mask_indices_by_tp, inplace_unique_group_indices
# ---------------------------------------------------------------------------------------------


@jit()
def mask_indices_kernel(index_dtype: str, threads: int = ELEMENT_THREADS):
    """Elementwise re-indexing, ``vector`` entries (16 bytes) per thread. ``vectorized`` (a uniform
    runtime flag): input and output contiguous and 16-byte aligned, read and written as vectors (a
    partial last vector element by element); otherwise element by element through both tensors'
    strides."""
    vector = 4 if index_dtype == "int32" else 2
    x_span = T.dynamic("x_span")
    out_span = T.dynamic("out_span")

    @T.macro
    def remap(values, e, n, per_rank, num_tp_ranks, tp_rank):
        value = values[e]
        T.device_assert(value < n, no_stack_info=True)
        # Operands are non-negative: truncating divisions are the floor divisions of the contract.
        expert = T.max(value, T.cast(0, index_dtype))
        rank = T.truncdiv(expert, per_rank)
        dp = T.truncdiv(rank, num_tp_ranks)
        keep = value >= 0 and rank - dp * num_tp_ranks == tp_rank
        values[e] = T.if_then_else(keep, dp * per_rank + (expert - rank * per_rank), T.cast(-1, index_dtype))

    @T.prim_func
    def kernel(
        x: T.Tensor((x_span,), index_dtype),
        out: T.Tensor((out_span,), index_dtype),
        num_elements: T.int64,
        vectorized: T.int32,
        num_topk: T.int64,
        row_stride: T.int64,
        column_stride: T.int64,
        out_row_stride: T.int64,
        out_column_stride: T.int64,
        n: T.int64,
        per_rank: T.int64,
        num_tp_ranks: T.int64,
        tp_rank: T.int64,
    ):
        with T.Kernel(T.ceildiv(T.ceildiv(num_elements, vector), threads), threads=threads) as (block,):
            tx = T.get_thread_binding()
            values = T.alloc_local((vector,), index_dtype)
            first = (T.cast(block, "int64") * threads + tx) * vector
            if vectorized != 0 and first + vector <= num_elements:
                for e in T.vectorized(vector):
                    values[e] = x[first + e]
                for e in T.unroll(vector):
                    remap(values, e, n, per_rank, num_tp_ranks, tp_rank)
                for e in T.vectorized(vector):
                    out[first + e] = values[e]
            else:
                for e in T.unroll(vector):
                    if first + e < num_elements:
                        token = (first + e) // num_topk
                        slot = first + e - token * num_topk
                        values[e] = x[token * row_stride + slot * column_stride]
                        remap(values, e, n, per_rank, num_tp_ranks, tp_rank)
                        out[token * out_row_stride + slot * out_column_stride] = values[e]

    return kernel


def mask_indices_by_tp(
    indices: torch.Tensor, n: int, num_ep_ranks: int, tp_rank: int, num_tp_ranks: int
) -> torch.Tensor:
    """Keep the experts of tensor-parallel rank ``tp_rank``, renumbered locally; everything else -1
    (``tileproof.reference.moe.mask_indices_by_tp``). A new tensor, same dtype and shape (and the
    layout ``torch.empty_like`` gives); entries ``>= n`` device-assert."""
    check_indices("indices", indices)
    check_int("n", n, low=1)
    check_int("num_ep_ranks", num_ep_ranks, low=1)
    check_int("num_tp_ranks", num_tp_ranks, low=1)
    check_int("tp_rank", tp_rank, low=0, high=num_tp_ranks - 1)
    if n % num_ep_ranks:
        raise ValueError(f"n must be a multiple of num_ep_ranks ({num_ep_ranks}), got {n}")
    require_cuda("indices", indices)
    out = new_output(torch.empty_like(indices))
    if indices.numel() == 0:
        return out
    kernel = mask_indices_kernel(_TL_INDEX_DTYPES[indices.dtype])
    if compiling_only():
        return out
    contiguous = indices.is_contiguous() and out.is_contiguous()
    vectorized = contiguous and address(indices) % 16 == 0 and address(out) % 16 == 0
    row_stride, column_stride = _strides(indices)
    out_row_stride, out_column_stride = _strides(out)
    kernel(
        flat_view(indices),
        flat_view(out),
        indices.numel(),
        int(vectorized),
        indices.shape[1],
        row_stride,
        column_stride,
        out_row_stride,
        out_column_stride,
        n,
        n // num_ep_ranks,
        num_tp_ranks,
        tp_rank,
    )
    return out


@jit()
def unique_group_kernel(index_dtype: str, threads: int = ROW_THREADS):
    """One thread per row, slots left to right; a repeat of an earlier group becomes -1 in place."""
    x_span = T.dynamic("x_span")

    @T.prim_func
    def kernel(
        x: T.Tensor((x_span,), index_dtype),
        num_tokens: T.int32,
        num_topk: T.int32,
        row_stride: T.int64,
        column_stride: T.int64,
        num_groups: T.int64,
    ):
        with T.Kernel(T.ceildiv(num_tokens, threads), threads=threads) as (block,):
            tx = T.get_thread_binding()
            row = block * threads + tx
            seen = T.alloc_local((1,), "uint64")
            repeated = T.alloc_local((1,), "int32")
            seen[0] = T.uint64(0)
            if row < num_tokens:
                base = T.cast(row, "int64") * row_stride
                for j in T.serial(num_topk):
                    value = x[base + j * column_stride]
                    T.device_assert(value < num_groups, no_stack_info=True)
                    if value >= 0:
                        if num_groups <= BITSET_GROUPS:
                            bit = T.shift_left(T.uint64(1), T.cast(value, "uint64"))
                            if (seen[0] & bit) != T.uint64(0):
                                x[base + j * column_stride] = T.cast(-1, index_dtype)
                            seen[0] = seen[0] | bit
                        else:
                            # Earlier slots already set to -1 were repeats: the first occurrence of
                            # their group is still there, so comparing with them changes nothing.
                            repeated[0] = 0
                            for i in T.serial(j):
                                if x[base + i * column_stride] == value:
                                    repeated[0] = 1
                            if repeated[0] != 0:
                                x[base + j * column_stride] = T.cast(-1, index_dtype)

    return kernel


def inplace_unique_group_indices(group_indices: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per row, every repeat of a group index after its first occurrence becomes -1, in place
    (``tileproof.reference.moe.inplace_unique_group_indices``); returns ``group_indices``. Entries
    ``>= num_groups`` device-assert."""
    check_indices("group_indices", group_indices)
    check_int("num_groups", num_groups, low=1)
    require_cuda("group_indices", group_indices)
    num_tokens, num_topk = group_indices.shape
    if group_indices.numel() == 0:
        return group_indices
    kernel = unique_group_kernel(_TL_INDEX_DTYPES[group_indices.dtype])
    if compiling_only():
        return group_indices
    row_stride, column_stride = _strides(group_indices)
    kernel(flat_view(group_indices), num_tokens, num_topk, row_stride, column_stride, num_groups)
    return group_indices


# ---------------------------------------------------------------------------------------------
# get_fused_mapping
# ---------------------------------------------------------------------------------------------


@jit()
def fused_mapping_kernel(
    index_dtype: str, threads: int = MAP_THREADS, rounds: int = MAP_ROUNDS, capacity: int = EXPERT_TILE
):
    """Kernel 3 of ``get_fused_mapping``: CTA ``c`` places the pairs of chunk ``c`` (the chunks of
    ``expert_histogram_kernel``) and writes its share of the padding positions.

    ``bases[e · num_chunks + c]``: pairs of expert ``e`` in chunks before ``c`` (expert_totals_kernel,
    MODE_MAPPING); ``totals``/``sizes``: each expert's count and aligned size.

    Shared memory, one buffer (it is exchanged between threads across barriers): ``warps`` rows of
    ``capacity`` per-warp counters, then the tile's segment starts, then one scan slot per warp.
    """
    _check_capacity(capacity, threads)
    warps = threads // 32
    per_thread = capacity // threads
    starts_at = warps * capacity
    warp_sums_at = starts_at + capacity
    load_chunk = _chunk_loader(index_dtype, threads, rounds)

    x_span = T.dynamic("x_span")
    bases_span = T.dynamic("bases_span")
    experts_span = T.dynamic("experts_span")
    positions_span = T.dynamic("positions_span")
    slots_span = T.dynamic("slots_span")

    @T.macro
    def write_padding(pos_to_expert, pos_to_token, pos_to_token_topk, position):
        pos_to_expert[position] = -1
        pos_to_token[position] = -1
        pos_to_token_topk[position] = -1

    @T.prim_func
    def kernel(
        x: T.Tensor((x_span,), index_dtype),
        bases: T.Tensor((bases_span,), "int32"),
        totals: T.Tensor((experts_span,), "int32"),
        sizes: T.Tensor((experts_span,), "int32"),
        expert_start: T.Tensor((experts_span,), "int32"),
        expert_end: T.Tensor((experts_span,), "int32"),
        pos_to_expert: T.Tensor((positions_span,), "int32"),
        pos_to_token: T.Tensor((positions_span,), "int32"),
        pos_to_token_topk: T.Tensor((positions_span,), "int32"),
        token_topk_to_pos: T.Tensor((slots_span,), "int32"),
        num_slots: T.int32,
        num_topk: T.int32,
        row_stride: T.int64,
        column_stride: T.int64,
        num_experts: T.int32,
        num_chunks: T.int32,
        num_positions: T.int32,
    ):
        with T.Kernel(num_chunks, threads=threads) as (chunk,):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            experts = T.alloc_local((rounds,), "int32")
            own_sizes = T.alloc_local((per_thread,), "int32")
            thread_sum = T.alloc_local((1,), "int32")
            inclusive = T.alloc_local((1,), "int32")
            running = T.alloc_local((1,), "int32")
            tile_total = T.alloc_local((1,), "int32")
            carry = T.alloc_local((1,), "int32")  # aligned sizes of the experts of earlier tiles
            previous = T.alloc_local((1,), "int32")
            shared = T.alloc_shared((warp_sums_at + warps,), "int32")
            below = _lanes_below(lane)

            load_chunk(
                x,
                experts,
                chunk,
                warp,
                lane,
                num_slots,
                num_topk,
                row_stride,
                column_stride,
                num_experts,
                -1,
                False,
            )
            for r in T.unroll(rounds):
                flat = chunk * (threads * rounds) + (warp * rounds + r) * 32 + lane
                if flat < num_slots and experts[r] < 0:
                    token_topk_to_pos[flat] = -1

            carry[0] = 0
            for tile in T.serial(T.ceildiv(num_experts, capacity)):
                first = tile * capacity
                width = T.min(capacity, num_experts - first)

                # (a) The tile's segment starts: an exclusive scan of the aligned sizes (thread tx
                #     owns experts tx · per_thread ...), and this warp's counters cleared.
                thread_sum[0] = 0
                for i in T.unroll(per_thread):
                    own = tx * per_thread + i
                    own_sizes[i] = T.if_then_else(own < width, sizes[first + own], 0)
                    thread_sum[0] = thread_sum[0] + own_sizes[i]
                inclusive[0] = thread_sum[0]
                for step in T.unroll(5):
                    from_below = T.shfl_up(inclusive[0], 1 << step)
                    if lane >= (1 << step):
                        inclusive[0] = inclusive[0] + from_below
                if lane == 31:
                    shared[warp_sums_at + warp] = inclusive[0]
                for i in T.unroll(capacity // 32):
                    shared[warp * capacity + i * 32 + lane] = 0
                T.sync_threads()
                running[0] = carry[0] + inclusive[0] - thread_sum[0]
                tile_total[0] = 0
                for w in T.unroll(warps):
                    if w < warp:
                        running[0] = running[0] + shared[warp_sums_at + w]
                    tile_total[0] = tile_total[0] + shared[warp_sums_at + w]
                for i in T.unroll(per_thread):
                    own = tx * per_thread + i
                    if own < width:
                        shared[starts_at + own] = running[0]
                        if chunk == 0:
                            expert_start[first + own] = running[0]
                            expert_end[first + own] = running[0] + own_sizes[i]
                    running[0] = running[0] + own_sizes[i]

                # (b) Each warp counts its own slots per expert of the tile: one shared atomic per
                #     group of equal experts in a round (its lowest lane). The rows are warp-private.
                for r in T.unroll(rounds):
                    local = experts[r] - first
                    same = T.match_any_sync(experts[r])
                    if local >= 0 and local < width and (same & below) == T.uint32(0):
                        T.atomic_add(shared[warp * capacity + local], T.cast(T.popcount(same), "int32"))
                T.sync_threads()

                # (c) Counters → each warp's first rank: segment start + earlier chunks (bases) +
                #     earlier warps of this chunk, in warp order (= flat order).
                for i in T.unroll(capacity // threads):
                    own = i * threads + tx
                    if own < width:
                        running[0] = bases[T.cast(first + own, "int64") * num_chunks + chunk] + shared[starts_at + own]
                        for w in T.unroll(warps):
                            thread_sum[0] = shared[w * capacity + own]
                            shared[w * capacity + own] = running[0]
                            running[0] = running[0] + thread_sum[0]
                T.sync_threads()

                # (d) Placement. The group's lowest lane takes the group's ranks from the warp's
                #     counter (an atomic returning the old value: the counter's updates stay in
                #     round order without a plain read-modify-write) and shares the first one.
                for r in T.unroll(rounds):
                    local = experts[r] - first
                    in_tile = local >= 0 and local < width
                    same = T.match_any_sync(experts[r])
                    previous[0] = 0
                    if in_tile and (same & below) == T.uint32(0):
                        previous[0] = T.atomic_add(
                            shared[warp * capacity + local], T.cast(T.popcount(same), "int32"), return_prev=True
                        )
                    group_first = T.shfl_sync(previous[0], T.call_extern("int32", "__ffs", same) - 1)
                    if in_tile:
                        flat = chunk * (threads * rounds) + (warp * rounds + r) * 32 + lane
                        position = group_first + T.cast(T.popcount(same & below), "int32")
                        token_topk_to_pos[flat] = position
                        if position < num_positions:
                            pos_to_expert[position] = experts[r]
                            pos_to_token[position] = flat // num_topk
                            pos_to_token_topk[position] = flat

                # (e) Segment tails (align(count) - count positions per expert), an expert per warp
                #     of the whole grid.
                for i in T.serial(T.ceildiv(width, num_chunks * warps)):
                    own = (i * num_chunks + chunk) * warps + warp
                    if own < width:
                        used = shared[starts_at + own] + totals[first + own]
                        end = shared[starts_at + own] + sizes[first + own]
                        for j in T.serial(T.ceildiv(end - used, 32)):
                            position = used + j * 32 + lane
                            if position < end and position < num_positions:
                                write_padding(pos_to_expert, pos_to_token, pos_to_token_topk, position)
                carry[0] = carry[0] + tile_total[0]
                T.sync_threads()

            # Everything past the last segment is padding. A given size below the aligned total
            # stops here (the reference raises ValueError; the check needs no host sync this way).
            if chunk == 0 and tx == 0:
                T.device_assert(carry[0] <= num_positions, no_stack_info=True)
            for i in T.serial(T.ceildiv(T.max(num_positions - carry[0], 0), num_chunks * threads)):
                position = carry[0] + (i * num_chunks + chunk) * threads + tx
                if position < num_positions:
                    write_padding(pos_to_expert, pos_to_token, pos_to_token_topk, position)

    return kernel


def get_fused_mapping(
    topk_idx: torch.Tensor,
    num_experts: int,
    num_expanded_tokens: int,
    alignment: int,
    force_no_sync: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Lay the ``(token, slot)`` pairs out expert by expert (``tileproof.reference.moe.get_fused_mapping``,
    bit for bit: inside a segment in ascending flat index ``t · k + j``).

    Three kernels. No host synchronisation when ``num_expanded_tokens > 0`` or ``force_no_sync``
    (CUDA-graph safe); with ``num_expanded_tokens == 0`` and not ``force_no_sync`` one read-back of
    the aligned sizes gives the exact size and the returned list. Entries outside ``[-1, E)``, and a
    positive ``num_expanded_tokens`` below the aligned total, device-assert instead of raising
    ``ValueError`` (the reference's checks need the values on the host).
    """
    check_indices("topk_idx", topk_idx)
    check_int("num_experts", num_experts, low=1)
    check_int("num_expanded_tokens", num_expanded_tokens, low=0)
    check_int("alignment", alignment, low=1)
    check_bool("force_no_sync", force_no_sync)
    require_cuda("topk_idx", topk_idx)
    num_tokens, num_topk = topk_idx.shape
    num_slots = num_tokens * num_topk
    device = topk_idx.device

    def mapping_output(size: int) -> torch.Tensor:
        return new_output(torch.empty(size, dtype=MAPPING_DTYPE, device=device))

    expert_start, expert_end, sizes = (mapping_output(num_experts) for _ in range(3))
    token_topk_to_pos = new_output(torch.empty((num_tokens, num_topk), dtype=MAPPING_DTYPE, device=device))
    should_sync = num_expanded_tokens == 0 and not force_no_sync
    if num_expanded_tokens == 0 and force_no_sync:
        num_expanded_tokens = (num_slots + (alignment - 1) * num_experts) // alignment * alignment

    index_dtype = _TL_INDEX_DTYPES[topk_idx.dtype]
    schedule = mapping_schedule(num_slots)
    histogram = expert_histogram_kernel(index_dtype, **schedule)
    totals_kernel = expert_totals_kernel()
    placement = fused_mapping_kernel(index_dtype, **schedule)
    if compiling_only():
        positions = (mapping_output(num_expanded_tokens) for _ in range(3))
        return (*positions, token_topk_to_pos, expert_start, expert_end, sizes, [])

    chunks = _chunks(num_slots, **schedule)
    bases = torch.empty(num_experts * chunks, dtype=torch.int32, device=device)
    totals = torch.empty(num_experts, dtype=torch.int32, device=device)
    row_stride, column_stride = _strides(topk_idx)
    histogram(flat_view(topk_idx), bases, num_slots, num_topk, row_stride, column_stride, num_experts, chunks, -1)
    placeholder = device_constant(torch.float32, device, numel=0)
    totals_kernel(bases, totals, sizes, placeholder, num_experts, chunks, alignment, 0, MODE_MAPPING)
    size_list: list[int] = []
    if should_sync:
        size_list = sizes.tolist()  # the one host read-back, as TileKernels does
        num_expanded_tokens = sum(size_list)
    pos_to_expert, pos_to_token, pos_to_token_topk = (mapping_output(num_expanded_tokens) for _ in range(3))
    placement(
        flat_view(topk_idx),
        bases,
        totals,
        sizes,
        expert_start,
        expert_end,
        pos_to_expert,
        pos_to_token,
        pos_to_token_topk,
        flat_view(token_topk_to_pos),
        num_slots,
        num_topk,
        row_stride,
        column_stride,
        num_experts,
        chunks,
        num_expanded_tokens,
    )
    return (
        pos_to_expert,
        pos_to_token,
        pos_to_token_topk,
        token_topk_to_pos,
        expert_start,
        expert_end,
        sizes,
        size_list,
    )

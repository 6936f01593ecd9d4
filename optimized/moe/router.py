"""Optimized twin of the top-k rankers and the full router (contract §2): TileLang kernels.

Same public names, argument order and results as ``tileproof.reference.moe``: ``topk_gate`` and
``topk_sum_and_topk_group_idx`` bit for bit; ``top2_sum_gate``'s indices bit for bit and its weights
as the reference's docstring states (the scores use the GPU's ``expf``, ``log1pf``, ``sqrtf``,
exactly the functions PyTorch's CUDA kernels call, so sigmoid and sqrt-softplus weights carry
PyTorch's bits, which the GPU tests require; the softmax denominator is summed in another order).

Kernel design (one warp per token row, the row in registers; shared memory only for the router's
warp-private key stash):

- **Layout**: lane ``l`` holds the ``n`` consecutive entries ``l·n .. l·n + n - 1`` of its row
  (``n = per_lane``, static: a few compiled configurations cover every width up to ``32·32``),
  read with 16-byte loads where the row allows. Lanes past the row hold *absent* slots.
- **Ranking keys**: each fp32 score becomes a uint32 whose unsigned order is the contract's order:
  the sign-magnitude bits turned into an ordered integer (``bits ^ 0x80000000`` for a positive
  number, ``~bits`` for a negative one), ``-0`` moved onto ``+0`` (a tie), every NaN onto
  ``0xFFFFFFFF`` (above ``+inf``; NaNs tie, so the index decides). Key 0 would be a negative NaN,
  which is never produced, so it marks an absent slot.
- **Top-k**: ``k`` rounds of a warp arg-max. In a round each lane finds its best key (the smaller
  slot on a tie), ``redux.sync.max`` gives the warp's best key, ``redux.sync.min`` over the indices
  of the lanes holding it gives the winner (ties → smaller index: the stable descending order),
  and the winner's lane sets the slot's bit in a per-lane mask that later rounds skip. Rank ``j``
  is kept by lane ``j % 32`` (register ``j // 32``) and stored with one coalesced int64 store per
  lane at the end. About ``4·n + 10`` instructions per round. Rows wider than ``32·32``
  (``topk_gate`` only) use a streaming variant that re-reads the row (L1/L2) in every round and
  picks the best entry ranked after the previous round's winner.
- **Group scores** (``topk_sum_and_topk_group_idx``): lane ``l`` owns whole groups and scans each
  one (any group size, any strides), keeping its two largest keys; the group score is
  ``fl32(first + second)`` (or ``first``) of the decoded keys, ranked like any score.
- **Router** (``top2_sum_gate``): scores, ranking keys, group limiting and top-k in one pass over
  the logits. A group spans ``L = group_size / n`` adjacent lanes (its top-2 is merged with
  ``shfl_xor`` when ``L`` is a power of two, else gathered lane by lane) or a lane holds
  ``n / group_size`` whole groups; ``n`` is chosen so that one of the two holds. The kept groups
  come from the same arg-max rounds over group keys (their mask bits mark the chosen); experts of
  the other groups get the key of ``-inf``, exactly as the reference masks them. The top-k of the
  experts (widths 1, 2, 4, 8 per lane) sorts each lane's keys once with a sorting network and
  then takes one warp max over the lane heads per round (``select_top_keys``): about half the
  instructions of the scan rounds; which slot won is resolved once, from the unsorted keys kept in
  shared memory. The lanes holding
  the ``k`` winners then re-read those logits (L1 hits) and recompute their scores with the same
  instructions, so the weights need no per-round bookkeeping: ``den`` is summed left to right over
  the lanes by shuffles, ``w = fl32(fl32(s / den) · factor)`` with an IEEE division. Shared
  experts, the physical replica, the TP re-indexing and the mask are per-slot integer work on the
  same lanes. Optional inputs are runtime switches (uniform branches), so one compiled kernel
  serves every combination of mask, fixed routing, physical map and unmapped buffer.

Data-dependent argument checks of the reference (finite routed logits, fixed indices in ``[0, R)``,
``logical_count`` in ``[1, num_extra + 1]``, physical experts below ``R + num_extra``) would cost a
host synchronization here: the kernels device-assert them instead, as the reference's docstring
announces.
"""

import tilelang.language as T
import torch

from tileproof.reference.contract import ceil_div, check_choice, check_int
from tileproof.reference.moe import (
    NUM_TOPK_SUM_CHOICES,
    REPLICA_HASH_PRIME,
    SOFTPLUS_THRESHOLD,
    WEIGHT_EPSILON,
    check_router_arguments,
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

__all__ = ["topk_gate", "topk_sum_and_topk_group_idx", "top2_sum_gate"]

# Entries per lane that the register kernels are compiled for (a row of E entries takes the
# smallest that holds it): few configurations, and at most 32 registers of keys per lane.
PER_LANE_CHOICES = (1, 2, 4, 8, 12, 16, 24, 32)
MAX_PER_LANE = PER_LANE_CHOICES[-1]
# Token rows per CTA (one warp each); see ``scratch/gpu_router.py`` for the sweep.
WARPS = 4

KEY_ABSENT = 0  # below every value's key: an absent slot (past the row, or a group no lane speaks for)
KEY_NAN = 0xFFFFFFFF
SIGN_BIT = 0x80000000
KEY_NEGATIVE_INFINITY = 0x007FFFFF  # ~bits(-inf): the key the reference's group mask gives
LARGEST_FINITE_BITS = 0x7F7FFFFF  # |x| bits above this: inf or NaN
NO_INDEX = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------


def ranking_key(value, signed_zero: bool = True):
    """fp32 → uint32 whose unsigned order is the contract's ranking order (see the module docstring).
    ``signed_zero=False`` skips the −0 step for values that are never −0 (a sigmoid or sqrt-softplus
    score plus a bias: the score is ≥ +0, and a sum is −0 only when both terms are)."""
    bits = T.reinterpret(value, "uint32")
    # The arithmetic shift spreads the sign: all ones for a negative number, then one XOR.
    sign_spread = T.reinterpret(T.shift_right(T.reinterpret(value, "int32"), 31), "uint32")
    ordered = bits ^ (sign_spread | T.uint32(SIGN_BIT))
    if signed_zero:
        # -0 is 0x80000000, whose ordered form 0x7FFFFFFF sits just below +0's 0x80000000: a tie instead.
        ordered = T.if_then_else(ordered == T.uint32(SIGN_BIT - 1), T.uint32(SIGN_BIT), ordered)
    is_nan = (bits & T.uint32(0x7FFFFFFF)) > T.uint32(0x7F800000)
    return T.if_then_else(is_nan, T.uint32(KEY_NAN), ordered)


def key_value(key):
    """The fp32 value of a ranking key (±0 decode as +0, NaN as 0x7FFFFFFF: both rank the same)."""
    bits = T.if_then_else(key >= T.uint32(SIGN_BIT), key ^ T.uint32(SIGN_BIT), key ^ T.uint32(0xFFFFFFFF))
    return T.reinterpret(bits, "float32")


@T.macro
def load_entries(src, values, row, lane, num_experts, expert_stride, fill, per_lane: int, vector: int):
    """``values[i] = src[row + (lane·per_lane + i)·expert_stride]`` for the entries below
    ``num_experts``, ``fill`` for the others. With ``vector > 1`` the stride is 1, ``num_experts``
    and ``row`` are multiples of ``vector`` and each chunk is one wide load.

    (Macro arguments keep the names of the kernel's variables: TileLang renames a kernel parameter
    after the macro argument it is passed to, and two parameters passed to one name would clash.)"""
    for c in T.unroll(per_lane // vector):
        first = lane * per_lane + c * vector
        if first < num_experts:
            if vector == 1:
                values[c] = src[row + T.cast(first, "int64") * expert_stride]
            else:
                for e in T.vectorized(vector):
                    values[c * vector + e] = src[row + first + e]
        else:
            for e in T.unroll(vector):
                values[c * vector + e] = fill


@T.macro
def load_bias(bias, biases, lane, num_experts, bias_stride, per_lane: int, vector: int):
    """The bias of the lane's experts (0 past the row), laid out like the logits."""
    for c in T.unroll(per_lane // vector):
        first = lane * per_lane + c * vector
        if first < num_experts:
            if vector == 1:
                biases[c] = bias[T.cast(first, "int64") * bias_stride]
            else:
                for e in T.vectorized(vector):
                    biases[c * vector + e] = bias[first + e]
        else:
            for e in T.unroll(vector):
                biases[c * vector + e] = T.float32(0)


@T.macro
def select_top(keys, ranked, chosen, best_key, best_slot, lane, rounds, per_lane: int, results_per_lane: int):
    """``rounds`` warp arg-max rounds over ``keys`` (``per_lane`` per lane; slot ``i`` of lane
    ``l`` is entry ``l·per_lane + i``). Round ``r``'s winner (its entry index) lands in
    ``ranked[r // 32]`` of lane ``r % 32``; bit ``i`` of ``chosen[0]`` tells whether slot ``i``
    has won. A chosen slot is skipped through that bit rather than by clearing its key: the
    compare against it folds into the arg-max's own compare (4 instead of 5 per slot and round)."""
    chosen[0] = T.uint32(0)
    for q in T.unroll(results_per_lane):
        ranked[q] = T.uint32(NO_INDEX)
    for r in T.serial(rounds):
        best_key[0] = T.uint32(KEY_ABSENT)
        best_slot[0] = 0
        for i in T.unroll(per_lane):
            # Strictly greater: the first (smaller) slot keeps a tie. An absent key (0) never wins.
            better = ((chosen[0] & T.uint32(1 << i)) == T.uint32(0)) & (keys[i] > best_key[0])
            best_slot[0] = T.if_then_else(better, i, best_slot[0])
            best_key[0] = T.if_then_else(better, keys[i], best_key[0])
        top = T.warp_reduce_max(best_key[0])
        mine = T.cast(lane * per_lane + best_slot[0], "uint32")
        winner = T.warp_reduce_min(T.if_then_else(best_key[0] == top, mine, T.uint32(NO_INDEX)))
        own_slot = T.cast(winner, "int32") - lane * per_lane
        won = (own_slot >= 0) & (own_slot < per_lane)
        chosen[0] = chosen[0] | T.if_then_else(won, T.shift_left(T.uint32(1), T.cast(own_slot, "uint32")), T.uint32(0))
        for q in T.unroll(results_per_lane):
            ranked[q] = T.if_then_else(r == q * 32 + lane, winner, ranked[q])


@T.macro
def store_ranked(out, ranked, row, lane, rounds, results_per_lane: int):
    """``out[row + j] = ranked[j // 32]`` of lane ``j % 32`` (int64) for ``j < rounds``."""
    for q in T.unroll(results_per_lane):
        if q * 32 + lane < rounds:
            out[row + q * 32 + lane] = T.cast(ranked[q], "int64")


# Lane widths with a sorting network in ``select_top_keys`` (the others use ``select_top``).
SORTED_LANE_WIDTHS = (1, 2, 4, 8)


@T.macro
def order_keys(keys, i: int, j: int):
    """``keys[i] >= keys[j]`` afterwards (one unsigned max and one min)."""
    larger = T.max(keys[i], keys[j])
    keys[j] = T.min(keys[i], keys[j])
    keys[i] = larger


@T.macro
def select_top_keys(
    keys, stash, stash_row, fetched, ranked, ranked_key, matches, lane, rounds, per_lane: int, results_per_lane: int
):
    """Same results as ``select_top`` for ``per_lane`` in ``SORTED_LANE_WIDTHS``, with 32-bit work:
    each lane sorts its keys alone (no slots: ``max``/``min`` per comparator), a round takes the
    warp's best head and the smallest lane holding it (its entries precede every later lane's), and
    that lane shifts its list. Which slot won is found once at the end: the unsorted keys wait in
    the warp's ``stash`` rows (shared memory, ``per_lane`` per lane from ``stash_row``), rank ``j``'s
    lane reads the winning lane's row, marks the slots holding the winning key and takes the
    ``(c + 1)``-th of them, ``c`` the number of earlier ranks won by the same lane with the same
    key. Those ranks are the ones right before ``j`` (the lane keeps winning while it holds the
    best key and is the smallest lane holding it), so ``c`` comes from one ballot of where runs
    start; the smaller slot goes first on a tie, as in ``select_top``."""
    # (TileLang's barrier insertion does not know that a warp's stash rows are its own: it adds one
    # __syncthreads at the kernel's start, before any work, which costs nothing measurable.)
    for i in T.vectorized(per_lane):
        stash[stash_row + lane * per_lane + i] = keys[i]
    # Optimal sorting networks (Knuth; 5 comparators for 4 entries, 19 for 8), written out: the macro
    # parser unrolls no Python loops. order_keys(i, j) puts the larger of positions i < j at i.
    if per_lane == 2:
        order_keys(keys, 0, 1)
    if per_lane == 4:
        order_keys(keys, 0, 1)
        order_keys(keys, 2, 3)
        order_keys(keys, 0, 2)
        order_keys(keys, 1, 3)
        order_keys(keys, 1, 2)
    if per_lane == 8:
        order_keys(keys, 0, 2)
        order_keys(keys, 1, 3)
        order_keys(keys, 4, 6)
        order_keys(keys, 5, 7)
        order_keys(keys, 0, 4)
        order_keys(keys, 1, 5)
        order_keys(keys, 2, 6)
        order_keys(keys, 3, 7)
        order_keys(keys, 0, 1)
        order_keys(keys, 2, 3)
        order_keys(keys, 4, 5)
        order_keys(keys, 6, 7)
        order_keys(keys, 2, 4)
        order_keys(keys, 3, 5)
        order_keys(keys, 1, 4)
        order_keys(keys, 3, 6)
        order_keys(keys, 1, 2)
        order_keys(keys, 3, 4)
        order_keys(keys, 5, 6)
    for q in T.unroll(results_per_lane):
        ranked[q] = T.uint32(NO_INDEX)
        ranked_key[q] = T.uint32(KEY_ABSENT)
    for r in T.serial(rounds):
        top = T.warp_reduce_max(keys[0])
        winner = T.warp_reduce_min(T.if_then_else(keys[0] == top, T.cast(lane, "uint32"), T.uint32(32)))
        won = T.cast(winner, "int32") == lane
        for i in T.unroll(per_lane - 1):
            keys[i] = T.if_then_else(won, keys[i + 1], keys[i])
        keys[per_lane - 1] = T.if_then_else(won, T.uint32(KEY_ABSENT), keys[per_lane - 1])
        for q in T.unroll(results_per_lane):
            ranked[q] = T.if_then_else(r == q * 32 + lane, winner, ranked[q])
            ranked_key[q] = T.if_then_else(r == q * 32 + lane, top, ranked_key[q])
    T.sync_warp()  # the stash rows are read by other lanes
    # Resolve (winning lane, key) into entry indices. matches[0]: this rank's candidate slots;
    # matches[1..3]: lane 31's run count, lane and key of the previous register (rank 32q - 1);
    # matches[4..5]: the previous rank's lane and key.
    matches[1] = T.uint32(0)
    matches[2] = T.uint32(NO_INDEX)
    matches[3] = T.uint32(KEY_ABSENT)
    for q in T.unroll(results_per_lane):
        source = ranked[q] & T.uint32(31)
        key = ranked_key[q]
        matches[4] = T.shfl_up(source, 1)
        matches[5] = T.shfl_up(key, 1)
        before_source = T.if_then_else(lane == 0, matches[2], matches[4])
        before_key = T.if_then_else(lane == 0, matches[3], matches[5])
        # A rank past ``rounds`` starts a run of its own, so that it has no occurrences to skip.
        starts = T.cast(T.ballot((before_source != source) | (before_key != key) | (q * 32 + lane >= rounds)), "uint32")
        # Run starts at or below this lane (bits 0..lane): the run's first rank is the highest, at
        # 31 - clz; with none (clz == 32) the run continues from the previous register.
        leading = T.cast(T.clz(starts & T.shift_right(T.uint32(0xFFFFFFFF), T.cast(31 - lane, "uint32"))), "int32")
        earlier = lane - 31 + leading + T.shift_right(leading, 5) * T.cast(matches[1], "int32")
        for i in T.vectorized(per_lane):
            fetched[i] = stash[stash_row + source * per_lane + i]
        matches[0] = T.uint32(0)
        for i in T.unroll(per_lane):
            matches[0] = matches[0] | T.if_then_else(fetched[i] == key, T.uint32(1 << i), T.uint32(0))
        for _skipped in T.serial(earlier):
            matches[0] = matches[0] & (matches[0] - T.uint32(1))
        if results_per_lane > 1:
            matches[1] = T.cast(T.shfl_sync(earlier, 31), "uint32")
            matches[2] = T.shfl_sync(source, 31)
            matches[3] = T.shfl_sync(key, 31)
        slot = T.cast(T.call_extern("int32", "__ffs", matches[0]) - 1, "uint32")
        if q * 32 + lane < rounds:
            ranked[q] = source * T.uint32(per_lane) + slot


# ---------------------------------------------------------------------------------------------
# topk_gate
# ---------------------------------------------------------------------------------------------


@jit()
def topk_gate_kernel(per_lane: int, vector: int, results_per_lane: int, warps: int = WARPS):
    """Factory over the static layout; T, E, k and the strides are runtime values.

    A CTA holds ``warps`` token rows (grid x: tokens); ``scores`` is flat, its row stride counted
    in vectors (entries: ``expert_stride``, 1 with vector loads)."""
    scores_span = T.dynamic("scores_span")
    out_span = T.dynamic("out_span")

    @T.prim_func
    def kernel(
        scores: T.Tensor((scores_span,), "float32"),
        out: T.Tensor((out_span,), "int64"),
        num_tokens: T.int32,
        num_experts: T.int32,
        row_stride_vectors: T.int32,
        expert_stride: T.int32,
        num_topk: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, warps), threads=32 * warps) as (block,):
            tx = T.get_thread_binding()
            lane = tx % 32
            token = block * warps + tx // 32
            values = T.alloc_local((per_lane,), "float32")
            keys = T.alloc_local((per_lane,), "uint32")
            ranked = T.alloc_local((results_per_lane,), "uint32")
            best_key = T.alloc_local((1,), "uint32")
            best_slot = T.alloc_local((1,), "int32")
            chosen = T.alloc_local((1,), "uint32")
            rounds = T.alloc_var("int32")
            rounds = num_topk
            if token < num_tokens:
                row = T.cast(token, "int64") * row_stride_vectors * vector
                load_entries(scores, values, row, lane, num_experts, expert_stride, T.float32(0), per_lane, vector)
                for i in T.unroll(per_lane):
                    present = lane * per_lane + i < num_experts
                    keys[i] = T.if_then_else(present, ranking_key(values[i]), T.uint32(KEY_ABSENT))
                select_top(keys, ranked, chosen, best_key, best_slot, lane, rounds, per_lane, results_per_lane)
                store_ranked(out, ranked, T.cast(token, "int64") * rounds, lane, rounds, results_per_lane)

    return kernel


@jit()
def topk_gate_streaming_kernel(results_per_lane: int, warps: int = WARPS):
    """Rows wider than ``32·MAX_PER_LANE``: round ``r`` scans the row (lane ``l`` takes entries
    ``l, l + 32, ...``) for the best entry ranked strictly after round ``r - 1``'s winner in the
    (key descending, index ascending) order; the row stays in L1/L2 across rounds."""
    scores_span = T.dynamic("scores_span")
    out_span = T.dynamic("out_span")

    @T.prim_func
    def kernel(
        scores: T.Tensor((scores_span,), "float32"),
        out: T.Tensor((out_span,), "int64"),
        num_tokens: T.int32,
        num_experts: T.int32,
        row_stride: T.int32,
        expert_stride: T.int32,
        num_topk: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, warps), threads=32 * warps) as (block,):
            tx = T.get_thread_binding()
            lane = tx % 32
            token = block * warps + tx // 32
            ranked = T.alloc_local((results_per_lane,), "uint32")
            best_key = T.alloc_local((1,), "uint32")
            best_index = T.alloc_local((1,), "uint32")
            previous_key = T.alloc_local((1,), "uint32")
            previous_index = T.alloc_local((1,), "uint32")
            rounds = T.alloc_var("int32")
            rounds = num_topk
            if token < num_tokens:
                row = T.cast(token, "int64") * row_stride
                previous_key[0] = T.uint32(KEY_ABSENT)
                previous_index[0] = T.uint32(NO_INDEX)
                for q in T.unroll(results_per_lane):
                    ranked[q] = T.uint32(NO_INDEX)
                for r in T.serial(rounds):
                    best_key[0] = T.uint32(KEY_ABSENT)
                    best_index[0] = T.uint32(NO_INDEX)
                    for chunk in T.serial(T.ceildiv(num_experts, 32)):
                        expert = chunk * 32 + lane
                        if expert < num_experts:
                            key = ranking_key(scores[row + T.cast(expert, "int64") * expert_stride])
                            index = T.cast(expert, "uint32")
                            after = (
                                (r == 0)
                                | (key < previous_key[0])
                                | ((key == previous_key[0]) & (index > previous_index[0]))
                            )
                            # Entries arrive in ascending index: a strict > keeps the first of equal keys.
                            if after & (key > best_key[0]):
                                best_key[0] = key
                                best_index[0] = index
                    top = T.warp_reduce_max(best_key[0])
                    winner = T.warp_reduce_min(T.if_then_else(best_key[0] == top, best_index[0], T.uint32(NO_INDEX)))
                    previous_key[0] = top
                    previous_index[0] = winner
                    for q in T.unroll(results_per_lane):
                        ranked[q] = T.if_then_else(r == q * 32 + lane, winner, ranked[q])
                store_ranked(out, ranked, T.cast(token, "int64") * rounds, lane, rounds, results_per_lane)

    return kernel


# ---------------------------------------------------------------------------------------------
# topk_sum_and_topk_group_idx
# ---------------------------------------------------------------------------------------------


@jit()
def group_topk_kernel(groups_per_lane: int, results_per_lane: int, warps: int = WARPS):
    """Factory over the static layout; T, G, the group size, ``num_topk_sum``, the number of kept
    groups and the three strides (elements) are runtime values.

    Lane ``l`` owns groups ``l·groups_per_lane + j`` and scans each one, keeping its two largest
    keys (a repeated maximum counts twice); the group scores' keys then go through the arg-max
    rounds."""
    scores_span = T.dynamic("scores_span")
    out_span = T.dynamic("out_span")

    @T.prim_func
    def kernel(
        scores: T.Tensor((scores_span,), "float32"),
        out: T.Tensor((out_span,), "int64"),
        num_tokens: T.int32,
        num_groups: T.int32,
        group_size: T.int32,
        token_stride: T.int32,
        group_stride: T.int32,
        expert_stride: T.int32,
        num_topk_sum: T.int32,
        num_topk_groups: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, warps), threads=32 * warps) as (block,):
            tx = T.get_thread_binding()
            lane = tx % 32
            token = block * warps + tx // 32
            keys = T.alloc_local((groups_per_lane,), "uint32")
            ranked = T.alloc_local((results_per_lane,), "uint32")
            best_key = T.alloc_local((1,), "uint32")
            best_slot = T.alloc_local((1,), "int32")
            chosen = T.alloc_local((1,), "uint32")
            first = T.alloc_var("uint32")
            second = T.alloc_var("uint32")
            rounds = T.alloc_var("int32")
            rounds = num_topk_groups
            if token < num_tokens:
                row = T.cast(token, "int64") * token_stride
                for j in T.unroll(groups_per_lane):
                    group = lane * groups_per_lane + j
                    keys[j] = T.uint32(KEY_ABSENT)
                    if group < num_groups:
                        first = T.uint32(KEY_ABSENT)
                        second = T.uint32(KEY_ABSENT)
                        base = row + T.cast(group, "int64") * group_stride
                        for e in T.serial(group_size):
                            key = ranking_key(scores[base + T.cast(e, "int64") * expert_stride])
                            second = T.max(second, T.min(first, key))
                            first = T.max(first, key)
                        best = key_value(first)
                        keys[j] = ranking_key(T.if_then_else(num_topk_sum == 2, best + key_value(second), best))
                select_top(keys, ranked, chosen, best_key, best_slot, lane, rounds, groups_per_lane, results_per_lane)
                store_ranked(out, ranked, T.cast(token, "int64") * rounds, lane, rounds, results_per_lane)

    return kernel


# ---------------------------------------------------------------------------------------------
# top2_sum_gate
# ---------------------------------------------------------------------------------------------


def routing_score(logit, row_max, exp_sum, scoring: str):
    """The score ``s`` of one logit with the instructions PyTorch's CUDA kernels use: ``expf``,
    ``log1pf``, ``sqrtf`` (correctly rounded without fast-math) and IEEE divisions. Softmax takes
    the row's maximum and its sum of ``exp(x - max)``."""
    if scoring == "sigmoid":
        # The correctly rounded reciprocal is the correctly rounded 1 / y (fewer instructions).
        return T.ieee_frcp(T.float32(1) + T.exp(-logit))
    if scoring == "sqrtsoftplus":
        softplus = T.if_then_else(logit > T.float32(SOFTPLUS_THRESHOLD), logit, T.log1p(T.exp(logit)))
        return T.sqrt(softplus)
    return T.ieee_fdiv(T.exp(logit - row_max), exp_sum)


@T.macro
def merge_top2(top2, other_first, other_second):
    """``top2[0] >= top2[1]`` ← the two largest of the multiset {top2[0], top2[1], other_first,
    other_second} (``other_first >= other_second``): a repeated maximum counts twice."""
    top2[1] = T.max(T.min(top2[0], other_first), T.max(top2[1], other_second))
    top2[0] = T.max(top2[0], other_first)


@jit()
def router_kernel(
    per_lane: int,
    vector: int,
    scoring: str,
    group_size: int,
    results_per_lane: int,
    warps: int = WARPS,
    full_rows: bool = False,
):
    """Factory over the static layout: ``per_lane`` experts per lane, the load width, the scoring
    function, the group size (0: no group limiting) and the output slots per lane. Everything
    else (T, R, k, kept groups, shared experts, the factor, the optional inputs and their
    strides, the EP/TP layout) is a runtime value.

    With groups, a group spans ``lanes_per_group = group_size / per_lane`` adjacent lanes, or a
    lane holds ``groups_per_lane = per_lane / group_size`` whole groups (the launcher picks
    ``per_lane`` so that one of the two divisions is exact).

    ``full_rows``: the launcher's word that R = 32 · per_lane (every lane full), so the bounds
    checks of the loads and keys fold away. The experts are ranked with ``select_top_keys`` where
    ``per_lane`` is in ``SORTED_LANE_WIDTHS``, else with ``select_top``."""
    sorted_keys = per_lane in SORTED_LANE_WIDTHS
    grouped = group_size > 0
    lanes_per_group = group_size // per_lane if grouped and group_size >= per_lane else 1
    groups_per_lane = per_lane // group_size if grouped and group_size < per_lane else 1
    group_slots = per_lane // groups_per_lane  # slots of one group inside a lane
    butterfly = lanes_per_group & (lanes_per_group - 1) == 0
    logits_span = T.dynamic("logits_span")
    bias_span = T.dynamic("bias_span")
    mask_span = T.dynamic("mask_span")
    fixed_span = T.dynamic("fixed_span")
    unmapped_span = T.dynamic("unmapped_span")
    map_span = T.dynamic("map_span")
    count_span = T.dynamic("count_span")
    out_span = T.dynamic("out_span")

    @T.macro
    def limit_groups(
        keys, group_keys, best_key, best_slot, ranked_groups, chosen_groups, top2, own, lane, num_groups, group_rounds
    ):
        """Keep the ``group_rounds`` best groups by top-2 sum; the other experts get the key of -inf."""
        for j in T.unroll(groups_per_lane):
            top2[0] = T.uint32(KEY_ABSENT)
            top2[1] = T.uint32(KEY_ABSENT)
            for i in T.unroll(group_slots):
                merge_top2(top2, keys[j * group_slots + i], T.uint32(KEY_ABSENT))
            if lanes_per_group > 1:
                if butterfly:
                    for step in T.unroll(lanes_per_group.bit_length() - 1):
                        merge_top2(top2, T.shfl_xor(top2[0], 1 << step), T.shfl_xor(top2[1], 1 << step))
                else:
                    own[0] = top2[0]
                    own[1] = top2[1]
                    top2[0] = T.uint32(KEY_ABSENT)
                    top2[1] = T.uint32(KEY_ABSENT)
                    for m in T.unroll(lanes_per_group):
                        source = lane // lanes_per_group * lanes_per_group + m
                        merge_top2(top2, T.shfl_sync(own[0], source), T.shfl_sync(own[1], source))
            group = (lane * groups_per_lane + j) // lanes_per_group
            # One lane speaks for a group that spans several: a group is chosen once.
            speaks = (group < num_groups) & (lane % lanes_per_group == 0)
            group_sum = key_value(top2[0]) + key_value(top2[1])
            group_keys[j] = T.if_then_else(speaks, ranking_key(group_sum), T.uint32(KEY_ABSENT))
        select_top(
            group_keys, ranked_groups, chosen_groups, best_key, best_slot, lane, group_rounds, groups_per_lane, 1
        )
        for j in T.unroll(groups_per_lane):
            kept = T.cast((chosen_groups[0] >> j) & T.uint32(1), "int32")
            if lanes_per_group > 1:
                kept = T.shfl_sync(kept, lane // lanes_per_group * lanes_per_group)
            for i in T.unroll(group_slots):
                slot = j * group_slots + i
                masked = (keys[slot] != T.uint32(KEY_ABSENT)) & (kept == 0)
                keys[slot] = T.if_then_else(masked, T.uint32(KEY_NEGATIVE_INFINITY), keys[slot])

    @T.prim_func
    def kernel(
        logits: T.Tensor((logits_span,), "float32"),
        bias: T.Tensor((bias_span,), "float32"),
        mask: T.Tensor((mask_span,), "uint8"),
        fixed: T.Tensor((fixed_span,), "uint8"),
        unmapped: T.Tensor((unmapped_span,), "int64"),
        to_physical: T.Tensor((map_span,), "int32"),
        logical_count: T.Tensor((count_span,), "int32"),
        topk_idx: T.Tensor((out_span,), "int64"),
        topk_weights: T.Tensor((out_span,), "float32"),
        num_tokens: T.int32,
        num_experts: T.int32,
        row_stride_vectors: T.int32,
        expert_stride: T.int32,
        bias_stride: T.int32,
        num_groups: T.int32,
        num_topk: T.int32,
        num_topk_groups: T.int32,
        num_shared: T.int32,
        routed_scaling_factor: T.float32,
        has_mask: T.int32,
        mask_stride: T.int32,
        has_fixed: T.int32,
        fixed_stride: T.int32,
        has_unmapped: T.int32,
        unmapped_stride: T.int32,
        has_map: T.int32,
        map_row_stride: T.int32,
        map_column_stride: T.int32,
        count_stride: T.int32,
        num_replica_columns: T.int32,
        ep_rank: T.int32,
        experts_per_rank: T.int32,
        tp_rank: T.int32,
        num_tp_ranks: T.int32,
        num_physical: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, warps), threads=32 * warps) as (block,):
            tx = T.get_thread_binding()
            lane = tx % 32
            token = block * warps + tx // 32
            values = T.alloc_local((per_lane,), "float32")
            biases = T.alloc_local((per_lane,), "float32")
            keys = T.alloc_local((per_lane,), "uint32")
            group_keys = T.alloc_local((groups_per_lane,), "uint32")
            ranked_groups = T.alloc_local((1,), "uint32")
            ranked = T.alloc_local((results_per_lane,), "uint32")
            chosen_scores = T.alloc_local((results_per_lane,), "float32")
            best_key = T.alloc_local((1,), "uint32")
            best_slot = T.alloc_local((1,), "int32")
            chosen = T.alloc_local((1,), "uint32")
            chosen_groups = T.alloc_local((1,), "uint32")
            ranked_key = T.alloc_local((results_per_lane,), "uint32")
            matches = T.alloc_local((6,), "uint32")
            fetched = T.alloc_local((per_lane,), "uint32")
            stash = T.alloc_shared((warps * 32 * per_lane if sorted_keys else 1,), "uint32")
            bits_max = T.alloc_var("uint32")
            top2 = T.alloc_local((2,), "uint32")
            own = T.alloc_local((2,), "uint32")
            row_max = T.alloc_var("float32")
            exp_sum = T.alloc_var("float32")
            den = T.alloc_var("float32")
            routed = T.alloc_var("int32")
            is_fixed = T.alloc_var("int32")
            not_finite = T.alloc_var("int32")
            logical = T.alloc_var("int32")
            physical = T.alloc_var("int32")
            replicas = T.alloc_var("int32")
            local = T.alloc_var("int64")
            weight = T.alloc_var("float32")
            rounds = T.alloc_var("int32")
            group_rounds = T.alloc_var("int32")
            rounds = num_topk
            group_rounds = num_topk_groups
            slots = num_topk + num_shared
            # Entries a row holds: the static width when the launcher says every lane is full
            # (R = 32 · per_lane), so that the bounds checks fold away.
            row_entries = 32 * per_lane if full_rows else num_experts
            if token < num_tokens:
                out_row = T.cast(token, "int64") * slots
                unmapped_row = T.cast(token, "int64") * unmapped_stride
                routed = 1
                if has_mask != 0:
                    routed = T.cast(mask[T.cast(token, "int64") * mask_stride], "int32")
                if routed == 0:
                    # A masked token: nothing read, every slot -1 with weight 0.
                    for q in T.unroll(results_per_lane):
                        if q * 32 + lane < slots:
                            topk_idx[out_row + q * 32 + lane] = T.int64(-1)
                            topk_weights[out_row + q * 32 + lane] = T.float32(0)
                        if (has_unmapped != 0) & (q * 32 + lane < num_topk):
                            unmapped[unmapped_row + q * 32 + lane] = T.int64(-1)
                else:
                    is_fixed = 0
                    if has_fixed != 0:
                        is_fixed = T.cast(fixed[T.cast(token, "int64") * fixed_stride], "int32")
                    row = T.cast(token, "int64") * row_stride_vectors * vector
                    load_entries(logits, values, row, lane, row_entries, expert_stride, T.float32(0), per_lane, vector)
                    # |x| > LARGEST_FINITE  <=>  bits << 1 > LARGEST_FINITE << 1 (the sign shifted out);
                    # the entries past the row were loaded as 0, which is finite.
                    bits_max = T.uint32(0)
                    for i in T.unroll(per_lane):
                        bits_max = T.max(bits_max, T.shift_left(T.reinterpret(values[i], "uint32"), T.uint32(1)))
                    not_finite = T.cast(bits_max > T.uint32(LARGEST_FINITE_BITS << 1), "int32")
                    T.device_assert(not_finite == 0, "top2_sum_gate: logits must be finite in every routed token")
                    if scoring == "softmax":
                        row_max = T.float32(float("-inf"))
                        for i in T.unroll(per_lane):
                            if lane * per_lane + i < row_entries:
                                row_max = T.max(row_max, values[i])
                        row_max = T.warp_reduce_max(row_max)
                        exp_sum = T.float32(0)
                        for i in T.unroll(per_lane):
                            if lane * per_lane + i < row_entries:
                                exp_sum = exp_sum + T.exp(values[i] - row_max)
                        exp_sum = T.warp_reduce_sum(exp_sum)
                    if is_fixed == 0:
                        load_bias(bias, biases, lane, row_entries, bias_stride, per_lane, vector)
                        for i in T.unroll(per_lane):
                            if scoring == "softmax":
                                ranking = values[i] + biases[i]
                            else:
                                ranking = routing_score(values[i], row_max, exp_sum, scoring) + biases[i]
                            present = lane * per_lane + i < row_entries
                            key = ranking_key(ranking, signed_zero=scoring == "softmax")
                            keys[i] = T.if_then_else(present, key, T.uint32(KEY_ABSENT))
                        if grouped:
                            limit_groups(
                                keys,
                                group_keys,
                                best_key,
                                best_slot,
                                ranked_groups,
                                chosen_groups,
                                top2,
                                own,
                                lane,
                                num_groups,
                                group_rounds,
                            )
                        if sorted_keys:
                            select_top_keys(
                                keys,
                                stash,
                                tx // 32 * 32 * per_lane,
                                fetched,
                                ranked,
                                ranked_key,
                                matches,
                                lane,
                                rounds,
                                per_lane,
                                results_per_lane,
                            )
                        else:
                            select_top(
                                keys, ranked, chosen, best_key, best_slot, lane, rounds, per_lane, results_per_lane
                            )
                    else:
                        for q in T.unroll(results_per_lane):
                            ranked[q] = T.uint32(0)
                            if q * 32 + lane < num_topk:
                                replayed = unmapped[unmapped_row + q * 32 + lane]
                                T.device_assert(
                                    (replayed >= 0) & (replayed < T.cast(num_experts, "int64")),
                                    "top2_sum_gate: unmapped_topk_idx of a fixed token must hold experts in [0, R)",
                                )
                                ranked[q] = T.cast(replayed, "uint32")
                    # Scores of the chosen experts, recomputed from their logits (same instructions).
                    for q in T.unroll(results_per_lane):
                        chosen_scores[q] = T.float32(0)
                        if q * 32 + lane < num_topk:
                            chosen = logits[row + T.cast(ranked[q], "int64") * expert_stride]
                            chosen_scores[q] = routing_score(chosen, row_max, exp_sum, scoring)
                    den = T.float32(WEIGHT_EPSILON)
                    # Left to right over the lanes in unrolled chunks of 8 shuffles: the lanes past k
                    # hold a score of +0, and den + 0 == den for the positive den.
                    for q in T.unroll(results_per_lane):
                        for chunk in T.serial(T.ceildiv(T.min(32, num_topk - q * 32), 8)):
                            for u in T.unroll(8):
                                den = den + T.shfl_sync(chosen_scores[q], chunk * 8 + u)
                    for q in T.unroll(results_per_lane):
                        slot = q * 32 + lane
                        if slot < slots:
                            if slot < num_topk:
                                logical = T.cast(ranked[q], "int32")
                                weight = T.ieee_fdiv(chosen_scores[q], den) * routed_scaling_factor
                            else:
                                logical = num_experts + slot - num_topk
                                weight = T.float32(1)
                            physical = logical
                            if has_map != 0:
                                replicas = logical_count[T.cast(logical, "int64") * count_stride]
                                T.device_assert(
                                    (replicas >= 1) & (replicas <= num_replica_columns),
                                    "top2_sum_gate: logical_count entries must be in [1, num_extra_experts + 1]",
                                )
                                # Unsigned: both operands are non-negative, and C's % needs no floor fix-up.
                                spread = T.cast(token, "uint64") * REPLICA_HASH_PRIME + T.cast(ep_rank, "uint64")
                                replica = T.cast(spread % T.cast(replicas, "uint64"), "int64")
                                physical = to_physical[
                                    T.cast(logical, "int64") * map_row_stride + replica * map_column_stride
                                ]
                                T.device_assert(
                                    physical < num_physical,
                                    "top2_sum_gate: to_physical_map entries must be below R + num_extra_experts",
                                )
                            # mask_indices_by_tp: a negative expert is padding; with one TP rank the
                            # renumbering is the identity (dp = rank, so dp·per_rank + offset = physical).
                            local = T.cast(physical, "int64")
                            if physical < 0:
                                local = T.int64(-1)
                            if (physical >= 0) & (num_tp_ranks > 1):
                                # Unsigned divisions of non-negative values (no floor fix-up code).
                                rank = T.cast(physical, "uint32") // T.cast(experts_per_rank, "uint32")
                                column = rank // T.cast(num_tp_ranks, "uint32")
                                local = T.int64(-1)
                                if rank - column * T.cast(num_tp_ranks, "uint32") == T.cast(tp_rank, "uint32"):
                                    offset = T.cast(physical, "uint32") - rank * T.cast(experts_per_rank, "uint32")
                                    local = T.cast(column * T.cast(experts_per_rank, "uint32") + offset, "int64")
                            topk_idx[out_row + slot] = local
                            topk_weights[out_row + slot] = weight
                        if (has_unmapped != 0) & (slot < num_topk):
                            unmapped[unmapped_row + slot] = T.cast(ranked[q], "int64")

    return kernel


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def entries_per_lane(entries: int) -> int:
    """The smallest compiled per-lane width whose warp holds ``entries`` entries (0: none does)."""
    needed = ceil_div(entries, 32)
    return next((choice for choice in PER_LANE_CHOICES if choice >= needed), 0)


def _row_strides(x: torch.Tensor) -> tuple[int, int]:
    """(row stride, entry stride) of a 2-D tensor in elements; a single row or entry counts as contiguous."""
    rows, entries = x.shape
    entry_stride = x.stride(1) if entries > 1 else 1
    row_stride = x.stride(0) if rows > 1 else entries * entry_stride
    return row_stride, entry_stride


def load_width(per_lane: int, entries: int, row_strides) -> int:
    """Widest fp32 load (at most 4 entries, 16 bytes) that divides the lane width, the row length
    and every row stride: the ``vector`` static parameter of the kernels (the oracle names compiled
    configurations with it too)."""
    vector = 4
    while vector > 1 and (per_lane % vector or entries % vector or any(stride % vector for stride in row_strides)):
        vector //= 2
    return vector


def _vector_width(tensors: list[torch.Tensor], per_lane: int, entries: int) -> int:
    """``load_width`` for these tensors (2-D rows or a 1-D row), narrowed until every base address
    is aligned to it; 1 when an entry stride is not 1."""
    row_strides = []
    for x in tensors:
        row_stride, entry_stride = _row_strides(x) if x.dim() == 2 else (entries, x.stride(0) if entries > 1 else 1)
        if entry_stride != 1:
            return 1
        row_strides.append(row_stride)
    vector = load_width(per_lane, entries, row_strides)
    while vector > 1 and any(address(x) % (4 * vector) for x in tensors):
        vector //= 2
    return vector


def _topk_gate_plan(scores: torch.Tensor, num_topk: int):
    """Check a ``topk_gate`` of this signature and decide its launch; the plan: ``run(scores) -> out``."""
    check_scores("scores", scores, ndim=2)
    check_int("num_topk", num_topk, low=1, high=scores.shape[1])
    require_cuda("scores", scores)
    num_tokens, num_experts = scores.shape
    device = scores.device

    def allocate():
        return new_output(torch.empty((num_tokens, num_topk), dtype=torch.int64, device=device))

    if num_tokens == 0:
        return lambda scores: allocate()
    results_per_lane = ceil_div(num_topk, 32)
    row_stride, expert_stride = _row_strides(scores)
    per_lane = entries_per_lane(num_experts)
    if per_lane:
        vector = _vector_width([scores], per_lane, num_experts)
        kernel = topk_gate_kernel(per_lane, vector, results_per_lane, warps=WARPS)
        row_stride //= vector
    else:
        kernel = topk_gate_streaming_kernel(results_per_lane, warps=WARPS)
    kernel = launched(kernel)
    scalars = (num_tokens, num_experts, row_stride, expert_stride, num_topk)

    def run(scores):
        out = allocate()
        if kernel is not None:
            kernel(flat_view(scores), flat_view(out), *scalars)
        return out

    return run


_TOPK_PLANS = LaunchPlans(_topk_gate_plan)


def topk_gate(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    """Indices of each token's ``num_topk`` highest scores, best first: int64 ``[T, num_topk]``,
    bit for bit ``tileproof.reference.moe.topk_gate`` (stable descending order; ties → smaller
    index; ``-0 == +0``; NaN first)."""
    return _TOPK_PLANS.plan(scores, num_topk)(scores)


def topk_sum_and_topk_group_idx(scores: torch.Tensor, num_topk_sum: int, num_topk_groups: int) -> torch.Tensor:
    """The ``num_topk_groups`` best groups of each token by the sum of their best one or two scores:
    int64 ``[T, num_topk_groups]``, bit for bit ``tileproof.reference.moe.topk_sum_and_topk_group_idx``.
    ``scores`` fp32 ``[T, G, E/G]`` with any strides; up to ``32·32`` groups."""
    check_scores("scores", scores, ndim=3)
    check_int("num_topk_sum", num_topk_sum, low=1, high=scores.shape[2])
    check_choice("num_topk_sum", num_topk_sum, NUM_TOPK_SUM_CHOICES)
    check_int("num_topk_groups", num_topk_groups, low=1, high=scores.shape[1])
    require_cuda("scores", scores)
    num_tokens, num_groups, group_size = scores.shape
    groups_per_lane = entries_per_lane(num_groups)
    if not groups_per_lane:
        raise ValueError(f"scores: the optimized kernel ranks at most {32 * MAX_PER_LANE} groups, got {num_groups}")
    out = new_output(torch.empty((num_tokens, num_topk_groups), dtype=torch.int64, device=scores.device))
    if num_tokens == 0:
        return out
    kernel = group_topk_kernel(groups_per_lane, ceil_div(num_topk_groups, 32), warps=WARPS)
    if compiling_only():
        return out
    kernel(
        flat_view(scores),
        flat_view(out),
        num_tokens,
        num_groups,
        group_size,
        *scores.stride(),
        num_topk_sum,
        num_topk_groups,
    )
    return out


def router_per_lane(num_experts: int, group_size: int) -> int:
    """Experts per lane of the router kernel (0: too many for a warp's registers). With group
    limiting, the smallest width that holds the row and divides the group size or is a multiple
    of it, so that no group straddles a lane boundary inside a lane."""
    if not group_size:
        return entries_per_lane(num_experts)
    needed = ceil_div(num_experts, 32)
    divisors = [width for width in range(needed, group_size + 1) if group_size % width == 0]
    width = divisors[0] if divisors else group_size * ceil_div(needed, group_size)
    return width if width <= MAX_PER_LANE else 0


def _top2_sum_gate_plan(
    logits: torch.Tensor,
    bias: torch.Tensor,
    num_topk: int,
    num_topk_groups: int,
    num_groups: int,
    use_shared_as_routed: bool,
    num_shared_experts: int,
    routed_scaling_factor: float,
    ep_rank: int,
    num_ep_ranks: int,
    tp_rank: int,
    num_tp_ranks: int,
    scoring_func: str,
    mask: torch.Tensor | None = None,
    fix_routing_mask: torch.Tensor | None = None,
    to_physical_map: torch.Tensor | None = None,
    logical_count: torch.Tensor | None = None,
    unmapped_topk_idx: torch.Tensor | None = None,
):
    """Check a ``top2_sum_gate`` of these signatures and decide its launch; the plan:
    ``run(logits, bias, mask, fix_routing_mask, to_physical_map, logical_count, unmapped_topk_idx)``
    returns ``(topk_idx, topk_weights)``."""
    num_shared, num_extra = check_router_arguments(
        logits,
        bias,
        num_topk,
        num_topk_groups,
        num_groups,
        use_shared_as_routed,
        num_shared_experts,
        routed_scaling_factor,
        ep_rank,
        num_ep_ranks,
        tp_rank,
        num_tp_ranks,
        scoring_func,
        mask,
        fix_routing_mask,
        to_physical_map,
        logical_count,
        unmapped_topk_idx,
        values=False,
    )
    optional = (("mask", mask), ("fix_routing_mask", fix_routing_mask), ("to_physical_map", to_physical_map))
    for name, tensor in (("logits", logits), ("bias", bias), *optional, ("logical_count", logical_count)):
        if tensor is not None:
            require_cuda(name, tensor)
    if unmapped_topk_idx is not None:
        require_cuda("unmapped_topk_idx", unmapped_topk_idx)
    num_tokens, num_routed = logits.shape
    slots = num_topk + num_shared
    device = logits.device

    def allocate():
        topk_idx = new_output(torch.empty((num_tokens, slots), dtype=torch.int64, device=device))
        return topk_idx, new_output(torch.empty((num_tokens, slots), dtype=torch.float32, device=device))

    if num_tokens == 0:
        return lambda *tensors: allocate()
    group_size = num_routed // num_groups if num_groups != num_topk_groups else 0
    per_lane = router_per_lane(num_routed, group_size)
    if not per_lane:
        raise ValueError(
            f"logits: the optimized router holds at most {32 * MAX_PER_LANE} experts per row "
            f"(and groups that fit a warp's lanes), got {num_routed} experts"
        )
    vector = _vector_width([logits, bias], per_lane, num_routed)
    kernel = router_kernel(
        per_lane,
        vector,
        scoring_func,
        group_size,
        ceil_div(slots, 32),
        warps=WARPS,
        full_rows=num_routed == 32 * per_lane,
    )
    kernel = launched(kernel)
    # An absent optional tensor is a zero-size constant and its flag 0; a present one is passed
    # flat (flags as bytes) with its row stride.
    absent_flags = device_constant(torch.uint8, device, numel=0)
    absent_indices = device_constant(torch.int64, device, numel=0)
    absent_map = device_constant(torch.int32, device, numel=0)
    has_mask, mask_stride = (0, 0) if mask is None else (1, mask.stride(0))
    has_fixed, fixed_stride = (0, 0) if fix_routing_mask is None else (1, fix_routing_mask.stride(0))
    has_unmapped, unmapped_stride = (0, 0) if unmapped_topk_idx is None else (1, unmapped_topk_idx.stride(0))
    if to_physical_map is None:
        has_map, map_strides, count_stride = 0, (0, 0), 0
    else:
        has_map, map_strides, count_stride = 1, to_physical_map.stride(), logical_count.stride(0)
    row_stride, expert_stride = _row_strides(logits)
    num_physical = num_routed + num_extra
    scalars = (
        num_tokens,
        num_routed,
        row_stride // vector,
        expert_stride,
        bias.stride(0) if num_routed > 1 else 1,
        num_groups,
        num_topk,
        num_topk_groups,
        num_shared,
        float(routed_scaling_factor),
        has_mask,
        mask_stride,
        has_fixed,
        fixed_stride,
        has_unmapped,
        unmapped_stride,
        has_map,
        *map_strides,
        count_stride,
        num_extra + 1,
        ep_rank,
        num_physical // num_ep_ranks,
        tp_rank,
        num_tp_ranks,
        num_physical,
    )

    def run(logits, bias, mask, fix_routing_mask, to_physical_map, logical_count, unmapped_topk_idx):
        topk_idx, topk_weights = allocate()
        if kernel is None:
            return topk_idx, topk_weights
        kernel(
            flat_view(logits),
            flat_view(bias),
            absent_flags if mask is None else flat_view(mask).view(torch.uint8),
            absent_flags if fix_routing_mask is None else flat_view(fix_routing_mask).view(torch.uint8),
            absent_indices if unmapped_topk_idx is None else flat_view(unmapped_topk_idx),
            absent_map if to_physical_map is None else flat_view(to_physical_map),
            absent_map if to_physical_map is None else flat_view(logical_count),
            flat_view(topk_idx),
            flat_view(topk_weights),
            *scalars,
        )
        return topk_idx, topk_weights

    return run


_ROUTER_PLANS = LaunchPlans(_top2_sum_gate_plan)


def top2_sum_gate(
    logits: torch.Tensor,
    bias: torch.Tensor,
    num_topk: int,
    num_topk_groups: int,
    num_groups: int,
    use_shared_as_routed: bool,
    num_shared_experts: int,
    routed_scaling_factor: float,
    ep_rank: int,
    num_ep_ranks: int,
    tp_rank: int,
    num_tp_ranks: int,
    scoring_func: str,
    mask: torch.Tensor | None = None,
    fix_routing_mask: torch.Tensor | None = None,
    to_physical_map: torch.Tensor | None = None,
    logical_count: torch.Tensor | None = None,
    unmapped_topk_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeepSeek-V3-style router in one kernel: same arguments, steps and results as
    ``tileproof.reference.moe.top2_sum_gate`` (``unmapped_topk_idx`` written in place); up to
    ``32·32`` routed experts. Returns ``(topk_idx int64 [T, k + S], topk_weights fp32 [T, k + S])``."""
    arguments = (
        logits,
        bias,
        num_topk,
        num_topk_groups,
        num_groups,
        use_shared_as_routed,
        num_shared_experts,
        routed_scaling_factor,
        ep_rank,
        num_ep_ranks,
        tp_rank,
        num_tp_ranks,
        scoring_func,
        mask,
        fix_routing_mask,
        to_physical_map,
        logical_count,
        unmapped_topk_idx,
    )
    plan = _ROUTER_PLANS.plan(*arguments)
    return plan(logits, bias, mask, fix_routing_mask, to_physical_map, logical_count, unmapped_topk_idx)

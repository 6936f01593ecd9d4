"""Fused SwiGLU + quantization (contract §1): ``swiglu_forward_and_per_token_cast`` as one TileLang
kernel, ``swiglu_forward_and_per_channel_cast_and_transpose`` as that kernel's activation pass
followed by the optimized per-channel cast, and ``swiglu_backward_and_per_token_cast`` as one kernel
(``swiglu_backward_kernel``, described there).

The activation (``tileproof.reference.quant_swiglu``, module docstring) is, per element of a row
``[g | u]``: the optional clamp (a select, so NaN passes), ``t = fl(1 + E(−g))``, ``silu = fl(g / t)``
(an IEEE division), ``a = fl(fl(silu · u) · w)``, with ``E(y) = fp32(exp(fp64(y)))``. Every step is
one correctly rounded IEEE operation in that order (no product feeds an addition, so nvcc has
nothing to contract into an FMA), hence the kernel is bitwise equal to the reference. ``a`` stays in
fp32 and is cast exactly as ``per_token_cast`` casts it (its scale and encoding macros).

Kernel design (memory-bound: the computation must hide behind the loads):

- **Persistent**: one CTA per SM loops over *tasks* (a row, or a part of a long row), so the per-CTA
  set-up below is paid once per SM. A CTA holds ``threads / threads_per_row`` *row groups* (whole
  warps); a row group takes one task per step. Thread ``i`` of a row group holds
  ``units_per_thread`` *units* of ``CHUNK`` (8) consecutive elements: units ``i``,
  ``i + threads_per_row``, ..., so a warp's loads are contiguous; gate and up are 16-byte loads
  (narrower when H, the row stride or the base address forbid it).
- **Pipelined** (``ForwardSchedule``): a row group keeps ``stages`` tasks in flight. Each step issues
  the loads of the task ``stages − 1`` steps ahead, into the stage the previous step freed, then
  computes its own task: with one CTA per SM nothing else would cover the memory latency. Loads
  land in a per-thread ring of shared memory (``cp.async``, one commit group per task, then
  ``cp.async.wait_group(stages − 1)``; each thread reads back only its own copies, so no barrier)
  or, for single bf16 values, in registers (one buffer per stage; the steps of a round are unrolled,
  so every register index is static). The first tasks' loads are issued before the table fill,
  which hides behind them.
- **Block scales (C = 128, and C = H ≤ 128, which is the same single partial block)**: a 1×128 block
  spans 16 adjacent lanes, so its maximum is four ``shfl_xor`` steps; as in ``per_token``, owner
  lanes compute the scales of the warp's blocks (one IEEE division pair per lane per task) and
  shuffle the multipliers back. No barrier in the loop.
- **Row scales (C = H > 128)**: a runtime switch of the same kernel: the task is the whole row, warp
  maxima meet in shared memory (two barriers per step). Rows longer than a CTA's task take more
  units per thread (a separately compiled configuration).
- **silu for bf16 input, memoized**: a bf16 gate has at most 2^16 values, so each CTA first fills a
  shared-memory table (layout at TABLE_LOW, 33 KiB) with ``silu(g) = fl(g / fl(1 + E(−g)))`` for
  every bf16 ``g`` with ``2^-26 ≤ |g| < 2^7`` (8448 of them): one fp64 ``exp`` and one division per
  entry, by the same expressions as the direct path, so an entry *is* the direct result. Outside
  the window the direct path has closed forms, checked for every bf16 value (scratch/swiglu):
  ``|g| < 2^-26`` (zeros and subnormals too) gives ``E(−g) = 1``, so ``silu = fl(g · 1/2)`` (a
  correctly rounded halving, equal to the division by 2); ``g ≥ 128`` (+Inf too) gives ``E = 0``,
  ``silu = g = g · 1``; ``g ≤ −128`` gives ``E = +Inf``, ``silu = −0 = g · 0`` for finite g and NaN
  for −Inf (``−Inf / Inf``), as ``−Inf · 0`` is; NaN stays NaN. So each gate's magnitude, clamped
  to one slot past either end of the window, picks a word: the window's value or the end's factor
  ``f``, and ``silu = fl(g · f)`` at the ends: a shared-memory load and a few integer operations
  per element, with no branch (2.8 % of the oracle's gates, its special values, lie outside the
  window: with 32 lanes a branch would diverge at almost every element). A clamped gate
  (``g = c``, an fp32 value) takes ``silu(c)``, computed once per thread. fp32 input always takes
  the direct path (2^32 gate values).
- **Routing and padding**: a task's ``pos_to_expert`` word is loaded a step before its loads are
  issued (padding rows are skipped: not read, not computed, not written, not counted); its
  ``pos_to_token_topk`` word two steps before it computes and its weight
  ``topk_weights.flatten()[pos_to_token_topk[r]]`` one step before: no dependent load waits in front
  of the data. Index tensors of either dtype are read as int32 words (an int64's sign is its high
  word; its value is its low word, since the weight index is below ``topk_weights.numel()`` <
  2^31). An index outside ``[0, numel)`` gives ``w = 0`` without a memory access: -1 is the
  contract's "no weight"; other values are refused by the reference's range check, which this twin
  skips (it needs the index data on the host: a device synchronization on every call).
- **Clamp counts**: per-thread int32 counts, a warp shuffle sum, one shared slot per warp and one
  int64 ``atomicAdd`` per counter and CTA: integer sums, independent of the order and the grid.
- Tails (H not a multiple of a task): masked per vector; gate and up read as zeros give ``a = ±0``,
  which never raises an absolute maximum and is never counted as clamped (``c ≥ 0``).

Compiled configurations stay few: token count, H, strides, the presence of routing inputs and
counts, the clamp value, ``round_sf``, block or row scales, the scale layout's strides, the row-group
size and the parts per row are runtime values; static are the input dtype, the format (or the bf16
activation alone), the load and store widths, packed UE8M0, the presence of a clamp (its compares
and counts cost issue slots) and the schedule (``FORWARD_SCHEDULE`` by input dtype, fitted to the
row by ``_plan``).
"""

import functools
import os
from typing import NamedTuple

import tilelang.language as T
import torch

from tileproof.reference.contract import (
    CAST_INPUT_DTYPES,
    E2M1,
    E4M3,
    ScaleLayout,
    ceil_div,
    check_cast_format,
    check_choice,
    check_int,
    check_num_per_tokens,
    check_per_token_blocks,
    check_scale_flags,
    check_tensor,
    check_unit_inner_stride,
)
from tileproof.reference.quant_swiglu import (
    CLAMP_COUNTERS,
    FORWARD_CHANNEL_BLOCK,
    check_backward_inputs,
    check_clamp,
    check_gate_up,
    check_index_vector,
    check_on_device,
    check_topk_weights,
)

from ..device import SHARED_MEMORY_BYTES, SM_LIMIT_ENV, sm_count
from ..jit import (
    LaunchPlans,
    address,
    compiling_only,
    device_constant,
    flat_view,
    jit,
    new_output,
    outputs_only_active,
    require_cuda,
)
from .common import float_bits_abs, scale_and_multiplier, ue8m0_byte
from .per_token import packed_scale_index, store_encoded_vector

# Schedule: threads per CTA, CTAs per SM, elements per unit (shared with the backward). 1024 threads
# on each SM (64 registers per thread) in one CTA: one silu table per SM, whose fill (8452 fp64 exp,
# ~1.5 µs) is paid once per SM, behind the first tasks' loads. A 1×128 block is 128 / CHUNK = 16 lanes.
THREADS = 1024
MIN_BLOCKS = 1
CHUNK = 8
STAGING_SHARED = "shared"  # loads land in a per-thread ring of shared memory (cp.async)
STAGING_REGISTERS = "registers"  # loads land in registers (one buffer per stage)


class ForwardSchedule(NamedTuple):
    """How the forward kernel streams a row group's tasks (one CTA per SM).

    ``threads``: per CTA. ``units_per_thread``: units of CHUNK values per thread and task.
    ``stages``: tasks in flight per row group: the loads of the next ``stages − 1`` tasks are issued
    before a task is computed, so that they arrive while it computes (1: load, then compute).
    ``staging``: where loads land.
    """

    threads: int
    units_per_thread: int
    stages: int
    staging: str


# By input dtype. bf16: a task is a row of 128 threads (H = 2048), 16 KiB of gate and up per row
# group and stage; two stages in shared memory keep one task (64 KiB per SM) in flight while one
# computes, and leave the registers to the computation. Two units per thread halve the per-task
# costs (block scales: one IEEE division pair per warp and task). Swept on the H200 (16384 × 2·2048,
# e4m3 1×128, µs plain / routed with weights, padding and clamp): three stages 51.7–52.6 / 67.7, two
# 51.7–52.0 / 64.0–65.6, registers instead of shared memory 57.4 / 72.4–74.9, and 2–4 smaller CTAs
# per SM (256 or 512 threads, each with its own table) no faster (docs/performance.md).
FORWARD_SCHEDULE = {
    torch.bfloat16: ForwardSchedule(1024, 2, 2, STAGING_SHARED),
    torch.float32: ForwardSchedule(1024, 1, 2, STAGING_SHARED),
}
# Register staging holds stages × units × (gate + up) words per thread; past 24 of them the
# computation spills beyond 64 registers.
REGISTER_STAGE_WORDS = 24

# The bf16 silu table: SILU_SLOTS slots of two fp32 words, one per sign (word 2 · slot + 1 for g < 0:
# a lookup shifts the slot and inserts the sign bit in one instruction). Slot 1 + i holds silu(g) for
# the window's bf16 magnitude TABLE_LOW + i (TABLE_LOW ≤ |g| < TABLE_HIGH). The two end slots hold
# factors f with silu(g) = fl(g · f): slot 0 takes every |g| below the window (zeros and subnormals
# too), f = 1/2; slot TABLE_WINDOW + 1 every |g| from TABLE_HIGH on (Inf and NaN too), f = 1 for
# g > 0 and f = 0 for g < 0. Magnitude bits of 2^k are (127 + k) << 7 (7 mantissa bits). Below
# 2^-26, E(−g) rounds to 1 (|e^−g − 1| < 2^-25, half an ulp below 1); from 2^7 on it rounds to 0 or
# overflows to +Inf.
TABLE_LOW = (127 - 26) << 7  # 2^-26
TABLE_HIGH = (127 + 7) << 7  # 2^7
TABLE_WINDOW = TABLE_HIGH - TABLE_LOW  # magnitudes per sign: 33 binades of 128
SILU_SLOTS = TABLE_WINDOW + 2
TABLE_WORDS = 2 * SILU_SLOTS

_TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
ACTIVATION_ONLY = "bf16"  # the kernel's "format" that writes the bf16 activation instead of a cast


def exp_rounded(y):
    """``E(y) = fp32(exp(fp64(y)))``: CUDA's double-precision ``exp``, rounded once to fp32."""
    return T.cast(T.exp(T.cast(y, "float64")), "float32")


def widen_half(word, half):
    """bf16 ``half`` (0: low, 1: high) of a 32-bit word as the equal fp32 (bf16 → fp32 is exact)."""
    bits = T.reinterpret(word, "uint32")
    widened = T.if_then_else(half == 0, T.shift_left(bits, T.uint32(16)), bits & T.uint32(0xFFFF0000))
    return T.reinterpret(widened, "float32")


def clamped_gate(gate, clamp_value, clamp: bool):
    """The gate after the clamp: a select (``g > c``), so NaN stays NaN and ``g == c`` stays."""
    return T.if_then_else(gate > clamp_value, clamp_value, gate) if clamp else gate


def clamped_up(up, clamp_value, clamp: bool):
    """The up projection after the two-sided clamp (selects, as for the gate)."""
    if not clamp:
        return up
    return T.if_then_else(up > clamp_value, clamp_value, T.if_then_else(up < -clamp_value, -clamp_value, up))


def silu_direct(gate):
    """``silu(g) = fl(g / fl(1 + E(−g)))``: one fp64 ``exp`` and one IEEE division."""
    return T.ieee_fdiv(gate, T.float32(1) + exp_rounded(-gate))


@T.macro
def fill_silu_table(table, tx, threads: int):
    """The silu table (fp32 bits; layout at TABLE_LOW): a window slot holds the direct path's
    expression, evaluated once per CTA; the end slots hold their factors."""
    for i in T.serial(ceil_div(TABLE_WORDS, threads)):
        entry = i * threads + tx
        if entry < TABLE_WORDS:
            negative = entry % 2
            slot = entry // 2
            bits = T.shift_left(negative, 15) | (TABLE_LOW - 1 + slot)
            gate = T.reinterpret(T.shift_left(T.cast(bits, "uint32"), T.uint32(16)), "float32")
            factor = T.if_then_else(
                slot == 0, T.float32(0.5), T.if_then_else(negative == 0, T.float32(1), T.float32(0))
            )
            in_window = T.And(slot > 0, slot <= TABLE_WINDOW)
            table[entry] = T.reinterpret(T.if_then_else(in_window, silu_direct(gate), factor), "int32")


def silu_from_table(gate, table):
    """``silu(g)`` for a bf16 gate ``g`` (as fp32): its window slot, or ``fl(g · f)`` with its end
    slot's factor ``f``.

    Exact: a window slot is the direct path's value; outside the window ``fl(g · 1/2) = fl(g / 2)``
    below it (zeros and subnormals included), ``g · 1 = g`` for g ≥ 2^7 and +Inf, and ``g · 0``:
    −0 for finite g ≤ −2^7, NaN for −Inf and NaN, as the direct path gives (``−Inf / Inf``,
    ``NaN / NaN``). No branch: 2.8 % of the oracle's gates lie outside the window, so most warps would
    take a branch at almost every element.
    """
    bits = T.reinterpret(gate, "uint32")
    magnitude = T.cast(T.shift_right(bits, T.uint32(16)) & T.uint32(0x7FFF), "int32")
    offset = T.min(T.max(magnitude - TABLE_LOW, -1), TABLE_WINDOW)  # −1: below, TABLE_WINDOW: above
    entry = (offset + 1) * 2 + T.cast(T.shift_right(bits, T.uint32(31)), "int32")
    value = T.reinterpret(table[entry], "float32")
    outside = T.cast(offset, "uint32") >= T.uint32(TABLE_WINDOW)
    return T.if_then_else(outside, gate * value, value)


@T.macro
def gate_silu(gate, clamp_value, silu_clamp, table, silu, use_table: bool, clamp: bool):
    """``silu[0] = silu(g')`` for the clamped gate g' of the *unclamped* gate ``g``: ``silu(c)``
    where clamped, else the table (bf16 gates) or the direct path (fp32 gates)."""
    if use_table:
        silu[0] = silu_from_table(gate, table)
        if clamp:
            silu[0] = T.if_then_else(gate > clamp_value, silu_clamp[0], silu[0])
    else:
        silu[0] = silu_direct(clamped_gate(gate, clamp_value, clamp))


@T.macro
def swiglu_element(gate, up, weight, clamp_value, silu_clamp, table, silu, out, use_table: bool, clamp: bool):
    """``out[0] = fl(fl(silu(g') · u') · w)`` with g', u' the clamped gate and up."""
    gate_silu(gate, clamp_value, silu_clamp, table, silu, use_table, clamp)
    out[0] = silu[0] * clamped_up(up, clamp_value, clamp) * weight


@T.macro
def count_clamps(gate, up, clamp_value, counts):
    """``counts += [g > c, u > c, u < −c]`` (strict: NaN and values equal to c are not counted)."""
    counts[0] = counts[0] + T.cast(gate > clamp_value, "int32")
    counts[1] = counts[1] + T.cast(up > clamp_value, "int32")
    counts[2] = counts[2] + T.cast(up < -clamp_value, "int32")


@jit()
def swiglu_per_token_kernel(
    in_dtype: str,
    fmt_name: str,
    vector: int,
    store_vector: int,
    packed_ue8m0: bool,
    clamp: bool,
    units_per_thread: int,
    stages: int,
    staging: str,
    threads: int = THREADS,
    chunk: int = CHUNK,
    min_blocks: int = MIN_BLOCKS,
):
    """Factory over the static parameters; everything else is a runtime scalar (module docstring).

    ``vector``: elements per load of gate / up (divides H, the row stride and the base); ``store_vector``:
    elements per store of q (divides H, at most ``chunk``). Tensors are passed flat with strides in
    vectors (see ``per_token_cast_kernel``: it lets TileLang prove the alignment of wide accesses).
    ``fmt_name == "bf16"``: no cast, the activation itself rounded to bf16 is the output ``q``
    (``sf`` is not touched), the first half of the per-channel forward. ``stages``, ``staging``:
    ``ForwardSchedule``.
    """
    activation_only = fmt_name == ACTIVATION_ONLY
    fmt = {"e4m3": E4M3, "e2m1": E2M1}.get(fmt_name)
    warps = threads // 32
    loads_per_unit = chunk // vector
    stores_per_unit = chunk // store_vector
    store_bytes = store_vector * 2 if activation_only else store_vector // fmt.values_per_byte
    # Rows travel as 32-bit words (two bf16 values or one fp32) until the activation: half the
    # registers for bf16, and whole words for cp.async. Only single bf16 values (odd H) travel as such.
    as_words = in_dtype == "float32" or vector % 2 == 0
    words = vector // 2 if in_dtype == "bfloat16" and as_words else vector
    held = loads_per_unit * words
    value_dtype = "int32" if as_words else "float32"
    x_dtype = "int32" if as_words else in_dtype
    use_table = in_dtype == "bfloat16"
    in_shared = staging == STAGING_SHARED
    if in_shared and not as_words:
        raise ValueError(f"staging {STAGING_SHARED!r} copies 32-bit words, got loads of {vector} {in_dtype} value")
    # Register buffers of gate and up: one per stage and unit, or (staged in shared memory) one for
    # the unit being computed, fetched from the ring just before.
    buffers, buffer_units = (1, 1) if in_shared else (stages, units_per_thread)
    lanes_per_block = FORWARD_CHANNEL_BLOCK // chunk
    block_shuffles = lanes_per_block.bit_length() - 1
    groups_per_warp = 32 // lanes_per_block
    scale_owners = units_per_thread * groups_per_warp
    q_dtype = "bfloat16" if activation_only else ("float8_e4m3" if fmt is E4M3 else "uint8")
    sf_dtype = "uint8" if packed_ue8m0 else "float32"
    # One shared buffer (int32 words) for everything exchanged across a barrier: TileLang may overlay
    # buffers whose per-thread lifetimes look disjoint. [silu table | warps row maxima | 3 × warps counts].
    # The staging ring is a second buffer: each thread reads back only what it copied.
    amax_base = TABLE_WORDS if use_table else 0
    count_base = amax_base + warps
    exchange_words = count_base + CLAMP_COUNTERS * warps
    stage_words = units_per_thread * 2 * held * threads
    all_stages = (1 << stages) - 1

    x_span = T.dynamic("x_span")
    q_span = T.dynamic("q_span")
    sf_span = T.dynamic("sf_span")
    expert_span = T.dynamic("expert_span")
    index_span = T.dynamic("index_span")
    weights_span = T.dynamic("weights_span")
    count_span = T.dynamic("count_span")

    def element_value(held_values, buffer, r, e):
        """Element ``e`` of unit ``r`` as fp32 (held as bf16 words, fp32 words or fp32 values)."""
        if not as_words:
            return held_values[buffer, r, e]
        if use_table:
            return widen_half(held_values[buffer, r, e // 2], e % 2)
        return T.reinterpret(held_values[buffer, r, e], "float32")

    def staged_offset(slot, r, half, v, tx):
        """Word offset of load ``v`` of unit ``r`` (``half`` 0: gate, 1: up) of thread ``tx`` in stage
        ``slot``: a warp's vectors are adjacent, so its shared-memory accesses are conflict-free."""
        return (((slot * units_per_thread + r) * 2 + half) * loads_per_unit + v) * threads * words + tx * words

    @T.macro
    def issue_loads(
        x,
        held_gate,
        held_up,
        staged,
        slot,
        row,
        part,
        tx,
        thread_in_group,
        threads_per_row,
        units_per_task,
        hidden_vectors,
        row_stride_vectors,
    ):
        """Start the loads of task (row, part)'s gate and up into stage ``slot``: cp.async copies into
        the staging ring (the caller commits them as one group per task), or loads into registers (a
        column past H reads as zeros)."""
        x_row = T.cast(row, "int64") * row_stride_vectors * words
        for r in T.unroll(units_per_thread):
            unit = part * units_per_task + r * threads_per_row + thread_in_group
            for v in T.unroll(loads_per_unit):
                column = unit * loads_per_unit + v
                if in_shared:
                    if column < hidden_vectors:
                        for half in T.unroll(2):
                            # An extern call: TileLang's barrier planner would see the copy as a write
                            # by any thread and fence every read of the ring with a __syncthreads.
                            T.call_extern(
                                "handle",
                                f"tl::cp_async_gs<{4 * words}>",
                                T.address_of(staged[staged_offset(slot, r, half, v, tx)]),
                                T.address_of(x[x_row + (half * hidden_vectors + column) * words]),
                            )
                elif column < hidden_vectors:
                    for w in T.vectorized(words):
                        if as_words:
                            held_gate[slot, r, v * words + w] = x[x_row + column * words + w]
                        else:
                            held_gate[slot, r, v * words + w] = T.cast(x[x_row + column * words + w], "float32")
                    for w in T.vectorized(words):
                        if as_words:
                            held_up[slot, r, v * words + w] = x[x_row + (hidden_vectors + column) * words + w]
                        else:
                            held_up[slot, r, v * words + w] = T.cast(
                                x[x_row + (hidden_vectors + column) * words + w], "float32"
                            )
                else:
                    for w in T.vectorized(words):
                        held_gate[slot, r, v * words + w] = T.cast(0, value_dtype)
                    for w in T.vectorized(words):
                        held_up[slot, r, v * words + w] = T.cast(0, value_dtype)

    @T.macro
    def fetch_staged(staged, held_gate, held_up, slot, r, unit, tx, hidden_vectors):
        """Unit ``r`` of stage ``slot`` (this thread's own copies) into the registers; zeros past H."""
        for v in T.unroll(loads_per_unit):
            column = unit * loads_per_unit + v
            if column < hidden_vectors:
                for w in T.vectorized(words):
                    held_gate[0, 0, v * words + w] = staged[staged_offset(slot, r, 0, v, tx) + w]
                for w in T.vectorized(words):
                    held_up[0, 0, v * words + w] = staged[staged_offset(slot, r, 1, v, tx) + w]
            else:
                for w in T.vectorized(words):
                    held_gate[0, 0, v * words + w] = T.cast(0, value_dtype)
                for w in T.vectorized(words):
                    held_up[0, 0, v * words + w] = T.cast(0, value_dtype)

    @T.macro
    def load_expert_word(expert_map, task, part_shift, num_rows, has_padding, expert_stride, expert_offset, word, slot):
        """``word[slot]``: the ``pos_to_expert`` word (its sign) of ``task``'s row; 0 without padding
        or past the last row. Loaded a step before it is needed, so that nothing waits for it."""
        row = T.shift_right(task, part_shift)
        word[slot] = 0
        if has_padding != 0:
            if row < num_rows:
                word[slot] = expert_map[T.cast(row, "int64") * expert_stride + expert_offset]

    @T.macro
    def load_weight_index(topk_index, task, part_shift, num_rows, has_weights, index_stride, index_offset, index, slot):
        """``index[slot]``: the ``pos_to_token_topk`` word (its value) of ``task``'s row; −1 without
        routing or past the last row."""
        row = T.shift_right(task, part_shift)
        index[slot] = -1
        if has_weights != 0:
            if row < num_rows:
                index[slot] = topk_index[T.cast(row, "int64") * index_stride + index_offset]

    @T.macro
    def load_weight(
        topk_weights,
        index,
        has_weights,
        weights_numel,
        weights_topk,
        weights_row_stride,
        weights_col_stride,
        weight,
        slot,
    ):
        """``weight[slot] = topk_weights.flatten()[index]``: 1 without routing, 0 for an index outside
        ``[0, numel)``. ``weights_topk == 0``: the flat index maps linearly (offset ``index · col_stride``)."""
        weight[slot] = T.float32(1)
        if has_weights != 0:
            weight[slot] = T.float32(0)
            if index >= 0 and index < weights_numel:
                if weights_topk == 0:
                    weight[slot] = topk_weights[T.cast(index, "int64") * weights_col_stride]
                else:
                    token = index // weights_topk
                    weight[slot] = topk_weights[
                        T.cast(token, "int64") * weights_row_stride
                        + T.cast(index - token * weights_topk, "int64") * weights_col_stride
                    ]

    @T.macro
    def store_scale(sf, sf_value, row, kblock, num_kblocks, sf_row_stride, sf_kblock_stride):
        if packed_ue8m0:
            byte = packed_scale_index(row, kblock, sf_row_stride)
            sf[byte] = ue8m0_byte(sf_value[0])
            if kblock == num_kblocks - 1:
                # The contract wants the unused bytes of the last word zeroed.
                for spare in T.unroll(1, 4):
                    if kblock % 4 + spare < 4:
                        sf[byte + spare] = T.uint8(0)
        else:
            sf[row * sf_row_stride + kblock * sf_kblock_stride] = sf_value[0]

    @T.prim_func
    def kernel(
        x: T.Tensor((x_span,), x_dtype),
        q: T.Tensor((q_span,), q_dtype),
        sf: T.Tensor((sf_span,), sf_dtype),
        expert_map: T.Tensor((expert_span,), "int32"),
        topk_index: T.Tensor((index_span,), "int32"),
        topk_weights: T.Tensor((weights_span,), "float32"),
        clamped_count: T.Tensor((count_span,), "int64"),
        num_ctas: T.int32,
        num_rows: T.int32,
        hidden_vectors: T.int32,
        row_stride_vectors: T.int32,
        hidden_stores: T.int32,
        num_kblocks: T.int32,
        sf_row_stride: T.int32,
        sf_kblock_stride: T.int32,
        round_sf: T.int32,
        row_scales: T.int32,
        group_shift: T.int32,
        part_shift: T.int32,
        has_padding: T.int32,
        expert_stride: T.int32,
        expert_offset: T.int32,
        has_weights: T.int32,
        index_stride: T.int32,
        index_offset: T.int32,
        weights_numel: T.int32,
        weights_topk: T.int32,
        weights_row_stride: T.int32,
        weights_col_stride: T.int32,
        clamp_value: T.float32,
        has_count: T.int32,
        count_stride: T.int32,
    ):
        with T.Kernel(num_ctas, threads=threads) as (cta,):
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            exchange = T.alloc_shared((exchange_words,), "int32")
            staged = T.alloc_shared((stages * stage_words if in_shared else 1,), x_dtype)
            held_gate = T.alloc_local((buffers, buffer_units, held), value_dtype)
            held_up = T.alloc_local((buffers, buffer_units, held), value_dtype)
            acts = T.alloc_local((units_per_thread, chunk), "float32")
            unit_amax = T.alloc_local((units_per_thread,), "int32")
            unit_multiplier = T.alloc_local((units_per_thread,), "float32")
            owned_amax = T.alloc_local((1,), "int32")
            sf_value = T.alloc_local((1,), "float32")
            multiplier = T.alloc_local((1,), "float32")
            codes = T.alloc_local((max(1, store_bytes),), "uint8")
            counts = T.alloc_local((CLAMP_COUNTERS,), "int32")
            silu_clamp = T.alloc_local((1,), "float32")
            silu = T.alloc_local((1,), "float32")
            element = T.alloc_local((1,), "float32")
            group_amax = T.alloc_local((1,), "int32")
            task = T.alloc_local((1,), "int32")  # the task computed in this step (row << part_shift | part)
            active_bits = T.alloc_local((1,), "int32")  # bit s: stage s's task is computed (exists, not padding)
            expert_words = T.alloc_local((stages,), "int32")  # of the first tasks, then [0]: the next load's
            weight_index = T.alloc_local((2,), "int32")  # of the first task, then [1]: the task after next's
            weight = T.alloc_local((2,), "float32")  # of this task and of the next
            owner_block = T.alloc_local((1,), "int32")  # the block this lane owns, within a task
            kblock = T.alloc_local((1,), "int32")

            threads_per_row = T.shift_left(1, group_shift)
            thread_in_group = tx & (threads_per_row - 1)
            group_in_cta = T.shift_right(tx, group_shift)
            groups_per_cta = T.shift_right(threads, group_shift)
            total_groups = num_ctas * groups_per_cta
            units_per_task = threads_per_row * units_per_thread
            warp_first_unit = thread_in_group - lane  # a row group is whole warps
            part_mask = T.shift_left(1, part_shift) - 1
            # Lane L owns block (unit round L // groups, group L % groups) of the warp (step 5).
            owner_round = lane // groups_per_warp
            owner_group = lane % groups_per_warp
            owner_block[0] = T.shift_right(
                owner_round * threads_per_row + warp_first_unit + owner_group * lanes_per_block, block_shuffles
            )

            # Prologue: the loads of the first stages − 1 tasks (padding rows too: they exist, and
            # their flags are not known yet), issued before the table fill so that the fill hides
            # behind them; the routing words of the first tasks.
            task[0] = cta * groups_per_cta + group_in_cta
            for p in T.unroll(stages - 1):
                if T.shift_right(task[0] + p * total_groups, part_shift) < num_rows:
                    issue_loads(
                        x,
                        held_gate,
                        held_up,
                        staged,
                        p,
                        T.shift_right(task[0] + p * total_groups, part_shift),
                        (task[0] + p * total_groups) & part_mask,
                        tx,
                        thread_in_group,
                        threads_per_row,
                        units_per_task,
                        hidden_vectors,
                        row_stride_vectors,
                    )
                if in_shared:
                    T.ptx_commit_group()
                load_expert_word(
                    expert_map,
                    task[0] + p * total_groups,
                    part_shift,
                    num_rows,
                    has_padding,
                    expert_stride,
                    expert_offset,
                    expert_words,
                    p + 1,
                )
            load_expert_word(
                expert_map,
                task[0] + (stages - 1) * total_groups,
                part_shift,
                num_rows,
                has_padding,
                expert_stride,
                expert_offset,
                expert_words,
                0,
            )
            for p in T.unroll(2):
                load_weight_index(
                    topk_index,
                    task[0] + p * total_groups,
                    part_shift,
                    num_rows,
                    has_weights,
                    index_stride,
                    index_offset,
                    weight_index,
                    p,
                )

            if use_table:
                fill_silu_table(exchange, tx, threads)
            if clamp:
                silu_clamp[0] = silu_direct(clamp_value)
            for c in T.unroll(CLAMP_COUNTERS):
                counts[c] = 0
            T.sync_threads()

            active_bits[0] = 0
            for p in T.unroll(stages - 1):
                if T.shift_right(task[0] + p * total_groups, part_shift) < num_rows and expert_words[p + 1] >= 0:
                    active_bits[0] = active_bits[0] | T.shift_left(1, p)
            load_weight(
                topk_weights,
                weight_index[0],
                has_weights,
                weights_numel,
                weights_topk,
                weights_row_stride,
                weights_col_stride,
                weight,
                0,
            )

            for _round in T.serial(T.ceildiv(T.ceildiv(T.shift_left(num_rows, part_shift), total_groups), stages)):
                for s in T.unroll(stages):
                    # 1. The task stages − 1 steps ahead: its flag (its routing word came a step ago)
                    #    and its loads, into the stage this step's task frees.
                    load_slot = (s + stages - 1) % stages
                    load_task = task[0] + (stages - 1) * total_groups
                    load_row = T.shift_right(load_task, part_shift)
                    load_bit = T.shift_left(1, load_slot)
                    active_bits[0] = active_bits[0] & (all_stages ^ load_bit)
                    if in_shared:
                        # The copies overwrite the stage read in the last step: a compiler fence (the
                        # copies are asm statements without a memory clobber).
                        T.sync_warp()
                    if load_row < num_rows and expert_words[0] >= 0:
                        active_bits[0] = active_bits[0] | load_bit
                        issue_loads(
                            x,
                            held_gate,
                            held_up,
                            staged,
                            load_slot,
                            load_row,
                            load_task & part_mask,
                            tx,
                            thread_in_group,
                            threads_per_row,
                            units_per_task,
                            hidden_vectors,
                            row_stride_vectors,
                        )
                    if in_shared:
                        T.ptx_commit_group()
                    # 2. Routing, a step ahead of its use: the next load's pos_to_expert word, the next
                    #    task's weight, the weight index of the task after it.
                    load_expert_word(
                        expert_map,
                        load_task + total_groups,
                        part_shift,
                        num_rows,
                        has_padding,
                        expert_stride,
                        expert_offset,
                        expert_words,
                        0,
                    )
                    load_weight(
                        topk_weights,
                        weight_index[1],
                        has_weights,
                        weights_numel,
                        weights_topk,
                        weights_row_stride,
                        weights_col_stride,
                        weight,
                        1,
                    )
                    load_weight_index(
                        topk_index,
                        task[0] + 2 * total_groups,
                        part_shift,
                        num_rows,
                        has_weights,
                        index_stride,
                        index_offset,
                        weight_index,
                        1,
                    )

                    # 3. This step's task (staged: wait for its copies; the warp sync keeps the compiler
                    #    from moving the reads of the ring above the wait).
                    row = T.shift_right(task[0], part_shift)
                    part = task[0] & part_mask
                    active = T.shift_right(active_bits[0], s) & 1
                    q_row = T.cast(row, "int64") * hidden_stores
                    if in_shared:
                        T.call_extern("handle", f"tl::cp_async_wait<{stages - 1}>")
                        T.sync_warp()

                    # 4. The activation, unit by unit (staged: fetched from the ring first), element
                    #    by element, and each unit's |a| maximum (fp32 bits: an integer max ranks NaN
                    #    above Inf, so NaN propagates as in the reference).
                    if active != 0:
                        for r in T.unroll(units_per_thread):
                            if in_shared:
                                fetch_staged(
                                    staged,
                                    held_gate,
                                    held_up,
                                    s,
                                    r,
                                    part * units_per_task + r * threads_per_row + thread_in_group,
                                    tx,
                                    hidden_vectors,
                                )
                            unit_amax[r] = 0
                            for e in T.unroll(chunk):
                                gate = element_value(held_gate, 0 if in_shared else s, 0 if in_shared else r, e)
                                up = element_value(held_up, 0 if in_shared else s, 0 if in_shared else r, e)
                                if clamp:
                                    count_clamps(gate, up, clamp_value, counts)
                                swiglu_element(
                                    gate,
                                    up,
                                    weight[0],
                                    clamp_value,
                                    silu_clamp,
                                    exchange,
                                    silu,
                                    element,
                                    use_table,
                                    clamp,
                                )
                                acts[r, e] = element[0]
                                if not activation_only:
                                    unit_amax[r] = T.max(unit_amax[r], float_bits_abs(element[0]))

                    # 5. Scales: per 1×128 block (lanes of one warp) or per row (the row group's warps).
                    if not activation_only:
                        if row_scales != 0:
                            # Two barriers: the slots are free (last step's readers are done), then full.
                            T.sync_threads()
                            if active != 0:
                                group_amax[0] = unit_amax[0]
                                for r in T.unroll(1, units_per_thread):
                                    group_amax[0] = T.max(group_amax[0], unit_amax[r])
                                for step in T.unroll(5):
                                    group_amax[0] = T.max(group_amax[0], T.shfl_xor(group_amax[0], 1 << step))
                                if lane == 0:
                                    exchange[amax_base + warp] = group_amax[0]
                            T.sync_threads()
                            if active != 0:
                                first_warp = T.shift_right(group_in_cta * threads_per_row, 5)
                                group_amax[0] = 0
                                for w in T.serial(T.shift_right(threads_per_row, 5)):
                                    slot = exchange[amax_base + first_warp + w]
                                    group_amax[0] = T.max(group_amax[0], slot)
                                scale_and_multiplier(group_amax[0], fmt, round_sf != 0, sf_value, multiplier)
                                if thread_in_group == 0:
                                    store_scale(sf, sf_value, row, 0, num_kblocks, sf_row_stride, sf_kblock_stride)
                                for r in T.unroll(units_per_thread):
                                    unit_multiplier[r] = multiplier[0]
                        else:
                            if active != 0:
                                for r in T.unroll(units_per_thread):
                                    for step in T.unroll(block_shuffles):
                                        unit_amax[r] = T.max(unit_amax[r], T.shfl_xor(unit_amax[r], 1 << step))
                                # An owner lane alone divides and stores its block's scale; the multipliers
                                # travel back by shuffle.
                                owned_amax[0] = 0
                                for r in T.unroll(units_per_thread):
                                    fetched = T.shfl_sync(unit_amax[r], owner_group * lanes_per_block)
                                    owned_amax[0] = T.if_then_else(owner_round == r, fetched, owned_amax[0])
                                kblock[0] = T.shift_right(part * units_per_task, block_shuffles) + owner_block[0]
                                scale_and_multiplier(owned_amax[0], fmt, round_sf != 0, sf_value, multiplier)
                                if lane < scale_owners and kblock[0] < num_kblocks:
                                    store_scale(
                                        sf, sf_value, row, kblock[0], num_kblocks, sf_row_stride, sf_kblock_stride
                                    )
                                for r in T.unroll(units_per_thread):
                                    unit_multiplier[r] = T.shfl_sync(
                                        multiplier[0], r * groups_per_warp + lane // lanes_per_block
                                    )

                    # 6. Encode and store, one wide store per ``store_vector`` elements.
                    if active != 0:
                        for r in T.unroll(units_per_thread):
                            unit = part * units_per_task + r * threads_per_row + thread_in_group
                            for s_store in T.unroll(stores_per_unit):
                                column = unit * stores_per_unit + s_store
                                if column < hidden_stores:
                                    if activation_only:
                                        # Round to nearest even, as torch's .to(torch.bfloat16).
                                        for e in T.vectorized(store_vector):
                                            q[(q_row + column) * store_vector + e] = T.cast(
                                                acts[r, s_store * store_vector + e], "bfloat16"
                                            )
                                    else:
                                        q_offset = (q_row + column) * store_bytes
                                        store_encoded_vector(
                                            q,
                                            q_offset,
                                            acts,
                                            r,
                                            s_store * store_vector,
                                            unit_multiplier[r],
                                            fmt,
                                            store_vector,
                                            codes,
                                        )
                    weight[0] = weight[1]
                    task[0] = task[0] + total_groups

            # 7. Clamp counts: warp sums, one shared slot per warp, one int64 atomic per counter and CTA.
            if clamp:
                if has_count != 0:
                    for c in T.unroll(CLAMP_COUNTERS):
                        for step in T.unroll(5):
                            counts[c] = counts[c] + T.shfl_xor(counts[c], 1 << step)
                    if lane == 0:
                        for c in T.unroll(CLAMP_COUNTERS):
                            exchange[count_base + warp * CLAMP_COUNTERS + c] = counts[c]
                    T.sync_threads()
                    if tx < CLAMP_COUNTERS:
                        total = T.alloc_local((1,), "int64")
                        total[0] = T.int64(0)
                        for w in T.serial(warps):
                            total[0] = total[0] + T.cast(exchange[count_base + w * CLAMP_COUNTERS + tx], "int64")
                        T.atomic_add(clamped_count[tx * count_stride], total[0])

    return kernel


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _vector_width(x: torch.Tensor, hidden: int) -> int:
    """Widest load (elements, at most 16 bytes) that H (the offset of the up half), the row stride
    and the base address allow."""
    element_bytes = x.element_size()
    vector = 16 // element_bytes
    while vector > 1 and (
        hidden % vector or (x.shape[0] > 1 and x.stride(0) % vector) or address(x) % (vector * element_bytes)
    ):
        vector //= 2
    return vector


def _store_width(hidden: int, chunk: int) -> int:
    """Widest store of q (elements): a power of two dividing H (rows of q are H apart), at most a unit."""
    width = chunk
    while hidden % width:
        width //= 2
    return width


class _Plan(NamedTuple):
    """One call's row groups and schedule (``_fitted_plan``)."""

    threads: int
    threads_per_row: int
    units_per_thread: int
    part_shift: int  # a row is 2^part_shift tasks
    stages: int
    staging: str


@functools.lru_cache(maxsize=256)
def _fitted_plan(hidden: int, row_scales: bool, dtype: torch.dtype, vector: int, schedule: ForwardSchedule) -> _Plan:
    """``FORWARD_SCHEDULE[dtype]`` fitted to the row: the smallest row group (whole warps, at most a
    CTA) whose task of ``units_per_thread`` units covers the row. Block scales split a longer row into
    a power of two of parts (a part past the row's end is an empty task); row scales need the whole
    row in one task, so a row longer than ``threads · units_per_thread · CHUNK`` values takes more
    units per thread (a separately compiled kernel). Single bf16 values (odd H) are staged in
    registers, one unit per thread; stages are dropped while the staging does not fit (shared memory
    or REGISTER_STAGE_WORDS), and a shared stage that never fits stages in registers."""
    # 32-bit words of gate and up per unit: bf16 pairs, or fp32 values (also single bf16 values).
    unit_words = CHUNK if dtype == torch.bfloat16 and vector > 1 else 2 * CHUNK
    staging, units_per_thread = schedule.staging, schedule.units_per_thread
    if dtype == torch.bfloat16 and vector == 1:
        staging, units_per_thread = STAGING_REGISTERS, 1
    units = ceil_div(hidden, CHUNK)
    threads_per_row = 32
    while threads_per_row < schedule.threads and threads_per_row * units_per_thread < units:
        threads_per_row *= 2
    if row_scales:
        units_per_thread = max(units_per_thread, ceil_div(units, threads_per_row))
    part_shift = (ceil_div(units, threads_per_row * units_per_thread) - 1).bit_length()
    stages = schedule.stages
    if staging == STAGING_SHARED:
        # The exchange buffer (table, warp slots), then the ring; 1 KiB for TileLang's alignment.
        fixed_bytes = 4 * ((TABLE_WORDS if dtype == torch.bfloat16 else 0) + 4 * (schedule.threads // 32)) + 1024
        stage_bytes = 4 * schedule.threads * units_per_thread * unit_words
        while stages > 1 and fixed_bytes + stages * stage_bytes > SHARED_MEMORY_BYTES:
            stages -= 1
        if fixed_bytes + stage_bytes > SHARED_MEMORY_BYTES:
            staging = STAGING_REGISTERS
    if staging == STAGING_REGISTERS:
        while stages > 1 and stages * units_per_thread * unit_words > REGISTER_STAGE_WORDS:
            stages -= 1
    return _Plan(schedule.threads, threads_per_row, units_per_thread, part_shift, stages, staging)


def _index_layout(index: torch.Tensor | None, word: int) -> tuple[int, int]:
    """(stride, offset) in int32 words of an int32/int64 index vector read as words (``_index_words``).
    ``word`` picks the int64 half: 0 the low word (the value of a small index), 1 the high word (the
    sign). (0, 0) for an absent or empty vector."""
    if index is None or index.numel() == 0:
        return 0, 0
    if index.dtype == torch.int32:
        return index.stride(0), 0
    return 2 * index.stride(0), word


def _index_words(index: torch.Tensor) -> torch.Tensor:
    """An int32/int64 index vector as int32 words (flat)."""
    return flat_view(index) if index.dtype == torch.int32 else flat_view(index).view(torch.int32)


def _check_forward_arguments(
    x, fmt, num_per_channels, pos_to_token_topk, topk_weights, pos_to_expert, flags, swiglu_clamp_value, clamped_count
):
    """The reference's checks, in its order and with its messages, except the range of
    ``pos_to_token_topk`` (data-dependent: it would synchronize with the device on every call)."""
    spec = check_cast_format(fmt)
    check_tensor("x", x, dtypes=CAST_INPUT_DTYPES, ndim=2)
    check_unit_inner_stride("x", x)
    rows, hidden = x.shape[0], check_gate_up("x", x)
    check_int("num_per_channels", num_per_channels)
    if num_per_channels not in (FORWARD_CHANNEL_BLOCK, hidden):
        raise ValueError(
            f"num_per_channels must be {FORWARD_CHANNEL_BLOCK} or the hidden size {hidden}, got {num_per_channels}"
        )
    check_per_token_blocks(spec, hidden, num_per_channels)
    round_sf = check_scale_flags(spec, *flags)
    if (pos_to_token_topk is None) != (topk_weights is None):
        raise ValueError(
            "pos_to_token_topk and topk_weights must be given together (the weight of row r is "
            "topk_weights.flatten()[pos_to_token_topk[r]]) or both be None"
        )
    if pos_to_token_topk is not None:
        check_index_vector("pos_to_token_topk", pos_to_token_topk, rows, x.device)
        check_topk_weights("topk_weights", topk_weights, x.device)
        if topk_weights.numel() >= 2**31:
            raise ValueError(f"topk_weights must have fewer than 2^31 elements, got {topk_weights.numel()}")
    if pos_to_expert is not None:
        check_index_vector("pos_to_expert", pos_to_expert, rows, x.device)
    clamp_value = check_clamp(swiglu_clamp_value)
    if clamped_count is not None:
        if clamp_value is None:
            raise ValueError("clamped_count counts clamped elements: it needs a swiglu_clamp_value")
        check_tensor("clamped_count", clamped_count, dtypes=(torch.int64,), ndim=1)
        if clamped_count.shape[0] != CLAMP_COUNTERS:
            raise ValueError(f"clamped_count must have shape ({CLAMP_COUNTERS},), got {tuple(clamped_count.shape)}")
        check_on_device("clamped_count", clamped_count, x.device)
    return spec, hidden, round_sf, clamp_value


def _launch_plan(
    x: torch.Tensor,
    hidden: int,
    fmt_name: str,
    num_per_channels: int,
    q_dtype: torch.dtype,
    sf_strides: tuple[int, int] | None,
    *,
    packed: bool = False,
    round_sf: bool = False,
    clamp_value: float | None = None,
    pos_to_token_topk: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    pos_to_expert: torch.Tensor | None = None,
    clamped_count: torch.Tensor | None = None,
    schedule: ForwardSchedule | None = None,
):
    """Compile (or fetch) the kernel for calls of these signatures (checked by the caller; q of
    ``q_dtype`` contiguous, sf with ``sf_strides`` or None) and decide the launch:
    ``launch(x, q, sf, pos_to_token_topk, topk_weights, pos_to_expert, clamped_count)`` (a no-op
    while compiling only or for zero rows)."""
    rows = x.shape[0]
    if rows == 0 or outputs_only_active():
        # Under outputs_only nothing is built or launched, and the sizes may be symbolic
        # (torch.compile's dynamic shapes), which the memoized schedule cannot hash.
        return lambda *tensors: None
    vector = _vector_width(x, hidden)
    store_vector = _store_width(hidden, CHUNK)
    # One scale per row of at most 128 values is the single (partial) 1×128 block of the row.
    row_scales = fmt_name != ACTIVATION_ONLY and num_per_channels == hidden and hidden > FORWARD_CHANNEL_BLOCK
    plan = _fitted_plan(hidden, row_scales, x.dtype, vector, schedule or FORWARD_SCHEDULE[x.dtype])
    clamp = clamp_value is not None
    kernel = swiglu_per_token_kernel(
        _TL_DTYPES[x.dtype],
        fmt_name,
        vector,
        store_vector,
        packed,
        clamp,
        plan.units_per_thread,
        plan.stages,
        plan.staging,
        plan.threads,
    )
    if compiling_only():
        return lambda *tensors: None

    device = x.device
    groups_per_cta = plan.threads // plan.threads_per_row
    tasks = rows << plan.part_shift
    num_ctas = max(1, min(sm_count(device), ceil_div(tasks, groups_per_cta)))
    # Absent inputs and outputs (their flags are off): constants made once per device, not a fill
    # kernel per call (each would add ~1.5 µs to the operator's GPU time).
    placeholder_int = device_constant(torch.int32, device)
    absent_sf = device_constant(torch.float32, device)
    if sf_strides is None:
        sf_row_stride, sf_kblock_stride = 0, 0
    elif packed:
        # int32 words [rows, kwords] with strides (1, ld): pass the bytes; ld counts words.
        sf_row_stride, sf_kblock_stride = sf_strides[1], 0
    else:
        sf_row_stride, sf_kblock_stride = sf_strides
    # Rows as 32-bit words (bf16 pairs or fp32 values), except single bf16 values.
    as_words = x.dtype == torch.float32 or vector % 2 == 0
    row_stride_vectors = x.stride(0) // vector if rows > 1 else 2 * hidden // vector
    q_bytes = q_dtype == torch.int8
    has_experts = pos_to_expert is not None and pos_to_expert.numel() > 0
    expert_stride, expert_offset = _index_layout(pos_to_expert, 1)
    has_indices = pos_to_token_topk is not None and pos_to_token_topk.numel() > 0
    index_stride, index_offset = _index_layout(pos_to_token_topk, 0)
    has_weights = topk_weights is not None
    weighted = has_weights and topk_weights.numel() > 0
    absent_weights = device_constant(torch.float32, device)
    if weighted:
        tokens, topk = topk_weights.shape
        if tokens == 1 or topk_weights.stride(0) == topk * topk_weights.stride(1):
            # The flat index maps linearly: the kernel skips the division by topk.
            weights_shape = (0, 0, topk_weights.stride(1))
        else:
            weights_shape = (topk, topk_weights.stride(0), topk_weights.stride(1))
    else:
        weights_shape = (1, 0, 0)
    absent_count = device_constant(torch.int64, device)
    count_stride = clamped_count.stride(0) if clamped_count is not None else 0
    # The clamp as the kernel sees it: rounded once to fp32 (+Inf, which clamps nothing, without one).
    clamp_fp32 = float("inf") if clamp_value is None else float(torch.tensor(clamp_value, dtype=torch.float32))
    scalars = (
        num_ctas,
        rows,
        hidden // vector,
        row_stride_vectors,
        hidden // store_vector,
        ceil_div(hidden, num_per_channels),
        sf_row_stride,
        sf_kblock_stride,
        int(round_sf),
        int(row_scales),
        plan.threads_per_row.bit_length() - 1,
        plan.part_shift,
        int(pos_to_expert is not None),
        expert_stride,
        expert_offset,
        int(has_weights),
        index_stride,
        index_offset,
        topk_weights.numel() if has_weights else 0,
        *weights_shape,
        clamp_fp32,
        int(clamped_count is not None),
        count_stride,
    )

    def launch(x, q, sf, pos_to_token_topk, topk_weights, pos_to_expert, clamped_count):
        if sf is None:
            sf_argument = absent_sf
        else:
            sf_argument = flat_view(sf).view(torch.uint8) if packed else flat_view(sf)
        kernel(
            flat_view(x).view(torch.int32) if as_words else flat_view(x),
            flat_view(q).view(torch.uint8) if q_bytes else flat_view(q),
            sf_argument,
            _index_words(pos_to_expert) if has_experts else placeholder_int,
            _index_words(pos_to_token_topk) if has_indices else placeholder_int,
            flat_view(topk_weights) if weighted else absent_weights,
            flat_view(clamped_count) if clamped_count is not None else absent_count,
            *scalars,
        )

    return launch


def _launch(x, hidden, fmt_name, num_per_channels, q, sf, **options) -> None:
    """Plan and launch once (``_launch_plan`` for a call that keeps no plan)."""
    sf_strides = None if sf is None else sf.stride()
    launch = _launch_plan(x, hidden, fmt_name, num_per_channels, q.dtype, sf_strides, **options)
    optional = ("pos_to_token_topk", "topk_weights", "pos_to_expert", "clamped_count")
    launch(x, q, sf, *(options.get(name) for name in optional))


def _forward_plan(
    x,
    fmt,
    num_per_channels,
    pos_to_token_topk,
    topk_weights,
    pos_to_expert,
    use_tma_aligned_col_major_sf,
    round_sf,
    use_packed_ue8m0,
    swiglu_clamp_value,
    clamped_count,
    sm_limit_setting,
    schedule,
):
    """Check a ``swiglu_forward_and_per_token_cast`` of these signatures and decide its launch
    (``sm_limit_setting``: the grid depends on the SM count; ``schedule``: ``FORWARD_SCHEDULE``'s entry
    for x's dtype when the call was made, so that a sweep that replaces it gets new plans). The plan:
    ``run(x, pos_to_token_topk, topk_weights, pos_to_expert, clamped_count) -> (q, sf)``."""
    flags = (round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    spec, hidden, round_sf, clamp_value = _check_forward_arguments(
        x,
        fmt,
        num_per_channels,
        pos_to_token_topk,
        topk_weights,
        pos_to_expert,
        flags,
        swiglu_clamp_value,
        clamped_count,
    )
    require_cuda("x", x)
    rows = x.shape[0]
    device = x.device
    layout = ScaleLayout.from_flags(use_tma_aligned_col_major_sf, use_packed_ue8m0)
    kblocks = ceil_div(hidden, num_per_channels)
    data_shape = (rows, hidden // spec.values_per_byte)
    launch = _launch_plan(
        x,
        hidden,
        spec.name,
        num_per_channels,
        spec.storage_dtype,
        layout.empty(rows, kblocks, "meta").stride(),
        packed=use_packed_ue8m0,
        round_sf=round_sf,
        clamp_value=clamp_value,
        pos_to_token_topk=pos_to_token_topk,
        topk_weights=topk_weights,
        pos_to_expert=pos_to_expert,
        clamped_count=clamped_count,
        schedule=schedule,
    )

    def run(x, pos_to_token_topk, topk_weights, pos_to_expert, clamped_count):
        sf = new_output(layout.empty(rows, kblocks, device))
        q = new_output(torch.empty(data_shape, dtype=spec.storage_dtype, device=device))
        launch(x, q, sf, pos_to_token_topk, topk_weights, pos_to_expert, clamped_count)
        return q, sf

    return run


_FORWARD_PLANS = LaunchPlans(_forward_plan)


def swiglu_forward_and_per_token_cast(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    pos_to_token_topk: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    pos_to_expert: torch.Tensor | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    swiglu_clamp_value: float | None = None,
    clamped_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU of each row (optionally weighted), kept in fp32 and quantized per token; same contract
    as ``tileproof.reference.quant_swiglu.swiglu_forward_and_per_token_cast``, bit for bit, except
    that padding rows (``pos_to_expert < 0``) are not written (the contract leaves them unspecified)
    and the entries of ``pos_to_token_topk`` are not range-checked (an entry outside
    ``[0, topk_weights.numel())`` gives weight 0)."""
    arguments = (
        x,
        fmt,
        num_per_channels,
        pos_to_token_topk,
        topk_weights,
        pos_to_expert,
        use_tma_aligned_col_major_sf,
        round_sf,
        use_packed_ue8m0,
        swiglu_clamp_value,
        clamped_count,
        os.environ.get(SM_LIMIT_ENV),
        FORWARD_SCHEDULE.get(getattr(x, "dtype", None)),
    )
    plan = _FORWARD_PLANS.plan(*arguments)
    return plan(x, pos_to_token_topk, topk_weights, pos_to_expert, clamped_count)


def swiglu_forward_and_per_channel_cast_and_transpose(
    x: torch.Tensor,
    fmt: str,
    num_per_tokens: int,
    round_sf: bool = False,
    without_transpose: bool = False,
    swiglu_clamp_value: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU of each row rounded to bf16, then cast per channel (and by default transposed); same
    contract as the reference twin, bit for bit.

    Two of our kernels, composed: ``swiglu_per_token_kernel`` writes the bf16 activation ``[T, H]``
    (one pass over x), then the optimized ``per_channel_cast_and_transpose`` (or ``per_channel_cast``
    with ``without_transpose``) casts it. The intermediate costs one extra write and read of 2 bytes
    per element (9 bytes per element moved instead of 5); a fused kernel would stage the activation
    tile in shared memory instead.
    """
    check_choice("fmt", fmt, (E4M3.name,))
    check_num_per_tokens(num_per_tokens)
    check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=2)
    check_unit_inner_stride("x", x)
    hidden = check_gate_up("x", x)
    check_scale_flags(E4M3, round_sf, False)
    if not isinstance(without_transpose, bool):
        raise TypeError(f"without_transpose must be a bool, got {type(without_transpose).__name__}")
    clamp_value = check_clamp(swiglu_clamp_value)
    require_cuda("x", x)
    # The casts below run even with zero tokens: they allocate the outputs of the right shapes.
    activation = torch.empty((x.shape[0], hidden), dtype=torch.bfloat16, device=x.device)
    _launch(x, hidden, ACTIVATION_ONLY, hidden, activation, None, clamp_value=clamp_value)
    from . import blocks

    if without_transpose:
        return blocks.per_channel_cast(activation, fmt, num_per_tokens, round_sf)
    transpose_cast = _per_channel_cast_and_transpose()
    if transpose_cast is None:
        raise NotImplementedError(
            "swiglu_forward_and_per_channel_cast_and_transpose needs the optimized per_channel_cast_and_transpose, "
            "which tileproof.optimized.quant does not provide yet"
        )
    return transpose_cast(activation, fmt, num_per_tokens, round_sf)


def _per_channel_cast_and_transpose():
    """The optimized ``per_channel_cast_and_transpose``, or None while the package lacks it."""
    import tileproof.optimized.quant as quant

    return getattr(quant, "per_channel_cast_and_transpose", None)


# ---------------------------------------------------------------------------------------------
# Backward + per-token cast of the input gradient
# ---------------------------------------------------------------------------------------------


@jit()
def swiglu_backward_kernel(
    num_per_channels: int,
    q_vector: int,
    go_vector: int,
    clamp: bool,
    units_per_thread: int,
    threads: int = THREADS,
    chunk: int = CHUNK,
):
    """The backward for one whole row per row-group task (its ``dweight`` sum needs the row).

    Per element, in the reference's order (module docstring of ``reference.quant_swiglu``): ``g, u =
    fl(decode(q) · sf)``, the clamp, ``t = fl(1 + E(−g))``, ``act = fl(fl(g / t) · u)``, ``s = fl(1 / t)``,
    ``out = bf16(fl(act · w))``, ``gw = fl(fl(go · w) · s)``, ``dg = fl(fl(gw · u) · fma(g, fl(1 − s), 1))``,
    ``du = fl(gw · g)`` (+0 where clamped). ``out`` and ``dx`` are stored at once; ``dg`` and ``du`` wait in
    registers for their 1×C block scales (lanes of one warp: C / CHUNK of them); ``dweight`` of the
    row's slot is an fp32 sum of ``go · act`` (per thread, then a shuffle tree, then the row group's
    warps in order: deterministic), written by the row group's first thread. Slots without a row are
    zeroed first, by a grid-stride pass. ``E`` is the direct fp64 ``exp`` (a dequantized gate is any fp32).

    ``q_vector``: bytes per load of x_q (divides CHUNK); ``go_vector``: elements per load of grad_out.
    """
    warps = threads // 32
    lanes_per_block = num_per_channels // chunk
    block_shuffles = lanes_per_block.bit_length() - 1
    q_loads = chunk // q_vector
    go_words = go_vector % 2 == 0
    go_width = go_vector // 2 if go_words else go_vector  # loaded per go vector, in its storage dtype
    go_loads = chunk // go_vector
    go_held = go_loads * go_width
    go_dtype = "int32" if go_words else "bfloat16"
    go_value_dtype = "int32" if go_words else "float32"

    q_span = T.dynamic("q_span")
    x_sf_span = T.dynamic("x_sf_span")
    go_span = T.dynamic("go_span")
    weight_span = T.dynamic("weight_span")
    slot_span = T.dynamic("slot_span")
    row_span = T.dynamic("row_span")
    out_span = T.dynamic("out_span")
    dx_q_span = T.dynamic("dx_q_span")
    dx_sf_span = T.dynamic("dx_sf_span")
    dx_span = T.dynamic("dx_span")
    dweight_span = T.dynamic("dweight_span")

    def go_value(held, r, e):
        return widen_half(held[r, e // 2], e % 2) if go_words else held[r, e]

    def unless_clamped(gradient, clamped):
        """+0 where the input was clamped (the clamp is flat there), else the gradient."""
        return T.if_then_else(clamped, T.float32(0), gradient) if clamp else gradient

    @T.macro
    def load_row_info(
        row, info_slot, info_weight, slot_of_row, weight, num_rows, slot_stride, num_slots, topk, w_stride0, w_stride1
    ):
        """The row's routing slot (-1: none) and weight (0 without a slot)."""
        info_slot[0] = -1
        info_weight[0] = T.float32(0)
        if row < num_rows:
            info_slot[0] = slot_of_row[T.cast(row, "int64") * slot_stride]
            if info_slot[0] >= 0 and info_slot[0] < num_slots:
                token = info_slot[0] // topk
                info_weight[0] = weight[
                    T.cast(token, "int64") * w_stride0 + T.cast(info_slot[0] - token * topk, "int64") * w_stride1
                ]

    @T.macro
    def block_scale(amax, round_sf, sf_value, multiplier, dx_sf, index, owner):
        scale_and_multiplier(amax, E4M3, round_sf != 0, sf_value, multiplier)
        if owner:
            dx_sf[index] = sf_value[0]

    @T.prim_func
    def kernel(
        x_q: T.Tensor((q_span,), "float8_e4m3"),
        x_sf: T.Tensor((x_sf_span,), "float32"),
        grad_out: T.Tensor((go_span,), go_dtype),
        weight: T.Tensor((weight_span,), "float32"),
        slot_of_row: T.Tensor((slot_span,), "int32"),
        row_of_slot: T.Tensor((row_span,), "int32"),
        out: T.Tensor((out_span,), "bfloat16"),
        dx_q: T.Tensor((dx_q_span,), "float8_e4m3"),
        dx_sf: T.Tensor((dx_sf_span,), "float32"),
        dx: T.Tensor((dx_span,), "bfloat16"),
        dweight: T.Tensor((dweight_span,), "float32"),
        num_ctas: T.int32,
        num_rows: T.int32,
        hidden_units: T.int32,
        q_row_stride_vectors: T.int32,
        x_sf_row_stride: T.int32,
        go_row_stride_vectors: T.int32,
        group_shift: T.int32,
        slot_stride: T.int32,
        row_of_slot_stride0: T.int32,
        row_of_slot_stride1: T.int32,
        row_of_slot_offset: T.int32,
        num_slots: T.int32,
        topk: T.int32,
        w_stride0: T.int32,
        w_stride1: T.int32,
        round_sf: T.int32,
        clamp_value: T.float32,
    ):
        with T.Kernel(num_ctas, threads=threads) as (cta,):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            exchange = T.alloc_shared((warps,), "float32")
            gate_q = T.alloc_local((units_per_thread, chunk), "float8_e4m3")
            up_q = T.alloc_local((units_per_thread, chunk), "float8_e4m3")
            go_held_values = T.alloc_local((units_per_thread, go_held), go_value_dtype)
            scales = T.alloc_local((units_per_thread, 2), "float32")
            d_gate = T.alloc_local((units_per_thread, chunk), "float32")
            d_up = T.alloc_local((units_per_thread, chunk), "float32")
            results = T.alloc_local((chunk,), "float32")
            values = T.alloc_local((7,), "float32")
            amax = T.alloc_local((units_per_thread, 2), "int32")
            multipliers = T.alloc_local((units_per_thread, 2), "float32")
            sf_value = T.alloc_local((1,), "float32")
            multiplier = T.alloc_local((1,), "float32")
            row_sum = T.alloc_local((1,), "float32")
            info_slot = T.alloc_local((1,), "int32")
            info_weight = T.alloc_local((1,), "float32")
            slot = T.alloc_local((1,), "int32")
            weight_value = T.alloc_local((1,), "float32")
            task_row = T.alloc_local((1,), "int32")
            current_row = T.alloc_local((1,), "int32")
            codes = T.alloc_local((1,), "uint8")

            threads_per_row = T.shift_left(1, group_shift)
            thread_in_group = tx & (threads_per_row - 1)
            group_in_cta = T.shift_right(tx, group_shift)
            groups_per_cta = T.shift_right(threads, group_shift)
            total_groups = num_ctas * groups_per_cta
            hidden = hidden_units * chunk
            blocks_per_half = hidden // num_per_channels

            # 0. dweight of the slots without a row is 0 (the rows write the others).
            for i in T.serial(T.ceildiv(num_slots, num_ctas * threads)):
                flat_slot = (i * num_ctas + cta) * threads + tx
                if flat_slot < num_slots:
                    token = flat_slot // topk
                    position = (
                        T.cast(token, "int64") * row_of_slot_stride0
                        + T.cast(flat_slot - token * topk, "int64") * row_of_slot_stride1
                        + row_of_slot_offset
                    )
                    if row_of_slot[position] < 0:
                        dweight[flat_slot] = T.float32(0)

            task_row[0] = cta * groups_per_cta + group_in_cta
            load_row_info(
                task_row[0],
                info_slot,
                info_weight,
                slot_of_row,
                weight,
                num_rows,
                slot_stride,
                num_slots,
                topk,
                w_stride0,
                w_stride1,
            )
            for _task in T.serial(T.ceildiv(num_rows, total_groups)):
                current_row[0] = task_row[0]
                row = current_row[0]
                slot[0] = info_slot[0]
                weight_value[0] = info_weight[0]
                active = row < num_rows
                q_row = T.cast(row, "int64") * q_row_stride_vectors * q_vector
                go_row = T.cast(row, "int64") * go_row_stride_vectors * go_width
                sf_row = T.cast(row, "int64") * x_sf_row_stride

                # 1. Loads: the row's quantized gate and up, their scales, grad_out.
                if active:
                    for r in T.unroll(units_per_thread):
                        unit = r * threads_per_row + thread_in_group
                        if unit < hidden_units:
                            for v in T.unroll(q_loads):
                                for b in T.vectorized(q_vector):
                                    gate_q[r, v * q_vector + b] = x_q[q_row + unit * chunk + v * q_vector + b]
                                for b in T.vectorized(q_vector):
                                    up_q[r, v * q_vector + b] = x_q[q_row + hidden + unit * chunk + v * q_vector + b]
                            for v in T.unroll(go_loads):
                                for w in T.vectorized(go_width):
                                    if go_words:
                                        go_held_values[r, v * go_width + w] = grad_out[
                                            go_row + (unit * go_loads + v) * go_width + w
                                        ]
                                    else:
                                        go_held_values[r, v * go_width + w] = T.cast(
                                            grad_out[go_row + (unit * go_loads + v) * go_width + w], "float32"
                                        )
                            kblock = unit * chunk // num_per_channels
                            scales[r, 0] = x_sf[sf_row + kblock]
                            scales[r, 1] = x_sf[sf_row + blocks_per_half + kblock]
                task_row[0] = task_row[0] + total_groups
                load_row_info(
                    task_row[0],
                    info_slot,
                    info_weight,
                    slot_of_row,
                    weight,
                    num_rows,
                    slot_stride,
                    num_slots,
                    topk,
                    w_stride0,
                    w_stride1,
                )

                # 2. The gradients, element by element; out and dx stored at once.
                row_sum[0] = T.float32(0)
                if active:
                    for r in T.unroll(units_per_thread):
                        unit = r * threads_per_row + thread_in_group
                        amax[r, 0] = 0
                        amax[r, 1] = 0
                        if unit < hidden_units:
                            for e in T.unroll(chunk):
                                gate = T.cast(gate_q[r, e], "float32") * scales[r, 0]
                                up = T.cast(up_q[r, e], "float32") * scales[r, 1]
                                # Local scalars (registers) hold the values used twice: TileLang may inline a named
                                # expression at each of its uses, the fp64 exp included.
                                values[0] = clamped_gate(gate, clamp_value, clamp)
                                values[1] = clamped_up(up, clamp_value, clamp)
                                values[2] = T.float32(1) + exp_rounded(-values[0])  # t
                                values[3] = T.ieee_fdiv(values[0], values[2]) * values[1]  # act
                                values[4] = T.ieee_fdiv(T.float32(1), values[2])  # s = σ(g)
                                values[5] = go_value(go_held_values, r, e)  # go
                                values[6] = values[5] * weight_value[0] * values[4]  # gw
                                factor = T.ieee_fmaf(values[0], T.float32(1) - values[4], T.float32(1))
                                d_gate[r, e] = unless_clamped(values[6] * values[1] * factor, gate > clamp_value)
                                d_up[r, e] = unless_clamped(
                                    values[6] * values[0], T.Or(up > clamp_value, up < -clamp_value)
                                )
                                results[e] = values[3] * weight_value[0]
                                row_sum[0] = row_sum[0] + values[5] * values[3]
                                amax[r, 0] = T.max(amax[r, 0], float_bits_abs(d_gate[r, e]))
                                amax[r, 1] = T.max(amax[r, 1], float_bits_abs(d_up[r, e]))
                            out_offset = (T.cast(row, "int64") * hidden_units + unit) * chunk
                            for e in T.vectorized(chunk):
                                out[out_offset + e] = T.cast(results[e], "bfloat16")
                            dx_offset = (T.cast(row, "int64") * 2 * hidden_units + unit) * chunk
                            for e in T.vectorized(chunk):
                                dx[dx_offset + e] = T.cast(d_gate[r, e], "bfloat16")
                            for e in T.vectorized(chunk):
                                dx[dx_offset + hidden + e] = T.cast(d_up[r, e], "bfloat16")

                    # 3. 1×C block scales of dg (gate half) and du (up half): lanes of one warp.
                    for r in T.unroll(units_per_thread):
                        for h in T.unroll(2):
                            for step in T.unroll(block_shuffles):
                                amax[r, h] = T.max(amax[r, h], T.shfl_xor(amax[r, h], 1 << step))
                    for r in T.unroll(units_per_thread):
                        unit = r * threads_per_row + thread_in_group
                        kblock = unit * chunk // num_per_channels
                        owner = unit < hidden_units and lane % lanes_per_block == 0
                        sf_base = T.cast(row, "int64") * 2 * blocks_per_half
                        for h in T.unroll(2):
                            block_scale(
                                amax[r, h],
                                round_sf,
                                sf_value,
                                multiplier,
                                dx_sf,
                                sf_base + h * blocks_per_half + kblock,
                                owner,
                            )
                            multipliers[r, h] = multiplier[0]
                        if unit < hidden_units:
                            q_offset = (T.cast(row, "int64") * 2 * hidden_units + unit) * chunk
                            store_encoded_vector(dx_q, q_offset, d_gate, r, 0, multipliers[r, 0], E4M3, chunk, codes)
                            store_encoded_vector(
                                dx_q, q_offset + hidden, d_up, r, 0, multipliers[r, 1], E4M3, chunk, codes
                            )

                # 4. dweight[slot] = Σ go · act over the row (fixed order: deterministic).
                for step in T.unroll(5):
                    row_sum[0] = row_sum[0] + T.shfl_xor(row_sum[0], 1 << step)
                T.sync_threads()
                if lane == 0:
                    exchange[warp] = row_sum[0]
                T.sync_threads()
                if active and thread_in_group == 0 and slot[0] >= 0 and slot[0] < num_slots:
                    first_warp = T.shift_right(group_in_cta * threads_per_row, 5)
                    row_sum[0] = T.float32(0)
                    for w in T.serial(T.shift_right(threads_per_row, 5)):
                        row_sum[0] = row_sum[0] + exchange[first_warp + w]
                    dweight[slot[0]] = row_sum[0]

    return kernel


def _load_width(tensor: torch.Tensor, limit_bytes: int) -> int:
    """Widest load (elements, at most ``limit_bytes``) that the row stride and base address allow."""
    element_bytes = tensor.element_size()
    vector = limit_bytes // element_bytes
    while vector > 1 and (
        (tensor.shape[0] > 1 and tensor.stride(0) % vector) or address(tensor) % (vector * element_bytes)
    ):
        vector //= 2
    return vector


def swiglu_backward_and_per_token_cast(
    x,
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    pos_to_token_topk: torch.Tensor,
    token_topk_to_pos: torch.Tensor,
    num_per_channels: int,
    round_sf: bool = False,
    swiglu_clamp_value: float | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Backward of ``out = silu(g) · u · w`` from the quantized forward input, dx also quantized; same
    contract as the reference twin (``dx_q``, ``dx_sf`` bit for bit; ``out``, ``dx`` the same fp32
    sequence; ``dweight`` an fp32 sum within the documented bound), except that the two mappings are
    trusted: their ranges and inverse relation are not checked (data-dependent: a device
    synchronization on every call)."""
    x_q, x_sf, rows, hidden, kblocks = check_backward_inputs(
        x, grad_out, weight, pos_to_token_topk, token_topk_to_pos, num_per_channels
    )
    if weight.numel() >= 2**31:
        raise ValueError(f"weight must have fewer than 2^31 elements, got {weight.numel()}")
    round_sf = check_scale_flags(E4M3, round_sf, False)
    clamp_value = check_clamp(swiglu_clamp_value)
    require_cuda("x[0]", x_q)

    device = x_q.device
    out = new_output(torch.empty((rows, hidden), dtype=torch.bfloat16, device=device))
    dx_q = new_output(torch.empty((rows, 2 * hidden), dtype=torch.float8_e4m3fn, device=device))
    dx_sf = new_output(torch.empty((rows, kblocks), dtype=torch.float32, device=device))
    dx = new_output(torch.empty((rows, 2 * hidden), dtype=torch.bfloat16, device=device))
    dweight = new_output(torch.empty(tuple(weight.shape), dtype=torch.float32, device=device))
    if rows == 0 and weight.numel() == 0:
        return out, (dx_q, dx_sf), dx, dweight

    q_vector = _load_width(x_q, CHUNK)
    go_vector = _load_width(grad_out, 2 * CHUNK)
    units = hidden // CHUNK
    threads_per_row = 32
    while threads_per_row < THREADS and threads_per_row < units:
        threads_per_row *= 2
    units_per_thread = ceil_div(units, threads_per_row)
    kernel = swiglu_backward_kernel(num_per_channels, q_vector, go_vector, clamp_value is not None, units_per_thread)
    if compiling_only():
        return out, (dx_q, dx_sf), dx, dweight

    groups_per_cta = THREADS // threads_per_row
    slots = weight.numel()
    num_ctas = max(1, min(sm_count(device) * MIN_BLOCKS, max(ceil_div(rows, groups_per_cta), ceil_div(slots, THREADS))))
    # Tensors without elements are passed as constants made once per device (the kernel touches none of
    # their elements), not as a fill kernel per call.
    placeholder_int = device_constant(torch.int32, device)
    slot_stride, _ = _index_layout(pos_to_token_topk, 0)
    has_slots = pos_to_token_topk is not None and pos_to_token_topk.numel() > 0
    slot_words = _index_words(pos_to_token_topk) if has_slots else placeholder_int
    if token_topk_to_pos.numel():
        words = 2 if token_topk_to_pos.dtype == torch.int64 else 1
        row_words = flat_view(token_topk_to_pos).view(torch.int32)
        row_strides = (token_topk_to_pos.stride(0) * words, token_topk_to_pos.stride(1) * words, words - 1)
    else:
        row_words, row_strides = placeholder_int, (0, 0, 0)
    go_argument = flat_view(grad_out).view(torch.int32) if go_vector % 2 == 0 else flat_view(grad_out)

    def flat_or_constant(tensor):
        return flat_view(tensor) if tensor.numel() else device_constant(tensor.dtype, device)

    kernel(
        flat_or_constant(x_q),
        flat_or_constant(x_sf),
        go_argument if grad_out.numel() else device_constant(go_argument.dtype, device),
        flat_or_constant(weight),
        slot_words,
        row_words,
        flat_or_constant(out),
        flat_or_constant(dx_q),
        flat_or_constant(dx_sf),
        flat_or_constant(dx),
        flat_or_constant(dweight),
        num_ctas,
        rows,
        units,
        x_q.stride(0) // q_vector if rows > 1 else 2 * hidden // q_vector,
        x_sf.stride(0) if rows > 1 else kblocks,
        grad_out.stride(0) // go_vector if rows > 1 else hidden // go_vector,
        threads_per_row.bit_length() - 1,
        slot_stride,
        *row_strides,
        slots,
        weight.shape[1] if weight.shape[1] else 1,
        weight.stride(0),
        weight.stride(1),
        int(round_sf),
        float("inf") if clamp_value is None else float(torch.tensor(clamp_value, dtype=torch.float32)),
    )
    return out, (dx_q, dx_sf), dx, dweight

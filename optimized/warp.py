"""Warp-level sums of several fp32 values per thread that keep a plain butterfly's bits.

A plain butterfly carries every value through all five ``shfl_xor`` steps (5 shuffles per value).
``halving_butterfly`` halves the values a lane carries at each of its first log2 steps: at step j
a lane keeps the values whose index bit j equals its lane bit for that step and sends the others to
its partner, which keeps those. Each value's sum is still the same tree over the 32 lanes (every
step adds a lane's value and its partner's), so the bits are the plain butterfly's, for 2^steps − 1
shuffles instead of 5·count; afterwards each lane holds one value's warp total.
"""

import tilelang.language as T


def halving_steps(count: int) -> int:
    """The halving steps for ``count`` values: log2 of ``count`` padded to a power of two (at most
    32 values: one per lane at the end)."""
    if not 1 <= count <= 32:
        raise ValueError(f"halving_butterfly sums 1 to 32 values per thread, got {count}")
    return (count - 1).bit_length()


def _lane_bit(step: int, descending: bool) -> int:
    """The lane bit (partner distance 2^bit) of butterfly step ``step``: 0, 1, … 4 or 4, 3, … 0."""
    return 4 - step if descending else step


def halved_index(lane, steps: int, descending: bool):
    """The value whose warp total lane ``lane`` holds after ``halving_butterfly``: its lane bit of
    step j as index bit j. Ascending, that is ``lane mod 2^steps``."""
    index = 0
    for step in range(steps):
        index = index + (((lane >> _lane_bit(step, descending)) & 1) << step)
    return index


@T.macro
def halving_butterfly(values, steps: int, lane, descending: bool):
    """``values[0:2^steps]`` (this thread's fp32 values, the ones past the real count zero) → in
    ``values[0]``, the warp's total of value ``halved_index(lane, steps, descending)``, as a plain
    ``shfl_xor`` butterfly with partners at distance 1, 2, … 16 (``descending``: 16, 8, … 1) sums
    it."""
    for step in T.unroll(steps):
        bit = _lane_bit(step, descending)
        upper = ((lane >> bit) & 1) == 1
        # A constant trip count with a guard, not a bound that depends on the step: nvcc then
        # unrolls both loops and keeps the values in registers (else they may go to the stack).
        for index in T.unroll(1 << max(steps - 1, 0)):
            if index < (1 << steps) >> (step + 1):
                sent = T.if_then_else(upper, values[2 * index], values[2 * index + 1])
                kept = T.if_then_else(upper, values[2 * index + 1], values[2 * index])
                values[index] = kept + T.shfl_xor(sent, 1 << bit)
    for step in T.unroll(steps, 5):
        values[0] = values[0] + T.shfl_xor(values[0], 1 << _lane_bit(step, descending))

"""TileLang building blocks shared by the quantization kernels: scale rules and element encoders.

Each macro is the kernel-side twin of a named step in ``tileproof.reference.quant`` and follows the
same bit-level rules; the reference's module docstring states them.
"""

from __future__ import annotations

import tilelang.language as T

from tileproof.reference.contract import FP32_EXPONENT_AND_SIGN_MASK, FP32_MANTISSA_MASK, UE8M0_NAN, QuantFormat

FP32_NAN_BITS_ABOVE = 0x7F800000  # an fp32 with abs bits above this is a NaN


def float_bits_abs(value):
    """|value| as int32 bits. Comparing these as integers orders non-negative floats exactly and
    ranks every NaN above +Inf, so an integer max propagates NaN (fmaxf would drop it)."""
    return T.reinterpret(value, "int32") & 0x7FFFFFFF


@T.macro
def cta_amax_bits(amax, warp_amax, lane, warp, warps: int):
    """``amax[0]`` (abs bits, this thread's maximum) → the maximum over the whole CTA, in every
    thread: a warp ``shfl_xor`` butterfly, then one shared-memory slot per warp (``warp_amax``,
    ``warps`` int32) and a barrier. Integer maxima of abs bits keep NaN ranked above Inf."""
    for step in T.unroll(5):
        amax[0] = T.max(amax[0], T.shfl_xor(amax[0], 1 << step))
    if lane == 0:
        warp_amax[warp] = amax[0]
    T.sync_threads()
    for w in T.unroll(warps):
        amax[0] = T.max(amax[0], warp_amax[w])


@T.macro
def scale_and_multiplier(amax_bits, fmt: QuantFormat, round_sf, sf, multiplier):
    """Block amax (abs bits) → ``sf`` and ``multiplier`` (two local fp32 vars), contract §1."""
    floor_bits = T.reinterpret(T.float32(fmt.amax_floor), "int32")
    amax = T.reinterpret(T.max(amax_bits, floor_bits), "float32")
    sf[0] = T.ieee_fdiv(amax, T.float32(fmt.qmax))
    multiplier[0] = T.ieee_fdiv(T.float32(fmt.qmax), amax)
    if round_sf:
        bits = T.reinterpret(sf[0], "uint32")
        if (bits & 0x7FFFFFFF) <= FP32_NAN_BITS_ABOVE:
            rounded = (bits + T.uint32(FP32_MANTISSA_MASK)) & T.uint32(FP32_EXPONENT_AND_SIGN_MASK)
            sf[0] = T.reinterpret(rounded, "float32")
        multiplier[0] = T.ieee_fdiv(T.float32(1.0), sf[0])


def division_magic(divisor: int) -> tuple[int, int]:
    """``(magic, shift)`` with ``n // divisor == (n · magic) >> shift`` for every ``0 <= n < 2^31``.

    ``shift = 31 + ceil(log2 divisor)``, ``magic = ceil(2^shift / divisor) < 2^32``: the excess
    ``e = magic - 2^shift / divisor < 1`` adds ``n · e / 2^shift < 1 / divisor`` to ``n / divisor``,
    which cannot reach the next integer (the classic round-up method). Kernels find a flattened
    index's row with it (``divide_by_magic``) instead of a ~20-instruction integer division."""
    if divisor < 1:
        raise ValueError(f"divisor must be >= 1, got {divisor}")
    shift = 31 + (divisor - 1).bit_length()
    return -(-(1 << shift) // divisor), shift


def divide_by_magic(n, magic, shift):
    """``n // divisor`` (int32, ``0 <= n < 2^31``) from ``division_magic(divisor)`` passed as runtime
    scalars (``magic`` int64, ``shift`` int32): one wide multiply and a shift."""
    product = T.cast(n, "uint64") * T.cast(magic, "uint64")
    return T.cast(T.shift_right(product, T.cast(shift, "uint64")), "int32")


def ue8m0_byte(sf):
    """The biased exponent of a power-of-two fp32 scale (0xFF for Inf and NaN)."""
    return T.cast((T.reinterpret(sf, "uint32") >> 23) & 0xFF, "uint8")


def scale_from_ue8m0(byte):
    """Biased exponent byte → fp32 power of two; 0xFF is NaN (OCP E8M0), as in the reference."""
    bits = T.shift_left(T.cast(byte, "uint32"), T.uint32(23))
    return T.reinterpret(T.if_then_else(byte == T.uint8(UE8M0_NAN), T.uint32(0x7FC00000), bits), "float32")


def e2m1_code(y):
    """fp32 → 4-bit e2m1 code as uint32: round to nearest even, saturating at 6, sign kept.

    With ``a = |y|``, the code of each binade is a plain integer rounding: ``RNE(2a)`` on [0, 2),
    ``RNE(a) + 2`` on [2, 4), ``RNE(a/2) + 4`` on [4, 8). Each candidate ``c_k = RNE(a·2^(1-k)) + 2k``
    is one FMA against the magic ``2^23 + 2k`` (the product by a power of two is exact, and at 2^23
    the fp32 spacing is 1, so the add rounds to the nearest integer, ties to even). The candidates
    are ordered so that the right binade's one is the smallest, hence ``code = min(c0, c1, c2, 7)``.
    The candidates are positive floats, +Inf, or (from a NaN y: NVIDIA's fp32 arithmetic yields the
    canonical NaN 0x7FFFFFFF) NaN, and positive floats order as their bits with NaN above +Inf: so
    the minimum is taken on the bits (one three-input and one two-input integer min instead of three
    float mins), and NaN and ±Inf land on the cap 7 (6.0) as the contract wants. The sign of y moves
    from bit 31 to bit 3: ``bits(y) >> 28`` holds only bits 0-3, so one LOP3 merges it with the
    magnitude's 3 bits. About 7 instructions; exhaustively checked against ``reference.quant``.
    """
    a = T.abs(y)
    magic = 8388608.0  # 2^23
    candidate_0 = T.reinterpret(a * T.float32(2.0) + T.float32(magic), "uint32")
    candidate_1 = T.reinterpret(a + T.float32(magic + 2.0), "uint32")
    candidate_2 = T.reinterpret(a * T.float32(0.5) + T.float32(magic + 4.0), "uint32")
    cap = T.uint32(0x4B000007)  # bits of 2^23 + 7
    smallest = T.min(T.min(T.min(candidate_0, candidate_1), candidate_2), cap)
    # A NaN y here comes out of an fp32 multiply (canonical NaN, sign clear), so NaN encodes as +6
    # like the reference asks; the oracle's NaN/Inf cases check this on the device.
    return (smallest & T.uint32(7)) | ((T.reinterpret(y, "uint32") >> 28) & T.uint32(0xFFFFFFF8))


def e2m1_value(code):
    """4-bit e2m1 code (uint32) → fp32 value, exact: ``(1 + m/2) · 2^(e-1)``, or ``m/2`` when e = 0."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    normal = T.reinterpret(((exponent + 126) << 23) | (mantissa << 22), "float32")
    subnormal = T.cast(mantissa, "float32") * T.float32(0.5)
    magnitude = T.if_then_else(exponent == 0, subnormal, normal)
    return T.reinterpret(T.reinterpret(magnitude, "uint32") | ((code & 8) << 28), "float32")

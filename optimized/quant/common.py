"""TileLang building blocks shared by the quantization kernels: scale rules and element encoders.

Each macro is the kernel-side twin of a named step in ``tileproof.reference.quant`` and follows the
same bit-level rules; the reference's module docstring states them.
"""

from __future__ import annotations

import numpy as np
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


# qmax values whose ``divide_bf16_amax`` is checked exact for every bf16 amax (and the floor).
BF16_AMAX_DIVISORS = (6.0, 448.0)


def divide_bf16_amax(amax, qmax: float):
    """``amax / qmax`` correctly rounded (IEEE fp32), for an ``amax`` that is a bf16 value (8
    significant bits) or the format's floor, in three instructions instead of the ~12 of a
    division (its range check and branch included): ``q = amax · r`` with ``r = RN(1/qmax)``,
    then one Newton correction with the exact residual, ``q + RN(amax − qmax·q) · r`` (two FMAs).
    Checked exact for every bf16 amax and both floors (tests/test_e2m1_encoder_model.py); +Inf
    would make the residual NaN, so it is passed through (Inf / qmax = Inf); a NaN stays NaN."""
    if qmax not in BF16_AMAX_DIVISORS:
        return T.ieee_fdiv(amax, T.float32(qmax))
    reciprocal = T.float32(float(np.float32(1.0) / np.float32(qmax)))  # IEEE fp32 division
    quotient = amax * reciprocal
    residual = T.call_extern("float32", "__fmaf_rn", T.float32(-qmax), quotient, amax)
    refined = T.call_extern("float32", "__fmaf_rn", residual, reciprocal, quotient)
    return T.if_then_else(amax == T.float32(float("inf")), amax, refined)


@T.macro
def scale_and_multiplier(amax_bits, fmt: QuantFormat, round_sf, sf, multiplier, amax_is_bf16: bool = False):
    """Block amax (abs bits) → ``sf`` and ``multiplier`` (two local fp32 vars), contract §1.
    ``amax_is_bf16``: the amax is a bf16 value (bf16 input), so ``sf`` takes ``divide_bf16_amax``."""
    floor_bits = T.reinterpret(T.float32(fmt.amax_floor), "int32")
    amax = T.reinterpret(T.max(amax_bits, floor_bits), "float32")
    sf[0] = divide_bf16_amax(amax, fmt.qmax) if amax_is_bf16 else T.ieee_fdiv(amax, T.float32(fmt.qmax))
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


E2M1_MAGIC = 8388608.0  # 2^23: from here up to 2^24 the fp32 spacing is 1
E2M1_MAGIC_BITS = 0x4B000000  # bits of E2M1_MAGIC; 2^23 + n has the bits E2M1_MAGIC_BITS + n
E2M1_SIGN_NIBBLE_BITS = 0x88888888  # bit 3 of every nibble: the sign bits of eight packed codes


def e2m1_magnitude_bits(y, saturate: bool = True):
    """fp32 → ``E2M1_MAGIC_BITS + c`` (uint32), ``c`` the 3-bit e2m1 code of ``|y|``: round to nearest
    even, saturating at 6 (code 7).

    With ``a = |y|``, the code of each binade is a plain integer rounding: ``RNE(2a)`` on [0, 2),
    ``RNE(a) + 2`` on [2, 4), ``RNE(a/2) + 4`` on [4, 8). Each candidate ``c_k = RNE(a·2^(1-k)) + 2k``
    is one FMA against the magic ``2^23 + 2k`` (the product by a power of two is exact, and at 2^23
    the fp32 spacing is 1, so the add rounds to the nearest integer, ties to even). The candidates
    are ordered so that the right binade's one is the smallest, hence ``c = min(c0, c1, c2, 7)``.
    The candidates are positive floats, +Inf, or (from a NaN y: NVIDIA's fp32 arithmetic yields the
    canonical NaN 0x7FFFFFFF) NaN, and positive floats order as their bits with NaN above +Inf: so
    the minimum is taken on the bits (one three-input and one two-input integer min instead of three
    float mins), and NaN and ±Inf land on the cap 7 (6.0) as the contract wants.

    ``saturate=False`` leaves out the cap, one instruction: only for ``|y| < 7``, where ``c2 <= 7``
    already (a block whose scale came from its own finite amax: ``|y| <= 6·(1 + 2^-22)``).
    Modelled instruction by instruction and checked against ``reference.quant`` for all 2^32 fp32
    inputs by ``tests/test_e2m1_encoder_model.py`` (run as a script; its tests take a sample).
    """
    a = T.abs(y)
    candidate_0 = T.reinterpret(a * T.float32(2.0) + T.float32(E2M1_MAGIC), "uint32")
    candidate_1 = T.reinterpret(a + T.float32(E2M1_MAGIC + 2.0), "uint32")
    candidate_2 = T.reinterpret(a * T.float32(0.5) + T.float32(E2M1_MAGIC + 4.0), "uint32")
    smallest = T.min(T.min(candidate_0, candidate_1), candidate_2)
    return T.min(smallest, T.uint32(E2M1_MAGIC_BITS + 7)) if saturate else smallest


def e2m1_code(y):
    """fp32 → 4-bit e2m1 code as uint32: ``e2m1_magnitude_bits``'s code, and the sign of y moved
    from bit 31 to bit 3: ``bits(y) >> 28`` holds only bits 0-3, so one LOP3 merges it with the
    magnitude's 3 bits. About 7 instructions; exhaustively checked (``tests/test_e2m1_encoder_model.py``).
    A NaN y here comes out of an fp32 multiply (canonical NaN, sign clear), so NaN encodes as +6
    like the reference asks; the oracle's NaN/Inf cases check this on the device."""
    smallest = e2m1_magnitude_bits(y)
    return (smallest & T.uint32(7)) | ((T.reinterpret(y, "uint32") >> 28) & T.uint32(0xFFFFFFF8))


def e2m1_magnitude_sum_excess(count: int) -> int:
    """What ``Σ_i e2m1_magnitude_bits(y_i) · 16^i`` (uint32, i < count) holds beyond the packed codes
    ``Σ_i c_i · 16^i``: ``Σ_i E2M1_MAGIC_BITS · 16^i`` mod 2^32 (0xFB000000 for eight codes). The
    magic's bits all sit at or above bit 23, so only the first two terms reach into the word."""
    if not 1 <= count <= 8:
        raise ValueError(f"a uint32 holds 1 to 8 packed e2m1 codes, not {count}")
    return sum(E2M1_MAGIC_BITS << (4 * i) for i in range(count)) & 0xFFFFFFFF


@T.macro
def e2m1_magnitude_sum(scaled, count: int, saturate: bool, packed, funnel_signs: bool):
    """``packed[0] = Σ_i e2m1_magnitude_bits(scaled[i], saturate) · 16^i`` (uint32, i < count), by
    Horner's rule from the last value: one shift-add each; with ``funnel_signs``, in the same pass
    ``packed[1]`` takes the top four bits of every value by a funnel shift (``e2m1_pack_codes``)."""
    packed[0] = T.uint32(0)
    if funnel_signs:
        packed[1] = T.uint32(0)
    for step in T.unroll(count):
        y = scaled[count - 1 - step]
        packed[0] = (packed[0] << 4) + e2m1_magnitude_bits(y, saturate)
        if funnel_signs:
            packed[1] = T.call_extern("uint32", "__funnelshift_l", T.reinterpret(y, "uint32"), packed[1], T.uint32(4))


@T.macro
def e2m1_pack_codes(scaled, count: int, saturate: bool, packed):
    """``count`` (≤ 8) fp32 values ``scaled[0 : count]`` → their e2m1 codes packed little-endian into
    ``packed[0]`` (uint32; value i in bits 4i..4i+3, the layout of the packed bytes), the same codes
    as ``e2m1_code``, in about 2 instructions per value fewer than coding and packing each one:

    - the magnitudes are summed unmasked, Horner's way (one shift-add per value, LEA or IMAD):
      ``Σ_i e2m1_magnitude_bits(y_i) · 16^i``; each term is ``E2M1_MAGIC_BITS + c_i`` exactly, so the
      magic's share is a constant (``e2m1_magnitude_sum_excess``) taken off once;
    - the signs come from a funnel shift (``SHF.L.W``, one per value): ``(acc << 4) | (bits(y_i) >>
      28)`` brings y_i's top four bits into the low nibble, so after the last value nibble i holds
      y_i's sign in its bit 3 (and exponent bits below it, masked off by the final LOP3).

    ``packed`` is a local uint32 buffer of 2: ``packed[1]`` is the sign accumulator."""
    e2m1_magnitude_sum(scaled, count, saturate, packed, True)
    packed[0] = (packed[1] & T.uint32(E2M1_SIGN_NIBBLE_BITS)) | (packed[0] - T.uint32(e2m1_magnitude_sum_excess(count)))


@T.macro
def e2m1_pack_codes_of_finite_block(scaled, words, item, first_word, packed):
    """``e2m1_pack_codes(scaled, 8, ...)`` for eight values ``y_i = x_i · m`` of a block whose
    multiplier ``m`` came from the block's own finite amax (``m > 0`` finite and ``|x_i| <= amax``,
    hence ``|y_i| <= 6·(1 + 2^-22) < 7``, and y_i is finite with the sign of x_i), ``x`` given as its
    bf16 pairs ``words[item, first_word : first_word + 4]`` (int32, element 2j in the low half):

    - no cap on the magnitudes (``e2m1_magnitude_bits(y, saturate=False)``): one instruction each;
    - the signs come from the bf16 words by four byte permutes (PRMT): the sign of element 2j is
      bit 7 of byte 1 of word j, of element 2j + 1 bit 7 of byte 3. Gathering bytes 1 (``even``)
      and bytes 3 (``odd``) of the four words puts the odd elements' signs on bits 8j + 7, where
      the packed codes want them, and the even elements' four bits above bits 8j + 3.

    Seven instructions for the signs instead of nine, eight caps fewer: 66 instead of 76 per eight
    values. Same bits as ``e2m1_pack_codes`` for every such block (tests/test_e2m1_encoder_model.py)."""
    e2m1_magnitude_sum(scaled, 8, False, packed, False)
    low_pair = T.call_extern(
        "uint32", "__byte_perm", words[item, first_word], words[item, first_word + 1], T.uint32(0x7351)
    )
    high_pair = T.call_extern(
        "uint32", "__byte_perm", words[item, first_word + 2], words[item, first_word + 3], T.uint32(0x7351)
    )
    even = T.call_extern("uint32", "__byte_perm", low_pair, high_pair, T.uint32(0x5410))
    odd = T.call_extern("uint32", "__byte_perm", low_pair, high_pair, T.uint32(0x7632))
    packed[1] = (odd & T.uint32(0x80808080)) | ((even >> 4) & T.uint32(0x08080808))
    packed[0] = packed[1] | (packed[0] - T.uint32(e2m1_magnitude_sum_excess(8)))


def e2m1_value(code):
    """4-bit e2m1 code (uint32) → fp32 value, exact: ``(1 + m/2) · 2^(e-1)``, or ``m/2`` when e = 0."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    normal = T.reinterpret(((exponent + 126) << 23) | (mantissa << 22), "float32")
    subnormal = T.cast(mantissa, "float32") * T.float32(0.5)
    magnitude = T.if_then_else(exponent == 0, subnormal, normal)
    return T.reinterpret(T.reinterpret(magnitude, "uint32") | ((code & 8) << 28), "float32")

"""The fused SwiGLU + quantization operators of the reference twin, proven on the CPU.

Independent checks, written in this file:

- ``exp_rounded`` against ``math.exp`` rounded to fp32, settled with ``decimal`` (60 digits) where
  the double lands near an fp32 rounding midpoint: correctly rounded on every bf16 argument.
- The activation and the gradients element by element in Python floats: an fp32 operation on fp32
  values is the double operation rounded to fp32 with ``struct`` (the double rounding is innocuous:
  53 >= 2·24 + 2), the fused multiply-add exact with ``fractions``, bf16 rounding on the bits. The
  casts of the operators are then compared, bit for bit, with ``quant.per_token_cast`` /
  ``quant_blocks.per_channel_cast`` of that independently computed tensor (those casts are proven
  in their own test files).
- The explicit backward formulas with ``torch.autograd.gradcheck`` (float64, finite differences,
  clamp regions included, away from the kinks) and against autograd of a forward written with
  ``F.silu`` and ``torch.clamp``.
- The float64 error bounds the oracle applies to ``out``, ``dx`` and ``dweight`` (docs/quant-swiglu.md),
  on random data and a DeepSeek-sized row (H = 2048).
"""

from __future__ import annotations

import math
import struct
from decimal import Decimal, localcontext
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from tileproof.reference import quant as rq
from tileproof.reference import quant_blocks as qb
from tileproof.reference import quant_swiglu as qs

FLOAT_INF = float("inf")
NAN = float("nan")
# The double midpoint between the largest fp32 (2^128 - 2^104) and 2^128: from here on fp32 is Inf.
F32_OVERFLOW_MIDPOINT = 2.0**128 - 2.0**103

# ---------------------------------------------------------------------------------------------
# Independent scalar helpers
# ---------------------------------------------------------------------------------------------


def f32(v: float) -> float:
    """Round a Python float (double) to the nearest fp32, ties to even; overflow gives ±Inf."""
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        return math.copysign(FLOAT_INF, v)


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def from_f32_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def bf16(v: float) -> float:
    """An fp32 value rounded to bf16 (nearest, ties to even on the dropped 16 bits)."""
    if math.isnan(v):
        return v
    bits = f32_bits(v)
    return from_f32_bits((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000)


def exp_f32(y: float) -> float:
    """e^y correctly rounded to fp32: math.exp is within one double ulp, decimal settles the rest."""
    if math.isnan(y):
        return NAN
    try:
        d = math.exp(y)
    except OverflowError:
        return FLOAT_INF
    if math.isinf(d):
        return FLOAT_INF
    rounded = f32(d)
    if d == rounded:  # e^y within a double ulp of an fp32 value is far from every fp32 midpoint
        return rounded
    bits = f32_bits(rounded)
    other = from_f32_bits(bits + 1 if d > rounded else bits - 1)  # the fp32 on the other side of d
    if math.isinf(rounded) or math.isinf(other):
        midpoint = F32_OVERFLOW_MIDPOINT
    else:
        midpoint = (rounded + other) / 2  # exact in double
    if abs(d - midpoint) > 2 * math.ulp(d):
        return rounded
    with localcontext() as context:
        context.prec = 60
        above = Decimal(y).exp() > Decimal(midpoint)
    return max(rounded, other) if above else min(rounded, other)


def round_to_f32(exact: Fraction) -> float:
    """The fp32 nearest to an exact rational, ties to the even significand (finite results only)."""
    if exact == 0:
        return 0.0
    magnitude = abs(exact)
    guess = f32(float(magnitude))
    bits = f32_bits(guess)
    candidates = [guess, from_f32_bits(bits + 1)] + ([from_f32_bits(bits - 1)] if guess > 0 else [])
    best = min(candidates, key=lambda c: (abs(Fraction(c) - magnitude), f32_bits(c) & 1))
    return best if exact > 0 else -best


def fma_f32(a: float, b: float, c: float) -> float:
    return round_to_f32(Fraction(a) * Fraction(b) + Fraction(c))


def clamp_scalar(g: float, u: float, clamp: float | None) -> tuple[float, float, bool, bool, bool]:
    if clamp is None:
        return g, u, False, False, False
    c = f32(clamp)
    g_above, u_above, u_below = g > c, u > c, u < -c
    return (c if g_above else g), (c if u_above else (-c if u_below else u)), g_above, u_above, u_below


def activation_scalar(g: float, u: float, w: float | None) -> float:
    """fl(fl(fl(g / fl(1 + E(-g))) · u) · w), one fp32 rounding per operation."""
    t = f32(1.0 + exp_f32(-g))
    a = f32(f32(g / t) * u)
    return a if w is None else f32(a * w)


def backward_scalar(g: float, u: float, go: float, w: float, clamp: float | None):
    """(act, out, dg, du) of one element, in the spec's fp32 operation order."""
    g, u, g_above, u_above, u_below = clamp_scalar(g, u, clamp)
    t = f32(1.0 + exp_f32(-g))
    act = f32(f32(g / t) * u)
    s = f32(1.0 / t)
    gw = f32(f32(go * w) * s)
    dg = 0.0 if g_above else f32(f32(gw * u) * fma_f32(g, f32(1.0 - s), 1.0))
    du = 0.0 if (u_above or u_below) else f32(gw * g)
    return act, f32(act * w), dg, du


def int_bits(t: torch.Tensor) -> torch.Tensor:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, *, strides: bool = True) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if strides and actual.numel() > 0:
        assert actual.stride() == expected.stride(), (actual.stride(), expected.stride())
    mismatch = int_bits(actual) != int_bits(expected)
    assert not mismatch.any(), f"{int(mismatch.sum())} of {actual.numel()} elements differ"


def all_bf16_values() -> torch.Tensor:
    return torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(torch.float32)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

# Gate values on the edges of the formula: t = 1 exactly (g >= 16.636), E(-g) = Inf (g <= -88.723),
# silu(±0) = ±0, and ordinary values.
GATE_SPECIALS = [20.0, 16.75, -100.0, -88.75, 0.0, -0.0, -1.25, 1.0]


def make_x(rows: int, hidden: int, generator: torch.Generator, dtype=torch.bfloat16, scale: float = 3.0):
    """``[P, 2H]`` random ``[g | u]`` with the gate specials in row 0 (as far as it reaches)."""
    x = torch.randn(rows, 2 * hidden, generator=generator) * scale
    if rows:
        count = min(len(GATE_SPECIALS), hidden)
        x[0, :count] = torch.tensor(GATE_SPECIALS[:count])
    return x.to(dtype)


def make_mapping(tokens: int, topk: int, rows: int, used: int, generator: torch.Generator):
    """Consistent ``(pos_to_token_topk [P], token_topk_to_pos [T, k])``, int32, ``used`` slots placed."""
    slots = torch.randperm(tokens * topk, generator=generator)[:used]
    placed = torch.randperm(rows, generator=generator)[:used]
    pos_to_token_topk = torch.full((rows,), -1, dtype=torch.int32)
    pos_to_token_topk[placed] = slots.to(torch.int32)
    token_topk_to_pos = torch.full((tokens * topk,), -1, dtype=torch.int32)
    token_topk_to_pos[slots] = placed.to(torch.int32)
    return pos_to_token_topk, token_topk_to_pos.reshape(tokens, topk)


# ---------------------------------------------------------------------------------------------
# exp
# ---------------------------------------------------------------------------------------------


def test_exp_rounded_is_correctly_rounded_on_every_bf16_argument():
    args = all_bf16_values()
    args = args[~torch.isnan(args)]
    expected = torch.tensor([exp_f32(y) for y in args.tolist()], dtype=torch.float32)
    assert_bitwise(qs.exp_rounded(args), expected)


def test_exp_rounded_on_fp32_arguments(generator):
    args = torch.cat([torch.rand(8192, generator=generator) * 200 - 100, torch.randn(8192, generator=generator)])
    expected = torch.tensor([exp_f32(y) for y in args.tolist()], dtype=torch.float32)
    assert_bitwise(qs.exp_rounded(args), expected)
    # float64 stays float64 (the high-precision evaluation)
    assert qs.exp_rounded(args.double()).dtype == torch.float64


def test_silu_edges_are_exact():
    gate = torch.tensor([20.0, 16.637, 16.63, -88.723, -88.72, 0.0, -0.0])
    silu = qs.swiglu_activation(gate, torch.ones_like(gate))
    assert silu[0].item() == 20.0 and silu[1].item() == f32(16.637)  # t = 1 exactly
    assert silu[2].item() != f32(16.63)  # E(-16.63) > 2^-24: t = 1 + 2^-23
    assert silu[3].item() == 0.0 and math.copysign(1, silu[3].item()) < 0  # -88.723 / Inf = -0
    assert silu[4].item() < 0
    assert math.copysign(1, silu[5].item()) > 0 and math.copysign(1, silu[6].item()) < 0


# ---------------------------------------------------------------------------------------------
# Forward + per-token cast
# ---------------------------------------------------------------------------------------------


def expected_per_token(x, fmt, num_per_channels, *, pos_to_token_topk, topk_weights, pos_to_expert, clamp, flags):
    """The independent activation (scalar loop), cast by ``per_token_cast``; plus the clamp counts."""
    rows, hidden = x.shape[0], x.shape[1] // 2
    values = x.float().tolist()
    flat_weights = None if topk_weights is None else topk_weights.flatten().tolist()
    padding = [pos_to_expert is not None and int(pos_to_expert[r]) < 0 for r in range(rows)]
    activation = [[0.0] * hidden for _ in range(rows)]
    counts = [0, 0, 0]
    for r in range(rows):
        if padding[r]:
            continue
        w = None
        if flat_weights is not None:
            index = int(pos_to_token_topk[r])
            w = flat_weights[index] if index >= 0 else 0.0
        for h in range(hidden):
            g, u, g_above, u_above, u_below = clamp_scalar(values[r][h], values[r][hidden + h], clamp)
            counts[0] += g_above
            counts[1] += u_above
            counts[2] += u_below
            activation[r][h] = activation_scalar(g, u, w)
    a = torch.tensor(activation, dtype=torch.float32).reshape(rows, hidden)
    q, sf = rq.per_token_cast(a, fmt, num_per_channels, **flags)
    return q, sf, torch.tensor(padding, dtype=torch.bool), counts


FLAG_SETS = {
    "plain": {},
    "round": {"round_sf": True},
    "colmajor": {"use_tma_aligned_col_major_sf": True},
    "packed": {"use_packed_ue8m0": True},
}

# (P, H, C or None for C == H, fmt, flags, weights, padding, clamp, x dtype)
FORWARD_CASES = [
    (6, 160, 128, "e4m3", "plain", True, True, 1.5, torch.bfloat16),  # tail block of 32
    (6, 160, None, "e4m3", "packed", True, True, None, torch.bfloat16),
    (5, 256, 128, "e4m3", "colmajor", False, True, 0.75, torch.bfloat16),
    (5, 256, 128, "e4m3", "round", True, False, None, torch.bfloat16),
    (7, 128, 128, "e2m1", "plain", True, True, 2.0, torch.bfloat16),
    (4, 96, None, "e2m1", "packed", False, False, 1.0, torch.bfloat16),
    (3, 130, 128, "e4m3", "plain", True, False, 4.0, torch.float32),  # fp32 input, odd-ish H
    (1, 128, 128, "e4m3", "packed", True, True, None, torch.bfloat16),
    (0, 128, 128, "e4m3", "colmajor", True, True, 1.0, torch.bfloat16),
    (3, 2048, 128, "e4m3", "packed", True, True, 10.0, torch.bfloat16),  # DeepSeek-V3 expert width
    (2, 2048, None, "e4m3", "round", True, False, None, torch.bfloat16),
]


@pytest.mark.parametrize(
    ("rows", "hidden", "block", "fmt", "flag_set", "weights", "padding", "clamp", "dtype"), FORWARD_CASES
)
def test_forward_per_token_matches_scalar(
    generator, rows, hidden, block, fmt, flag_set, weights, padding, clamp, dtype
):
    num_per_channels = hidden if block is None else block
    tokens, topk = 3, 2
    x = make_x(rows, hidden, generator, dtype)
    pos_to_token_topk = topk_weights = pos_to_expert = None
    if weights:
        pos_to_token_topk = torch.randint(-1, tokens * topk, (rows,), generator=generator, dtype=torch.int32)
        topk_weights = torch.randn(tokens, topk, generator=generator)
    if padding:
        pos_to_expert = torch.randint(-1, 4, (rows,), generator=generator, dtype=torch.int32)
        if rows > 1:
            pos_to_expert[1] = -1
    flags = FLAG_SETS[flag_set]
    clamped_count = None if clamp is None else torch.tensor([5, 6, 7], dtype=torch.int64)
    q, sf = qs.swiglu_forward_and_per_token_cast(
        x,
        fmt,
        num_per_channels,
        pos_to_token_topk=pos_to_token_topk,
        topk_weights=topk_weights,
        pos_to_expert=pos_to_expert,
        swiglu_clamp_value=clamp,
        clamped_count=clamped_count,
        **flags,
    )
    q_ref, sf_ref, pad, counts = expected_per_token(
        x,
        fmt,
        num_per_channels,
        pos_to_token_topk=pos_to_token_topk,
        topk_weights=topk_weights,
        pos_to_expert=pos_to_expert,
        clamp=clamp,
        flags=flags,
    )
    # Same dtype, shape and strides as the plain cast; computed rows bit for bit; padding rows zero.
    assert (q.dtype, q.shape, sf.dtype, sf.shape) == (q_ref.dtype, q_ref.shape, sf_ref.dtype, sf_ref.shape)
    if sf.numel():
        assert sf.stride() == sf_ref.stride()
    assert_bitwise(q[~pad], q_ref[~pad])
    assert_bitwise(sf[~pad], sf_ref[~pad], strides=False)
    assert not int_bits(q[pad]).any() and not int_bits(sf[pad]).any()
    if clamped_count is not None:
        assert clamped_count.tolist() == [5 + counts[0], 6 + counts[1], 7 + counts[2]]


def test_forward_strided_rows(generator):
    storage = make_x(4, 136, generator).float()
    x = storage[:, :256]  # row stride 272 > 2H = 256
    q, sf = qs.swiglu_forward_and_per_token_cast(x, "e4m3", 128, swiglu_clamp_value=2.0)
    q_ref, sf_ref = qs.swiglu_forward_and_per_token_cast(x.contiguous(), "e4m3", 128, swiglu_clamp_value=2.0)
    assert_bitwise(q, q_ref)
    assert_bitwise(sf, sf_ref)


def test_forward_weights_gather_and_unweighted_rows():
    """w = topk_weights.flatten()[pos_to_token_topk[r]]; index -1 (not padding) gives w = 0."""
    x = torch.cat([torch.full((3, 128), 20.0), torch.full((3, 128), 16.0)], dim=1).bfloat16()
    # silu(20) = 20 exactly, so a = 20 · 16 · w = 320 · w, a value of e4m3 times a power of two
    topk_weights = torch.tensor([[0.5, 0.25], [2.0, -1.0]])
    pos_to_token_topk = torch.tensor([3, 1, -1], dtype=torch.int32)
    q, sf = qs.swiglu_forward_and_per_token_cast(
        x, "e4m3", 128, pos_to_token_topk=pos_to_token_topk, topk_weights=topk_weights, round_sf=True
    )
    decoded = rq.cast_back((q, sf), "fp32", (1, 128))
    assert decoded[0].unique().tolist() == [-320.0]  # topk_weights[1, 1]
    assert decoded[1].unique().tolist() == [80.0]  # topk_weights[0, 1]
    assert not decoded[2].any()  # w = 0
    assert sf[2].tolist() == [2.0**-22]  # the 1e-4 floor, rounded up to a power of two


def test_forward_clamp_counts_are_strict_skip_padding_and_accumulate():
    c = 1.5
    gate = [2.0, 1.5, -3.0, NAN, 1.25, 5.0, 0.0, 1.0]  # above c: 2.0 and 5.0 (1.5 is not above)
    up = [1.5, -1.5, 4.0, -2.0, NAN, 0.0, -1.75, 1.0]  # above: 4.0; below: -2.0, -1.75
    x = torch.tensor([gate + up, gate + up, [9.0] * 16]).bfloat16()
    pos_to_expert = torch.tensor([0, -1, -5])  # rows 1 and 2 are padding: not counted
    counts = torch.tensor([10, 20, 30], dtype=torch.int64)
    buffer = counts
    q, sf = qs.swiglu_forward_and_per_token_cast(
        x, "e4m3", 8, pos_to_expert=pos_to_expert, swiglu_clamp_value=c, clamped_count=counts
    )
    assert counts is buffer and counts.tolist() == [12, 21, 32]
    # The NaN of the gate and of the up half survive the clamp: the row's scale is NaN, its data 0x7F.
    assert math.isnan(sf[0, 0].item())
    assert q[0].view(torch.uint8).tolist() == [0x7F] * 8
    # A second call adds again.
    qs.swiglu_forward_and_per_token_cast(x[:1], "e4m3", 8, swiglu_clamp_value=c, clamped_count=counts)
    assert counts.tolist() == [14, 22, 34]


def test_forward_clamp_values_are_the_fp32_clamp():
    """g > c becomes fp32(c) (not bf16(c)); u is clamped on both sides; counts match."""
    c = 1.1  # not a bf16 value: fp32(1.1) = 1.10000002384
    x = torch.tensor([[3.0, -3.0, 3.0, -3.0]]).bfloat16()  # g = [3, -3], u = [3, -3]
    q, sf = qs.swiglu_forward_and_per_token_cast(x, "e4m3", 2, swiglu_clamp_value=c)
    c32 = f32(c)
    expected = [activation_scalar(c32, c32, None), activation_scalar(-3.0, -c32, None)]
    q_ref, sf_ref = rq.per_token_cast(torch.tensor([expected]), "e4m3", 2)
    assert_bitwise(q, q_ref)
    assert_bitwise(sf, sf_ref)


def test_forward_activation_is_not_rounded_to_bf16():
    """The per-token cast sees the fp32 activation: the scale is amax(a)/448 of the fp32 a."""
    x = torch.tensor([[1.0, 3.0]]).bfloat16()  # a = silu(1) · 3 = 2.19317573...
    _, sf = qs.swiglu_forward_and_per_token_cast(x, "e4m3", 1)
    a = activation_scalar(1.0, 3.0, None)
    assert bf16(a) != a
    assert sf.item() == f32(a / 448.0)


# ---------------------------------------------------------------------------------------------
# Forward + per-channel cast (+ transpose)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "hidden", "num_per_tokens", "round_sf", "clamp"),
    [
        (130, 24, 128, False, None),  # tail of 2 tokens
        (130, 24, 32, True, 1.5),
        (33, 40, 32, False, 0.5),  # tail of 1
        (64, 8, 32, True, None),
        (1, 16, 128, False, 2.0),
        (0, 16, 32, False, None),
        (3, 2048, 128, True, 10.0),  # DeepSeek-V3 expert width
    ],
)
def test_forward_per_channel_matches_scalar(generator, tokens, hidden, num_per_tokens, round_sf, clamp):
    x = make_x(tokens, hidden, generator)
    values = x.float().tolist()
    activation = [
        [
            bf16(activation_scalar(*clamp_scalar(values[t][h], values[t][hidden + h], clamp)[:2], None))
            for h in range(hidden)
        ]
        for t in range(tokens)
    ]
    a = torch.tensor(activation, dtype=torch.float32).reshape(tokens, hidden).to(torch.bfloat16)  # exact
    q_ref, sf_ref = qb.per_channel_cast(a, "e4m3", num_per_tokens, round_sf)

    q, sf = qs.swiglu_forward_and_per_channel_cast_and_transpose(
        x, "e4m3", num_per_tokens, round_sf=round_sf, without_transpose=True, swiglu_clamp_value=clamp
    )
    assert_bitwise(q, q_ref)
    assert_bitwise(sf, sf_ref)

    q_t, sf_t = qs.swiglu_forward_and_per_channel_cast_and_transpose(
        x, "e4m3", num_per_tokens, round_sf=round_sf, swiglu_clamp_value=clamp
    )
    assert q_t.shape == (hidden, tokens) and q_t.is_contiguous()
    assert_bitwise(q_t, q_ref.T.contiguous())
    assert_bitwise(sf_t, sf_ref)


def test_per_channel_scale_uses_the_bf16_activation():
    x = torch.tensor([[1.0, 3.0]]).bfloat16()  # a = 2.19317573..., bf16(a) = 2.1875
    _, sf = qs.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 32)
    assert sf.item() == f32(bf16(activation_scalar(1.0, 3.0, None)) / 448.0)


# ---------------------------------------------------------------------------------------------
# Backward: the formulas (float64)
# ---------------------------------------------------------------------------------------------


class ExplicitSwiGLU(torch.autograd.Function):
    """The reference's forward math with the reference's explicit backward formulas."""

    @staticmethod
    def forward(ctx, gate, up, weight, clamp):
        gate, up, gate_above, up_above, up_below = qs.swiglu_clamp(gate, up, clamp)
        ctx.save_for_backward(gate, up, weight, gate_above, up_above | up_below)
        return qs.swiglu_activation(gate, up, weight)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, weight, gate_clamped, up_clamped = ctx.saved_tensors
        act, _, d_gate, d_up = qs.swiglu_gradients(gate, up, grad_out, weight, gate_clamped, up_clamped)
        return d_gate, d_up, (grad_out * act).sum(dim=1, keepdim=True), None


def independent_forward(gate, up, weight, clamp):
    if clamp is not None:
        gate = torch.clamp(gate, max=clamp)
        up = torch.clamp(up, min=-clamp, max=clamp)
    return F.silu(gate) * up * weight


def away_from_kinks(values: torch.Tensor, clamp: float | None, margin: float = 1e-3) -> torch.Tensor:
    """Move values within ``margin`` of ±clamp off the kink (finite differences must not straddle it)."""
    if clamp is None:
        return values
    for kink in (clamp, -clamp):
        near = (values - kink).abs() < margin
        values = torch.where(near, values + 4 * margin, values)
    return values


def gradient_inputs(generator, rows, hidden, clamp):
    spread = 3 * (clamp or 2.0)
    gate = away_from_kinks((torch.rand(rows, hidden, generator=generator, dtype=torch.float64) * 2 - 1) * spread, clamp)
    up = away_from_kinks((torch.rand(rows, hidden, generator=generator, dtype=torch.float64) * 2 - 1) * spread, clamp)
    weight = torch.rand(rows, 1, generator=generator, dtype=torch.float64) + 0.25
    return gate.requires_grad_(), up.requires_grad_(), weight.requires_grad_()


@pytest.mark.parametrize("clamp", [None, 1.5, 0.5])
def test_backward_formulas_gradcheck(generator, clamp):
    gate, up, weight = gradient_inputs(generator, 3, 12, clamp)
    if clamp is not None:  # the clamp regions are really exercised
        assert (gate.detach() > clamp).any() and (up.detach() > clamp).any() and (up.detach() < -clamp).any()
    assert torch.autograd.gradcheck(lambda g, u, w: ExplicitSwiGLU.apply(g, u, w, clamp), (gate, up, weight))


@pytest.mark.parametrize("clamp", [None, 1.0])
def test_backward_formulas_match_autograd_of_an_independent_forward(generator, clamp):
    gate, up, weight = gradient_inputs(generator, 4, 64, clamp)
    grad_out = torch.randn(4, 64, generator=generator, dtype=torch.float64)
    expected = torch.autograd.grad(independent_forward(gate, up, weight, clamp), (gate, up, weight), grad_out)

    g, u, gate_above, up_above, up_below = qs.swiglu_clamp(gate.detach(), up.detach(), clamp)
    act, out, d_gate, d_up = qs.swiglu_gradients(g, u, grad_out, weight.detach(), gate_above, up_above | up_below)
    d_weight = (grad_out * act).sum(dim=1, keepdim=True)
    torch.testing.assert_close(out, independent_forward(gate, up, weight, clamp).detach(), rtol=1e-13, atol=1e-15)
    for actual, reference in zip((d_gate, d_up, d_weight), expected, strict=True):
        torch.testing.assert_close(actual, reference, rtol=1e-12, atol=1e-14)
    if clamp is not None:
        assert not d_gate[gate_above].any() and not d_up[up_above | up_below].any()


# ---------------------------------------------------------------------------------------------
# Backward + per-token cast: the fp32 operation sequence, element by element
# ---------------------------------------------------------------------------------------------


def backward_case(generator, rows, hidden, block, tokens, topk, used, round_sf_input=False):
    x = torch.randn(rows, 2 * hidden, generator=generator) * 2.5
    if rows:  # t = 1 exactly, E(-g) = Inf, silu(0), near silu's minimum, the overflow edge, subnormal s
        edges = [20.0, -100.0, 0.0, -1.25, -88.72, -87.5][:hidden]
        x[0, : len(edges)] = torch.tensor(edges)
    x_q, x_sf = rq.per_token_cast(x, "e4m3", block, round_sf=round_sf_input)
    grad_out = torch.randn(rows, hidden, generator=generator).to(torch.bfloat16)
    weight = torch.randn(tokens, topk, generator=generator)
    pos_to_token_topk, token_topk_to_pos = make_mapping(tokens, topk, rows, used, generator)
    return (x_q, x_sf), grad_out, weight, pos_to_token_topk, token_topk_to_pos


def expected_backward(x, grad_out, weight, pos_to_token_topk, token_topk_to_pos, block, clamp):
    x_q, x_sf = x
    rows, hidden = grad_out.shape
    codes, scales = x_q.float().tolist(), x_sf.tolist()
    go_values, flat_weight = grad_out.float().tolist(), weight.flatten().tolist()
    out, dx, row_sums, row_magnitudes = [], [], [], []
    for p in range(rows):
        index = int(pos_to_token_topk[p])
        w = flat_weight[index] if index >= 0 else 0.0
        out_row, dg_row, du_row, total, magnitude = [], [], [], Fraction(0), Fraction(0)
        for h in range(hidden):
            g = f32(codes[p][h] * scales[p][h // block])
            u = f32(codes[p][hidden + h] * scales[p][(hidden + h) // block])
            act, o, dg, du = backward_scalar(g, u, go_values[p][h], w, clamp)
            out_row.append(o)
            dg_row.append(dg)
            du_row.append(du)
            total += Fraction(go_values[p][h]) * Fraction(act)
            magnitude += abs(Fraction(go_values[p][h]) * Fraction(act))
        out.append(out_row)
        dx.append(dg_row + du_row)
        row_sums.append(total)
        row_magnitudes.append(magnitude)
    dweight = [[None] * weight.shape[1] for _ in range(weight.shape[0])]
    for t in range(weight.shape[0]):
        for j in range(weight.shape[1]):
            p = int(token_topk_to_pos[t, j])
            dweight[t][j] = (Fraction(0), Fraction(0)) if p < 0 else (row_sums[p], row_magnitudes[p])
    return out, dx, dweight


# (P, H, C, T, k, used slots, round_sf, clamp, input scales rounded)
BACKWARD_CASES = [
    (5, 64, 32, 3, 2, 4, False, 1.5, False),  # one padding row
    (5, 64, 32, 3, 2, 5, True, None, True),
    (4, 256, 128, 4, 2, 3, False, 0.75, False),
    (1, 128, 128, 1, 1, 1, True, 2.0, False),
    (0, 64, 32, 2, 2, 0, False, 1.0, False),  # no rows: every dweight is 0
    (1, 2048, 128, 1, 1, 1, False, 10.0, False),  # DeepSeek-V3 expert width
]


@pytest.mark.parametrize(
    ("rows", "hidden", "block", "tokens", "topk", "used", "round_sf", "clamp", "rounded_input"), BACKWARD_CASES
)
def test_backward_matches_scalar(generator, rows, hidden, block, tokens, topk, used, round_sf, clamp, rounded_input):
    x, grad_out, weight, pos_to_token_topk, token_topk_to_pos = backward_case(
        generator, rows, hidden, block, tokens, topk, used, rounded_input
    )
    out, (dx_q, dx_sf), dx, dweight = qs.swiglu_backward_and_per_token_cast(
        x, grad_out, weight, pos_to_token_topk, token_topk_to_pos, block, round_sf=round_sf, swiglu_clamp_value=clamp
    )
    out_ref, dx_ref, dweight_ref = expected_backward(
        x, grad_out, weight, pos_to_token_topk, token_topk_to_pos, block, clamp
    )
    out_expected = torch.tensor([[bf16(v) for v in row] for row in out_ref], dtype=torch.float32)
    assert_bitwise(out, out_expected.reshape(rows, hidden).to(torch.bfloat16))
    dx_fp32 = torch.tensor(dx_ref, dtype=torch.float32).reshape(rows, 2 * hidden)
    dx_expected = torch.tensor([[bf16(v) for v in row] for row in dx_ref], dtype=torch.float32)
    assert_bitwise(dx, dx_expected.reshape(rows, 2 * hidden).to(torch.bfloat16))
    q_ref, sf_ref = rq.per_token_cast(dx_fp32, "e4m3", block, round_sf=round_sf)
    assert_bitwise(dx_q, q_ref)
    assert_bitwise(dx_sf, sf_ref)

    # dweight: the exact sum rounded once, up to the fp64 accumulation (H · 2^-53 · Σ|terms|).
    assert dweight.dtype == torch.float32 and dweight.shape == weight.shape
    for t in range(tokens):
        for j in range(topk):
            exact, magnitude = dweight_ref[t][j]
            bound = Fraction(abs(exact)) * Fraction(1, 2**24) + magnitude * Fraction(hidden, 2**53)
            assert abs(Fraction(dweight[t, j].item()) - exact) <= bound, (t, j)


def test_gradients_fp32_sequence_matches_scalar(generator):
    """``swiglu_gradients`` in fp32, before any bf16 rounding: every fp32 bit of act, out, dg, du."""
    n, clamp = 2048, 2.5
    gate = torch.randn(n, generator=generator) * 4
    up = torch.randn(n, generator=generator) * 4
    grad_out = torch.randn(n, generator=generator).to(torch.bfloat16).float()
    weight = torch.randn(n, generator=generator)
    g, u, gate_above, up_above, up_below = qs.swiglu_clamp(gate, up, clamp)
    results = qs.swiglu_gradients(g, u, grad_out, weight, gate_above, up_above | up_below)
    expected = [
        backward_scalar(*args, clamp)
        for args in zip(gate.tolist(), up.tolist(), grad_out.tolist(), weight.tolist(), strict=True)
    ]
    for actual, column in zip(results, zip(*expected, strict=True), strict=True):
        assert_bitwise(actual, torch.tensor(column, dtype=torch.float32))


def test_backward_padding_rows_and_clamped_gradients_are_zero(generator):
    x, grad_out, weight, _, _ = backward_case(generator, 3, 64, 32, 2, 2, 0)
    pos_to_token_topk = torch.tensor([2, -1, 0], dtype=torch.int32)
    token_topk_to_pos = torch.tensor([[2, -1], [0, -1]], dtype=torch.int32)
    out, (dx_q, dx_sf), dx, dweight = qs.swiglu_backward_and_per_token_cast(
        x, grad_out, weight, pos_to_token_topk, token_topk_to_pos, 32, swiglu_clamp_value=1.0
    )
    # Row 1 has no slot: w = 0, so its output and gradients are (signed) zeros; its slot-less
    # entries of dweight are 0.
    assert not out[1].float().any() and not dx[1].float().any() and not dx_q[1].float().any()
    assert dweight[0, 1].item() == 0.0 and dweight[1, 1].item() == 0.0
    assert dweight[0, 0].item() != 0.0 and dweight[1, 0].item() != 0.0
    # Clamped elements have a +0 gradient.
    values = rq.cast_back(x, "fp32", (1, 32))
    gate, up = values[:, :64], values[:, 64:]
    assert (gate > 1.0).any() and ((up > 1.0) | (up < -1.0)).any()
    assert int_bits(dx[:, :64][gate > 1.0]).eq(0).all()
    assert int_bits(dx[:, 64:][(up > 1.0) | (up < -1.0)]).eq(0).all()


# ---------------------------------------------------------------------------------------------
# The oracle's float64 bounds (docs/quant-swiglu.md), satisfied by the reference itself
# ---------------------------------------------------------------------------------------------

U = 2.0**-24
BF16_U = 2.0**-8
TINY = 2.0**-126
# Where sigma(g) is subnormal or E(-g) overflows (g <= -87.3), every true output is below 2^-120 · M.
EDGE = 2.0**-120


EXP_ROUNDED = qs.exp_rounded


def sloppy_exp(y: torch.Tensor) -> torch.Tensor:
    """``e^y`` two fp32 ulps off (up or down by the argument's low bit) where it is a normal number,
    like a 2-ulp ``expf``."""
    exact = EXP_ROUNDED(y)
    if y.dtype != torch.float32:
        return exact
    direction = torch.where(y.view(torch.int32) & 1 == 1, FLOAT_INF, -FLOAT_INF)
    sloppy = torch.nextafter(torch.nextafter(exact, direction), direction)
    return torch.where(torch.isfinite(sloppy) & (exact >= TINY), sloppy, exact)


def unfused_one_plus_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(a) + a * b  # two roundings in fp32


@pytest.mark.parametrize("kernel", ["spec", "expf-like"])
@pytest.mark.parametrize(
    ("rows", "hidden", "block", "clamp"), [(6, 256, 128, None), (6, 256, 32, 1.0), (3, 2048, 128, 10.0)]
)
def test_backward_float_outputs_within_the_oracle_bounds(monkeypatch, generator, rows, hidden, block, clamp, kernel):
    """The bounds hold for the reference and for a kernel with a 2-ulp exp and no fma."""
    x, grad_out, weight, pos_to_token_topk, token_topk_to_pos = backward_case(
        generator, rows, hidden, block, 4, 2, min(rows, 8)
    )
    with monkeypatch.context() as patch:
        if kernel == "expf-like":
            patch.setattr(qs, "exp_rounded", sloppy_exp)
            patch.setattr(qs, "_one_plus_product", unfused_one_plus_product)
        out, _, dx, dweight = qs.swiglu_backward_and_per_token_cast(
            x, grad_out, weight, pos_to_token_topk, token_topk_to_pos, block, swiglu_clamp_value=clamp
        )
    values = rq.cast_back(x, "fp32", (1, block)).double()
    gate, up, gate_above, up_above, up_below = qs.swiglu_clamp(values[:, :hidden], values[:, hidden:], clamp)
    index = pos_to_token_topk.long()
    w = torch.where(index >= 0, weight.flatten().double()[index.clamp(min=0)], 0.0).unsqueeze(1)
    go = grad_out.double()
    act, out64, dg64, du64 = qs.swiglu_gradients(gate, up, go, w, gate_above, up_above | up_below)
    sigmoid = 1 / (1 + torch.exp(-gate))

    out_error = (out.double() - out64).abs()
    assert (out_error <= (BF16_U + 2**-20) * out64.abs() + EDGE * (up * w).abs() + TINY).all()
    du_error = (dx[:, hidden:].double() - du64).abs()
    assert (du_error <= (BF16_U + 2**-20) * du64.abs() + EDGE * (go * w).abs() + TINY).all()
    dg_scale = (go * w).abs() * sigmoid * up.abs() * (1 + gate.abs())
    dg_error = (dx[:, :hidden].double() - dg64).abs()
    assert (dg_error <= BF16_U * dg64.abs() + 2**-19 * dg_scale + EDGE * (go * w * up).abs() + TINY).all()

    sums = (go * act).sum(dim=1)
    magnitudes = (go * act).abs().sum(dim=1)
    edge = EDGE * (go * up).abs().sum(dim=1)
    slots = token_topk_to_pos.long()
    for t, j in zip(*torch.nonzero(slots >= 0, as_tuple=True), strict=True):
        p = slots[t, j]
        bound = (hidden + 8) * U * magnitudes[p].item() + edge[p].item() + TINY
        assert abs(dweight[t, j].item() - sums[p].item()) <= bound


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _forward_args(**overrides):
    args = {"x": torch.zeros(4, 256).bfloat16(), "fmt": "e4m3", "num_per_channels": 128}
    args.update(overrides)
    return args


FORWARD_ERRORS = [
    ({"x": [[1.0]]}, TypeError, "x must be a torch.Tensor"),
    ({"x": torch.zeros(4, 256, dtype=torch.int32)}, TypeError, "x must have dtype in"),
    ({"x": torch.zeros(2, 4, 256).bfloat16()}, ValueError, "x must be 2-D"),
    ({"x": torch.zeros(4, 257).bfloat16()}, ValueError, "column count must be even and non-zero, got 257"),
    ({"x": torch.zeros(4, 0).bfloat16()}, ValueError, "column count must be even and non-zero, got 0"),
    ({"x": torch.zeros(256, 4).bfloat16().T}, ValueError, "x must have unit stride"),
    ({"fmt": "e5m6"}, ValueError, "fmt must be one of"),
    ({"num_per_channels": 64}, ValueError, "num_per_channels must be 128 or the hidden size 128, got 64"),
    ({"num_per_channels": 128.0}, TypeError, "num_per_channels must be an int"),
    ({"x": torch.zeros(4, 2 * 129).bfloat16(), "fmt": "e2m1", "num_per_channels": 129}, ValueError, "e2m1 packs"),
    ({"pos_to_token_topk": torch.zeros(4, dtype=torch.int32)}, ValueError, "must be given together"),
    ({"topk_weights": torch.zeros(2, 2)}, ValueError, "must be given together"),
    (
        {"pos_to_token_topk": torch.zeros(4, dtype=torch.int32), "topk_weights": torch.zeros(2, 2).half()},
        TypeError,
        "topk_weights must have dtype in (float32)",
    ),
    (
        {"pos_to_token_topk": torch.zeros(3, dtype=torch.int32), "topk_weights": torch.zeros(2, 2)},
        ValueError,
        "pos_to_token_topk must have shape (4,)",
    ),
    (
        {"pos_to_token_topk": torch.zeros(4), "topk_weights": torch.zeros(2, 2)},
        TypeError,
        "pos_to_token_topk must have dtype in (int32, int64)",
    ),
    (
        {"pos_to_token_topk": torch.tensor([0, 1, 2, 4], dtype=torch.int32), "topk_weights": torch.zeros(2, 2)},
        ValueError,
        "pos_to_token_topk entries must be in [-1, 4)",
    ),
    (
        {"pos_to_token_topk": torch.tensor([0, -2, 2, 3]), "topk_weights": torch.zeros(2, 2)},
        ValueError,
        "got values in [-2, 3]",
    ),
    ({"pos_to_expert": torch.zeros(5, dtype=torch.int32)}, ValueError, "pos_to_expert must have shape (4,)"),
    ({"pos_to_expert": torch.zeros(4, 1, dtype=torch.int32)}, ValueError, "pos_to_expert must be 1-D"),
    ({"swiglu_clamp_value": 0.0}, ValueError, "swiglu_clamp_value must be a finite float > 0"),
    ({"swiglu_clamp_value": -1.0}, ValueError, "swiglu_clamp_value must be a finite float > 0"),
    ({"swiglu_clamp_value": float("inf")}, ValueError, "swiglu_clamp_value must be a finite float > 0"),
    ({"swiglu_clamp_value": NAN}, ValueError, "swiglu_clamp_value must be a finite float > 0"),
    ({"swiglu_clamp_value": "1"}, TypeError, "swiglu_clamp_value must be a float or None"),
    ({"swiglu_clamp_value": True}, TypeError, "swiglu_clamp_value must be a float or None"),
    ({"clamped_count": torch.zeros(3, dtype=torch.int64)}, ValueError, "clamped_count counts clamped elements"),
    (
        {"clamped_count": torch.zeros(3, dtype=torch.int32), "swiglu_clamp_value": 1.0},
        TypeError,
        "clamped_count must have dtype in (int64)",
    ),
    (
        {"clamped_count": torch.zeros(4, dtype=torch.int64), "swiglu_clamp_value": 1.0},
        ValueError,
        "clamped_count must have shape (3,)",
    ),
    ({"round_sf": 1}, TypeError, "round_sf must be a bool"),
    ({"use_packed_ue8m0": None}, TypeError, "use_packed_ue8m0 must be a bool"),
]


@pytest.mark.parametrize(("overrides", "error", "message"), FORWARD_ERRORS)
def test_forward_per_token_validation(overrides, error, message):
    with pytest.raises(error) as info:
        qs.swiglu_forward_and_per_token_cast(**_forward_args(**overrides))
    assert message in str(info.value)


PER_CHANNEL_ERRORS = [
    ({"fmt": "e2m1"}, ValueError, "fmt must be one of ['e4m3']"),
    ({"num_per_tokens": 64}, ValueError, "num_per_tokens must be one of (32, 128), got 64"),
    ({"x": torch.zeros(4, 256)}, TypeError, "x must have dtype in (bfloat16)"),
    ({"x": torch.zeros(4, 255).bfloat16()}, ValueError, "column count must be even and non-zero, got 255"),
    ({"without_transpose": 1}, TypeError, "without_transpose must be a bool"),
    ({"round_sf": "no"}, TypeError, "round_sf must be a bool"),
    ({"swiglu_clamp_value": -0.5}, ValueError, "swiglu_clamp_value must be a finite float > 0"),
]


@pytest.mark.parametrize(("overrides", "error", "message"), PER_CHANNEL_ERRORS)
def test_forward_per_channel_validation(overrides, error, message):
    args = {"x": torch.zeros(4, 256).bfloat16(), "fmt": "e4m3", "num_per_tokens": 32}
    args.update(overrides)
    with pytest.raises(error) as info:
        qs.swiglu_forward_and_per_channel_cast_and_transpose(**args)
    assert message in str(info.value)


def _backward_args(**overrides):
    x_q, x_sf = rq.per_token_cast(torch.ones(3, 128), "e4m3", 32)
    args = {
        "x": (x_q, x_sf),
        "grad_out": torch.ones(3, 64).bfloat16(),
        "weight": torch.ones(2, 2),
        "pos_to_token_topk": torch.tensor([0, 3, -1], dtype=torch.int32),
        "token_topk_to_pos": torch.tensor([[0, -1], [-1, 1]], dtype=torch.int32),
        "num_per_channels": 32,
    }
    args.update(overrides)
    return args


def _col_major_scales():
    _, sf = rq.per_token_cast(torch.ones(3, 128), "e4m3", 32, use_tma_aligned_col_major_sf=True)
    return sf


BACKWARD_ERRORS = [
    ({"x": torch.zeros(3, 128)}, TypeError, "x must be a (x_q, x_sf) pair"),
    ({"x": (torch.zeros(3, 128).bfloat16(), torch.ones(3, 4))}, TypeError, "x[0] must have dtype in (float8_e4m3fn)"),
    ({"num_per_channels": 64}, ValueError, "num_per_channels must be one of (32, 128), got 64"),
    ({"num_per_channels": "32"}, TypeError, "num_per_channels must be an int"),
    ({"num_per_channels": 128}, ValueError, "the hidden size 64 must be a multiple of num_per_channels (128)"),
    ({"x": (torch.zeros(3, 128).to(torch.float8_e4m3fn), torch.ones(3, 3))}, ValueError, "x[1] must have shape (3, 4)"),
    ({"x": (torch.zeros(3, 128).to(torch.float8_e4m3fn), _col_major_scales())}, ValueError, "x[1] must be row-major"),
    (
        {"x": (torch.zeros(3, 128).to(torch.float8_e4m3fn), torch.ones(3, 4, dtype=torch.int32))},
        TypeError,
        "x[1] must have dtype in (float32)",
    ),
    ({"grad_out": torch.ones(3, 64)}, TypeError, "grad_out must have dtype in (bfloat16)"),
    ({"grad_out": torch.ones(3, 65).bfloat16()}, ValueError, "grad_out must have shape (3, 64)"),
    ({"weight": torch.ones(2, 2).double()}, TypeError, "weight must have dtype in (float32)"),
    ({"weight": torch.ones(2, 3)}, ValueError, "token_topk_to_pos must have weight's shape (2, 3)"),
    ({"pos_to_token_topk": torch.tensor([0, 3], dtype=torch.int32)}, ValueError, "pos_to_token_topk must have shape"),
    ({"pos_to_token_topk": torch.tensor([0, 4, -1])}, ValueError, "pos_to_token_topk entries must be in [-1, 4)"),
    (
        {"token_topk_to_pos": torch.tensor([[0, -1], [-1, 3]], dtype=torch.int32)},
        ValueError,
        "token_topk_to_pos entries must be in [-1, 3)",
    ),
    (
        {"token_topk_to_pos": torch.tensor([[0, -1], [1, -1]], dtype=torch.int32)},
        ValueError,
        "must be inverse mappings",
    ),
    ({"pos_to_token_topk": torch.tensor([0, 3, 1], dtype=torch.int32)}, ValueError, "must be inverse mappings"),
    ({"round_sf": 0}, TypeError, "round_sf must be a bool"),
    ({"swiglu_clamp_value": 0}, ValueError, "swiglu_clamp_value must be a finite float > 0"),
]


@pytest.mark.parametrize(("overrides", "error", "message"), BACKWARD_ERRORS)
def test_backward_validation(overrides, error, message):
    with pytest.raises(error) as info:
        qs.swiglu_backward_and_per_token_cast(**_backward_args(**overrides))
    assert message in str(info.value)


def test_backward_valid_arguments_pass():
    out, (dx_q, dx_sf), dx, dweight = qs.swiglu_backward_and_per_token_cast(**_backward_args())
    shapes = [tuple(t.shape) for t in (out, dx_q, dx_sf, dx, dweight)]
    assert shapes == [(3, 64), (3, 128), (3, 4), (3, 128), (2, 2)]

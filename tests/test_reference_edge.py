"""The documented numeric edge policy (docs/numerics.md), one test per table row and edge class:
what the reference twins do with all-zero blocks, ±max, subnormals, scaled subnormals, outliers,
NaN and ±Inf. The oracle's edge profile holds the optimized kernels to these same references;
these tests hold the references to the page. Rows marked "open" there are pinned here as they are
(``test_open_*``): changing one is a contract decision, and these tests say where."""

from __future__ import annotations

import math

import pytest
import torch

from tileproof.reference import engram, mhc, moe, quant, quant_blocks, quant_swiglu, transpose

NAN, INF = float("nan"), float("inf")
BF16, F32 = torch.bfloat16, torch.float32
BF16_MAX, F32_MAX = torch.finfo(BF16).max, torch.finfo(F32).max
QMAX = {"e4m3": 448.0, "e2m1": 6.0, "e5m6": 65024.0}
# The scale of an all-zero (or subnormal) block: the amax floor over Qmax, plain and round_sf.
FLOOR_SCALE = {
    "e4m3": (float(torch.tensor(1e-4) / torch.tensor(448.0)), 2.0**-22),
    "e2m1": (2.0**-126, 2.0**-126),
    "e5m6": (float(torch.tensor(1e-4) / torch.tensor(65024.0)), 2.0**-29),
}
NAN_CODE = {"e4m3": 0x7F, "e2m1": 0x7, "e5m6": 0x7FF}  # e2m1 has no NaN: +6, its scale carries the NaN
CASTS = [(fmt, flags) for fmt in ("e4m3", "e2m1", "e5m6") for flags in ({}, {"round_sf": True})]


def _row(*values, width: int = 16, fill: float = 1.0, dtype=F32) -> torch.Tensor:
    """One row of ``width`` values, ``fill`` where not given."""
    row = torch.full((1, width), fill, dtype=torch.float64)
    row[0, : len(values)] = torch.tensor(values, dtype=torch.float64)
    return row.to(dtype)


def _cast(x: torch.Tensor, fmt: str, **flags):
    """(codes [T, H], fp32 scales, dequantized fp32) of the per-token cast with one block per row."""
    C = x.shape[1] if fmt == "e5m6" else 16
    q, sf = quant.per_token_cast(x, fmt, C, **flags)
    if fmt == "e5m6":
        codes = quant.unpack_e5m6(q).to(torch.int64)
        back = quant.cast_back((q, sf), "fp32", (1, C), x_special_fmt="e5m6")
    elif fmt == "e2m1":
        nibbles = q.view(torch.uint8).to(torch.int64)
        codes = torch.stack([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(x.shape[0], -1)
        back = quant.cast_back((q, sf), "fp32", (1, C))
    else:
        codes = q.view(torch.uint8).to(torch.int64)
        back = quant.cast_back((q, sf), "fp32", (1, C))
    return codes, quant.scales_from_layout(sf, x.shape[1] // C), back


def _decoded(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """The values of the codes ``_cast`` returns (before the scale)."""
    if fmt == "e5m6":
        return quant.decode_e5m6(codes.to(torch.uint16))
    if fmt == "e2m1":
        pairs = codes.reshape(codes.shape[0], -1, 2)
        return quant.decode_e2m1((pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).view(torch.int8))
    return codes.to(torch.uint8).view(torch.float8_e4m3fn).float()


def _negative_zero_code(fmt: str) -> int:
    return {"e4m3": 0x80, "e2m1": 0x8, "e5m6": 0x800}[fmt]


# ---------------------------------------------------------------------------------------------
# Casts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "flags"), CASTS)
def test_cast_zero_block_takes_the_scale_of_the_clamp_and_keeps_the_signs(fmt, flags):
    x = _row(0.0, -0.0, fill=0.0)
    codes, sf, back = _cast(x, fmt, **flags)
    assert sf.item() == FLOOR_SCALE[fmt][bool(flags)]
    assert codes[0, :2].tolist() == [0, _negative_zero_code(fmt)]
    assert (back == 0).all() and torch.signbit(back[0, 1])


def test_cast_zero_block_packed_scale_bytes():
    for fmt, byte in (("e4m3", 0x69), ("e2m1", 0x01)):
        _, sf = quant.per_token_cast(torch.zeros((1, 16)), fmt, 16, use_packed_ue8m0=True)
        assert int(sf[0, 0]) & 0xFF == byte, fmt


@pytest.mark.parametrize("cast", ["per_block_cast", "per_channel_cast"])
def test_block_and_channel_casts_share_the_clamp(cast):
    x = torch.zeros((32, 32))
    if cast == "per_block_cast":
        _, sf = quant_blocks.per_block_cast(x, "e4m3", (32, 32))
    else:
        _, sf = quant_blocks.per_channel_cast(x, "e4m3", 32)
    assert (sf == FLOOR_SCALE["e4m3"][0]).all()


@pytest.mark.parametrize(("fmt", "flags"), CASTS)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_cast_max_encodes_as_qmax_and_the_rest_of_its_block_as_zero(fmt, flags, dtype):
    largest = torch.finfo(dtype).max
    x = _row(-largest, 1.0, dtype=dtype)
    codes, sf, back = _cast(x, fmt, **flags)
    decoded = _decoded(codes, fmt)[0]
    if flags:  # round_sf: the power of two above, and the value the max rounds to (at most Qmax)
        assert math.log2(sf.item()).is_integer() and -QMAX[fmt] <= decoded[0].item() < 0
    else:
        assert sf.item() == float(torch.tensor(largest) / torch.tensor(QMAX[fmt]))
        assert decoded[0].item() == -QMAX[fmt]
    assert (decoded[1:] == 0).all() and (back[0, 1:] == 0).all()


@pytest.mark.parametrize(
    ("fmt", "flags", "dtype", "overflows"),
    [
        ("e4m3", {}, F32, False),
        ("e2m1", {}, F32, False),
        ("e5m6", {}, BF16, False),
        ("e5m6", {}, F32, True),
        ("e4m3", {"round_sf": True}, BF16, True),
        ("e4m3", {"round_sf": True}, F32, True),
        ("e2m1", {"round_sf": True}, BF16, True),
        ("e5m6", {"round_sf": True}, BF16, True),
    ],
)
def test_note_a_dequantized_max_can_overflow_to_infinity(fmt, flags, dtype, overflows):
    """Qmax·sf rounds above fp32's range for e5m6 with an fp32 max, and with round_sf for any max."""
    largest = torch.finfo(dtype).max
    _, _, back = _cast(_row(largest, dtype=dtype), fmt, **flags)
    assert math.isinf(back[0, 0].item()) == overflows
    if not overflows:
        assert back[0, 0].item() == largest


@pytest.mark.parametrize(("fmt", "flags"), CASTS)
def test_cast_subnormal_block_takes_the_clamp(fmt, flags):
    x = _row(2.0**-127, -(2.0**-127), 3 * 2.0**-129, 2.0**-149, fill=2.0**-140)
    codes, sf, back = _cast(x, fmt, **flags)
    assert sf.item() == FLOOR_SCALE[fmt][bool(flags)]
    if fmt == "e2m1":  # multiplier 2^126: 2^-127 → ±0.5, 3·2^-129 → 0.375 → 0.5, the rest → 0
        assert codes[0, :4].tolist() == [0x1, 0x9, 0x1, 0x0]
        assert back[0, :3].tolist() == [2.0**-127, -(2.0**-127), 2.0**-127]
    else:  # far below the format's smallest subnormal: ±0, the sign kept
        assert codes[0, :2].tolist() == [0, _negative_zero_code(fmt)] and (back == 0).all()


@pytest.mark.parametrize(
    ("fmt", "half_step", "scaled", "expected"),
    [
        ("e4m3", 2.0**-10, (1, 2, 3, 5, 15), (0, 2.0**-9, 2.0**-8, 2.0**-8, 2.0**-6)),
        ("e2m1", 0.25, (1, 2, 3), (0, 0.5, 1.0)),
        ("e5m6", 2.0**-21, (1, 2, 3, 127), (0, 2.0**-20, 2.0**-19, 2.0**-14)),
    ],
)
def test_cast_scaled_subnormals_round_to_nearest_even(fmt, half_step, scaled, expected):
    power = 2.0**3
    values = [QMAX[fmt] * power] + [m * half_step * power for m in scaled]
    width = 16 if fmt != "e5m6" else 8
    _, sf, back = _cast(_row(*values, width=width, fill=0.0), fmt)
    assert sf.item() == power
    assert (back[0, 1 : 1 + len(scaled)] / power).tolist() == list(expected)


@pytest.mark.parametrize(("fmt", "flags"), CASTS)
def test_cast_outlier_sets_the_scale_and_stays_within_the_round_trip_bound(fmt, flags):
    x = _row(2.0**20, fill=0.5) * torch.linspace(1, 2, 16)
    _, sf, back = _cast(x, fmt, **flags)
    amax = x.abs().max().item()
    if not flags:
        assert sf.item() == float(torch.tensor(amax) / torch.tensor(QMAX[fmt]))
    bound = {"e4m3": 2.0**-4, "e2m1": 2.0**-2, "e5m6": 2.0**-7 + 2.0**-20}[fmt]
    assert ((back - x).abs().max() / amax).item() <= bound


@pytest.mark.parametrize(("fmt", "flags"), CASTS)
def test_cast_nan_makes_the_scale_and_the_whole_block_nan(fmt, flags):
    x = _row(1.0, -2.0, NAN, 3.0)
    codes, sf, back = _cast(x, fmt, **flags)
    assert math.isnan(sf.item())  # never a finite scale
    assert (codes == NAN_CODE[fmt]).all()
    assert torch.isnan(back).all()


def test_cast_nan_scale_packs_as_ue8m0_nan():
    x = _row(NAN)
    _, sf = quant.per_token_cast(x, "e4m3", 16, use_packed_ue8m0=True)
    assert int(sf[0, 0]) & 0xFF == 0xFF
    assert math.isnan(quant.scales_from_layout(sf, 1).item())


def test_cast_nan_stays_in_its_own_block():
    x = torch.ones((1, 32))
    x[0, 3] = NAN
    codes, _, back = _cast(x, "e4m3")
    assert (codes[0, :16] == 0x7F).all() and (back[0, 16:] == 1).all()


@pytest.mark.parametrize(("fmt", "flags"), CASTS)
@pytest.mark.parametrize("infinity", [INF, -INF])
def test_cast_infinity_makes_an_infinite_scale_and_a_nan_block(fmt, flags, infinity):
    x = _row(infinity, -2.0, 3.0)
    codes, sf, back = _cast(x, fmt, **flags)
    assert sf.item() == INF
    # The multiplier Qmax/Inf is 0: the infinity becomes Inf·0 = NaN, the finite values ±0.
    assert codes[0, 0].item() == NAN_CODE[fmt]
    assert codes[0, 1:3].tolist() == [_negative_zero_code(fmt), 0]
    if fmt == "e2m1":  # a float scale: the infinity's +6 code times Inf is +Inf, the ±0 codes NaN
        assert back[0, 0].item() == INF and torch.isnan(back[0, 1:]).all()
    else:
        assert torch.isnan(back).all()


def test_cast_infinite_scale_packs_as_0xff_which_decodes_as_nan():
    _, sf = quant.per_token_cast(_row(INF), "e2m1", 16, use_packed_ue8m0=True)
    assert int(sf[0, 0]) & 0xFF == 0xFF and math.isnan(quant.scales_from_layout(sf, 1).item())


def _given_scale_codes(fmt: str, values) -> tuple[list[int], torch.Tensor]:
    x = torch.ones((1, 16))
    sf = quant.per_token_cast_with_sf_only(x, fmt, 16)  # 1/Qmax: every 1 encodes as Qmax
    x[0, : len(values)] = torch.tensor(values)
    q = quant.per_token_cast_with_precomputed_sf(x, fmt, 16, sf)
    back = quant.cast_back((q, sf), "fp32", (1, 16))
    if fmt == "e2m1":
        nibbles = q.view(torch.uint8).to(torch.int64)
        return torch.stack([nibbles & 0xF, nibbles >> 4], -1).reshape(-1).tolist(), back
    return q.view(torch.uint8).reshape(-1).tolist(), back


@pytest.mark.parametrize(("fmt", "plus", "minus"), [("e4m3", 0x7E, 0xFE), ("e2m1", 0x7, 0xF)])
def test_given_scales_saturate_max_and_outliers(fmt, plus, minus):
    codes, _ = _given_scale_codes(fmt, [F32_MAX, -(2.0**20), 3.0])
    assert codes[:3] == [plus, minus, plus]


def test_given_scales_keep_an_e4m3_nan():
    codes, back = _given_scale_codes("e4m3", [NAN, -NAN])
    assert codes[:2] == [0x7F, 0x7F] and torch.isnan(back[0, :2]).all() and (back[0, 2:] == 1).all()


def test_open_given_e2m1_scale_turns_nan_into_plus_six():
    """Open question 1: e2m1 has no NaN code; under a finite given scale a NaN dequantizes to 6·sf."""
    codes, back = _given_scale_codes("e2m1", [NAN, -NAN])
    assert codes[:2] == [0x7, 0x7] and back[0, :2].tolist() == [1.0, 1.0]


@pytest.mark.parametrize(("fmt", "plus", "minus"), [("e4m3", 0x7E, 0xFE), ("e2m1", 0x7, 0xF)])
def test_open_given_scales_saturate_infinities(fmt, plus, minus):
    """Open question 2: an infinity under a finite given scale becomes ±Qmax, finite."""
    codes, back = _given_scale_codes(fmt, [INF, -INF])
    assert codes[:2] == [plus, minus] and torch.isfinite(back).all()


def test_cast_back_nan_zero_times_infinity_and_overflow():
    data = torch.tensor([[448.0, -448.0, 0.0, 1.0]]).to(torch.float8_e4m3fn)
    data = torch.cat([data, data.view(torch.uint8).new_full((1, 12), 0x7F).view(torch.float8_e4m3fn)], dim=1)
    for sf, expected in ((F32_MAX, [INF, -INF, 0.0]), (INF, [INF, -INF, NAN]), (NAN, [NAN, NAN, NAN])):
        out = quant.cast_back((data, torch.tensor([[sf]])), "bf16", (1, 16)).float()
        assert torch.equal(out[0, :3].isnan(), torch.tensor(expected).isnan())
        assert all(a == b for a, b in zip(out[0, :3].tolist(), expected, strict=True) if not math.isnan(b))
        assert torch.isnan(out[0, 4:]).all()  # the NaN code, whatever the scale


# ---------------------------------------------------------------------------------------------
# SwiGLU
# ---------------------------------------------------------------------------------------------


def test_swiglu_activation_of_infinities_nan_and_max():
    gate = torch.tensor([[INF, -INF, NAN, F32_MAX, 1.0, INF]])
    up = torch.tensor([[2.0, 2.0, 2.0, 2.0, NAN, 0.0]])
    activation = quant_swiglu.swiglu_activation(gate, up)[0]
    assert activation[0].item() == INF  # silu(+Inf)·u
    assert torch.isnan(activation[[1, 2, 4, 5]]).all()  # −Inf/Inf, NaN, NaN·silu, Inf·0
    assert activation[3].item() == INF  # silu(max)·2 overflows fp32


def test_swiglu_cast_of_a_nan_or_infinite_activation_block():
    x = torch.tensor([[INF, -INF, NAN, 1.0, 2.0, 2.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0, INF, 1.0, 1.0, 1.0]])
    q, sf = quant_swiglu.swiglu_forward_and_per_token_cast(x, "e4m3", 4)
    assert math.isnan(sf[0, 0].item()) and (q[0].view(torch.uint8) == 0x7F).all()  # NaN in a: the whole block
    assert sf[1, 0].item() == INF  # silu(1)·Inf: an infinite scale, the infinity Inf·0 = NaN, the rest 0
    assert q[1].view(torch.uint8).tolist() == [0x7F, 0, 0, 0]


def test_swiglu_clamp_keeps_nan_and_minus_infinity_and_counts_only_infinities():
    x = torch.tensor([[INF, -INF, NAN, 1.0, INF, -INF, NAN, 0.0]])
    counts = torch.zeros(3, dtype=torch.int64)
    _, sf = quant_swiglu.swiglu_forward_and_per_token_cast(x, "e4m3", 4, swiglu_clamp_value=4.0, clamped_count=counts)
    assert counts.tolist() == [1, 1, 1]  # g = +Inf > c, u = +Inf > c, u = −Inf < −c; never a NaN
    assert math.isnan(sf.item())  # −Inf and NaN gates survive the clamp g = min(g, c)
    gate, up, *_ = quant_swiglu.swiglu_clamp(x[:, :4], x[:, 4:], 4.0)
    assert gate[0, 0].item() == 4.0 and up[0, :2].tolist() == [4.0, -4.0]


def test_swiglu_backward_propagates_a_nan_block_of_its_input():
    values = torch.ones((2, 64))
    values[0, 3] = NAN  # the first 1×32 block of row 0's gate
    x_q, x_sf = quant.per_token_cast(values, "e4m3", 32)
    grad = torch.ones((2, 32), dtype=BF16)
    out, (dx_q, dx_sf), dx, dweight = quant_swiglu.swiglu_backward_and_per_token_cast(
        (x_q, x_sf),
        grad,
        torch.ones((1, 4)),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([[0, 1, -1, -1]], dtype=torch.int32),
        32,
    )
    assert torch.isnan(out[0].float()).all() and torch.isfinite(out[1].float()).all()
    assert torch.isnan(dx[0, :32].float()).all() and math.isnan(dx_sf[0, 0].item())
    assert math.isnan(dweight[0, 0].item()) and math.isfinite(dweight[0, 1].item())


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------


def test_topk_order_of_edge_values():
    scores = torch.tensor([[0.5, NAN, 2.0, INF, -INF, -0.0, 0.0, NAN, 1e-40, F32_MAX]])
    # NaN first (by index), +Inf, the numbers descending (±0 tie by index), −Inf last.
    assert moe.topk_gate(scores, 10).tolist() == [[1, 7, 3, 9, 2, 0, 8, 5, 6, 4]]


def test_topk_zero_row_ties_go_to_the_smaller_index():
    assert moe.topk_gate(torch.zeros((1, 8)), 3).tolist() == [[0, 1, 2]]


def test_open_group_top2_sum_of_opposite_infinities_or_nan_ranks_first():
    scores = torch.tensor([[[1.0, 2.0], [INF, -INF], [NAN, 0.0], [3.0, 3.0]]])
    assert moe.topk_sum_and_topk_group_idx(scores, 2, 4).tolist() == [[1, 2, 3, 0]]
    assert moe.topk_sum_and_topk_group_idx(scores, 1, 4).tolist() == [[2, 1, 3, 0]]
    overflow = torch.tensor([[[F32_MAX, F32_MAX], [INF, 0.0]]])
    assert moe.topk_sum_and_topk_group_idx(overflow, 2, 2).tolist() == [[0, 1]]  # +Inf ties, index 0 first


def _router(logits: torch.Tensor, scoring: str, bias=None):
    bias = torch.zeros(logits.shape[1]) if bias is None else bias
    return moe.top2_sum_gate(logits, bias, 2, 0, 0, False, 0, 1.0, 0, 1, 0, 1, scoring)


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_router_refuses_non_finite_logits_of_routed_tokens(value):
    logits = torch.zeros((2, 8))
    logits[1, 3] = value
    with pytest.raises(ValueError, match="finite"):
        _router(logits, "sigmoid")
    mask = torch.tensor([True, False])  # a masked token's logits are not read
    moe.top2_sum_gate(logits, torch.zeros(8), 2, 0, 0, False, 0, 1.0, 0, 1, 0, 1, "sigmoid", mask=mask)


def test_router_saturates_on_max_and_ties_on_zeros():
    bias = torch.tensor([0.0, 0.3, 0.0, 0.0, 0.2, 0.0, 0.0, 0.0])
    idx, weights = _router(torch.zeros((1, 8)), "sigmoid", bias)
    assert idx.tolist() == [[1, 4]] and weights.tolist() == [[0.5, 0.5]]  # σ(0) = ½ exactly, the bias ranks
    logits = torch.zeros((1, 8))
    logits[0, 5], logits[0, 2] = F32_MAX, -F32_MAX
    for scoring, expected in (("sigmoid", [5, 0]), ("softmax", [5, 0]), ("sqrtsoftplus", [5, 0])):
        idx, weights = _router(logits, scoring)
        assert idx[0].tolist() == expected, scoring
    idx, weights = _router(logits, "softmax")
    assert weights.tolist() == [[1.0, 0.0]]  # exp(x - max) one-hot


@pytest.mark.parametrize(
    ("weights", "den", "normalized"),
    [
        ([0.0, 0.0], float(torch.tensor(1e-20)), [0.0, 0.0]),
        ([0.5, NAN], NAN, [NAN, NAN]),
        ([INF, 1.0], INF, [NAN, 0.0]),
        ([INF, -INF], NAN, [NAN, NAN]),
        ([F32_MAX, F32_MAX], INF, [0.0, 0.0]),  # note: the sum overflows, the weights become 0
        ([1e-40, 2e-40], float(torch.tensor(1e-20)), None),
    ],
)
def test_normalize_weight_edge_rows(weights, den, normalized):
    got_den, got = moe.normalize_weight(torch.tensor([weights]))
    assert math.isnan(got_den.item()) if math.isnan(den) else got_den.item() == den
    if normalized is not None:
        assert torch.equal(got[0].isnan(), torch.tensor(normalized).isnan())
        assert all(a == b for a, b in zip(got[0].tolist(), normalized, strict=True) if not math.isnan(b))


def _edge_bits(dtype: torch.dtype) -> torch.Tensor:
    """A row of every edge class of ``dtype`` as raw bits: ±0, ±max, a subnormal, NaNs with payloads, ±Inf."""
    words = {BF16: torch.int16, F32: torch.int32}[dtype]
    values = torch.tensor([0.0, -0.0, -torch.finfo(dtype).max, torch.finfo(dtype).tiny / 4, INF, -INF], dtype=dtype)
    nans = torch.tensor([0x7FC1, -0x1] if dtype == BF16 else [0x7FC00001, -0x3], dtype=words).view(dtype)
    return torch.cat([values, nans]).reshape(1, -1)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_copies_move_edge_values_bit_for_bit(dtype):
    x = _edge_bits(dtype)
    words = {BF16: torch.int16, F32: torch.int32}[dtype]
    assert torch.equal(transpose.transpose(x).view(words), x.view(words).T)
    assert torch.equal(transpose.batched_transpose(x[None]).view(words), x.view(words).T[None])
    expanded = moe.expand_to_fused(x, torch.tensor([[1]], dtype=torch.int32), torch.tensor([-1, 0], dtype=torch.int32))
    assert torch.equal(expanded[1].view(words), x[0].view(words)) and (expanded[0].view(words) == 0).all()
    if dtype == BF16:
        streams = mhc.expand_to_mhc(x, 4)
        assert all(torch.equal(streams[:, i].view(words), x.view(words)) for i in range(4))


def test_reduce_fused_propagates_and_saturates_in_e4m3():
    x = torch.tensor([[BF16_MAX, 1.0, NAN, INF, 0.0], [BF16_MAX, 1.0, 1.0, -INF, -0.0]], dtype=BF16)
    to_pos, weights = torch.tensor([[0, 1]], dtype=torch.int32), torch.ones((1, 2))
    out = moe.reduce_fused(x, weights, to_pos).float()[0]
    assert out[0].item() == INF and out[1].item() == 2.0 and torch.isnan(out[2:4]).all()  # overflow, NaN, Inf − Inf
    fp8 = moe.reduce_fused(x, weights, to_pos, "e4m3", torch.tensor([1.0])).view(torch.uint8)[0]
    assert fp8[:4].tolist() == [0x7E, 0x40, 0x7F, 0x7F]  # open: +Inf saturates at 448; NaN is 0x7F


def test_open_reduce_fused_e4m3_output_saturates_an_infinity():
    x = torch.tensor([[INF, -INF]], dtype=BF16)
    out = moe.reduce_fused(x, torch.ones((1, 1)), torch.tensor([[0]], dtype=torch.int32), "e4m3", torch.tensor([1.0]))
    assert out.float()[0].tolist() == [448.0, -448.0]


# ---------------------------------------------------------------------------------------------
# Engram
# ---------------------------------------------------------------------------------------------


def test_fused_weight_edge_products():
    wh = torch.tensor([[BF16_MAX, 2.0**-130, NAN, INF, 0.0, -0.0]], dtype=BF16).expand(4, -1).contiguous()
    we = torch.tensor([[2.0, 2.0**-10, 1.0, 0.0, INF, 3.0]], dtype=BF16).expand(4, -1).contiguous()
    w = engram.fused_weight(wh, we)[0]
    assert w[0].item() == INF and w[1].item() == 2.0**-140  # overflow; an exact subnormal product
    assert torch.isnan(w[2:5]).all() and w[5].item() == 0 and torch.signbit(w[5])  # NaN, Inf·0, −0


def _gate(x_edit=None, k_edit=None, v_edit=None):
    torch.manual_seed(0)
    x, k = torch.randn((2, 4, 512)).to(BF16), torch.randn((2, 4, 512)).to(BF16)
    v = torch.randn((2, 512)).to(BF16)
    for edit, tensor in ((x_edit, x), (k_edit, k), (v_edit, v)):
        if edit:
            edit(tensor)
    return x, engram.engram_gate_fwd(x, k, v, torch.ones((4, 512)), 1e-20, 1e-6)


def test_engram_zero_and_subnormal_rows_give_gate_one_half():
    for value in (0.0, 1e-39):
        x, (out, dot, gate, rstd_x, _) = _gate(lambda x, value=value: x[0, 1].fill_(value))
        assert rstd_x[0, 1].item() == pytest.approx(1e10)  # rsqrt(eps): x² underflows or is 0
        assert gate[0, 1].item() == pytest.approx(0.5, abs=1e-3)


def test_open_engram_max_makes_rstd_zero_and_gate_one_half():
    """Open question 3: x² overflows fp32, so rstd is 0 and the gate is ½ whatever the data."""
    x, (out, dot, gate, rstd_x, _) = _gate(lambda x: x[0, 1, 7].fill_(BF16_MAX))
    assert rstd_x[0, 1].item() == 0.0 and gate[0, 1].item() == 0.5 and math.isfinite(dot[0, 1].item())
    x, (out, dot, gate, rstd_x, _) = _gate(lambda x: x[0, 1, 7].fill_(2.0**64))  # far below bf16's max
    assert rstd_x[0, 1].item() == 0.0 and gate[0, 1].item() == 0.5


@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("where", ["x", "k"])
def test_engram_nan_or_infinity_in_x_or_k_makes_the_out_row_nan(value, where):
    def edit(tensor):
        tensor[0, 1, 7] = value

    _, (out, dot, gate, rstd_x, rstd_k) = _gate(edit if where == "x" else None, edit if where == "k" else None)
    assert torch.isnan(out[0, 1].float()).all() and math.isnan(gate[0, 1].item())
    assert torch.isfinite(out[0, [0, 2, 3]].float()).all() and torch.isfinite(out[1].float()).all()
    rstd = (rstd_x if where == "x" else rstd_k)[0, 1].item()
    assert math.isnan(rstd) if math.isnan(value) else rstd == 0.0


@pytest.mark.parametrize("value", [NAN, INF])
def test_engram_nan_or_infinity_in_v_fills_its_column_in_every_stream(value):
    _, (out, *_) = _gate(v_edit=lambda v: v[0, 7].fill_(value))
    column = out[0, :, 7].float()
    assert torch.isnan(column).all() if math.isnan(value) else (column == INF).all()
    assert torch.isfinite(out[0, :, :7].float()).all()


def test_engram_backward_and_reduce_propagate_nan():
    x, (out, dot, gate, rstd_x, rstd_k) = _gate()
    _, k, v = torch.randn((2, 4, 512)).to(BF16), torch.randn((2, 4, 512)).to(BF16), torch.randn((2, 512)).to(BF16)
    grad = torch.ones((2, 4, 512), dtype=BF16)
    grad[0, 1, 9] = NAN
    dx, dk, dv, dw = engram.engram_gate_bwd(grad, x, k, v, torch.ones((4, 512)), dot, gate, rstd_x, rstd_k, 1e-6)
    assert torch.isnan(dv[0, 9].float()) and torch.isfinite(dv[1].float()).all()
    partials = torch.zeros((3, 4, 8))
    partials[1, 2, 5] = NAN
    grad_wh, grad_we = torch.zeros((4, 8)), torch.zeros((4, 8))
    engram.grad_w_reduce(partials, torch.ones((4, 8), dtype=BF16), torch.ones((4, 8), dtype=BF16), grad_wh, grad_we)
    for grad_w in (grad_wh, grad_we):
        assert math.isnan(grad_w[2, 5].item()) and torch.isnan(grad_w).sum() == 1


# ---------------------------------------------------------------------------------------------
# mHC
# ---------------------------------------------------------------------------------------------


def _mixes(edit) -> torch.Tensor:
    torch.manual_seed(1)
    residual = torch.randn((2, 4, 8)).to(BF16)
    edit(residual)
    return mhc.mhc_pre_norm_fn(residual, torch.randn((24, 32)) * 0.1, None, 1e-6)


def test_mhc_norm_fn_zero_token_and_non_finite_values():
    assert (_mixes(lambda r: r[0].zero_())[0] == 0).all()
    for value in (NAN, INF):
        mixes = _mixes(lambda r, value=value: r[0, 1, 3].fill_(value))
        assert torch.isnan(mixes[0]).all() and torch.isfinite(mixes[1]).all()


def test_open_mhc_norm_fn_max_gives_zero_mixes():
    """Open question 3: Σx² overflows fp32, rsqrt is 0, the token's mixes are ±0."""
    mixes = _mixes(lambda r: r[0, 1, 3].fill_(BF16_MAX))
    assert (mixes[0] == 0).all() and (mixes[1] != 0).all()


def test_mhc_split_and_head_saturate_their_sigmoids():
    n = 4
    mixes = torch.zeros((1, 24))
    mixes[0, 0], mixes[0, 1], mixes[0, 2] = INF, -INF, NAN
    mixes[0, n], mixes[0, n + 1], mixes[0, 2 * n], mixes[0, 2 * n + 1] = INF, -INF, INF, NAN
    pre, post, comb = mhc.mhc_pre_split_mixes(mixes, torch.ones(3), torch.zeros(24), n, 2.0, 1e-6)
    one_plus_eps, eps = float(torch.tensor(1.0) + torch.tensor(1e-6)), float(torch.tensor(1e-6))
    assert pre[0, :2].tolist() == [one_plus_eps, eps]
    assert math.isnan(pre[0, 2].item()) and post[0, :2].tolist() == [2.0, 0.0]
    assert comb[0, 0, 0].item() == INF and math.isnan(comb[0, 0, 1].item())
    head = mhc.mhc_head_compute_mix(torch.tensor([[INF, -INF, NAN, 0.0]]), torch.ones(1), torch.zeros(n), 1e-6)
    assert head[0, :2].tolist() == [one_plus_eps, eps]
    assert math.isnan(head[0, 2].item())


def test_mhc_sinkhorn_edge_logits():
    torch.manual_seed(2)
    logits = torch.randn((6, 4, 4))
    logits[0, 1, 2] = NAN
    logits[1, 1, 2] = INF
    logits[2, 1] = -INF
    logits[3, 1, 2] = -INF
    logits[4] = 0.0
    logits[5, 1, 2] = F32_MAX
    comb = mhc.sinkhorn_normalize(logits, 10, 1e-6)
    assert torch.isnan(comb[:3]).all()  # NaN, exp(Inf − Inf), a row of −Inf
    assert comb[3, 1, 2].item() < 1e-5 and torch.isfinite(comb[3:]).all()
    assert torch.allclose(comb[4], torch.full((4, 4), 0.25), atol=1e-5)  # zeros: uniform
    assert comb[5, 1, 2].item() > 0.9  # softmax one-hot on the max


def test_mhc_short_sums_propagate_and_overflow():
    torch.manual_seed(3)
    x = torch.randn((1, 4, 8)).to(BF16)
    x[0, 2, 5] = NAN
    pre = torch.full((1, 4), 0.5)
    layer_input = mhc.mhc_pre_apply_mix(x, pre)
    assert torch.isnan(layer_input[0, 5].float()) and torch.isnan(layer_input.float()).sum() == 1
    y = torch.randn((1, 8)).to(BF16)
    comb = mhc.sinkhorn_normalize(torch.randn((1, 4, 4)), 10, 1e-6)
    out = mhc.mhc_post(y, x, torch.ones((1, 4)), comb)
    assert torch.isnan(out[0, :, 5].float()).all() and torch.isnan(out.float()).sum() == 4  # column c, every stream
    y[0, 1] = BF16_MAX
    out = mhc.mhc_post(y, torch.zeros((1, 4, 8), dtype=BF16), torch.full((1, 4), 2.0), comb)
    assert (out[0, :, 1].float() == INF).all()  # post_mult·max overflows
    assert (mhc.expand_to_mhc_bwd(torch.full((1, 4, 2), BF16_MAX, dtype=BF16)).float() == INF).all()


def test_mhc_big_fuse_and_recompute_equal_the_operators_one_by_one_on_nan():
    torch.manual_seed(4)
    residual = torch.randn((2, 4, 8)).to(BF16)
    residual[0, 1, 3] = NAN
    fn, scale, base = torch.randn((24, 32)) * 0.1, torch.full((3,), 0.1), torch.zeros(24)
    fused = mhc.mhc_pre_big_fuse(residual, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 10)
    mixes = mhc.mhc_pre_norm_fn(residual, fn, None, 1e-6)
    pre, post, logits = mhc.mhc_pre_split_mixes(mixes, scale, base, 4, 2.0, 1e-6)
    one_by_one = (post, mhc.sinkhorn_normalize(logits, 10, 1e-6), mhc.mhc_pre_apply_mix(residual, pre))
    for a, b in zip(fused, one_by_one, strict=True):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    assert torch.isnan(fused[2][0].float()).all() and torch.isfinite(fused[2][1].float()).all()
    pres, ys = [torch.full((2, 4), 0.25)] * 2, [torch.randn((2, 8)).to(BF16)]
    posts, combs = [torch.ones((2, 4))], [mhc.sinkhorn_normalize(torch.randn((2, 4, 4)), 10, 1e-6)]
    layer_inputs = [torch.empty((2, 8), dtype=BF16) for _ in range(2)]
    residuals = [torch.empty((2, 4, 8), dtype=BF16)]
    mhc.mhc_multilayer_recompute(residual, pres, ys, posts, combs, layer_inputs, residuals)
    second = mhc.mhc_pre_apply_mix(mhc.mhc_post(ys[0], residual, posts[0], combs[0]), pres[1])
    assert torch.equal(layer_inputs[1].float().isnan(), second.float().isnan())
    assert torch.isnan(layer_inputs[1][0, 3].float()) and torch.isnan(residuals[0][0, :, 3].float()).all()

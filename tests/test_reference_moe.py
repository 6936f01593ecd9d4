"""The reference twin of the MoE gating and routing family, proven on its own (CPU only).

Each operator is compared with an independent scalar implementation written here: rows are ranked
with ``sorted(range(E), key=(-score, index))`` (NaN first), counts are taken with Python loops, and
fp32 arithmetic is done on Python doubles rounded to fp32 with ``struct`` after every operation
(double rounding is innocuous for one fp32 addition or division: 53 >= 2·24 + 2). Integer results
and fp32 results of a fixed sequence of IEEE operations must agree bitwise.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import struct
from fractions import Fraction

import pytest
import torch

from tileproof.reference import moe as rm

NAN = float("nan")
INF = float("inf")


# ---------------------------------------------------------------------------------------------
# Independent helpers
# ---------------------------------------------------------------------------------------------


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def py_rank(row: list[float]) -> list[int]:
    """Stable descending order: NaN first (by index), then larger values, ties by index."""

    def key(e: int):
        v = row[e]
        return (0, 0.0, e) if math.isnan(v) else (1, -v, e)

    return sorted(range(len(row)), key=key)


def py_topk(scores: torch.Tensor, k: int) -> list[list[int]]:
    return [py_rank(row)[:k] for row in scores.tolist()]


def py_group_topk(scores: torch.Tensor, num_topk_sum: int, num_topk_groups: int) -> list[list[int]]:
    out = []
    for groups in scores.tolist():
        group_scores = []
        for values in groups:
            best = sorted(values, reverse=True)[:num_topk_sum]
            group_scores.append(best[0] if num_topk_sum == 1 else f32(best[0] + best[1]))
        out.append(py_rank(group_scores)[:num_topk_groups])
    return out


def py_normalize(weights: torch.Tensor) -> tuple[list[float], list[list[float]]]:
    dens, rows = [], []
    for row in weights.tolist():
        den = f32(1e-20)
        for w in row:
            den = f32(den + w)
        dens.append(den)
        rows.append([f32(w / den) for w in row])
    return dens, rows


def py_group_count(idx: torch.Tensor, num_groups: int) -> list[int]:
    counts = [0] * num_groups
    for row in idx.tolist():
        for g in row:
            if g >= 0:
                counts[g] += 1
    return counts


def py_aux_fi(idx: torch.Tensor, num_experts: int, num_aux_topk: int) -> list[float]:
    counts = py_group_count(idx, num_experts)
    num_tokens = idx.shape[0]
    if num_tokens == 0:
        return [0.0] * num_experts
    return [f32(f32(c * num_experts) / f32(num_tokens * num_aux_topk)) for c in counts]


def py_mask_by_tp(idx: torch.Tensor, n: int, num_ep_ranks: int, tp_rank: int, num_tp_ranks: int) -> list[list[int]]:
    """TileKernels' formulation, written out per element."""
    per_gpu = n // num_ep_ranks
    per_dp = num_tp_ranks * per_gpu
    out = []
    for row in idx.tolist():
        new_row = []
        for e in row:
            if e < 0 or (e // per_gpu) % num_tp_ranks != tp_rank:
                new_row.append(-1)
                continue
            v = e - tp_rank * per_gpu
            dp = v // per_dp
            new_row.append(v - dp * (per_dp - per_gpu))
        out.append(new_row)
    return out


def py_unique(idx: torch.Tensor) -> list[list[int]]:
    out = []
    for row in idx.tolist():
        seen, new_row = set(), []
        for g in row:
            if g >= 0 and g in seen:
                new_row.append(-1)
            else:
                seen.add(g)
                new_row.append(g)
        out.append(new_row)
    return out


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_scores(shape, seed: int, ties: bool = False) -> torch.Tensor:
    if ties:  # few distinct values: many exact ties, including ±0
        values = torch.tensor([-1.0, -0.0, 0.0, 0.5, 2.0], dtype=torch.float32)
        return values[torch.randint(0, len(values), shape, generator=gen(seed))]
    return torch.randn(shape, generator=gen(seed), dtype=torch.float32)


def random_indices(num_tokens: int, k: int, high: int, seed: int, dtype=torch.int64, low: int = -1) -> torch.Tensor:
    return torch.randint(low, high, (num_tokens, k), generator=gen(seed), dtype=dtype)


def same_bits(a: torch.Tensor, b: list) -> bool:
    expected = torch.tensor(b, dtype=a.dtype).reshape(a.shape)
    if a.dtype.is_floating_point:
        return torch.equal(a.view(torch.int32), expected.view(torch.int32))
    return torch.equal(a, expected)


TOKEN_COUNTS = (0, 1, 7, 33)


# ---------------------------------------------------------------------------------------------
# topk_gate
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("num_experts,num_topk", [(1, 1), (16, 1), (16, 6), (16, 16), (72, 6), (256, 8)])
@pytest.mark.parametrize("ties", [False, True])
def test_topk_gate_matches_sorted(num_tokens, num_experts, num_topk, ties):
    scores = random_scores((num_tokens, num_experts), seed=num_tokens * 1000 + num_experts, ties=ties)
    out = rm.topk_gate(scores, num_topk)
    assert out.dtype == torch.int64 and out.shape == (num_tokens, num_topk) and out.is_contiguous()
    assert same_bits(out, py_topk(scores, num_topk))


def test_topk_gate_tie_rules():
    scores = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0, 3.0],
            [0.0, -0.0, 0.0, -0.0, -1.0],
            [-INF, -INF, -INF, 5.0, -INF],
            [1.0, NAN, 2.0, NAN, INF],
        ]
    )
    out = rm.topk_gate(scores, 5)
    assert out.tolist() == [[1, 2, 4, 3, 0], [0, 1, 2, 3, 4], [3, 0, 1, 2, 4], [1, 3, 4, 2, 0]]


def test_topk_gate_non_contiguous_input_and_determinism():
    base = random_scores((64, 40), seed=5, ties=True)
    view = base[:, ::2]
    first = rm.topk_gate(view, 4)
    assert same_bits(first, py_topk(view, 4))
    assert torch.equal(first, rm.topk_gate(view.contiguous(), 4))


# ---------------------------------------------------------------------------------------------
# topk_sum_and_topk_group_idx
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("num_groups,per_group,num_topk_groups", [(1, 2, 1), (8, 32, 4), (8, 4, 8), (4, 2, 1)])
@pytest.mark.parametrize("num_topk_sum", [1, 2])
@pytest.mark.parametrize("ties", [False, True])
def test_group_topk_matches_loops(num_tokens, num_groups, per_group, num_topk_groups, num_topk_sum, ties):
    scores = random_scores((num_tokens, num_groups, per_group), seed=num_tokens + 17 * num_groups, ties=ties)
    out = rm.topk_sum_and_topk_group_idx(scores, num_topk_sum, num_topk_groups)
    assert out.dtype == torch.int64 and out.shape == (num_tokens, num_topk_groups)
    assert same_bits(out, py_group_topk(scores, num_topk_sum, num_topk_groups))


def test_group_topk_repeated_maximum_counts_twice():
    # group 0: top-2 sum 3 + 3 = 6; group 1: 5 + 0 = 5; top-1 would prefer group 1.
    scores = torch.tensor([[[3.0, 3.0, 1.0], [5.0, 0.0, 0.0]]])
    assert rm.topk_sum_and_topk_group_idx(scores, 2, 2).tolist() == [[0, 1]]
    assert rm.topk_sum_and_topk_group_idx(scores, 1, 2).tolist() == [[1, 0]]


def test_deepseek_v3_shape():
    """256 experts in 8 groups of 32, 4 groups kept, top-8 inside them, 300 tokens."""
    scores = torch.rand((300, 256), generator=gen(3), dtype=torch.float32)
    groups = rm.topk_sum_and_topk_group_idx(scores.view(300, 8, 32), 2, 4)
    assert same_bits(groups, py_group_topk(scores.view(300, 8, 32), 2, 4))
    keep = torch.zeros(300, 8, dtype=torch.bool).scatter_(1, groups, True).repeat_interleave(32, dim=1)
    topk = rm.topk_gate(scores.masked_fill(~keep, -INF), 8)
    assert same_bits(topk, py_topk(scores.masked_fill(~keep, -INF), 8))
    assert bool(((topk // 32).unsqueeze(-1) == groups.unsqueeze(1)).any(-1).all())


# ---------------------------------------------------------------------------------------------
# normalize_weight
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("num_topk", [1, 2, 6, 9])
def test_normalize_weight_bitwise(num_tokens, num_topk):
    weights = torch.rand((num_tokens, num_topk), generator=gen(num_tokens * 10 + num_topk), dtype=torch.float32)
    den, out = rm.normalize_weight(weights)
    exp_den, exp_out = py_normalize(weights)
    assert den.dtype == out.dtype == torch.float32 and den.shape == (num_tokens,) and out.shape == weights.shape
    assert same_bits(den, exp_den) and same_bits(out, exp_out)


def test_normalize_weight_zero_row_and_tiny():
    weights = torch.tensor([[0.0, 0.0], [1e-30, 0.0], [1.0, 3.0]])
    den, out = rm.normalize_weight(weights)
    assert out[0].tolist() == [0.0, 0.0] and den[0].item() == f32(1e-20)
    assert same_bits(den, py_normalize(weights)[0]) and same_bits(out, py_normalize(weights)[1])
    assert out[2].tolist() == [0.25, 0.75]


# ---------------------------------------------------------------------------------------------
# group_count and aux_fi
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_group_count(num_tokens, dtype):
    idx = random_indices(num_tokens, 6, 8, seed=num_tokens, dtype=dtype, low=-3)
    out = rm.group_count(idx, 8)
    assert out.dtype == torch.int32 and out.shape == (8,)
    assert same_bits(out, py_group_count(idx, 8))


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("num_experts,num_topk,num_aux_topk", [(1, 1, 1), (72, 6, 6), (256, 8, 1), (256, 8, 8)])
def test_aux_fi_bitwise(num_tokens, num_experts, num_topk, num_aux_topk):
    idx = random_indices(num_tokens, num_topk, num_experts, seed=num_tokens + num_experts)
    out = rm.aux_fi(idx, num_experts, num_aux_topk)
    assert out.dtype == torch.float32 and out.shape == (num_experts,)
    assert same_bits(out, py_aux_fi(idx, num_experts, num_aux_topk))


def test_aux_fi_uniform_routing_is_one():
    idx = torch.arange(64).reshape(16, 4)  # every expert of 64 chosen exactly once
    assert rm.aux_fi(idx, 64, 4).tolist() == [1.0] * 64
    assert rm.aux_fi(torch.empty(0, 4, dtype=torch.int64), 5, 4).tolist() == [0.0] * 5


# ---------------------------------------------------------------------------------------------
# mask_indices_by_tp and inplace_unique_group_indices
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize(
    "num_experts,num_ep_ranks,num_tp_ranks", [(72, 8, 2), (256, 8, 4), (16, 1, 2), (72, 8, 8), (8, 6, 4)]
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_mask_indices_by_tp(num_tokens, num_experts, num_ep_ranks, num_tp_ranks, dtype):
    n = num_experts * num_ep_ranks
    idx = random_indices(num_tokens, 8, n, seed=num_tokens + n, dtype=dtype, low=-2)
    for tp_rank in range(num_tp_ranks):
        out = rm.mask_indices_by_tp(idx, n, num_ep_ranks, tp_rank, num_tp_ranks)
        assert out.dtype == dtype and out.shape == idx.shape
        assert same_bits(out, py_mask_by_tp(idx, n, num_ep_ranks, tp_rank, num_tp_ranks))


def test_mask_indices_by_tp_partitions_experts():
    """Across the TP ranks every expert is kept exactly once, and each rank's numbering is dense."""
    n, num_ep_ranks, num_tp_ranks = 64, 8, 4
    idx = torch.arange(n).reshape(1, n)
    outs = [rm.mask_indices_by_tp(idx, n, num_ep_ranks, r, num_tp_ranks) for r in range(num_tp_ranks)]
    kept = torch.stack([o >= 0 for o in outs]).sum(0)
    assert kept.tolist() == [[1] * n]
    for o in outs:
        assert sorted(o[o >= 0].tolist()) == list(range(n // num_tp_ranks))


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("num_groups,num_topk", [(1, 1), (8, 4), (8, 8), (8, 12), (128, 9)])
def test_inplace_unique_group_indices(num_tokens, num_groups, num_topk):
    idx = random_indices(num_tokens, num_topk, num_groups, seed=num_tokens * 3 + num_groups, low=-2)
    expected = py_unique(idx)
    storage = idx.data_ptr()
    out = rm.inplace_unique_group_indices(idx, num_groups)
    assert out is idx and idx.data_ptr() == storage
    assert same_bits(idx, expected)


def test_inplace_unique_keeps_first_and_padding():
    idx = torch.tensor([[3, 1, 3, 3, 1], [-2, -2, 0, -1, 0]], dtype=torch.int32)
    rm.inplace_unique_group_indices(idx, 4)
    assert idx.tolist() == [[3, 1, -1, -1, -1], [-2, -2, 0, -1, -1]]


# ---------------------------------------------------------------------------------------------
# Validation: the same refusals, naming the argument
# ---------------------------------------------------------------------------------------------

S2 = torch.zeros(4, 8)
S3 = torch.zeros(4, 4, 2)
I2 = torch.zeros(4, 3, dtype=torch.int64)

BAD_CALLS = [
    ("topk_gate", (S2, 9), ValueError, "num_topk"),
    ("topk_gate", (S2, 0), ValueError, "num_topk"),
    ("topk_gate", (S2, -1), ValueError, "num_topk"),
    ("topk_gate", (S2, 2.0), TypeError, "num_topk"),
    ("topk_gate", (S2, True), TypeError, "num_topk"),
    ("topk_gate", (S2.double(), 2), TypeError, "scores"),
    ("topk_gate", (S2.bfloat16(), 2), TypeError, "scores"),
    ("topk_gate", (S3, 2), ValueError, "scores"),
    ("topk_gate", (S2.tolist(), 2), TypeError, "scores"),
    ("topk_sum_and_topk_group_idx", (S3, 3, 2), ValueError, "num_topk_sum"),
    ("topk_sum_and_topk_group_idx", (torch.zeros(4, 4, 3), 3, 2), ValueError, "num_topk_sum"),
    ("topk_sum_and_topk_group_idx", (torch.zeros(4, 4, 1), 2, 2), ValueError, "num_topk_sum"),
    ("topk_sum_and_topk_group_idx", (S3, 2, 5), ValueError, "num_topk_groups"),
    ("topk_sum_and_topk_group_idx", (S3, 2, 0), ValueError, "num_topk_groups"),
    ("topk_sum_and_topk_group_idx", (S2, 2, 2), ValueError, "scores"),
    ("topk_sum_and_topk_group_idx", (S3.half(), 2, 2), TypeError, "scores"),
    ("normalize_weight", (S2.double(),), TypeError, "topk_weights"),
    ("normalize_weight", (S3,), ValueError, "topk_weights"),
    ("group_count", (I2.float(), 4), TypeError, "group_idx"),
    ("group_count", (I2[0], 4), ValueError, "group_idx"),
    ("group_count", (I2 + 4, 4), ValueError, "group_idx"),
    ("group_count", (I2, 0), ValueError, "num_groups"),
    ("group_count", (I2, "4"), TypeError, "num_groups"),
    ("aux_fi", (I2, 0, 1), ValueError, "num_experts"),
    ("aux_fi", (I2, 4, 0), ValueError, "num_aux_topk"),
    ("aux_fi", (I2 - 2, 4, 1), ValueError, "topk_idx"),
    ("aux_fi", (I2 + 4, 4, 1), ValueError, "topk_idx"),
    ("aux_fi", (I2.to(torch.int16), 4, 1), TypeError, "topk_idx"),
    ("mask_indices_by_tp", (I2, 10, 4, 0, 2), ValueError, "n"),
    ("mask_indices_by_tp", (I2, 8, 4, 2, 2), ValueError, "tp_rank"),
    ("mask_indices_by_tp", (I2, 8, 4, -1, 2), ValueError, "tp_rank"),
    ("mask_indices_by_tp", (I2, 8, 0, 0, 2), ValueError, "num_ep_ranks"),
    ("mask_indices_by_tp", (I2, 8, 4, 0, 0), ValueError, "num_tp_ranks"),
    ("mask_indices_by_tp", (I2 + 8, 8, 4, 0, 2), ValueError, "indices"),
    ("mask_indices_by_tp", (I2.float(), 8, 4, 0, 2), TypeError, "indices"),
    ("inplace_unique_group_indices", (I2 + 4, 4), ValueError, "group_indices"),
    ("inplace_unique_group_indices", (I2, 0), ValueError, "num_groups"),
    ("inplace_unique_group_indices", (I2.view(-1), 4), ValueError, "group_indices"),
]


@pytest.mark.parametrize(
    "name,args,error,argument", BAD_CALLS, ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(BAD_CALLS)]
)
def test_validation(name, args, error, argument):
    with pytest.raises(error) as info:
        getattr(rm, name)(*args)
    assert str(info.value).startswith(f"{argument} ")


def test_every_operator_is_deterministic():
    scores = random_scores((257, 256), seed=11, ties=True)
    idx = random_indices(257, 8, 256, seed=12)
    weights = torch.rand((257, 8), generator=gen(13))
    calls = [
        lambda: rm.topk_gate(scores, 8),
        lambda: rm.topk_sum_and_topk_group_idx(scores.view(257, 8, 32), 2, 4),
        lambda: rm.normalize_weight(weights)[1].view(torch.int32),
        lambda: rm.normalize_weight(weights)[0].view(torch.int32),
        lambda: rm.group_count(idx, 256),
        lambda: rm.aux_fi(idx, 256, 8).view(torch.int32),
        lambda: rm.mask_indices_by_tp(idx, 256, 8, 1, 4),
        lambda: rm.inplace_unique_group_indices(idx // 32, 8),
    ]
    for call in calls:
        assert torch.equal(call(), call())


# ---------------------------------------------------------------------------------------------
# get_fused_mapping
# ---------------------------------------------------------------------------------------------


def py_fused_mapping(idx: torch.Tensor, num_experts: int, alignment: int):
    """Expert by expert, the (t, j) pairs in flat order, each segment padded with -1 to alignment."""
    rows = idx.tolist()
    k = idx.shape[1]
    layout, starts = [], []
    for e in range(num_experts):
        starts.append(len(layout))
        mine = [t * k + j for t, row in enumerate(rows) for j, v in enumerate(row) if v == e]
        layout += [(e, f) for f in mine]
        layout += [(-1, -1)] * (-len(mine) % alignment)
    return layout, starts, len(layout)


@pytest.mark.parametrize("num_tokens", (0, 1, 7, 33))
@pytest.mark.parametrize("num_experts,num_topk", [(16, 1), (16, 8), (256, 1), (256, 8)])
@pytest.mark.parametrize("alignment", (1, 4, 128))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_get_fused_mapping(num_tokens, num_experts, num_topk, alignment, dtype):
    idx = random_indices(num_tokens, num_topk, num_experts, seed=num_tokens + num_experts, dtype=dtype)
    layout, starts, used = py_fused_mapping(idx, num_experts, alignment)
    p2e, p2t, p2tk, tk2p, start, end, sizes, size_list = rm.get_fused_mapping(idx, num_experts, 0, alignment)
    for tensor in (p2e, p2t, p2tk, tk2p, start, end, sizes):
        assert tensor.dtype == torch.int32
    assert p2e.tolist() == [e for e, _ in layout]
    assert p2tk.tolist() == [f for _, f in layout]
    assert p2t.tolist() == [f // num_topk if f >= 0 else -1 for _, f in layout]
    assert start.tolist() == starts and end.tolist() == starts[1:] + [used]
    assert sizes.tolist() == size_list == [b - a for a, b in zip(starts, starts[1:] + [used], strict=True)]
    assert all(s % alignment == 0 for s in size_list)
    # every (t, j) with an expert lands exactly once, where token_topk_to_pos says
    where = {f: p for p, (_, f) in enumerate(layout) if f >= 0}
    flat = idx.reshape(-1).tolist()
    assert tk2p.reshape(-1).tolist() == [where[f] if v >= 0 else -1 for f, v in enumerate(flat)]
    assert len(where) == sum(v >= 0 for v in flat)


def test_get_fused_mapping_sizes():
    idx = torch.tensor([[2, 0], [0, -1], [2, 2]])
    full = rm.get_fused_mapping(idx, 3, 0, 4)
    assert full[0].tolist() == [0, 0, -1, -1, 2, 2, 2, -1] and full[7] == [4, 0, 4]
    bigger = rm.get_fused_mapping(idx, 3, 12, 4)
    assert bigger[0].tolist() == full[0].tolist() + [-1] * 4 and bigger[7] == []
    assert torch.equal(bigger[3], full[3])
    no_sync = rm.get_fused_mapping(idx, 3, 0, 4, force_no_sync=True)
    assert no_sync[0].numel() == (6 + 3 * 3) // 4 * 4 and no_sync[7] == []
    with pytest.raises(ValueError, match="^num_expanded_tokens "):
        rm.get_fused_mapping(idx, 3, 7, 4)


# ---------------------------------------------------------------------------------------------
# expand_to_fused / reduce_fused
# ---------------------------------------------------------------------------------------------


def routed(num_tokens: int, num_experts: int, num_topk: int, alignment: int, seed: int):
    scores = torch.rand(num_tokens, num_experts, generator=gen(seed))
    idx = rm.topk_gate(scores, num_topk)
    idx[torch.rand(num_tokens, num_topk, generator=gen(seed + 1)) < 0.2] = -1
    return idx, rm.get_fused_mapping(idx, num_experts, 0, alignment)


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_expand_to_fused(num_tokens):
    idx, (p2e, p2t, *_rest) = routed(num_tokens, 16, 4, 8, seed=5)
    tk2p = _rest[1]
    x = torch.randn(num_tokens, 64, generator=gen(6)).bfloat16()
    sf = torch.rand(num_tokens, 2, generator=gen(7))
    out = rm.expand_to_fused(x, tk2p, p2e)
    assert out.dtype == torch.bfloat16 and out.shape == (p2e.numel(), 64)
    for p, t in enumerate(p2t.tolist()):
        expected = x[t] if t >= 0 else torch.zeros(64, dtype=torch.bfloat16)
        assert torch.equal(out[p].view(torch.int16), expected.view(torch.int16))
    for col_major in (False, True):
        data, out_sf = rm.expand_to_fused_with_sf((x, sf), 32, tk2p, p2e, col_major)
        assert torch.equal(data, out)
        for p, t in enumerate(p2t.tolist()):
            assert torch.equal(out_sf[p], sf[t] if t >= 0 else torch.zeros(2))


def py_fma(a: float, b: float, c: float) -> float:
    """fl32(a · b + c) with one rounding: the nearest fp32 to the exact rational (ties → even)."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    near = f32(float(exact))  # within one fp32 ulp of the answer (fp64 then fp32 may round twice)
    bits = struct.unpack("<i", struct.pack("<f", near))[0]
    candidates = [struct.unpack("<f", struct.pack("<i", bits + d))[0] for d in (-1, 0, 1)]
    return min(candidates, key=lambda v: (abs(Fraction(v) - exact), struct.unpack("<i", struct.pack("<f", v))[0] & 1))


def py_reduce(x, w, x_sf, tk2p, sf) -> list[list[float]]:
    """Per token: fp32 FMAs over the valid slots in order, then one fp32 multiply by sf."""
    hidden = x.shape[1]
    xs = x.float().tolist()
    ws = w.tolist() if w is not None else None
    xsf = x_sf.tolist() if x_sf is not None else None
    out = []
    for t, row in enumerate(tk2p.tolist()):
        acc = [0.0] * hidden
        for j, p in enumerate(row):
            if p < 0:
                continue
            s = ws[t][j] if ws is not None else 1.0
            if xsf is not None:
                s = f32(s * xsf[p])
            acc = [py_fma(xs[p][h], s, acc[h]) for h in range(hidden)]
        if sf is not None:
            acc = [f32(a * sf) for a in acc]
        out.append(acc)
    return out


def e4m3_value(code: int) -> Fraction:
    """The value of a non-negative float8_e4m3fn code 0x00..0x7E (bias 7, subnormals at exponent 0)."""
    exponent, mantissa = code >> 3, code & 7
    if exponent == 0:
        return Fraction(mantissa, 8) * Fraction(1, 2**6)
    return (1 + Fraction(mantissa, 8)) * Fraction(2) ** (exponent - 7)


E4M3_VALUES = [e4m3_value(code) for code in range(0x7F)]  # ascending, 0 .. 448


def py_e4m3(v: float) -> int:
    """The float8_e4m3fn byte of an fp32 value: saturate to ±448, nearest code, ties to the even code."""
    if math.isnan(v):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    magnitude = Fraction(min(abs(v), 448.0))
    upper = bisect.bisect_left(E4M3_VALUES, magnitude)  # the first code >= |v|
    candidates = [code for code in (upper - 1, upper) if 0 <= code < len(E4M3_VALUES)]
    best = min(candidates, key=lambda code: (abs(E4M3_VALUES[code] - magnitude), code & 1))
    return sign | best


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("with_sf", [False, True])
def test_reduce_fused_bitwise(num_tokens, with_sf):
    idx, mapping = routed(num_tokens, 16, 4, 8, seed=9)
    tk2p, num_positions = mapping[3], mapping[0].numel()
    x = torch.randn(num_positions, 24, generator=gen(10)).bfloat16()
    w = torch.rand(num_tokens, 4, generator=gen(11))
    x_sf = torch.rand(num_positions, generator=gen(12)) + 0.5
    sf = torch.tensor([0.75])
    got = rm.reduce_fused((x, x_sf) if with_sf else x, w, tk2p, "", sf if with_sf else None)
    assert got.dtype == torch.bfloat16 and got.shape == (num_tokens, 24)
    expected = py_reduce(x, w, x_sf if with_sf else None, tk2p, 0.75 if with_sf else None)
    assert torch.equal(got, torch.tensor(expected, dtype=torch.float32).reshape(num_tokens, 24).bfloat16())


@pytest.mark.parametrize("num_tokens", (0, 1, 7))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "sf_value,with_weights,with_x_sf",
    [(None, True, False), (0.75, False, True), (300.0, True, True), (2.0**-12, True, False)],
)
def test_reduce_fused_fp8_bytes(num_tokens, dtype, sf_value, with_weights, with_x_sf):
    """FP8 output: the same FMA chain, then · sf, then e4m3 (300 saturates many, 2^-12 makes subnormals)."""
    idx, mapping = routed(num_tokens, 16, 4, 8, seed=19)
    tk2p, num_positions = mapping[3], mapping[0].numel()
    x = (torch.randn(num_positions, 20, generator=gen(20)) * 2).to(dtype)
    w = torch.rand(num_tokens, 4, generator=gen(21)) if with_weights else None
    x_sf = torch.rand(num_positions, generator=gen(22)) + 0.5 if with_x_sf else None
    sf = torch.tensor([sf_value]) if sf_value is not None else None
    got = rm.reduce_fused((x, x_sf) if with_x_sf else x, w, tk2p, "e4m3", sf)
    assert got.dtype == torch.float8_e4m3fn and got.shape == (num_tokens, 20) and got.is_contiguous()
    expected = [[py_e4m3(a) for a in row] for row in py_reduce(x, w, x_sf, tk2p, sf_value)]
    assert got.view(torch.uint8).tolist() == expected


def test_reduce_fused_fp8_saturation_ties_and_specials():
    # k = 1, no weights: the accumulator is x itself, so every value below reaches the encoder as is.
    saturating = [500.0, 480.0, 464.0, 449.0, -1000.0, INF, -INF]
    values = saturating + [NAN, -NAN, 2.0**-10, 3 * 2.0**-10, -1e-10, 17.0, 19.0, 0.0]
    x = torch.tensor(values).reshape(-1, 1)
    pos = torch.arange(len(values)).reshape(-1, 1)
    got = rm.reduce_fused(x, None, pos, "e4m3").view(torch.uint8).reshape(-1).tolist()
    assert got == [py_e4m3(v) for v in values]
    # 448 is 0x7E (saturated, including ±inf); every NaN is 0x7F (sign dropped); 2^-10 ties to 0;
    # 3·2^-10 to 2^-8 (0x02); -1e-10 keeps its sign (0x80); 17 ties down to 16 (0x58), 19 up to 20 (0x5A).
    assert got == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7E, 0xFE, 0x7F, 0x7F, 0x00, 0x02, 0x80, 0x58, 0x5A, 0x00]
    scaled = rm.reduce_fused(x[:4], None, pos[:4], "e4m3", torch.tensor([0.5])).view(torch.uint8)
    assert scaled.reshape(-1).tolist() == [py_e4m3(f32(v * 0.5)) for v in values[:4]]  # 250, 240, 232, 224.5


def test_fma_single_rounding():
    # a·b + c = 1 + 2^-23 + 2^-24 - 2^-70: just below a midpoint. Rounding through fp64 lands on
    # the midpoint and then ties up to 1 + 2^-22; a true fma rounds down to c = 1 + 2^-23.
    a, b, c = 1.0 + 2.0**-23, 2.0**-24 - 2.0**-47, 1.0 + 2.0**-23
    assert f32(a * b + c) == 1.0 + 2.0**-22
    got = rm.fma_fp32(torch.tensor([a]), torch.tensor([b]), torch.tensor([c]))
    assert got.item() == py_fma(a, b, c) == c


def test_expand_reduce_round_trip():
    idx, mapping = routed(65, 256, 8, 128, seed=13)
    tk2p, p2e = mapping[3], mapping[0]
    x = torch.randn(65, 128, generator=gen(14)).bfloat16()
    weights = torch.rand(65, 8, generator=gen(15)) * (idx >= 0)
    weights[:, 0] += (idx[:, 0] >= 0) * 1e-3  # no all-zero row with a valid slot
    has_slot = (idx >= 0).any(dim=1)
    _, normalized = rm.normalize_weight(weights)
    back = rm.reduce_fused(rm.expand_to_fused(x, tk2p, p2e), normalized, tk2p)
    torch.testing.assert_close(back[has_slot], x[has_slot], rtol=2**-7, atol=1e-6)
    assert not back[~has_slot].any()


# ---------------------------------------------------------------------------------------------
# top2_sum_gate
# ---------------------------------------------------------------------------------------------


def py_router(logits, bias, num_topk, num_groups, num_topk_groups, factor, fixed=None):
    """DeepSeek-V3 routing in plain Python: sigmoid, +bias, top-2 group sums, top-k, normalise.

    ``fixed[t]``, when given and not None, is row t's chosen experts (fixed routing)."""
    idx_rows, weight_rows = [], []
    per_group = logits.shape[1] // num_groups
    for t, row in enumerate(logits.tolist()):
        s = [f32(1.0 / (1.0 + math.exp(-v))) for v in row]
        r = [f32(a + b) for a, b in zip(s, bias.tolist(), strict=True)]
        sums = []
        for g in range(num_groups):
            best = sorted(r[g * per_group : (g + 1) * per_group], reverse=True)
            sums.append(f32(best[0] + best[1]))
        kept = set(py_rank(sums)[:num_topk_groups])
        candidates = [r[e] if e // per_group in kept else -INF for e in range(len(r))]
        chosen = py_rank(candidates)[:num_topk]
        if fixed is not None and fixed[t] is not None:
            chosen = fixed[t]
        den = f32(1e-20)
        for e in chosen:
            den = f32(den + s[e])
        idx_rows.append(chosen)
        weight_rows.append([f32(f32(s[e] / den) * f32(factor)) for e in chosen])
    return idx_rows, weight_rows


def test_top2_sum_gate_deepseek_v3():
    logits = torch.randn(100, 256, generator=gen(21))
    bias = torch.randn(256, generator=gen(22)) * 0.1
    idx, weights = rm.top2_sum_gate(logits, bias, 8, 4, 8, False, 0, 2.5, 0, 1, 0, 1, "sigmoid")
    want_idx, want_weights = py_router(logits, bias, 8, 8, 4, 2.5)
    assert idx.dtype == torch.int64 and weights.dtype == torch.float32
    assert idx.tolist() == want_idx
    torch.testing.assert_close(weights, torch.tensor(want_weights), rtol=4e-7, atol=0)


@pytest.mark.parametrize("twin", ["reference", "optimized"])
def test_top2_sum_gate_group_limiting_needs_two_experts_per_group(twin):
    """Groups are ranked by the sum of their top-2 scores: one expert per group is refused by name
    (it used to fail on an argument of an inner function the caller never passed)."""
    from tileproof.optimized.jit import outputs_only

    logits, bias = torch.randn(3, 8, generator=gen(23)), torch.zeros(8)
    if twin == "reference":
        gate, context = rm.top2_sum_gate, contextlib.nullcontext
    else:
        from tileproof.optimized.moe import top2_sum_gate as gate

        context = outputs_only  # validation and outputs only: no kernel built
    with context(), pytest.raises(ValueError, match="^group limiting .* at least 2 experts per group .* got 8$"):
        gate(logits, bias, 2, 4, 8, False, 0, 1.0, 0, 1, 0, 1, "softmax")
    with context():
        gate(logits, bias, 2, 2, 4, False, 0, 1.0, 0, 1, 0, 1, "softmax")  # two per group: accepted


def test_top2_sum_gate_mask_shared_and_ranks():
    logits = torch.randn(6, 16, generator=gen(23))
    bias = torch.zeros(16)
    mask = torch.tensor([True, False, True, True, True, True])
    # identity physical map with one extra slot, so that the shared expert (16) has a home
    phys = torch.tensor([[e, e] for e in range(17)], dtype=torch.int32)
    count = torch.ones(17, dtype=torch.int32)
    args = (4, 0, 0, True, 1, 1.0, 0, 1, 0, 1, "softmax", mask)
    idx, weights = rm.top2_sum_gate(logits, bias, *args, to_physical_map=phys, logical_count=count)
    assert idx.shape == (6, 5) and idx[1].tolist() == [-1] * 5 and weights[1].tolist() == [0.0] * 5
    assert idx[0, 4].item() == 16 and weights[0, 4].item() == 1.0
    assert idx[0, :4].tolist() == torch.topk(logits[0], 4).indices.tolist()
    torch.testing.assert_close(weights[0, :4].sum(), torch.tensor(1.0))
    # EP = 1, TP = 1 keeps everything; EP = 17 ranks, TP = 17: only experts of rank tp_rank survive
    tp_args = (4, 0, 0, True, 1, 1.0, 0, 17, 3, 17, "softmax", mask)
    tp_idx, _ = rm.top2_sum_gate(logits, bias, *tp_args, to_physical_map=phys, logical_count=count)
    assert set(tp_idx[mask].reshape(-1).tolist()) <= {-1, 0}
    assert ((tp_idx == 0) == (idx == 3)).all()
    with pytest.raises(ValueError, match="^num_shared_experts "):
        rm.top2_sum_gate(logits, bias, 4, 0, 0, True, 1, 1.0, 0, 1, 0, 1, "sigmoid")
    with pytest.raises(ValueError, match="^scoring_func "):
        rm.top2_sum_gate(logits, bias, 4, 0, 0, False, 0, 1.0, 0, 1, 0, 1, "identity")


@pytest.mark.parametrize("scoring_func", ["sigmoid", "sqrtsoftplus", "softmax"])
def test_top2_sum_gate_empty_and_sqrtsoftplus(scoring_func):
    logits = torch.tensor([[30.0, 21.0, -3.0, 0.5]])
    idx, weights = rm.top2_sum_gate(logits, torch.zeros(4), 2, 0, 0, False, 0, 1.0, 0, 1, 0, 1, scoring_func)
    assert idx.tolist() == [[0, 1]]
    if scoring_func == "sqrtsoftplus":  # softplus(x) = x above 20
        s0, s1 = f32(math.sqrt(30.0)), f32(math.sqrt(21.0))
        torch.testing.assert_close(weights, torch.tensor([[s0 / (s0 + s1), s1 / (s0 + s1)]]))
    empty = rm.top2_sum_gate(torch.zeros(0, 4), torch.zeros(4), 2, 0, 0, False, 0, 1.0, 0, 1, 0, 1, scoring_func)
    assert empty[0].shape == (0, 2) and empty[1].shape == (0, 2)


# ---------------------------------------------------------------------------------------------
# top2_sum_gate: fixed routing and the unmapped indices
# ---------------------------------------------------------------------------------------------


def test_top2_sum_gate_fixed_routing_and_unmapped():
    num_tokens, num_routed, num_topk = 40, 64, 6
    logits = torch.randn(num_tokens, num_routed, generator=gen(31))
    bias = torch.randn(num_routed, generator=gen(32)) * 0.1
    mask = torch.rand(num_tokens, generator=gen(33)) > 0.2
    fix = torch.rand(num_tokens, generator=gen(34)) > 0.5
    mask[:2], fix[:2] = torch.tensor([False, True]), torch.tensor([True, True])  # a masked and a routed fixed row
    logits[0] = NAN  # a masked token's logits are not read
    given = torch.randint(0, num_routed, (num_tokens, num_topk), generator=gen(35))  # repeats allowed
    # The buffer is a slice of a wider one (row stride k + 3) whose padding columns must survive.
    wide = torch.full((num_tokens, num_topk + 3), 12345, dtype=torch.int64)
    wide[:, :num_topk] = given
    wide[0, :num_topk] = -1  # a masked fixed row (left by an earlier call) is not read either
    unmapped = wide[:, :num_topk]
    args = (num_topk, 4, 8, False, 0, 2.5, 0, 1, 0, 1, "sigmoid", mask, fix)
    idx, weights = rm.top2_sum_gate(logits, bias, *args, unmapped_topk_idx=unmapped)

    routed_rows = [t for t in range(num_tokens) if mask[t]]
    fixed = [given[t].tolist() if fix[t] else None for t in routed_rows]
    want_idx, want_weights = py_router(logits[routed_rows], bias, num_topk, 8, 4, 2.5, fixed)
    assert idx[routed_rows].tolist() == want_idx
    torch.testing.assert_close(weights[routed_rows], torch.tensor(want_weights), rtol=4e-7, atol=0)
    assert idx[~mask].eq(-1).all() and weights[~mask].eq(0).all()
    expected_unmapped = [[-1] * num_topk for _ in range(num_tokens)]
    for t, chosen in zip(routed_rows, want_idx, strict=True):
        expected_unmapped[t] = chosen
    assert unmapped.tolist() == expected_unmapped
    assert wide[:, num_topk:].eq(12345).all()


def test_top2_sum_gate_unmapped_is_the_logical_choice():
    """unmapped_topk_idx holds the logical experts; topk_idx their replicas, TP-masked (loops here)."""
    num_tokens, num_routed, num_topk, num_extra = 9, 16, 4, 4  # 20 physical experts on 4 EP ranks of 5
    logits = torch.randn(num_tokens, num_routed, generator=gen(41))
    bias = torch.randn(num_routed, generator=gen(42)) * 0.1
    count = torch.randint(1, num_extra + 2, (num_routed + 1,), generator=gen(43), dtype=torch.int32)
    phys = torch.randint(
        0, num_routed + num_extra, (num_routed + 1, num_extra + 1), generator=gen(44), dtype=torch.int32
    )
    fix = torch.tensor([t % 3 == 0 for t in range(num_tokens)])
    given = torch.randint(0, num_routed, (num_tokens, num_topk), generator=gen(45))
    ep_rank, num_ep_ranks, num_tp_ranks = 1, 4, 2
    for tp_rank in range(num_tp_ranks):
        unmapped = given.clone()
        args = (num_topk, 0, 0, True, 1, 1.0, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, "softmax")
        # Positional: TileKernels' order (mask, fix_routing_mask, to_physical_map, logical_count, unmapped_topk_idx).
        idx, _ = rm.top2_sum_gate(logits, bias, *args, None, fix, phys, count, unmapped)
        for t in range(num_tokens):
            ranking = [
                f32(v + b) for v, b in zip(logits[t].tolist(), bias.tolist(), strict=True)
            ]  # softmax ranks logits
            logical = given[t].tolist() if fix[t] else py_rank(ranking)[:num_topk]
            assert unmapped[t].tolist() == logical
            replicas = [phys[e, (ep_rank + t * 23333) % int(count[e])].item() for e in logical + [num_routed]]
            expected = py_mask_by_tp(
                torch.tensor([replicas]), num_routed + num_extra, num_ep_ranks, tp_rank, num_tp_ranks
            )
            assert idx[t].tolist() == expected[0]


L4, B8, U42 = torch.zeros(4, 8), torch.zeros(8), torch.zeros(4, 2, dtype=torch.int64)
ALL4 = torch.ones(4, dtype=torch.bool)


def gate(logits=L4, **kwargs):
    return rm.top2_sum_gate(logits, B8, 2, 0, 0, False, 0, 1.0, 0, 1, 0, 1, "sigmoid", **kwargs)


def with_nan(row: int) -> torch.Tensor:
    logits = L4.clone()
    logits[row, 3] = NAN
    return logits


BAD_EXTRAS = {
    "fix-without-unmapped": (lambda: gate(fix_routing_mask=ALL4), ValueError, "fix_routing_mask"),
    "fix-dtype": (lambda: gate(fix_routing_mask=ALL4.int(), unmapped_topk_idx=U42), TypeError, "fix_routing_mask"),
    "fix-shape": (lambda: gate(fix_routing_mask=ALL4[:3], unmapped_topk_idx=U42), ValueError, "fix_routing_mask"),
    "fixed-index-too-large": (
        lambda: gate(fix_routing_mask=ALL4, unmapped_topk_idx=U42 + 8),
        ValueError,
        "unmapped_topk_idx",
    ),
    "fixed-index-negative": (
        lambda: gate(fix_routing_mask=ALL4, unmapped_topk_idx=U42 - 1),
        ValueError,
        "unmapped_topk_idx",
    ),
    "unmapped-dtype": (lambda: gate(unmapped_topk_idx=U42.int()), TypeError, "unmapped_topk_idx"),
    "unmapped-list": (lambda: gate(unmapped_topk_idx=U42.tolist()), TypeError, "unmapped_topk_idx"),
    "unmapped-shape": (
        lambda: gate(unmapped_topk_idx=torch.zeros(4, 3, dtype=torch.int64)),
        ValueError,
        "unmapped_topk_idx",
    ),
    "unmapped-inner-stride": (
        lambda: gate(unmapped_topk_idx=torch.zeros(2, 4, dtype=torch.int64).T),
        ValueError,
        "unmapped_topk_idx",
    ),
    "nan-in-routed-token": (
        lambda: gate(with_nan(2), mask=torch.tensor([False, True, True, True])),
        ValueError,
        "logits",
    ),
    "fp8-format": (lambda: rm.reduce_fused(L4, None, U42, "e5m2"), ValueError, "fp8_format"),
    "fp8-format-none": (lambda: rm.reduce_fused(L4, None, U42, None), ValueError, "fp8_format"),
    "sf-shape": (lambda: rm.reduce_fused(L4, None, U42, "e4m3", torch.ones(2)), ValueError, "sf"),
    "sf-dtype": (lambda: rm.reduce_fused(L4, None, U42, "e4m3", torch.ones(1, dtype=torch.float64)), TypeError, "sf"),
}


@pytest.mark.parametrize("name", list(BAD_EXTRAS))
def test_validation_of_the_extras(name):
    call, error, argument = BAD_EXTRAS[name]
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(f"{argument} ")


def test_masked_tokens_are_not_read():
    """Invalid fixed indices and NaN logits are fine in masked tokens (they take no part)."""
    mask = torch.tensor([True, False, True, True])
    unmapped = U42.clone()
    unmapped[1] = 99
    idx, weights = gate(with_nan(1), mask=mask, fix_routing_mask=ALL4, unmapped_topk_idx=unmapped)
    assert idx[1].tolist() == [-1, -1] and weights[1].tolist() == [0.0, 0.0]
    assert unmapped.tolist() == [[0, 0], [-1, -1], [0, 0], [0, 0]]
    assert weights[0].tolist() == [0.5, 0.5]  # the fixed row [0, 0]: twice sigmoid(0) over its double


@pytest.mark.parametrize("scoring_func", ["sigmoid", "sqrtsoftplus"])
def test_router_rankings_of_bounded_scores_are_never_negative_zero(scoring_func):
    """The optimized router skips the ``-0 → +0`` step of its ranking keys for these two scoring
    functions: their scores are ``>= +0`` and a sum is ``-0`` only when both terms are. Finite
    logits from the extremes through the subnormals, biases including ``-0``."""
    big = torch.finfo(torch.float32).max
    tiny = torch.finfo(torch.float32).smallest_normal
    logits = torch.tensor(
        [-big, -1e30, -1000.0, -104.0, -88.8, -20.0, -tiny, -1e-45, -0.0, 0.0, 1e-45, 20.0, 21.0, big]
    )
    bias = torch.tensor([-0.0, 0.0, -1.0, 1.0, -1e-45, -big])
    scores = rm._scores_from_logits(logits.unsqueeze(0), scoring_func).squeeze(0)
    assert bool((scores >= 0).all())
    ranking = scores.unsqueeze(1) + bias.unsqueeze(0)
    negative_zero = (ranking == 0) & torch.signbit(ranking)
    assert not bool(negative_zero.any()), ranking[negative_zero]

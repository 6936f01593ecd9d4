"""GPU: the optimized top-k rankers and router (``tileproof.optimized.moe.router``) agree with the
reference twin: indices bit for bit on every input (ties, ``±0``, ``±inf``, NaN), router weights bit
for bit for sigmoid and sqrt-softplus (the kernel calls the same ``expf``/``log1pf``/``sqrtf`` as
PyTorch's CUDA kernels and sums in the same order) and within the contract's ``2^-16`` for softmax
(its denominator is summed in another order).

The rankers' expected indices come from the reference run on the CPU: the executable
specification, whose ``torch.sort`` ranks a NaN of either sign first (a GPU radix sort need not:
it orders the raw bits, and a negative NaN's bits sit below ``-inf``). The router's inputs hold no
NaN, so its reference runs on the GPU, which also gives the weights PyTorch's CUDA bits.

Every case runs under ``poison_outputs``, so an element the kernels never write shows up. The
inputs are built on ``DEVICE``; with it set to ``"cpu"``, every case also runs under
``compile_only()`` on a CPU machine (which checks that every configuration the cases reach compiles).
"""

import dataclasses

import pytest
import torch

import tileproof.reference.moe as reference
from tileproof.optimized.jit import poison_outputs
from tileproof.oracle.moe import RouterParams, Top2SumGateOp, _router_params
from tileproof.oracle.registry import Case

pytestmark = pytest.mark.gpu

DEVICE = "cuda"  # every input is built on it (a compile-only run on a CPU machine sets "cpu")
ROUTER_WEIGHT_BOUND = 2.0**-16
# Exact ties, signed zeros and infinities; "special" adds NaNs of both signs.
TIE_VALUES = (float("-inf"), -1.0, -0.0, 0.0, 0.5, 2.0)
SPECIAL_VALUES = (*TIE_VALUES, float("inf"), float("nan"), -float("nan"))


def _optimized():
    import tileproof.optimized.moe as optimized

    return optimized


def _scores(shape, values, padding, generator):
    """fp32 scores of ``shape``, a view of a buffer whose last dimension is ``padding`` longer; the
    padding holds NaN, which ranks first: a kernel reading past a row shows."""
    wide = (*shape[:-1], shape[-1] + padding)
    if values == "randn":
        data = torch.randn(wide, generator=generator)
    else:
        table = torch.tensor(TIE_VALUES if values == "ties" else SPECIAL_VALUES)
        data = table[torch.randint(0, len(table), wide, generator=generator)]
    data[..., shape[-1] :] = float("nan")
    return data.to(DEVICE)[..., : shape[-1]]


def _assert_same(actual, expected, what):
    assert actual.dtype == expected.dtype, what
    assert actual.shape == expected.shape, what
    sizes = zip(actual.shape, actual.stride(), expected.stride(), strict=True)
    assert all(a == b for size, a, b in sizes if size > 1), f"{what}: strides {actual.stride()} {expected.stride()}"
    if actual.dtype == torch.float32:
        actual, expected = actual.view(torch.int32), expected.view(torch.int32)
    differ = (actual != expected).nonzero()
    assert differ.numel() == 0, f"{what}: {differ.shape[0]} differ, first at {differ[0].tolist()}"


# --- topk_gate ----------------------------------------------------------------------------------

TOPK_CASES = [
    (tokens, experts, k, values, padding)
    for tokens in (1, 7, 129)
    for experts, k in ((1, 1), (16, 16), (33, 9), (72, 6), (144, 2), (256, 8), (384, 9), (256, 40), (1100, 5))
    for values in ("randn", "ties", "special")
    for padding in (0, 3)
] + [
    (0, 256, 8, "randn", 0),
    (4001, 256, 8, "ties", 0),
    (8001, 384, 9, "special", 16),
    (300, 96, 8, "randn", 16),
]


@pytest.mark.parametrize("tokens,experts,k,values,padding", TOPK_CASES)
def test_topk_gate_matches_reference(tokens, experts, k, values, padding):
    generator = torch.Generator().manual_seed(tokens * 7919 + experts * 31 + k)
    scores = _scores((tokens, experts), values, padding, generator)
    with poison_outputs():
        actual = _optimized().topk_gate(scores, k)
    _assert_same(actual.cpu(), reference.topk_gate(scores.cpu(), k), "topk_idx")


# --- topk_sum_and_topk_group_idx ----------------------------------------------------------------

GROUP_CASES = [
    (tokens, groups, group_size, topk_sum, kept, values, layout)
    for tokens in (1, 33)
    for groups, group_size, kept in ((8, 2, 4), (8, 9, 4), (8, 32, 8), (16, 24, 6), (4, 16, 1), (40, 3, 33), (1, 5, 1))
    for topk_sum in (1, 2)
    for values in ("randn", "ties", "special")
    for layout in ("contiguous", "padded", "transposed")
    if topk_sum <= group_size
] + [(0, 8, 32, 2, 4, "randn", "contiguous"), (4001, 8, 32, 2, 4, "ties", "padded")]


def _group_scores(tokens, groups, group_size, values, layout, generator):
    if layout == "transposed":  # expert stride G·T, group stride T: nothing contiguous
        wide = _scores((group_size, groups, tokens), values, 0, generator)
        return wide.permute(2, 1, 0)
    return _scores((tokens, groups, group_size), values, 4 if layout == "padded" else 0, generator)


@pytest.mark.parametrize("tokens,groups,group_size,topk_sum,kept,values,layout", GROUP_CASES)
def test_group_topk_matches_reference(tokens, groups, group_size, topk_sum, kept, values, layout):
    generator = torch.Generator().manual_seed(tokens * 7919 + groups * 131 + group_size * 7 + kept)
    scores = _group_scores(tokens, groups, group_size, values, layout, generator)
    with poison_outputs():
        actual = _optimized().topk_sum_and_topk_group_idx(scores, topk_sum, kept)
    _assert_same(actual.cpu(), reference.topk_sum_and_topk_group_idx(scores.cpu(), topk_sum, kept), "group_idx")


# --- top2_sum_gate ------------------------------------------------------------------------------

ROUTER = Top2SumGateOp()
# (R, k, groups, kept, scoring, S, extra, EP, TP, mask, fixed, unmapped, unmapped row stride, special):
# layouts the oracle's list does not reach: k + S > 32 (two output slots per lane), several groups
# per lane (R = 384, 64 groups), a group of three lanes (R = 72), TP ranks without a physical map.
EXTRA_ROUTER_CONFIGS = [
    (64, 40, 0, 0, "sigmoid", 0, 0, 1, 1, False, False, True, 0, ""),
    (384, 8, 64, 8, "sqrtsoftplus", 0, 0, 8, 2, True, True, True, 0, ""),
    (72, 4, 8, 2, "sigmoid", 2, 2, 2, 1, False, False, True, 11, ""),
    (96, 6, 8, 3, "softmax", 0, 0, 4, 4, True, False, False, 0, ""),
]


def _router_cases():
    cases = [
        dataclasses.replace(params, tokens=tokens) for params in _router_params("quick") for tokens in (1, 7, 129, 4001)
    ]
    for config in EXTRA_ROUTER_CONFIGS:
        experts, k, groups, kept, scoring, shared, extra, ep, tp, mask, fixed, unmapped, ld, special = config
        for tokens in (7, 1000):
            cases.append(
                RouterParams(
                    tokens, experts, k, groups, kept, scoring, shared, extra, ep, tp, mask, fixed, unmapped, ld, special
                )
            )
    cases.append(RouterParams(16384, 256, 8, 8, 4))  # DeepSeek-V3
    return cases


ROUTER_CASES = _router_cases()


@pytest.mark.parametrize("params", ROUTER_CASES, ids=ROUTER.label)
def test_top2_sum_gate_matches_reference(params):
    case = Case(ROUTER.name, ROUTER.label(params), params)
    generator = torch.Generator().manual_seed(params.tokens * 7919 + params.experts * 31 + params.topk)
    call = ROUTER.build(case, torch.device(DEVICE), generator)
    expected_idx, expected_weights, expected_unmapped = call(ROUTER.reference())
    with poison_outputs():
        actual_idx, actual_weights, actual_unmapped = call(ROUTER.optimized())
    _assert_same(actual_idx, expected_idx, "topk_idx")
    _assert_same(actual_unmapped, expected_unmapped, "unmapped_topk_idx")
    if params.scoring == "softmax":
        _assert_same(actual_weights.isnan(), expected_weights.isnan(), "NaN weights")
        error = (actual_weights.double() - expected_weights.double()).abs()
        assert bool((error <= ROUTER_WEIGHT_BOUND * expected_weights.double().abs()).all()), "softmax weights"
    else:
        _assert_same(actual_weights, expected_weights, "topk_weights")


def test_top2_sum_gate_reads_strided_inputs():
    """Logits with a row stride that is not a multiple of 4, a bias with stride 2, mask and fixed
    flags as views: scalar loads everywhere."""
    generator = torch.Generator().manual_seed(5)
    tokens, experts, k = 37, 256, 8
    logits = (torch.randn(tokens, experts + 3, generator=generator) * 2).to(DEVICE)[:, :experts]
    bias = (torch.randn(2 * experts, generator=generator) * 0.1).to(DEVICE)[::2]
    flags = torch.rand(tokens, 2, generator=generator).to(DEVICE) < 0.7
    mask, fixed = flags[:, 0], flags[:, 1]
    unmapped = torch.randint(0, experts, (tokens, k + 2), generator=generator).to(DEVICE)[:, :k]
    buffers = unmapped.clone(), unmapped.clone()
    args = (k, 4, 8, False, 0, 2.5, 0, 1, 0, 1, "sigmoid", mask, fixed)
    expected = reference.top2_sum_gate(logits, bias, *args, unmapped_topk_idx=buffers[0])
    with poison_outputs():
        actual = _optimized().top2_sum_gate(logits, bias, *args, unmapped_topk_idx=buffers[1])
    _assert_same(actual[0], expected[0], "topk_idx")
    _assert_same(actual[1], expected[1], "topk_weights")
    _assert_same(buffers[1], buffers[0], "unmapped_topk_idx")


@pytest.mark.parametrize("lowered", [1, 3, 5])
@pytest.mark.parametrize("k", [33, 40, 47])
def test_top2_sum_gate_ties_that_run_across_the_output_registers(k, lowered):
    """All scores equal but the first ``lowered`` experts', which rank last: one lane's equal keys
    win ranks on both sides of rank 32, where the results move to a lane's second register (the
    kernel counts a run of equal keys won by one lane across that boundary)."""
    tokens, experts = 5, 256
    logits = torch.zeros(tokens, experts)
    logits[:, :lowered] = -1.0
    logits, bias = logits.to(DEVICE), torch.zeros(experts, device=DEVICE)
    args = (k, 1, 1, False, 0, 1.0, 0, 1, 0, 1, "sigmoid")
    expected = reference.top2_sum_gate(logits, bias, *args)
    with poison_outputs():
        actual = _optimized().top2_sum_gate(logits, bias, *args)
    _assert_same(actual[0], expected[0], "topk_idx")
    _assert_same(actual[1], expected[1], "topk_weights")


# --- grid independence and argument checks ------------------------------------------------------


def test_results_do_not_depend_on_the_rows_per_cta(monkeypatch):
    from tileproof.optimized.moe import router

    generator = torch.Generator().manual_seed(11)
    scores = _scores((999, 256), "ties", 0, generator)
    logits = (torch.randn(999, 256, generator=generator) * 2).to(DEVICE)
    bias = torch.zeros(256, device=DEVICE)
    results = []
    for warps in (1, 4, 8):
        monkeypatch.setattr(router, "WARPS", warps)
        gate = router.topk_gate(scores, 8)
        groups = router.topk_sum_and_topk_group_idx(scores.view(999, 8, 32), 2, 4)
        idx, weights = router.top2_sum_gate(logits, bias, 8, 4, 8, False, 0, 2.5, 0, 1, 0, 1, "sigmoid")
        results.append((gate, groups, idx, weights.view(torch.int32)))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def _bad_calls(device):
    scores = torch.zeros(4, 16, device=device)
    logits, bias = torch.zeros(4, 16, device=device), torch.zeros(16, device=device)
    router = (2, 0, 0, False, 0, 1.0, 0, 1, 0, 1, "sigmoid")

    def with_router(*changes, **kwargs):
        args = list(router)
        for position, value in changes:
            args[position] = value
        return ("top2_sum_gate", (logits, bias, *args), kwargs)

    return [
        ("topk_gate", (scores.double(), 2), {}),
        ("topk_gate", (scores, 17), {}),
        ("topk_gate", (scores, True), {}),
        ("topk_sum_and_topk_group_idx", (scores.view(4, 4, 4), 3, 2), {}),
        ("topk_sum_and_topk_group_idx", (scores.view(4, 4, 4), 2, 5), {}),
        ("topk_sum_and_topk_group_idx", (scores, 2, 2), {}),
        with_router((0, 17)),
        with_router((1, 2)),
        with_router((1, 2), (2, 3)),
        with_router((3, True), (4, 1)),
        with_router((5, "2.5")),
        with_router((8, 1)),
        with_router((10, "tanh")),
        with_router(mask=torch.ones(3, dtype=torch.bool, device=device)),
        with_router(fix_routing_mask=torch.ones(4, dtype=torch.bool, device=device)),
        with_router(unmapped_topk_idx=torch.zeros(4, 4, dtype=torch.int64, device=device)[:, ::2]),
        with_router(to_physical_map=torch.zeros(16, 2, dtype=torch.int32, device=device)),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls("cpu"))))
def test_invalid_arguments_raise_the_reference_errors(index):
    name, args, kwargs = _bad_calls(DEVICE)[index]
    with pytest.raises((TypeError, ValueError)) as expected:
        getattr(reference, name)(*args, **kwargs)
    with pytest.raises(expected.type) as actual:
        getattr(_optimized(), name)(*args, **kwargs)
    assert str(actual.value) == str(expected.value)

"""CPU tests of the oracle specs of the MoE and transpose families (``tileproof.oracle.moe`` and
``tileproof.oracle.transpose``): registration, the cases of both tiers against the acceptance list,
every quick case's reference and self-checks, uninitialized (compile-only) inputs, and self-checks
that fail when the reference's outputs are damaged.

Until the two modules join ``FAMILY_MODULES`` in ``oracle/registry.py``, the ``families`` fixture
imports them and registers their specs for this module's tests only (and takes them out again
afterwards), so that the rest of the suite sees the registry it expects.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tileproof.oracle import registry, runner
from tileproof.oracle.policy import FAIL, PASS, SKIP, compare, same_bytes

CPU = torch.device("cpu")
MOE_OPS = (
    "topk_gate",
    "topk_sum_and_topk_group_idx",
    "top2_sum_gate",
    "normalize_weight",
    "aux_fi",
    "group_count",
    "mask_indices_by_tp",
    "inplace_unique_group_indices",
    "get_fused_mapping",
    "expand_to_fused",
    "expand_to_fused_with_sf",
    "reduce_fused",
)
TRANSPOSE_OPS = ("transpose", "batched_transpose")
ALL_OPS = MOE_OPS + TRANSPOSE_OPS
# Checks the runner adds itself (the rest are the specs' own self-checks).
RUNNER_CHECKS = {"build inputs", "reference", "reference self-check", "reference float64", "reference only"}
RUNNER_CHECKS |= {runner.COMPILE_NAME, "GPU comparison"}


@pytest.fixture(scope="module")
def families():
    """The two family modules, their specs registered for the duration of this test module."""
    moe = importlib.import_module("tileproof.oracle.moe")
    transpose = importlib.import_module("tileproof.oracle.transpose")
    added = []
    for spec in (*moe.SPECS, *transpose.SPECS):
        if spec.name not in registry._OPS:
            registry.register(spec)
            added.append(spec.name)
    yield moe, transpose
    for name in added:
        del registry._OPS[name]
        for tier in registry.TIERS:
            registry._CASES.pop((name, tier), None)


def _ok(checks) -> bool:
    return all(check.status in (PASS, SKIP) for check in checks)


def _params(op: str, tier: str) -> list:
    return [case.params for case in registry.cases_of(op, tier)]


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------


def test_every_public_operator_has_a_spec(families):
    moe, transpose = families
    assert tuple(spec.name for spec in moe.SPECS) == MOE_OPS == moe.OPS
    assert tuple(spec.name for spec in transpose.SPECS) == TRANSPOSE_OPS == transpose.OPS
    from tileproof.reference import moe as reference_moe
    from tileproof.reference import transpose as reference_transpose

    assert set(MOE_OPS) == set(reference_moe.__all__)
    assert set(TRANSPOSE_OPS) == set(reference_transpose.__all__)
    for name in ALL_OPS:
        spec = registry.get_op(name)
        assert spec.family == ("transpose" if name in TRANSPOSE_OPS else "moe")
        assert spec.outputs and all(output.why and output.policy for output in spec.outputs)


def test_no_optimized_twin_means_none(families):
    for family, names in (("moe", MOE_OPS), ("transpose", TRANSPOSE_OPS)):
        if importlib.util.find_spec(f"tileproof.optimized.{family}") is not None:
            continue  # a twin exists by now: nothing to test here
        for name in names:
            spec = registry.get_op(name)
            assert spec.optimized() is None
            assert spec.compile_group(registry.cases_of(name, "quick")[0]) is None


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ALL_OPS)
def test_quick_cases_pass_their_reference_self_checks(families, op):
    for case in registry.cases_of(op, "quick"):
        checks, call = runner.check_case(case, registry.case_seed(0, case.label), CPU, None, gpu=False)
        assert call is not None and _ok(checks), (case.label, [c for c in checks if c.status not in (PASS, SKIP)])
        own = [c for c in checks if c.name not in RUNNER_CHECKS and not c.name.startswith("reference ≈")]
        assert own[0].name == "reference layout" and len(own) >= 2, (case.label, checks)


@pytest.mark.parametrize("op", ALL_OPS)
def test_every_tier_has_the_edges(families, op):
    for tier in registry.TIERS:
        params = _params(op, tier)
        if op in TRANSPOSE_OPS:
            rows = {p.rows for p in params} | {p.cols for p in params}
            assert {0, 1} <= rows and any(n % 2 and n > 1 for n in rows)
            assert any(p.row_stride > p.cols for p in params), "a row stride larger than N"
            assert {"e4m3", "bf16"} <= {p.dtype for p in params}
        else:
            tokens = {p.tokens for p in params}
            assert {0, 1} <= tokens and any(t % 2 and t > 1 for t in tokens), (op, tier, tokens)


def test_full_tier_covers_the_acceptance_list(families):
    experts, topks, tokens, ep_ranks = (
        {16, 32, 64, 72, 96, 128, 144, 256, 384},
        {1, 2, 6, 8, 9},
        {0, 1, 4001, 8001},
        {1, 8, 64},
    )
    for op in ("topk_gate", "top2_sum_gate", "aux_fi", "get_fused_mapping", "expand_to_fused", "reduce_fused"):
        params = _params(op, "full")
        assert experts <= {p.experts for p in params}, op
        assert topks <= {p.topk for p in params}, op
        assert tokens <= {p.tokens for p in params}, op
    for op in ("top2_sum_gate", "aux_fi", "mask_indices_by_tp", "get_fused_mapping", "expand_to_fused", "reduce_fused"):
        assert ep_ranks <= {p.ep_ranks for p in _params(op, "full")}, op
    router = _params("top2_sum_gate", "full")
    assert {p.scoring for p in router} == {"sigmoid", "sqrtsoftplus", "softmax"}
    assert {p.shared for p in router} == {0, 1, 2}
    assert any(p.groups == 8 and p.topk_groups == 4 for p in router)
    assert all(any(getattr(p, flag) for p in router) for flag in ("mask", "fixed", "unmapped", "extra", "unmapped_ld"))
    assert any(p.groups == 8 and p.topk == 4 for p in _params("topk_sum_and_topk_group_idx", "full"))
    reduce = _params("reduce_fused", "full")
    assert all(any(getattr(p, flag) for p in reduce) for flag in ("fp8", "sf", "x_sf"))
    assert not all(p.weights for p in reduce)
    # Covering, not exploding: a few dozen cases per operator.
    for op in ALL_OPS:
        assert len(registry.cases_of(op, "full")) <= 40, op


def test_full_tier_has_the_benchmarks(families):
    benchmarks = {case.label: case for case in registry.select_cases("full", ops=ALL_OPS) if case.benchmark}
    assert all(case.title for case in benchmarks.values())
    assert "topk_gate/T16384/E256/k8" in benchmarks
    assert "top2_sum_gate/sigmoid/R256/k8/g8c4/ep1tp1/T16384" in benchmarks
    assert "normalize_weight/T16384/k8" in benchmarks
    assert "expand_to_fused/T8192/E256/k8/a128/H7168/bf16" in benchmarks
    assert "reduce_fused/T8192/E256/k8/a128/H7168/bf16/w" in benchmarks
    assert "reduce_fused/T8192/E256/k8/a128/H7168/bf16/w/e4m3/sf" in benchmarks
    transposes = [case.params for case in benchmarks.values() if case.op in TRANSPOSE_OPS]
    assert {p.dtype for p in transposes} == {"bf16", "e4m3"}
    assert any(p.rows % 64 and p.cols % 64 and p.row_stride > p.cols for p in transposes)
    assert not any(case.benchmark for case in registry.select_cases("quick", ops=ALL_OPS))


def test_bytes_moved(families):
    def case(op, label):
        (found,) = [c for c in registry.cases_of(op, "full") if c.label == label]
        return registry.get_op(op).bytes_moved(found)

    assert case("topk_gate", "topk_gate/T16384/E256/k8") == 16384 * 256 * 4 + 16384 * 8 * 8
    assert case("normalize_weight", "normalize_weight/T16384/k8") == 2 * 16384 * 8 * 4 + 16384 * 4
    # 8192 tokens × 8 valid slots, P = floor((65536 + 127·256) / 128)·128 expanded rows of 7168 bf16.
    rows = (65536 + 127 * 256) // 128 * 128
    expand = 8192 * 7168 * 2 + 8192 * 8 * 4 + rows * 7168 * 2
    assert case("expand_to_fused", "expand_to_fused/T8192/E256/k8/a128/H7168/bf16") == expand
    reduce = 65536 * 7168 * 2 + 8192 * 8 * 4 + 8192 * 7168 * 2 + 8192 * 8 * 4
    assert case("reduce_fused", "reduce_fused/T8192/E256/k8/a128/H7168/bf16/w") == reduce
    assert case("transpose", "transpose/e4m3/8192x7168/ld14336") == 2 * 8192 * 7168
    for op in ALL_OPS:
        for tier in registry.TIERS:
            for c in registry.cases_of(op, tier):
                assert registry.get_op(op).bytes_moved(c) >= 0


@pytest.mark.parametrize("op", ALL_OPS)
def test_uninitialized_inputs_have_the_seeded_layout(families, op):
    spec = registry.get_op(op)
    for case in registry.cases_of(op, "quick"):
        real = spec.build(case, CPU, torch.Generator().manual_seed(0)).tensors()
        empty = spec.build(case, CPU, None).tensors()
        assert [(t.dtype, t.shape, t.stride()) for t in real] == [(t.dtype, t.shape, t.stride()) for t in empty], case


def test_inputs_are_seeded(families):
    for op, predicate in (
        ("top2_sum_gate", lambda p: p.tokens > 1),
        ("reduce_fused", lambda p: p.tokens > 1),
        ("transpose", lambda p: p.rows > 1 and p.cols > 1),
    ):
        case = next(c for c in registry.cases_of(op, "quick") if predicate(c.params))
        spec = registry.get_op(op)
        first, again, other = (spec.build(case, CPU, torch.Generator().manual_seed(s)).tensors() for s in (5, 5, 6))
        assert all(same_bytes(a, b) for a, b in zip(first, again, strict=True))
        assert not all(same_bytes(a, b) for a, b in zip(first, other, strict=True))


# ---------------------------------------------------------------------------------------------
# The router's inputs and the in-place operators
# ---------------------------------------------------------------------------------------------


def _case(op: str, predicate) -> registry.Case:
    return next(case for case in registry.cases_of(op, "quick") if predicate(case.params))


def test_router_inputs_keep_the_routing_unambiguous(families):
    moe, _ = families
    spec = registry.get_op("top2_sum_gate")
    for case in registry.cases_of("top2_sum_gate", "quick"):
        p = case.params
        if p.special or p.tokens == 0:
            continue
        call = spec.build(case, CPU, torch.Generator().manual_seed(1))
        logits, bias = call.args[0], call.args[1]
        routed = call.kwargs.get("mask", torch.ones(p.tokens, dtype=torch.bool))
        _, margin = moe._ideal_routing(logits, bias, p)
        assert bool((margin[routed] >= moe.ROUTING_GAP).all()), case.label
        assert bool(torch.isnan(logits[~routed]).all()), "masked tokens' logits are NaN (never read)"


def test_in_place_operators_run_on_a_copy(families):
    for op, predicate in (
        ("top2_sum_gate", lambda p: p.fixed and p.unmapped_ld and p.tokens > 1),
        ("inplace_unique_group_indices", lambda p: p.tokens > 1 and p.topk > 2),
    ):
        case = _case(op, predicate)
        spec = registry.get_op(op)
        call = spec.build(case, CPU, torch.Generator().manual_seed(2))
        before = [t.clone() for t in call.tensors()]
        first, second = spec.split(call(spec.reference())), spec.split(call(spec.reference()))
        assert all(torch.equal(a, b) for a, b in zip(before, call.tensors(), strict=True)), "inputs untouched"
        for output, a, b in zip(spec.outputs, first, second, strict=True):
            assert compare(output.name, a, b, output.policy).status == PASS
    buffer = call.args[0]
    assert not torch.equal(first[0], buffer), "the copy was written (repeats became -1)"


def test_router_float64_weights_meet_the_bound(families):
    moe, _ = families
    spec = registry.get_op("top2_sum_gate")
    case = _case("top2_sum_gate", lambda p: p.scoring == "softmax" and p.tokens > 1 and not p.special)
    call = spec.build(case, CPU, torch.Generator().manual_seed(3))
    _, weights, _ = spec.split(call(spec.reference()))
    idx64, weights64, unmapped64 = spec.reference_float64(case, call)
    assert idx64 is None and unmapped64 is None and weights64.dtype == torch.float64
    check = compare("topk_weights", weights, weights, spec.outputs[1].policy, expected64=weights64)
    assert check.status == PASS and float(check.metric) < 2.0**-20  # the fp32 reference: a few ulps
    off = weights.clone()
    off[0, 0] *= 1 + 2.0**-14
    assert compare("topk_weights", off, weights, spec.outputs[1].policy, expected64=weights64).status == FAIL


# ---------------------------------------------------------------------------------------------
# The self-checks can fail
# ---------------------------------------------------------------------------------------------


def _damaged_checks(op: str, predicate, damage) -> list:
    """The self-checks of a case whose reference outputs ``damage`` altered in place."""
    case = _case(op, predicate)
    spec = registry.get_op(op)
    call = spec.build(case, CPU, torch.Generator().manual_seed(4))
    outputs = tuple(spec.split(call(spec.reference())))
    damage(outputs)
    return spec.self_check(case, call, outputs)


def _swap_first_two(t: torch.Tensor) -> None:
    t[:, [0, 1]] = t[:, [1, 0]]


def _routed(p) -> bool:
    return p.tokens > 1 and p.topk > 1 and not p.special


# (op, which quick case, how its outputs are damaged)
DAMAGES = [
    ("topk_gate", lambda p: p.tokens > 1 and p.topk > 1 and p.values == "randn", lambda o: _swap_first_two(o[0])),
    ("topk_sum_and_topk_group_idx", lambda p: p.tokens > 1 and p.values == "randn", lambda o: _swap_first_two(o[0])),
    ("top2_sum_gate", _routed, lambda o: o[1].mul_(1.01)),
    ("top2_sum_gate", _routed, lambda o: _swap_first_two(o[0])),
    ("top2_sum_gate", lambda p: _routed(p) and p.unmapped, lambda o: _swap_first_two(o[2])),
    ("normalize_weight", lambda p: p.tokens > 1, lambda o: o[1][0].mul_(1.001)),
    ("normalize_weight", lambda p: p.tokens > 1, lambda o: o[0][0].mul_(1.001)),
    ("aux_fi", lambda p: p.tokens > 1, lambda o: o[0][0].add_(1.0)),
    ("group_count", lambda p: p.tokens > 1, lambda o: o[0][0].add_(1)),
    ("mask_indices_by_tp", lambda p: p.tokens > 1, lambda o: o[0].fill_(0)),
    ("inplace_unique_group_indices", lambda p: p.tokens > 1, lambda o: o[0][:, -1].fill_(0)),
    ("get_fused_mapping", lambda p: p.tokens > 1, lambda o: o[3].fill_(0)),
    ("get_fused_mapping", lambda p: p.tokens > 1 and p.alignment > 1, lambda o: o[6].add_(1)),
    ("get_fused_mapping", lambda p: p.tokens > 1, lambda o: _swap_first_two(o[1].reshape(1, -1))),
    ("expand_to_fused", lambda p: p.tokens > 1, lambda o: o[0][-1].view(torch.uint8).fill_(1)),
    ("expand_to_fused_with_sf", lambda p: p.tokens > 1, lambda o: o[1][-1].fill_(7)),
    ("reduce_fused", lambda p: p.tokens > 1, lambda o: o[0][0].view(torch.uint8).fill_(0x3F)),
    ("transpose", lambda p: p.rows > 1 and p.cols > 1, lambda o: o[0].view(torch.uint8).view(-1)[0:1].add_(1)),
    ("batched_transpose", lambda p: p.batch and p.rows > 1, lambda o: o[0].view(torch.uint8).view(-1)[-1:].add_(1)),
]


@pytest.mark.parametrize("op,predicate,damage", DAMAGES, ids=[f"{d[0]}-{i}" for i, d in enumerate(DAMAGES)])
def test_self_checks_catch_damaged_outputs(families, op, predicate, damage):
    checks = _damaged_checks(op, predicate, damage)
    assert any(check.status == FAIL for check in checks), checks
    assert not any(check.status == "error" for check in checks), checks

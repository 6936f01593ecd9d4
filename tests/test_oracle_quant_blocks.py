"""CPU tests of the oracle spec of the block, per-channel and lossless casts
(``tileproof.oracle.quant_blocks``): registration, the cases of both tiers, every quick case's
reference and self-checks, uninitialized (compile-only) inputs, the benchmark workloads, and
self-checks that fail when the reference's outputs are damaged.

Until the module joins ``FAMILY_MODULES`` in ``oracle/registry.py``, the ``family`` fixture imports
it and registers its specs for this module's tests only (and takes them out again afterwards), so
that the rest of the suite sees the registry it expects.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from tileproof.oracle import registry, runner
from tileproof.oracle.policy import FAIL, PASS, SKIP, Bitwise, same_bytes

CPU = torch.device("cpu")
OPS = (
    "per_block_cast",
    "per_block_cast_with_sf_only",
    "per_block_cast_with_precomputed_sf",
    "per_channel_cast",
    "per_channel_cast_fused",
    "per_channel_cast_and_transpose",
    "per_block_cast_lossless",
)
BLOCK_OPS = OPS[:3]
# Checks the runner adds itself (the rest are the spec's own self-checks).
RUNNER_CHECKS = {"build inputs", "reference", "reference self-check", "reference only", "GPU comparison"}
RUNNER_CHECKS |= {runner.COMPILE_NAME}


@pytest.fixture(scope="module")
def family():
    """The family module, its specs registered for the duration of this test module."""
    module = importlib.import_module("tileproof.oracle.quant_blocks")
    registry.all_ops()  # the registered families first: what is there already stays there
    added = []
    for spec in module.SPECS:
        if spec.name not in registry._OPS:
            registry.register(spec)
            added.append(spec.name)
    yield module
    for name in added:
        del registry._OPS[name]
        for tier in registry.TIERS:
            registry._CASES.pop((name, tier), None)


def _params(op: str, tier: str) -> list:
    return [case.params for case in registry.cases_of(op, tier)]


def _case(op: str, predicate) -> registry.Case:
    return next(case for case in registry.cases_of(op, "quick") if predicate(case.params))


# ---------------------------------------------------------------------------------------------
# Registration and the optimized twin
# ---------------------------------------------------------------------------------------------


def test_every_operator_has_a_spec(family):
    from tileproof.reference import quant_blocks as reference

    assert tuple(spec.name for spec in family.SPECS) == OPS == family.OPS
    for name in OPS:
        spec = registry.get_op(name)
        assert spec.family == "quant" and spec.reference() is getattr(reference, name)
        assert spec.outputs and all(output.why and isinstance(output.policy, Bitwise) for output in spec.outputs)
    assert [o.name for o in registry.get_op("per_block_cast_with_sf_only").outputs] == ["sf"]
    assert [o.name for o in registry.get_op("per_block_cast_with_precomputed_sf").outputs] == ["q"]


def test_optimized_is_the_kernel_by_name_or_none(family, monkeypatch):
    quant = importlib.import_module("tileproof.optimized.quant")
    for name in OPS:
        spec = registry.get_op(name)
        assert spec.optimized() is getattr(quant, name, None)
        if spec.optimized() is None:
            assert spec.compile_group(registry.cases_of(name, "quick")[0]) is None
    # A kernel added to tileproof.optimized.quant later is picked up without touching the spec.
    monkeypatch.setattr(quant, "per_block_cast_lossless", len, raising=False)
    assert registry.get_op("per_block_cast_lossless").optimized() is len


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_quick_cases_pass_their_reference_self_checks(family, op):
    for case in registry.cases_of(op, "quick"):
        checks, call = runner.check_case(case, registry.case_seed(0, case.label), CPU, None, gpu=False)
        failures = [c for c in checks if c.status not in (PASS, SKIP)]
        assert call is not None and not failures, (case.label, failures)
        own = [c for c in checks if c.name not in RUNNER_CHECKS]
        assert own[0].name == "reference layout" and len(own) >= 2, (case.label, checks)


@pytest.mark.parametrize("op", OPS)
def test_every_tier_has_the_edges(family, op):
    for tier in registry.TIERS:
        params = _params(op, tier)
        tokens = {p.tokens for p in params}
        assert {0, 1} <= tokens and any(t % 2 and t > 1 for t in tokens), (op, tier, tokens)
        assert any(p.row_stride and p.row_stride > p.hidden for p in params), "a strided input"
        assert any(p.tokens % p.block[0] for p in params), "a partial block of tokens"
        if op != "per_channel_cast_fused":
            assert any(p.hidden % 128 for p in params), "a hidden size that is not a multiple of 128"
        for p in params:
            assert p.hidden % 2 == 0 or p.fmt == "e4m3"
    if op in BLOCK_OPS:
        params = _params(op, "quick")
        assert {(p.fmt, p.block, p.dtype, p.flags) for p in params if not p.source} >= {
            (fmt, block, dtype, flags)
            for fmt in family.FORMATS
            for block in family.BLOCKS
            for dtype in family.DTYPES
            for flags in family.FLAGS
        }
        assert {p.source for p in params} >= {"", "e4m3-1x128", "e2m1-1x32-packed", "e4m3-128x128-colmajor"}
        assert any(p.special == "naninf" for p in params)
    if op == "per_channel_cast_fused":
        params = _params(op, "quick")
        gathers = [p for p in params if p.rows is not None]
        assert any(p.rows % 128 and p.rows > 128 for p in gathers) and {0, 1} <= {p.rows for p in gathers}
        assert any(p.tokens == 0 and p.rows for p in gathers), "every row padding"
        layouts = {family.SOURCES[p.source][2].get("use_packed_ue8m0", False) for p in params if p.source}
        assert layouts == {False, True}
    if op == "per_block_cast_lossless":
        params = _params(op, "quick")
        assert {p.block for p in params} == set(family.LOSSLESS_OUT_BLOCKS)
        assert {p.source for p in params} == set(family.LOSSLESS_SOURCES)
        assert {p.layout.kind for p in params} == {"row_major", "col_major", "packed_ue8m0"}


def test_full_tier_has_the_benchmarks(family):
    benchmarks = {case.label: case for case in registry.select_cases("full", ops=OPS) if case.benchmark}
    assert set(benchmarks) == {
        "per_block_cast/e4m3/128x128/bf16/8192x7168/plain",
        "per_channel_cast/e4m3/nt128/bf16/8192x7168/plain",
    }
    titles = {case.title for case in benchmarks.values()}
    assert titles == {
        "per_block_cast e4m3 128×128, 8192×7168 bf16",
        "per_channel_cast e4m3 (128 tokens per block), 8192×7168",
    }
    assert not any(case.benchmark for case in registry.select_cases("quick", ops=OPS))


def test_quick_and_full_reach_the_same_compile_groups(family, monkeypatch):
    for spec in family.SPECS:
        monkeypatch.setattr(spec, "optimized", lambda: len)  # a twin exists: groups are computed

    def groups(tier):
        return {registry.get_op(c.op).compile_group(c) for c in registry.select_cases(tier, ops=OPS)} - {None}

    assert groups("quick") == groups("full") and len(groups("quick")) > 100


def test_bytes_moved(family):
    def moved(op, label):
        (case,) = [c for c in registry.cases_of(op, "full") if c.label == label]
        return registry.get_op(op).bytes_moved(case)

    T, H = 8192, 7168
    assert moved("per_block_cast", "per_block_cast/e4m3/128x128/bf16/8192x7168/plain") == 3 * T * H + 64 * 56 * 4
    assert moved("per_channel_cast", "per_channel_cast/e4m3/nt128/bf16/8192x7168/plain") == 3 * T * H + 64 * H * 4
    lossless = "per_block_cast_lossless/e4m3/128x128/from-e2m1-1x32-round/8192x7168/round"
    assert moved("per_block_cast_lossless", lossless) == T * H // 2 + T * 224 * 4 + T * H + 64 * 56 * 4
    for op in OPS:
        for tier in registry.TIERS:
            assert all(registry.get_op(op).bytes_moved(c) >= 0 for c in registry.cases_of(op, tier))


@pytest.mark.parametrize("op", OPS)
def test_uninitialized_inputs_have_the_seeded_layout(family, op):
    spec = registry.get_op(op)
    cases = registry.cases_of(op, "quick")
    for case in [c for i, c in enumerate(cases) if i % 3 == 0 or c.params.source or c.params.rows is not None]:
        real = spec.build(case, CPU, torch.Generator().manual_seed(0)).tensors()
        empty = spec.build(case, CPU, None).tensors()
        assert [(t.dtype, t.shape, t.stride()) for t in real] == [(t.dtype, t.shape, t.stride()) for t in empty], case


def test_inputs_are_seeded_strided_and_padded_with_nan(family):
    for op, predicate in (
        ("per_block_cast", lambda p: p.row_stride and p.tokens > 1 and not p.source),
        ("per_block_cast", lambda p: p.row_stride and p.source == "e2m1-1x32-packed"),
        ("per_channel_cast_fused", lambda p: p.row_stride and p.rows),
    ):
        case = _case(op, predicate)
        spec = registry.get_op(op)
        first, again, other = (spec.build(case, CPU, torch.Generator().manual_seed(s)) for s in (5, 5, 6))
        assert all(same_bytes(a, b) for a, b in zip(first.tensors(), again.tensors(), strict=True))
        assert not all(same_bytes(a, b) for a, b in zip(first.tensors(), other.tensors(), strict=True))
        data = first.args[0][0] if case.params.source else first.args[0]
        padding = data.as_strided((data.shape[0], data.stride(0)), data.stride())[:, data.shape[1] :]
        assert padding.numel() and bool((padding.view(torch.uint8) == 0x7F).all() or torch.isnan(padding).all())


def test_fused_positions_hold_padding_rows_in_range(family):
    spec = registry.get_op("per_channel_cast_fused")
    for case in registry.cases_of("per_channel_cast_fused", "quick"):
        p = case.params
        if not p.rows:
            continue
        pos = spec.build(case, CPU, torch.Generator().manual_seed(1)).kwargs["pos_to_token"]
        assert pos.dtype == torch.int32 and pos.shape == (p.rows,)
        assert int(pos[-1]) == -1 and bool(((pos >= -1) & (pos < max(p.tokens, 1))).all())
        if p.tokens == 0:
            assert bool((pos == -1).all())


# ---------------------------------------------------------------------------------------------
# The self-checks can fail
# ---------------------------------------------------------------------------------------------


def _first_byte_plus_one(t: torch.Tensor) -> None:
    t.view(torch.uint8).view(-1)[:1].add_(1)


DAMAGES = {
    "per_block_cast": (lambda p: p.tokens > 1 and p.flags == "plain", lambda o: o[0].view(torch.uint8).fill_(0)),
    "per_block_cast_with_sf_only": (lambda p: p.tokens > 1, lambda o: o[0].view(-1)[:1].mul_(2)),
    "per_block_cast_with_precomputed_sf": (
        lambda p: p.tokens > 1 and p.flags == "packed",
        lambda o: _first_byte_plus_one(o[0]),
    ),
    "per_channel_cast": (lambda p: p.tokens > 1, lambda o: o[1].mul_(2)),
    "per_channel_cast_fused": (lambda p: p.rows and p.tokens > 1, lambda o: _first_byte_plus_one(o[0])),
    "per_channel_cast_and_transpose": (lambda p: p.tokens > 1, lambda o: _first_byte_plus_one(o[0])),
    "per_block_cast_lossless": (lambda p: p.tokens > 1, lambda o: o[1].view(-1)[:1].mul_(2)),
}


@pytest.mark.parametrize("op", OPS)
def test_self_checks_catch_damaged_outputs(family, op):
    predicate, damage = DAMAGES[op]
    case = _case(op, predicate)
    spec = registry.get_op(op)
    call = spec.build(case, CPU, torch.Generator().manual_seed(4))
    outputs = tuple(spec.split(call(spec.reference())))
    assert all(check.status == PASS for check in spec.self_check(case, call, outputs))
    damage(outputs)
    assert any(check.status == FAIL for check in spec.self_check(case, call, outputs)), case.label


def test_layout_check_catches_a_wrong_scale_layout(family):
    case = _case("per_block_cast", lambda p: p.flags == "colmajor" and p.tokens > 4)
    spec = registry.get_op("per_block_cast")
    call = spec.build(case, CPU, torch.Generator().manual_seed(7))
    q, sf = spec.split(call(spec.reference()))
    checks = spec.self_check(case, call, (q, sf.contiguous()))
    assert checks[0].name == "reference layout" and checks[0].status == FAIL and "strides" in checks[0].detail

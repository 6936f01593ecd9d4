"""CPU tests of the oracle spec of the fused SwiGLU casts (``tileproof.oracle.quant_swiglu``):
registration, the cases of both tiers, every quick case's reference and self-checks, uninitialized
(compile-only) inputs, the benchmark workload, the padding-row mask of the comparison, the in-place
counter, and self-checks that fail when the reference's outputs are damaged.

Until the module joins ``FAMILY_MODULES`` in ``oracle/registry.py``, the ``family`` fixture imports
it and registers its specs for this module's tests only (and takes them out again afterwards), so
that the rest of the suite sees the registry it expects.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from tileproof.oracle import registry, runner
from tileproof.oracle.policy import FAIL, PASS, SKIP, Bitwise, RelativeError, compare, same_bytes

CPU = torch.device("cpu")
OPS = (
    "swiglu_forward_and_per_token_cast",
    "swiglu_forward_and_per_channel_cast_and_transpose",
    "swiglu_backward_and_per_token_cast",
)
FORWARD, PER_CHANNEL, BACKWARD = OPS
# Checks the runner adds itself (the rest are the spec's own self-checks).
RUNNER_CHECKS = {"build inputs", "reference", "reference self-check", "reference float64", "reference only"}
RUNNER_CHECKS |= {runner.COMPILE_NAME, "GPU comparison"}


@pytest.fixture(scope="module")
def family():
    """The family module, its specs registered for the duration of this test module."""
    module = importlib.import_module("tileproof.oracle.quant_swiglu")
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


def _build(op: str, case: registry.Case, seed: int = 4):
    return registry.get_op(op).build(case, CPU, torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Registration and the optimized twins
# ---------------------------------------------------------------------------------------------


def test_every_operator_has_a_spec(family):
    assert tuple(spec.name for spec in family.SPECS) == OPS == family.OPS
    for name in OPS:
        spec = registry.get_op(name)
        assert spec.family == "quant" and spec.outputs
        assert all(output.why for output in spec.outputs)
    forward = registry.get_op(FORWARD)
    assert [o.name for o in forward.outputs] == ["q", "sf", "clamped_count"]
    assert all(isinstance(o.policy, Bitwise) for o in forward.outputs)
    assert "padding" in forward.outputs[0].why and "split" in forward.outputs[0].why
    backward = registry.get_op(BACKWARD)
    assert [o.name for o in backward.outputs] == ["out", "dx_q", "dx_sf", "dx_gate", "dx_up", "dweight"]
    assert isinstance(backward.outputs[1].policy, Bitwise) and isinstance(backward.outputs[0].policy, RelativeError)


def test_optimized_twins_by_name_or_none(family, monkeypatch):
    quant = importlib.import_module("tileproof.optimized.quant")
    forward = registry.get_op(FORWARD)
    assert (forward.optimized() is None) == (getattr(quant, FORWARD, None) is None)
    per_channel = registry.get_op(PER_CHANNEL)
    present = hasattr(quant, PER_CHANNEL) and hasattr(quant, "per_channel_cast_and_transpose")
    assert (per_channel.optimized() is not None) == present
    backward = registry.get_op(BACKWARD)
    assert backward.optimized() is getattr(quant, BACKWARD, None)
    if backward.optimized() is None:
        assert all(backward.compile_group(c) is None for c in registry.cases_of(BACKWARD, "quick"))
    # The per-channel forward counts as present only with the transposing cast it composes.
    monkeypatch.delattr(quant, "per_channel_cast_and_transpose", raising=False)
    assert per_channel.optimized() is None
    # A backward kernel added to tileproof.optimized.quant later is picked up without touching the spec.
    monkeypatch.setattr(quant, BACKWARD, len, raising=False)
    assert backward.optimized() is len


def test_the_forward_twin_runs_on_a_counter_copy(family):
    """The in-place counter: both twins get a copy (the case's input stays as built) and return it."""
    case = _case(FORWARD, lambda p: p.count and p.rows > 1 and "padding" in p.routing)
    spec = registry.get_op(FORWARD)
    call = _build(FORWARD, case)
    before = call.kwargs["clamped_count"].clone()
    q, sf, counts = spec.split(call(spec.reference()))
    assert torch.equal(call.kwargs["clamped_count"], before)
    assert counts.shape == (3,) and bool((counts >= before).all()) and not torch.equal(counts, before)
    no_count = _case(FORWARD, lambda p: not p.count and p.rows > 1)
    assert spec.split(_build(FORWARD, no_count)(spec.reference()))[2].shape == (0,)


def test_padding_rows_are_masked_on_both_sides(family):
    """A twin that leaves padding rows unwritten (poison) passes; one wrong byte elsewhere fails."""
    case = _case(FORWARD, lambda p: "padding" in p.routing and p.rows > 8 and p.flags == "colmajor")
    spec = registry.get_op(FORWARD)
    call = _build(FORWARD, case)
    reference = spec.reference()
    expected = spec.split(call(reference))
    padding = call.kwargs["pos_to_expert"] < 0
    assert bool(padding.any()) and not bool(padding.all())

    def poisoned_twin(*args, **kwargs):
        q, sf, counts, pos_to_expert = reference(*args, **kwargs)
        q.view(torch.uint8)[padding] = 0xFF
        sf[padding] = float("nan")  # sf is column-major here: this writes through its view
        return q, sf, counts, pos_to_expert

    actual = spec.split(call(poisoned_twin))
    assert actual[1].stride() == expected[1].stride()
    for output, a, e in zip(spec.outputs, actual, expected, strict=True):
        assert compare(output.name, a, e, output.policy).status == PASS
    computed_row = int((~padding).nonzero()[0])
    wrong = actual[0].clone()
    wrong.view(torch.uint8)[computed_row, 0] ^= 1
    assert compare("q", wrong, expected[0], Bitwise()).status == FAIL


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_quick_cases_pass_their_reference_self_checks(family, op):
    for case in registry.cases_of(op, "quick"):
        checks, call = runner.check_case(case, registry.case_seed(0, case.label), CPU, None, gpu=False)
        failures = [c for c in checks if c.status not in (PASS, SKIP)]
        assert call is not None and not failures, (case.label, failures)
        own = [c for c in checks if c.name not in RUNNER_CHECKS and not c.name.startswith("reference ≈")]
        assert own[0].name == "reference layout" and len(own) >= 2, (case.label, checks)


@pytest.mark.parametrize("op", OPS)
def test_every_tier_has_the_edges(family, op):
    for tier in registry.TIERS:
        params = _params(op, tier)
        rows = {p.rows for p in params}
        assert {0, 1} <= rows and any(r % 2 and r > 1 for r in rows), (op, tier, rows)
        assert any(p.clamp is not None for p in params) and any(p.clamp is None for p in params)
        assert any(p.flags == "round" for p in params) and any(p.flags == "plain" for p in params)
        if op != BACKWARD:
            assert any(p.row_stride and p.row_stride > 2 * p.hidden for p in params), "a strided input"
    if op == FORWARD:
        params = _params(op, "quick")
        assert any(p.hidden % 128 and p.block == 128 for p in params), "a partial 1×128 block"
        assert any(p.block == p.hidden > 128 for p in params), "row scales (C = H > 128)"
        assert any(p.hidden == 2048 for p in params), "DeepSeek-V3's expert width"
        assert {p.routing for p in params} == set(family.ROUTINGS)
        assert {p.index_dtype for p in params if p.routing} == {"int32", "int64"}
        assert any(p.count for p in params) and any(p.special == "naninf" for p in params)
        assert {(p.fmt, p.dtype) for p in params} == {(f, d) for f in ("e4m3", "e2m1") for d in ("bf16", "fp32")}
        assert {p.flags for p in params} == {"plain", "round", "colmajor", "packed", "round+colmajor"}
        assert any(p.hidden % 2 for p in params), "odd H (1-element vectors)"
        assert any(p.row_stride and p.row_stride % 2 for p in params), "an odd row stride"
    if op == PER_CHANNEL:
        params = _params(op, "quick")
        assert {p.block for p in params} == {32, 128} and {p.transpose for p in params} == {True, False}
        assert any(p.rows % p.block and p.rows > p.block for p in params), "a partial token block"


def test_full_tier_has_the_benchmark(family):
    benchmarks = [case for case in registry.select_cases("full", ops=OPS) if case.benchmark]
    assert [case.title for case in benchmarks] == ["swiglu_forward_and_per_token_cast e4m3 1×128, 16384×(2·2048)"]
    p = benchmarks[0].params
    assert (p.rows, p.hidden, p.block, p.fmt, p.dtype, p.flags, p.routing, p.clamp) == (
        16384,
        2048,
        128,
        "e4m3",
        "bf16",
        "plain",
        "",
        None,
    )
    assert not any(case.benchmark for case in registry.select_cases("quick", ops=OPS))


def test_quick_and_full_reach_the_same_compile_groups(family, monkeypatch):
    for spec in family.SPECS:
        monkeypatch.setattr(spec, "optimized", lambda: len)  # a twin exists: groups are computed

    def groups(tier):
        return {registry.get_op(c.op).compile_group(c) for c in registry.select_cases(tier, ops=OPS)} - {None}

    assert groups("quick") == groups("full")
    kernels = {g for g in groups("quick") if g[0] == "swiglu_per_token"}
    assert 8 <= len(kernels) <= 14, kernels  # the static configurations stay few


def test_bytes_moved(family):
    spec = registry.get_op(FORWARD)
    (case,) = [c for c in registry.cases_of(FORWARD, "full") if c.benchmark]
    P, H = 16384, 2048
    assert spec.bytes_moved(case) == P * 2 * H * 2 + P * H + P * (H // 128) * 4
    padded = _case(FORWARD, lambda p: p.routing == "weights+padding" and p.rows > 8)
    p = padded.params
    padding = len({r for r in range(p.rows) if r % 8 == 7} | {p.rows - 1})
    assert p.padding_rows == padding and spec.bytes_moved(padded) < spec.bytes_moved(
        registry.Case(FORWARD, "x", type(p)(p.rows, p.hidden, p.fmt, p.block, p.dtype, p.flags, p.row_stride))
    )
    for op in OPS:
        for tier in registry.TIERS:
            assert all(registry.get_op(op).bytes_moved(c) >= 0 for c in registry.cases_of(op, tier))


@pytest.mark.parametrize("op", OPS)
def test_uninitialized_inputs_have_the_seeded_layout(family, op):
    spec = registry.get_op(op)
    for case in registry.cases_of(op, "quick")[::3]:
        real = spec.build(case, CPU, torch.Generator().manual_seed(0)).tensors()
        empty = spec.build(case, CPU, None).tensors()
        assert [(t.dtype, t.shape, t.stride()) for t in real] == [(t.dtype, t.shape, t.stride()) for t in empty], case


def test_inputs_are_seeded_strided_and_padded_with_nan(family):
    case = _case(FORWARD, lambda p: p.row_stride and p.rows > 1 and p.routing)
    first, again, other = (_build(FORWARD, case, seed) for seed in (5, 5, 6))
    assert all(same_bytes(a, b) for a, b in zip(first.tensors(), again.tensors(), strict=True))
    assert not all(same_bytes(a, b) for a, b in zip(first.tensors(), other.tensors(), strict=True))
    x = first.args[0]
    padding = x.as_strided((x.shape[0], x.stride(0)), x.stride())[:, x.shape[1] :]
    assert padding.numel() and bool(torch.isnan(padding).all())


def test_backward_mappings_are_inverse_with_gaps(family):
    case = _case(BACKWARD, lambda p: p.rows > 30)
    (x_q, x_sf), grad_out, weight, pos_to_token_topk, token_topk_to_pos, C = _build(BACKWARD, case).args
    assert bool((pos_to_token_topk == -1).any()) and bool((token_topk_to_pos == -1).any())
    for row, slot in enumerate(pos_to_token_topk.tolist()):
        if slot >= 0:
            assert token_topk_to_pos.reshape(-1)[slot] == row


# ---------------------------------------------------------------------------------------------
# The self-checks can fail
# ---------------------------------------------------------------------------------------------


def _zero_a_computed_row(outputs, call) -> None:
    padding = call.kwargs.get("pos_to_expert")
    row = 0 if padding is None else int((padding >= 0).nonzero()[0])
    outputs[0].view(torch.uint8)[row].fill_(0)


DAMAGES = {
    FORWARD: [
        (lambda p: p.rows > 8 and p.fmt == "e4m3" and not p.special, _zero_a_computed_row),
        (lambda p: p.count and p.rows > 1, lambda o, call: o[2].add_(1)),
        (lambda p: "padding" in p.routing and p.rows > 8, lambda o, call: o[0].view(torch.uint8)[-1].fill_(1)),
    ],
    PER_CHANNEL: [(lambda p: p.rows > 30, lambda o, call: o[0].view(torch.uint8).view(-1)[:8].add_(16))],
    BACKWARD: [
        (lambda p: p.rows > 30, lambda o, call: o[2].mul_(4)),
        (lambda p: p.rows > 30, lambda o, call: o[5].masked_fill_(call.args[4] < 0, 1.0)),
    ],
}


@pytest.mark.parametrize("op,index", [(op, i) for op in OPS for i in range(len(DAMAGES[op]))])
def test_self_checks_catch_damaged_outputs(family, op, index):
    predicate, damage = DAMAGES[op][index]
    case = _case(op, predicate)
    spec = registry.get_op(op)
    call = _build(op, case)
    outputs = spec.split(call(spec.reference()))
    assert all(check.status == PASS for check in spec.self_check(case, call, outputs)), case.label
    damage(outputs, call)
    assert any(check.status == FAIL for check in spec.self_check(case, call, outputs)), case.label


def test_backward_bounds_catch_a_wrong_output(family):
    """The float64 comparison of the backward's float outputs fails for a 1% error (10% for dweight:
    the documented bound of an fp32 sum of 2048 terms allows about 0.3 on sums of typically 20..80)."""
    case = _case(BACKWARD, lambda p: p.rows > 30)
    spec = registry.get_op(BACKWARD)
    call = _build(BACKWARD, case)
    outputs = spec.split(call(spec.reference()))
    exact = spec.reference_float64(case, call)
    for index, factor in ((0, 1.01), (3, 1.01), (4, 1.01), (5, 1.1)):
        policy = spec.outputs[index].policy
        assert compare("ok", outputs[index], outputs[index], policy, expected64=exact[index]).status == PASS
        wrong = (outputs[index].float() * factor).to(outputs[index].dtype)
        assert compare("wrong", wrong, outputs[index], policy, expected64=exact[index]).status == FAIL


@pytest.mark.compile
def test_every_quick_kernel_configuration_compiles(family):
    """Every compile group of the quick tier builds for sm_90a (without a GPU); once the module is in
    ``FAMILY_MODULES``, tests/test_compile.py does this for every family and this test steps aside."""
    if "tileproof.oracle.quant_swiglu" in registry.FAMILY_MODULES:
        pytest.skip("covered by tests/test_compile.py")
    failures = runner.compile_all("quick", ops=OPS)
    assert not failures, [(f.label, f.error) for f in failures[:5]]

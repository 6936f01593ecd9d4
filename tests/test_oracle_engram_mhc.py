"""CPU tests of the Engram and mHC oracle specs (``oracle/engram.py``, ``oracle/mhc.py``).

Every quick case runs through ``runner.check_case`` on the CPU: inputs, the reference, its
self-checks (documented layout, explicit backward ≡ autograd in float64, the ops' invariants) and
the native reference against its float64 version under each output's own bound; with no optimized
twin yet each case ends "reference only". A backend twin then shows that the comparison passes the
reference itself and fails an output moved past its bound, and the mutation catalogue's planted
bugs for these operators are all killed by the quick cases.

The specs are registered into a copy of the registry for the duration of this module (the
integrator adds the families to ``FAMILY_MODULES``; until then other tests see only theirs). The
inference fuse and the multilayer recompute have tests of their own at the end.
"""

from __future__ import annotations

import importlib
import math
import types

import pytest
import torch

from tileproof.oracle import registry, runner
from tileproof.oracle.policy import FAIL, PASS, SKIP, Bitwise, RelativeError

CPU = torch.device("cpu")
FAMILIES = ("tileproof.oracle.engram", "tileproof.oracle.mhc")
ENGRAM_OPS = ("engram_hash", "fused_weight", "engram_gate_fwd", "engram_gate_bwd", "grad_w_reduce")
MHC_OPS = (
    "expand_to_mhc",
    "expand_to_mhc_bwd",
    "mhc_pre_norm_fn",
    "mhc_pre_norm_fn_bwd",
    "mhc_pre_split_mixes",
    "mhc_pre_split_mixes_bwd",
    "sinkhorn_normalize",
    "sinkhorn_normalize_bwd",
    "mhc_pre_apply_mix",
    "mhc_pre_apply_mix_bwd",
    "mhc_post",
    "mhc_post_bwd",
    "mhc_head_compute_mix",
    "mhc_head_compute_mix_bwd",
    "mhc_pre_big_fuse",
    "mhc_multilayer_recompute",
)
OPS = ENGRAM_OPS + MHC_OPS
BITWISE_OUTPUTS = {("engram_hash", "rows"), ("fused_weight", "w"), ("expand_to_mhc", "out")}
BITWISE_OUTPUTS |= {("mhc_multilayer_recompute", "layer_inputs"), ("mhc_multilayer_recompute", "residuals")}


@pytest.fixture(scope="module")
def families():
    """The two family modules, registered with the others (``registry.FAMILY_MODULES``)."""
    registry.all_ops()
    return {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in FAMILIES}


def _failures(checks):
    return [check for check in checks if check.status not in (PASS, SKIP)]


# ---------------------------------------------------------------------------------------------
# Registration, policies and cases
# ---------------------------------------------------------------------------------------------


def test_every_public_function_is_registered_once(families):
    assert families["engram"].OPS == ENGRAM_OPS and families["mhc"].OPS == MHC_OPS
    for name in OPS:
        op = registry.get_op(name)
        assert op.family in ("engram", "mhc") and op.outputs
        assert op.reference() is getattr(importlib.import_module(f"tileproof.reference.{op.family}"), name)
        twin = op.optimized()  # None while tileproof.optimized.<family> lacks it (reference only)
        assert twin is None or twin is getattr(importlib.import_module(f"tileproof.optimized.{op.family}"), name)
    for module in ("engram", "mhc"):
        public = set(importlib.import_module(f"tileproof.reference.{module}").__all__)
        public = {name for name in public if not name.endswith("_math")}  # dtype-generic building blocks
        assert public <= set(OPS), public - set(OPS)


@pytest.mark.parametrize("name", OPS)
def test_policies_are_stated_and_bytes_counted(name):
    op = registry.get_op(name)
    for output in op.outputs:
        assert output.why and isinstance(output.policy, (Bitwise, RelativeError))
        assert isinstance(output.policy, Bitwise) == ((name, output.name) in BITWISE_OUTPUTS)
        if isinstance(output.policy, RelativeError):
            assert 0 < output.policy.bound < 2.0**-6 and output.policy.atol >= 0
    for case in registry.cases_of(name, "full"):
        assert op.bytes_moved(case) > 0 or "T0/" in case.label or "/P0/" in case.label


def _token_counts(name, tier):
    return {getattr(case.params, "tokens", None) for case in registry.cases_of(name, tier)} - {None}


@pytest.mark.parametrize("tier", registry.TIERS)
@pytest.mark.parametrize("name", OPS)
def test_tiers_cover_the_edges(name, tier):
    cases = registry.cases_of(name, tier)
    tokens = _token_counts(name, tier)
    if tokens:
        assert {0, 1} <= tokens and any(t % 2 and t > 1 for t in tokens)
    if tier == "full" and name not in ("engram_hash", "fused_weight", "grad_w_reduce"):
        assert {0, 1, 4001, 8192} <= tokens
    params = [case.params for case in cases]
    hiddens = {getattr(p, "hidden", 0) for p in params}
    if tier == "full" and name.startswith(("engram_gate", "fused_weight", "grad_w")):
        assert {4096, 7168} <= hiddens
    if tier == "full" and name in MHC_OPS and not name.startswith(("mhc_pre_split", "sinkhorn", "mhc_head")):
        assert {1280, 2560, 4096, 7168} <= hiddens
    if name.startswith("sinkhorn"):
        assert {p.repeat for p in params} == {10, 20}
    strided = [
        p for p in params if getattr(p, "pad", 0) or getattr(p, "strided", False) or getattr(p, "layout", "") == "fused"
    ]
    if name != "grad_w_reduce":
        assert strided, "a non-contiguous input"


def test_full_tier_has_the_acceptance_benchmarks():
    titles = {(c.op, c.label): c.title for c in registry.select_cases("full", OPS) if c.benchmark}
    wanted = {
        "engram_gate_fwd/T8192/n4/D4096/fused",
        "engram_gate_bwd/T8192/n4/D4096/fused/P132",
        "mhc_post/T8192/C7168",
        "mhc_post_bwd/T8192/C7168",
        "sinkhorn_normalize/T65536/R20",
        "sinkhorn_normalize_bwd/T65536/R20",
    }
    assert {label for _, label in titles} == wanted
    assert all(titles.values())


def test_full_cases_build_with_the_documented_layouts():
    """Uninitialized (compile-only) inputs of every full case, on the meta device: k and v are views
    of one fused projection output, token blocks of dw_partial hold at most 64 tokens."""
    meta = torch.device("meta")
    for case in registry.select_cases("full", OPS):
        call = registry.get_op(case.op).build(case, meta, None)
        assert all(t.device.type == "meta" for t in call.tensors())
        p = case.params
        if case.op.startswith("engram_gate") and p.layout == "fused" and p.tokens > 1:
            x, k, v = call.args[1:4] if case.op == "engram_gate_bwd" else call.args[:3]
            assert x.is_contiguous()
            assert k.stride() == ((4 + 1) * p.hidden, p.hidden, 1) and v.stride() == ((4 + 1) * p.hidden, 1)
        if case.op == "engram_gate_bwd":
            assert math.ceil(p.tokens / p.num_partials) <= 64


# ---------------------------------------------------------------------------------------------
# Every quick case through the runner
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPS)
def test_every_quick_case_passes_its_checks(name, seed):
    for case in registry.cases_of(name, "quick"):
        checks, call = runner.check_case(case, registry.case_seed(seed, case.label), CPU, None, gpu=False)
        assert call is not None
        assert _failures(checks) == [], (case.label, _failures(checks))
        names = {check.name for check in checks}
        assert "reference layout" in names
        # Without a GPU an operator with an optimized twin has its comparison skipped for that reason.
        skipped = runner.REFERENCE_ONLY if registry.get_op(name).optimized() is None else "GPU comparison"
        assert any(c.name == skipped and c.status == SKIP for c in checks)
        relative = [o.name for o in registry.get_op(name).outputs if isinstance(o.policy, RelativeError)]
        assert {f"reference ≈ float64: {output}" for output in relative} <= names
        if name.endswith("_bwd") or name == "grad_w_reduce":
            assert any(n.startswith("explicit ≡ autograd (float64)") for n in names), case.label


# ---------------------------------------------------------------------------------------------
# The comparison: the reference passes, a moved output fails
# ---------------------------------------------------------------------------------------------


def _moved(policy):
    """Moves an output 4× past its bound (an integer output: its last element by one)."""

    def move(values: torch.Tensor) -> torch.Tensor:
        if isinstance(policy, Bitwise):
            moved = values.clone()
            moved.view(-1)[-1] += 1
            return moved
        exact = values.double()
        step = 4 * policy.bound * torch.clamp(exact.abs(), min=max(policy.atol, 1e-30))
        return (exact + step).to(values.dtype)

    return move


@pytest.mark.parametrize(
    "name, case_index, output_index",
    [
        ("engram_hash", 1, 0),
        ("engram_gate_fwd", 2, 2),
        ("engram_gate_bwd", 2, 3),
        ("mhc_post", 2, 0),
        ("mhc_post_bwd", 2, 2),
        ("mhc_pre_norm_fn", 2, 0),
        ("sinkhorn_normalize_bwd", 4, 0),
        ("grad_w_reduce", 2, 1),
        ("mhc_pre_big_fuse", 2, 1),
        ("mhc_pre_big_fuse", 4, 2),
    ],
)
def test_comparison_passes_the_reference_and_fails_a_moved_output(name, case_index, output_index, seed):
    op = registry.get_op(name)
    case = registry.cases_of(name, "quick")[case_index]
    reference = op.reference()
    same = runner.backend_twin("reference", types.SimpleNamespace(**{name: reference}))
    checks, _ = runner.check_case(case, seed, CPU, None, False, twin=same, self_checks=False)
    assert _failures(checks) == [] and any(c.name == op.outputs[0].name for c in checks)

    output = op.outputs[output_index]
    move = _moved(output.policy)

    def wrong(*args, **kwargs):
        result = reference(*args, **kwargs)
        if name == "grad_w_reduce":  # accumulates in place: move the accumulator it wrote
            accumulator = args[3 + output_index]
            accumulator.copy_(move(accumulator))
            return None
        result = list(op.split(result))
        result[output_index] = move(result[output_index])
        return tuple(result)

    twin = runner.backend_twin("moved", types.SimpleNamespace(**{name: wrong}))
    checks, _ = runner.check_case(case, seed, CPU, None, False, twin=twin, self_checks=False)
    statuses = {check.name: check.status for check in checks}
    assert statuses[output.name] == FAIL, checks
    others = [o.name for i, o in enumerate(op.outputs) if i != output_index]
    assert all(statuses[other] == PASS for other in others), checks


def test_grad_w_reduce_runs_on_fresh_accumulators(seed):
    """Every run starts from the case's accumulators, which stay untouched (in-place op)."""
    op = registry.get_op("grad_w_reduce")
    case = registry.cases_of("grad_w_reduce", "quick")[2]
    call = op.build(case, CPU, torch.Generator().manual_seed(seed))
    before = [t.clone() for t in call.args[3:]]
    first, second = call(op.reference()), call(op.reference())
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before, call.args[3:], strict=True))
    assert not torch.equal(first[0], before[0])


def test_grad_kv_cases_need_dk_and_dv_written_into_the_buffer(seed):
    """``engram_gate_bwd``'s kvgrad case: the reference writes dk and dv into the fresh poisoned buffer
    and passes; a twin that ignores ``grad_kv`` (returns buffers of its own) errs, and one that leaves a
    column of the buffer unwritten fails."""
    op = registry.get_op("engram_gate_bwd")
    case = next(c for c in registry.cases_of("engram_gate_bwd", "quick") if "/kvgrad" in c.label)
    reference = op.reference()

    def own_buffers(*args, grad_kv=None, **kwargs):
        return reference(*args, **kwargs)

    def one_column_unwritten(*args, grad_kv=None, **kwargs):
        dx, dk, dv, dw = reference(*args, grad_kv=grad_kv, **kwargs)
        grad_kv[:, -1] = torch.tensor(float("nan"), dtype=grad_kv.dtype)
        return dx, dk, dv, dw

    statuses = {}
    for name, fn in (("reference", reference), ("own", own_buffers), ("unwritten", one_column_unwritten)):
        twin = runner.backend_twin(name, types.SimpleNamespace(engram_gate_bwd=fn))
        checks, _ = runner.check_case(case, seed, CPU, None, False, twin=twin, self_checks=False)
        statuses[name] = {c.name: c.status for c in checks}
    assert all(status in (PASS, SKIP) for status in statuses["reference"].values())
    assert "error" in statuses["own"].values()
    assert statuses["unwritten"]["dv"] == FAIL and statuses["unwritten"]["dk"] == PASS


# ---------------------------------------------------------------------------------------------
# mhc_pre_big_fuse and mhc_multilayer_recompute
# ---------------------------------------------------------------------------------------------


def _built(name, case_index, seed):
    op = registry.get_op(name)
    case = registry.cases_of(name, "quick")[case_index]
    call = op.build(case, CPU, torch.Generator().manual_seed(seed))
    return op, case, call, list(op.split(call(op.reference())))


def _plus_one_ulp(tensor, index):
    tensor.view(torch.int16)[index] += 1


def test_big_fuse_self_checks_catch_a_damaged_output(seed):
    op, case, call, outputs = _built("mhc_pre_big_fuse", 2, seed)
    checks = {c.name: c.status for c in op.self_check(case, call, tuple(outputs))}
    assert set(checks.values()) == {PASS} and sum(n.startswith("premise") for n in checks) == 4
    _plus_one_ulp(outputs[2], (3, 5))  # one element of layer_input, one bf16 ulp
    checks = {c.name: c.status for c in op.self_check(case, call, tuple(outputs))}
    assert checks["≡ norm-fn → split → Sinkhorn → pre-apply, one by one: layer_input"] == FAIL
    assert checks["≡ norm-fn → split → Sinkhorn → pre-apply, one by one: comb_mix"] == PASS


def test_round_bf16_is_round_to_nearest_even_of_float32_values(generator):
    mhc = importlib.import_module("tileproof.oracle.mhc")
    values = torch.randn(4096, generator=generator) * 8
    ties = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 2.0**-130, 0.0])  # exact midpoints, tiny, 0
    values = torch.cat([values, ties])
    assert torch.equal(mhc._round_bf16(values.double()), values.to(torch.bfloat16).double())
    midpoint = torch.tensor([1 + 2.0**-8], dtype=torch.float64)
    assert bool(mhc._near_boundary(midpoint, torch.ones(1, dtype=torch.float64)).all())
    assert not bool(mhc._near_boundary(torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)).any())


def test_recompute_runs_on_fresh_buffers_and_is_bitwise(seed):
    op, case, call, (layer_inputs, residuals) = _built("mhc_multilayer_recompute", 2, seed)
    assert case.params.layers == case.params.posts == 4
    templates = call.args[5:]
    assert all(bool((t.view(torch.int16) == -1).all()) for buffers in templates for t in buffers)  # untouched
    again = op.split(call(op.reference()))
    assert torch.equal(again[0], layer_inputs) and torch.equal(again[1], residuals)
    reference = op.reference()

    def last_residual_one_ulp_off(*args):
        reference(*args)
        _plus_one_ulp(args[-1][-1], (0, 0, 0))

    twin = runner.backend_twin("ulp", types.SimpleNamespace(mhc_multilayer_recompute=last_residual_one_ulp_off))
    checks, _ = runner.check_case(case, seed, CPU, None, False, twin=twin, self_checks=False)
    statuses = {c.name: c.status for c in checks}
    assert statuses["residuals"] == FAIL and statuses["layer_inputs"] == PASS


def test_recompute_timed_call_is_the_operator_alone(seed):
    """The timing runs (``Call.timed``) write into one set of buffers kept for them: no per-run clones
    or stacks (harness work the compared call needs, not the operator's time), and the build's
    poisoned templates stay untouched for the compared runs."""
    op, case, call, (layer_inputs, residuals) = _built("mhc_multilayer_recompute", 2, seed)
    seen = []

    def recording(*args):
        seen.append([id(buffer) for buffers in args[-2:] for buffer in buffers])
        op.reference()(*args)

    assert call.timed(recording) is None and call.timed(recording) is None
    assert seen[0] == seen[1]  # the same buffers on every timed run
    timed_inputs, timed_residuals = call.context["timed_buffers"]
    assert torch.equal(torch.stack(timed_inputs), layer_inputs) and torch.equal(torch.stack(timed_residuals), residuals)
    templates = call.args[5:]
    assert all(bool((t.view(torch.int16) == -1).all()) for buffers in templates for t in buffers)


def test_recompute_self_checks_catch_a_damaged_output(seed):
    op, case, call, outputs = _built("mhc_multilayer_recompute", 3, seed)
    checks = {c.name: c.status for c in op.self_check(case, call, tuple(outputs))}
    assert set(checks.values()) == {PASS}
    _plus_one_ulp(outputs[1], (1, 2, 0, 3))
    checks = {c.name: c.status for c in op.self_check(case, call, tuple(outputs))}
    assert checks["≡ float64 replay, rounded (residuals)"] == FAIL
    assert checks["≡ layers one by one (mhc_post)"] == FAIL
    assert checks["≡ layers one by one (mhc_pre_apply_mix)"] == PASS


def test_mutation_catalogue_is_killed_by_the_quick_cases():
    mutation = importlib.import_module("tileproof.oracle.mutation")
    mutants = [m for m in mutation.CATALOGUE if m.op in OPS]
    assert len(mutants) >= 10
    for mutant in mutants:
        result = mutation.run_mutant(mutant, profile="quick")
        assert result.status == mutation.KILLED, (mutant.id, result.evidence)

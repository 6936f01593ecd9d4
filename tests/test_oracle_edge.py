"""CPU tests of the oracle's edge profile (docs/numerics.md): the cases it derives from the quick
tier, the edge values written into their inputs, the edge rule of the comparison policy, the
command line, and a CPU run of a selection (references and self-checks)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shlex
from pathlib import Path

import pytest
import torch

from tileproof.oracle import cli, policy, registry, runner
from tileproof.oracle.policy import FAIL, PASS, Bitwise, EdgeReference, RelativeError, compare

CPU = torch.device("cpu")
EDGE = registry.EDGE_TIER
INTEGER_ONLY = (
    "aux_fi",
    "group_count",
    "mask_indices_by_tp",
    "inplace_unique_group_indices",
    "get_fused_mapping",
    "engram_hash",
)


def _edge_ops() -> list[str]:
    return [name for name in registry.all_ops() if registry.cases_of(name, EDGE)]


def _base(case: registry.Case) -> registry.Case:
    """The quick case an edge case was made from."""
    quick = {quick.label: quick for quick in registry.cases_of(case.op, "quick")}
    return quick[case.label.removesuffix(case.edge.suffix)]


# ---------------------------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------------------------


def test_the_edge_profile_is_a_profile_not_a_shape_tier():
    assert registry.PROFILES == (*registry.TIERS, EDGE)
    assert EDGE not in registry.TIERS  # the shape tiers each cover 0, 1 and odd sizes; this one need not
    with pytest.raises(ValueError, match="unknown profile"):
        registry.cases_of("per_token_cast", "edges")


def test_the_edge_profile_is_gpu_sized():
    cases = registry.select_cases(EDGE)
    assert 300 <= len(cases) <= 800, len(cases)
    assert not any(case.benchmark for case in cases)


def test_edge_cases_are_quick_cases_with_edge_values():
    for name in registry.all_ops():
        quick = {case.label: case for case in registry.cases_of(name, "quick")}
        for case in registry.cases_of(name, EDGE):
            assert case.edge is not None and case.edge.kind in registry.EDGE_KINDS
            assert case.label.endswith(case.edge.suffix), case.label
            base = quick[case.label.removesuffix(case.edge.suffix)]
            assert case.params == base.params and case.op == base.op  # same shapes, dtypes, flags
            assert registry.get_op(name).compile_group(case) == registry.get_op(name).compile_group(base)


def test_integer_only_operators_have_no_edge_cases_and_the_others_do():
    for name in INTEGER_ONLY:
        assert registry.cases_of(name, EDGE) == [], name
    for name, spec in registry.all_ops().items():
        assert bool(spec.edge_kinds) == bool(registry.cases_of(name, EDGE)), name


def test_every_edge_class_reaches_every_family_that_takes_it():
    kinds: dict[str, set[str]] = {}
    for case in registry.select_cases(EDGE):
        kinds.setdefault(registry.get_op(case.op).family, set()).add(case.edge.kind)
    assert kinds["quant"] == set(registry.CAST_EDGE_KINDS)
    for family in ("moe", "transpose", "engram", "mhc"):
        assert kinds[family] == set(registry.FLOAT_EDGE_KINDS), family
    # The cast-only class, on every cast (the SwiGLU activation stands between x and its cast).
    for name in ("per_token_cast", "per_token_cast_e5m6", "per_block_cast", "per_channel_cast", "cast_back"):
        assert "scaled-subnormal" in {case.edge.kind for case in registry.cases_of(name, EDGE)}, name


def test_the_labels_docs_numerics_shows_are_edge_cases():
    text = (Path(__file__).resolve().parents[1] / "docs" / "numerics.md").read_text(encoding="utf-8")
    shown = re.findall(r"^\S+/edge-\S+$", text, flags=re.MULTILINE)
    labels = {case.label for case in registry.select_cases(EDGE)}
    assert shown and set(shown) <= labels, set(shown) - labels


def test_every_data_input_of_an_operator_takes_edge_values():
    for name, spec in registry.all_ops().items():
        targets = {case.edge.target for case in registry.cases_of(name, EDGE)}
        if spec.edge_kinds and len(spec.edge_targets) > 1:
            assert targets == set(spec.edge_targets), name


def _kernel_configurations(cases: list[registry.Case], monkeypatch) -> set:
    """(factory, static arguments) of every kernel the cases' optimized calls build: the compile
    pass with a stand-in for TileLang that records each factory call instead of compiling (as
    tests/test_oracle.py::test_quick_and_full_need_the_same_kernel_configurations)."""
    from tileproof.optimized import jit

    built = set()

    def record(factory, *args, **kwargs):
        built.add((factory.qualified_name, args, tuple(sorted(kwargs.items()))))

    monkeypatch.setattr(jit.KernelFactory, "__call__", record)
    monkeypatch.setattr(runner, "_device_compile_batch", lambda twin, batched=True: contextlib.nullcontext())
    errors = runner.compile_pass(cases, device=CPU, workers=1)
    assert not any(errors.values()), {label: error for label, error in errors.items() if error}
    return built


def test_the_edge_profile_needs_no_kernel_configuration_the_quick_tier_lacks(monkeypatch):
    """CI compiles the quick tier: the edge profile's kernels must be among them. Its cases' own
    quick cases are a subset of the quick tier, so this compares with those (a third of the cost)."""
    edge = registry.select_cases(EDGE)
    bases = list({case.label: case for case in map(_base, edge)}.values())
    needed, compiled = (_kernel_configurations(cases, monkeypatch) for cases in (edge, bases))
    assert needed, "the edge profile compiles kernels"
    assert needed <= compiled, sorted(needed - compiled, key=repr)


# ---------------------------------------------------------------------------------------------
# The edge values in the inputs
# ---------------------------------------------------------------------------------------------


def _tensors(call: registry.Call) -> list[torch.Tensor]:
    """The call's floating-point tensors, its context's too (the values a quantized pair is made from)."""
    context = [value for value in call.context.values() if isinstance(value, torch.Tensor)]
    return [t for t in call.tensors() + context if t.is_floating_point()]


def _count(tensors: list[torch.Tensor], predicate) -> int:
    return sum(int(predicate(t.detach().double()).sum()) for t in tensors)


@pytest.mark.parametrize("name", _edge_ops())
def test_edge_values_land_in_the_inputs(name):
    """An edge case of each class and data input, built twice from one seed, with and without its
    edge values: the inputs differ, and a NaN or infinity case has more NaNs or infinities."""
    spec = registry.get_op(name)
    firsts = {}
    for case in registry.cases_of(name, EDGE):
        firsts.setdefault(case.edge, case)
    for case in firsts.values():
        clean = dataclasses.replace(case, edge=None)
        with_edges, without = (spec.build(c, CPU, torch.Generator().manual_seed(3)) for c in (case, clean))
        pairs = zip(with_edges.tensors(), without.tensors(), strict=True)
        assert not all(policy.same_bytes(a, b) for a, b in pairs), case.label
        if case.edge.kind == "nan":
            assert _count(_tensors(with_edges), torch.isnan) > _count(_tensors(without), torch.isnan), case.label
        if case.edge.kind == "inf":
            assert _count(_tensors(with_edges), torch.isinf) > _count(_tensors(without), torch.isinf), case.label


def test_edge_values_by_class_keep_the_padding_of_a_strided_view():
    finfo = torch.finfo(torch.bfloat16)
    for kind in registry.FLOAT_EDGE_KINDS:
        wide = torch.full((8, 40), float("nan"), dtype=torch.bfloat16)
        wide[:, :32] = torch.randn((8, 32)).to(torch.bfloat16)
        x = wide[:, :32]
        before = x.clone()
        registry.write_edge_values(x, kind, torch.Generator().manual_seed(1), block=(1, 16))
        assert torch.isnan(wide[:, 32:].float()).all(), kind
        changed = x.view(torch.int16) != before.view(torch.int16)
        values = x[changed].double()
        if kind == "zero":
            assert (values == 0).all() and changed.sum() % 16 == 0  # whole 1×16 blocks
        elif kind == "max":
            assert (values.abs() == finfo.max).all()
        elif kind == "subnormal":
            assert ((values != 0) & (values.abs() < finfo.tiny)).all()
        elif kind == "outlier":
            assert (values.abs() >= 2.0**20 * before.double().abs().min()).all()
        elif kind == "nan":
            assert torch.isnan(values).all()
        else:
            assert torch.isinf(values).all() and (values > 0).any() and (values < 0).any()


def test_nan_edge_values_vary_sign_and_payload_and_fp8_has_no_infinity():
    x = torch.zeros((64, 8))
    registry.write_edge_values(x, "nan", torch.Generator().manual_seed(2))
    bits = x[torch.isnan(x)].view(torch.int32)
    assert len(set(bits.tolist())) > 1 and (bits < 0).any() and (bits > 0).any()
    with pytest.raises(ValueError, match="no infinity"):
        registry.write_edge_values(torch.zeros((4, 4), dtype=torch.float8_e4m3fn), "inf", torch.Generator())


def test_scaled_subnormals_set_the_scale_to_a_power_of_two():
    from tileproof.oracle.quant import write_cast_edge_values
    from tileproof.reference import quant

    x = torch.randn((8, 64))
    write_cast_edge_values(x, "scaled-subnormal", torch.Generator().manual_seed(4), (1, 16), "e4m3")
    q, sf = quant.per_token_cast(x, "e4m3", 16)
    scales = sf.reshape(-1)
    powers = scales[(scales.view(torch.int32) & 0x7FFFFF) == 0]
    assert powers.numel() >= 1  # the edge blocks: sf = 2^k exactly
    codes = q.view(torch.uint8) & 0x7F
    assert ((codes > 0) & (codes < 8)).any()  # e4m3 subnormal codes 0x01 .. 0x07


# ---------------------------------------------------------------------------------------------
# The comparison policy on edge cases
# ---------------------------------------------------------------------------------------------

RULE = RelativeError(2.0**-8)


def test_the_edge_rule_takes_nan_and_inf_from_the_native_reference():
    native = torch.tensor([1.0, float("nan"), float("inf"), 0.0])  # fp32: rsqrt of an overflowed Σx² is 0
    exact = EdgeReference(torch.tensor([1.0, float("nan"), 3e38, 1e-38], dtype=torch.float64))
    assert compare("y", native.clone(), native, RULE, expected64=exact).status == PASS
    finite_instead = torch.tensor([1.0, float("nan"), 3e38, 0.0])
    assert compare("y", finite_instead, native, RULE, expected64=exact).status == FAIL
    nan_instead = torch.tensor([1.0, float("nan"), float("inf"), float("nan")])
    assert compare("y", nan_instead, native, RULE, expected64=exact).status == FAIL
    other_infinity = torch.tensor([1.0, float("nan"), float("-inf"), 0.0])
    assert compare("y", other_infinity, native, RULE, expected64=exact).status == FAIL
    # Without the edge rule the float64 reference decides, and the native reference itself fails.
    assert compare("y", native.clone(), native, RULE, expected64=exact.values).status == FAIL


def test_the_edge_rule_bounds_finite_values_by_the_nearer_reference():
    native = torch.tensor([0.0, 2.0])  # element 0: an fp32 underflow, far from float64; element 1: ordinary
    exact = EdgeReference(torch.tensor([0.25, 2.0], dtype=torch.float64))
    near_native = torch.tensor([0.0, 2.0 * (1 + 2.0**-10)])
    check = compare("y", near_native, native, RULE, expected64=exact)
    assert check.status == PASS and check.metric.endswith("1 by fp32"), check
    near_float64 = torch.tensor([0.25, 2.0])
    assert compare("y", near_float64, native, RULE, expected64=exact).status == PASS
    neither = torch.tensor([0.1, 2.0])
    assert compare("y", neither, native, RULE, expected64=exact).status == FAIL
    far = torch.tensor([0.0, 2.1])
    check = compare("y", far, native, RULE, expected64=exact)
    assert check.status == FAIL and "from both references" in check.detail


def test_the_edge_rule_keeps_atol_and_error_scales():
    native = torch.tensor([1e-6])
    exact = EdgeReference(policy.ScaledReference(torch.tensor([0.0], dtype=torch.float64), torch.tensor([1.0])))
    rule = RelativeError(2.0**-8, scale="the terms' RSS")
    assert compare("y", torch.tensor([2e-3]), native, rule, expected64=exact).status == PASS
    assert compare("y", torch.tensor([1e-2]), native, rule, expected64=exact).status == FAIL
    assert compare("y", torch.tensor([1e-3]), native, RelativeError(2.0**-8, atol=1.0), expected64=exact).status == PASS


def test_bitwise_outputs_keep_their_rule_on_edge_cases():
    q = torch.tensor([float("nan"), 1.0])
    other_nan = torch.tensor([-float("nan"), 1.0])
    assert compare("q", other_nan, q, Bitwise()).status == FAIL
    assert compare("q", other_nan, q, Bitwise(nan_equal=True)).status == PASS


def test_only_edge_cases_get_the_edge_rule():
    def float64_of(label: str):
        (case,) = registry.select_cases(EDGE if "edge-" in label else "quick", patterns=[label])
        spec = registry.get_op(case.op)
        call = spec.build(case, CPU, torch.Generator().manual_seed(0))
        return runner._float64_outputs(spec, case, call, spec.split(call(spec.reference())))

    edge_case = registry.cases_of("engram_gate_fwd", EDGE)[0]
    assert all(isinstance(value, EdgeReference) for value in float64_of(edge_case.label))
    assert not any(isinstance(value, EdgeReference) for value in float64_of(_base(edge_case).label))


# ---------------------------------------------------------------------------------------------
# Command line and a run on the CPU
# ---------------------------------------------------------------------------------------------


def test_the_cli_selects_and_reproduces_edge_cases(capsys):
    args = cli.build_parser().parse_args(["oracle", "--profile", "edge", "--op", "normalize_weight"])
    cases = cli.select(args)
    assert cases == registry.cases_of("normalize_weight", EDGE)
    for case in (cases[0], cases[-1]):
        words = shlex.split(runner.repro_command(case, 7, EDGE))
        assert "--profile" in words and words[words.index("--profile") + 1] == EDGE
        assert cli.select(cli.build_parser().parse_args(words[1:])) == [case]
    assert cli.main(["oracle", "--profile", "edge", "--op", "aux_fi", "--list"]) == 2  # integer-only: none


def test_the_edge_profile_runs_on_the_cpu():
    """References and their self-checks on the first case of every class of a few cheap operators
    of each family (all of them: tileproof oracle --profile edge --no-compile, about a minute)."""
    ops = [
        "cast_back",
        "per_block_cast_with_precomputed_sf",
        "per_token_cast_e5m6",
        "swiglu_backward_and_per_token_cast",
    ]
    ops += ["top2_sum_gate", "reduce_fused", "transpose", "engram_gate_fwd", "sinkhorn_normalize", "mhc_post_bwd"]
    firsts = {}
    for case in registry.select_cases(EDGE, ops):
        firsts.setdefault((case.op, case.edge.kind), case.label)
    report = runner.run(EDGE, ops=ops, patterns=list(firsts.values()), timing=False, compile=False)
    failures = {r.case.label: r.failures for r in report.results if r.status != PASS}
    assert report.exit_status == 0, failures
    assert len(report.results) == len(firsts)
    assert {r.case.edge.kind for r in report.results} == set(registry.EDGE_KINDS)
    assert report.profile == EDGE and "--profile edge" in report.command

"""CPU tests of the oracle's machinery: registry and cases, the comparison policy, the GPU-mode
checks (driven on the CPU with stand-in optimized functions), reports and the command line."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import time
import types

import pytest
import torch

from tileproof.oracle import cli, policy, registry, report, runner, timing
from tileproof.oracle.policy import ERROR, FAIL, PASS, Bitwise, RelativeError, compare
from tileproof.oracle.quant import CHANNELS, FLAGS, FORMATS

OPS = (
    "per_token_cast",
    "per_token_cast_with_sf_only",
    "per_token_cast_with_precomputed_sf",
    "per_token_cast_back",
)
CPU = torch.device("cpu")


def _case(label: str, profile: str = "quick") -> registry.Case:
    (case,) = registry.select_cases(profile, patterns=[label])
    return case


def _small_case(op: str, fmt: str = "e4m3", flags: str = "plain") -> registry.Case:
    """A cheap case of ``op`` with at least one token."""
    for case in registry.cases_of(op, "quick"):
        p = case.params
        if p.fmt == fmt and p.flags == flags and 0 < p.tokens * p.hidden <= 4096 and not p.special:
            return case
    raise AssertionError(f"no small {fmt}/{flags} case of {op}")


def _zero_token_case(op: str) -> registry.Case:
    return next(case for case in registry.cases_of(op, "quick") if case.params.tokens == 0)


# ---------------------------------------------------------------------------------------------
# Registry and cases
# ---------------------------------------------------------------------------------------------


def test_registry_lists_the_four_quant_ops():
    ops = registry.all_ops()
    assert tuple(name for name in ops if name in OPS) == OPS  # other families may be registered too
    for name in OPS:
        assert ops[name].family == "quant" and ops[name].outputs


@pytest.mark.parametrize("tier", registry.TIERS)
@pytest.mark.parametrize("op", OPS)
def test_every_tier_covers_the_edges(op, tier):
    cases = registry.cases_of(op, tier)
    params = [case.params for case in cases]
    tokens = {p.tokens for p in params}
    assert {0, 1} <= tokens
    assert any(t % 2 and t > 1 for t in tokens), "an odd token count above 1"
    assert any(p.hidden % 128 for p in params), "a hidden size that is not a multiple of 128"
    assert any(p.row_stride and p.row_stride > p.hidden for p in params), "a strided (row stride > H) input"
    assert {p.fmt for p in params} == set(FORMATS)
    assert {p.dtype for p in params} == {"bf16", "fp32"}
    assert {p.flags for p in params} == set(FLAGS)
    assert set(CHANNELS) <= {p.num_per_channels for p in params}
    assert any(p.num_per_channels == p.hidden for p in params), "C == H"
    assert any(p.special == "naninf" for p in params)
    for p in params:
        if p.fmt == "e2m1":
            assert p.hidden % 2 == 0
        assert p.num_per_channels in CHANNELS or p.num_per_channels == p.hidden


def test_full_tier_has_the_acceptance_benchmarks():
    labels = {case.label for case in registry.select_cases("full") if case.benchmark}
    for label in (
        "per_token_cast/e4m3/C128/bf16/8192x7168/plain",
        "per_token_cast/e4m3/C128/bf16/8192x7168/packed",
        "per_token_cast/e4m3/C32/bf16/8192x7168/plain",
        "per_token_cast/e2m1/C32/bf16/8192x7168/plain",
        "per_token_cast/e2m1/C16/bf16/8192x7168/plain",
        "per_token_cast/e4m3/C128/bf16/128x7168/plain",
        "per_token_cast_back/e4m3/C128/bf16/8192x7168/plain",
    ):
        assert label in labels


def _kernel_configurations(profile: str, monkeypatch, device: torch.device = CPU) -> set:
    """(factory, static arguments) of every kernel the profile's optimized calls build: the compile
    pass with a stand-in for TileLang that records each factory call instead of compiling. On the
    meta device no input is allocated or computed with (the full tier's mHC layers otherwise run
    their CPU autograd on GB-sized tensors: 45 s); launchers see the same shapes, strides, dtypes
    and address offsets (a meta tensor's address is its byte offset from 0, CPU allocations are
    64-byte aligned), so they choose the same kernels, which the test checks on the quick tier."""
    from tileproof.optimized import jit

    built = set()

    def record(factory, *args, **kwargs):
        if not jit.compiling_only():
            raise AssertionError("a launch during a compile-only pass")
        built.add((factory.qualified_name, args, tuple(sorted(kwargs.items()))))
        return None

    monkeypatch.setattr(jit.KernelFactory, "__call__", record)
    monkeypatch.setattr(runner, "_device_compile_batch", lambda twin, batched=True: contextlib.nullcontext())
    errors = runner.compile_pass(registry.select_cases(profile), device=device, workers=1)
    assert not any(errors.values()), {label: error for label, error in errors.items() if error}
    return built


def test_compile_pass_with_cache_builds_whole_kernels_without_a_gpu(monkeypatch):
    """``tileproof precompile --cache``: without a GPU the compile pass calls each factory outside the
    batched device-only check (which keeps nothing), so TileLang builds and caches the whole kernel;
    without ``cache`` the factories are lowered into the batch."""
    from tileproof.optimized import jit

    batched_calls = []

    def record(factory, *args, **kwargs):
        batched_calls.append(jit._batch is not None)
        return None

    monkeypatch.setattr(jit.KernelFactory, "__call__", record)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cases = [_small_case("per_token_cast")]
    for cache in (False, True):
        batched_calls.clear()
        runner.compile_pass(cases, device=CPU, workers=1, cache=cache)
        assert batched_calls and all(batched is not cache for batched in batched_calls), (cache, batched_calls)


def test_quick_and_full_need_the_same_kernel_configurations(monkeypatch):
    """CI compiles the quick tier (on the CPU): it must build every kernel the full tier needs on the H200."""
    meta = torch.device("meta")
    quick = _kernel_configurations("quick", monkeypatch)
    assert _kernel_configurations("quick", monkeypatch, meta) == quick  # meta inputs choose the CPU's kernels
    full = _kernel_configurations("full", monkeypatch, meta)
    assert full <= quick, sorted(full - quick, key=repr)


def test_case_seeds_are_stable_and_distinct():
    assert registry.case_seed(0, "a") == registry.case_seed(0, "a")
    assert registry.case_seed(0, "a") != registry.case_seed(0, "b")
    assert registry.case_seed(0, "a") != registry.case_seed(1, "a")
    assert 0 <= registry.case_seed(12345, "x") < 2**63


@pytest.mark.parametrize("op", OPS)
def test_inputs_are_seeded_strided_and_nonzero(op):
    case = next(c for c in registry.cases_of(op, "quick") if c.params.row_stride and c.params.tokens > 1)
    spec = registry.get_op(op)
    first = spec.build(case, CPU, torch.Generator().manual_seed(5))
    again = spec.build(case, CPU, torch.Generator().manual_seed(5))
    other = spec.build(case, CPU, torch.Generator().manual_seed(6))
    for a, b in zip(first.tensors(), again.tensors(), strict=True):
        assert policy.same_bytes(a, b)
    assert not all(policy.same_bytes(a, b) for a, b in zip(first.tensors(), other.tensors(), strict=True))
    x = first.context["source"] if op == "per_token_cast_back" else first.args[0]
    assert x.stride(0) == case.params.row_stride > x.shape[1]
    assert bool((x.float().abs() > 0).any())
    padding = x.as_strided((x.shape[0], x.stride(0)), x.stride())[:, x.shape[1] :]
    assert bool(torch.isnan(padding.float()).all()), "row padding is NaN, so over-reads show"


@pytest.mark.parametrize("op", OPS)
def test_uninitialized_inputs_have_the_seeded_layout(op):
    case = next(c for c in registry.cases_of(op, "quick") if c.params.row_stride and "colmajor" in c.params.flags)
    spec = registry.get_op(op)
    real = spec.build(case, CPU, torch.Generator().manual_seed(0)).tensors()
    empty = spec.build(case, CPU, None).tensors()
    assert [(t.dtype, t.shape, t.stride()) for t in real] == [(t.dtype, t.shape, t.stride()) for t in empty]


# ---------------------------------------------------------------------------------------------
# The comparison policy
# ---------------------------------------------------------------------------------------------


def _q(generator, shape=(4, 64)):
    return (torch.randn(shape, generator=generator) * 100).to(torch.float8_e4m3fn)


def test_bitwise_passes_identical_tensors(generator):
    q = _q(generator)
    check = compare("q", q.clone(), q, Bitwise())
    assert check.status == PASS and check.metric == f"0/{q.numel()} differ"


def test_bitwise_flags_a_single_bit(generator):
    q = _q(generator)
    flipped = q.clone()
    flipped.view(torch.uint8)[2, 5] ^= 1
    check = compare("q", flipped, q, Bitwise())
    assert check.status == FAIL
    assert check.metric == f"1/{q.numel()} differ"
    assert "[2, 5]" in check.detail


def test_bitwise_flags_dtype_shape_and_strides(generator):
    sf = torch.rand((8, 4), generator=generator)
    assert compare("sf", sf.double(), sf, Bitwise()).status == FAIL
    assert "dtype" in compare("sf", sf.double(), sf, Bitwise()).detail
    assert "shape" in compare("sf", sf[:7], sf, Bitwise()).detail
    column_major = sf.T.contiguous().T  # same values, strides (1, 8)
    check = compare("sf", column_major, sf, Bitwise())
    assert check.status == FAIL and "strides" in check.detail


def test_bitwise_ignores_strides_of_unit_and_empty_dimensions():
    one_row = torch.empty_strided((1, 4), (100, 1))  # the row stride addresses no second row
    one_row.copy_(torch.arange(4.0).reshape(1, 4))
    assert compare("sf", one_row, torch.arange(4.0).reshape(1, 4), Bitwise()).status == PASS
    assert compare("sf", torch.empty_strided((0, 3), (1, 0)), torch.empty((0, 3)), Bitwise()).status == PASS


def test_bitwise_nan_equal_only_when_asked():
    expected = torch.tensor([1.0, float("nan")])
    other_nan = expected.clone()
    other_nan.view(torch.int32)[1] = 0x7FFFFFFF  # a NaN with other payload bits
    assert compare("sf", other_nan, expected, Bitwise(nan_equal=True)).status == PASS
    assert compare("sf", other_nan, expected, Bitwise()).status == FAIL
    # A NaN where the reference is a number is never equal.
    assert compare("sf", torch.tensor([float("nan"), float("nan")]), expected, Bitwise(nan_equal=True)).status == FAIL


def test_relative_error_bound(generator):
    expected = torch.randn(256, generator=generator, dtype=torch.float64) + 3
    close = (expected * (1 + 1e-4)).float()
    far = (expected * (1 + 1e-2)).float()
    rule = RelativeError(1e-3)
    assert compare("y", close, expected.float(), rule, expected64=expected).status == PASS
    check = compare("y", far, expected.float(), rule, expected64=expected)
    assert check.status == FAIL and "> 0.001" in check.detail
    assert float(check.metric) == pytest.approx(1e-2, rel=1e-3)


def test_relative_error_non_finite():
    rule = RelativeError(1e-3)
    expected = torch.tensor([1.0, 2.0, float("inf"), float("nan")])
    assert compare("y", expected.clone(), expected, rule).status == PASS
    nan_where_finite = torch.tensor([float("nan"), 2.0, float("inf"), float("nan")])
    check = compare("y", nan_where_finite, expected, rule)
    assert check.status == FAIL and "non-finite" in check.detail
    wrong_infinity = torch.tensor([1.0, 2.0, float("-inf"), float("nan")])
    assert compare("y", wrong_infinity, expected, rule).status == FAIL


# ---------------------------------------------------------------------------------------------
# Checks of one case: CPU mode, and GPU mode driven on the CPU with stand-in optimized functions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_reference_self_checks_pass(op, seed):
    for fmt, flags in (("e4m3", "plain"), ("e2m1", "packed")):
        case = _small_case(op, fmt, flags)
        checks, _ = runner.check_case(case, seed, CPU, None, gpu=False)
        assert [c.status for c in checks if c.status not in (PASS, policy.SKIP)] == [], checks
        assert any(c.name == "GPU comparison" and runner.NO_GPU_NOTE in c.detail for c in checks)
        assert not any(c.name == runner.REFERENCE_ONLY for c in checks)


def _statuses(checks):
    return {check.name: check.status for check in checks}


@pytest.fixture
def stand_in(monkeypatch):
    """Replace an op's optimized function (the GPU-mode checks then run on the CPU)."""

    def install(op_name, fn):
        monkeypatch.setattr(registry.get_op(op_name), "optimized", lambda: fn)

    return install


def test_gpu_mode_passes_when_optimized_is_the_reference(stand_in, seed):
    case = _small_case("per_token_cast", "e2m1", "packed")
    stand_in(case.op, registry.get_op(case.op).reference())
    checks, _ = runner.check_case(case, seed, CPU, None, gpu=True)
    statuses = _statuses(checks)
    assert statuses["q"] == statuses["sf"] == statuses["determinism"] == statuses["inputs untouched"] == PASS
    assert statuses["reference CPU ≡ GPU: q"] == PASS
    assert all(check.ok for check in checks), checks


def test_gpu_mode_reports_a_wrong_byte_with_its_repro(stand_in, seed):
    case = _small_case("per_token_cast")
    reference = registry.get_op(case.op).reference()

    def off_by_one_bit(*args, **kwargs):
        q, sf = reference(*args, **kwargs)
        q.view(torch.uint8)[0, 3] ^= 1
        return q, sf

    stand_in(case.op, off_by_one_bit)
    checks, _ = runner.check_case(case, seed, CPU, None, gpu=True)
    (q_check,) = [c for c in checks if c.name == "q"]
    assert q_check.status == FAIL and "first mismatch at [0, 3]" in q_check.detail
    assert _statuses(checks)["sf"] == PASS
    result = runner.CaseResult(case, seed, runner.repro_command(case, 0, "quick"), checks)
    assert result.status == FAIL and result.failures == [q_check]


def test_gpu_mode_catches_nondeterminism_input_writes_and_exceptions(stand_in, seed):
    case = _small_case("per_token_cast_with_sf_only")
    reference = registry.get_op(case.op).reference()
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        sf = reference(*args, **kwargs)
        return sf if len(calls) % 2 else sf * 2

    stand_in(case.op, flaky)
    assert _statuses(runner.check_case(case, seed, CPU, None, gpu=True)[0])["determinism"] == FAIL

    def writes_its_input(x, *args, **kwargs):
        sf = reference(x, *args, **kwargs)
        x.as_strided((1,), (1,), x.storage_offset() + x.shape[1]).fill_(0)  # the row padding
        return sf

    stand_in(case.op, writes_its_input)
    strided = next(c for c in registry.cases_of(case.op, "quick") if c.params.row_stride and c.params.tokens > 1)
    assert _statuses(runner.check_case(strided, seed, CPU, None, gpu=True)[0])["inputs untouched"] == FAIL

    def raises(*args, **kwargs):
        raise RuntimeError("launch failed")

    stand_in(case.op, raises)
    checks, _ = runner.check_case(case, seed, CPU, None, gpu=True)
    assert _statuses(checks)["optimized"] == ERROR


def test_compile_error_is_reported_not_raised(monkeypatch, seed):
    case = _small_case("per_token_cast_back")

    def broken():
        raise ImportError("cannot import name 'cast_back'")

    monkeypatch.setattr(registry.get_op(case.op), "optimized", broken)
    errors = runner.compile_pass([case], device=CPU, workers=1)
    assert "cannot import the optimized twin" in errors[case.label]
    checks, _ = runner.check_case(case, seed, CPU, errors[case.label], gpu=False)
    assert _statuses(checks)["compile (optimized)"] == ERROR


@pytest.mark.compile
def test_compile_all_on_a_small_selection():
    labels = [_zero_token_case("per_token_cast").label, _small_case("per_token_cast").label]
    assert runner.compile_all("quick", ["per_token_cast"], labels, workers=2) == []


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------


def _report_with_timings(seed) -> runner.Report:
    case = _small_case("per_token_cast")
    checks, _ = runner.check_case(case, seed, CPU, None, gpu=False)
    result = runner.CaseResult(case, seed, runner.repro_command(case, 0, "quick"), checks)
    result.timing = timing.Timing(10**9, timing.COPY_ROOF_GBPS, optimized_us=500.0, eager_us=5000.0)
    result.timing.errors["compiled"] = "RuntimeError: stand-in"
    env = runner.environment("quick", 0)
    return runner.Report(env, "quick", 0, False, True, [case.op], [result], [runner.NO_GPU_NOTE], "tileproof oracle")


def test_timing_figures(seed):
    t = _report_with_timings(seed).results[0].timing
    assert t.gbps == pytest.approx(2000.0)
    assert t.pct_roof == pytest.approx(100 * 2000 / timing.COPY_ROOF_GBPS)
    assert t.speedup_eager == pytest.approx(10.0) and t.speedup_compiled is None
    assert timing.geomean([2.0, 8.0, None]) == pytest.approx(4.0)


class _FakeEvent:
    """Stands in for torch.cuda.Event on the CPU (host clock; enough to test the bookkeeping)."""

    def __init__(self, enable_timing=True):
        self.at = 0.0

    def record(self):
        self.at = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


def _fake_profiler(monkeypatch):
    """Stands in for CUPTI on the CPU: each flush is a 300 µs activity named like the real flush,
    the call after it one activity lasting the call's host time (enough for the bookkeeping)."""
    marks = []
    monkeypatch.setattr(timing.Timer, "_flush", lambda self: marks.append(time.perf_counter()))

    def activities(loop):
        marks.clear()
        started = time.perf_counter()
        loop()
        if not marks:  # a loop without flushes (back to back): one activity as long as the loop
            return [(0.0, (time.perf_counter() - started) * 1e6, "kernel")]
        ends = [*marks[1:], time.perf_counter()]
        recorded = []
        for run, (flushed, ended) in enumerate(zip(marks, ends, strict=True)):
            recorded.append((run * 1e6, run * 1e6 + 300, "fill<uint8>"))
            recorded.append((run * 1e6 + 300, run * 1e6 + 300 + min((ended - flushed) * 1e6, 9e5), "kernel"))
        return recorded

    monkeypatch.setattr(timing, "gpu_activities", activities)


def test_kernel_time_per_run_splits_the_profile_at_the_flushes():
    flush = "fill<uint8>"
    activities = [
        (0, 300, flush),
        (300, 310, "cast"),
        (311, 312, "fill<uint8>"),  # the op's own small fill counts
        (400, 700, flush),
        (700, 705, "cast"),
        (705, 707, "cast"),
    ]
    assert timing.kernel_time_per_run(list(reversed(activities)), 2) == [11.0, 7.0]
    with pytest.raises(RuntimeError, match="found 2 L2 flushes in the profile of 3 runs"):
        timing.kernel_time_per_run(activities, 3)
    with pytest.raises(RuntimeError, match="no GPU activity"):
        timing.kernel_time_per_run([], 1)


def test_time_case_bookkeeping_without_a_gpu(monkeypatch, stand_in, seed):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(timing.Timer, "_capture", staticmethod(lambda fn: fn))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    _fake_profiler(monkeypatch)
    case = _small_case("per_token_cast")
    op = registry.get_op(case.op)
    reference = op.reference()
    stand_in(case.op, reference)
    call = op.build(case, CPU, torch.Generator().manual_seed(seed))
    timer = timing.Timer(CPU, flush_bytes=1 << 10)
    measured = timing.time_case(op, case, call, timer, torch_compile=False)
    assert measured.optimized_us > 0 and measured.eager_us > 0 and measured.compiled_us is None
    assert measured.optimized_stream_us > 0 and measured.as_dict()["optimized_stream_us"] > 0
    assert measured.host_us > 0 and measured.as_dict()["optimized_host_us"] == measured.host_us
    assert measured.back_to_back_us > 0 and measured.back_to_back_kernel_us > 0
    assert measured.as_dict()["launch_overhead_us"] == measured.back_to_back_us - measured.back_to_back_kernel_us
    assert measured.graph_us > 0 and measured.as_dict()["graph_overhead_us"] == measured.graph_overhead_us
    assert timing.MIN_REPS <= measured.reps["optimized"] <= timing.MAX_REPS
    assert "compiled" in measured.errors
    assert measured.bytes_moved == op.bytes_moved(case) > 0

    def no_capture(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(timing.Timer, "_capture", staticmethod(no_capture))
    measured = timing.time_case(op, case, call, timer, torch_compile=False)
    assert measured.graph_us is None and measured.graph_overhead_us is None
    assert measured.errors["graph"] == "RuntimeError: operation not permitted when stream is capturing"
    assert measured.overhead_us is not None

    def broken_compile(op):
        raise RuntimeError("inductor says no")

    monkeypatch.setattr(timing, "compiled_reference", broken_compile)
    measured = timing.time_case(op, case, call, timer)
    assert measured.errors["compiled"] == "RuntimeError: inductor says no"
    assert measured.optimized_us > 0


def test_launch_overhead_is_what_back_to_back_calls_pay_above_the_kernel():
    launch_bound = timing.Timing(1 << 20, 4217.0, optimized_us=3.0, back_to_back_us=40.0, back_to_back_kernel_us=2.5)
    stream_bound = timing.Timing(1 << 20, 4217.0, optimized_us=50.0, back_to_back_us=51.0, back_to_back_kernel_us=49.0)
    assert launch_bound.overhead_us == 37.5 and launch_bound.as_dict()["launch_overhead_us"] == 37.5
    assert stream_bound.overhead_us == 2.0
    assert timing.Timing(1 << 20, 4217.0, optimized_us=3.0, host_us=40.0).overhead_us is None
    replayed = timing.Timing(1 << 20, 4217.0, graph_us=4.5, back_to_back_kernel_us=2.5)
    assert replayed.graph_overhead_us == 2.0 and replayed.as_dict()["graph_overhead_us"] == 2.0


def test_back_to_back_loop_is_sized_by_the_kernel_time_and_measures_the_stream(monkeypatch):
    """A launch-bound call (host 2 ms, no kernel time of note) shows its host time per call."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(timing.Timer, "_capture", staticmethod(lambda fn: fn))
    calls = []

    def slow_call():
        calls.append(None)
        time.sleep(0.002)

    monkeypatch.setattr(timing, "gpu_activities", lambda loop: (loop(), [(0.0, 30.0, "kernel")])[1])
    timer = timing.Timer(CPU, flush_bytes=1 << 10)
    wall, kernel = timer.back_to_back_us(slow_call, kernel_us=1000.0)
    low, high = timing.BACK_TO_BACK_CALLS
    loop_calls = max(low, min(high, int(timing.BACK_TO_BACK_KERNEL_US / 1000.0)))
    assert len(calls) == 1 + (timing.BACK_TO_BACK_LOOPS + 1) * loop_calls  # warm-up, timed loops, profiled loop
    assert 2000 <= wall < 20000 and kernel == pytest.approx(30.0 / loop_calls)


def test_host_time_is_the_median_of_single_calls(monkeypatch):
    """A call that waits (a synchronization, a slow launch path) shows in host_us at its own cost."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    timer = timing.Timer(CPU, flush_bytes=1 << 10)
    calls = []

    def slow_call():
        calls.append(None)
        time.sleep(0.002)

    assert 2000 <= timer.host_us(slow_call, reps=5) < 20000
    assert len(calls) == 6  # one warm-up call, then the measured ones


HEADER_OF_TIMINGS = "| stream µs | host µs | back-to-back µs | overhead µs | graph overhead µs |"


def test_gpu_flow_end_to_end_with_stand_ins(monkeypatch, stand_in, tmp_path):
    """The whole GPU-mode run (compare, determinism, timing, reports) on the CPU: the optimized
    op is the reference itself, CUDA events are host clocks."""
    monkeypatch.setattr(runner, "execution_target", lambda: (CPU, True))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(timing.Timer, "_capture", staticmethod(lambda fn: fn))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "L2_FLUSH_BYTES", 1 << 10)
    _fake_profiler(monkeypatch)
    monkeypatch.setattr(runner, "compile_pass", lambda cases, **kwargs: {case.label: None for case in cases})
    op = registry.get_op("per_token_cast")
    stand_in(op.name, op.reference())
    benchmark = next(case for case in registry.cases_of(op.name, "quick") if case.benchmark)
    labels = [benchmark.label, _small_case(op.name).label]
    built = runner.run("quick", patterns=labels, torch_compile=False)
    assert built.exit_status == 0 and built.gpu and not built.notes
    timed = {r.case.label: r.timing for r in built.results if r.timing}
    assert list(timed) == [benchmark.label] and timed[benchmark.label].optimized_us > 0
    (bench_result,) = [r for r in built.results if r.case.benchmark]
    names = {check.name for check in bench_result.checks}
    assert {"q", "sf", "determinism", "inputs untouched", "reference CPU ≡ GPU: sf"} <= names
    text = report.markdown(built)
    assert "## Timings" in text and benchmark.title in text and HEADER_OF_TIMINGS in text
    assert "timed workloads; median" in text and "In a CUDA graph, the overhead under" in text
    assert "## Kernel builds" not in text  # the stand-in builds no kernel
    built.kernel_builds = {"tileproof.optimized.quant.per_token.per_token_cast_kernel('bfloat16', 'e4m3')": 3.5}
    assert "## Kernel builds" in report.markdown(built) and "3.50" in report.markdown(built)
    assert report.report_dict(built)["kernel_builds"][0]["seconds"] == 3.5
    report.write_json(built, tmp_path / "gpu.json")
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["summary"]["geomean_speedups"]["quant"]["cases"] == 1


def test_copy_roof_from_the_environment(monkeypatch):
    monkeypatch.setenv(timing.COPY_ROOF_ENV, "3350")
    assert timing.copy_roof_gbps() == 3350.0
    monkeypatch.setenv(timing.COPY_ROOF_ENV, "fast")
    with pytest.raises(ValueError, match=timing.COPY_ROOF_ENV):
        timing.copy_roof_gbps()


def test_markdown_and_plot_with_timings(tmp_path, seed):
    built = _report_with_timings(seed)
    text = report.markdown(built)
    for needle in ("## Environment", "## Comparison policy", "## Timings", "10.00×", "RuntimeError: stand-in"):
        assert needle in text
    assert ">>>" not in text  # docs/ markdown is collected for doctests
    pytest.importorskip("matplotlib")
    report.write_plot(built, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_console_report_shows_bounds_failures_and_repro(seed):
    import io

    from rich.console import Console

    built = _report_with_timings(seed)
    failing = built.results[0]
    bad = policy.Check("q", FAIL, "bitwise", "1/64 differ", "first mismatch at [0, 3]: expected 1.0 (0x38), got …")
    built.results.append(runner.CaseResult(failing.case, seed, failing.repro, [bad]))
    stream = io.StringIO()
    report.print_report(built, Console(file=stream, width=250), verbose=True)
    text = stream.getvalue()
    assert "[block rel ≤" in text  # bounds survive rich's markup
    assert "repro: tileproof oracle --op per_token_cast --case" in text
    assert "q: 1/64 differ [bitwise] first mismatch at [0, 3]" in text
    assert "10.00×" in text and "exit status 1" in text


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["oracle", "--op", "no_such_op"],
        ["oracle", "--profile", "huge"],
        ["oracle", "--case", "per_token_cast/no/such/case"],
        ["oracle", "--seed", "-1"],
        ["oracle", "--max-cases", "0"],
        ["oracel"],
        [],
    ],
)
def test_cli_usage_errors_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    assert "error" in capsys.readouterr().err


def test_cli_list(capsys):
    assert cli.main(["oracle", "--list", "--op", "per_token_cast_back", "--profile", "full"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(registry.cases_of("per_token_cast_back", "full"))
    assert any("[benchmark:" in line for line in lines)


def test_cli_runs_a_selection_and_writes_reports(tmp_path, capsys):
    labels = [_zero_token_case("per_token_cast").label, _small_case("per_token_cast").label]
    json_path, markdown_path = tmp_path / "out" / "oracle.json", tmp_path / "oracle.md"
    argv = ["oracle", "--op", "per_token_cast", "--profile", "quick", "--no-timing", "--jobs", "2"]
    argv += [arg for label in labels for arg in ("--case", label)]
    argv += ["--json", str(json_path), "--markdown", str(markdown_path)]
    status = cli.main(argv)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "all 2 cases pass" in out

    data = json.loads(json_path.read_text())
    assert data["schema"] == report.SCHEMA
    for key in ("date_utc", "torch", "tilelang", "gpu", "sm_count", "driver", "git_revision", "profile", "seed"):
        assert key in data["environment"]
    assert sorted(case["label"] for case in data["cases"]) == sorted(labels)
    assert data["summary"]["exit_status"] == 0
    assert data["policies"]["per_token_cast"]["q"]["policy"] == "bitwise"
    if not torch.cuda.is_available():
        assert runner.NO_GPU_NOTE in data["run"]["notes"]

    text = markdown_path.read_text()
    assert "## Environment" in text and "| torch |" in text and "## Comparison policy" in text
    assert "--case" in text  # the re-run command names the selection


@pytest.mark.parametrize("profile", registry.TIERS)
def test_repro_command_selects_exactly_its_case(profile):
    cases = registry.select_cases(profile)
    for case in (cases[0], cases[len(cases) // 2], cases[-1]):
        words = shlex.split(runner.repro_command(case, 42, profile))
        assert words[:2] == ["tileproof", "oracle"]
        args = cli.build_parser().parse_args(words[1:])
        assert args.seed == 42 and args.no_timing
        assert cli.select(args) == [case]


def test_json_of_every_case_is_serializable(seed):
    case = _small_case("per_token_cast_with_precomputed_sf", "e2m1", "packed")
    checks, _ = runner.check_case(case, seed, CPU, None, gpu=False)
    result = runner.CaseResult(case, seed, "repro", checks)
    built = runner.Report(runner.environment("quick", 0), "quick", 0, False, False, [case.op], [result])
    data = json.loads(json.dumps(report.report_dict(built)))
    assert data["cases"][0]["params"] == dataclasses.asdict(case.params)


def test_headline_shows_each_outputs_bound_when_bounds_differ(seed):
    case = _small_case("per_token_cast")
    same = [policy.Check("q", PASS, "bitwise", "0/8 differ"), policy.Check("sf", PASS, "bitwise", "0/1 differ")]
    assert report.headline(runner.CaseResult(case, seed, "", same)) == "q 0/8 differ, sf 0/1 differ [bitwise]"
    mixed = [policy.Check("q", PASS, "rel ≤ 0.01", "0.003"), policy.Check("sf", PASS, "rel ≤ 0.002", "1e-06")]
    assert report.headline(runner.CaseResult(case, seed, "", mixed)) == "q 0.003 [rel ≤ 0.01], sf 1e-06 [rel ≤ 0.002]"


# ---------------------------------------------------------------------------------------------
# Reference-only operators (no optimized twin yet)
# ---------------------------------------------------------------------------------------------


def test_reference_only_case_runs_the_reference_and_skips_the_rest(stand_in, seed):
    case = _small_case("per_token_cast")
    stand_in(case.op, None)
    assert runner.compile_pass([case], device=CPU, workers=1) == {case.label: None}  # nothing to compile, no error
    checks, _ = runner.check_case(case, seed, CPU, None, gpu=False)
    statuses = _statuses(checks)
    assert statuses[runner.REFERENCE_ONLY] == policy.SKIP
    assert statuses["reference round trip"] == PASS  # the self-checks still run
    assert runner.COMPILE_NAME not in statuses and "GPU comparison" not in statuses
    result = runner.CaseResult(case, seed, "repro", checks)
    assert result.status == PASS and result.reference_only == runner.NO_TWIN_NOTE

    # With a GPU (simulated on the CPU) the reference is still held to the same bytes on both devices.
    checks, _ = runner.check_case(case, seed, CPU, None, gpu=True)
    statuses = _statuses(checks)
    assert statuses["reference CPU ≡ GPU: q"] == statuses["reference CPU ≡ GPU: sf"] == PASS
    assert "q" not in statuses and "determinism" not in statuses


def test_reference_only_operators_are_counted_apart_in_every_report(stand_in, tmp_path, seed):
    import io

    from rich.console import Console

    stand_in("per_token_cast_back", None)
    labels = [_small_case("per_token_cast").label, _small_case("per_token_cast_back").label]
    built = runner.run("quick", patterns=labels, timing=False)
    assert built.exit_status == 0
    assert built.counts() == {PASS: 1, FAIL: 0, ERROR: 0, runner.REFERENCE_ONLY: 1}
    assert any("reference only (no optimized twin yet): per_token_cast_back" in note for note in built.notes)
    data = report.report_dict(built)
    assert data["summary"]["reference_only"] == 1 and data["summary"]["pass"] == 1
    assert data["summary"]["reference_only_ops"] == ["per_token_cast_back"]
    by_label = {case["label"]: case for case in data["cases"]}
    assert (
        by_label[labels[1]]["reference_only"] == runner.NO_TWIN_NOTE and by_label[labels[0]]["reference_only"] is None
    )
    text = report.markdown(built)
    assert "| reference only |" in text and "REFERENCE ONLY" in text and "1 of them reference only" in text
    stream = io.StringIO()
    report.print_report(built, Console(file=stream, width=250), verbose=True)
    console = stream.getvalue()
    assert "REFERENCE ONLY" in console and "reference only (no optimized twin yet)" in console
    assert "exit status 0" in console


# ---------------------------------------------------------------------------------------------
# The float64 reference of RelativeError outputs
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Length:
    n: int


class _ThirdOp(registry.OpSpec):
    """``y = x / 3`` in fp32, with a planted flaw: the native reference is off by a relative 1e-3,
    its float64 version is right. A twin that computes y correctly must pass against the float64
    reference, and the native reference must fail its own bound against it."""

    name = "test_third"
    family = "test"
    outputs = (registry.Output("y", RelativeError(1e-5), "fp32 division: half an ulp, 2^-24"),)

    def __init__(self, float64_outputs: int = 1):
        self.float64_outputs = float64_outputs

    def cases(self, tier):
        return [registry.Case(self.name, f"{self.name}/n{n}", _Length(n)) for n in (0, 1, 37)]

    def build(self, case, device, generator):
        n = case.params.n
        x = torch.randn(n, generator=generator) if generator is not None else torch.empty(n)
        return registry.Call((x.to(device),))

    def reference(self):
        return lambda x: x / 3 * (1 + 1e-3)

    def optimized(self):
        return None

    def bytes_moved(self, case):
        return 8 * case.params.n

    def reference_float64(self, case, call):
        return ((call.args[0].double() / 3),) * self.float64_outputs


@pytest.fixture
def temporary_op(monkeypatch):
    """Register an extra OpSpec for one test."""

    def install(spec):
        registry.all_ops()
        monkeypatch.setitem(registry._OPS, spec.name, spec)
        monkeypatch.setattr(registry, "_CASES", {})
        return spec

    return install


def test_relative_error_outputs_are_measured_against_the_float64_reference(temporary_op, seed):
    spec = temporary_op(_ThirdOp())
    case = registry.cases_of(spec.name, "quick")[-1]
    exact = runner.backend_twin("exact", types.SimpleNamespace(test_third=lambda x: (x.double() / 3).float()))
    checks, _ = runner.check_case(case, seed, CPU, None, gpu=False, twin=exact)
    statuses = _statuses(checks)
    assert statuses["y"] == PASS  # against the native reference (1e-3 away) it would fail
    (own,) = [c for c in checks if c.name == "reference ≈ float64: y"]
    assert own.status == FAIL and float(own.metric) == pytest.approx(1e-3, rel=1e-2)

    like_reference = runner.backend_twin("flawed", types.SimpleNamespace(test_third=spec.reference()))
    checks, _ = runner.check_case(case, seed, CPU, None, gpu=False, twin=like_reference, self_checks=False)
    assert _statuses(checks)["y"] == FAIL
    assert not any(c.name.startswith("reference ≈") for c in checks)  # self-checks off


def test_a_malformed_float64_reference_is_an_error(temporary_op, seed):
    spec = temporary_op(_ThirdOp(float64_outputs=2))
    checks, _ = runner.check_case(registry.cases_of(spec.name, "quick")[-1], seed, CPU, None, gpu=False)
    (check,) = [c for c in checks if c.name == "reference float64"]
    assert check.status == ERROR and "2 outputs, expected 1" in check.detail


# ---------------------------------------------------------------------------------------------
# Other twins: --backend, --base
# ---------------------------------------------------------------------------------------------


def test_a_backend_module_is_compared_on_the_cpu(tmp_path, capsys):
    labels = [_small_case("per_token_cast").label, _zero_token_case("per_token_cast").label]
    json_path = tmp_path / "backend.json"
    argv = ["oracle", "--backend", "tileproof.reference.quant", "--op", "per_token_cast", "--no-timing"]
    argv += [arg for label in labels for arg in ("--case", label)] + ["--json", str(json_path)]
    assert cli.main(argv) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "backend tileproof.reference.quant compared with the reference on the CPU" in " ".join(out.split())
    data = json.loads(json_path.read_text())
    assert data["run"]["twin"] == "backend tileproof.reference.quant" and data["run"]["compared"] is True
    (small,) = [case for case in data["cases"] if case["label"] == labels[0]]
    names = {check["name"]: check["status"] for check in small["checks"]}
    assert names["q"] == names["sf"] == names["determinism"] == PASS
    assert runner.COMPILE_NAME not in names  # foreign code is not compiled by tileproof's jit
    assert "--backend tileproof.reference.quant" in small["repro"]


def test_operators_a_backend_lacks_are_reference_only(seed):
    reference = registry.get_op("per_token_cast").reference()
    twin = runner.backend_twin("partial", types.SimpleNamespace(per_token_cast=reference))
    for op, expected in (("per_token_cast", ""), ("per_token_cast_back", "not in backend partial")):
        checks, _ = runner.check_case(_small_case(op), seed, CPU, None, gpu=False, twin=twin)
        assert runner.CaseResult(_small_case(op), seed, "", checks).reference_only == expected
        assert all(check.ok for check in checks), checks


def test_backend_and_base_usage_errors_exit_2(capsys):
    with pytest.raises(ValueError, match="no_such_module_xyz"):
        runner.backend_twin("no_such_module_xyz")
    assert cli.main(["oracle", "--backend", "no_such_module_xyz", "--op", "per_token_cast"]) == 2
    assert "cannot import" in capsys.readouterr().err
    assert cli.main(["oracle", "--base", "no-such-revision-xyz", "--op", "per_token_cast"]) == 2
    assert "not a commit" in capsys.readouterr().err
    assert cli.main(["oracle", "--base", "HEAD", "--backend", "tileproof.reference.quant"]) == 2


def test_base_revision_is_imported_under_its_own_name():
    if not (runner.REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    twin = runner.base_twin("HEAD")
    fn = twin.lookup(registry.get_op("per_token_cast"))
    package = twin.jit_module.removesuffix(".jit")
    assert package.startswith("tileproof_base_") and fn.__module__.startswith(package + ".")
    assert fn is not registry.get_op("per_token_cast").optimized()
    assert twin.cli_args == ("--base", "HEAD") and twin.name.startswith("base HEAD (")
    assert twin.lookup(registry.get_op("per_token_cast")) is fn  # extracted and imported once


# ---------------------------------------------------------------------------------------------
# Grid-size independence (--sm-limit) and --no-compile
# ---------------------------------------------------------------------------------------------


def test_sm_count_reads_the_limit(monkeypatch):
    from tileproof.optimized import device

    monkeypatch.delenv(device.SM_LIMIT_ENV, raising=False)
    assert device.sm_count("cpu") == device.SM_COUNT_WITHOUT_GPU == 132
    monkeypatch.setenv(device.SM_LIMIT_ENV, "114")
    assert device.sm_count("cpu") == 114
    monkeypatch.setenv(device.SM_LIMIT_ENV, "500")
    assert device.sm_count(torch.device("cpu")) == 132  # a limit above the device's count changes nothing
    for bad in ("many", "0", "-3"):
        monkeypatch.setenv(device.SM_LIMIT_ENV, bad)
        with pytest.raises(ValueError, match=device.SM_LIMIT_ENV):
            device.sm_count("cpu")


def test_grid_size_independence_check(stand_in, monkeypatch, seed):
    from tileproof.optimized.device import SM_LIMIT_ENV, sm_count

    monkeypatch.delenv(SM_LIMIT_ENV, raising=False)
    case = _small_case("per_token_cast_with_sf_only")
    reference = registry.get_op(case.op).reference()
    stand_in(case.op, reference)
    checks, _ = runner.check_case(case, seed, CPU, None, gpu=True, sm_limit=114)
    (grid,) = [c for c in checks if c.name == runner.GRID_CHECK]
    assert grid.status == PASS and grid.metric == "≤ 114 SMs vs all"

    def sized_by_sm_count(*args, **kwargs):  # a result that depends on the grid: a real bug
        return reference(*args, **kwargs) * (sm_count("cpu") / 132)

    stand_in(case.op, sized_by_sm_count)
    checks, _ = runner.check_case(case, seed, CPU, None, gpu=True, sm_limit=114)
    statuses = _statuses(checks)
    assert statuses[runner.GRID_CHECK] == FAIL and statuses["sf"] == PASS
    assert SM_LIMIT_ENV not in os.environ  # restored after the limited run


def test_sm_limit_defaults_and_repro(capsys):
    parse = cli.build_parser().parse_args
    assert cli.sm_limit_of(parse(["oracle"])) is None
    assert cli.sm_limit_of(parse(["oracle", "--profile", "full"])) == runner.FULL_PROFILE_SM_LIMIT
    assert cli.sm_limit_of(parse(["oracle", "--profile", "full", "--sm-limit", "0"])) is None
    assert cli.sm_limit_of(parse(["oracle", "--sm-limit", "100"])) == 100
    assert cli.main(["oracle", "--sm-limit", "-1"]) == 2
    case = _small_case("per_token_cast")
    twin = runner.backend_twin("tileproof.reference.quant")
    words = shlex.split(runner.repro_command(case, 3, "quick", twin, 100))
    args = parse(words[1:])
    assert args.sm_limit == 100 and args.backend == "tileproof.reference.quant" and cli.select(args) == [case]
    assert "--sm-limit" not in runner.repro_command(case, 3, "full", None, runner.FULL_PROFILE_SM_LIMIT)


def test_no_compile_and_sm_limit_without_a_gpu(monkeypatch):
    monkeypatch.setattr(runner, "execution_target", lambda: (CPU, False))
    built = runner.run(
        "quick", patterns=[_small_case("per_token_cast").label], timing=False, compile=False, sm_limit=114
    )
    assert built.exit_status == 0
    assert "compile pass not run (--no-compile)" in built.notes
    assert any("needs a GPU" in note for note in built.notes)
    assert _statuses(built.results[0].checks)[runner.COMPILE_NAME] == policy.SKIP


def test_reference_device_check_is_bitwise_for_bitwise_outputs_and_bounded_for_float_outputs():
    """The CPU ≡ GPU reference check, fed 'GPU' outputs made on the CPU: a one-ulp change of a float
    output under a relative-error policy passes (CPU and CUDA transcendentals differ in the last
    bit; there the CPU reference is held to its bound against float64 instead, while the GPU
    reference meets the same bound in its own self-check), the same change of a bitwise output fails."""
    from tileproof.oracle.registry import case_seed, cases_of, get_op
    from tileproof.oracle.runner import _generator, _reference_device_check

    def one_ulp_up(tensor):
        return torch.nextafter(tensor, torch.full_like(tensor, float("inf"))) if tensor.is_floating_point() else tensor

    float_case = next(c for c in cases_of("mhc_post", "quick") if "x0" not in c.label and get_op(c.op))
    op = get_op(float_case.op)
    seed = case_seed(0, float_case.label)
    outputs = op.split(op.build(float_case, torch.device("cpu"), _generator(seed))(op.reference()))
    checks = _reference_device_check(float_case, seed, tuple(one_ulp_up(t) for t in outputs))
    assert checks and all(check.ok for check in checks), checks

    bitwise_case = next(c for c in cases_of("per_token_cast", "quick") if c.params.tokens > 1)
    op = get_op(bitwise_case.op)
    seed = case_seed(0, bitwise_case.label)
    q, sf = op.split(op.build(bitwise_case, torch.device("cpu"), _generator(seed))(op.reference()))
    checks = _reference_device_check(bitwise_case, seed, (q, one_ulp_up(sf)))
    assert any(not check.ok for check in checks), checks


def test_precompile_command(monkeypatch, capsys):
    assert cli.main(["precompile", "--op", "no_such_operator"]) == 2
    assert cli.main(["precompile", "--op", "topk_gate", "--case", "no-such-case*"]) == 0
    assert "0 cases" in capsys.readouterr().out
    failure = runner.CompileFailure("topk_gate", "topk_gate/x", "RuntimeError: nvcc says no")
    monkeypatch.setattr(runner, "compile_all", lambda *args, **kwargs: [failure])
    assert cli.main(["precompile", "--op", "topk_gate"]) == 1
    assert "FAIL topk_gate/x: RuntimeError: nvcc says no" in capsys.readouterr().out


def test_base_revision_mirrors_oracle_harnesses_and_layer_drivers():
    """An operator the oracle runs through a harness (top2_sum_gate: a copy of its in-place buffer)
    or a layer driver gets the same harness or driver over the base revision's code."""
    if not (runner.REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    from tileproof.oracle.modeling import LayerDriver

    twin = runner.base_twin("HEAD")
    package = twin.jit_module.removesuffix(".jit")
    current = registry.get_op("top2_sum_gate").optimized()
    harness = twin.lookup(registry.get_op("top2_sum_gate"))
    assert harness.__code__ is current.__code__
    launchers = [cell.cell_contents for cell in harness.__closure__ if callable(cell.cell_contents)]
    assert launchers and all(launcher.__module__.startswith(package + ".") for launcher in launchers)
    driver = twin.lookup(registry.get_op("engram_gate_layer"))
    assert isinstance(driver, LayerDriver) and driver.layers.__name__ == f"{package}.modeling"

"""GPU: a pytest-benchmark suite over the oracle's named benchmark workloads (issue 8).

One test per workload: the cases of the ``full`` profile that the registry marks ``benchmark=True``
(``tileproof oracle --profile full --list`` shows them as ``[benchmark: ...]``). Each test builds
its inputs once on the GPU with the operator spec's own ``build``, from the seed the oracle gives
the case under its default global seed, so they are the inputs the oracle's report timed. One call
outside the timing builds (or loads) the kernels and shows that the call runs; then
``benchmark.pedantic`` times the optimized operator.

What is timed: back-to-back calls, as a caller looping over the operator sees them. A round makes
``iterations`` calls and then waits for the GPU (``torch.cuda.synchronize``), so a round's
wall-clock time ends when its GPU work does; pytest-benchmark divides each round by its
iterations, so its statistics are per call. The oracle's own timings differ on purpose: kernel time
from CUPTI with the L2 flushed before every run. Here the L2 stays warm, and where the host's launch
cost exceeds the GPU's time (small workloads) the calls are launch-bound, which is what a loop of
them would see. ``extra_info`` holds the oracle's bytes model and the GB/s it implies.

Results for the oracle's report (docs/performance.md)::

    python -m pytest -m gpu tests/test_gpu_benchmarks.py --benchmark-json docs/results/pytest-benchmark-h200.json
    tileproof oracle --profile full ... --benchmark-results docs/results/pytest-benchmark-h200.json

Collection builds nothing: the parameters are the registry's cases (plain dataclasses); inputs and
kernels only come when a test runs, and without CUDA the ``gpu`` marker skips every test.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import pytest
import torch

from tileproof.oracle import registry, runner

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
ORACLE_SEED = 0  # the oracle's default --seed: each case's inputs are the ones its report timed
# A round lasts about this long, so the one wait for the GPU at its end (~10 µs) costs < 0.5 %.
ROUND_SECONDS = 0.005
MAX_ITERATIONS = 1000
# Wall-clock time spent on the timed rounds of one workload.
BUDGET_SECONDS = 0.5
MIN_ROUNDS, MAX_ROUNDS = 10, 100
WARMUP_ROUNDS = 1

BENCHMARK_WORKLOADS = [case for case in registry.select_cases("full") if case.benchmark]


class CallsEndingInAWait:
    """The optimized call for ``benchmark.pedantic(..., iterations=iterations)``: pedantic calls its
    target ``iterations`` times per round, so waiting for the GPU on every ``iterations``-th call
    ends each round (warm-up rounds included) with the GPU idle, and the GPU's work is inside the
    round's time."""

    def __init__(self, launch: Callable[[], object], iterations: int):
        self.launch = launch
        self.iterations = iterations
        self.calls = 0
        self.waits = 0

    def __call__(self) -> None:
        self.launch()
        self.calls += 1
        if self.calls % self.iterations == 0:
            torch.cuda.synchronize()
            self.waits += 1


def seconds_per_call(launch: Callable[[], object], calls: int = 3) -> float:
    """Wall-clock time of one back-to-back call (an estimate, to size the rounds)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        launch()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / calls


@pytest.mark.parametrize("case", BENCHMARK_WORKLOADS, ids=[case.label for case in BENCHMARK_WORKLOADS])
def test_benchmark_workload(benchmark, case: registry.Case):
    spec = registry.get_op(case.op)
    optimized, import_error = runner.twin_function(runner.OPTIMIZED, spec)
    if import_error:
        pytest.fail(import_error)
    if optimized is None:
        pytest.skip(f"{case.op}: {runner.NO_TWIN_NOTE}")
    generator = torch.Generator().manual_seed(registry.case_seed(ORACLE_SEED, case.label))
    call = spec.build(case, DEVICE, generator)

    def launch():
        return call(optimized)

    # Outside the timing: builds or loads the kernels, and shows that the call runs.
    outputs = spec.split(launch())
    torch.cuda.synchronize()
    assert len(outputs) == len(spec.outputs), f"{len(outputs)} outputs, the spec names {len(spec.outputs)}"
    del outputs

    estimate = max(seconds_per_call(launch), 1e-7)
    iterations = max(1, min(MAX_ITERATIONS, math.ceil(ROUND_SECONDS / estimate)))
    rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, int(BUDGET_SECONDS / (estimate * iterations))))
    timed_calls = CallsEndingInAWait(launch, iterations)
    bytes_moved = spec.bytes_moved(case)
    benchmark.extra_info.update(
        case=case.label,
        title=case.title,
        operator=case.op,
        gpu=torch.cuda.get_device_name(DEVICE),
        bytes_moved=bytes_moved,
    )
    benchmark.pedantic(timed_calls, rounds=rounds, iterations=iterations, warmup_rounds=WARMUP_ROUNDS)
    torch.cuda.synchronize()  # the untimed extra call pedantic makes for its result, and --benchmark-disable

    if benchmark.stats is None:  # --benchmark-disable: the target ran once, untimed
        return
    assert timed_calls.waits == WARMUP_ROUNDS + rounds, "a round ended without waiting for the GPU"
    median_seconds = benchmark.stats.stats.median  # per call: pytest-benchmark divides by the iterations
    benchmark.extra_info["gbps"] = bytes_moved / median_seconds / 1e9

"""GPU timing: the operator's own kernel time, measured as the public baselines were, with the L2
cache flushed before every run.

Before each timed run a 1 GiB buffer (over sixteen times the H200's 60 MB L2) is overwritten, so
every run reads its inputs from HBM, as a large operator does in a model. Two measures per callee:

- **kernel µs** (the headline, ``optimized_us``): the sum of the GPU durations of the kernels (and
  memsets/copies) the call launched, from CUPTI through ``torch.profiler``, the flush excluded;
  the median over runs. This is how the issues' targets were measured (TileLang's
  ``do_bench(backend="cupti")``, behind the public kernels' benchmark suites), so the two compare.
- **stream µs** (``optimized_stream_us``): the median of CUDA-event pairs around the call. It adds
  what the kernel time leaves out: the event records themselves and the gaps between a multi-kernel
  operator's launches (on the H200 about 2.5 µs more than the kernel time for a one-kernel
  operator; docs/performance.md).

The host's launch overhead is hidden behind the flush in both (the GPU queue stays ahead); the
host time of a warm call is measured on its own (``host_us``), and a loop of warm calls made back
to back, with no flush and no synchronization between them, gives what a stream of calls pays per
call (``back_to_back_us``) and the kernel time inside that loop: their difference is the warm
launch overhead (``launch_overhead_us``). The number of runs adapts to the operator's duration (a
fixed budget of GPU time per callee).

Bandwidth is ``bytes_moved / kernel time`` with the operator's bytes model (bytes it must read plus
bytes it must write); the roof is the measured device-to-device copy bandwidth of the H200.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .registry import Call, Case, OpSpec

COPY_ROOF_GBPS = 4217.0  # H200, torch 2.11: device-to-device copy, bytes read + bytes written
COPY_ROOF_ENV = "TILEPROOF_COPY_ROOF_GBPS"
# 1 GiB: over sixteen times the H200's 60 MB L2, and ~300 µs of GPU work per run, so the GPU
# queue stays ahead of the host: a launcher's host-side cost (validation, allocation, the
# kernel call; tens of µs in Python) never lands between the events. With 256 MiB it sometimes
# did, and a 6 µs decode kernel timed at 28 µs.
L2_FLUSH_BYTES = 1 << 30
BUDGET_MS = 100.0  # GPU time spent on the timed runs of one callee
MIN_REPS, MAX_REPS = 5, 200
HOST_REPS = 21  # warm calls whose host time is measured (median)
# Back-to-back loops: calls sized to about this much kernel time (within the bounds), three loops
# (median), each behind a GPU sleep of HEAD_START_CYCLES (~100 µs on an H200): the GPU is busy
# while the host makes the first call, so the loop measures the steady state, not the first
# call's host time (which alone put 11 µs per call on a 20-call loop of a 383 µs kernel).
BACK_TO_BACK_KERNEL_US = 5000.0
BACK_TO_BACK_CALLS = (20, 500)
BACK_TO_BACK_LOOPS = 3
HEAD_START_CYCLES = 200_000
LARGE_CASE_BYTES = 128 << 20  # full-profile cases moving at least this much are timed too
# Issue 8's line: a warm call should cost less than this above the kernel's own time.
LAUNCH_OVERHEAD_TARGET_US = 10.0


def copy_roof_gbps() -> float:
    """The copy roof in GB/s: ``TILEPROOF_COPY_ROOF_GBPS`` if set, else the measured H200 figure."""
    raw = os.environ.get(COPY_ROOF_ENV, "").strip()
    if not raw:
        return COPY_ROOF_GBPS
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{COPY_ROOF_ENV} must be a positive number of GB/s, got {raw!r}")
    return value


@dataclass
class Timing:
    """Median times of one case (µs; None when not measured) and what they imply."""

    bytes_moved: int
    roof_gbps: float
    optimized_us: float | None = None  # kernel time (CUPTI)
    eager_us: float | None = None
    compiled_us: float | None = None
    optimized_stream_us: float | None = None  # CUDA events around the call
    # Host cost of one warm optimized call (validation, allocation, the kernel calls): what a
    # launch-bound caller pays per call, whatever the kernel's own time.
    host_us: float | None = None
    # Warm optimized calls made back to back (no flush, no synchronization between them), per call:
    # the stream time (CUDA events), and the kernel time of the same calls (CUPTI). Their difference
    # is what the launch costs a stream of calls above the kernels themselves.
    back_to_back_us: float | None = None
    back_to_back_kernel_us: float | None = None
    # The same loop with the call captured once in a CUDA graph and the graph replayed: what a caller
    # that captures (a serving loop, a training step under CUDA graphs) pays per call.
    graph_us: float | None = None
    reps: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # callee -> why it has no time

    @property
    def gbps(self) -> float | None:
        return self.bytes_moved / (self.optimized_us * 1e3) if self.optimized_us else None

    @property
    def overhead_us(self) -> float | None:
        """What back-to-back warm calls pay above the kernel time, measured on one loop of them:
        wall time per call minus the kernel time per call. A call whose host work outlasts its
        kernels is launch-bound (the GPU waits for the host); otherwise what is left is the gap
        between kernels on the stream (a multi-kernel operator's launches)."""
        if None in (self.back_to_back_us, self.back_to_back_kernel_us):
            return None
        return self.back_to_back_us - self.back_to_back_kernel_us

    @property
    def graph_overhead_us(self) -> float | None:
        """Per call above the kernel time when the call is a CUDA graph replayed back to back."""
        if None in (self.graph_us, self.back_to_back_kernel_us):
            return None
        return self.graph_us - self.back_to_back_kernel_us

    @property
    def pct_roof(self) -> float | None:
        return 100.0 * self.gbps / self.roof_gbps if self.gbps is not None else None

    @property
    def speedup_eager(self) -> float | None:
        return self.eager_us / self.optimized_us if self.eager_us and self.optimized_us else None

    @property
    def speedup_compiled(self) -> float | None:
        return self.compiled_us / self.optimized_us if self.compiled_us and self.optimized_us else None

    def as_dict(self) -> dict:
        return {
            "bytes_moved": self.bytes_moved,
            "copy_roof_gbps": self.roof_gbps,
            "optimized_us": self.optimized_us,
            "optimized_stream_us": self.optimized_stream_us,
            "reference_eager_us": self.eager_us,
            "reference_compiled_us": self.compiled_us,
            "optimized_host_us": self.host_us,
            "back_to_back_us": self.back_to_back_us,
            "back_to_back_kernel_us": self.back_to_back_kernel_us,
            "launch_overhead_us": self.overhead_us,
            "graph_us": self.graph_us,
            "graph_overhead_us": self.graph_overhead_us,
            "gbps": self.gbps,
            "pct_copy_roof": self.pct_roof,
            "speedup_vs_eager": self.speedup_eager,
            "speedup_vs_compile": self.speedup_compiled,
            "reps": self.reps,
            "errors": self.errors,
        }


class Timer:
    """Times callables on one CUDA device (owns the L2-flush buffer)."""

    def __init__(self, device: torch.device, flush_bytes: int | None = None):
        self.flush = torch.empty(flush_bytes or L2_FLUSH_BYTES, dtype=torch.uint8, device=device)

    def _flush(self) -> None:
        self.flush.zero_()

    def _reps(self, fn: Callable[[], object]) -> int:
        """Warm up (first-call costs are not timed) and size the runs to the GPU-time budget."""
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        end.synchronize()
        estimate_ms = max(start.elapsed_time(end) / 3, 1e-3)
        return max(MIN_REPS, min(MAX_REPS, int(BUDGET_MS / estimate_ms)))

    def median_us(self, fn: Callable[[], object], reps: int | None = None) -> tuple[float, int]:
        """Stream time: median of CUDA-event pairs around ``fn``, and the number of runs (sized to the
        time budget unless ``reps`` is given: ``fn`` already warm)."""
        reps = reps or self._reps(fn)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for begin, finish in zip(starts, ends, strict=True):
            self._flush()
            begin.record()
            fn()
            finish.record()
        torch.cuda.synchronize()
        return statistics.median(b.elapsed_time(f) for b, f in zip(starts, ends, strict=True)) * 1e3, reps

    def kernel_median_us(self, fn: Callable[[], object], reps: int | None = None) -> tuple[float, int]:
        """Kernel time: median over runs of the GPU durations of what ``fn`` launched (CUPTI); runs
        sized as ``median_us``'s."""
        reps = reps or self._reps(fn)

        def runs():
            for _ in range(reps):
                self._flush()
                fn()

        return statistics.median(kernel_time_per_run(gpu_activities(runs), reps)), reps

    def host_us(self, fn: Callable[[], object], reps: int = HOST_REPS) -> float:
        """Median wall-clock time of one warm call of ``fn``, each made while the GPU is still busy
        with an L2 flush (so the call never waits for the GPU, unless it synchronizes: then the
        wait shows, as it should)."""
        fn()
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            self._flush()
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        torch.cuda.synchronize()
        return statistics.median(times) * 1e6

    def back_to_back_us(self, fn: Callable[[], object], kernel_us: float) -> tuple[float, float]:
        """Per call of warm calls of ``fn`` made back to back, as a model's stream of calls makes them
        (no flush, no synchronization between calls, so the host queues ahead where it can): the
        stream time from the first call to the end of the last (CUDA events; median of three loops,
        each behind a short GPU sleep) and the kernel time of such a loop (CUPTI). Where the host is
        slower than the kernels the stream waits for it, and the wait is in the first number.
        ``kernel_us`` (one call's kernel time) sizes the loop."""
        calls = _back_to_back_calls(kernel_us)
        loop = _repeated(fn, calls)
        fn()
        kernel = sum(end - start for start, end, _ in gpu_activities(loop)) / calls
        return _stream_us_per_call(loop, calls), kernel

    def graph_replay_us(self, fn: Callable[[], object], kernel_us: float) -> float:
        """Per call, the stream time of one call of ``fn`` captured in a CUDA graph and the graph
        replayed back to back (as ``back_to_back_us``); ``fn`` must already be warm."""
        calls = _back_to_back_calls(kernel_us)
        loop = _repeated(self._capture(fn), calls)
        loop()
        return _stream_us_per_call(loop, calls)

    @staticmethod
    def _capture(fn: Callable[[], object]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay


def _repeated(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    """``fn`` called ``calls`` times in a row, as one callable."""

    def loop():
        for _ in range(calls):
            fn()

    return loop


def _back_to_back_calls(kernel_us: float) -> int:
    low, high = BACK_TO_BACK_CALLS
    return max(low, min(high, int(BACK_TO_BACK_KERNEL_US / max(kernel_us, 1.0))))


def _stream_us_per_call(loop: Callable[[], None], calls: int) -> float:
    """Median over loops of the stream time (CUDA events) of ``loop`` per call, each loop behind a
    GPU sleep so that the host's first call is made while the GPU is busy."""
    spans = []
    for _ in range(BACK_TO_BACK_LOOPS):
        begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(HEAD_START_CYCLES)
        begin.record()
        loop()
        finish.record()
        finish.synchronize()
        spans.append(begin.elapsed_time(finish) * 1e3 / calls)
    return statistics.median(spans)


def gpu_activities(loop: Callable[[], None]) -> list[tuple[float, float, str]]:
    """``(start µs, end µs, name)`` of every GPU activity (kernel, memset, copy) ``loop`` ran, from
    CUPTI through ``torch.profiler``; the GPU is idle before (the callers synchronize) and after."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        loop()
        torch.cuda.synchronize()
    return [
        (event.time_range.start, event.time_range.end, event.name)
        for event in profiler.events()
        if getattr(event.device_type, "name", "") == "CUDA" and not getattr(event, "is_user_annotation", False)
    ]


FLUSH_MIN_US = 100.0  # the 1 GiB flush takes ~300 µs on the H200; no operator's own fill is that long


def kernel_time_per_run(activities: list[tuple[float, float, str]], runs: int) -> list[float]:
    """Per run, the summed durations (µs) of the GPU activities between one flush and the next.

    ``activities`` are ``(start, end, name)`` of everything the profiled loop ran on the GPU, each
    run a flush then the call. The flush is the first activity; its repetitions are the activities
    with its name lasting at least ``FLUSH_MIN_US`` (an operator's own small fills share the name).
    Anything but ``runs`` runs found is an error, not a guess."""
    ordered = sorted(activities)
    if not ordered:
        raise RuntimeError("the profiler recorded no GPU activity")
    flush_name = ordered[0][2]
    totals: list[float] = []
    for start, end, name in ordered:
        if name == flush_name and end - start >= FLUSH_MIN_US:
            totals.append(0.0)
        elif totals:
            totals[-1] += end - start
        else:
            raise RuntimeError(f"GPU activity {name!r} before the first L2 flush")
    if len(totals) != runs:
        raise RuntimeError(f"found {len(totals)} L2 flushes in the profile of {runs} runs")
    return totals


_COMPILED: dict[str, Callable] = {}


def compiled_reference(op: OpSpec) -> Callable:
    """``torch.compile`` of the op's reference, one per op (shapes recompile inside it)."""
    if op.name not in _COMPILED:
        import torch._dynamo

        # Each timed shape and flag set is its own graph; the default limit (8) would silently
        # fall back to eager after a few cases.
        for limit in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
            try:
                setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
            except (AttributeError, TypeError):
                pass
        _COMPILED[op.name] = torch.compile(op.reference(), dynamic=False)
    return _COMPILED[op.name]


def time_case(op: OpSpec, case: Case, call: Call, timer: Timer, *, torch_compile: bool = True) -> Timing:
    """Median times of the optimized op, the eager reference and the compiled reference."""
    timing = Timing(op.bytes_moved(case), copy_roof_gbps())
    callees: list[tuple[str, Callable[[], Callable]]] = [("optimized", op.optimized), ("eager", op.reference)]
    if torch_compile:
        callees.append(("compiled", lambda: compiled_reference(op)))
    else:
        timing.errors["compiled"] = "skipped (--no-torch-compile)"
    for name, get in callees:
        try:
            run = functools.partial(call.timed, get())
            median, reps = timer.kernel_median_us(run)
            if name == "optimized":  # warm and sized by the kernel-time runs
                timing.optimized_stream_us = timer.median_us(run, reps)[0]
        except Exception as error:  # a baseline that fails is reported, not fatal
            timing.errors[name] = first_line(error)
            continue
        setattr(timing, f"{name}_us", median)
        timing.reps[name] = reps
        if name == "optimized":
            timing.host_us = timer.host_us(run)
            timing.back_to_back_us, timing.back_to_back_kernel_us = timer.back_to_back_us(run, median)
            try:
                timing.graph_us = timer.graph_replay_us(run, median)
            except Exception as error:  # an operator that cannot be captured is reported, not fatal
                timing.errors["graph"] = first_line(error)
    return timing


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None

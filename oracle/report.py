"""The oracle's reports: a rich console table, JSON (for machines), Markdown (committed under
docs/results/ unedited) and a PNG plot (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import urllib.parse
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .policy import ERROR, FAIL, PASS, Check
from .registry import get_op
from .runner import GRID_CHECK, OPTIMIZED, REFERENCE_ONLY, CaseResult, Report, outcome_counts, policies
from .timing import LAUNCH_OVERHEAD_TARGET_US, geomean

SCHEMA = "tileproof-oracle/1"
_STATUS_STYLE = {PASS: "green", FAIL: "bold red", ERROR: "bold magenta", REFERENCE_ONLY: "cyan"}

ENVIRONMENT_ROWS = [
    ("date_utc", "date (UTC)"),
    ("profile", "profile"),
    ("seed", "seed"),
    ("gpu", "GPU"),
    ("sm_count", "SMs"),
    ("compute_capability", "compute capability"),
    ("driver", "driver"),
    ("cuda_runtime", "CUDA (torch)"),
    ("torch", "torch"),
    ("tilelang", "tilelang"),
    ("triton", "triton"),
    ("python", "Python"),
    ("platform", "platform"),
    ("host", "host"),
    ("compile_target", "kernel target"),
    ("copy_roof_gbps", "copy roof (GB/s)"),
    ("git_revision", "git revision"),
    ("git_dirty", "uncommitted changes"),
]

SELF_CHECKS = (
    "Reference self-checks (every case, CPU or GPU): the reference returns the documented dtypes, "
    "shapes and strides; quantize-then-dequantize stays within half an ulp of the format at the top "
    "of each block, relative to the block's amax (e4m3 ≤ 2^-4, e2m1 ≤ 2^-2, plus 2^-8 for a bf16 "
    "dequantized output), over rows of finite input; the scales-only op returns per_token_cast's "
    "scales, and with power-of-two scales the given-scales op returns per_token_cast's data, bit for bit."
)


# ---------------------------------------------------------------------------------------------
# Shared formatting
# ---------------------------------------------------------------------------------------------


def short_label(result: CaseResult) -> str:
    """The label without its operator prefix (the operator has its own column)."""
    prefix = result.case.op + "/"
    label = result.case.label
    return label[len(prefix) :] if label.startswith(prefix) else label


def status_text(result: CaseResult) -> str:
    """PASS, FAIL, ERROR, or REFERENCE ONLY for a passing case whose operator the twin lacks."""
    return result.outcome.upper()


def headline(result: CaseResult) -> str:
    """The metrics and bounds of a case, in one line: the failures if any, else what passed."""
    bad = result.failures
    if bad:
        return "; ".join(f"{c.name}: {c.metric or c.status}" + (f" [{c.policy}]" if c.policy else "") for c in bad)
    output_names = {output.name for output in get_op(result.case.op).outputs}
    compared = [c for c in result.checks if c.name in output_names and c.status == PASS]
    if compared:  # GPU: the optimized outputs against the reference
        if len({c.policy for c in compared}) == 1:
            text = ", ".join(f"{c.name} {c.metric}" for c in compared) + f" [{compared[0].policy}]"
        else:  # outputs under different bounds: each with its own, never one bound that looks like all
            text = ", ".join(f"{c.name} {c.metric} [{c.policy}]" for c in compared)
        grid = [c for c in result.checks if c.name == GRID_CHECK and c.status == PASS]
        return text + (f"; grid-size independent ({grid[0].metric})" if grid else "")
    # CPU: the reference's value checks (round trip, cross-op identities), then the compile.
    quiet = ("reference layout", "compile (optimized)")
    parts = [f"reference only ({result.reference_only})"] if result.reference_only else []
    parts += [
        f"{c.name.removeprefix('reference ')} {c.metric} [{c.policy}]"
        for c in result.checks
        if c.status == PASS and c.name not in quiet
    ]
    if any(c.name == "compile (optimized)" and c.status == PASS for c in result.checks):
        parts.append("compiled")
    return "; ".join(parts) or "ok"


def describe(check: Check) -> str:
    """``name: metric [policy] detail``, leaving out the empty parts."""
    text = f"{check.name}: {check.metric or check.status}"
    text += f" [{check.policy}]" if check.policy else ""
    return text + (f" {check.detail}" if check.detail else "")


def _number(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _speedup(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _verdict(report: Report) -> str:
    counts = report.counts()
    total = len(report.results)
    only = f"; {counts[REFERENCE_ONLY]} of them reference only" if counts[REFERENCE_ONLY] else ""
    if report.exit_status == 0:
        other = report.twin != OPTIMIZED.name
        if report.compared:
            where = "on the GPU" if report.gpu else "on the CPU"
            checked = (
                f"{report.twin} compared with the reference {where}"
                if other
                else f"compared with the reference {where}"
            )
        else:
            checked = "reference-checked and compiled" + (
                f"; {report.twin} not compared without a GPU" if other else ""
            )
        return f"all {total} cases pass ({checked}){only}"
    return f"{counts[FAIL]} failed and {counts[ERROR]} errors among {total} cases{only}"


def _device_text(report: Report) -> str:
    env = report.environment
    if env.get("gpu"):
        return f"{env['gpu']} ({env['sm_count']} SMs)"
    return "CPU only (no CUDA GPU)"


def _family_speedups(report: Report) -> dict[str, dict]:
    by_family: dict[str, list] = defaultdict(list)
    for result in report.results:
        if result.timing and result.timing.optimized_us:
            by_family[get_op(result.case.op).family].append(result.timing)
    return {
        family: {
            "cases": len(timings),
            "vs_eager": geomean([t.speedup_eager for t in timings]),
            "vs_compile": geomean([t.speedup_compiled for t in timings]),
            "pct_copy_roof": geomean([t.pct_roof for t in timings]),
        }
        for family, timings in by_family.items()
    }


def _timed(report: Report) -> list[CaseResult]:
    return [r for r in report.results if r.timing is not None]


# ---------------------------------------------------------------------------------------------
# Console
# ---------------------------------------------------------------------------------------------


def print_report(report: Report, console: Console, *, verbose: bool = False) -> None:
    env = report.environment
    target = f"  kernels for {env['compile_target']}" if env.get("compile_target") else ""
    console.print(
        f"[bold]tileproof oracle[/]  profile [cyan]{report.profile}[/]  seed {report.seed}  "
        f"{_device_text(report)}{target}"
    )
    if report.twin != OPTIMIZED.name:
        console.print(f"checked against [bold]{escape(report.twin)}[/]")
    for note in report.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")

    summary = Table(title="by operator", title_justify="left")
    for column in ("operator", "cases", "pass", "fail", "error", "reference only", "timed"):
        summary.add_column(column, justify="left" if column == "operator" else "right")
    for op, results in _by_op(report).items():
        counts = outcome_counts(results)
        timed = sum(r.timing is not None for r in results)
        summary.add_row(
            op, str(len(results)), *(str(counts[s]) for s in (PASS, FAIL, ERROR, REFERENCE_ONLY)), str(timed)
        )
    console.print(summary)

    shown = report.results if verbose else [r for r in report.results if r.status != PASS or r.timing]
    if shown:
        table = Table(title="cases" if verbose else "failures and timed cases", title_justify="left")
        table.add_column("operator")
        table.add_column("case", overflow="fold")
        table.add_column("status")
        table.add_column(escape("metric [bound]"), overflow="fold")
        for column in ("µs", "host µs", "GB/s", "% roof", "× eager", "× compile"):
            table.add_column(column, justify="right")
        for result in shown:
            t = result.timing
            table.add_row(
                result.case.op,
                Text(short_label(result)),
                Text(status_text(result), style=_STATUS_STYLE[result.outcome]),
                Text(headline(result)),
                _number(t.optimized_us) if t else "",
                _number(t.host_us) if t else "",
                _number(t.gbps, 0) if t else "",
                _number(t.pct_roof) if t else "",
                _speedup(t.speedup_eager) if t else "",
                _speedup(t.speedup_compiled) if t else "",
            )
        console.print(table)

    for family, figures in _family_speedups(report).items():
        console.print(
            f"geometric mean, {family} ({figures['cases']} timed cases): {_speedup(figures['vs_eager'])} vs eager, "
            f"{_speedup(figures['vs_compile'])} vs torch.compile, {_number(figures['pct_copy_roof'])}% of copy roof"
        )
    for result in report.results:
        if result.timing and result.timing.errors:
            for callee, error in result.timing.errors.items():
                console.print(Text("timing ", style="yellow") + Text(f"{result.case.label}: {callee}: {error}"))

    for result in report.results:
        if result.status == PASS:
            continue
        console.print(Text(result.status.upper(), style=_STATUS_STYLE[result.status]) + Text(f" {result.case.label}"))
        console.print(f"  repro: {result.repro}", markup=False, highlight=False)
        for check in result.failures:
            console.print(f"  {describe(check)}", markup=False, highlight=False)
    style = "green" if report.exit_status == 0 else "bold red"
    console.print(f"[{style}]{_verdict(report)}[/] (exit status {report.exit_status})")


def _by_op(report: Report) -> dict[str, list[CaseResult]]:
    grouped: dict[str, list[CaseResult]] = defaultdict(list)
    for result in report.results:
        grouped[result.case.op].append(result)
    return grouped


# ---------------------------------------------------------------------------------------------
# Linked pytest-benchmark results (tileproof oracle --benchmark-results)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchmarkEntry:
    """One benchmark of a pytest-benchmark results file, as a report shows it."""

    name: str  # the oracle case label (tests/test_gpu_benchmarks.py records it), else the test's name
    median_us: float  # pytest-benchmark's median time per call
    gbps: float | None  # the oracle's bytes model over that median, when the benchmark recorded it


@dataclasses.dataclass(frozen=True)
class BenchmarkSuite:
    """A pytest-benchmark results file (``pytest --benchmark-json``) that a report links to."""

    path: Path
    date: str | None  # when pytest-benchmark wrote it
    commit: str | None  # the git commit it recorded
    gpus: tuple[str, ...]  # the GPUs the benchmarks recorded (tests/test_gpu_benchmarks.py does)
    benchmarks: tuple[BenchmarkEntry, ...]

    def link(self, folder: Path | None = None) -> str:
        """The file's path relative to ``folder`` (a report's folder; default: the working directory)."""
        return Path(os.path.relpath(self.path.resolve(), (folder or Path.cwd()).resolve())).as_posix()

    def as_dict(self, folder: Path | None = None) -> dict:
        return {
            "path": self.link(folder),
            "date": self.date,
            "commit": self.commit,
            "gpus": list(self.gpus),
            "benchmarks": [dataclasses.asdict(entry) for entry in self.benchmarks],
        }


def load_benchmark_suite(path: Path) -> BenchmarkSuite:
    """Read a ``pytest --benchmark-json`` file; a ValueError says why when it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # missing, unreadable, not UTF-8 or not JSON
        raise ValueError(f"cannot read the benchmark results {path}: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise ValueError(f"{path} is not a pytest-benchmark JSON file (no list of benchmarks)")
    entries: list[BenchmarkEntry] = []
    gpus: list[str] = []
    for index, benchmark in enumerate(data["benchmarks"]):
        try:
            extra_info = benchmark.get("extra_info") or {}
            name = str(extra_info.get("case") or benchmark["name"])
            median_us = float(benchmark["stats"]["median"]) * 1e6
            gbps, gpu = extra_info.get("gbps"), extra_info.get("gpu")
        except (AttributeError, KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: benchmark {index} has no name or no median time") from None
        entries.append(BenchmarkEntry(name, median_us, float(gbps) if isinstance(gbps, (int, float)) else None))
        if gpu and str(gpu) not in gpus:
            gpus.append(str(gpu))
    commit_info = data.get("commit_info")
    date, commit = data.get("datetime"), commit_info.get("id") if isinstance(commit_info, dict) else None
    return BenchmarkSuite(
        path, str(date) if date else None, str(commit) if commit else None, tuple(gpus), tuple(entries)
    )


def _benchmark_suite_lines(suite: BenchmarkSuite, folder: Path | None) -> list[str]:
    """The Markdown section linking the suite's results file, with each benchmark's median."""
    link = suite.link(folder)
    provenance = [f"{len(suite.benchmarks)} benchmarks"]
    provenance += [f"run {suite.date}"] if suite.date else []
    provenance += [f"commit {suite.commit[:12]}"] if suite.commit else []
    provenance += [f"on {' and '.join(suite.gpus)}"] if suite.gpus else []
    lines = [
        "",
        "## Benchmark suite",
        "",
        f"Benchmark suite results: [{link}]({urllib.parse.quote(link)}) (pytest-benchmark; {', '.join(provenance)}).",
    ]
    if not suite.benchmarks:
        return lines
    lines += [
        "",
        "median µs: pytest-benchmark's median time per call. For `tests/test_gpu_benchmarks.py` that is "
        "back-to-back calls with a warm L2, each round ending when the GPU is idle (launch-bound where the "
        "host is slower than the kernel): not the oracle's kernel time with the L2 flushed. GB/s: the "
        "oracle's bytes model over that median.",
        "",
    ]
    rows = [[f"`{entry.name}`", _number(entry.median_us), _number(entry.gbps, 0)] for entry in suite.benchmarks]
    return lines + _table(["benchmark", "median µs", "GB/s"], rows, "lrr")


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def report_dict(report: Report, benchmark_suite: BenchmarkSuite | None = None, folder: Path | None = None) -> dict:
    """The report as JSON-able data. ``benchmark_suite``: pytest-benchmark results to link, by a
    path relative to ``folder`` (the report file's; default: the working directory)."""
    counts = report.counts()
    data = {
        "schema": SCHEMA,
        "environment": report.environment,
        "run": {
            "profile": report.profile,
            "seed": report.seed,
            "gpu": report.gpu,
            "compared": report.compared,
            "timing": report.timing,
            "ops": report.ops,
            "twin": report.twin,
            "sm_limit": report.sm_limit,
            "command": report.command,
            "notes": report.notes,
        },
        "summary": {
            "cases": len(report.results),
            "pass": counts[PASS],
            "fail": counts[FAIL],
            "error": counts[ERROR],
            "reference_only": counts[REFERENCE_ONLY],
            "reference_only_ops": [
                op for op, results in _by_op(report).items() if all(r.reference_only for r in results)
            ],
            "exit_status": report.exit_status,
            "geomean_speedups": _family_speedups(report),
        },
        "kernel_builds": [
            {"kernel": name, "seconds": seconds}
            for name, seconds in sorted(report.kernel_builds.items(), key=lambda item: -item[1])
        ],
        "policies": {op: p for op, p in policies().items() if op in report.ops},
        "reference_self_checks": SELF_CHECKS,
        "cases": [_case_dict(result) for result in report.results],
    }
    if benchmark_suite is not None:
        data["benchmark_suite"] = benchmark_suite.as_dict(folder)
    return data


def _case_dict(result: CaseResult) -> dict:
    case = result.case
    params = dataclasses.asdict(case.params) if dataclasses.is_dataclass(case.params) else case.params
    return {
        "op": case.op,
        "label": case.label,
        "title": case.title or None,
        "benchmark": case.benchmark,
        "params": params,
        "seed": result.seed,
        "status": result.status,
        "reference_only": result.reference_only or None,
        "repro": result.repro,
        "checks": [dataclasses.asdict(check) for check in result.checks],
        "timing": result.timing.as_dict() if result.timing else None,
    }


def write_json(report: Report, path: Path, benchmark_suite: BenchmarkSuite | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = report_dict(report, benchmark_suite, path.parent)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list], align: str | None = None) -> list[str]:
    align = align or "l" * len(header)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


SLOWEST_BUILDS_SHOWN = 10


def _overhead_lines(timed) -> list[str]:
    """How many timed workloads meet issue 8's warm-launch line, and the median overhead."""
    lines = []
    measures = (("Warm launch overhead", "overhead_us"), ("In a CUDA graph, the overhead", "graph_overhead_us"))
    for what, attribute in measures:
        overheads = [getattr(r.timing, attribute) for r in timed if getattr(r.timing, attribute) is not None]
        if not overheads:
            continue
        under = sum(overhead < LAUNCH_OVERHEAD_TARGET_US for overhead in overheads)
        lines += [
            "",
            f"{what} under {LAUNCH_OVERHEAD_TARGET_US:g} µs above the kernel time (issue 8's line): "
            f"{under} of {len(overheads)} timed workloads; median {statistics.median(overheads):.1f} µs, "
            f"largest {max(overheads):.1f} µs.",
        ]
    return lines


def _kernel_build_lines(builds: dict[str, float]) -> list[str]:
    """The kernel configurations' first calls: how many, their total and median, the slowest."""
    if not builds:
        return []
    seconds = sorted(builds.values())
    lines = [
        "",
        "## Kernel builds",
        "",
        f"{len(builds)} kernel configurations; first call (a TileLang build with a cold kernel cache, else a "
        f"load from it) {sum(seconds):.1f} s in all, median {statistics.median(seconds):.2f} s, slowest "
        f"{seconds[-1]:.2f} s (wall time in the compile pass's threads, waits for one another included).",
        "",
    ]
    slowest = sorted(builds.items(), key=lambda item: -item[1])[:SLOWEST_BUILDS_SHOWN]
    return lines + _table(["kernel configuration", "s"], [[f"`{name}`", f"{s:.2f}"] for name, s in slowest], "lr")


def markdown(report: Report, benchmark_suite: BenchmarkSuite | None = None, folder: Path | None = None) -> str:
    """The Markdown report. ``benchmark_suite``: pytest-benchmark results to link, by a path relative
    to ``folder`` (the report file's; default: the working directory)."""
    env = report.environment
    lines = [f"# tileproof oracle: `{report.profile}` profile", ""]
    lines += [f"**Result: {_verdict(report)}** (exit status {report.exit_status}) on {_device_text(report)}.", ""]
    if report.twin != OPTIMIZED.name:
        lines += [f"Checked against: {report.twin}.", ""]
    for note in report.notes:
        lines += [f"Note: {note}.", ""]
    lines += [f"Re-run: `{report.command}`", "", "## Environment", ""]
    rows = [[title, "—" if env.get(key) is None else env.get(key)] for key, title in ENVIRONMENT_ROWS]
    lines += _table(["item", "value"], rows)

    lines += ["", "## Comparison policy", ""]
    rows = []
    for op, outputs in policies().items():
        if op in report.ops:
            rows += [[f"`{op}`", f"`{name}`", p["rule"], p["why"]] for name, p in outputs.items()]
    lines += _table(["operator", "output", "rule", "why"], rows)
    lines += [
        "",
        "Every optimized output is also compared between two runs (bytes identical: determinism), the "
        "outputs start as 0xFF bytes so that unwritten elements show, and every input's storage (padding "
        "included) must be unchanged. Cases of at most 2^20 input elements also compare the reference "
        "run on the CPU with the reference run on the GPU.",
    ]
    if report.sm_limit:
        lines += [
            "",
            f"Grid-size independence: every optimized case ran once more with `TILEPROOF_SM_LIMIT={report.sm_limit}` "
            "and must give the same bytes as the unlimited run.",
        ]
    lines += ["", SELF_CHECKS]

    timed = _timed(report)
    if timed:
        roof = env.get("copy_roof_gbps")
        lines += [
            "",
            "## Timings",
            "",
            "µs: kernel time, the median over runs of the GPU durations of the kernels a call launched "
            "(CUPTI, L2 flushed before each run), as the issues' public baselines were measured; the "
            "eager and compile columns are measured the same way. stream µs: median of CUDA events "
            "around the optimized call (adds the event records and the gaps between a multi-kernel "
            f"operator's launches). GB/s counts the bytes the operator must read plus write, over the "
            f"kernel time; the roof is the device-to-device copy bandwidth, {roof:,.0f} GB/s. "
            "host µs: one warm optimized call's host time (median of single calls made while the GPU is busy). "
            "back-to-back µs: stream time per call of warm calls made back to back (no flush, no synchronization "
            "between them; CUDA events), launch-bound where the host is slower than the kernels. "
            "overhead µs: what those calls pay above their own kernel time (CUPTI, same loop; warm L2, "
            "so at most the flushed µs). "
            "graph overhead µs: the same with the call captured once in a CUDA graph and the graph replayed.",
            "",
        ]
        rows = []
        for result in timed:
            t = result.timing
            rows.append(
                [
                    f"`{result.case.op}`",
                    result.case.title or f"`{short_label(result)}`",
                    _number(t.optimized_us),
                    _number(t.optimized_stream_us),
                    _number(t.host_us),
                    _number(t.back_to_back_us),
                    _number(t.overhead_us),
                    _number(t.graph_overhead_us),
                    _number(t.gbps, 0),
                    _number(t.pct_roof),
                    _number(t.eager_us),
                    _number(t.compiled_us),
                    _speedup(t.speedup_eager),
                    _speedup(t.speedup_compiled),
                ]
            )
        header = ["operator", "workload", "µs", "stream µs", "host µs", "back-to-back µs", "overhead µs"]
        header += ["graph overhead µs", "GB/s", "% roof", "eager µs", "compile µs", "× eager", "× compile"]
        lines += _table(header, rows, "llrrrrrrrrrrrr")
        lines += _overhead_lines(timed)
        speedups = _family_speedups(report)
        if speedups:
            lines += ["", "Geometric means per family:", ""]
            lines += _table(
                ["family", "timed cases", "× eager", "× torch.compile", "% roof"],
                [
                    [f, s["cases"], _speedup(s["vs_eager"]), _speedup(s["vs_compile"]), _number(s["pct_copy_roof"])]
                    for f, s in speedups.items()
                ],
                "lrrrr",
            )
        errors = [(r.case.label, c, e) for r in timed for c, e in r.timing.errors.items()]
        if errors:
            lines += ["", "Timing notes:", ""] + [f"- `{label}` {callee}: {error}" for label, callee, error in errors]

    if benchmark_suite is not None:
        lines += _benchmark_suite_lines(benchmark_suite, folder)
    lines += _kernel_build_lines(report.kernel_builds)

    failing = [r for r in report.results if r.status != PASS]
    if failing:
        lines += ["", "## Failures", ""]
        for result in failing:
            lines += [f"### `{result.case.label}` ({result.status})", "", f"Repro: `{result.repro}`", ""]
            lines += [f"- {_cell(describe(c))}" for c in result.failures]
            lines += [""]

    lines += ["", "## By operator", ""]
    rows = []
    for op, results in _by_op(report).items():
        counts = outcome_counts(results)
        rows.append([f"`{op}`", len(results), *(counts[s] for s in (PASS, FAIL, ERROR, REFERENCE_ONLY))])
    lines += _table(["operator", "cases", "pass", "fail", "error", "reference only"], rows, "lrrrrr")

    lines += ["", f"<details><summary>All {len(report.results)} cases</summary>", ""]
    rows = [[f"`{r.case.op}`", f"`{short_label(r)}`", status_text(r), headline(r)] for r in report.results]
    lines += _table(["operator", "case", "status", "metric [bound]"], rows)
    lines += ["", "</details>", ""]
    return "\n".join(lines)


def write_markdown(report: Report, path: Path, benchmark_suite: BenchmarkSuite | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown(report, benchmark_suite, path.parent), encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------


def write_plot(report: Report, path: Path) -> None:
    """Per timed case: % of the copy roof (optimized, eager, compiled) and the speedups."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    timed = _timed(report)
    title = f"tileproof oracle, {report.profile} profile, {_device_text(report)}"
    if not timed:
        figure, axis = plt.subplots(figsize=(8, 2))
        axis.axis("off")
        why = "; ".join(report.notes) or "no timed cases in this selection"
        axis.text(0.5, 0.5, f"no timings: {why}", ha="center", va="center")
        figure.suptitle(title)
        figure.savefig(path, dpi=120)
        plt.close(figure)
        return

    names = [f"{r.case.op}: {r.case.title or short_label(r)}" for r in timed]
    height = 0.27
    rows = range(len(timed))
    figure, (roof_axis, speed_axis) = plt.subplots(
        1, 2, figsize=(15, 1.2 + 0.55 * len(timed)), sharey=True, gridspec_kw={"width_ratios": [3, 2]}
    )
    series = [("optimized", "tab:green", "optimized_us"), ("eager", "tab:gray", "eager_us")]
    series.append(("torch.compile", "tab:blue", "compiled_us"))
    for k, (name, color, attribute) in enumerate(series):
        values = []
        for result in timed:
            t = result.timing
            us = getattr(t, attribute)
            values.append(100.0 * t.bytes_moved / (us * 1e3) / t.roof_gbps if us else 0.0)
        roof_axis.barh([i + (k - 1) * height for i in rows], values, height, label=name, color=color)
    roof_axis.axvline(100, color="black", linewidth=0.8)
    roof_axis.set_xlabel(f"% of copy roof ({report.environment.get('copy_roof_gbps'):,.0f} GB/s)")
    roof_axis.set_yticks(list(rows), names)
    roof_axis.invert_yaxis()
    roof_axis.legend(loc="lower right", fontsize="small")
    # A missing speedup (a baseline that failed) is NaN: no bar, rather than a bar at 0 on a log axis.
    eager = [r.timing.speedup_eager or float("nan") for r in timed]
    compiled = [r.timing.speedup_compiled or float("nan") for r in timed]
    speed_axis.barh([i - height / 2 for i in rows], eager, height, label="vs eager", color="tab:gray")
    speed_axis.barh([i + height / 2 for i in rows], compiled, height, label="vs torch.compile", color="tab:blue")
    speed_axis.axvline(1, color="black", linewidth=0.8)
    speed_axis.set_xscale("log")
    speed_axis.set_xlabel("speedup of the optimized kernel (×, log scale)")
    speed_axis.legend(loc="lower right", fontsize="small")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

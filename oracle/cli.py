"""The ``tileproof`` command: ``tileproof oracle [options]`` runs the oracle; ``tileproof mutate
[options]`` runs its mutation self-test (planted bugs the oracle must flag; ``oracle.mutation``).

Environment variables:

- ``TILEPROOF_COPY_ROOF_GBPS``: the bandwidth roof of "% of roof", in GB/s (default 4217, the
  device-to-device copy bandwidth measured on the H200, bytes read plus bytes written).
- ``TILEPROOF_GIT_REVISION``: the commit recorded in reports when the code runs outside a git
  checkout (an installed copy on a GPU machine).
- ``TILEPROOF_CACHE_DIR`` and ``TILEPROOF_TARGET`` are read by ``tileproof.optimized.jit`` (TileLang's
  kernel cache; the compile target, sm_90a when there is no GPU).
- ``TILEPROOF_SM_LIMIT`` is read by ``tileproof.optimized.device.sm_count``; ``--sm-limit`` sets it
  for the grid-size independence re-runs only.

Exit status (``oracle``): 0 when every selected case passes (reference-only cases included); 1 when
any comparison disagrees or any check (reference, compile, optimized run) raises; 2 on a usage
error. (``mutate``): 0 when every mutant of a registered operator is killed, 1 when one survives, 2
on a usage error.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from . import launches, runner, sanitize
from .registry import PROFILES, Case, all_ops, select_cases
from .timing import copy_roof_gbps

if TYPE_CHECKING:
    from .report import BenchmarkSuite

DESCRIPTION = """\
Run every selected case of every selected operator through the reference twin and the optimized
twin. With a CUDA GPU: compare every output under the stated policy (bitwise for quantized data,
scales and dequantized values), check determinism, and time the benchmark workloads. Without one:
run the reference with its self-checks and compile every optimized kernel for sm_90a; GPU
comparisons and timings are reported as skipped. Operators without an optimized twin yet run
their reference and self-checks only ("reference only"). --backend checks another module's
functions instead (on the CPU when there is no GPU), --base the optimized kernels of another git
revision. Guide: docs/oracle.md."""

EPILOG = """\
examples:
  tileproof oracle --list
  tileproof oracle --op per_token_cast --no-timing
  tileproof oracle --profile full --json out/oracle.json --markdown docs/results/quant-h200.md --plot out/quant.png
  tileproof oracle --case 'per_token_cast/e2m1/*' --seed 7
  tileproof oracle --profile edge --no-timing            # NaN, ±Inf, ±max, subnormals, ... (docs/numerics.md)
  tileproof oracle --backend tile_kernels --no-timing     # another library against our references
  tileproof oracle --base HEAD~3 --op per_token_cast      # the optimized kernels of an older commit
  tileproof oracle --sm-limit 114                         # also prove results independent of the grid size
  tileproof oracle --profile full --markdown out/oracle.md --benchmark-results out/pytest-benchmark.json"""

PROFILE_HELP = "case tier: quick (default), full, or edge (numeric edge values in quick cases; docs/numerics.md)"

MUTATE_DESCRIPTION = """\
The oracle's self-test: every mutant of the catalogue (oracle/mutation.py) is the reference twin of
one operator with one planted bug (wrong rounding mode, missing clamp, wrong tie rule, wrong scale
layout stride, dropped eps, swapped transpose, zeroed gradient, unwritten tail, ...). Each mutant is
checked as a backend (the path of `tileproof oracle --backend`) over its operator's cases until one
case FAILs: the mutant is then killed. A mutant that survives every case means the oracle's cases or
policies would miss that bug. Mutants of operators that are not registered are listed as skipped."""


PRECOMPILE_DESCRIPTION = """\
Build every kernel configuration that the selected cases of the oracle need, as the oracle's compile
pass does, before a run that must not compile: a CUDA-graph capture cannot build or load a kernel
(the first call of a configuration inside a capture raises and says so). On a GPU machine the
kernels go into TileLang's cache (TILEPROOF_CACHE_DIR) for this GPU; without a GPU they are
compiled for TILEPROOF_TARGET (sm_90a by default) as a check, and nothing reusable is kept, unless
--cache asks for the whole kernels (host module included, about 250 KB each, slower: no batching)
in the cache, to copy to a GPU machine of that architecture with the same TileLang and CUDA. Exit
status 1 when a kernel fails to build."""


class UsageError(Exception):
    pass


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer seed, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer seed, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``tileproof`` parser (``parse_args(["oracle", ...])``)."""
    return _build_parsers()[0]


def _build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="tileproof", description="GPU kernels, each proven against a readable twin.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    oracle = commands.add_parser(
        "oracle",
        help="compare the optimized kernels with the reference twins, and time them",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    select = oracle.add_argument_group("selection")
    select.add_argument(
        "--op", action="append", metavar="NAME", help="operator to run (repeat, or comma-separate; default: all)"
    )
    select.add_argument("--profile", choices=PROFILES, default="quick", help=PROFILE_HELP)
    select.add_argument(
        "--case", action="append", metavar="LABEL", help="case label, exact or a shell glob (repeatable; see --list)"
    )
    select.add_argument("--max-cases", type=_positive_int, metavar="N", help="run at most N of the selected cases")
    select.add_argument("--seed", type=_seed, default=0, help="global seed; each case derives its own (default: 0)")
    select.add_argument("--list", action="store_true", help="list the selected cases and exit")
    run = oracle.add_argument_group("running")
    run.add_argument("--no-timing", action="store_true", help="skip timings (GPU only anyway)")
    run.add_argument("--no-torch-compile", action="store_true", help="time without the torch.compile baseline")
    run.add_argument(
        "--jobs", type=_positive_int, metavar="N", help="kernel-compile threads (default: CPU count, at most 16)"
    )
    run.add_argument("--no-compile", action="store_true", help="skip the compile pass (kernels compile when called)")
    run.add_argument(
        "--sm-limit",
        type=_non_negative_int,
        metavar="N",
        help="also re-run every optimized case with TILEPROOF_SM_LIMIT=N and require identical bytes "
        f"(GPU; default: {runner.FULL_PROFILE_SM_LIMIT} with --profile full, else off; 0: off)",
    )
    twins = run.add_mutually_exclusive_group()
    twins.add_argument(
        "--backend",
        metavar="MODULE",
        help="check the functions of an importable module (named like the operators) instead of the optimized "
        "kernels; operators it lacks are skipped; it runs on the CPU when there is no GPU",
    )
    twins.add_argument(
        "--base", metavar="REV", help="check the optimized kernels of another git revision (e.g. HEAD~1, a tag)"
    )
    out = oracle.add_argument_group("output")
    out.add_argument("--json", type=Path, metavar="PATH", help="write the machine-readable report")
    out.add_argument("--markdown", type=Path, metavar="PATH", help="write the human-readable report")
    out.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG of the timings (needs matplotlib)")
    out.add_argument(
        "--benchmark-results",
        type=Path,
        metavar="PATH",
        help="link a pytest-benchmark results file (pytest --benchmark-json, e.g. of tests/test_gpu_benchmarks.py) "
        "from the --json and --markdown reports, with each benchmark's median",
    )
    out.add_argument("-v", "--verbose", action="store_true", help="print every case, not only failures and timings")

    mutate = commands.add_parser(
        "mutate",
        help="mutation self-test: planted bugs the oracle must flag",
        description=MUTATE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mutate.add_argument("--op", action="append", metavar="NAME", help="only the mutants of this operator (repeatable)")
    mutate.add_argument(
        "--mutant", action="append", metavar="ID", help="only this mutant, 'operator:name' or a shell glob (repeatable)"
    )
    mutate.add_argument("--profile", choices=PROFILES, default="quick", help=PROFILE_HELP)
    mutate.add_argument("--seed", type=_seed, default=0, help="global seed; each case derives its own (default: 0)")
    mutate.add_argument(
        "--max-cases", type=_positive_int, metavar="N", help="try at most N cases per mutant (default: all, in order)"
    )
    mutate.add_argument("--list", action="store_true", help="list the catalogue and exit")
    mutate.add_argument(
        "--target",
        choices=("reference", "optimized"),
        default="reference",
        help="plant the bugs in the reference twin (default; CPU) or in the optimized kernels (needs a GPU)",
    )
    mutate.add_argument("--json", type=Path, metavar="PATH", help="write the machine-readable result")

    precompile = commands.add_parser(
        "precompile",
        help="build (or load) every kernel a selection of the oracle's cases needs",
        description=PRECOMPILE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    precompile.add_argument(
        "--op", action="append", metavar="NAME", help="operator (repeat, or comma-separate; default: all)"
    )
    precompile.add_argument("--profile", choices=PROFILES, default="quick", help=PROFILE_HELP)
    precompile.add_argument("--case", action="append", metavar="LABEL", help="case label or shell glob (repeatable)")
    precompile.add_argument(
        "-j", "--jobs", type=_positive_int, metavar="N", help="compile threads (default: CPUs, at most 16)"
    )
    precompile.add_argument(
        "--cache",
        action="store_true",
        help="without a GPU: keep the built kernels in the cache, for a GPU of the compile target",
    )
    sanitize.add_parser(commands)
    launches.add_parser(commands)
    return parser, oracle, mutate


def selected_ops(requested: Sequence[str] | None) -> list[str] | None:
    """``--op`` values (repeated or comma-separated), checked against the registry."""
    if not requested:
        return None
    names = [name.strip() for value in requested for name in value.split(",") if name.strip()]
    known = all_ops()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise UsageError(f"unknown operator {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    return list(dict.fromkeys(names))


def select(args: argparse.Namespace) -> list[Case]:
    """The cases an ``oracle`` command line selects (a UsageError when none does)."""
    cases = select_cases(args.profile, selected_ops(args.op), args.case, args.max_cases)
    if not cases:
        raise UsageError(f"no case of the {args.profile} profile matches {args.case}; see --list")
    return cases


class _Progress(runner.Progress):
    def __init__(self, bar: RichProgress):
        self.bar = bar
        self.task = None

    def stage(self, name: str, total: int) -> None:
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(name, total=total, detail="")

    def advance(self, detail: str = "") -> None:
        self.bar.update(self.task, advance=1, detail=detail)


def _progress_bar(console: Console) -> RichProgress:
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[detail]}", style="dim"),
    )
    return RichProgress(*columns, console=console, transient=True, disable=not console.is_terminal)


def _console() -> Console:
    console = Console()
    # Not a terminal (CI logs, files): use a wide table rather than rich's 80-column default.
    return console if console.is_terminal else Console(width=200)


def sm_limit_of(args: argparse.Namespace) -> int | None:
    """``--sm-limit`` (0: off), defaulting to the full profile's limit."""
    if args.sm_limit is None:
        return runner.FULL_PROFILE_SM_LIMIT if args.profile == "full" else None
    return args.sm_limit or None


def twin_of(args: argparse.Namespace) -> runner.Twin:
    """The twin ``--backend`` / ``--base`` name (default: the optimized kernels); a ValueError when
    the module does not import or the revision does not exist."""
    if args.backend:
        return runner.backend_twin(args.backend)
    if args.base:
        return runner.base_twin(args.base)
    return runner.OPTIMIZED


def benchmark_suite_of(args: argparse.Namespace) -> BenchmarkSuite | None:
    """The pytest-benchmark results ``--benchmark-results`` names (None without it), read before the
    run so that a wrong path or file is a usage error rather than a failure after a long run."""
    if args.benchmark_results is None:
        return None
    if not (args.json or args.markdown):
        raise UsageError("--benchmark-results is linked from the reports: give --json or --markdown too")
    from .report import load_benchmark_suite

    return load_benchmark_suite(args.benchmark_results)


def main(argv: Sequence[str] | None = None) -> int:
    parser, oracle_parser, mutate_parser = _build_parsers()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # argparse exits on errors (2) and on --help (0)
        return stop.code if isinstance(stop.code, int) else 2
    if args.command == "mutate":
        return _mutate(args, mutate_parser)
    if args.command == "precompile":
        return _precompile(args)
    if args.command == "sanitize":
        return sanitize.main_from_args(args)
    if args.command == "launches":
        return launches.main_from_args(args)
    try:
        cases = select(args)
        copy_roof_gbps()  # a malformed TILEPROOF_COPY_ROOF_GBPS is a usage error, found before the run
        if args.plot:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
        twin = None if args.list else twin_of(args)
        benchmark_suite = None if args.list else benchmark_suite_of(args)
    except (UsageError, ValueError) as error:
        oracle_parser.print_usage(sys.stderr)
        print(f"tileproof oracle: error: {error}", file=sys.stderr)
        return 2

    if args.list:
        try:
            for case in cases:
                print(case.label + (f"    [benchmark: {case.title}]" if case.benchmark else ""))
        except BrokenPipeError:  # `tileproof oracle --list | head`
            sys.stderr.close()
        return 0

    console = _console()
    with _progress_bar(console) as bar:
        report = runner.run(
            args.profile,
            ops=selected_ops(args.op),
            patterns=args.case,
            max_cases=args.max_cases,
            seed=args.seed,
            timing=not args.no_timing,
            torch_compile=not args.no_torch_compile,
            workers=args.jobs,
            progress=_Progress(bar),
            twin=twin,
            sm_limit=sm_limit_of(args),
            compile=not args.no_compile,
        )

    from . import report as reporting  # rich tables, JSON, Markdown; matplotlib only in write_plot

    reporting.print_report(report, console, verbose=args.verbose)
    for path, write in ((args.json, reporting.write_json), (args.markdown, reporting.write_markdown)):
        if path:
            write(report, path, benchmark_suite)
            console.print(f"wrote {path}", highlight=False)
    if args.plot:
        reporting.write_plot(report, args.plot)
        console.print(f"wrote {args.plot}", highlight=False)
    return report.exit_status


def _precompile(args: argparse.Namespace) -> int:
    """``tileproof precompile``: the oracle's compile pass over the selected cases."""
    from tileproof.optimized import jit

    try:
        ops = selected_ops(args.op)
        cases = select_cases(args.profile, ops, args.case)
    except (UsageError, ValueError) as error:
        print(f"tileproof precompile: error: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    before = set(jit.kernel_first_calls())
    failures = runner.compile_all(args.profile, ops, args.case, workers=args.jobs, cache=args.cache)
    seconds = time.perf_counter() - started
    if torch.cuda.is_available() or args.cache:
        built = len(set(jit.kernel_first_calls()) - before)
        where = "this GPU" if torch.cuda.is_available() else jit.compile_target()["arch"]
        done = f"{built} kernel configurations built or loaded into the cache for {where}"
    else:
        done = f"their kernels compiled for {jit.compile_target()['arch']} (a check: no GPU, nothing cached)"
    print(f"{len(cases)} cases: {done} in {seconds:.0f} s; {len(failures)} failed")
    for failure in failures:
        print(f"FAIL {failure.label}: {failure.error}")
    return 1 if failures else 0


def _mutate(args: argparse.Namespace, mutate_parser: argparse.ArgumentParser) -> int:
    """``tileproof mutate``: the mutation self-test (see ``oracle.mutation``)."""
    from . import mutation

    try:
        ops = [name.strip() for value in args.op or [] for name in value.split(",") if name.strip()]
        known = set(all_ops()) | {m.op for m in mutation.CATALOGUE}
        unknown = [name for name in ops if name not in known]
        if unknown:
            raise UsageError(f"no operator or mutant named {', '.join(map(repr, unknown))}; see --list")
        chosen = mutation.select_mutants(ops, args.mutant)
        if not chosen:
            raise UsageError(f"no mutant matches --op {args.op} --mutant {args.mutant}; see --list")
        if args.target == "optimized" and not torch.cuda.is_available():
            raise UsageError("--target optimized plants the bugs in the optimized kernels: it needs a CUDA GPU")
    except (UsageError, ValueError) as error:
        mutate_parser.print_usage(sys.stderr)
        print(f"tileproof mutate: error: {error}", file=sys.stderr)
        return 2
    if args.list:
        try:
            for mutant in chosen:
                print(f"{mutant.id}    [{mutant.family}] {mutant.bug}")
        except BrokenPipeError:
            sys.stderr.close()
        return 0
    console = _console()
    with _progress_bar(console) as bar:
        result = mutation.run_mutants(
            chosen,
            profile=args.profile,
            seed=args.seed,
            max_cases=args.max_cases,
            target=args.target,
            progress=_Progress(bar),
        )
    mutation.print_result(result, console)
    if args.json:
        mutation.write_json(result, args.json)
        console.print(f"wrote {args.json}", highlight=False)
    return result.exit_status


if __name__ == "__main__":
    sys.exit(main())

"""``tileproof sanitize``: the oracle under NVIDIA's compute-sanitizer (memcheck, racecheck, ...).

The oracle runs its cases (``--no-timing``) inside ``compute-sanitizer --tool TOOL``, which
instruments every TileLang kernel it launches and reports bad global or shared memory accesses
(memcheck) or shared-memory hazards between threads (racecheck). Three choices make the run both
affordable and sharp:

- **Only our kernels are instrumented** (``--kernel-name kns=kernel_kernel``: every TileLang
  entry point is named after its ``prim_func``, ``kernel``). PyTorch's own kernels (the reference
  twin on the GPU, allocation fills) run at full speed, so the quick profile takes minutes.
- **No caching allocator** (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``): every tensor is its own
  ``cudaMalloc``, so a read or write past a tensor's end leaves its allocation and memcheck sees
  it; inside PyTorch's pooled segments it would land in a neighbour and pass unnoticed.
- **A planted bug first**: before the real run, a small TileLang kernel with a known defect (a
  store past its buffer for memcheck, a shared-memory read of another warp's element without a
  barrier for racecheck; TileLang's own guards against both are switched off for it) runs under the
  same command line, and the sanitizer must report it. A filter that matched nothing, or a tool
  that cannot instrument on this machine, would otherwise give a clean log that proves nothing.

The sanitizer's log is written exactly as the tool wrote it (``--log``); ``--markdown`` adds a
summary with the GPU, the versions, the date, the command, the planted bug's result and the error
summary. Exit status: 0 when the plant was caught and the run had no error and every case passed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

TOOLS = ("memcheck", "racecheck")
# Every TileLang kernel entry point is ``<prim_func name>_kernel``; ours are all named ``kernel``
# (``persistent_kernel_kernel`` contains it too). ``kns``: the name contains this substring.
KERNEL_FILTER = "kns=kernel_kernel"
ERROR_EXIT_CODE = 86  # the sanitizer's exit status when it reported an error (--error-exitcode)
_SUMMARY = re.compile(r"(?:ERROR SUMMARY|RACECHECK SUMMARY):.*")


def sanitizer_command(tool: str, log: Path | None = None) -> list[str]:
    """The compute-sanitizer prefix for ``tool``; every run (plant and oracle) uses exactly this."""
    command = ["compute-sanitizer", "--tool", tool, "--kernel-name", KERNEL_FILTER]
    command += ["--error-exitcode", str(ERROR_EXIT_CODE)]
    if log is not None:
        command += ["--log-file", str(log)]
    return command


def sanitizer_environment() -> dict[str, str]:
    return {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}


# ---------------------------------------------------------------------------------------------
# Planted bugs (run in a child process, under the sanitizer)
# ---------------------------------------------------------------------------------------------

PLANT_ELEMENTS = 256
PLANT_THREADS = 128


def _planted_kernel(tool: str):
    import tilelang
    import tilelang.language as T

    if tool == "memcheck":
        # 32 threads store at [n - 16, n + 16): the upper half lands past the buffer.
        @T.prim_func
        def kernel(x: T.Tensor((PLANT_ELEMENTS,), "float32")):
            with T.Kernel(1, threads=32):
                tx = T.get_thread_binding()
                x[tx + PLANT_ELEMENTS - 16] = 1.0

        guard = tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS
    else:
        # Thread t reads the shared element thread 127 - t (another warp) wrote, with no barrier.
        @T.prim_func
        def kernel(x: T.Tensor((PLANT_ELEMENTS,), "float32")):
            with T.Kernel(1, threads=PLANT_THREADS):
                tx = T.get_thread_binding()
                staged = T.alloc_shared((PLANT_THREADS,), "float32")
                staged[tx] = x[tx]
                x[tx] = staged[PLANT_THREADS - 1 - tx]

        guard = tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC
    return tilelang.compile(kernel, pass_configs={guard: True})


def run_plant(tool: str) -> None:
    """Launch the planted kernel for ``tool`` once (the parent checks that the sanitizer saw it)."""
    import torch

    # The memcheck plant writes up to 16 floats past the tensor: a separate cudaMalloc of exactly
    # PLANT_ELEMENTS floats (the caching allocator is off under the sanitizer's environment).
    x = torch.arange(PLANT_ELEMENTS, dtype=torch.float32, device="cuda")
    _planted_kernel(tool)(x)
    torch.cuda.synchronize()
    print(f"planted {tool} kernel ran")


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def _summary_line(text: str) -> str:
    """The sanitizer's last summary line (``ERROR SUMMARY: 0 errors``, ``RACECHECK SUMMARY: ...``)."""
    found = _SUMMARY.findall(text)
    return found[-1] if found else "(no summary line: the sanitizer did not finish)"


def _sanitizer_version() -> str:
    result = subprocess.run(["compute-sanitizer", "--version"], capture_output=True, text=True, check=False)
    lines = result.stdout.strip().splitlines()
    return lines[-1] if lines else "?"


def sanitize(tool: str, oracle_args: Sequence[str], log: Path, markdown: Path | None) -> int:
    if shutil.which("compute-sanitizer") is None:
        print("tileproof sanitize: compute-sanitizer is not on PATH (it ships with the CUDA toolkit)", file=sys.stderr)
        return 2
    environment = sanitizer_environment()
    python = [sys.executable, "-m"]

    plant = subprocess.run(
        sanitizer_command(tool) + python + ["tileproof.oracle.sanitize", "--plant", tool],
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    plant_caught = plant.returncode == ERROR_EXIT_CODE
    plant_result = f"{'caught' if plant_caught else 'NOT caught'}: {_summary_line(plant.stdout + plant.stderr)}"
    print(f"planted {tool} bug: {plant_result}")
    if not plant_caught:
        print(plant.stdout[-4000:] + plant.stderr[-4000:], file=sys.stderr)

    oracle_command = python + ["tileproof.oracle.cli", "oracle", "--no-timing", *oracle_args]
    log.parent.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    run = subprocess.run(sanitizer_command(tool, log) + oracle_command, env=environment, check=False)
    summary = _summary_line(log.read_text() if log.exists() else "")
    print(f"{tool} over the oracle: {summary} (sanitizer exit status {run.returncode}; log {log})")

    if markdown is not None:
        from .runner import environment  # the oracle reports' own header: GPU, versions, revision

        env = environment("(see the command)", 0, jit_module=None)
        command = " ".join(["tileproof", "oracle", "--no-timing", *oracle_args])
        lines = [
            f"# compute-sanitizer {tool} over the oracle",
            "",
            f"- date: {started.isoformat(timespec='seconds')}",
            f"- GPU: {env['gpu'] or 'no CUDA GPU'}",
            f"- versions: torch {env['torch']}, tilelang {env['tilelang']}, {_sanitizer_version()}",
            f"- git revision: {env['git_revision'] or 'unknown'}",
            f"- command: `{' '.join(sanitizer_command(tool, log))} {command}` with PYTORCH_NO_CUDA_MEMORY_CACHING=1",
            f"- planted {tool} bug (must be caught): {plant_result}",
            f"- sanitizer summary: **{summary}**; sanitizer exit status {run.returncode}; raw log: `{log.name}`",
        ]
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text("\n".join(lines) + "\n")
        print(f"wrote {markdown}")
    return 0 if plant_caught and run.returncode == 0 else 1


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "sanitize",
        help="run the oracle under compute-sanitizer (memcheck or racecheck), after a planted bug it must catch",
        description=__doc__.split("\n\n", 1)[0],
    )
    parser.add_argument("--tool", choices=TOOLS, default="memcheck", help="the sanitizer's tool (default: memcheck)")
    parser.add_argument("--log", type=Path, required=True, metavar="PATH", help="the sanitizer's own log file")
    parser.add_argument("--markdown", type=Path, metavar="PATH", help="write a summary with versions and date")
    parser.add_argument(
        "oracle_args",
        nargs=argparse.REMAINDER,
        metavar="-- ORACLE ARGS",
        help="arguments for `tileproof oracle` (e.g. -- --profile quick --json report.json)",
    )
    return parser


def main_from_args(args: argparse.Namespace) -> int:
    oracle_args = list(args.oracle_args)
    if oracle_args[:1] == ["--"]:
        oracle_args = oracle_args[1:]
    return sanitize(args.tool, oracle_args, args.log, args.markdown)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--plant" and sys.argv[2] in TOOLS:
        run_plant(sys.argv[2])
    else:
        print("usage: python -m tileproof.oracle.sanitize --plant {memcheck,racecheck}", file=sys.stderr)
        sys.exit(2)

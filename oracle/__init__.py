"""The oracle: runs the reference and optimized twins side by side, compares, times, reports.

Modules: ``registry`` (operator specs, cases, seeds), ``policy`` (the comparison policy),
``quant`` (the quantization family's specs), ``runner`` (twins, compile pass, checks, timings),
``timing`` (kernel-time medians from CUPTI, CUDA-event stream times, the copy roof), ``report``
(console, JSON, Markdown, PNG), ``mutation`` (the self-test: planted bugs the oracle must flag)
and ``cli`` (``tileproof oracle``, ``tileproof mutate``). The twins never import the oracle. Guide: docs/oracle.md.

For tests and scripts::

    from tileproof.oracle import backend_twin, compile_all, run
    failures = compile_all("quick")   # every kernel configuration compiles (no GPU needed)
    report = run("quick", ops=["per_token_cast"], timing=False)
    report = run("quick", twin=backend_twin("my_kernels"))   # another library against the references
"""

from .registry import all_ops, case_seed, select_cases
from .runner import OPTIMIZED, Twin, backend_twin, base_twin, compile_all, run

__all__ = [
    "OPTIMIZED",
    "Twin",
    "all_ops",
    "backend_twin",
    "base_twin",
    "case_seed",
    "compile_all",
    "run",
    "select_cases",
]

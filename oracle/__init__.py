"""The oracle: runs the reference and optimized twins side by side, compares, times, reports.

Modules: ``registry`` (operator specs, cases, seeds), ``policy`` (the comparison policy),
``quant`` (the quantization family's specs), ``runner`` (compile pass, checks, timings),
``timing`` (CUDA-event medians, the copy roof), ``report`` (console, JSON, Markdown, PNG) and
``cli`` (``tileproof oracle``). The twins never import the oracle.

For tests and scripts::

    from tileproof.oracle import compile_all, run
    failures = compile_all("quick")   # every kernel configuration compiles (no GPU needed)
    report = run("quick", ops=["per_token_cast"], timing=False)
"""

from .registry import all_ops, case_seed, select_cases
from .runner import compile_all, run

__all__ = ["all_ops", "case_seed", "compile_all", "run", "select_cases"]

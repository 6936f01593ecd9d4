"""The number of SMs a kernel may size its grid by, and the oracle's way of lowering it.

A kernel whose grid depends on the SM count (a persistent kernel with one CTA per SM, a split of
partial sums over SMs) asks ``sm_count(device)`` instead of reading the device properties itself.
``TILEPROOF_SM_LIMIT=N`` caps the answer at N, so that the oracle can re-run every case with fewer
SMs (``tileproof oracle --sm-limit 114``: an H100 PCIe's count, not a multiple of 4) and require
bit-identical results: the contract makes every result independent of the grid size.
"""

import os

import torch

SM_LIMIT_ENV = "TILEPROOF_SM_LIMIT"
# Without a GPU (compile-only passes) kernels are built for the H200 / H100 SXM: 132 SMs.
SM_COUNT_WITHOUT_GPU = 132
# The most shared memory one CTA may use on sm_90 (and sm_100): kernels that size their shared
# buffers by the shape check their plan against it.
SHARED_MEMORY_BYTES = 227 * 1024


def sm_limit() -> int | None:
    """``TILEPROOF_SM_LIMIT`` as a positive int, or None when it is unset or empty."""
    raw = os.environ.get(SM_LIMIT_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{SM_LIMIT_ENV} must be a positive integer number of SMs, got {raw!r}")
    return value


def sm_count(device=None) -> int:
    """The SMs a kernel on ``device`` may use: the device's multiprocessor count, at most
    ``TILEPROOF_SM_LIMIT``. ``device``: a ``torch.device``, an index or None (the current CUDA
    device); a CPU device, or no CUDA at all, gives ``SM_COUNT_WITHOUT_GPU`` (capped the same way)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda":
        available = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        available = SM_COUNT_WITHOUT_GPU
    limit = sm_limit()
    return available if limit is None else min(limit, available)

"""TileLang plumbing shared by every kernel: compile target, kernel cache, pass configuration.

Environment variables (all listed in the README):

- ``TILEPROOF_TARGET``: the TileLang target to compile for, as JSON (``{"kind": "cuda", "arch":
  "sm_90a"}``) or an arch name (``sm_90a``, ``sm_100a``). Default: the current GPU's arch (``sm_90a``
  on Hopper, ``sm_100a`` on Blackwell); ``sm_90a`` when there is no GPU, so that a CPU machine still
  compiles every kernel to a cubin.
- ``TILEPROOF_CACHE_DIR``: TileLang's kernel cache (sets ``TILELANG_CACHE_DIR``); default
  ``~/.cache/tileproof/tilelang``.
"""

from __future__ import annotations

import json
import os
import threading
from contextlib import contextmanager
from functools import cache
from pathlib import Path

_DEFAULT_CACHE = Path.home() / ".cache" / "tileproof" / "tilelang"

# TileLang reads its cache location when it is imported: set it before anything imports tilelang.
os.environ.setdefault("TILELANG_CACHE_DIR", os.environ.get("TILEPROOF_CACHE_DIR", str(_DEFAULT_CACHE)))
os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
if "CUDA_HOME" not in os.environ and Path("/usr/local/cuda").exists():
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import tilelang  # noqa: E402
import torch  # noqa: E402

# Our kernels are hand-scheduled loads and stores that mask their own tails (per 16-byte vector):
# TileLang's per-element bound checks would split every vector access into scalar ones. Warp
# specialization is not used by these memory-bound kernels.
PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True,
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
}


def _arch_of_current_gpu() -> str | None:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    if major == 9:
        return "sm_90a"
    if major == 10:
        return "sm_100a"
    return f"sm_{major}{minor}"


@cache
def compile_target() -> dict:
    """The TileLang target dict every kernel factory compiles for."""
    configured = os.environ.get("TILEPROOF_TARGET", "").strip()
    if configured.startswith("{"):
        return json.loads(configured)
    arch = configured or _arch_of_current_gpu() or "sm_90a"
    return {"kind": "cuda", "arch": arch}


def jit(**kwargs):
    """``tilelang.jit`` with the project's target and pass configuration."""
    return tilelang.jit(target=compile_target(), pass_configs=PASS_CONFIGS, **kwargs)


def gpu_available() -> bool:
    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------
# Hooks for the oracle: compile without launching, and poisoned outputs
# ---------------------------------------------------------------------------------------------

_state = threading.local()


@contextmanager
def compile_only():
    """Inside this context an optimized op validates its arguments and compiles (or loads from
    the cache) every kernel the call needs, then returns its unwritten outputs without launching.
    Inputs may live on the CPU. This is how a machine without a GPU proves that kernels build."""
    previous = getattr(_state, "compile_only", False)
    _state.compile_only = True
    try:
        yield
    finally:
        _state.compile_only = previous


def compiling_only() -> bool:
    return getattr(_state, "compile_only", False)


@contextmanager
def poison_outputs():
    """Inside this context every output an optimized op allocates starts filled with 0xFF bytes
    (NaN for floats and e4m3, -1 for integers), so an element the kernel never wrote shows up."""
    previous = getattr(_state, "poison", False)
    _state.poison = True
    try:
        yield
    finally:
        _state.poison = previous


def new_output(tensor: torch.Tensor) -> torch.Tensor:
    """Launchers pass each freshly allocated output through here (poisoning it when asked)."""
    if getattr(_state, "poison", False) and tensor.numel() > 0:
        flat_view(tensor).view(torch.uint8).fill_(0xFF)
    return tensor


def flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view from the tensor's first element to its last. Kernels take tensors flat, with
    their strides as runtime scalars counted in vectors, which lets TileLang prove alignment."""
    if tensor.numel() == 0:
        return tensor.reshape(0)
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.as_strided((span,), (1,))


def require_cuda(name: str, tensor: torch.Tensor) -> None:
    """Optimized ops run on CUDA tensors only (except under ``compile_only``)."""
    if tensor.device.type != "cuda" and not compiling_only():
        raise ValueError(f"{name} must be a CUDA tensor for the optimized kernels, got device {tensor.device}")

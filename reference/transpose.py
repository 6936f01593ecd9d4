"""Reference twin of the transpose family (contract §3): the executable specification.

A transpose moves elements; it never computes with them. The rules:

- Any dtype is accepted (float8_e4m3fn, bf16, fp32, integers, bool, ...). The reference reads the
  input as integer words of the element's width (two 8-byte words for complex128) and copies those,
  so the output is bit-for-bit the input (NaN payloads, signed zeros and FP8 codes included): there
  is no dtype conversion anywhere.
- Any shape is accepted, tails included: ``M`` and ``N`` need not be multiples of 64 (or of
  anything); empty and single-row/column inputs are fine.
- The input must have unit stride along its last dimension ``N`` (when ``N > 1``); the row stride
  may exceed ``N`` (a slice of a wider buffer), and in the batched form the batch stride is free.
- The output is a fresh, contiguous tensor of the input's dtype on the input's device; it never
  aliases the input.
"""

from __future__ import annotations

import torch
from einops import rearrange

from .contract import check_tensor

__all__ = ["transpose", "batched_transpose"]


def check_transpose_input(name: str, x, ndim: int) -> torch.Tensor:
    check_tensor(name, x, ndim=ndim)
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(
            f"{name} must have unit stride in its last dimension (a row stride larger than the row is "
            f"fine), got strides {tuple(x.stride())}; call .contiguous() first"
        )
    return x


# Unsigned/signed integer dtypes used as opaque storage words of 1, 2, 4 and 8 bytes.
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _word_dtype(dtype: torch.dtype) -> torch.dtype:
    """The widest integer word (≤ 8 bytes) whose width divides the element size of ``dtype``."""
    size = dtype.itemsize
    return next(_WORDS[w] for w in (8, 4, 2, 1) if size % w == 0)


def _as_words(x: torch.Tensor) -> torch.Tensor:
    """``[..., N]`` of any dtype → integer words ``[..., N · s]``: the same memory, reinterpreted.

    ``s`` words make one element (``s == 1`` for every dtype up to 8 bytes, 2 for complex128).
    Integer copies move bit patterns exactly, so nothing downstream can alter a value.
    """
    if x.shape[-1] <= 1:
        # The stride of a dimension of size 0 or 1 never addresses memory; normalise it to 1 so that
        # reinterpreting the dtype is allowed whatever the caller's stride there was.
        x = x.as_strided(x.shape, (*x.stride()[:-1], 1))
    return x.view(_word_dtype(x.dtype))


def batched_transpose(x: torch.Tensor) -> torch.Tensor:
    """Swap the last two dimensions of a batch of matrices: ``out[b, j, i] = x[b, i, j]``.

    Args:
        x: ``[B, M, N]``, any dtype, any device; unit stride along ``N`` (when ``N > 1``), any row
            stride (may exceed ``N``) and any batch stride.

    Returns:
        ``[B, N, M]``, same dtype and device, contiguous (strides ``(N·M, M, 1)``), bitwise equal to
        ``x.transpose(1, 2)``.
    """
    check_transpose_input("x", x, 3)
    batches, rows, cols = x.shape
    words = x.element_size() // _word_dtype(x.dtype).itemsize

    # Each element is a group of `words` integer words: swap the row and column axes, keep the
    # groups whole, and copy word for word into the contiguous output.
    out = torch.empty((batches, cols, rows), dtype=x.dtype, device=x.device)
    source = rearrange(_as_words(x), "b m (n s) -> b n m s", n=cols, s=words)
    destination = rearrange(_as_words(out), "b n (m s) -> b n m s", m=rows, s=words)
    destination.copy_(source)
    return out


def transpose(x: torch.Tensor) -> torch.Tensor:
    """Transpose one matrix: ``out[j, i] = x[i, j]``.

    Args:
        x: ``[M, N]``, any dtype, any device; unit stride along ``N`` (when ``N > 1``), any row stride
            (may exceed ``N``).

    Returns:
        ``[N, M]``, same dtype and device, contiguous (strides ``(M, 1)``), bitwise equal to ``x.T``.
    """
    check_transpose_input("x", x, 2)
    return batched_transpose(x.unsqueeze(0)).squeeze(0)

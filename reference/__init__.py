"""Readable PyTorch twins of every operator: the executable specification (CPU and GPU)."""

from . import engram, moe, quant, transpose

__all__ = ["engram", "moe", "quant", "transpose"]

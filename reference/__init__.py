"""Readable PyTorch twins of every operator: the executable specification (CPU and GPU)."""

from . import engram, mhc, moe, quant, quant_blocks, transpose

__all__ = ["engram", "mhc", "moe", "quant", "quant_blocks", "transpose"]

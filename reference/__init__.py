"""Readable PyTorch twins of every operator: the executable specification (CPU and GPU)."""

from . import quant

__all__ = ["quant"]

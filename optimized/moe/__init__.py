"""Optimized twin of the MoE gating and routing family (contract §2): TileLang kernels for sm_90a / sm_100.

Same public names, argument order and results as ``tileproof.reference.moe`` (integer outputs bit
for bit, float outputs as each function states). Three modules: ``router`` (the top-k rankers and
the full router), ``mapping`` (index bookkeeping: counts, masks, the token→expert layout) and
``fused`` (moving rows into and out of the expert-major layout).
"""

from . import fused, mapping, router
from .fused import *  # noqa: F403
from .mapping import *  # noqa: F403
from .router import *  # noqa: F403

__all__ = [*router.__all__, *mapping.__all__, *fused.__all__]

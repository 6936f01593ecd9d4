"""Optimized twin of the quantization family (contract §1): TileLang kernels for sm_90a / sm_100.

Same public names, argument order and results (bit for bit) as ``tileproof.reference.quant``.
"""

from .blocks import per_block_cast, per_block_cast_with_precomputed_sf, per_block_cast_with_sf_only, per_channel_cast
from .channel import per_channel_cast_and_transpose, per_channel_cast_fused
from .dequantize import cast_back, per_token_cast_back
from .lossless import per_block_cast_lossless
from .per_token import per_token_cast, per_token_cast_with_precomputed_sf, per_token_cast_with_sf_only
from .swiglu import (
    swiglu_backward_and_per_token_cast,
    swiglu_forward_and_per_channel_cast_and_transpose,
    swiglu_forward_and_per_token_cast,
)

__all__ = [
    "per_token_cast",
    "per_token_cast_with_sf_only",
    "per_token_cast_with_precomputed_sf",
    "per_token_cast_back",
    "cast_back",
    "per_block_cast",
    "per_block_cast_with_sf_only",
    "per_block_cast_with_precomputed_sf",
    "per_channel_cast",
    "per_channel_cast_fused",
    "per_channel_cast_and_transpose",
    "swiglu_forward_and_per_token_cast",
    "swiglu_forward_and_per_channel_cast_and_transpose",
    "swiglu_backward_and_per_token_cast",
    "per_block_cast_lossless",
]

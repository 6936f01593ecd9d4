"""TileLang kernels for Hopper (sm_90a), also targeting Blackwell (sm_100): the optimized twins.

Importing a family (``tileproof.optimized.quant``) imports TileLang; a GPU is needed only to
launch. Nothing here calls a reference implementation to compute a result.
"""

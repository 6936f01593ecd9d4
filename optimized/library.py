"""The optimized operators as PyTorch custom operators: ``torch.ops.tileproof.<name>``.

Importing this module registers every public optimized operator with ``torch.library.custom_op``:
the real implementation is the operator's launcher (``OPERATORS``) or a thin adapter that calls it
(``ADAPTED``), and the fake implementation (what ``torch.compile``, ``torch.export`` and
``FakeTensorMode`` run) is that same function under ``outputs_only``: argument checks and output
allocation on fake or meta tensors, no kernel built or launched, so the fake outputs cannot drift
from the real ones (``tests/test_optimized_shapes.py`` checks them against the reference on every
quick case).

An adapter stands in for a launcher whose signature PyTorch's schema language does not express; it
re-shapes arguments and results only (no check, no kernel of its own), and its docstring states the
mapping. The rules:

- a ``(data, sf)`` pair ``x`` becomes two tensors: ``x, x_sf`` in its place where the launcher
  always takes a pair; ``x`` plus a trailing ``x_sf=None`` where it also takes a plain tensor, so
  that a plain call reads as the launcher's;
- a block size is an int list (the schema has no tuples), handed to the launcher as a tuple;
- an output the launcher returns as None is an empty fp32 ``[0]`` tensor; a nested pair of outputs
  is flattened in its place;
- an in-place operator that returns its argument returns nothing (an output may not alias an input);
- a keyword-only tensor becomes an ordinary argument (custom ops take no keyword-only tensors);
- ``get_fused_mapping`` is registered in its no-sync form only (see its adapter).

Two operators write an optional tensor in place (``swiglu_forward_and_per_token_cast``'s
``clamped_count``, ``top2_sum_gate``'s ``unmapped_topk_idx``); they are defined through
``torch.library.define`` / ``impl`` / ``register_fake`` rather than ``custom_op`` (see ``_register``),
with the same schema and behaviour.

The plain functions (``tileproof.optimized.mhc.mhc_post``, ...) stay the eager API: the dispatcher
adds host time to every call, which an eager caller need not pay. The layers of
``tileproof.optimized.modeling`` compose these operators and are not operators themselves.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

import torch

from . import engram, mhc_fuse, mhc_norm
from .jit import outputs_only
from .moe import fused, mapping
from .quant import blocks, channel, dequantize, e5m6, lossless, per_token, swiglu

NAMESPACE = "tileproof"

# name -> (module under tileproof.optimized, the arguments it writes in place): launchers registered as they are
OPERATORS: dict[str, tuple[str, tuple[str, ...]]] = {
    "per_channel_cast": ("quant.blocks", ()),
    "per_channel_cast_and_transpose": ("quant.channel", ()),
    "swiglu_forward_and_per_token_cast": ("quant.swiglu", ("clamped_count",)),
    "swiglu_forward_and_per_channel_cast_and_transpose": ("quant.swiglu", ()),
    "topk_gate": ("moe.router", ()),
    "topk_sum_and_topk_group_idx": ("moe.router", ()),
    "top2_sum_gate": ("moe.router", ("unmapped_topk_idx",)),
    "normalize_weight": ("moe.mapping", ()),
    "aux_fi": ("moe.mapping", ()),
    "group_count": ("moe.mapping", ()),
    "mask_indices_by_tp": ("moe.mapping", ()),
    "expand_to_fused": ("moe.fused", ()),
    "transpose": ("transpose", ()),
    "batched_transpose": ("transpose", ()),
    "engram_hash": ("engram", ()),
    "fused_weight": ("engram", ()),
    "grad_w_reduce": ("engram", ("grad_wh", "grad_we")),
    "expand_to_mhc": ("mhc", ()),
    "expand_to_mhc_bwd": ("mhc", ()),
    "mhc_pre_split_mixes": ("mhc", ()),
    "mhc_pre_split_mixes_bwd": ("mhc", ()),
    "sinkhorn_normalize": ("mhc", ()),
    "sinkhorn_normalize_bwd": ("mhc", ()),
    "mhc_pre_apply_mix": ("mhc", ()),
    "mhc_pre_apply_mix_bwd": ("mhc", ()),
    "mhc_post": ("mhc", ()),
    "mhc_post_bwd": ("mhc", ()),
    "mhc_head_compute_mix": ("mhc", ()),
    "mhc_head_compute_mix_bwd": ("mhc", ()),
    "mhc_multilayer_recompute": ("mhc_fuse", ("layer_input_list", "residual_list")),
}


def launcher(name: str) -> Callable:
    module, _ = OPERATORS[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


# name -> (adapter, the arguments it writes in place): launchers registered through an adapter below,
# whose signature the schema language expresses; each adapter's docstring maps it onto its launcher.
ADAPTED: dict[str, tuple[Callable, tuple[str, ...]]] = {}


def _adapter(*mutates: str) -> Callable[[Callable], Callable]:
    """Record the decorated function as the adapter of the operator of its name."""

    def record(function: Callable) -> Callable:
        ADAPTED[function.__name__] = (function, mutates)
        return function

    return record


def _source(x: torch.Tensor, x_sf: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The launchers' ``x``: the plain tensor ``x``, or the quantized pair ``(x, x_sf)`` when scales
    come with it."""
    return x if x_sf is None else (x, x_sf)


def _block(size: list[int] | None) -> tuple[int, ...] | None:
    """A block size as the launchers document it, a tuple (the schema has int lists only); the
    launcher checks that it is a pair."""
    return None if size is None else tuple(size)


def _absent(like: torch.Tensor) -> torch.Tensor:
    """The stand-in for an output the launcher returns as None: fp32 ``[0]`` on ``like``'s device."""
    return torch.empty(0, dtype=torch.float32, device=like.device)


# ---------------------------------------------------------------------------------------------
# Quantization: (data, sf) pairs split in two, block sizes as int lists
# ---------------------------------------------------------------------------------------------


@_adapter()
def per_token_cast(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    x_block_size: list[int] | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    x_sf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.per_token.per_token_cast(x if x_sf is None else (x, x_sf), ..., tuple(x_block_size))``.

    ``x``: bf16 / fp32 ``[T, H]``, or the data of a quantized pair (e4m3 ``[T, H]``, e2m1 int8
    ``[T, H/2]``) whose scales are ``x_sf`` (fp32 or packed int32) and block ``x_block_size``.
    Returns ``(q, sf)``: q ``[T, H]`` e4m3 (int8 ``[T, H/2]`` e2m1, uint8 ``[T, 3H/2]`` e5m6), sf
    ``[T, ceil(H / C)]`` in the layout the flags name."""
    return per_token.per_token_cast(
        _source(x, x_sf),
        fmt,
        num_per_channels,
        _block(x_block_size),
        use_tma_aligned_col_major_sf,
        round_sf,
        use_packed_ue8m0,
    )


@_adapter()
def per_token_cast_with_sf_only(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    x_block_size: list[int] | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    x_sf: torch.Tensor | None = None,
) -> torch.Tensor:
    """``quant.per_token.per_token_cast_with_sf_only`` with ``per_token_cast``'s mapping: ``x`` (plus
    ``x_sf`` for a quantized pair) and an int-list ``x_block_size``. Returns sf ``[T, ceil(H / C)]``."""
    return per_token.per_token_cast_with_sf_only(
        _source(x, x_sf),
        fmt,
        num_per_channels,
        _block(x_block_size),
        use_tma_aligned_col_major_sf,
        round_sf,
        use_packed_ue8m0,
    )


@_adapter()
def per_token_cast_with_precomputed_sf(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    sf: torch.Tensor,
    x_block_size: list[int] | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    x_sf: torch.Tensor | None = None,
) -> torch.Tensor:
    """``quant.per_token.per_token_cast_with_precomputed_sf`` with ``per_token_cast``'s mapping: ``x``
    (plus ``x_sf`` for a quantized pair) and an int-list ``x_block_size``; ``sf`` is the scales to
    cast with, ``[T, ceil(H / C)]``. Returns q, as ``per_token_cast``'s."""
    return per_token.per_token_cast_with_precomputed_sf(
        _source(x, x_sf),
        fmt,
        num_per_channels,
        sf,
        _block(x_block_size),
        use_tma_aligned_col_major_sf,
        round_sf,
        use_packed_ue8m0,
    )


@_adapter()
def per_token_cast_e5m6(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    x_block_size: list[int] | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.e5m6.per_token_cast_e5m6(..., tuple(x_block_size))``; ``x`` is plain bf16 / fp32
    ``[T, H]`` (e5m6 re-quantizes no pair). Returns ``(q uint8 [T, 3H/2], sf [T, 1])``."""
    return e5m6.per_token_cast_e5m6(
        x, fmt, num_per_channels, _block(x_block_size), use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0
    )


@_adapter()
def per_token_cast_back(
    x: torch.Tensor, x_sf: torch.Tensor, fmt: str, num_per_channels: int, x_special_fmt: str | None = None
) -> torch.Tensor:
    """``quant.dequantize.per_token_cast_back((x, x_sf), fmt, ...)``: ``x`` the data (e4m3 ``[T, H]``,
    e2m1 int8 ``[T, H/2]``, e5m6 uint8 ``[T, 3H/2]``), ``x_sf`` its scales ``[T, ceil(H / C)]``.
    Returns bf16 / fp32 ``[T, H]``."""
    return dequantize.per_token_cast_back((x, x_sf), fmt, num_per_channels, x_special_fmt)


@_adapter()
def cast_back(
    x: torch.Tensor, x_sf: torch.Tensor, fmt: str, x_block_size: list[int], x_special_fmt: str | None = None
) -> torch.Tensor:
    """``quant.dequantize.cast_back((x, x_sf), fmt, tuple(x_block_size), ...)``: ``x`` the data,
    ``x_sf`` its scales ``[ceil(T / bm), ceil(H / bk)]``. Returns bf16 / fp32 ``[T, H]``."""
    return dequantize.cast_back((x, x_sf), fmt, _block(x_block_size), x_special_fmt)


@_adapter()
def per_block_cast(
    x: torch.Tensor,
    fmt: str,
    block_size: list[int],
    x_block_size: list[int] | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    x_sf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.blocks.per_block_cast(x if x_sf is None else (x, x_sf), fmt, tuple(block_size),
    tuple(x_block_size), ...)``: ``x`` plain bf16 / fp32 ``[T, H]`` or the data of a quantized pair
    with scales ``x_sf``. Returns ``(q, sf)``: q as ``per_token_cast``'s, sf
    ``[ceil(T / bm), ceil(H / bk)]``."""
    return blocks.per_block_cast(
        _source(x, x_sf),
        fmt,
        _block(block_size),
        _block(x_block_size),
        use_tma_aligned_col_major_sf,
        round_sf,
        use_packed_ue8m0,
    )


@_adapter()
def per_block_cast_with_sf_only(
    x: torch.Tensor,
    fmt: str,
    block_size: list[int],
    x_block_size: list[int] | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    x_sf: torch.Tensor | None = None,
) -> torch.Tensor:
    """``quant.blocks.per_block_cast_with_sf_only`` with ``per_block_cast``'s mapping. Returns sf
    ``[ceil(T / bm), ceil(H / bk)]``."""
    return blocks.per_block_cast_with_sf_only(
        _source(x, x_sf),
        fmt,
        _block(block_size),
        _block(x_block_size),
        use_tma_aligned_col_major_sf,
        round_sf,
        use_packed_ue8m0,
    )


@_adapter()
def per_block_cast_with_precomputed_sf(
    x: torch.Tensor,
    fmt: str,
    block_size: list[int],
    sf: torch.Tensor,
    x_block_size: list[int] | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    x_sf: torch.Tensor | None = None,
) -> torch.Tensor:
    """``quant.blocks.per_block_cast_with_precomputed_sf`` with ``per_block_cast``'s mapping; ``sf``
    is the scales to cast with, ``[ceil(T / bm), ceil(H / bk)]``. Returns q."""
    return blocks.per_block_cast_with_precomputed_sf(
        _source(x, x_sf),
        fmt,
        _block(block_size),
        sf,
        _block(x_block_size),
        use_tma_aligned_col_major_sf,
        round_sf,
        use_packed_ue8m0,
    )


@_adapter()
def per_block_cast_lossless(
    x: torch.Tensor,
    x_sf: torch.Tensor,
    fmt: str,
    x_block_size: list[int],
    out_block_size: list[int],
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.lossless.per_block_cast_lossless((x, x_sf), fmt, tuple(x_block_size),
    tuple(out_block_size), ...)``: ``x`` e2m1 int8 ``[T, H/2]``, ``x_sf`` its power-of-two scales.
    Returns ``(q e4m3 [T, H], sf [ceil(T / out_bm), ceil(H / out_bk)])``. Synchronizes with the host
    once, as the launcher does."""
    return lossless.per_block_cast_lossless(
        (x, x_sf),
        fmt,
        _block(x_block_size),
        _block(out_block_size),
        use_tma_aligned_col_major_sf,
        round_sf,
        use_packed_ue8m0,
    )


@_adapter()
def per_channel_cast_fused(
    x: torch.Tensor,
    fmt: str,
    num_per_tokens: int = 128,
    round_sf: bool = False,
    num_per_channels: int | None = None,
    pos_to_token: torch.Tensor | None = None,
    x_sf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.channel.per_channel_cast_fused(x if x_sf is None else (x, x_sf), ...)``: ``x`` plain
    bf16 / fp32 ``[T, H]``, or e4m3 data with 1×128 scales ``x_sf`` fp32 ``[T, ceil(H / 128)]``.
    Returns ``(q e4m3 [P, H], sf fp32 [ceil(P / nt), H])``, P = T without ``pos_to_token``."""
    return channel.per_channel_cast_fused(
        _source(x, x_sf), fmt, num_per_tokens, round_sf, num_per_channels, pos_to_token
    )


@_adapter()
def swiglu_backward_and_per_token_cast(
    x: torch.Tensor,
    x_sf: torch.Tensor,
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    pos_to_token_topk: torch.Tensor,
    token_topk_to_pos: torch.Tensor,
    num_per_channels: int,
    round_sf: bool = False,
    swiglu_clamp_value: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quant.swiglu.swiglu_backward_and_per_token_cast((x, x_sf), ...)`` with its nested result
    flattened: ``x`` e4m3 ``[P, 2H]``, ``x_sf`` fp32 ``[P, 2H / C]``. Returns
    ``(out bf16 [P, H], dx_q e4m3 [P, 2H], dx_sf fp32 [P, 2H / C], dx bf16 [P, 2H], dweight fp32 [T, k])``
    where the launcher returns ``(out, (dx_q, dx_sf), dx, dweight)``."""
    out, (dx_q, dx_sf), dx, dweight = swiglu.swiglu_backward_and_per_token_cast(
        (x, x_sf),
        grad_out,
        weight,
        pos_to_token_topk,
        token_topk_to_pos,
        num_per_channels,
        round_sf,
        swiglu_clamp_value,
    )
    return out, dx_q, dx_sf, dx, dweight


# ---------------------------------------------------------------------------------------------
# MoE: an in-place operator, the mapping without its host list, a (data, sf) pair
# ---------------------------------------------------------------------------------------------


@_adapter("group_indices")
def inplace_unique_group_indices(group_indices: torch.Tensor, num_groups: int) -> None:
    """``moe.mapping.inplace_unique_group_indices``, returning nothing: the launcher returns
    ``group_indices`` itself, and a custom op's output may not alias its input. ``group_indices``
    int32 / int64 ``[T, k]`` is rewritten in place."""
    mapping.inplace_unique_group_indices(group_indices, num_groups)


@_adapter()
def get_fused_mapping(
    topk_idx: torch.Tensor, num_experts: int, num_expanded_tokens: int, alignment: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe.mapping.get_fused_mapping(..., force_no_sync=True)`` without its last output, the host
    list of per-expert sizes: the no-sync form only, never a host synchronization.

    The launcher's synchronizing form (``num_expanded_tokens == 0`` without ``force_no_sync``) sizes
    its outputs by the values of ``topk_idx``: its fake, the launcher under ``outputs_only``, cannot
    know that size, and a schema returns no list of ints, so that form is not registered. Here
    ``num_expanded_tokens`` is the number of positions N, or 0 for the upper bound
    ``(T·k + E·(alignment − 1))`` rounded down to ``alignment``; the exact per-expert sizes are the
    returned ``sizes`` (``sizes.tolist()`` is the launcher's list, at the cost of that
    synchronization).

    Returns ``(pos_to_expert, pos_to_token, pos_to_token_topk)`` int32 ``[N]``,
    ``token_topk_to_pos`` int32 ``[T, k]``, ``(expert_start, expert_end, sizes)`` int32 ``[E]``."""
    return mapping.get_fused_mapping(topk_idx, num_experts, num_expanded_tokens, alignment, force_no_sync=True)[:7]


@_adapter()
def expand_to_fused_with_sf(
    x: torch.Tensor,
    x_sf: torch.Tensor,
    num_per_channels: int,
    token_topk_to_pos: torch.Tensor,
    pos_to_expert: torch.Tensor,
    use_tma_aligned_col_major_sf: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe.fused.expand_to_fused_with_sf((x, x_sf), ...)``: ``x`` ``[T, H]``, ``x_sf`` ``[T, S]``.
    Returns ``(out [N, H], out_sf [N, S])`` in the dtypes of x and x_sf, N = ``pos_to_expert``'s
    length."""
    return fused.expand_to_fused_with_sf(
        (x, x_sf), num_per_channels, token_topk_to_pos, pos_to_expert, use_tma_aligned_col_major_sf
    )


@_adapter()
def reduce_fused(
    x: torch.Tensor,
    topk_weights: torch.Tensor | None,
    token_topk_to_pos: torch.Tensor,
    fp8_format: str = "",
    sf: torch.Tensor | None = None,
    x_sf: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moe.fused.reduce_fused(x if x_sf is None else (x, x_sf), ...)``: ``x`` bf16 / fp16 / fp32
    ``[N, H]``, ``x_sf`` its per-row scales ``[N]``. Returns ``[T, H]`` in x's dtype (e4m3 with
    ``fp8_format="e4m3"``)."""
    return fused.reduce_fused(_source(x, x_sf), topk_weights, token_topk_to_pos, fp8_format, sf)


# ---------------------------------------------------------------------------------------------
# Engram and mHC: outputs that may be None, a keyword-only tensor
# ---------------------------------------------------------------------------------------------


@_adapter()
def engram_gate_fwd(
    x: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    clamp_value: float,
    save_for_backward: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``engram.engram_gate_fwd``, with an empty fp32 ``[0]`` tensor for each statistic the launcher
    returns as None (``save_for_backward=False``). Returns ``(out bf16 [T, n, D], dot, gate, rstd_x,
    rstd_k)``, the four statistics fp32 ``[T, n]`` or ``[0]``."""
    out, *statistics = engram.engram_gate_fwd(x, k, v, w, eps, clamp_value, save_for_backward)
    return out, *(_absent(out) if statistic is None else statistic for statistic in statistics)


@_adapter()
def engram_gate_bwd(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    dot: torch.Tensor,
    gate: torch.Tensor,
    rstd_x: torch.Tensor,
    rstd_k: torch.Tensor,
    clamp_value: float,
    *,
    num_partials: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``engram.engram_gate_bwd`` without its ``grad_kv`` buffer (an operator's outputs may not alias
    its inputs): dk and dv in tensors of their own."""
    return engram.engram_gate_bwd(
        grad_out, x, k, v, w, dot, gate, rstd_x, rstd_k, clamp_value, num_partials=num_partials
    )


@_adapter()
def mhc_pre_norm_fn(
    residual: torch.Tensor,
    mhc_fn: torch.Tensor,
    mhc_norm_weight: torch.Tensor | None,
    mhc_norm_eps: float,
    save_statistics: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mhc_norm.mhc_pre_norm_fn``, always ``(mixes fp32 [T, m], statistics)``: the statistics fp32
    ``[T, m + 1]`` with ``save_statistics``, else an empty fp32 ``[0]`` (a schema has one return form)."""
    if save_statistics:
        return mhc_norm.mhc_pre_norm_fn(residual, mhc_fn, mhc_norm_weight, mhc_norm_eps, save_statistics=True)
    mixes = mhc_norm.mhc_pre_norm_fn(residual, mhc_fn, mhc_norm_weight, mhc_norm_eps)
    return mixes, _absent(mixes)


@_adapter()
def mhc_pre_norm_fn_bwd(
    grad_output: torch.Tensor,
    residual: torch.Tensor,
    mhc_fn: torch.Tensor,
    mhc_norm_weight: torch.Tensor | None,
    mhc_norm_eps: float,
    grad_addend: torch.Tensor | None = None,
    statistics: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mhc_norm.mhc_pre_norm_fn_bwd``, with an empty fp32 ``[0]`` tensor for the norm weight's
    gradient the launcher returns as None (no ``mhc_norm_weight``), and its keyword-only
    ``grad_addend`` and ``statistics`` as ordinary arguments. Returns ``(dresidual fp32 [T, n, C] (bf16 with
    grad_addend), dfn fp32 [m, nC], dnorm_weight fp32 [nC] or [0])``."""
    d_residual, d_fn, d_weight = mhc_norm.mhc_pre_norm_fn_bwd(
        grad_output, residual, mhc_fn, mhc_norm_weight, mhc_norm_eps, grad_addend=grad_addend, statistics=statistics
    )
    return d_residual, d_fn, _absent(d_residual) if d_weight is None else d_weight


@_adapter()
def mhc_pre_big_fuse(
    residual: torch.Tensor,
    fn: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    rms_eps: float,
    mhc_pre_eps: float,
    mhc_sinkhorn_eps: float,
    mhc_post_mult_value: float,
    sinkhorn_repeat: int,
    n_splits: int = 16,
    mhc_norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mhc_fuse.mhc_pre_big_fuse``, its keyword-only ``mhc_norm_weight`` (fp32 ``[nC]``) an ordinary
    argument: custom ops take no keyword-only tensors. Returns ``(post_mix fp32 [T, n],
    comb_mix fp32 [T, n, n], layer_input bf16 [T, C])``."""
    return mhc_fuse.mhc_pre_big_fuse(
        residual,
        fn,
        mhc_scale,
        mhc_base,
        rms_eps,
        mhc_pre_eps,
        mhc_sinkhorn_eps,
        mhc_post_mult_value,
        sinkhorn_repeat,
        n_splits,
        mhc_norm_weight=mhc_norm_weight,
    )


def _fake(function: Callable) -> Callable:
    def fake(*args, **kwargs):
        with outputs_only():
            return function(*args, **kwargs)

    return fake


def _register(name: str, function: Callable, mutates: tuple[str, ...]) -> None:
    qualified_name = f"{NAMESPACE}::{name}"
    schema = torch.library.infer_schema(function, mutates_args=mutates)
    if any(argument in mutates for argument in _defaulted_arguments(function)):
        # ``custom_op`` on PyTorch before 2.12 fails when a mutable argument is left at its default
        # (pytorch/pytorch#176078: its version-counter bump indexes only the arguments the caller
        # passed). The plain registration API has no such step, and the operator is the same:
        # one schema, the launcher for every device (it checks the device itself), the same fake.
        torch.library.define(qualified_name, schema, tags=(torch.Tag.pt2_compliant_tag,))
        torch.library.impl(qualified_name, "CompositeExplicitAutograd", function)
        torch.library.register_fake(qualified_name, _fake(function))
        return
    operator = torch.library.custom_op(qualified_name, function, mutates_args=mutates, schema=schema)
    operator.register_fake(_fake(function))


def _defaulted_arguments(function: Callable) -> list[str]:
    parameters = inspect.signature(function).parameters.values()
    return [parameter.name for parameter in parameters if parameter.default is not inspect.Parameter.empty]


for _name, (_, _mutates) in OPERATORS.items():
    _register(_name, launcher(_name), _mutates)
for _name, (_adapter_function, _mutates) in ADAPTED.items():
    _register(_name, _adapter_function, _mutates)

"""The optimized operators as PyTorch custom operators: ``torch.ops.tileproof.<name>``.

Importing this module registers each operator of ``OPERATORS`` with ``torch.library.custom_op``:
the real implementation is the operator's launcher, and the fake implementation (what
``torch.compile``, ``torch.export`` and ``FakeTensorMode`` run) is the same launcher under
``outputs_only``: argument checks and output allocation on fake or meta tensors, no kernel built
or launched, so the fake outputs cannot drift from the real ones (``tests/test_optimized_shapes.py``
checks them against the reference on every quick case).

The plain functions (``tileproof.optimized.mhc.mhc_post``, ...) stay the eager API: the dispatcher
adds host time to every call, which an eager caller need not pay.

Not registered yet (``NOT_YET``): operators whose signatures PyTorch's schema language does not
express as they are (tuple inputs, ``None`` among the outputs, ``*args`` launchers, a host list of
sizes among the outputs, keyword-only tensors); they need adapter signatures first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from .jit import outputs_only

NAMESPACE = "tileproof"

# name -> (module under tileproof.optimized, the arguments it writes in place)
OPERATORS: dict[str, tuple[str, tuple[str, ...]]] = {
    "per_channel_cast": ("quant.blocks", ()),
    "per_channel_cast_and_transpose": ("quant.channel", ()),
    "swiglu_forward_and_per_channel_cast_and_transpose": ("quant.swiglu", ()),
    "topk_gate": ("moe.router", ()),
    "topk_sum_and_topk_group_idx": ("moe.router", ()),
    "normalize_weight": ("moe.mapping", ()),
    "aux_fi": ("moe.mapping", ()),
    "group_count": ("moe.mapping", ()),
    "mask_indices_by_tp": ("moe.mapping", ()),
    "expand_to_fused": ("moe.fused", ()),
    "transpose": ("transpose", ()),
    "batched_transpose": ("transpose", ()),
    "engram_hash": ("engram", ()),
    "fused_weight": ("engram", ()),
    "engram_gate_bwd": ("engram", ()),
    "grad_w_reduce": ("engram", ("grad_wh", "grad_we")),
    "expand_to_mhc": ("mhc", ()),
    "expand_to_mhc_bwd": ("mhc", ()),
    "mhc_pre_norm_fn": ("mhc_norm", ()),
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

NOT_YET = {
    "per_token_cast": "unannotated block-size arguments (int or a pair)",
    "per_token_cast_with_sf_only": "unannotated block-size arguments (int or a pair)",
    "per_token_cast_with_precomputed_sf": "unannotated block-size arguments (int or a pair)",
    "per_token_cast_e5m6": "unannotated block-size arguments (int or a pair)",
    "per_token_cast_back": "a (data, sf) tuple input",
    "cast_back": "a (data, sf) tuple input",
    "per_block_cast": "unannotated block-size arguments (int or a pair)",
    "per_block_cast_with_sf_only": "unannotated block-size arguments (int or a pair)",
    "per_block_cast_with_precomputed_sf": "unannotated block-size arguments (int or a pair)",
    "per_block_cast_lossless": "a (data, sf) tuple input",
    "per_channel_cast_fused": "a (data, sf) tuple input",
    "top2_sum_gate": "an *args launcher",
    "inplace_unique_group_indices": "an *args launcher",
    "get_fused_mapping": "a host list of per-expert sizes among the outputs",
    "expand_to_fused_with_sf": "a (data, sf) tuple input",
    "reduce_fused": "a (data, sf) tuple input",
    "swiglu_forward_and_per_token_cast": "an *args launcher",
    "swiglu_backward_and_per_token_cast": "a (data, sf) tuple input",
    "engram_gate_fwd": "None among the outputs (save_for_backward=False)",
    "mhc_pre_norm_fn_bwd": "None among the outputs (no norm weight)",
    "mhc_pre_big_fuse": "a keyword-only tensor argument (mhc_norm_weight)",
}


def launcher(name: str) -> Callable:
    module, _ = OPERATORS[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def _fake(function: Callable) -> Callable:
    def fake(*args, **kwargs):
        with outputs_only():
            return function(*args, **kwargs)

    return fake


def _register(name: str) -> None:
    function = launcher(name)
    _, mutates = OPERATORS[name]
    operator = torch.library.custom_op(f"{NAMESPACE}::{name}", function, mutates_args=mutates)
    operator.register_fake(_fake(function))


for _name in OPERATORS:
    _register(_name)

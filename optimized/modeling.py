"""Optimized twin of the modeling layers (contract §6): trainable Engram and mHC layers.

Same public names, argument order, defaults and validation as ``tileproof.reference.modeling``
(its module docstring states the rules: layouts with any leading dimensions, where bf16 roundings
happen, ``main_grad``, the no-grad path through ``mhc_pre_big_fuse`` with the norm weight, head
``fn`` rows beyond n ignored). Each layer is a ``torch.autograd.Function`` whose forward and
explicit backward only compose our kernels (``tileproof.optimized.engram`` and
``tileproof.optimized.mhc``); outputs and gradients agree with the reference within the oracle's
bounds (``oracle/modeling.py``), not bit for bit: the kernels' sums over D / nC run in other orders.

Differences from the reference, all deliberate:

- **bf16 storage only.** The kernels are bf16 kernels: fp32 / fp64 streams or hidden states, which
  the reference accepts for gradcheck, raise ``TypeError`` here (after the reference's own checks,
  so every input the reference refuses is refused with its message).
- **The residual's gradient inside ``mhc_pre`` and ``mhc_head``.** The pre-apply backward kernel
  rounds its dX to bf16; the norm-fn backward kernel adds it to its fp32 dX and rounds once more
  (``grad_addend``; the reference adds both in fp32 and rounds once), so no layer adds gradient
  terms itself. Across layers (the residual read by ``mhc_pre`` and ``mhc_post``) autograd adds the
  bf16 gradients, as in the reference.
- **Engram gains.** ``engram_gate_bwd`` writes one fp32 partial of ``Σ_t β·x⊙k`` per token block
  (as many blocks as the GPU has SMs, at most one per token); ``grad_w_reduce`` adds them in block
  order into ``main_grad`` in place when the gain has one (read at backward time; nothing reaches
  ``.grad``), else into a fresh fp32 zero buffer whose bf16 rounding becomes ``.grad``.
- **k and v views of one projection output** (``kv[..., :n·D]`` and ``kv[..., n·D:]``): the gate
  takes ``kv`` itself and its backward kernel writes kv's gradient whole, where autograd would
  assemble it from dk and dv (a zero fill and two copies of kv's size, and an add). Eager mode only,
  and not when a view retains its gradient or has a hook (``_fused_projection``).

The three norm-fn / fused kernels (``mhc_pre_norm_fn``, ``mhc_pre_norm_fn_bwd``,
``mhc_pre_big_fuse``) are looked up on ``tileproof.optimized.mhc`` at call time.

**torch.compile.** The layers compile with ``fullgraph=True``: inside ``torch.compile`` every kernel
is called as its custom operator ``torch.ops.tileproof.<name>`` (``tileproof.optimized.library``),
which dynamo keeps opaque and traces through its fake implementation, instead of the plain launcher,
Python that dynamo cannot trace (see ``_kernels``).
"""

import math

import torch

from tileproof.reference import modeling as reference_modeling
from tileproof.reference.contract import check_nonnegative_float, check_positive_int, check_shape, check_tensor
from tileproof.reference.modeling import (
    STORAGE_DTYPES,
    check_coefficients,
    check_main_grad,
    check_mult,
    check_parameter,
    check_streams,
    math_dtype,
)

from . import engram, mhc
from .engram import _leading_strides
from .jit import require_cuda

__all__ = list(reference_modeling.__all__)  # the same public names as the reference twin

F32 = torch.float32
BF16 = torch.bfloat16
# dw_partial blocks of the gate backward when no GPU says otherwise (compile checks): an H200's SMs.
DEFAULT_PARTIALS = 132


def _require_bf16(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype != BF16:
        raise TypeError(
            f"{name} must be bf16 (torch.bfloat16) for the optimized layers (their kernels are bf16), "
            f"got {tensor.dtype}; the reference layers accept fp32 and fp64"
        )


def _rows(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``tensor`` as ``shape`` (a view where possible) with unit stride along its last dimension,
    which every kernel asks of its channel axis."""
    rows = tensor.reshape(shape)
    return rows if rows.shape[-1] <= 1 or rows.stride(-1) == 1 else rows.contiguous()


def _num_partials(device: torch.device, tokens: int) -> int:
    """One ``dw_partial`` block per SM (the backward's persistent grid), at most one per token."""
    on_gpu = device.type == "cuda" and torch.cuda.is_available()  # fake CUDA tensors need no GPU
    sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else DEFAULT_PARTIALS
    return max(1, min(sms, tokens))


def _kernels(module):
    """Where the layers find their kernels: ``module`` (``engram`` or ``mhc``), the plain launchers,
    in eager mode; ``torch.ops.tileproof`` while ``torch.compile`` traces.

    The launchers are Python that dynamo cannot trace (TileLang's factories, data pointers); each
    custom operator is opaque to dynamo, with the launcher under ``outputs_only`` as its fake
    implementation, so a compiled model has no graph break at a layer. Eager calls keep the
    launchers: the dispatcher adds host time to every call. The operators take the launchers'
    arguments, under the same names, for every kernel called here, and return the same results but
    for an output a launcher returns as None, an empty tensor there; of those the layers read one,
    ``mhc_pre_norm_fn_bwd``'s norm-weight gradient without a norm weight (``_norm_fn_bwd``).

    Why not ``torch.library.register_autograd`` on layer-level operators instead: each layer's
    forward and backward compose several kernels, so it would take a new operator per layer forward
    and per backward (with fakes composed of the kernels' fakes) for what is a choice of callable
    here; and the Engram gate's backward writes into a gain's ``main_grad`` in place, looked up when
    the backward runs, a side effect outside the gradients a registered backward returns. Dynamo
    traces these ``autograd.Function``s as they are, forward and backward (it lifts ``main_grad`` as
    a graph input and copies the sum back into it).
    """
    if torch.compiler.is_compiling():
        from . import library  # noqa: F401  (registers torch.ops.tileproof; imported on first need)

        return torch.ops.tileproof
    return module


def _norm_fn_bwd(grad_mixes, residual, fn, norm_weight, norm_eps: float, grad_addend, statistics):
    """``mhc_pre_norm_fn_bwd`` from the forward's statistics → ``(bf16(dresidual + grad_addend), dfn,
    dnorm_weight or None)``: without a norm weight its operator returns an empty tensor for
    ``dnorm_weight`` (schemas return no None), the launcher None."""
    d_residual, d_fn, d_weight = _kernels(mhc).mhc_pre_norm_fn_bwd(
        grad_mixes, residual, fn, norm_weight, norm_eps, grad_addend=grad_addend, statistics=statistics
    )
    return d_residual, d_fn, None if norm_weight is None else d_weight


# ---------------------------------------------------------------------------------------------
# Engram gate
# ---------------------------------------------------------------------------------------------


def _split_kv(kv: torch.Tensor, streams: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k ``[T, n, D]`` and v ``[T, D]``, the views of a fused ``[T, (n+1)·D]`` projection output."""
    return kv[:, : streams * hidden].unflatten(1, (streams, hidden)), kv[:, streams * hidden :]


class _EngramGateFunction(torch.autograd.Function):
    """``fused_weight`` → ``engram_gate_fwd``; backward ``engram_gate_bwd`` → ``grad_w_reduce``.

    x ``[T, n, D]`` bf16 and either k ``[T, n, D]`` and v ``[T, D]`` or, in their place (k, v None),
    ``kv`` ``[T, (n+1)·D]`` whose columns hold them (``_split_kv``): its gradient is then one buffer the
    backward kernel writes whole. Unit stride along D; the gains ``[n, D]`` bf16.
    """

    @staticmethod
    def forward(ctx, x, k, v, kv, weight_hidden, weight_embed, clamp_value: float, eps: float):
        kernels = _kernels(engram)
        streams, hidden = x.shape[1:]
        key, value = (k, v) if kv is None else _split_kv(kv, streams, hidden)
        w = kernels.fused_weight(weight_hidden, weight_embed)
        save = any(ctx.needs_input_grad[:6])
        out, dot, gate, rstd_x, rstd_k = kernels.engram_gate_fwd(
            x, key, value, w, eps, clamp_value, save_for_backward=save
        )
        if save:
            ctx.save_for_backward(x, k, v, kv, weight_hidden, weight_embed, w, dot, gate, rstd_x, rstd_k)
            ctx.gains = (weight_hidden, weight_embed)  # their main_grad is read at backward time
            ctx.clamp_value = clamp_value
        return out

    @staticmethod
    def backward(ctx, grad_out):
        kernels = _kernels(engram)
        x, k, v, kv, weight_hidden, weight_embed, w, dot, gate, rstd_x, rstd_k = ctx.saved_tensors
        tokens, streams, hidden = x.shape
        grad_out = grad_out.contiguous()
        partials = _num_partials(x.device, tokens)
        need_x, need_k, need_v, need_kv, need_wh, need_we = ctx.needs_input_grad[:6]
        grad_kv = None
        if kv is None:
            dx, dk, dv, dw_partial = kernels.engram_gate_bwd(
                grad_out, x, k, v, w, dot, gate, rstd_x, rstd_k, ctx.clamp_value, num_partials=partials
            )
        else:
            k, v = _split_kv(kv, streams, hidden)
            grad_kv = torch.empty((tokens, (streams + 1) * hidden), dtype=kv.dtype, device=kv.device)
            dx, dk, dv, dw_partial = kernels.engram_gate_bwd(
                grad_out, x, k, v, w, dot, gate, rstd_x, rstd_k, ctx.clamp_value, num_partials=partials, grad_kv=grad_kv
            )
        grads_w = [None, None]
        if need_wh or need_we:
            accumulators = []
            for needed, gain in zip((need_wh, need_we), ctx.gains, strict=True):
                main_grad = getattr(gain, "main_grad", None) if needed else None
                fresh = main_grad is None
                accumulator = torch.zeros((streams, hidden), dtype=F32, device=x.device) if fresh else main_grad
                accumulators.append((accumulator, needed and fresh))
            kernels.grad_w_reduce(dw_partial, weight_hidden, weight_embed, accumulators[0][0], accumulators[1][0])
            # A gain without main_grad gets the fp32 sum rounded once, as autograd casts the reference's.
            grads_w = [acc.to(BF16) if to_grad else None for acc, to_grad in accumulators]
        return (
            dx if need_x else None,
            dk if need_k else None,
            dv if need_v else None,
            grad_kv if need_kv else None,
            *grads_w,
            None,
            None,
        )


def _fused_projection(k: torch.Tensor, v: torch.Tensor, streams: int, hidden: int) -> torch.Tensor | None:
    """The tensor ``kv [..., (n+1)·D]`` when k and v are exactly its views ``kv[..., :n·D]`` (as ``[...,
    n, D]``) and ``kv[..., n·D:]`` with unit stride along D, else None. The layer then takes kv
    itself: autograd would otherwise build its gradient from dk and dv by a zero fill of kv's size, two
    strided copies and an add (~820 µs at T 8192, n 4, D 4096 on the H200, more than the backward
    kernel). Not while ``torch.compile`` traces (``._base`` is eager-only; the custom operator's
    outputs may not alias a buffer), where dk and dv stay separate."""
    if torch.compiler.is_compiling():
        return None
    base = k._base
    if base is None or v._base is not base or base.dim() != k.dim() - 1:
        return None
    # A view whose own gradient is asked for (retain_grad, a hook) must stay in the graph.
    if any(view.retains_grad or view._backward_hooks for view in (k, v)):
        return None
    lead = tuple(k.shape[:-2])
    if tuple(base.shape) != (*lead, (streams + 1) * hidden) or base.stride(-1) != 1:
        return None
    # Strides of size-1 dimensions count as 0: PyTorch gives such a dimension of a view a stride of its
    # own choosing (one token: kv[:, :n·D] has token stride n·D, not kv's (n+1)·D).
    k_strides, rows = _leading_strides(k), len(lead)
    same_rows = k_strides[:rows] == _leading_strides(base) == _leading_strides(v)
    k_is_head = (
        k.storage_offset() == base.storage_offset()
        and k_strides[rows] == (hidden if streams > 1 else 0)
        and (k.stride(-1) == 1 or hidden == 1)
    )
    v_is_tail = v.storage_offset() == base.storage_offset() + streams * hidden and v.stride(-1) == 1
    if not (same_rows and k_is_head and v_is_tail):
        return None
    # Rows of kv must be one view away from [T, (n+1)·D] (reshape would copy otherwise).
    try:
        base.view(-1, (streams + 1) * hidden)
    except RuntimeError:
        return None
    return base


def engram_gate(
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    clamp_value: float,
    eps: float,
) -> torch.Tensor:
    """The trainable Engram gate on our kernels; same contract as
    ``tileproof.reference.modeling.engram_gate`` for bf16 hidden states (``TypeError`` otherwise).

    Args:
        hidden_states: ``[..., n, D]`` bf16. k: ``[..., n, D]`` bf16, v: ``[..., D]`` bf16 (any strides;
            a non-unit stride along D costs a copy). weight_hidden, weight_embed: ``[n, D]`` bf16,
            with an optional fp32 ``main_grad``. clamp_value: finite, > 0. eps: finite, >= 0.

    Returns:
        ``[..., n, D]`` bf16, contiguous.
    """
    streams, hidden = check_streams("hidden_states", hidden_states)
    dtype = hidden_states.dtype
    lead = tuple(hidden_states.shape[:-2])
    check_parameter("k", k, dtype, (*lead, streams, hidden))
    check_parameter("v", v, dtype, (*lead, hidden))
    check_parameter("weight_hidden", weight_hidden, dtype, (streams, hidden))
    check_parameter("weight_embed", weight_embed, dtype, (streams, hidden))
    clamp_value = check_nonnegative_float("clamp_value", clamp_value, allow_zero=False)
    eps = check_nonnegative_float("eps", eps)
    compute = math_dtype(dtype)
    check_main_grad("weight_hidden", weight_hidden, compute)
    check_main_grad("weight_embed", weight_embed, compute)
    _require_bf16("hidden_states", hidden_states)
    # Checked here so that a refusal names the layer's arguments, not the kernels' (fused_weight's wh).
    for name, tensor in (("hidden_states", hidden_states), ("k", k), ("v", v)):
        require_cuda(name, tensor)
    require_cuda("weight_hidden", weight_hidden)
    require_cuda("weight_embed", weight_embed)

    tokens = math.prod(lead)
    kv = _fused_projection(k, v, streams, hidden)
    out = _EngramGateFunction.apply(
        _rows(hidden_states, (tokens, streams, hidden)),
        None if kv is not None else _rows(k, (tokens, streams, hidden)),
        None if kv is not None else _rows(v, (tokens, hidden)),
        None if kv is None else kv.reshape(tokens, (streams + 1) * hidden),
        weight_hidden,
        weight_embed,
        clamp_value,
        eps,
    )
    return out.reshape(hidden_states.shape)


class EngramGate(reference_modeling.EngramGate):
    """The reference's ``EngramGate`` module (same parameters and initialisation) on our kernels."""

    def forward(self, hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return engram_gate(hidden_states, k, v, self.weight_hidden, self.weight_embed, self.clamp_value, self.eps)


# ---------------------------------------------------------------------------------------------
# mHC
# ---------------------------------------------------------------------------------------------


class _ExpandFunction(torch.autograd.Function):
    """``expand_to_mhc`` ``[T, C] → [T, n, C]``; backward ``expand_to_mhc_bwd`` (fp32 sum, one rounding)."""

    @staticmethod
    def forward(ctx, x, n: int):
        return _kernels(mhc).expand_to_mhc(x, n)

    @staticmethod
    def backward(ctx, grad_output):
        return _kernels(mhc).expand_to_mhc_bwd(grad_output.contiguous()), None


def expand_from_embedding(x: torch.Tensor, mhc_mult: int = 4) -> torch.Tensor:
    """Enter the mHC residual on our kernels: bf16 ``[..., C] → [..., n, C]`` contiguous (exact); same
    contract as ``tileproof.reference.modeling.expand_from_embedding`` for bf16 x."""
    check_tensor("x", x, dtypes=STORAGE_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"x must be [..., C] (at least 1-D), got shape {tuple(x.shape)}")
    n = check_positive_int("mhc_mult", mhc_mult)
    _require_bf16("x", x)
    require_cuda("x", x)  # named as the layer's argument, not expand_to_mhc's
    hidden = x.shape[-1]
    streams = _ExpandFunction.apply(_rows(x, (math.prod(x.shape[:-1]), hidden)), n)
    return streams.reshape(*x.shape[:-1], n, hidden)


class _MHCPreFunction(torch.autograd.Function):
    """norm-fn → split → Sinkhorn → pre-apply; backward in the reverse order.

    residual ``[T, n, C]`` bf16; returns ``(layer_input bf16 [T, C], post fp32 [T, n], comb fp32 [T, n, n])``.
    """

    @staticmethod
    def forward(ctx, residual, fn, scale, base, norm_weight, options: tuple):
        norm_eps, n, post_mult, pre_eps, sinkhorn_eps, repeat = options
        kernels = _kernels(mhc)
        # The statistics ([x·fnᵀ | Σx²], T·(m + 1) floats) spare the backward a pass over the streams.
        mixes, statistics = kernels.mhc_pre_norm_fn(residual, fn, norm_weight, norm_eps, save_statistics=True)
        pre_mix, post_mix, comb_logits = kernels.mhc_pre_split_mixes(mixes, scale, base, n, post_mult, pre_eps)
        comb_mix = kernels.sinkhorn_normalize(comb_logits, repeat, sinkhorn_eps)
        layer_input = kernels.mhc_pre_apply_mix(residual, pre_mix)
        ctx.save_for_backward(residual, fn, scale, base, norm_weight, mixes, pre_mix, comb_logits, statistics)
        ctx.options = options
        return layer_input, post_mix, comb_mix

    @staticmethod
    def backward(ctx, grad_layer_input, grad_post, grad_comb):
        residual, fn, scale, base, norm_weight, mixes, pre_mix, comb_logits, statistics = ctx.saved_tensors
        norm_eps, n, post_mult, _, sinkhorn_eps, repeat = ctx.options
        kernels = _kernels(mhc)
        grad_logits = kernels.sinkhorn_normalize_bwd(grad_comb.contiguous(), comb_logits, repeat, sinkhorn_eps)
        d_apply, grad_pre = kernels.mhc_pre_apply_mix_bwd(grad_layer_input.contiguous(), residual, pre_mix)
        grad_mixes, grad_scale, grad_base = kernels.mhc_pre_split_mixes_bwd(
            grad_pre, grad_post.contiguous(), grad_logits, mixes, scale, base, n, post_mult
        )
        # The residual's two terms inside this layer: the norm-fn backward adds d_apply (bf16 already:
        # the pre-apply kernel rounds it) to its fp32 dx and rounds once, in its kernel.
        grad_residual, grad_fn, grad_norm_weight = _norm_fn_bwd(
            grad_mixes, residual, fn, norm_weight, norm_eps, d_apply, statistics
        )
        grad_residual = grad_residual if ctx.needs_input_grad[0] else None
        return grad_residual, grad_fn, grad_scale, grad_base, grad_norm_weight, None


def mhc_pre(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    mhc_mult: int = 4,
    post_mult_value: float = 1.0,
    pre_eps: float = 1e-6,
    sinkhorn_eps: float = 1e-6,
    sinkhorn_repeat: int = 10,
    n_splits: int = 16,
):
    """mHC before one sublayer on our kernels; same contract as ``tileproof.reference.modeling.mhc_pre``
    for bf16 streams. With gradients disabled it runs ``mhc_pre_big_fuse`` (norm weight included).

    Returns:
        ``(layer_input [..., C] bf16, (post_mix [..., n], comb_mix [..., n, n]))``, the mixes fp32.
    """
    n, hidden = check_streams("residual", residual)
    m3 = n * n + 2 * n
    check_mult(mhc_mult, n)
    check_coefficients(residual, fn, scale, base, norm_weight, m3, 3, m3)
    check_shape("fn", fn, (m3, n * hidden))
    norm_eps = check_nonnegative_float("norm_eps", norm_eps)
    post_mult_value = check_nonnegative_float("post_mult_value", post_mult_value)
    pre_eps = check_nonnegative_float("pre_eps", pre_eps)
    sinkhorn_eps = check_nonnegative_float("sinkhorn_eps", sinkhorn_eps)
    sinkhorn_repeat = check_positive_int("sinkhorn_repeat", sinkhorn_repeat)
    check_positive_int("n_splits", n_splits)
    _require_bf16("residual", residual)
    lead = residual.shape[:-2]
    streams = _rows(residual, (math.prod(lead), n, hidden))

    if not torch.is_grad_enabled():
        post_mix, comb_mix, layer_input = _kernels(mhc).mhc_pre_big_fuse(
            streams,
            fn,
            scale,
            base,
            rms_eps=norm_eps,
            mhc_pre_eps=pre_eps,
            mhc_sinkhorn_eps=sinkhorn_eps,
            mhc_post_mult_value=post_mult_value,
            sinkhorn_repeat=sinkhorn_repeat,
            n_splits=n_splits,
            mhc_norm_weight=norm_weight,
        )
    else:
        options = (norm_eps, n, post_mult_value, pre_eps, sinkhorn_eps, sinkhorn_repeat)
        layer_input, post_mix, comb_mix = _MHCPreFunction.apply(streams, fn, scale, base, norm_weight, options)
    return (
        layer_input.reshape(*lead, hidden),
        (post_mix.reshape(*lead, n), comb_mix.reshape(*lead, n, n)),
    )


class _MHCPostFunction(torch.autograd.Function):
    """``mhc_post`` over ``[T, ...]`` rows; backward ``mhc_post_bwd``."""

    @staticmethod
    def forward(ctx, x, residual, post_layer_mix, comb_res_mix):
        ctx.save_for_backward(x, residual, post_layer_mix, comb_res_mix)
        return _kernels(mhc).mhc_post(x, residual, post_layer_mix, comb_res_mix)

    @staticmethod
    def backward(ctx, grad_output):
        return _kernels(mhc).mhc_post_bwd(grad_output.contiguous(), *ctx.saved_tensors)


def mhc_post(
    x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor
) -> torch.Tensor:
    """mHC after one sublayer on our kernels; same contract as ``tileproof.reference.modeling.mhc_post``
    for bf16 streams: ``[..., n, C]`` bf16, contiguous."""
    n, hidden = check_streams("residual", residual)
    lead = tuple(residual.shape[:-2])
    compute = math_dtype(residual.dtype)
    check_parameter("x", x, residual.dtype, (*lead, hidden))
    check_parameter("post_layer_mix", post_layer_mix, compute, (*lead, n))
    check_parameter("comb_res_mix", comb_res_mix, compute, (*lead, n, n))
    _require_bf16("residual", residual)
    tokens = math.prod(lead)
    out = _MHCPostFunction.apply(
        _rows(x, (tokens, hidden)),
        _rows(residual, (tokens, n, hidden)),
        post_layer_mix.reshape(tokens, n),
        comb_res_mix.reshape(tokens, n, n),
    )
    return out.reshape(residual.shape)


class _MHCHeadFunction(torch.autograd.Function):
    """norm-fn (fn's first n rows) → head mix → pre-apply; backward in the reverse order."""

    @staticmethod
    def forward(ctx, residual, fn, scale, base, norm_weight, norm_eps: float, pre_eps: float):
        n = residual.shape[1]
        scale_1 = scale.reshape(1)
        kernels = _kernels(mhc)
        mixes, statistics = kernels.mhc_pre_norm_fn(residual, fn[:n], norm_weight, norm_eps, save_statistics=True)
        head_mix = kernels.mhc_head_compute_mix(mixes, scale_1, base, pre_eps)
        ctx.save_for_backward(residual, fn, scale_1, base, norm_weight, mixes, head_mix, statistics)
        ctx.scale_shape = scale.shape
        ctx.norm_eps = norm_eps
        return kernels.mhc_pre_apply_mix(residual, head_mix)

    @staticmethod
    def backward(ctx, grad_output):
        residual, fn, scale_1, base, norm_weight, mixes, head_mix, statistics = ctx.saved_tensors
        n = residual.shape[1]
        kernels = _kernels(mhc)
        d_apply, grad_mix = kernels.mhc_pre_apply_mix_bwd(grad_output.contiguous(), residual, head_mix)
        grad_mixes, grad_scale, grad_base = kernels.mhc_head_compute_mix_bwd(grad_mix, mixes, scale_1, base)
        grad_residual, grad_rows, grad_norm_weight = _norm_fn_bwd(
            grad_mixes, residual, fn[:n], norm_weight, ctx.norm_eps, d_apply, statistics
        )
        grad_fn = grad_rows
        if fn.shape[0] != n:
            # The rows beyond n (TileKernels' zero padding) take no part: their gradient is 0.
            grad_fn = torch.zeros_like(fn)
            grad_fn[:n].copy_(grad_rows)
        # As in mhc_pre: d_apply added to the norm-fn's fp32 dx in its kernel, rounded once.
        grad_residual = grad_residual if ctx.needs_input_grad[0] else None
        return grad_residual, grad_fn, grad_scale.reshape(ctx.scale_shape), grad_base, grad_norm_weight, None, None


def mhc_head(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    mhc_mult: int = 4,
    pre_eps: float = 1e-6,
    n_splits: int = 16,
) -> torch.Tensor:
    """mHC before the LM head on our kernels; same contract as ``tileproof.reference.modeling.mhc_head``
    for bf16 streams: ``[..., C]`` bf16."""
    n, hidden = check_streams("residual", residual)
    check_mult(mhc_mult, n)
    scale_checked = scale.reshape(1) if isinstance(scale, torch.Tensor) and scale.dim() == 0 else scale
    check_coefficients(residual, fn, scale_checked, base, norm_weight, n, 1, n)
    norm_eps = check_nonnegative_float("norm_eps", norm_eps)
    pre_eps = check_nonnegative_float("pre_eps", pre_eps)
    check_positive_int("n_splits", n_splits)
    _require_bf16("residual", residual)
    lead = residual.shape[:-2]
    streams = _rows(residual, (math.prod(lead), n, hidden))
    out = _MHCHeadFunction.apply(streams, fn, scale, base, norm_weight, norm_eps, pre_eps)
    return out.reshape(*lead, hidden)


class ExpandFromEmbedding(reference_modeling.ExpandFromEmbedding):
    """The reference's module on our kernels: ``forward(x [..., C]) → [..., n, C]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return expand_from_embedding(x, self.mhc_mult)


class MHCPre(reference_modeling.MHCPre):
    """The reference's ``MHCPre`` (same parameters, initialisation and options) on our kernels."""

    def forward(self, residual: torch.Tensor):
        return mhc_pre(residual, self.fn, self.scale, self.base, norm_weight=self.norm_weight, **self.options)


class MHCPost(reference_modeling.MHCPost):
    """``forward(x, residual, post_layer_mix, comb_res_mix)`` on our kernels; no parameters."""

    def forward(self, x, residual, post_layer_mix, comb_res_mix) -> torch.Tensor:
        return mhc_post(x, residual, post_layer_mix, comb_res_mix)


class MHCHead(reference_modeling.MHCHead):
    """The reference's ``MHCHead`` (same parameters, initialisation and options) on our kernels."""

    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        return mhc_head(residual, self.fn, self.scale, self.base, norm_weight=self.norm_weight, **self.options)

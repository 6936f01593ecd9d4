"""The modeling layers (contract §6) for the oracle: trainable layers, forward and backward.

Two operators, each a *driver* of the layers of ``tileproof.<twin>.modeling``: it makes leaves of
the inputs and parameters, runs the layers' forward, calls ``backward`` with the case's fixed
random upstream gradient (built in ``build``, part of the call) and returns the forward's outputs
followed by the gradient of every input and parameter, so that the oracle compares outputs and
gradients alike:

- ``engram_gate_layer``: ``engram_gate(x, k, v, wh, we, clamp_value, eps)`` with k and v views of
  one fused ``[..., (n + 1)·D]`` projection output (the leaf is that buffer) → ``(out, dx, dk, dv,
  dwh, dwe)``. Cases with ``main_grad`` give both gains a Megatron-style fp32 ``main_grad`` buffer
  (random initial values): the gains' outputs are then those buffers after the backward, whose
  ``.grad`` must stay None.
- ``mhc_pipeline``: ``expand_from_embedding`` → two blocks of (``mhc_pre`` with its norm weight →
  a fixed sublayer ``y = bf16(u ⊙ g)``, g a constant bf16 gain of the call → ``mhc_post``) →
  ``mhc_head`` → ``(out, layer_inputs, post_mixes, comb_mixes, residuals, dh, dfn, dscale, dbase,
  dnorm_weight, dhead_fn, dhead_scale, dhead_base, dhead_norm_weight)``, the blocks' tensors
  stacked ``[2, ...]``. (After the expand the streams are equal, so the first block's comb acts
  through its column sums only; the second block's streams differ.)

Gradients of parameters are sums over the tokens (and channels) of random-sign terms. The driver
reports each times the case's ``report_scales`` entry, an exact power of two that ``build`` picks
from the float64 explicit backward so that the terms' root-sum-square is at most 1 (in (½, 1] for
the largest element): the floatops scaling argument, which here needs the data (scaling the
upstream gradient instead would move the per-token gradients' scale). ``main_grad`` buffers are
reported the same way.

``reference()`` is the driver over ``tileproof.reference.modeling``; ``optimized()`` the driver over
``tileproof.optimized.modeling`` once that module exists and has every layer function the operator
drives (``LAYERS``), else None: the oracle then checks the reference only. ``reference_float64``
runs the same driver over the reference layers with float64 storage (the layers accept it: no
rounding anywhere, autograd in float64).

Self-checks: the documented layouts; in float64, every gradient of the layer equals the explicit
backward references of ``reference/engram.py`` / ``reference/mhc.py`` composed by hand (no autograd;
cases up to 2^20 input elements); the premises the bounds rest on; for ``engram_gate_layer`` the
``main_grad`` semantics (the fp32 gradient added in place, its bf16 rounding exactly the ``.grad`` of
a gain without ``main_grad``, accumulating over backwards, ``.grad`` left None).

Bounds: the forward outputs and the Engram gate's gradients are derived (the operators' error model
of ``floatops``, plus the errors the forward's fp32 statistics and TF32 mixes carry into the rest).
The pipeline's gradients pass through a whole chain of bf16-stored tensors; their bounds are set at
≥ 3× the largest error fp32 twins with that storage showed against float64, and every case checks
that its own reference keeps half of that margin. They are there to catch wiring (a gradient
routed to the wrong place, dropped, transposed, a missing ``main_grad``), which moves results by
O(1); each operator's own spec holds its precision.

Cases: ``engram_gate_layer`` has D ∈ {512, 768, 4096} and T ∈ {0, 1, odd} in ``quick``, T ∈ {0, 1,
4001, 8192} × D ∈ {4096, 7168} in ``full``, one case per tier with leading dimensions ``[2, T/2]``,
with clamp 0.3 and with ``main_grad`` (the gate's inputs as ``oracle.engram``'s, k unscaled, rows
redrawn to |s| ≥ 2^-4); ``mhc_pipeline`` runs the mHC stream shapes (quick: T ∈ {0, 1, 13, 5, 3},
C ∈ {64, 128, 1280}; full: T ∈ {0, 1, 4001, 8192} × C ∈ {1280, 2560, 4096, 7168}), one embedding a
strided view, each block with the inputs of ``mhc_pre_big_fuse`` (small scales α, fn scaled by
½·2^-⌈log2 √nC⌉), R 20 / 10 and post_mult 2 / 1 alternating; the upstream gradients are N(0, 1).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from einops import einsum, rearrange, reduce

from tileproof.reference import engram as reference_engram
from tileproof.reference import mhc as reference_mhc
from tileproof.reference import modeling as reference_modeling

from . import engram as oracle_engram
from . import mhc as oracle_mhc
from .floatops import (
    AUTOGRAD_BOUND,
    BF16_BOUND,
    F64,
    FLOAT64_CHECK_ELEMENTS,
    LAMBDA,
    U32,
    U_BF16,
    FloatOp,
    input_elements,
    inverse_sqrt_pow2,
    normal,
    normwise_check,
    place,
    random_sum_bound,
    uniform,
)
from .mhc import _premise_check
from .policy import FAIL, PASS, SKIP, Check, RelativeError, ScaledReference, compare
from .registry import Call, Case, Output, register

N = 4  # streams (hc_mult)
M = N * N + 2 * N
F32, BF16 = torch.float32, torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Drivers: the operator's callable over a module of layers
# ---------------------------------------------------------------------------------------------


def _leaf(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A leaf of the autograd graph over the same storage (strides kept, nothing copied)."""
    return None if tensor is None else tensor.detach().requires_grad_(True)


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    """The leaf's gradient; zeros where the backward left none (a layer that ignores the tensor)."""
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


@dataclass
class Driven:
    """What a driver's timed call returns once the layers have run, forward and backward: ``finish``
    builds the outputs the oracle compares (views of fused gradients, stacks of intermediates, report
    scales). ``ModelingOp.split`` calls it after the call, so that work is not timed as the layer's."""

    finish: Callable[[], tuple]


class LayerDriver:
    """``spec.drive(layers, *args, **kwargs)``: the operator's callable over ``layers``, a module
    with the layer functions of ``tileproof.<twin>.modeling``."""

    def __init__(self, spec: ModelingOp, layers):
        self.spec, self.layers = spec, layers
        self.__name__ = self.__qualname__ = f"{spec.name}[{layers.__name__}]"
        self.__module__ = layers.__name__

    def __call__(self, *args, **kwargs):
        return self.spec.drive(self.layers, *args, **kwargs)


def optimized_modeling():
    """``tileproof.optimized.modeling``, or None while it does not exist."""
    # jit first: it points TileLang's kernel cache at TILEPROOF_CACHE_DIR before TileLang loads.
    importlib.import_module("tileproof.optimized.jit")
    name = "tileproof.optimized.modeling"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise  # the module exists but something it imports is missing: a real error
        return None


class ModelingOp(FloatOp):
    family = "modeling"
    layers: tuple[str, ...]  # the layer functions the driver calls

    def __init__(self, name: str):
        self.name = name

    def drive(self, layers, *args, **kwargs) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def reference(self) -> Callable:
        return LayerDriver(self, reference_modeling)

    def split(self, result) -> tuple[torch.Tensor, ...]:
        return super().split(result.finish() if isinstance(result, Driven) else result)

    def optimized(self) -> Callable | None:
        layers = optimized_modeling()
        if layers is None or not all(hasattr(layers, name) for name in self.layers):
            return None
        return LayerDriver(self, layers)

    def float64_call(self, call: Call) -> Call:
        """The call with every floating tensor upcast to float64 (the layers then run in float64)."""

        def upcast(value):
            if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
                return value.detach().to(F64)
            if isinstance(value, (tuple, list)):
                return type(value)(upcast(item) for item in value)
            return value

        return Call(upcast(call.args), {key: upcast(value) for key, value in call.kwargs.items()}, call.context)

    def reference_float64(self, case, call):
        """The driver over the reference layers in float64 (computed once per call: the self-checks
        use it too)."""
        if "float64" not in call.context:
            call.context["float64"] = self.split(self.float64_call(call)(self.reference()))
        return call.context["float64"]

    def self_check(self, case, call, outputs):
        checks = [self._layout_check(case, outputs)]
        if input_elements(call) <= FLOAT64_CHECK_ELEMENTS:
            checks += self.composition_checks(case, call)
        else:
            checks.append(
                Check("autograd ≡ explicit backwards (float64)", SKIP, detail="large case: proven on the small ones")
            )
        checks += self.extra_checks(case, call, outputs)
        return checks

    def composition_checks(self, case: Case, call: Call) -> list[Check]:
        """Every gradient of the float64 layers ≡ the explicit backward references composed by hand."""
        float64 = self.reference_float64(case, call)
        mine = [value.values if isinstance(value, ScaledReference) else value for value in float64]
        explicit = self.explicit_float64(case, call)
        first_gradient = len(self.outputs) - len(explicit)
        return [
            normwise_check(f"autograd ≡ explicit backwards (float64): {output.name}", got, want, AUTOGRAD_BOUND)
            for output, got, want in zip(self.outputs[first_gradient:], mine[first_gradient:], explicit, strict=True)
        ]

    def explicit_float64(self, case: Case, call: Call) -> tuple[torch.Tensor, ...]:
        """The gradients (in output order) from the explicit ``*_backward_math`` references, float64."""
        raise NotImplementedError


def _pow2_scale(rss: float) -> float:
    """The power of two that brings ``rss`` into (½, 1] (1 for 0: nothing to scale)."""
    return 2.0 ** -math.ceil(math.log2(rss)) if rss > 0 else 1.0


def _worst(values: torch.Tensor) -> float:
    return float(values.abs().max()) if values.numel() else 0.0


# ---------------------------------------------------------------------------------------------
# Engram gate layer
# ---------------------------------------------------------------------------------------------

# The layer's gradients come from the forward's fp32 statistics, so they carry the statistics'
# errors (engram_gate_bwd's own bounds start from exact ones). β = dg·g(1 − g)·½·(rstd_x·rstd_k/√D)
# /√|s| is singular at s = 0: the cases keep |s| ≥ S_GAP_LAYER (k rows redrawn, ≈ 10 % of them;
# s = 0 stays, exactly, on the zero streams) and |s| ≤ S_MAX (premise).
S_GAP_LAYER = 2.0**-4
S_MAX = 6.0
# Relative error of s: dot's LAMBDA·(√D + 2)·2^-24 of the normalised terms' RSS (≈ 1, so relative to
# |s| ≥ S_GAP_LAYER), and twice rstd's.
S_ERROR = LAMBDA * (oracle_engram.D_MAX**0.5 + 2) * U32 / S_GAP_LAYER + 2 * oracle_engram.RSTD_BOUND
# β's relative error: ½·S_ERROR (1/√|s|), |1 − 2g|·½·√|s|·S_ERROR ≤ ½·√S_MAX·S_ERROR (g(1 − g),
# through √|s|), 2·RSTD_BOUND (rstd_x·rstd_k), dg's D-term sum (engram's BETA_ERROR): ≈ 1.9e-3.
BETA_LAYER_ERROR = 0.5 * S_ERROR + 0.5 * S_MAX**0.5 * S_ERROR + 2 * oracle_engram.RSTD_BOUND + oracle_engram.BETA_ERROR
# dk = bf16(β·b): 2^-8 rounding, β's error, fp32 room for b's two products (atol ½ where they cancel).
GATE_LAYER_DK_BOUND = U_BF16 + BETA_LAYER_ERROR + 2.0**-12
# dx = bf16(go + β·a): 2^-8 rounding plus β's error on |β·a| ≤ BETA_A_MAX (premise), measured
# against max(|dx|, atol 4): go and β·a may cancel.
BETA_A_MAX = 16.0
GATE_LAYER_DX_ATOL = 4.0
GATE_LAYER_DX_BOUND = U_BF16 + BETA_LAYER_ERROR * BETA_A_MAX / GATE_LAYER_DX_ATOL + 2.0**-12
# dv = bf16(Σ_m g_m·go_m): rounding and fp32 sum (BF16_BOUND) plus the gates' 2^-12 on
# Σ_m g_m·|go_m| ≤ GATE_SUM_MAX (premise), against max(|dv|, atol 2).
GATE_SUM_MAX = 16.0
GATE_LAYER_DV_ATOL = 2.0
GATE_LAYER_DV_BOUND = BF16_BOUND + oracle_engram.GATE_BOUND * GATE_SUM_MAX / GATE_LAYER_DV_ATOL
# dwh = (Σ_t β·x⊙k)⊙we, T random-sign terms each with β's error (floatops' probabilistic model; the
# terms' RSS ≤ 1 = 2·atol by the report scale), rounded to bf16 in .grad (2^-8), or added to main_grad.
GATE_LAYER_DW_ATOL = 0.5
GATE_LAYER_DW_BOUND = random_sum_bound(oracle_mhc.T_MAX, BETA_LAYER_ERROR + 2 * U32, 1 / GATE_LAYER_DW_ATOL) + U_BF16
WHY_GATE_DW = (
    "Σ over T of random-sign β·x⊙k (·we or ·wh), each with β's error from the fp32 statistics (≈ 1.9e-3): "
    "5·(√T_max·2^-24 + that) of the terms' RSS, ≤ 2·atol (reported × a power of two), + 2^-8 for .grad's bf16"
)


@dataclass(frozen=True)
class GateLayerParams:
    tokens: int
    hidden: int  # D
    batch: int = 1  # leading dimensions [batch, T / batch]
    clamp_value: float = oracle_engram.CLAMP
    main_grad: bool = False


GATE_LAYER_CASES = {
    "quick": [
        GateLayerParams(0, 512),
        GateLayerParams(1, 512, main_grad=True),
        GateLayerParams(9, 768),
        GateLayerParams(6, 512, batch=2),
        GateLayerParams(11, 512, clamp_value=0.3),
        GateLayerParams(3, 4096, main_grad=True),
    ],
    "full": [GateLayerParams(t, d) for d in oracle_engram.GATE_HIDDENS for t in oracle_engram.TOKENS]
    + [
        GateLayerParams(4001, 4096, clamp_value=0.3),
        GateLayerParams(8192, 4096, batch=2, main_grad=True),
        GateLayerParams(4001, 7168, main_grad=True),
    ],
}


def _keep_s_in_range(x, k, w, clamp_value: float, generator) -> None:
    """Redraw (in place) the k rows whose |s| is below 2·S_GAP_LAYER without being 0, or within 2^-10
    (relative) of the clamp value (where β jumps): the layer's bounds assume |s| ≥ S_GAP_LAYER."""
    for _ in range(100):
        s = oracle_engram._scores(x, k, w).abs()
        near_zero = (s > 0) & (s < 2 * S_GAP_LAYER)
        near_clamp = (s - clamp_value).abs() < 2 * 2.0**-10 * clamp_value
        bad = (near_zero | near_clamp).nonzero().tolist()
        if not bad:
            return
        for t, m in bad:
            k[t, m] = normal((k.shape[-1],), generator).to(BF16).float()
    raise RuntimeError("could not draw keys with |s| away from the gate's singular points")


class EngramGateLayer(ModelingOp):
    layers = ("engram_gate",)
    outputs = (
        Output(
            "out",
            RelativeError(oracle_engram.OUT_BOUND, atol=oracle_engram.OUT_ATOL),
            "as engram_gate_fwd's out: bf16(x + gate·v), 2^-8 rounding plus the gate's error times |v| ≤ 6; "
            "atol 2 for cancellations of x and gate·v",
        ),
        Output(
            "grad_hidden_states",
            RelativeError(GATE_LAYER_DX_BOUND, atol=GATE_LAYER_DX_ATOL),
            "bf16(go + β·a): 2^-8 rounding plus β's error from the fp32 statistics (≈ 1.9e-3: |s| ≥ 2^-4) on "
            "|β·a| ≤ 16 (premise), against max(|dx|, atol 4) where go and β·a cancel",
        ),
        Output(
            "grad_k",
            RelativeError(GATE_LAYER_DK_BOUND, atol=0.5),
            "bf16(β·b): 2^-8 rounding plus β's error (≈ 1.9e-3) plus fp32 room; atol ½ where b's products cancel",
        ),
        Output(
            "grad_v",
            RelativeError(GATE_LAYER_DV_BOUND, atol=GATE_LAYER_DV_ATOL),
            "bf16(Σ_m gate_m·go_m): 2^-8 rounding and fp32 sum plus the saved gates' 2^-12 on Σ_m gate_m·|go_m| ≤ 16 "
            "(premise), against max(|dv|, atol 2)",
        ),
        Output("grad_weight_hidden", RelativeError(GATE_LAYER_DW_BOUND, atol=GATE_LAYER_DW_ATOL), WHY_GATE_DW),
        Output("grad_weight_embed", RelativeError(GATE_LAYER_DW_BOUND, atol=GATE_LAYER_DW_ATOL), WHY_GATE_DW),
    )

    def cases(self, tier):
        def label(p: GateLayerParams) -> str:
            text = f"{self.name}/T{p.tokens}/n{N}/D{p.hidden}" + (f"/B{p.batch}" if p.batch > 1 else "")
            text += "" if p.clamp_value == oracle_engram.CLAMP else f"/clamp{p.clamp_value:g}"
            return text + ("/main_grad" if p.main_grad else "")

        return [Case(self.name, label(p), p) for p in GATE_LAYER_CASES[tier]]

    def kernel_group(self, case):
        p: GateLayerParams = case.params
        return None if p.tokens == 0 else (self.name, p.hidden)

    def build(self, case, device, generator):
        p: GateLayerParams = case.params
        T, D = p.tokens, p.hidden
        lead = (p.batch, T // p.batch) if p.batch > 1 else (T,)
        report_scales = (1.0, 1.0)
        if generator is None:
            x = torch.empty((*lead, N, D), dtype=BF16, device=device)
            kv = torch.empty((*lead, (N + 1) * D), dtype=BF16, device=device)
            wh, we = (torch.empty((N, D), dtype=BF16, device=device) for _ in range(2))
            grad = torch.empty((*lead, N, D), dtype=BF16, device=device)
            main_grads = [torch.empty((N, D), dtype=F32, device=device) for _ in range(2)] if p.main_grad else None
        else:
            wh, we = (oracle_engram._gains(D, "cpu", generator, 0.1) for _ in range(2))
            w = reference_engram.fused_weight(wh, we)
            x = normal((T, N, D), generator).to(BF16).float()
            k = normal((T, N, D), generator).to(BF16).float()
            v = normal((T, D), generator)
            if T >= 3:
                x[1, 2] = 0.0  # only eps keeps rstd_x finite; s = 0: gate ½, the clamped branch
                k[2, 0] = 0.0
            _keep_s_in_range(x, k, w, p.clamp_value, generator)
            kv = torch.cat([rearrange(k, "t m d -> t (m d)"), v], dim=1).to(BF16)
            x, kv = x.to(BF16).reshape(*lead, N, D).to(device), kv.reshape(*lead, (N + 1) * D).to(device)
            wh, we = wh.to(device), we.to(device)
            grad = normal((T, N, D), generator).to(BF16).reshape(*lead, N, D).to(device)
            rss = _gain_term_rss(x, kv, wh, we, grad, p.clamp_value)
            report_scales = tuple(_pow2_scale(float(r.max()) if r.numel() else 0.0) for r in rss)
            main_grads = None
            if p.main_grad:  # earlier gradients already accumulated: O(1) once reported
                main_grads = [normal((N, D), generator, 1 / scale).to(device) for scale in report_scales]
        kwargs = {"main_grads": main_grads} if p.main_grad else {}
        return Call((x, kv, wh, we, p.clamp_value, oracle_engram.EPS, grad, report_scales), kwargs)

    def drive(
        self,
        layers,
        hidden_states,
        kv,
        weight_hidden,
        weight_embed,
        clamp_value,
        eps,
        grad_output,
        report_scales,
        main_grads=None,
    ):
        streams, hidden = weight_hidden.shape
        x, kv, wh, we = _leaf(hidden_states), _leaf(kv), _leaf(weight_hidden), _leaf(weight_embed)
        if main_grads is not None:
            wh.main_grad, we.main_grad = (buffer.clone() for buffer in main_grads)
        k = kv[..., : streams * hidden].unflatten(-1, (streams, hidden))
        v = kv[..., streams * hidden :]
        with torch.enable_grad():
            out = layers.engram_gate(x, k, v, wh, we, clamp_value, eps)
            out.backward(grad_output)

        def finish():
            grad_kv = _grad(kv)
            grad_k = grad_kv[..., : streams * hidden].unflatten(-1, (streams, hidden)).contiguous()
            grad_v = grad_kv[..., streams * hidden :].contiguous()
            gains = (wh.main_grad, we.main_grad) if main_grads is not None else (_grad(wh), _grad(we))
            reported = (g * scale for g, scale in zip(gains, report_scales, strict=True))
            return (out.detach(), _grad(x), grad_k, grad_v, *reported)

        return Driven(finish)

    def expected_layout(self, case):
        p: GateLayerParams = case.params
        lead = (p.batch, p.tokens // p.batch) if p.batch > 1 else (p.tokens,)
        streams = (BF16, (*lead, N, p.hidden))
        gain = (F32 if p.main_grad else BF16, (N, p.hidden))
        return (streams, streams, streams, (BF16, (*lead, p.hidden)), gain, gain)

    def bytes_moved(self, case):
        p: GateLayerParams = case.params
        T, D = p.tokens, p.hidden
        forward = T * N * D * 2 * 2 + T * D * 2 + N * D * 2 * 2 + T * N * D * 2 + 4 * T * N * 4
        backward = T * N * D * 2 * 3 + T * D * 2 + 4 * T * N * 4 + T * N * D * 2 * 2 + T * D * 2
        gains = N * D * (2 * 2 + (4 * 2 if p.main_grad else 2) * 2)
        return forward + backward + gains

    def explicit_float64(self, case, call):
        x, kv, wh, we, clamp, eps, grad, report_scales = call.args
        streams, hidden = wh.shape
        x64 = f64_tokens(x, streams, hidden)
        k64 = f64_tokens(kv[..., : streams * hidden], streams, hidden)
        v64 = kv.detach().to(F64)[..., streams * hidden :].reshape(-1, hidden)
        wh64, we64 = wh.detach().to(F64), we.detach().to(F64)
        _, *stats = reference_engram.gate_forward_math(x64, k64, v64, wh64 * we64, eps, clamp)
        dx, dk, dv, dw = reference_engram.gate_backward_math(
            f64_tokens(grad, streams, hidden), x64, k64, v64, wh64 * we64, *stats, clamp, 3
        )
        total = reduce(dw, "p m d -> m d", "sum")  # grad_w_reduce: grad_wh += G⊙we, grad_we += G⊙wh
        grad_wh, grad_we = total * we64, total * wh64
        main_grads = call.kwargs.get("main_grads")
        if main_grads is not None:
            grad_wh, grad_we = grad_wh + main_grads[0].to(F64), grad_we + main_grads[1].to(F64)
        return (
            dx.reshape(x.shape),
            dk.reshape(x.shape),
            dv.reshape(*x.shape[:-2], hidden),
            grad_wh * report_scales[0],
            grad_we * report_scales[1],
        )

    def extra_checks(self, case, call, outputs):
        x, kv, wh, we, clamp, eps, grad, _ = call.args
        streams, hidden = wh.shape
        x64 = f64_tokens(x, streams, hidden)
        k64 = f64_tokens(kv[..., : streams * hidden], streams, hidden)
        v64 = kv.detach().to(F64)[..., streams * hidden :].reshape(-1, hidden)
        w64 = wh.detach().to(F64) * we.detach().to(F64)
        go64 = f64_tokens(grad, streams, hidden)
        _, dot, gate, rstd_x, rstd_k = reference_engram.gate_forward_math(x64, k64, v64, w64, eps, clamp)
        s = dot * rstd_x * rstd_k * hidden**-0.5
        dx, _, _, _ = reference_engram.gate_backward_math(go64, x64, k64, v64, w64, dot, gate, rstd_x, rstd_k, clamp)
        gate_sum = reduce(rearrange(gate, "t m -> t m 1") * go64.abs(), "t m d -> t d", "sum")
        checks = [
            _premise_check("|s|", _worst(s), S_MAX),
            _check_gap(s[s != 0].abs()),
            _premise_check("|β·a|", _worst(dx - go64), BETA_A_MAX),
            _premise_check("Σ_m gate_m·|go_m|", _worst(gate_sum), GATE_SUM_MAX),
        ]
        if input_elements(call) <= FLOAT64_CHECK_ELEMENTS:
            checks += self.main_grad_checks(call)
        return checks

    def main_grad_checks(self, call: Call) -> list[Check]:
        """main_grad: the unrounded fp32 gradient is added in place, accumulates over backwards, its bf16
        rounding is exactly the .grad of a gain without main_grad, and .grad stays None."""
        x, kv, wh, we, clamp, eps, grad, _ = call.args
        streams, hidden = wh.shape

        def backward(main_grads, times=1):
            gains = [_leaf(wh.clone()), _leaf(we.clone())]
            if main_grads is not None:
                for gain, buffer in zip(gains, main_grads, strict=True):
                    gain.main_grad = buffer.clone()
            k = kv[..., : streams * hidden].unflatten(-1, (streams, hidden))
            for _ in range(times):
                with torch.enable_grad():
                    reference_modeling.engram_gate(x, k, kv[..., streams * hidden :], *gains, clamp, eps).backward(grad)
            return gains

        plain = backward(None)
        zero = [torch.zeros((streams, hidden), dtype=F32, device=wh.device) for _ in range(2)]
        routed = backward(zero)
        initial = [normal((streams, hidden), torch.Generator().manual_seed(1)).to(wh.device) for _ in range(2)]
        twice = backward(initial, times=2)
        checks = []
        for name, p, r, t, start in zip(("weight_hidden", "weight_embed"), plain, routed, twice, initial, strict=True):
            fp32 = r.main_grad
            ok = (
                r.grad is None
                and t.grad is None
                and bool(torch.equal(fp32.to(BF16), p.grad))
                and bool(torch.equal(t.main_grad, (start + fp32) + fp32))
            )
            detail = "" if ok else "main_grad is not the fp32 gradient added in place (or .grad was written)"
            checks.append(
                Check(
                    f"main_grad ({name}): += fp32 gradient, ≡ .grad unrounded, .grad None",
                    PASS if ok else FAIL,
                    "bitwise",
                    "",
                    detail,
                )
            )
        return checks


def _gain_term_rss(x, kv, wh, we, grad, clamp_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The RSS over tokens of the terms of dwh = Σ_t β·x⊙k⊙we and of dwe (float64 ``[n, D]``)."""
    streams, hidden = wh.shape
    x64 = f64_tokens(x, streams, hidden)
    k64 = f64_tokens(kv[..., : streams * hidden], streams, hidden)
    v64 = kv.to(F64)[..., streams * hidden :].reshape(-1, hidden)
    wh64, we64 = wh.to(F64), we.to(F64)
    _, *stats = reference_engram.gate_forward_math(x64, k64, v64, wh64 * we64, oracle_engram.EPS, clamp_value)
    go64 = f64_tokens(grad, streams, hidden)
    # One token per block: dw_partial holds every token's term β·x⊙k.
    tokens = max(x64.shape[0], 1)
    _, _, _, terms = reference_engram.gate_backward_math(go64, x64, k64, v64, wh64 * we64, *stats, clamp_value, tokens)
    squares = reduce(terms * terms, "t m d -> m d", "sum")
    return torch.sqrt(squares) * we64.abs(), torch.sqrt(squares) * wh64.abs()


def f64_tokens(tensor: torch.Tensor, streams: int, hidden: int) -> torch.Tensor:
    """``[..., n, D]`` (or a ``[..., n·D]`` view) → float64 ``[T, n, D]``."""
    return tensor.detach().to(F64).reshape(-1, streams, hidden)


def _check_gap(nonzero_s: torch.Tensor) -> Check:
    smallest = float(nonzero_s.min()) if nonzero_s.numel() else float("inf")
    ok = smallest >= S_GAP_LAYER
    metric = f"{smallest:.3g}" if nonzero_s.numel() else "none"
    return Check(
        "premise |s| ≥ 2^-4 where s ≠ 0", PASS if ok else FAIL, "premise", metric, "" if ok else f"|s| = {smallest:.3g}"
    )


# ---------------------------------------------------------------------------------------------
# mHC pipeline
# ---------------------------------------------------------------------------------------------

NORM_EPS = 1e-6
PRE_EPS = 1e-6
HEAD_SCALE = (2.0**-5, 2.0**-4)  # as the big fuse's s0: the head's weights are pre weights
# Two blocks: after expand_from_embedding the n streams are equal, so the first block's comb acts
# only through its column sums (a comb read transposed is invisible there) and its gradient through
# Sinkhorn vanishes; the second block's streams differ.
BLOCKS = 2

# Forward outputs. Every coefficient is positive (pre, post, comb, the sublayer gains g, the head
# weights), so every stream stays h times a positive factor per (token, stream, channel): no
# cancellation, relative errors add. With mhc_pre_big_fuse's inputs and premises (|mixes| ≤ 4, RSS
# ≤ 0.75, Sinkhorn gain ≤ 6, the head's mixes included), one block's residual
# bf16(post_o·bf16(bf16(Σ_i pre_i·X_i)·g) + Σ_i comb[i, o]·X_i) adds three bf16 roundings and the
# pre, post and comb errors (plus fp32 room) to its input streams' relative error:
BLOCK_ERROR = (
    3 * U_BF16
    + oracle_mhc.BIG_FUSE_PRE_BOUND
    + oracle_mhc.BIG_FUSE_POST_BOUND
    + oracle_mhc.BIG_FUSE_COMB_BOUND
    + 2.0**-12
)
PIPELINE_RESIDUAL_BOUND = BLOCKS * BLOCK_ERROR  # the last block's
# A block's layer input bf16(Σ_i pre_i·X_i): its rounding, the pre weights' error, its streams'.
PIPELINE_LAYER_INPUT_BOUND = BF16_BOUND + oracle_mhc.BIG_FUSE_PRE_BOUND + (BLOCKS - 1) * BLOCK_ERROR
# out = bf16(Σ_o w_o·residual_o), w the head weights σ(s_h·mixes + b) + eps (as pre: s_h ≤ 2^-4).
HEAD_WEIGHT_BOUND = HEAD_SCALE[1] * oracle_mhc.MIXES_ERROR + oracle_mhc.SIGMOID_BOUND
PIPELINE_OUT_BOUND = U_BF16 + PIPELINE_RESIDUAL_BOUND + HEAD_WEIGHT_BOUND + 2.0**-12
# Gradients. A parameter's gradient is a sum over tokens and channels of products that carry the
# chain's bf16 storage roundings (layer inputs, y, residuals, and the bf16 gradients of out, y, the
# layer inputs and the streams). Its inner sums (d_pre, d_post, d_comb, the head's d_weights: over
# C) cancel, so errors scale with the RSS of the elementary (token, channel) terms, not with the
# sums: the report scale brings that RSS into (½, 1] (``_mixes_terms`` carries it through σ', the
# scales and the Sinkhorn Jacobian) and atol 1 measures against it. An analytic bound would
# multiply 2^-8 by per-element gains of the whole chain; the bound is ≥ 3× the largest error fp32
# twins with this storage showed (the reference, T ≤ 4001, C ≤ 4096: ≤ 0.0121; before the terms
# were counted over channels a T = 1 case reached 0.233 through one cancelled d_mixes), and every
# case checks that its own reference stays within half of it (premise "margin"). dh sums stream
# gradients that cancel too: its bound is analytic against their magnitudes (``EMBEDDING_SCALE``).
# These bounds catch wiring (a gradient routed wrong, dropped or transposed), not rounding: the
# operators' own specs hold those to tight bounds.
PIPELINE_PARAMETER_BOUND = 2.0**-3
PIPELINE_EMBEDDING_BOUND = 2.0**-4
EMBEDDING_SCALE = "the float64 backward with every term by magnitude (d_mixes raised to its channel terms' RSS)"
PIPELINE_GRAD_MARGIN = 0.5
WHY_PIPELINE_PARAMETER = (
    "Σ over tokens and channels of terms carrying the chain's bf16 storage roundings, reported × a power of two "
    "that brings the terms' RSS into (½, 1] (atol 1): ≥ 3× the largest error of fp32 twins with that storage "
    "(0.0121), and each case's reference within half the bound (checked)"
)
PARAMETERS = ("fn", "scale", "base", "norm_weight")  # of each block's mhc_pre, stacked over blocks
# (tokens, hidden, pad): the mHC stream shapes (quick: a smaller odd T, the layers run twice in float64).
PIPELINE_SHAPES = {
    "quick": [(0, 64, 0), (1, 64, 0), (13, 128, 0), (5, 64, oracle_mhc.PAD), (3, 1280, 0)],
    "full": oracle_mhc.STREAM_SHAPES["full"],
}


@dataclass(frozen=True)
class PipelineParams:
    tokens: int
    hidden: int  # C
    pad: int = 0  # the embedding is a view of rows `pad` elements longer (NaN padding)
    repeat: int = 20  # Sinkhorn iterations
    post_mult: float = 2.0


def _sublayer(layer_input: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """The fixed sublayer ``y = u ⊙ g`` in the math dtype, rounded once to u's storage dtype."""
    compute = F64 if layer_input.dtype == F64 else F32
    return (layer_input.to(compute) * gain.to(compute)).to(layer_input.dtype)


def _parameter_output(name: str) -> Output:
    return Output(name, RelativeError(PIPELINE_PARAMETER_BOUND, atol=1.0), WHY_PIPELINE_PARAMETER)


def _per_block(gradient: torch.Tensor, scales: tuple[float, ...]) -> torch.Tensor:
    """A stacked ``[blocks, ...]`` gradient, block b times ``scales[b]`` (exact powers of two)."""
    factors = torch.tensor(scales, dtype=gradient.dtype, device=gradient.device)
    return gradient * factors.reshape(-1, *([1] * (gradient.dim() - 1)))


class MhcPipeline(ModelingOp):
    layers = ("expand_from_embedding", "mhc_pre", "mhc_post", "mhc_head")
    outputs = (
        Output(
            "out",
            RelativeError(PIPELINE_OUT_BOUND),
            "bf16(Σ_o w_o·residual_o), every factor positive (no cancellation): 2^-8 rounding plus the last "
            "residual's and the head weights' relative errors (TF32 mixes through s_h ≤ 2^-4)",
        ),
        Output(
            "layer_inputs",
            RelativeError(PIPELINE_LAYER_INPUT_BOUND),
            "[blocks] bf16(Σ_i pre_i·X_i), all positive: 2^-8 rounding, the pre weights' error (TF32 mixes "
            "through s0 ≤ 2^-4), and the streams' own (one block's for the second)",
        ),
        Output("post_mixes", RelativeError(oracle_mhc.BIG_FUSE_POST_BOUND), "[blocks] as mhc_pre_big_fuse's post_mix"),
        Output(
            "comb_mixes",
            RelativeError(oracle_mhc.BIG_FUSE_COMB_BOUND, atol=2.0**-10),
            "[blocks] as mhc_pre_big_fuse's comb_mix",
        ),
        Output(
            "residuals",
            RelativeError(PIPELINE_RESIDUAL_BOUND),
            "[blocks] bf16(post_o·y + Σ_i comb[i, o]·X_i), all positive: per block three bf16 roundings (layer "
            "input, y, residual) plus the pre, post and comb errors, on top of the streams' own",
        ),
        Output(
            "grad_embedding",
            RelativeError(PIPELINE_EMBEDDING_BOUND, scale=EMBEDDING_SCALE),
            "Σ over streams of gradients that cancel: each of its ≤ 10 bf16 roundings on a path (head, per block "
            "dy, d(layer input), the pre's dX and the residual's sum, the expand) is ≤ 2^-9 of a value that S "
            "bounds (positive weights), so ≤ 10·2^-9 ≈ 0.02 of S, plus the norm-fn terms' statistical part; bound "
            "≥ 3× that, and each case's reference within half of it",
        ),
        *(_parameter_output(f"grad_{name}") for name in PARAMETERS),
        *(_parameter_output(f"grad_head_{name}") for name in PARAMETERS),
    )

    def cases(self, tier):
        cases = []
        for index, (tokens, hidden, pad) in enumerate(PIPELINE_SHAPES[tier]):
            even = index % 2 == 0
            p = PipelineParams(tokens, hidden, pad, 20 if even else 10, 2.0 if even else 1.0)
            label = f"{self.name}/T{tokens}/C{hidden}/R{p.repeat}/post{p.post_mult:g}" + ("/strided" if pad else "")
            cases.append(Case(self.name, label, p))
        return cases

    def kernel_group(self, case):
        p: PipelineParams = case.params
        return None if p.tokens == 0 else (self.name, p.hidden, p.repeat, bool(p.pad))

    def build(self, case, device, generator):
        p: PipelineParams = case.params
        T, C, width = p.tokens, p.hidden, N * p.hidden
        fn_scale = 0.5 * inverse_sqrt_pow2(width)

        def make(shape, dtype, values: Callable[[], torch.Tensor]) -> torch.Tensor:
            if generator is None:
                return torch.empty(shape, dtype=dtype, device=device)
            return values().to(dtype=dtype, device=device)

        def scales() -> torch.Tensor:
            return torch.stack(
                [
                    torch.cat([uniform((1,), generator, lo, hi) for lo, hi in oracle_mhc.BIG_FUSE_SCALES])
                    for _ in range(BLOCKS)
                ]
            )

        embedding = place(normal((T, C), generator) if generator is not None else None, (T, C), BF16, device, p.pad)
        gains = make((BLOCKS, C), BF16, lambda: uniform((BLOCKS, C), generator, 0.5, 1.5))
        fn = make((BLOCKS, M, width), F32, lambda: normal((BLOCKS, M, width), generator, fn_scale))
        scale = make((BLOCKS, 3), F32, scales)
        base = make((BLOCKS, M), F32, lambda: uniform((BLOCKS, M), generator, -3.3, 3.3))
        norm_weight = make((BLOCKS, width), F32, lambda: uniform((BLOCKS, width), generator, 0.9, 1.1))
        head_fn = make((N, width), F32, lambda: normal((N, width), generator, fn_scale))
        head_scale = make((1,), F32, lambda: uniform((1,), generator, *HEAD_SCALE))
        head_base = make((N,), F32, lambda: uniform((N,), generator, -3.3, 3.3))
        head_norm_weight = make((width,), F32, lambda: uniform((width,), generator, 0.9, 1.1))
        grad = make((T, C), BF16, lambda: normal((T, C), generator))
        args = (embedding, gains, fn, scale, base, norm_weight, head_fn, head_scale, head_base, head_norm_weight, grad)
        options = {
            "norm_eps": NORM_EPS,
            "post_mult_value": p.post_mult,
            "pre_eps": PRE_EPS,
            "sinkhorn_eps": oracle_mhc.SINKHORN_EPS,
            "sinkhorn_repeat": p.repeat,
        }
        unit = ((1.0,) * BLOCKS,) * len(PARAMETERS) + (1.0,) * len(PARAMETERS)
        call = Call((*args, unit), options)
        if generator is not None:
            rss = self.backward_float64(call)[2]
            blocks = tuple(tuple(_pow2_scale(_worst(r)) for r in per_block) for per_block in rss[: len(PARAMETERS)])
            call.args = (*args, blocks + tuple(_pow2_scale(_worst(r)) for r in rss[len(PARAMETERS) :]))
        return call

    def drive(
        self,
        layers,
        embedding,
        sublayer_gains,
        fn,
        scale,
        base,
        norm_weight,
        head_fn,
        head_scale,
        head_base,
        head_norm_weight,
        grad_output,
        report_scales,
        *,
        norm_eps,
        post_mult_value,
        pre_eps,
        sinkhorn_eps,
        sinkhorn_repeat,
    ):
        h = _leaf(embedding)
        parameters = [
            _leaf(t) for t in (fn, scale, base, norm_weight, head_fn, head_scale, head_base, head_norm_weight)
        ]
        fn, scale, base, norm_weight, head_fn, head_scale, head_base, head_norm_weight = parameters
        blocks = []
        with torch.enable_grad():
            streams = layers.expand_from_embedding(h, N)
            for block in range(fn.shape[0]):
                layer_input, (post_mix, comb_mix) = layers.mhc_pre(
                    streams,
                    fn[block],
                    scale[block],
                    base[block],
                    norm_weight=norm_weight[block],
                    norm_eps=norm_eps,
                    mhc_mult=N,
                    post_mult_value=post_mult_value,
                    pre_eps=pre_eps,
                    sinkhorn_eps=sinkhorn_eps,
                    sinkhorn_repeat=sinkhorn_repeat,
                )
                streams = layers.mhc_post(_sublayer(layer_input, sublayer_gains[block]), streams, post_mix, comb_mix)
                blocks.append((layer_input, post_mix, comb_mix, streams))
            out = layers.mhc_head(
                streams,
                head_fn,
                head_scale,
                head_base,
                norm_weight=head_norm_weight,
                norm_eps=norm_eps,
                mhc_mult=N,
                pre_eps=pre_eps,
            )
            out.backward(grad_output)

        def finish():
            forward = [torch.stack([block[k].detach() for block in blocks]) for k in range(4)]
            stacked = [_per_block(_grad(t), s) for t, s in zip(parameters[:4], report_scales[:4], strict=True)]
            head = [_grad(t) * s for t, s in zip(parameters[4:], report_scales[4:], strict=True)]
            return (out.detach(), *forward, _grad(h), *stacked, *head)

        return Driven(finish)

    def expected_layout(self, case):
        p: PipelineParams = case.params
        T, C, width = p.tokens, p.hidden, N * p.hidden
        return (
            (BF16, (T, C)),
            (BF16, (BLOCKS, T, C)),
            (F32, (BLOCKS, T, N)),
            (F32, (BLOCKS, T, N, N)),
            (BF16, (BLOCKS, T, N, C)),
            (BF16, (T, C)),
            (F32, (BLOCKS, M, width)),
            (F32, (BLOCKS, 3)),
            (F32, (BLOCKS, M)),
            (F32, (BLOCKS, width)),
            (F32, (N, width)),
            (F32, (1,)),
            (F32, (N,)),
            (F32, (width,)),
        )

    def bytes_moved(self, case):
        p: PipelineParams = case.params
        T, C, width = p.tokens, p.hidden, N * p.hidden
        parameters = BLOCKS * (M * width * 4 + width * 4 + (3 + M) * 4) + N * width * 4 + width * 4 + (1 + N) * 4
        expand = T * (C * 2 + width * 2)
        # per block: norm-fn and pre-apply read the streams twice; the post reads y and the streams
        block = T * (width * 2 * 2 + C * 2 + (N + N * N) * 4) + T * (C * 2 + width * 2 + width * 2)
        head = T * (width * 2 * 2 + C * 2)
        # the backward moves about twice the forward's traffic, and writes the parameter gradients
        return (expand + BLOCKS * block + head) * 3 + parameters * 2

    def forward_float64(self, call: Call) -> dict:
        """The pipeline's forward in float64 by the ``*_math`` steps, every intermediate kept (computed
        once per call)."""
        if "forward64" not in call.context:
            call.context["forward64"] = self._forward_float64(call)
        return call.context["forward64"]

    def _forward_float64(self, call: Call) -> dict:
        h, gains, fn, scale, base, gamma, head_fn, head_scale, head_base, head_gamma = (
            t.detach().to(F64) for t in call.args[:10]
        )
        options = call.kwargs
        eps, pre_eps = options["norm_eps"], options["pre_eps"]
        rm = reference_mhc
        streams = rearrange(h, "t c -> t 1 c").expand(h.shape[0], N, h.shape[1])
        blocks = []
        for b in range(fn.shape[0]):
            mixes = rm.norm_fn_forward_math(_flat(streams), fn[b] * gamma[b], eps)
            pre, post, logits = rm.split_mixes_forward_math(
                mixes, scale[b], base[b], N, options["post_mult_value"], pre_eps
            )
            comb = rm.sinkhorn_forward_math(logits, options["sinkhorn_repeat"], options["sinkhorn_eps"])
            y = rm.apply_mix_forward_math(streams, pre) * gains[b]
            block = dict(x=streams, fn=fn[b], gamma=gamma[b], scale=scale[b], base=base[b], gain=gains[b])
            block.update(mixes=mixes, pre=pre, post=post, logits=logits, comb=comb, y=y)
            blocks.append(block)
            streams = rm.post_forward_math(y, streams, post, comb)
        head_mixes = rm.norm_fn_forward_math(_flat(streams), head_fn * head_gamma, eps)
        head = dict(x=streams, fn=head_fn, gamma=head_gamma, scale=head_scale, base=head_base, mixes=head_mixes)
        head["weights"] = rm.head_mix_forward_math(head_mixes, head_scale, head_base, pre_eps)
        return {"blocks": blocks, "head": head}

    def extra_checks(self, case, call, outputs):
        steps = self.forward_float64(call)
        options = call.kwargs
        checks = []
        sites = [(f"block {b}", block) for b, block in enumerate(steps["blocks"])] + [("head", steps["head"])]
        for site, step in sites:
            flat = _flat(step["x"])
            normed = flat * torch.rsqrt(reduce(flat * flat, "t k -> t 1", "mean") + options["norm_eps"])
            folded = step["fn"] * step["gamma"]
            rss = torch.sqrt((normed * normed) @ (folded * folded).T)
            checks += [
                _premise_check(f"|mixes| ({site})", _worst(step["mixes"]), oracle_mhc.MIXES_MAX),
                _premise_check(f"RSS of the GEMM's terms ({site})", _worst(rss), oracle_mhc.MIXES_RSS_MAX),
            ]
            if "logits" in step:
                gain = oracle_mhc._sinkhorn_gain(step["logits"], options["sinkhorn_repeat"], options["sinkhorn_eps"])
                checks.append(_premise_check(f"Sinkhorn gain ({site})", _worst(gain), oracle_mhc.SINKHORN_GAIN_MAX))
        # The gradients' bounds are empirical: this case's reference must keep the margin.
        expected = self.reference_float64(case, call)
        for index, output in enumerate(self.outputs):
            if output.name.startswith("grad_"):
                policy = dataclasses.replace(output.policy, bound=output.policy.bound * PIPELINE_GRAD_MARGIN)
                name = f"margin: reference within ½ of the bound: {output.name}"
                checks.append(compare(name, outputs[index], outputs[index], policy, expected64=expected[index]))
        return checks

    def backward_float64(self, call: Call) -> tuple[torch.Tensor, tuple, tuple, torch.Tensor]:
        """``(dh, the parameter gradients, the RSS of each one's terms, dh's error scale)`` by the
        explicit backward references in float64, unscaled; the blocks' gradients and RSS stacked
        ``[blocks, ...]``. The terms: of dfn̂ = Σ_t dmul ⊗ x, dγ = Σ_{t, j} dmul·x·fn, dscale =
        Σ_{t, j ∈ group} dz·mixes, dbase = Σ_t dz (dz: the gradient of z = s·mixes + b), with the
        channel terms of each d_mixes counted (``_mixes_terms``). dh's error scale: the same
        backward with every term taken by magnitude (``_stream_scale``). Computed once per call."""
        if "backward64" not in call.context:
            call.context["backward64"] = self._backward_float64(call)
        return call.context["backward64"]

    def _backward_float64(self, call: Call) -> tuple[torch.Tensor, tuple, tuple, torch.Tensor]:
        steps = self.forward_float64(call)
        grad = call.args[10].detach().to(F64)
        options = call.kwargs
        eps, repeat, s_eps = options["norm_eps"], options["sinkhorn_repeat"], options["sinkhorn_eps"]
        rm = reference_mhc
        head = steps["head"]
        d_x_apply, d_weights = rm.apply_mix_backward_math(grad, head["x"], head["weights"])
        d_head_mixes, d_head_scale, d_head_base = rm.head_mix_backward_math(
            d_weights, head["mixes"], head["scale"], head["base"]
        )
        d_x_norm, d_head_folded = rm.norm_fn_backward_math(
            d_head_mixes, _flat(head["x"]), head["fn"] * head["gamma"], eps
        )
        d_x = d_x_apply + rearrange(d_x_norm, "t (i c) -> t i c", i=N)
        head_gradients = (
            d_head_folded * head["gamma"],
            d_head_scale,
            d_head_base,
            reduce(d_head_folded * head["fn"], "m k -> k", "sum"),
        )
        # The terms: d_weights[t, o] = Σ_c g·X_o is itself a sum over channels (it cancels, and its
        # error scales with its terms, not with it), so the parameters' terms are counted over (t, c).
        weight_terms = _channel_rss(grad, head["x"], "t c, t o c -> t o")
        head_mixes_terms = rm.head_mix_backward_math(weight_terms, head["mixes"], head["scale"], head["base"])[0].abs()
        head_norm_rss = _norm_fn_term_rss(head_mixes_terms, _flat(head["x"]), head["fn"], head["gamma"], eps)
        head_split_rss = _affine_term_rss(head_mixes_terms / head["scale"].abs(), head["mixes"], (N,))
        head_rss = (head_norm_rss[0], head_split_rss[0], head_split_rss[1], head_norm_rss[1])
        # dh's error scale: every stream gradient's terms by magnitude (the weights are positive).
        stream_scale = d_x_apply.abs() + _norm_fn_input_scale(
            d_head_mixes, head_mixes_terms, _flat(head["x"]), head["fn"] * head["gamma"], eps
        )
        block_gradients, block_rss = [], []
        for step in reversed(steps["blocks"]):
            x, fn, gamma = step["x"], step["fn"], step["gamma"]
            d_y, d_x_post, d_post, d_comb = rm.post_backward_math(d_x, step["y"], x, step["post"], step["comb"])
            d_x_apply, d_pre = rm.apply_mix_backward_math(d_y * step["gain"], x, step["pre"])
            d_mixes_terms = _mixes_terms(step, d_x, d_y * step["gain"], options)
            d_logits = rm.sinkhorn_backward_math(d_comb, step["logits"], repeat, s_eps)
            d_mixes, d_scale, d_base = rm.split_mixes_backward_math(
                d_pre, d_post, d_logits, step["mixes"], step["scale"], step["base"], N, options["post_mult_value"]
            )
            d_x_norm, d_folded = rm.norm_fn_backward_math(d_mixes, _flat(x), fn * gamma, eps)
            d_x = d_x_post + d_x_apply + rearrange(d_x_norm, "t (i c) -> t i c", i=N)
            # γ folded into fn: dfn = dfn̂⊙γ, dγ = Σ_j dfn̂⊙fn
            block_gradients.insert(0, (d_folded * gamma, d_scale, d_base, reduce(d_folded * fn, "m k -> k", "sum")))
            group = torch.cat([step["scale"][k : k + 1].expand(size) for k, size in enumerate((N, N, N * N))])
            norm_rss = _norm_fn_term_rss(d_mixes_terms, _flat(x), fn, gamma, eps)
            split_rss = _affine_term_rss(d_mixes_terms / group.abs(), step["mixes"], (N, N, N * N))
            block_rss.insert(0, (norm_rss[0], split_rss[0], split_rss[1], norm_rss[1]))
            layer_input_scale = einsum(step["post"], stream_scale, "t o, t o c -> t c") * step["gain"]
            stream_scale = (
                einsum(step["comb"], stream_scale, "t i o, t o c -> t i c")
                + einsum(step["pre"], layer_input_scale, "t i, t c -> t i c")
                + _norm_fn_input_scale(d_mixes, d_mixes_terms, _flat(x), fn * gamma, eps)
            )
        stacked = tuple(torch.stack([g[k] for g in block_gradients]) for k in range(len(PARAMETERS)))
        stacked_rss = tuple(tuple(r[k] for r in block_rss) for k in range(len(PARAMETERS)))
        # expand: the streams' gradients summed
        d_h = reduce(d_x, "t i c -> t c", "sum")
        return d_h, stacked + head_gradients, stacked_rss + head_rss, reduce(stream_scale, "t i c -> t c", "sum")

    def reference_float64(self, case, call):
        """The float64 layers' outputs, grad_embedding with its error scale (``ScaledReference``)."""
        outputs = list(super().reference_float64(case, call))
        index = [output.name for output in self.outputs].index("grad_embedding")
        outputs[index] = ScaledReference(outputs[index], self.backward_float64(call)[3])
        return tuple(outputs)

    def explicit_float64(self, case, call):
        d_h, gradients = self.backward_float64(call)[:2]
        scales = call.args[11]
        blocks = [
            _per_block(g, s) for g, s in zip(gradients[: len(PARAMETERS)], scales[: len(PARAMETERS)], strict=True)
        ]
        head = [g * s for g, s in zip(gradients[len(PARAMETERS) :], scales[len(PARAMETERS) :], strict=True)]
        return (d_h, *blocks, *head)


def _flat(streams: torch.Tensor) -> torch.Tensor:
    return rearrange(streams, "t i c -> t (i c)")


def _channel_rss(a: torch.Tensor, b: torch.Tensor, pattern: str) -> torch.Tensor:
    """RSS over the summed channels of the products of an einsum ``a ⊙ b`` (same pattern)."""
    return torch.sqrt(einsum(a * a, b * b, pattern))


def _mixes_terms(step: dict, d_streams: torch.Tensor, d_layer_input: torch.Tensor, options: dict) -> torch.Tensor:
    """The RSS of the channel terms behind each d_mixes[t, j] of a block (float64 ``[T, n² + 2n]``).

    d_pre, d_post and d_comb are sums over C of products that cancel (random-sign gradients), so
    their storage errors scale with the RSS of those products, not with the sums. These RSS go
    through the block's backward as the sums do: through σ' (positive) and the scales for pre and
    post, and through the Sinkhorn Jacobian for comb, where the per-(i, o) terms meet in
    quadrature: every term of d_logits[t, j] is one channel's product times J[t, (i o), j]."""
    x = step["x"]
    pre_terms = _channel_rss(d_layer_input, x, "t c, t i c -> t i")
    post_terms = _channel_rss(step["y"], d_streams, "t c, t o c -> t o")
    comb_terms = _channel_rss(x, d_streams, "t i c, t o c -> t i o")
    jacobian = oracle_mhc.sinkhorn_jacobian(step["logits"], options["sinkhorn_repeat"], options["sinkhorn_eps"])
    logits_terms = torch.sqrt(einsum(jacobian**2, rearrange(comb_terms, "t i o -> t (i o)") ** 2, "t k j, t k -> t j"))
    d_mixes_terms, _, _ = reference_mhc.split_mixes_backward_math(
        pre_terms,
        post_terms,
        rearrange(logits_terms, "t (i o) -> t i o", i=N),
        step["mixes"],
        step["scale"],
        step["base"],
        N,
        options["post_mult_value"],
    )
    return d_mixes_terms.abs()


def _norm_fn_input_scale(d_mixes, d_mixes_terms, x, fn, eps: float) -> torch.Tensor:
    """The magnitude of norm_fn's input gradient ``dx = fnᵀ·dmul + 2·dsq·x`` term by term, each
    d_mixes raised to the RSS of its own channel terms (its error scales with those): ``[T, n, C]``."""
    width = x.shape[1]
    sq = reduce(x * x, "t k -> t 1", "sum")
    rstd = torch.rsqrt(sq / width + eps)
    scale = torch.maximum(d_mixes.abs(), d_mixes_terms)
    mul = einsum(x, fn, "t k, m k -> t m")
    d_sq = 0.5 * reduce(scale * mul.abs(), "t m -> t 1", "sum") * rstd / (sq + eps * width)
    magnitude = einsum(scale * rstd, fn.abs(), "t m, m k -> t k") + 2 * d_sq * x.abs()
    return rearrange(magnitude, "t (i c) -> t i c", i=N)


def _norm_fn_term_rss(d_mixes, x, fn, gamma, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RSS of the terms of dfn = γ⊙Σ_t dmul ⊗ x and of dγ = Σ_{t, j} dmul·x·fn (dmul = d_mixes·rstd)."""
    rstd = torch.rsqrt(reduce(x * x, "t k -> t 1", "mean") + eps)
    d_mul_squared = (d_mixes * rstd) ** 2
    d_fn = torch.sqrt(d_mul_squared.T @ (x * x)) * gamma.abs()
    d_gamma = torch.sqrt(reduce((x * x) * (d_mul_squared @ (fn * fn)), "t k -> k", "sum"))
    return d_fn, d_gamma


def _affine_term_rss(d_z, mixes, groups: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """RSS of the terms of dscale (Σ over tokens and a group's columns of dz·mixes) and of dbase
    (Σ over tokens of dz)."""
    squares = reduce((d_z * mixes) ** 2, "t j -> j", "sum")
    per_group = torch.stack([part.sum() for part in torch.split(squares, list(groups))])
    return torch.sqrt(per_group), torch.sqrt(reduce(d_z * d_z, "t j -> j", "sum"))


# --- registration -----------------------------------------------------------------------------

SPECS = (EngramGateLayer("engram_gate_layer"), MhcPipeline("mhc_pipeline"))
OPS = tuple(spec.name for spec in SPECS)
for _spec in SPECS:
    register(_spec)

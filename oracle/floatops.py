"""Shared machinery of the float families (Engram, mHC): error constants, inputs, self-checks.

The bounds of every float output follow one error model, stated here once:

- A stored bf16 output carries its rounding, at most ``U_BF16 = 2^-8`` relative (8 significant
  bits, round to nearest even); the fp32 arithmetic before it gets ``2^-12`` of room, so bf16
  outputs of short fp32 computations use ``BF16_BOUND = 2^-8 + 2^-12``.
- Short sums (n = 4 streams, a few products) use the worst case: K terms in fp32, in any order, are
  within ``(K + 1)·2^-24`` of the exact sum relative to the sum of the terms' magnitudes Σ|terms|.
  Near-zero results of a cancellation are compared absolutely: ``atol`` is chosen so that this
  error stays below the room the bound leaves after the output's rounding.
- Long sums of random-sign terms (over C, D, nC or T) use the probabilistic model of Higham and
  Mary (SIAM J. Sci. Comput. 2019): the rounding errors are independent and of either sign, so they
  add like a random walk, not in the worst case's lockstep. By Hoeffding's inequality an fp32 sum
  of K terms, each with an independent relative error ≤ e (its product's rounding; 2^-11 for a TF32
  operand), is within ``LAMBDA·(√K·2^-24 + e)·RSS`` of the exact sum, RSS being the terms'
  root-sum-square, except with probability ≤ 2·exp(−LAMBDA²/2) ≈ 7e-6 per element (the uniform
  rounding errors' real tail is far thinner: LAMBDA Hoeffding scales are > 8 standard deviations).
  The worst case K·2^-24·Σ|terms| is useless there: random-sign terms sum to |ref| ≈ RSS ≈
  Σ|terms|/√K, so it would admit errors of K^1.5·2^-24 of the result (30 % at K = nC = 28672).
  ``atol`` is then the scale of the RSS: the cases scale one input by an exact power of two
  (``inverse_sqrt_pow2``), among those the op is linear in or invariant to, so that every long sum's
  RSS lies within ``rss_per_atol``·atol whatever K is; powers of two are exact in bf16 and fp32, so
  the relative rounding of every value is unchanged (``random_sum_bound``).

A few outputs need more than this (the Engram gate's square root, Sinkhorn's iterations): their
modules state those bounds next to the outputs.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Hashable, Sequence

import torch

from .policy import FAIL, PASS, SKIP, Check, structure_mismatch
from .registry import Call, Case, OpSpec

U32 = 2.0**-24  # fp32 unit roundoff
LAMBDA = 5.0  # Hoeffding scales of the probabilistic bounds (see the module docstring)
U_BF16 = 2.0**-8  # bf16 unit roundoff (8 significant bits)
U_TF32 = 2.0**-11  # one operand rounded to TF32 (10 explicit mantissa bits), as tensor cores read fp32
BF16_BOUND = U_BF16 + 2.0**-12  # bf16 output rounding plus room for the fp32 error before it

# Self-checks that recompute in float64 (the reference within its bounds, autograd of the
# forward) run on cases up to this many input elements (every quick case; the small full ones).
FLOAT64_CHECK_ELEMENTS = 1 << 20
# Explicit backward vs autograd of the forward, both float64: normwise relative agreement.
AUTOGRAD_BOUND = 1e-9

F64 = torch.float64


def inverse_pow2(n: int) -> float:
    """``2^-ceil(log2 n)``: the power of two that brings a sum of n O(1) magnitudes to at most 1."""
    return 2.0 ** -math.ceil(math.log2(n)) if n > 1 else 1.0


def inverse_sqrt_pow2(n: int) -> float:
    """``2^-ceil(log2 √n)``: scales one factor of n random-sign O(1) terms so that their
    root-sum-square lies in (½, 1]·(the other factors' RMS)."""
    return 2.0 ** -math.ceil(0.5 * math.log2(n)) if n > 1 else 1.0


def random_sum_bound(terms: int, per_term: float = 2 * U32, rss_per_atol: float = 2.5) -> float:
    """The bound of an fp32 sum of ``terms`` random-sign terms, each with an independent relative
    error ≤ ``per_term``, measured against max(|ref|, atol) for cases whose root-sum-square of the
    terms is at most ``rss_per_atol``·atol: ``LAMBDA·(√K·2^-24 + per_term)·rss_per_atol``."""
    return LAMBDA * (math.sqrt(terms) * U32 + per_term) * rss_per_atol


def optimized_twin(family: str, name: str) -> Callable | None:
    """``tileproof.optimized.<family>.<name>``, or None while the family module or the function does
    not exist yet (the runner then checks the reference only)."""
    # jit first: it points TileLang's kernel cache at TILEPROOF_CACHE_DIR before TileLang loads.
    importlib.import_module("tileproof.optimized.jit")
    module_name = f"tileproof.optimized.{family}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise  # the module exists but something it imports is missing: a real error
        return None
    return getattr(module, name, None)


# --- inputs -----------------------------------------------------------------------------------


def unwritten_bf16(shape: Sequence[int], device) -> torch.Tensor:
    """A bf16 buffer of ``shape`` whose every byte is 0xFF (NaN): an output buffer handed to an operator
    that writes in place, so that an element it leaves unwritten fails the comparison."""
    return torch.full(tuple(shape), -1, dtype=torch.int16, device=device).view(torch.bfloat16)


def normal(shape: Sequence[int], generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """fp32 N(0, scale²) values on the CPU (round them to the storage dtype with ``.to``)."""
    return torch.randn(tuple(shape), generator=generator) * scale


def uniform(shape: Sequence[int], generator: torch.Generator, low: float, high: float) -> torch.Tensor:
    return torch.rand(tuple(shape), generator=generator) * (high - low) + low


def place(
    values: torch.Tensor | None,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    pad: int = 0,
) -> torch.Tensor:
    """A tensor of ``shape`` holding ``values`` (None: uninitialized), whose rows are ``pad`` elements
    longer than the last dimension when ``pad`` > 0: a view of a wider buffer whose padding holds
    NaN, so that a kernel reading past a row's end shows in its results."""
    shape = tuple(shape)
    wide_shape = shape[:-1] + (shape[-1] + pad,)
    if values is None:
        return torch.empty(wide_shape, dtype=dtype, device=device)[..., : shape[-1]]
    wide = torch.full(wide_shape, float("nan"), dtype=dtype) if pad else torch.empty(wide_shape, dtype=dtype)
    wide[..., : shape[-1]] = values.to(dtype)
    return wide.to(device)[..., : shape[-1]]


def input_elements(call: Call) -> int:
    return sum(t.numel() for t in call.tensors())


def f64(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().to(F64)


# --- the base class ---------------------------------------------------------------------------


class FloatOp(OpSpec):
    """An operator of the float families. Subclasses give ``name``, ``family``, ``outputs``,
    ``cases``, ``build``, ``bytes_moved``, ``expected_layout``, and for float math
    ``reference_float64``; explicit backwards also give ``autograd_float64``."""

    def reference(self) -> Callable:
        return getattr(importlib.import_module(f"tileproof.reference.{self.family}"), self.name)

    def optimized(self) -> Callable | None:
        return optimized_twin(self.family, self.name)

    def split(self, result) -> tuple[torch.Tensor, ...]:
        """The outputs as a tuple; an output the op returns as None (``save_for_backward=False``, no
        norm weight) becomes an empty fp32 tensor, so both twins must return None there (a tensor
        in its place has another shape and fails)."""
        values = tuple(result) if isinstance(result, (tuple, list)) else (result,)
        device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
        return tuple(torch.empty(0, device=device) if v is None else v for v in values)

    def compile_group(self, case: Case) -> Hashable | None:
        if self.optimized() is None:
            return None  # no optimized twin yet: nothing to compile
        return self.kernel_group(case)

    def kernel_group(self, case: Case) -> Hashable | None:
        """Cases with the same group most likely share compiled kernels (None: nothing launched)."""
        return case.label

    # -- hooks of subclasses --

    def expected_layout(self, case: Case) -> tuple[tuple[torch.dtype, tuple[int, ...]] | None, ...]:
        """(dtype, shape) of every output, contiguous; None where the output is None."""
        raise NotImplementedError

    def reference_float64(self, case: Case, call: Call) -> tuple[torch.Tensor, ...] | None:
        """The reference outputs computed in float64 from float64 copies of the inputs (the
        public entry points check their storage dtypes, so this runs their ``*_math`` steps)."""
        return None

    def autograd_float64(self, case: Case, call: Call) -> tuple[tuple[str, ...], tuple, tuple] | None:
        """For an explicit backward: (names, explicit gradients, ``torch.autograd`` gradients of the
        forward), both in float64 from the case's inputs and upstream gradient."""
        return None

    def extra_checks(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        """Checks of the op's own invariants (Sinkhorn columns, the hash's ranges, ...)."""
        return []

    # -- the self-checks --

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        """Documented layout, the explicit backward ≡ autograd (small cases), the op's own invariants.
        (The runner itself holds the native reference to its bounds against ``reference_float64``.)"""
        checks = [self._layout_check(case, outputs)]
        small = input_elements(call) <= FLOAT64_CHECK_ELEMENTS
        gradients = self.autograd_float64(case, call) if small else None
        if gradients is not None:
            names, explicit, autograd = gradients
            for name, mine, theirs in zip(names, explicit, autograd, strict=True):
                checks.append(normwise_check(f"explicit ≡ autograd (float64): {name}", mine, theirs, AUTOGRAD_BOUND))
        elif not small and type(self).autograd_float64 is not FloatOp.autograd_float64:
            checks.append(Check("explicit ≡ autograd (float64)", SKIP, detail="large case: proven on the small ones"))
        checks.extend(self.extra_checks(case, call, outputs))
        return checks

    def _layout_check(self, case: Case, outputs: tuple[torch.Tensor, ...]) -> Check:
        """The reference returns the documented dtypes and shapes, contiguous."""
        for output, actual, wanted in zip(self.outputs, outputs, self.expected_layout(case), strict=True):
            if wanted is None:
                expected = torch.empty(0, device="meta")  # an output the op returns as None
            else:
                expected = torch.empty(wanted[1], dtype=wanted[0], device="meta")
            problem = structure_mismatch(actual, expected)
            if problem:
                return Check("reference layout", FAIL, "documented layout", "", f"{output.name}: {problem}")
        return Check("reference layout", PASS, "documented layout", "ok")


def normwise_check(name: str, actual: torch.Tensor, expected: torch.Tensor, bound: float) -> Check:
    """``max |actual - expected| / max |expected| <= bound`` (both float64; robust to cancellation
    in single elements, which is what the float64 agreement of two exact formulas needs)."""
    policy = f"normwise rel ≤ {bound:g}"
    if tuple(actual.shape) != tuple(expected.shape):
        return Check(name, FAIL, policy, "shape", f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if expected.numel() == 0:
        return Check(name, PASS, policy, "empty")
    a, e = actual.to(F64), expected.to(F64)
    scale = float(e.abs().max())
    error = float((a - e).abs().max())
    relative = error / scale if scale > 0 else error
    if not math.isfinite(relative) or relative > bound:
        return Check(name, FAIL, policy, f"{relative:.3g}", f"max |Δ| {error:.3g} over max |expected| {scale:.3g}")
    return Check(name, PASS, policy, f"{relative:.3g}")


def autograd_of(forward: Callable, inputs: Sequence[torch.Tensor], cotangents: Sequence[torch.Tensor]) -> tuple:
    """``torch.autograd.grad`` of ``forward(*inputs)`` (float64 leaves) against ``cotangents``."""
    leaves = [t.detach().to(F64).requires_grad_(True) for t in inputs]
    with torch.enable_grad():
        outputs = forward(*leaves)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, c.to(F64)) for o, c in zip(outputs, cotangents, strict=True) if o.requires_grad]
        gradients = torch.autograd.grad(
            [o for o, _ in pairs], leaves, [c for _, c in pairs], allow_unused=True, materialize_grads=True
        )
    return tuple(g.detach() for g in gradients)

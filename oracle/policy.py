"""The oracle's one comparison policy: how an optimized output must agree with the reference.

Each output of each operator names one of two policies (contract, "Agreement rules for the
oracle"); the policy, the measured metric and the bound travel with every result:

- ``Bitwise``: integer outputs, quantized data and scale bytes, and float outputs whose math is a
  single correctly rounded operation (so there is exactly one right answer). Same dtype, same
  shape, same strides and the same raw bytes. Strides are compared only for dimensions longer than
  one, and not at all for empty tensors: the stride of a dimension of extent 0 or 1 addresses no
  second element, so it carries no layout information (``torch.empty((0, 4))`` and a column-major
  scale view of zero rows may legitimately differ there). With ``nan_equal``, a NaN in a floating
  output matches any NaN: NaN payload and sign bits are not part of the contract (CPU and GPU
  produce different NaN bits for the same IEEE operation).
- ``RelativeError``: other float outputs, against the reference run in float64 where the operator
  provides one: ``max |out - ref| / max(|ref|, atol) <= bound`` over the elements where the
  reference is finite; a NaN or infinity where the reference is finite fails, and wherever the
  reference is NaN or ±Inf the output must be the same non-finite value. An output whose rounding
  errors scale with intermediates larger than itself (a sum that cancels) names its per-element
  error scale (``scale``, in words); its float64 reference then comes as ``ScaledReference``
  (values and scales) and the denominator is ``max(|ref|, atol, scale)``.

One edge-specific rule (the edge profile, docs/numerics.md): on a case whose inputs hold numeric
edge values (NaN, ±Inf, ±max, subnormals, outliers, all-zero blocks) the float64 reference comes
wrapped as ``EdgeReference``, and a ``RelativeError`` output is held to the *native* reference
(the contract's fp32/bf16 arithmetic, ``compare``'s ``expected``) for where NaN and ±Inf appear,
and to the bound from the float64 or from the native reference, whichever is nearer (see
``EdgeReference``). ``Bitwise`` outputs keep their rule: edge values change nothing about "one
right answer".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PASS, FAIL, ERROR, SKIP = "pass", "fail", "error", "skip"

# Raw bytes are compared through an integer view of the same width (exact, and NaN-safe).
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Check:
    """One named check of one case: a comparison, a reference self-check, a compile, a skip."""

    name: str
    status: str  # PASS | FAIL | ERROR | SKIP
    policy: str = ""  # the rule applied, short ("bitwise", "rel ≤ 2^-4")
    metric: str = ""  # what was measured, short ("0/4096 differ", "0.031")
    detail: str = ""  # on failure: where and what (first mismatch), or the error message

    @property
    def ok(self) -> bool:
        return self.status in (PASS, SKIP)


@dataclass(frozen=True)
class Bitwise:
    nan_equal: bool = False

    kind = "bitwise"

    def describe(self) -> str:
        text = "bitwise: same dtype, shape, strides (of dimensions longer than 1) and raw bytes"
        return text + ("; in floating outputs any NaN matches any NaN" if self.nan_equal else "")

    def short(self) -> str:
        return "bitwise" + (" (NaN≡NaN)" if self.nan_equal else "")


@dataclass(frozen=True)
class RelativeError:
    bound: float
    atol: float = 0.0  # denominators below this are raised to it (relative error near zero)
    scale: str = ""  # what the per-element error scale is ("": none; see ScaledReference)

    kind = "relative"

    def describe(self) -> str:
        floor = f"{self.atol:g}, S" if self.scale else f"{self.atol:g}"
        text = (
            f"relative error vs the float64 reference: max |out - ref| / max(|ref|, {floor}) <= "
            f"{self.bound:g} where ref is finite; same dtype and shape; NaN/±Inf exactly where ref has them"
        )
        return text + (f"; S = {self.scale}" if self.scale else "")

    def short(self) -> str:
        return f"rel ≤ {self.bound:g}"


Policy = Bitwise | RelativeError


@dataclass(frozen=True)
class ScaledReference:
    """A float64 reference with the per-element error scales of a ``RelativeError(scale=...)``."""

    values: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


@dataclass(frozen=True)
class EdgeReference:
    """The float64 reference of an edge case (``values``: a tensor or a ``ScaledReference``). With it,
    ``RelativeError`` compares the output ``a`` with both the native reference ``n`` (the contract's
    fp32/bf16 arithmetic: what ``compare`` is given as ``expected``) and the float64 values ``e``:

    - where ``n`` is NaN, ``a`` is NaN; where ``n`` is ±Inf, ``a`` is the same infinity; where ``n``
      is finite, ``a`` is finite. The native reference decides, not ``e``: edge values overflow fp32
      where float64 does not (the square of a bf16 max is +Inf in fp32, so its rsqrt is 0; float64
      has a tiny positive number), so where NaN and ±Inf appear is a property of the fp32 arithmetic
      the contract prescribes and every implementation shares;
    - a finite ``a`` is within the bound of ``e`` *or* within the bound of ``n`` (each with its own
      denominator ``max(|ref|, atol, scale)``). Where an fp32 intermediate overflowed or underflowed
      on the edge values, no fp32 result is near the float64 one (the reference's neither), and the
      element is held to the fp32 reference instead; elsewhere the two agree and this is the usual
      bound, up to the native reference's own rounding. The metric counts the elements that only the
      native reference's bound admits ("k by fp32").
    """

    values: torch.Tensor | ScaledReference

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


def compare(name: str, actual, expected: torch.Tensor, policy: Policy, *, expected64=None) -> Check:
    """Compare ``actual`` with the reference's ``expected`` under ``policy``.

    ``expected64`` is the reference computed in float64 (``RelativeError`` only); without it the
    native reference result is upcast. An ``EdgeReference`` (edge cases) applies the edge rule, with
    ``expected`` as the native reference.
    """
    problem = structure_mismatch(actual, expected, check_strides=isinstance(policy, Bitwise))
    if problem:
        return Check(name, FAIL, policy.short(), "structure", problem)
    if isinstance(policy, Bitwise):
        return _compare_bits(name, actual, expected, policy)
    if isinstance(expected64, EdgeReference):
        return _compare_relative_on_edges(name, actual, expected, expected64.values, policy)
    return _compare_relative(name, actual, expected if expected64 is None else expected64, policy)


def meaningful_strides(tensor: torch.Tensor) -> tuple[int | None, ...]:
    """Strides of the dimensions longer than one (None elsewhere); () for an empty tensor."""
    if tensor.numel() == 0:
        return ()
    return tuple(stride if size > 1 else None for size, stride in zip(tensor.shape, tensor.stride(), strict=True))


def structure_mismatch(actual, expected: torch.Tensor, *, check_strides: bool = True) -> str:
    """'' when dtype, shape (and strides) agree; otherwise what differs, in words."""
    if not isinstance(actual, torch.Tensor):
        return f"expected a tensor, got {type(actual).__name__}"
    if actual.dtype != expected.dtype:
        return f"dtype {_dtype_name(actual.dtype)} != reference {_dtype_name(expected.dtype)}"
    if tuple(actual.shape) != tuple(expected.shape):
        return f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}"
    if check_strides and meaningful_strides(actual) != meaningful_strides(expected):
        return f"strides {tuple(actual.stride())} != reference {tuple(expected.stride())}"
    return ""


def _compare_bits(name: str, actual: torch.Tensor, expected: torch.Tensor, policy: Bitwise) -> Check:
    total = expected.numel()
    if total == 0:
        return Check(name, PASS, policy.short(), "0/0 differ")
    if actual.device != expected.device:
        actual = actual.to(expected.device)
    differs = bits_of(actual) != bits_of(expected)
    if policy.nan_equal and expected.dtype.is_floating_point:
        differs &= ~(torch.isnan(actual.float()) & torch.isnan(expected.float()))
    count = int(differs.sum().item())
    metric = f"{count}/{total} differ"
    if count == 0:
        return Check(name, PASS, policy.short(), metric)
    first = _unravel(int(differs.reshape(-1).nonzero()[0].item()), tuple(expected.shape))
    detail = f"first mismatch at {list(first)}: expected {_show(expected, first)}, got {_show(actual, first)}"
    return Check(name, FAIL, policy.short(), metric, detail)


def _compare_relative(name: str, actual: torch.Tensor, expected, policy: RelativeError) -> Check:
    scale = None
    if isinstance(expected, ScaledReference):
        expected, scale = expected.values, expected.scale
    if policy.scale and scale is None:
        return Check(name, ERROR, policy.short(), "", f"no float64 error scale given ({policy.scale})")
    if expected.numel() == 0:
        return Check(name, PASS, policy.short(), "empty")
    a = actual.to(device=expected.device, dtype=torch.float64)
    e = expected.to(torch.float64)
    floor = None if scale is None else scale.to(device=e.device, dtype=torch.float64)
    compared = torch.isfinite(e) & torch.isfinite(a)
    errors = torch.where(compared, _relative_error(a, e, policy, floor), torch.zeros_like(e))
    worst = float(errors.max().item())

    def worst_detail(first):
        detail = f"reference {e[first].item()!r}, got {a[first].item()!r}"
        return detail + (f", error scale {float(scale[first]):.6g}" if scale is not None else "")

    return _verdict(
        name,
        policy,
        f"{worst:.3g}",
        _nonfinite_mismatches(a, e),
        errors,
        worst,
        mismatch_detail=lambda first: f"reference {e[first].item()!r}, got {a[first].item()!r}",
        worst_detail=worst_detail,
    )


def _compare_relative_on_edges(
    name: str, actual: torch.Tensor, native: torch.Tensor, exact, policy: RelativeError
) -> Check:
    """``RelativeError`` under the edge rule (``EdgeReference``): non-finite values exactly where the
    native reference has them; finite values within the bound of the float64 or of the native one."""
    scale = None
    if isinstance(exact, ScaledReference):
        exact, scale = exact.values, exact.scale
    if policy.scale and scale is None:
        return Check(name, ERROR, policy.short(), "", f"no float64 error scale given ({policy.scale})")
    if exact.numel() == 0:
        return Check(name, PASS, policy.short(), "empty")
    e = exact.to(torch.float64)
    a = actual.to(device=e.device, dtype=torch.float64)
    n = native.to(device=e.device, dtype=torch.float64)
    floor = None if scale is None else scale.to(device=e.device, dtype=torch.float64)
    to_float64, to_native = _relative_error(a, e, policy, floor), _relative_error(a, n, policy, floor)
    compared = torch.isfinite(n) & torch.isfinite(a)
    errors = torch.where(compared, torch.minimum(to_float64, to_native), torch.zeros_like(e))
    by_fp32 = int((compared & ~(to_float64 <= policy.bound) & (to_native <= policy.bound)).sum().item())
    worst = float(errors.max().item())
    return _verdict(
        name,
        policy,
        f"{worst:.3g}" + (f"; {by_fp32} by fp32" if by_fp32 else ""),
        _nonfinite_mismatches(a, n),
        errors,
        worst,
        mismatch_detail=lambda first: f"reference {n[first].item()!r}, got {a[first].item()!r}",
        worst_detail=lambda first: f"float64 {e[first].item()!r}, native {n[first].item()!r}, got {a[first].item()!r}",
        mismatches_against=" with the native reference",
        bound_against=" from both references",
    )


def _nonfinite_mismatches(actual: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Where the reference is not finite the output must be the same non-finite value (any NaN for
    a NaN); where it is finite, so must the output be."""
    finite = torch.isfinite(reference)
    same_nonfinite = (torch.isnan(reference) & torch.isnan(actual)) | (actual == reference)
    return (~finite & ~same_nonfinite) | (finite & ~torch.isfinite(actual))


def _relative_error(
    actual: torch.Tensor, reference: torch.Tensor, policy: RelativeError, floor: torch.Tensor | None
) -> torch.Tensor:
    """``|actual - reference| / max(|reference|, atol, floor)``; 0 where they are equal (0/0 is no
    error, x/0 with x > 0 an infinite one); +Inf where either is not finite."""
    denominator = torch.clamp(reference.abs(), min=policy.atol) if policy.atol > 0 else reference.abs()
    if floor is not None:
        denominator = torch.maximum(denominator, floor)
    error = (actual - reference).abs()
    relative = torch.where(error == 0, torch.zeros_like(error), error / denominator)
    usable = torch.isfinite(reference) & torch.isfinite(actual)
    return torch.where(usable, relative, torch.full_like(relative, float("inf")))


def _verdict(
    name: str,
    policy: RelativeError,
    metric: str,
    mismatches: torch.Tensor,
    errors: torch.Tensor,
    worst: float,
    *,
    mismatch_detail,
    worst_detail,
    mismatches_against: str = "",
    bound_against: str = "",
) -> Check:
    """FAIL on any non-finite mismatch (first one shown), then on an error above the bound (the
    worst shown); else PASS. The details name the values at the shown index."""
    shape = tuple(errors.shape)
    mismatch_count = int(mismatches.sum().item())
    if mismatch_count:
        first = _unravel(int(mismatches.reshape(-1).nonzero()[0].item()), shape)
        detail = f"{mismatch_count} non-finite mismatches{mismatches_against}; first at {list(first)}: "
        return Check(name, FAIL, policy.short(), metric, detail + mismatch_detail(first))
    if not worst <= policy.bound:
        first = _unravel(int(errors.reshape(-1).argmax().item()), shape)
        detail = f"relative error {worst:.3g} > {policy.bound:g}{bound_against}; worst at {list(first)}: "
        return Check(name, FAIL, policy.short(), metric, detail + worst_detail(first))
    return Check(name, PASS, policy.short(), metric)


def bits_of(tensor: torch.Tensor) -> torch.Tensor:
    """The logical elements as integers of the same width, contiguous (padding excluded)."""
    if tensor.dtype == torch.bool:
        return tensor.to(torch.uint8)
    return tensor.view(_SAME_WIDTH_INT[tensor.element_size()]).contiguous()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a and b have the same dtype, shape and logical raw bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(bits_of(a), bits_of(b.to(a.device))))


def _unravel(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(index))


def _show(tensor: torch.Tensor, index: tuple[int, ...]) -> str:
    """One element as value and hex bits, e.g. ``1.5 (0x3c)``."""
    width = 2 * tensor.element_size()
    bits = int(bits_of(tensor[index].reshape(1)).item()) & ((1 << (4 * width)) - 1)
    if tensor.dtype.is_floating_point:
        value = float(tensor[index].float().item())
        shown = repr(value) if math.isfinite(value) else str(value)
        return f"{shown} (0x{bits:0{width}x})"
    return f"{int(tensor[index].item())} (0x{bits:0{width}x})"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")

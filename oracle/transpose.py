"""The transpose family (contract §3) for the oracle: cases, inputs, policies, bytes, self-checks.

Two operators, ``transpose`` and ``batched_transpose``. There is no optimized twin yet:
``optimized()`` returns ``getattr(tileproof.optimized.transpose, name)``, or None while that module
(or the name in it) does not exist.

A transpose only moves elements, so every output is compared bitwise. Inputs are random *bit
patterns* of the element's width viewed as the dtype (FP8 and bf16 inputs hold NaNs with payloads,
infinities, signed zeros and subnormals), inside a wider buffer when the case has a row stride
larger than ``N`` (and, batched, a batch stride larger than ``M`` rows): a kernel that reads the
padding, or converts a value on the way, shows in its output.

Cases of each tier: every element width (1, 2, 4, 8 bytes, bool) on small shapes with tails
(0, 1, odd, primes, around 64 and 128), strided and contiguous; the ``full`` tier adds large bf16
and FP8 matrices, among them the benchmark workloads (``benchmark=True``): DeepSeek-V3's 8192×7168
in TileKernels' twice-strided layout (row stride 2N), tails on both dimensions with a row stride
larger than N, and batches of expert matrices.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from tileproof.reference import transpose as reference

from .moe import optimized_twin
from .policy import FAIL, PASS, Bitwise, Check, structure_mismatch
from .registry import FLOAT_EDGE_KINDS, Call, Case, OpSpec, Output, register, write_edge_values

DTYPES = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp64": torch.float64,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
# Integer words of each element width: the bits are drawn as these, then viewed as the dtype.
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

WHY = "elements are moved, never computed: the same bytes in the transposed place (NaN payloads included)"


@dataclass(frozen=True)
class TransposeParams:
    rows: int  # M
    cols: int  # N
    dtype: str  # a key of DTYPES
    batch: int | None = None  # B (batched_transpose, may be 0); None for transpose
    row_stride: int = 0  # elements between rows when > N (a slice of a wider buffer)
    batch_stride: int = 0  # elements between matrices when > M · row stride (batched only)

    @property
    def ld(self) -> int:
        return self.row_stride or self.cols

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, self.cols) if self.batch is None else (self.batch, self.rows, self.cols)


# (M, N, dtype, row stride): small shapes of both tiers, every dtype, tails, strided rows.
SMALL = [
    (0, 0, "bf16", 0),
    (0, 7, "e4m3", 0),
    (7, 0, "fp32", 0),
    (1, 1, "int8", 0),
    (1, 130, "e4m3", 136),
    (130, 1, "bf16", 0),
    (3, 5, "fp64", 8),
    (63, 65, "e4m3", 80),
    (64, 64, "bf16", 0),
    (127, 129, "bf16", 192),
    (200, 96, "e5m2", 0),
    (37, 250, "fp16", 256),
    (65, 33, "int32", 40),
    (17, 19, "int64", 0),
    (31, 45, "bool", 48),
    (9, 11, "int8", 12),
]
# (B, M, N, dtype, row stride, batch stride)
SMALL_BATCHED = [
    (0, 5, 7, "bf16", 0, 0),
    (3, 0, 7, "e4m3", 0, 0),
    (1, 1, 1, "fp32", 0, 0),
    (2, 63, 65, "e4m3", 72, 0),
    (3, 17, 130, "bf16", 0, 17 * 130 + 10),
    (4, 128, 64, "e4m3", 0, 0),
    (2, 33, 31, "fp32", 32, 33 * 32 + 64),
    (5, 7, 9, "int64", 0, 0),
]
# Larger shapes of the full tier (tails, strided), not named workloads: (M, N, dtype, row stride).
LARGE = [
    (4096, 7168, "fp32", 0),
    (1023, 4097, "e4m3", 4160),
    (7168, 576, "bf16", 0),
    (2049, 2047, "fp16", 2048),
]
LARGE_BATCHED = [(32, 129, 2048, "e4m3", 0, 0), (8, 1000, 1000, "fp32", 1024, 0)]
# The named workloads: (title, params).
BENCHMARKS = {
    "transpose": [
        ("transpose bf16 8192×7168, row stride 14336", TransposeParams(8192, 7168, "bf16", row_stride=14336)),
        ("transpose e4m3 8192×7168, row stride 14336", TransposeParams(8192, 7168, "e4m3", row_stride=14336)),
        ("transpose bf16 8001×7000 (tails), row stride 7168", TransposeParams(8001, 7000, "bf16", row_stride=7168)),
        ("transpose e4m3 4001×2050 (tails), row stride 2112", TransposeParams(4001, 2050, "e4m3", row_stride=2112)),
    ],
    "batched_transpose": [
        ("batched_transpose bf16 8×4096×7168", TransposeParams(4096, 7168, "bf16", batch=8)),
        ("batched_transpose e4m3 8×4096×7168", TransposeParams(4096, 7168, "e4m3", batch=8)),
        (
            "batched_transpose e4m3 32×1023×2050 (tails), row stride 2112",
            TransposeParams(1023, 2050, "e4m3", batch=32, row_stride=2112),
        ),
    ],
}


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator, dtype=torch.uint8).view(torch.bool)
    word = _WORDS[dtype.itemsize]
    info = torch.iinfo(word)
    return torch.randint(info.min, info.max, shape, generator=generator).to(word).view(dtype)


def _input(p: TransposeParams, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """``x`` with the case's strides: a view of a wider buffer holding random bits, padding included."""
    dtype = DTYPES[p.dtype]
    if p.batch is not None:
        span = p.batch_stride or p.rows * p.ld
        flat_shape = (p.batch * span,)
        strides = (span, p.ld, 1)
    else:
        flat_shape = (p.rows * p.ld,)
        strides = (p.ld, 1)
    if generator is None:
        flat = torch.empty(flat_shape, dtype=dtype, device=device)
    else:
        flat = _random_bits(flat_shape, dtype, generator).to(device)
    if flat.numel() == 0:
        return torch.empty(p.shape, dtype=dtype, device=device)
    return flat.as_strided(p.shape, strides)


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The elements as integers of the same width."""
    if tensor.dtype == torch.bool:
        return tensor.to(torch.uint8)
    return tensor.view(_WORDS[tensor.element_size()])


class TransposeOp(OpSpec):
    family = "transpose"
    outputs = (Output("out", Bitwise(), WHY),)

    def __init__(self, name: str):
        self.name = name
        self.batched = name == "batched_transpose"

    def label(self, p: TransposeParams) -> str:
        shape = "x".join(str(n) for n in p.shape)
        label = f"{self.name}/{p.dtype}/{shape}"
        if p.row_stride:
            label += f"/ld{p.row_stride}"
        if p.batch_stride:
            label += f"/bs{p.batch_stride}"
        return label

    def cases(self, tier: str) -> list[Case]:
        if self.batched:
            params = [TransposeParams(m, n, d, b, ld, bs) for b, m, n, d, ld, bs in SMALL_BATCHED]
            if tier == "full":
                params += [TransposeParams(m, n, d, b, ld, bs) for b, m, n, d, ld, bs in LARGE_BATCHED]
        else:
            params = [TransposeParams(m, n, d, row_stride=ld) for m, n, d, ld in SMALL]
            if tier == "full":
                params += [TransposeParams(m, n, d, row_stride=ld) for m, n, d, ld in LARGE]
        cases = [Case(self.name, self.label(p), p) for p in params]
        if tier == "full":
            for title, p in BENCHMARKS[self.name]:
                cases.append(Case(self.name, self.label(p), p, benchmark=True, title=title))
        return cases

    # The edge profile: the floating-point dtypes' classes written over the random bits (which hold
    # every class already, scattered: here whole rows of zeros and subnormals, a max, an outlier, a
    # NaN, infinities where the dtype has them), on four quick cases.
    edge_base_count = 4
    edge_kinds = FLOAT_EDGE_KINDS

    def edge_base_ok(self, case: Case) -> bool:
        p: TransposeParams = case.params
        return DTYPES[p.dtype].is_floating_point and 0 not in p.shape and not case.benchmark

    def edge_kinds_of(self, case: Case) -> tuple[str, ...]:
        if case.params.dtype == "e4m3":  # float8_e4m3fn has no infinity
            return tuple(kind for kind in self.edge_kinds if kind != "inf")
        return self.edge_kinds

    def build(self, case: Case, device: torch.device, generator: torch.Generator | None) -> Call:
        x = _input(case.params, device, generator)
        if case.edge is not None and generator is not None:
            write_edge_values(x, case.edge.kind, generator)
        return Call((x,))

    def reference(self) -> Callable:
        return getattr(reference, self.name)

    def optimized(self) -> Callable | None:
        return optimized_twin("transpose", self.name)

    def compile_group(self, case: Case) -> Hashable | None:
        p: TransposeParams = case.params
        if self.optimized() is None or 0 in p.shape:
            return None  # no twin, or nothing to launch
        # Both operators share one kernel per element width: sizes, strides and alignment are runtime values.
        return ("transpose", DTYPES[p.dtype].itemsize)

    def bytes_moved(self, case: Case) -> int:
        p: TransposeParams = case.params
        elements = (1 if p.batch is None else p.batch) * p.rows * p.cols
        return 2 * elements * DTYPES[p.dtype].itemsize

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        p: TransposeParams = case.params
        x, out = call.args[0], outputs[0]
        shape = (*p.shape[:-2], p.cols, p.rows)
        problem = structure_mismatch(out, torch.empty(shape, dtype=x.dtype, device="meta"))
        checks = [
            Check("reference layout", FAIL if problem else PASS, "documented layout", "" if problem else "ok", problem)
        ]
        # The same bits, moved: compared through integer words, never through a float path.
        same = torch.equal(_words(out), _words(x).transpose(-2, -1))
        aliased = out.numel() > 0 and out.data_ptr() == x.data_ptr()
        ok = same and not aliased
        detail = "" if ok else ("the output aliases the input" if aliased else "an element moved wrongly or changed")
        checks.append(Check("bits transposed", PASS if ok else FAIL, "bitwise", "ok" if ok else "differs", detail))
        return checks


OPS = ("transpose", "batched_transpose")
SPECS = tuple(TransposeOp(name) for name in OPS)
for _spec in SPECS:
    register(_spec)

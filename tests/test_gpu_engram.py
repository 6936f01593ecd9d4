"""GPU: the optimized Engram kernels (``tileproof.optimized.engram``) agree with the reference twin:
``engram_hash`` and ``fused_weight`` bit for bit, the gate and ``grad_w_reduce`` within the
oracle's own policies (``tileproof.oracle.engram``: the bounds and their reasons live there).

Every call runs under ``poison_outputs``, so an element the kernels never write shows up. Gate
inputs come from the oracle's builder (|s| kept off the gate's singular points, the all-zero x and
k streams of tokens 1 and 2), then x is optionally moved into a wider, NaN-padded buffer so that
its strides differ from k's. With ``DEVICE = "cpu"`` every case runs under ``compile_only()`` on a
CPU machine (``scratch/emu_engram/runtests.py``), which checks that each configuration compiles.
"""

import subprocess
import sys
import zlib

import pytest
import torch

import tileproof.reference.engram as reference
from tileproof.optimized.jit import poison_outputs
from tileproof.oracle import engram as spec
from tileproof.oracle.policy import Bitwise, compare
from tileproof.oracle.registry import Case

pytestmark = pytest.mark.gpu

DEVICE = "cuda"  # every input is built on it (a compile-only run on a CPU machine sets "cpu")
N = spec.N


def _optimized():
    import tileproof.optimized.engram as optimized

    return optimized


def _generator(*params) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def _assert_within_policy(op, case, call, actual):
    """Each output of ``actual`` against the reference under the oracle's policy for it (float64
    reference for the relative bounds, the native one for bitwise outputs)."""
    expected = op.split(call(op.reference()))
    expected64 = op.reference_float64(case, call)
    for index, output in enumerate(op.outputs):
        reference64 = None if expected64 is None else expected64[index]
        check = compare(output.name, actual[index], expected[index], output.policy, expected64=reference64)
        assert check.ok, f"{case.label}: {output.name}: {check.metric} {check.detail}"


def _assert_same_bits(actual, expected, what):
    check = compare(what, actual, expected, Bitwise())
    assert check.ok, f"{what}: {check.metric} {check.detail}"


# --- engram_hash --------------------------------------------------------------------------------

# (tokens, N, L, M, table size, multipliers, strided ids): 0 / 1 / odd / real-model token counts,
# N = 2..4, M = 1, 3 (rows not a multiple of 4: scalar stores), 8; int64-wrapping multipliers.
HASH_CASES = [
    (0, 3, 2, 8, 1000, "engram", False),
    (1, 3, 2, 8, 1_000_000, "engram", False),
    (5, 2, 1, 1, 7, "engram", False),
    (37, 4, 1, 8, 1000, "engram", True),
    (33, 3, 2, 3, 1000, "wrapping", False),
    (129, 4, 3, 8, 100, "wrapping", True),
    (4001, 3, 2, 8, 1_000_000, "wrapping", False),
    (8192, 4, 1, 8, 16_000_000, "engram", True),
]


@pytest.mark.parametrize("tokens,max_ngram,layers,tables,size,multipliers,strided", HASH_CASES)
def test_engram_hash_matches_reference(tokens, max_ngram, layers, tables, size, multipliers, strided):
    params = spec.HashParams(tokens, max_ngram, layers, tables, size, multipliers, strided)
    op = spec.EngramHash()
    case = Case(op.name, str(params), params)
    call = op.build(case, DEVICE, _generator(params))
    with poison_outputs():
        actual = call(_optimized().engram_hash)
    _assert_same_bits(actual, call(reference.engram_hash), "rows")


def test_engram_hash_reads_column_major_ids():
    params = spec.HashParams(45, 3, 2, 8, 1000, "wrapping")
    op = spec.EngramHash()
    call = op.build(Case(op.name, "column-major", params), DEVICE, _generator("column-major"))
    ids, *tables = call.args
    column_major = ids.T.contiguous().T
    with poison_outputs():
        actual = _optimized().engram_hash(column_major, *tables)
    _assert_same_bits(actual, reference.engram_hash(ids, *tables), "rows")


# A bad value in a process of its own: the device-side assertion it triggers leaves the CUDA context
# unusable. Two tokens, n-grams up to 3, one layer, two tables of size 7 per order.
_BAD_HASH_VALUE = """
import torch
from tileproof.optimized.engram import engram_hash
ids = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32, device="cuda")
multipliers = torch.ones(1, 3, dtype=torch.int64, device="cuda")
vocab_sizes = torch.full((1, 2, 2), 7, dtype=torch.int32, device="cuda")
offsets = torch.tensor([[0, 7, 14, 21]], dtype=torch.int32, device="cuda")
{spoil}
engram_hash(ids, multipliers, vocab_sizes, offsets)
torch.cuda.synchronize()
"""


@pytest.mark.parametrize(
    "spoil",
    ["ids[1, 2] = -1", "vocab_sizes[0, 1, 0] = 0", "offsets[0, 3] = 2**31 - 5"],
    ids=["negative id", "zero table size", "offset past int32"],
)
def test_engram_hash_bad_values_stop_the_kernel(spoil):
    """The value rules are not read back to the host (that would synchronize and break CUDA-graph
    capture): a bad value stops the kernel with a device-side assertion (the reference raises
    ``ValueError``); the unspoiled script runs."""
    if DEVICE != "cuda":
        pytest.skip("needs a CUDA GPU")
    clean = subprocess.run([sys.executable, "-c", _BAD_HASH_VALUE.format(spoil="")], capture_output=True, text=True)
    assert clean.returncode == 0, clean.stderr[-2000:]
    result = subprocess.run([sys.executable, "-c", _BAD_HASH_VALUE.format(spoil=spoil)], capture_output=True, text=True)
    assert result.returncode != 0, f"engram_hash accepted: {spoil}"
    assert "assert" in (result.stdout + result.stderr).lower(), result.stderr[-2000:]


# --- fused_weight -------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden,pad", [(1, 0), (3, 0), (37, 0), (36, 4), (512, 8), (4096, 0), (7168, 64)])
def test_fused_weight_matches_reference(hidden, pad):
    params = spec.WeightParams(hidden, pad)
    op = spec.FusedWeight()
    call = op.build(Case(op.name, str(params), params), DEVICE, _generator(params))
    with poison_outputs():
        actual = call(_optimized().fused_weight)
    _assert_same_bits(actual, call(reference.fused_weight), "w")


# --- gate ---------------------------------------------------------------------------------------


def _gate_case(op, tokens, hidden, layout, num_partials=1, save=True, clamp=spec.CLAMP):
    params = spec.GateParams(tokens, hidden, layout, num_partials, save, clamp)
    case = Case(op.name, f"{op.name}/{params}", params)
    return case, op.build(case, DEVICE, _generator(op.name, params))


def _pad_x(call, x_index: int, pad: int):
    """The call with x moved into a ``[T, n, D + pad]`` NaN-filled buffer (other strides than k's)."""
    if not pad:
        return call
    x = call.args[x_index]
    wide = torch.full((*x.shape[:-1], x.shape[-1] + pad), float("nan"), dtype=x.dtype, device=x.device)
    wide[..., : x.shape[-1]] = x
    args = list(call.args)
    args[x_index] = wide[..., : x.shape[-1]]
    return type(call)(tuple(args), call.kwargs)


# (tokens, hidden, layout, save_for_backward, clamp, x padding): D multiples of 256 (the oracle's),
# others that leave masked columns (264, 1000) or need narrower vectors (36: 8 bytes, 37 and 2: one
# element); 0 / 1 / 2 / odd / real-model token counts; the clamped branch (clamp 0.3).
GATE_FWD_CASES = [
    (0, 512, "fused", True, spec.CLAMP, 0),
    (1, 512, "contiguous", True, spec.CLAMP, 0),
    (2, 2, "contiguous", True, spec.CLAMP, 0),
    (3, 37, "fused", True, spec.CLAMP, 0),
    (4, 36, "fused", True, spec.CLAMP, 4),
    (5, 512, "fused", False, spec.CLAMP, 0),
    (7, 264, "contiguous", True, spec.CLAMP, 8),
    (11, 512, "fused", True, 0.3, 0),
    (19, 768, "fused", True, spec.CLAMP, 16),
    (9, 1000, "fused", True, spec.CLAMP, 0),
    (33, 1280, "fused", True, spec.CLAMP, 0),
    (17, 2560, "contiguous", False, spec.CLAMP, 0),
    (3, 4096, "contiguous", True, spec.CLAMP, 0),
    (5, 7168, "fused", True, spec.CLAMP, 8),
    (4001, 4096, "fused", True, spec.CLAMP, 0),
    (4001, 4096, "fused", True, 0.3, 8),
    (8192, 4096, "fused", False, spec.CLAMP, 0),
    (4001, 7168, "contiguous", True, spec.CLAMP, 0),
]


@pytest.mark.parametrize("tokens,hidden,layout,save,clamp,pad", GATE_FWD_CASES)
def test_engram_gate_fwd_within_oracle_bounds(tokens, hidden, layout, save, clamp, pad):
    op = spec.GateFwd()
    case, call = _gate_case(op, tokens, hidden, layout, save=save, clamp=clamp)
    call = _pad_x(call, 0, pad)
    with poison_outputs():
        actual = op.split(call(_optimized().engram_gate_fwd))
    _assert_within_policy(op, case, call, actual)
    if save:
        # Without the statistics, the same out bit for bit (one kernel, a runtime switch).
        x, k, v, w, eps, clamp_value, _ = call.args
        with poison_outputs():
            alone = _optimized().engram_gate_fwd(x, k, v, w, eps, clamp_value, save_for_backward=False)
        _assert_same_bits(alone[0], actual[0], "out without statistics")
        assert all(stat is None for stat in alone[1:])
    if tokens >= 3:
        # The all-zero x (token 1, stream 2) and k (token 2, stream 0) streams: s = 0, gate ½ exactly.
        x, v = call.args[0], call.args[2]
        _assert_same_bits(actual[0][1, 2], (0.5 * v[1].float()).to(torch.bfloat16), "zero x stream")
        _assert_same_bits(actual[0][2, 0], (x[2, 0].float() + 0.5 * v[2].float()).to(torch.bfloat16), "zero k stream")


# (tokens, hidden, layout, P, clamp, x padding): P > T (empty blocks), P = 1, the SM counts of an
# H100 PCIe (114) and an H200 (132), blocks of one token, T = 0 (every block zero).
GATE_BWD_CASES = [
    (0, 512, "fused", 2, spec.CLAMP, 0),
    (1, 512, "contiguous", 3, spec.CLAMP, 0),
    (2, 2, "contiguous", 1, spec.CLAMP, 0),
    (6, 37, "fused", 4, spec.CLAMP, 0),
    (4, 36, "fused", 2, spec.CLAMP, 4),
    (7, 264, "contiguous", 7, spec.CLAMP, 8),
    (11, 512, "fused", 4, 0.3, 0),
    (19, 768, "fused", 5, spec.CLAMP, 16),
    (40, 1000, "fused", 3, spec.CLAMP, 0),
    (133, 1280, "fused", 132, spec.CLAMP, 0),
    (3, 4096, "contiguous", 2, spec.CLAMP, 0),
    (5, 7168, "fused", 3, spec.CLAMP, 8),
    (6, 5000, "fused", 2, 0.3, 0),  # wide row with a tail: 625 vectors over 160 threads x 4
    (4001, 4096, "fused", 132, spec.CLAMP, 0),
    (4001, 4096, "fused", 114, 0.3, 8),
    (8192, 4096, "fused", 132, spec.CLAMP, 0),
    (4001, 7168, "contiguous", 114, spec.CLAMP, 0),
]


@pytest.mark.parametrize("tokens,hidden,layout,partials,clamp,pad", GATE_BWD_CASES)
def test_engram_gate_bwd_within_oracle_bounds(tokens, hidden, layout, partials, clamp, pad):
    op = spec.GateBwd()
    case, call = _gate_case(op, tokens, hidden, layout, num_partials=partials, clamp=clamp)
    call = _pad_x(call, 1, pad)
    with poison_outputs():
        actual = op.split(call(_optimized().engram_gate_bwd))
    _assert_within_policy(op, case, call, actual)
    # Blocks past the last token hold exact zeros.
    per_block = -(-tokens // partials)
    first_empty = -(-tokens // per_block) if per_block else 0
    empty = actual[3][first_empty:]
    _assert_same_bits(empty, torch.zeros_like(empty), "empty blocks")


# The oracle's cases all have n = 4. The backward's lane-owned stream totals halve the streams once per
# lane bit: none for n = 1, one step for 2, three for 8, and n = 3 padded to 4 with zero streams; the
# policies' bounds hold per stream, whatever n.
@pytest.mark.parametrize("streams", [1, 2, 3, 8])
@pytest.mark.parametrize("tokens,hidden,partials", [(37, 1000, 5), (300, 4096, 132)])
def test_engram_gate_bwd_other_stream_counts(monkeypatch, streams, tokens, hidden, partials):
    monkeypatch.setattr(spec, "N", streams)
    op = spec.GateBwd()
    case, call = _gate_case(op, tokens, hidden, "fused", num_partials=partials)
    assert call.args[1].shape == (tokens, streams, hidden)
    with poison_outputs():
        actual = op.split(call(_optimized().engram_gate_bwd))
    _assert_within_policy(op, case, call, actual)


# The bulk-copy backward (rows staged in shared memory one token ahead) does the register kernel's
# arithmetic in the same order: where both take one column per thread (D of 257-512 vectors; the
# launcher sends rows of more than 320 to the register kernel, so both are forced here) every output
# must be the same bits, whatever the layout, the padding of x and the tokens per block.
@pytest.mark.parametrize(
    "tokens,hidden,layout,partials,pad",
    [
        (1, 4096, "fused", 132, 0),
        (37, 2560, "contiguous", 5, 8),
        (300, 4096, "kvgrad", 132, 0),
        (4001, 4096, "fused", 114, 8),
    ],
)
def test_engram_gate_bwd_bulk_copies_match_the_register_kernel(monkeypatch, tokens, hidden, layout, partials, pad):
    optimized = _optimized()
    op = spec.GateBwd()
    case, call = _gate_case(op, tokens, hidden, layout, num_partials=partials)
    call = _pad_x(call, 1, pad)
    results = {}
    for bulk in (True, False):
        monkeypatch.setattr(optimized, "GATE_BWD_BULK_MAX_COLUMNS", 512 if bulk else 0)
        assert optimized.gate_bwd_bulk_threads(N, hidden, 8) == (hidden // 8 if bulk else 0)
        optimized._GATE_BWD_PLANS.clear()
        with poison_outputs():
            results[bulk] = op.split(call(optimized.engram_gate_bwd))
    optimized._GATE_BWD_PLANS.clear()
    assert optimized.gate_bwd_schedule(hidden, 8) == (hidden // 8, 1)
    for output, bulk, register in zip(op.outputs, results[True], results[False], strict=True):
        _assert_same_bits(bulk, register, f"{case.label}: {output.name}")
    _assert_within_policy(op, case, call, results[True])


# --- grad_w_reduce ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "partials,hidden", [(0, 512), (1, 37), (3, 512), (5, 36), (33, 64), (114, 4096), (132, 4096), (132, 7168)]
)
def test_grad_w_reduce_within_oracle_bounds(partials, hidden):
    params = spec.ReduceParams(partials, hidden)
    op = spec.GradWReduce()
    case = Case(op.name, str(params), params)
    call = op.build(case, DEVICE, _generator(params))
    dw_partial, wh, we, grad_wh, grad_we = call.args
    accumulators = (grad_wh.clone(), grad_we.clone())
    assert _optimized().grad_w_reduce(dw_partial, wh, we, *accumulators) is None  # in place
    _assert_within_policy(op, case, call, accumulators)
    if partials == 0:
        _assert_same_bits(accumulators[0], grad_wh, "grad_wh unchanged")


def test_grad_w_reduce_reads_strided_partials():
    """``dw_partial`` as a view with padded rows and a P-stride that is not ``n·D``."""
    generator = _generator("strided-partials")
    partials, hidden = 7, 520
    wide = torch.randn(partials, N + 1, hidden + 8, generator=generator).to(DEVICE)
    dw_partial = wide[:, 1:, :hidden]
    wh, we = (torch.randn(N, hidden, generator=generator).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    grad_wh, grad_we = (torch.randn(N, hidden, generator=generator).to(DEVICE) for _ in range(2))
    expected = (grad_wh.clone(), grad_we.clone())
    reference.grad_w_reduce(dw_partial, wh, we, *expected)
    _optimized().grad_w_reduce(dw_partial, wh, we, grad_wh, grad_we)
    for actual, wanted in zip((grad_wh, grad_we), expected, strict=True):
        assert torch.allclose(actual, wanted, rtol=1e-6, atol=1e-6)


# --- argument checks ----------------------------------------------------------------------------


def _bad_calls(device):
    bf16, f32 = torch.bfloat16, torch.float32
    x = torch.zeros(3, N, 16, dtype=bf16, device=device)
    v = torch.zeros(3, 16, dtype=bf16, device=device)
    w = torch.zeros(N, 16, dtype=f32, device=device)
    stats = [torch.zeros(3, N, dtype=f32, device=device) for _ in range(4)]
    gains = torch.zeros(N, 16, dtype=bf16, device=device)
    ids = torch.zeros(3, 3, dtype=torch.int32, device=device)
    mults = torch.ones(1, 3, dtype=torch.int64, device=device)
    vocab = torch.ones(1, 2, 2, dtype=torch.int32, device=device)
    offsets = torch.zeros(1, 4, dtype=torch.int32, device=device)
    return [
        ("engram_hash", (ids.float(), mults, vocab, offsets), {}),
        ("engram_hash", (ids[:, :1], mults[:, :1], vocab[:, :0], offsets[:, :0]), {}),
        ("engram_hash", (ids, mults, vocab, offsets[:, :3]), {}),
        # Bad values (a table size of 0, a negative id) stop the optimized kernel with a device-side
        # assertion instead: test_engram_hash_bad_values_stop_the_kernel.
        ("fused_weight", (gains, gains.float()), {}),
        ("fused_weight", (gains, gains[:, :8]), {}),
        ("engram_gate_fwd", (x, x, v, w.double(), 1e-20, 1e-6), {}),
        ("engram_gate_fwd", (x, x[:, :, :8], v, w, 1e-20, 1e-6), {}),
        ("engram_gate_fwd", (x, x.transpose(1, 2).contiguous().transpose(1, 2), v, w, 1e-20, 1e-6), {}),
        ("engram_gate_fwd", (x, x, v, w, -1.0, 1e-6), {}),
        ("engram_gate_fwd", (x, x, v, w, 1e-20, 0.0), {}),
        ("engram_gate_fwd", (x, x, v, w, 1e-20, 1e-6, 1), {}),
        ("engram_gate_bwd", (x, x, x, v, w, *stats, 1e-6), {"num_partials": 0}),
        ("engram_gate_bwd", (x, x, x, v, w, *stats[:3], stats[3][:2], 1e-6), {}),
        ("engram_gate_bwd", (x.float(), x, x, v, w, *stats, 1e-6), {}),
        ("grad_w_reduce", (stats[0][None], gains, gains, w, w), {}),
        ("grad_w_reduce", (w[None], gains, gains, w.double(), w), {}),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls("cpu"))))
def test_invalid_arguments_raise_the_reference_errors(index):
    name, args, kwargs = _bad_calls(DEVICE)[index]
    with pytest.raises((TypeError, ValueError)) as expected:
        getattr(reference, name)(*args, **kwargs)
    with pytest.raises(expected.type) as actual:
        getattr(_optimized(), name)(*args, **kwargs)
    assert str(actual.value) == str(expected.value)

"""CPU tests of the optimized modeling layers (``tileproof.optimized.modeling``).

Without a GPU the layers cannot run (``tests/test_gpu_modeling.py`` compares them with the reference
layers on the H200). What is checked here: every malformed argument is refused exactly as the
reference refuses it (same exception type, same message); fp32 / fp64 storage, which only the
reference accepts, is refused with a ``TypeError`` naming the argument and bf16; and, marked
``compile``, every layer's forward and backward run under ``compile_only()`` on small CPU tensors:
the kernels build, nothing launches (outputs are uninitialised), so only shapes, dtypes, strides
and the presence of every gradient are checked.
"""

import contextlib
import re

import pytest
import torch

from tileproof.reference import modeling as reference

N = 4
M3 = N * N + 2 * N
C = 8
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
NORM_FN_NAMES = {"mhc_pre_norm_fn": "mhc_norm", "mhc_pre_norm_fn_bwd": "mhc_norm", "mhc_pre_big_fuse": "mhc_fuse"}


def _optimized():
    from tileproof.optimized import modeling

    return modeling


def _streams(dtype=BF16, lead=(2,)):
    return torch.zeros(*lead, N, C, dtype=dtype)


def _pre_params(dtype=F32, hidden=C):
    return torch.zeros(M3, N * hidden, dtype=dtype), torch.ones(3, dtype=dtype), torch.zeros(M3, dtype=dtype)


def _bad_calls():
    x = _streams()
    fn, scale, base = _pre_params()
    w = torch.ones(N, C, dtype=BF16)
    head = (torch.zeros(N, N * C), torch.ones(1), torch.zeros(N))
    with_main_grad = torch.ones(N, C, dtype=BF16)
    with_main_grad.main_grad = torch.zeros(N, C, dtype=F64)
    return [
        ("mhc_pre", (x, fn, scale, base), {"mhc_mult": 2}),
        ("mhc_pre", (x, fn.double(), scale, base), {}),
        ("mhc_pre", (x, fn[:, :-1], scale, base), {}),
        ("mhc_pre", (x, fn[:-1], scale, base), {}),
        ("mhc_pre", (x, fn, scale[:2], base), {}),
        ("mhc_pre", (x, fn, scale, base.double()), {}),
        ("mhc_pre", (x, fn, scale, base), {"norm_weight": torch.ones(N * C + 1)}),
        ("mhc_pre", (x, fn, scale, base), {"sinkhorn_repeat": 0}),
        ("mhc_pre", (x, fn, scale, base), {"sinkhorn_eps": -1.0}),
        ("mhc_pre", (x, fn, scale, base), {"post_mult_value": float("nan")}),
        ("mhc_pre", (x, fn, scale, base), {"n_splits": 0}),
        ("mhc_pre", (torch.zeros(C, dtype=BF16), fn, scale, base), {}),
        ("mhc_pre", (x.to(torch.float16), fn, scale, base), {}),
        ("mhc_pre", (x.tolist(), fn, scale, base), {}),
        ("mhc_post", (torch.zeros(2, C, dtype=BF16), x, torch.zeros(2, N + 1), torch.zeros(2, N, N)), {}),
        ("mhc_post", (torch.zeros(2, C), x, torch.zeros(2, N), torch.zeros(2, N, N)), {}),
        ("mhc_post", (torch.zeros(2, C, dtype=BF16), x, torch.zeros(2, N), torch.zeros(2, N, N, dtype=F64)), {}),
        ("mhc_head", (x, torch.zeros(N - 1, N * C), *head[1:]), {}),
        ("mhc_head", (x.to(torch.float16), *head), {}),
        ("mhc_head", (x, *head), {"mhc_mult": 3}),
        ("mhc_head", (x, head[0], torch.ones(2), head[2]), {}),
        ("mhc_head", (x, *head), {"pre_eps": float("inf")}),
        ("mhc_head", (x, *head), {"norm_weight": torch.ones(N * C, dtype=F64)}),
        ("expand_from_embedding", (torch.zeros(2, C, dtype=BF16), 0), {}),
        ("expand_from_embedding", (torch.zeros((), dtype=BF16), N), {}),
        ("expand_from_embedding", (torch.zeros(2, C, dtype=torch.int32), N), {}),
        ("engram_gate", (x, x[:, :2], x[:, 0], w, w, 1e-6, 1e-6), {}),
        ("engram_gate", (x, x, x[:, 0], w, w.float(), 1e-6, 1e-6), {}),
        ("engram_gate", (x, x, x[:, 0], w, w, 0.0, 1e-6), {}),
        ("engram_gate", (x, x, x[:, 0], w, w, 1e-6, -1.0), {}),
        ("engram_gate", (x, x, x[:, 0, :-1], w, w, 1e-6, 1e-6), {}),
        ("engram_gate", (x, x, x[:, 0], w[:, :-1], w, 1e-6, 1e-6), {}),
        ("engram_gate", (x, x, x[:, 0], with_main_grad, w, 1e-6, 1e-6), {}),
    ]


BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("index", range(len(BAD_CALLS)), ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CALLS)])
def test_arguments_are_refused_like_the_reference(index):
    name, args, kwargs = BAD_CALLS[index]
    with pytest.raises((TypeError, ValueError)) as expected:
        getattr(reference, name)(*args, **kwargs)
    with pytest.raises(expected.type, match=re.escape(str(expected.value))):
        getattr(_optimized(), name)(*args, **kwargs)


def _wide_storage_calls(dtype):
    math = F64 if dtype == F64 else F32
    x = _streams(dtype)
    w = torch.ones(N, C, dtype=dtype)
    return [
        ("residual", "mhc_pre", (x, *_pre_params(math))),
        (
            "residual",
            "mhc_post",
            (torch.zeros(2, C, dtype=dtype), x, torch.zeros(2, N, dtype=math), x.new_zeros(2, N, N)),
        ),
        ("residual", "mhc_head", (x, torch.zeros(N, N * C, dtype=math), torch.ones(1, dtype=math), x.new_zeros(N))),
        ("x", "expand_from_embedding", (torch.zeros(2, C, dtype=dtype), N)),
        ("hidden_states", "engram_gate", (x, x, x[:, 0], w, w, 1e-6, 1e-6)),
    ]


@pytest.mark.parametrize("dtype", (F32, F64))
def test_wide_storage_is_refused_with_a_type_error_naming_bf16(dtype):
    """The reference accepts these calls (it runs them in fp32 / fp64); the kernels are bf16."""
    for argument, name, args in _wide_storage_calls(dtype):
        getattr(reference, name)(*args)
        with pytest.raises(TypeError, match=rf"^{argument} must be bf16 .*got {dtype}"):
            getattr(_optimized(), name)(*args)


def test_modules_are_the_reference_modules_on_the_optimized_layers():
    """Same parameters, initialisation and option validation (the constructors are the reference's)."""
    optimized = _optimized()
    for name in ("EngramGate", "ExpandFromEmbedding", "MHCPre", "MHCPost", "MHCHead"):
        assert issubclass(getattr(optimized, name), getattr(reference, name))
        assert getattr(optimized, name).forward is not getattr(reference, name).forward
    with pytest.raises(ValueError, match="hidden_size"):
        optimized.MHCPre(0)
    assert sorted(optimized.__all__) == sorted(reference.__all__)


# ---------------------------------------------------------------------------------------------
# Compile-only smoke test of every layer, forward and backward
# ---------------------------------------------------------------------------------------------


def _leaf(tensor):
    return tensor.detach().requires_grad_(True)


def _check_grads(leaves):
    for name, leaf in leaves.items():
        assert leaf.grad is not None, name
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == leaf.dtype, name


def _run_layers(modeling, tokens: int, hidden: int):
    """Every layer's forward and backward on uninitialised CPU tensors; checks layouts only."""
    lead = (tokens,) if tokens != 6 else (2, 3)  # one case with two leading dimensions
    rows = 1
    for size in lead:
        rows *= size

    # Engram gate: k and v views of one fused projection output; one gain with main_grad.
    fused = _leaf(torch.empty(*lead, (N + 1) * hidden, dtype=BF16))
    k = fused[..., : N * hidden].unflatten(-1, (N, hidden))
    v = fused[..., N * hidden :]
    x = _leaf(torch.empty(*lead, N, hidden, dtype=BF16))
    wh, we = _leaf(torch.ones(N, hidden, dtype=BF16)), _leaf(torch.ones(N, hidden, dtype=BF16))
    we.main_grad = torch.zeros(N, hidden, dtype=F32)
    out = modeling.engram_gate(x, k, v, wh, we, 1e-6, 1e-6)
    assert out.shape == x.shape and out.dtype == BF16 and out.is_contiguous()
    out.backward(torch.ones_like(out))
    _check_grads({"x": x, "fused": fused, "wh": wh})
    assert we.grad is None

    # mHC pipeline: expand → pre → post → head.
    embedding = _leaf(torch.empty(*lead, hidden, dtype=BF16))
    params = {
        "fn": _leaf(torch.zeros(M3, N * hidden)),
        "scale": _leaf(torch.ones(3)),
        "base": _leaf(torch.zeros(M3)),
        "norm_weight": _leaf(torch.ones(N * hidden)),
        "head_fn": _leaf(torch.zeros(N * N + 2 * N, N * hidden)),  # TileKernels' padded rows
        "head_scale": _leaf(torch.ones(())),
        "head_base": _leaf(torch.zeros(N)),
    }
    streams = modeling.expand_from_embedding(embedding, N)
    assert streams.shape == (*lead, N, hidden) and streams.dtype == BF16
    layer_input, (post, comb) = modeling.mhc_pre(
        streams,
        params["fn"],
        params["scale"],
        params["base"],
        norm_weight=params["norm_weight"],
        sinkhorn_repeat=20,
        post_mult_value=2.0,
    )
    assert layer_input.shape == (*lead, hidden) and layer_input.dtype == BF16
    assert post.shape == (*lead, N) and comb.shape == (*lead, N, N) and post.dtype == comb.dtype == F32
    mixed = modeling.mhc_post(layer_input, streams, post, comb)
    assert mixed.shape == streams.shape and mixed.dtype == BF16 and mixed.is_contiguous()
    head = modeling.mhc_head(
        mixed, params["head_fn"], params["head_scale"], params["head_base"], norm_weight=params["norm_weight"]
    )
    assert head.shape == (*lead, hidden) and head.dtype == BF16
    head.backward(torch.ones_like(head))
    _check_grads({"embedding": embedding, **params})

    with torch.no_grad():
        layer_input, (post, comb) = modeling.mhc_pre(
            streams, params["fn"], params["scale"], params["base"], norm_weight=params["norm_weight"]
        )
    assert layer_input.shape == (*lead, hidden) and post.shape == (*lead, N) and comb.shape == (*lead, N, N)
    return rows


@pytest.mark.compile
def test_every_layer_runs_forward_and_backward_under_compile_only(monkeypatch):
    """0, 1 and 6 (as [2, 3]) tokens at C = 64 (16-byte vectors): every layer path, kernels built once
    (the oracle's compile pass builds the configurations of its other shapes)."""
    from tileproof.optimized import mhc
    from tileproof.optimized.jit import batched_device_compile, compile_only

    # Until the integrator re-exports the norm-fn and fused kernels from optimized.mhc.
    for name, module in NORM_FN_NAMES.items():
        if not hasattr(mhc, name):
            source = __import__(f"tileproof.optimized.{module}", fromlist=[name])
            monkeypatch.setattr(mhc, name, getattr(source, name), raising=False)
    modeling = _optimized()
    with contextlib.ExitStack() as stack:
        batch = None if torch.cuda.is_available() else stack.enter_context(batched_device_compile())
        stack.enter_context(compile_only())
        for tokens, hidden in ((0, 64), (1, 64), (6, 64)):
            _run_layers(modeling, tokens, hidden)
    if batch is not None:
        assert batch.compile(workers=2) == {}


# ---------------------------------------------------------------------------------------------
# Wiring: the optimized layers over the reference operators, through the oracle
# ---------------------------------------------------------------------------------------------


def _cpu_stand_in_device(name, tensor):
    """The layers refuse CPU tensors (with the layer's argument names); over the reference
    operators on the CPU they are the point, so that check is the one thing swapped out."""


@pytest.mark.parametrize("op_name", ("engram_gate_layer", "mhc_pipeline"))
def test_layer_wiring_over_the_reference_operators_passes_the_oracle(monkeypatch, op_name, seed):
    """The layers' autograd wiring on the CPU: with the kernel modules swapped for the reference
    operators (same names, signatures and results up to summation order), the layers must pass the
    oracle's bounds on its small quick cases. A gradient routed to the wrong place, dropped,
    transposed or left out of ``main_grad`` moves results by O(1) and fails here."""
    import types

    from tileproof.oracle import modeling as spec_module
    from tileproof.oracle import registry, runner
    from tileproof.oracle.policy import PASS, SKIP
    from tileproof.reference import engram as reference_engram
    from tileproof.reference import mhc as reference_mhc

    modeling = _optimized()
    monkeypatch.setattr(modeling, "engram", reference_engram)
    monkeypatch.setattr(modeling, "mhc", reference_mhc)
    monkeypatch.setattr(modeling, "require_cuda", _cpu_stand_in_device)
    op = registry.get_op(op_name)
    twin = runner.backend_twin("layers", types.SimpleNamespace(**{op_name: spec_module.LayerDriver(op, modeling)}))
    small = [case for case in registry.cases_of(op_name, "quick") if case.params.hidden <= 768]
    assert len(small) >= 4
    for case in small:
        checks, _ = runner.check_case(case, seed, torch.device("cpu"), None, False, twin=twin, self_checks=False)
        problems = [f"{c.name}: {c.status} {c.metric} {c.detail}" for c in checks if c.status not in (PASS, SKIP)]
        assert not problems, f"{case.label}:\n" + "\n".join(problems)
        compared = {c.name for c in checks if c.status == PASS}
        assert all(output.name in compared for output in op.outputs), case.label


def test_head_rows_scalar_scale_and_no_grad_path_over_the_reference_operators(monkeypatch, generator):
    """Wiring the oracle's driver does not reach: head fn rows beyond n (zero gradient, nothing else
    changes), a scalar head scale, and ``mhc_pre``'s no-grad path (``mhc_pre_big_fuse``) ≡ its grad path."""
    from tileproof.reference import engram as reference_engram
    from tileproof.reference import mhc as reference_mhc

    modeling = _optimized()
    monkeypatch.setattr(modeling, "engram", reference_engram)
    monkeypatch.setattr(modeling, "mhc", reference_mhc)
    monkeypatch.setattr(modeling, "require_cuda", _cpu_stand_in_device)
    tokens, hidden = 5, 16
    residual = torch.randn(tokens, N, hidden, generator=generator).to(BF16)
    fn = torch.randn(M3, N * hidden, generator=generator) / 16
    base, norm_weight = torch.randn(M3, generator=generator), 1 + torch.randn(N * hidden, generator=generator) / 8
    grad = torch.randn(tokens, hidden, generator=generator).to(BF16)

    def head(layers, head_fn, scale):
        leaves = [t.clone().requires_grad_(True) for t in (residual, head_fn, scale, base[:N], norm_weight)]
        out = layers.mhc_head(*leaves[:4], norm_weight=leaves[4])
        out.backward(grad)
        return out, [leaf.grad for leaf in leaves]

    out, grads = head(modeling, fn, torch.tensor(0.05))
    out_ref, grads_ref = head(reference, fn[:N], torch.tensor([0.05]))
    assert torch.equal(out, out_ref)
    assert grads[2].shape == () and torch.count_nonzero(grads[1][N:]) == 0
    grads[1], grads[2] = grads[1][:N], grads[2].reshape(1)
    for got, want in zip(grads, grads_ref, strict=True):
        # The residual's gradient carries one bf16 rounding more (module docstring): 2^-8 relative.
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)

    options = dict(norm_weight=norm_weight, sinkhorn_repeat=20, post_mult_value=2.0)
    with torch.no_grad():
        fused = modeling.mhc_pre(residual, fn, torch.tensor([0.05, 0.03, 0.04]), base, **options)
    with torch.enable_grad():
        leaves = [t.clone().requires_grad_(True) for t in (residual, fn, torch.tensor([0.05, 0.03, 0.04]), base)]
        layer_input, (post, comb) = modeling.mhc_pre(*leaves, **options)
    assert torch.equal(fused[0], layer_input) and torch.equal(fused[1][0], post) and torch.equal(fused[1][1], comb)


@pytest.mark.parametrize("lead", [(1,), (5,), (2, 1), (1, 3)])
def test_fused_projection_is_found_with_size_one_dimensions(lead):
    """k and v as views of one projection ``kv [..., (n+1)·D]`` are recognised whatever the stride
    PyTorch gives a dimension of size 1 (one token: ``kv[:, :n·D]`` gets token stride n·D); views that
    are not kv's head and tail, or not its rows, are not."""
    fused_projection = _optimized()._fused_projection
    kv = torch.zeros(*lead, (N + 1) * C, dtype=BF16)
    k, v = kv[..., : N * C].unflatten(-1, (N, C)), kv[..., N * C :]
    assert fused_projection(k, v, N, C) is kv
    swapped = kv[..., C:].unflatten(-1, (N, C)), kv[..., :C]
    assert fused_projection(*swapped, N, C) is None
    wider = torch.zeros(*lead, (N + 2) * C, dtype=BF16)
    assert fused_projection(wider[..., : N * C].unflatten(-1, (N, C)), wider[..., N * C : (N + 1) * C], N, C) is None
    every_other = torch.zeros(*lead, (N + 1) * 2 * C, dtype=BF16)[..., ::2]
    assert fused_projection(every_other[..., : N * C].unflatten(-1, (N, C)), every_other[..., N * C :], N, C) is None

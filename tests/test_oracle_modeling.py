"""CPU tests of the oracle spec of the trainable layers (``tileproof.oracle.modeling``).

Every quick case runs through ``runner.check_case`` on the CPU: inputs, the driver over the
reference layers (forward + backward), its self-checks (documented layouts, every gradient ≡ the
explicit backward references composed by hand in float64, the bounds' premises, ``main_grad``) and
the native reference against the float64 layers under each output's bound; with no optimized layers
yet each case ends "reference only". A layer twin (a namespace of layer functions, driven like the
reference) then shows that the comparison passes the reference layers and fails wiring bugs and
outputs moved past their bounds, and the self-checks fail when the reference misbehaves.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tileproof.oracle import modeling as spec_module
from tileproof.oracle import registry, runner
from tileproof.oracle.policy import FAIL, PASS, SKIP, RelativeError
from tileproof.reference import engram as reference_engram
from tileproof.reference import modeling

CPU = torch.device("cpu")
OPS = ("engram_gate_layer", "mhc_pipeline")


def _failures(checks):
    return [check for check in checks if check.status not in (PASS, SKIP)]


def _statuses(checks):
    return {check.name: check.status for check in checks}


def _layers(**overrides) -> types.SimpleNamespace:
    """The reference layers, some replaced: a stand-in for tileproof.optimized.modeling."""
    names = ("engram_gate", "expand_from_embedding", "mhc_pre", "mhc_post", "mhc_head")
    functions = {name: getattr(modeling, name) for name in names}
    return types.SimpleNamespace(__name__="stand_in_layers", **{**functions, **overrides})


def _check_with(name: str, case: registry.Case, layers, seed: int):
    op = registry.get_op(name)
    twin = runner.backend_twin("layers", types.SimpleNamespace(**{name: spec_module.LayerDriver(op, layers)}))
    checks, _ = runner.check_case(case, seed, CPU, None, False, twin=twin, self_checks=False)
    return _statuses(checks)


def _quick(name: str, predicate=lambda p: True) -> registry.Case:
    return next(case for case in registry.cases_of(name, "quick") if predicate(case.params))


# ---------------------------------------------------------------------------------------------
# Registration, policies, cases
# ---------------------------------------------------------------------------------------------


def test_both_layers_are_registered_with_stated_policies():
    assert "tileproof.oracle.modeling" in registry.FAMILY_MODULES and spec_module.OPS == OPS
    for name in OPS:
        op = registry.get_op(name)
        assert op.family == "modeling" and op.outputs
        assert all(o.why and isinstance(o.policy, RelativeError) and 0 < o.policy.bound <= 2.0**-3 for o in op.outputs)
        driver = op.reference()
        assert isinstance(driver, spec_module.LayerDriver) and driver.layers is modeling
        twin = op.optimized()  # the driver over tileproof.optimized.modeling once it has every layer
        assert twin is None or (isinstance(twin, spec_module.LayerDriver) and twin.layers.__name__.endswith("modeling"))
        for case in registry.cases_of(name, "full"):
            assert op.bytes_moved(case) > 0 or "/T0/" in case.label
            if twin is None:
                assert op.compile_group(case) is None  # nothing to compile for a reference-only layer


def test_optimized_is_a_driver_once_every_layer_exists(monkeypatch):
    spec = registry.get_op("engram_gate_layer")
    fake = types.ModuleType("tileproof.optimized.modeling")
    monkeypatch.setitem(sys.modules, "tileproof.optimized.modeling", fake)
    assert spec.optimized() is None  # the module exists, the layer does not
    fake.engram_gate = modeling.engram_gate
    driver = spec.optimized()
    assert isinstance(driver, spec_module.LayerDriver) and driver.layers is fake
    assert registry.get_op("mhc_pipeline").optimized() is None  # needs all four mHC layers


@pytest.mark.parametrize("tier", registry.TIERS)
def test_tiers_cover_the_edges(tier):
    gate = [case.params for case in registry.cases_of("engram_gate_layer", tier)]
    pipeline = [case.params for case in registry.cases_of("mhc_pipeline", tier)]
    for params in (gate, pipeline):
        tokens = {p.tokens for p in params}
        assert {0, 1} <= tokens and any(t % 2 and t > 1 for t in tokens)
    assert any(p.main_grad for p in gate) and any(p.batch > 1 for p in gate) and any(p.clamp_value > 0.1 for p in gate)
    assert any(p.pad for p in pipeline)
    if tier == "full":
        assert {4001, 8192} <= {p.tokens for p in gate} and {4096, 7168} <= {p.hidden for p in gate}
        assert {4001, 8192} <= {p.tokens for p in pipeline}
        assert {1280, 2560, 4096, 7168} <= {p.hidden for p in pipeline}


def test_full_cases_build_uninitialized():
    meta = torch.device("meta")
    for case in registry.select_cases("full", OPS):
        call = registry.get_op(case.op).build(case, meta, None)
        assert all(t.device.type == "meta" for t in call.tensors())


# ---------------------------------------------------------------------------------------------
# Every quick case through the runner
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPS)
def test_every_quick_case_passes_its_checks(name, seed):
    op = registry.get_op(name)
    gradients = [o.name for o in op.outputs if o.name.startswith("grad_")]
    for case in registry.cases_of(name, "quick"):
        checks, call = runner.check_case(case, registry.case_seed(seed, case.label), CPU, None, gpu=False)
        assert call is not None and _failures(checks) == [], (case.label, _failures(checks))
        names = {check.name for check in checks}
        # Without a GPU a layer with an optimized twin has its comparison skipped for that reason.
        skipped = runner.REFERENCE_ONLY if op.optimized() is None else "GPU comparison"
        assert "reference layout" in names and any(c.name == skipped for c in checks)
        assert {f"reference ≈ float64: {o.name}" for o in op.outputs} <= names
        assert {f"autograd ≡ explicit backwards (float64): {g}" for g in gradients} <= names, case.label
        assert any(n.startswith("premise") for n in names)
        if name == "engram_gate_layer":
            assert sum(n.startswith("main_grad") for n in names) == 2


def test_report_scales_bring_the_terms_rss_into_half_one(seed):
    op = registry.get_op("mhc_pipeline")
    call = op.build(_quick("mhc_pipeline", lambda p: p.tokens > 10), CPU, torch.Generator().manual_seed(seed))
    rss = op.backward_float64(call)[2]
    blocks = len(spec_module.PARAMETERS)
    flat_scales = [s for per_block in call.args[11][:blocks] for s in per_block] + list(call.args[11][blocks:])
    flat_rss = [r for per_block in rss[:blocks] for r in per_block] + list(rss[blocks:])
    assert len(flat_scales) == len(flat_rss) == spec_module.BLOCKS * blocks + blocks
    for scale, terms in zip(flat_scales, flat_rss, strict=True):
        assert 0.5 < float(terms.max()) * scale <= 1.0


def test_embedding_error_scale_bounds_the_gradient_it_scales(seed):
    """S, the backward taken term by term in magnitude, is ≥ |dh| everywhere (every weight is
    positive), and exceeds it where stream gradients cancel: there it is the denominator."""
    op = registry.get_op("mhc_pipeline")
    call = op.build(_quick("mhc_pipeline", lambda p: p.tokens > 10), CPU, torch.Generator().manual_seed(seed))
    d_h, _, _, scale = op.backward_float64(call)
    assert scale.shape == d_h.shape and scale.dtype == torch.float64
    assert bool((scale >= d_h.abs() * (1 - 1e-12)).all())
    assert float((scale / d_h.abs().clamp(min=1e-30)).max()) > 4  # some cancellation is present


# ---------------------------------------------------------------------------------------------
# The comparison: the reference layers pass, wiring bugs and moved outputs fail
# ---------------------------------------------------------------------------------------------


def test_engram_layer_comparison(seed):
    case = _quick("engram_gate_layer", lambda p: p.main_grad and p.hidden == 512)
    statuses = _check_with("engram_gate_layer", case, _layers(), seed)
    assert all(status == PASS for name, status in statuses.items() if name.startswith("grad_") or name == "out")

    def gate_without_main_grad(x, k, v, wh, we, clamp_value, eps):
        """A layer that ignores main_grad: the gains' gradients land in .grad."""
        w = wh.float() * we.float()
        out, *_ = reference_engram.gate_forward_math(
            x.flatten(0, -3).float(), k.flatten(0, -3).float(), v.flatten(0, -2).float(), w, eps, clamp_value
        )
        return out.to(x.dtype).reshape(x.shape)

    statuses = _check_with("engram_gate_layer", case, _layers(engram_gate=gate_without_main_grad), seed)
    assert statuses["grad_weight_hidden"] == statuses["grad_weight_embed"] == FAIL
    assert statuses["out"] == statuses["grad_k"] == PASS

    def gate_with_eps_dropped(x, k, v, wh, we, clamp_value, eps):
        return modeling.engram_gate(x, k, v, wh, we, clamp_value, 0.0)

    zero_stream = _quick("engram_gate_layer", lambda p: p.tokens >= 3 and p.hidden == 512)
    statuses = _check_with("engram_gate_layer", zero_stream, _layers(engram_gate=gate_with_eps_dropped), seed)
    assert FAIL in statuses.values()


def test_pipeline_comparison(seed):
    case = _quick("mhc_pipeline", lambda p: p.pad > 0)  # T 5, C 64, the embedding a strided view
    statuses = _check_with("mhc_pipeline", case, _layers(), seed)
    assert set(statuses.values()) == {PASS}

    def post_detaching_the_residual(x, residual, post_layer_mix, comb_res_mix):
        """The same forward, but the streams' gradient through comb never reaches the residual."""
        return modeling.mhc_post(x, residual.detach(), post_layer_mix, comb_res_mix)

    statuses = _check_with("mhc_pipeline", case, _layers(mhc_post=post_detaching_the_residual), seed)
    forward = ("out", "layer_inputs", "post_mixes", "comb_mixes", "residuals")
    assert all(statuses[name] == PASS for name in forward)
    assert statuses["grad_embedding"] == statuses["grad_fn"] == FAIL

    def pre_without_norm_weight(residual, fn, scale, base, *, norm_weight=None, **options):
        return modeling.mhc_pre(residual, fn, scale, base, **options)

    statuses = _check_with("mhc_pipeline", case, _layers(mhc_pre=pre_without_norm_weight), seed)
    assert statuses["post_mixes"] == statuses["grad_norm_weight"] == FAIL
    assert statuses["grad_head_norm_weight"] == PASS


@pytest.mark.parametrize("name, output", [("engram_gate_layer", "grad_k"), ("mhc_pipeline", "grad_head_scale")])
def test_an_output_moved_past_its_bound_fails(name, output, seed):
    op = registry.get_op(name)
    index = [o.name for o in op.outputs].index(output)
    policy = op.outputs[index].policy
    reference = op.reference()

    def moved(*args, **kwargs):
        outputs = list(op.split(reference(*args, **kwargs)))
        exact = outputs[index].double()
        outputs[index] = (exact + 4 * policy.bound * torch.clamp(exact.abs(), min=policy.atol)).to(outputs[index].dtype)
        return tuple(outputs)

    case = _quick(name, lambda p: p.tokens > 5)
    twin = runner.backend_twin("moved", types.SimpleNamespace(**{name: moved}))
    statuses = _statuses(runner.check_case(case, seed, CPU, None, False, twin=twin, self_checks=False)[0])
    assert statuses[output] == FAIL
    assert all(statuses[o.name] == PASS for o in op.outputs if o.name != output)


# ---------------------------------------------------------------------------------------------
# The self-checks can fail
# ---------------------------------------------------------------------------------------------


def _self_check(name: str, case: registry.Case, seed: int, damage=None):
    op = registry.get_op(name)
    call = op.build(case, CPU, torch.Generator().manual_seed(seed))
    outputs = list(op.split(call(op.reference())))
    if damage:
        damage(outputs)
    return _statuses(op.self_check(case, call, tuple(outputs)))


def test_main_grad_self_check_fails_when_the_gradient_is_not_routed(seed, monkeypatch):
    case = _quick("engram_gate_layer", lambda p: p.main_grad and p.hidden == 512)
    assert all(s == PASS for n, s in _self_check("engram_gate_layer", case, seed).items() if n.startswith("main_grad"))
    # The reference's routing replaced by a plain cast: the gradient reaches .grad, main_grad stays.
    monkeypatch.setattr(modeling._RouteToMainGrad, "apply", lambda param, dtype: param.to(dtype))
    statuses = _self_check("engram_gate_layer", case, seed)
    assert statuses["main_grad (weight_hidden): += fp32 gradient, ≡ .grad unrounded, .grad None"] == FAIL


def test_composition_self_check_fails_when_an_explicit_backward_is_wrong(seed, monkeypatch):
    case = _quick("engram_gate_layer", lambda p: p.tokens > 5 and p.clamp_value < 0.1)
    real = reference_engram.gate_backward_math

    def dv_doubled(*args, **kwargs):
        dx, dk, dv, dw = real(*args, **kwargs)
        return dx, dk, 2 * dv, dw

    monkeypatch.setattr(reference_engram, "gate_backward_math", dv_doubled)
    statuses = _self_check("engram_gate_layer", case, seed)
    assert statuses["autograd ≡ explicit backwards (float64): grad_v"] == FAIL
    assert statuses["autograd ≡ explicit backwards (float64): grad_k"] == PASS


def test_pipeline_self_checks_catch_damaged_outputs(seed):
    case = _quick("mhc_pipeline", lambda p: p.tokens > 10)
    assert FAIL not in _self_check("mhc_pipeline", case, seed).values()

    def damage(outputs):
        outputs[7] = outputs[7] * 1.25  # grad_scale
        outputs[0] = outputs[0].float()  # out in the wrong dtype

    statuses = _self_check("mhc_pipeline", case, seed, damage)
    assert statuses["reference layout"] == FAIL
    assert statuses["margin: reference within ½ of the bound: grad_scale"] == FAIL
    assert statuses["margin: reference within ½ of the bound: grad_base"] == PASS

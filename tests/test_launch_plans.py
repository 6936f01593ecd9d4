"""Launch plans (``tileproof.optimized.jit.LaunchPlans``): what a launcher decides once per call
signature, on the CPU.

A plan may only be reused by a call that would pass the same argument checks and make the same
decisions, so the key must tell apart everything the checks and decisions read (including Python
values that compare equal across types), and a plan must not keep the tensors of the call that made
it (it would hold them alive, and could launch on them instead of the caller's). The H200 proves
the plans' results: the oracle compares the first call of each case (a new plan) with the
reference and the second (the kept plan) with the first, bitwise.
"""

import pytest
import torch

from tileproof.optimized import jit
from tileproof.optimized.jit import LaunchPlans, call_signature, compile_only, outputs_only, tensor_signature
from tileproof.oracle import registry


def test_signature_tells_apart_what_a_launcher_reads():
    x = torch.zeros(64, 32)
    assert tensor_signature(x) == tensor_signature(torch.ones(64, 32))  # values are not read
    assert tensor_signature(x) != tensor_signature(x.T)  # strides
    assert tensor_signature(x) != tensor_signature(x.double())  # dtype
    assert tensor_signature(x) != tensor_signature(x[:, 1:])  # shape and the address's alignment
    assert tensor_signature(x.view(-1)[1:33]) != tensor_signature(x.view(-1)[4:36])  # 4 bytes against 16 off
    # Equal in Python, told apart by the argument checks: a key holds each value's type.
    assert len({call_signature(value) for value in (True, 1, 1.0)}) == 3
    assert call_signature(-0.0) != call_signature(0.0)  # rsqrt(0 + eps) tells them apart
    assert call_signature(1e-6) == call_signature(float("1e-6"))
    assert call_signature(x, None, "e4m3") == call_signature(torch.empty(64, 32), None, "e4m3")


def test_views_one_row_apart_share_a_signature():
    x = torch.zeros(64, 32)
    assert tensor_signature(x[1:]) == tensor_signature(x[:-1])  # 128 bytes apart: the same alignment


def test_plans_are_kept_per_signature_and_only_outside_compile_only():
    made = []

    def make(value):
        made.append(value)
        return lambda: value

    plans = LaunchPlans(make)
    assert plans.plan("a")() == "a"
    assert plans.plan("a")() == "a" and made == ["a"]  # kept: make is not called again
    assert plans.plan(1)() == 1 and plans.plan(True)() is True  # equal values, other types
    assert made == ["a", 1, True] and len(plans) == 3
    with compile_only():
        assert plans.plan("c")() == "c"
        plans.plan("a")
        assert made[-2:] == ["c", "a"]  # stand-in kernels: always planned afresh
    assert len(plans) == 3
    # An unhashable argument (a list where a tuple is expected) is planned afresh, so that its
    # check can report it, and never kept.
    assert plans.plan([1, 2])() == [1, 2]
    assert len(plans) == 3


def test_a_full_cache_starts_over(monkeypatch):
    monkeypatch.setattr(jit, "PLANS_PER_LAUNCHER", 3)
    plans = LaunchPlans(lambda value: lambda: value)
    for value in range(3):
        plans.plan(value)
    assert len(plans) == 3
    plans.plan(3)
    assert len(plans) == 1


def test_a_failed_check_keeps_no_plan():
    def make(x):
        raise ValueError("x must be 2-D")

    plans = LaunchPlans(make)
    with pytest.raises(ValueError, match="2-D"):
        plans.plan(torch.zeros(3))
    assert len(plans) == 0


def _captured(function, seen=None):
    """Every object a function's closure holds, through nested functions, tuples and lists."""
    seen = set() if seen is None else seen
    if id(function) in seen:
        return
    seen.add(id(function))
    for cell in function.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        yield from _held(value, seen)


def _held(value, seen):
    yield value
    if callable(value) and hasattr(value, "__closure__"):
        yield from _captured(value, seen)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _held(item, seen)


def _planned_cases():
    for op in registry.all_ops().values():
        if op.optimized() is not None:
            yield from (pytest.param(op, case, id=case.label) for case in op.cases("quick")[:6])


@pytest.mark.parametrize("op,case", list(_planned_cases()))
def test_a_plan_keeps_none_of_its_calls_tensors(monkeypatch, op, case):
    plans = []
    original = LaunchPlans.plan

    def recording(self, *arguments):
        plan = original(self, *arguments)
        plans.append(plan)
        return plan

    monkeypatch.setattr(LaunchPlans, "plan", recording)
    call = op.build(case, torch.device("cpu"), None)
    with outputs_only():
        call(op.optimized())
    inputs = {id(tensor) for tensor in call.tensors()}
    for plan in plans:
        held = [value for value in _captured(plan) if isinstance(value, torch.Tensor) and id(value) in inputs]
        assert not held, f"{op.name}: the plan holds {len(held)} of the call's tensors"


@pytest.mark.gpu
def test_a_kept_plan_still_refuses_what_its_checks_refuse():
    from tileproof.optimized.quant import per_token_cast

    x = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    per_token_cast(x, "e4m3", 128, round_sf=True)  # keeps a plan for round_sf=True
    with pytest.raises(TypeError, match="round_sf"):
        per_token_cast(x, "e4m3", 128, round_sf=1)  # equal to True in Python, refused by the check
    with pytest.raises(ValueError, match="CUDA"):
        per_token_cast(x.cpu(), "e4m3", 128, round_sf=True)


@pytest.mark.gpu
def test_views_of_other_alignments_get_their_own_plans():
    """The same shape and strides at 16, 4 and 2 bytes past an aligned address: three vector
    widths, each call bit for bit the reference's (a plan kept for the aligned view would read the
    others with misaligned 16-byte loads)."""
    from tileproof.optimized.jit import poison_outputs
    from tileproof.optimized.quant import per_token_cast
    from tileproof.reference.quant import per_token_cast as reference

    storage = (torch.randn(64 * 264 + 16, generator=torch.Generator().manual_seed(7)) * 3).to(torch.bfloat16).cuda()
    for offset in (8, 2, 1, 8):
        x = storage[offset : offset + 64 * 264].view(64, 264)[:, :256]
        with poison_outputs():
            q, sf = per_token_cast(x, "e4m3", 128)
        q_ref, sf_ref = reference(x.cpu(), "e4m3", 128)
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)), offset
        assert torch.equal(sf.cpu(), sf_ref), offset


def test_a_swept_schedule_gets_new_plans(monkeypatch):
    """The SwiGLU forward's schedule is read at each call (a sweep replaces ``FORWARD_SCHEDULE``'s
    entry between calls): it is part of the plan's key, so the next call launches the new schedule."""
    from tileproof.optimized.quant import swiglu

    launched_with = []

    def factory(*static, **options):
        launched_with.append(static)
        return lambda *arguments: None

    monkeypatch.setattr(swiglu, "swiglu_per_token_kernel", factory)
    monkeypatch.setattr(swiglu, "require_cuda", lambda name, tensor: None)
    monkeypatch.setattr(swiglu._FORWARD_PLANS, "_plans", {})  # CPU plans with a stand-in kernel: this test's only
    x = torch.randn(64, 2 * 256).to(torch.bfloat16)
    swiglu.swiglu_forward_and_per_token_cast(x, "e4m3", 128)
    swiglu.swiglu_forward_and_per_token_cast(x, "e4m3", 128)
    assert len(launched_with) == 1  # the second call ran the kept plan
    committed = swiglu.FORWARD_SCHEDULE[torch.bfloat16]
    monkeypatch.setitem(swiglu.FORWARD_SCHEDULE, torch.bfloat16, committed._replace(threads=512))
    swiglu.swiglu_forward_and_per_token_cast(x, "e4m3", 128)
    assert len(launched_with) == 2 and launched_with[1][-1] == 512 and launched_with[0][-1] == committed.threads


def test_norm_fn_plans_follow_their_schedules(monkeypatch):
    """The norm-fn launchers read their schedule dictionaries at each call (sweeps replace entries):
    the dictionaries are part of the plans' keys, so a changed entry builds and launches the new
    kernels, in the forward and the backward."""
    from tileproof.optimized import mhc_norm

    built = []

    def recorder(name):
        def factory(*static, **options):
            built.append((name, static, tuple(sorted(options.items()))))
            return lambda *arguments: None

        return factory

    stand_ins = ("folded_fn_split_kernel", "norm_fn_mma_kernel", "norm_fn_finish_kernel", "norm_fn_grad_mma_kernel")
    for name in (*stand_ins, "norm_fn_reduce_columns_kernel"):
        monkeypatch.setattr(mhc_norm, name, recorder(name))
    monkeypatch.setattr(mhc_norm, "require_cuda", lambda name, tensor: None)
    for plans in (mhc_norm._NORM_FN_PLANS, mhc_norm._NORM_FN_BWD_PLANS):
        monkeypatch.setattr(plans, "_plans", {})  # CPU plans with stand-in kernels: this test's only
    residual = torch.randn(64, 4, 32).to(torch.bfloat16)  # nC = 128: the tensor-core path
    fn = torch.randn(24, 128)
    grad = torch.randn(64, 24)

    def mma_stages():
        return [static[2] for name, static, _ in built if name == "norm_fn_mma_kernel"]

    def grad_stages():
        return [dict(options)["stages"] for name, _, options in built if name == "norm_fn_grad_mma_kernel"]

    for _ in range(2):
        mhc_norm.mhc_pre_norm_fn(residual, fn, None, 1e-6)
        mhc_norm.mhc_pre_norm_fn_bwd(grad, residual, fn, None, 1e-6)
    assert mma_stages() == [mhc_norm.MMA_SCHEDULE["stages"]] * 2  # one plan each: the forward's, the backward's
    assert grad_stages() == [mhc_norm.GRAD_MMA_SCHEDULE["stages"]]
    monkeypatch.setitem(mhc_norm.MMA_SCHEDULE, "stages", mhc_norm.MMA_SCHEDULE["stages"] + 1)
    monkeypatch.setitem(mhc_norm.GRAD_MMA_SCHEDULE, "stages", mhc_norm.GRAD_MMA_SCHEDULE["stages"] + 1)
    mhc_norm.mhc_pre_norm_fn(residual, fn, None, 1e-6)
    mhc_norm.mhc_pre_norm_fn_bwd(grad, residual, fn, None, 1e-6)
    assert mma_stages()[2:] == [mhc_norm.MMA_SCHEDULE["stages"]] * 2
    assert grad_stages()[1:] == [mhc_norm.GRAD_MMA_SCHEDULE["stages"]]

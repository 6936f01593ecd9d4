"""GPU: the optimized modeling layers (``tileproof.optimized.modeling``) against the reference layers.

Outputs and every gradient: each quick case of the oracle's two layer-level operators
(``oracle/modeling.py``: ``engram_gate_layer`` and ``mhc_pipeline``) runs through the oracle's own
``check_case``, so the bounds are the oracle's constants, outputs start poisoned, two runs must be
identical and the inputs untouched. Properties the oracle's drivers do not reach, each compared bit
for bit between two runs of the optimized layers (no tolerance needed):

- ``main_grad``: the gains' fp32 gradient lands in ``main_grad`` (in place, accumulating over
  backwards, ``.grad`` left None) and its bf16 rounding is exactly the ``.grad`` of a gain without one;
- the no-grad path of ``mhc_pre`` (``mhc_pre_big_fuse``, norm weight included) equals the forward of
  the differentiable path;
- ``mhc_head``: fn rows beyond n get a zero gradient and do not change anything else; a scalar
  ``scale`` behaves as ``[1]``;
- leading dimensions ``[2, T/2]`` give the flattened ``[T]`` results;
- ``expand_from_embedding`` equals the reference exactly.
"""

import pytest
import torch

from tileproof.oracle import registry, runner
from tileproof.oracle.policy import PASS, SKIP
from tileproof.reference import modeling as reference

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
N = 4
M3 = N * N + 2 * N
BF16, F32 = torch.bfloat16, torch.float32
OPS = ("engram_gate_layer", "mhc_pipeline")


def _optimized():
    from tileproof.optimized import modeling

    return modeling


def _bits_equal(name, actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    assert torch.equal(actual.view(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize(
    "case", [case for op in OPS for case in registry.cases_of(op, "quick")], ids=lambda case: case.label
)
def test_oracle_case(case, seed):
    checks, _ = runner.check_case(case, seed, DEVICE, None, True, self_checks=False)
    problems = [f"{c.name}: {c.status} {c.metric} {c.detail}" for c in checks if c.status not in (PASS, SKIP)]
    assert not problems, "\n".join(problems)
    compared = {c.name for c in checks if c.status == PASS}
    missing = [output.name for output in registry.get_op(case.op).outputs if output.name not in compared]
    assert not missing, f"not compared (is tileproof.optimized.modeling complete?): {missing}"


# ---------------------------------------------------------------------------------------------
# Engram gate: main_grad
# ---------------------------------------------------------------------------------------------


def _gate_inputs(generator, lead, hidden):
    x = torch.randn(*lead, N, hidden, generator=generator).to(BF16)
    fused = torch.randn(*lead, (N + 1) * hidden, generator=generator).to(BF16)  # k and v: views of one buffer
    gains = [(1 + 0.25 * torch.randn(N, hidden, generator=generator)).to(BF16) for _ in range(2)]
    grad = torch.randn(*lead, N, hidden, generator=generator).to(BF16)
    return [t.to(DEVICE) for t in (x, fused, *gains, grad)]


def _gate_run(x, fused, wh, we, grad, main_grads=(None, None), backwards=1):
    hidden = x.shape[-1]
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, fused, wh, we)]
    for leaf, main_grad in zip(leaves[2:], main_grads, strict=True):
        if main_grad is not None:
            leaf.main_grad = main_grad
    k = leaves[1][..., : N * hidden].unflatten(-1, (N, hidden))
    v = leaves[1][..., N * hidden :]
    for _ in range(backwards):
        out = _optimized().engram_gate(leaves[0], k, v, leaves[2], leaves[3], 1e-6, 1e-6)
        out.backward(grad)
    return out, leaves


@pytest.mark.parametrize("tokens,hidden", [(1, 512), (37, 768), (300, 4096)])
def test_engram_gate_main_grad(generator, tokens, hidden):
    x, fused, wh, we, grad = _gate_inputs(generator, (tokens,), hidden)
    out, plain = _gate_run(x, fused, wh, we, grad)
    zeros = [torch.zeros(N, hidden, dtype=F32, device=DEVICE) for _ in range(2)]
    out_main, routed = _gate_run(x, fused, wh, we, grad, main_grads=zeros)
    _bits_equal("out", out_main, out)
    for name, a, b in (("dx", routed[0], plain[0]), ("dfused", routed[1], plain[1])):
        _bits_equal(name, a.grad, b.grad)
    for name, leaf, fresh in (("wh", routed[2], plain[2]), ("we", routed[3], plain[3])):
        assert leaf.grad is None, f"{name}.grad must stay None with a main_grad"
        _bits_equal(f"bf16({name}.main_grad)", leaf.main_grad.to(BF16), fresh.grad)

    # Accumulation over two backwards: G + G = 2·G exactly in fp32.
    twice = [torch.zeros(N, hidden, dtype=F32, device=DEVICE) for _ in range(2)]
    _gate_run(x, fused, wh, we, grad, main_grads=twice, backwards=2)
    for once, two in zip(zeros, twice, strict=True):
        _bits_equal("main_grad after two backwards", two, 2 * once)

    # Only one gain with main_grad: the other still gets its .grad.
    only = torch.zeros(N, hidden, dtype=F32, device=DEVICE)
    _, mixed = _gate_run(x, fused, wh, we, grad, main_grads=(None, only))
    _bits_equal("wh.grad", mixed[2].grad, plain[2].grad)
    assert mixed[3].grad is None
    _bits_equal("we.main_grad", only, zeros[1])


def test_engram_gate_leading_dimensions(generator):
    x, fused, wh, we, grad = _gate_inputs(generator, (2, 9), 768)
    out, nested = _gate_run(x, fused, wh, we, grad)
    flat_out, flat = _gate_run(x.flatten(0, 1), fused.flatten(0, 1), wh, we, grad.flatten(0, 1))
    _bits_equal("out", out.flatten(0, 1), flat_out)
    for a, b in zip(nested, flat, strict=True):
        _bits_equal("grad", a.grad.reshape(b.grad.shape), b.grad)


@pytest.mark.parametrize("tokens,hidden", [(1, 512), (37, 768), (300, 4096)])
def test_engram_gate_fused_projection_gradient(generator, tokens, hidden):
    """k and v as views of one projection output take the fused path (one gradient buffer written by
    the kernel): bit for bit the gradients of separate k and v leaves, also when a view asks for its
    own gradient (retain_grad keeps the views in the graph: the unfused path)."""
    x, fused, wh, we, grad = _gate_inputs(generator, (tokens,), hidden)
    out, leaves = _gate_run(x, fused, wh, we, grad)
    separate = [t.detach().clone().requires_grad_(True) for t in (x, fused[:, : N * hidden], fused[:, N * hidden :])]
    key = separate[1].unflatten(-1, (N, hidden))
    out_separate = _optimized().engram_gate(separate[0], key, separate[2], wh, we, 1e-6, 1e-6)
    out_separate.backward(grad)
    _bits_equal("out", out, out_separate)
    _bits_equal("dx", leaves[0].grad, separate[0].grad)
    _bits_equal("dkv", leaves[1].grad, torch.cat([separate[1].grad, separate[2].grad], dim=1))

    kv = fused.detach().clone().requires_grad_(True)
    k, v = kv[:, : N * hidden].unflatten(-1, (N, hidden)), kv[:, N * hidden :]
    k.retain_grad()
    _optimized().engram_gate(x, k, v, wh, we, 1e-6, 1e-6).backward(grad)
    _bits_equal("dk (retained)", k.grad.flatten(1), separate[1].grad)
    _bits_equal("dkv (retained views)", kv.grad, leaves[1].grad)


# ---------------------------------------------------------------------------------------------
# mHC
# ---------------------------------------------------------------------------------------------


def _pre_inputs(generator, tokens, hidden):
    width = N * hidden
    residual = torch.randn(tokens, N, hidden, generator=generator).to(BF16)
    fn = torch.randn(M3, width, generator=generator) * 0.5 / width**0.5
    scale = torch.tensor([0.05, 0.03, 0.04])
    base = torch.empty(M3).uniform_(-3.3, 3.3, generator=generator)
    norm_weight = torch.empty(width).uniform_(0.9, 1.1, generator=generator)
    return [t.to(DEVICE) for t in (residual, fn, scale, base, norm_weight)]


@pytest.mark.parametrize("tokens,hidden,repeat", [(0, 64, 20), (1, 64, 10), (13, 1280, 20), (4001, 2560, 10)])
def test_mhc_pre_no_grad_path_equals_the_grad_path(generator, tokens, hidden, repeat):
    residual, fn, scale, base, norm_weight = _pre_inputs(generator, tokens, hidden)
    options = dict(norm_weight=norm_weight, sinkhorn_repeat=repeat, post_mult_value=2.0)
    with torch.no_grad():
        fused = _optimized().mhc_pre(residual, fn, scale, base, **options)
    leaves = [t.detach().clone().requires_grad_(True) for t in (residual, fn, scale, base)]
    options["norm_weight"] = norm_weight.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        layer_input, (post, comb) = _optimized().mhc_pre(*leaves, **options)
    _bits_equal("layer_input", fused[0], layer_input.detach())
    _bits_equal("post_mix", fused[1][0], post.detach())
    _bits_equal("comb_mix", fused[1][1], comb.detach())


def _head_run(residual, fn, scale, base, norm_weight, grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in (residual, fn, scale, base, norm_weight)]
    out = _optimized().mhc_head(*leaves[:4], norm_weight=leaves[4])
    out.backward(grad)
    return out, leaves


@pytest.mark.parametrize("tokens,hidden", [(1, 64), (37, 1280)])
def test_mhc_head_padded_rows_and_scalar_scale(generator, tokens, hidden):
    residual, fn, _, base, norm_weight = _pre_inputs(generator, tokens, hidden)
    grad = torch.randn(tokens, hidden, generator=generator).to(BF16).to(DEVICE)
    scale = torch.tensor([0.05], device=DEVICE)
    out, plain = _head_run(residual, fn[:N].contiguous(), scale, base[:N], norm_weight, grad)
    out_padded, padded = _head_run(residual, fn, scale.reshape(()), base[:N], norm_weight, grad)
    _bits_equal("out", out_padded, out)
    for index, name in ((0, "residual"), (3, "base"), (4, "norm_weight")):
        _bits_equal(f"d{name}", padded[index].grad, plain[index].grad)
    _bits_equal("dfn rows < n", padded[1].grad[:N], plain[1].grad)
    assert torch.count_nonzero(padded[1].grad[N:]) == 0, "fn rows beyond n must get a zero gradient"
    assert padded[2].grad.shape == ()
    _bits_equal("dscale", padded[2].grad.reshape(1), plain[2].grad)


def test_mhc_post_and_expand_leading_dimensions(generator):
    hidden = 1280
    x = torch.randn(2, 7, hidden, generator=generator).to(BF16).to(DEVICE)
    streams = _optimized().expand_from_embedding(x)
    _bits_equal("expand", streams, reference.expand_from_embedding(x))
    residual = torch.randn(2, 7, N, hidden, generator=generator).to(BF16).to(DEVICE)
    post = torch.rand(2, 7, N, generator=generator).to(DEVICE) * 2
    comb = torch.rand(2, 7, N, N, generator=generator).to(DEVICE)
    grad = torch.randn(2, 7, N, hidden, generator=generator).to(BF16).to(DEVICE)

    def run(*tensors):
        leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
        out = _optimized().mhc_post(*leaves)
        out.backward(grad.reshape(out.shape))
        return out, leaves

    out, nested = run(x, residual, post, comb)
    flat_out, flat = run(x.flatten(0, 1), residual.flatten(0, 1), post.flatten(0, 1), comb.flatten(0, 1))
    _bits_equal("out", out.flatten(0, 1), flat_out)
    for a, b in zip(nested, flat, strict=True):
        _bits_equal("grad", a.grad.reshape(b.grad.shape), b.grad)


# ---------------------------------------------------------------------------------------------
# Training: both twins follow the same loss curve
# ---------------------------------------------------------------------------------------------


def _toy_model(modeling, vocab: int = 16, hidden: int = 8, n: int = N) -> torch.nn.Module:
    """docs/modeling.md's toy (embedding → Engram gate → two mHC blocks → head) built from one twin's
    layers, with bf16 storage (the optimized layers' contract); mHC parameters stay fp32."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = modeling.MHCPre(hidden, n, post_mult_value=2.0, sinkhorn_repeat=20)
            self.ffn = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden)).to(BF16)

        def forward(self, streams):
            layer_in, (post_mix, comb_mix) = self.pre(streams)
            return modeling.mhc_post(self.ffn(layer_in), streams, post_mix, comb_mix)

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden).to(BF16)
            self.memory = nn.Embedding(vocab, hidden).to(BF16)
            self.kv = nn.Linear(hidden, (n + 1) * hidden, bias=False).to(BF16)
            self.gate = modeling.EngramGate(n, hidden, dtype=BF16)
            self.blocks = nn.ModuleList([Block() for _ in range(2)])
            self.head = modeling.MHCHead(hidden, n)
            self.lm_head = nn.Linear(hidden, vocab).to(BF16)

        def forward(self, tokens, previous):
            streams = modeling.expand_from_embedding(self.embed(tokens), n)
            kv = self.kv(self.memory(previous))
            k = kv[..., : n * hidden].unflatten(-1, (n, hidden))
            streams = self.gate(streams, k, kv[..., n * hidden :])
            for block in self.blocks:
                streams = block(streams)
            return self.lm_head(self.head(streams)).float()

    return Toy()


def _loss_curve(model, tokens, previous, target, steps: int, learning_rate: float) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(tokens, previous).flatten(0, 1), target.flatten())
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter -= learning_rate * parameter.grad
        losses.append(loss.item())
    return losses


# The twins' layers differ by the oracle's layer bounds (a few bf16 units of 2^-8 in the streams);
# SGD carries those differences into the parameters, so the curves drift apart slowly: 2% of the
# loss over ten steps is about five bf16 units of the logits.
TRAINING_CURVE_RTOL = 0.02


def test_toy_training_curves_agree():
    """Ten SGD steps of docs/modeling.md's toy in bf16 storage on the GPU, from the same initial
    parameters and batch: the optimized layers' loss curve follows the reference layers' within
    ``TRAINING_CURVE_RTOL`` at every step, and the reference's curve goes down."""
    optimized = _optimized()
    torch.manual_seed(0)
    reference_model = _toy_model(reference).to(DEVICE)
    optimized_model = _toy_model(optimized).to(DEVICE)
    optimized_model.load_state_dict(reference_model.state_dict())
    tokens = torch.randint(0, 16, (4, 16), device=DEVICE)
    previous = tokens.roll(1, dims=1)
    target = (tokens + previous) % 16
    curves = [_loss_curve(model, tokens, previous, target, 10, 0.5) for model in (reference_model, optimized_model)]
    deviation = max(abs(o - r) / r for r, o in zip(*curves, strict=True))
    assert curves[0][-1] < curves[0][0], curves
    assert deviation <= TRAINING_CURVE_RTOL, (deviation, curves)

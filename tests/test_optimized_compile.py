"""``torch.compile(fullgraph=True)`` of the optimized layers, without a GPU (issue 8).

A small model built from every layer of ``tileproof.optimized.modeling`` (``layers_model``, also the
model of ``tests/test_gpu_library.py``) compiles to one graph per grad mode, without a graph break,
and the graphs dynamo and AOTAutograd record call the kernels as ``torch.ops.tileproof`` operators:
the forward kernels in the forward graph, the backward kernels in the backward graph, the inference
kernel ``mhc_pre_big_fuse`` under ``torch.no_grad()``. Values are the GPU test's business.

Dynamo traces the model with fake tensors, through the operators' fake implementations; the recorded
graphs then run on real CPU tensors under ``outputs_only()``, where every launcher validates its
arguments and returns its outputs unwritten (no kernel built or launched). Only the runs are under
that context, not the tracing: under it a launcher is plain PyTorch that dynamo could trace. Fake CUDA tensors would
be closer to the GPU, but not with autograd: a CPU-only PyTorch cannot make the gradient
accumulator of a fake CUDA leaf (it asks for the CUDA device guard and aborts the process).
"""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

from tileproof.optimized.jit import outputs_only

N = 4
HIDDEN = 64  # 16-byte vectors of bf16
VOCAB = 16
BF16 = torch.bfloat16

FORWARD_KERNELS = {
    "fused_weight",
    "engram_gate_fwd",
    "expand_to_mhc",
    "mhc_pre_norm_fn",
    "mhc_pre_split_mixes",
    "sinkhorn_normalize",
    "mhc_pre_apply_mix",
    "mhc_post",
    "mhc_head_compute_mix",
}
BACKWARD_KERNELS = {
    "engram_gate_bwd",
    "grad_w_reduce",
    "expand_to_mhc_bwd",
    "mhc_pre_norm_fn_bwd",
    "mhc_pre_split_mixes_bwd",
    "sinkhorn_normalize_bwd",
    "mhc_pre_apply_mix_bwd",
    "mhc_post_bwd",
    "mhc_head_compute_mix_bwd",
}
# With gradients disabled mhc_pre runs its inference kernel; the head keeps its three steps.
INFERENCE_KERNELS = {
    "fused_weight",
    "engram_gate_fwd",
    "expand_to_mhc",
    "mhc_pre_big_fuse",
    "mhc_post",
    "mhc_pre_norm_fn",
    "mhc_head_compute_mix",
    "mhc_pre_apply_mix",
}


def layers_model(modeling, hidden: int = HIDDEN, vocab: int = VOCAB, n: int = N) -> nn.Module:
    """docs/modeling.md's toy (embedding → Engram gate → two mHC blocks → mHC head → LM head) on one
    twin's layers: every layer, as a module (``EngramGate``, ``MHCPre``, ``MHCHead``) or a function
    (``expand_from_embedding``, ``mhc_post``); the second block's ``MHCPre`` without a norm weight.
    bf16 storage, mHC parameters fp32; tensors are made in their dtype on the default device (``with
    torch.device(...)``)."""

    class Block(nn.Module):
        def __init__(self, use_norm_weight: bool):
            super().__init__()
            self.pre = modeling.MHCPre(
                hidden, n, use_norm_weight=use_norm_weight, post_mult_value=2.0, sinkhorn_repeat=20
            )
            self.ffn = nn.Sequential(
                nn.Linear(hidden, 2 * hidden, dtype=BF16), nn.SiLU(), nn.Linear(2 * hidden, hidden, dtype=BF16)
            )

        def forward(self, streams):
            layer_input, (post_mix, comb_mix) = self.pre(streams)
            return modeling.mhc_post(self.ffn(layer_input), streams, post_mix, comb_mix)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden, dtype=BF16)
            self.memory = nn.Embedding(vocab, hidden, dtype=BF16)
            self.kv = nn.Linear(hidden, (n + 1) * hidden, bias=False, dtype=BF16)
            self.gate = modeling.EngramGate(n, hidden, dtype=BF16)
            self.blocks = nn.ModuleList([Block(use_norm_weight=True), Block(use_norm_weight=False)])
            self.head = modeling.MHCHead(hidden, n)
            self.lm_head = nn.Linear(hidden, vocab, dtype=BF16)

        def forward(self, tokens, previous):
            streams = modeling.expand_from_embedding(self.embed(tokens), n)
            kv = self.kv(self.memory(previous))
            k = kv[..., : n * hidden].unflatten(-1, (n, hidden))
            streams = self.gate(streams, k, kv[..., n * hidden :])
            for block in self.blocks:
                streams = block(streams)
            return self.lm_head(self.head(streams)).float()

    return Model()


class GraphRecorder:
    """A ``torch.compile`` backend that keeps every graph it is given: dynamo's, then AOTAutograd's
    forward (or inference) and backward graphs, which it runs as they are under ``outputs_only()``
    (no GPU here: each launcher returns its outputs unwritten). Tracing runs outside that context,
    as on a GPU, so a launcher dynamo tried to trace would not be the shape function it is there."""

    def __init__(self):
        self.dynamo, self.forward, self.backward = [], [], []

    def __call__(self, graph_module, example_inputs):
        self.dynamo.append(graph_module)

        def keeping(graphs):
            def compiler(graph, _inputs):
                graphs.append(graph)

                def run(*args):
                    with outputs_only():
                        return graph(*args)

                return make_boxed_func(run)

            return compiler

        backend = aot_autograd(fw_compiler=keeping(self.forward), bw_compiler=keeping(self.backward))
        return backend(graph_module, example_inputs)


def tileproof_ops(graph_module) -> set[str]:
    """The ``torch.ops.tileproof`` operators a graph calls: directly, or through ``auto_functionalized``
    (how a graph calls an operator that writes into its arguments)."""
    names = set()
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        for target in (node.target, *node.args[:1]):
            if isinstance(target, torch._ops.OpOverload) and target.namespace == "tileproof":
                names.add(target.overloadpacket.__name__)
    return names


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_layers_compile_without_a_graph_break_through_the_custom_ops(fresh_dynamo, monkeypatch):
    from tileproof.optimized import modeling

    # CPU tensors here: the layers' own device check (which refuses them) is the one thing swapped out.
    monkeypatch.setattr(modeling, "require_cuda", lambda name, tensor: None)

    model = layers_model(modeling)
    model.gate.weight_hidden.main_grad = torch.zeros(N, HIDDEN)  # the gain gradient's other route
    tokens = torch.randint(0, VOCAB, (2, 8))
    previous = tokens.roll(1, dims=1)
    recorder = GraphRecorder()
    compiled = torch.compile(model, fullgraph=True, backend=recorder)  # a graph break raises
    logits = compiled(tokens, previous)
    logits.sum().backward()
    with torch.no_grad():
        inference = compiled(tokens, previous)

    assert logits.shape == inference.shape == (2, 8, VOCAB)
    assert len(recorder.dynamo) == 2, "one graph per grad mode"
    assert len(recorder.forward) == 2 and len(recorder.backward) == 1
    assert tileproof_ops(recorder.forward[0]) == FORWARD_KERNELS
    assert tileproof_ops(recorder.backward[0]) == BACKWARD_KERNELS
    assert tileproof_ops(recorder.forward[1]) == INFERENCE_KERNELS
    # Every parameter got its gradient, the gain with main_grad there instead of in .grad.
    missing = [name for name, p in model.named_parameters() if p.grad is None and name != "gate.weight_hidden"]
    assert not missing and model.gate.weight_hidden.grad is None
    # Eager calls keep the plain launchers.
    assert modeling._kernels(modeling.mhc) is modeling.mhc and modeling._kernels(modeling.engram) is modeling.engram

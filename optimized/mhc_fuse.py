"""Optimized twin of the mHC fused operators (contract §5): ``mhc_pre_big_fuse`` and ``mhc_multilayer_recompute``.

Same public names, argument order and results as ``tileproof.reference.mhc``; each output within the
policy its oracle states (``oracle/mhc.py``).

Design:

- **Multilayer recompute** (``apply_post_kernel``): one kernel per replayed layer with a post. A
  thread takes ``items`` 16-byte vectors of one token row of ``X_l``, loads the ``n`` streams once and
  writes both ``layer_input_l = bf16(Σ_i pre_i·X_l[i])`` and ``X_{l+1}[o] = bf16(post_o·y + Σ_i
  comb[i, o]·X_l[i])``, with the operation order of ``mhc_pre_apply_mix`` and ``mhc_post``
  (``tileproof.optimized.mhc``): fp32, streams in index order, one bf16 rounding each. ``X_{l+1}`` is
  read back from its bf16 buffer by the next layer, which is what makes the replay bit-identical to
  the layers run one by one (the contract): keeping it in fp32 across layers would not be. A layer
  without a post (the last one when P = L − 1) is ``apply_mix_kernel`` of ``optimized/mhc.py``.
  Per layer the streams are read once instead of twice (pre-apply and post separately): 2nC + 2C
  bf16 elements move per token instead of 3nC + 2C. The outputs go straight into the caller's
  buffers (16-byte stores when their rows allow); a buffer whose channels are not contiguous gets
  a contiguous temporary, copied in after the kernel.
- **Big fuse**: composes the optimized kernels, ``mhc_pre_norm_fn`` (``optimized/mhc_norm.py``, the
  TF32 GEMM with the norm weight folded), then the split, Sinkhorn and pre-apply kernels of
  ``optimized/mhc.py``. Its results are therefore bit-identical to those four optimized operators
  run one by one; the streams are read twice (GEMM and pre-apply). A single-pass kernel (one CTA per
  token reading its streams once) is not written yet.
"""

import tilelang.language as T
import torch

from tileproof.reference.mhc import check_big_fuse_inputs, check_multilayer_inputs

from .jit import address, compiling_only, flat_view, jit, new_output, require_cuda
from .mhc import (
    STREAM_ITEMS,
    STREAM_THREADS,
    _channel_strides,
    _stream_vector,
    apply_mix_kernel,
    load_channels,
    load_streams,
    mhc_pre_apply_mix,
    mhc_pre_split_mixes,
    post_mix_item,
    pre_mix_item,
    sinkhorn_normalize,
    store_channels,
)

__all__ = ["mhc_pre_big_fuse", "mhc_multilayer_recompute"]

F32 = torch.float32
BF16 = torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Multilayer recompute
# ---------------------------------------------------------------------------------------------


@jit()
def apply_post_kernel(n: int, vector: int, items: int = STREAM_ITEMS, threads: int = STREAM_THREADS):
    """One replayed layer: ``layer_in[t, c] = Σ_i pre[t, i]·X[t, i, c]`` and ``out[t, o, c] =
    post[t, o]·y[t, c] + Σ_i comb[t, i, o]·X[t, i, c]`` from one read of ``X`` (fp32, i in order, one
    bf16 rounding each, as ``apply_mix_kernel`` and ``post_kernel``). Grid: (T, channel blocks of
    ``threads·items`` vectors); strides in vectors; the outputs' channels are contiguous."""
    residual_span = T.dynamic("residual_span")
    pre_span = T.dynamic("pre_span")
    x_span = T.dynamic("x_span")
    post_span = T.dynamic("post_span")
    comb_span = T.dynamic("comb_span")
    layer_input_span = T.dynamic("layer_input_span")
    out_span = T.dynamic("out_span")

    @T.prim_func
    def kernel(
        residual: T.Tensor((residual_span,), "bfloat16"),
        pre_mix: T.Tensor((pre_span,), "float32"),
        x: T.Tensor((x_span,), "bfloat16"),
        post_mix: T.Tensor((post_span,), "float32"),
        comb: T.Tensor((comb_span,), "float32"),
        layer_input: T.Tensor((layer_input_span,), "bfloat16"),
        out: T.Tensor((out_span,), "bfloat16"),
        num_tokens: T.int32,
        hidden_vectors: T.int32,
        residual_token_stride: T.int32,
        residual_stream_stride: T.int32,
        residual_channel_stride: T.int32,
        pre_token_stride: T.int32,
        pre_stream_stride: T.int32,
        x_token_stride: T.int32,
        x_channel_stride: T.int32,
        post_token_stride: T.int32,
        post_stream_stride: T.int32,
        comb_token_stride: T.int32,
        comb_source_stride: T.int32,
        comb_destination_stride: T.int32,
        layer_input_token_stride: T.int32,
        out_token_stride: T.int32,
        out_stream_stride: T.int32,
    ):
        with T.Kernel(num_tokens, T.ceildiv(hidden_vectors, threads * items), threads=threads) as (token, block):
            tx = T.get_thread_binding()
            raw = T.alloc_local((vector,), "bfloat16")
            y = T.alloc_local((items * vector,), "bfloat16")
            streams = T.alloc_local((n * items * vector,), "bfloat16")
            mixed = T.alloc_local((items * vector,), "float32")
            pre = T.alloc_local((n,), "float32")
            post = T.alloc_local((n,), "float32")
            weights = T.alloc_local((n * n,), "float32")
            t64 = T.cast(token, "int64")
            for o in T.unroll(n):
                pre[o] = pre_mix[t64 * pre_token_stride + o * pre_stream_stride]
                post[o] = post_mix[t64 * post_token_stride + o * post_stream_stride]
                for i in T.unroll(n):
                    weights[i * n + o] = comb[
                        t64 * comb_token_stride + i * comb_source_stride + o * comb_destination_stride
                    ]
            for item in T.unroll(items):
                column = (block * items + item) * threads + tx
                load_channels(
                    x,
                    y,
                    t64 * x_token_stride,
                    column,
                    T.cast(x_channel_stride, "int64"),
                    item,
                    hidden_vectors,
                    vector,
                )
                load_streams(
                    residual,
                    streams,
                    t64 * residual_token_stride,
                    residual_stream_stride,
                    T.cast(residual_channel_stride, "int64"),
                    column,
                    item,
                    items,
                    hidden_vectors,
                    n,
                    vector,
                )
            for item in T.unroll(items):
                column = (block * items + item) * threads + tx
                pre_mix_item(mixed, streams, pre, item, items, n, vector)
                store_channels(
                    layer_input, raw, mixed, t64 * layer_input_token_stride, column, item, hidden_vectors, vector
                )
            for o in T.unroll(n):
                for item in T.unroll(items):
                    column = (block * items + item) * threads + tx
                    post_mix_item(mixed, streams, y, post, weights, o, item, items, n, vector)
                    store_channels(
                        out,
                        raw,
                        mixed,
                        t64 * out_token_stride + o * out_stream_stride,
                        column,
                        item,
                        hidden_vectors,
                        vector,
                    )

    return kernel


# The fused replay reads each layer's tensors through a device table of their addresses (the lists'
# tensors are separate allocations, and a kernel's parameter list is fixed), written per call by
# ``address_row_kernel``: TABLE_WORDS int64 per layer, in this order.
TABLE_WORDS = 6
PRE, LAYER_OUTPUT, POST, COMB, LAYER_INPUT, RESIDUAL = range(TABLE_WORDS)


@jit()
def replay_layers_kernel(
    n: int, vector: int, layers: int, posts: int, items: int = STREAM_ITEMS, threads: int = STREAM_THREADS
):
    """Every replayed layer of ``mhc_multilayer_recompute`` in one pass over ``X_0``: per token and
    block of ``threads·items`` channel vectors, the n streams stay in registers (bf16, as the unfused
    path stores them) from one layer to the next; each layer reads its coefficients and ``y_l`` and
    writes ``layer_input_l`` and ``X_{l+1}`` with ``apply_post_kernel``'s arithmetic (the same macros,
    so the same bits). Every tensor is contiguous; ``table`` holds each layer's addresses
    (``TABLE_WORDS`` per layer, ``PRE`` ... ``RESIDUAL``)."""
    residual_span = T.dynamic("residual_span")

    @T.prim_func
    def kernel(
        initial: T.Tensor((residual_span,), "bfloat16"),
        table: T.Tensor((layers * TABLE_WORDS,), "int64"),
        num_tokens: T.int32,
        hidden_vectors: T.int32,
    ):
        with T.Kernel(num_tokens, T.ceildiv(hidden_vectors, threads * items), threads=threads) as (token, block):
            tx = T.get_thread_binding()
            raw = T.alloc_local((vector,), "bfloat16")
            y = T.alloc_local((items * vector,), "bfloat16")
            streams = T.alloc_local((n * items * vector,), "bfloat16")
            next_streams = T.alloc_local((n * items * vector,), "bfloat16")
            mixed = T.alloc_local((items * vector,), "float32")
            pre = T.alloc_local((n,), "float32")
            post = T.alloc_local((n,), "float32")
            weights = T.alloc_local((n * n,), "float32")
            t64 = T.cast(token, "int64")
            row_vectors = T.cast(hidden_vectors, "int64")
            tokens64 = T.cast(num_tokens, "int64")
            for item in T.unroll(items):
                column = (block * items + item) * threads + tx
                load_streams(
                    initial,
                    streams,
                    t64 * n * row_vectors,
                    row_vectors,
                    1,
                    column,
                    item,
                    items,
                    hidden_vectors,
                    n,
                    vector,
                )
            for layer in T.unroll(layers):
                entry = layer * TABLE_WORDS
                pre_mix = T.make_tensor_from_addr(table[entry + PRE], (tokens64 * n,), "float32")
                layer_input = T.make_tensor_from_addr(
                    table[entry + LAYER_INPUT], (tokens64 * row_vectors * vector,), "bfloat16"
                )
                for o in T.unroll(n):
                    pre[o] = pre_mix[t64 * n + o]
                for item in T.unroll(items):
                    column = (block * items + item) * threads + tx
                    pre_mix_item(mixed, streams, pre, item, items, n, vector)
                    store_channels(layer_input, raw, mixed, t64 * row_vectors, column, item, hidden_vectors, vector)
                if layer < posts:
                    x = T.make_tensor_from_addr(
                        table[entry + LAYER_OUTPUT], (tokens64 * row_vectors * vector,), "bfloat16"
                    )
                    post_mix = T.make_tensor_from_addr(table[entry + POST], (tokens64 * n,), "float32")
                    comb = T.make_tensor_from_addr(table[entry + COMB], (tokens64 * n * n,), "float32")
                    out = T.make_tensor_from_addr(
                        table[entry + RESIDUAL], (tokens64 * n * row_vectors * vector,), "bfloat16"
                    )
                    for o in T.unroll(n):
                        post[o] = post_mix[t64 * n + o]
                        for i in T.unroll(n):
                            weights[i * n + o] = comb[(t64 * n + i) * n + o]
                    for item in T.unroll(items):
                        column = (block * items + item) * threads + tx
                        load_channels(x, y, t64 * row_vectors, column, 1, item, hidden_vectors, vector)
                    for o in T.unroll(n):
                        for item in T.unroll(items):
                            column = (block * items + item) * threads + tx
                            post_mix_item(mixed, streams, y, post, weights, o, item, items, n, vector)
                            store_channels(
                                out, raw, mixed, (t64 * n + o) * row_vectors, column, item, hidden_vectors, vector
                            )
                            for e in T.unroll(vector):
                                next_streams[(o * items + item) * vector + e] = T.cast(
                                    mixed[item * vector + e], "bfloat16"
                                )
                    for k in T.unroll(n * items * vector):
                        streams[k] = next_streams[k]

    return kernel


def _writable(buffer: torch.Tensor) -> torch.Tensor:
    """The caller's buffer when its channels are contiguous (the kernels store rows), else a
    contiguous temporary that ``_write_back`` copies into it."""
    if buffer.numel() == 0 or buffer.stride(-1) == 1:
        return buffer
    return new_output(torch.empty(buffer.shape, dtype=buffer.dtype, device=buffer.device))


def _write_back(buffer: torch.Tensor, written: torch.Tensor) -> None:
    if written is not buffer:
        buffer.copy_(written)


def _output_strides(tensor: torch.Tensor, vector: int) -> list[int]:
    """Outer strides of an output whose channels are contiguous, in vectors."""
    return [stride // vector for stride in tensor.stride()[:-1]]


def _replay_layer(stream, pre, y, post, comb, layer_input, residual_out, n: int, hidden: int) -> None:
    """Layer input (and, with ``y``, the next residual) of one layer, into the given buffers."""
    tokens = stream.shape[0]
    input_target = _writable(layer_input)
    if y is None:
        vector = _stream_vector(hidden, stream, input_target)
        kernel = apply_mix_kernel(n, vector)
        if compiling_only():
            return
        kernel(
            flat_view(stream),
            flat_view(pre),
            flat_view(input_target),
            tokens,
            hidden // vector,
            *_channel_strides(stream, vector),
            *pre.stride(),
        )
        _write_back(layer_input, input_target)
        return
    residual_target = _writable(residual_out)
    vector = _stream_vector(hidden, stream, y, input_target, residual_target)
    kernel = apply_post_kernel(n, vector)
    if compiling_only():
        return
    kernel(
        flat_view(stream),
        flat_view(pre),
        flat_view(y),
        flat_view(post),
        flat_view(comb),
        flat_view(input_target),
        flat_view(residual_target),
        tokens,
        hidden // vector,
        *_channel_strides(stream, vector),
        *pre.stride(),
        *_channel_strides(y, vector),
        *post.stride(),
        *comb.stride(),
        *_output_strides(input_target, vector),
        *_output_strides(residual_target, vector),
    )
    _write_back(layer_input, input_target)
    _write_back(residual_out, residual_target)


def mhc_multilayer_recompute(
    initial_residual: torch.Tensor,
    pre_mix_list: list[torch.Tensor],
    layer_output_list: list[torch.Tensor],
    post_mix_list: list[torch.Tensor],
    comb_mix_list: list[torch.Tensor],
    layer_input_list: list[torch.Tensor],
    residual_list: list[torch.Tensor],
) -> None:
    """Recompute the layer inputs and residuals of L consecutive layers from ``X_0`` into the given
    buffers (see the reference); bit-identical to ``mhc_pre_apply_mix`` / ``mhc_post`` layer by layer."""
    pre_mixes, layer_outputs, post_mixes, comb_mixes, layer_inputs, residuals = check_multilayer_inputs(
        initial_residual, pre_mix_list, layer_output_list, post_mix_list, comb_mix_list, layer_input_list, residual_list
    )
    tokens, n, hidden = initial_residual.shape
    num_layers, num_post = len(pre_mixes), len(layer_outputs)
    require_cuda("initial_residual", initial_residual)
    for name, tensors in (
        ("pre_mix_list", pre_mixes),
        ("layer_output_list", layer_outputs),
        ("post_mix_list", post_mixes),
        ("comb_mix_list", comb_mixes),
        ("layer_input_list", layer_inputs),
        ("residual_list", residuals),
    ):
        for index, tensor in enumerate(tensors):
            require_cuda(f"{name}[{index}]", tensor)
    if tokens == 0 or hidden == 0:
        return
    if n == 0:  # no streams: every layer input is the empty sum, and the residuals have no elements
        for buffer in layer_inputs:
            buffer.zero_()
        return

    if _replay_fused(initial_residual, pre_mixes, layer_outputs, post_mixes, comb_mixes, layer_inputs, residuals):
        return
    stream = initial_residual  # X_l: the bf16 buffer the previous layer wrote, as the unfused path stores it
    for layer in range(num_layers):
        if layer < num_post:
            _replay_layer(
                stream,
                pre_mixes[layer],
                layer_outputs[layer],
                post_mixes[layer],
                comb_mixes[layer],
                layer_inputs[layer],
                residuals[layer],
                n,
                hidden,
            )
            stream = residuals[layer]
        else:
            _replay_layer(stream, pre_mixes[layer], None, None, None, layer_inputs[layer], None, n, hidden)


@jit()
def address_row_kernel():
    """``table[first + w] = address_w`` for the ``TABLE_WORDS`` addresses of one layer: the table is
    written on the stream, in order with the replay that reads it (and inside a CUDA graph's capture
    too, where the addresses become the graph's kernel parameters)."""
    words = T.dynamic("words")

    @T.prim_func
    def kernel(
        table: T.Tensor((words,), "int64"),
        first: T.int32,
        pre: T.int64,
        layer_output: T.int64,
        post: T.int64,
        comb: T.int64,
        layer_input: T.int64,
        residual: T.int64,
    ):
        with T.Kernel(1, threads=32) as (_,):
            if T.get_thread_binding() == 0:
                table[first + PRE] = pre
                table[first + LAYER_OUTPUT] = layer_output
                table[first + POST] = post
                table[first + COMB] = comb
                table[first + LAYER_INPUT] = layer_input
                table[first + RESIDUAL] = residual

    return kernel


def replay_schedule(hidden_vectors: int) -> tuple[int, int]:
    """``(items, threads)`` of ``replay_layers_kernel`` for a row of ``hidden_vectors`` 16-byte vectors:
    CTAs that tile the row exactly (an idle lane still holds its share of the layers' registers).
    Rows of a multiple of 128 vectors: 64 threads of 2; others: one vector per thread over the largest
    multiple of 32 threads up to 256 that divides the row; else the streaming kernels' 128 of 2. H200
    sweep, T 8192, 4 layers, kernel time against 128 × 2: C 7168 757 µs against 796, C 4096 440
    against 441, C 1280 (160 threads) 141 against 172, C 2560 (2 × 160) 279 against 352. Same bits:
    the arithmetic per element does not depend on the CTA shape."""
    if hidden_vectors % 128 == 0:
        return 2, 64
    for threads in range(256, 31, -32):
        if hidden_vectors % threads == 0:
            return 1, threads
    return STREAM_ITEMS, STREAM_THREADS


def _replay_fused(initial_residual, pre_mixes, layer_outputs, post_mixes, comb_mixes, layer_inputs, residuals) -> bool:
    """All layers in one kernel when every tensor is contiguous with 16-byte channel vectors (the layout
    a model's buffers have); False (nothing launched) otherwise, for the layer-by-layer kernels."""
    tokens, n, hidden = initial_residual.shape
    per_layer = [*pre_mixes, *layer_outputs, *post_mixes, *comb_mixes, *layer_inputs, *residuals]
    if not all(t.is_contiguous() for t in (initial_residual, *per_layer)):
        return False
    if _stream_vector(hidden, initial_residual, *layer_outputs, *layer_inputs, *residuals) != 8:
        return False
    num_layers, num_post = len(pre_mixes), len(layer_outputs)
    kernel = replay_layers_kernel(n, 8, num_layers, num_post, *replay_schedule(hidden // 8))
    writer = address_row_kernel()
    if compiling_only():
        return True
    # Scratch, written on the stream before the replay reads it: a fresh table per call (no cache to
    # keep in step with the caller's buffers, and nothing for a capture to bake from host memory).
    table = torch.empty((num_layers * TABLE_WORDS,), dtype=torch.int64, device=initial_residual.device)
    for layer in range(num_layers):
        posted = layer < num_post
        writer(
            table,
            layer * TABLE_WORDS,
            address(pre_mixes[layer]),
            address(layer_outputs[layer]) if posted else 0,
            address(post_mixes[layer]) if posted else 0,
            address(comb_mixes[layer]) if posted else 0,
            address(layer_inputs[layer]),
            address(residuals[layer]) if posted else 0,
        )
    kernel(flat_view(initial_residual), table, tokens, hidden // 8)
    return True


# ---------------------------------------------------------------------------------------------
# Big fuse (inference)
# ---------------------------------------------------------------------------------------------


def mhc_pre_big_fuse(
    residual: torch.Tensor,
    fn: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    rms_eps: float,
    mhc_pre_eps: float,
    mhc_sinkhorn_eps: float,
    mhc_post_mult_value: float,
    sinkhorn_repeat: int,
    n_splits: int = 16,
    *,
    mhc_norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inference ``mhc_pre``: ``(post_mix fp32 [T, n], comb_mix fp32 [T, n, n], layer_input bf16 [T, C])``,
    the optimized norm-fn (norm weight folded), split, Sinkhorn and pre-apply run one by one."""
    from .mhc_norm import mhc_pre_norm_fn  # the norm-fn GEMM's module; imported here so this one loads alone

    n, rms_eps, pre_eps, sinkhorn_eps, post_mult, repeat = check_big_fuse_inputs(
        residual,
        fn,
        mhc_scale,
        mhc_base,
        mhc_norm_weight,
        rms_eps,
        mhc_pre_eps,
        mhc_sinkhorn_eps,
        mhc_post_mult_value,
        sinkhorn_repeat,
        n_splits,
    )

    mixes = mhc_pre_norm_fn(residual, fn, mhc_norm_weight, rms_eps)
    # n is residual's size (a SymInt under dynamic shapes); the split takes it as a plain int argument.
    pre_mix, post_mix, comb_logits = mhc_pre_split_mixes(mixes, mhc_scale, mhc_base, int(n), post_mult, pre_eps)
    comb_mix = sinkhorn_normalize(comb_logits, repeat=repeat, eps=sinkhorn_eps)
    layer_input = mhc_pre_apply_mix(residual, pre_mix)
    return post_mix, comb_mix, layer_input

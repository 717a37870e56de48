"""All decoder layers of a q4_1 target in one C call (kernels/layers.c), for decode and verify rows.

A target in the `q4_1` format runs its linears through the Q4_1 kernel and the rest of each layer
through kernels/decode_ops.c; what is left between those calls is Python (module calls, tensor
allocations, ctypes argument conversion), about 70 us a layer, 2 ms of a 6.5 ms one-row forward of
the embedded model. `LayerStack.run` does the same calls from C, layer after layer, with the same
inputs in the same order: the same bits as the module-by-module forward (tests/test_layer_stack.py).

It applies where every piece has its C kernel: bf16 activations on the CPU, every decoder linear a
Q41Linear run by its kernel at these row counts, no q/k norms or attention biases (Llama's layer, not
Qwen3's), at most STACK_ROWS rows per request (more: consecutive calls). Everything else (other
formats, Qwen3, prefills past the dense copies' row count) keeps the module forward.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import decode_ops, native, q4_1_kernel
from .decode_ops import int64s, pointers

SOURCE = Path(__file__).parent / "kernels" / "layers.c"
WEIGHTS_PER_LAYER = 14   # kernels/layers.c's enum: norm, qkv (qw, dw, mw), o, norm, gate_up, down
# rows of one request per call; longer inputs go through as consecutive calls of this many
# (TargetModel._forward_in_chunks). Each call reads every weight once, so fewer, longer calls cost
# less: an agent turn's new tokens (tens of rows) after 1,024 cached positions, Xeon with AMX, 2
# threads, 64 against 16 (MAX_ATTENTION_ROWS, the module path's limit): 20 rows 21.8 -> 18.4 ms,
# 32 rows 29.5 -> 24.7, 64 rows 57.5 -> 43.5; with the AVX2 kernels forced the same within 2 %
# (the arithmetic, not the weights' reads, bounds them there).
STACK_ROWS = 64


def bind(lib: ctypes.CDLL, kernels: ctypes.CDLL, ops: ctypes.CDLL) -> None:
    """Point the layer stack `lib` at the Q4_1 matmul of `kernels` and the decode ops of `ops`
    (kernels/layers.c calls them through these pointers)."""
    address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value   # noqa: E731
    lib.layers_use(address(kernels.q4_1_matmul), address(ops.rms_norm_bf16), address(ops.silu_mul_bf16),
                   address(ops.attend_rows_bf16), address(ops.attend_segments_bf16), address(ops.rope_append_bf16))


@functools.cache
def _library() -> ctypes.CDLL | None:
    kernels, ops = q4_1_kernel._library(), decode_ops._library()
    lib = native.build(SOURCE) if kernels is not None and ops is not None else None
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.layers_use.argtypes = [p, p, p, p, p, p]
    lib.layers_use.restype = None
    bind(lib, kernels, ops)
    lib.layers_bf16.argtypes = [p, i64, i64, i64, i64, i64, i64, ctypes.c_float, p, i64, p, p, i64,
                                p, p, p, p, p, p, p, p, i64, p]
    lib.layers_bf16.restype = ctypes.c_int
    lib.draft_layer_bf16.argtypes = [p, i64, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, p, i64, p, p, i64,
                                     p, p, p, p, p]
    lib.draft_layer_bf16.restype = ctypes.c_int
    lib.eagle_chain_bf16.argtypes = [p, p, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int, ctypes.c_int, p,
                                     i64, i64, p, i64, p, i64, p, p, i64, i64, p, p, i64, p]
    lib.eagle_chain_bf16.restype = ctypes.c_int
    lib.eagle_catch_up_bf16.argtypes = [p, p, i64, i64, i64, ctypes.c_float, p, i64, i64, p, p, p, p, i64, i64, p, p,
                                        i64]
    lib.eagle_catch_up_bf16.restype = ctypes.c_int
    return lib


def _segment_args(segments: list[tuple[int, int, object]]) -> tuple:
    """kernels/layers.c's per-segment arguments for segments (rows, start, KVCache): their count,
    rows, starts, cache capacities and K / V cache addresses."""
    caches = [c for _, _, c in segments]
    if any(not (c.k.is_contiguous() and c.v.is_contiguous()) for c in caches):
        raise ValueError("the layer stack needs contiguous KV caches")
    return (len(segments), int64s([r for r, _, _ in segments]), int64s([st for _, st, _ in segments]),
            int64s([c.capacity for c in caches]), pointers([c.k.data_ptr() for c in caches]),
            pointers([c.v.data_ptr() for c in caches]))


def shared_prefixes(segments: list[tuple[int, int, object]]) -> tuple[list[int], list[int]] | None:
    """Which segments (rows, start, KVCache) begin with the same K/V bits, for kernels/decode_ops.c's
    attend_segments_bf16: caches of one `KVCache.lineage` (copied from one prefix-cache entry) agree
    below both lineage_lens. Per segment: its lead (the first segment of its lineage) and how many
    keys it shares with it, in whole attention chunks before either's new rows (a lead: the most
    any of its followers shares). None when no two segments share a chunk."""
    chunk = decode_ops.ATTENTION_CHUNK
    lead, shared, first = [], [], {}
    for s, (_, start, cache) in enumerate(segments):
        head = first.setdefault(id(cache.lineage), s)
        lead.append(head)
        shared.append(0)
        if head != s:
            _, head_start, head_cache = segments[head]
            n = min(cache.lineage_len, head_cache.lineage_len, start, head_start) // chunk * chunk
            shared[s] = n
            shared[head] = max(shared[head], n)
    return (lead, shared) if any(shared) else None


def _sharing_args(segments: list[tuple[int, int, object]]) -> tuple:
    """layers_bf16's lead and shared arrays (NULL, NULL where no segments share a prefix)."""
    sharing = shared_prefixes(segments) if len(segments) > 1 else None
    return (None, None) if sharing is None else (int64s(sharing[0]), int64s(sharing[1]))


class LayerStack:
    """The decoder layers of one target, ready for kernels/layers.c: their weights' addresses in
    the C file's order, and the tensors behind them kept alive."""

    def __init__(self, model, max_rows: int, max_total_rows: int):
        cfg = model.cfg
        self.model_id = id(model)
        self.cfg = cfg
        self.tensors: list[torch.Tensor] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.tensors += [layer.input_layernorm.weight, *_blocks(attn.qkv_proj), *_blocks(attn.o_proj),
                             layer.post_attention_layernorm.weight, *_blocks(mlp.gate_up_proj), *_blocks(mlp.down_proj)]
        self.weights = pointers([t.data_ptr() for t in self.tensors])
        self.max_rows, self.max_total_rows = max_rows, max_total_rows
        self.first_norm = model.layers[0].input_layernorm.weight.data_ptr()

    @classmethod
    def build(cls, model) -> "LayerStack | None":
        """The stack of `model`, or None where kernels/layers.c does not apply (see the module
        docstring) or could not be built here."""
        from .quant import Q41Linear

        cfg = model.cfg
        if (not len(model.layers) or model.dtype != torch.bfloat16 or model.device.type != "cpu" or cfg.qk_norm or cfg.attention_bias
                or cfg.hidden_size % 16 or cfg.intermediate_size % 16 or cfg.head_dim % 16 or cfg.head_dim > 256):
            return None
        for layer in model.layers:
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if not all(isinstance(m, Q41Linear) for m in linears) or any(w.dtype != torch.bfloat16 for w in norms):
                return None
        if _library() is None:
            return None
        # per request at most STACK_ROWS, and fewer than any linear's dense_from_rows in all (from
        # there the module forward multiplies by the dense copy instead of the kernel)
        dense_from = min(m.dense_from_rows for m in model.modules() if isinstance(m, Q41Linear))
        return cls(model, min(STACK_ROWS, dense_from - 1), dense_from - 1)

    def current(self, model) -> bool:
        """Still the weights of `model` (not converted since)?"""
        return self.model_id == id(model) and model.layers[0].input_layernorm.weight.data_ptr() == self.first_norm

    def takes(self, x: torch.Tensor, rows: list[int]) -> bool:
        """Does one call take x's rows, `rows` a request (segment)?"""
        return self.takes_activations(x.dtype, x.device) and max(rows) <= self.max_rows and sum(rows) <= self.max_total_rows

    def takes_in_chunks(self, dtype: torch.dtype, device: torch.device, rows: int) -> bool:
        """Too many rows for one call, but fewer than where the linears switch to their dense copies:
        the rows of one request as consecutive calls of max_rows each (TargetModel._forward_in_chunks)."""
        return self.takes_activations(dtype, device) and self.max_rows < rows <= self.max_total_rows

    @staticmethod
    def takes_activations(dtype: torch.dtype, device: torch.device) -> bool:
        return dtype == torch.bfloat16 and device.type == "cpu"

    def __deepcopy__(self, memo):   # a copied model has other tensors: it runs its modules
        return None

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[tuple[int, int, object]],
            taps: tuple[int, ...]) -> torch.Tensor | None:
        """The decoder layers over x [T, hidden] bf16 (the embeddings; updated in place to the
        last layer's output): segments (rows, start, KVCache) in row order, cos / sin [T, hd] of
        the rows' positions. Returns the taps [T, n_taps, hidden] with every layer's tap filled
        (a final-norm tap, index num_layers, is left for the caller), or None without taps."""
        cfg = self.cfg
        T = x.shape[0]
        tap_tensor = torch.empty(T, len(taps), cfg.hidden_size, dtype=x.dtype) if taps else None
        cos, sin = cos.contiguous(), sin.contiguous()
        status = _library().layers_bf16(
            self.weights, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, x.data_ptr(), T, cos.data_ptr(), sin.data_ptr(),
            *_segment_args(segments), *_sharing_args(segments), int64s(list(taps)), len(taps),
            None if tap_tensor is None else tap_tensor.data_ptr())
        if status != 0:
            raise MemoryError(f"the layer stack could not allocate scratch for {T} rows")
        return tap_tensor


def _blocks(linear: Q41Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return linear.qw, linear.dw, linear.mw


class DraftLayer:
    """An EAGLE-3 drafter layer ready for kernels/layers.c's `draft_layer_bf16`: its stacked Q4_1
    q/k/v and gate/up (the attention input is given: [norm(embedding), norm(hidden)] for the first
    layer), for the one-row-per-request chain steps (`Eagle3Layer.forward_rows`)."""

    def __init__(self, layer, index: int, qkv, gate_up):
        attn = layer.self_attn
        self.index, self.nh, self.nkv, self.hd = index, attn.nh, attn.nkv, attn.hd
        self.in_dim = qkv.in_features
        self.hidden, self.intermediate = attn.o_proj.out_features, layer.mlp.down_proj.in_features
        self.eps = layer.post_attention_layernorm.eps
        # INPUT_NORM is not read by draft_layer_bf16: the post-attention norm's weight stands in
        self.tensors = [layer.post_attention_layernorm.weight, *_blocks(qkv), *_blocks(attn.o_proj),
                        layer.post_attention_layernorm.weight, *_blocks(gate_up), *_blocks(layer.mlp.down_proj)]
        self.weights = pointers([t.data_ptr() for t in self.tensors])

    @classmethod
    def build(cls, layer, index: int) -> "DraftLayer | None":
        """`layer`'s C form where every piece has its kernel (bf16 norms, Q4_1 linears), else None."""
        from .quant import Q41Linear

        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = attn.qkv(), mlp.gate_up()
        linears = (qkv, attn.o_proj, gate_up, mlp.down_proj)
        if (not all(isinstance(m, Q41Linear) for m in linears) or layer.post_attention_layernorm.weight.dtype != torch.bfloat16
                or attn.hd % 16 or attn.hd > 256 or mlp.down_proj.in_features % 16 or _library() is None):
            return None
        return cls(layer, index, qkv, gate_up)

    def __deepcopy__(self, memo):   # a copied drafter has other tensors: it runs its modules
        return None

    def run(self, attn_in: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            segments: list[tuple[int, int, object]]) -> torch.Tensor:
        """The layer over attn_in [T, in_dim] with residual [T, hidden] (both bf16): the output
        stream [T, hidden] (a new tensor); segments (rows, start, KVCache) as LayerStack.run's."""
        x = residual.contiguous().clone()
        attn_in, cos, sin = attn_in.contiguous(), cos.contiguous(), sin.contiguous()
        status = _library().draft_layer_bf16(
            self.weights, self.index, attn_in.data_ptr(), self.in_dim, self.hidden, self.intermediate, self.nh,
            self.nkv, self.hd, self.eps, x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(),
            *_segment_args(segments))
        if status != 0:
            raise MemoryError(f"the drafter layer could not allocate scratch for {x.shape[0]} rows")
        return x


class EagleChain:
    """An EAGLE-3 drafter's greedy chain for one request in one call (kernels/layers.c's
    `eagle_chain_bf16`): the fused feature, the first step, every head and argmax and every chain
    step, with the very kernels the module path calls in the same order (the same bits,
    tests/test_layer_stack.py), where Python between them cost ~0.3 ms a step; and its KV-only
    catch-up on verified pairs (`eagle_catch_up_bf16`), likewise. It applies to a
    one-layer drafter whose layer runs in C (DraftLayer), with Q4_1 fc and head, bf16 norms in C
    (one eps) and no norm before fc; otherwise the drafter keeps its module path."""

    def __init__(self, drafter, layer: DraftLayer):
        fc_norms = list(drafter.fc_norm) if drafter.fc_norm is not None else []
        first = drafter.layers[0]
        self.layer, self.eps = layer, drafter.cfg.rms_norm_eps
        self.norm_output, self.norm_before_residual = drafter.cfg.norm_output, first.norm_before_residual
        self.n_taps, self.tap_width = len(drafter.tap_layers), drafter.cfg.tap_width
        self.tensors = [*_blocks(drafter.fc), first.input_layernorm.weight, first.hidden_norm.weight,
                        drafter.norm.weight, *_blocks(drafter.lm_head), *(n.weight for n in fc_norms)]
        addresses = [t.data_ptr() for t in self.tensors]
        self.weights = pointers(addresses if fc_norms else addresses + [0] * self.n_taps)
        self.embed = drafter.embed_tokens.weight
        self.d2t = drafter.d2t
        self.vocab = drafter.lm_head.out_features
        attn = first.self_attn
        self.kv = [*_blocks(attn.k_proj), *_blocks(attn.v_proj)]
        self.kv_weights = pointers([t.data_ptr() for t in self.kv])
        # catch-ups of fewer rows than this take the C call; longer ones (a prompt) keep the module
        # path, whose linears multiply by their dense copies from there
        self.catch_up_rows = min(m.dense_from_rows for m in (drafter.fc, attn.k_proj, attn.v_proj))

    @classmethod
    def build(cls, drafter) -> "EagleChain | None":
        """`drafter`'s chain in C where every piece has its kernel, else None."""
        from .quant import Q41Linear

        if len(drafter.layers) != 1 or drafter.input_norm is not None:
            return None
        layer = drafter.layers[0].native_layer(0)
        norms = [drafter.norm, drafter.layers[0].input_layernorm, drafter.layers[0].hidden_norm,
                 *(drafter.fc_norm or [])]
        attn = drafter.layers[0].self_attn
        if (layer is None or not all(isinstance(m, Q41Linear)
                                     for m in (drafter.fc, drafter.lm_head, attn.k_proj, attn.v_proj))
                or not all(n.native_ops and n.weight.dtype == torch.bfloat16 and n.eps == drafter.cfg.rms_norm_eps
                           for n in norms)
                or drafter.embed_tokens.weight.dtype != torch.bfloat16 or not drafter.embed_tokens.weight.is_contiguous()
                or drafter.cfg.tap_width % 16 or drafter.cfg.hidden_size % 16):
            return None
        return cls(drafter, layer)

    def __deepcopy__(self, memo):   # a copied drafter has other tensors: it drafts step by step
        return None

    def run(self, taps: torch.Tensor, pending: int, cos: torch.Tensor, sin: torch.Tensor, start: int,
            cache, k: int) -> torch.Tensor:
        """The k draft tokens (target ids, [k] long) of the chain seeded by the newest verified
        pair: taps [n_taps, tap_width] bf16 at position `start`, the pending token; cos, sin [k, hd]
        of positions start..start + k - 1; `cache` the drafter's KVCache, holding those positions."""
        L = self.layer
        taps, cos, sin = taps.contiguous(), cos.contiguous(), sin.contiguous()
        tokens = torch.empty(k, dtype=torch.long)
        status = _library().eagle_chain_bf16(
            L.weights, self.weights, L.hidden, L.intermediate, L.nh, L.nkv, L.hd, self.eps, int(self.norm_output),
            int(self.norm_before_residual), taps.data_ptr(), self.n_taps, self.tap_width, self.embed.data_ptr(),
            pending, self.d2t.data_ptr(), self.vocab, cos.data_ptr(), sin.data_ptr(), start, cache.capacity,
            cache.k.data_ptr(), cache.v.data_ptr(), k, tokens.data_ptr())
        if status != 0:
            raise MemoryError(f"the EAGLE-3 chain could not allocate scratch for {k} steps")
        return tokens

    def catch_up(self, taps: torch.Tensor, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                 cache) -> None:
        """Eagle3Drafter.catch_up's KV-only rows in one call (kernels/layers.c's `eagle_catch_up_bf16`,
        the module path's bits): taps [T, n_taps, tap_width] bf16 and tokens [T] of the verified
        pairs at positions start..start + T - 1, cos, sin [T, hd] theirs; `cache` holds them."""
        L = self.layer
        T = taps.shape[0]
        taps, cos, sin = taps.contiguous(), cos.contiguous(), sin.contiguous()
        tokens = tokens.to(torch.long).contiguous()
        status = _library().eagle_catch_up_bf16(
            self.weights, self.kv_weights, L.hidden, L.nkv, L.hd, self.eps, taps.data_ptr(), self.n_taps,
            self.tap_width, self.embed.data_ptr(), tokens.data_ptr(), cos.data_ptr(), sin.data_ptr(), start,
            cache.capacity, cache.k.data_ptr(), cache.v.data_ptr(), T)
        if status != 0:
            raise MemoryError(f"the EAGLE-3 catch-up could not allocate scratch for {T} rows")

"""The text decoder's small operators as single C++ calls on float32 CPU tensors.

A decode step on the CPU is a few hundred small operators, each paying torch's dispatch; three of
them are worth one call each (``torchgemma::rms_norm``, ``rope``, ``decode_attention``):

* RMSNorm -> ``FusedRMSNorm``: a dozen operators fewer per norm (109 norms per token on Gemma 3
  270M); the reference norm's result to a float32 rounding, not its bits;
* ``apply_rope`` -> ``fused_rope``: four operators fewer per rotation, the same bits;
* GatedMLP's ``gelu_tanh(gate) * up`` -> ``FusedGatedMLP``: one pass (``torchgemma::gelu_mul``)
  where ATen's GELU (2.5 ns a value on AVX-512) and mul make two; the function to a few float32
  roundings, not ATen's bits;
* sdpa attention -> ``decode_attention``, one C++ call in which each query attends as a decode
  step's one new token does, over the keys it sees (the exact softmax's result to a float32
  rounding; long contexts split over the threads in pieces of 1024 keys): a decode step's rows, and
  a prompt's queries, which so skip the keys their mask hides (sdpa computes them all).

And a decoder layer's one-token step (``FusedDecoderLayer``) calls its parts' forwards without
``nn.Module.__call__``, the same operators in the same order (the same bits); where its products are
quantized (float32 rows through the row kernel), everything before the attention and everything
after it are one C++ call each (``decode_layer_qkv``, ``decode_layer_output``), again the same
kernels in the same order.

``fuse_cpu_ops(model)`` applies them in place. Quantized models on the CPU get them when quantized
or loaded (``torchgemma.quantize``, ``load(..., quantize=...)``); any other model on request.
Anything else (other dtypes, other devices, C++ kernels unavailable) takes the reference's
operators, and the towers keep theirs.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..cache import RingKeys
from ..kernels import ensure_kernels, isa
from ..model.attention import ATTENTION, AttentionInputs, sdpa_backend
from ..model.layers import GatedMLP, RMSNorm, apply_rope, gelu_tanh
from ..model.text import Attention, DecoderLayer


class FusedRMSNorm(RMSNorm):
    """RMSNorm as one C++ call (``torchgemma::rms_norm``) on float32 CPU inputs: the reference's
    result to a float32 rounding rather than its bits, for a dozen fewer small operators per norm
    (109 norms per token on Gemma 3 270M: ~1.3 ms of a 28 ms decode step). Anything else (other
    dtypes, devices, no C++ kernels) takes RMSNorm's own forward."""

    @classmethod
    def replacing(cls, norm: RMSNorm) -> FusedRMSNorm:
        """A fused norm in place of ``norm``, holding its very weight (the state dict is the same)."""
        fused = cls(0, norm.eps, with_scale=norm.with_scale, plus_one=norm.plus_one)
        if norm.with_scale:
            fused.weight = norm.weight  # replaces the empty weight made above
        return fused.train(norm.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (Attributes read directly: this runs ~110 times per decoded token.)
        if x.dtype is not torch.float32 or not x.is_cpu or not ensure_kernels():
            return super().forward(x)
        weight = self._parameters.get("weight")
        if weight is not None and weight.requires_grad and torch.is_grad_enabled():
            weight = weight.detach()  # the op has no backward: it never sees a tensor that asks for one
        return _RMS_NORM(x, weight, self.eps, self.plus_one)


_RMS_NORM = torch.ops.torchgemma.rms_norm.default


def fused_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` as one C++ call on float32 CPU tensors, to the bit (four operators fewer per
    rotation, two rotations per layer); anything else takes ``apply_rope`` itself."""
    if (
        x.dtype is torch.float32
        and cos.dtype is torch.float32
        and x.device.type == "cpu"
        and x.dim() == 4
        and cos.shape == (x.shape[0], x.shape[1], x.shape[3])
        and ensure_kernels()
    ):
        return _ROPE(x, cos, sin)
    return apply_rope(x, cos, sin)


_ROPE = torch.ops.torchgemma.rope.default


class FusedGatedMLP(GatedMLP):
    """GatedMLP whose ``gelu_tanh(gate) * up`` is one C++ call (``torchgemma::gelu_mul``) on float32
    CPU tensors: gate / (1 + e^(-2u)), the same function as ATen's tanh form to a few float32
    roundings, not its bits (more precise where 1 + tanh(u) cancels). 125 x 2048 values, one
    thread, Zen 4: 174 us against 464 for ATen's GELU and mul. Anything else (other dtypes or
    devices, gradients, no C++ kernels) takes GatedMLP's operators."""

    @classmethod
    def adopting(cls, mlp: GatedMLP) -> FusedGatedMLP:
        """``mlp`` itself, now of this class (its parts, weights and state dict untouched)."""
        mlp.__class__ = cls
        return mlp

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up``: the C++ call where it applies, else GatedMLP's operators."""
        if (
            gate.dtype is torch.float32
            and up.dtype is torch.float32
            and gate.is_cpu
            and up.is_cpu
            and not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad))
            and ensure_kernels()
        ):
            return _GELU_MUL(gate, up)
        return super().activate(gate, up)


_GELU_MUL = torch.ops.torchgemma.gelu_mul.default


def sdpa_with_decode_kernel(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, inputs: AttentionInputs, scale: float
) -> torch.Tensor:
    """``sdpa_backend``, except on float32 CPU tensors, where each query attends as a decode step's
    one new token does: one C++ call (``torchgemma::decode_attention``: the exact softmax's result
    to a float32 rounding). A decode step's rows so skip sdpa's thread pool wake-up for a few
    microseconds of work, or its row-by-row calls where the rows' key ranges differ; a prompt's
    queries (``_prompt_attention``) skip the keys their mask hides, where sdpa's CPU kernels compute
    every query against every key it is given. The keys a query sees are the mask's (True-to-attend),
    the causal ones, or all of them; a query gets the same bits in a batch as alone (its visible keys,
    in order), and a prompt's token the bits of its decode step."""
    mask = inputs.mask
    rings = isinstance(key, RingKeys)
    buffer = key.buffer if rings else key
    if (
        query.shape[2] == 1
        and query.dtype is torch.float32
        and buffer.dtype is torch.float32
        and query.device.type == "cpu"
        and (mask is None or (mask.dtype is torch.bool and mask.shape[1:3] == (1, 1)))
        and (mask is not None or inputs.rows is None)
        and ensure_kernels()
    ):
        if rings:
            # A decode step's sliding keys read where they lie in the ring (the same keys in the same
            # order as gathered: the same bits).
            first, end = 0, key.length
            if inputs.key_slice is not None:
                first, end, _ = inputs.key_slice.indices(key.length)
            visible = None if mask is None else mask[:, 0, 0]
            # Keys before position 0 that a ring as long as the cache does not hold: never visible.
            skip = max(0, key.unheld - first)
            if skip:
                first += skip
                visible = None if visible is None else visible[:, skip:]
            b, s = query.shape[0], end - first
            visible = _all_visible(b, s) if visible is None else visible.expand(b, s)
            offsets = key.offsets + first if first else key.offsets
            return _DECODE_ATTENTION_RING(query, key.buffer, value.buffer, scale, visible, key.slots, offsets)
        if inputs.key_slice is not None:
            key, value = key[:, :, inputs.key_slice], value[:, :, inputs.key_slice]
        visible = None if mask is None else mask[:, 0, 0].expand(query.shape[0], key.shape[2])
        return _DECODE_ATTENTION(query, key, value, scale, visible)
    if rings:
        key, value = key.gather(), value.gather()
    if inputs.key_slice is not None:
        key, value = key[:, :, inputs.key_slice], value[:, :, inputs.key_slice]
        inputs = replace(inputs, key_slice=None)
    attended = _prompt_attention(query, key, value, inputs, scale)
    return sdpa_backend(query, key, value, inputs, scale) if attended is None else attended


# The most keys a prompt's queries are given for decode_attention to take them. Each query reads its
# keys and values on its own, where sdpa's kernel reads them once per block of queries: past the
# caches' reach that costs more than the masked keys skipped save. 256 queries over the causal tail
# of S keys (a full layer's chunk), one thread, Zen 4, kernel / sdpa: S = 1,023 14.3 / 14.1 ms,
# 2,303 33.0 / 32.3, 4,351 68.6 / 66.6, 8,447 263.9 / 136.0 (two threads: 107.1 / 65.1); with the
# kernel's later tuning (scores' odd tail, largest score, kept buffers) 14.0 / 16.3, 30.8 / 31.9,
# 74.0 / 73.4, 137.7 / 134.6: no gain past a few thousand keys either way. A sliding layer's chunk
# is given at most its window and the chunk (767 keys for Gemma 3's 512 and 256).
PROMPT_KEYS = 4096


def _prompt_attention(query, key, value, inputs: AttentionInputs, scale: float) -> torch.Tensor | None:
    """Several queries per row (a prompt's) through ``decode_attention``, each over the keys it sees:
    the mask's, or the causal ones, row by row where the rows' key ranges differ. None where the
    kernel's vector code does not apply (it would then run scalar loops: fewer than 4 query heads
    per KV head, head dims not a multiple of 8, a build without AVX2), where the queries are given
    more than ``PROMPT_KEYS`` keys, or where a query sees no key (sdpa's padding rows): sdpa then
    attends. Against sdpa on the CPU, which computes every query
    against every key it is given (Gemma 3 270M's shapes: 4 heads, 1 KV head, D 256; one thread, Zen
    4, medians of 15 interleaved calls, two runs): a 125-token prompt's causal layer 0.63-0.65 ms
    against 1.13-1.16; a 256-token chunk after 511 keys, 8.4-9.1 against 11.4-12.4 ms in a sliding
    layer (a band of 512 keys), 9.4-10.2 against 10.5-11.4 in a full one."""
    batch, heads, length, dim = query.shape
    mask = inputs.mask
    if (
        query.dtype is not torch.float32
        or key.dtype is not torch.float32
        or value.dtype is not torch.float32
        or query.device.type != "cpu"
        or heads % key.shape[1]
        or (heads // key.shape[1]) % 4
        or dim % 8
        or (mask is not None and mask.dtype is not torch.bool)
        or inputs.queries is not None
        or key.shape[2] > PROMPT_KEYS
        or not ensure_kernels()
        or isa() not in ("avx2", "avx512")
    ):
        return None
    keys = key.shape[2]
    if inputs.rows is None:
        if mask is not None:
            visible = mask[:, 0].expand(batch, length, keys)
        elif inputs.causal and length == keys:
            visible = _causal(length, keys).expand(batch, length, keys)
        else:
            visible = None  # every key
    else:
        visible = torch.zeros(batch, length, keys, dtype=torch.bool)
        for b, (start, end, alone) in enumerate(inputs.rows):
            visible[b, :, start:end] = _causal(length, end - start) if alone else mask[b, 0, :, start:end]
    # (Causal queries each see their first key; a mask's may see none.)
    if mask is not None and not bool(visible.any(-1).all()):
        return None
    return _DECODE_ATTENTION(query, key, value, scale, visible)


@functools.lru_cache(maxsize=64)
def _all_visible(rows: int, keys: int) -> torch.Tensor:
    """(rows, keys) True, made once per shape (the kernel only reads it): ~18 layers per step ask."""
    return torch.ones(rows, keys, dtype=torch.bool)


@functools.lru_cache(maxsize=16)
def _causal(queries: int, keys: int) -> torch.Tensor:
    """(queries, keys) True where key j <= query t (sdpa's is_causal: aligned at the first key)."""
    return torch.ones(queries, keys, dtype=torch.bool).tril()


sdpa_with_decode_kernel.reads_rings = True  # Attention hands it a decode step's sliding keys as RingKeys


_DECODE_ATTENTION = torch.ops.torchgemma.decode_attention.default
_DECODE_ATTENTION_RING = torch.ops.torchgemma.decode_attention_ring.default
# What a fused model's attention layers run for each backend name.
FUSED_ATTENTION = {**ATTENTION, "sdpa": sdpa_with_decode_kernel}


class FusedDecoderLayer(DecoderLayer):
    """A decoder layer whose one-token calls (decode steps) run DecoderLayer's, Attention's and
    GatedMLP's operators in their order, calling each part's forward directly: ``nn.Module.__call__``
    costs about a microsecond, and a decode step of Gemma 3 270M makes ~290 such calls for ~25 ms of
    kernels; quantized parts run as two C++ calls around the attention (one dispatch each where the
    Python path makes ten: 0.5-1.2 ms less per 20 ms step at 2 threads, within noise at 1). Parts
    with hooks (``torchgemma.debug``) are still called through ``__call__``; anything else
    (several tokens, gradients, a trace, AltUp, LAuReL, experts, a verify pass) takes DecoderLayer's
    own forward."""

    @classmethod
    def adopting(cls, layer: DecoderLayer) -> FusedDecoderLayer:
        """``layer`` itself, now of this class (its parts, weights and state dict untouched)."""
        layer.__class__ = cls
        return layer

    def forward(self, x, per_layer_input, inputs, shared_kv, cache, step):
        if (
            x.dim() != 3
            or x.shape[1] != 1
            or inputs.queries is not None
            or self.altup is not None
            or self.laurel is not None
            or self.spec.moe
            or torch.is_grad_enabled()
            or torch._C._get_tracing_state()
            or torch.compiler.is_compiling()
            or _has_global_hooks()
        ):
            return super().forward(x, per_layer_input, inputs, shared_kv, cache, step)
        parts = self._modules
        attention = parts["self_attn"]
        if _hooked(attention):
            attended = attention(_norm(parts["input_layernorm"], x), inputs, shared_kv, cache, step)
            x = _after_attention(parts, x, attended)
        else:
            # Quantized parts (float32 rows on the CPU) run as two C++ calls around the attention
            # (decode_layer_qkv, decode_layer_output): the same kernels in the same order as the
            # Python path beside each, one dispatch each.
            rows = x.shape[0] * x.shape[1]
            fused = x.dtype is torch.float32 and x.is_cpu and ensure_kernels()
            qkv, tail = self._decode_lists(parts, attention, rows) if fused else (None, None)
            if qkv is not None and not _tables_fit(attention, x, inputs):
                qkv = None
            if qkv is None:
                normed = _norm(parts["input_layernorm"], x)
                query, key, value = _attention_inputs(attention, normed, inputs, shared_kv)
            else:
                query, key, value = _DECODE_LAYER_QKV(
                    x, inputs.cos, inputs.sin, *qkv, attention.spec.head_dim
                )
            attended = _attend_to(
                attention, query, key, value, inputs, shared_kv, cache, step
            )  # (B, T, H, D)
            if tail is None:
                projected = _call(attention._modules["o_proj"], attended.reshape(*x.shape[:2], -1))
                x = _after_attention(parts, x, projected)
            else:
                x = _DECODE_LAYER_OUTPUT(x, attended, *tail)
        if per_layer_input is not None:
            gate = gelu_tanh(_call(parts["per_layer_input_gate"], x)) * per_layer_input
            x = x + _norm(parts["post_per_layer_input_norm"], _call(parts["per_layer_projection"], gate))
        scalar = self._buffers.get("layer_scalar")
        return x if scalar is None else x * scalar

    def _decode_lists(self, parts, attention: Attention, rows: int) -> tuple:
        """``decode_layer_qkv``'s and ``decode_layer_output``'s lists for ``rows`` float32 rows (each
        None where that half takes its Python path), built on a layer's first step of that many
        rows and kept while everything they were read from holds the same objects (``Reads``) and
        no hook was registered anywhere since: building them each step cost ~1 ms of a 23 ms step
        of the 270M."""
        memos = self.__dict__.get("_decode_memos")  # by row count (a server's batches vary)
        if memos is None:
            memos = self.__dict__["_decode_memos"] = {}
        memo = memos.get(rows)
        if memo is not None and memo[0] == RemovableHandle.next_id and memo[1].unchanged():
            return memo[2]
        reads = Reads()
        reads.keys(parts, "self_attn", "input_layernorm", "mlp")
        lists = (
            _qkv_arguments(attention, parts["input_layernorm"], rows, reads),
            _output_arguments(parts, attention, rows, reads),
        )
        memos[rows] = (RemovableHandle.next_id, reads, lists)
        return lists

    def _apply(self, fn, recurse=True):
        # The kept lists hold the weights: dropped when they move or change type.
        self.__dict__.pop("_decode_memos", None)
        return super()._apply(fn, recurse)


class Reads:
    """What an answer was read from: (mapping, key, value) and (object, attribute, value) triples.
    It still holds while each mapping and object gives the very same value (an ``is`` test: an
    equal but new value counts as a change)."""

    __slots__ = ("entries", "attrs")

    def __init__(self):
        self.entries: list[tuple] = []
        self.attrs: list[tuple] = []

    def keys(self, mapping, *keys: str) -> None:
        self.entries += [(mapping, key, mapping.get(key)) for key in keys]

    def attributes(self, obj, *names: str) -> None:
        self.attrs += [(obj, name, getattr(obj, name, None)) for name in names]

    def unchanged(self) -> bool:
        # Loops rather than all() over generators: 5.4 against 8.1 us per layer and step (the 270M's).
        for mapping, key, value in self.entries:
            if mapping.get(key) is not value:
                return False
        for obj, name, value in self.attrs:  # noqa: SIM110
            if getattr(obj, name, None) is not value:
                return False
        return True


def _after_attention(parts, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """DecoderLayer.forward from the attention's output (o_proj applied) to the feedforward's residual."""
    x = x + _norm(parts["post_attention_layernorm"], attended)
    residual = x
    ffw = _mlp(parts["mlp"], _norm(parts["pre_feedforward_layernorm"], residual))
    return residual + _norm(parts["post_feedforward_layernorm"], ffw)


def _attention_inputs(attention: Attention, x, inputs, shared_kv):
    """Attention.forward's query (B, H, T, D), keys and values (B, Hkv, T, D): this call's own, or a
    KV-sharing layer's source's (already stored)."""
    spec, parts = attention.spec, attention._modules
    batch, length, _ = x.shape
    query = _norm(parts["q_norm"], _call(parts["q_proj"], x).view(batch, length, -1, spec.head_dim))
    query = attention.rope(query, inputs.cos, inputs.sin).transpose(1, 2)  # (B, H, T, D)
    if spec.kv_role == "reuse":
        key, value = shared_kv[spec.kv_source]
        return query, key, value
    key = _call(parts["k_proj"], x).view(batch, length, -1, spec.head_dim)
    v_proj, v_norm = parts.get("v_proj"), parts.get("v_norm")
    value = key if v_proj is None else _call(v_proj, x).view(batch, length, -1, spec.head_dim)
    key = attention.rope(_norm(parts["k_norm"], key), inputs.cos, inputs.sin).transpose(1, 2)
    if v_norm is not None:
        value = _norm(v_norm, value)
    return query, key, value.transpose(1, 2)


def _attend_to(attention: Attention, query, key, value, inputs, shared_kv, cache, step) -> torch.Tensor:
    """The rest of Attention.forward before o_proj: new keys and values stored (the cache, a source
    layer's share), then the backend's (B, T, H, D)."""
    spec = attention.spec
    backend = attention.backends[attention.backend]
    if spec.kv_role != "reuse":
        if cache is not None:
            key, value = cache.update(key, value, step, getattr(backend, "reads_rings", False))
        if spec.kv_role == "store":
            shared_kv[spec.index] = (key, value)
    return backend(query, key, value, inputs, attention.scale)


def _products(modules, rows: int, reads: Reads) -> tuple[list, list] | None:
    """``decode_layer_*``'s products for ``modules`` (None: a layer without that product): each one's
    (qweight, scales, mins) and (bits, group size), where ``rows`` float32 rows take it through the
    row kernel (a quantized linear's ``decode_product``); None if one is anything else (dense, hooked,
    taking integer activations at this many rows). ``reads`` records what the answer was read from."""
    tensors, formats = [], []
    for module in modules:
        if module is None:
            tensors += (None, None, None)
            formats += (0, 0)
            continue
        reads.attributes(module, "__class__", "_compiled_call_impl")
        product = getattr(type(module), "decode_product", None)
        found = None if product is None or _hooked(module) else product(module, rows, reads)
        if found is None:
            return None
        tensors += found[:3]
        formats += found[3:]
    return tensors, formats


def _norm_arguments(norms, reads: Reads) -> tuple[list, list, list] | None:
    """``decode_layer_*``'s norms: each FusedRMSNorm's weight (or None), eps and plus_one; None if
    one is anything else or hooked."""
    weights, eps, plus_one = [], [], []
    for norm in norms:
        reads.attributes(norm, "__class__", "_compiled_call_impl", "eps", "plus_one")
        reads.keys(norm._parameters, "weight")
        if type(norm) is not FusedRMSNorm or _hooked(norm):
            return None
        weights.append(norm._parameters.get("weight"))
        eps.append(norm.eps)
        plus_one.append(1 if norm.plus_one else 0)
    return weights, eps, plus_one


def _output_arguments(parts, attention: Attention, rows: int, reads: Reads) -> tuple | None:
    """``decode_layer_output``'s lists for this layer (``rows`` float32 rows on the CPU), or None where its
    Python path must run (hooks, activation sparsity, products that are not the row kernel's)."""
    mlp = parts["mlp"]
    reads.attributes(mlp, "__class__", "activation_sparsity", "_compiled_call_impl")
    if type(mlp) is not FusedGatedMLP or mlp.activation_sparsity > 0 or _hooked(mlp):
        return None  # (decode_layer_output's activation is FusedGatedMLP's gelu_mul)
    layers = mlp._modules
    reads.keys(layers, "gate_proj", "up_proj", "down_proj")
    reads.keys(attention._modules, "o_proj")
    products = _products(
        (attention._modules["o_proj"], layers["gate_proj"], layers["up_proj"], layers["down_proj"]),
        rows,
        reads,
    )
    names = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    reads.keys(parts, *names)
    norms = _norm_arguments([parts[name] for name in names], reads)
    return None if products is None or norms is None else (*products, *norms)


def _qkv_arguments(attention: Attention, input_norm: nn.Module, rows: int, reads: Reads) -> tuple | None:
    """``decode_layer_qkv``'s lists, or None where Attention's inputs take their Python path (a
    KV-sharing layer, parts as above; the rotation and its tables: ``_tables_fit``, each call)."""
    spec, parts = attention.spec, attention._modules
    if spec.kv_role == "reuse":
        return None
    reads.keys(parts, "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "v_norm")
    products = _products((parts["q_proj"], parts["k_proj"], parts.get("v_proj")), rows, reads)
    v_norm = parts.get("v_norm")
    norms = _norm_arguments(
        (input_norm, parts["q_norm"], parts["k_norm"]) + (() if v_norm is None else (v_norm,)), reads
    )
    return None if products is None or norms is None else (*products, *norms)


def _tables_fit(attention: Attention, x: torch.Tensor, inputs) -> bool:
    """Whether ``decode_layer_qkv`` rotates as Attention would: the fused rotation, float32 tables of
    shape (B, T, head_dim)."""
    cos, sin = inputs.cos, inputs.sin
    return (
        attention.rope is fused_rope
        and cos.dtype is torch.float32
        and sin.dtype is torch.float32
        and cos.shape == (x.shape[0], x.shape[1], attention.spec.head_dim)
        and sin.shape == cos.shape
    )


_DECODE_LAYER_QKV = torch.ops.torchgemma.decode_layer_qkv.default
_DECODE_LAYER_OUTPUT = torch.ops.torchgemma.decode_layer_output.default


def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``GatedMLP.forward`` (or FusedGatedMLP's) without activation sparsity, its parts called directly."""
    if mlp.activation_sparsity > 0 or _hooked(mlp) or type(mlp) not in (GatedMLP, FusedGatedMLP):
        return mlp(x)
    parts = mlp._modules
    return _call(parts["down_proj"], mlp.activate(_call(parts["gate_proj"], x), _call(parts["up_proj"], x)))


def _hooked(module: nn.Module) -> bool:
    """Whether ``module(...)`` does more than ``module.forward(...)`` (no global hooks, no trace)."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or module._compiled_call_impl is not None
    )


def _call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x) if _hooked(module) else module.forward(x)


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A norm's forward; a FusedRMSNorm's C++ call itself (float32 CPU input, no gradients)."""
    fused = type(norm) is FusedRMSNorm and x.dtype is torch.float32 and x.is_cpu
    if fused and not _hooked(norm) and ensure_kernels():
        return _RMS_NORM(x, norm._parameters.get("weight"), norm.eps, norm.plus_one)
    return _call(norm, x)


def _has_global_hooks() -> bool:
    hooks = nn.modules.module
    return bool(
        hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    )


def fuse_cpu_ops(model: nn.Module) -> nn.Module:
    """Make the text decoder's RMSNorms, RoPE rotations, GeGLU activations and decode-step attention
    single C++ calls, in place (see the module docstring); returns the model. Where the C++ kernels cannot be built
    the model keeps the reference's operators (``torchgemma.kernels.kernel_status()`` says why)."""
    ensure_kernels()  # built or loaded now rather than in the first forward
    text = getattr(model, "language_model", model)
    for name, module in list(text.named_modules()):
        if type(module) is RMSNorm:
            parent_name, _, child = name.rpartition(".")
            setattr(text.get_submodule(parent_name), child, FusedRMSNorm.replacing(module))
        elif isinstance(module, Attention):
            module.rope = fused_rope
            module.backends = FUSED_ATTENTION
        elif type(module) is DecoderLayer:
            FusedDecoderLayer.adopting(module)
        elif type(module) is GatedMLP:
            FusedGatedMLP.adopting(module)
    return model

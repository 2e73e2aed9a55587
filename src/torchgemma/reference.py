"""The Gemma 4 text decoder written again as plain NumPy in float64: the formulas and nothing else.

    ids ─ E[id]·√H ─┬───────────────────────────────────────────────────────────────┐
                    │ (E2B/E4B) ple = (rms(W_pl·x/√H) + √P·E_pl[id]) / √2            │
                    ▼                                                               ▼
    each layer:  x ← x + rms(attention(rms(x)))               QK-norm, RoPE, scale 1, KV sharing
                 x ← x + rms(GeGLU(rms(x)) [+ experts])       26B: dense MLP beside top-k experts
                 x ← x + rms(W_proj·(gelu(W_gate·x) ⊙ ple_ℓ))  E2B/E4B: the per-layer input gate
                 x ← x · layer_scalar
    logits = cap · tanh(E·rms(x) / cap)

Gemma 3n keeps N copies of the stream (AltUp): each layer predicts every copy from all of them,
runs the block above on one (LAuReL beside its attention, sparse MLP gates in the first layers),
corrects the copies by what it changed and adds the per-layer input to the others.

One small function per block, each docstring its formula, composed by ``forward`` over a
checkpoint's weights. It shares no code with ``torchgemma.model`` and uses torch only to read
weights: it takes only the facts of ``TextConfig`` and its ``LayerSpec`` records (layer type, head
geometry, KV source, MLP width, MoE), so a disagreement with the torch model points at one of the
two. Everything is float64 with no rounding to a model dtype, so it is also the yardstick for how far
a float32 or bf16 run drifts. Gemma 3 text models (``(1 + w)`` norms, ``query_pre_attn_scalar``,
linear RoPE, no V-norm, no layer scalar, bidirectional encoders) run through the same functions, as
config data, and so does Gemma 3n's text decoder. The formulas are those of transformers 5.23
(``models/gemma4/modeling_gemma4.py``, ``models/gemma3n/modeling_gemma3n.py``).

Weights are a dict ``name -> float64 array`` under the ``gemma4`` checkpoint's names
(``model.language_model.layers.3.self_attn.q_proj.weight``; an untied head is ``lm_head.weight``):
``weights_from_model`` takes them from a loaded model, ``weights_from_checkpoint`` from the files.
``forward(..., record={})`` also fills the dict with what every module produced, under the module's
name in the same layout (``model.language_model.layers.3.self_attn``, ``...layers.3.mlp``,
``...layers.3.experts``, ``...layers.3.per_layer_input_gate``): our model's module names are these
without the leading ``model.``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from .config import LayerSpec, RopeSpec, TextConfig

PREFIX = "model.language_model."

# The text model's own top-level modules: how ``weights_from_checkpoint`` tells them from the towers'.
TEXT_MODULES = (
    "embed_tokens.",
    "embed_tokens_per_layer.",
    "per_layer_model_projection.",
    "per_layer_projection_norm.",
    "layers.",
    "norm.",
    "altup_projections.",
    "altup_unembed_projections.",
    "embed_vision.",
    "embed_audio.",
)

Array = np.ndarray


# ── small parts ─────────────────────────────────────────────────────────────────────────────────


def rms_norm(x: Array, weight: Array | None = None, eps: float = 1e-6, plus_one: bool = False) -> Array:
    """RMSNorm over the last axis: ``y = x / sqrt(mean(x²) + eps) · s``.

    ``s = w`` in Gemma 4 (the checkpoint stores the scale itself), ``s = 1 + w`` in Gemma 1-3
    (``plus_one``), ``s = 1`` without a weight (V-norm, router norm).
    """
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    if weight is None:
        return y
    return y * (1.0 + weight if plus_one else weight)


def gelu_tanh(x: Array) -> Array:
    """``gelu(x) ≈ x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))``, the tanh approximation."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def linear(x: Array, weight: Array) -> Array:
    """``y = x Wᵀ`` for a checkpoint weight ``W`` stored (out, in); no bias anywhere in Gemma."""
    return x @ weight.T


def gaussian_topk(x: Array, sparsity: float) -> Array:
    """``relu(x − (μ + σ · Φ⁻¹(p)))`` over the last axis (μ, σ its mean and population std): of
    normally distributed values, keeps the top ``1 − p``, less the cutoff (Gemma 3n's sparse gates)."""
    mean, std = np.mean(x, axis=-1, keepdims=True), np.std(x, axis=-1, keepdims=True)
    return np.maximum(x - (mean + std * NormalDist().inv_cdf(sparsity)), 0.0)


def geglu(x: Array, gate: Array, up: Array, down: Array, sparsity: float = 0.0) -> Array:
    """The gated MLP: ``W_down · (gelu_tanh(W_gate · x) ⊙ (W_up · x))``; with ``sparsity`` p > 0
    (Gemma 3n) the gate's activations go through ``gaussian_topk`` before the GELU."""
    gated = linear(x, gate)
    if sparsity > 0:
        gated = gaussian_topk(gated, sparsity)
    return linear(gelu_tanh(gated) * linear(x, up), down)


def soft_cap(x: Array, cap: float | None) -> Array:
    """``cap · tanh(x / cap)``: squashes into (-cap, cap); the identity when ``cap`` is None."""
    return x if cap is None else cap * np.tanh(x / cap)


# ── rotary embeddings ───────────────────────────────────────────────────────────────────────────


def inverse_frequencies(rope: RopeSpec) -> Array:
    """The ``D/2`` rotation frequencies of a head of width ``D = rope.head_dim``.

    default: ``f_j = θ^(-2j/D)``, ``j < D/2`` (every pair rotates).
    proportional (Gemma 4 full layers): the first ``⌊p·D/2⌋`` of those, exponents still over the
    full ``D``, and ``f_j = 0`` for the rest (those pairs do not rotate); divided by ``factor``.
    linear (Gemma 3 global layers): default frequencies divided by ``factor``.
    """
    d = rope.head_dim
    exponents = np.arange(0, d, 2, dtype=np.float64) / d
    freqs = rope.theta**-exponents
    if rope.rope_type == "default":
        return freqs  # transformers' default rope ignores any factor
    if rope.rope_type == "proportional":
        rotated = int(rope.partial_rotary_factor * d // 2)
        freqs = np.where(np.arange(d // 2) < rotated, freqs, 0.0)
    elif rope.rope_type != "linear":
        raise ValueError(f"reference: unsupported rope_type {rope.rope_type!r}")
    return freqs / rope.factor


def rope(x: Array, positions: Array, freqs: Array) -> Array:
    """Rotate ``x`` (B, T, heads, D) in half-split pairs: dimension ``j`` pairs with ``j + D/2``.

    With ``a = position · f_j``: ``(x_j, x_{j+D/2}) → (x_j cos a − x_{j+D/2} sin a,
    x_{j+D/2} cos a + x_j sin a)``.
    """
    angles = (positions[..., None] * freqs)[:, :, None, :]  # (B, T, 1, D/2)
    cos, sin = np.cos(angles), np.sin(angles)
    first, second = np.split(x, 2, axis=-1)
    return np.concatenate((first * cos - second * sin, second * cos + first * sin), axis=-1)


# ── masks ───────────────────────────────────────────────────────────────────────────────────────


def visible_keys(
    valid: Array, window: int | None, blocks: Array | None = None, bidirectional: bool = False
) -> Array:
    """(B, T, T) True where query ``q`` may attend to key ``k``, from ``valid`` (B, T) real tokens.

    Decoder: ``k`` is real and (``k ≤ q``, or ``q`` and ``k`` lie in one image block:
    ``blocks[q] = blocks[k] ≥ 0``), and on sliding layers (``window`` W) ``q − k < W``: W keys
    including the query itself; a block's later tokens are always within reach.
    Encoder (``bidirectional``, EmbeddingGemma): ``k`` is real, and ``|q − k| < W`` on sliding layers.
    Indices are columns, padding included (left padding keeps distances between real tokens).
    """
    index = np.arange(valid.shape[1])
    q, k = index[:, None], index[None, :]
    if bidirectional:
        allowed = np.ones((1, len(index), len(index)), bool) if window is None else abs(q - k)[None] < window
    else:
        allowed = np.broadcast_to(k <= q, (1, len(index), len(index)))
        if blocks is not None:
            allowed = allowed | ((blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0))
        if window is not None:
            allowed = allowed & (q - k < window)
    return allowed & valid[:, None, :]


# ── attention ───────────────────────────────────────────────────────────────────────────────────


def attention(query: Array, key: Array, value: Array, allowed: Array, scale: float) -> Array:
    """``softmax(scale · q kᵀ over the allowed keys) v`` per head: query (B, T, H, D), key and value
    (B, S, Hkv, D), allowed (B, T, S). KV head ``j`` serves query heads ``j·g … j·g + g − 1``,
    ``g = H / Hkv``. A query with no allowed key (a left-padding row) gets zeros. Returns (B, T, H, D).
    """
    b, t, h, d = query.shape
    hkv = key.shape[2]
    grouped = query.reshape(b, t, hkv, h // hkv, d)
    scores = np.einsum("btkgd,bskd->bkgts", grouped, key) * scale  # (B, Hkv, g, T, S)
    mask = allowed[:, None, None]
    scores = np.where(mask, scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    weights = np.where(mask, np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = np.sum(weights, axis=-1, keepdims=True)
    probs = weights / np.where(total > 0, total, 1.0)
    return np.einsum("bkgts,bskd->btkgd", probs, value).reshape(b, t, h, d)


def self_attention(
    x: Array,
    w: Callable[[str], Array],
    spec: LayerSpec,
    config: TextConfig,
    positions: Array,
    freqs: Array,
    allowed: Array,
    shared_kv: dict[int, tuple[Array, Array]],
    keep: Callable[[str, Any], Any],
) -> Array:
    """One layer's attention over the normed stream ``x`` (B, T, H):

    ``q = rope(rms(W_q x, w_q))``; own K/V: ``k = rope(rms(W_k x, w_k))``, ``v = rms(W_v x)``
    (no scale; ``W_v = W_k`` on K=V full layers, the raw projection before the K-norm). Gemma 4's
    score scale is 1, the QK norms standing in for ``1/√D``; Gemma 3 scales by
    ``query_pre_attn_scalar^-½`` and has no V-norm. A KV-shared layer (``kv_role == "reuse"``) has
    no K/V of its own: it attends with its own queries to exactly the keys and values its source
    layer attended to. Output ``W_o · attention``.
    """
    b, t, _ = x.shape
    d, eps, plus_one = spec.head_dim, config.rms_norm_eps, config.norm_plus_one
    query = keep(
        "q_norm",
        rms_norm(linear(x, w("q_proj.weight")).reshape(b, t, -1, d), w("q_norm.weight"), eps, plus_one),
    )
    query = rope(query, positions, freqs)
    if spec.kv_role == "reuse":
        key, value = shared_kv[spec.kv_source]
    else:
        raw_key = linear(x, w("k_proj.weight")).reshape(b, t, -1, d)
        raw_value = raw_key if spec.k_eq_v else linear(x, w("v_proj.weight")).reshape(b, t, -1, d)
        key = rope(keep("k_norm", rms_norm(raw_key, w("k_norm.weight"), eps, plus_one)), positions, freqs)
        value = keep("v_norm", rms_norm(raw_value, eps=eps)) if config.use_v_norm else raw_value
        shared_kv[spec.index] = (key, value)
    out = attention(query, key, value, allowed, config.attention_scale)
    return linear(out.reshape(b, t, -1), w("o_proj.weight"))


# ── mixture of experts (26B-A4B) ────────────────────────────────────────────────────────────────


def router(
    x: Array, proj: Array, scale: Array, per_expert_scale: Array, top_k: int, eps: float
) -> tuple[Array, Array]:
    """Top-k routing of tokens ``x`` (N, H): ``p = softmax(W_r · (rms(x) ⊙ s / √H))`` over all experts;
    the ``k`` largest ``p_e`` renormalised to sum 1, each times its expert's scale ``c_e``.
    Returns weights (N, K) and expert ids (N, K), largest probability first.
    """
    logits = linear(rms_norm(x, eps=eps) * scale * x.shape[-1] ** -0.5, proj)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    chosen = np.take_along_axis(probs, experts, axis=-1)
    return chosen / chosen.sum(axis=-1, keepdims=True) * per_expert_scale[experts], experts


def experts(x: Array, weights: Array, chosen: Array, gate_up: Array, down: Array) -> Array:
    """``y_n = Σ_k weights[n, k] · GeGLU_e(x_n)``, ``e = chosen[n, k]``, over tokens ``x`` (N, H).

    Expert ``e``'s gate is ``gate_up[e][:I]``, its up projection ``gate_up[e][I:]``, its down
    projection ``down[e]`` (stacked tensors: gate_up_proj (E, 2I, H), down_proj (E, H, I)).
    """
    out = np.zeros_like(x)
    for e in np.unique(chosen):
        token, slot = np.nonzero(chosen == e)
        gate, up = np.split(gate_up[e], 2, axis=0)
        out[token] += weights[token, slot, None] * geglu(x[token], gate, up, down[e])
    return out


# ── per-layer embeddings (E2B/E4B) ──────────────────────────────────────────────────────────────


def per_layer_inputs(
    input_ids: Array, embeds: Array, table: Array, projection: Array, norm: Array, config: TextConfig
) -> tuple[Array, dict[str, Array]]:
    """(B, T, L, P): every layer's input from the token itself and from its context embedding.

    ``ple[b, t, ℓ] = (rms(W_pl · x / √H)[ℓ] + √P · E_pl[id][ℓ]) / √2``: ``x`` the scaled token
    embedding (B, T, H), ``W_pl`` per_layer_model_projection (L·P, H), ``E_pl`` the packed table whose
    row is [layer 0's P values | layer 1's | ...]; the RMSNorm (weight ``norm``) runs over P. Also
    returns the modules' outputs by name (the table rows, the projection, the normed projection).
    """
    shape = (*input_ids.shape, config.num_hidden_layers, config.hidden_size_per_layer_input)
    rows = table[np.where(input_ids < len(table), input_ids, 0)]  # (B, T, L·P); ids past the table: row 0
    projected = linear(embeds, projection)
    context = rms_norm((projected * config.hidden_size**-0.5).reshape(shape), norm, config.rms_norm_eps)
    ple = (context + rows.reshape(shape) * config.hidden_size_per_layer_input**0.5) * 2.0**-0.5
    modules = {
        "embed_tokens_per_layer": rows,
        "per_layer_model_projection": projected,
        "per_layer_projection_norm": context,
    }
    return ple, modules


# ── AltUp and LAuReL (Gemma 3n) ─────────────────────────────────────────────────────────────────


def rescaled(x: Array, target: Array) -> Array:
    """``x`` scaled to the RMS ``target`` (B, T, 1): ``x · target / sqrt(max(mean(x²), 1e-5))``."""
    return x * target / np.sqrt(np.maximum(np.mean(x * x, axis=-1, keepdims=True), 1e-5))


def altup_streams(x: Array, projections: list[Array]) -> Array:
    """(N, B, T, H): ``s_0 = x`` and ``s_i = W_i x`` rescaled to x's RMS, ``i = 1 … N−1``."""
    target = np.sqrt(np.mean(x * x, axis=-1, keepdims=True))
    return np.stack([x] + [rescaled(linear(x, w), target) for w in projections])


def altup_merge(streams: Array, projections: list[Array]) -> Array:
    """(B, T, H): the mean of ``s_0`` and of ``W'_i s_i`` rescaled to the RMS of ``s_0``."""
    target = np.sqrt(np.mean(streams[0] ** 2, axis=-1, keepdims=True))
    merged = [streams[0]] + [rescaled(linear(s, w), target) for s, w in zip(streams[1:], projections)]
    return np.mean(np.stack(merged), axis=0)


def altup_route(x: Array, norm: Array, router: Array, eps: float) -> Array:
    """(B, T, N) per-token coefficients' inputs: ``tanh(W_router · rms(x) / H)``."""
    return np.tanh(linear(rms_norm(x, norm, eps) / x.shape[-1], router))


def altup_predict(streams: Array, active: int, w: Callable[[str], Array], eps: float) -> Array:
    """``p_i = s_i + Σ_j C[i, j] s_j``, ``C`` = (N, N) per token from ``W_pred · route(s_active)``,
    row-major (``C[i, j]`` is output ``i·N + j``)."""
    n = streams.shape[0]
    route = altup_route(streams[active], w("router_norm.weight"), w("modality_router.weight"), eps)
    coefs = linear(route, w("prediction_coefs.weight")).reshape(*route.shape[:-1], n, n)
    return streams + np.einsum("btij,jbth->ibth", coefs, streams)


def altup_correct(
    predictions: Array, activated: Array, active: int, w: Callable[[str], Array], eps: float
) -> Array:
    """``c_i = p_i + (1 + K_i) (a − p_active)``, ``K = W_corr · route(a)`` per token, ``a`` the
    active stream after the layer."""
    route = altup_route(activated, w("router_norm.weight"), w("modality_router.weight"), eps)
    gains = linear(route, w("correction_coefs.weight")) + 1.0  # (B, T, N)
    return predictions + np.moveaxis(gains, -1, 0)[..., None] * (activated - predictions[active])


def laurel(x: Array, left: Array, right: Array, norm: Array, eps: float) -> Array:
    """``x + rms(W_r · W_l · x)``: a residual through a rank-r bottleneck."""
    return x + rms_norm(linear(linear(x, left), right), norm, eps)


# ── decoder layer ───────────────────────────────────────────────────────────────────────────────


def decoder_layer(
    x: Array,
    per_layer_input: Array | None,
    w: Callable[[str], Array],
    spec: LayerSpec,
    config: TextConfig,
    positions: Array,
    freqs: Array,
    allowed: Array,
    shared_kv: dict[int, tuple[Array, Array]],
    keep: Callable[[str, Any], Any],
) -> Array:
    """One decoder layer on the stream ``x`` (B, T, H), every norm an RMSNorm with its own weight:

    ``x ← x + post_attn(attention(input(x)))``
    ``x ← x + post_ffw(f)``, ``f = GeGLU(pre_ffw(x))``; with MoE (26B) the dense MLP runs beside
    the experts: ``f = post_ffw_1(GeGLU(pre_ffw(x))) + post_ffw_2(experts(pre_ffw_2(x), router(x)))``,
    routed on the stream itself (transformers; Google's JAX code routes on ``pre_ffw(x)``).
    ``x ← x + post_ple(W_proj · (gelu_tanh(W_gate · x) ⊙ ple_ℓ))`` with per-layer inputs (E2B/E4B).
    ``x ← x · layer_scalar`` (Gemma 4): the whole stream, after everything else.

    Gemma 3n (AltUp): ``x`` is the N streams (N, B, T, H). ``p = predict(x)``, the block runs on
    ``a = p_active`` with ``a ← (a + post_attn(attention(input(a))) + laurel(input(a))) / √2``
    for the attention step; then ``c = correct(p, a)`` and ``c_i += post_ple(W_proj ·
    (gelu_tanh(W_gate · (c_active ⊙ s)) ⊙ ple_ℓ))`` for ``i ≥ 1`` (``s`` correct_output_scale).
    """
    eps, plus_one = config.rms_norm_eps, config.norm_plus_one

    def norm(name: str, value: Array) -> Array:
        return keep(name, rms_norm(value, w(f"{name}.weight"), eps, plus_one))

    if config.has_altup:
        altup_weights, active = _prefixed(w, "altup."), config.altup_active_idx
        predictions = altup_predict(x, active, altup_weights, eps)
        x = predictions[active]

    attn_weights, attn_keep = _prefixed(w, "self_attn."), _prefixed(keep, "self_attn.")
    normed = norm("input_layernorm", x)
    attn = self_attention(
        normed,
        attn_weights,
        spec,
        config,
        positions,
        freqs,
        allowed,
        shared_kv,
        attn_keep,
    )
    x = x + norm("post_attention_layernorm", keep("self_attn", attn))
    if config.laurel_rank:
        residual = laurel(
            normed,
            w("laurel.linear_left.weight"),
            w("laurel.linear_right.weight"),
            w("laurel.post_laurel_norm.weight"),
            eps,
        )
        x = (x + keep("laurel", residual)) / np.sqrt(2.0)

    mlp_weights = (w(f"mlp.{name}_proj.weight") for name in ("gate", "up", "down"))
    mlp = keep("mlp", geglu(norm("pre_feedforward_layernorm", x), *mlp_weights, spec.activation_sparsity))
    if spec.moe:
        flat = x.reshape(-1, x.shape[-1])  # (N, H), N = B·T
        scales = w("router.scale"), w("router.per_expert_scale")
        routing = keep("router", router(flat, w("router.proj.weight"), *scales, config.top_k_experts, eps))
        stacked = w("experts.gate_up_proj"), w("experts.down_proj")
        moe = keep("experts", experts(norm("pre_feedforward_layernorm_2", flat), *routing, *stacked))
        moe = norm("post_feedforward_layernorm_2", moe.reshape(x.shape))
        mlp = norm("post_feedforward_layernorm_1", mlp) + moe
    x = x + norm("post_feedforward_layernorm", mlp)

    def per_layer_update(x: Array) -> Array:
        gate = keep("per_layer_input_gate", linear(x, w("per_layer_input_gate.weight")))
        projected = keep(
            "per_layer_projection",
            linear(gelu_tanh(gate) * per_layer_input, w("per_layer_projection.weight")),
        )
        return norm("post_per_layer_input_norm", projected)

    if config.has_altup:
        corrected = altup_correct(predictions, x, active, altup_weights, eps)
        scale = w("altup.correct_output_scale") if config.altup_correct_scale else 1.0
        corrected[1:] += per_layer_update(corrected[active] * scale)
        return corrected
    if per_layer_input is not None:
        x = x + per_layer_update(x)
    return x * w("layer_scalar") if config.use_layer_scalar else x


# ── the stack ───────────────────────────────────────────────────────────────────────────────────


def embed(input_ids: Array, table: Array) -> Array:
    """``x = E[id] · √H``: the token's row of the embedding table (V, H), scaled by ``√H``."""
    return table[input_ids] * table.shape[1] ** 0.5


def embed_media_ids(x: Array, input_ids: Array, vocab: Any, w: Callable[[str], Array]) -> Array:
    """Gemma 3n: ids in ``[offset, end)`` embed as ``rms(W_proj · rms(T[id − offset], w_hard))``
    (the last norm without a weight), from the tower embedder's own table ``T``, not ``E``."""
    mine = (input_ids >= vocab.offset) & (input_ids < (np.inf if vocab.end is None else vocab.end))
    rows = w("embedding.weight")[np.where(mine, input_ids - vocab.offset, 0)]
    hard = rms_norm(rows, w("hard_embedding_norm.weight"), vocab.rms_norm_eps)
    media = rms_norm(linear(hard, w("embedding_projection.weight")), eps=vocab.rms_norm_eps)
    return np.where(mine[..., None], media, x)


def token_positions(valid: Array) -> Array:
    """(B, T) RoPE positions: each token's index among its row's real tokens (left padding at 0)."""
    return np.where(valid, np.cumsum(valid, axis=-1) - 1, 0)


def forward(
    weights: dict[str, Array],
    config: TextConfig,
    input_ids: Array,
    attention_mask: Array | None = None,
    vision_blocks: Array | None = None,
    record: dict[str, Any] | None = None,
) -> Array:
    """Logits (B, T, V) in float64 for ``input_ids`` (B, T): the whole decoder, no cache.

    ``attention_mask`` (B, T): 1 for real tokens, 0 for left padding (whose rows are meaningless);
    RoPE positions count real tokens only, as generation does.
    ``vision_blocks`` (B, T): image-block ids, -1 outside images (``vision_block_ids`` of the
    multimodal model): on sliding layers a block's tokens see each other both ways (26B/31B "vision"
    mode); full layers stay causal. ``record``: filled with every module's output under its
    checkpoint name (``model.language_model.layers.3.mlp``, ...; the router's entry is the pair
    (weights, expert ids), as our module returns it; tokens are flattened (B·T, H) where the module
    sees them so: router, experts, pre_feedforward_layernorm_2).
    """
    w = _reader(weights)
    keep = _prefixed(_recorder(record), PREFIX)
    input_ids = np.asarray(input_ids)
    valid = (
        np.ones(input_ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    )
    if valid.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {valid.shape}, input_ids {input_ids.shape}")
    positions = token_positions(valid)
    blocks = None if vision_blocks is None else np.asarray(vision_blocks)

    table = w(PREFIX + "embed_tokens.weight")
    keep("embed_tokens", table[input_ids])
    x = embed(input_ids, table)
    for vocab in config.media_vocabularies:
        x = embed_media_ids(x, input_ids, vocab, _prefixed(w, f"{PREFIX}embed_{vocab.name}."))
    per_layer = None
    if config.has_per_layer_inputs:
        per_layer, modules = per_layer_inputs(
            input_ids,
            x,
            w(PREFIX + "embed_tokens_per_layer.weight"),
            w(PREFIX + "per_layer_model_projection.weight"),
            w(PREFIX + "per_layer_projection_norm.weight"),
            config,
        )
        for name, value in modules.items():
            keep(name, value)

    # One RoPE table and one mask per attention type, shared by all layers of that type.
    freqs = {t: inverse_frequencies(spec) for t, spec in config.rope.items()}
    masks = {}
    for spec in config.layers:
        if spec.attention_type not in masks:
            sliding_blocks = None if spec.window is None else blocks
            masks[spec.attention_type] = visible_keys(
                valid, spec.window, sliding_blocks, config.bidirectional
            )

    if config.has_altup:
        projections = range(config.altup_num_inputs - 1)
        x = altup_streams(x, [w(f"{PREFIX}altup_projections.{i}.weight") for i in projections])
    shared_kv: dict[int, tuple[Array, Array]] = {}
    for spec in config.layers:
        name = f"layers.{spec.index}"
        x = decoder_layer(
            x,
            None if per_layer is None else per_layer[:, :, spec.index],
            _prefixed(w, f"{PREFIX}{name}."),
            spec,
            config,
            positions,
            freqs[spec.attention_type],
            masks[spec.attention_type],
            shared_kv,
            _prefixed(keep, f"{name}."),
        )
        keep(name, x)

    if config.has_altup:
        x = altup_merge(x, [w(f"{PREFIX}altup_unembed_projections.{i}.weight") for i in projections])
    # The final norm, the output projection (the embedding table unless untied), the soft-cap.
    x = keep("norm", rms_norm(x, w(PREFIX + "norm.weight"), config.rms_norm_eps, config.norm_plus_one))
    output = table if config.tie_word_embeddings else w("lm_head.weight")
    return soft_cap(linear(x, output), config.final_logit_softcapping)


# ── weights ─────────────────────────────────────────────────────────────────────────────────────


def weights_from_model(model: Any) -> dict[str, Array]:
    """The text decoder's weights of a loaded ``torchgemma`` model, in float64, under checkpoint names."""
    state = model.state_dict()
    weights = {}
    for name, tensor in state.items():
        if name == "language_model.lm_head.weight":
            weights["lm_head.weight"] = _float64(tensor)
        elif name.startswith("language_model."):
            weights["model." + name] = _float64(tensor)
    return weights


def weights_from_checkpoint(folder: str | Path) -> dict[str, Array]:
    """The text decoder's weights read from a checkpoint folder's safetensors files, in float64.

    Names are brought to the ``gemma4`` layout: ``model.layers.*`` (``*ForCausalLM``) and
    ``language_model.model.*`` (Gemma 3 multimodal) become ``model.language_model.*``; the towers'
    tensors are left out. Reads the files directly, not through ``torchgemma.load``.
    """
    from .weights.safetensors import read_safetensors, safetensors_files

    weights = {}
    with ExitStack() as stack:
        for name, load, _, _ in read_safetensors(safetensors_files(Path(folder)), stack):
            key = _text_name(name)
            if key is not None:
                weights[key] = _float64(load())
    return weights


def _text_name(name: str) -> str | None:
    for prefix in (PREFIX, "language_model.model.", "model."):
        if name.startswith(prefix) and name[len(prefix) :].startswith(TEXT_MODULES):
            return PREFIX + name[len(prefix) :]
    return name if name == "lm_head.weight" else None


def _float64(tensor: Any) -> Array:
    import torch  # only to read weights: the formulas above are NumPy

    # A copy: a float64 tensor may be a view of a mapped file that closes after reading.
    return tensor.detach().to(device="cpu", dtype=torch.float64).numpy().copy()


def _reader(weights: dict[str, Array]) -> Callable[[str], Array]:
    def read(name: str) -> Array:
        if name not in weights:
            raise KeyError(
                f"reference: no weight {name!r} among the {len(weights)} given "
                f"(e.g. {', '.join(sorted(weights)[:3])})"
            )
        return weights[name]

    return read


def _recorder(record: dict[str, Any] | None) -> Callable[[str, Any], Any]:
    """``keep(name, value)``: returns ``value``, and stores it under ``name`` when recording."""

    def keep(name: str, value: Any) -> Any:
        if record is not None:
            record[name] = value
        return value

    return keep


def _prefixed(fn: Callable[..., Any], prefix: str) -> Callable[..., Any]:
    """``fn`` with ``prefix`` put before the name it is called with (a weight reader, a recorder)."""
    return lambda name, *args: fn(prefix + name, *args)

"""The Gemma 4 text decoder, in reading order.

    token ids ─ embed_tokens·√H ─┬──────────────────────────────────────────────┐
                                 │ (E2B/E4B) per-layer inputs: token table + context projection
                                 ▼                                              ▼
    for each layer:  x + post_attn_norm(attention(input_norm(x)))         per_layer_inputs[:, :, i]
                     x + post_ffw_norm(MLP(pre_ffw_norm(x)) [+ experts])          │
                     (E2B/E4B) x + post_ple_norm(proj(gelu(gate(x)) · ple_i)) ◀───┘
                     x · layer_scalar
    final norm ─ tied LM head ─ tanh soft-cap ─ logits

Per-layer differences (sliding/full geometry, KV role, MLP width, MoE) come from ``LayerSpec``.
Every numerics choice mirrors transformers 5.23 (``models/gemma4/modeling_gemma4.py``) so that bf16
logits agree to the bit with its eager attention and eager experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache, LayerCache
from ..config import LayerSpec, RopeSpec, TextConfig
from .layers import GatedMLP, RMSNorm, apply_rope, gelu_tanh, rope_cos_sin


def text_norm(config: TextConfig, dim: int) -> RMSNorm:
    """The decoder's RMSNorm with a weight, in the variant of the model's generation."""
    return RMSNorm(dim, config.rms_norm_eps, plus_one=config.norm_plus_one)


def scale_in_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``: the reference keeps embedding scales as tensors of the weight dtype."""
    return float(torch.tensor(value).to(dtype))


# ── attention ───────────────────────────────────────────────────────────────────────────────────


def eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Softmax attention with an additive mask.

    Gemma 4 uses scale 1 (the QK norms replace 1/√D); Gemma 3 scales by query_pre_attn_scalar^-1/2.
    query (B, H, T, D); key/value (B, Hkv, S, D); mask (B, 1, T, S) or None. Returns (B, T, H, D).
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        # Each key/value head serves `groups` consecutive query heads.
        b, hkv, s, d = key.shape
        key = key[:, :, None].expand(b, hkv, groups, s, d).reshape(b, hkv * groups, s, d)
        value = value[:, :, None].expand(b, hkv, groups, s, d).reshape(b, hkv * groups, s, d)
    scores = torch.matmul(query, key.transpose(2, 3))  # (B, H, T, S)
    if scale != 1.0:  # multiplying by 1.0 is exact: skip it
        scores = scores * scale
    if mask is not None:
        scores = scores + mask
    # Softmax in float32, then back to the model dtype before the product with V, as the reference.
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


class Attention(nn.Module):
    def __init__(self, config: TextConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        hidden, heads, dim = config.hidden_size, config.num_attention_heads, spec.head_dim
        self.q_proj = nn.Linear(hidden, heads * dim, bias=False)
        self.q_norm = text_norm(config, dim)
        self.scale = config.attention_scale
        if spec.has_kv_weights:  # KV-shared layers own no k/v weights
            self.k_proj = nn.Linear(hidden, spec.num_kv_heads * dim, bias=False)
            self.v_proj = None if spec.k_eq_v else nn.Linear(hidden, spec.num_kv_heads * dim, bias=False)
            self.k_norm = text_norm(config, dim)
            # Gemma 4 normalises values too (without a scale); Gemma 3 does not.
            self.v_norm = RMSNorm(dim, config.rms_norm_eps, with_scale=False) if config.use_v_norm else None
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
        cache: LayerCache | None,
        start: int,
    ) -> torch.Tensor:
        spec = self.spec
        batch, length, _ = x.shape
        query = self.q_norm(self.q_proj(x).view(batch, length, -1, spec.head_dim))
        query = apply_rope(query, cos, sin).transpose(1, 2)  # (B, H, T, D)

        if spec.kv_role == "reuse":
            # Exactly the keys/values (and so the mask) the source layer attended to in this pass.
            key, value = shared_kv[spec.kv_source]
        else:
            key = self.k_proj(x).view(batch, length, -1, spec.head_dim)
            # K=V: values are the raw key projection, before k_norm and RoPE.
            value = key if self.v_proj is None else self.v_proj(x).view(batch, length, -1, spec.head_dim)
            key = apply_rope(self.k_norm(key), cos, sin).transpose(1, 2)  # (B, Hkv, T, D)
            if self.v_norm is not None:
                value = self.v_norm(value)
            value = value.transpose(1, 2)
            if cache is not None:
                key, value = cache.update(key, value, start)
            if spec.kv_role == "store":
                shared_kv[spec.index] = (key, value)

        out = eager_attention(query, key, value, mask, self.scale)  # (B, T, H, D)
        return self.o_proj(out.reshape(batch, length, -1))


# ── mixture of experts (26B-A4B) ───────────────────────────────────────────────────────────────


class Router(nn.Module):
    """Top-k routing over all experts, softmax in float32, renormalised, then per-expert scales."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.top_k = config.top_k_experts
        self.root_size = config.hidden_size**-0.5
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, H) -> weights (N, K) float32, expert ids (N, K)."""
        scores = self.proj(self.norm(x) * self.scale * self.root_size)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Experts(nn.Module):
    """All experts' GeGLU weights as stacked tensors: gate_up_proj (E, 2I, H), gate rows first."""

    def __init__(self, config: TextConfig):
        super().__init__()
        e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x (N, H), weights/experts (N, K) -> (N, H).

        Matches the reference's eager experts: expert by expert in ascending id, each expert's
        weighted output rounded to the model dtype and accumulated with index_add_.
        """
        out = torch.zeros_like(x)
        for expert in torch.unique(experts).tolist():
            # Rows in (slot, token) order: the order the reference gathers them in.
            slot, token = torch.where(expert == experts.T)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(gelu_tanh(gate) * up, self.down_proj[expert])
            y = y * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


# ── decoder layer ─────────────────────────────────────────────────────────────────────────────


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        hidden = config.hidden_size
        self.input_layernorm = text_norm(config, hidden)
        self.self_attn = Attention(config, spec)
        self.post_attention_layernorm = text_norm(config, hidden)
        self.pre_feedforward_layernorm = text_norm(config, hidden)
        self.mlp = GatedMLP(hidden, spec.intermediate_size)
        self.post_feedforward_layernorm = text_norm(config, hidden)
        if spec.moe:
            # The dense MLP above runs beside the experts; each branch has its own norms.
            self.router = Router(config)
            self.experts = Experts(config)
            self.pre_feedforward_layernorm_2 = text_norm(config, hidden)
            self.post_feedforward_layernorm_1 = text_norm(config, hidden)
            self.post_feedforward_layernorm_2 = text_norm(config, hidden)
        if config.has_per_layer_inputs:
            p = config.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(hidden, p, bias=False)
            self.per_layer_projection = nn.Linear(p, hidden, bias=False)
            self.post_per_layer_input_norm = text_norm(config, hidden)
        # Gemma 4: multiplies the whole residual stream at the end of the layer; loaded from the checkpoint.
        if config.use_layer_scalar:
            self.register_buffer("layer_scalar", torch.ones(1))

    def forward(
        self,
        x: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
        cache: LayerCache | None,
        start: int,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, mask, shared_kv, cache, start)
        x = x + self.post_attention_layernorm(attn)

        residual = x
        ffw = self.mlp(self.pre_feedforward_layernorm(residual))
        if self.spec.moe:
            # transformers routes on the post-attention residual; Google's JAX code routes on the
            # pre-FFN-normed input. We match transformers, the reference of our parity tests.
            flat = residual.reshape(-1, residual.shape[-1])
            weights, experts = self.router(flat)
            moe = self.experts(self.pre_feedforward_layernorm_2(flat), weights, experts)
            ffw = self.post_feedforward_layernorm_1(ffw) + self.post_feedforward_layernorm_2(
                moe.view_as(residual)
            )
        x = residual + self.post_feedforward_layernorm(ffw)

        if per_layer_input is not None:
            gate = gelu_tanh(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return x * self.layer_scalar if hasattr(self, "layer_scalar") else x


# ── the stack ─────────────────────────────────────────────────────────────────────────────────


class RotaryTables(nn.Module):
    """One float32 inverse-frequency table per attention type."""

    def __init__(self, rope: dict[str, RopeSpec]):
        super().__init__()
        self.specs = rope
        for layer_type, spec in rope.items():
            self.register_buffer(layer_type, spec.inv_freq(), persistent=False)

    def _apply(self, fn, recurse=True):
        # A blanket .to(bfloat16) would round the frequencies and move every angle (the reference
        # keeps them in float32), and to_empty() leaves them uninitialised: recompute them on
        # whatever device the module went to.
        super()._apply(fn, recurse)
        for layer_type, spec in self.specs.items():
            device = getattr(self, layer_type).device
            if device.type != "meta":
                setattr(self, layer_type, spec.inv_freq().to(device))
        return self

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {t: rope_cos_sin(getattr(self, t), positions, dtype) for t in self.specs}


def build_mask(
    query_slots: torch.Tensor,
    key_slots: torch.Tensor,
    key_valid: torch.Tensor,
    window: int | None,
    dtype,
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
    bidirectional: bool = False,
) -> torch.Tensor:
    """Additive mask (B, 1, T, S): 0 where a query may attend, the dtype's minimum elsewhere.

    Slots are absolute indices in the (padded) sequence. A query sees keys at or before it, within
    ``window`` keys including itself on sliding layers, and never padding keys. ``blocks`` =
    (query block ids (B, T), key block ids (B, S)): a query also sees later keys of its own block
    (id >= 0), still within the window's reach into the past. ``bidirectional`` (encoder models):
    every key on full layers, keys with |q - k| < window on sliding layers.
    """
    q, k = query_slots[:, None], key_slots[None, :]
    if bidirectional:
        allowed = (torch.ones_like(k <= q) if window is None else (q - k).abs() < window)[None]
    else:
        allowed = (k <= q)[None]  # (1, T, S)
        if blocks is not None:
            query_block, key_block = blocks
            same_block = (query_block[:, :, None] == key_block[:, None, :]) & (query_block[:, :, None] >= 0)
            allowed = allowed | same_block  # (B, T, S)
        if window is not None:
            allowed = allowed & (k > q - window)
    allowed = allowed & key_valid[:, None, :]  # (B, T, S)
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


class TextModel(nn.Module):
    """Embeddings, decoder layers and final norm; checkpoint prefix ``model.language_model.``."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.has_per_layer_inputs:
            n, p = config.num_hidden_layers, config.hidden_size_per_layer_input
            # One packed table: row = [layer 0's P values | layer 1's | ...].
            self.embed_tokens_per_layer = nn.Embedding(config.vocab_size_per_layer_input, n * p)
            self.per_layer_model_projection = nn.Linear(config.hidden_size, n * p, bias=False)
            self.per_layer_projection_norm = RMSNorm(p, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config, spec) for spec in config.layers)
        self.norm = text_norm(config, config.hidden_size)
        self.rotary = RotaryTables(config.rope)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight
        return self.embed_tokens(input_ids) * scale_in_dtype(self.config.hidden_size**0.5, weight.dtype)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """(B, T, L, P): the token's own per-layer vector plus a projection of its context embedding."""
        cfg = self.config
        shape = (*input_ids.shape, cfg.num_hidden_layers, cfg.hidden_size_per_layer_input)
        table = self.embed_tokens_per_layer
        token_part = table(input_ids) * scale_in_dtype(
            cfg.hidden_size_per_layer_input**0.5, table.weight.dtype
        )
        context = self.per_layer_model_projection(embeds) * cfg.hidden_size**-0.5
        context = self.per_layer_projection_norm(context.reshape(shape))
        return (context + token_part.reshape(shape)) * 2.0**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        keep_last: int = 0,
        *,
        inputs_embeds: torch.Tensor | None = None,
        vision_blocks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T) -> final hidden states (B, T', H), T' = keep_last or T.

        ``inputs_embeds`` (B, T, H) replaces ``embed(input_ids)`` (the multimodal model passes the
        embeddings with soft tokens scattered in); ``input_ids`` then only pick the per-layer
        embedding rows. ``vision_blocks`` (B, T): image-block ids (-1 = none) of this call's tokens;
        sliding layers let the tokens of one block attend to each other in both directions.
        """
        cfg = self.config
        batch, length = input_ids.shape
        device = input_ids.device
        valid = (
            torch.ones(batch, length, dtype=torch.bool, device=device)
            if attention_mask is None
            else attention_mask.to(device=device, dtype=torch.bool)
        )
        if valid.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(valid.shape)}, input_ids {tuple(input_ids.shape)}"
            )

        # Positions count real tokens only (left padding gets position 0), as generate() does.
        first_position = 0 if cache is None else cache.next_position[:, None]
        positions = (first_position + valid.long().cumsum(-1) - 1).masked_fill(~valid, 0)

        start = 0 if cache is None else cache.length
        if cache is not None:
            if cfg.bidirectional:
                raise ValueError(
                    "a bidirectional (encoder) model attends to later tokens: it cannot use a KV cache"
                )
            if cache.batch_size != batch:
                raise ValueError(
                    f"cache was made for batch size {cache.batch_size}, got input of batch {batch}"
                )
            if start + length > cache.max_len:
                raise ValueError(
                    f"cache holds {cache.max_len} tokens; {start} are used and this call adds {length}"
                )
            cache.key_valid[:, start : start + length] = valid
            key_valid = cache.key_valid
        else:
            key_valid = valid

        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        per_layer_inputs = self.per_layer_inputs(input_ids, x) if cfg.has_per_layer_inputs else None

        dtype = x.dtype
        query_slots = torch.arange(start, start + length, device=device)
        rope = self.rotary(positions, dtype)
        if vision_blocks is not None:
            # Keys from earlier calls belong to no block: blocks are this call's tokens.
            block_of_slot = torch.full((batch, start + length), -1, dtype=torch.long, device=device)
            block_of_slot[:, start:] = vision_blocks.to(device)
        masks = {}
        for layer_type, first in ((t, cfg.layer_types.index(t)) for t in cfg.rope):
            spec = cfg.layers[first]
            if cache is None:
                key_slots = query_slots
            else:
                key_slots = cache.layers[first].key_slots(start, length, device)
            # Image blocks are bidirectional on sliding layers only; full layers stay causal.
            blocks = None
            if vision_blocks is not None and spec.is_sliding:
                blocks = (block_of_slot[:, start:], block_of_slot[:, key_slots])
            masks[layer_type] = build_mask(
                query_slots, key_slots, key_valid[:, key_slots], spec.window, dtype, blocks, cfg.bidirectional
            )

        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for spec, layer in zip(cfg.layers, self.layers):
            if spec.index == cfg.first_kv_shared_layer and 0 < keep_last < x.shape[1]:
                # KV-shared layers write no cache: only the kept positions need to go through them.
                x, per_layer_inputs = x[:, -keep_last:], _last(per_layer_inputs, keep_last)
                rope = {t: (c[:, -keep_last:], s[:, -keep_last:]) for t, (c, s) in rope.items()}
                masks = {t: m[:, :, -keep_last:] for t, m in masks.items()}
            cos, sin = rope[spec.attention_type]
            layer_cache = None if cache is None else cache.layers[spec.index]
            x = layer(
                x,
                None if per_layer_inputs is None else per_layer_inputs[:, :, spec.index],
                cos,
                sin,
                masks[spec.attention_type],
                shared_kv,
                layer_cache,
                start,
            )

        if cache is not None:
            cache.length = start + length
            cache.next_position += valid.sum(-1)
        x = x if keep_last <= 0 else x[:, -keep_last:]
        return self.norm(x)


def _last(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if t is None else t[:, -n:]

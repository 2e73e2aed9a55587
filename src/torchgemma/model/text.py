"""The Gemma 4 text decoder, in reading order; Gemma 3 and Gemma 3n are configs of the same decoder.

    token ids ─ embed_tokens·√H ─┬──────────────────────────────────────────────┐
                                 │ (E2B/E4B) per-layer inputs: token table + context projection
                                 ▼                                              ▼
    for each layer:  x + post_attn_norm(attention(input_norm(x)))         per_layer_inputs[:, :, i]
                     x + post_ffw_norm(MLP(pre_ffw_norm(x)) [+ experts])          │
                     (E2B/E4B) x + post_ple_norm(proj(gelu(gate(x)) · ple_i)) ◀───┘
                     x · layer_scalar
    final norm ─ tied LM head ─ tanh soft-cap ─ logits

Gemma 3n wraps the same layer in AltUp: the embedding is widened into several residual streams
(``altup_projections``); each layer predicts every stream from all of them, computes on one (the
active stream; LAuReL's low-rank residual beside its attention, the first layers' MLP gates
sparsified), corrects every stream by what that computation changed, and feeds the per-layer
input into the other streams; at the end the streams are projected back and averaged.

Per-layer differences (sliding/full geometry, KV role, MLP width and sparsity, MoE) come from
``LayerSpec``. Every numerics choice mirrors transformers 5.23 (``models/gemma4/modeling_gemma4.py``,
``models/gemma3n/modeling_gemma3n.py``) so that bf16 logits agree to the bit with its eager
attention, and with either of its experts implementations (``Experts``).

A forward call first lays out what its queries see (``TextModel.layout``: positions, RoPE tables,
one mask per attention type, where the cache puts the tokens), then runs the stack on that layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import CacheStep, FullLayerCache, KVCache, SlidingLayerCache
from ..config import LayerSpec, MediaVocabulary, RopeSpec, TextConfig
from .attention import ATTENTION, ATTENTION_BACKENDS, AttentionInputs, attend_apart
from .layers import GatedMLP, RMSNorm, apply_rope, gelu_tanh, rope_cos_sin, rounded_scales
from .masks import attention_inputs, cached_keys, uncached_keys


def text_norm(config: TextConfig, dim: int) -> RMSNorm:
    """The decoder's RMSNorm with a weight, in the variant of the model's generation."""
    return RMSNorm(dim, config.rms_norm_eps, plus_one=config.norm_plus_one)


class Embedding(nn.Embedding):
    """A token table; the tied LM head reads it as a linear layer (``as_linear``), so that a
    quantized table (``torchgemma.quantize``) can serve both uses."""

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _embedding(rows: int, dim: int) -> Embedding:
    """An embedding table left uninitialised: its values always come from a checkpoint, and
    nn.Embedding's random init (normal_) on the meta device imports torch._dynamo (2.4 s)."""
    return Embedding(rows, dim, _weight=torch.empty(rows, dim))


class MediaTokenEmbedder(nn.Module):
    """Gemma 3n: the ids of a tower's own vocabulary, embedded from the tower embedder's table:
    ``post_norm(projection(hard_norm(embedding[id - offset])))``, the last norm without a scale.

    Checkpoint prefix ``model.embed_vision.`` / ``model.embed_audio.``. A built tower's soft tokens
    (the audio conformer's) go through ``soft``: ``post_norm(projection(soft_norm(x)))``; the vision
    tower is not built, its ``soft_embedding_norm`` not loaded.
    """

    def __init__(self, vocab: MediaVocabulary, text_hidden_size: int):
        super().__init__()
        self.vocab = vocab
        self.embedding = _embedding(vocab.size, vocab.hidden_size)
        self.hard_embedding_norm = RMSNorm(vocab.hidden_size, vocab.rms_norm_eps)
        if vocab.soft_tokens:
            self.soft_embedding_norm = RMSNorm(vocab.hidden_size, vocab.rms_norm_eps)
        self.embedding_projection = nn.Linear(vocab.hidden_size, text_hidden_size, bias=False)
        self.embedding_post_projection_norm = RMSNorm(text_hidden_size, vocab.rms_norm_eps, with_scale=False)

    def forward(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """``embeds`` (B, T, H) with the rows of this vocabulary's ids replaced by its embeddings."""
        vocab = self.vocab
        mine = input_ids >= vocab.offset
        if vocab.end is not None:
            mine &= input_ids < vocab.end
        # Every position is embedded (others as the table's last row), then selected, as the
        # reference: a row's bits can depend on how many rows share the projection.
        rows = torch.where(mine, input_ids - vocab.offset, vocab.size - 1)
        return torch.where(mine[..., None], self.hard(rows).to(embeds.dtype), embeds)

    def hard(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of the table (ids less the offset) in the text width."""
        x = self.embedding_projection(self.hard_embedding_norm(self.embedding(rows)))
        return self.embedding_post_projection_norm(x)

    def soft(self, x: torch.Tensor) -> torch.Tensor:
        """A tower's soft tokens (..., D) in the text width."""
        return self.embedding_post_projection_norm(self.embedding_projection(self.soft_embedding_norm(x)))


# ── rotary tables and attention ──────────────────────────────────────────────────────────────


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
        return {t: rope_cos_sin(self._table(t, dtype), positions, dtype) for t in self.specs}

    def _table(self, layer_type: str, dtype: torch.dtype) -> torch.Tensor:
        table = getattr(self, layer_type)
        if dtype != torch.float64:
            return table
        # A float64 model: frequencies computed in float64 (a few hundred values, per call).
        return self.specs[layer_type].inv_freq(torch.float64).to(table.device)


class Attention(nn.Module):
    # How queries and keys are rotated, and what each backend name runs (acceleration.fuse_cpu_ops
    # swaps in C++ calls for RoPE and for one new token's attention).
    rope = staticmethod(apply_rope)
    backends = ATTENTION

    def __init__(self, config: TextConfig, spec: LayerSpec, backend: str):
        super().__init__()
        self.spec = spec
        self.backend = backend
        hidden, heads, dim = config.hidden_size, config.num_attention_heads, spec.head_dim
        self.q_proj = nn.Linear(hidden, heads * dim, bias=False)
        self.q_norm = text_norm(config, dim)
        # Gemma 4 uses scale 1 (the QK norms replace 1/√D); Gemma 3 scales by query_pre_attn_scalar^-½.
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
        inputs: AttentionInputs,
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
        cache: FullLayerCache | SlidingLayerCache | None,
        step: CacheStep | None,
    ) -> torch.Tensor:
        spec = self.spec
        batch, length, _ = x.shape
        query = self.q_norm(self.q_proj(x).view(batch, length, -1, spec.head_dim))
        query = self.rope(query, inputs.cos, inputs.sin).transpose(1, 2)  # (B, H, T, D)

        if spec.kv_role == "reuse":
            # Exactly the keys/values (and so the mask) the source layer attended to in this pass.
            key, value = shared_kv[spec.kv_source]
        else:
            key = self.k_proj(x).view(batch, length, -1, spec.head_dim)
            # K=V: values are the raw key projection, before k_norm and RoPE.
            value = key if self.v_proj is None else self.v_proj(x).view(batch, length, -1, spec.head_dim)
            key = self.rope(self.k_norm(key), inputs.cos, inputs.sin).transpose(1, 2)  # (B, Hkv, T, D)
            if self.v_norm is not None:
                value = self.v_norm(value)
            value = value.transpose(1, 2)
            if cache is not None:
                # Backends that read rings in place take a decode step's sliding keys where they lie.
                in_place = getattr(self.backends[self.backend], "reads_rings", False)
                key, value = cache.update(key, value, step, in_place)
            if spec.kv_role == "store":
                shared_kv[spec.index] = (key, value)

        backend = self.backends[self.backend]
        if inputs.queries is None:
            out = backend(query, key, value, inputs, self.scale)  # (B, T, H, D)
        else:
            out = attend_apart(backend, query, key, value, inputs, self.scale)
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
        probs = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        weights, experts = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


def expert_linear(stack, expert: int, x: torch.Tensor) -> torch.Tensor:
    """``x @ stack[expert].T`` for a stack of expert weights (E, N, K), or a quantized stack
    (``torchgemma.quantize``), which multiplies without dequantizing."""
    if isinstance(stack, torch.Tensor):
        return F.linear(x, stack[expert])
    return stack.linear(expert, x)


# How a token's K expert outputs are combined, named as transformers names its experts
# implementations (``experts_implementation``); the first is the default, as in transformers.
EXPERTS = ("grouped_mm", "eager")


def check_experts(implementation: str) -> str:
    if implementation not in EXPERTS:
        raise ValueError(
            f"unknown experts implementation {implementation!r}; use one of {', '.join(EXPERTS)}"
        )
    return implementation


def _per_expert(stack, runs: list[tuple[int, int]], rows: torch.Tensor) -> torch.Tensor:
    """rows (S, K) sorted by expert, ``runs`` (expert, first row) of each expert's run -> each run
    times its expert's weight, (S, N)."""
    ends = [start for _, start in runs[1:]] + [rows.shape[0]]
    return torch.cat([expert_linear(stack, e, rows[a:b]) for (e, a), b in zip(runs, ends)])


class Experts(nn.Module):
    """All experts' GeGLU weights as stacked tensors: gate_up_proj (E, 2I, H), gate rows first.

    ``implementation`` says how a token's K weighted expert outputs are summed, as transformers'
    implementations of the same name do (each expert's product is the same in both):

    * ``"grouped_mm"`` (transformers' default, ``integrations/moe.py``): each output times its
      routing weight kept in float32, the K summed in float32 in routing order (``sum`` over the
      slot dimension, as transformers), rounded to the model dtype once;
    * ``"eager"`` (the experts module's own forward): each weighted output rounded to the model
      dtype and added into the result expert by expert, in ascending expert id.

    In bf16 the two differ by a few units in the last place of the sum, enough to part logits.

    Two ways to each sum: ``grouped`` (tokens gathered per expert, one product per expert with all
    its rows, as transformers; data-dependent shapes) and ``gathered`` (each token's K experts'
    weights gathered; static shapes, what a compiled decode step traces). They make the same
    products row by row and sum in the same order, so they agree to the bit in bf16.
    """

    def __init__(self, config: TextConfig, implementation: str = EXPERTS[0]):
        super().__init__()
        e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.implementation = check_experts(implementation)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x (N, H), weights/experts (N, K) -> (N, H)."""
        if torch.compiler.is_compiling():
            return self.gathered(x, weights, experts)
        return self.grouped(x, weights, experts)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """One product per expert over all the rows routed to it, in ascending expert id, the rows
        in the order transformers gives them (a float32 product's bits can depend on a row's place
        in the call)."""
        if self.implementation == "eager":
            out = torch.zeros_like(x)
            for expert in torch.unique(experts).tolist():
                # Rows in (slot, token) order: the order transformers' eager experts gather them in.
                slot, token = torch.where(expert == experts.T)
                gate, up = expert_linear(self.gate_up_proj, expert, x[token]).chunk(2, dim=-1)
                y = expert_linear(self.down_proj, expert, gelu_tanh(gate) * up)
                y = y * weights[token, slot, None]
                out.index_add_(0, token, y.to(out.dtype))
            return out
        # transformers' grouped_mm_experts_forward: the (token, slot) pairs sorted by expert with
        # torch.sort (the same sort, so equal ids keep the same order), one product per expert's
        # run of rows (what torch's grouped_mm does on the CPU), the weighted rows put back in
        # (token, slot) order and summed over the slots.
        n, k = experts.shape
        sorted_experts, order = torch.sort(experts.reshape(-1))
        rows = x[order // k]
        ids, counts = torch.unique_consecutive(sorted_experts, return_counts=True)
        runs = list(zip(ids.tolist(), [0, *torch.cumsum(counts, 0).tolist()]))
        gate, up = _per_expert(self.gate_up_proj, runs, rows).chunk(2, dim=-1)
        y = _per_expert(self.down_proj, runs, gelu_tanh(gate) * up)
        weighted = torch.empty_like(y, dtype=torch.promote_types(y.dtype, weights.dtype))
        weighted[order] = y * weights.reshape(-1)[order, None]
        return weighted.view(n, k, -1).sum(dim=1).to(x.dtype)

    def gathered(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Slot by slot: (N, K) weight gathers, no host sync. Reads K expert matrices per token:
        meant for decode-sized N."""
        eager = self.implementation == "eager"
        if eager:  # summed in ascending expert id, as the eager experts' loop
            experts, order = experts.sort(dim=-1)
            weights = weights.gather(-1, order)
        out = torch.zeros_like(x)
        weighted = []
        for slot in range(experts.shape[1]):
            chosen = experts[:, slot]
            gate_up = torch.bmm(x[:, None], self.gate_up_proj[chosen].transpose(1, 2))[:, 0]  # (N, 2I)
            gate, up = gate_up.chunk(2, dim=-1)
            y = torch.bmm((gelu_tanh(gate) * up)[:, None], self.down_proj[chosen].transpose(1, 2))[:, 0]
            if eager:
                out = out + (y * weights[:, slot, None]).to(out.dtype)
            else:
                weighted.append(y * weights[:, slot, None])
        # grouped_mm: the same (N, K, H) sum over the slots as ``grouped`` (inductor compiles
        # without floating-point contraction: the products stay rounded before the sum).
        return out if eager else torch.stack(weighted, dim=1).sum(dim=1).to(x.dtype)


# ── AltUp and LAuReL (Gemma 3n) ────────────────────────────────────────────────────────────────


class AltUp(nn.Module):
    """Alternating updates: N residual streams (N, B, T, H), of which a layer computes on one.

    ``predict`` mixes the streams into each stream's prediction with coefficients a router picks
    per token from the active stream; ``correct`` adds to each prediction the active stream's
    innovation (what the layer changed), weighted per token. The reference clips the coefficient
    weights (altup_coef_clip) only while training.
    """

    def __init__(self, config: TextConfig):
        super().__init__()
        n, hidden = config.altup_num_inputs, config.hidden_size
        self.active = config.altup_active_idx
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden))
        self.correction_coefs = nn.Linear(n, n, bias=False)
        self.prediction_coefs = nn.Linear(n, n * n, bias=False)
        self.modality_router = nn.Linear(hidden, n, bias=False)
        self.router_norm = text_norm(config, hidden)
        self.router_input_scale = rounded_scales(hidden**-1.0)

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, N) in [-1, 1]; tanh in float32 as the reference (float64 stays)."""
        routed = self.modality_router(self.router_norm(x) * self.router_input_scale[x.dtype])
        return torch.tanh(routed.to(torch.promote_types(routed.dtype, torch.float32))).type_as(x)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """(N, B, T, H): each stream plus a per-token mix of all of them."""
        n = streams.shape[0]
        modalities = self.route(streams[self.active])
        # coefs[b, t, j, i]: how much stream j contributes to stream i's prediction.
        coefs = self.prediction_coefs(modalities).reshape(*modalities.shape[:-1], n, n).permute(0, 1, 3, 2)
        predictions = torch.matmul(streams.permute(1, 2, 3, 0), coefs).permute(3, 0, 1, 2)
        predictions += streams
        return predictions.contiguous()

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """(N, B, T, H): each prediction plus the active stream's innovation, weighted per token."""
        modalities = self.route(activated)
        innovation = activated - predictions[self.active]  # (B, T, H), broadcast over the N streams
        coefs = self.correction_coefs(modalities) + 1.0
        corrected = innovation * coefs.permute(2, 0, 1).unsqueeze(-1)  # coefs (N, B, T, 1)
        corrected += predictions
        return corrected


def _rescaled(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """AltUp: ``y`` scaled to the RMS ``target`` (its own RMS floored at sqrt(1e-5))."""
    return y * target / torch.sqrt(torch.mean(y**2, dim=-1, keepdim=True).clamp(min=1e-5))


class Laurel(nn.Module):
    """Learned augmented residual layer: ``x + norm(right(left(x)))`` through a rank-r bottleneck."""

    def __init__(self, config: TextConfig):
        super().__init__()
        hidden, rank = config.hidden_size, config.laurel_rank
        self.linear_left = nn.Linear(hidden, rank, bias=False)
        self.linear_right = nn.Linear(rank, hidden, bias=False)
        self.post_laurel_norm = text_norm(config, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


# ── decoder layer ─────────────────────────────────────────────────────────────────────────────


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, spec: LayerSpec, attention: str, experts: str = EXPERTS[0]):
        super().__init__()
        self.spec = spec
        hidden = config.hidden_size
        self.input_layernorm = text_norm(config, hidden)
        self.self_attn = Attention(config, spec, attention)
        self.post_attention_layernorm = text_norm(config, hidden)
        self.pre_feedforward_layernorm = text_norm(config, hidden)
        self.mlp = GatedMLP(hidden, spec.intermediate_size, spec.activation_sparsity)
        self.post_feedforward_layernorm = text_norm(config, hidden)
        if spec.moe:
            # The dense MLP above runs beside the experts; each branch has its own norms.
            self.router = Router(config)
            self.experts = Experts(config, experts)
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
        self.altup = AltUp(config) if config.has_altup else None
        self.altup_correct_scale = config.altup_correct_scale
        self.laurel = Laurel(config) if config.laurel_rank else None

    def forward(
        self,
        x: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        inputs: AttentionInputs,
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
        cache: FullLayerCache | SlidingLayerCache | None,
        step: CacheStep | None,
    ) -> torch.Tensor:
        """x (B, T, H) -> (B, T, H); with AltUp the streams, (N, B, T, H) -> (N, B, T, H)."""
        if self.altup is not None:
            streams = self.altup.predict(x)
            x = streams[self.altup.active]

        normed = self.input_layernorm(x)
        attn = self.post_attention_layernorm(self.self_attn(normed, inputs, shared_kv, cache, step))
        if self.laurel is not None:
            # LAuReL's residual joins attention's, and the sum is scaled back by 1/√2.
            x = (x + attn + self.laurel(normed)) / math.sqrt(2)
        else:
            x = x + attn

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

        if self.altup is not None:
            streams = self.altup.correct(streams, x)
            # (A view: the update below is computed from it before the streams change in place.)
            active = streams[self.altup.active]
            if self.altup_correct_scale:
                active = active * self.altup.correct_output_scale
            # The per-layer input reaches the streams from 1 on (the reference's indices), not x.
            streams[1:] += self.per_layer_update(active, per_layer_input)
            return streams
        if per_layer_input is not None:
            x = x + self.per_layer_update(x, per_layer_input)
        return x * self.layer_scalar if hasattr(self, "layer_scalar") else x

    def per_layer_update(self, x: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        """PLE: this layer's per-layer input (B, T, P), gated by x and projected to (B, T, H)."""
        gate = gelu_tanh(self.per_layer_input_gate(x)) * per_layer_input
        return self.post_per_layer_input_norm(self.per_layer_projection(gate))


# ── the stack ─────────────────────────────────────────────────────────────────────────────────


class TextModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head; checkpoint prefix ``model.language_model.``.

    ``attention`` picks the attention backend of every layer: ``"sdpa"`` (the default, fast,
    bounded memory) or ``"eager"`` (the reference's own arithmetic; the parity tests use it).
    ``experts`` (a mixture of experts) how each token's expert outputs are summed, as transformers'
    implementation of that name: ``"grouped_mm"`` (its default) or ``"eager"`` (see ``Experts``).
    """

    def __init__(self, config: TextConfig, attention: str = "sdpa", experts: str = EXPERTS[0]):
        super().__init__()
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {attention!r}; use one of {', '.join(ATTENTION_BACKENDS)}"
            )
        self.config = config
        self._experts = check_experts(experts)
        hidden = config.hidden_size
        self.embed_tokens = _embedding(config.vocab_size, hidden)
        self.embed_scale = rounded_scales(hidden**0.5)
        for vocab in config.media_vocabularies:
            self.add_module(f"embed_{vocab.name}", MediaTokenEmbedder(vocab, hidden))
        if config.has_per_layer_inputs:
            n, p = config.num_hidden_layers, config.hidden_size_per_layer_input
            if config.ple_token_table:  # one packed table: row = [layer 0's P values | layer 1's | ...]
                self.embed_tokens_per_layer = _embedding(config.vocab_size_per_layer_input, n * p)
                self.per_layer_embed_scale = rounded_scales(p**0.5)
            self.per_layer_model_projection = nn.Linear(hidden, n * p, bias=False)
            self.per_layer_projection_norm = RMSNorm(p, config.rms_norm_eps)
            # H^-1/2 on the context projection and 2^-1/2 on the sum: Python floats in Gemma 4, tensors
            # of the model dtype in Gemma 3n (its float32 rsqrt(2) is float32(2^-1/2)).
            rounded = config.ple_scales_in_model_dtype
            self.per_layer_context_scale = rounded_scales(hidden**-0.5, rounded)
            self.per_layer_sum_scale = rounded_scales(2.0**-0.5, rounded)
        if config.has_altup:
            # The embedding is widened into N streams, and the N streams merged back at the end.
            n = config.altup_num_inputs
            self.altup_projections = nn.ModuleList(
                nn.Linear(hidden, hidden, bias=False) for _ in range(n - 1)
            )
            self.altup_unembed_projections = nn.ModuleList(
                nn.Linear(hidden, hidden, bias=False) for _ in range(n - 1)
            )
        self.layers = nn.ModuleList(DecoderLayer(config, spec, attention, experts) for spec in config.layers)
        self.norm = text_norm(config, config.hidden_size)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryTables(config.rope)
        if config.embedding_dim:  # EmbeddingGemma 2: the sentence states' width
            self.embedding_projection = nn.Linear(hidden, config.embedding_dim, bias=False)

    @property
    def attention(self) -> str:
        return self.layers[0].self_attn.backend

    @property
    def experts(self) -> str:
        """How a mixture of experts sums each token's expert outputs: ``"grouped_mm"`` or
        ``"eager"`` (recorded for a dense model too, where it changes nothing)."""
        return self._experts

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the decoder computes in (its norms' weights: never quantized)."""
        return self.norm.weight.dtype

    def set_attention(self, backend: str) -> None:
        """Switch every layer to another attention backend (``"eager"`` or ``"sdpa"``)."""
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {backend!r}; use one of {', '.join(ATTENTION_BACKENDS)}"
            )
        for layer in self.layers:
            layer.self_attn.backend = backend

    def set_experts(self, implementation: str) -> None:
        """Switch every mixture of experts to another implementation (``"grouped_mm"`` or ``"eager"``)."""
        self._experts = check_experts(implementation)
        for layer in self.layers:
            if layer.spec.moe:
                layer.experts.implementation = implementation

    # ── embeddings and head ──────────────────────────────────────────────────────────────────

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale[self.dtype]
        for vocab in self.config.media_vocabularies:  # Gemma 3n: the towers' token ids
            x = getattr(self, f"embed_{vocab.name}")(input_ids, x)
        return x

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """(B, T, L, P): the token's own per-layer vector plus a projection of its context embedding
        (EmbeddingGemma 2: the projection alone)."""
        cfg = self.config
        shape = (*input_ids.shape, cfg.num_hidden_layers, cfg.hidden_size_per_layer_input)
        context = self.per_layer_model_projection(embeds) * self.per_layer_context_scale[self.dtype]
        context = self.per_layer_projection_norm(context.reshape(shape))
        if not cfg.ple_token_table:
            return context
        table = self.embed_tokens_per_layer
        # Ids beyond the table (Gemma 3n's media ids) read row 0, as in the reference.
        input_ids = torch.where(input_ids < table.num_embeddings, input_ids, 0)
        token_part = table(input_ids) * self.per_layer_embed_scale[self.dtype]
        return (context + token_part.reshape(shape)) * self.per_layer_sum_scale[self.dtype]

    def altup_streams(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> AltUp's (N, B, T, H): x, and its projections rescaled to x's RMS."""
        target = torch.mean(x**2, dim=-1, keepdim=True) ** 0.5
        return torch.stack([x] + [_rescaled(projection(x), target) for projection in self.altup_projections])

    def altup_merge(self, streams: torch.Tensor) -> torch.Tensor:
        """(N, B, T, H) -> (B, T, H): the mean of stream 0 and the others' projections back,
        each rescaled to stream 0's RMS."""
        target = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
        projected = zip(streams[1:], self.altup_unembed_projections)
        merged = [streams[0]] + [_rescaled(projection(stream), target) for stream, projection in projected]
        return torch.mean(torch.stack(merged), dim=0)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head (tied to the embeddings unless the checkpoint has its own), soft-cap."""
        return self.logits(self.norm(hidden))

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head on final-normed hidden states, soft-capped."""
        tied = self.config.tie_word_embeddings
        return self._softcap(self.embed_tokens.as_linear(normed) if tied else self.lm_head(normed))

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def greedy(self, normed: torch.Tensor) -> torch.Tensor:
        """(M, H) final-normed hidden states -> (M,) the greedy tokens: ``logits(normed).float()``'s
        argmax, exactly. A quantized head finds it without computing every logit exactly
        (``QuantizedWeight.argmax``); any other head computes the logits."""
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        argmax = getattr(head, "argmax", None)
        if argmax is None:
            return self.logits(normed).float().argmax(-1)
        if normed.dtype == torch.float32 and self.config.final_logit_softcapping is None:
            return argmax(normed)  # the logits are the product itself
        return argmax(normed, lambda values: self._softcap(values.to(normed.dtype)).float())

    # ── forward ──────────────────────────────────────────────────────────────────────────────

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        keep_last: int = 0,
        *,
        slots: list[int] | None = None,
        inputs_embeds: torch.Tensor | None = None,
        vision_blocks: torch.Tensor | None = None,
        head: bool = True,
        apart: bool = False,
    ) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T', vocab), T' = keep_last or T.

        With a ``cache``, row ``b`` appends its real tokens to slot ``slots[b]`` (default: slot
        ``b``). ``inputs_embeds`` (B, T, H) replaces ``embed(input_ids)`` (the multimodal model
        passes the embeddings with soft tokens scattered in); ``input_ids`` then only pick the
        per-layer embedding rows. ``vision_blocks`` (B, T): image-block ids (-1 = none) of this
        call's tokens; sliding layers let the tokens of one block attend to each other both ways.
        ``head=False`` returns the final-normed hidden states (B, T', H) instead of logits: what
        transformers' text models return as ``last_hidden_state`` (sentence embeddings pool them;
        EmbeddingGemma 2's are projected to ``embedding_dim``).
        ``apart`` (with a cache): each query attends as a one-token call at its position would
        (``CacheStep.apart``: a speculative verify pass).
        """
        batch, length = input_ids.shape
        valid = None
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}"
                )
            valid = attention_mask.to(device=input_ids.device, dtype=torch.bool)
        step = None
        if cache is not None:
            if self.config.bidirectional:
                raise ValueError(
                    "a bidirectional (encoder) model attends to later tokens: it cannot use a KV cache"
                )
            if slots is None:
                if batch > cache.num_slots:
                    raise ValueError(
                        f"cache was made for batch size {cache.num_slots}, got input of batch {batch}"
                    )
                slots = list(range(batch))
            elif len(slots) != batch:
                raise ValueError(f"{len(slots)} slots given for {batch} rows")
            step = cache.step(slots, length, valid, apart)
        layout = self.layout(input_ids, valid, cache, step, vision_blocks)
        logits = self.run(input_ids, layout, cache, step, keep_last, inputs_embeds, head)
        if cache is not None:
            cache.commit(step)
        return logits

    def decode(
        self, input_ids: torch.Tensor, cache: KVCache, positions: torch.Tensor, active: torch.Tensor
    ) -> torch.Tensor:
        """One token for every slot of ``cache`` with static shapes: (S, 1) -> logits (S, 1, vocab).

        ``positions`` (S,) are the slots' lengths, ``active`` (S,) the slots that really decode;
        the caller records the new lengths (``cache.advance``). No host sync, no data-dependent shape.
        """
        step = cache.decode_step(positions, active)
        layout = self.layout(input_ids, None, cache, step, None)
        return self.run(input_ids, layout, cache, step)

    def run(
        self,
        input_ids: torch.Tensor,
        layout: dict[str, AttentionInputs],
        cache: KVCache | None,
        step: CacheStep | None,
        keep_last: int = 0,
        inputs_embeds: torch.Tensor | None = None,
        head: bool = True,
    ) -> torch.Tensor:
        """The stack on a laid-out call: embeddings, layers, head (or only the final norm)."""
        cfg = self.config
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        per_layer_inputs = self.per_layer_inputs(input_ids, x) if cfg.has_per_layer_inputs else None
        if cfg.has_altup:
            x = self.altup_streams(x)  # (N, B, T, H)
        # KV-shared layers write no cache: only the kept positions need to go through them. Without
        # a mask the kept queries must be one (a causal block's last query sees every key).
        trim = (
            cfg.trim_kv_shared_layers
            and 0 < keep_last < x.shape[-2]
            and (keep_last == 1 or all(inputs.mask is not None for inputs in layout.values()))
        )
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for spec, layer in zip(cfg.layers, self.layers):
            if trim and spec.index == cfg.first_kv_shared_layer:
                x = x[..., -keep_last:, :]
                per_layer_inputs = None if per_layer_inputs is None else per_layer_inputs[:, -keep_last:]
                layout = {t: inputs.last(keep_last) for t, inputs in layout.items()}
            x = layer(
                x,
                None if per_layer_inputs is None else per_layer_inputs[:, :, spec.index],
                layout[spec.attention_type],
                shared_kv,
                None if cache is None else cache.layers[spec.index],
                step,
            )
        if cfg.has_altup:
            x = self.altup_merge(x)
        x = x if keep_last <= 0 else x[:, -keep_last:]
        if head:
            return self.head(x)
        x = self.norm(x)
        return self.embedding_projection(x) if cfg.embedding_dim else x

    # ── layout: positions, RoPE, masks ───────────────────────────────────────────────────────

    def layout(
        self,
        input_ids: torch.Tensor,
        valid: torch.Tensor | None,
        cache: KVCache | None,
        step: CacheStep | None,
        vision_blocks: torch.Tensor | None,
    ) -> dict[str, AttentionInputs]:
        """What the queries of each attention type see: RoPE tables, mask, key ranges."""
        cfg = self.config
        batch, length = input_ids.shape
        device = input_ids.device
        dtype = self.dtype
        if step is None:
            # Positions count real tokens only (left padding gets position 0), as generate() does.
            positions = torch.arange(length, device=device)[None].expand(batch, length)
            if valid is not None:
                positions = (valid.long().cumsum(-1) - 1).masked_fill(~valid, 0)
        else:
            positions = step.positions
        rope = self.rotary(positions, dtype)
        if vision_blocks is not None:
            vision_blocks = vision_blocks.to(device)
        layout = {}
        for layer_type in cfg.rope:
            spec = cfg.layers[cfg.layer_types.index(layer_type)]
            # gemma4 applies image blocks on sliding layers only; gemma4_unified and gemma3 on all.
            block_layers = cfg.vision_block_layers
            if step is None:
                keys = uncached_keys(
                    length, valid, spec.window, vision_blocks, cfg.bidirectional, device, block_layers
                )
            else:
                keys = cached_keys(cache, step, spec.window, vision_blocks, device, block_layers)
            cos, sin = rope[layer_type]
            layout[layer_type] = attention_inputs(keys, cos, sin, self.attention, dtype)
        return layout

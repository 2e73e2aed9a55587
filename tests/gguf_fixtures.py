"""Tiny GGUF files, written the way llama.cpp's converter writes Gemma 3 and Gemma 4 checkpoints.

The source is a tiny random transformers model (every parameter randomised, norms and scalars
included, so that an un-undone `1 + w` or a swapped tensor shows). `write_gguf` plays the part of
llama.cpp's `convert_hf_to_gguf.py`, written from its conventions and independently of
`torchgemma.weights.gguf`: its own name table, GGUF metadata keys, Gemma 3 norms stored as `1 + w`,
Gemma 4's router/per-expert scales and layer scalar under llama.cpp's names, the `rope_freqs` tensor,
and every matrix quantized. It returns what each Hugging Face tensor must read back as: the values
written, dequantized by `gguf.quants`, with the `1 + w` removed.

Row lengths that are a multiple of 256 take the k-quants (random blocks: the gguf package cannot
quantize to them); the others cycle through the 32-wide block types, quantized with
`gguf.quants.quantize`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, TokenType
from gguf.quants import dequantize, quantize

from tokenizer_fixtures import gemma4_vocab, special_token_list

SLIDING, FULL = "sliding_attention", "full_attention"
# The fixture vocabulary's whitespace tokens that Gemma keeps as plain added tokens.
PLAIN_ADDED = ("\n", "\n\n")

TYPES_32 = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.F16, T.BF16)
TYPES_256 = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
K_TYPES = frozenset(TYPES_256)

GEMMA4_COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    head_dim=16,
    global_head_dim=32,
    sliding_window=7,
    final_logit_softcapping=30.0,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=[1, 106, 50],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
        },
    },
)

GEMMA4_STYLES: dict[str, dict] = {
    # E2B-like: 3:1 pattern, one KV head, PLE (8 layers x 32 = 256 wide), KV sharing of both layer
    # types, double-wide MLP on the shared layers (128 -> 256, so their down_proj takes k-quants).
    "e2b": dict(
        num_hidden_layers=8,
        layer_types=([SLIDING] * 3 + [FULL]) * 2,
        num_key_value_heads=1,
        intermediate_size=128,
        num_kv_shared_layers=3,
        hidden_size_per_layer_input=32,
        vocab_size_per_layer_input=1024,
        use_double_wide_mlp=True,
    ),
    # E4B-like: 2:1 pattern, two KV heads, PLE, KV sharing, normal-width MLP; every count is one
    # value, which is the only Gemma 4 layout transformers' own GGUF config reader accepts.
    "e4b": dict(
        num_hidden_layers=6,
        layer_types=[SLIDING, SLIDING, FULL] * 2,
        num_key_value_heads=2,
        intermediate_size=96,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=1024,
    ),
    # 26B-A4B-like: routed experts beside the dense MLP, K=V full layers with their own KV-head count.
    "26b": dict(
        num_hidden_layers=6,
        layer_types=[SLIDING, SLIDING, FULL] * 2,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        intermediate_size=96,
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=256,
    ),
    # 31B-like: dense, K=V, 5:1 pattern, no PLE.
    "31b": dict(
        num_hidden_layers=6,
        layer_types=[SLIDING] * 5 + [FULL],
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        intermediate_size=256,
        hidden_size_per_layer_input=0,
    ),
}

GEMMA3_CONFIG = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=7,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)

# HF -> llama.cpp names (gguf.tensor_mapping / the Gemma converters), written out for the tests.
_LAYER_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
    "layer_scalar": "layer_output_scale.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
}
_GLOBAL_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_TO_GGUF:
        return _GLOBAL_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_TO_GGUF[rest]}"


def random_model(model_type: str, overrides: dict, seed: int):
    """A tiny transformers model with every parameter and persistent buffer randomised."""
    import transformers

    torch.manual_seed(seed)
    if model_type == "gemma4_text":
        config = transformers.Gemma4TextConfig(**{**GEMMA4_COMMON, "vocab_size": 1024, **overrides})
        model = transformers.Gemma4ForCausalLM(config)
    else:
        config = transformers.Gemma3TextConfig(**{**GEMMA3_CONFIG, "vocab_size": 1024, **overrides})
        model = transformers.Gemma3ForCausalLM(config)
    model.gguf_source = {**(GEMMA4_COMMON if model_type == "gemma4_text" else GEMMA3_CONFIG), **overrides}
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                scale = 1.0 if tensor.dim() <= 1 else 1.0 / math.sqrt(tensor.shape[-1])
                tensor.copy_(torch.randn(tensor.shape, dtype=tensor.dtype) * scale)
    return model


def random_blocks(qtype: T, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of a k-quant (or any block type) with random quants and moderate fp16 scales."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    halves = {  # byte offsets of the fp16 scale fields in each block (ggml-common.h)
        T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
        T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    }[qtype]  # fmt: skip
    for offset in halves:
        scale = rng.uniform(0.002, 0.05, size=n_blocks) * rng.choice([-1, 1], size=n_blocks)
        raw[:, offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def _pack(value: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    if qtype == T.F32:
        return value.astype(np.float32)
    if qtype in K_TYPES:
        return random_blocks(qtype, value.shape, rng)
    return quantize(value.astype(np.float32), qtype)


def _stored(packed: np.ndarray, qtype: T) -> np.ndarray:
    return np.asarray(dequantize(packed, qtype), dtype=np.float32)


def write_gguf(
    path: Path,
    model,
    *,
    seed: int = 0,
    extra_shared_kv: bool = False,
    split_experts: bool = False,
    untied: bool = False,
    tokenizer: str = "auto",
    chat_template: str | None = None,
) -> dict[str, torch.Tensor]:
    """Write `model` as llama.cpp would, and return HF name -> the float32 values it must read back as.

    extra_shared_kv: also write k/v/k_norm for KV-shared layers (HF has none; a reader must drop them).
    split_experts: write ffn_gate_exps + ffn_up_exps instead of the merged ffn_gate_up_exps.
    untied: write an output.weight (HF lm_head), so the embeddings are not tied.
    """
    rng = np.random.default_rng(seed)
    config = model.config
    gemma4 = config.model_type == "gemma4_text"
    arch = "gemma4" if gemma4 else "gemma3"
    writer = GGUFWriter(str(path), arch)
    _write_metadata(writer, config, model.gguf_source, gemma4)
    _write_vocab(writer, gemma4 if tokenizer == "auto" else tokenizer == "gemma4", chat_template)

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight")
    if untied:
        state["lm_head.weight"] = (
            rng.standard_normal(state["model.embed_tokens.weight"].shape).astype(np.float32) / 8
        )
    n_layers = config.num_hidden_layers
    first_shared = n_layers - getattr(config, "num_kv_shared_layers", 0)
    if gemma4 and extra_shared_kv:
        for i in range(first_shared, n_layers):
            d, kv = config.per_layer_config[i].head_dim, config.per_layer_config[i].num_key_value_heads
            state[f"model.layers.{i}.self_attn.k_proj.weight"] = rng.standard_normal((kv * d, 64)).astype(
                np.float32
            )
            state[f"model.layers.{i}.self_attn.v_proj.weight"] = rng.standard_normal((kv * d, 64)).astype(
                np.float32
            )
            state[f"model.layers.{i}.self_attn.k_norm.weight"] = rng.standard_normal(d).astype(np.float32)

    expected: dict[str, torch.Tensor] = {}
    cycle_32 = cycle_256 = 0
    for hf_name, value in state.items():
        if value.ndim <= 1:
            qtype = T.F32  # llama.cpp keeps 1-D tensors (norms, scales) in F32
        elif value.shape[-1] % 32:
            qtype = T.F16  # rows too short for any block type: llama.cpp falls back to a float type
        elif value.shape[-1] % 256 == 0:
            qtype, cycle_256 = TYPES_256[cycle_256 % len(TYPES_256)], cycle_256 + 1
        else:
            qtype, cycle_32 = TYPES_32[cycle_32 % len(TYPES_32)], cycle_32 + 1
        if value.ndim == 0:
            value = value.reshape(1)
        norm = hf_name.endswith("norm.weight")
        if not gemma4 and norm:
            value = value + np.float32(1.0)  # Gemma3RMSNorm computes x * (1 + w): llama.cpp stores 1 + w
        name = gguf_name(hf_name)
        if split_experts and name.endswith("ffn_gate_up_exps.weight"):
            half = value.shape[1] // 2
            layer = name.split(".")[1]
            parts = []
            for part_name, part in (
                (f"blk.{layer}.ffn_gate_exps.weight", value[:, :half]),
                (f"blk.{layer}.ffn_up_exps.weight", value[:, half:]),
            ):
                packed = _pack(np.ascontiguousarray(part), qtype, rng)
                writer.add_tensor(part_name, packed, raw_dtype=qtype)
                parts.append(_stored(packed, qtype))
            stored = np.concatenate(parts, axis=1)
        else:
            packed = _pack(value, qtype, rng)
            writer.add_tensor(name, packed, raw_dtype=qtype)
            stored = _stored(packed, qtype)
        if not gemma4 and norm:
            stored = stored - np.float32(1.0)
        layer = int(hf_name.split(".")[2]) if hf_name.startswith("model.layers.") else -1
        if layer >= first_shared and hf_name.split(".")[-2] in ("k_proj", "v_proj", "k_norm"):
            continue  # written only to check that the reader drops them
        expected[hf_name] = torch.from_numpy(stored.reshape(value.shape).copy())
    if gemma4:
        # llama.cpp's encoding of proportional RoPE: factor 1 on rotated pairs, 1e30 on the others.
        rope = config.rope_parameters["full_attention"]
        global_head_dim = model.gguf_source["global_head_dim"]
        n_rot = int(global_head_dim * rope["partial_rotary_factor"] / 2)
        factors = [1.0] * n_rot + [1e30] * (global_head_dim // 2 - n_rot)
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _write_metadata(writer: GGUFWriter, config, source: dict, gemma4: bool) -> None:
    """The keys Gemma3Model / Gemma4Model.set_gguf_parameters write (convert_hf_to_gguf)."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_file_type(1)
    if not gemma4:
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        return
    swa = [t == SLIDING for t in config.layer_types]
    n_layers = config.num_hidden_layers
    first_shared = n_layers - config.num_kv_shared_layers
    if config.use_double_wide_mlp:
        writer.add_feed_forward_length(
            [config.intermediate_size * (1 if i < first_shared else 2) for i in range(n_layers)]
        )
    else:
        writer.add_feed_forward_length(config.intermediate_size)
    layers = [config.per_layer_config[i] for i in range(n_layers)]
    if source.get("num_global_key_value_heads") is not None:
        # The converter writes one count per layer when the config names a global KV-head count.
        writer.add_head_count_kv([layer.num_key_value_heads for layer in layers])
    else:
        writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input)
    writer.add_sliding_window_pattern(swa)
    global_head_dim = source["global_head_dim"]
    writer.add_key_length(global_head_dim)
    writer.add_value_length(global_head_dim)
    writer.add_key_length_swa(source["head_dim"])
    writer.add_value_length_swa(source["head_dim"])
    writer.add_rope_dimension_count(global_head_dim)
    writer.add_rope_dimension_count_swa(source["head_dim"])
    if config.enable_moe_block:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.top_k_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def vocab_tokens(gemma4: bool) -> tuple[list[str], list[int], list[str] | None]:
    """Tokens, llama.cpp token types and merges for the fixture vocabulary (1024 tokens).

    gemma4: what Gemma4Model.set_vocab writes from a tokenizer.json (tokens as spelled there,
    merges). Otherwise a SentencePiece-style listing as Gemma 3 files have: no merges, whitespace
    pieces with real spaces, and a user-defined tag.
    """
    vocab, merges = gemma4_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    specials = set(special_token_list())
    types = []
    for token in tokens:
        if token in specials:
            types.append(int(TokenType.CONTROL))
        elif token in PLAIN_ADDED:
            types.append(int(TokenType.USER_DEFINED))
        elif token.startswith("<0x") and len(token) == 6:
            types.append(int(TokenType.BYTE))
        elif token.startswith("<unused"):
            types.append(int(TokenType.CONTROL))
        else:
            types.append(int(TokenType.NORMAL))
    if gemma4:
        return tokens, types, [" ".join(m) for m in merges]
    # SentencePiece files: whitespace runs are user-defined pieces stored with spaces, and some
    # tags are user-defined too.
    for i, piece in zip(range(900, 906), ("  ", "   ", "    ", "\t", "<h1>", "</h1>")):
        tokens[i], types[i] = piece, int(TokenType.USER_DEFINED)
    return tokens, types, None


def _write_vocab(writer: GGUFWriter, gemma4: bool, chat_template: str | None) -> None:
    tokens, types, merges = vocab_tokens(gemma4)
    writer.add_tokenizer_model("gemma4" if gemma4 else "llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(
        [-1000.0 if t != int(TokenType.NORMAL) else -float(i) for i, t in enumerate(types)]
    )
    writer.add_token_types(types)
    if merges:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    if chat_template:
        writer.add_chat_template(chat_template)

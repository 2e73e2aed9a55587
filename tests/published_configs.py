"""The text configs of the four published Gemma 4 checkpoints, in the published field style.

From the reference notes (../shared/reference/gemma4-transformers-5.23.md §1.1: the official
conversion script's variants). Only config.json is needed: no weights.
"""

SLIDING, FULL = "sliding_attention", "full_attention"

_COMMON = dict(
    model_type="gemma4_text",
    vocab_size=262144,
    head_dim=256,
    global_head_dim=512,
    rms_norm_eps=1e-6,
    final_logit_softcapping=30.0,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    vocab_size_per_layer_input=262144,
    rope_parameters={
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
    dtype="bfloat16",
)

E2B = dict(
    _COMMON,
    num_hidden_layers=35,
    hidden_size=1536,
    intermediate_size=6144,
    num_attention_heads=8,
    num_key_value_heads=1,
    num_global_key_value_heads=None,
    layer_types=([SLIDING] * 4 + [FULL]) * 7,
    sliding_window=512,
    num_kv_shared_layers=20,
    hidden_size_per_layer_input=256,
    use_double_wide_mlp=True,
    attention_k_eq_v=False,
    max_position_embeddings=131072,
)

E4B = dict(
    E2B,
    num_hidden_layers=42,
    hidden_size=2560,
    intermediate_size=10240,
    num_key_value_heads=2,
    layer_types=([SLIDING] * 5 + [FULL]) * 7,
    num_kv_shared_layers=18,
    use_double_wide_mlp=False,
)

A26B = dict(
    _COMMON,
    num_hidden_layers=30,
    hidden_size=2816,
    intermediate_size=2112,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_global_key_value_heads=2,
    layer_types=([SLIDING] * 5 + [FULL]) * 5,
    sliding_window=1024,
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    attention_k_eq_v=True,
    enable_moe_block=True,
    num_experts=128,
    top_k_experts=8,
    moe_intermediate_size=704,
    use_bidirectional_attention="vision",
    max_position_embeddings=262144,
)

D31B = dict(
    _COMMON,
    num_hidden_layers=60,
    hidden_size=5376,
    intermediate_size=21504,
    num_attention_heads=32,
    num_key_value_heads=16,
    num_global_key_value_heads=4,
    layer_types=([SLIDING] * 5 + [FULL]) * 10,
    sliding_window=1024,
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    attention_k_eq_v=True,
    use_bidirectional_attention="vision",
    max_position_embeddings=262144,
)

PUBLISHED = {"e2b": E2B, "e4b": E4B, "26b-a4b": A26B, "31b": D31B}


def multimodal(text: dict) -> dict:
    """The same text config wrapped the way the published (gemma4) config.json wraps it."""
    text = {k: v for k, v in text.items() if k != "dtype"}
    return {
        "model_type": "gemma4",
        "text_config": dict(text, model_type="gemma4_text"),
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 768},
        "audio_config": None,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
    }


# google/embeddinggemma-300m: a bidirectional Gemma 3 text model (config.json), then sentence-transformers
# modules whose two Dense layers (768 -> 3072 -> 768, no bias, identity) are counted by info too.
# Google gives it as 308M parameters.
EMBEDDINGGEMMA_300M = dict(
    architectures=["Gemma3TextModel"],
    model_type="gemma3_text",
    _sliding_window_pattern=6,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    hidden_size=768,
    intermediate_size=1152,
    max_position_embeddings=2048,
    num_attention_heads=3,
    num_hidden_layers=24,
    num_key_value_heads=1,
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-06,
    rope_local_base_freq=10000.0,
    rope_theta=1000000.0,
    sliding_window=512,
    use_bidirectional_attention=True,
    vocab_size=262144,
)
EMBEDDINGGEMMA_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
    {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"},
]
EMBEDDINGGEMMA_DENSE = {
    "2_Dense": {"in_features": 768, "out_features": 3072, "bias": False,
                "activation_function": "torch.nn.modules.linear.Identity"},
    "3_Dense": {"in_features": 3072, "out_features": 768, "bias": False,
                "activation_function": "torch.nn.modules.linear.Identity"},
}  # fmt: skip

# Gemma 3n (google/gemma-3n-E2B / -E4B config.json, as published: the multimodal layout, RoPE in the
# older keys, one MLP width per layer, the first 10 layers' gates sparsified). The conversion
# defaults of transformers' Gemma3nTextConfig are E4B's; E2B has 30 layers, MLP 8192, 10 KV-shared.
_GEMMA3N_COMMON = dict(
    model_type="gemma3n_text",
    vocab_size=262400,
    vocab_size_per_layer_input=262144,
    hidden_size=2048,
    hidden_size_per_layer_input=256,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    sliding_window=512,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    final_logit_softcapping=30.0,
    hidden_activation="gelu_pytorch_tanh",
    rope_theta=1000000.0,
    rope_local_base_freq=10000.0,
    rope_scaling=None,
    query_pre_attn_scalar=256,
    laurel_rank=64,
    altup_num_inputs=4,
    altup_active_idx=0,
    altup_coef_clip=120.0,
    altup_correct_scale=True,
    altup_lr_multiplier=1.0,
    attention_bias=False,
    attention_dropout=0.0,
    torch_dtype="bfloat16",
)

GEMMA3N_E2B = dict(
    _GEMMA3N_COMMON,
    num_hidden_layers=30,
    intermediate_size=[8192] * 30,
    layer_types=([SLIDING] * 4 + [FULL]) * 6,
    num_kv_shared_layers=10,
    activation_sparsity_pattern=[0.95] * 10 + [0.0] * 20,
)

GEMMA3N_E4B = dict(
    _GEMMA3N_COMMON,
    num_hidden_layers=35,
    intermediate_size=[16384] * 35,
    layer_types=([SLIDING] * 4 + [FULL]) * 7,
    num_kv_shared_layers=15,
    activation_sparsity_pattern=[0.95] * 10 + [0.0] * 25,
)

GEMMA3N_PUBLISHED = {"e2b": GEMMA3N_E2B, "e4b": GEMMA3N_E4B}


def gemma3n_multimodal(text: dict) -> dict:
    """The same text config wrapped as the published (gemma3n) config.json wraps it."""
    return {
        "model_type": "gemma3n",
        "architectures": ["Gemma3nForConditionalGeneration"],
        "text_config": {k: v for k, v in text.items() if k != "torch_dtype"},
        "vision_config": {
            "model_type": "gemma3n_vision",
            "architecture": "mobilenetv5_300m_enc",
            "hidden_size": 2048,
            "vocab_size": 128,
            "vocab_offset": 262144,
            "rms_norm_eps": 1e-6,
        },
        "audio_config": {
            "model_type": "gemma3n_audio",
            "hidden_size": 1536,
            "vocab_size": 128,
            "vocab_offset": 262272,
            "rms_norm_eps": 1e-6,
            "conf_num_hidden_layers": 12,
            "conf_num_attention_heads": 8,
            "input_feat_size": 128,
            "sscp_conv_channel_size": [128, 32],
        },
        "audio_soft_tokens_per_image": 188,
        "vision_soft_tokens_per_image": 256,
        "boi_token_id": 255999,
        "eoi_token_id": 262144,
        "image_token_id": 262145,
        "boa_token_id": 256000,
        "eoa_token_id": 262272,
        "audio_token_id": 262273,
        "eos_token_id": [1, 106],
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }

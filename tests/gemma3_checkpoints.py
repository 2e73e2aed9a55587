"""Tiny random Gemma 3 text checkpoints (``gemma3_text``), saved by transformers, one per style."""

from __future__ import annotations

from pathlib import Path

from checkpoints import FULL, SLIDING, randomize_

COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=5,
    max_position_embeddings=4096,
)

GEMMA3_STYLES = {
    # 270M / 1B: 5:1 pattern, local 10k and global 1M RoPE, no soft-caps.
    "1b": dict(num_hidden_layers=6, num_key_value_heads=1, query_pre_attn_scalar=16),
    # 4B and up: linear RoPE scaling (factor 8) on the global layers; here also a final soft-cap and an
    # attention soft-cap, which transformers 5.23 reads but never applies (we match it).
    "4b": dict(
        num_hidden_layers=7,
        layer_types=[SLIDING, SLIDING, FULL] * 2 + [SLIDING],
        query_pre_attn_scalar=24,
        rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
        attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0,
    ),
    # EmbeddingGemma: bidirectional attention.
    "embedding": dict(num_hidden_layers=4, layer_types=[SLIDING, FULL] * 2, use_bidirectional_attention=True),
}


def gemma3_checkpoint(folder: Path, style: str, seed: int = 0) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**COMMON, **GEMMA3_STYLES[style]}))
    randomize_(model, seed)  # every norm weight away from 0 (Gemma 3 stores w, the scale is 1 + w)
    model.save_pretrained(folder)
    return folder


# Gemma 3 4B-27B (``gemma3``): the "4b" text model with a SigLIP tower of 6x6 patches pooled 2x2
# into 9 soft tokens per image (more than the sliding window, 5, so image blocks cross it).
TINY_SIGLIP = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=42,
    patch_size=7,
    layer_norm_eps=1e-6,
    vision_use_head=False,  # as Gemma 3's (test_gemma3_vision.py checks that a head is skipped)
)
TOKENS_PER_IMAGE = 9
# Media ids inside the 300-row table (as Gemma 3's 262,144 in its 262,208 rows).
GEMMA3_MEDIA_IDS = dict(boi_token_index=296, eoi_token_index=297, image_token_index=298)


def gemma3_vision_checkpoint(
    folder: Path, seed: int = 0, *, dtype=None, media_ids: dict | None = None, **text_changes
) -> Path:
    """A tiny ``Gemma3ForConditionalGeneration`` checkpoint, every parameter random; small token
    embeddings (x 0.05), else each tied token predicts itself and greedy replies repeat one token."""
    import torch
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    text = Gemma3TextConfig(**{**COMMON, **GEMMA3_STYLES["4b"], **text_changes})
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=SiglipVisionConfig(**TINY_SIGLIP).to_dict(),
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        **(media_ids or GEMMA3_MEDIA_IDS),
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    randomize_(model, seed)
    with torch.no_grad():
        model.model.language_model.embed_tokens.weight.mul_(0.05)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder)
    return folder

"""Tiny random Gemma 4 checkpoints, built and saved by transformers, one per variant style.

Every parameter and buffer is randomised — norm weights, router scales and layer scalars included,
since values of exactly 1 hide bugs — and the checkpoint is written with ``save_pretrained`` so that
the folder is what transformers itself would publish.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

SLIDING, FULL = "sliding_attention", "full_attention"

COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    head_dim=16,
    sliding_window=5,
    final_logit_softcapping=30.0,
    max_position_embeddings=4096,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=[1, 106 % 300],
)

STYLES: dict[str, dict] = {
    # E2B: 4:1 pattern, one KV head, PLE, KV sharing of both layer types, double-wide MLP.
    "e2b": dict(
        num_hidden_layers=10,
        layer_types=([SLIDING] * 4 + [FULL]) * 2,
        num_key_value_heads=1,
        global_head_dim=32,
        num_kv_shared_layers=4,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=300,
        use_double_wide_mlp=True,
    ),
    # E4B: 5:1 pattern, two KV heads, PLE, KV sharing, normal-width MLP.
    "e4b": dict(
        num_hidden_layers=12,
        layer_types=([SLIDING] * 5 + [FULL]) * 2,
        num_key_value_heads=2,
        global_head_dim=32,
        num_kv_shared_layers=5,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=300,
    ),
    # 26B-A4B: dense MLP beside routed experts, K=V full layers, own global KV-head count.
    "26b": dict(
        num_hidden_layers=6,
        layer_types=[SLIDING, SLIDING, FULL] * 2,
        num_key_value_heads=2,
        global_head_dim=32,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=3,
        moe_intermediate_size=24,
        hidden_size_per_layer_input=0,
        use_bidirectional_attention="vision",
    ),
    # 31B: dense, K=V full layers.
    "31b": dict(
        num_hidden_layers=6,
        layer_types=[SLIDING] * 5 + [FULL],
        num_key_value_heads=2,
        global_head_dim=32,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        hidden_size_per_layer_input=0,
    ),
}

# Gemma 4 12B "unified" (gemma4_unified) decoder styles: the 12B's own (K=V full layers, one global
# KV head, 5:1) and one with KV sharing and the double-wide MLP, which Gemma4UnifiedTextConfig also
# accepts.
UNIFIED_STYLES = {
    "12b": {k: v for k, v in STYLES["31b"].items() if k != "hidden_size_per_layer_input"},
    "kv-shared": dict(
        num_hidden_layers=8,
        layer_types=([SLIDING] * 3 + [FULL]) * 2,
        num_key_value_heads=2,
        global_head_dim=32,
        num_kv_shared_layers=3,
        use_double_wide_mlp=True,
    ),
}

TINY_VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=8,
    patch_size=4,
    pooling_kernel_size=2,
    position_embedding_size=16,
)


# Multimodal token ids inside the tiny vocabulary (the published ones are 255999-258884), so that
# boi/eoi/boa/eoa are real rows of the embedding table. Text tokens are drawn below 250.
TINY_TOKEN_IDS = dict(
    boi_token_id=250,
    eoi_token_id=251,
    image_token_id=252,
    audio_token_id=253,
    boa_token_id=254,
    eoa_token_index=255,  # sic: transformers' Gemma4Config field name
    video_token_id=256,
)

# E2B-like "on-device" towers, sized so that our own processors' outputs fit them: 16 px patches
# pooled 3x3 (process_images), 128 mel bins into a first conv of 128 channels (process_audio).
ON_DEVICE_VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=8,
    patch_size=16,
    pooling_kernel_size=3,
    position_embedding_size=64,
    use_clipped_linears=True,
    standardize=False,
)
ON_DEVICE_AUDIO = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    subsampling_conv_channels=[128, 8],
    conv_kernel_size=5,
    attention_chunk_size=12,
    attention_context_left=13,
    attention_context_right=0,
    output_proj_dims=24,
    use_clipped_linears=True,
)
# 26B/31B-like "large" tower: no clipping, standardised soft tokens, head_dim not a power of two
# (72 in the real one), 4 px patches pooled 2x2 (inputs built by hand in the processor's layout).
LARGE_VISION = dict(
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=12,
    patch_size=4,
    pooling_kernel_size=2,
    position_embedding_size=32,
    use_clipped_linears=False,
    standardize=True,
)


def text_config(style: str):
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(**COMMON, **STYLES[style])


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter and persistent buffer random, non-trivial values."""
    gen = torch.Generator().manual_seed(seed)
    persistent = set(model.state_dict().keys())
    named = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in persistent]
    with torch.no_grad():
        for name, t in named:
            if not t.is_floating_point():
                continue
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name or leaf in ("scale", "per_expert_scale", "layer_scalar", "std_scale"):
                # Scales around 1, never exactly 1.
                values = 0.5 + torch.rand(t.shape, generator=gen)
            elif leaf in ("input_min", "output_min"):
                values = -2.0 - torch.rand(t.shape, generator=gen)
            elif leaf in ("input_max", "output_max"):
                values = 2.0 + torch.rand(t.shape, generator=gen)
            elif "embed_tokens" in name or "position_embedding" in name:
                values = torch.randn(t.shape, generator=gen)
            else:
                fan_in = t.shape[-1] if t.dim() > 1 else t.numel()
                values = torch.randn(t.shape, generator=gen) / math.sqrt(fan_in)
            t.copy_(values.to(t.dtype))


def build_text_checkpoint(folder: Path, style: str, *, seed: int = 0, dtype=torch.float32) -> Path:
    """A ``gemma4_text`` checkpoint (``Gemma4ForCausalLM``) of the given style."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(text_config(style)).to(dtype)
    randomize_(model, seed)
    model.save_pretrained(folder)
    return folder


def build_multimodal_checkpoint(folder: Path, style: str, *, seed: int = 0, dtype=torch.float32) -> Path:
    """A ``gemma4`` checkpoint (``Gemma4ForConditionalGeneration``) with a tiny vision tower."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    config = Gemma4Config(
        text_config=text_config(style).to_dict(),
        vision_config=Gemma4VisionConfig(**TINY_VISION).to_dict(),
        audio_config=None,
    )
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).to(dtype)
    randomize_(model, seed)
    model.save_pretrained(folder)
    return folder


def tighten_clip_bounds_(model: torch.nn.Module, seed: int, bound: float = 1.0) -> None:
    """Clip bounds of about +-bound (each a little different), so that clamping really happens."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("input_min", "input_max", "output_min", "output_max"):
                value = bound * (1.0 + 0.5 * torch.rand((), generator=gen))
                buffer.fill_(-value if leaf.endswith("min") else value)


def build_omni_checkpoint(folder: Path, *, seed: int = 0, dtype=torch.float32) -> Path:
    """E2B-like ``gemma4`` checkpoint with vision and audio towers whose clip bounds clamp."""
    from transformers import (
        Gemma4AudioConfig,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4VisionConfig,
    )

    config = Gemma4Config(
        text_config=text_config("e2b").to_dict(),
        vision_config=Gemma4VisionConfig(**ON_DEVICE_VISION).to_dict(),
        audio_config=Gemma4AudioConfig(**ON_DEVICE_AUDIO).to_dict(),
        **TINY_TOKEN_IDS,
    )
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).to(dtype)
    randomize_(model, seed)
    tighten_clip_bounds_(model, seed)
    model.save_pretrained(folder)
    return folder


def build_large_vision_checkpoint(folder: Path, *, seed: int = 0, dtype=torch.float32) -> Path:
    """31B-like ``gemma4`` checkpoint: K=V text, bidirectional image blocks, large-style vision tower."""
    from transformers import (
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4TextConfig,
        Gemma4VisionConfig,
    )

    text = Gemma4TextConfig(**{**COMMON, **STYLES["31b"], "use_bidirectional_attention": "vision"})
    config = Gemma4Config(
        text_config=text.to_dict(),
        vision_config=Gemma4VisionConfig(**LARGE_VISION).to_dict(),
        audio_config=None,
        **TINY_TOKEN_IDS,
    )
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).to(dtype)
    randomize_(model, seed)
    model.save_pretrained(folder)
    return folder


def build_media_chat_checkpoint(
    folder: Path,
    *,
    vocab_size: int,
    media_token_ids: dict[str, int],
    large: bool = False,
    seed: int = 0,
    embed_scale: float = 0.05,
) -> Path:
    """A ``gemma4`` checkpoint for a real-layout tokenizer: ``vocab_size`` rows, its media token ids
    (``TINY_TOKEN_IDS`` field names), towers that fit our own processors, and small embeddings.

    E2B-like with vision and audio towers by default; ``large=True`` is 31B-like (K=V text,
    bidirectional image blocks, standardised vision tower without clipping, no audio). With large
    tied embeddings every token predicts itself; at ``embed_scale`` greedy continuations vary.
    """
    from transformers import (
        Gemma4AudioConfig,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4TextConfig,
        Gemma4VisionConfig,
    )

    style = "31b" if large else "e2b"
    fields = {**COMMON, **STYLES[style], "vocab_size": vocab_size}
    if large:
        fields["use_bidirectional_attention"] = "vision"
        vision = {**ON_DEVICE_VISION, "use_clipped_linears": False, "standardize": True}
    else:
        fields["vocab_size_per_layer_input"] = vocab_size
        vision = ON_DEVICE_VISION
    config = Gemma4Config(
        text_config=Gemma4TextConfig(**fields).to_dict(),
        vision_config=Gemma4VisionConfig(**vision).to_dict(),
        audio_config=None if large else Gemma4AudioConfig(**ON_DEVICE_AUDIO).to_dict(),
        **media_token_ids,
    )
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config)
    randomize_(model, seed)
    with torch.no_grad():
        model.model.language_model.embed_tokens.weight.mul_(embed_scale)
    model.save_pretrained(folder)
    return folder


def reference_model(folder: Path, dtype=torch.float32):
    """The transformers model of a saved checkpoint, with eager attention and its default experts
    (grouped_mm, as ours: tests/test_moe_default.py checks the eager experts against ours)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    return model.eval()


# Parity checks shared by the logits tests: a padded batch, transformers' logits on it, the tolerance.


def padded_batch(seed: int, length: int = 17):
    """Two rows longer than the sliding window (5); the second is left-padded by 4."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (2, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids[1, :4] = 0
    return ids, mask


def reference_logits(ref, ids, mask, **kwargs):
    # Positions follow the mask, as in transformers' generate().
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        return ref(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs).logits


def assert_match(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype):
    """float32 to 1e-5, bfloat16 to the bit."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if dtype == torch.bfloat16:
        assert torch.equal(ours, ref), f"bf16 differs: max |Δ| = {(ours.float() - ref.float()).abs().max()}"
    else:
        assert (ours - ref).abs().max().item() <= 1e-5


# Generation parity: three left-padded prompts WIDTH wide, continued by NEW tokens.
NEW = 18  # more than 3x the sliding window (5)
WIDTH = 12


def padded_prompts(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded rows: 12 tokens, 3 tokens (shorter than the window) and 8 tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (3, WIDTH), generator=gen)
    mask = torch.ones_like(ids)
    for row, real in ((1, 3), (2, 8)):
        mask[row, : WIDTH - real] = 0
        ids[row, : WIDTH - real] = 0
    return ids, mask


def transformers_generate_alone(ref, ids, mask=None, **kwargs) -> torch.Tensor:
    """transformers' generate of each row ALONE (its prompt without the padding), laid out as its
    batched generate lays out a left-padded batch: padding, prompt, new tokens, then pad_token_id
    (0) after a row's stop token. Alone, not batched: ours promises each row what it gets alone,
    and transformers' own batched rows differ from alone where a CPU's kernels depend on row
    counts (bf16 on AVX-512: tests/row_kernels.py)."""
    with torch.no_grad():
        if mask is None:
            return ref.generate(ids, **kwargs)
        rows = [ref.generate(ids[b : b + 1][:, mask[b].bool()], **kwargs)[0] for b in range(ids.shape[0])]
    width = ids.shape[1]
    total = max(width + len(row) - int(mask[b].sum()) for b, row in enumerate(rows))
    out = torch.zeros(ids.shape[0], total, dtype=ids.dtype)
    for b, row in enumerate(rows):
        new = row[int(mask[b].sum()) :]
        out[b, :width] = ids[b]
        out[b, width : width + len(new)] = new
    return out

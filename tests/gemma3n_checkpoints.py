"""Tiny random Gemma 3n checkpoints, built and saved by transformers: ``gemma3n_text``
(``Gemma3nForCausalLM``) and ``gemma3n`` (``Gemma3nForConditionalGeneration``).

transformers builds Gemma 3n's MobileNet-V5 vision tower through timm, which is not installed here
(nor a dependency of torchgemma): a module without parameters stands in for it while transformers
builds and loads the multimodal model. torchgemma builds neither tower, and the text path never
reaches them; the audio tower transformers builds itself (tiny here), and its tensors are skipped.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from checkpoints import randomize_

SLIDING, FULL = "sliding_attention", "full_attention"

# Width 48 (not a power of two) so that 1/H, H^-1/2 and √H all round in bf16; a wider MLP on one
# layer; the first two layers' gates sparsified (0.95, as published, and 0.5); the last two layers
# KV-shared; ids 260-299 belong to the towers' vocabularies (and beyond the per-layer table).
TEXT = dict(
    vocab_size=300,
    hidden_size=48,
    intermediate_size=[64, 64, 96, 64, 64, 64],
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=5,
    layer_types=[SLIDING, SLIDING, FULL] * 2,
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=260,
    laurel_rank=4,
    activation_sparsity_pattern=[0.95, 0.5, 0.0, 0.0, 0.0, 0.0],
    max_position_embeddings=4096,
    eos_token_id=[1, 106],
)
VISION = dict(hidden_size=24, vocab_size=20, vocab_offset=260)
AUDIO = dict(
    hidden_size=16,
    vocab_size=20,
    vocab_offset=280,
    conf_num_hidden_layers=1,
    conf_num_attention_heads=2,
    sscp_conv_channel_size=[4, 4],
    input_feat_size=16,
)
TOKEN_IDS = dict(
    boi_token_id=250,
    eoi_token_id=260,
    image_token_id=261,
    boa_token_id=251,
    eoa_token_id=280,
    audio_token_id=281,
)


@contextlib.contextmanager
def vision_tower_stub():
    """transformers builds a parameter-free module where Gemma 3n's timm vision tower would be."""
    from transformers import Gemma3nVisionConfig
    from transformers.models.gemma3n import modeling_gemma3n

    real = modeling_gemma3n.AutoModel

    class AutoModel:
        @staticmethod
        def from_config(config, **kwargs):
            if isinstance(config, Gemma3nVisionConfig):
                return nn.Module()
            return real.from_config(config, **kwargs)

    modeling_gemma3n.AutoModel = AutoModel
    try:
        yield
    finally:
        modeling_gemma3n.AutoModel = real


def text_config(**changes):
    from transformers import Gemma3nTextConfig

    return Gemma3nTextConfig(**{**TEXT, **changes})


def build(folder: Path, multimodal: bool, *, seed: int = 0, embed_scale: float = 1.0, **changes) -> Path:
    """A ``gemma3n`` (multimodal layout) or ``gemma3n_text`` checkpoint with every parameter random.

    ``embed_scale`` < 1 shrinks the token embeddings, so that greedy continuations vary (with large
    tied embeddings every token predicts itself). ``changes`` go to the text config; the towers'
    vocabularies take the last 40 ids of ``vocab_size``.
    """
    from transformers import Gemma3nAudioConfig, Gemma3nConfig, Gemma3nForCausalLM, Gemma3nVisionConfig

    torch.manual_seed(seed)
    if multimodal:
        from transformers import Gemma3nForConditionalGeneration

        media = text_config(**changes).vocab_size - 40
        config = Gemma3nConfig(
            text_config=text_config(**changes).to_dict(),
            vision_config=Gemma3nVisionConfig(**{**VISION, "vocab_offset": media}).to_dict(),
            audio_config=Gemma3nAudioConfig(**{**AUDIO, "vocab_offset": media + 20}).to_dict(),
            **TOKEN_IDS,
        )
        with vision_tower_stub():
            model = Gemma3nForConditionalGeneration(config)
        text = model.model.language_model
    else:
        model = Gemma3nForCausalLM(text_config(**changes))
        text = model.model
    randomize_(model, seed)
    with torch.no_grad():
        text.embed_tokens.weight.mul_(embed_scale)
    model.save_pretrained(folder)
    return folder


def reference_model(folder: Path, dtype=torch.float32):
    """The transformers model of a saved checkpoint, eager attention."""
    from transformers import AutoModelForCausalLM

    with vision_tower_stub():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    return model.eval()

"""Checkpoint folders whose non-weight files mirror the published ones, one per Gemma family.

The hub cannot be reached from here, so each folder is reconstructed: the files each published
repository carries, with the field values it publishes (from transformers 5.23's config classes and
conversion scripts, the reference notes ../shared/reference/gemma4-transformers-5.23.md §1.1, §5.4,
§9, and public copies of the files), except the sizes, shrunk so that a model builds and runs in
milliseconds. Vocabularies keep their real size (262,144 ids and more), so every special token sits
at its real id, including the ones past the embedding table (EmbeddingGemma's and Gemma 3's
``<image_soft_token>``, 262144). The weights are random, built with transformers from the folder's
own config.json when a test first asks for the folder (``published_checkpoint(name)``, one build
per session and worker), saved in the published dtype.

What each folder mirrors, and the fields that differ from the published values (sizes only):

==================  ===================================================  ===========================
folder              files (as published)                                 differs (sizes only)
==================  ===================================================  ===========================
embeddinggemma-300m config.json (Gemma3TextModel, bidirectional, float32),  hidden 768->24, layers
                    tokenizer.json (+ <image_soft_token> 262144, one     24->6, head_dim 256->16,
                    past the table), tokenizer_config.json (add_bos and  MLP 1152->36, window
                    add_eos, added_tokens_decoder), special_tokens_map,  512->4; Dense 768->3072
                    added_tokens.json, modules.json, config_sentence_    ->768 as 24->96->24;
                    transformers.json (task prompts),                    max_seq_length 2048->64
                    sentence_bert_config.json, 1_Pooling/config.json,
                    2_Dense/ and 3_Dense/ (config.json, model.safetensors)
gemma-3-270m        config.json (Gemma3ForCausalLM, layer_types,         hidden 640->32, layers
                    _sliding_window_pattern), generation_config.json,    18->6, head_dim 256->16,
                    tokenizer files as above (add_bos only),             MLP 2048->64, window
                    chat_template.jinja                                  512->4
gemma-3-1b-it       config.json (4.50 style: sliding_window_pattern, no  hidden 1152->32, layers
                    layer_types, cache_implementation), generation_      26->6, head_dim 256->16,
                    config.json, tokenizer files, chat template inside   MLP 6912->64, window
                    tokenizer_config.json                                512->4
gemma-3-4b-it       config.json (gemma3: text_config of only the fields  text: hidden 2560->32,
                    that differ from the defaults, linear RoPE x8,       layers 34->6, MLP
                    SigLIP vision_config, mm_tokens_per_image),          10240->64, window
                    generation_config.json, tokenizer files, template    1024->4; vision: hidden
                    in tokenizer_config.json and chat_template.json,     1152->16, layers 27->1,
                    processor_config.json, preprocessor_config.json      MLP 4304->32, heads
                                                                         16->2, image 896->56 px,
                                                                         256->4 tokens
gemma-3n-E2B-it     config.json (gemma3n: text_config with PLE, AltUp,   text: hidden 2048->32,
                    LAuReL, sparsity, KV sharing; vision (MobileNet-V5)  layers 30->10 (4 KV-
                    and audio configs, media ids), generation_config,    shared), head_dim 256->16,
                    tokenizer files (262,400 ids), chat_template.jinja,  MLP 8192->64, PLE 256->4,
                    processor_config.json, preprocessor_config.json      LAuReL 64->4, heads 8->2,
                                                                         sparse layers 10->2,
                                                                         window 512->4; towers:
                                                                         hidden ->16, audio layers
                                                                         12->1
gemma-4-E2B-it      config.json (gemma4: text_config per §1.1,           text: hidden ->32, layers
gemma-4-E4B-it      on-device vision, audio), generation_config.json     35/42/30/60->10/12/6/6
gemma-4-26B-A4B-it  (eos [1, 106, 50]), tokenizer.json, tokenizer_       (the layer pattern and
gemma-4-31B-it      config.json (the named control tokens, no added_     KV-shared share kept), heads
                    tokens_decoder), chat_template.jinja, processor_     16/32->4 and KV 8/16->2
                    config.json (image, audio, video processors)         and global KV 2/4->1 for
                                                                         26B/31B, head_dim 256/512
                                                                         ->16/32, MLP, experts
                                                                         128->8 (top 8->2), window
                                                                         ->4; towers: hidden ->32,
                                                                         layers ->2
gemma-4-12B-it      config.json (gemma4_unified: K=V text, encoder-free  text: hidden 3840->32,
(unified)           image and audio embedders), the Gemma 4 tokenizer    layers 48->6, MLP, window
                    files and template, generation_config.json           1024->4; mm_embed 3840->40
==================  ===================================================  ===========================

Reconstructed, not confirmed against the hub (said where used): the vocabulary's ordinary pieces
are a few hundred BPE merges learned on the tests' sample text (tokenizer_fixtures) padded with
filler pieces, not Gemma's 262k pieces and 514k merges, and the Gemma 3 added_tokens_decoder lists
the control tokens, not the published ~6k entries (unused slots, HTML tags, whitespace runs); Gemma
3n's tokenizer is given 262,400 ids with placeholder names for the unnamed media slots (262146-262271,
262274-262399); EmbeddingGemma's config.json dtype (float32) and its tokenizer's right padding; Gemma
4's processor_config.json takes the image processor's fields from reference §3.1 and the video and
audio processors' from the 5.23 classes' defaults; the chat templates are reconstructions of the
published ones' format (Gemma 4's is tokenizer_fixtures' §9.4 template); transformers_version
strings are indicative.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints import randomize_
from tokenizer_fixtures import GEMMA4_CHAT_TEMPLATE, GEMMA4_NAMED_TOKENS, _trained_pieces

SLIDING, FULL = "sliding_attention", "full_attention"

# ── tokenizers ───────────────────────────────────────────────────────────────────────────────

# Gemma 3 (and 3n, EmbeddingGemma): control tokens at their published ids.
GEMMA3_HEAD = {
    0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 5: "[multimodal]",
    **{6 + i: f"<unused{i}>" for i in range(99)},
    105: "<start_of_turn>", 106: "<end_of_turn>",
}  # fmt: skip
GEMMA3_TAIL = {255999: "<start_of_image>", 256000: "<end_of_image>"}
GEMMA3_ADDED = {262144: "<image_soft_token>"}  # added_tokens.json: one past the 262,144 pieces

GEMMA3N_TAIL = {255999: "<start_of_image>", 256000: "<start_of_audio>"}
GEMMA3N_ADDED = {
    262144: "<end_of_image>", 262145: "<image_soft_token>",
    262272: "<end_of_audio>", 262273: "<audio_soft_token>",
}  # fmt: skip

# Gemma 4: reference §9.2.
GEMMA4_HEAD = {
    0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>",
    46: "<|tool>", 47: "<tool|>", 48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>",
    51: "<tool_response|>", 52: '<|"|>', 98: "<|think|>", 100: "<|channel>", 101: "<channel|>",
    105: "<|turn>", 106: "<turn|>",
}  # fmt: skip
GEMMA4_TAIL = {
    255999: "<|image>", 256000: "<|audio>", 258880: "<|image|>", 258881: "<|audio|>",
    258882: "<image|>", 258883: "<audio|>", 258884: "<|video|>",
}  # fmt: skip
# Newlines are added tokens, not special ones, in both generations.
PLAIN_ADDED = {107: "\n", 108: "\n\n"}
GEMMA_VOCAB = 262144


@functools.cache
def _vocabulary(family: str) -> tuple[dict[str, int], tuple, dict[int, str], dict[int, str]]:
    """(BPE vocabulary of 262,144 pieces, merges, special added tokens by id, extra added tokens
    past the vocabulary by id) of a family: control tokens at their published ids, the byte pieces,
    the learned pieces, filler pieces in between."""
    head, tail, added = {
        "gemma3": (GEMMA3_HEAD, GEMMA3_TAIL, GEMMA3_ADDED),
        "gemma3n": (GEMMA3_HEAD, GEMMA3N_TAIL, GEMMA3N_ADDED),
        "gemma4": (GEMMA4_HEAD, GEMMA4_TAIL, {}),
    }[family]
    if family == "gemma3n":  # 262,400 ids in all: the towers' 2 x 128 (placeholder names)
        added = {i: added.get(i, f"<unused_media{i - GEMMA_VOCAB}>") for i in range(GEMMA_VOCAB, 262400)}
    fixed = {**head, **PLAIN_ADDED, **tail}
    pieces, merges = _trained_pieces()
    fill = iter([f"<0x{b:02X}>" for b in range(256)] + [p for p in pieces if p not in fixed.values()])
    ordered = [fixed[i] if i in fixed else next(fill, f"<filler{i}>") for i in range(GEMMA_VOCAB)]
    vocab = {piece: i for i, piece in enumerate(ordered)}
    assert len(vocab) == GEMMA_VOCAB, "a learned piece collides with a fixed one"
    specials = {i: t for i, t in {**head, **tail}.items() if not t.startswith("<unused")}
    return vocab, tuple(merges), specials, added


def _added_entry(token_id: int, content: str, special: bool) -> dict:
    return {
        "id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
        "normalized": not special, "special": special,
    }  # fmt: skip


def _template(single: list[str]) -> dict:
    """tokenizer.json's TemplateProcessing with ``single`` around $A (<bos>, <eos> ids: 2, 1)."""

    def part(item: str, type_id: int) -> dict:
        if item == "$A":
            return {"Sequence": {"id": "A" if type_id == 0 else "B", "type_id": type_id}}
        return {"SpecialToken": {"id": item, "type_id": type_id}}

    used = {t: {"id": t, "ids": [{"<bos>": 2, "<eos>": 1}[t]], "tokens": [t]} for t in single if t != "$A"}
    return {
        "type": "TemplateProcessing",
        "single": [part(t, 0) for t in single],
        "pair": [part(t, 0) for t in single] + [part(t, 1) for t in single],
        "special_tokens": used,
    }


def added_tokens(family: str) -> list[dict]:
    """tokenizer.json's added tokens: control tokens special, newlines not, the family's tokens past
    the vocabulary special."""
    _, _, specials, added = _vocabulary(family)
    entries = [_added_entry(i, t, True) for i, t in sorted(specials.items())]
    entries += [_added_entry(i, t, False) for i, t in PLAIN_ADDED.items()]
    entries += [_added_entry(i, t, True) for i, t in sorted(added.items())]
    return sorted(entries, key=lambda e: e["id"])


def tokenizer_json(family: str, single: list[str]) -> dict:
    """A published-layout tokenizer.json: Gemma's pipeline, the added tokens (control tokens
    special, newlines not, the family's added tokens past the vocabulary special), the post-processor."""
    vocab, merges, _, _ = _vocabulary(family)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens(family),
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
        "post_processor": _template(single),
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
            "vocab": vocab, "merges": [list(m) for m in merges],
        },
    }  # fmt: skip


@functools.cache
def _tokenizer_text(family: str, single: tuple[str, ...]) -> str:
    return json.dumps(tokenizer_json(family, list(single)), ensure_ascii=False)


def _token_dict(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


# Gemma 3's chat template (in tokenizer_config.json for 1B/4B, chat_template.jinja for 270M): <bos>,
# the system message folded into the first user turn, "assistant" written as "model", images as
# <start_of_image>, text trimmed. Reconstructed from the published format.
GEMMA3_CHAT_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'MEDIA_IMAGE_TYPE' -%}
                {{ 'MEDIA_IMAGE_TOKEN' }}
            {%- elif item['type'] == 'audio' -%}
                {{ 'MEDIA_AUDIO_TOKEN' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


def gemma3_template(image_token: str, audio_token: str | None = None) -> str:
    """Gemma 3's template writes images as <start_of_image>; Gemma 3n's as <image_soft_token> and
    audio as <audio_soft_token>."""
    template = GEMMA3_CHAT_TEMPLATE.replace("MEDIA_IMAGE_TYPE", "image").replace(
        "MEDIA_IMAGE_TOKEN", image_token
    )
    if audio_token is None:  # Gemma 3 has no audio branch
        return template.replace(
            "            {%- elif item['type'] == 'audio' -%}\n                {{ 'MEDIA_AUDIO_TOKEN' }}\n",
            "",
        )
    return template.replace("MEDIA_AUDIO_TOKEN", audio_token)


def gemma3_tokenizer_files(
    family: str = "gemma3",
    *,
    add_eos: bool = False,
    padding_side: str = "left",
    template_in_config: str | None = None,
    named: dict[str, str] | None = None,
    processor_class: str | None = None,
) -> dict[str, Any]:
    """Gemma 3 / 3n / EmbeddingGemma tokenizer files, as transformers 4.5x saved them: tokenizer.json,
    tokenizer_config.json with added_tokens_decoder, special_tokens_map.json and added_tokens.json."""
    single = ["<bos>", "$A", "<eos>"] if add_eos else ["<bos>", "$A"]

    named = named or {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    decoder = {str(e["id"]): {k: v for k, v in e.items() if k != "id"} for e in added_tokens(family)}
    config: dict[str, Any] = {
        "add_bos_token": True,
        "add_eos_token": add_eos,
        "added_tokens_decoder": decoder,
        **named,
        "bos_token": "<bos>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<eos>",
        "extra_special_tokens": dict(named),
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "<pad>",
        "padding_side": padding_side,
        "sp_model_kwargs": None,
        "spaces_between_special_tokens": False,
        "tokenizer_class": "GemmaTokenizer",
        "unk_token": "<unk>",
        "use_default_system_prompt": False,
    }
    if processor_class is not None:
        config["processor_class"] = processor_class
    if template_in_config is not None:
        config["chat_template"] = template_in_config
    _, _, _, added = _vocabulary(family)
    return {
        "tokenizer.json": _tokenizer_text(family, tuple(single)),  # 262k pieces: the JSON text, made once
        "tokenizer_config.json": config,
        "special_tokens_map.json": {
            **named,
            "bos_token": _token_dict("<bos>"),
            "eos_token": _token_dict("<eos>"),
            "pad_token": _token_dict("<pad>"),
            "unk_token": _token_dict("<unk>"),
        },
        "added_tokens.json": {t: i for i, t in sorted(added.items())},
    }


def gemma4_tokenizer_files() -> dict[str, Any]:
    """Gemma 4's tokenizer files as transformers 5 saved them (reference §9.1): tokenizer.json whose
    post-processor adds nothing (the template writes <bos>), tokenizer_config.json with the named
    control tokens and no added_tokens_decoder, chat_template.jinja; no special_tokens_map.json."""
    return {
        "tokenizer.json": _tokenizer_text("gemma4", ("$A",)),
        "tokenizer_config.json": {
            "tokenizer_class": "GemmaTokenizer",
            "add_bos_token": False,
            "add_eos_token": False,
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "mask_token": "<mask>",
            **GEMMA4_NAMED_TOKENS,
            "extra_special_tokens": ["<|video|>"],
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1000000000000000019884624838656,
            "padding_side": "left",
            "processor_class": "Gemma4Processor",
            "spaces_between_special_tokens": False,
        },
        "chat_template.jinja": GEMMA4_CHAT_TEMPLATE,
    }


# ── configs ──────────────────────────────────────────────────────────────────────────────────

GEMMA3_GENERATION = {
    "bos_token_id": 2, "cache_implementation": "hybrid", "do_sample": True, "eos_token_id": [1, 106],
    "pad_token_id": 0, "top_k": 64, "top_p": 0.95,
}  # fmt: skip
GEMMA4_GENERATION = {
    "bos_token_id": 2, "do_sample": True, "eos_token_id": [1, 106, 50], "pad_token_id": 0,
    "temperature": 1.0, "top_k": 64, "top_p": 0.95,
}  # fmt: skip

_GEMMA3_TEXT = dict(
    attention_bias=False, attention_dropout=0.0, attn_logit_softcapping=None, bos_token_id=2,
    eos_token_id=1, final_logit_softcapping=None, head_dim=16, hidden_activation="gelu_pytorch_tanh",
    hidden_size=32, initializer_range=0.02, intermediate_size=64, max_position_embeddings=32768,
    model_type="gemma3_text", num_attention_heads=4, num_hidden_layers=6, num_key_value_heads=1,
    pad_token_id=0, query_pre_attn_scalar=256, rms_norm_eps=1e-06, rope_local_base_freq=10000.0,
    rope_scaling=None, rope_theta=1000000.0, sliding_window=4, use_cache=True, vocab_size=262144,
)  # fmt: skip

EMBEDDINGGEMMA = dict(
    _GEMMA3_TEXT, architectures=["Gemma3TextModel"], _sliding_window_pattern=6, hidden_size=24,
    intermediate_size=36, num_attention_heads=3, max_position_embeddings=2048,
    layer_types=[SLIDING] * 5 + [FULL], use_bidirectional_attention=True, dtype="float32",
    transformers_version="4.57.0.dev0",
)  # fmt: skip
GEMMA3_270M = dict(
    _GEMMA3_TEXT, architectures=["Gemma3ForCausalLM"], _sliding_window_pattern=6,
    layer_types=[SLIDING] * 5 + [FULL], use_bidirectional_attention=False, torch_dtype="bfloat16",
    transformers_version="4.55.0.dev0",
)  # fmt: skip
GEMMA3_1B = dict(
    _GEMMA3_TEXT, architectures=["Gemma3ForCausalLM"],
    cache_implementation="hybrid", eos_token_id=[1, 106], sliding_window_pattern=6,
    rope_local_base_freq=10000, rope_theta=1000000, torch_dtype="bfloat16",
    transformers_version="4.50.0.dev0",
)  # fmt: skip
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 4,
    "model_type": "gemma3",
    # Published: only the fields that differ from Gemma3TextConfig's defaults (heads 8, KV heads 4,
    # head_dim 256, vocab 262,208, query_pre_attn_scalar 256 come from the defaults).
    "text_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 4,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 16,
        "image_size": 56,
        "intermediate_size": 32,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "patch_size": 14,
        "vision_use_head": False,
    },
}
GEMMA3_PREPROCESSOR = {
    "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
    "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor",
    "image_seq_length": 4, "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None,
    "processor_class": "Gemma3Processor", "resample": 2, "rescale_factor": 0.00392156862745098,
    "size": {"height": 56, "width": 56},
}  # fmt: skip

GEMMA3N_E2B = {
    "architectures": ["Gemma3nForConditionalGeneration"],
    "audio_config": {
        "conf_attention_chunk_size": 12, "conf_attention_context_left": 13,
        "conf_attention_context_right": 0, "conf_attention_logit_cap": 50.0, "conf_conv_kernel_size": 5,
        "conf_num_attention_heads": 2, "conf_num_hidden_layers": 1, "conf_reduction_factor": 4,
        "conf_residual_weight": 0.5, "gradient_clipping": 10000000000.0, "hidden_size": 16,
        "input_feat_size": 128, "model_type": "gemma3n_audio", "rms_norm_eps": 1e-06,
        "sscp_conv_channel_size": [128, 32], "sscp_conv_group_norm_eps": 0.001,
        "sscp_conv_kernel_size": [[3, 3], [3, 3]], "sscp_conv_stride_size": [[2, 2], [2, 2]],
        "vocab_offset": 262272, "vocab_size": 128,
    },
    "audio_soft_tokens_per_image": 188,
    "boa_token_id": 256000,
    "boi_token_id": 255999,
    "eoa_token_id": 262272,
    "eoi_token_id": 262144,
    "eos_token_id": [1, 106],
    "image_token_id": 262145,
    "audio_token_id": 262273,
    "initializer_range": 0.02,
    "model_type": "gemma3n",
    "text_config": {
        "activation_sparsity_pattern": [0.95] * 2 + [0.0] * 8,
        "altup_active_idx": 0, "altup_coef_clip": 120.0, "altup_correct_scale": True,
        "altup_lr_multiplier": 1.0, "altup_num_inputs": 4, "attention_bias": False,
        "attention_dropout": 0.0, "final_logit_softcapping": 30.0, "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 32, "hidden_size_per_layer_input": 4,
        "initializer_range": 0.02, "intermediate_size": [64] * 10, "laurel_rank": 4,
        "layer_types": ([SLIDING] * 4 + [FULL]) * 2, "max_position_embeddings": 32768,
        "model_type": "gemma3n_text", "num_attention_heads": 2, "num_hidden_layers": 10,
        "num_key_value_heads": 2, "num_kv_shared_layers": 4, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0, "rope_scaling": None,
        "rope_theta": 1000000.0, "sliding_window": 4, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 262400, "vocab_size_per_layer_input": 262144,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.53.0.dev0",
    "vision_config": {
        "architecture": "mobilenetv5_300m_enc", "do_pooling": False, "hidden_size": 16,
        "initializer_range": 0.02, "model_type": "gemma3n_vision", "rms_norm_eps": 1e-06,
        "vocab_offset": 262144, "vocab_size": 128,
    },
    "vision_soft_tokens_per_image": 256,
}  # fmt: skip
GEMMA3N_PREPROCESSOR = {
    "data_format": "channels_first", "dither": 0.0, "do_center_crop": None, "do_convert_rgb": None,
    "do_normalize": False, "do_rescale": True, "do_resize": True,
    "feature_extractor_type": "Gemma3nAudioFeatureExtractor", "feature_size": 128, "fft_length": 1024,
    "fft_overdrive": True, "frame_length": 512, "hop_length": 160, "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "SiglipImageProcessorFast", "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5], "input_scale_factor": 1.0, "max_frequency": 7600.0,
    "mel_floor": 1e-05, "min_frequency": 125.0, "padding_side": "right", "padding_value": 0.0,
    "per_bin_mean": None, "per_bin_stddev": None, "preemphasis": 0.97, "preemphasis_htk_flavor": True,
    "processor_class": "Gemma3nProcessor", "resample": 2, "rescale_factor": 0.00392156862745098,
    "return_attention_mask": True, "sampling_rate": 16000, "size": {"height": 768, "width": 768},
}  # fmt: skip

_GEMMA4_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}
_GEMMA4_TEXT = dict(
    model_type="gemma4_text", vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size=32,
    head_dim=16, global_head_dim=32, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, rope_parameters=_GEMMA4_ROPE,
    sliding_window=4, pad_token_id=0, bos_token_id=2, eos_token_id=1,
)  # fmt: skip
GEMMA4_TEXT = {
    "e2b": dict(
        _GEMMA4_TEXT, num_hidden_layers=10, intermediate_size=128, num_attention_heads=8,
        num_key_value_heads=1, num_global_key_value_heads=None, layer_types=([SLIDING] * 4 + [FULL]) * 2,
        num_kv_shared_layers=4, hidden_size_per_layer_input=4, use_double_wide_mlp=True,
        attention_k_eq_v=False, max_position_embeddings=131072,
    ),
    "e4b": dict(
        _GEMMA4_TEXT, num_hidden_layers=12, intermediate_size=128, num_attention_heads=8,
        num_key_value_heads=2, num_global_key_value_heads=None, layer_types=([SLIDING] * 5 + [FULL]) * 2,
        num_kv_shared_layers=5, hidden_size_per_layer_input=4, use_double_wide_mlp=False,
        attention_k_eq_v=False, max_position_embeddings=131072,
    ),
    "26b-a4b": dict(
        _GEMMA4_TEXT, num_hidden_layers=6, intermediate_size=24, num_attention_heads=4,
        num_key_value_heads=2, num_global_key_value_heads=1, layer_types=[SLIDING] * 5 + [FULL],
        num_kv_shared_layers=0, hidden_size_per_layer_input=0, attention_k_eq_v=True,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=8,
        use_bidirectional_attention="vision", max_position_embeddings=262144,
    ),
    "31b": dict(
        _GEMMA4_TEXT, num_hidden_layers=6, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_global_key_value_heads=1, layer_types=[SLIDING] * 5 + [FULL],
        num_kv_shared_layers=0, hidden_size_per_layer_input=0, attention_k_eq_v=True,
        use_bidirectional_attention="vision", max_position_embeddings=262144,
    ),
}  # fmt: skip
_VISION_COMMON = dict(
    model_type="gemma4_vision", patch_size=16, pooling_kernel_size=3, position_embedding_size=64,
    rope_parameters={"rope_type": "default", "rope_theta": 100.0}, default_output_length=280,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
)  # fmt: skip
ON_DEVICE_VISION = dict(
    _VISION_COMMON, hidden_size=32, intermediate_size=48, use_clipped_linears=True, standardize=False
)
LARGE_VISION = dict(
    _VISION_COMMON, hidden_size=36, intermediate_size=48, use_clipped_linears=False, standardize=True
)
GEMMA4_AUDIO = dict(
    model_type="gemma4_audio", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    subsampling_conv_channels=[128, 32], conv_kernel_size=5, attention_chunk_size=12,
    attention_context_left=13, attention_context_right=0, attention_logit_cap=50.0,
    residual_weight=0.5, output_proj_dims=24, use_clipped_linears=True, hidden_act="silu",
)  # fmt: skip
GEMMA4_MEDIA_IDS = {
    "boi_token_id": 255999, "eoi_token_id": 258882, "image_token_id": 258880, "video_token_id": 258884,
    "boa_token_id": 256000, "eoa_token_index": 258883, "audio_token_id": 258881,
}  # fmt: skip


def gemma4_config(style: str) -> dict:
    small = style in ("e2b", "e4b")
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": GEMMA4_TEXT[style],
        "vision_config": ON_DEVICE_VISION if small else LARGE_VISION,
        "audio_config": GEMMA4_AUDIO if small else None,
        **GEMMA4_MEDIA_IDS,
        "eos_token_id": [1, 106],
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
        "transformers_version": "5.5.0",
    }


def gemma4_processor(audio: bool) -> dict:
    """processor_config.json (reference §3.1, §3.5, §4.1), the processors nested."""
    processor: dict[str, Any] = {
        "processor_class": "Gemma4Processor",
        "image_seq_length": 280,
        "image_processor": {
            "image_processor_type": "Gemma4ImageProcessor", "do_convert_rgb": True, "do_resize": True,
            "do_rescale": True, "rescale_factor": 0.00392156862745098, "do_normalize": False,
            "max_soft_tokens": 280, "patch_size": 16, "pooling_kernel_size": 3, "resample": 3,
            "size": {"height": 224, "width": 224},
        },
        "video_processor": {
            "video_processor_type": "Gemma4VideoProcessor", "do_sample_frames": True, "num_frames": 32,
            "max_soft_tokens": 70, "patch_size": 16, "pooling_kernel_size": 3, "do_normalize": True,
            "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0],
        },
    }  # fmt: skip
    if audio:
        processor["feature_extractor"] = {
            "feature_extractor_type": "Gemma4AudioFeatureExtractor", "feature_size": 128,
            "sampling_rate": 16000, "padding_side": "right", "padding_value": 0.0,
            "return_attention_mask": True,
        }  # fmt: skip
    return processor


GEMMA4_12B = {
    "architectures": ["Gemma4UnifiedForConditionalGeneration"],
    "model_type": "gemma4_unified",
    "text_config": dict(
        _GEMMA4_TEXT, model_type="gemma4_unified_text", num_hidden_layers=6, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1,
        layer_types=[SLIDING] * 5 + [FULL], attention_k_eq_v=True,
        use_bidirectional_attention="vision", max_position_embeddings=262144,
    ),
    "vision_config": {
        "model_type": "gemma4_unified_vision", "patch_size": 16, "pooling_kernel_size": 3,
        "mm_embed_dim": 40, "mm_posemb_size": 16, "output_proj_dims": 40, "rms_norm_eps": 1e-06,
    },
    "audio_config": {"model_type": "gemma4_unified_audio", "audio_embed_dim": 24, "rms_norm_eps": 1e-06},
    **GEMMA4_MEDIA_IDS,
    "eos_token_id": [1, 106],
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
    "transformers_version": "5.23.0",
}  # fmt: skip

# EmbeddingGemma's sentence-transformers files (sentence-transformers 5.1's layout).
EMBEDDING_PROMPTS = {
    "query": "task: search result | query: ", "document": "title: none | text: ",
    "BitextMining": "task: search result | query: ", "Clustering": "task: clustering | query: ",
    "Classification": "task: classification | query: ", "InstructionRetrieval": "task: code retrieval | query: ",
    "MultilabelClassification": "task: classification | query: ",
    "PairClassification": "task: sentence similarity | query: ", "Reranking": "task: search result | query: ",
    "Retrieval": "task: search result | query: ", "Retrieval-query": "task: search result | query: ",
    "Retrieval-document": "title: none | text: ", "STS": "task: sentence similarity | query: ",
    "Summarization": "task: summarization | query: ",
}  # fmt: skip
EMBEDDING_WIDTH, EMBEDDING_DENSE = 24, 96  # published 768 and 3072


def embeddinggemma_module_files() -> dict[str, Any]:
    dense = {"bias": False, "activation_function": "torch.nn.modules.linear.Identity"}
    return {
        "modules.json": [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
            {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
            {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"},
        ],
        "config_sentence_transformers.json": {
            "model_type": "SentenceTransformer",
            "__version__": {"sentence_transformers": "5.1.0", "transformers": "4.57.0.dev0", "pytorch": "2.8.0+cu128"},
            "prompts": EMBEDDING_PROMPTS,
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
        "sentence_bert_config.json": {"max_seq_length": 64, "do_lower_case": False},
        "1_Pooling/config.json": {
            "word_embedding_dimension": EMBEDDING_WIDTH, "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": False, "include_prompt": True,
        },
        "2_Dense/config.json": {"in_features": EMBEDDING_WIDTH, "out_features": EMBEDDING_DENSE, **dense},
        "3_Dense/config.json": {"in_features": EMBEDDING_DENSE, "out_features": EMBEDDING_WIDTH, **dense},
    }  # fmt: skip


# ── the folders ──────────────────────────────────────────────────────────────────────────────


def _gemma3_family_files(config: dict, *, template: str = "jinja", processor: bool = False) -> dict[str, Any]:
    files: dict[str, Any] = {"config.json": config, "generation_config.json": GEMMA3_GENERATION}
    chat = gemma3_template("<start_of_image>")
    files.update(
        gemma3_tokenizer_files(
            template_in_config=chat if template == "config" else None,
            processor_class="Gemma3Processor" if processor else None,
        )
    )
    if template == "jinja":
        files["chat_template.jinja"] = chat
    if processor:
        files["chat_template.json"] = {"chat_template": chat}
        files["processor_config.json"] = {"image_seq_length": 4, "processor_class": "Gemma3Processor"}
        files["preprocessor_config.json"] = GEMMA3_PREPROCESSOR
    return files


def published_files(name: str) -> dict[str, Any]:
    """Every non-weight file of the named folder (see the module's table): path -> JSON data or text."""
    if name == "embeddinggemma-300m":
        named = {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        }
        files = {
            "config.json": EMBEDDINGGEMMA,
            **gemma3_tokenizer_files(add_eos=True, padding_side="right", named=named),
        }
        return {**files, **embeddinggemma_module_files()}
    if name == "gemma-3-270m":
        return _gemma3_family_files(GEMMA3_270M)
    if name == "gemma-3-1b-it":
        return _gemma3_family_files(GEMMA3_1B, template="config")
    if name == "gemma-3-4b-it":
        return _gemma3_family_files(GEMMA3_4B, template="config", processor=True)
    if name == "gemma-3n-E2B-it":
        named = {
            "audio_token": "<audio_soft_token>", "boa_token": "<start_of_audio>", "boi_token": "<start_of_image>",
            "eoa_token": "<end_of_audio>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>",
        }  # fmt: skip
        files = gemma3_tokenizer_files("gemma3n", named=named, processor_class="Gemma3nProcessor")
        return {
            "config.json": GEMMA3N_E2B,
            "generation_config.json": GEMMA3_GENERATION,
            **files,
            "chat_template.jinja": gemma3_template("<image_soft_token>", "<audio_soft_token>"),
            "processor_config.json": {"audio_seq_length": 188, "image_seq_length": 256, "processor_class": "Gemma3nProcessor"},
            "preprocessor_config.json": GEMMA3N_PREPROCESSOR,
        }  # fmt: skip
    if name.startswith("gemma-4-") and name != "gemma-4-12B-it":
        style = name.removeprefix("gemma-4-").removesuffix("-it").lower()
        return {
            "config.json": gemma4_config(style),
            "generation_config.json": GEMMA4_GENERATION,
            **gemma4_tokenizer_files(),
            "processor_config.json": gemma4_processor(audio=style in ("e2b", "e4b")),
        }
    if name == "gemma-4-12B-it":
        return {
            "config.json": GEMMA4_12B,
            "generation_config.json": GEMMA4_GENERATION,
            **gemma4_tokenizer_files(),
        }
    raise KeyError(f"no published-files fixture named {name!r}; known: {', '.join(PUBLISHED_NAMES)}")


PUBLISHED_NAMES = (
    "embeddinggemma-300m",
    "gemma-3-270m",
    "gemma-3-1b-it",
    "gemma-3-4b-it",
    "gemma-3n-E2B-it",
    "gemma-4-E2B-it",
    "gemma-4-E4B-it",
    "gemma-4-26B-A4B-it",
    "gemma-4-31B-it",
    "gemma-4-12B-it",
)


def write_files(folder: Path, files: dict[str, Any]) -> Path:
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        text = content if isinstance(content, str) else json.dumps(content, indent=2, ensure_ascii=False)
        path.write_text(text, encoding="utf-8")
    return folder


def build_weights(folder: Path, seed: int) -> None:
    """Random weights for the folder's config.json, built and saved by transformers (the class its
    ``architectures`` names), in the published dtype; the published files stay as written."""
    import transformers

    from gemma3n_checkpoints import vision_tower_stub

    config = json.loads((folder / "config.json").read_text())
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    cls = getattr(transformers, config["architectures"][0])
    torch.manual_seed(seed)
    with vision_tower_stub():  # Gemma 3n's timm tower (not installed): a stand-in without weights
        model = cls(hf_config)
    randomize_(model, seed)
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    model.to(getattr(torch, dtype))
    saved = folder.parent / f"{folder.name}-saved"
    model.save_pretrained(saved)
    for path in saved.glob("model*.safetensors*"):
        shutil.move(str(path), folder / path.name)
    shutil.rmtree(saved)
    if (folder / "modules.json").is_file():  # EmbeddingGemma's Dense layers
        from safetensors.torch import save_file

        gen = torch.Generator().manual_seed(seed + 1)
        for dense in ("2_Dense", "3_Dense"):
            spec = json.loads((folder / dense / "config.json").read_text())
            shape = (spec["out_features"], spec["in_features"])
            weight = torch.randn(shape, generator=gen) / spec["in_features"] ** 0.5
            save_file(
                {"linear.weight": weight.to(getattr(torch, dtype))}, folder / dense / "model.safetensors"
            )


def build_published_checkpoint(folder: Path, name: str, seed: int = 0) -> Path:
    write_files(folder, published_files(name))
    build_weights(folder, seed)
    return folder


@pytest.fixture(scope="session")
def published_checkpoint(tmp_path_factory):
    """``published_checkpoint(name)``: the folder of a ``PUBLISHED_NAMES`` fixture, built on first
    use (once per session and worker). Read-only: copy it to change a file."""
    root = tmp_path_factory.mktemp("published")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_published_checkpoint(root / name, name, seed=PUBLISHED_NAMES.index(name))
        return built[name]

    return get

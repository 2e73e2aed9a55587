"""Tiny random Gemma 3n checkpoints, built and saved by transformers: ``gemma3n_text``
(``Gemma3nForCausalLM``) and ``gemma3n`` (``Gemma3nForConditionalGeneration``).

transformers builds Gemma 3n's MobileNet-V5 vision tower through timm (``TimmWrapperModel``), here a
tiny one (timm's ``model_args``: ``VISION_BLOCKS``). timm is not a dependency of torchgemma and needs
torchvision: timm_reference.py imports it with a stand-in for torchvision and lets transformers build
its wrapper on it. Without timm, torchgemma's own MobileNet-V5 (same tensor names) stands in for the
tower with random weights, so that text and audio tests still run; the vision tests skip.
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

# MobileNet-V5 at its smallest, in timm's block notation: four stages of one to three blocks, with
# each kind of block (edge residual; inverted residual with start, middle and end depthwise convs;
# attention with and without the key/value stride) at 8-32 channels; a 4x4 output grid (published:
# 16x16), 16 soft tokens per image.
VISION_BLOCKS = [
    ["er_r1_k3_s2_e4_c8", "er_r1_k3_s1_e4_c8"],
    ["uir_r1_a3_k5_s2_e6_c16", "uir_r1_a5_k0_s1_e4_c16"],
    ["uir_r1_a5_k5_s2_e6_c24", "mqa_r1_k3_h2_v2_s1_d8_c24", "uir_r1_a0_k0_s1_e2_c24"],
    ["uir_r1_a5_k5_s2_e6_c32", "mqa_r1_k3_h2_s1_d8_c32", "uir_r1_a0_k3_s1_e2_p3_c32"],
]
VISION_SOFT_TOKENS = 16


def timm_block_args(stages: list[list[str]]) -> list[list[dict]]:
    """timm's decoded form of blocks in its notation (``decode_arch_def``), as model_args takes them
    (test_gemma3n_vision checks it against timm's own decoder)."""
    out = []
    for stage in stages:
        decoded = []
        for text in stage:
            kind, *options = text.split("_")
            o = {option[0]: option[1:] for option in options}
            block = {"block_type": kind, "out_chs": int(o["c"]), "stride": int(o["s"]), "act_layer": None}
            if kind == "er":
                block.update(exp_kernel_size=int(o["k"]), pw_kernel_size=1, exp_ratio=float(o["e"]))
                block.update(force_in_chs=0, se_ratio=0.0)
            elif kind == "uir":
                block.update(dw_kernel_size_start=int(o.get("a", 0)), dw_kernel_size_mid=int(o["k"]))
                block.update(dw_kernel_size_end=int(o.get("p", 0)), exp_ratio=float(o["e"]), se_ratio=0.0)
            else:
                block.update(dw_kernel_size=int(o["k"]), num_heads=int(o["h"]), key_dim=int(o["d"]))
                block.update(value_dim=int(o["d"]), kv_stride=int(o.get("v", 1)))
            block["noskip"] = False
            decoded.append(block)
        out.append(decoded)
    return out


VISION = dict(
    hidden_size=2048,
    vocab_size=20,
    vocab_offset=260,
    model_args=dict(block_args=timm_block_args(VISION_BLOCKS), stem_size=8, msfa_output_resolution=4),
)
# Two conformer layers; attention chunks of 4 with 5 frames of left context (4 before) and 1 of
# right context (published: 12, 13, 0), so that a second of audio spans several chunks; 128 mel
# bins, as the feature extractor gives.
AUDIO = dict(
    hidden_size=16,
    vocab_size=20,
    vocab_offset=280,
    conf_num_hidden_layers=2,
    conf_num_attention_heads=2,
    conf_attention_chunk_size=4,
    conf_attention_context_left=5,
    conf_attention_context_right=1,
    sscp_conv_channel_size=[4, 3],
    input_feat_size=128,
)
TOKEN_IDS = dict(
    boi_token_id=250,
    eoi_token_id=260,
    image_token_id=261,
    boa_token_id=251,
    eoa_token_id=280,
    audio_token_id=281,
    vision_soft_tokens_per_image=VISION_SOFT_TOKENS,
)


class OwnVisionTower(nn.Module):
    """Without timm: torchgemma's MobileNet-V5 where transformers' TimmWrapperModel would be (the
    same tensor names), to make and load checkpoints whose vision tower goes unused."""

    def __init__(self, config):
        super().__init__()
        from torchgemma.config.gemma3n_vision import vision_config_from_hf
        from torchgemma.model.gemma3n_vision import MobileNetV5Encoder

        side = (config.model_args or {}).get("msfa_output_resolution", 16)
        ours = vision_config_from_hf(config.to_dict(), {"vision_soft_tokens_per_image": side * side})
        self.timm_model = MobileNetV5Encoder(ours)

    def forward(self, *args, **kwargs):
        raise NotImplementedError("timm is not installed: this stands in for Gemma 3n's vision tower")


@contextlib.contextmanager
def vision_tower_stub():
    """transformers builds Gemma 3n's vision tower on timm (timm_reference.py), or, without timm,
    on torchgemma's own MobileNet-V5 (``OwnVisionTower``)."""
    from timm_reference import timm_available, timm_in_transformers

    if timm_available():
        with timm_in_transformers():
            yield
        return
    from transformers import Gemma3nVisionConfig
    from transformers.models.gemma3n import modeling_gemma3n

    real = modeling_gemma3n.AutoModel

    class AutoModel:
        @staticmethod
        def from_config(config, **kwargs):
            if isinstance(config, Gemma3nVisionConfig):
                return OwnVisionTower(config)
            return real.from_config(config, **kwargs)

    modeling_gemma3n.AutoModel = AutoModel
    try:
        yield
    finally:
        modeling_gemma3n.AutoModel = real


def text_config(**changes):
    from transformers import Gemma3nTextConfig

    return Gemma3nTextConfig(**{**TEXT, **changes})


def build(
    folder: Path,
    multimodal: bool,
    *,
    seed: int = 0,
    embed_scale: float = 1.0,
    token_ids: dict[str, int] | None = None,
    **changes,
) -> Path:
    """A ``gemma3n`` (multimodal layout) or ``gemma3n_text`` checkpoint with every parameter random.

    ``embed_scale`` < 1 shrinks the token embeddings, so that greedy continuations vary (with large
    tied embeddings every token predicts itself). ``changes`` go to the text config; the towers'
    vocabularies take the last 40 ids of ``vocab_size``. ``token_ids`` override ``TOKEN_IDS`` (a
    tokenizer's own media ids).
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
            **{**TOKEN_IDS, **(token_ids or {})},
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


# HF -> llama.cpp names for Gemma 3n (gguf.constants / gguf.tensor_mapping), for the test writer.
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
    "altup.correction_coefs.weight": "altup_correct_coef.weight",
    "altup.correct_output_scale": "altup_correct_scale.weight",
    "altup.prediction_coefs.weight": "altup_predict_coef.weight",
    "altup.modality_router.weight": "altup_router.weight",
    "altup.router_norm.weight": "altup_router_norm.weight",
    "laurel.linear_left.weight": "laurel_l.weight",
    "laurel.linear_right.weight": "laurel_r.weight",
    "laurel.post_laurel_norm.weight": "laurel_post_norm.weight",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}
# A GGUF-sized Gemma 3n: the fixture tokenizer's 1024 ids, widths that take block quantization,
# a per-layer table of 1000 rows that the converter pads to the vocabulary.
GGUF_TEXT = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=[128, 128, 256, 128, 128, 128],
    hidden_size_per_layer_input=32,
    vocab_size_per_layer_input=1000,
    laurel_rank=32,
    eos_token_id=1,
)


def write_gemma3n_gguf(path: Path, model, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a ``Gemma3nForCausalLM`` as llama.cpp's converter (``Gemma3NModel``) does: its metadata
    keys, the AltUp projections stacked, the per-layer table padded with zero rows to the
    vocabulary, ``.weight`` added to correct_output_scale, no norm shift, matrices quantized. Returns
    HF name -> the float32 values each tensor must read back as."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter

    from gguf_fixtures import TYPES_32, TYPES_256, _pack, _stored, _write_vocab

    rng = np.random.default_rng(seed)
    config = model.config
    writer = GGUFWriter(str(path), "gemma3n")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)
    writer.add_altup_active_idx(config.altup_active_idx)
    writer.add_altup_num_inputs(config.altup_num_inputs)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input)
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    normal = torch.distributions.normal.Normal(0, 1)
    writer.add_activation_sparsity_scale(
        [normal.icdf(torch.tensor(p, dtype=torch.float32)).item() for p in config.activation_sparsity_pattern]
    )
    writer.add_sliding_window_pattern([t == SLIDING for t in config.layer_types])
    writer.add_file_type(1)
    _write_vocab(writer, False, None)

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    table = state["model.embed_tokens_per_layer.weight"]
    state["model.embed_tokens_per_layer.weight"] = np.concatenate(
        [table, np.zeros((config.vocab_size - table.shape[0], table.shape[1]), np.float32)]
    )
    stacked = {}
    for name in ("altup_projections", "altup_unembed_projections"):
        parts = [state.pop(f"model.{name}.{i}.weight") for i in range(config.altup_num_inputs - 1)]
        stacked[name] = np.stack(parts)
    expected: dict[str, torch.Tensor] = {}
    cycle_32 = cycle_256 = 0
    items = [(name, value, None) for name, value in state.items()]
    items += [(name, value, "stack") for name, value in stacked.items()]
    for name, value, kind in items:
        if value.ndim <= 1:
            qtype = T.F32
        elif value.shape[-1] % 32:
            qtype = T.F16
        elif value.shape[-1] % 256 == 0:
            qtype, cycle_256 = TYPES_256[cycle_256 % len(TYPES_256)], cycle_256 + 1
        else:
            qtype, cycle_32 = TYPES_32[cycle_32 % len(TYPES_32)], cycle_32 + 1
        packed = _pack(value, qtype, rng)
        stored = torch.from_numpy(_stored(packed, qtype).reshape(value.shape).copy())
        if kind == "stack":
            writer.add_tensor(
                "altup_proj.weight" if name == "altup_projections" else "altup_unembd_proj.weight",
                packed,
                raw_dtype=qtype,
            )
            for i in range(value.shape[0]):
                expected[f"model.{name}.{i}.weight"] = stored[i].clone()
            continue
        if name in _GGUF_GLOBAL:
            gguf_name = _GGUF_GLOBAL[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{_GGUF_LAYER[rest]}"
        writer.add_tensor(gguf_name, packed, raw_dtype=qtype)
        expected[name] = stored
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected

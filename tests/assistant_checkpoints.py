"""Tiny random Gemma 4 MTP drafters ("assistants") built with transformers, each beside a tiny target.

A drafter's config follows its target's (checkpoints.py): the same vocabulary, the target's hidden
size as ``backbone_hidden_size``, and per attention type the head geometry and RoPE of the target
layers it reads. transformers 5.23 cannot build a drafter as released: ``Gemma4TextConfig.
kv_sharing_modes`` raises when every layer is KV-shared (the case of every drafter), so
``drafters_buildable`` gives the all-shared config the modes its modeling code expects ("reuse" for
every layer) for as long as a test runs.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from checkpoints import COMMON, FULL, SLIDING, STYLES, UNIFIED_STYLES, randomize_

# The drafter's own decoder: narrower than the target, two or three layers.
DRAFTER = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, head_dim=16, global_head_dim=32)
# E2B/E4B's centroid head, at this vocabulary (300 tokens in 10 clusters of 30; the top 3 scored).
CENTROIDS = dict(use_ordered_embeddings=True, num_centroids=10, centroid_intermediate_top_k=3)


@contextlib.contextmanager
def drafters_buildable():
    """transformers 5.23's text configs with every layer KV-shared give every layer the mode "reuse"
    (as released they raise)."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.gemma4_unified.configuration_gemma4_unified import Gemma4UnifiedTextConfig

    saved = {cls: cls.__dict__["kv_sharing_modes"] for cls in (Gemma4TextConfig, Gemma4UnifiedTextConfig)}

    def patched(original):
        def modes(self):
            if self.num_kv_shared_layers == self.num_hidden_layers:
                return ["reuse"] * self.num_hidden_layers
            return original.fget(self)

        return property(modes)

    try:
        for cls, original in saved.items():
            cls.kv_sharing_modes = patched(original)
        yield
    finally:
        for cls, original in saved.items():
            cls.kv_sharing_modes = original


def target_fields(style: str, unified: bool = False) -> dict:
    return {**COMMON, **(UNIFIED_STYLES if unified else STYLES)[style]}


def drafter_text_fields(style: str, unified: bool = False, layer_types=(SLIDING, SLIDING, FULL)) -> dict:
    """The drafter's text config for a target of ``style``: the target's KV geometry and window."""
    target = target_fields(style, unified)
    fields = {
        **DRAFTER,
        "vocab_size": target["vocab_size"],
        "sliding_window": target["sliding_window"],
        "num_key_value_heads": target["num_key_value_heads"],
        "num_hidden_layers": len(layer_types),
        "layer_types": list(layer_types),
        "max_position_embeddings": target["max_position_embeddings"],
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": target["eos_token_id"],
    }
    if target.get("attention_k_eq_v"):
        # The target's full layers have their own KV-head count (K=V): so do the drafter's.
        fields.update(attention_k_eq_v=True, num_global_key_value_heads=target["num_global_key_value_heads"])
    if not unified:
        fields.update(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    return fields


def build_target(folder: Path, style: str, *, unified: bool = False, seed: int = 0, dtype=torch.float32):
    """``gemma4_text`` / ``gemma4_unified_text`` target of ``style``."""
    from transformers import (
        Gemma4ForCausalLM,
        Gemma4TextConfig,
        Gemma4UnifiedForCausalLM,
        Gemma4UnifiedTextConfig,
    )

    torch.manual_seed(seed)
    config_class, model_class = (
        (Gemma4UnifiedTextConfig, Gemma4UnifiedForCausalLM)
        if unified
        else (Gemma4TextConfig, Gemma4ForCausalLM)
    )
    model = model_class(config_class(**target_fields(style, unified))).to(dtype)
    randomize_(model, seed)
    model.save_pretrained(folder)
    return folder


def build_drafter(
    folder: Path,
    style: str,
    *,
    unified: bool = False,
    ordered: bool = False,
    seed: int = 1,
    dtype=torch.float32,
    text_overrides: dict | None = None,
    **top_level,
):
    """A ``gemma4_assistant`` (``gemma4_unified_assistant``) drafter for a target of ``style``;
    ``ordered``: with the centroid head (a random token ordering)."""
    from transformers import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
        Gemma4TextConfig,
        Gemma4UnifiedAssistantConfig,
        Gemma4UnifiedAssistantForCausalLM,
        Gemma4UnifiedTextConfig,
    )

    text_fields = {**drafter_text_fields(style, unified), **(text_overrides or {})}
    fields = {"backbone_hidden_size": COMMON["hidden_size"], **(CENTROIDS if ordered else {}), **top_level}
    with drafters_buildable():
        if unified:
            config = Gemma4UnifiedAssistantConfig(
                text_config=Gemma4UnifiedTextConfig(**text_fields), **fields
            )
            model_class = Gemma4UnifiedAssistantForCausalLM
        else:
            config = Gemma4AssistantConfig(text_config=Gemma4TextConfig(**text_fields), **fields)
            model_class = Gemma4AssistantForCausalLM
        torch.manual_seed(seed)
        model = model_class(config).to(dtype)
        randomize_(model, seed)
        if ordered:
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                model.masked_embedding.token_ordering.copy_(
                    torch.randperm(COMMON["vocab_size"], generator=gen)
                )
        model.save_pretrained(folder)
    return folder


def reference_drafter(folder: Path, dtype=torch.float32, attention: str = "eager"):
    """transformers' drafter of a saved checkpoint (eager attention unless told otherwise)."""
    from transformers import AutoModelForCausalLM

    with drafters_buildable():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attention)
    return model.eval()


# llama.cpp's names for a drafter's tensors (gguf.constants / tensor_mapping), written independently
# of torchgemma.weights.gguf.
_GGUF_GLOBALS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "pre_projection.weight": "nextn.pre_projection.weight",
    "post_projection.weight": "nextn.post_projection.weight",
    "masked_embedding.centroids.weight": "masked_embd_centroids.weight",
    "masked_embedding.token_ordering": "masked_embd_ordering",
}
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "layer_scalar": "layer_output_scale.weight",
}


def write_drafter_gguf(path: Path, folder: Path, *, centroids: bool = False) -> Path:
    """The drafter at ``folder`` as llama.cpp's converter writes it (``Gemma4AssistantModel``):
    arch ``gemma4-assistant``, float32 tensors under llama.cpp's names, the tied head not written,
    ``rope_freqs`` for the full layers' proportional RoPE. Its converter drops the centroid head;
    ``centroids=True`` writes it anyway (a reader must skip it, as llama.cpp's graph ignores it)."""
    import json

    import numpy as np
    from gguf import GGUFWriter
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    writer = GGUFWriter(str(path), "gemma4-assistant")
    n_layers = text["num_hidden_layers"]
    swa = [t == SLIDING for t in text["layer_types"]]
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_block_count(n_layers)
    writer.add_head_count(text["num_attention_heads"])
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    writer.add_sliding_window(text["sliding_window"])
    rope = text["rope_parameters"]
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_feed_forward_length(text["intermediate_size"])
    full_kv = text["per_layer_config"][str(swa.index(False))].get("num_key_value_heads")
    if full_kv is not None:
        writer.add_head_count_kv([text["num_key_value_heads"] if s else full_kv for s in swa])
    else:
        writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_shared_kv_layers(n_layers)
    writer.add_embedding_length_per_layer_input(0)
    writer.add_sliding_window_pattern(swa)
    global_head_dim = text["per_layer_config"][str(swa.index(False))]["head_dim"]
    writer.add_key_length(global_head_dim)
    writer.add_value_length(global_head_dim)
    writer.add_key_length_swa(text["head_dim"])
    writer.add_value_length_swa(text["head_dim"])
    writer.add_embedding_length_out(config["backbone_hidden_size"])
    writer.add_nextn_predict_layers(n_layers)
    for hf_name, value in load_file(folder / "model.safetensors").items():
        if hf_name == "lm_head.weight" or (hf_name.startswith("masked_embedding.") and not centroids):
            continue
        if hf_name.startswith("model.layers."):
            _, _, layer, rest = hf_name.split(".", 3)
            name = f"blk.{layer}.{_GGUF_LAYER[rest]}"
        else:
            name = _GGUF_GLOBALS[hf_name]
        array = value.numpy() if not value.is_floating_point() else value.float().numpy()
        writer.add_tensor(name, array.astype(np.int32) if array.dtype == np.int64 else array)
    n_rot = int(global_head_dim * rope["full_attention"]["partial_rotary_factor"] / 2)
    factors = [1.0] * n_rot + [1e30] * (global_head_dim // 2 - n_rot)
    writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_echo_pair(target: Path, drafter: Path, embed_scale: float = 0.5, seed: int = 0) -> None:
    """Rewrite a built pair so that drafts are often, not always, accepted (random drafters almost
    never are, which leaves a speculative engine's accepting paths untried).

    The target's tied embeddings are scaled up, so that its tokens tend to repeat (at 0.5 on the
    E2B style: runs of repeats broken now and then); the drafter echoes the token it reads: its
    pre_projection keeps an orthonormal projection A of the target's token embedding (the hidden
    state's half zeroed), its own table is the target's table times A^T (so the echoed token scores
    highest), and its layers' output projections are nearly silenced."""
    from safetensors.torch import load_file, save_file

    weights = load_file(target / "model.safetensors")
    table = weights["model.embed_tokens.weight"] * embed_scale
    weights["model.embed_tokens.weight"] = table
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})

    own = load_file(drafter / "model.safetensors")
    width, backbone = own["pre_projection.weight"].shape[0], table.shape[1]
    gen = torch.Generator().manual_seed(seed)
    projection = torch.linalg.qr(torch.randn(backbone, width, generator=gen))[0].T  # (width, backbone)
    own["pre_projection.weight"] = torch.cat([projection, torch.zeros(width, backbone)], dim=1)
    own["model.embed_tokens.weight"] = table @ projection.T
    for name in own:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            own[name] = own[name] * 0.01
        elif name.endswith("layer_scalar"):
            own[name] = torch.ones_like(own[name])
    save_file(own, drafter / "model.safetensors", metadata={"format": "pt"})

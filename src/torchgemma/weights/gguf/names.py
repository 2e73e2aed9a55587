"""GGUF tensor names -> Hugging Face checkpoint names, per architecture.

llama.cpp's converter renames every tensor (``blk.3.attn_q.weight`` for
``model.layers.3.self_attn.q_proj.weight``), stacks or splits a few, and for Gemma 3 stores RMSNorm
weights as ``1 + w``. The tables below undo that, one ``ArchNames`` record per architecture, so
that ``plan_tensors`` reads the same for all three.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .reader import GGUFError, _GGUFFile, _TensorInfo

# Per-layer names llama.cpp gives Gemma 3 and Gemma 4 tensors (gguf.constants.TENSOR_NAMES /
# gguf.tensor_mapping), to the module path under `model.layers.N.` in transformers.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GEMMA4_LAYER_NAMES = {
    **_LAYER_NAMES,
    # MoE (26B-A4B): the dense MLP above is the "shared expert" beside these.
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",  # the converter files router.scale under the router's name
    "ffn_down_exps.scale": "router.per_expert_scale",  # ...and per_expert_scale as a down_exps scale
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",  # [E, 2I, H], gate rows first, as in HF
    "ffn_down_exps.weight": "experts.down_proj",  # [E, H, I]
    # The persistent buffer `layer_scalar`; the converter adds ".weight" to its name.
    "layer_output_scale.weight": "layer_scalar",
    # Per-layer embeddings (E2B/E4B).
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
}
# Gemma 3n: PLE as Gemma 4's, AltUp and LAuReL (gguf.constants: the gemma3n tensors). The converter
# adds ".weight" to correct_output_scale's name.
_GEMMA3N_LAYER_NAMES = {
    **_LAYER_NAMES,
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "altup_correct_coef.weight": "altup.correction_coefs.weight",
    "altup_correct_scale.weight": "altup.correct_output_scale",
    "altup_predict_coef.weight": "altup.prediction_coefs.weight",
    "altup_router.weight": "altup.modality_router.weight",
    "altup_router_norm.weight": "altup.router_norm.weight",
    "laurel_l.weight": "laurel.linear_left.weight",
    "laurel_r.weight": "laurel.linear_right.weight",
    "laurel_post_norm.weight": "laurel.post_laurel_norm.weight",
}
# Gemma 3n's N - 1 AltUp projections (HF: a module list), stacked by the converter into one tensor.
_STACKED = {
    "altup_proj.weight": "altup_projections",
    "altup_unembd_proj.weight": "altup_unembed_projections",
}
# Converters that keep gate and up experts apart write these two; they are concatenated on dim 1.
_SPLIT_EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight")

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
}
_GEMMA4_GLOBAL_NAMES = {
    **_GLOBAL_NAMES,
    "per_layer_token_embd.weight": "embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "per_layer_projection_norm.weight",
}
# Not checkpoint tensors: llama.cpp's encoding of Gemma 4's proportional RoPE (read into the config).
_DERIVED = ("rope_freqs.weight",)

_BLOCK = re.compile(r"blk\.(\d{1,9})\.(.+)")


@dataclass(frozen=True)
class ArchNames:
    """How llama.cpp's converter names (and stores) one architecture's tensors."""

    # blk.N.{GGUF suffix} -> model.layers.N.{HF name}
    layer: dict[str, str]
    # GGUF name -> model.{HF name}
    globals: dict[str, str]
    # Gemma 3's RMSNorm computes x * (1 + w) and llama.cpp stores 1 + w; Gemma 3n's and Gemma 4's use
    # w directly and their converters add nothing (norm_shift 0).
    shifted_norms: bool = False
    # GGUF name of a stacked tensor -> the HF module list its matrices go to.
    stacked: dict[str, str] = field(default_factory=dict)
    # Gate and up experts may come as two tensors (_SPLIT_EXPERTS).
    split_experts: bool = False
    # What every layer holds, whatever its type (sliding or full, KV-shared, MoE): its input norm,
    # query and output projections. Checked on the tensor table before any model is built.
    every_layer: tuple[str, ...] = ("attn_norm.weight", "attn_q.weight", "attn_output.weight")


ARCHITECTURES = {
    "gemma3": ArchNames(_LAYER_NAMES, _GLOBAL_NAMES, shifted_norms=True),
    "gemma3n": ArchNames(_GEMMA3N_LAYER_NAMES, _GEMMA4_GLOBAL_NAMES, stacked=_STACKED),
    "gemma4": ArchNames(_GEMMA4_LAYER_NAMES, _GEMMA4_GLOBAL_NAMES, split_experts=True),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


@dataclass(frozen=True)
class Entry:
    """One Hugging Face tensor and the GGUF tensor(s) it is made from."""

    hf_name: str
    sources: tuple[str, ...]  # several: concatenated along dim 1 (split gate/up experts)
    shift_norm: bool = False  # Gemma 3 RMSNorm weights are stored as 1 + w
    part: int | None = None  # one matrix of a stacked source (Gemma 3n's AltUp projections)


def check_layers(file: _GGUFFile, arch: str) -> None:
    """The layer count must be what the tensor table holds: blk.0.* to blk.{n-1}.*, each present
    with the tensors every layer has (``ArchNames.every_layer``). Read from the table alone, so that a
    file claiming many layers it does not hold is refused at once, not after a model of that many
    layers is built to compare shapes against (512 layers: seconds)."""
    key = f"{arch}.block_count"
    if key not in file.metadata:
        raise GGUFError(f"{file.name} lacks the metadata key {key}")
    n_layers = file.metadata[key]
    found = sorted({int(m.group(1)) for name in file.tensors if (m := _BLOCK.fullmatch(name))})
    if found != list(range(n_layers)):
        held = f"blk.N tensors for {len(found)} layers ({_spans(found)})" if found else "no blk.N tensors"
        raise GGUFError(f"{file.name}: metadata key {key} is {n_layers}, but its tensor table has {held}")
    required = ARCHITECTURES[arch].every_layer
    lacking = [
        f"blk.{i}.{suffix}"
        for i in range(n_layers)
        for suffix in required
        if f"blk.{i}.{suffix}" not in file.tensors
    ]
    if lacking:
        raise GGUFError(
            f"{file.name}: every layer needs {', '.join(required)}; its tensor table lacks {len(lacking)} of "
            f"them, e.g. {', '.join(lacking[:4])}"
        )


def _spans(numbers: list[int]) -> str:
    """Sorted ints as ranges: [0, 1, 2, 5] -> "0-2, 5" (the first few)."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    text = [f"{a}-{b}" if b > a else f"{a}" for a, b in spans[:4]]
    return ", ".join(text) + (", ..." if len(spans) > 4 else "")


def hf_shape(parts: list[_TensorInfo]) -> tuple[int, ...]:
    """The shape of the tensor made from ``parts`` (split experts: concatenated along dim 1)."""
    shapes = [t.shape for t in parts]
    if len(shapes) == 1:
        return shapes[0]
    first = shapes[0]
    return (first[0], sum(s[1] for s in shapes), *first[2:])


def plan_tensors(
    arch: str, config: dict, gguf: Mapping[str, _TensorInfo], fname: str
) -> tuple[list[Entry], list[str]]:
    """Which Hugging Face tensor comes from which GGUF tensor(s), in file order, and the GGUF
    tensors left out, each with the reason."""
    names = ARCHITECTURES[arch]
    n_layers = config["num_hidden_layers"]
    first_shared = n_layers - config.get("num_kv_shared_layers", 0)

    entries: list[Entry] = []
    skipped: list[str] = []
    unknown: list[str] = []
    for name in gguf:  # file order
        if name in _DERIVED:
            skipped.append(f"{name}: llama.cpp's RoPE frequency factors, read into rope_parameters")
            continue
        if name == "output.weight":
            entries.append(Entry("lm_head.weight", (name,)))
            continue
        if name in names.stacked:
            for part in range(gguf[name].shape[0]):
                entries.append(Entry(f"model.{names.stacked[name]}.{part}.weight", (name,), part=part))
            continue
        if name in names.globals:
            hf = names.globals[name]
            entries.append(Entry(f"model.{hf}", (name,), names.shifted_norms and hf.endswith("norm.weight")))
            continue
        match = _BLOCK.fullmatch(name)
        if match is None:
            unknown.append(name)
            continue
        layer, suffix = int(match.group(1)), match.group(2)
        if layer >= n_layers:
            unknown.append(name)
            continue
        if suffix in _SPLIT_EXPERTS and names.split_experts:
            if suffix == _SPLIT_EXPERTS[0]:
                up = f"blk.{layer}.{_SPLIT_EXPERTS[1]}"
                if up not in gguf:
                    raise GGUFError(f"{fname}: {name} has no matching {up}")
                entries.append(Entry(f"model.layers.{layer}.experts.gate_up_proj", (name, up)))
            elif f"blk.{layer}.{_SPLIT_EXPERTS[0]}" not in gguf:
                raise GGUFError(f"{fname}: {name} has no matching blk.{layer}.{_SPLIT_EXPERTS[0]}")
            continue
        hf = names.layer.get(suffix)
        if hf is None:
            unknown.append(name)
            continue
        if layer >= first_shared and hf.startswith(
            ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.")
        ):
            # KV-shared layers read another layer's K/V; HF builds no k/v weights for them.
            skipped.append(f"{name}: layer {layer} reuses K/V of an earlier layer")
            continue
        shift = names.shifted_norms and hf.endswith("norm.weight")
        entries.append(Entry(f"model.layers.{layer}.{hf}", (name,), shift))
    if unknown:
        raise GGUFError(
            f"{fname}: {len(unknown)} tensor(s) with no known Hugging Face {arch} name, e.g. {', '.join(unknown[:5])}"
        )
    return entries, skipped

"""GGUF metadata -> a Hugging Face ``config.json`` dict (``Gemma3ForCausalLM``, ``Gemma3nForCausalLM``,
``Gemma4ForCausalLM``): the ``{arch}.*`` keys, llama.cpp's defaults for those a file omits, and the
few facts only the tensor table states (tied head, K=V, the PLE table's rows, proportional RoPE).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .blocks import dequantize
from .reader import GGUFError, _GGUFFile, _TensorInfo


def read_config(file: _GGUFFile) -> dict[str, Any]:
    """The config.json dict of a file whose architecture is gemma3, gemma3n or gemma4."""
    arch = file.metadata["general.architecture"]
    return {"gemma3": _gemma3_config, "gemma3n": _gemma3n_config, "gemma4": _gemma4_config}[arch](file)


class _Meta:
    """Metadata lookups under the architecture's prefix, with errors that name the file."""

    def __init__(self, metadata: Mapping[str, Any], arch: str, fname: str):
        self.m, self.arch, self.fname = metadata, arch, fname

    def get(self, key: str, default: Any = None) -> Any:
        return self.m.get(f"{self.arch}.{key}", default)

    def need(self, key: str) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.m:
            raise GGUFError(f"{self.fname} lacks the metadata key {full}")
        return self.m[full]

    def uniform(self, key: str, default: Any = None, required: bool = False) -> Any:
        """A value llama.cpp allows as a scalar or a per-layer array, where HF has one value."""
        value = self.need(key) if required else self.get(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise GGUFError(
                    f"{self.fname}: {self.arch}.{key} varies per layer ({value}), which the HF config cannot express"
                )
            return value[0]
        return value


def _token_ids(metadata: Mapping[str, Any]) -> dict[str, Any]:
    # Absent ids fall back to the Gemma config classes' defaults (pad 0, eos 1, bos 2).
    return {
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id", 0),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id", 1),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id", 2),
    }


def _vocab_size(meta: _Meta, gguf: Mapping[str, _TensorInfo]) -> int:
    # llama.cpp: `{arch}.vocab_size`, else the length of the token list (as transformers does).
    size = meta.get("vocab_size")
    if size is None and "tokenizer.ggml.tokens" in meta.m:
        size = len(meta.m["tokenizer.ggml.tokens"])
    if size is None and "token_embd.weight" in gguf:
        size = gguf["token_embd.weight"].shape[0]
    if size is None:
        raise GGUFError(f"{meta.fname} states no vocabulary size (no vocab_size, token list or token_embd)")
    return int(size)


def _swa_layers(meta: _Meta, n_layers: int, default_period: int) -> list[bool]:
    """Which layers are sliding-window, from `attention.sliding_window_pattern` or llama.cpp's default.

    The key is either one bool per layer (True = sliding) or a period n: layer i is sliding unless
    i % n == n - 1 (llama.cpp's `set_swa_pattern(n)`, dense layer last in each group).
    """
    pattern = meta.get("attention.sliding_window_pattern", default_period)
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise GGUFError(
                f"{meta.fname}: sliding_window_pattern has {len(pattern)} entries for {n_layers} layers"
            )
        return [bool(p) for p in pattern]
    period = int(pattern)
    if period <= 1:
        return [False] * n_layers
    return [i % period < period - 1 for i in range(n_layers)]


def _layer_types(swa: list[bool]) -> list[str]:
    return ["sliding_attention" if s else "full_attention" for s in swa]


def _common(
    meta: _Meta, gguf: Mapping[str, _TensorInfo], model_type: str, architecture: str
) -> dict[str, Any]:
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": _vocab_size(meta, gguf),
        "hidden_size": meta.need("embedding_length"),
        "num_hidden_layers": meta.need("block_count"),
        "num_attention_heads": meta.uniform("attention.head_count", required=True),
        "rms_norm_eps": meta.get("attention.layer_norm_rms_epsilon", 1e-6),
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        # llama.cpp writes output.weight only when the LM head is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in gguf,
        **_token_ids(meta.m),
    }


def _gemma3_config(file: _GGUFFile) -> dict[str, Any]:
    gguf, fname = file.tensors, file.name
    meta = _Meta(file.metadata, "gemma3", fname)
    config = _common(meta, gguf, "gemma3_text", "Gemma3ForCausalLM")
    n_layers = config["num_hidden_layers"]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = meta.get("attention.key_length", hidden // heads)

    # llama.cpp (load_hparams, GEMMA3): sliding layers only when a positive window is stated, then
    # five sliding to one full layer unless a pattern says otherwise, local RoPE base 10000.
    window = meta.get("attention.sliding_window", 0)
    swa = _swa_layers(meta, n_layers, 6) if window else [False] * n_layers

    full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": meta.get("rope.freq_base", 10000.0)}
    scaling = meta.get("rope.scaling.type", "none")
    if scaling == "linear":
        # The converter writes the full-attention layers' linear scaling (Gemma 3 4B and up: factor 8).
        full_rope = {
            "rope_type": "linear",
            "factor": meta.need("rope.scaling.factor"),
            "rope_theta": full_rope["rope_theta"],
        }
    elif scaling not in ("none", None):
        raise GGUFError(f"{fname}: RoPE scaling {scaling!r} is not supported for gemma3")

    # llama.cpp's attention scale: 1/sqrt(hidden/heads) for the 62-layer 27B, else 1/sqrt(head_dim)
    # (from gemma_pytorch); HF states the same as query_pre_attn_scalar.
    query_pre_attn_scalar = hidden // heads if n_layers == 62 else head_dim

    config.update(
        intermediate_size=meta.uniform("feed_forward_length", required=True),
        num_key_value_heads=meta.uniform("attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=meta.get("context_length", 131072),
        query_pre_attn_scalar=query_pre_attn_scalar,
        sliding_window=window if any(swa) else None,
        layer_types=_layer_types(swa),
        rope_parameters={
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": meta.get("rope.freq_base_swa", 10000.0),
            },
            "full_attention": full_rope,
        },
        # Gemma 3 has no attention soft-capping (llama.cpp ignores the key for gemma3).
        final_logit_softcapping=meta.get("final_logit_softcapping"),
        attn_logit_softcapping=None,
        use_bidirectional_attention=False,
    )
    return config


def _gemma4_config(file: _GGUFFile) -> dict[str, Any]:
    gguf, fname = file.tensors, file.name
    meta = _Meta(file.metadata, "gemma4", fname)
    config = _common(meta, gguf, "gemma4_text", "Gemma4ForCausalLM")
    n_layers, heads = config["num_hidden_layers"], config["num_attention_heads"]

    # The converter writes one bool per layer (True = sliding) and llama.cpp requires it.
    if not isinstance(meta.get("attention.sliding_window_pattern"), list):
        raise GGUFError(f"{fname} lacks gemma4.attention.sliding_window_pattern (one bool per layer)")
    swa = _swa_layers(meta, n_layers, 0)
    shared = meta.get("attention.shared_kv_layers", 0)
    first_shared = n_layers - shared

    # Head dims: key_length is the full-attention layers' (HF global_head_dim), key_length_swa the
    # sliding layers' (HF head_dim).
    global_head_dim = meta.need("attention.key_length")
    head_dim = meta.get("attention.key_length_swa", global_head_dim)

    num_kv, global_kv = _gemma4_kv_heads(meta, swa, heads)

    # K = V: full-attention layers that compute their own K/V but carry no attn_v.
    owners = [i for i in range(n_layers) if not swa[i] and i < first_shared]
    k_eq_v = bool(owners) and all(f"blk.{i}.attn_v.weight" not in gguf for i in owners)
    if global_kv is not None and global_kv != num_kv and not k_eq_v:
        raise GGUFError(
            f"{fname}: full-attention layers have {global_kv} KV heads and sliding ones {num_kv}, which HF "
            f"Gemma 4 expresses only for K=V models, but the full layers have attn_v tensors"
        )

    ff, double_wide = _gemma4_mlp_width(meta, n_layers, first_shared)

    partial = _partial_rotary_factor(file, global_head_dim)
    ple = meta.get("embedding_length_per_layer_input", 0)
    ple_table = gguf.get("per_layer_token_embd.weight")
    experts = meta.get("expert_count", 0) or 0

    config.update(
        intermediate_size=ff,
        num_key_value_heads=num_kv,
        num_global_key_value_heads=global_kv,
        head_dim=head_dim,
        global_head_dim=global_head_dim,
        max_position_embeddings=meta.get("context_length", 131072),
        sliding_window=meta.need("attention.sliding_window"),
        layer_types=_layer_types(swa),
        rope_parameters=gemma4_rope(meta, partial),
        final_logit_softcapping=meta.get("final_logit_softcapping"),
        # Only the multimodal model reads this ("vision" on 26B/31B); GGUF metadata does not record it.
        use_bidirectional_attention=None,
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=ple_table.shape[0] if ple_table is not None else 262144,
        attention_k_eq_v=k_eq_v,
        num_kv_shared_layers=shared,
        use_double_wide_mlp=double_wide,
        enable_moe_block=experts > 0,
        num_experts=experts or None,
        top_k_experts=meta.get("expert_used_count") if experts else None,
        moe_intermediate_size=meta.uniform("expert_feed_forward_length") if experts else None,
    )
    config["eos_token_id"] = _gemma4_eos(file.metadata, config["eos_token_id"])
    return config


def _gemma4_kv_heads(meta: _Meta, swa: list[bool], heads: int) -> tuple[int, int | None]:
    """(num_key_value_heads, num_global_key_value_heads): a scalar when both layer types agree (no
    global count), else one count per layer (sliding: HF num_key_value_heads, full: the global)."""
    kv = meta.get("attention.head_count_kv", heads)
    if not isinstance(kv, list):
        return kv, None
    sliding_kv = {k for k, s in zip(kv, swa) if s}
    full_kv = {k for k, s in zip(kv, swa) if not s}
    if len(sliding_kv) > 1 or len(full_kv) > 1:
        raise GGUFError(f"{meta.fname}: head_count_kv {kv} is not one value per layer type")
    num_kv = sliding_kv.pop() if sliding_kv else full_kv.copy().pop()
    return num_kv, full_kv.pop() if full_kv else None


def _gemma4_mlp_width(meta: _Meta, n_layers: int, first_shared: int) -> tuple[int, bool]:
    """(intermediate_size, use_double_wide_mlp): the dense MLP width is one value, or per layer when
    the KV-shared layers are double width (E2B)."""
    ff = meta.need("feed_forward_length")
    if not isinstance(ff, list):
        return ff, False
    base = ff[0]
    if ff == [base] * n_layers:
        return base, False
    if ff == [base if i < first_shared else 2 * base for i in range(n_layers)]:
        return base, True
    raise GGUFError(
        f"{meta.fname}: feed_forward_length {ff} is neither uniform nor double width on KV-shared layers"
    )


def _partial_rotary_factor(file: _GGUFFile, global_head_dim: int) -> float:
    """Proportional RoPE on full layers: llama.cpp rotates the first n dims and marks the rest with
    frequency factors of 1e30 in rope_freqs (one per rotated pair), so partial_rotary_factor is
    2 * (pairs with factor 1) / head dim (0.25, transformers' default, without rope_freqs)."""
    info = file.tensors.get("rope_freqs.weight")
    if info is None:
        return 0.25
    factors = dequantize(file.raw(info), info.qtype, info.shape).numpy()
    return 2 * int(np.count_nonzero(factors < 1e20)) / global_head_dim


def gemma4_rope(meta, partial_rotary_factor: float) -> dict:
    """Gemma 4's rope_parameters as transformers' config has them, from llama.cpp's keys: default
    RoPE on sliding layers, proportional RoPE on a fraction of the full layers' dimensions."""
    return {
        "sliding_attention": {"rope_type": "default", "rope_theta": meta.get("rope.freq_base_swa", 10000.0)},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": partial_rotary_factor,
            "rope_theta": meta.get("rope.freq_base", 1000000.0),
        },
    }


def _gemma3n_config(file: _GGUFFile) -> dict[str, Any]:
    gguf, fname = file.tensors, file.name
    meta = _Meta(file.metadata, "gemma3n", fname)
    config = _common(meta, gguf, "gemma3n_text", "Gemma3nForCausalLM")
    n_layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    # llama.cpp (load_hparams, GEMMA3N): one bool per layer (or a period, 5 by default: four
    # sliding layers, then a full one), attention scale 1, local RoPE base 10000.
    swa = _swa_layers(meta, n_layers, 5)
    ff = meta.need("feed_forward_length")
    shared = meta.get("attention.shared_kv_layers")
    if shared is None:
        # llama.cpp's loader fixes the layers that compute their own K/V at the first 20.
        shared = max(n_layers - 20, 0)
    ple_table = gguf.get("per_layer_token_embd.weight")
    laurel = gguf.get("blk.0.laurel_l.weight")
    config.update(
        intermediate_size=ff if isinstance(ff, list) else [ff] * n_layers,
        num_key_value_heads=meta.uniform("attention.head_count_kv", heads),
        head_dim=meta.get("attention.key_length", config["hidden_size"] // heads),
        max_position_embeddings=meta.get("context_length", 32768),
        sliding_window=meta.need("attention.sliding_window"),
        layer_types=_layer_types(swa),
        rope_parameters={
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": meta.get("rope.freq_base_swa", 10000.0),
            },
            "full_attention": {"rope_type": "default", "rope_theta": meta.get("rope.freq_base", 1000000.0)},
        },
        final_logit_softcapping=meta.get("final_logit_softcapping"),
        hidden_size_per_layer_input=meta.need("embedding_length_per_layer_input"),
        # The converter pads the per-layer table with zero rows up to the vocabulary (the towers'
        # ids): those ids read zeros, as in llama.cpp.
        vocab_size_per_layer_input=ple_table.shape[0] if ple_table is not None else 262144,
        num_kv_shared_layers=shared,
        altup_num_inputs=meta.get("altup.num_inputs", 4),
        altup_active_idx=meta.get("altup.active_idx", 0),
        altup_correct_scale=True,  # llama.cpp always scales
        laurel_rank=laurel.shape[0] if laurel is not None else 64,
    )
    scales = meta.get("activation_sparsity_scale")
    if scales is not None:
        if len(scales) != n_layers:
            raise GGUFError(
                f"{fname}: activation_sparsity_scale has {len(scales)} entries for {n_layers} layers"
            )
        config["activation_sparsity_pattern"] = [_sparsity(m, fname) for m in scales]
    return config


def _sparsity(multiplier: float, fname: str) -> float:
    """The sparsity p whose float32 normal quantile is ``multiplier``: the converter writes
    icdf(p) (-inf for 0), transformers' config holds p. The shortest decimal that gives back the
    same float32 quantile, as the config.json value it was computed from."""
    from ...model.layers import normal_quantile

    if multiplier == -math.inf:
        return 0.0
    target = float(np.float32(multiplier))
    p = 0.5 * math.erfc(-multiplier / math.sqrt(2))
    candidates = [round(p, digits) for digits in range(1, 10)]
    candidates += [float(np.nextafter(np.float32(p), np.float32(d * np.inf))) for d in (-1, 1)]
    for candidate in [*candidates, p]:
        if 0 < candidate < 1 and normal_quantile(candidate) == target:
            return candidate
    raise GGUFError(
        f"{fname}: activation_sparsity_scale {multiplier} is no float32 normal quantile of a sparsity"
    )


def _gemma4_eos(metadata: Mapping[str, Any], eos: int) -> list[int]:
    """Gemma 4 stops on <eos>, <turn|> and <|tool_response>; GGUF states one eos id.

    The other two are looked up by their text (transformers hard-codes ids [1, 106, 50]).
    """
    ids = [eos]
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    for text in ("<turn|>", "<|tool_response>"):
        try:
            index = tokens.index(text)
        except ValueError:
            continue
        if index not in ids:
            ids.append(index)
    return ids

"""What a checkpoint costs, from its config alone: parameter counts and memory.

Every tower is counted by building our own model on the meta device (no memory, no weights), so
the count is exactly what ``load`` will allocate. The config comes from wherever ``load`` would read
it (``checkpoint_config``): a folder's or hub repository's config.json, or a GGUF file's metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .cache import sliding_ring
from .config import ModelConfig
from .distributed import ShardPlan, build_sharded
from .model import Gemma
from .model.text import Experts
from .quantization import quantizable as quantizable_weights
from .weights.loading import checkpoint_dtype
from .weights.safetensors import check_header, safetensors_files
from .weights.source import CheckpointError, resolve_source

GIB = 2**30

# What info fetches of a hub repository: the model's config, and a sentence-transformers folder's
# module list and Dense layer configs (EmbeddingGemma's sentence head). No weights.
CONFIG_FILES = ["config.json", "modules.json", "*_Dense/config.json"]

# Which tower a module path belongs to; everything else is the language model (and its head).
TOWER_PREFIXES = {
    "vision": ("vision_tower.", "embed_vision.", "vision_embedder.", "multi_modal_projector."),
    "audio": ("audio_tower.", "embed_audio."),
}


@dataclass(frozen=True)
class TensorShape:
    name: str
    shape: tuple[int, ...]
    # Persistent buffers (layer scalars, clip bounds, standardisation) are loaded but not trained.
    buffer: bool = False
    # Stacked expert weights (E, ...): a token reads only top_k of the E slices.
    experts: bool = False
    # torchgemma.quantize replaces it (the text decoder's matrices but the router's).
    quantizable: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def model_tensors(config: ModelConfig, sentence_head: dict | None = None) -> dict[str, list[TensorShape]]:
    """Every parameter and persistent buffer of the model ``load`` builds, grouped by tower; with
    ``sentence_head`` (``embedding.dense_shapes``: a sentence-transformers folder's Dense layers,
    EmbeddingGemma's), those too, as the tower ``sentence_head``."""
    with torch.device("meta"):
        model = Gemma(config)
    persistent = set(model.state_dict())
    experts = {
        f"{path}.{name}"
        for path, module in model.named_modules()
        if isinstance(module, Experts)
        for name, _ in module.named_parameters()
    }
    quantizable = {
        name if isinstance(item, torch.Tensor) else f"{name}.weight"
        for name, item in quantizable_weights(model)
    }
    tensors = [
        TensorShape(n, tuple(p.shape), experts=n in experts, quantizable=n in quantizable)
        for n, p in model.named_parameters()
    ]
    tensors += [TensorShape(n, tuple(b.shape), True) for n, b in model.named_buffers() if n in persistent]
    towers: dict[str, list[TensorShape]] = {"language_model": []}
    for tensor in tensors:
        tower = next((t for t, prefixes in TOWER_PREFIXES.items() if tensor.name.startswith(prefixes)), None)
        towers.setdefault(tower or "language_model", []).append(tensor)
    if sentence_head:
        towers["sentence_head"] = [TensorShape(name, shape) for name, shape in sentence_head.items()]
    return towers


def checkpoint_config(source: str | Path) -> ModelConfig:
    """The config ``load(source)`` would build, without reading a weight.

    ``source`` is anything ``load`` takes (a folder, a ``.gguf`` file, a hub id, a named model such as
    ``gemma3-270m``), resolved by the same ``resolve_source`` (a hub id fetches config.json alone), or
    a config.json file. A GGUF file's config comes from its metadata, as ``load`` reads it.
    """
    return inspect_checkpoint(source)[0]


def inspect_checkpoint(source: str | Path) -> tuple[ModelConfig, torch.dtype]:
    """``checkpoint_config(source)`` and the dtype ``load(source)`` builds the model in when told
    none, which is its KV cache's too: loading's own rule (``checkpoint_dtype``), applied to the GGUF
    file, or to config.json and, where the weights are local, their safetensors headers (read when
    config.json names no dtype; a hub id fetches no weights, so then float32, as load's fallback)."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".json":
        config = ModelConfig.from_file(path)
        return config, checkpoint_dtype(config, _stored_dtypes(path.parent))
    local = resolve_source(source, hub_files=CONFIG_FILES)
    if local.suffix != ".gguf":
        config = ModelConfig.from_file(local)
        return config, checkpoint_dtype(config, _stored_dtypes(local))
    from .weights.gguf import read_gguf

    config = read_gguf(local).model_config  # a ConfigError names the file
    return config, checkpoint_dtype(config, gguf=True)


def _stored_dtypes(folder: Path) -> list[str]:
    """The safetensors dtype names of a folder's tensors, from the file headers (none without weights)."""
    if (
        not (folder / "model.safetensors").is_file()
        and not (folder / "model.safetensors.index.json").is_file()
    ):
        return []
    try:
        files = safetensors_files(folder)
    except CheckpointError:  # shards missing: load would refuse the folder; info still reports
        return []
    return [
        entry["dtype"]
        for file in files
        for name, entry in check_header(file)[0].items()
        if name != "__metadata__"
    ]


def sentence_head_shapes(source: str | Path) -> dict:
    """A sentence-transformers folder's Dense shapes (``embedding.dense_shapes``); empty otherwise."""
    from .embedding import dense_shapes

    path = Path(source).expanduser()
    if path.is_file():
        return {}
    local = resolve_source(source, hub_files=CONFIG_FILES)
    return {} if local.suffix == ".gguf" else dense_shapes(local)


def active_params(config: ModelConfig, tensors: list[TensorShape]) -> int:
    """Parameters one token runs through: all of them except the experts its router does not pick.

    Each MoE layer routes a token to ``top_k_experts`` of ``num_experts``; the router, the dense MLP
    beside the experts and everything else run for every token.
    """
    text = config.text
    total = 0
    for t in tensors:
        if t.buffer:
            continue
        total += t.numel * text.top_k_experts // text.num_experts if t.experts else t.numel
    return total


def weight_bytes(tensors: list[TensorShape], scheme: str) -> int:
    """Bytes of ``tensors`` stored as bf16, or as ``torchgemma.quantize(model, "int8" / "int4")``
    stores them.

    int8: one byte per weight plus a float32 scale per row; int4: half a byte per weight plus a
    float32 scale and offset per group of 32. What quantize leaves alone (norms, the router, the
    vision and audio towers) stays bf16.
    """
    total = 0
    for t in tensors:
        if scheme == "bf16" or not t.quantizable:
            total += 2 * t.numel
        elif scheme == "int8":
            total += t.numel + 4 * (t.numel // t.shape[-1])
        elif scheme == "int4":
            total += t.numel // 2 + 8 * math.ceil(t.numel / 32)
        else:
            raise ValueError(f"unknown weight scheme {scheme!r}")
    return total


def kv_cache_bytes(
    config: ModelConfig, context: int, batch: int, dtype: torch.dtype, max_rollback: int = 0
) -> int:
    """What ``make_cache(batch, context, max_rollback=...)`` allocates: full layers ``context``
    columns, sliding layers a ring of ``window + max_rollback`` (at most ``context``), KV-shared
    layers none; keys and values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    ring = sliding_ring(config.text.sliding_window, context, max_rollback)
    total = 0
    for spec in config.text.layers:
        if spec.kv_role == "reuse":
            continue
        columns = ring if spec.is_sliding else context
        total += 2 * batch * spec.num_kv_heads * spec.head_dim * columns * itemsize
    return total


def describe(
    config: ModelConfig,
    *,
    context: int | None = None,
    batch: int = 1,
    dtype: torch.dtype | None = None,
    max_rollback: int = 0,
    sentence_head: dict | None = None,
) -> dict:
    """Parameter counts and memory of a checkpoint, as a JSON-ready dict (``sentence_head``: see
    ``model_tensors``).

    ``dtype``: the KV cache's. None: the one ``load`` would give the model (its cache takes the
    model's), as far as the config tells (``checkpoint_dtype``); a GGUF file, or a config.json that
    names no dtype, needs the source: pass ``inspect_checkpoint(source)[1]``, as ``torchgemma info`` does.
    """
    text = config.text
    context = context or text.max_position_embeddings
    kv_dtype = dtype or checkpoint_dtype(config)
    towers = model_tensors(config, sentence_head)
    everything = [t for tensors in towers.values() for t in tensors]

    def count(tensors):
        return sum(t.numel for t in tensors if not t.buffer)

    ple = sum(t.numel for t in towers["language_model"] if t.name.endswith("embed_tokens_per_layer.weight"))
    total = count(everything)
    moe = text.num_experts is not None
    kv_layers = [s for s in text.layers if s.kv_role != "reuse"]
    # Towers config.json describes that torchgemma does not build: not counted. Gemma 3's SigLIP and
    # Gemma 3n's conformer and MobileNet-V5 are built (siglip_vision, gemma3n_audio, gemma3n_vision).
    source = config.source or {}
    built = {
        "vision": config.vision_config or config.siglip_vision or config.gemma3n_vision,
        "audio": config.audio_config or config.gemma3n_audio,
    }
    unbuilt = [name for name in ("vision", "audio") if source.get(f"{name}_config") and built[name] is None]
    return {
        "model_type": config.model_type,
        "towers_not_built": unbuilt,
        "layers": text.num_hidden_layers,
        "sliding_layers": sum(s.is_sliding for s in text.layers),
        "full_layers": sum(not s.is_sliding for s in text.layers),
        "kv_shared_layers": text.num_kv_shared_layers,
        "sliding_window": text.sliding_window,
        "params_total": total,
        "params_by_tower": {name: count(tensors) for name, tensors in towers.items()},
        "params_ple_table": ple,
        "params_effective": total - ple,
        # Mixture of experts: what one token runs through (top_k of num_experts expert weights).
        "params_active": active_params(config, everything) if moe else total,
        "params_active_language_model": (
            active_params(config, towers["language_model"]) if moe else count(towers["language_model"])
        ),
        "experts_per_token": [text.top_k_experts, text.num_experts] if moe else None,
        "buffers_total": sum(t.numel for t in everything if t.buffer),
        "weights_bytes": {scheme: weight_bytes(everything, scheme) for scheme in ("bf16", "int8", "int4")},
        "ple_table_bytes_bf16": 2 * ple,
        "context": context,
        "batch": batch,
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "kv_cache_layers": {
            "sliding": sum(s.is_sliding for s in kv_layers),
            "full": sum(not s.is_sliding for s in kv_layers),
        },
        # Sliding layers keep the W - 1 keys the next call reads and the column a decode step writes
        # first, plus the tokens that may be taken back (speculative decoding): the slack. Chunked
        # prefill needs none (see cache.py).
        "kv_cache_sliding_columns": sliding_ring(text.sliding_window, context, max_rollback),
        "kv_cache_sliding_slack": max_rollback,
        "kv_cache_bytes": kv_cache_bytes(config, context, batch, kv_dtype, max_rollback),
    }


def format_report(info: dict) -> str:
    def n(x):
        return f"{x / 1e9:.3f} B" if x >= 1e8 else f"{x / 1e6:.3f} M"

    def b(x):
        return f"{x / GIB:.2f} GiB"

    lines = [
        f"{info['model_type']}: {info['layers']} layers ({info['sliding_layers']} sliding, {info['full_layers']} full, "
        f"{info['kv_shared_layers']} KV-shared), sliding window {info['sliding_window']}",
        "",
        "parameters",
        f"  total                {n(info['params_total']):>12}  ({info['params_total']:,})",
    ]
    for name, count in info["params_by_tower"].items():
        lines.append(f"  {name:<20} {n(count):>12}")
    if info["towers_not_built"]:
        towers = " and ".join(info["towers_not_built"])
        lines.append(
            f"  (the {towers} tower{'s' if len(info['towers_not_built']) > 1 else ''}: not built, not counted)"
        )
    if info["params_ple_table"]:
        lines.append(
            f"  per-layer embeddings {n(info['params_ple_table']):>12}  (a lookup table; can live off the accelerator)"
        )
        lines.append(
            f"  effective            {n(info['params_effective']):>12}  (total without the PLE table)"
        )
    if info["experts_per_token"]:
        top_k, experts = info["experts_per_token"]
        lines.append(
            f"  active per token     {n(info['params_active']):>12}  ({top_k} of {experts} experts per MoE layer; "
            f"language model {n(info['params_active_language_model'])})"
        )
    lines += ["", "weights"]
    for scheme, size in info["weights_bytes"].items():
        lines.append(f"  {scheme:<20} {b(size):>12}")
    lines += [
        "",
        f"KV cache ({info['kv_cache_dtype']}, context {info['context']:,}, batch {info['batch']}: "
        f"{info['kv_cache_layers']['sliding']} sliding + {info['kv_cache_layers']['full']} full layers cache K/V)",
        f"  {'total':<20} {b(info['kv_cache_bytes']):>12}  ({info['kv_cache_bytes']:,} bytes)",
        f"  sliding layers keep {info['kv_cache_sliding_columns']:,} columns each: the window's "
        f"{info['sliding_window'] - 1:,} earlier keys + {info['kv_cache_sliding_slack']} of rollback slack",
    ]
    return "\n".join(lines)


def rank_memory(
    config: ModelConfig,
    size: int,
    *,
    expert_parallel: bool = False,
    context: int | None = None,
    batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """What one of ``size`` tensor-parallel ranks holds, from the shard plan (``torchgemma.distributed``;
    every rank holds an equal share): its parameters (its text-decoder slices, the towers whole) in
    ``dtype``, and its KV cache (its KV heads; a head replicated on several ranks counted on each)."""
    plan = ShardPlan(config.text, size, 0, expert_parallel)
    with torch.device("meta"):
        model = build_sharded(config, plan, "sdpa")
    itemsize = torch.empty((), dtype=dtype).element_size()
    params = sum(p.numel() for p in model.parameters())
    context = context or config.text.max_position_embeddings
    local = replace(config, text=plan.local_text())
    return {
        "tensor_parallel_size": size,
        "expert_parallel": expert_parallel,
        "params_per_rank": params,
        "weights_bytes_per_rank": params * itemsize,
        "kv_cache_bytes_per_rank": kv_cache_bytes(local, context, batch, dtype),
        "context": context,
        "batch": batch,
    }

"""``torchgemma.load``: checkpoint tensors -> a ready ``Gemma`` module.

Loading is the identity on names except for the few exceptions in ``sanitize``, each one line with
its reason. Anything missing, unexpected or mis-shaped is an error that names the tensor, raised
from the checkpoint's tensor table and a model built on the meta device, before any memory is
allocated. Tensors are then read one at a time (memory-mapped safetensors, or dequantized GGUF
blocks) into a model allocated once in the target dtype and device.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

from ..config import ModelConfig
from ..distributed import ShardPlan, build_sharded, connect, init_group, shard_source, sync_seed
from ..model import Gemma
from ..model.attention import ATTENTION_BACKENDS
from ..model.text import check_experts
from ..placement import offload_per_layer_table
from ..quantization import QuantizationPlan, QuantizedWeight
from .safetensors import FLOAT_DTYPES, read_safetensors, safetensors_files, tensor_nbytes
from .source import CheckpointError, auto_quantization, resolve_source

if TYPE_CHECKING:
    from .gguf import GGUFCheckpoint, MultimodalGGUF

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


# Below this many bytes read a progress bar is noise.
PROGRESS_MIN_BYTES = 64 * 2**20

# Gemma's residual stream outgrows float16 (largest finite 65504): Gemma 3 270M's reaches 1.04e5 in
# float32 by layer 14; in float16 it is inf after layer 7 and every logit NaN (transformers 5.23's
# Gemma3ForCausalLM too). A model is never built in float16.
FLOAT16_REFUSED = "float16 is not supported: Gemma's activations exceed float16's range: use bf16 or fp32"


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The torch dtype a name stands for ("bf16", "float32", ...); float16 included (KV-cache sizing)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(DTYPES))}")
    return DTYPES[key]


def model_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``resolve_dtype``, refusing the dtypes a model cannot run in."""
    resolved = resolve_dtype(dtype)
    if resolved == torch.float16:
        raise ValueError(FLOAT16_REFUSED)
    return resolved


def load(
    source: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attention: str = "sdpa",
    experts: str = "grouped_mm",
    progress: bool = True,
    quantize: str | None = "auto",
    per_layer_table: str = "auto",
    activations: str | None = "auto",
    mmproj: str | Path | None = None,
    tensor_parallel_size: int = 1,
    expert_parallel: bool | str = False,
) -> Gemma:
    """Load a Gemma 4 or Gemma 3 checkpoint: a folder, a hub repository id, a GGUF file or a named model.

    ``dtype`` defaults to the checkpoint's own (``config.json``'s ``dtype``, else the tensors'; float32
    for GGUF files, which are dequantized into it, and for float16 checkpoints, whose activations
    would overflow); float16 is refused. ``device`` defaults to the CPU. Tensors are read
    memory-mapped one at a time into the built model, so memory peaks at the model plus its largest
    tensor. ``attention`` is the text decoder's and vision tower's backend: ``"sdpa"`` (fast,
    bounded memory) or ``"eager"`` (transformers' eager arithmetic, bit for bit). ``experts`` (a
    mixture of experts, 26B-A4B): how each token's expert outputs are summed, as transformers'
    ``experts_implementation`` of the same name: ``"grouped_mm"`` (its default: in float32, rounded
    once) or ``"eager"`` (rounded to the model dtype expert by expert). The model is returned in
    eval mode.
    A progress bar counts the bytes read when stderr is a terminal and the checkpoint is large;
    ``progress=False`` never shows one.

    ``quantize`` quantizes the text decoder's weights while loading, one tensor at a time, so memory
    peaks near the quantized size (see ``torchgemma.quantization``): ``"int8"``, ``"int4"``, or, for a
    GGUF file, ``"gguf"`` (each tensor kept at the file's own precision, no full-precision copy).
    ``"auto"`` (the default) is ``"gguf"`` for a ``.gguf`` file and for the named model ``gemma3-270m``
    (which is one), no quantization otherwise; None never quantizes (a GGUF file is then dequantized
    into ``dtype``). A checkpoint saved quantized by ``torchgemma.save`` loads as saved.
    ``activations`` (a quantized model on the CPU): how products of 16 rows or more (prefill) take
    their activations (``torchgemma.quantization.set_activations``): ``"int16"`` (float32's accuracy,
    ~1.6x faster with AVX-512 VNNI), ``"int8"`` (llama.cpp's arithmetic: ~2.2x, slightly less
    accurate), None (the model's dtype); ``"auto"`` (the default): int16 where the CPU has AVX-512
    VNNI, else None.

    ``per_layer_table`` (E2B/E4B): ``"host"`` keeps the per-layer-embedding table in host memory and
    moves only the rows each call reads (``torchgemma.placement``); ``"device"`` puts it with the rest;
    ``"auto"`` (the default) is ``"host"`` on CUDA, else ``"device"``.

    ``mmproj`` (a GGUF model file): llama.cpp's mmproj file of its vision and audio towers, loaded
    with it as one multimodal model (the towers dequantized into ``dtype``; weights/gguf/mmproj.py).

    ``tensor_parallel_size`` N > 1: this process loads its share of a text decoder split over the N
    processes of a process group (``torchgemma.distributed``; set up from torchrun's environment when
    none exists), reading only its slices of the checkpoint; every process must call ``load`` alike
    and then run the same forward calls. ``expert_parallel`` (26B-A4B): whole experts per process
    instead of a slice of every expert; True exchanges the tokens by ``"all-reduce"`` (each process
    computes its experts for every token, the sums reduced), ``"all-to-all"`` sends each token to
    its experts' processes and back (``torchgemma.distributed.routed``).
    """
    # The arguments are checked before any work (a hub id would be downloaded first).
    if per_layer_table not in ("auto", "host", "device"):
        raise ValueError(f"per_layer_table must be 'auto', 'host' or 'device', got {per_layer_table!r}")
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention {attention!r}; use one of {', '.join(ATTENTION_BACKENDS)}")
    check_experts(experts)
    requested = model_dtype(dtype)
    QuantizationPlan.check(quantize, activations)
    path = resolve_source(source)
    if mmproj is not None and path.suffix != ".gguf":
        raise ValueError(f"mmproj= goes with a .gguf model file (llama.cpp's layout); {path} is not one")
    with ExitStack() as stack:  # safetensors files stay mapped until the model is filled
        checkpoint = _open(path, stack, mmproj)
        # Every default and "auto" becomes a concrete choice here; what follows takes them as given.
        dtype = requested or checkpoint.dtype
        device = torch.device(device or "cpu")
        host_table = per_layer_table == "host" or (per_layer_table == "auto" and device.type == "cuda")
        plan = QuantizationPlan.resolve(
            auto_quantization(source) if quantize == "auto" else quantize,
            activations,
            path=path,
            saved=checkpoint.config.quantization,
            gguf=checkpoint.gguf,
            device=device,
        )
        shards = None
        if tensor_parallel_size > 1 or expert_parallel:
            rank, device = init_group(tensor_parallel_size, device)
            sync_seed()  # unseeded sampling must draw alike on every rank
            if checkpoint.config.quantization is not None:
                raise ValueError(f"{path} was saved quantized: load its float checkpoint to split it")
            granule = plan.shard_granule  # quantization groups kept whole where the widths allow
            shards = ShardPlan(checkpoint.config.text, tensor_parallel_size, rank, expert_parallel, granule)
        built = (checkpoint, plan, dtype, device, attention, host_table, path.name if progress else None)
        model = _build(*built) if shards is None else _build(*built, shards)
        model.language_model.set_experts(experts)
        return model


@dataclass(frozen=True)
class _Checkpoint:
    """A checkpoint opened for loading: its config and tensor table, no tensor read yet."""

    config: ModelConfig
    dtype: torch.dtype  # what the model is built in unless load is told otherwise
    stored: dict[str, int]  # each tensor's bytes in the file, by key: what the progress bar counts
    # (key, load, shape, stored dtype name) of every tensor, loads giving the given dtype (GGUF) or
    # the stored one (safetensors: the model's tensors cast as they are filled).
    tensors: Callable[[torch.dtype], list[tuple]]
    gguf: GGUFCheckpoint | MultimodalGGUF | None = (
        None  # a GGUF file: its dequantized tensors are fresh memory, adopted
    )


def _open(path: Path, stack: ExitStack, mmproj: str | Path | None = None) -> _Checkpoint:
    """The config and tensor table of the checkpoint at ``path`` (a GGUF file: with its ``mmproj``
    file if given), from file headers alone (safetensors files are mapped until ``stack`` closes)."""
    if path.suffix == ".gguf":
        return _open_gguf(path, mmproj)
    config = ModelConfig.from_file(path)
    tensors = list(read_safetensors(safetensors_files(path), stack))
    check_tensor_table(config, {name: shape for name, _, shape, _ in tensors}, path)
    stored = {name: tensor_nbytes(shape, dt) for name, _, shape, dt in tensors}
    dtype = checkpoint_dtype(config, (dt for *_, dt in tensors))
    return _Checkpoint(config, dtype, stored, lambda dtype: tensors)


def _open_gguf(path: Path, mmproj: str | Path | None) -> _Checkpoint:
    from .gguf import read_gguf, read_gguf_with_mmproj

    # Shapes are checked in _build, against the meta model built there.
    if mmproj is None:
        checkpoint = read_gguf(path, check_shapes=False)
    else:
        checkpoint = read_gguf_with_mmproj(path, mmproj, check_shapes=False)
    config = checkpoint.model_config
    names = checkpoint.tensor_names()
    # The bar counts what is read: the quantized bytes of the GGUF tensor(s) behind each tensor.
    stored = {name: checkpoint.stored_bytes(name) for name in names}

    def tensors(dtype: torch.dtype) -> list[tuple]:
        # Each load reads its tensor when called; under tensor parallelism, narrowed to the rank's piece.
        return [(name, checkpoint.load(name, dtype), checkpoint.shape(name), "") for name in names]

    # GGUF blocks are dequantized into float32 unless another dtype is asked for.
    return _Checkpoint(config, checkpoint_dtype(config, gguf=True), stored, tensors, gguf=checkpoint)


def _build(
    checkpoint: _Checkpoint,
    plan: QuantizationPlan,
    dtype: torch.dtype,
    device: torch.device,
    attention: str,
    host_table: bool,
    label: str | None,
    shards: ShardPlan | None = None,
) -> Gemma:
    """The model of ``checkpoint``, built once in ``dtype`` on ``device``, quantized as ``plan``
    says, its text decoder attending with ``attention``; ``host_table``: the per-layer-embedding
    table kept in host memory; ``label`` names the progress bar (None: no bar); ``shards``: this
    rank's share of a tensor-parallel model (None: the whole model)."""
    config = checkpoint.config
    with torch.device("meta"):
        model = Gemma(config, attention).to(dtype=dtype)
    if checkpoint.gguf is not None:
        checkpoint.gguf.check_shapes(model)  # read_gguf's own check, on this meta model
    source = checkpoint.tensors(dtype)
    if shards is not None:  # the whole model checked, then the rank's share built and read
        match_tensors(model, config, source)
        with torch.device("meta"):
            model = build_sharded(config, shards, attention).to(dtype=dtype)
        source = shard_source(source, shards, config.module_path)
    plan.prepare(model, dtype)
    # Every missing, unexpected or mis-shaped tensor is found on the meta model, before allocating.
    loads = match_tensors(model, config, source)
    loads = plan.assign(model, loads, dtype)
    if host_table:
        offload_per_layer_table(model)  # on the meta model: the table is then allocated on the host
    # Allocate once, directly in the target dtype and device; loading fills it in place.
    # (to_empty would do, but empty_like of a meta tensor runs torch's Python reference ops, which
    # import half a second of modules; a plain factory call does not.) A GGUF file's tensors are
    # read into new memory that becomes the model's (fill's adopt): what they replace holds none.
    adopt = checkpoint.gguf is not None
    targets = _targets(model) if adopt else {}  # (held through _apply: no id below is reused)
    shells = {id(t) for t in targets.values()}
    model = model._apply(
        lambda t: (
            _placeholder(t.shape, t.dtype, device)
            if id(t) in shells
            else torch.empty(t.shape, dtype=t.dtype, device=device)
        )
    )
    del targets
    stored = checkpoint.stored
    with _progress(sum(stored[key] for _, key, _ in loads), label) as bar:
        fill(model, loads, lambda key: bar.update(stored[key]), adopt=adopt)
    if adopt:  # (match_tensors covered every target: a placeholder left is a loader bug, never data)
        left = [name for name, t in _targets(model).items() if _is_placeholder(t)]
        if left:
            raise CheckpointError(f"the GGUF file's tensors left {', '.join(left[:5])} unread")
    plan.apply(model)
    if shards is not None:
        connect(model)
    release_freed_memory()
    return model.eval()


def _progress(total: int, name: str | None) -> tqdm:
    # tqdm's disable=None does not check the stream in every version: a log file gets no bar.
    stream = sys.stderr
    quiet = name is None or total < PROGRESS_MIN_BYTES or not getattr(stream, "isatty", lambda: False)()
    return tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {name}", file=stream, disable=quiet)


def checkpoint_dtype(config: ModelConfig, stored: Iterable[str] = (), *, gguf: bool = False) -> torch.dtype:
    """The dtype ``load`` builds a checkpoint's model in when told none, and so the dtype of every KV
    cache the model makes (``make_cache`` allocates in the model's dtype); ``torchgemma info`` asks
    it too. A GGUF file: float32 (its blocks are dequantized into it). Otherwise config.json's
    dtype, else the first float dtype among ``stored`` (the safetensors dtype names of the tensors,
    "BF16", ...), else float32; float16 becomes float32."""
    if gguf:
        return torch.float32
    dtype = resolve_dtype(config.dtype) if config.dtype is not None else None
    if dtype is None:
        dtype = next((FLOAT_DTYPES[dt] for dt in stored if dt in FLOAT_DTYPES), torch.float32)
    # float16 checkpoints run in float32 (exact, and in range): see FLOAT16_REFUSED.
    return torch.float32 if dtype == torch.float16 else dtype


def check_tensor_table(config: ModelConfig, shapes: dict[str, tuple[int, ...]], where: Path) -> None:
    """The decoder's layer count and embedding shape against a checkpoint's tensor table.

    Milliseconds, from file headers alone: a config.json that disagrees with its weights is refused
    before a model is sized from it.
    """
    text = config.text
    layers: set[int] = set()
    embedding = None
    for key, shape in shapes.items():
        name = sanitize(key, config)
        if name is None:
            continue
        parts = name.split(".")
        if parts[:2] == ["language_model", "layers"] and len(parts) > 2 and parts[2].isdigit():
            layers.add(int(parts[2]))
        elif name == "language_model.embed_tokens.weight":
            embedding = (key, shape)
    if layers != set(range(text.num_hidden_layers)):
        found = f"{len(layers)} (indices {min(layers)}..{max(layers)})" if layers else "none"
        raise CheckpointError(
            f"{where}: config.json says num_hidden_layers={text.num_hidden_layers} but the checkpoint's "
            f"decoder layers are {found}"
        )
    expected = (text.vocab_size, text.hidden_size)
    if embedding is not None and tuple(embedding[1]) != expected:
        raise CheckpointError(
            f"{where}: config.json says vocab_size={text.vocab_size}, hidden_size={text.hidden_size} but "
            f"{embedding[0]} has shape {list(embedding[1])}"
        )


def sanitize(name: str, config: ModelConfig) -> str | None:
    """The module path a checkpoint tensor loads into, or None to skip it: the config's rule (the
    checkpoint layouts' prefixes, each family's parts not built, KV-shared layers' unused k/v)."""
    return config.module_path(name)


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers a checkpoint must cover, by name."""
    targets: dict[str, torch.Tensor] = dict(model.named_parameters())
    targets.update(model.named_buffers())
    persistent = set(model.state_dict().keys())
    return {k: v for k, v in targets.items() if k in persistent}


def match_tensors(
    model: nn.Module, config: ModelConfig, source: Iterable[tuple]
) -> list[tuple[str, str, Callable[[], torch.Tensor]]]:
    """``(module path, checkpoint key, load)`` for every tensor of ``source`` the model takes.

    Reads names and shapes only (``model`` may be on the meta device): every parameter and buffer
    must be covered once, with its shape, and every checkpoint tensor must have a place.
    """
    targets = _targets(model)
    plan: list[tuple[str, str, Callable[[], torch.Tensor]]] = []
    loaded: dict[str, str] = {}
    unexpected: list[str] = []
    for key, load, shape, _ in source:
        name = sanitize(key, config)
        if name is None:
            continue
        target = targets.get(name)
        if target is None:
            unexpected.append(key)
            continue
        if name in loaded:
            raise CheckpointError(f"tensor {key} appears twice in the checkpoint (also as {loaded[name]})")
        if tuple(target.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {key} has shape {list(shape)} but the config implies {list(target.shape)} for {name}"
            )
        loaded[name] = key
        plan.append((name, key, load))

    if unexpected:
        raise CheckpointError(
            f"{len(unexpected)} checkpoint tensor(s) have no place in the model built from config.json: "
            + ", ".join(unexpected[:8])
            + (" ..." if len(unexpected) > 8 else "")
        )
    missing = [name for name in targets if name not in loaded]
    if missing:
        raise CheckpointError(
            f"{len(missing)} model tensor(s) missing from the checkpoint: "
            + ", ".join(missing[:8])
            + (" ..." if len(missing) > 8 else "")
        )
    return plan


def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of this shape and dtype that holds no memory (one element, expanded), for a
    parameter or buffer whose storage loading replaces. Allocating them instead, untouched, left
    their sizes as holes in the heap (Gemma 3 270M: ~42 MB between the weights read after them)
    and raised malloc's mmap threshold to the largest when they were freed: the first generation's
    temporaries then came from those holes and made them resident, ~30 MB of the peak RSS."""
    return torch.empty((), dtype=dtype, device=device).expand(shape)


def _is_placeholder(t: torch.Tensor) -> bool:
    return t.numel() > 1 and t.untyped_storage().nbytes() < t.numel() * t.element_size()


def _allocate(t: torch.Tensor) -> None:
    """Give a placeholder (``_placeholder``) its own memory, before something is written into it."""
    if _is_placeholder(t):
        t.data = torch.empty(t.shape, dtype=t.dtype, device=t.device)


def fill(
    model: nn.Module,
    plan: list[tuple[str, str, Callable[[], torch.Tensor]]],
    progress: Callable[[str], None] = lambda key: None,
    adopt: bool = False,
) -> None:
    """Read each tensor of ``match_tensors``' plan into ``model`` (allocated), one at a time.

    ``adopt``: the loaded tensors are new memory no one else holds (not views of a mapped file), so
    one that already has the parameter's dtype, device and layout becomes its storage, uncopied
    (the model's tensors are then ``_placeholder``s; one that is copied into gets memory first).
    """
    targets = _targets(model)
    for name, key, load in plan:
        tensor = load()
        target = targets.get(name)
        with torch.no_grad():
            if target is None:  # the weight of a module (or expert stack) quantized while loading
                module = model.get_submodule(name.removesuffix(".weight"))
                assert isinstance(module, QuantizedWeight), name
                if isinstance(tensor, torch.Tensor):
                    for buffer in module.buffers(recurse=False):
                        _allocate(buffer)  # (quantized into in place)
                    module.set_weight(tensor)
                else:  # a GGUF tensor's own blocks
                    module.set_quantized(tensor.qweight, tensor.scales, tensor.mins)
            elif (
                adopt
                and tensor.is_contiguous()
                and (tensor.dtype, tensor.device, tensor.shape)
                == (
                    target.dtype,
                    target.device,
                    target.shape,
                )
            ):
                target.data = tensor
            else:
                _allocate(target)
                target.copy_(tensor)
        progress(key)
        del tensor
        _release(load)


def release_freed_memory() -> None:
    """Return the pages of freed heap memory to the system (glibc's ``malloc_trim``; nothing
    elsewhere). Loading passes every tensor through temporary buffers, and the holes they leave in
    the heap stay resident until reused: Gemma 3 270M from its GGUF file, 7 MiB after loading and
    10 MiB at the peak of the first generation."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc (e.g. musl): nothing to do
        ctypes.CDLL(None).malloc_trim(0)


def _release(load) -> None:
    """Drop a mapped tensor's pages once copied (``read_safetensors``' loads can)."""
    release = getattr(load, "release", None)
    if release is not None:
        release()

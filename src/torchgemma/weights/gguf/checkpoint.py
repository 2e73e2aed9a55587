"""A GGUF file as a Hugging Face checkpoint (``read_gguf``): the loader-facing entry points.

``GGUFCheckpoint`` gives the config read from the file's metadata and its tensors under their
Hugging Face names, dequantized one at a time (or kept as grouped integers), after checking that
the tensors are the ones the model that config builds takes, each with its shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from ...config import ConfigError, ModelConfig
from .blocks import (
    INT_TYPES,
    SUPPORTED_TYPES,
    GroupedInts,
    NonFiniteWeights,
    dequantize,
    dequantize_piece,
    grouped_ints,
)
from .metadata import read_config
from .names import SUPPORTED_ARCHITECTURES, Entry, check_layers, hf_shape, plan_tensors
from .reader import GGUFError, _GGUFFile
from .slices import Pieces


class GGUFCheckpoint:
    """A GGUF file read as a Hugging Face checkpoint: ``config`` and ``tensors()``.

    Made by ``read_gguf``. The file stays memory-mapped; tensors are dequantized one at a time when
    iterated. Attributes: ``config`` (a ``config.json`` dict for ``Gemma3ForCausalLM`` /
    ``Gemma3nForCausalLM`` / ``Gemma4ForCausalLM``), ``model_config`` (the ``ModelConfig`` read from
    it), ``metadata`` (every GGUF key/value), ``architecture`` (``"gemma3"`` / ``"gemma3n"`` /
    ``"gemma4"``), ``skipped`` (GGUF tensors not yielded, each with the reason).
    """

    def __init__(self, file: _GGUFFile, *, check_shapes: bool = True):
        self.path = file.path
        self.metadata = file.metadata
        self.architecture: str = file.metadata["general.architecture"]
        self._file = file
        self._gguf = file.tensors
        check_layers(file, self.architecture)  # before anything is built per layer
        file.check_tensors()  # types, sizes, alignment, bounds, and no shared bytes
        self.config = read_config(file)
        self._entries, self.skipped = plan_tensors(self.architecture, self.config, self._gguf, file.name)
        self._by_name = {e.hf_name: e for e in self._entries}
        self._check_types()
        try:
            self.model_config = ModelConfig.from_hf(self.config)
        except ConfigError as err:
            raise ConfigError(f"{self.path}: {err}") from err
        if check_shapes:
            self.check_shapes()

    # -- public API --------------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        """Hugging Face names of the tensors ``tensors()`` yields, in file order."""
        return [e.hf_name for e in self._entries]

    def shape(self, hf_name: str) -> tuple[int, ...]:
        """The Hugging Face shape of one tensor, without reading it."""
        entry = self._entry(hf_name)
        shape = hf_shape([self._gguf[s] for s in entry.sources])
        return shape if entry.part is None else shape[1:]

    def stored_bytes(self, hf_name: str) -> int:
        """The bytes the file stores for one tensor (what a loading progress bar counts)."""
        return sum(self._gguf[s].n_bytes for s in self._entry(hf_name).sources)

    def gguf_types(self) -> dict[str, str]:
        """The GGML type each Hugging Face tensor is stored in (e.g. ``{"model.norm.weight": "F32"}``)."""
        return {e.hf_name: "+".join(self._gguf[s].type_name for s in e.sources) for e in self._entries}

    def tensor(
        self, hf_name: str, dtype: torch.dtype = torch.float32, pieces: Pieces | None = None
    ) -> torch.Tensor:
        """One tensor, dequantized, in Hugging Face layout and semantics, cast to ``dtype``.
        ``pieces``: only that piece of it (``distributed.ShardPlan.slices``), only its blocks read."""
        return self._load(self._entry(hf_name), dtype, pieces)

    def load(self, hf_name: str, dtype: torch.dtype = torch.float32) -> TensorLoad:
        """The loader's handle on one tensor (``TensorLoad``): read when called."""
        return TensorLoad(self, hf_name, dtype)

    def int_format(self, hf_name: str) -> tuple[int, int, bool] | None:
        """(bits, group size, offsets?) if ``grouped_ints`` reads the tensor, else None: its type is
        not in ``INT_TYPES``, or it needs a conversion (split experts, Gemma 3's shifted norms)."""
        entry = self._entry(hf_name)
        info = self._gguf[entry.sources[0]]
        if (
            len(entry.sources) != 1
            or entry.shift_norm
            or entry.part is not None
            or len(info.shape) not in (2, 3)
        ):
            return None
        return INT_TYPES.get(info.qtype)

    def grouped_ints(self, hf_name: str, pieces: Pieces | None = None) -> GroupedInts:
        """One tensor as the file stores it, for the tensors ``int_format`` accepts (``pieces``: a
        piece of it, as ``tensor``'s; cut along the columns, its ends must be whole groups)."""
        if self.int_format(hf_name) is None:
            raise GGUFError(f"{self.path.name}: {hf_name} is not stored as grouped integers")
        info = self._gguf[self._entry(hf_name).sources[0]]
        with self._naming(info, hf_name):
            ints = grouped_ints(
                self._file.raw(info),
                info.qtype,
                info.shape,
                lambda a, b: self._file.release(info, a, b),
                finite=True,
                pieces=pieces,
            )
        self._file.release(info)
        return ints

    def tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` for every checkpoint tensor, one dequantized tensor at a time.

        Values are dequantized to float32, corrected there (Gemma 3 norms) and only then cast to
        ``dtype``, so a bfloat16 request rounds once.
        """
        for entry in self._entries:
            yield entry.hf_name, self._load(entry, dtype)

    def state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """All tensors at once (small models and tests; large models should stream ``tensors()``)."""
        return dict(self.tensors(dtype))

    def __repr__(self) -> str:
        return (
            f"GGUFCheckpoint({self.path.name!r}, {self.config['model_type']}, {len(self._entries)} tensors)"
        )

    # -- internals ---------------------------------------------------------------------------------

    def _entry(self, hf_name: str) -> Entry:
        try:
            return self._by_name[hf_name]
        except KeyError:
            raise KeyError(f"{self.path.name} has no tensor {hf_name!r}") from None

    @contextlib.contextmanager
    def _naming(self, info, hf_name: str) -> Iterator[None]:
        """The block readers refuse NaN and infinite weights (blocks.NonFiniteWeights), found at load
        rather than as NaN logits that decode token 0 forever; this names the tensor."""
        try:
            yield
        except NonFiniteWeights as err:
            raise GGUFError(
                f"{self.path.name}: tensor {info.name} ({hf_name}, {info.type_name}) holds {err}; the model "
                f"would compute NaN"
            ) from None

    def _decoded(
        self, info, hf_name: str, dtype: torch.dtype = torch.float32, pieces: Pieces | None = None
    ) -> torch.Tensor:
        with self._naming(info, hf_name):
            if pieces is not None:
                release = lambda a, b: self._file.release(info, a, b)  # noqa: E731
                raw = self._file.raw(info)
                return dequantize_piece(raw, info.qtype, info.shape, pieces, dtype, release, finite=True)
            return dequantize(self._file.raw(info), info.qtype, info.shape, dtype, finite=True)

    def _load(self, entry: Entry, dtype: torch.dtype, pieces: Pieces | None = None) -> torch.Tensor:
        parts = [self._gguf[s] for s in entry.sources]
        per_source = _source_pieces(entry, parts, pieces) if pieces is not None else None
        if per_source is not None:  # only the piece's blocks read
            values = [self._decoded(info, entry.hf_name, dtype, p) for info, p in per_source]
            tensor = values[0] if len(values) == 1 else torch.cat(values, dim=1)
        elif entry.shift_norm:
            # llama.cpp stores Gemma 3 norms as 1 + w (transformers computes x * (1 + w)): undo it in
            # float32, where the converter added it, before any cast.
            (info,) = parts
            tensor = (self._decoded(info, entry.hf_name) - 1.0).to(dtype)
        elif entry.part is not None:
            # A stacked source: dequantized whole (in float32, then cast), one matrix kept, copied
            # out (a view would keep the whole stack alive in the parameter that adopts it).
            (info,) = parts
            tensor = self._decoded(info, entry.hf_name)[entry.part].clone().to(dtype)
        else:
            values = [self._decoded(t, entry.hf_name, dtype) for t in parts]
            tensor = values[0] if len(values) == 1 else torch.cat(values, dim=1)
        if pieces is not None and per_source is None:  # read whole, then cut
            cut = [tensor.narrow(dim, first, end - first) for dim, first, end in pieces]
            tensor = torch.cat(cut, dim=pieces[0][0])
        for info in parts:
            self._file.release(info)
        return tensor

    def _check_types(self) -> None:
        for entry in self._entries:
            for source in entry.sources:
                info = self._gguf[source]
                if info.qtype not in SUPPORTED_TYPES:
                    raise GGUFError(
                        f"{self.path.name}: tensor {source} is stored as {info.type_name}, a GGML type this "
                        f"reader cannot dequantize (supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})"
                    )

    def check_shapes(self, model: torch.nn.Module | None = None, only: str = "") -> None:
        """Every tensor against ``model``: by default the model ``model_config`` builds, made on the
        meta device (no memory, no weights), as the loader checks a checkpoint: one model definition.
        The loader passes the meta model it builds anyway, so that one is built once. ``only``: the
        module paths this file must cover start with it (an mmproj file covers the others)."""
        config = self.model_config
        if model is None:
            from ...model import Gemma

            with torch.device("meta"):
                model = Gemma(config)
        expected = {p: s for p, s in _model_shapes(model).items() if p.startswith(only)}
        problems = []
        covered = set()
        for entry in self._entries:
            path = config.module_path(entry.hf_name)
            want = expected.get(path) if path is not None else None
            if want is None:
                problems.append(f"unexpected tensor {entry.hf_name} (from {', '.join(entry.sources)})")
                continue
            covered.add(path)
            got = self.shape(entry.hf_name)
            if got != want:
                problems.append(
                    f"{entry.hf_name} (from {entry.sources[0]}) has shape {list(got)}, config implies {list(want)}"
                )
        problems += [f"missing tensor {config.checkpoint_name(n)}" for n in expected if n not in covered]
        if problems:
            shown = "; ".join(problems[:8]) + (
                f"; ... ({len(problems)} problems)" if len(problems) > 8 else ""
            )
            raise GGUFError(f"{self.path.name} does not match the config read from its metadata: {shown}")


def _source_pieces(entry: Entry, parts: list, pieces: Pieces) -> list[tuple] | None:
    """(GGUF tensor, its pieces) to read, in order, for ``pieces`` of ``entry``'s tensor; None where
    the tensor is read whole and then cut (a Gemma 3 norm, a matrix of a stack: never split, or a
    piece across two of the tensors concatenated)."""
    if entry.shift_norm or entry.part is not None:
        return None
    if len(parts) == 1:
        return [(parts[0], pieces)]
    if any(dim != 1 for dim, _, _ in pieces):  # tensors concatenated on dim 1: each cut alike
        return [(info, pieces) for info in parts]
    found, offset = [], 0
    bounds = []
    for info in parts:
        bounds.append((info, offset, offset + info.shape[1]))
        offset += info.shape[1]
    for dim, first, end in pieces:
        holder = next(((i, a) for i, a, b in bounds if a <= first and end <= b), None)
        if holder is None:
            return None
        found.append((holder[0], [(dim, first - holder[1], end - holder[1])]))
    return found


class TensorLoad:
    """One tensor of a GGUF checkpoint as the loader reads it: called, dequantized into ``dtype``;
    ``blocks()``, its grouped integers; ``narrow(pieces)``, a piece of it (tensor parallelism),
    read alike but from the piece's blocks only."""

    def __init__(self, checkpoint, hf_name: str, dtype: torch.dtype, pieces: Pieces | None = None):
        self.checkpoint, self.hf_name, self.dtype, self.pieces = checkpoint, hf_name, dtype, pieces

    def __call__(self) -> torch.Tensor:
        return self.checkpoint.tensor(self.hf_name, self.dtype, self.pieces)

    def blocks(self) -> GroupedInts:
        return self.checkpoint.grouped_ints(self.hf_name, self.pieces)

    def narrow(self, pieces: Pieces) -> TensorLoad:
        return TensorLoad(self.checkpoint, self.hf_name, self.dtype, pieces)


def _model_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The shapes of the parameters and persistent buffers a checkpoint must cover, by module path."""
    persistent = set(model.state_dict())
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {name: tuple(t.shape) for name, t in tensors.items() if name in persistent}


def read_gguf(path: str | Path, *, check_shapes: bool = True) -> GGUFCheckpoint:
    """Open a Gemma 3, Gemma 3n or Gemma 4 GGUF file (memory-mapped) as a Hugging Face style checkpoint.

    Raises ``GGUFError`` (a ``ValueError``) naming the file and the problem for a file that is not a
    GGUF, is truncated, uses an unknown or unsupported quantization type, has an architecture other
    than gemma3/gemma3n/gemma4, or whose tensors disagree with its metadata; ``ConfigError`` (also a
    ``ValueError``, naming the file) when its metadata describes a model torchgemma cannot build.
    ``check_shapes=False`` leaves the tensor shapes to the caller (``GGUFCheckpoint.check_shapes``).
    A model with llama.cpp's mmproj file of its towers: ``read_gguf_with_mmproj`` (mmproj.py).
    """
    file = _GGUFFile(Path(path))
    arch = file.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        hint = " (an mmproj file: pass it as mmproj=, beside the model's GGUF)" if arch == "clip" else ""
        raise GGUFError(
            f"{file.name} has architecture {arch!r}; read_gguf supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            + hint
        )
    return GGUFCheckpoint(file, check_shapes=check_shapes)

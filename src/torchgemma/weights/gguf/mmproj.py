"""A model GGUF with its mmproj GGUF (``read_gguf_with_mmproj``): one multimodal checkpoint.

llama.cpp keeps a model's towers in a second file, the mmproj (``general.architecture`` "clip"),
that names each tower's projector type. ``MultimodalGGUF`` reads the pair as the Hugging Face
checkpoint they were converted from: the config (``Gemma4ForConditionalGeneration``,
``Gemma3ForConditionalGeneration``...: the text
config from the model file, the towers' configs from the mmproj's metadata and tensor shapes, the
media token ids from the model file's vocabulary) and every tensor under its Hugging Face name. The
text tensors read as ``GGUFCheckpoint`` reads them (kept as grouped integers where
``quantize="gguf"`` keeps them); the towers' tensors are dequantized (float32, then the model
dtype). Tables: mmproj_names.py.

Strict, as the model file is: a tensor no tower names, a tower tensor the model needs and the file
lacks, a shape the config does not imply, an mmproj whose towers project into another text width or
pair with another architecture: each is a ``GGUFError`` naming the file, the tensor and the value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...config import ConfigError, ModelConfig
from .blocks import SUPPORTED_TYPES, NonFiniteWeights, dequantize
from .checkpoint import GGUFCheckpoint, TensorLoad, _model_shapes, read_gguf
from .mmproj_names import BOUNDS, LAYOUTS, TOWERS, MultimodalLayout, TowerNames, Transform
from .reader import GGUFError, _GGUFFile


@dataclass(frozen=True)
class _TowerEntry:
    hf_name: str
    source: str  # the mmproj tensor
    transform: Transform | None


def _projectors(file: _GGUFFile) -> list[TowerNames]:
    """The towers an mmproj holds, from its projector-type keys (the legacy single
    ``clip.projector_type`` included)."""
    meta = file.metadata
    if meta.get("general.architecture") != "clip":
        raise GGUFError(
            f"{file.name} is not an mmproj file: its general.architecture is "
            f"{meta.get('general.architecture')!r}, not 'clip'"
        )
    types = []
    for modality in ("vision", "audio"):
        kind = meta.get(f"clip.{modality}.projector_type")
        if kind is None and meta.get(f"clip.has_{modality}_encoder") and modality == "vision":
            kind = meta.get("clip.projector_type")
        if kind is not None:
            types.append((modality, kind))
    if not types:
        raise GGUFError(
            f"{file.name} names no projector type (clip.vision.projector_type / clip.audio.projector_type)"
        )
    towers = []
    for modality, kind in types:
        tower = TOWERS.get(kind)
        if tower is None or tower.modality != modality:
            raise GGUFError(
                f"{file.name}: {modality} projector type {kind!r} is not one torchgemma reads "
                f"(it reads {', '.join(TOWERS)})"
            )
        towers.append(tower)
    return towers


def _gguf_name(towers: list[TowerNames], hf_name: str) -> str:
    """The mmproj name llama.cpp's converter gives a Hugging Face tower tensor (for errors)."""
    for tower in towers:
        for gguf, hf in tower.globals.items():
            if hf == hf_name:
                return gguf
        if hf_name.startswith(tower.hf_layer_prefix):
            parts = hf_name.removeprefix(tower.hf_layer_prefix).split(".", tower.layer_depth)
            layer, rest = ".".join(parts[:-1]), parts[-1]
            for suffix, hf in tower.layer.items():
                if rest == hf:
                    return f"{tower.layer_prefix}{layer}.{suffix}"
                base, _, bound = rest.rpartition(".")
                if bound in BOUNDS and hf == f"{base}.linear.weight":
                    return f"{tower.layer_prefix}{layer}.{suffix.removesuffix('weight')}{bound}"
    return "(no mmproj name)"


class MmprojFile:
    """An mmproj GGUF: its towers (``TowerNames``), their Hugging Face configs and tensors."""

    def __init__(self, file: _GGUFFile):
        self.file, self.name, self.metadata = file, file.name, file.metadata
        self.towers = _projectors(file)
        file.check_tensors()  # types, sizes, alignment, bounds, and no shared bytes
        self.entries: list[_TowerEntry] = []
        unknown = []
        for name, info in file.tensors.items():
            found = next((m for t in self.towers if (m := t.hf_name(name))), None)
            if found is None:
                unknown.append(name)
                continue
            if info.qtype not in SUPPORTED_TYPES:
                raise GGUFError(
                    f"{self.name}: tensor {name} is stored as {info.type_name}, a GGML type this reader "
                    f"cannot dequantize"
                )
            self.entries.append(_TowerEntry(found[0], name, found[1]))
        if unknown:
            raise GGUFError(
                f"{self.name}: {len(unknown)} tensor(s) that no {'/'.join(t.projector for t in self.towers)} "
                f"tower of llama.cpp's names, e.g. {', '.join(unknown[:5])}"
            )

    def configs(self) -> dict[str, Any]:
        """``{"vision_config": {...}, "audio_config": {...}}`` for the towers the file holds (and
        their top-level fields, such as Gemma 3's ``mm_tokens_per_image``)."""
        out = {}
        for tower in self.towers:
            key, config = tower.config(self.metadata, self.file.tensors, self.name)
            out[key] = config
            if tower.top_level is not None:
                out.update(tower.top_level(self.metadata, self.file.tensors, self.name))
        return out

    def projection_width(self, tower: TowerNames) -> int | None:
        """The text width the tower's soft tokens are projected into (``clip.*.projection_dim``)."""
        return self.metadata.get(f"clip.{tower.modality}.projection_dim")

    def shape(self, entry: _TowerEntry) -> tuple[int, ...]:
        shape = self.file.tensors[entry.source].shape
        return entry.transform.shape(shape) if entry.transform else shape

    def load(self, entry: _TowerEntry, dtype: torch.dtype) -> torch.Tensor:
        info = self.file.tensors[entry.source]
        try:
            tensor = dequantize(self.file.raw(info), info.qtype, info.shape, torch.float32, finite=True)
        except NonFiniteWeights as err:
            raise GGUFError(f"{self.name}: tensor {entry.source} ({entry.hf_name}) holds {err}") from None
        self.file.release(info)
        if entry.transform is not None:
            tensor = entry.transform.apply(tensor)
        return tensor.to(dtype).contiguous()


def _media_token_ids(layout: MultimodalLayout, metadata: Mapping[str, Any]) -> dict[str, int]:
    """The media token ids of the model file's vocabulary, found by their text (those it lacks take
    the config's defaults)."""
    wanted = {text: key for key, text in layout.media_tokens.items()}
    found = {}
    for index, token in enumerate(metadata.get("tokenizer.ggml.tokens") or []):
        if token in wanted:
            found[wanted[token]] = index
    return found


class MultimodalGGUF:
    """A model GGUF and its mmproj GGUF as one Hugging Face multimodal checkpoint: ``config``,
    ``model_config``, ``tensor_names()``, ``shape()``, ``tensor()``, and the grouped-integer access
    of the text tensors that ``GGUFCheckpoint`` gives (``int_format``, ``grouped_ints``)."""

    def __init__(self, text: GGUFCheckpoint, mmproj: MmprojFile):
        self.text, self.mmproj, self.path = text, mmproj, text.path
        kinds = {tower.layout for tower in mmproj.towers}
        if len(kinds) != 1:
            raise GGUFError(f"{mmproj.name} mixes towers of {' and '.join(sorted(kinds))} models")
        layout = LAYOUTS[kinds.pop()]
        width = text.config["hidden_size"]
        for tower in mmproj.towers:
            if text.architecture not in tower.models:
                raise GGUFError(
                    f"{mmproj.name} holds a {tower.projector} {tower.modality} tower, made for "
                    f"{'/'.join(tower.models)} models; {text.path.name} is {text.architecture}: is the "
                    f"mmproj another model's?"
                )
            projected = mmproj.projection_width(tower)
            if projected is not None and projected != width:
                raise GGUFError(
                    f"{mmproj.name}: its {tower.modality} tower projects into a {projected}-wide text model "
                    f"(clip.{tower.modality}.projection_dim) but {text.path.name}'s is {width} wide "
                    f"({text.architecture}.embedding_length): is the mmproj another model's?"
                )
        towers = mmproj.configs()
        text_config = {**text.config, **layout.text_fields(text.config, towers)}
        self.config = {
            "architectures": [layout.architecture],
            "model_type": layout.model_type,
            "text_config": text_config,
            "tie_word_embeddings": text_config["tie_word_embeddings"],
            **towers,
            **_media_token_ids(layout, text.metadata),
        }
        try:
            self.model_config = ModelConfig.from_hf(self.config)
        except ConfigError as err:
            raise ConfigError(f"{text.path.name} with {mmproj.name}: {err}") from err
        self.metadata = text.metadata
        self.architecture = text.architecture
        # Text tensors: model.X -> model.language_model.X (the head keeps its name).
        prefix = "model." + layout.text_prefix
        self._text = {
            (prefix + n.removeprefix("model.") if n.startswith("model.") else n): n
            for n in text.tensor_names()
        }
        self._towers = {e.hf_name: e for e in mmproj.entries}

    # -- the GGUFCheckpoint interface the loader uses ----------------------------------------------

    def tensor_names(self) -> list[str]:
        return [*self._text, *self._towers]

    def shape(self, hf_name: str) -> tuple[int, ...]:
        if hf_name in self._towers:
            return self.mmproj.shape(self._towers[hf_name])
        return self.text.shape(self._text_name(hf_name))

    def tensor(self, hf_name: str, dtype: torch.dtype = torch.float32, pieces=None) -> torch.Tensor:
        if hf_name in self._towers:  # the towers are never split (replicated under tensor parallelism)
            return self.mmproj.load(self._towers[hf_name], dtype)
        return self.text.tensor(self._text_name(hf_name), dtype, pieces)

    def load(self, hf_name: str, dtype: torch.dtype = torch.float32) -> TensorLoad:
        return TensorLoad(self, hf_name, dtype)

    def stored_bytes(self, hf_name: str) -> int:
        if hf_name in self._towers:
            return self.mmproj.file.tensors[self._towers[hf_name].source].n_bytes
        return self.text.stored_bytes(self._text_name(hf_name))

    def int_format(self, hf_name: str) -> tuple[int, int, bool] | None:
        """Only the text model's tensors are kept as grouped integers; the towers are dequantized."""
        return None if hf_name in self._towers else self.text.int_format(self._text_name(hf_name))

    def grouped_ints(self, hf_name: str, pieces=None):
        return self.text.grouped_ints(self._text_name(hf_name), pieces)

    def _text_name(self, hf_name: str) -> str:
        try:
            return self._text[hf_name]
        except KeyError:
            raise KeyError(f"{self.path.name} with {self.mmproj.name} has no tensor {hf_name!r}") from None

    def check_shapes(self, model: torch.nn.Module | None = None) -> None:
        """The text tensors as ``GGUFCheckpoint.check_shapes`` checks them; every tower tensor
        against ``model`` (by default the one ``model_config`` builds, on the meta device): none
        missing, none without a place, each with its shape. Errors name the mmproj tensor."""
        config = self.model_config
        if model is None:
            from ...model import Gemma

            with torch.device("meta"):
                model = Gemma(config)
        self.text.check_shapes(model, only="language_model.")
        expected = {p: s for p, s in _model_shapes(model).items() if not p.startswith("language_model.")}
        problems, covered = [], set()
        for entry in self.mmproj.entries:
            path = config.module_path(entry.hf_name)
            if path not in expected:
                problems.append(
                    f"unexpected tensor {entry.source} ({entry.hf_name}): the model has no place for it"
                )
                continue
            covered.add(path)
            got = self.mmproj.shape(entry)
            if got != expected[path]:
                problems.append(
                    f"{entry.source} ({entry.hf_name}) has shape {list(got)}, the config implies {list(expected[path])}"
                )
        for path in expected:
            if path not in covered:
                hf = config.checkpoint_name(path)
                problems.append(f"missing tensor {_gguf_name(self.mmproj.towers, hf)} (for {hf})")
        if problems:
            shown = "; ".join(problems[:8]) + (
                f"; ... ({len(problems)} problems)" if len(problems) > 8 else ""
            )
            raise GGUFError(f"{self.mmproj.name} does not fit {self.path.name}: {shown}")

    def __repr__(self) -> str:
        return f"MultimodalGGUF({self.path.name!r}, {self.mmproj.name!r}, {len(self.tensor_names())} tensors)"


def read_gguf_with_mmproj(
    path: str | Path, mmproj: str | Path, *, check_shapes: bool = True
) -> MultimodalGGUF:
    """A model GGUF and llama.cpp's mmproj GGUF of its towers, as one multimodal checkpoint.

    Errors as ``read_gguf``'s, and a ``GGUFError`` naming the mmproj tensor or key for an mmproj
    that does not fit the model (``MultimodalGGUF.check_shapes``; ``check_shapes=False`` leaves
    that to the caller)."""
    checkpoint = MultimodalGGUF(read_gguf(path, check_shapes=False), MmprojFile(_GGUFFile(Path(mmproj))))
    if check_shapes:
        checkpoint.check_shapes()
    return checkpoint

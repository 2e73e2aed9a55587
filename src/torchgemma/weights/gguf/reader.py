"""Reading a GGUF file: its header (metadata and tensor table, every length and offset checked
against the file's size before it is used), the types of the metadata values this package reads,
and raw, memory-mapped views of tensor data.

The header is parsed here rather than with `gguf.GGUFReader`: the stock reader builds two numpy
views per vocabulary string, which takes 5-15 s for Gemma's 262k-token vocabulary, and it maps
tensor data through unchecked slices (a truncated file fails later with a reshape error). The
layout, type ids and block sizes are the gguf package's (`GGUFValueType`, `GGML_QUANT_SIZES`);
tests check this parser against `GGUFReader` field by field.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A GGUF file that cannot be read, or that describes something this reader does not support."""


_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip
# The fewest bytes one array item of each type takes (a string: its length; an array: type and count),
# so that a claimed length the file cannot hold is refused before anything is read or allocated.
_MIN_ITEM_BYTES = {
    **{vtype: struct.calcsize(fmt) for vtype, fmt in _SCALARS.items()},
    GGUFValueType.STRING: 8,
    GGUFValueType.ARRAY: 12,
}
# ggml's limits (GGML_MAX_DIMS; a tensor's element count is an int64_t).
_MAX_DIMS = 4
_MAX_VALUES = 2**63 - 1


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    type_id: int
    dims: tuple[int, ...]  # GGUF order: innermost dimension first
    offset: int  # absolute byte offset of the data in the file

    @property
    def shape(self) -> tuple[int, ...]:
        """Outermost dimension first, as torch and Hugging Face list them."""
        return tuple(reversed(self.dims))

    @property
    def qtype(self) -> GGMLQuantizationType | None:
        try:
            return GGMLQuantizationType(self.type_id)
        except ValueError:
            return None

    @property
    def type_name(self) -> str:
        qtype = self.qtype
        return qtype.name if qtype is not None else f"unknown GGML type id {self.type_id}"

    @property
    def n_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.dims) * type_size // block  # Python ints: no int64 wrap-around


class _GGUFFile:
    """A GGUF file, memory-mapped: its metadata and tensor table, and raw views of tensor data."""

    def __init__(self, path: Path):
        self.path = path
        self.name = path.name
        with open(path, "rb") as f:  # a missing file raises FileNotFoundError, as for any open
            head = f.read(8)
            if not head:
                raise GGUFError(f"{self.name} is not a GGUF file: it is empty")
            if head[:4] != _MAGIC:
                raise GGUFError(f"{self.name} is not a GGUF file: it starts with {head!r}, not {_MAGIC!r}")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = len(self._map)
        self._pos = 4
        version = self._scalar("<I")
        if version & 0xFFFF == 0:
            raise GGUFError(f"{self.name} is a big-endian GGUF file, which is not supported")
        if version not in (2, 3):
            raise GGUFError(f"{self.name} is GGUF version {version}; versions 2 and 3 are supported")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        # A key/value takes at least 13 bytes (name length, type, one-byte value), a tensor entry 24.
        self._need(13 * n_kv + 24 * n_tensors, f"{n_kv} metadata keys and {n_tensors} tensors", advance=False)
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string("a metadata key name")
            self.metadata[key] = self._value(self._scalar("<I"), key)
        check_metadata_types(self.metadata, self.name)
        infos = []
        for _ in range(n_tensors):
            name = self._string("a tensor name")
            n_dims = self._scalar("<I")
            if n_dims > _MAX_DIMS:
                raise GGUFError(
                    f"{self.name}: tensor {name} has {n_dims} dimensions; GGUF allows at most {_MAX_DIMS}"
                )
            dims = tuple(self._scalar("<Q") for _ in range(n_dims))
            if (n_values := math.prod(dims)) > _MAX_VALUES:
                raise GGUFError(
                    f"{self.name}: tensor {name} has dimensions {list(dims)}, {n_values} values, more than a "
                    f"tensor can hold (2**63 - 1)"
                )
            infos.append((name, dims, self._scalar("<I"), self._scalar("<Q")))
        alignment = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.name}: general.alignment {alignment!r} is not a power of two")
        self.alignment = alignment
        self.data_offset = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, _TensorInfo] = {}
        for name, dims, type_id, offset in infos:
            if name in self.tensors:
                raise GGUFError(f"{self.name} lists tensor {name} twice")
            self.tensors[name] = _TensorInfo(name, type_id, dims, self.data_offset + offset)
        # The header (a 262k vocabulary and its merges: ~15 MB) has been walked: its pages leave the
        # process until a string array is read (they fault in again from the file then).
        header = min(self.data_offset, self.size) // mmap.PAGESIZE * mmap.PAGESIZE
        if hasattr(mmap, "MADV_DONTNEED") and header > 0:
            self._map.madvise(mmap.MADV_DONTNEED, 0, header)

    # -- header parsing ----------------------------------------------------------------------------

    def _need(self, n: int, what: str = "", advance: bool = True) -> int:
        """Claim the next n header bytes (the start offset); a claim past the end names what wanted it."""
        start, end = self._pos, self._pos + n
        if end > self.size:
            raise GGUFError(
                f"{self.name} is truncated: its header needs bytes up to {end}, file has {self.size}"
                + (f" ({what})" if what else "")
            )
        if advance:
            self._pos = end
        return start

    def _scalar(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self._map, self._need(struct.calcsize(fmt)))[0]

    def _string(self, what: str) -> str:
        n = self._scalar("<Q")
        start = self._need(n, f"{what}: a string of {n} bytes")
        try:
            return self._map[start : start + n].decode("utf-8")
        except UnicodeDecodeError as err:
            raise GGUFError(f"{self.name}: {what} at byte {start} is not UTF-8 ({err})") from None

    def _strings(self, count: int, key: str) -> Sequence[str]:
        # The vocabulary is 262k strings and the merges 515k: their lengths are walked now (the
        # header's end depends on them), the strings decoded only when read (_StringArray; a string
        # that is not UTF-8 is named then). Loading the weights never reads them: ~45 MB of Python
        # strings not made.
        data, size, pos, unpack = self._map, self.size, self._pos, struct.Struct("<Q").unpack_from
        start = pos
        for i in range(count):
            end = pos + 8 + (unpack(data, pos)[0] if pos + 8 <= size else 0)
            if end > size:  # re-read the string that did not fit, for the error that says so
                self._pos = pos
                self._string(f"metadata key {key}, string {i} of {count}")
            pos = end
        self._pos = pos
        if count < 4096:  # short arrays (and their errors) at once
            return self.decode_strings(key, start, count)
        return _StringArray(self, key, start, count)

    def decode_strings(self, key: str, start: int, count: int) -> list[str]:
        """The ``count`` length-prefixed UTF-8 strings from byte ``start`` (walked by ``_strings``)."""
        data, pos, unpack = self._map, start, struct.Struct("<Q").unpack_from
        out: list[str] = []
        for i in range(count):
            end = pos + 8 + unpack(data, pos)[0]
            try:
                out.append(data[pos + 8 : end].decode("utf-8"))
            except UnicodeDecodeError as err:
                raise GGUFError(
                    f"{self.name}: metadata key {key}, string {i}, is not UTF-8 ({err})"
                ) from None
            pos = end
        return out

    def _value(self, type_id: int, key: str) -> Any:
        try:
            vtype = GGUFValueType(type_id)
        except ValueError:
            raise GGUFError(f"{self.name}: metadata key {key} has unknown value type {type_id}") from None
        if vtype == GGUFValueType.STRING:
            return self._string(f"metadata key {key}")
        if vtype == GGUFValueType.ARRAY:
            item_id, count = self._scalar("<I"), self._scalar("<Q")
            try:
                item = GGUFValueType(item_id)
            except ValueError:
                raise GGUFError(
                    f"{self.name}: metadata key {key} is an array of unknown type {item_id}"
                ) from None
            # Refuse a length the rest of the file cannot hold at once, before reading any item.
            least = _MIN_ITEM_BYTES[item] * count
            self._need(least, f"metadata key {key}: an array of {count} {item.name} values", advance=False)
            if item in _SCALARS:
                start = self._need(least)
                return np.frombuffer(
                    self._map, dtype=np.dtype(_SCALARS[item]), count=count, offset=start
                ).tolist()
            if item == GGUFValueType.STRING:
                return self._strings(count, key)
            return [self._value(item_id, key) for _ in range(count)]
        value = self._scalar(_SCALARS[vtype])
        # A float32 such as 1e-6 reads back as 9.99999997e-07: keep the decimal the writer meant.
        return _f32(value) if vtype == GGUFValueType.FLOAT32 else value

    # -- tensor data -------------------------------------------------------------------------------

    def check(self, info: _TensorInfo) -> None:
        """Raise unless the tensor's type is known, its rows fill whole blocks, its data starts on the
        file's alignment and its bytes are in the file."""
        if info.qtype is None:
            raise GGUFError(
                f"{self.name}: tensor {info.name} has {info.type_name}, not a known quantization type"
            )
        block = GGML_QUANT_SIZES[info.qtype][0]
        if info.dims and info.dims[0] % block:
            raise GGUFError(
                f"{self.name}: tensor {info.name} of type {info.type_name} has rows of {info.dims[0]} values, "
                f"not a multiple of its block size {block}"
            )
        # GGUF: "the offset of each tensor's data must be a multiple of ALIGNMENT" (llama.cpp's
        # gguf_init_from_file refuses a file where it is not).
        if (info.offset - self.data_offset) % self.alignment:
            raise GGUFError(
                f"{self.name}: tensor {info.name} starts at offset {info.offset - self.data_offset} of the data "
                f"section, not a multiple of its alignment {self.alignment}"
            )
        end = info.offset + info.n_bytes
        if end > self.size:
            raise GGUFError(
                f"{self.name} is truncated: tensor {info.name} needs bytes up to {end}, file has {self.size}"
            )

    def check_tensors(self) -> None:
        """``check`` every tensor, then that no two share a byte: a tensor whose bytes overlap (or
        alias) another's would read the other's data as its own, and its size would not be what its
        type and shape say. llama.cpp refuses such files (it requires each tensor to start where the
        one before it ends, padded to the alignment); this is the weaker condition that makes every
        read safe, in O(n log n). Errors name both tensors and their byte ranges."""
        for info in self.tensors.values():
            self.check(info)
        spans = sorted(
            (info.offset, info.offset + info.n_bytes, info.name)
            for info in self.tensors.values()
            if info.n_bytes
        )
        reach, holder = -1, None  # the furthest end so far, and whose it is
        for start, end, name in spans:
            if start < reach:
                first = self.tensors[holder]
                raise GGUFError(
                    f"{self.name}: tensors {holder} (bytes {first.offset}-{first.offset + first.n_bytes}) and {name} "
                    f"(bytes {start}-{end}) overlap: each tensor's {self.alignment}-aligned data must have bytes "
                    f"of its own"
                )
            reach, holder = end, name

    def release(self, info: _TensorInfo, begin: int = 0, end: int | None = None) -> None:
        """Drop the tensor's pages (or those of its bytes ``begin:end``) from this process's memory
        once they have been read (a later read faults them in again from the file): loading then
        holds one tensor's pages at a time, not the whole file's."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = info.offset + begin
        start -= start % mmap.PAGESIZE
        stop = min(info.offset + (info.n_bytes if end is None else end), self.size)
        if stop > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def raw(self, info: _TensorInfo) -> np.ndarray:
        """The tensor's stored data, zero-copy, shaped as `gguf.quants.dequantize` expects."""
        self.check(info)
        data = np.frombuffer(self._map, dtype=np.uint8, count=info.n_bytes, offset=info.offset)
        if info.qtype == GGMLQuantizationType.F32:
            return data.view(np.float32).reshape(info.shape)
        if info.qtype == GGMLQuantizationType.F16:
            return data.view(np.float16).reshape(info.shape)
        return data.reshape(quant_shape_to_byte_shape(info.shape, info.qtype))


def _f32(value: float) -> float:
    return float(str(np.float32(value)))


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata key/values of a GGUF file (``general.*``, ``{arch}.*``, ``tokenizer.*``).

    float32 scalars come back as the shortest decimal that rounds to them (``1e-06``, not
    ``9.99999997e-07``); arrays come back as lists.
    """
    return _GGUFFile(Path(path)).metadata


# --------------------------------------------------------------------------------------------------
# Metadata value types
#
# The keys this package reads, with the type llama.cpp's converter stores in each. A value of another
# type (a block count written as a string, a token list of numbers) is refused by name when the file
# is opened, rather than failing later somewhere unrelated; counts that size things have a floor, and
# the layer count llama.cpp's ceiling (LLAMA_MAX_LAYERS, llama-hparams.h), so that nothing is built
# from a corrupt count.

_MAX_LAYERS = 512


class _StringArray(Sequence[str]):
    """A metadata array of strings, decoded from the file at its first read (then kept)."""

    def __init__(self, file: _GGUFFile, key: str, start: int, count: int):
        self._file, self._key, self._start, self._count = file, key, start, count
        self._items: list[str] | None = None

    def _decoded(self) -> list[str]:
        if self._items is None:
            self._items = self._file.decode_strings(self._key, self._start, self._count)
        return self._items

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        return self._decoded()[index]

    def __iter__(self):
        return iter(self._decoded())

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (list, _StringArray)) else NotImplemented

    def __repr__(self) -> str:
        return f"<{self._count} strings of {self._key}>"


def _all(value: Any, *types: type) -> bool:
    if isinstance(value, _StringArray):  # strings by construction (a bad one fails when decoded)
        return str in types
    return isinstance(value, list) and set(map(type, value)) <= set(types)


_KINDS = {  # kind: (what it must be, test); exact types, so that True is not a count
    "int": ("an integer", lambda v: type(v) is int),
    "number": ("a number", lambda v: type(v) in (int, float)),
    "bool": ("a bool", lambda v: type(v) in (bool, int)),
    "string": ("a string", lambda v: type(v) is str),
    "per-layer int": (
        "an integer or an array of integers (one per layer)",
        lambda v: type(v) is int or _all(v, int),
    ),
    "period or bools": (
        "an integer period or an array of bools (one per layer)",
        lambda v: type(v) is int or _all(v, bool, int),
    ),
    "strings": ("an array of strings", lambda v: _all(v, str)),
    "numbers": ("an array of numbers", lambda v: _all(v, float, int)),
    "ints": ("an array of integers", lambda v: _all(v, int)),
}
# key: (kind, least value or None)
_KEY_KINDS = {
    "general.architecture": ("string", None),
    "general.alignment": ("int", 1),
    "tokenizer.ggml.model": ("string", None),
    "tokenizer.ggml.tokens": ("strings", None),
    "tokenizer.ggml.scores": ("numbers", None),
    "tokenizer.ggml.token_type": ("ints", None),
    "tokenizer.ggml.merges": ("strings", None),
    "tokenizer.ggml.bos_token_id": ("int", None),
    "tokenizer.ggml.eos_token_id": ("int", None),
    "tokenizer.ggml.padding_token_id": ("int", None),
    "tokenizer.ggml.unknown_token_id": ("int", None),
    "tokenizer.ggml.add_bos_token": ("bool", None),
    "tokenizer.ggml.add_eos_token": ("bool", None),
    "tokenizer.chat_template": ("string", None),
}
# The same under `{general.architecture}.`; block_count first, as the per-layer arrays are checked against it.
_ARCH_KEY_KINDS = {
    "block_count": ("int", 1),
    "context_length": ("int", 1),
    "embedding_length": ("int", 1),
    "vocab_size": ("int", 1),
    "feed_forward_length": ("per-layer int", 0),
    "attention.head_count": ("per-layer int", 1),
    "attention.head_count_kv": ("per-layer int", 0),
    "attention.key_length": ("int", 1),
    "attention.key_length_swa": ("int", 1),
    "attention.sliding_window": ("int", 0),
    "attention.sliding_window_pattern": ("period or bools", 0),
    "attention.shared_kv_layers": ("int", 0),
    "attention.layer_norm_rms_epsilon": ("number", None),
    "rope.freq_base": ("number", None),
    "rope.freq_base_swa": ("number", None),
    "rope.scaling.type": ("string", None),
    "rope.scaling.factor": ("number", None),
    "final_logit_softcapping": ("number", None),
    "embedding_length_per_layer_input": ("int", 0),
    "expert_count": ("int", 0),
    "expert_used_count": ("int", 0),
    "expert_feed_forward_length": ("per-layer int", 0),
    "altup.num_inputs": ("int", 1),
    "altup.active_idx": ("int", 0),
    "activation_sparsity_scale": ("numbers", None),
}
_TYPE_NAMES = {str: "string", int: "integer", float: "float", bool: "bool", list: "array"}


def _describe(value: Any) -> str:
    if isinstance(value, _StringArray):
        return f"an array of {len(value)} items (string)"
    if isinstance(value, list):
        if not value:
            return "an empty array"
        items = sorted({_TYPE_NAMES.get(type(v), type(v).__name__) for v in value})
        return f"an array of {len(value)} items ({', '.join(items)})"
    return f"the {_TYPE_NAMES.get(type(value), type(value).__name__)} {value!r:.60}"


def check_metadata_types(metadata: Mapping[str, Any], source: str = "GGUF file") -> None:
    """Raise ``GGUFError`` naming the key if a metadata value this package reads has the wrong type or range.

    Keys that are absent are not checked here (their readers say what is missing); per-layer arrays
    must have ``block_count`` entries, and ``block_count`` is at most llama.cpp's 512.
    """
    arch = metadata.get("general.architecture")
    keys = dict(_KEY_KINDS)
    if type(arch) is str:
        keys.update({f"{arch}.{key}": kind for key, kind in _ARCH_KEY_KINDS.items()})
    for key, (kind, least) in keys.items():
        if key not in metadata:
            continue
        value = metadata[key]
        expected, test = _KINDS[kind]
        if not test(value):
            raise GGUFError(f"{source}: metadata key {key} should be {expected}, but is {_describe(value)}")
        if least is not None and type(value) is int and value < least:
            raise GGUFError(f"{source}: metadata key {key} is {value}; it must be at least {least}")
        if least is not None and isinstance(value, list) and value and min(value) < least:
            raise GGUFError(
                f"{source}: metadata key {key} holds {min(value)}; its entries must be at least {least}"
            )
    blocks = metadata.get(f"{arch}.block_count")
    if blocks is None:
        return
    if blocks > _MAX_LAYERS:
        raise GGUFError(
            f"{source}: metadata key {arch}.block_count is {blocks}; llama.cpp reads at most {_MAX_LAYERS} "
            f"layers (LLAMA_MAX_LAYERS)"
        )
    for key, (kind, _) in _ARCH_KEY_KINDS.items():
        value = metadata.get(f"{arch}.{key}")
        if kind in ("per-layer int", "period or bools") and isinstance(value, list) and len(value) != blocks:
            raise GGUFError(
                f"{source}: metadata key {arch}.{key} has {len(value)} entries, but {arch}.block_count is {blocks} "
                f"(one entry per layer)"
            )

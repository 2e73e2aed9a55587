"""GGUF files -> a Hugging Face ``config.json`` dict and Hugging Face checkpoint tensors.

A GGUF holds what llama.cpp's converter made of a Hugging Face checkpoint: its own tensor names
(``blk.3.attn_q.weight``), dimensions listed innermost first, quantized blocks, hyper-parameters as
``{arch}.*`` metadata keys, and for Gemma 3 every RMSNorm weight stored as ``1 + w``. ``read_gguf``
undoes each of those, so that a caller sees the names, shapes, values and config of the checkpoint the
file was converted from:

    ckpt = read_gguf("gemma-3-270m-q4_k_m.gguf")
    ckpt.config["model_type"]                      # "gemma3_text"
    for name, tensor in ckpt.tensors(dtype=torch.bfloat16):   # one tensor in memory at a time
        ...

Facts about llama.cpp's conventions come from its converter (``Gemma3Model`` / ``Gemma4Model`` in
convert_hf_to_gguf), its loader (``llama_model::load_hparams``), the ``gguf`` package's tables and
transformers' GGUF integration; each use is commented where it is made.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize as _gguf_dequantize
from gguf.quants import quant_shape_to_byte_shape

__all__ = [
    "GGUFCheckpoint",
    "GGUFError",
    "GroupedInts",
    "INT_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TYPES",
    "check_metadata_types",
    "dequantize",
    "grouped_ints",
    "read_gguf",
    "read_gguf_metadata",
]

SUPPORTED_ARCHITECTURES = ("gemma3", "gemma3n", "gemma4")

_T = GGMLQuantizationType
# Types whose dequantization is checked bit for bit against ggml's reference loops (tests/test_gguf.py).
_VERIFIED_TYPES = (
    _T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0,
    _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K,
)  # fmt: skip
# Further types the gguf package dequantizes (the same code transformers uses); checked against it only.
_EXTRA_TYPES = tuple(
    getattr(_T, name)
    for name in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
                 "TQ1_0", "TQ2_0", "MXFP4")
    if hasattr(_T, name)
)  # fmt: skip
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_VERIFIED_TYPES + _EXTRA_TYPES)

_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A GGUF file that cannot be read, or that describes something this reader does not support."""


# --------------------------------------------------------------------------------------------------
# Opening the file
#
# The header is parsed here rather than with `gguf.GGUFReader`: the stock reader builds two numpy
# views per vocabulary string, which takes 5-15 s for Gemma's 262k-token vocabulary, and it maps
# tensor data through unchecked slices (a truncated file fails later with a reshape error). The
# layout, type ids and block sizes are the gguf package's (`GGUFValueType`, `GGML_QUANT_SIZES`);
# tests check this parser against `GGUFReader` field by field.

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
        """Raise unless the tensor's type is known, its rows fill whole blocks and its bytes are in the file."""
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
        end = info.offset + info.n_bytes
        if end > self.size:
            raise GGUFError(
                f"{self.name} is truncated: tensor {info.name} needs bytes up to {end}, file has {self.size}"
            )

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


# --------------------------------------------------------------------------------------------------
# Dequantization


def dequantize(
    data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A ``dtype`` tensor of ``shape`` (outermost dimension first) from a tensor's raw GGUF data.

    The types ggml's reference loops are checked against (``_VERIFIED_TYPES``) are decoded here, a
    whole tensor at a time in chunks of blocks, with the float32 operations of ``dequantize_row_*``
    in their order, which are also those of ``gguf.quants.dequantize`` (what transformers' GGUF
    loader uses): the values are the same to the bit (tests compare all three). Each float32 chunk is
    written straight into the result, or cast into it once for another ``dtype``. The further types go
    through ``gguf.quants.dequantize``.
    """
    if qtype not in SUPPORTED_TYPES:
        raise GGUFError(f"GGML type {qtype.name} is not supported")
    decode = _DECODERS.get(qtype)
    if decode is None:
        return torch.from_numpy(np.asarray(_gguf_dequantize(data, qtype)).reshape(shape)).to(dtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_values = math.prod(shape)
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if n_values % block or raw.size != n_values // block * type_size:
        raise GGUFError(f"{raw.size} bytes of {qtype.name} data do not hold a tensor of shape {list(shape)}")
    blocks = raw.reshape(-1, type_size)
    # Allocated by numpy, which asks for 2 MB pages (MADV_HUGEPAGE) on large arrays: the 671 MB Gemma 3
    # embedding then faults in about 4x faster than in torch's 4 KB pages.
    itemsize = torch.empty((), dtype=dtype).element_size()
    out = torch.from_numpy(np.empty(n_values * itemsize, np.uint8)).view(dtype).view(shape)
    rows = out.view(-1, block)  # (n_blocks, block)
    step = max(1, _CHUNK_VALUES // block)
    direct = rows.numpy() if dtype == torch.float32 else None
    scratch = np.empty((min(step, len(blocks)), block), np.float32)
    # NaN or infinite scales decode as ggml decodes them, without numpy's warnings.
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, len(blocks), step):
            part = blocks[start : start + step]
            if direct is not None:
                decode(part, direct[start : start + len(part)])
            else:
                decode(part, scratch[: len(part)])
                rows[start : start + len(part)].copy_(torch.from_numpy(scratch[: len(part)]))
    return out


# Values decoded per step: one step's float32 values and byte-sized temporaries stay in the cache.
_CHUNK_VALUES = 1 << 17

# Each decoder turns (n, type_size) bytes, n blocks of one type (layouts: ggml-common.h), into
# (n, block) float32 values in `out`. Integers are exact in float32, so only the float operations'
# order matters: d * q, then +/- the block minimum, never fused.


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of each block, as float32, (n, 1)."""
    return blocks[:, at : at + 2].view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(n, k) bytes -> (n, 2k) 4-bit values: every low nibble, then every high one."""
    n, k = packed.shape
    q = np.empty((n, 2 * k), np.uint8)
    np.bitwise_and(packed, 0x0F, out=q[:, :k])
    np.right_shift(packed, 4, out=q[:, k:])
    return q


def _fifth_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: value j is nibble j with bit j of the 32-bit qh as its fifth bit."""
    q = _nibbles(qs)
    q |= np.unpackbits(qh, axis=1, bitorder="little") << np.uint8(4)
    return q


def _decode_f32(blocks: np.ndarray, out: np.ndarray) -> None:
    out[...] = blocks.view(np.float32)


def _decode_f16(blocks: np.ndarray, out: np.ndarray) -> None:
    out[...] = blocks.view(np.float16)


def _decode_bf16(blocks: np.ndarray, out: np.ndarray) -> None:
    np.left_shift(blocks.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)


def _decode_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(blocks[:, 2:].view(np.int8), _half(blocks, 0), out=out)


def _decode_q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    np.subtract(_nibbles(blocks[:, 2:]), np.float32(8), out=out)
    np.multiply(_half(blocks, 0), out, out=out)


def _decode_q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_half(blocks, 0), _nibbles(blocks[:, 4:]), out=out)
    np.add(out, _half(blocks, 2), out=out)


def _decode_q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    np.subtract(_fifth_bits(blocks[:, 2:6], blocks[:, 6:]), np.float32(16), out=out)
    np.multiply(_half(blocks, 0), out, out=out)


def _decode_q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_half(blocks, 0), _fifth_bits(blocks[:, 4:8], blocks[:, 8:]), out=out)
    np.add(out, _half(blocks, 2), out=out)


# K-quants: 256 values in sub-blocks of 16 or 32, each with its own 4- or 6-bit scale (and minimum).
_SHIFT_2 = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
_SHIFT_1 = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)


def _crumbs(packed: np.ndarray) -> np.ndarray:
    """(n, 64) bytes -> (n, 16, 16) 2-bit values: per 32 bytes, bits 0-1 of each, then 2-3, 4-5, 6-7."""
    n = len(packed)
    return ((packed.reshape(n, 2, 1, 32) >> _SHIFT_2) & 3).reshape(n, 16, 16)


def _bits(packed: np.ndarray, groups: int) -> np.ndarray:
    """(n, 32) bytes -> (n, groups, 256 // groups) bits: bit 0 of every byte, then bit 1, ... bit 7."""
    n = len(packed)
    return ((packed.reshape(n, 1, 1, 32) >> _SHIFT_1) & 1).reshape(n, groups, -1)


def _decode_q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = len(blocks)
    scales = blocks[:, :16]
    dl = (_half(blocks, 80) * (scales & 0x0F)).reshape(n, 16, 1)
    ml = (_half(blocks, 82) * (scales >> 4)).reshape(n, 16, 1)
    values = out.reshape(n, 16, 16)
    np.multiply(dl, _crumbs(blocks[:, 16:80]), out=values)
    np.subtract(values, ml, out=values)


def _decode_q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = len(blocks)
    packed = blocks[:, 96:108]  # 16 6-bit scales: low 4 bits in bytes 0-7, high 2 bits in bytes 8-11
    low = np.concatenate([packed[:, :8] & 0x0F, packed[:, :8] >> 4], axis=1)
    high = ((packed[:, 8:].reshape(n, 1, 4) >> _SHIFT_2.reshape(1, 4, 1)) & 3).reshape(n, 16)
    scales = (low | (high << np.uint8(4))).view(np.int8) - np.int8(32)
    dl = (_half(blocks, 108) * scales).reshape(n, 16, 1)
    # A value is its 2 low bits, less 4 where its bit in the high mask is clear.
    q = _crumbs(blocks[:, 32:96]).view(np.int8)
    q -= ((_bits(blocks[:, :32], 16) ^ 1) << np.uint8(2)).view(np.int8)
    np.multiply(dl, q, out=out.reshape(n, 16, 16))


def _k_nibbles(packed: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: (n, 128) bytes -> (n, 8, 32): per 32 bytes, their low nibbles, then their high ones."""
    n = len(packed)
    q = np.empty((n, 4, 2, 32), np.uint8)
    packed = packed.reshape(n, 4, 32)
    np.bitwise_and(packed, 0x0F, out=q[:, :, 0])
    np.right_shift(packed, 4, out=q[:, :, 1])
    return q.reshape(n, 8, 32)


def _decode_k4(blocks: np.ndarray, q: np.ndarray, out: np.ndarray) -> None:
    """Q4_K/Q5_K: d * scale * q - dmin * min over 8 sub-blocks of 32 (get_scale_min_k4's 6-bit fields)."""
    n = len(blocks)
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    d, m, both = packed[:, 0], packed[:, 1], packed[:, 2]
    scale = np.concatenate([d & 0x3F, (both & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    least = np.concatenate([m & 0x3F, (both >> 4) | ((m >> 2) & 0x30)], axis=1)
    dl = (_half(blocks, 0) * scale).reshape(n, 8, 1)
    ml = (_half(blocks, 2) * least).reshape(n, 8, 1)
    values = out.reshape(n, 8, 32)
    np.multiply(dl, q, out=values)
    np.subtract(values, ml, out=values)


def _decode_q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    _decode_k4(blocks, _k_nibbles(blocks[:, 16:144]), out)


def _decode_q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    q = _k_nibbles(blocks[:, 48:176])
    q |= _bits(blocks[:, 16:48], 8) << np.uint8(4)
    _decode_k4(blocks, q, out)


def _decode_q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    n = len(blocks)
    d = (_half(blocks, 208) * blocks[:, 192:208].view(np.int8)).reshape(n, 16, 1)
    # Per 128 values: low nibbles of 64 bytes, then their high nibbles, each with 2 more bits from qh.
    low = (blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFT_2) & 3
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << np.uint8(4))).view(np.int8) - np.int8(32)
    np.multiply(d, q.reshape(n, 16, 16), out=out.reshape(n, 16, 16))


_DECODERS = {
    _T.F32: _decode_f32, _T.F16: _decode_f16, _T.BF16: _decode_bf16,
    _T.Q8_0: _decode_q8_0, _T.Q4_0: _decode_q4_0, _T.Q4_1: _decode_q4_1, _T.Q5_0: _decode_q5_0,
    _T.Q5_1: _decode_q5_1, _T.Q2_K: _decode_q2_k, _T.Q3_K: _decode_q3_k, _T.Q4_K: _decode_q4_k,
    _T.Q5_K: _decode_q5_k, _T.Q6_K: _decode_q6_k,
}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Blocks kept quantized: integers, a float32 scale per group and maybe a float32 offset per group, so
# that scale * q (+ offset) is, to the bit, what the decoders above compute (the same float32
# products, then the same sum: "- dmin * m" is "+ (-(dmin * m))"). torchgemma.quantization reads
# this layout: 8-bit values as int8; 4-bit values two per byte, within each 32 values byte j holding
# value j (low nibble) and value j + 16 (high nibble), which is Q4_0/Q4_1's own packing. Q5 values go
# in as 8-bit ones: the 5-bit layout (kernels.pack) reads 0.69 bytes per weight instead of 1.06 (with
# float16 scales), but its unpacking makes the one-thread AVX2 product slower than the 8-bit one (real 270M decode step, its Q5_0 layers in 5 bits:
# 32.8 ms, in 8 bits: 31.0 ms). Scales and offsets are stored as float16 where that holds every one
# exactly (the blocks' own fp16 fields, and -8 d unless it overflows), else as float32 (Q4_K/Q6_K's
# products d * scale).


@dataclass(frozen=True)
class GroupedInts:
    """A quantized (N, K) tensor: W = scales * q + mins, per group of ``group_size`` values of a row."""

    bits: int
    group_size: int
    qweight: torch.Tensor  # int8 (N, K) or uint8 (N, K / 2)
    scales: torch.Tensor  # float16 or float32 (N, K / group_size)
    mins: torch.Tensor | None  # as scales


def _pack4(q: np.ndarray) -> np.ndarray:
    """(n, 32) values 0..15 -> (n, 16) bytes: value j low, value j + 16 high."""
    return q[:, :16] | (q[:, 16:] << np.uint8(4))


def _ints_q8_0(b):
    return 8, 32, b[:, 2:].view(np.int8), _half(b, 0), None


def _ints_q5_0(b):
    q = _fifth_bits(b[:, 2:6], b[:, 6:]).view(np.int8) - np.int8(16)
    return 8, 32, q, _half(b, 0), None


def _ints_q5_1(b):
    return 8, 32, _fifth_bits(b[:, 4:8], b[:, 8:]).view(np.int8), _half(b, 0), _half(b, 2)


def _ints_q4_0(b):
    # (q - 8) * d = d * q + (-8 d) exactly: both products fit float32's 24 bits (11-bit d, 4-bit q).
    d = _half(b, 0)
    return 4, 32, b[:, 2:], d, d * np.float32(-8)


def _ints_q4_1(b):
    return 4, 32, b[:, 4:], _half(b, 0), _half(b, 2)


def _k4_scales(b) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: (n, 8) float32 scales d * scale and offsets -(dmin * min) (see _decode_k4)."""
    n = len(b)
    packed = b[:, 4:16].reshape(n, 3, 4)
    d, m, both = packed[:, 0], packed[:, 1], packed[:, 2]
    scale = np.concatenate([d & 0x3F, (both & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    least = np.concatenate([m & 0x3F, (both >> 4) | ((m >> 2) & 0x30)], axis=1)
    return _half(b, 0) * scale, -(_half(b, 2) * least)


def _ints_q4_k(b):
    scales, mins = _k4_scales(b)
    return 4, 32, _pack4(_k_nibbles(b[:, 16:144]).reshape(-1, 32)), scales, mins


def _ints_q5_k(b):
    q = _k_nibbles(b[:, 48:176])
    q |= _bits(b[:, 16:48], 8) << np.uint8(4)
    scales, mins = _k4_scales(b)
    return 8, 32, q.view(np.int8), scales, mins


def _ints_q6_k(b):
    n = len(b)
    scales = _half(b, 208) * b[:, 192:208].view(np.int8)
    low = (b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFT_2) & 3
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << np.uint8(4))).view(np.int8) - np.int8(32)
    return 8, 16, q, scales, None


_INTS = {
    _T.Q8_0: _ints_q8_0, _T.Q5_0: _ints_q5_0, _T.Q5_1: _ints_q5_1, _T.Q4_0: _ints_q4_0,
    _T.Q4_1: _ints_q4_1, _T.Q4_K: _ints_q4_k, _T.Q5_K: _ints_q5_k, _T.Q6_K: _ints_q6_k,
}  # fmt: skip
# The GGML types read as grouped integers, with (bits, group size, offsets?); the others (floats,
# Q2_K, Q3_K, the IQ types) are not.
INT_TYPES: dict[GGMLQuantizationType, tuple[int, int, bool]] = {
    _T.Q8_0: (8, 32, False), _T.Q5_0: (8, 32, False), _T.Q5_1: (8, 32, True), _T.Q4_0: (4, 32, True),
    _T.Q4_1: (4, 32, True), _T.Q4_K: (4, 32, True), _T.Q5_K: (8, 32, True), _T.Q6_K: (8, 16, False),
}  # fmt: skip


_SLAB_BYTES = 1 << 20  # file bytes converted at a time by grouped_ints


def grouped_ints(
    data: np.ndarray,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    release: Callable[[int, int], None] | None = None,
) -> GroupedInts:
    """A tensor's raw GGUF blocks as ``GroupedInts`` (``qtype`` in ``INT_TYPES``), its leading
    dimensions flattened into rows (stacked experts: (E, N, K) -> E * N rows).

    Converted ~1 MB of file bytes (``_SLAB_BYTES``) at a time into the result, ``release(begin, end)`` called on each
    byte range of ``data`` once read: a large tensor (a 262144-row token table) is then never in
    memory twice, as file pages and as integers."""
    if qtype not in _INTS or len(shape) < 2:
        raise GGUFError(f"{qtype.name} tensors of shape {list(shape)} are not read as grouped integers")
    rows, cols = math.prod(shape[:-1]), shape[-1]
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if cols % block or raw.size != rows * cols // block * type_size:
        raise GGUFError(f"{raw.size} bytes of {qtype.name} data do not hold a tensor of shape {list(shape)}")
    row_bytes = cols // block * type_size
    step = max(1, _SLAB_BYTES // row_bytes)
    q_all, parts, half = None, [], True  # parts: the scales (and mins), float16 while exact
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        blocks = raw[start * row_bytes : stop * row_bytes].reshape(-1, type_size)
        with np.errstate(invalid="ignore", over="ignore"):
            bits, group, q, *chunk = _INTS[qtype](blocks)
        chunk = [
            np.ascontiguousarray(v, np.float32).reshape(stop - start, -1) for v in chunk if v is not None
        ]
        if q_all is None:
            q_all = np.empty((rows, q.size // (stop - start)), q.dtype)
            parts = [np.empty((rows, v.shape[1]), np.float16) for v in chunk]
        q_all[start:stop] = q.reshape(stop - start, -1)
        if half and not all(_exact_in_half(v) for v in chunk):
            # Kept as float32 from here: the rows so far widen exactly (no float32 copy of a
            # tensor whose scales float16 holds, as the token table's: 21 MB freed again would
            # raise malloc's mmap threshold and grow the heap later).
            half = False
            parts = [
                np.concatenate(
                    (p[:start].astype(np.float32), np.empty((rows - start, p.shape[1]), np.float32))
                )
                for p in parts
            ]
        for part, v in zip(parts, chunk):
            part[start:stop] = v
        if release is not None:
            release(start * row_bytes, stop * row_bytes)
    scales, mins = [torch.from_numpy(v) for v in parts] + [None] * (2 - len(parts))
    return GroupedInts(bits, group, torch.from_numpy(q_all), scales, mins)


def _exact_in_half(values: np.ndarray) -> bool:
    """Whether float16 holds every one of the float32 ``values`` (bits compared: NaNs, -0 kept)."""
    back = values.astype(np.float16).astype(np.float32)
    return bool(np.array_equal(back.view(np.uint32), values.view(np.uint32)))


# --------------------------------------------------------------------------------------------------
# Tensor names: GGUF -> Hugging Face

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
class _Entry:
    """One Hugging Face tensor and the GGUF tensor(s) it is made from."""

    hf_name: str
    sources: tuple[str, ...]  # several: concatenated along dim 1 (split gate/up experts)
    shift_norm: bool = False  # Gemma 3 RMSNorm weights are stored as 1 + w
    part: int | None = None  # one matrix of a stacked source (Gemma 3n's AltUp projections)


# --------------------------------------------------------------------------------------------------
# The checkpoint


class GGUFCheckpoint:
    """A GGUF file read as a Hugging Face checkpoint: ``config`` and ``tensors()``.

    Made by ``read_gguf``. The file stays memory-mapped; tensors are dequantized one at a time when
    iterated. Attributes: ``config`` (a ``config.json`` dict for ``Gemma3ForCausalLM`` /
    ``Gemma4ForCausalLM``), ``metadata`` (every GGUF key/value), ``architecture`` (``"gemma3"`` /
    ``"gemma4"``), ``skipped`` (GGUF tensors not yielded, each with the reason).
    """

    def __init__(self, file: _GGUFFile):
        self.path = file.path
        self.metadata = file.metadata
        self.architecture: str = file.metadata["general.architecture"]
        self._file = file
        self._gguf = file.tensors
        _check_layers(file, self.architecture)  # before anything is built per layer
        for info in self._gguf.values():
            file.check(info)
        build = {"gemma3": _gemma3_config, "gemma3n": _gemma3n_config, "gemma4": _gemma4_config}[
            self.architecture
        ]
        self.config = build(file)
        self._entries, self.skipped = _plan(self.architecture, self.config, self._gguf, file.name)
        self._by_name = {e.hf_name: e for e in self._entries}
        self._check_types()
        self._check_shapes()

    # -- public API --------------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        """Hugging Face names of the tensors ``tensors()`` yields, in file order."""
        return [e.hf_name for e in self._entries]

    def shape(self, hf_name: str) -> tuple[int, ...]:
        """The Hugging Face shape of one tensor, without reading it."""
        entry = self._entry(hf_name)
        shape = _hf_shape([self._gguf[s] for s in entry.sources])
        return shape if entry.part is None else shape[1:]

    def gguf_types(self) -> dict[str, str]:
        """The GGML type each Hugging Face tensor is stored in (e.g. ``{"model.norm.weight": "F32"}``)."""
        return {e.hf_name: "+".join(self._gguf[s].type_name for s in e.sources) for e in self._entries}

    def tensor(self, hf_name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One tensor, dequantized, in Hugging Face layout and semantics, cast to ``dtype``."""
        return self._load(self._entry(hf_name), dtype)

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

    def grouped_ints(self, hf_name: str) -> GroupedInts:
        """One tensor as the file stores it, for the tensors ``int_format`` accepts."""
        if self.int_format(hf_name) is None:
            raise GGUFError(f"{self.path.name}: {hf_name} is not stored as grouped integers")
        info = self._gguf[self._entry(hf_name).sources[0]]
        ints = grouped_ints(
            self._file.raw(info), info.qtype, info.shape, lambda a, b: self._file.release(info, a, b)
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

    def _entry(self, hf_name: str) -> _Entry:
        try:
            return self._by_name[hf_name]
        except KeyError:
            raise KeyError(f"{self.path.name} has no tensor {hf_name!r}") from None

    def _load(self, entry: _Entry, dtype: torch.dtype) -> torch.Tensor:
        parts = [self._gguf[s] for s in entry.sources]
        if entry.shift_norm:
            # llama.cpp stores Gemma 3 norms as 1 + w (transformers computes x * (1 + w)): undo it in
            # float32, where the converter added it, before any cast.
            (info,) = parts
            tensor = (dequantize(self._file.raw(info), info.qtype, info.shape) - 1.0).to(dtype)
        elif entry.part is not None:
            # A stacked source: dequantized whole (in float32, then cast), one matrix kept, copied
            # out (a view would keep the whole stack alive in the parameter that adopts it).
            (info,) = parts
            tensor = dequantize(self._file.raw(info), info.qtype, info.shape)[entry.part].clone().to(dtype)
        else:
            values = [dequantize(self._file.raw(t), t.qtype, t.shape, dtype) for t in parts]
            tensor = values[0] if len(values) == 1 else torch.cat(values, dim=1)
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

    def _check_shapes(self) -> None:
        expected = _expected_shapes(self.config)
        problems = []
        names = set()
        for entry in self._entries:
            names.add(entry.hf_name)
            want = expected.get(entry.hf_name)
            if want is None:
                problems.append(f"unexpected tensor {entry.hf_name} (from {', '.join(entry.sources)})")
                continue
            got = self.shape(entry.hf_name)
            if got != want:
                problems.append(
                    f"{entry.hf_name} (from {entry.sources[0]}) has shape {list(got)}, config implies {list(want)}"
                )
        missing = [n for n in expected if n not in names and not n.endswith(_OPTIONAL)]
        problems += [f"missing tensor {n}" for n in missing]
        if problems:
            shown = "; ".join(problems[:8]) + (
                f"; ... ({len(problems)} problems)" if len(problems) > 8 else ""
            )
            raise GGUFError(f"{self.path.name} does not match the config read from its metadata: {shown}")


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open a Gemma 3, Gemma 3n or Gemma 4 GGUF file (memory-mapped) as a Hugging Face style checkpoint.

    Raises ``GGUFError`` (a ``ValueError``) naming the file and the problem for a file that is not a
    GGUF, is truncated, uses an unknown or unsupported quantization type, has an architecture other
    than gemma3/gemma3n/gemma4, or whose tensors disagree with its metadata.
    """
    file = _GGUFFile(Path(path))
    arch = file.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{file.name} has architecture {arch!r}; read_gguf supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return GGUFCheckpoint(file)


def _check_layers(file: _GGUFFile, arch: str) -> None:
    """The layer count must be what the tensor table holds: blk.0.* to blk.{n-1}.*, each present."""
    key = f"{arch}.block_count"
    if key not in file.metadata:
        raise GGUFError(f"{file.name} lacks the metadata key {key}")
    n_layers = file.metadata[key]
    found = sorted({int(m.group(1)) for name in file.tensors if (m := _BLOCK.fullmatch(name))})
    if found != list(range(n_layers)):
        held = f"blk.N tensors for {len(found)} layers ({_spans(found)})" if found else "no blk.N tensors"
        raise GGUFError(f"{file.name}: metadata key {key} is {n_layers}, but its tensor table has {held}")


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


# --------------------------------------------------------------------------------------------------
# Planning: which HF tensor comes from which GGUF tensor(s)


def _hf_shape(parts: list[_TensorInfo]) -> tuple[int, ...]:
    shapes = [t.shape for t in parts]
    if len(shapes) == 1:
        return shapes[0]
    first = shapes[0]
    return (first[0], sum(s[1] for s in shapes), *first[2:])


def _plan(
    arch: str, config: dict, gguf: Mapping[str, _TensorInfo], fname: str
) -> tuple[list[_Entry], list[str]]:
    layer_names = {"gemma4": _GEMMA4_LAYER_NAMES, "gemma3n": _GEMMA3N_LAYER_NAMES}.get(arch, _LAYER_NAMES)
    global_names = _GLOBAL_NAMES if arch == "gemma3" else _GEMMA4_GLOBAL_NAMES
    # Gemma 3's RMSNorm computes x * (1 + w) and llama.cpp stores 1 + w; Gemma 4's uses w directly
    # and its converter adds nothing (norm_shift 0).
    shift = arch == "gemma3"
    n_layers = config["num_hidden_layers"]
    first_shared = n_layers - config.get("num_kv_shared_layers", 0)

    entries: list[_Entry] = []
    skipped: list[str] = []
    unknown: list[str] = []
    for name in gguf:  # file order
        if name in _DERIVED:
            skipped.append(f"{name}: llama.cpp's RoPE frequency factors, read into rope_parameters")
            continue
        if name == "output.weight":
            entries.append(_Entry("lm_head.weight", (name,)))
            continue
        if name in _STACKED and arch == "gemma3n":
            for part in range(gguf[name].shape[0]):
                entries.append(_Entry(f"model.{_STACKED[name]}.{part}.weight", (name,), part=part))
            continue
        if name in global_names:
            hf = global_names[name]
            entries.append(_Entry(f"model.{hf}", (name,), shift and hf.endswith("norm.weight")))
            continue
        match = _BLOCK.fullmatch(name)
        if match is None:
            unknown.append(name)
            continue
        layer, suffix = int(match.group(1)), match.group(2)
        if layer >= n_layers:
            unknown.append(name)
            continue
        if suffix in _SPLIT_EXPERTS and arch == "gemma4":
            if suffix == _SPLIT_EXPERTS[0]:
                up = f"blk.{layer}.{_SPLIT_EXPERTS[1]}"
                if up not in gguf:
                    raise GGUFError(f"{fname}: {name} has no matching {up}")
                entries.append(_Entry(f"model.layers.{layer}.experts.gate_up_proj", (name, up)))
            elif f"blk.{layer}.{_SPLIT_EXPERTS[0]}" not in gguf:
                raise GGUFError(f"{fname}: {name} has no matching blk.{layer}.{_SPLIT_EXPERTS[0]}")
            continue
        hf = layer_names.get(suffix)
        if hf is None:
            unknown.append(name)
            continue
        if layer >= first_shared and hf.startswith(
            ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.")
        ):
            # KV-shared layers read another layer's K/V; HF builds no k/v weights for them.
            skipped.append(f"{name}: layer {layer} reuses K/V of an earlier layer")
            continue
        entries.append(_Entry(f"model.layers.{layer}.{hf}", (name,), shift and hf.endswith("norm.weight")))
    if unknown:
        raise GGUFError(
            f"{fname}: {len(unknown)} tensor(s) with no known Hugging Face {arch} name, e.g. {', '.join(unknown[:5])}"
        )
    return entries, skipped


# --------------------------------------------------------------------------------------------------
# Config


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

    # KV heads: a scalar when both layer types agree, else one count per layer (sliding: HF
    # num_key_value_heads, full: num_global_key_value_heads).
    kv = meta.get("attention.head_count_kv", heads)
    if isinstance(kv, list):
        sliding_kv = {k for k, s in zip(kv, swa) if s}
        full_kv = {k for k, s in zip(kv, swa) if not s}
        if len(sliding_kv) > 1 or len(full_kv) > 1:
            raise GGUFError(f"{fname}: head_count_kv {kv} is not one value per layer type")
        num_kv = sliding_kv.pop() if sliding_kv else full_kv.copy().pop()
        global_kv = full_kv.pop() if full_kv else None
    else:
        num_kv, global_kv = kv, None

    # K = V: full-attention layers that compute their own K/V but carry no attn_v.
    owners = [i for i in range(n_layers) if not swa[i] and i < first_shared]
    k_eq_v = bool(owners) and all(f"blk.{i}.attn_v.weight" not in gguf for i in owners)
    if global_kv is not None and global_kv != num_kv and not k_eq_v:
        raise GGUFError(
            f"{fname}: full-attention layers have {global_kv} KV heads and sliding ones {num_kv}, which HF "
            f"Gemma 4 expresses only for K=V models, but the full layers have attn_v tensors"
        )

    # Dense MLP width: one value, or per layer when KV-shared layers are double width (E2B).
    ff = meta.need("feed_forward_length")
    double_wide = False
    if isinstance(ff, list):
        base = ff[0]
        if ff == [base] * n_layers:
            pass
        elif ff == [base if i < first_shared else 2 * base for i in range(n_layers)]:
            double_wide = True
        else:
            raise GGUFError(
                f"{fname}: feed_forward_length {ff} is neither uniform nor double width on KV-shared layers"
            )
        ff = base

    # Proportional RoPE on full layers: llama.cpp rotates the first n dims and marks the rest with
    # frequency factors of 1e30 in rope_freqs (one per rotated pair), so partial_rotary_factor is
    # 2 * (pairs with factor 1) / head dim.
    partial = 0.25
    if "rope_freqs.weight" in gguf:
        info = gguf["rope_freqs.weight"]
        factors = dequantize(file.raw(info), info.qtype, info.shape).numpy()
        partial = 2 * int(np.count_nonzero(factors < 1e20)) / global_head_dim

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
        rope_parameters={
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": meta.get("rope.freq_base_swa", 10000.0),
            },
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": partial,
                "rope_theta": meta.get("rope.freq_base", 1000000.0),
            },
        },
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
    from ..model.layers import normal_quantile

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


# --------------------------------------------------------------------------------------------------
# Expected shapes (the strict check between metadata and tensors)

# Tensors a file may lack without being wrong.
_OPTIONAL = ("lm_head.weight",)


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    H, V, L = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    nh, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = (V, H)
    gemma4 = config["model_type"] == "gemma4_text"
    gemma3n = config["model_type"] == "gemma3n_text"
    P = config.get("hidden_size_per_layer_input", 0) if gemma4 or gemma3n else 0
    if P:
        out["model.embed_tokens_per_layer.weight"] = (config["vocab_size_per_layer_input"], L * P)
        out["model.per_layer_model_projection.weight"] = (L * P, H)
        out["model.per_layer_projection_norm.weight"] = (P,)
    if gemma3n:
        for part in range(config["altup_num_inputs"] - 1):
            out[f"model.altup_projections.{part}.weight"] = (H, H)
            out[f"model.altup_unembed_projections.{part}.weight"] = (H, H)
    first_shared = L - config.get("num_kv_shared_layers", 0)
    for i, kind in enumerate(config["layer_types"]):
        full = kind == "full_attention"
        d, kv = config["head_dim"], n_kv
        if gemma4 and full:
            d = config["global_head_dim"]
            if config["attention_k_eq_v"] and config["num_global_key_value_heads"] is not None:
                kv = config["num_global_key_value_heads"]
        inter = config["intermediate_size"][i] if gemma3n else config["intermediate_size"]
        if gemma4 and config["use_double_wide_mlp"] and i >= first_shared:
            inter *= 2
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": (nh * d, H),
            p + "self_attn.o_proj.weight": (H, nh * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, H),
            p + "mlp.up_proj.weight": (inter, H),
            p + "mlp.down_proj.weight": (H, inter),
        })  # fmt: skip
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            out[p + norm + ".weight"] = (H,)
        if i < first_shared:
            out[p + "self_attn.k_proj.weight"] = (kv * d, H)
            out[p + "self_attn.k_norm.weight"] = (d,)
            if not (gemma4 and full and config["attention_k_eq_v"]):
                out[p + "self_attn.v_proj.weight"] = (kv * d, H)
        if gemma3n:
            N, R = config["altup_num_inputs"], config["laurel_rank"]
            out.update({
                p + "per_layer_input_gate.weight": (P, H),
                p + "per_layer_projection.weight": (H, P),
                p + "post_per_layer_input_norm.weight": (H,),
                p + "altup.correction_coefs.weight": (N, N),
                p + "altup.correct_output_scale": (H,),
                p + "altup.prediction_coefs.weight": (N * N, N),
                p + "altup.modality_router.weight": (N, H),
                p + "altup.router_norm.weight": (H,),
                p + "laurel.linear_left.weight": (R, H),
                p + "laurel.linear_right.weight": (H, R),
                p + "laurel.post_laurel_norm.weight": (H,),
            })  # fmt: skip
        if not gemma4:
            continue
        out[p + "layer_scalar"] = (1,)
        if P:
            out[p + "per_layer_input_gate.weight"] = (P, H)
            out[p + "per_layer_projection.weight"] = (H, P)
            out[p + "post_per_layer_input_norm.weight"] = (H,)
        if config["enable_moe_block"]:
            E, Im = config["num_experts"], config["moe_intermediate_size"]
            out.update({
                p + "router.proj.weight": (E, H),
                p + "router.scale": (H,),
                p + "router.per_expert_scale": (E,),
                p + "experts.gate_up_proj": (E, 2 * Im, H),
                p + "experts.down_proj": (E, H, Im),
                p + "pre_feedforward_layernorm_2.weight": (H,),
                p + "post_feedforward_layernorm_1.weight": (H,),
                p + "post_feedforward_layernorm_2.weight": (H,),
            })  # fmt: skip
    return out

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

    reader.py       the file: header, metadata value types, tensor table, bounds checks, raw data
    blocks.py       GGML block types -> float tensors (dequantize) or grouped integers (grouped_ints)
    names.py        GGUF tensor names -> Hugging Face names, per architecture
    metadata.py     GGUF metadata -> a Hugging Face config.json dict
    checkpoint.py   read_gguf / GGUFCheckpoint: what the loader calls
    mmproj.py       a model GGUF with llama.cpp's mmproj file of its towers, as one checkpoint
    mmproj_names.py mmproj tensor names -> Hugging Face names, one table per projector type

Facts about llama.cpp's conventions come from its converter (``Gemma3Model`` / ``Gemma4Model`` in
convert_hf_to_gguf), its loader (``llama_model::load_hparams``), the ``gguf`` package's tables and
transformers' GGUF integration; each use is commented where it is made.
"""

from .blocks import INT_TYPES, SUPPORTED_TYPES, GroupedInts, dequantize, grouped_ints
from .checkpoint import GGUFCheckpoint, read_gguf
from .metadata import _gemma3_config, _gemma4_config, _sparsity
from .mmproj import MmprojFile, MultimodalGGUF, read_gguf_with_mmproj
from .names import SUPPORTED_ARCHITECTURES
from .reader import GGUFError, _GGUFFile, check_metadata_types, read_gguf_metadata

__all__ = [
    "GGUFCheckpoint",
    "GGUFError",
    "GroupedInts",
    "INT_TYPES",
    "MmprojFile",
    "MultimodalGGUF",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TYPES",
    "check_metadata_types",
    "dequantize",
    "grouped_ints",
    "read_gguf",
    "read_gguf_metadata",
    "read_gguf_with_mmproj",
    # internals tests call directly
    "_GGUFFile",
    "_gemma3_config",
    "_gemma4_config",
    "_sparsity",
]

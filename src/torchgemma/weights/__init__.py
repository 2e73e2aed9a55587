"""Checkpoints in, model tensors out.

    source.py        what a user names (folder, .gguf file, hub id, named model) -> a local path
    safetensors.py   a folder's safetensors files, memory-mapped
    gguf.py          GGUF files: metadata, tensors dequantized, llama.cpp names -> Hugging Face names
    loading.py       ``load``: build the model, sanitize names, copy strictly
    assistant.py     ``load_assistant``: an MTP drafter (gemma4_assistant), as strictly

Only ``source`` is imported here: the tokenizer resolves checkpoints without loading a model.
"""

from .source import SHORTCUTS, CheckpointError, resolve_source

__all__ = ["SHORTCUTS", "CheckpointError", "resolve_source"]

"""``torchgemma.save``: a model (quantized or not) -> a checkpoint folder that ``load`` reads back.

The folder is a Hugging Face style checkpoint: ``config.json`` (the config the model was built from,
with torchgemma's ``quantization_config`` when it is quantized) and ``model.safetensors`` under the
checkpoint's own tensor names. A quantized layer is saved as its buffers, beside where its weight
would be (``...q_proj.qweight``, ``.scales``, ``.mins``), so no float copy is ever made and the
loaded model is the saved one to the bit. Safetensors only: nothing is pickled.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .source import resolve_source

# What a checkpoint folder holds besides its weights and config: copied by ``copy_from``.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
)


def save(model: torch.nn.Module, folder: str | Path, *, copy_from: str | Path | None = None) -> Path:
    """Write ``model`` to ``folder`` (created if needed) as ``config.json`` + ``model.safetensors``.

    ``copy_from``: a checkpoint (folder, hub id or named model) whose tokenizer, chat template and
    generation config files are copied beside the weights, so that ``LLM(folder)`` finds them.
    Returns the folder.
    """
    config = model.config
    if config.source is None:
        raise ValueError("this model's config was not read from a config.json: it cannot be saved")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = dict(config.source)
    data["dtype"] = str(model.dtype).removeprefix("torch.")
    data.pop("torch_dtype", None)
    quantization = getattr(model, "quantization", None)
    if quantization:
        data["quantization_config"] = {"quant_method": "torchgemma", **quantization}
    else:
        data.pop("quantization_config", None)
    tensors = {}
    for path, tensor in model.state_dict().items():
        if config.text.tie_word_embeddings and path == "language_model.lm_head.weight":
            continue
        tensors[config.checkpoint_name(path)] = tensor.detach().contiguous().cpu()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    if copy_from is not None:
        source = resolve_source(copy_from)
        if source.is_dir():
            for name in SIDE_FILES:
                if (source / name).is_file():
                    shutil.copyfile(source / name, folder / name)
    return folder

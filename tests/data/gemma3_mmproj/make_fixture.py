"""Regenerate tests/data/gemma3_mmproj/: a tiny Gemma 3 vision tower and llama.cpp's mmproj GGUF of it.

tests/test_gemma3_mmproj.py reads ``mmproj.gguf`` with torchgemma (weights/gguf/gemma3_mmproj.py)
and compares its config with ``config.json``'s and its tensors with ``vision.safetensors``'s (the
checkpoint's vision tower and projector, as transformers 5.23 names them). CI has no llama.cpp, so
the converted file is committed; this script documents how it was made and makes it again.

The checkpoint is tests/gemma3_checkpoints.py's ``gemma3_vision_checkpoint`` (seed 7), its values
rounded to float16 ones (kept float32), so that the converter's float16 copy of the projection
matrix and its ``1 + w`` copy of the projector's norm hold the checkpoint's values exactly. The
converter reads the published (transformers 4.5x) names, ``vision_tower.vision_model.*``, and the
preprocessor config's ``image_seq_length`` (9 soft tokens per image here).

The converter is the one llama-cpp-python 0.3.36's sdist vendors (its ``gguf-py`` on PYTHONPATH).
From the repository root::

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llsrc
    tar -xzf /tmp/llsrc/llama_cpp_python-0.3.36.tar.gz -C /tmp/llsrc
    PYTHONPATH=src:tests python tests/data/gemma3_mmproj/make_fixture.py \\
        /tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp

which runs, on a temporary checkpoint folder DIR::

    PYTHONPATH=LLAMA_CPP/gguf-py python LLAMA_CPP/convert_hf_to_gguf.py DIR --outtype f32 --mmproj --outfile mmproj.gguf
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TOWER = ("vision_tower.", "multi_modal_projector.")


def main(llama_cpp: Path) -> None:
    from safetensors.torch import load_file, save_file

    from gemma3_checkpoints import gemma3_vision_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        folder = gemma3_vision_checkpoint(Path(tmp) / "ckpt", seed=7)
        tensors = {k: v.half().float() for k, v in load_file(folder / "model.safetensors").items()}
        published = {
            k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()
        }
        save_file(published, folder / "model.safetensors", metadata={"format": "pt"})
        preprocessor = {
            "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": 9,
            "size": {"height": 42, "width": 42}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        }  # fmt: skip
        (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
        env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
        command = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder)]
        command += ["--outtype", "f32", "--mmproj", "--outfile", str(HERE / "mmproj.gguf")]
        subprocess.run(command, check=True, env=env)
        shutil.copy(folder / "config.json", HERE / "config.json")
        tower = {k: v for k, v in tensors.items() if k.startswith(TOWER)}
        save_file(tower, HERE / "vision.safetensors", metadata={"format": "pt"})


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} LLAMA_CPP_SOURCE_DIR")
    torch.set_grad_enabled(False)
    main(Path(sys.argv[1]))

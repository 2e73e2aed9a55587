"""Regenerate tests/data/mmproj/: two tiny Gemma 4 checkpoints and llama.cpp's own GGUF conversion of each.

The files under tests/data/mmproj/ are what this script writes; tests/test_gguf_mmproj.py loads the
GGUFs (model + mmproj) with torchgemma and compares the logits with transformers on the checkpoint.
CI has no llama.cpp, so the converted files are committed; this script documents how they were made
and makes them again.

* ``e2b/``: E2B-like (PLE, KV sharing, double-wide MLP) with the on-device vision tower and the
  audio conformer, clip bounds that clamp.
* ``31b/``: 31B-like (K=V full layers, bidirectional image blocks) with the large-style vision
  tower (standardised soft tokens, no clipping), no audio.
* ``gemma3/``: a Gemma 3 4B-like ``Gemma3ForConditionalGeneration`` (tests/gemma3_checkpoints.py's
  tiny SigLIP: 42 px images, 7 px patches pooled into 9 soft tokens), projector type ``gemma3``.
  Gemma 3's text conversion (``Gemma3Model``) takes a SentencePiece ``tokenizer.model`` (its other
  path, a tokenizer.json, must be one llama.cpp knows by hash), so a tiny one is trained here with
  the ``sentencepiece`` package (``pip install sentencepiece==0.2.3``; only for this script): the
  media tokens are its user-defined pieces 4-6. The converter asserts ``attn_logit_softcapping`` is
  unset and writes neither ``query_pre_attn_scalar`` (llama.cpp uses the head size) nor the layer
  pattern (every sixth layer full), so the checkpoint keeps to those.
* ``12b/``: 12B-Unified-like (``gemma4_unified``): the encoder-free image and audio embedders. Its
  config.json carries ``"moe_intermediate_size": null`` in ``text_config``: transformers'
  Gemma4UnifiedTextConfig has no such field and does not write it, and the converter's
  ``Gemma4Model.set_gguf_parameters`` fails without it (KeyError).

Each folder holds ``config.json`` and ``model.safetensors`` (the transformers checkpoint the tests
compare against), ``model.gguf`` (``convert_hf_to_gguf.py``) and ``mmproj.gguf``
(``convert_hf_to_gguf.py --mmproj``). The weights are random (seeded) and rounded to float16 values,
and the matrices are saved as float16, so that the ``--outtype f16`` conversion stores exactly the
checkpoint's values (vectors stay float32 in both: the converter writes them as F32) and the logits
can be compared to rounding. The tokenizer is the tests' fixture tokenizer
(tests/tokenizer_fixtures.py), which the text conversion reads and then stores in model.gguf.

The converter is the one llama-cpp-python 0.3.36's sdist vendors (its ``gguf-py`` on PYTHONPATH, as
the converter needs the ``gguf`` package of its own tree). The exact commands, from the repository
root::

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llsrc
    tar -xzf /tmp/llsrc/llama_cpp_python-0.3.36.tar.gz -C /tmp/llsrc
    PYTHONPATH=src:tests python tests/data/make_mmproj_fixture.py \\
        /tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp

which for each checkpoint folder DIR runs::

    PYTHONPATH=LLAMA_CPP/gguf-py python LLAMA_CPP/convert_hf_to_gguf.py DIR --outtype f16 --outfile DIR/model.gguf
    PYTHONPATH=LLAMA_CPP/gguf-py python LLAMA_CPP/convert_hf_to_gguf.py DIR --outtype f16 --mmproj --outfile DIR/mmproj.gguf
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
OUT = HERE / "mmproj"
SLIDING, FULL = "sliding_attention", "full_attention"

TEXT = dict(
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=5,
    final_logit_softcapping=30.0,
    max_position_embeddings=4096,
    pad_token_id=0,
    bos_token_id=2,
)
E2B_TEXT = dict(
    num_hidden_layers=5,
    layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL],
    num_key_value_heads=1,
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=4,
    use_double_wide_mlp=True,
)
# Another text width than E2B's, so that each mmproj is refused beside the other's model.
LARGE_TEXT = dict(
    hidden_size=24,
    num_hidden_layers=4,
    layer_types=[SLIDING, SLIDING, SLIDING, FULL],
    num_key_value_heads=2,
    attention_k_eq_v=True,
    num_global_key_value_heads=1,
    hidden_size_per_layer_input=0,
    use_bidirectional_attention="vision",
)
# 12B Unified: K=V full layers; its config class has no MoE fields, and the converter (Gemma4Model)
# asks for moe_intermediate_size: written as null into config.json for it (see build).
UNIFIED_TEXT = dict(
    num_hidden_layers=3,
    layer_types=[SLIDING, SLIDING, FULL],
    num_key_value_heads=2,
    attention_k_eq_v=True,
    num_global_key_value_heads=1,
)
# llama.cpp merges 3 x 3 patches (clip.cpp): 2 px patches, 6 px merged, 108 values each.
UNIFIED_VISION = dict(
    patch_size=2, pooling_kernel_size=3, mm_embed_dim=40, mm_posemb_size=16, output_proj_dims=40
)
UNIFIED_AUDIO = dict(audio_embed_dim=24)
# llama.cpp states no pooling size for gemma4v (clip.cpp: n_merge = 3 unless the file says
# otherwise) and no vision RoPE base (100): the towers keep those. 16 px patches pooled 3 x 3 and 128
# mel bins are what our processors produce.
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=8,
    patch_size=16,
    pooling_kernel_size=3,
    position_embedding_size=64,
)
AUDIO = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    subsampling_conv_channels=[128, 8],  # transformers sizes its input projection as if the first were 128
    conv_kernel_size=5,
    output_proj_dims=24,
    use_clipped_linears=True,
)


def unified_model(text: dict):
    from transformers import (
        Gemma4UnifiedAudioConfig,
        Gemma4UnifiedConfig,
        Gemma4UnifiedForConditionalGeneration,
        Gemma4UnifiedTextConfig,
        Gemma4UnifiedVisionConfig,
    )

    from llm_fixtures import media_token_ids

    config = Gemma4UnifiedConfig(
        text_config=Gemma4UnifiedTextConfig(**text, **UNIFIED_TEXT).to_dict(),
        vision_config=Gemma4UnifiedVisionConfig(**UNIFIED_VISION).to_dict(),
        audio_config=Gemma4UnifiedAudioConfig(**UNIFIED_AUDIO).to_dict(),
        **media_token_ids(),
    )
    return Gemma4UnifiedForConditionalGeneration(config)


def gemma4_model(text: dict, large: bool):
    from transformers import (
        Gemma4AudioConfig,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4TextConfig,
        Gemma4VisionConfig,
    )

    from llm_fixtures import media_token_ids

    text = {**text, **(LARGE_TEXT if large else E2B_TEXT)}
    if not large:
        text["vocab_size_per_layer_input"] = text["vocab_size"]
    vision = {**VISION, "use_clipped_linears": not large, "standardize": large}
    config = Gemma4Config(
        text_config=Gemma4TextConfig(**text).to_dict(),
        vision_config=Gemma4VisionConfig(**vision).to_dict(),
        audio_config=None if large else Gemma4AudioConfig(**AUDIO).to_dict(),
        **media_token_ids(),
    )
    return Gemma4ForConditionalGeneration(config)


GEMMA3_MEDIA = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def gemma3_tokenizer(folder: Path) -> dict[str, int]:
    """A tiny SentencePiece model (Gemma's special ids: pad 0, eos 1, bos 2, unk 3) with the media
    tokens as user-defined pieces; returns Gemma3Config's media id fields."""
    import io

    import sentencepiece as spm

    text = ["The quick brown fox jumps over the lazy dog.", "An image of a cat on a mat.", "Hello world!"]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text * 20),
        model_writer=model,
        vocab_size=80,
        model_type="bpe",
        hard_vocab_limit=False,
        user_defined_symbols=list(GEMMA3_MEDIA),
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    ids = [processor.piece_to_id(token) for token in GEMMA3_MEDIA]
    # Special, as Gemma 3's tokenizer_config.json marks them: the converter then types them CONTROL.
    added = {str(i): {"content": t, "special": True} for i, t in zip(ids, GEMMA3_MEDIA)}
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}, indent=2))
    return dict(zip(("boi_token_index", "eoi_token_index", "image_token_index"), ids))


def build_gemma3(folder: Path, seed: int) -> None:
    """Gemma 3 with its SigLIP tower, float16 values, the tokenizer above, and the preprocessor
    config the mmproj conversion reads (its image_seq_length gives the pooling: 6 -> 3 per side)."""
    from safetensors.torch import load_file, save_file

    from gemma3_checkpoints import TOKENS_PER_IMAGE, gemma3_vision_checkpoint

    folder.mkdir(parents=True)
    media = gemma3_tokenizer(folder)
    # Gemma 3's GGUF keeps no layer pattern (llama.cpp: every sixth layer full), no attention cap and
    # no query_pre_attn_scalar (the head size): the checkpoint keeps to those.
    # Narrower than the tests' Gemma 3 (64 wide, 7 layers), to keep the files small.
    gemma3_vision_checkpoint(
        folder,
        seed,
        media_ids=media,
        attn_logit_softcapping=None,
        query_pre_attn_scalar=16,
        layer_types=[SLIDING] * 5 + [FULL],
        num_hidden_layers=6,
        hidden_size=32,
        intermediate_size=48,
    )
    weights = load_file(folder / "model.safetensors")
    weights = {k: v.half() if v.dim() >= 2 else v.half().float() for k, v in weights.items()}
    # The mmproj conversion reads the published (transformers 4.5x) tower names, vision_model inside.
    weights = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in weights.items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    preprocessor = {
        "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": TOKENS_PER_IMAGE,
        "size": {"height": 42, "width": 42}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
    }  # fmt: skip
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))


def build(folder: Path, kind: str, seed: int) -> None:
    """The checkpoint (float16 matrices, float32 vectors) with the fixture tokenizer beside it."""
    from safetensors.torch import load_file, save_file

    from checkpoints import randomize_, tighten_clip_bounds_
    from llm_fixtures import processor_config
    from tokenizer_fixtures import VOCAB_SIZE, write_gemma4_tokenizer

    text = {**TEXT, "vocab_size": VOCAB_SIZE, "eos_token_id": [1, 106]}
    torch.manual_seed(seed)
    model = unified_model(text) if kind == "12b" else gemma4_model(text, large=kind == "31b")
    randomize_(model, seed)
    if kind == "e2b":
        tighten_clip_bounds_(model, seed)
    with torch.no_grad():  # float16 values: the converter's f16 then stores them exactly
        for tensor in model.state_dict().values():
            tensor.copy_(tensor.to(torch.float16))
    model.save_pretrained(folder)  # transformers' own names and layout
    if kind == "12b":
        config = json.loads((folder / "config.json").read_text())
        config["text_config"]["moe_intermediate_size"] = None
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    # Matrices stored as float16 (half the bytes), vectors as float32 (as the converter writes them).
    weights = load_file(folder / "model.safetensors")
    weights = {k: v.half() if v.dim() >= 2 else v for k, v in weights.items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    write_gemma4_tokenizer(folder)
    # The mmproj conversion reads the image processor's mean and std from it.
    (folder / "processor_config.json").write_text(json.dumps(processor_config(), default=str))


def convert(llama_cpp: Path, folder: Path, mmproj: bool) -> Path:
    target = folder / ("mmproj.gguf" if mmproj else "model.gguf")
    command = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f16"]
    command += ["--mmproj"] * mmproj + ["--outfile", str(target)]
    # Its own gguf-py first (then the caller's path: sentencepiece, wherever it is installed).
    path = os.pathsep.join([str(llama_cpp / "gguf-py"), os.environ.get("PYTHONPATH", "")])
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": path}, stdout=subprocess.DEVNULL)
    return target


def main(llama_cpp: Path, only: list[str]) -> None:
    """Every folder, or those named in ``only`` (the others are left as they are)."""
    OUT.mkdir(exist_ok=True)
    for name, seed in (("e2b", 41), ("31b", 42), ("12b", 43), ("gemma3", 44)):
        with tempfile.TemporaryDirectory() as tmp:
            if only and name not in only:
                continue
            work = Path(tmp) / name
            build_gemma3(work, seed) if name == "gemma3" else build(work, name, seed)
            target = OUT / name
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            for produced in (convert(llama_cpp, work, False), convert(llama_cpp, work, True)):
                shutil.copy(produced, target / produced.name)
            for kept in ("config.json", "model.safetensors"):
                shutil.copy(work / kept, target / kept)
    sizes = {str(p.relative_to(OUT)): p.stat().st_size for p in sorted(OUT.rglob("*")) if p.is_file()}
    print(json.dumps(sizes, indent=1), f"total {sum(sizes.values()):,} bytes")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(
            f"usage: {sys.argv[0]} LLAMA_CPP_SOURCE_DIR [FOLDER ...] (the llama.cpp tree with "
            "convert_hf_to_gguf.py; the fixture folders to make, by default all)"
        )
    main(Path(sys.argv[1]), sys.argv[2:])

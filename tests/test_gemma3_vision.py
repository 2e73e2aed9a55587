"""Gemma 3 with images (``gemma3``: SigLIP tower, projector, image blocks) against transformers 5.23.

Model: tiny random ``Gemma3ForConditionalGeneration`` checkpoints (tests/gemma3_checkpoints.py),
logits and greedy tokens with eager and sdpa attention, float32 to 1e-5 and bfloat16 to the bit.
Processor: ``Gemma3ImageProcessorPil`` (transformers' PIL backend: no torchvision) and
``Gemma3Processor`` over the published-layout gemma-3-4b-it folder (tests/published_files.py),
with and without pan-and-scan.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import torchgemma
from checkpoints import assert_match
from gemma3_checkpoints import GEMMA3_MEDIA_IDS, TOKENS_PER_IMAGE, gemma3_vision_checkpoint
from torchgemma.processing.gemma3_image import Gemma3ImageSettings, process_images_gemma3

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

DTYPES = [torch.float32, torch.bfloat16]
BOI, EOI, IMAGE = (GEMMA3_MEDIA_IDS[k] for k in ("boi_token_index", "eoi_token_index", "image_token_index"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return gemma3_vision_checkpoint(tmp_path_factory.mktemp("gemma3-vision") / "ckpt", seed=5)


def reference(folder, dtype, attention="eager"):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(
        folder, dtype=dtype, attn_implementation=attention
    ).eval()


def image_run() -> list[int]:
    return [BOI] + [IMAGE] * TOKENS_PER_IMAGE + [EOI]


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows with three images between them; the second left-padded by 4."""
    first = [2, 10, 11, *image_run(), 12, 13, 14, *image_run(), 15, 16]
    second = [0] * 4 + [2, 20, *image_run(), *range(21, 21 + len(first) - 4 - 2 - 11)]
    ids = torch.tensor([first, second])
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask, torch.randn(3, 3, 42, 42, generator=torch.Generator().manual_seed(3))


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "attention, dtype",
    [
        ("eager", torch.float32),
        pytest.param("eager", torch.bfloat16, marks=SLOW),
        pytest.param("sdpa", torch.float32, marks=SLOW),
        ("sdpa", torch.bfloat16),
    ],
    ids=str,
)
def test_logits_with_images_equal_transformers(checkpoint, attention, dtype):
    ids, mask, pixels = batch()
    types = (ids == IMAGE).long()
    ref = reference(checkpoint, dtype, attention)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        expected = ref(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            pixel_values=pixels.to(dtype),
            token_type_ids=types,
        ).logits
        model = torchgemma.load(checkpoint, dtype=dtype, attention=attention, progress=False)
        got = model(ids, mask, pixel_values=pixels.to(dtype), mm_token_type_ids=types)
    assert_match(got, expected, dtype)
    # The image blocks matter here (9 image tokens, a window of 5): without them the logits move.
    if dtype == torch.float32:
        with torch.no_grad():
            causal = model(ids, mask, pixel_values=pixels)
        assert (causal - expected).abs().max() > 1e-2


@SLOW
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_with_images_equals_transformers(checkpoint, dtype):
    ids, _, pixels = batch()
    ids, pixels = ids[:1], pixels[:2]
    types = (ids == IMAGE).long()
    ref = reference(checkpoint, dtype)
    with torch.no_grad():
        expected = ref.generate(
            input_ids=ids,
            pixel_values=pixels.to(dtype),
            token_type_ids=types,
            max_new_tokens=10,
            do_sample=False,
        )[0, ids.shape[1] :]
    model = torchgemma.load(checkpoint, dtype=dtype, attention="eager", progress=False)
    media = torchgemma.MediaInputs(pixel_values=pixels.to(dtype), mm_token_type_ids=types)
    got = torchgemma.generate(model, ids, media=media, max_new_tokens=10)
    assert got[0].tolist()[-10:] == expected.tolist()
    assert len(set(expected.tolist())) > 1


@SLOW
def test_loading_is_strict_and_reads_older_names(checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(checkpoint / "model.safetensors")
    # transformers 4.5x (the published files) nested the tower's parts under vision_model.
    older = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()}
    folder = tmp_path / "older"
    shutil.copytree(checkpoint, folder)
    save_file(older, folder / "model.safetensors", metadata={"format": "pt"})
    ids, mask, pixels = batch()
    with torch.no_grad():
        ours = torchgemma.load(folder, progress=False)(ids, mask, pixel_values=pixels)
        theirs = torchgemma.load(checkpoint, progress=False)(ids, mask, pixel_values=pixels)
    assert torch.equal(ours, theirs)
    missing = {k: v for k, v in tensors.items() if "post_layernorm.bias" not in k}
    save_file(missing, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match="post_layernorm.bias"):
        torchgemma.load(folder, progress=False)


def test_info_counts_the_tower(checkpoint):
    from torchgemma.info import describe

    described = describe(torchgemma.ModelConfig.from_file(checkpoint))
    assert described["towers_not_built"] == []
    from transformers import Gemma3ForConditionalGeneration

    ref = Gemma3ForConditionalGeneration.from_pretrained(checkpoint)
    inner = ref.model
    vision = sum(p.numel() for p in inner.vision_tower.parameters())
    vision += sum(p.numel() for p in inner.multi_modal_projector.parameters())
    assert described["params_by_tower"]["vision"] == vision


# ── the image processor ─────────────────────────────────────────────────────────────────────────


def noise(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)


IMAGES = {
    "square": noise(60, 60),
    "wide": noise(40, 130, seed=1),  # ratio 3.25: 3 crops
    "tall": noise(150, 50, seed=2),
    "slightly wide": noise(50, 59, seed=3),  # ratio 1.18: no crops
    "rgba": noise(33, 90, 4, seed=4),
    "gray": noise(70, 20, 1, seed=5)[..., 0],
}
PAN_AND_SCAN = dict(
    do_pan_and_scan=True,
    pan_and_scan_min_crop_size=16,
    pan_and_scan_max_num_crops=4,
    pan_and_scan_min_ratio_to_activate=1.2,
)


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_image_processor_equals_transformers(pan_and_scan):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    options = PAN_AND_SCAN if pan_and_scan else {}
    settings = dict(size={"height": 56, "width": 56}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    reference = Gemma3ImageProcessorPil(**settings, **options)
    images = [IMAGES[name] for name in IMAGES if name not in ("rgba", "gray")]
    images += [Image.fromarray(IMAGES["rgba"], "RGBA"), Image.fromarray(IMAGES["gray"], "L")]
    expected = reference(images, return_tensors="pt")
    got = process_images_gemma3(images, Gemma3ImageSettings(size=56, **options))
    assert torch.equal(got["pixel_values"], expected["pixel_values"])
    assert got["num_crops"] == expected["num_crops"].tolist()
    assert sum(got["num_crops"]) > 0 if pan_and_scan else not any(got["num_crops"])


# ── the processor: prompts, LLM.chat ────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def chat_folder(published_checkpoint, tmp_path_factory):
    """The published-layout gemma-3-4b-it folder with token embeddings x 0.05: with large tied
    embeddings every token predicts itself, whatever the image (greedy replies would prove little)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("gemma3-chat") / "ckpt"
    shutil.copytree(published_checkpoint("gemma-3-4b-it"), folder)
    (path,) = folder.glob("*.safetensors")
    tensors = load_file(path)
    name = next(k for k in tensors if k.endswith("embed_tokens.weight"))
    tensors[name] = tensors[name] * 0.05
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def reference_processor(folder, **options):
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    image_processor = Gemma3ImageProcessorPil.from_pretrained(folder, **options)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return Gemma3Processor(
        image_processor, tokenizer, chat_template=tokenizer.chat_template, image_seq_length=4
    )


def messages(*images) -> list[dict]:
    content = [{"type": "image", "image": image} for image in images]
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Look:"}, *content, {"type": "text", "text": "What is it?"}],
        }
    ]


def with_pan_and_scan(folder, tmp_path):
    import json
    import shutil

    copy = tmp_path / "pas"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "preprocessor_config.json").read_text())
    (copy / "preprocessor_config.json").write_text(json.dumps({**config, **PAN_AND_SCAN}))
    return copy


@pytest.mark.parametrize("pan_and_scan", [pytest.param(False, marks=SLOW), True])
def test_llm_inputs_equal_the_processor(published_checkpoint, tmp_path, pan_and_scan):
    """transformers' Gemma3Processor takes its pan-and-scan settings from the call (its own defaults
    override preprocessor_config.json's); torchgemma reads them from the folder's config."""
    folder = published_checkpoint("gemma-3-4b-it")
    options = {}
    if pan_and_scan:
        folder, options = with_pan_and_scan(folder, tmp_path), PAN_AND_SCAN
    llm = torchgemma.LLM(folder, progress=False)
    processor = reference_processor(folder)
    images = [IMAGES["wide"], IMAGES["square"]]
    chat = messages(*images)
    ours = llm.chat_inputs(chat)
    theirs = processor.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt", **options
    )
    assert ours["input_ids"].tolist() == theirs["input_ids"].tolist()
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])
    assert ours["mm_token_type_ids"].tolist() == theirs["token_type_ids"].tolist()
    assert len(ours["pixel_values"]) == (5 if pan_and_scan else 2)
    # A raw prompt, and a batch of two whose images are taken in order.
    prompts = ["First <start_of_image> then\n<start_of_image>", "Last:<start_of_image>"]
    images.append(IMAGES["tall"])
    raw = llm.inputs(llm.processor.encode_all(prompts, images=images), images=images)
    processor.tokenizer.padding_side = "left"
    expected = processor(
        text=prompts, images=[images[:2], images[2:]], padding=True, return_tensors="pt", **options
    )
    assert raw["input_ids"].tolist() == expected["input_ids"].tolist()
    assert torch.equal(raw["pixel_values"], expected["pixel_values"])
    assert raw["mm_token_type_ids"].tolist() == expected["token_type_ids"].tolist()


@SLOW
def test_llm_chat_with_an_image_generates_like_transformers(chat_folder):
    folder = chat_folder
    llm = torchgemma.LLM(folder, dtype=torch.float32, attention="eager", progress=False)
    processor = reference_processor(folder)
    chat = messages(IMAGES["tall"])
    inputs = processor.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    ref = reference(folder, torch.float32)
    with torch.no_grad():
        expected = ref.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None)
    expected = expected[0, inputs["input_ids"].shape[1] :].tolist()
    # temperature 0: the folder's generation_config.json samples (top-k 64), as published.
    assert list(llm.chat(chat, max_new_tokens=6, stop_token_ids=[], temperature=0).token_ids) == expected
    assert len(set(expected)) > 1
    other = llm.chat(messages(IMAGES["square"]), max_new_tokens=6, stop_token_ids=[], temperature=0)
    assert list(other.token_ids) != expected  # the image changes the reply


def test_errors_are_named(published_checkpoint):
    llm = torchgemma.LLM(published_checkpoint("gemma-3-4b-it"), progress=False)
    image = IMAGES["square"]
    with pytest.raises(ValueError, match="need 4: Gemma 3 prompts take each image's placeholder expanded"):
        llm.inputs([llm.encode("<start_of_image>")], images=[image])
    with pytest.raises(ValueError, match="1 <start_of_image> placeholders but 2 images"):
        llm.processor.encode("<start_of_image>", images=[image, image])
    with pytest.raises(ValueError, match="images only"):
        llm.inputs([[2]], audio=[np.zeros(16000, np.float32)])
    with pytest.raises(ValueError, match=r"pixel_values must be \(images, 3, 56, 56\)"):
        llm.model(torch.tensor([[2, 5]]), pixel_values=torch.zeros(1, 3, 32, 32))


def png(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


@SLOW
def test_cli_generate_with_an_image_equals_transformers(chat_folder, tmp_path, capsys):
    import json

    from torchgemma.cli import main

    folder = chat_folder
    path = tmp_path / "wide.png"
    path.write_bytes(png(IMAGES["wide"]))
    argv = ["generate", "--model", str(folder), "--image", str(path), "--temperature", "0", "--dtype", "fp32"]
    assert main([*argv, "--max-new-tokens", "5", "--json", "Describe <|image|> please"]) == 0
    got = json.loads(capsys.readouterr().out)["token_ids"]
    processor = reference_processor(folder)
    image = Image.open(path)
    # The tokenizer adds <bos> (add_bos_token), to the reference's text as to the CLI's.
    inputs = processor(text=["Describe <start_of_image> please"], images=[[image]], return_tensors="pt")
    with torch.no_grad():
        expected = reference(folder, torch.float32).generate(**inputs, max_new_tokens=5, do_sample=False)
    assert got == expected[0, inputs["input_ids"].shape[1] :].tolist()[: len(got)]
    assert len(set(got)) > 1


@SLOW
def test_server_chat_with_an_image_url(chat_folder):
    """An image_url content part (a data URL) replies what LLM.chat replies to the same image."""
    import base64

    import openai

    from serving_fixtures import content_of, running_server
    from torchgemma.serving.app import create_app

    llm = torchgemma.LLM(chat_folder, progress=False)
    data = png(IMAGES["tall"])
    url_part = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()},
    }
    with running_server(create_app(llm, model_name="g3", max_len=256)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="g3",
            messages=[{"role": "user", "content": [url_part, {"type": "text", "text": "What is it?"}]}],
            temperature=0,
            max_tokens=5,
        )
    chat = [
        {
            "role": "user",
            "content": [{"type": "image", "image": IMAGES["tall"]}, {"type": "text", "text": "What is it?"}],
        }
    ]
    expected = llm.chat(chat, temperature=0, max_new_tokens=5)
    assert len(set(expected.token_ids)) > 1
    assert reply.choices[0].message.content == content_of(llm, expected.token_ids)
    assert reply.usage.prompt_tokens == int(llm.chat_inputs(chat)["attention_mask"].sum())

"""Gemma 3n's vision path against its references: MobileNet-V5 against timm's, the image processor
against transformers' ``SiglipImageProcessorPil``, logits and greedy generation with images against
transformers' ``Gemma3nForConditionalGeneration``.

timm needs torchvision, which has no CPU build here: timm is imported with a stand-in for the
torchvision names it imports (none of them called by MobileNet-V5), and transformers builds its
``TimmWrapperModel`` on that timm (see timm_reference.py). Without timm installed
(``pip install --no-deps timm``) the tests that need it skip, saying so.
"""

import json

import numpy as np
import pytest
import torch
from PIL import Image

import torchgemma
from gemma3n_checkpoints import (
    TOKEN_IDS,
    VISION,
    VISION_BLOCKS,
    VISION_SOFT_TOKENS,
    build,
    reference_model,
    timm_block_args,
)
from timm_reference import import_timm, mobilenetv5
from torchgemma.config import ConfigError, ModelConfig
from torchgemma.config.gemma3n_vision import vision_config_from_hf
from torchgemma.generation import generate
from torchgemma.model.gemma3n_vision import Gemma3nVisionTower
from torchgemma.model.inputs import MediaInputs
from torchgemma.processing.gemma3n_image import process_images_gemma3n

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = [torch.float32, torch.bfloat16]
BOI, EOI, IMAGE = TOKEN_IDS["boi_token_id"], TOKEN_IDS["eoi_token_id"], TOKEN_IDS["image_token_id"]
TINY_ARGS = VISION["model_args"]

# ── the tower against timm's ────────────────────────────────────────────────────────────────────


def test_tiny_blocks_are_timms_decoding():
    import_timm()
    from timm.models._efficientnet_builder import decode_arch_def

    assert timm_block_args(VISION_BLOCKS) == decode_arch_def(VISION_BLOCKS)


def test_published_architecture_is_timms():
    """mobilenetv5_300m_enc as written in config/gemma3n_vision.py: timm's tensors, names and shapes."""
    with torch.device("meta"):
        theirs = mobilenetv5()
        ours = Gemma3nVisionTower(vision_config_from_hf(None, {})).timm_model
    shapes = {name: tuple(t.shape) for name, t in theirs.state_dict().items()}
    assert {name: tuple(t.shape) for name, t in ours.state_dict().items()} == shapes
    assert sum(p.numel() for p in ours.parameters()) == 294_126_912


@pytest.fixture(scope="module")
def towers():
    """timm's tiny MobileNet-V5 with random weights (norm scales and layer scales around 1, so that
    every block counts), and ours with the same weights."""
    ref = mobilenetv5(**TINY_ARGS)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in ref.parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if param.ndim == 1 else 0.3 * noise)
    config = vision_config_from_hf(
        {"model_args": TINY_ARGS}, {"vision_soft_tokens_per_image": VISION_SOFT_TOKENS}
    )
    ours = Gemma3nVisionTower(config).eval()
    ours.timm_model.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


# Square and odd sizes: strided convolutions pad by the input's size ("SAME", the odd pixel after);
# 64 px gives 4x4 maps (the adapter's grid, no pooling), 96 px 6x6 (not a multiple: bilinear), 128 px
# 8x8 (2x2 average pooling).
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tower_equals_timm(towers, dtype):
    ref, ours = towers
    gen = torch.Generator().manual_seed(4)
    for size in ((64, 64), (77, 93), (96, 96), (128, 128)):
        pixels = torch.rand(2, 3, *size, generator=gen).to(dtype)
        with torch.no_grad():
            expected = ref.to(dtype).forward_features(pixels)
            got = ours.to(dtype).timm_model(pixels)
        assert got.shape == expected.shape == (2, 2048, 4, 4)
        if dtype == torch.float32:
            assert (got - expected).abs().max().item() <= 1e-5
        else:
            assert torch.equal(got, expected)
    ref.float(), ours.float()


@pytest.mark.slow  # 294M parameters twice, at 768 px: ~1 min
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_published_tower_equals_timm_at_768px(dtype):
    """The published MobileNet-V5 at the published size (768 px in, 16x16 soft tokens out:
    the stem's padding, key/value strides, the adapter's 48 -> 16 average pooling), random weights."""
    ref = mobilenetv5()
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for param in ref.parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if param.ndim == 1 else noise / max(1, param[0].numel()) ** 0.5)
    ours = Gemma3nVisionTower(vision_config_from_hf(None, {})).eval()
    ours.timm_model.load_state_dict(ref.state_dict(), strict=True)
    pixels = torch.rand(1, 3, 768, 768, generator=gen).to(dtype)
    with torch.no_grad():
        expected = ref.to(dtype).forward_features(pixels)
        got = ours.to(dtype).timm_model(pixels)
    assert got.shape == expected.shape == (1, 2048, 16, 16)
    assert torch.isfinite(expected).all()
    if dtype == torch.float32:
        assert (got - expected).abs().max().item() <= 1e-5  # 0.0 measured (values up to 5.6)
    else:
        assert torch.equal(got, expected)


# ── the image processor against SiglipImageProcessorPil ───────────────────────────────────────


def images(tmp_path):
    """An RGB array, a grayscale, an RGBA and a palette PIL image, a file; various shapes."""
    rng = np.random.default_rng(5)
    rgba = Image.fromarray(rng.integers(0, 256, (40, 30, 4), dtype=np.uint8), "RGBA")
    palette = Image.fromarray(rng.integers(0, 256, (21, 50, 3), dtype=np.uint8)).convert("P")
    path = tmp_path / "image.png"
    Image.fromarray(rng.integers(0, 256, (33, 33, 3), dtype=np.uint8)).save(path)
    return [
        rng.integers(0, 256, (50, 70, 3), dtype=np.uint8),
        Image.fromarray(rng.integers(0, 256, (60, 45), dtype=np.uint8), "L"),
        rgba,
        palette,
        str(path),
    ]


@pytest.mark.parametrize(
    "settings",
    [
        {},  # SigLIP's defaults at Gemma 3n's 768 px
        {"size": {"height": 96, "width": 64}, "resample": 2, "do_normalize": False},
        {"do_resize": False, "image_mean": [0.1, 0.2, 0.3], "image_std": [0.5, 0.6, 0.7]},
    ],
)
def test_images_equal_siglip_processor(tmp_path, settings):
    from transformers.image_utils import load_image
    from transformers.models.siglip import SiglipImageProcessorPil

    reference = SiglipImageProcessorPil(**{"size": {"height": 768, "width": 768}, **settings})
    items = images(tmp_path)
    if settings.get("do_resize") is False:
        items = [items[0], items[0][::-1].copy()]  # one size: unresized images batch only then
    theirs = reference([load_image(i) if isinstance(i, str) else i for i in items], return_tensors="pt")
    ours = process_images_gemma3n(items, settings)["pixel_values"]
    assert ours.dtype == torch.float32
    assert torch.equal(ours, theirs["pixel_values"])


def test_image_settings_are_read_and_refused_by_name(tmp_path):
    from torchgemma.processing.gemma3n_image import image_settings

    assert image_settings(None) == {} == image_settings(tmp_path)
    nested = {
        "image_processor": {"size": {"height": 32, "width": 48}, "do_normalize": False, "crop_size": None}
    }
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    assert image_settings(tmp_path) == {"size": {"height": 32, "width": 48}, "do_normalize": False}
    image = np.full((10, 20, 3), 255, np.uint8)
    assert process_images_gemma3n(image, image_settings(tmp_path))["pixel_values"].shape == (1, 3, 32, 48)
    floats = process_images_gemma3n(image.astype(np.float32) / 255, {"do_normalize": False})["pixel_values"]
    assert floats.shape == (1, 3, 768, 768) and floats.max().item() == 1.0  # intensities, rescaled once
    for bad, message in (
        ({"do_pad": True}, "do_pad is True; torchgemma supports False"),
        ({"do_center_crop": True}, "do_center_crop is True"),
        ({"size": {"shortest_edge": 768}}, "size must be"),
        ({"resample": 9}, "resample 9 is not a PIL filter"),
    ):
        (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": bad}))
        with pytest.raises(ValueError, match=message):
            image_settings(tmp_path)
    with pytest.raises(ValueError, match="different sizes"):
        process_images_gemma3n([image, image[:5]], {"do_resize": False})


# ── the model with images against transformers ──────────────────────────────────────────────────


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import_timm()
    return build(
        tmp_path_factory.mktemp("gemma3n-vision") / "ckpt", multimodal=True, seed=71, embed_scale=0.1
    )


def aligned_reference(folder, dtype):
    """transformers' model, its parameters copied to fresh (aligned) memory (see test_gemma3n_audio)."""
    model = reference_model(folder, dtype)
    for param in model.parameters():
        param.data = param.data.clone()
    return model


def image_prompts(seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows: text, an image (boi, 16 placeholders, eoi), text, and in the first a second image;
    the second row left-padded. Ids 260-279 (the vision vocabulary, eoi among them) included."""
    gen = torch.Generator().manual_seed(seed)
    image = [BOI] + [IMAGE] * VISION_SOFT_TOKENS + [EOI]
    text = lambda n: torch.randint(3, 250, (n,), generator=gen).tolist()  # noqa: E731
    rows = [text(5) + image + text(3) + image + [265, 270] + text(2), text(2) + image + text(4)]
    length = max(len(r) for r in rows)
    ids = torch.zeros(2, length, dtype=torch.long)
    mask = torch.zeros(2, length, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, length - len(row) :] = torch.tensor(row)
        mask[b, length - len(row) :] = 1
    return ids, mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logits_with_images_equal_transformers(checkpoint, dtype):
    """Three 64 px images (two in the first row) through both models: the soft tokens
    (get_image_features) and the logits."""
    ref = aligned_reference(checkpoint, dtype)
    model = torchgemma.load(checkpoint, dtype=dtype, attention="eager")
    ids, mask = image_prompts(seed=1)
    pixels = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate numbers left-padded rows
    with torch.no_grad():
        expected_soft = ref.model.get_image_features(pixels.to(dtype)).pooler_output
        got_soft = model.image_features(pixels, None)
        expected = ref(input_ids=ids, attention_mask=mask, position_ids=positions, pixel_values=pixels).logits
        got = model(ids, mask, pixel_values=pixels)
    assert got_soft.shape == (3 * VISION_SOFT_TOKENS, 48)
    real = mask.bool()
    if dtype == torch.float32:
        assert (got_soft - expected_soft.reshape(got_soft.shape)).abs().max().item() <= 1e-5
        assert (got[real] - expected[real]).abs().max().item() <= 1e-5
    else:
        assert torch.equal(got_soft, expected_soft.reshape(got_soft.shape))
        assert torch.equal(got[real], expected[real])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_with_images_equals_transformers(checkpoint, dtype):
    ref = aligned_reference(checkpoint, dtype)
    model = torchgemma.load(checkpoint, dtype=dtype, attention="eager")
    ids, mask = image_prompts(seed=5)
    pixels = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = ref.generate(
            input_ids=ids,
            attention_mask=mask,
            pixel_values=pixels,
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
        )
    media = MediaInputs.from_dict({"pixel_values": pixels})
    got = generate(model, ids, attention_mask=mask, media=media, max_new_tokens=8, stop_token_ids=[])
    assert got.tolist() == expected.tolist()
    assert len(set(got[:, ids.shape[1] :].flatten().tolist())) > 1  # the continuation varies


def test_config_and_model_refuse_what_they_do_not_take(checkpoint):
    data = ModelConfig.from_file(checkpoint).source
    vision = data["vision_config"]
    cases = [
        ({**vision, "architecture": "mobilenetv5_base"}, {}, "builds 'mobilenetv5_300m_enc' only"),
        ({**vision, "model_args": {**TINY_ARGS, "channel_multiplier": 0.5}}, {}, "channel_multiplier"),
        (vision, {"vision_soft_tokens_per_image": 256}, "gives 4x4 = 16 soft tokens"),
        ({**vision, "hidden_size": 24}, {}, "hidden_size 24, but MobileNet-V5's adapter gives 2048"),
    ]
    for bad_vision, top, message in cases:
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_hf({**data, **top, "vision_config": bad_vision})
    stages = TINY_ARGS["block_args"]
    bad = [stages[0], [{**stages[1][0], "se_ratio": 0.25}]] + stages[2:]
    model = torchgemma.load(checkpoint)
    with pytest.raises(ValueError, match=r"must be \(images, 3, height, width\), got \(1, 144, 768\)"):
        model(torch.tensor([[4, 5]]), pixel_values=torch.zeros(1, 144, 768))  # Gemma 4's patches
    with pytest.raises(ConfigError, match=r"block_args\[1\]\[0\]: se_ratio=0.25"):
        ModelConfig.from_hf(
            {**data, "vision_config": {**vision, "model_args": {**TINY_ARGS, "block_args": bad}}}
        )


# ── LLM, CLI and server with images ──────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def llm_folder(tmp_path_factory):
    """A gemma3n checkpoint with the fixture tokenizer (its media ids), whose image processor
    resizes to 64 px (preprocessor_config.json), bilinear and without normalisation."""
    from tokenizer_fixtures import VOCAB_SIZE, write_gemma4_tokenizer

    import_timm()
    folder = tmp_path_factory.mktemp("gemma3n-vision-llm") / "ckpt"
    write_gemma4_tokenizer(folder)
    tok = torchgemma.load_tokenizer(folder)
    ids = dict(boi_token_id=tok.image_start_id, image_token_id=tok.image_id, eoi_token_id=tok.image_end_id)
    ids.update(boa_token_id=tok.audio_start_id, audio_token_id=tok.audio_id, eoa_token_id=tok.audio_end_id)
    build(
        folder,
        multimodal=True,
        seed=72,
        embed_scale=0.1,
        token_ids=ids,
        vocab_size=VOCAB_SIZE,
        vocab_size_per_layer_input=VOCAB_SIZE - 40,
    )
    settings = {"size": {"height": 64, "width": 64}, "resample": 2, "do_normalize": False}
    (folder / "preprocessor_config.json").write_text(json.dumps(settings))
    return folder


def reference_processor(folder):
    from transformers import AutoTokenizer, Gemma3nAudioFeatureExtractor, Gemma3nProcessor
    from transformers.models.siglip import SiglipImageProcessorPil

    settings = json.loads((folder / "preprocessor_config.json").read_text())
    return Gemma3nProcessor(
        feature_extractor=Gemma3nAudioFeatureExtractor(),
        image_processor=SiglipImageProcessorPil(**settings),
        tokenizer=AutoTokenizer.from_pretrained(folder),
        chat_template=(folder / "chat_template.jinja").read_text(),
        image_seq_length=VISION_SOFT_TOKENS,
    )


def picture(seed: int, shape=(40, 52, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


MESSAGES = [
    {
        "role": "user",
        "content": [{"type": "image", "image": picture(11)}, {"type": "text", "text": "What is shown?"}],
    }
]


def test_llm_inputs_equal_the_processor(llm_folder):
    llm = torchgemma.LLM(llm_folder, progress=False)
    processor = reference_processor(llm_folder)
    ours = llm.chat_inputs(MESSAGES)
    theirs = processor.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert ours["input_ids"].tolist() == theirs["input_ids"].tolist()
    assert (ours["input_ids"] == llm.tokenizer.image_id).sum() == VISION_SOFT_TOKENS
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])

    pictures = [Image.fromarray(picture(12)), Image.fromarray(picture(13, (30, 30)))]
    prompt = "<bos>First<|image|> then<|image|>\nsecond"
    ours = llm.inputs([llm.encode(prompt, images=pictures)], images=pictures)
    theirs = processor(text=[prompt], images=[pictures], return_tensors="pt")
    assert ours["input_ids"].tolist() == theirs["input_ids"].tolist()
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])
    with pytest.raises(ValueError, match=f"{VISION_SOFT_TOKENS} each"):
        llm.inputs([llm.encode("<|image|>")], images=pictures[:1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llm_chat_with_an_image_generates_like_transformers(llm_folder, dtype):
    llm = torchgemma.LLM(llm_folder, dtype=dtype, attention="eager", progress=False)
    inputs = reference_processor(llm_folder).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    inputs.pop("token_type_ids", None)
    with torch.no_grad():
        expected = aligned_reference(llm_folder, dtype).generate(
            **inputs, max_new_tokens=8, do_sample=False, eos_token_id=None
        )
    expected = expected[0, inputs["input_ids"].shape[1] :].tolist()
    got = llm.chat(MESSAGES, max_new_tokens=8, stop_token_ids=[])
    assert list(got.token_ids) == expected
    assert len(set(expected)) > 1


def test_cli_generate_with_an_image_equals_transformers(llm_folder, tmp_path, capsys):
    from torchgemma.cli import main

    path = tmp_path / "picture.png"
    Image.fromarray(picture(14)).save(path)
    argv = ["generate", "--model", str(llm_folder), "--image", str(path), "--temperature", "0"]
    assert main([*argv, "--max-new-tokens", "6", "--json", "Say:"]) == 0
    got = json.loads(capsys.readouterr().out)["token_ids"]

    inputs = reference_processor(llm_folder)(
        text=["<bos>Say:<|image|>"], images=[[Image.open(path)]], return_tensors="pt"
    )
    inputs.pop("token_type_ids", None)
    with torch.no_grad():
        expected = aligned_reference(llm_folder, torch.float32).generate(
            **inputs, max_new_tokens=6, do_sample=False, eos_token_id=None
        )
    assert got == expected[0, inputs["input_ids"].shape[1] :].tolist()[: len(got)]
    assert len(got) > 0


def png_data_url(image: np.ndarray) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_chat_handler_takes_an_image_url(llm_folder):
    """The server's chat handler (no socket): an image_url part is the image LLM.chat takes."""
    import asyncio

    from torchgemma.serving.chat import create_chat_completion
    from torchgemma.serving.protocol import ChatCompletionRequest
    from torchgemma.serving.state import ServerState

    llm = torchgemma.LLM(llm_folder, progress=False)
    expected = llm.chat(MESSAGES, max_new_tokens=6, temperature=0)
    content = [
        {"type": "image_url", "image_url": {"url": png_data_url(picture(11))}},
        {"type": "text", "text": "What is shown?"},
    ]
    body = ChatCompletionRequest(
        model="g3n", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=6
    )
    loop = asyncio.new_event_loop()
    state = ServerState.build(llm, model_name="g3n", max_len=512)
    try:
        response = loop.run_until_complete(create_chat_completion(state, body))
    finally:
        state.close()
        loop.close()
    assert response["usage"]["completion_tokens"] == len(expected.token_ids)
    assert response["usage"]["prompt_tokens"] == len(llm.chat_inputs(MESSAGES)["input_ids"][0])
    assert response["choices"][0]["message"]["content"].strip() == expected.text.strip()


@pytest.mark.slow  # a server and the OpenAI client: 6 s; the handler's test above runs by default
def test_server_chat_with_an_image_url(llm_folder):
    """An image_url part (a data URL) is the same image LLM.chat takes: the same reply."""
    import openai

    from serving_fixtures import content_of, running_server
    from torchgemma.serving.app import create_app

    url = png_data_url(picture(11))
    llm = torchgemma.LLM(llm_folder, progress=False)
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is shown?"}]
    with running_server(create_app(llm, model_name="g3n", max_len=512)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="g3n", messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0
        )
    expected = llm.chat(MESSAGES, max_new_tokens=6, temperature=0)
    assert reply.choices[0].message.content == content_of(llm, expected.token_ids)
    assert reply.usage.completion_tokens == len(expected.token_ids)


# ── llama.cpp's mmproj names ─────────────────────────────────────────────────────────────────────


def test_mmproj_names_undo_llama_cpp_conversion():
    """Every tensor of the published tower and the vision embedder: the name llama.cpp's converter
    gives it (gguf.tensor_mapping for the stem, adapter and embedder; its block table, which keeps
    timm's suffix, for the blocks) maps back to the checkpoint name through the gemma3nv
    ``TowerNames``; the stem's (1, C, 1, 1) bias too. (Checked once by hand against the converter's
    own output: see weights/gguf/mmproj_names.py.)"""
    from gguf import MODEL_ARCH, get_tensor_name_map

    from torchgemma.weights.gguf.mmproj_names import GEMMA3N_VISION

    with torch.device("meta"):
        tower = Gemma3nVisionTower(vision_config_from_hf(None, {}))
    names = ["model.vision_tower." + name for name in tower.state_dict()]
    names += [
        f"model.embed_vision.{n}.weight" for n in ("embedding", "hard_embedding_norm", "soft_embedding_norm")
    ]
    names.append("model.embed_vision.embedding_projection.weight")
    mapping = get_tensor_name_map(MODEL_ARCH.MMPROJ, 1)
    for name in names:
        if name.startswith("model.vision_tower.timm_model.blocks."):
            stage, block, suffix = name.split(".", 6)[4:]
            theirs = f"v.blk.{stage}.{block}.{suffix}"
        else:
            theirs = mapping.get_name(name, try_suffixes=(".weight", ".bias"))
        assert GEMMA3N_VISION.hf_name(theirs)[0] == name, (name, theirs)
    for unknown in ("v.blk.0.0.unknown.weight", "v.blk.0.conv_exp.weight", "a.conv1d.0.weight"):
        assert GEMMA3N_VISION.hf_name(unknown) is None
    _, stem = GEMMA3N_VISION.hf_name("v.conv_stem.conv.bias")
    bias = torch.arange(4.0).reshape(1, 4, 1, 1)
    assert torch.equal(stem.apply(bias), torch.arange(4.0)) and stem.shape((1, 4, 1, 1)) == (4,)
    # Layer scales are written before the converter's reshape: as in the checkpoint, untouched.
    assert GEMMA3N_VISION.hf_name("v.blk.1.0.layer_scale.gamma")[1] is None
    with pytest.raises(ValueError, match="expected the converter's"):
        stem.apply(torch.zeros(4))

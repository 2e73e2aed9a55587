"""EmbeddingGemma 2 (``embedding_gemma2``, ``embedding_gemma2_text``): text, image and audio
embeddings against transformers 5.23 and sentence-transformers 6.2.

Tiny random checkpoints built and saved by transformers: a text-only one saved by
sentence-transformers (``Transformer`` + mean ``Pooling`` + ``Normalize``: the head the model's
own docstring names), and one with Gemma 4's E2B-like vision and audio towers, its vocabulary the
fixture tokenizer's (media tokens included), with the same sentence-transformers modules.

Text is checked against ``SentenceTransformer(folder).encode``. sentence-transformers loads the
multimodal model through ``AutoProcessor``, whose video processor needs torchvision (absent here):
images and audio are checked against transformers' ``EmbeddingGemma2Processor`` (its video
processor left out) and ``EmbeddingGemma2Model``, pooled by sentence-transformers' own
``Pooling`` and ``Normalize`` modules.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling as STPooling
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

import torchgemma
from checkpoints import ON_DEVICE_AUDIO, ON_DEVICE_VISION, randomize_, tighten_clip_bounds_
from llm_fixtures import SOFT_TOKENS, image_processor, media_token_ids
from tokenizer_fixtures import VOCAB_SIZE, write_gemma4_tokenizer
from torchgemma.config import FULL, SLIDING, ModelConfig
from torchgemma.llm import LLM

pytestmark = pytest.mark.usefixtures("one_thread")

HIDDEN, EMBEDDING_DIM = 64, 48
PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}
TEXTS = ["Which planet is known as the Red Planet?", "Mars", "A tiny model, " * 4 + "longer than the window."]

TEXT_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=HIDDEN,
    intermediate_size=96,
    num_hidden_layers=4,
    layer_types=[SLIDING, FULL] * 2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    sliding_window=3,  # a radius: 3 keys either side
    hidden_size_per_layer_input=8,
    embedding_dim=EMBEDDING_DIM,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)

RNG = np.random.default_rng(11)
IMAGES = [
    Image.fromarray(RNG.integers(0, 256, (100, 150, 3), dtype=np.uint8)),
    Image.fromarray(RNG.integers(0, 256, (60, 40, 3), dtype=np.uint8)),
]
CLIPS = [0.1 * RNG.standard_normal(n).astype(np.float32) for n in (8000, 4800)]


def write_tokenizer(folder: Path) -> None:
    """The fixture tokenizer, writing ``<bos> text <eos>`` as EmbeddingGemma's does."""
    write_gemma4_tokenizer(folder, chat_template=None)
    backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>",
        pair="<bos> $A <eos> $B:1 <eos>:1",
        special_tokens=[("<bos>", backend.token_to_id("<bos>")), ("<eos>", backend.token_to_id("<eos>"))],
    )
    backend.save(str(folder / "tokenizer.json"))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["padding_side"] = "right"
    config_path.write_text(json.dumps(config, indent=2))


def build_text_folder(folder: Path, seed: int) -> Path:
    """``embedding_gemma2_text`` saved by sentence-transformers with mean pooling and normalisation."""
    from transformers import EmbeddingGemma2TextConfig, EmbeddingGemma2TextModel

    backbone = folder.parent / f"{folder.name}-backbone"
    write_tokenizer(backbone)
    torch.manual_seed(seed)
    model = EmbeddingGemma2TextModel(EmbeddingGemma2TextConfig(**TEXT_CONFIG))
    randomize_(model, seed)
    model.save_pretrained(backbone)
    modules = [Transformer(str(backbone)), STPooling(EMBEDDING_DIM, "mean"), Normalize()]
    SentenceTransformer(modules=modules, prompts=PROMPTS).save(str(folder), safe_serialization=True)
    shutil.rmtree(backbone)
    return folder


def build_omni_folder(folder: Path, text_folder: Path, seed: int) -> Path:
    """``embedding_gemma2`` with E2B-like vision and audio towers (clip bounds that clamp), the
    text folder's sentence-transformers modules, and the processor config transformers writes."""
    from transformers import (
        EmbeddingGemma2Config,
        EmbeddingGemma2Model,
        Gemma4AudioConfig,
        Gemma4AudioFeatureExtractor,
        Gemma4VisionConfig,
    )

    config = EmbeddingGemma2Config(
        text_config=TEXT_CONFIG,
        vision_config=Gemma4VisionConfig(**ON_DEVICE_VISION).to_dict(),
        audio_config=Gemma4AudioConfig(**ON_DEVICE_AUDIO).to_dict(),
        **media_token_ids(),
    )
    torch.manual_seed(seed)
    model = EmbeddingGemma2Model(config)
    randomize_(model, seed)
    tighten_clip_bounds_(model, seed)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    for name in ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json"):
        shutil.copy(text_folder / name, folder / name)
    for module in ("1_Pooling", "2_Normalize"):
        shutil.copytree(text_folder / module, folder / module)
    processor_config = {
        "processor_class": "EmbeddingGemma2Processor",
        "image_processor": image_processor().to_dict(),
        "feature_extractor": Gemma4AudioFeatureExtractor().to_dict(),
        "image_seq_length": 280,
        "audio_seq_length": 750,
    }
    (folder / "processor_config.json").write_text(json.dumps(processor_config, default=str))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedding-gemma2")
    text = build_text_folder(root / "text", seed=21)
    return {"text": text, "omni": build_omni_folder(root / "omni", text, seed=22)}


def assert_parity(ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    delta = (ours.float() - theirs.float()).abs().max().item()
    if dtype == torch.bfloat16:
        assert torch.equal(ours, theirs), f"max |Δ| = {delta}"
    else:
        assert delta <= 1e-5, f"max |Δ| = {delta}"


def test_config_reads_the_family(folders):
    config = ModelConfig.from_file(folders["omni"])
    text = config.text
    assert config.model_type == "embedding_gemma2" and config.takes_media
    assert text.bidirectional and not text.ple_token_table and text.embedding_dim == EMBEDDING_DIM
    # The radius 3 is our window of 4 (|q - k| < 4); full layers take the global geometry.
    assert [(s.window, s.head_dim, s.num_kv_heads) for s in text.layers[:2]] == [(4, 16, 2), (None, 32, 1)]
    assert {t: spec.rope_type for t, spec in text.rope.items()} == {SLIDING: "default", FULL: "default"}
    assert config.vision_config is not None and config.audio_config is not None


def test_config_defaults_are_transformers():
    """A config.json in the published style (no per_layer_config): transformers' defaults."""
    from transformers import EmbeddingGemma2TextConfig

    fields = dict(vocab_size=300, hidden_size=64, num_hidden_layers=6, model_type="embedding_gemma2_text")
    theirs = EmbeddingGemma2TextConfig(**{k: v for k, v in fields.items() if k != "model_type"})
    text = ModelConfig.from_hf(fields).text
    assert list(text.layer_types) == theirs.layer_types
    for spec in text.layers:
        layer = theirs.per_layer_config[spec.index]
        assert (spec.head_dim, spec.num_kv_heads) == (layer.head_dim, layer.num_key_value_heads)
        assert spec.window == (theirs.sliding_window + 1 if spec.is_sliding else None)
    assert {t: (r.rope_type, r.theta) for t, r in text.rope.items()} == {
        t: (p["rope_type"], p["rope_theta"]) for t, p in theirs.rope_parameters.items()
    }
    assert (text.hidden_size_per_layer_input, text.embedding_dim) == (512, 768)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_text_matches_sentence_transformers(folders, dtype, attention):
    folder = folders["text"]
    st = SentenceTransformer(str(folder), model_kwargs={"dtype": dtype, "attn_implementation": attention})
    llm = LLM(folder, dtype=dtype, attention=attention, progress=False)
    for prompt_name in (None, "query"):
        theirs = st.encode(TEXTS, convert_to_tensor=True, prompt_name=prompt_name, batch_size=2)
        assert_parity(llm.embed(TEXTS, prompt_name=prompt_name, batch_size=2), theirs, dtype)


@pytest.fixture(scope="module")
def processor(folders):
    from transformers import AutoTokenizer, EmbeddingGemma2Processor, Gemma4AudioFeatureExtractor

    class Processor(EmbeddingGemma2Processor):
        # The video processor needs torchvision, absent here; videos are not used.
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    return Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=image_processor(),
        tokenizer=AutoTokenizer.from_pretrained(folders["omni"]),
        video_processor=None,
    )


def reference_vectors(
    folder: Path, processor, items: list[dict], dtype: torch.dtype, attention: str = "eager"
) -> torch.Tensor:
    """transformers' processor and model, one input at a time, then sentence-transformers' mean
    pooling and normalisation. (transformers' audio tower has no sdpa: it runs eager, as ours.)"""
    from transformers import EmbeddingGemma2Model

    implementation = {"text_config": attention, "vision_config": attention, "audio_config": "eager"}
    model = EmbeddingGemma2Model.from_pretrained(folder, dtype=dtype, attn_implementation=implementation)
    model.eval()
    pooling, normalize = STPooling(EMBEDDING_DIM, "mean"), Normalize()
    vectors = []
    for item in items:
        images, audio = item.get("image"), item.get("audio")
        text = " ".join(
            [processor.image_token] * len(images or []) + [processor.audio_token] * len(audio or [])
        )
        if item.get("text"):
            text = f"{text} {item['text']}" if text else item["text"]
        inputs = processor(
            text=[text], images=[images] if images else None, audio=audio or None, return_tensors="pt"
        )
        inputs.pop("mm_token_type_ids", None)
        with torch.no_grad():
            states = model(**{k: v for k, v in inputs.items()}).last_hidden_state
        features = {"token_embeddings": states, "attention_mask": inputs["attention_mask"]}
        vectors.append(normalize(pooling(features))["sentence_embedding"][0])
    return torch.stack(vectors)


MEDIA_ITEMS = [
    {"image": [IMAGES[0]]},
    {"audio": [CLIPS[0]]},
    {"image": [IMAGES[1]], "audio": [CLIPS[1]], "text": "a caption"},
]


@pytest.mark.parametrize(
    "dtype, attention",
    [(torch.float32, "eager"), (torch.bfloat16, "eager"), (torch.bfloat16, "sdpa")],
    ids=["fp32-eager", "bf16-eager", "bf16-sdpa"],
)
def test_images_and_audio_match_transformers(folders, processor, dtype, attention):
    folder = folders["omni"]
    llm = LLM(folder, dtype=dtype, attention=attention, progress=False)
    assert llm.max_soft_tokens == SOFT_TOKENS
    items = [*MEDIA_ITEMS, {"text": TEXTS[0]}]
    theirs = reference_vectors(folder, processor, items, dtype, attention)
    ours = llm.embed([*MEDIA_ITEMS, TEXTS[0]])
    assert_parity(ours, theirs, dtype)


def test_inputs_are_checked(folders):
    llm = LLM(folders["omni"], progress=False)
    one = torchgemma.embed({"image": IMAGES[0]}, model=llm)
    assert one.shape == (EMBEDDING_DIM,)
    torch.testing.assert_close(one, llm.embed([{"image": [IMAGES[0]]}])[0], rtol=0, atol=0)
    assert llm.embed([{"audio": CLIPS[0]}], truncate_dim=8).shape == (1, 8)
    for bad, error, words in [
        ([{"picture": IMAGES[0]}], ValueError, r"unknown key\(s\) \['picture'\]"),
        ([{}], ValueError, r"texts\[0\] is empty"),
        ([{"text": 3}], TypeError, r"texts\[0\]\['text'\] is a int"),
        ([{"image": IMAGES[0], "text": "<|audio|>"}], ValueError, "hold 2 media placeholders for 1"),
    ]:
        with pytest.raises(error, match=words):
            llm.embed(bad)
    with pytest.raises(ValueError, match="unknown prompt_name 'nope'"):
        llm.embed([{"image": IMAGES[0]}], prompt_name="nope")
    text_only = LLM(folders["text"], progress=False)
    with pytest.raises(ValueError, match="embeds text only"):
        text_only.embed([{"image": IMAGES[0]}])


def _data_url(kind: str, data: bytes) -> str:
    import base64

    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def _png(image: Image.Image) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _wav(clip: np.ndarray) -> bytes:
    import io
    import wave

    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1), out.setsampwidth(2), out.setframerate(16_000)
        out.writeframes((np.clip(clip, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def test_server_embeds_images_and_audio(folders):
    """Jina-shaped items through the official client: the vectors are LLM.embed's of the same
    decoded media; usage counts the soft tokens; bad media and models without towers are 400s."""
    import httpx
    import openai

    from serving_fixtures import running_server
    from torchgemma.processing.audio import decode_wav
    from torchgemma.serving.app import create_app

    llm = LLM(folders["omni"], progress=False)
    png, wav = _png(IMAGES[0]), _wav(CLIPS[0])
    items = [
        {"image": _data_url("image/png", png)},
        "plain text",
        {"audio": _data_url("audio/wav", wav), "text": "a caption"},
    ]
    expected = llm.embed(
        [
            {"image": Image.open(__import__("io").BytesIO(png))},
            "plain text",
            {"audio": decode_wav(wav), "text": "a caption"},
        ]
    )
    with running_server(create_app(llm, model_name="emb", max_batch_size=2, max_len=64)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        reply = client.embeddings.create(model="emb", input=items)
        ours = torch.tensor([item.embedding for item in reply.data])
        assert (ours - expected).abs().max().item() <= 1e-6
        assert reply.usage.prompt_tokens > 64  # the image's 60-odd soft tokens are counted
        for body, words in [
            ({"input": [{"image": "https://example.com/cat.png"}]}, "URLs are not fetched"),
            ({"input": [{"image": "data:image/png;base64,AAAA"}]}, "cannot read the image"),
            ({"input": [{"audio": "data:audio/wav;base64,AAAA"}]}, "cannot read the audio"),
            ({"input": [{"picture": "x"}]}, "picture"),
        ]:
            answer = httpx.post(f"{url}/v1/embeddings", json=body)
            assert answer.status_code == 400 and words in answer.json()["error"]["message"], body
    with running_server(create_app(LLM(folders["text"], progress=False), model_name="t")) as url:
        answer = httpx.post(f"{url}/v1/embeddings", json={"input": items[:1]})
        assert answer.status_code == 400 and "cannot embed images" in answer.json()["error"]["message"]


def test_the_embed_command_takes_images_and_audio(folders, tmp_path, capsys, monkeypatch):
    from llm_fixtures import run_cli

    image, clip = tmp_path / "cat.png", tmp_path / "bell.wav"
    image.write_bytes(_png(IMAGES[0]))
    clip.write_bytes(_wav(CLIPS[0]))
    argv = ["embed", "--model", str(folders["omni"]), "--image", str(image), "--audio", str(clip), "a text"]
    code, out, err = run_cli(argv, capsys, monkeypatch)
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [sorted(k for k in line if k != "embedding") for line in lines] == [["text"], ["image"], ["audio"]]
    llm = LLM(folders["omni"], progress=False)
    expected = llm.embed(["a text", {"image": str(image)}, {"audio": str(clip)}])
    assert (torch.tensor([line["embedding"] for line in lines]) - expected).abs().max().item() <= 1e-6

"""Gemma 3n's audio path against transformers: the feature extractor, the conformer encoder, the
audio embedder, logits and greedy generation with audio in the prompt."""

import numpy as np
import pytest
import torch

import torchgemma
from gemma3n_checkpoints import TOKEN_IDS, build, reference_model
from torchgemma.generation import generate
from torchgemma.model.inputs import MediaInputs
from torchgemma.processing.gemma3n_audio import process_audio_gemma3n

pytestmark = pytest.mark.usefixtures("one_thread")


def clips(lengths, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * 0.3).astype(dtype) for n in lengths]


# One clip, the shortest (one frame), a padded batch, one truncated to 30 s, float64 input.
@pytest.mark.parametrize(
    "lengths, dtype",
    [
        ([16000], np.float32),
        ([513], np.float32),
        ([700, 16000, 3001], np.float32),
        ([480_200], np.float32),
        ([5000, 999], np.float64),
    ],
)
def test_features_equal_transformers(lengths, dtype):
    from transformers import Gemma3nAudioFeatureExtractor

    waves = clips(lengths, seed=len(lengths), dtype=dtype)
    ref = Gemma3nAudioFeatureExtractor()(waves, return_tensors="pt")
    ours = process_audio_gemma3n(waves)
    assert ours["input_features"].dtype == torch.float32
    assert ours["input_features"].shape == ref["input_features"].shape
    assert (ours["input_features"] - ref["input_features"]).abs().max().item() == 0.0
    assert torch.equal(ours["input_features_mask"], ref["input_features_mask"])


def test_per_bin_normalisation_equals_transformers():
    from transformers import Gemma3nAudioFeatureExtractor

    rng = np.random.default_rng(3)
    mean, stddev = rng.standard_normal(128), rng.random(128) + 0.5
    waves = clips([4000, 2500], seed=5)
    ref = Gemma3nAudioFeatureExtractor(per_bin_mean=mean, per_bin_stddev=stddev)(waves, return_tensors="pt")
    ours = process_audio_gemma3n(waves, per_bin_mean=mean, per_bin_stddev=stddev)
    assert torch.equal(ours["input_features"], ref["input_features"])


def test_bad_audio_is_named():
    with pytest.raises(ValueError, match="too short.*513"):
        process_audio_gemma3n(clips([400])[0])
    with pytest.raises(ValueError, match="clip 1 is too short.*513"):
        process_audio_gemma3n(clips([1000, 100]))
    with pytest.raises(ValueError, match="per_bin_mean must be 128"):
        process_audio_gemma3n(clips([1000])[0], per_bin_mean=[0.0] * 3)


# ── the encoder and the model with audio ────────────────────────────────────────────────────────

DTYPES = [torch.float32, torch.bfloat16]
BOA, EOA, AUDIO = TOKEN_IDS["boa_token_id"], TOKEN_IDS["eoa_token_id"], TOKEN_IDS["audio_token_id"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build(tmp_path_factory.mktemp("gemma3n-audio") / "ckpt", multimodal=True, seed=61)


@pytest.fixture(scope="module")
def gen_checkpoint(tmp_path_factory):
    """Small token embeddings: greedy continuations that vary."""
    return build(
        tmp_path_factory.mktemp("gemma3n-audio-gen") / "ckpt", multimodal=True, seed=62, embed_scale=0.05
    )


def aligned_reference(folder, dtype):
    """transformers' model with every parameter copied to fresh (aligned) memory. Loaded in float32
    its weights are views into the file at whatever offset, and MKL's result for one row (the audio
    padding embedding, embedded alone) can depend on the weight's alignment by an ulp; torchgemma's
    weights are aligned. Copies compute what the reference computes, free of that."""
    model = reference_model(folder, dtype)
    for param in model.parameters():
        param.data = param.data.clone()
    return model


def features(lengths, seed=0):
    """Log-mel features of random clips (the feature extractor's, itself checked above)."""
    return process_audio_gemma3n(clips(lengths, seed=seed))


def audio_prompts(num_soft: int = 188, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, each text + boa + the clip's placeholders + eoa + text; the second left-padded."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for width in (6, 3):
        head = torch.randint(3, 250, (width,), generator=gen).tolist()
        tail = torch.randint(3, 250, (4,), generator=gen).tolist()
        rows.append(head + [BOA] + [AUDIO] * num_soft + [EOA] + tail)
    length = max(len(r) for r in rows)
    ids = torch.zeros(2, length, dtype=torch.long)
    mask = torch.zeros(2, length, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, length - len(row) :] = torch.tensor(row)
        mask[b, length - len(row) :] = 1
    return ids, mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encoder_equals_transformers(checkpoint, dtype):
    ref = reference_model(checkpoint, dtype)
    model = torchgemma.load(checkpoint, dtype=dtype, attention="eager")
    # Three clips of one batch: whole, half padded, mostly padded (several attention chunks each).
    mel = torch.randn(3, 160, 128, generator=torch.Generator().manual_seed(1))
    valid = torch.ones(3, 160, dtype=torch.bool)
    valid[1, 80:] = False
    valid[2, 9:] = False
    with torch.no_grad():
        expected = ref.model.audio_tower(mel, ~valid)
        got, got_valid = model.audio_tower(mel, valid)
        expected_soft = ref.model.get_audio_features(mel, ~valid).pooler_output
        got_soft = model.language_model.embed_audio.soft(got)
    assert torch.equal(got_valid, ~expected.audio_mel_mask)
    assert got.dtype == expected.last_hidden_state.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 0.0
    assert (got.float() - expected.last_hidden_state.float()).abs().max().item() <= tolerance
    assert (got_soft.float() - expected_soft.float()).abs().max().item() <= tolerance


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logits_with_audio_equal_transformers(checkpoint, dtype):
    ref = aligned_reference(checkpoint, dtype)
    model = torchgemma.load(checkpoint, dtype=dtype, attention="eager")
    ids, mask = audio_prompts(seed=3)
    audio = features([16000, 7000], seed=4)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate numbers left-padded rows
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask, position_ids=positions, **audio).logits
        got = model(ids, mask, **audio)
    real = mask.bool()
    tolerance = 1e-5 if dtype == torch.float32 else 0.0
    assert (got[real].float() - expected[real].float()).abs().max().item() <= tolerance


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_with_audio_equals_transformers(gen_checkpoint, dtype):
    ref = aligned_reference(gen_checkpoint, dtype)
    model = torchgemma.load(gen_checkpoint, dtype=dtype, attention="eager")
    ids, mask = audio_prompts(seed=5)
    audio = features([12000, 20000], seed=6)
    with torch.no_grad():
        expected = ref.generate(
            input_ids=ids, attention_mask=mask, **audio, max_new_tokens=8, do_sample=False, eos_token_id=None
        )
    media = MediaInputs.from_dict(audio)
    got = generate(model, ids, attention_mask=mask, media=media, max_new_tokens=8, stop_token_ids=[])
    assert got.tolist() == expected.tolist()
    assert len(set(got[:, ids.shape[1] :].flatten().tolist())) > 1  # the continuation varies


def test_audio_errors_are_named(checkpoint):
    model = torchgemma.load(checkpoint)
    ids, mask = audio_prompts(seed=7)
    audio = features([16000], seed=8)
    with pytest.raises(ValueError, match="audio features and audio tokens do not match"):
        model(ids, mask, **audio)  # one clip, two rows of placeholders
    with pytest.raises(ValueError, match="input_features_mask"):
        model(ids[:1], mask[:1], input_features=audio["input_features"])
    with pytest.raises(ValueError, match="audio features must be"):
        model(
            ids[:1],
            mask[:1],
            input_features=audio["input_features"][..., :16],
            input_features_mask=audio["input_features_mask"],
        )
    too_long = {
        "input_features": torch.zeros(1, 3100, 128),
        "input_features_mask": torch.ones(1, 3100, dtype=torch.bool),
    }
    with pytest.raises(ValueError, match="more than the 188 placeholders"):
        model(ids[:1], mask[:1], **too_long)
    with pytest.raises(ValueError, match="the prompt has 0 image placeholder tokens"):
        model(ids[:1], mask[:1], pixel_values=torch.zeros(1, 3, 32, 32), **features([16000], seed=8))


# ── the processor's prompts, LLM ────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def llm_folder(tmp_path_factory):
    """A gemma3n checkpoint with the fixture tokenizer; its media ids are the tokenizer's."""
    from tokenizer_fixtures import VOCAB_SIZE, write_gemma4_tokenizer

    folder = tmp_path_factory.mktemp("gemma3n-llm") / "ckpt"
    write_gemma4_tokenizer(folder)
    tok = torchgemma.load_tokenizer(folder)
    ids = dict(boa_token_id=tok.audio_start_id, audio_token_id=tok.audio_id, eoa_token_id=tok.audio_end_id)
    build(
        folder,
        multimodal=True,
        seed=63,
        embed_scale=0.1,
        token_ids=ids,
        vocab_size=VOCAB_SIZE,
        vocab_size_per_layer_input=VOCAB_SIZE - 40,
    )
    return folder


def reference_processor(folder):
    from transformers import AutoTokenizer, Gemma3nAudioFeatureExtractor, Gemma3nProcessor
    from transformers.models.siglip import SiglipImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return Gemma3nProcessor(
        feature_extractor=Gemma3nAudioFeatureExtractor(),
        image_processor=SiglipImageProcessorPil(),
        tokenizer=tokenizer,
        chat_template=(folder / "chat_template.jinja").read_text(),
    )


# The clip first: the processor's "\n\n" follows the template's "user\n" (the tokenizer splits "\n\n\n").
MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "audio", "audio": clips([9000], seed=11)[0]},
            {"type": "text", "text": "What is said?"},
        ],
    }
]


def test_llm_chat_inputs_equal_the_processor(llm_folder):
    llm = torchgemma.LLM(llm_folder, progress=False)
    processor = reference_processor(llm_folder)
    ours = llm.chat_inputs(MESSAGES)
    theirs = processor.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert ours["input_ids"].tolist() == theirs["input_ids"].tolist()
    assert (ours["input_ids"] == llm.tokenizer.audio_id).sum() == 188
    assert torch.equal(ours["input_features"], theirs["input_features"])
    assert torch.equal(ours["input_features_mask"], theirs["input_features_mask"])


def test_llm_raw_prompt_inputs_equal_the_processor(llm_folder):
    llm = torchgemma.LLM(llm_folder, progress=False)
    processor = reference_processor(llm_folder)
    waves = clips([7000, 12000], seed=12)
    prompt = "<bos>First\n<|audio|> then<|audio|>\nsecond"
    ours = llm.inputs([llm.encode(prompt, waves)], audio=waves)
    theirs = processor(text=[prompt], audio=waves, return_tensors="pt")
    assert ours["input_ids"].tolist() == theirs["input_ids"].tolist()
    assert torch.equal(ours["input_features"], theirs["input_features"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llm_chat_with_audio_generates_like_transformers(llm_folder, dtype):
    llm = torchgemma.LLM(llm_folder, dtype=dtype, attention="eager", progress=False)
    processor = reference_processor(llm_folder)
    ref = aligned_reference(llm_folder, dtype)
    inputs = processor.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    inputs.pop("token_type_ids", None)
    with torch.no_grad():
        expected = ref.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None)
    expected = expected[0, inputs["input_ids"].shape[1] :].tolist()
    got = llm.chat(MESSAGES, max_new_tokens=8, stop_token_ids=[])
    assert list(got.token_ids) == expected
    assert len(set(expected)) > 1


def test_llm_refuses_unexpanded_prompts(llm_folder):
    llm = torchgemma.LLM(llm_folder, progress=False)
    with pytest.raises(ValueError, match="188 each"):
        llm.inputs([llm.encode("<|audio|>")], audio=clips([4000]))


def test_cli_generate_with_audio_equals_transformers(llm_folder, tmp_path, capsys):
    import json
    import wave

    from torchgemma.cli import main
    from torchgemma.processing.audio import load_audio

    path = tmp_path / "clip.wav"
    samples = (clips([8000], seed=13)[0].clip(-1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(16000)
        file.writeframes(samples.tobytes())
    argv = ["generate", "--model", str(llm_folder), "--audio", str(path), "--temperature", "0"]
    assert main([*argv, "--max-new-tokens", "6", "--json", "Say:"]) == 0
    got = json.loads(capsys.readouterr().out)["token_ids"]

    processor = reference_processor(llm_folder)
    inputs = processor(text=["<bos>Say:<|audio|>"], audio=[load_audio(path)[0]], return_tensors="pt")
    inputs.pop("token_type_ids", None)
    with torch.no_grad():
        expected = aligned_reference(llm_folder, torch.float32).generate(
            **inputs, max_new_tokens=6, do_sample=False, eos_token_id=None
        )
    assert got == expected[0, inputs["input_ids"].shape[1] :].tolist()[: len(got)]
    assert len(got) > 0


def test_llm_reads_the_feature_extractor_config(llm_folder, tmp_path):
    """Per-bin normalisation from preprocessor_config.json, as the processor loaded from the folder;
    settings computed otherwise are refused by name."""
    import json
    import shutil

    from transformers import Gemma3nAudioFeatureExtractor

    folder = tmp_path / "normalised"
    shutil.copytree(llm_folder, folder)
    rng = np.random.default_rng(14)
    extractor = Gemma3nAudioFeatureExtractor(
        per_bin_mean=rng.standard_normal(128), per_bin_stddev=rng.random(128) + 0.5
    )
    extractor.save_pretrained(folder)
    llm = torchgemma.LLM(folder, progress=False)
    waves = clips([6000], seed=15)
    ours = llm.inputs([llm.encode("<|audio|>", waves)], audio=waves)
    theirs = Gemma3nAudioFeatureExtractor.from_pretrained(folder)(waves, return_tensors="pt")
    assert torch.equal(ours["input_features"], theirs["input_features"])

    config = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**config, "dither": 1e-4}))
    with pytest.raises(ValueError, match="dither is 0.0001"):
        llm.inputs([llm.encode("<|audio|>", waves)], audio=waves)


def test_server_chat_and_transcription_with_audio(llm_folder):
    """The server renders Gemma 3n's audio placeholder expanded, as LLM.chat does: a chat with
    input_audio and a transcription reply what the library replies to the same conversation."""
    import base64
    import io
    import wave

    import openai

    from serving_fixtures import content_of, running_server
    from torchgemma.serving.app import create_app
    from torchgemma.serving.audio import TRANSCRIBE_PROMPT

    llm = torchgemma.LLM(llm_folder, progress=False)
    samples = (clips([9000], seed=17)[0].clip(-1, 1) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(samples.tobytes())
    wav = buffer.getvalue()
    heard = samples / 32768.0
    with running_server(create_app(llm, model_name="g3n", max_len=512)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        audio_part = {
            "type": "input_audio",
            "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"},
        }
        reply = client.chat.completions.create(
            model="g3n",
            messages=[{"role": "user", "content": [audio_part, {"type": "text", "text": "What is said?"}]}],
            temperature=0,
            max_tokens=6,
        )
        expected = llm.chat(
            [
                {
                    "role": "user",
                    "content": [{"type": "audio", "audio": heard}, {"type": "text", "text": "What is said?"}],
                }
            ],
            temperature=0,
            max_new_tokens=6,
        )
        assert reply.choices[0].message.content == content_of(llm, expected.token_ids)
        assert reply.usage.completion_tokens == len(expected.token_ids)
        transcript = client.audio.transcriptions.create(model="g3n", file=("clip.wav", wav, "audio/wav"))
        messages = [
            {
                "role": "user",
                "content": [{"type": "audio", "audio": heard}, {"type": "text", "text": TRANSCRIBE_PROMPT}],
            }
        ]
        prompt = int(llm.chat_inputs(messages)["attention_mask"].sum())
        spoken = llm.chat(messages, temperature=0, max_new_tokens=min(448, 512 - prompt))
        assert transcript.text == content_of(llm, spoken.token_ids)

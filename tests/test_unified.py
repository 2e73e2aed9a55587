"""Gemma 4 12B "unified" (gemma4_unified): parity with transformers 5.23 on tiny random checkpoints.

Text-only logits (fp32 to 1e-5, bf16 to the bit) and greedy generation of the text decoder, then
logits with images (transformers' own image processor) and raw-audio frames in the prompt.
"""

from __future__ import annotations

import pytest
import torch

import torchgemma
from checkpoints import (
    COMMON,
    NEW,
    TINY_TOKEN_IDS,
    UNIFIED_STYLES,
    WIDTH,
    assert_match,
    padded_batch,
    padded_prompts,
    randomize_,
    reference_logits,
    transformers_generate_alone,
)
from torchgemma.config import ModelConfig
from torchgemma.generation import SamplingParams, generate
from torchgemma.model.inputs import MediaInputs

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = [torch.float32, torch.bfloat16]

# Decoder styles: checkpoints.UNIFIED_STYLES (the 12B's own, and one with KV sharing).
# 4 px patches merged 2x2: 8 px model patches of 192 values; output_proj_dims must equal mm_embed_dim.
TINY_UNIFIED_VISION = dict(
    patch_size=4, pooling_kernel_size=2, mm_embed_dim=40, mm_posemb_size=16, output_proj_dims=40
)
TINY_UNIFIED_AUDIO = dict(audio_embed_dim=24)


def unified_text_config(style: str):
    from transformers import Gemma4UnifiedTextConfig

    return Gemma4UnifiedTextConfig(**COMMON, **UNIFIED_STYLES[style])


def build_unified_checkpoint(folder, style: str, *, seed: int, text_only: bool = False, embed_scale=1.0):
    """``gemma4_unified_text`` (Gemma4UnifiedForCausalLM) or ``gemma4_unified`` with both embedders."""
    from transformers import (
        Gemma4UnifiedAudioConfig,
        Gemma4UnifiedConfig,
        Gemma4UnifiedForCausalLM,
        Gemma4UnifiedForConditionalGeneration,
        Gemma4UnifiedVisionConfig,
    )

    torch.manual_seed(seed)
    if text_only:
        model = Gemma4UnifiedForCausalLM(unified_text_config(style))
        table = model.model.embed_tokens
    else:
        config = Gemma4UnifiedConfig(
            text_config=unified_text_config(style).to_dict(),
            vision_config=Gemma4UnifiedVisionConfig(**TINY_UNIFIED_VISION).to_dict(),
            audio_config=Gemma4UnifiedAudioConfig(**TINY_UNIFIED_AUDIO).to_dict(),
            **TINY_TOKEN_IDS,
        )
        model = Gemma4UnifiedForConditionalGeneration(config)
        table = model.model.language_model.embed_tokens
    randomize_(model, seed)  # LayerNorm biases and the position table included
    with torch.no_grad():
        table.weight.mul_(embed_scale)
    model.save_pretrained(folder)
    return folder


def reference(folder, dtype):
    from transformers import AutoModelForCausalLM, Gemma4UnifiedForConditionalGeneration

    cls = AutoModelForCausalLM
    if 'gemma4_unified"' in (folder / "config.json").read_text().replace(" ", ""):
        cls = Gemma4UnifiedForConditionalGeneration
    return cls.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def unified_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("unified")
    folders = {}
    for i, style in enumerate(UNIFIED_STYLES):
        folders[style, "text"] = build_unified_checkpoint(
            root / f"{style}-text", style, seed=40 + i, text_only=True
        )
        folders[style, "mm"] = build_unified_checkpoint(root / f"{style}-mm", style, seed=50 + i)
    return folders


def test_config_reads_unified(unified_checkpoints):
    config = ModelConfig.from_file(unified_checkpoints["12b", "mm"])
    assert config.model_type == "gemma4_unified"
    text = config.text
    assert not text.has_per_layer_inputs and not text.enable_moe_block
    assert text.use_bidirectional_attention == "vision" and text.vision_block_layers == "all"
    assert [layer.k_eq_v for layer in text.layers] == [False] * 5 + [True]
    assert (text.layers[5].head_dim, text.layers[5].num_kv_heads) == (32, 1)
    assert config.unified_vision.model_patch_size == 8 and config.unified_vision.mm_embed_dim == 40
    assert config.unified_audio.audio_embed_dim == 24
    assert config.vision_config is None and config.audio_config is None
    assert config.token_ids["image_token_id"] == TINY_TOKEN_IDS["image_token_id"]
    # Gemma4UnifiedTextConfig's own defaults where the json is silent.
    bare = ModelConfig.from_hf(
        {
            "model_type": "gemma4_unified_text",
            **{k: v for k, v in COMMON.items() if k != "sliding_window"},
            "num_hidden_layers": 6,
            "num_key_value_heads": 2,
            "final_logit_softcapping": None,
        }
    )
    assert bare.text.sliding_window == 1024 and bare.text.final_logit_softcapping is None
    assert bare.text.use_bidirectional_attention == "vision"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["text", "mm"])
@pytest.mark.parametrize("style", list(UNIFIED_STYLES))
def test_text_logits_match_transformers(unified_checkpoints, style, layout, dtype):
    folder = unified_checkpoints[style, layout]
    ref = reference(folder, dtype)
    model = torchgemma.load(folder, dtype=dtype, attention="eager")
    ids, mask = padded_batch(seed=7)
    with torch.no_grad():
        ours = model(ids, attention_mask=mask)
        ours_unpadded = model(ids[:1])
        theirs_unpadded = ref(input_ids=ids[:1]).logits
    assert_match(ours, reference_logits(ref, ids, mask), dtype)
    assert_match(ours_unpadded, theirs_unpadded, dtype)


@pytest.fixture(scope="module")
def unified_gen_checkpoints(tmp_path_factory):
    """Small embeddings, so that greedy continuations vary (see conftest.gen_checkpoints)."""
    root = tmp_path_factory.mktemp("unified-gen")
    return {
        style: build_unified_checkpoint(
            root / style, style, seed=60 + 2 * i, text_only=True, embed_scale=0.05
        )
        for i, style in enumerate(UNIFIED_STYLES)
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", list(UNIFIED_STYLES))
def test_greedy_matches_transformers(unified_gen_checkpoints, style, dtype):
    folder = unified_gen_checkpoints[style]
    ref = reference(folder, dtype)
    model = torchgemma.load(folder, dtype=dtype, attention="eager")
    ids, mask = padded_prompts(seed=70)
    greedy = SamplingParams(temperature=0)
    ours = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, sampling=greedy, stop_token_ids=[])
    # Each row against transformers' run of its prompt alone (see transformers_generate_alone).
    theirs = transformers_generate_alone(
        ref, ids, mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None
    )
    assert torch.equal(ours, theirs), f"\nours   {ours[:, WIDTH:]}\ntheirs {theirs[:, WIDTH:]}"
    assert all(len(set(row)) >= 5 for row in ours[:, WIDTH:].tolist()), "degenerate continuation"


# The 12B's text config as third-party copies of the hub config.json give it (reference notes §6.2:
# 48 layers, width 3840, MLP 15360, 16 heads, 8 KV heads, 1 global KV head, head_dim 256/512, K=V,
# window 1024); transformers' Gemma4UnifiedTextConfig defaults (2304 wide, 30 layers) are not the
# 12B's. Layer pattern: the default 5:1. Vision and audio: the sub-configs' own defaults.
UNIFIED_12B_TEXT = dict(
    vocab_size=262144,
    hidden_size=3840,
    intermediate_size=15360,
    num_hidden_layers=48,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_global_key_value_heads=1,
    head_dim=256,
    global_head_dim=512,
    attention_k_eq_v=True,
    sliding_window=1024,
    final_logit_softcapping=30.0,
    use_bidirectional_attention="vision",
    max_position_embeddings=262144,
)


def test_12b_parameter_count_matches_transformers():
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration

    from torchgemma.info import describe

    data = {
        "model_type": "gemma4_unified",
        "text_config": dict(UNIFIED_12B_TEXT, model_type="gemma4_unified_text"),
        "vision_config": {"model_type": "gemma4_unified_vision"},
        "audio_config": {"model_type": "gemma4_unified_audio"},
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
    }
    info = describe(ModelConfig.from_hf(data))
    with torch.device("meta"):
        ref = Gemma4UnifiedForConditionalGeneration(
            Gemma4UnifiedConfig(text_config=UNIFIED_12B_TEXT, vision_config={}, audio_config={})
        )
    by_tower = {"language_model": 0, "vision": 0, "audio": 0}
    for name, p in ref.named_parameters():  # the tied head is listed once, under the embeddings
        tower = "vision" if "embed_vision" in name else "audio" if "embed_audio" in name else "language_model"
        by_tower[tower] += p.numel()
    assert info["params_by_tower"] == by_tower
    assert info["params_total"] == sum(by_tower.values()) == 11_959_730_176
    assert (info["sliding_layers"], info["full_layers"]) == (40, 8)


def media_prompt(seed: int, image_tokens: list[int], audio_tokens: int, length: int = 40):
    """(1, T) ids: text, then each image as boi + placeholders + eoi, then boa + audio + eoa, text;
    and transformers' mm_token_type_ids for it (1 image, 3 audio, 0 text)."""
    gen = torch.Generator().manual_seed(seed)
    ids = [int(t) for t in torch.randint(3, 250, (6,), generator=gen)]
    types = [0] * len(ids)
    t = TINY_TOKEN_IDS
    for n in image_tokens:
        ids += [t["boi_token_id"]] + [t["image_token_id"]] * n + [t["eoi_token_id"]]
        types += [0] + [1] * n + [0]
    if audio_tokens:
        ids += [t["boa_token_id"]] + [t["audio_token_id"]] * audio_tokens + [t["eoa_token_index"]]
        types += [0] + [3] * audio_tokens + [0]
    tail = [int(x) for x in torch.randint(3, 250, (max(length - len(ids), 4),), generator=gen)]
    return torch.tensor([ids + tail]), torch.tensor([types + [0] * len(tail)])


def reference_image_functions():
    """transformers' gemma4_unified patchify and merge functions. Their module imports torchvision
    (for the resize alone), which this environment lacks: a stub stands in for it at import time."""
    import importlib
    import sys
    import types

    name = "transformers.models.gemma4_unified.image_processing_gemma4_unified"
    if name not in sys.modules and importlib.util.find_spec("torchvision") is None:
        stubs = {}
        for module in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2"):
            stubs[module] = types.ModuleType(module)
        functional = types.ModuleType("functional")
        functional.InterpolationMode = object  # only read in an annotation
        stubs["torchvision.transforms.v2"].functional = functional
        saved = {k: sys.modules.get(k) for k in stubs}
        sys.modules.update(stubs)
        try:
            module = importlib.import_module(name)
        finally:
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v
    else:
        module = importlib.import_module(name)
    return module


def tiny_images(max_soft_tokens: int = 70):
    """Two images of different sizes and aspect ratios in transformers' layout: its processor's
    steps after the resize (sizes already multiples of the 8 px model patch), by its own functions
    (rescale to [0, 1], patchify, merge 2x2, pad to max_soft_tokens with (-1, -1) positions)."""
    ref = reference_image_functions()
    gen = torch.Generator().manual_seed(5)
    pixels, positions, counts = [], [], []
    for height, width in ((32, 48), (56, 24)):
        image = torch.randint(0, 256, (3, height, width), generator=gen).float() / 255
        patches = ref.convert_image_to_patches(image, 4)
        grid = torch.meshgrid(torch.arange(width // 4), torch.arange(height // 4), indexing="xy")
        where = torch.stack(grid, dim=-1).reshape(patches.shape[0], 2)
        merged, merged_where = ref.patches_merge(patches[None], where[None], patches.shape[0] // 4)
        counts.append(merged.shape[1])
        merged, merged_where = ref.pad_along_first_dim(merged[0], merged_where[0], max_soft_tokens)
        pixels.append(merged)
        positions.append(merged_where)
    return torch.stack(pixels), torch.stack(positions), counts


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", list(UNIFIED_STYLES))
def test_media_logits_match_transformers(unified_checkpoints, style, dtype):
    """Images (bidirectional blocks on every layer) and raw audio frames in the prompt."""
    folder = unified_checkpoints[style, "mm"]
    ref = reference(folder, dtype)
    model = torchgemma.load(folder, dtype=dtype, attention="eager")
    pixels, positions, counts = tiny_images()
    assert all(n < 70 for n in counts)
    gen = torch.Generator().manual_seed(8)
    features = torch.randn(2, 7, TINY_UNIFIED_AUDIO["audio_embed_dim"], generator=gen)
    features_mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    ids, types = media_prompt(seed=3, image_tokens=counts, audio_tokens=11)
    inputs = dict(
        pixel_values=pixels,
        image_position_ids=positions,
        input_features=features,
        input_features_mask=features_mask,
        mm_token_type_ids=types,
    )
    with torch.no_grad():
        theirs = ref(input_ids=ids, **inputs).logits
        ours = model(ids, **inputs)
        text_only = ref(input_ids=ids).logits
    assert_match(ours, theirs, dtype)
    # The media really change the logits (and the blocks the mask): not a vacuous comparison.
    assert not torch.equal(theirs, text_only)
    with torch.no_grad():
        causal = ref(input_ids=ids, **{k: v for k, v in inputs.items() if k != "mm_token_type_ids"}).logits
    assert not torch.equal(theirs, causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", list(UNIFIED_STYLES))
def test_greedy_with_media_matches_transformers(tmp_path, style, dtype):
    """Prefill through the cache with image blocks on every layer (full layers' keys included),
    then decoding without them, as transformers' generate() does with its default cache."""
    folder = build_unified_checkpoint(tmp_path / style, style, seed=80, embed_scale=0.05)
    ref = reference(folder, dtype)
    model = torchgemma.load(folder, dtype=dtype, attention="eager")
    pixels, positions, counts = tiny_images()
    gen = torch.Generator().manual_seed(9)
    features = torch.randn(1, 6, TINY_UNIFIED_AUDIO["audio_embed_dim"], generator=gen)
    features_mask = torch.tensor([[True] * 5 + [False]])
    ids, types = media_prompt(seed=4, image_tokens=counts, audio_tokens=5)
    inputs = dict(
        pixel_values=pixels,
        image_position_ids=positions,
        input_features=features,
        input_features_mask=features_mask,
        mm_token_type_ids=types,
    )
    ours = generate(
        model,
        ids,
        max_new_tokens=NEW,
        sampling=SamplingParams(temperature=0),
        stop_token_ids=[],
        media=MediaInputs(**inputs),
    )
    with torch.no_grad():
        theirs = ref.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, **inputs)
    width = ids.shape[1]
    assert torch.equal(ours, theirs), f"\nours   {ours[:, width:]}\ntheirs {theirs[:, width:]}"
    assert len(set(ours[0, width:].tolist())) >= 5, "degenerate continuation"


def test_audio_frames_match_transformers_feature_extractor():
    import numpy as np
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
        Gemma4UnifiedAudioFeatureExtractor,
    )

    from torchgemma.processing.unified import frame_audio

    rng = np.random.default_rng(0)
    # A partial last frame, an exact multiple of 640, a clip shorter than one frame; float64 input.
    clips = [rng.standard_normal(1500), rng.standard_normal(1280).astype(np.float32), rng.standard_normal(90)]
    theirs = Gemma4UnifiedAudioFeatureExtractor()(clips, return_tensors="pt")
    ours = frame_audio(clips)
    assert ours["input_features"].dtype == theirs["input_features"].dtype
    assert torch.equal(ours["input_features"], theirs["input_features"])
    assert torch.equal(ours["input_features_mask"], theirs["input_features_mask"])
    one = frame_audio(torch.from_numpy(clips[0]))
    assert torch.equal(
        one["input_features"],
        Gemma4UnifiedAudioFeatureExtractor()(clips[0], return_tensors="pt")["input_features"],
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["text", "mm"])
def test_default_sdpa_matches_transformers_sdpa(unified_checkpoints, layout, dtype):
    """Our default backend (sdpa) against transformers' default (sdpa): the same logits to the bit,
    without media (unpadded and left-padded) and with images and audio (bidirectional blocks)."""
    from transformers import AutoModelForCausalLM, Gemma4UnifiedForConditionalGeneration

    folder = unified_checkpoints["12b", layout]
    cls = Gemma4UnifiedForConditionalGeneration if layout == "mm" else AutoModelForCausalLM
    ref = cls.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()
    model = torchgemma.load(folder, dtype=dtype)
    assert model.attention == "sdpa"
    ids, mask = padded_batch(seed=7)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # what generate() passes
    real = mask.bool()
    with torch.no_grad():
        assert torch.equal(model(ids[:1]), ref(input_ids=ids[:1]).logits)
        theirs = ref(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert torch.equal(model(ids, attention_mask=mask)[real], theirs[real])
    if layout == "mm":
        pixels, positions, counts = tiny_images()
        features = torch.randn(
            1, 7, TINY_UNIFIED_AUDIO["audio_embed_dim"], generator=torch.Generator().manual_seed(8)
        )
        ids, types = media_prompt(seed=3, image_tokens=counts, audio_tokens=7)
        inputs = dict(
            pixel_values=pixels,
            image_position_ids=positions,
            input_features=features,
            input_features_mask=torch.ones(1, 7, dtype=torch.bool),
            mm_token_type_ids=types,
        )
        with torch.no_grad():
            assert torch.equal(model(ids, **inputs), ref(input_ids=ids, **inputs).logits)

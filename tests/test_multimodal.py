"""Multimodal logits parity with transformers 5.23's Gemma4ForConditionalGeneration (eager attention).

Two tiny random checkpoints built by transformers:

* E2B-like: PLE + KV sharing, on-device vision tower and audio conformer with clip bounds that
  clamp; inputs from our own ``process_images`` / ``process_audio``.
* 31B-like: K=V text, ``use_bidirectional_attention="vision"``, large-style vision tower
  (standardised, no clipping); pixel inputs built by hand in the processor's layout, with padding.

Prompts are laid out as the processor expands them: ``<|image>`` + n × ``<|image|>`` + ``<image|>``.
"""

import numpy as np
import pytest
import torch

import torchgemma
from checkpoints import (
    LARGE_VISION,
    TINY_TOKEN_IDS,
    build_large_vision_checkpoint,
    build_omni_checkpoint,
    reference_model,
)
from torchgemma import process_audio, process_images
from torchgemma.model.multimodal import vision_block_ids

DTYPES = [torch.float32, torch.bfloat16]
IDS = {k.split("_token")[0]: v for k, v in TINY_TOKEN_IDS.items()}
TYPE_OF = {"image": 1, "video": 2, "audio": 3}


@pytest.fixture(scope="module")
def omni_checkpoint(tmp_path_factory):
    return build_omni_checkpoint(tmp_path_factory.mktemp("omni") / "e2b-omni", seed=21)


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory):
    return build_large_vision_checkpoint(tmp_path_factory.mktemp("large") / "31b-vision", seed=22)


def build_prompts(rows, seed):
    """rows: per row a list of ints (that many random text tokens) or (kind, n) soft-token runs.

    Returns input_ids, attention_mask (left padding) and mm_token_type_ids, as the processor does.
    """
    gen = torch.Generator().manual_seed(seed)
    ids_rows, type_rows = [], []
    for row in rows:
        ids, types = [], []
        for part in row:
            if isinstance(part, int):
                ids += torch.randint(3, 250, (part,), generator=gen).tolist()
                types += [0] * part
            else:
                kind, n = part
                start, end = ("boa", "eoa") if kind == "audio" else ("boi", "eoi")
                ids += [IDS[start]] + [IDS[kind]] * n + [IDS[end]]
                types += [0] + [TYPE_OF[kind]] * n + [0]
        ids_rows.append(ids)
        type_rows.append(types)
    length = max(len(r) for r in ids_rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    types = torch.zeros(len(rows), length, dtype=torch.long)
    for i, (r, t) in enumerate(zip(ids_rows, type_rows)):
        input_ids[i, length - len(r) :] = torch.tensor(r)
        mask[i, length - len(r) :] = 1
        types[i, length - len(t) :] = torch.tensor(t)
    return input_ids, mask, types


def reference_logits(ref, inputs):
    # Positions follow the mask, as in transformers' generate().
    mask = inputs["attention_mask"]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        return ref(**inputs, position_ids=positions).logits


def max_diff(ours, ref):
    return (ours.float() - ref.float()).abs().max().item()


def assert_match(ours, ref, dtype, case):
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    diff = max_diff(ours, ref)
    print(f"{case} {dtype}: max |Δ| = {diff:.3g}")
    if dtype == torch.bfloat16:
        assert torch.equal(ours, ref), f"{case}: bf16 differs, max |Δ| = {diff}"
    else:
        assert diff <= 1e-5, case


# ── E2B-like: images and audio through our own processors ─────────────────────────────────────


def omni_inputs():
    rng = np.random.default_rng(7)
    images = [
        rng.integers(0, 256, (60, 90, 3), dtype=np.uint8),
        rng.integers(0, 256, (100, 40, 3), dtype=np.uint8),
    ]
    image_inputs = process_images(images, max_soft_tokens=70)
    # Three clips of different lengths in one batch (0.5 s, 1 s, 0.3 s).
    clips = [0.1 * rng.standard_normal(n).astype(np.float32) for n in (8000, 16000, 5000)]
    audio_inputs = process_audio(clips)
    # Soft tokens per clip: valid frames at indices divisible by 4 (two stride-2 convolutions).
    audio_tokens = audio_inputs["input_features_mask"][:, ::4].sum(-1).tolist()
    n1, n2 = image_inputs["num_soft_tokens"]
    a1, a2, a3 = audio_tokens
    assert len(set(audio_tokens)) == 3
    input_ids, mask, types = build_prompts(
        [
            [3, ("image", n1), 4, ("audio", a1), 2, ("image", n2), 3],
            [2, ("audio", a2), 5, ("audio", a3), 6],
        ],
        seed=1,
    )
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "pixel_values": image_inputs["pixel_values"],
        "image_position_ids": image_inputs["image_position_ids"],
        "input_features": audio_inputs["input_features"],
        "input_features_mask": audio_inputs["input_features_mask"],
        "mm_token_type_ids": types,
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_e2b_images_and_audio_match_transformers(omni_checkpoint, dtype):
    ref = reference_model(omni_checkpoint, dtype)
    model = torchgemma.load(omni_checkpoint, dtype=dtype, attention="eager")
    inputs = omni_inputs()
    with torch.no_grad():
        ours = model(**inputs)
        # generate()'s prefill: only the last position, which alone goes through the KV-shared layers.
        last = model(**inputs, logits_to_keep=1)
    assert_match(ours, reference_logits(ref, inputs), dtype, "e2b images+audio")
    assert_match(last, reference_logits(ref, {**inputs, "logits_to_keep": 1}), dtype, "e2b keep 1")


def test_e2b_clip_bounds_clamp(omni_checkpoint):
    """The bounds are tight enough that both towers clamp inputs and outputs of their linears."""
    ref = reference_model(omni_checkpoint)
    clamped = {"vision_in": 0, "vision_out": 0, "audio_in": 0, "audio_out": 0}
    hooks = []
    for name, module in ref.model.named_modules():
        if type(module).__name__ != "Gemma4ClippableLinear":
            continue
        tower = "vision" if "vision_tower" in name else "audio"

        def count_in(mod, args, tower=tower):
            x = args[0]
            clamped[f"{tower}_in"] += int(((x < mod.input_min) | (x > mod.input_max)).sum())

        def count_out(lin, args, out, mod=module, tower=tower):
            clamped[f"{tower}_out"] += int(((out < mod.output_min) | (out > mod.output_max)).sum())

        hooks.append(module.register_forward_pre_hook(count_in))
        hooks.append(module.linear.register_forward_hook(count_out))
    reference_logits(ref, omni_inputs())
    for hook in hooks:
        hook.remove()
    assert all(count > 0 for count in clamped.values()), clamped


def test_e2b_text_only_and_cached_decode(omni_checkpoint):
    """A prompt with media, then decode steps through the cache: equal to one uncached forward."""
    model = torchgemma.load(omni_checkpoint, dtype=torch.float32, attention="eager")
    inputs = omni_inputs()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    extra = torch.randint(3, 250, (2, 3), generator=torch.Generator().manual_seed(0))
    full = {
        **inputs,
        "input_ids": torch.cat((ids, extra), 1),
        "attention_mask": torch.cat((mask, torch.ones_like(extra)), 1),
    }
    full["mm_token_type_ids"] = torch.cat((inputs["mm_token_type_ids"], torch.zeros_like(extra)), 1)
    with torch.no_grad():
        whole = model(**full)
        cache = model.make_cache(2, full["input_ids"].shape[1])
        steps = [model(**inputs, cache=cache)]
        for t in range(extra.shape[1]):
            steps.append(model(extra[:, t : t + 1], cache=cache))
    valid = full["attention_mask"].bool()  # padding positions attend to nothing real
    # Decode steps run other matmul shapes than the full forward (and the padded row's cached keys
    # leave its padding out): float32 rounding only, as test_cache's float64 check shows.
    torch.testing.assert_close(torch.cat(steps, 1)[valid], whole[valid], rtol=0, atol=5e-4)


def test_soft_token_count_mismatch_is_named(omni_checkpoint):
    model = torchgemma.load(omni_checkpoint, attention="eager")
    inputs = omni_inputs()
    inputs["input_ids"] = inputs["input_ids"].clone()
    first = int((inputs["input_ids"][0] == IDS["image"]).nonzero()[0, 0])
    inputs["input_ids"][0, first] = 7  # one image placeholder fewer than soft tokens
    with pytest.raises(ValueError, match=r"the prompt has 124 image placeholder tokens but .* give 125"):
        model(**inputs)
    audio_only = {k: v for k, v in omni_inputs().items() if k != "input_features_mask"}
    with pytest.raises(ValueError, match="input_features and input_features_mask go together"):
        model(**audio_only)


# ── 31B-like: large vision tower, bidirectional image blocks, hand-built patches ──────────────


def hand_built_images(grids, max_patches, seed):
    """Processor layout for (rows, cols) patch grids: row-major patches, (x, y) ids, (-1, -1) padding."""
    gen = torch.Generator().manual_seed(seed)
    p = LARGE_VISION["patch_size"]
    pixels = torch.zeros(len(grids), max_patches, 3 * p * p)
    positions = torch.full((len(grids), max_patches, 2), -1, dtype=torch.long)
    for i, (rows, cols) in enumerate(grids):
        n = rows * cols
        pixels[i, :n] = torch.rand(n, 3 * p * p, generator=gen)
        y, x = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        positions[i, :n] = torch.stack((x.flatten(), y.flatten()), -1)
    k2 = LARGE_VISION["pooling_kernel_size"] ** 2
    return pixels, positions, [rows * cols // k2 for rows, cols in grids]


def large_inputs(with_video: bool):
    # Three images of different grids (one fills the patch budget, two are padded).
    pixels, positions, tokens = hand_built_images([(4, 6), (8, 8), (2, 10)], max_patches=64, seed=3)
    rows = [
        [4, ("image", tokens[0]), 3, ("image", tokens[1]), 2],
        [6, ("image", tokens[2]), 7],
    ]
    inputs = {"pixel_values": pixels, "image_position_ids": positions}
    if with_video:
        frames, frame_positions, frame_tokens = hand_built_images([(4, 4), (4, 4)], max_patches=16, seed=4)
        rows[1] += [("video", frame_tokens[0]), 1, ("video", frame_tokens[1]), 2]
        inputs.update(
            pixel_values_videos=frames,
            video_position_ids=frame_positions,
            num_frames_per_video=torch.tensor([2]),
        )
    input_ids, mask, types = build_prompts(rows, seed=2)
    return {"input_ids": input_ids, "attention_mask": mask, "mm_token_type_ids": types, **inputs}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_types", [True, False], ids=["bidirectional", "causal"])
def test_31b_images_match_transformers(large_checkpoint, dtype, with_types):
    ref = reference_model(large_checkpoint, dtype)
    model = torchgemma.load(large_checkpoint, dtype=dtype, attention="eager")
    inputs = large_inputs(with_video=True)
    if not with_types:  # without mm_token_type_ids the masks stay causal, as in the reference
        del inputs["mm_token_type_ids"]
    with torch.no_grad():
        ours = model(**inputs)
    assert_match(
        ours, reference_logits(ref, inputs), dtype, f"31b images+video {'bidir' if with_types else 'causal'}"
    )


def test_bidirectional_blocks_change_the_logits(large_checkpoint):
    """The image-block mask is not a no-op here: with it, an image's first token sees its last."""
    model = torchgemma.load(large_checkpoint, attention="eager")
    inputs = large_inputs(with_video=False)
    with torch.no_grad():
        bidirectional = model(**inputs)
        causal = model(**{k: v for k, v in inputs.items() if k != "mm_token_type_ids"})
    image = inputs["mm_token_type_ids"] == 1
    assert max_diff(bidirectional[image], causal[image]) > 1e-3
    # Text before the first image cannot see any image either way.
    first = int(image[0].nonzero()[0, 0])
    torch.testing.assert_close(bidirectional[0, :first], causal[0, :first], rtol=0, atol=0)


def test_bidirectional_prefill_then_cached_decode(large_checkpoint):
    """Image blocks in a cached prefill, then text decode steps: equal to one uncached forward."""
    model = torchgemma.load(large_checkpoint, attention="eager")
    inputs = large_inputs(with_video=False)
    ids, mask, types = inputs["input_ids"], inputs["attention_mask"], inputs["mm_token_type_ids"]
    extra = torch.randint(3, 250, (2, 3), generator=torch.Generator().manual_seed(1))
    full = {
        **inputs,
        "input_ids": torch.cat((ids, extra), 1),
        "attention_mask": torch.cat((mask, torch.ones_like(extra)), 1),
        "mm_token_type_ids": torch.cat((types, torch.zeros_like(extra)), 1),
    }
    with torch.no_grad():
        whole = model(**full)
        cache = model.make_cache(2, full["input_ids"].shape[1])
        steps = [model(**inputs, cache=cache)]
        steps += [model(extra[:, t : t + 1], cache=cache) for t in range(extra.shape[1])]
    valid = full["attention_mask"].bool()
    torch.testing.assert_close(torch.cat(steps, 1)[valid], whole[valid], rtol=0, atol=1e-4)


def test_tower_weights_load_strictly(large_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from torchgemma import CheckpointError

    def rewrite(folder, change):
        tensors = load_file(folder / "model.safetensors")
        change(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})

    missing = shutil.copytree(large_checkpoint, tmp_path / "missing")
    rewrite(missing, lambda t: t.pop("model.vision_tower.std_scale"))
    with pytest.raises(CheckpointError, match="missing from the checkpoint: vision_tower.std_scale"):
        torchgemma.load(missing)
    extra = shutil.copytree(large_checkpoint, tmp_path / "extra")
    rewrite(extra, lambda t: t.__setitem__("model.audio_tower.output_proj.bias", torch.zeros(24)))
    with pytest.raises(CheckpointError, match="no place in the model.*model.audio_tower.output_proj.bias"):
        torchgemma.load(extra)


def test_vision_block_ids():
    types = torch.tensor([[0, 1, 1, 0, 1, 2, 2, 0, 3, 3], [1, 1, 1, 1, 0, 0, 2, 0, 1, 1]])
    expected = torch.tensor([[-1, 0, 0, -1, 1, 1, 1, -1, -1, -1], [0, 0, 0, 0, -1, -1, 1, -1, 2, 2]])
    assert torch.equal(vision_block_ids(types), expected)


def test_checkpoint_without_audio_has_no_audio_tower(large_checkpoint):
    model = torchgemma.load(large_checkpoint, attention="eager")
    assert model.config.audio_config is None
    assert not hasattr(model, "audio_tower") and not hasattr(model, "embed_audio")
    names = {n.split(".")[0] for n, _ in model.named_parameters()}
    assert names == {"language_model", "vision_tower", "embed_vision"}
    with pytest.raises(ValueError, match="no audio tower"):
        model(
            torch.tensor([[IDS["audio"]]]),
            input_features=torch.zeros(1, 8, 128),
            input_features_mask=torch.ones(1, 8, dtype=torch.bool),
        )

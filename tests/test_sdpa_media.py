"""The default attention (sdpa) with images, audio and video, against transformers 5.23's default.

transformers' default for ``Gemma4ForConditionalGeneration`` is sdpa in the text decoder and the
vision tower; its audio tower has no sdpa (``_supports_sdpa = False``) and runs eager, so the
reference there is its eager path, and ours runs its one (eager) path whatever the backend.
Checked on tiny random checkpoints of every style, built by transformers, with image blocks
longer than the sliding window (5), padded patches, a left-padded row and, on 26B/31B, image and
video-frame blocks that attend both ways on sliding layers: bf16 logits to the bit and float32 to
1e-5 (measured: 0.0 both), and greedy generation in bf16 token for token (16 tokens, > 3x the
window). Before the vision tower had an sdpa path (it always ran eager) bf16 logits differed by
0.08-1.7 and float32 by up to 8e-5, and greedy tokens parted at steps 0-12.

Decode steps take transformers' dispatch of one query over shared KV heads (packed where it packs
them): checked against its own function and on an E2B-like model at the real global head dim
(512), where before bf16 decode logits differed at a step past the window and float32 by 2.8e-5.

Run as a script (``python tests/test_sdpa_media.py``) it prints the max |Δ| of every case.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import torchgemma
from checkpoints import (
    COMMON,
    FULL,
    LARGE_VISION,
    ON_DEVICE_AUDIO,
    SLIDING,
    STYLES,
    TINY_TOKEN_IDS,
    TINY_VISION,
    randomize_,
    tighten_clip_bounds_,
)
from torchgemma import MediaInputs, generate, process_audio

DTYPES = [torch.float32, torch.bfloat16]
IDS = {k.split("_token")[0]: v for k, v in TINY_TOKEN_IDS.items()}
TYPE_OF = {"image": 1, "video": 2, "audio": 3}
NEW = 16  # greedy tokens: more than 3x the sliding window

# Tiny models gain nothing from threads (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")

# Towers per style. On-device (E2B/E4B): clip bounds that clamp; E4B's tower shares its KV heads
# (2 for 4 query heads) so that the vision attention's GQA dispatch is exercised too. 26B/31B: the
# large tower (standardised, no clipping, head dim 12).
ON_DEVICE_TINY_VISION = {**TINY_VISION, "use_clipped_linears": True, "standardize": False}
VISION = {
    "e2b": ON_DEVICE_TINY_VISION,
    "e4b": {**ON_DEVICE_TINY_VISION, "num_key_value_heads": 2},
    "26b": LARGE_VISION,
    "31b": LARGE_VISION,
}


def build_checkpoint(folder: Path, style: str, seed: int) -> Path:
    """A ``gemma4`` checkpoint of ``style`` with a vision tower (and, for E2B, an audio tower);
    26B/31B attend both ways inside image blocks. Small embeddings, so that greedy continuations
    vary rather than repeat the last token."""
    from transformers import (
        Gemma4AudioConfig,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4TextConfig,
        Gemma4VisionConfig,
    )

    text = {**COMMON, **STYLES[style]}
    if style in ("26b", "31b"):
        text["use_bidirectional_attention"] = "vision"
    config = Gemma4Config(
        text_config=Gemma4TextConfig(**text).to_dict(),
        vision_config=Gemma4VisionConfig(**VISION[style]).to_dict(),
        audio_config=Gemma4AudioConfig(**ON_DEVICE_AUDIO).to_dict() if style == "e2b" else None,
        **TINY_TOKEN_IDS,
    )
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config)
    randomize_(model, seed)
    tighten_clip_bounds_(model, seed)
    with torch.no_grad():
        model.model.language_model.embed_tokens.weight.mul_(0.05)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sdpa-media")
    return {style: build_checkpoint(root / style, style, seed=60 + i) for i, style in enumerate(STYLES)}


def reference_model(folder: Path, dtype: torch.dtype):
    """transformers' default attention: sdpa in the text decoder and the vision tower, eager in the
    audio tower (which has no sdpa); its default experts (grouped_mm), as ours."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    towers = {
        name: module.config._attn_implementation
        for name, module in model.model.named_children()
        if name.endswith(("_model", "_tower"))
    }
    expected = {"language_model": "sdpa", "vision_tower": "sdpa"}
    if "audio_tower" in towers:
        expected["audio_tower"] = "eager"
    assert towers == expected, towers
    return model.eval()


# ── inputs, laid out as the processor lays them out ──────────────────────────────────────────

IMAGE_GRIDS = [(4, 6), (6, 6), (2, 10)]  # patch grids: 6, 9 and 5 soft tokens (pooled 2x2), two padded
FRAME_GRIDS = [(4, 4), (4, 4)]  # one video of two frames, 4 soft tokens each
# Each case: two rows of text runs (ints) and media runs (kind, index into the case's media). The
# image blocks (up to 9 tokens) are longer than the sliding window (5); row 2 is left-padded.
ROWS = {
    "image": [
        [4, ("image", 0), 3, ("image", 1), 2],
        [6, ("image", 2), 7],
    ],
    "video": [
        [3, ("video", 0), 1, ("video", 1), 5],
        [2, ("image", 0), 3, ("image", 1), 4, ("image", 2), 2],
    ],
    "audio": [
        [3, ("image", 0), 4, ("audio", 0), 2, ("image", 1), 3],
        [2, ("audio", 1), 5, ("image", 2), 6],
    ],
}


def patches(style: str, grids, max_patches: int, seed: int):
    """Processor layout for (rows, cols) patch grids: row-major patches, (x, y) ids, (-1, -1)
    padding up to ``max_patches``. Returns pixels, positions and soft tokens per image."""
    vision = VISION[style]
    gen = torch.Generator().manual_seed(seed)
    p, k = vision["patch_size"], vision["pooling_kernel_size"]
    pixels = torch.zeros(len(grids), max_patches, 3 * p * p)
    positions = torch.full((len(grids), max_patches, 2), -1, dtype=torch.long)
    for i, (rows, cols) in enumerate(grids):
        n = rows * cols
        pixels[i, :n] = torch.rand(n, 3 * p * p, generator=gen)
        y, x = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        positions[i, :n] = torch.stack((x.flatten(), y.flatten()), -1)
    return pixels, positions, [rows * cols // k**2 for rows, cols in grids]


def audio_clips():
    """Two clips of different lengths (0.5 s, 0.3 s): features, mask and soft tokens per clip."""
    rng = np.random.default_rng(7)
    audio = process_audio([0.1 * rng.standard_normal(n).astype(np.float32) for n in (8000, 4800)])
    # Soft tokens per clip: valid frames at indices divisible by 4 (two stride-2 convolutions).
    tokens = audio["input_features_mask"][:, ::4].sum(-1).tolist()
    return audio["input_features"], audio["input_features_mask"], tokens


def media_inputs(style: str, case: str, rows: list[int] = (0, 1)) -> dict[str, torch.Tensor]:
    """The prompt rows ``rows`` of ``case`` with their media, as the processor gives them:
    input_ids and attention_mask (left padding), mm_token_type_ids, and each medium's tensors in
    the order the placeholders come."""
    pixels, positions, image_tokens = patches(style, IMAGE_GRIDS, max_patches=40, seed=3)
    frames, frame_positions, frame_tokens = patches(style, FRAME_GRIDS, max_patches=16, seed=4)
    media = {"image": (pixels, positions, image_tokens), "video": (frames, frame_positions, frame_tokens)}
    if case == "audio":
        media["audio"] = audio_clips()
    gen = torch.Generator().manual_seed(2)
    texts = [
        [torch.randint(3, 250, (part,), generator=gen).tolist() for part in row if isinstance(part, int)]
        for row in ROWS[case]
    ]
    id_rows, type_rows, used = [], [], {"image": [], "video": [], "audio": []}
    for r in rows:
        ids, types, words = [], [], iter(texts[r])
        for part in ROWS[case][r]:
            if isinstance(part, int):
                ids += next(words)
                types += [0] * part
                continue
            kind, index = part
            n = media[kind][2][index]
            start, end = ("boa", "eoa") if kind == "audio" else ("boi", "eoi")
            ids += [IDS[start]] + [IDS[kind]] * n + [IDS[end]]
            types += [0] + [TYPE_OF[kind]] * n + [0]
            used[kind].append(index)
        id_rows.append(ids)
        type_rows.append(types)
    length = max(map(len, id_rows))
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask, types = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    for i, (ids, kinds) in enumerate(zip(id_rows, type_rows)):
        input_ids[i, length - len(ids) :] = torch.tensor(ids)
        mask[i, length - len(ids) :] = 1
        types[i, length - len(ids) :] = torch.tensor(kinds)
    inputs = {"input_ids": input_ids, "attention_mask": mask, "mm_token_type_ids": types}
    if used["image"]:
        inputs.update(pixel_values=pixels[used["image"]], image_position_ids=positions[used["image"]])
    if used["video"]:  # the frames of one video
        inputs.update(
            pixel_values_videos=frames[used["video"]],
            video_position_ids=frame_positions[used["video"]],
            num_frames_per_video=torch.tensor([len(used["video"])]),
        )
    if used["audio"]:
        features, frame_mask, _ = media["audio"]
        inputs.update(input_features=features[used["audio"]], input_features_mask=frame_mask[used["audio"]])
    return inputs


_MODELS: dict = {}


def models(folder: Path, dtype: torch.dtype):
    """transformers' model (its weights copied to aligned memory: see test_attention on MKL's
    one-row products of memory-mapped weights) and ours at the default attention, once each."""
    if (folder, dtype) not in _MODELS:
        ref = reference_model(folder, dtype)
        for parameter in ref.parameters():
            parameter.data = parameter.data.clone()
        model = torchgemma.load(folder, dtype=dtype)
        assert model.attention == "sdpa"  # the default
        _MODELS[(folder, dtype)] = ref, model
    return _MODELS[(folder, dtype)]


def reference_logits(ref, inputs):
    # Positions follow the mask, as in transformers' generate().
    mask = inputs["attention_mask"]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        return ref(**inputs, position_ids=positions).logits


def max_diff(ours, theirs) -> float:
    return (ours.float() - theirs.float()).abs().max().item()


CASES = [("e2b", "image"), ("e4b", "image"), ("26b", "image"), ("31b", "image")]
CASES += [("e2b", "audio"), ("e2b", "video"), ("31b", "video")]
CASE_IDS = [f"{style}-{case}" for style, case in CASES]


def logits_diffs(folder: Path, style: str, case: str, dtype: torch.dtype) -> dict[str, float]:
    """max |Δ| over the real positions of the padded batch, and of generate()'s prefill (the last
    position, which alone goes through the KV-shared layers)."""
    ref, model = models(folder, dtype)
    inputs = media_inputs(style, case)
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        whole = model(**inputs)
        last = model(**inputs, logits_to_keep=1)
    return {
        "whole": max_diff(whole[real], reference_logits(ref, inputs)[real]),
        "keep 1": max_diff(last, reference_logits(ref, {**inputs, "logits_to_keep": 1})),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style,case", CASES, ids=CASE_IDS)
def test_logits_match_transformers_sdpa(checkpoints, style, case, dtype):
    diffs = logits_diffs(checkpoints[style], style, case, dtype)
    limit = 0.0 if dtype == torch.bfloat16 else 1e-5
    assert all(diff <= limit for diff in diffs.values()), diffs


def greedy_tokens(folder: Path, style: str, case: str, dtype=torch.bfloat16):
    """NEW greedy tokens per row: ours for both rows in one generate() call (rows left-padded),
    transformers' generate() for each row alone (our engine gives a row what it gets alone;
    transformers' own padded batch does not, see test_engine)."""
    ref, model = models(folder, dtype)
    inputs = media_inputs(style, case)
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    ours = generate(
        model,
        ids,
        attention_mask=mask,
        media=MediaInputs.from_dict(inputs),
        max_new_tokens=NEW,
        stop_token_ids=[],
    )[:, ids.shape[1] :]
    theirs = []
    for row in range(ids.shape[0]):
        alone = media_inputs(style, case, rows=[row])
        width = alone["input_ids"].shape[1]
        with torch.no_grad():
            out = ref.generate(**alone, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        theirs.append(out[0, width:])
    return ours, torch.stack(theirs)


# In the default run: image blocks, audio and video once each; the other styles with -m slow.
GREEDY_DEFAULT = {("31b", "image"), ("e2b", "audio"), ("31b", "video")}
GREEDY_CASES = [
    pytest.param(
        style, case, id=f"{style}-{case}", marks=() if (style, case) in GREEDY_DEFAULT else pytest.mark.slow
    )
    for style, case in CASES
]


@pytest.mark.parametrize("style,case", GREEDY_CASES)
def test_greedy_matches_transformers_sdpa(checkpoints, style, case):
    ours, theirs = greedy_tokens(checkpoints[style], style, case)
    assert torch.equal(ours, theirs), f"\nours   {ours.tolist()}\ntheirs {theirs.tolist()}"
    assert all(len(set(row)) >= 4 for row in theirs.tolist()), f"degenerate continuation {theirs}"


def test_set_attention_switches_the_vision_tower(checkpoints):
    """One backend for the text decoder and the vision tower; the audio tower has its one path."""
    model = torchgemma.load(checkpoints["e2b"])
    assert model.vision_tower.encoder.attention == "sdpa"
    model.set_attention("eager")
    assert model.attention == model.vision_tower.encoder.attention == "eager"
    inputs = media_inputs("e2b", "audio")
    eager = torchgemma.load(checkpoints["e2b"], attention="eager")
    with torch.no_grad():
        assert torch.equal(model(**inputs), eager(**inputs))
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        model.set_attention("flash")


# ── what parted greedy decoding: one query over shared KV heads ─────────────────────────────


class _Layer(torch.nn.Module):
    """What transformers' sdpa function reads off an attention module."""

    def __init__(self, groups: int, causal: bool):
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.layer_idx = groups, causal, 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sdpa_call_matches_transformers(dtype):
    """Our sdpa call against transformers' ``sdpa_attention_forward`` itself, on every branch of
    its dispatch: shared KV heads in place, packed (one query with a mask, or head dims over 256)
    or repeated; with and without a mask; causal or not."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from torchgemma.model.attention import sdpa_attention

    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, length, keys, dim in [
        (4, 1, 1, 9, 16),
        (4, 2, 1, 5, 16),
        (8, 1, 1, 700, 512),
        (8, 2, 1, 600, 256),
        (4, 4, 1, 9, 16),
        (4, 1, 7, 7, 16),
        (8, 2, 33, 40, 512),
        (4, 4, 12, 12, 32),
    ]:
        query = torch.randn(2, heads, length, dim, generator=gen).to(dtype)
        key, value = (torch.randn(2, kv_heads, keys, dim, generator=gen).to(dtype) for _ in range(2))
        allowed = torch.rand(2, 1, length, keys, generator=gen) > 0.3
        allowed[..., -1] = True  # no fully masked row
        for mask in (None, allowed):
            for causal in (False, True) if mask is None and length == keys else (False,):
                layer = _Layer(heads // kv_heads, causal)
                theirs, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=1.0)
                ours = sdpa_attention(query, key, value, mask, causal and length > 1, 1.0)
                case = (heads, kv_heads, length, keys, dim, mask is None, causal)
                assert torch.equal(ours, theirs), f"{case}: max |Δ| {max_diff(ours, theirs)}"


WIDE_E2B = dict(
    STYLES["e2b"],
    num_hidden_layers=9,
    layer_types=[SLIDING] * 4 + [FULL] + [SLIDING] * 3 + [FULL],
    num_kv_shared_layers=4,
    hidden_size=128,
    num_attention_heads=8,
    head_dim=64,
    global_head_dim=512,
)


@pytest.fixture(scope="module")
def wide_e2b(tmp_path_factory) -> Path:
    """E2B-like text, 9 layers, at Gemma 4's real global head dim (512: transformers packs every
    decode step's query heads there) and 8 query heads on one KV head."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{**COMMON, **WIDE_E2B}))
    randomize_(model, seed=5)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.05)
    folder = tmp_path_factory.mktemp("wide-e2b")
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_past_the_window_matches_transformers(wide_e2b, dtype):
    """generate()'s prefill (last position only) then decode steps past the window (5), through
    the cache, against transformers' sdpa with its DynamicCache: every step's logits equal.
    Before the packed dispatch (every step's heads in place) bf16 logits differed here at step 7
    (by 0.019) and float32 by up to 2.8e-5 from the prefill on."""
    from transformers import AutoModelForCausalLM, DynamicCache

    ref = AutoModelForCausalLM.from_pretrained(wide_e2b, dtype=dtype, attn_implementation="sdpa").eval()
    for parameter in ref.parameters():
        parameter.data = parameter.data.clone()
    model = torchgemma.load(wide_e2b, dtype=dtype)
    ids = torch.randint(3, 250, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_cache, cache = DynamicCache(config=ref.config), model.make_cache(1, 20)
        theirs = [
            ref(input_ids=ids[:, :7], past_key_values=ref_cache, use_cache=True, logits_to_keep=1).logits
        ]
        theirs += [ref(input_ids=ids[:, t : t + 1], past_key_values=ref_cache).logits for t in range(7, 20)]
        ours = [model(ids[:, :7], cache=cache, logits_to_keep=1)]
        ours += [model(ids[:, t : t + 1], cache=cache) for t in range(7, 20)]
    ours, theirs = torch.cat(ours, 1), torch.cat(theirs, 1)
    limit = 0.0 if dtype == torch.bfloat16 else 1e-5
    assert max_diff(ours, theirs) <= limit, max_diff(ours, theirs)


def first_difference(ours: torch.Tensor, theirs: torch.Tensor) -> int | None:
    apart = (ours != theirs).any(0).nonzero()
    return None if len(apart) == 0 else int(apart[0, 0])


if __name__ == "__main__":
    # The figures behind the module docstring: max |Δ| per case, and where greedy tokens part.
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        folders = {s: build_checkpoint(Path(root) / s, s, seed=60 + i) for i, s in enumerate(STYLES)}
        for style, case in CASES:
            for dtype in DTYPES:
                print(style, case, dtype, logits_diffs(folders[style], style, case, dtype), flush=True)
            ours, theirs = greedy_tokens(folders[style], style, case)
            print(style, case, "greedy bf16: first step apart", first_difference(ours, theirs), flush=True)
    sys.exit(0)

"""Video preprocessing against transformers' Gemma4VideoProcessor (torch.equal on every output).

The reference processor runs on a torchvision stand-in where torchvision is missing (see
video_reference.py). Files are written at test time with PyAV, losslessly, and read both by our
decoder and by transformers' PyAV loader.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from PIL import Image

from torchgemma.processing import Video, load_video, process_videos
from torchgemma.processing.video import format_timestamp, sample_frame_indices, sample_video
from video_reference import decode_with_pyav, moving_frames, reference_video_processor_class, write_video

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()  # fps-less frames and ambiguous layouts are warned about


@pytest.fixture(scope="module")
def processor_class():
    with pytest.MonkeyPatch.context() as patch:
        yield reference_video_processor_class(patch)


def reference(processor_class, videos, **kwargs):
    """The reference's outputs, with per-video timestamps (24 fps where the frames bring none)."""
    out = processor_class(**kwargs)(videos=videos, return_tensors="pt", return_metadata=True)
    times = []
    for metadata in out["video_metadata"]:
        metadata.fps = 24 if metadata.fps is None else metadata.fps  # as replace_video_token does
        times.append([float(t) for t in metadata.timestamps])
    return out, times


def assert_same(ours: dict, ref, ref_times) -> None:
    assert torch.equal(ours["pixel_values_videos"], ref["pixel_values_videos"])
    assert torch.equal(ours["video_position_ids"], ref["video_position_ids"])
    assert torch.equal(ours["num_frames_per_video"], ref["num_frames_per_video"])
    assert ours["num_soft_tokens"] == list(ref["num_soft_tokens_per_video"])
    assert ours["timestamps"] == ref_times
    assert ours["pixel_values_videos"].dtype == torch.float32
    assert ours["video_position_ids"].dtype == torch.int64


# --- Sampling ----------------------------------------------------------------------------------------


def test_sampled_indices_match_reference():
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    for total in range(1, 300):
        for num_frames in (1, 2, 7, 32):
            ours = sample_frame_indices(total, num_frames)
            if num_frames > total:
                # The reference refuses; we keep every frame (what it does with sampling turned off).
                with pytest.raises(ValueError, match="exceeds total_num_frames"):
                    default_sample_indices_fn(VideoMetadata(total_num_frames=total), num_frames=num_frames)
                assert ours.tolist() == list(range(total))
                continue
            ref = default_sample_indices_fn(VideoMetadata(total_num_frames=total), num_frames=num_frames)
            assert ours.tolist() == ref.tolist(), (total, num_frames)
    assert sample_frame_indices(5, None).tolist() == [0, 1, 2, 3, 4]


def test_timestamps_written_as_the_processor_writes_them(processor_class, tmp_path):
    from transformers import AutoTokenizer, Gemma4Processor
    from transformers.video_utils import VideoMetadata

    from tokenizer_fixtures import write_gemma4_tokenizer

    class Processor(Gemma4Processor):
        # No image processor here, and transformers' video-processor registry needs torchvision.
        def check_argument_for_proper_class(self, name, arg):
            if name not in ("image_processor", "video_processor"):
                return super().check_argument_for_proper_class(name, arg)

    write_gemma4_tokenizer(tmp_path)
    processor = Processor(
        feature_extractor=transformers.Gemma4AudioFeatureExtractor(),
        image_processor=None,
        tokenizer=AutoTokenizer.from_pretrained(tmp_path),
        video_processor=processor_class(),
    )
    cases = ((24.0, [0, 23, 24, 1439, 1440, 86399]), (29.97, [0, 1, 1798, 1799, 3597]), (0.5, [0, 1, 29, 31]))
    for fps, indices in cases:
        metadata = VideoMetadata(total_num_frames=max(indices) + 1, fps=fps, frames_indices=indices)
        text = processor.replace_video_token(
            {"num_soft_tokens_per_video": [1], "video_metadata": [metadata]}, 0
        )
        assert " ".join(f"{format_timestamp(i / fps)} <|image><|video|><image|>" for i in indices) == text


# --- Pixels: sizes, aspect ratios, budgets, frame counts ---------------------------------------------

# (frames, height, width): sizes that upscale, downscale, keep the size, and elongated ones.
SHAPES = [(11, 60, 90), (9, 100, 40), (7, 240, 320), (6, 144, 144), (10, 17, 300), (5, 3, 500), (4, 48, 96)]


@pytest.mark.parametrize("budget", (70, 140, 280))
def test_pixels_match_reference(processor_class, budget):
    rng = np.random.default_rng(budget)
    for count, height, width in SHAPES:
        noise = rng.integers(0, 256, (count, height, width, 3), dtype=np.uint8)
        smooth = moving_frames(count, height, width, seed=count)
        for frames, num_frames in ((noise, 3), (smooth, 8)):
            ours = process_videos([frames], num_frames=num_frames, max_soft_tokens=budget)
            if num_frames > count:  # the reference needs sampling off to keep them all
                ref = reference(processor_class, [frames], max_soft_tokens=budget, do_sample_frames=False)
            else:
                ref = reference(processor_class, [frames], max_soft_tokens=budget, num_frames=num_frames)
            assert_same(ours, *ref)


def test_frame_inputs_match_reference(processor_class):
    rng = np.random.default_rng(3)
    hwc = rng.integers(0, 256, (12, 70, 50, 3), dtype=np.uint8)
    cases = {
        "PIL frames": [Image.fromarray(frame) for frame in hwc],
        "HWC array frames": list(hwc),
        "HWC tensor": torch.from_numpy(hwc),
        "CHW array": np.ascontiguousarray(hwc.transpose(0, 3, 1, 2)),
        "CHW tensor frames": [torch.from_numpy(frame).permute(2, 0, 1) for frame in hwc],
        "one channel": hwc[..., :1],
    }
    for name, video in cases.items():
        ours = process_videos([video], num_frames=5)
        assert_same(ours, *reference(processor_class, [video], num_frames=5)), name
    # Two videos of different sizes and lengths (same layout: the reference reads every video of a
    # call with the first one's channel layout).
    second = moving_frames(20, 90, 120)
    assert_same(
        process_videos([hwc, second], num_frames=8),
        *reference(processor_class, [hwc, second], num_frames=8),
    )


def test_frame_rate_sets_timestamps(processor_class):
    frames = moving_frames(40, 32, 48)
    ours = process_videos([Video(frames, fps=2.5)], num_frames=4)
    metadata = {"total_num_frames": 40, "fps": 2.5}
    ref = reference(processor_class, [frames], num_frames=4, video_metadata=[metadata])
    assert_same(ours, *ref)
    assert ours["timestamps"] == [[0.0, 4.0, 8.0, 12.0]]
    assert process_videos([frames], num_frames=4)["timestamps"] == [[0.0, 10 / 24, 20 / 24, 30 / 24]]


def test_other_pil_modes_become_rgb():
    rgb = moving_frames(3, 40, 40)
    rgba = [Image.fromarray(frame).convert("RGBA") for frame in rgb]
    gray = [Image.fromarray(frame).convert("L") for frame in rgb]
    assert torch.equal(
        process_videos([rgba])["pixel_values_videos"], process_videos([rgb])["pixel_values_videos"]
    )
    expected = process_videos([np.stack([np.asarray(g)[..., None] for g in gray])])
    assert torch.equal(process_videos([gray])["pixel_values_videos"], expected["pixel_values_videos"])


def test_bad_inputs_are_named():
    frames = moving_frames(4, 32, 32)
    with pytest.raises(ValueError, match="must be uint8"):
        process_videos([frames.astype(np.float32) / 255])
    with pytest.raises(ValueError, match="1 or 3 channels"):
        process_videos([np.zeros((4, 32, 32, 4), dtype=np.uint8)])
    with pytest.raises(ValueError, match="must all have one size"):
        process_videos([[frames[0], frames[1][:16]]])
    with pytest.raises(TypeError, match="a list of videos"):
        process_videos(frames)
    with pytest.raises(TypeError, match="unsupported video type"):
        process_videos([Image.fromarray(frames[0])])
    with pytest.raises(ValueError, match="at least one frame"):
        process_videos([[]])
    with pytest.raises(ValueError, match="max_soft_tokens must be one of"):
        process_videos([frames], max_soft_tokens=100)
    with pytest.raises(ValueError, match="fps must be a positive number"):
        process_videos([Video(frames, fps=0)])


# --- Files ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def video_files(tmp_path_factory):
    pytest.importorskip("av")
    root = tmp_path_factory.mktemp("videos")
    frames = moving_frames(75, 60, 80, seed=5)
    return {
        "frames": frames,
        # 12.5 fps: timestamps that are not whole seconds.
        "avi": write_video(root / "clip.avi", frames, Fraction(25, 2)),
        # Matroska does not state the frame count: transformers' PyAV loader cannot sample it.
        "mkv": write_video(root / "clip.mkv", frames[:20], 10),
    }


@pytest.mark.parametrize("num_frames", (32, 4, 100))
def test_file_frames_match_transformers_loader(video_files, num_frames):
    from transformers.video_utils import default_sample_indices_fn
    from transformers.video_utils import load_video as reference_load

    def indices_fn(metadata, **_):
        return default_sample_indices_fn(metadata, num_frames=min(num_frames, metadata.total_num_frames))

    ours = load_video(video_files["avi"], num_frames=num_frames)
    frames, metadata = reference_load(str(video_files["avi"]), backend="pyav", sample_indices_fn=indices_fn)
    assert torch.equal(ours.frames, torch.from_numpy(frames).permute(0, 3, 1, 2))
    assert ours.indices == list(metadata.frames_indices) and ours.fps == metadata.fps == 12.5
    # Lossless file: the frames are those that were encoded.
    assert torch.equal(ours.frames, torch.from_numpy(video_files["frames"][ours.indices]).permute(0, 3, 1, 2))


def test_file_through_reference_processor(video_files, processor_class):
    ours = process_videos([video_files["avi"], str(video_files["avi"])], num_frames=6)
    processor = processor_class(num_frames=6)
    decode_with_pyav(processor)
    ref = processor(videos=[str(video_files["avi"])] * 2, return_tensors="pt", return_metadata=True)
    assert_same(ours, ref, [[float(t) for t in m.timestamps] for m in ref["video_metadata"]])
    assert ours["timestamps"][0] == [i / 12.5 for i in (0, 12, 25, 37, 50, 62)]


def test_file_without_frame_count(video_files):
    ours = load_video(video_files["mkv"], num_frames=8)
    assert ours.indices == [0, 2, 5, 7, 10, 12, 15, 17] and ours.fps == 10
    expected = torch.from_numpy(video_files["frames"][ours.indices]).permute(0, 3, 1, 2)
    assert torch.equal(ours.frames, expected)
    assert torch.equal(sample_video(str(video_files["mkv"]), 8).frames, expected)


def test_file_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="video file not found"):
        process_videos([tmp_path / "missing.mp4"])
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\0\0\0\x18ftypmp42 not a real video")
    pytest.importorskip("av")
    with pytest.raises(ValueError, match="cannot read video file"):
        process_videos([broken])
    # Without PyAV, a file cannot be decoded: the error names the extra that brings it.
    monkeypatch.setitem(__import__("sys").modules, "av", None)
    with pytest.raises(ImportError, match=r'pip install "torchgemma\[video\]"'):
        process_videos([broken])


# --- Prompt: timestamps are text ---------------------------------------------------------------------


def merging_tokenizer():
    """A Gemma-style tokenizer (spaces as "▁", no pre-tokenizer) whose merges cross the edge between
    a text and a timestamp after it: "e" + "0" and "▁" + "0" are tokens."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as Backend

    from torchgemma import Tokenizer

    pieces = ["<pad>", "<bos>", *"Scenxt:0123456789▁", "e0", "00", "00:", "▁0", "ne"]
    merges = [("e", "0"), ("▁", "0"), ("0", "0"), ("00", ":"), ("n", "e")]
    backend = Backend(models.BPE({p: i for i, p in enumerate(pieces)}, merges, fuse_unk=False))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
    specials = ["<|image>", "<image|>", "<|video|>", "<|image|>", "<|audio|>", "<|audio>", "<audio|>"]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ["<bos>", *specials]])
    backend.add_tokens([AddedToken("\n", special=False, normalized=False)])
    return Tokenizer(backend, bos_id=1, pad_id=0)


def test_timestamps_are_tokenized_with_the_text_before_them():
    """Ids equal to encoding the text as the processor expands it (``replace_video_token``)."""
    import types

    from transformers import Gemma4Processor
    from transformers.video_utils import VideoMetadata

    from torchgemma.processing import MediaTokens, VideoTokens, expand_placeholders

    tokenizer = merging_tokenizer()
    tokens = MediaTokens(
        *(tokenizer.token_id(t) for t in ("<|image|>", "<|image>", "<image|>")),
        *(tokenizer.token_id(t) for t in ("<|audio|>", "<|audio>", "<audio|>")),
        video=tokenizer.token_id("<|video|>"),
    )
    names = types.SimpleNamespace(boi_token="<|image>", eoi_token="<image|>", video_token="<|video|>")
    prompts = ["<bos>Scene<|video|>next", "<bos>Scene 0<|video|>\n<|video|> Scene", "<|video|>"]
    videos = [([0, 1, 50], 24.0), ([0, 36], 12.0), ([3], 0.5), ([0, 7, 200], 2.0)]
    counts = [2, 1, 3, 1]
    expected, placeholders = [], iter(zip(videos, counts))
    for prompt in prompts:
        pieces = prompt.split("<|video|>")
        text = pieces[0]
        for piece in pieces[1:]:
            (indices, fps), n = next(placeholders)
            metadata = VideoMetadata(total_num_frames=max(indices) + 1, fps=fps, frames_indices=indices)
            inputs = {"num_soft_tokens_per_video": [n], "video_metadata": [metadata]}
            text += Gemma4Processor.replace_video_token(names, inputs, 0) + piece
        expected.append(tokenizer.encode(text, add_special_tokens=False))
    rows = [tokenizer.encode(prompt, add_special_tokens=False) for prompt in prompts]
    video_tokens = [VideoTokens(n, [i / fps for i in indices]) for (indices, fps), n in zip(videos, counts)]
    ours, types_ = expand_placeholders(rows, tokens, videos=video_tokens, tokenizer=tokenizer)
    assert ours == expected
    # Encoding the timestamp on its own would differ: the merges do cross the edge.
    apart = tokenizer.encode("<bos>Scene", add_special_tokens=False) + tokenizer.encode("00:00 ")
    assert ours[0][: len(apart)] != apart
    assert [sum(t == 2 for t in row) for row in types_] == [2 * 3, 1 * 2 + 3 * 1, 1 * 3]

"""A model GGUF with llama.cpp's mmproj GGUF of its towers, against transformers.

The files in tests/data/mmproj/ are llama.cpp's own conversion (``convert_hf_to_gguf.py``, and with
``--mmproj``, of the converter llama-cpp-python 0.3.36 vendors) of two tiny random checkpoints
saved beside them; tests/data/make_mmproj_fixture.py made them and says how. Their weights are
float16 values, stored F16/F32, so the GGUF pair holds exactly the checkpoint's values: logits
must match transformers' on the safetensors checkpoint to float32 rounding, media included.

* e2b: E2B-like text, the on-device vision tower and the audio conformer (clip bounds clamp).
* 31b: 31B-like text (K=V, bidirectional image blocks), the large vision tower (standardised).
* 12b: 12B-Unified-like: the encoder-free image embedder (merged patches) and raw-audio embedder.
* gemma3: Gemma 3 4B-like text and its SigLIP tower with the projector (projector type gemma3).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize
from gguf.quants import quantize as quantize_blocks

import torchgemma
from checkpoints import reference_model
from torchgemma import process_audio, process_images
from torchgemma.processing.unified import frame_audio, process_unified_images
from torchgemma.weights.gguf import GGUFError, read_gguf_with_mmproj

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = Path(__file__).parent / "data" / "mmproj"
TYPE_OF = {"image": 1, "audio": 3}


def pair(name: str) -> tuple[Path, Path]:
    return DATA / name / "model.gguf", DATA / name / "mmproj.gguf"


NAMES = ["e2b", "31b", "12b", "gemma3"]


@pytest.fixture(scope="module")
def references():
    return {name: reference_model(DATA / name) for name in NAMES}


def gemma3_inputs(ids: dict) -> dict:
    """Gemma 3: two rows, each with an image's 9 tokens between its boi and eoi (as Gemma3Processor
    expands them), 42 px images; ``mm_token_type_ids`` marks the image tokens."""
    gen = torch.Generator().manual_seed(1)
    image = [ids["boi_token_index"]] + [ids["image_token_index"]] * 9 + [ids["eoi_token_index"]]
    rows = [
        torch.randint(10, 290, (3,), generator=gen).tolist() + image + [12, 40, 77, 9],
        [2, 33] + image + torch.randint(10, 290, (5,), generator=gen).tolist(),
    ]
    length = max(map(len, rows))
    input_ids = torch.zeros(2, length, dtype=torch.long)
    mask = torch.zeros(2, length, dtype=torch.long)
    for i, r in enumerate(rows):  # left padding
        input_ids[i, length - len(r) :] = torch.tensor(r)
        mask[i, length - len(r) :] = 1
    types = (input_ids == ids["image_token_index"]).long()
    pixels = torch.rand(2, 3, 42, 42, generator=gen) * 2 - 1
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "mm_token_type_ids": types,
        "pixel_values": pixels,
    }


def theirs(name: str, inputs: dict) -> dict:
    """The inputs as transformers' model takes them (Gemma 3 calls mm_token_type_ids token_type_ids)."""
    if name != "gemma3":
        return inputs
    out = dict(inputs)
    out["token_type_ids"] = out.pop("mm_token_type_ids")
    return out


def media_inputs(name: str) -> dict:
    """Two prompt rows laid out as the processor expands them, with images (and audio for e2b, 12b)."""
    ids = json.loads((DATA / name / "config.json").read_text())
    if name == "gemma3":
        return gemma3_inputs(ids)
    rng = np.random.default_rng(3)
    pictures = [
        rng.integers(0, 256, (60, 90, 3), dtype=np.uint8),
        rng.integers(0, 256, (100, 40, 3), dtype=np.uint8),
    ]
    if name == "12b":
        vision = ids["vision_config"]
        images = process_unified_images(
            pictures, 70, patch_size=vision["patch_size"], pooling_kernel_size=vision["pooling_kernel_size"]
        )
    else:
        images = process_images(pictures, max_soft_tokens=70)
    inputs = {"pixel_values": images["pixel_values"], "image_position_ids": images["image_position_ids"]}
    n1, n2 = images["num_soft_tokens"]
    rows = [[3, ("image", n1), 4], [2, ("image", n2), 5]]
    clips = [0.1 * rng.standard_normal(n).astype(np.float32) for n in (8000, 5000)]
    if name == "12b":  # raw frames of audio_embed_dim samples, one soft token each
        audio = frame_audio([clip[:300] for clip in clips], ids["audio_config"]["audio_embed_dim"])
        a1, a2 = audio["input_features_mask"].sum(-1).tolist()
    elif name == "e2b":
        audio = process_audio(clips)
        a1, a2 = audio["input_features_mask"][:, ::4].sum(-1).tolist()
    if name != "31b":
        rows[0] += [("audio", a1), 2]
        rows[1] += [("audio", a2), 3]
        inputs.update(
            input_features=audio["input_features"], input_features_mask=audio["input_features_mask"]
        )
    gen = torch.Generator().manual_seed(1)
    id_rows, type_rows = [], []
    for row in rows:
        row_ids, row_types = [], []
        for part in row:
            if isinstance(part, int):
                row_ids += torch.randint(300, 700, (part,), generator=gen).tolist()  # plain text pieces
                row_types += [0] * part
                continue
            kind, n = part
            start, end = (
                (ids["boa_token_id"], ids["eoa_token_index"])
                if kind == "audio"
                else (ids["boi_token_id"], ids["eoi_token_id"])
            )
            row_ids += [start] + [ids[f"{kind}_token_id"]] * n + [end]
            row_types += [0] + [TYPE_OF[kind]] * n + [0]
        id_rows.append(row_ids)
        type_rows.append(row_types)
    length = max(map(len, id_rows))
    input_ids = torch.zeros(2, length, dtype=torch.long)
    mask = torch.zeros(2, length, dtype=torch.long)
    types = torch.zeros(2, length, dtype=torch.long)
    for i, (r, t) in enumerate(zip(id_rows, type_rows)):  # left padding
        input_ids[i, length - len(r) :] = torch.tensor(r)
        mask[i, length - len(r) :] = 1
        types[i, length - len(t) :] = torch.tensor(t)
    return {"input_ids": input_ids, "attention_mask": mask, "mm_token_type_ids": types, **inputs}


def reference_logits(ref, inputs):
    mask = inputs["attention_mask"]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        return ref(**inputs, position_ids=positions).logits


@pytest.mark.parametrize("name", NAMES)
def test_gguf_with_mmproj_matches_transformers(references, name):
    """Logits with images (and audio) equal transformers' to float32 rounding; greedy tokens
    (ours through the KV cache, transformers' generate) equal."""
    model_file, mmproj = pair(name)
    model = torchgemma.load(model_file, mmproj=mmproj, attention="eager")
    assert model.dtype == torch.float32
    inputs = media_inputs(name)
    new_tokens = 4
    with torch.no_grad():
        ours = model(**inputs)
        cache = model.make_cache(2, inputs["input_ids"].shape[1] + new_tokens)
        tokens = [model(**inputs, cache=cache)[:, -1].argmax(-1, keepdim=True)]
        for _ in range(new_tokens - 1):
            tokens.append(model(tokens[-1], cache=cache)[:, -1].argmax(-1, keepdim=True))
        expected = references[name].generate(
            **theirs(name, inputs), max_new_tokens=new_tokens, do_sample=False
        )
    ref = reference_logits(references[name], theirs(name, inputs))
    diff = (ours - ref).abs().max().item()
    print(f"{name}: max |Δ| = {diff:.3g}")
    assert diff <= 1e-5
    assert torch.equal(torch.cat(tokens, 1), expected[:, inputs["input_ids"].shape[1] :])


@pytest.mark.parametrize("name", NAMES)
def test_every_tower_tensor_reads_back_as_the_checkpoints(name):
    """Names, layouts and values: every tensor of the checkpoint from the GGUF pair, bit for bit
    (the converter stores softplus(per_dim_scale): what reads back has the same softplus)."""
    from safetensors.torch import load_file

    checkpoint = read_gguf_with_mmproj(*pair(name))
    # By module path: Gemma 3's checkpoint is saved in its published layout (language_model.model.*,
    # vision_tower.vision_model.*), the pair reads as transformers 5 names it (model.language_model.*).
    path = checkpoint.model_config.module_path
    ours_by_path = {path(n): n for n in checkpoint.tensor_names()}
    stored = {path(n): v for n, v in load_file(DATA / name / "model.safetensors").items()}
    assert set(ours_by_path) == set(stored)
    towers = [n for n in stored if not n.startswith("language_model.")]
    assert towers
    for module_path, value in stored.items():
        hf_name = ours_by_path[module_path]
        ours, value = checkpoint.tensor(hf_name), value.float()
        if hf_name.endswith("per_dim_scale"):
            ours, value = torch.nn.functional.softplus(ours), torch.nn.functional.softplus(value)
        assert ours.shape == value.shape and torch.equal(ours, value), hf_name


def test_gemma3_llm_with_an_image_equals_transformers(references):
    """LLM on Gemma 3's GGUF pair: the prompt's <start_of_image> expanded as Gemma3Processor does
    (from the GGUF's own vocabulary), the image preprocessed, and the greedy reply transformers'
    generate gives for the same inputs."""
    llm = torchgemma.LLM(pair("gemma3")[0], mmproj=pair("gemma3")[1], progress=False)
    picture = np.random.default_rng(5).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    prompt = "The cat <start_of_image> on a mat"
    ids = llm.processor.encode_all([prompt], None, [picture])
    inputs = llm.inputs(ids, [picture])
    assert int((inputs["input_ids"] == 6).sum()) == 9 and inputs["pixel_values"].shape == (1, 3, 42, 42)
    ours = llm.generate_ids(ids, images=[picture], max_new_tokens=4, temperature=0)
    with torch.no_grad():
        expected = references["gemma3"].generate(
            **theirs("gemma3", inputs), max_new_tokens=4, do_sample=False
        )
    assert ours[0] == expected[0, inputs["input_ids"].shape[1] :].tolist()


def test_cli_and_server_take_the_mmproj(tmp_path, capsys, monkeypatch):
    """`--mmproj` on generate (an image through the CLI: the same tokens as LLM.generate_ids; without
    it the image is refused) and on serve's parser; LLM(..., mmproj=) behind the server answers an
    image_url as LLM.chat does."""
    import base64
    import io

    import openai
    from PIL import Image

    from llm_fixtures import run_cli
    from serving_fixtures import content_of, running_server
    from torchgemma.cli import build_parser
    from torchgemma.cli.generate import with_placeholders
    from torchgemma.serving.app import create_app

    model_file, mmproj = pair("e2b")
    picture = Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 56, 3), dtype=np.uint8))
    picture.save(tmp_path / "p.png")
    argv = [
        "generate",
        "--model",
        str(model_file),
        "--image",
        str(tmp_path / "p.png"),
        "-q",
        "--max-new-tokens",
        "3",
    ]
    code, out, _ = run_cli(
        [*argv, "--mmproj", str(mmproj), "--temperature", "0", "--json", "what?"], capsys, monkeypatch
    )
    assert code == 0
    llm = torchgemma.LLM(model_file, mmproj=mmproj)
    prompt = llm.encode(with_placeholders("what?", [str(tmp_path / "p.png")], None, None))
    expected = llm.generate_ids([prompt], images=[str(tmp_path / "p.png")], max_new_tokens=3, temperature=0)
    assert json.loads(out)["token_ids"] == expected[0]
    code, _, err = run_cli([*argv, "what?"], capsys, monkeypatch)
    assert code != 0 and "image" in err
    args = build_parser().parse_args(["serve", "--model", str(model_file), "--mmproj", str(mmproj)])
    assert args.mmproj == str(mmproj)

    png = io.BytesIO()
    picture.save(png, format="PNG")
    url_of = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    with running_server(create_app(llm, model_name="tiny", max_len=512)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        content = [{"type": "image_url", "image_url": {"url": url_of}}, {"type": "text", "text": "what?"}]
        response = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=3
        )
    messages = [
        {"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "what?"}]}
    ]
    reply = llm.chat(messages, temperature=0, max_new_tokens=3)
    # The tiny model's reply is a special token the server leaves out: its content is empty. The
    # prompt it ran is the library's, the image expanded into its soft tokens.
    assert (response.choices[0].message.content or "") == content_of(llm, reply.token_ids)
    assert response.usage.prompt_tokens == int(llm.chat_inputs(messages)["attention_mask"].sum()) > 280


def test_a_quantized_mmproj_reads_as_its_blocks_dequantize(tmp_path):
    """Towers stored as Q8_0 (llama.cpp's quantize tool does this to mmproj matrices) are
    dequantized as the gguf package dequantizes them, and load with the model."""
    model_file, mmproj = pair("e2b")
    quantized = rewrite(mmproj, tmp_path / "mmproj-q8_0.gguf", quantize=GGMLQuantizationType.Q8_0)
    checkpoint = read_gguf_with_mmproj(model_file, quantized)
    reader = GGUFReader(quantized)
    stored = {t.name: t for t in reader.tensors}
    checked = 0
    for entry in checkpoint.mmproj.entries:
        tensor = stored[entry.source]
        if tensor.tensor_type != GGMLQuantizationType.Q8_0:
            continue
        shape = [int(d) for d in reversed(tensor.shape)]
        expected = torch.from_numpy(
            dequantize(np.array(tensor.data), tensor.tensor_type).reshape(shape).copy()
        )
        if entry.transform is not None:
            expected = entry.transform.apply(expected)
        assert torch.equal(checkpoint.tensor(entry.hf_name), expected), entry.source
        checked += 1
    assert checked >= 30  # every tower matrix whose rows hold whole blocks
    model = torchgemma.load(model_file, mmproj=quantized)
    q_proj = model.vision_tower.encoder.layers[0].self_attn.q_proj.linear.weight
    assert torch.equal(
        q_proj, checkpoint.tensor("model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight")
    )


# ── refused, each naming the problem ─────────────────────────────────────────────────────────────


def rewrite(source: Path, target: Path, *, drop=(), add=None, metadata=None, quantize=None) -> Path:
    """A copy of a GGUF file with tensors dropped or added, metadata values changed, and (``quantize``:
    a GGML type) its matrices whose rows fit that type's blocks requantized into it."""
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(target, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture",):
            continue
        value = (metadata or {}).get(key, field.contents())
        writer.add_key_value(
            key, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None
        )
    for tensor in reader.tensors:
        if tensor.name in drop:
            continue
        data = np.array(tensor.data).reshape([int(d) for d in reversed(tensor.shape)])
        block = GGML_QUANT_SIZES[quantize][0] if quantize is not None else 0
        if quantize is not None and data.ndim == 2 and data.shape[-1] % block == 0:
            values = dequantize(data, tensor.tensor_type).astype(np.float32)
            writer.add_tensor(tensor.name, quantize_blocks(values, quantize), raw_dtype=quantize)
            continue
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    for name, data in (add or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_missing_mmproj_tensor_is_named(tmp_path):
    model_file, mmproj = pair("e2b")
    broken = rewrite(mmproj, tmp_path / "mmproj.gguf", drop={"a.blk.1.attn_k_rel.weight"})
    with pytest.raises(
        GGUFError, match=r"missing tensor a\.blk\.1\.attn_k_rel\.weight \(for model\.audio_tower"
    ):
        torchgemma.load(model_file, mmproj=broken)


def test_unexpected_mmproj_tensor_is_named(tmp_path):
    model_file, mmproj = pair("31b")
    extra = {"v.blk.0.attn_extra.weight": np.zeros((4, 4), np.float32)}
    broken = rewrite(mmproj, tmp_path / "mmproj.gguf", add=extra)
    with pytest.raises(
        GGUFError, match=r"no gemma4v tower of llama\.cpp's names, e\.g\. v\.blk\.0\.attn_extra\.weight"
    ):
        torchgemma.load(model_file, mmproj=broken)


def test_mmproj_sizes_that_do_not_fit_are_named(tmp_path):
    model_file, mmproj = pair("31b")
    broken = rewrite(mmproj, tmp_path / "mmproj.gguf", metadata={"clip.vision.feed_forward_length": 64})
    with pytest.raises(
        GGUFError, match=r"v\.blk\.0\.ffn_gate\.weight .* has shape \[48, 32\], the config implies \[64, 32\]"
    ):
        torchgemma.load(model_file, mmproj=broken)


def test_another_models_mmproj_is_refused():
    with pytest.raises(
        GGUFError, match=r"projects into a 32-wide text model .* model\.gguf's is 24 wide .* another model's"
    ):
        torchgemma.load(pair("31b")[0], mmproj=pair("e2b")[1])


def test_misplaced_files_are_refused(tmp_path):
    model_file, mmproj = pair("e2b")
    with pytest.raises(GGUFError, match="an mmproj file: pass it as mmproj="):
        torchgemma.load(mmproj)
    with pytest.raises(GGUFError, match="is not an mmproj file: its general.architecture is 'gemma4'"):
        torchgemma.load(model_file, mmproj=model_file)
    with pytest.raises(ValueError, match="mmproj= goes with a .gguf model file"):
        torchgemma.load(DATA / "e2b", mmproj=mmproj)
    shutil.copy(mmproj, tmp_path / "m.gguf")
    odd = rewrite(mmproj, tmp_path / "odd.gguf", metadata={"clip.vision.projector_type": "qwen2vl"})
    with pytest.raises(GGUFError, match="vision projector type 'qwen2vl' is not one torchgemma reads"):
        torchgemma.load(model_file, mmproj=odd)

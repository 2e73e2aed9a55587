"""Loading: sharded and single files, hub ids, dtype, sanitize exceptions, and clear errors."""

import json
import shutil

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

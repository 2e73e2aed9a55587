"""`torchgemma info`: parameter counts and memory from config.json alone."""

import json

import pytest
import torch

from published_configs import (
    EMBEDDINGGEMMA_300M,
    EMBEDDINGGEMMA_DENSE,
    EMBEDDINGGEMMA_MODULES,
    PUBLISHED,
    multimodal,
)
from torchgemma.cli import main
from torchgemma.config import ModelConfig
from torchgemma.info import describe

ON_DEVICE_VISION = {"model_type": "gemma4_vision", "use_clipped_linears": True}
LARGE_VISION = {
    "model_type": "gemma4_vision",
    "hidden_size": 1152,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 72,
    "intermediate_size": 4304,
    "standardize": True,
}


def published_multimodal(name):
    data = multimodal(PUBLISHED[name])
    small = name in ("e2b", "e4b")
    data["vision_config"] = ON_DEVICE_VISION if small else LARGE_VISION
    data["audio_config"] = {"model_type": "gemma4_audio"} if small else None
    return data


# Totals (tied head counted once, buffers excluded) from instantiating the published configs in
# transformers on the meta device (reference notes §7.4); they match Google's 5.1B / 8B / 25.2B / 30.7B.
PUBLISHED_TOTALS = {
    "e2b": 5_104_297_504,
    "e4b": 7_941_100_832,
    "26b-a4b": 25_805_933_872,
    "31b": 31_273_086_512,
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_parameter_counts(name):
    info = describe(ModelConfig.from_hf(published_multimodal(name)))
    assert info["params_total"] == PUBLISHED_TOTALS[name]
    assert info["params_effective"] == info["params_total"] - info["params_ple_table"]


def test_moe_active_parameters_match_the_published_figure():
    """Google gives Gemma 4 26B-A4B as 25.2B parameters (language model), 3.8B active per token."""
    info = describe(ModelConfig.from_hf(published_multimodal("26b-a4b")))
    assert info["experts_per_token"] == [8, 128]
    assert round(info["params_by_tower"]["language_model"] / 1e9, 1) == 25.2
    assert round(info["params_active_language_model"] / 1e9, 1) == 3.8
    # The vision tower runs for image tokens: it counts as active in the whole model's figure.
    assert info["params_active"] - info["params_active_language_model"] == info["params_by_tower"]["vision"]
    dense = describe(ModelConfig.from_hf(published_multimodal("31b")))
    assert dense["experts_per_token"] is None and dense["params_active"] == dense["params_total"]


def test_e2b_kv_cache_at_128k():
    """12 sliding layers x 512 columns (the window: 511 earlier keys, and the column a decode step writes
    first) + 3 full layers x 131072 columns, K and V, 1 KV head, 256/512 dims."""
    config = ModelConfig.from_hf(published_multimodal("e2b"))
    info = describe(config, context=131072, batch=1, dtype=torch.bfloat16)
    expected = 2 * 2 * (12 * 512 * 256 + 3 * 131072 * 512)
    assert info["kv_cache_bytes"] == expected
    assert round(expected / 2**30, 2) == 0.76
    assert info["kv_cache_layers"] == {"sliding": 12, "full": 3}
    assert (info["kv_cache_sliding_columns"], info["kv_cache_sliding_slack"]) == (512, 0)
    assert info["params_ple_table"] == 262144 * 35 * 256
    # Rolling back up to 8 tokens (speculative decoding) costs 8 more columns per sliding layer.
    rollback = describe(config, context=131072, batch=1, dtype=torch.bfloat16, max_rollback=8)
    assert rollback["kv_cache_bytes"] - expected == 2 * 2 * 12 * 8 * 256
    assert (rollback["kv_cache_sliding_columns"], rollback["kv_cache_sliding_slack"]) == (520, 8)


def test_counts_match_transformers_and_our_cache(text_checkpoints, multimodal_checkpoint):
    from transformers import AutoModelForCausalLM

    import torchgemma

    for folder in [*text_checkpoints.values(), multimodal_checkpoint]:
        ref = AutoModelForCausalLM.from_pretrained(folder)
        info = describe(ModelConfig.from_file(folder), context=37, batch=2, dtype=torch.float32)
        assert info["params_total"] == sum(p.numel() for p in ref.parameters()), folder.name
        model = torchgemma.load(folder)
        assert info["kv_cache_bytes"] == model.make_cache(2, 37).nbytes
        rollback = describe(ModelConfig.from_file(folder), context=37, batch=2, max_rollback=3)
        assert rollback["kv_cache_bytes"] == model.make_cache(2, 37, max_rollback=3).nbytes


def test_cli_json_and_table(multimodal_checkpoint, capsys):
    assert main(["info", str(multimodal_checkpoint), "--context", "1000", "--batch", "3", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"params_total", "kv_cache_bytes", "weights_bytes", "params_ple_table"} <= info.keys()
    assert info["context"] == 1000 and info["batch"] == 3
    assert main(["info", str(multimodal_checkpoint), "--max-rollback", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_cache_sliding_slack"] == 4
    assert main(["info", str(multimodal_checkpoint / "config.json")]) == 0
    table = capsys.readouterr().out
    assert "per-layer embeddings" in table and "KV cache" in table and "rollback slack" in table


def test_cli_errors(tmp_path, capsys):
    assert main(["info", str(tmp_path / "missing")]) == 2
    assert "missing is neither a local folder or .gguf file" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert main(["info", str(tmp_path)]) == 2
    assert "unsupported model_type 'bert'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["info"])


def test_embeddinggemma_counts_its_sentence_head(tmp_path, capsys):
    """EmbeddingGemma's published files (config.json, modules.json, the Dense configs): the decoder
    and the two Dense layers make Google's 308M; without modules.json only the decoder counts."""
    (tmp_path / "config.json").write_text(json.dumps(EMBEDDINGGEMMA_300M))
    assert main(["info", str(tmp_path), "--json"]) == 0
    decoder = json.loads(capsys.readouterr().out)
    assert "sentence_head" not in decoder["params_by_tower"]
    (tmp_path / "modules.json").write_text(json.dumps(EMBEDDINGGEMMA_MODULES))
    for name, config in EMBEDDINGGEMMA_DENSE.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert main(["info", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["params_by_tower"]["sentence_head"] == 2 * 768 * 3072
    assert info["params_total"] == decoder["params_total"] + 2 * 768 * 3072
    assert round(info["params_total"] / 1e6) == 308
    # The decoder count is transformers' own for the same config.
    from transformers import Gemma3TextConfig, Gemma3TextModel

    with torch.device("meta"):
        reference = Gemma3TextModel(Gemma3TextConfig(**EMBEDDINGGEMMA_300M))
    assert decoder["params_total"] == sum(p.numel() for p in reference.parameters())

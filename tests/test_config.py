"""Config parsing: both field styles, the per-layer specs, and clear errors for bad configs."""

import copy
import json

import pytest

from checkpoints import STYLES, text_config
from published_configs import A26B, D31B, E2B, E4B, PUBLISHED, multimodal
from torchgemma.config import FULL, SLIDING, ConfigError, ModelConfig


def specs(data):
    return ModelConfig.from_hf(data).text.layers


def test_e2b_layer_specs():
    layers = specs(E2B)
    assert [s.index for s in layers if s.attention_type == FULL] == [4, 9, 14, 19, 24, 29, 34]
    assert [s.index for s in layers if s.kv_role == "store"] == [13, 14]
    assert all(s.kv_role == "reuse" for s in layers[15:])
    assert {s.kv_source for s in layers[15:] if s.is_sliding} == {13}
    assert {s.kv_source for s in layers[15:] if not s.is_sliding} == {14}
    assert [s.intermediate_size for s in layers] == [6144] * 15 + [12288] * 20
    for s in layers:
        assert (s.head_dim, s.num_kv_heads) == ((256, 1) if s.is_sliding else (512, 1))
        assert s.window == (512 if s.is_sliding else None)
        assert not s.k_eq_v and not s.moe


def test_e4b_and_large_specs():
    e4b = specs(E4B)
    assert [s.index for s in e4b if s.kv_role == "store"] == [22, 23]
    assert all(s.kv_role == "reuse" for s in e4b[24:]) and e4b[24].kv_source == 22
    assert {s.intermediate_size for s in e4b} == {10240}  # no double-wide MLP
    assert {(s.head_dim, s.num_kv_heads) for s in e4b} == {(256, 2), (512, 2)}

    a26 = specs(A26B)
    assert {(s.head_dim, s.num_kv_heads, s.k_eq_v) for s in a26} == {(256, 8, False), (512, 2, True)}
    assert all(s.moe and s.kv_role == "own" for s in a26)
    d31 = specs(D31B)
    assert {(s.head_dim, s.num_kv_heads, s.k_eq_v) for s in d31} == {(256, 16, False), (512, 4, True)}
    assert [s.index for s in d31 if not s.is_sliding] == list(range(5, 60, 6))


def test_rope_tables():
    rope = ModelConfig.from_hf(E2B).text.rope
    sliding, full = rope[SLIDING].inv_freq(), rope[FULL].inv_freq()
    assert sliding.shape == (128,) and full.shape == (256,)
    # Proportional RoPE: 64 rotating frequencies with exponents over the full 512-dim head.
    assert (full[64:] == 0).all() and (full[:64] > 0).all()
    assert abs(full[63].item() - 1e6 ** (-126 / 512)) < 1e-9


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_multimodal_wrapper_reads_the_same_text_config(name):
    wrapped = ModelConfig.from_hf(multimodal(PUBLISHED[name]))
    assert wrapped.model_type == "gemma4"
    assert wrapped.text.layers == specs(PUBLISHED[name])
    assert wrapped.token_ids["image_token_id"] == 258880 and wrapped.dtype == "bfloat16"


@pytest.mark.parametrize("style", list(STYLES))
def test_saved_style_equals_published_style_and_transformers(style, tmp_path):
    """transformers writes per_layer_config on save; we read both styles the same, and as it does."""
    from transformers import Gemma4ForCausalLM

    config = text_config(style)
    saved = json.loads(config.to_json_string())
    assert "per_layer_config" in saved and "global_head_dim" not in saved
    from checkpoints import COMMON

    published = dict(COMMON, **STYLES[style], model_type="gemma4_text")
    ours = specs(saved)
    assert ours == specs(published)

    reference = Gemma4ForCausalLM(config).model
    for spec, layer in zip(ours, reference.layers):
        attn = layer.self_attn
        assert spec.head_dim == attn.head_dim
        assert (
            spec.kv_role
            == {None: "own", "store": "store", "reuse": "reuse"}[config.kv_sharing_modes[spec.index]]
        )
        assert spec.has_kv_weights == hasattr(attn, "k_proj")
        if spec.has_kv_weights:
            assert spec.num_kv_heads * spec.head_dim == attn.k_proj.out_features
            assert spec.k_eq_v == (attn.v_proj is None)
        assert spec.intermediate_size == layer.mlp.intermediate_size
        assert spec.moe == hasattr(layer, "experts")


def test_last_layer_is_forced_full_like_transformers():
    data = dict(E2B, layer_types=[SLIDING] * 35, num_kv_shared_layers=0)
    with pytest.warns(UserWarning, match="last layer"):
        layers = specs(data)
    assert layers[-1].attention_type == FULL


def broken(base, **changes):
    data = copy.deepcopy(base)
    for key, value in changes.items():
        if value is DROP:
            data.pop(key)
        else:
            data[key] = value
    return data


DROP = object()


@pytest.mark.parametrize(
    "data, message",
    [
        (broken(E2B, model_type="llama"), "unsupported model_type 'llama'"),
        (broken(E2B, model_type=DROP), "unsupported model_type None"),
        (broken(E2B, hidden_size=DROP), "missing required field.*hidden_size"),
        (broken(E2B, num_attention_heads=0), "num_attention_heads must be a positive integer"),
        (broken(E2B, layer_types=[SLIDING] * 3), "layer_types has 3 entries but num_hidden_layers is 35"),
        (broken(E2B, layer_types=["local"] * 34 + [FULL]), "unknown layer type"),
        (broken(E2B, num_kv_shared_layers=35), "num_kv_shared_layers=35"),
        (broken(E2B, num_kv_shared_layers=31), "no earlier layer of that type"),
        (broken(E2B, num_key_value_heads=3), "not a multiple of its 3 key/value heads"),
        (broken(A26B, num_experts=DROP), "needs a positive integer num_experts"),
        (broken(A26B, top_k_experts=200), "top_k_experts=200 exceeds num_experts=128"),
        (
            broken(E2B, rope_parameters={SLIDING: {"rope_type": "yarn", "rope_theta": 1.0}}),
            "unsupported rope_type",
        ),
        (broken(E2B, use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
        (
            broken(E2B, per_layer_config={"4": {"head_dim": 256}}, global_head_dim=512),
            "global_head_dim=512 contradicts per_layer_config head_dim 256",
        ),
        (broken(E2B, per_layer_config={"40": {"head_dim": 512}}), "names layer 40"),
        (broken(E2B, per_layer_config={"4": {"intermediate_size": 5}}), "unsupported field"),
        ({"model_type": "gemma4"}, "needs a 'text_config' object"),
    ],
)
def test_bad_configs_are_clear_errors(data, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(data)


def test_config_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(broken(E2B, model_type="gemma2")))
    with pytest.raises(ConfigError, match=r"config.json: unsupported model_type 'gemma2'"):
        ModelConfig.from_file(tmp_path)


def test_multimodal_token_ids_in_transformers_spelling():
    data = multimodal(E2B)
    data.update(eoa_token_index=7, boi_token_id=None)
    ids = ModelConfig.from_hf(data).token_ids
    assert ids["eoa_token_id"] == 7 and ids["boi_token_id"] == 255999

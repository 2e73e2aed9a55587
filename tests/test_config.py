"""Config parsing: both field styles, the per-layer specs, and clear errors for bad configs."""

import copy
import json
import subprocess
import sys

import pytest

from checkpoints import STYLES, text_config
from published_configs import A26B, D31B, E2B, E4B, PUBLISHED, multimodal
from torchgemma.config import FULL, MAX_CONFIG_BYTES, MAX_SIZES, SLIDING, ConfigError, ModelConfig


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
        (broken(A26B, num_experts=DROP), "enable_moe_block=true: num_experts must be a positive integer"),
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


# ── sizes, numbers and token ids that cannot be built: refused at parse, by name ──────────────────

# Gemma 3 27B's published text config (google/gemma-3-27b-it): the largest Gemma 3 must still parse.
GEMMA3_27B = dict(
    model_type="gemma3_text",
    vocab_size=262208,
    hidden_size=5376,
    intermediate_size=21504,
    num_hidden_layers=62,
    num_attention_heads=32,
    num_key_value_heads=16,
    head_dim=128,
    query_pre_attn_scalar=168,
    sliding_window=1024,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    max_position_embeddings=131072,
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
)


def test_largest_published_configs_are_within_the_caps():
    for data in (A26B, D31B, multimodal(D31B), GEMMA3_27B):
        ModelConfig.from_hf(data)


TEXT_SIZES = [
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "global_head_dim",
    "sliding_window",
    "max_position_embeddings",
    "hidden_size_per_layer_input",
    "vocab_size_per_layer_input",
]


# Just past each cap, and far past it (not for the layer count: should the cap regress, per-layer lists
# would be sized in this process; the subprocess test below covers 10^9 layers).
@pytest.mark.parametrize(
    "key, value",
    [(key, MAX_SIZES[key] + 1) for key in TEXT_SIZES]
    + [(key, 10**12) for key in TEXT_SIZES if key != "num_hidden_layers"],
)
def test_oversize_text_fields_are_refused_by_name(key, value):
    with pytest.raises(ConfigError, match=rf"{key}={value} exceeds the largest supported value"):
        ModelConfig.from_hf(broken(E2B, **{key: value}))


@pytest.mark.parametrize(
    "data, message",
    [
        (broken(A26B, num_experts=10**6, top_k_experts=8), "num_experts=1000000 exceeds"),
        (broken(A26B, moe_intermediate_size=10**7), "moe_intermediate_size=10000000 exceeds"),
        (broken(D31B, num_global_key_value_heads=10**5), "num_global_key_value_heads=100000 exceeds"),
        (
            broken(E2B, per_layer_config={"4": {"head_dim": 10**6}}),
            r"per_layer_config\[4\]: head_dim=1000000",
        ),
        (
            broken(E2B, per_layer_config={"4": {"num_key_value_heads": 0}}),
            "num_key_value_heads must be a pos",
        ),
        (broken(GEMMA3_27B, num_hidden_layers=513), "num_hidden_layers=513 exceeds"),
        (broken(GEMMA3_27B, sliding_window_pattern=0), "sliding_window_pattern must be a positive integer"),
        (broken(E2B, layer_types="sliding_attention"), "layer_types must be a list"),
        (broken(E2B, num_kv_shared_layers=None), "num_kv_shared_layers=None"),
        (
            dict(multimodal(E2B), vision_config={"position_embedding_size": 10**9}),
            "vision_config: position_embedding_size=1000000000 exceeds",
        ),
        (
            dict(multimodal(E2B), audio_config={"conv_kernel_size": 10**9}),
            "audio_config: conv_kernel_size=1000000000 exceeds",
        ),
        (
            dict(multimodal(E2B), audio_config={"subsampling_conv_channels": [128, 10**9]}),
            "audio_config: subsampling_conv_channels=1000000000 exceeds",
        ),
    ],
)
def test_oversize_fields_of_every_sub_config_are_refused(data, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(data)


NAN, INF = float("nan"), float("inf")


def rope(**full):
    """E2B's RoPE parameters with the full-attention entry changed."""
    params = copy.deepcopy(E2B["rope_parameters"])
    params[FULL].update(full)
    return params


@pytest.mark.parametrize(
    "data, message",
    [
        *[
            (broken(E2B, rms_norm_eps=v), f"rms_norm_eps must be a positive finite number, got {v!r}")
            for v in (NAN, INF, 0.0, -1e-6, "1e-6")
        ],
        *[
            (broken(E2B, final_logit_softcapping=v), f"final_logit_softcapping must be a positive .*got {v}")
            for v in (0.0, -30.0, NAN, INF)
        ],
        (broken(GEMMA3_27B, attn_logit_softcapping=0.0), "attn_logit_softcapping must be a positive"),
        (broken(GEMMA3_27B, final_logit_softcapping=NAN), "final_logit_softcapping must be a positive"),
        (broken(GEMMA3_27B, query_pre_attn_scalar=0), "query_pre_attn_scalar must be a positive"),
        (broken(GEMMA3_27B, rope_theta=NAN), "rope_theta must be a positive finite number, got nan"),
        (broken(GEMMA3_27B, rope_local_base_freq=-1.0), "rope_local_base_freq must be a positive"),
        (
            broken(GEMMA3_27B, rope_scaling={"rope_type": "linear", "factor": 0.0}),
            r"rope_scaling: factor must",
        ),
        (broken(E2B, rope_parameters=rope(factor=0.0)), r"\['full_attention'\]: factor must be a positive"),
        (broken(E2B, rope_parameters=rope(factor=NAN)), r"\['full_attention'\]: factor must be a positive"),
        (
            broken(E2B, rope_parameters=rope(rope_theta=0)),
            r"rope_theta must be a positive finite number, got 0",
        ),
        (broken(E2B, rope_parameters=rope(rope_theta=INF)), "rope_theta must be a positive finite number"),
        *[
            (
                broken(E2B, rope_parameters=rope(partial_rotary_factor=v)),
                r"partial_rotary_factor must be a number in \(0, 1\]",
            )
            for v in (0.0, -0.25, 1.5, NAN)
        ],
        (
            dict(multimodal(E2B), vision_config={"rms_norm_eps": NAN}),
            "vision_config: rms_norm_eps must be a positive finite number",
        ),
        (
            dict(multimodal(E2B), vision_config={"rope_parameters": {"rope_theta": 0.0}}),
            "vision_config: rope_theta must be a positive finite number",
        ),
        *[
            (dict(multimodal(E2B), audio_config={key: value}), f"audio_config: {key} must be a {rule}")
            for key, value, rule in [
                ("attention_logit_cap", 0.0, "positive finite number"),
                ("gradient_clipping", NAN, "positive finite number"),
                ("rms_norm_eps", -1.0, "positive finite number"),
                ("residual_weight", INF, "finite number"),
                ("attention_invalid_logits_value", -INF, "finite number"),
            ]
        ],
    ],
)
def test_values_that_make_nan_are_refused(data, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(data)


def test_nan_written_in_config_json_is_refused(tmp_path):
    """Python's json module reads the NaN and Infinity literals some writers emit."""
    (tmp_path / "config.json").write_text(json.dumps(broken(E2B, rms_norm_eps=NAN)))
    assert "NaN" in (tmp_path / "config.json").read_text()
    with pytest.raises(
        ConfigError, match="config.json: rms_norm_eps must be a positive finite number, got nan"
    ):
        ModelConfig.from_file(tmp_path)


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(pad_token_id=262144),
            "pad_token_id=262144 is not a token id of the vocabulary .vocab_size=262144",
        ),
        (dict(pad_token_id=-1), "pad_token_id=-1 is not a token id"),
        (dict(pad_token_id=True), "pad_token_id=True is not a token id"),
        (dict(bos_token_id=10**9), "bos_token_id=1000000000 is not a token id"),
        (dict(eos_token_id=[1, 262144]), "eos_token_id=262144 is not a token id"),
        (dict(eos_token_id="1"), "eos_token_id='1' is not a token id"),
    ],
)
def test_special_token_ids_outside_the_vocabulary_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(broken(E2B, **changes))


def test_special_token_ids_inside_the_vocabulary_are_kept():
    text = ModelConfig.from_hf(
        broken(E2B, pad_token_id=262143, bos_token_id=None, eos_token_id=[1, 106])
    ).text
    assert (text.pad_token_id, text.bos_token_id, text.eos_token_id) == (262143, None, (1, 106))


# A child process: a ConfigError for config.json, with the seconds it took, under an address-space
# budget of 256 MiB above what the imports use (Linux: /proc/self/status).
BOUNDED_PARSE = r"""
import json, resource, sys, time
from torchgemma.config import ConfigError, ModelConfig
status = open("/proc/self/status").read()
used = int(status.split("VmSize:")[1].split()[0]) * 1024
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
budget = used + 256 * 2**20 if hard == resource.RLIM_INFINITY else min(used + 256 * 2**20, hard)
resource.setrlimit(resource.RLIMIT_AS, (budget, hard))
start = time.perf_counter()
try:
    ModelConfig.from_file(sys.argv[1])
    print(json.dumps({"error": None}))
except ConfigError as err:
    print(json.dumps({"error": str(err), "seconds": time.perf_counter() - start}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("style", ["gemma4", "gemma3"])
def test_a_billion_layers_fail_fast_in_bounded_memory(tmp_path, style):
    """10^9 layers (what `torchgemma info` and `load` parse first): a ConfigError within 256 MiB and
    1 s of parsing. Before the cap, sizing per-layer lists took minutes and GiBs (MemoryError at a
    4 GiB address-space limit after 62 s)."""
    base = {k: v for k, v in (E2B if style == "gemma4" else GEMMA3_27B).items() if k != "layer_types"}
    (tmp_path / "config.json").write_text(json.dumps(dict(base, num_hidden_layers=10**9)))
    done = subprocess.run(
        [sys.executable, "-c", BOUNDED_PARSE, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "num_hidden_layers=1000000000 exceeds the largest supported value 512" in result["error"]
    assert result["seconds"] < 1.0


def test_oversize_config_file_is_refused_unread(tmp_path):
    path = tmp_path / "config.json"
    with open(path, "wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)  # sparse: no disk used, and never read
    with pytest.raises(ConfigError, match=rf"config.json is {MAX_CONFIG_BYTES + 1:,} bytes, more than any"):
        ModelConfig.from_file(tmp_path)


# --------------------------------------------------------------------------------------------------
# Family knowledge: asked of the config, never by comparing model_type elsewhere

FAMILY_TEXT = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    global_head_dim=8,
    sliding_window=5,
    layer_types=[SLIDING, FULL] * 2,
)
GEMMA3N_TEXT = dict(
    FAMILY_TEXT, num_kv_shared_layers=2, hidden_size_per_layer_input=8, laurel_rank=4, altup_num_inputs=2
)


def family_configs() -> dict[str, ModelConfig]:
    """One tiny config of every supported model_type."""
    from checkpoints import TINY_VISION

    tops = {
        "gemma4": {"vision_config": TINY_VISION},
        "gemma3": {  # SigLIP: 4x4 patches pooled into 2x2 soft tokens
            "vision_config": {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
                              "num_attention_heads": 2, "image_size": 56, "patch_size": 14},
            "mm_tokens_per_image": 4,
        },
        "gemma3n": {"vision_config": {"vocab_offset": 260, "vocab_size": 20}, "audio_config": {
            "vocab_offset": 280, "vocab_size": 20, "hidden_size": 16, "conf_num_hidden_layers": 1,
            "conf_num_attention_heads": 2, "sscp_conv_channel_size": [4, 3]}},
        "gemma4_unified": {
            "vision_config": {"mm_embed_dim": 32, "output_proj_dims": 32, "mm_posemb_size": 16},
            "audio_config": {"audio_embed_dim": 24},
        },
    }  # fmt: skip
    configs = {}
    for family, top in tops.items():
        text = GEMMA3N_TEXT if family == "gemma3n" else FAMILY_TEXT
        configs[family] = ModelConfig.from_hf({"model_type": family, "text_config": text, **top})
        configs[f"{family}_text"] = ModelConfig.from_hf({"model_type": f"{family}_text", **text})
    return configs


def test_family_facts():
    configs = family_configs()
    assert {t: c.family.name for t, c in configs.items()} == {t: t.removesuffix("_text") for t in configs}
    assert {t for t, c in configs.items() if c.text_only} == {t for t in configs if t.endswith("_text")}
    assert {t for t, c in configs.items() if c.takes_media} == {"gemma4", "gemma4_unified", "gemma3"}
    assert {t for t, c in configs.items() if c.encoder_free} == {"gemma4_unified"}
    assert configs["gemma3"].siglip_vision.tokens_per_side == 2
    assert configs["gemma3n"].gemma3n_vision is not None and configs["gemma3n"].gemma3n_audio is not None
    for model_type in ("gemma4", "gemma4_unified", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text"):
        assert configs[model_type].towers_note == "config.json describes none"


def test_checkpoint_names_round_trip_every_tensor():
    """Every parameter and persistent buffer of every family's model has a checkpoint name that
    loads back into it (the names torchgemma.save writes, the names load reads)."""
    import torch

    from torchgemma.model import Gemma

    for model_type, config in family_configs().items():
        with torch.device("meta"):
            model = Gemma(config)
        persistent = set(model.state_dict())
        paths = [n for n, _ in model.named_parameters()]
        paths += [n for n, _ in model.named_buffers() if n in persistent]
        for path in paths:
            name = config.checkpoint_name(path)
            assert name.startswith("model."), (model_type, path)
            assert config.module_path(name) == path, (model_type, path, name)


def test_module_path_follows_each_family():
    configs = family_configs()
    gemma4, gemma3, gemma3n = configs["gemma4"], configs["gemma3"], configs["gemma3n"]
    text = configs["gemma3_text"]
    assert gemma4.module_path("model.language_model.norm.weight") == "language_model.norm.weight"
    assert gemma4.module_path("model.vision_tower.encoder.x") == "vision_tower.encoder.x"
    # Gemma 3's published multimodal layout (transformers 4.5x: vision_model. inside the tower) and
    # transformers 5's; SigLIP's pooling head, unused by Gemma 3, is not built.
    assert gemma3.module_path("language_model.model.norm.weight") == "language_model.norm.weight"
    fc1 = "vision_tower.encoder.layers.0.mlp.fc1.weight"
    assert gemma3.module_path("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight") == fc1
    assert gemma3.module_path("model.vision_tower.encoder.layers.0.mlp.fc1.weight") == fc1
    assert gemma3.module_path("vision_tower.vision_model.head.weight") is None
    projection = "multi_modal_projector.mm_input_projection_weight"
    assert gemma3.module_path(projection) == projection
    # Gemma 3n: both towers are built; the embedders sit in the text model.
    stem = "vision_tower.timm_model.conv_stem.conv.weight"
    assert gemma3n.module_path(f"model.{stem}") == stem
    norm = "language_model.embed_vision.soft_embedding_norm.weight"
    assert gemma3n.module_path("model.embed_vision.soft_embedding_norm.weight") == norm
    embedder = "language_model.embed_audio.embedding.weight"
    assert gemma3n.module_path("model.embed_audio.embedding.weight") == embedder
    assert gemma3n.checkpoint_name(embedder) == "model.embed_audio.embedding.weight"
    # KV-shared layers (2 and 3 of 4) have no k/v weights: published files' copies are skipped.
    assert gemma3n.module_path("model.language_model.layers.3.self_attn.k_proj.weight") is None
    assert gemma3n.module_path("model.language_model.layers.1.self_attn.k_proj.weight") is not None
    # *ForCausalLM and *TextModel (EmbeddingGemma) names; a tied head's copy is skipped.
    assert text.module_path("model.norm.weight") == "language_model.norm.weight"
    assert text.module_path("norm.weight") == "language_model.norm.weight"
    assert text.module_path("lm_head.weight") is None
    untied = ModelConfig.from_hf(dict(FAMILY_TEXT, model_type="gemma3_text", tie_word_embeddings=False))
    assert untied.module_path("lm_head.weight") == "language_model.lm_head.weight"

"""Gemma 3n's text decoder through the same decoder, as config data: parity with transformers.

Both layouts: ``gemma3n_text`` (Gemma3nForCausalLM) and ``gemma3n`` (Gemma3nForConditionalGeneration,
text only here; the towers' own tests are test_gemma3n_audio.py and test_gemma3n_vision.py).
"""

import dataclasses

import pytest
import torch

import torchgemma
from checkpoints import transformers_generate_alone
from gemma3n_checkpoints import TEXT, build, reference_model, text_config, vision_tower_stub
from published_configs import GEMMA3N_PUBLISHED, gemma3n_multimodal
from torchgemma.config import FULL, SLIDING, ModelConfig
from torchgemma.generation import SamplingParams, generate
from torchgemma.info import describe, format_report
from torchgemma.model.layers import normal_quantile

LAYOUTS = ["gemma3n_text", "gemma3n"]
DTYPES = [torch.float32, torch.bfloat16]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3n")
    return {
        layout: build(root / layout, multimodal=layout == "gemma3n", seed=40 + i)
        for i, layout in enumerate(LAYOUTS)
    }


@pytest.fixture(scope="module")
def gen_checkpoints(tmp_path_factory):
    """Small token embeddings: greedy continuations that vary."""
    root = tmp_path_factory.mktemp("gemma3n-gen")
    seeds = {"gemma3n_text": 52, "gemma3n": 51}
    return {
        layout: build(root / layout, multimodal=layout == "gemma3n", seed=seed, embed_scale=0.05)
        for layout, seed in seeds.items()
    }


def padded_batch(seed: int, width: int = 15) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, the second left-padded; ids from the whole vocabulary (media ids 260-299 included)."""
    ids = torch.randint(3, 300, (2, width), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_transformers(checkpoints, layout, dtype):
    folder = checkpoints[layout]
    ref = reference_model(folder, dtype)
    model = torchgemma.load(folder, dtype=dtype, attention="eager")
    ids, mask = padded_batch(seed=7)
    assert ((ids >= 260) & (mask == 1)).any(), "no media-vocabulary id in the batch"
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        theirs = ref(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        ours = model(ids, attention_mask=mask)
        last = model(ids, attention_mask=mask, logits_to_keep=1)
    if dtype == torch.bfloat16:
        assert torch.equal(ours, theirs), f"max |Δ| = {(ours.float() - theirs.float()).abs().max()}"
        assert torch.equal(last, theirs[:, -1:])
    else:
        assert (ours - theirs).abs().max().item() <= 1e-5
        assert (last - theirs[:, -1:]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sdpa_bf16_logits_match_transformers_sdpa(checkpoints, layout):
    """The default attention on both sides: bit for bit, with and without padding and in a prompt
    shorter than the window (where transformers' sdpa skips the sliding mask)."""
    from transformers import AutoModelForCausalLM

    with vision_tower_stub():
        ref = AutoModelForCausalLM.from_pretrained(checkpoints[layout], dtype=torch.bfloat16).eval()
    model = torchgemma.load(checkpoints[layout], dtype=torch.bfloat16)
    assert model.attention == "sdpa"
    for width, pad in ((15, 0), (15, 3), (4, 0)):
        ids, mask = padded_batch(seed=7, width=width)
        mask[1] = 1
        mask[1, :pad] = 0
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        given = mask if pad else None
        with torch.no_grad():
            theirs = ref(input_ids=ids, attention_mask=given, position_ids=positions).logits
            assert torch.equal(model(ids, attention_mask=given), theirs), (width, pad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_matches_transformers(gen_checkpoints, layout, dtype):
    folder = gen_checkpoints[layout]
    ref = reference_model(folder, dtype)
    model = torchgemma.load(folder, dtype=dtype, attention="eager")
    width, new = 12, 18  # more than 3x the sliding window (5)
    ids = torch.randint(3, 300, (3, width), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for row, real in ((1, 3), (2, 8)):
        mask[row, : width - real] = 0
        ids[row, : width - real] = 0

    greedy = SamplingParams(temperature=0)
    ours = generate(model, ids, attention_mask=mask, max_new_tokens=new, sampling=greedy, stop_token_ids=[])
    # Each row against transformers' run of its prompt alone (see transformers_generate_alone).
    theirs = transformers_generate_alone(
        ref, ids, mask, max_new_tokens=new, do_sample=False, eos_token_id=None
    )
    assert torch.equal(ours, theirs), f"\nours   {ours[:, width:]}\ntheirs {theirs[:, width:]}"
    assert all(len(set(row)) >= 5 for row in ours[:, width:].tolist()), "degenerate continuation"

    for prompt in (ids[1:2, -3:], ids[:1]):  # shorter and longer than the window, no mask
        ours = generate(model, prompt, max_new_tokens=new, stop_token_ids=[])
        with torch.no_grad():
            theirs = ref.generate(prompt, max_new_tokens=new, do_sample=False, eos_token_id=None)
        assert torch.equal(ours, theirs), f"\nours   {ours}\ntheirs {theirs}"


def assert_step_logits(ref, model, prompt, prompt_mask) -> None:
    from torchgemma.generation import decode_step, prefill

    with torch.no_grad():
        out = ref.generate(
            prompt, attention_mask=prompt_mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    cache = model.make_cache(prompt.shape[0], prompt.shape[1] + 8)
    logits = prefill(model, prompt, prompt_mask, cache)
    for step, expected in enumerate(out.logits):
        assert torch.equal(logits, expected), f"step {step}: max |Δ| {(logits - expected).abs().max()}"
        logits = decode_step(model, out.sequences[:, prompt.shape[1] + step], cache)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_logits_match_transformers(gen_checkpoints, layout):
    """prefill and decode_step give transformers' generate() next-token logits to the bit (bf16),
    for each prompt alone."""
    folder = gen_checkpoints[layout]
    ref = reference_model(folder, torch.bfloat16)
    model = torchgemma.load(folder, dtype=torch.bfloat16, attention="eager")
    ids, mask = padded_batch(seed=31, width=12)
    for row in range(ids.shape[0]):
        assert_step_logits(ref, model, ids[row : row + 1][:, mask[row].bool()], None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_batch_step_logits_match_transformers(gen_checkpoints, layout):
    """A left-padded batch equals transformers' batched generate() to the bit (bf16) where this
    machine's kernels round a row alike in any call (``RowProbe``); not on bf16 AVX-512 CPUs, where
    transformers' batched rows are not its rows alone (the per-prompt test is the check there)."""
    from torchgemma.generation.invariance import RowProbe

    folder = gen_checkpoints[layout]
    model = torchgemma.load(folder, dtype=torch.bfloat16, attention="eager")
    ids, mask = padded_batch(seed=31, width=12)
    probe = RowProbe.run(model.language_model, ids.numel(), torch.bfloat16)
    if probe.first is not None:
        pytest.skip(f"this machine's bf16 products change a row's bits at {probe.first} rows")
    assert_step_logits(reference_model(folder, torch.bfloat16), model, ids, mask)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cached_decoding_equals_full_forward(checkpoints, layout, backend):
    """Prefill then one token at a time, across the window's wrap-around and the KV-shared layers."""
    model = torchgemma.load(checkpoints[layout], attention=backend)
    ids = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(3))
    cache = model.make_cache(1, 20)
    with torch.no_grad():
        full = model(ids)
        steps = [model(ids[:, :6], cache=cache)] + [
            model(ids[:, t : t + 1], cache=cache) for t in range(6, 20)
        ]
    # float32: a 1-row product and a 20-row one round differently (MKL picks other kernels by row
    # count); on an AVX2-only Zen 3, AltUp's extra products put one logit of ~5.5 at 5.15e-5 (9e-6
    # relative). The same bound as test_multimodal's cached-vs-whole check.
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-4)


def test_config_as_data(checkpoints):
    """Everything that differs is config data, read as transformers reads it."""
    ref = text_config()
    for layout in LAYOUTS:
        config = ModelConfig.from_file(checkpoints[layout])
        text = config.text
        assert config.model_type == layout and config.vision_config is None and config.audio_config is None
        assert [s.intermediate_size for s in text.layers] == TEXT["intermediate_size"]
        assert [s.activation_sparsity for s in text.layers] == TEXT["activation_sparsity_pattern"]
        roles = [None if s.kv_role == "own" else s.kv_role for s in text.layers]
        assert roles == ref.kv_sharing_modes
        assert {s.head_dim for s in text.layers} == {16}  # one geometry for both layer types
        assert {t: (r.rope_type, r.theta) for t, r in text.rope.items()} == {
            t: (p["rope_type"], p["rope_theta"]) for t, p in ref.rope_parameters.items()
        }
        assert (text.altup_num_inputs, text.altup_active_idx, text.laurel_rank) == (4, 0, 4)
        assert text.final_logit_softcapping == 30.0 and text.attention_scale == 1.0
        assert not text.norm_plus_one and text.use_v_norm and not text.use_layer_scalar
        assert text.ple_scales_in_model_dtype and not text.trim_kv_shared_layers
    media = ModelConfig.from_file(checkpoints["gemma3n"]).text.media_vocabularies
    assert [(v.name, v.offset, v.end, v.size) for v in media] == [
        ("vision", 260, 280, 20),
        ("audio", 280, None, 20),
    ]
    assert ModelConfig.from_file(checkpoints["gemma3n_text"]).text.media_vocabularies == ()


def test_published_style_config_defaults():
    """A config as published (RoPE in older keys, one MLP width, no sparsity pattern or layer types)
    reads with transformers' Gemma3nTextConfig defaults."""
    from transformers import Gemma3nTextConfig

    published = dict(
        model_type="gemma3n_text",
        vocab_size=300,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=500_000.0,
        rope_local_base_freq=20_000.0,
        rope_scaling=None,
        num_kv_shared_layers=5,
        query_pre_attn_scalar=256,  # read by neither: Gemma 3n's attention scale is 1
    )
    text = ModelConfig.from_hf(published).text
    ref = Gemma3nTextConfig(**{k: v for k, v in published.items() if k != "model_type"})
    assert list(text.layer_types) == ref.layer_types
    assert [s.intermediate_size for s in text.layers] == ref.intermediate_size
    assert [s.activation_sparsity for s in text.layers] == ref.activation_sparsity_pattern
    assert [None if s.kv_role == "own" else s.kv_role for s in text.layers] == ref.kv_sharing_modes
    assert (text.rope[SLIDING].theta, text.rope[FULL].theta) == (20_000.0, 500_000.0)
    assert (text.sliding_window, text.final_logit_softcapping, text.max_position_embeddings) == (
        ref.sliding_window,
        ref.final_logit_softcapping,
        ref.max_position_embeddings,
    )
    assert (text.laurel_rank, text.altup_num_inputs, text.hidden_size_per_layer_input) == (64, 4, 256)


@pytest.mark.parametrize("name", list(GEMMA3N_PUBLISHED))
def test_published_configs_read_as_transformers(name):
    from transformers import Gemma3nTextConfig

    text = GEMMA3N_PUBLISHED[name]
    ours = ModelConfig.from_hf(gemma3n_multimodal(text)).text
    ref = Gemma3nTextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    assert list(ours.layer_types) == ref.layer_types
    assert [None if s.kv_role == "own" else s.kv_role for s in ours.layers] == ref.kv_sharing_modes
    stores = {ref.layer_types[i]: i for i, mode in enumerate(ref.kv_sharing_modes) if mode == "store"}
    for spec in ours.layers[-ref.num_kv_shared_layers :]:
        assert spec.kv_source == stores[spec.attention_type]  # every reuse layer reads its type's store
    assert [s.intermediate_size for s in ours.layers] == ref.intermediate_size
    assert [s.activation_sparsity for s in ours.layers] == ref.activation_sparsity_pattern
    assert {t: r.theta for t, r in ours.rope.items()} == {
        t: p["rope_theta"] for t, p in ref.rope_parameters.items()
    }
    assert [(v.offset, v.end, v.size) for v in ours.media_vocabularies] == [
        (262144, 262272, 128),
        (262272, None, 128),
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(activation_sparsity_pattern=[1.0] * 6), "in \\[0, 1\\)"),
        (dict(activation_sparsity_pattern=[0.5] * 5), "one value per layer"),
        (dict(intermediate_size=[64] * 5), "intermediate_size has 5 entries"),
        (dict(altup_active_idx=4), "altup_active_idx=4"),
    ],
)
def test_bad_configs_are_named(change, message):
    data = dict(TEXT, model_type="gemma3n_text", **change)
    with pytest.raises(torchgemma.ConfigError, match=message):
        ModelConfig.from_hf(data)


def test_media_vocabulary_must_fit_its_table(checkpoints):
    data = ModelConfig.from_file(checkpoints["gemma3n"]).source
    data = {**data, "audio_config": {**data["audio_config"], "vocab_size": 10}}
    with pytest.raises(torchgemma.ConfigError, match="audio_config: ids 280..299 go to its embedder"):
        ModelConfig.from_hf(data)


def test_both_towers_are_built(checkpoints):
    """The audio conformer and MobileNet-V5 are built, each embedder with its soft tokens' norm
    (the towers' parity: tests/test_gemma3n_audio.py, test_gemma3n_vision.py)."""
    model = torchgemma.load(checkpoints["gemma3n"])
    names = [name for name, _ in model.named_parameters()]
    assert any(name.startswith("vision_tower.timm_model.") for name in names)
    assert any(name.startswith("audio_tower") for name in names)
    assert "language_model.embed_vision.embedding.weight" in names
    assert [n for n in names if "soft_embedding_norm" in n] == [
        "language_model.embed_vision.soft_embedding_norm.weight",
        "language_model.embed_audio.soft_embedding_norm.weight",
    ]
    with pytest.raises(ValueError, match="the prompt has 0 image placeholder tokens but .* 16 soft tokens"):
        model(torch.tensor([[4, 5]]), pixel_values=torch.zeros(1, 3, 32, 32))


def test_kv_shared_layers_own_no_kv_weights(checkpoints):
    model = torchgemma.load(checkpoints["gemma3n_text"])
    for spec, layer in zip(model.config.text.layers, model.language_model.layers):
        assert hasattr(layer.self_attn, "k_proj") == (spec.kv_role != "reuse")
    assert [layer is None for layer in model.make_cache(1, 8).layers] == [False] * 4 + [True] * 2


def test_save_writes_the_checkpoint_names(checkpoints, tmp_path):
    """torchgemma.save writes the tensors it loaded under their own names, and the saved folder
    loads to the same logits."""
    from safetensors import safe_open

    model = torchgemma.load(checkpoints["gemma3n"], attention="eager")
    torchgemma.save(model, tmp_path)
    with safe_open(checkpoints["gemma3n"] / "model.safetensors", "pt") as f:
        published = set(f.keys())
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert set(f.keys()) == published
    ids, mask = padded_batch(seed=9)
    with torch.no_grad():
        again = torchgemma.load(tmp_path, attention="eager")(ids, attention_mask=mask)
        assert torch.equal(again, model(ids, attention_mask=mask))


@pytest.mark.parametrize("p", [0.95, 0.5, 0.25, 0.999])
def test_normal_quantile_is_torch_distributions(p):
    expected = torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(p, dtype=torch.float32))
    assert normal_quantile(p) == expected.item()


# transformers' own parameter counts for the published configs (Gemma3nForCausalLM: the tied head
# counted once): what torchgemma builds and `info` reports. Google's raw counts (about 5B and 8B)
# also hold the MobileNet-V5 and audio towers: the audio tower is counted with the multimodal layout.
PUBLISHED_TEXT_TOTALS = {"e2b": 4_435_182_688, "e4b": 6_835_235_568}
# transformers' count of Gemma3nAudioEncoder with the published audio config (both sizes).
PUBLISHED_AUDIO_TOWER = 681_348_640
# timm's count of mobilenetv5_300m_enc (transformers' Gemma 3n vision tower), both sizes.
PUBLISHED_VISION_TOWER = 294_126_912


@pytest.mark.parametrize("name", list(GEMMA3N_PUBLISHED))
def test_info_counts_the_published_configs_as_transformers(name):
    from transformers import (
        Gemma3nConfig,
        Gemma3nForCausalLM,
        Gemma3nForConditionalGeneration,
        Gemma3nTextConfig,
    )

    text = GEMMA3N_PUBLISHED[name]
    info = describe(ModelConfig.from_hf(text))
    with torch.device("meta"):
        ref = Gemma3nForCausalLM(Gemma3nTextConfig(**{k: v for k, v in text.items() if k != "model_type"}))
    assert info["params_total"] == sum(p.numel() for p in ref.parameters()) == PUBLISHED_TEXT_TOTALS[name]
    layers = text["num_hidden_layers"]
    assert info["params_ple_table"] == 262144 * layers * 256
    assert (info["layers"], info["kv_shared_layers"]) == (layers, text["num_kv_shared_layers"])
    assert info["towers_not_built"] == []

    # The multimodal layout adds the towers' token-id embedders and both towers, counted as
    # transformers counts them (its vision tower timm's, or without timm torchgemma's own: then
    # the published figure, timm's, is what is checked).
    data = gemma3n_multimodal(text)
    info = describe(ModelConfig.from_hf(data))
    with vision_tower_stub(), torch.device("meta"):
        ref = Gemma3nForConditionalGeneration(Gemma3nConfig.from_dict(data))
    assert info["params_total"] == sum(p.numel() for p in ref.parameters())
    audio = sum(p.numel() for p in ref.model.audio_tower.parameters())
    assert info["params_by_tower"]["audio"] == audio == PUBLISHED_AUDIO_TOWER
    vision = sum(p.numel() for p in ref.model.vision_tower.parameters())
    assert info["params_by_tower"]["vision"] == vision == PUBLISHED_VISION_TOWER
    assert info["towers_not_built"] == []
    assert "not built" not in format_report(info)


def test_info_kv_cache_is_what_the_cache_allocates(checkpoints):
    config = ModelConfig.from_file(checkpoints["gemma3n"])
    info = describe(config, context=37, batch=2, dtype=torch.float32)
    assert info["kv_cache_bytes"] == torchgemma.load(checkpoints["gemma3n"]).make_cache(2, 37).nbytes
    assert info["kv_cache_layers"] == {"sliding": 3, "full": 1}


def test_llm_generates_like_transformers(tmp_path):
    """LLM (tokenizer, engine, generation defaults) on a gemma3n checkpoint: transformers' text."""
    from transformers import AutoTokenizer

    from tokenizer_fixtures import VOCAB_SIZE, write_gemma4_tokenizer

    folder = build(
        tmp_path / "llm",
        multimodal=True,
        seed=51,
        embed_scale=0.1,
        vocab_size=VOCAB_SIZE,
        vocab_size_per_layer_input=VOCAB_SIZE - 40,
    )
    write_gemma4_tokenizer(folder)
    llm = torchgemma.LLM(folder)
    hf = AutoTokenizer.from_pretrained(folder)
    ref = reference_model(folder)
    prompts = ["The quick brown fox", "def tokenize(text: str) -> list[int]:\n    return"]
    greedy = dict(max_new_tokens=12, temperature=0, stop_token_ids=[])
    expected = []
    for prompt in prompts:
        ids = torch.tensor([llm.encode(prompt)])
        with torch.no_grad():
            theirs = ref.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
        expected.append(hf.decode(theirs[0, ids.shape[1] :]))
        assert llm.generate(prompt, **greedy) == expected[-1]
    assert llm.generate(prompts, **greedy) == expected  # both at once, through the engine's slots
    assert all(len(set(text)) > 3 for text in expected), "degenerate continuation"


def test_static_decode_step_is_one_graph(checkpoints):
    """AltUp's streams, the media-id embedders and the sparse gates trace without a graph break."""
    from torchgemma.acceleration import decode_step

    torch._dynamo.reset()
    model = torchgemma.load(checkpoints["gemma3n"], dtype=torch.bfloat16)
    cache = model.make_cache(4, 32)
    tokens = torch.tensor([[5], [6], [270], [290]])  # a vision and an audio id among them
    positions, active = torch.tensor([3, 0, 7, 31]), torch.tensor([True, False, True, False])
    explained = torch._dynamo.explain(decode_step)(model, cache, tokens, positions, active)
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


# ── GGUF (llama.cpp's gemma3n architecture) ─────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def gemma3n_gguf(tmp_path_factory):
    """A tiny Gemma3nForCausalLM written as llama.cpp's converter writes one, and what it must read as."""
    from transformers import Gemma3nForCausalLM

    from checkpoints import randomize_
    from gemma3n_checkpoints import GGUF_TEXT, write_gemma3n_gguf

    torch.manual_seed(3)
    model = Gemma3nForCausalLM(text_config(**GGUF_TEXT))
    randomize_(model, 3)
    path = tmp_path_factory.mktemp("gemma3n-gguf") / "tiny-gemma3n.gguf"
    return path, model, write_gemma3n_gguf(path, model, seed=3)


def _gguf_reference(path, expected):
    """transformers' model of the file: the config read from it, the values it holds."""
    import json

    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    from torchgemma.weights.gguf import read_gguf

    fields = json.loads(json.dumps(read_gguf(path).config))  # as a config.json would travel
    reference = Gemma3nForCausalLM(Gemma3nTextConfig(**fields))
    values = dict(expected)
    reference.load_state_dict({**values, "lm_head.weight": values["model.embed_tokens.weight"]})
    reference.set_attn_implementation("eager")
    return reference.eval()


def test_gguf_reads_as_the_hf_checkpoint(gemma3n_gguf):
    from torchgemma.weights.gguf import read_gguf

    path, source, expected = gemma3n_gguf
    ckpt = read_gguf(path)
    ours = ckpt.state_dict()
    assert set(ours) == set(source.state_dict()) - {"lm_head.weight"} == set(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    # The per-layer table comes padded with zero rows to the vocabulary, as llama.cpp reads it.
    assert ours["model.embed_tokens_per_layer.weight"].shape[0] == 1024
    assert not ours["model.embed_tokens_per_layer.weight"][1000:].any()
    # Every other field rebuilds the transformers config the file was converted from.
    ignored = {
        "architectures",
        "dtype",
        "transformers_version",
        "vocab_size_per_layer_input",
        "tie_word_embeddings",
    }
    rebuilt = _gguf_reference(path, expected).config.to_dict()
    original = source.config.to_dict()
    assert {k: v for k, v in rebuilt.items() if k not in ignored} == {
        k: v for k, v in original.items() if k not in ignored
    }
    assert ckpt.config["activation_sparsity_pattern"] == TEXT["activation_sparsity_pattern"]


def test_gguf_loads_with_the_logits_of_its_values(gemma3n_gguf):
    path, _, expected = gemma3n_gguf
    reference = _gguf_reference(path, expected)
    model = torchgemma.load(
        path, attention="eager", quantize=None
    )  # dequantized (a .gguf default: its blocks)
    assert model.config.model_type == "gemma3n_text" and model.dtype == torch.float32
    ids = torch.randint(3, 1024, (2, 11), generator=torch.Generator().manual_seed(1))
    ids[:, 4], ids[1, 7] = 1001, 1023  # past the source's per-layer table (zero rows in the file)
    with torch.no_grad():
        ours, theirs = model(ids), reference(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    tokenizer = torchgemma.load_tokenizer(path)  # Gemma 3's SentencePiece vocabulary, as gemma3 files
    ids = tokenizer.encode("The quick brown fox")
    assert ids[0] == 2 and tokenizer.decode(ids[1:]) == "The quick brown fox"  # <bos> added, as gemma3


@pytest.mark.parametrize("p", [0.95, 0.5, 0.25, 0.0])
def test_gguf_sparsity_scale_reads_back_as_the_config_value(p):
    from torchgemma.weights.gguf import _sparsity

    quantile = torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(p, dtype=torch.float32)).item()
    assert _sparsity(quantile, "x.gguf") == p


# ── the float64 NumPy reference ─────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_agrees_with_the_model(checkpoints, layout):
    """torchgemma.reference (float64 NumPy formulas) against our float64 and float32 models, from
    the checkpoint's files; with the sparse gates or AltUp's correction left out it must not."""
    import numpy as np

    from torchgemma import reference

    folder = checkpoints[layout]
    config = ModelConfig.from_file(folder).text
    weights = reference.weights_from_checkpoint(folder)
    ids, mask = padded_batch(seed=11)
    real = mask.bool()
    expected = reference.forward(weights, config, ids.numpy(), mask.numpy())
    for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 6e-5)):
        model = torchgemma.load(folder, dtype=dtype, attention="eager")
        with torch.no_grad():
            ours = model(ids, attention_mask=mask).double().numpy()
        assert np.abs(ours - expected)[real.numpy()].max() <= tolerance, dtype
    dense = [dataclasses.replace(spec, activation_sparsity=0.0) for spec in config.layers]
    for wrong in (
        dataclasses.replace(config, layers=tuple(dense)),
        dataclasses.replace(config, altup_correct_scale=False),
    ):
        assert np.abs(reference.forward(weights, wrong, ids.numpy(), mask.numpy()) - expected).max() > 1e-2

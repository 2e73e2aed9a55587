"""``torchgemma.reference``, the decoder in float64 NumPy, against our torch model.

First each block function against the module it mirrors, in float64 on random inputs; then the whole
forward on the tiny checkpoints of every style (2 x 17 tokens, sliding window 5, the second row
left-padded by 4) and on Gemma 3 ones; last, deliberately wrong variants of the reference, which
must fail the same comparison.

Our float64 model computes in float64 throughout (the bf16/fp32 models take four steps in float32
as transformers does: RMSNorm, the router's softmax, the RoPE frequencies and angles, the embedding
scales; a float64 model does them in float64). Measured max |Δ| against the reference: blocks up to
8e-15, logits (up to ~30) up to 1.2e-13. The float32 model's logits, on real tokens, against the
reference (Gemma 3 logits reach ~136):

    e2b 2.4e-5   e4b 2.7e-5   26b 9.4e-6   31b 1.4e-5   Gemma 3: 4b 2.5e-5   embedding 2.4e-5

which is float32's own rounding: transformers' float32 logits are exactly as far off.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import torchgemma
from checkpoints import STYLES, padded_batch
from gemma3_checkpoints import gemma3_checkpoint
from torchgemma import reference
from torchgemma.config import FULL, RopeSpec
from torchgemma.model.layers import RMSNorm, apply_rope, eager_attention, gelu_tanh, rope_cos_sin
from torchgemma.model.masks import allowed_keys

pytestmark = pytest.mark.usefixtures("one_thread")

# Blocks of our float64 model against the reference's, on values of order 1: float64 rounding.
EXACT = 1e-12
# Blocks with a reduction or transcendental inside (norms, softmax, RoPE tables): measured <= 8e-15.
FLOAT64_BLOCKS = 1e-12
# Logits (up to ~30 in magnitude) of our float64 model (measured <= 1.2e-13) and float32 model
# (measured <= 2.7e-5, see the module docstring).
LOGITS_FLOAT64_MODEL = 1e-10
LOGITS_FLOAT32_MODEL = 6e-5


@pytest.fixture(scope="module")
def models(text_checkpoints):
    """``models(style, dtype)``: our model of a tiny checkpoint, eager attention, loaded once."""
    loaded = {}

    def get(style: str, dtype: torch.dtype = torch.float64):
        if (style, dtype) not in loaded:
            loaded[style, dtype] = torchgemma.load(text_checkpoints[style], dtype=dtype, attention="eager")
        return loaded[style, dtype]

    return get


def random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def numpy(value: torch.Tensor) -> np.ndarray:
    return value.detach().numpy()


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def layer_weights(model, index: int, under: str = ""):
    """A reader of layer ``index``'s weights, as the reference's blocks read them: by their name in the
    layer (``self_attn.q_proj.weight``), or in its module ``under`` (``q_proj.weight``)."""
    weights = reference.weights_from_model(model)
    prefix = f"{reference.PREFIX}layers.{index}.{under}"
    return lambda name: weights[prefix + name]


def ignore(name, value):
    return value


# ── small parts ─────────────────────────────────────────────────────────────────────────────────


def test_rms_norm_with_and_without_scale(models):
    layer = models("e2b").language_model.layers[0]
    x = random(2, 5, 64) * 3.0
    with_scale = layer.input_layernorm
    ours = numpy(with_scale(tensor(x)))
    theirs = reference.rms_norm(x, numpy(with_scale.weight), with_scale.eps)
    assert max_diff(ours, theirs) < FLOAT64_BLOCKS
    v = random(2, 5, 1, 16, seed=1)
    assert max_diff(numpy(layer.self_attn.v_norm(tensor(v))), reference.rms_norm(v)) < FLOAT64_BLOCKS
    # The weight matters: a wrong one is far off.
    assert max_diff(ours, reference.rms_norm(x)) > 0.1


def test_rms_norm_plus_one_is_gemma3s():
    norm = RMSNorm(32, plus_one=True).double()
    with torch.no_grad():
        norm.weight.copy_(tensor(random(32, seed=2) * 0.3))
    x = random(3, 32, seed=3)
    theirs = reference.rms_norm(x, numpy(norm.weight), norm.eps, plus_one=True)
    assert max_diff(numpy(norm(tensor(x))), theirs) < FLOAT64_BLOCKS
    assert max_diff(theirs, reference.rms_norm(x, numpy(norm.weight), norm.eps)) > 0.5


def test_geglu_is_our_mlp(models):
    for style in ("e2b", "26b"):
        model = models(style)
        for spec in model.config.text.layers:  # both widths of E2B (double-wide on shared layers)
            mlp = model.language_model.layers[spec.index].mlp
            x = random(2, 5, 64, seed=spec.index)
            ours = numpy(mlp(tensor(x)))
            weights = (numpy(m.weight) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
            assert max_diff(ours, reference.geglu(x, *weights)) < EXACT
    x = random(1000, seed=4) * 4
    assert max_diff(numpy(gelu_tanh(tensor(x))), reference.gelu_tanh(x)) < EXACT


def test_embedding_and_soft_cap(models):
    text = models("31b").language_model
    ids = np.array([[3, 17, 299], [0, 5, 8]])
    table = numpy(text.embed_tokens.weight)
    assert max_diff(numpy(text.embed(torch.from_numpy(ids))), reference.embed(ids, table)) < EXACT
    hidden = random(2, 3, 64, seed=5) * 10
    cap = text.config.final_logit_softcapping
    logits = reference.soft_cap(
        reference.linear(reference.rms_norm(hidden, numpy(text.norm.weight)), table), cap
    )
    ours = numpy(text.head(tensor(hidden)))
    assert max_diff(ours, logits) < FLOAT64_BLOCKS * cap
    assert np.abs(logits).max() < cap and reference.soft_cap(logits, None) is logits


# ── rotary embeddings ───────────────────────────────────────────────────────────────────────────


ROPES = {
    "default": RopeSpec("default", 10_000.0, 16),
    "proportional": RopeSpec("proportional", 1_000_000.0, 32, partial_rotary_factor=0.25),
    "linear": RopeSpec("linear", 1_000_000.0, 16, factor=8.0),
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope(kind):
    spec = ROPES[kind]
    freqs = reference.inverse_frequencies(spec)
    # Our frequencies are float32, as transformers computes them, and float64 for a float64 model.
    np.testing.assert_allclose(numpy(spec.inv_freq()), freqs, rtol=1e-6, atol=0)
    np.testing.assert_allclose(numpy(spec.inv_freq(torch.float64)), freqs, rtol=1e-15, atol=0)
    if kind == "proportional":
        assert np.count_nonzero(freqs) == 4 and freqs[1] == 1e6 ** (-2 / 32)  # exponents over all 32
    positions = np.array([[0, 1, 2, 3, 40, 41], [0, 0, 0, 1, 2, 3]])
    x = random(2, 6, 3, spec.head_dim, seed=6)
    rotated = reference.rope(x, positions, freqs)
    # The rotation itself, on float64 tables: half-split pairs, signs.
    angles = np.concatenate([positions[..., None] * freqs] * 2, axis=-1)
    ours = apply_rope(tensor(x), tensor(np.cos(angles)), tensor(np.sin(angles)))
    assert max_diff(numpy(ours), rotated) < EXACT
    # Our tables for a float64 model: float64 frequencies and angles (up to ~40 radians here).
    cos, sin = rope_cos_sin(spec.inv_freq(torch.float64), torch.from_numpy(positions), torch.float64)
    assert max_diff(numpy(apply_rope(tensor(x), cos, sin)), rotated) < FLOAT64_BLOCKS
    # From float32 frequencies (what bf16/fp32 models use) the angles carry float32's rounding.
    cos, sin = rope_cos_sin(spec.inv_freq(), torch.from_numpy(positions), torch.float32)
    assert 1e-9 < max_diff(numpy(apply_rope(tensor(x), cos.double(), sin.double())), rotated) < 2e-5
    # A rotation keeps each pair's norm, and position 0 is the identity.
    assert np.allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1))
    assert np.array_equal(rotated[1, :3], x[1, :3])


# ── masks ───────────────────────────────────────────────────────────────────────────────────────


MASKS = {
    "causal": (None, False, False),
    "sliding": (3, False, False),
    "causal, image blocks": (None, True, False),
    "sliding, image blocks": (3, True, False),
    "encoder": (None, False, True),
    "encoder, sliding": (3, False, True),
}


@pytest.mark.parametrize("case", list(MASKS))
def test_visible_keys_equal_our_masks(case):
    window, blocks, bidirectional = MASKS[case]
    valid = np.ones((2, 9), bool)
    valid[1, :3] = False
    block_ids = np.full((2, 9), -1)
    block_ids[0, 2:6], block_ids[0, 7:9], block_ids[1, 4:8] = 0, 1, 0
    block_ids = block_ids if blocks else None
    theirs = reference.visible_keys(valid, window, block_ids, bidirectional)
    index = torch.arange(9)[None]
    pair = None if block_ids is None else (torch.from_numpy(block_ids),) * 2
    ours = allowed_keys(index, index, torch.from_numpy(valid), window, pair, bidirectional)[:, 0]
    assert np.array_equal(numpy(ours), theirs)


def test_visible_keys_by_hand():
    valid = np.array([[False, True, True, True, True, True]])
    blocks = np.array([[-1, -1, 0, 0, 0, -1]])
    sliding = reference.visible_keys(valid, 2, blocks)[0].astype(int)
    expected = [
        [0, 0, 0, 0, 0, 0],  # a padding query sees no real key
        [0, 1, 0, 0, 0, 0],
        [0, 1, 1, 1, 1, 0],  # the block's first token sees the whole block ahead
        [0, 0, 1, 1, 1, 0],  # ... and, behind it, only the window (2 keys including itself)
        [0, 0, 0, 1, 1, 0],  # the window limits the past inside a block too
        [0, 0, 0, 0, 1, 1],
    ]
    assert sliding.tolist() == expected


# ── attention ───────────────────────────────────────────────────────────────────────────────────


def test_attention_core_is_our_eager_attention():
    query, key, value = random(2, 7, 4, 16, seed=7), random(2, 7, 2, 16, seed=8), random(2, 7, 2, 16, seed=9)
    valid = np.ones((2, 7), bool)
    valid[1, :2] = False
    allowed = reference.visible_keys(valid, 4)
    additive = np.where(allowed, 0.0, np.finfo(np.float64).min)[:, None]
    for scale in (1.0, 16**-0.5):
        ours = eager_attention(
            tensor(query.transpose(0, 2, 1, 3)),
            tensor(key.transpose(0, 2, 1, 3)),
            tensor(value.transpose(0, 2, 1, 3)),
            tensor(additive),
            scale,
        )
        theirs = reference.attention(query, key, value, allowed, scale)
        seen = allowed.any(-1)  # our padding rows average masked keys, the reference's are zero
        assert max_diff(numpy(ours)[seen], theirs[seen]) < EXACT
        assert not theirs[~seen].any()


@pytest.mark.parametrize("style", list(STYLES))
def test_self_attention_is_our_attention(models, style):
    """Every layer's attention, K=V and KV-shared layers included, on the same normed input."""
    model = models(style)
    config, text = model.config.text, model.language_model
    ids, mask = padded_batch(seed=1)
    layout = text.layout(ids, mask.bool(), None, None, None)
    x = random(2, 17, 64, seed=10)
    valid = numpy(mask).astype(bool)
    positions = reference.token_positions(valid)
    ours_kv, theirs_kv = {}, {}
    for spec in config.layers:
        module = text.layers[spec.index].self_attn
        with torch.no_grad():
            ours = module(tensor(x), layout[spec.attention_type], ours_kv, None, None)
        theirs = reference.self_attention(
            x,
            layer_weights(model, spec.index, "self_attn."),
            spec,
            config,
            positions,
            reference.inverse_frequencies(config.rope[spec.attention_type]),
            reference.visible_keys(valid, spec.window),
            theirs_kv,
            ignore,
        )
        assert max_diff(numpy(ours)[valid], theirs[valid]) < FLOAT64_BLOCKS, spec


# ── mixture of experts ──────────────────────────────────────────────────────────────────────────


def test_router_and_experts(models):
    model = models("26b")
    config = model.config.text
    layer = model.language_model.layers[0]
    x = random(34, 64, seed=11) * 2
    with torch.no_grad():
        weights, chosen = layer.router(tensor(x))
    theirs_weights, theirs_chosen = reference.router(
        x,
        numpy(layer.router.proj.weight),
        numpy(layer.router.scale),
        numpy(layer.router.per_expert_scale),
        config.top_k_experts,
        config.rms_norm_eps,
    )
    assert np.array_equal(numpy(chosen), theirs_chosen)
    assert max_diff(numpy(weights), theirs_weights) < FLOAT64_BLOCKS
    assert not np.allclose(theirs_weights.sum(-1), 1.0)  # the per-expert scales apply after renormalising

    # Experts on the same routing: float64 throughout, both of our paths.
    gate_up, down = numpy(layer.experts.gate_up_proj), numpy(layer.experts.down_proj)
    theirs = reference.experts(x, theirs_weights, theirs_chosen, gate_up, down)
    routing = (tensor(theirs_weights), torch.from_numpy(theirs_chosen))
    with torch.no_grad():
        for path in (layer.experts.grouped, layer.experts.gathered):
            assert max_diff(numpy(path(tensor(x), *routing)), theirs) < EXACT
    # By hand for one token: Σ_k w_k · GeGLU_e(x).
    n = 5
    by_hand = sum(
        theirs_weights[n, k] * reference.geglu(x[n], *np.split(gate_up[e], 2), down[e])
        for k, e in enumerate(theirs_chosen[n])
    )
    assert max_diff(theirs[n], by_hand) < EXACT


# ── per-layer embeddings and the decoder layer ──────────────────────────────────────────────────


def test_per_layer_inputs(models):
    model = models("e4b")
    config, text = model.config.text, model.language_model
    ids, _ = padded_batch(seed=2)
    embeds = random(2, 17, 64, seed=12)
    with torch.no_grad():
        ours = text.per_layer_inputs(ids, tensor(embeds))
    theirs, _ = reference.per_layer_inputs(
        numpy(ids),
        embeds,
        numpy(text.embed_tokens_per_layer.weight),
        numpy(text.per_layer_model_projection.weight),
        numpy(text.per_layer_projection_norm.weight),
        config,
    )
    assert theirs.shape == (2, 17, config.num_hidden_layers, 8)
    assert max_diff(numpy(ours), theirs) < FLOAT64_BLOCKS


@pytest.mark.parametrize("style", list(STYLES))
def test_decoder_layer_is_ours(models, style):
    """Each layer alone (per-layer gate, dense MLP beside the experts, layer scalar included), on a
    random stream and, for E2B/E4B, random per-layer inputs."""
    model = models(style)
    config, text = model.config.text, model.language_model
    ids, mask = padded_batch(seed=3)
    layout = text.layout(ids, mask.bool(), None, None, None)
    valid = numpy(mask).astype(bool)
    positions = reference.token_positions(valid)
    x = random(2, 17, 64, seed=13) * 5
    ple = random(2, 17, 8, seed=14) if config.has_per_layer_inputs else None
    ours_kv, theirs_kv = {}, {}
    for spec in config.layers:
        with torch.no_grad():
            ours = text.layers[spec.index](
                tensor(x),
                None if ple is None else tensor(ple),
                layout[spec.attention_type],
                ours_kv,
                None,
                None,
            )
        theirs = reference.decoder_layer(
            x,
            ple,
            layer_weights(model, spec.index),
            spec,
            config,
            positions,
            reference.inverse_frequencies(config.rope[spec.attention_type]),
            reference.visible_keys(valid, spec.window),
            theirs_kv,
            ignore,
        )
        assert max_diff(numpy(ours)[valid], theirs[valid]) < FLOAT64_BLOCKS, spec


# ── the whole forward ───────────────────────────────────────────────────────────────────────────


def whole(model, ids, mask, weights=None, config=None, **kwargs):
    """Our logits and the reference's, real tokens only."""
    with torch.no_grad():
        ours = model.language_model(ids, attention_mask=mask, **kwargs).double()
    extra = {k: numpy(v) for k, v in kwargs.items()}
    theirs = reference.forward(
        weights if weights is not None else reference.weights_from_model(model),
        config or model.config.text,
        numpy(ids),
        numpy(mask),
        **extra,
    )
    real = numpy(mask).astype(bool)
    return numpy(ours)[real], theirs[real]


@pytest.mark.parametrize("style", list(STYLES))
def test_forward_equals_our_models(models, text_checkpoints, style):
    """Our float64 and float32 models against the reference, reading weights from the checkpoint
    files (not through our loader)."""
    weights = reference.weights_from_checkpoint(text_checkpoints[style])
    ids, mask = padded_batch(seed=list(STYLES).index(style))
    ours, theirs = whole(models(style, torch.float64), ids, mask, weights)
    assert theirs.shape == (17 + 13, 300) and np.abs(theirs).max() > 10
    assert max_diff(ours, theirs) < LOGITS_FLOAT64_MODEL
    ours, theirs = whole(models(style, torch.float32), ids, mask, weights)
    assert max_diff(ours, theirs) < LOGITS_FLOAT32_MODEL


def test_weights_from_checkpoint_equal_our_loaded_weights(models, text_checkpoints):
    for style in STYLES:
        from_files = reference.weights_from_checkpoint(text_checkpoints[style])
        from_model = reference.weights_from_model(models(style))
        assert sorted(from_files) == sorted(from_model)
        assert all(np.array_equal(from_files[k], from_model[k]) for k in from_model)


@pytest.mark.parametrize("style", ["26b", "31b"])
def test_forward_with_image_blocks(models, style):
    """Bidirectional image blocks (26B/31B "vision" mode) on sliding layers, one longer than the window."""
    ids, mask = padded_batch(seed=4)
    blocks = torch.full((2, 17), -1)
    blocks[0, 3:11], blocks[0, 13:15], blocks[1, 6:9] = 0, 1, 0
    ours, theirs = whole(models(style), ids, mask, vision_blocks=blocks)
    assert max_diff(ours, theirs) < LOGITS_FLOAT64_MODEL
    _, causal = whole(models(style), ids, mask)
    assert max_diff(theirs, causal) > 1.0  # the blocks change the logits


def module_outputs(model, ids, mask) -> dict:
    """What every module of our model returned in one forward, by module name."""
    outputs = {}
    hooks = [
        module.register_forward_hook(lambda m, i, o, name=name: outputs.__setitem__(name, o))
        for name, module in model.named_modules()
    ]
    try:
        with torch.no_grad():
            model(ids, attention_mask=mask)
    finally:
        for hook in hooks:
            hook.remove()
    return outputs


def test_record_names_are_our_module_names(models):
    """Every recorded output is the output of our module of that name (less ``model.``)."""
    for style in ("e2b", "26b"):
        model = models(style)
        ids, mask = padded_batch(seed=5)
        outputs = module_outputs(model, ids, mask)
        record = {}
        reference.forward(
            reference.weights_from_model(model), model.config.text, numpy(ids), numpy(mask), record=record
        )
        real = numpy(mask).astype(bool)
        for key, value in record.items():
            assert key.startswith("model.")
            ours = outputs[key.removeprefix("model.")]
            if key.endswith(".router"):  # (weights, expert ids)
                assert np.array_equal(numpy(ours[1])[real.ravel()], value[1][real.ravel()]), key
                ours, value = ours[0], value[0]
            ours = numpy(ours)
            assert ours.shape == value.shape, key
            # Real tokens only: (B, T, ...) outputs, or (B·T, ...) where the module flattens them.
            if ours.shape[:2] == real.shape:
                ours, value = ours[real], value[real]
            elif ours.shape[0] == real.size:
                ours, value = ours[real.ravel()], value[real.ravel()]
            scale = max(1.0, np.abs(value).max())
            assert max_diff(ours, value) < FLOAT64_BLOCKS * scale, key
        layers = [f"model.language_model.layers.{i}" for i in range(model.config.text.num_hidden_layers)]
        expected = [
            f"{layer}.{part}" for layer in layers for part in ("self_attn", "mlp", "self_attn.q_norm")
        ]
        if style == "26b":
            expected += [f"{layer}.{part}" for layer in layers for part in ("router", "experts")]
        else:
            expected += [f"{layer}.per_layer_input_gate" for layer in layers]
            expected += ["model.language_model.per_layer_projection_norm"]
        assert set(expected + layers) <= set(record)


# ── Gemma 3 ─────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("style", ["4b", "embedding"])
def test_forward_equals_gemma3(tmp_path, style):
    """(1 + w) norms, query_pre_attn_scalar, linear RoPE, no V-norm or layer scalar; and an encoder."""
    folder = gemma3_checkpoint(tmp_path, style, seed=21)
    ids, mask = padded_batch(seed=6)
    config = torchgemma.ModelConfig.from_file(folder).text
    weights = reference.weights_from_checkpoint(folder)
    for dtype, tolerance in ((torch.float64, LOGITS_FLOAT64_MODEL), (torch.float32, LOGITS_FLOAT32_MODEL)):
        model = torchgemma.load(folder, dtype=dtype, attention="eager")
        ours, theirs = whole(model, ids, mask, weights, config)
        assert max_diff(ours, theirs) < tolerance, dtype


# ── the comparison can fail ─────────────────────────────────────────────────────────────────────


def with_layers(config, changes):
    return dataclasses.replace(
        config, layers=tuple(dataclasses.replace(s, **changes(s)) for s in config.layers)
    )


WRONG = {
    # Gemma 4 scores with scale 1 (the QK norms replace 1/sqrt(d)).
    "scale 1/sqrt(d)": ("31b", lambda c: dataclasses.replace(c, attention_scale=16**-0.5)),
    "no V-norm": ("31b", lambda c: dataclasses.replace(c, use_v_norm=False)),
    "no layer scalar": ("e4b", lambda c: dataclasses.replace(c, use_layer_scalar=False)),
    # Proportional RoPE rotates a quarter of the pairs of full layers; rotating all is wrong.
    "full RoPE on full layers": (
        "26b",
        lambda c: dataclasses.replace(c, rope={**c.rope, FULL: RopeSpec("default", 1e6, 32)}),
    ),
    "window one wider": (
        "31b",
        lambda c: with_layers(c, changes=lambda s: {"window": s.window and s.window + 1}),
    ),
    # Shared layers read the last layer of their type before the shared ones, not the first.
    "KV from the first layer of the type": (
        "e2b",
        lambda c: with_layers(
            c,
            changes=lambda s: (
                {"kv_source": c.layer_types.index(s.attention_type)} if s.kv_role == "reuse" else {}
            ),
        ),
    ),
}


@pytest.mark.parametrize("variant", list(WRONG))
def test_a_wrong_reference_fails(models, variant):
    style, change = WRONG[variant]
    model = models(style)
    ids, mask = padded_batch(seed=7)
    ours, right = whole(model, ids, mask)
    _, wrong = whole(model, ids, mask, config=change(model.config.text))
    assert max_diff(ours, right) < LOGITS_FLOAT64_MODEL
    assert max_diff(ours, wrong) > 1000 * LOGITS_FLOAT64_MODEL, variant


def test_missing_weight_is_named(models):
    weights = reference.weights_from_model(models("31b"))
    del weights["model.language_model.layers.2.self_attn.k_norm.weight"]
    with pytest.raises(KeyError, match=r"layers\.2\.self_attn\.k_norm\.weight"):
        reference.forward(weights, models("31b").config.text, np.array([[5, 6, 7]]))

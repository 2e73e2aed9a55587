"""Gemma 3 text models through the same decoder, as config data: parity with transformers."""

import pytest
import torch

import torchgemma
from checkpoints import randomize_
from gemma3_checkpoints import COMMON, GEMMA3_STYLES, gemma3_checkpoint
from torchgemma.config import FULL, SLIDING, ModelConfig


@pytest.fixture(scope="module")
def gemma3_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    return {
        style: gemma3_checkpoint(root / style, style, seed=i + 20) for i, style in enumerate(GEMMA3_STYLES)
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("style", list(GEMMA3_STYLES))
def test_gemma3_logits_match_transformers(gemma3_checkpoints, style, dtype):
    from transformers import AutoModelForCausalLM

    folder = gemma3_checkpoints[style]
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
    model = torchgemma.load(folder, dtype=dtype, attention="eager")
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 300, (2, 15), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kwargs = {}
    if style != "embedding":  # an encoder is not run with generate()'s positions
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    else:
        mask[:] = 1
    with torch.no_grad():
        theirs = ref(input_ids=ids, attention_mask=mask, **kwargs).logits
        ours = model(ids, attention_mask=mask)
    if dtype == torch.bfloat16:
        assert torch.equal(ours, theirs), f"max |Δ| = {(ours.float() - theirs.float()).abs().max()}"
    else:
        assert (ours - theirs).abs().max().item() <= 1e-5


def test_gemma3_config_as_data(gemma3_checkpoints):
    text = ModelConfig.from_file(gemma3_checkpoints["4b"]).text
    assert text.norm_plus_one and not text.use_v_norm and not text.use_layer_scalar
    assert text.attention_scale == 24**-0.5 and text.final_logit_softcapping == 30.0
    assert text.rope[FULL].rope_type == "linear" and text.rope[FULL].factor == 8.0
    assert {s.head_dim for s in text.layers} == {16}  # one geometry for both types
    assert text.layer_types[-1] == SLIDING  # Gemma 3 does not force a full last layer
    embedding = ModelConfig.from_file(gemma3_checkpoints["embedding"]).text
    assert embedding.bidirectional and embedding.sliding_window == 5 // 2 + 1


def test_gemma3_old_style_rope_keys():
    data = dict(
        COMMON,
        model_type="gemma3_text",
        num_hidden_layers=6,
        rope_theta=500_000.0,
        rope_local_base_freq=20_000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    )
    text = ModelConfig.from_hf(data).text
    assert (text.rope[SLIDING].theta, text.rope[SLIDING].rope_type) == (20_000.0, "default")
    assert (text.rope[FULL].theta, text.rope[FULL].rope_type, text.rope[FULL].factor) == (
        500_000.0,
        "linear",
        4.0,
    )
    assert text.layer_types == (SLIDING,) * 5 + (FULL,)


def test_gemma3_cache_decoding_equals_full_forward(gemma3_checkpoints):
    model = torchgemma.load(gemma3_checkpoints["4b"], attention="eager")
    ids = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(3))
    cache = model.make_cache(1, 20)
    with torch.no_grad():
        full = model(ids)
        steps = [model(ids[:, :6], cache=cache)] + [
            model(ids[:, t : t + 1], cache=cache) for t in range(6, 20)
        ]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=5e-4)


def test_bidirectional_model_refuses_a_cache(gemma3_checkpoints):
    model = torchgemma.load(gemma3_checkpoints["embedding"], attention="eager")
    with pytest.raises(ValueError, match="cannot use a KV cache"):
        model(torch.tensor([[4, 5, 6]]), cache=model.make_cache(1, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemma3_multimodal_layout_text_logits(tmp_path, dtype):
    """model_type gemma3 (Gemma3ForConditionalGeneration): its text model loads; the SigLIP tower is skipped."""
    from transformers import (
        AutoModelForCausalLM,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        SiglipVisionConfig,
    )

    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    text = {**COMMON, **GEMMA3_STYLES["4b"]}
    config = Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4)
    model = Gemma3ForConditionalGeneration(config)
    randomize_(model, 31)
    model.save_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, attn_implementation="eager").eval()
    ours = torchgemma.load(tmp_path, dtype=dtype, attention="eager")
    assert ours.config.model_type == "gemma3" and ours.config.vision_config is None
    ids = torch.randint(3, 300, (1, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs, mine = ref(input_ids=ids).logits, ours(ids)
    if dtype == torch.bfloat16:
        assert torch.equal(mine, theirs)
    else:
        assert (mine - theirs).abs().max().item() <= 1e-5

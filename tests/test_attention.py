"""The sdpa attention backend against transformers' default (``attn_implementation="sdpa"``).

Measured on the tiny checkpoints of every style (2 x 17 tokens, window 5, row 2 left-padded by 4):
bf16 logits are bit-identical to transformers' sdpa path in unpadded and padded prefill, with
``logits_to_keep=1`` and in cached decode; float32 logits are identical in prefill, and within
1.4e-5 where one-row matmuls are involved (keep-1 and decode: transformers' memory-mapped weights
are not 64-byte aligned, and MKL's one-row GEMV rounds differently on them).
"""

from __future__ import annotations

import pytest
import torch

import torchgemma
from checkpoints import COMMON, STYLES, padded_batch, randomize_

DTYPES = [torch.float32, torch.bfloat16]


def transformers_sdpa(folder, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def check(ours: torch.Tensor, theirs: torch.Tensor, dtype, float32_tolerance: float = 0.0):
    if dtype == torch.bfloat16:
        assert torch.equal(ours, theirs), f"max |Δ| {(ours.float() - theirs.float()).abs().max()}"
    else:
        assert (ours - theirs).abs().max() <= float32_tolerance


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", list(STYLES))
def test_sdpa_matches_transformers_sdpa(text_checkpoints, style, dtype):
    from transformers import DynamicCache

    folder = text_checkpoints[style]
    ref = transformers_sdpa(folder, dtype)
    model = torchgemma.load(folder, dtype=dtype)
    assert model.attention == "sdpa"  # the default
    ids, mask = padded_batch(seed=0)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    real = mask.bool()
    with torch.no_grad():
        check(model(ids[:1]), ref(input_ids=ids[:1]).logits, dtype, 1e-5)
        padded = model(ids, attention_mask=mask)
        theirs = ref(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        check(padded[real], theirs[real], dtype, 1e-5)
        check(model(ids[:1], logits_to_keep=1), ref(input_ids=ids[:1], logits_to_keep=1).logits, dtype, 2e-5)
        cache, ref_cache = model.make_cache(1, 17), DynamicCache(config=ref.config)
        ours = [model(ids[:1, :7], cache=cache)] + [
            model(ids[:1, t : t + 1], cache=cache) for t in range(7, 17)
        ]
        theirs = [ref(input_ids=ids[:1, :7], past_key_values=ref_cache, use_cache=True).logits]
        theirs += [ref(input_ids=ids[:1, t : t + 1], past_key_values=ref_cache).logits for t in range(7, 17)]
    check(torch.cat(ours, 1), torch.cat(theirs, 1), dtype, 5e-5)


@pytest.mark.parametrize("style", ["e2b", "26b"])
def test_sdpa_and_eager_agree(text_checkpoints, style):
    """The two backends are the same math: float64 logits agree to rounding."""
    folder = text_checkpoints[style]
    ids, mask = padded_batch(seed=1)
    out = {}
    for backend in ("sdpa", "eager"):
        model = torchgemma.load(folder, dtype=torch.float64, attention=backend)
        with torch.no_grad():
            out[backend] = model(ids, attention_mask=mask)
    real = mask.bool()
    assert (out["sdpa"][real] - out["eager"][real]).abs().max() < 1e-10
    model.set_attention("sdpa")
    assert model.attention == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        model.set_attention("flash")
    with pytest.raises(ValueError, match="unknown attention 'flex'"):
        torchgemma.load(folder, attention="flex")


def test_head_dim_512_full_layers(tmp_path):
    """Full layers at Gemma 4's real head dim (512; sliding 256): sdpa on CPU, against transformers'
    sdpa and eager paths."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(
        **{**COMMON, "head_dim": 256, "num_attention_heads": 2, "sliding_window": 6},
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        num_key_value_heads=1,
        global_head_dim=512,
        hidden_size_per_layer_input=0,
    )
    torch.manual_seed(0)
    reference = Gemma4ForCausalLM(config)
    randomize_(reference, seed=4)
    reference.save_pretrained(tmp_path)
    ids, mask = padded_batch(seed=2, length=20)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    real = mask.bool()
    for backend in ("sdpa", "eager"):
        from transformers import AutoModelForCausalLM

        model = torchgemma.load(tmp_path, dtype=torch.bfloat16, attention=backend)
        assert model.config.text.layers[1].head_dim == 512
        ref = AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=torch.bfloat16, attn_implementation=backend
        )
        with torch.no_grad():
            theirs = ref(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            assert torch.equal(model(ids, attention_mask=mask)[real], theirs[real]), backend

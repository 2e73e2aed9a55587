"""The KV cache: chunked prefill and decode far past the sliding window's wrap-around."""

import pytest
import torch

import torchgemma
from checkpoints import STYLES, reference_model
from torchgemma.cache import FullLayerCache, SlidingLayerCache

WINDOW = 5  # the tiny checkpoints' sliding window


def batch(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (2, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return ids, mask


def run_in_chunks(model, ids, mask, chunks: list[int], max_len: int):
    cache = model.make_cache(ids.shape[0], max_len)
    out, start = [], 0
    with torch.no_grad():
        for size in chunks:
            out.append(
                model(ids[:, start : start + size], attention_mask=mask[:, start : start + size], cache=cache)
            )
            start += size
    assert start == ids.shape[1]
    return torch.cat(out, dim=1), cache


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize(
    "chunks",
    [
        [7] + [1] * 23,  # prefill past the window, then decode through four wrap-arounds
        [3, 9, 2, 1, 1, 6, 4, 1, 3],  # chunks shorter and longer than the window
        [1] * 30,  # token by token from the start
    ],
    ids=["prefill+decode", "mixed-chunks", "token-by-token"],
)
def test_cached_equals_full_forward(text_checkpoints, style, chunks):
    model = torchgemma.load(text_checkpoints[style], dtype=torch.float32)
    ids, mask = batch(sum(chunks))
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
    cached, cache = run_in_chunks(model, ids, mask, chunks, max_len=40)
    valid = mask.bool()  # padding positions attend to nothing real: their outputs are meaningless
    # Reduction order differs between shapes (one row vs many): logits up to ±30 agree to ~1e-4.
    torch.testing.assert_close(cached[valid], full[valid], rtol=0, atol=5e-4)
    assert cache.length == ids.shape[1]
    assert cache.next_position.tolist() == mask.sum(-1).tolist()


@pytest.mark.parametrize("style", list(STYLES))
def test_cached_decode_matches_transformers_cached_decode(text_checkpoints, style):
    """bf16: our ring-buffer decode equals transformers' DynamicCache decode to the bit."""
    from transformers import DynamicCache

    folder = text_checkpoints[style]
    model = torchgemma.load(folder, dtype=torch.bfloat16)
    ref = reference_model(folder, torch.bfloat16)
    ids, mask = batch(22, seed=3)
    prefill = 7
    ours, _ = run_in_chunks(model, ids, mask, [prefill] + [1] * (22 - prefill), max_len=22)

    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    ref_cache = DynamicCache(config=ref.config)
    steps = [(0, prefill)] + [(t, t + 1) for t in range(prefill, 22)]
    with torch.no_grad():
        theirs = torch.cat(
            [
                ref(
                    input_ids=ids[:, a:b],
                    attention_mask=mask[:, :b],
                    position_ids=positions[:, a:b],
                    past_key_values=ref_cache,
                    use_cache=True,
                ).logits
                for a, b in steps
            ],
            dim=1,
        )
    assert torch.equal(ours, theirs), f"max |Δ| = {(ours.float() - theirs.float()).abs().max()}"


def test_cache_layout_is_the_architectural_minimum(text_checkpoints):
    """Full layers: max_len slots; sliding layers: window slots; KV-shared layers: nothing."""
    model = torchgemma.load(text_checkpoints["e2b"])
    cache = model.make_cache(batch_size=3, max_len=64)
    for spec, layer_cache in zip(model.config.text.layers, cache.layers):
        if spec.kv_role == "reuse":
            assert layer_cache is None
        elif spec.is_sliding:
            assert isinstance(layer_cache, SlidingLayerCache)
            assert layer_cache.keys.shape == (3, spec.num_kv_heads, WINDOW, spec.head_dim)
        else:
            assert isinstance(layer_cache, FullLayerCache)
            assert layer_cache.keys.shape == (3, spec.num_kv_heads, 64, spec.head_dim)
    # e2b tiny: layers 0-5 own their K/V ([s, s, s, s, f, s]): 5 sliding (5 slots x 16 dims) and
    # 1 full (64 slots x 32 dims), 1 KV head; K and V, batch 3, float32.
    assert cache.nbytes == 2 * 3 * 4 * (5 * 5 * 16 + 1 * 64 * 32)


def test_cache_overflow_and_batch_mismatch_are_errors(text_checkpoints):
    model = torchgemma.load(text_checkpoints["31b"])
    cache = model.make_cache(batch_size=1, max_len=8)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8, 9, 10]]), cache=cache)
        with pytest.raises(ValueError, match="cache holds 8 tokens; 6 are used and this call adds 3"):
            model(torch.tensor([[5, 6, 7]]), cache=cache)
        with pytest.raises(ValueError, match="batch size 1"):
            model(torch.tensor([[5], [6]]), cache=cache)


def test_cache_reset_reuses_buffers(text_checkpoints):
    model = torchgemma.load(text_checkpoints["e4b"])
    ids, mask = batch(12)
    first, cache = run_in_chunks(model, ids, mask, [4, 8], max_len=12)
    cache.reset()
    with torch.no_grad():
        again = torch.cat(
            [model(ids[:, :4], mask[:, :4], cache=cache), model(ids[:, 4:], mask[:, 4:], cache=cache)], 1
        )
    assert torch.equal(first, again)

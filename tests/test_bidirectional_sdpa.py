"""Bidirectional (encoder) Gemma 3 text models, EmbeddingGemma-like, under sdpa: the same kernel
calls as transformers' sdpa path, and so the same bits.

transformers 5.23 always hands sdpa a mask here, even without padding: Gemma 3 builds the masks
with ``create_causal_mask`` plus an ``or_mask_function`` (every key on full layers, the window
both ways on sliding ones), which turns off its mask skipping (and ``Gemma3TextConfig`` has no
``is_causal`` that would route it to ``create_bidirectional_mask``, whose skip could apply). Ours
passes a mask always too (``masks.uncached_keys``: never "trivial" when bidirectional).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchgemma
from gemma3_checkpoints import gemma3_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return gemma3_checkpoint(tmp_path_factory.mktemp("bidirectional") / "embedding", "embedding", seed=7)


class SdpaCalls:
    """Records each scaled_dot_product_attention call: query shape, whether a mask came and
    whether it allowed every key, is_causal."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple] = []
        original = F.scaled_dot_product_attention

        def spy(query, key, value, attn_mask=None, is_causal=False, **kwargs):
            everything = None if attn_mask is None else bool(attn_mask.all())
            self.calls.append((tuple(query.shape), attn_mask is not None, everything, is_causal))
            return original(query, key, value, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

        monkeypatch.setattr(F, "scaled_dot_product_attention", spy)

    def take(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls


def _masks(length: int) -> dict[str, torch.Tensor | None]:
    right, left = torch.ones(2, length, dtype=torch.long), torch.ones(2, length, dtype=torch.long)
    right[1, length - 2 :] = 0
    left[1, :2] = 0
    return {"none": None, "right": right, "left": left}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("length", [3, 11])  # within the sliding window (3 of 5) and past it
def test_bidirectional_sdpa_equals_transformers_sdpa(encoder, monkeypatch, dtype, length):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(encoder, dtype=dtype).eval()
    assert reference.config._attn_implementation == "sdpa"
    model = torchgemma.load(encoder, dtype=dtype)
    assert model.attention == "sdpa" and model.config.text.bidirectional
    ids = torch.randint(3, 300, (2, length), generator=torch.Generator().manual_seed(length))
    sdpa = SdpaCalls(monkeypatch)
    for name, mask in _masks(length).items():
        with torch.no_grad():
            if mask is None:
                theirs = reference(input_ids=ids).logits
            else:  # positions counted over the real tokens, as ours
                positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
                theirs = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            their_calls = sdpa.take()
            ours = model(ids, attention_mask=mask)
            our_calls = sdpa.take()
        # The same dispatch: a mask on every layer (all-True on full layers without padding).
        assert our_calls == their_calls, name
        assert all(has_mask for _, has_mask, _, _ in our_calls)
        real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        if dtype == torch.bfloat16:
            assert torch.equal(ours[real], theirs[real]), name
        else:
            assert (ours[real] - theirs[real]).abs().max().item() <= 1e-5, name

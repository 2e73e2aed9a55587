"""The KV cache: slots, chunked prefill and decode far past the sliding window's wrap-around,
rollback, freeing and reuse, and the static decode step."""

import pytest
import torch

import torchgemma
from checkpoints import STYLES, reference_model
from torchgemma.cache import FullLayerCache, SlidingLayerCache
from torchgemma.generation.invariance import RowProbe

WINDOW = 5  # the tiny checkpoints' sliding window
BACKENDS = ["eager", "sdpa"]

pytestmark = pytest.mark.usefixtures("one_thread")


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


CHUNKINGS = {
    "prefill+decode": [7] + [1] * 23,  # prefill past the window, then decode through four wrap-arounds
    "mixed-chunks": [3, 9, 2, 1, 1, 6, 4, 1, 3],  # shorter and longer than the window; row 1 starts empty
    "token-by-token": [1] * 30,
}


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("chunks", list(CHUNKINGS))
def test_cached_equals_full_forward(text_checkpoints, style, chunks):
    model = torchgemma.load(text_checkpoints[style], dtype=torch.float32, attention="eager")
    ids, mask = batch(sum(CHUNKINGS[chunks]))
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
    cached, cache = run_in_chunks(model, ids, mask, CHUNKINGS[chunks], max_len=40)
    valid = mask.bool()  # padding positions attend to nothing real: their outputs are meaningless
    # Reduction order differs between shapes (one row vs many): logits up to ±30 agree to ~1e-4.
    torch.testing.assert_close(cached[valid], full[valid], rtol=0, atol=5e-4)
    # Each slot holds its row's real tokens only: padding is not stored.
    assert cache.lengths == mask.sum(-1).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("style", list(STYLES))
def test_cached_equals_full_forward_in_float64(text_checkpoints, style, backend):
    """In float64 rounding vanishes: the slot layout (padding skipped, ring reads) is the same math."""
    model = torchgemma.load(text_checkpoints[style], dtype=torch.float64, attention=backend)
    ids, mask = batch(24, seed=4)
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
    cached, _ = run_in_chunks(model, ids, mask, [7, 2] + [1] * 15, max_len=30)
    valid = mask.bool()
    assert (cached[valid] - full[valid]).abs().max() < 1e-10


def two_slots_and_transformers_alone(model, ref, device="cpu"):
    """Two sequences (7 and 3 tokens) in two slots, fed 15 tokens each (teacher forcing), decoded
    together as the engine batches them (in one call where this machine's kernels round a row alike
    in any call, else one call per slot: ``RowProbe``); for each, (our logits, transformers'
    DynamicCache logits of that sequence alone), and whether they ran together."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (1, n), generator=gen).to(device) for n in (7, 3)]
    steps = 15
    new = torch.randint(3, 300, (2, steps), generator=gen).to(device)
    cache = model.make_cache(2, 7 + steps)
    together = not RowProbe.run(model.language_model, 2, torch.bfloat16).split([1, 1])
    with torch.no_grad():
        ours = [[model(prompt, cache=cache, slots=[row])] for row, prompt in enumerate(prompts)]
        for t in range(steps):
            if together:
                logits = model(new[:, t : t + 1], cache=cache)  # rows 0 and 1 -> slots 0 and 1
            else:
                logits = torch.cat(
                    [model(new[r : r + 1, t : t + 1], cache=cache, slots=[r]) for r in range(2)]
                )
            for row in range(2):
                ours[row].append(logits[row : row + 1])
    assert cache.lengths == [7 + steps, 3 + steps]
    pairs = []
    for row, prompt in enumerate(prompts):
        ref_cache = DynamicCache(config=ref.config)
        with torch.no_grad():
            theirs = [ref(input_ids=prompt, past_key_values=ref_cache, use_cache=True).logits]
            for t in range(steps):
                theirs.append(ref(input_ids=new[row : row + 1, t : t + 1], past_key_values=ref_cache).logits)
        pairs.append((torch.cat(ours[row], 1), torch.cat(theirs, 1)))
    return pairs, together


@pytest.mark.parametrize("style", list(STYLES))
def test_slots_decode_like_transformers_alone(text_checkpoints, style):
    """bf16: two sequences of different lengths in two slots, decoded together, each equal to the bit
    to transformers' DynamicCache decode of that sequence alone. Together as the engine batches
    them: in one call where this machine's kernels round a row alike in any call, else one call per
    slot (``RowProbe``; bf16 on AVX-512 CPUs)."""
    folder = text_checkpoints[style]
    model = torchgemma.load(folder, dtype=torch.bfloat16, attention="eager")
    pairs, _ = two_slots_and_transformers_alone(model, reference_model(folder, torch.bfloat16))
    for row, (ours_row, theirs_row) in enumerate(pairs):
        assert torch.equal(ours_row, theirs_row), f"row {row}: max |Δ| {(ours_row - theirs_row).abs().max()}"


def test_cache_layout_is_the_architectural_minimum(text_checkpoints):
    """Full layers: max_len columns; sliding layers: W + max_rollback (the W - 1 keys before a call,
    and the column a decode step writes its key to first); KV-shared layers: nothing."""
    model = torchgemma.load(text_checkpoints["e2b"])
    for rollback in (0, 3):
        cache = model.make_cache(batch_size=3, max_len=64, max_rollback=rollback)
        for spec, layer_cache in zip(model.config.text.layers, cache.layers):
            if spec.kv_role == "reuse":
                assert layer_cache is None
            elif spec.is_sliding:
                assert isinstance(layer_cache, SlidingLayerCache)
                assert layer_cache.keys.shape == (3, spec.num_kv_heads, WINDOW + rollback, spec.head_dim)
            else:
                assert isinstance(layer_cache, FullLayerCache)
                assert layer_cache.keys.shape == (3, spec.num_kv_heads, 64, spec.head_dim)
        # e2b tiny: layers 0-5 own their K/V ([s, s, s, s, f, s]): 5 sliding (ring x 16 dims) and
        # 1 full (64 columns x 32 dims), 1 KV head; K and V, batch 3, float32.
        assert cache.nbytes == 2 * 3 * 4 * (5 * (WINDOW + rollback) * 16 + 1 * 64 * 32)
    # Never more columns than a sequence can have.
    assert model.make_cache(1, 3).layers[0].keys.shape[2] == 3


def test_rows_of_one_length_store_as_the_indexed_path(text_checkpoints):
    """Rows that share a length and store every token write their keys as slices (no index
    tensors): the buffers and what each call attends to equal the indexed path's (the same call
    with an all-true mask), through chunks shorter and longer than the ring and its wrap-arounds."""
    model = torchgemma.load(text_checkpoints["e2b"])
    fast, indexed = model.make_cache(3, 40), model.make_cache(3, 40)
    gen = torch.Generator().manual_seed(1)
    for length in [3, 1, 2, 1, 1, 5, 1, 4, 1, 1, 9, 1]:
        steps = (
            fast.step([1, 2], length),
            indexed.step([1, 2], length, valid=torch.ones(2, length, dtype=torch.bool)),
        )
        assert steps[0].common_start is not None and steps[1].common_start is None
        for ours, theirs in zip(fast.layers, indexed.layers):
            if ours is None:
                continue
            key, value = (
                torch.randn(2, ours.keys.shape[1], length, ours.keys.shape[3], generator=gen) for _ in "kv"
            )
            for a, b in zip(ours.update(key, value, steps[0]), theirs.update(key, value, steps[1])):
                assert torch.equal(a, b)
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        fast.commit(steps[0])
        indexed.commit(steps[1])


def test_a_mask_of_any_dtype_marks_the_same_tokens(text_checkpoints):
    """``step(valid=...)`` takes an attention mask as given: bool, int or float, nonzero is real."""
    model = torchgemma.load(text_checkpoints["e2b"])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    steps = [
        model.make_cache(2, 8).step([0, 1], 3, valid=mask.to(dtype))
        for dtype in (torch.bool, torch.long, torch.float32)
    ]
    for step in steps:
        assert step.counts == [2, 3] and all(type(c) is int for c in step.counts)
        assert step.full_span == 3 and type(step.full_span) is int and step.written.dtype == torch.bool
        assert torch.equal(step.positions, steps[0].positions) and torch.equal(step.written, steps[0].written)


def test_cache_overflow_and_batch_mismatch_are_errors(text_checkpoints):
    model = torchgemma.load(text_checkpoints["31b"])
    cache = model.make_cache(batch_size=1, max_len=8)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8, 9, 10]]), cache=cache)
        with pytest.raises(
            ValueError, match="cache holds 8 tokens; 6 are used in slot 0 and this call adds 3"
        ):
            model(torch.tensor([[5, 6, 7]]), cache=cache)
        with pytest.raises(ValueError, match="batch size 1"):
            model(torch.tensor([[5], [6]]), cache=cache)
        with pytest.raises(ValueError, match="slot 4 does not exist"):
            model(torch.tensor([[5]]), cache=cache, slots=[4])
    two = model.make_cache(batch_size=2, max_len=8)
    with pytest.raises(ValueError, match="one slot twice"):
        model(torch.tensor([[5], [6]]), cache=two, slots=[1, 1])


def test_cache_reset_reuses_buffers(text_checkpoints):
    model = torchgemma.load(text_checkpoints["e4b"], attention="eager")
    ids, mask = batch(12)
    first, cache = run_in_chunks(model, ids, mask, [4, 8], max_len=12)
    cache.reset()
    assert cache.lengths == [0, 0]
    with torch.no_grad():
        again = torch.cat(
            [model(ids[:, :4], mask[:, :4], cache=cache), model(ids[:, 4:], mask[:, 4:], cache=cache)], 1
        )
    assert torch.equal(first, again)


@pytest.mark.parametrize("style", ["e2b", "26b"])
def test_freed_slot_is_reused_at_once(text_checkpoints, style):
    """A slot freed mid-run serves a new sequence at the next call, as a fresh cache would, while
    the other slot's sequence goes on undisturbed."""
    model = torchgemma.load(text_checkpoints[style], dtype=torch.bfloat16, attention="eager")
    gen = torch.Generator().manual_seed(8)
    a, b, c = (torch.randint(3, 300, (1, n), generator=gen) for n in (12, 9, 11))
    cache = model.make_cache(2, 16)
    with torch.no_grad():
        model(a[:, :6], cache=cache, slots=[0])
        model(b, cache=cache, slots=[1])
        cache.free(1)
        assert cache.lengths == [6, 0]
        reused = model(c, cache=cache, slots=[1])
        rest = model(a[:, 6:], cache=cache, slots=[0])
        fresh = model.make_cache(1, 16)
        assert torch.equal(reused, model(c, cache=fresh))
        alone = model.make_cache(1, 16)
        model(a[:, :6], cache=alone)
        assert torch.equal(rest, model(a[:, 6:], cache=alone))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("style", list(STYLES))
def test_rollback_then_redecode_is_identical(text_checkpoints, style, backend):
    """Taking back k tokens (past the ring's wrap-around) and feeding other tokens gives what a
    sequence that never saw the taken-back tokens gets, to the bit."""
    model = torchgemma.load(text_checkpoints[style], dtype=torch.bfloat16, attention=backend)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 300, (1, 9), generator=gen)
    drafts, accepted = torch.randint(3, 300, (2, 4), generator=gen)
    cache = model.make_cache(1, 24, max_rollback=4)
    straight = model.make_cache(1, 24)
    with torch.no_grad():
        model(prompt, cache=cache)
        model(drafts[None], cache=cache)  # a verify step: 4 draft tokens at once
        cache.rollback(0, 4)
        assert cache.lengths == [9]
        after = torch.cat([model(accepted[None, t : t + 1], cache=cache) for t in range(4)], 1)
        model(prompt, cache=straight)
        expected = torch.cat([model(accepted[None, t : t + 1], cache=straight) for t in range(4)], 1)
    assert torch.equal(after, expected)


def test_rollback_limits(text_checkpoints):
    model = torchgemma.load(text_checkpoints["31b"])
    cache = model.make_cache(1, 24, max_rollback=2)
    with torch.no_grad():
        model(torch.arange(3, 13)[None], cache=cache)
    with pytest.raises(ValueError, match="cannot take back 11"):
        cache.rollback(0, 11)
    with pytest.raises(ValueError, match="can go back to 8 tokens at most"):
        cache.rollback(0, 3)
    cache.rollback(0, 1)
    cache.rollback(0, 1)  # two steps of one: still within the 2 the ring keeps
    with pytest.raises(ValueError, match="can go back to 8"):
        cache.rollback(0, 1)
    # Without a ring to outrun (the sequence fits in the window's columns) any rollback works.
    short = model.make_cache(1, 4)
    with torch.no_grad():
        model(torch.arange(3, 7)[None], cache=short)
    short.rollback(0, 4)
    assert short.lengths == [0]


def test_read_refuses_positions_a_ring_lost_before_a_rollback(text_checkpoints):
    """After a rollback the ring still holds the last positions written (past the slot's length):
    read takes what it holds and refuses what those writes overwrote."""
    model = torchgemma.load(text_checkpoints["31b"])
    cache = model.make_cache(1, 24, max_rollback=2)  # rings of WINDOW + 2 = 7 columns
    with torch.no_grad():
        model(torch.arange(3, 13)[None], cache=cache)  # positions 0..9: the rings hold 3..9
    cache.rollback(0, 2)  # length 8; positions 8 and 9 are still in the rings
    assert len(cache.read(0, 3, 8)) == len(cache.layers)
    with pytest.raises(
        ValueError, match=r"hold its last 7 positions written \(3 to 10\); position 2 is gone"
    ):
        cache.read(0, 2, 8)


@pytest.mark.parametrize("style", list(STYLES))
def test_static_decode_step_matches_the_cached_forward(text_checkpoints, style):
    """TextModel.decode (static shapes over every slot) equals per-slot cached decoding, and slots
    it is told are idle are left exactly as they were."""
    model = torchgemma.load(text_checkpoints[style], dtype=torch.float32, attention="sdpa")
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 300, (1, n), generator=gen) for n in (8, 3, 6)]
    static, reference = model.make_cache(3, 20), model.make_cache(3, 20)
    with torch.no_grad():
        for cache in (static, reference):
            for slot, prompt in enumerate(prompts):
                model(prompt, cache=cache, slots=[slot])
        for step in range(9):
            if step == 1:  # slot 1 idles in steps 1 and 2
                idle_before = [
                    (c.keys[1].clone(), c.values[1].clone()) for c in static.layers if c is not None
                ]
            active = torch.tensor([True, step % 3 == 0, True])  # slot 1 decodes every third step only
            tokens = torch.randint(3, 300, (3, 1), generator=gen)
            positions = torch.tensor(static.lengths)
            ours = model.language_model.decode(tokens, static, positions, active)
            live = [s for s in range(3) if active[s]]
            static.advance(live)
            theirs = model(tokens[live], cache=reference, slots=live)
            torch.testing.assert_close(ours[live], theirs, rtol=0, atol=5e-5)
            if step == 2:  # nothing of the idle slot changed
                after = [(c.keys[1], c.values[1]) for c in static.layers if c is not None]
                assert all(
                    torch.equal(k0, k1) and torch.equal(v0, v1)
                    for (k0, v0), (k1, v1) in zip(idle_before, after)
                )
    assert static.lengths == reference.lengths


@pytest.mark.parametrize("style", ["e2b", "31b"])
def test_a_growing_cache_equals_a_preallocated_one(text_checkpoints, style, monkeypatch):
    """preallocate=False: the full layers' buffers start small and grow (here in steps of 4 columns)
    as the sequences do; the logits are those of the whole preallocated cache, to the bit, and the
    buffers end far below max_len."""
    monkeypatch.setattr(torchgemma.cache, "GROWTH_QUANTUM", 4)
    model = torchgemma.load(text_checkpoints[style], attention="eager")
    ids, mask = batch(30, seed=3)
    chunks = CHUNKINGS["mixed-chunks"]
    whole, _ = run_in_chunks(model, ids, mask, chunks, max_len=4096)
    cache = model.make_cache(2, 4096, preallocate=False)
    assert cache.capacity == 4
    out, start, capacities = [], 0, []
    with torch.no_grad():
        for size in chunks:
            piece = slice(start, start + size)
            out.append(model(ids[:, piece], attention_mask=mask[:, piece], cache=cache))
            capacities.append(cache.capacity)
            start += size
    assert torch.equal(torch.cat(out, 1), whole)
    # The rule: when row 0 (no padding) reaches n > capacity tokens, grow to max(n, 2 x capacity)
    # rounded up to the quantum. Row 0 holds 3, 12, 14, 15, 16, 22, 26, 27, 30 tokens after each call.
    assert capacities == [4, 12, 24, 24, 24, 24, 48, 48, 48], capacities
    full = [c for c in cache.layers if isinstance(c, FullLayerCache)]
    assert full and all(c.keys.shape[2] == 48 for c in full)


def test_generate_allocates_for_the_tokens_it_makes(text_checkpoints, monkeypatch):
    """max_new_tokens=10**9 once allocated the whole context for every row; now the full layers
    hold one growth quantum until the sequence needs more."""
    import importlib

    generate_module = importlib.import_module("torchgemma.generation.generate")

    engines = []

    class Recording(generate_module.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(generate_module, "Engine", Recording)
    model = torchgemma.load(text_checkpoints["31b"], attention="eager")
    context = model.config.text.max_position_embeddings
    steps = torchgemma.stream(model, [[5, 6, 7]], max_new_tokens=10**9, stop_token_ids=[])
    for _ in range(3):
        next(steps)
    (engine,) = engines
    assert engine.max_len == context  # the budget is the whole context ...
    cache = engine.cache
    assert cache.capacity == torchgemma.cache.GROWTH_QUANTUM < context  # ... the memory is not
    whole = model.make_cache(1, context)
    assert cache.nbytes < whole.nbytes / 4, (cache.nbytes, whole.nbytes)


def test_a_compiled_step_needs_the_whole_cache(text_checkpoints):
    model = torchgemma.load(text_checkpoints["e2b"])
    cache = model.make_cache(2, 4096, preallocate=False)
    with pytest.raises(RuntimeError, match="reserve"):
        cache.decode_step(torch.tensor([0, 0]), torch.tensor([True, True]))
    cache.reserve(cache.max_len)
    assert cache.capacity == 4096
    cache.decode_step(torch.tensor([0, 0]), torch.tensor([True, True]))

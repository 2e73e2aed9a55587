"""Prefix caching (generation/prefix_cache.py): a request whose prompt begins as an earlier one did
prefills only the rest, and gets exactly what it gets without the store.

Every comparison is against the same requests through an engine without a store: bf16 log-
probabilities to the bit (sdpa, the default attention), float32 greedy tokens. The tiny models'
sliding window is 5 tokens; chunks of 8 put reuse points past it, chunks of 4 at its edge.
"""

from __future__ import annotations

import gc
import io
from pathlib import Path

import pytest
import torch

import torchgemma
from checkpoints import TINY_TOKEN_IDS, build_large_vision_checkpoint, build_omni_checkpoint
from gemma3_checkpoints import gemma3_checkpoint
from gemma3n_checkpoints import build as build_gemma3n
from torchgemma import Engine, MediaInputs, SamplingParams
from torchgemma.cli.common import report_speed
from torchgemma.generation import GenerationStats, stream
from torchgemma.generation.engine import DEFAULT_PREFILL_CHUNK
from torchgemma.generation.prefix_cache import PrefixCache

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0)
IMAGE_TOKEN, BOI, EOI = (TINY_TOKEN_IDS[f"{k}_token_id"] for k in ("image", "boi", "eoi"))


@pytest.fixture(scope="module")
def other_families(tmp_path_factory) -> dict[str, Path]:
    """Gemma 3 (1B-like) and Gemma 3n (AltUp, KV sharing) text checkpoints."""
    root = tmp_path_factory.mktemp("families")
    return {
        "gemma3": gemma3_checkpoint(root / "gemma3", "1b", seed=5),
        "gemma3n": build_gemma3n(root / "gemma3n", multimodal=False, seed=6, embed_scale=0.05),
    }


@pytest.fixture(scope="module")
def vision_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """E2B-like with vision (and audio) towers; 31B-like whose image tokens attend both ways."""
    root = tmp_path_factory.mktemp("mm")
    return {
        "e2b": build_omni_checkpoint(root / "e2b", seed=21),
        "31b": build_large_vision_checkpoint(root / "31b", seed=22),
    }


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve(engine: Engine, requests: list[tuple], check=None) -> dict:
    """Run requests (id, prompt, max_new_tokens[, media][, join step]) to the end; per request its
    outputs as (token, logprob, top, cached_tokens). ``check(engine)`` runs after every step."""
    outputs: dict = {}
    step = 0
    pending = list(requests)
    while pending or engine.has_unfinished_requests():
        for request in [r for r in pending if (r[4] if len(r) > 4 else 0) <= step]:
            rid, prompt, new = request[:3]
            media = request[3] if len(request) > 3 else None
            engine.add_request(
                rid, prompt, sampling=GREEDY, max_new_tokens=new, stop_token_ids=[], logprobs=2, media=media
            )
            pending.remove(request)
        for out in engine.step():
            assert out.error is None, out.error
            outputs.setdefault(out.request_id, []).append(
                (out.token_id, out.logprobs.logprob, tuple(out.logprobs.top), out.cached_tokens)
            )
        if check is not None:
            check(engine)
        step += 1
    return outputs


def one_by_one(model, requests, store, chunk=8, **engine_args) -> dict:
    """Each request through its own engine, one after another (the store carries across)."""
    outputs = {}
    for request in requests:
        engine = Engine(
            model, max_batch_size=1, max_len=96, prefill_chunk=chunk, prefix_cache=store, **engine_args
        )
        outputs |= serve(engine, [request])
    return outputs


def without_cached(outputs: dict) -> dict:
    return {rid: [o[:3] for o in outs] for rid, outs in outputs.items()}


def cached(outputs: dict) -> dict:
    """Each request's cached_tokens (asserting that only its first output carries any)."""
    for outs in outputs.values():
        assert all(o[3] == 0 for o in outs[1:])
    return {rid: outs[0][3] for rid, outs in outputs.items()}


def conversation(model, chunk: int = 8) -> list[tuple]:
    """A prompt; one sharing its first 30 tokens; the first continued by its greedy reply and more."""
    first = tokens(45, 1)
    reply = [o[0] for o in one_by_one(model, [("a", first, 6)], None, chunk)["a"]]
    return [("a", first, 6), ("b", first[:30] + tokens(12, 2), 5), ("c", first + reply + tokens(5, 3), 5)]


# ── exactness on every style ─────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("style", ["e2b", "26b", "31b", "gemma3", "gemma3n"])
def test_reuse_is_exact_on_every_style(gen_checkpoints, other_families, style):
    """bf16 sdpa: a prompt, one sharing 30 of its tokens (24 reused: whole chunks of 8, past the
    5-token window) and a conversation continued (its previous prompt's whole chunks reused) give
    the bits an engine without a store gives."""
    folder = other_families[style] if style.startswith("gemma3") else gen_checkpoints[style]
    model = torchgemma.load(folder, dtype=torch.bfloat16)
    requests = conversation(model)
    store = PrefixCache(1 << 24, block_size=4)
    with_store = one_by_one(model, requests, store)
    assert without_cached(with_store) == without_cached(one_by_one(model, requests, None))
    # "b" shares 30 tokens with "a": 24 whole chunks; "c" begins with all 45 of "a": its 5 whole
    # chunks (a's last 5 tokens were a shorter chunk, and its reply was decoded: neither stored).
    assert cached(with_store) == {"a": 0, "b": 24, "c": 40}
    stats = store.stats()
    assert (stats["queries"], stats["hits"], stats["cached_tokens"]) == (3, 2, 64)
    # a: 5 chunks, b: 2 chunks from 24 (its first block there is a's), c: chunks [40, 56).
    assert stats["blocks"] == 10 + 3 + 4 and stats["evictions"] == 0


@pytest.mark.parametrize("style", ["e2b", "26b", "31b", "gemma3", "gemma3n"])
def test_a_repeated_prompt_is_taken_whole(gen_checkpoints, other_families, style):
    """bf16 sdpa: a prompt stored to its end (its last chunk, shorter or whole, and the state that
    chose its first token) is taken whole by the same prompt again, which then runs no prefill
    forward at all, and gets the bits an engine without a store gives: greedy with log-
    probabilities, and sampled with a seed (the first token drawn from the stored state)."""
    folder = other_families[style] if style.startswith("gemma3") else gen_checkpoints[style]
    model = torchgemma.load(folder, dtype=torch.bfloat16)
    # 45 tokens (a shorter last chunk past the window), 5 (all in one chunk), 48 (a whole last chunk)
    long, short, whole = tokens(45, 11), tokens(5, 12), tokens(48, 13)
    requests = [("a", long, 4), ("a again", long, 4), ("s", short, 3), ("s again", short, 3)]
    requests += [("w", whole, 3), ("w again", whole, 3)]
    store = PrefixCache(1 << 24, block_size=4)
    calls = []
    hook = model.language_model.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[1]))
    outputs = {}
    for request in requests:
        calls.clear()
        outputs |= one_by_one(model, [request], store)
        if request[0].endswith("again"):
            assert calls == [1] * (request[2] - 1), calls  # decode steps only
    hook.remove()
    assert without_cached(outputs) == without_cached(one_by_one(model, requests, None))
    assert cached(outputs) == {"a": 0, "a again": 45, "s": 0, "s again": 5, "w": 0, "w again": 48}
    stats = store.stats()
    assert (stats["ends"], stats["hits"], stats["cached_tokens"]) == (3, 3, 45 + 5 + 48)

    def sampled(store) -> list[int]:
        engine = Engine(model, max_batch_size=1, max_len=96, prefill_chunk=8, prefix_cache=store)
        sampling = SamplingParams(temperature=1.0, seed=7)
        engine.add_request("r", long, sampling=sampling, max_new_tokens=5, stop_token_ids=[])
        out = []
        while engine.has_unfinished_requests():
            out += [o.token_id for o in engine.step()]
        return out

    assert sampled(store) == sampled(None)
    assert store.stats()["cached_tokens"] == 45 + 5 + 48 + 45


def test_repeated_prompts_taken_whole_in_one_step(gen_checkpoints, monkeypatch):
    """Requests taking their whole prompt from the store in the same step choose their first tokens
    together, beside a request still prefilling, and get what they get without the store."""
    model = torchgemma.load(gen_checkpoints["e2b"], dtype=torch.bfloat16)
    first, other = tokens(21, 31), tokens(13, 32)

    def engine(store):
        return Engine(model, max_batch_size=3, max_len=64, prefill_chunk=8, prefix_cache=store)

    groups = []
    prefill = Engine._prefill

    def watched(self, group):
        groups.append([(r.request_id, r.final is not None) for r in group])
        return prefill(self, group)

    monkeypatch.setattr(Engine, "_prefill", watched)
    store = PrefixCache(1 << 24, block_size=4)
    # "a" prefills in steps 0-2 and ends at step 5; the others join at step 6.
    requests = [
        ("a", first, 4),
        ("a1", first, 3, None, 6),
        ("a2", first, 5, None, 6),
        ("b", other, 3, None, 6),
    ]
    with_store = serve(engine(store), requests)
    assert [("a1", True), ("a2", True)] in groups and [("b", False)] in groups
    assert without_cached(with_store) == without_cached(serve(engine(None), requests))
    assert cached(with_store) == {"a": 0, "a1": 21, "a2": 21, "b": 0}


def test_reuse_inside_the_window(gen_checkpoints):
    """Chunks of 4 (blocks of 2): reuse points at 4 and 8, at and just past the 5-token window."""
    model = torchgemma.load(gen_checkpoints["e2b"], dtype=torch.bfloat16)
    base = tokens(10, 4)
    requests = [("a", base, 4), ("b", base[:5] + tokens(3, 5), 4), ("c", base[:9] + tokens(2, 6), 4)]
    with_store = one_by_one(model, requests, PrefixCache(1 << 24, block_size=2), chunk=4)
    assert without_cached(with_store) == without_cached(one_by_one(model, requests, None, chunk=4))
    assert cached(with_store) == {"a": 0, "b": 4, "c": 8}


def test_reuse_off_the_chunk_grid_would_not_be_exact(gen_checkpoints, monkeypatch):
    """Why reuse stops at chunk starts: at a block boundary inside a chunk (28 here), the rest is
    computed in other chunks than without the store, and the bits move (this test checks that the
    comparisons above can fail). Shown where kernels switch by row count on every machine: the
    quantized products take the row kernel below DENSE_ROWS (32) rows and the dequantized BLAS from
    there, so keys 28-39 come from a 40-row call without the store and from a 14-row one with it.
    (sdpa's bf16 bits moved the same way on an AVX2 machine, and did not on an AVX-512 one.)"""
    model = torchgemma.load(gen_checkpoints["e2b"], dtype=torch.float32, quantize="int8")
    requests = conversation(model, chunk=40)[:2]
    match = PrefixCache.match
    monkeypatch.setattr(
        PrefixCache, "match", lambda self, root, ids, limit, unit, whole: match(self, root, ids, 28, 4)
    )
    with_store = one_by_one(model, requests, PrefixCache(1 << 24, block_size=4), chunk=40)
    assert cached(with_store)["b"] == 28
    without = one_by_one(model, requests, None, chunk=40)
    assert without_cached(with_store)["b"] != without_cached(without)["b"]


def test_float32_greedy_tokens(gen_checkpoints):
    """float32: the same greedy tokens (and, one request at a time, the same bits)."""
    model = torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32)
    requests = conversation(model)
    with_store = one_by_one(model, requests, PrefixCache(1 << 24, block_size=8))
    assert without_cached(with_store) == without_cached(one_by_one(model, requests, None))
    assert cached(with_store) == {"a": 0, "b": 24, "c": 40}


def test_requests_sharing_a_running_engine(gen_checkpoints):
    """Three slots, requests joining while others run: later ones reuse what earlier ones stored
    as they prefilled (a shared system prompt), bits equal to the same schedule without a store."""
    model = torchgemma.load(gen_checkpoints["e4b"], dtype=torch.bfloat16)
    system = tokens(33, 7)
    requests = [
        ("q1", system + tokens(6, 8), 12, None, 0),
        ("q2", system + tokens(9, 9), 6, None, 6),
        ("q3", system + tokens(4, 10), 6, None, 7),
        ("q4", system[:20], 3, None, 8),
    ]

    def engine(store):
        return Engine(model, max_batch_size=3, max_len=80, prefill_chunk=8, prefix_cache=store)

    store = PrefixCache(1 << 24, block_size=8)
    with_store = serve(engine(store), requests)
    assert without_cached(with_store) == without_cached(serve(engine(None), requests))
    assert cached(with_store) == {"q1": 0, "q2": 32, "q3": 32, "q4": 16}


# ── media ──────────────────────────────────────────────────────────────────────────────────────


def image_request(model, text_before: list[int], text_after: list[int]) -> tuple[list[int], MediaInputs]:
    """A prompt with one image of 4 soft tokens (2k x 2k patches pooled k x k) between two texts."""
    vision = model.config.vision_config
    side = 2 * vision.pooling_kernel_size
    grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1)
    grid = grid.reshape(1, side * side, 2)
    patches = torch.rand(1, side * side, 3 * vision.patch_size**2, generator=torch.Generator().manual_seed(3))
    prompt = text_before + [BOI] + [IMAGE_TOKEN] * 4 + [EOI] + text_after
    types = torch.tensor([[0] * (len(text_before) + 1) + [1] * 4 + [0] * (len(text_after) + 1)])
    return prompt, MediaInputs(pixel_values=patches, image_position_ids=grid, mm_token_type_ids=types)


@pytest.mark.parametrize("which", ["e2b", "31b"])
def test_images_in_the_shared_prefix(vision_checkpoints, which):
    """Only the text before the first image token is reused (whole chunks of it), the rest is
    prefilled with the image; bits equal. A text-only prompt with the same beginning reuses it on
    the E2B-like model, not on the 31B-like one, whose multimodal text runs with image blocks."""
    model = torchgemma.load(vision_checkpoints[which], dtype=torch.bfloat16)
    before = tokens(21, 11)
    first, media = image_request(model, before, tokens(5, 12))
    second, media2 = image_request(model, before, tokens(7, 13))
    requests = [("a", first, 4, media), ("b", second, 4, media2), ("text", before + tokens(3, 14), 4)]
    store = PrefixCache(1 << 24, block_size=4)
    with_store = one_by_one(model, requests, store)
    assert without_cached(with_store) == without_cached(one_by_one(model, requests, None))
    # The image starts at 22 (after 21 tokens and its begin-of-image token): chunks [0, 8), [8, 16).
    assert cached(with_store) == {"a": 0, "b": 16, "text": 16 if which == "e2b" else 0}
    # "a" stores 2 chunks (4 blocks); "b" none (its chunk [16, 26) holds the image); "text" its
    # chunk [16, 24), and on the 31B-like model all 3 (its text chains start elsewhere).
    assert store.stats()["blocks"] == 4 + (2 if which == "e2b" else 6)


def test_media_types_that_do_not_fit_the_prompt(vision_checkpoints):
    """mm_token_type_ids of another length than the prompt are refused when the request is added
    (the engine's admission reads them to find the first media token; a 31B-like prefill read them
    past their end), with or without a store."""
    model = torchgemma.load(vision_checkpoints["31b"], dtype=torch.float32)
    prompt, media = image_request(model, tokens(9, 17), tokens(3, 18))
    types = media.mm_token_type_ids[:, :-2]
    broken = MediaInputs(
        pixel_values=media.pixel_values, image_position_ids=media.image_position_ids, mm_token_type_ids=types
    )
    for store in (PrefixCache(1 << 20, block_size=8), None):
        engine = Engine(model, max_batch_size=2, max_len=64, prefill_chunk=8, prefix_cache=store)
        with pytest.raises(
            ValueError, match=f"'bad': {len(prompt) - 2} mm_token_type_ids, {len(prompt)} ids"
        ):
            engine.add_request("bad", prompt, max_new_tokens=2, media=broken, sampling=GREEDY)


def test_stream_reuses_the_text_before_an_image(vision_checkpoints):
    """``stream`` hands one unpadded multimodal row to the engine (which embeds it as stream does):
    its text before the image is reused; a padded batch (embedded at once) neither reuses nor stores."""
    model = torchgemma.load(vision_checkpoints["31b"], dtype=torch.bfloat16)
    prompt, media = image_request(model, tokens(21, 15), tokens(5, 16))
    ids = torch.tensor([prompt])

    def run(store, stats=None):
        steps = stream(
            model,
            ids,
            media=media,
            max_new_tokens=4,
            sampling=GREEDY,
            prefill_chunk=8,
            prefix_cache=store,
            stats=stats,
            stop_token_ids=[],
        )
        return torch.stack(list(steps)).tolist()

    store = PrefixCache(1 << 24, block_size=8)
    expected = run(None)
    assert run(store) == expected and store.stats()["blocks"] == 2
    stats = GenerationStats()
    assert run(store, stats) == expected and stats.cached_tokens == 16
    batch = torch.tensor([prompt, [0, 0] + prompt[2:]])
    mask = torch.ones_like(batch)
    mask[1, :2] = 0
    types = media.mm_token_type_ids.repeat(2, 1)
    pixels = media.pixel_values.repeat(2, 1, 1)
    positions = media.image_position_ids.repeat(2, 1, 1)
    two = MediaInputs(pixel_values=pixels, image_position_ids=positions, mm_token_type_ids=types)
    before = store.stats()
    list(
        stream(
            model,
            batch,
            attention_mask=mask,
            media=two,
            max_new_tokens=2,
            sampling=GREEDY,
            prefill_chunk=8,
            prefix_cache=store,
        )
    )
    assert store.stats() == before


# ── the store: bytes, eviction, least recently used ─────────────────────────────────────────────


def test_eviction_under_a_small_cap(gen_checkpoints):
    """A cap of 6 blocks: bytes never exceed it (checked after every step), blocks are evicted,
    evicted prefixes are prefilled again, and every result is still the one without a store."""
    model = torchgemma.load(gen_checkpoints["26b"], dtype=torch.bfloat16)
    probe = PrefixCache(1 << 24, block_size=4)
    one_by_one(model, [("x", tokens(9, 0), 1)], probe)
    blocks = [block for block in probe._blocks.values() if block.final is None]  # (not its end)
    block_bytes = blocks[0].nbytes
    assert all(block.nbytes == block_bytes for block in blocks) and len(blocks) == 2
    store = PrefixCache(6 * block_bytes + block_bytes // 2, block_size=4)
    first, other = tokens(40, 21), tokens(40, 22)
    requests = [("a", first, 3), ("a2", first[:33], 3), ("b", other, 3), ("a3", first[:20], 3)]

    def check(engine):
        assert store.bytes <= store.max_bytes

    outputs = {}
    for request in requests:
        engine = Engine(model, max_batch_size=1, max_len=64, prefill_chunk=8, prefix_cache=store)
        outputs |= serve(engine, [request], check)
    assert without_cached(outputs) == without_cached(one_by_one(model, requests, None))
    # "a" stores 6 of its 10 blocks (then the least recently used block is its own: it stops,
    # and so stores no end); "a2" reuses them; "b" evicts them all for its own 6; "a3" prefills
    # from the start again and stores its 4 blocks in place of 4 of "b"'s, then its end (its
    # last 4 tokens' keys and values, a block's bytes, and the hidden state of its last token) in
    # place of a fifth.
    assert cached(outputs) == {"a": 0, "a2": 24, "b": 0, "a3": 0}
    stats = store.stats()
    final_bytes = model.config.text.hidden_size * 2  # bf16
    assert (stats["blocks"], stats["ends"], stats["evictions"], stats["bytes"]) == (
        5,
        1,
        6 + 4 + 1,
        6 * block_bytes + final_bytes,
    )


def fake_layers(nbytes: int) -> list:
    return [(torch.zeros(nbytes // 2, dtype=torch.uint8), torch.zeros(nbytes // 2, dtype=torch.uint8)), None]


def chain(store: PrefixCache, root: int, ids: list[int]) -> int | None:
    return store.store(root, ids, 0, lambda a, b: fake_layers(100))


def test_least_recently_used_chains_go_first():
    """Bytes are the tensors' own; a chain matched last outlives one stored before it; a chain's
    last blocks go before its first (a shared beginning outlives its continuations); evicting a
    block evicts what continues it; matches round down to whole units and are counted."""
    store = PrefixCache(500, block_size=2)  # five blocks of 100 bytes
    root = store.root("r")
    chain(store, root, [1, 2, 3, 4])  # a1 = (1, 2) -> a2 = (3, 4)
    chain(store, root, [5, 6, 7, 8])  # b1 -> b2
    assert store.bytes == 400
    assert len(store.match(root, [1, 2, 3, 4, 9], 4, 2)) == 2  # a's chain used again
    chain(store, root, [1, 2, 10, 11])  # continues a1: one block more
    chain(store, root, [12, 13, 14, 15])  # evicts b2, then b1: the least recently used, last first
    assert (store.bytes, store.evictions, len(store._blocks)) == (500, 2, 5)
    assert store.match(root, [5, 6, 7, 8, 0], 4, 2) == []
    assert [b.tokens for b in store.match(root, [1, 2, 3, 4, 0], 4, 4)] == [(1, 2), (3, 4)]
    assert [b.tokens for b in store.match(root, [1, 2, 10, 11, 0], 4, 4)] == [(1, 2), (10, 11)]
    assert store.match(root, [1, 2, 3, 4, 0], 4, 4)[0] is store.match(root, [1, 2, 10, 11], 2, 2)[0]
    assert store.match(root, [1, 2, 3, 4, 0], 3, 4) == []  # one block, not a whole unit of 4 tokens
    assert store.match(store.root("other"), [1, 2, 3, 4, 0], 4, 2) == []  # chains of another root
    stats = store.stats()
    assert (stats["queries"], stats["hits"], stats["cached_tokens"]) == (8, 5, 4 + 4 + 4 + 4 + 2)
    # Evicting a chain's first block takes its continuations with it.
    store._evict(store._children[root, (1, 2)])
    assert store.match(root, [1, 2, 3, 4, 0], 4, 2) == [] and store.match(root, [1, 2, 10, 11, 0], 4, 2) == []
    assert store.bytes == sum(b.nbytes for b in store._blocks.values()) == 200 and store.evictions == 5


def test_a_block_over_the_cap_is_not_stored():
    store = PrefixCache(150, block_size=2)
    root = store.root("r")
    assert store.store(root, [1, 2], 0, lambda a, b: fake_layers(200)) is None
    assert store.stats()["blocks"] == 0 and store.bytes == 0
    off = PrefixCache(0)
    assert off.store(off.root("r"), [1] * 32, 0, lambda a, b: fake_layers(2)) is None


# ── the engine's checks, LLM ───────────────────────────────────────────────────────────────────


def test_engine_checks(gen_checkpoints):
    """Clear errors for a chunk that is not whole blocks, a cache whose rings cannot hold a chunk,
    a store shared by two models, bad sizes."""
    model = torchgemma.load(gen_checkpoints["e2b"], dtype=torch.float32)
    with pytest.raises(ValueError, match=r"prefill_chunk \(12\) must be a multiple .* block_size \(8\)"):
        Engine(model, prefill_chunk=12, prefix_cache=PrefixCache(1000, block_size=8))
    with pytest.raises(ValueError, match="hold 5 positions, fewer than prefill_chunk"):
        Engine(
            model,
            cache=model.make_cache(1, 64),
            prefill_chunk=8,
            prefix_cache=PrefixCache(1000, block_size=8),
        )
    store = PrefixCache(1 << 20, block_size=8)
    one_by_one(model, [("a", tokens(9, 0), 1)], store)
    assert store.stats()["blocks"] == 1
    other = torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32)
    with pytest.raises(ValueError, match="another model's keys and values"):
        Engine(other, max_len=64, prefill_chunk=8, prefix_cache=store)
    # Once the model is gone, its blocks go with it: the next model starts from an empty store.
    del model
    gc.collect()
    Engine(other, max_len=64, prefill_chunk=8, prefix_cache=store)
    assert store.stats()["blocks"] == 0 and store.bytes == 0
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0"):
        PrefixCache(-1)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        PrefixCache(10, block_size=0)


def test_llm_chat_second_turn_reuses_the_conversation(llm_checkpoint):
    """LLM keeps one store across calls: the second turn of a chat reuses the first turn's prompt
    (its whole chunks of the engine's default ``prefill_chunk``) and answers what a fresh LLM without
    a store answers."""
    from torchgemma import LLM

    llm = LLM(llm_checkpoint, dtype=torch.bfloat16, progress=False)
    assert llm.prefix_cache is not None and llm.prefix_cache.max_bytes == 2**30
    long_text = " ".join(f"word{i % 50} is here" for i in range(100))
    messages = [{"role": "user", "content": long_text}]
    first = llm.chat(messages, max_new_tokens=4, temperature=0)
    prompt_tokens = len(llm.chat_ids(messages))
    chunk = DEFAULT_PREFILL_CHUNK
    # 3 chunks and a part: 768 tokens reused where a 512-token grid (the old default) reused 512.
    assert 3 * chunk < prompt_tokens < 4 * chunk, f"the test wants a prompt of 3-4 {chunk}-token chunks"
    messages += [first.message, {"role": "user", "content": "And then?"}]
    stats = GenerationStats()
    second = llm.chat(messages, max_new_tokens=6, temperature=0, stats=stats)
    assert stats.cached_tokens == prompt_tokens // chunk * chunk and llm.prefix_cache.stats()["hits"] == 1
    line = io.StringIO()
    report_speed(stats, line)  # what chat --verbose prints after a turn
    assert f"({stats.cached_tokens} from the prefix cache) | decode" in line.getvalue()
    fresh = LLM(llm_checkpoint, dtype=torch.bfloat16, progress=False, prefix_cache_gb=0)
    assert fresh.prefix_cache is None
    assert fresh.chat(messages, max_new_tokens=6, temperature=0).token_ids == second.token_ids
    with pytest.raises(ValueError, match="prefix_cache_gb must be >= 0"):
        LLM(llm_checkpoint, progress=False, prefix_cache_gb=-1)


# ── compiled decode, the real model ────────────────────────────────────────────────────────────


@pytest.mark.slow
def test_compiled_decode_from_a_restored_slot(gen_checkpoints):
    """The compiled static-shape decode step (traced by dynamo, eager backend) decodes from slots
    loaded from the store as from prefilled ones."""
    model = torchgemma.load(gen_checkpoints["e2b"], dtype=torch.float32)
    requests = conversation(model)
    expected = one_by_one(model, requests, None)
    torchgemma.compile(model, backend="eager")
    store = PrefixCache(1 << 24, block_size=8)
    with_store = one_by_one(model, requests, store)
    assert [o[0] for r in "abc" for o in with_store[r]] == [o[0] for r in "abc" for o in expected[r]]
    assert cached(with_store) == {"a": 0, "b": 24, "c": 40}


@pytest.mark.slow
def test_real_270m_repeated_prefix(real_270m_file):
    """The real 270M in its default (GGUF blocks) mode: a 1,100-token prompt, then the same with a
    new ending: 1,024 tokens reused, log-probabilities equal to the bit (float32)."""
    model = torchgemma.load(real_270m_file, progress=False)
    gen = torch.Generator().manual_seed(0)
    prefix = [2] + torch.randint(3, 200000, (1099,), generator=gen).tolist()
    requests = [("a", prefix + [100, 200], 8), ("b", prefix + [300, 400, 500], 8)]

    def run(store):
        outputs = {}
        for request in requests:
            engine = Engine(model, max_batch_size=1, max_len=1200, prefix_cache=store)
            outputs |= serve(engine, [request])
        return outputs

    with_store = run(PrefixCache(1 << 30))
    assert without_cached(with_store) == without_cached(run(None))
    assert cached(with_store) == {"a": 0, "b": 1024}


def test_default_prefill_chunk_follows_how_quantized_products_prefill():
    """256 tokens per pass, but 512 where a quantized product dequantizes its weight each pass
    (float activations); integer activations and float models keep 256."""
    from torch import nn

    from torchgemma.generation.engine import DEQUANTIZING_PREFILL_CHUNK, default_prefill_chunk
    from torchgemma.quantization.modules import Format, QuantizedLinear
    from torchgemma.quantization.transform import set_activations

    assert default_prefill_chunk(nn.Sequential(nn.Linear(64, 64))) == DEFAULT_PREFILL_CHUNK == 256
    model = nn.Sequential(QuantizedLinear(64, 64, Format(4, 32, has_mins=True)))
    model[0].set_weight(torch.randn(64, 64))
    assert default_prefill_chunk(set_activations(model, None)) == DEQUANTIZING_PREFILL_CHUNK == 512
    assert default_prefill_chunk(set_activations(model, "int16")) == 256

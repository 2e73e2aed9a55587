"""The CPU fusions (``torchgemma.acceleration.cpu_fusions``): each fused operator against the one it
replaces, and a float model with the fusions against the same model without them."""

from __future__ import annotations

import pytest
import torch

import torchgemma
from checkpoints import padded_batch
from torchgemma import kernels
from torchgemma.acceleration import cpu_fusions
from torchgemma.acceleration.cpu_fusions import (
    FUSED_ATTENTION,
    FusedDecoderLayer,
    FusedRMSNorm,
    fuse_cpu_ops,
    fused_rope,
)
from torchgemma.model.attention import ATTENTION
from torchgemma.model.layers import RMSNorm, apply_rope
from torchgemma.model.text import Attention, DecoderLayer

pytestmark = pytest.mark.usefixtures("one_thread")

decode = torch.ops.torchgemma.decode_attention.default


@pytest.fixture(autouse=True)
def _kernels():
    if not kernels.ensure_kernels():
        pytest.skip(kernels.kernel_status())


def _activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Hidden-state-like rows: mostly small values, a few large ones."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x[:, torch.randint(0, k, (3,), generator=gen)] *= 300
    return x


# ── the fused operators ────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(("plus_one", "with_scale"), [(True, True), (False, True), (False, False)])
def test_fused_rms_norm_is_the_reference_to_rounding(plus_one, with_scale):
    """One C++ call = RMSNorm's dozen operators to a float32 rounding (not to the bit: the mean is
    summed in another order), for every variant: Gemma 3's 1 + w, Gemma 4's w, no scale."""
    from torchgemma.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(0)
    reference = RMSNorm(640, 1e-6, with_scale=with_scale, plus_one=plus_one)
    if with_scale:
        reference.weight.data = torch.randn(640, generator=gen) * 0.3
    fused = FusedRMSNorm.replacing(reference)
    x = _activations(12, 640, seed=4).view(2, 3, 2, 640).transpose(1, 2)  # not contiguous
    ours, theirs = fused(x), reference(x)
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    assert ((ours - theirs).abs() <= 4e-7 * theirs.abs().amax(-1, keepdim=True)).all()
    assert torch.equal(fused(x.bfloat16()), reference(x.bfloat16()))  # other dtypes: the reference


def test_fused_rope_is_apply_rope_to_the_bit():
    """One C++ call = apply_rope's operators to the bit (float32 CPU), on a non-contiguous input with
    several rows, tokens and heads; other dtypes take apply_rope itself."""
    from torchgemma.model.layers import apply_rope, rope_cos_sin

    gen = torch.Generator().manual_seed(2)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 256, 2).float() / 256)
    positions = torch.tensor([[0, 1, 2, 7, 4095], [9, 10, 11, 12, 13]])
    cos, sin = rope_cos_sin(inv_freq, positions, torch.float32)
    x = torch.randn(2, 4, 5, 256, generator=gen).transpose(1, 2) * 3  # (B, T, H, D), not contiguous
    assert torch.equal(fused_rope(x, cos, sin), apply_rope(x, cos, sin))
    half = [t.bfloat16() for t in (x, cos, sin)]
    assert torch.equal(fused_rope(*half), apply_rope(*half))


def _run(model, ids, mask) -> torch.Tensor:
    """Logits of a padded prefill, then of five cached decode steps of the first row (B, 17 + 5, V)."""
    with torch.no_grad():
        prefill = model(ids, attention_mask=mask)
        cache = model.make_cache(1, 24)
        steps = [model(ids[:1, :12], cache=cache)]
        steps += [model(ids[:1, t : t + 1], cache=cache) for t in range(12, 17)]
    return torch.cat((prefill[:1], torch.cat(steps, 1)), 1)


def test_decode_attention_gives_a_row_its_own_bits_in_a_batch_and_on_any_thread_count():
    """A row whose visible keys are a range gets the bits of that range attended alone (a batch of
    rows with their own lengths is one call, each row as it would be alone), for contexts of one
    piece and of several (1024 keys each); and the bits do not depend on the thread count."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, 1, 256, generator=gen)
    k, v = torch.randn(2, 3, 1, 3000, 256, generator=gen).unbind(0)
    ranges = [(0, 700), (11, 3000), (2990, 3000)]
    visible = torch.zeros(3, 3000, dtype=torch.bool)
    for row, (start, end) in enumerate(ranges):
        visible[row, start:end] = True
    together = decode(q, k, v, 0.0625, visible)
    for row, (start, end) in enumerate(ranges):
        alone = decode(
            q[row : row + 1], k[row : row + 1, :, start:end], v[row : row + 1, :, start:end], 0.0625
        )
        assert torch.equal(together[row : row + 1], alone)
    # A lone piece of many keys (one row, one KV head: a sliding layer's window) shares its key pairs
    # and value columns over the threads: also with an odd number of keys, a head size that is not a
    # multiple of 16, and eight heads per KV head.
    q2, k2, v2 = (
        torch.randn(1, 8, 1, 72, generator=gen),
        *torch.randn(2, 1, 1, 301, 72, generator=gen).unbind(0),
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        lone = [decode(q[:1], k[:1, :, :700], v[:1, :, :700], 0.0625), decode(q2, k2, v2, 0.125)]
        torch.set_num_threads(2)
        assert torch.equal(decode(q, k, v, 0.0625, visible), together)
        assert torch.equal(decode(q[:1], k[:1, :, :700], v[:1, :, :700], 0.0625), lone[0])
        assert torch.equal(lone[0], together[:1])
        assert torch.equal(decode(q2, k2, v2, 0.125), lone[1])
    finally:
        torch.set_num_threads(before)


def test_decode_attention_gives_each_of_several_queries_its_decode_steps_bits():
    """T queries per row (a prompt's), each with its own visible keys, get the bits each would get
    as a decode step's one query over those keys alone: causal rows, a sliding band, a row whose keys
    have holes (a list of columns, not a range), and a context of several pieces (1024 keys each);
    at one thread and at two. The reference agrees to float32 rounding; a query that sees no key and
    a mask of the wrong shape are refused by name."""
    gen = torch.Generator().manual_seed(8)
    b, t, s = 2, 9, 1100
    q = torch.randn(b, 8, t, 64, generator=gen)
    k, v = torch.randn(2, b, 2, s, 64, generator=gen).unbind(0)
    position = torch.arange(s - t, s)[:, None]
    key = torch.arange(s)[None, :]
    visible = torch.stack(
        [
            key <= position,  # causal: up to 1,100 keys, two pieces for the last queries
            (key <= position) & (key > position - 7),  # a sliding band of 7
        ]
    )
    visible[1, 3, s - t - 5] = False  # a hole: this query's keys are a list
    visible[1, 3, s - t - 30] = True
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            together = decode(q, k, v, 0.125, visible)
            assert together.shape == (b, t, 8, 64)
            for row in range(b):
                for query in range(t):
                    seen = visible[row, query].nonzero()[:, 0]
                    alone = decode(
                        q[row : row + 1, :, query : query + 1],
                        k[row : row + 1, :, seen],
                        v[row : row + 1, :, seen],
                        0.125,
                    )
                    assert torch.equal(together[row, query], alone[0, 0]), (threads, row, query)
    finally:
        torch.set_num_threads(before)
    reference = kernels.OPERATORS[[op.name for op in kernels.OPERATORS].index("decode_attention")].reference
    assert torch.allclose(together, reference(q, k, v, 0.125, visible), atol=2e-6, rtol=1e-5)
    unseen = visible.clone()
    unseen[0, 4] = False
    with pytest.raises(RuntimeError, match="row 0's query 4 sees no key"):
        decode(q, k, v, 0.125, unseen)
    with pytest.raises(RuntimeError, match=r"visible must be \(B, S\)"):
        decode(q, k, v, 0.125, visible[:, 0])


def test_prompt_attention_skips_what_the_mask_hides_and_agrees_with_sdpa(monkeypatch):
    """A fused model's attention of several queries (a prompt's chunk) on float32 CPU tensors: one
    decode_attention call, its result sdpa's to float32 rounding, for causal queries (no mask), a
    boolean mask (a sliding band after earlier keys), rows with their own key ranges, and a key
    slice. Where the kernel's vector code does not apply (2 query heads per KV head, a portable
    build), a query sees nothing (sdpa's padding) or the queries are given more keys than
    PROMPT_KEYS, sdpa runs."""
    from torchgemma.model.attention import AttentionInputs, sdpa_backend

    gen = torch.Generator().manual_seed(9)
    calls = []

    vector = kernels.isa() in ("avx2", "avx512")  # a portable build's prompts take sdpa

    def attend(q, k, v, inputs, expect_kernel=True):
        expect_kernel = expect_kernel and vector
        before = len(calls)
        got = cpu_fusions.sdpa_with_decode_kernel(q, k, v, inputs, 0.0625)
        assert (len(calls) > before) == expect_kernel
        expected = sdpa_backend(q, k, v, inputs, 0.0625)
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=2e-6, rtol=1e-5)

    original = cpu_fusions._DECODE_ATTENTION

    def counted(*args):
        calls.append(args[0].shape)
        return original(*args)

    cpu_fusions._DECODE_ATTENTION = counted
    try:
        q = torch.randn(2, 4, 12, 32, generator=gen)
        k, v = torch.randn(2, 2, 1, 12, 32, generator=gen).unbind(0)
        attend(q, k, v, AttentionInputs(None, None, None, causal=True))
        attend(q, k, v, AttentionInputs(None, None, None))  # every key
        k2, v2 = torch.randn(2, 2, 1, 20, 32, generator=gen).unbind(0)
        position = torch.arange(8, 20)[:, None]
        band = ((torch.arange(20)[None] <= position) & (torch.arange(20)[None] > position - 5))[None, None]
        attend(q, k2, v2, AttentionInputs(None, None, band.expand(2, 1, 12, 20)))
        attend(q, k2, v2, AttentionInputs(None, None, band[..., 4:], key_slice=slice(4, 20)))
        rows = [(0, 12, True), (3, 20, False)]
        mask = torch.zeros(2, 1, 12, 20, dtype=torch.bool)
        mask[1, 0, :, 3:20] = band[0, 0, :, 3:20]
        attend(q, k2, v2, AttentionInputs(None, None, mask, rows=rows))
        padded = band.expand(2, 1, 12, 20).clone()
        padded[1, 0, -2:] = False  # padding queries: sdpa's business
        attend(q, k2, v2, AttentionInputs(None, None, padded), expect_kernel=False)
        few = torch.randn(2, 2, 12, 32, generator=gen)  # 2 query heads per KV head
        attend(few, k, v, AttentionInputs(None, None, None, causal=True), expect_kernel=False)
        monkeypatch.setattr(cpu_fusions, "PROMPT_KEYS", 19)
        attend(q, k2, v2, AttentionInputs(None, None, band.expand(2, 1, 12, 20)), expect_kernel=False)
        attend(q, k2, v2, AttentionInputs(None, None, band[..., 4:], key_slice=slice(4, 20)))
    finally:
        cpu_fusions._DECODE_ATTENTION = original


def test_decode_attention_over_rings_gives_the_gathered_keys_bits():
    """Rows reading their windows in place from ring buffers (each its slot and offset, wrapping past
    the ring's end, some keys not visible) get the bits of decode_attention over the same keys
    gathered in that order."""
    gen = torch.Generator().manual_seed(6)
    rings_k, rings_v = torch.randn(2, 4, 2, 50, 64, generator=gen).unbind(0)
    q = torch.randn(3, 4, 1, 64, generator=gen)
    slots, offsets = torch.tensor([3, 0, 3]), torch.tensor([45, 0, 7])
    visible = torch.rand(3, 48, generator=gen) < 0.9
    visible[:, -1] = True
    columns = (offsets[:, None] + torch.arange(48)) % 50
    keys, values = (t[slots[:, None], :, columns].transpose(1, 2) for t in (rings_k, rings_v))
    ring = torch.ops.torchgemma.decode_attention_ring(q, rings_k, rings_v, 0.125, visible, slots, offsets)
    assert torch.equal(ring, decode(q, keys, values, 0.125, visible))


def test_a_batched_decode_step_of_rows_with_their_own_lengths_takes_one_call(text_checkpoints, monkeypatch):
    """The engine's decode step over requests of different lengths (each row its own key range) runs
    the one-call attention, and each request's tokens are its tokens alone (its logprobs to float32
    rounding: the float32 products round a row by the batch's size; the attention does not, as the
    test above shows)."""
    from torchgemma.generation import Engine

    model = fuse_cpu_ops(torchgemma.load(text_checkpoints["e2b"], dtype=torch.float32))
    prompts = {"a": list(range(5, 12)), "b": list(range(20, 23)), "c": list(range(40, 53))}

    def run(names):
        engine = Engine(model, max_batch_size=3, max_len=48)
        for name in names:
            engine.add_request(name, prompts[name], max_new_tokens=6, logprobs=0)
        got = {name: [] for name in names}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id].append((out.token_id, out.logprobs.logprob))
        return got

    alone = {name: run([name])[name] for name in prompts}
    calls, ring_calls, fallbacks = [], [], []

    def kernel(q, k, v, scale, visible):
        calls.append((q.shape[0], visible is not None))
        return decode(q, k, v, scale, visible)

    def ring_kernel(q, k, v, scale, visible, slots, offsets):
        ring_calls.append(q.shape[0])
        return torch.ops.torchgemma.decode_attention_ring(q, k, v, scale, visible, slots, offsets)

    def fallback(q, *args):
        fallbacks.append(q.shape[2])
        return ATTENTION["sdpa"](q, *args)

    monkeypatch.setattr(cpu_fusions, "_DECODE_ATTENTION", kernel)
    monkeypatch.setattr(cpu_fusions, "_DECODE_ATTENTION_RING", ring_kernel)
    monkeypatch.setattr(cpu_fusions, "sdpa_backend", fallback)
    together = run(list(prompts))
    for name in prompts:
        assert [t for t, _ in together[name]] == [t for t, _ in alone[name]]
        assert max(abs(a - b) for (_, a), (_, b) in zip(together[name], alone[name])) <= 1e-5
    assert (3, True) in calls  # three rows, each with its own keys, in one call
    assert 3 in ring_calls  # the sliding layers: three rows read in place from their rings
    # No step fell back to sdpa; prefill chunks too where the kernel's vector code runs (a portable
    # build's prompts take sdpa: _prompt_attention).
    assert (not fallbacks) if kernels.isa() in ("avx2", "avx512") else 1 not in fallbacks


@pytest.mark.parametrize("style", ["e2b", "26b"])
def test_a_float32_model_with_the_fusions_gives_its_logits(text_checkpoints, style, monkeypatch):
    """fuse_cpu_ops on a float32 model (not quantized): every text-decoder norm, rotation and backend
    swapped, the state dict the same names and storage; logits through prefill and cached decode steps equal
    the unfused model's to float32 rounding (the fused norm and decode attention promise that, not
    the bits), and to the bit with the fused RoPE alone (which promises the bits)."""
    folder = text_checkpoints[style]
    plain = torchgemma.load(folder, dtype=torch.float32)
    assert FusedRMSNorm not in {type(m) for m in plain.modules()}  # float models: only on request
    ids, mask = padded_batch(seed=3)
    expected = _run(plain, ids, mask)

    rope_only = torchgemma.load(folder, dtype=torch.float32)
    for module in rope_only.language_model.modules():
        if isinstance(module, Attention):
            module.rope = fused_rope
    assert torch.equal(_run(rope_only, ids, mask), expected)

    model = torchgemma.load(folder, dtype=torch.float32)
    before = model.state_dict()
    assert torchgemma.fuse_cpu_ops(model) is model
    after = model.state_dict()
    assert list(after) == list(before) and all(after[k].data_ptr() == before[k].data_ptr() for k in before)
    norms = [type(m) for m in model.language_model.modules() if isinstance(m, RMSNorm)]
    assert norms and set(norms) == {FusedRMSNorm}
    attention = [m for m in model.language_model.modules() if isinstance(m, Attention)]
    assert all(m.rope is fused_rope and m.backends is FUSED_ATTENTION for m in attention)
    assert not model.training
    calls = []
    monkeypatch.setattr(cpu_fusions, "_DECODE_ATTENTION", lambda *args: calls.append(1) or decode(*args))
    fused = _run(model, ids, mask)
    assert calls  # the decode steps' full layers took the one-call attention
    # Measured: 5.8e-7 of the largest logit (e2b, e4b), 3.6e-7 (26b, 31b).
    assert (fused - expected).abs().max() <= 4e-6 * expected.abs().max()


def test_the_fusions_leave_other_dtypes_to_the_reference(text_checkpoints):
    """On a bf16 model every fused operator takes the reference's own path: the same bits."""
    folder = text_checkpoints["e4b"]
    plain = torchgemma.load(folder, dtype=torch.bfloat16)
    fused = fuse_cpu_ops(torchgemma.load(folder, dtype=torch.bfloat16))
    ids, mask = padded_batch(seed=4)
    assert torch.equal(_run(fused, ids, mask), _run(plain, ids, mask))
    assert {m.rope for m in plain.modules() if isinstance(m, Attention)} == {apply_rope}
    assert all(m.backends is ATTENTION for m in plain.modules() if isinstance(m, Attention))


@pytest.mark.parametrize("names", [["a"], ["a", "b", "c"]])
def test_rings_as_long_as_the_cache_are_read_in_place_with_the_gathered_bits(
    text_checkpoints, names, monkeypatch
):
    """A cache shorter than the sliding window (its rings as long as the cache, shorter than the
    window's past and the new key): decode steps still read the rings in place,
    skipping the window's positions before 0, with the bits of the copied keys (one row, whose keys
    are a slice; rows of different lengths, each with its mask)."""
    from torchgemma import cache as cache_module
    from torchgemma.generation import Engine

    model = fuse_cpu_ops(torchgemma.load(text_checkpoints["e2b"], dtype=torch.float32))
    window = model.config.text.sliding_window
    prompts = {"a": [5, 6], "b": [20], "c": [40, 41, 42]}

    def run():
        engine = Engine(model, max_batch_size=3, max_len=window - 1)
        for name in names:
            engine.add_request(
                name, prompts[name], max_new_tokens=window - 1 - len(prompts[name]), logprobs=0
            )
        got = {name: [] for name in names}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id].append((out.token_id, out.logprobs.logprob))
        assert engine.cache.ring == window - 1 < engine.cache.past_len + 1  # the past alone fills it
        return got

    ring_calls = []

    def ring_kernel(q, k, v, scale, visible, slots, offsets):
        ring_calls.append(visible.shape)
        return torch.ops.torchgemma.decode_attention_ring(q, k, v, scale, visible, slots, offsets)

    monkeypatch.setattr(cpu_fusions, "_DECODE_ATTENTION_RING", ring_kernel)
    in_place = run()
    assert ring_calls and all(keys <= window - 1 for _, keys in ring_calls)
    monkeypatch.setattr(cache_module.SlidingLayerCache, "_in_place", lambda self, key, step: False)
    copied = run()
    assert in_place == copied


@pytest.mark.parametrize("source", ["gemma3-gguf", "e2b", "e2b-int8", "31b-int8"])
def test_the_fused_decoder_layer_gives_the_layers_bits(text_checkpoints, tmp_path, source, monkeypatch):
    """A fused model's decoder layers run their one-token calls (the decode steps, rows of their own
    lengths included) through FusedDecoderLayer's direct calls, with the logits of DecoderLayer's own
    forward to the bit: a Gemma 3 GGUF (as loaded: quantized, fused), a Gemma 4 E2B in float32 and
    quantized to int8 (per-layer inputs, KV-shared layers, value norms) and a Gemma 4 31B quantized
    to int8 (K=V layers). Quantized layers take the two C++ calls around their attention
    (decode_layer_qkv where a layer makes its own keys, decode_layer_output); float32 ones do not."""
    if source == "gemma3-gguf":
        from gguf_fixtures import random_model, write_gguf

        path = tmp_path / "gemma3.gguf"
        write_gguf(path, random_model("gemma3_text", {}, seed=7))
        model = torchgemma.load(path)
    elif source == "e2b":
        model = fuse_cpu_ops(torchgemma.load(text_checkpoints["e2b"], dtype=torch.float32))
    else:
        name = source.removesuffix("-int8")
        model = torchgemma.quantize(torchgemma.load(text_checkpoints[name], dtype=torch.float32), "int8")
    layers = model.language_model.layers
    assert all(type(layer) is FusedDecoderLayer for layer in layers)
    ids, mask = padded_batch(seed=5)
    ids = ids % model.config.text.vocab_size

    def run() -> torch.Tensor:
        with torch.inference_mode():
            cache = model.make_cache(2, 24)
            steps = [model(ids[:, :9], cache=cache)]
            steps += [model(ids[:, t : t + 1], cache=cache) for t in range(9, 14)]
            # Rows of their own lengths: a one-token call whose rows read different key ranges.
            steps.append(model(ids[:1, 14:15], cache=cache, slots=[0]))
            steps.append(model(ids[:, 15:16], cache=cache))
        return torch.cat([step[:, -1] for step in steps])

    calls = {"attend": 0, "qkv": 0, "output": 0}

    def counted(name, function):
        def call(*args):
            calls[name] += 1
            return function(*args)

        return call

    monkeypatch.setattr(cpu_fusions, "_attend_to", counted("attend", cpu_fusions._attend_to))
    monkeypatch.setattr(cpu_fusions, "_DECODE_LAYER_QKV", counted("qkv", cpu_fusions._DECODE_LAYER_QKV))
    monkeypatch.setattr(
        cpu_fusions, "_DECODE_LAYER_OUTPUT", counted("output", cpu_fusions._DECODE_LAYER_OUTPUT)
    )
    fused = run()
    assert calls["attend"] == 7 * len(layers)  # every one-token call of every layer, no prefill
    if source == "e2b":
        assert calls["qkv"] == calls["output"] == 0
    elif source == "gemma3-gguf":  # the fixture mixes float32 and quantized products: some of each path
        assert 0 < calls["qkv"] < calls["attend"] and 0 < calls["output"] < calls["attend"]
    else:
        own_keys = sum(layer.self_attn.spec.kv_role != "reuse" for layer in layers)
        assert (calls["qkv"], calls["output"]) == (7 * own_keys, 7 * len(layers))
        # E2B's KV-shared layers make only their queries, in Python
        assert (own_keys < len(layers)) == (source == "e2b-int8")
    for layer in layers:
        layer.__class__ = DecoderLayer
    assert torch.equal(fused, run())


def test_the_fused_layers_kept_lists_follow_new_weights_hooks_and_parts(text_checkpoints):
    """FusedDecoderLayer builds its C++ calls' lists once and keeps them: a weight adopted anew
    (``set_quantized``), a part replaced and a hook registered after that are each seen at the next
    step, with the logits of DecoderLayer's own forward under the same changes."""

    def run(fused: bool) -> tuple[torch.Tensor, int]:
        model = torchgemma.quantize(torchgemma.load(text_checkpoints["e2b"], dtype=torch.float32), "int8")
        layers = model.language_model.layers
        if not fused:
            for layer in layers:
                layer.__class__ = DecoderLayer
        ids = torch.arange(3, 17).unsqueeze(0) % model.config.text.vocab_size
        hooked = []
        with torch.inference_mode():
            cache = model.make_cache(1, 16)
            steps = [model(ids[:, :9], cache=cache)]
            steps += [model(ids[:, t : t + 1], cache=cache) for t in (9, 10)]
            assert all(bool(vars(layer).get("_decode_memos")) == fused for layer in layers)
            gate = layers[0].mlp.gate_proj
            gate.set_quantized(gate.qweight.flip(0), gate.scales * 2, gate.mins)
            steps.append(model(ids[:, 11:12], cache=cache))
            old = layers[2].post_feedforward_layernorm
            new = FusedRMSNorm(old.weight.shape[0], old.eps, plus_one=old.plus_one)
            new.weight.copy_(old.weight + 0.5)
            layers[2].post_feedforward_layernorm = new
            steps.append(model(ids[:, 12:13], cache=cache))
            layers[1].self_attn.o_proj.register_forward_hook(lambda *args: hooked.append(1))
            steps.append(model(ids[:, 13:14], cache=cache))
        model.float()  # a conversion drops the kept lists (they hold the weights it replaces)
        assert not any("_decode_memos" in vars(layer) for layer in layers)
        return torch.cat([step[:, -1] for step in steps]), len(hooked)

    fused, hooked = run(True)
    reference, hooked_reference = run(False)
    assert hooked == hooked_reference == 1
    assert torch.equal(fused, reference)

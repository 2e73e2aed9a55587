"""Gemma 4's MTP drafters against transformers 5.23 on tiny random drafter/target pairs.

* Logits: ours and transformers' ``Gemma4AssistantForCausalLM`` (and the unified one) on the same
  inputs (the target's embedding, hidden state and keys/values, taken from our target's cache),
  three drafting steps, float32 to 1e-5 and bfloat16 to the bit; the E2B/E4B centroid head included.
* Drafts: ``MTPDrafter.propose`` from our target's state equals what transformers'
  ``SinglePositionMultiTokenCandidateGenerator`` (what ``generate(assistant_model=...)`` runs) drafts
  from transformers' target in the same state, several requests in one call, before and past the
  sliding window, and after a rollback across the sliding ring.
* Loading: strict (missing, unexpected, mis-shaped tensors named), configs refused with the reason,
  drafters that do not fit their target refused before any weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import torchgemma
from assistant_checkpoints import build_drafter, build_target, reference_drafter
from checkpoints import reference_model
from torchgemma.cache import KVCache
from torchgemma.config import ConfigError
from torchgemma.config.assistant import AssistantConfig
from torchgemma.generation.mtp import DrafterMismatch, MTPDrafter, load_drafter
from torchgemma.weights.assistant import load_assistant
from torchgemma.weights.source import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")

# name -> (target style, unified target, centroid head). The first three have KV-shared targets,
# whose drafters transformers' generate can drive (it hands a drafter only what a target's KV-sharing
# "store" layers record); the others read a plain target's last full and last sliding layers.
PAIRS = {
    "e2b-centroids": ("e2b", False, True),
    "e4b": ("e4b", False, False),
    "unified-kv-shared-centroids": ("kv-shared", True, True),
    "31b": ("31b", False, False),
    "unified-12b": ("12b", True, False),
}
GENERATE_PAIRS = ["e2b-centroids", "e4b", "unified-kv-shared-centroids"]
WINDOW = 5  # checkpoints.COMMON's sliding window
STEPS = 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each pair's (target folder, drafter folder), built on first use."""
    built: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in built:
            style, unified, ordered = PAIRS[name]
            root = tmp_path_factory.mktemp(name)
            built[name] = (
                build_target(root / "target", style, unified=unified),
                build_drafter(root / "drafter", style, unified=unified, ordered=ordered),
            )
        return built[name]

    return get


def prefill(target, tokens: list[list[int]], drafter: MTPDrafter, max_rollback: int = 0):
    """A cache holding each row's tokens but the last in slot b; the final-normed hidden states."""
    cache = KVCache(
        target.config.text,
        len(tokens),
        64,
        max_rollback=max_rollback,
        min_ring=drafter.min_ring(max_rollback),
        dtype=target.dtype,
    )
    hidden = []
    with torch.no_grad():
        for slot, row in enumerate(tokens):
            ids = torch.tensor([row[:-1]])
            hidden.append(target.language_model(ids, cache=cache, slots=[slot], head=False)[0, -1])
    return cache, hidden


def requests(tokens, hidden, num_tokens):
    return [
        SimpleNamespace(tokens=row, num_tokens=num_tokens, slot=slot, hidden=hidden[slot])
        for slot, row in enumerate(tokens)
    ]


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# ── logits ────────────────────────────────────────────────────────────────────────────────────


def assert_same(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str):
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, what
    if dtype == torch.bfloat16:
        assert torch.equal(ours, ref), f"{what}: bf16 differs by {(ours.float() - ref.float()).abs().max()}"
    else:
        assert (ours - ref).abs().max().item() <= 1e-5, what


def cases(names, default):
    """(name, dtype) for each pair and dtype; those not in ``default`` marked slow (the default
    run keeps bf16, the bit-for-bit case, for every pair it runs)."""
    return [
        pytest.param(
            name, dtype, id=f"{name}-{label}", marks=[] if (name, label) in default else [pytest.mark.slow]
        )
        for name in names
        for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
    ]


LOGITS_DEFAULT = {(name, "bf16") for name in PAIRS} | {("e2b-centroids", "fp32")}
DRAFTS_DEFAULT = {("e2b-centroids", "bf16"), ("unified-kv-shared-centroids", "fp32")}


@pytest.mark.parametrize(("name", "dtype"), cases(PAIRS, LOGITS_DEFAULT))
def test_step_logits_match_transformers(folders, name, dtype):
    """Three drafting steps on the same inputs: logits and the projected state fed back (eager
    attention, as transformers' eager)."""
    check_steps(folders, name, dtype, "eager")


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("e2b-centroids", torch.bfloat16), ("31b", torch.float32)],
    ids=["e2b-bf16", "31b-fp32"],
)
def test_step_logits_match_transformers_sdpa(folders, name, dtype):
    """The default attention backend against transformers' sdpa drafter."""
    check_steps(folders, name, dtype, "sdpa")


def check_steps(folders, name: str, dtype: torch.dtype, attention: str) -> None:
    target_dir, drafter_dir = folders(name)
    target = torchgemma.load(target_dir, dtype=dtype, attention=attention)
    drafter = load_drafter(drafter_dir, target)
    assert drafter.drafter.model.attention == attention
    ref = reference_drafter(drafter_dir, dtype, attention)
    tokens = prompt(12, seed=3)  # past the sliding window: its ring has wrapped
    cache, hidden = prefill(target, [tokens], drafter)
    length = len(tokens) - 1
    target_kv = {
        kind: cache.layer_keys(
            0, layer, max(0, length - WINDOW - 1) if kind == "sliding_attention" else 0, length
        )
        for kind, layer in drafter.sources.items()
    }
    position = torch.tensor([[length]])
    token = torch.tensor([[tokens[-1]]])
    ours_state = ref_state = hidden[0].view(1, 1, -1)
    with torch.no_grad():
        for step in range(STEPS):
            embeds = target.language_model.embed(token)
            logits, ours_state = drafter.drafter.step(embeds, ours_state, position, target_kv)
            out = ref(
                inputs_embeds=torch.cat([embeds, ref_state], dim=-1),
                position_ids=position,
                shared_kv_states={kind: tuple(t.clone() for t in kv) for kind, kv in target_kv.items()},
            )
            assert_same(logits, out.logits, dtype, f"step {step} logits")
            assert_same(ours_state, out.last_hidden_state, dtype, f"step {step} state")
            ref_state = out.last_hidden_state
            token = logits.argmax(-1)
    if PAIRS[name][2]:
        # The centroid head masks: most tokens share the row's floor, less than every scored logit.
        row = logits[0, 0]
        assert (row == row.min()).sum() == 300 - 3 * 30


# ── drafts ────────────────────────────────────────────────────────────────────────────────────


def transformers_drafts(ref_target, ref_drafter, tokens: list[int], num_tokens: int) -> list[int]:
    """transformers' candidate generator after its target read ``tokens[:-1]`` (as after prefill)."""
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    ids = torch.tensor([tokens])
    with torch.no_grad():
        outputs = ref_target(
            ids[:, :-1], use_cache=True, output_hidden_states=True, return_shared_kv_states=True
        )
    ref_drafter.generation_config.num_assistant_tokens = num_tokens
    generator = SinglePositionMultiTokenCandidateGenerator(
        ref_drafter, ref_target.get_input_embeddings(), GenerationConfig(max_length=1000)
    )
    kwargs = {"attention_mask": torch.ones_like(ids)}
    candidates, _ = generator.get_candidates(ids, kwargs, outputs, is_first_iteration=False, n_last_matches=0)
    return candidates[0, len(tokens) :].tolist()


@pytest.mark.parametrize(("name", "dtype"), cases(GENERATE_PAIRS, DRAFTS_DEFAULT))
def test_propose_matches_transformers(folders, name, dtype):
    """Three requests in one call: shorter than the window, just past W + 1, and long."""
    target_dir, drafter_dir = folders(name)
    target = torchgemma.load(target_dir, dtype=dtype, attention="eager")
    drafter = load_drafter(drafter_dir, target)
    ref_target, ref_drafter = reference_model(target_dir, dtype), reference_drafter(drafter_dir, dtype)
    rows = [prompt(length, seed=length) for length in (3, 8, 21)]
    cache, hidden = prefill(target, rows, drafter)
    drafts = drafter.propose(requests(rows, hidden, 4), cache)
    expected = [transformers_drafts(ref_target, ref_drafter, row, 4) for row in rows]
    assert drafts == expected
    assert cache.lengths == [len(row) - 1 for row in rows]  # the target's cache is only read


def test_propose_after_rollback_across_the_ring(folders):
    """A slot that held 3 more tokens (the ring wrapped past them) and took them back drafts as a
    slot that never held them; a ring too small for that is refused, naming min_ring."""
    target_dir, drafter_dir = folders("e2b-centroids")
    target = torchgemma.load(target_dir, attention="eager")
    drafter = load_drafter(drafter_dir, target)
    tokens = prompt(19, seed=7)
    longer = tokens + prompt(3, seed=8)
    cache, _ = prefill(target, [longer], drafter, max_rollback=3)
    cache.rollback(0, 3)
    fresh, hidden = prefill(target, [tokens], drafter)
    request = requests([tokens], hidden, 5)
    assert drafter.propose(request, cache) == drafter.propose(request, fresh)

    small = target.make_cache(1, 64, max_rollback=3)
    with pytest.raises(ValueError, match=f"min_ring={drafter.min_ring(3)}"):
        drafter.propose(request, small)
    with pytest.raises(ValueError, match="read all 17 tokens before the last"):
        drafter.propose(requests([tokens[:-1]], hidden, 5), fresh)


# ── loading ───────────────────────────────────────────────────────────────────────────────────


def copy_drafter(source: Path, folder: Path, *, config=None, tensors=None) -> Path:
    """A copy of a drafter folder with its config.json and/or tensors edited."""
    folder.mkdir()
    data = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config(data) if config else data))
    weights = load_file(source / "model.safetensors")
    save_file(tensors(weights) if tensors else weights, folder / "model.safetensors")
    return folder


def test_load_is_strict(folders, tmp_path):
    _, drafter_dir = folders("e2b-centroids")
    assert isinstance(load_assistant(drafter_dir).config, AssistantConfig)

    def without(weights):
        return {k: v for k, v in weights.items() if k != "pre_projection.weight"}

    missing = copy_drafter(drafter_dir, tmp_path / "missing", tensors=without)
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: pre_projection\.weight"):
        load_assistant(missing)
    extra = copy_drafter(
        drafter_dir, tmp_path / "extra", tensors=lambda w: {**w, "model.extra": torch.ones(2)}
    )
    with pytest.raises(CheckpointError, match=r"no place in the model.*model\.extra"):
        load_assistant(extra)
    # Shared layers own no k/v: a k_proj is no part of a drafter.
    kv = copy_drafter(
        drafter_dir,
        tmp_path / "kv",
        tensors=lambda w: {**w, "model.layers.0.self_attn.k_proj.weight": torch.ones(16, 32)},
    )
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_assistant(kv)

    def wider(data):
        return {**data, "backbone_hidden_size": 48}

    shape = copy_drafter(drafter_dir, tmp_path / "shape", config=wider)
    with pytest.raises(CheckpointError, match=r"projection\.weight has shape \[.*\] but the config implies"):
        load_assistant(shape)

    def out_of_vocab(weights):
        return {**weights, "masked_embedding.token_ordering": weights["masked_embedding.token_ordering"] + 1}

    ordering = copy_drafter(drafter_dir, tmp_path / "ordering", tensors=out_of_vocab)
    with pytest.raises(CheckpointError, match=r"token_ordering holds ids outside the vocabulary \[0, 300\)"):
        load_assistant(ordering)


def edited(data: dict, **text) -> dict:
    return {**data, "text_config": {**data["text_config"], **text}}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: {**d, "model_type": "gemma4"}, "'gemma4' is not an MTP drafter"),
        (lambda d: edited(d, hidden_size_per_layer_input=8), "needs hidden_size_per_layer_input=0, got 8"),
        (lambda d: edited(d, enable_moe_block=True), "needs enable_moe_block=false"),
        (
            lambda d: edited(d, num_kv_shared_layers=1),
            "num_kv_shared_layers=3\\), got num_kv_shared_layers=1",
        ),
        (lambda d: {**d, "num_centroids": 7}, "num_centroids=7 must divide vocab_size=300"),
        (lambda d: {**d, "centroid_intermediate_top_k": 11}, "centroid_intermediate_top_k=11 exceeds"),
    ],
    ids=["model-type", "per-layer-input", "moe", "kv-shared", "centroids", "top-k"],
)
def test_config_refused(folders, edit, message):
    _, drafter_dir = folders("e2b-centroids")
    data = json.loads((drafter_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match=message):
        AssistantConfig.from_hf(edit(data))


def test_drafter_must_fit_its_target(folders, tmp_path):
    """Checked from the configs: the weights of a mismatched drafter are never read."""
    e2b_target, e2b_drafter = folders("e2b-centroids")
    _, e4b_drafter = folders("e4b")
    target = torchgemma.load(e2b_target, attention="eager")

    def configured(name, edit):
        folder = copy_drafter(e2b_drafter, tmp_path / name, config=edit)
        (folder / "model.safetensors").unlink()
        return folder

    cases = [
        (configured("hidden", lambda d: {**d, "backbone_hidden_size": 48}), "target of hidden size 48"),
        (
            configured("vocab", lambda d: edited(d, vocab_size=310)),
            "vocabulary has 310 tokens; the target's 300",
        ),
        (
            configured(
                "rope",
                lambda d: edited(
                    d,
                    rope_parameters={
                        **d["text_config"]["rope_parameters"],
                        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                    },
                ),
            ),
            "rotates sliding_attention queries",
        ),
        # E4B's drafter reads 2 KV heads; the E2B target's layers have 1.
        (
            e4b_drafter,
            r"sliding_attention layers attend to keys of head_dim 16 in 2 heads; the target's layer 5, which they read",
        ),
    ]
    for folder, message in cases:
        with pytest.raises(DrafterMismatch, match=message):
            load_drafter(folder, target)
    bf16 = load_assistant(e2b_drafter, dtype=torch.bfloat16)
    with pytest.raises(DrafterMismatch, match="load them in one dtype"):
        MTPDrafter(target, bf16)


def test_split_keys_refused_under_tensor_parallelism(folders, tmp_path):
    """Under --tensor-parallel-size every rank runs the whole drafter on its own share of the
    target's cache, and the ranks must draft alike. Where the target layers it reads have their KV
    heads split over the ranks (E4B's 2 at N=2) the drafter is refused, naming the flags, before
    any weight is read; where every rank holds them all (E2B's single KV head, replicated) it loads.
    The rank's share is its ``ShardPlan`` (what ``load`` records); the split load itself needs
    torchrun (tests/test_distributed_media.py, slow)."""
    from torchgemma.distributed import ShardPlan

    message = (
        r"split over 2 ranks \(--tensor-parallel-size 2\): the drafter reads all 2 KV heads of the "
        r"target's layer \d+ \(sliding_attention\), and each rank holds 1 of them\. Use --speculative ngram"
    )
    target_dir, drafter_dir = folders("e4b")
    target = torchgemma.load(target_dir, attention="eager")
    target.shard_plan = ShardPlan(target.config.text, size=2, rank=1)
    unread = copy_drafter(drafter_dir, tmp_path / "unread")
    (unread / "model.safetensors").unlink()
    with pytest.raises(DrafterMismatch, match=message):
        load_drafter(unread, target)
    with pytest.raises(DrafterMismatch, match=message):  # a loaded drafter (or a GGUF file's)
        MTPDrafter(target, load_assistant(drafter_dir))

    target_dir, drafter_dir = folders("e2b-centroids")
    target = torchgemma.load(target_dir, attention="eager")
    target.shard_plan = ShardPlan(target.config.text, size=2, rank=1)
    assert load_drafter(drafter_dir, target).target is target


# ── GGUF ──────────────────────────────────────────────────────────────────────────────────────


def test_gguf_drafter(folders, tmp_path):
    """llama.cpp's gemma4-assistant file: the same weights as the folder it was converted from, the
    centroid head skipped (llama.cpp's graph scores the whole vocabulary), so logits and drafts are
    transformers' drafter's with its plain head."""
    from gguf import GGUFWriter

    from assistant_checkpoints import write_drafter_gguf
    from torchgemma.weights.gguf import GGUFError

    target_dir, drafter_dir = folders("e2b-centroids")
    path = write_drafter_gguf(tmp_path / "drafter.gguf", drafter_dir, centroids=True)
    target = torchgemma.load(target_dir, attention="eager")
    drafter = load_drafter(path, target)
    assert not drafter.drafter.config.use_ordered_embeddings
    folder = load_assistant(drafter_dir).state_dict()
    ours = drafter.drafter.state_dict()
    assert set(folder) - set(ours) == {"masked_embedding.centroids.weight", "masked_embedding.token_ordering"}
    assert all(torch.equal(ours[name], folder[name]) for name in ours)

    ref_target, ref_drafter = reference_model(target_dir), reference_drafter(drafter_dir)
    ref_drafter.config.use_ordered_embeddings = False  # as llama.cpp runs the file: the tied head
    rows = [prompt(length, seed=length) for length in (4, 13)]
    cache, hidden = prefill(target, rows, drafter)
    expected = [transformers_drafts(ref_target, ref_drafter, row, 3) for row in rows]
    assert drafter.propose(requests(rows, hidden, 3), cache) == expected

    writer = GGUFWriter(str(tmp_path / "model.gguf"), "gemma4")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        GGUFError, match="architecture 'gemma4'; an MTP drafter's GGUF file is 'gemma4-assistant'"
    ):
        load_assistant(tmp_path / "model.gguf")


# ── the target's keys, read from its cache ────────────────────────────────────────────────────


def test_layer_keys_read_the_cache_in_place(folders):
    """Full layers as views of the buffer; a sliding ring in position order across its wrap, as
    ``KVCache.read`` copies them; positions a rollback cannot bring back refused."""
    target_dir, _ = folders("e2b-centroids")
    target = torchgemma.load(target_dir, attention="eager")
    text = target.config.text
    cache = KVCache(text, 2, 64, max_rollback=2, dtype=target.dtype)
    with torch.no_grad():
        target.language_model(torch.tensor([prompt(13, seed=1)]), cache=cache, slots=[1])
    full = next(i for i, s in enumerate(text.layers) if s.kv_role != "reuse" and not s.is_sliding)
    sliding = next(i for i, s in enumerate(text.layers) if s.kv_role != "reuse" and s.is_sliding)
    copies = cache.read(1, 6, 13)
    keys, values = cache.layer_keys(1, full, 0, 13)
    assert keys.data_ptr() == cache.layers[full].keys[1].data_ptr()  # a view: nothing copied
    assert torch.equal(keys[0, :, 6:], copies[full][0]) and torch.equal(values[0, :, 6:], copies[full][1])
    keys, values = cache.layer_keys(1, sliding, 6, 13)  # the ring (7 columns) wraps inside these
    assert torch.equal(keys[0], copies[sliding][0]) and torch.equal(values[0], copies[sliding][1])
    cache.rollback(1, 2)
    with pytest.raises(
        ValueError, match="hold positions 6 on .*position 5 is gone: make the cache with a larger min_ring"
    ):
        cache.layer_keys(1, sliding, 5, 11)
    with pytest.raises(ValueError, match="is KV-shared"):
        cache.layer_keys(1, text.num_hidden_layers - 1, 0, 5)


def test_load_drafter_from_a_hub_id(folders, monkeypatch):
    target_dir, drafter_dir = folders("e4b")
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None, **kwargs):
        calls.append(repo_id)
        return str(drafter_dir)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    drafter = load_drafter("google/gemma-4-tiny-assistant", torchgemma.load(target_dir))
    assert calls == ["google/gemma-4-tiny-assistant"]
    assert drafter.drafter.config.model_type == "gemma4_assistant"


# ── in the speculative engine ─────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)], ids=["fp32", "bf16"]
)
def test_generate_with_mtp_equals_without(tmp_path, dtype):
    """Greedy output with MTP speculation is token for token the output without, on a pair whose
    drafts are accepted now and then (both the accepting and the rolling-back paths run), three
    ragged prompts batched, the drafter given by path and as a loaded drafter. Runs where the
    speculative engine (generation/speculative.py, issue 26's other half) is in the build."""
    pytest.importorskip("torchgemma.generation.speculative")
    from assistant_checkpoints import make_echo_pair
    from torchgemma.generation import generate
    from torchgemma.generation.generate import GenerationStats

    target_dir = build_target(tmp_path / "target", "e2b")
    drafter_dir = build_drafter(tmp_path / "drafter", "e2b", ordered=True)
    make_echo_pair(target_dir, drafter_dir)
    target = torchgemma.load(target_dir, dtype=dtype)
    prompts = [prompt(length, seed=length) for length in (3, 9, 14)]
    plain = generate(target, prompts, max_new_tokens=24, stop_token_ids=[])
    for model in (str(drafter_dir), load_drafter(drafter_dir, target)):
        stats = GenerationStats()
        speculative = {"method": "mtp", "model": model, "num_tokens": 3}
        out = generate(
            target, prompts, max_new_tokens=24, stop_token_ids=[], stats=stats, speculative=speculative
        )
        assert out == plain
        if dtype == torch.float32:  # (bf16 on a tiny model may draft nothing: batch invariance first)
            assert 0 < stats.accepted_tokens < stats.drafted_tokens


def test_quantized_target_and_drafter(folders):
    """An int8 target (its embedding table quantized too) and an int8 drafter (``torchgemma.quantize``,
    centroid head included: its rows come dequantized from the quantized table): they draft, and
    the drafter's logits stay near the full-precision drafter's on the same inputs."""
    target_dir, drafter_dir = folders("e2b-centroids")
    target = torchgemma.load(target_dir, quantize="int8")
    full = load_drafter(drafter_dir, target)
    quantized = load_drafter(torchgemma.quantize(load_assistant(drafter_dir), "int8"), target)
    assert type(quantized.drafter.model.embed_tokens).__name__ == "QuantizedEmbedding"
    rows = [prompt(length, seed=length) for length in (4, 13)]
    cache, hidden = prefill(target, rows, full)
    drafts = quantized.propose(requests(rows, hidden, 4), cache)
    assert [len(d) for d in drafts] == [4, 4] and all(0 <= t < 300 for d in drafts for t in d)
    length = len(rows[1]) - 1
    starts = {"sliding_attention": length - WINDOW - 1, "full_attention": 0}
    target_kv = {
        kind: cache.layer_keys(1, layer, starts[kind], length) for kind, layer in full.sources.items()
    }
    args = (
        target.language_model.embed(torch.tensor([[rows[1][-1]]])),
        hidden[1].view(1, 1, -1),
        torch.tensor([[length]]),
    )
    with torch.no_grad():
        ours, _ = quantized.drafter.step(*args, target_kv)
        ref, _ = full.drafter.step(*args, target_kv)
    scored = ref > ref.min()  # the tokens both centroid heads scored (same clusters here)
    assert torch.equal(ours > ours.min(), scored)
    assert (ours[scored] - ref[scored]).abs().max() < 0.02 * ref[scored].abs().max()

"""Checkpoints whose files mirror the published ones (tests/published_files.py): each loads here as
transformers (and, for EmbeddingGemma, sentence-transformers) loads it, to the same ids, logits and
vectors; a token the tokenizer has but the embedding table lacks is refused only when used; and
``torchgemma info`` names the KV cache's dtype the loaded model really allocates.

The default run takes EmbeddingGemma and Gemma 3 270M (~20 CPU-s with the folders' builds); the
other families' parity checks run with ``-m slow``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import torchgemma
from published_files import EMBEDDING_PROMPTS, PUBLISHED_NAMES
from torchgemma.cli import main
from torchgemma.info import describe, inspect_checkpoint
from torchgemma.llm import LLM
from torchgemma.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

# In the default run (the others: ~3 CPU-s each, a 262k-id tokenizer and model read twice).
DEFAULT_RUN = ("gemma-3-270m",)
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Zürich, 日本語 and emoji 🙂", "Hi"]
# Past the 262,144-row table of EmbeddingGemma and Gemma 3 270M/1B (added_tokens.json).
SOFT_TOKEN, SOFT_ID = "<image_soft_token>", 262144


@pytest.fixture(scope="module")
def loaded(published_checkpoint):
    """``loaded(name)``: the folder's LLM in float32 with eager attention, loaded once per module
    (a 262k-id tokenizer takes a second or two). Shared: tests must not change it."""
    llms: dict[str, LLM] = {}

    def get(name: str) -> LLM:
        if name not in llms:
            llms[name] = LLM(
                published_checkpoint(name), dtype=torch.float32, attention="eager", progress=False
            )
        return llms[name]

    return get


def _reference(folder):
    """transformers' model of the folder: the class its config.json names, float32, eager."""
    import transformers

    from gemma3n_checkpoints import vision_tower_stub

    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    with vision_tower_stub():  # Gemma 3n's timm tower is not installed (it is not on the text path)
        model = getattr(transformers, architecture).from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        )
    return model.eval()


# ── every family: ids, chat template and logits equal transformers' ─────────────────────────────


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=() if name in DEFAULT_RUN else pytest.mark.slow)
        for name in PUBLISHED_NAMES
        if name != "embeddinggemma-300m"
    ],
)
def test_loads_and_matches_transformers(published_checkpoint, loaded, name):
    from transformers import AutoTokenizer

    folder = published_checkpoint(name)
    llm = loaded(name)
    reference_tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(llm.tokenizer) == len(reference_tokenizer)
    text = "The quick brown fox, Zürich 日本語 <start_of_turn> <|turn>"
    assert llm.tokenizer.encode(text) == reference_tokenizer(text)["input_ids"]
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hello there, how are you?"},
        {"role": "assistant", "content": "Fine."},
        {"role": "user", "content": "And the weather?"},
    ]
    ids = llm.chat_ids(messages)
    assert ids == list(
        reference_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    )

    reference = _reference(folder)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        theirs = reference(input_ids=input_ids).logits
        ours = llm.model(input_ids)
    assert ours.shape == theirs.shape == (1, len(ids), llm.model.config.text.vocab_size)
    assert (ours - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=() if name in DEFAULT_RUN else pytest.mark.slow,
        )
        for name in PUBLISHED_NAMES
        if name != "embeddinggemma-300m"
    ],
)
def test_defaults_equal_transformers_defaults_in_bf16(published_checkpoint, loaded, name):
    """What a user runs by default on each published folder: ``torchgemma.load(folder)`` (the
    published dtype, bfloat16; sdpa) against ``from_pretrained(folder)`` with transformers' own
    defaults (the same dtype, sdpa, its default experts): the same logits to the bit."""
    import transformers

    from gemma3n_checkpoints import vision_tower_stub

    folder = published_checkpoint(name)
    ours = torchgemma.load(folder, progress=False)
    assert ours.dtype == torch.bfloat16
    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    with vision_tower_stub():
        reference = getattr(transformers, architecture).from_pretrained(folder).eval()
    ids = torch.tensor([loaded(name).chat_ids([{"role": "user", "content": "Write a poem about the sea."}])])
    with torch.no_grad():
        theirs = reference(input_ids=ids).logits
        logits = ours(ids)
    assert theirs.dtype == logits.dtype == torch.bfloat16
    assert torch.equal(logits, theirs), f"max |Δ| = {(logits.float() - theirs.float()).abs().max().item()}"


# ── EmbeddingGemma: its tokenizer's 262,145th id, sentence-transformers' vectors ────────────────


@pytest.fixture(scope="module")
def embeddinggemma(published_checkpoint):
    return published_checkpoint("embeddinggemma-300m")


def test_embeddinggemma_loads_and_equals_sentence_transformers(embeddinggemma, loaded):
    """The published folder's tokenizer has 262,145 ids (added_tokens.json: <image_soft_token> ->
    262144) for 262,144 embedding rows: ``LLM(folder)`` and ``torchgemma.embed(model=folder)``
    refused it; sentence-transformers loads it, and our vectors equal its own."""
    from sentence_transformers import SentenceTransformer

    ours = torchgemma.embed(TEXTS, model=embeddinggemma, prompt_name="query")  # its own default load
    llm = loaded("embeddinggemma-300m")
    assert len(llm.tokenizer) == SOFT_ID + 1 and llm.tokenizer.token_id(SOFT_TOKEN) == SOFT_ID
    assert llm.model.config.text.vocab_size == SOFT_ID
    assert ours.dtype == torch.float32  # config.json's dtype

    reference = SentenceTransformer(str(embeddinggemma), model_kwargs={"attn_implementation": "eager"})
    assert reference.prompts["query"] == EMBEDDING_PROMPTS["query"] and len(reference.prompts) == 14
    for prompt_name, vectors in [("query", ours), ("document", llm.embed(TEXTS, prompt_name="document"))]:
        theirs = reference.encode(TEXTS, prompt_name=prompt_name, convert_to_tensor=True)
        assert vectors.shape == theirs.shape == (len(TEXTS), 24)
        assert (vectors - theirs).abs().max().item() <= 1e-5, prompt_name


def test_a_token_past_the_table_is_refused_when_used(loaded):
    """Named, with its id and the table's size, before the model runs (not an IndexError inside)."""
    message = rf"uses token '{SOFT_TOKEN}' \(id {SOFT_ID}\), which the tokenizer defines but the model cannot embed: its embedding table has {SOFT_ID} rows"
    llm = loaded("embeddinggemma-300m")
    with pytest.raises(ValueError, match=r"texts\[1\] " + message):
        llm.embed(["fine", f"an image {SOFT_TOKEN} here"])
    assert llm.embed(["fine"]).shape == (1, 24)  # the same model, still usable

    generative = loaded("gemma-3-270m")
    with pytest.raises(ValueError, match="the prompt " + message):
        generative.generate(f"Describe {SOFT_TOKEN}", max_new_tokens=2, temperature=0)
    with pytest.raises(ValueError, match="the prompt " + message):
        list(generative.stream(f"Describe {SOFT_TOKEN}", max_new_tokens=2, temperature=0))
    # Typed into a chat message it is text (control tokens are sanitized), so the chat runs.
    reply = generative.chat(
        [{"role": "user", "content": f"what is {SOFT_TOKEN}?"}], max_new_tokens=2, temperature=0
    )
    assert len(reply.token_ids) <= 2


@pytest.mark.slow  # two 262k-id tokenizers (~4 CPU-s)
def test_added_tokens_json_alone_is_read_as_transformers_reads_it(embeddinggemma, tmp_path):
    """Without added_tokens_decoder in tokenizer_config.json, transformers takes added tokens from
    added_tokens.json (legacy) and tokenizer.json; a token only the former lists still gets its id."""
    from transformers import AutoTokenizer

    for name in ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
        shutil.copy(embeddinggemma / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["added_tokens_decoder"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    data = json.loads((embeddinggemma / "tokenizer.json").read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != SOFT_TOKEN]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))

    ours, theirs = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert len(ours) == len(theirs) == SOFT_ID + 1
    text = f"an image {SOFT_TOKEN} here"
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert SOFT_ID in ours.encode(text)


# ── torchgemma info: the KV cache's dtype and bytes are what the loaded model allocates ──────────


def _cache_dtype(cache) -> torch.dtype:
    return next(layer.keys.dtype for layer in cache.layers if layer is not None)


def test_info_names_the_dtype_load_allocates(published_checkpoint, tmp_path):
    """config.json's dtype (bfloat16 for Gemma 3 270M, float32 for EmbeddingGemma); without one,
    the stored tensors' (here bfloat16)."""
    untyped = tmp_path / "untyped"
    shutil.copytree(published_checkpoint("gemma-3-270m"), untyped)
    config = json.loads((untyped / "config.json").read_text())
    del config["torch_dtype"]
    (untyped / "config.json").write_text(json.dumps(config))
    folders = {
        "bfloat16": published_checkpoint("gemma-3-270m"),
        "float32": published_checkpoint("embeddinggemma-300m"),
        "untyped": untyped,
    }
    for expected, folder in folders.items():
        config, dtype = inspect_checkpoint(folder)
        info = describe(config, context=37, batch=2, dtype=dtype)
        cache = torchgemma.load(folder, progress=False).make_cache(2, 37)
        assert info["kv_cache_dtype"] == str(_cache_dtype(cache)).removeprefix("torch."), expected
        assert info["kv_cache_bytes"] == cache.nbytes, expected
    assert info["kv_cache_dtype"] == "bfloat16"  # the untyped folder: from the safetensors headers


def test_info_on_the_270m_gguf_names_float32(real_270m_file, capsys):
    """The 270M GGUF was reported as a bfloat16 cache of 108.5 MB; load dequantizes into float32,
    and its cache is float32 (217.1 MB at the full 32,768 context)."""
    assert main(["info", "gemma3-270m", "--json", "--context", "64"]) == 0
    info = json.loads(capsys.readouterr().out)
    cache = torchgemma.load("gemma3-270m", progress=False).make_cache(1, 64)
    assert info["kv_cache_dtype"] == "float32" == str(_cache_dtype(cache)).removeprefix("torch.")
    assert info["kv_cache_bytes"] == cache.nbytes
    config, dtype = inspect_checkpoint("gemma3-270m")
    full = describe(config, dtype=dtype)
    assert (full["context"], full["kv_cache_bytes"]) == (32768, 217_055_232)

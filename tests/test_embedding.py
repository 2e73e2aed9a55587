"""Sentence embeddings (EmbeddingGemma): ``LLM.embed`` / ``torchgemma.embed`` against sentence-transformers.

The checkpoint is built the way EmbeddingGemma is published: a tiny random bidirectional
``Gemma3TextModel`` (transformers) with a Gemma-style tokenizer that writes ``<bos> ... <eos>``,
wrapped by sentence-transformers itself in Transformer -> Pooling(mean) -> Dense -> Dense ->
Normalize with EmbeddingGemma's task prompts, and saved by ``SentenceTransformer.save``. Every
comparison is against ``SentenceTransformer(folder).encode(...)`` on that folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Dense as STDense
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling as STPooling
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

import torchgemma
from checkpoints import randomize_
from tokenizer_fixtures import SAMPLE_TEXT, VOCAB_SIZE, write_gemma4_tokenizer
from torchgemma.config import FULL, SLIDING, ModelConfig
from torchgemma.embedding import ACTIVATIONS, POOLING_MODES, Dense, Pooling, SentenceHead
from torchgemma.llm import LLM

# Tiny models: one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")

HIDDEN = 64
# EmbeddingGemma's prompts (a few of them), as its config_sentence_transformers.json writes them.
PROMPTS = {
    "query": "task: search result | query: ",
    "document": "title: none | text: ",
    "Classification": "task: classification | query: ",
}
# Lengths from 2 to ~60 tokens: padded batches, and texts longer than the sliding window (3 keys
# either side, bidirectional) and than the truncation tests' limit.
TEXTS = [line for line in SAMPLE_TEXT.splitlines() if line.strip()][:9] + ["Hi", "Gemma", "Zürich 日本語"]


def _gemma3_tokenizer(folder: Path, padding_side: str) -> None:
    """The fixture tokenizer, made to write ``<bos> text <eos>`` as EmbeddingGemma's does."""
    write_gemma4_tokenizer(folder, chat_template=None)
    backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>",
        pair="<bos> $A <eos> $B:1 <eos>:1",
        special_tokens=[("<bos>", backend.token_to_id("<bos>")), ("<eos>", backend.token_to_id("<eos>"))],
    )
    backend.save(str(folder / "tokenizer.json"))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["padding_side"] = padding_side
    config_path.write_text(json.dumps(config, indent=2))


def build_embedding_folder(
    folder: Path,
    *,
    seed: int = 0,
    padding_side: str = "right",
    pooling: str = "mean",
    include_prompt: bool = True,
    second_dense: dict | None = None,
    normalize: bool = True,
    default_prompt_name: str | None = None,
    max_seq_length: int | None = None,
) -> Path:
    """An EmbeddingGemma-layout folder, written by sentence-transformers (safetensors throughout)."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    backbone = folder.parent / f"{folder.name}-backbone"
    _gemma3_tokenizer(backbone, padding_side)
    config = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=4,
        layer_types=[SLIDING, FULL] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=5,
        max_position_embeddings=512,
        use_bidirectional_attention=True,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    model = Gemma3TextModel(config)
    randomize_(model, seed)
    model.save_pretrained(backbone)
    transformer = Transformer(str(backbone))
    if max_seq_length is not None:
        transformer.max_seq_length = max_seq_length
    modules = [
        transformer,
        STPooling(HIDDEN, pooling, include_prompt=include_prompt),
        STDense(HIDDEN, 3 * HIDDEN // 2, bias=False, activation_function=torch.nn.Identity()),
        STDense(
            3 * HIDDEN // 2,
            HIDDEN,
            **(second_dense or dict(bias=False, activation_function=torch.nn.Identity())),
        ),
    ]
    if normalize:
        modules.append(Normalize())
    st = SentenceTransformer(modules=modules, prompts=PROMPTS, default_prompt_name=default_prompt_name)
    with torch.no_grad():  # non-trivial dense weights and biases
        gen = torch.Generator().manual_seed(seed + 1)
        for parameter in (p for module in modules[2:] for p in module.parameters()):
            parameter.copy_(torch.randn(parameter.shape, generator=gen) / parameter.shape[-1] ** 0.5)
    st.save(str(folder), safe_serialization=True)
    shutil.rmtree(backbone)
    return folder


def as_published(source: Path, folder: Path, max_seq_length: int) -> Path:
    """``source`` rewritten in the layout sentence-transformers 5 gave the published EmbeddingGemma:
    short module type names, one flag per pooling mode, ``max_seq_length`` in sentence_bert_config.json."""
    shutil.copytree(source, folder)
    modules = json.loads((folder / "modules.json").read_text())
    for entry in modules:
        entry["type"] = "sentence_transformers.models." + entry["type"].rsplit(".", 1)[-1]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    pooling = json.loads((folder / "1_Pooling/config.json").read_text())
    legacy = {"word_embedding_dimension": pooling["embedding_dimension"]}
    for flag, mode in [
        ("pooling_mode_cls_token", "cls"),
        ("pooling_mode_mean_tokens", "mean"),
        ("pooling_mode_max_tokens", "max"),
        ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens"),
        ("pooling_mode_weightedmean_tokens", "weightedmean"),
        ("pooling_mode_lasttoken", "lasttoken"),
    ]:
        legacy[flag] = pooling["pooling_mode"] == mode
    legacy["include_prompt"] = pooling["include_prompt"]
    (folder / "1_Pooling/config.json").write_text(json.dumps(legacy, indent=2))
    for dense in ("2_Dense", "3_Dense"):
        config = json.loads((folder / dense / "config.json").read_text())
        config.pop("module_input_name"), config.pop("module_output_name")
        (folder / dense / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "4_Normalize/config.json").unlink()
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
    )
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedding")
    gemma = build_embedding_folder(root / "embeddinggemma", seed=3)
    return {
        "embeddinggemma": gemma,
        "published": as_published(gemma, root / "published", max_seq_length=12),
        # Bias, tanh, no normalisation, prompt left out of the mean, a default prompt, a token limit.
        "variant": build_embedding_folder(
            root / "variant",
            seed=5,
            include_prompt=False,
            second_dense=dict(bias=True, activation_function=torch.nn.Tanh()),
            normalize=False,
            default_prompt_name="query",
            max_seq_length=10,
        ),
        # A tokenizer that pads on the left: sentence-transformers then shifts the positions of short
        # rows (transformers counts them from the first column); we do not, equal to rounding.
        "left": build_embedding_folder(root / "left", seed=7, padding_side="left"),
    }


def reference(folder: Path, dtype=torch.float32, attention: str = "sdpa") -> SentenceTransformer:
    return SentenceTransformer(str(folder), model_kwargs={"dtype": dtype, "attn_implementation": attention})


def assert_parity(ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    delta = (ours.float() - theirs.float()).abs().max().item()
    if dtype == torch.bfloat16:
        assert torch.equal(ours, theirs), f"max |Δ| = {delta}"
    else:
        assert delta <= 1e-5, f"max |Δ| = {delta}"


# ── parity with sentence-transformers ──────────────────────────────────────────────────────


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_embed_matches_sentence_transformers(folders, dtype, attention):
    folder = folders["embeddinggemma"]
    st = reference(folder, dtype, attention)
    llm = LLM(folder, dtype=dtype, attention=attention, progress=False)
    for options in ({}, {"prompt_name": "query"}, {"prompt_name": "document"}, {"prompt": "summarize: "}):
        theirs = st.encode(TEXTS, batch_size=5, convert_to_tensor=True, **options)
        ours = llm.embed(TEXTS, batch_size=5, **options)
        assert_parity(ours, theirs, dtype)
    norms = ours.float().norm(dim=-1)
    torch.testing.assert_close(
        norms, torch.ones_like(norms), rtol=0, atol=1e-2 if dtype != torch.float32 else 1e-6
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_variant_head_matches_sentence_transformers(folders, dtype):
    """Dense with bias and tanh, no Normalize, the prompt out of the mean, a default prompt, truncation."""
    folder = folders["variant"]
    st = reference(folder, dtype)
    llm = LLM(folder, dtype=dtype, progress=False)
    assert llm.sentence_head.max_length == 10 and not llm.sentence_head.normalize
    for options in ({}, {"prompt_name": "document"}, {"prompt": ""}):
        theirs = st.encode(TEXTS, batch_size=4, convert_to_tensor=True, **options)
        assert_parity(llm.embed(TEXTS, batch_size=4, **options), theirs, dtype)
    # The default prompt is "query": no prompt and prompt_name="query" are the same vectors.
    torch.testing.assert_close(
        llm.embed(TEXTS[:3]), llm.embed(TEXTS[:3], prompt_name="query"), rtol=0, atol=0
    )
    assert (llm.embed(TEXTS[:3]).float().norm(dim=-1) - 1).abs().max() > 0.01  # not normalized


def test_published_layout_matches_sentence_transformers(folders):
    """EmbeddingGemma's files as sentence-transformers 5 wrote them, with a 12-token limit."""
    folder = folders["published"]
    st = reference(folder)
    assert st.max_seq_length == 12
    llm = LLM(folder, progress=False)
    assert llm.sentence_head.max_length == 12
    theirs = st.encode(TEXTS, prompt_name="query", convert_to_tensor=True)
    assert_parity(llm.embed(TEXTS, prompt_name="query"), theirs, torch.float32)


def test_left_padding_tokenizer_equal_to_rounding(folders):
    folder = folders["left"]
    theirs = reference(folder).encode(TEXTS, batch_size=6, convert_to_tensor=True)
    ours = LLM(folder, progress=False).embed(TEXTS, batch_size=6)
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_truncate_dim_matches_sentence_transformers(folders):
    folder = folders["embeddinggemma"]
    theirs = reference(folder).encode(TEXTS[:4], truncate_dim=16, convert_to_tensor=True)
    ours = torchgemma.embed(TEXTS[:4], model=folder, truncate_dim=16)
    assert ours.shape == (4, 16)
    assert_parity(ours, theirs, torch.float32)


# ── batching, prompts, API ─────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_batch_equals_each_text_alone(folders, dtype):
    llm = LLM(folders["embeddinggemma"], dtype=dtype, progress=False)
    batched = llm.embed(TEXTS, batch_size=len(TEXTS), prompt_name="query")
    alone = torch.stack([llm.embed(text, prompt_name="query") for text in TEXTS])
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    assert (batched.float() - alone.float()).abs().max().item() <= tolerance
    # Padding really happened: the texts' token counts differ.
    counts = {len(llm.tokenizer.encode(text)) for text in TEXTS}
    assert len(counts) > 5


def test_prompts(folders):
    llm = LLM(folders["embeddinggemma"], progress=False)
    head = llm.sentence_head
    assert head.prompts == PROMPTS and head.default_prompt_name is None
    by_name = llm.embed(TEXTS[:3], prompt_name="query")
    torch.testing.assert_close(llm.embed(TEXTS[:3], prompt=PROMPTS["query"]), by_name, rtol=0, atol=0)
    assert (llm.embed(TEXTS[:3]) - by_name).abs().max() > 1e-3  # the prompt changes the vectors
    with pytest.raises(
        ValueError,
        match="unknown prompt_name 'search'; this checkpoint's prompts: 'Classification', 'document', 'query'",
    ):
        llm.embed(TEXTS[:1], prompt_name="search")
    with pytest.raises(ValueError, match="prompt_name or prompt, not both"):
        llm.embed(TEXTS[:1], prompt_name="query", prompt="q: ")


def test_embed_api_shapes(folders):
    folder = folders["embeddinggemma"]
    llm = LLM(folder, progress=False)
    one = torchgemma.embed("Hello, world!", model=llm)
    assert one.shape == (HIDDEN,)
    torch.testing.assert_close(one, llm.embed(["Hello, world!"])[0], rtol=0, atol=0)
    assert llm.embed([]).shape == (0, HIDDEN)
    with pytest.raises(TypeError, match=r"texts\[1\] is a int"):
        llm.embed(["a", 3])
    with pytest.raises(ValueError, match="dtype and device apply"):
        torchgemma.embed("a", model=llm, dtype=torch.bfloat16)


# ── the modules, one at a time ─────────────────────────────────────────────────────────────


@pytest.mark.parametrize("include_prompt", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", POOLING_MODES)
def test_pooling_matches_sentence_transformers(mode, dtype, include_prompt):
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(4, 9, HIDDEN, generator=gen).to(dtype)
    mask = torch.zeros(4, 9, dtype=torch.long)
    for row, length in enumerate([9, 5, 1, 3]):  # right-padded
        mask[row, :length] = 1
    features = {"token_embeddings": states, "attention_mask": mask, "prompt_length": 2}
    theirs = STPooling(HIDDEN, mode, include_prompt=include_prompt)(features)["sentence_embedding"]
    ours = Pooling(mode, include_prompt)(states, mask, prompt_length=2)
    assert ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs), f"max |Δ| = {(ours.float() - theirs.float()).abs().max()}"


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_dense_matches_sentence_transformers(tmp_path, activation, bias):
    torch.manual_seed(0)
    module = STDense(HIDDEN, 24, bias=bias, activation_function=ACTIVATIONS[activation]())
    module.save(str(tmp_path), safe_serialization=True)
    assert json.loads((tmp_path / "config.json").read_text())["activation_function"] == activation
    x = torch.randn(5, HIDDEN)
    ours = Dense.from_folder(tmp_path)
    with torch.no_grad():
        assert torch.equal(ours(x), module({"sentence_embedding": x})["sentence_embedding"])


# ── bad folders ────────────────────────────────────────────────────────────────────────────


def _broken_copy(folders, tmp_path) -> tuple[Path, object]:
    folder = shutil.copytree(folders["embeddinggemma"], tmp_path / "copy")
    return folder, ModelConfig.from_file(folder).text


def test_a_folder_without_sentence_transformers_modules(folders, tmp_path):
    folder, _ = _broken_copy(folders, tmp_path)
    (folder / "modules.json").unlink()
    llm = LLM(folder, progress=False)  # still a model: loading does not need the modules
    with pytest.raises(FileNotFoundError, match="has no modules.json: sentence embeddings need"):
        llm.embed(["a"])


def test_missing_module_files_are_named(folders, tmp_path):
    folder, text = _broken_copy(folders, tmp_path)
    (folder / "1_Pooling/config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"1_Pooling/config.json is missing"):
        SentenceHead.from_folder(folder, text)
    folder, text = _broken_copy(folders, tmp_path / "2")
    (folder / "3_Dense/model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"3_Dense/model.safetensors is missing"):
        SentenceHead.from_folder(folder, text)


def test_pickled_dense_weights_are_refused(folders, tmp_path):
    folder, text = _broken_copy(folders, tmp_path)
    (folder / "2_Dense/model.safetensors").rename(folder / "2_Dense/pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model.bin is a pickle, which torchgemma never loads"):
        SentenceHead.from_folder(folder, text)


def test_dense_weights_are_loaded_strictly(folders, tmp_path):
    folder, text = _broken_copy(folders, tmp_path)
    config = json.loads((folder / "3_Dense/config.json").read_text())
    (folder / "3_Dense/config.json").write_text(json.dumps({**config, "bias": True}))
    with pytest.raises(ValueError, match=r"3_Dense/model.safetensors has no tensor 'linear.bias'"):
        SentenceHead.from_folder(folder, text)
    weight = torch.zeros(HIDDEN, 3 * HIDDEN // 2)
    save_file({"linear.weight": weight, "extra": torch.zeros(3)}, folder / "2_Dense/model.safetensors")
    (folder / "3_Dense/config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"2_Dense/model.safetensors: linear.weight has shape \[64, 96\]"):
        SentenceHead.from_folder(folder, text)
    save_file(
        {"linear.weight": weight.T.contiguous(), "extra": torch.zeros(3)},
        folder / "2_Dense/model.safetensors",
    )
    with pytest.raises(ValueError, match=r"unexpected tensors: extra"):
        SentenceHead.from_folder(folder, text)


def test_unsupported_modules_are_named(folders, tmp_path):
    folder, text = _broken_copy(folders, tmp_path)
    modules = json.loads((folder / "modules.json").read_text())
    modules[2]["type"] = "my_package.Projection"
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="module type 'my_package.Projection' is not supported"):
        SentenceHead.from_folder(folder, text)
    config = json.loads((folder / "2_Dense/config.json").read_text())
    config["activation_function"] = "os.system"
    (folder / "2_Dense/config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="activation 'os.system' is not one of"):
        Dense.from_folder(folder / "2_Dense")


# ── the server's /v1/embeddings and the embed command ──────────────────────────────────────


def test_server_embeddings_as_openai_clients_call_them(folders):
    """The official client (which asks for base64 and decodes it), float lists, dimensions, usage
    and the task prompt as a vendor extra: the vectors are sentence-transformers' own."""
    import httpx
    import openai

    from serving_fixtures import running_server
    from torchgemma.serving.app import create_app

    folder = folders["embeddinggemma"]
    st = reference(folder)
    llm = LLM(folder, progress=False)
    with running_server(create_app(llm, model_name="emb", max_batch_size=2, max_len=64)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        reply = client.embeddings.create(model="emb", input=TEXTS, extra_body={"prompt_name": "query"})
        theirs = st.encode(TEXTS, convert_to_tensor=True, prompt_name="query")
        ours = torch.tensor([item.embedding for item in reply.data])
        assert [item.index for item in reply.data] == list(range(len(TEXTS)))
        assert (ours - theirs).abs().max().item() <= 1e-5
        expected_tokens = sum(len(st.tokenize([PROMPTS["query"] + t])["input_ids"][0]) for t in TEXTS)
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == expected_tokens
        short = httpx.post(
            f"{url}/v1/embeddings", json={"input": TEXTS[0], "dimensions": 8, "encoding_format": "float"}
        ).json()
        assert len(short["data"]) == 1 and len(short["data"][0]["embedding"]) == 8
        first = st.encode(TEXTS[0], convert_to_tensor=True, truncate_dim=8)
        assert (torch.tensor(short["data"][0]["embedding"]) - first).abs().max().item() <= 1e-5
        for body, words in [
            ({"input": [[5, 6, 7], "x"]}, "Input should be a valid"),
            ({"input": []}, "input is empty"),
            ({"input": "x", "dimensions": 10_000}, "dimensions must be in 1.."),
            ({"input": "x", "prompt_name": "nope"}, "unknown prompt_name 'nope'"),
        ]:
            answer = httpx.post(f"{url}/v1/embeddings", json=body)
            assert answer.status_code == 400 and words in answer.json()["error"]["message"], body


def test_server_embeds_token_ids(folders):
    """Token ids (a list, or a list of lists, as langchain's OpenAIEmbeddings sends them) are the
    decoder's whole input: the ids sentence-transformers' own tokenizer writes for a text (its
    prompt and special tokens included) give sentence-transformers' vector of that text."""
    import httpx
    import openai

    from serving_fixtures import running_server
    from torchgemma.serving.app import create_app

    for name, prompt in (("embeddinggemma", "query"), ("variant", None)):
        folder = folders[name]
        st = reference(folder)
        before = PROMPTS[prompt] if prompt else ""
        # ("variant": the prompt left out of the mean, a token limit: ids of the text alone, cut as
        # sentence-transformers cuts them.)
        rows = [st.tokenize([before + text])["input_ids"][0].tolist() for text in TEXTS]
        theirs = st.encode(
            TEXTS, convert_to_tensor=True, **({"prompt_name": prompt} if prompt else {"prompt": ""})
        )
        llm = LLM(folder, progress=False)
        with running_server(create_app(llm, model_name="emb", max_batch_size=2, max_len=64)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            reply = client.embeddings.create(model="emb", input=rows)
            ours = torch.tensor([item.embedding for item in reply.data])
            assert (ours - theirs).abs().max().item() <= 1e-5, name
            assert reply.usage.prompt_tokens == sum(len(row) for row in rows)
            one = client.embeddings.create(model="emb", input=rows[0]).data[0].embedding
            assert (torch.tensor(one) - theirs[0]).abs().max().item() <= 1e-5
            vocab = llm.model.config.text.vocab_size
            for body, param, words in [
                (
                    {"input": [[1, 2], [3, vocab]]},
                    "input",
                    f"input[1] has token id {vocab}, outside the vocabulary",
                ),
                ({"input": [-1]}, "input", "token id -1"),
                ({"input": [[]]}, "input", "empty list of token ids"),
                ({"input": [[5, 6]], "prompt_name": "query"}, "input", "prompt_name applies to text input"),
            ]:
                answer = httpx.post(f"{url}/v1/embeddings", json=body)
                error = answer.json()["error"]
                assert answer.status_code == 400 and words in error["message"] and error["param"] == param, (
                    body
                )
    # A row longer than the head's limit is cut to it, as a text's tokens are.
    head = llm.sentence_head
    long = [2] + [100 + i for i in range(head.max_length + 5)]
    with running_server(create_app(llm, model_name="emb", max_batch_size=2, max_len=64)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        cut, whole = client.embeddings.create(model="emb", input=[long[: head.max_length], long]).data
    assert cut.embedding == whole.embedding


def test_a_generative_checkpoint_does_not_embed(llm_checkpoint):  # noqa: F811
    import httpx

    from serving_fixtures import running_server
    from torchgemma.serving.app import create_app

    llm = LLM(llm_checkpoint, progress=False)
    with running_server(create_app(llm, model_name="m", max_batch_size=1, max_len=64)) as url:
        answer = httpx.post(f"{url}/v1/embeddings", json={"input": "hello"})
    assert answer.status_code == 404 and "cannot embed" in answer.json()["error"]["message"]


def test_the_embed_command(folders):
    import json
    import subprocess
    import sys

    folder = folders["embeddinggemma"]
    command = [sys.executable, "-m", "torchgemma.cli", "embed", "--model", str(folder), "--threads", "1"]
    done = subprocess.run(
        [*command, "--prompt-name", "document", *TEXTS[:2]], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["text"] for line in lines] == TEXTS[:2]
    theirs = reference(folder).encode(TEXTS[:2], convert_to_tensor=True, prompt_name="document")
    assert (torch.tensor([line["embedding"] for line in lines]) - theirs).abs().max().item() <= 1e-5
    piped = subprocess.run(
        command, input="one line\n\nanother\n", capture_output=True, text=True, timeout=300
    )
    assert piped.returncode == 0 and len(piped.stdout.splitlines()) == 2

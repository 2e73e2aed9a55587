"""Tokenizer parity with transformers 5.23 on Gemma-4-like checkpoints built in the test.

Every folder is read by both `AutoTokenizer.from_pretrained` (the reference) and `load_tokenizer`.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import AddedToken
from transformers import AutoTokenizer

from tokenizer_fixtures import (
    GEMMA4_CHAT_TEMPLATE,
    build_gemma4_backend,
    gemma4_vocab,
    write_gemma4_tokenizer,
)
from torchgemma.tokenizer import GEMMA4_TOKENS, Tokenizer, UnknownTokenError, load_tokenizer
from torchgemma.weights.source import CheckpointError

transformers.logging.set_verbosity_error()

TEXTS = [
    "",
    " ",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "   three leading spaces",
    "trailing spaces   ",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\nline four\n\n\n\nend\n",
    "\n\nstarts with newlines",
    "digits 0123456789 and 3.14159, 1e-9, -42, 1,250.75",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    '{"key": [1, 2, {"nested": null}], "ok": true}',
    "Café naïve résumé Zürich Ærøskøbing",
    "日本語のテキストです。中文文本。한국어 문장.",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 and ✨",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937",
    "rare script: ᚠᛇᚻ ꦗꦮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "zero\u200bwidth and nbsp\u00a0here",
    "<bos>special<eos> tokens <|turn>user\ninside<turn|>\n text",
    "<|image|><|audio|><|video|><|image><image|> media",
    '<|channel>thought\nhmm<channel|>answer <|"|>quoted<|"|>',
    "not special: <turn> <|turn <bos",
    "<unused7> and <0xE2> written as text",
    "▁ literal metaspace ▁▁",
    "mixed 😀中文e\u0301<turn|>end",
]

# Checkpoint variants: how BOS is decided, where added tokens come from, which pipeline is used.
VARIANTS = {
    "default": {},
    "bos_in_tokenizer_json": {"post_processor": "bos", "add_bos_token": False},
    "config_says_bos_but_json_has_none": {"post_processor": "none", "add_bos_token": True},
    "added_tokens_decoder_in_config": {"added_tokens_decoder": True, "post_processor": "bos"},
    "metaspace_json_rebuilt_as_gemma": {"pipeline": "metaspace"},
    "tokenizers_backend_as_is": {
        "tokenizer_class": "TokenizersBackend",
        "pipeline": "metaspace",
        "post_processor": "bos",
    },
    "eos_is_turn_end": {"eos_token": "<turn|>"},
}


def _random_ids(rng: random.Random, vocab_size: int, byte_ids: list[int], n: int) -> list[int]:
    # Byte-fallback pieces are over-sampled so invalid and truncated UTF-8 runs are common.
    return [rng.choice(byte_ids) if rng.random() < 0.35 else rng.randrange(vocab_size) for _ in range(n)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object, Tokenizer]]:
    root = tmp_path_factory.mktemp("tokenizers")
    loaded = {}
    for name, options in VARIANTS.items():
        folder = write_gemma4_tokenizer(root / name, **options)
        loaded[name] = (folder, AutoTokenizer.from_pretrained(folder), load_tokenizer(folder))
    return loaded


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_encode_decode_match_transformers(checkpoints, variant: str) -> None:
    _, ref, ours = checkpoints[variant]
    for text in TEXTS:
        for add_special in (True, False):
            expected = ref(text, add_special_tokens=add_special)["input_ids"]
            assert ours.encode(text, add_special_tokens=add_special) == expected, (variant, text)
        ids = ref(text)["input_ids"]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (
                text
            )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_random_ids_matches_transformers(checkpoints, variant: str) -> None:
    _, ref, ours = checkpoints[variant]
    rng = random.Random(variant)
    byte_ids = sorted(ours.byte_ids)
    for _ in range(40):
        ids = _random_ids(rng, len(ours), byte_ids, rng.randint(1, 40))
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (
                ids
            )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_special_tokens_and_added_vocabulary_match(checkpoints, variant: str) -> None:
    _, ref, ours = checkpoints[variant]
    assert len(ours) == len(ref)
    assert ours.special_tokens == ref.special_tokens_map
    assert ours.bos_id == ref.bos_token_id
    assert ours.eos_id == ref.eos_token_id
    assert ours.pad_id == ref.pad_token_id
    assert ours.unk_id == ref.unk_token_id
    theirs = {i: repr(t) for i, t in ref.backend_tokenizer.get_added_tokens_decoder().items()}
    assert {i: repr(t) for i, t in ours.backend.get_added_tokens_decoder().items()} == theirs


def test_bos_is_decided_by_tokenizer_json(checkpoints) -> None:
    # transformers ignores add_bos_token in tokenizer_config.json when tokenizer.json exists.
    cases = {"default": False, "bos_in_tokenizer_json": True, "config_says_bos_but_json_has_none": False}
    for variant, adds_bos in cases.items():
        _, ref, ours = checkpoints[variant]
        assert ours.add_bos is adds_bos
        assert (ours.encode("Hi")[0] == ours.bos_id) is adds_bos
        assert (ref("Hi")["input_ids"][0] == ref.bos_token_id) is adds_bos


def test_gemma_pipeline_is_rebuilt_like_transformers(checkpoints) -> None:
    # tokenizer.json says Metaspace (prepend "▁"), but GemmaTokenizer keeps only vocab/merges and
    # post-processor, so nothing is prepended; with another tokenizer_class the file is used as is.
    _, _, rebuilt = checkpoints["metaspace_json_rebuilt_as_gemma"]
    _, _, as_is = checkpoints["tokenizers_backend_as_is"]
    assert not rebuilt.id_to_token(rebuilt.encode("Hello")[0]).startswith("▁")
    assert as_is.id_to_token(as_is.encode("Hello")[1]).startswith("▁")
    assert rebuilt.decode(rebuilt.encode(" Hello")) == " Hello"


def test_gemma4_named_token_ids(gemma4_tokenizer_dir: Path) -> None:
    ours = load_tokenizer(gemma4_tokenizer_dir)
    ref = AutoTokenizer.from_pretrained(gemma4_tokenizer_dir)
    for stem, (_, text) in GEMMA4_TOKENS.items():
        assert getattr(ours, f"{stem}_id") == ref.convert_tokens_to_ids(text), stem
        assert ours.named_id(stem) == ours.token_id(text)
    # The fixture keeps the real Gemma 4 ids for the control tokens (reference §9.2).
    assert (ours.pad_id, ours.eos_id, ours.bos_id, ours.unk_id) == (0, 1, 2, 3)
    assert (ours.turn_start_id, ours.turn_end_id, ours.think_id) == (105, 106, 98)
    assert (ours.channel_start_id, ours.channel_end_id) == (100, 101)
    assert (ours.tool_start_id, ours.tool_call_start_id, ours.tool_response_start_id, ours.escape_id) == (
        46,
        48,
        50,
        52,
    )
    assert ours.special_token("image_token") == "<|image|>"
    assert ours.special_token("turn_end") == "<turn|>"
    assert ours.image_id in ours.special_ids and ours.video_id in ours.special_ids


def test_named_tokens_follow_the_config(tmp_path: Path) -> None:
    folder = write_gemma4_tokenizer(tmp_path / "tok")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["image_token"] = "<|audio|>"  # a checkpoint may rename; the lookup must follow it
    config_path.write_text(json.dumps(config))
    ours = load_tokenizer(folder)
    assert ours.image_id == ours.token_id("<|audio|>") == AutoTokenizer.from_pretrained(folder).image_token_id


def test_unknown_special_tokens_raise(gemma4_tokenizer_dir: Path) -> None:
    ours = load_tokenizer(gemma4_tokenizer_dir)
    with pytest.raises(UnknownTokenError, match="not_a_token"):
        ours.special_token("not_a_token")
    with pytest.raises(UnknownTokenError, match="<nope>"):
        ours.token_id("<nope>")
    with pytest.raises(UnknownTokenError, match="99999"):
        ours.id_to_token(99999)
    # A vocabulary without the token: the error names the text that was looked up.
    backend = build_gemma4_backend()
    bare = Tokenizer(backend, special_tokens={"bos_token": "<bos>", "eos_token": "<eos>"})
    with pytest.raises(UnknownTokenError, match="pad_token"):
        _ = bare.pad_id


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _flag_turn_tokens(config: dict) -> None:
    for token in config["added_tokens_decoder"].values():
        if token["content"] == "<|turn>":
            token["lstrip"] = token["rstrip"] = True
        if token["content"] == "\n":
            token["special"] = True


def _strip_turn_end(data: dict) -> None:
    for token in data["added_tokens"]:
        if token["content"] == "<turn|>":
            token["lstrip"] = token["rstrip"] = True


def _extra_tokens(config: dict) -> None:
    config["extra_special_tokens"] = ["<|video|>", "<brand_new>"]
    config["foo_token"] = "<foo>"  # a model-specific name whose token is not in the vocabulary


# Where added tokens and their flags come from (tokenizer_config.json, tokenizer.json,
# special_tokens_map.json), including tokens that are not in the vocabulary yet.
ADDED_TOKEN_CASES = {
    "config_decoder_flags": ({"added_tokens_decoder": True}, "tokenizer_config.json", _flag_turn_tokens),
    "json_added_token_flags": ({}, "tokenizer.json", _strip_turn_end),
    "json_flags_as_is": ({"tokenizer_class": "TokenizersBackend"}, "tokenizer.json", _strip_turn_end),
    "extra_and_new_tokens": ({}, "tokenizer_config.json", _extra_tokens),
    "special_tokens_map": (
        {
            "special_tokens_map": {
                "eos_token": {
                    "content": "<turn|>",
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "single_word": False,
                },
                "additional_special_tokens": ["<new_tok>"],
                "image_token": "<ignored-because-config-names-it>",
                "zzz_token": "<zzz>",
            }
        },
        None,
        None,
    ),
    "special_tokens_map_ignored_with_decoder": (
        {"added_tokens_decoder": True, "special_tokens_map": {"eos_token": "<turn|>"}},
        None,
        None,
    ),
}


@pytest.mark.parametrize("case", list(ADDED_TOKEN_CASES))
def test_added_token_sources_match_transformers(tmp_path: Path, case: str) -> None:
    options, file_name, edit = ADDED_TOKEN_CASES[case]
    folder = write_gemma4_tokenizer(tmp_path / case, **options)
    if edit is not None:
        _edit_json(folder / file_name, edit)
    ref, ours = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    assert len(ours) == len(ref)
    assert ours.special_tokens == ref.special_tokens_map
    theirs = {i: repr(t) for i, t in ref.backend_tokenizer.get_added_tokens_decoder().items()}
    assert {i: repr(t) for i, t in ours.backend.get_added_tokens_decoder().items()} == theirs
    for text in TEXTS + [" <|turn> user <turn|> ", "<brand_new>x<foo> <new_tok><zzz>", "a\nb\n\nc"]:
        ids = ref(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_clean_up_flag_is_ignored_for_bpe_like_transformers(tmp_path: Path) -> None:
    folder = write_gemma4_tokenizer(tmp_path / "tok")
    _edit_json(folder / "tokenizer_config.json", lambda c: c.update(clean_up_tokenization_spaces=True))
    ref, ours = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    ids = ref("Hello , world . I 'm here !")["input_ids"]
    assert ours.decode(ids) == ref.decode(ids) == "Hello , world . I 'm here !"


def test_missing_files_name_folder_and_file(tmp_path: Path) -> None:
    folder = write_gemma4_tokenizer(tmp_path / "ckpt")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"ckpt.*tokenizer\.json"):
        load_tokenizer(folder)
    folder = write_gemma4_tokenizer(tmp_path / "ckpt2")
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"ckpt2.*tokenizer_config\.json"):
        load_tokenizer(folder)
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_tokenizer(tmp_path / "does-not-exist")
    with pytest.raises(CheckpointError, match="is a file"):
        load_tokenizer(tmp_path / "ckpt" / "tokenizer_config.json")
    (tmp_path / "broken").mkdir()
    shutil.copy(tmp_path / "ckpt" / "tokenizer_config.json", tmp_path / "broken")
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"broken.*tokenizer\.json"):
        load_tokenizer(tmp_path / "broken")


def test_hub_ids_download_only_tokenizer_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    folder = write_gemma4_tokenizer(tmp_path / "snapshot")
    calls = []

    def fake_snapshot_download(**kwargs):
        calls.append(kwargs)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    ours = load_tokenizer("google/gemma-4-E2B-it", revision="main")
    assert ours.encode("Hello") == load_tokenizer(folder).encode("Hello")
    assert calls[0]["repo_id"] == "google/gemma-4-E2B-it" and calls[0]["revision"] == "main"
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(
        calls[0]["allow_patterns"]
    )
    assert not any(p.endswith(".safetensors") for p in calls[0]["allow_patterns"])


def test_direct_construction_from_backend_matches_checkpoint(checkpoints) -> None:
    # The GGUF route: a tokenizers.Tokenizer and ids from the file's metadata.
    _, ref, _ = checkpoints["bos_in_tokenizer_json"]
    backend = build_gemma4_backend(post_processor="none")
    ours = Tokenizer(backend, bos_id=2, eos_id=1, pad_id=0, add_bos=True, chat_template=GEMMA4_CHAT_TEMPLATE)
    assert (ours.special_tokens["bos_token"], ours.special_tokens["eos_token"]) == ("<bos>", "<eos>")
    assert ours.add_bos
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], text
    messages = [{"role": "user", "content": "Hello"}]
    assert (
        ours.apply_chat_template(messages)
        == ref.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)["input_ids"]
    )


def test_direct_construction_registers_missing_special_tokens() -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    vocab, merges = gemma4_vocab()
    backend = Backend(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    plain = backend.encode("<|turn>x").ids
    assert len(plain) > 2  # not an added token yet: BPE splits the text
    ours = Tokenizer(
        backend,
        special_tokens={"bos_token": "<bos>", "eos_token": "<eos>", "sot_token": "<|turn>"},
        extra_special_tokens=[AddedToken("<|video|>", special=True, normalized=False)],
        add_bos=False,
    )
    assert ours.encode("<|turn>x")[0] == vocab["<|turn>"]
    assert ours.decode(ours.encode("<|turn>x<|video|>"), skip_special_tokens=True) == "x"
    assert ours.turn_start_id == 105


def test_direct_construction_rejects_inconsistent_metadata() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Tokenizer(build_gemma4_backend(), bos_id=10**6)
    with pytest.raises(ValueError, match="disagrees"):
        Tokenizer(build_gemma4_backend(), special_tokens={"bos_token": "<bos>"}, bos_id=1)
    with pytest.raises(TypeError):
        Tokenizer("not a backend")  # type: ignore[arg-type]


def test_decode_accepts_tensors_and_single_ids(gemma4_tokenizer_dir: Path) -> None:
    ours = load_tokenizer(gemma4_tokenizer_dir)
    ids = ours.encode("Hello world")
    assert ours.decode(torch.tensor(ids)) == ours.decode(ids) == "Hello world"
    assert ours.decode(ids[0]) == ours.decode(ids[:1])


# ---- streaming detokenization ------------------------------------------------------------------------

STREAM_TEXTS = [
    "日本語のテキストです。東京は大きな都市です。",  # CJK, partly real tokens, partly bytes
    "Emoji 😀👍🏽👨‍👩‍👧‍👦🇫🇷 in a row",  # 4-byte characters and ZWJ sequences as byte pieces
    "e\u0301 a\u0308 \u0915\u094d\u0937 combining marks",
    "∑ ≠ ∞ → byte-fallback symbols",
    "   leading spaces and ▁ metaspace ▁",
    "\n\nnewlines first\n",
    "<bos><|turn>user\nHi 😀<turn|>\n<|turn>model\n<|channel>thought\n<channel|>Hello!<turn|>",
]


def _stream(tokenizer: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    decoder = tokenizer.stream_decoder(skip_special_tokens=skip)
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.flush())
    return pieces


@pytest.mark.parametrize("skip", [False, True])
def test_stream_decoder_concatenates_to_decode(gemma4_tokenizer_dir: Path, skip: bool) -> None:
    ours = load_tokenizer(gemma4_tokenizer_dir)
    ref = AutoTokenizer.from_pretrained(gemma4_tokenizer_dir)
    for text in STREAM_TEXTS + TEXTS:
        ids = ours.encode(text)
        pieces = _stream(ours, ids, skip)
        assert (
            "".join(pieces)
            == ours.decode(ids, skip_special_tokens=skip)
            == ref.decode(ids, skip_special_tokens=skip)
        )
        # Valid text never produces a replacement character mid-stream.
        assert not any("\ufffd" in piece for piece in pieces), (text, pieces)


def test_stream_decoder_releases_whole_characters(gemma4_tokenizer_dir: Path) -> None:
    ours = load_tokenizer(gemma4_tokenizer_dir)
    ids = ours.encode("a 😀 b")
    byte_positions = [k for k, i in enumerate(ids) if i in ours.byte_ids]
    assert len(byte_positions) == 4  # the emoji is four byte-fallback pieces
    pieces = _stream(ours, ids, skip=False)
    assert all(pieces[k] == "" for k in byte_positions)  # held while the character is incomplete
    assert "😀" in pieces[byte_positions[-1] + 1]  # released whole with the next ordinary token
    assert pieces[0] == "a"  # ordinary tokens come out immediately


@pytest.mark.parametrize("variant", ["default", "tokenizers_backend_as_is"])
def test_stream_decoder_random_ids(checkpoints, variant: str) -> None:
    # Includes invalid and truncated byte runs, special tokens, and (as_is) a Metaspace decoder that
    # strips the first token's leading space.
    _, _, ours = checkpoints[variant]
    rng = random.Random(7)
    byte_ids = sorted(ours.byte_ids)
    for _ in range(150):
        ids = _random_ids(rng, len(ours), byte_ids, rng.randint(0, 50))
        for skip in (False, True):
            assert "".join(_stream(ours, ids, skip)) == ours.decode(ids, skip_special_tokens=skip), ids


def test_stream_decoder_invalid_byte_run_matches_decode(gemma4_tokenizer_dir: Path) -> None:
    ours = load_tokenizer(gemma4_tokenizer_dir)
    b = [ours.token_id(f"<0x{x:02X}>") for x in (0xE4, 0xB8, 0xAD, 0x80)]  # "中" then a stray byte
    ids = [ours.token_id("▁the"), *b, ours.token_id("▁the")]
    # The stray byte invalidates the whole run, so "中" must not have been released early.
    assert ours.decode(ids) == " the\ufffd\ufffd\ufffd\ufffd the"
    assert "".join(_stream(ours, ids, skip=False)) == ours.decode(ids)
    decoder = ours.stream_decoder()
    assert [decoder.push(i) for i in ids[:4]] == [" the", "", "", ""]
    assert decoder.flush() == "中"  # flush releases a run cut short by the end of generation

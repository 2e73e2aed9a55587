"""A small Gemma-4-like tokenizer checkpoint, built in-process, for tests.

No real Gemma 4 tokenizer can be downloaded here, so tests build one: a byte-fallback BPE trained on
the sample text below with the `tokenizers` trainer, wrapped in Gemma's pipeline (spaces become "▁"
in the normalizer, no real pre-tokenization, decoder "▁"->" " + byte fallback + fuse), with the
Gemma 4 control tokens at their real ids where the vocabulary is large enough (§9.2 of the
reference) and the multimodal tokens at the end of the vocabulary, as in the real layout.

`write_gemma4_tokenizer(folder)` writes the files a checkpoint carries (tokenizer.json,
tokenizer_config.json, chat_template.jinja, optionally special_tokens_map.json) so that
transformers' `AutoTokenizer.from_pretrained(folder)` and `torchgemma.tokenizer.load_tokenizer(folder)`
read the same folder. Every test file can use it through the `gemma4_tokenizer_dir` fixture
(registered by conftest.py):

    def test_something(gemma4_tokenizer_dir): ...
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Literal

import pytest
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

# Varied on purpose: prose, code, digits, punctuation runs, accents, a little CJK/Cyrillic/Greek so
# some non-Latin characters get real tokens while others (and emoji) fall back to bytes.
SAMPLE_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran away.
Machine learning models learn patterns from data; the more data they see, the better they get.
Gemma is a family of lightweight, state-of-the-art open models built from the same research.
def tokenize(text: str) -> list[int]:
    return [ord(ch) for ch in text if not ch.isspace()]

for i in range(10):
    print(f"value {i}: {i * i}")
class Model(nn.Module):
    def forward(self, x):
        return self.linear(x) + x  # residual connection
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
The meeting is on 2024-05-17 at 10:30; the budget is $1,250.75 (about 1150 EUR).
Hello, world! How are you today? I'm fine, thanks. What's the weather like in Zürich?
Café, naïve, résumé, façade, jalapeño, São Paulo, Kraków, Ærøskøbing.
Привет, как дела? Всё хорошо, спасибо.
Καλημέρα κόσμε, τι κάνεις;
日本語のテキストです。東京は大きな都市です。中文文本也在这里。
한국어 문장도 조금 있습니다.
Please summarize the following article in three sentences.
Describe this image in detail. What animal do you see in the picture?
Transcribe the audio clip and translate it into English.
    Indented lines,\ttabs,\tand   multiple   spaces   matter   for   tokenization.
<html><body><p>Some HTML &amp; entities &lt;here&gt;</p></body></html>
SELECT id, name FROM users WHERE age > 30 ORDER BY name;
The answer is 42. The square root of 144 is 12. Pi is approximately 3.14159.
Think step by step before answering the question, then give the final answer.
"""

# Control tokens at their Gemma 4 ids (reference §9.2); the other head slots are unused fillers.
_HEAD_TOKENS: dict[int, str] = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    4: "<mask>",
    46: "<|tool>",
    47: "<tool|>",
    48: "<|tool_call>",
    49: "<tool_call|>",
    50: "<|tool_response>",
    51: "<tool_response|>",
    52: '<|"|>',
    98: "<|think|>",
    100: "<|channel>",
    101: "<channel|>",
    105: "<|turn>",
    106: "<turn|>",
    107: "\n",
    108: "\n\n",
}
_HEAD_SIZE = 109
# Whitespace tokens that Gemma keeps as added (non-special) tokens.
_PLAIN_ADDED = ("\n", "\n\n")
# Multimodal tokens sit at the end of the vocabulary (real ids 255999, 256000, 258880..258884).
_TAIL_BOI_BOA = ("<|image>", "<|audio>")
_TAIL_MEDIA = ("<|image|>", "<|audio|>", "<image|>", "<audio|>", "<|video|>")
VOCAB_SIZE = 1024

# Model-specific special-token names, as the official converter writes them into tokenizer_config.json.
GEMMA4_NAMED_TOKENS: dict[str, str] = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "sot_token": "<|turn>",
    "eot_token": "<turn|>",
    "soc_token": "<|channel>",
    "eoc_token": "<channel|>",
    "think_token": "<|think|>",
    "escape_token": '<|"|>',
    "str_token": "<|tool_response>",
    "etr_token": "<tool_response|>",
    "stc_token": "<|tool_call>",
    "etc_token": "<tool_call|>",
    "std_token": "<|tool>",
    "etd_token": "<tool|>",
}

# A chat template in Gemma 4's published format (reference §9.4), written for these tests: <bos>, an
# optional system turn (with <|think|> when thinking is on, and tool declarations), user/model turns
# with assistant->model, media items as placeholders, thinking stripped from earlier model turns,
# tool calls/responses, and the generation prompt with the empty thought channel when thinking is off.
GEMMA4_CHAT_TEMPLATE = r"""{%- macro format_argument(argument) -%}
    {%- if argument is string -%}
        {{- '<|"|>' + argument + '<|"|>' -}}
    {%- elif argument is boolean -%}
        {{- 'true' if argument else 'false' -}}
    {%- elif argument is mapping -%}
        {{- '{' -}}
        {%- for key, value in argument | dictsort -%}
            {{- key + ':' + format_argument(value) -}}
            {%- if not loop.last -%},{%- endif -%}
        {%- endfor -%}
        {{- '}' -}}
    {%- elif argument is sequence -%}
        {{- '[' -}}
        {%- for item in argument -%}
            {{- format_argument(item) -}}
            {%- if not loop.last -%},{%- endif -%}
        {%- endfor -%}
        {{- ']' -}}
    {%- else -%}
        {{- argument | tojson -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content | trim -}}
    {%- elif content is iterable -%}
        {%- for item in content -%}
            {%- if item['type'] == 'text' -%}
                {{- item['text'] | trim -}}
            {%- elif item['type'] == 'image' -%}
                {{- '<|image|>' -}}
            {%- elif item['type'] == 'audio' -%}
                {{- '<|audio|>' -}}
            {%- elif item['type'] == 'video' -%}
                {{- '<|video|>' -}}
            {%- else -%}
                {{- raise_exception('Unknown content item type: ' + item['type']) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro strip_thinking(text) -%}
    {%- set ns = namespace(result='') -%}
    {%- for part in text.split('<channel|>') -%}
        {%- if '<|channel>' in part -%}
            {%- set ns.result = ns.result + part.split('<|channel>')[0] -%}
        {%- else -%}
            {%- set ns.result = ns.result + part -%}
        {%- endif -%}
    {%- endfor -%}
    {{- ns.result | trim -}}
{%- endmacro -%}
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{%- set loop_messages = messages -%}
{{- bos_token -}}
{%- if thinking or tools or messages[0]['role'] in ['system', 'developer'] -%}
    {{- '<|turn>system\n' -}}
    {%- if thinking -%}
        {{- '<|think|>\n' -}}
    {%- endif -%}
    {%- if messages[0]['role'] in ['system', 'developer'] -%}
        {{- render_content(messages[0]['content']) -}}
        {%- set loop_messages = messages[1:] -%}
    {%- endif -%}
    {%- for tool in tools or [] -%}
        {%- set function = tool['function'] if 'function' in tool else tool -%}
        {{- '<|tool>declaration:' + function['name'] + '{description:' + format_argument(function['description'] | default('')) -}}
        {%- if function['parameters'] is defined -%}
            {{- ',parameters:' + format_argument(function['parameters']) -}}
        {%- endif -%}
        {{- '}<tool|>' -}}
    {%- endfor -%}
    {{- '<turn|>\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if message['role'] in ['system', 'developer'] -%}
        {{- raise_exception('A system message is only allowed first.') -}}
    {%- endif -%}
    {%- if message['role'] == 'tool' -%}
        {{- '<|tool_response>response:' + (message['name'] | default('tool')) + '{value:' + format_argument(message['content']) + '}<tool_response|>' -}}
        {%- continue -%}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{- '<|turn>' + role + '\n' -}}
    {%- for call in message['tool_calls'] | default([]) -%}
        {%- set function = call['function'] if 'function' in call else call -%}
        {{- '<|tool_call>call:' + function['name'] + format_argument(function['arguments']) + '<tool_call|>' -}}
    {%- endfor -%}
    {%- if role == 'model' and message['content'] is string -%}
        {{- strip_thinking(message['content']) -}}
    {%- else -%}
        {{- render_content(message['content']) -}}
    {%- endif -%}
    {{- '<turn|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|turn>model\n' -}}
    {%- if not thinking -%}
        {{- '<|channel>thought\n<channel|>' -}}
    {%- endif -%}
{%- endif -%}
"""


@functools.lru_cache(maxsize=1)
def _trained_pieces() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Learn a few hundred BPE merges on SAMPLE_TEXT (deterministic, well under a second)."""
    trainer_tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    # Train on "▁"-prefixed words with digits kept apart, as Gemma's vocabulary has no multi-digit pieces;
    # the finished tokenizer then runs Gemma's own (split-free) pipeline over the learned merges.
    trainer_tokenizer.normalizer = normalizers.Replace(" ", "▁")
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("▁", behavior="merged_with_next"),
            pre_tokenizers.Split("\n", behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    n_trained = VOCAB_SIZE - _HEAD_SIZE - 256 - 16
    trainer = trainers.BpeTrainer(
        vocab_size=n_trained, min_frequency=1, show_progress=False, max_token_length=12
    )
    trainer_tokenizer.train_from_iterator(SAMPLE_TEXT.splitlines(keepends=True), trainer=trainer)
    model = json.loads(trainer_tokenizer.to_str())["model"]
    pieces = tuple(token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1]))
    merges = tuple(tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"])
    return pieces, merges


def gemma4_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The fixture's vocabulary (token -> id, exactly VOCAB_SIZE entries) and BPE merges."""
    pieces, merges = _trained_pieces()
    ordered: list[str] = [_HEAD_TOKENS.get(i, f"<unused{i}>") for i in range(_HEAD_SIZE)]
    ordered += [f"<0x{b:02X}>" for b in range(256)]
    taken = set(ordered)
    ordered += [p for p in pieces if p not in taken]
    tail_len = len(_TAIL_BOI_BOA) + len(_TAIL_MEDIA) + 4
    if len(ordered) + tail_len > VOCAB_SIZE:
        raise RuntimeError("trained vocabulary too large for the fixture layout")
    while len(ordered) < VOCAB_SIZE - tail_len:
        ordered.append(f"<unused{len(ordered)}>")
    # boi/boa, a gap, then the media tokens, then a little unused room, like the real layout.
    ordered += list(_TAIL_BOI_BOA) + ["<unused_gap0>", "<unused_gap1>"] + list(_TAIL_MEDIA)
    ordered += ["<unused_end0>", "<unused_end1>"]
    vocab = {token: i for i, token in enumerate(ordered)}
    assert len(vocab) == VOCAB_SIZE
    return vocab, [tuple(m) for m in merges]


def special_token_list() -> list[str]:
    """The tokens registered as special added tokens, in id order."""
    vocab, _ = gemma4_vocab()
    specials = [t for t in _HEAD_TOKENS.values() if t not in _PLAIN_ADDED]
    specials += list(_TAIL_BOI_BOA) + list(_TAIL_MEDIA)
    return sorted(specials, key=vocab.__getitem__)


def build_gemma4_backend(
    *,
    post_processor: Literal["bos", "plain", "none"] = "plain",
    pipeline: Literal["gemma", "metaspace"] = "gemma",
) -> Tokenizer:
    """The `tokenizers.Tokenizer` that tokenizer.json serializes.

    post_processor: "bos" prepends <bos> (Gemma 2/3 style), "plain" is a template without special
    tokens (what a tokenizer saved with add_bos_token=False carries), "none" leaves it unset.
    pipeline: "metaspace" swaps in a Llama-style Metaspace pre-tokenizer/decoder, which transformers'
    GemmaTokenizer ignores (it rebuilds Gemma's pipeline around the vocabulary), to test that we do too.
    """
    vocab, merges = gemma4_vocab()
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    if pipeline == "gemma":
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_token_list()])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _PLAIN_ADDED])
    if post_processor == "bos":
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B:1", special_tokens=[("<bos>", vocab["<bos>"])]
        )
    elif post_processor == "plain":
        tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    return tok


def write_gemma4_tokenizer(
    folder: str | Path,
    *,
    add_bos_token: bool = False,
    post_processor: Literal["bos", "plain", "none"] = "plain",
    pipeline: Literal["gemma", "metaspace"] = "gemma",
    chat_template: str | None = GEMMA4_CHAT_TEMPLATE,
    template_in: Literal["jinja", "config", "both"] = "jinja",
    eos_token: str = "<eos>",
    added_tokens_decoder: bool = False,
    special_tokens_map: dict[str, str] | None = None,
    tokenizer_class: str = "GemmaTokenizer",
) -> Path:
    """Write a Gemma-4-like tokenizer checkpoint into `folder` and return it.

    The defaults follow the reference (§9.1): GemmaTokenizer, add_bos_token False with a tokenizer.json
    that adds nothing (the template writes <bos>), template in chat_template.jinja, no
    added_tokens_decoder (transformers 5 does not save one for tokenizers-backed classes).
    template_in="both" writes a different template into tokenizer_config.json so precedence shows.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    backend = build_gemma4_backend(post_processor=post_processor, pipeline=pipeline)
    backend.save(str(folder / "tokenizer.json"))

    config: dict = {
        "tokenizer_class": tokenizer_class,
        "add_bos_token": add_bos_token,
        "add_eos_token": False,
        "bos_token": "<bos>",
        "eos_token": eos_token,
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        **GEMMA4_NAMED_TOKENS,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1000000000000000019884624838656,
        "padding_side": "left",
        "spaces_between_special_tokens": False,
    }
    if added_tokens_decoder:
        config["added_tokens_decoder"] = {
            str(i): added.__getstate__() for i, added in sorted(backend.get_added_tokens_decoder().items())
        }
    if chat_template is not None:
        if template_in in ("jinja", "both"):
            (folder / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
        if template_in == "config":
            config["chat_template"] = chat_template
        elif template_in == "both":
            config["chat_template"] = "{{ bos_token }}stale template from tokenizer_config.json"
    (folder / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8"
    )
    if special_tokens_map is not None:
        (folder / "special_tokens_map.json").write_text(
            json.dumps(special_tokens_map, indent=2), encoding="utf-8"
        )
    return folder


@pytest.fixture(name="gemma4_tokenizer_dir")
def gemma4_tokenizer_dir_fixture(tmp_path: Path) -> Path:
    """A folder with a Gemma-4-like tokenizer (default options of `write_gemma4_tokenizer`)."""
    return write_gemma4_tokenizer(tmp_path / "gemma4-tokenizer")

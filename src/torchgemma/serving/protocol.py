"""OpenAI's request shapes, as pydantic models: what the server accepts, checked before any work.

Unknown fields are ignored (clients send vendor extras), except other servers' grammar fields,
refused by name; known fields of the wrong type are a 400
naming the field. Fields we accept but cannot honour are refused by the handlers with the reason
(``sampling.refuse_unsupported``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# OpenAI's limit on n (and best_of).
MAX_N = 128


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Model):
    url: str
    detail: str | None = None


class InputAudio(_Model):
    data: str  # base64
    format: str = "wav"


class ContentPart(_Model):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None
    video_url: ImageURL | None = None  # vLLM's video part: {"type": "video_url", "video_url": {"url": ...}}


class FunctionCall(_Model):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # Some clients send the assistant's earlier reasoning back; Gemma's template drops it anyway.
    reasoning_content: str | None = None


class FunctionSpec(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: dict[str, str]


class StreamOptions(_Model):
    include_usage: bool = False


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatTemplateKwargs(_Model):
    enable_thinking: bool | None = None


class SamplingFields(_Model):
    """What chat and text completions share, with OpenAI's ranges (a value outside one is a 400
    naming the field)."""

    # Extras kept (not dropped): the grammar fields other servers take are refused by name
    # (sampling.refuse_unsupported), not silently ignored.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # 0 only with completions' echo (the prompt's logprobs, nothing generated): checked there.
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: int | None = None
    # OpenAI's map of token id (a JSON key, so a string of digits) -> bias in [-100, 100]; checked
    # in sampling_args (ids against the vocabulary, values by SamplingParams).
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extension: generate past the end-of-sequence tokens, up to max_tokens (benchmarks).
    ignore_eos: bool = False

    @field_validator("n", mode="before")
    @classmethod
    def _n_default(cls, value):
        return 1 if value is None else value


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None


class CompletionRequest(SamplingFields):
    # One prompt or several (OpenAI's four forms): text, token ids, a list of texts, a list of id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    # OpenAI's insertion suffix and server-side best-of: refused unless they change nothing
    # (sampling.refuse_unsupported).
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)


class EmbeddingItem(BaseModel):
    """One multimodal input (EmbeddingGemma 2), as Jina's API and sentence-transformers 6 take them:
    ``{"image": data URL}``, ``{"audio": WAV data URL}``, ``{"text": ...}``, or several together."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key is named, not ignored
    text: str | None = None
    image: str | list[str] | None = None
    audio: str | list[str] | None = None


class EmbeddingRequest(_Model):
    model: str | None = None
    input: str | list[str | EmbeddingItem] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # Vendor extra (extra_body): a task prompt of the checkpoint's config_sentence_transformers.json
    # (EmbeddingGemma: "query", "document", ...); without it, the checkpoint's default prompt.
    prompt_name: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _item_keys(cls, value):
        # Named here: the union's own error would only say the item is not a string.
        for index, item in enumerate(value if isinstance(value, list) else ()):
            if isinstance(item, dict) and set(item) - set(EmbeddingItem.model_fields):
                unknown = sorted(set(item) - set(EmbeddingItem.model_fields))
                raise ValueError(f"input[{index}] has unknown key(s) {unknown}; known: text, image, audio")
        return value


# ── /v1/responses ───────────────────────────────────────────────────────────────────────────


class ResponsesReasoning(_Model):
    effort: str | None = None
    summary: str | None = None


class ResponsesText(_Model):
    # {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "name", "schema", ...}
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(_Model):
    """OpenAI's Responses API request. ``input``'s items and ``tools`` are read by
    ``responses.chat_request`` (a 400 naming the item that is not understood); other vendor fields
    (top_k, seed, stop, ...) are kept and handed to the chat path, which checks them."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    reasoning: ResponsesReasoning | None = None
    text: ResponsesText | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None

"""Errors answered in OpenAI's shape."""

from __future__ import annotations

from fastapi.responses import JSONResponse

# How long a client is told to wait when the waiting room is full.
RETRY_AFTER_SECONDS = 2


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        kind = {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            503: "server_busy",
        }.get(self.status, "server_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def context_overflow(
    limit: int, prompt: int, param: str = "messages", completion: int | None = None
) -> APIError:
    """A request that does not fit the context, in OpenAI's words: clients recognise them (litellm
    raises ``ContextWindowExceededError`` on "This model's maximum context length is"), with
    OpenAI's code. ``limit``: tokens of prompt and reply together; ``param``: where the prompt is;
    ``completion``: the tokens asked for the reply, when that is what does not fit (the param is
    then max_tokens)."""
    what = "messages" if param == "messages" else "prompt"
    if completion is None:
        message = (
            f"This model's maximum context length is {limit} tokens. However, your {what} resulted in "
            f"{prompt} tokens. Please reduce the length of the {what}."
        )
    else:
        message = (
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt + completion} tokens ({prompt} in the {what}, {completion} in the completion). "
            f"Please reduce the length of the {what} or completion."
        )
    return bad_request(message, param if completion is None else "max_tokens", "context_length_exceeded")

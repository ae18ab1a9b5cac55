"""The OpenAI wire format: request bodies (validated by pydantic) and the error body.

Requests accept OpenAI's fields plus jaxpaged's extra sampling fields (`top_k`, `min_p`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `cache_salt`), which the `openai` client sends through `extra_body`,
as vLLM accepts them. Unknown fields are ignored, as OpenAI's and vLLM's servers ignore them.

Every error, whatever raised it, leaves the server as one JSON body built by `error_body`:

    {"error": {"message": "...what to change...", "type": "...", "param": "field" | null, "code": ... | null}}

| status | type | when |
| --- | --- | --- |
| 400 | invalid_request_error | malformed JSON, missing or mistyped fields, bad sampling values, prompt or max_tokens past max_model_len |
| 401 | authentication_error | `--api-key` set and no `Authorization: Bearer KEY` |
| 404 | invalid_request_error (code model_not_found) | `model` names no served model |
| 413 | invalid_request_error (code request_too_large) | body over `--max-body-bytes` |
| 503 | server_overloaded | the waiting queue is full; retry later |
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    """The one shape of every error response (OpenAI's)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints; `to_sampling_params` in routes.py turns them into SamplingParams."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # jaxpaged / vLLM extras
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None  # requests with different salts never share prefix-cache pages
    # Structured outputs (serve/tools.py): OpenAI's response_format, vLLM's structured_outputs
    response_format: dict | None = None
    structured_outputs: dict | None = None  # {"json": ...} | {"regex": ...} | {"choice": [...]} | ...


class CompletionRequest(_SamplingFields):
    # One prompt per request: a string, or token ids (a one-element list of either is accepted too).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0)  # 0 or 1: the chosen token's log-probability
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    # a string, or OpenAI's content parts ([{"type": "text", "text": ...}]); None on an assistant
    # turn that only calls tools
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None  # assistant: [{"id", "type": "function", "function": {"name", "arguments"}}]
    tool_call_id: str | None = None  # tool: the call this message answers
    name: str | None = None

    def text(self) -> str | None:
        if self.content is None:
            if self.role == "assistant" and self.tool_calls:
                return None
            raise ValueError(f"a {self.role} message needs content (only an assistant message with tool_calls "
                             "may leave it null)")
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[dict] | None = None  # [{"type": "function", "function": {"name", "description", "parameters"}}]
    tool_choice: str | dict | None = None  # "none" | "auto" | "required" | {"type": "function", "function": {...}}

"""The OpenAI wire format: request bodies (validated by pydantic) and the error body.

Requests accept OpenAI's fields plus jaxpaged's extra sampling fields (`top_k`, `min_p`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `cache_salt`, `repetition_penalty`, `allowed_token_ids`), which the
`openai` client sends through `extra_body`, as vLLM accepts them. OpenAI fields the server does not
implement (`best_of` > 1, `suffix`, `tools`, ...) get a 400 naming the field; fields unknown to
OpenAI are ignored, as OpenAI's and vLLM's servers ignore them.

Every error, whatever raised it, leaves the server as one JSON body built by `error_body`:

    {"error": {"message": "...what to change...", "type": "...", "param": "field" | null, "code": <HTTP status>}}

(`code` is the HTTP status as an int, as vLLM sends it.)

| status | type | when |
| --- | --- | --- |
| 400 | invalid_request_error | malformed JSON, missing or mistyped fields, bad sampling values, prompt or max_tokens past max_model_len |
| 401 | authentication_error | `--api-key` set and no `Authorization: Bearer KEY` |
| 404 | invalid_request_error | `model` names no served model, or no such route |
| 413 | invalid_request_error | body over `--max-body-bytes` |
| 503 | server_overloaded | the waiting queue is full; retry later |
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxpaged.entrypoints.chat_prompts import flat_message


def error_body(message: str, type_: str, param: str | None, code: int) -> dict:
    """The one shape of every error response (OpenAI's)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (not supported: refused when set)


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
    # Penalties and biases (OpenAI's, plus vLLM's repetition_penalty and allowed_token_ids)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as JSON keys are) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None
    # vLLM's output-text fields (SamplingParams' meanings)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    user: str | None = None  # accepted and unused (OpenAI's servers only log it)
    # vLLM's extra fields. Implemented: the prompt's last k tokens (-1: max_model_len's worth), the
    # token ids in each choice and the prompt's ids in the response, the response id's suffix.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    return_token_ids: bool = False
    request_id: str | None = None
    # Not implemented: refused when set (UNSUPPORTED_VLLM_FIELDS), never dropped.
    priority: int = 0
    bad_words: list[str] | None = None
    use_beam_search: bool = False
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    length_penalty: float = 1.0

    # Structured outputs (serve/tools.py): OpenAI's response_format, vLLM's structured_outputs
    response_format: dict | None = None
    structured_outputs: dict | None = None  # {"json": ...} | {"regex": ...} | {"choice": [...]} | ...


# Fields this server does not implement, with the values that mean "unused": any other value is a
# 400 that names the field (common.check_unsupported) instead of being silently ignored.
UNSUPPORTED_VLLM_FIELDS = {"priority": (0,), "bad_words": (None, []), "use_beam_search": (False,),
                           "prompt_logprobs": (None,), "return_tokens_as_token_ids": (False,), "length_penalty": (1.0,)}
UNSUPPORTED_COMPLETION_FIELDS = {"best_of": (None, 1), "suffix": (None,), **UNSUPPORTED_VLLM_FIELDS}
UNSUPPORTED_CHAT_FIELDS = {"functions": (None, []), "function_call": (None, "none"), "audio": (None,),
                           "prediction": (None,), "echo": (False,), "chat_template": (None,), "documents": (None,),
                           **UNSUPPORTED_VLLM_FIELDS}


class CompletionRequest(_SamplingFields):
    # One prompt per request: a string, or token ids (a one-element list of either is accepted too).
    # A string, token ids, or a list of either: one choice (n choices) per prompt, in order.
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's default for completions; 0 only with echo (prompt logprobs alone, as lm-eval asks).
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)  # the chosen token and the k most likely
    echo: bool = False  # the prompt's text (and, with logprobs, its tokens' logprobs) before the output
    add_special_tokens: bool = True  # vLLM's: text prompts are encoded with the tokenizer's special tokens
    best_of: int | None = None
    suffix: str | None = None


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
        return flat_message({"content": self.content}, 0)["content"]  # text parts joined, as vLLM


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict] | None = None  # [{"type": "function", "function": {"name", "description", "parameters"}}]
    tool_choice: str | dict | None = None  # "none" | "auto" | "required" | {"type": "function", "function": {...}}
    parallel_tool_calls: bool = True  # False: at most one call per response (OpenAI's field)
    # vLLM's chat-template fields: the template's generation prompt, continuing the last (assistant)
    # message instead, variables for the template (e.g. enable_thinking), and special tokens added
    # when encoding the rendered text (False, as vLLM: the template writes them).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool = False
    echo: bool = False  # vLLM's (the last message's text before the output): not supported
    chat_template: str | None = None  # vLLM refuses it without --trust-request-chat-template: so does jaxpaged
    documents: list | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    audio: dict | None = None
    prediction: dict | None = None

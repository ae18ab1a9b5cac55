"""What every endpoint does with a request: check it, submit it, stream or collect its outputs.

A request's life: validate (pydantic, then the limits this engine has) -> tokenize -> `submit`
-> wait until the engine thread admits it (or refuses it: 400) -> stream server-sent events, or
collect the final output. Whatever ends the response early (the client went away, an error), the
request is aborted in a `finally`, so its pages are freed before the engine's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxpaged.entrypoints.serve.bridge import EngineBridge, RequestStream, ServerOverloaded
from jaxpaged.entrypoints.serve.protocol import error_body
from jaxpaged.planner.request import SamplingParams

_DISCONNECT_POLL_S = 0.25  # non-streaming requests: how often to check whether the client is still there


@dataclasses.dataclass(frozen=True)
class ServerState:
    """What the handlers need, set once on `app.state.server` by `build_app`."""

    bridge: EngineBridge
    metrics: object  # ServerMetrics
    served_model_name: str
    limits: object = None  # limits.RequestLimits: what one request may ask (None: the defaults)
    # The LoRA adapters served, by name (serve/lora_routes.py); the load / unload routes change it.
    loras: dict = dataclasses.field(default_factory=dict)

    @property
    def tokenizer(self):
        return self.bridge.engine.tokenizer

    @property
    def config(self):
        return self.bridge.engine.config


def server_state(request: Request) -> ServerState:
    return request.app.state.server


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type_, self.param = status, message, type_, param


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, headers: dict | None = None) -> JSONResponse:
    """Every error response the server sends is built here; its `code` is the HTTP status, as vLLM's."""
    return JSONResponse(error_body(message, type_, param, status), status_code=status, headers=headers)


def check_model(state: ServerState, model: str | None):
    """The LoRARequest a request's `model` names (None: the base model); 404 for a name not served."""
    if model is not None and model in state.loras:
        return state.loras[model]
    if model is not None and model != state.served_model_name:
        raise APIError(404, f"model {model!r} is not served here; use {state.served_model_name!r} (GET /v1/models)",
                       param="model")


def check_unsupported(body, fields: dict) -> None:
    """400 naming the first field the client set that this server does not implement."""
    for name, unused in fields.items():
        value = getattr(body, name)
        if all(value != u for u in unused):
            raise APIError(400, f"{name}={value!r} is not supported by this server; leave it out", param=name)


def truncated_prompt(token_ids: list[int], body, state: ServerState) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: max_model_len's worth)."""
    k = body.truncate_prompt_tokens
    if k is None:
        return token_ids
    k = state.config.max_model_len if k == -1 else k
    if k == 0:
        raise APIError(400, "truncate_prompt_tokens=0 leaves no prompt; use >= 1, or -1 for max_model_len",
                       param="truncate_prompt_tokens")
    return token_ids[-k:]


def logit_bias_ids(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (JSON keys are strings) as {token id: bias}."""
    if logit_bias is None:
        return None
    if not all(-100 <= v <= 100 for v in logit_bias.values()):  # OpenAI's range
        raise APIError(400, "logit_bias values must be in [-100, 100]", param="logit_bias")
    try:
        return {int(k): v for k, v in logit_bias.items()}
    except ValueError:
        raise APIError(400, f"logit_bias keys must be token ids, got {list(logit_bias)[:5]}",
                       param="logit_bias") from None


# Request fields a model's generation_config may give defaults for (vLLM's server defaults).
DEFAULTABLE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                      "repetition_penalty")


def sampling_params(state: ServerState, body, num_prompt_tokens: int, max_tokens: int | None, logprobs: int | None,
                    prompt_param: str, prompt_logprobs: int | None = None,
                    structured_outputs=None) -> SamplingParams:
    max_model_len, max_num_seqs = state.config.max_model_len, state.config.max_num_seqs
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        raise APIError(400, "stream_options.continuous_usage_stats is not supported by this server; use "
                            "include_usage (usage in the last chunk)", param="stream_options")
    if num_prompt_tokens + 1 > max_model_len:
        raise APIError(400, f"the prompt has {num_prompt_tokens} tokens but max_model_len={max_model_len} "
                            "leaves no room for an output token; shorten the prompt", param=prompt_param)
    room = max_model_len - num_prompt_tokens
    defaults = state.bridge.engine.generation_defaults  # the model's generation_config (vLLM's "server default")
    # As vLLM's get_max_tokens: the request's (or the model's default) max_tokens, trimmed to the room
    # max_model_len leaves after the prompt.
    max_tokens = min(room, defaults.get("max_tokens", room) if max_tokens is None else max_tokens)
    if body.n > max_num_seqs:
        raise APIError(400, f"n={body.n} exceeds this server's max_num_seqs={max_num_seqs}; "
                            "ask for fewer samples", param="n")
    # Priority as in vLLM: the request's value, else the model's default, else the protocol's.
    given = body.model_fields_set
    sampling = {name: getattr(body, name) if name in given or name not in defaults else defaults[name]
                for name in DEFAULTABLE_FIELDS}
    try:
        return SamplingParams(
            **sampling, seed=body.seed, max_tokens=max_tokens, min_tokens=body.min_tokens, stop=body.stop or (),
            stop_token_ids=body.stop_token_ids or (), ignore_eos=body.ignore_eos, n=body.n, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=logit_bias_ids(body.logit_bias), allowed_token_ids=body.allowed_token_ids,
            structured_outputs=structured_outputs, include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens)
    except ValueError as err:  # SamplingParams' rules, one for every entry point ("seed=... must be ...")
        field = str(err).split("=", 1)[0]
        raise APIError(400, str(err), param=field if field.isidentifier() else None) from None


def base_request_id(request: Request, body_request_id: str | None) -> str:
    """vLLM's: the X-Request-Id header, else the body's request_id, else random. The response's id is
    "chatcmpl-" or "cmpl-" and this; /abort_requests names requests by it."""
    return request.headers.get("X-Request-Id") or body_request_id or uuid.uuid4().hex


async def start(state: ServerState, token_ids: list[int], params: SamplingParams,
                cache_salt: str | None, lora_request=None, external_ids: tuple[str, ...] = ()) -> RequestStream:
    if params.structured_outputs is not None:  # validated on a worker thread: never stalls the engine or the loop
        try:
            await asyncio.to_thread(state.bridge.validate_structured, params.structured_outputs)
        except ValueError as err:
            raise APIError(400, str(err), param="structured_outputs") from None
    try:
        stream = state.bridge.submit(token_ids, params, cache_salt=cache_salt, external_ids=external_ids,
                                     lora_request=lora_request)
    except ServerOverloaded as err:
        raise APIError(503, str(err), "server_overloaded") from None
    try:
        await stream.accepted()
    except ValueError as err:  # the engine refused it (bad token ids, can never fit, an invalid grammar)
        message = str(err)
        param = "structured_outputs" if "structured_outputs" in message else "prompt" if "prompt" in message else None
        raise APIError(400, message, param=param) from None
    except BaseException:  # cancelled while waiting (client gone): do not leave the request running
        stream.close()
        raise
    return stream


async def collect(stream: RequestStream, request: Request):
    """The final output; aborts the request if the client disconnects while it runs."""
    final = None
    loop = asyncio.get_running_loop()
    next_check = loop.time() + _DISCONNECT_POLL_S
    try:
        while not stream.finished:
            try:
                final = await asyncio.wait_for(stream.__anext__(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                pass
            # Checked on a clock, not only when no output came: a running request has one every step.
            if loop.time() >= next_check:
                if await request.is_disconnected():
                    break
                next_check = loop.time() + _DISCONNECT_POLL_S
    finally:
        stream.close()
    return final


def usage(output) -> dict:
    num_prompt = len(output.prompt_token_ids)
    num_completion = sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class EngineStreamResponse(StreamingResponse):
    """Server-sent events of one request; aborts the request when the response ends early."""

    def __init__(self, content, request_stream):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.request_stream = request_stream  # a RequestStream, or several behind one close() (a prompt list)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.request_stream.close()  # a no-op when the request finished


def deltas_to_send(output, done: set[int]):
    """(completion, logprobs of its new tokens) for each sample of a streamed output with something
    to send: new text or tokens, or its finish, once (`done` collects the finished samples' indices)."""
    for c in output.outputs:
        if c.index in done or (not c.delta_token_ids and not c.delta_text and c.finish_reason is None):
            continue
        if c.finish_reason is not None:
            done.add(c.index)
        yield c, (c.logprobs[len(c.logprobs) - len(c.delta_token_ids):] if c.logprobs else [])  # {id: Logprob} each


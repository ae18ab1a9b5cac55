"""The HTTP routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/health`, `/metrics`.

A request's life: validate (pydantic, then the limits this engine has) -> tokenize -> `bridge.submit`
-> wait until the engine thread admits it (or refuses it: 400) -> stream server-sent events, or
collect the final output. Whatever ends the response early (the client went away, an error), the
request is aborted in a `finally`, so its pages are freed before the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jaxpaged.sampling_params import SamplingParams
from jaxpaged.serve.bridge import EngineBridge, RequestStream, ServerOverloaded
from jaxpaged.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body

_DISCONNECT_POLL_S = 0.25  # non-streaming requests: how often to check whether the client is still there
_MAX_SEED = 2**31 - 1


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type_, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    """Every error response the server sends is built here."""
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


class _Guard:
    """ASGI middleware: body size limit (413) and, with an API key, bearer auth on /v1 (401).

    Runs before FastAPI reads the body, so an unauthenticated or oversized request costs nothing.
    """

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"].startswith("/v1"):
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
                return await error_response(
                    401, "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                    "authentication_error", code="invalid_api_key")(scope, receive, send)
        too_large = error_response(
            413, f"request body is larger than {self.max_body_bytes} bytes; send a shorter prompt",
            code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await too_large(scope, receive, send)
        if length is None:  # chunked upload: count as it arrives
            received = 0

            async def counting_receive():
                nonlocal received
                message = await receive()
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge()
                return message

            try:
                return await self.app(scope, counting_receive, send)
            except _BodyTooLarge:
                return await too_large(scope, receive, send)
        return await self.app(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class _EngineStreamResponse(StreamingResponse):
    """Server-sent events of one request; aborts the request when the response ends early."""

    def __init__(self, content, request_stream: RequestStream):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.request_stream = request_stream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.request_stream.close()  # a no-op when the request finished


def build_app(bridge: EngineBridge, metrics, *, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = 1 << 20) -> _Guard:
    engine = bridge.engine
    tokenizer = engine.tokenizer
    max_model_len = engine.config.max_model_len
    app = FastAPI(title="jaxpaged", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_request, err: APIError):
        return error_response(err.status, err.message, err.type_, err.param, err.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, err: RequestValidationError):
        first = err.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON; send a JSON object", param=None)
        param = ".".join(loc) or None
        return error_response(400, f"{param or 'body'}: {first.get('msg')}; fix this field and retry",
                              param=param)

    @app.exception_handler(404)
    async def _not_found(request, _err):
        return error_response(404, f"no route {request.method} {request.url.path}; see GET /v1/models",
                              code="not_found")

    @app.exception_handler(405)
    async def _bad_method(request, _err):
        return error_response(405, f"{request.method} is not allowed on {request.url.path}")

    # ---------------------------------------------------------------- validation helpers

    def check_model(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise APIError(404, f"model {model!r} is not served here; use {served_model_name!r} (GET /v1/models)",
                           param="model", code="model_not_found")

    def sampling_params(body, num_prompt_tokens: int, max_tokens: int | None, logprobs: bool,
                        prompt_param: str) -> SamplingParams:
        if num_prompt_tokens + 1 > max_model_len:
            raise APIError(400, f"the prompt has {num_prompt_tokens} tokens but max_model_len={max_model_len} "
                                "leaves no room for an output token; shorten the prompt", param=prompt_param)
        room = max_model_len - num_prompt_tokens
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} plus the prompt's {num_prompt_tokens} tokens exceed "
                                f"max_model_len={max_model_len}; ask for at most {room} tokens", param="max_tokens")
        if body.n > engine.config.max_num_seqs:
            raise APIError(400, f"n={body.n} exceeds this server's max_num_seqs={engine.config.max_num_seqs}; "
                                "ask for fewer samples", param="n")
        if body.seed is not None and not 0 <= body.seed <= _MAX_SEED:
            raise APIError(400, f"seed={body.seed} must be in [0, {_MAX_SEED}]", param="seed")
        try:
            return SamplingParams(
                temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                seed=body.seed, max_tokens=max_tokens, min_tokens=body.min_tokens, stop=body.stop or (),
                stop_token_ids=body.stop_token_ids or (), ignore_eos=body.ignore_eos, n=body.n, logprobs=logprobs)
        except ValueError as err:
            raise APIError(400, str(err)) from None

    async def start(token_ids: list[int], params: SamplingParams, cache_salt: str | None) -> RequestStream:
        try:
            stream = bridge.submit(token_ids, params, cache_salt=cache_salt)
        except ServerOverloaded as err:
            raise APIError(503, str(err), "server_overloaded", code="queue_full") from None
        try:
            await stream.accepted()
        except ValueError as err:  # the engine refused the prompt (bad token ids, can never fit)
            raise APIError(400, str(err), param="prompt") from None
        except BaseException:  # cancelled while waiting (client gone): do not leave the request running
            stream.close()
            raise
        return stream

    async def collect(stream: RequestStream, request: Request):
        """The final output; aborts the request if the client disconnects while it runs."""
        final = None
        try:
            while not stream.finished:
                try:
                    final = await asyncio.wait_for(stream.__anext__(), _DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        break
        finally:
            stream.close()
        return final

    def usage(output) -> dict:
        num_prompt = len(output.prompt_token_ids)
        num_completion = sum(len(c.token_ids) for c in output.outputs)
        return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                "total_tokens": num_prompt + num_completion}

    def token_strings(token_ids) -> list[str]:
        return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    # ---------------------------------------------------------------- routes

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                            "owned_by": "jaxpaged", "max_model_len": max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"{len(prompt)} prompts in one request; send one prompt per request",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt is empty; send some text", param="prompt")
            token_ids = tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        if body.logprobs is not None and body.logprobs > 1:
            raise APIError(400, f"logprobs={body.logprobs}: only the chosen token's log-probability is available; "
                                "use logprobs=0 or 1", param="logprobs")
        if body.echo:
            raise APIError(400, "echo is not supported; drop it", param="echo")
        params = sampling_params(body, len(token_ids), body.max_tokens, logprobs=body.logprobs is not None,
                                 prompt_param="prompt")
        stream = await start(token_ids, params, body.cache_salt)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs_of(token_ids, lps, text_offset0: int):
            if body.logprobs is None:
                return None
            tokens = token_strings(token_ids)
            offsets = list(_text_offsets([len(t) for t in tokens], text_offset0))
            return {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets,
                    "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps)] if body.logprobs else None}

        def chunk(choices, usage_=None):
            return {"id": rid, "object": "text_completion", "created": created, "model": served_model_name,
                    "choices": choices, **({"usage": usage_} if include_usage else {})}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            async def events():
                final, done = None, set()  # done: choices whose finish_reason was sent
                async for output in stream:
                    final = output
                    choices = [{"index": c.index, "text": c.delta_text, "finish_reason": c.finish_reason,
                                "logprobs": logprobs_of(c.delta_token_ids, new_lps, 0)}
                               for c, new_lps in _deltas_to_send(output, done)]
                    if choices:
                        yield sse(chunk(choices, None))
                if include_usage and final is not None:
                    yield sse(chunk([], usage(final)))
                yield "data: [DONE]\n\n"

            return _EngineStreamResponse(events(), stream)

        final = await collect(stream, request)
        if final is None or not final.finished:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return {
            "id": rid, "object": "text_completion", "created": created, "model": served_model_name,
            "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                         "logprobs": logprobs_of(c.token_ids, c.logprobs or [], 0)} for c in final.outputs],
            "usage": usage(final),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from None
        except Exception as err:  # the template raised (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected these messages: {err}", param="messages") from None
        token_ids = tokenizer.encode(text)
        if body.top_logprobs is not None and body.top_logprobs > 1:
            raise APIError(400, f"top_logprobs={body.top_logprobs}: only the chosen token's log-probability is "
                                "available; use top_logprobs=0 or 1", param="top_logprobs")
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = sampling_params(body, len(token_ids), max_tokens, logprobs=body.logprobs, prompt_param="messages")
        stream = await start(token_ids, params, body.cache_salt)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def logprobs_of(token_ids, lps):
            if not body.logprobs:
                return None
            content = []
            for token, lp in zip(token_strings(token_ids), lps):
                top = [{"token": token, "logprob": lp, "bytes": list(token.encode())}] if body.top_logprobs else []
                content.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": top})
            return {"content": content}

        def chunk(choices, usage_=None):
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": served_model_name,
                    "choices": choices, **({"usage": usage_} if include_usage else {})}

        if body.stream:
            async def events():
                yield sse(chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None} for j in range(body.n)]))
                final, done = None, set()  # done: choices whose finish_reason was sent
                async for output in stream:
                    final = output
                    choices = [{"index": c.index, "delta": {"content": c.delta_text} if c.delta_text else {},
                                "logprobs": logprobs_of(c.delta_token_ids, new_lps), "finish_reason": c.finish_reason}
                               for c, new_lps in _deltas_to_send(output, done)]
                    if choices:
                        yield sse(chunk(choices))
                if include_usage and final is not None:
                    yield sse(chunk([], usage(final)))
                yield "data: [DONE]\n\n"

            return _EngineStreamResponse(events(), stream)

        final = await collect(stream, request)
        if final is None or not final.finished:
            return Response(status_code=499)
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": served_model_name,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": logprobs_of(c.token_ids, c.logprobs or []), "finish_reason": c.finish_reason}
                        for c in final.outputs],
            "usage": usage(final),
        }

    return _Guard(app, api_key=api_key, max_body_bytes=max_body_bytes)


def _deltas_to_send(output, done: set[int]):
    """(completion, logprobs of its new tokens) for each sample of a streamed output with something
    to send: new text or tokens, or its finish, once (`done` collects the finished samples' indices)."""
    for c in output.outputs:
        if c.index in done or (not c.delta_token_ids and not c.delta_text and c.finish_reason is None):
            continue
        if c.finish_reason is not None:
            done.add(c.index)
        yield c, (c.logprobs[len(c.logprobs) - len(c.delta_token_ids):] if c.logprobs else [])


def _text_offsets(lengths: list[int], start: int) -> list[int]:
    """Character offset of each token's text: [start, start + len0, start + len0 + len1, ...]."""
    offsets, offset = [], start
    for n in lengths:
        offsets.append(offset)
        offset += n
    return offsets

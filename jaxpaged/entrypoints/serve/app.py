"""The FastAPI app: error handlers, the auth and body-size guard, and the routes of each endpoint.

    GET  /health, /metrics, /v1/models,
         /v1/models/{id}, /version, /ping  here
    POST /tokenize, /detokenize, /ping     here (vLLM's)
    POST /v1/completions                   completions.py
    POST /v1/chat/completions              chat.py
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   lora_routes.py

Handlers are module-level functions; what they share (the bridge to the engine, the metrics, the
served name) is one `ServerState` on `app.state.server`.
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, ConfigDict
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jaxpaged.entrypoints.serve import chat, completions, lora_routes, rl_routes
from jaxpaged.entrypoints.serve.bridge import EngineBridge
from jaxpaged.entrypoints.chat_prompts import check_template_kwargs
from jaxpaged.entrypoints.serve.common import APIError, ServerState, check_model, error_response, server_state
from jaxpaged.entrypoints.serve.protocol import ChatMessage
from jaxpaged.entrypoints.serve.tools import render_messages

router = APIRouter()


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus_metrics(request: Request):
    return Response(generate_latest(server_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping():
    """vLLM's (and SageMaker's) liveness probe."""
    return Response(status_code=200)


@router.get("/version")
async def version():
    from importlib.metadata import version as package_version

    return {"version": package_version("jaxpaged")}


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the template first."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    state = server_state(request)
    check_model(state, body.model)
    tokenizer = state.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send either 'prompt' (text) or 'messages' (a chat)", param="prompt")
    if body.prompt is not None:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        try:
            template_kwargs = check_template_kwargs(body.chat_template_kwargs)
        except ValueError as err:
            raise APIError(400, str(err), param="chat_template_kwargs") from None
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            text = render_messages(tokenizer, messages, None, "none", add_generation_prompt=body.add_generation_prompt,
                                   continue_final_message=body.continue_final_message, **template_kwargs)
        except Exception as err:  # noqa: BLE001 - a template error or a bad message: the client's to fix
            raise APIError(400, f"these messages cannot be rendered: {err}", param="messages") from None
        ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None  # vLLM's: the vocabulary's strings
    return {"count": len(ids), "max_model_len": state.config.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    state = server_state(request)
    check_model(state, body.model)
    vocab = state.bridge.engine.model_config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"tokens outside the vocabulary [0, {vocab}): {bad[:5]}", param="tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}


def _model_card(state) -> dict:
    return {"id": state.served_model_name, "object": "model", "created": 0, "owned_by": "jaxpaged",
            "max_model_len": state.config.max_model_len}


@router.get("/v1/models")
async def list_models(request: Request):
    state = server_state(request)
    base = _model_card(state)
    return {"object": "list", "data": [base, *lora_routes.model_cards(state, base)]}


@router.get("/v1/models/{model_id:path}")  # the openai client's models.retrieve; a served name may hold "/"
async def retrieve_model(model_id: str, request: Request):
    state = server_state(request)
    if check_model(state, model_id) is not None:  # a LoRA adapter
        return next(card for card in lora_routes.model_cards(state, _model_card(state)) if card["id"] == model_id)
    return _model_card(state)


async def _api_error(_request, err: APIError):
    return error_response(err.status, err.message, err.type_, err.param)


async def _validation_error(_request, err: RequestValidationError):
    first = err.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return error_response(400, "the request body is not valid JSON; send a JSON object", param=None)
    param = ".".join(loc) or None
    return error_response(400, f"{param or 'body'}: {first.get('msg')}; fix this field and retry", param=param)


async def _http_error(_request, err: StarletteHTTPException):
    """Any other HTTPException (FastAPI's own, e.g. a body it cannot decode) in OpenAI's shape."""
    if err.status_code == 400:
        return error_response(400, "the request body could not be read as JSON; send a UTF-8 JSON object")
    return error_response(err.status_code, str(err.detail), headers=err.headers)


async def _not_found(request, _err):
    return error_response(404, f"no route {request.method} {request.url.path}; see GET /v1/models")


async def _bad_method(request, _err):
    return error_response(405, f"{request.method} is not allowed on {request.url.path}")


def build_app(bridge: EngineBridge, metrics, *, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = 1 << 20, drain=None, limits=None, max_header_count: int = 256,
              max_header_bytes: int = 4 << 20, loras=()) -> "_Guard":
    app = FastAPI(title="jaxpaged", docs_url=None, redoc_url=None)
    app.state.server = ServerState(bridge=bridge, metrics=metrics, served_model_name=served_model_name, limits=limits,
                                   loras={lora.lora_name: lora for lora in loras})
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)  # after the two by status below
    app.add_exception_handler(404, _not_found)
    app.add_exception_handler(405, _bad_method)
    for module_router in (router, completions.router, chat.router):
        app.include_router(module_router)
    rl_routes.attach(app)  # vLLM's RL endpoints, with VLLM_SERVER_DEV_MODE=1
    lora_routes.attach(app)  # vLLM's adapter load / unload, with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
    return _Guard(app, api_key=api_key, max_body_bytes=max_body_bytes, drain=drain, max_header_count=max_header_count,
                  max_header_bytes=max_header_bytes)


# While the server drains (shutdown.py): probes answer 503 {"status": "draining"}, /metrics as usual,
# every other path 503 with Retry-After.
_PROBES = ("/health", "/ping")


class _Guard:
    """ASGI middleware: the drain (503), header count and size (431), body size limit (413) and, with an API key,
    bearer auth on /v1 (401).

    Runs before FastAPI reads the body, so an unauthenticated or oversized request costs nothing.
    """

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, drain=None, max_header_count: int = 256,
                 max_header_bytes: int = 4 << 20):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.max_header_count, self.max_header_bytes = max_header_count, max_header_bytes
        self.drain = drain  # shutdown.Drain, or None (no graceful shutdown)
        self._expected_authorization = None if api_key is None else f"Bearer {api_key}".encode("utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain is not None and self.drain.draining and scope["path"] != "/metrics":
            retry = {"Retry-After": str(self.drain.retry_after_s())}
            if scope["path"] in _PROBES:
                refusal = JSONResponse({"status": "draining"}, status_code=503, headers=retry)
            else:
                refusal = error_response(503, "the server is shutting down and admits no new request; retry "
                                              "on another replica", "server_draining", headers=retry)
            return await refusal(scope, receive, send)
        if len(scope["headers"]) > self.max_header_count:
            return await error_response(
                431, f"the request has {len(scope['headers'])} headers; this server takes at most "
                     f"{self.max_header_count} (--h11-max-header-count)")(scope, receive, send)
        # h11 bounds only the headers it must buffer across reads; one read (up to 64 KiB) can bring more.
        if (size := sum(len(name) + len(value) for name, value in scope["headers"])) > self.max_header_bytes:
            return await error_response(
                431, f"the request's headers are {size} bytes; this server takes at most {self.max_header_bytes} "
                     "(--h11-max-incomplete-event-size)")(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"].startswith("/v1"):
            # Constant time: how long the comparison takes says nothing of how much of the key matched.
            if not hmac.compare_digest(headers.get(b"authorization", b""), self._expected_authorization):
                return await error_response(
                    401, "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                    "authentication_error")(scope, receive, send)
        too_large = error_response(
            413, f"request body is larger than {self.max_body_bytes} bytes; send a shorter prompt")
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

"""The FastAPI app: error handlers, the auth and body-size guard, and the routes of each endpoint.

    GET  /health, /metrics, /v1/models,
         /v1/models/{id}                   here
    POST /v1/completions                   completions.py
    POST /v1/chat/completions              chat.py

Handlers are module-level functions; what they share (the bridge to the engine, the metrics, the
served name) is one `ServerState` on `app.state.server`.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jaxpaged.entrypoints.serve import chat, completions
from jaxpaged.entrypoints.serve.bridge import EngineBridge
from jaxpaged.entrypoints.serve.common import APIError, ServerState, check_model, error_response, server_state

router = APIRouter()


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus_metrics(request: Request):
    return Response(generate_latest(server_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _model_card(state) -> dict:
    return {"id": state.served_model_name, "object": "model", "created": 0, "owned_by": "jaxpaged",
            "max_model_len": state.config.max_model_len}


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [_model_card(server_state(request))]}


@router.get("/v1/models/{model_id:path}")  # the openai client's models.retrieve; a served name may hold "/"
async def retrieve_model(model_id: str, request: Request):
    state = server_state(request)
    check_model(state, model_id)
    return _model_card(state)


async def _api_error(_request, err: APIError):
    return error_response(err.status, err.message, err.type_, err.param, err.code)


async def _validation_error(_request, err: RequestValidationError):
    first = err.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return error_response(400, "the request body is not valid JSON; send a JSON object", param=None)
    param = ".".join(loc) or None
    return error_response(400, f"{param or 'body'}: {first.get('msg')}; fix this field and retry", param=param)


async def _not_found(request, _err):
    return error_response(404, f"no route {request.method} {request.url.path}; see GET /v1/models", code="not_found")


async def _bad_method(request, _err):
    return error_response(405, f"{request.method} is not allowed on {request.url.path}")


def build_app(bridge: EngineBridge, metrics, *, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = 1 << 20) -> "_Guard":
    app = FastAPI(title="jaxpaged", docs_url=None, redoc_url=None)
    app.state.server = ServerState(bridge=bridge, metrics=metrics, served_model_name=served_model_name)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(404, _not_found)
    app.add_exception_handler(405, _bad_method)
    for module_router in (router, completions.router, chat.router):
        app.include_router(module_router)
    return _Guard(app, api_key=api_key, max_body_bytes=max_body_bytes)


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

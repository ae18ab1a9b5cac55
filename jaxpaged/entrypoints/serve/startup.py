"""Readiness: the server listens at once and answers 503 until its engine is built and warmed up.

    python -m jaxpaged.serve ─► uvicorn listening, StartupGate in front
                              ├─ /health, /ping   503 {"status": "starting"}   (a readiness probe waits)
                              ├─ any other path   503 + Retry-After
                              └─ engine built and every step program compiled (warm-up) on a thread
                                 ─► the gate hands every request to the real app: /health 200

Kubernetes: point the readiness probe at /health; the liveness probe too, with an
initialDelaySeconds that covers loading and compiling. If the engine cannot be built the server
stops and the process exits 2 with the error.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from jaxpaged.entrypoints.serve.common import error_response

_PROBES = ("/health", "/ping")
_RETRY_AFTER_S = 5


class StartupGate:
    """ASGI app: 503 while starting, then the served app (`open(app)`)."""

    def __init__(self):
        self.app = None  # the served app once ready

    def open(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":  # the served app has nothing to start or stop: acknowledged here
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]  # "startup" | "shutdown"
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if self.app is not None:
            return await self.app(scope, receive, send)
        retry = {"Retry-After": str(_RETRY_AFTER_S)}
        if scope["path"] in _PROBES:
            refusal = JSONResponse({"status": "starting"}, status_code=503, headers=retry)
        else:
            refusal = error_response(503, "the server is starting (loading the model and compiling); retry "
                                          "when GET /health answers 200", "server_starting", headers=retry)
        await refusal(scope, receive, send)

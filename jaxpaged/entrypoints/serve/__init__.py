"""The OpenAI-compatible server: `python -m jaxpaged.serve` (see cli.py).

    cli.py          python -m jaxpaged.serve: flags, the engine, uvicorn
    app.py          the FastAPI app: error handlers, auth and body-size guard, /health /metrics /v1/models
    completions.py  POST /v1/completions
    chat.py         POST /v1/chat/completions
    common.py       what every endpoint does: validate, submit, stream or collect
    protocol.py     request bodies (pydantic) and the one error body
    limits.py       what one request may ask (stop strings, structured-output spec, template kwargs)
    bridge.py       the engine thread and the queues between it and the handlers
    startup.py      readiness: 503 (/health "starting") until the engine is built and warm
    shutdown.py     graceful shutdown (--shutdown-timeout): drain on SIGTERM, then exit 0
    metrics.py      the Prometheus metrics, declared once
    lora_routes.py  LoRA adapters: --lora-modules, model=<adapter>, /v1/models, load / unload
"""

from __future__ import annotations


def build_server(engine, *, served_model_name: str, api_key: str | None = None, max_waiting_requests: int = 64,
                 max_body_bytes: int = 1 << 20, drain=None, request_timeout_s: float = 0.0, limits=None,
                 max_header_count: int = 256, max_header_bytes: int = 4 << 20, loras=()):
    """`(asgi_app, bridge)` over an engine. Call `bridge.start()` before serving, `bridge.shutdown()` after.
    `drain`: a shutdown.Drain the app consults (503 while draining), or None. `request_timeout_s`: a
    request in flight that long is aborted (0: no deadline). `limits`: a limits.RequestLimits (None:
    its defaults). `max_header_count`, `max_header_bytes`: requests with more headers, or more bytes of them, get 431
    (--h11-max-header-count, --h11-max-incomplete-event-size, which also bounds uvicorn's h11 buffer).
    `loras`: LoRARequests served by name from the start (already added to the engine)."""
    from jaxpaged.entrypoints.serve.app import build_app
    from jaxpaged.entrypoints.serve.bridge import EngineBridge
    from jaxpaged.entrypoints.serve.metrics import ServerMetrics

    metrics = ServerMetrics(page_size=engine.config.page_size, bytes_per_page=engine.kv_bytes_per_page,
                            model_name=served_model_name)
    bridge = EngineBridge(engine, max_waiting_requests=max_waiting_requests, metrics=metrics,
                          request_timeout_s=request_timeout_s)
    app = build_app(bridge, metrics, served_model_name=served_model_name, api_key=api_key,
                    max_body_bytes=max_body_bytes, drain=drain, limits=limits, max_header_count=max_header_count,
                    max_header_bytes=max_header_bytes, loras=loras)
    return app, bridge

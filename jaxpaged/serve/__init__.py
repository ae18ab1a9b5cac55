"""The OpenAI-compatible server: `python -m jaxpaged.serve` (see __main__.py).

    protocol.py  request bodies (pydantic) and the one error body
    routes.py    the FastAPI routes, auth and body-size guard
    bridge.py    the engine thread and the queues between it and the handlers
    metrics.py   the Prometheus metrics, declared once
"""

from __future__ import annotations


def build_server(engine, *, served_model_name: str, api_key: str | None = None, max_waiting_requests: int = 64,
                 max_body_bytes: int = 1 << 20):
    """`(asgi_app, bridge)` over an engine. Call `bridge.start()` before serving, `bridge.shutdown()` after."""
    from jaxpaged.model_runner import kv_cache_bytes_per_page
    from jaxpaged.serve.bridge import EngineBridge
    from jaxpaged.serve.metrics import ServerMetrics
    from jaxpaged.serve.routes import build_app

    metrics = ServerMetrics(page_size=engine.config.page_size,
                            bytes_per_page=kv_cache_bytes_per_page(engine.model_config, engine.config.page_size))
    bridge = EngineBridge(engine, max_waiting_requests=max_waiting_requests, metrics=metrics)
    app = build_app(bridge, metrics, served_model_name=served_model_name, api_key=api_key,
                    max_body_bytes=max_body_bytes)
    return app, bridge

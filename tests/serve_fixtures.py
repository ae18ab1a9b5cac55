"""The OpenAI server as the server tests start it: over an engine, on a free 127.0.0.1 port, in a thread."""

import contextlib
import socket
import threading
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(engine, uvicorn_kwargs: dict | None = None, **build_kwargs):
    """Yields `(base_url, bridge)` once `/health` answers (fails the test after 30 s); stops the server
    and the engine bridge on exit. `build_kwargs` go to `build_server` (served_model_name, api_key, ...),
    `uvicorn_kwargs` to uvicorn.Config."""
    import uvicorn

    from jaxpaged.entrypoints.serve import build_server

    app, bridge = build_server(engine, **build_kwargs)
    bridge.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           **(uvicorn_kwargs or {})))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            pytest.fail("the server did not come up in 30 s")
        yield base, bridge
    finally:
        server.should_exit = True
        thread.join(10)
        bridge.shutdown()

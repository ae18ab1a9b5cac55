"""Command line: `python -m jaxpaged.serve [--model M] [--host H] [--port P] [--api-key KEY] [engine flags]`.

With no arguments it serves the bundled SmolLM2-135M-Instruct on http://127.0.0.1:8000/v1; the engine
flags are those of `python -m jaxpaged.generate`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxpaged.entrypoints.cli import add_engine_args, engine_args

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxpaged.serve",
                                description="OpenAI-compatible HTTP server over the jaxpaged engine.")
    s = p.add_argument_group("server")
    s.add_argument("--model", default=None,
                   help="a .gguf file, a local Hugging Face directory or a hub id (default: bundled SmolLM2-135M-Instruct)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("JAXPAGED_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $JAXPAGED_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: the model's file or directory name)")
    s.add_argument("--max-waiting-requests", type=int, default=64,
                   help="requests that may wait beyond the running batch; past it: HTTP 503")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get HTTP 413")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(p)
    return p


def served_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_waiting_requests < 0:
        raise SystemExit("--max-waiting-requests must be >= 0")
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s %(levelname)s %(message)s", stream=sys.stderr)

    import uvicorn

    from jaxpaged.entrypoints.llm import LLM
    from jaxpaged.entrypoints.serve import build_server

    try:
        llm = LLM(args.model, **engine_args(args))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    app, bridge = build_server(
        llm.engine, served_model_name=args.served_model_name or served_name(args.model), api_key=args.api_key,
        max_waiting_requests=args.max_waiting_requests, max_body_bytes=args.max_body_bytes)
    bridge.start()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        bridge.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

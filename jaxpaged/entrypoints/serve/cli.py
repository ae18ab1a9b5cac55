"""Command line: `python -m jaxpaged.serve [--model M] [--host H] [--port P] [--api-key KEY] [engine flags]`.

With no arguments it serves the bundled SmolLM2-135M-Instruct on http://127.0.0.1:8000/v1; the engine
flags are those of `python -m jaxpaged.generate`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from jaxpaged.entrypoints.cli import add_engine_args, engine_args

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
H11_MAX_INCOMPLETE_EVENT_SIZE = 4 << 20  # vLLM's defaults (vllm/entrypoints/constants.py)
H11_MAX_HEADER_COUNT = 256


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
    s.add_argument("--h11-max-incomplete-event-size", type=int, default=H11_MAX_INCOMPLETE_EVENT_SIZE, metavar="BYTES",
                   help="vLLM's flag: the most bytes of a request's headers (and of uvicorn's h11 buffer); "
                        "past it HTTP 431")
    s.add_argument("--h11-max-header-count", type=int, default=H11_MAX_HEADER_COUNT,
                   help="vLLM's flag: requests with more headers get HTTP 431")
    s.add_argument("--shutdown-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="vLLM's flag: on SIGTERM / SIGINT stop admitting (503 with Retry-After; /health says "
                        "draining), let requests in flight finish for up to SECONDS, abort the rest, exit 0 "
                        "(default 0: no drain, uvicorn's own shutdown)")
    s.add_argument("--max-stop-strings", type=int, default=64, help="stop strings one request may give")
    s.add_argument("--max-stop-string-length", type=int, default=1024, metavar="CHARS",
                   help="characters of one stop string")
    s.add_argument("--max-structured-spec-bytes", type=int, default=64 << 10, metavar="BYTES",
                   help="JSON size of a request's structured_outputs, response_format or tools (compiled to a grammar)")
    s.add_argument("--max-chat-template-kwargs-bytes", type=int, default=16 << 10, metavar="BYTES",
                   help="JSON size of a request's chat_template_kwargs")
    s.add_argument("--request-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="a request still running SECONDS after it arrived is aborted (finish_reason abort) and "
                        "its KV pages freed (default 0: no deadline)")
    s.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters served as models (vLLM's flag; needs --enable-lora): name=path of a PEFT "
                        "directory, or a JSON object with name, path and base_model_name")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(p)
    return p


def served_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def configure_logging(level: str) -> None:
    """`--log-level` for jaxpaged's and uvicorn's own lines; everyone else (absl, orbax, jax's
    compiler and cache loggers: a dozen INFO lines per start) at WARNING."""
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("jaxpaged").setLevel(level.upper())


def startup_line(engine, served_model_name: str, url: str) -> str:
    """The server's configuration in one line (logged once at start)."""
    config, stats = engine.config, engine.stats()
    num_pages = stats["num_pages"]  # usable pages, over every replica
    kv_gib = num_pages * engine.kv_bytes_per_page / 2**30
    replicas = f", data_parallel_size={config.data_parallel_size}" if config.data_parallel_size > 1 else ""
    return (f"serving {served_model_name} at {url}: {num_pages} KV pages of {config.page_size} tokens "
            f"({kv_gib:.2f} GiB, kv_cache_dtype={config.kv_cache_dtype}), max_num_seqs={config.max_num_seqs}, "
            f"max_model_len={config.max_model_len}, max_num_batched_tokens={config.max_num_batched_tokens}, "
            f"backend={config.attention_backend}, dtype={config.dtype}, "
            f"tensor_parallel_size={config.tensor_parallel_size}{replicas}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_waiting_requests < 0:
        raise SystemExit("--max-waiting-requests must be >= 0")
    if not args.request_timeout >= 0:
        raise SystemExit(f"--request-timeout {args.request_timeout} must be >= 0 seconds (0: no deadline)")
    for flag, value in (("--h11-max-incomplete-event-size", args.h11_max_incomplete_event_size),
                        ("--h11-max-header-count", args.h11_max_header_count)):
        if value < 1:
            raise SystemExit(f"{flag} {value} must be >= 1")
    if not args.shutdown_timeout >= 0:
        raise SystemExit(f"--shutdown-timeout {args.shutdown_timeout} must be >= 0 seconds (0: no drain)")
    from jaxpaged.entrypoints.serve.limits import RequestLimits

    try:
        limits = RequestLimits(args.max_stop_strings, args.max_stop_string_length, args.max_structured_spec_bytes,
                               args.max_chat_template_kwargs_bytes)
    except ValueError as err:
        raise SystemExit(f"--{str(err).split('=')[0].replace('_', '-')}: {err}") from None
    from jaxpaged.entrypoints.serve.lora_routes import parse_lora_modules

    try:
        loras = parse_lora_modules(args.lora_modules)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    if loras and not args.enable_lora:
        raise SystemExit("--lora-modules needs --enable-lora")
    configure_logging(args.log_level)

    import uvicorn

    from jaxpaged.config import EngineConfig
    from jaxpaged.engine.build import build_engine
    from jaxpaged.entrypoints.serve import build_server
    from jaxpaged.entrypoints.serve.shutdown import Drain, DrainingServer
    from jaxpaged.entrypoints.serve.startup import StartupGate

    drain = Drain(args.shutdown_timeout)
    gate = StartupGate()  # /health 503 until the engine below is built and warm (startup.py)
    config = uvicorn.Config(gate, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, lifespan="off",
                            h11_max_incomplete_event_size=args.h11_max_incomplete_event_size)
    server = DrainingServer(config, drain=drain, bridge=None)
    failed: list[str] = []

    def start_engine() -> None:
        try:  # with no --max-num-seqs, the batch is sized from the KV pool (build_engine's docstring)
            engine = build_engine(args.model, EngineConfig(**engine_args(args)), max_num_seqs_from_pool=True)
            for lora in loras:  # read and checked now: a bad adapter stops the server (exit status 2)
                engine.add_lora(lora)
        except Exception as err:  # noqa: BLE001 - any failure to start: the server stops, exit status 2
            failed.append(" ".join(str(err).split()) or repr(err))
            server.should_exit = True
            return
        name = args.served_model_name or served_name(args.model)
        app, bridge = build_server(engine, served_model_name=name, api_key=args.api_key,
                                   max_waiting_requests=args.max_waiting_requests,
                                   max_body_bytes=args.max_body_bytes, drain=drain,
                                   request_timeout_s=args.request_timeout, limits=limits,
                                   max_header_count=args.h11_max_header_count,
                                   max_header_bytes=args.h11_max_incomplete_event_size, loras=loras)
        logging.getLogger("jaxpaged.serve").info(startup_line(engine, name, f"http://{args.host}:{args.port}/v1"))
        bridge.start()
        server.bridge = bridge
        gate.open(app)

    threading.Thread(target=start_engine, name="jaxpaged-startup", daemon=True).start()
    try:
        server.run()
    finally:
        if server.bridge is not None:
            server.bridge.shutdown()
    if failed:
        print("error: " + failed[0], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

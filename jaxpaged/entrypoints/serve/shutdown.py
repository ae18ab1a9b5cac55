"""Graceful shutdown, vLLM's `--shutdown-timeout SECONDS`: on SIGTERM (or SIGINT) drain, then exit 0.

    signal ─► draining: new API requests 503 + Retry-After; /health and /ping 503 {"status": "draining"}
           ─► requests in flight run on, for up to shutdown_timeout seconds
           ─► those still running then are aborted: each ends with finish_reason "abort" (a stream
              gets its last chunk and [DONE]; a whole response its body), pages freed
           ─► uvicorn stops (listening socket closed, the last responses sent); exit status 0

A second signal during the drain ends it at once (the rest aborted). shutdown_timeout 0 keeps
uvicorn's own handling: no drain, the connections closed within 5 s, the signal re-raised after.
Kubernetes: set terminationGracePeriodSeconds above shutdown_timeout + a few seconds.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import uvicorn

logger = logging.getLogger("jaxpaged.serve")

_ABORT_WAIT_S = 5.0  # after aborting the rest: how long the engine thread gets to end their streams


class Drain:
    """Whether the server is draining, and until when; read by the HTTP guard (app.py)."""

    def __init__(self, timeout_s: float):
        if not timeout_s >= 0:
            raise ValueError(f"shutdown_timeout={timeout_s!r} must be >= 0 seconds (0: no drain)")
        self.timeout_s = timeout_s
        self.deadline: float | None = None  # time.monotonic() when the drain stops waiting; None: serving
        self.hurry = threading.Event()  # set by a second signal: abort the rest now

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def begin(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s

    def retry_after_s(self) -> int:
        """Retry-After for refused requests: the seconds left in the drain (at least 1)."""
        left = 0.0 if self.deadline is None else self.deadline - time.monotonic()
        return max(1, math.ceil(left))


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose exit signal drains the engine bridge first (shutdown_timeout > 0)."""

    def __init__(self, config: uvicorn.Config, *, drain: Drain, bridge):
        super().__init__(config)
        self.drain = drain
        self.bridge = bridge  # the engine bridge; None while the server is still starting
        self.num_aborted: int | None = None  # requests the drain aborted, once it ended

    def handle_exit(self, sig, frame) -> None:
        if self.drain.timeout_s <= 0:
            return super().handle_exit(sig, frame)
        if self.bridge is None:  # still starting (startup.py): nothing to drain
            self.should_exit = True
            return
        if self.drain.draining:
            self.drain.hurry.set()
            return
        logger.info("signal %s: draining %d requests in flight for up to %.1f s (--shutdown-timeout)",
                    sig, self.bridge.num_in_flight, self.drain.timeout_s)
        self.drain.begin()
        threading.Thread(target=self._drain_then_exit, name="jaxpaged-drain", daemon=True).start()

    def _drain_then_exit(self) -> None:
        self.num_aborted = self.bridge.drain(self.drain.deadline, self.drain.hurry, abort_wait_s=_ABORT_WAIT_S)
        logger.info("drained: %d requests aborted at the deadline; stopping", self.num_aborted)
        self.should_exit = True  # not a captured signal: uvicorn does not re-raise it, the process exits 0

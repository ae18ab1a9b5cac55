"""The bridge between HTTP handlers (asyncio, many) and the engine (one thread, the only caller).

    handler ──submit()──► inbox (queue.SimpleQueue) ──► engine thread: add_request / abort_request
                                                                      step()
    handler ◄──RequestStream (asyncio.Queue) ◄── loop.call_soon_threadsafe ◄── RequestOutputs

Only the engine thread touches the engine, so the engine needs no lock (one exception, thread-safe:
`validate_structured`, a grammar's validation on a handler's worker thread). Commands reach it between
steps: a request submitted while a step runs joins the batch at the next step, and an abort (a
client that went away) frees its pages before the next step is planned.

Admission control: at most `max_num_seqs + max_waiting_requests` requests are in flight (submitted
and not yet finished, aborted or rejected); past that `submit` raises `ServerOverloaded` (HTTP 503)
instead of growing an unbounded backlog.

Deadline (`--request-timeout`): a request still in flight that long after its arrival is aborted
the same way, between two steps, and its pages freed.

Chosen aborts (/abort_requests, serve/rl_routes.py): each request is also known by its external ids,
vLLM's: `chatcmpl-<base>` for a chat completion, `cmpl-<base>-<i>` for a completion's i-th prompt and
`cmpl-<base>` for all of a completion's prompts (<base>: the X-Request-Id header, else the body's
request_id, else random). `abort_external(ids)` ends those requests as the drain does; unknown ids
are ignored, as vLLM ignores them.

Drain (graceful shutdown, shutdown.py): `drain(deadline)` waits for the requests in flight, then
aborts the rest on the engine thread; each of those gets a last output with finish_reason "abort",
so its handler ends the response as for any finished request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass

from jaxpaged.engine.outputs import CompletionOutput, RequestOutput
from jaxpaged.planner.request import SamplingParams

logger = logging.getLogger("jaxpaged.serve")

_ACCEPTED = object()  # first item of a stream whose request the engine admitted
_IDLE_WAIT_S = 0.05  # how long the idle engine thread blocks on the inbox before checking for shutdown


class ServerOverloaded(Exception):
    """The waiting queue is full."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    stream: RequestStream
    external_ids: tuple[str, ...] = ()  # the ids /abort_requests may name it by
    lora_request: object = None  # a LoRARequest (serve/lora_routes.py), None: the base model


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Run:
    """A function of the bridge run on the engine thread between two steps (serve/rl_routes.py)."""

    fn: object
    future: concurrent.futures.Future


@dataclass
class _AbortAll:
    """Abort every request in flight (the drain's deadline); `done` is set once they are retired."""

    done: threading.Event
    num_aborted: list[int]  # filled by the engine thread


@dataclass
class _Timing:
    """Per-request clock, kept by the engine thread for the latency histograms."""

    arrival: float
    first_token: float | None = None
    num_tokens: int = 0  # output tokens of the request's longest sample


class RequestStream:
    """What a handler reads: `await accepted()`, then `async for output in stream`, then `close()`."""

    def __init__(self, bridge: EngineBridge, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._bridge = bridge
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.last_output: RequestOutput | None = None  # engine thread: the last output pushed (for an abort)
        self.num_samples = 1  # engine thread: the request's n
        self.prompt_token_ids: list[int] = []
        self.external_ids: tuple[str, ...] = ()  # engine thread: set when admitted

    def push(self, item) -> None:  # engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the handler's event loop is closed (server shutting down): nobody listens
            pass

    async def accepted(self) -> None:
        """Returns once the engine admitted the request; raises its ValueError if it refused it."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        assert item is _ACCEPTED

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Aborts the request unless it finished: call it in a `finally` (client gone, handler error)."""
        if not self.finished:
            self.finished = True
            self._bridge.abort(self.request_id)


class EngineBridge:
    def __init__(self, engine, *, max_waiting_requests: int = 64, metrics=None, request_timeout_s: float = 0.0):
        if not request_timeout_s >= 0:
            raise ValueError(f"request_timeout={request_timeout_s!r} must be >= 0 seconds (0: no deadline)")
        self.engine = engine
        self.request_timeout_s = request_timeout_s  # 0: none; else in flight this long after arrival -> aborted
        self.num_timed_out = 0  # requests aborted at their deadline
        self.metrics = metrics
        self.capacity = engine.config.max_num_seqs + max_waiting_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_in_flight = 0  # guarded by _lock; submit() adds, the engine thread retires
        self._ids = itertools.count()
        # Engine thread only:
        self._streams: dict[str, RequestStream] = {}
        self._timings: dict[str, _Timing] = {}
        self._by_external: dict[str, set[str]] = {}  # external id -> the bridge's ids of its requests
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxpaged-engine", daemon=True)
        # /pause (serve/rl_routes.py): while paused nothing steps; requests that arrive wait here, unadded.
        self.paused = False
        self.held: list[_Add] = []

    # ---------------------------------------------------------------- handler side (any thread)

    def start(self) -> None:
        if self.metrics is not None:
            self.metrics.publish(self.engine)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return self._num_in_flight

    def validate_structured(self, spec) -> None:
        """ValueError if a request's structured_outputs spec is invalid. Handlers call it on a worker
        thread before `submit` (llguidance's validation of a large schema takes ~0.1 s: never on the
        engine thread or the event loop); the one engine call made off the engine thread, and
        thread-safe (engine/structured_requests.py)."""
        self.engine.structured.validate(spec)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, *, cache_salt: str | None = None,
               request_id: str | None = None, external_ids: tuple[str, ...] = (), lora_request=None) -> RequestStream:
        """Queues a request for the engine thread; raises ServerOverloaded when the queue is full."""
        with self._lock:
            if self._num_in_flight >= self.capacity:
                raise ServerOverloaded(
                    f"{self._num_in_flight} requests are in flight, the server's limit "
                    f"(max_num_seqs + --max-waiting-requests = {self.capacity}); retry later"
                )
            self._num_in_flight += 1
        request_id = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        self._inbox.put(_Add(request_id, list(prompt_token_ids), params, cache_salt, stream, tuple(external_ids),
                             lora_request))
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def run_on_engine(self, fn) -> concurrent.futures.Future:
        """`fn(bridge)` on the engine thread between two steps; its result (or exception) in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Run(fn, future))
        return future

    # ---------------------------------------------------------------- engine thread: pause (serve/rl_routes.py)

    def step_until_idle(self) -> None:
        """Steps until the engine holds no request, delivering every output (a draining /pause)."""
        while self.engine.has_unfinished_requests():
            self._step()

    def add_held(self) -> None:
        """Adds the requests that arrived while paused, in arrival order (/resume)."""
        held, self.held = self.held, []
        for command in held:
            self._add(command)

    def abort_external(self, external_ids) -> None:
        """Aborts the requests known by any of `external_ids`, held ones included (/abort_requests);
        each stream ends with finish_reason "abort"."""
        wanted = set(external_ids)
        held, kept = [], []
        for command in self.held:
            (held if wanted & set(command.external_ids) else kept).append(command)
        self.held = kept
        for command in held:  # admitted only to end like the rest
            self._add(command)
        self._abort_now(sorted({request_id for external_id in wanted
                                for request_id in self._by_external.get(external_id, ())}))

    def drain(self, deadline: float, hurry: threading.Event, *, abort_wait_s: float = 5.0) -> int:
        """Waits until no request is in flight, `deadline` (time.monotonic()) passes or `hurry` is set;
        then aborts the rest (each stream ends with finish_reason "abort"). Returns how many."""
        while self.num_in_flight and time.monotonic() < deadline and not hurry.is_set():
            hurry.wait(0.05)
        if not self.num_in_flight:
            return 0
        command = _AbortAll(threading.Event(), [])
        self._inbox.put(command)
        command.done.wait(abort_wait_s)
        return command.num_aborted[0] if command.num_aborted else 0

    # ---------------------------------------------------------------- engine thread

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain_inbox(block=self.paused or not engine.has_unfinished_requests())
            if self.paused or not engine.has_unfinished_requests():
                continue
            self._step()

    def _step(self) -> None:
        """One engine step, its outputs delivered to their streams."""
        engine = self.engine
        t0 = time.perf_counter()
        try:
            outputs = engine.step()
        except Exception as err:  # a bug: fail every request in flight, keep serving new ones
            logger.exception("engine step failed; aborting %d requests", len(self._streams))
            for request_id in list(self._streams):
                engine.abort_request(request_id)
                self._retire(request_id, RuntimeError(f"engine step failed: {err!r}"))
            return
        now = time.perf_counter()
        for output in outputs:
            self._deliver(output, now)
        if self.request_timeout_s:
            self._expire(now)
        if self.metrics is not None:
            self.metrics.step_done(now - t0)
            self.metrics.publish(engine, force=not engine.has_unfinished_requests())

    def _drain_inbox(self, *, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        changed = False
        while True:
            changed = True
            if isinstance(command, _Add):
                self.held.append(command) if self.paused else self._add(command)
            elif isinstance(command, _Run):
                try:
                    command.future.set_result(command.fn(self))
                except Exception as err:  # noqa: BLE001 - the handler that sent it answers
                    command.future.set_exception(err)
            elif isinstance(command, _AbortAll):
                command.num_aborted.append(self._abort_all())
                command.done.set()
            elif command.request_id in self._streams:  # an abort of a request still running (client gone)
                self.engine.abort_request(command.request_id)
                self._count_abort(command.request_id)
                self._retire(command.request_id, None)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
        if changed and self.metrics is not None:
            self.metrics.publish(self.engine)  # aborts free pages: show it even if no step follows

    def _add(self, command: _Add) -> None:
        try:
            adapter = {} if command.lora_request is None else {"lora_request": command.lora_request}
            self.engine.add_request(command.prompt_token_ids, command.params, request_id=command.request_id,
                                    cache_salt=command.cache_salt, **adapter)
        except ValueError as err:  # the engine can never serve it: the handler answers 400
            self._release()
            command.stream.push(err)
            return
        self._streams[command.request_id] = command.stream
        for external_id in command.external_ids:
            self._by_external.setdefault(external_id, set()).add(command.request_id)
        command.stream.num_samples, command.stream.prompt_token_ids = command.params.n, command.prompt_token_ids
        command.stream.external_ids = command.external_ids
        self._timings[command.request_id] = _Timing(arrival=time.perf_counter())
        if self.metrics is not None:
            self.metrics.add_prompt_tokens(len(command.prompt_token_ids))
        command.stream.push(_ACCEPTED)

    def _deliver(self, output: RequestOutput, now: float) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return  # aborted in the meantime
        stream.push(output)
        stream.last_output = output
        timing = self._timings[output.request_id]
        num_new = sum(len(c.delta_token_ids) for c in output.outputs)
        if num_new and timing.first_token is None:
            timing.first_token = now
            queued = output.metrics.time_in_queue if output.metrics is not None else None
            if self.metrics is not None and queued is not None:
                self.metrics.observe_queue_time(queued)
        timing.num_tokens = max((len(c.token_ids) for c in output.outputs), default=0)
        if self.metrics is not None:
            self.metrics.add_generation_tokens(num_new)
        if output.finished:
            if self.metrics is not None:
                self.metrics.request_done(timing.arrival, timing.first_token, now, timing.num_tokens,
                                          output.outputs[0].finish_reason if output.outputs else None)
            self._retire(output.request_id, None)

    def _expire(self, now: float) -> None:
        """Aborts every request past its deadline (each stream ends with finish_reason "abort")."""
        late = [request_id for request_id, timing in self._timings.items()
                if now - timing.arrival > self.request_timeout_s]
        for request_id in late:
            self.engine.abort_request(request_id)
            self._count_abort(request_id)  # before the client can see its end (and read /metrics)
            self._streams[request_id].push(_aborted_output(request_id, self._streams[request_id]))
            self._retire(request_id, None)
        self.num_timed_out += len(late)

    def _abort_all(self) -> int:
        """Aborts every request in flight; each stream gets a last output, finish_reason "abort"."""
        held, self.held = self.held, []  # arrived while paused (/pause): admitted only to end like the rest
        for command in held:
            self._add(command)
        return self._abort_now(list(self._streams))

    def _abort_now(self, request_ids: list[str]) -> int:
        """Aborts these requests (pages freed now); each stream gets a last output, finish_reason "abort"."""
        for request_id in request_ids:
            self.engine.abort_request(request_id)
            stream = self._streams[request_id]
            self._count_abort(request_id)
            stream.push(_aborted_output(request_id, stream))
            self._retire(request_id, None)
        return len(request_ids)

    def _count_abort(self, request_id: str) -> None:
        """A request the bridge ends (client gone, deadline, drain) counts in the latency histograms and
        in request_success{finished_reason="abort"} as one the engine finishes does: vLLM declares that
        series, and its open fix (vllm-project/vllm#55634) records aborts through the same accounting;
        a time without its timestamp (no first token yet) is left out of its histogram."""
        timing = self._timings.get(request_id)
        if self.metrics is not None and timing is not None:
            self.metrics.request_done(timing.arrival, timing.first_token, time.perf_counter(), timing.num_tokens,
                                      "abort")

    def _retire(self, request_id: str, error: BaseException | None) -> None:
        stream = self._streams.pop(request_id)
        self._timings.pop(request_id, None)
        for external_id in stream.external_ids:
            known = self._by_external.get(external_id)
            if known is not None:
                known.discard(request_id)
                if not known:
                    del self._by_external[external_id]
        if error is not None:
            stream.push(error)
        self._release()

    def _release(self) -> None:
        with self._lock:
            self._num_in_flight -= 1


def _aborted_output(request_id: str, stream: RequestStream) -> RequestOutput:
    """The final output of a request aborted by the drain: what it had, every unfinished sample
    finished with "abort" and nothing new in its deltas."""
    last = stream.last_output
    if last is None:  # nothing generated yet
        return RequestOutput(request_id, None, stream.prompt_token_ids,
                             [CompletionOutput(j, "", [], "abort") for j in range(stream.num_samples)])
    outputs = [c if c.finish_reason is not None else CompletionOutput(c.index, c.text, list(c.token_ids), "abort",
                                                                      c.logprobs)
               for c in last.outputs]
    return dataclasses.replace(last, outputs=outputs)

"""A soak under faults: rounds of concurrent requests against a running OpenAI server, with the
faults a production server meets, and what must hold after each round.

One round (`run_round`):

    t=0   num_streams requests open at once, each one of:
            well-formed  a streamed completion, a streamed chat or a plain completion: must end
                         answered (finish_reason stop / length) or cleanly aborted (finish_reason abort)
            disconnect   a stream the client closes after its first 1-3 chunks
            malformed    bad JSON, a bad parameter, an unknown field or model: must get a 4xx whose
                         body has OpenAI's shape with `code` the status
    events, in order, each once enough streams have had their first token and enough well-formed
    requests were answered (`SoakEvent.after_first_tokens`, `after_answered`):
            update_weights   new weights between two steps, requests in flight kept
            sleep_wake       pause(abort): what is in flight or waiting ends "abort"; sleep(level 1);
                             requests that arrive while asleep wait; wake_up; resume: they run
    end   every request answered, aborted, disconnected or refused; then no request in flight,
          none in the engine, no page in use (`Leaks`), and the process's RSS taken

`run_soak` runs rounds (the first warms up: compiles, allocator pools) and reports latency
percentiles over the well-formed requests answered, RSS after every round and the leaks.
benchmarks/bench_soak.py and tests/test_serve_soak.py both drive this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import httpx
import numpy as np

FINISHED = ("stop", "length")  # a well-formed request answered
ABORTED = "abort"  # a well-formed request ended by the server (abort, deadline, drain)


@dataclasses.dataclass(frozen=True)
class SoakPlan:
    num_streams: int = 64  # requests opened at once in a round (disconnects and malformed ones included)
    num_rounds: int = 3  # the first warms up; RSS growth is measured from the second to the last
    min_tokens: int = 4  # max_tokens of a well-formed request is drawn from [min_tokens, max_tokens]
    max_tokens: int = 24
    disconnect_fraction: float = 0.2  # of a round's requests: streams the client closes mid-way
    malformed_fraction: float = 0.15  # of a round's requests: bodies the server must refuse with a 4xx
    num_asleep_arrivals: int = 4  # well-formed requests sent while the engine sleeps
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens}, max_tokens={self.max_tokens}: need 1 <= min <= max")
        if self.num_rounds < 3:
            raise ValueError(f"num_rounds={self.num_rounds}: need >= 3 (a warm-up round, then two to compare RSS)")
        if not 0 <= self.disconnect_fraction + self.malformed_fraction <= 1:
            raise ValueError("disconnect_fraction + malformed_fraction must lie in [0, 1]")


@dataclasses.dataclass(frozen=True)
class SoakEvent:
    name: str
    run: Callable[[SoakRound], Awaitable[None]]
    after_first_tokens: int = 0  # fires once this many streams of the round have had their first token
    after_answered: int = 0  # ... and this many well-formed requests were answered


@dataclasses.dataclass
class Leaks:
    num_in_flight: int  # requests the server still counts (EngineBridge)
    num_requests: int  # requests in the engine
    num_used_pages: int  # KV pages not on the free list

    @property
    def none(self) -> bool:
        return self.num_in_flight == 0 and self.num_requests == 0 and self.num_used_pages == 0


@dataclasses.dataclass
class RoundResult:
    outcomes: Counter  # answered / aborted / disconnected / refused / failed -> count
    failures: list[str]  # one line per request that ended in none of the allowed ways
    latencies_s: list[float]  # well-formed requests answered: sent -> last byte
    ttfts_s: list[float]  # streamed ones among them: sent -> first token
    events: list[str]  # the events that ran, in order
    leaks: Leaks
    rss_bytes: int
    seconds: float


# ---------------------------------------------------------------- the requests

def _malformed(model: str, rng: random.Random) -> tuple[str, bytes | dict]:
    """A body the server must refuse: (path, raw bytes or a JSON object)."""
    choices = [
        ("/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": "hi", "max_tokens": 4'),  # cut short
        ("/v1/completions", b"\xff\xfe not json"),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": -3}),
        ("/v1/completions", {"model": model, "prompt": "hi", "temperature": -1.0}),
        ("/v1/completions", {"model": model, "prompt": "hi", "n": 10**6}),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": "many"}),
        ("/v1/completions", {"model": "not-" + model, "prompt": "hi"}),
        ("/v1/chat/completions", {"model": model, "messages": "not a list"}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 10**4,
                                  "logprobs": True}),
        ("/v1/completions", {"model": model, "prompt": "hi", "stop": ["x"] * 10**4}),
    ]
    return rng.choice(choices)


class SoakRound:
    """One round's requests, counters and events over one server (`run_round` drives it)."""

    def __init__(self, client: httpx.AsyncClient, model: str, plan: SoakPlan, rng: random.Random,
                 on_engine: Callable[[Callable], Awaitable]):
        self.client, self.model, self.plan, self.rng = client, model, plan, rng
        self.on_engine = on_engine  # runs fn(bridge) on the engine thread between two steps
        self.outcomes: Counter = Counter()
        self.failures: list[str] = []
        self.latencies_s: list[float] = []
        self.ttfts_s: list[float] = []
        self.num_first_tokens = 0
        self.waiting_for_progress = False  # an event waits for more first tokens or answers
        self.progress = asyncio.Condition()  # notified at every first token and every answer
        self.tasks: list[asyncio.Task] = []

    def spawn(self, kind: str) -> None:
        self.tasks.append(asyncio.create_task(self._request(kind, len(self.tasks))))

    async def _request(self, kind: str, index: int) -> None:
        try:
            outcome = await (self._refused() if kind == "malformed" else self._well_formed(kind, index))
        except Exception as err:  # noqa: BLE001 - a request that broke is one failure, the round goes on
            outcome = f"failed: {kind}: {type(err).__name__}: {err}"
        if outcome.startswith("failed"):
            self.failures.append(outcome)
            outcome = "failed"
        async with self.progress:
            self.outcomes[outcome] += 1
            self.progress.notify_all()

    async def _refused(self) -> str:
        path, body = _malformed(self.model, self.rng)
        kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        response = await self.client.post(path, **kwargs)
        error = response.json().get("error") if response.headers.get("content-type", "").startswith(
            "application/json") else None
        if not 400 <= response.status_code < 500 or not isinstance(error, dict) or error.get("code") != \
                response.status_code:
            return f"failed: malformed {body!r:.80} to {path}: {response.status_code} {response.text[:200]}"
        return "refused"

    async def _note_first_token(self) -> None:
        async with self.progress:
            self.num_first_tokens += 1
            self.progress.notify_all()

    async def wait_for(self, event: SoakEvent) -> None:
        self.waiting_for_progress = True
        async with self.progress:
            await self.progress.wait_for(lambda: self.num_first_tokens >= event.after_first_tokens
                                         and self.outcomes["answered"] >= event.after_answered)
        self.waiting_for_progress = False

    async def _well_formed(self, kind: str, index: int) -> str:
        max_tokens = self.rng.randint(self.plan.min_tokens, self.plan.max_tokens)
        chat = kind in ("chat", "disconnect") and index % 2 == 0
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": self.rng.choice([0.0, 0.8]),
                "seed": index}
        if chat:
            body["messages"] = [{"role": "user", "content": f"request {index}: tell a story"}]
        else:
            body["prompt"] = f"request {index}: once upon a time " * self.rng.randint(1, 4)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        sent = time.perf_counter()
        if kind == "plain":
            response = await self.client.post(path, json=body)
            if response.status_code != 200:
                return f"failed: {kind}: HTTP {response.status_code} {response.text[:200]}"
            reasons = [choice["finish_reason"] for choice in response.json()["choices"]]
            return self._ended(kind, reasons, sent, None)
        body["stream"] = True
        disconnect_after = self.rng.randint(1, 3) if kind == "disconnect" else None
        first = None
        reasons: list = []
        async with self.client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return f"failed: {kind}: HTTP {response.status_code} {(await response.aread())[:200]!r}"
            num_chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    return f"failed: {kind}: error event {chunk['error']}"
                num_chunks += 1
                if first is None:
                    first = time.perf_counter()
                    await self._note_first_token()
                reasons += [c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")]
                if disconnect_after is not None and num_chunks >= disconnect_after:
                    return "disconnected"  # leaving the block closes the connection mid-stream
        if disconnect_after is not None and reasons:
            return "disconnected"  # it ended before the client could leave: nothing to check
        return self._ended(kind, reasons, sent, first)

    def _ended(self, kind: str, reasons: list, sent: float, first: float | None) -> str:
        if not reasons:
            return f"failed: {kind}: the response ended without a finish_reason"
        if all(reason in FINISHED for reason in reasons):
            self.latencies_s.append(time.perf_counter() - sent)
            if first is not None:
                self.ttfts_s.append(first - sent)
            return "answered"
        if all(reason in FINISHED or reason == ABORTED for reason in reasons):
            return "aborted"
        return f"failed: {kind}: finish_reason {reasons}"


def _kinds(plan: SoakPlan, rng: random.Random) -> list[str]:
    num_disconnect = round(plan.num_streams * plan.disconnect_fraction)
    num_malformed = round(plan.num_streams * plan.malformed_fraction)
    num_well_formed = plan.num_streams - num_disconnect - num_malformed
    kinds = ["disconnect"] * num_disconnect + ["malformed"] * num_malformed + \
        [("stream", "chat", "plain")[i % 3] for i in range(num_well_formed)]
    rng.shuffle(kinds)
    return kinds


# ---------------------------------------------------------------- the faults

def update_weights_event(new_params: Callable[[], object], after_first_tokens: int = 8) -> SoakEvent:
    """New weights mid-round (`update_params(..., in_flight="keep")`); `new_params()` gives the tree."""

    async def run(round_: SoakRound) -> None:
        params = new_params()
        await round_.on_engine(lambda bridge: bridge.engine.update_params(params, in_flight="keep"))

    return SoakEvent("update_weights", run, after_first_tokens=after_first_tokens)


def sleep_wake_event(after_answered: int = 16) -> SoakEvent:
    """pause(mode="abort") -> sleep(1) -> requests arrive and wait -> wake_up -> resume, as an RL
    trainer drives vLLM between two rollouts (rl_control.py's pause modes)."""

    def pause_abort_sleep(bridge) -> None:
        bridge.paused = True  # nothing steps and new requests wait, unadded, until resume
        bridge.engine.abort_all_requests()
        bridge.step_until_idle()  # delivers the aborted requests' final outputs
        bridge.engine.sleep(1)

    def wake_resume(bridge) -> None:
        bridge.engine.wake_up()
        bridge.paused = False
        bridge.add_held()

    async def run(round_: SoakRound) -> None:
        await round_.on_engine(pause_abort_sleep)
        for _ in range(round_.plan.num_asleep_arrivals):
            round_.spawn("stream")
        await asyncio.sleep(0.2)  # they reach the bridge and wait there
        await round_.on_engine(wake_resume)

    return SoakEvent("sleep_wake", run, after_answered=after_answered)


# ---------------------------------------------------------------- a round, a soak

def rss_bytes() -> int:
    """This process's resident set size (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _leaks(bridge, on_engine, timeout_s: float) -> Leaks:
    """Waits (up to `timeout_s`) for the server to retire every request, then reads the engine."""
    deadline = time.monotonic() + timeout_s
    while bridge.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    stats = await on_engine(lambda b: b.engine.stats())
    return Leaks(bridge.num_in_flight, stats["num_requests"], stats["num_used_pages"])


async def run_round(base_url: str, model: str, bridge, plan: SoakPlan, events: list[SoakEvent],
                    round_idx: int, *, timeout_s: float = 300.0) -> RoundResult:
    """One round (the module's picture); `bridge` is the server's EngineBridge (in this process)."""
    rng = random.Random(plan.seed * 1000 + round_idx)

    async def on_engine(fn):
        return await asyncio.wrap_future(bridge.run_on_engine(fn))

    limits = httpx.Limits(max_connections=plan.num_streams + plan.num_asleep_arrivals + 8)
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        round_ = SoakRound(client, model, plan, rng, on_engine)
        for kind in _kinds(plan, rng):
            round_.spawn(kind)
        ran = []

        async def fire():
            for event in events:
                await round_.wait_for(event)
                await event.run(round_)
                ran.append(event.name)

        events_task = asyncio.create_task(fire())
        while True:  # events may add requests while the first ones run
            pending = [t for t in round_.tasks if not t.done()]
            if not pending and (events_task.done() or round_.waiting_for_progress):
                break  # with no request left, an event still waiting for progress never fires
            waiters = pending if events_task.done() else [*pending, events_task]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        events_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await events_task  # its exception, if any, is read below
        if not events_task.cancelled() and events_task.exception() is not None:
            err = events_task.exception()
            round_.failures.append(f"failed: event after {ran}: {type(err).__name__}: {err}")
    seconds = time.perf_counter() - started
    leaks = await _leaks(bridge, on_engine, timeout_s=30.0)
    gc.collect()
    return RoundResult(round_.outcomes, round_.failures, round_.latencies_s, round_.ttfts_s, ran, leaks,
                       rss_bytes(), seconds)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def run_soak(base_url: str, model: str, bridge, plan: SoakPlan, events: list[SoakEvent]) -> dict:
    """`plan.num_rounds` rounds; the report: per round its outcomes, events, leaks, RSS and latency
    percentiles; over the rounds after warm-up the latency percentiles, and the RSS growth from the
    first of them to the last."""
    rounds = [asyncio.run(run_round(base_url, model, bridge, plan, events, i)) for i in range(plan.num_rounds)]
    measured = rounds[1:]
    report = {
        "plan": dataclasses.asdict(plan),
        "rounds": [{"outcomes": dict(r.outcomes), "failures": r.failures, "events": r.events,
                    "leaks": dataclasses.asdict(r.leaks), "rss_mib": r.rss_bytes / 2**20, "seconds": r.seconds,
                    "latency_s": percentiles(r.latencies_s), "ttft_s": percentiles(r.ttfts_s)} for r in rounds],
        "latency_s": percentiles([x for r in measured for x in r.latencies_s]),  # after warm-up
        "ttft_s": percentiles([x for r in measured for x in r.ttfts_s]),
        "rss_growth": rounds[-1].rss_bytes / rounds[1].rss_bytes - 1.0,  # first round after warm-up -> last
        "num_failures": sum(len(r.failures) for r in rounds),
        "leaks_after_every_round": all(r.leaks.none for r in rounds),
    }
    return report


@contextlib.contextmanager
def serving(engine, **build_kwargs):
    """The OpenAI server over `engine` on a free 127.0.0.1 port, in a thread: yields `(base_url, bridge)`
    once /health answers; stops the server and the bridge on exit. `build_kwargs` go to build_server."""
    import uvicorn

    from jaxpaged.entrypoints.serve import build_server

    app, bridge = build_server(engine, **build_kwargs)
    bridge.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not answer /health within 60 s")
            time.sleep(0.1)
        yield base, bridge
    finally:
        server.should_exit = True
        thread.join(10)
        bridge.shutdown()

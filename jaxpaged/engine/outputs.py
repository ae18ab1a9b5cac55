"""What generation returns: vLLM's `RequestOutput` / `CompletionOutput` shapes, which users know.

A streaming engine hands out one `RequestOutput` per request per step. Copying each sample's whole
token list (and logprobs) into every snapshot would make a step cost O(generated tokens) per
request, ~10 µs at 4,000 tokens, 2.5 ms a step at 256 requests. The engine's lists only ever grow
(a token, once known, is never changed or removed), so a snapshot instead keeps the live list and
its length then, and slices it only when `token_ids` / `logprobs` is read (once; the slice is kept).
What a snapshot shows never changes afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpaged.sample.logprobs import Logprob  # its home is sample/logprobs.py; users import it from here too


# One position's log-probabilities: {token_id: Logprob}, the chosen (or prompt) token first, then the top k.
LogprobsDict = dict[int, Logprob]


class CompletionOutput:
    """One sample of a request (a request with `n=4` has four).

    index: which of the request's n samples; text: detokenized output so far (stop string and stop
    token excluded unless include_stop_str_in_output); token_ids: generated token ids so far;
    finish_reason: "stop" | "length" | "abort", None while running; stop_reason: the stop string or
    stop token id that ended it, None otherwise (eos included), as vLLM; logprobs: one `{token_id: Logprob}` per token if SamplingParams.logprobs
    (None otherwise), cumulative_logprob their chosen tokens' sum;
    delta_text / delta_token_ids: what was added since the previous streamed update.
    weight_versions: per token, the weight `version` (`update_params`) it was sampled under (None
    for outputs not made by the engine). Kept as runs [(first token index, version)], expanded on read.
    routed_experts: with the engine's `enable_return_routed_experts` (MoE), int16 numpy
    [len(prompt) + len(token_ids) - 1, num_layers, top_k]: each fed token's expert ids; else None.
    """

    __slots__ = ("index", "text", "finish_reason", "stop_reason", "delta_text", "delta_token_ids",
                 "_token_ids", "_num_tokens", "_logprobs", "_num_logprobs", "_version_runs", "routed_experts")

    def __init__(self, index: int, text: str, token_ids: list[int], finish_reason: str | None = None,
                 logprobs: list[LogprobsDict] | None = None, delta_text: str = "",
                 delta_token_ids: list[int] | None = None, stop_reason: str | int | None = None):
        self.index = index
        self.text = text
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.delta_text = delta_text
        self.delta_token_ids = [] if delta_token_ids is None else delta_token_ids
        self._token_ids, self._num_tokens = token_ids, None  # None: the list is this output's own
        self._logprobs, self._num_logprobs = logprobs, None
        self._version_runs = None
        self.routed_experts = None

    @classmethod
    def snapshot(cls, index: int, text: str, live_token_ids: list[int], finish_reason: str | None,
                 live_logprobs: list[LogprobsDict] | None, delta_text: str, delta_token_ids: list[int],
                 version_runs: tuple[tuple[int, int | str], ...] | None = None, routed_experts=None,
                 stop_reason: str | int | None = None) -> CompletionOutput:
        """An output over the engine's growing lists as they are now (their current lengths)."""
        out = cls.__new__(cls)
        out.index, out.text, out.finish_reason, out.stop_reason = index, text, finish_reason, stop_reason
        out.delta_text, out.delta_token_ids = delta_text, delta_token_ids
        out._token_ids, out._num_tokens = live_token_ids, len(live_token_ids)
        out._logprobs = live_logprobs
        out._num_logprobs = None if live_logprobs is None else len(live_logprobs)
        out._version_runs = version_runs
        out.routed_experts = routed_experts
        return out

    @property
    def token_ids(self) -> list[int]:
        if self._num_tokens is not None:  # first read of a snapshot: take its prefix of the live list
            self._token_ids, self._num_tokens = self._token_ids[: self._num_tokens], None
        return self._token_ids

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids, self._num_tokens = value, None

    @property
    def logprobs(self) -> list[LogprobsDict] | None:
        if self._num_logprobs is not None:
            self._logprobs, self._num_logprobs = self._logprobs[: self._num_logprobs], None
        return self._logprobs

    @logprobs.setter
    def logprobs(self, value: list[LogprobsDict] | None) -> None:
        self._logprobs, self._num_logprobs = value, None

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the chosen tokens' log-probabilities (None without logprobs), as vLLM reports it."""
        logprobs, token_ids = self.logprobs, self.token_ids
        if logprobs is None:
            return None
        return float(sum(entry[t].logprob for entry, t in zip(logprobs, token_ids)))

    @property
    def weight_versions(self) -> list[int | str] | None:
        """The weight version each token was sampled under (runs expanded; see the class doc)."""
        if self._version_runs is None:
            return None
        num_tokens = len(self.token_ids)
        versions: list[int | str] = []
        for i, (start, version) in enumerate(self._version_runs):
            end = self._version_runs[i + 1][0] if i + 1 < len(self._version_runs) else num_tokens
            versions += [version] * (min(end, num_tokens) - min(start, num_tokens))
        return versions

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _fields(self) -> tuple:
        return (self.index, self.text, self.token_ids, self.finish_reason, self.logprobs, self.delta_text,
                self.delta_token_ids)

    def __eq__(self, other) -> bool:
        return type(other) is CompletionOutput and self._fields() == other._fields()

    __hash__ = None  # mutable, like the dataclass it replaces

    def __repr__(self) -> str:
        names = ("index", "text", "token_ids", "finish_reason", "logprobs", "delta_text", "delta_token_ids")
        return "CompletionOutput(" + ", ".join(f"{n}={v!r}" for n, v in zip(names, self._fields())) + ")"


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """A request's times (vLLM's RequestMetrics names), `time.monotonic()` seconds."""

    arrival_time: float  # when the engine took the request
    first_scheduled_time: float | None  # its first admission to the running batch; None while it waits

    @property
    def time_in_queue(self) -> float | None:
        """Seconds it waited for its first admission (vLLM's request_queue_time)."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then {token_id: Logprob}
    # per prompt token (the token itself and the top k), once the whole prompt is computed; else None.
    prompt_logprobs: list[LogprobsDict | None] | None = None
    metrics: RequestMetrics | None = None  # arrival and first admission times

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

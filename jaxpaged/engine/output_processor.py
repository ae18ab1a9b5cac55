"""After a step's tokens land on the host: incremental detokenizing, stop strings, `RequestOutput`s.

    Scheduler.commit ──► (seq, token, sampler row) ──► OutputProcessor.process ──► RequestOutputs
                                                        per token: text, logprob
                                                        stop strings ──► sequences the engine finishes

A request is n samples; sample j is one `Sequence`. The engine calls `process` once per committed
step. A request without stop strings detokenizes lazily: its text is caught up (one decode call)
only when an output is made, so offline generation (`only_finished`) decodes each text once. Streaming never shows a stop string: while a sample runs, its last `max(len(s) for s in stop)
- 1` characters are held back (they may be the start of a stop string), as vLLM does; they are
released when it finishes. Every new character is searched: a stop string is found wherever it ends
in the text a token added, however long that text is.

Host only (no jax).
"""

from __future__ import annotations

import dataclasses

from jaxpaged.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxpaged.planner.request import SamplingParams, stop_prefix_len, stop_string_match
from jaxpaged.planner.sequence import Sequence, SequenceStatus
from jaxpaged.sample.logprobs import HostLogprobs, PromptChunk, TokenDecoder

FINISHED = SequenceStatus.FINISHED


@dataclasses.dataclass(slots=True)
class Sample:
    """One sample of a request: its sequence, its text so far, and what was already reported."""

    seq: Sequence
    detokenizer: object  # tokenizer.detokenizer(prompt): .step(token_id) -> str, .flush() -> str, .decode(ids)
    text: str = ""  # detokenized output of seq.output_token_ids[:num_decoded], cut before a stop string
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it (not eos)
    logprobs: list[dict] = dataclasses.field(default_factory=list)  # {token_id: Logprob} per token
    num_sent_tokens: int = 0  # tokens already reported (streaming deltas)
    num_sent_chars: int = 0  # characters of `text` already reported
    num_decoded: int = 0  # leading seq.output_token_ids the detokenizer has taken (`text` covers them)
    # [(first output token index, weight version)]: tokens from that index on were sampled under it.
    version_runs: list[tuple[int, int | str]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # sample j draws with planner.request.seed_for(seed, j)
    samples: list[Sample]  # starts with the parent alone; siblings join when it forks
    stops: tuple[str, ...]  # stop strings: while streaming, text that could still start one is held back
    num_finished: int = 0  # samples with a finish_reason
    # SamplingParams.prompt_logprobs: [None, {id: Logprob}, ...] filled chunk by chunk; shown once complete.
    prompt_logprobs: list | None = None
    prompt_logprobs_done: bool = False

    @property
    def seqs(self) -> list[Sequence]:
        return [s.seq for s in self.samples]

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.samples) == self.params.n


class OutputProcessor:
    """Owns every request's text state; turns committed tokens into `RequestOutput`s."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decode_token = TokenDecoder(tokenizer)
        self.requests: dict[str, RequestState] = {}
        self.owner: dict[int, tuple[RequestState, int]] = {}  # seq_id -> (request, sample index)
        self.routed_experts = None  # a RoutedExpertsRecorder when the engine returns routed experts

    def add_request(self, request_id: str, prompt: str | None, seq: Sequence, params: SamplingParams,
                    seed: int, weight_version: int | str = 0) -> RequestState:
        stops = params.stop or ()
        request = RequestState(
            request_id=request_id, prompt=prompt, prompt_token_ids=list(seq.prompt_token_ids), params=params,
            seed=seed, samples=[], stops=tuple(stops),
        )
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(request.prompt_token_ids)
            request.prompt_logprobs_done = len(request.prompt_token_ids) == 1
        self.requests[request_id] = request
        self.add_sample(request, seq)
        request.samples[0].version_runs.append((0, weight_version))
        return request

    def add_sample(self, request: RequestState, seq: Sequence) -> None:
        """`seq` becomes sample len(request.samples) of `request` (forks join in order)."""
        self.owner[seq.seq_id] = (request, len(request.samples))
        sample = Sample(seq, self._detokenizer(request.params, seq.prompt_token_ids))
        sample.num_decoded = len(seq.output_token_ids)  # its text starts with the tokens it gets from now on
        if request.samples:  # a fork: its tokens so far are its parent's (sample 0)
            sample.version_runs = list(request.samples[0].version_runs)
        request.samples.append(sample)

    def add_prompt_logprobs(self, logprobs: HostLogprobs, chunks: list[PromptChunk]) -> None:
        """Fills prompt positions from a step's per-token logprobs (a recomputed prompt refills the same values)."""
        for chunk in chunks:
            request = chunk.request
            if request.prompt_logprobs is None:
                continue
            prompt, k = request.prompt_token_ids, request.params.prompt_logprobs
            for i in range(chunk.count):
                position = chunk.first_position + 1 + i
                request.prompt_logprobs[position] = logprobs.entry(chunk.flat_start + i, prompt[position], k,
                                                                   self.decode_token)
            if chunk.first_position + chunk.count == len(prompt) - 1:
                request.prompt_logprobs_done = True

    def pop(self, request_id: str) -> RequestState | None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            for sample in request.samples:
                self.owner.pop(sample.seq.seq_id, None)
                if self.routed_experts is not None:
                    self.routed_experts.forget(sample.seq.seq_id)
        return request

    def process(self, appended, rows, logprobs, *, only_finished: bool = False):
        """Texts, logprobs and stop strings for one committed step.

        `appended` is `Scheduler.commit`'s [(seq, token_id)], `rows` their sampler rows, `logprobs`
        the step's per-row log-probabilities (None if no request asked). Returns the outputs of every
        request that moved (only finished ones if `only_finished`) and the sequences a stop string
        finished, for the engine to hand to `Scheduler.finish`; finished requests are retired.

        Only a request with stop strings needs its text on every token (to search it). Any other
        detokenizes lazily: its new tokens stay in `seq.output_token_ids` until an output is made
        (every step when streaming; once, when it finishes, under `only_finished`), then they are
        decoded in one call (`_catch_up`). Both give the text incremental decoding gives.
        """
        moved: dict[str, RequestState] = {}
        done: list[RequestState] = []  # requests whose last sample finished in this step
        stopped: list[Sequence] = []  # running sequences a stop string ended: the engine finishes them
        cut: list[Sequence] = []  # every sequence a stop string ended, finished already or not
        owners = self.owner
        for (seq, token_id), row in zip(appended, rows):
            owner = owners.get(seq.seq_id)
            if owner is None:
                continue  # its request was aborted
            request, j = owner
            if request.samples[j].finish_reason is not None:
                continue  # a stop string ended it at an earlier token of this step (a speculative run)
            params = request.params
            if params.logprobs is not None:
                request.samples[j].logprobs.append(logprobs.entry(row, token_id, params.logprobs, self.decode_token))
            if params.stop:
                self._step_with_stops(request, request.samples[j], seq, token_id, stopped, cut, done)
            elif seq.status is FINISHED:
                sample = request.samples[j]
                _catch_up(sample, _stopped_by_token(seq, params))
                self._finish(request, sample, seq.finish_reason, done, _stop_token(seq))
            if not only_finished:
                moved[request.request_id] = request
        # Tokens after a stop string (a speculative run) are not output, as in vLLM, even when the
        # scheduler finished the sequence at a later token of the run (length, eos).
        for seq in cut:
            request, j = owners[seq.seq_id]
            extra = len(seq.output_token_ids) - request.samples[j].num_decoded
            if extra > 0:
                del seq.output_token_ids[-extra:], seq.token_ids[-extra:]
        outputs = [self.make_output(r) for r in (done if only_finished else moved.values())]
        for request in done:  # retired after their last output is made
            self.pop(request.request_id)
        return outputs, stopped

    def start_weight_version(self, version: int | str) -> None:
        """Tokens sampled from now on belong to `version`: those still on the device (placeholders)
        were sampled under the previous weights, so each sample's new run starts after them."""
        for request in self.requests.values():
            for sample in request.samples:
                if sample.finish_reason is not None:
                    continue
                start = len(sample.seq.token_ids) - sample.seq.num_prompt_tokens
                runs = sample.version_runs
                if runs[-1][0] == start:  # no token under the previous version
                    runs.pop()
                if not runs or runs[-1][1] != version:
                    runs.append((start, version))

    def finish_all(self, reason: str) -> list[RequestOutput]:
        """Final outputs of every request, each unfinished sample finished with `reason` (the caller
        has finished their sequences in the scheduler); every request is retired."""
        outputs = []
        for request in list(self.requests.values()):
            for sample in request.samples:
                if sample.finish_reason is None:
                    _catch_up(sample)
                    sample.finish_reason = reason
            outputs.append(self.make_output(request))
            self.pop(request.request_id)
        return outputs

    def _step_with_stops(self, request: RequestState, sample: Sample, seq: Sequence, token_id: int,
                         stopped: list[Sequence], cut: list[Sequence], done: list[RequestState]) -> None:
        """One token of a request with stop strings: decode it now and search the new text."""
        params = request.params
        # A step may commit several tokens of a sequence (speculative decoding): only its last one
        # ends the sequence, however early `seq` shows the finish.
        ends = seq.status is FINISHED and sample.num_decoded + 1 == len(seq.output_token_ids)
        # A stop token's own text is left out unless include_stop_str_in_output (as vLLM).
        new_text = "" if ends and _stopped_by_token(seq, params) else sample.detokenizer.step(token_id)
        sample.num_decoded += 1  # this token's number among the outputs
        if ends:
            new_text += sample.detokenizer.flush()
        if new_text and sample.finish_reason is None:
            sample.text += new_text
            match = stop_string_match(sample.text, len(new_text), params, sample.num_decoded)
            if match is not None:
                stop, end = match
                sample.text = sample.text[:end]
                self._finish(request, sample, "stop", done, stop)
                cut.append(seq)
                if not seq.is_finished:
                    stopped.append(seq)
        if ends and sample.finish_reason is None:
            self._finish(request, sample, seq.finish_reason, done, _stop_token(seq))

    def _detokenizer(self, params: SamplingParams, prompt_token_ids):
        if not params.detokenize:
            return NO_TEXT
        if params.skip_special_tokens:
            return self.tokenizer.detokenizer(prompt_token_ids)
        return self.tokenizer.detokenizer(prompt_token_ids, skip_special_tokens=False)

    @staticmethod
    def _finish(request: RequestState, sample: Sample, reason: str, done: list[RequestState],
                stop_reason: str | int | None = None) -> None:
        sample.finish_reason = reason
        sample.stop_reason = stop_reason
        request.num_finished += 1
        if request.finished:
            done.append(request)

    def make_output(self, request: RequestState) -> RequestOutput:
        """A snapshot of `request` with the deltas since the previous one (and marks them sent)."""
        completions = []
        stops = request.stops
        want_logprobs = request.params.logprobs is not None
        for j, sample in enumerate(request.samples):
            output_ids = sample.seq.output_token_ids
            num_new = len(output_ids) - sample.num_decoded
            if num_new == 1:  # streaming: one new token per step (_catch_up, inlined)
                new_text = sample.detokenizer.step(output_ids[-1])
                sample.num_decoded += 1
                if new_text:
                    sample.text += new_text
            elif num_new:
                _catch_up(sample)
            text = sample.text
            if stops and sample.finish_reason is None and not request.params.include_stop_str_in_output:
                text = text[: len(text) - stop_prefix_len(text, stops)]  # what may be the start of a stop string
            routed = None if self.routed_experts is None else self.routed_experts.rows_of(
                sample.seq.seq_id, sample.seq.num_prompt_tokens + len(output_ids) - 1)
            # A snapshot over the live lists (they only grow): no copy of the tokens so far.
            completions.append(CompletionOutput.snapshot(
                j, text, output_ids, sample.finish_reason, sample.logprobs if want_logprobs else None,
                text[sample.num_sent_chars :], output_ids[sample.num_sent_tokens :], tuple(sample.version_runs),
                routed, sample.stop_reason,
            ))
            if len(text) > sample.num_sent_chars:
                sample.num_sent_chars = len(text)
            sample.num_sent_tokens = len(output_ids)
        first = request.samples[0].seq
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, completions, first.num_cached_tokens,
            request.prompt_logprobs if request.prompt_logprobs_done else None,
            RequestMetrics(first.arrival_time, first.first_scheduled_time),
        )


def _stopped_by_token(seq: Sequence, params: SamplingParams) -> bool:
    """Whether `seq` just ended on a stop token (eos or stop_token_ids) whose text stays out."""
    return seq.status is FINISHED and seq.finish_reason == "stop" and not params.include_stop_str_in_output


def _stop_token(seq: Sequence) -> int | None:
    """vLLM's stop_reason of a sequence the scheduler finished: its stop token id, None for eos."""
    if seq.finish_reason != "stop" or not seq.output_token_ids:
        return None
    token = seq.output_token_ids[-1]
    if token == seq.eos_token_id and not seq.sampling_params.ignore_eos:
        return None  # vLLM's check_stop tests eos first, even when it is in stop_token_ids too
    return token if token in seq.sampling_params.stop_token_ids else None


class _NoText:
    """The detokenizer of a request with detokenize=False: token ids only."""

    def step(self, token_id: int) -> str:
        return ""

    def decode(self, token_ids) -> str:
        return ""

    def flush(self) -> str:
        return ""


NO_TEXT = _NoText()


def _catch_up(sample: Sample, drop_last: bool = False) -> None:
    """Decodes the sample's tokens not yet in its text (a lazily detokenized one: no stop strings),
    without the last one if `drop_last` (a stop token); flushes the detokenizer once its sequence
    has finished."""
    token_ids = sample.seq.output_token_ids
    if sample.num_decoded != len(token_ids):
        new_ids = token_ids[sample.num_decoded : len(token_ids) - drop_last]
        decode = getattr(sample.detokenizer, "decode", None)  # a detokenizer with only step() works too
        sample.text += decode(new_ids) if decode is not None else "".join([sample.detokenizer.step(t) for t in new_ids])
        sample.num_decoded = len(token_ids)
    if sample.seq.status is FINISHED and sample.finish_reason is None:
        sample.text += sample.detokenizer.flush()

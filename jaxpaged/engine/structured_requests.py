"""The engine's side of structured outputs, a feature of the step (engine/features.py).

    add_request     ─► hold: the spec is validated now (ValueError), compiled on a worker thread;
                       the sequence enters the scheduler as WAITING_FOR_GRAMMAR (planned for nothing)
    before_schedule ─► compiled grammars: Scheduler.grammar_ready (the queue's FIFO from then on);
                       failed ones, and ones still compiling compile_timeout_s after their request
                       arrived: the request ends with finish_reason "abort". With nothing else to
                       run, waits for one grammar (at most until its timeout).
    sample_args     ─► step_mask: the step's int32 mask, or None when no row needs one (the sampler's
                       unmasked variant: an unconstrained step pays nothing); rows of greedy or
                       plain-temperature requests draw first and are checked after (matchers.py)
    after_commit    ─► release: matchers of finished sequences and templates of gone requests dropped;
                       the next masks start on a worker thread (matchers.py: prefetch)

Async stepping: the mask for a row's next token needs its last token, so a step with a constrained
row is committed in the engine step that dispatched it (as beam search steps are); a step without
one keeps the overlap. The constrained rows' overlap is the mask's: computed from commit k to the
sampling of step k + 1, beside the host's work and the device's forward pass. llguidance is imported on the first constrained request only.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

from jaxpaged.engine.features import StepFeature
from jaxpaged.planner.sequence import SequenceStatus

logger = logging.getLogger("jaxpaged")


class StructuredRequests(StepFeature):
    name = "structured"

    def __init__(self, tokenizer, vocab_size: int, scheduler, processor, *, strict_json: bool = True,
                 compile_timeout_s: float = 30.0):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.strict_json = strict_json  # objects admit only the keys they name (config.strict_json_schemas)
        self.scheduler, self.processor = scheduler, processor
        self.compiling: dict[str, tuple] = {}  # request_id -> (Future of the template, sequence, its spec, deadline)
        self.compile_timeout_s = compile_timeout_s  # EngineConfig.grammar_compile_timeout_s
        self.num_compile_timeouts = 0
        self.compiler = self.state = None  # built on first use
        self._start_lock = threading.Lock()  # `validate` may run on another thread than the engine's

    def validate(self, spec) -> None:
        """ValueError if `spec` is invalid. The one call other threads may make (the server's handlers,
        off the event loop): the engine thread's `hold` then skips the validation."""
        self._start()
        self.compiler.validate(spec)

    def _start(self) -> None:
        with self._start_lock:
            if self.compiler is None:
                self._build()

    def _build(self) -> None:
        from jaxpaged.structured.grammar import GrammarCompiler, make_ll_tokenizer
        from jaxpaged.structured.matchers import StructuredState

        backend = getattr(self.tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise ValueError(
                "structured_outputs needs the model's tokenizers.Tokenizer (a GGUF or Hugging Face tokenizer); "
                f"this engine's tokenizer is a {type(self.tokenizer).__name__}"
            )
        eos = self.tokenizer.eos_token_id
        self.compiler = GrammarCompiler(make_ll_tokenizer(backend, self.vocab_size, eos), strict_json=self.strict_json)
        self.state = StructuredState(self.vocab_size, eos)

    def __len__(self) -> int:
        """Requests waiting for a grammar plus matchers held: 0 when none is in flight (no leak)."""
        return len(self.compiling) + (len(self.state) if self.state is not None else 0)

    def hold(self, request_id: str, seq, spec) -> None:
        """Validates the spec (ValueError), starts its compile, adds the sequence to the scheduler as
        WAITING_FOR_GRAMMAR (ValueError, and nothing queued, if it could never run)."""
        self._start()
        future = self.compiler.submit(spec)
        seq.status = SequenceStatus.WAITING_FOR_GRAMMAR
        self.scheduler.add(seq)
        self.compiling[request_id] = (future, seq, spec, time.monotonic() + self.compile_timeout_s)

    def before_schedule(self, scheduler) -> list:
        """Sequences whose grammar compiled join the scheduler's queue; with nothing else to plan,
        waits for one grammar first. Returns outputs of requests whose grammar failed to compile
        (finish "abort")."""
        if not self.compiling:
            return []
        if not scheduler.num_schedulable:  # blocks until one is compiled, failed or out of time
            future, _, _, deadline = next(iter(self.compiling.values()))
            try:
                future.exception(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                pass
        failed = []
        now = time.monotonic()
        for request_id, (future, seq, spec, deadline) in list(self.compiling.items()):
            if not future.done():
                if now >= deadline:
                    del self.compiling[request_id]
                    self.compiler.forget(spec, future)  # a later request with this spec compiles it anew
                    self.num_compile_timeouts += 1
                    logger.warning("request %s: its grammar (%s) did not compile within grammar_compile_timeout_s="
                                   "%s; the request is aborted", request_id, spec.kind, self.compile_timeout_s)
                    failed.append(self._fail(request_id, seq))
                continue
            del self.compiling[request_id]
            try:
                self.state.templates[request_id] = future.result()
            except ValueError as e:
                logger.warning("request %s: %s", request_id, e)
                failed.append(self._fail(request_id, seq))
            else:
                scheduler.grammar_ready(seq)
        return [output for output in failed if output is not None]

    def _fail(self, request_id: str, seq):
        self.scheduler.abort(seq.seq_id)
        request = self.processor.requests.get(request_id)
        if request is None:
            return None
        request.samples[0].finish_reason = "abort"
        request.num_finished += 1
        output = self.processor.make_output(request)
        self.processor.pop(request_id)
        return output

    def abort(self, request_id: str) -> None:
        self.compiling.pop(request_id, None)

    def sample_args(self, out) -> dict:
        if self.state is None or not len(self.state):
            return {}
        return {"step_mask_fn": lambda entries, num_rows, first: self.step_mask(out.seqs, entries, num_rows, first)}

    def commits_at_once(self, step) -> bool:
        """A constrained row's next mask needs its token: the step commits in the engine step that dispatched it."""
        return step.constrained

    def after_commit(self, step) -> list:
        self.release()
        return []

    def step_mask(self, seqs, entries, num_rows: int, sample_first: bool):
        """The step's StepMask (structured/matchers.py), or None if no row has a grammar. `entries`:
        the sampler row of each scheduled sequence (a list of n rows at an n > 1 request's first
        token: each of them starts from the same state), None where it samples nothing.
        `sample_first`: the step's sampler can redraw (the plain one): rows of greedy or
        plain-temperature requests draw before their mask and are checked after."""
        if self.state is None or not len(self.state):
            return None
        from jaxpaged.structured.matchers import samples_first

        rows = []
        sample_first = sample_first and self.state.sample_first
        for seq, entry in zip(seqs, entries):
            if entry is None:
                continue
            request = self.processor.owner[seq.seq_id][0]
            if request.params.structured_outputs is not None:
                first = sample_first and samples_first(request.params)
                rows += [(row, seq, request.request_id, first)
                         for row in (entry if isinstance(entry, list) else [entry])]
        return self.state.step_mask(rows, num_rows) if rows else None

    def release(self, prefetch: bool = True) -> None:
        """At every commit: frees finished matchers, then starts the next step's masks (prefetch).
        At an abort (prefetch=False): frees them now, the engine may not step again."""
        if self.state is not None and len(self.state):
            self.state.release(self.processor.requests)
            if prefetch:
                self.state.prefetch()

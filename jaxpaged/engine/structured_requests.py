"""The engine's side of structured outputs: requests wait for their grammar, steps get their mask.

    add_request ─► hold: the spec is validated now (ValueError), compiled on a worker thread;
                   the request waits here, outside the scheduler, until its grammar is ready
    step()      ─► admit: ready requests go to the scheduler's waiting queue (nothing else waits)
    dispatch    ─► step_mask: the step's int32 mask, or None when no row needs one (the sampler's
                   unmasked variant: an unconstrained step pays nothing); rows of greedy or
                   plain-temperature requests draw first and are checked after (matchers.py)
    commit      ─► release: matchers of finished sequences and templates of gone requests dropped;
                   the next masks start on a worker thread (matchers.py: prefetch)

Async stepping: the mask for a row's next token needs its last token, so a step with a constrained
row is committed in the engine step that dispatched it (as beam search steps are); a step without
one keeps the overlap. The constrained rows' overlap is the mask's: computed from commit k to the
sampling of step k + 1, beside the host's work and the device's forward pass. llguidance is imported on the first constrained request only.
"""

from __future__ import annotations

import logging

from jaxpaged.planner.request import check_fits_pool, check_prompt_fits
from jaxpaged.planner.sequence import SequenceStatus

logger = logging.getLogger("jaxpaged")


class StructuredRequests:
    def __init__(self, engine):
        self.tokenizer, self.vocab_size = engine.tokenizer, engine.model_config.vocab_size
        self.scheduler, self.processor = engine.scheduler, engine.processor
        self.max_model_len = engine.config.max_model_len
        self.pending: dict[str, tuple] = {}  # request_id -> (Future of the template, sequence)
        self.compiler = self.state = None  # built on first use

    def _start(self) -> None:
        from jaxpaged.structured.grammar import GrammarCompiler, make_ll_tokenizer
        from jaxpaged.structured.matchers import StructuredState

        backend = getattr(self.tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise ValueError(
                "structured_outputs needs the model's tokenizers.Tokenizer (a GGUF or Hugging Face tokenizer); "
                f"this engine's tokenizer is a {type(self.tokenizer).__name__}"
            )
        eos = self.tokenizer.eos_token_id
        self.compiler = GrammarCompiler(make_ll_tokenizer(backend, self.vocab_size, eos))
        self.state = StructuredState(self.vocab_size, eos)

    def __len__(self) -> int:
        """Requests waiting for a grammar plus matchers held: 0 when none is in flight (no leak)."""
        return len(self.pending) + (len(self.state) if self.state is not None else 0)

    def hold(self, request_id: str, seq, spec) -> None:
        """Validates the spec and the request's fit (ValueError), starts its compile, holds the sequence."""
        if self.compiler is None:
            self._start()
        check_prompt_fits(len(seq.token_ids), self.max_model_len)
        check_fits_pool(min(seq.max_num_tokens, self.max_model_len), self.scheduler.block_manager.page_size,
                        self.scheduler.block_manager.num_pages - 1)
        self.pending[request_id] = (self.compiler.submit(spec), seq)

    def admit(self, wait: bool) -> list:
        """Moves requests whose grammar is ready into the scheduler; `wait`: block for one if nothing
        else can run. Returns outputs of requests whose grammar failed to compile (finish "abort")."""
        if wait and self.pending:
            next(iter(self.pending.values()))[0].exception()  # blocks until it is compiled (or failed)
        failed = []
        for request_id, (future, seq) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[request_id]
            try:
                self.state.templates[request_id] = future.result()
                self.scheduler.add(seq)
            except ValueError as e:
                logger.warning("request %s: %s", request_id, e)
                failed.append(self._fail(request_id, seq))
        return [output for output in failed if output is not None]

    def _fail(self, request_id: str, seq):
        request = self.processor.requests.get(request_id)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        if request is None:
            return None
        request.samples[0].finish_reason = "abort"
        request.num_finished += 1
        output = self.processor.make_output(request)
        self.processor.pop(request_id)
        return output

    def abort(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

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

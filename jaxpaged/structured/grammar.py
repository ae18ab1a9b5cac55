"""Grammar specs -> llguidance matchers: validation, a compile cache keyed by spec, worker threads.

    StructuredOutputsParams ──grammar_text──► llguidance grammar (JSON schema / regex / Lark)
        ──GrammarCompiler.submit (validates now: ValueError)──► Future[template LLMatcher]
        (built on a worker thread, cached by spec; each sequence deep-copies the template)

Why llguidance (DESIGN.md, "Structured outputs"): it has no hard dependencies (xgrammar requires
torch and triton, which jaxpaged must never need), computes a token bitmask into a numpy buffer,
and takes JSON schema, regex and Lark natively.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import queue
import threading

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark  # a submodule: `llguidance.gbnf_to_lark` is not the function
import numpy as np

from jaxpaged.planner.structured_params import StructuredOutputsParams

# JSON is written as Python's json.dumps writes it (`{"a": 1, "b": [2, 3]}`): no other whitespace,
# so a model cannot pad an object with newlines until max_tokens (vLLM's disable_any_whitespace).
# A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_JSON_OBJECT_SCHEMA = {"type": "object"}
MAX_CACHED_GRAMMARS = 256  # compiled templates kept; the oldest is dropped beyond this
MAX_ABANDONED_WORKERS = 4  # compile threads stuck past their timeout that may live at once (GrammarCompiler)
logger = logging.getLogger("jaxpaged")


def closed_objects(schema):
    """A copy of `schema` in which every object schema that names properties (or patternProperties)
    and says nothing of additionalProperties gets `"additionalProperties": false`: xgrammar's strict
    mode, vLLM's default. Nested schemas too (items, $defs, anyOf, ...); the input is not changed."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_objects(value) for key, value in schema.items()}
    if ("properties" in schema or "patternProperties" in schema) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def grammar_text(spec: StructuredOutputsParams, strict: bool = True) -> str:
    """The llguidance grammar for a spec; raises ValueError for a schema that is not JSON.
    `strict`: JSON schemas' objects admit only the keys they name (`closed_objects`)."""
    kind = spec.kind
    if kind == "json" or kind == "json_object":
        schema = spec.json if kind == "json" else _JSON_OBJECT_SCHEMA
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON ({e}); pass a JSON schema") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
        if strict:
            schema = closed_objects(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in spec.choice)  # Lark string literals
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    text = spec.grammar
    if "::=" in text:  # GBNF (llama.cpp / vLLM's EBNF): llguidance converts it to Lark
        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 - the converter raises plain Exceptions
            raise ValueError(f"structured_outputs.grammar is not valid GBNF: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def make_ll_tokenizer(backend, vocab_size: int, eos_token_id: int | None):
    """An llguidance tokenizer over a `tokenizers.Tokenizer`, with the model's vocabulary width
    (ids past the tokenizer's are never allowed) and its eos (allowed only where the grammar ends)."""
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_token_id)


class GrammarCompiler:
    """Compiles specs into template matchers on worker threads, once per distinct spec.

    A compile that outlives its request's timeout (`forget`) cannot be stopped; its worker is given
    up and a fresh one takes the queue, so one pathological grammar cannot hold up every later one.
    At most MAX_ABANDONED_WORKERS given-up workers live at once; past that the queue waits for one.
    """

    def __init__(self, ll_tokenizer, num_threads: int = 1, *, strict_json: bool = True):
        self.ll_tokenizer = ll_tokenizer
        self.strict_json = strict_json  # EngineConfig.structured_outputs_config (config.strict_json_schemas)
        self.vocab_size = ll_tokenizer.vocab_size
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (future, kind, grammar), or None: a worker stops
        self._cache: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        # Keys of specs `validate` passed (bounded, oldest dropped): `submit` does not validate them again.
        self._validated: dict[tuple[str, str], None] = {}
        self._abandoned: set[concurrent.futures.Future] = set()  # running compiles given up (guarded by _lock)
        self._num_workers = 0  # live worker threads, abandoned ones included (guarded by _lock)
        self.num_compiles = 0
        self.num_abandoned = 0  # workers given up so far
        for _ in range(num_threads):
            self._start_worker()

    def _start_worker(self) -> None:
        with self._lock:
            self._num_workers += 1
        threading.Thread(target=self._work, name="jaxpaged-grammar", daemon=True).start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, kind, grammar = job
            if not future.set_running_or_notify_cancel():
                continue  # forgotten before it started
            try:
                future.set_result(self._compile(kind, grammar))
            except BaseException as err:  # noqa: BLE001 - the request's before_schedule reads it
                future.set_exception(err)
            with self._lock:
                if future in self._abandoned:  # a replacement took the queue meanwhile: this worker ends
                    self._abandoned.discard(future)
                    self._num_workers -= 1
                    return
        with self._lock:
            self._num_workers -= 1

    def validate(self, spec: StructuredOutputsParams) -> None:
        """Raises ValueError for an invalid schema, regex or grammar (llguidance's validation: well under
        a millisecond for usual specs, ~0.1 s for a 60 KB schema). Any thread may call it: the server
        does, off the engine thread and the event loop, so `submit` on the engine thread skips it."""
        key = spec.key()
        with self._lock:
            if key in self._validated or key in self._cache:
                return
        self._check(grammar_text(spec, self.strict_json), spec.kind)
        with self._lock:
            self._validated[key] = None
            while len(self._validated) > MAX_CACHED_GRAMMARS:
                del self._validated[next(iter(self._validated))]

    def _check(self, grammar: str, kind: str) -> None:
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{kind} is invalid: {error.strip()}")

    def submit(self, spec: StructuredOutputsParams) -> concurrent.futures.Future:
        """Future of the spec's template matcher. Raises ValueError now for an invalid schema, regex
        or grammar, unless `validate` passed it already."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            validated = self._validated.pop(key, False) is None
        if future is not None:
            return future
        grammar = grammar_text(spec, self.strict_json)
        if not validated:
            self._check(grammar, spec.kind)
        future = concurrent.futures.Future()
        self._jobs.put((future, spec.kind, grammar))
        with self._lock:
            self._cache[key] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                del self._cache[next(iter(self._cache))]
        return future

    def forget(self, spec: StructuredOutputsParams, future: concurrent.futures.Future) -> None:
        """Drops `spec`'s cache entry if it is `future` (one that took too long: not kept for later
        requests). A compile not started is cancelled; one running is given up: its worker is
        replaced, and ends when the compile does (a thread cannot be stopped)."""
        with self._lock:
            if self._cache.get(spec.key()) is future:
                del self._cache[spec.key()]
            if future.cancel() or future.done() or future in self._abandoned:
                return
            if len(self._abandoned) >= MAX_ABANDONED_WORKERS:
                logger.warning("%d grammar compiles are stuck past their timeout; later grammars wait for one "
                               "of them", len(self._abandoned))
                return
            self._abandoned.add(future)
            self.num_abandoned += 1
        self._start_worker()

    def _compile(self, kind: str, grammar: str):
        """The template matcher (worker thread). Raises ValueError if it fails or can emit nothing."""
        self.num_compiles += 1
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind} is invalid: {matcher.get_error()}")
        mask = np.zeros((self.vocab_size + 31) // 32, np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if matcher.is_error() or not mask.any():  # llguidance errs when no token can start the output
            raise ValueError(f"structured_outputs.{kind} matches no output: no token can start it")
        matcher.reset()  # out of the error-free first-mask state: the template is clean
        return matcher

    def shutdown(self) -> None:
        """Cancels the compiles not started; each worker ends after its current one."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        with self._lock:
            num_workers = self._num_workers
        for _ in range(num_workers):
            self._jobs.put(None)
